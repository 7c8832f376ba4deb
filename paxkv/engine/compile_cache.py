"""The persistent compilation cache, on by default: a second start loads its programs.

JAX keeps compiled programs on disk (`jax_compilation_cache_dir`), keyed by the program
(its HLO, so the model, the shapes and paxkv's code), the compile options and XLA flags,
and the jax, jaxlib and backend versions, device kind and topology: another version or
machine never loads a stale entry. paxkv turns it on for every engine, in a per-user
directory: `$PAXKV_CACHE_DIR`, else `$XDG_CACHE_HOME/paxkv`, else `~/.cache/paxkv`; the
programs go in a subfolder per jaxlib version (`xla-<version>`), which makes an old
version's entries easy to delete. `LLM(cache_dir=...)` and the launch apps'
`--compilation_cache_dir` override it; the value `off` (there, or in
`PAXKV_CACHE_DIR`) turns it off. The cache is capped at `MAX_CACHE_BYTES`, evicting the
least recently used programs, and shared safely by processes that fill it at once (a
file lock). A directory that cannot be written is one warning and a start without the
cache; entries that cannot be read or written are one warning per process and a
compilation, never an error.
"""

from __future__ import annotations

import os
import tempfile
import threading
import warnings

import jax
from absl import logging

OFF = "off"
ENV_VAR = "PAXKV_CACHE_DIR"
MAX_CACHE_BYTES = 8 << 30
# JAX's own warnings for an entry it could not read or write (`jax._src.compiler`).
_ENTRY_ERRORS = ("Error reading persistent compilation cache entry", "Error writing persistent")

_lock = threading.Lock()
_enabled: str | None = None  # the directory this process's programs are cached in
_chosen = False  # whether a caller chose it (a directory or off), not the default
_warned = False


def default_cache_dir() -> str:
    """`$PAXKV_CACHE_DIR`, else `$XDG_CACHE_HOME/paxkv`, else `~/.cache/paxkv`."""
    if os.environ.get(ENV_VAR):
        return os.environ[ENV_VAR]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "paxkv")


def programs_dir(cache_dir: str) -> str:
    """Where the programs of this jaxlib version go under `cache_dir`."""
    import jaxlib

    return os.path.join(os.path.expanduser(cache_dir), f"xla-{jaxlib.__version__}")


def enable(cache_dir: str | None = None) -> str | None:
    """Points this process's compilation cache at `cache_dir` (None: `default_cache_dir`;
    "off": none). Returns the directory programs are cached in, or None when off or
    unusable (one warning says why). A process that set JAX's cache directory itself
    (`jax_compilation_cache_dir`, `JAX_COMPILATION_CACHE_DIR`) keeps it unless
    `cache_dir` is given."""
    global _enabled, _chosen
    with _lock:
        if cache_dir is None:
            if _chosen:  # a caller chose already: a directory, or off
                return _enabled
            own = jax.config.jax_compilation_cache_dir
            if own and own != _enabled:  # set on JAX itself: kept
                _watch_entry_errors(own)
                return own
            chosen = default_cache_dir()
        else:
            _chosen, chosen = True, cache_dir
        if chosen == OFF:
            if _enabled is not None:
                jax.config.update("jax_compilation_cache_dir", None)
                _reset()
                _enabled = None
            return None
        path = programs_dir(chosen)
        if path == _enabled:
            return path
        problem = _unusable(path)
        if problem is not None:
            logging.warning(
                "paxkv: the compilation cache at %s cannot be used (%s): programs are "
                "compiled without it (%s=off turns it off)",
                path,
                problem,
                ENV_VAR,
            )
            return None
        jax.config.update("jax_compilation_cache_dir", path)
        # Every step program is worth keeping: a load takes milliseconds.
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        if _has_filelock():  # JAX locks a capped cache with it
            jax.config.update("jax_compilation_cache_max_size", MAX_CACHE_BYTES)
        _reset()
        _enabled = path
        _watch_entry_errors(path)
        return path


def _unusable(path: str) -> str | None:
    """Why `path` cannot hold the cache (it cannot be made or written), or None."""
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".probe-"):
            pass
    except OSError as e:
        return f"{type(e).__name__}: {e.strerror or e}"
    return None


def _has_filelock() -> bool:
    try:
        import filelock  # noqa: F401
    except ImportError:
        return False
    return True


def _reset() -> None:
    """Makes JAX open the cache directory anew at its next compilation (it opens it once)."""
    from jax.experimental.compilation_cache import compilation_cache

    compilation_cache.reset_cache()


def _watch_entry_errors(path: str) -> None:
    """Turns JAX's warning per unreadable or unwritable entry into one warning."""
    if getattr(warnings.showwarning, "_paxkv", False):
        return
    shown = warnings.showwarning

    def showwarning(message, category, filename, lineno, file=None, line=None):
        global _warned
        text = str(message)
        if not text.startswith(_ENTRY_ERRORS):
            return shown(message, category, filename, lineno, file, line)
        if not _warned:
            _warned = True
            logging.warning(
                "paxkv: the compilation cache at %s has entries that cannot be read or "
                "written (%s); those programs are compiled instead, and this warning is "
                "not repeated. Deleting the directory clears it.",
                jax.config.jax_compilation_cache_dir or path,
                text,
            )
        return None

    showwarning._paxkv = True
    warnings.showwarning = showwarning
