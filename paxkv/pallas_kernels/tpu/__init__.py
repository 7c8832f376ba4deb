"""TPU (Mosaic) kernels."""

from .block_sizes import BlockSizes
from .ragged_paged_attention import SUPPORTED_HEAD_DIMS, ragged_paged_attention_tpu

__all__ = ["SUPPORTED_HEAD_DIMS", "BlockSizes", "ragged_paged_attention_tpu"]
