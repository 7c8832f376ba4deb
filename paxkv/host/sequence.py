"""One completion being generated, as the host tracks it. Plain Python, no JAX."""

from __future__ import annotations

import dataclasses
import enum
import math

from paxkv.host.prompt_scores import PromptScores
from paxkv.host.request import FinishReason, SamplingParams

# The top-k of one output token: (token ids, their logprobs, the chosen token's rank).
TopLogprobs = tuple[tuple[int, ...], tuple[float, ...], int]


PLACEHOLDER_TOKEN = -1  # async scheduling: a sampled token the host has not read yet


class SeqStatus(enum.Enum):
    """Where a sequence is: queued, holding pages and running, or ended."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclasses.dataclass(eq=False, slots=True, weakref_slot=True)
class SequenceState:
    """One completion being generated: a prompt, the tokens so far, its outputs and times.

    `num_computed_tokens` of its tokens have K/V in the cache; which pages hold them is
    the KV-cache manager's record (`paxkv.host.kv_cache_manager`), not the sequence's.
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
    # The LoRA adapter it runs under: its key (name and weights version, part of its
    # cached pages' keys) and, once admitted, its device slot (`paxkv.host.lora_slots`).
    lora_key: tuple | None = None
    lora_slot: int = 0
    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    # With params.logprobs: per output token, the chosen token's logprob (kept only for
    # the sequences that report them: no float per token per step for the others).
    logprobs: list[float] = dataclasses.field(default_factory=list)
    # With params.logprobs: per output token, (top ids, their logprobs, chosen's rank).
    top_logprobs: list[TopLogprobs | None] = dataclasses.field(default_factory=list)
    # With penalties: how often each real token (not a placeholder) was generated.
    output_counts: dict[int, int] = dataclasses.field(default_factory=dict)
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    # Speculative proposals recorded as accepted before their verdict was read (async
    # scheduling, `record_proposed`): its length may be that much shorter.
    num_unverified: int = 0
    # Ended by its structured-outputs constraint, complete (`paxkv.host.constrained`): its
    # finish reason is "stop" though its last token is no stop token (its text is kept).
    constraint_done: bool = False
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    # With prompt_logprobs (or a score request): the logprobs of its prompt positions.
    prompt_scores: PromptScores | None = dataclasses.field(default=None, repr=False)
    _prompt_set: frozenset[int] | None = dataclasses.field(default=None, repr=False)
    # `(salt, keys of its full prompt pages)`, kept by the prefix cache (`keys_of`).
    prompt_keys: tuple | None = dataclasses.field(default=None, repr=False)
    # Slots, not a __dict__: the running decodes write a few fields of every running
    # sequence each step, and slots keep those writes and the objects small.
    num_prompt: int = dataclasses.field(init=False, repr=False)
    track_top: bool = dataclasses.field(init=False, repr=False)
    penalised: bool = dataclasses.field(init=False, repr=False)
    biased: bool = dataclasses.field(init=False, repr=False)
    constrained: bool = dataclasses.field(init=False, repr=False)
    _stops: tuple = dataclasses.field(init=False, repr=False)

    def __post_init__(self) -> None:
        # Facts the per-step host path reads for every sequence, computed once.
        self.num_prompt = len(self.prompt_token_ids)
        self.track_top = self.params.logprobs is not None  # keeps top logprobs
        self.penalised = self.params.has_penalties  # keeps output counts
        self.biased = self.params.biased  # its steps carry logit biases
        # its steps carry token masks (`paxkv.host.constrained`)
        self.constrained = self.params.structured_outputs is not None
        self._stops: tuple[tuple[int, ...] | None, frozenset[int]] = (None, frozenset())

    # Outputs. Every change to the output tokens goes through these three, so the
    # logprobs and the penalty counts stay aligned with them. Tokens < 0 are
    # placeholders (async scheduling) whose value the device knows and the host not yet.

    def append_output(self, token: int, logprob: float, top: TopLogprobs | None = None) -> None:
        """Appends a sampled token and (with params.logprobs) its logprob and top-k."""
        self.output_token_ids.append(token)
        if self.track_top:
            self.logprobs.append(logprob)
            self.top_logprobs.append(top)
        if self.penalised:
            self.count_output(token, 1)

    def set_output(
        self, index: int, token: int, logprob: float, top: TopLogprobs | None = None
    ) -> None:
        """Puts the real token at output `index` (in place of a placeholder)."""
        self.count_output(self.output_token_ids[index], -1)
        self.output_token_ids[index] = token
        if self.track_top:
            self.logprobs[index] = logprob
            self.top_logprobs[index] = top
        self.count_output(token, 1)

    def truncate_outputs(self, n: int) -> None:
        """Keeps the first `n` output tokens."""
        for token in self.output_token_ids[n:]:
            self.count_output(token, -1)
        del self.output_token_ids[n:], self.logprobs[n:], self.top_logprobs[n:]

    def count_output(self, token: int, delta: int = 1) -> None:
        """Counts `delta` more of output `token` for penalties (placeholders not)."""
        if token < 0 or not self.params.has_penalties:
            return
        count = self.output_counts.get(token, 0) + delta
        if count:
            self.output_counts[token] = count
        else:
            del self.output_counts[token]

    def penalty_history(self) -> tuple[list[int], list[int], list[int]]:
        """The tokens penalties look at: `(ids, output counts, in prompt 0/1)`, one entry
        per distinct token of the prompt and the real outputs."""
        if self._prompt_set is None:
            self._prompt_set = frozenset(self.prompt_token_ids)
        prompt, counts = self._prompt_set, self.output_counts
        ids = [*prompt, *(t for t in counts if t not in prompt)]
        return ids, [counts.get(t, 0) for t in ids], [int(t in prompt) for t in ids]

    def cacheable_tokens(self) -> int:
        """Leading tokens the prefix cache may serve: all but the last, and none from
        the first row whose prompt logprob is wanted on (`PromptScores`)."""
        n = self.num_tokens - 1
        if self.prompt_scores is not None:
            n = min(n, self.prompt_scores.cacheable_tokens)
        return n

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_ids(self, start: int, stop: int) -> list[int]:
        """Tokens `start:stop` of prompt + output."""
        prompt = self.prompt_token_ids
        if stop <= len(prompt):
            return prompt[start:stop]
        out = self.output_token_ids
        if start >= len(prompt):  # the outputs alone (a decode's filled page)
            return out[start - len(prompt) : stop - len(prompt)]
        return prompt[start:] + out[: stop - len(prompt)]

    def record_sample(
        self,
        token: int,
        logprob: float,
        top: TopLogprobs | None,
        eos_token_ids: tuple[int, ...],
        max_model_len: int,
        now: float,
    ) -> FinishReason | None:
        """Appends a sampled token at time `now`; returns why it ends the sequence (a stop
        token, max_tokens or `max_model_len`), or None. With max_tokens=0 (scoring) the
        token is dropped: the prefill was all the sequence asked for. A placeholder
        (< 0) keeps the token times: `resolve_output` sets them when the token is read."""
        if self.params.max_tokens == 0:
            return FinishReason.LENGTH
        self.append_output(token, logprob, top)
        if token >= 0:
            if self.first_token_time is None:
                self.first_token_time = now
            self.last_token_time = now
        outputs = len(self.output_token_ids)
        if token in self.stop_set(eos_token_ids):
            return FinishReason.STOP
        if outputs >= self.params.max_tokens or self.num_prompt + outputs >= max_model_len:
            return FinishReason.LENGTH
        return None

    def resolve_output(
        self,
        index: int,
        token: int,
        logprob: float,
        top: TopLogprobs | None,
        eos_token_ids: tuple[int, ...],
        now: float,
    ) -> bool:
        """Puts the real token at output `index` (a placeholder until now); returns whether
        it is a stop token, in which case the outputs end there."""
        self.set_output(index, token, logprob, top)
        if index == 0:
            self.first_token_time = now
        self.last_token_time = now
        if not self.is_stop_token(token, eos_token_ids):
            return False
        self.truncate_outputs(index + 1)
        return True

    def precedence(self) -> tuple[int, float]:
        """Sort key: who keeps running when pages run out (smallest first)."""
        return (self.priority, self.arrival_time)

    def stop_set(self, eos_token_ids: tuple[int, ...]) -> frozenset[int]:
        """The tokens that end this sequence, as a set (kept for the last `eos_token_ids`)."""
        eos, stops = self._stops
        if eos is not eos_token_ids:
            stops = frozenset(self.stop_token_ids(eos_token_ids))
            self._stops = (eos_token_ids, stops)
        return stops

    def stop_token_ids(self, eos_token_ids: tuple[int, ...]) -> tuple[int, ...]:
        """The tokens that end this sequence: its stop ids, and the model's EOS unless ignored."""
        eos = () if self.params.ignore_eos else eos_token_ids
        return tuple(dict.fromkeys((*self.params.stop_token_ids, *eos)))

    def logit_bias(self, eos_token_ids: tuple[int, ...]) -> list[tuple[int, float]]:
        """The (token id, bias) pairs its next sample adds to the logits: `logit_bias`,
        and -inf on its stop tokens while fewer than `min_tokens` are generated (a
        placeholder counts: its token is sampled already)."""
        p = self.params
        pairs = dict(p.logit_bias or ())
        if len(self.output_token_ids) < p.min_tokens:
            pairs.update(dict.fromkeys(self.stop_token_ids(eos_token_ids), -math.inf))
        return list(pairs.items())

    def is_stop_token(self, token: int, eos_token_ids: tuple[int, ...]) -> bool:
        """Whether sampling `token` ends this sequence with finish reason "stop"."""
        p = self.params
        return token in p.stop_token_ids or (not p.ignore_eos and token in eos_token_ids)

    def remaining_tokens(self, max_model_len: int) -> int:
        """Tokens it may still generate before max_tokens or `max_model_len` ends it."""
        return min(
            self.params.max_tokens - len(self.output_token_ids), max_model_len - self.num_tokens
        )
