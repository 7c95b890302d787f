"""The MTP drafter (runtime/engine/mtp_drafter.py) on ERNIE 4.5's dense MTP layer: greedy outputs token for token those
of plain decoding with ``--speculative mtp`` on a checkpoint whose MTP layer is random (drafts made and verified), and
on one built so the MTP layer predicts the token after next exactly (the copy construction) every draft is kept -
which needs each draft made from the right token at the right position, chained right, through the release's names
(``mtp_linear_proj`` / ``mtp_emb_norm`` / ``mtp_block``) and the model's final norm before the head."""
import importlib.util
import os

import pytest
import torch

from runtime.model.convert import convert


def _load(name: str, *path):
    spec = importlib.util.spec_from_file_location(name, os.path.join(os.path.dirname(__file__), *path))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


engine_base = _load("_spec_mtp_base", "test_spec_mtp.py")                    # _run / _prompts: the engine runs
ernie_fixtures = _load("_mtp_ernie_fixtures", "..", "model", "test_mtp_ernie_mimo.py")   # build_ernie_mtp


@pytest.fixture(scope="module")
def random_ernie(tmp_path_factory):
    d = tmp_path_factory.mktemp("ernie")
    ernie_fixtures.build_ernie_mtp(str(d / "hf"))
    convert(str(d / "hf"), str(d / "store"))
    return str(d / "store")


def ernie_copy_construction(hf: str) -> None:
    """Rewrite the ERNIE checkpoint so its MTP layer predicts the token after next exactly: every sublayer's output
    projection zeroed (o_proj, the dense MLPs', shared and routed experts' down_proj) in the model and in its MTP
    layer, so each residual stream stays its input and the model's next token is f(t) = argmax head(norm(embed(t)));
    the MTP layer's mtp_linear_proj is [identity | 0] (it reads the token, not the hidden state) and mtp_emb_norm's
    weight ones, so with the model's final norm before the head it computes f(t[i + 1]) = t[i + 2]."""
    engine_base.read_the_token(hf, ("o_proj.weight", "down_proj.weight"), "model.mtp_linear_proj.0.weight",
                               "model.mtp_emb_norm.0.weight")


@pytest.fixture(scope="module")
def copy_ernie(tmp_path_factory):
    d = tmp_path_factory.mktemp("ernie_copy")
    ernie_fixtures.build_ernie_mtp(str(d / "hf"), seed=1, tie=False)      # an untied head: f has no fixed points
    ernie_copy_construction(str(d / "hf"))
    convert(str(d / "hf"), str(d / "store"))
    return str(d / "store")


@pytest.mark.parametrize("max_batch", [1, 3])
def test_greedy_outputs_identical_with_mtp(random_ernie, max_batch):
    engine_base.greedy_identical(random_ernie, max_batch)


def test_copy_construction_keeps_every_draft(copy_ernie):
    """Acceptance set by construction: every draft kept at k = 3, outputs those of plain decoding."""
    engine_base.copy_keeps_every_draft(copy_ernie, tiered=False)


# -- MiMo-V2-Flash: a sliding-window MTP layer (a ring per request, rolled back after the chained drafts) -------------
@pytest.fixture(scope="module")
def random_mimo(tmp_path_factory):
    d = tmp_path_factory.mktemp("mimo")
    ernie_fixtures.build_mimo_mtp(str(d / "hf"))
    convert(str(d / "hf"), str(d / "store"))
    return str(d / "store")


def mimo_copy_construction(hf: str) -> None:
    """As ernie_copy_construction for MiMo-V2-Flash's names: its MTP layer's eh_proj [identity | 0], enorm's weight
    ones and final_layernorm's the model's final norm's, every output projection zeroed."""
    p = "model.mtp.layers.0."
    engine_base.read_the_token(hf, ("o_proj.weight", "down_proj.weight"), p + "eh_proj.weight", p + "enorm.weight",
                               p + "final_layernorm.weight")


@pytest.fixture(scope="module")
def copy_mimo(tmp_path_factory):
    d = tmp_path_factory.mktemp("mimo_copy")
    ernie_fixtures.build_mimo_mtp(str(d / "hf"), seed=2)
    mimo_copy_construction(str(d / "hf"))
    convert(str(d / "hf"), str(d / "store"))
    return str(d / "store")


@pytest.mark.parametrize("max_batch", [1, 3])
def test_mimo_greedy_outputs_identical_with_mtp(random_mimo, max_batch):
    """Prompts and outputs past the 6-token window: the MTP layer's ring runs, is rolled back, caught up."""
    engine_base.greedy_identical(random_mimo, max_batch)


def test_mimo_copy_construction_keeps_every_draft(copy_mimo):
    engine_base.copy_keeps_every_draft(copy_mimo, tiered=False)


def test_mimo_chained_drafts_leave_the_ring_as_caught_up(random_mimo):
    """Chained drafts feed the sliding-window layer speculative positions, which overwrite its ring's oldest entries:
    after drafting, the ring is the one the catch-up alone leaves (k = 3 against k = 1, which chains nothing)."""
    from runtime.engine import SamplingParams
    from runtime.engine.mtp_drafter import MTPDrafter
    from runtime.engine.request import Request
    from runtime.model import load_model
    from runtime.model.mtp import load_mtp
    prompt = engine_base._prompts(1)[0]                  # 9 tokens: past the 6-token window
    hidden = torch.randn(len(prompt), 64, generator=torch.Generator().manual_seed(0))
    model, store = load_model(random_mimo, dtype=torch.float32)
    rings = []
    try:
        for k in (1, 3):
            d = MTPDrafter(load_mtp(random_mimo, model), 256, state_slots=2)
            r = Request(id=0, prompt=list(prompt), params=SamplingParams(max_tokens=8), output=[5])
            r.seq.length = len(prompt)
            d.prefilled(r, hidden)
            assert len(d.propose([r], [k])[0].tokens) == k
            m = d.mirrors[0]
            assert m.seq.length == len(prompt)
            rings.append({n: t[m.seq.state].clone() for n, t in d.mtp.kv[3].slot_tensors().items()})
            d.close()
    finally:
        store.close()
    assert rings[0].keys() == rings[1].keys() and rings[0]
    for n in rings[0]:
        assert torch.equal(rings[0][n], rings[1][n]), n
