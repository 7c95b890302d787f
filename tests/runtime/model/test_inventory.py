"""The README's inventory of MoE model types against transformers and the architecture registry: every type
transformers maps to a causal LM or an image-text-to-text model whose config (or a sub-config) counts experts has a
row; a row says "supported" exactly where the registry reads the type (and the type has a fixture checked against
transformers); every other row names what the type lacks."""
import dataclasses
import inspect
import os
import re

import pytest

from runtime.model.arch import ARCHITECTURES

from conftest import ARCHS, transformers

README = os.path.join(os.path.dirname(__file__), "..", "..", "..", "README.md")
INVENTORY_VERSION = "5.25."          # the transformers the table was made from
EXPERT_COUNTS = {"num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"}


def rows() -> dict:
    """model_type -> status text, from the README's "MoE model types in transformers" table."""
    text = open(README).read()
    section = text.split("### MoE model types in transformers", 1)[1].split("\n#", 1)[0]
    out = {}
    for m in re.finditer(r"^\| `([a-z0-9_]+)` \| (.+?) \|$", section, re.M):
        if m.group(2) == "status":
            continue                                  # the header
        assert m.group(1) not in out, f"{m.group(1)} listed twice"
        out[m.group(1)] = m.group(2)
    return out


def counts_experts(cls, depth: int = 0) -> bool:
    names = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else \
        set(inspect.signature(cls.__init__).parameters)
    if EXPERT_COUNTS & (names | set(getattr(cls, "attribute_map", None) or {})):
        return True
    subs = (getattr(cls, "sub_configs", None) or {}).values()
    return depth < 2 and any(isinstance(s, type) and counts_experts(s, depth + 1) for s in subs)


def test_supported_rows_are_the_registry():
    table = rows()
    supported = {t for t, s in table.items() if s.startswith("supported")}
    assert supported == set(ARCHITECTURES), (sorted(supported ^ set(ARCHITECTURES)))
    for t, s in table.items():
        assert (s.startswith("supported (") and s.endswith(")")) or (s.startswith("not yet: ") and len(s) > 12), (t, s)
    # each supported type has a fixture of its own config class checked against transformers, or is a release read
    # through one: Qwen3.5's multimodal name (its text config's fixture), Qwen3-Omni's (its thinker's, and
    # test_arch_fixtures' released-layout test), DeepSeek-OCR 2's text config (the release's fixture)
    fixture_types = {getattr(transformers, c).model_type for c, _, _ in ARCHS.values()}
    assert supported - fixture_types <= {"qwen3_5_moe", "qwen3_omni_moe", "deepseek_ocr2_text"}, \
        sorted(supported - fixture_types)


@pytest.mark.skipif(not transformers.__version__.startswith(INVENTORY_VERSION),
                    reason=f"the table lists transformers {INVENTORY_VERSION}x's types")
def test_every_moe_type_transformers_defines_has_a_row():
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
                                                        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)
    types = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) | set(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)
    moe = {t for t in types if t in CONFIG_MAPPING and counts_experts(CONFIG_MAPPING[t])}
    table = rows()
    assert not moe - set(table), f"MoE types without a row: {sorted(moe - set(table))}"
    assert set(table) - moe <= set(ARCHITECTURES), sorted(set(table) - moe - set(ARCHITECTURES))
