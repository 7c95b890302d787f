"""Speculative decoding in the engine (runtime/engine/speculative.py, spec_step.py): greedy outputs token for token
those of plain decoding - on GQA (Qwen3-MoE), MLA (DeepSeek-V2), sliding windows with sinks (gpt-oss: ring state
rolled back), Gated DeltaNet (Qwen3-Next: recurrent state rolled back) and DeepSeek-V4 (compressor windows and hash
routing) - with n-gram drafts and with drafts whose
acceptance is set by construction (a drafter that knows the plain continuation and gets every fourth token wrong);
stop tokens and max_tokens inside accepted drafts, streaming outputs, preemption and the prefix cache with
speculation on; the options' validation."""
import importlib.util
import os

import numpy as np
import pytest
import torch

from runtime.engine import Engine, FinishReason, SamplingParams
from runtime.engine.speculative import DRAFTERS, Draft, SpecOptions, ngram_lookup
from runtime.model import load_model

_spec = importlib.util.spec_from_file_location(
    "_model_fixtures", os.path.join(os.path.dirname(__file__), "..", "model", "conftest.py"))
fixtures = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fixtures)            # the transformers fixtures of tests/runtime/model (build_hf)

ARCHS = ("qwen3_moe", "deepseek_v2", "gpt_oss", "qwen3_next", "deepseek_v4")
STATEFUL = ("gpt_oss", "qwen3_next", "deepseek_v4")
V = fixtures.SIZES["vocab_size"]


@pytest.fixture(scope="module", params=ARCHS)
def arch_store(request, tmp_path_factory):
    from runtime.model.convert import convert
    d = tmp_path_factory.mktemp(request.param)
    fixtures.build_hf(request.param, str(d / "hf"))
    convert(str(d / "hf"), str(d / "store"))
    return request.param, str(d / "store")


def _prompts():
    """Mixed requests: a repeated text (n-gram drafts get accepted), a random one, a short repeat, a short one."""
    g = torch.Generator().manual_seed(0)
    base = torch.randint(3, V, (10,), generator=g).tolist()
    return [(base * 3, 24), (torch.randint(3, V, (20,), generator=g).tolist(), 24), (base + base[:4], 17),
            (torch.randint(3, V, (7,), generator=g).tolist(), 5)]


def _run(store, spec=None, reqs=None, max_batch=4, init_kv=None, **params):
    """(outputs, finish reasons, engine, streamed tokens per request) of a greedy run."""
    model, st = load_model(store)
    try:
        if init_kv is not None:
            init_kv(model)
        eng = Engine(model, st, max_batch=max_batch, speculative=spec)
        ids = [eng.add_request(p, SamplingParams(max_tokens=n, ignore_eos=True, **params)) for p, n in reqs or _prompts()]
        streamed = {i: [] for i in ids}
        while eng.has_work():
            for o in eng.step():
                if o.token is not None:
                    assert not (streamed[o.request_id] and streamed[o.request_id][-1] is None), "a token after the end"
                    streamed[o.request_id].append(o.token)
                if o.finished:
                    streamed[o.request_id].append(None)
        return ([eng.done[i].output for i in ids], [eng.done[i].finish_reason for i in ids], eng,
                [streamed[i] for i in ids])
    finally:
        st.close()


class Oracle:
    """Drafts the plain continuation (``ref``: prompt -> plain greedy output) with every ``every``-th position of the
    output wrong: acceptance set by construction (a run of accepted drafts, then a rejection)."""
    wants_hidden = False

    def __init__(self, ref: dict, every: int = 4) -> None:
        self.ref, self.every, self.released = ref, every, 0

    def propose(self, reqs, ks):
        out = []
        for r, k in zip(reqs, ks):
            n, ref = len(r.output), self.ref[tuple(r.prompt)]
            out.append(Draft([(t + 1) % V if (n + i) % self.every == self.every - 1 else t
                              for i, t in enumerate(ref[n:n + k])]))
        return out

    def verified(self, r, accepted, hidden):
        pass

    def prefilled(self, r, hidden):
        pass

    def release(self, r):
        self.released += 1


def _oracle(monkeypatch, ref, every=4) -> Oracle:
    o = Oracle(ref, every)
    monkeypatch.setitem(DRAFTERS, "ngram", lambda engine, spec: o)
    return o


def _spec_steps(eng):
    return (sum(s.spec_drafted for s in eng.steps), sum(s.spec_accepted for s in eng.steps),
            sum(s.spec_refed for s in eng.steps))


def test_ngram_lookup_is_prompt_lookup():
    t = [1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3]
    assert ngram_lookup(t, 2, 1, 4) == [7, 8]              # suffix [1, 2, 3]: its most recent earlier occurrence
    assert ngram_lookup(t, 5, 1, 4) == [7, 8, 1, 2, 3]
    assert ngram_lookup(t, 2, 4, 4) == []                  # no 4-token suffix recurs
    assert ngram_lookup([5, 6, 5], 3, 1, 2) == [6, 5]      # n = 1: the last 5's earlier occurrence
    assert ngram_lookup([4], 3, 1, 4) == []


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_ngram_outputs_are_plain_decodings(arch_store, k):
    arch, store = arch_store
    plain, reasons, _, _ = _run(store)
    got, got_reasons, eng, streamed = _run(store, SpecOptions("ngram", k, rule="fixed"))
    assert got == plain and got_reasons == reasons
    assert [s[:-1] for s in streamed] == got and all(s[-1] is None for s in streamed)
    drafted, accepted, _ = _spec_steps(eng)
    summ = eng.summary()["speculative"]
    assert drafted > 0 and summ["drafted_tokens"] == drafted and summ["accepted_tokens"] == accepted
    assert sum(summ["accepted_length_histogram"]) == summ["verify_steps"] > 0
    if arch in ("qwen3_moe", "gpt_oss"):              # these fixtures repeat themselves: n-gram drafts are kept
        assert accepted > 0


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_outputs_with_accepted_and_rejected_drafts(arch_store, k, monkeypatch):
    """Drafts accepted by construction (3 of every 4 output positions), so rollback happens after partial
    acceptance - for the stateful models by restoring the state and feeding the kept tokens again."""
    arch, store = arch_store
    plain, reasons, eng0, _ = _run(store)
    oracle = _oracle(monkeypatch, {tuple(p): o for (p, _), o in zip(_prompts(), plain)})
    got, got_reasons, eng, streamed = _run(store, SpecOptions("ngram", k, rule="fixed"))
    assert got == plain and got_reasons == reasons
    assert [s[:-1] for s in streamed] == got
    drafted, accepted, refed = _spec_steps(eng)
    assert 0 < accepted < drafted
    lengths = [a for r in eng.done.values() for a in r.spec_lengths]
    if k > 1:
        assert any(0 < a < k for a in lengths)           # partial acceptance: the rollback keeps some drafts
    assert (refed > 0) == (arch in STATEFUL)             # state restored, kept tokens fed again
    assert oracle.released == len(plain)
    assert len(eng.steps) < len(eng0.steps)              # accepted drafts: several tokens per step


def _stop_case(store):
    """A prompt whose plain output has a token first seen at position 4..20 (the stop token), and that output."""
    g = torch.Generator().manual_seed(1)
    for _ in range(20):
        p = torch.randint(3, V, (12,), generator=g).tolist()
        (ref,), _, _, _ = _run(store, reqs=[(p, 30)])
        j = next((i for i in range(4, 21) if ref[i] not in ref[:i]), None)
        if j is not None:
            return p, ref, ref[j], j
    raise AssertionError("no prompt with a fresh token at positions 4..20 in 20 tries")


def test_stop_token_and_max_tokens_inside_accepted_drafts(arch_store, monkeypatch):
    arch, store = arch_store
    p, ref, stop, j = _stop_case(store)
    plain, plain_reasons, eng0, _ = _run(store, reqs=[(p, 30), (p, 3)], stop_token_ids=(stop,))
    assert plain[0] == ref[:j + 1] and plain_reasons == [FinishReason.STOP, FinishReason.LENGTH]
    _oracle(monkeypatch, {tuple(p): ref}, every=10 ** 6)     # every draft right: chunks of 6 accepted tokens
    got, reasons, eng, streamed = _run(store, SpecOptions("ngram", 5, rule="fixed"), reqs=[(p, 30), (p, 3)],
                                       stop_token_ids=(stop,))
    assert got == plain and reasons == plain_reasons
    assert [s[:-1] for s in streamed] == got             # nothing streamed after the stop token or max_tokens
    assert len(eng.steps) < len(eng0.steps)               # several tokens per step: the stop came inside a chunk


def test_preemption_with_speculation(arch_store, monkeypatch):
    arch, store = arch_store

    def tight(model):        # blocks for two of the four sequences: the newest is preempted and recomputed
        model.init_kv(12 * 8 * model.kv_bytes_per_token() + 8 * model.state_bytes_per_sequence(), block_size=8,
                      max_seqs=8)
    plain, _, eng0, _ = _run(store, init_kv=tight)
    _oracle(monkeypatch, {tuple(p): o for (p, _), o in zip(_prompts(), plain)})
    got, _, eng, _ = _run(store, SpecOptions("ngram", 3, rule="fixed"), init_kv=tight)
    assert got == plain
    assert eng0.preemptions > 0 and eng.preemptions > 0 and _spec_steps(eng)[1] > 0


def test_prefix_cache_registers_only_accepted_tokens(arch_store, monkeypatch):
    """The same prompts twice: the second round finds the first's blocks (outputs unchanged), and every block the
    prefix cache holds is a block of some request's prompt + accepted output - never one with a rejected draft."""
    arch, store = arch_store
    reqs = _prompts()
    plain, _, _, _ = _run(store, reqs=reqs + reqs, max_batch=4)
    _oracle(monkeypatch, {tuple(p): o for (p, _), o in zip(reqs, plain)}, every=3)
    got, _, eng, _ = _run(store, SpecOptions("ngram", 4, rule="fixed"), reqs=reqs + reqs, max_batch=4)
    assert got == plain
    mgr = eng.kv
    assert mgr.hits > 0 and _spec_steps(eng)[1] > 0
    bs = mgr.block_size
    true_blocks = {tuple((r.prompt + r.output)[i * bs:(i + 1) * bs]) for r in eng.done.values()
                   for i in range(len(r.prompt + r.output) // bs)}
    held = [tokens for (_, tokens) in mgr.cached]
    assert held and all(t in true_blocks for t in held)


def test_requests_that_cannot_speculate_decode_plainly():
    """A grammar-constrained request would need its matcher advanced per draft: it gets no drafts (plain_reason)."""
    from runtime.engine.speculative import plain_reason
    assert plain_reason(SamplingParams(grammar=("regex", "[a-z]+"))) is not None
    assert plain_reason(SamplingParams(logprobs=2, presence_penalty=0.5, min_tokens=3, top_k=5)) is None


def _logprobs_run(store, spec=None, **params):
    """Greedy outputs and the (logprob, top tokens) streamed with each token."""
    model, st = load_model(store)
    try:
        eng = Engine(model, st, max_batch=4, speculative=spec)
        ids = [eng.add_request(p, SamplingParams(max_tokens=n, ignore_eos=True, **params)) for p, n in _prompts()]
        lps = {i: [] for i in ids}
        while eng.has_work():
            for o in eng.step():
                if o.token is not None:
                    lps[o.request_id].append((o.logprobs.logprob, [t for t, _ in o.logprobs.top]))
        return [eng.done[i].output for i in ids], [lps[i] for i in ids], eng
    finally:
        st.close()


def test_penalties_and_logprobs_apply_per_position(arch_store, monkeypatch):
    """Repetition / frequency / presence penalties and logprobs: the target's pick at each draft position sees the
    output as plain decoding would there - greedy outputs and each token's logprobs equal."""
    arch, store = arch_store
    kw = dict(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.3, logprobs=2)
    plain, plain_lps, _ = _logprobs_run(store, **kw)
    _oracle(monkeypatch, {tuple(p): o for (p, _), o in zip(_prompts(), plain)})
    got, lps, eng = _logprobs_run(store, SpecOptions("ngram", 4, rule="fixed"), **kw)
    assert got == plain and _spec_steps(eng)[1] > 0
    # the verify chunk's rows and a decode step's row come from different kernels: equal to float32 rounding
    flat = [(a, b) for x, y in zip(lps, plain_lps) for a, b in zip(x, y)]
    assert [len(x) for x in lps] == [len(x) for x in plain_lps]
    assert all(a[1] == b[1] and abs(a[0] - b[0]) < 1e-4 for a, b in flat)


def test_options_are_validated():
    with pytest.raises(ValueError, match="--num-speculative-tokens"):
        SpecOptions("ngram", 0)
    with pytest.raises(ValueError, match="--num-speculative-tokens"):
        SpecOptions("ngram", 17)
    with pytest.raises(ValueError, match="--speculative"):
        SpecOptions("eagle", 3)
    with pytest.raises(ValueError, match="--spec-rule"):
        SpecOptions("ngram", 3, rule="always")
    with pytest.raises(ValueError, match="--draft-model"):
        SpecOptions("draft", 3)
    with pytest.raises(ValueError, match="--draft-model"):
        SpecOptions("draft", 3, draft_model="/nonexistent/store")
    with pytest.raises(ValueError, match="--prompt-lookup-min"):
        SpecOptions("ngram", 3, ngram_min=5, ngram_max=2)


class HiddenWatcher(Oracle):
    """An oracle drafter that reads the target's hidden states (as an MTP drafter does) and checks them against the
    model's own head: the logits of each row handed over pick the token that followed it."""
    wants_hidden = True

    def __init__(self, ref, head) -> None:
        super().__init__(ref)
        self.head, self.checked = head, 0

    def verified(self, r, accepted, hidden):
        assert hidden.shape[0] == accepted + 1
        assert self.head(hidden).argmax(-1).tolist() == r.output[-(accepted + 1):]
        self.checked += 1

    def prefilled(self, r, hidden):
        if r.output:                                  # the prompt's last chunk: its last row picked output[0]
            assert int(self.head(hidden[-1:]).argmax()) == r.output[0]
            self.checked += 1


def test_drafters_that_want_hidden_states_get_the_kept_rows(arch_store, monkeypatch):
    arch, store = arch_store
    plain, _, _, _ = _run(store)
    ref = {tuple(p): o for (p, _), o in zip(_prompts(), plain)}
    made = []

    def factory(engine, spec):
        made.append(HiddenWatcher(ref, engine.model._logits))
        return made[-1]
    monkeypatch.setitem(DRAFTERS, "ngram", factory)
    got, _, eng, _ = _run(store, SpecOptions("ngram", 3, rule="fixed"))
    assert got == plain and made[0].checked > len(plain) and _spec_steps(eng)[1] > 0


def test_spec_metrics_in_prometheus(arch_store, monkeypatch):
    """The step records feed tiered_moe_spec_* (counters equal the records' sums; one histogram sample per verify
    chunk)."""
    from dataclasses import asdict
    from runtime.serve.metrics import ServerMetrics
    arch, store = arch_store
    plain, _, _, _ = _run(store)
    _oracle(monkeypatch, {tuple(p): o for (p, _), o in zip(_prompts(), plain)})
    _, _, eng, _ = _run(store, SpecOptions("ngram", 3, rule="fixed"))
    m = ServerMetrics()
    monkeypatch.setattr(m.store, "update", lambda stats: None)     # the store's gauges are not under test here
    for rec in eng.steps:
        d = asdict(rec)
        d["mean_unique_experts"] = sum(rec.unique_experts) / len(rec.unique_experts)
        m.on_step(d, {})
    text = m.render().decode()

    def value(name):
        line = next(x for x in text.splitlines() if x.startswith(name + " "))
        return float(line.split()[1])
    drafted, accepted, _ = _spec_steps(eng)
    assert value("tiered_moe_spec_draft_tokens_total") == drafted
    assert value("tiered_moe_spec_accepted_tokens_total") == accepted
    lengths = [a for s in eng.steps for a in s.spec_lengths]
    assert value("tiered_moe_spec_accepted_length_count") == len(lengths)
    assert value("tiered_moe_spec_accepted_length_sum") == sum(lengths) == accepted
    verify_steps = [s for s in eng.steps if s.spec_verify_unique_experts is not None]
    assert value("tiered_moe_spec_verify_unique_experts_count") == len(verify_steps) > 0


@pytest.mark.parametrize("arch_store", ["qwen3_moe"], indirect=True)
def test_generate_prints_the_acceptance(arch_store):
    import subprocess
    import sys
    arch, store = arch_store
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    cmd = [sys.executable, "-m", "runtime.cli", "generate", "--model", store, "--prompt-ids",
           ",".join(map(str, _prompts()[0][0])), "--max-tokens", "16", "--speculative", "ngram",
           "--num-speculative-tokens", "4", "--spec-rule", "fixed"]
    out = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "[speculative ngram, K=4, rule fixed: " in out.stderr and "drafts accepted" in out.stderr
    bad = subprocess.run(cmd[:-4] + ["--num-speculative-tokens", "0"], cwd=root, capture_output=True, text=True,
                         timeout=300)
    assert bad.returncode == 2 and "--num-speculative-tokens" in bad.stderr


def test_the_trace_has_each_kept_token_once(arch_store, monkeypatch):
    """Rejected drafts and kept tokens fed again leave no rows in the routing trace: per request, one row per token
    of prompt + output but the last - the plain run's count; and they route to the plain run's experts."""
    arch, store = arch_store
    plain, _, eng0, _ = _run(store)
    _oracle(monkeypatch, {tuple(p): o for (p, _), o in zip(_prompts(), plain)})
    _, _, eng, _ = _run(store, SpecOptions("ngram", 3, rule="fixed"))
    for i in eng.done:
        r, r0 = eng.done[i], eng0.done[i]
        rows = np.concatenate(r.routing)
        rows0 = np.concatenate(r0.routing)
        assert rows.shape == rows0.shape == (len(r.prompt) + len(r.output) - 1,) + rows0.shape[1:]
        assert (np.sort(rows, -1) == np.sort(rows0, -1)).all()        # the same experts for every token


def test_a_server_streams_the_plain_text_with_speculation(tmp_path):
    """`serve --speculative ngram`: a streamed greedy completion is the text of plain decoding in-process, streamed
    token by token (several per engine step), and /metrics counts the drafts."""
    import http.client
    import json
    import urllib.request
    from runtime.model.convert import convert
    from runtime.model.synthetic import SyntheticModelSpec, build_checkpoint
    from runtime.serve.api import Server
    from runtime.serve.engine_proc import EngineConfig
    from runtime.tokenizer import Tokenizer
    build_checkpoint(str(tmp_path / "hf"), SyntheticModelSpec(num_layers=2, num_experts=8, hidden_size=64,
                                                              intermediate_size=64, num_heads=2, num_kv_heads=1))
    store = str(tmp_path / "s")
    convert(str(tmp_path / "hf"), store)
    prompt = "abc abc abc abc abc"
    ids = Tokenizer(store).encode(prompt)
    (ref,), _, _, _ = _run(store, reqs=[(ids, 24)])
    srv = Server(EngineConfig(model=store, max_batch=4, speculative=dict(method="ngram", num_speculative_tokens=4,
                                                                         rule="fixed")), port=0).start()
    try:
        c = http.client.HTTPConnection(srv.host, srv.port, timeout=60)
        c.request("POST", "/v1/completions", body=json.dumps({"model": srv.model_name, "prompt": prompt,
                                                              "max_tokens": 24, "temperature": 0, "stream": True,
                                                              "ignore_eos": True}),
                  headers={"Content-Type": "application/json"})
        events = [e[6:] for e in c.getresponse().read().decode().split("\n\n") if e.startswith("data: ")]
        c.close()
        assert events[-1] == "[DONE]"
        text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1] if json.loads(e)["choices"])
        assert text == Tokenizer(store).decode(ref)
        metrics = urllib.request.urlopen(srv.url + "/metrics").read().decode()
        drafted = [float(x.split()[1]) for x in metrics.splitlines()
                   if x.startswith("tiered_moe_spec_draft_tokens_total ")]
        assert drafted and drafted[0] > 0
    finally:
        srv.close()


@pytest.mark.parametrize("arch_store", ["qwen3_next"], indirect=True)
def test_scratch_state_slots_come_from_the_cache_budget(arch_store):
    """A stateful model with speculation on: max_batch more state slots (scratch for the state before a verify
    chunk), the sequences' own slots unchanged."""
    _, store = arch_store
    slots = {}
    for spec in (None, SpecOptions("ngram", 2, rule="fixed")):
        model, st = load_model(store)
        try:
            eng = Engine(model, st, max_batch=3, max_active=5, speculative=spec, prefix_caching=False)
            slots[spec is None] = (model.kv.state_slots, eng.kv.free_sequences, len(eng.spec.scratch) if spec else 0)
        finally:
            st.close()
    assert slots[True] == (5, 5, 0) and slots[False] == (5 + 3, 5, 3)
