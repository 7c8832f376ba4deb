"""The persistent compilation cache, on by default (`paxkv.engine.compile_cache`).

Each start is a fresh Python process, as a user's job is: the second start in the same
cache directory loads every step program and compiles none; a directory that cannot be
used, entries that are corrupt or another version's, and two processes filling one
directory at once each give at most one warning and the same outputs as a cold start.
"""

import json
import os
import pathlib
import subprocess
import sys

import pytest

# A start: LLM(...) with small limits, one greedy request; its outputs and counts.
_START = r"""
import json, resource, signal, sys
if sys.argv[2:] == ["full"]:  # a disk that takes no more than 4 KiB a file
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
from paxkv import LLM, SamplingParams
cache_dir = None if sys.argv[1] == "default" else sys.argv[1]
llm = LLM("tiny", dtype="float32", num_pages=64, page_size=8, max_num_seqs=4,
          max_num_batched_tokens=32, max_model_len=64, cache_dir=cache_dir,
          token_buckets=(32,), seq_buckets=(4,), page_buckets=(8,), warmup_scoring=False)
prompts = [{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [9, 8]}]
out = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6),
                   use_tqdm=False)
engine = llm.engine
print(json.dumps({
    "tokens": [o.outputs[0].token_ids for o in out],
    "compilations": engine.num_compilations,
    "loads": engine.num_cache_loads,
}))
"""


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_COMPILATION_CACHE_DIR",)}
    env.pop("PAXKV_CACHE_DIR", None)
    env.update(extra)
    return env


def _start(cache_dir, *, env=None, wait=True, full=False):
    command = [sys.executable, "-c", _START, str(cache_dir), *(["full"] if full else [])]
    if not wait:
        return subprocess.Popen(
            command, env=env or _env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
    done = subprocess.run(command, env=env or _env(), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1]), done.stderr


def _cache_warnings(stderr):
    return [line for line in stderr.splitlines() if "compilation cache" in line]


@pytest.fixture(scope="module")
def cold(tmp_path_factory):
    """A first start into an empty directory: its outputs, stderr and the directory."""
    cache = tmp_path_factory.mktemp("cache")
    result, stderr = _start(cache)
    return result, stderr, cache


def test_a_second_start_loads_every_step_program(cold):
    first, stderr, cache = cold
    assert first["compilations"] > 0 and first["loads"] == 0
    assert _cache_warnings(stderr) == []
    (programs,) = cache.iterdir()  # one folder per jaxlib version
    import jaxlib

    assert programs.name == f"xla-{jaxlib.__version__}"
    assert any(programs.iterdir())
    second, stderr = _start(cache)
    assert second["tokens"] == first["tokens"]
    assert second["loads"] == second["compilations"] == first["compilations"]


def test_the_default_directory_follows_the_environment(cold, tmp_path):
    first, _, _ = cold
    home = tmp_path / "xdg"
    result, _ = _start("default", env=_env(XDG_CACHE_HOME=str(home)))
    assert result["tokens"] == first["tokens"]
    assert (home / "paxkv").is_dir()
    result, _ = _start("default", env=_env(PAXKV_CACHE_DIR=str(tmp_path / "mine")))
    assert (tmp_path / "mine").is_dir()
    off_home = tmp_path / "off-home"
    result, _ = _start("default", env=_env(PAXKV_CACHE_DIR="off", XDG_CACHE_HOME=str(off_home)))
    assert result["tokens"] == first["tokens"] and result["loads"] == 0
    assert not off_home.exists() and not (tmp_path / "off").exists()


def test_an_unusable_directory_is_one_warning_and_a_cold_start(cold, tmp_path):
    first, _, _ = cold
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    result, stderr = _start(blocker / "cache")
    assert result["tokens"] == first["tokens"] and result["loads"] == 0
    warnings = _cache_warnings(stderr)
    assert len(warnings) == 1 and "cannot be used" in warnings[0], stderr[-2000:]


def test_corrupt_entries_are_one_warning_and_compiled_again(cold, tmp_path):
    first, _, _ = cold
    # Its own directory: JAX's keys depend on where the cache is (XLA's own caches
    # live under it), so entries copied elsewhere would just be misses.
    cache = tmp_path / "broken"
    _start(cache)
    entries = list(next(cache.iterdir()).glob("*-cache"))
    for entry in entries:
        entry.write_bytes(b"\x00garbage")
    result, stderr = _start(cache)
    assert result["tokens"] == first["tokens"]
    assert result["loads"] < result["compilations"]
    warnings = _cache_warnings(stderr)
    assert len(warnings) == 1 and "cannot be read or written" in warnings[0], stderr[-2000:]


def test_a_full_disk_is_one_warning_and_a_cold_start(cold, tmp_path):
    first, _, _ = cold
    result, stderr = _start(tmp_path / "full", full=True)
    assert result["tokens"] == first["tokens"] and result["loads"] == 0
    warnings = _cache_warnings(stderr)
    assert len(warnings) == 1 and "cannot be read or written" in warnings[0], stderr[-2000:]
    again, _ = _start(tmp_path / "full")  # nothing it half wrote is read as a program
    assert again["tokens"] == first["tokens"]


def test_another_versions_entries_are_never_read(cold, tmp_path):
    first, _, cache = cold
    other = tmp_path / "versions"
    stale = other / "xla-0.0.1"  # what an older jaxlib left: garbage to this one
    stale.mkdir(parents=True)
    for entry in next(cache.iterdir()).iterdir():
        (stale / entry.name).write_bytes(b"\x00stale")
    result, stderr = _start(other)
    assert result["tokens"] == first["tokens"] and result["loads"] == 0
    assert _cache_warnings(stderr) == []
    assert {p.name for p in stale.iterdir()} == {p.name for p in next(cache.iterdir()).iterdir()}


def test_two_processes_fill_one_directory_at_once(cold, tmp_path):
    first, _, _ = cold
    shared = tmp_path / "shared"
    procs = [_start(shared, wait=False) for _ in range(2)]
    for proc in procs:
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err[-3000:]
        assert json.loads(out.splitlines()[-1])["tokens"] == first["tokens"]
        assert _cache_warnings(err) == []
    third, _ = _start(shared)
    assert third["loads"] == third["compilations"]


def test_bad_cache_dir_values_are_refused():
    from paxkv import LLM

    with pytest.raises(TypeError, match="cache_dir must be a path or 'off', got 3"):
        LLM("tiny", cache_dir=3, warmup=False)


def test_the_cache_module_never_runs_at_import(tmp_path):
    # Importing paxkv (or building nothing) leaves the default directory alone.
    env = _env(XDG_CACHE_HOME=str(tmp_path))
    subprocess.run([sys.executable, "-c", "import paxkv.engine"], env=env, check=True)
    assert not pathlib.Path(tmp_path, "paxkv").exists()
