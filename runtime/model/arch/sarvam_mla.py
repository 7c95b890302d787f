"""Sarvam-105B (``sarvam_mla``): DeepSeek-V3's model under its own config type - transformers runs it as
``DeepseekV3ForCausalLM`` - read through the ``deepseek_v3`` module once its original (remote-code) fields are
translated as transformers translates them: ``num_shared_experts`` -> ``n_shared_experts``, ``num_experts`` ->
``n_routed_experts``, the derived ``head_dim`` / ``q_head_dim`` dropped, ``deepseek_yarn`` RoPE as YaRN; and
transformers' SarvamMLA defaults where the config leaves them out (one dense first layer, one shared expert,
routed scaling 2.5, interleaved RoPE)."""

_DEFAULTS = {"first_k_dense_replace": 1, "n_shared_experts": 1, "routed_scaling_factor": 2.5, "n_group": 1,
             "topk_group": 1, "norm_topk_prob": True, "rope_interleave": True}


def language_model(d: dict) -> dict:
    d = {k: v for k, v in d.items() if k not in ("head_dim", "q_head_dim")}
    for legacy, ours in (("num_shared_experts", "n_shared_experts"), ("num_experts", "n_routed_experts")):
        if legacy in d and ours not in d:
            d[ours] = d.pop(legacy)
    rope = dict(d.get("rope_scaling") or {})
    if "deepseek_yarn" in (rope.get("type"), rope.get("rope_type")):
        d.pop("rope_scaling")
        d["rope_parameters"] = {**{k: v for k, v in rope.items() if k != "type"}, "rope_type": "yarn",
                                **{k: v for k, v in (d.get("rope_parameters") or {}).items() if k != "rope_type"}}
    for k, v in _DEFAULTS.items():
        if d.get(k) is None:
            d[k] = v
    return {**d, "model_type": "deepseek_v3"}
