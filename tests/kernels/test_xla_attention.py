"""The "xla" loop backend against the reference, on the shared grid."""

import jax.numpy as jnp
import numpy as np
import pytest
from attention_cases import GRID, TOLERANCES, make_case

from paxkv.pallas_kernels.dispatch import ragged_paged_attention, resolve_backend
from paxkv.pallas_kernels.reference import ragged_paged_attention_reference
from paxkv.pallas_kernels.xla import ragged_paged_attention_xla


@pytest.mark.parametrize("point", GRID, ids=lambda p: p.name)
def test_xla_matches_reference(point):
    case = point.case(seed=1)
    kwargs = point.attention_kwargs(case)
    expected = np.asarray(
        ragged_paged_attention_reference(*case.args(), **kwargs).astype(jnp.float32)
    )
    got = np.asarray(ragged_paged_attention_xla(*case.args(), **kwargs).astype(jnp.float32))
    assert np.all(np.isfinite(got)), "poisoned pages or padding leaked into the output"
    tol = TOLERANCES[np.dtype(case.q.dtype)]
    np.testing.assert_allclose(got, expected, rtol=tol, atol=tol)
    assert np.all(got[int(case.cu_q_lens[case.num_seqs[0]]) :] == 0)


@pytest.mark.parametrize("block_pages", [1, 3, 64])
def test_block_sizes_agree(block_pages):
    point = GRID[6]  # mixed, softcap and window
    case = point.case(seed=2)
    kwargs = point.attention_kwargs(case)
    expected = np.asarray(ragged_paged_attention_reference(*case.args(), **kwargs))
    got = np.asarray(ragged_paged_attention_xla(*case.args(), **kwargs, block_pages=block_pages))
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_entry_point_backends():
    case = make_case(
        0, q_lens=(1, 4), kv_lens=(9, 4), num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=8
    )
    ref = ragged_paged_attention(*case.args(), sm_scale=case.sm_scale, backend="reference")
    xla = ragged_paged_attention(*case.args(), sm_scale=case.sm_scale, backend="xla")
    np.testing.assert_allclose(np.asarray(xla), np.asarray(ref), rtol=1e-5, atol=1e-5)
    assert resolve_backend("auto", "cpu") == "xla"
    assert resolve_backend("auto", "tpu") == "tpu" and resolve_backend("auto", "cuda") == "gpu"
    with pytest.raises(ValueError, match="backend='mps'"):
        resolve_backend("mps")
    with pytest.raises(ValueError, match="block_sizes applies"):
        ragged_paged_attention(
            *case.args(), sm_scale=case.sm_scale, backend="xla", block_sizes=object()
        )
