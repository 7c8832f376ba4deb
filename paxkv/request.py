"""What a user submits and what comes back: sampling parameters, outputs and metrics.

Plain Python, no JAX: the scheduler and the API share these types. The names follow
vLLM's offline API (`SamplingParams`, `RequestOutput`, `CompletionOutput`), so code
written against it switches over.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to sample one request's output tokens.

    `temperature == 0` is greedy. `top_k` (0 or -1: off), `top_p` (1.0: off) and `min_p`
    (0.0: off) truncate the distribution after temperature scaling. `seed` makes the
    request's samples reproducible whatever it is batched with (None: the engine draws
    one). Generation stops after `max_tokens` tokens, or at a token of `stop_token_ids`
    or the model's EOS (unless `ignore_eos`); a stop token is kept in the output.
    `logprobs=True` reports the log-probability of each chosen token under the model's
    distribution (before temperature and truncation). `n > 1` samples several
    completions of the same prompt.
    """

    n: int = 1
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if self.n < 1:
            raise ValueError(f"n={self.n} must be at least 1")
        if not self.temperature >= 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0")
        if self.top_k < -1:
            raise ValueError(f"top_k={self.top_k} must be -1, 0 (off) or positive")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p={self.min_p} must be in [0, 1]")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens} must be at least 1")
        if self.seed is not None and not 0 <= self.seed < 2**31:
            raise ValueError(f"seed={self.seed} must be in [0, 2**31)")


class FinishReason(enum.StrEnum):
    """Why a request ended. `str` values match vLLM's ("stop", "length", "abort")."""

    STOP = "stop"  # a stop token or EOS
    LENGTH = "length"  # max_tokens or max_model_len
    ABORT = "abort"  # aborted by the caller


@dataclasses.dataclass
class RequestMetrics:
    """Timestamps (time.monotonic seconds) and counters of one request."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0

    @property
    def queue_time(self) -> float | None:
        """Seconds from arrival until first scheduled."""
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def ttft(self) -> float | None:
        """Time to first token, from arrival."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        """Seconds from arrival until finished."""
        if self.finished_time is None:
            return None
        return self.finished_time - self.arrival_time


@dataclasses.dataclass
class CompletionOutput:
    """One completion of a request (`RequestOutput.outputs[i]`)."""

    index: int
    token_ids: list[int]
    text: str | None = None
    logprobs: list[float] | None = None
    finish_reason: str | None = None  # a FinishReason value once finished

    @property
    def finished(self) -> bool:
        """Whether the completion has ended."""
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestOutput:
    """The state of one request: its prompt, its completions so far, and its metrics."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None


def normalize_prompt(prompt) -> tuple[str | None, list[int] | None]:
    """Splits a prompt into `(text, token_ids)`; exactly one of them is not None.

    A prompt is a string or a dict with "prompt_token_ids" (vLLM's TokensPrompt) or
    "prompt" (TextPrompt).
    """
    if isinstance(prompt, str):
        return prompt, None
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
                raise ValueError(
                    f"prompt_token_ids must be a list of ints, got {type(ids).__name__}"
                )
            return None, [int(t) for t in ids]
        if "prompt" in prompt and isinstance(prompt["prompt"], str):
            return prompt["prompt"], None
    raise ValueError(
        f"a prompt must be a str or a dict with 'prompt_token_ids' or 'prompt', got {type(prompt).__name__}"
    )
