"""One completion being generated, as the host tracks it. Plain Python, no JAX."""

from __future__ import annotations

import dataclasses
import enum

from paxkv.host.prefix_cache import PageKey
from paxkv.request import FinishReason, SamplingParams


class SeqStatus(enum.Enum):
    """Where a sequence is: queued, holding pages and running, or ended."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclasses.dataclass(eq=False)
class SequenceState:
    """One completion being generated: a prompt, the tokens so far, and the pages it holds.

    `pages` grow only at the end while the sequence runs, and are emptied when it is
    preempted or ends; `num_computed_tokens` of its tokens have K/V in those pages.
    """

    seq_id: str
    request_id: str
    index: int  # which of the request's n completions
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    arrival_time: float
    priority: int = 0  # lower runs first, as in vLLM
    cache_salt: str | None = None
    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    pages: list[int] = dataclasses.field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    keys: list[PageKey] = dataclasses.field(default_factory=list)  # of its full computed pages
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_at(self, i: int) -> int:
        """Token i of prompt + output."""
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[i] if i < n else self.output_token_ids[i - n]

    def token_ids(self, start: int, stop: int) -> list[int]:
        """Tokens `start:stop` of prompt + output."""
        prompt = self.prompt_token_ids
        if stop <= len(prompt):
            return prompt[start:stop]
        out = self.output_token_ids
        return prompt[start:] + out[max(0, start - len(prompt)) : stop - len(prompt)]

    def precedence(self) -> tuple[int, float]:
        """Sort key: who keeps running when pages run out (smallest first)."""
        return (self.priority, self.arrival_time)

    def stop_token_ids(self, eos_token_ids: tuple[int, ...]) -> tuple[int, ...]:
        """The tokens that end this sequence: its stop ids, and the model's EOS unless ignored."""
        eos = () if self.params.ignore_eos else eos_token_ids
        return tuple(dict.fromkeys((*self.params.stop_token_ids, *eos)))

    def is_stop_token(self, token: int, eos_token_ids: tuple[int, ...]) -> bool:
        """Whether sampling `token` ends this sequence with finish reason "stop"."""
        p = self.params
        return token in p.stop_token_ids or (not p.ignore_eos and token in eos_token_ids)

    def remaining_tokens(self, max_model_len: int) -> int:
        """Tokens it may still generate before max_tokens or `max_model_len` ends it."""
        return min(
            self.params.max_tokens - len(self.output_token_ids), max_model_len - self.num_tokens
        )
