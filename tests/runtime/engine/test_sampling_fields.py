"""vLLM's sampling fields in the engine (issue 32): min_p, min_tokens, allowed_token_ids and prompt_logprobs, each
checked against a reference written here - the formula token by token, brute-force draws, the model's own logits."""
import math

import pytest
import torch

from runtime.engine import Engine, SamplingParams
from runtime.engine.request import distribution, restrict, sample
from runtime.model import load_model

LOGITS = torch.tensor([2.0, 1.6, 1.0, 0.3, -0.5, -2.0, 0.9, 1.95])


def _reference(logits, temperature, min_p=0.0, top_k=0, top_p=1.0) -> list:
    """vLLM's sampler written out: softmax(logits / T); drop p < min_p * max p; keep the top_k; keep the smallest
    prefix (by probability) whose mass reaches top_p; renormalize after each cut."""
    x = [v / temperature for v in logits.tolist()]
    p = [math.exp(v - max(x)) for v in x]
    p = [v / sum(p) for v in p]
    keep = {i for i, v in enumerate(p) if v >= min_p * max(p)}
    if top_k:
        keep &= set(sorted(keep, key=lambda i: -p[i])[:top_k])
    mass = sum(p[i] for i in keep)
    q = {i: p[i] / mass for i in keep}
    if top_p < 1:
        acc, kept = 0.0, set()
        for i in sorted(q, key=lambda i: -q[i]):
            if acc >= top_p:
                break
            kept.add(i)
            acc += q[i]
        q = {i: q[i] for i in kept}
    s = sum(q.values())
    return [q.get(i, 0.0) / s for i in range(len(p))]


@pytest.mark.parametrize("knobs", [dict(temperature=1.0, min_p=0.3), dict(temperature=0.5, min_p=0.1),
                                   dict(temperature=1.3, min_p=0.2, top_k=4), dict(temperature=1.0, min_p=0.05,
                                                                                   top_p=0.8),
                                   dict(temperature=1.0, min_p=1.0)])
def test_min_p_distribution_is_vllms(knobs):
    p = SamplingParams(**knobs)
    got = distribution(LOGITS, p).tolist()
    assert got == pytest.approx(_reference(LOGITS, **knobs), abs=1e-9)


def test_min_p_draws_follow_the_reference():
    """20,000 seeded draws: no token below min_p x the likeliest's probability ever comes; the frequencies are the
    reference distribution's (within 4 standard deviations)."""
    p = SamplingParams(temperature=1.0, min_p=0.3)
    want = _reference(LOGITS, 1.0, min_p=0.3)
    g = torch.Generator().manual_seed(7)
    n = 20_000
    counts = [0] * len(want)
    for _ in range(n):
        counts[sample(LOGITS, p, g)] += 1
    for c, w in zip(counts, want):
        if w == 0:
            assert c == 0
        else:
            assert abs(c / n - w) < 4 * math.sqrt(w * (1 - w) / n) + 1e-9
    assert sum(1 for w in want if w == 0) >= 3          # min_p cut something (else the test shows nothing)


def test_restrict_masks_stop_tokens_before_min_tokens():
    p = SamplingParams(max_tokens=10, min_tokens=2, stop_token_ids=(3,))
    x = restrict(LOGITS, p, 0, eos={5})
    assert x[3] == -math.inf and x[5] == -math.inf and int((x == -math.inf).sum()) == 2
    assert torch.equal(restrict(LOGITS, p, 2, eos={5}), LOGITS)                 # min_tokens reached: as it was
    ig = SamplingParams(max_tokens=10, min_tokens=2, stop_token_ids=(3,), ignore_eos=True)
    assert restrict(LOGITS, ig, 0, eos={5})[5] == LOGITS[5]                       # EOS does not stop it anyway
    only = restrict(LOGITS, SamplingParams(allowed_token_ids=[1, 4]), 5, eos=())
    assert [i for i in range(8) if only[i] > -math.inf] == [1, 4]
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=3, min_tokens=4)
    with pytest.raises(ValueError, match="min_p"):
        SamplingParams(min_p=1.5)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)


@pytest.fixture(scope="module")
def engine(store):
    model, st = load_model(store)
    eng = Engine(model, st, prefill_chunk=16)        # prompts of several chunks
    yield eng
    st.close()


def _run(eng, prompt, **kw):
    i = eng.add_request(prompt, SamplingParams(**kw))
    eng.run()
    return eng.done.pop(i)


def _greedy(eng, prompt, n, banned_until=0, banned=(), allowed=None) -> list:
    """Greedy decoding by hand from the model's last-token logits (Engine.score): ``banned`` tokens at -inf while the
    output is shorter than ``banned_until``; only ``allowed`` ones when given; stops after a banned token."""
    out = []
    for _ in range(n):
        x = eng.score([prompt + out])[0].clone()
        if len(out) < banned_until:
            x[list(banned)] = -math.inf
        if allowed is not None:
            x[[t for t in range(x.numel()) if t not in allowed]] = -math.inf
        out.append(int(x.argmax()))
        if out[-1] in banned:
            break
    return out


def test_min_tokens_and_allowed_token_ids(engine):
    prompt = [3, 4, 5, 6]
    first = _run(engine, prompt, max_tokens=1).output[0]
    r = _run(engine, prompt, max_tokens=12, stop_token_ids=(first,))
    assert r.output == [first] and r.finish_reason == "stop"
    r = _run(engine, prompt, max_tokens=12, stop_token_ids=(first,), min_tokens=4)
    assert r.output == _greedy(engine, prompt, 12, banned_until=4, banned=(first,))
    assert len(r.output) >= 4 and first not in r.output[:4]
    allowed = [7, 9, 40, 200]
    r = _run(engine, prompt, max_tokens=6, allowed_token_ids=allowed)
    assert r.output == _greedy(engine, prompt, 6, allowed=set(allowed)) and set(r.output) <= set(allowed)


def test_prompt_logprobs_are_the_models(engine):
    """Each prompt token's log-probability, rank and top-k under the model's logits at the position before it (one
    forward per prefix, Engine.score); the prompt is computed whole though the prefix cache holds it."""
    prompt = [(7 * i + 3) % 200 + 1 for i in range(45)]       # 3 chunks of 16
    _run(engine, prompt, max_tokens=2)                        # its blocks are cached now
    r = _run(engine, prompt, max_tokens=2, prompt_logprobs=3)
    assert r.cached_tokens == 0
    plp = r.prompt_logprobs
    assert len(plp) == len(prompt) and plp[0] is None
    for i in range(1, len(prompt)):
        lp = engine.score([prompt[:i]])[0].float().log_softmax(-1)
        e = plp[i]
        assert e.logprob == pytest.approx(float(lp[prompt[i]]), abs=1e-4)
        assert e.rank == 1 + int((lp > lp[prompt[i]]).sum())
        vals, idx = lp.topk(3)
        assert [t for t, _ in e.top] == idx.tolist()
        assert [v for _, v in e.top] == pytest.approx(vals.tolist(), abs=1e-4)
    # the output is what it is without them
    assert r.output == _run(engine, prompt, max_tokens=2).output
    assert _run(engine, [9], max_tokens=1, prompt_logprobs=0).prompt_logprobs == [None]
