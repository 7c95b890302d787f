"""The engine's typed seams: requests and their sampling parameters, per-step outputs and records,
what the scheduler hands the runner (vLLM v1's ``EngineCoreRequest`` / ``EngineCoreOutput`` /
``SchedulerOutput``)."""
from __future__ import annotations

import math

from dataclasses import dataclass, field

import torch

from ..model.layers.cache import Sequence
from .grammar import FORMATS


class FinishReason:
    """Why a request ended (the OpenAI ``finish_reason`` values, plus ``error`` and ``abort``)."""
    STOP = "stop"          # an EOS or stop token
    LENGTH = "length"      # max_tokens reached
    ABORT = "abort"        # the client went away or asked
    ERROR = "error"        # the engine failed while serving it (the message says why); others go on
    REJECTED = "rejected"  # its content cannot be served (its grammar failed while generating): the client's error


# Temperatures below this are greedy (vLLM's _SAMPLING_EPS): dividing logits by 1e-300 overflows.
SAMPLING_EPS = 1e-5


# The most alternatives a request may ask log-probabilities of (OpenAI's top_logprobs limit).
MAX_LOGPROBS = 20


@dataclass
class TokenLogprobs:
    """A sampled token's log-probability under the model's distribution (its raw logits: before penalties,
    biases and temperature - vLLM's default ``raw_logprobs``), and the ``k`` most likely tokens with theirs."""
    logprob: float
    top: list                         # [(token id, logprob)], most likely first
    rank: "int | None" = None         # its rank in the vocabulary (1: the likeliest), where asked for (prompt_logprobs)


@dataclass
class StepOutput:
    """One request's result of one step: a new token (None while its prompt is still being fed),
    and, when it finished, why; ``error`` names the cause of a failed request; ``logprobs`` when the
    request asked for them; ``cached_tokens`` with its first token: the prompt tokens the prefix cache held."""
    request_id: int
    token: "int | None"
    finished: bool = False
    finish_reason: "str | None" = None
    error: "str | None" = None
    logprobs: "TokenLogprobs | None" = None
    cached_tokens: "int | None" = None
    prompt_logprobs: "list | None" = None      # with its first token, when asked for: Request.prompt_logprobs


@dataclass
class SamplingParams:
    max_tokens: int = 32
    temperature: float = 0.0          # 0: greedy
    top_p: float = 1.0
    top_k: int = 0                    # 0: off
    seed: "int | None" = None
    stop_token_ids: tuple = ()
    ignore_eos: bool = False
    logprobs: "int | None" = None     # None: none; k: the sampled token's log-probability and the k most likely
    presence_penalty: float = 0.0     # subtracted from the logit of every token the output has (OpenAI)
    frequency_penalty: float = 0.0    # ... times how often it has it
    repetition_penalty: float = 1.0   # logits of tokens in the prompt or output: / p if positive, x p if not (CTRL)
    logit_bias: "dict | None" = None  # token id -> added to its logit (a list of [id, bias] pairs is taken too)
    grammar: "tuple | None" = None    # (format, text): the output must be in its language (runtime/engine/grammar.py)
    # (token id, format, text): free output until the model samples that token, then the rest must be in the
    # grammar's language - a tool call the model starts by its family's marker is finished by the grammar
    # (what llguidance / vLLM call a lazy grammar or structural tag)
    trigger: "tuple | None" = None
    # vLLM's: EOS (unless ignore_eos) and the stop token ids cannot be sampled before the output has min_tokens
    min_tokens: int = 0
    min_p: float = 0.0                # after temperature: tokens below min_p x the likeliest's probability are dropped
    allowed_token_ids: "tuple | None" = None   # only these may be sampled
    prompt_logprobs: "int | None" = None       # each prompt token's log-probability, rank and the k most likely

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be a non-negative integer, got {self.top_k!r}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or isinstance(self.logprobs, bool)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and -2 <= v <= 2):
                raise ValueError(f"{name} must be in [-2, 2], got {v!r}")
        if not (isinstance(self.repetition_penalty, (int, float)) and 0 < self.repetition_penalty <= 100):
            raise ValueError(f"repetition_penalty must be in (0, 100], got {self.repetition_penalty!r}")
        if self.logit_bias is not None:
            pairs = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
            try:
                bias = {int(t): float(b) for t, b in pairs}
            except (TypeError, ValueError):
                raise ValueError("logit_bias must map token ids to numbers") from None
            bad = [b for b in bias.values() if not -100 <= b <= 100]
            if bad:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bad[0]!r}")
            self.logit_bias = bias or None
        if self.grammar is not None:
            g = tuple(self.grammar)
            if len(g) != 2 or g[0] not in FORMATS or not isinstance(g[1], str):
                raise ValueError(f"grammar must be (format, text) with a format of {', '.join(FORMATS)}, got "
                                 f"{str(self.grammar)[:80]}")
            self.grammar = g
        if self.trigger is not None:
            t = tuple(self.trigger)
            if (len(t) != 3 or not isinstance(t[0], int) or isinstance(t[0], bool) or t[1] not in FORMATS
                    or not isinstance(t[2], str)):
                raise ValueError(f"trigger must be (token id, format, text) with a format of {', '.join(FORMATS)}, "
                                 f"got {str(self.trigger)[:80]}")
            if self.grammar is not None:
                raise ValueError("a request has either a grammar or a trigger, not both")
            self.trigger = t
        self._check_vllm_fields()

    def _check_vllm_fields(self) -> None:
        if not (isinstance(self.min_tokens, int) and not isinstance(self.min_tokens, bool)
                and 0 <= self.min_tokens <= self.max_tokens):
            raise ValueError(f"min_tokens must be an integer in [0, max_tokens = {self.max_tokens}], got "
                             f"{self.min_tokens!r}")
        if not (isinstance(self.min_p, (int, float)) and 0 <= self.min_p <= 1):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.allowed_token_ids is not None:
            ids = tuple(self.allowed_token_ids)
            if not ids or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
                raise ValueError("allowed_token_ids must be a non-empty list of token ids")
            self.allowed_token_ids = ids
        if self.prompt_logprobs is not None and (not isinstance(self.prompt_logprobs, int)
                                                 or isinstance(self.prompt_logprobs, bool)
                                                 or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS):
            raise ValueError(f"prompt_logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs!r}")

    @property
    def processes_logits(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias)


def process_logits(logits: torch.Tensor, p: SamplingParams, prompt: list, output: list) -> torch.Tensor:
    """The logits sampling sees, in vLLM's order: logit_bias, then the repetition penalty (prompt and output
    tokens), then frequency and presence penalties (output tokens). logits: [vocab]; returns a new tensor."""
    if not p.processes_logits:
        return logits
    V = logits.shape[-1]
    x = logits.float().clone()
    if p.logit_bias:
        ids = [t for t in p.logit_bias if 0 <= t < V]       # an id outside the vocabulary biases nothing
        if ids:
            x[torch.tensor(ids, device=x.device)] += torch.tensor([p.logit_bias[t] for t in ids], device=x.device)
    if p.repetition_penalty != 1.0 and (prompt or output):
        seen = torch.tensor(sorted(set(prompt) | set(output)), device=x.device)
        v = x[seen]
        x[seen] = torch.where(v > 0, v / p.repetition_penalty, v * p.repetition_penalty)
    if output and (p.frequency_penalty or p.presence_penalty):
        counts = torch.bincount(torch.tensor(output, device=x.device), minlength=V)[:V].to(x.dtype)   # counts: [vocab]
        x -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(x.dtype)
    return x


def restrict(logits: torch.Tensor, p: SamplingParams, generated: int, eos) -> torch.Tensor:
    """vLLM's allowed_token_ids (no other token may be sampled) and min_tokens (while the output has fewer than
    min_tokens tokens, neither the stop token ids nor - unless ignore_eos - EOS may be): those at -inf.
    logits: [vocab]; returns it untouched or a new tensor."""
    banned = list(p.stop_token_ids) + ([] if p.ignore_eos else list(eos)) if generated < p.min_tokens else []
    if p.allowed_token_ids is None and not banned:
        return logits
    V = logits.shape[-1]
    off = torch.zeros(V, dtype=torch.bool, device=logits.device)
    if p.allowed_token_ids is not None:
        off[:] = True
        off[torch.tensor([t for t in p.allowed_token_ids if t < V], dtype=torch.long, device=logits.device)] = False
    if banned:
        off[torch.tensor([t for t in banned if 0 <= t < V], dtype=torch.long, device=logits.device)] = True
    return logits.masked_fill(off, float("-inf"))


def prompt_logprobs_of(logits: torch.Tensor, targets: list, k: int) -> list:
    """Per row of logits [n, vocab] (the model's raw ones at a prompt position): the log-probability of the prompt's
    next token ``targets[i]``, its rank in the vocabulary (1: the likeliest; vLLM's), and the ``k`` most likely."""
    lp = logits.float().log_softmax(-1)                                  # lp: [n, vocab]
    t = torch.tensor(targets, dtype=torch.long, device=lp.device)
    mine = lp.gather(1, t[:, None])[:, 0]                                # mine: [n]
    ranks = ((lp > mine[:, None]).sum(1) + 1).tolist()
    top = lp.topk(k) if k else None
    out = []
    for i, (v, rank) in enumerate(zip(mine.tolist(), ranks)):
        alts = [] if top is None else list(zip(top.indices[i].tolist(), top.values[i].tolist()))
        out.append(TokenLogprobs(v, alts, rank=rank))
    return out


def logprobs_of(logits: torch.Tensor, token: int, k: int) -> TokenLogprobs:
    """``token``'s log-probability and the ``k`` most likely under softmax(logits). logits: [vocab]."""
    lp = logits.float().log_softmax(-1)
    top = lp.topk(k) if k else None
    return TokenLogprobs(float(lp[token]), [] if top is None else
                         [(int(i), float(v)) for v, i in zip(top.values.tolist(), top.indices.tolist())])


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
    probs = distribution(logits, p)
    if not bool(torch.isfinite(probs).all()) or not probs.sum() > 0:
        return int(logits.argmax())                # degenerate distribution: the mode
    return int(torch.multinomial(probs, 1, generator=gen))


def distribution(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The probabilities a non-greedy draw samples from, in vLLM's order: temperature, min_p (tokens whose
    probability is below min_p x the likeliest's dropped), top_k, top_p. logits: [vocab]; float64 [vocab]."""
    x = logits.double() / p.temperature            # float64: small temperatures stay finite
    if p.min_p > 0:
        probs = x.softmax(-1)
        x = x.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
    if p.top_k:
        kth = x.topk(min(p.top_k, x.numel())).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = x.softmax(-1)
    if p.top_p < 1:
        sp, si = probs.sort(descending=True)
        keep = sp.cumsum(0) - sp < p.top_p         # the smallest prefix whose mass reaches top_p
        probs = torch.zeros_like(probs).scatter_(0, si[keep], sp[keep])
        probs = probs / probs.sum()
    return probs


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
    matcher: object = None                        # its grammar's state (grammar.Matcher), when it has one
    armed: object = None                          # its trigger's grammar, compiled, until the trigger token comes
    # vLLM's cache_salt: its prefix-cache blocks are shared only with requests of the same salt (kv_manager.py)
    cache_salt: "str | None" = None
    cached_tokens: "int | None" = None            # prompt tokens found in the prefix cache at its first admission
    # params.prompt_logprobs: per prompt position, None for the first, then its token's TokenLogprobs (the engine
    # fills them as the prompt's chunks run)
    prompt_logprobs: "list | None" = None
    # speculative decoding (speculative.py): tokens of output[-1:] fed again before output[-1] - their state was
    # rolled back after a rejected draft (a model with per-sequence state); drafts proposed / kept; per verify
    # step, how many of its drafts were kept
    refeed: int = 0
    spec_drafted: int = 0
    spec_accepted: int = 0
    spec_lengths: list = field(default_factory=list)


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
    # speculative decoding: drafts fed / kept this step, kept tokens fed again after a state rollback, each verified
    # request's kept drafts, and the distinct experts per MoE layer (mean over layers) its verify chunks routed to
    spec_drafted: int = 0
    spec_accepted: int = 0
    spec_refed: int = 0
    spec_lengths: tuple = ()
    spec_verify_unique_experts: "float | None" = None



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
