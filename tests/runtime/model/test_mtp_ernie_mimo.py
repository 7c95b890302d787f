"""ERNIE 4.5's multi-token-prediction layer (runtime/model/mtp.py, arch/ernie4_5_moe.py) against transformers' own MTP
model (transformers.modeling_layers.MtpModel around Ernie4_5_MoeDecoderLayer), which reads it from the same checkpoint
by the release's names - an independent reading and an independent forward.

The release's layout (ERNIE-4.5-*-PT; transformers' conversion_mapping "MtpModel", vLLM's ernie_mtp.py, SGLang's
ernie4_eagle.py): ``model.mtp_emb_norm.0`` / ``model.mtp_hidden_norm.0`` (enorm / hnorm), ``model.mtp_linear_proj.0``
(eh_proj over concat(embeddings, hidden)), ``model.mtp_block.0.*`` a decoder layer with a dense MLP (decoder layer 0
of the MTP config: below moe_layer_start_index), and the model's own ``model.norm`` before the head. The fixture: a tiny
ERNIE 4.5 MoE (transformers' config class, sizes shrunk, num_nextn_predict_layers = 1 - the class's own field),
random weights, the MTP layer's tensors appended by those names."""
import importlib.util
import json
import os

import pytest
import torch

from helpers import require
from runtime.model.convert import Checkpoint, convert
from runtime.model import MoEConfig
from runtime.model.arch.ernie4_5_moe import deinterleave_rows
from runtime.model.mtp import has_mtp, load_mtp, mtp_checkpoint, mtp_dense_tensors, mtp_store_dir

transformers = require("transformers", "the test-only reference")

_spec = importlib.util.spec_from_file_location("_mtp_base", os.path.join(os.path.dirname(__file__), "test_mtp.py"))
base = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(base)                # _reference / mtp_layer / _ours / _seq / _close: the shared checks

ERNIE = dict(base.SIZES, num_key_value_heads=2, pad_token_id=None, moe_num_experts=16, moe_k=2,
             moe_intermediate_size=32, moe_num_shared_experts=1, moe_layer_start_index=1, num_nextn_predict_layers=1)
# transformers' MtpModel state (layers.0.*) -> the release's names; its post_norm is the model's final norm
ERNIE_PARTS = {"enorm.weight": "model.mtp_emb_norm.0.weight", "hnorm.weight": "model.mtp_hidden_norm.0.weight",
               "eh_proj.weight": "model.mtp_linear_proj.0.weight"}


def _randomize(m, mtp) -> None:
    base.randomize(m, mtp)
    with torch.no_grad():
        mtp.layers[0].post_norm.weight.copy_(m.model.norm.weight)     # the release stores one: model.norm


def build_ernie_mtp(out_dir: str, seed: int = 0, tie: bool = True, mtp_tensors: bool = True):
    """A tiny ERNIE 4.5 MoE checkpoint with one MTP layer by the release's names -> (transformers' model, its MTP
    model loaded back from the directory by those names)."""
    from safetensors.torch import load_file, save_file
    from transformers.modeling_layers import MtpModel
    torch.manual_seed(seed)
    c = transformers.Ernie4_5_MoeConfig(**ERNIE, tie_word_embeddings=tie)
    m = transformers.Ernie4_5_MoeForCausalLM(c).eval()
    mtp = MtpModel(m, 1).eval()
    _randomize(m, mtp)
    m.save_pretrained(out_dir)
    assert json.load(open(os.path.join(out_dir, "config.json")))["num_nextn_predict_layers"] == 1
    if not mtp_tensors:             # a re-upload without them (config.json still announces one)
        return m, None
    path = os.path.join(out_dir, "model.safetensors")
    tensors = load_file(path)
    for k, v in mtp.state_dict().items():
        k = k.removeprefix("layers.0.")
        if k.startswith("mtp_block."):
            tensors["model.mtp_block.0." + k.removeprefix("mtp_block.")] = v.contiguous()
        elif k in ERNIE_PARTS:
            tensors[ERNIE_PARTS[k]] = v.contiguous()
        else:
            assert k in ("post_norm.weight", "embed_tokens.weight", "shared_head.weight"), k
    save_file(tensors, path, metadata={"format": "pt"})
    ref = transformers.Ernie4_5_MoeForCausalLM.from_pretrained(out_dir).eval()
    mtp_ref = MtpModel.from_pretrained(ref).eval()
    got = mtp_ref.state_dict()
    for k, v in mtp.state_dict().items():     # transformers read every MTP weight back (none left at its init)
        assert torch.equal(got[k], v), f"transformers did not read {k} back from the release's names"
    assert isinstance(mtp_ref.layers[0].mtp_block.mlp, transformers.models.ernie4_5_moe.modeling_ernie4_5_moe.
                      Ernie4_5_MoeMLP)      # the MTP layer's FFN is dense
    return ref, mtp_ref


@pytest.fixture(scope="module")
def ernie(tmp_path_factory):
    d = tmp_path_factory.mktemp("ernie")
    ref, mtp_ref = build_ernie_mtp(str(d / "hf"))
    report = convert(str(d / "hf"), str(d / "store"))
    return ref, mtp_ref, str(d / "hf"), str(d / "store"), report


def test_conversion_keeps_the_dense_mtp_layer(ernie):
    """convert reads every MTP tensor (none reported unread) into the MTP part's dense tensors - no store of experts
    (the layer is dense) -, q / k rows reordered as the model's (convert_dense), the rest as shipped."""
    ref, mtp_ref, hf, store_dir, report = ernie
    assert report.mtp_layers == 1 and has_mtp(store_dir)
    assert not [n for n in report.unread if "mtp" in n], report.unread
    assert not os.path.exists(os.path.join(mtp_store_dir(store_dir), "manifest.json"))
    from safetensors.torch import load_file
    cfg = MoEConfig.from_hf(store_dir)
    d = load_file(os.path.join(mtp_store_dir(store_dir), "dense.safetensors"))
    assert set(d) == set(mtp_dense_tensors(cfg, 1))
    assert "model.layers.3.mlp.gate_proj.weight" in d and "model.layers.3.mlp.gate.weight" not in d
    ck = Checkpoint(hf)
    assert torch.equal(d["model.layers.3.enorm.weight"], ck.get("model.mtp_emb_norm.0.weight"))
    assert torch.equal(d["model.layers.3.eh_proj.weight"], ck.get("model.mtp_linear_proj.0.weight"))
    assert torch.equal(d["model.layers.3.shared_head.norm.weight"], ck.get("model.norm.weight"))
    assert torch.equal(d["model.layers.3.self_attn.q_proj.weight"],
                       deinterleave_rows(ck.get("model.mtp_block.0.self_attn.q_proj.weight"), 4, 16))
    assert not torch.equal(d["model.layers.3.self_attn.k_proj.weight"],
                           ck.get("model.mtp_block.0.self_attn.k_proj.weight"))
    seen = mtp_checkpoint(Checkpoint(hf), cfg)       # our names through the release's, reordered alike
    for k, v in d.items():
        assert torch.equal(v, seen.get(k)), k


@pytest.mark.parametrize("chunked", [True, False])
def test_mtp_forward_matches_transformers(ernie, chunked):
    """The MTP layer's logits and normed output at every position against transformers' MtpModel on the same weights
    and target hidden states: one prefill chunk, or the same positions fed one at a time (the decode path)."""
    ref, mtp_ref, hf, store_dir, report = ernie
    ids = torch.randint(0, 96, (11,), generator=torch.Generator().manual_seed(3)).tolist()
    h, want_out, want_logits = base._reference(ref, mtp_ref, ids)
    model, store, mtp = base._ours(store_dir)
    try:
        assert mtp.experts is None and mtp.chain_normed
        T = len(ids) - 1
        s = base._seq(mtp, T)
        if chunked:
            got = mtp.forward([s], [ids[1:]], h, every_token=True)
            torch.testing.assert_close(got.normed, want_out, rtol=1e-4, atol=1e-4)
            logits = got.logits
        else:
            logits = torch.stack([mtp.forward([s], [[ids[i + 1]]], h[i:i + 1]).logits[0] for i in range(T)])
        assert s.length == T
        torch.testing.assert_close(logits, want_logits, rtol=1e-4, atol=1e-4)
    finally:
        store.close()


def test_chained_draft_matches_transformers(ernie):
    """A second draft feeds the layer its own output after model.norm at the last position (transformers' MtpModel
    hands the next layer its post-normed output) with the first draft's token: transformers agrees."""
    ref, mtp_ref, hf, store_dir, report = ernie
    ids = torch.randint(0, 96, (9,), generator=torch.Generator().manual_seed(5)).tolist()
    h, _, _ = base._reference(ref, mtp_ref, ids)
    model, store, mtp = base._ours(store_dir)
    try:
        T = len(ids) - 1
        s = base._seq(mtp, T + 1)
        first = mtp.forward([s], [ids[1:]], h)
        torch.testing.assert_close(first.hidden, first.normed)
        d1 = int(first.logits[0].argmax())
        second = mtp.forward([s], [[d1]], first.hidden[-1:])
        with torch.no_grad():
            out = base.mtp_layer(mtp_ref, torch.cat([h, first.hidden[-1:]])[None], torch.arange(1, T + 2)[None],
                                 torch.tensor([ids[1:] + [d1]]))
            want = mtp_ref._project_to_logits(out)[0, -1].float()
        torch.testing.assert_close(second.logits[0], want, rtol=1e-4, atol=1e-4)
    finally:
        store.close()


def test_a_release_without_the_mtp_tensors_converts_without_them(tmp_path):
    """config.json announces an MTP layer the checkpoint does not ship (a re-upload): convert keeps none and does not
    fail; --speculative mtp then says the store holds none."""
    build_ernie_mtp(str(tmp_path / "hf"), mtp_tensors=False)
    report = convert(str(tmp_path / "hf"), str(tmp_path / "store"))
    assert report.mtp_layers == 0 and not has_mtp(str(tmp_path / "store"))
    from runtime.model import load_model
    model, store = load_model(str(tmp_path / "store"), dtype=torch.float32)
    try:
        with pytest.raises(ValueError, match="holds no MTP layers"):
            load_mtp(str(tmp_path / "store"), model)
    finally:
        store.close()


# -- MiMo-V2-Flash ----------------------------------------------------------------------------------------------------
# transformers has no MiMo-V2-Flash MTP model (MiMoV2FlashConfig drops num_mtp_layers), so the reference is the formula
# of vLLM's mimo_v2_mtp.py / SGLang's mimo_v2_flash_nextn.py written out below around transformers' own decoder layer
# of the sliding kind (MiMoV2FlashDecoderLayer: SWA heads, sinks, the sliding RoPE, a dense MLP):
#     x = eh_proj(concat(enorm(embed(t[i + 1])), hnorm(h[i])));  x = layer(x);  logits = head(final_layernorm(x))
# the release's names: model.mtp.layers.{j}.{enorm, hnorm, eh_proj, input_layernorm, self_attn.*,
# self_attn.attention_sink_bias, pre_mlp_layernorm, mlp.*, final_layernorm}.
MIMO = dict(base.SIZES, num_key_value_heads=1, pad_token_id=None, n_routed_experts=16, num_experts_per_tok=4,
            n_group=4, topk_group=2, moe_intermediate_size=32, head_dim=24, v_head_dim=16, sliding_window=6,
            layer_types=["full_attention", "sliding_attention", "sliding_attention"],
            mlp_layer_types=["dense", "sparse", "sparse"], routed_scaling_factor=2.0)
MIMO_BLOCK = {"post_attention_layernorm.weight": "pre_mlp_layernorm.weight",
              "self_attn.sinks": "self_attn.attention_sink_bias"}


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as the reference implementations write it (float32)."""
    x = x.float()
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def build_mimo_mtp(out_dir: str, seed: int = 0, tie: bool = False):
    """A tiny MiMo-V2-Flash checkpoint with one MTP layer by the release's names -> (transformers' model, the MTP
    layer's parts {enorm, hnorm, eh_proj, final_layernorm, block})."""
    from safetensors.torch import load_file, save_file
    torch.manual_seed(seed)
    kw = dict(MIMO, tie_word_embeddings=tie)
    m = transformers.MiMoV2FlashForCausalLM(transformers.MiMoV2FlashConfig(**kw)).eval()
    one = transformers.MiMoV2FlashConfig(**{**kw, "num_hidden_layers": 1, "layer_types": ["sliding_attention"],
                                            "mlp_layer_types": ["dense"]})
    one._attn_implementation = "eager"                      # transformers' sink-aware attention on CPU
    block = transformers.models.mimo_v2_flash.modeling_mimo_v2_flash.MiMoV2FlashDecoderLayer(one, 0).eval()
    H = m.config.hidden_size
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "norm" not in n:
                p.mul_(4.0)                                  # routing and logits far from ties
            if n.endswith(".sinks"):
                p.copy_(torch.randn(p.shape))
        for n, b in m.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape) * 0.5)
        for n, p in block.named_parameters():
            p.copy_(1 + 0.2 * torch.randn(p.shape) if "norm" in n else torch.randn(p.shape) * (1.0 if "sinks" in n
                                                                                                 else 0.08))
    parts = {"enorm": 1 + 0.2 * torch.randn(H), "hnorm": 1 + 0.2 * torch.randn(H),
             "eh_proj": torch.randn(H, 2 * H) * 0.08, "final_layernorm": 1 + 0.2 * torch.randn(H)}
    m.save_pretrained(out_dir)
    path = os.path.join(out_dir, "model.safetensors")
    tensors = load_file(path)
    p = "model.mtp.layers.0."
    tensors.update({p + k + ".weight": v.contiguous() for k, v in parts.items()})
    tensors.update({p + MIMO_BLOCK.get(k, k): v.contiguous() for k, v in block.state_dict().items()})
    save_file(tensors, path, metadata={"format": "pt"})
    cj = os.path.join(out_dir, "config.json")
    raw = json.load(open(cj))
    raw["num_nextn_predict_layers"] = 1   # the release's field, which MiMoV2FlashConfig does not define
    json.dump(raw, open(cj, "w"))
    ref = transformers.MiMoV2FlashForCausalLM.from_pretrained(out_dir).eval()
    ref.config._attn_implementation = "eager"
    return ref, {**parts, "block": block}


def mimo_reference(ref, mtp: dict, h: torch.Tensor, ids: list):
    """The MTP layer over positions 0..T-1 reading tokens ``ids`` [T] with the target's hidden states h [T, hidden]
    -> (its output before final_layernorm, after it, the logits) [T, ...]."""
    c, T = ref.config, len(ids)
    with torch.no_grad():
        e = ref.model.embed_tokens(torch.tensor([ids]))[0]
        x = torch.cat([rms(e, mtp["enorm"], c.rms_norm_eps), rms(h, mtp["hnorm"], c.rms_norm_eps)], -1) @ \
            mtp["eh_proj"].T
        pos = torch.arange(T)
        q, k = pos[:, None], pos[None, :]
        allowed = (k <= q) & (q - k < c.sliding_window)       # transformers' window: sliding_window keys, its own
        mask = torch.zeros(T, T).masked_fill(~allowed, float("-inf"))[None, None]
        cos_sin = ref.model.rotary_emb(x[None], pos[None], "sliding_attention")
        out = mtp["block"](x[None], attention_mask=mask, position_embeddings=cos_sin)[0]
        normed = rms(out, mtp["final_layernorm"], c.rms_norm_eps)
        return out, normed, ref.lm_head(normed).float()


@pytest.fixture(scope="module")
def mimo(tmp_path_factory):
    d = tmp_path_factory.mktemp("mimo")
    ref, mtp = build_mimo_mtp(str(d / "hf"))
    report = convert(str(d / "hf"), str(d / "store"))
    return ref, mtp, str(d / "hf"), str(d / "store"), report


def test_mimo_conversion_keeps_the_mtp_layer(mimo):
    """Every MTP tensor read (none unread), into dense tensors of a sliding-window layer with sinks and a dense MLP."""
    ref, mtp, hf, store_dir, report = mimo
    assert report.mtp_layers == 1 and has_mtp(store_dir)
    assert not [n for n in report.unread if "mtp" in n], report.unread
    from safetensors.torch import load_file
    cfg = MoEConfig.from_hf(store_dir)
    d = load_file(os.path.join(mtp_store_dir(store_dir), "dense.safetensors"))
    assert set(d) == set(mtp_dense_tensors(cfg, 1))
    ck = Checkpoint(hf)
    for ours, theirs in (("self_attn.sinks", "self_attn.attention_sink_bias"), ("shared_head.norm.weight",
                         "final_layernorm.weight"), ("post_attention_layernorm.weight", "pre_mlp_layernorm.weight"),
                         ("eh_proj.weight", "eh_proj.weight"), ("mlp.down_proj.weight", "mlp.down_proj.weight"),
                         ("self_attn.k_proj.weight", "self_attn.k_proj.weight")):
        assert torch.equal(d["model.layers.3." + ours], ck.get("model.mtp.layers.0." + theirs)), ours
    assert d["model.layers.3.self_attn.k_proj.weight"].shape[0] == 2 * 1 * 24    # the SWA layers' twice the KV heads


@pytest.mark.parametrize("chunked", [True, False])
def test_mimo_mtp_forward_matches_the_reference(mimo, chunked):
    """Logits and normed output at every position (past the 6-token window) against the reference formula on
    transformers' hidden states: one prefill chunk, or one position at a time (the ring's decode path)."""
    ref, parts, hf, store_dir, report = mimo
    ids = torch.randint(0, 96, (12,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.no_grad():
        h = ref.model(torch.tensor([ids[:-1]])).last_hidden_state[0]       # after the final norm
    _, want_out, want_logits = mimo_reference(ref, parts, h, ids[1:])
    model, store, mtp = base._ours(store_dir)
    try:
        assert mtp.experts is None and not mtp.chain_normed
        T = len(ids) - 1
        s = base._seq(mtp, T)
        if chunked:
            got = mtp.forward([s], [ids[1:]], h, every_token=True)
            torch.testing.assert_close(got.normed, want_out, rtol=1e-4, atol=1e-4)
            logits = got.logits
        else:
            logits = torch.stack([mtp.forward([s], [[ids[i + 1]]], h[i:i + 1]).logits[0] for i in range(T)])
        torch.testing.assert_close(logits, want_logits, rtol=1e-4, atol=1e-4)
    finally:
        store.close()


def test_mimo_chained_draft_matches_the_reference(mimo):
    """A second draft feeds the layer its output before final_layernorm at the last position (SGLang's multi-layer
    MTP) with the first draft's token: the reference on that same input agrees."""
    ref, parts, hf, store_dir, report = mimo
    ids = torch.randint(0, 96, (10,), generator=torch.Generator().manual_seed(5)).tolist()
    with torch.no_grad():
        h = ref.model(torch.tensor([ids[:-1]])).last_hidden_state[0]
    model, store, mtp = base._ours(store_dir)
    try:
        T = len(ids) - 1
        s = base._seq(mtp, T + 1)
        first = mtp.forward([s], [ids[1:]], h)
        out, _, _ = mimo_reference(ref, parts, h, ids[1:])
        torch.testing.assert_close(first.hidden[-1], out[-1], rtol=1e-4, atol=1e-4)     # chained: before the norm
        d1 = int(first.logits[0].argmax())
        second = mtp.forward([s], [[d1]], first.hidden[-1:])
        _, _, want = mimo_reference(ref, parts, torch.cat([h, first.hidden[-1:]]), ids[1:] + [d1])
        torch.testing.assert_close(second.logits[0], want[-1], rtol=1e-4, atol=1e-4)
    finally:
        store.close()
