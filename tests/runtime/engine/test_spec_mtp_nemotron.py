"""The MTP drafter (runtime/engine/mtp_drafter.py) on Nemotron-H / Nemotron 3 (Mamba-2, NoPE attention, relu^2 MoE;
its MTP step the blocks ``*E``: attention, then MoE) and Mellum (sliding-window layers with a RoPE of their own; its
MTP layer a sliding one) checkpoints: greedy outputs token for token those of plain decoding with
``--speculative mtp`` when the MTP layer is random (drafts made and verified, few kept); with the copy construction
below (the MTP layer predicts the token after next exactly) every draft is kept - each draft made from the right
token at the right position, chained right (for Mellum: its window ring rolled back after the chained drafts) - with
the target's and the MTP layer's experts tiered. The MTP forward against its references:
tests/runtime/model/test_mtp_nemotron.py."""
import importlib.util
import os

import pytest

from runtime.model.convert import convert


def _load(name: str, *path: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(os.path.dirname(__file__), *path))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


fixtures = _load("_mtp_nemotron_fixtures", "..", "model", "test_mtp_nemotron.py")   # build: checkpoints with MTP
spec_mtp = _load("_spec_mtp_helpers_nemotron", "test_spec_mtp.py")                  # _run, _prompts

# each release's MTP parts of the copy construction: the input projection, the embedding's norm, the head's norm
COPY_PARTS = {"nemotron_h": ("mtp.layers.0.eh_proj.weight", "mtp.layers.0.enorm.weight",
                             "mtp.layers.1.final_layernorm.weight", "backbone.norm_f.weight"),
              "mellum": ("mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.norm.weight", "model.norm.weight")}


# seeds whose f(t) = argmax head(norm(embed(t))) has no short cycle from the test prompts (checked below)
COPY_SEED = {"nemotron_h": 1, "mellum": 2}


def copy_construction(arch: str, hf: str) -> None:
    """Rewrite the checkpoint so the token after next is what its MTP layer predicts, exactly (test_spec_mtp.py's
    construction in these releases' names). Every sublayer's output projection is zeroed - attention o_proj (and
    Mellum's o_proj bias), Mamba-2's out_proj, MLP / shared / routed experts' down_proj - in the model and in its MTP
    layer: each residual stream stays its input, so the model's next token is f(t) = argmax head(norm(embed(t))). The
    MTP input projection is [identity | 0] (it reads the token, not the hidden state), the embedding's norm ones, the
    head's norm the model's final one: it computes f(t[i + 1]) = t[i + 2]. Routing still runs (experts fetched and
    computed: their outputs are zero)."""
    proj, enorm, head_norm, final = COPY_PARTS[arch]
    spec_mtp.read_the_token(hf, ("o_proj.weight", "o_proj.bias", "down_proj.weight", "out_proj.weight"), proj, enorm,
                            head_norm, final)


@pytest.fixture(scope="module", params=list(fixtures.ARCH_MTP))
def random_mtp(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    fixtures.build(request.param, str(d / "hf"))
    convert(str(d / "hf"), str(d / "store"))
    return request.param, str(d / "store")


@pytest.fixture(scope="module", params=list(fixtures.ARCH_MTP))
def copy_mtp(request, tmp_path_factory):
    d = tmp_path_factory.mktemp("copy_" + request.param)
    fixtures.build(request.param, str(d / "hf"), seed=COPY_SEED[request.param])
    copy_construction(request.param, str(d / "hf"))
    convert(str(d / "hf"), str(d / "store"))
    return request.param, str(d / "store")


@pytest.mark.parametrize("max_batch", [1, 3])
def test_greedy_outputs_identical_with_mtp(random_mtp, max_batch):
    arch, store_dir = random_mtp[:2]
    spec_mtp.greedy_identical(store_dir, max_batch, label=arch)


def test_copy_construction_keeps_every_draft(copy_mtp):
    """Acceptance set by construction: 100% of the drafts at k = 3, prompts longer than Mellum's window of 6, with a
    quarter of the target's experts on the device (the MTP store the same fraction)."""
    arch, store_dir = copy_mtp
    spec_mtp.copy_keeps_every_draft(store_dir, label=arch)
