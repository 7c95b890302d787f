"""Expert weights: the formats an expert blob's weights can hold and the codec of one expert, under
the one name callers import them by.

- runtime/weight_formats.py: the format registry (fp32 / bf16 / fp16, mxfp4, int4, int8, fp8_e4m3):
  how each stores a weight matrix, quantizes it and turns it back into a float operand.
- runtime/expert_codec.py: one expert's logical weights (``WeightSpec``), how a blob is encoded, and
  ``ExpertCodec``, which turns a stored blob into the float operands the expert matmuls read.

The codec builds on the formats, so the two modules import in that one direction; this module
imports both and defines nothing of its own.
"""
from __future__ import annotations

from .expert_codec import (ExpertCodec, ExpertWeights, WeightSpec, blob_tensor_specs, encode_expert,  # noqa: F401
                           expert_weight_specs)
from .weight_formats import (FLOAT_DTYPES, FORMATS, FP4_E2M1, FP8, INT4, INT8, MXFP4, SCALE_DTYPES,  # noqa: F401
                             _INSTANCES, Dense, FormatSpec, Part, WeightFormat, _cut, _group_scales, _Lut16,
                             _Nibbles, _split_cols, cost_dtype, dense_format_of, get_format, quantize_choices,
                             register_format)
