"""A checkpoint's own multi-token-prediction (MTP) layers, read and run as a drafter's model (issue 33).

DeepSeek-V3 / V3.2 and GLM-4.5 / 4.7 ship ``num_nextn_predict_layers`` MTP layers after the last decoder layer, stored
as ``model.layers.{L + j}.*`` (L = num_hidden_layers): ``enorm`` and ``hnorm`` (RMSNorms), ``eh_proj`` ([hidden,
2 hidden]), a full decoder layer of the model's own kinds (MLA / GQA attention, a MoE FFN with routed and shared
experts: ``input_layernorm``, ``self_attn.*``, ``post_attention_layernorm``, ``mlp.*``) and ``shared_head.norm`` /
``shared_head.head`` (the release's copy of the model's lm_head; ``embed_tokens`` too, a copy of the model's).
Qwen3-Next / Qwen3.5 (``mtp_num_hidden_layers``) store the same parts as ``mtp.*`` - ``mtp.fc`` (eh_proj),
``mtp.pre_fc_norm_embedding`` / ``_hidden`` (enorm / hnorm), full-attention MoE layers ``mtp.layers.{j}``, ``mtp.norm``
(shared_head.norm) before the model's own lm_head -, every norm a (1 + weight) one: the architecture module's
``mtp_name`` maps our names onto theirs (``mtp_checkpoint``), and its ``MTP_CHAIN_NORMED`` says the next draft reads
the output after ``mtp.norm`` (vLLM's qwen3_next_mtp.py returns the normed states; its deepseek_mtp.py the states
before shared_head.norm).

The forward of MTP layer j at position i (vLLM's deepseek_mtp.py / glm4_moe_mtp.py, transformers' ``MtpLayer``):

    x   = eh_proj(concat(enorm(embed(t[i + 1])), hnorm(h[i])))     # the token after i, embeddings first
    x   = decoder_layer(x)       # attention over this layer's own KV cache of positions <= i
    out = x                      # chained as h[i] of the next draft (vLLM's, for DeepSeek: before shared_head.norm)
    logits = head(shared_head.norm(x))                                # the distribution of t[i + 2]

``h[i]`` of the first draft is the target's hidden state at position i after its final norm (what vLLM's model
forward returns and hands the MTP proposer; transformers' candidate generator takes ``hidden_states[-1]``, the
normed one too). RoPE is relative, so whether position i or i + 1 is rotated (vLLM: i, transformers: i + 1) gives
the same attention. vLLM zeroes the embedding at position 0; transformers does not, nor does this.

Conversion (runtime/model/convert.py) writes the MTP layers to the store's ``mtp/`` part: their routed experts a
store of their own (``mtp/manifest.json`` + blobs, one store layer per MTP layer, the main store's format) - tiered
like any layer's by their own ``ExpertStore`` -, their dense tensors to ``mtp/dense.safetensors``; the per-layer
``embed_tokens`` / ``shared_head.head`` only where they differ from the model's (the releases' are copies).
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch

from ..store import ExpertStore, Manifest
from .arch import module
from .config import MoEConfig
from .layers.cache import PagedKV, kv_block_size
from .layers.context import NO_HOOKS, StepHooks, build_context
from .layers.dense import Linear
from .layers.experts import ExpertExecutor
from .layers.kinds import attention_kind, cache_specs, kv_bytes_per_token
from .layers.moe_block import MoEBlock
from .layers.norm import RMSNorm
from .layers.rope import RotaryEmbedding
from .layers.weights import DenseTensors, layer_prefix, take, take_raw
from .residual import DecoderLayer

MTP_DIR = "mtp"                   # the store's MTP part: a store of the MTP layers' experts + their dense tensors
MTP_DENSE = "dense.safetensors"
# per-layer copies of the model's embedding and head: stored only where they differ from the model's
MTP_COPIES = ("embed_tokens.weight", "shared_head.head.weight")


def mtp_layers_of(cfg: MoEConfig, raw: dict) -> int:
    """MTP layers the checkpoint of config.json ``raw`` stores in a layout this reads (the architecture module's
    ``mtp_layers``); 0 for an architecture without one."""
    fn = getattr(module(cfg.model_type), "mtp_layers", None)
    return int(fn(raw)) if fn is not None else 0


def mtp_config(cfg: MoEConfig, n: int) -> MoEConfig:
    """The model's config extended by its ``n`` MTP layers (model layers L .. L + n - 1), which are its only MoE
    layers: the layer classes then build an MTP layer as any layer, and its experts are MoE layer j of the MTP store."""
    L = cfg.num_layers
    if cfg.norm_placement != "pre" or cfg.hc_mult or cfg.attn_res_block_layers:
        raise ValueError(f"{cfg.source}: MTP layers of {cfg.model_type} are not supported (the plain pre-norm residual "
                         f"stream is)")
    return dataclasses.replace(cfg, num_layers=L + n, moe_layers=[L + j for j in range(n)])


def mtp_dense_tensors(cfg: MoEConfig, n: int) -> dict:
    """Every dense tensor of the ``n`` MTP layers -> shape (the optional copies of MTP_COPIES not included)."""
    mcfg, H = mtp_config(cfg, n), cfg.hidden_size
    out = {}
    for i in mcfg.moe_layers:
        p = layer_prefix(i)
        out.update({p + "enorm.weight": (H,), p + "hnorm.weight": (H,), p + "eh_proj.weight": (H, 2 * H),
                    p + "shared_head.norm.weight": (H,)})
        out.update({p + nm: (H,) for nm in mcfg.layer_norms(i)})
        out.update(attention_kind(mcfg, i).tensors(mcfg, i))
        out.update(MoEBlock.tensors(mcfg, i))
    return out


def mtp_copies(cfg: MoEConfig, n: int) -> dict:
    """The MTP layers' own copies of the embedding / head -> shape (stored where they differ from the model's)."""
    V, H = cfg.vocab_size, cfg.hidden_size
    return {layer_prefix(cfg.num_layers + j) + c: (V, H) for j in range(n) for c in MTP_COPIES}


def mtp_renamer(cfg: MoEConfig):
    """Our name of a tensor -> the checkpoint's, for an architecture whose release stores its MTP layers elsewhere than
    ``model.layers.{L + j}.*`` (its module's ``mtp_name(j, part)``: Qwen3-Next's ``mtp.*``); None where it does not."""
    fn = getattr(module(cfg.model_type), "mtp_name", None)
    if fn is None:
        return None
    L = cfg.num_layers

    def rename(name: str) -> str:
        parts = name.split(".", 3)
        if name.startswith("model.layers.") and len(parts) == 4 and int(parts[2]) >= L:
            return fn(int(parts[2]) - L, parts[3])
        return name
    return rename


class RenamedCheckpoint:
    """A checkpoint (convert.Checkpoint) read by our names through ``rename`` (``has`` / ``get`` / ``stored``): the
    MTP layers of a release that names them its own way, for the readers convert has."""

    def __init__(self, ck, rename) -> None:
        self.ck, self.rename, self.dir = ck, rename, ck.dir

    def has(self, name: str) -> bool:
        return self.ck.has(self.rename(name))

    def get(self, name: str, shape=None):
        return self.ck.get(self.rename(name), shape)

    def stored(self, name: str) -> str:
        return self.ck.stored(self.rename(name))


def mtp_checkpoint(ck, cfg: MoEConfig):
    """``ck`` seen by our MTP names (itself where the release uses them)."""
    rename = mtp_renamer(cfg)
    return ck if rename is None else RenamedCheckpoint(ck, rename)


@dataclass(frozen=True)
class MTPStep:
    """One MTP forward's result."""
    hidden: torch.Tensor           # [tokens, hidden]: each row's output as the next draft reads it (chained as h)
    normed: torch.Tensor           # [tokens, hidden]: each row's output after shared_head.norm (what the head reads)
    logits: torch.Tensor           # [rows, vocab] float32: each chunk's last row (every row with every_token)


@dataclass
class MTPLayer:
    """MTP layer j: the input norms and projection, its decoder layer, its head's norm (and own copies)."""
    enorm: RMSNorm
    hnorm: RMSNorm
    eh_proj: Linear
    block: DecoderLayer
    head_norm: RMSNorm
    embed: "torch.Tensor | None"   # [vocab, hidden]: its own copy where it differs from the model's, else None
    head: "Linear | None"


class MTPModel:
    """The MTP layers of one model, computing with the target's embedding / head where they hold no copy of their
    own, their experts from ``experts`` (the MTP part's ExpertStore), over their own ``PagedKV`` (``init_kv``)."""

    def __init__(self, cfg: MoEConfig, n: int, dense: dict, experts, *, embed: torch.Tensor, head,
                 device: str = "cpu", dtype=torch.float32, host_act_quant: str = "none") -> None:
        """``embed``: the target's embedding [vocab, hidden]; ``head``: its logits function (hidden [rows, hidden]
        -> [rows, vocab]), e.g. ``MoEModel._logits``. Takes ownership of ``dense`` (the MTP tensors)."""
        self.cfg, self.n, self.device, self.dtype = mtp_config(cfg, n), n, device, dtype
        self.experts, self.target_embed, self.target_head = experts, embed, head
        if experts.m.num_layers != n:
            raise ValueError(f"MTP store holds {experts.m.num_layers} MoE layers, config.json describes {n} MTP layers")
        if cfg.norm_offset:       # Qwen3-Next's (1 + weight) RMSNorms, folded in once (as MoEModel does)
            for k in list(dense):
                if k.endswith(("layernorm.weight", "q_norm.weight", "k_norm.weight", "enorm.weight", "hnorm.weight",
                               "shared_head.norm.weight")):
                    dense[k] = dense[k].float() + cfg.norm_offset
        # the output the next draft reads: after shared_head.norm (Qwen3-Next, vLLM's qwen3_next_mtp) or before it
        self.chain_normed = bool(getattr(module(cfg.model_type), "MTP_CHAIN_NORMED", False))
        w = DenseTensors(dense, device, dtype, "none", host_act_quant)
        dense.clear()
        self.rope = RotaryEmbedding(self.cfg, device, dtype)
        self.executor = ExpertExecutor(self.cfg, experts, dtype, device, host_act_quant)
        self.layers = [self._build(j, w) for j in range(n)]
        self.gqa = any(m.block.attn.reads_rope_heads for m in self.layers)
        if len(w):
            raise ValueError(f"MTP tensors no MTP layer reads: {', '.join(sorted(w))}")
        self.kv = None

    def _build(self, j: int, w: dict) -> MTPLayer:
        cfg, i = self.cfg, self.cfg.moe_layers[j]
        p, eps = layer_prefix(i), cfg.rms_norm_eps
        attn = attention_kind(cfg, i)(cfg, i, w)
        ffn = MoEBlock(cfg, i, j, w, self.experts, self.executor)
        an, fn = [RMSNorm(take(w, p + nm), eps) for nm in cfg.layer_norm_names[:2]]
        head = Linear(take_raw(w, p + "shared_head.head.weight"), None, self.dtype) \
            if p + "shared_head.head.weight" in w else None
        embed = take(w, p + "embed_tokens.weight") if p + "embed_tokens.weight" in w else None
        return MTPLayer(RMSNorm(take(w, p + "enorm.weight"), eps), RMSNorm(take(w, p + "hnorm.weight"), eps),
                        Linear(take_raw(w, p + "eh_proj.weight"), None, self.dtype), DecoderLayer(i, attn, ffn, an, fn),
                        RMSNorm(take(w, p + "shared_head.norm.weight"), eps), embed, head)

    # -- the cache -------------------------------------------------------------------------------
    def cache_specs(self) -> dict:
        return cache_specs(self.cfg, self.cfg.moe_layers)

    def kv_bytes_per_token(self) -> int:
        return kv_bytes_per_token(self.cfg, self.dtype, self.cfg.moe_layers)

    def init_kv(self, tokens: int, block_size: "int | None" = None) -> PagedKV:
        """A cache of ``tokens`` positions for the MTP layers (their specs are per-token: MLA / GQA / DSA)."""
        block_size = block_size or kv_block_size(self.cfg)
        blocks = max(1, -(-int(tokens) // block_size))
        self.kv = PagedKV(self.cache_specs(), self.dtype, self.device, num_blocks=blocks, block_size=block_size)
        if self.kv.state_slots:
            raise ValueError("MTP layers with per-sequence state are not supported")
        return self.kv

    # -- the forward -----------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, seqs: list, chunks: list, hidden: torch.Tensor, depth: int = 0, hooks: StepHooks = NO_HOOKS,
                every_token: bool = False) -> MTPStep:
        """MTP layer ``depth % n`` over new positions of several sequences: chunks[j] the token ids t[i + 1] of
        seqs[j]'s new positions i (seq.length, ...), ``hidden`` [tokens, hidden] the h[i] of the same rows, in
        chunk order. Advances each sequence's length; returns every row's output and the logits of each chunk's
        last row (of every row with ``every_token``)."""
        if self.kv is None:
            raise ValueError("the MTP layers have no KV cache: init_kv makes it")
        flat = [t for c in chunks for t in c]
        if hidden.shape != (len(flat), self.cfg.hidden_size):
            raise ValueError(f"MTP forward: hidden states {tuple(hidden.shape)} for {len(flat)} tokens of hidden size "
                             f"{self.cfg.hidden_size}")
        self.kv.check(seqs, chunks)
        layer = self.layers[depth % self.n]
        ctx = build_context(seqs, chunks, self.kv, self.rope, rope_heads=self.gqa, device=self.device, hooks=hooks)
        ids = torch.tensor(flat, device=self.device)
        ctx.tokens = ids
        emb = (layer.embed if layer.embed is not None else self.target_embed)[ids]     # emb: [tokens, hidden]
        h = hidden.to(device=self.device, dtype=self.dtype)
        x = layer.eh_proj(torch.cat([layer.enorm(emb), layer.hnorm(h)], dim=-1))     # x: [tokens, hidden]
        x = layer.block.forward(x, ctx)
        for s, c in zip(seqs, chunks):
            s.length += len(c)
        normed = layer.head_norm(x)                                                   # normed: [tokens, hidden]
        rows = normed if every_token else normed[torch.tensor([b - 1 for _, b in ctx.spans], device=self.device)]
        logits = layer.head(rows).float() if layer.head is not None else self.target_head(rows)
        return MTPStep(hidden=normed if self.chain_normed else x, normed=normed, logits=logits)


def mtp_store_dir(store_dir: str) -> str:
    return os.path.join(store_dir, MTP_DIR)


def has_mtp(store_dir: str) -> bool:
    """Whether a converted store holds MTP layers (convert wrote its ``mtp/`` part)."""
    return os.path.exists(os.path.join(mtp_store_dir(store_dir), MTP_DENSE))


def load_mtp_dense(store_dir: str, cfg: MoEConfig, n: int) -> dict:
    """The MTP part's dense tensors, checked against what the MTP layers take."""
    from safetensors.torch import load_file
    path = os.path.join(mtp_store_dir(store_dir), MTP_DENSE)
    if not os.path.exists(path):
        raise ValueError(f"{store_dir}: no MTP layers in this store ({MTP_DIR}/{MTP_DENSE}): convert a checkpoint that "
                         f"ships them (num_nextn_predict_layers > 0) with this version")
    d = load_file(path)
    want = mtp_dense_tensors(cfg, n)
    optional = mtp_copies(cfg, n)
    for name, shape in {**want, **{k: v for k, v in optional.items() if k in d}}.items():
        if name not in d:
            raise ValueError(f"{path}: MTP tensor {name!r} is missing")
        if tuple(d[name].shape) != tuple(shape):
            raise ValueError(f"{path}: MTP tensor {name!r} has shape {tuple(d[name].shape)}, expected {tuple(shape)}")
    return d


def load_mtp(store_dir: str, target, *, device_fraction: float = 1.0, on_host: bool = False,
             host_act_quant: str = "none") -> "MTPModel":
    """The MTP layers of the store a ``MoEModel`` ``target`` was loaded from: their experts in an ExpertStore of
    their own - device slots for ``device_fraction`` of them (at least one token's top-k), host slots for every one
    (a catch-up chunk of a whole prompt routes to more experts than the device tier may hold: its waves need them
    all on the host; they are one layer's, 1 / L of the model's), computed from their host slots with ``on_host``
    (ExpertStore's cpu_experts over every MTP layer) -, computing with the target's embedding and head, device and
    dtype."""
    cfg = target.cfg
    sub = mtp_store_dir(store_dir)
    if not has_mtp(store_dir):
        raise ValueError(f"--speculative mtp: {store_dir} holds no MTP layers ({cfg.model_type} with "
                         f"num_nextn_predict_layers > 0, converted by this version, has them)")
    m = Manifest.read(sub)
    n = m.num_layers
    if target.embed is None:
        raise ValueError("--speculative mtp needs the model's embedding in this process (not a later pipeline stage)")
    dense = load_mtp_dense(store_dir, cfg, n)
    total = n * m.num_experts
    slots = min(total, max(cfg.top_k, int(device_fraction * total)))
    experts = ExpertStore(sub, device_budget=slots * m.blob_stride, host_budget=None, device=target.device,
                          min_experts_per_layer=cfg.top_k, cpu_experts=str(n) if on_host else "0")
    try:
        return MTPModel(cfg, n, dense, experts, embed=target.embed, head=target._logits, device=target.device,
                        dtype=target.dtype, host_act_quant=host_act_quant)
    except Exception:
        experts.close()
        raise
