"""The OpenAI-compatible HTTP server: a Starlette app over a `ReplicaSet` of engines.

    POST /v1/completions        prompt text, token ids, or a list of either
    POST /v1/chat/completions   messages through the chat template
    GET  /v1/models             the served model and its LoRA adapters
    POST /v1/load_lora_adapter  with `allow_runtime_lora_updating`: add or remove an adapter
    POST /v1/unload_lora_adapter (vLLM's); requests name one as their `model`
    POST /tokenize, /detokenize the server's tokenizer, in vLLM's shapes
    GET  /tokenizer_info        (`paxkv.serve.tokenize`)
    GET  /health                200 once the engine is warm and stepping, else 503
    GET  /metrics               Prometheus text (`paxkv.engine.metrics.PrometheusCollector`)
    POST /sleep, /wake_up       with `enable_sleep_mode` only: free the engines' device
    GET  /is_sleeping           memory and take it back (`Engine.sleep`), as vLLM's

Streaming responses are server-sent events (`data: {chunk}` lines) ending with
`data: [DONE]`. Errors are OpenAI's error objects (`protocol.ApiError`): 400 naming the
field for a bad request or one past the server's `protocol.Limits`, 413 for a body
past its size limit, 404 for another model's name or an unknown path, 429 when the
server holds as many sequences as it may, 503 once the engine is shutting down or has
failed, or sleeps refusing requests (and to the requests still in flight when the
shutdown grace period ends: streams get it as their last event before `[DONE]`), and
401 without the server's API key where it has one (every path but /health and /metrics). A
client that disconnects aborts its requests, and their pages return to the pool.

Parsing, tokenizing and chat-template rendering run in worker threads, never on the
event loop or the engine's stepping thread. Requests with a `cache_salt` share cached
pages only with requests of the same salt (vLLM's). `/metrics` leaves out what would
tell one client whether another's prompt is cached (the prefix-cache counters, and the
step count, which a cached prefix shortens) unless `expose_prefix_cache_metrics`.

With several data-parallel replicas (`paxkv.serve.replicas`), each prompt goes to the
replica the router picks; `/metrics` shows the whole server's figures under the usual
names, and each replica's (`replica_*{replica="i"}`, which tell where a prompt was
routed, so by prefix) only with `expose_prefix_cache_metrics`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import hmac
import itertools
import json
import socket
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from absl import logging
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from paxkv.engine import sleep
from paxkv.engine.metrics import PrometheusCollector
from paxkv.host.lora_slots import LoRARequest
from paxkv.serve import protocol, responses, tokenize
from paxkv.serve.frontend import EngineDead, QueueFull, Submission
from paxkv.serve.protocol import ApiError
from paxkv.serve.replicas import ReplicaSet, RoutedGroup
from paxkv.text import chat

# Stats that tell whether a prompt's prefix was cached (a hit computes fewer tokens, in
# fewer steps): one client could learn from them what another sent.
PREFIX_CACHE_STATS = ("prefix_cache_queries", "prefix_cache_hits", "num_steps")
# What a server with an API key answers without one (load balancers, Prometheus), as vLLM.
OPEN_PATHS = ("/health", "/metrics")


@dataclasses.dataclass
class ServerState:
    """What the handlers serve: the replicas' front end (one or more engines), the
    model's name, tokenizer, and chat templates (`chat.ChatTemplates`; the server's
    `--chat_template` as "default")."""

    front: ReplicaSet
    model_name: str
    tokenizer: Any
    chat_templates: chat.ChatTemplates
    max_model_len: int
    metrics_prefix: str = "paxkv"  # "vllm" makes /metrics read as vLLM's for its dashboards
    limits: protocol.Limits = dataclasses.field(default_factory=protocol.Limits)
    expose_prefix_cache_metrics: bool = False  # see PREFIX_CACHE_STATS
    enable_sleep_mode: bool = False  # serve /sleep, /wake_up and /is_sleeping
    # With a key, every path but OPEN_PATHS needs `Authorization: Bearer <api_key>`.
    api_key: str | None = None
    # Called once the engines have stopped, at shutdown (a replica across processes
    # stops the other processes).
    on_shutdown: Callable[[], None] | None = None
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))
    # LoRA adapters the engines serve (`--lora_modules`, `/v1/load_lora_adapter`), by
    # name; with `allow_runtime_lora_updating` the load and unload endpoints are served
    # (clients then name directories the server reads: vLLM's default is off too).
    loras: dict[str, LoRARequest] = dataclasses.field(default_factory=dict)
    allow_runtime_lora_updating: bool = False
    # One load or unload at a time: each checks the names, then awaits the engines.
    lora_lock: asyncio.Lock = dataclasses.field(default_factory=asyncio.Lock)


def build_app(state: ServerState) -> Starlette:
    """The ASGI app serving `state`; its lifespan starts and stops the stepping thread."""

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        state.front.start()
        try:
            yield
        finally:
            await state.front.close()
            if state.on_shutdown is not None:
                state.on_shutdown()

    routes = [
        Route("/v1/completions", _api(state, _completions), methods=["POST"]),
        Route("/v1/chat/completions", _api(state, _chat_completions), methods=["POST"]),
        Route("/v1/models", _api(state, _models), methods=["GET"]),
        *(
            [
                Route("/v1/load_lora_adapter", _api(state, _load_lora_adapter), methods=["POST"]),
                Route(
                    "/v1/unload_lora_adapter", _api(state, _unload_lora_adapter), methods=["POST"]
                ),
            ]
            if state.allow_runtime_lora_updating
            else []
        ),
        Route("/tokenize", _api(state, _tokenize), methods=["POST"]),
        Route("/detokenize", _api(state, _detokenize), methods=["POST"]),
        Route("/tokenizer_info", _api(state, _tokenizer_info), methods=["GET"]),
        Route("/health", _api(state, _health), methods=["GET"]),
        Route("/metrics", _api(state, _metrics), methods=["GET"]),
    ]
    if state.enable_sleep_mode:
        routes += [
            Route("/sleep", _api(state, _sleep), methods=["POST"]),
            Route("/wake_up", _api(state, _wake_up), methods=["POST"]),
            Route("/is_sleeping", _api(state, _is_sleeping), methods=["GET"]),
        ]
    return Starlette(
        routes=routes, lifespan=lifespan, exception_handlers={HTTPException: _http_error}
    )


async def _http_error(request: Request, e: HTTPException) -> Response:
    """Starlette's own errors (an unknown path, a wrong method) as OpenAI error objects."""
    return _error(ApiError(e.status_code, f"{e.detail}: {request.method} {request.url.path}"))


def bind(host: str, port: int) -> socket.socket:
    """A TCP socket bound to `host`:`port` (0: a free port), for `run_server` to listen on.

    Binding first, before the model loads, makes an address that cannot be served an
    error at start (ValueError naming it: a host that does not resolve or is not this
    machine's, a port in use or not allowed), not after the warm-up.
    """
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except (socket.gaierror, UnicodeError) as e:
        raise ValueError(f"--host={host!r} is not an address to listen on ({e})") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on --host={host} --port={port}: {e.strerror}") from None
    return sock


def run_server(state: ServerState, *, sock: socket.socket, shutdown_grace_s: float) -> None:
    """Serves `state` with uvicorn on `sock` (see `bind`) until SIGTERM or SIGINT.

    Then it stops accepting connections and lets the requests in flight run for up to
    `shutdown_grace_s` seconds; those still running then are answered 503 (streams: an
    error event, then `[DONE]`), rather than cut off. A second signal ends the wait:
    it returns at once, the requests in flight cut off.
    """
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            if self.should_exit:  # a second signal: stop waiting for the requests
                self.force_exit = True
            super().handle_exit(sig, frame)

        async def shutdown(self, sockets: Any = None) -> None:
            timer = asyncio.get_running_loop().call_later(
                shutdown_grace_s, state.front.end_in_flight, "the server is shutting down"
            )
            try:
                await super().shutdown(sockets)
            finally:
                timer.cancel()

    config = uvicorn.Config(
        build_app(state),
        # Past the grace period, time for the ended requests' last bytes.
        timeout_graceful_shutdown=shutdown_grace_s + 5.0,
        log_level="info",
        access_log=False,
    )
    host, port = sock.getsockname()[:2]
    logging.info("paxkv-serve: listening on http://%s:%d", host, port)
    Server(config).run(sockets=[sock])


Handler = Callable[[ServerState, Request], Awaitable[Response]]


def _api(state: ServerState, handler: Handler) -> Callable[[Request], Awaitable[Response]]:
    """`handler` with every failure answered as an OpenAI error object."""

    @functools.wraps(handler)
    async def endpoint(request: Request) -> Response:
        try:
            if state.api_key is not None and request.url.path not in OPEN_PATHS:
                _check_api_key(request, state.api_key)
            return await handler(state, request)
        except ApiError as e:
            return _error(e)
        except QueueFull as e:
            return _error(ApiError(429, str(e), code="too_many_requests"))
        except (EngineDead, sleep.EngineAsleep) as e:
            return _error(ApiError(503, str(e)))
        except ClientDisconnect:  # it left while sending its body: nobody to answer
            return _error(ApiError(499, "the client disconnected"))
        except (TypeError, ValueError) as e:  # the engine rejected a request
            chat_request = request.url.path.endswith("/chat/completions")
            return _error(protocol.engine_rejection(e, chat_request=chat_request))
        except Exception as e:
            logging.exception("paxkv-serve: %s %s failed", request.method, request.url.path)
            return _error(ApiError(500, f"{type(e).__name__}: {e}"))

    return endpoint


def _check_api_key(request: Request, api_key: str) -> None:
    """401 unless the request's `Authorization` is `Bearer <api_key>` (compared in
    constant time: the comparison says nothing of how much of the key matched)."""
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(
        given.strip().encode("utf-8", "surrogateescape"), api_key.encode("utf-8")
    ):
        raise ApiError(
            401,
            "Incorrect or missing API key: send the header 'Authorization: Bearer <key>'",
            code="invalid_api_key",
        )


class _AsciiJSON(JSONResponse):
    """A JSON response escaped to ASCII: an error body echoes what the client sent,
    which may hold lone surrogates (valid JSON, not encodable as UTF-8)."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def _error(e: ApiError) -> JSONResponse:
    return _AsciiJSON(e.body(), status_code=e.status)


async def _json_body(request: Request, limits: protocol.Limits) -> dict[str, Any]:
    """The request's JSON object, read up to `limits.max_body_bytes` and parsed in a
    worker thread."""
    limit = limits.max_body_bytes
    too_big = ApiError(413, f"the request body is over this server's limit of {limit} bytes")
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise too_big
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_big
        chunks.append(chunk)
    body = await asyncio.to_thread(_parse_json, b"".join(chunks))
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def _parse_json(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}") from None
    except RecursionError:
        raise ApiError(400, "the request body is not valid JSON: nested too deeply") from None


async def _completions(state: ServerState, request: Request) -> Response:
    body = await _json_body(request, state.limits)
    lora = protocol.check_model(body, state.model_name, state.loras)
    stream, include_usage = protocol.stream_options(body)
    salt = protocol.cache_salt(body)

    def inputs() -> tuple[list[list[int]], list[Any]]:
        prompts = protocol.completion_prompts(
            body, state.tokenizer, max_model_len=state.max_model_len, limits=state.limits
        )
        params = [
            protocol.sampling_params(
                body,
                chat_request=False,
                prompt_len=len(p),
                max_model_len=state.max_model_len,
                limits=state.limits,
            )
            for p in prompts
        ]
        return prompts, params

    prompts, params = await asyncio.to_thread(inputs)
    return await _serve(
        state,
        request,
        f"cmpl-{uuid.uuid4().hex}",
        prompts,
        params,
        chat_response=False,
        stream=stream,
        include_usage=include_usage,
        token_ids=_token_ids_flag(body),
        cache_salt=salt,
        lora=lora,
        echo=body.get("echo") is True,
        best=(body.get("n") or 1) if protocol.best_of_n(body) is not None else None,
        logprobs=body.get("logprobs") is not None,
    )


async def _chat_completions(state: ServerState, request: Request) -> Response:
    body = await _json_body(request, state.limits)
    lora = protocol.check_model(body, state.model_name, state.loras)
    stream, include_usage = protocol.stream_options(body)
    salt = protocol.cache_salt(body)

    def inputs() -> tuple[protocol.ChatPrompt, Any]:
        prompt = protocol.chat_prompt(
            body,
            state.chat_templates,
            state.tokenizer,
            max_model_len=state.max_model_len,
            limits=state.limits,
        )
        params = protocol.sampling_params(
            body,
            chat_request=True,
            prompt_len=len(prompt.token_ids),
            max_model_len=state.max_model_len,
            limits=state.limits,
        )
        return prompt, params

    # The renderer stops itself at its time limit (`paxkv.text.template_sandbox.RenderLimits`); this bounds
    # the wait should any work escape it (tokenizing is not bounded by it).
    wait_s = state.limits.chat_template.time_s + 10.0
    try:
        prompt, params = await asyncio.wait_for(asyncio.to_thread(inputs), wait_s)
    except TimeoutError:
        raise ApiError(400, f"the chat prompt took over {wait_s} s to render") from None
    return await _serve(
        state,
        request,
        f"chatcmpl-{uuid.uuid4().hex}",
        [prompt.token_ids],
        [params],
        chat_response=True,
        stream=stream,
        include_usage=include_usage,
        token_ids=_token_ids_flag(body),
        cache_salt=salt,
        lora=lora,
    )


def _token_ids_flag(body: dict[str, Any]) -> bool:
    value = body.get("return_tokens_as_token_ids", False)
    if not isinstance(value, bool):
        raise ApiError(
            400, "return_tokens_as_token_ids must be a boolean", param="return_tokens_as_token_ids"
        )
    return value


async def _serve(
    state: ServerState,
    request: Request,
    response_id: str,
    prompts: list[list[int]],
    params: list[Any],
    *,
    chat_response: bool,
    stream: bool,
    include_usage: bool,
    token_ids: bool,
    cache_salt: str | None,
    echo: bool = False,
    best: int | None = None,
    logprobs: bool = True,
    lora: str | None = None,
) -> Response:
    """Submits one engine request per prompt and answers with their completions (with
    `best`, each prompt's `best` of highest cumulative logprob, logprobs shown only
    if the client asked)."""
    submissions = [
        Submission(f"{response_id}-{i}", {"prompt_token_ids": ids}, p, cache_salt, lora)
        for i, (ids, p) in enumerate(zip(prompts, params, strict=True))
    ]
    group = await state.front.submit(submissions, stream=stream)
    choices = responses.Choices(
        group.request_ids,
        params[0].n,
        chat_response=chat_response,
        top_logprobs=params[0].logprobs or 0,
        token_ids=token_ids,
        echo=echo,
        decode=None if state.tokenizer is None else state.tokenizer.decode,
    )
    header = {
        "id": response_id,
        "object": "chat.completion.chunk" if chat_response else "text_completion",
        "created": int(time.time()),
        "model": lora or state.model_name,
    }
    if stream:
        events = _events(group, choices, header, chat_response, include_usage)
        return _EventStream(events, on_close=group.abort)
    try:
        await _collect(request, group, choices)
    finally:
        group.abort()  # a no-op unless the client left or collecting failed
    if choices.errors:
        raise ApiError(500, "; ".join(choices.errors))
    header["object"] = "chat.completion" if chat_response else "text_completion"
    answered = choices.response_choices(best=best, logprobs=logprobs)
    return JSONResponse({**header, "choices": answered, "usage": choices.usage()})


async def _collect(request: Request, group: RoutedGroup, choices: responses.Choices) -> None:
    """Takes every output of `group` into `choices`; returns early if the client leaves."""

    async def outputs() -> None:
        async for out in group:
            choices.add(out)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    done_task = asyncio.ensure_future(outputs())
    left_task = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait((done_task, left_task), return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (done_task, left_task):
            task.cancel()
    if done_task.done() and not done_task.cancelled():
        done_task.result()  # raises what collecting raised (EngineDead)
    else:
        raise ApiError(499, "the client disconnected")


async def _events(
    group: RoutedGroup,
    choices: responses.Choices,
    header: dict[str, Any],
    chat_response: bool,
    include_usage: bool,
) -> AsyncIterator[str]:
    """The server-sent events of a streamed response, `data: [DONE]` last."""
    if chat_response:
        yield _sse({**header, "choices": choices.role_chunks()})
    try:
        async for out in group:
            chunk = choices.add(out)
            if chunk:
                yield _sse({**header, "choices": chunk})
            if out.error is not None:
                yield _sse(ApiError(500, out.error).body())
    except EngineDead as e:
        yield _sse(ApiError(503, str(e)).body())
    if include_usage:
        yield _sse({**header, "choices": [], "usage": choices.usage()})
    yield "data: [DONE]\n\n"


def _sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


class _EventStream(StreamingResponse):
    """A server-sent event stream that calls `on_close` however it ends: finished, or
    cut short by the client leaving (which cancels the stream) or by shutdown."""

    def __init__(self, events: AsyncIterator[str], *, on_close: Callable[[], None]) -> None:
        super().__init__(
            events,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


async def _models(state: ServerState, request: Request) -> Response:
    base = {
        "id": state.model_name,
        "object": "model",
        "created": state.created,
        "owned_by": "paxkv",
        "root": state.model_name,
        "parent": None,
        "max_model_len": state.max_model_len,
    }
    adapters = [  # as vLLM lists them: the adapter's path as root, the base as parent
        base | {"id": name, "root": lora.lora_path, "parent": state.model_name}
        for name, lora in state.loras.items()
    ]
    return JSONResponse({"object": "list", "data": [base, *adapters]})


async def _load_lora_adapter(state: ServerState, request: Request) -> Response:
    """`POST /v1/load_lora_adapter {"lora_name", "lora_path"}` (vLLM's): loads a PEFT
    adapter on every replica; requests then name it as their `model`. 400 naming the
    field (the adapter's file and field for one the model cannot take)."""
    body = await _json_body(request, state.limits)
    name, path = body.get("lora_name"), body.get("lora_path")
    for field, value in (("lora_name", name), ("lora_path", path)):
        if not isinstance(value, str) or not value:
            raise ApiError(
                400, f"{field} must be a non-empty string, got {value!r:.80}", param=field
            )
    if name == state.model_name:
        raise ApiError(400, f"lora_name={name!r} is the base model's name", param="lora_name")
    async with state.lora_lock:
        if name in state.loras:
            raise ApiError(400, f"LoRA adapter {name!r} is loaded already", param="lora_name")
        taken = {lora.lora_int_id for lora in state.loras.values()}
        lora = LoRARequest(name, next(i for i in itertools.count(1) if i not in taken), path)
        try:
            await state.front.add_lora(lora)
        except ValueError as e:
            raise ApiError(400, str(e), param="lora_path") from None
        state.loras[name] = lora
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


async def _unload_lora_adapter(state: ServerState, request: Request) -> Response:
    """`POST /v1/unload_lora_adapter {"lora_name"}` (vLLM's): requests running under it
    finish; 404 for a name not loaded."""
    body = await _json_body(request, state.limits)
    name = body.get("lora_name")
    async with state.lora_lock:
        if not isinstance(name, str) or name not in state.loras:
            raise ApiError(404, f"LoRA adapter {name!r:.80} is not loaded", param="lora_name")
        del state.loras[name]
        await state.front.remove_lora(name)
    return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")


async def _tokenize(state: ServerState, request: Request) -> Response:
    body = await _json_body(request, state.limits)
    protocol.check_model(body, state.model_name, state.loras)
    out = await asyncio.to_thread(
        tokenize.tokenize,
        body,
        state.tokenizer,
        state.chat_templates,
        max_model_len=state.max_model_len,
        limits=state.limits,
    )
    return JSONResponse(out)


async def _detokenize(state: ServerState, request: Request) -> Response:
    body = await _json_body(request, state.limits)
    protocol.check_model(body, state.model_name, state.loras)
    vocab = state.front.engines[0].model_config.vocab_size
    out = await asyncio.to_thread(tokenize.detokenize, body, state.tokenizer, vocab_size=vocab)
    return JSONResponse(out)


async def _tokenizer_info(state: ServerState, request: Request) -> Response:
    return JSONResponse(
        tokenize.tokenizer_info(
            state.tokenizer, state.chat_templates, max_model_len=state.max_model_len
        )
    )


async def _health(state: ServerState, request: Request) -> Response:
    if state.front.dead:
        return Response("the engine has failed\n", status_code=503)
    return Response(status_code=200)


# /sleep's query parameters and their choices (`paxkv.engine.sleep`); `level` an int.
_SLEEP_PARAMS = {"level": sleep.LEVELS, "weights": sleep.WEIGHTS, "requests": sleep.REQUESTS}


async def _sleep(state: ServerState, request: Request) -> Response:
    """`POST /sleep?level=1&weights=host&requests=wait` (the defaults): every replica's
    engine frees its device memory (`Engine.sleep`). Answers {"released_bytes": over
    the replicas, "seconds": the slowest replica's, "replicas": each replica's
    `Engine.sleep` result, in order}; 400 naming a bad parameter, or when asleep already."""
    query = request.query_params
    for name in query:
        if name not in _SLEEP_PARAMS:
            raise ApiError(
                400,
                f"unknown query parameter {name}={query[name]!r}: /sleep takes {list(_SLEEP_PARAMS)}",
                param=name,
            )
    args: dict[str, Any] = {"level": 1, "weights": "host", "requests": "wait"}
    for name, choices in _SLEEP_PARAMS.items():
        value = query.get(name)
        if value is None:
            continue
        if name == "level":
            with contextlib.suppress(ValueError):  # else named as it came
                value = int(value)
        if value not in choices:
            raise ApiError(400, f"{name}={value!r} must be one of {choices}", param=name)
        args[name] = value
    try:
        each = await state.front.sleep(
            args["level"], weights=args["weights"], requests=args["requests"]
        )
    except ValueError as e:
        raise ApiError(400, str(e)) from None
    return JSONResponse(_over_replicas(each, "released_bytes"))


async def _wake_up(state: ServerState, request: Request) -> Response:
    """`POST /wake_up`: every replica's engine takes its memory back (`Engine.wake_up`)
    and the requests that waited run. Answers {"restored_bytes": over the replicas,
    "seconds": the slowest replica's, "replicas": each one's result}; a no-op (zeros)
    when awake; 400 when weights dropped by `sleep(weights="drop")` were not replaced.
    Query parameters (vLLM's `tags`) are ignored: everything wakes."""
    try:
        each = await state.front.wake_up()
    except ValueError as e:
        raise ApiError(400, str(e)) from None
    return JSONResponse(_over_replicas(each, "restored_bytes"))


def _over_replicas(each: list[dict[str, float]], counted: str) -> dict[str, Any]:
    """The replicas' sleep or wake-up results as one: `counted` bytes summed, the
    slowest one's seconds, and each one's result."""
    return {
        counted: sum(r[counted] for r in each),
        "seconds": max((r["seconds"] for r in each), default=0.0),
        "replicas": each,
    }


async def _is_sleeping(state: ServerState, request: Request) -> Response:
    """`GET /is_sleeping`: {"is_sleeping": whether the engines sleep}."""
    return JSONResponse({"is_sleeping": state.front.asleep})


async def _metrics(state: ServerState, request: Request) -> Response:
    from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Gauge, generate_latest

    stats = await state.front.stats()
    registry = CollectorRegistry()
    collector = PrometheusCollector(lambda: stats, prefix=state.metrics_prefix)
    if not state.expose_prefix_cache_metrics:
        collector.COUNTERS = tuple(n for n in collector.COUNTERS if n not in PREFIX_CACHE_STATS)
        stats.pop("replicas", None)  # a replica's load tells where (so why) a prompt went
    registry.register(collector)
    if state.enable_sleep_mode:
        Gauge(
            f"{state.metrics_prefix}:is_sleeping",
            "Whether the engines sleep (POST /sleep), 1, or are awake, 0.",
            registry=registry,
        ).set(int(state.front.asleep))
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)
