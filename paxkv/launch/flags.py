"""Flags shared by the launch apps, and the library objects they build.

`--setup` names a serving set-up of `paxkv.launch.setups`; the engine flags override its
`EngineConfig` fields (unset, they keep the set-up's). `--model_dir` is a local
Hugging Face checkpoint whose weights (and config.json) replace the set-up's shapes.

The runtime flags (`--mesh`, `--jax_distributed` and its addresses,
`--compilation_cache_dir`) take effect in `init_runtime()`, which every app's `main()`
calls first.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
from absl import flags, logging

from paxkv.engine.config import EngineConfig
from paxkv.host.request import INT32_MAX
from paxkv.host.speculative import SpeculativeConfig
from paxkv.launch import define_seed, json_object, platform
from paxkv.launch.setups import NAMES, ServingSetup, get_setup
from paxkv.models import CONFIG_FILE, DTYPES, ModelConfig, read_hf_config
from paxkv.offline.llm import LLM
from paxkv.pallas_kernels.layout import kv_page_bytes, resolve_kv_cache_dtype
from paxkv.sharding.mesh_shape import MeshShape

SETUP = flags.DEFINE_string("setup", "tiny", f"Serving set-up: one of {', '.join(NAMES)}.")
# The flag's name before set-ups had a name of their own; deprecated (docs/moved.md).
flags.DEFINE_alias("config", "setup")
MODEL_DIR = flags.DEFINE_string(
    "model_dir",
    None,
    "Local Hugging Face checkpoint directory (config.json, safetensors, tokenizer.json) of "
    "--setup's model. Required except for set-ups with weights in the package (tiny-py) "
    "or random ones (tiny).",
)
DTYPE = flags.DEFINE_enum("dtype", None, list(DTYPES), "Parameter dtype; unset: the model's.")
SCAN_LAYERS = flags.DEFINE_bool(
    "scan_layers",
    None,
    "Hold the layers stacked and run them as one scan: each step shape compiles one "
    "layer, not all of them (deep models compile in seconds); unset: the set-up's "
    "(on for the real-size set-ups).",
)
QUANTIZATION = flags.DEFINE_enum(
    "quantization",
    None,
    ["int8", "fp8", "w8a8-int8", "w8a8-fp8"],
    "Quantize the projections' and experts' weights at load, a scale per output channel; "
    "w8a8-: the projections' input activations too, per row (docs/quantization.md); "
    "unset: the model dtype.",
)
SEED = define_seed(0, "Seed of random weights, sampling and the planner's draws.")


# Why an app's engine limits differ from the Python API's (`LLM` has no set-up).
UNSET_ENGINE_FLAG = (
    "Unset: --setup's value (paxkv.launch.setups), not the EngineConfig default LLM() uses."
)


def _define_engine_flags() -> dict[str, flags.FlagHolder]:
    """One flag per `EngineConfig` field that declares a help text; unset (None), a
    flag keeps the set-up's value."""
    holders = {}
    for f in dataclasses.fields(EngineConfig):
        help_text, choices = f.metadata.get("help"), f.metadata.get("choices")
        if help_text is None:
            continue
        help_text += f" {UNSET_ENGINE_FLAG}"
        kind = type(f.default) if f.default is not None else int
        if choices:
            holders[f.name] = flags.DEFINE_enum(f.name, None, list(choices), help_text)
        elif f.metadata.get("ints"):
            holders[f.name] = flags.DEFINE_list(f.name, None, help_text)
        elif kind is bool:
            holders[f.name] = flags.DEFINE_bool(f.name, None, help_text)
        elif kind is int:
            holders[f.name] = flags.DEFINE_integer(
                f.name, None, help_text, lower_bound=1, upper_bound=INT32_MAX
            )
        elif kind is float:
            holders[f.name] = flags.DEFINE_float(f.name, None, help_text, lower_bound=0.0)
        else:
            raise TypeError(f"EngineConfig.{f.name}: no flag type for {kind.__name__}")
    return holders


_ENGINE_FLAGS = _define_engine_flags()
NUM_PAGES = _ENGINE_FLAGS["num_pages"]
SPECULATIVE_CONFIG = flags.DEFINE_string(
    "speculative_config",
    None,
    "Speculative decoding as a JSON object of `paxkv.host.speculative.SpeculativeConfig` "
    'fields (vLLM\'s --speculative-config), e.g. \'{"method": "ngram", '
    '"num_speculative_tokens": 4, "prompt_lookup_max": 4}\'. Unset: the set-up\'s (off).',
)


def speculative_config() -> dict | None:
    """`--speculative_config` parsed and checked (None when unset); ValueError naming the
    flag and what is wrong, a value of the wrong type included."""
    text = SPECULATIVE_CONFIG.value
    if text is None:
        return None
    value = json_object(text, "--speculative_config")
    try:
        SpeculativeConfig.of(value)
    except (TypeError, ValueError) as e:
        raise ValueError(f"--speculative_config: {e}") from None
    return value


# The runtime: devices, hosts, compilation cache.
MESH = flags.DEFINE_string(
    "mesh",
    None,
    "Device mesh as axis:size pairs, e.g. model:4,data:2: tensor parallelism over `model` "
    "devices, times `data` independent replicas. An app serves the one replica holding this "
    "process's devices. Unset: one device.",
)
JAX_DISTRIBUTED = flags.DEFINE_bool(
    "jax_distributed",
    False,
    "Call jax.distributed.initialize() first: multi-host (e.g. TPU pod slices), with the same "
    "command on every host.",
)
COORDINATOR_ADDRESS = flags.DEFINE_string(
    "coordinator_address",
    None,
    "With --jax_distributed: host:port of process 0. Unset: detected (TPU VMs, SLURM, ...).",
)
NUM_PROCESSES = flags.DEFINE_integer(
    "num_processes",
    None,
    "With --jax_distributed: processes in all. Unset: detected.",
    lower_bound=1,
)
PROCESS_ID = flags.DEFINE_integer(
    "process_id",
    None,
    "With --jax_distributed: this process's index. Unset: detected.",
    lower_bound=0,
)
HEARTBEAT_TIMEOUT_S = flags.DEFINE_integer(
    "heartbeat_timeout_s",
    100,
    "With --jax_distributed: seconds without a process's heartbeat before the job ends on "
    "every process (a process that hangs); jax.distributed's default.",
    lower_bound=1,
)
DISTRIBUTED_INIT_TIMEOUT_S = flags.DEFINE_integer(
    "distributed_init_timeout_s",
    300,
    "With --jax_distributed: seconds to wait for the job to form (the coordinator answering, "
    "every process registered); past it the process exits 1 saying what it waited for.",
    lower_bound=1,
)
COMPILATION_CACHE_DIR = flags.DEFINE_string(
    "compilation_cache_dir",
    None,
    "Directory of the persistent compilation cache: later runs load the compiled programs "
    "instead of compiling them; unset: $PAXKV_CACHE_DIR or ~/.cache/paxkv; off: none.",
)

_SHAPE_FIELDS = ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim")


def mesh_shape() -> MeshShape | None:
    """`--mesh` parsed, or None when unset; ValueError saying what is wrong with it."""
    if MESH.value is None:
        return None
    try:
        return MeshShape.parse(MESH.value)
    except ValueError as e:
        raise ValueError(f"--mesh={MESH.value}: {e}") from None


def init_runtime(*, replicas: bool = False) -> MeshShape | None:
    """Applies the runtime flags; returns `--mesh`'s shape (None: one device).

    In order: `jax.distributed.initialize` (`--jax_distributed`), the platform's check
    (`paxkv.launch.platform.require_platform`), the persistent compilation cache
    (`--compilation_cache_dir`), then the mesh: built over every process's devices, cut
    into replicas, and the replica holding this process's devices made the default of
    every `Engine` (`paxkv.sharding.shardings.set_default_mesh`). With `replicas` (an app
    that serves every replica of its process: paxkv-serve, see `replica_meshes`), a
    process holding several replicas sets no default. Raises ValueError for flags that
    contradict each other or the devices, and for a requested platform that is not here.
    """
    shape = mesh_shape()  # bad syntax fails before anything starts
    addresses = {
        "coordinator_address": COORDINATOR_ADDRESS.value,
        "num_processes": NUM_PROCESSES.value,
        "process_id": PROCESS_ID.value,
    }
    given = [f"--{name}" for name, value in addresses.items() if value is not None]
    if given and not JAX_DISTRIBUTED.value:
        raise ValueError(
            f"{', '.join(given)} only {'apply' if len(given) > 1 else 'applies'} with --jax_distributed"
        )
    if JAX_DISTRIBUTED.value:
        from paxkv.engine import multihost

        multihost.initialize_distributed(
            **addresses,
            heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S.value,
            init_timeout_s=DISTRIBUTED_INIT_TIMEOUT_S.value,
        )
    platform.require_platform()  # before anything loads: a missing runtime is named
    if COMPILATION_CACHE_DIR.value is not None:
        from paxkv.engine import compile_cache

        compile_cache.enable(COMPILATION_CACHE_DIR.value)
    if shape is not None:
        from paxkv.sharding import shardings

        mesh = shardings.make_mesh(shape)
        if not replicas:
            shardings.set_default_mesh(shardings.process_replica(mesh))
        elif len(mine := shardings.process_replicas(mesh)) == 1:
            shardings.set_default_mesh(mine[0])
    return shape


def replica_meshes(shape: MeshShape | None) -> list[Any]:
    """The meshes of the replicas this process serves under `--mesh` of `shape`
    (`init_runtime(replicas=True)`'s): [None] (the default mesh, or one device) unless
    it holds several."""
    if shape is None or shape.data == 1:
        return [None]
    from paxkv.sharding import shardings

    mine = shardings.process_replicas(shardings.make_mesh(shape))
    return [None] if len(mine) == 1 else mine


def serving_setup() -> ServingSetup:
    """The set-up of `--setup`, with `--model_dir`'s shapes, `--dtype` and the engine flags.

    Raises ValueError (or OSError) for an unknown set-up, a missing checkpoint, an
    invalid `config.json` (naming the file and the field), or engine limits that
    contradict each other or the model.
    """
    if flags.FLAGS["config"].present:
        logging.warning("--setup is deprecated: use --setup (docs/moved.md)")
    setup = get_setup(SETUP.value)
    model = setup.model
    if MODEL_DIR.value is not None:
        model = _checkpoint_config(MODEL_DIR.value)
        differ = [f for f in _SHAPE_FIELDS if getattr(model, f) != getattr(setup.model, f)]
        if differ:
            logging.warning(
                "--model_dir=%s differs from --setup=%s in %s: serving with the checkpoint's "
                "shapes and the set-up's engine limits",
                MODEL_DIR.value,
                setup.name,
                ", ".join(differ),
            )
        if setup.model.scan_layers:  # how the set-up runs its layers, not a shape
            model = model.replace(scan_layers=True)
    if DTYPE.value is not None:
        model = model.replace(dtype=DTYPE.value)
    if SCAN_LAYERS.value is not None:
        model = model.replace(scan_layers=SCAN_LAYERS.value)
    if QUANTIZATION.value is not None:
        model = model.replace(quantization=QUANTIZATION.value)
    overrides = {
        name: _flag_ints(name, f.value) if isinstance(f.value, list) else f.value
        for name, f in _ENGINE_FLAGS.items()
        if f.value is not None
    }
    if SPECULATIVE_CONFIG.value is not None:
        overrides["speculative_config"] = speculative_config()
    engine = dataclasses.replace(setup.engine, seed=SEED.value, **overrides)
    if engine.max_model_len > model.max_position_embeddings:
        raise ValueError(
            f"max_model_len={engine.max_model_len} exceeds the model's "
            f"max_position_embeddings={model.max_position_embeddings}"
        )
    return setup.replace(model=model, engine=engine)


def _flag_ints(name: str, values: list[str]) -> tuple[int, ...]:
    """A list flag's integers; ValueError naming the flag and showing the value."""
    try:
        return tuple(int(v) for v in values)
    except ValueError:
        raise ValueError(
            f"--{name}={','.join(values)}: expected integers, e.g. 16,64,256"
        ) from None


def _model_source(setup: ServingSetup) -> str:
    """What `load_model` loads: `--model_dir`, the set-up's shipped checkpoint, or its preset."""
    if MODEL_DIR.value is not None:
        return MODEL_DIR.value
    if setup.checkpoint is not None:
        return setup.checkpoint
    if not setup.random_weights:
        raise ValueError(
            f"--setup={setup.name} holds the model's shapes only: pass "
            "--model_dir=<local Hugging Face checkpoint directory> for its weights"
        )
    return setup.name


def build_model(setup: ServingSetup) -> Any:
    """The model of `setup` (an NNX module): `--model_dir`'s weights, the set-up's shipped
    checkpoint, or random ones where allowed."""
    from paxkv.models import load_model

    _, model, _ = load_model(
        _model_source(setup),
        dtype=DTYPE.value,
        seed=SEED.value,
        scan_layers=setup.model.scan_layers,
        quantization=setup.model.quantization,
    )
    return model


def build_llm(setup: ServingSetup, *, warmup: bool = False, mesh: Any = None) -> LLM:
    """An `LLM` serving `setup`: `--model_dir`'s weights, the set-up's shipped checkpoint,
    or random ones where the set-up allows, on `mesh` (one replica; None: the default
    mesh). `warmup`: compile every step shape first (a server); off by default, since
    a one-shot run compiles only the shapes it uses and its timing says "compilation
    included".

    ValueError naming the settings to lower when the device runs out of memory
    (XLA's RESOURCE_EXHAUSTED) for the weights, the KV cache or a step.
    """
    try:
        return LLM(
            _model_source(setup),
            dtype=DTYPE.value,
            seed=SEED.value,
            scan_layers=setup.model.scan_layers,
            quantization=setup.model.quantization,
            config=setup.engine,
            warmup=warmup,
            mesh=mesh,
        )
    except jax.errors.JaxRuntimeError as e:
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        raise ValueError(_out_of_memory(setup, e)) from None


def _out_of_memory(setup: ServingSetup, error: Exception) -> str:
    """What to lower when building `setup`'s engine ran out of device memory."""
    model, engine = setup.model, setup.engine
    per_page = kv_page_bytes(
        num_layers=model.num_layers,
        num_kv_heads=model.num_kv_heads,
        page_size=engine.page_size,
        head_dim=model.head_dim,
        page_dtype=resolve_kv_cache_dtype(engine.kv_cache_dtype, model.dtype),
    )
    first_line = str(error).strip().splitlines()[0][:200]
    return (
        f"out of device memory ({first_line}): --num_pages={engine.num_pages} asks for a "
        f"KV cache of up to {engine.num_pages * per_page / 2**30:.1f} GiB besides the "
        "weights; lower --num_pages (paxkv-plan sizes it for a device), or "
        "--max_num_batched_tokens / --max_num_seqs"
    )


def _checkpoint_config(model_dir: str) -> ModelConfig:
    if not os.path.isfile(os.path.join(model_dir, CONFIG_FILE)):
        raise ValueError(f"--model_dir={model_dir!r} holds no {CONFIG_FILE}")
    return read_hf_config(model_dir)
