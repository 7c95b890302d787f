"""The draft-model drafter (runtime/engine/spec_draft.py): its drafts against the draft model's own plain greedy
decoding and scoring (the engine without speculation), its rollback against a fresh drafter on the same context,
its KV blocks, and the refusals."""
from __future__ import annotations

import random

import pytest
import torch
from helpers import require, two_sample_p

from runtime.engine import Engine, SamplingParams
from runtime.engine.request import Request, distribution
from runtime.engine.spec_draft import DraftModelDrafter
from runtime.engine.speculative import DRAFTERS
from runtime.model import load_model
from runtime.model.convert import convert

transformers = require("transformers", "the reference implementation the fixtures are built with")

PROMPTS = ([5, 6, 7, 8, 9], [90, 3, 77], [40, 41, 42, 43, 44, 45, 46])
VOCAB = 96
SAMPLED = dict(n=300, temperature=1.0, top_k=4, perturb=0.5)     # the statistical test's seeds and sampling


def _mixtral(out: str, layers: int, seed: int, vocab: int = VOCAB, perturb: float = 0.0) -> str:
    """A Mixtral checkpoint from transformers' config class, sizes shrunk (tests/runtime/model/conftest.py's), its
    random weights scaled up so greedy picks are far from ties and do not just repeat the last token. ``perturb``:
    noise of that many standard deviations added to the last layer's weights (a draft close to, not equal to, the
    model of the same seed)."""
    c = transformers.MixtralConfig(vocab_size=vocab, hidden_size=64, intermediate_size=48, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   num_local_experts=8, num_experts_per_tok=2)
    torch.manual_seed(seed)
    m = transformers.MixtralForCausalLM(c).eval()
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "norm" not in n:
                p.mul_(4.0)
        g = torch.Generator().manual_seed(seed + 1)
        for n, p in m.named_parameters():
            if perturb and f"layers.{layers - 1}." in n and "norm" not in n:
                p.add_(torch.randn(p.shape, generator=g) * perturb * p.std())
    m.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    d = tmp_path_factory.mktemp("target")
    convert(_mixtral(str(d / "hf"), 2, 0), str(d / "s"))
    return str(d / "s")


@pytest.fixture(scope="module")
def near(tmp_path_factory):
    """The target with noise on its last layer: a draft whose distributions are close to the target's, not equal."""
    d = tmp_path_factory.mktemp("near")
    convert(_mixtral(str(d / "hf"), 2, 0, perturb=SAMPLED["perturb"]), str(d / "s"))
    return str(d / "s")


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """A smaller model with the target's vocabulary (1 layer, other weights): a real draft model."""
    d = tmp_path_factory.mktemp("draft")
    convert(_mixtral(str(d / "hf"), 1, 7), str(d / "s"))
    return str(d / "s")


def _plain(store_dir: str, prompt: list, n: int) -> list:
    """The model's own greedy continuation of ``prompt`` (the engine without speculation)."""
    model, st = load_model(store_dir)
    try:
        eng = Engine(model, st, max_batch=1)
        rid = eng.add_request(prompt, SamplingParams(max_tokens=n, ignore_eos=True))
        eng.run()
        return eng.done[rid].output
    finally:
        st.close()


def _req(rid: int, prompt: list, temperature: float = 0.0, seed=None) -> Request:
    return Request(id=rid, prompt=list(prompt), params=SamplingParams(max_tokens=64, temperature=temperature,
                                                                     seed=seed))


@pytest.fixture
def drafter(small):
    d = DraftModelDrafter.load(small, VOCAB)
    yield d
    d.close()


def test_greedy_drafts_are_the_draft_models_own_continuation(small, drafter):
    ref = _plain(small, PROMPTS[0], 20)
    r = _req(0, PROMPTS[0])
    got = drafter.propose([r], [4])[0]
    assert got.tokens == ref[:4] and got.probs is None
    # as the target would: keep 2 drafts and add its own (here: the draft model's) next token, four times over
    for step in range(4):
        drafter.verified(r, 2, None)
        r.output = ref[:len(r.output) + 3]
        got = drafter.propose([r], [3])[0]
        assert got.tokens == ref[len(r.output):len(r.output) + 3], step


def test_rollback_matches_a_fresh_drafter_on_the_same_context(small, drafter):
    """Random accepted counts and target tokens that differ from the drafts: after each verify, the drafts equal
    those of a drafter that never saw the rejected ones (a fresh one, fed the context from scratch)."""
    rng = random.Random(3)
    r = _req(0, PROMPTS[1])
    for _ in range(6):
        k = rng.randint(1, 4)
        d = drafter.propose([r], [k])[0]
        fresh = DraftModelDrafter.load(small, VOCAB)
        try:
            assert fresh.propose([_req(9, r.prompt + r.output)], [k])[0].tokens == d.tokens
        finally:
            fresh.close()
        a = rng.randint(0, len(d.tokens))
        drafter.verified(r, a, None)
        r.output += d.tokens[:a] + [rng.randrange(VOCAB)]     # the target's token: often not the draft's
        assert drafter.mirrors[0].seq.length <= len(r.prompt) + len(r.output) - 1


def test_a_batch_drafts_as_each_request_alone(small, drafter):
    reqs = [_req(i, p) for i, p in enumerate(PROMPTS)]
    got = drafter.propose(reqs, [3, 0, 2])
    assert got[1].tokens == []
    for (r, k), d in zip(((reqs[0], 3), (reqs[2], 2)), (got[0], got[2])):
        assert d.tokens == _plain(small, r.prompt, k)


def test_copy_of_the_target_drafts_the_targets_tokens(target):
    """A draft that is a copy of the target proposes the target's greedy continuation (acceptance 1)."""
    d = DraftModelDrafter.load(target, VOCAB)
    try:
        assert d.propose([_req(0, PROMPTS[2])], [5])[0].tokens == _plain(target, PROMPTS[2], 5)
    finally:
        d.close()


def test_sampled_drafts_return_the_distribution_they_were_drawn_from(target):
    """q's first row is the target's own sampling distribution at the context (the draft is its copy; the target
    scored by the engine), every row a distribution, and each token drawn has q > 0."""
    model, st = load_model(target)
    d = DraftModelDrafter.load(target, VOCAB)
    try:
        eng = Engine(model, st, max_batch=1)
        r = _req(0, PROMPTS[0], temperature=0.8, seed=1)
        got = d.propose([r], [4])[0]
        assert got.probs.shape == (4, VOCAB) and got.probs.dtype == torch.float32
        assert torch.allclose(got.probs.sum(1), torch.ones(4), atol=1e-5)
        assert all(float(got.probs[i, t]) > 0 for i, t in enumerate(got.tokens))
        p = distribution(eng.score([PROMPTS[0]])[0], r.params).float()
        assert torch.allclose(got.probs[0], p, atol=1e-5)
        q2 = distribution(eng.score([PROMPTS[0] + got.tokens[:1]])[0], r.params).float()
        assert torch.allclose(got.probs[1], q2, atol=1e-5)
        # the same seed draws the same drafts; the target's own generator is never touched
        again = DraftModelDrafter.load(target, VOCAB)
        try:
            assert again.propose([_req(0, PROMPTS[0], 0.8, seed=1)], [4])[0].tokens == got.tokens
        finally:
            again.close()
        assert r.gen is None
    finally:
        d.close()
        st.close()


def test_release_frees_the_blocks_and_a_full_cache_drafts_nothing(small):
    model, st = load_model(small)
    model.init_kv(num_blocks=2, block_size=16)        # 32 positions in all
    d = DraftModelDrafter(model, st, VOCAB)
    try:
        free = d.kv.free_blocks
        r = _req(0, PROMPTS[0])
        assert len(d.propose([r], [4])[0].tokens) == 4
        assert d.kv.free_blocks == free - 1
        d.release(r)
        assert d.kv.free_blocks == free and not d.mirrors
        long = _req(1, list(range(1, 31)))
        assert d.propose([long], [4])[0].tokens == []     # 30 + 3 positions do not fit: no drafts, no error
        assert d.kv.free_blocks == free
    finally:
        d.close()


def test_vocabulary_mismatch_is_refused_naming_both_sizes(small):
    with pytest.raises(ValueError, match="vocabulary of 96 tokens and the target model 1024"):
        DraftModelDrafter.load(small, 1024)


def test_per_sequence_state_is_refused(small):
    model, st = load_model(small)
    try:
        model.state_bytes_per_sequence = lambda: 4096      # as a linear-attention model reports it
        with pytest.raises(ValueError, match="per-sequence state"):
            DraftModelDrafter(model, st, VOCAB)
    finally:
        st.close()


def test_registered_for_method_draft(small, target):
    model, st = load_model(target)
    try:
        eng = Engine(model, st, max_batch=1)
        spec = type("Spec", (), {"draft_model": small})()
        d = DRAFTERS["draft"](eng, spec)
        assert isinstance(d, DraftModelDrafter) and not d.wants_hidden
        # its cache holds as many tokens as the target's (both 16-token blocks here)
        assert d.kv.num_blocks * d.kv.block_size == eng.kv.num_blocks * eng.kv.block_size
        d.close()
    finally:
        st.close()


def test_a_checkpoint_folder_is_converted(tmp_path, monkeypatch, small):
    monkeypatch.setenv("TIERED_MOE_CACHE", str(tmp_path / "cache"))
    hf = _mixtral(str(tmp_path / "hf"), 1, 7)
    d = DraftModelDrafter.load(hf, VOCAB)
    try:
        assert d.propose([_req(0, PROMPTS[0])], [3])[0].tokens == _plain(small, PROMPTS[0], 3)
    finally:
        d.close()
    with pytest.raises(ValueError, match="--draft-model"):
        DraftModelDrafter.load(str(tmp_path / "nowhere"), VOCAB)


def test_prompt_chunks_are_prefilled_beside_the_target(small, drafter):
    """prefilled feeds each prompt chunk as the target runs it; the drafts after are a fresh drafter's, and the
    prompt's seconds are not drafting's."""
    r = _req(0, PROMPTS[2])
    for fed in (3, 7):                  # two prompt chunks: 3 tokens, then the other 4
        r.fed = fed
        drafter.prefilled(r, None)
        assert drafter.mirrors[0].seq.length == fed and drafter.mirrors[0].fed == PROMPTS[2][:fed]
    assert drafter.timing.prefill_seconds > 0 and drafter.timing.tokens == 0
    r.output = [_plain(small, PROMPTS[2], 1)[0]]
    ref = _plain(small, PROMPTS[2], 4)
    assert drafter.propose([r], [3])[0].tokens == ref[1:4]
    assert drafter.timing.forwards == 2 + 3      # two prompt chunks, then one catch-up token and two drafts fed


def _engine_outputs(store_dir: str, spec, prompts=PROMPTS, max_batch: int = 2, n: int = 16):
    """Greedy outputs of the engine (continuous batching: more prompts than max_batch) and its speculation
    figures; the drafter's state after every request finished."""
    from runtime.engine.speculative import SpecOptions
    model, st = load_model(store_dir)
    try:
        eng = Engine(model, st, max_batch=max_batch,
                     speculative=None if spec is None else SpecOptions("draft", 3, rule=spec[1], draft_model=spec[0]))
        free = eng.drafter.kv.free_blocks if spec is not None else None
        ids = [eng.add_request(p, SamplingParams(max_tokens=n, ignore_eos=True)) for p in prompts]
        eng.run()
        drafted = sum(s.spec_drafted for s in eng.steps)
        accepted = sum(s.spec_accepted for s in eng.steps)
        left = None if spec is None else (len(eng.drafter.mirrors), eng.drafter.kv.free_blocks - free)
        if spec is not None:
            eng.drafter.close()
        return [eng.done[i].output for i in ids], drafted, accepted, left
    finally:
        st.close()


@pytest.mark.parametrize("which", ["small", "copy"])
def test_engine_greedy_outputs_are_the_plain_ones(target, small, which):
    """--speculative draft through the engine: greedy outputs token for token the plain engine's, with a smaller
    draft model (drafts rejected and kept) and with a copy of the target (every draft kept); every request's draft
    state released when it finishes."""
    ref, *_ = _engine_outputs(target, None)
    got, drafted, accepted, left = _engine_outputs(target, (small if which == "small" else target, "fixed"))
    assert got == ref
    assert drafted > 0
    assert (accepted == drafted) if which == "copy" else (accepted < drafted)
    assert left == (0, 0)


def test_sampled_outputs_keep_their_distribution_with_a_draft_model(target, near):
    """Sampled (SAMPLED: seeds, temperature, top-k), the tokens after the first - verified against a near draft
    model's q (most drafts kept, some not) - are distributed as without speculation (a two-sample chi-square test
    per position)."""
    from runtime.engine.speculative import SpecOptions

    def run(spec):
        model, st = load_model(target)
        try:
            eng = Engine(model, st, max_batch=32, speculative=spec)
            ids = [eng.add_request(PROMPTS[0], SamplingParams(max_tokens=4, ignore_eos=True,
                                                              temperature=SAMPLED["temperature"],
                                                              top_k=SAMPLED["top_k"], seed=i))
                   for i in range(SAMPLED["n"])]
            eng.run()
            drafted = sum(s.spec_drafted for s in eng.steps)
            accepted = sum(s.spec_accepted for s in eng.steps)
            return [eng.done[i].output for i in ids], drafted, accepted
        finally:
            st.close()
    plain, _, _ = run(None)
    got, drafted, accepted = run(SpecOptions("draft", 3, rule="fixed", draft_model=near))
    assert 0 < accepted < drafted                        # kept and rejected drafts both judged
    for j in range(1, 4):
        assert two_sample_p([o[j] for o in plain], [o[j] for o in got]) > 1e-3, f"position {j}"
