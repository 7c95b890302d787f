"""The MTP drafter (runtime/engine/mtp_drafter.py) on GLM-4.7-Flash (``glm4_moe_lite``: MLA) and GLM-5
(``glm_moe_dsa``: MLA + DeepSeek Sparse Attention, the MTP layer with an indexer of its own after a "shared" layer)
checkpoints: greedy outputs token for token those of plain decoding with ``--speculative mtp`` when the MTP layer is
random (drafts made and verified, few kept); with the copy construction (test_spec_mtp.py's: the MTP layer predicts
the token after next exactly) every draft is kept - each draft made from the right token at the right position,
chained right - with the target's and the MTP layer's experts tiered. (Sarvam ships no MTP layer:
tests/runtime/model/test_mtp_glm_sarvam.py.)"""
import importlib.util
import os

import pytest
import torch

from runtime.engine import SamplingParams
from runtime.engine.mtp_drafter import MTPDrafter
from runtime.engine.request import Request
from runtime.model import load_model
from runtime.model.convert import convert
from runtime.model.mtp import load_mtp


def _load(name: str, *path: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(os.path.dirname(__file__), *path))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


glm = _load("_mtp_glm_fixtures", "..", "model", "test_mtp_glm_sarvam.py")   # build_glm_checkpoint, reference
spec_mtp = _load("_spec_mtp_helpers", "test_spec_mtp.py")                    # copy_construction, _run, _prompts


@pytest.fixture(scope="module", params=list(glm.FIXTURES))
def random_mtp(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    ref, mtp_ref = glm.build_glm_checkpoint(request.param, str(d / "hf"))
    convert(str(d / "hf"), str(d / "store"))
    return request.param, str(d / "store"), ref, mtp_ref


@pytest.fixture(scope="module", params=list(glm.FIXTURES))
def copy_mtp(request, tmp_path_factory):
    d = tmp_path_factory.mktemp("copy_" + request.param)
    glm.build_glm_checkpoint(request.param, str(d / "hf"), seed=1)
    spec_mtp.copy_construction(str(d / "hf"))
    convert(str(d / "hf"), str(d / "store"))
    return request.param, str(d / "store")


@pytest.mark.parametrize("max_batch", [1, 3])
def test_greedy_outputs_identical_with_mtp(random_mtp, max_batch):
    arch, store_dir, _, _ = random_mtp
    spec_mtp.greedy_identical(store_dir, max_batch, label=arch)


def test_copy_construction_keeps_every_draft(copy_mtp):
    """Acceptance 100% by construction at k = 3, with a quarter of the target's experts on the device (the MTP store
    the same fraction)."""
    arch, store_dir = copy_mtp
    spec_mtp.copy_keeps_every_draft(store_dir, label=arch)


def test_first_draft_matches_transformers(random_mtp):
    """The drafter fed transformers' own normed hidden states of a prompt (in two overlapping chunks) drafts, after
    the target's next token, the argmax of transformers' MTP layer at the prompt's last position."""
    arch, store_dir, ref, mtp_ref = random_mtp
    prompt = spec_mtp._prompts(1)[0]
    model, store = load_model(store_dir, dtype=torch.float32)
    d = MTPDrafter(load_mtp(store_dir, model), 256)
    try:
        with torch.no_grad():
            x = torch.tensor([prompt])
            h = ref.model(x).last_hidden_state[0]                       # [T, hidden], after the final norm
            nxt = int(ref(x).logits[0, -1].argmax())
            out = glm.mtp_layer(arch, mtp_ref, h[None], torch.arange(1, len(prompt) + 1)[None],
                                torch.tensor([prompt[1:] + [nxt]]))
            want = int(mtp_ref._project_to_logits(out)[0, -1].argmax())
        r = Request(id=0, prompt=list(prompt), params=SamplingParams(max_tokens=8))
        r.seq.length = 5
        d.prefilled(r, h[:5])
        r.seq.length = len(prompt)
        d.prefilled(r, h)
        r.output = [nxt]
        got = d.propose([r], [2])[0]
        assert got.tokens[0] == want and len(got.tokens) == 2, arch
        d.release(r)
        assert d.kv.free_blocks == d.kv.num_blocks
    finally:
        d.close()
        store.close()
