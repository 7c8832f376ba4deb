"""Qwen3 8B on one 80 GiB accelerator (an H100): 15.3 GiB of bf16 weights."""

from paxkv.configs.setup import ServingSetup
from paxkv.engine import EngineConfig
from paxkv.models.llama_config import QWEN3_8B

# 36 layers x 8 KV heads x 128 x 2 (K, V) x 2 bytes = 144 KiB of KV per token:
# 24576 pages of 16 tokens are 54 GiB.
SETUP = ServingSetup(
    name="qwen3-8b",
    model=QWEN3_8B.replace(scan_layers=True),  # compiles one layer per shape
    engine=EngineConfig(
        num_pages=24576,
        page_size=16,
        max_num_seqs=256,
        max_num_batched_tokens=8192,
        max_model_len=8192,
    ),
)
