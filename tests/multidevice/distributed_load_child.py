"""One process of the two-process loading test (`test_distributed_loading.py`).

    python distributed_load_child.py CHECKPOINT PORT PROCESS_ID   # PROCESS_ID -1: one device

Loads the safetensors checkpoint (onto `model:8` over both processes' devices, or one
device), counts the bytes it reads per tensor, decodes greedily, and prints one JSON
line: `{"bytes": {tensor: bytes read}, "tokens": [[...], ...]}`.
"""

import json
import sys

import jax

from paxkv import SamplingParams
from paxkv.engine import Engine, EngineConfig
from paxkv.models.weights import load_hf_checkpoint
from paxkv.sharding import shardings
from paxkv.sharding.mesh_shape import MeshShape

PROMPTS = [[5, 9, 200, 7], list(range(1, 30)), [42] * 17]


def main(checkpoint: str, port: int, process_id: int) -> None:
    mesh = None
    if process_id >= 0:
        jax.distributed.initialize(f"localhost:{port}", num_processes=2, process_id=process_id)
        assert jax.device_count() == 8 and jax.local_device_count() == 4
        mesh = shardings.make_mesh(MeshShape.parse("model:8"))
    stats: dict[str, int] = {}
    _, model = load_hf_checkpoint(checkpoint, mesh=mesh, stats=stats)
    config = EngineConfig(
        num_pages=64,
        page_size=8,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        max_model_len=128,
        token_buckets=(64,),
    )
    engine = Engine(model, config, mesh=mesh)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    for i, p in enumerate(PROMPTS):
        engine.add_request(str(i), {"prompt_token_ids": p}, params)
    done = engine.run_until_done()
    tokens = [list(done[str(i)].outputs[0].token_ids) for i in range(len(PROMPTS))]
    print(json.dumps({"bytes": stats, "tokens": tokens}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
