"""Start-up: what a user waits for from `LLM(...)` to the first finished request.

Each scenario runs in fresh Python processes, as a user's script or job would: once with
an empty compilation cache (cold) and once more with the cache the first run left
(warm). A process reports its phases: importing paxkv and JAX, loading the weights,
building the engine (the KV cache allocated), compiling (warm-up), and the first
request; and the XLA compilations it ran, and how many of them were loads from the
persistent cache. With `--before=DIR` (an installed copy of another commit, e.g.
`pip install --no-deps --target DIR <checkout>`) each scenario also runs on that code in
the same run, alternating, for a side-by-side:

    git worktree add /tmp/before 22d4154
    pip install -q --no-deps --target /tmp/before-site /tmp/before
    python -m benchmarks.startup --before=/tmp/before-site --repeats=2

Only the public API is used (`LLM`, `generate`), so any commit runs the same script.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

from absl import app, flags

from benchmarks.side_by_side import child_env

_SCENARIOS = flags.DEFINE_list(
    "scenarios", ["tiny-py", "readme"], "Which start-ups to measure (see SCENARIOS)."
)
_BEFORE = flags.DEFINE_string(
    "before", None, "An installed copy of other code (PYTHONPATH), run side by side."
)
_REPEATS = flags.DEFINE_integer("repeats", 1, "Cold+warm pairs per scenario and code.")
_JSON_OUT = flags.DEFINE_string("json_out", None, "Write every run's phases here.")

# name -> LLM keyword arguments. tiny-py: `LLM(model="tiny-py")` with defaults; readme:
# the README's example settings; llama-3.2-1b: its real shapes, random weights.
SCENARIOS = {
    "tiny-py": {"model": "tiny-py"},
    # The same with every program compiled before LLM() returns (the old code's only way).
    "tiny-py-full": {"model": "tiny-py", "warmup": "full"},
    "readme": {
        "model": "tiny-py",
        "num_pages": 128,
        "page_size": 16,
        "max_num_seqs": 8,
        "max_num_batched_tokens": 64,
        "max_model_len": 256,
    },
    "serve": "serve",  # paxkv-serve up to its first answered completion
    "llama-3.2-1b": {
        "model": "llama-3.2-1b",
        "dtype": "bfloat16",
        "scan_layers": True,
        "num_pages": 256,
        "max_num_seqs": 8,
        "max_num_batched_tokens": 256,
        "max_model_len": 1024,
    },
}

# The child: one start-up, its phases as one JSON line on stdout.
_CHILD = r"""
import json, sys, threading, time
t0 = time.perf_counter()
counts = {"compiles": 0, "loads": 0}
hit = threading.local()
import jax
def on_event(event, **kw):
    if event == "/jax/compilation_cache/cache_hits":
        hit.pending = True
def on_duration(event, duration, **kw):
    if event == "/jax/core/compile/backend_compile_duration":
        loaded, hit.pending = getattr(hit, "pending", False), False
        counts["loads" if loaded else "compiles"] += 1
jax.monitoring.register_event_listener(on_event)
jax.monitoring.register_event_duration_secs_listener(on_duration)
import paxkv
from paxkv import LLM, SamplingParams
import paxkv.models as models
phases = {"import_s": time.perf_counter() - t0}
def timed(owner, name, phase):
    real = getattr(owner, name)
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return real(*args, **kwargs)
        finally:
            phases[phase] = phases.get(phase, 0.0) + time.perf_counter() - start
    setattr(owner, name, wrapper)
from paxkv.engine import Engine
timed(models, "load_model", "weights_s")
timed(Engine, "__init__", "engine_s")
timed(Engine, "warmup", "compile_s")
kwargs = json.loads(sys.argv[1])
start = time.perf_counter()
llm = LLM(**kwargs)
phases["llm_s"] = time.perf_counter() - start
first = time.perf_counter()
prompt = "def f(x):" if llm.get_tokenizer() is not None else {"prompt_token_ids": [1, 2, 3]}
out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
phases["first_request_s"] = time.perf_counter() - first
phases["to_first_token_s"] = time.perf_counter() - t0
phases["xla_compiles"] = counts["compiles"]
phases["xla_cache_loads"] = counts["loads"]
runner = llm.engine.runner
phases["step_programs"] = (
    len(runner.programs_compiled) + runner.programs_reused
    if hasattr(runner, "programs_compiled") else None
)
phases["text"] = out[0].outputs[0].text
print(json.dumps(phases))
"""


def run_child(kwargs: dict | str, cache_dir: str, pythonpath: str | None) -> dict:
    """One start-up in a fresh process with `cache_dir` as its compilation cache."""
    if kwargs == "serve":
        return run_server(cache_dir, pythonpath)
    if kwargs.get("warmup") == "full" and pythonpath is not None:
        kwargs = kwargs | {"warmup": True}  # older code: True compiled everything first
    env = child_env(cache_dir, pythonpath)
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps(kwargs)],
        cwd=cache_dir,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode:
        raise RuntimeError(f"start-up failed ({kwargs}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_server(cache_dir: str, pythonpath: str | None) -> dict:
    """`paxkv-serve` (tiny-py) started in a fresh process: seconds until it answers its
    first completion."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    start = time.perf_counter()
    code = f"import sys; from paxkv.launch.serve import run; sys.argv = ['paxkv-serve', '--port={port}']; run()"
    server = subprocess.Popen(
        [sys.executable, "-c", code],
        cwd=cache_dir,
        env=child_env(cache_dir, pythonpath),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    body = json.dumps(
        {"model": "tiny-py", "prompt": "def f(x):", "max_tokens": 8, "temperature": 0}
    )
    try:
        while True:
            if server.poll() is not None:
                raise RuntimeError(f"paxkv-serve exited with {server.returncode}")
            try:
                request = urllib.request.Request(
                    f"http://127.0.0.1:{port}/v1/completions",
                    data=body.encode(),
                    headers={"Content-Type": "application/json"},
                )
                with urllib.request.urlopen(request, timeout=600) as answer:
                    text = json.loads(answer.read())["choices"][0]["text"]
                break
            except (urllib.error.URLError, ConnectionError):
                time.sleep(0.2)
        return {"to_first_token_s": time.perf_counter() - start, "text": text}
    finally:
        server.terminate()
        server.wait(120)


PHASES = ("import_s", "weights_s", "engine_s", "compile_s", "first_request_s", "to_first_token_s")


def main(argv: list[str]) -> None:
    """Runs the scenarios, prints every run and a table of medians."""
    del argv
    codes = {"this": None} | ({"before": _BEFORE.value} if _BEFORE.value else {})
    runs = []
    for name in _SCENARIOS.value:
        for _ in range(_REPEATS.value):
            for code, path in codes.items():  # alternating, so drift hits both alike
                with tempfile.TemporaryDirectory(prefix="paxkv-startup-") as cache:
                    for kind in ("cold", "warm"):
                        r = run_child(SCENARIOS[name], cache, path)
                        runs.append({"scenario": name, "code": code, "start": kind, **r})
                        print(json.dumps(runs[-1]), flush=True)
    print(f"\nload average {os.getloadavg()[0]:.2f}; medians over {_REPEATS.value} run(s)")
    head = ["scenario", "code", "start", *PHASES, "xla_compiles", "xla_cache_loads"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for name in _SCENARIOS.value:
        for code in codes:
            for kind in ("cold", "warm"):
                rows = [
                    r for r in runs if (r["scenario"], r["code"], r["start"]) == (name, code, kind)
                ]
                cells = []
                for key in (*PHASES, "xla_compiles", "xla_cache_loads"):
                    values = [r.get(key) or 0 for r in rows]
                    value = statistics.median(values)
                    cells.append(f"{value:.1f}" if key.endswith("_s") else f"{value:g}")
                print(f"| {name} | {code} | {kind} | " + " | ".join(cells) + " |")
    if _JSON_OUT.value:
        with open(_JSON_OUT.value, "w") as f:
            json.dump({"load_average": os.getloadavg(), "runs": runs, "at": time.time()}, f)


if __name__ == "__main__":
    app.run(main)
