"""Per-family views of the model config: the fields one layer family reads, validated together.

``MoEConfig`` keeps one flat record (what the architecture modules fill from config.json, and what
tensor-parallel ranks rewrite with ``dataclasses.replace``); each family's layers read their own view
(``cfg.mla``, ``cfg.linear``, ``cfg.v4``, ``cfg.hyper``), which exists only for a model that has that
family and checks its fields when the config is made. A field a family does not have is not on its view."""
from __future__ import annotations

from dataclasses import dataclass, fields

# Kimi Delta Attention (Kimi-Linear), Gated DeltaNet (Qwen3-Next / Qwen3.5), lightning attention (MiniMax-Text-01 / M1),
# Mamba-2 (Granite 4 hybrids)
LINEAR_KINDS = ("kda", "gated_deltanet", "lightning", "mamba2")
V4_KINDS = ("sliding", "csa", "hca")       # DeepSeek-V4 layer kinds (config.json layer_types: see arch/deepseek_v4.py)


class ConfigView:
    """A frozen view: ``SOURCE`` maps a view field to its MoEConfig field (same name where absent)."""
    SOURCE: dict = {}
    FAMILY = ""

    @classmethod
    def of(cls, cfg):
        view = cls(**{f.name: getattr(cfg, cls.SOURCE.get(f.name, f.name)) for f in fields(cls)})
        view.check(cfg)
        return view

    def check(self, cfg) -> None:      # raise ValueError naming the config file and the field
        pass


@dataclass(frozen=True)
class MLAFields(ConfigView):
    """Multi-head latent attention (DeepSeek-V2/V3, Kimi K2, Kimi-Linear, GLM-4.7-Flash): q through a
    low-rank factor (``q_lora_rank``; 0: a plain q_proj), k and v from one ``kv_lora_rank`` latent plus a
    shared rotary key of ``qk_rope_head_dim``."""
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope: bool                  # False: no RoPE at all (Kimi-Linear: positions come from its KDA layers)
    rope_interleave: bool
    SOURCE = {"rope": "mla_rope"}
    FAMILY = "multi-head latent attention"

    def check(self, cfg) -> None:
        if self.kv_lora_rank < 1 or self.v_head_dim < 1 or self.q_lora_rank < 0:
            raise ValueError(f"{cfg.source}: MLA needs a positive kv_lora_rank and v_head_dim and q_lora_rank >= 0, "
                             f"got {self.kv_lora_rank} / {self.v_head_dim} / {self.q_lora_rank}")
        if self.qk_nope_head_dim < 0 or self.qk_rope_head_dim < 0 or self.qk_rope_head_dim % 2 \
                or self.qk_nope_head_dim + self.qk_rope_head_dim < 1:
            raise ValueError(f"{cfg.source}: MLA's query head is qk_nope_head_dim {self.qk_nope_head_dim} + an even "
                             f"qk_rope_head_dim {self.qk_rope_head_dim}, at least one channel")


@dataclass(frozen=True)
class LinearFields(ConfigView):
    """Linear-attention layers (a fixed recurrent state per sequence): Kimi Delta Attention (keys = values
    of ``head_dim``), Gated DeltaNet (``num_heads`` key heads, ``num_v_heads`` value heads) or lightning
    attention (keys = values of ``head_dim``, no convolution) or Mamba-2 (``num_heads`` heads of ``head_dim``
    channels, B and C in ``num_groups`` groups of ``state_dim``)."""
    layers: list
    kind: str
    prefix: str                 # a layer's tensors live under model.layers.N.<prefix>
    num_heads: int
    head_dim: int
    num_v_heads: int            # Gated DeltaNet only
    value_head_dim: int         # Gated DeltaNet only
    conv_kernel: int
    num_groups: int             # Mamba-2 only
    state_dim: int              # Mamba-2 only
    conv_bias: bool             # Mamba-2 only
    proj_bias: bool             # Mamba-2 only
    SOURCE = {"num_groups": "linear_num_groups", "state_dim": "linear_state_dim", "conv_bias": "linear_conv_bias",
              "proj_bias": "linear_proj_bias", "layers": "linear_layers", "kind": "linear_kind", "prefix": "linear_prefix",
              "num_heads": "linear_num_heads", "head_dim": "linear_head_dim", "num_v_heads": "linear_num_v_heads",
              "value_head_dim": "linear_value_head_dim", "conv_kernel": "linear_conv_kernel"}
    FAMILY = "linear-attention layers"

    def check(self, cfg) -> None:
        src = cfg.source
        if self.kind not in LINEAR_KINDS:
            raise ValueError(f"{src}: unknown linear-attention kind {self.kind!r}; choose one of {', '.join(LINEAR_KINDS)}")
        if any(not 0 <= i < cfg.num_layers for i in self.layers):
            raise ValueError(f"{src}: linear-attention layer index out of range 0..{cfg.num_layers - 1}")
        if self.num_heads < 1 or self.head_dim < 1 or (self.conv_kernel < 2 and self.kind != "lightning"):
            raise ValueError(f"{src}: linear-attention layers need positive linear_num_heads / linear_head_dim and a "
                             f"convolution kernel of at least 2, got {self.num_heads} / {self.head_dim} / "
                             f"{self.conv_kernel}")
        if self.kind == "mamba2" and (self.state_dim < 1 or self.num_groups < 1 or self.num_heads % self.num_groups):
            raise ValueError(f"{src}: Mamba-2 needs a positive state size and mamba_n_heads ({self.num_heads}) a "
                             f"multiple of mamba_n_groups ({self.num_groups}), got state size {self.state_dim}")
        if self.kind == "gated_deltanet" and (self.num_v_heads < 1 or self.value_head_dim < 1
                                              or self.num_v_heads % self.num_heads):
            raise ValueError(f"{src}: Gated DeltaNet needs linear_num_value_heads ({self.num_v_heads}) a positive "
                             f"multiple of linear_num_key_heads ({self.num_heads}) and a positive value head dim")


@dataclass(frozen=True)
class HyperFields(ConfigView):
    """Hyper-connections (runtime/model/hyper.py): ``mult`` residual streams mixed by Sinkhorn-normalised
    matrices."""
    mult: int
    sinkhorn_iters: int
    eps: float
    SOURCE = {"mult": "hc_mult", "sinkhorn_iters": "hc_sinkhorn_iters", "eps": "hc_eps"}
    FAMILY = "hyper-connections"

    def check(self, cfg) -> None:
        if self.mult < 1 or self.sinkhorn_iters < 1:
            raise ValueError(f"{cfg.source}: hc_mult and hc_sinkhorn_iters must be positive, got {self.mult} / "
                             f"{self.sinkhorn_iters}")


@dataclass(frozen=True)
class V4Fields(ConfigView):
    """DeepSeek-V4 attention: each layer's kind (``kinds``: sliding, csa, hca), the compress rate of each
    compressed kind, a shared K=V head with RoPE on its last ``rope_head_dim`` channels, q through a
    ``q_lora_rank`` factor, the grouped low-rank output (``o_groups`` x ``o_lora_rank``), CSA's indexer
    (``index_*``), and the compressed layers' RoPE (``compress_rope_*``)."""
    kinds: list
    compress_rates: dict
    window: int
    q_lora_rank: int
    rope_head_dim: int
    o_groups: int
    o_lora_rank: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    compress_rope_theta: float
    compress_rope_scaling: dict
    SOURCE = {"kinds": "v4_kinds", "window": "sliding_window", "rope_head_dim": "qk_rope_head_dim"}
    FAMILY = "DeepSeek-V4 attention"

    def check(self, cfg) -> None:
        src = cfg.source
        if len(self.kinds) != cfg.num_layers or any(k not in V4_KINDS for k in self.kinds):
            raise ValueError(f"{src}: DeepSeek-V4 needs one of {', '.join(V4_KINDS)} per layer, got {self.kinds!r}")
        for kind in set(self.kinds) - {"sliding"}:
            r = self.compress_rates.get(kind)
            if not isinstance(r, int) or r < 1:
                raise ValueError(f"{src}: compress rate of {kind} layers must be a positive integer, got {r!r}")
        if self.o_groups < 1 or cfg.num_heads % self.o_groups or self.o_lora_rank < 1:
            raise ValueError(f"{src}: o_groups {self.o_groups} must divide num_attention_heads {cfg.num_heads} and "
                             f"o_lora_rank {self.o_lora_rank} be positive")
        if not 0 < self.rope_head_dim <= cfg.head_dim or self.rope_head_dim % 2:
            raise ValueError(f"{src}: the rotary part {self.rope_head_dim} must be even and within head_dim {cfg.head_dim}")
        if self.q_lora_rank < 1 or self.window < 1:
            raise ValueError(f"{src}: DeepSeek-V4 needs q_lora_rank and sliding_window, got {self.q_lora_rank} / "
                             f"{self.window}")
        if "csa" in self.kinds and (self.index_n_heads < 1 or self.index_head_dim < 1 or self.index_topk < 1
                                    or self.index_head_dim < self.rope_head_dim):
            raise ValueError(f"{src}: CSA layers need index_n_heads, index_head_dim (>= the rotary part) and index_topk")
        if any(l not in cfg.moe_layers for l in cfg.hash_layers):
            raise ValueError(f"{src}: hash-routed layers {cfg.hash_layers} must be MoE layers")


@dataclass(frozen=True)
class DSAFields(ConfigView):
    """DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5) over MLA: a lightning indexer of ``n_heads`` x
    ``head_dim`` (RoPE on its first ``rope_head_dim`` channels, in interleaved pairs or rotate-half) reading
    MLA's q LoRA residual, which picks ``topk`` cached keys per query; the ``shared`` layers have no indexer
    and reuse the pick of the layer before them."""
    n_heads: int
    head_dim: int
    topk: int
    rope_head_dim: int
    rope_interleave: bool
    shared: list
    SOURCE = {"n_heads": "index_n_heads", "head_dim": "index_head_dim", "topk": "index_topk",
              "rope_head_dim": "qk_rope_head_dim", "rope_interleave": "index_rope_interleave",
              "shared": "index_shared_layers"}
    FAMILY = "DeepSeek sparse attention"

    def check(self, cfg) -> None:
        src = cfg.source
        if self.n_heads < 1 or self.topk < 1 or self.head_dim < max(self.rope_head_dim, 1):
            raise ValueError(f"{src}: DeepSeek sparse attention needs positive index_n_heads and index_topk and an "
                             f"index_head_dim of at least qk_rope_head_dim {self.rope_head_dim}, got {self.n_heads} / "
                             f"{self.topk} / {self.head_dim}")
        if cfg.q_lora_rank < 1:
            raise ValueError(f"{src}: DeepSeek sparse attention's indexer reads the q LoRA residual: it needs a "
                             f"q_lora_rank, got {cfg.q_lora_rank}")
        if any(not 0 < i < cfg.num_layers for i in self.shared):
            raise ValueError(f"{src}: layers {self.shared} reuse the top-k of the layer before them: each must be one "
                             f"of layers 1..{cfg.num_layers - 1} (layer 0 has none before it)")
