"""The LoRA benchmark runs small: a step's FLOPs grow with the rank, not with the number
of slots, and a Zipf run over more adapters than slots loads and evicts them without a
compilation after warm-up."""

from benchmarks import lora


def test_step_flops_grow_with_the_rank_not_the_slots():
    base = lora.step_cost("tiny", rows=64, max_loras=0, rank=8)
    few = lora.step_cost("tiny", rows=64, max_loras=2, rank=8, method="gather")
    many = lora.step_cost("tiny", rows=64, max_loras=16, rank=8, method="gather")
    wide = lora.step_cost("tiny", rows=64, max_loras=2, rank=16, method="gather")
    assert base["flops"] < few["flops"] == many["flops"] < wide["flops"]


def test_zipf_run_loads_and_evicts_without_compiling():
    r = lora.zipf_run("tiny", adapters=12, requests=24, max_loras=2, rank=4, lora=True)
    assert r["distinct_adapters"] > 2 and r["evictions"] > 0
    assert r["loads"] == r["evictions"] + 2
    assert r["compilations_after_warmup"] == 0 and r["tok_per_s"] > 0
