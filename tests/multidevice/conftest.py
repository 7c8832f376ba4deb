"""8 forced CPU devices for the mesh tests; set before JAX starts (run them in their own process)."""

import os

import pytest

NUM_DEVICES = 8
_FLAG = f"--xla_force_host_platform_device_count={NUM_DEVICES}"

if _FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FLAG}".strip()


@pytest.fixture(scope="session", autouse=True)
def eight_devices():
    import jax

    if jax.device_count() < NUM_DEVICES:
        pytest.fail(
            f"{jax.device_count()} devices: JAX started before XLA_FLAGS={_FLAG} was set; run "
            "`PAXKV_MULTIDEVICE_TESTS=1 python -m pytest tests/multidevice` in a fresh process"
        )


@pytest.fixture(scope="module")
def serve_oracle():
    """The serving tests' oracle: the engine `serve_processes` serves, on one device."""
    from serve_processes import ENGINE, MAX_MODEL_LEN, MODEL

    from paxkv import LLM

    return LLM(MODEL, dtype="float32", warmup=False, max_model_len=MAX_MODEL_LEN, **ENGINE)
