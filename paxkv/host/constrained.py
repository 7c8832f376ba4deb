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
from collections.abc import Iterable
from typing import Any

from paxkv.host.queues import SequenceQueues
from paxkv.host.sequence import SeqStatus, SequenceState
from paxkv.host.step_plan import SchedulerOutput


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

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, seq: SequenceState, matcher: Any) -> None:
        """Tracks `seq`, whose matcher stands at the start of its output."""
        self._entries[id(seq)] = _Entry(seq, matcher)

    def matcher(self, seq: SequenceState) -> Any | None:
        """seq's matcher, or None when seq is not constrained (or has ended)."""
        entry = self._entries.get(id(seq))
        return None if entry is None else entry.matcher

    def sync(self, queues: SequenceQueues) -> list[SequenceState]:
        """Feeds each matcher the real output tokens it has not seen (up to the first
        placeholder of a step in flight), and ends the sequences whose constraint is
        complete (`SequenceQueues.stop` after the token that completed it) or that a
        mask left nothing to sample; a token the matcher refuses fails its sequence.
        Forgets the sequences that ended. Returns those it ended or failed."""
        ended = []
        for key, e in list(self._entries.items()):
            seq = e.seq
            if seq.status is SeqStatus.FINISHED:
                del self._entries[key]
                continue
            out = seq.output_token_ids
            real = len(out)
            while real > e.consumed and out[real - 1] < 0:
                real -= 1
            m = e.matcher
            if real < e.consumed:  # outputs cut back (not by an end): the matcher too
                m.rollback(e.consumed - real)
                e.consumed = real
            stop_at = e.consumed if e.ending else None
            while stop_at is None and e.consumed < real:
                token = out[e.consumed]
                if not m.consume_token(token):
                    queues.fail(
                        seq,
                        ValueError(
                            f"output token {token} at {e.consumed} breaks its "
                            f"structured_outputs constraint: {m.get_error()}"
                        ),
                    )
                    break
                e.consumed += 1
                if m.is_stopped():
                    stop_at = e.consumed
            if seq.status is SeqStatus.FINISHED:  # failed
                del self._entries[key]
                ended.append(seq)
            elif stop_at is not None:
                seq.constraint_done = True
                queues.stop(seq, stop_at)
                del self._entries[key]
                ended.append(seq)
        return ended

    def sampling(self, plan: SchedulerOutput) -> list[tuple[int, Any, SequenceState]]:
        """`(row, matcher, seq)` of each of `plan`'s constrained sequences that samples
        in its step and still runs, row its index among the step's sequences."""
        if not self._entries:
            return []
        entries = self._entries
        rows = []
        nd = plan.num_decode
        if plan.decode is not None:
            for i, seq in enumerate(plan.decode.seqs):
                e = entries.get(id(seq))
                if e is not None and seq.status is SeqStatus.RUNNING:
                    rows.append((i, e.matcher, seq))
        for j, c in enumerate(plan.extra):
            e = entries.get(id(c.seq))
            if e is not None and c.samples and c.seq.status is SeqStatus.RUNNING:
                rows.append((nd + j, e.matcher, c.seq))
        return rows

    def end_after(self, seqs: Iterable[SequenceState]) -> None:
        """Marks `seqs` (whose constraint allows none of the model's tokens: only an EOS
        the model has not got) to end at the next `sync`, before what they sample now."""
        for seq in seqs:
            e = self._entries.get(id(seq))
            if e is not None:
                e.ending = True
