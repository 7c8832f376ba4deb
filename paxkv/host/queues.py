"""Where each sequence is (waiting, running, ended) and how it ends. No JAX.

`SequenceQueues` keeps the queues and every transition out of them: finishing (stop,
length, abort), failing one sequence without touching the others, and resolving the
placeholder tokens of async scheduling. The scheduler (`paxkv.host.scheduler`) adds the
planning on top: which of these sequences run in the next step.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Iterable

from paxkv.host.kv_cache_manager import KVCacheManager
from paxkv.host.request import FinishReason
from paxkv.host.sequence import SeqStatus, SequenceState, TopLogprobs


class SequenceQueues:
    """The waiting queue (first come, first admitted) and the running list (in order of
    precedence) over `kv_cache_manager`, which frees what an ended sequence holds."""

    def __init__(self, kv_cache_manager: KVCacheManager) -> None:
        self.kv_cache_manager = kv_cache_manager
        self.waiting: deque[SequenceState] = deque()
        self.running: list[SequenceState] = []
        self._failed: list[tuple[SequenceState, str]] = []
        # Changes when a running sequence is preempted: what the running decodes' columns
        # cannot absorb (an ended sequence they drop, a resolved placeholder they read
        # from the device).
        self.version = 0
        # Running sequences that ended: how many ever, and the persistent-batch rows of
        # those since the running decodes last took them (`RunningDecodes.plan`): what it
        # drops from its columns without asking each sequence.
        self.num_departures = 0
        self._departed_rows: list[int] = []

    def add(self, seq: SequenceState) -> None:
        """Queues a validated sequence (see `check_fits`). With prefix caching its
        prompt's page keys are computed now, on arrival, not in a step (as vLLM hashes
        a request's blocks when it makes the request)."""
        cache = self.kv_cache_manager.prefix_cache
        if cache.enabled:
            cache.prompt_keys(seq)
        self.waiting.append(seq)

    def take_departed_rows(self) -> list[int]:
        """The persistent-batch rows of the running sequences that ended since the last
        call (what the running decodes drop from their columns); forgets them."""
        rows, self._departed_rows = self._departed_rows, []
        return rows

    def departed_rows(self) -> list[int]:
        """The rows `take_departed_rows` would take, left in place."""
        return self._departed_rows

    def has_unfinished(self) -> bool:
        """Whether any sequence is waiting or running."""
        return bool(self.waiting or self.running)

    def resolve(
        self,
        seq: SequenceState,
        index: int,
        token: int,
        logprob: float,
        eos_token_ids: tuple[int, ...],
        now: float,
        top: TopLogprobs | None = None,
    ) -> None:
        """Puts the real value of output `index` of `seq`, recorded by `update` as a
        placeholder (async scheduling), and ends the sequence there if it is a stop token:
        later placeholders are dropped, and a sequence already finished by length gets
        finish reason "stop", as it would have without the placeholder."""
        if seq.finish_reason is FinishReason.ABORT:
            return
        if seq.resolve_output(index, token, logprob, top, eos_token_ids, now):
            self.end_stopped(seq, now)

    def _depart(self, seq: SequenceState) -> None:
        """Notes that running `seq` ends now (before its pages and row are freed)."""
        self.num_departures += 1
        with contextlib.suppress(KeyError):  # KeyError: it holds no row
            self._departed_rows.append(self.kv_cache_manager.row(seq))

    def finish(self, seq: SequenceState, reason: FinishReason, now: float) -> None:
        """Ends running or waiting `seq` at time `now` with `reason` and frees its pages."""
        if seq.status is SeqStatus.RUNNING:
            self._depart(seq)
        self.kv_cache_manager.free(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        seq.finished_time = now
        if seq in self.running:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)

    def stop(self, seq: SequenceState, num_output_tokens: int) -> None:
        """Ends `seq` with finish reason "stop" after its first `num_output_tokens`
        outputs (a stop string matched on the text): later tokens, placeholders of a step
        in flight included, are dropped. A sequence already ended keeps its pages freed
        and takes reason "stop" unless it was aborted."""
        if seq.finish_reason is FinishReason.ABORT:
            return
        seq.truncate_outputs(num_output_tokens)
        self.end_stopped(seq, time.monotonic())

    def end_stopped(self, seq: SequenceState, now: float) -> None:
        """Ends `seq`, whose outputs end at a stop, with reason "stop" (one that already
        ended keeps its pages freed and takes the reason)."""
        if seq.status is SeqStatus.FINISHED:
            seq.finish_reason = FinishReason.STOP
        else:
            self.finish(seq, FinishReason.STOP, now)

    def fail(self, seq: SequenceState, error: BaseException | str) -> None:
        """Ends `seq` (finish reason "abort") because something tied to it failed, frees
        what it holds, and records why for `take_failed`. Safe on a sequence caught
        half-way through scheduling: whatever pages it took go back."""
        if seq.status is SeqStatus.FINISHED:  # ended, but its output failed: not a success
            seq.finish_reason = FinishReason.ABORT
        else:
            if seq.status is SeqStatus.RUNNING:
                self._depart(seq)
            self.kv_cache_manager.free(seq)
            seq.status = SeqStatus.FINISHED
            seq.finish_reason = FinishReason.ABORT
            seq.finished_time = time.monotonic()
            if seq in self.running:
                self.running.remove(seq)
            if seq in self.waiting:
                self.waiting.remove(seq)
        message = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        self._failed.append((seq, message))

    def take_failed(self) -> list[tuple[SequenceState, str]]:
        """The sequences `fail` ended since the last call, with why; forgets them."""
        failed, self._failed = self._failed, []
        return failed

    def abort(self, seqs: Iterable[SequenceState]) -> None:
        """Ends these sequences now and frees everything they hold."""
        now = time.monotonic()
        for seq in seqs:
            if seq.status is not SeqStatus.FINISHED:
                self.finish(seq, FinishReason.ABORT, now)
