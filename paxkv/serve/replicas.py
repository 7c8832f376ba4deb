"""Data-parallel replicas behind one front end: D engines, one router, one endpoint.

Each replica is an `Engine` on its own slice of devices (one `paxkv.sharding`
replica mesh) with its own stepping thread (`AsyncEngine`), scheduler, page pool and
prefix cache. `ReplicaSet` offers the HTTP app what one `AsyncEngine` does (`submit`,
`stats`, `sleep`, `wake_up`, `start`, `close`, `end_in_flight`, `dead`) and sends each
prompt of a request to the replica a router picks (`paxkv.serve.router`: prefix-aware by
default).

A replica that fails (its step raised: `AsyncEngine.dead`) takes no more requests, and
its requests in flight are not lost: a request nothing of which has reached the client
yet (any non-streamed request, whose outputs are held back until it finishes, and a
stream before its first chunk) runs again from its start on a live replica, under the
same id; a stream that has sent part of its output ends with an error (HTTP 503 event),
since what it sent cannot be taken back. Only when every replica has failed does the
set report itself dead.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import AsyncIterator, Sequence
from typing import Any

from absl import logging

from paxkv.engine import Engine, sleep
from paxkv.engine.metrics import merge_stats
from paxkv.host.request import RequestOutput
from paxkv.serve.frontend import AsyncEngine, EngineDead, QueueFull, RequestGroup, Submission
from paxkv.serve.router import Route, make_router


class ReplicaSet:
    """Serves several engines (one per replica) behind one router, to asyncio code.

    Args:
      engines: the replicas' engines, warmed up, with equal `page_size`; from now on
        only their stepping threads touch them.
      max_queued: sequences held beyond the replicas' `max_num_seqs` in all, waiting for
        a slot; spread evenly, each replica holds at most `max_num_seqs +
        ceil(max_queued / D)` unfinished sequences, and a prompt no live replica has
        room for is refused with `QueueFull` (HTTP 429).
      router: "prefix" (`PrefixRouter`) or "round_robin".
      balance_slack: the prefix rule's load slack in sequences (`PrefixRouter`); None:
        a replica's `max_num_seqs`, one batch.
    """

    def __init__(
        self,
        engines: Sequence[Engine],
        *,
        max_queued: int,
        router: str = "prefix",
        balance_slack: int | None = None,
    ) -> None:
        if not engines:
            raise ValueError("a ReplicaSet needs at least one engine")
        configs = [e.config for e in engines]
        if len({c.page_size for c in configs}) != 1:
            raise ValueError(f"replicas differ in page_size: {[c.page_size for c in configs]}")
        per_replica = -(-max_queued // len(engines))
        self.fronts = [
            AsyncEngine(e, max_unfinished=e.config.max_num_seqs + per_replica) for e in engines
        ]
        first = configs[0]
        self.router_name = router
        self.router = make_router(
            router,
            len(engines),
            page_size=first.page_size,
            # A replica keeps a prefix in its pool and in its host KV tier, if any.
            capacity_pages=max(1, min(_cached_pages(e) for e in engines)),
            balance_slack=first.max_num_seqs if balance_slack is None else balance_slack,
        )
        self.routed = [collections.Counter() for _ in engines]  # rule -> prompts sent
        self.retried = 0  # requests run again after their replica failed
        self.cut = 0  # streams ended early by their replica's failure
        # Sequences routed and not yet submitted to their front (a request's shares go
        # one after another): in the load the router balances before their front counts
        # them (while the front validates and queues them, both count them).
        self._pending = [0] * len(engines)
        self._forgotten: set[int] = set()  # failed replicas whose routes were dropped
        self._last_stats: list[dict[str, Any] | None] = [None] * len(engines)
        self._stopping = False

    @property
    def engines(self) -> list[Engine]:
        """The replicas' engines, in replica order."""
        return [f.engine for f in self.fronts]

    @property
    def dead(self) -> bool:
        """Whether no replica can take requests (all failed, or shutting down)."""
        return self._stopping or all(f.dead for f in self.fronts)

    @property
    def failed(self) -> bool:
        """Whether every replica has failed (not: the server is shutting down)."""
        return not self._stopping and all(f.dead for f in self.fronts)

    def start(self) -> None:
        """Starts every replica's stepping thread; call it from the serving event loop."""
        for f in self.fronts:
            f.start()

    async def close(self, timeout_s: float = 10.0) -> None:
        """Aborts what is unfinished and stops every stepping thread."""
        self._stopping = True
        await asyncio.gather(*(f.close(timeout_s) for f in self.fronts))

    def end_in_flight(self, reason: str) -> None:
        """Ends every request in flight on every replica (see `AsyncEngine.end_in_flight`)."""
        self._stopping = True
        for f in self.fronts:
            f.end_in_flight(reason)

    def fail_stuck(self, reason: str) -> None:
        """Fails every replica's requests in flight now, its stepping thread stuck (see
        `AsyncEngine.fail_stuck`); safe from any thread."""
        for f in self.fronts:
            f.fail_stuck(reason)

    async def submit(
        self, submissions: Sequence[Submission], *, stream: bool = True
    ) -> RoutedGroup:
        """Routes and queues the requests of one HTTP request, all or none; their outputs
        come through the returned group (held back until each request finishes unless
        `stream`, so that a failed replica's requests can run again unseen).

        Raises what `AsyncEngine.submit` raises: QueueFull when no live replica has
        room, EngineDead when none is alive, ValueError or TypeError for a request the
        engines reject.
        """
        group = RoutedGroup(self, submissions, stream=stream)
        await self._place(group, list(submissions))
        return group

    def _loads(self, extra: Sequence[int], seqs: int) -> list[int | None]:
        """Each replica's unfinished sequences, or None where it is dead or has no room
        for `seqs` more (`extra`: this request's sequences placed there already)."""
        loads: list[int | None] = []
        for i, f in enumerate(self.fronts):
            if f.dead:
                self._forget(i)
                loads.append(None)
                continue
            room = f.num_unfinished + extra[i] + seqs <= f.max_unfinished  # as `f` checks
            loads.append(f.num_unfinished + self._pending[i] + extra[i] if room else None)
        return loads

    def _forget(self, replica: int) -> None:
        if replica not in self._forgotten:
            self._forgotten.add(replica)
            self.router.forget(replica)
            logging.error("paxkv-serve: replica %d failed; routing around it", replica)

    def _route(self, submissions: Sequence[Submission]) -> list[tuple[int, Route]]:
        """The replica of each submission, placed one after another."""
        if self._stopping or all(f.dead for f in self.fronts):
            raise EngineDead("every replica has failed, or the server is shutting down")
        num_seqs = sum(s.params.n for s in submissions)
        most = sum(f.max_unfinished for f in self.fronts if not f.dead)
        if num_seqs > most:
            raise ValueError(
                f"the request has {num_seqs} sequences (prompts x n), and the server holds "
                f"at most {most} at once"
            )
        extra = [0] * len(self.fronts)
        routes = []
        for s in submissions:
            most = max(f.max_unfinished for f in self.fronts)
            if s.params.n > most:
                raise ValueError(
                    f"the request has {s.params.n} sequences (n), and a replica holds at "
                    f"most {most} at once"
                )
            loads = self._loads(extra, s.params.n)
            if all(load is None for load in loads):
                raise QueueFull(
                    "every replica holds as many unfinished sequences as it may: retry later"
                )
            route = self.router.choose(_token_ids(s), s.cache_salt, loads)
            extra[route.replica] += s.params.n
            routes.append((route.replica, route))
        return routes

    async def _place(self, group: RoutedGroup, submissions: list[Submission]) -> None:
        """Routes `submissions`, submits each replica's share, and starts draining them
        into `group`; all or none (the shares already queued are aborted on failure)."""
        routes = self._route(submissions)
        parts: dict[int, list[Submission]] = collections.defaultdict(list)
        for s, (replica, _) in zip(submissions, routes, strict=True):
            parts[replica].append(s)
        for replica, part in parts.items():
            self._pending[replica] += sum(s.params.n for s in part)
        placed: list[tuple[int, RequestGroup]] = []
        try:
            for replica, part in parts.items():
                placed.append((replica, await self.fronts[replica].submit(part)))
        except BaseException:
            for _, inner in placed:
                inner.abort()
            raise
        finally:
            for replica, part in parts.items():
                self._pending[replica] -= sum(s.params.n for s in part)
        for s, (replica, route) in zip(submissions, routes, strict=True):
            self.router.routed(replica, _token_ids(s), s.cache_salt)
            self.routed[replica][route.rule] += 1
        for replica, inner in placed:
            group.drain(replica, inner)

    @property
    def asleep(self) -> bool:
        """Whether a replica's engine sleeps (`sleep`)."""
        return any(f.asleep for f in self.fronts)

    async def sleep(
        self, level: int = 1, *, weights: str = "host", requests: str = "wait"
    ) -> list[dict[str, float]]:
        """Puts every live replica's engine to sleep (`AsyncEngine.sleep`); each one's
        {"released_bytes", "seconds"}, in replica order. ValueError, none put to sleep,
        for a bad argument or a replica asleep already."""
        sleep.check(level, weights, requests)
        if self.asleep:
            levels = [f.asleep for f in self.fronts]
            raise ValueError(f"the engine is asleep already (levels {levels}): wake_up first")
        live = [f for f in self.fronts if not f.dead]
        return list(
            await asyncio.gather(
                *(f.sleep(level, weights=weights, requests=requests) for f in live)
            )
        )

    async def add_lora(self, request: Any) -> None:
        """Loads a LoRA adapter on every live replica (`Engine.add_lora`); ValueError
        from the first that refuses it (the others then forget it)."""
        live = [f for f in self.fronts if not f.dead]
        results = await asyncio.gather(*(f.add_lora(request) for f in live), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            await self.remove_lora(request.lora_name)
            raise errors[0]

    async def remove_lora(self, name: str) -> bool:
        """Unloads adapter `name` on every live replica; whether any had it."""
        live = [f for f in self.fronts if not f.dead]
        return any(await asyncio.gather(*(f.remove_lora(name) for f in live)))

    async def wake_up(self) -> list[dict[str, float]]:
        """Wakes every live replica's engine (`AsyncEngine.wake_up`); each one's
        {"restored_bytes", "seconds"}, in replica order (zeros for one awake)."""
        live = [f for f in self.fronts if not f.dead]
        return list(await asyncio.gather(*(f.wake_up() for f in live)))

    async def stats(self) -> dict[str, Any]:
        """The replicas' stats summed (`paxkv.engine.metrics.merge_stats`), with each replica's
        under "replicas" (its last stats if it has failed; "routed": the prompts routed
        to it, by rule), whether each is up under "replicas_up", and the router's counts
        under "router"."""

        async def one(i: int) -> dict[str, Any] | None:
            if not self.fronts[i].dead:
                with contextlib.suppress(EngineDead):  # it failed meanwhile
                    self._last_stats[i] = await self.fronts[i].stats()
            return self._last_stats[i]

        per = await asyncio.gather(*(one(i) for i in range(len(self.fronts))))
        totals = merge_stats([s for s in per if s is not None])
        totals["replicas"] = [
            {**(s or {}), "routed": dict(self.routed[i])} for i, s in enumerate(per)
        ]
        totals["replicas_up"] = [not f.dead for f in self.fronts]
        totals["router"] = {
            "name": self.router_name,
            "retried_requests": self.retried,
            "cut_streams": self.cut,
        }
        return totals


def _token_ids(s: Submission) -> Sequence[int]:
    """The prompt's token ids the router reads (none for a text prompt: it routes by load)."""
    return s.prompt.get("prompt_token_ids", ()) if isinstance(s.prompt, dict) else ()


class RoutedGroup:
    """The requests of one HTTP request, spread over replicas: `RequestGroup`'s
    interface (iterate it for the delta outputs, `abort()` the unfinished ones)."""

    def __init__(
        self, replicas: ReplicaSet, submissions: Sequence[Submission], *, stream: bool
    ) -> None:
        self._replicas = replicas
        self._submissions = {s.request_id: s for s in submissions}
        self._stream = stream
        self.request_ids = tuple(s.request_id for s in submissions)
        self.unfinished = set(self.request_ids)
        self.outputs: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._where: dict[str, int] = {}  # request id -> its replica now
        self._started: set[str] = set()  # requests with an output handed on
        self._held: dict[str, list[RequestOutput]] = collections.defaultdict(list)
        self._aborted = False
        self._tasks: set[asyncio.Task] = set()

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        while self.unfinished:
            out = await self.outputs.get()
            if isinstance(out, BaseException):
                raise out
            if out.finished:
                self.unfinished.discard(out.request_id)
            yield out

    def abort(self) -> None:
        """Aborts the group's unfinished requests (a no-op once all have finished)."""
        self._aborted = True
        for rid in self.unfinished:
            if rid in self._where:
                self._replicas.fronts[self._where[rid]].abort(rid)

    def drain(self, replica: int, inner: RequestGroup) -> None:
        """Starts passing on the outputs of `inner`, queued on `replica`."""
        for rid in inner.request_ids:
            self._where[rid] = replica
        task = asyncio.ensure_future(self._drain(replica, inner))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _drain(self, replica: int, inner: RequestGroup) -> None:
        try:
            async for out in inner:
                self._take(out)
        except EngineDead as e:
            await self._replica_failed(replica, inner, e)
        except Exception as e:  # handed to the consumer, which raises it
            self.outputs.put_nowait(e)

    def _take(self, out: RequestOutput) -> None:
        rid = out.request_id
        if self._stream:
            self._started.add(rid)
            self.outputs.put_nowait(out)
            return
        self._held[rid].append(out)
        if out.finished:
            for held in self._held.pop(rid):
                self.outputs.put_nowait(held)

    async def _replica_failed(self, replica: int, inner: RequestGroup, error: EngineDead) -> None:
        """Runs `inner`'s unfinished requests again elsewhere if none has been seen,
        else ends the group with `error`."""
        lost = [rid for rid in inner.request_ids if rid in inner.unfinished]
        replicas = self._replicas
        if replicas._stopping or self._aborted or not lost:
            self.outputs.put_nowait(error)
            return
        if any(rid in self._started for rid in lost):
            replicas.cut += 1
            self.abort()
            self.outputs.put_nowait(
                EngineDead(f"replica {replica} failed after part of the stream was sent: {error}")
            )
            return
        for rid in lost:
            self._held.pop(rid, None)
        try:
            await replicas._place(self, [self._submissions[rid] for rid in lost])
        except (EngineDead, QueueFull) as e:
            self.outputs.put_nowait(EngineDead(f"replica {replica} failed, and {e}"))
            return
        replicas.retried += len(lost)
        if self._aborted:  # the client left while they were placed again
            self.abort()
        logging.warning(
            "paxkv-serve: %d request(s) of failed replica %d run again elsewhere",
            len(lost),
            replica,
        )


def _cached_pages(engine: Any) -> int:
    """Pages of prefixes `engine` can keep: its pool's usable pages and its host KV
    tier's slots."""
    tier = engine.scheduler.kv_cache_manager.host_tier
    return engine.config.num_pages - 1 + (tier.num_slots if tier is not None else 0)
