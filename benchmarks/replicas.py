"""Benchmark: data-parallel replicas behind one router, prefix-aware against round robin.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu \\
        python -m benchmarks.replicas --mesh=model:2,data:4
    python -m benchmarks.replicas --runner=fake --replicas=4 --step_ms=5

A shared-prefix workload (`--prefixes` system prompts of `--prefix_pages` full pages,
each followed by `--requests_per_prefix` distinct questions, shuffled) is sent by
`--concurrency` clients through a `paxkv.serve.replicas.ReplicaSet` (the server's front
end, without HTTP), three times in one run, side by side: over D replicas with the
prefix-aware router, over the same D with round robin, and over one replica. Each run
gets new engines (empty caches; the compiled steps are shared). Reported per run: the
prefix-cache hit rate (cached prompt tokens over prompt tokens looked up), the prompt
tokens computed, the prompts each replica got (balance: the largest over the mean),
generated tokens per second of wall time, and the router's own time per prompt
(`choose` and `routed`, p50 and p99).

`--runner=model` serves tiny-py on `--mesh` (D = its data axis; on the CPU force the
devices with XLA_FLAGS before the start, as above); `--runner=fake` serves fake-runner
engines (`paxkv.engine.fake_runner.FakeRunner`) whose steps sleep `--step_ms` (a stand-in
for device time that, like a device, frees the host meanwhile). Engines are warmed up
before any run.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import random
import time
from typing import Any

import numpy as np
from absl import app, flags

from paxkv.engine import Engine, EngineConfig
from paxkv.engine.fake_runner import FakeRunner
from paxkv.host.request import SamplingParams
from paxkv.serve.frontend import Submission
from paxkv.serve.replicas import ReplicaSet
from paxkv.sharding.mesh_shape import MeshShape

_RUNNER = flags.DEFINE_enum("runner", "model", ["model", "fake"], "What the replicas run.")
_MESH = flags.DEFINE_string("mesh", "model:2,data:4", "With --runner=model: the devices' mesh.")
_REPLICAS = flags.DEFINE_integer("replicas", 4, "With --runner=fake: replicas.", lower_bound=1)
_STEP_MS = flags.DEFINE_float("step_ms", 5.0, "With --runner=fake: each step's sleep.")
_PREFIXES = flags.DEFINE_integer("prefixes", 16, "Shared system prompts.", lower_bound=1)
_PREFIX_PAGES = flags.DEFINE_integer("prefix_pages", 4, "Full pages of each.", lower_bound=1)
_PER_PREFIX = flags.DEFINE_integer("requests_per_prefix", 8, "Requests per prefix.", lower_bound=1)
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 16, "Tokens generated per request.")
_CONCURRENCY = flags.DEFINE_integer("concurrency", 16, "Clients at once.", lower_bound=1)
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the workload.")
_JSON_OUT = flags.DEFINE_string("json_out", None, "Write the results as JSON here.")

CONFIG = EngineConfig(
    num_pages=512, page_size=16, max_num_seqs=8, max_num_batched_tokens=128, max_model_len=256
)


class TimedRouter:
    """A router that records the seconds of each of its calls."""

    def __init__(self, router: Any) -> None:
        self.router = router
        self.seconds: list[float] = []

    def choose(self, *args: Any) -> Any:
        """The wrapped router's choice, timed."""
        t0 = time.perf_counter()
        route = self.router.choose(*args)
        self.seconds.append(time.perf_counter() - t0)
        return route

    def routed(self, *args: Any) -> None:
        """The wrapped router's record, timed with the choice it follows."""
        t0 = time.perf_counter()
        self.router.routed(*args)
        self.seconds[-1] += time.perf_counter() - t0

    def forget(self, replica: int) -> None:
        """The wrapped router's `forget`."""
        self.router.forget(replica)


def workload(rng: random.Random, vocab: int) -> list[Submission]:
    """The shared-prefix requests, shuffled (token ids below `vocab`)."""
    page = CONFIG.page_size
    heads = [
        [rng.randrange(1, vocab) for _ in range(_PREFIX_PAGES.value * page)]
        for _ in range(_PREFIXES.value)
    ]
    params = SamplingParams(temperature=0, max_tokens=_MAX_TOKENS.value, ignore_eos=True)
    subs = [
        Submission(
            f"p{p}-{i}",
            {
                "prompt_token_ids": head
                + [rng.randrange(1, vocab) for _ in range(rng.randint(4, 24))]
            },
            params,
        )
        for p, head in enumerate(heads)
        for i in range(_PER_PREFIX.value)
    ]
    rng.shuffle(subs)
    return subs


async def drive(rs: ReplicaSet, subs: list[Submission]) -> float:
    """Sends `subs` from `--concurrency` clients; the wall seconds until all finished."""
    queue = list(reversed(subs))

    async def client() -> None:
        while queue:
            group = await rs.submit([queue.pop()], stream=False)
            async for _ in group:
                pass

    rs.start()
    t0 = time.perf_counter()
    try:
        await asyncio.gather(*(client() for _ in range(_CONCURRENCY.value)))
        return time.perf_counter() - t0
    finally:
        await rs.close()


def run(engines: list[Engine], router: str, subs: list[Submission]) -> dict[str, Any]:
    """One run of the workload over `engines` behind `router`."""
    rs = ReplicaSet(engines, max_queued=len(subs), router=router)
    timed = rs.router = TimedRouter(rs.router)
    wall = asyncio.run(drive(rs, subs))
    per = [e.stats() for e in engines]
    hits = sum(s["prefix_cache_hits"] for s in per)
    queries = sum(s["prefix_cache_queries"] for s in per)
    routed = [sum(c.values()) for c in rs.routed]
    ms = np.array(timed.seconds) * 1e3
    return {
        "replicas": len(engines),
        "router": router,
        "hit_rate": hits / queries if queries else 0.0,
        "prompt_tokens_computed": queries - hits,
        "routed": routed,
        "balance": max(routed) / (sum(routed) / len(routed)),
        "output_tok_per_s": sum(s["generation_tokens"] for s in per) / wall,
        "wall_s": wall,
        "router_ms_p50": float(np.percentile(ms, 50)),
        "router_ms_p99": float(np.percentile(ms, 99)),
    }


def make_engines() -> tuple[Any, int]:
    """`(make, vocab)`: `make(count)` builds `count` warmed-up engines (or the replicas
    of `--mesh`)."""
    if _RUNNER.value == "fake":
        delay = _STEP_MS.value / 1e3

        class Sleeping(FakeRunner):
            def dispatch(self, hb):
                time.sleep(delay)
                return super().dispatch(hb)

        def fake(count: int) -> list[Engine]:
            return [Engine(None, CONFIG, runner=lambda c: Sleeping(32000, c)) for _ in range(count)]

        return fake, 32000
    from paxkv.models import load_model
    from paxkv.sharding import shardings

    meshes = shardings.replica_meshes(shardings.make_mesh(MeshShape.parse(_MESH.value)))
    config = dataclasses.replace(CONFIG, warmup_scoring=False)  # nothing here scores
    loaded = [load_model("tiny-py", mesh=m) for m in meshes]

    def model(count: int) -> list[Engine]:
        engines = []
        for (_, module, tokenizer), mesh in zip(loaded[:count], meshes, strict=False):
            engine = Engine(module, config, tokenizer=tokenizer, mesh=mesh)
            engine.warmup()  # compiled once per replica; later engines reuse it
            engines.append(engine)
        return engines

    return model, loaded[0][0].vocab_size


def main(argv: list[str]) -> None:
    """The absl main: the three runs, a markdown table, optionally JSON."""
    del argv
    make, vocab = make_engines()
    subs = workload(random.Random(_SEED.value), vocab)
    d = _REPLICAS.value if _RUNNER.value == "fake" else MeshShape.parse(_MESH.value).data
    load = os.getloadavg()[0]
    rows = [
        run(make(d), "prefix", subs),
        run(make(d), "round_robin", subs),
        run(make(1), "prefix", subs),
    ]
    print(
        f"{_RUNNER.value} runner, {len(subs)} requests ({_PREFIXES.value} prefixes of "
        f"{_PREFIX_PAGES.value} pages x {_PER_PREFIX.value}), {_CONCURRENCY.value} clients, "
        f"load average {load:.2f} before, {os.getloadavg()[0]:.2f} after"
    )
    print(
        "| replicas | router | prefix hit rate | prompt tokens computed | prompts per replica "
        "| balance (max/mean) | output tok/s | router p50 / p99 (ms) |"
    )
    print("|---:|---|---:|---:|---|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['replicas']} | {r['router']} | {r['hit_rate']:.1%} | "
            f"{r['prompt_tokens_computed']} | {' '.join(map(str, r['routed']))} | "
            f"{r['balance']:.2f} | {r['output_tok_per_s']:.0f} | "
            f"{r['router_ms_p50']:.3f} / {r['router_ms_p99']:.3f} |"
        )
    if _JSON_OUT.value:
        with open(_JSON_OUT.value, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    app.run(main)
