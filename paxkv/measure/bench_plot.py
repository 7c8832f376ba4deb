"""A PNG of the load benchmark's results (needs the optional matplotlib)."""

from __future__ import annotations

from typing import Any


def plot(results: dict[str, Any], path: str) -> None:
    """Bar charts of peak concurrency, output tok/s, TTFT p50 and KV utilisation per set-up."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise OSError("--plot_out needs matplotlib: pip install 'paxkv[plot]'") from e
    setups = results["setups"]
    names = list(setups)
    panels = [
        ("peak concurrent sequences", "peak_concurrency"),
        ("output tok/s", "output_tok_per_s"),
        ("TTFT p50 (s)", "ttft_p50_s"),
        ("KV utilisation", "kv_utilization"),
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.5))
    for ax, (title, key) in zip(axes, panels, strict=True):
        ax.bar(
            names,
            [setups[n][key] or 0 for n in names],
            color=["#2a7", "#c55", "#d92"][: len(names)],
        )
        ax.set_title(title)
        ax.tick_params(axis="x", labelrotation=20)
    w = results["workload"]
    fig.suptitle(
        f"{results['model']}: {w['name']} workload, {w['num_requests']} requests, "
        f"{results['kv_budget_bytes'] / 2**20:.1f} MiB of KV for every set-up"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
