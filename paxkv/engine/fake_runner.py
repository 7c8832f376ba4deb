"""A step runner with no model and no device (`FakeRunner`): the whole host path of the
engine (scheduling, batching, outputs, speculation, async scheduling) run and tested
without compiling anything, its tokens a fixed function of the inputs (`fake_token`)."""

from __future__ import annotations

import types
from collections.abc import Sequence

import jax
import numpy as np

from paxkv.engine.config import EngineConfig
from paxkv.engine.device.sampling import Sampled, Scored, Speculated
from paxkv.engine.runner import Deferred, StepRunner
from paxkv.host.batch import HostBatch
from paxkv.host.kv_groups import KVCacheGroups


def fake_token(tokens: np.ndarray, positions: np.ndarray, vocab_size: int) -> np.ndarray:
    """The fake runner's next token after `tokens` at `positions`: a fixed mix of both,
    modulo the vocabulary (i64 arithmetic, so it never overflows)."""
    t = tokens.astype(np.int64) * 1_000_003 + positions.astype(np.int64) * 7_919 + 12_345
    return ((t ^ (t >> 13)) % vocab_size).astype(np.int32)


def masked(tokens: np.ndarray, allowed: np.ndarray) -> np.ndarray:
    """`tokens` (i32[n]) with each one its row's mask (`allowed`, i32[>= n, W]) leaves
    out replaced by the first allowed token after it, cyclically (kept where none is)."""
    out = tokens.copy()
    for i, t in enumerate(tokens.tolist()):
        bits = np.unpackbits(allowed[i].view(np.uint8), bitorder="little")
        if bits[t] or not bits.any():
            continue
        ids = np.flatnonzero(bits)
        after = ids[ids > t]
        out[i] = int(after[0] if len(after) else ids[0])
    return out


class FakeRunner(StepRunner):
    """A step runner with no model and no device: each sequence's next token is
    `fake_token(its last input token, that token's position)`, its logprob -1, and its
    top logprobs the next `max_logprobs` ids after it; a scored row's target likewise
    (logprob -1, rank 1, top ids the target and those after it); speculative proposals
    are accepted while each equals the fake token of the row before it, as a greedy
    target would. Deterministic and batch-independent, like the real greedy step, so
    the engine's host path runs unchanged over it.

    Args:
      vocab_size: the fake model's vocabulary.
      config: the engine's settings (max_num_seqs, max_logprobs, num_decode_steps).
      eos_token_ids: the fake model's EOS tokens.
      max_position_embeddings: the fake model's position limit (None: none).
      layer_windows: the fake model's sliding window per layer (None: global), which
        the engine groups layers by (`paxkv.host.kv_groups`); default: one global layer.
      accept_fraction: None, the greedy rule above; else each sequence accepts
        `round(fraction * proposals)` of its proposals whatever they are, and then the
        fake token after the last accepted one (for host-path benchmarks).
    """

    def __init__(
        self,
        vocab_size: int,
        config: EngineConfig,
        *,
        eos_token_ids: tuple[int, ...] = (),
        max_position_embeddings: int | None = None,
        layer_windows: tuple[int | None, ...] = (None,),
        accept_fraction: float | None = None,
    ) -> None:
        self.accept_fraction = accept_fraction
        self.kv_groups = KVCacheGroups.from_windows(layer_windows, hybrid=config.hybrid_kv_cache)
        self.model_config = types.SimpleNamespace(
            vocab_size=vocab_size,
            eos_token_ids=eos_token_ids,
            max_position_embeddings=max_position_embeddings,
        )
        self.config = config
        # What the last step left the next (`paxkv.engine.device.step.Carried`), on the host.
        self._prev = np.zeros(config.max_num_seqs, np.int32)
        self._rejected = np.zeros(config.max_num_seqs, np.int32)

    def _samples(self, tokens: np.ndarray, rows: int) -> Sampled:
        k = self.config.max_logprobs
        vocab = self.model_config.vocab_size
        padded = np.zeros(rows, np.int32)
        padded[: len(tokens)] = tokens
        top = (padded[:, None] + np.arange(k, dtype=np.int32)[None, :]) % vocab
        return Sampled(
            tokens=padded,
            logprobs=np.full(rows, -1.0, np.float32),
            top_ids=top,
            top_logprobs=np.full((rows, k), -1.0, np.float32),
            ranks=np.ones(rows, np.int32),
        )

    def _carried(self, hb: HostBatch) -> tuple[np.ndarray, np.ndarray]:
        """Each sequence's last known token, with the previous step's in place where it
        was fed (`token_src`), and how far back its positions move: the proposals the
        previous step rejected of it (`paxkv.engine.device.step.with_carried`)."""
        n = int(hb.num_seqs[0])
        src = hb.token_src[hb.logits_indices[:n]]
        fed = src >= 0
        inputs = np.where(fed, self._prev[np.maximum(src, 0)], hb.tokens[hb.logits_indices[:n]])
        return inputs, np.where(fed, self._rejected[np.maximum(src, 0)], 0)

    def dispatch(self, hb: HostBatch) -> Sampled | Deferred:
        """Computes the step's tokens on the host; with token masks (`HostBatch.allowed`)
        a `Deferred` step, each masked sequence taking the first allowed token at or
        after its fake token (cyclically)."""
        last = hb.logits_indices[: int(hb.num_seqs[0])]
        inputs, shift = self._carried(hb)
        out = fake_token(inputs, hb.positions[last] - shift, self.model_config.vocab_size)
        if hb.allowed.shape[1]:
            k1 = 1 + hb.draft_tokens.shape[1]
            return Deferred(
                hb.allowed,
                lambda mask: self._step(hb, masked(out, mask[::k1]), shift, mask),
                positions=k1,
            )
        return self._step(hb, out, shift)

    def _step(
        self, hb: HostBatch, out: np.ndarray, shift: np.ndarray, masks: np.ndarray | None = None
    ) -> Sampled:
        sampled = self._samples(out, self.config.max_num_seqs)
        self._prev, self._rejected = sampled.tokens, np.zeros_like(self._rejected)
        if hb.draft_tokens.shape[1]:
            spec = self._verify(hb, out, shift, masks)
            sampled = sampled.replace(spec=spec)
            self._prev = spec.tokens[np.arange(len(spec.tokens)), spec.num_accepted]
            self._rejected = np.zeros_like(self._rejected)
            self._rejected[: len(hb.draft_counts)] = hb.draft_counts
            self._rejected -= spec.num_accepted
        if hb.score_rows.shape[0]:
            scored = self._samples(hb.score_targets, hb.score_rows.shape[0])
            sampled = sampled.replace(
                scored=Scored(scored.logprobs, scored.ranks, scored.top_ids, scored.top_logprobs)
            )
        return sampled

    def _verify(
        self, hb: HostBatch, first: np.ndarray, shift: np.ndarray, masks: np.ndarray | None
    ) -> Speculated:
        """The greedy verdict on each sequence's proposals: it accepts them while each
        equals the fake token after the row before it (the first allowed one after it,
        with token masks at each position: `masks`, `HostBatch.allowed`), then emits the
        fake token."""
        rows, k = self.config.max_num_seqs, hb.draft_tokens.shape[1]
        n = len(first)
        tokens = np.full((rows, k + 1), -1, np.int32)
        accepted = np.zeros(rows, np.int32)
        for s in range(n):
            count, row = int(hb.draft_counts[s]), int(hb.logits_indices[s])
            drafts = hb.draft_tokens[s, :count]
            # The target's token after each of the rows row .. row + count.
            target = fake_token(
                hb.tokens[row : row + count + 1],
                hb.positions[row : row + count + 1] - shift[s],
                self.model_config.vocab_size,
            )
            target[0] = first[s]
            if masks is not None:
                target[1:] = masked(target[1:], masks[s * (k + 1) + 1 : (s + 1) * (k + 1)])
            a = 0
            if self.accept_fraction is not None:
                a = round(self.accept_fraction * count)
            else:
                while a < count and drafts[a] == target[a]:
                    a += 1
            accepted[s] = a
            tokens[s, : a + 1] = [*drafts[:a], target[a]]
        per_token = self._samples(np.maximum(tokens, 0).reshape(-1), rows * (k + 1))
        scores = Scored(
            per_token.logprobs, per_token.ranks, per_token.top_ids, per_token.top_logprobs
        )
        scores = jax.tree.map(lambda a: a.reshape(rows, k + 1, *a.shape[1:]), scores)
        return Speculated(accepted, tokens, scores)

    def fetch(self, handle: Sampled) -> Sampled:
        """The samples themselves (they are on the host already)."""
        return handle

    def decode_loop(
        self, hb: HostBatch, stop_ids: Sequence[tuple[int, ...]], limits: Sequence[int]
    ) -> tuple[Sampled, np.ndarray]:
        """The N-step loop's semantics on the host: each live sequence feeds its token to
        the next iteration until it samples a stop id or reaches its limit."""
        n = int(hb.num_seqs[0])
        size = hb.logits_indices.shape[0]
        steps_n = self.config.num_decode_steps
        current, shift = self._carried(hb)
        current = current.astype(np.int32)
        positions = hb.kv_lens[:n].astype(np.int64) - 1 - shift
        active = np.ones(n, bool)
        tokens = np.full((steps_n, size), -1, np.int32)
        valid = np.zeros((steps_n, size), bool)
        for i in range(steps_n):
            new = fake_token(current, positions, self.model_config.vocab_size)
            tokens[i, :n] = np.where(active, new, -1)
            valid[i, :n] = active
            stop = np.array([int(t) in s for t, s in zip(new, stop_ids, strict=True)], bool) | (
                i + 1 >= np.asarray(limits, np.int64)
            )
            still = active & ~stop
            current = np.where(still, new, current)
            positions = positions + still
            active = still
        per_step = [self._samples(tokens[i, :n], size) for i in range(steps_n)]
        stacked = jax.tree.map(lambda *a: np.stack(a), *per_step)
        stacked = stacked.replace(tokens=tokens)
        self._prev = np.zeros_like(self._prev)
        self._prev[:n] = current
        self._rejected = np.zeros_like(self._rejected)
        return stacked, valid

    def fetch_loop(self, handle: tuple[Sampled, np.ndarray]) -> tuple[Sampled, np.ndarray]:
        """The loop's samples themselves (on the host already)."""
        return handle
