"""Benchmark: the host's cost per step of structured outputs, against the unconstrained step.

    python -m benchmarks.structured_step [--constrained=0,1,32,256] [--steps=48]

256 sequences decode together over the fake step runner (`FakeRunner`: no model, no
device) with a 32000-token byte-level BPE vocabulary trained here on the Python
standard library's sources (nothing is downloaded), N of them constrained by a JSON
schema (an object holding an array of strings, so a sequence rarely completes it within
the run). Reported per step in microseconds, median over the decode steps with all 256 running:
the host total (`Engine.step` less the fake runner's own time) in the stepping thread's
CPU time (`time.thread_time_ns`; this machine is shared) and in wall time, and, of it,
the masks' part in wall time (llguidance works on threads of its own, whose CPU time is
not the stepping thread's): bringing the matchers up to the new tokens
(`ConstrainedSequences.sync`) and filling the N bitmasks. On a device the fill runs while
the step's forward does (`paxkv.engine.stepper`), so it delays the step only by what
exceeds the forward's time.
"""

from __future__ import annotations

import glob
import json
import os
import sysconfig
import time

import numpy as np
from absl import app, flags

from paxkv.engine import Engine, EngineConfig
from paxkv.engine.fake_runner import FakeRunner
from paxkv.host.request import SamplingParams
from paxkv.host.structured_outputs import StructuredOutputs
from paxkv.models import HFTokenizer

_CONSTRAINED = flags.DEFINE_list("constrained", ["0", "1", "32", "256"], "Constrained sequences.")
_STEPS = flags.DEFINE_integer("steps", 48, "Decode steps per sequence (max_tokens).")
# Not `json_out`: benchmarks.host_step defines that flag, and tests import both modules.
_RESULTS_JSON = flags.DEFINE_string("results_json", None, "Write the results as JSON here.")

VOCAB = 32000
RUNNING = 256
SCHEMA = {
    "type": "object",
    "properties": {"items": {"type": "array", "items": {"type": "string"}}},
    "required": ["items"],
}


def stdlib_bpe(vocab_size: int = VOCAB) -> HFTokenizer:
    """A byte-level BPE of `vocab_size` tokens (`<|endoftext|>` the last special, id 0)
    trained on this Python's standard library sources."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))
    tok.train(files, trainer)
    return HFTokenizer(tok)


def run(tokenizer: HFTokenizer, constrained: int, max_tokens: int = 48) -> dict[str, float]:
    """Median per-step host costs (us) with `constrained` of the 256 sequences constrained,
    each generating `max_tokens`; `valid`: every constrained output is a prefix the
    schema allows."""
    config = EngineConfig(
        num_pages=RUNNING * 16,
        page_size=16,
        max_num_seqs=RUNNING,
        max_num_batched_tokens=RUNNING * 32,
        max_model_len=256,
    )
    engine = Engine(
        None,
        config,
        tokenizer=tokenizer,
        runner=lambda c: FakeRunner(tokenizer.vocab_size, c, eos_token_ids=(0,)),
    )
    stepper = engine._stepper
    spent = {"runner": 0, "runner_wall": 0, "sync": 0, "fill": 0}

    def timed(name, fn):
        def call(*args, **kwargs):
            t, w = time.thread_time_ns(), time.perf_counter_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                if name == "runner":
                    spent["runner"] += time.thread_time_ns() - t
                    spent["runner_wall"] += time.perf_counter_ns() - w
                else:  # wall: llguidance works on threads of its own
                    spent[name] += time.perf_counter_ns() - w

        return call

    for name in ("dispatch", "fetch", "finish"):
        setattr(engine.runner, name, timed("runner", getattr(engine.runner, name)))
    stepper.constrained.sync = timed("sync", stepper.constrained.sync)
    stepper.fill_masks = timed("fill", stepper.fill_masks)
    rng = np.random.default_rng(0)
    for i in range(RUNNING):
        spec = {"json": SCHEMA} if i < constrained else None
        params = SamplingParams(
            temperature=0, max_tokens=max_tokens, ignore_eos=True, structured_outputs=spec
        )
        prompt = rng.integers(1, tokenizer.vocab_size, 32).tolist()
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
    rows, final = [], {}
    while engine.has_unfinished():
        for k in spent:
            spent[k] = 0
        t, w = time.thread_time_ns(), time.perf_counter_ns()
        outputs = engine.step()
        total, wall = time.thread_time_ns() - t, time.perf_counter_ns() - w
        final |= {o.request_id: o for o in outputs if o.finished}
        full = len(engine.scheduler.running) == RUNNING
        host, host_wall = total - spent["runner"], wall - spent["runner_wall"]
        rows.append((full, host, host_wall, spent["sync"], spent["fill"]))
    decode = np.array([r[1:] for r in rows[1:] if r[0]], np.float64) / 1e3
    if not len(decode):
        raise RuntimeError("no step ran with all 256 sequences decoding")
    # Every constrained output is a prefix the schema allows (the fake runner took only
    # tokens its mask allowed).
    grammar = engine.grammars.compile(StructuredOutputs(json=SCHEMA))

    def matches(i: int) -> bool:
        return engine.grammars.matcher(grammar).consume_tokens(final[str(i)].outputs[0].token_ids)

    valid = all(matches(i) for i in range(constrained))
    free_valid = [matches(i) for i in range(constrained, RUNNING)]
    return {
        "constrained": constrained,
        "valid": valid,
        "free_valid": sum(free_valid) / max(1, len(free_valid)),
        "steps": len(decode),
        "host_us": float(np.median(decode[:, 0])),
        "host_wall_us": float(np.median(decode[:, 1])),
        "sync_us": float(np.median(decode[:, 2])),
        "fill_us": float(np.median(decode[:, 3])),
    }


def main(argv: list[str]) -> None:
    """Runs each constrained count on a new engine and prints the table."""
    del argv
    t = time.perf_counter()
    tokenizer = stdlib_bpe()
    print(f"tokenizer: {tokenizer.vocab_size} tokens in {time.perf_counter() - t:.1f} s")
    results = [run(tokenizer, int(n), _STEPS.value) for n in _CONSTRAINED.value]
    assert all(r["valid"] for r in results), "a constrained output left its schema"
    base = results[0]["host_us"]
    wall = results[0]["host_wall_us"]
    print(
        "| constrained of 256 | steps | host CPU (us) | x | host wall (us) | x "
        "| sync wall (us) | fill wall (us) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r['constrained']} | {r['steps']} | {r['host_us']:.0f} | "
            f"{r['host_us'] / base:.2f} | {r['host_wall_us']:.0f} | "
            f"{r['host_wall_us'] / wall:.2f} | {r['sync_us']:.0f} | {r['fill_us']:.0f} |"
        )
    if _RESULTS_JSON.value:
        with open(_RESULTS_JSON.value, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    app.run(main)
