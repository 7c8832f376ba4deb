"""Llama 3.1 8B on one 80 GiB accelerator (an H100): 15 GiB of bf16 weights."""

from paxkv.configs.setup import ServingSetup
from paxkv.engine import EngineConfig
from paxkv.models.llama_config import LLAMA_3_1_8B

# 128 KiB of KV per token: 24576 pages of 16 tokens are 48 GiB. `paxkv-plan
# --config=llama-3.1-8b --device=H100` gives the pages that fit there.
SETUP = ServingSetup(
    name="llama-3.1-8b",
    model=LLAMA_3_1_8B.replace(scan_layers=True),  # compiles one layer per shape
    engine=EngineConfig(
        num_pages=24576,
        page_size=16,
        max_num_seqs=256,
        max_num_batched_tokens=8192,
        max_model_len=8192,
    ),
)
