"""The platform every launch app checks before loading, and the line it prints first.

The apps run as subprocesses (their absl flags would clash in this process), all at once.
A platform is requested that this CPU machine lacks (`JAX_PLATFORMS=tpu`, `cuda`): each
app must end with one line naming the runtime and its install extra, before it loads
anything.
"""

import concurrent.futures
import os
import subprocess
import sys
from importlib import metadata

import jax
import pytest
from test_launch import _ok, _one_line_error

from paxkv.launch import platform

APPS = ("generate", "bench", "serve", "quality", "demo", "train")
# A missing platform, by JAX_PLATFORMS: what the error line must name.
MISSING = {
    "tpu": ("the TPU runtime (libtpu) is not installed", "pip install -e '.[tpu]'"),
    "cuda": ("the CUDA plugin (jax-cuda12-plugin) is not installed", "pip install -e '.[cuda]'"),
}
DEMO = ["-m", "paxkv.launch.demo", "--num_seqs=2", "--max_model_len=64"]


def _installed(name):
    try:
        metadata.distribution(name)
    except metadata.PackageNotFoundError:
        return False
    return True


def _commands(tmp):
    commands = {}
    for requested in MISSING:
        for app in APPS:
            # train writes nowhere it should not if it got that far: its own tmp dir.
            extra = [f"--out_dir={tmp / 'train'}"] if app == "train" else []
            argv = [sys.executable, "-m", f"paxkv.launch.{app}", *extra]
            commands[f"{app}_{requested}"] = (argv, {"JAX_PLATFORMS": requested})
    # JAX left to choose: it tries the TPU first, which this machine lacks.
    commands["demo_unset"] = ([sys.executable, *DEMO], {"JAX_PLATFORMS": None})
    commands["demo_cpu"] = (
        [sys.executable, *DEMO, "--backend=reference"],
        {"JAX_PLATFORMS": "cpu"},
    )
    return commands


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("platform")

    def run(argv, env):
        full = {k: v for k, v in (os.environ | env).items() if v is not None}
        return subprocess.run(argv, capture_output=True, text=True, env=full, timeout=120)

    commands = _commands(tmp)
    with concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 2) as pool:
        futures = {name: pool.submit(run, *spec) for name, spec in commands.items()}
        return {name: f.result() for name, f in futures.items()}, tmp


@pytest.mark.parametrize("requested", MISSING)
@pytest.mark.parametrize("app", APPS)
def test_missing_platform_is_one_line_naming_the_extra(runs, app, requested):
    if _installed("libtpu" if requested == "tpu" else "jax-cuda12-plugin"):
        pytest.skip(f"the {requested} runtime is installed here")
    results, tmp = runs
    result = results[f"{app}_{requested}"]
    err = _one_line_error(result)
    assert result.returncode == 2
    runtime, install = MISSING[requested]
    assert err.startswith(
        f"error: JAX_PLATFORMS={requested} asks for a platform that is not here: "
    )
    assert f"{runtime}: {install}" in err
    # Nothing was loaded, compiled or written first: the checkpoint is not blamed.
    assert "params" not in err and "checkpoint" not in err
    assert result.stdout == ""
    assert not (tmp / "train").exists()


def test_demo_prints_the_platform_first_and_no_backend_noise(runs):
    results, _ = runs
    result = results["demo_unset"]
    out = _ok(result)
    first = out.splitlines()[0]
    assert first.startswith("paxkv-demo: platform "), out
    # JAX logged each platform it could not start at INFO, on every run of every app.
    assert "Unable to initialize backend" not in result.stderr, result.stderr
    out = _ok(results["demo_cpu"])
    assert out.splitlines()[0] == (
        "paxkv-demo: platform cpu, 1 device (cpu), process 0 of 1, attention backend reference"
    )


def test_describe_runtime_here():
    kind = jax.local_devices()[0].device_kind
    n = jax.device_count()
    devices = f"{n} device{'s' if n > 1 else ''} ({kind})"
    head = f"platform {jax.default_backend()}, {devices}, process 0 of 1"
    assert platform.describe_runtime(None) == head
    assert platform.describe_runtime("reference") == f"{head}, attention backend reference"
    if jax.default_backend() == "cpu":
        assert platform.describe_runtime("auto") == f"{head}, attention backend xla (auto)"


@pytest.mark.parametrize(
    "requested, installed, expect",
    [
        ("tpu", set(), "JAX_PLATFORMS=tpu asks for a platform that is not here: the TPU runtime"),
        ("tpu,cpu", set(), "asks for a platform that is not here: the TPU runtime (libtpu) is not"),
        # Installed and failing (the TPU busy, say): JAX's reason, no install advice.
        ("tpu", {"libtpu"}, "JAX_PLATFORMS=tpu: JAX cannot start the platform: TPU in use"),
        (
            "gpu",
            set(),
            "the CUDA plugin (jax-cuda12-plugin) is not installed: pip install -e '.[cuda]'; or the ROCm plugin",
        ),
        (
            "gpu",
            {"jax-cuda13-plugin"},
            "JAX_PLATFORMS=gpu: JAX cannot start the platform: TPU in use",
        ),
        ("", set(), "JAX cannot start its backends: TPU in use"),
    ],
)
def test_platform_error(monkeypatch, requested, installed, expect):
    monkeypatch.setenv("JAX_PLATFORMS", requested)
    monkeypatch.setattr(platform, "_installed", lambda names: bool(set(names) & installed))
    message = platform._platform_error("TPU in use\n by process 7", requested)
    assert expect in message
    assert "\n" not in message
    if "not installed" in message:
        assert message.endswith("JAX says: TPU in use by process 7)")
    else:
        assert "pip install" not in message
