"""The compiled steps: one model step, and N decode steps in one call.

A step is one program per step shape, `forward_step`: it writes a batch's K/V, attends
and samples one token per sequence. What only some steps need (penalty histories,
scored prompt rows, speculative verification) runs in a small program right after it,
`resample_step`, over the hidden states the forward left on the device, so these
features never multiply the compilations of the model. `decode_loop` runs N decode iterations of the same in a `lax.fori_loop`: the host
reserves, before the call, the pages the next N tokens of every sequence will need; the
device feeds each sampled token to the next iteration and advances the lengths itself.
A sequence that samples a stop token or reaches its token limit is masked out of the
remaining iterations (its query length drops to 0, so it neither writes nor reads),
exactly where the host will later see it finish. All are jitted at module level with
the cache donated, and compiled ahead of time per shape (`paxkv.engine.programs`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from paxkv.engine.device.draft import draft_proposals
from paxkv.engine.device.sampling import Sampled, SamplingBatch, add_to_history, sample, score
from paxkv.engine.device.verification import verify
from paxkv.host.batch import HostBatch
from paxkv.host.sampling_columns import INT_COLUMN, SAMPLING_FLOATS, SAMPLING_INTS
from paxkv.kv_cache import PagedKVCache, PageTable
from paxkv.sharding import shardings

MAX_STOP_IDS = 8  # stop + EOS token ids a sequence may have in the multi-step path


@struct.dataclass
class ForwardBatch:
    """What the model's forward consumes, padded to a step shape (T, S, P): its one
    program per shape (`FORWARD`) sees nothing else."""

    tokens: jax.Array  # i32[T]
    positions: jax.Array  # i32[T]
    table: PageTable
    # i32[S]; the packed row of each sequence's last known token (its last row, or the
    # row before its speculative proposals)
    logits_indices: jax.Array
    token_src: jax.Array  # i32[T]; >= 0: the row's token is prev_tokens[token_src]
    # f32[S, F] and i32[S, I] (`paxkv.host.sampling_columns`): what the plain sampler reads
    sampling_floats: jax.Array
    sampling_ints: jax.Array


@struct.dataclass
class Carried:
    """What a step leaves on the device for the step after it, which the host planned
    before reading this one (async scheduling): the token each of its rows sampled last
    (row s: the step's sequence s; with speculative proposals, the target's token after
    the accepted ones; after N decode iterations, the last), and how many of row s's
    proposals it rejected: the positions the next step was planned with (as if every
    proposal were accepted) that its sequence does not have."""

    tokens: jax.Array  # i32[max_num_seqs]
    rejected: jax.Array  # i32[max_num_seqs]

    @classmethod
    def zeros(cls, size: int) -> Carried:
        """What the first step reads: nothing sampled, nothing rejected."""
        return cls(jnp.zeros(size, jnp.int32), jnp.zeros(size, jnp.int32))


def _replace(a: jax.Array, new: jax.Array) -> jax.Array:
    """`new` (i32[n]) in `a`'s first rows (i32[m], m >= n), the rest kept."""
    return a.at[: new.shape[0]].set(new)


def with_carried(batch: ForwardBatch, carried: Carried) -> ForwardBatch:
    """`batch` as the previous step left it to run: each row whose `token_src` is >= 0
    runs the token the previous step sampled there, and each sequence whose last known
    token is such a row is moved back by the proposals the previous step rejected of
    it (its positions, cache length and sampling counter), which the host planned it
    without knowing."""
    src = batch.token_src
    tokens = jnp.where(src >= 0, carried.tokens[jnp.maximum(src, 0)], batch.tokens)
    table = batch.table
    num_rows, num_seqs = tokens.shape[0], batch.logits_indices.shape[0]
    seq_src = src[batch.logits_indices]  # i32[S]: the previous row of each one's last token
    live = jnp.arange(num_seqs) < table.num_seqs[0]
    shift = jnp.where(live & (seq_src >= 0), carried.rejected[jnp.maximum(seq_src, 0)], 0)
    # Each packed row's sequence (rows past the last sequence's belong to none).
    row_seq = jnp.searchsorted(table.cu_q_lens[1:], jnp.arange(num_rows), side="right")
    in_seq = jnp.arange(num_rows) < table.cu_q_lens[table.num_seqs[0]]
    row_shift = jnp.where(in_seq, shift[jnp.minimum(row_seq, num_seqs - 1)], 0)
    counter = INT_COLUMN["counter"]
    ints = batch.sampling_ints.at[:, counter].add(-shift)
    return batch.replace(
        tokens=tokens,
        positions=batch.positions - row_shift,
        table=table.replace(kv_lens=table.kv_lens - shift),
        sampling_ints=ints,
    )


@struct.dataclass
class StepExtras:
    """What a step's samplers read beyond the plain sampler's: penalty histories
    (H > 0), scored prompt rows (R > 0) and speculative proposals (k > 0). Each is
    empty in most steps; when none is there the forward's own sample is the step's."""

    penalty_history: jax.Array  # i32[3, S, H] (`SamplingBatch.history`)
    # i32[R] each: rows whose prompt logprob is wanted and their target tokens
    # (`paxkv.host.prompt_scores`)
    score_rows: jax.Array
    score_targets: jax.Array
    # Speculative proposals (`ScheduledChunk.num_draft`): sequence s's tokens after its
    # last known one, which follow it as query rows.
    draft_tokens: jax.Array  # i32[S, k]
    draft_counts: jax.Array  # i32[S]
    # Logit biases (`HostBatch.bias_ids`): i32[S, B] token ids (-1 pads), f32[S, B].
    bias_ids: jax.Array
    bias_values: jax.Array
    # Token bitmasks of constrained sequences (`HostBatch.allowed`): i32[S * (k + 1), W],
    # row s * (k + 1) + j sequence s's at speculative position j; W = 0 (S rows): none.
    allowed: jax.Array

    @property
    def needed(self) -> bool:
        """Whether any sampler beyond the forward's plain one must run."""
        return bool(
            self.penalty_history.shape[2]
            or self.score_rows.shape[0]
            or self.draft_tokens.shape[1]
            or self.bias_ids.shape[1]
            or self.allowed.shape[1]
        )


@struct.dataclass
class LastRows:
    """What the forward leaves on the device for the samplers: the final hidden states
    of each sequence's last known row, and of every row (the scored and proposal rows)."""

    hidden: jax.Array  # [S, hidden]
    tokens: jax.Array  # i32[S]; the token each sequence's last row ran (fed ones too)
    fed: jax.Array  # bool[S]; the host had not seen it (async scheduling)
    rows: jax.Array  # i32[S]; the packed row of each (logits_indices)


def step_batch(
    hb: HostBatch, page_size: int, sharding: Any = None
) -> tuple[ForwardBatch, StepExtras]:
    """Moves a host batch to the device (replicated over `sharding`'s mesh if given) in
    one transfer, all but its token masks (`HostBatch.allowed`, filled while the forward
    runs): the extras' `allowed` is empty (i32[S, 0]) until `with_allowed` puts them."""
    names = [f.name for f in dataclasses.fields(hb) if f.name != "allowed"]
    a = dict(zip(names, jax.device_put([getattr(hb, n) for n in names], sharding), strict=True))
    a["allowed"] = jax.device_put(np.zeros((hb.allowed.shape[0], 0), np.int32), sharding)
    return _assemble(a, page_size)


def with_allowed(extras: StepExtras, allowed: np.ndarray, sharding: Any = None) -> StepExtras:
    """`extras` with the step's token masks (i32[S, W], filled on the host) moved to the
    device."""
    return extras.replace(allowed=jax.device_put(allowed, sharding))


def abstract_step_batch(
    num_tokens: int,
    num_seqs: int,
    pages_per_seq: int,
    page_size: int,
    num_groups: int = 1,
    *,
    history_len: int = 0,
    num_scored: int = 0,
    num_draft: int = 0,
    num_bias: int = 0,
    num_mask: int = 0,
    sharding: Any = None,
) -> tuple[ForwardBatch, StepExtras]:
    """The shapes and dtypes (`jax.ShapeDtypeStruct`s, no buffers) of the step batch of
    one shape: what its programs are lowered for."""
    groups = () if num_groups == 1 else (num_groups,)
    t, s = num_tokens, num_seqs
    shapes = {
        "tokens": (t,),
        "positions": (t,),
        "block_tables": (*groups, s, pages_per_seq),
        "kv_lens": (s,),
        "cu_q_lens": (s + 1,),
        "num_seqs": (1,),
        "logits_indices": (s,),
        "sampling_floats": (s, len(SAMPLING_FLOATS)),
        "sampling_ints": (s, len(SAMPLING_INTS)),
        "penalty_history": (3, s, history_len),
        "token_src": (t,),
        "score_rows": (num_scored,),
        "score_targets": (num_scored,),
        "draft_tokens": (s, num_draft),
        "draft_counts": (s,),
        "bias_ids": (s, num_bias),
        "bias_values": (s, num_bias),
        "allowed": (s * (1 + num_draft), num_mask) if num_mask else (s, 0),
    }
    dtype = {"sampling_floats": jnp.float32, "bias_values": jnp.float32}
    a = {
        name: jax.ShapeDtypeStruct(shape, dtype.get(name, jnp.int32), sharding=sharding)
        for name, shape in shapes.items()
    }
    return _assemble(a, page_size)


def _assemble(a: dict[str, Any], page_size: int) -> tuple[ForwardBatch, StepExtras]:
    table = PageTable(
        block_tables=a["block_tables"],
        kv_lens=a["kv_lens"],
        cu_q_lens=a["cu_q_lens"],
        num_seqs=a["num_seqs"],
        page_size=page_size,
    )
    forward = ForwardBatch(
        a["tokens"],
        a["positions"],
        table,
        a["logits_indices"],
        a["token_src"],
        a["sampling_floats"],
        a["sampling_ints"],
    )
    extras = StepExtras(
        a["penalty_history"],
        a["score_rows"],
        a["score_targets"],
        a["draft_tokens"],
        a["draft_counts"],
        a["bias_ids"],
        a["bias_values"],
        a["allowed"],
    )
    return forward, extras


def row_lora(
    model: nnx.Module,
    sampling_ints: jax.Array,  # i32[S, I]
    cu_q_lens: jax.Array,  # i32[S + 1]
    num_rows: int,
) -> jax.Array | None:  # i32[T]
    """Each packed row's LoRA slot, its sequence's (`lora_slot` column; 0 for rows of
    no sequence), for a model with adapter slots; None for one without."""
    if not getattr(model, "lora_slots", 0):
        return None
    seq_slots = sampling_ints[:, INT_COLUMN["lora_slot"]]
    rows = jnp.arange(num_rows)
    row_seq = jnp.searchsorted(cu_q_lens[1:], rows, side="right")
    in_seq = rows < cu_q_lens[-1]
    slots = jnp.where(in_seq, seq_slots[jnp.minimum(row_seq, seq_slots.shape[0] - 1)], 0)
    return slots.astype(jnp.int32)


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
    lora: jax.Array | None = None,
) -> tuple[jax.Array, ...]:  # logits, cache (, i32[L, T, k])
    """The model over a packed batch: writes its K/V, attends, and returns the logits
    (f32[S, V], or [T, V] for every row) with the updated cache. `decode_only` (static):
    every sequence has at most one row, which the model is told (`decode_only=True`).
    `return_routing` (static, a model that `routes_experts` only): also the experts each
    MoE layer sent each row to. `lora`: each row's adapter slot (`row_lora`)."""
    extra = {"decode_only": True} if decode_only else {}
    if return_routing:
        extra["return_routing"] = True
    if lora is not None:
        extra["lora"] = lora
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
    lora: jax.Array | None = None,
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
        lora=lora,
    )
    return sample(logits, sampling, num_logprobs=num_logprobs), kv_cache


def _replicated(x: jax.Array, mesh: Any) -> jax.Array:
    """`x` replicated over `mesh` (a no-op off a mesh): what any process reads whole."""
    if mesh is None:
        return x
    return jax.lax.with_sharding_constraint(x, shardings.replicated(mesh))


def forward_step(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    kv_cache: PagedKVCache,
    batch: ForwardBatch,
    carried: Carried,  # of the previous step
    *,
    attention_backend: str,
    num_logprobs: int = 0,
) -> tuple[Sampled, LastRows, jax.Array, PagedKVCache]:
    """The model over one step: writes the batch's K/V, attends, and samples a token per
    sequence without penalties. The one program of a step shape.

    Returns the samples padded to `max_num_seqs` rows (row i: the batch's sequence i), so
    the next step can read its input tokens from them on the device; the last rows'
    hidden states (`LastRows`) and every row's (f32[T, hidden]) for the samplers of
    `resample_step`; and the cache. A row whose `token_src` is >= 0 (async scheduling)
    runs the token the previous step sampled there, which the host has not seen
    (`with_carried`).
    """
    model = nnx.merge(graphdef, params)
    batch = with_carried(batch, carried)
    tokens_in = batch.tokens
    # A model that routes experts always returns its routing (no second compiled
    # variant): it stays on the device unless a request asks (`ModelRunner.fetch_routing`).
    extra = {"return_routing": True} if getattr(model, "routes_experts", False) else {}
    lora = row_lora(model, batch.sampling_ints, batch.table.cu_q_lens, tokens_in.shape[0])
    if lora is not None:
        extra["lora"] = lora
    hidden, kv_cache, *routing = model(
        tokens_in,
        batch.positions,
        kv_cache,
        batch.table,
        attention_backend=attention_backend,
        **extra,
    )
    last = batch.logits_indices
    num_seqs = last.shape[0]
    sampling = SamplingBatch(
        batch.sampling_floats, batch.sampling_ints, jnp.zeros((3, num_seqs, 0), jnp.int32)
    )
    sampled = sample(model.logits(hidden[last]), sampling, num_logprobs=num_logprobs)
    sampled = sampled.padded(carried.tokens.shape[0])
    mesh = getattr(model, "mesh", None)
    if routing:  # replicated on a mesh, so any process reads it whole
        sampled = sampled.replace(routing=_replicated(routing[0], mesh))
    # Replicated, like the next step's prev_tokens input.
    sampled = sampled.replace(tokens=_replicated(sampled.tokens, mesh))
    rows = LastRows(hidden[last], tokens_in[last], batch.token_src[last] >= 0, last)
    return sampled, rows, hidden, kv_cache


def resample_step(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    last: LastRows,
    hidden: jax.Array | None,  # [T, hidden]; None when no row is scored or proposed
    sampling_floats: jax.Array,  # f32[S, F]
    sampling_ints: jax.Array,  # i32[S, I]
    extras: StepExtras,
    proposals: jax.Array,  # i32[S, k]; the extras' own, or a draft model's
    draft_probs: jax.Array | None,  # f32[S, k, V]; None: n-gram proposals
    *,
    num_rows: int,
    num_logprobs: int = 0,
) -> tuple[Sampled, Carried]:
    """A step's samples when it has extras (`StepExtras`): each sequence's token with
    its penalties, the scored rows' prompt logprobs (`sampled.scored`), the verdicts on
    speculative proposals (`sampled.spec`, with `sampled.tokens` what each sequence's
    first row sampled), padded to `num_rows` rows, and what the step leaves the next
    (`Carried`). A small program of the LM head and the samplers, run right after the
    step's `forward_step`."""
    model = nnx.merge(graphdef, params)
    num_sampled, k = last.rows.shape[0], proposals.shape[1]
    allowed, position_masks = extras.allowed, None
    if allowed.shape[1] and k:  # per speculative position: [S, k + 1, W]
        position_masks = allowed.reshape(num_sampled, k + 1, allowed.shape[1])
        allowed = position_masks[:, 0]
    sampling = SamplingBatch(
        sampling_floats,
        sampling_ints,
        extras.penalty_history,
        extras.bias_ids,
        extras.bias_values,
        allowed,
    )
    sampling = add_to_history(sampling, last.tokens, last.fed)
    if hidden is None:
        logits = model.logits(last.hidden)
    else:
        # The rows whose logits are read: each sequence's last known token, its
        # proposals' rows after it, and the scored rows: one matmul.
        draft_rows = jnp.minimum(last.rows[:, None] + jnp.arange(1, k + 1), hidden.shape[0] - 1)
        rows = jnp.concatenate([last.rows, draft_rows.reshape(-1), extras.score_rows])
        logits = model.logits(hidden[rows])
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
            extras.draft_counts,
            sampled.tokens,
            draft_probs=draft_probs,
            num_logprobs=num_logprobs,
            position_masks=position_masks,
        )
        sampled = sampled.replace(spec=spec)
    if extras.score_rows.shape[0]:
        scored = score(logits[num_spec:], extras.score_targets, num_logprobs=num_logprobs)
        sampled = sampled.replace(scored=scored)
    sampled = sampled.padded(num_rows)
    mesh = getattr(model, "mesh", None)
    sampled = sampled.replace(tokens=_replicated(sampled.tokens, mesh))
    last_tokens, rejected = sampled.tokens, jnp.zeros(num_rows, jnp.int32)
    if k:  # the target's token after each sequence's accepted proposals
        spec = sampled.spec
        last_tokens = jnp.take_along_axis(spec.tokens, spec.num_accepted[:, None], axis=1)[:, 0]
        rejected = _replace(rejected, extras.draft_counts) - spec.num_accepted
    return sampled, Carried(_replicated(last_tokens, mesh), _replicated(rejected, mesh))


def draft_step(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    cache: PagedKVCache,
    batch: ForwardBatch,
    carried: Carried,  # of the previous step
    penalty_history: jax.Array,  # i32[3, S, H]
    draft_counts: jax.Array,  # i32[S]
    *,
    attention_backend: str,
    k: int,
) -> tuple[jax.Array, jax.Array, jax.Array, PagedKVCache]:
    """A draft model's part of a step (`paxkv.engine.device.draft`): it runs the step's tokens
    and proposes up to k tokens after each sequence's last one. Returns the step's
    tokens with the proposals in their rows (i32[T], what the target runs), the
    proposals (i32[S, k]), their draft distributions (f32[S, k, V]) and its cache."""
    model = nnx.merge(graphdef, params)
    batch = with_carried(batch, carried)
    tokens_in = batch.tokens
    last = batch.logits_indices
    sampling = SamplingBatch(batch.sampling_floats, batch.sampling_ints, penalty_history)
    sampling = add_to_history(sampling, tokens_in[last], batch.token_src[last] >= 0)
    proposals, draft_probs, cache = draft_proposals(
        model,
        tokens_in,
        batch.positions,
        cache,
        batch.table,
        last,
        draft_counts,
        sampling,
        k,
        attention_backend=attention_backend,
    )
    num_rows = tokens_in.shape[0]
    draft_rows = jnp.minimum(last[:, None] + jnp.arange(1, k + 1), num_rows - 1)
    valid = jnp.arange(k)[None, :] < draft_counts[:, None]
    rows = jnp.where(valid, draft_rows, num_rows)
    tokens_in = tokens_in.at[rows.reshape(-1)].set(proposals.reshape(-1), mode="drop")
    return tokens_in, proposals, draft_probs, cache


FORWARD = jax.jit(
    forward_step,
    static_argnames=("attention_backend", "num_logprobs"),
    donate_argnames=("kv_cache",),
)
RESAMPLE = jax.jit(resample_step, static_argnames=("num_rows", "num_logprobs"))
DRAFT = jax.jit(draft_step, static_argnames=("attention_backend", "k"), donate_argnames=("cache",))


@struct.dataclass
class DecodeLimits:
    """Per-sequence stop conditions of a multi-step call, padded to S."""

    stop_ids: jax.Array  # i32[S, MAX_STOP_IDS]; -1 pads
    remaining: jax.Array  # i32[S]; tokens the sequence may still generate (>= 1 if live)

    @classmethod
    def from_host(
        cls,
        stops: list[tuple[int, ...]],
        remaining: list[int],
        size: int,
        sharding: Any = None,
    ) -> DecodeLimits:
        """Pads each sequence's stop ids (at most `MAX_STOP_IDS`) and token limit to `size` rows."""
        ids = np.full((size, MAX_STOP_IDS), -1, np.int32)
        for i, s in enumerate(stops):
            ids[i, : len(s)] = s
        rem = np.zeros(size, np.int32)
        rem[: len(remaining)] = remaining
        return cls(*jax.device_put((ids, rem), sharding))

    @classmethod
    def abstract(cls, size: int, sharding: Any = None) -> DecodeLimits:
        """The shapes and dtypes of `size` rows' limits (what the loop is lowered for)."""
        return cls(
            jax.ShapeDtypeStruct((size, MAX_STOP_IDS), jnp.int32, sharding=sharding),
            jax.ShapeDtypeStruct((size,), jnp.int32, sharding=sharding),
        )


def decode_loop(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    kv_cache: PagedKVCache,
    batch: ForwardBatch,  # of a decode-only plan: row s is sequence s
    carried: Carried,  # of the previous step
    penalty_history: jax.Array,  # i32[3, S, H]
    limits: DecodeLimits,
    *,
    attention_backend: str,
    num_steps: int,
    num_logprobs: int = 0,
) -> tuple[Sampled, jax.Array, Carried, PagedKVCache]:
    """Runs `num_steps` decode iterations. Returns `(samples with arrays [N, S, ...],
    valid bool[N, S], what it leaves the next step, kv_cache)`; `valid[i, s]` says
    sequence s produced token i. Each token a sequence samples joins its penalty
    history before its next iteration; a token fed from the previous step (async
    scheduling) before the first."""
    model = nnx.merge(graphdef, params)
    fed = batch.token_src[batch.logits_indices] >= 0
    batch = with_carried(batch, carried)
    sampling = SamplingBatch(batch.sampling_floats, batch.sampling_ints, penalty_history)
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
            lora=row_lora(model, batch.sampling_ints, cu, num_rows),
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
        lambda lg: sample(lg, sampling, num_logprobs=num_logprobs),
        jax.ShapeDtypeStruct((num_slots, model.config.vocab_size), jnp.float32),
    )
    out = jax.tree.map(lambda a: jnp.zeros((num_steps, *a.shape), a.dtype), shapes)
    carry = (
        kv_cache,
        first_tokens,
        table.kv_lens,
        live,
        add_to_history(sampling, first_tokens, fed & live),
        out,
        jnp.zeros((num_steps, num_slots), bool),
    )
    kv_cache, last, _, _, _, out, valid = jax.lax.fori_loop(0, num_steps, body, carry)
    mesh = getattr(model, "mesh", None)
    left = Carried(
        _replicated(_replace(jnp.zeros_like(carried.tokens), last), mesh),
        jnp.zeros_like(carried.rejected),
    )
    return out, valid, left, kv_cache


DECODE_LOOP = jax.jit(
    decode_loop,
    static_argnames=("attention_backend", "num_steps", "num_logprobs"),
    donate_argnames=("kv_cache",),
)
# What `CompileCounter` watches: the step's programs; of them, those that run the model.
COMPILED_FUNCTIONS = ("forward_step", "resample_step", "draft_step", "decode_loop")
MODEL_FUNCTIONS = ("forward_step", "draft_step", "decode_loop")
