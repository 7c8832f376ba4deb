"""The OpenAI wire format of responses: engine outputs turned into response bodies and
stream chunks (`/v1/completions` and `/v1/chat/completions` choices, logprobs, usage).

Plain Python: no HTTP here. The requests' side is `paxkv.serve.protocol`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from paxkv.host.request import CompletionOutput, Logprob, RequestOutput
from paxkv.text.detokenizer import WindowStream


class Choices:
    """The completions of one HTTP request as they come, as OpenAI choices.

    Each engine request (one per prompt) has `n` completions; choice `i * n + j` is
    completion j of prompt i. `add` takes a delta output and returns the stream chunk's
    choices for it; `response` gives the whole response once every request is done.

    Args:
      request_ids: the engine request of each prompt, in prompt order.
      n: completions per prompt.
      chat_response: chat choices (a message, a delta) instead of completion ones (text).
      top_logprobs: k of `SamplingParams.logprobs`: chat's `top_logprobs` lists these.
      token_ids: write tokens as "token_id:<id>" in logprobs (vLLM's
        `return_tokens_as_token_ids`).
      echo: completions only: each choice's text (and, with logprobs, its logprobs)
        starts with its prompt's, as vLLM's echo: the first prompt token with logprob
        None, the others with their prompt logprobs; streamed, in each choice's first
        chunk.
      decode: token ids to text (the tokenizer's `decode`), for the echoed prompt's
        text and its first token; None: the prompt's text is empty and its tokens are
        written as "token_id:<id>".
    """

    def __init__(
        self,
        request_ids: Sequence[str],
        n: int,
        *,
        chat_response: bool,
        top_logprobs: int = 0,
        token_ids: bool = False,
        echo: bool = False,
        decode: Callable[[list[int]], str] | None = None,
    ) -> None:
        self._k = top_logprobs
        self._echo = echo
        self._decode = decode
        # Per prompt: its echoed text and logprob entries (offsets from 0).
        self._echoed: dict[int, tuple[str, list[dict[str, Any]]]] = {}
        self._echo_streamed: set[int] = set()  # choices whose chunk carried the echo
        self._streams: dict[int, WindowStream] = {}  # each choice's token texts so far
        self._prompt_index = {rid: i for i, rid in enumerate(request_ids)}
        self._n = n
        self._chat = chat_response
        self._token_ids = token_ids
        num = len(request_ids) * n
        self._text = [[] for _ in range(num)]
        self._logprobs = [[] for _ in range(num)]
        self._finish: list[tuple[str | None, Any]] = [(None, None)] * num
        self._offsets = [0] * num
        self._cumulative = [0.0] * num  # each choice's cumulative logprob (with logprobs)
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.errors: list[str] = []

    def add(self, out: RequestOutput) -> list[dict[str, Any]]:
        """Records a delta output; the chunk choices it makes."""
        base = self._prompt_index[out.request_id] * self._n
        if self._echo and base // self._n not in self._echoed:
            self._echoed[base // self._n] = self._echo_prompt(out)
        if out.finished:
            self.prompt_tokens += len(out.prompt_token_ids)
            if out.error is not None:
                self.errors.append(out.error)
        chunks = []
        for c in out.outputs:
            i = base + c.index
            self.completion_tokens += len(c.token_ids)
            text = c.text or ""
            self._text[i].append(text)
            logprobs = self._logprob_entries(i, c)
            self._logprobs[i].extend(logprobs)
            if c.cumulative_logprob is not None:
                self._cumulative[i] = c.cumulative_logprob
            shown_text, shown = text, logprobs  # the stream chunk's: after the echo's
            if self._echo:
                echoed_text, echoed = self._echoed[base // self._n]
                shift = sum(len(e["token"]) for e in echoed)
                shown = [{**e, "offset": e["offset"] + shift} for e in logprobs]
                if i not in self._echo_streamed:
                    self._echo_streamed.add(i)
                    shown_text, shown = echoed_text + text, echoed + shown
            if c.finish_reason is not None:
                self._finish[i] = (c.finish_reason, c.stop_reason)
            if self._chat:
                delta = {"content": text} if text or c.finish_reason is None else {}
                lp = None if c.logprobs is None else {"content": logprobs}
                chunks.append(
                    {"index": i, "delta": delta, "logprobs": lp, "finish_reason": c.finish_reason}
                )
            else:
                chunks.append(
                    {
                        "index": i,
                        "text": shown_text,
                        "logprobs": None if c.logprobs is None else _merge(shown),
                        "finish_reason": c.finish_reason,
                        "stop_reason": c.stop_reason,
                    }
                )
        return chunks

    def role_chunks(self) -> list[dict[str, Any]]:
        """Chat streams open each choice with the assistant's role, as OpenAI's do."""
        return [
            {
                "index": i,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
            for i in range(len(self._text))
        ]

    def usage(self) -> dict[str, int]:
        """OpenAI's `usage`: prompt tokens (once per prompt), completion tokens, total."""
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }

    def response_choices(
        self, *, best: int | None = None, logprobs: bool = True
    ) -> list[dict[str, Any]]:
        """The choices of the whole (non-streamed) response; with `best`, each prompt's
        `best` choices of highest cumulative logprob (OpenAI's `best_of`), numbered
        from 0, and without their logprobs unless `logprobs`."""
        choices = self._choices()
        if best is None:
            return choices
        kept = []
        for p in range(0, len(choices), self._n):
            group = choices[p : p + self._n]
            ranked = sorted(range(len(group)), key=lambda j: -self._cumulative[p + j])
            kept += [group[j] for j in sorted(ranked[:best])]
        for index, choice in enumerate(kept):
            choice["index"] = index
            if not logprobs:
                choice["logprobs"] = None
        return kept

    def _choices(self) -> list[dict[str, Any]]:
        choices = []
        for i, parts in enumerate(self._text):
            reason, stop_reason = self._finish[i]
            logprobs = self._logprobs[i]
            if self._echo:
                text, entries = self._echoed.get(i // self._n, ("", []))
                shift = sum(len(e["token"]) for e in entries)
                parts = [text, *parts]
                logprobs = entries + [{**e, "offset": e["offset"] + shift} for e in logprobs]
            asked = bool(logprobs) or None
            if self._chat:
                choice = {
                    "index": i,
                    "message": {"role": "assistant", "content": "".join(parts)},
                    "logprobs": {"content": logprobs} if asked else None,
                }
            else:
                choice = {
                    "index": i,
                    "text": "".join(parts),
                    "logprobs": _merge(logprobs) if asked else None,
                }
            choice["finish_reason"] = reason
            choice["stop_reason"] = stop_reason
            choices.append(choice)
        return choices

    def _echo_prompt(self, out: RequestOutput) -> tuple[str, list[dict[str, Any]]]:
        """The echoed text of `out`'s prompt, and its logprob entries when it has them."""
        ids = out.prompt_token_ids
        text = out.prompt if out.prompt is not None else ""
        if out.prompt is None and self._decode is not None:
            text = self._decode(list(ids))
        if out.prompt_logprobs is None:
            return text, []
        # Each token's text as the prompt's text has it: a character split over several
        # tokens (a UTF-8 byte each) is the text of the token that completes it, the
        # others' empty; so the tokens' texts make the text, and offsets stay inside it.
        names = _token_texts(ids, self._decode) if self._decode is not None else None
        entries, offset = [], 0
        for i, (token, top) in enumerate(zip(ids, out.prompt_logprobs, strict=True)):
            shown = Logprob(0.0, decoded_token=None if names is None else names[i])
            if top is None:  # nothing before it (vLLM: None; OpenAI: null)
                name = self._token(token, shown)
                entry = {"token": name, "logprob": None, "top": None, "offset": offset}
            else:
                name = self._token(token, shown if names is not None else top[token])
                entry = {
                    "token": name,
                    "logprob": top[token].logprob,
                    "top": {self._token(t, lp): lp.logprob for t, lp in top.items()},
                    "offset": offset,
                }
            entries.append(entry)
            offset += len(name)
        return text, entries

    def _token(self, token: int, lp: Logprob) -> str:
        if self._token_ids or lp.decoded_token is None:
            return f"token_id:{token}"
        return lp.decoded_token

    def _logprob_entries(self, i: int, c: CompletionOutput) -> list[dict[str, Any]]:
        if c.logprobs is None:
            return []
        entries = []
        # A completion's tokens named by the text each adds (`_token_texts`, across its
        # deltas): a character split over several tokens is the text of the token that
        # completes it, the others "", so the tokens make the text and the offsets stay
        # in it (each token decoded alone would be U+FFFD).
        stream = None
        if not self._chat and not self._token_ids and self._decode is not None:
            stream = self._streams.setdefault(i, WindowStream(self._decode))
        last = len(c.token_ids) - 1
        for j, (token, top) in enumerate(zip(c.token_ids, c.logprobs, strict=True)):
            chosen = top[token]
            if stream is None:
                text = self._token(token, chosen)
            else:
                text = stream.step(token)
                if j == last and c.finish_reason is not None:
                    text += stream.flush()
            # The k most likely: ranks 1..k (the chosen token may be one, or come extra).
            ranked = sorted(top.items(), key=lambda e: e[1].rank or len(top) + 1)[: self._k]
            if self._chat:
                entries.append(
                    {
                        "token": text,
                        "logprob": chosen.logprob,
                        "bytes": list(text.encode()),
                        "top_logprobs": [
                            {
                                "token": (s := self._token(t, lp)),
                                "logprob": lp.logprob,
                                "bytes": list(s.encode()),
                            }
                            for t, lp in ranked
                        ],
                    }
                )
            else:
                entries.append(
                    {
                        "token": text,
                        "logprob": chosen.logprob,
                        "top": {self._token(t, lp): lp.logprob for t, lp in top.items()},
                        "offset": self._offsets[i],
                    }
                )
            self._offsets[i] += len(text)
        return entries


def _token_texts(ids: Sequence[int], decode: Callable[[list[int]], str]) -> list[str]:
    """The text each of `ids` adds to their decoded text, in order (`WindowStream`):
    "" for a token whose character the next ones complete."""
    stream = WindowStream(decode)
    texts = [stream.step(t) for t in ids]
    if texts:
        texts[-1] += stream.flush()
    return texts


def _merge(entries: list[dict[str, Any]]) -> dict[str, list[Any]]:
    """Completions' logprobs object: per-token lists (`tokens`, `token_logprobs`,
    `top_logprobs`, `text_offset`)."""
    return {
        "tokens": [e["token"] for e in entries],
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [e["top"] for e in entries],
        "text_offset": [e["offset"] for e in entries],
    }
