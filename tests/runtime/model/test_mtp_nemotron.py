"""The multi-token-prediction layers of Nemotron-H / Nemotron 3 and Mellum (runtime/model/mtp.py through
arch/nemotron_h.py's and arch/mellum.py's ``mtp_layers`` / ``mtp_name``), each against an independent reference.

Nemotron-H: transformers does not run its MTP blocks (NemotronHForCausalLM ignores ``mtp.*``), so the reference is
vLLM's nemotron_h_mtp.py written out here: a step of blocks ``*E`` (the releases' ``mtp_hybrid_override_pattern`` /
``mtp_layers_block_type``), stored as ``mtp.layers.{0, 1}.*``, computes

    x = eh_proj(concat(enorm(embed(t[i + 1])), hnorm(h[i])))       # mtp.layers.0.{enorm, hnorm, eh_proj}
    x = attention block (mtp.layers.0: norm, NoPE GQA mixer) ; x = MoE block (mtp.layers.1: norm, MoE mixer)
    out = final_layernorm(x)  (mtp.layers.1.final_layernorm)     -> lm_head(out); out is the next draft's h

with transformers' own NemotronHBlock for the two blocks (its attention and MoE, not ours) and the MTP-specific parts
(enorm, hnorm, eh_proj, final_layernorm) as plain torch below. Mellum: transformers' MtpModel runs it (its Mellum
layout in conversion_mapping.py: ``mtp.fc``, ``mtp.pre_fc_norm_embedding`` / ``_hidden``, ``mtp.layers.0.*``,
``mtp.norm``), as test_mtp.py checks the other architectures; its MTP layer is a sliding-window one (MellumConfig's
default ``mtp_layer_types``) with the sliding layers' RoPE."""
import importlib.util
import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers import require
from runtime.model import MoEConfig
from runtime.model.arch import mellum, nemotron_h
from runtime.model.convert import convert
from runtime.model.mtp import has_mtp, mtp_store_dir
from runtime.store import ExpertStore, Manifest

transformers = require("transformers", "the test-only reference")


def _sibling(name: str):
    """A module of this folder by its path (tests/runtime/engine's MTP tests load this file the same way)."""
    spec = importlib.util.spec_from_file_location(f"_mtp_nemotron_{name}", os.path.join(os.path.dirname(__file__),
                                                                                        name + ".py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


fixture_kwargs = _sibling("conftest").fixture_kwargs        # the per-architecture fixtures' config keywords
_mtp = _sibling("test_mtp")                                  # test_mtp.py's store / MTP-layer helpers
_close, _ours, _seq, mtp_layer = _mtp._close, _mtp._ours, _mtp._seq, _mtp.mtp_layer

L_NEMOTRON = 9          # conftest's nemotron_h blocks "ME-*M*EM-E*-M" pair onto 9 layers of ours: the MTP layer is 9


def _scale(m, mtp_params) -> None:
    """Weights far from ties (as conftest.build_hf): the model's scaled, the MTP parts' drawn; norms that matter."""
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "norm" not in n and not n.endswith(("A_log", "dt_bias")):
                p.mul_(4.0)
        for n, b in m.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape) * 0.5)
        for n, p in mtp_params:
            if n.endswith("e_score_correction_bias"):
                p.copy_(torch.randn(p.shape) * 0.5)
            elif "norm" in n:
                p.copy_(1 + 0.2 * torch.randn(p.shape))
            else:
                p.copy_(torch.randn(p.shape) * 0.15)


# -- Nemotron-H ------------------------------------------------------------------------------------------------------
class NemotronMTPRef:
    """vLLM's NemotronH MTP step over transformers' NemotronHBlock (blocks ``*E``) and the model's embedding / head."""

    def __init__(self, model, blocks, parts: dict, eps: float) -> None:
        self.model, self.blocks, self.parts, self.eps = model, blocks, parts, eps

    def _rms(self, x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * w

    @torch.no_grad()
    def step(self, h: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """h [1, T, hidden] (the target's normed states at positions i), ids [1, T] (t[i + 1]) -> the output after
        final_layernorm [1, T, hidden]."""
        P, T = self.parts, ids.shape[1]
        emb = self.model.get_input_embeddings()(ids)
        x = torch.cat([self._rms(emb, P["enorm"]), self._rms(h, P["hnorm"])], -1) @ P["eh_proj"].T
        mask = torch.full((T, T), float("-inf")).triu(1)[None, None]             # causal over the MTP's positions
        x = self.blocks[0](x, attention_mask=mask)
        x = self.blocks[1](x)
        return self._rms(x, P["final_layernorm"])

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(out).float()


def build_nemotron_mtp(out_dir: str, seed: int = 0):
    """conftest's Nemotron-H fixture with one MTP step ``*E`` (num_nextn_predict_layers, mtp_layers_block_type: fields
    of NemotronHConfig), its tensors appended as the releases name them -> (transformers' model, the reference)."""
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHBlock
    C, kw = fixture_kwargs("nemotron_h")
    torch.manual_seed(seed)
    c = C(**kw, num_nextn_predict_layers=1, mtp_layers_block_type=["full_attention", "moe"])
    m = transformers.NemotronHForCausalLM(c).eval()
    cs = C(**{**kw, "layers_block_type": ["full_attention", "moe"]})      # the step's two blocks, as layers 0 and 1
    cs._attn_implementation = "eager"
    blocks = [NemotronHBlock(cs, 0).eval(), NemotronHBlock(cs, 1).eval()]
    H = c.hidden_size
    parts = {"enorm": torch.nn.Parameter(torch.empty(H)), "hnorm": torch.nn.Parameter(torch.empty(H)),
             "eh_proj": torch.nn.Parameter(torch.empty(H, 2 * H)),
             "final_layernorm": torch.nn.Parameter(torch.empty(H))}
    params = list(parts.items()) + [(f"b{k}.{n}", p) for k, b in enumerate(blocks) for n, p in b.named_parameters()]
    _scale(m, params + [(f"b{k}.{n}", x) for k, b in enumerate(blocks) for n, x in b.named_buffers()
                        if n.endswith("e_score_correction_bias")])
    m.save_pretrained(out_dir)
    extra = {f"mtp.layers.0.{k}.weight": parts[k].detach() for k in ("enorm", "hnorm", "eh_proj")}
    extra["mtp.layers.1.final_layernorm.weight"] = parts["final_layernorm"].detach()
    for k, b in enumerate(blocks):
        for n, v in b.state_dict().items():
            if n.startswith("mixer.experts."):        # transformers' fused [E, out, in]: the release's per expert
                extra.update({f"mtp.layers.{k}.mixer.experts.{e}.{n.rsplit('.', 1)[1]}.weight": v[e].contiguous()
                              for e in range(v.shape[0])})
            else:
                extra[f"mtp.layers.{k}.{n}"] = v.contiguous()
    path = os.path.join(out_dir, "model.safetensors")
    save_file({**load_file(path), **extra}, path, metadata={"format": "pt"})
    return m, NemotronMTPRef(m, blocks, {k: p.detach() for k, p in parts.items()}, c.layer_norm_epsilon)


# -- Mellum ----------------------------------------------------------------------------------------------------------
MELLUM_PARTS = {"enorm.weight": "mtp.pre_fc_norm_embedding.weight", "hnorm.weight": "mtp.pre_fc_norm_hidden.weight",
                "eh_proj.weight": "mtp.fc.weight", "post_norm.weight": "mtp.norm.weight"}


def build_mellum_mtp(out_dir: str, seed: int = 0):
    """conftest's Mellum fixture (sliding window 6) with its one MTP layer (num_mtp_layers: MellumConfig's field,
    saved as num_nextn_predict_layers; mtp_layer_types / mtp_mlp_layer_types left at their defaults, sliding and
    sparse), appended as the release names it -> (transformers' model, its MtpModel loaded back by those names)."""
    from transformers.modeling_layers import MtpModel
    C, kw = fixture_kwargs("mellum")
    torch.manual_seed(seed)
    c = C(**kw, num_mtp_layers=1)
    m = transformers.MellumForCausalLM(c).eval()
    mtp = MtpModel(m, 1).eval()
    _scale(m, [(n, p) for n, p in mtp.named_parameters() if not n.startswith(("embed_tokens", "shared_head"))])
    m.save_pretrained(out_dir)
    I, extra = c.moe_intermediate_size, {}
    for k, v in mtp.state_dict().items():
        if not k.startswith("layers.0."):
            continue
        k = k[len("layers.0."):]
        if k.startswith("mtp_block.mlp.experts."):      # fused gate_up [E, 2I, H] (gate rows first), down [E, H, I]
            w = k.rsplit(".", 1)[1]
            for e in range(v.shape[0]):
                if w == "gate_up_proj":
                    extra[f"mtp.layers.0.mlp.experts.{e}.gate_proj.weight"] = v[e, :I].contiguous()
                    extra[f"mtp.layers.0.mlp.experts.{e}.up_proj.weight"] = v[e, I:].contiguous()
                else:
                    extra[f"mtp.layers.0.mlp.experts.{e}.down_proj.weight"] = v[e].contiguous()
        elif k.startswith("mtp_block."):
            extra["mtp.layers.0." + k.removeprefix("mtp_block.")] = v.contiguous()
        else:
            extra[MELLUM_PARTS[k]] = v.contiguous()
    path = os.path.join(out_dir, "model.safetensors")
    save_file({**load_file(path), **extra}, path, metadata={"format": "pt"})
    ref = transformers.MellumForCausalLM.from_pretrained(out_dir).eval()
    mtp_ref = MtpModel.from_pretrained(ref).eval()
    got = mtp_ref.state_dict()
    for k, v in mtp.state_dict().items():     # transformers read every MTP weight back from the release's names
        assert torch.equal(got[k], v), f"transformers did not read {k} back"
    return ref, mtp_ref


class MellumMTPRef:
    """transformers' MtpModel for Mellum, behind the reference's step / logits."""

    def __init__(self, model, mtp_ref) -> None:
        self.model, self.mtp_ref = model, mtp_ref

    @torch.no_grad()
    def step(self, h: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(1, ids.shape[1] + 1)[None]                  # transformers rotates the token's position
        return mtp_layer(self.mtp_ref, h, pos, ids)

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        return self.mtp_ref._project_to_logits(out).float()


def build(arch: str, out_dir: str, seed: int = 0):
    """-> (transformers' model, the MTP reference: step(h, ids) / logits(out))."""
    if arch == "nemotron_h":
        return build_nemotron_mtp(out_dir, seed)
    ref, mtp_ref = build_mellum_mtp(out_dir, seed)
    return ref, MellumMTPRef(ref, mtp_ref)


ARCH_MTP = {"nemotron_h": L_NEMOTRON, "mellum": 3}      # arch -> our index of its MTP layer (the layer count)


@pytest.fixture(scope="module", params=list(ARCH_MTP))
def fixture(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    model, ref = build(request.param, str(d / "hf"))
    report = convert(str(d / "hf"), str(d / "store"))
    return request.param, model, ref, str(d / "hf"), str(d / "store"), report


def _reference(model, ref, ids: list):
    """The target's normed hidden states h of ids[:-1] (transformers' model), the MTP step over ids[1:] -> (h [T,
    hidden], output [T, hidden], logits [T, vocab])."""
    with torch.no_grad():
        x = torch.tensor([ids])
        h = model.model(x[:, :-1]).last_hidden_state
        out = ref.step(h, x[:, 1:])
        return h[0], out[0], ref.logits(out)[0]


# what each release names our MTP tensors (checked against the converted store's, independently of mtp_name)
RELEASE_NAMES = {
    "nemotron_h": {"eh_proj.weight": "mtp.layers.0.eh_proj.weight",
                   "input_layernorm.weight": "mtp.layers.0.norm.weight",
                   "self_attn.k_proj.weight": "mtp.layers.0.mixer.k_proj.weight",
                   "post_attention_layernorm.weight": "mtp.layers.1.norm.weight",
                   "mlp.gate.e_score_correction_bias": "mtp.layers.1.mixer.gate.e_score_correction_bias",
                   "mlp.shared_experts.down_proj.weight": "mtp.layers.1.mixer.shared_experts.down_proj.weight",
                   "shared_head.norm.weight": "mtp.layers.1.final_layernorm.weight"},
    "mellum": {"eh_proj.weight": "mtp.fc.weight", "enorm.weight": "mtp.pre_fc_norm_embedding.weight",
               "self_attn.q_norm.weight": "mtp.layers.0.self_attn.q_norm.weight",
               "self_attn.o_proj.bias": "mtp.layers.0.self_attn.o_proj.bias",
               "mlp.gate.weight": "mtp.layers.0.mlp.gate.weight", "shared_head.norm.weight": "mtp.norm.weight"},
}
EXPERT = {"nemotron_h": ("mtp.layers.1.mixer.experts.{e}.up_proj.weight", "up"),
          "mellum": ("mtp.layers.0.mlp.experts.{e}.gate_proj.weight", "gate_up")}


def test_conversion_keeps_the_mtp_layer(fixture):
    """convert reads every ``mtp.*`` tensor (none reported unread) into the store's mtp/ part: its dense tensors as
    the release has them, its experts a store of one layer (the experts' bytes as shipped)."""
    arch, model, ref, hf, store_dir, report = fixture
    L = ARCH_MTP[arch]
    assert report.mtp_layers == 1 and has_mtp(store_dir)
    assert not [n for n in report.unread if n.startswith("mtp.")], report.unread
    m = Manifest.read(mtp_store_dir(store_dir))
    assert (m.num_layers, m.num_experts, m.layer_numbers) == (1, 16, [L])
    release = load_file(os.path.join(hf, "model.safetensors"))
    dense = load_file(os.path.join(mtp_store_dir(store_dir), "dense.safetensors"))
    for ours, theirs in RELEASE_NAMES[arch].items():
        assert torch.equal(dense[f"model.layers.{L}.{ours}"], release[theirs]), ours
    assert not [k for k in dense if "embed_tokens" in k or "shared_head.head" in k]     # the model's own are used
    name, blob = EXPERT[arch]
    from runtime.expert_codec import ExpertCodec
    codec = ExpertCodec(m.weights, torch.float32, "cpu")
    with ExpertStore(mtp_store_dir(store_dir), device_budget=16 * m.blob_stride) as st:
        for e in (0, 9, 15):
            f = st.request(0, [e], 0)
            f.wait()
            t = codec.dequantize_all(f.tensors(e))[blob].float()
            want = release[name.format(e=e)].float()
            assert torch.equal(t[:want.shape[0]], want), e


@pytest.mark.parametrize("budget", ["all", "tiered"])
def test_mtp_forward_matches_the_reference(fixture, budget):
    """The MTP layer's logits and normed output at every position against the reference on the same weights and
    target hidden states: one chunk (past Mellum's window of 6), then position by position (the decode path); experts
    all on the device or one token's top-k of them."""
    arch, model, ref, hf, store_dir, report = fixture
    ids = torch.randint(0, 96, (12,), generator=torch.Generator().manual_seed(3)).tolist()
    h, want_out, want_logits = _reference(model, ref, ids)
    ours, store, mtp = _ours(store_dir, **({} if budget == "all" else {"device_fraction": 0.0}))
    mtp.init_kv(256, state_slots=2)            # two sequences below: Mellum's sliding MTP layer keeps a ring each
    try:
        T = len(ids) - 1
        s = _seq(mtp, T)
        got = mtp.forward([s], [ids[1:]], h, every_token=True)
        torch.testing.assert_close(got.logits, want_logits, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got.normed, want_out, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got.hidden, want_out, rtol=1e-4, atol=1e-4)    # chained after the final norm
        s2 = _seq(mtp, T)
        rows = [mtp.forward([s2], [[ids[i + 1]]], h[i:i + 1]).logits[0] for i in range(T)]
        torch.testing.assert_close(torch.stack(rows), want_logits, rtol=1e-4, atol=1e-4)
    finally:
        _close(ours, store, mtp)


def test_chained_draft_matches_the_reference(fixture):
    """A second draft reads the layer's own output at the last position (after its final norm: vLLM's NemotronH
    chaining, transformers' MtpModel's) with the first draft's token: the reference on that input agrees."""
    arch, model, ref, hf, store_dir, report = fixture
    ids = torch.randint(0, 96, (10,), generator=torch.Generator().manual_seed(5)).tolist()
    h, _, _ = _reference(model, ref, ids)
    ours, store, mtp = _ours(store_dir)
    try:
        first, d1, second = _mtp.chain_two(mtp, ids, h)
        out = ref.step(torch.cat([h, first.hidden[-1:]])[None], torch.tensor([ids[1:] + [d1]]))
        torch.testing.assert_close(second.logits[0], ref.logits(out)[0, -1], rtol=1e-4, atol=1e-4)
    finally:
        _close(ours, store, mtp)


def test_nemotron_mtp_config_forms():
    """The step layouts the releases write (Nemotron 3 Super's ``mtp_hybrid_override_pattern: "*E"``, Ultra's
    ``mtp_layers_block_type: ["attention", "moe"]``, transformers' own save) read as one MTP layer each, as
    transformers reads them to the blocks attention, MoE; any other step (or none) as none, its tensors left unread."""
    base = {"num_nextn_predict_layers": 1}
    for form in ({"mtp_hybrid_override_pattern": "*E"}, {"mtp_layers_block_type": ["attention", "moe"]},
                 {"mtp_layers_block_type": ["full_attention", "moe"]}, {}):
        assert nemotron_h.mtp_layers({**base, **form}) == 1, form
        assert transformers.NemotronHConfig(**base, **form).mtp_layers_block_type == ["full_attention", "moe"], form
    for form in ({"mtp_hybrid_override_pattern": "*E*E"}, {"mtp_hybrid_override_pattern": "M*E"},
                 {"mtp_layers_block_type": ["moe"]}, {"mtp_hybrid_override_pattern": "*?"},
                 {"num_nextn_predict_layers": 0}):
        assert nemotron_h.mtp_layers({**base, **form}) == 0, form
    assert nemotron_h.mtp_layers({"num_nextn_predict_layers": 2}) == 2          # MTP layer j: blocks 2j and 2j + 1
    assert nemotron_h.mtp_name(1, "self_attn.q_proj.weight") == "mtp.layers.2.mixer.q_proj.weight"
    assert nemotron_h.mtp_name(1, "mlp.latent_down.weight") == "mtp.layers.3.mixer.fc1_latent_proj.weight"
    C, kw = fixture_kwargs("nemotron_h")
    d = json.loads(C(**kw, num_nextn_predict_layers=1).to_json_string(use_diff=False))
    cfg = MoEConfig.from_dict(d)
    assert cfg.nope_layers == [2, 4, 7, L_NEMOTRON]          # the MTP layer's attention has no RoPE either


def test_mellum_mtp_config_forms():
    """One sparse MTP layer is read (sliding: the model's window and sliding RoPE on it; full: neither); a dense one
    or more than one (MellumConfig refuses those) is not."""
    C, kw = fixture_kwargs("mellum")
    d = json.loads(C(**kw, num_mtp_layers=1).to_json_string(use_diff=False))
    assert d["num_nextn_predict_layers"] == 1 and mellum.mtp_layers(d) == 1
    cfg = MoEConfig.from_dict(d)
    assert (cfg.sliding_layers, cfg.sliding_window, cfg.sliding_rope_theta) == ([1, 2, 3], 6, 1e4)
    full = MoEConfig.from_dict({**d, "mtp_layer_types": ["full_attention"]})
    assert full.sliding_layers == [1, 2] and full == MoEConfig.from_dict({**d, "num_nextn_predict_layers": 0})
    for change in ({"mtp_mlp_layer_types": ["dense"]}, {"num_nextn_predict_layers": 2},
                   {"num_nextn_predict_layers": 0}):
        assert mellum.mtp_layers({**d, **change}) == 0, change


UNREADABLE = {"nemotron_h": {"mtp_layers_block_type": ["moe", "full_attention"]},     # a step this does not run
              "mellum": {"mtp_mlp_layer_types": ["dense"]}}                            # a dense MTP layer


def test_an_mtp_layout_not_run_is_reported_unread(fixture, tmp_path):
    """A release whose MTP layer is of a layout this does not run converts as before: its ``mtp.*`` tensors reported
    unread, no mtp/ part."""
    import shutil
    arch, model, ref, hf, store_dir, report = fixture
    other = tmp_path / "hf"
    shutil.copytree(hf, other)
    with open(other / "config.json") as f:
        d = json.load(f)
    with open(other / "config.json", "w") as f:
        json.dump({**d, **UNREADABLE[arch]}, f)
    rep = convert(str(other), str(tmp_path / "store"))
    assert rep.mtp_layers == 0 and not has_mtp(str(tmp_path / "store"))
    shipped = load_file(os.path.join(hf, "model.safetensors"))
    assert {n for n in rep.unread if n.startswith("mtp.")} == {n for n in shipped if n.startswith("mtp.")}
