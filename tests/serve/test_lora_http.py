"""LoRA adapters over HTTP, through the `openai` client: `--lora_modules`, `model=<adapter>`,
`/v1/models`, and vLLM's load and unload endpoints; every answer equals the in-process
`LLM` under the same adapter (whose tokens equal PEFT's: tests/lora)."""

import tempfile

import httpx
import openai
import pytest
from peft_adapters import write_random_adapter
from serve_env import ENGINE, MAX_MODEL_LEN, Server

from paxkv import LLM, LoRARequest, SamplingParams

LORA_FLAGS = (
    "--enable_lora",
    "--max_loras=1",
    "--max_lora_rank=8",
    "--allow_runtime_lora_updating",
)
PROMPT = "def add(a, b):"


@pytest.fixture(scope="module")
def oracle():
    return LLM(
        "tiny-py",
        warmup=False,
        max_model_len=MAX_MODEL_LEN,
        enable_lora=True,
        max_loras=1,
        max_lora_rank=8,
        **ENGINE,
    )


@pytest.fixture(scope="module")
def adapters(oracle):
    root = tempfile.mkdtemp()
    config = oracle.engine.model_config
    targets = ["q_proj", "v_proj", "down_proj"]
    return {
        "a1": write_random_adapter(f"{root}/a1", config, r=4, alpha=8, targets=targets, seed=1),
        "a2": write_random_adapter(f"{root}/a2", config, r=8, alpha=8, targets=targets, seed=2),
        "big": write_random_adapter(f"{root}/big", config, r=16, alpha=8, targets=targets, seed=3),
    }


@pytest.fixture(scope="module")
def server(adapters):
    s = Server(*LORA_FLAGS, f"--lora_modules=a1={adapters['a1']}")
    yield s
    s.stop()


def _expected(oracle, adapters, name):
    lora = None if name is None else LoRARequest(name, 1 if name == "a1" else 2, adapters[name])
    params = SamplingParams(temperature=0.0, max_tokens=12)
    return oracle.generate(PROMPT, params, use_tqdm=False, lora_request=lora)[0].outputs[0].text


def test_adapters_by_model_name(server, oracle, adapters):
    client = openai.OpenAI(base_url=server.url, api_key="none")
    ids = [m.id for m in client.models.list().data]
    assert ids[1:] == ["a1"] and ids[0] != "a1"
    texts = {}
    for model in (ids[0], "a1"):
        out = client.completions.create(model=model, prompt=PROMPT, temperature=0, max_tokens=12)
        assert out.model == model
        texts[model] = out.choices[0].text
    assert texts["a1"] == _expected(oracle, adapters, "a1")
    assert texts[ids[0]] == _expected(oracle, adapters, None)
    assert texts["a1"] != texts[ids[0]]  # the adapter changes what the model says
    with pytest.raises(openai.NotFoundError, match="a2"):
        client.completions.create(model="a2", prompt=PROMPT, max_tokens=2)


def test_load_and_unload_at_run_time(server, oracle, adapters):
    client = openai.OpenAI(base_url=server.url, api_key="none")
    r = httpx.post(
        f"{server.url}/load_lora_adapter", json={"lora_name": "a2", "lora_path": adapters["a2"]}
    )
    assert r.status_code == 200, r.text
    assert [m.id for m in client.models.list().data][1:] == ["a1", "a2"]
    # One slot (--max_loras=1): the two adapters take turns in it.
    for name in ("a2", "a1", "a2"):
        out = client.completions.create(model=name, prompt=PROMPT, temperature=0, max_tokens=12)
        assert out.choices[0].text == _expected(oracle, adapters, name)
    metrics = server.metrics()  # a2, a1, a2 took turns in the one slot
    assert metrics["paxkv:lora_loads_total"] >= 3 and metrics["paxkv:lora_evictions_total"] >= 2
    assert metrics["paxkv:lora_resident"] == 1
    r = httpx.post(f"{server.url}/unload_lora_adapter", json={"lora_name": "a2"})
    assert r.status_code == 200, r.text
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="a2", prompt=PROMPT, max_tokens=2)
    assert (
        httpx.post(f"{server.url}/unload_lora_adapter", json={"lora_name": "a2"}).status_code == 404
    )


def test_a_bad_adapter_is_refused_naming_the_field(server, adapters):
    r = httpx.post(
        f"{server.url}/load_lora_adapter", json={"lora_name": "big", "lora_path": adapters["big"]}
    )
    assert r.status_code == 400
    assert "max_lora_rank=8" in r.json()["error"]["message"]
    r = httpx.post(f"{server.url}/load_lora_adapter", json={"lora_name": "x", "lora_path": "/nope"})
    assert r.status_code == 400 and "/nope" in r.json()["error"]["message"]
    client = openai.OpenAI(base_url=server.url, api_key="none")
    assert "big" not in [m.id for m in client.models.list().data]
    # The server still serves.
    out = client.completions.create(model="a1", prompt=PROMPT, temperature=0, max_tokens=3)
    assert out.choices[0].finish_reason == "length"
