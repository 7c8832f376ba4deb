"""What the split of the step costs per step: the model's program alone, or followed by
the small sampler program (penalties), against the code of another commit where both
ran in one program.

A fresh process per run: `LLM` with the README's settings on tiny-py, every program
compiled first, then 8 prompts decoded to 64 tokens, plain and with a frequency penalty
(every step then runs the sampler program after the model's); reported as wall time per
engine step, the median of `--repeats` runs alternating the two codes:

    python -m benchmarks.sampler_split --before=/tmp/before-site --repeats=5
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

from absl import app, flags

from benchmarks.side_by_side import child_env

_BEFORE = flags.DEFINE_string("before", None, "An installed copy of other code (PYTHONPATH).")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Runs per code, alternated.")

_CHILD = r"""
import json, sys, time
from paxkv import LLM, SamplingParams
full = sys.argv[1]
llm = LLM("tiny-py", num_pages=128, page_size=16, max_num_seqs=8, max_num_batched_tokens=64,
          max_model_len=256, warmup=full if full != "True" else True)
prompts = [f"def f{i}(x):" for i in range(8)]
out = {}
for name, extra in (("plain", {}), ("penalised", {"frequency_penalty": 0.5})):
    params = SamplingParams(temperature=0.8, seed=1, max_tokens=64, ignore_eos=True, **extra)
    llm.generate(prompts, params, use_tqdm=False)  # warm: every path taken once
    steps = llm.stats()["num_steps"]
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    out[name] = (time.perf_counter() - start) / (llm.stats()["num_steps"] - steps)
print(json.dumps(out))
"""


def _run(pythonpath: str | None) -> dict:
    env = child_env("off", pythonpath)
    warmup = "True" if pythonpath else "full"  # the older code's True compiled everything
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, warmup],
        env=env,
        cwd="/",
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode:
        raise RuntimeError(done.stderr[-3000:])
    return json.loads(done.stdout.splitlines()[-1])


def main(argv: list[str]) -> None:
    """Alternates the codes, prints each run and the medians in ms per step."""
    del argv
    codes = {"this": None} | ({"before": _BEFORE.value} if _BEFORE.value else {})
    runs = {code: [] for code in codes}
    for _ in range(_REPEATS.value):
        for code, path in codes.items():
            runs[code].append(_run(path))
            print(code, json.dumps(runs[code][-1]), flush=True)
    print(f"load average {os.getloadavg()[0]:.2f}; ms per engine step, median of {_REPEATS.value}")
    print("| code | plain | penalised |")
    print("|---|---:|---:|")
    for code, rs in runs.items():
        cells = [f"{1e3 * statistics.median(r[k] for r in rs):.2f}" for k in ("plain", "penalised")]
        print(f"| {code} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    app.run(main)
