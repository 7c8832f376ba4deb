"""The MoE-vs-dense benchmark runs at tiny sizes and reports every column."""

from benchmarks import moe
from paxkv.planner import parameters


def test_measures_equal_active_parameters_and_every_column():
    sparse, dense = moe.configs(hidden=64, expert_size=32, experts=4, top_k=2, layers=1)
    assert dense.intermediate_size == 2 * sparse.intermediate_size
    router = sparse.num_layers * sparse.hidden_size * sparse.num_experts
    assert parameters.active_parameters(sparse) == parameters.num_parameters(dense) + router
    result = moe.measure(sparse, dense, 4, iters=1)
    for key, _ in moe.COLUMNS:
        assert result[key]["cpu_s"] > 0 and result[key]["wall_s"] > 0 and result[key]["flops"] > 0
    assert moe.table_row(result).startswith("| 4 | ") and moe.table_row(result).count("|") == 10
