"""The tools' length distribution: its presets reproduce the numbers the tools drew before."""

import dataclasses
import math

import numpy as np
import pytest

from paxkv.planner import workloads
from paxkv.planner.workloads import LengthDistribution


def test_rounding_and_clipping_by_hand():
    # sigma 0: every draw is the median itself, then rounded and clipped.
    rng = np.random.default_rng(0)
    assert LengthDistribution(100.6, 0.0).sample(rng, 3).tolist() == [101] * 3
    assert LengthDistribution(100.6, 0.0, rounding="down").sample(rng, 3).tolist() == [100] * 3
    assert LengthDistribution(100.6, 0.0, hi=50).sample(rng, 2).tolist() == [50, 50]
    assert LengthDistribution(0.2, 0.0, lo=4).sample(rng, 2).tolist() == [4, 4]


def test_presets_are_the_tools_former_draws():
    # The expressions the load benchmark and the demo drew their lengths with.
    rng, ref = np.random.default_rng(7), np.random.default_rng(7)
    capped = dataclasses.replace(workloads.SHAREGPT_PROMPT_LENS, hi=2048)
    prompt = capped.sample(rng, 500)
    np.testing.assert_array_equal(
        prompt, np.clip(ref.lognormal(5.15, 1.0, 500), 4, 2048).astype(int)
    )
    output = workloads.SHAREGPT_OUTPUT_LENS.sample(rng, 500)
    np.testing.assert_array_equal(
        output, np.clip(ref.lognormal(4.8, 0.9, 500), 2, None).astype(int)
    )
    demo = workloads.DEMO_PROMPT_LENS.sample(rng, 500)
    np.testing.assert_array_equal(
        demo, np.clip(ref.lognormal(5.3, 1.0, 500).astype(np.int64), 1, None)
    )
    assert workloads.SHAREGPT_PROMPT_LENS.median == pytest.approx(172.4, abs=0.1)
    assert math.log(workloads.DEMO_PROMPT_LENS.median) == 5.3


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(median=0.0), "median=0.0 must be positive"),
        (dict(sigma=-0.5), "sigma=-0.5 must be >= 0"),
        (dict(lo=0), "lo=0"),
        (dict(lo=8, hi=4), "lo=8, hi=4"),
        (dict(rounding="up"), "rounding='up'"),
    ],
)
def test_bad_distribution(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LengthDistribution(**(dict(median=100.0, sigma=1.0) | kwargs))
