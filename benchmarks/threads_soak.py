"""Soak: the RL pattern from several threads for a while, and a paused stream's CPU.

    python -m benchmarks.threads_soak [--seconds=120] [--paused_seconds=10]

Two threads stream and generate rollouts of the tiny model (greedy, a few prompts) while
a third syncs weights (two weight sets in turn, a random `update_weights` policy each
time) and a fourth pauses and resumes the engine, for `--seconds`
(`tests/offline/test_llm_threads.py` runs the same threads for a few rounds). Prints
the counts (calls, updates, pauses, outputs checked against the single-threaded greedy
output of their weight version) and every failure: a documented refusal while paused
is counted apart. Then a stream paused for `--paused_seconds`: the process's CPU time
meanwhile (a reader that polled would use a core).
"""

from __future__ import annotations

import random
import threading
import time
from typing import Any

from absl import app, flags

_SECONDS = flags.DEFINE_float("seconds", 120.0, "How long the threads run.")
_PAUSED = flags.DEFINE_float("paused_seconds", 10.0, "How long the stream stays paused.")

REFUSALS = ("on a paused engine", "the engine is paused: engine.resume() it first")


def main(argv: list[str]) -> None:
    """Runs the soak and prints its counts."""
    del argv
    import sys

    import jax
    import numpy as np
    from flax import nnx

    from paxkv import LLM, RequestOutputKind, SamplingParams
    from paxkv.engine import EngineConfig
    from paxkv.models import load_model

    config = EngineConfig(
        num_pages=64, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128
    )
    llm = LLM("tiny", dtype="float32", warmup=False, config=config)
    state = nnx.to_pure_dict(nnx.state(load_model("tiny", dtype="float32", seed=0)[1], nnx.Param))
    weights = {s: jax.tree.map(lambda x, s=s: np.asarray(x) * s, state) for s in (1.0, 1.05)}
    prompts = [{"prompt_token_ids": list(range(3 + i, 9 + 2 * i))} for i in range(4)]
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    delta = SamplingParams(
        temperature=0.0, max_tokens=6, ignore_eos=True, output_kind=RequestOutputKind.DELTA
    )
    expected = {}
    for s in (1.05, 1.0):
        llm.update_weights(weights[s])
        expected[s] = [
            o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)
        ]
    versions = {llm.engine.weight_version: 1.0}
    counts: dict[str, int] = dict.fromkeys(
        ("calls", "updates", "pauses", "checked", "aborted", "refused"), 0
    )
    failures: list[str] = []
    seen: list[tuple[int, Any, list[int]]] = []
    end = time.monotonic() + _SECONDS.value
    lock = threading.Lock()

    def note(key: str) -> None:
        with lock:
            counts[key] += 1

    def guarded(body):
        def run(rng: random.Random) -> None:
            while time.monotonic() < end:
                try:
                    body(rng)
                except Exception as e:  # counted, never raised: the soak goes on
                    if any(r in str(e) for r in REFUSALS):
                        note("refused")
                        time.sleep(0.01)  # paused: try again shortly
                    else:
                        failures.append(f"{type(e).__name__}: {e}")

        return run

    def rollouts(rng: random.Random) -> None:
        note("calls")
        tokens: dict[str, list[int]] = {}
        params = delta if rng.random() < 0.5 else greedy
        for o in llm.generate_stream(prompts, params):
            tokens.setdefault(o.request_id, []).extend(o.outputs[0].token_ids)
            if o.finished:
                i = prompts.index({"prompt_token_ids": o.prompt_token_ids})
                got = tokens[o.request_id] if params is delta else list(o.outputs[0].token_ids)
                seen.append((i, o, got))

    def trainer(rng: random.Random) -> None:
        time.sleep(rng.uniform(0.0, 0.2))
        scale = 1.05 if counts["updates"] % 2 == 0 else 1.0
        versions[
            llm.update_weights(weights[scale], policy=rng.choice(("wait", "abort", "recompute")))
        ] = scale
        note("updates")

    def pauser(rng: random.Random) -> None:
        llm.engine.pause()
        note("pauses")
        time.sleep(rng.uniform(0.0, 0.02))
        llm.engine.resume()
        time.sleep(rng.uniform(0.0, 0.2))

    threads = [
        threading.Thread(target=guarded(f), args=(random.Random(i),))
        for i, f in enumerate((rollouts, rollouts, trainer, pauser))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    llm.engine.resume()
    llm.engine.run_until_done()
    for i, out, tokens in seen:
        c = out.outputs[0]
        if c.finish_reason == "abort":
            counts["aborted"] += 1
        elif len(out.weight_versions) == 1:
            if tokens != expected[versions[out.weight_versions[0]]][i]:
                failures.append(f"prompt {i} under version {out.weight_versions}: {tokens}")
            counts["checked"] += 1
    pages = llm.engine.pool.num_in_use
    print(
        f"{_SECONDS.value:.0f} s, 4 threads: {counts['calls']} rollout calls, {counts['updates']} "
        f"weight updates (version {llm.engine.weight_version}), {counts['pauses']} pauses; "
        f"{counts['checked']} outputs equal to their version's greedy output, "
        f"{counts['aborted']} aborted by updates, {counts['refused']} refusals while paused; "
        f"pages in use at the end {pages}; failures: {len(failures)}"
    )
    for f in failures[:20]:
        print("  failure:", f)
    # A stream paused mid-way: the process's CPU time while it waits.
    stream = llm.generate_stream(prompts[:1], delta)
    next(stream)
    llm.engine.pause()
    reader = threading.Thread(target=lambda: list(stream))
    cpu = time.process_time()
    reader.start()
    time.sleep(_PAUSED.value)
    cpu = time.process_time() - cpu
    llm.engine.resume()
    reader.join()
    print(f"a stream paused for {_PAUSED.value:.0f} s: the process used {cpu:.3f} s of CPU")
    sys.exit(1 if failures or pages else 0)


if __name__ == "__main__":
    app.run(main)
