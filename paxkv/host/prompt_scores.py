"""Prompt logprobs on the host: which packed rows a step scores, and what came back. No JAX.

A sequence with `SamplingParams.prompt_logprobs` (or a score request) wants the
log-probability of its prompt token at every position p >= `first` given the tokens
before it: the model's output at row p - 1, read against target token p. A step that
computes positions [start, end) of the sequence therefore scores rows
`max(start, first - 1) .. min(end, num_prompt - 1)`, and the device gathers the target
logprob, its rank and the top-k there (`paxkv.engine.device.sampling.score`); full-vocabulary
logits never reach the host.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class PromptScores:
    """The logprobs of one sequence's prompt positions `first .. num_prompt - 1`,
    filled in as its prefill chunks run (a recompute fills them again, equal).

    Args:
      prompt_token_ids: the prompt (the targets are its tokens).
      first: the first position scored (>= 1: position 0 has nothing before it).
      k: top-k logprobs kept per position.
    """

    def __init__(self, prompt_token_ids: Sequence[int], first: int, k: int) -> None:
        num_prompt = len(prompt_token_ids)
        if not 1 <= first <= num_prompt:
            raise ValueError(f"first={first} must be in [1, {num_prompt}] (the prompt's length)")
        self.prompt_token_ids = prompt_token_ids
        self.first = first
        self.k = k
        n = num_prompt - first
        self.logprobs = np.full(n, np.nan, np.float32)  # f32[n]; NaN: not computed yet
        self.ranks = np.zeros(n, np.int32)  # i32[n]; 1: the most likely token
        self.top_ids = np.zeros((n, k), np.int32)  # i32[n, k]
        self.top_logprobs = np.zeros((n, k), np.float32)  # f32[n, k]
        self._missing = n

    @property
    def complete(self) -> bool:
        """Whether every scored position has its logprob."""
        return self._missing == 0

    @property
    def cacheable_tokens(self) -> int:
        """Leading tokens that may come from the prefix cache: those before the first
        row that must be computed (position first - 1)."""
        return self.first - 1

    def rows(self, start: int, end: int) -> tuple[int, int]:
        """`(lo, hi)`: the positions in [start, end) whose output rows are scored (row p
        targets prompt token p + 1); lo >= hi when none is."""
        return max(start, self.first - 1), min(end, len(self.prompt_token_ids) - 1)

    def targets(self, lo: int, hi: int) -> list[int]:
        """The target tokens of rows `lo .. hi - 1`."""
        return self.prompt_token_ids[lo + 1 : hi + 1]

    def record(
        self,
        lo: int,
        logprobs: np.ndarray,  # f32[m]
        ranks: np.ndarray,  # i32[m]
        top_ids: np.ndarray,  # i32[m, >= k]
        top_logprobs: np.ndarray,  # f32[m, >= k]
    ) -> None:
        """Stores the results of rows `lo .. lo + m - 1` (prompt positions lo + 1 ..)."""
        i = lo + 1 - self.first
        m = len(logprobs)
        self._missing -= int(np.isnan(self.logprobs[i : i + m]).sum())
        self.logprobs[i : i + m] = logprobs
        self.ranks[i : i + m] = ranks
        self.top_ids[i : i + m] = top_ids[:, : self.k]
        self.top_logprobs[i : i + m] = top_logprobs[:, : self.k]
