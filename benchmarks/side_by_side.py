"""Benchmarks that run this checkout's code beside another commit's, each in fresh
child processes (`startup`, `sampler_split`): the children's environment."""

import os


def child_env(cache_dir: str, pythonpath: str | None) -> dict:
    """A child's environment: JAX's default XLA flags, `cache_dir` as its compilation
    cache ("off": none), and this checkout's code or the copy at `pythonpath`."""
    env = {
        k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_COMPILATION_CACHE_DIR")
    }
    env["PAXKV_CACHE_DIR"] = cache_dir
    # This checkout's code, or the other copy's: run from the cache folder, so the
    # working directory shadows neither.
    env["PYTHONPATH"] = pythonpath or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return env
