"""Isolation: a failure tied to one request ends that request, never the others.

Faults are injected at random into every place a step does per-request host work
(admission, scheduling, batch layout, reading the samples, recording them, building the
output). Whatever fails, every request ends: the faulty ones with finish reason "abort"
and the error in their output, the others with exactly the tokens of a fault-free run,
and no page stays in use.
"""

import collections

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from test_engine import _engine, _run

from paxkv import SamplingParams
from paxkv.engine import recording as recording_module
from paxkv.engine import stepper as stepper_module
from paxkv.engine.requests import Request
from paxkv.host import admission as admission_module
from paxkv.host import batch as batch_module
from paxkv.host import scheduler as scheduler_module
from paxkv.host.prefix_cache import PrefixCache
from paxkv.host.sequence import SequenceState

MODES = {
    "sync": {},
    "async": {"async_scheduling": True},
    "multi-step": {"num_decode_steps": 3},
}


class Injected(RuntimeError):
    pass


def _install(monkeypatch, faults):
    """Makes each hook raise `Injected` for a victim request at its trigger-th call.

    `faults` maps request id -> (hook name, trigger). Returns the ids whose fault fired.
    """
    calls = collections.Counter()
    fired = set()

    def check(hook, rid):
        if rid in faults and faults[rid][0] == hook:
            calls[rid] += 1
            if calls[rid] > faults[rid][1]:
                fired.add(rid)
                raise Injected(f"injected into {hook} of {rid}")

    def wrap(owner, name, hook, rid_of):
        original = getattr(owner, name)

        def hooked(*args, **kwargs):
            check(hook, rid_of(*args, **kwargs))
            return original(*args, **kwargs)

        monkeypatch.setattr(owner, name, hooked)

    wrap(PrefixCache, "lookup", "admit", lambda cache, seq: seq.request_id)
    for module in (scheduler_module, admission_module):  # the chunk of a running or new seq
        wrap(module, "chunk_tokens", "schedule", lambda seq, budget, page_size: seq.request_id)
    wrap(SequenceState, "append_output", "record", lambda seq, *a: seq.request_id)
    wrap(Request, "output", "output", lambda req, *a, **kw: req.request_id)
    for module in (recording_module, stepper_module):
        wrap(module, "sample_result", "sample", lambda samples, row, seq: seq.request_id)
    # The batch layout: a penalised request's token history (every other one has one).
    wrap(SequenceState, "penalty_history", "layout", lambda seq: seq.request_id)
    return fired


HOOKS = ["admit", "schedule", "layout", "sample", "record", "output"]


@st.composite
def scenarios(draw):
    n = draw(st.integers(3, 6))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    prompts = [rng.integers(0, 256, size=int(rng.integers(1, 30))).tolist() for _ in range(n)]
    max_tokens = [draw(st.integers(1, 8)) for _ in range(n)]
    victims = draw(st.sets(st.integers(0, n - 1), min_size=1, max_size=n - 1))
    # "layout" fires only for penalised (odd) requests, which lay out a token history.
    faults = {
        str(i): (
            draw(st.sampled_from(HOOKS if i % 2 else HOOKS[:2] + HOOKS[3:])),
            draw(st.integers(0, 3)),
        )
        for i in victims
    }
    num_pages = draw(st.sampled_from([64, 14]))  # 14: preemption
    return prompts, max_tokens, faults, num_pages


def _params(max_tokens, penalised):
    # Every other request has penalties, so both layout paths run.
    return SamplingParams(
        temperature=0.0,
        max_tokens=max_tokens,
        ignore_eos=True,
        logprobs=1,
        repetition_penalty=1.3 if penalised else 1.0,
    )


def _serve(model, mode, prompts, max_tokens, num_pages):
    engine = _engine(model, num_pages=num_pages, **MODES[mode])
    for i, (prompt, m) in enumerate(zip(prompts, max_tokens, strict=True)):
        params = _params(m, i % 2)
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
    return engine, engine.run_until_done()


@pytest.mark.parametrize("mode", MODES)
@settings(
    max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(case=scenarios())
# Found by CI: request 3's layout fails only on its second call, which came after request
# 1's failure had been isolated, when the batch without it was laid out again.
@example(
    case=(
        [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14]],
        [1, 1, 1, 1],
        {"1": ("layout", 0), "2": ("admit", 0), "3": ("layout", 1)},
        64,
    )
)
def test_a_failing_request_never_takes_others_down(tiny, monkeypatch, mode, case):
    _, model, _ = tiny
    prompts, max_tokens, faults, num_pages = case
    _, reference = _serve(model, mode, prompts, max_tokens, num_pages)
    with monkeypatch.context() as m:
        fired = _install(m, faults)
        engine, final = _serve(model, mode, prompts, max_tokens, num_pages)
    assert set(final) == {str(i) for i in range(len(prompts))}  # every request ended
    for rid, out in final.items():
        if rid in fired:
            assert out.finished and out.outputs[0].finish_reason == "abort"
            assert (
                out.error is not None
                and f"Injected: injected into {faults[rid][0]} of {rid}" in out.error
            )
            expected = reference[rid].outputs[0].token_ids
            assert out.outputs[0].token_ids == expected[: len(out.outputs[0].token_ids)]
        else:
            assert out.error is None
            assert out.outputs[0].token_ids == reference[rid].outputs[0].token_ids
            assert out.outputs[0].finish_reason == "length"
    assert not engine.has_unfinished()
    assert engine.pool.num_in_use == 0
    engine.pool.check_invariants()
    assert not engine.scheduler.running and not engine.scheduler.waiting


def test_a_fault_of_the_whole_step_is_not_blamed_on_a_request(tiny, monkeypatch):
    """A layout failure that no single request reproduces is the step's: it propagates."""
    _, model, _ = tiny
    engine = _engine(model)
    engine.add_request("a", {"prompt_token_ids": [1, 2, 3]}, _params(4, False))
    engine.add_request("b", {"prompt_token_ids": [4, 5]}, _params(4, False))
    original = batch_module._scored_rows

    def only_together(chunks, *args, **kwargs):
        if len(chunks) > 1:
            raise Injected("the step")
        return original(chunks, *args, **kwargs)

    monkeypatch.setattr(batch_module, "_scored_rows", only_together)
    with pytest.raises(Injected, match="the step"):
        engine.step()


@pytest.mark.parametrize("abort_after", [1, 2, 3, 4])
def test_abort_during_multi_step_decode(tiny, abort_after):
    """Aborting between multi-step calls frees the pages reserved ahead, reports the
    request once with a prefix of its tokens, and leaves the others untouched."""
    _, model, _ = tiny
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    prompts = {"a": [7, 8, 9], "b": [4, 5], "c": list(range(20, 37))}
    reference = dict(
        zip(prompts, _run(_engine(model), list(prompts.values()), params), strict=True)
    )
    engine = _engine(model, num_decode_steps=4)
    for rid, prompt in prompts.items():
        engine.add_request(rid, {"prompt_token_ids": prompt}, params)
    for _ in range(abort_after):
        engine.step()
    held = engine.pool.num_in_use
    engine.abort("a")
    assert engine.pool.num_in_use < held  # a's pages, those reserved ahead included
    reports = collections.defaultdict(list)
    while engine.has_unfinished():
        for o in engine.step():
            reports[o.request_id].append(o)
    assert [o.finished for o in reports["a"]] == [True]
    a = reports["a"][0].outputs[0]
    assert a.finish_reason == "abort"
    assert a.token_ids == reference["a"].outputs[0].token_ids[: len(a.token_ids)]
    assert reports["b"][-1].outputs[0].token_ids == reference["b"].outputs[0].token_ids
    assert reports["c"][-1].outputs[0].token_ids == reference["c"].outputs[0].token_ids
    assert engine.stats()["num_decode_loops"] > 0
    assert engine.pool.num_in_use == 0
    engine.pool.check_invariants()
