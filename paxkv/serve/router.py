"""Which data-parallel replica serves a request: prefix-aware, or round robin. No JAX.

A replica reuses the KV pages of a prompt prefix it has computed before (its prefix
cache), so sending requests that share a prefix to the same replica saves their prefill.
`PrefixRouter` keeps, per replica, the keys of the full pages of the prompts it sent
there (`paxkv.host.prefix_cache.page_keys`: the same chain of page hashes, with the
request's `cache_salt`, that the replica's cache uses), in LRU order and bounded by the
replica's page count, as SGLang's cache-aware router keeps its approximate tree: it
reads no replica's state, so routing never waits for a step.

The rule (`PrefixRouter.choose`), over the replicas that are alive:

1. the replica whose routed pages match the longest run of the prompt's leading full
   pages (ties: the less loaded, then the lower index), if that run is at least one
   page and the replica's load is within `balance_slack` sequences of the least loaded
   replica's;
2. else the least loaded replica (ties: the next one after the last replica chosen
   this way, so an idle set fills evenly).

Load is a replica's unfinished sequences (queued or running). The index is what was
sent, not what is cached: a replica may since have evicted the pages (a miss costs a
prefill, nothing else).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Hashable, Sequence

from paxkv.host.prefix_cache import page_keys

ROUTERS = ("prefix", "round_robin")  # the `--router` choices


@dataclasses.dataclass(frozen=True)
class Route:
    """A routing decision: the replica, the rule that chose it ("prefix",
    "least_loaded", "round_robin"), and the leading pages it was matched on."""

    replica: int
    rule: str
    matched_pages: int = 0


class RoundRobinRouter:
    """Each request to the next live replica in turn; prefixes are ignored."""

    def __init__(self, num_replicas: int) -> None:
        self.num_replicas = num_replicas
        self._next = 0

    def choose(
        self, token_ids: Sequence[int], salt: Hashable, loads: Sequence[int | None]
    ) -> Route:
        """The next replica after the last one chosen whose load is not None (None:
        dead or full); ValueError when every one is None."""
        for i in range(self.num_replicas):
            r = (self._next + i) % self.num_replicas
            if loads[r] is not None:
                self._next = r + 1
                return Route(r, "round_robin")
        raise ValueError("no replica can take the request")

    def routed(self, replica: int, token_ids: Sequence[int], salt: Hashable) -> None:
        """Records that `token_ids` went to `replica` (nothing to record)."""

    def forget(self, replica: int) -> None:
        """Forgets `replica`'s history (there is none)."""


class PrefixRouter:
    """The prefix-aware rule of the module docstring.

    Args:
      num_replicas: replicas behind the router.
      page_size: tokens per KV page (the replicas' `EngineConfig.page_size`).
      capacity_pages: pages remembered per replica (its pool's pages): older routed
        pages are forgotten first, as the replica's cache would evict them.
      balance_slack: how many more unfinished sequences than the least loaded replica
        a replica may hold and still get a request by prefix.
    """

    def __init__(
        self, num_replicas: int, *, page_size: int, capacity_pages: int, balance_slack: int
    ) -> None:
        if num_replicas < 1 or page_size < 1 or capacity_pages < 1 or balance_slack < 0:
            raise ValueError(
                f"{num_replicas=}, {page_size=}, {capacity_pages=} must be >= 1 and "
                f"{balance_slack=} >= 0"
            )
        self.num_replicas = num_replicas
        self.page_size = page_size
        self.capacity_pages = capacity_pages
        self.balance_slack = balance_slack
        # Per replica: hashes of the page keys routed there, least recent first.
        self._pages: list[collections.OrderedDict[int, None]] = [
            collections.OrderedDict() for _ in range(num_replicas)
        ]
        self._next = 0  # where the least-loaded rule's tie-break starts

    def _hashes(self, token_ids: Sequence[int], salt: Hashable) -> list[int]:
        return [hash(k) for k in page_keys(token_ids, self.page_size, salt=salt)]

    def matched_pages(self, replica: int, hashes: Sequence[int]) -> int:
        """How many of the leading page hashes `hashes` were routed to `replica`."""
        pages = self._pages[replica]
        n = 0
        while n < len(hashes) and hashes[n] in pages:
            n += 1
        return n

    def choose(
        self, token_ids: Sequence[int], salt: Hashable, loads: Sequence[int | None]
    ) -> Route:
        """The replica for a prompt of `token_ids` with `cache_salt` `salt`, given each
        replica's load (None: dead or full, never chosen); ValueError if all are None."""
        live = [r for r, load in enumerate(loads) if load is not None]
        if not live:
            raise ValueError("no replica can take the request")
        least = min(loads[r] for r in live)
        hashes = self._hashes(token_ids, salt)
        if hashes:
            matched = {r: self.matched_pages(r, hashes) for r in live}
            best = max(live, key=lambda r: (matched[r], -loads[r], -r))
            if matched[best] > 0 and loads[best] - least <= self.balance_slack:
                return Route(best, "prefix", matched[best])
        for i in range(self.num_replicas):
            r = (self._next + i) % self.num_replicas
            if loads[r] is not None and loads[r] == least:
                self._next = r + 1
                return Route(r, "least_loaded")
        raise AssertionError("unreachable: a live replica has the least load")

    def routed(self, replica: int, token_ids: Sequence[int], salt: Hashable) -> None:
        """Records the full pages of `token_ids` as held by `replica` (most recent)."""
        pages = self._pages[replica]
        for h in self._hashes(token_ids, salt):
            pages[h] = None
            pages.move_to_end(h)
        while len(pages) > self.capacity_pages:
            pages.popitem(last=False)

    def forget(self, replica: int) -> None:
        """Drops everything recorded for `replica` (it failed: its cache is gone)."""
        self._pages[replica].clear()


def make_router(
    name: str, num_replicas: int, *, page_size: int, capacity_pages: int, balance_slack: int
) -> PrefixRouter | RoundRobinRouter:
    """The router `name` (one of `ROUTERS`); ValueError naming it otherwise."""
    if name == "prefix":
        return PrefixRouter(
            num_replicas,
            page_size=page_size,
            capacity_pages=capacity_pages,
            balance_slack=balance_slack,
        )
    if name == "round_robin":
        return RoundRobinRouter(num_replicas)
    raise ValueError(f"router={name!r} must be one of {ROUTERS}")
