"""Checkpoint tensor names of the routed-expert parts of a layer, as the layers that take them and the
conversion that reads them both spell them: one place, imported by both.

A leaf of the model package (it reads only the config and the architecture modules' tables), so the
layers need not import convert.py, which sits above them (it reads the layers' tensor table)."""
from __future__ import annotations

from .arch import module
from .config import MoEConfig


def expert_names(cfg: MoEConfig, layer: int, e: int) -> dict:
    """Expert ``e``'s weights by role: gate, up, down - up and down alone for an ungated expert (Nemotron-H)."""
    p = f"model.layers.{layer}.{cfg.mlp_prefix}experts.{e}."
    roles = ("gate", "up", "down") if cfg.gated_experts else ("up", "down")
    return {role: f"{p}{t}.weight" for role, t in zip(roles, cfg.expert_tensors)}


def router_name(cfg: MoEConfig, layer: int) -> str:
    return f"model.layers.{layer}.{cfg.mlp_prefix}{cfg.router_tensor}"


def correction_bias_name(cfg: MoEConfig, layer: int) -> str:
    """The sigmoid router's selection bias (DeepSeek-V3, Kimi, GLM-4.5, MiniMax-M2)."""
    return f"model.layers.{layer}.{cfg.mlp_prefix}{cfg.correction_bias_tensor}"


def linear_names(cfg: MoEConfig, layer: int) -> dict:
    """A linear-attention layer's tensors -> shape: its architecture module's table."""
    return module(cfg.model_type).linear_names(cfg, layer)
