"""A tensor-parallel rank's slice of the checkpoint's dense tensors (``shard_dense``): attention heads,
linear-attention heads, shared-expert and dense-MLP intermediate rows and columns, as the rank's
``ShardPlan`` says (runtime/parallel/shard.py plans the split and describes it whole). The cuts are the
layer kinds' own (``shard_tensors``); this walks the layers.

In the model package because it is the model's tensor table, read per layer kind, and because
``load_model`` slices a rank's tensors as it loads them: the parallel package sits above the model and
imports this, not the other way."""
from __future__ import annotations

from typing import TYPE_CHECKING

from .config import MoEConfig
from .layers.kinds import attention_kind
from .layers.mlp import mlp_kind
from .layers.weights import layer_prefix

if TYPE_CHECKING:           # annotations only: the plan is made above the model (runtime/parallel/shard.py)
    from ..parallel.shard import ShardPlan


def shard_dense(cfg: MoEConfig, p: ShardPlan, dense: dict) -> dict:
    """The checkpoint's dense tensors -> this rank's (a new dict; replicated tensors are shared, not copied).
    Each layer kind cuts its own (``shard_tensors``: attention kinds, the MLPs)."""
    N, r = p.shard.world, p.shard.rank
    out = dict(dense)
    if N == 1:
        return out
    mlp = mlp_kind(cfg)
    for i in range(cfg.num_layers):
        pre = layer_prefix(i)
        if pre + cfg.layer_norms(i)[0] not in out:
            continue                      # another pipeline stage's layer
        if p.attn_split[i]:
            attention_kind(cfg, i).shard_tensors(cfg, i, out, p)
        if i in cfg.moe_layers:
            if p.shared != "none":
                mlp.shard_tensors(out, pre + cfg.shared_prefix, cfg.shared_intermediate, p.shared, p.shard)
                if p.shared == "rank0" and r:
                    out.pop(pre + "mlp.shared_expert_gate.weight", None)
        elif i not in cfg.empty_ffn_layers:
            mlp.shard_tensors(out, pre + cfg.mlp_prefix, cfg.dense_intermediate, p.dense_mlp, p.shard)
    return out
