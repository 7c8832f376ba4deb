"""The byte-level toy model with random weights: runs on the CPU with no downloads."""

from paxkv.configs.setup import ServingSetup
from paxkv.engine import EngineConfig
from paxkv.models.llama_config import TINY

SETUP = ServingSetup(
    name="tiny",
    model=TINY,
    engine=EngineConfig(
        num_pages=256,  # 4096 token slots
        page_size=16,
        max_num_seqs=8,
        max_num_batched_tokens=128,
        # Below EngineConfig's default (LLM's): tiny-py, this model trained, saw 256-byte
        # windows, and shorter sequences need fewer step shapes: a quick warm-up on the CPU.
        max_model_len=512,
    ),
    random_weights=True,
)
