"""One replica across the processes of a `jax.distributed` job, behind process 0.

JAX runs multi-controller: every process must run the same partitioned step on the
same inputs. Here process 0 alone owns the front end and the scheduler; before each
device call its step runner (`LeaderRunner`) sends the call's host inputs to every other
process through JAX's own collectives (`jax.experimental.multihost_utils`
`broadcast_one_to_all`), and those processes (`follow`) run the same call on them.
Nothing else crosses: every process holds its shards of the weights and of the KV
cache, and the device state the steps carry (the cache, the previous step's tokens)
stays equal because every process runs the same calls in the same order.

A message is a header of `HEADER_WORDS` int32 (the command, the shapes and dtypes of
its arrays, the payload's length and CRC-32) and, when it carries arrays, a payload of
int32 words padded to a power of two (a bounded set of shapes, compiled by warm-up).
The arrays are a `HostBatch`'s fields in declaration order, whatever they are, and the
command's extras after them. A receiver checks the payload against the header's
CRC-32 and the sequence number against its own count: inputs that differ between
processes stop the job with a message (`InputMismatch`) rather than produce wrong
tokens.

Failure: a process that dies breaks the next collective (gloo: connection reset), so
the step raises on every other process; a process that hangs, or one whose death
leaves a collective waiting, stops process 0's call: `LeaderRunner.busy_s` tells a
watchdog how long the call in flight has run, and an idle process 0 sends `PING`s to
find out (`paxkv.serve.multihost`). A process that stops sending heartbeats to the
coordinator ends every process after `heartbeat_timeout_seconds` of
`jax.distributed.initialize`, by SIGABRT: the watchdog acts before.
`initialize_distributed` bounds the wait for the job to form. `update_weights` is not
carried: process 0's runner refuses it with a ValueError that says why
(`LeaderRunner.param_source`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import os
import sys
import threading
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NoReturn

import jax
import numpy as np
from absl import logging

from paxkv.engine.device.sampling import Sampled
from paxkv.engine.device.step import MAX_STOP_IDS, abstract_step_batch
from paxkv.engine.runner import Deferred, StepRunner
from paxkv.host.batch import HostBatch, history_length, mask_words

HEADER_WORDS = 256
MAGIC = 0x70784B56  # "pxKV"
_FIXED = 6  # magic, command, sequence number, number of arrays, payload words, CRC-32
_PER_ARRAY = 6  # dtype code, ndim, up to 4 dims
MAX_ARRAYS = (HEADER_WORDS - _FIXED) // _PER_ARRAY
DTYPES = (np.dtype(np.int32), np.dtype(np.float32), np.dtype(np.bool_), np.dtype(np.int64))
MIN_PAYLOAD_WORDS = 1 << 10


def initialize_distributed(
    *,
    coordinator_address: str | None,
    num_processes: int | None,
    process_id: int | None,
    heartbeat_timeout_s: int,
    init_timeout_s: float,
    on_timeout: Callable[[int, str], Any] | None = None,
) -> None:
    """`jax.distributed.initialize`, bounded: when the job has not formed within
    `init_timeout_s` (the coordinator does not answer, or a process never registers),
    this process ends with status 1 and a line saying what it waited for
    (`on_timeout(status, message)`; default `exit_now`). JAX's own deadline, set past
    it, would end the process with SIGABRT and a C++ stack trace."""
    joined = threading.Event()
    where = coordinator_address or "the detected coordinator address"
    me = "?" if process_id is None else process_id

    def watch() -> None:
        if not joined.wait(init_timeout_s):
            (on_timeout or exit_now)(
                1,
                f"paxkv: process {me} could not join the jax.distributed job at {where} "
                f"within --distributed_init_timeout_s={init_timeout_s:g}: is every process "
                "started, with the same --coordinator_address and --num_processes?",
            )

    threading.Thread(target=watch, name="paxkv-distributed-init", daemon=True).start()
    try:
        jax.distributed.initialize(
            coordinator_address=coordinator_address,
            num_processes=num_processes,
            process_id=process_id,
            heartbeat_timeout_seconds=heartbeat_timeout_s,
            initialization_timeout=int(init_timeout_s) + 60,
        )
    finally:
        joined.set()


def exit_now(status: int, message: str) -> NoReturn:
    """Ends the process with `status` after writing `message` to stderr, skipping JAX's
    shutdown barrier (which would wait for processes that are gone)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os.write(2, f"{message}\n".encode())
    os._exit(status)


class Command(enum.IntEnum):
    """What process 0 asks the others to do."""

    STEP = 1  # run one step of the HostBatch (`StepRunner.dispatch`)
    LOOP = 2  # the N-step decode loop: the HostBatch, stop ids i32[S, MAX_STOP_IDS], limits
    WARMUP = 3  # compile: shapes i32[n, 3], scoring i32[1], payload words i32[1]
    RESTORE = 4  # a step raised: restore the cache (`StepRunner.restore_cache`)
    STOP = 5  # end `follow`
    PING = 6  # nothing: process 0 idle checks that every process still answers
    MASKS = 7  # the token masks of the last STEP (`StepRunner.finish`): i32[S, W]


class InputMismatch(RuntimeError):
    """A process received step inputs that differ from what process 0 sent."""


def payload_words(num_words: int) -> int:
    """The padded payload size of `num_words` words: a power of two, at least
    `MIN_PAYLOAD_WORDS`."""
    return max(MIN_PAYLOAD_WORDS, 1 << max(0, num_words - 1).bit_length())


def pack(command: Command, seq: int, arrays: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """`(header i32[HEADER_WORDS], payload i32[W])` of a message: `arrays` as raw bytes,
    each padded to whole words; W = 0 when there are none."""
    if len(arrays) > MAX_ARRAYS:
        raise ValueError(f"{len(arrays)} arrays exceed the header's room for {MAX_ARRAYS}")
    header = np.zeros(HEADER_WORDS, np.int32)
    chunks = []
    for i, a in enumerate(arrays):
        a = np.ascontiguousarray(a)
        if a.dtype not in DTYPES or a.ndim > _PER_ARRAY - 2:
            raise ValueError(f"array {i}: {a.dtype}{list(a.shape)} cannot be sent")
        at = _FIXED + i * _PER_ARRAY
        header[at : at + 2 + a.ndim] = [DTYPES.index(a.dtype), a.ndim, *a.shape]
        raw = a.tobytes()
        chunks.append(raw + b"\0" * (-len(raw) % 4))
    data = np.frombuffer(b"".join(chunks), np.int32)
    crc = zlib.crc32(data.tobytes())
    header[:_FIXED] = [
        MAGIC,
        int(command),
        seq,
        len(arrays),
        data.size,
        np.uint32(crc).view(np.int32),
    ]
    payload = np.zeros(payload_words(data.size) if data.size else 0, np.int32)
    payload[: data.size] = data
    return header, payload


def unpack(header: np.ndarray, payload: np.ndarray) -> tuple[Command, int, list[np.ndarray]]:
    """The command, sequence number and arrays of a message; InputMismatch if the
    payload is not what the header describes."""
    magic, command, seq, count, size, crc = (int(x) for x in header[:_FIXED])
    if magic != MAGIC:
        raise InputMismatch(f"a message header starts with {magic:#x}, not {MAGIC:#x}")
    data = payload[:size]
    got = np.uint32(zlib.crc32(data.tobytes())).view(np.int32)
    if int(got) != crc:
        raise InputMismatch(
            f"message {seq}: the payload's CRC-32 is {int(got) & 0xFFFFFFFF:#010x}, process 0 "
            f"sent {crc & 0xFFFFFFFF:#010x}: the step inputs differ between processes"
        )
    raw = data.tobytes()
    arrays, at = [], 0
    for i in range(count):
        code, ndim, *dims = (int(x) for x in header[_FIXED + i * _PER_ARRAY :][:_PER_ARRAY])
        dtype, shape = DTYPES[code], tuple(dims[:ndim])
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        arrays.append(
            np.frombuffer(raw, dtype, count=int(np.prod(shape)), offset=at).reshape(shape)
        )
        at += nbytes + (-nbytes % 4)
    return Command(command), seq, arrays


class Channel:
    """Process 0's messages to every other process of the job, in order.

    Args:
      broadcast: sends a pytree of NumPy arrays from process 0 to all, every process
        calling it with arrays of the same shapes (default:
        `multihost_utils.broadcast_one_to_all`).
    """

    def __init__(self, broadcast: Callable[[Any], Any] | None = None) -> None:
        if broadcast is None:
            from jax.experimental import multihost_utils

            broadcast = multihost_utils.broadcast_one_to_all
        self._broadcast = broadcast
        self.seq = 0  # messages sent or received

    def send(self, command: Command, arrays: Sequence[np.ndarray] = ()) -> None:
        """Process 0: sends one message."""
        header, payload = pack(command, self.seq, arrays)
        self._broadcast(header)
        if payload.size:
            self._broadcast(payload)
        self.seq += 1

    def receive(self) -> tuple[Command, list[np.ndarray]]:
        """Another process: the next message; InputMismatch if it is not intact or out of
        order."""
        header = np.asarray(self._broadcast(np.zeros(HEADER_WORDS, np.int32)))
        size = int(header[4])
        payload = np.zeros(0, np.int32)
        if size:
            payload = np.asarray(self._broadcast(np.zeros(payload_words(size), np.int32)))
        command, seq, arrays = unpack(header, payload)
        if seq != self.seq:
            raise InputMismatch(f"received message {seq}, expected {self.seq}")
        self.seq += 1
        return command, arrays

    def warm(self, max_words: int) -> None:
        """Every process: runs one broadcast of each payload size up to `max_words` (and
        of the header), so that none compiles later."""
        size = MIN_PAYLOAD_WORDS
        while True:
            self._broadcast(np.zeros(size, np.int32))
            if size >= max_words:
                break
            size *= 2
        self._broadcast(np.zeros(HEADER_WORDS, np.int32))


def host_batch_arrays(hb: HostBatch) -> list[np.ndarray]:
    """A HostBatch's fields, in declaration order."""
    return [np.asarray(getattr(hb, f.name)) for f in dataclasses.fields(HostBatch)]


def host_batch_of(arrays: Sequence[np.ndarray]) -> HostBatch:
    """The HostBatch of `host_batch_arrays`' output."""
    return HostBatch(*arrays[: len(dataclasses.fields(HostBatch))])


def max_payload_words(runner: StepRunner, shapes: Sequence[tuple[int, int, int]]) -> int:
    """A bound on a message's payload over step shapes `shapes`: the largest step batch
    (penalties, R = T scored rows), its per-token arrays again (token_src and what may
    join it) and the decode loop's limits, or the token masks of a step (structured
    outputs, with proposals), in 4-byte words."""
    page_size, groups = runner.config.page_size, runner.kv_groups.num_groups
    spec = runner.config.speculative_config
    positions = 1 + (spec.num_speculative_tokens if spec is not None else 0)
    mask = mask_words(runner.model_config.vocab_size)
    most = 0
    for t, s, p in shapes:
        batch = abstract_step_batch(
            t, s, p, page_size, groups, history_len=history_length(p, page_size), num_scored=t
        )
        words = sum(x.size for x in jax.tree.leaves(batch)) + 4 * t + 16
        # The decode loop's limits, or a step's token masks (MASKS, structured outputs).
        most = max(most, words + s * (MAX_STOP_IDS + 1), s * positions * mask + 16)
    return payload_words(most)


class LeaderRunner(StepRunner):
    """Process 0's step runner: sends each device call's inputs over `channel`, then
    makes the call on `runner` (a `ModelRunner` on the mesh that spans the processes).
    Everything else is `runner`'s."""

    @property
    def param_source(self) -> Any:
        """Refuses `Engine.update_weights` (which reads this first, before any change):
        the weights are sharded over the processes, each holding only its own shards,
        so new weights given to process 0 cannot reach the others' devices."""
        raise ValueError(
            "update_weights is not supported for a replica that spans processes "
            f"({jax.process_count()} under jax.distributed): each process holds only its "
            "own shards of the weights, and process 0 cannot place new ones on the other "
            "processes' devices; restart the job on the new checkpoint, or serve replicas "
            "that each fit one process"
        )

    def __init__(self, runner: StepRunner, channel: Channel) -> None:
        self.runner = runner
        self.channel = channel
        self.model_config = runner.model_config
        self.config = runner.config
        self.kv_groups = runner.kv_groups
        self.mesh = getattr(runner, "mesh", None)
        self.routing_shape = runner.routing_shape
        self._busy_since: float | None = None  # time.monotonic() at the call's start
        self._idle_since = time.monotonic()  # at the last call's end

    def busy_s(self) -> float:
        """Seconds the call in flight (a message and its device call) has run; 0 when
        none is. Safe from any thread."""
        since = self._busy_since
        return 0.0 if since is None else time.monotonic() - since

    def idle_s(self) -> float:
        """Seconds since the last call ended; 0 while one is in flight. Safe from any
        thread."""
        return 0.0 if self._busy_since is not None else time.monotonic() - self._idle_since

    @contextlib.contextmanager
    def _busy(self) -> Iterator[None]:
        self._busy_since = time.monotonic()
        try:
            yield
        finally:
            self._idle_since = time.monotonic()
            self._busy_since = None

    num_compilations = property(lambda self: self.runner.num_compilations)
    compile_seconds = property(lambda self: self.runner.compile_seconds)
    kv_cache = property(lambda self: self.runner.kv_cache)

    def dispatch(self, hb: HostBatch) -> Any:
        """Sends `hb` (its token masks as their width alone: they are all set until
        `finish` sends them filled), then dispatches it."""
        with self._busy():
            words = hb.allowed.shape[1]
            if words:
                empty = np.zeros((hb.allowed.shape[0], 0), np.int32)
                arrays = [*host_batch_arrays(dataclasses.replace(hb, allowed=empty))]
                arrays.append(np.array([words], np.int32))
            else:
                arrays = host_batch_arrays(hb)
            self.channel.send(Command.STEP, arrays)
            return self.runner.dispatch(hb)

    def finish(self, handle: Any) -> Any:
        """Sends a deferred step's token masks, then finishes it (`runner.finish`)."""
        if not isinstance(handle, Deferred):
            return handle
        with self._busy():
            self.channel.send(Command.MASKS, [handle.allowed])
            return self.runner.finish(handle)

    def fetch(self, handle: Any) -> Sampled:
        """`runner.fetch`: process 0 reads the (replicated) samples."""
        with self._busy():
            return self.runner.fetch(handle)

    def fetch_routing(self, handle: Any) -> np.ndarray:
        """`runner.fetch_routing`: process 0 reads the (replicated) routing."""
        return self.runner.fetch_routing(handle)

    def decode_loop(
        self, hb: HostBatch, stop_ids: Sequence[tuple[int, ...]], limits: Sequence[int]
    ) -> Any:
        """Sends `hb` with the loop's stop ids and limits, then dispatches the loop."""
        with self._busy():
            self.channel.send(
                Command.LOOP, [*host_batch_arrays(hb), *_loop_arrays(stop_ids, limits)]
            )
            return self.runner.decode_loop(hb, stop_ids, limits)

    def fetch_loop(self, handle: Any) -> tuple[Sampled, np.ndarray]:
        """`runner.fetch_loop`: process 0 reads the (replicated) samples."""
        with self._busy():
            return self.runner.fetch_loop(handle)

    def warmup(
        self,
        shapes: Sequence[tuple[int, int, int]],
        progress: Callable[[int, int], None] | None,
        *,
        scoring: bool = True,
        background: bool = False,
    ) -> None:
        """Every process compiles the channel's messages and the steps of `shapes`, all
        before serving (`background` is not taken: every process must run each step at
        the same shape, whatever it has compiled)."""
        words = max_payload_words(self.runner, shapes)
        table = np.array(shapes, np.int32).reshape(-1, 3)
        self.channel.send(Command.WARMUP, [table, np.array([scoring, words], np.int32)])
        self.channel.warm(words)
        self.runner.warmup(shapes, progress, scoring=scoring)

    def restore_cache(self) -> bool:
        """Every process restores its cache after a failed call."""
        with self._busy():
            self.channel.send(Command.RESTORE)
            return self.runner.restore_cache()

    def ping(self) -> None:
        """Sends a message that does nothing: it raises (the runtime's error) when a
        process has died, and waits (`busy_s` grows) while one hangs. Under the lock of
        the engine that steps this runner."""
        with self._busy():
            self.channel.send(Command.PING)

    def stop(self) -> None:
        """Ends the other processes' `follow`."""
        with self._busy():
            self.channel.send(Command.STOP)


def _loop_arrays(stop_ids: Sequence[tuple[int, ...]], limits: Sequence[int]) -> list[np.ndarray]:
    ids = np.full((len(stop_ids), MAX_STOP_IDS), -1, np.int32)
    for i, s in enumerate(stop_ids):
        ids[i, : len(s)] = s
    return [ids, np.asarray(limits, np.int32).reshape(-1)]


def _loop_inputs(ids: np.ndarray, limits: np.ndarray) -> tuple[list[tuple[int, ...]], list[int]]:
    stops = [tuple(int(t) for t in row if t >= 0) for row in ids]
    return stops, [int(n) for n in limits]


def follow(runner: StepRunner, channel: Channel) -> int:
    """Another process's loop: runs on `runner` (built as process 0 built its own) every
    call process 0 sends, until STOP; returns the messages handled. Raises
    InputMismatch, or the runtime's error when a collective fails (process 0 died)."""
    num_fields = len(dataclasses.fields(HostBatch))
    deferred = None  # a STEP whose masks come next
    while True:
        command, arrays = channel.receive()
        if command is Command.STOP:
            logging.info("paxkv: process 0 sent stop after %d messages", channel.seq)
            return channel.seq
        if command is Command.STEP:
            hb = host_batch_of(arrays)
            if len(arrays) > num_fields:  # token masks, all set until MASKS fills them
                words = int(arrays[num_fields][0])
                hb = dataclasses.replace(
                    hb, allowed=np.full((hb.allowed.shape[0], words), -1, np.int32)
                )
            deferred = runner.dispatch(hb)
        elif command is Command.MASKS:
            if not isinstance(deferred, Deferred):
                raise InputMismatch("token masks came without a step waiting for them")
            if arrays[0].shape != deferred.allowed.shape:
                raise InputMismatch(
                    f"token masks of shape {arrays[0].shape}, the step's are {deferred.allowed.shape}"
                )
            runner.finish(dataclasses.replace(deferred, allowed=arrays[0]))
            deferred = None
        elif command is Command.LOOP:
            stops, limits = _loop_inputs(*arrays[num_fields:])
            runner.decode_loop(host_batch_of(arrays), stops, limits)
        elif command is Command.WARMUP:
            table, (scoring, words) = arrays
            shapes = [tuple(int(x) for x in row) for row in table]
            channel.warm(int(words))
            runner.warmup(shapes, None, scoring=bool(scoring))
        elif command is Command.RESTORE:
            runner.restore_cache()
        # PING: nothing to do; receiving it was the point


def process_role(mesh: Any) -> str:
    """This process's part in serving `mesh` (one replica, or None: one device):
    "alone" when only this process's devices are in it, else "leader" for the lowest
    process index among its devices (it runs the front end and the scheduler) and
    "follower" for the others."""
    if mesh is None:
        return "alone"
    processes = {d.process_index for d in mesh.devices.flat}
    if len(processes) == 1:
        return "alone"
    return "leader" if jax.process_index() == min(processes) else "follower"
