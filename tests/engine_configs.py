"""The small engine set-up that the engine, model and multi-device tests share.

8-token pages, 8 sequences, 64-token steps, 128-token sequences and one or two buckets
per axis: every step shape compiles in seconds on the CPU. Each test picks its pool.
"""

from paxkv.engine import EngineConfig

PAGE_SIZE = 8
SMALL = dict(
    page_size=PAGE_SIZE,
    max_num_seqs=8,
    max_num_batched_tokens=64,
    max_model_len=128,
    token_buckets=(16, 64),
    seq_buckets=(8,),
    page_buckets=(16,),
)


def small_config(num_pages: int, **overrides) -> EngineConfig:
    """`SMALL` with a pool of `num_pages` pages, and `overrides` on top."""
    return EngineConfig(**(SMALL | {"num_pages": num_pages} | overrides))
