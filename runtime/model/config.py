"""Model configuration: one dataclass for every supported MoE architecture, read from a Hugging
Face ``config.json`` and validated once."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from cache_policy.jsonfile import read_json

SUPPORTED = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "gpt_oss")
ROUTERS = ("softmax_topk", "topk_softmax", "sigmoid_group")


@dataclass
class MoEConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dense_intermediate: int            # dense MLP layers (and Mixtral's experts use expert_intermediate)
    expert_intermediate: int
    num_experts: int
    top_k: int
    moe_layers: list                   # model layer indices that are MoE
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict = field(default_factory=dict)   # {} or YaRN parameters (factor, original_max_position_embeddings, ...)
    qkv_bias: bool = False
    qk_norm: str = "none"              # none | head (Qwen3: per head) | full (OLMoE: over the projection)
    router: str = "softmax_topk"       # see ROUTERS
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    shared_intermediate: int = 0       # 0: no shared expert
    shared_expert_gate: bool = False   # Qwen2-MoE: sigmoid gate on the shared expert
    latent_dim: int = 0                # 0: experts run in the hidden space (else a LatentMoE projection)
    shared_prefix: str = "mlp.shared_expert."
    # Multi-head latent attention (DeepSeek-V2/V3, Kimi K2): attention = "mla"
    attention: str = "gqa"
    q_lora_rank: int = 0               # 0: a plain q_proj
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    sliding_window: int = 0            # > 0: layers in sliding_layers attend to the last sliding_window tokens only
    sliding_layers: list = field(default_factory=list)
    # gpt-oss: attention sinks (a learned per-head logit in every softmax), biases on q/k/v/o, a router
    # bias, expert biases and the clamped SwiGLU ((up + 1) * gate * sigmoid(alpha * gate), clamped at limit)
    attn_sinks: bool = False
    o_bias: bool = False
    router_bias: bool = False
    expert_bias: bool = False
    expert_act: str = "silu"           # silu (SwiGLU) | swiglu_clamp (gpt-oss)
    swiglu_limit: float = 7.0
    swiglu_alpha: float = 1.702
    eos_token_ids: list = field(default_factory=list)
    bos_token_id: "int | None" = None
    source: str = "<memory>"

    def __post_init__(self) -> None:
        src = self.source
        if self.model_type not in SUPPORTED:
            raise ValueError(f"{src}: model_type {self.model_type!r} is not supported; supported: {', '.join(SUPPORTED)}")
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                     "expert_intermediate", "num_experts", "top_k"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{src}: {name} must be a positive integer, got {v!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{src}: num_attention_heads {self.num_heads} is not a multiple of num_key_value_heads {self.num_kv_heads}")
        if self.top_k > self.num_experts:
            raise ValueError(f"{src}: num_experts_per_tok {self.top_k} exceeds the {self.num_experts} experts")
        if self.expert_act not in ("silu", "swiglu_clamp"):
            raise ValueError(f"{src}: unknown expert activation {self.expert_act!r}")
        if self.router not in ROUTERS:
            raise ValueError(f"{src}: unknown router {self.router!r}; choose one of {', '.join(ROUTERS)}")
        if self.n_group < 1 or self.num_experts % self.n_group or not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"{src}: n_group {self.n_group} / topk_group {self.topk_group} do not divide {self.num_experts} experts")
        if not self.moe_layers:
            raise ValueError(f"{src}: no MoE layer (check decoder_sparse_step / mlp_only_layers)")
        if any(not 0 <= l < self.num_layers for l in self.moe_layers):
            raise ValueError(f"{src}: MoE layer index out of range 0..{self.num_layers - 1}")

    @property
    def expert_in(self) -> int:
        """Width the experts read and write: the latent size with LatentMoE, else hidden."""
        return self.latent_dim or self.hidden_size

    @property
    def num_moe_layers(self) -> int:
        return len(self.moe_layers)

    @staticmethod
    def from_hf(model_dir: str) -> "MoEConfig":
        path = os.path.join(model_dir, "config.json")
        if not os.path.exists(path):
            raise ValueError(f"{model_dir}: no config.json (expected a Hugging Face model directory)")
        d = read_json(path)
        return MoEConfig.from_dict(d, source=path)

    @staticmethod
    def from_dict(d: dict, source: str = "<dict>") -> "MoEConfig":
        mt = d.get("model_type")
        if mt not in SUPPORTED:
            raise ValueError(f"{source}: model_type {mt!r} is not supported; supported: {', '.join(SUPPORTED)}")

        def need(*names):
            for n in names:
                if d.get(n) is not None:
                    return d[n]
            raise ValueError(f"{source}: missing config field {' / '.join(names)}")

        L = int(need("num_hidden_layers"))
        H = int(need("hidden_size"))
        heads = int(need("num_attention_heads"))
        kv = int(d.get("num_key_value_heads") or heads)
        head_dim = int(d.get("head_dim") or H // heads)
        rope = dict(d.get("rope_parameters") or {})
        if d.get("rope_scaling"):   # the older field name (DeepSeek-V3's and Kimi K2's released configs)
            rope = {**d["rope_scaling"], **rope}
        theta = float(rope.get("rope_theta", d.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type") or rope.get("type") or "default"
        if rope_type not in ("default", "yarn"):
            raise ValueError(f"{source}: rope_type {rope_type!r} is not supported yet (default and yarn are)")
        if float(rope.get("partial_rotary_factor", 1.0)) != 1.0:
            raise ValueError(f"{source}: partial_rotary_factor is not supported yet")
        scaling = {}
        if rope_type == "yarn":
            if "original_max_position_embeddings" not in rope:
                raise ValueError(f"{source}: yarn RoPE needs original_max_position_embeddings")
            scaling = {k: rope[k] for k in ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
                                            "mscale", "mscale_all_dim", "attention_factor", "truncate") if k in rope}
        E = int(need("num_local_experts", "num_experts", "n_routed_experts"))
        eos = d.get("eos_token_id")
        eos = [] if eos is None else ([int(eos)] if isinstance(eos, int) else [int(x) for x in eos])
        common = dict(model_type=mt, vocab_size=int(need("vocab_size")), hidden_size=H, num_layers=L, num_heads=heads,
                      num_kv_heads=kv, head_dim=head_dim, num_experts=E, top_k=int(need("num_experts_per_tok")),
                      rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)), rope_theta=theta, rope_scaling=scaling,
                      tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                      max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
                      eos_token_ids=eos, bos_token_id=d.get("bos_token_id"), source=source)
        # Sliding-window attention, by transformers' rules: Mixtral and Qwen3-MoE apply `sliding_window`
        # to every layer (Qwen3-MoE only with use_sliding_window); Qwen2-MoE, with use_sliding_window,
        # to the even-indexed layers below max_window_layers; `layer_types` (newer configs) says it
        # per layer.
        window = int(d.get("sliding_window") or 0)
        if window and mt in ("qwen2_moe", "qwen3_moe") and not d.get("use_sliding_window", False):
            window = 0
        if window and mt in ("olmoe", "deepseek_v3"):
            raise ValueError(f"{source}: sliding_window is not supported for {mt}")
        if window:
            if d.get("layer_types"):
                sliding = [i for i, t in enumerate(d["layer_types"]) if t == "sliding_attention"]
            elif mt == "qwen2_moe":
                sliding = [i for i in range(L) if i % 2 == 0 and i < int(d.get("max_window_layers", 28))]
            elif mt == "gpt_oss":   # transformers' default layer_types: sliding, full, sliding, ...
                sliding = list(range(0, L, 2))
            else:
                sliding = list(range(L))
            common.update(sliding_window=window, sliding_layers=sliding)
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{source}: hidden_act {d.get('hidden_act')!r} is not supported (only silu / SwiGLU)")
        if mt == "mixtral":
            inter = int(need("intermediate_size"))
            # tiered-moe extension: "moe_latent_size" puts a LatentMoE projection (Kimi K3) around
            # the experts; experts then run in the latent space.
            return MoEConfig(**common, dense_intermediate=inter, expert_intermediate=inter, moe_layers=list(range(L)),
                             router="softmax_topk", norm_topk_prob=True, latent_dim=int(d.get("moe_latent_size") or 0))
        if mt == "deepseek_v3":
            first = int(d.get("first_k_dense_replace", 0))
            freq = int(d.get("moe_layer_freq", 1) or 1)
            rope_dim = int(need("qk_rope_head_dim"))
            common["head_dim"] = rope_dim
            return MoEConfig(**common, dense_intermediate=int(need("intermediate_size")),
                             expert_intermediate=int(need("moe_intermediate_size")),
                             moe_layers=[i for i in range(L) if i >= first and i % freq == 0],
                             router="sigmoid_group", n_group=int(d.get("n_group") or 1), topk_group=int(d.get("topk_group") or 1),
                             norm_topk_prob=bool(d.get("norm_topk_prob", True)),
                             routed_scaling_factor=float(d.get("routed_scaling_factor", 1.0)),
                             shared_intermediate=int(need("moe_intermediate_size")) * int(d.get("n_shared_experts") or 0),
                             shared_prefix="mlp.shared_experts.", attention="mla", qkv_bias=bool(d.get("attention_bias", False)),
                             q_lora_rank=int(d.get("q_lora_rank") or 0), kv_lora_rank=int(need("kv_lora_rank")),
                             qk_rope_head_dim=rope_dim, qk_nope_head_dim=int(need("qk_nope_head_dim")),
                             v_head_dim=int(need("v_head_dim")), rope_interleave=bool(d.get("rope_interleave", True)))
        if mt == "gpt_oss":
            # Every layer is MoE; layer_types alternates sliding and full attention (handled above).
            inter = int(need("intermediate_size"))
            return MoEConfig(**common, dense_intermediate=inter, expert_intermediate=inter, moe_layers=list(range(L)),
                             router="topk_softmax", router_bias=True, qkv_bias=bool(d.get("attention_bias", True)),
                             o_bias=bool(d.get("attention_bias", True)), attn_sinks=True, expert_bias=True,
                             expert_act="swiglu_clamp", swiglu_limit=float(d.get("swiglu_limit", 7.0)),
                             swiglu_alpha=float(d.get("swiglu_alpha", 1.702)))
        if mt == "olmoe":
            if d.get("clip_qkv") is not None:
                raise ValueError(f"{source}: clip_qkv is not supported yet")
            inter = int(need("intermediate_size"))
            return MoEConfig(**common, dense_intermediate=inter, expert_intermediate=inter, moe_layers=list(range(L)),
                             qk_norm="full", qkv_bias=bool(d.get("attention_bias", False)),
                             norm_topk_prob=bool(d.get("norm_topk_prob", False)))
        # qwen2_moe / qwen3_moe
        step = int(d.get("decoder_sparse_step", 1))
        only = set(d.get("mlp_only_layers") or [])
        moe = [i for i in range(L) if i not in only and E > 0 and (i + 1) % step == 0]
        kw = dict(dense_intermediate=int(need("intermediate_size")), expert_intermediate=int(need("moe_intermediate_size")),
                  moe_layers=moe, norm_topk_prob=bool(d.get("norm_topk_prob", False)))
        if mt == "qwen2_moe":
            return MoEConfig(**common, **kw, qkv_bias=bool(d.get("qkv_bias", True)),
                             shared_intermediate=int(d.get("shared_expert_intermediate_size") or 0),
                             shared_expert_gate=bool(d.get("shared_expert_intermediate_size")))
        return MoEConfig(**common, **kw, qkv_bias=bool(d.get("attention_bias", False)), qk_norm="head")
