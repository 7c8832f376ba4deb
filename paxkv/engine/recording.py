"""Recording a step's samples: the sampled tokens (on the host) handed to the scheduler,
and the prompt logprobs of its scored rows handed to their sequences."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from paxkv.engine.device.sampling import Sampled, sample_result
from paxkv.host.request import FinishReason
from paxkv.host.scheduler import Scheduler, SchedulerOutput
from paxkv.host.sequence import SeqStatus, SequenceState
from paxkv.host.step_plan import score_spans


def record_samples(
    scheduler: Scheduler,
    plan: SchedulerOutput,
    samples: Sampled,
    valid: Sequence[bool] | None,
    eos_token_ids: tuple[int, ...],
) -> list[float | None] | np.ndarray:
    """Hands one iteration's samples to `scheduler.update`; `valid` masks a multi-step
    loop's (None: every sampling chunk got a token). A sequence whose result cannot be
    read fails alone. Returns, per token produced, the time since the sequence's previous
    token (None for its first, and for the tokens after the first that one speculative
    step produced for a sequence: they arrive together): a list, or for a plan with the
    running decodes' columns an f64 array (NaN for those None)."""
    if plan.decode is not None and valid is None:  # the running decodes' columns first
        n = plan.num_decode
        seqs = plan.decode.seqs
        recorded = scheduler.decodes.record(
            plan,
            samples.tokens[:n],
            eos_token_ids,
            lambda i: sample_result(samples, i, seqs[i])[1:],
        )
        if recorded is not None:
            gaps = recorded[1]  # f64[taken], no first tokens among them
            if plan.extra:
                rest = SchedulerOutput(plan.extra, ())
                more = _record(scheduler, rest, samples.rows_from(n), None, eos_token_ids, True)
                if more:  # None (a first token) as NaN
                    gaps = np.concatenate((gaps, np.array(more, np.float64)))
            return gaps
    return _record(scheduler, plan, samples, valid, eos_token_ids, False)


def _record(
    scheduler: Scheduler,
    plan: SchedulerOutput,
    samples: Sampled,
    valid: Sequence[bool] | None,
    eos_token_ids: tuple[int, ...],
    decodes_recorded: bool,
) -> list[float | None]:
    """`record_samples` with `Scheduler.update` (`decodes_recorded`: `plan` is the
    `extra` of a plan whose decodes the running decodes recorded; else their columns
    are made again at the next plan)."""
    if valid is None:
        record_scores(plan, samples)
    tokens, logprobs = samples.tokens.tolist(), samples.logprobs.tolist()
    running = SeqStatus.RUNNING
    sampled, previous = [], []
    for i, c in enumerate(plan.chunks):
        seq = c.seq
        previous.append(seq.last_token_time)
        result = None
        if c.num_draft and seq.status is running:
            try:
                result = verified_results(samples, i, seq)
            except Exception as e:  # isolated: only this sequence fails
                scheduler.fail(seq, e)
        elif c.samples and (valid is None or valid[i]) and seq.status is running:
            if seq.track_top:  # the top-k too
                try:
                    result = sample_result(samples, i, seq)
                except Exception as e:  # isolated: only this sequence fails
                    scheduler.fail(seq, e)
            else:
                result = (tokens[i], logprobs[i])
        sampled.append(result)
    was_running = [c.seq.status is running for c in plan.chunks] if valid is not None else None
    scheduler.update(plan, sampled, eos_token_ids=eos_token_ids)
    if not decodes_recorded:
        scheduler.decodes.after_update(eos_token_ids)
    if was_running is not None:  # the loop and the host must agree on who ran
        for c, ran, got in zip(plan.chunks, was_running, sampled, strict=True):
            aborted = c.seq.finish_reason is FinishReason.ABORT  # failed or aborted
            if not aborted and ran != (got is not None):
                raise RuntimeError(
                    f"multi-step decode disagrees with the host about {c.seq.seq_id}: "
                    f"running={ran}, token produced={got is not None}"
                )
    gaps: list[float | None] = []
    for c, before, got in zip(plan.chunks, previous, sampled, strict=True):
        if got is None:
            continue
        gaps.append(None if before is None else c.seq.last_token_time - before)
        if c.num_draft:  # the step's other tokens arrived with the first (vLLM's count)
            gaps.extend([None] * (len(got) - 1))
    return gaps


def verified_results(samples: Sampled, row: int, seq: SequenceState) -> list[tuple]:
    """Row `row`'s speculative verdict (`Sampled.spec`, host arrays) as
    `Scheduler.update` takes it: `(token, logprob[, top-k])` for each accepted proposal
    and the target's token after them."""
    spec = samples.spec
    n = int(spec.num_accepted[row]) + 1
    tokens = spec.tokens[row, :n].tolist()
    scores = spec.scores
    logprobs = scores.logprobs[row, :n].tolist()
    k = seq.params.logprobs
    if k is None:
        return list(zip(tokens, logprobs, strict=True))
    return [
        (
            tokens[j],
            logprobs[j],
            (
                tuple(scores.top_ids[row, j, :k].tolist()),
                tuple(scores.top_logprobs[row, j, :k].tolist()),
                int(scores.ranks[row, j]),
            ),
        )
        for j in range(n)
    ]


def record_scores(plan: SchedulerOutput, samples: Sampled) -> list[SequenceState]:
    """Stores the prompt logprobs of `plan`'s scored rows (host arrays, `Sampled.scored`)
    in their sequences' `prompt_scores`; returns those sequences, in plan order."""
    spans = score_spans(plan.chunks)
    if not spans:
        return []
    scored = samples.scored
    seqs, at = [], 0
    for i, lo, hi in spans:
        seq = plan.chunks[i].seq
        end = at + hi - lo
        seq.prompt_scores.record(
            lo,
            scored.logprobs[at:end],
            scored.ranks[at:end],
            scored.top_ids[at:end],
            scored.top_logprobs[at:end],
        )
        seqs.append(seq)
        at = end
    return seqs
