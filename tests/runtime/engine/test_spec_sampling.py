"""The accept / reject rule keeps the target's distribution (Leviathan et al. 2023, Chen et al. 2023).

Unit level: over many seeded trials of one position - a draft d ~ q, then ``accept_sampled`` - the emitted token is
distributed as p (a chi-square goodness-of-fit test and a total-variation bound), for a full q and a one-hot q
(n-gram drafts); rules that are wrong - always accepting, or resampling from p instead of norm(max(0, p - q)) after a
rejection - fail the same checks. Engine level: the first tokens sampled at temperature 1 with speculation on and
off, over many seeds, pass a two-sample chi-square test; always accepting the drafts fails it."""
import importlib.util
import os

import pytest
import torch
from helpers import chi2_p, two_sample_p

from runtime.engine import Engine, SamplingParams
from runtime.engine import spec_step
from runtime.engine.speculative import DRAFTERS, Draft, SpecOptions, accept_sampled
from runtime.model import load_model

_spec = importlib.util.spec_from_file_location(
    "_model_fixtures_s", os.path.join(os.path.dirname(__file__), "..", "model", "conftest.py"))
fixtures = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fixtures)

ALPHA = 1e-3          # a test below this p-value says "not the same distribution"


def gof_p(counts: torch.Tensor, p: torch.Tensor) -> float:
    """Chi-square goodness of fit of ``counts`` to probabilities ``p`` (categories with p > 0)."""
    n = counts.sum()
    keep = p > 0
    if bool((counts[~keep] > 0).any()):
        return 0.0                       # a token of probability 0 was emitted
    e = n * p[keep]
    stat = float(((counts[keep] - e) ** 2 / e).sum())
    return chi2_p(stat, int(keep.sum()) - 1)


def _emitted(rule, p, q, n, seed, one_hot_d=None) -> torch.Tensor:
    """Counts of the first emitted token over n trials: d ~ q (or fixed), then ``rule``."""
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros(len(p), dtype=torch.float64)
    for _ in range(n):
        d = one_hot_d if one_hot_d is not None else int(torch.multinomial(q, 1, generator=g))
        t = rule(p, d, None if one_hot_d is not None else q, g)
        counts[d if t is None else t] += 1
    return counts


def _always_accept(p, d, q, gen):
    return None


def _resample_from_p(p, d, q, gen):
    """Wrong: after a rejection, a fresh draw from p (instead of from norm(max(0, p - q)))."""
    qd = 1.0 if q is None else float(q[d])
    if float(torch.rand((), generator=gen, dtype=torch.float64)) * qd < float(p[d]):
        return None
    return int(torch.multinomial(p, 1, generator=gen))


def _pq(seed=0, V=8):
    g = torch.Generator().manual_seed(seed)
    p = (torch.randn(V, generator=g, dtype=torch.float64) * 1.5).softmax(0)
    q = (torch.randn(V, generator=g, dtype=torch.float64) * 1.5).softmax(0)
    return p, q


N = 20000
TV_TOL = 0.025        # expected TV of 20000 draws over 8 tokens is about 0.01; the wrong rules below are >= 0.06 off


def test_accept_reject_keeps_p_for_a_full_draft_distribution():
    p, q = _pq()
    assert 0.5 * float((p - q).abs().sum()) > 0.25         # p and q far apart: a wrong rule shows
    c = _emitted(accept_sampled, p, q, N, seed=1)
    assert gof_p(c, p) > ALPHA and 0.5 * float((c / N - p).abs().sum()) < TV_TOL
    for wrong in (_always_accept, _resample_from_p):
        cw = _emitted(wrong, p, q, N, seed=1)
        assert gof_p(cw, p) < ALPHA and 0.5 * float((cw / N - p).abs().sum()) > TV_TOL, wrong.__name__


def test_accept_reject_keeps_p_for_one_hot_drafts():
    """n-gram drafts: q is one-hot at d, so d is kept with probability p[d], else a draw from p without d."""
    p, _ = _pq(seed=2)
    d = int(p.argmin())
    c = _emitted(accept_sampled, p, None, N, seed=3, one_hot_d=d)
    assert gof_p(c, p) > ALPHA and 0.5 * float((c / N - p).abs().sum()) < TV_TOL
    cw = _emitted(_always_accept, p, None, N, seed=3, one_hot_d=d)
    assert gof_p(cw, p) < ALPHA


def test_p_equal_q_always_accepts():
    p, _ = _pq(seed=4)
    g = torch.Generator().manual_seed(0)
    assert all(accept_sampled(p, int(torch.multinomial(p, 1, generator=g)), p, g) is None for _ in range(200))


# -- engine level ---------------------------------------------------------------------------------------------------
PROMPT = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]
REQS, TOKENS, TOP_K = 600, 4, 3


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    from runtime.model.convert import convert
    d = tmp_path_factory.mktemp("qwen3_moe_sampling")
    fixtures.build_hf("qwen3_moe", str(d / "hf"))
    convert(str(d / "hf"), str(d / "store"))
    return str(d / "store")


class GreedyPathDrafter:
    """Drafts the greedy continuation of the prompt (``ref``): one-hot, or (mix > 0) d ~ q = (1 - mix) one-hot + mix
    uniform, q returned with the draft. At temperature 1, top_k 3 the target keeps about a third of them."""
    wants_hidden = False

    def __init__(self, ref: list, V: int, mix: float = 0.0) -> None:
        self.ref, self.V, self.mix = ref, V, mix
        self.g = torch.Generator().manual_seed(123)

    def propose(self, reqs, ks):
        out = []
        for r, k in zip(reqs, ks):
            toks = self.ref[len(r.output):len(r.output) + k]
            if not self.mix:
                out.append(Draft(toks))
                continue
            q = torch.full((len(toks), self.V), self.mix / self.V, dtype=torch.float32)
            q[torch.arange(len(toks)), torch.tensor(toks)] += 1 - self.mix
            out.append(Draft([int(torch.multinomial(row, 1, generator=self.g)) for row in q], q))
        return out

    def verified(self, r, accepted, hidden):
        pass

    def prefilled(self, r, hidden):
        pass

    def release(self, r):
        pass


def _sample_run(store, spec=None, temperature=1.0):
    model, st = load_model(store)
    try:
        eng = Engine(model, st, max_batch=32, speculative=spec)
        ids = [eng.add_request(PROMPT, SamplingParams(max_tokens=TOKENS, ignore_eos=True, temperature=temperature,
                                                      top_k=TOP_K if temperature else 0, seed=i))
               for i in range(REQS)]
        eng.run()
        return [eng.done[i].output for i in ids], eng, model.cfg.vocab_size
    finally:
        st.close()


@pytest.mark.parametrize("mix", [0.0, 0.5])
def test_sampled_tokens_keep_their_distribution_with_speculation(store, monkeypatch, mix):
    model_ref, _, V = _sample_run_ref(store)
    plain, _, _ = _sample_run(store)
    monkeypatch.setitem(DRAFTERS, "ngram", lambda engine, spec: GreedyPathDrafter(model_ref, V, mix))
    spec = SpecOptions("ngram", 3, rule="fixed")
    got, eng, _ = _sample_run(store, spec)
    drafted = sum(s.spec_drafted for s in eng.steps)
    accepted = sum(s.spec_accepted for s in eng.steps)
    assert 0.1 * drafted < accepted < 0.9 * drafted        # the rule had both kept and rejected drafts to judge
    for j in range(TOKENS):
        assert two_sample_p([o[j] for o in plain], [o[j] for o in got]) > ALPHA, f"position {j}"
    # the same test catches a rule that keeps every draft
    monkeypatch.setattr(spec_step, "accept_sampled", _always_accept)
    wrong, _, _ = _sample_run(store, spec)
    assert min(two_sample_p([o[j] for o in plain], [o[j] for o in wrong]) for j in range(1, TOKENS)) < ALPHA


def _sample_run_ref(store):
    """The prompt's greedy continuation (what the drafter proposes)."""
    model, st = load_model(store)
    try:
        eng = Engine(model, st, max_batch=1)
        i = eng.add_request(PROMPT, SamplingParams(max_tokens=TOKENS + 4, ignore_eos=True))
        eng.run()
        return eng.done[i].output, eng, model.cfg.vocab_size
    finally:
        st.close()
