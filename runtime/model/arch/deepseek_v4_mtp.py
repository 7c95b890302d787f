"""DeepSeek-V4's multi-token-prediction layers: what runtime/model/mtp.py runs for ``deepseek_v4`` (its ``MTP_SCHEME``).

The facts, from the release's own inference code (DeepSeek-V4-Flash ``inference/model.py``: ``MTPBlock``,
``Transformer``, ``ParallelHead.hc_head``) and vLLM's ``deepseek_v4_mtp.py`` (which runs the same layer as a drafter):

* config.json's ``num_nextn_predict_layers`` layers (transformers' ``DeepseekV4Config`` has the field; its model
  ignores ``mtp.*`` on load, ``_keys_to_ignore_on_load_unexpected``), stored as ``mtp.{j}.*``: ``enorm``, ``hnorm``,
  ``e_proj``, ``h_proj`` (two [hidden, hidden] Linears, not V3's fused ``eh_proj``), ``norm`` (the head's norm), the
  layer's own hyper-connection head ``hc_head_fn`` / ``hc_head_base`` / ``hc_head_scale``, and a whole V4 block
  (``attn.*``, ``attn_norm``, ``ffn.*`` with routed and shared experts, ``ffn_norm``, ``hc_attn_*``, ``hc_ffn_*``) -
  named like ``layers.{i}.*`` (``deepseek_v4.released_name``). The embedding and head are the model's
  (``MTPBlock.embed`` / ``.head`` are set to the ``Transformer``'s).
* The block is ``Block(n_layers + j)``: its attention kind is ``compress_ratios[n_layers + j]`` (the released
  config lists one more ratio than layers: 0, a sliding-window-only layer), its router scores (not hash: layer
  ``n_layers + j`` >= ``n_hash_layers``) with the correction bias.
* h[i] is the target's hyper-connected streams at position i after its last layer, before the final ``hc_head``
  collapse and norm ([tokens, hc_mult, hidden]; vLLM's target stashes them flat, [tokens, hc_mult * hidden]). The
  layer at position i, reading the token t[i + 1]::

      x      = e_proj(enorm(embed(t[i + 1])))[:, None] + h_proj(hnorm(h[i]))   # [tokens, hc_mult, hidden]: its
                                                                              # own streams (hnorm, h_proj per stream)
      x      = block(x)                                 # the V4 block over the streams (hc_attn / hc_ffn)
      out    = x                                        # chained as the next draft's h[i] (vLLM: before hc_head)
      logits = head(norm(hc_head(x)))                   # the layer's own hc_head, then its ``norm``

``attach`` sets the target's ``draft_rows`` to "streams": its forward then hands the drafter (StepHooks.token_hidden)
each row's streams after the last layer, flat, where other models hand their normed hidden states."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import MoEConfig
from ..hyper import HyperConnection, HyperHead
from ..layers.dense import Linear
from ..layers.norm import RMSNorm
from ..layers.weights import layer_prefix, take, take_raw
from ..residual import HyperResidual

# our names of the MTP layer's own parts (model.layers.{L + j}.<ours>) -> the release's (mtp.{j}.<theirs>); the
# embedding / head copies as vLLM's deepseek_v4_mtp.py load_weights names them (the release ships none: it shares
# the model's)
PARTS = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "e_proj.weight": "e_proj.weight",
         "h_proj.weight": "h_proj.weight", "shared_head.norm.weight": "norm.weight", "hc_head.hc_fn": "hc_head_fn",
         "hc_head.hc_base": "hc_head_base", "hc_head.hc_scale": "hc_head_scale",
         "embed_tokens.weight": "emb.tok_emb.weight", "shared_head.head.weight": "head.weight"}
RATIO_KINDS = {0: "sliding", 4: "csa", 128: "hca"}


def mtp_layers(d: dict, released_name) -> int:
    """MTP layers of config.json ``d`` this runs: ``num_nextn_predict_layers``, but 0 where the released
    ``compress_ratios`` gives an MTP layer a compressed attention (the releases' is 0, a window alone; its
    compressor state would need rolling back after each chain of drafts): its tensors are then reported unread."""
    n = int(d.get("num_nextn_predict_layers") or 0)
    L, ratios = int(d.get("num_hidden_layers") or 0), list(d.get("compress_ratios") or [])
    if any(r != 0 for r in ratios[L:L + n]):
        return 0
    return n


def mtp_name(j: int, part: str, released_name) -> str:
    """Our name of MTP layer j's tensor ``part`` (after ``model.layers.{L + j}.``) -> the release's ``mtp.{j}.*``."""
    if part in PARTS:
        return f"mtp.{j}.{PARTS[part]}"
    return f"mtp.{j}." + released_name(f"model.layers.0.{part}")[len("layers.0."):]


class V4MTP:
    """The hooks runtime/model/mtp.py dispatches to for ``deepseek_v4`` (``MTP_SCHEME``)."""

    @staticmethod
    def fields(cfg: MoEConfig, n: int) -> dict:
        """MoEConfig fields of the model extended by its n MTP layers: each a sliding-window layer (``mtp_layers``
        reads no other), none hash-routed."""
        return {"v4_kinds": list(cfg.v4_kinds) + ["sliding"] * n, "hash_layers": []}

    @staticmethod
    def hidden_width(cfg: MoEConfig) -> int:
        """Width of a row of h: the streams, flat."""
        return cfg.hc_mult * cfg.hidden_size

    @staticmethod
    def tensors(mcfg: MoEConfig, i: int) -> dict:
        """MTP layer i's own dense tensors (beside its attention, norms and MoE block) -> shape."""
        p, H, N = layer_prefix(i), mcfg.hidden_size, mcfg.hc_mult
        out = {p + "enorm.weight": (H,), p + "hnorm.weight": (H,), p + "e_proj.weight": (H, H),
               p + "h_proj.weight": (H, H), p + "shared_head.norm.weight": (H,)}
        out.update({p + "hc_head.hc_fn": (N, N * H), p + "hc_head.hc_base": (N,), p + "hc_head.hc_scale": (1,)})
        out.update(HyperConnection.tensors(mcfg, p + "attn_hc."))
        out.update(HyperConnection.tensors(mcfg, p + "ffn_hc."))
        return out

    @staticmethod
    def build(mcfg: MoEConfig, i: int, w: dict, block, embed, head, dtype) -> "V4MTPLayer":
        """MTP layer i from its tensors ``w`` (taken) around ``block`` (its attention, MoE and norms)."""
        p, eps = layer_prefix(i), mcfg.rms_norm_eps
        block.attn_hc = HyperConnection(mcfg, w, p + "attn_hc.")
        block.ffn_hc = HyperConnection(mcfg, w, p + "ffn_hc.")
        hc = {"model.hc_head." + k: take(w, p + "hc_head." + k) for k in ("hc_fn", "hc_base", "hc_scale")}
        return V4MTPLayer(RMSNorm(take(w, p + "enorm.weight"), eps), RMSNorm(take(w, p + "hnorm.weight"), eps),
                          Linear(take_raw(w, p + "e_proj.weight"), None, dtype),
                          Linear(take_raw(w, p + "h_proj.weight"), None, dtype), block, HyperResidual(mcfg, {}, False),
                          HyperHead(mcfg, hc), RMSNorm(take(w, p + "shared_head.norm.weight"), eps), embed, head,
                          mcfg.hc_mult)

    @staticmethod
    def attach(target) -> None:
        """The target hands its hyper-connected streams (flat) as the rows of h, not its normed hidden states."""
        target.draft_rows = "streams"


@dataclass
class V4MTPLayer:
    """One DeepSeek-V4 MTP layer: its input norms and projections, its block, its own streams' head and norm."""
    enorm: RMSNorm
    hnorm: RMSNorm
    e_proj: Linear
    h_proj: Linear
    block: object                      # a DecoderLayer with attn_hc / ffn_hc
    streams: HyperResidual             # runs the block over the streams (no head of its own)
    hc_head: HyperHead
    head_norm: RMSNorm
    embed: "torch.Tensor | None"
    head: "Linear | None"
    N: int

    def run(self, emb: torch.Tensor, h: torch.Tensor, ctx) -> "tuple[torch.Tensor, torch.Tensor]":
        """emb [tokens, hidden] (of t[i + 1]), h [tokens, N * hidden] (the streams at i) -> (the output streams, flat
        [tokens, N * hidden]: the next draft's h; the head's input [tokens, hidden] after norm)."""
        T, H = emb.shape
        hs = self.hnorm(h.reshape(T * self.N, H))                                  # hs: [tokens * N, hidden]
        x = self.h_proj(hs).view(T, self.N, H) + self.e_proj(self.enorm(emb))[:, None, :]   # x: [tokens, N, hidden]
        x = self.streams.run([self.block], x, ctx)
        return x.reshape(T, self.N * H), self.head_norm(self.hc_head(x))
