"""Benchmark: many LoRA adapters over one base model.

    python -m benchmarks.lora [--adapters=100] [--requests=400] [--max_loras=8] [--rank=16]

Two parts, on JAX's default device (tiny random Llama-family weights; `--preset`):

- cost: XLA's cost analysis (FLOPs, bytes accessed) of the decode step of a batch of 64
  sequences, without adapters and with slots of several counts and ranks: what the
  gathered per-row A and B cost, and that it grows with the rank, not the slots.
- zipf: `--requests` requests over `--adapters` adapters (a Zipf(1.1) draw: a few hot,
  a long tail), `--max_loras` device slots; generated tokens per second against the
  same requests on the base model, the slots' loads and evictions, and the
  compilations after warm-up (0: adapters coming and going compile nothing).
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from benchmarks.step_cost import forward_cost
from paxkv import Engine, EngineConfig, LoRARequest, SamplingParams  # noqa: F401
from paxkv.models import registry
from paxkv.models.llama_config import PRESETS
from paxkv.models.lora import TARGETS
from paxkv.models.lora_checkpoint import _dims

DECODE_BATCH = 64


def _config(preset: str):
    return dataclasses.replace(PRESETS[preset], dtype="float32")


def step_cost(
    preset: str, *, rows: int, max_loras: int, rank: int, method: str = "auto"
) -> dict[str, float]:
    """FLOPs and bytes of the step of `rows` packed rows over `DECODE_BATCH` sequences
    (max_loras=0: no LoRA), from the compiled program's cost analysis."""
    lora = dict(enable_lora=True, max_loras=max_loras, max_lora_rank=rank, lora_method=method)
    model = registry.init_model(_config(preset))
    return forward_cost(model, rows=rows, seqs=DECODE_BATCH, **(lora if max_loras else {}))


def random_adapter(
    config, rank: int, seed: int, *, targets: tuple[str, ...] = tuple(TARGETS), alpha: float = 0
) -> tuple[dict, dict]:
    """A PEFT-named state dict of `targets` and its adapter config (alpha: the rank
    unless given), random: A ~ N(0, 1/in), B ~ N(0, 1/r)."""
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(config.num_layers):
        for name in targets:
            holder = TARGETS[name]
            d_in, d_out = _dims(config, name)
            key = f"base_model.model.model.layers.{layer}.{holder}.{name}"
            tensors[f"{key}.lora_A.weight"] = rng.normal(0, d_in**-0.5, (rank, d_in))
            tensors[f"{key}.lora_B.weight"] = rng.normal(0, rank**-0.5, (d_out, rank))
    return tensors, {"r": rank, "lora_alpha": alpha or rank}


def zipf_run(
    preset: str,
    *,
    adapters: int,
    requests: int,
    max_loras: int,
    rank: int,
    lora: bool,
    method: str = "auto",
) -> dict[str, float]:
    """Serves `requests` requests (Zipf-drawn adapters when `lora`); tokens/s and counts."""
    mc = _config(preset)
    model = registry.init_model(mc)
    config = EngineConfig(
        num_pages=512,
        page_size=16,
        max_model_len=64,
        max_num_seqs=32,
        max_num_batched_tokens=256,
        enable_lora=lora,
        max_loras=max_loras,
        max_lora_rank=rank,
        lora_method=method,
    )
    engine = Engine(model, config)
    rng = np.random.default_rng(0)
    names = [f"adapter-{i}" for i in range(adapters)]
    if lora:
        for i, name in enumerate(names):
            engine.update_lora(name, *random_adapter(mc, rank, seed=i))
    engine.warmup()
    compiled = engine.num_compilations
    draws = np.minimum(rng.zipf(1.1, requests), adapters) - 1
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    t0 = time.perf_counter()
    for i in range(requests):
        prompt = rng.integers(1, mc.vocab_size, 32).tolist()
        lora_request = names[draws[i]] if lora else None
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params, lora_request=lora_request)
    generated = 0
    while engine.has_unfinished():
        generated += sum(len(o.outputs[0].token_ids) for o in engine.step() if o.finished)
    seconds = time.perf_counter() - t0
    stats = engine.stats()
    return {
        "tok_per_s": generated / seconds,
        "seconds": seconds,
        "distinct_adapters": len(set(draws.tolist())) if lora else 0,
        "loads": stats.get("lora_loads", 0),
        "evictions": stats.get("lora_evictions", 0),
        "compilations_after_warmup": engine.num_compilations - compiled,
    }


def main(argv: list[str]) -> None:
    """Prints the cost table, then the Zipf runs' figures."""
    del argv
    f = FLAGS
    print(f"cost of one step over {DECODE_BATCH} sequences ({f.preset}, f32, XLA cost analysis):")
    for rows in (DECODE_BATCH, 4 * DECODE_BATCH):
        base = step_cost(f.preset, rows=rows, max_loras=0, rank=f.rank)
        print(
            f"  {rows} rows, no LoRA: {base['flops'] / 1e6:.1f} MFLOP, {base['bytes'] / 1e6:.1f} MB"
        )
        for method, loras, rank in (
            ("gather", 8, f.rank),
            ("gather", 32, f.rank),
            ("gather", 8, 2 * f.rank),
            ("ragged", 8, f.rank),
            ("ragged", 32, f.rank),
        ):
            c = step_cost(f.preset, rows=rows, max_loras=loras, rank=rank, method=method)
            print(
                f"  {rows} rows, {method} max_loras={loras:<3} rank={rank:<3}: "
                f"{c['flops'] / 1e6:.1f} MFLOP (x{c['flops'] / base['flops']:.2f}), "
                f"{c['bytes'] / 1e6:.1f} MB (x{c['bytes'] / base['bytes']:.2f})"
            )
    args = dict(adapters=f.adapters, requests=f.requests, max_loras=f.max_loras, rank=f.rank)
    print(f"{f.requests} requests, {f.adapters} adapters (Zipf 1.1), {f.max_loras} slots:")
    plain = zipf_run(f.preset, lora=False, **args)
    print(f"  base model: {plain['tok_per_s']:.0f} tok/s ({plain['seconds']:.1f} s)")
    for method in ("auto", "gather", "ragged"):
        r = zipf_run(f.preset, lora=True, method=method, **args)
        print(
            f"  {method:<6}: {r['tok_per_s']:.0f} tok/s ({r['seconds']:.1f} s, "
            f"x{r['tok_per_s'] / plain['tok_per_s']:.2f}), {r['distinct_adapters']} adapters "
            f"drawn, {r['loads']} loads, {r['evictions']} evictions, "
            f"{r['compilations_after_warmup']} compilations after warm-up"
        )


if __name__ == "__main__":
    from absl import app, flags

    flags.DEFINE_string("preset", "tiny", "Llama-family preset (f32, random weights).")
    flags.DEFINE_integer("adapters", 100, "Adapters the requests draw from.")
    flags.DEFINE_integer("requests", 400, "Requests served.")
    flags.DEFINE_integer("max_loras", 8, "Device slots.")
    flags.DEFINE_integer("rank", 16, "Adapter rank (max_lora_rank).")
    FLAGS = flags.FLAGS
    app.run(main)
