"""Benchmark: what quantized weights save in a decode step, by XLA's cost analysis.

    python -m benchmarks.quantized_weights [--preset=llama-3.2-1b]

One layer of the decode step of 64 sequences (the engine's compiled forward program,
two layers' less one layer's) of `--preset`'s shapes (bfloat16, random weights), with the
weights in bfloat16, int8 and fp8 (a scale per output channel): its parameter bytes, and
the bytes the step accesses and its FLOPs as XLA's cost analysis counts them on this
machine's backend. Speed is for an accelerator: the
CPU has no int8 or fp8 matmul, and its figures count the dequantized copies.
"""

from __future__ import annotations

import jax
from flax import nnx

from benchmarks.step_cost import forward_cost
from paxkv.models import PRESETS, registry
from paxkv.models.quantized_weights import quantize_model

ROWS = 64


def step_cost(preset: str, layers: int, quantization: str | None) -> dict[str, float]:
    """Parameter bytes, and the decode step's bytes accessed and FLOPs (cost analysis)."""
    config = PRESETS[preset].replace(dtype="bfloat16", num_layers=layers, scan_layers=False)
    model = registry.init_model(config)
    if quantization:
        quantize_model(model, quantization)
    cost = forward_cost(model, rows=ROWS, seqs=ROWS)
    params = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    return {
        "param_bytes": float(params),
        "bytes": cost["bytes"],
        "flops": cost["flops"],
    }


def per_layer(preset: str, quantization: str | None) -> dict[str, float]:
    """One layer's share of `step_cost`: a two-layer model's less a one-layer model's
    (the embedding, head and logits cancel out)."""
    one, two = step_cost(preset, 1, quantization), step_cost(preset, 2, quantization)
    return {k: two[k] - one[k] for k in one}


def main(argv: list[str]) -> None:
    """Prints the table of one layer's bytes and FLOPs per weight dtype."""
    del argv
    f = FLAGS
    rows = {mode: per_layer(f.preset, mode) for mode in (None, "int8", "fp8")}
    base = rows[None]
    print(
        f"one layer of the decode step of {ROWS} sequences, {f.preset} shapes, "
        f"{jax.default_backend()}, XLA cost analysis:"
    )
    print("| weights | parameter MB | step MB accessed | step MFLOP |")
    print("|---|---:|---:|---:|")
    for mode, c in rows.items():
        print(
            f"| {mode or 'bfloat16'} | {c['param_bytes'] / 1e6:.1f} "
            f"(x{c['param_bytes'] / base['param_bytes']:.2f}) | {c['bytes'] / 1e6:.1f} "
            f"(x{c['bytes'] / base['bytes']:.2f}) | {c['flops'] / 1e6:.1f} |"
        )


if __name__ == "__main__":
    from absl import app, flags

    flags.DEFINE_string("preset", "llama-3.2-1b", "Model preset whose shapes are used.")
    FLAGS = flags.FLAGS
    app.run(main)
