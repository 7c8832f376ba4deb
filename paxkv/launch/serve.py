"""Serves a model over HTTP with an OpenAI-compatible API (`paxkv.serve`).

    paxkv-serve                                   # tiny-py on 127.0.0.1:8000
    paxkv-serve --setup=llama-3.1-8b --model_dir=/ckpt/Llama-3.1-8B-Instruct --port=8000
    curl localhost:8000/v1/completions -H 'Content-Type: application/json' \\
        -d '{"prompt": "def f(x):", "max_tokens": 16, "temperature": 0}'

The engine compiles every step shape before the server listens, so `/health` answers
200 once requests can be served without compiling. `--mesh=model:M,data:D` serves D
data-parallel replicas of M devices each behind the one endpoint, each prompt routed by
`--router` (`paxkv.serve.router`: prefix-aware by default); with `--jax_distributed`, a
replica spanning the processes is served by process 0 (`paxkv.serve.multihost`).
SIGTERM (or Ctrl-C) stops accepting connections, lets the requests in flight finish for
up to `--shutdown_grace_s` seconds, aborts the rest, and exits 0; a second one stops
waiting, cuts the requests still in flight and exits 0 at once. Before the server listens (loading, compiling) either
signal exits 0 at once: nothing is in flight. Chat needs a chat template: the
checkpoint's, or `--chat_template` (Jinja source, or a file of it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import sys
from typing import Any

from absl import flags, logging

from paxkv.launch import exit_with_error, list_in_help, run_app
from paxkv.text import (  # no JAX: the flags below are defined before JAX is imported
    chat,
    template_sandbox,
)

DEFAULT_SETUP = "tiny-py"

_HOST = flags.DEFINE_string("host", "127.0.0.1", "Address to listen on (0.0.0.0: every interface).")
_PORT = flags.DEFINE_integer("port", 8000, "Port to listen on.", lower_bound=0, upper_bound=65535)
_MAX_QUEUED = flags.DEFINE_integer(
    "max_queued_requests",
    256,
    "Requests held beyond --max_num_seqs (waiting for a slot); more are answered 429.",
    lower_bound=0,
)
_SERVED_MODEL_NAME = flags.DEFINE_string(
    "served_model_name", None, "The model's name in the API; unset: --model_dir, else --config."
)
_METRICS_PREFIX = flags.DEFINE_string(
    "metrics_prefix",
    "paxkv",
    "Prefix of /metrics names (vLLM's names after it); 'vllm' for vLLM dashboards.",
)
_CHAT_TEMPLATE = flags.DEFINE_string(
    "chat_template",
    None,
    "Chat template for /v1/chat/completions: Jinja source, or a file holding it; unset: "
    "the checkpoint's.",
)
_TRUST_REQUEST_CHAT_TEMPLATE = flags.DEFINE_bool(
    "trust_request_chat_template",
    False,
    "Render a chat template a request sends (`chat_template`; bounded in time and size); "
    "off: requests may only name one of the checkpoint's (as vLLM's flag).",
)
_EXPOSE_PREFIX_CACHE_METRICS = flags.DEFINE_bool(
    "expose_prefix_cache_metrics",
    False,
    "Show the prefix-cache counters and the step count in /metrics; they tell a client "
    "whether another's prompt is cached, so keep them off for untrusted clients.",
)
_DISABLE_ANY_WHITESPACE = flags.DEFINE_bool(
    "disable_any_whitespace",
    False,
    "JSON outputs (response_format, guided_json, structured_outputs) allow no whitespace "
    "between tokens unless the request's structured_outputs says otherwise (vLLM's "
    "structured-outputs option); off: any JSON whitespace, which a weak model may repeat "
    "until max_tokens.",
)
_MAX_N = flags.DEFINE_integer(
    "max_n", 128, "The most completions (n, best_of) one request may ask for.", lower_bound=1
)
_ROUTER = flags.DEFINE_enum(
    "router",
    "prefix",
    ["prefix", "round_robin"],
    "With several replicas (--mesh=...,data:D): where each prompt goes; prefix: the "
    "replica sent the longest run of its leading pages before, unless busier than the "
    "least loaded by a batch (then the least loaded); round_robin: in turn.",
)
_API_KEY = flags.DEFINE_string(
    "api_key",
    None,
    "Every request but /health and /metrics must send 'Authorization: Bearer <key>' "
    "(401 otherwise). Unset: $PAXKV_API_KEY, else none needed.",
)
_ENABLE_SLEEP_MODE = flags.DEFINE_bool(
    "enable_sleep_mode",
    False,
    "Serve POST /sleep?level=1|2 (free the KV pool; 2: the weights too), POST /wake_up "
    "and GET /is_sleeping, as vLLM's, for RL that shares the devices with a trainer; "
    "off: they answer 404. Anyone who can reach the server can stop it serving.",
)
_SHUTDOWN_GRACE_S = flags.DEFINE_float(
    "shutdown_grace_s", 30.0, "Seconds requests in flight may run on after SIGTERM.", lower_bound=0
)


_LORA_MODULES = flags.DEFINE_multi_string(
    "lora_modules",
    [],
    "LoRA adapters to serve, name=path (a PEFT checkpoint directory), repeated or "
    "comma-separated; requests name one as their model (needs --enable_lora).",
)


_ALLOW_RUNTIME_LORA_UPDATING = flags.DEFINE_bool(
    "allow_runtime_lora_updating",
    False,
    "Serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's endpoints, "
    "which its VLLM_ALLOW_RUNTIME_LORA_UPDATING turns on): clients then name "
    "directories the server reads. Needs --enable_lora.",
)


def lora_modules(values: list[str]) -> list[Any]:
    """`--lora_modules` as LoRARequests (ids from 1, in order); ValueError naming a
    malformed entry or a name given twice."""
    from paxkv.host.lora_slots import LoRARequest

    out: dict[str, Any] = {}
    entries = [e.strip() for v in values for e in v.split(",") if e.strip()]
    for entry in entries:
        name, sep, path = entry.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora_modules entry {entry!r} must be name=path")
        if name in out:
            raise ValueError(f"--lora_modules names {name!r} twice")
        out[name] = LoRARequest(name, len(out) + 1, path)
    return list(out.values())


def main(argv: list[str]) -> None:
    """The absl main: builds and warms up the engine, then serves until SIGTERM."""
    from paxkv.launch import flags as launch_flags  # imported by `run` already
    from paxkv.launch import platform  # imports JAX: after the signal handlers

    if len(argv) > 1:
        exit_with_error(f"unexpected arguments {argv[1:]}")
    try:
        import uvicorn  # noqa: F401 (the serve extra's)

        from paxkv.serve import multihost
        from paxkv.serve.app import ServerState, bind, run_server
        from paxkv.serve.protocol import Limits
        from paxkv.serve.replicas import ReplicaSet
    except ImportError as e:
        exit_with_error(f"{e}: paxkv-serve needs the serve extra: pip install -e '.[serve]'")
    sock = None
    try:
        if not launch_flags.JAX_DISTRIBUTED.value:  # before loading: a bad address fails at once
            sock = bind(_HOST.value, _PORT.value)
        _check_chat_template_flag()
        meshes = launch_flags.replica_meshes(launch_flags.init_runtime(replicas=True))
        role = multihost.role(meshes)
        if role != "alone" and _ENABLE_SLEEP_MODE.value:
            raise ValueError(
                "--enable_sleep_mode needs each replica in one process, not across "
                "--jax_distributed processes"
            )
        loras = lora_modules(_LORA_MODULES.value)
        if role != "follower" and sock is None:
            sock = bind(_HOST.value, _PORT.value)
        setup = launch_flags.serving_setup()
        setup = setup.replace(engine=dataclasses.replace(setup.engine, max_n=_MAX_N.value))
        if loras and not setup.engine.enable_lora:
            raise ValueError("--lora_modules needs --enable_lora")
        if _ALLOW_RUNTIME_LORA_UPDATING.value and not setup.engine.enable_lora:
            raise ValueError("--allow_runtime_lora_updating needs --enable_lora")
        if role != "alone" and setup.engine.enable_lora:
            raise ValueError(
                "--enable_lora needs each replica in one process, not across "
                "--jax_distributed processes (not supported yet)"
            )
        platform.announce("paxkv-serve", setup.engine.attention_backend)
        if role == "follower":  # no server here: run process 0's steps until it stops
            multihost.follow_and_exit(launch_flags.build_llm(setup))
        channel = multihost.Channel() if role == "leader" else None  # to the followers
        llms, engines = [], []
        for i, mesh in enumerate(meshes):
            logging.info(
                "paxkv-serve: replica %d of %d: loading the model and compiling its step shapes",
                i,
                len(meshes),
            )
            llm = launch_flags.build_llm(setup, warmup=channel is None, mesh=mesh)
            llms.append(llm)
            engines.append(llm.engine if channel is None else multihost.leader_engine(llm, channel))
        templates = _chat_templates(llms[0].chat_templates)
        for lora in loras:  # read and checked now: a bad adapter stops the start
            for e in engines:
                e.add_lora(lora)
    except (ValueError, OSError) as e:
        exit_with_error(str(e))
    _prepare_structured_outputs(engines)
    engine = engines[0]
    name = _SERVED_MODEL_NAME.value or launch_flags.MODEL_DIR.value or setup.name
    if any(lora.lora_name == name for lora in loras):
        exit_with_error(f"--lora_modules names an adapter {name!r}, the served model's name")
    state = ServerState(
        front=ReplicaSet(engines, max_queued=_MAX_QUEUED.value, router=_ROUTER.value),
        model_name=name,
        tokenizer=engine.tokenizer,
        chat_templates=templates,
        max_model_len=engine.config.max_model_len,
        metrics_prefix=_METRICS_PREFIX.value,
        limits=Limits(
            max_n=_MAX_N.value,
            trust_request_chat_template=_TRUST_REQUEST_CHAT_TEMPLATE.value,
            disable_any_whitespace=_DISABLE_ANY_WHITESPACE.value,
        ),
        expose_prefix_cache_metrics=_EXPOSE_PREFIX_CACHE_METRICS.value,
        enable_sleep_mode=_ENABLE_SLEEP_MODE.value,
        api_key=_API_KEY.value or os.environ.get("PAXKV_API_KEY") or None,
        on_shutdown=None if channel is None else lambda: multihost.stop_followers(engine),
        loras={lora.lora_name: lora for lora in loras},
        allow_runtime_lora_updating=_ALLOW_RUNTIME_LORA_UPDATING.value,
    )
    if channel is not None:
        # Half the heartbeat timeout: the requests are answered 503 before JAX ends the job.
        stall_s = launch_flags.HEARTBEAT_TIMEOUT_S.value / 2
        multihost.exit_when_failed(state.front, engine, stall_s=stall_s)
    run_server(state, sock=sock, shutdown_grace_s=_SHUTDOWN_GRACE_S.value)


def _prepare_structured_outputs(engines: list) -> None:
    """Builds each engine's llguidance view of its tokenizer (about a second for a large
    vocabulary) on a thread of its own, so that the first request with structured
    outputs does not hold the engine's lock that long. Nothing without llguidance or a
    tokenizer it reads: such requests are refused when they come."""
    import importlib.util
    import threading

    if importlib.util.find_spec("llguidance") is None:
        return

    def prepare(engine) -> None:
        with contextlib.suppress(Exception):
            engine.grammars.width  # noqa: B018 (builds the tokenizer once)

    for engine in engines:
        threading.Thread(target=prepare, args=(engine,), daemon=True).start()


# What makes --chat_template a file's name rather than Jinja source.
_TEMPLATE_FILE_SUFFIXES = (".jinja", ".j2", ".txt")


def _check_chat_template_flag() -> None:
    """ValueError when `--chat_template` looks like a path (a path separator or a
    template file suffix, and no Jinja markup) that names no file: taken as the template
    itself, it would replace every conversation with the path."""
    source = _CHAT_TEMPLATE.value
    if source is None or os.path.isfile(source) or "{" in source:
        return
    if os.sep in source or "/" in source or source.endswith(_TEMPLATE_FILE_SUFFIXES):
        raise ValueError(f"--chat_template={source!r} looks like a file's path, and none exists")


def _chat_templates(templates: chat.ChatTemplates) -> chat.ChatTemplates:
    """The checkpoint's chat `templates` (none for a config without one), with
    `--chat_template` as the default when given, and messages for HTTP clients.

    ValueError when there is a template and no jinja2 to render it: refused at start,
    not on every chat request.
    """
    source = _CHAT_TEMPLATE.value
    if source is not None:
        if os.path.isfile(source):
            with open(source, encoding="utf-8") as f:
                source = f.read()
        templates = chat.ChatTemplates(
            {**templates.templates, "default": source},
            templates.special_tokens,
            f"--chat_template over {templates.source}",
        )
    if templates.templates:
        try:
            template_sandbox.require_jinja2()
        except ImportError as e:
            raise ValueError(f"{templates.source} has a chat template, and {e}") from None
    # Their errors reach HTTP clients: no server path or flag in them (the start-up log
    # says where the templates came from).
    logging.info(
        "paxkv-serve: chat templates %s from %s", sorted(templates.templates), templates.source
    )
    return dataclasses.replace(templates, source="the served model", knob="a chat_template ")


def _exit_on_signal(signum: int, frame: object) -> None:
    """Ends the process now with status 0, its output flushed: the handler of SIGTERM
    and SIGINT before the server listens, and after uvicorn has drained (it re-raises
    the signal that stopped it). `os._exit`, not `sys.exit`: the signal may find the
    main thread inside a compilation, and Python's finalization with XLA's threads
    still running can crash the process (a segfault, not status 0)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # the main thread may have been writing to it
            stream.flush()
    name = signal.Signals(signum).name
    os.write(2, f"paxkv-serve: {name}: exiting\n".encode())
    os._exit(0)


def run() -> None:
    """Console-script entry point (`paxkv-serve`)."""
    # First: importing JAX, loading the model and compiling take seconds, during which
    # a signal must end the process cleanly (uvicorn takes the signals while it serves).
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _exit_on_signal)
    from paxkv.launch import flags as launch_flags  # defines the shared flags

    flags.FLAGS.set_default("setup", DEFAULT_SETUP)
    list_in_help(__name__, __doc__, launch_flags.__name__)
    run_app(main)


if __name__ == "__main__":
    run()
