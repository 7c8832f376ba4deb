"""The per-step page table: which pages each sequence of one step reads and writes.

An immutable pytree (`flax.struct.dataclass`) of int32 arrays the host's batch fills each
step (`paxkv.host.batch`), read by the cache's write and the attention call; with
KV-cache groups it holds one table per group (`for_group`).
"""

from __future__ import annotations

import jax
from flax import struct


@struct.dataclass
class PageTable:
    """Which pages each sequence of one step reads and writes; built on the host.

    Sequences `s < num_seqs[0]` are live. Sequence s has `kv_lens[s]` tokens in the
    cache after this step's write (its new tokens included), its new query tokens are
    the packed rows `cu_q_lens[s] : cu_q_lens[s + 1]`, and token j lives in page
    `block_tables[s, j // page_size]`. Unused entries point at `NULL_PAGE`. With
    several KV-cache groups, `block_tables` is `i32[G, S, pages_per_seq]`, a table per
    group, and `for_group(g)` is the table of group g's layers.
    """

    block_tables: jax.Array  # i32[S, pages_per_seq], or i32[G, S, pages_per_seq]
    kv_lens: jax.Array  # i32[S]
    cu_q_lens: jax.Array  # i32[S + 1]
    num_seqs: jax.Array  # i32[1]
    page_size: int = struct.field(pytree_node=False)

    @property
    def max_num_seqs(self) -> int:
        """S, the padded sequence count."""
        return self.kv_lens.shape[0]

    @property
    def pages_per_seq(self) -> int:
        """Block-table entries per sequence."""
        return self.block_tables.shape[-1]

    @property
    def num_groups(self) -> int:
        """Page tables per sequence (KV-cache groups)."""
        return 1 if self.block_tables.ndim == 2 else self.block_tables.shape[0]

    def for_group(self, group: int) -> PageTable:
        """The table of KV-cache group `group` (itself with one group)."""
        if self.block_tables.ndim == 2:
            if group != 0:
                raise ValueError(f"group={group} of a table with one group")
            return self
        return self.replace(block_tables=self.block_tables[group])

    def kernel_args(self) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
        """`(kv_lens, block_tables, cu_q_lens, num_seqs)`, in the attention call's order."""
        return self.kv_lens, self.block_tables, self.cu_q_lens, self.num_seqs

    def kernel_kwargs(self) -> dict[str, jax.Array]:
        """The same four arrays as keyword arguments of the attention call."""
        names = ("kv_lens", "block_tables", "cu_q_lens", "num_seqs")
        return dict(zip(names, self.kernel_args(), strict=True))
