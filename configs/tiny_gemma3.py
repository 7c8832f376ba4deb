"""A Gemma-3-shaped byte-level toy with random weights (5 window-128 layers, 1 global):
runs on the CPU with no downloads; the hybrid page allocator's benchmark model."""

from paxkv.configs.setup import ServingSetup
from paxkv.engine import EngineConfig
from paxkv.models.gemma_config import TINY_GEMMA3

SETUP = ServingSetup(
    name="tiny-gemma3",
    model=TINY_GEMMA3,
    engine=EngineConfig(
        num_pages=1536,  # 6 groups over 1 slot: a page holds one layer
        page_size=16,
        max_num_seqs=8,
        max_num_batched_tokens=128,
        max_model_len=4096,
    ),
    random_weights=True,
)
