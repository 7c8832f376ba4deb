"""The running sequences whose outputs follow a constraint (`StructuredOutputs`), each
with its matcher: what keeps the matchers in step with the outputs. No JAX.

A matcher (llguidance's `LLMatcher`, made by `paxkv.text.grammar.GrammarCompiler`)
consumes each real output token once the host has read it (`sync`, after every step
is recorded), so before each sampling it stands where the output does. A constraint
that is complete and allows nothing more ends its sequence there, finish reason
"stop"; a token it refuses (which the mask should have prevented) fails the sequence
alone.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from paxkv.host.queues import SequenceQueues
from paxkv.host.sequence import SeqStatus, SequenceState
from paxkv.host.step_plan import SchedulerOutput

# Feeds (matcher, token) pairs at once; whether each was taken.
Consume = Callable[[Sequence[tuple[Any, int]]], list[bool]]


@dataclasses.dataclass(eq=False)
class _Entry:
    seq: SequenceState
    matcher: Any
    consumed: int = 0  # output tokens the matcher has consumed
    ending: bool = False  # allows no token of the model's: ends at the next sync


class ConstrainedSequences:
    """The constrained sequences that have not ended, by `id(seq)`."""

    def __init__(self) -> None:
        self._entries: dict[int, _Entry] = {}

    def __bool__(self) -> bool:
        return bool(self._entries)

    def add(self, seq: SequenceState, matcher: Any) -> None:
        """Tracks `seq`, whose matcher stands at the start of its output."""
        self._entries[id(seq)] = _Entry(seq, matcher)

    def allowed_prefix(self, seq: SequenceState, tokens: Sequence[int]) -> int:
        """How many leading `tokens` seq's constraint allows after its outputs so far (its
        matcher up to date: the host has read every token, as before a synchronous step's
        plan); 0 when it is not constrained."""
        entry = self._entries.get(id(seq))
        if entry is None or entry.ending or entry.consumed != len(seq.output_token_ids):
            return 0
        return entry.matcher.validate_tokens(list(tokens))

    def sync(self, queues: SequenceQueues, consume: Consume | None = None) -> list[SequenceState]:
        """Feeds each matcher the real output tokens it has not seen (up to the first
        placeholder of a step in flight), and ends the sequences whose constraint is
        complete (`SequenceQueues.stop` after the token that completed it) or that a
        mask left nothing to sample; a token the matcher refuses fails its sequence.
        Forgets the sequences that ended. Returns those it ended or failed.

        `consume(pairs)` feeds `(matcher, token)` pairs at once (llguidance's threads,
        `GrammarCompiler.consume`) and returns whether each was taken; None: one by one.
        """
        ended: list[SequenceState] = []
        pending: list[tuple[_Entry, list[int]]] = []  # the new tokens of each
        for key, e in list(self._entries.items()):
            seq = e.seq
            if seq.status is SeqStatus.FINISHED:
                del self._entries[key]
                continue
            out = seq.output_token_ids
            real = len(out)
            while real > e.consumed and out[real - 1] < 0:
                real -= 1
            if real < e.consumed:  # outputs cut back (not by an end): the matcher too
                e.matcher.rollback(e.consumed - real)
                e.consumed = real
            if e.ending:
                self._stop(queues, e, e.consumed, ended)
            elif real > e.consumed:
                pending.append((e, out[e.consumed : real]))
        # One token each, the common case: all at once (one by one if that raises).
        single = [(e, t[0]) for e, t in pending if len(t) == 1] if consume else []
        results: dict[int, bool] = {}
        if single:
            try:
                taken = consume([(e.matcher, t) for e, t in single])
                results = {id(e): ok for (e, _), ok in zip(single, taken, strict=True)}
            except Exception:
                results = {}
        for e, tokens in pending:
            for i, token in enumerate(tokens):
                try:
                    if i == 0 and id(e) in results:
                        ok = results.pop(id(e))
                    else:
                        ok = e.matcher.consume_token(token)
                    error = None if ok else e.matcher.get_error()
                except Exception as exc:  # isolated: only this sequence fails
                    error = f"{type(exc).__name__}: {exc}"
                if error is not None:
                    queues.fail(
                        e.seq,
                        ValueError(
                            f"output token {token} at {e.consumed} breaks its "
                            f"structured_outputs constraint: {error}"
                        ),
                    )
                    del self._entries[id(e.seq)]
                    ended.append(e.seq)
                    break
                e.consumed += 1
                if e.matcher.is_stopped():
                    self._stop(queues, e, e.consumed, ended)
                    break
        return ended

    def _stop(self, queues: SequenceQueues, e: _Entry, at: int, ended: list[SequenceState]) -> None:
        """Ends e's sequence after its first `at` outputs: its constraint is complete."""
        e.seq.constraint_done = True
        queues.stop(e.seq, at)
        del self._entries[id(e.seq)]
        ended.append(e.seq)

    def sampling(self, plan: SchedulerOutput) -> list[tuple[int, Any, SequenceState, tuple]]:
        """`(row, matcher, seq, proposals)` of each of `plan`'s constrained sequences
        that samples in its step and still runs, row its index among the step's
        sequences and proposals its speculative tokens in the step (`allowed_prefix`)."""
        if not self._entries:
            return []
        entries = self._entries
        rows = []
        nd = plan.num_decode
        if plan.decode is not None:
            for i, seq in enumerate(plan.decode.seqs):
                e = entries.get(id(seq))
                if e is not None and seq.status is SeqStatus.RUNNING:
                    rows.append((i, e.matcher, seq, ()))
        for j, c in enumerate(plan.extra):
            e = entries.get(id(c.seq))
            if e is not None and c.samples and c.seq.status is SeqStatus.RUNNING:
                drafts = tuple(c.token_ids[len(c.token_ids) - c.num_draft :]) if c.num_draft else ()
                rows.append((nd + j, e.matcher, c.seq, drafts))
        return rows

    def end_after(self, seqs: Iterable[SequenceState]) -> None:
        """Marks `seqs` (whose constraint allows none of the model's tokens: only an EOS
        the model has not got) to end at the next `sync`, before what they sample now."""
        for seq in seqs:
            e = self._entries.get(id(seq))
            if e is not None:
                e.ending = True
