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

This module plans a rank's split (``plan``), a pipeline stage's layers and the all-reduces a layout costs.
The cuts themselves live where they are made: an expert's in runtime/store/slices.py (the store cuts the
blobs it reads); each attention kind and the MLP declare their own split (``head_split``, ``shard_tensors`` in
runtime/model/layers/, vLLM's column / row parallel linears with their weight loaders), walked per layer by
runtime/model/dense_slices.py (``load_model`` slices a rank's tensors). This module only combines them.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from cache_policy.layout import stage_ranges

from ..model.config import MoEConfig
from ..model.layers.kinds import attention_kind
from ..model.layers.protocol import HeadSplit
# A rank's slice of each expert is the store's (it cuts the blobs it reads) and of the dense tensors the
# model's (load_model slices them); both importable from here as before.
from ..model.dense_slices import shard_dense  # noqa: F401
from ..store.slices import Shard, expert_weights, rank_bytes_fraction, rank_manifest, slice_expert  # noqa: F401


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
    # each layer's attention kind says whether its heads split (layers/*.py ``head_split``): one softmax kind
    # and at most one linear kind per model
    lin = set(cfg.linear_layers)
    kinds = {i: attention_kind(cfg, i) for i in range(cfg.num_layers)}
    splits = {k: k.head_split(cfg, shard) for k in set(kinds.values())}
    soft = next((splits[kinds[i]] for i in cfg.attention_layers), HeadSplit())   # (not an empty attention's)
    linear_split = next((splits[kinds[i]] for i in sorted(lin)), None)
    changes = {"expert_intermediate": cfg.expert_intermediate // N}
    for sp in splits.values():
        if not sp.why:
            changes.update(sp.changes)
    dense_mlp = "split" if cfg.dense_intermediate % N == 0 else "rank0"
    if dense_mlp == "split":
        changes["dense_intermediate"] = cfg.dense_intermediate // N
    shared = "none" if not cfg.shared_intermediate else "split" if cfg.shared_intermediate % N == 0 else "rank0"
    if shared == "split":
        changes["shared_intermediate"] = cfg.shared_intermediate // N
    elif shared == "rank0" and r:
        changes.update(shared_intermediate=0, shared_expert_gate=False)
    local = dataclasses.replace(cfg, **changes)
    linear = "none" if linear_split is None else "replicated" if linear_split.why else "split"
    attn_split = tuple(not splits[kinds[i]].why for i in range(cfg.num_layers))
    # experts always split; dense MLPs split or rank 0's; an empty FFN (Nemotron-H) has nothing to split
    ffn_split = tuple(N > 1 and i not in cfg.empty_ffn_layers for i in range(cfg.num_layers))
    return ShardPlan(shard, local, attn_split, ffn_split, None if soft.why else soft.kv_heads, dense_mlp, shared,
                     soft.why, linear)


def stage_layers(cfg: MoEConfig, stages: int, stage: int) -> tuple:
    """((lo, hi), (a, b)): the model layers [lo, hi) and MoE layers [a, b) of pipeline stage ``stage`` of
    ``stages``: balanced MoE-layer ranges (cache_policy/layout.stage_ranges), the dense layers before the
    first MoE layer on the first stage, the layers after a range's last MoE layer with it."""
    a, b = stage_ranges(cfg.num_moe_layers, stages)[stage]
    lo = cfg.moe_layers[a] if stage else 0
    hi = cfg.moe_layers[b] if b < cfg.num_moe_layers else cfg.num_layers
    return (lo, hi), (a, b)



def shared_pick_cuts(cfg: MoEConfig, stages: int) -> list:
    """The layers at which a stage of ``stages`` starts that reuse the pick of the layer before them (GLM-5's shared
    DSA indexer, layers/dsa.py): the stage before keeps it, so such a cut cannot run."""
    starts = {stage_layers(cfg, stages, s)[0][0] for s in range(1, stages)}
    return sorted(starts & set(cfg.index_shared_layers))


def allreduces_per_layer(cfg: MoEConfig, world: int) -> float:
    """All-reduces a layer costs on ``world`` tensor-parallel ranks, on average over the layers (one per split
    sublayer: every FFN; the attention where its heads split) - what cache_policy/layout.py charges."""
    if world <= 1:
        return 0.0
    p = plan(cfg, Shard(0, world))
    return (sum(p.attn_split) + sum(p.ffn_split)) / cfg.num_layers


__all__ = ["Shard", "ShardPlan", "plan", "shard_dense", "expert_weights", "slice_expert", "rank_bytes_fraction",
           "rank_manifest", "stage_layers", "allreduces_per_layer"]
