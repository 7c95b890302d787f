"""DeepSeek-V4's multi-token-prediction layer (runtime/model/arch/deepseek_v4_mtp.py through runtime/model/mtp.py)
against an independent reference: transformers has no V4 MTP model (its DeepseekV4ForCausalLM drops ``mtp.*`` on
load), so the MTP-specific parts are the release's formula written out here in torch (DeepSeek-V4's
``inference/model.py`` ``MTPBlock.forward`` / ``ParallelHead.hc_head``, as vLLM's ``deepseek_v4_mtp.py`` runs it):

    x = e_proj(enorm(embed(t[i + 1])))[:, :, None] + h_proj(hnorm(h[i]))   # h: the target's streams before hc_head
    x = block(x)                                                           # a V4 decoder block over the streams
    logits = head(norm(hc_head(x)))                                        # the layer's own hc_head and norm

with transformers' own ``DeepseekV4DecoderLayer`` as the block, and the target's streams taken from transformers'
model (the input of its ``hc_head``).

The fixture: the tiny DeepSeek-V4 of tests/runtime/model/conftest.py (``deepseek_v4``: HCA, CSA and sliding layers,
2 streams, hash-routed first layer; transformers' DeepseekV4Config, whose ``num_nextn_predict_layers`` is 1), its MTP
layer appended as the release names it (``mtp.0.*``): a sliding-window block (the released ``compress_ratios`` give
the MTP layer 0) routed by scores, its weights those of the model's layer 2 (the same kinds) perturbed."""
import copy
import importlib.util
import os

import pytest
import torch
import torch.nn.functional as F

from helpers import feed, require
from runtime.engine.kv_manager import KVManager
from runtime.model import MoEConfig, load_model
from runtime.model.arch import deepseek_v4
from runtime.model.arch.deepseek_v4 import released_name
from runtime.model.convert import Checkpoint, convert
from runtime.model.layers.cache import Sequence
from runtime.model.mtp import has_mtp, load_mtp, mtp_checkpoint, mtp_dense_tensors, mtp_store_dir
from runtime.store import Manifest

transformers = require("transformers", "the test-only reference")
_spec = importlib.util.spec_from_file_location("_model_conftest", os.path.join(os.path.dirname(__file__), "conftest.py"))
mc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(mc)              # build_hf: the tiny DeepSeek-V4 checkpoint

V, L = 96, 3


class Reference:
    """transformers' target and the MTP layer: the block (a DeepseekV4DecoderLayer) and the MTP-specific tensors."""

    def __init__(self, ref, block, P: dict) -> None:
        self.ref, self.block, self.P = ref, block, P

    def streams(self, ids: list) -> torch.Tensor:
        """The target's streams after its last layer (the input of its hc_head) of ids -> [T, N, hidden]."""
        got = {}
        hook = self.ref.model.hc_head.register_forward_pre_hook(lambda mod, args: got.__setitem__("h", args[0]))
        try:
            with torch.no_grad():
                self.ref.model(torch.tensor([ids]))
        finally:
            hook.remove()
        return got["h"][0]

    def mtp(self, h: torch.Tensor, nxt: list) -> "tuple[torch.Tensor, torch.Tensor, torch.Tensor]":
        """The MTP layer over positions 0..T-1 with streams h [T, N, hidden] and the tokens after them nxt [T] ->
        (its output streams [T, N, hidden], the head's normed input [T, hidden], logits [T, vocab])."""
        P, cfg, model = self.P, self.ref.config, self.ref.model
        eps = cfg.rms_norm_eps

        def rms(x, w):
            return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))
        with torch.no_grad():
            ids = torch.tensor([nxt])
            emb = model.embed_tokens(ids)                                         # [1, T, hidden]
            x = (rms(emb, P["enorm"]) @ P["e_proj"].T)[:, :, None, :] + rms(h[None], P["hnorm"]) @ P["h_proj"].T
            pos = torch.arange(len(nxt))[None]
            from transformers.masking_utils import create_sliding_window_causal_mask
            mask = create_sliding_window_causal_mask(
                config=cfg, inputs_embeds=emb, attention_mask=None, cache=None, position_ids=pos)
            pe = {k: model.rotary_emb(emb, position_ids=pos, layer_type=k) for k in ("main", "compress")}
            x = self.block(x, position_embeddings=pe, position_ids=pos, attention_mask=mask, input_ids=ids, cache=None)
            flat = x.flatten(2)                                                   # the layer's own hc_head
            flat = flat * torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + eps)
            pre = torch.sigmoid(F.linear(flat, P["hc_fn"]) * P["hc_scale"] + P["hc_base"]) + cfg.hc_eps
            normed = rms((pre[..., None] * x).sum(2), P["norm"])
            return x[0], normed[0], self.ref.lm_head(normed)[0].float()


def build_v4_mtp(out_dir: str, seed: int = 0) -> Reference:
    """The tiny DeepSeek-V4 with one MTP layer in ``out_dir`` (release names ``mtp.0.*``) -> the reference."""
    from safetensors.torch import load_file, save_file
    ref = mc.build_hf("deepseek_v4", out_dir, seed=seed)
    g = torch.Generator().manual_seed(seed + 7)
    block = copy.deepcopy(ref.model.layers[2]).eval()     # layer 2: sliding window, score-routed - the MTP's kinds
    with torch.no_grad():
        for n, p in list(block.named_parameters()) + list(block.named_buffers()):
            p.add_(0.3 * p.float().std().clamp(min=0.1) * torch.randn(p.shape, generator=g))
    H, N = ref.config.hidden_size, ref.config.hc_mult
    P = {"enorm": 1 + 0.2 * torch.randn(H, generator=g), "hnorm": 1 + 0.2 * torch.randn(H, generator=g),
         "norm": 1 + 0.2 * torch.randn(H, generator=g), "e_proj": 0.5 * torch.randn(H, H, generator=g),
         "h_proj": 0.5 * torch.randn(H, H, generator=g), "hc_fn": 0.1 * torch.randn(N, N * H, generator=g),
         "hc_base": torch.randn(N, generator=g), "hc_scale": torch.rand(1, generator=g) + 0.5}
    path = os.path.join(out_dir, "model.safetensors")
    t = load_file(path)
    out = {"mtp.0.enorm.weight": P["enorm"], "mtp.0.hnorm.weight": P["hnorm"], "mtp.0.norm.weight": P["norm"],
           "mtp.0.e_proj.weight": P["e_proj"], "mtp.0.h_proj.weight": P["h_proj"], "mtp.0.hc_head_fn": P["hc_fn"],
           "mtp.0.hc_head_base": P["hc_base"], "mtp.0.hc_head_scale": P["hc_scale"]}
    I = ref.config.moe_intermediate_size
    for k, v in block.state_dict().items():
        if k.startswith("mlp.experts."):                   # per expert, as released: w1 / w3 (gate / up), w2 (down)
            for e in range(v.shape[0]):
                base = f"mtp.0.ffn.experts.{e}."
                if k.endswith("gate_up_proj"):
                    out[base + "w1.weight"], out[base + "w3.weight"] = v[e, :I], v[e, I:]
                else:
                    out[base + "w2.weight"] = v[e]
        else:
            out["mtp.0." + released_name("model.layers.0." + k)[len("layers.0."):]] = v
    save_file({**t, **{k: v.contiguous() for k, v in out.items()}}, path, metadata={"format": "pt"})
    return Reference(ref, block, P)


@pytest.fixture(scope="module")
def v4(tmp_path_factory):
    d = tmp_path_factory.mktemp("v4_mtp")
    r = build_v4_mtp(str(d / "hf"))
    report = convert(str(d / "hf"), str(d / "store"))
    return r, str(d / "hf"), str(d / "store"), report


def _ours(store_dir: str, **kw):
    model, store = load_model(store_dir, dtype=torch.float32)
    mtp = load_mtp(store_dir, model, **kw)
    mtp.init_kv(256, state_slots=2)
    return model, store, mtp


def _close(store, mtp):
    mtp.experts.close()
    store.close()


def _seq(mtp, n: int) -> Sequence:
    s = Sequence()
    KVManager.for_cache(mtp.kv).ensure(s, n)
    return s


def _ids(n: int, seed: int) -> list:
    return torch.randint(0, V, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_conversion_keeps_the_mtp_layer(v4):
    """convert reads every mtp.0.* tensor (none unread) into the MTP part: its experts a store of their own, its dense
    tensors (the layer's own parts, block, hyper-connections) as the checkpoint has them."""
    r, hf, store_dir, report = v4
    assert report.mtp_layers == 1 and has_mtp(store_dir)
    assert not [n for n in report.unread if n.startswith("mtp.")], report.unread
    m = Manifest.read(mtp_store_dir(store_dir))
    assert (m.num_layers, m.num_experts, m.layer_numbers) == (1, 16, [L])
    from safetensors.torch import load_file
    cfg = MoEConfig.from_hf(store_dir)
    d = load_file(os.path.join(mtp_store_dir(store_dir), "dense.safetensors"))
    assert set(d) == set(mtp_dense_tensors(cfg, 1))
    ck = mtp_checkpoint(Checkpoint(hf), cfg)
    for k, v in d.items():
        assert torch.equal(v, ck.get(k)), k
    assert torch.equal(d[f"model.layers.{L}.e_proj.weight"], r.P["e_proj"])
    assert torch.equal(d[f"model.layers.{L}.hc_head.hc_fn"], r.P["hc_fn"])


@pytest.mark.parametrize("budget", ["all", "tiered"])
def test_mtp_forward_matches_the_reference(v4, budget):
    """The MTP layer's logits, normed head input and output streams at every position against the reference on
    transformers' own target streams: one prefill chunk (longer than the 6-token window), then the same positions
    fed one at a time (the decode path); experts all on the device, or tiered (one token's top-k slots)."""
    r, hf, store_dir, report = v4
    ids = _ids(13, 3)
    h = r.streams(ids[:-1])                                               # [T, N, hidden]
    want_x, want_normed, want_logits = r.mtp(h, ids[1:])
    model, store, mtp = _ours(store_dir, **({} if budget == "all" else {"device_fraction": 0.0}))
    try:
        T = len(ids) - 1
        s = _seq(mtp, T)
        got = mtp.forward([s], [ids[1:]], h.reshape(T, -1), every_token=True)
        assert s.length == T
        torch.testing.assert_close(got.logits, want_logits, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got.normed, want_normed, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got.hidden, want_x.reshape(T, -1), rtol=1e-4, atol=1e-4)
        s2 = _seq(mtp, T)
        rows = [mtp.forward([s2], [[ids[i + 1]]], h[i].reshape(1, -1)).logits[0] for i in range(T)]
        torch.testing.assert_close(torch.stack(rows), want_logits, rtol=1e-4, atol=1e-4)
    finally:
        _close(store, mtp)


def test_chained_draft_and_state_rollback(v4):
    """A second draft reads the layer's own output streams at the last position with the first draft's token: the
    reference on that same input agrees. Then the state the chained positions wrote (the window ring) is put back
    by restore_state: positions fed again after it give what a fresh sequence gives."""
    r, hf, store_dir, report = v4
    ids = _ids(10, 5)
    h = r.streams(ids[:-1])
    T = len(ids) - 1
    model, store, mtp = _ours(store_dir)
    try:
        s = _seq(mtp, T + 4)
        first = mtp.forward([s], [ids[1:T - 2]], h[:T - 3].reshape(T - 3, -1))
        saved = mtp.save_state([s])
        d1 = int(first.logits[0].argmax())
        second = mtp.forward([s], [[d1]], first.hidden[-1:])
        hh = torch.cat([h[:T - 3], first.hidden[-1:].view(1, *h.shape[1:])])
        want = r.mtp(hh, ids[1:T - 2] + [d1])[2][-1]
        torch.testing.assert_close(second.logits[0], want, rtol=1e-4, atol=1e-4)
        mtp.forward([s], [[5, 6]], torch.randn(2, h[0].numel()))            # more speculative positions
        mtp.restore_state([s], saved)
        s.length = T - 3                                                     # back to the caught-up positions
        again = mtp.forward([s], [ids[T - 2:]], h[T - 3:].reshape(3, -1), every_token=True)
        torch.testing.assert_close(again.logits, r.mtp(h, ids[1:])[2][T - 3:], rtol=1e-4, atol=1e-4)
    finally:
        _close(store, mtp)


def test_target_hands_its_streams(v4):
    """What the target's forward hands an MTP drafter once the MTP layer is loaded (StepHooks.token_hidden, its
    draft_rows "streams"): each chunk's rows of streams after the last layer, as transformers' model has them before
    its hc_head, flat; a target without V4's MTP layer loaded hands its normed hidden states."""
    from runtime.model import StepHooks
    r, hf, store_dir, report = v4
    ids = _ids(11, 9)
    model, store, mtp = _ours(store_dir)
    try:
        got = {}
        hooks = StepHooks(token_hidden=lambda seq, row, h: got.setdefault(len(got), h))
        seq = Sequence()
        feed(model, [seq], [ids[:7]], hooks)
        feed(model, [seq], [ids[7:]], hooks)                                 # a second chunk: positions 7..10
        want = r.streams(ids)                                                # [tokens, N, hidden]
        assert model.draft_rows == "streams" and [g.shape[0] for g in got.values()] == [7, 4]
        torch.testing.assert_close(torch.cat([got[0], got[1]]), want.reshape(len(ids), -1), rtol=1e-4, atol=1e-4)
        model.draft_rows = "normed"                                          # as before load_mtp set it
        got.clear()
        feed(model, [Sequence()], [ids[:7]], hooks)
        assert got[0].shape == (7, want.shape[-1])
    finally:
        _close(store, mtp)


def _released_v4():
    spec = importlib.util.spec_from_file_location("_v4_released", os.path.join(os.path.dirname(__file__),
                                                                                "test_deepseek_v4.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)                  # write_released, fp4 / fp8 quantizers: the released V4 layout
    return mod


def test_released_quantized_layout(v4, tmp_path):
    """The release's own layout: the model as test_deepseek_v4 writes it (DeepSeek's names, FP8 dense Linears with
    E8M0 tile scales, FP4 routed experts) and the MTP layer likewise - e_proj / h_proj, its attention and shared
    expert in FP8 (``mtp.0.e_proj.scale``...), its experts in FP4 -: converted, its forward against the reference on
    the dequantized weights."""
    from safetensors.torch import load_file, save_file
    rel = _released_v4()
    r = v4[0]
    q = str(tmp_path / "q")
    ref = type(r.ref)(r.ref.config).eval()
    ref.load_state_dict(rel.write_released(r.ref, q, "fp4"))
    block, P = copy.deepcopy(r.block), dict(r.P)
    out, deq = {}, {}
    for k, v in r.block.state_dict().items():
        if k.startswith("mlp.experts."):
            I = r.ref.config.moe_intermediate_size
            for e in range(v.shape[0]):
                mats = {"w1": v[e, :I], "w3": v[e, I:]} if k.endswith("gate_up_proj") else {"w2": v[e]}
                for wn, wt in mats.items():
                    b = f"mtp.0.ffn.experts.{e}.{wn}."
                    out[b + "weight"], out[b + "scale"], mats[wn] = rel.fp4_quantize(wt)
                deq.setdefault(k, v.clone())[e] = torch.cat([mats["w1"], mats["w3"]]) if "w1" in mats else mats["w2"]
            continue
        n = "mtp.0." + released_name("model.layers.0." + k)[len("layers.0."):]
        if v.dim() == 2 and any(f in "." + n for f in rel.FP8_DENSE):
            out[n], out[n[:-len("weight")] + "scale"], deq[k] = rel.fp8_quantize(v, 16)
        else:
            out[n], deq[k] = v, v
    block.load_state_dict(deq)
    for nm in ("e_proj", "h_proj"):
        out[f"mtp.0.{nm}.weight"], out[f"mtp.0.{nm}.scale"], P[nm] = rel.fp8_quantize(r.P[nm], 16)
    out.update({"mtp.0.enorm.weight": P["enorm"], "mtp.0.hnorm.weight": P["hnorm"], "mtp.0.norm.weight": P["norm"],
                "mtp.0.hc_head_fn": P["hc_fn"], "mtp.0.hc_head_base": P["hc_base"], "mtp.0.hc_head_scale": P["hc_scale"]})
    path = os.path.join(q, "model.safetensors")
    t = {k: v for k, v in load_file(path).items() if not k.startswith("mtp.")}   # not write_released's stand-in
    save_file({**t, **{k: v.contiguous() for k, v in out.items()}}, path, metadata={"format": "pt"})
    report = convert(q, str(tmp_path / "store"))
    assert report.mtp_layers == 1 and not [n for n in report.unread if n.startswith("mtp.")], report.unread
    assert Manifest.read(mtp_store_dir(str(tmp_path / "store"))).expert_format == "mxfp4"   # stored as shipped
    assert not torch.equal(P["e_proj"], r.P["e_proj"])          # the FP8 rounding is what the reference computes with
    want = Reference(ref, block, P)
    ids = _ids(12, 4)
    h = want.streams(ids[:-1])
    _, want_normed, want_logits = want.mtp(h, ids[1:])
    model, store, mtp = _ours(str(tmp_path / "store"))
    try:
        got = mtp.forward([_seq(mtp, 11)], [ids[1:]], h.reshape(11, -1), every_token=True)
        torch.testing.assert_close(got.logits, want_logits, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got.normed, want_normed, rtol=1e-4, atol=1e-4)
    finally:
        _close(store, mtp)


def test_mtp_layers_read_from_the_config():
    """num_nextn_predict_layers, but none where the released compress_ratios give the MTP layer a compressed kind
    (then convert reports its tensors unread); our names of its parts -> the release's."""
    assert deepseek_v4.mtp_layers({"num_nextn_predict_layers": 1, "num_hidden_layers": 2,
                                   "compress_ratios": [4, 128, 0]}) == 1
    assert deepseek_v4.mtp_layers({"num_nextn_predict_layers": 1, "num_hidden_layers": 2,
                                   "compress_ratios": [4, 128, 4]}) == 0
    assert deepseek_v4.mtp_layers({"num_hidden_layers": 2}) == 0
    assert deepseek_v4.mtp_name(0, "self_attn.q_a_proj.weight") == "mtp.0.attn.wq_a.weight"
    assert deepseek_v4.mtp_name(1, "mlp.experts.3.down_proj.weight") == "mtp.1.ffn.experts.3.w2.weight"
    assert deepseek_v4.mtp_name(0, "ffn_hc.fn") == "mtp.0.hc_ffn_fn"
    assert deepseek_v4.mtp_name(0, "shared_head.norm.weight") == "mtp.0.norm.weight"
    assert deepseek_v4.mtp_name(0, "mlp.gate.e_score_correction_bias") == "mtp.0.ffn.gate.bias"


def test_hidden_of_the_wrong_width_is_named(v4):
    r, hf, store_dir, report = v4
    model, store, mtp = _ours(store_dir)
    try:
        with pytest.raises(ValueError, match=r"hidden states \(1, 64\) for 1 tokens of hidden size 128"):
            mtp.forward([_seq(mtp, 1)], [[1]], torch.zeros(1, 64))     # the normed hidden state, not the streams
    finally:
        _close(store, mtp)
