"""On-device sampling of the next token of every sequence in a step.

Everything here is per row: what one sequence samples does not depend on what it is
batched with (its penalties read its own history, its draws use its own key).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import struct

from paxkv.host.batch import sampling_arrays
from paxkv.host.request import SamplingParams
from paxkv.host.sampling_columns import FLOAT_COLUMN as _F
from paxkv.host.sampling_columns import INT_COLUMN as _I
from paxkv.host.sequence import SequenceState, TopLogprobs


@struct.dataclass
class SamplingBatch:
    """Per-sequence sampling parameters of one step, padded to the step's S.

    `floats` holds temperature (0 = greedy), top_p (1 = off), min_p (0 = off) and the
    presence, frequency and repetition penalties; `ints` holds top_k (<= 0 = off), the
    seed, and the counter (index of the token being sampled in its completion).
    `history` lists, per sequence with penalties, the distinct tokens of its prompt and
    output: `history[0]` their ids (-1 pads), `history[1]` how often each was
    generated, `history[2]` whether it is in the prompt; H = 0 when no sequence of the
    step has penalties, and the penalty code then compiles away, else the tokens the
    step's pages hold (`paxkv.host.batch.history_length`): each step shape has two
    variants, and warm-up compiles both.
    """

    floats: jax.Array  # f32[S, len(SAMPLING_FLOATS)] (`paxkv.host.sampling_columns`)
    ints: jax.Array  # i32[S, len(SAMPLING_INTS)]
    history: jax.Array  # i32[3, S, H]
    # Logit biases (`paxkv.host.batch.HostBatch.bias_ids`): i32[S, B] ids (-1 pads) and
    # f32[S, B] values, added with the penalties; None (or B = 0): none.
    bias_ids: jax.Array | None = None
    bias_values: jax.Array | None = None
    # Token bitmasks (`paxkv.host.batch.HostBatch.allowed`): i32[S, W], bit t % 32 of
    # word t // 32 set where token t may be sampled; None (or W = 0): no mask.
    allowed: jax.Array | None = None

    temperature = property(lambda self: self.floats[:, _F["temperature"]])
    top_p = property(lambda self: self.floats[:, _F["top_p"]])
    min_p = property(lambda self: self.floats[:, _F["min_p"]])
    presence_penalty = property(lambda self: self.floats[:, _F["presence_penalty"]])
    frequency_penalty = property(lambda self: self.floats[:, _F["frequency_penalty"]])
    repetition_penalty = property(lambda self: self.floats[:, _F["repetition_penalty"]])
    top_k = property(lambda self: self.ints[:, _I["top_k"]])
    seeds = property(lambda self: self.ints[:, _I["seed"]])
    counters = property(lambda self: self.ints[:, _I["counter"]])

    @classmethod
    def create(
        cls,
        params: Sequence[SamplingParams],
        size: int,
        *,
        seeds: Sequence[int] | None = None,
        counters: Sequence[int] | None = None,
        histories: Sequence[tuple[list[int], list[int], list[int]] | None] = (),
        history_len: int | None = None,
    ) -> SamplingBatch:
        """The batch of `params` padded to `size` rows (seeds default to the params' or 0,
        counters to 0; histories and their length H: `paxkv.host.batch.sampling_arrays`)."""
        n = len(params)
        seeds = [p.seed or 0 for p in params] if seeds is None else seeds
        counters = [0] * n if counters is None else counters
        floats, ints, history = sampling_arrays(
            params, seeds, counters, size, histories=histories, history_len=history_len
        )
        return cls(jnp.asarray(floats), jnp.asarray(ints), jnp.asarray(history))

    def advanced(self, steps: jax.Array) -> SamplingBatch:
        """The batch `steps` tokens later (each row's counter advanced)."""
        return self.replace(ints=self.ints.at[:, _I["counter"]].add(steps))


@struct.dataclass
class Scored:
    """A step's scored rows (prompt logprobs): each row's target token under the raw
    distribution `log_softmax(logits)`, and the K most likely tokens there."""

    logprobs: jax.Array  # f32[R]; of the target token
    ranks: jax.Array  # i32[R]; the target's rank, 1 = the most likely
    top_ids: jax.Array  # i32[R, K]
    top_logprobs: jax.Array  # f32[R, K]


@struct.dataclass
class Speculated:
    """A speculative step's verdicts (`paxkv.engine.device.verification`): sequence s emits
    `tokens[s, :num_accepted[s] + 1]`, its accepted proposals and one token of the
    target's, and `scores` reports each under the target's raw distribution."""

    num_accepted: jax.Array  # i32[S]
    tokens: jax.Array  # i32[S, k+1]; -1 after the emitted tokens
    scores: Scored  # arrays [S, k+1, ...]


@struct.dataclass
class Sampled:
    """One step's samples: the token of every row and what the API reports about it,
    and (`scored`, None when the step scores no row) its prompt logprobs, and (`spec`,
    None when no sequence of the step speculates) the speculative verdicts, and
    (`routing`, None unless the model routes experts) the experts each MoE layer sent
    each packed row to, which stays on the device unless a request asks for it."""

    tokens: jax.Array  # i32[S]
    logprobs: jax.Array  # f32[S]; of the chosen token, under log_softmax(logits)
    top_ids: jax.Array  # i32[S, K]; the K most likely tokens (K = 0: none asked)
    top_logprobs: jax.Array  # f32[S, K]
    ranks: jax.Array  # i32[S]; the chosen token's rank, 1 = the most likely
    scored: Scored | None = None
    spec: Speculated | None = None
    routing: jax.Array | None = None  # i32[L, T, k]

    def rows_from(self, start: int) -> Sampled:
        """Its per-sequence arrays (`spec` too) from row `start` on (host arrays)."""
        if self.spec is None:  # the per-row arrays, sliced one by one
            return Sampled(
                self.tokens[start:],
                self.logprobs[start:],
                self.top_ids[start:],
                self.top_logprobs[start:],
                self.ranks[start:],
                self.scored,
                None,
                self.routing,
            )
        per_row = self.replace(scored=None, routing=None)
        per_row = jax.tree.map(lambda a: a[start:], per_row)
        return per_row.replace(scored=self.scored, routing=self.routing)

    def padded(self, rows: int) -> Sampled:
        """Its per-sequence arrays (`spec` too) padded with zero rows to `rows` rows."""
        pad = rows - self.tokens.shape[0]
        per_row = self.replace(scored=None, routing=None)
        per_row = jax.tree.map(lambda a: jnp.pad(a, [(0, pad)] + [(0, 0)] * (a.ndim - 1)), per_row)
        return per_row.replace(scored=self.scored, routing=self.routing)


def apply_penalties(
    logits: jax.Array,  # f32[S, V]
    params: SamplingBatch,
) -> jax.Array:  # f32[S, V]
    """The logits with each row's presence, frequency and repetition penalties applied
    to the tokens of its history (vLLM's and OpenAI's definitions); rows without
    penalties are unchanged. Costs O(S * H), not O(S * V). The rows' logit biases are
    added after (O(S * B)), then the tokens their masks leave out are set to -inf."""
    logits = _penalised(logits, params)
    if params.bias_ids is not None and params.bias_ids.shape[1]:
        ids = params.bias_ids
        rows = jnp.arange(logits.shape[0])[:, None]
        logits = logits.at[rows, jnp.where(ids >= 0, ids, logits.shape[1])].add(
            params.bias_values, mode="drop"
        )
    if params.allowed is not None and params.allowed.shape[1]:
        logits = jnp.where(allowed_tokens(params.allowed, logits.shape[1]), logits, -jnp.inf)
    return logits


def allowed_tokens(allowed: jax.Array, vocab_size: int) -> jax.Array:  # bool[S, V]
    """The bitmasks `allowed` (i32[S, W], bit t % 32 of word t // 32 for token t)
    unpacked over the first `vocab_size` tokens."""
    bits = (allowed[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1
    return bits.reshape(allowed.shape[0], -1)[:, :vocab_size].astype(bool)


def _penalised(logits: jax.Array, params: SamplingBatch) -> jax.Array:  # f32[S, V]
    ids, counts, in_prompt = params.history
    if ids.shape[1] == 0:
        return logits
    vocab = logits.shape[1]
    present = ids >= 0
    picked = jnp.take_along_axis(logits, jnp.maximum(ids, 0), axis=1)
    rep = params.repetition_penalty[:, None]
    seen = present & ((counts > 0) | (in_prompt > 0))
    repeated = jnp.where(picked > 0, picked / rep, picked * rep)
    penalised = jnp.where(seen, repeated, picked)
    penalised -= params.frequency_penalty[:, None] * counts
    penalised -= params.presence_penalty[:, None] * (counts > 0)
    rows = jnp.arange(logits.shape[0])[:, None]
    return logits.at[rows, jnp.where(present, ids, vocab)].set(penalised, mode="drop")


def add_to_history(
    params: SamplingBatch,
    tokens: jax.Array,  # i32[S]
    generated: jax.Array,  # bool[S]; rows whose `tokens` count as generated
) -> SamplingBatch:
    """The batch with `tokens` counted as generated in the rows `generated`: a token
    already in a row's history gains a count, a new one takes the first free slot."""
    ids, counts, in_prompt = params.history
    if ids.shape[1] == 0:
        return params
    match = (ids == tokens[:, None]) & generated[:, None]
    free = ids < 0
    slot = jnp.argmax(free, axis=1)
    new = generated & ~match.any(axis=1) & free.any(axis=1)
    rows = jnp.arange(ids.shape[0])
    ids = ids.at[rows, slot].set(jnp.where(new, tokens, ids[rows, slot]))
    counts = (counts + match).at[rows, slot].add(new.astype(jnp.int32))
    return params.replace(history=jnp.stack([ids, counts, in_prompt]))


def _truncated(
    logits: jax.Array,  # f32[S, V]
    params: SamplingBatch,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """What `sample` draws from: `(greedy i32[S], order i32[S, V], masked f32[S, V])`,
    the argmax of the penalised logits, the token ids in descending order of them, and
    those logits in that order, scaled by temperature, with the truncated ones -inf."""
    vocab = logits.shape[-1]
    adjusted = apply_penalties(logits, params)
    greedy = jnp.argmax(adjusted, axis=-1).astype(jnp.int32)
    temp = jnp.where(params.temperature > 0, params.temperature, 1.0)[:, None]
    order = jnp.argsort(-adjusted, axis=-1)  # descending
    sorted_logits = jnp.take_along_axis(adjusted, order, axis=-1) / temp
    rank = jnp.arange(vocab)[None, :]
    keep = (params.top_k[:, None] <= 0) | (rank < params.top_k[:, None])
    masked = jnp.where(keep, sorted_logits, -jnp.inf)
    probs = jax.nn.softmax(masked, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # probability mass ahead of each token
    keep &= before < params.top_p[:, None]
    keep &= probs >= params.min_p[:, None] * probs[:, :1]
    keep = keep.at[:, 0].set(True)  # the most likely token always survives
    return greedy, order, jnp.where(keep, sorted_logits, -jnp.inf)


def sampling_keys(params: SamplingBatch) -> jax.Array:  # u32[S, 2]
    """Each row's key, `fold_in(PRNGKey(seed), counter)`: a request's draws depend on
    its seed and on how many tokens it has generated, not on its batch."""
    return jax.vmap(lambda s, c: jax.random.fold_in(jax.random.PRNGKey(s), c))(
        params.seeds, params.counters
    )


def target_probs(
    logits: jax.Array,  # f32[S, V]
    params: SamplingBatch,
) -> tuple[jax.Array, jax.Array]:
    """`(probs f32[S, V], greedy i32[S])`: the distribution `sample` draws each row's
    token from (penalties, temperature and truncation applied; in vocabulary order) and
    the token a greedy row takes. Speculative verification accepts against these."""
    logits = logits.astype(jnp.float32)

    def truncated() -> tuple[jax.Array, jax.Array]:
        greedy, order, masked = _truncated(logits, params)
        rows = jnp.arange(logits.shape[0])[:, None]
        probs = jnp.zeros_like(masked).at[rows, order].set(jax.nn.softmax(masked, axis=-1))
        return probs, greedy

    def whole() -> tuple[jax.Array, jax.Array]:  # no row truncates: no sort needed
        adjusted = apply_penalties(logits, params)
        temp = jnp.where(params.temperature > 0, params.temperature, 1.0)[:, None]
        greedy = jnp.argmax(adjusted, axis=-1).astype(jnp.int32)
        return jax.nn.softmax(adjusted / temp, axis=-1), greedy

    truncates = (params.top_k > 0) | (params.top_p < 1) | (params.min_p > 0)
    return jax.lax.cond(jnp.any(truncates), truncated, whole)


def sample(
    logits: jax.Array,  # f32[S, V]
    params: SamplingBatch,
    *,
    num_logprobs: int = 0,
) -> Sampled:
    """Samples one token per row and reports it with its log-probability, its rank and
    the `num_logprobs` most likely tokens.

    Penalties apply first. Greedy rows (temperature 0) take the argmax. Other rows scale
    by temperature, keep the `top_k` most likely tokens, then the smallest set whose
    probability reaches `top_p`, then drop tokens below `min_p` times the most likely
    one's probability, and draw from what is left with the key
    `fold_in(PRNGKey(seed), counter)`, so a request's samples do not depend on what it is
    batched with. Log-probabilities and ranks are under the raw distribution
    `log_softmax(logits)`, before penalties, temperature and truncation.
    """
    logits = logits.astype(jnp.float32)
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    greedy, order, masked = _truncated(logits, params)
    choice = jax.vmap(jax.random.categorical)(sampling_keys(params), masked)
    sampled = jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)
    tokens = jnp.where(params.temperature > 0, sampled, greedy)
    chosen = jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]
    ranks = 1 + jnp.sum(logprobs > chosen[:, None], axis=-1, dtype=jnp.int32)
    top_logprobs, top_ids = jax.lax.top_k(logprobs, num_logprobs)
    return Sampled(tokens, chosen, top_ids.astype(jnp.int32), top_logprobs, ranks)


def score(
    logits: jax.Array,  # f32[R, V]
    targets: jax.Array,  # i32[R]
    *,
    num_logprobs: int = 0,
) -> Scored:
    """Each row's target token's logprob and rank, and the `num_logprobs` most likely
    tokens, under `log_softmax(logits)` in f32 (no penalty, temperature or truncation):
    vLLM's prompt logprobs. Costs O(R * V); only these reductions leave the device."""
    logprobs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    chosen = jnp.take_along_axis(logprobs, targets[:, None], axis=-1)[:, 0]
    ranks = 1 + jnp.sum(logprobs > chosen[:, None], axis=-1, dtype=jnp.int32)
    top_logprobs, top_ids = jax.lax.top_k(logprobs, num_logprobs)
    return Scored(chosen, ranks, top_ids.astype(jnp.int32), top_logprobs)


def sample_result(
    samples: Sampled, row: int, seq: SequenceState
) -> tuple[int, float] | tuple[int, float, TopLogprobs]:
    """Row `row` of host-side samples as `Scheduler.update` takes it: `(token, logprob)`,
    and the top-k `(ids, logprobs, rank)` when `seq` asks for logprobs."""
    token, logprob = int(samples.tokens[row]), float(samples.logprobs[row])
    k = seq.params.logprobs
    if k is None:
        return token, logprob
    top = (
        tuple(samples.top_ids[row, :k].tolist()),
        tuple(samples.top_logprobs[row, :k].tolist()),
        int(samples.ranks[row]),
    )
    return token, logprob, top
