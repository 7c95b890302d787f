"""Hugging Face checkpoint -> tiered store (expert blobs + manifest) + dense weights.

Reads ``config.json`` and ``*.safetensors`` (sharded with ``model.safetensors.index.json`` or a
single file), tensor by tensor: an expert's three matrices are read, written as one blob, and
dropped, so a model larger than RAM converts. Dense weights go to ``dense.safetensors``.
"""
from __future__ import annotations

import json
import os
import shutil

import torch

from ..store.layout import StoreWriter
from .config import MoEConfig

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


def expert_names(cfg: MoEConfig, layer: int, e: int) -> dict:
    if cfg.model_type == "mixtral":
        p = f"model.layers.{layer}.block_sparse_moe.experts.{e}."
        return {"gate": p + "w1.weight", "up": p + "w3.weight", "down": p + "w2.weight"}
    p = f"model.layers.{layer}.mlp.experts.{e}."
    return {"gate": p + "gate_proj.weight", "up": p + "up_proj.weight", "down": p + "down_proj.weight"}


def dense_names(cfg: MoEConfig) -> dict:
    """Every dense tensor the model needs -> expected shape."""
    H, hd = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd
    out = {"model.embed_tokens.weight": (cfg.vocab_size, H), "model.norm.weight": (H,)}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (cfg.vocab_size, H)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        out.update({p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,)})
        if cfg.attention == "mla":
            nh, qk = cfg.num_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
            if cfg.qkv_bias:
                raise ValueError(f"{cfg.source}: attention_bias with MLA is not supported yet")
            if cfg.q_lora_rank:
                out.update({p + "self_attn.q_a_proj.weight": (cfg.q_lora_rank, H),
                            p + "self_attn.q_a_layernorm.weight": (cfg.q_lora_rank,),
                            p + "self_attn.q_b_proj.weight": (nh * qk, cfg.q_lora_rank)})
            else:
                out[p + "self_attn.q_proj.weight"] = (nh * qk, H)
            out.update({p + "self_attn.kv_a_proj_with_mqa.weight": (cfg.kv_lora_rank + cfg.qk_rope_head_dim, H),
                        p + "self_attn.kv_a_layernorm.weight": (cfg.kv_lora_rank,),
                        p + "self_attn.kv_b_proj.weight": (nh * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank),
                        p + "self_attn.o_proj.weight": (H, nh * cfg.v_head_dim)})
        else:
            out.update({p + "self_attn.q_proj.weight": (q, H), p + "self_attn.k_proj.weight": (kv, H),
                        p + "self_attn.v_proj.weight": (kv, H), p + "self_attn.o_proj.weight": (H, q)})
        if cfg.qkv_bias:
            out.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,), p + "self_attn.v_proj.bias": (kv,)})
        if cfg.qk_norm == "head":
            out.update({p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,)})
        elif cfg.qk_norm == "full":
            out.update({p + "self_attn.q_norm.weight": (q,), p + "self_attn.k_norm.weight": (kv,)})
        if i in cfg.moe_layers:
            out[p + ("block_sparse_moe.gate.weight" if cfg.model_type == "mixtral" else "mlp.gate.weight")] = (cfg.num_experts, H)
            if cfg.latent_dim:
                out[p + "block_sparse_moe.latent_down.weight"] = (cfg.latent_dim, H)
                out[p + "block_sparse_moe.latent_up.weight"] = (H, cfg.latent_dim)
            if cfg.router == "sigmoid_group":
                out[p + "mlp.gate.e_score_correction_bias"] = (cfg.num_experts,)
            if cfg.shared_intermediate:
                S, sp = cfg.shared_intermediate, p + cfg.shared_prefix
                out.update({sp + "gate_proj.weight": (S, H), sp + "up_proj.weight": (S, H), sp + "down_proj.weight": (H, S)})
                if cfg.shared_expert_gate:
                    out[p + "mlp.shared_expert_gate.weight"] = (1, H)
        else:
            I = cfg.dense_intermediate
            out.update({p + "mlp.gate_proj.weight": (I, H), p + "mlp.up_proj.weight": (I, H), p + "mlp.down_proj.weight": (H, I)})
    return out


_ST_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool, "F8_E4M3": getattr(torch, "float8_e4m3fn", None), "F8_E5M2": getattr(torch, "float8_e5m2", None)}


class Checkpoint:
    """Tensors of a (possibly sharded) safetensors checkpoint, read one at a time with pread.

    Not memory-mapped: a converted tensor's pages do not stay in the process, so converting a
    model larger than RAM keeps the resident set to about one expert. The format is the
    safetensors one: 8-byte little-endian header length, a JSON header of dtype, shape and
    data offsets, then the data."""

    def __init__(self, model_dir: str) -> None:
        self.dir = model_dir
        self._headers: dict = {}
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

    def get(self, name: str, shape=None) -> torch.Tensor:
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


def expert_specs(H: int, I: int, dt) -> list:
    """The tensors of one expert blob. Stored input-major (transposed from Hugging Face's
    [out, in]): ``x @ w`` over an [in, out] matrix runs 20-30% faster on CPU than ``F.linear``
    over [out, in] at decode's few tokens per expert (bench/results/decode_speed.md), and gate
    and up side by side make one matmul."""
    return [("gate_up_t", (H, 2 * I), dt), ("down_t", (I, H), dt)]


def expert_blob(gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> dict:
    """Hugging Face expert weights (gate, up: [I, H]; down: [H, I]) as the blob's tensors."""
    return {"gate_up_t": torch.cat([gate, up], 0).t(), "down_t": down.t()}   # [H, 2I], [I, H]


def convert(model_dir: str, out_dir: str, progress: bool = False) -> str:
    from safetensors.torch import save_file
    cfg = MoEConfig.from_hf(model_dir)
    ck = Checkpoint(model_dir)
    H, I = cfg.expert_in, cfg.expert_intermediate
    probe = ck.get(expert_names(cfg, cfg.moe_layers[0], 0)["gate"], (I, H))
    dt = probe.dtype
    if dt not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"{model_dir}: expert weights are {dt} (a quantized checkpoint); only float32, bfloat16 and "
                         f"float16 checkpoints are supported yet - dequantize first")
    writer = StoreWriter(out_dir, model=os.path.basename(os.path.abspath(model_dir)), num_layers=cfg.num_moe_layers,
                         num_experts=cfg.num_experts, specs=expert_specs(H, I, dt),
                         layer_numbers=cfg.moe_layers, extra={"model_type": cfg.model_type})
    total = cfg.num_moe_layers * cfg.num_experts
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=total, desc="converting experts", unit="expert")
    shapes = {"gate": (I, H), "up": (I, H), "down": (H, I)}
    for m, layer in enumerate(cfg.moe_layers):
        for e in range(cfg.num_experts):
            names = expert_names(cfg, layer, e)
            w = {k: ck.get(n, shapes[k]) for k, n in names.items()}
            writer.write(m, e, expert_blob(w["gate"], w["up"], w["down"]))
            if bar:
                bar.update()
    if bar:
        bar.close()
    writer.close()
    dense = {n: ck.get(n, s).contiguous() for n, s in dense_names(cfg).items()}
    save_file(dense, os.path.join(out_dir, "dense.safetensors"))
    shutil.copy(os.path.join(model_dir, "config.json"), os.path.join(out_dir, "config.json"))
    for f in TOKENIZER_FILES:
        if os.path.exists(os.path.join(model_dir, f)):
            shutil.copy(os.path.join(model_dir, f), os.path.join(out_dir, f))
    return out_dir


def load_dense(store_dir: str, cfg: MoEConfig) -> dict:
    from safetensors.torch import load_file
    path = os.path.join(store_dir, "dense.safetensors")
    if not os.path.exists(path):
        raise ValueError(f"{store_dir}: no dense.safetensors; convert the model with 'tiered-moe convert'")
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
