"""Structured outputs compiled against a tokenizer: llguidance matchers and the token
masks they allow. No JAX; llguidance is optional (the `serve` and `structured` extras).

A `GrammarCompiler` turns a `paxkv.host.structured_outputs.StructuredOutputs` into llguidance's grammar (checked, and
cached by spec) and makes one matcher per constrained sequence. Each step the host
fills a bitmask per constrained sequence, `i32[W]` with bit `t % 32` of word `t // 32`
set when token t may come next (`fill`), and the device's sampler masks the logits
with it (`paxkv.engine.device.sampling.apply_penalties`).
"""

from __future__ import annotations

import collections
import functools
import os
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

_GRAMMARS_CACHED = 256  # compiled grammars kept (a server sees the same schemas again)


def _mask_words(vocab_size: int) -> int:
    """Words of a token bitmask over `vocab_size` tokens."""
    return (vocab_size + 31) // 32


class _ByteTokens:
    """The byte tokenizer (ids 0..255 are bytes) as llguidance's `TokenizerWrapper`
    takes it, with `eos` a token of its own after them (the byte model has no EOS; a
    constraint that is complete and allows nothing else ends the sequence)."""

    def __init__(self, eos: int) -> None:
        self.eos_token_id = eos
        self.bos_token_id = None
        self.tokens = [bytes([i]) for i in range(256)] + [b"<|end|>"] * (eos - 255)
        self.special_token_ids = list(range(256, eos + 1))

    def __call__(self, text: bytes | str) -> list[int]:
        return list(text if isinstance(text, bytes) else text.encode("utf-8"))


class GrammarCompiler:
    """Compiles `StructuredOutputs` for one tokenizer.

    Args:
      tokenizer: the engine's (`paxkv.models.tokenizer`): a Hugging Face `tokenizer.json`
        tokenizer or the byte tokenizer.
      vocab_size: the model's vocabulary (its logits' width, which may exceed the
        tokenizer's: tokens past the tokenizer's are never allowed).
      eos_token_ids: the model's EOS tokens; none: a token past the vocabulary stands in
        for it (never sampled: a complete constraint then ends the sequence).
    """

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self._lock = threading.Lock()
        self._grammars: collections.OrderedDict[tuple, str] = collections.OrderedDict()

    @functools.cached_property
    def _ll(self) -> Any:
        """llguidance's tokenizer (built once: about a second for a large vocabulary)."""
        llguidance = _import()
        tok = self.tokenizer
        if tok is None:
            raise ValueError("structured_outputs needs a tokenizer; this engine has none")
        inner = getattr(tok, "_tokenizer", None)
        if inner is not None and hasattr(inner, "to_str"):  # HFTokenizer
            n = max(self.vocab_size, inner.get_vocab_size(with_added_tokens=True))
            if self.eos_token_ids:
                return llguidance.LLTokenizer(
                    inner.to_str(), n_vocab=n, eos_token=list(self.eos_token_ids)
                )
            return llguidance.LLTokenizer(inner.to_str(), n_vocab=n + 1, eos_token=n)
        if type(tok).__name__ == "ByteTokenizer":
            eos = max(self.vocab_size, 256)
            wrapper = llguidance.TokenizerWrapper(_ByteTokens(eos))
            return llguidance.LLTokenizer(wrapper, eos_token=list(self.eos_token_ids) or eos)
        raise ValueError(
            f"structured_outputs needs a Hugging Face tokenizer.json or the byte tokenizer; "
            f"this engine's is a {type(tok).__name__}"
        )

    @property
    def width(self) -> int:
        """Words of the bitmask llguidance fills (its vocabulary's, EOS included)."""
        return _mask_words(self._ll.vocab_size)

    def compile(self, spec: Any) -> str:
        """llguidance's grammar of `spec` (a `StructuredOutputs`), checked against the tokenizer; ValueError
        naming the field (`structured_outputs.json`, ...) when it does not compile."""
        key = spec.key()
        with self._lock:
            if key in self._grammars:
                self._grammars.move_to_end(key)
                return self._grammars[key]
        llguidance = _import()
        grammar = _grammar(llguidance, spec)
        error = llguidance.LLMatcher.validate_grammar(grammar, self._ll)
        if error and not error.startswith("WARNING"):
            raise ValueError(f"structured_outputs.{spec.kind} does not compile: {error.strip()}")
        with self._lock:
            self._grammars[key] = grammar
            while len(self._grammars) > _GRAMMARS_CACHED:
                self._grammars.popitem(last=False)
        return grammar

    def matcher(self, grammar: str) -> Any:
        """A new `llguidance.LLMatcher` of a compiled grammar, at its start."""
        m = _import().LLMatcher(self._ll, grammar, log_level=0)
        if m.is_error():
            raise ValueError(f"structured_outputs does not compile: {m.get_error()}")
        return m

    @functools.cached_property
    def _executor(self) -> Any:
        return _import().LLExecutor(max(1, min(8, (os.cpu_count() or 1))))

    def consume(self, pairs: Sequence[tuple[Any, int]]) -> list[bool]:
        """Feeds each `(matcher, token)` pair on llguidance's threads (the GIL
        released); whether each matcher took its token (False: it is in error)."""
        return list(_import_numpy().consume_token_par(self._executor, list(pairs)))

    def fill(
        self,
        matchers: Sequence[Any],
        out: np.ndarray,
        drafts: Sequence[Sequence[int]] | None = None,
    ) -> None:
        """Fills `out` (i32[n, W], W at least the model's words) with the matchers'
        masks of the tokens they allow next, on llguidance's threads (the GIL released),
        then clears the bits past the model's vocabulary. Row i is matcher i's; with
        `drafts` (speculative proposals each matcher allows), matcher i has
        `1 + len(drafts[i])` consecutive rows: its mask now, then after each proposal."""
        width = max(self.width, out.shape[1])
        buf = np.zeros((out.shape[0], width), np.int32)
        numpy = _import_numpy()
        at, plain, drafted = 0, [], []
        for i, m in enumerate(matchers):
            d = list(drafts[i]) if drafts is not None else []
            if d:
                drafted.append((m, at, d))
            else:
                plain.append((m, at))
            at += 1 + len(d)
        if drafted:
            numpy.fill_next_token_bitmask_par_with_draft_tokens(self._executor, drafted, buf)
        if plain:
            numpy.fill_next_token_bitmask_par(self._executor, plain, buf)
        words = out.shape[1]
        out[:] = buf[:, :words]
        v = self.vocab_size
        if v < 32 * words:  # tokens past the model's vocabulary: never
            out[:, v // 32] &= np.int32((1 << (v % 32)) - 1) if v % 32 else 0
            out[:, v // 32 + 1 :] = 0


def check_compiles(spec: Any) -> None:
    """ValueError naming the field (`structured_outputs.regex`, ...) when `spec` (a
    `StructuredOutputs`) does not compile, whatever the tokenizer (what a server checks
    before a request reaches an engine)."""
    _checked(spec)


@functools.lru_cache(maxsize=_GRAMMARS_CACHED)
def _checked(spec: Any) -> None:
    """`check_compiles` once per distinct spec (a request's prompts share one)."""
    llguidance = _import()
    error = llguidance.LLMatcher.validate_grammar(_grammar(llguidance, spec))
    if error and not error.startswith("WARNING"):
        raise ValueError(f"structured_outputs.{spec.kind} does not compile: {error.strip()}")


def _grammar(llguidance: Any, spec: Any) -> str:
    kind = spec.kind
    try:
        if kind in ("json", "json_object"):
            options: dict[str, Any] = {}
            if spec.disable_any_whitespace:
                options["whitespace_flexible"] = False
            if spec.whitespace_pattern is not None:
                options["whitespace_pattern"] = spec.whitespace_pattern
            schema = spec.json if kind == "json" else '{"type": "object"}'
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options or None)
        if kind == "regex":
            return llguidance.grammar_from("regex", spec.regex)
        if kind == "choice":
            return llguidance.grammar_from("choice", list(spec.choice))
        return llguidance.grammar_from("grammar", spec.grammar)
    except ValueError as e:
        raise ValueError(f"structured_outputs.{kind} does not compile: {e}") from None


def _import() -> Any:
    try:
        import llguidance
    except ImportError:
        raise ImportError(
            "structured_outputs needs llguidance: pip install 'paxkv[structured]' "
            "(the serve extra has it too)"
        ) from None
    return llguidance


def _import_numpy() -> Any:
    _import()
    import llguidance.numpy

    return llguidance.numpy
