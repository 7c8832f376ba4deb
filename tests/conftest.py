"""The suite's collection and its XLA settings.

`multidevice/` runs in its own process (see test_multidevice.py): those tests need 8 host
devices, which XLA creates only when `XLA_FLAGS` is set before JAX starts, so this
process leaves them to a child that sets it.

Compiling is most of the suite's time (the models are tiny; a warm compilation cache runs
the engine tests 4x faster), so XLA:CPU compiles its code here with LLVM at -O0 and
without its expensive passes: the same HLO and IEEE semantics (fast-math stays off),
less machine-code optimisation, so results may differ only in the last bits (fused
multiply-adds). `PAXKV_TEST_XLA_OPT=1` runs the
suite with XLA's default optimisation instead. Set before any test module imports JAX;
child processes (the launch and multidevice tests) inherit it.
"""

import gc
import os

import pytest
from multidevice_env import MULTIDEVICE_ENV

_FAST_COMPILE = ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true")

if os.environ.get("PAXKV_TEST_XLA_OPT") != "1":
    _flags = os.environ.get("XLA_FLAGS", "").split()
    os.environ["XLA_FLAGS"] = " ".join(_flags + [f for f in _FAST_COMPILE if f not in _flags])

# One persistent compilation cache for every JAX process of the session (the workers,
# the servers and apps they start, the multidevice child suites): a step shape one of
# them compiled is loaded, not compiled again, by the others (a tiny-py server is ready
# in 3 s instead of 9). Kept in the checkout (`.pytest_cache`, which git ignores); a fresh
# clone starts empty. The cache key holds the HLO, the XLA flags and the versions, so a
# changed program is compiled anew. A hit still counts as a compilation for
# `paxkv.engine.compilations` (JAX reports the backend compile event around the lookup).
_CACHE_DIR = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    ".pytest_cache",
    "jax-compilation-cache",
)
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _CACHE_DIR)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")

collect_ignore = [] if os.environ.get(MULTIDEVICE_ENV) else ["multidevice"]

# Every executable XLA:CPU compiles holds memory maps; a worker that compiles thousands
# of step shapes reaches the kernel's vm.max_map_count (65530 here), and LLVM's next
# mmap fails as a segfault inside a compile (seen as a worker "node down"). Past half
# of the limit, the caches are dropped after a test module, freeing their executables.
_MAX_MAPS = "/proc/sys/vm/max_map_count"


def _num_maps() -> tuple[int, int]:
    try:
        with open("/proc/self/maps") as maps, open(_MAX_MAPS) as limit:
            return sum(1 for _ in maps), int(limit.read())
    except OSError:
        return 0, 1


@pytest.fixture(autouse=True, scope="module")
def _bounded_memory_maps():
    """Drops JAX's caches after a module when this process holds over half of the
    memory maps the kernel allows."""
    yield
    used, limit = _num_maps()
    if used > limit // 2:
        import jax

        from paxkv.engine import programs

        jax.clear_caches()
        programs.clear_compiled()
        gc.collect()


# The files that take over a minute and a half of a worker, longest first (measured
# with `pytest --junitxml` on a 2-core machine, summing each file's test times): the
# two multidevice child suites, the docs' runnable blocks, the model and kernel suites.
LONGEST_FILES = (
    "tests/test_multidevice.py",
    "tests/test_docs.py",
    "tests/test_multidevice_servers.py",
    "tests/models/test_moe.py",
    "tests/kernels/test_gpu_kernel.py",
    "tests/models/test_layer_stack.py",
    "tests/kernels/test_tpu_kernel.py",
    "tests/models/test_gemma.py",
    "tests/engine/test_no_compile_after_warmup.py",
    "tests/engine/test_speculative.py",
)


def pytest_collection_modifyitems(items):
    """The longest files first (`LONGEST_FILES`), the rest in their order: pytest-xdist
    (a worker per core, a file per worker, files handed out in this order with
    `--no-loadscope-reorder`) then runs them side by side while the short files fill
    the end, instead of one worker finishing a long file alone."""
    rank = {path: i for i, path in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))


def pytest_sessionfinish(session):
    """Collects the suite's garbage now, while the session is still counted as running,
    and freezes what survives.

    Under pytest-xdist a worker reports itself finished after this hook; the controller
    then tells it to exit, and execnet sends a worker still busy 5 s later a SIGINT.
    The work left after the report is pytest's own `gc.collect()` at unconfigure, over
    every object the suite left (JAX, transformers, hypothesis's runs), finalizers
    included: a SIGINT landing in a finalizer is printed ("Exception ignored in ...
    KeyboardInterrupt") after a passing run. Here the finalizers run before the report,
    and `gc.freeze()` leaves the later collection nothing to traverse.
    """
    gc.collect()
    gc.freeze()
