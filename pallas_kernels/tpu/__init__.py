"""TPU (Mosaic) kernels."""

from .ragged_paged_attention import (
    SUPPORTED_HEAD_DIMS,
    BlockSizes,
    default_block_sizes,
    ragged_paged_attention_tpu,
    ragged_paged_attention_tpu_decode,
)

__all__ = [
    "SUPPORTED_HEAD_DIMS",
    "BlockSizes",
    "default_block_sizes",
    "ragged_paged_attention_tpu",
    "ragged_paged_attention_tpu_decode",
]
