"""Bad launch flags end every app with one `error:` line and exit 2, before any work.

absl's own parser would print a FATAL block and exit 1; values it accepts but the
engine cannot use (a seed past int64, more pages than memory, an address that cannot
be served) must not end in a traceback, or fail only after the model compiled.
"""

import concurrent.futures
import os
import socket
import subprocess
import sys
import tomllib

import pytest

from paxkv.engine.config import EngineConfig

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))


def _run(argv: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    env = os.environ | {"JAX_PLATFORMS": "cpu"}
    return subprocess.run(
        [sys.executable, "-m", *argv], capture_output=True, text=True, env=env, timeout=timeout
    )


def _error_line(result: subprocess.CompletedProcess) -> str:
    """The app's error: exit 2, no traceback, stderr's last line `error: ...`."""
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr and "FATAL" not in result.stderr, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: "), result.stderr
    return last


def _console_script_modules() -> list[str]:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        scripts = tomllib.load(f)["project"]["scripts"]
    return sorted(target.split(":")[0] for target in scripts.values())


# (app, flags, what the one error line says); each fails while parsing or reading its flags.
REJECTED = [
    ("generate", ["--num_pages=abc"], "flag --num_pages=abc: invalid literal for int()"),
    (
        "serve",
        ["--port=70000"],
        "flag --port=70000: 70000 is not an integer in the range [0, 65535]",
    ),
    ("generate", ["--kv_cache_dtype=bogus"], "flag --kv_cache_dtype=bogus: value should be one of"),
    ("serve", ["--shutdown_grace_s=-1"], "flag --shutdown_grace_s=-1: -1.0 is not a non-negative"),
    (
        "plan",
        ["--seed=99999999999999999999"],
        "99999999999999999999 is not an integer in the range [0, 9223372036854775807]",
    ),
    ("generate", ["--seed=-1"], "-1 is not an integer in the range [0, "),
    (
        "serve",
        ["--num_pages=4294967296"],
        "4294967296 is not an integer in the range [1, 2147483647]",
    ),
    (
        "serve",
        ['--speculative_config={"method": ngram}'],
        """error: --speculative_config: not valid JSON (Expecting value): '{"method": ngram}'""",
    ),
    (
        "generate",
        ["--speculative_config=[4]"],
        "error: --speculative_config: expected a JSON object, got list: '[4]'",
    ),
    (
        "generate",
        ["--prompts_file=/nonexistent/prompts.txt"],
        "error: --prompts_file=/nonexistent/prompts.txt: No such file or directory",
    ),
    # A value of the wrong type is one error line too, naming the field it was given for.
    (
        "generate",
        ['--speculative_config={"num_speculative_tokens": 4.0}'],
        "error: --speculative_config: speculative_config.num_speculative_tokens must be an "
        "integer, got 4.0",
    ),
    (
        "serve",
        ['--speculative_config={"num_speculative_tokens": 1e400}'],
        "speculative_config.num_speculative_tokens must be an integer, got inf",
    ),
    (
        "generate",
        ['--speculative_config={"prompt_lookup_max": true}'],
        "speculative_config.prompt_lookup_max must be an integer, got True",
    ),
]


@pytest.fixture(scope="module")
def rejected():
    def run(case):
        app, argv, _ = case
        return _run([f"paxkv.launch.{app}", *argv])

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        return list(pool.map(run, REJECTED))


@pytest.mark.parametrize("i", range(len(REJECTED)), ids=[" ".join(c[1]) for c in REJECTED])
def test_a_flag_absl_rejects_is_one_error_line_and_exit_2(rejected, i):
    result = rejected[i]
    assert result.stderr.count("\n") == 1, result.stderr  # nothing else: no usage block
    assert REJECTED[i][2] in _error_line(result), result.stderr


def test_every_app_reports_an_unknown_flag_the_same_way():
    modules = _console_script_modules()
    assert len(modules) >= 8, modules
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda m: _run([m, "--no_such_flag=1"]), modules))
    for module, result in zip(modules, results, strict=True):
        assert _error_line(result) == "error: Unknown command line flag 'no_such_flag'", module


def test_the_engine_config_bounds_the_seed_as_the_flag_does():
    assert EngineConfig(seed=2**63 - 1).seed == 2**63 - 1
    for seed in (2**63, -1):
        with pytest.raises(ValueError, match=f"seed={seed} must be in"):
            EngineConfig(seed=seed)


def test_more_pages_than_memory_is_one_error_line_naming_the_flag():
    # 200M pages of the tiny model's 32 KiB: terabytes, refused by the allocator at once.
    result = _run(["paxkv.launch.generate", "--num_pages=200000000", "--prompt=x"])
    error = _error_line(result)
    assert "out of device memory (RESOURCE_EXHAUSTED" in error, error
    assert "--num_pages=200000000" in error and "lower --num_pages" in error, error


def test_serve_checks_its_address_before_loading_the_model():
    result = _run(["paxkv.launch.serve", "--host=256.1.1.1"])
    assert result.stderr.count("\n") == 1, result.stderr  # before the platform line, the load
    assert _error_line(result).startswith("error: --host='256.1.1.1' is not an address to listen")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = _run(["paxkv.launch.serve", f"--port={port}"])
    assert result.stderr.count("\n") == 1, result.stderr
    assert _error_line(result) == (
        f"error: cannot listen on --host=127.0.0.1 --port={port}: Address already in use"
    )


@pytest.mark.parametrize("process_id", [0, 1], ids=["waits_for_others", "no_coordinator"])
def test_a_job_that_never_forms_ends_in_the_stated_time_with_one_line(process_id):
    # Process 1 finds no coordinator; process 0 (the coordinator) sees no process 1. JAX's
    # own deadline would abort with SIGABRT and a C++ stack trace.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = [
        "paxkv.launch.generate",
        "--prompt=x",
        "--jax_distributed",
        f"--coordinator_address=127.0.0.1:{port}",
        "--num_processes=2",
        f"--process_id={process_id}",
        "--distributed_init_timeout_s=3",
    ]
    result = _run(argv, timeout=60)
    assert result.returncode == 1, (result.returncode, result.stderr[-3000:])
    last = result.stderr.strip().splitlines()[-1]
    assert last == (
        f"paxkv: process {process_id} could not join the jax.distributed job at "
        f"127.0.0.1:{port} within --distributed_init_timeout_s=3: is every process "
        "started, with the same --coordinator_address and --num_processes?"
    ), result.stderr[-3000:]
    assert "Check failure" not in result.stderr, result.stderr[-3000:]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--lora_modules=sql=/ckpt/sql"], "error: --lora_modules needs --enable_lora"),
        (
            ["--enable_lora", "--lora_modules=sql"],
            "error: --lora_modules entry 'sql' must be name=path",
        ),
        (
            ["--enable_lora", "--lora_modules=a=/x,a=/y"],
            "error: --lora_modules names 'a' twice",
        ),
        (
            ["--allow_runtime_lora_updating"],
            "error: --allow_runtime_lora_updating needs --enable_lora",
        ),
    ],
)
def test_serve_checks_its_lora_modules_before_loading_the_model(flags, message):
    result = _run(["paxkv.launch.serve", "--port=0", *flags])
    assert _error_line(result) == message
