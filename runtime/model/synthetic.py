"""A deterministic synthetic MoE checkpoint in Hugging Face layout (Mixtral format), whose router
has real locality - the embedded default the demo runs on.

How the locality is built (the knobs):
- ``skew``: every token embedding carries a shared direction u; router row e has the component
  ``skew * z_e`` along u with z_e evenly spread over [-1, 1] (a random order). After RMSNorm
  every token sees the same per-expert offset, so popularity is skewed: larger skew, hotter
  hot experts.
- ``topics`` and ``topic_strength``: the vocabulary is split into topics; a token's embedding
  carries its topic's direction with weight ``topic_strength``, and each expert's router row
  points at one topic. The LM head is the embedding matrix, so the model tends to continue
  in the topic it is in: consecutive tokens share experts (persistence across tokens).
- ``head_scale``: the LM head is the embedding matrix times this; smaller is softer, so sampled
  text wanders more within (and across) topics.
Attention and expert weights are random and small; the text is not language, the routing is
what matters. Same arguments, same bytes.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass

import torch

from ..tokenizer import bytes_to_unicode


@dataclass(frozen=True)
class SyntheticModelSpec:
    vocab_size: int = 512
    hidden_size: int = 256
    intermediate_size: int = 256
    num_layers: int = 8
    num_experts: int = 32
    top_k: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    skew: float = 2.5
    topics: int = 8
    topic_strength: float = 2.0
    head_scale: float = 0.15
    latent_size: int = 0   # > 0: a LatentMoE projection (Kimi K3) around the experts
    seed: int = 0

    def __post_init__(self) -> None:
        if self.vocab_size % self.topics or self.num_experts % self.topics:
            raise ValueError("synthetic model: topics must divide vocab_size and num_experts")
        if self.top_k > self.num_experts:
            raise ValueError("synthetic model: top_k exceeds num_experts")


def build_checkpoint(out_dir: str, spec: SyntheticModelSpec = SyntheticModelSpec(), *, dtype=torch.float32,
                     shard_by_layer: bool = False) -> str:
    """Write the synthetic checkpoint (HF layout, Mixtral names) in ``dtype``. ``shard_by_layer``: one
    safetensors file per layer plus the index, each written as soon as its layer is made, so a checkpoint
    larger than memory is never held whole (the same weights either way: one generator, one order)."""
    from safetensors.torch import save_file
    os.makedirs(out_dir, exist_ok=True)
    index: dict = {}

    def flush(w: dict, name: str) -> None:
        save_file({k: v.contiguous().to(dtype) for k, v in w.items()}, os.path.join(out_dir, name))
        index.update({k: name for k in w})
        w.clear()
    g = torch.Generator().manual_seed(spec.seed)
    V, H, I, L, E = spec.vocab_size, spec.hidden_size, spec.intermediate_size, spec.num_layers, spec.num_experts
    hd = H // spec.num_heads

    def rnd(*shape, scale):
        return torch.randn(*shape, generator=g) * scale

    emb, router = _locality(g, spec, V, H, E)
    # A soft LM head (the embeddings, scaled down): sampling stays mostly within the current topic.
    w = {"model.embed_tokens.weight": emb, "lm_head.weight": emb * spec.head_scale, "model.norm.weight": torch.ones(H)}
    for l in range(L):
        p = f"model.layers.{l}."
        w[p + "input_layernorm.weight"] = torch.ones(H)
        w[p + "post_attention_layernorm.weight"] = torch.ones(H)
        w[p + "self_attn.q_proj.weight"] = rnd(H, H, scale=0.02)
        w[p + "self_attn.k_proj.weight"] = rnd(spec.num_kv_heads * hd, H, scale=0.02)
        w[p + "self_attn.v_proj.weight"] = rnd(spec.num_kv_heads * hd, H, scale=0.02)
        w[p + "self_attn.o_proj.weight"] = rnd(H, H, scale=0.02)
        w[p + "block_sparse_moe.gate.weight"] = router()
        X = spec.latent_size or H
        if spec.latent_size:
            w[p + "block_sparse_moe.latent_down.weight"] = rnd(X, H, scale=H ** -0.5)
            w[p + "block_sparse_moe.latent_up.weight"] = rnd(H, X, scale=X ** -0.5)
        for e in range(E):
            q = f"{p}block_sparse_moe.experts.{e}."
            w[q + "w1.weight"] = rnd(I, X, scale=0.02)
            w[q + "w3.weight"] = rnd(I, X, scale=0.02)
            w[q + "w2.weight"] = rnd(X, I, scale=0.02)
        if shard_by_layer:
            flush(w, f"model-{l + 1:05d}-of-{L:05d}.safetensors")
    if shard_by_layer:                                  # (embeddings, head and final norm went with layer 0's file)
        with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": index}, f)
    else:
        flush(w, "model.safetensors")
    config = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": V, "hidden_size": H,
              "intermediate_size": I, "num_hidden_layers": L, "num_attention_heads": spec.num_heads,
              "num_key_value_heads": spec.num_kv_heads, "num_local_experts": E, "num_experts_per_tok": spec.top_k,
              "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 4096, "hidden_act": "silu",
              "tie_word_embeddings": False, "torch_dtype": str(dtype).replace("torch.", ""), "bos_token_id": None, "eos_token_id": None,
              "tiered_moe_synthetic": asdict(spec)}
    if spec.latent_size:
        config["moe_latent_size"] = spec.latent_size
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    if V >= 256:
        write_byte_tokenizer(out_dir, V)
    return out_dir


def _locality(g: torch.Generator, spec, V: int, H: int, E: int):
    """The embeddings and a maker of router rows with the locality knobs of the module docstring
    (skew along a shared direction u, topics): returns (emb [V, H], router() -> [E, H])."""
    u = torch.nn.functional.normalize(torch.randn(H, generator=g), dim=0)
    topic_dirs = torch.nn.functional.normalize(torch.randn(spec.topics, H, generator=g), dim=1)
    topic_of_token = torch.arange(V) % spec.topics
    emb = u[None, :] * 1.0 + spec.topic_strength * topic_dirs[topic_of_token] * 0.5 + torch.randn(V, H, generator=g) * 0.3
    emb = emb / emb.norm(dim=1, keepdim=True) * (H ** 0.5) * 0.1
    topic_of_expert = torch.arange(E) % spec.topics

    def router() -> torch.Tensor:
        z = torch.linspace(-1, 1, E)[torch.randperm(E, generator=g)]
        return (spec.skew * z[:, None] * u[None, :] + spec.topic_strength * topic_dirs[topic_of_expert]
                + torch.randn(E, H, generator=g) * 0.3)
    return emb, router


@dataclass(frozen=True)
class K3ShapeSpec:
    """A scaled-down checkpoint in Kimi K3's shape (``tiered-moe demo --shape k3``): Kimi Delta
    Attention and MLA layers 3:1 (the Kimi-Linear format), LatentMoE experts (``moe_latent_size``)
    with many experts, top-16 sigmoid routing with a correction bias, two shared experts, and Block
    Attention Residuals (``attn_res_block_layers``; runtime/model/attn_res.py). Router locality as
    SyntheticModelSpec's. K3 itself: 93 layers (69 KDA + 24 MLA), 7168 hidden, 3584 latent, 896
    experts + 2 shared, top-16."""
    vocab_size: int = 512
    hidden_size: int = 256
    latent_size: int = 128
    expert_intermediate: int = 128
    num_layers: int = 8             # KDA, KDA, KDA, MLA, ...
    num_experts: int = 128
    top_k: int = 16
    shared_experts: int = 2
    kda_heads: int = 4
    kda_head_dim: int = 64
    mla_heads: int = 4
    kv_lora_rank: int = 64
    qk_nope_head_dim: int = 32
    qk_rope_head_dim: int = 16
    v_head_dim: int = 32
    attn_res_block_layers: int = 2
    skew: float = 2.5
    topics: int = 8
    topic_strength: float = 2.0
    head_scale: float = 0.15
    seed: int = 0

    def __post_init__(self) -> None:
        if self.vocab_size % self.topics or self.num_experts % self.topics:
            raise ValueError("K3-shaped model: topics must divide vocab_size and num_experts")
        if self.top_k > self.num_experts or self.num_layers < 4:
            raise ValueError("K3-shaped model: top_k exceeds num_experts, or fewer than 4 layers (one KDA:MLA group)")

    @property
    def layer_types(self) -> list:
        return ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(self.num_layers)]


def build_k3_checkpoint(out_dir: str, spec: K3ShapeSpec = K3ShapeSpec()) -> str:
    """Write a K3-shaped checkpoint (float32 safetensors, Kimi-Linear names) and its config.json."""
    from safetensors.torch import save_file
    os.makedirs(out_dir, exist_ok=True)
    g = torch.Generator().manual_seed(spec.seed)
    V, H, X, I, L, E = (spec.vocab_size, spec.hidden_size, spec.latent_size, spec.expert_intermediate, spec.num_layers,
                        spec.num_experts)

    def rnd(*shape, scale):
        return torch.randn(*shape, generator=g) * scale

    emb, router = _locality(g, spec, V, H, E)
    w = {"model.embed_tokens.weight": emb, "lm_head.weight": emb * spec.head_scale, "model.norm.weight": torch.ones(H),
         "model.attn_res.final_query": rnd(H, scale=0.5)}
    Hk, K = spec.kda_heads, spec.kda_head_dim
    nh, qk, S = spec.mla_heads, spec.qk_nope_head_dim + spec.qk_rope_head_dim, spec.shared_experts * I
    for l, kind in enumerate(spec.layer_types):
        p = f"model.layers.{l}."
        w.update({p + "input_layernorm.weight": torch.ones(H), p + "post_attention_layernorm.weight": torch.ones(H),
                  p + "attn_res.attn_query": rnd(H, scale=0.5), p + "attn_res.mlp_query": rnd(H, scale=0.5)})
        a = p + "self_attn."
        if kind == "linear_attention":
            for n in "qkv":
                w[a + f"{n}_proj.weight"] = rnd(Hk * K, H, scale=H ** -0.5)
                w[a + f"{n}_conv1d.weight"] = rnd(Hk * K, 1, 4, scale=0.5)
            w.update({a + "f_a_proj.weight": rnd(K, H, scale=H ** -0.5), a + "f_b_proj.weight": rnd(Hk * K, K, scale=K ** -0.5),
                      a + "dt_bias": rnd(Hk * K, scale=0.5), a + "A_log": torch.rand(1, 1, Hk, 1, generator=g).mul(2).log1p(),
                      a + "b_proj.weight": rnd(Hk, H, scale=H ** -0.5), a + "g_a_proj.weight": rnd(K, H, scale=H ** -0.5),
                      a + "g_b_proj.weight": rnd(Hk * K, K, scale=K ** -0.5), a + "o_norm.weight": torch.ones(K),
                      a + "o_proj.weight": rnd(H, Hk * K, scale=0.02)})
        else:
            w.update({a + "q_proj.weight": rnd(nh * qk, H, scale=H ** -0.5),
                      a + "kv_a_proj_with_mqa.weight": rnd(spec.kv_lora_rank + spec.qk_rope_head_dim, H, scale=H ** -0.5),
                      a + "kv_a_layernorm.weight": torch.ones(spec.kv_lora_rank),
                      a + "kv_b_proj.weight": rnd(nh * (spec.qk_nope_head_dim + spec.v_head_dim), spec.kv_lora_rank,
                                                  scale=spec.kv_lora_rank ** -0.5),
                      a + "o_proj.weight": rnd(H, nh * spec.v_head_dim, scale=0.02)})
        m = p + "block_sparse_moe."
        w.update({m + "gate.weight": router(), m + "gate.e_score_correction_bias": torch.zeros(E),
                  m + "latent_down.weight": rnd(X, H, scale=H ** -0.5), m + "latent_up.weight": rnd(H, X, scale=X ** -0.5),
                  m + "shared_experts.gate_proj.weight": rnd(S, H, scale=0.02),
                  m + "shared_experts.up_proj.weight": rnd(S, H, scale=0.02),
                  m + "shared_experts.down_proj.weight": rnd(H, S, scale=0.02)})
        for e in range(E):
            q = f"{m}experts.{e}."
            w.update({q + "w1.weight": rnd(I, X, scale=0.02), q + "w3.weight": rnd(I, X, scale=0.02),
                      q + "w2.weight": rnd(X, I, scale=0.02)})
    save_file({k: v.contiguous().float() for k, v in w.items()}, os.path.join(out_dir, "model.safetensors"))
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(k3_config(spec), f, indent=1)
    if V >= 256:
        write_byte_tokenizer(out_dir, V)
    return out_dir


def k3_config(spec: K3ShapeSpec) -> dict:
    """The config.json of a K3-shaped checkpoint (also alone: ``tiered-moe plan`` sizes a model from it)."""
    V, H, X, I, L, E = (spec.vocab_size, spec.hidden_size, spec.latent_size, spec.expert_intermediate, spec.num_layers,
                        spec.num_experts)
    Hk, K, nh = spec.kda_heads, spec.kda_head_dim, spec.mla_heads
    return {"architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear", "vocab_size": V, "hidden_size": H,
              "intermediate_size": I, "moe_intermediate_size": I, "num_hidden_layers": L,
              "num_attention_heads": nh, "num_key_value_heads": nh, "num_experts": E, "num_experts_per_token": spec.top_k,
              "num_shared_experts": spec.shared_experts, "moe_renormalize": True, "routed_scaling_factor": 2.5,
              "num_expert_group": 1, "topk_group": 1, "kv_lora_rank": spec.kv_lora_rank, "q_lora_rank": None,
              "qk_nope_head_dim": spec.qk_nope_head_dim, "qk_rope_head_dim": spec.qk_rope_head_dim,
              "v_head_dim": spec.v_head_dim, "layer_types": spec.layer_types, "mlp_layer_types": ["sparse"] * L,
              "linear_attn_config": {"num_heads": Hk, "head_dim": K, "short_conv_kernel_size": 4},
              "rms_norm_eps": 1e-5, "model_max_length": 4096, "hidden_act": "silu", "tie_word_embeddings": False,
              "torch_dtype": "float32", "bos_token_id": None, "eos_token_id": None,
              # tiered-moe extensions (no public K3 checkpoint exists to mirror):
              "moe_latent_size": X, "attn_res_block_layers": spec.attn_res_block_layers,
              "tiered_moe_synthetic": {"shape": "k3", **asdict(spec)}}


# Kimi K3 at full size, for plans and projections (no public K3 config exists): the figures - 93
# layers with KDA:MLA 3:1, hidden 7168, LatentMoE in a 3584 latent, 896 experts + 2 shared, top-16, the
# expert intermediate of h200-anchors.json's K3-like expert (3072) - and Kimi K2's attention sizes (64 MLA
# heads, kv_lora_rank 512, rotary 64, nope / v 128; 163840 vocabulary), KDA heads of 128 over the hidden size.
K3_FULL = K3ShapeSpec(vocab_size=163840, hidden_size=7168, latent_size=3584, expert_intermediate=3072, num_layers=93,
                      num_experts=896, top_k=16, shared_experts=2, kda_heads=56, kda_head_dim=128, mla_heads=64,
                      kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                      attn_res_block_layers=3)


# A chat template in the Jinja dialect Hugging Face checkpoints use (tokenizer_config.json).
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def write_byte_tokenizer(out_dir: str, vocab_size: int) -> None:
    """A byte-level tokenizer (ids 0-255: the bytes, GPT-2's byte-to-unicode alphabet; the rest of
    the vocabulary: plain tokens ``<|xNNN|>``) in tokenizer.json, and a tokenizer_config.json with
    a chat template - so the synthetic model can be served with text and chat like a real one."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    char_of = bytes_to_unicode()
    vocab = {char_of[b]: b for b in range(256)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_tokens([AddedToken(f"<|x{i}|>", special=False, normalized=False) for i in range(256, vocab_size)])
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"chat_template": CHAT_TEMPLATE, "tokenizer_class": "PreTrainedTokenizerFast"}, f, indent=1)
