"""Benchmark: host memory of loading a checkpoint onto a mesh, whole-then-spread vs sharded.

    python -m benchmarks.sharded_load [--mesh=model:8] [--layers=8] [--hidden=1024]

Writes a random Llama-shaped safetensors checkpoint (about 0.75 GB in f32 with the
defaults: hidden 1024, MLP 4096, 8 layers, 16 heads, 8 KV heads, vocab 32000) to a
temporary directory, then loads it in a fresh process per method on forced host
devices (`--xla_force_host_platform_device_count`), where device memory is the
process's own, so peak RSS shows what loading held at once:

- `whole_then_spread`: every tensor read whole onto one device, then `device_put` to
  its sharding (how loading worked before sharded loading);
- `sharded`: `load_hf_checkpoint(mesh=...)`, each device's slice read on its own.

Reports each method's peak RSS above the process's baseline (after JAX started), and
its peak anonymous memory (sampled every 2 ms: RSS also counts the checkpoint's file
pages that safetensors maps, which the kernel can drop), both also as multiples of the
checkpoint's size. Linux only (`/proc/self/status`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

from absl import app, flags

_MESH = flags.DEFINE_string("mesh", "model:8", "Mesh to load onto (host devices are forced).")
_LAYERS = flags.DEFINE_integer("layers", 8, "Decoder layers of the checkpoint.")
_HIDDEN = flags.DEFINE_integer("hidden", 1024, "Hidden size (MLP is 4x).")
_CHILD = flags.DEFINE_string("child", None, "Internal: method,checkpoint dir to run.")

METHODS = ("whole_then_spread", "sharded")


def _config(layers: int, hidden: int):
    from paxkv.models import PRESETS

    return PRESETS["tiny"].replace(
        vocab_size=32000,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_layers=layers,
        num_heads=16,
        num_kv_heads=8,
        head_dim=hidden // 16,
        dtype="float32",
    )


def _status(field: str) -> int:
    """A `/proc/self/status` memory figure, in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def _child(method: str, path: str, mesh_shape: str) -> dict:
    import threading
    import time

    import jax
    from flax import nnx

    from paxkv.models.weights import load_hf_checkpoint
    from paxkv.sharding import shardings
    from paxkv.sharding.mesh_shape import MeshShape

    mesh = shardings.make_mesh(MeshShape.parse(mesh_shape))
    jax.block_until_ready(jax.numpy.zeros(8))  # the runtime up: part of the baseline
    base_rss, base_anon = _status("VmRSS"), _status("RssAnon")
    # VmHWM is the peak RSS (file pages mapped from the checkpoint included: safetensors
    # reads through mmap); anonymous memory has no peak figure, so it is sampled.
    peak_anon, done = [base_anon], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak_anon[0] = max(peak_anon[0], _status("RssAnon"))
            time.sleep(0.002)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    if method == "sharded":
        _, model = load_hf_checkpoint(path, mesh=mesh)
        state = nnx.state(model)
    else:
        config, model = load_hf_checkpoint(path)
        state = nnx.state(model)
        state = jax.device_put(state, shardings.param_shardings(state, config, mesh))
        del model
    jax.block_until_ready(state)
    done.set()
    sampler.join()
    return {
        "method": method,
        "peak_rss_above_baseline_bytes": _status("VmHWM") - base_rss,
        "peak_anon_above_baseline_bytes": max(peak_anon[0], _status("RssAnon")) - base_anon,
    }


def main(argv: list[str]) -> None:
    """Writes the checkpoint, loads it both ways in child processes, prints the table."""
    del argv
    if _CHILD.value is not None:
        method, path = _CHILD.value.split(",", 1)
        print(json.dumps(_child(method, path, _MESH.value)))
        return
    from paxkv.models import init_model, save_hf_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        model = init_model(_config(_LAYERS.value, _HIDDEN.value), seed=0)
        save_hf_checkpoint(model, tmp, max_shard_bytes=256 << 20)
        del model
        size = sum(
            os.path.getsize(os.path.join(tmp, f))
            for f in os.listdir(tmp)
            if f.endswith(".safetensors")
        )
        n = _MESH.value.split(":")[-1]
        env = os.environ | {
            "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} "
            f"--xla_force_host_platform_device_count={n}".strip()
        }
        print(f"checkpoint: {size / 2**30:.2f} GiB, mesh {_MESH.value}")
        print(
            "| method | peak RSS above baseline (GiB) | x checkpoint | "
            "peak anonymous memory above baseline (GiB) | x checkpoint |"
        )
        print("|---|---:|---:|---:|---:|")
        for method in METHODS:
            out = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "benchmarks.sharded_load",
                    f"--child={method},{tmp}",
                    f"--mesh={_MESH.value}",
                ],
                env=env,
                capture_output=True,
                text=True,
                check=True,
            ).stdout
            r = json.loads(out.strip().splitlines()[-1])
            rss, anon = r["peak_rss_above_baseline_bytes"], r["peak_anon_above_baseline_bytes"]
            print(
                f"| {method} | {rss / 2**30:.2f} | {rss / size:.2f} | "
                f"{anon / 2**30:.2f} | {anon / size:.2f} |"
            )


if __name__ == "__main__":
    app.run(main)
