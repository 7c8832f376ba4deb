"""What a launch app runs on: the check that the requested platform is here, and the line saying so.

Every app that runs on devices (all but `paxkv-plan` and the HTTP client
`paxkv-serve-bench`) calls `require_platform()` before it loads anything, so a platform
asked for (`JAX_PLATFORMS=tpu`) whose runtime is not installed ends the run with one
line naming the runtime and the extra that installs it, not with an error from the
first array made. `announce()` prints the line those apps print first: platform,
devices, processes (`jax.distributed`) and the attention backend.
"""

from __future__ import annotations

import logging as std_logging
import os
from importlib import metadata

import jax

from paxkv.pallas_kernels.dispatch import resolve_backend

# Platform (as JAX_PLATFORMS names it): the runtime it needs, the distributions that
# provide it, and the command that installs them (pyproject's accelerator extras).
RUNTIMES = {
    "tpu": ("the TPU runtime (libtpu)", ("libtpu",), "pip install -e '.[tpu]'"),
    "cuda": (
        "the CUDA plugin (jax-cuda12-plugin)",
        ("jax-cuda12-plugin", "jax-cuda13-plugin"),
        "pip install -e '.[cuda]'",
    ),
    "rocm": (
        "the ROCm plugin (jax-rocm7-plugin)",
        ("jax-rocm7-plugin",),
        "pip install 'jax[rocm7-local]' (see JAX's installation guide)",
    ),
}
_ALIASES = {"gpu": ("cuda", "rocm")}  # JAX's own platform aliases


def quiet_backend_probes() -> None:
    """Quiets JAX's INFO record of each platform it tried and could not start ("Unable to
    initialize backend 'tpu'" on a CPU-only machine): for scripts that run under absl's
    INFO logging and say what runs themselves."""
    std_logging.getLogger("jax._src.xla_bridge").setLevel(std_logging.WARNING)


def require_platform() -> str:
    """JAX's default platform ("cpu", "gpu", "tpu"), its backends started.

    Raises ValueError, one line, when JAX cannot start a platform: a requested one whose
    runtime is not installed names the runtime and its install command; otherwise JAX's
    reason. Also quiets JAX's INFO record of each platform it tried and could not start
    (a CPU-only machine logs "Unable to initialize backend 'tpu'" on every run); the
    line of `describe_runtime` says what runs.
    """
    quiet_backend_probes()
    try:
        jax.devices()
    except (RuntimeError, AssertionError) as e:  # AssertionError: no platform requested is here
        raise ValueError(_platform_error(str(e), jax.config.jax_platforms or "")) from None
    return jax.default_backend()


def describe_runtime(attention_backend: str | None) -> str:
    """One line: platform, this process's devices (and the total over processes), the
    process's index and count under `jax.distributed`, and the attention backend
    `attention_backend` resolves to here (None: the app runs no paged attention)."""
    platform = jax.default_backend()
    local, total = jax.local_device_count(), jax.device_count()
    kind = jax.local_devices()[0].device_kind
    devices = (
        f"{local} device{'s' * (local != 1)}" if local == total else f"{local} of {total} devices"
    )
    parts = [
        f"platform {platform}",
        f"{devices} ({kind})",
        f"process {jax.process_index()} of {jax.process_count()}",
    ]
    if attention_backend is not None:
        chosen = resolve_backend(attention_backend, platform)
        auto = " (auto)" if attention_backend == "auto" else ""
        parts.append(f"attention backend {chosen}{auto}")
    return ", ".join(parts)


def announce(app: str, attention_backend: str | None) -> None:
    """Prints `app: <describe_runtime(attention_backend)>` on stdout, an app's first line."""
    print(f"{app}: {describe_runtime(attention_backend)}", flush=True)


def _platform_error(reason: str, requested: str) -> str:
    """The error line for JAX's `reason`, with `requested` the platforms asked for
    (`jax_platforms`, e.g. "tpu,cpu"; "" when JAX chose)."""
    reason = " ".join(reason.split()) or "none of the platforms asked for is present"
    if not requested:
        return f"JAX cannot start its backends: {reason}"
    setting = f"JAX_PLATFORMS={os.environ.get('JAX_PLATFORMS', requested)}"
    names = [p for name in requested.split(",") for p in _ALIASES.get(name, (name,))]
    accelerators = [p for p in names if p in RUNTIMES]
    missing = [p for p in accelerators if not _installed(RUNTIMES[p][1])]
    if not missing or len(missing) < len(accelerators):  # its runtime is here, and fails
        return f"{setting}: JAX cannot start the platform: {reason}"
    needs = "; or ".join(f"{RUNTIMES[p][0]} is not installed: {RUNTIMES[p][2]}" for p in missing)
    return (
        f"{setting} asks for a platform that is not here: {needs} "
        f"(JAX_PLATFORMS=cpu runs on the CPU; JAX says: {reason})"
    )


def _installed(distributions: tuple[str, ...]) -> bool:
    for name in distributions:
        try:
            metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        return True
    return False
