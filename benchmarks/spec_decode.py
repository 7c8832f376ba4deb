"""Benchmark: speculative decoding by prompt lookup against plain decoding, in one run.

    python -m benchmarks.spec_decode [--model=tiny-py] [--ks=2,4,8] [--runs=3]

Two workloads on the same engine settings, each run with speculation off and with
n-gram proposals of k = each of `--ks`:

- "code": Python prompts, greedy, one request at a time (so a step is one sequence's
  forward pass): mean accepted length (tokens emitted per verified draft) and target
  forward passes per output token (steps / generated tokens; 1.0 without speculation).
- "random": `--random_model` (random weights) on prompts of random tokens, sampled at
  temperature 1, 8 requests at once, with 1-token lookups (`prompt_lookup_min=1`):
  proposals are made and almost never accepted, which the adaptive rule
  (`paxkv.host.speculative`) must notice, so speculation costs little.

Each variant's engine is warmed up (nothing compiles later: checked) and runs its
workload once untimed, then `--runs` timed passes alternated across variants; reported: output tokens per second
(median wall, and the calling thread's CPU time per token), and the ratio to "off".
Greedy outputs of every variant are checked equal to "off" (they must be). With
`--draft_model` the code workload also runs a draft-model row (k = 4), and it and
"off" again with async scheduling (the host plans step k+1 while step k runs; proposals
are recorded as accepted and rejections undone on the device); its default, tiny-py
itself, costs as much as the target, so that row shows the target's forward passes per
token, not a speed-up.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import numpy as np
from absl import app, flags

_MODEL = flags.DEFINE_string("model", "tiny-py", "The code workload's model (preset or directory).")
_RANDOM_MODEL = flags.DEFINE_string("random_model", "tiny", "The random workload's model.")
_KS = flags.DEFINE_list("ks", ["2", "4", "8"], "num_speculative_tokens values to compare.")
_RUNS = flags.DEFINE_integer("runs", 3, "Timed passes per variant, alternated.")
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 64, "Tokens generated per request.")
_DRAFT = flags.DEFINE_string(
    "draft_model",
    "tiny-py",
    "The draft model of the code workload's draft_model row (k = 4); empty: no such row.",
)
_MIN_ACCEPTANCE = flags.DEFINE_float(
    "min_acceptance", None, "SpeculativeConfig.min_acceptance; unset: its default."
)

CODE_PROMPTS = (
    "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n\n"
    "class Size:\n    def __init__(self, w, h):\n",
    "for i in range(10):\n    print(i)\nfor j in range(10):\n    print(j)\nfor k in range(10):\n",
    "import os\nimport sys\nimport json\nimport time\nimport math\n",
)


def _engine(
    model: Any, tokenizer: Any, spec: dict | None, draft: Any = None, async_: bool = False
) -> Any:
    from paxkv.engine import Engine, EngineConfig

    config = EngineConfig(
        num_pages=256,
        page_size=16,
        max_num_seqs=8,
        max_num_batched_tokens=128,
        max_model_len=256,
        token_buckets=(16, 128),
        page_buckets=(16,),
        log_stats_interval_s=0,
        speculative_config=spec,
        async_scheduling=async_,
    )
    return Engine(model, config, tokenizer=tokenizer, draft_model=draft)


def _spec(k: int, **fields: Any) -> dict:
    spec = {"num_speculative_tokens": k, **fields}
    if _MIN_ACCEPTANCE.value is not None:
        spec["min_acceptance"] = _MIN_ACCEPTANCE.value
    return spec


def _workloads(models: dict[str, tuple], max_tokens: int) -> dict[str, tuple]:
    """Each workload: `(model, tokenizer, prompt_lookup_min, batches)`, a batch being a
    list of `(prompt ids, SamplingParams)` run together."""
    from paxkv.host.request import SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    model, tokenizer = models["code"]
    code = [[(tokenizer.encode(p), greedy)] for p in CODE_PROMPTS]
    rng = np.random.default_rng(0)
    random_model, random_tokenizer = models["random"]
    vocab = random_model.config.vocab_size
    random = [
        [
            (
                rng.integers(0, vocab, 32).tolist(),
                SamplingParams(temperature=1.0, seed=i, max_tokens=max_tokens, ignore_eos=True),
            )
            for i in range(8)
        ]
    ]
    return {
        "code": (model, tokenizer, None, code),
        "random": (random_model, random_tokenizer, 1, random),
    }


def _pass(engine: Any, batches: list[list[tuple]]) -> tuple[float, float, int, list]:
    """Runs every batch to the end; `(wall s, thread CPU s, tokens, token ids)`."""
    w0, c0 = time.perf_counter(), time.thread_time_ns()
    tokens, ids = 0, []
    for b, batch in enumerate(batches):
        for i, (prompt, params) in enumerate(batch):
            engine.add_request(f"{b}.{i}", {"prompt_token_ids": prompt}, params)
        done = engine.run_until_done()
        for i in range(len(batch)):
            out = done[f"{b}.{i}"].outputs[0].token_ids
            tokens += len(out)
            ids.append(list(out))
    return time.perf_counter() - w0, (time.thread_time_ns() - c0) / 1e9, tokens, ids


def measure(
    models: dict[str, tuple], ks: list[int], runs: int, max_tokens: int, draft: Any = None
) -> dict:
    """Per workload and variant: tokens/s (median), CPU us per token, forward passes
    per output token, mean accepted length, acceptance rate; and the ratio to "off".
    `models` maps "code" and "random" to `(model, tokenizer)`; with `draft`, the code
    workload also runs a draft-model variant of k = 4."""
    work = _workloads(models, max_tokens)
    results: dict[str, dict] = {}
    for name, (model, tokenizer, lookup_min, batches) in work.items():
        variants: dict[str, tuple] = {"off": (None, None)}
        for k in ks:
            variants[f"ngram k={k}"] = (_spec(k, prompt_lookup_min=lookup_min), None)
        if draft is not None and name == "code":
            spec = _spec(4, method="draft_model", model="(object)")
            variants["draft k=4"] = (spec, draft)
            # Async scheduling beside each (n-gram proposals need the sync host).
            variants["off, async"] = (None, None, True)
            variants["draft k=4, async"] = (spec, draft, True)
        engines = {v: _engine(model, tokenizer, *args) for v, args in variants.items()}
        for e in engines.values():
            e.warmup()
        compiled = {v: e.num_compilations for v, e in engines.items()}
        outputs = {v: _pass(e, batches)[3] for v, e in engines.items()}
        if name == "code":
            for v, out in outputs.items():
                if out != outputs["off"]:
                    raise AssertionError(f"{v}: greedy outputs differ from plain decoding")
        for e in engines.values():  # counts from the timed passes only
            e.metrics.num_steps = 0
            e.metrics.generation_tokens = 0
        times: dict[str, list] = {v: [] for v in variants}
        before = {v: _spec_counts(e) for v, e in engines.items()}
        for _ in range(runs):
            for v, e in engines.items():
                times[v].append(_pass(e, batches)[:3])
        rows = {}
        for v, e in engines.items():
            wall = statistics.median(t[0] for t in times[v])
            cpu = statistics.median(t[1] for t in times[v])
            tokens = times[v][0][2]
            stats = e.stats()
            drafts, proposed, accepted = (
                a - b for a, b in zip(_spec_counts(e), before[v], strict=True)
            )
            rows[v] = {
                "tokens_per_s": tokens / wall,
                "cpu_us_per_token": 1e6 * cpu / tokens,
                "forward_passes_per_token": stats["num_steps"] / stats["generation_tokens"],
                "mean_accepted_length": 1 + accepted / drafts if drafts else None,
                "acceptance_rate": accepted / proposed if proposed else None,
            }
        for v, e in engines.items():
            if e.num_compilations != compiled[v]:
                raise AssertionError(f"{v} compiled after warm-up")
        off = rows["off"]["tokens_per_s"]
        for row in rows.values():
            row["speedup"] = row["tokens_per_s"] / off
        results[name] = rows
    return results


def _spec_counts(engine: Any) -> tuple[int, int, int]:
    s = engine.speculator
    if s is None:
        return (0, 0, 0)
    return (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens)


def main(argv: list[str]) -> None:
    """Prints each workload's variants side by side."""
    del argv
    import os

    import jax

    from paxkv.models import load_model

    models = {
        name: load_model(m, dtype="float32")[1:]
        for name, m in (("code", _MODEL.value), ("random", _RANDOM_MODEL.value))
    }
    ks = [int(k) for k in _KS.value]
    draft = load_model(_DRAFT.value, dtype="float32")[1] if _DRAFT.value else None
    load = os.getloadavg()[0]
    r = measure(models, ks, _RUNS.value, _MAX_TOKENS.value, draft)
    print(
        f"backend={jax.default_backend()} code: {_MODEL.value}, random: {_RANDOM_MODEL.value} "
        f"max_tokens={_MAX_TOKENS.value} runs={_RUNS.value} "
        f"load before/after={load:.2f}/{os.getloadavg()[0]:.2f}"
    )
    head = f"{'workload':<10}{'variant':<18}{'tok/s':>8}{'vs off':>8}{'cpu us/tok':>11}"
    print(head + f"{'passes/tok':>11}{'accepted len':>13}{'accept rate':>12}")
    for name, rows in r.items():
        for v, row in rows.items():
            mal, rate = row["mean_accepted_length"], row["acceptance_rate"]
            print(
                f"{name:<10}{v:<18}{row['tokens_per_s']:>8.1f}{row['speedup']:>8.2f}"
                f"{row['cpu_us_per_token']:>11.0f}{row['forward_passes_per_token']:>11.3f}"
                f"{'-' if mal is None else f'{mal:.2f}':>13}"
                f"{'-' if rate is None else f'{rate:.2f}':>12}"
            )


if __name__ == "__main__":
    app.run(main)
