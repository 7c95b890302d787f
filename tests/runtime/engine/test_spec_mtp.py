"""The MTP drafter (runtime/engine/mtp_drafter.py) in the engine: greedy outputs token for token those of plain
decoding with ``--speculative mtp`` on DeepSeek-V3 (MLA) and GLM-4.5 (GQA) checkpoints whose MTP layer is random
(drafts are made and verified, few kept); on a checkpoint built so the MTP layer predicts the token after next
exactly (the copy construction below) every draft is kept - which needs each draft made from the right token at the
right position, chained right; the first draft after a prompt against transformers' MtpModel on transformers' own
hidden states; a gap in the hidden states (prefix cache) restarts the mirror."""
import importlib.util
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from runtime.engine import Engine, SamplingParams
from runtime.engine.mtp_drafter import MTPDrafter
from runtime.engine.request import Request, distribution
from runtime.engine.speculative import DRAFTERS, SpecOptions
from runtime.model import load_model
from runtime.model.convert import convert
from runtime.model.mtp import load_mtp
from runtime.store import Manifest

_spec = importlib.util.spec_from_file_location(
    "_mtp_fixtures", os.path.join(os.path.dirname(__file__), "..", "model", "test_mtp.py"))
fixtures = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fixtures)            # build_mtp_checkpoint: tiny checkpoints with an MTP layer

V = fixtures.SIZES["vocab_size"]


@pytest.fixture(scope="module", params=list(fixtures.FIXTURES))
def random_mtp(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    ref, mtp_ref = fixtures.build_mtp_checkpoint(request.param, str(d / "hf"))
    convert(str(d / "hf"), str(d / "store"))
    return request.param, str(d / "store"), ref, mtp_ref


def copy_construction(hf: str) -> None:
    """Rewrite a DeepSeek-V3 checkpoint so the token after next is what its MTP layer predicts, exactly. Every
    sublayer's output projection is zeroed (attention o_proj, dense MLP / shared / routed experts' down_proj) in the
    model and in its MTP layer: each residual stream stays its input, so the model's next token is
    f(t) = argmax head(norm(embed(t))) - a function of the last token. The MTP layer's eh_proj is [identity | 0]
    (it reads the token, not the hidden state), enorm's weight is ones and shared_head.norm's the final norm's, so it
    computes head(norm(embed(t[i + 1]))) = f(t[i + 1]) = t[i + 2]. Routing still runs (the experts are fetched and
    computed: their outputs are zero)."""
    path = os.path.join(hf, "model.safetensors")
    L = max(int(k.split(".")[2]) for k in load_file(path) if k.startswith("model.layers."))
    p = f"model.layers.{L}."
    read_the_token(hf, ("o_proj.weight", "down_proj.weight"), p + "eh_proj.weight", p + "enorm.weight",
                   p + "shared_head.norm.weight")


def read_the_token(hf: str, outputs: tuple, proj: str, enorm: str, head_norm: "str | None" = None,
                   final: str = "model.norm.weight") -> None:
    """The copy construction on ``hf``'s model.safetensors, in an architecture's names: every tensor whose name ends
    with one of ``outputs`` (the sublayers' output projections) zeroed, the MTP input projection ``proj`` [identity |
    0] (the layer reads the token, not the hidden state), its embedding norm ``enorm`` ones and, where the layer has
    a head norm of its own, ``head_norm`` the model's final norm ``final``."""
    path = os.path.join(hf, "model.safetensors")
    t = load_file(path)
    for k in t:
        if k.endswith(outputs):
            t[k] = torch.zeros_like(t[k])
    H = t[enorm].shape[0]
    t[proj] = torch.cat([torch.eye(H), torch.zeros(H, H)], 1).to(t[proj].dtype)
    t[enorm] = torch.ones_like(t[enorm])
    if head_norm is not None:
        t[head_norm] = t[final].clone()
    save_file(t, path, metadata={"format": "pt"})


@pytest.fixture(scope="module")
def copy_mtp(tmp_path_factory):
    d = tmp_path_factory.mktemp("copy")
    fixtures.build_mtp_checkpoint("deepseek_v3", str(d / "hf"), seed=1)
    copy_construction(str(d / "hf"))
    convert(str(d / "hf"), str(d / "store"))
    return str(d / "store")


def _prompts(n: int = 3):
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, V, (L,), generator=g).tolist() for L in (9, 4, 14)][:n]


def _run(store_dir: str, prompts: list, spec, max_batch: int, max_tokens: int = 12, log=None, **kw):
    """Outputs, drafted and accepted tokens; ``log``: each proposal's (context, draft tokens) appended."""
    model, store = load_model(store_dir, dtype=torch.float32, **kw)
    try:
        eng = Engine(model, store, max_batch=max_batch, prefill_chunk=5, speculative=spec)
        if log is not None:
            propose = eng.drafter.propose

            def logged(reqs, ks):
                out = propose(reqs, ks)
                log.extend((list(r.prompt) + list(r.output), list(d.tokens)) for r, d in zip(reqs, out))
                return out
            eng.drafter.propose = logged
        ids = [eng.add_request(p, SamplingParams(max_tokens=max_tokens, ignore_eos=True)) for p in prompts]
        eng.run()
        reqs = [eng.done[i] for i in ids]
        drafter = eng.drafter
        if drafter is not None:
            drafter.close()
        return [r.output for r in reqs], sum(r.spec_drafted for r in reqs), sum(r.spec_accepted for r in reqs)
    finally:
        store.close()


def greedy_identical(store_dir: str, max_batch: int, run=None, prompts=None, label=None) -> None:
    """Greedy outputs with ``--speculative mtp`` (k = 3, the fixed rule) token for token those of plain decoding, and
    drafts made (the test_spec_mtp_* files' check of each architecture). ``run`` / ``prompts``: a file's own."""
    run, prompts = run or _run, prompts or _prompts()
    plain, _, _ = run(store_dir, prompts, None, max_batch)
    spec, drafted, accepted = run(store_dir, prompts, SpecOptions("mtp", 3, rule="fixed"), max_batch)
    assert spec == plain, label
    assert drafted > 0, label


def copy_keeps_every_draft(store_dir: str, tiered: bool = True, run=None, prompts=None, label=None) -> None:
    """On a copy construction (the MTP layer predicts the token after next exactly): every draft kept at k = 3 and the
    outputs those of plain decoding; ``tiered``: a quarter of the target's experts on the device (the MTP store the
    same fraction)."""
    run, prompts = run or _run, prompts or _prompts()
    plain, _, _ = run(store_dir, prompts, None, 3, max_tokens=16)
    for out in plain:          # f has no short cycle here: a draft off by one position would be rejected
        assert len(set(out[:6])) >= 4, (label, out)
    m = Manifest.read(store_dir)
    kw = {"expert_budget": max(4, m.num_layers * m.num_experts // 4) * m.blob_stride} if tiered else {}
    spec, drafted, accepted = run(store_dir, prompts, SpecOptions("mtp", 3, rule="fixed"), 3, max_tokens=16, **kw)
    assert spec == plain, label
    assert drafted >= 3 * len(prompts) * 3 and accepted == drafted, (label, drafted, accepted)


@pytest.mark.parametrize("max_batch", [1, 3])
def test_greedy_outputs_identical_with_mtp(random_mtp, max_batch):
    arch, store_dir, _, _ = random_mtp
    greedy_identical(store_dir, max_batch, label=arch)


def test_copy_construction_keeps_every_draft(copy_mtp):
    """Acceptance set by construction: 100% of the drafts, at k = 3 and with a tiered target and MTP store."""
    copy_keeps_every_draft(copy_mtp)


def test_greedy_identical_with_experts_on_disk(copy_mtp):
    """A target whose host tier holds 3 / 4 of its experts (the rest read from disk) and whose device tier holds a
    quarter: the MTP store gets the same device fraction (its host holds its one layer's experts, so a catch-up
    chunk's waves fit); outputs as plain decoding's, drafts made and kept."""
    m = Manifest.read(copy_mtp)
    n = m.num_layers * m.num_experts
    kw = dict(expert_budget=max(8, n // 4) * m.blob_stride, host_budget=3 * n // 4 * m.blob_stride)
    prompts = _prompts(2)
    plain, _, _ = _run(copy_mtp, prompts, None, 1, max_tokens=10, **kw)
    spec, drafted, accepted = _run(copy_mtp, prompts, SpecOptions("mtp", 3, rule="fixed"), 1, max_tokens=10, **kw)
    assert spec == plain and accepted > 0, (drafted, accepted)


def test_sampled_copy_keeps_its_drafts(copy_mtp):
    """Sampling: on the copy construction the MTP layer's distribution q of the token after next is the target's p
    there (the same logits), so the accept / reject rule keeps a draft with probability min(1, p / q) = 1 (up to
    rounding): nearly every draft is kept, and every request still emits max_tokens tokens."""
    model, store = load_model(copy_mtp, dtype=torch.float32)
    try:
        eng = Engine(model, store, max_batch=3, speculative=SpecOptions("mtp", 3, rule="fixed"))
        ids = [eng.add_request(p, SamplingParams(max_tokens=16, ignore_eos=True, temperature=1.0, seed=i))
               for i, p in enumerate(_prompts())]
        eng.run()
        reqs = [eng.done[i] for i in ids]
        eng.drafter.close()
    finally:
        store.close()
    drafted, accepted = sum(r.spec_drafted for r in reqs), sum(r.spec_accepted for r in reqs)
    assert all(len(r.output) == 16 for r in reqs)
    assert drafted >= 9 and accepted >= 0.9 * drafted, (drafted, accepted)


def test_first_draft_matches_transformers(random_mtp):
    """The drafter fed transformers' own normed hidden states of a prompt drafts, after the target's next token,
    the argmax of transformers' MtpModel at the prompt's last position; then a second request with the same
    prompt but a gap (its first rows missing, as a prefix cache hit leaves them) still drafts."""
    arch, store_dir, ref, mtp_ref = random_mtp
    prompt = _prompts(1)[0]
    model, store = load_model(store_dir, dtype=torch.float32)
    d = MTPDrafter(load_mtp(store_dir, model), 256)
    try:
        with torch.no_grad():
            x = torch.tensor([prompt])
            h = ref.model(x).last_hidden_state[0]                       # [T, hidden], after the final norm
            nxt = int(ref(x).logits[0, -1].argmax())
            ids = torch.tensor([prompt[1:] + [nxt]])
            out = fixtures.mtp_layer(mtp_ref, h[None], torch.arange(1, len(prompt) + 1)[None], ids)
            want = int(mtp_ref._project_to_logits(out)[0, -1].argmax())
        r = Request(id=0, prompt=list(prompt), params=SamplingParams(max_tokens=8))
        r.seq.length = 5                              # a first prompt chunk of 5 tokens ran
        d.prefilled(r, h[:5])
        r.seq.length = len(prompt)
        d.prefilled(r, h)                             # overlapping rows: only the new ones are kept
        r.output = [nxt]
        got = d.propose([r], [2])[0]
        assert got.tokens[0] == want and len(got.tokens) == 2 and got.probs is None
        assert d.mirrors[0].seq.length == len(prompt) and d.restarts == 0
        # a sampled request: draft 1's q is the request's distribution of transformers' MTP logits
        params = SamplingParams(max_tokens=8, temperature=0.7, top_k=20, seed=3)
        rs = Request(id=2, prompt=list(prompt), params=params, output=[nxt])
        rs.seq.length = len(prompt)
        d.prefilled(rs, h)
        got = d.propose([rs], [3])[0]
        q_ref = distribution(mtp_ref._project_to_logits(out)[0, -1].float(), params).float()
        assert got.probs.shape == (3, V) and torch.allclose(got.probs[0], q_ref, atol=1e-5)
        assert all(float(got.probs[i, t]) > 0 for i, t in enumerate(got.tokens))
        d.release(rs)
        r2 = Request(id=1, prompt=list(prompt), params=SamplingParams(max_tokens=8), output=[nxt])
        r2.seq.length = len(prompt)
        d.prefilled(r2, h[8:])                        # positions 0..7 came from the prefix cache: no rows
        assert len(d.propose([r2], [1])[0].tokens) == 1 and d.mirrors[1].pos0 == 8
        d.MAX_PENDING = 4                             # a request that has not drafted for long keeps its last rows
        r3 = Request(id=3, prompt=list(prompt), params=SamplingParams(max_tokens=8), output=[nxt])
        r3.seq.length = len(prompt)
        d.prefilled(r3, h)
        m3 = d.mirrors[3]
        assert (m3.pos0, m3.known, d.restarts) == (len(prompt) - 4, len(prompt), 1)
        assert torch.equal(torch.cat(m3.pending), h[-4:])
        assert d.propose([r3], [1])[0].tokens
        d.release(r)
        d.release(r2)
        d.release(r3)
        assert d.kv.free_blocks == d.kv.num_blocks
    finally:
        d.close()
        store.close()


def test_mtp_is_registered_and_refuses_a_store_without_mtp(tmp_path):
    from runtime.model.synthetic import SyntheticModelSpec, build_checkpoint
    assert DRAFTERS["mtp"].__module__ == "runtime.engine.mtp_drafter"
    build_checkpoint(str(tmp_path / "hf"), SyntheticModelSpec(num_layers=2, num_experts=8, hidden_size=64,
                                                              intermediate_size=64, num_heads=2, num_kv_heads=1))
    convert(str(tmp_path / "hf"), str(tmp_path / "s"))
    model, store = load_model(str(tmp_path / "s"))
    try:
        with pytest.raises(ValueError, match="holds no MTP layers"):
            Engine(model, store, speculative=SpecOptions("mtp", 2))
    finally:
        store.close()
