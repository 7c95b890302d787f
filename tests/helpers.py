"""Paths shared by the tests (import as `helpers`; conftest modules are not imported by name)."""
import importlib
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED = os.environ.get("TIERED_MOE_SHARED", os.path.join(os.path.dirname(ROOT), "shared"))
TRACES = os.path.join(SHARED, "traces")


def shared_trace(name: str) -> str:
    path = os.path.join(TRACES, name)
    if not os.path.exists(path):
        pytest.fail(f"shared trace {path} is missing: the project expects ../shared/traces beside the checkout "
                    f"(or TIERED_MOE_SHARED pointing at shared/)")
    return path


def require(module: str, why: str):
    """A module that ``pip install -e '.[test]'`` installs: the module, or, where it is missing, a stand-in whose
    first use fails the test using it (never a skip; tests that do not use it still run)."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        return _Missing(f"{module} is missing ({e}); it is {why}: pip install -e '.[test]' installs it")


class _Missing:
    def __init__(self, message: str):
        self._message = message

    def __getattr__(self, name):
        if name.startswith("__"):          # introspection (pytest's collection, hasattr, copy): a plain miss
            raise AttributeError(name)
        pytest.fail(self._message, pytrace=False)


def check_against_transformers(ref, store_dir: str, frac: float, name: str) -> None:
    """Our model from ``store_dir`` against transformers' ``ref`` on the same weights: logits of
    every prompt position within 1e-4 (fed one token at a time), then 32 greedy tokens identical
    through the engine; with ``frac`` < 1 of the experts on the device, offloading really happens."""
    import torch

    from runtime.engine import Engine, SamplingParams
    from runtime.model import Sequence, load_model
    from runtime.store import Manifest
    m = Manifest.read(store_dir)
    prompt = torch.randint(0, 96, (1, 10), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = ref(prompt).logits[0]                                    # want: [10, vocab]
    model, store = load_model(store_dir, expert_budget=max(4, int(frac * m.num_layers * m.num_experts)) * m.blob_stride)
    try:
        s = Sequence()
        got = torch.stack([feed(model, [s], [[t]])[0] for t in prompt[0].tolist()])
        assert (got - want).abs().max().item() < 1e-4, name
        with torch.no_grad():
            gen = ref.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=32, do_sample=False,
                               min_new_tokens=32, eos_token_id=None, pad_token_id=None)[0, 10:].tolist()
        eng = Engine(model, store, max_batch=1, prefill_chunk=4)
        rid = eng.add_request(prompt[0].tolist(), SamplingParams(max_tokens=32, ignore_eos=True))
        eng.run()
        assert eng.done[rid].output == gen, name
        if frac < 1:
            assert store.stats.hits["device"] < sum(store.stats.hits.values())   # offloading really happened
    finally:
        store.close()


_MANAGERS = None


def feed(model, seqs: list, chunks: list, hooks=None):
    """``model.forward(seqs, chunks, hooks)`` without an engine: the blocks and slots come first from a
    KVManager of the model's cache (one per cache, kept across calls, as the engine keeps its own)."""
    import weakref

    from runtime.engine.kv_manager import KVManager
    from runtime.model import StepHooks
    global _MANAGERS
    if _MANAGERS is None:
        _MANAGERS = weakref.WeakKeyDictionary()
    mgr = _MANAGERS.get(model.kv) if model.kv is not None else None
    if mgr is None:
        mgr = KVManager.for_model(model)          # makes the cache if the model has none
        _MANAGERS[model.kv] = mgr
    mgr.prepare(seqs, chunks)
    return model.forward(seqs, chunks, hooks if hooks is not None else StepHooks())


# Chi-square tests on sampled tokens (speculative decoding keeps the target's distribution).
def chi2_p(stat: float, df: int) -> float:
    """P(X >= stat) for X ~ chi-square(df): the regularized upper incomplete gamma Q(df / 2, stat / 2)."""
    import torch
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def two_sample_p(a: list, b: list, min_count: int = 5) -> float:
    """Two-sample chi-square test of two lists of tokens (categories with fewer than ``min_count`` in both pooled)."""
    import torch
    cats = sorted(set(a) | set(b))
    ca = torch.tensor([a.count(c) for c in cats], dtype=torch.float64)
    cb = torch.tensor([b.count(c) for c in cats], dtype=torch.float64)
    small = (ca + cb) < min_count
    if bool(small.any()):
        ca = torch.cat([ca[~small], ca[small].sum()[None]])
        cb = torch.cat([cb[~small], cb[small].sum()[None]])
    na, nb = ca.sum(), cb.sum()
    tot = ca + cb
    keep = tot > 0
    stat = float((((ca * (nb / na).sqrt() - cb * (na / nb).sqrt()) ** 2)[keep] / tot[keep]).sum())
    return chi2_p(stat, int(keep.sum()) - 1)
