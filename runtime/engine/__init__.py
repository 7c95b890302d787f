"""Continuous batching over the MoE model and the expert store: the scheduler (scheduler.py), the
typed requests and outputs (request.py), and the engine that steps them (engine.py)."""
from .engine import Engine
from .request import FinishReason, Request, SamplingParams, SchedulerOutput, StepOutput, StepRecord, StepResult, sample
from .scheduler import Scheduler

__all__ = ["Engine", "FinishReason", "Request", "SamplingParams", "Scheduler", "SchedulerOutput", "StepOutput",
           "StepRecord", "StepResult", "sample"]
