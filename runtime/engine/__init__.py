"""Scheduler and step(): continuous batching over the MoE model and the expert store."""
from .engine import Engine, Request, SamplingParams, StepRecord, sample

__all__ = ["Engine", "Request", "SamplingParams", "StepRecord", "sample"]
