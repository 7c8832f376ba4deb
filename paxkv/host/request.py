"""What a user submits and what comes back: sampling parameters, outputs and metrics.

Plain Python, no JAX: the scheduler and the API share these types. The names follow
vLLM's offline API (`SamplingParams`, `RequestOutput`, `CompletionOutput`), so code
written against it switches over.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import numbers
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from paxkv.host.structured_outputs import StructuredOutputs

# The largest value of an integer field that reaches the device (as int32).
INT32_MAX = 2**31 - 1
# The most stop strings one request may give, and the longest: each token's text is
# matched against them (a server's `protocol.Limits` may allow fewer).
MAX_STOP_STRINGS = 1024
MAX_STOP_STRING_CHARS = 1024
# The most stop token ids one request may give (each sampled token is looked up in them).
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 1024  # entries of `SamplingParams.logit_bias`
LOGIT_BIAS_RANGE = 100.0  # each bias in [-100, 100], as OpenAI's
# The largest seed of an engine or a model's initialisation (`jax.random.key` takes an int64).
MAX_SEED = 2**63 - 1


def check_int(name: str, value: Any, *, lo: int | None = None, hi: int | None = None) -> int:
    """`value` as an int if it is an integer (Python or NumPy, not bool) in `[lo, hi]`;
    TypeError or ValueError naming `name` and showing the value otherwise."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer, got {value!r} ({type(value).__name__})")
    value = int(value)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        lo_s = "-inf" if lo is None else lo
        hi_s = "inf" if hi is None else hi
        raise ValueError(f"{name}={value} must be in [{lo_s}, {hi_s}]")
    return value


def check_int32(name: str, value: int) -> int:
    """`value` if it fits the int32 the device takes it as; ValueError naming `name`."""
    if value > INT32_MAX:
        raise ValueError(f"{name}={value} must be <= {INT32_MAX} (it is an int32 on the device)")
    return value


def check_float(name: str, value: Any) -> float:
    """`value` as a finite float (an int or a float, not bool); TypeError or ValueError
    naming `name` otherwise."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name}={value} must be finite")
    return value


def check_bool(name: str, value: Any) -> bool:
    """`value` if it is a bool (Python or NumPy); TypeError naming `name` otherwise."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {value!r} ({type(value).__name__})")
    return bool(value)


def check_stop_strings(stop: Any) -> tuple[str, ...]:
    """`SamplingParams.stop` as a tuple: a str, a sequence of at most `MAX_STOP_STRINGS`
    non-empty strs of at most `MAX_STOP_STRING_CHARS` characters, or None (none)."""
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    elif isinstance(stop, bytes) or not isinstance(stop, Sequence):
        raise TypeError(f"stop must be a str, a list of str or None, got {stop!r}")
    if len(stop) > MAX_STOP_STRINGS:
        raise ValueError(
            f"stop has {len(stop)} strings, over the limit of {MAX_STOP_STRINGS} "
            "(paxkv.host.request.MAX_STOP_STRINGS)"
        )
    for i, s in enumerate(stop):
        if not isinstance(s, str):
            raise TypeError(f"stop[{i}] must be a str, got {s!r} ({type(s).__name__})")
        if not s:
            raise ValueError(f"stop[{i}] is an empty string, which would end every completion")
        if len(s) > MAX_STOP_STRING_CHARS:
            raise ValueError(
                f"stop[{i}] has {len(s)} characters, over the limit of {MAX_STOP_STRING_CHARS} "
                "(paxkv.host.request.MAX_STOP_STRING_CHARS)"
            )
    return tuple(stop)


def check_token_ids(name: str, ids: Any, *, lo: int | None = 0, hi: int | None = None) -> list[int]:
    """`ids` as a list of ints in `[lo, hi]`: a sequence (or 1-D integer array) of integers."""
    if isinstance(ids, np.ndarray):
        if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
            raise TypeError(f"{name} must be a 1-D integer array, got {ids.dtype}{list(ids.shape)}")
        ids = ids.tolist()
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
        raise TypeError(f"{name} must be a list of ints, got {ids!r} ({type(ids).__name__})")
    # The common case in C loops (a prompt's thousands of ids): plain ints within range.
    if (
        ids
        and set(map(type, ids)) == {int}
        and (lo is None or min(ids) >= lo)
        and (hi is None or max(ids) <= hi)
    ):
        return list(ids)
    # Otherwise each entry, so the error names the first bad one.
    return [check_int(f"{name}[{i}]", t, lo=lo, hi=hi) for i, t in enumerate(ids)]


class RequestOutputKind(enum.IntEnum):
    """What each `RequestOutput` of a request holds (vLLM's names and values).

    CUMULATIVE: everything so far (tokens, text, logprobs), every time it advances.
    DELTA: only what is new since the request's previous output: new tokens, text and
      logprobs, and with n > 1 only the completions that advanced or ended; concatenated
      they give the cumulative output. The last one has `finished=True`.
    FINAL_ONLY: nothing until the request has ended, then the cumulative output once.
    """

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to sample one request's output tokens.

    `temperature == 0` is greedy. `top_k` (0 or -1: off), `top_p` (1.0: off) and `min_p`
    (0.0: off) truncate the distribution after temperature scaling. `seed` makes the
    request's samples reproducible whatever it is batched with (None: the engine draws
    one). Generation stops after `max_tokens` tokens, or at a token of `stop_token_ids`
    or the model's EOS (unless `ignore_eos`; at most `MAX_STOP_TOKEN_IDS`, 1024, ids); a
    stop token is kept in the output.
    `logprobs=k` reports, for each generated token, the log-probabilities of the k most
    likely tokens and of the chosen one (so k + 1 entries at most; 0: the chosen one
    only), under the model's raw distribution `log_softmax(logits)` (before penalties,
    temperature and truncation, vLLM's "raw_logprobs"), with each token's rank; None
    reports none. `n > 1` samples several completions of the same prompt.

    `prompt_logprobs=k` reports, for every prompt position after the first, the
    log-probability of the actual prompt token given the tokens before it, with its rank
    and the k most likely tokens there (vLLM's semantics; same raw distribution as
    `logprobs`); the engine computes them on the device during the prefill, and such a
    request never reads the prefix cache (every position must be computed).
    `max_tokens=0` (only with `prompt_logprobs`) generates nothing: the request ends
    after its prefill with finish reason "length" (scoring; vLLM's echo without
    generation).

    `stop` strings (a str or a list; they need a tokenizer) are matched on the output
    text as it is decoded: the first token whose text completes one ends the completion
    with finish reason "stop" and `stop_reason` the string; its tokens are kept up to
    and including that token, and its text is cut before the string (after it with
    `include_stop_str_in_output`), as vLLM cuts it. Among strings that the same token
    completes, the one that starts first wins. At most `MAX_STOP_STRINGS` (1024) strings of
    at most `MAX_STOP_STRING_CHARS` (1024) characters each. The text of a stop token (EOS or one of
    `stop_token_ids`) is left out of the text unless `include_stop_str_in_output`.
    `output_kind` says what each output of the request holds (`RequestOutputKind`).

    Penalties, applied to the logits before temperature, as vLLM and OpenAI define them:
    `presence_penalty` (in [-2, 2]) subtracts itself from every token generated so far,
    `frequency_penalty` (in [-2, 2]) subtracts itself times the number of times it was
    generated, and `repetition_penalty` (> 0; 1: off) divides the positive logits and
    multiplies the negative ones of every token in the prompt or generated so far.

    `logit_bias` ({token id: bias in [-100, 100]}, OpenAI's) adds each bias to its
    token's logit before penalties, temperature and truncation (the reported logprobs
    stay raw); `min_tokens` holds back the stop tokens (EOS and `stop_token_ids`) until
    that many tokens are generated (vLLM's; stop strings still apply). Steps with such
    a sequence run one decode at a time.

    `structured_outputs` (a `StructuredOutputs`, or a mapping of its fields) constrains
    the output to a JSON schema, any JSON object, a regex, a choice of strings or a
    grammar: each step, only the tokens that keep the output a prefix of a match can be
    sampled (the reported logprobs stay raw), and the completion ends with finish
    reason "stop" once the constraint is complete and can go no further. Such a
    sequence runs one decode at a time, and takes the n-gram proposals its constraint
    allows (none under a draft model or async scheduling).

    `return_routed_experts` (MoE models only; SGLang's name) returns, on each finished
    completion, the experts every MoE layer sent each of its tokens to
    (`CompletionOutput.routed_experts`), for RL trainers to replay the rollout's
    routing. Such a request shares prefix-cache pages only among its own completions,
    and runs one decode step per call (no multi-step decode, no speculative tokens).
    """

    n: int = 1
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: tuple[str, ...] = ()  # a str or a list of str are taken too, and None (none)
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    return_routed_experts: bool = False
    # {token id: bias}: added to the token's logit before sampling (not to the reported
    # logprobs); given as a mapping, held as sorted (id, bias) pairs.
    logit_bias: Any = None
    min_tokens: int = 0
    structured_outputs: StructuredOutputs | None = None

    def __post_init__(self) -> None:
        def put(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)

        put("n", check_int32("n", check_int("n", self.n, lo=1)))
        put("temperature", check_float("temperature", self.temperature))
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0")
        put("top_k", check_int32("top_k", check_int("top_k", self.top_k, lo=-1)))
        put("top_p", check_float("top_p", self.top_p))
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
        put("min_p", check_float("min_p", self.min_p))
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p={self.min_p} must be in [0, 1]")
        if self.seed is not None:
            put("seed", check_int("seed", self.seed, lo=0, hi=INT32_MAX))
        put("max_tokens", check_int32("max_tokens", check_int("max_tokens", self.max_tokens, lo=0)))
        stop = self.stop_token_ids
        if isinstance(stop, (str, bytes)) or not isinstance(stop, (Sequence, np.ndarray)):
            raise TypeError(f"stop_token_ids must be a list of ints, got {stop!r}")
        if len(stop) > MAX_STOP_TOKEN_IDS:
            raise ValueError(
                f"stop_token_ids has {len(stop)} ids, over the limit of {MAX_STOP_TOKEN_IDS} "
                "(paxkv.host.request.MAX_STOP_TOKEN_IDS)"
            )
        put("stop_token_ids", tuple(check_token_ids("stop_token_ids", list(stop), hi=INT32_MAX)))
        put("ignore_eos", check_bool("ignore_eos", self.ignore_eos))
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if isinstance(value, (bool, np.bool_)):
                raise TypeError(
                    f"{name} must be an integer k (the top-k log-probabilities to report per "
                    f"token, 0: the actual token's only) or None, got {value!r}"
                )
            if value is not None:
                put(name, check_int32(name, check_int(name, value, lo=0)))
        if self.max_tokens == 0 and self.prompt_logprobs is None:
            raise ValueError(
                "max_tokens=0 must be in [1, inf] without prompt_logprobs (max_tokens=0 "
                "generates nothing: it scores the prompt, and needs prompt_logprobs)"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = check_float(name, getattr(self, name))
            if not -2 <= value <= 2:
                raise ValueError(f"{name}={value} must be in [-2, 2]")
            put(name, value)
        put("repetition_penalty", check_float("repetition_penalty", self.repetition_penalty))
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty={self.repetition_penalty} must be > 0")
        put("stop", check_stop_strings(self.stop))
        put(
            "include_stop_str_in_output",
            check_bool("include_stop_str_in_output", self.include_stop_str_in_output),
        )
        if not isinstance(self.output_kind, RequestOutputKind):
            raise TypeError(
                f"output_kind must be a RequestOutputKind, got {self.output_kind!r} "
                f"({type(self.output_kind).__name__})"
            )
        put(
            "return_routed_experts", check_bool("return_routed_experts", self.return_routed_experts)
        )
        put("logit_bias", check_logit_bias(self.logit_bias))
        put("min_tokens", check_int32("min_tokens", check_int("min_tokens", self.min_tokens, lo=0)))
        if self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens={self.min_tokens} must be at most max_tokens={self.max_tokens}"
            )
        put("structured_outputs", StructuredOutputs.of(self.structured_outputs))

    @property
    def biased(self) -> bool:
        """Whether sampling adds biases to logits (`logit_bias`, or stop tokens held back
        by `min_tokens`): the step then runs the sampler that applies them."""
        return bool(self.logit_bias) or self.min_tokens > 0

    @property
    def has_penalties(self) -> bool:
        """Whether any penalty is on (the step then needs the sequence's token history)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1)


def check_logit_bias(bias: Any) -> tuple[tuple[int, float], ...] | None:
    """`SamplingParams.logit_bias` as sorted (token id, bias) pairs: a mapping of token
    ids (ints, or their decimal strings as JSON sends them) to finite biases in
    [-100, 100], at most `MAX_LOGIT_BIAS`; None or empty: None."""
    if bias is None or (isinstance(bias, tuple) and not bias):
        return None
    items = bias if isinstance(bias, tuple) else None
    if items is None:
        if not isinstance(bias, Mapping):
            raise TypeError(
                f"logit_bias must be a mapping of token ids to biases, got {bias!r:.80}"
            )
        items = tuple(bias.items())
    if len(items) > MAX_LOGIT_BIAS:
        raise ValueError(f"logit_bias has {len(items)} entries, over the limit of {MAX_LOGIT_BIAS}")
    pairs = {}
    for key, value in items:
        token = int(key) if isinstance(key, str) and key.strip().isdigit() else key
        if isinstance(token, bool) or not isinstance(token, numbers.Integral) or token < 0:
            raise TypeError(f"logit_bias keys must be token ids, got {key!r:.80}")
        token = check_int32("logit_bias", int(token))
        value = check_float(f"logit_bias[{token}]", value)
        if not -LOGIT_BIAS_RANGE <= value <= LOGIT_BIAS_RANGE:
            raise ValueError(
                f"logit_bias[{token}]={value} must be in [-{LOGIT_BIAS_RANGE:g}, {LOGIT_BIAS_RANGE:g}]"
            )
        pairs[token] = value
    return tuple(sorted(pairs.items())) or None


class FinishReason(enum.StrEnum):
    """Why a request ended. `str` values match vLLM's ("stop", "length", "abort")."""

    STOP = "stop"  # a stop token, EOS or a stop string
    LENGTH = "length"  # max_tokens or max_model_len
    ABORT = "abort"  # aborted by the caller


@dataclasses.dataclass
class RequestMetrics:
    """Timestamps (time.monotonic seconds) and counters of one request."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0

    @property
    def queue_time(self) -> float | None:
        """Seconds from arrival until first scheduled."""
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def ttft(self) -> float | None:
        """Time to first token, from arrival."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        """Seconds from arrival until finished."""
        if self.finished_time is None:
            return None
        return self.finished_time - self.arrival_time


@dataclasses.dataclass(frozen=True)
class Logprob:
    """A token's log-probability under the model, and its rank (1: the most likely)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclasses.dataclass
class CompletionOutput:
    """One completion of a request (`RequestOutput.outputs[i]`).

    With `SamplingParams.logprobs=k`, `logprobs[i]` maps token ids to their `Logprob` at
    output position i: the k most likely and the chosen token `token_ids[i]`; the chosen
    tokens' log-probabilities alone are `token_logprobs` (a list) and `logprobs_array`
    (f32[len(token_ids)], what an RL trainer takes); and `cumulative_logprob` is their sum
    (of all the tokens so far, in delta outputs too). All are None without it.

    In a delta output (`RequestOutputKind.DELTA`) `token_ids`, `text` and `logprobs`
    hold only what is new since the previous output. `stop_reason` says which stop
    ended a completion with finish reason "stop": the stop string, or the token of
    `stop_token_ids`; None at EOS, as in vLLM.

    `routed_experts` (with `SamplingParams.return_routed_experts`, on the output that
    finishes the completion; None before and without it): i32[N, L, k] for the N =
    prompt + generated tokens, L MoE layers and top k: row p holds the experts each
    layer routed token p to when the model last computed it (a recomputation after
    preemption replaces the earlier routing), -1 where the model never computed it
    (the last generated token, which no step feeds back). Replaying it through the
    model's `routing=` reproduces the forward pass (`paxkv.engine.routed_experts`).
    """

    index: int
    token_ids: list[int]
    text: str | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None  # a FinishReason value once finished
    cumulative_logprob: float | None = None
    stop_reason: int | str | None = None
    routed_experts: np.ndarray | None = None

    @property
    def finished(self) -> bool:
        """Whether the completion has ended."""
        return self.finish_reason is not None

    @property
    def token_logprobs(self) -> list[float] | None:
        """The chosen tokens' log-probabilities (None without `SamplingParams.logprobs`)."""
        if self.logprobs is None:
            return None
        return [d[t].logprob for d, t in zip(self.logprobs, self.token_ids, strict=True)]

    @property
    def logprobs_array(self) -> np.ndarray | None:
        """f32[len(token_ids)]: `token_logprobs` as an array, entry i the log-probability
        of `token_ids[i]` (the engine's values are f32, so exactly those of `logprobs`);
        None without `SamplingParams.logprobs`. A delta output's holds its new tokens
        only: a completion's deltas concatenate to its cumulative array."""
        chosen = self.token_logprobs
        return None if chosen is None else np.array(chosen, np.float32)


@dataclasses.dataclass
class RequestOutput:
    """The state of one request: its prompt, its completions so far, and its metrics.

    What the completions hold depends on `SamplingParams.output_kind`: everything so
    far, or only what is new (with n > 1, only the completions that advanced). The
    request has ended when `finished`. `prompt_token_ids` is the request's own list,
    not a copy (as in vLLM): do not change it. `metrics` is set on every output, except
    on a DELTA request's outputs before its last.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    # Why the engine ended the request itself (finish reason "abort"): something tied to
    # it failed in a step's host work, or new weights came with policy "abort". None otherwise.
    error: str | None = None
    # The weight versions (`Engine.weight_version`) its output tokens were sampled
    # under, oldest first: one unless weights were updated while it ran.
    weight_versions: tuple[int, ...] = ()
    # With `SamplingParams.prompt_logprobs` (once the prefill has run): per prompt
    # position, None for the first (and, for a score request, for the prompt before
    # the scored completion), then {token id: Logprob} holding the actual token and
    # the top-k. `scores` is its array form: the actual tokens' logprobs of the scored
    # positions alone, which are the last ones, f32[num scored] (every position after
    # the first, f32[len(prompt_token_ids) - 1]; or a score request's completion
    # tokens, `Engine.add_score_request`). In a delta output both come once, in the
    # first output after the prefill.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    scores: np.ndarray | None = None
    # The LoRA adapter it ran under (`paxkv.host.lora_slots.LoRARequest`), as vLLM's
    # field; None: the base model.
    lora_request: Any = None


def normalize_prompt(prompt) -> tuple[str | None, list[int] | None]:
    """Splits a prompt into `(text, token_ids)`; exactly one of them is not None.

    A prompt is a string or a dict with "prompt_token_ids" (vLLM's TokensPrompt) or
    "prompt" (TextPrompt).
    """
    if isinstance(prompt, str):
        return _check_text(prompt), None
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            # The range is checked against the model's vocabulary (`Engine.add_request`).
            ids = check_token_ids("prompt_token_ids", prompt["prompt_token_ids"], lo=None)
            return None, ids
        if "prompt" in prompt and isinstance(prompt["prompt"], str):
            return _check_text(prompt["prompt"]), None
    raise ValueError(
        f"a prompt must be a str or a dict with 'prompt_token_ids' or 'prompt', got {type(prompt).__name__}"
    )


def _check_text(text: str) -> str:
    """`text` if it is valid Unicode (encodable as UTF-8); ValueError otherwise."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(
            f"the prompt is not valid Unicode: {e.reason} at position {e.start} "
            f"({text[e.start : e.end]!r})"
        ) from None
    return text
