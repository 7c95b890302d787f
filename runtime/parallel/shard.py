"""What one tensor-parallel rank holds: its slice of the config, of the dense weights and of every expert.

The split is the usual column / row one (Megatron-LM; vLLM's ``ColumnParallelLinear`` /
``RowParallelLinear``), chosen so that each layer needs one all-reduce per sublayer and nothing else:

* **experts**: gate and up split along the intermediate axis (rows), down along the same axis
  (columns). A rank's expert computes ``down_r(act(gate_r x) * up_r x)``, a partial sum of the whole
  expert's output; the weighted sum over experts is linear, so the layer's partial outputs add up
  across ranks in one all-reduce. An expert's down bias (gpt-oss) is kept by rank 0 only.
* **shared experts and dense MLPs**: the same split; where the intermediate size does not divide,
  rank 0 computes the whole MLP and the others skip it (the all-reduce adds nothing from them).
* **softmax attention** (GQA and MLA): heads split; q / k / v (GQA) or q / kv_b (MLA) by rows of
  whole heads, o by the same columns; o's bias on rank 0. With fewer kv heads than ranks, each rank
  keeps the kv head its q heads read (replicated, as vLLM does). MLA's latent projections and its
  latent cache are replicated (the cache cannot split by heads: it has none).
* **linear attention** (Kimi Delta Attention, Gated DeltaNet): heads split - the q / k / v projections and
  their short convolutions' channels, KDA's forget / output gates' second low-rank factors, ``dt_bias``,
  ``A_log`` and the beta projection by the rank's heads (Gated DeltaNet: its key-head groups and their value
  heads; Qwen3-Next's fused projection is already grouped that way), o by the same columns; the low-rank first
  factors and the per-head output norm (over a head's channels) replicated. Each rank keeps its heads'
  recurrent state: the state arena splits too.
* **replicated**: embeddings, the head, norms, routers and their biases and hash tables, LatentMoE's
  projections, hyper-connections, and the attention kinds not split yet: DeepSeek-V4's one shared K=V head,
  and GQA with a q/k RMSNorm over the whole projection (OLMoE, MiniMax-M2: the norm's statistic spans every
  head, one more all-reduce). Those layers run the same numbers on every rank; only their experts split.

Quantized experts split on their block boundaries (``WeightFormat.slice_parts``); a split that would
cut a scale block or a packed word is refused with the numbers that cut it.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from ..expert_codec import WeightSpec
from ..model.config import MoEConfig


@dataclass(frozen=True)
class Shard:
    """Rank ``rank`` of ``world`` tensor-parallel ranks."""
    rank: int = 0
    world: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.world, int) or self.world < 1:
            raise ValueError(f"tensor-parallel size must be a positive integer, got {self.world!r}")
        if not 0 <= self.rank < self.world:
            raise ValueError(f"rank {self.rank} is outside 0..{self.world - 1}")

    def part(self, n: int) -> tuple:
        """(start, stop) of this rank's equal part of n (n must divide)."""
        k = n // self.world
        return self.rank * k, (self.rank + 1) * k


@dataclass(frozen=True)
class ShardPlan:
    """What a rank splits: per layer, whether its attention and its FFN output partial sums (then one
    all-reduce follows them); the model-wide choices; and the rank's config."""
    shard: Shard
    cfg: MoEConfig                   # the rank's config (heads, kv heads and intermediate sizes of its slice)
    attn_split: tuple                # [layer] -> the attention's output is a partial sum
    ffn_split: tuple                 # [layer] -> the FFN's output is a partial sum
    kv_heads: "tuple | None"         # GQA: the global kv heads this rank keeps (None: attention replicated)
    dense_mlp: str                   # split | rank0: dense MLP layers
    shared: str                      # split | rank0 | none: shared experts
    why_replicated: str = ""         # why attention is replicated, when it is
    linear: str = "none"             # split | replicated | none: the linear-attention layers

    def summary(self) -> dict:
        lin = set(self.cfg.linear_layers)
        soft = [s for i, s in enumerate(self.attn_split) if i not in lin]
        return {"attention": "heads split" if any(soft) else f"replicated ({self.why_replicated})",
                "linear_attention": self.linear,
                "dense_mlp": self.dense_mlp, "shared_experts": self.shared,
                "kv_heads_per_rank": len(self.kv_heads) if self.kv_heads else self.cfg.num_kv_heads}


def plan(cfg: MoEConfig, shard: Shard) -> ShardPlan:
    """The rank's plan and config; ValueError naming what cannot split (the experts must)."""
    N, r = shard.world, shard.rank
    if cfg.expert_intermediate % N:
        raise ValueError(f"{cfg.source}: the expert intermediate size {cfg.expert_intermediate} does not split over "
                         f"{N} tensor-parallel ranks; use a size that divides it")
    gqa = cfg.attention == "gqa" and cfg.qk_norm != "full"
    mla = cfg.attention == "mla"
    why = ""
    if cfg.attention == "v4":
        why = "DeepSeek-V4's attention has one shared K=V head"
    elif cfg.attention == "gqa" and cfg.qk_norm == "full":
        why = "its q/k RMSNorm spans every head"
    elif cfg.num_heads % N:
        why = f"{cfg.num_heads} heads do not split over {N} ranks"
    elif gqa and cfg.num_kv_heads % N and N % cfg.num_kv_heads:
        why = f"{cfg.num_kv_heads} kv heads neither split over nor replicate evenly onto {N} ranks"
    split_attn = (gqa or mla) and not why
    changes = {"expert_intermediate": cfg.expert_intermediate // N}
    kv_heads = None
    if split_attn:
        changes["num_heads"] = cfg.num_heads // N
        if gqa:
            nkv = cfg.num_kv_heads
            if nkv % N == 0:
                kv_heads = tuple(range(*Shard(r, N).part(nkv)))
            else:   # fewer kv heads than ranks: each rank keeps the one its q heads read
                kv_heads = ((r * nkv) // N,)
            changes["num_kv_heads"] = len(kv_heads)
        else:     # MLA: no kv heads (one latent per token); the field only has to stay consistent
            changes["num_kv_heads"] = math.gcd(cfg.num_kv_heads, cfg.num_heads // N)
    dense_mlp = "split" if cfg.dense_intermediate % N == 0 else "rank0"
    if dense_mlp == "split":
        changes["dense_intermediate"] = cfg.dense_intermediate // N
    shared = "none" if not cfg.shared_intermediate else "split" if cfg.shared_intermediate % N == 0 else "rank0"
    if shared == "split":
        changes["shared_intermediate"] = cfg.shared_intermediate // N
    elif shared == "rank0" and r:
        changes.update(shared_intermediate=0, shared_expert_gate=False)
    local = dataclasses.replace(cfg, **changes)
    lin = set(cfg.linear_layers)
    linear = "none" if not lin else "split" if cfg.linear_num_heads % N == 0 else "replicated"
    if linear == "split":
        local = dataclasses.replace(local, linear_num_heads=cfg.linear_num_heads // N,
                                    linear_num_v_heads=cfg.linear_num_v_heads // N)
    attn_split = tuple((linear == "split") if i in lin else split_attn for i in range(cfg.num_layers))
    ffn_split = tuple(N > 1 for _ in range(cfg.num_layers))   # experts always split; dense MLPs split or rank 0's
    return ShardPlan(shard, local, attn_split, ffn_split, kv_heads, dense_mlp, shared, why, linear)


# -- dense tensors ------------------------------------------------------------------------------
def _rows(t: torch.Tensor, a: int, b: int) -> torch.Tensor:
    return t[a:b].contiguous()


def _cols(t: torch.Tensor, a: int, b: int) -> torch.Tensor:
    return t[:, a:b].contiguous()


def shard_dense(cfg: MoEConfig, p: ShardPlan, dense: dict) -> dict:
    """The checkpoint's dense tensors -> this rank's (a new dict; replicated tensors are shared, not copied)."""
    N, r = p.shard.world, p.shard.rank
    out = dict(dense)
    if N == 1:
        return out
    from ..model.layers.weights import layer_prefix

    def mlp(prefix: str, inter: int, how: str) -> None:
        names = [prefix + n for n in ("gate_proj.weight", "up_proj.weight", "down_proj.weight")]
        if how == "rank0":
            if r:
                for n in names:
                    out.pop(n, None)
            return
        a, b = Shard(r, N).part(inter)
        out[names[0]], out[names[1]] = _rows(out[names[0]], a, b), _rows(out[names[1]], a, b)
        out[names[2]] = _cols(out[names[2]], a, b)

    for i in range(cfg.num_layers):
        pre = layer_prefix(i)
        if pre + "input_layernorm.weight" not in out:
            continue                      # another pipeline stage's layer
        if p.attn_split[i]:
            if i in cfg.linear_layers:
                (_kda if cfg.linear_kind == "kda" else _gdn)(cfg, out, pre + cfg.linear_prefix, p.shard)
            elif cfg.attention == "mla":
                _mla(cfg, out, pre + "self_attn.", p.shard)
            else:
                _gqa(cfg, out, pre + "self_attn.", p)
        if i in cfg.moe_layers:
            if p.shared != "none":
                mlp(pre + cfg.shared_prefix, cfg.shared_intermediate, p.shared)
                if p.shared == "rank0" and r:
                    out.pop(pre + "mlp.shared_expert_gate.weight", None)
        else:
            mlp(pre + cfg.mlp_prefix, cfg.dense_intermediate, p.dense_mlp)
    return out


def _gqa(cfg: MoEConfig, out: dict, p: str, plan_: ShardPlan) -> None:
    N, r = plan_.shard.world, plan_.shard.rank
    nh, hd = cfg.num_heads, cfg.head_dim
    qh = Shard(r, N).part(nh)
    per = hd * (2 if cfg.attn_output_gate else 1)       # Qwen3-Next: [q | gate] per head, whole heads move
    for sfx in ("weight", "bias"):
        if p + "q_proj." + sfx in out:
            out[p + "q_proj." + sfx] = _rows(out[p + "q_proj." + sfx], qh[0] * per, qh[1] * per)
        for n in ("k_proj.", "v_proj."):
            if p + n + sfx in out:
                t = out[p + n + sfx]
                out[p + n + sfx] = torch.cat([t[h * hd:(h + 1) * hd] for h in plan_.kv_heads]).contiguous()
    out[p + "o_proj.weight"] = _cols(out[p + "o_proj.weight"], qh[0] * hd, qh[1] * hd)
    if p + "o_proj.bias" in out and r:
        out[p + "o_proj.bias"] = torch.zeros_like(out[p + "o_proj.bias"])   # added once: by rank 0
    if p + "sinks" in out:
        out[p + "sinks"] = out[p + "sinks"][qh[0]:qh[1]].contiguous()


def _mla(cfg: MoEConfig, out: dict, p: str, shard: Shard) -> None:
    a, b = shard.part(cfg.num_heads)
    qk, kvw, vd = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.qk_nope_head_dim + cfg.v_head_dim,
                   cfg.v_head_dim)
    q = p + ("q_b_proj.weight" if cfg.q_lora_rank else "q_proj.weight")
    out[q] = _rows(out[q], a * qk, b * qk)
    out[p + "kv_b_proj.weight"] = _rows(out[p + "kv_b_proj.weight"], a * kvw, b * kvw)
    out[p + "o_proj.weight"] = _cols(out[p + "o_proj.weight"], a * vd, b * vd)


def _kda(cfg: MoEConfig, out: dict, p: str, shard: Shard) -> None:
    """Kimi Delta Attention's tensors (the released names: runtime/model/arch/kimi_linear.py) for the rank's heads."""
    a, b = shard.part(cfg.linear_num_heads)
    K = cfg.linear_head_dim
    for n in ("q_proj.weight", "k_proj.weight", "v_proj.weight", "q_conv1d.weight", "k_conv1d.weight",
              "v_conv1d.weight", "f_b_proj.weight", "g_b_proj.weight", "dt_bias"):
        out[p + n] = _rows(out[p + n], a * K, b * K)
    out[p + "b_proj.weight"] = _rows(out[p + "b_proj.weight"], a, b)
    out[p + "A_log"] = out[p + "A_log"][..., a:b, :].contiguous() if out[p + "A_log"].dim() == 4 else \
        out[p + "A_log"][a:b].contiguous()
    out[p + "o_proj.weight"] = _cols(out[p + "o_proj.weight"], a * K, b * K)


def _gdn(cfg: MoEConfig, out: dict, p: str, shard: Shard) -> None:
    """Gated DeltaNet's tensors (runtime/model/arch/qwen3_next.py's table) for the rank's key-head groups."""
    Hk, Dk, Hv, Dv = cfg.linear_num_heads, cfg.linear_head_dim, cfg.linear_num_v_heads, cfg.linear_value_head_dim
    a, b = shard.part(Hk)
    r = Hv // Hk                                         # value heads per key head
    va, vb = a * r, b * r

    def flat_qkv(t: torch.Tensor) -> torch.Tensor:      # rows (or conv channels) q | k | v, each flat over heads
        q, k, v = t[:Hk * Dk], t[Hk * Dk:2 * Hk * Dk], t[2 * Hk * Dk:]
        return torch.cat([q[a * Dk:b * Dk], k[a * Dk:b * Dk], v[va * Dv:vb * Dv]]).contiguous()
    if p + "in_proj_qkvz.weight" in out:                 # Qwen3-Next: grouped per key head [q k v z] and [b a]
        w = out[p + "in_proj_qkvz.weight"]
        out[p + "in_proj_qkvz.weight"] = w.reshape(Hk, -1, w.shape[1])[a:b].reshape(-1, w.shape[1]).contiguous()
        w = out[p + "in_proj_ba.weight"]
        out[p + "in_proj_ba.weight"] = w.reshape(Hk, -1, w.shape[1])[a:b].reshape(-1, w.shape[1]).contiguous()
    else:                                                # Qwen3.5: flat
        out[p + "in_proj_qkv.weight"] = flat_qkv(out[p + "in_proj_qkv.weight"])
        out[p + "in_proj_z.weight"] = _rows(out[p + "in_proj_z.weight"], va * Dv, vb * Dv)
        for n in ("in_proj_b.weight", "in_proj_a.weight"):
            out[p + n] = _rows(out[p + n], va, vb)
    out[p + "conv1d.weight"] = flat_qkv(out[p + "conv1d.weight"])
    for n in ("dt_bias", "A_log"):
        out[p + n] = _rows(out[p + n], va, vb)
    out[p + "out_proj.weight"] = _cols(out[p + "out_proj.weight"], va * Dv, vb * Dv)


# -- experts ------------------------------------------------------------------------------------
def expert_weights(weights: list, inter: int, shard: Shard) -> list:
    """The rank's logical expert weights (``WeightSpec``) for a store's ``weights``; ValueError naming
    a weight whose format would be cut inside a block."""
    if inter % shard.world:
        raise ValueError(f"the expert intermediate size {inter} does not split over {shard.world} ranks")
    out = []
    for w in weights:
        shape = _local_shape(w, inter, shard.world)
        spec = WeightSpec(w.name, shape, w.format, dict(w.params))
        _slice(w, _meta_parts(w), shard, inter)           # raises where a block would be cut
        out.append(spec)
    return out


def _local_shape(w: WeightSpec, inter: int, N: int) -> tuple:
    s = tuple(w.shape)
    if w.name in ("gate", "up"):
        return (s[0] // N, s[1])
    if w.name == "down":
        return (s[0], s[1] // N)
    if w.name in ("gate_up", "gate_up_bias"):
        return (s[0] // N,) + s[1:]
    return s                                               # down_bias: whole (rank 0's, zeros elsewhere)


def _meta_parts(w: WeightSpec) -> dict:
    return {p.suffix: torch.empty(p.shape, dtype=p.dtype, device="meta") for p in w.fmt.parts(w.shape)}


def _slice(w: WeightSpec, parts: dict, shard: Shard, inter: int) -> dict:
    fmt, (a, b) = w.fmt, shard.part(inter)
    try:
        if w.name in ("gate", "up"):
            return fmt.slice_parts(w.shape, parts, rows=[(a, b)])
        if w.name == "down":
            return fmt.slice_parts(w.shape, parts, cols=(a, b))
        if w.name in ("gate_up", "gate_up_bias"):      # [gate | up]: the rank's rows of each half, gate first
            return fmt.slice_parts(w.shape, parts, rows=[(a, b), (inter + a, inter + b)])
    except ValueError as e:
        raise ValueError(f"expert weight {w.name} {tuple(w.shape)} ({w.format}) cannot split over {shard.world} "
                         f"tensor-parallel ranks: {e}") from None
    if w.name == "down_bias":
        return parts if shard.rank == 0 else {k: torch.zeros_like(v) for k, v in parts.items()}
    raise ValueError(f"expert weight {w.name!r} has no tensor-parallel split")


def slice_expert(weights: list, views: dict, inter: int, shard: Shard) -> dict:
    """One expert's blob views (``name.suffix`` -> tensor, the whole expert) -> the rank's raw tensors."""
    out = {}
    for w in weights:
        parts = {p.suffix: views[f"{w.name}.{p.suffix}"] for p in w.fmt.parts(w.shape)}
        out.update({f"{w.name}.{k}": v for k, v in _slice(w, parts, shard, inter).items()})
    return out


def rank_bytes_fraction(weights: list, local: list) -> float:
    """Bytes of a rank's slice / bytes of the whole expert."""
    whole = sum(w.fmt.nbytes(w.shape) for w in weights)
    return sum(w.fmt.nbytes(w.shape) for w in local) / whole if whole else 0.0




def rank_manifest(m, shard: Shard):
    """A store's manifest (runtime/store/layout.py) -> the one a rank's slices follow: the rank's logical
    weights, their tensors back to back, the slice's bytes and a 4 KiB-aligned stride (the same for every
    rank: the split is even). Checksums stay the whole blobs' (what the disk holds)."""
    from ..store.layout import ALIGN, Manifest, _align
    from ..expert_codec import blob_tensor_specs
    inter = next(w.shape[1] for w in m.weights if w.name == "down")
    local = expert_weights(m.weights, inter, shard)
    tensors, nbytes = Manifest.layout(blob_tensor_specs(local))
    return Manifest(model=m.model, num_layers=m.num_layers, num_experts=m.num_experts, tensors=tensors,
                    blob_bytes=nbytes, blob_stride=_align(nbytes, ALIGN), checksums=m.checksums,
                    layer_numbers=m.layer_numbers, extra=dict(m.extra), weights=local)


def stage_layers(cfg: MoEConfig, stages: int, stage: int) -> tuple:
    """((lo, hi), (a, b)): the model layers [lo, hi) and MoE layers [a, b) of pipeline stage ``stage`` of
    ``stages``: balanced MoE-layer ranges (cache_policy/layout.stage_ranges), the dense layers before the
    first MoE layer on the first stage, the layers after a range's last MoE layer with it."""
    from cache_policy.layout import stage_ranges
    a, b = stage_ranges(cfg.num_moe_layers, stages)[stage]
    lo = cfg.moe_layers[a] if stage else 0
    hi = cfg.moe_layers[b] if b < cfg.num_moe_layers else cfg.num_layers
    return (lo, hi), (a, b)



def allreduces_per_layer(cfg: MoEConfig, world: int) -> float:
    """All-reduces a layer costs on ``world`` tensor-parallel ranks, on average over the layers (one per split
    sublayer: every FFN; the attention where its heads split) - what cache_policy/layout.py charges."""
    if world <= 1:
        return 0.0
    p = plan(cfg, Shard(0, world))
    return (sum(p.attn_split) + sum(p.ffn_split)) / cfg.num_layers


__all__ = ["Shard", "ShardPlan", "plan", "shard_dense", "expert_weights", "slice_expert", "rank_bytes_fraction",
           "rank_manifest", "stage_layers", "allreduces_per_layer"]
