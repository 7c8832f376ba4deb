"""The launch apps end to end, as subprocesses, and the pieces they are built from.

The apps define absl flags, so they run in subprocesses (their flags would clash with
other apps' in this process), all started at once to keep the suite fast.
"""

import concurrent.futures
import json
import os
import subprocess
import sys
from importlib import metadata

import pytest

from paxkv.launch import json_object, read_prompts
from paxkv.launch.setups import NAMES, ServingSetup, get_setup
from paxkv.models import CHECKPOINTS, PRESETS, init_model, save_hf_checkpoint
from paxkv.models.llama_config import TINY
from paxkv.planner import capacity as plan
from paxkv.planner import kv_budget, parameters

# Small limits so that the tiny model compiles one step shape, once.
TINY_FLAGS = [
    "--max_model_len=128",
    "--num_pages=64",
    "--max_num_seqs=4",
    "--max_num_batched_tokens=16",
    "--max_tokens=3",
]


# The load benchmark at toy size: 4 requests of fixed lengths, 2 contiguous slots.
BENCH_FLAGS = [
    "--workload=fixed",
    "--fixed_prompt_len=8,40",
    "--fixed_output_len=4,12",
    "--num_requests=4",
    "--max_model_len=128",
    "--max_num_seqs=4",
    "--max_num_batched_tokens=64",
    "--kv_budget_mib=0.5",  # 16 pages of 32 KiB: 15 usable, 8 per 128-token sequence
    "--guess_tokens=16",
]


def _damage_config(path):
    hf = json.loads((path / "config.json").read_text())
    del hf["hidden_size"]
    (path / "config.json").write_text(json.dumps(hf))


def _truncate_weights(path):
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])


def _garbage_tokenizer(path):
    (path / "tokenizer.json").write_text("garbage")


def _nan_weight(path):
    from safetensors.numpy import load_file, save_file

    tensors = load_file(str(path / "model.safetensors"))
    tensors["model.norm.weight"][3] = float("nan")
    save_file(tensors, str(path / "model.safetensors"))


# Damaged tiny checkpoints, by name: how each is damaged, and what its one error line names.
DAMAGED = {
    "missing_field": (_damage_config, "config.json: missing field 'hidden_size'"),
    "truncated": (_truncate_weights, "model.safetensors: not a complete safetensors file"),
    "bad_tokenizer": (_garbage_tokenizer, "tokenizer.json: not a readable tokenizer file"),
    "nan_weight": (_nan_weight, "model.safetensors: ['model.norm.weight']"),
}


def _damaged_checkpoints(tmp):
    """Writes each of `DAMAGED` as a tiny Hugging Face checkpoint under `tmp`."""
    model = init_model(TINY, 0)
    for name, (damage, _) in DAMAGED.items():
        save_hf_checkpoint(model, tmp / name)
        damage(tmp / name)


def _commands(tmp):
    _damaged_checkpoints(tmp)
    jsonl = tmp / "prompts.jsonl"
    jsonl.write_text('{"prompt": "from the file"}\n\n{"prompt_token_ids": [72, 105]}\n')
    bad = tmp / "bad.jsonl"
    bad.write_text('{"prompt": "fine"}\n{"prompt": 3}\n')
    generate = [sys.executable, "-m", "paxkv.launch.generate"]
    plan_app = [sys.executable, "-m", "paxkv.launch.plan"]
    bench = [sys.executable, "-m", "paxkv.launch.bench"]
    return {
        "generate": [
            *generate,
            *TINY_FLAGS,
            "--prompt=first flag prompt",
            "--prompt=second",
            f"--prompts_file={jsonl}",
        ],
        "generate_default": [*generate, "--max_tokens=4"],
        "generate_bad_file": [*generate, f"--prompts_file={bad}"],
        **{
            f"generate_{name}": [*generate, f"--model_dir={tmp / name}", "--prompt=x"]
            for name in DAMAGED
        },
        "quality_truncated": [
            sys.executable,
            "-m",
            "paxkv.launch.quality",
            f"--model={tmp / 'truncated'}",
        ],
        "bench_nan_weight": [*bench, *BENCH_FLAGS, f"--model_dir={tmp / 'nan_weight'}"],
        "generate_unknown_config": [*generate, "--setup=llama-9", "--prompt=x"],
        "generate_needs_weights": [*generate, "--setup=llama-3.1-8b", "--prompt=x"],
        "plan_tiny": [*plan_app, "--setup=tiny", "--kv_budget_gib=0.01", "--workload=fixed"],
        "plan_8b": [
            *plan_app,
            "--setup=llama-3.1-8b",
            "--device=H200",
            "--num_samples=5000",
            f"--json_out={tmp / 'plan.json'}",
        ],
        "plan_too_small": [*plan_app, "--setup=llama-3.1-8b", "--kv_budget_gib=0.5"],
        "plan_zero_budget": [*plan_app, "--kv_budget_gib=0"],
        "bench": [
            *bench,
            *BENCH_FLAGS,
            f"--json_out={tmp / 'bench.json'}",
            f"--plot_out={tmp / 'bench.png'}",
        ],
        "bench_bad_rate": [*bench, *BENCH_FLAGS, "--request_rate=0"],
        "bench_too_small": [*bench, *BENCH_FLAGS, "--kv_budget_mib=0.1"],
        "bench_unknown_config": [*bench, "--setup=nope"],
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("launch")
    env = os.environ | {"JAX_PLATFORMS": "cpu"}
    run = lambda argv: subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120)
    commands = _commands(tmp)
    with concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 2) as pool:
        futures = {name: pool.submit(run, argv) for name, argv in commands.items()}
        results = {name: f.result() for name, f in futures.items()}
    return results, tmp


def _ok(result):
    assert result.returncode == 0, result.stderr
    return result.stdout


def _error(result):
    assert result.returncode != 0, result.stdout
    assert "Traceback" not in result.stderr, result.stderr
    return result.stderr


def _one_line_error(result):
    """The app's error: one line on stderr, nothing else there, a non-zero exit."""
    err = _error(result)
    assert err.count("\n") == 1 and err.startswith("error: "), err
    return err


@pytest.mark.parametrize("name", DAMAGED)
def test_generate_damaged_checkpoint_is_one_line(runs, name):
    results, tmp = runs
    err = _one_line_error(results[f"generate_{name}"])
    assert f"{tmp / name}/{DAMAGED[name][1]}" in err


def test_quality_and_bench_damaged_checkpoint_is_one_line(runs):
    results, tmp = runs
    err = _one_line_error(results["quality_truncated"])
    assert f"{tmp / 'truncated'}/model.safetensors: not a complete" in err
    err = _one_line_error(results["bench_nan_weight"])
    assert f"{tmp / 'nan_weight'}/model.safetensors: ['model.norm.weight']" in err


def test_generate_prompts_from_flags_and_a_jsonl_file(runs):
    results, _ = runs
    out = _ok(results["generate"])
    # Flag prompts first, then the file's, in order; each gets max_tokens tokens.
    for i, prompt in enumerate(["'first flag prompt'", "'second'", "'from the file'", "[72, 105]"]):
        assert f"[{i}] prompt: {prompt}" in out
        assert f"[{i}] completion: " in out
    assert out.count("(3 tokens, length)") == 4
    assert "--- stats ---" in out
    assert "requests: 4, prompt tokens: 38, generated tokens: 12" in out
    assert "compilations: 1, steps: " in out and "preemptions: 0" in out
    assert "tokens/s" in out


def test_generate_default_run_shows_tiny_py_text(runs):
    results, _ = runs
    result = results["generate_default"]
    first, out = _ok(result).split("\n", 1)
    # What it runs on first (`paxkv.launch.platform`), then the default prompts,
    # completed by the trained model that ships with the package.
    assert first == (
        "paxkv-generate: platform cpu, 1 device (cpu), process 0 of 1, attention backend xla (auto)"
    )
    assert out.startswith("[0] prompt: 'import os'\n[0] completion: ")
    assert "[1] prompt: 'class Stack:'" in out and out.count("(4 tokens, length)") == 2
    assert "requests: 2, prompt tokens: 21, generated tokens: 8" in out
    assert "orbax" not in result.stderr and "Restoring" not in result.stderr, result.stderr


def test_generate_bad_input(runs):
    results, tmp = runs
    err = _error(results["generate_bad_file"])
    assert f"error: {tmp / 'bad.jsonl'}:2: expected" in err
    err = _error(results["generate_unknown_config"])
    assert (
        "unknown set-up 'llama-9'; known set-ups: tiny, tiny-py, tiny-gemma3, llama-3.2-1b" in err
    )
    err = _error(results["generate_needs_weights"])
    assert "--model_dir=" in err


def test_plan_tiny(runs):
    results, _ = runs
    out = _ok(results["plan_tiny"])
    assert out.startswith("# KV capacity plan: tiny\n")
    assert "| float32 (auto) | 2048 |" in out  # 2 layers x 2 heads x 64 x 4 bytes x K, V
    for kind in ("float32 (auto)", "int8", "fp8"):
        assert f"## Page size trade-off: {kind}" in out
    assert "| 256 | " in out


def test_plan_8b_on_h200(runs):
    results, tmp = runs
    out = _ok(results["plan_8b"])
    assert out.startswith("# KV capacity plan: llama-3.1-8b on H200\n")
    assert "0.9 x (H200 141.00 GiB - weights 14.96 GiB)" in out
    assert "| 16 * |" in out  # the chosen page size, marked in the trade-off tables
    data = json.loads((tmp / "plan.json").read_text())
    auto, int8 = data["plans"]["auto"], data["plans"]["int8"]
    assert f"| {auto['paged_concurrency']} |" in out
    assert auto["page_size"] == 16 and auto["max_model_len"] == 8192  # the config's
    assert auto["paged_concurrency"] > 10 * auto["contiguous_concurrency"]
    assert int8["paged_concurrency"] >= 1.9 * auto["paged_concurrency"]
    assert data["budget"]["device"] == "H200"


def test_plan_bad_input(runs):
    results, _ = runs
    err = _error(results["plan_too_small"])
    # One 8192-token sequence: 513 pages of 16 tokens x 32 layers x 2 x 8 x 128 x 2 bytes.
    need = 513 * 16 * 32 * 2 * 8 * 128 * 2
    assert "is too small for one sequence of max_model_len=8192" in err
    assert f"needs at least {need} bytes" in err
    assert "--kv_budget_gib=0.0 must be positive" in _error(results["plan_zero_budget"])


def test_console_scripts():
    scripts = {e.name: e.value for e in metadata.entry_points(group="console_scripts")}
    assert scripts["paxkv-generate"] == "paxkv.launch.generate:run"
    assert scripts["paxkv-plan"] == "paxkv.launch.plan:run"


# Configs.


@pytest.mark.parametrize("name", NAMES)
def test_configs(name):
    setup = get_setup(name)
    assert isinstance(setup, ServingSetup) and setup.name == name
    preset = "tiny" if setup.checkpoint == "tiny-py" else name
    # The preset's value (not a copy of its fields); a real-size set-up
    # only changes how the layers run.
    model = setup.model
    if model.scan_layers:
        assert setup.random_weights is False and model.replace(scan_layers=False) == PRESETS[preset]
    else:
        assert model is PRESETS[preset]
    assert setup.engine.page_size == 16
    assert setup.engine.max_model_len <= setup.model.max_position_embeddings
    assert setup.engine.max_num_batched_tokens >= setup.engine.max_num_seqs


def test_only_the_byte_level_toys_run_without_a_checkpoint():
    assert [n for n in NAMES if get_setup(n).random_weights] == [
        "tiny",
        "tiny-gemma3",
        "tiny-qwen3",
        "tiny-gemma2",
        "tiny-mixtral",
        "tiny-qwen3-moe",
        "tiny-gpt-oss",
    ]
    shipped = {n: get_setup(n).checkpoint for n in NAMES if get_setup(n).checkpoint}
    assert shipped == {"tiny-py": "tiny-py"} and set(shipped.values()) <= set(CHECKPOINTS)


@pytest.mark.parametrize(
    "name, device",
    [
        ("llama-3.2-1b", "v5e"),
        ("llama-3.1-8b", "H100"),
        ("mistral-7b", "H100"),
        ("qwen2.5-7b", "H100"),
        ("qwen3-8b", "H100"),
        ("gemma-2-9b", "H100"),
        ("gemma-3-4b", "H100"),
    ],
)
def test_real_configs_fit_their_device(name, device):
    setup = get_setup(name)
    budget = kv_budget.KVBudget.on_device(
        device, weights_bytes=parameters.weights_bytes(setup.model), kv_fraction=0.9
    )
    p = plan.plan_capacity(
        setup.model,
        kv_budget_bytes=budget.kv_budget_bytes,
        page_size=setup.engine.page_size,
        lengths=[setup.engine.max_model_len],
        max_model_len=setup.engine.max_model_len,
    )
    # Pages of the engine's KV-cache groups: fewer layers a page for hybrid models.
    assert setup.engine.num_pages <= p.group_num_pages
    assert p.group_concurrency >= 1


def test_unknown_config():
    with pytest.raises(
        ValueError, match=r"known set-ups: tiny, tiny-py, tiny-gemma3, llama-3\.2-1b, llama-3\.1-8b"
    ):
        get_setup("llama-9")


# Prompt files.


def test_read_prompts_text(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("Hello there\n\n  indented, kept  \r\nlast")
    assert read_prompts(path) == ["Hello there", "  indented, kept  ", "last"]


def test_read_prompts_jsonl(tmp_path):
    lines = ['{"prompt": "a"}', '{"prompt_token_ids": [1, 2]}', "", '{"prompt": "{b}"}']
    for name in ("p.jsonl", "p.txt"):  # by extension, or by a JSON object on the first line
        path = tmp_path / name
        path.write_text("\n".join(lines) + "\n")
        assert read_prompts(path) == [
            {"prompt": "a"},
            {"prompt_token_ids": [1, 2]},
            {"prompt": "{b}"},
        ]


@pytest.mark.parametrize(
    "text, match",
    [
        ('{"prompt": "a"}\n{"prompt": "b"\n', r":2: not valid JSON"),
        ('{"prompt": "a"}\n[1, 2]\n', r":2: expected a JSON object, got list"),
        ('{"prompt": "a"}\n{"text": "b"}\n', r":2: expected .* got keys \['text'\]"),
        ('{"prompt_token_ids": [1, "2"]}\n', r":1: 'prompt_token_ids' must be a non-empty list"),
        ('{"prompt_token_ids": []}\n', r":1: 'prompt_token_ids' must be a non-empty list"),
        ("\n\n", "holds no prompts"),
    ],
)
def test_read_prompts_malformed(tmp_path, text, match):
    path = tmp_path / "p.jsonl"
    path.write_text(text)
    with pytest.raises(ValueError, match=match):
        read_prompts(path)


def test_json_object_names_where_and_shows_the_value():
    assert json_object('{"a": [1]}', "--flag") == {"a": [1]}
    with pytest.raises(ValueError, match=r"^--flag: not valid JSON \(Expecting value\): '\[a\]'$"):
        json_object("[a]", "--flag")
    with pytest.raises(ValueError, match=r"^--flag: expected a JSON object, got int: '3'$"):
        json_object("3", "--flag")
    long = "[" + "1, " * 100 + "1]"
    with pytest.raises(ValueError, match=r"got list: '\[1, 1, .*\.\.\.'$") as e:
        json_object(long, "--flag")
    assert len(str(e.value)) < len(long)  # a long value is shown cut


def test_read_prompts_missing_file(tmp_path):
    with pytest.raises(OSError):
        read_prompts(tmp_path / "nope.txt")


def test_bench_runs_three_setups(runs):
    results, tmp = runs
    out = _ok(results["bench"])
    assert out.startswith("paxkv-bench: platform cpu, 1 device (cpu), process 0 of 1, ")
    assert "| metric | paged | contiguous_max | contiguous_guess |" in out
    data = json.loads((tmp / "bench.json").read_text())
    assert set(data["setups"]) == {"paged", "contiguous_max", "contiguous_guess"}
    assert data["kv_budget_bytes"] == 16 * 32 * 1024 and data["workload"]["num_requests"] == 4
    for name, r in data["setups"].items():
        for key in (
            "peak_concurrency",
            "output_tok_per_s",
            "req_per_s",
            "kv_utilization",
            "preemptions",
            "ttft_p50_s",
        ):
            assert key in r, (name, key)
        assert r["num_requests"] == 4 and r["recompilations_after_warmup"] == 0
    assert data["setups"]["contiguous_max"]["peak_concurrency"] == 1  # 15 usable pages / 8
    assert data["setups"]["paged"]["peak_concurrency"] > 1
    assert (tmp / "bench.png").read_bytes()[:4] == b"\x89PNG"


def test_bench_bad_input(runs):
    results, _ = runs
    assert "--request_rate=0.0 must be > 0" in _error(results["bench_bad_rate"])
    err = _error(results["bench_too_small"])
    assert "cannot hold one sequence of max_model_len=128: that needs 9 pages" in err
    assert "unknown set-up 'nope'" in _error(results["bench_unknown_config"])
