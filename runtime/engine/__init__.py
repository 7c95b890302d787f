"""Scheduler and step(): continuous batching over the MoE model and the expert store."""
from .engine import Engine, FinishReason, Request, SamplingParams, StepOutput, StepRecord, sample

__all__ = ["Engine", "FinishReason", "Request", "SamplingParams", "StepOutput", "StepRecord", "sample"]
