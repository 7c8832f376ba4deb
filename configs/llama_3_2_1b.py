"""Llama 3.2 1B on one 16 GiB accelerator (a TPU v5e): 2.3 GiB of bf16 weights."""

from paxkv.configs.setup import ServingSetup
from paxkv.engine import EngineConfig
from paxkv.models.llama_config import LLAMA_3_2_1B

# 32 KiB of KV per token: 16384 pages of 16 tokens are 8 GiB. `paxkv-plan
# --config=llama-3.2-1b --device=v5e` gives the pages that fit there.
SETUP = ServingSetup(
    name="llama-3.2-1b",
    model=LLAMA_3_2_1B.replace(scan_layers=True),  # compiles one layer per shape
    engine=EngineConfig(
        num_pages=16384,
        page_size=16,
        max_num_seqs=128,
        max_num_batched_tokens=4096,
        max_model_len=8192,
    ),
)
