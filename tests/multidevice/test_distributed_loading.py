"""Two `jax.distributed` processes of 4 CPU devices each load one safetensors checkpoint
onto `model:8`: each reads only the slices its own devices hold, and the greedy outputs
equal one device's."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from subprocess import PIPE

from multidevice_env import xla_flags
from safetensors import safe_open

from paxkv.models import PRESETS, init_model, save_hf_checkpoint

CHILD = Path(__file__).with_name("distributed_load_child.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def test_two_processes_each_read_only_their_slices(tmp_path):
    config = PRESETS["tiny"].replace(dtype="float32")
    save_hf_checkpoint(init_model(config, seed=5), tmp_path, max_shard_bytes=600_000)
    port = _free_port()
    env = os.environ | {
        "XLA_FLAGS": xla_flags(4),
        "JAX_CPU_COLLECTIVES_IMPLEMENTATION": "gloo",
    }
    solo_env = os.environ | {"XLA_FLAGS": xla_flags(1)}
    argvs = [(-1, solo_env), (0, env), (1, env)]
    procs = [
        subprocess.Popen(
            [sys.executable, str(CHILD), str(tmp_path), str(port), str(pid)],
            stdout=PIPE,
            stderr=PIPE,
            text=True,
            env=e,
        )
        for pid, e in argvs
    ]
    runs = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
        runs.append(json.loads(out.strip().splitlines()[-1]))
    solo, first, second = runs
    assert first["tokens"] == second["tokens"] == solo["tokens"]
    # What a process must read: the whole of a tensor whose split dimension model:8
    # does not divide (replicated), else the half its 4 devices hold.
    sizes = {}
    for file in tmp_path.glob("*.safetensors"):
        with safe_open(str(file), "np") as f:
            for name in f.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                sizes[name] = f.get_tensor(name).nbytes
    assert set(solo["bytes"]) - {"bytes_read"} == set(sizes)
    assert all(solo["bytes"][n] == b for n, b in sizes.items())
    halves = 0
    for name, nbytes in sizes.items():
        a, b = first["bytes"][name], second["bytes"][name]
        assert a == b, name  # symmetric shards
        assert a in (nbytes, nbytes // 2), (name, a, nbytes)
        halves += a == nbytes // 2
    # The projections, the MLP and the vocabulary are split; only norms (and the
    # attention, whose 4 query heads cannot spread over 8 devices) are read whole.
    assert halves >= 2 * config.num_layers + 1
    split_total = sum(first["bytes"][n] for n in sizes)
    assert split_total < 0.75 * sum(sizes.values())
