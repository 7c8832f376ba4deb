"""The OpenAI wire format of requests: bodies checked and turned into prompts and
`SamplingParams` (the responses are `paxkv.serve.responses`).

Field names, defaults and shapes are OpenAI's (`/v1/completions`,
`/v1/chat/completions`), with vLLM's extra sampling fields (`top_k`, `min_p`,
`repetition_penalty`, `stop_token_ids`, `ignore_eos`, `include_stop_str_in_output`,
`return_tokens_as_token_ids`, and for chat `chat_template`, `chat_template_kwargs`,
`add_generation_prompt`, `continue_final_message`). Where OpenAI is silent this does
what `vllm serve` does: unknown fields are ignored, a finish reason may be "abort", and
chat's `max_tokens` defaults to what is left of `max_model_len` after the prompt.

Plain Python: no HTTP here. Every check raises `ApiError` with the status, the message
and the field (`param`) an OpenAI client shows.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping
from typing import Any, ClassVar

from paxkv.host.request import SamplingParams
from paxkv.serve.structured import StructuredOutputsError, structured_outputs
from paxkv.text import chat
from paxkv.text.template_sandbox import RenderLimits

# Sampling fields taken as they are, by their SamplingParams name (all of them OpenAI's or vLLM's).
_SAMPLING_FIELDS = (
    "n",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "include_stop_str_in_output",
    "logit_bias",
    "min_tokens",
)
# Fields that would change the output in ways this server does not implement: refused
# with 400 unless absent or at their no-op value (vLLM implements some; OpenAI all).
_UNSUPPORTED = {
    "suffix": (None, ""),
    "tools": (None, []),
}
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's and vLLM's default for /v1/completions


@dataclasses.dataclass(frozen=True)
class Limits:
    """What one request may ask of the server, checked at the door (400 naming the limit).

    vLLM caps none of these but `max_logprobs` (the engine's, checked there); a public
    endpoint needs them. `max_n` bounds `n` (and `best_of`); `max_prompts` the prompts
    of one completions request; `max_prompt_chars` a text prompt before it is
    tokenized (None: 32 characters per token of `max_model_len`); `max_messages` a
    chat's messages; `max_stop` and `max_stop_chars` the stop strings (and stop token
    ids) and each one's length; `max_body_bytes` the request body (413 past it).
    `chat_template` bounds the rendering of every chat template (`RenderLimits`);
    `trust_request_chat_template` lets a request send its own (vLLM's
    `--trust-request-chat-template`); else one may only name one of the checkpoint's.
    `disable_any_whitespace`: a request's JSON constraint allows no whitespace unless its
    `structured_outputs` sets the field itself.
    """

    max_n: int = 128
    max_prompts: int = 256
    max_prompt_chars: int | None = None
    max_messages: int = 4096
    max_stop: int = 64
    max_stop_chars: int = 1024
    max_body_bytes: int = 16 << 20
    chat_template: RenderLimits = dataclasses.field(default_factory=RenderLimits)
    trust_request_chat_template: bool = False
    disable_any_whitespace: bool = False

    def prompt_chars(self, max_model_len: int) -> int:
        """The longest text prompt taken, in characters."""
        return 32 * max_model_len if self.max_prompt_chars is None else self.max_prompt_chars


class ApiError(Exception):
    """An error answered to the client: HTTP `status` and OpenAI's error object."""

    TYPES: ClassVar[dict[int, str]] = {
        400: "invalid_request_error",
        401: "authentication_error",
        404: "not_found_error",
        405: "invalid_request_error",
        413: "invalid_request_error",
        429: "rate_limit_error",
        500: "internal_server_error",
        503: "service_unavailable_error",
    }

    def __init__(
        self, status: int, message: str, *, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        """`{"error": {"message", "type", "param", "code"}}`, as OpenAI answers errors."""
        return {
            "error": {
                "message": self.message,
                "type": self.TYPES.get(self.status, "error"),
                "param": self.param,
                "code": self.code if self.code is not None else self.status,
            }
        }


def bad_request(error: Exception, *, param: str | None = None) -> ApiError:
    """A 400 for a ValueError or TypeError of the engine or `SamplingParams`, with the
    engine's "request '<id>': " prefix cut (the client never saw that id)."""
    return ApiError(400, re.sub(r"^request '[^']*': ", "", str(error)), param=param)


# What each rejection of `Engine.add_request` is about, by the words of its message:
# the first pattern found names the field.
_ENGINE_REJECTIONS = (
    ("structured_outputs", "structured_outputs"),
    ("logit_bias", "logit_bias"),
    ("max_tokens", "max_tokens"),
    ("max_logprobs", "logprobs"),
    ("stop strings", "stop"),
    ("prompt|vocabulary", "prompt"),
)


def engine_rejection(error: Exception, *, chat_request: bool) -> ApiError:
    """The 400 for a request `Engine.add_request` rejects, naming the field."""
    message = str(error)
    param = next((p for words, p in _ENGINE_REJECTIONS if re.search(words, message)), None)
    if chat_request and param == "prompt":
        param = "messages"
    return bad_request(error, param=param)


def check_model(
    body: Mapping[str, Any], served_model_name: str, adapters: Iterable[str] = ()
) -> str | None:
    """The LoRA adapter `model` names (one of `adapters`), or None for the base model
    (`model` absent or the served model's name); 404 otherwise, as vLLM answers."""
    model = body.get("model")
    if model is None or model == served_model_name:
        return None
    if not isinstance(model, str):
        raise ApiError(400, f"model must be a string, got {model!r:.80}", param="model")
    adapters = list(adapters)
    if model in adapters:
        return model
    also = f" and the LoRA adapters {adapters}" if adapters else ""
    raise ApiError(
        404,
        f"The model `{model}` does not exist; this server serves `{served_model_name}`{also}",
        param="model",
        code="model_not_found",
    )


def stream_options(body: Mapping[str, Any]) -> tuple[bool, bool]:
    """`(stream, include_usage)` of a request: whether to stream server-sent events,
    and whether the stream ends with a chunk of usage."""
    stream = body.get("stream")
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise ApiError(400, f"stream must be a boolean, got {stream!r:.80}", param="stream")
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not isinstance(options, dict):
        raise ApiError(400, "stream_options must be an object", param="stream_options")
    if not stream:
        raise ApiError(
            400, "stream_options is only allowed with stream=true", param="stream_options"
        )
    usage = options.get("include_usage", False)
    if not isinstance(usage, bool):
        raise ApiError(
            400, "stream_options.include_usage must be a boolean", param="stream_options"
        )
    return stream, usage


def _check_supported(body: Mapping[str, Any]) -> None:
    for name, noops in _UNSUPPORTED.items():
        if name in body and body[name] not in noops:
            raise ApiError(400, f"{name} is not supported by this server", param=name)
    best_of_n(body)


def best_of_n(body: Mapping[str, Any]) -> int | None:
    """`best_of` when it asks for more samples than `n` (completions only, not
    streamed: the server samples `best_of` and answers the `n` of highest cumulative
    logprob); None when it is absent or equal to n; 400 naming it otherwise."""
    best_of = body.get("best_of")
    if best_of is None:
        return None
    n = body.get("n", 1)
    n = 1 if n is None else n
    if not _is_int(best_of) or best_of < 1:
        raise ApiError(
            400, f"best_of must be a positive integer, got {best_of!r:.80}", param="best_of"
        )
    if not _is_int(n) or best_of == n:
        return None
    if best_of < n:
        raise ApiError(400, f"best_of={best_of} must be at least n={n}", param="best_of")
    if body.get("stream"):
        raise ApiError(400, "best_of > n cannot be streamed (stream=true)", param="best_of")
    if "messages" in body:
        raise ApiError(400, "best_of is taken by /v1/completions only", param="best_of")
    return best_of


def sampling_params(
    body: Mapping[str, Any],
    *,
    chat_request: bool,
    prompt_len: int,
    max_model_len: int,
    limits: Limits = Limits(),
) -> SamplingParams:
    """The `SamplingParams` of a request body; 400 naming the field for a bad value.

    `max_tokens` (chat: `max_completion_tokens`, else `max_tokens`) defaults to 16 for
    completions and, for chat, to what is left of `max_model_len` after the prompt's
    `prompt_len` tokens. `logprobs` is an int k for completions; for chat, a boolean
    with `top_logprobs` (default 0) as k.
    """
    _check_supported(body)
    _check_limits(body, limits)
    echo = _echo(body, chat_request=chat_request)
    kwargs = {f: body[f] for f in _SAMPLING_FIELDS if body.get(f) is not None}
    if "stop_token_ids" in kwargs and not isinstance(kwargs["stop_token_ids"], list):
        raise ApiError(400, "stop_token_ids must be a list of integers", param="stop_token_ids")
    max_name = "max_tokens"
    if chat_request:
        if body.get("max_completion_tokens") is not None:
            max_name = "max_completion_tokens"
        default = max(1, max_model_len - prompt_len)
    else:
        default = COMPLETION_DEFAULT_MAX_TOKENS
    max_tokens = body.get(max_name)
    if max_tokens is not None and _is_int(max_tokens) and max_tokens < (0 if echo else 1):
        # In the API's terms, not SamplingParams' (its 0 means "score the prompt").
        raise ApiError(
            400,
            f"{max_name}={max_tokens} must be at least 1"
            + ("" if chat_request else " (0 only with echo=true: the prompt's logprobs alone)"),
            param=max_name,
        )
    kwargs["max_tokens"] = default if max_tokens is None else max_tokens
    if chat_request:
        wanted, top = body.get("logprobs"), body.get("top_logprobs")
        if wanted is not None and not isinstance(wanted, bool):
            raise ApiError(400, f"logprobs must be a boolean, got {wanted!r:.80}", param="logprobs")
        if top is not None and not wanted:
            raise ApiError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        if wanted:
            kwargs["logprobs"] = 0 if top is None else top
    elif body.get("logprobs") is not None:
        kwargs["logprobs"] = body["logprobs"]
    if (best_of := best_of_n(body)) is not None:
        # Sampled best_of times, ranked by cumulative logprob (which logprobs makes).
        kwargs["n"] = best_of
        kwargs.setdefault("logprobs", 0)
    try:
        kwargs["structured_outputs"] = structured_outputs(
            body, disable_any_whitespace=limits.disable_any_whitespace
        )
    except StructuredOutputsError as e:
        raise ApiError(400, str(e), param=e.param) from None
    if echo and (kwargs.get("logprobs") is not None or kwargs["max_tokens"] == 0):
        # The echoed prompt's logprobs (vLLM's echo), computed in the prefill; with
        # max_tokens=0 nothing is generated.
        kwargs["prompt_logprobs"] = kwargs.get("logprobs") or 0
    try:
        params = SamplingParams(**kwargs)
    except (TypeError, ValueError) as e:
        # Its messages start with the field's name: "top_p=0.0 must be in (0, 1]".
        field = re.match(r"\w+", str(e))
        param = field[0] if field and field[0] in kwargs else None
        if chat_request and param == "logprobs":
            param = "top_logprobs"
        if param == "max_tokens":
            param = max_name
        raise bad_request(e, param=param) from None
    return params


def _echo(body: Mapping[str, Any], *, chat_request: bool) -> bool:
    """Whether a completions request echoes its prompt (`echo`; not for chat)."""
    echo = body.get("echo")
    if echo is None or echo is False:
        return False
    if chat_request:
        raise ApiError(400, "echo is not supported by this server for chat", param="echo")
    if not isinstance(echo, bool):
        raise ApiError(400, f"echo must be a boolean, got {echo!r:.80}", param="echo")
    return True


def _check_limits(body: Mapping[str, Any], limits: Limits) -> None:
    """400 for `n`, `best_of` or the stop strings past `limits`."""
    for name in ("n", "best_of"):
        value = body.get(name)
        if _is_int(value) and value > limits.max_n:
            raise ApiError(
                400, f"{name}={value} is over this server's limit of {limits.max_n}", param=name
            )
    stop = body.get("stop")
    for name, items in (
        ("stop", [stop] if isinstance(stop, str) else stop),
        ("stop_token_ids", body.get("stop_token_ids")),
    ):
        if isinstance(items, list) and len(items) > limits.max_stop:
            raise ApiError(
                400,
                f"{name} has {len(items)} entries, over this server's limit of {limits.max_stop}",
                param=name,
            )
    if isinstance(stop, (str, list)):
        for s in [stop] if isinstance(stop, str) else stop:
            if isinstance(s, str) and len(s) > limits.max_stop_chars:
                raise ApiError(
                    400,
                    f"a stop string of {len(s)} characters is over this server's limit of "
                    f"{limits.max_stop_chars}",
                    param="stop",
                )


def cache_salt(body: Mapping[str, Any]) -> str | None:
    """vLLM's `cache_salt`: requests with different salts never share cached pages."""
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise ApiError(400, "cache_salt must be a non-empty string", param="cache_salt")
    return salt


def completion_prompts(
    body: Mapping[str, Any], tokenizer: Any, *, max_model_len: int, limits: Limits = Limits()
) -> list[list[int]]:
    """The token ids of each prompt of a completions body: `prompt` is a string, a list
    of token ids, or a non-empty list of either. Prompts longer than `max_model_len`
    tokens, or than `limits.prompt_chars` before tokenizing, are refused (400)."""
    prompt = body.get("prompt")
    if prompt is None:
        raise ApiError(400, "prompt is required", param="prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and _is_int(prompt[0])):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt:
        prompts = prompt
    else:
        raise ApiError(
            400,
            "prompt must be a string, a list of token ids, or a non-empty list of either, "
            f"got {prompt!r:.80}",
            param="prompt",
        )
    if len(prompts) > limits.max_prompts:
        raise ApiError(
            400,
            f"{len(prompts)} prompts are over this server's limit of {limits.max_prompts}",
            param="prompt",
        )
    max_chars = limits.prompt_chars(max_model_len)
    return [
        _prompt_ids(i, p, tokenizer, len(prompts) > 1, max_model_len, max_chars)
        for i, p in enumerate(prompts)
    ]


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _prompt_ids(
    i: int, prompt: Any, tokenizer: Any, many: bool, max_model_len: int, max_chars: int
) -> list[int]:
    where = f"prompt[{i}]" if many else "prompt"
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ApiError(
                400, "this model has no tokenizer: send prompts as token ids", param="prompt"
            )
        if len(prompt) > max_chars:
            raise ApiError(
                400,
                f"{where} of {len(prompt)} characters is over this server's limit of "
                f"{max_chars} (before tokenizing)",
                param="prompt",
            )
        try:
            ids = list(tokenizer.encode(prompt))
        except UnicodeEncodeError as e:  # a lone surrogate (JSON's "\ud800")
            raise ApiError(400, f"{where} is not valid Unicode: {e}", param="prompt") from None
    elif isinstance(prompt, list) and len(prompt) > max_model_len:
        raise ApiError(
            400,
            f"{where} of {len(prompt)} tokens is longer than max_model_len={max_model_len}",
            param="prompt",
        )
    elif isinstance(prompt, list) and all(_is_int(t) for t in prompt):
        ids = prompt
    else:
        raise ApiError(
            400,
            f"{where} must be a string or a list of token ids, got {prompt!r:.80}",
            param="prompt",
        )
    if not ids:
        raise ApiError(400, f"{where} is empty", param="prompt")
    return ids


@dataclasses.dataclass(frozen=True)
class ChatPrompt:
    """A conversation rendered with the chat template, and its token ids."""

    text: str
    token_ids: list[int]


def chat_prompt(
    body: Mapping[str, Any],
    templates: chat.ChatTemplates,
    tokenizer: Any,
    *,
    max_model_len: int,
    limits: Limits = Limits(),
) -> ChatPrompt:
    """The prompt of a chat body: `messages` rendered with the chat template (the body's
    `chat_template`, else the server's) and tokenized with no special tokens added, as
    `LLM.chat` renders it. Text content parts (`[{"type": "text", "text": ...}]`) are
    joined with newlines, as vLLM joins them.

    Rendering is bounded by `limits.chat_template`; a body's own template (not the name
    of one of the checkpoint's) is refused unless `limits.trust_request_chat_template`.
    Runs for as long as rendering and tokenizing take: call it off the event loop."""
    if tokenizer is None:
        raise ApiError(400, "this model has no tokenizer, which chat needs", param="messages")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list of messages", param="messages")
    if len(messages) > limits.max_messages:
        raise ApiError(
            400,
            f"{len(messages)} messages are over this server's limit of {limits.max_messages}",
            param="messages",
        )
    requested = body.get("chat_template")
    if (
        isinstance(requested, str)
        and requested not in templates.templates
        and not limits.trust_request_chat_template
    ):
        raise ApiError(
            400,
            "chat_template: this server renders only its own chat templates (by name: "
            f"{sorted(templates.templates)}); it was not started with "
            "--trust_request_chat_template",
            param="chat_template",
        )
    messages = [_flatten_content(j, m) for j, m in enumerate(messages)]
    flags = {}
    for name, default in (("add_generation_prompt", True), ("continue_final_message", False)):
        value = body.get(name, default)
        if not isinstance(value, bool):
            raise ApiError(400, f"{name} must be a boolean, got {value!r:.80}", param=name)
        flags[name] = value
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise ApiError(400, "chat_template_kwargs must be an object", param="chat_template_kwargs")
    try:
        (conversation,) = chat.parse_conversations([messages])
        template = templates.get(requested)
        (text,) = chat.render(
            template,
            [conversation],
            special_tokens=templates.special_tokens,
            chat_template_kwargs=kwargs,
            limits=limits.chat_template,
            **flags,
        )
    except (TypeError, ValueError, ImportError) as e:  # ImportError: no jinja2
        message = str(e).replace("conversation 0, ", "").replace("conversation 0: ", "")
        param = "chat_template" if "template" in message else "messages"
        raise ApiError(400, message, param=param) from None
    try:
        ids = chat.encode_rendered(tokenizer, text)
    except UnicodeEncodeError as e:
        raise ApiError(400, f"messages are not valid Unicode: {e}", param="messages") from None
    if len(ids) > max_model_len:
        raise ApiError(
            400,
            f"the chat prompt of {len(ids)} tokens is longer than max_model_len={max_model_len}",
            param="messages",
        )
    return ChatPrompt(text, ids)


def _flatten_content(j: int, message: Any) -> Any:
    if not isinstance(message, dict) or not isinstance(message.get("content"), list):
        return message
    texts = []
    for part in message["content"]:
        if not isinstance(part, dict) or part.get("type") != "text":
            raise ApiError(
                400,
                f"message {j}: only text content parts are supported, got {part!r:.80}",
                param="messages",
            )
        texts.append(part.get("text", ""))
    return {**message, "content": "\n".join(texts)}
