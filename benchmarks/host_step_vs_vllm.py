"""Side by side: paxkv's host step (`host_step`) against vLLM's v1 scheduler
(`vllm_scheduler`) on one trace, alternated.

    python -m benchmarks.host_step_vs_vllm --trace=FILE \\
        --vllm_python=/tmp/vllm-venv/bin/python [--rounds=3] [--repeat=1] [--vocab=32000] \\
        [--max_num_seqs=256 --num_pages=16384] [--json_out=FILE]

Runs `host_step --trace=FILE` with this interpreter and `vllm_scheduler --trace=FILE`
with `--vllm_python` (a venv holding vLLM: see `vllm_scheduler`), each in a process of
its own, alternately (paxkv, vLLM, paxkv, vLLM, ...) for `--rounds` rounds, with the
same configuration flags (`--repeat`: each run replays the trace that many times, on
new engines and schedulers, and pools their steps). Prints the load average before and after, and per row (all
steps, steps at `max_num_seqs` running, decode-only steps at `max_num_seqs`) the
medians across rounds of each run's CPU-clock p50s: paxkv's host total and parts,
vLLM's schedule + update and parts, the ratio vLLM / paxkv of the totals, and the
range of the rounds' own ratios (each round's two runs back to back).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from typing import Any

import numpy as np
from absl import app, flags

ROWS = ("all", "at_max_num_seqs", "decode_only_at_max_num_seqs")
PAXKV_PARTS = ("schedule", "layout", "record", "outputs", "read")
VLLM_PARTS = ("schedule", "update")


def define_flags() -> None:
    """Defines the command's flags; called only when run as a script, so that importing
    this module (the tests do) defines no global absl flags."""
    flags.DEFINE_string("trace", None, "Trace JSON (host_step --make_trace).")
    flags.DEFINE_string(
        "vllm_python", "/tmp/vllm-venv/bin/python", "An interpreter that imports vLLM 0.33."
    )
    flags.DEFINE_integer("rounds", 3, "Alternated rounds (one run of each per round).")
    flags.DEFINE_integer(
        "repeat", 1, "Replays of the trace in each run (steps pooled).", lower_bound=1
    )
    flags.DEFINE_integer("vocab", 32000, "The fake model's vocabulary.")
    flags.DEFINE_integer("max_num_seqs", 256, "Sequences running at once.")
    flags.DEFINE_integer("num_pages", 16384, "KV pages (vLLM: blocks).")
    flags.DEFINE_string("json_out", None, "Write every run's results as JSON here.")


def _load() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def _run(python: str, module: str, args: list[str], out: str) -> dict[str, Any]:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    env.setdefault("JAX_PLATFORMS", "cpu")
    cmd = [python, "-m", module, *args, f"--json_out={out}"]
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=root)
    if result.returncode != 0:
        raise RuntimeError(
            f"`{' '.join(cmd)}` exited {result.returncode}:\n{result.stderr[-3000:]}"
        )
    with open(out) as f:
        return json.load(f)


def compare(runs: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per row: the medians across runs of the CPU-clock p50s (paxkv's total and parts,
    vLLM's total and parts), the step counts, the ratio vLLM / paxkv of the total's
    medians and each round's own ratio (`round_ratios`)."""
    out = []
    for row in ROWS:
        med, totals = {}, {}
        for name, parts in (("paxkv", PAXKV_PARTS), ("vllm", VLLM_PARTS)):
            stats = [r["per_step_us"]["cpu"][row] for r in runs[name]]
            totals[name] = [s["p50"] for s in stats]
            med[name] = {"steps": stats[0]["steps"], "total": np.median(totals[name])}
            for part in parts:
                med[name][part] = float(np.median([s[part]["p50"] for s in stats]))
        ratio = med["vllm"]["total"] / med["paxkv"]["total"] if med["paxkv"]["total"] else 0.0
        # Each round's own ratio: its two runs ran back to back, so the machine's drift
        # over the rounds shows as their spread.
        rounds = [v / p for p, v in zip(totals["paxkv"], totals["vllm"], strict=True) if p]
        out.append({"row": row, **med, "ratio": ratio, "round_ratios": rounds})
    return out


def _tables(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| steps | paxkv steps | host total | schedule | layout | record | outputs | "
        "read | vLLM steps | schedule + update | schedule | update | vLLM / paxkv | "
        "rounds' ratios |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        p, v = r["paxkv"], r["vllm"]
        lines.append(
            f"| {r['row'].replace('_', ' ')} | {p['steps']} | {p['total']:.0f} | "
            + " | ".join(f"{p[k]:.0f}" for k in PAXKV_PARTS)
            + f" | {v['steps']} | {v['total']:.0f} | "
            + " | ".join(f"{v[k]:.0f}" for k in VLLM_PARTS)
            + f" | {r['ratio']:.1f}x | {_span(r['round_ratios'])} |"
        )
    return "\n".join(lines)


def _span(ratios: list[float]) -> str:
    """`min-max` of the rounds' ratios (one value when they agree to a tenth)."""
    if not ratios:
        return "-"
    lo, hi = f"{min(ratios):.1f}x", f"{max(ratios):.1f}x"
    return lo if lo == hi else f"{lo}-{hi}"


def main(argv: list[str]) -> None:
    """Runs the alternated rounds and prints the load averages and the table."""
    del argv
    if flags.FLAGS.trace is None:
        raise app.UsageError("--trace is required (write one with host_step --make_trace)")
    common = [
        f"--trace={os.path.abspath(flags.FLAGS.trace)}",
        f"--vocab={flags.FLAGS.vocab}",
        f"--max_num_seqs={flags.FLAGS.max_num_seqs}",
        f"--num_pages={flags.FLAGS.num_pages}",
        f"--repeat={flags.FLAGS.repeat}",
    ]
    runs: dict[str, list[dict[str, Any]]] = {"paxkv": [], "vllm": []}
    load_before = _load()
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(flags.FLAGS.rounds):
            for name, python, module in (
                ("paxkv", sys.executable, "benchmarks.host_step"),
                ("vllm", flags.FLAGS.vllm_python, "benchmarks.vllm_scheduler"),
            ):
                result = _run(python, module, common, os.path.join(tmp, f"{name}{i}.json"))
                if not result["all_finished"]:
                    raise RuntimeError(f"{name} round {i}: not every request got its tokens")
                runs[name].append(result)
                total = result["per_step_us"]["cpu"]["at_max_num_seqs"]["p50"]
                print(f"round {i} {name}: p50 at max_num_seqs {total:.0f} us", flush=True)
    load_after = _load()
    rows = compare(runs)
    print(f"load average before: {load_before}; after: {load_after}")
    print("CPU-clock p50 per step (us), medians across rounds:")
    print(_tables(rows))
    if flags.FLAGS.json_out is not None:
        with open(flags.FLAGS.json_out, "w") as f:
            json.dump(
                {"load_before": load_before, "load_after": load_after, "rows": rows, "runs": runs},
                f,
                indent=2,
            )


if __name__ == "__main__":
    define_flags()
    app.run(main)
