"""Mistral 7B v0.1 on one 80 GiB accelerator (an H100): 13.5 GiB of bf16 weights."""

from paxkv.configs.setup import ServingSetup
from paxkv.engine import EngineConfig
from paxkv.models.llama_config import MISTRAL_7B

# 128 KiB of KV per token: 24576 pages of 16 tokens are 48 GiB. Every layer has the
# 4096-token sliding window, so a sequence holds at most about 4096 tokens' pages
# (`paxkv.host.kv_groups`; `hybrid_kv_cache=False` keeps every token resident).
SETUP = ServingSetup(
    name="mistral-7b",
    model=MISTRAL_7B.replace(scan_layers=True),  # compiles one layer per shape
    engine=EngineConfig(
        num_pages=24576,
        page_size=16,
        max_num_seqs=256,
        max_num_batched_tokens=8192,
        max_model_len=8192,
    ),
)
