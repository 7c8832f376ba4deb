"""Per-step timing rows summarised as the host-step benchmarks print them (NumPy only:
`vllm_scheduler` runs it in vLLM's venv, without JAX)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

ROWS = ("all", "at_max_num_seqs", "decode_only_at_max_num_seqs")


def summary(
    rows: list[dict[str, Any]], clock: str, keep: Callable[[dict], bool], parts: Sequence[str]
) -> dict[str, Any]:
    """p50 / mean / p99 of `{clock}_total` (at the top level) and of each `{clock}_{part}`
    over the rows `keep` accepts, with their count ("steps")."""
    kept = [r for r in rows if keep(r)]
    out: dict[str, Any] = {"steps": len(kept)}
    for part in ("total", *parts):
        x = np.array([r[f"{clock}_{part}"] for r in kept]) if kept else np.zeros(1)
        stats = {
            "p50": float(np.median(x)),
            "mean": float(x.mean()),
            "p99": float(np.percentile(x, 99)),
        }
        if part == "total":
            out.update(stats)
        else:
            out[part] = stats
    return out


def table(result: dict[str, Any], total: str, parts: Sequence[str]) -> str:
    """A markdown table of `result["per_step_us"][clock][row]` (`summary`s) for both
    clocks and every row of `ROWS`; `total` names the total's line."""
    lines = [
        "| clock | steps | part | p50 (us) | mean (us) | p99 (us) |",
        "|---|---:|---|---:|---:|---:|",
    ]
    for clock in ("cpu", "wall"):
        for which in ROWS:
            s = result["per_step_us"][clock][which]
            label = f"{clock}, {which.replace('_', ' ')}"
            lines.append(
                f"| {label} | {s['steps']} | {total} | {s['p50']:.0f} | {s['mean']:.0f} | "
                f"{s['p99']:.0f} |"
            )
            for part in parts:
                p = s[part]
                lines.append(f"| | | {part} | {p['p50']:.0f} | {p['mean']:.0f} | {p['p99']:.0f} |")
    return "\n".join(lines)
