"""The kernel benchmark's device rates and report: the copy bandwidth and matmul rate
measured on the device, each result's fraction of them, and the markdown table.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from benchmarks.kernel_cases import Settings
from benchmarks.timing import median_seconds


def copy_bandwidth(settings: Settings) -> float:
    """Device-to-device bandwidth in bytes/s: read and write of a `copy_mib` buffer."""
    x = jnp.zeros((settings.copy_mib * 2**20 // 4,), jnp.float32)
    fn = jax.jit(lambda a: a + 1.0)  # one read and one write of every element
    seconds = median_seconds(lambda: fn(x), iters=max(3, settings.iters), warmup=settings.warmup)
    return 2 * x.nbytes / seconds


def matmul_rate(settings: Settings) -> float:
    """FLOP/s of an n x n x n matmul in the run's dtype (f32 accumulation)."""
    n = settings.matmul_size
    a = jax.random.normal(jax.random.key(1), (n, n), settings.dtype)
    fn = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32))
    seconds = median_seconds(lambda: fn(a, a), iters=max(3, settings.iters), warmup=settings.warmup)
    return 2 * n**3 / seconds


def add_rates(
    results: list[dict], copy_bytes_per_s: float, matmul_flops_per_s: float
) -> list[dict]:
    """Adds bandwidth (decode) or FLOP/s (prefill) and their fractions of the device's."""
    for r in results:
        if "median_s" not in r:
            continue
        r["bandwidth_bytes_per_s"] = r["kv_bytes"] / r["median_s"]
        r["bandwidth_fraction"] = r["bandwidth_bytes_per_s"] / copy_bytes_per_s
        r["flops_per_s"] = r["flops"] / r["median_s"]
        r["matmul_fraction"] = r["flops_per_s"] / matmul_flops_per_s
    return results


def markdown_table(report: dict) -> str:
    """The results as a markdown table, with the device's measured rates in a header line."""
    lines = [
        f"device: {report['device']} ({report['backend']}); copy bandwidth "
        f"{report['copy_bytes_per_s'] / 1e9:.1f} GB/s; matmul {report['matmul_flops_per_s'] / 1e12:.2f} "
        f"TFLOP/s ({report['settings']['dtype']}); pages {report['settings']['page_dtype']}, "
        f"Hq={report['settings']['num_q_heads']} Hkv={report['settings']['num_kv_heads']} "
        f"D={report['settings']['head_dim']} page_size={report['settings']['page_size']}; "
        f"medians of {report['settings']['iters']}",
        "",
        "| kind | batch | context | impl | median (us) | GB/s | % copy BW | TFLOP/s | % matmul | max |diff| vs dense | note |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in report["results"]:
        cells = ["-"] * 5
        if "median_s" in r:  # decode is bandwidth-bound, prefill compute-bound: show that rate
            cells[0] = f"{r['median_s'] * 1e6:.1f}"
            if r["kind"] == "decode":
                cells[1] = f"{r['bandwidth_bytes_per_s'] / 1e9:.1f}"
                cells[2] = f"{100 * r['bandwidth_fraction']:.1f}"
            else:
                cells[3] = f"{r['flops_per_s'] / 1e12:.3f}"
                cells[4] = f"{100 * r['matmul_fraction']:.1f}"
        diff = f"{r['max_abs_diff_vs_dense']:.2e}" if "max_abs_diff_vs_dense" in r else "-"
        lines.append(
            f"| {r['kind']} | {r['batch']} | {r['context']} | {r['impl']} | "
            + " | ".join(cells)
            + f" | {diff} | {r.get('error', '')} |"
        )
    return "\n".join(lines)
