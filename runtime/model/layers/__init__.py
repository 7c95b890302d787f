"""The layers a model is built from: norms, RoPE, routers, caches, attention, MoE blocks."""
