"""Chat templates: conversations rendered to prompt text and ids, as transformers renders them.

A checkpoint's chat template is a Jinja program (`chat_template` in its
`tokenizer_config.json`, or the newer `chat_template.jinja` beside it) that turns a list
of `{"role", "content"}` messages into one prompt string, special tokens written out as
text. It is rendered here exactly as transformers' `apply_chat_template` renders it: in
a sandboxed, immutable Jinja environment with `trim_blocks` and `lstrip_blocks`, the
same `tojson` filter and the same `raise_exception` and `strftime_now` functions. Chat
templates are code from the checkpoint's authors, hence the sandbox.

jinja2 is imported only when a template is compiled (`pip install -e '.[tokenizers]'`;
the `serve` extra has it too).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from paxkv.text.template_sandbox import (
    RenderLimits,
    bounded_environment,
    load_jinja2,
    render_bounded,
)

# transformers' own file for a checkpoint's default template; it wins over the field of
# tokenizer_config.json, as in transformers.
CHAT_TEMPLATE_FILE = "chat_template.jinja"
# The special tokens a template sees as variables, as transformers passes them
# (`special_tokens_map`): their text, from tokenizer_config.json.
SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
# What the final message is marked with to find where it ends in the rendered text
# (`continue_final_message`); transformers' marker.
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
# Variables `render` sets itself, which `chat_template_kwargs` may not replace.
_RESERVED = ("messages", "add_generation_prompt", "tools", "documents")

Conversation = list[dict[str, Any]]


@dataclasses.dataclass(frozen=True)
class ChatTemplates:
    """A checkpoint's chat templates and the special-token text they may refer to.

    `templates` maps a name to Jinja source; a checkpoint with one template names it
    "default". `special_tokens` maps e.g. "bos_token" to its text. `source` says where
    they were read, and `knob` how to pass a template, for messages: the Python
    argument, or the server's flag ("--chat_template=").
    """

    templates: Mapping[str, str]
    special_tokens: Mapping[str, str]
    source: str
    knob: str = "chat_template="

    @classmethod
    def from_checkpoint(cls, directory: str | None, tokenizer_config_file: str) -> ChatTemplates:
        """The templates of checkpoint `directory` (None: a model with no files: none).

        Reads `tokenizer_config_file` in it (its "chat_template": a string, or a list of
        {"name", "template"}; and the special tokens, as strings or AddedToken dicts) and
        `chat_template.jinja`, which replaces the config's default template. Missing
        files give no templates; unreadable ones raise ValueError naming the file.
        """
        if directory is None:
            return cls({}, {}, "a model with no checkpoint directory")
        config_path = os.path.join(directory, tokenizer_config_file)
        config = _read_json_object(config_path) if os.path.isfile(config_path) else {}
        templates = _templates_of(config.get("chat_template"), config_path)
        jinja_path = os.path.join(directory, CHAT_TEMPLATE_FILE)
        if os.path.isfile(jinja_path):
            try:
                with open(jinja_path, encoding="utf-8") as f:
                    templates["default"] = f.read()
            except (OSError, UnicodeDecodeError) as e:
                raise ValueError(f"cannot read {jinja_path}: {e}") from None
        special = {}
        for name in SPECIAL_TOKEN_NAMES:
            token = config.get(name)
            if isinstance(token, dict):  # a serialized AddedToken
                token = token.get("content")
            if token is None:
                continue
            if not isinstance(token, str):
                raise ValueError(f"{config_path}: {name} must be a string, got {token!r}")
            special[name] = token
        return cls(templates, special, directory)

    def get(self, chat_template: str | None = None) -> str:
        """The Jinja source to render with: `chat_template` itself, or the checkpoint's
        template of that name; None: the checkpoint's default.

        Raises ValueError when there is none to use.
        """
        if chat_template is not None:
            if not isinstance(chat_template, str):
                raise TypeError(
                    f"chat_template must be a str (a Jinja template or the name of one of "
                    f"the checkpoint's), got {type(chat_template).__name__}"
                )
            return self.templates.get(chat_template, chat_template)
        if "default" in self.templates:
            return self.templates["default"]
        if self.templates:
            raise ValueError(
                f"{self.source} has chat templates {sorted(self.templates)} and none named "
                f"'default': pass {self.knob} one of them (or a Jinja template)"
            )
        raise ValueError(
            f"{self.source} has no chat template (no 'chat_template' in its tokenizer "
            f"config, no {CHAT_TEMPLATE_FILE}): pass {self.knob}<a Jinja template>"
        )


def _read_json_object(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {path}: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(value).__name__}")
    return value


def _templates_of(field: Any, path: str) -> dict[str, str]:
    """The templates of a tokenizer config's "chat_template" field, by name."""
    if field is None:
        return {}
    if isinstance(field, str):
        return {"default": field}
    if isinstance(field, list) and all(
        isinstance(t, dict)
        and isinstance(t.get("name"), str)
        and isinstance(t.get("template"), str)
        for t in field
    ):
        return {t["name"]: t["template"] for t in field}
    raise ValueError(
        f"{path}: chat_template must be a string or a list of {{'name', 'template'}} "
        f"strings, got {field!r:.200}"
    )


def parse_conversations(messages: Any) -> list[Conversation]:
    """`messages` as a list of conversations, checked; a copy the caller's data never shares.

    `messages` is one conversation (a list of message dicts) or a list of them. A message
    is a dict with a non-empty str "role" and a str "content"; other keys (e.g. "name")
    are passed to the template as they are, and keys whose value is None are dropped, as
    transformers drops them. Raises TypeError or ValueError naming the conversation, the
    message and the field.
    """
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence):
        raise TypeError(
            f"messages must be a list of message dicts (one conversation) or a list of "
            f"such lists, got {type(messages).__name__}"
        )
    if not messages:
        raise ValueError("messages is empty: pass at least one conversation")
    batched = isinstance(messages[0], (list, tuple))
    conversations = list(messages) if batched else [messages]
    parsed = []
    for i, conversation in enumerate(conversations):
        if not isinstance(conversation, (list, tuple)):
            raise TypeError(
                f"conversation {i} must be a list of message dicts, got {type(conversation).__name__}"
            )
        if not conversation:
            raise ValueError(f"conversation {i} is empty: it needs at least one message")
        parsed.append([_parse_message(i, j, m) for j, m in enumerate(conversation)])
    return parsed


def _parse_message(i: int, j: int, message: Any) -> dict[str, Any]:
    where = f"conversation {i}, message {j}"
    if not isinstance(message, Mapping):
        raise TypeError(
            f"{where} must be a dict with 'role' and 'content', got {type(message).__name__}"
        )
    for key in message:
        if not isinstance(key, str):
            raise TypeError(f"{where}: keys must be strings, got {key!r}")
    for field in ("role", "content"):
        if field not in message:
            raise ValueError(f"{where} has no {field!r}")
        value = message[field]
        if not isinstance(value, str):
            raise TypeError(
                f"{where}: {field} must be a str, got {type(value).__name__} {value!r:.80}"
            )
    if not message["role"]:
        raise ValueError(f"{where}: role is empty")
    return {k: v for k, v in message.items() if v is not None}


def render(
    template: str,
    conversations: Sequence[Conversation],
    *,
    special_tokens: Mapping[str, str] | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    limits: RenderLimits | None = None,
) -> list[str]:
    """The prompt text of each parsed conversation (see `parse_conversations`).

    The template sees `messages`, `add_generation_prompt`, `tools` and `documents` (None),
    the `special_tokens` (e.g. `bos_token`) and `chat_template_kwargs`, which may replace
    special tokens but not the others. `add_generation_prompt` appends the header that
    starts the assistant's reply; `continue_final_message` ends the text right after
    the final message's content instead (no end-of-turn), so the model continues it.
    Raises ValueError when the template does not parse, or, naming the conversation,
    when it raises (`raise_exception`), drops the final message to be continued, or
    passes `limits` (None: none, for templates the caller trusts).
    """
    for name, value in (
        ("add_generation_prompt", add_generation_prompt),
        ("continue_final_message", continue_final_message),
    ):
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool, got {value!r}")
    if add_generation_prompt and continue_final_message:
        raise ValueError(
            "add_generation_prompt and continue_final_message cannot both be True: "
            "add_generation_prompt starts a new assistant message, continue_final_message "
            "continues the last one (pass add_generation_prompt=False)"
        )
    if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, Mapping):
        raise TypeError(
            f"chat_template_kwargs must be a dict, got {type(chat_template_kwargs).__name__}"
        )
    kwargs = dict(chat_template_kwargs or {})
    for key in kwargs:
        if not isinstance(key, str):
            raise TypeError(f"chat_template_kwargs keys must be strings, got {key!r}")
        if key in _RESERVED:
            raise ValueError(f"chat_template_kwargs may not set {key!r}: chat() sets it")
    if continue_final_message and "content" not in template:
        raise ValueError(
            "continue_final_message is set but the chat template never reads 'content'"
        )
    compiled = _compile(template, limits)
    variables = {**(special_tokens or {}), **kwargs}
    texts = []
    for i, conversation in enumerate(conversations):
        try:
            texts.append(
                _render_one(
                    compiled,
                    conversation,
                    add_generation_prompt,
                    continue_final_message,
                    variables,
                    limits,
                )
            )
        except ValueError as e:
            raise ValueError(f"conversation {i}: {e}") from None
    return texts


def _render_one(
    compiled: Any,
    conversation: Conversation,
    add_generation_prompt: bool,
    continue_final_message: bool,
    variables: dict[str, Any],
    limits: RenderLimits | None,
) -> str:
    messages = [dict(m) for m in conversation]
    final = messages[-1]["content"]
    if continue_final_message:
        messages[-1]["content"] = final + _CONTINUE_TAG
    context = dict(
        messages=messages,
        add_generation_prompt=add_generation_prompt,
        tools=None,
        documents=None,
        **variables,
    )
    try:
        if limits is None:
            text = compiled.render(**context)
        else:
            text = render_bounded(compiled, context, limits)
    except load_jinja2().TemplateError as e:
        raise ValueError(f"the chat template raised: {e}") from None
    except RecursionError:
        raise ValueError("the chat template recursed too deeply") from None
    if not continue_final_message:
        return text
    # The template may strip the content: cut at the marker, and before the trailing
    # space of the content too when the template dropped the marker's, as transformers does.
    tag = _CONTINUE_TAG.strip()
    if final.strip() not in text or tag not in text:
        raise ValueError(
            "continue_final_message is set but the chat template dropped (part of) the "
            f"final message: {final.strip()!r:.200} is not in the rendered text"
        )
    at = text.rindex(tag)
    return text[:at] if text[at:].startswith(_CONTINUE_TAG) else text[:at].rstrip()


def encode_rendered(tokenizer: Any, text: str) -> list[int]:
    """Token ids of rendered chat text, with no special tokens added by the tokenizer.

    The template wrote the special tokens (e.g. BOS) as text already; adding them again
    would double them, so this encodes as transformers' `apply_chat_template` does
    (`add_special_tokens=False`; see `paxkv.models.tokenizer.Tokenizer`).
    """
    return list(tokenizer.encode(text, add_special_tokens=False))


@functools.lru_cache(maxsize=16)
def _compile(template: str, limits: RenderLimits | None = None) -> Any:
    """The compiled template, in the environment transformers renders chat templates in
    (bounded by `limits`, when given: `bounded_environment`)."""
    jinja2 = load_jinja2()

    class Generation(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}`, which transformers uses to mask
        assistant tokens in training; it renders its body unchanged."""

        tags = frozenset({"generation"})

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(
                lineno
            )

        def _body(self, caller):
            return caller()

    def raise_exception(message: str):
        raise jinja2.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # Jinja's own tojson escapes HTML characters; transformers' does not.
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def strftime_now(format: str) -> str:
        return datetime.now().strftime(format)

    environment = jinja2.sandbox.ImmutableSandboxedEnvironment
    if limits is not None:
        environment = bounded_environment(environment, limits)
    env = environment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"the chat template does not parse: {e} (line {e.lineno})") from None
