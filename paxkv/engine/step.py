"""The compiled steps: one model step, and N decode steps in one call.

`model_step` writes a batch's K/V, attends and samples one token per sequence.
`decode_loop` runs N decode iterations of the same in a `lax.fori_loop`: the host
reserves, before the call, the pages the next N tokens of every sequence will need; the
device feeds each sampled token to the next iteration and advances the lengths itself.
A sequence that samples a stop token or reaches its token limit is masked out of the
remaining iterations (its query length drops to 0, so it neither writes nor reads),
exactly where the host will later see it finish. Both are jitted at module level with
the cache donated, so engines serving the same model at the same shapes share
compilations.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from paxkv.engine.draft import draft_proposals
from paxkv.engine.sampling import Sampled, SamplingBatch, add_to_history, sample, score
from paxkv.engine.spec_verify import verify
from paxkv.host.batch import HostBatch, history_length
from paxkv.kv_cache import PagedKVCache, PageTable
from paxkv.sharding import shardings

PLACEHOLDER_TOKEN = -1  # async scheduling: a sampled token the host has not read yet
MAX_STOP_IDS = 8  # stop + EOS token ids a sequence may have in the multi-step path


@struct.dataclass
class StepBatch:
    """Everything one compiled step consumes, padded to its bucket shapes."""

    tokens: jax.Array  # i32[T]
    positions: jax.Array  # i32[T]
    table: PageTable
    # i32[S]; the packed row of each sequence's last known token (its last row, or the
    # row before its speculative proposals)
    logits_indices: jax.Array
    sampling: SamplingBatch
    # i32[R] each: rows whose prompt logprob is wanted and their target tokens
    # (`paxkv.host.prompt_scores`); R = 0: none, and the scoring compiles away.
    score_rows: jax.Array
    score_targets: jax.Array
    # Speculative proposals (`ScheduledChunk.num_draft`): sequence s's tokens after its
    # last known one, which follow it as query rows; k = 0: none, and the verification
    # compiles away.
    draft_tokens: jax.Array  # i32[S, k]
    draft_counts: jax.Array  # i32[S]

    @classmethod
    def from_host(cls, hb: HostBatch, page_size: int) -> tuple[StepBatch, jax.Array]:
        """Moves a host batch to the device in one transfer; returns it and its
        `token_src` (i32[T], see `model_step`)."""
        names = [f.name for f in dataclasses.fields(hb)]
        a = dict(zip(names, jax.device_put([getattr(hb, n) for n in names]), strict=True))
        table = PageTable(
            block_tables=a["block_tables"],
            kv_lens=a["kv_lens"],
            cu_q_lens=a["cu_q_lens"],
            num_seqs=a["num_seqs"],
            page_size=page_size,
        )
        sampling = SamplingBatch(a["sampling_floats"], a["sampling_ints"], a["penalty_history"])
        batch = cls(
            a["tokens"],
            a["positions"],
            table,
            a["logits_indices"],
            sampling,
            a["score_rows"],
            a["score_targets"],
            a["draft_tokens"],
            a["draft_counts"],
        )
        return batch, a["token_src"]

    @classmethod
    def empty(
        cls,
        num_tokens: int,
        num_seqs: int,
        pages_per_seq: int,
        page_size: int,
        num_groups: int = 1,
        num_scored: int = 0,
        *,
        penalties: bool = False,
        num_draft: int = 0,
    ) -> StepBatch:
        """A batch of the given bucket shape with no live sequence (warm-up compiles it);
        `num_groups` page tables per sequence (KV-cache groups), `num_scored` scored rows;
        `penalties`: the shape's variant with penalty histories (`SamplingBatch`);
        `num_draft`: with room for that many speculative tokens per sequence."""
        groups = () if num_groups == 1 else (num_groups,)
        history_len = history_length(pages_per_seq, page_size) if penalties else 0
        table = PageTable(
            block_tables=jnp.zeros((*groups, num_seqs, pages_per_seq), jnp.int32),
            kv_lens=jnp.zeros(num_seqs, jnp.int32),
            cu_q_lens=jnp.zeros(num_seqs + 1, jnp.int32),
            num_seqs=jnp.zeros(1, jnp.int32),
            page_size=page_size,
        )
        return cls(
            tokens=jnp.zeros(num_tokens, jnp.int32),
            positions=jnp.zeros(num_tokens, jnp.int32),
            table=table,
            logits_indices=jnp.zeros(num_seqs, jnp.int32),
            sampling=SamplingBatch.create([], num_seqs, history_len=history_len),
            score_rows=jnp.zeros(num_scored, jnp.int32),
            score_targets=jnp.zeros(num_scored, jnp.int32),
            draft_tokens=jnp.zeros((num_seqs, num_draft), jnp.int32),
            draft_counts=jnp.zeros(num_seqs, jnp.int32),
        )


def forward_logits(
    model: nnx.Module,
    tokens: jax.Array,  # i32[T]
    positions: jax.Array,  # i32[T]
    kv_cache: PagedKVCache,
    table: PageTable,
    rows: jax.Array | None,  # i32[S]: the packed rows to take logits of; None: every row
    *,
    attention_backend: str,
    decode_only: bool = False,
    return_routing: bool = False,
) -> tuple[jax.Array, ...]:  # logits, cache (, i32[L, T, k])
    """The model over a packed batch: writes its K/V, attends, and returns the logits
    (f32[S, V], or [T, V] for every row) with the updated cache. `decode_only` (static):
    every sequence has at most one row, which the model is told (`decode_only=True`).
    `return_routing` (static, a model that `routes_experts` only): also the experts each
    MoE layer sent each row to."""
    extra = {"decode_only": True} if decode_only else {}
    if return_routing:
        extra["return_routing"] = True
    hidden, kv_cache, *routing = model(
        tokens, positions, kv_cache, table, attention_backend=attention_backend, **extra
    )
    return model.logits(hidden if rows is None else hidden[rows]), kv_cache, *routing


def forward_sample(
    model: nnx.Module,
    tokens: jax.Array,  # i32[T]
    positions: jax.Array,  # i32[T]
    kv_cache: PagedKVCache,
    table: PageTable,
    rows: jax.Array,  # i32[S]
    sampling: SamplingBatch,
    *,
    attention_backend: str,
    num_logprobs: int = 0,
    decode_only: bool = False,
) -> tuple[Sampled, PagedKVCache]:
    """`forward_logits`, then one sampled token per row (`sample`), and the cache."""
    logits, kv_cache = forward_logits(
        model,
        tokens,
        positions,
        kv_cache,
        table,
        rows,
        attention_backend=attention_backend,
        decode_only=decode_only,
    )
    return sample(logits, sampling, num_logprobs=num_logprobs), kv_cache


def model_step(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    kv_cache: PagedKVCache,
    batch: StepBatch,
    token_src: jax.Array,  # i32[T]; >= 0: take the token from prev_tokens
    prev_tokens: jax.Array,  # i32[max_num_seqs]; the previous step's sampled tokens
    draft_graphdef: nnx.GraphDef | None = None,
    draft_params: nnx.State | None = None,
    draft_cache: PagedKVCache | None = None,
    *,
    attention_backend: str,
    num_logprobs: int = 0,
) -> tuple[Sampled, PagedKVCache, PagedKVCache | None]:
    """One model step: write the batch's K/V, attend, sample a token per sequence.

    Returns the samples padded to `max_num_seqs` rows (row i: the batch's sequence i),
    so the next step can read its input tokens from them on the device, the cache, and
    the draft model's cache. A sequence
    whose last token is fed from `prev_tokens` (async scheduling) has that token, which
    the host has not seen, counted in its penalty history before it samples.
    With scored rows (R > 0) the logits of the S sampling rows and the R scored rows are
    one matmul, and `sampled.scored` holds their prompt logprobs (`score`). With
    speculative proposals (k > 0) the k rows after each sequence's sampling row join
    that matmul, and `sampled.spec` holds the verdicts (`paxkv.engine.spec_verify`);
    `sampled.tokens` then still holds what each sequence's first row sampled. With a
    draft model (`paxkv.engine.draft`) the draft runs first and its proposals fill
    those rows.
    """
    model = nnx.merge(graphdef, params)
    fed = prev_tokens[jnp.maximum(token_src, 0)]
    tokens_in = jnp.where(token_src >= 0, fed, batch.tokens)
    last = batch.logits_indices
    sampling = add_to_history(batch.sampling, tokens_in[last], token_src[last] >= 0)
    num_sampled, k = last.shape[0], batch.draft_tokens.shape[1]
    # The rows whose logits the step reads: each sequence's last known token, its
    # proposals' rows after it (speculative steps), and the scored rows.
    draft_rows = jnp.minimum(last[:, None] + jnp.arange(1, k + 1), tokens_in.shape[0] - 1)
    proposals, draft_probs = batch.draft_tokens, None
    if draft_graphdef is not None:
        proposals, draft_probs, draft_cache = draft_proposals(
            nnx.merge(draft_graphdef, draft_params),
            tokens_in,
            batch.positions,
            draft_cache,
            batch.table,
            last,
            batch.draft_counts,
            sampling,
            k,
            attention_backend=attention_backend,
        )
        valid = jnp.arange(k)[None, :] < batch.draft_counts[:, None]
        rows = jnp.where(valid, draft_rows, tokens_in.shape[0])
        tokens_in = tokens_in.at[rows.reshape(-1)].set(proposals.reshape(-1), mode="drop")
    # A model that routes experts always returns its routing (no second compiled
    # variant): it stays on the device unless a request asks (`ModelRunner.fetch_routing`).
    logits, kv_cache, *routing = forward_logits(
        model,
        tokens_in,
        batch.positions,
        kv_cache,
        batch.table,
        jnp.concatenate([last, draft_rows.reshape(-1), batch.score_rows]),
        attention_backend=attention_backend,
        return_routing=getattr(model, "routes_experts", False),
    )
    sampled = sample(logits[:num_sampled], sampling, num_logprobs=num_logprobs)
    num_spec = num_sampled * (k + 1)
    if k:
        spec_logits = jnp.concatenate(
            [logits[:num_sampled, None], logits[num_sampled:num_spec].reshape(num_sampled, k, -1)],
            axis=1,
        )
        spec = verify(
            spec_logits,
            sampling,
            proposals,
            batch.draft_counts,
            sampled.tokens,
            draft_probs=draft_probs,
            num_logprobs=num_logprobs,
        )
        sampled = sampled.replace(spec=spec)
    if batch.score_rows.shape[0]:
        scored = score(logits[num_spec:], batch.score_targets, num_logprobs=num_logprobs)
        sampled = sampled.replace(scored=scored)
    sampled = sampled.padded(prev_tokens.shape[0])
    mesh = getattr(model, "mesh", None)
    if routing:  # replicated on a mesh, so any process reads it whole
        routing = routing[0]
        if mesh is not None:
            routing = jax.lax.with_sharding_constraint(routing, shardings.replicated(mesh))
        sampled = sampled.replace(routing=routing)
    if mesh is not None:  # replicated, like the next step's prev_tokens input
        sampled = sampled.replace(
            tokens=jax.lax.with_sharding_constraint(sampled.tokens, shardings.replicated(mesh))
        )
    return sampled, kv_cache, draft_cache


MODEL_STEP = jax.jit(
    model_step,
    static_argnames=("attention_backend", "num_logprobs"),
    donate_argnames=("kv_cache", "draft_cache"),
)


@struct.dataclass
class DecodeLimits:
    """Per-sequence stop conditions of a multi-step call, padded to S."""

    stop_ids: jax.Array  # i32[S, MAX_STOP_IDS]; -1 pads
    remaining: jax.Array  # i32[S]; tokens the sequence may still generate (>= 1 if live)

    @classmethod
    def from_host(
        cls, stops: list[tuple[int, ...]], remaining: list[int], size: int
    ) -> DecodeLimits:
        """Pads each sequence's stop ids (at most `MAX_STOP_IDS`) and token limit to `size` rows."""
        ids = np.full((size, MAX_STOP_IDS), -1, np.int32)
        for i, s in enumerate(stops):
            ids[i, : len(s)] = s
        rem = np.zeros(size, np.int32)
        rem[: len(remaining)] = remaining
        return cls(stop_ids=jnp.asarray(ids), remaining=jnp.asarray(rem))


def decode_loop(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    kv_cache: PagedKVCache,
    batch: StepBatch,  # of a decode-only plan: row s is sequence s
    limits: DecodeLimits,
    *,
    attention_backend: str,
    num_steps: int,
    num_logprobs: int = 0,
) -> tuple[Sampled, jax.Array, PagedKVCache]:
    """Runs `num_steps` decode iterations. Returns `(samples with arrays [N, S, ...],
    valid bool[N, S], kv_cache)`; `valid[i, s]` says sequence s produced token i. Each
    token a sequence samples joins its penalty history before its next iteration."""
    model = nnx.merge(graphdef, params)
    table = batch.table
    num_rows = batch.tokens.shape[0]
    num_slots = table.kv_lens.shape[0]
    live = jnp.arange(num_slots) < table.num_seqs[0]
    first_tokens = (
        jnp.zeros(num_slots, jnp.int32)
        .at[: min(num_slots, num_rows)]
        .set(batch.tokens[: min(num_slots, num_rows)])
    )

    def body(i, carry):
        cache, current, kv_lens, active, sampling, out, out_valid = carry
        q_lens = active.astype(jnp.int32)
        cu = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(q_lens)])
        rows = jnp.where(active, cu[:-1], num_rows)  # inactive sequences have no row
        tokens = jnp.zeros(num_rows, jnp.int32).at[rows].set(current, mode="drop")
        positions = jnp.zeros(num_rows, jnp.int32).at[rows].set(kv_lens - 1, mode="drop")
        step_table = table.replace(kv_lens=kv_lens, cu_q_lens=cu)
        sampled, cache = forward_sample(
            model,
            tokens,
            positions,
            cache,
            step_table,
            jnp.where(active, cu[:-1], 0),
            sampling.advanced(i),
            attention_backend=attention_backend,
            num_logprobs=num_logprobs,
            decode_only=True,  # every sequence decodes one token an iteration
        )
        new = sampled.tokens
        stop = jnp.any(new[:, None] == limits.stop_ids, axis=1) | (i + 1 >= limits.remaining)
        sampled = sampled.replace(tokens=jnp.where(active, new, -1))
        out = jax.tree.map(lambda o, x: o.at[i].set(x), out, sampled)
        out_valid = out_valid.at[i].set(active)
        still = active & ~stop
        return (
            cache,
            jnp.where(still, new, current),
            kv_lens + still,
            still,
            add_to_history(sampling, new, still),
            out,
            out_valid,
        )

    shapes = jax.eval_shape(
        lambda lg: sample(lg, batch.sampling, num_logprobs=num_logprobs),
        jax.ShapeDtypeStruct((num_slots, model.config.vocab_size), jnp.float32),
    )
    out = jax.tree.map(lambda a: jnp.zeros((num_steps, *a.shape), a.dtype), shapes)
    carry = (
        kv_cache,
        first_tokens,
        table.kv_lens,
        live,
        batch.sampling,
        out,
        jnp.zeros((num_steps, num_slots), bool),
    )
    kv_cache, _, _, _, _, out, valid = jax.lax.fori_loop(0, num_steps, body, carry)
    return out, valid, kv_cache


DECODE_LOOP = jax.jit(
    decode_loop,
    static_argnames=("attention_backend", "num_steps", "num_logprobs"),
    donate_argnames=("kv_cache",),
)
COMPILED_FUNCTIONS = ("model_step", "decode_loop")  # what `CompileCounter` watches
