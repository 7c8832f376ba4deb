"""`paxkv.engine.metrics.LatencySummary`: its ring of recent samples keeps what a bounded queue
of the same window would, whatever the sizes of the batches it is given."""

import collections

import numpy as np
import pytest

from paxkv.engine import metrics
from paxkv.engine.metrics import LatencySummary


@pytest.mark.parametrize("seed", range(4))
def test_the_ring_holds_the_newest_window(monkeypatch, seed):
    monkeypatch.setattr(metrics, "_WINDOW", 50)
    rng = np.random.default_rng(seed)
    summary, reference, total = LatencySummary(), collections.deque(maxlen=50), 0.0
    for _ in range(40):
        if rng.random() < 0.3:
            x = float(rng.random())
            summary.add(x)
            reference.append(x)
            total += x
        else:  # batches below, at and above the window, as lists and arrays
            x = rng.random(int(rng.choice([0, 1, 7, 49, 50, 51, 120])))
            summary.extend(x if rng.random() < 0.5 else x.tolist())
            reference.extend(x.tolist())
            total += float(x.sum())
        got = summary.summary()
        want = np.percentile(np.array(reference), [50, 90, 99]) if reference else [None] * 3
        for key, value in zip(("p50", "p90", "p99"), want, strict=True):
            assert got[key] == pytest.approx(value) if value is not None else got[key] is None
        assert summary.total == pytest.approx(total)
        assert sorted(summary._ring[: min(summary.count, 50)]) == sorted(reference)


def test_an_empty_summary_is_none():
    assert LatencySummary().summary() == {"p50": None, "p90": None, "p99": None, "mean": None}


def test_on_tokens_counts_first_tokens_but_times_only_the_others():
    # A list (None: a sequence's first token) and an array (NaN: the same) count alike.
    as_list, as_array = metrics.EngineMetrics(), metrics.EngineMetrics()
    gaps = [None, 0.5, 0.25, None, 1.0]
    as_list.on_tokens(gaps)
    as_array.on_tokens(np.array(gaps, np.float64))
    as_array.on_tokens(np.array([2.0]))
    as_list.on_tokens([2.0])
    for m in (as_list, as_array):
        itl = m.latency["inter_token_latency_seconds"]
        assert m.generation_tokens == 6
        assert itl.count == 4 and itl.total == pytest.approx(3.75)
        assert itl.summary()["p50"] == pytest.approx(0.75)
