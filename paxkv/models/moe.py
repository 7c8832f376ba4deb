"""The sparse mixture-of-experts layer in Flax NNX: a top-k router and gated-MLP experts
computed as grouped matmuls over the tokens sorted by expert.

Each token goes to `top_k` of `num_experts` experts; the layer's output is the sum of
those experts' outputs, weighted by the router. The work per token follows `top_k`, not
the expert count: the (token, expert) pairs are sorted by expert and each expert
multiplies only its own rows (`grouped_matmul`). On TPU and GPU that is
`jax.lax.ragged_dot` (lowered to XLA's ragged-dot instruction); on the CPU,
where JAX lowers `ragged_dot` to a masked dense product over every group (the work of
all experts for every row), it is a loop over tiles of each expert's rows instead
(`tiled_grouped_matmul`). The layouts and gated units of the families' experts are
`ExpertForm`s: Mixtral's, Qwen3-MoE's, and gpt-oss's (biased router, fused interleaved
gate/up with biases, clamped SwiGLU).

On a mesh the experts are split over the `model` axis (expert parallelism) when it
divides their number, else each expert's hidden features are (tensor parallelism inside
the experts), by the family's `SplitRule`s. Activations are replicated within a replica,
so every device already holds every token: it computes the rows routed to the experts it
holds, and one all-reduce (`psum`) sums the partial outputs, the same collective as a
row-parallel MLP's.

Routing replay (RL): `MoE.__call__` returns the experts each token went to, and takes
them back (`experts=`) to force that routing: the gate weights are then the router's
probabilities at the given experts, normalised by the same rule.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from paxkv.sharding import shardings
from paxkv.sharding.mesh_shape import MODEL_AXIS
from paxkv.sharding.shardings import COLUMN, EXPERT, ROW, SCALE, SplitRule

from . import quantized_weights
from .decoder_config import DecoderConfig
from .layers import INIT_STD, linear, matmul_precision
from .moe_config import GROUPED_MATMULS


def route(
    logits: jax.Array,  # [T, E]
    top_k: int,
    *,
    renormalize: bool,
    experts: jax.Array | None = None,  # i32[T, k]
) -> tuple[jax.Array, jax.Array]:  # f32[T, k], i32[T, k]
    """The gate weights and experts of each token: the softmax of its router logits (in
    float32) at its `top_k` most probable experts, divided by their sum when
    `renormalize` (Mixtral, gpt-oss; Qwen3-MoE's `norm_topk_prob`; equal to the softmax
    over the top-k logits). With `experts` given (routing replay) those are the experts, and the
    weights the probabilities at them, normalised by the same rule.
    """
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    if experts is None:
        weights, experts = jax.lax.top_k(probs, top_k)
    else:
        weights = jnp.take_along_axis(probs, experts, axis=-1)
    if renormalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts.astype(jnp.int32)


# The fewest rows of a tile (unless all rows are fewer): a tile reads its group's whole
# matrix, so on the CPU a few padded rows cost less than reading it again.
MIN_TILE_ROWS = 8


def _power_of_two_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def tile_rows(num_rows: int, num_groups: int) -> int:
    """The rows of a tile of `tiled_grouped_matmul`: the power of two at or above half
    the mean group size, at least `MIN_TILE_ROWS` and at most the rows' power of two. A
    group wastes under one tile, so the padding is at most about the rows when groups
    are large, and a decode step's groups of a row or two take one tile each."""
    half_mean = _power_of_two_at_least(-(-num_rows // (2 * num_groups)))
    return min(max(MIN_TILE_ROWS, half_mean), _power_of_two_at_least(num_rows))


def num_tiles(num_rows: int, num_groups: int) -> int:
    """The most tiles `num_rows` rows in `num_groups` groups take: each non-empty group
    wastes under one tile, `(M + min(G, M) * (B - 1)) // B` for B = `tile_rows`."""
    b = tile_rows(num_rows, num_groups)
    return (num_rows + min(num_groups, num_rows) * (b - 1)) // b


def tiled_grouped_matmul(
    lhs: jax.Array,  # [M, K], rows sorted by group
    rhs: jax.Array,  # [G, K, N]
    group_sizes: jax.Array,  # i32[G]
    *,
    precision: Any = None,
) -> jax.Array:  # [M, N]
    """`grouped_matmul` by tiles: each group's rows are padded to whole tiles of
    `tile_rows` (B) rows, and a loop over the tiles multiplies each by its group's
    matrix, skipping the tiles left over (of the static `num_tiles`). The work is
    `B x K x N` per tile, at most `(M + min(G, M) * (B - 1)) x K x N` in all (about
    twice the rows' when groups are large, at most B times when they hold a row or two),
    whatever the number of groups; each tile reads its group's matrix once, so a step
    whose rows touch few groups reads only those.
    """
    m, k = lhs.shape
    g, _, n = rhs.shape
    b, tiles_max = tile_rows(m, g), num_tiles(m, g)
    group_end = jnp.cumsum(group_sizes)
    group_start = group_end - group_sizes
    tiles = (group_sizes + b - 1) // b
    tile_end = jnp.cumsum(tiles)
    rows = jnp.arange(m, dtype=group_sizes.dtype)
    group = jnp.sum(rows[:, None] >= group_end[None, :], axis=1)  # G for rows past them
    valid = group < g
    group = jnp.minimum(group, g - 1)
    slot = (tile_end[group] - tiles[group]) * b + rows - group_start[group]
    slot = jnp.where(valid, slot, tiles_max * b)  # past every tile
    # Gathers, not scatters, move the rows (XLA:CPU's row scatters are slow): which row
    # each padded slot holds (M: none, a zero row), and the tiles' groups.
    source = jnp.full(tiles_max * b, m, slot.dtype).at[slot].set(rows, mode="drop")
    padded = jnp.concatenate([lhs, jnp.zeros((1, k), lhs.dtype)])[source]
    tile_ids = jnp.arange(tiles_max, dtype=tile_end.dtype)
    tile_group = jnp.minimum(jnp.sum(tile_ids[:, None] >= tile_end[None, :], axis=1), g - 1)

    def tile_product(_, tile):
        x, group, used = tile
        w = jax.lax.dynamic_index_in_dim(rhs, group, keepdims=False)  # [K, N]
        y = jax.lax.cond(
            used,
            lambda: jnp.dot(x, w, precision=precision),
            lambda: jnp.zeros((b, n), jnp.result_type(x, w)),
        )
        return None, y

    tiles_in = (padded.reshape(tiles_max, b, k), tile_group, tile_ids < tile_end[-1])
    _, out = jax.lax.scan(tile_product, None, tiles_in)
    out = jnp.concatenate([out.reshape(tiles_max * b, n), jnp.zeros((1, n), out.dtype)])
    return out[slot].astype(lhs.dtype)  # rows past every group read the zero row


def grouped_matmul(
    lhs: jax.Array,  # [M, K], rows sorted by group
    rhs: jax.Array,  # [G, K, N]
    group_sizes: jax.Array,  # i32[G]
    *,
    impl: str = "auto",
    precision: Any = None,
) -> jax.Array:  # [M, N], lhs.dtype
    """Row r of group j times `rhs[j]`: groups are consecutive runs of rows, group j the
    `group_sizes[j]` rows after group j - 1's, and rows past `sum(group_sizes)` are
    zero. `impl`: "ragged_dot" (`jax.lax.ragged_dot`), "tiled"
    (`tiled_grouped_matmul`), or "auto": ragged_dot on TPU and GPU, tiled on the CPU
    (see the module's docstring).
    """
    if impl not in GROUPED_MATMULS:
        raise ValueError(f"impl={impl!r} must be one of {GROUPED_MATMULS}")
    if impl == "auto":
        impl = "tiled" if jax.default_backend() == "cpu" else "ragged_dot"
    if impl == "tiled":
        return tiled_grouped_matmul(lhs, rhs, group_sizes, precision=precision)
    total = jnp.sum(group_sizes)
    out = jax.lax.ragged_dot(lhs, rhs, group_sizes, precision=precision)
    return jnp.where(jnp.arange(lhs.shape[0])[:, None] < total, out, 0).astype(lhs.dtype)


def swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    """`silu(gate) * up` (Mixtral, Qwen3-MoE)."""
    return jax.nn.silu(gate) * up


def clamped_swiglu(gate_up: jax.Array, *, limit: float, alpha: float) -> jax.Array:
    """gpt-oss's gated unit over one fused projection whose columns alternate gate, up:
    `(clip(up, -limit, limit) + 1) * g * sigmoid(alpha * g)` with `g = min(gate, limit)`."""
    gate, up = gate_up[..., ::2], gate_up[..., 1::2]
    gate = jnp.minimum(gate, limit)
    up = jnp.clip(up, -limit, limit)
    return (up + 1) * gate * jax.nn.sigmoid(gate * alpha)


def expert_mlp(
    x: jax.Array,  # [T, hidden]
    experts: jax.Array,  # i32[T, k]
    weights: jax.Array,  # f32[T, k]
    w_in: Sequence[jax.Array],  # each [G, hidden, *]: experts first_expert .. + G - 1
    w_out: jax.Array,  # [G, I, hidden]
    *,
    b_in: Sequence[jax.Array] = (),  # each [G, *], one for each of w_in, or none
    glu: Callable[..., jax.Array] = swiglu,
    first_expert: jax.Array | int = 0,
    impl: str = "auto",
    precision: Any = None,
) -> jax.Array:  # f32[T, hidden]
    """`sum_j weights[t, j] * w_out(glu(x[t] w_in + b_in))` over the experts
    `experts[t, j]`, counting only the G experts given (the rest contribute zero): each
    (token, expert) pair is a row, the rows are sorted by expert, and each projection is
    one `grouped_matmul`. `glu` maps the input projections (gate and up, or one fused)
    to `[rows, I]`.
    """
    t, k = experts.shape
    local = experts.reshape(-1) - first_expert  # [T * k]
    num_local = w_out.shape[0]
    mine = (local >= 0) & (local < num_local)
    key = jnp.where(mine, local, num_local)  # other devices' rows sort last, ungrouped
    order = jnp.argsort(key, stable=True)
    group_sizes = jnp.bincount(key, length=num_local + 1)[:num_local].astype(jnp.int32)
    rows = x[order // k]  # [T * k, hidden]
    mm = lambda a, w: grouped_matmul(a, w, group_sizes, impl=impl, precision=precision)
    ins = [mm(rows, w) for w in w_in]
    if b_in:  # each row's expert's bias (other devices' rows: any, their output is zero)
        row_expert = jnp.minimum(key[order], num_local - 1)
        ins = [a + b[row_expert].astype(a.dtype) for a, b in zip(ins, b_in, strict=True)]
    out = mm(glu(*ins), w_out)  # [T * k, hidden], sorted
    out = out[jnp.argsort(order)]  # back to (token, slot) order
    w = jnp.where(mine, weights.reshape(-1), 0.0)[:, None]
    return jnp.sum((out.astype(jnp.float32) * w).reshape(t, k, -1), axis=1)


@dataclasses.dataclass(frozen=True)
class ExpertForm:
    """A family's MoE block as its checkpoints hold it, and its gated unit.

    `router`: the router's attribute (`[hidden, E]`, with a bias when `router_bias`).
    `inputs`: the experts' input projections, gate and up (`[E, hidden, I]` each), or one
    fused projection whose columns alternate gate and up (`[E, hidden, 2 I]`); `output`
    the down projection (`[E, I, hidden]`). `bias`: each has a bias `<name>_bias`
    (`[E, out]`). `swiglu_limit` (with `swiglu_alpha`): gpt-oss's `clamped_swiglu` on
    the fused projection; None: `swiglu` on gate and up.
    """

    router: str = "gate"
    router_bias: bool = False
    inputs: tuple[str, ...] = ("gate_proj", "up_proj")
    output: str = "down_proj"
    bias: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702

    def __post_init__(self):
        if len(self.inputs) != (1 if self.swiglu_limit is not None else 2):
            raise ValueError(
                f"inputs={self.inputs}: the clamped SwiGLU takes one fused projection, "
                "SwiGLU a gate and an up one"
            )

    @classmethod
    def gpt_oss(cls, *, limit: float, alpha: float) -> ExpertForm:
        """gpt-oss's: a biased `router`, fused `gate_up_proj` and `down_proj`, biases."""
        return cls(
            router="router",
            router_bias=True,
            inputs=("gate_up_proj",),
            bias=True,
            swiglu_limit=limit,
            swiglu_alpha=alpha,
        )

    @property
    def names(self) -> tuple[str, ...]:
        """The experts' parameters split over a mesh: the projections, the input biases."""
        biases = tuple(f"{n}_bias" for n in self.inputs) if self.bias else ()
        return (*self.inputs, self.output, *biases)

    def glu(self) -> Callable[..., jax.Array]:
        """The gated unit over the input projections' outputs."""
        if self.swiglu_limit is None:
            return swiglu
        return functools.partial(clamped_swiglu, limit=self.swiglu_limit, alpha=self.swiglu_alpha)


# The forms by family: Mixtral's `w1` (gate), `w3` (up), `w2` (down); Qwen3-MoE's names.
MIXTRAL = ExpertForm(inputs=("w1", "w3"), output="w2")
QWEN = ExpertForm()


class Experts(nnx.Module):
    """`num_experts` gated MLPs, each projection stacked over the experts (`[E, in, out]`,
    as NNX kernels), named and shaped as `form` says."""

    def __init__(self, config: DecoderConfig, form: ExpertForm, *, rngs: nnx.Rngs):
        e, h, i = config.num_experts, config.hidden_size, config.intermediate_size
        width = i * (2 if len(form.inputs) == 1 else 1)
        init = nnx.initializers.normal(INIT_STD)
        shapes = {**dict.fromkeys(form.inputs, (e, h, width)), form.output: (e, i, h)}
        for name, shape in shapes.items():
            setattr(self, name, nnx.Param(init(rngs.params(), shape, config.dtype)))
            if form.bias:
                setattr(self, f"{name}_bias", nnx.Param(jnp.zeros((e, shape[-1]), config.dtype)))
        self.form = form

    def __getitem__(self, name: str) -> jax.Array:
        """The parameter `name`'s value (dequantized, for quantized weights:
        `paxkv.models.quantized_weights`)."""
        value = getattr(self, name)[...]
        scale = getattr(self, name + SCALE, None)
        if scale is None:
            return value
        return quantized_weights.dequantize(value, scale[...], scale.get_value().dtype)


class MoE(nnx.Module):
    """A sparse MoE block: the router (`[hidden, E]`) and the `experts`, as `form` lays
    them out (`MIXTRAL`, `QWEN`, `ExpertForm.gpt_oss`).

    `config` is the family's: `num_experts`, `num_experts_per_tok` (k),
    `intermediate_size` (each expert's), `norm_topk_prob` (renormalise the top-k
    weights), `grouped_matmul`, `dtype`.
    """

    def __init__(self, config: DecoderConfig, form: ExpertForm, *, rngs: nnx.Rngs):
        h, e = config.hidden_size, config.num_experts
        setattr(self, form.router, linear(config, h, e, bias=form.router_bias, rngs=rngs))
        self.experts = Experts(config, form, rngs=rngs)
        self.form = form
        self.config = config  # static: the expert fields, and the sharding rules' family

    def __call__(
        self,
        x: jax.Array,  # [T, hidden]
        *,
        experts: jax.Array | None = None,  # i32[T, k]: replay this routing
        mesh: Any = None,
    ) -> tuple[jax.Array, jax.Array]:  # [T, hidden], i32[T, k]
        """The block's output and the experts each token went to (`experts` if given).

        With a `mesh`, the experts run per shard of its `model` axis as the weights are
        split (see the module's docstring); the output is replicated.
        """
        c, form = self.config, self.form
        logits = getattr(self, form.router)(x)
        weights, experts = route(
            logits, c.num_experts_per_tok, renormalize=c.norm_topk_prob, experts=experts
        )
        arrays = [self.experts[name] for name in form.names]
        num_in = len(form.inputs)

        def run(x, experts, weights, *arrays, first_expert=0):
            w_in, w_out, b_in = arrays[:num_in], arrays[num_in], arrays[num_in + 1 :]
            return expert_mlp(
                x,
                experts,
                weights,
                w_in,
                w_out,
                b_in=b_in,
                glu=form.glu(),
                first_expert=first_expert,
                impl=c.grouped_matmul,
                precision=matmul_precision(c),
            )

        specs = (
            [
                shardings.param_spec(("experts", name), a.shape, c, mesh)
                for name, a in zip(form.names, arrays, strict=True)
            ]
            if mesh is not None
            else []
        )
        if all(spec == shardings.REPLICATED for spec in specs):
            out = run(x, experts, weights, *arrays)
        else:
            split_experts = specs[0] == shardings.kernel_spec(EXPERT, arrays[0].ndim)

            def per_shard(x, experts, weights, *arrays):
                first = jax.lax.axis_index(MODEL_AXIS) * arrays[0].shape[0] if split_experts else 0
                partial = run(x, experts, weights, *arrays, first_expert=first)
                return jax.lax.psum(partial, MODEL_AXIS)

            rep = shardings.REPLICATED
            out = shardings.shard_map(
                per_shard, mesh, in_specs=(rep, rep, rep, *specs), out_specs=rep
            )(x, experts, weights, *arrays)
        if form.bias:  # the down bias, replicated: added once, after the all-reduce
            out_bias = self.experts[f"{form.output}_bias"][experts].astype(jnp.float32)
            out = out + jnp.einsum("tk,tkh->th", weights, out_bias)
        return out.astype(x.dtype), experts


def sharding_rules(form: ExpertForm) -> tuple[SplitRule, ...]:
    """How experts of `form` split over the `model` axis: by expert when it divides
    `num_experts` (expert parallelism), else by each expert's hidden feature when it
    divides `intermediate_size` (the inputs and their biases by column, keeping a fused
    projection's gate and up pairs together, the output by row), else replicated. The
    router and the output's bias are replicated."""
    # Quantized weights' scales (`paxkv.models.quantized_weights`) split as their weights'
    # output channels: with them by expert or by column, replicated by row.
    names = (*form.names, *(n + SCALE for n in (*form.inputs, form.output)))
    by_expert = tuple(SplitRule(("experts", n), EXPERT, "num_experts") for n in names)
    inputs = [n for n in names if n not in (form.output, form.output + SCALE)]
    inside = (
        *(SplitRule(("experts", n), COLUMN, "intermediate_size") for n in inputs),
        SplitRule(("experts", form.output), ROW, "intermediate_size"),
        SplitRule(("experts", form.output + SCALE), ROW, "intermediate_size"),
    )
    return by_expert + inside
