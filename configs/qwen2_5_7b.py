"""Qwen2.5 7B on one 80 GiB accelerator (an H100): 14.2 GiB of bf16 weights."""

from paxkv.configs.setup import ServingSetup
from paxkv.engine import EngineConfig
from paxkv.models.llama_config import QWEN2_5_7B

# Four KV heads, 28 layers: 56 KiB of KV per token, so 49152 pages of 16 tokens are 42 GiB.
SETUP = ServingSetup(
    name="qwen2.5-7b",
    model=QWEN2_5_7B.replace(scan_layers=True),  # compiles one layer per shape
    engine=EngineConfig(
        num_pages=49152,
        page_size=16,
        max_num_seqs=256,
        max_num_batched_tokens=8192,
        max_model_len=8192,
    ),
)
