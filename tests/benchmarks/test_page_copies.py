"""The page-copy benchmark runs small and reports both directions over the bytes it
copies (the copies' results are checked in tests/engine/test_host_tier.py)."""

from benchmarks import page_copies


def test_a_small_round_trip_reports_both_directions():
    r = page_copies.measure(layers=2, kv_heads=2, head_dim=64, page_size=8, pages=4, repeats=1)
    assert r["bytes"] == 4 * 2 * (2 * 8 * 128 * 2)  # pages x layers x one bf16 page's bytes
    assert r["to_host_gb_s"] > 0 and r["to_device_gb_s"] > 0
