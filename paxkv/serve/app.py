"""The OpenAI-compatible HTTP server: a Starlette app over an `AsyncEngine`.

    POST /v1/completions        prompt text, token ids, or a list of either
    POST /v1/chat/completions   messages through the chat template
    GET  /v1/models             the served model
    GET  /health                200 once the engine is warm and stepping, else 503
    GET  /metrics               Prometheus text (`paxkv.metrics.PrometheusCollector`)

Streaming responses are server-sent events (`data: {chunk}` lines) ending with
`data: [DONE]`. Errors are OpenAI's error objects (`protocol.ApiError`): 400 naming the
field for a bad request, 404 for another model's name, 429 when the server holds as many
requests as it may, 503 once the engine is shutting down or has failed. A client that
disconnects aborts its requests, and their pages return to the pool.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from absl import logging
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from paxkv import chat
from paxkv.metrics import PrometheusCollector
from paxkv.serve import protocol
from paxkv.serve.frontend import AsyncEngine, EngineDead, QueueFull, RequestGroup, Submission
from paxkv.serve.protocol import ApiError


@dataclasses.dataclass
class ServerState:
    """What the handlers serve: the front end, the model's name, tokenizer, and chat
    templates (`chat.ChatTemplates`; the server's `--chat_template` as "default")."""

    front: AsyncEngine
    model_name: str
    tokenizer: Any
    chat_templates: chat.ChatTemplates
    max_model_len: int
    metrics_prefix: str = "paxkv"  # "vllm" makes /metrics read as vLLM's for its dashboards
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))


def build_app(state: ServerState) -> Starlette:
    """The ASGI app serving `state`; its lifespan starts and stops the stepping thread."""

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        state.front.start()
        try:
            yield
        finally:
            await state.front.close()

    routes = [
        Route("/v1/completions", _api(state, _completions), methods=["POST"]),
        Route("/v1/chat/completions", _api(state, _chat_completions), methods=["POST"]),
        Route("/v1/models", _api(state, _models), methods=["GET"]),
        Route("/health", _api(state, _health), methods=["GET"]),
        Route("/metrics", _api(state, _metrics), methods=["GET"]),
    ]
    return Starlette(routes=routes, lifespan=lifespan)


Handler = Callable[[ServerState, Request], Awaitable[Response]]


def _api(state: ServerState, handler: Handler) -> Callable[[Request], Awaitable[Response]]:
    """`handler` with every failure answered as an OpenAI error object."""

    @functools.wraps(handler)
    async def endpoint(request: Request) -> Response:
        try:
            return await handler(state, request)
        except ApiError as e:
            return _error(e)
        except QueueFull as e:
            return _error(ApiError(429, str(e), code="too_many_requests"))
        except EngineDead as e:
            return _error(ApiError(503, str(e)))
        except (TypeError, ValueError) as e:  # the engine rejected a request
            chat_request = request.url.path.endswith("/chat/completions")
            return _error(protocol.engine_rejection(e, chat_request=chat_request))
        except Exception as e:
            logging.exception("paxkv-serve: %s %s failed", request.method, request.url.path)
            return _error(ApiError(500, f"{type(e).__name__}: {e}"))

    return endpoint


def _error(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


async def _json_body(request: Request) -> dict[str, Any]:
    raw = await request.body()
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    return body


async def _completions(state: ServerState, request: Request) -> Response:
    body = await _json_body(request)
    protocol.check_model(body, state.model_name)
    stream, include_usage = protocol.stream_options(body)
    prompts = protocol.completion_prompts(body, state.tokenizer)
    params = [
        protocol.sampling_params(
            body, chat_request=False, prompt_len=len(p), max_model_len=state.max_model_len
        )
        for p in prompts
    ]
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
        echo=body.get("echo") is True,
    )


async def _chat_completions(state: ServerState, request: Request) -> Response:
    body = await _json_body(request)
    protocol.check_model(body, state.model_name)
    stream, include_usage = protocol.stream_options(body)
    prompt = protocol.chat_prompt(body, state.chat_templates, state.tokenizer)
    params = protocol.sampling_params(
        body,
        chat_request=True,
        prompt_len=len(prompt.token_ids),
        max_model_len=state.max_model_len,
    )
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
    echo: bool = False,
) -> Response:
    """Submits one engine request per prompt and answers with their completions."""
    submissions = [
        Submission(f"{response_id}-{i}", {"prompt_token_ids": ids}, p)
        for i, (ids, p) in enumerate(zip(prompts, params, strict=True))
    ]
    group = await state.front.submit(submissions)
    choices = protocol.Choices(
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
        "model": state.model_name,
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
    return JSONResponse({**header, "choices": choices.response_choices(), "usage": choices.usage()})


async def _collect(request: Request, group: RequestGroup, choices: protocol.Choices) -> None:
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
    group: RequestGroup,
    choices: protocol.Choices,
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
    return JSONResponse(
        {
            "object": "list",
            "data": [
                {
                    "id": state.model_name,
                    "object": "model",
                    "created": state.created,
                    "owned_by": "paxkv",
                    "root": state.model_name,
                    "max_model_len": state.max_model_len,
                }
            ],
        }
    )


async def _health(state: ServerState, request: Request) -> Response:
    if state.front.dead:
        return Response("the engine has failed\n", status_code=503)
    return Response(status_code=200)


async def _metrics(state: ServerState, request: Request) -> Response:
    from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

    stats = await state.front.stats()
    registry = CollectorRegistry()
    registry.register(PrometheusCollector(lambda: stats, prefix=state.metrics_prefix))
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)
