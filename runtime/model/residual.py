"""Decoder layers and the residual stream that carries them, each picked once when the model is built.

``DecoderLayer`` is one layer: an attention kind and an FFN kind (runtime/model/layers/), each after its
RMSNorm (or, OLMo-2's placement, each followed by it; MiniMax's: the stream carries the normed input).
``forward`` is its backend on the plain residual stream - ``composed`` (the sublayers' own ops) or the fused CPU
decode (layers/fused.py) - chosen at build.

A residual scheme says what flows between the layers and how a layer's sublayers read and add to it:

* ``PlainResidual`` - x [tokens, hidden]; x += attn(norm(x)); x += ffn(norm(x)) (every family but two);
* ``AttnResResidual`` - Block Attention Residuals (attn_res.py, Kimi K3): each sublayer reads a softmax
  mix of the block summaries by its pseudo-query;
* ``HyperResidual`` - DeepSeek-V4's hyper-connected streams [tokens, N, hidden] (hyper.py).

Each gives ``enter`` (the embeddings -> what flows), ``run`` (the layers of this stage over it), ``leave``
(what flows -> the final hidden state [tokens, hidden]) and ``wire_shape`` (what a pipeline stage
hands over). The model tests no architecture flag in its forward: it calls the scheme it was built with."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .attn_res import BlockAttnRes
from .config import MoEConfig
from .hyper import HyperConnection, HyperHead
from .layers.norm import RMSNorm
from .layers.weights import take


@dataclass
class DecoderLayer:
    """One decoder layer: attention (GQA, ring, MLA, linear or V4) and FFN (dense MLP or MoE block),
    each after its RMSNorm; with Block Attention Residuals, the pseudo-queries of its two sublayers; with
    hyper-connections, one around each sublayer."""
    index: int
    attn: object
    ffn: object
    input_norm: "RMSNorm | None"       # None: the attention is empty (layers/absent.py), and so is its norm
    post_norm: "RMSNorm | None"        # None: the FFN is empty
    attn_query: "torch.Tensor | None" = None
    mlp_query: "torch.Tensor | None" = None
    attn_hc: "HyperConnection | None" = None
    ffn_hc: "HyperConnection | None" = None
    forward: object = field(default=None, repr=False)   # the backend on the plain stream: composed or fused
    norm_after: bool = False   # OLMo-2 / FlexOlmo: input_norm / post_norm follow the attention / FFN instead
    out_norms: "tuple | None" = None   # sandwich norms (Kolibri): the norms after the attention and the FFN too
    scales: "tuple | None" = None      # normed residual (MiniMax): (alpha, beta) of the attention, then of the FFN

    def __post_init__(self) -> None:
        if self.norm_after:                  # the layer's composed ops, wherever they are asked for, are these
            self.composed = self.composed_post
        elif self.out_norms is not None:
            self.composed = self.composed_sandwich
        elif self.scales is not None:
            self.composed = self.composed_normed
        elif getattr(self.attn, "empty", False):   # one sublayer (Nemotron-H's unpaired blocks): the other is skipped
            self.composed = self.composed_ffn_only
        elif getattr(self.ffn, "empty", False):
            self.composed = self.composed_attn_only
        if self.forward is None:
            self.forward = self.composed

    def composed(self, x: torch.Tensor, ctx) -> torch.Tensor:
        """The plain residual stream through this layer's sublayers. x: [tokens, hidden]."""
        x = x + self.attn(self.input_norm(x), ctx)
        return x + self.ffn(self.post_norm(x), ctx)

    def composed_attn_only(self, x: torch.Tensor, ctx) -> torch.Tensor:
        """... with an empty FFN: x += attn(norm(x))."""
        return x + self.attn(self.input_norm(x), ctx)

    def composed_ffn_only(self, x: torch.Tensor, ctx) -> torch.Tensor:
        """... with an empty attention: x += ffn(norm(x))."""
        return x + self.ffn(self.post_norm(x), ctx)

    def composed_sandwich(self, x: torch.Tensor, ctx) -> torch.Tensor:
        """... with norms before and after each sublayer: x += norm'(attn(norm(x))); x += norm'(ffn(norm(x)))."""
        a, f = self.out_norms
        x = x + a(self.attn(self.input_norm(x), ctx))
        return x + f(self.ffn(self.post_norm(x), ctx))

    def composed_normed(self, x: torch.Tensor, ctx) -> torch.Tensor:
        """... carrying the normed input (MiniMax): h = norm(x); x = a h + b attn(h); the same around the FFN."""
        (a1, b1), (a2, b2) = self.scales
        h = self.input_norm(x)
        x = a1 * h + b1 * self.attn(h, ctx)
        h = self.post_norm(x)
        return a2 * h + b2 * self.ffn(h, ctx)

    def composed_post(self, x: torch.Tensor, ctx) -> torch.Tensor:
        """... with the norms after the sublayers: x += norm(attn(x)); x += norm(ffn(x))."""
        x = x + self.input_norm(self.attn(x, ctx))
        return x + self.post_norm(self.ffn(x, ctx))


class PlainResidual:
    fusable = True             # a layer may add its sublayers into x itself (the fused decode backend)
    step = None                # runs of fused layers in one kernel call (layers/fused_step.py), set at build

    def __init__(self, cfg: MoEConfig, w: dict, last: bool) -> None:
        self.H = cfg.hidden_size

    def wire_shape(self, T: int) -> tuple:
        return (T, self.H)

    def enter(self, emb: torch.Tensor) -> torch.Tensor:
        return emb                                                       # x: [tokens, hidden]

    def run(self, layers: list, x: torch.Tensor, ctx) -> torch.Tensor:
        if self.step is not None:
            return self.step.run(layers, x, ctx)
        for layer in layers:
            x = layer.forward(x, ctx)
        return x

    def leave(self, x: torch.Tensor) -> torch.Tensor:
        return x


class AttnResResidual(PlainResidual):
    """Block Attention Residuals: a forward's stream is a ``BlockAttnRes``; ``final_query`` reads the
    final hidden state out of it."""
    fusable = False

    def __init__(self, cfg: MoEConfig, w: dict, last: bool) -> None:
        super().__init__(cfg, w, last)
        self.block_layers, self.eps = cfg.attn_res_block_layers, cfg.rms_norm_eps
        self.final_query = take(w, "model.attn_res.final_query")

    def enter(self, emb: torch.Tensor) -> BlockAttnRes:
        return BlockAttnRes(emb, self.eps)

    def run(self, layers: list, res: BlockAttnRes, ctx) -> BlockAttnRes:
        for layer in layers:
            res.add(layer.attn(layer.input_norm(res.input(layer.attn_query)), ctx))
            res.add(layer.ffn(layer.post_norm(res.input(layer.mlp_query)), ctx))
            if (layer.index + 1) % self.block_layers == 0:
                res.end_block()
        return res

    def leave(self, res: BlockAttnRes) -> torch.Tensor:
        return res.input(self.final_query)


class HyperResidual(PlainResidual):
    """DeepSeek-V4's hyper-connections: ``hc_mult`` streams per token; each sublayer reads a mix of the
    streams and its output is spread back over them; the last stage's ``HyperHead`` collapses them."""
    fusable = False

    def __init__(self, cfg: MoEConfig, w: dict, last: bool) -> None:
        super().__init__(cfg, w, last)
        self.N = cfg.hyper.mult
        self.head = HyperHead(cfg, w) if last else None

    def wire_shape(self, T: int) -> tuple:
        return (T, self.N, self.H)

    def enter(self, emb: torch.Tensor) -> torch.Tensor:
        return emb[:, None, :].expand(-1, self.N, -1).contiguous()      # h: [tokens, streams, hidden]

    def run(self, layers: list, h: torch.Tensor, ctx) -> torch.Tensor:
        for layer in layers:
            h = layer.attn_hc.mix(h, lambda c: layer.attn(layer.input_norm(c), ctx))
            h = layer.ffn_hc.mix(h, lambda c: layer.ffn(layer.post_norm(c), ctx))
        return h

    def leave(self, h: torch.Tensor) -> torch.Tensor:
        return self.head(h)


def residual_kind(cfg: MoEConfig):
    """The residual scheme of a config: the one place the config picks it."""
    if cfg.hc_mult:
        return HyperResidual
    return AttnResResidual if cfg.attn_res_block_layers else PlainResidual


def residual_tensors(cfg: MoEConfig) -> dict:
    """The dense checkpoint tensors the residual scheme takes (outside the layers) -> shape."""
    if cfg.hc_mult:
        return HyperHead.tensors(cfg)
    return {"model.attn_res.final_query": (cfg.hidden_size,)} if cfg.attn_res_block_layers else {}


def layer_residual_tensors(cfg: MoEConfig, p: str) -> dict:
    """The residual scheme's tensors of the layer whose names start with ``p``."""
    if cfg.hc_mult:
        return {**HyperConnection.tensors(cfg, p + "attn_hc."), **HyperConnection.tensors(cfg, p + "ffn_hc.")}
    if cfg.attn_res_block_layers:
        return {p + "attn_res.attn_query": (cfg.hidden_size,), p + "attn_res.mlp_query": (cfg.hidden_size,)}
    return {}
