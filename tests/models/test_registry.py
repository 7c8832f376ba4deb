"""The model registry: one name list for the Python API and the launch apps, each model
type's config class, model class and Hugging Face type, and sharding rules by family."""

import dataclasses
import json
import subprocess
import sys

import pytest
import transformers
from jax.sharding import AbstractMesh
from jax.sharding import PartitionSpec as P

from paxkv.launch import setups as configs
from paxkv.models import (
    BYTE_LEVEL_PRESETS,
    CHECKPOINTS,
    FAMILIES,
    PRESETS,
    ByteTokenizer,
    GemmaConfig,
    GemmaForCausalLM,
    GptOssConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MoeConfig,
    MoeForCausalLM,
    config_from_hf,
    init_model,
    load_model,
    registry,
)
from paxkv.models.registry import family_of, model_class
from paxkv.sharding import shardings

NAMES = [*PRESETS, *CHECKPOINTS]  # every name `LLM(model=...)` takes besides a directory


def test_the_launch_apps_know_the_names_the_python_api_knows():
    assert len(set(NAMES)) == len(NAMES) == 21
    assert sorted(configs.NAMES) == sorted(NAMES)
    assert {"tiny-gemma2", "tiny-qwen3", "qwen3-0.6b", "gemma-2-2b", "gemma-3-1b"} <= set(
        configs.NAMES
    )


# The launch apps' flags, parsed in a child process: they are absl's process-wide flags,
# which another test file's app (on the same xdist worker) may define too.
_PARSE_CONFIG_FLAG = """
import json, sys
from absl import flags
from paxkv.launch import flags as launch_flags
out = {}
for name in sys.argv[1:]:
    flags.FLAGS(["app", f"--setup={name}"])
    setup = launch_flags.serving_setup()
    try:
        source = launch_flags._model_source(setup)
    except ValueError as e:
        source = "error: " + str(e)
    flags.FLAGS.unparse_flags()
    out[name] = [setup.name, source, setup.random_weights, bool(setup.checkpoint)]
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def parsed_config_flags():
    run = subprocess.run(
        [sys.executable, "-c", _PARSE_CONFIG_FLAG, *NAMES],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", NAMES)
def test_config_flag_accepts_every_name(name, parsed_config_flags):
    parsed_name, source, random_weights, checkpoint = parsed_config_flags[name]
    assert parsed_name == name
    if random_weights or checkpoint:
        # What the app loads is a name `load_model` resolves (the tests below).
        assert source in NAMES
    else:  # a real model's shapes: the app asks for its weights, not for a known name
        assert source.startswith("error: ") and "pass --model_dir" in source
    setup = configs.get_setup(name)
    assert setup.name == name
    assert setup.model.replace(scan_layers=False) == PRESETS.get(name, PRESETS["tiny"])
    assert setup.random_weights == (name in BYTE_LEVEL_PRESETS)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_python_api_resolves_every_preset(name, monkeypatch):
    # `LLM(model=name)` loads through `load_model`; the name's resolution is under test
    # here, not the (random) initialisation, which test_each_preset_builds_its_model_class
    # covers.
    built = []
    monkeypatch.setattr(registry, "init_model", lambda *a, **k: built.append((a, k)) or name)
    config, model, tokenizer = load_model(name, seed=5)
    assert config is PRESETS[name] and model == name
    assert built == [((PRESETS[name], 5), {"mesh": None})]
    assert isinstance(tokenizer, ByteTokenizer) == (name in BYTE_LEVEL_PRESETS)


def test_python_api_resolves_the_shipped_checkpoint():
    config, model, tokenizer = load_model("tiny-py")
    assert config == PRESETS["tiny"] and type(model) is LlamaForCausalLM
    assert isinstance(tokenizer, ByteTokenizer)


def test_unknown_name_is_refused_by_both():
    with pytest.raises(ValueError, match="neither a preset"):
        load_model("llama-9")
    with pytest.raises(ValueError, match="unknown set-up 'llama-9'"):
        configs.get_setup("llama-9")


# Model types: config class <-> model class <-> Hugging Face's model_type.

EXPECTED = {
    "llama": (LlamaConfig, LlamaForCausalLM, "LlamaForCausalLM"),
    "mistral": (LlamaConfig, LlamaForCausalLM, "MistralForCausalLM"),
    "qwen2": (LlamaConfig, LlamaForCausalLM, "Qwen2ForCausalLM"),
    "qwen3": (LlamaConfig, LlamaForCausalLM, "Qwen3ForCausalLM"),
    "gemma2": (GemmaConfig, GemmaForCausalLM, "Gemma2ForCausalLM"),
    "gemma3_text": (GemmaConfig, GemmaForCausalLM, "Gemma3ForCausalLM"),
    "mixtral": (MoeConfig, MoeForCausalLM, "MixtralForCausalLM"),
    "qwen3_moe": (MoeConfig, MoeForCausalLM, "Qwen3MoeForCausalLM"),
    "gpt_oss": (GptOssConfig, MoeForCausalLM, "GptOssForCausalLM"),
}


def test_registered_model_types():
    registered = {t: (f.config_class, f.model_class) for f in FAMILIES for t in f.model_types}
    assert registered == {t: classes[:2] for t, classes in EXPECTED.items()}


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_each_preset_round_trips_through_its_model_type(name):
    config = PRESETS[name]
    hf = config.to_hf()
    config_class, cls, architecture = EXPECTED[hf["model_type"]]
    assert type(config) is config_class and model_class(config) is cls
    assert config_from_hf(hf) == config
    assert hf["architectures"] == [architecture]
    # Hugging Face's own mapping agrees: the type names its config, the class exists.
    hf_config = transformers.AutoConfig.for_model(**hf)
    assert hf_config.model_type == hf["model_type"]
    assert hasattr(transformers, architecture)


def test_each_preset_builds_its_model_class():
    for name in (
        "tiny",
        "tiny-qwen3",
        "tiny-gemma2",
        "tiny-gemma3",
        "tiny-mixtral",
        "tiny-gpt-oss",
    ):
        assert type(init_model(PRESETS[name])) is model_class(PRESETS[name])


def test_every_model_type_has_a_preset():
    reached = {PRESETS[n].to_hf()["model_type"] for n in PRESETS}
    assert reached == set(EXPECTED)


def test_unknown_model_type():
    with pytest.raises(ValueError, match=r"model_type='phi3' is not supported; expected one of"):
        config_from_hf({"model_type": "phi3"})


# Registration.


def test_a_family_registers_once():
    llama = family_of(PRESETS["tiny"])
    with pytest.raises(ValueError, match=r"model types \['llama', 'mistral'"):
        registry._index((llama, llama))
    renamed = dataclasses.replace(llama, model_types=("other",))
    with pytest.raises(ValueError, match="LlamaConfig is taken"):
        registry._index((llama, renamed))


def test_family_presets_must_be_its_config():
    llama = family_of(PRESETS["tiny"])
    with pytest.raises(ValueError, match="'tiny-gemma2' is a GemmaConfig, not a LlamaConfig"):
        dataclasses.replace(
            llama, presets={"tiny-gemma2": PRESETS["tiny-gemma2"]}, byte_level_presets=()
        )
    with pytest.raises(ValueError, match=r"byte-level presets \['nope'\] are not presets"):
        dataclasses.replace(llama, byte_level_presets=("nope",))


def test_sharding_rules_come_from_the_family(monkeypatch):
    for config in PRESETS.values():
        assert shardings.param_rules(config) is family_of(config).sharding_rules

    @dataclasses.dataclass(frozen=True)
    class OtherConfig:
        width: int

    mesh = AbstractMesh((1, 4), ("data", "model"))
    with pytest.raises(ValueError, match="no sharding rules for OtherConfig"):
        shardings.param_spec(("wte", "embedding"), (8, 8), OtherConfig(8), mesh)
    rule = shardings.SplitRule(("wte",), shardings.ROW, "width")
    monkeypatch.setitem(shardings._PARAM_RULES, OtherConfig, (rule,))
    assert shardings.param_spec(("wte", "embedding"), (8, 8), OtherConfig(8), mesh) == P(
        "model", None
    )
    assert shardings.param_spec(("wte", "embedding"), (6, 8), OtherConfig(6), mesh) == P()
    assert shardings.param_spec(("ln", "weight"), (8,), OtherConfig(8), mesh) == P()
