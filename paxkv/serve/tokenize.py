"""The tokenizer endpoints, in vLLM's shapes, for clients that count and cut tokens on
the server's tokenizer (lm-eval's `tokenizer_backend=remote`, agent frameworks):

    POST /tokenize        {"prompt": str, "add_special_tokens": bool} or a chat body
                          ({"messages": [...]}, rendered as /v1/chat/completions renders
                          it) -> {"count", "max_model_len", "tokens", "token_strs"}
    POST /detokenize      {"tokens": [int, ...]} -> {"prompt": str}
    GET  /tokenizer_info  the special tokens' text, the chat template, the class and
                          max_model_len

Each is a function of the request's JSON body here; `paxkv.serve.app` routes them.
Bad input is an `ApiError` 400 naming the field.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from paxkv.serve import protocol
from paxkv.serve.protocol import ApiError
from paxkv.text import chat


def _tokenizer(tokenizer: Any) -> Any:
    if tokenizer is None:
        raise ApiError(400, "this model has no tokenizer: send and read token ids")
    return tokenizer


def tokenize(
    body: Mapping[str, Any],
    tokenizer: Any,
    templates: chat.ChatTemplates,
    *,
    max_model_len: int,
    limits: protocol.Limits,
) -> dict[str, Any]:
    """`/tokenize`: the token ids of `prompt` (with the tokenizer's special tokens
    unless `add_special_tokens` is false) or of the chat `messages` as rendered for a
    chat completion; `token_strs` (each token's text) with `return_token_strs`."""
    tokenizer = _tokenizer(tokenizer)
    strs = body.get("return_token_strs", False)
    if not isinstance(strs, bool):
        raise ApiError(
            400, f"return_token_strs must be a boolean, got {strs!r:.80}", param="return_token_strs"
        )
    if "messages" in body:
        ids = protocol.chat_prompt(
            body, templates, tokenizer, max_model_len=2**31 - 1, limits=limits
        ).token_ids
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise ApiError(
                400,
                f"prompt must be a string (or send messages), got {prompt!r:.80}",
                param="prompt",
            )
        special = body.get("add_special_tokens", True)
        if not isinstance(special, bool):
            raise ApiError(
                400,
                f"add_special_tokens must be a boolean, got {special!r:.80}",
                param="add_special_tokens",
            )
        try:
            ids = list(tokenizer.encode(prompt, add_special_tokens=special))
        except UnicodeEncodeError as e:
            raise ApiError(400, f"prompt is not valid Unicode: {e}", param="prompt") from None
    return {
        "count": len(ids),
        "max_model_len": max_model_len,
        "tokens": ids,
        "token_strs": [tokenizer.decode([t]) for t in ids] if strs else None,
    }


def detokenize(body: Mapping[str, Any], tokenizer: Any, *, vocab_size: int) -> dict[str, Any]:
    """`/detokenize`: the text of `tokens`, ids in the vocabulary."""
    tokenizer = _tokenizer(tokenizer)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in tokens
    ):
        raise ApiError(
            400, f"tokens must be a list of token ids, got {tokens!r:.80}", param="tokens"
        )
    bad = next((t for t in tokens if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ApiError(
            400,
            f"tokens: {bad} is not a token id of this model (0 .. {vocab_size - 1})",
            param="tokens",
        )
    return {"prompt": tokenizer.decode(tokens)}


def tokenizer_info(
    tokenizer: Any, templates: chat.ChatTemplates, *, max_model_len: int
) -> dict[str, Any]:
    """`/tokenizer_info`: what a client needs to tokenize as the server does: the
    special tokens' text (None where the tokenizer has none), the default chat template
    (None without one), the tokenizer's class and the longest sequence served."""
    tokenizer = _tokenizer(tokenizer)
    special = dict(templates.special_tokens)
    default = templates.templates.get("default")
    return {
        "tokenizer_class": type(getattr(tokenizer, "tokenizer", tokenizer)).__name__,
        "eos_token": special.get("eos_token"),
        "bos_token": special.get("bos_token"),
        "pad_token": special.get("pad_token"),
        "unk_token": special.get("unk_token"),
        "chat_template": default,
        "model_max_length": max_model_len,
    }
