"""A decoder-only MoE transformer whose routed experts come from the expert store.

The model runs forward passes and nothing else: it knows no scheduling, no sockets, and no
residency - it asks an expert provider (``ExpertStore``) for a layer's experts and computes the
resident ones first while misses stream in. Dense weights (attention, norms, router, shared
expert, embeddings) stay in memory, each held by the layer that computes with it.

The model is a list of ``DecoderLayer`` (an attention kind and an FFN kind, chosen once at build
from the config: runtime/model/layers/) plus the embedding and the head; ``forward`` builds one
``ForwardContext`` and runs the layers over it. No architecture flag is tested inside a forward.
"""
from __future__ import annotations

import dataclasses

import torch

from .. import kernels
from ..kernels.cores import free_cores
from ..kernels import hugepages
from .config import MoEConfig
from .layers.cache import KVFull, PagedKV, Sequence, StateCacheSpec, TokenCacheSpec, WindowCacheSpec, kv_block_size
from .layers.kinds import attention_kind, cache_specs, kv_bytes_per_token, state_bytes_per_sequence
from .layers.context import NO_HOOKS, ForwardContext, StepHooks, build_context, rope_heads_of
from .hyper import HyperConnection
from .layers.absent import Absent
from .layers.mlp import mlp_kind
from .layers.experts import ExpertExecutor
from .layers.moe_block import MoEBlock
from .layers.norm import RMSNorm, rms_norm
from .layers.rope import RotaryEmbedding, mla_softmax_scale, rope_frequencies
from .layers.router import route
from .layers.dense import DENSE_QUANT, Linear
from .layers.fused import build_fused
from .layers.fused_step import FusedStep
from .layers.parallel import Reduced, Skipped
from .layers.weights import DenseTensors, layer_prefix, linear_opts, take, take_raw
from .residual import DecoderLayer, layer_residual_tensors, residual_kind, residual_tensors

__all__ = ["MoEModel", "DecoderLayer", "dense_tensors", "ForwardContext", "StepHooks", "KVFull", "PagedKV", "Sequence", "StateCacheSpec",
           "TokenCacheSpec", "WindowCacheSpec", "cache_specs", "kv_bytes_per_token",
           "state_bytes_per_sequence", "rms_norm", "route", "rope_frequencies", "mla_softmax_scale"]


def fused_decode_on(what: str = "DECODE") -> bool:
    import os
    return os.environ.get(f"TIERED_MOE_FUSED_{what}", "1") != "0"


def dense_tensors(cfg: MoEConfig) -> dict:
    """Every dense checkpoint tensor the model takes -> expected shape, from the layers that take
    them (convert reads exactly this table; MoEModel.unused lists what no layer took)."""
    H = cfg.hidden_size
    out = {"model.embed_tokens.weight": (cfg.vocab_size, H), "model.norm.weight": (H,)}
    out.update(residual_tensors(cfg))
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (cfg.vocab_size, H)
    for i in range(cfg.num_layers):
        p = layer_prefix(i)
        out.update({p + n: (H,) for n in cfg.layer_norms(i)})
        out.update(layer_residual_tensors(cfg, p))
        out.update(attention_kind(cfg, i).tensors(cfg, i))
        if i in cfg.moe_layers:
            out.update(MoEBlock.tensors(cfg, i))
        elif i not in cfg.empty_ffn_layers:
            out.update(mlp_kind(cfg).tensors(p + cfg.mlp_prefix, cfg.dense_intermediate, H))
    return out


def fold_scales(cfg: MoEConfig, dense: dict) -> None:
    """Granite's scalar multipliers folded into the dense weights once, in float32, each tensor back in its dtype:
    q (and its bias) x attention_multiplier * sqrt(head_dim) - the attention's own scale is head_dim ** -0.5 -;
    o (a linear-attention layer's out_proj), a dense MLP's and the shared experts' down x residual_multiplier; v x
    attn_v_scale (MiMo-V2-Flash) (the routed experts' through
    routed_scaling_factor, which the architecture sets to it); the embeddings x embedding_multiplier; the final
    norm / logits_scaling, and / embedding_multiplier where the head is the (scaled) embedding. The kernels and
    every backend then need no scalar of their own."""
    def scale(name: str, f: float) -> None:
        if f != 1.0 and name in dense:
            dense[name] = (dense[name].float() * f).to(dense[name].dtype)
    r = cfg.residual_multiplier
    for i in range(cfg.num_layers):
        p = layer_prefix(i)
        for sfx in ("weight", "bias"):
            if cfg.attention_multiplier:
                scale(f"{p}self_attn.q_proj.{sfx}", cfg.attention_multiplier * cfg.head_dim ** 0.5)
            scale(f"{p}self_attn.o_proj.{sfx}", r)
            scale(f"{p}self_attn.v_proj.{sfx}", cfg.attn_v_scale)    # MiMo-V2-Flash's value scale
            if i in cfg.linear_layers:       # Granite 4's Mamba-2 layers: their output projection
                scale(f"{p}{cfg.linear_prefix}out_proj.{sfx}", r)
            scale(f"{p}{cfg.mlp_prefix}down_proj.{sfx}", r)
            scale(f"{p}{cfg.shared_prefix}down_proj.{sfx}", r)
    scale("model.embed_tokens.weight", cfg.embedding_multiplier)
    scale("model.norm.weight", 1.0 / (cfg.logits_scaling * (cfg.embedding_multiplier if cfg.tie_word_embeddings else 1.0)))


class MoEModel:
    def __init__(self, cfg: MoEConfig, dense: dict, experts, *, device: str = "cpu", dtype=torch.float32,
                 kv_bytes: "int | None" = None, host_act_quant: str = "none", dense_quant: str = "none",
                 tp=None) -> None:
        """``tp``: a rank of a parallel group (runtime/parallel/group.py ``Rank``): ``cfg`` and ``dense`` are then
        the rank's (runtime/parallel/shard.py), its split sublayers are all-reduced, and with pipeline stages
        it runs the model layers ``tp.layers`` only - the hidden states come from the stage before and go to
        the stage after (``tp.pipe``); the first stage embeds, the last one computes the logits."""
        self.cfg, self.experts, self.device, self.dtype = cfg, experts, device, dtype
        self.on_host = torch.device(device).type == "cpu"
        self.tp = tp
        lo, hi = tp.layers if tp is not None and tp.layers is not None else (0, cfg.num_layers)
        self.layer_ids = range(lo, hi)
        self.first, self.last = lo == 0, hi == cfg.num_layers
        self.pipe = tp.pipe if tp is not None and (not self.first or not self.last) else None
        if self.pipe is not None and cfg.attn_res_block_layers:
            raise ValueError(f"{cfg.source}: pipeline stages with Block Attention Residuals are not supported yet "
                             f"(a stage would hand over every block summary); run it with --tensor-parallel only")
        self.tokens_per_thread = 128      # intra-op threads of a forward: one per this many tokens (see forward)
        self._tokens = None               # token ids of the forward running now [tokens] (hash-routed layers)
        fold_scales(cfg, dense)
        if cfg.norm_offset:   # Qwen3-Next / Qwen3.5 RMSNorms scale by (1 + weight): folded in once here
            for k in list(dense):
                if k.endswith(("layernorm.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight")) or k == "model.norm.weight":
                    dense[k] = dense[k].float() + cfg.norm_offset
        # Takes ownership of `dense`: the layers take it apart, each tensor converted to the compute
        # dtype as it is taken (layers/weights.py), so at most one converted copy is alive at a time.
        if dense_quant not in DENSE_QUANT:
            raise ValueError(f"dense quantization {dense_quant!r} is not one of {', '.join(DENSE_QUANT)}")
        w = DenseTensors(dense, device, dtype, dense_quant, host_act_quant)
        dense.clear()
        self.rope = RotaryEmbedding(cfg, device, dtype)
        # a RoPE per layer type (Mellum): the sliding-window layers' own, default RoPE of their theta
        self.window_rope = RotaryEmbedding(dataclasses.replace(cfg, rope_theta=cfg.sliding_rope_theta, rope_scaling={}),
                                           device, dtype) if cfg.sliding_rope_theta else None
        self.moe_index = {layer: i for i, layer in enumerate(cfg.moe_layers)}
        self.executor = ExpertExecutor(cfg, experts, dtype, device, host_act_quant)
        self.kv = None            # PagedKV, made by init_kv (the engine sizes it; KVManager.for_model otherwise)
        self.kv_bytes = kv_bytes
        self.layers = [self._build_layer(i, w) for i in self.layer_ids]
        self.moe_blocks = [layer.ffn for layer in self.layers if layer.index in self.moe_index]
        # GQA layers read cos / sin broadcast over heads: built once per forward only when one exists.
        self.gqa = any(layer.attn.reads_rope_heads for layer in self.layers)
        self.embed = take(w, "model.embed_tokens.weight") if self.first or (self.last and cfg.tie_word_embeddings) \
            else None
        self.norm = RMSNorm(take(w, "model.norm.weight"), cfg.rms_norm_eps) if self.last else None
        self.residual = residual_kind(cfg)(cfg, w, self.last)       # the residual scheme (residual.py), once
        self.draft_rows = "normed"      # what StepHooks.token_hidden hears (_draft_rows): normed | streams
        # An untied lm_head is a Linear like the attention weights (kept bf16 where that pays).
        self.head = Linear(take_raw(w, "lm_head.weight"), None, dtype, **linear_opts(w, head=True)) \
            if "lm_head.weight" in w and self.last else None
        self.unused = sorted(w)    # dense tensors of the store no layer reads (none for a supported model)
        if self.on_host:           # the dense weights in 2 MiB pages, before the fused kernels take their addresses
            hugepages.rehome((self.layers, self.head, self.embed, self.norm, self.residual),
                             skip=(self.experts, self.executor))
        self._pick_layer_backends(tp, device)

    def _build_layer(self, i: int, w: dict) -> DecoderLayer:
        """Model layer ``i``: its attention and FFN kinds from the config, split sublayers wrapped for the
        all-reduce, the residual scheme's per-layer tensors."""
        cfg, tp, pre = self.cfg, self.tp, layer_prefix(i)
        attn = attention_kind(cfg, i)(cfg, i, w)
        split = tp.plan if tp is not None and tp.plan.shard.world > 1 else None
        if i in self.moe_index:
            ffn = MoEBlock(cfg, i, self.moe_index[i], w, self.experts, self.executor)
        elif i in cfg.empty_ffn_layers:
            ffn = Absent()                   # a layer of a mixer alone (Nemotron-H): no FFN
        elif split is not None and split.dense_mlp == "rank0" and split.shard.rank:
            ffn = Skipped()                  # rank 0 computes this dense MLP alone (layers/parallel.py)
        else:
            ffn = mlp_kind(cfg)(w, pre + cfg.mlp_prefix)
        if split is not None:
            attn = Reduced(attn, tp.all_reduce) if split.attn_split[i] else attn
            ffn = Reduced(ffn, tp.all_reduce) if split.ffn_split[i] else ffn
        q = (take(w, pre + "attn_res.attn_query"), take(w, pre + "attn_res.mlp_query")) if cfg.attn_res_block_layers \
            else (None, None)
        hc = (HyperConnection(cfg, w, pre + "attn_hc."), HyperConnection(cfg, w, pre + "ffn_hc.")) if cfg.hc_mult \
            else (None, None)
        eps = cfg.rms_norm_eps
        kept = cfg.layer_norms(i)            # an empty sublayer has no norm (None)
        an, fn, *out = [RMSNorm(take(w, pre + n), eps) if n in kept else None for n in cfg.layer_norm_names]
        rs = cfg.residual_scales
        scales = ((rs["linear"] if i in cfg.linear_layers else rs["attention"]), rs["ffn"]) \
            if cfg.norm_placement == "normed" else None
        return DecoderLayer(i, attn, ffn, an, fn, *q, *hc, norm_after=cfg.norm_placement == "post",
                            out_norms=tuple(out) or None, scales=scales)

    def _pick_layer_backends(self, tp, device) -> None:
        """Each layer's backend on the plain residual stream, once: the fused CPU decode (two kernel calls per
        GQA + MoE layer, layers/fused.py) where the layer and the kernels allow, else its composed ops.
        ``fused_why[j]`` says why layer j runs composed (None: it is fused). Not with another residual scheme
        (the fused call adds into x itself) nor under tensor parallelism (no place for the all-reduces);
        TIERED_MOE_FUSED_DECODE=0 turns it off (the composed path for comparison)."""
        off = ("TIERED_MOE_FUSED_DECODE=0" if not fused_decode_on() else
               "not a plain residual stream" if not self.residual.fusable else
               "norms after the sublayers (the kernels norm before)" if self.cfg.norm_placement != "pre" else
               "tensor-parallel ranks" if tp is not None and tp.plan.shard.world > 1 else None)
        if off is not None:
            self.fused, self.fused_why = [None] * len(self.layers), [off] * len(self.layers)
        else:
            self.fused, self.fused_why = build_fused(self.layers, device, self.cfg)
        for layer, f in zip(self.layers, self.fused):
            if f is not None:
                layer.forward = f
        # runs of consecutive fused layers in one call per decode step (layers/fused_step.py);
        # TIERED_MOE_FUSED_STEP=0: one layer at a time (for comparison)
        self.residual.step = FusedStep(self.layers, self.fused) \
            if any(f is not None for f in self.fused) and fused_decode_on("STEP") else None

    @property
    def codec(self):
        return self.executor.codec

    def route_preview(self, moe_idx: int, x: torch.Tensor) -> torch.Tensor:
        """Expert ids [tokens, k] that MoE layer ``moe_idx`` routes hidden state x [tokens, hidden] to,
        by the router code its forward runs (lookahead prefetch predicts with it; a hash-routed layer's
        choice is its table's row of each token of the forward running now: exact)."""
        return self.moe_blocks[moe_idx].route_preview(x, self._tokens)

    @property
    def known_expert_layers(self) -> set:
        """MoE layers (their index among the MoE layers) whose experts follow from the token ids alone,
        before the forward runs (DeepSeek-V4's hash-routed layers): ``known_experts`` gives them exactly,
        so nothing predicts them."""
        return {b.moe_idx for b in self.moe_blocks if b.routes_by_token}

    def known_experts(self, tokens: list) -> dict:
        """{MoE layer: sorted experts} that the layers of ``known_expert_layers`` will use for ``tokens``."""
        ids = torch.tensor(tokens, dtype=torch.long)
        return {b.moe_idx: b.known_experts(ids) for b in self.moe_blocks if b.routes_by_token}

    # -- the KV cache ----------------------------------------------------------------------------
    def cache_specs(self) -> dict:
        return cache_specs(self.cfg, self.layer_ids)

    def kv_bytes_per_token(self) -> int:
        """Bytes one more token of context adds to a sequence's cache (per-token layers only; a pipeline
        stage's layers)."""
        return kv_bytes_per_token(self.cfg, self.dtype, self.layer_ids)

    def state_bytes_per_sequence(self) -> int:
        """Bytes of fixed per-sequence state (linear-attention layers), whatever the context length."""
        return state_bytes_per_sequence(self.cfg, self.dtype, self.layer_ids)

    def cache_bytes(self, tokens: int) -> int:
        """A sequence's whole cache at ``tokens`` tokens of context."""
        return tokens * self.kv_bytes_per_token() + self.state_bytes_per_sequence()

    def init_kv(self, nbytes: "int | None" = None, block_size: "int | None" = None,
                max_seqs: "int | None" = None, num_blocks: "int | None" = None, snapshots: int = 0) -> PagedKV:
        """Preallocate the cache from one budget: ``nbytes`` (else the model's kv_bytes, else room for
        16 sequences of up to 4096 tokens). With linear-attention layers ``max_seqs`` (default 16)
        state slots come out of it first; the rest is KV blocks of ``block_size`` tokens (default 16, a
        multiple of every DeepSeek-V4 compress rate). ``num_blocks``: exactly this many blocks (the ranks
        of a group agree on one count: runtime/parallel/group.py). ``snapshots``: spare state slots for the prefix
        cache (runtime/engine/kv_manager.py KVManager.snapshot), out of the same budget."""
        block_size = block_size or kv_block_size(self.cfg)
        per_tok, per_seq = self.kv_bytes_per_token(), self.state_bytes_per_sequence()
        seqs = (max_seqs or 16) if per_seq else 0
        snaps = snapshots if per_seq else 0
        nbytes = nbytes or self.kv_bytes or 16 * (min(self.cfg.max_position_embeddings, 4096) * per_tok + per_seq)
        if per_tok:
            blocks = int((nbytes - (seqs + snaps) * per_seq) // (per_tok * block_size))
        else:   # no layer caches per token (every one sliding or linear): blocks only number positions
            blocks = (seqs * -(-self.cfg.max_position_embeddings // block_size)
                      if nbytes >= (seqs + snaps) * per_seq else 0)
        if num_blocks is not None:
            blocks = int(num_blocks)
        if blocks < 1:
            need = (seqs + snaps) * per_seq + per_tok * block_size
            raise ValueError(f"KV cache budget {nbytes:,} bytes is smaller than "
                             + (f"the recurrent state of {seqs} sequences ({seqs * per_seq:,} bytes) + " if seqs else "")
                             + (f"{snaps} prefix-cache state snapshots ({snaps * per_seq:,} bytes) + " if snaps else "")
                             + f"one block of {block_size} tokens ({per_tok * block_size:,} bytes): the minimum is "
                             f"{need:,} bytes")
        self.kv = PagedKV(self.cache_specs(), self.dtype, self.device, num_blocks=blocks, block_size=block_size,
                          state_slots=seqs, snapshots=snaps)
        return self.kv

    @torch.inference_mode()
    def forward(self, seqs: list, chunks: list, hooks: StepHooks = NO_HOOKS) -> torch.Tensor:
        """Run new tokens of several sequences. chunks[j]: token ids of seqs[j] (prefill chunk or one
        decode token). Returns logits of each chunk's last token: [len(seqs), vocab]. ``hooks``: the
        engine's step number, cache-aware routing bonus and callbacks for this forward (context.py).

        Intra-op threads: at most one per ``tokens_per_thread`` tokens of the forward (never more
        than torch's setting). A decode step's ops are small - matmuls of a few rows, elementwise
        ops of a few KiB - and split across threads each pays a fork/join that costs more than it
        saves, and waits for the slowest thread (a core busy with anything else stalls every op):
        on this project's 2-core machine, shared with other jobs, a 2-row expert matmul took 0.6 ms
        on one thread and 3 ms on two, and a 64-token prefill of the mid-size checkpoint of
        bench/decode_speed.py 0.56 s and 2.5 s. Large forwards (long prefills, big batches) use
        every thread. Never more than the cores other processes leave free (kernels/cores.py, remeasured every
        0.1 s): on a shared machine a thread that gets descheduled stalls every join of the step."""
        configured = torch.get_num_threads()
        # one thread needs no cap (the monitor reads /proc/stat every 0.1 s: under load a read took up to 5 ms)
        free = free_cores() if configured > 1 else None
        want = configured if free is None else min(configured, free)
        kernels.set_threads(want)         # the host kernels split even one token's experts
        use = max(1, min(want, sum(len(c) for c in chunks) // self.tokens_per_thread))
        if use == configured:
            return self._micro(seqs, chunks, hooks)
        torch.set_num_threads(use)
        try:
            return self._micro(seqs, chunks, hooks)
        finally:
            torch.set_num_threads(configured)

    def _micro(self, seqs: list, chunks: list, hooks: StepHooks):
        """Pipeline stages: the step's sequences in up to ``stages`` micro-batches, one after the other on this
        stage - while the next stage runs micro-batch j, this one runs j + 1 (GPipe's schedule, for decode).
        The last stage returns the logits of all of them; the others None."""
        m = min(len(seqs), self.pipe.stages) if self.pipe is not None else 1
        if m <= 1:
            out = self._forward(seqs, chunks, hooks)
        else:
            cuts = [round(i * len(seqs) / m) for i in range(m + 1)]
            parts = [self._forward(seqs[a:b], chunks[a:b], hooks) for a, b in zip(cuts, cuts[1:])]
            out = torch.cat(parts) if self.last else None
        if self.pipe is not None:
            self.pipe.flush()             # this step's sends have left: their buffers may be reused
        return out

    def _forward(self, seqs: list, chunks: list, hooks: StepHooks) -> torch.Tensor:
        flat = [t for c in chunks for t in c]
        if self.kv is None:
            raise ValueError("the model has no KV cache: init_kv makes it (the engine, or runtime/engine/kv_manager.py "
                             "KVManager.for_model)")
        self.kv.check(seqs, chunks)           # the blocks are the engine's KVManager's to give: none are taken here
        ctx = build_context(seqs, chunks, self.kv, self.rope, rope_heads=self.gqa, device=self.device, hooks=hooks)
        if self.on_host:
            kernels.spin_for(ctx.decode)      # the kernels' pool spins between decode's kernels only
        if self.window_rope is not None:
            ctx.window_rope_heads = rope_heads_of(ctx, self.window_rope, self.device)
        ids = torch.tensor(flat, device=self.device)
        ctx.tokens = self._tokens = ids
        res = self.residual
        # what flows between the layers: the embeddings entered into the residual scheme, or the stage before's
        h = res.enter(self.embed[ids]) if self.first else self.pipe.recv(res.wire_shape(len(flat)), self.dtype)
        h = res.run(self.layers, h, ctx)
        for s, c in zip(seqs, chunks):
            s.length += len(c)
        if not self.last:
            self.pipe.send(h)
            return None
        x = res.leave(h)                                                 # x: [tokens, hidden]
        if hooks.every_token:
            self._every_token(seqs, ctx.spans, x, hooks)
        if hooks.token_hidden is not None:
            for s, (a, b) in zip(seqs, ctx.spans):      # each chunk's rows for speculative drafters (MTP)
                hooks.token_hidden(s, 0, self._draft_rows(h[a:b], x[a:b]))
        # decode: every token is its sequence's last
        return self._logits(self.norm(x if ctx.decode else x[torch.tensor([b - 1 for _, b in ctx.spans],
                                                                           device=self.device)]))

    def _draft_rows(self, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """What token_hidden hands an MTP drafter of some rows: their final norm's output (vLLM's convention), or with
        ``draft_rows`` "streams" (set by DeepSeek-V4's MTP layer, which reads the hyper-connected streams before the
        head's collapse) the residual scheme's state after the last layer, flat. h: [rows, N, hidden] (hyper-connected
        streams) or [rows, hidden]; x: [rows, hidden] after the scheme's leave -> [rows, N * hidden] or [rows, hidden]."""
        return h.reshape(h.shape[0], -1) if self.draft_rows == "streams" else self.norm(x)

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        """h: normed hidden states [rows, hidden] -> float32 logits [rows, vocab]."""
        if self.head is not None:
            return self.head(h).float()
        return torch.nn.functional.linear(h, self.embed).float()   # tied: the embedding's rows

    EVERY_TOKEN_ROWS = 64      # logits rows made at once for hooks.every_token (a row is vocab x 4 bytes)

    def _every_token(self, seqs: list, spans: list, x: torch.Tensor, hooks: StepHooks) -> None:
        """The logits of every token of the sequences in ``hooks.every_token`` (prompt_logprobs), to
        ``hooks.token_logits``, EVERY_TOKEN_ROWS rows at a time."""
        for s, (a, b) in zip(seqs, spans):
            if any(s is w for w in hooks.every_token):
                for i in range(a, b, self.EVERY_TOKEN_ROWS):
                    hooks.token_logits(s, i - a, self._logits(self.norm(x[i:min(b, i + self.EVERY_TOKEN_ROWS)])))
