"""Text <-> token ids: a Hugging Face `tokenizer.json` (optional `tokenizers` library) or raw bytes."""

from __future__ import annotations

import functools
import json
import os
from typing import Any, Protocol

from absl import logging

from paxkv.text.detokenizer import TokenStream, Utf8Stream, WindowStream, window_text

TOKENIZER_FILE = "tokenizer.json"


class Tokenizer(Protocol):
    """What the engine needs of a tokenizer: text to ids and back.

    A tokenizer may also have `decode_stream() -> paxkv.text.detokenizer.TokenStream`, a
    streaming decoder of its own; without it, outputs are decoded over a window of
    recent tokens (`paxkv.text.detokenizer.WindowStream`).
    """

    vocab_size: int

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; with `add_special_tokens`, those the tokenizer adds (BOS)."""
        ...

    def decode(self, ids: list[int]) -> str:
        """Text of `ids`."""
        ...


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255; invalid byte sequences decode to U+FFFD."""

    vocab_size = 256

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """The UTF-8 bytes of `text`, one id per byte (it has no special tokens)."""
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        """Text of byte ids; invalid UTF-8 becomes U+FFFD."""
        return bytes(ids).decode("utf-8", errors="replace")

    def decode_stream(self) -> Utf8Stream:
        """A streaming decoder: its text is `decode`'s, one byte at a time."""
        return Utf8Stream()


def byte_tokenizer_json() -> str:
    """The `ByteTokenizer` as a Hugging Face `tokenizer.json`: byte-level BPE with no
    merges, token id = byte, no special tokens (what `transformers.AutoTokenizer` and
    lm-eval's `huggingface` tokenizer read; tiny-py ships it). Built without the
    `tokenizers` package; its `encode`/`decode` equal `ByteTokenizer`'s."""
    # GPT-2's map of bytes to printable characters, which byte-level BPE vocabularies use.
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]
    chars = {b: chr(b) for b in printable} | {b: chr(256 + i) for i, b in enumerate(others)}
    byte_level = {"add_prefix_space": False, "trim_offsets": True, "use_regex": False}
    spec = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [],
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", **byte_level},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", **byte_level},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": {chars[b]: b for b in range(256)},
            "merges": [],
        },
    }
    return json.dumps(spec, ensure_ascii=False, indent=1) + "\n"


# tiny-py's chat template: each message on a line of its own, then the assistant's turn.
BYTE_CHAT_TEMPLATE = (
    "{% for message in messages %}# {{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}# assistant:\n{% endif %}"
)


def write_byte_tokenizer(out_dir: str, chat_template: str = BYTE_CHAT_TEMPLATE) -> None:
    """Writes the byte tokenizer's files into checkpoint directory `out_dir`:
    `tokenizer_config.json`, which declares it to paxkv (`"paxkv_tokenizer": "bytes"`)
    and holds `chat_template`, and `tokenizer.json` (`byte_tokenizer_json`), so that
    `transformers.AutoTokenizer` and lm-eval read the same tokens."""
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "paxkv_tokenizer": "bytes",
        "chat_template": chat_template,
    }
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        f.write(json.dumps(config, indent=2) + "\n")
    with open(os.path.join(out_dir, TOKENIZER_FILE), "w", encoding="utf-8") as f:
        f.write(byte_tokenizer_json())


class HFTokenizer:
    """A `tokenizers.Tokenizer` read from a `tokenizer.json`.

    `encode` adds the special tokens the file's post-processor defines (e.g. Llama 3's
    BOS); `decode` drops special tokens.
    """

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self.vocab_size = tokenizer.get_vocab_size()

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`, with the special tokens the post-processor adds unless
        `add_special_tokens=False` (text that already holds them, e.g. a chat template's)."""
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int]) -> str:
        """Text of `ids`, special tokens skipped."""
        return self._tokenizer.decode(list(ids), skip_special_tokens=True)

    def decode_stream(self) -> TokenStream:
        """A streaming decoder whose text is `decode`'s: the `tokenizers` library's
        `DecodeStream` (0.21 and later; a `WindowStream` before)."""
        try:
            from tokenizers.decoders import DecodeStream  # noqa: F401
        except ImportError:
            return WindowStream(self.decode)
        return _HFDecodeStream(self._tokenizer, self.decode)


# What `DecodeStream.step` raises when a token changes text it already returned.
_INVALID_PREFIX = "Invalid prefix encountered"


class _HFDecodeStream:
    """`tokenizers.decoders.DecodeStream` (special tokens skipped), and the text of the
    tokens it holds back (an incomplete character) when the sequence ends."""

    def __init__(self, tokenizer: Any, decode: Any) -> None:
        from tokenizers.decoders import DecodeStream

        self._new_stream = lambda: DecodeStream(skip_special_tokens=True)
        self._stream = self._new_stream()
        self._tokenizer = tokenizer
        self._decode = decode
        self._context: list[int] = []  # the tokens of the last text returned
        self._pending: list[int] = []  # tokens since, held back by the stream

    def step(self, token: int) -> str:
        """The text `token` completes."""
        try:
            text = self._stream.step(self._tokenizer, token)
        except Exception as e:
            if not str(e).startswith(_INVALID_PREFIX):
                raise
            # A token rewrote text already returned (as vLLM does: start a new stream).
            logging.warning("paxkv: %s; restarting the decode stream", e)
            self._stream, self._context, self._pending = self._new_stream(), [], []
            text = self._stream.step(self._tokenizer, token)
        self._pending.append(token)
        if text is None:
            return ""
        self._context, self._pending = self._pending, []
        return text

    def flush(self) -> str:
        """The held-back tokens' text as `decode` renders it after the text before."""
        if not self._pending:
            return ""
        text = window_text(self._decode, self._context, self._pending)
        self._stream, self._context, self._pending = self._new_stream(), [], []
        return text


def load_tokenizer(path: str | os.PathLike) -> HFTokenizer | None:
    """The tokenizer in directory `path`, or None without a `tokenizer.json` or `tokenizers`
    (then a warning, once per file: text prompts will fail).

    ValueError naming the file when `tokenizers` cannot read it (not JSON, not a
    tokenizer, not UTF-8); OSError when it cannot be opened.
    """
    file = os.path.join(os.fspath(path), TOKENIZER_FILE)
    if not os.path.exists(file):
        return None
    try:
        from tokenizers import Tokenizer as _Tokenizer
    except ImportError:
        _warn_unreadable(file)
        return None
    with open(file, "rb"):  # an unopenable file is an OSError, not a parse error
        pass
    try:
        tokenizer = _Tokenizer.from_file(file)
    # `tokenizers` raises the bare Exception class for every file it cannot parse.
    except Exception as e:
        raise ValueError(f"{file}: not a readable tokenizer file ({e})") from e
    return HFTokenizer(tokenizer)


@functools.cache
def _warn_unreadable(file: str) -> None:
    logging.warning(
        "paxkv: IGNORING %s: reading it needs the tokenizers package, which is not "
        "installed (pip install -e '.[tokenizers]'); text prompts and chat will fail",
        file,
    )
