"""Batch invariance of attention: a sequence's rows alone and in a batch, bitwise.

The GPU kernel (interpreted) under `deterministic=True` cuts each decode sequence's KV
reduction from its own length (`BlockSizes.split_tokens`); its default plan sizes the
cut from every live decode's length, which the first test shows changing a sequence's
bits. The "xla" loop reduces each row over its own sequence's blocks in a fixed order.
"""

import jax.numpy as jnp
import numpy as np
import pytest
from attention_cases import TOLERANCES, make_case

from paxkv.pallas_kernels.dispatch import DETERMINISTIC, ragged_paged_attention
from paxkv.pallas_kernels.gpu import BlockSizes
from paxkv.pallas_kernels.reference import ragged_paged_attention_reference

# Four KV heads make TARGET_DECODE_PROGRAMS / 4 = 66 shares the default plan aims for;
# with 16-token KV blocks the batch's 89 blocks exceed it, so it cuts sequence 0 (19
# blocks) into shares of 2 blocks, where alone it gets shares of 1.
KV_LENS = (300, 900, 200, 9)
SMALL_BLOCKS = BlockSizes(decode_kv_block=16)


def _case(seed, q_lens=(1, 1, 1, 1), sinks=False):
    return make_case(
        seed, q_lens=q_lens, kv_lens=KV_LENS, num_q_heads=8, num_kv_heads=4, head_dim=64,
        page_size=16, sinks=sinks,
    )  # fmt: skip


def _alone(case, s, pad_tokens=3, pad_seqs=2):
    """The arguments of sequence `s` of `case` alone (the same pages), in a batch of
    other padding, and its row count."""
    a, b = int(case.cu_q_lens[s]), int(case.cu_q_lens[s + 1])
    q = np.zeros((b - a + pad_tokens, *case.q.shape[1:]), case.q.dtype)
    q[: b - a] = case.q[a:b]
    kv_lens = np.zeros(1 + pad_seqs, np.int32)
    kv_lens[0] = case.kv_lens[s]
    tables = np.zeros((1 + pad_seqs, case.block_tables.shape[1]), np.int32)
    tables[0] = case.block_tables[s]
    cu = np.full(2 + pad_seqs, b - a, np.int32)
    cu[0] = 0
    arrays = (q, case.kv_pages, kv_lens, tables, cu, np.array([1], np.int32))
    return tuple(jnp.asarray(x) for x in arrays), b - a


def _alone_and_batched(case, **kwargs):
    """Pairs (alone, in the batch) of every live sequence's output rows."""
    kwargs = dict(sm_scale=case.sm_scale, **case.array_kwargs(), **kwargs)
    batched = np.asarray(ragged_paged_attention(*case.args(), **kwargs))
    pairs = []
    for s in range(int(case.num_seqs[0])):
        args, rows = _alone(case, s)
        alone = np.asarray(ragged_paged_attention(*args, **kwargs))
        a = int(case.cu_q_lens[s])
        pairs.append((alone[:rows], batched[a : a + rows]))
    return pairs


GPU = dict(backend="gpu", interpret=True, block_sizes=SMALL_BLOCKS)


def test_gpu_default_split_plan_depends_on_the_batch():
    """The oracle's premise: without `deterministic`, sequence 0 differs in its bits."""
    (alone, batched), *_ = _alone_and_batched(_case(0), **GPU)
    assert not np.array_equal(alone, batched)
    np.testing.assert_allclose(alone, batched, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("seed, sinks", [(0, False), (1, False), (1, True)])
def test_gpu_deterministic_is_batch_invariant_and_exact(seed, sinks):
    # With sinks: the in-order combine counts each sequence's sink once, from its first share.
    case = _case(seed, sinks=sinks)
    for alone, batched in _alone_and_batched(case, deterministic=True, **GPU):
        np.testing.assert_array_equal(alone, batched)
    # The backend-name form the engine passes, and the semantics of the reference.
    arrays = case.array_kwargs()
    got = ragged_paged_attention(
        *case.args(), sm_scale=case.sm_scale, **arrays, backend="gpu" + DETERMINISTIC,
        interpret=True, block_sizes=SMALL_BLOCKS,
    )  # fmt: skip
    expected = ragged_paged_attention_reference(*case.args(), sm_scale=case.sm_scale, **arrays)
    tol = TOLERANCES[np.dtype(np.float32)]
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=tol, atol=tol)


def test_xla_loop_is_batch_invariant():
    # Decodes and prefill chunks mixed: each row alone equals its row in the batch.
    case = _case(2, q_lens=(1, 7, 1, 9))
    for alone, batched in _alone_and_batched(case, backend="xla"):
        np.testing.assert_array_equal(alone, batched)
