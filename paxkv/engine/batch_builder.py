"""The host batch of a planned step, with per-request failure isolation.

`paxkv.host.batch.build_host_batch` lays out a plan; here a chunk whose layout fails
fails its own request (`Scheduler.fail`) and leaves the step, and the others run.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

from paxkv.host.batch import Buckets, HostBatch, build_host_batch
from paxkv.host.scheduler import Scheduler, SchedulerOutput


class BatchBuilder:
    """Builds the host batches of `scheduler`'s plans.

    Args:
      scheduler: whose plans, and whose persistent batch holds their rows.
      page_size: tokens per page.
      buckets: the step's declared padded sizes.
      num_speculative_tokens: most speculative proposals a chunk may carry (0: none).
      eos_token_ids: the model's EOS tokens (`min_tokens` holds them back).
      mask_words: words of a token mask over the model's vocabulary (structured outputs).
    """

    def __init__(
        self,
        scheduler: Scheduler,
        *,
        page_size: int,
        buckets: Buckets,
        num_speculative_tokens: int = 0,
        eos_token_ids: tuple[int, ...] = (),
        mask_words: int = 0,
    ) -> None:
        self.scheduler = scheduler
        self.page_size = page_size
        self.buckets = buckets
        self.num_speculative_tokens = num_speculative_tokens
        self.eos_token_ids = eos_token_ids
        self.mask_words = mask_words

    def build_batch(
        self, plan: SchedulerOutput, pending: Mapping[int, int] | None = None
    ) -> tuple[SchedulerOutput, HostBatch | None]:
        """The host batch of `plan`: `pending` maps `id(seq)` to the row of the in-flight
        step's output that holds the token seq samples there (async scheduling).

        A chunk whose layout fails fails its sequence (`Scheduler.fail`) and leaves the
        step: returns the plan without it, and None for the batch if no chunk is left.
        A fault may show only on a later call (state a failed attempt left behind), so the
        chunks left are laid out again until the batch builds, each round failing at least
        one more chunk or raising (a fault no chunk shows alone is the step's).
        """
        build = functools.partial(
            build_host_batch,
            page_size=self.page_size,
            buckets=self.buckets,
            rows=self.scheduler.batch_rows,
            pending=pending,
            num_speculative_tokens=self.num_speculative_tokens,
            eos_token_ids=self.eos_token_ids,
            mask_words=self.mask_words,
        )
        while True:
            try:
                return plan, build(plan)
            except Exception:
                # The chunks that fail on their own; if none does, the fault is the step's.
                bad = []
                for c in plan.chunks:
                    try:
                        build(SchedulerOutput((c,), ()))
                    except Exception as e:
                        bad.append(c)
                        self.scheduler.fail(c.seq, e)
                if not bad:
                    raise
                plan = self.scheduler.prune(plan)
                if not plan.chunks:
                    return plan, None
