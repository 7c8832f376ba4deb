"""Benchmark: a mixture-of-experts step against the dense step of equal active parameters.

    python -m benchmarks.moe [--tokens=1,16,128,1024] [--experts=8] [--top_k=2]

Two decoders with the same attention, embedding and LM head: a Mixtral-shaped MoE
(`--experts` experts of `--expert_size` features, `--top_k` per token) and a dense
Llama-shaped one whose MLP has `top_k * expert_size` features, so a token runs through
the same number of parameters in both (the router's `hidden x experts` aside). For each
token count T it times (median of --iters, compile excluded; the CPU time of all the
process's threads, and the wall time) the MLP block alone and the whole forward pass
over T tokens (`dense_logits`), dense and MoE, the MoE with the grouped matmul the CPU
uses ("tiled") and with `jax.lax.ragged_dot` (which JAX lowers on the CPU to every
expert for every row).
"""

from __future__ import annotations

import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from flax import nnx

from benchmarks.timing import median_seconds
from paxkv.models import LlamaConfig, MoeConfig, init_model
from paxkv.models.layers import MLP
from paxkv.models.moe import MIXTRAL, MoE

_TOKENS = flags.DEFINE_list("tokens", ["1", "16", "128", "1024"], "Tokens per step (T).")
_HIDDEN = flags.DEFINE_integer("hidden", 512, "Hidden size.")
_EXPERT_SIZE = flags.DEFINE_integer("expert_size", 1024, "Each expert's MLP features.")
_EXPERTS = flags.DEFINE_integer("experts", 8, "Experts per layer.")
_TOP_K = flags.DEFINE_integer("top_k", 2, "Experts per token.")
_LAYERS = flags.DEFINE_integer("layers", 4, "Decoder layers.")
_ITERS = flags.DEFINE_integer("iters", 10, "Timed calls per point.")

IMPLS = ("tiled", "ragged_dot")


def configs(
    *, hidden: int, expert_size: int, experts: int, top_k: int, layers: int
) -> tuple[MoeConfig, LlamaConfig]:
    """The MoE and the dense config of equal active parameters (float32, 64-wide heads)."""
    heads = hidden // 64
    moe = MoeConfig(
        vocab_size=1024,
        hidden_size=hidden,
        intermediate_size=expert_size,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=max(1, heads // 4),
        head_dim=64,
        num_experts=experts,
        num_experts_per_tok=top_k,
        dtype="float32",
    )
    dense = LlamaConfig(
        vocab_size=moe.vocab_size,
        hidden_size=hidden,
        intermediate_size=top_k * expert_size,
        num_layers=layers,
        num_heads=moe.num_heads,
        num_kv_heads=moe.num_kv_heads,
        head_dim=64,
        dtype="float32",
    )
    return moe, dense


def _timed(fn: Any, state: Any, x: jax.Array, iters: int) -> dict[str, float]:
    """Median wall and CPU seconds of `fn(state, x)` (jitted), and XLA's FLOPs of it."""
    run = jax.jit(fn)
    flops = run.lower(state, x).compile().cost_analysis()["flops"]
    call = lambda: run(state, x)
    return {
        "wall_s": median_seconds(call, iters=iters),
        "cpu_s": median_seconds(call, iters=iters, clock=time.process_time),
        "flops": float(flops),
    }


def measure(moe: MoeConfig, dense: LlamaConfig, tokens: int, *, iters: int) -> dict[str, Any]:
    """Timings of the MLP block and of the model over `tokens` tokens (`_timed`): dense,
    and MoE by each grouped matmul of `IMPLS`, keyed `dense_block`, `moe_tiled_model`..."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((tokens, moe.hidden_size)), jnp.float32)
    ids = jnp.asarray(rng.integers(0, moe.vocab_size, tokens), jnp.int32)
    out: dict[str, Any] = {"tokens": tokens}
    graphdef, state = nnx.split(MLP(dense, rngs=nnx.Rngs(0)))
    out["dense_block"] = _timed(lambda s, x: nnx.merge(graphdef, s)(x), state, x, iters)
    graphdef, state = nnx.split(init_model(dense))
    model = lambda s, t, g=graphdef: nnx.merge(g, s).dense_logits(t)
    out["dense_model"] = _timed(model, state, ids, iters)
    for impl in IMPLS:
        config = moe.replace(grouped_matmul=impl)
        graphdef, state = nnx.split(MoE(config, MIXTRAL, rngs=nnx.Rngs(0)))
        block = lambda s, x, g=graphdef: nnx.merge(g, s)(x)[0]
        out[f"moe_{impl}_block"] = _timed(block, state, x, iters)
        graphdef, state = nnx.split(init_model(config))
        model = lambda s, t, g=graphdef: nnx.merge(g, s).dense_logits(t)
        out[f"moe_{impl}_model"] = _timed(model, state, ids, iters)
    return out


COLUMNS = (
    ("dense_block", "block: dense"),
    ("moe_tiled_block", "MoE tiled"),
    ("moe_ragged_dot_block", "MoE ragged_dot"),
    ("dense_model", "model: dense"),
    ("moe_tiled_model", "MoE tiled"),
    ("moe_ragged_dot_model", "MoE ragged_dot"),
)


def table_row(r: dict[str, Any]) -> str:
    """One markdown row of `measure`'s result: CPU ms (wall ms) of each column, and the
    tiled MoE over dense for the block and the model."""
    cell = lambda key: f"{r[key]['cpu_s'] * 1e3:.2f} ({r[key]['wall_s'] * 1e3:.2f})"
    ratio = lambda a, b: f"{r[a]['cpu_s'] / r[b]['cpu_s']:.2f}"
    cells = [cell(key) for key, _ in COLUMNS]
    cells.insert(3, ratio("moe_tiled_block", "dense_block"))
    cells.append(ratio("moe_tiled_model", "dense_model"))
    return f"| {r['tokens']} | " + " | ".join(cells) + " |"


def main(argv: list[str]) -> None:
    """Measures every --tokens count and prints the table."""
    del argv
    from paxkv.planner import parameters

    moe, dense = configs(
        hidden=_HIDDEN.value,
        expert_size=_EXPERT_SIZE.value,
        experts=_EXPERTS.value,
        top_k=_TOP_K.value,
        layers=_LAYERS.value,
    )
    print(
        f"device: {jax.devices()[0].device_kind}; float32; {moe.num_layers} layers, hidden "
        f"{moe.hidden_size}; MoE {moe.num_experts} experts x {moe.intermediate_size}, top "
        f"{moe.num_experts_per_tok}: {parameters.num_parameters(moe) / 1e6:.1f} M parameters, "
        f"{parameters.active_parameters(moe) / 1e6:.1f} M active; dense MLP "
        f"{dense.intermediate_size}: {parameters.num_parameters(dense) / 1e6:.1f} M; medians of "
        f"{_ITERS.value}"
    )
    heads = [name for _, name in COLUMNS]
    heads.insert(3, "tiled / dense")
    print("CPU ms of all threads (wall ms)")
    print("| T | " + " | ".join(heads) + " | tiled / dense |")
    print("|---:" * (len(heads) + 2) + "|")
    for t in _TOKENS.value:
        print(table_row(measure(moe, dense, int(t), iters=_ITERS.value)), flush=True)


def run() -> None:
    """The benchmark as a console script."""
    app.run(main)


if __name__ == "__main__":
    run()
