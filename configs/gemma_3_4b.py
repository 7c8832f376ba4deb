"""Gemma 3 4B (text) on one 80 GiB accelerator (an H100): 7.2 GiB of bf16 weights.

Five 1024-token sliding-window layers for every global one: with the hybrid page
allocator (`paxkv.host.kv_groups`, on by default) a window layer holds only the pages of
its window, and a page holds 5 layers (the cache is 5 slots shared by 7 layer groups)
instead of 34. `paxkv-plan --config=gemma-3-4b --device=H100` shows the difference.
"""

from paxkv.configs.setup import ServingSetup
from paxkv.engine import EngineConfig
from paxkv.models.gemma_config import GEMMA_3_4B

# 5 slots x 4 KV heads x 256 x 2 (K, V) x 2 bytes x 16 tokens = 320 KiB a page:
# 196608 pages are 60 GiB.
SETUP = ServingSetup(
    name="gemma-3-4b",
    model=GEMMA_3_4B.replace(scan_layers=True),  # compiles one period per shape
    engine=EngineConfig(
        num_pages=196608,
        page_size=16,
        max_num_seqs=256,
        max_num_batched_tokens=8192,
        max_model_len=32768,
    ),
)
