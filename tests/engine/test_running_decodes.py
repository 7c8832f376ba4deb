"""The running decodes (`paxkv.host.running_decodes`) and deferred outputs
(`paxkv.engine.outputs`) against an independent oracle: the fake model's tokens
computed by a plain loop per request, over workloads whose decodes keep changing
(arrivals, stop tokens, length limits, aborts, preemption, shared prefixes, penalties,
logprobs, a tokenizer); and what a decode step costs: no chunk, no output object."""

from __future__ import annotations

import numpy as np
import pytest

from paxkv.engine import Engine, EngineConfig
from paxkv.engine.fake_runner import FakeRunner, fake_token
from paxkv.engine.outputs import StepOutputs, built, handles
from paxkv.host.request import RequestOutputKind, SamplingParams

VOCAB = 64
EOS = 7


class CharTokenizer:
    """Token t is the letter chr(97 + t % 26); enough for incremental text."""

    def encode(self, text):
        return [ord(c) - 97 for c in text]

    def decode(self, ids):
        return "".join(chr(97 + t % 26) for t in ids)


def _engine(num_pages: int, tokenizer, async_scheduling: bool = False) -> Engine:
    config = EngineConfig(
        async_scheduling=async_scheduling,
        num_pages=num_pages,
        page_size=8,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        max_model_len=MAX_MODEL_LEN,
        num_decode_steps=1,
        log_stats_interval_s=0.0,
    )
    return Engine(
        None,
        config,
        tokenizer=tokenizer,
        runner=lambda c: FakeRunner(VOCAB, c, eos_token_ids=(EOS,)),
    )


MAX_MODEL_LEN = 128


def _workload(seed: int):
    """Per step: requests to add and ids to abort."""
    rng = np.random.default_rng(seed)
    prefix = rng.integers(8, VOCAB, 9).tolist()
    arrivals: dict[int, list] = {}
    for i in range(14):
        step = int(rng.integers(0, 40))
        prompt = (prefix if i % 3 == 0 else []) + rng.integers(
            8, VOCAB, int(rng.integers(1, 12))
        ).tolist()
        params = SamplingParams(
            temperature=0.0,
            max_tokens=int(rng.integers(1, 40)),
            ignore_eos=bool(i % 4 == 1),
            stop_token_ids=rng.integers(8, VOCAB, 20).tolist()
            if i == 11
            else [int(rng.integers(8, VOCAB))]
            if i % 5 == 2
            else [],
            repetition_penalty=1.2 if i % 6 == 3 else 1.0,
            logprobs=2 if i % 7 == 4 else None,
            output_kind=RequestOutputKind.DELTA if i % 7 else RequestOutputKind.CUMULATIVE,
        )
        arrivals.setdefault(step, []).append((f"r{i}", prompt, params))
    aborts = {int(rng.integers(5, 50)): [f"r{int(rng.integers(0, 14))}"] for _ in range(2)}
    return arrivals, aborts


def _oracle(prompt: list[int], params: SamplingParams) -> tuple[list[int], str]:
    """The fake model's greedy completion of `prompt`, by a plain loop: each token is
    `fake_token(previous token, its position)` (`FakeRunner`), until a stop token or a
    limit; and its finish reason."""
    stops = set(params.stop_token_ids) | (set() if params.ignore_eos else {EOS})
    token, pos, out = prompt[-1], len(prompt) - 1, []
    while True:
        token = int(fake_token(np.array([token]), np.array([pos]), VOCAB)[0])
        pos += 1
        out.append(token)
        if token in stops:
            return out, "stop"
        if len(out) >= params.max_tokens or len(prompt) + len(out) >= MAX_MODEL_LEN:
            return out, "length"


def _run(seed: int, num_pages: int, tokenizer, async_scheduling: bool = False):
    """Runs the workload; returns each request's prompt, params, tokens, text, finish
    reason and logprob count, how many plans held decodes as columns, and the stats."""
    engine = _engine(num_pages, tokenizer, async_scheduling)
    plans = []
    schedule = engine.scheduler.schedule

    def recorded():
        plans.append(schedule())
        return plans[-1]

    engine.scheduler.schedule = recorded
    arrivals, aborts = _workload(seed)
    got: dict[str, dict] = {}
    asked = {}
    for step in range(400):
        for rid, prompt, params in arrivals.get(step, []):
            engine.add_request(rid, {"prompt_token_ids": prompt}, params)
            asked[rid] = (prompt, params)
            got[rid] = {"tokens": [], "text": "", "reason": None, "logprobs": 0}
        for rid in aborts.get(step, []):
            engine.abort(rid)
        if not engine.has_unfinished() and step > 50:
            break
        if engine.has_unfinished():
            for o in engine.step():
                c, g = o.outputs[0], got[o.request_id]
                delta = asked[o.request_id][1].output_kind is RequestOutputKind.DELTA
                if delta:
                    g["tokens"] += c.token_ids
                    g["text"] += c.text or ""
                    g["logprobs"] += len(c.logprobs or ())
                else:
                    g["tokens"], g["text"] = list(c.token_ids), c.text or ""
                    g["logprobs"] = len(c.logprobs or ())
                g["reason"] = c.finish_reason
            engine.scheduler.kv_cache_manager.check_invariants()
    assert engine.pool.num_in_use == 0
    columns = sum(p.decode is not None for p in plans)
    return asked, got, columns, engine.stats()


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("num_pages", [64, 12])  # 12: preemption
def test_running_decodes_give_the_oracles_tokens(seed, num_pages, async_scheduling):
    tokenizer = CharTokenizer() if seed % 2 else None
    asked, got, columns, stats = _run(seed, num_pages, tokenizer, async_scheduling)
    assert columns >= 5, "no plan held decodes as columns"
    if num_pages == 12:
        assert stats["num_preemptions"] > 0
    for rid, (prompt, params) in asked.items():
        g = got[rid]
        want, reason = _oracle(prompt, params)
        if g["reason"] == "abort":  # aborted: what it had is the oracle's start
            assert g["tokens"] == want[: len(g["tokens"])], rid
            continue
        assert (g["tokens"], g["reason"]) == (want, reason), rid
        if tokenizer is not None:  # a stop token's text is left out, as in vLLM
            shown = want[:-1] if reason == "stop" else want
            assert g["text"] == tokenizer.decode(shown), rid
        if params.logprobs is not None:
            assert g["logprobs"] == len(want), rid


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_decode_steps_make_no_chunk_and_no_output_object(async_scheduling):
    """A decode step plans as columns (no `ScheduledChunk`) and reports one batch
    of deltas (no output object) until someone reads it; with async scheduling too."""
    engine = _engine(256, None, async_scheduling)
    params = SamplingParams(
        temperature=0.0, max_tokens=30, ignore_eos=True, output_kind=RequestOutputKind.DELTA
    )
    for i in range(4):
        engine.add_request(f"r{i}", {"prompt_token_ids": [10 + i, 11, 12]}, params)
    plans = []
    schedule = engine.scheduler.schedule
    engine.scheduler.schedule = lambda: plans.append(schedule()) or plans[-1]
    outs = [engine.step() for _ in range(10)]
    columns = [p for p in plans if p.decode is not None]
    assert len(columns) >= 8
    assert all(p._chunks is None for p in columns)  # never made into chunks
    last = outs[-1]
    assert isinstance(last, StepOutputs) and last._deltas is not None and not last._items
    assert not last._built  # nothing built yet
    got = [(rid, fin) for rid, fin, _ in handles(last)]
    assert got == [(f"r{i}", False) for i in range(4)]
    # Built, they equal what the general path reports.
    tokens = {o.request_id: o.outputs[0].token_ids for o in last}
    for i in range(4):
        seq = engine.requests.get(f"r{i}").seqs[0]
        if async_scheduling:  # the last output is the in-flight step's placeholder
            assert seq.output_token_ids[-1] < 0
            assert tokens[f"r{i}"] == seq.output_token_ids[-2:-1]
        else:
            assert tokens[f"r{i}"] == seq.output_token_ids[-1:]


def test_a_skipped_delta_keeps_its_tokens_and_passes_its_text_on():
    engine = _engine(256, CharTokenizer())
    params = SamplingParams(
        temperature=0.0, max_tokens=12, ignore_eos=True, output_kind=RequestOutputKind.DELTA
    )
    engine.add_request("a", {"prompt_token_ids": [1, 2, 3]}, params)
    taken = []
    while engine.has_unfinished():
        outs = engine.step()
        hs = handles(outs)
        if len(taken) % 3 != 1:  # skip every third output unread
            taken += [built(h[2]) for h in hs]
        else:
            taken.append(None)
    read = [o for o in taken if o is not None]
    text = "".join(o.outputs[0].text for o in read)
    final = engine.requests.get("a")
    assert final is None  # finished and forgotten
    assert len(text) == 12  # every token's text reached a read output
    assert read[-1].finished


def test_step_outputs_behave_like_a_list():
    engine = _engine(256, None)
    assert engine.step() == []
    engine.add_request("x", {"prompt_token_ids": [5, 6]}, SamplingParams(max_tokens=3))
    outs = engine.step()
    assert len(outs) == 1 and outs[0] is outs[-1] and outs[0:1] == [outs[0]]
    assert outs + [] == [outs[0]] == [] + outs  # noqa: RUF005 (the operators under test)
    with pytest.raises(IndexError):
        outs[1]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_fault_in_a_decode_step_fails_only_its_request(async_scheduling):
    """An allocation that raises while the columns plan (the batched growth of several
    sequences, then a page for one of them on the general path) fails that request
    alone; the others finish."""
    engine = _engine(256, None, async_scheduling)
    params = SamplingParams(
        temperature=0.0, max_tokens=20, ignore_eos=True, output_kind=RequestOutputKind.DELTA
    )
    for i in range(4):
        engine.add_request(f"r{i}", {"prompt_token_ids": [10 + i] * 5}, params)
    kv = engine.scheduler.kv_cache_manager
    pages_to_hold = kv.pages_to_hold  # asked by every growth, one by one or batched

    def faulty(seq, num_tokens):
        if seq.request_id == "r2" and num_tokens > 12:
            raise RuntimeError("injected")
        return pages_to_hold(seq, num_tokens)

    append_one = kv.rows.append_one  # the batched growth's write of the columns' rows
    raised = []

    def faulty_rows(rows, pages):
        grown = {s.request_id for s in engine.scheduler.running if kv.row(s) in rows}
        if "r2" in grown and max(s.num_tokens for s in engine.scheduler.running) > 12:
            raised.append(rows)
            raise RuntimeError("injected")
        return append_one(rows, pages)

    kv.pages_to_hold = faulty
    kv.rows.append_one = faulty_rows
    final = engine.run_until_done()
    assert raised, "the batched growth never met the fault"
    assert final["r2"].outputs[0].finish_reason == "abort"
    assert "injected" in final["r2"].error
    for rid in ("r0", "r1", "r3"):
        assert final[rid].outputs[0].finish_reason == "length"
    assert engine.pool.num_in_use == 0
