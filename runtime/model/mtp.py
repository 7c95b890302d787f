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

DeepSeek-V4 (``mtp.{j}.*``) has a layer of its own around its block - separate e_proj / h_proj, the target's
hyper-connected streams before its hc_head as h[i], the layer's own hc_head before its norm, the output streams
chained -: its module's ``MTP_SCHEME`` (``mtp_scheme``; runtime/model/arch/deepseek_v4_mtp.py), whose ``attach`` has the
target hand its streams as the rows of h (``MoEModel.draft_rows``); its window ring is per-sequence state, which ``save_state`` /
``restore_state`` put back after the chained drafts.

ERNIE 4.5 and MiMo-V2-Flash ship dense MTP layers (their modules' ``MTP_MOE = False``: a dense MLP of
intermediate_size, ``mtp_moe``): no store of experts then, the model's own MoE layers stay in the MTP config. An
architecture module's ``mtp_fields`` extends the MTP config (MiMo-V2-Flash: its MTP layers are sliding-window ones,
their rings rolled back like V4's), its ``mtp_stored`` reorders a released MTP tensor as convert_dense reorders the
model's (ERNIE's q / k rows).

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
from .layers.context import NO_HOOKS, StepHooks, build_context, rope_heads_of
from .layers.dense import Linear
from .layers.experts import ExpertExecutor
from .layers.kinds import attention_kind, cache_specs, kv_bytes_per_token
from .layers.mlp import mlp_kind
from .layers.moe_block import MoEBlock
from .layers.norm import RMSNorm
from .layers.rope import RotaryEmbedding
from .layers.weights import DenseTensors, layer_prefix, take, take_raw
from .moe import fold_scales
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


def mtp_scheme(cfg: MoEConfig):
    """An architecture's own MTP layer around its decoder layer (its module's ``MTP_SCHEME``: DeepSeek-V4's, over the
    hyper-connected streams - ``fields``, ``tensors``, ``hidden_width``, ``build``, ``attach``), or None: the layer
    above (eh_proj) on the plain residual stream."""
    return getattr(module(cfg.model_type), "MTP_SCHEME", None)


def mtp_moe(cfg: MoEConfig) -> bool:
    """Whether the architecture's MTP layers are MoE layers (DeepSeek-V3, GLM, Qwen3-Next) or dense ones (its module's
    ``MTP_MOE = False``: ERNIE 4.5's ``mtp_block``, MiMo-V2-Flash's ``mtp.layers``, of a dense MLP of
    intermediate_size)."""
    return bool(getattr(module(cfg.model_type), "MTP_MOE", True))


def mtp_ids(cfg: MoEConfig, n: int) -> list:
    """The model layer numbers of the ``n`` MTP layers of the model of ``cfg`` (L .. L + n - 1)."""
    return list(range(cfg.num_layers, cfg.num_layers + n))


def mtp_config(cfg: MoEConfig, n: int) -> MoEConfig:
    """The model's config extended by its ``n`` MTP layers (model layers L .. L + n - 1), which are its only MoE
    layers: the layer classes then build an MTP layer as any layer, and its experts are MoE layer j of the MTP store."""
    L = cfg.num_layers
    scheme = mtp_scheme(cfg)
    if cfg.norm_placement != "pre" or (cfg.hc_mult and scheme is None) or cfg.attn_res_block_layers:
        raise ValueError(f"{cfg.source}: MTP layers of {cfg.model_type} are not supported (the plain pre-norm residual "
                         f"stream is)")
    more = scheme.fields(cfg, n) if scheme is not None else {}     # e.g. the MTP layers' attention kinds
    fields = getattr(module(cfg.model_type), "mtp_fields", None)   # MiMo-V2-Flash: its MTP layers are sliding ones
    more.update(fields(cfg, n) if fields is not None else {})
    if not mtp_moe(cfg):     # dense MTP layers: the model's MoE layers stay its own (no MTP layer is one of them)
        if not cfg.dense_intermediate:
            raise ValueError(f"{cfg.source}: the dense MTP layers of {cfg.model_type} need intermediate_size")
        return dataclasses.replace(cfg, num_layers=L + n, **more)
    return dataclasses.replace(cfg, num_layers=L + n, moe_layers=[L + j for j in range(n)], **more)


def mtp_dense_tensors(cfg: MoEConfig, n: int) -> dict:
    """Every dense tensor of the ``n`` MTP layers -> shape (the optional copies of MTP_COPIES not included)."""
    mcfg, H = mtp_config(cfg, n), cfg.hidden_size
    scheme = mtp_scheme(cfg)
    out = {}
    for i in mtp_ids(cfg, n):
        p = layer_prefix(i)
        out.update({p + "enorm.weight": (H,), p + "hnorm.weight": (H,), p + "eh_proj.weight": (H, 2 * H),
                    p + "shared_head.norm.weight": (H,)} if scheme is None else scheme.tensors(mcfg, i))
        out.update({p + nm: (H,) for nm in mcfg.layer_norms(i)})
        out.update(attention_kind(mcfg, i).tensors(mcfg, i))
        out.update(MoEBlock.tensors(mcfg, i) if i in mcfg.moe_layers else
                   mlp_kind(mcfg).tensors(p + mcfg.mlp_prefix, mcfg.dense_intermediate, H))
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

    def __init__(self, ck, rename, convert=None) -> None:
        self.ck, self.rename, self.dir = ck, rename, ck.dir
        self.convert = convert          # (our name, tensor) -> the tensor as the store keeps it, or None

    def has(self, name: str) -> bool:
        return self.ck.has(self.rename(name))

    def get(self, name: str, shape=None):
        t = self.ck.get(self.rename(name), shape)
        return t if self.convert is None else self.convert(name, t)

    def stored(self, name: str) -> str:
        return self.ck.stored(self.rename(name))


def mtp_checkpoint(ck, cfg: MoEConfig):
    """``ck`` seen by our MTP names (itself where the release uses them)."""
    rename = mtp_renamer(cfg)
    fix = getattr(module(cfg.model_type), "mtp_stored", None)    # the release's tensor -> the store's (ERNIE: q/k rows)
    if rename is None and fix is None:
        return ck
    return RenamedCheckpoint(ck, rename or (lambda name: name), (lambda name, t: fix(cfg, name, t)) if fix else None)


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
        self.ids = mtp_ids(cfg, n)      # their model layer numbers
        if (experts is None) == mtp_moe(cfg):
            raise ValueError(f"MTP layers of {cfg.model_type}: " + ("their experts' store is missing" if experts is None
                             else "dense layers (no experts) given an expert store"))
        if experts is not None and experts.m.num_layers != n:
            raise ValueError(f"MTP store holds {experts.m.num_layers} MoE layers, config.json describes {n} MTP layers")
        if cfg.norm_offset:       # Qwen3-Next's (1 + weight) RMSNorms, folded in once (as MoEModel does)
            for k in list(dense):
                if k.endswith(("layernorm.weight", "q_norm.weight", "k_norm.weight", "enorm.weight", "hnorm.weight",
                               "shared_head.norm.weight")):
                    dense[k] = dense[k].float() + cfg.norm_offset
        # the output the next draft reads: after shared_head.norm (Qwen3-Next, vLLM's qwen3_next_mtp) or before it
        self.chain_normed = bool(getattr(module(cfg.model_type), "MTP_CHAIN_NORMED", False))
        # the architecture's own MTP layer (mtp_scheme), the width of a row of h it reads (DeepSeek-V4: the target's
        # streams, flat), and where the target's rows of h come from where they are not its normed hidden states
        self.scheme = mtp_scheme(cfg)
        self.hidden_width = self.scheme.hidden_width(cfg) if self.scheme is not None else cfg.hidden_size
        fold_scales(self.cfg, dense)   # MiMo-V2-Flash's value scale into v_proj, as MoEModel folds the model's
        w = DenseTensors(dense, device, dtype, "none", host_act_quant)
        dense.clear()
        self.rope = RotaryEmbedding(self.cfg, device, dtype)
        # a RoPE per layer type (Mellum, as MoEModel): a sliding MTP layer's own default RoPE of its theta
        self.window_rope = RotaryEmbedding(dataclasses.replace(self.cfg, rope_theta=cfg.sliding_rope_theta,
                                                               rope_scaling={}), device, dtype) \
            if cfg.sliding_rope_theta else None
        self.executor = None if experts is None else ExpertExecutor(self.cfg, experts, dtype, device, host_act_quant)
        self.layers = [self._build(j, w) for j in range(n)]
        self.gqa = any(m.block.attn.reads_rope_heads for m in self.layers)
        if len(w):
            raise ValueError(f"MTP tensors no MTP layer reads: {', '.join(sorted(w))}")
        self.kv = None

    def _build(self, j: int, w: dict) -> MTPLayer:
        cfg, i = self.cfg, self.ids[j]
        p, eps = layer_prefix(i), cfg.rms_norm_eps
        attn = attention_kind(cfg, i)(cfg, i, w)
        ffn = MoEBlock(cfg, i, j, w, self.experts, self.executor) if i in cfg.moe_layers else \
            mlp_kind(cfg)(w, p + cfg.mlp_prefix)                  # a dense MTP layer (ERNIE 4.5, MiMo-V2-Flash)
        an, fn = [RMSNorm(take(w, p + nm), eps) for nm in cfg.layer_norm_names[:2]]
        head = Linear(take_raw(w, p + "shared_head.head.weight"), None, self.dtype) \
            if p + "shared_head.head.weight" in w else None
        embed = take(w, p + "embed_tokens.weight") if p + "embed_tokens.weight" in w else None
        if self.scheme is not None:   # the architecture's own parts around the decoder layer (DeepSeek-V4's streams)
            return self.scheme.build(cfg, i, w, DecoderLayer(i, attn, ffn, an, fn), embed, head, self.dtype)
        return MTPLayer(RMSNorm(take(w, p + "enorm.weight"), eps), RMSNorm(take(w, p + "hnorm.weight"), eps),
                        Linear(take_raw(w, p + "eh_proj.weight"), None, self.dtype), DecoderLayer(i, attn, ffn, an, fn),
                        RMSNorm(take(w, p + "shared_head.norm.weight"), eps), embed, head)

    # -- the cache -------------------------------------------------------------------------------
    def cache_specs(self) -> dict:
        return cache_specs(self.cfg, self.ids)

    def kv_bytes_per_token(self) -> int:
        return kv_bytes_per_token(self.cfg, self.dtype, self.ids)

    def init_kv(self, tokens: int, block_size: "int | None" = None, state_slots: int = 1) -> PagedKV:
        """A cache of ``tokens`` positions for the MTP layers (per-token specs: MLA / GQA / DSA; DeepSeek-V4's window
        ring: ``state_slots`` sequences' state, which chained drafts roll back through ``save_state``)."""
        block_size = block_size or kv_block_size(self.cfg)
        blocks = max(1, -(-int(tokens) // block_size))
        self.kv = PagedKV(self.cache_specs(), self.dtype, self.device, num_blocks=blocks, block_size=block_size,
                          state_slots=max(1, int(state_slots)))
        # a sliding-window MTP layer's ring (Mellum's) goes back by save_state / restore_state as V4's window does
        windowed = any(i in self.cfg.window_layers for i in self.ids)
        if self.kv.state_slots and self.scheme is None and not windowed:
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
        if hidden.shape != (len(flat), self.hidden_width):
            raise ValueError(f"MTP forward: hidden states {tuple(hidden.shape)} for {len(flat)} tokens of hidden size "
                             f"{self.hidden_width}")
        self.kv.check(seqs, chunks)
        layer = self.layers[depth % self.n]
        ctx = build_context(seqs, chunks, self.kv, self.rope, rope_heads=self.gqa, device=self.device, hooks=hooks)
        if self.window_rope is not None:
            ctx.window_rope_heads = rope_heads_of(ctx, self.window_rope, self.device)
        ids = torch.tensor(flat, device=self.device)
        ctx.tokens = ids
        emb = (layer.embed if layer.embed is not None else self.target_embed)[ids]     # emb: [tokens, hidden]
        h = hidden.to(device=self.device, dtype=self.dtype)
        if self.scheme is not None:
            return self._scheme_forward(layer, seqs, chunks, ctx, emb, h, every_token)
        x = layer.eh_proj(torch.cat([layer.enorm(emb), layer.hnorm(h)], dim=-1))     # x: [tokens, hidden]
        x = layer.block.forward(x, ctx)
        for s, c in zip(seqs, chunks):
            s.length += len(c)
        normed = layer.head_norm(x)                                                   # normed: [tokens, hidden]
        rows = normed if every_token else normed[torch.tensor([b - 1 for _, b in ctx.spans], device=self.device)]
        logits = layer.head(rows).float() if layer.head is not None else self.target_head(rows)
        return MTPStep(hidden=normed if self.chain_normed else x, normed=normed, logits=logits)

    def _scheme_forward(self, layer, seqs: list, chunks: list, ctx, emb: torch.Tensor, h: torch.Tensor,
                        every_token: bool) -> MTPStep:
        """``forward`` through the architecture's own MTP layer (``layer.run``: its output as chained, and the head's
        normed input)."""
        x, normed = layer.run(emb, h, ctx)              # x: [tokens, hidden_width], normed: [tokens, hidden]
        for s, c in zip(seqs, chunks):
            s.length += len(c)
        rows = normed if every_token else normed[torch.tensor([b - 1 for _, b in ctx.spans], device=self.device)]
        logits = layer.head(rows).float() if layer.head is not None else self.target_head(rows)
        return MTPStep(hidden=x, normed=normed, logits=logits)

    def save_state(self, seqs: list) -> "list | None":
        """A copy of the per-sequence state of ``seqs`` (DeepSeek-V4's window rings), None without any: positions fed
        speculatively (chained drafts) write into it, and going back by length does not undo that."""
        if self.kv is None or not self.kv.state_slots:
            return None
        return [{(i, k): t[s.state].clone() for i in self.ids for k, t in self.kv[i].slot_tensors().items()}
                for s in seqs]

    def restore_state(self, seqs: list, saved: "list | None") -> None:
        """The state ``save_state`` copied, back into the sequences' slots."""
        for s, d in zip(seqs, saved or []):
            for (i, k), t in d.items():
                self.kv[i].slot_tensors()[k][s.state] = t


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
    if not mtp_moe(cfg):          # dense MTP layers (ERNIE 4.5, MiMo-V2-Flash): no store of experts
        return _load_dense_mtp(store_dir, target, host_act_quant)
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
        mtp = MTPModel(cfg, n, dense, experts, embed=target.embed, head=target._logits, device=target.device,
                       dtype=target.dtype, host_act_quant=host_act_quant)
        if mtp.scheme is not None:    # what the target hands as rows of h (DeepSeek-V4: its streams, moe._draft_rows)
            mtp.scheme.attach(target)
        return mtp
    except Exception:
        experts.close()
        raise


def _load_dense_mtp(store_dir: str, target, host_act_quant: str) -> "MTPModel":
    """``load_mtp`` of dense MTP layers: no experts; as many layers as the MTP part holds eh_proj weights."""
    from safetensors import safe_open
    with safe_open(os.path.join(mtp_store_dir(store_dir), MTP_DENSE), "pt") as f:
        n = sum(1 for k in f.keys() if k.endswith(".eh_proj.weight"))
    if not n:
        raise ValueError(f"{store_dir}: the MTP part holds no MTP layer (no eh_proj weight in {MTP_DIR}/{MTP_DENSE})")
    if target.embed is None:
        raise ValueError("--speculative mtp needs the model's embedding in this process (not a later pipeline stage)")
    dense = load_mtp_dense(store_dir, target.cfg, n)
    return MTPModel(target.cfg, n, dense, None, embed=target.embed, head=target._logits, device=target.device,
                    dtype=target.dtype, host_act_quant=host_act_quant)
