"""What the apps and the API say at the front door: install hints, refusals, defaults.

The apps run as subprocesses (their absl flags would clash in this process).
"""

import os
import subprocess
import sys
import tomllib

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))


def _run(code_or_module: list[str], timeout: float = 180) -> subprocess.CompletedProcess:
    env = os.environ | {"JAX_PLATFORMS": "cpu"}
    return subprocess.run(
        [sys.executable, *code_or_module], capture_output=True, text=True, env=env, timeout=timeout
    )


def _one_line_error(result: subprocess.CompletedProcess, status: int = 2) -> str:
    """The last line of stderr, which must be the app's one `error:` line, and no traceback."""
    assert result.returncode == status, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: "), result.stderr
    return last


def test_the_serve_extra_brings_the_tokenizers_extra():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    assert set(extras["tokenizers"]) <= set(extras["serve"])


def test_serve_without_jinja2_refuses_a_chat_template_at_start():
    pytest.importorskip("uvicorn")
    code = (
        "import sys; sys.modules['jinja2'] = None; "
        "sys.argv = ['paxkv-serve', '--max_model_len=32', '--num_pages=16', "
        "'--max_num_seqs=2', '--max_num_batched_tokens=16', '--chat_template={{ messages }}']; "
        "from paxkv.launch import serve; serve.run()"
    )
    error = _one_line_error(_run(["-c", code]))
    assert "--chat_template over" in error and "chat templates need jinja2" in error, error
    assert "'.[serve]'" in error, error


def test_demo_on_a_device_not_here_is_one_error_line():
    result = _run(["-m", "paxkv.launch.demo", "--backend=tpu"])
    assert result.stderr.count("\n") == 1, result.stderr
    error = _one_line_error(result)
    assert (
        error == "error: backend='tpu' needs a TPU; this platform is 'cpu' (auto runs 'xla' here)"
    )
    from paxkv.measure.ragged_batch_demo import run_demo

    with pytest.raises(ValueError, match="backend='gpu' needs a GPU; this platform is 'cpu'"):
        run_demo(num_seqs=2, max_model_len=64, backend="gpu")
    # What the help says auto runs on the CPU is what runs.
    assert run_demo(num_seqs=2, max_model_len=64).backend == "xla"
    help_text = _run(["-m", "paxkv.launch.demo", "--help"]).stdout
    assert "the 'xla' loop on the CPU" in " ".join(help_text.split()), help_text


def test_max_model_len_defaults_of_llm_and_the_apps_and_why_they_differ():
    import dataclasses

    from paxkv import LLM
    from paxkv.engine import EngineConfig
    from paxkv.launch.setups import get_setup
    from paxkv.models import training as train

    setup = get_setup("tiny-py")  # paxkv-serve's default --config
    positions = setup.model.max_position_embeddings
    llm = LLM("tiny-py", warmup=False)
    assert llm.engine.config.max_model_len == min(positions, EngineConfig.max_model_len) == 2048
    # What LLM's docstring says gives the server's limits does.
    assert "config=paxkv.launch.setups.get_setup(name).engine" in " ".join(LLM.__doc__.split())
    served = LLM("tiny-py", warmup=False, config=setup.engine)
    assert served.engine.config.max_model_len == setup.engine.max_model_len == 512
    # The set-up's reasons hold: the trained window fits, and fewer shapes to warm up.
    assert train.TrainConfig().seq_len <= setup.engine.max_model_len
    longer = dataclasses.replace(setup.engine, max_model_len=EngineConfig.max_model_len)
    assert len(setup.engine.buckets().shapes()) < len(longer.buckets().shapes())
    # And the server's flag says where its default comes from.
    help_text = " ".join(_run(["-m", "paxkv.launch.serve", "--help"]).stdout.split())
    assert (
        "--max_model_len: Longest sequence, prompt and output. Unset: --setup's value "
        "(paxkv.launch.setups), not the EngineConfig default LLM() uses." in help_text
    ), help_text
