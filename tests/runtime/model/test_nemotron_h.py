"""Nemotron-H (runtime/model/arch/nemotron_h.py) beyond the per-architecture suite (conftest ARCHS "nemotron_h"): its
blocks paired onto our layers (empty sublayers where a mixer has no FFN block after it or an FFN block no mixer
before it) and their names, the released config forms, refusals, chunked prefill, the ungated relu^2 experts in
every stored format (the host kernels refuse them by name: the torch path computes them), a layer 0 without
attention, the latent experts, and a tensor-parallel rank's plan and slices."""
import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import ARCHS, build_hf, hf_config
from helpers import feed
from runtime import kernels
from runtime.model import MoEConfig, Sequence, load_model
from runtime.model.arch import nemotron_h
from runtime.model.convert import convert
from runtime.model.dense_slices import shard_dense
from runtime.parallel.shard import Shard, plan, rank_manifest
from runtime.store import Manifest

PATTERN = "ME-*M*EM-E*-M"                 # the fixture's blocks
# our layers: (mixer block, FFN block) of the checkpoint
PAIRS = [(0, 1), (None, 2), (3, None), (4, None), (5, 6), (7, 8), (None, 9), (10, 11), (12, None)]


@pytest.fixture(scope="module")
def nemotron(tmp_path_factory):
    d = tmp_path_factory.mktemp("nemotron_h")
    ref = build_hf("nemotron_h", str(d / "hf"))
    report = convert(str(d / "hf"), str(d / "store"))
    return ref, str(d / "hf"), str(d / "store"), report


def _config_dict() -> dict:
    return json.loads(hf_config("nemotron_h").to_json_string(use_diff=False))


def test_blocks_pair_onto_layers():
    kinds = nemotron_h.blocks({"hybrid_override_pattern": PATTERN})
    assert nemotron_h.pairs(kinds) == PAIRS
    cfg = MoEConfig.from_dict(_config_dict())
    assert (cfg.num_layers, cfg.moe_layers, cfg.linear_layers, cfg.nope_layers) == (9, [0, 4, 6], [0, 3, 5, 8], [2, 4, 7])
    assert (cfg.empty_attn_layers, cfg.empty_ffn_layers, cfg.attention_layers) == ([1, 6], [2, 3, 8], [2, 4, 7])
    assert nemotron_h.block_map(cfg) == PAIRS           # the names' map, from the config alone
    for pattern, want in (("M", [(0, None)]), ("E", [(None, 0)]), ("MM", [(0, None), (1, None)]),
                          ("EE-", [(None, 0), (None, 1), (None, 2)]), ("*E-M", [(0, 1), (None, 2), (3, None)])):
        assert nemotron_h.pairs(nemotron_h.blocks({"hybrid_override_pattern": pattern})) == want, pattern


def test_released_config_forms_read_alike():
    """The releases' form - the pattern's letters, the block count in num_hidden_layers, the Mamba fields' older names,
    a hidden_act transformers' config does not define - reads as transformers' own save does, and transformers reads
    it to the same blocks."""
    import transformers
    d = _config_dict()
    old = ("layers_block_type", "n_groups", "conv_kernel", "use_conv_bias", "time_step_limit")
    released = {k: v for k, v in d.items() if k not in old}
    released.update(hybrid_override_pattern=PATTERN, num_hidden_layers=len(PATTERN), mamba_n_groups=d["n_groups"],
                    mamba_d_conv=d["conv_kernel"], mamba_conv_bias=d["use_conv_bias"], hidden_act="relu2",
                    mamba_dt_limit=[0.0, float("inf")])
    ours, theirs = MoEConfig.from_dict(d, source="c.json"), MoEConfig.from_dict(released, source="c.json")
    assert ours == theirs
    assert transformers.NemotronHConfig.from_dict(released).layers_block_type == d["layers_block_type"]
    legacy = {**d, "layers_block_type": [{"linear_attention": "mamba", "full_attention": "attention"}.get(k, k)
                                          for k in d["layers_block_type"]]}
    assert MoEConfig.from_dict(legacy, source="c.json") == ours


BAD = [({"mlp_hidden_act": "gelu"}, "mlp_hidden_act 'gelu' is not supported"),
       ({"mamba_hidden_act": "relu"}, "mamba_hidden_act 'relu' is not supported"),
       ({"mlp_bias": True}, "mlp_bias"),
       ({"time_step_limit": [0.0, 10.0]}, r"time_step_limit \[0.0, 10.0\] is not supported"),
       ({"layers_block_type": ["linear_attention", "mlp", "full_attention"]}, "no MoE block"),
       ({"layers_block_type": None, "hybrid_override_pattern": "ME?"}, r"letters \['\?'\]"),
       ({"layers_block_type": ["linear_attention", "moe", "sliding_attention"]}, "block 2 has kind 'sliding_attention'")]


@pytest.mark.parametrize("change,msg", BAD, ids=[next(iter(c)) + str(i) for i, (c, _) in enumerate(BAD)])
def test_unsupported_options_are_refused_by_name(change, msg):
    d = {k: v for k, v in {**_config_dict(), **change}.items() if v is not None}
    with pytest.raises(ValueError, match=f"c.json: .*{msg}"):
        MoEConfig.from_dict(d, source="c.json")


def test_every_tensor_read_and_no_norm_for_an_empty_sublayer(nemotron):
    _, hf_dir, store_dir, report = nemotron
    assert report.unread == []
    dense = load_file(os.path.join(store_dir, "dense.safetensors"))
    assert "model.layers.1.post_attention_layernorm.weight" in dense                    # a MLP block alone
    assert "model.layers.1.input_layernorm.weight" not in dense
    assert "model.layers.2.input_layernorm.weight" in dense and "model.layers.2.mlp.up_proj.weight" not in dense
    names = nemotron_h.stored_names_of(MoEConfig.from_hf(hf_dir))
    assert names("model.layers.4.self_attn.q_proj.weight")[0] == "backbone.layers.5.mixer.q_proj.weight"
    assert names("model.layers.4.post_attention_layernorm.weight")[0] == "backbone.layers.6.norm.weight"
    assert names("model.layers.6.mlp.experts.3.up_proj.weight")[0] == "backbone.layers.9.mixer.experts.3.up_proj.weight"
    assert names("model.embed_tokens.weight")[0] == "backbone.embeddings.weight"
    assert {w.name: w.shape for w in Manifest.read(store_dir).weights} == {"up": (32, 64), "down": (64, 32)}


def test_chunked_prefill_matches_transformers(nemotron):
    """A 13-token prompt fed as 5 + 1 + 7 tokens (the Mamba and attention states carried across chunks), then 3
    decode tokens: the logits of each chunk's last token against transformers' on the whole text."""
    ref, _, store_dir, _ = nemotron
    text = torch.randint(0, 96, (16,), generator=torch.Generator().manual_seed(7)).tolist()
    with torch.no_grad():
        want = ref(torch.tensor([text])).logits[0]                     # want: [16, vocab]
    model, store = load_model(store_dir)
    try:
        s, ends, got = Sequence(), [], []
        for a, b in ((0, 5), (5, 6), (6, 13), (13, 14), (14, 15), (15, 16)):
            got.append(feed(model, [s], [text[a:b]])[0])
            ends.append(b - 1)
        assert (torch.stack(got) - want[ends]).abs().max().item() < 1e-4
    finally:
        store.close()


def test_layers_run_composed_and_the_host_kernels_refuse_relu2(nemotron):
    """No layer decodes fused, each for its reason; the experts take the torch path, the host kernel having refused
    their activation by name (and a blob without a gate, and the activation, where asked directly)."""
    _, _, store_dir, _ = nemotron
    model, store = load_model(store_dir)
    try:
        why = model.fused_why
        assert why[0] == why[3] == why[5] == why[8] == "mamba2 layers (no host kernel yet)"
        assert why[1] == why[2] == why[6] == "a layer with one sublayer (the fused kernels run an attention and an FFN)"
        assert why[4] == "experts without a host kernel, or not float32" and why[7] == "UngatedMLP has no fused host decode"
        assert model.executor.kernel is None and type(model.executor.backend).__name__ == "TorchExperts"
        if kernels.lib() is not None:
            assert model.executor.kernel_off == "expert activation relu2 has no host kernel"
            from runtime.kernels.moe import HostMoE, unsupported
            from runtime.quant import expert_weight_specs, get_format
            assert "without a gate projection" in unsupported(store.m.weights, 64, 32)
            with pytest.raises(ValueError, match="expert activation 'relu2' has no host kernel"):
                HostMoE(expert_weight_specs(64, 32, get_format("fp32")), 64, 32, 64, act="relu2")
    finally:
        store.close()


def _logp(store_dir: str, seq: list) -> torch.Tensor:
    model, store = load_model(store_dir)
    try:
        s = Sequence()
        out = [feed(model, [s], [seq[:8]])[0]] + [feed(model, [s], [[t]])[0] for t in seq[8:]]
        return torch.stack(out).log_softmax(-1)                          # [len(seq) - 7, vocab]
    finally:
        store.close()


@pytest.mark.parametrize("quant", ["mxfp4", "int4", "int8", "fp8", "bf16"])
def test_ungated_experts_in_every_format(nemotron, quant, tmp_path):
    """--quantize (the error report reading an ungated expert), or a bf16 checkpoint (its experts widened by the codec):
    up and down stored in the format, the next-token distributions near the float store's."""
    _, hf_dir, store_dir, _ = nemotron
    if quant == "bf16":
        src = str(tmp_path / "hf")
        os.makedirs(src)
        for f in os.listdir(hf_dir):
            if f.endswith(".safetensors"):
                save_file({k: v.to(torch.bfloat16) for k, v in load_file(os.path.join(hf_dir, f)).items()},
                          os.path.join(src, f), metadata={"format": "pt"})
            else:
                with open(os.path.join(hf_dir, f), "rb") as a, open(os.path.join(src, f), "wb") as b:
                    b.write(a.read())
        rep = convert(src, str(tmp_path / "q"))
    else:
        rep = convert(hf_dir, str(tmp_path / "q"), quantize=quant)
        assert 0 < rep.mean_rel_error <= rep.max_rel_error < {"fp8": 0.1, "int8": 0.05}.get(quant, 0.35)
    m = Manifest.read(str(tmp_path / "q"))
    assert sorted(w.name for w in m.weights) == ["down", "up"]
    assert m.expert_format == {"fp8": "fp8_e4m3"}.get(quant, quant)
    seq = torch.randint(0, 96, (20,), generator=torch.Generator().manual_seed(1)).tolist()
    lf, lq = _logp(store_dir, seq), _logp(str(tmp_path / "q"), seq)
    kl = (lf.exp() * (lf - lq)).sum(-1).mean().item()
    assert kl < {"bf16": 1e-3, "int8": 1e-3, "fp8": 0.01}.get(quant, 0.1), kl


def test_a_first_ffn_block_and_latent_experts_match_transformers(monkeypatch, tmp_path):
    """Blocks "E*-M-E" with the experts in a latent space (``moe_latent_size``): layer 0 has no attention (the MoE
    block first; transformers' cached forward cannot run it - its cache reads block 0's length - so its uncached
    forward is the reference, per position), the latent projections read as LatentMoE's."""
    cfg_cls, model_cls, kw = ARCHS["nemotron_h"]
    kinds = [nemotron_h.LETTERS[c] for c in "E*-M-E"]
    monkeypatch.setitem(ARCHS, "nemotron_h", (cfg_cls, model_cls, {**kw, "layers_block_type": kinds,
                                                                   "moe_latent_size": 32}))
    ref = build_hf("nemotron_h", str(tmp_path / "hf"))
    convert(str(tmp_path / "hf"), str(tmp_path / "store"))
    cfg = MoEConfig.from_hf(str(tmp_path / "store"))
    assert (cfg.latent_dim, cfg.empty_attn_layers, cfg.empty_ffn_layers) == (32, [0, 3], [])
    text = torch.randint(0, 96, (10,), generator=torch.Generator().manual_seed(2)).tolist()
    with torch.no_grad():
        want = ref(torch.tensor([text]), use_cache=False).logits[0]
    model, store = load_model(str(tmp_path / "store"))
    try:
        s = Sequence()
        got = torch.cat([feed(model, [s], [text[:4]])] + [feed(model, [s], [[t]]) for t in text[4:]])
        assert (got - want[3:]).abs().max().item() < 1e-4
    finally:
        store.close()


def test_tensor_parallel_plan_and_slices(nemotron):
    """Two ranks: the NoPE attention splits its heads, the Mamba-2 layers and empty sublayers split nothing (no
    all-reduce), the experts, dense MLPs and shared experts split along the intermediate axis (up rows, down
    columns)."""
    _, _, store_dir, _ = nemotron
    cfg = MoEConfig.from_hf(store_dir)
    p = plan(cfg, Shard(1, 2))
    assert [i for i, s in enumerate(p.attn_split) if s] == [2, 4, 7]
    assert [i for i, s in enumerate(p.ffn_split) if s] == [0, 1, 4, 5, 6, 7]
    assert (p.dense_mlp, p.shared, p.linear, p.kv_heads) == ("split", "split", "replicated", (1,))
    dense = shard_dense(cfg, p, load_file(os.path.join(store_dir, "dense.safetensors")))
    assert dense["model.layers.1.mlp.up_proj.weight"].shape == (24, 64)
    assert dense["model.layers.1.mlp.down_proj.weight"].shape == (64, 24)
    assert dense["model.layers.0.mlp.shared_experts.up_proj.weight"].shape == (24, 64)
    assert dense["model.layers.2.self_attn.q_proj.weight"].shape == (32, 64)
    assert {w.name: w.shape for w in rank_manifest(Manifest.read(store_dir), Shard(1, 2)).weights} == \
        {"up": (16, 64), "down": (64, 16)}
