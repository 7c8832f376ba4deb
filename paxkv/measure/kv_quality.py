"""What a quantized KV cache, or quantized weights, cost in quality: held-out
perplexity and greedy agreement.

Both measures run the model over the paged cache, so the quantized KV write and the
dequantizing attention read (and the quantized projections: `paxkv.models.
quantized_weights`) are what change between the rows:

* **Perplexity** is teacher-forced. Each held-out window is prefilled through the
  model's paged `__call__` in chunks of `chunk_len` tokens, so every chunk attends to
  K/V that earlier chunks (and its own rows) wrote to the cache in its dtype. The loss
  is the mean next-byte negative log-likelihood over every row of every window.
* **Greedy agreement** generates `max_tokens` greedy tokens for each prompt through
  the `Engine`, and compares each cache dtype's tokens with the unquantized ("auto")
  run's. `prefix_agreement` is the fraction of tokens generated before a
  continuation's first divergence (total common-prefix length over total tokens);
  `token_agreement` the fraction of positions holding the same token, after a
  divergence included; `identical` the fraction of continuations equal throughout.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from paxkv.engine import Engine, EngineConfig
from paxkv.engine.device.step import forward_logits
from paxkv.host.request import SamplingParams
from paxkv.kv_cache import PagedKVCache, PageTable
from paxkv.models.quantized_weights import quantize_model
from paxkv.models.training import spaced_windows
from paxkv.pallas_kernels.layout import cdiv

REFERENCE_DTYPE = "auto"
NO_QUANTIZATION = "none"  # the weights in the model's own dtype


def _chunk_nll(graphdef, state, kv_cache, tokens, positions, targets, table, *, attention_backend):
    model = nnx.merge(graphdef, state)
    logits, kv_cache = forward_logits(
        model, tokens, positions, kv_cache, table, None, attention_backend=attention_backend
    )
    logp = jax.nn.log_softmax(logits, axis=-1)  # f32[T, V]
    return -jnp.take_along_axis(logp, targets[:, None], axis=-1)[:, 0], kv_cache


_CHUNK_NLL = jax.jit(
    _chunk_nll, static_argnames=("attention_backend",), donate_argnames=("kv_cache",)
)


def paged_nll(
    model: nnx.Module,
    windows: np.ndarray,  # i32[N, L + 1]
    *,
    kv_cache_dtype: str = "auto",
    chunk_len: int = 64,
    batch_size: int = 16,
    page_size: int = 16,
    attention_backend: str = "auto",
) -> np.ndarray:  # f32[N, L]
    """Per-token NLL (nats) of `windows[:, 1:]` given the preceding tokens, over a paged cache.

    `batch_size` windows run as the sequences of one step, each prefilled from position
    0 in chunks of `chunk_len` tokens (L must be a multiple) into a fresh cache of
    `kv_cache_dtype` ("auto", "int8", "fp8"); the logits of every row are kept.
    """
    windows = np.asarray(windows, np.int32)
    num_windows, length = windows.shape[0], windows.shape[1] - 1
    if length % chunk_len:
        raise ValueError(f"window length {length} must be a multiple of chunk_len={chunk_len}")
    mc = model.config
    graphdef, state = nnx.split(model)
    pages_per_seq = cdiv(length, page_size)
    s = min(batch_size, num_windows)
    block_tables = jnp.asarray(
        1 + np.arange(s * pages_per_seq).reshape(s, pages_per_seq), jnp.int32
    )
    cu_q_lens = jnp.asarray(np.arange(s + 1) * chunk_len, jnp.int32)
    num_seqs = jnp.asarray([s], jnp.int32)
    out = np.empty((num_windows, length), np.float32)
    for lo in range(0, num_windows, s):
        batch = windows[lo : lo + s]
        live = len(batch)
        if live < s:  # the last batch: repeat its last window, drop the copies' results
            batch = np.concatenate([batch, np.repeat(batch[-1:], s - live, axis=0)])
        kv_cache = PagedKVCache.for_model(mc, 1 + s * pages_per_seq, page_size, kv_cache_dtype)
        nll = []
        for start in range(0, length, chunk_len):
            stop = start + chunk_len
            table = PageTable(
                block_tables=block_tables,
                kv_lens=jnp.full((s,), stop, jnp.int32),
                cu_q_lens=cu_q_lens,
                num_seqs=num_seqs,
                page_size=page_size,
            )
            positions = np.tile(np.arange(start, stop, dtype=np.int32), s)
            chunk, kv_cache = _CHUNK_NLL(
                graphdef,
                state,
                kv_cache,
                jnp.asarray(batch[:, start:stop].reshape(-1)),
                jnp.asarray(positions),
                jnp.asarray(batch[:, start + 1 : stop + 1].reshape(-1)),
                table,
                attention_backend=attention_backend,
            )
            nll.append(chunk.reshape(s, chunk_len))
        out[lo : lo + live] = np.concatenate(jax.device_get(nll), axis=1)[:live]
    return out


@jax.jit
def _dense_nll(graphdef, state, windows):
    logits = jax.vmap(nnx.merge(graphdef, state).dense_logits)(windows[:, :-1])
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.take_along_axis(logp, windows[:, 1:, None], axis=-1)[..., 0]


def dense_nll(model: nnx.Module, windows: np.ndarray) -> np.ndarray:  # f32[N, L]
    """The same per-token NLL as `paged_nll`, from the dense forward (`dense_logits`): the oracle."""
    return np.asarray(_dense_nll(*nnx.split(model), jnp.asarray(windows, jnp.int32)))


def perplexity(nll: np.ndarray) -> dict[str, float]:
    """Mean NLL in nats, bits per byte (byte tokens: bits per token) and perplexity."""
    mean = float(np.mean(nll, dtype=np.float64))
    return {"nll": mean, "bits_per_byte": mean / math.log(2), "perplexity": math.exp(mean)}


def line_start_prompts(data: np.ndarray, num_prompts: int, prompt_len: int) -> list[list[int]]:
    """`num_prompts` prompts of `prompt_len` bytes, each starting at the first line start at
    or after one of `num_prompts` evenly spaced offsets of `data` (deterministic)."""
    starts = np.linspace(0, len(data) - 2 * prompt_len, num_prompts).astype(np.int64)
    prompts = []
    for s in starts:
        newline = np.flatnonzero(data[s : s + prompt_len] == ord("\n"))
        s = s + newline[0] + 1 if len(newline) else s
        prompts.append(data[s : s + prompt_len].astype(np.int64).tolist())
    return prompts


def greedy_continuations(
    model: nnx.Module,
    prompts: Sequence[Sequence[int]],
    *,
    kv_cache_dtype: str = "auto",
    max_tokens: int = 64,
    page_size: int = 16,
    attention_backend: str = "auto",
) -> list[list[int]]:
    """The `max_tokens` greedy tokens (EOS ignored) the `Engine` generates for each prompt.

    All prompts run at once over a cache of `kv_cache_dtype`, in steps of one shape: as
    many tokens as prompts, so the prompts are prefilled in chunks beside the decodes.
    """
    n = len(prompts)
    max_len = max(len(p) for p in prompts) + max_tokens
    max_model_len = cdiv(max_len, page_size) * page_size
    config = EngineConfig(
        num_pages=1 + n * (max_model_len // page_size),
        page_size=page_size,
        max_num_seqs=n,
        max_num_batched_tokens=n,
        token_buckets=(n,),  # one compiled step shape
        max_model_len=max_model_len,
        kv_cache_dtype=kv_cache_dtype,
        attention_backend=attention_backend,
        log_stats_interval_s=0,
    )
    engine = Engine(model, config)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": list(p)}, params)
    final = engine.run_until_done()
    return [final[str(i)].outputs[0].token_ids for i in range(n)]


def agreement(
    reference: Sequence[Sequence[int]], other: Sequence[Sequence[int]]
) -> dict[str, float]:
    """How far `other`'s continuations match `reference`'s (see the module docstring)."""
    if len(reference) != len(other):
        raise ValueError(f"{len(reference)} reference continuations, {len(other)} others")
    total = prefix = same = identical = 0
    for ref, oth in zip(reference, other, strict=True):
        if len(ref) != len(oth):
            raise ValueError(f"continuations of {len(ref)} and {len(oth)} tokens")
        eq = np.asarray(ref) == np.asarray(oth)
        total += len(ref)
        same += int(eq.sum())
        prefix += len(ref) if eq.all() else int(np.argmin(eq))  # the first False
        identical += bool(eq.all())
    return {
        "prefix_agreement": prefix / total,
        "token_agreement": same / total,
        "identical": identical / len(reference),
    }


@dataclasses.dataclass(frozen=True)
class QualityConfig:
    """The measurement's sizes; the defaults run in a few minutes on a 2-core CPU."""

    kv_cache_dtypes: tuple[str, ...] = ("auto", "int8", "fp8")
    # Weights: "none" (the model's dtype), "int8", "fp8"; each with every cache dtype.
    weight_quantizations: tuple[str, ...] = (NO_QUANTIZATION,)
    num_windows: int = 64
    window_len: int = 256
    chunk_len: int = 64
    batch_size: int = 16
    num_prompts: int = 32
    prompt_len: int = 64
    max_tokens: int = 64
    page_size: int = 16
    attention_backend: str = "auto"


def evaluate(
    model: nnx.Module,
    eval_data: np.ndarray,
    config: QualityConfig = QualityConfig(),
    *,
    progress: Callable[[int, int, str], None] | None = None,
) -> dict[str, Any]:
    """Perplexity and greedy agreement of every weight quantization and cache dtype on
    held-out bytes `eval_data`.

    Returns `{"config", "dense", "rows"}`: the dense forward's perplexity (the oracle the
    unquantized "auto" row must match), and one row per (weights, cache dtype) with its
    perplexity, its relative perplexity change against the unquantized "auto" row, the
    mean absolute difference of its per-token NLL from that row's (`nll_abs_diff`,
    nats: how far quantization moves each prediction, either way), its agreement with
    that row and its seconds. `progress(done, total, stage)` is
    called before each of its `total` stages (the dense forward, then each dtype's
    perplexity and greedy runs) with the number done and the one starting, and once at
    the end (`done == total`, stage "done").
    """
    dtypes = list(dict.fromkeys((REFERENCE_DTYPE, *config.kv_cache_dtypes)))
    weights = list(dict.fromkeys((NO_QUANTIZATION, *config.weight_quantizations)))
    variants = [(w, d) for w in weights for d in dtypes]
    stages = ["dense forward"]
    stages += [
        f"{w} weights, {d} {what}" for w, d in variants for what in ("perplexity", "greedy")
    ] + ["done"]

    def report(done: int) -> None:
        if progress is not None:
            progress(done, len(stages) - 1, stages[done])

    windows = spaced_windows(eval_data, config.num_windows, config.window_len)
    prompts = line_start_prompts(eval_data, config.num_prompts, config.prompt_len)
    report(0)
    dense = perplexity(dense_nll(model, windows))
    rows, reference, models = [], None, {NO_QUANTIZATION: model}
    for i, (mode, dtype) in enumerate(variants):
        start = time.perf_counter()
        report(1 + 2 * i)
        if mode not in models:
            models[mode] = nnx.clone(model)
            quantize_model(models[mode], mode)
        nll = paged_nll(
            models[mode],
            windows,
            kv_cache_dtype=dtype,
            chunk_len=config.chunk_len,
            batch_size=config.batch_size,
            page_size=config.page_size,
            attention_backend=config.attention_backend,
        )
        ppl = perplexity(nll)
        report(2 + 2 * i)
        tokens = greedy_continuations(
            models[mode],
            prompts,
            kv_cache_dtype=dtype,
            max_tokens=config.max_tokens,
            page_size=config.page_size,
            attention_backend=config.attention_backend,
        )
        if reference is None:
            reference, reference_nll, reference_ppl = tokens, nll, ppl["perplexity"]
        rows.append(
            {
                "weights": mode,
                "kv_cache_dtype": dtype,
                **ppl,
                "perplexity_change": ppl["perplexity"] / reference_ppl - 1,
                "nll_abs_diff": float(np.mean(np.abs(nll - reference_nll), dtype=np.float64)),
                **agreement(reference, tokens),
                "seconds": time.perf_counter() - start,
            }
        )
    report(len(stages) - 1)
    return {"config": dataclasses.asdict(config), "dense": dense, "rows": rows}


def markdown_table(result: dict[str, Any]) -> str:
    """The rows of `evaluate` as a Markdown table."""
    lines = [
        "| weights | kv cache | bits/byte | perplexity | vs unquantized | mean abs ΔNLL | prefix agreement | token agreement | identical |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['weights']} | {r['kv_cache_dtype']} | {r['bits_per_byte']:.4f} "
            f"| {r['perplexity']:.4f} "
            f"| {100 * r['perplexity_change']:+.3f}% | {r['nll_abs_diff']:.5f} "
            f"| {r['prefix_agreement']:.3f} "
            f"| {r['token_agreement']:.3f} | {r['identical']:.3f} |"
        )
    return "\n".join(lines)
