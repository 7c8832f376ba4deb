"""`LLM.generate_stream`: each stream yields exactly its own requests' outputs, all of
them, whatever else runs meanwhile; a stream that ends early aborts its requests.

The oracle is `generate` of each prompt alone, greedy: the tokens a request must end
with whatever it was batched with.
"""

import gc
import itertools

import pytest

from paxkv import LLM, SamplingParams

SMALL = dict(num_pages=64, page_size=8, max_num_seqs=4, max_num_batched_tokens=32)
SHORT = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
LONG = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPTS = [{"prompt_token_ids": [5 + i, 60 + 3 * i, 7, 9 + i]} for i in range(5)]


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny", dtype="float32", max_model_len=64, warmup=False, **SMALL)


@pytest.fixture(scope="module")
def expected(llm):
    """expected[params is LONG][prompt index]: the tokens of each prompt run alone."""
    return {
        long: [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS]
        for long, params in ((False, SHORT), (True, LONG))
    }


def prompt_index(out) -> int:
    return [p["prompt_token_ids"] for p in PROMPTS].index(out.prompt_token_ids)


def check_stream(outputs, prompts, tokens):
    """Every output is of one of `prompts`; each request grows by prefixes and finishes
    once, last, with `tokens[prompt index]`."""
    by_id = {}
    for out in outputs:
        by_id.setdefault(out.request_id, []).append(out)
    assert sorted(prompt_index(o[0]) for o in by_id.values()) == prompts
    for outs in by_id.values():
        assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
        seen = [o.outputs[0].token_ids for o in outs]
        assert all(a == b[: len(a)] for a, b in itertools.pairwise(seen))
        assert seen[-1] == tokens[prompt_index(outs[-1])]


def assert_idle(llm):
    engine = llm.engine
    if engine.has_unfinished():
        engine.step()  # reports aborted requests
    assert not engine.has_unfinished()
    assert engine.pool.num_in_use == 0
    engine.pool.check_invariants()


def test_interleaved_streams_each_yield_their_own_requests(llm, expected):
    a = llm.generate_stream(PROMPTS[:2], LONG)
    b = llm.generate_stream(PROMPTS[2:3], LONG)
    got = {"a": [], "b": []}
    live = {"a": a, "b": b}
    while live:
        for name, stream in list(live.items()):
            out = next(stream, None)
            if out is None:
                del live[name]
            else:
                got[name].append(out)
    check_stream(got["a"], [0, 1], expected[True])
    check_stream(got["b"], [2], expected[True])
    assert_idle(llm)


def test_a_suspended_stream_gets_what_a_later_generate_ran(llm, expected):
    stream = llm.generate_stream(PROMPTS[:2], SHORT)
    first = [next(stream)]
    # generate runs until its own request ends: the stream's end meanwhile.
    (other,) = llm.generate(PROMPTS[2:3], LONG, use_tqdm=False)
    assert other.finished and other.outputs[0].token_ids == expected[True][2]
    check_stream(first + list(stream), [0, 1], expected[False])
    assert_idle(llm)


class RaisingBar:
    """A tqdm-like bar that raises when the first request finishes."""

    def __init__(self, **kwargs):
        self.format_dict = {"elapsed": 1.0}

    def set_postfix_str(self, text, refresh=True):
        pass

    def update(self, n):
        raise RuntimeError("bar broke")

    def close(self):
        pass


class BrokenBar(RaisingBar):
    def __init__(self, **kwargs):
        raise RuntimeError("bar broke")


@pytest.mark.parametrize("bar", [RaisingBar, BrokenBar])
@pytest.mark.parametrize("call", ["generate", "generate_stream"])
def test_a_use_tqdm_bar_that_raises_aborts_the_calls_requests(llm, expected, call, bar):
    # The short request finishes first; the long one is still running when the bar breaks.
    params = [SHORT, LONG]
    before = set(llm.engine.requests._requests)
    with pytest.raises(RuntimeError, match="bar broke"):
        if call == "generate":
            llm.generate(PROMPTS[:2], params, use_tqdm=bar)
        else:
            list(llm.generate_stream(PROMPTS[:2], params, use_tqdm=bar))
    assert set(llm.engine.requests._requests) == before  # none left running
    # The next stream yields its own request only, not the aborted ones.
    check_stream(list(llm.generate_stream(PROMPTS[3:4], SHORT)), [3], expected[False])
    assert_idle(llm)


def test_a_closed_stream_aborts_its_unfinished_requests(llm, expected):
    stream = llm.generate_stream(PROMPTS[:2], LONG)
    out = next(stream)
    stream.close()
    assert out.request_id not in llm.engine.requests
    assert not llm.engine.has_unfinished() and llm.engine.pool.num_in_use == 0
    llm.engine.pool.check_invariants()


def test_a_collected_stream_aborts_its_unfinished_requests(llm, expected):
    stream = llm.generate_stream(PROMPTS[:2], LONG)
    rid = next(stream).request_id
    del stream
    gc.collect()
    assert rid not in llm.engine.requests
    (other,) = llm.generate(PROMPTS[2:3], SHORT, use_tqdm=False)
    assert other.outputs[0].token_ids == expected[False][2]
    assert_idle(llm)


def test_a_stream_collected_inside_a_step_aborts_after_it(llm, expected, monkeypatch):
    """A stream in a reference cycle may be collected while the engine steps: its
    aborts wait for the step to end."""
    stream = llm.generate_stream(PROMPTS[:2], LONG)
    rid = next(stream).request_id
    real_step = llm.engine.step

    def step():
        outputs = real_step()
        if stream.gi_frame is not None:  # the first step: closes it
            stream.close()  # as the garbage collector would, inside the step
            assert rid in llm.engine.requests  # not yet: the step is still filing outputs
        return outputs

    monkeypatch.setattr(llm.engine, "step", step)
    (other,) = llm.generate(PROMPTS[2:3], SHORT, use_tqdm=False)
    monkeypatch.undo()
    assert other.outputs[0].token_ids == expected[False][2]
    assert rid not in llm.engine.requests
    assert_idle(llm)
