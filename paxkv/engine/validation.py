"""What a request must be to be served: its sampling parameters against the engine's
limits, and its prompt as token ids (`RequestRegistry.validate`). Each check raises a
ValueError that names the request and the field and shows the value."""

from __future__ import annotations

from typing import Any

from paxkv.host.request import SamplingParams, normalize_prompt


def check_params(
    request_id: str, params: SamplingParams, tokenizer: Any, max_logprobs: int, max_n: int = 128
) -> None:
    """ValueError unless `params` can be served: stop strings need a tokenizer,
    `logprobs` / `prompt_logprobs` are at most `max_logprobs`, and `n` at most `max_n`."""
    if params.n > max_n:
        raise ValueError(
            f"request {request_id!r}: SamplingParams.n={params.n} exceeds the engine's "
            f"max_n={max_n} (EngineConfig.max_n)"
        )
    if params.stop and tokenizer is None:
        raise ValueError(
            f"request {request_id!r}: stop strings (SamplingParams.stop={list(params.stop)!r}) "
            "are matched on the text and need a tokenizer, and the engine has none: "
            "pass Engine(..., tokenizer=paxkv.models.load_tokenizer(checkpoint_dir))"
        )
    for name in ("logprobs", "prompt_logprobs"):
        k = getattr(params, name)
        if k is not None and k > max_logprobs:
            raise ValueError(
                f"request {request_id!r}: {name}={k} exceeds the engine's "
                f"max_logprobs={max_logprobs}"
            )


def prompt_ids(
    request_id: str, prompt: str | dict, tokenizer: Any, vocab_size: int, max_model_len: int
) -> tuple[str | None, list[int]]:
    """`(text, token_ids)` of a prompt (a string, encoded with `tokenizer`, or
    `{"prompt_token_ids": [...]}`); ValueError unless it is non-empty, inside the
    vocabulary and at most `max_model_len` tokens."""
    text, ids = normalize_prompt(prompt)
    if ids is None:
        if tokenizer is None:
            raise ValueError(
                "a string prompt needs a tokenizer, and the engine has none: pass "
                "tokenizer= to Engine(...) or LLM.from_model(...) (e.g. "
                "paxkv.models.load_tokenizer(checkpoint_dir); LLM reads a checkpoint's "
                "tokenizer.json with the tokenizers package: pip install -e "
                "'.[tokenizers]'), or {'prompt_token_ids': [...]} instead"
            )
        ids = list(tokenizer.encode(text))
    if not ids:
        raise ValueError(f"request {request_id!r}: the prompt is empty")
    bad = [(i, t) for i, t in enumerate(ids) if not 0 <= t < vocab_size]
    if bad:
        i, t = bad[0]
        raise ValueError(
            f"request {request_id!r}: token id {t} at position {i} is outside the vocabulary [0, {vocab_size})"
        )
    if len(ids) > max_model_len:
        raise ValueError(
            f"request {request_id!r}: prompt of {len(ids)} tokens is longer than max_model_len={max_model_len}"
        )
    return text, ids
