"""Per-family config views (runtime/model/config_views.py): each family's layers read only their view; a
view exists only for a model with that family; bad family fields fail when the config is made, naming the
field; a tensor-parallel rank's config (dataclasses.replace) has views of its own fields. Configs come
from transformers' Config classes (the fixtures of conftest.py)."""
import dataclasses

import pytest

from conftest import ARCHS, hf_config, lm_config
from runtime.model import MoEConfig
from runtime.model.config_views import HyperFields, LinearFields, MLAFields, V4Fields


def cfg_of(name: str, **change) -> MoEConfig:
    d = hf_config(name).to_dict()
    lm_config(d).update(change)                 # a multimodal release: its text_config
    return MoEConfig.from_dict(d, source=f"{name}/config.json")


def test_each_fixture_has_exactly_its_families_views():
    """Every fixture architecture: the views present are those of its layer kinds (from transformers'
    config), the others refuse by family name."""
    for name in ARCHS:
        cfg = cfg_of(name)
        has = {"mla": cfg.attention == "mla", "linear": bool(cfg.linear_layers), "v4": cfg.attention == "v4",
               "hyper": cfg.hc_mult > 0}
        for view, cls in (("mla", MLAFields), ("linear", LinearFields), ("v4", V4Fields), ("hyper", HyperFields)):
            if has[view]:
                assert isinstance(getattr(cfg, view), cls), (name, view)
            else:
                with pytest.raises(ValueError, match=f"{cfg.model_type} has no {cls.FAMILY}"):
                    getattr(cfg, view)


def test_mla_view_reads_the_released_fields():
    hf = hf_config("deepseek_v3")
    m = cfg_of("deepseek_v3").mla
    assert (m.q_lora_rank, m.kv_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim) == \
        (hf.q_lora_rank, hf.kv_lora_rank, hf.qk_nope_head_dim, hf.qk_rope_head_dim, hf.v_head_dim)


@pytest.mark.parametrize("name,change,msg", [
    ("deepseek_v3", {"kv_lora_rank": 0}, "MLA needs a positive kv_lora_rank"),
    ("deepseek_v3", {"qk_rope_head_dim": 7}, "an even qk_rope_head_dim 7"),
    ("deepseek_v3", {"v_head_dim": 0}, "MLA needs a positive kv_lora_rank and v_head_dim"),
])
def test_bad_mla_fields_fail_at_load_naming_them(name, change, msg):
    with pytest.raises(ValueError, match=msg) as e:
        cfg_of(name, **change)
    assert f"{name}/config.json" in str(e.value)


def test_bad_family_fields_on_the_flat_record_fail_when_made():
    cfg = cfg_of("qwen3_next")
    with pytest.raises(ValueError, match="Gated DeltaNet needs linear_num_value_heads"):
        dataclasses.replace(cfg, linear_num_v_heads=cfg.linear_num_heads + 1)
    with pytest.raises(ValueError, match="linear-attention layer index out of range"):
        dataclasses.replace(cfg, linear_layers=[cfg.num_layers])
    with pytest.raises(ValueError, match="unknown attention 'mqa'"):
        dataclasses.replace(cfg, attention="mqa")


def test_a_rank_config_has_views_of_its_own_fields():
    """What LinearAttentionLayer.head_split gives a rank (the flat fields) is what the rank's view reads."""
    from runtime.model.layers.linear import LinearAttentionLayer
    from runtime.store.slices import Shard
    cfg = cfg_of("qwen3_next")
    split = LinearAttentionLayer.head_split(cfg, Shard(0, 2))
    rank = dataclasses.replace(cfg, **split.changes)
    assert (rank.linear.num_heads, rank.linear.num_v_heads) == (cfg.linear.num_heads // 2, cfg.linear.num_v_heads // 2)
    assert rank.linear.head_dim == cfg.linear.head_dim
