"""Request lengths the tools plan and measure with: one log-normal length distribution.

Chat traffic (ShareGPT) has lengths with a long right tail, which a log-normal models
well: `LengthDistribution(median, sigma, lo, hi)` draws whole token counts from one.
The presets are the distributions the tools use, as values. `Workload` is the planner's
description of a workload, prompt plus output lengths, as the capacity planner samples it.
Plain NumPy, no JAX.

    rng = np.random.default_rng(0)
    prompt_lens = SHAREGPT_PROMPT_LENS.sample(rng, 1000)  # i64[1000]
    Workload("sharegpt", prompt_len=128, output_len=128).lengths(max_model_len=8192)
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

ROUNDINGS = ("nearest", "down")
WORKLOAD_KINDS = ("sharegpt", "fixed")


@dataclasses.dataclass(frozen=True)
class LengthDistribution:
    """Log-normal lengths in whole tokens, clipped to `[lo, hi]` (`hi` None: no cap).

    `median` is the median before rounding (`exp` of the log lengths' mean) and `sigma`
    the standard deviation of the log lengths: 1.0 puts the 90th percentile at about
    3.6x the median. Each draw is rounded to the `rounding` whole token ("nearest", or
    "down" to the token below) before it is clipped.
    """

    median: float
    sigma: float
    lo: int = 1
    hi: int | None = None
    rounding: str = "nearest"

    def __post_init__(self) -> None:
        if not self.median > 0:
            raise ValueError(f"median={self.median} must be positive")
        if self.sigma < 0:
            raise ValueError(f"sigma={self.sigma} must be >= 0")
        if self.lo < 1 or (self.hi is not None and self.hi < self.lo):
            raise ValueError(f"lo={self.lo}, hi={self.hi} must satisfy 1 <= lo <= hi")
        if self.rounding not in ROUNDINGS:
            raise ValueError(f"rounding={self.rounding!r} must be one of {ROUNDINGS}")

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """`n` lengths drawn from `rng`, i64[n] in `[lo, hi]`."""
        x = rng.lognormal(math.log(self.median), self.sigma, n)
        x = np.rint(x) if self.rounding == "nearest" else np.floor(x)
        return np.clip(x, self.lo, self.hi).astype(np.int64)


# The load benchmark's ShareGPT-like requests (paxkv.measure.load_bench): prompts of
# median ~172 tokens (capped at max_model_len / 2 there), outputs of median ~122.
SHAREGPT_PROMPT_LENS = LengthDistribution(median=math.exp(5.15), sigma=1.0, lo=4, rounding="down")
SHAREGPT_OUTPUT_LENS = LengthDistribution(median=math.exp(4.8), sigma=0.9, lo=2, rounding="down")
# The CPU demo's ragged batch (paxkv.measure.ragged_batch_demo): prompts of median ~200 tokens.
DEMO_PROMPT_LENS = LengthDistribution(median=math.exp(5.3), sigma=1.0, rounding="down")


@dataclasses.dataclass(frozen=True)
class Workload:
    """A distribution of prompt and output lengths, in tokens, as the capacity planner sees it.

    "fixed": every request has `prompt_len` prompt and `output_len` output tokens.
    "sharegpt": chat-like, both log-normal with those medians and log-space standard
    deviation `sigma` (a long tail), each at least 1, the total capped at max_model_len;
    `num_samples` draws with `seed` estimate the expectations.
    """

    kind: str
    prompt_len: int
    output_len: int
    sigma: float = 1.0
    num_samples: int = 100_000
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind not in WORKLOAD_KINDS:
            raise ValueError(f"workload={self.kind!r} must be one of {WORKLOAD_KINDS}")
        for name in ("prompt_len", "output_len", "num_samples"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be positive")
        if self.sigma < 0:
            raise ValueError(f"sigma={self.sigma} must be >= 0")

    def lengths(self, max_model_len: int) -> np.ndarray:
        """Final sequence lengths (prompt + output), i64[N] in [1, max_model_len]."""
        if max_model_len < 2:
            raise ValueError(f"max_model_len={max_model_len} must be at least 2")
        if self.kind == "fixed":
            total = self.prompt_len + self.output_len
            if total > max_model_len:
                raise ValueError(
                    f"prompt_len={self.prompt_len} + output_len={self.output_len} = {total} "
                    f"exceeds max_model_len={max_model_len}"
                )
            return np.array([total], np.int64)
        rng = np.random.default_rng(self.seed)
        prompt = LengthDistribution(self.prompt_len, self.sigma).sample(rng, self.num_samples)
        output = LengthDistribution(self.output_len, self.sigma).sample(rng, self.num_samples)
        return np.minimum(prompt + output, max_model_len)

    def describe(self) -> str:
        """One line saying what the workload is, for the planner's report."""
        if self.kind == "fixed":
            return f"fixed: {self.prompt_len} prompt + {self.output_len} output tokens"
        return (
            f"sharegpt: log-normal prompt (median {self.prompt_len}) + output (median "
            f"{self.output_len}) tokens, sigma {self.sigma}; {self.num_samples} samples, seed {self.seed}"
        )
