"""The speculator's adaptive rule and counts, on the host alone."""

import dataclasses
import math

import pytest

from paxkv.host.request import SamplingParams
from paxkv.host.sequence import SequenceState
from paxkv.host.speculative import PAUSE_STEPS, SpeculativeConfig, Speculator


def _seq(tokens):
    return SequenceState("s", "s", 0, list(tokens), SamplingParams(max_tokens=100), 0, 0.0)


def test_depth_follows_the_estimated_acceptance():
    spec = Speculator(SpeculativeConfig(num_speculative_tokens=8, min_acceptance=0.2), (1024,))
    seq = _seq([1, 2, 3] * 4)
    spec.new_step(1)
    assert spec.propose(seq, 100) == (1, 2, 3, 1, 2, 3, 1, 2)  # alpha starts at 1: all k
    spec.on_verified(seq, 8, 8)
    assert len(spec.propose(seq, 100)) == 8
    assert spec.propose(seq, 3) == (1, 2, 3)  # never more than asked
    # Rejections lower alpha; the depth is floor(log 0.2 / log alpha).
    for _ in range(3):
        spec.on_verified(seq, 8, 1)
    state = spec._seqs[seq]
    alpha = state.accepted / (state.accepted + state.rejected)
    assert len(spec.propose(seq, 100)) == min(8, int(math.log(0.2) / math.log(alpha)))
    assert 0 < len(spec.propose(seq, 100)) < 8


def test_pause_then_probe_with_one():
    spec = Speculator(SpeculativeConfig(num_speculative_tokens=4, min_acceptance=0.5), (1024,))
    seq = _seq([5, 6] * 5)
    spec.new_step(1)
    while spec.propose(seq, 100):  # all rejected until the depth reaches 0
        spec.on_verified(seq, len(spec.propose(seq, 100)), 0)
    paused_at = spec._step
    resume = -(-(paused_at + PAUSE_STEPS) // PAUSE_STEPS) * PAUSE_STEPS  # aligned
    while spec._step + 1 < resume:
        spec.new_step(1)
        assert spec.propose(seq, 100) == ()
    spec.new_step(1)
    assert len(spec.propose(seq, 100)) == 1  # the probe
    spec.on_verified(seq, 1, 0)  # rejected: a pause twice as long
    resume = spec._step + 2 * PAUSE_STEPS
    while spec._step + 1 < resume:
        spec.new_step(1)
        assert spec.propose(seq, 100) == ()
    spec.new_step(1)
    assert len(spec.propose(seq, 100)) == 1


def test_counts_and_disable_by_batch_size():
    spec = Speculator(SpeculativeConfig(num_speculative_tokens=3, disable_by_batch_size=4), (64,))
    assert spec.new_step(4) and not spec.new_step(5)
    seq = _seq([1, 1, 1])
    spec.on_verified(seq, 3, 2)
    spec.on_verified(seq, 2, 0)
    s = spec.stats()
    assert s["spec_decode_num_drafts"] == 2
    assert s["spec_decode_num_draft_tokens"] == 5
    assert s["spec_decode_num_accepted_tokens"] == 2
    assert s["spec_decode_mean_accepted_length"] == pytest.approx(2.0)
    assert s["spec_decode_acceptance_per_position"] == [0.5, 0.5, 0.0]
    # Proposals fill the padding of the step's token bucket: a 40-token step in the
    # 64-token bucket has 24 spare rows (or all its budget left, with grow_token_bucket).
    assert spec.spare_tokens(40, 100) == 24
    assert spec.spare_tokens(64, 100) == 0
    grow = Speculator(SpeculativeConfig(grow_token_bucket=True), (64,))
    assert grow.spare_tokens(64, 100) == 100


def test_new_sequences_start_from_the_workloads_acceptance():
    spec = Speculator(SpeculativeConfig(num_speculative_tokens=4, min_acceptance=0.5), (64,))
    spec.new_step(1)
    first = _seq([1, 2] * 4)
    assert len(spec.propose(first, 100)) == 4  # nothing known yet: alpha 1
    for _ in range(20):  # the workload's drafts are all rejected
        spec.on_verified(_seq([1]), 4, 0)
    late = _seq([1, 2] * 4)
    assert spec.propose(late, 100) == ()  # starts paused, until the next aligned probe
    while spec._step % PAUSE_STEPS:
        spec.new_step(1)
    assert len(spec.propose(late, 100)) == 1


def test_replicas_stats_merge_from_counts():
    from paxkv.engine.metrics import merge_stats

    a = Speculator(SpeculativeConfig(num_speculative_tokens=2), (64,))
    b = Speculator(SpeculativeConfig(num_speculative_tokens=2), (64,))
    a.on_verified(_seq([1]), 2, 2)
    b.on_verified(_seq([1]), 2, 0)
    b.on_verified(_seq([1]), 1, 1)
    merged = merge_stats([a.stats(), b.stats()])
    assert merged["spec_decode_num_drafts"] == 3
    assert merged["spec_decode_acceptance_rate"] == pytest.approx(3 / 5)
    assert merged["spec_decode_mean_accepted_length"] == pytest.approx(1 + 3 / 3)
    assert merged["spec_decode_acceptance_per_position"] == [2 / 3, 1 / 2]


def test_prompt_lookup_lengths_are_refused_for_a_draft_model():
    draft = dict(method="draft_model", model="tiny")
    # The defaults keep working: the lengths stay unset, and ngram fills them in.
    config = SpeculativeConfig(**draft)
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (None, None)
    assert SpeculativeConfig.of(dataclasses.asdict(config)) == config  # round-trips
    ngram = SpeculativeConfig()
    assert (ngram.prompt_lookup_min, ngram.prompt_lookup_max) == (2, 5)
    for name, value in (("prompt_lookup_min", 1), ("prompt_lookup_max", 3)):
        match = rf"^speculative_config\.{name}={value} applies to method='ngram' only, not 'draft_model'"
        with pytest.raises(ValueError, match=match):
            SpeculativeConfig.of({**draft, name: value})
    # Set to the ngram defaults' values, still refused: what was set is what counts.
    with pytest.raises(ValueError, match=r"prompt_lookup_min=2 applies"):
        SpeculativeConfig(**draft, prompt_lookup_min=2, prompt_lookup_max=5)
