"""Hugging Face checkpoint -> tiered store (expert blobs + manifest) + dense weights.

Reads ``config.json`` and ``*.safetensors`` (sharded with ``model.safetensors.index.json`` or a
single file), tensor by tensor: an expert's three matrices are read, written as one blob, and
dropped, so a model larger than RAM converts (a layer's experts fused into two float tensors, as
Qwen3-VL ships them, are read a layer at a time). Dense weights go to ``dense.safetensors``; an
architecture module's ``convert_dense`` may reorder them (ERNIE 4.5's interleaved-RoPE q/k rows).

Quantized checkpoints (``quantization_config`` in config.json) are read as shipped:
- ``fp8`` (DeepSeek-V3 / V3.2, Qwen FP8): E4M3 weights with ``weight_scale_inv`` tiles
  (``weight_block_size``, 128 x 128);
- ``compressed-tensors`` ``pack-quantized`` (Kimi K2 / K2.5): symmetric int4 in int32 words,
  ``weight_packed`` / ``weight_scale`` / ``weight_shape``, group strategy;
- ``mxfp4`` (gpt-oss): fused per-layer ``*_blocks`` / ``*_scales``.
Expert bytes go into the store as shipped (no dequantize/requantize round trip; gpt-oss's
interleaved gate/up rows are only reordered). Non-expert weights (attention, shared experts,
dense MLPs) are dequantized at conversion into the dtype of the checkpoint's embeddings (bf16 in
the released checkpoints). ``quantize=`` turns a float checkpoint's experts into mxfp4, int4 or
fp8 (rounding: ``runtime/weight_formats.py``).
"""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field

import torch

from ..quant import ExpertCodec, quantize_choices, WeightFormat, dense_format_of, expert_weight_specs, get_format
from ..store.layout import StoreWriter
from .layers.dense import DENSE_QUANT
from cache_policy.jsonfile import read_json

from .arch import language_model, module
from .config import MoEConfig
from .moe import dense_tensors
from .mtp import MTP_DENSE, mtp_checkpoint, mtp_config, mtp_copies, mtp_dense_tensors, mtp_layers_of, mtp_store_dir
# The tensor names the layers share with conversion live in names.py; importable from here as before.
from .names import expert_names

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                   "chat_template.jinja")
QUANT_METHODS = ("fp8", "compressed-tensors (pack-quantized int4)", "mxfp4")


def dense_names(cfg: MoEConfig) -> dict:
    """Every dense tensor the model needs -> expected shape: declared by the layers that take them
    (runtime/model/moe.py ``dense_tensors``)."""
    return dense_tensors(cfg)


_ST_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool, "F8_E4M3": getattr(torch, "float8_e4m3fn", None), "F8_E5M2": getattr(torch, "float8_e5m2", None),
              "F8_E8M0": getattr(torch, "float8_e8m0fnu", None)}


class Checkpoint:
    """Tensors of a (possibly sharded) safetensors checkpoint, read one at a time with pread.

    Not memory-mapped: a converted tensor's pages do not stay in the process, so converting a
    model larger than RAM keeps the resident set to about one expert. The format is the
    safetensors one: 8-byte little-endian header length, a JSON header of dtype, shape and
    data offsets, then the data."""

    def __init__(self, model_dir: str, lm_prefix: str = "model.", lm_head_name: str = "lm_head.weight",
                 aliases=None) -> None:
        self.dir = model_dir
        self.aliases = aliases          # name -> [candidate stored names] (an architecture's released naming)
        self._headers: dict = {}
        self.lm_prefix = lm_prefix      # multimodal checkpoints store model.* under e.g. model.language_model.
        self.lm_head_name = lm_head_name   # ... and lm_head.weight under e.g. language_model.lm_head.weight
        self.read: set = set()          # stored names read so far (the rest is reported as not needed)
        index = os.path.join(model_dir, "model.safetensors.index.json")
        if os.path.exists(index):
            try:
                with open(index) as f:
                    self.where = dict(json.load(f)["weight_map"])
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(f"{index}: not a safetensors index ({e})") from None
        else:
            files = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
            if not files:
                raise ValueError(f"{model_dir}: no *.safetensors files")
            self.where = {k: f for f in files for k in self._header(f)[0] if k != "__metadata__"}

    def _header(self, fname: str):
        h = self._headers.get(fname)
        if h is None:
            path = os.path.join(self.dir, fname)
            if not os.path.exists(path):
                raise ValueError(f"{path}: shard named by the index does not exist")
            size = os.path.getsize(path)
            with open(path, "rb") as f:
                raw = f.read(8)
                n = int.from_bytes(raw, "little") if len(raw) == 8 else -1
                if n <= 0 or 8 + n > size:
                    raise ValueError(f"{path}: not a readable safetensors file (bad header length)")
                try:
                    meta = json.loads(f.read(n))
                except (json.JSONDecodeError, UnicodeDecodeError) as e:
                    raise ValueError(f"{path}: not a readable safetensors file (header: {e})") from None
            h = self._headers[fname] = (meta, 8 + n, size)
        return h

    def stored(self, name: str) -> str:
        """The checkpoint's name for one of ours (``model.layers.0...``): the architecture's release names (aliases)
        first, each where the language model is stored (a multimodal release's prefix and head)."""
        if self.aliases is not None:
            names = [self._placed(n) for n in self.aliases(name)]
            for i, c in enumerate(names):
                if c in self.where:
                    self._style = i             # the naming this checkpoint uses: a missing tensor is named in it
                    return c
            return names[min(getattr(self, "_style", 0), len(names) - 1)]   # (a name the release does not rename)
        return self._placed(name)

    def _placed(self, name: str) -> str:
        if self.lm_prefix != "model." and name.startswith("model."):
            return self.lm_prefix + name[len("model."):]
        if name == "lm_head.weight":
            return self.lm_head_name
        return name

    def has(self, name: str) -> bool:
        return self.stored(name) in self.where

    def unread(self) -> list:
        """Stored tensors no read asked for (a vision tower, multi-token-prediction layers...)."""
        return sorted(n for n in self.where if n not in self.read)

    def get(self, name: str, shape=None) -> torch.Tensor:
        name = self.stored(name)
        self.read.add(name)
        f = self.where.get(name)
        if f is None:
            raise ValueError(f"{self.dir}: tensor {name!r} is missing from the checkpoint")
        path = os.path.join(self.dir, f)
        meta, base, size = self._header(f)
        info = meta.get(name)
        if info is None:
            raise ValueError(f"{path}: tensor {name!r} is missing (the index names this file)")
        dt = _ST_DTYPES.get(info.get("dtype"))
        if dt is None:
            raise ValueError(f"{path}: tensor {name!r} has unsupported dtype {info.get('dtype')!r}")
        a, b = info["data_offsets"]
        want = int(torch.Size(info["shape"]).numel()) * dt.itemsize
        if b - a != want:
            raise ValueError(f"{path}: tensor {name!r} header is inconsistent ({b - a} bytes for shape {info['shape']})")
        if base + b > size:
            raise ValueError(f"{path}: cannot read tensor {name!r}: the file ends at {size} bytes, the tensor at "
                             f"{base + b}: truncated")
        buf = bytearray(b - a)
        with open(path, "rb") as fh:
            n = os.preadv(fh.fileno(), [buf], base + a)
        if n != len(buf):
            raise ValueError(f"{path}: short read of tensor {name!r}: truncated")
        t = torch.frombuffer(buf, dtype=dt).reshape(info["shape"]) if buf else torch.empty(info["shape"], dtype=dt)
        if shape is not None and tuple(t.shape) != tuple(shape):
            raise ValueError(f"{path}: tensor {name!r} has shape {tuple(t.shape)}, expected {tuple(shape)}")
        return t


class ShippedQuant:
    """A checkpoint's ``quantization_config``: how its quantized tensors are laid out."""

    def __init__(self, qc: "dict | None", source: str) -> None:
        self.method, self.fmt = None, None
        if not qc:
            return
        if not isinstance(qc, dict):
            raise ValueError(f"{source}: quantization_config is not an object")
        m = qc.get("quant_method")
        self.method = m
        if m == "fp8":
            if qc.get("fmt", "e4m3") != "e4m3":
                raise ValueError(f"{source}: fp8 format {qc.get('fmt')!r} is not supported (e4m3 is)")
            block = qc.get("weight_block_size")
            if block is None:
                raise ValueError(f"{source}: fp8 quantization_config without weight_block_size (per-tensor fp8 is not supported)")
            # DeepSeek-V4: scales as E8M0 bytes (powers of two), and the routed experts in FP4 or FP8
            self.scale_fmt = qc.get("scale_fmt") or "float"
            if self.scale_fmt not in ("float", "ue8m0"):
                raise ValueError(f"{source}: fp8 scale_fmt {self.scale_fmt!r} is not supported (float and ue8m0 are)")
            self.expert_dtype = qc.get("expert_dtype") or "fp8"
            if self.expert_dtype not in ("fp8", "fp4"):
                raise ValueError(f"{source}: expert_dtype {self.expert_dtype!r} is not supported (fp8 and fp4 are)")
            self.fmt = get_format("fp8_e4m3", block=tuple(block))
        elif m == "compressed-tensors":
            if qc.get("format") != "pack-quantized":
                raise ValueError(f"{source}: compressed-tensors format {qc.get('format')!r} is not supported "
                                 f"(pack-quantized int4 is)")
            groups = [g for g in (qc.get("config_groups") or {}).values() if isinstance(g, dict)]
            w = groups[0].get("weights") if len(groups) == 1 else None
            if not w:
                raise ValueError(f"{source}: compressed-tensors needs exactly one config group with weights, got {len(groups)}")
            bad = {k: w.get(k) for k, want in (("num_bits", 4), ("type", "int"), ("symmetric", True), ("strategy", "group"))
                   if w.get(k) != want}
            if bad:
                raise ValueError(f"{source}: compressed-tensors weights {bad} are not supported "
                                 f"(num_bits 4, type int, symmetric, group strategy are)")
            self.group = int(w.get("group_size") or 0)
            self.fmt = None   # the scale dtype comes from the tensors (INT4 below)
        elif m == "mxfp4":
            self.fmt = get_format("mxfp4")
        else:
            raise ValueError(f"{source}: quant_method {m!r} is not supported; supported: {', '.join(QUANT_METHODS)}")

    def int4(self, scale_dtype: torch.dtype) -> WeightFormat:
        name = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}.get(scale_dtype)
        if name is None:
            raise ValueError(f"int4 weight_scale of dtype {scale_dtype} is not supported")
        return get_format("int4", group=self.group, scale_dtype=name)


def _e8m0(t: torch.Tensor) -> torch.Tensor:
    """E8M0 scale bytes (safetensors F8_E8M0, or uint8) -> their float32 values 2^(byte - 127) (exact)."""
    b = t.view(torch.uint8).to(torch.int32)
    return torch.where(b == 255, torch.tensor(float("nan")), torch.exp2((b - 127).float()))


def _fp8_scale(ck: "Checkpoint", name: str) -> torch.Tensor:
    """The scale tiles of fp8 weight ``name``: ``<name>_scale_inv`` (DeepSeek-V3, Qwen) or ``<base>.scale``
    (DeepSeek-V4's release), float32 or E8M0 -> float32."""
    for n in (name + "_scale_inv", name[: -len("weight")] + "scale"):
        if ck.has(n):
            s = ck.get(n)
            return _e8m0(s) if s.dtype in (torch.uint8, getattr(torch, "float8_e8m0fnu", None)) else s.float()
    raise ValueError(f"{ck.dir}: fp8 tensor {ck.stored(name)!r} has no scale ({name}_scale_inv or {name[:-len('weight')]}scale)")


def read_linear(ck: "Checkpoint", name: str, shape: tuple, sq: ShippedQuant):
    """One Linear weight ``name`` ([out, in]) as shipped: a float tensor, or (format, parts)
    for an fp8 (``name`` + ``name_scale_inv``) or int4 (``name_packed`` + ``name_scale``) one."""
    packed = name + "_packed"
    if ck.has(packed):
        base = name[: -len("weight")]
        scale = ck.get(base + "weight_scale")
        fmt = sq.int4(scale.dtype) if sq.method == "compressed-tensors" else None
        if fmt is None:
            raise ValueError(f"{ck.dir}: tensor {packed!r} found but quantization_config is not compressed-tensors")
        if ck.has(base + "weight_shape"):
            ws = tuple(int(x) for x in ck.get(base + "weight_shape").tolist())
            if ws != tuple(shape):
                raise ValueError(f"{ck.dir}: tensor {base + 'weight_shape'!r} says {ws}, expected {tuple(shape)}")
        parts = {"packed": ck.get(packed), "scale": scale}
        fmt.check(name, shape, parts)
        return fmt, parts
    t = ck.get(name)
    if t.dtype == torch.float8_e4m3fn:
        if sq.method != "fp8":
            raise ValueError(f"{ck.dir}: tensor {name!r} is float8_e4m3fn but quantization_config is {sq.method!r}")
        parts = {"weight": t, "scale_inv": _fp8_scale(ck, name)}
        sq.fmt.check(name, shape, parts)
        return sq.fmt, parts
    if t.dtype == torch.int8 and sq.method == "fp8" and getattr(sq, "expert_dtype", "fp8") == "fp4":
        # DeepSeek-V4's FP4 experts: E2M1 pairs in int8 bytes (element 2j in the low nibble of byte j), one
        # E8M0 scale per 32 of a row - the MXFP4 layout, stored as shipped
        fmt = get_format("mxfp4")
        sc = ck.get(name[: -len("weight")] + "scale")
        parts = {"blocks": t.view(torch.uint8), "scales": sc.view(torch.uint8)}
        fmt.check(name, shape, parts)
        return fmt, parts
    if tuple(t.shape) != tuple(shape):
        ck.get(name, shape)   # raises, naming the file
    return None, t


def stored_names(cfg: MoEConfig):
    """The architecture's release names for ours (``Checkpoint``'s aliases), or None: its ``stored_names``, or - where
    they depend on the config (Nemotron-H's layers pair its blocks) - ``stored_names_of(cfg)``."""
    arch = module(cfg.model_type)
    return arch.stored_names_of(cfg) if hasattr(arch, "stored_names_of") else getattr(arch, "stored_names", None)


def read_dense(ck: "Checkpoint", name: str, shape: tuple, sq: ShippedQuant, dtype: torch.dtype) -> torch.Tensor:
    """A non-expert tensor, dequantized into ``dtype`` where it is shipped quantized."""
    if len(shape) == 2 and (sq.method in ("fp8", "compressed-tensors")):
        fmt, t = read_linear(ck, name, shape, sq)
        if fmt is not None:
            out = torch.empty(shape, dtype=torch.float32)
            return fmt.dequantize(t, out).to(dtype)
        return t.contiguous()
    return ck.get(name, shape).contiguous()


def read_rows(ck: "Checkpoint", name: str, shape: tuple, where: tuple) -> torch.Tensor:
    """Our tensor ``name`` as rows lo:hi of a stored one (where = (stored name, lo, hi))."""
    src, lo, hi = where
    t = ck.get(src)
    if t.dim() != len(shape) or t.shape[0] < hi or tuple(t.shape[1:]) != tuple(shape[1:]) or hi - lo != shape[0]:
        raise ValueError(f"{ck.dir}: tensor {ck.stored(src)!r} has shape {tuple(t.shape)}, expected rows {lo}:{hi} "
                         f"of it to be {name} {tuple(shape)}")
    return t[lo:hi].contiguous()


def _gpt_oss_layer(ck: "Checkpoint", cfg: MoEConfig, layer: int) -> dict:
    """gpt-oss's fused per-layer expert tensors -> per expert logical weights. Its gate_up rows
    (output features) interleave gate (even) and up (odd); they are reordered into gate then up
    rows, which moves whole rows of MXFP4 bytes and changes none."""
    p = f"model.layers.{layer}.mlp.experts."
    E, H, I = cfg.num_experts, cfg.hidden_size, cfg.expert_intermediate
    out = {"bias_gu": ck.get(p + "gate_up_proj_bias", (E, 2 * I)), "bias_dn": ck.get(p + "down_proj_bias", (E, H))}
    if ck.has(p + "gate_up_proj_blocks"):
        fmt = get_format("mxfp4")
        for w, (O, In) in (("gate_up_proj", (2 * I, H)), ("down_proj", (H, I))):
            blocks, scales = ck.get(p + w + "_blocks"), ck.get(p + w + "_scales")
            if tuple(scales.shape) != (E, O, In // 32) or blocks.numel() != E * O * In // 2 or blocks.dtype != torch.uint8:
                raise ValueError(f"{ck.dir}: {p + w}_blocks {tuple(blocks.shape)} / _scales {tuple(scales.shape)} do not "
                                 f"hold {E} experts of a {O}x{In} mxfp4 weight (blocks [E, {O}, {In // 32}, 16] uint8, "
                                 f"scales [E, {O}, {In // 32}])")
            out[w] = (fmt, blocks.reshape(E, O, In // 2), scales)
    else:
        out["gate_up_proj"] = (None, ck.get(p + "gate_up_proj", (E, H, 2 * I)))    # input-major
        out["down_proj"] = (None, ck.get(p + "down_proj", (E, I, H)))
    return out


def _gpt_oss_expert(layer_t: dict, e: int) -> dict:
    fmt, *gu = layer_t["gate_up_proj"]
    _, *dn = layer_t["down_proj"]
    bias = layer_t["bias_gu"][e]
    b = {"gate_up_bias": torch.cat([bias[0::2], bias[1::2]]), "down_bias": layer_t["bias_dn"][e]}
    if fmt is None:
        w = gu[0][e].t()                                                 # [2I, H], rows interleaved
        return {"gate": w[0::2], "up": w[1::2], "down": dn[0][e].t(), **b}
    blocks, scales = gu
    return {"gate": {"blocks": blocks[e, 0::2].contiguous(), "scales": scales[e, 0::2].contiguous()},
            "up": {"blocks": blocks[e, 1::2].contiguous(), "scales": scales[e, 1::2].contiguous()},
            "down": {"blocks": dn[0][e], "scales": dn[1][e]}, **b}


def fused_expert_name(cfg: MoEConfig, layer: int, w: str) -> str:
    return f"model.layers.{layer}.{cfg.mlp_prefix}experts.{w}"


def _fused_layer(ck: "Checkpoint", cfg: MoEConfig, layer: int):
    """A layer's experts fused into two float tensors -> input-major ``gate_up`` [E, hidden, 2I] (gate
    columns, then up) and ``down`` [E, I, hidden], the layout Qwen3-VL ships. transformers 5 saves
    them output-major ([E, 2I, hidden], [E, hidden, I]) and, loading, tells the two apart by shape,
    the output-major reading first where both fit (hidden = 2I); so does this - but for an architecture
    whose experts transformers keeps input-major (``FUSED_INPUT_MAJOR``: Llama 4), read only so."""
    E, H, I = cfg.num_experts, cfg.hidden_size, cfg.expert_intermediate
    out_major = not getattr(module(cfg.model_type), "FUSED_INPUT_MAJOR", False)

    def read(w: str, in_major: tuple):
        name = fused_expert_name(cfg, layer, w)
        t = ck.get(name)
        if out_major and tuple(t.shape) == (E, in_major[2], in_major[1]):
            return t.transpose(1, 2)
        return t if tuple(t.shape) == in_major else ck.get(name, in_major)   # the latter raises: shape and expected
    return read("gate_up_proj", (E, H, 2 * I)), read("down_proj", (E, I, H))


def expert_error(weights: list, raw: dict, src: dict, dtype=torch.float32, n: int = 8, seed: int = 0) -> float:
    """Relative error ||y_q - y|| / ||y|| of one expert's output on ``n`` random inputs - SwiGLU, or relu^2 for an
    ungated expert (Nemotron-H's: up and down only) -, the stored (quantized) weights against the float ones they
    were made from."""
    codec = ExpertCodec(weights, torch.float32, "cpu")
    deq = codec.dequantize_all(raw)
    H = codec.shapes[0]
    x = torch.randn(n, H, generator=torch.Generator().manual_seed(seed))

    def run(g, u, d):
        h = x @ u.float().t()
        h = torch.relu(h).square() if g is None else torch.nn.functional.silu(x @ g.float().t()) * h
        return h @ d.float().t()

    I = codec.shapes[1]
    gq, uq = (deq.get("gate"), deq["up"]) if "up" in deq else (deq["gate_up"][:I], deq["gate_up"][I:])
    y = run(src.get("gate"), src["up"], src["down"])
    return float((run(gq, uq, deq["down"]) - y).norm() / y.norm().clamp_min(1e-30))


@dataclass
class ConvertReport:
    """What ``convert`` did: the experts' format and, with ``quantize``, its error."""
    expert_format: str
    source: str                    # "float", "shipped <method>", "quantized from <dtype>"
    blob_bytes: int
    mean_rel_error: "float | None" = None
    max_rel_error: "float | None" = None
    unread: list = field(default_factory=list)   # checkpoint tensors decoding does not need (vision...), not read
    mtp_layers: int = 0            # multi-token-prediction layers kept (the store's mtp/ part: runtime/model/mtp.py)


def _expert_reader(ck: Checkpoint, cfg: MoEConfig, sq: "ShippedQuant"):
    """logical(layer, e) -> one expert's logical weights: float [out, in] tensors or (format, parts) as
    shipped. Layers whose experts are fused (gpt-oss, Qwen3-VL) are read once and kept for their experts."""
    H, I = cfg.expert_in, cfg.expert_intermediate
    shapes = {"gate": (I, H), "up": (I, H), "down": (H, I)}
    gpt_oss = cfg.model_type == "gpt_oss"
    layer_cache: dict = {}

    def fused(layer: int, read):
        if layer not in layer_cache:
            layer_cache.clear()
            layer_cache[layer] = read(ck, cfg, layer)
        return layer_cache[layer]

    def logical(layer: int, e: int) -> dict:
        if gpt_oss:
            return _gpt_oss_expert(fused(layer, _gpt_oss_layer), e)
        if ck.has(fused_expert_name(cfg, layer, "gate_up_proj")):   # Qwen3-VL: the layer's experts in two tensors
            gu, dn = fused(layer, _fused_layer)
            return {"gate": gu[e, :, :I].t().contiguous(), "up": gu[e, :, I:].t().contiguous(), "down": dn[e].t().contiguous()}
        out = {}
        for k, n in expert_names(cfg, layer, e).items():
            fmt, t = read_linear(ck, n, shapes[k], sq)
            out[k] = t if fmt is None else (fmt, t)
        return out
    return logical


def _expert_format(probe: dict, sq: "ShippedQuant", quantize: "str | None", model_dir: str):
    """(format, shipped?, source) of the store's experts, from the first expert as read (its up projection: every
    expert has one)."""
    if isinstance(probe["up"], (tuple, dict)):
        fmt = probe["up"][0] if isinstance(probe["up"], tuple) else get_format("mxfp4")
        return fmt, True, f"shipped {sq.method}"
    dt = probe["up"].dtype
    if dt not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"{model_dir}: expert weights are {dt} without a quantization_config this tiered-moe reads; "
                         f"supported quant_method: {', '.join(QUANT_METHODS)}")
    fmt = get_format(quantize_choices()[quantize]) if quantize else dense_format_of(dt)
    return fmt, False, f"quantized from {dense_format_of(dt).name}" if quantize else "float"


def _write_experts(writer, cfg: MoEConfig, logical, fmt, shipped: bool, weights: list, quantize, model_dir: str,
                   progress: bool) -> list:
    """Every expert into the store; returns the quantization errors of a sample of them."""
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=cfg.num_moe_layers * cfg.num_experts, desc="converting experts", unit="expert")
    errors = []
    for m, layer in enumerate(cfg.moe_layers):
        for e in range(cfg.num_experts):
            w = logical(layer, e)
            mats = [k for k in ("gate", "up", "down") if k in w]     # an ungated expert (Nemotron-H) has no gate
            for k in mats:
                v = w[k]
                if isinstance(v, tuple):
                    if v[0].name != fmt.name or v[0].params() != fmt.params():
                        raise ValueError(f"{model_dir}: layer {layer} expert {e} {k} is {v[0].name} {v[0].params()}, "
                                         f"the first expert's is {fmt.name} {fmt.params()}: mixed expert formats")
                    w[k] = v[1]
            if not fmt.quantized and "gate" in w:
                w["gate_up"] = torch.cat([w.pop("gate"), w.pop("up")], 0)
            elif fmt.quantized and not shipped:
                # contiguous: gpt-oss's gate and up are every other row of its fused tensor (strided views)
                src = {k: w[k].contiguous() for k in mats}
                w.update({k: fmt.quantize(v) for k, v in src.items()})
            writer.write(m, e, w)
            if quantize and (e < 4 or e % 16 == 0):   # a sample of experts per layer
                # every stored part as the codec names it: a quantized weight's parts, a float tensor's ".t"
                # (gpt-oss's biases)
                raw = {f"{k}.{s}": t for k, v in w.items() for s, t in (v.items() if isinstance(v, dict) else
                                                                        [("t", v)])}
                errors.append(expert_error(weights, raw, src))
            if bar:
                bar.update()
    if bar:
        bar.close()
    return errors


def _write_dense(ck: Checkpoint, cfg: MoEConfig, sq: "ShippedQuant", model_dir: str, out_dir: str) -> None:
    """The dense tensors (dequantized like every non-expert weight), config and tokenizer files."""
    embed = ck.get("model.embed_tokens.weight", (cfg.vocab_size, cfg.hidden_size))
    arch = module(cfg.model_type)
    # tensors an architecture stores as rows of one (Granite's shared MLP, Ling's query_key_value) where the
    # checkpoint does not hold them apart
    sliced = getattr(arch, "sliced", None)
    dense = {}
    for n, s in dense_names(cfg).items():
        where = None if sliced is None or ck.has(n) else sliced(n, cfg)
        dense[n] = read_dense(ck, n, s, sq, embed.dtype) if where is None else read_rows(ck, n, s, where)
    if hasattr(arch, "convert_dense"):   # an architecture's reordering of stored weights (ERNIE 4.5's q/k rows)
        arch.convert_dense(cfg, dense)
    _save_readable(dense, os.path.join(out_dir, "dense.safetensors"))
    shutil.copy(os.path.join(model_dir, "config.json"), os.path.join(out_dir, "config.json"))
    for f in TOKENIZER_FILES:
        if os.path.exists(os.path.join(model_dir, f)):
            shutil.copy(os.path.join(model_dir, f), os.path.join(out_dir, f))


def convert(model_dir: str, out_dir: str, progress: bool = False, quantize: "str | None" = None,
            dense_quant: "str | None" = None) -> ConvertReport:
    """``model_dir`` (a Hugging Face checkpoint) -> the store ``out_dir``. ``quantize``: the experts of a float
    checkpoint into that format. ``dense_quant`` (none | int8 | int4): recorded in the manifest's extra as how the
    non-expert projections run by default (the runtime's --dense-quant auto); their tensors are stored as the
    checkpoint has them either way."""
    if dense_quant is not None and dense_quant not in DENSE_QUANT:
        raise ValueError(f"--dense-quant {dense_quant!r} is not supported; choose one of {', '.join(DENSE_QUANT)}")
    cfg = MoEConfig.from_hf(model_dir)
    raw_cfg = read_json(os.path.join(model_dir, "config.json"))
    qc = raw_cfg.get("quantization_config")
    if isinstance(qc, dict) and raw_cfg.get("expert_dtype") and "expert_dtype" not in qc:
        qc = {**qc, "expert_dtype": raw_cfg["expert_dtype"]}     # DeepSeek-V4 ships it at the top level
    sq = ShippedQuant(qc, os.path.join(model_dir, "config.json"))
    if quantize is not None and quantize not in quantize_choices():
        raise ValueError(f"--quantize {quantize!r} is not supported; choose one of {', '.join(quantize_choices())}")
    if quantize is not None and sq.method is not None:
        raise ValueError(f"{model_dir}: the checkpoint is already quantized ({sq.method}); its experts are stored as shipped - "
                         f"drop --quantize (re-quantizing quantized weights would only add error)")
    ck = Checkpoint(model_dir, cfg.lm_prefix, cfg.lm_head_name, stored_names(cfg))
    logical = _expert_reader(ck, cfg, sq)
    probe = logical(cfg.moe_layers[0], 0)
    fmt, shipped, source = _expert_format(probe, sq, quantize, model_dir)
    bias_dtype = probe["down_bias"].dtype if "down_bias" in probe else None
    try:
        weights = expert_weight_specs(cfg.expert_in, cfg.expert_intermediate, fmt, bias_dtype, cfg.gated_experts)
    except ValueError as e:
        raise ValueError(f"{model_dir}: {e}") from None
    writer = StoreWriter(out_dir, model=os.path.basename(os.path.abspath(model_dir)), num_layers=cfg.num_moe_layers,
                         num_experts=cfg.num_experts, weights=weights, layer_numbers=cfg.moe_layers,
                         extra={"model_type": cfg.model_type, "expert_source": source,
                                **({"dense_quant": dense_quant} if dense_quant else {})})
    errors = _write_experts(writer, cfg, logical, fmt, shipped, weights, quantize, model_dir, progress)
    man = writer.close()
    _write_dense(ck, cfg, sq, model_dir, out_dir)
    n_mtp = _mtp_shipped(mtp_checkpoint(ck, cfg), cfg, mtp_layers_of(cfg, language_model(raw_cfg)))
    if n_mtp:
        errors += _write_mtp(mtp_checkpoint(ck, cfg), cfg, n_mtp, sq, fmt, shipped, weights, source, quantize,
                             model_dir, out_dir)
    return ConvertReport(fmt.name, source, man.blob_bytes, float(sum(errors) / len(errors)) if errors else None,
                         max(errors) if errors else None, unread=ck.unread(), mtp_layers=n_mtp)


def _mtp_shipped(ck: Checkpoint, cfg: MoEConfig, n: int) -> int:
    """Of the ``n`` MTP layers config.json announces, how many the checkpoint ships whole, in order: a re-upload may
    drop them, a config class may default num_nextn_predict_layers to 1 without any; an incomplete layer (and those
    after it) is not read - its tensors are reported unread - and decoding does not need it."""
    if not n:
        return 0
    mcfg = mtp_config(cfg, n)
    for j, i in enumerate(range(cfg.num_layers, cfg.num_layers + n)):     # a dense MTP layer has no experts
        names = [k for k in mtp_dense_tensors(cfg, j + 1) if k.startswith(f"model.layers.{i}.")]
        if not all(ck.has(k) for k in names) or i in mcfg.moe_layers and not (ck.has(fused_expert_name(
                mcfg, i, "gate_up_proj")) or all(ck.has(k) for k in expert_names(mcfg, i, 0).values())):
            return j
    return n


def _write_mtp(ck: Checkpoint, cfg: MoEConfig, n: int, sq: "ShippedQuant", fmt, shipped: bool, weights: list,
               source: str, quantize, model_dir: str, out_dir: str) -> list:
    """The checkpoint's ``n`` multi-token-prediction layers (``ck`` reads them by our names: mtp.mtp_checkpoint) into
    the store's mtp/ part (runtime/model/mtp.py): their experts (dense MTP layers have none) a store of their own in
    the main store's format (``fmt``, ``shipped``, ``weights``, ``source``), their dense tensors dequantized like the
    model's, the per-layer embedding / head copies that differ from the model's. Returns the experts' sampled errors."""
    mcfg, sub = mtp_config(cfg, n), mtp_store_dir(out_dir)
    os.makedirs(sub, exist_ok=True)
    errors = []
    if cfg.num_layers in mcfg.moe_layers:       # MoE MTP layers (ERNIE 4.5's and MiMo-V2-Flash's are dense)
        writer = StoreWriter(sub, model=os.path.basename(os.path.abspath(model_dir)) + " (MTP)", num_layers=n,
                             num_experts=cfg.num_experts, weights=weights, layer_numbers=mcfg.moe_layers,
                             extra={"model_type": cfg.model_type, "expert_source": source, "mtp_of": cfg.num_layers})
        errors = _write_experts(writer, mcfg, _expert_reader(ck, mcfg, sq), fmt, shipped, weights, quantize,
                                model_dir, False)
        writer.close()
    embed = ck.get("model.embed_tokens.weight", (cfg.vocab_size, cfg.hidden_size))
    dense = {k: read_dense(ck, k, s, sq, embed.dtype) for k, s in mtp_dense_tensors(cfg, n).items()}
    head = embed if cfg.tie_word_embeddings else read_dense(ck, "lm_head.weight", embed.shape, sq, embed.dtype)
    for k, s in mtp_copies(cfg, n).items():
        if ck.has(k):
            t = read_dense(ck, k, s, sq, embed.dtype)
            if not torch.equal(t, embed if k.endswith("embed_tokens.weight") else head):
                dense[k] = t
    _save_readable(dense, os.path.join(sub, MTP_DENSE))
    return errors


def _save_readable(tensors: dict, path: str) -> None:
    from safetensors.torch import save_file
    save_file(tensors, path)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)   # safetensors writes 0600: a store must be readable like its other files
                                     # (a container's unprivileged user reads a store converted by root)


def load_dense(store_dir: str, cfg: MoEConfig) -> dict:
    from safetensors.torch import load_file
    path = os.path.join(store_dir, "dense.safetensors")
    if not os.path.exists(path):
        raise ValueError(f"{store_dir}: no dense.safetensors; convert the model with 'tiered-moe convert'")
    if not os.access(path, os.R_OK):
        raise ValueError(f"{path}: permission denied (this process runs as uid {os.getuid()}); make the store readable")
    try:
        d = load_file(path)
    except Exception as e:  # noqa: BLE001
        raise ValueError(f"{path}: not a readable safetensors file ({e})") from None
    for n, s in dense_names(cfg).items():
        if n not in d:
            raise ValueError(f"{path}: tensor {n!r} is missing")
        if tuple(d[n].shape) != tuple(s):
            raise ValueError(f"{path}: tensor {n!r} has shape {tuple(d[n].shape)}, expected {tuple(s)}")
    return d
