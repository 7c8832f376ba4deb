"""Serving one replica that spans processes (`paxkv.engine.multihost`): process 0's engine,
the other processes' loop, and how each ends.

Process 0 serves HTTP over an engine whose runner sends every device call to the other
processes first (`leader_engine`); the others serve nothing and run those calls
(`follow_and_exit`). At shutdown process 0 stops them (`stop_followers`); when the
replica fails (a collective broke, or a device call waits past a bound: another process
died or hangs), process 0 answers the requests in flight with 503 and exits 1
(`exit_when_failed`). Exits go through
`os._exit`: JAX's shutdown barrier would wait for processes that are gone.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, NoReturn

import jax
from absl import logging

from paxkv.engine import Engine, multihost
from paxkv.engine.multihost import Channel, exit_now

__all__ = [
    "Channel",
    "exit_when_failed",
    "follow_and_exit",
    "leader_engine",
    "role",
    "stop_followers",
]


def role(meshes: list[Any]) -> str:
    """This process's part ("alone", "leader", "follower": `multihost.process_role`) in
    serving the replicas of `meshes` (`paxkv.launch.flags.replica_meshes`: [None] for the
    one replica of the default mesh); several replicas are this process's alone."""
    from paxkv.sharding import shardings

    return multihost.process_role(shardings.default_mesh()) if meshes == [None] else "alone"


def leader_engine(llm: Any, channel: multihost.Channel) -> Engine:
    """Process 0's engine: `llm`'s limits and tokenizer over its model runner, each
    device call sent over `channel` first (`multihost.LeaderRunner`); warmed up on every
    process."""
    runner = multihost.LeaderRunner(llm.engine.runner, channel)
    engine = Engine(
        None, llm.engine.config, tokenizer=llm.engine.tokenizer, runner=lambda c: runner
    )
    engine.warmup()
    return engine


def follow_and_exit(llm: Any) -> NoReturn:
    """Another process: runs the calls process 0 sends on `llm`'s model runner until it
    stops them (exit 0), or a collective fails or the inputs differ (exit 1, naming the
    error: `multihost.InputMismatch`, or the runtime's when process 0 died)."""
    me = jax.process_index()
    logging.info("paxkv-serve: process %d runs process 0's steps; it serves no HTTP", me)
    try:
        multihost.follow(llm.engine.runner, multihost.Channel())
    except Exception as e:
        exit_now(1, f"paxkv-serve: process {me} stops: {type(e).__name__}: {e}")
    exit_now(0, f"paxkv-serve: process {me}: process 0 stopped the job")


def stop_followers(engine: Engine) -> None:
    """Process 0 at shutdown, its engine stopped: ends the other processes' loop."""
    try:
        engine.runner.stop()
    except Exception as e:  # they are gone already: nothing to stop
        logging.warning("paxkv-serve: could not stop the other processes: %s", e)


def exit_when_failed(
    front: Any,
    engine: Engine,
    *,
    stall_s: float,
    ping_every_s: float | None = None,
    grace_s: float = 2.0,
    on_exit: Callable[[int, str], Any] | None = None,
) -> None:
    """Process 0: exits 1 once the replica has failed, its requests in flight answered
    503 first (a replica without all its processes cannot serve again).

    It fails when a step raises (a collective broke: `front`, a `ReplicaSet`, fails its
    requests); when a device call of `engine` (whose runner is a
    `multihost.LeaderRunner`) has run `stall_s` seconds (a process died without breaking
    the collective, or hangs: the requests are failed here, the stepping thread being
    stuck); and, while nothing is served, when a `ping` sent after `ping_every_s` idle
    seconds (default: a tenth of `stall_s`, at most 5 s) raises or stalls, so that a
    process lost while idle is found before JAX's heartbeat check aborts this one.
    Then it exits `grace_s` later, time for the 503 events to reach the clients
    (`on_exit(status, message)`; default `exit_now`). Set `stall_s` below the heartbeat
    timeout and above any step's time.
    """
    runner = engine.runner
    on_exit = on_exit or exit_now
    ping_every_s = min(5.0, stall_s / 10) if ping_every_s is None else ping_every_s

    def ping() -> None:
        while not front.failed:
            time.sleep(max(0.05, ping_every_s - runner.idle_s()))
            if runner.idle_s() < ping_every_s:
                continue
            try:
                with engine.lock:  # one caller of the runner at a time: the engine's rule
                    if runner.idle_s() >= ping_every_s:
                        runner.ping()
            except Exception as e:
                logging.error("paxkv-serve: the replica's processes do not answer: %s", e)
                front.fail_stuck(f"the replica's processes stopped answering: {e}")
                return

    def watch() -> None:
        while not front.failed:
            if runner.busy_s() > stall_s:
                front.fail_stuck(
                    f"the replica's processes stopped answering: a device call has waited "
                    f"{stall_s:g} s for them"
                )
                break
            time.sleep(0.2)
        time.sleep(grace_s)
        on_exit(1, "paxkv-serve: the replica's processes stopped answering (see above); exiting")

    threading.Thread(target=ping, name="paxkv-replica-ping", daemon=True).start()
    threading.Thread(target=watch, name="paxkv-failure-watch", daemon=True).start()
