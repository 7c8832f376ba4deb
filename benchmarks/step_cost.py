"""XLA's cost analysis of one compiled forward step of an engine: FLOPs and bytes."""

from __future__ import annotations

from typing import Any

from paxkv.engine import Engine, EngineConfig


def forward_cost(model: Any, *, rows: int, seqs: int, **engine: Any) -> dict[str, float]:
    """FLOPs and bytes accessed of the engine's forward program for a step of `rows`
    packed rows over `seqs` sequences of up to 32 tokens (2 pages of 16), as this
    backend compiles it; `engine`: more `EngineConfig` fields (LoRA slots, ...)."""
    config = EngineConfig(
        num_pages=2 * seqs + 1,
        page_size=16,
        max_model_len=32,
        max_num_seqs=seqs,
        max_num_batched_tokens=rows,
        token_buckets=(rows,),
        page_buckets=(2,),
        **engine,
    )
    program = Engine(model, config).runner._spec("forward", (rows, seqs, 2))
    cost = program.fn.lower(*program.args, **program.kwargs).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return {"flops": float(cost.get("flops", 0)), "bytes": float(cost.get("bytes accessed", 0))}
