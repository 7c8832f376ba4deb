"""Ragged paged attention for NVIDIA GPUs: Pallas kernels with the Triton lowering."""

from .ragged_paged_attention import BlockSizes, ragged_paged_attention_gpu

__all__ = ["BlockSizes", "ragged_paged_attention_gpu"]
