"""The MTP drafter (runtime/engine/mtp_drafter.py) on DeepSeek-V4 (runtime/model/arch/deepseek_v4_mtp.py): greedy
outputs token for token those of plain decoding with ``--speculative mtp`` on the tiny V4 checkpoint of
tests/runtime/model/test_mtp_deepseek_v4.py (a random MTP layer: drafts made and verified, few kept); the drafts the
engine makes - from the target's streams handed over through prompt chunks, decode and verify steps with rollbacks,
and chained - are the reference's (the release's formula on transformers' streams); on a checkpoint built so the
MTP layer predicts the token after next exactly (the copy construction below) every draft is kept."""
import importlib.util
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from runtime.engine.speculative import SpecOptions
from runtime.model.convert import convert

_spec = importlib.util.spec_from_file_location(
    "_v4_mtp_fixtures", os.path.join(os.path.dirname(__file__), "..", "model", "test_mtp_deepseek_v4.py"))
fixtures = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fixtures)            # build_v4_mtp: the tiny DeepSeek-V4 with an MTP layer, its reference
_spec = importlib.util.spec_from_file_location("_spec_mtp_v4", os.path.join(os.path.dirname(__file__),
                                                                          "test_spec_mtp.py"))
spec_mtp = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(spec_mtp)            # greedy_identical / copy_keeps_every_draft: the checks every MTP file runs

V = fixtures.V


@pytest.fixture(scope="module")
def random_v4(tmp_path_factory):
    d = tmp_path_factory.mktemp("v4")
    r = fixtures.build_v4_mtp(str(d / "hf"))
    convert(str(d / "hf"), str(d / "store"))
    return r, str(d / "store")


def copy_construction(hf: str) -> None:
    """Rewrite the V4 checkpoint so the token after next is what its MTP layer predicts, exactly. Every sublayer's
    output projection is zeroed (attention ``wo_b``, routed and shared experts' ``w2``) in the model and its MTP
    layer: each layer's streams are then the comb-mixed streams before it - N copies of the embedding stay parallel
    to it -, the hc_head's weighted sum is a multiple of it and the final norm undoes the scale, so the model's next
    token is f(t) = argmax head(norm(embed(t))). The MTP layer's e_proj is the identity and h_proj zero (it reads the
    token, not the streams), enorm's weight ones and its norm the final norm's: it computes f(t[i + 1]) = t[i + 2]
    the same way. Routing still runs (experts are fetched and computed: their outputs are zero)."""
    path = os.path.join(hf, "model.safetensors")
    t = load_file(path)
    for k in t:
        if k.endswith(("attn.wo_b.weight", "w2.weight")):
            t[k] = torch.zeros_like(t[k])
    H = t["model.embed_tokens.weight"].shape[1]
    t["mtp.0.e_proj.weight"], t["mtp.0.h_proj.weight"] = torch.eye(H), torch.zeros(H, H)
    t["mtp.0.enorm.weight"], t["mtp.0.norm.weight"] = torch.ones(H), t["model.norm.weight"].clone()
    save_file(t, path, metadata={"format": "pt"})


@pytest.fixture(scope="module")
def copy_v4(tmp_path_factory):
    d = tmp_path_factory.mktemp("v4_copy")
    fixtures.build_v4_mtp(str(d / "hf"), seed=1)
    copy_construction(str(d / "hf"))
    convert(str(d / "hf"), str(d / "store"))
    return str(d / "store")


def _prompts(n: int = 3):
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, V, (L,), generator=g).tolist() for L in (9, 4, 14)][:n]


@pytest.mark.parametrize("max_batch", [1, 3])
def test_greedy_outputs_identical_with_mtp(random_v4, max_batch):
    r, store_dir = random_v4
    spec_mtp.greedy_identical(store_dir, max_batch, prompts=_prompts())


def test_engine_drafts_are_the_references(random_v4):
    """Every proposal the engine's drafter makes (3 drafts, the second and third chained) is the reference's argmax on
    transformers' streams of the context: the streams reached the drafter from chunked prefill, decode and verify
    steps (rejections included) at the right positions, each chained draft read the layer's own output streams, and
    the window ring the chained positions wrote was put back before the next catch-up read it."""
    r, store_dir = random_v4
    log: list = []
    spec_mtp._run(store_dir, _prompts(2), SpecOptions("mtp", 3, rule="fixed"), 2, max_tokens=10, log=log)
    assert len(log) >= 6 and any(len(d) == 3 for _, d in log)
    for ctx, draft in log:
        hh, toks = r.streams(ctx[:-1]), ctx[1:]          # positions 0 .. n - 2; the last token reads h[n - 2]
        for d in draft:
            x, _, logits = r.mtp(hh, toks)
            assert logits[-1, d] >= logits[-1].max() - 1e-4, (ctx, draft)
            hh, toks = torch.cat([hh, x[-1:]]), toks + [d]


def test_copy_construction_keeps_every_draft(copy_v4):
    """Acceptance set by construction: 100% of the drafts at k = 3, with a tiered target and MTP store."""
    spec_mtp.copy_keeps_every_draft(copy_v4, prompts=_prompts())
