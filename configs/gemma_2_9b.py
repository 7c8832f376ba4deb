"""Gemma 2 9B on one 80 GiB accelerator (an H100): 17.2 GiB of bf16 weights.

Sliding-window (4096) and global layers alternate: with the hybrid page allocator
(`paxkv.host.kv_groups`, on by default) the 21 window layers hold only the pages of
their window, and a page holds 21 layers (one of each group) instead of 42.
"""

from paxkv.configs.setup import ServingSetup
from paxkv.engine import EngineConfig
from paxkv.models.gemma_config import GEMMA_2_9B

# 21 slots x 8 KV heads x 256 x 2 (K, V) x 2 bytes x 16 tokens = 2.6 MiB a page:
# 20480 pages are 52.5 GiB.
SETUP = ServingSetup(
    name="gemma-2-9b",
    model=GEMMA_2_9B.replace(scan_layers=True),  # compiles one period per shape
    engine=EngineConfig(
        num_pages=20480,
        page_size=16,
        max_num_seqs=256,
        max_num_batched_tokens=8192,
        max_model_len=8192,
    ),
)
