"""A tensor-parallel rank's slice of the checkpoint's dense tensors (``shard_dense``): attention heads,
linear-attention heads, shared-expert and dense-MLP intermediate rows and columns, as the rank's
``ShardPlan`` says (runtime/parallel/shard.py plans the split and describes it whole).

In the model package because it is the model's tensor table, read per layer kind, and because
``load_model`` slices a rank's tensors as it loads them: the parallel package sits above the model and
imports this, not the other way."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..store.slices import Shard
from .config import MoEConfig
from .layers.weights import layer_prefix

if TYPE_CHECKING:           # annotations only: the plan is made above the model (runtime/parallel/shard.py)
    from ..parallel.shard import ShardPlan


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
