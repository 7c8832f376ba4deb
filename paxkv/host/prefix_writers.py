"""Same-step prefix sharing: which chunk of the plan writes each page registered ahead. No JAX.

The scheduler registers the full pages of a chunk in the prefix cache when it plans
the chunk, not when the step has run: the step writes each layer's K/V before any
attention reads them, so a sequence admitted later in the same step can take those
pages as its cached prefix. It then depends on the writer's chunk: if that chunk does
not run (its request failed or was aborted), the reader's must not either.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from paxkv.host.kv_cache_manager import KVCacheManager, register_decodes
from paxkv.host.sequence import SequenceState
from paxkv.host.step_plan import SchedulerOutput


class PrefixWriters:
    """The sequences writing the pages registered ahead in the plan being made."""

    def __init__(self, kv_cache_manager: KVCacheManager) -> None:
        self.kv_cache_manager = kv_cache_manager
        self._writers: dict[int, SequenceState] = {}  # page -> the sequence writing it

    def new_plan(self) -> None:
        """Forgets the writers of the last plan."""
        self._writers = {}

    def register(self, seq: SequenceState, end: int) -> None:
        """Caches the full pages of seq's planned chunk (to token `end`) now, and
        remembers that seq writes them."""
        kv = self.kv_cache_manager
        if kv.needs_registering(seq, end):
            for page in kv.register_full_pages(seq, end):
                self._writers[page] = seq

    def register_decodes(self, seqs: list[SequenceState], ends: list[int]) -> None:
        """`register` of decodes (`seqs[i]` to token `ends[i]`), each filling a page."""
        writers = self._writers
        for seq, pages in zip(
            seqs, register_decodes(self.kv_cache_manager, seqs, ends), strict=True
        ):
            for page in pages:
                writers[page] = seq

    def depends_on(self, seq: SequenceState) -> set[SequenceState]:
        """The sequences whose chunks in the current plan write pages `seq`'s prefix hits
        read: if one of those chunks does not run, seq's must not either."""
        writers = self._writers
        if not writers:
            return set()
        return {
            w
            for p in self.kv_cache_manager.held(seq)
            if (w := writers.get(p)) is not None and w is not seq
        }

    def prune(
        self, plan: SchedulerOutput, fail: Callable[[SequenceState, str], None]
    ) -> SchedulerOutput:
        """`plan` without the chunks of sequences that ended since it was made, and
        without those that read pages such a chunk was to write (`fail`ed: the prefix
        they share was never computed)."""
        pruned = plan.running()
        while pruned is not plan:
            plan = pruned
            ended = self._ended(c.seq for c in plan.chunks)
            if not ended:
                break
            for c in plan.chunks:
                if any(id(w) in ended for w in self.depends_on(c.seq)):
                    fail(
                        c.seq,
                        "the shared prefix it read was being computed by a request that failed",
                    )
            pruned = plan.running()
        return pruned

    def _ended(self, planned: Iterable[SequenceState]) -> set[int]:
        gone = {id(s) for s in planned}
        return {id(s) for s in self._writers.values() if id(s) not in gone}
