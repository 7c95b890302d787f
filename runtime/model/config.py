"""Model configuration: one dataclass for every supported MoE architecture, read from a Hugging
Face ``config.json`` and validated once."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from cache_policy.jsonfile import read_json

from .arch import ARCHITECTURES, language_model, module
from .config_views import DSAFields, HyperFields, LinearFields, MLAFields, V4Fields
from .layers.router import ROUTERS

SUPPORTED = tuple(ARCHITECTURES)
# q/k RMSNorm: none | head (Qwen3: per head, before RoPE) | full (OLMoE: over the projection) | head_post_rope
# (Hunyuan: per head, after RoPE) | weightless_rope (Llama 4: per head without a weight, on the RoPE layers only)
QK_NORMS = ("none", "head", "full", "head_post_rope", "weightless_rope")


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
                                                      # or Llama 3.1's (rope_type llama3 and its four fields)
    qkv_bias: bool = False
    qk_norm: str = "none"              # see QK_NORMS
    router: str = "softmax_topk"       # see ROUTERS
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    shared_intermediate: int = 0       # 0: no shared expert
    shared_expert_gate: bool = False   # Qwen2-MoE: sigmoid gate on the shared expert
    router_scales_input: bool = False  # Llama 4: the router weight scales each expert's input, not its output
    latent_dim: int = 0                # 0: experts run in the hidden space (else a LatentMoE projection)
    shared_prefix: str = "mlp.shared_expert."
    mlp_prefix: str = "mlp."           # a layer's dense MLP / router / experts live under model.layers.N.<mlp_prefix>
    router_tensor: str = "gate.weight"  # the router under mlp_prefix
    correction_bias_tensor: str = "gate.e_score_correction_bias"   # sigmoid routers' selection bias under mlp_prefix
    lm_prefix: str = "model."          # where the checkpoint stores model.* (multimodal: model.language_model.)
    lm_head_name: str = "lm_head.weight"   # where the checkpoint stores lm_head (Kimi K2.5: language_model.lm_head.weight)
    expert_tensors: tuple = ("gate_proj", "up_proj", "down_proj")   # expert N's gate / up / down under <mlp_prefix>experts.N.
    # Hybrid attention (Kimi-Linear): layers whose token mixer is Kimi Delta Attention (a fixed recurrent
    # state per sequence) instead of full attention (a cache that grows per token).
    linear_layers: list = field(default_factory=list)
    linear_kind: str = "kda"           # see LINEAR_KINDS
    linear_prefix: str = "self_attn."  # a linear-attention layer's tensors live under model.layers.N.<linear_prefix>
    linear_num_heads: int = 0          # KDA: heads; Gated DeltaNet: key heads
    linear_head_dim: int = 0           # KDA: head dim (keys = values); Gated DeltaNet: key head dim
    linear_num_v_heads: int = 0        # Gated DeltaNet only
    linear_value_head_dim: int = 0     # Gated DeltaNet only
    linear_conv_kernel: int = 4
    # Mamba-2 only: groups of B and C, the SSM state size N, and biases on the convolution / projections
    linear_num_groups: int = 1
    linear_state_dim: int = 0
    linear_conv_bias: bool = False
    linear_proj_bias: bool = False
    mla_rope: bool = True              # False: MLA without RoPE (Kimi-Linear: positions come from the KDA layers)
    # Qwen3-Next / Qwen3.5: RoPE on the first rotary_dim of each head only (0: all of it), a sigmoid
    # output gate per attention channel (q_proj gives [q | gate] per head), and RMSNorms that scale by
    # (norm_offset + weight).
    rotary_dim: int = 0
    attn_output_gate: bool = False
    norm_offset: float = 0.0
    # pre: x += attn(norm(x)), x += ffn(norm(x)) (most families); post (OLMo-2, FlexOlmo): x += norm(attn(x)),
    # x += norm(ffn(x)) - the norms after the sublayers (post_attention_layernorm, post_feedforward_layernorm);
    # sandwich (Kolibri): both, x += norm'(attn(norm(x))), x += norm'(ffn(norm(x))); normed (MiniMax): the stream
    # carries the normed input, x = a * norm(x) + b * attn(norm(x)), then the same around the FFN, with (a, b) of
    # the layer's kind from residual_scales
    norm_placement: str = "pre"
    # normed: (alpha, beta) around full attention, linear attention and the FFN
    residual_scales: dict = field(default_factory=lambda: {"attention": (1.0, 1.0), "linear": (1.0, 1.0),
                                                           "ffn": (1.0, 1.0)})
    # Granite's scalars (folded into the weights at load, moe.fold_scales): the embeddings x embedding_multiplier,
    # each sublayer's output x residual_multiplier before the residual add, the attention scale
    # attention_multiplier (0: head_dim ** -0.5), the logits / logits_scaling
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float = 0.0
    logits_scaling: float = 1.0
    attn_res_block_layers: int = 0     # > 0: Block Attention Residuals over blocks of this many layers (attn_res.py)
    # Multi-head latent attention (DeepSeek-V2/V3, Kimi K2): attention = "mla"
    attention: str = "gqa"
    q_lora_rank: int = 0               # 0: a plain q_proj
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False
    # Llama 4's position-dependent query scale (Mistral 4's MLA): q x (1 + q_scale_beta ln(1 + floor(pos / q_scale_len)))
    q_scale_beta: float = 0.0
    q_scale_len: int = 0
    q_scale_offset: int = 0            # Llama 4's own counts from 1: floor((pos + q_scale_offset) / q_scale_len)
    q_scale_layers: list = field(default_factory=list)   # GQA: the layers it scales (Llama 4's NoPE ones); MLA: all
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    sliding_window: int = 0            # > 0: layers in sliding_layers attend to the last sliding_window tokens only
    sliding_layers: list = field(default_factory=list)
    nope_layers: list = field(default_factory=list)   # attention layers without RoPE (EXAONE's global layers)
    sliding_rope_theta: float = 0.0    # > 0: the sliding-window layers' own RoPE base (Mellum; default RoPE), 0: rope_theta
    # Llama 4's chunked local attention: the window layers attend within their position's chunk of sliding_window
    # positions (chunk p // sliding_window), not to the last sliding_window
    chunked_windows: bool = False
    # gpt-oss: attention sinks (a learned per-head logit in every softmax), biases on q/k/v/o, a router
    # bias, expert biases and the clamped SwiGLU ((up + 1) * gate * sigmoid(alpha * gate), clamped at limit)
    attn_sinks: bool = False
    o_bias: bool = False
    # MiMo-V2-Flash's GQA: values of a head dim of their own (0: head_dim), the sliding layers' own KV head count (0:
    # num_kv_heads), sinks on the sliding layers only, and values scaled (folded into v_proj at load: fold_scales)
    attn_v_head_dim: int = 0
    window_kv_heads: int = 0
    window_sinks_only: bool = False
    attn_v_scale: float = 1.0
    router_bias: bool = False
    expert_bias: bool = False
    expert_act: str = "silu"           # silu (SwiGLU) | swiglu_clamp (gpt-oss) | silu_clamp (DeepSeek-V4: gate <= limit, |up| <= limit)
                                       # | relu2 (Nemotron-H: relu(up x)^2, no gate: experts of up and down only)
    mlp_act: str = "silu"              # the dense MLPs' and shared experts': silu (SwiGLU) | relu2 (ungated, as expert_act)
    # Layers with one sublayer (Nemotron-H, whose blocks are a mixer or an FFN alone; arch/nemotron_h.py): the
    # attention / the FFN of these layers is empty - it adds nothing and has no norm (layers/absent.py)
    empty_attn_layers: list = field(default_factory=list)
    empty_ffn_layers: list = field(default_factory=list)
    swiglu_limit: float = 7.0
    swiglu_alpha: float = 1.702
    # DeepSeek-V4 (attention = "v4"): each layer's kind - sliding (a window only), csa (the window + an
    # entry per compress_rates["csa"] tokens, of which an indexer picks index_topk per query) or hca (the
    # window + an entry per compress_rates["hca"] tokens) -, a shared K=V head of head_dim with RoPE on its
    # last qk_rope_head_dim channels (θ = rope_theta for sliding layers, compress_rope_theta + its scaling
    # for the others), attention sinks, a grouped low-rank output projection (o_groups x o_lora_rank),
    # hyper-connections (hc_mult residual streams), and MoE layers routed by a token -> experts table
    # (hash_layers) or sqrt(softplus) scores.
    v4_kinds: list = field(default_factory=list)
    compress_rates: dict = field(default_factory=dict)
    o_groups: int = 0
    o_lora_rank: int = 0
    index_n_heads: int = 0
    index_head_dim: int = 0
    index_topk: int = 0
    compress_rope_theta: float = 0.0
    compress_rope_scaling: dict = field(default_factory=dict)
    hc_mult: int = 0                   # > 0: hyper-connections with this many residual streams (runtime/model/hyper.py)
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    hash_layers: list = field(default_factory=list)   # MoE layers whose experts come from a token-id table (tid2eid)
    # DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5: attention = "mla" with mla_indexer): a lightning indexer
    # (index_n_heads x index_head_dim, RoPE on its first qk_rope_head_dim channels - interleaved pairs or
    # rotate-half: index_rope_interleave) picks index_topk cached keys per query; the index_shared_layers
    # (GLM-5's "shared" indexer types) have no indexer and reuse the pick of the layer before
    mla_indexer: bool = False
    index_rope_interleave: bool = False
    index_shared_layers: list = field(default_factory=list)
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
        if self.norm_placement not in ("pre", "post", "sandwich", "normed"):
            raise ValueError(f"{src}: norm_placement {self.norm_placement!r} is not pre, post, sandwich or normed")
        if self.norm_placement != "pre" and (self.hc_mult or self.attn_res_block_layers):
            raise ValueError(f"{src}: norms after the sublayers with hyper-connections or attention residuals")
        if self.qk_norm not in QK_NORMS:
            raise ValueError(f"{src}: qk_norm {self.qk_norm!r} is not one of {', '.join(QK_NORMS)}")
        if self.window_kv_heads and self.num_heads % self.window_kv_heads:
            raise ValueError(f"{src}: num_attention_heads {self.num_heads} is not a multiple of the sliding layers' "
                             f"{self.window_kv_heads} key-value heads")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{src}: num_attention_heads {self.num_heads} is not a multiple of num_key_value_heads {self.num_kv_heads}")
        if self.top_k > self.num_experts:
            raise ValueError(f"{src}: num_experts_per_tok {self.top_k} exceeds the {self.num_experts} experts")
        if self.expert_act not in ("silu", "swiglu_clamp", "silu_clamp", "relu2"):
            raise ValueError(f"{src}: unknown expert activation {self.expert_act!r}")
        if self.mlp_act not in ("silu", "relu2"):
            raise ValueError(f"{src}: unknown MLP activation {self.mlp_act!r}")
        if len(self.expert_tensors) != (3 if self.gated_experts else 2):
            raise ValueError(f"{src}: expert tensors {self.expert_tensors} do not fit {self.expert_act} experts")
        self._check_empty_sublayers()
        if self.router not in ROUTERS:
            raise ValueError(f"{src}: unknown router {self.router!r}; choose one of {', '.join(ROUTERS)}")
        if self.n_group < 1 or self.num_experts % self.n_group or not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"{src}: n_group {self.n_group} / topk_group {self.topk_group} do not divide {self.num_experts} experts")
        if not self.moe_layers:
            raise ValueError(f"{src}: no MoE layer (check decoder_sparse_step / mlp_only_layers)")
        if any(not 0 <= l < self.num_layers for l in self.moe_layers):
            raise ValueError(f"{src}: MoE layer index out of range 0..{self.num_layers - 1}")
        if not 0 <= self.attn_res_block_layers <= self.num_layers:
            raise ValueError(f"{src}: attn_res_block_layers {self.attn_res_block_layers} must be in 0..{self.num_layers}")
        if not 0 <= self.rotary_dim <= self.head_dim or self.rotary_dim % 2:
            raise ValueError(f"{src}: rotary dim {self.rotary_dim} must be even and at most head_dim {self.head_dim}")
        if self.attention not in ("gqa", "mla", "v4"):
            raise ValueError(f"{src}: unknown attention {self.attention!r}; choose one of gqa, mla, v4")
        # each family present checks its own fields (config_views.py)
        for view, has in ((MLAFields, self.attention == "mla"), (LinearFields, bool(self.linear_layers)),
                          (V4Fields, self.attention == "v4"), (HyperFields, self.hc_mult > 0 or self.attention == "v4"),
                          (DSAFields, self.sparse_mla)):
            if has:
                view.of(self)

    def _check_empty_sublayers(self) -> None:
        """Empty sublayers: in range, never both in one layer, never a MoE / linear-attention layer's, and only on the
        plain pre-norm stream (the other residual schemes and norm placements run both sublayers of every layer)."""
        src, ea, ef = self.source, set(self.empty_attn_layers), set(self.empty_ffn_layers)
        if not ea and not ef:
            return
        if any(not 0 <= i < self.num_layers for i in ea | ef) or ea & ef:
            raise ValueError(f"{src}: empty attention layers {sorted(ea)} / FFN layers {sorted(ef)} must be layers of "
                             f"0..{self.num_layers - 1}, no layer in both")
        if ef & set(self.moe_layers) or ea & set(self.linear_layers):
            raise ValueError(f"{src}: a MoE layer without an FFN or a linear-attention layer without attention")
        if self.norm_placement != "pre" or self.hc_mult or self.attn_res_block_layers:
            raise ValueError(f"{src}: layers with an empty sublayer need the plain pre-norm residual stream")

    @property
    def gated_experts(self) -> bool:
        """Whether an expert has a gate projection (every activation but Nemotron-H's relu2)."""
        return self.expert_act != "relu2"

    def layer_norms(self, i: int) -> tuple:
        """Layer ``i``'s norm weights (``layer_norm_names``) but an empty sublayer's, which has none."""
        gone = {self.layer_norm_names[0]} if i in self.empty_attn_layers else set()
        gone |= {self.layer_norm_names[1]} if i in self.empty_ffn_layers else set()
        return tuple(n for n in self.layer_norm_names if n not in gone)

    # -- per-family views (config_views.py): the fields one layer family reads, validated together -----
    def _view(self, cls, has: bool):
        if not has:
            raise ValueError(f"{self.source}: {self.model_type} has no {cls.FAMILY}")
        return cls.of(self)

    @property
    def mla(self) -> MLAFields:
        return self._view(MLAFields, self.attention == "mla")

    @property
    def linear(self) -> LinearFields:
        return self._view(LinearFields, bool(self.linear_layers))

    @property
    def v4(self) -> V4Fields:
        return self._view(V4Fields, self.attention == "v4")

    @property
    def hyper(self) -> HyperFields:
        return self._view(HyperFields, self.hc_mult > 0)

    @property
    def dsa(self) -> DSAFields:
        return self._view(DSAFields, self.sparse_mla)

    @property
    def sparse_mla(self) -> bool:
        """MLA whose keys a lightning indexer selects per query (DeepSeek Sparse Attention)."""
        return self.attention == "mla" and self.mla_indexer

    @property
    def v4_layers(self) -> list:
        """DeepSeek-V4 attention layers: each keeps its own window ring, compressed entries and compressor
        state (layers/v4_attention.py), none of them the paged per-token cache."""
        return list(range(self.num_layers)) if self.attention == "v4" else []

    @property
    def attention_layers(self) -> list:
        """Layers with softmax attention (full, sliding-window or MLA)."""
        lin = set(self.linear_layers) | set(self.empty_attn_layers)
        return [i for i in range(self.num_layers) if i not in lin]

    @property
    def window_layers(self) -> list:
        """Sliding-window layers: each sequence keeps only its last sliding_window keys (a ring)."""
        return sorted(set(self.sliding_layers) - set(self.linear_layers)) if self.sliding_window else []

    @property
    def paged_layers(self) -> list:
        """Layers whose cache grows with every token: the paged KV cache's."""
        win = set(self.window_layers) | set(self.v4_layers)
        return [i for i in self.attention_layers if i not in win]

    def kv_heads_of(self, i: int) -> int:
        """Key-value heads of attention layer ``i`` (MiMo-V2-Flash: its sliding layers have their own count)."""
        return self.window_kv_heads if self.window_kv_heads and i in self.window_layers else self.num_kv_heads

    @property
    def attn_v_dim(self) -> int:
        """GQA's value head dim."""
        return self.attn_v_head_dim or self.head_dim

    def sinks_on(self, i: int) -> bool:
        """Whether attention layer ``i`` has sinks (gpt-oss: every layer; MiMo-V2-Flash: the sliding ones)."""
        return self.attn_sinks and (not self.window_sinks_only or i in self.window_layers)

    @property
    def layer_norm_names(self) -> tuple:
        """A layer's RMSNorm weights under model.layers.N: the attention sublayer's and the FFN's, then with sandwich
        norms those after each sublayer."""
        return {"pre": ("input_layernorm.weight", "post_attention_layernorm.weight"),
                "normed": ("input_layernorm.weight", "post_attention_layernorm.weight"),
                "post": ("post_attention_layernorm.weight", "post_feedforward_layernorm.weight"),
                "sandwich": ("input_layernorm.weight", "post_attention_layernorm.weight",
                             "post_self_attn_layernorm.weight", "post_mlp_layernorm.weight")}[self.norm_placement]

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
        try:
            d = language_model(d)
        except ValueError as e:
            raise ValueError(f"{source}: {e}") from None
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
        if rope_type not in ("default", "yarn", "llama3"):
            raise ValueError(f"{source}: rope_type {rope_type!r} is not supported yet (default, yarn and llama3 are)")
        arch = module(mt)
        partial = float(rope.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0)))
        if partial != 1.0 and not getattr(arch, "PARTIAL_ROTARY", False):
            raise ValueError(f"{source}: partial_rotary_factor is not supported for {mt}")
        scaling = {}
        if rope_type == "yarn":
            if "original_max_position_embeddings" not in rope:
                raise ValueError(f"{source}: yarn RoPE needs original_max_position_embeddings")
            scaling = {k: rope[k] for k in ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
                                            "mscale", "mscale_all_dim", "attention_factor", "truncate") if k in rope}
        elif rope_type == "llama3":     # Llama 3.1's (layers/rope.py): the scaling named, its four fields all needed
            keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
            if any(rope.get(k) is None for k in keys):
                raise ValueError(f"{source}: llama3 RoPE needs {', '.join(keys)}")
            scaling = {"rope_type": "llama3", **{k: rope[k] for k in keys}}
        E = int(need("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts"))
        eos = d.get("eos_token_id")
        eos = [] if eos is None else ([int(eos)] if isinstance(eos, int) else [int(x) for x in eos])
        common = dict(model_type=mt, vocab_size=int(need("vocab_size")), hidden_size=H, num_layers=L, num_heads=heads,
                      num_kv_heads=kv, head_dim=head_dim, num_experts=E,
                      top_k=int(need("num_experts_per_tok", "num_experts_per_token", "moe_k")),
                      rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)), rope_theta=theta, rope_scaling=scaling,
                      tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                      max_position_embeddings=int(d.get("max_position_embeddings") or d.get("model_max_length") or 4096),
                      eos_token_ids=eos, bos_token_id=d.get("bos_token_id"), source=source,
                      rotary_dim=int(head_dim * partial) if partial != 1.0 else 0)
        # A multimodal release's language model (arch language_model): where its tensors are stored.
        common.update({k: d[k] for k in ("lm_prefix", "lm_head_name") if k in d})
        # Sliding-window attention, by transformers' rule for the architecture (its module's
        # sliding_layers: which layers, [] when the config leaves it off, None when unsupported).
        window = int(d.get("sliding_window") or 0)
        if window:
            sliding = arch.sliding_layers(d, L)
            if sliding is None:
                raise ValueError(f"{source}: sliding_window is not supported for {mt}")
            if sliding:
                common.update(sliding_window=window, sliding_layers=sliding)
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{source}: hidden_act {d.get('hidden_act')!r} is not supported (only silu / SwiGLU)")
        own = arch.config(d, common, need)     # first: an architecture may also correct common fields
        return MoEConfig(**common, **own)

