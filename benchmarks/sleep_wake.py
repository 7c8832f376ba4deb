"""Benchmark: `LLM.sleep` / `wake_up` of a model's preset shape (random weights).

    python -m benchmarks.sleep_wake [--models=tiny-py,llama-3.2-1b] [--repeats=3]

For each model and level, the device bytes released (counted over the live device
arrays, as `jax.live_arrays()` sees them) and the medians of the sleep and wake-up wall
times, greedy outputs compared before and after, and the compilations the steps after
waking triggered (0 expected). On the CPU host and "device" memory are the same RAM:
the times are copies within it, not a TPU's or GPU's host link.
"""

from __future__ import annotations

import gc

import jax
import numpy as np
from absl import app, flags

_MODELS = flags.DEFINE_list("models", ["tiny-py", "llama-3.2-1b"], "Model presets.")
_DTYPE = flags.DEFINE_string("dtype", "bfloat16", "Parameter dtype.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Sleep/wake cycles per level.")


def _device_bytes() -> int:
    gc.collect()
    return sum(a.nbytes for a in jax.live_arrays() if a.sharding.memory_kind == "device")


def run_model(name: str) -> None:
    """Prints each level's figures for preset `name`."""
    from paxkv import LLM, SamplingParams
    from paxkv.launch.platform import quiet_backend_probes

    quiet_backend_probes()
    llm = LLM(
        name,
        dtype=_DTYPE.value,
        warmup=False,
        num_pages=256,
        page_size=16,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        max_model_len=512,
    )
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = [{"prompt_token_ids": [1, 2, 3, 4, 5]}, {"prompt_token_ids": list(range(7, 40))}]

    def tokens():
        return [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]

    expected = tokens()
    compiled = llm.engine.num_compilations
    for level in (1, 2):
        sleeps, wakes, released = [], [], []
        for _ in range(_REPEATS.value):
            before = _device_bytes()
            sleeps.append(llm.sleep(level=level)["seconds"])
            released.append(before - _device_bytes())
            wakes.append(llm.wake_up()["seconds"])
        same = tokens() == expected
        print(
            f"{name} ({_DTYPE.value}) level {level}: released {np.median(released) / 2**20:8.1f} "
            f"MiB, sleep {np.median(sleeps) * 1e3:7.1f} ms, wake_up {np.median(wakes) * 1e3:7.1f}"
            f" ms, outputs equal: {same}, compilations after: "
            f"{llm.engine.num_compilations - compiled}",
            flush=True,
        )


def main(argv: list[str]) -> None:
    """Runs every model of `--models`."""
    del argv
    for name in _MODELS.value:
        run_model(name)


if __name__ == "__main__":
    app.run(main)
