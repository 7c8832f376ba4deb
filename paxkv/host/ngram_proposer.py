"""Prompt-lookup (n-gram) proposals for speculative decoding. No JAX.

`paxkv.host.speculative` asks it for each decoding sequence's proposals.

The proposal for a sequence of tokens `t[0:L]` follows vLLM's `prompt_lookup_min/max`
rule: for n from `max_n` down to `min_n`, take the suffix `t[L-n:L]`, find its most
recent earlier occurrence `t[i:i+n]` (i < L - n), and propose the k tokens that followed
it, `t[i+n:i+n+k]`; the first n that matches wins, and no match proposes nothing. Where
that runs past the sequence's end the proposal goes on copying itself (as an LZ77 copy
overlaps its output: proposal j is `t'[i+n+j]` of the sequence extended by the proposal),
so a repeating run proposes k tokens of its period rather than the few tokens between
the match and the end.
"""

from __future__ import annotations

from collections.abc import Iterable


class NgramProposer:
    """One sequence's n-gram index and the proposals it answers.

    The index maps every n-gram (min_n <= n <= max_n) of the tokens seen, except the
    current suffix, to the position of the token that followed its latest occurrence. It
    is updated as tokens are appended, so `extend` costs O(new tokens * max_n^2) and
    `propose` O(max_n^2 + k), whatever the sequence's length; memory is O(L * number of
    n). Rejected speculative tokens are never appended (only accepted ones are), so the
    index never needs to shrink; a preempted sequence keeps its tokens and its index.

    Args:
      min_n: shortest suffix to match (>= 1).
      max_n: longest suffix to match (>= min_n).
      tokens: the sequence so far (prompt, then output).
    """

    def __init__(self, min_n: int, max_n: int, tokens: Iterable[int] = ()) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n=}, {max_n=}")
        self.min_n = min_n
        self.max_n = max_n
        self._tokens: list[int] = []
        # n -> n-gram -> position of the token after its latest occurrence (not the suffix)
        self._next: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(min_n, max_n + 1)}
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self._tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        """Appends `tokens` to the sequence (accepted output tokens, in order)."""
        for token in tokens:
            self._tokens.append(int(token))
            end = len(self._tokens) - 1  # the new token's position
            # The n-gram ending just before it stops being the suffix and gains a follower.
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self._next[n][tuple(self._tokens[end - n : end])] = end

    def propose(self, k: int) -> list[int]:
        """`k` proposed next tokens, or none when no suffix of min_n..max_n tokens
        occurred earlier (or k = 0); see the module docstring for the rule."""
        if k < 0:
            raise ValueError(f"{k=} must be >= 0")
        tokens = self._tokens
        length = len(tokens)
        if k == 0:
            return []
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            start = self._next[n].get(tuple(tokens[length - n :]))
            if start is not None:
                out = tokens[start : start + k]
                period = length - start  # past the end, the proposal repeats itself
                for j in range(len(out), k):
                    out.append(out[j - period])
                return out
        return []
