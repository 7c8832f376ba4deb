"""Speculative decoding on the host: the configuration, the proposals each decode
carries into the step, when a sequence speculates, and the counts. No JAX.

After the scheduler has planned a step (decodes, prefill chunks, admissions), the
step's spare tokens go to proposals: each decoding sequence that speculates gets up to
`num_speculative_tokens` tokens proposed by prompt lookup
(`paxkv.host.ngram_proposer`), as query rows after its last token, and the pages they
need if the pool has them free. The spare tokens are the budget left, and no more than
the padding of the step's token bucket: the rows the step would compute anyway, so
proposals never move a step to a larger (costlier) shape unless `grow_token_bucket`;
they are shared evenly among the decodes that have proposals. Speculation never
preempts, never delays a prefill or an admission, and never proposes past the
sequence's `max_tokens` or `max_model_len` (at most `remaining - 1` proposals, so the
emitted tokens, at most proposals + 1, fit).
The step verifies them (`paxkv.engine.device.verification`) and the scheduler keeps what it
accepts (`Scheduler.update`), giving back pages held only for rejected positions.

How far a sequence speculates (the adaptive rule): it estimates the probability α
that the target accepts a proposed token given it accepted the ones before, as
`accepted / (accepted + rejections)` over its recent drafts (counts decayed by 3/4 at
each draft; its first estimate is the same ratio over the engine's recent drafts of
every sequence, decayed by 0.95 a draft, starting at 1), and proposes position j only while `α**j`, the
chance that position j is reached and accepted, is at least `min_acceptance`: k' =
`floor(log(min_acceptance) / log(α))`, at most k. When k' falls to 0 the sequence
pauses for `8 * 2**m` steps (m: the pauses in a row before it, at most 5; rounded up
to a multiple of 8 steps, so paused sequences probe together) and then probes with one
proposal. A sequence for which the lookup finds nothing costs nothing
(no rows). With `disable_by_batch_size`, no sequence speculates in a step planned while
more sequences than that run (vLLM's option of that name): a full batch is compute
bound, where extra query rows cost as much as they can save.
"""

from __future__ import annotations

import dataclasses
import math
import weakref
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from paxkv.host.mappings import dataclass_of
from paxkv.host.ngram_proposer import NgramProposer
from paxkv.host.request import FinishReason, check_bool, check_float, check_int
from paxkv.host.sequence import SequenceState
from paxkv.host.step_plan import ScheduledChunk
from paxkv.pallas_kernels.layout import cdiv

if TYPE_CHECKING:
    from paxkv.host.kv_cache_manager import KVCacheManager

METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 16
DECAY = 0.75  # of a sequence's acceptance counts at each of its drafts
GLOBAL_DECAY = 0.95  # of the engine's acceptance counts at each draft
PAUSE_STEPS = 8  # the first pause; each pause in a row doubles it
MAX_PAUSE_DOUBLINGS = 5


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding settings, as vLLM's `speculative_config` names them.

    Args:
      method: "ngram" (prompt lookup: no extra model) or "draft_model" (a smaller
        model with the target's tokenizer, `paxkv.engine.device.draft`); unset:
        "draft_model" when `model` is given, else "ngram" (as vLLM infers it).
      num_speculative_tokens: most tokens proposed per sequence per step (k), 1..16.
      prompt_lookup_min / prompt_lookup_max: the shortest and longest suffix matched
        (`NgramProposer`); one unset takes the other's value, both unset: 2 and 5.
        Method "ngram" only: with "draft_model" they stay None, and setting one is an
        error.
      min_acceptance: the least estimated chance of acceptance a proposed position
        must have (module docstring), in [0, 1); 0: always propose k.
      disable_by_batch_size: no speculation in steps planned with more running
        sequences than this; None: no limit.
      grow_token_bucket: let proposals move a step to a larger token bucket (more
        padded rows); off, they only fill the padding of the step's own bucket.
      model: the draft model's preset name or checkpoint directory (method
        "draft_model" only; `LLM` loads it, an `Engine` takes the model object).
    """

    method: str | None = None
    num_speculative_tokens: int = 4
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    min_acceptance: float = 0.2
    disable_by_batch_size: int | None = None
    grow_token_bucket: bool = False
    model: str | None = None

    def __post_init__(self) -> None:
        if self.method is None:
            object.__setattr__(self, "method", "ngram" if self.model is None else "draft_model")
        if self.method not in METHODS:
            raise ValueError(f"speculative_config.method={self.method!r} must be one of {METHODS}")
        if self.method == "draft_model" and not isinstance(self.model, str):
            raise ValueError(
                f"speculative_config.method='draft_model' needs model= (the draft's preset "
                f"name or checkpoint directory), got model={self.model!r}"
            )
        if self.method != "draft_model" and self.model is not None:
            raise ValueError(
                f"speculative_config.model={self.model!r} needs method='draft_model', "
                f"not {self.method!r}"
            )
        check_int(
            "speculative_config.num_speculative_tokens",
            self.num_speculative_tokens,
            lo=1,
            hi=MAX_SPECULATIVE_TOKENS,
        )
        self._check_prompt_lookup()
        rate = check_float("speculative_config.min_acceptance", self.min_acceptance)
        if not 0 <= rate < 1:
            raise ValueError(f"speculative_config.min_acceptance={rate} must be in [0, 1)")
        check_bool("speculative_config.grow_token_bucket", self.grow_token_bucket)
        if self.disable_by_batch_size is not None:
            check_int("speculative_config.disable_by_batch_size", self.disable_by_batch_size, lo=1)

    def _check_prompt_lookup(self) -> None:
        """Checks the n-gram lookup lengths and fills in their defaults (method "ngram"),
        or refuses them (the draft model proposes, and would silently ignore them)."""
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if self.method != "ngram":
            for name, value in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
                if value is not None:
                    raise ValueError(
                        f"speculative_config.{name}={value!r} applies to method='ngram' only, "
                        f"not {self.method!r}: leave it unset"
                    )
            return
        for name, value in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if value is not None:  # the value given, named as given
                check_int(f"speculative_config.{name}", value, lo=1)
        if lo is None and hi is None:
            lo, hi = 2, 5
        lo, hi = (hi if lo is None else lo), (lo if hi is None else hi)
        check_int("speculative_config.prompt_lookup_min", lo, lo=1)
        check_int("speculative_config.prompt_lookup_max", hi, lo=1)
        if lo > hi:
            raise ValueError(
                f"speculative_config.prompt_lookup_min={lo} exceeds prompt_lookup_max={hi}"
            )
        object.__setattr__(self, "prompt_lookup_min", lo)
        object.__setattr__(self, "prompt_lookup_max", hi)

    @classmethod
    def of(cls, value: SpeculativeConfig | Mapping[str, Any] | None) -> SpeculativeConfig | None:
        """`value` as a config: a dict of its fields (vLLM's form), itself, or None;
        an unknown key is a ValueError naming it."""
        return dataclass_of(cls, value, "speculative_config")


class _SeqState:
    """One sequence's proposer and acceptance record."""

    __slots__ = ("accepted", "paused_until", "pauses", "proposer", "rejected")

    def __init__(self, proposer: NgramProposer | None) -> None:
        self.proposer = proposer
        self.accepted = 1.0  # decayed counts of accepted proposals and of rejections
        self.rejected = 0.0
        self.paused_until = 0
        self.pauses = 0

    def depth(self, k: int, floor: float) -> int:
        """Proposals worth making: the positions j <= k with alpha**j >= floor."""
        alpha = self.accepted / (self.accepted + self.rejected)
        if floor <= 0 or alpha >= 1:
            return k
        if alpha < floor - 1e-9:
            return 0
        return max(1, min(k, int(math.log(floor) / math.log(alpha) + 1e-9)))


class Speculator:
    """Proposes tokens for decoding sequences and keeps the counts (vLLM's metric
    names: drafts, draft tokens, accepted tokens, accepted per position).

    Args:
      config: the settings.
      token_buckets: the step's token buckets (`paxkv.host.batch.Buckets.tokens`).
      optimistic: proposals are recorded as accepted before their verdict is read
        (async scheduling, `record_proposed`): a sequence then proposes at most its
        remaining tokens - 2, and none with penalties (its history on the device would
        miss the accepted tokens the host has not read).
    """

    def __init__(
        self, config: SpeculativeConfig, token_buckets: tuple[int, ...], *, optimistic: bool = False
    ) -> None:
        self.config = config
        self.optimistic = optimistic
        self.num_speculative_tokens = config.num_speculative_tokens
        self.token_buckets = token_buckets
        self._seqs: weakref.WeakKeyDictionary[SequenceState, _SeqState] = (
            weakref.WeakKeyDictionary()
        )
        self._step = 0
        # Every sequence's drafts, decayed by GLOBAL_DECAY each: a new sequence's
        # first estimate of alpha (the workload's, rather than 1).
        self._accepted, self._rejected = 1.0, 0.0
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        k = self.num_speculative_tokens
        self.accepted_per_position = [0] * k  # drafts whose position i was accepted
        self.drafts_per_position = [0] * k  # drafts that proposed position i

    def new_step(self, num_running: int) -> bool:
        """Starts a step's planning; whether sequences may speculate in it."""
        self._step += 1
        limit = self.config.disable_by_batch_size
        return limit is None or num_running <= limit

    def spare_tokens(self, planned: int, budget: int) -> int:
        """Tokens proposals may add to a step of `planned` tokens with `budget` left."""
        if self.config.grow_token_bucket:
            return budget
        bucket = next((b for b in self.token_buckets if b >= planned), planned)
        return max(0, min(budget, bucket - planned))

    def propose(self, seq: SequenceState, max_tokens: int) -> tuple[int, ...]:
        """Up to `min(k, max_tokens)` proposed tokens after `seq`'s last one; empty when
        it is paused or the lookup finds nothing. With a draft model, rows for that
        many proposals (zeros: the draft fills them on the device)."""
        n = min(self.num_speculative_tokens, max_tokens - self.optimistic)
        if n <= 0 or (self.optimistic and seq.penalised):
            return ()
        state = self._seqs.get(seq)
        if state is None:
            c = self.config
            proposer = (
                NgramProposer(c.prompt_lookup_min, c.prompt_lookup_max)
                if c.method == "ngram"
                else None
            )
            state = self._seqs[seq] = _SeqState(proposer)
            state.accepted, state.rejected = self._accepted, self._rejected
            # Wait for the next probe.
            if state.depth(self.num_speculative_tokens, c.min_acceptance) == 0:
                state.paused_until = -(-(self._step + 1) // PAUSE_STEPS) * PAUSE_STEPS
                state.accepted, state.rejected = c.min_acceptance, 1 - c.min_acceptance
        if self._step < state.paused_until:
            return ()
        n = min(n, state.depth(self.num_speculative_tokens, self.config.min_acceptance))
        if n <= 0:
            return ()
        if state.proposer is None:  # a draft model proposes on the device: rows only
            return (0,) * n
        proposer, total = state.proposer, seq.num_tokens
        if len(proposer) < total:  # the tokens accepted since its last proposal
            proposer.extend(seq.token_ids(len(proposer), total))
        return tuple(proposer.propose(n))

    def on_verified(self, seq: SequenceState, num_proposed: int, num_accepted: int) -> None:
        """Counts a verified draft of `seq` and applies the adaptive rule."""
        rejected = num_accepted < num_proposed
        self._accepted = GLOBAL_DECAY * self._accepted + num_accepted
        self._rejected = GLOBAL_DECAY * self._rejected + rejected
        self.num_drafts += 1
        self.num_draft_tokens += num_proposed
        self.num_accepted_tokens += num_accepted
        for i in range(num_proposed):
            self.drafts_per_position[i] += 1
            if i < num_accepted:
                self.accepted_per_position[i] += 1
        state = self._seqs.get(seq)
        if state is None:
            return
        state.accepted = DECAY * state.accepted + num_accepted
        state.rejected = DECAY * state.rejected + rejected
        floor = self.config.min_acceptance
        # Pause, then probe with one proposal.
        if state.depth(self.num_speculative_tokens, floor) == 0:
            until = self._step + PAUSE_STEPS * 2 ** min(state.pauses, MAX_PAUSE_DOUBLINGS)
            # Rounded up to a multiple of PAUSE_STEPS: paused sequences probe in the
            # same steps, so most steps have no proposal at all (the cheaper variant).
            state.paused_until = -(-until // PAUSE_STEPS) * PAUSE_STEPS
            state.pauses += 1
            state.accepted, state.rejected = floor, 1 - floor
        elif num_accepted:
            state.pauses = 0

    def stats(self) -> dict[str, Any]:
        """The counts so far: drafts, draft and accepted tokens, and per position the
        drafts that reached it and those accepted there; with the rates `spec_rates`
        derives from them."""
        counts = {
            "spec_decode_num_drafts": self.num_drafts,
            "spec_decode_num_draft_tokens": self.num_draft_tokens,
            "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
            "spec_decode_num_drafts_per_pos": list(self.drafts_per_position),
            "spec_decode_num_accepted_tokens_per_pos": list(self.accepted_per_position),
        }
        return counts | spec_rates(counts)


def spec_rates(counts: dict[str, Any]) -> dict[str, Any]:
    """The acceptance rate (accepted / proposed tokens), the mean accepted length
    (tokens emitted per draft: accepted + 1) and the acceptance rate per position, from
    `Speculator.stats`'s counts (or their sums over several engines)."""
    drafts, proposed = counts["spec_decode_num_drafts"], counts["spec_decode_num_draft_tokens"]
    accepted = counts["spec_decode_num_accepted_tokens"]
    per_pos = zip(
        counts["spec_decode_num_accepted_tokens_per_pos"],
        counts["spec_decode_num_drafts_per_pos"],
        strict=True,
    )
    return {
        "spec_decode_acceptance_rate": accepted / proposed if proposed else 0.0,
        "spec_decode_mean_accepted_length": 1 + accepted / drafts if drafts else 0.0,
        "spec_decode_acceptance_per_position": [a / d if d else 0.0 for a, d in per_pos],
    }


def add_proposals(
    chunks: list[ScheduledChunk],
    spare: int,
    speculator: Speculator,
    kv: KVCacheManager,
    *,
    max_model_len: int,
    fail: Callable[[SequenceState, BaseException], None],
    allowed_prefix: Callable[[SequenceState, tuple[int, ...]], int] | None = None,
) -> int:
    """Gives the decodes of a planned step their proposals out of `spare` tokens
    (`Speculator.spare_tokens`), shared evenly in plan order, and the pool's free pages
    (module docstring); replaces those chunks in `chunks` and returns the tokens used. A
    sequence whose proposal raises fails alone (`fail`) and leaves the step.

    A constrained sequence (structured outputs) keeps the leading proposals its
    constraint allows (`allowed_prefix(seq, proposals)`, its matcher up to date: n-gram
    proposals of a synchronous engine); without `allowed_prefix` (a draft model, whose
    proposals are made on the device, or async scheduling) it takes none."""
    ps = kv.page_size
    decodes = [
        i
        for i, c in enumerate(chunks)
        # not after a prefill, nor constrained unless its proposals can be checked
        if c.num_tokens == 1
        and c.samples
        and c.num_output_tokens
        and (allowed_prefix is not None or not c.seq.constrained)
    ]
    used = 0
    for n, i in enumerate(decodes):
        share = -(-(spare - used) // (len(decodes) - n))  # an even share of what is left
        if share <= 0:
            break
        c = chunks[i]
        seq = c.seq
        try:
            drafts = speculator.propose(seq, min(share, seq.remaining_tokens(max_model_len) - 1))
            if drafts and seq.constrained:
                drafts = drafts[: allowed_prefix(seq, drafts)]
            if not drafts:
                continue
            end = c.start + 1 + len(drafts)
            if kv.needs_pages(seq, end) and not kv.allocate(seq, end):
                continue  # no free pages: this step decodes it plainly
        except Exception as e:  # isolated: only seq fails
            fail(seq, e)
            continue
        chunks[i] = c._replace(
            num_tokens=1 + len(drafts),
            token_ids=(*c.token_ids, *drafts),
            num_pages=cdiv(end, ps),
            num_draft=len(drafts),
        )
        used += len(drafts)
    return used


def record_proposed(
    speculator: Speculator,
    kv: KVCacheManager,
    chunk: ScheduledChunk,
    placeholders: list[tuple],
    eos_token_ids: tuple[int, ...],
    max_model_len: int,
    now: float,
) -> FinishReason | None:
    """Records a speculative chunk dispatched with its verdict unknown (async
    scheduling) as if every proposal were accepted: its cache holds its last known
    token and the proposals, and its outputs take `placeholders` (one per proposal and
    one for the target's token) until `Scheduler.resolve_verified`. Proposals stop two
    tokens short of the sequence's limits then (`Speculator.optimistic`), so this never
    ends a sequence that a rejection would continue."""
    seq = chunk.seq
    seq.num_computed_tokens = chunk.end
    seq.num_unverified = chunk.num_draft
    reason = None
    for r in placeholders:
        reason = seq.record_sample(r[0], r[1], None, eos_token_ids, max_model_len, now)
        if reason is not None:
            break
    return reason


def record_verified(
    speculator: Speculator,
    kv: KVCacheManager,
    chunk: ScheduledChunk,
    results: list[tuple],
    eos_token_ids: tuple[int, ...],
    max_model_len: int,
    now: float,
) -> FinishReason | None:
    """Records a speculative chunk's emitted tokens (`Scheduler.update`: its accepted
    proposals, then the target's token, each `(token, logprob[, top-k])`) until one ends
    the sequence, and returns why it ended (or None). Its cache then holds its last known
    token and the accepted proposals; pages taken for rejected ones go back to the pool."""
    seq = chunk.seq
    accepted = len(results) - 1
    speculator.on_verified(seq, chunk.num_draft, accepted)
    seq.num_computed_tokens = end = chunk.start + 1 + accepted
    if kv.needs_registering(seq, end):
        kv.register_full_pages(seq)
    for r in results:
        top = r[2] if len(r) > 2 else None
        reason = seq.record_sample(r[0], r[1], top, eos_token_ids, max_model_len, now)
        if reason is not None:
            return reason
    kv.trim(seq, seq.num_tokens)
    return None
