"""The host-step benchmark replays a trace over the fake runner and checks itself."""

import json

from benchmarks import host_step
from paxkv.engine import EngineConfig


def at_max_steps(result, row):
    return result["per_step_us"]["cpu"][row]["steps"]


def test_replays_a_trace_to_the_end(tmp_path):
    trace = host_step.make_trace(60, seed=1, arrival_rate=8.0, shared_prefix=32)
    assert len(trace["requests"]) == 60
    assert all(r["prompt"][:32] == trace["requests"][0]["prompt"][:32] for r in trace["requests"])
    config = EngineConfig(
        num_pages=512,
        page_size=16,
        max_num_seqs=16,
        max_num_batched_tokens=1024,
        max_model_len=4096,
        num_decode_steps=1,
        log_stats_interval_s=0.0,
    )
    result = host_step.run(trace, config)
    assert result["all_finished"] and result["pages_in_use_at_end"] == 0
    assert result["peak_running"] == 16 and result["prefix_hit_rate"] > 0
    at_max = result["per_step_us"]["cpu"]["at_max_num_seqs"]
    assert at_max["steps"] > 0 and at_max["p50"] > 0
    assert set(at_max) >= {"p50", "mean", "p99", "steps", "schedule", "outputs"}
    json.dumps(result)  # what --json_out writes
    # Two replays on new engines: the same steps twice, pooled.
    twice = host_step.run(trace, config, repeat=2)
    assert twice["all_finished"] and twice["steps"] == result["steps"]
    assert twice["repeat"] == 2
    for row in ("all", "at_max_num_seqs"):
        assert twice["per_step_us"]["cpu"][row]["steps"] == 2 * at_max_steps(result, row)


def test_schedule_parts_time_the_pieces_inside_schedule_and_restore_them():
    from benchmarks import schedule_parts
    from paxkv.host.scheduler import Scheduler

    schedule = Scheduler.schedule
    trace = host_step.make_trace(40, seed=2, arrival_rate=4.0)
    config = EngineConfig(
        num_pages=512,
        page_size=16,
        max_num_seqs=8,
        max_num_batched_tokens=1024,
        max_model_len=4096,
        num_decode_steps=1,
        log_stats_interval_s=0.0,
    )
    with schedule_parts.timed_schedule() as steps:
        result = host_step.run(trace, config)
    assert result["all_finished"]
    assert Scheduler.schedule is schedule  # every piece put back
    m = schedule_parts.medians(steps, running=8)
    assert m["steps"] > 0
    plan, page_work = m["running decodes: plan"], m["  page work"]
    assert 0 < page_work <= plan <= m["schedule"]
    for _, parts in steps:  # nested pieces never exceed the call they are inside
        assert parts.get("  page work", 0) <= parts.get("running decodes: plan", 0)
        assert (
            parts.get("running decodes: plan", 0) + parts.get("admissions", 0) <= parts["schedule"]
        )
