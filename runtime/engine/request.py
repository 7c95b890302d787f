"""The engine's typed seams: requests and their sampling parameters, per-step outputs and records,
what the scheduler hands the runner (vLLM v1's ``EngineCoreRequest`` / ``EngineCoreOutput`` /
``SchedulerOutput``)."""
from __future__ import annotations

import math

from dataclasses import dataclass, field

import torch

from ..model.layers.cache import Sequence


class FinishReason:
    """Why a request ended (the OpenAI ``finish_reason`` values, plus ``error`` and ``abort``)."""
    STOP = "stop"          # an EOS or stop token
    LENGTH = "length"      # max_tokens reached
    ABORT = "abort"        # the client went away or asked
    ERROR = "error"        # the engine failed while serving it (the message says why); others go on


# Temperatures below this are greedy (vLLM's _SAMPLING_EPS): dividing logits by 1e-300 overflows.
SAMPLING_EPS = 1e-5


@dataclass
class StepOutput:
    """One request's result of one step: a new token (None while its prompt is still being fed),
    and, when it finished, why; ``error`` names the cause of a failed request."""
    request_id: int
    token: "int | None"
    finished: bool = False
    finish_reason: "str | None" = None
    error: "str | None" = None


@dataclass
class SamplingParams:
    max_tokens: int = 32
    temperature: float = 0.0          # 0: greedy
    top_p: float = 1.0
    top_k: int = 0                    # 0: off
    seed: "int | None" = None
    stop_token_ids: tuple = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be a non-negative integer, got {self.top_k!r}")


def sample(logits: torch.Tensor, p: SamplingParams, gen: "torch.Generator | None") -> int:
    """logits: [vocab] float32."""
    if p.temperature < SAMPLING_EPS:
        i = int(logits.argmax())
        if math.isfinite(float(logits[i])):      # the largest is finite: some logit is (no scan needed)
            return i
    if not bool(torch.isfinite(logits).any()):
        raise FloatingPointError("the model produced no finite logit for this token")
    if p.temperature < SAMPLING_EPS:
        return int(logits.argmax())
    x = logits.double() / p.temperature            # float64: small temperatures stay finite
    if p.top_k:
        kth = x.topk(min(p.top_k, x.numel())).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = x.softmax(-1)
    if p.top_p < 1:
        sp, si = probs.sort(descending=True)
        keep = sp.cumsum(0) - sp < p.top_p         # the smallest prefix whose mass reaches top_p
        probs = torch.zeros_like(probs).scatter_(0, si[keep], sp[keep])
        probs = probs / probs.sum()
    if not bool(torch.isfinite(probs).all()) or not probs.sum() > 0:
        return int(logits.argmax())                # degenerate distribution: the mode
    return int(torch.multinomial(probs, 1, generator=gen))


@dataclass
class Request:
    id: int
    prompt: list
    params: SamplingParams
    output: list = field(default_factory=list)
    seq: Sequence = field(default_factory=Sequence)
    fed: int = 0                      # prompt tokens fed so far
    finished: bool = False
    finish_reason: "str | None" = None
    gen: "torch.Generator | None" = None
    arrival: float = 0.0
    first_token_time: "float | None" = None
    routing: list = field(default_factory=list)   # per step: [fed tokens, moe layers, k] expert ids
    last_step: int = -1                           # the last step this request ran in
    error: "str | None" = None                    # why it failed (finish_reason "error")
    recompute: "list | None" = None               # after a preemption: prompt + output[:-1], fed again
    preemptions: int = 0


@dataclass
class StepRecord:
    step: int
    batch: int
    tokens: int
    unique_experts: list
    hits: dict
    bytes: dict
    stall_seconds: float
    seconds: float
    failed: int = 0          # requests this step failed (an error while serving them)



@dataclass(frozen=True)
class SchedulerOutput:
    """One step's work: the requests that run and the tokens each feeds (a prefill chunk, or its
    last sampled token when decoding), in the same order."""
    requests: list
    chunks: list

    @property
    def tokens(self) -> int:
        return sum(len(c) for c in self.chunks)


@dataclass(frozen=True)
class StepResult:
    """What one ``Engine.step`` produced: one output per request of the step, and the step's record
    (None when it ran nothing)."""
    outputs: list
    record: "StepRecord | None"
