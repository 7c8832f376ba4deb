"""Request outputs: cumulative, delta and final-only; incremental text; stop strings.

Two harnesses. `Host` runs the engine's host path (the scheduler and the request
registry) with each step's tokens chosen by the test, so characters can be split over
tokens and tokens given to the outputs in any grouping. The tiny model runs the whole
engine (sync, async, multi-step) with the byte tokenizer and a byte-level BPE. The
oracle of every text is the tokenizer's `decode` of all the tokens.
"""

import dataclasses
import itertools

import pytest
from bpe_tokenizer import bpe_tokenizer
from test_engine import _engine

from paxkv import LLM, RequestOutputKind, SamplingParams
from paxkv.engine.requests import RequestRegistry
from paxkv.host.page_pool import PagePool
from paxkv.host.scheduler import Scheduler
from paxkv.host.sequence import PLACEHOLDER_TOKEN as PLACEHOLDER
from paxkv.models import ByteTokenizer, HFTokenizer

CUMULATIVE, DELTA, FINAL_ONLY = RequestOutputKind
TEXT = "héllo wörld € 😀 日本語 naïve"


class Host:
    """The engine's host path without a model: each step gives every sequence it
    samples for the next token of `script(seq)`; `report` outputs what advanced."""

    def __init__(self, tokenizer, *, eos=(), page_size=4):
        self.pool = PagePool(512)
        self.scheduler = Scheduler(
            self.pool,
            page_size=page_size,
            max_num_seqs=8,
            max_num_batched_tokens=64,
            max_model_len=256,
        )
        self.requests = RequestRegistry(
            self.scheduler, vocab_size=512, max_model_len=256, tokenizer=tokenizer
        )
        self.eos = tuple(eos)
        self.scripts = {}

    def add(self, rid, tokens, params, prompt=(1, 2, 3)):
        """Request `rid`; completion i generates `tokens` (cycled), offset by i."""
        req = self.requests.create(rid, {"prompt_token_ids": list(prompt)}, params)
        for seq in req.seqs:
            self.scripts[seq.seq_id] = itertools.islice(itertools.cycle(tokens), seq.index, None)
            self.scheduler.add(seq)
        return req

    def step(self, placeholder=False):
        """Schedules and records one step; its tokens are `PLACEHOLDER` if asked.
        Returns the sequences that sampled, and the tokens they will resolve to."""
        plan = self.scheduler.schedule()
        sampled, real = [], []
        for c in plan.chunks:
            if not c.samples:
                sampled.append(None)
                continue
            token = next(self.scripts[c.seq.seq_id])
            top = ((token,), (-0.25,), 1) if c.seq.params.logprobs is not None else None
            sampled.append((PLACEHOLDER if placeholder else token, -0.25, top))
            real.append((c.seq, len(c.seq.output_token_ids), token, top))
        self.scheduler.update(plan, sampled, eos_token_ids=self.eos)
        return real

    def report(self, seqs):
        return self.requests.report(s.request_id for s, *_ in seqs)[0]

    def run(self, tokens_per_report=1):
        """Steps until done, reporting every `tokens_per_report` steps (a multi-step
        call); returns every output."""
        outputs = []
        while self.scheduler.has_unfinished():
            touched = [s for _ in range(tokens_per_report) for s in self.step()]
            outputs += self.report(touched)
        return outputs


def _bpe() -> HFTokenizer:
    return bpe_tokenizer(TEXT)


TOKENIZERS = {"byte": ByteTokenizer, "bpe": _bpe}


def _joined(outputs, index=0):
    """Delta outputs of one request concatenated: (tokens, text, logprobs, last)."""
    parts = [c for o in outputs for c in o.outputs if c.index == index]
    tokens = [t for c in parts for t in c.token_ids]
    logprobs = None if parts[0].logprobs is None else [lp for c in parts for lp in c.logprobs]
    return tokens, "".join(c.text for c in parts), logprobs, parts[-1]


@pytest.mark.parametrize("tokens_per_report", [1, 3])
@pytest.mark.parametrize("name", TOKENIZERS)
def test_deltas_concatenate_to_the_cumulative_output(name, tokens_per_report):
    tokenizer = TOKENIZERS[name]()
    tokens = tokenizer.encode(TEXT, add_special_tokens=False)
    host = Host(tokenizer)
    for kind in RequestOutputKind:
        params = SamplingParams(max_tokens=len(tokens) + 5, n=2, logprobs=0, output_kind=kind)
        host.add(kind.name, tokens, params)
    outputs = host.run(tokens_per_report)
    by_kind = {k: [o for o in outputs if o.request_id == k.name] for k in RequestOutputKind}
    (final,) = by_kind[FINAL_ONLY]
    cumulative = by_kind[CUMULATIVE][-1]
    assert final.finished and cumulative.finished and by_kind[DELTA][-1].finished
    assert [o.finished for o in by_kind[DELTA]].count(True) == 1
    for i in range(2):
        whole = cumulative.outputs[i]
        assert whole.token_ids == final.outputs[i].token_ids
        assert whole.text == final.outputs[i].text == tokenizer.decode(whole.token_ids)
        assert whole.logprobs == final.outputs[i].logprobs and len(whole.logprobs) == len(
            whole.token_ids
        )
        tokens_d, text_d, logprobs_d, last = _joined(by_kind[DELTA], i)
        assert tokens_d == whole.token_ids and text_d == whole.text and logprobs_d == whole.logprobs
        assert last.finish_reason == whole.finish_reason == "length"
        assert (
            last.cumulative_logprob
            == whole.cumulative_logprob
            == pytest.approx(-0.25 * len(whole.token_ids))
        )
    # Completion 0 is the text itself, and a character split over tokens shows up whole
    # once its last token is in: no delta ever holds part of one.
    assert cumulative.outputs[0].text.startswith(TEXT)
    assert all("\ufffd" not in c.text for o in by_kind[DELTA] for c in o.outputs)
    assert host.pool.num_in_use == 0


def test_delta_and_cumulative_streams_advance_together():
    host = Host(ByteTokenizer())
    tokens = list("a€b".encode())  # the € takes three tokens
    for kind in (CUMULATIVE, DELTA):
        host.add(kind.name, tokens, SamplingParams(max_tokens=5, output_kind=kind))
    texts = {CUMULATIVE.name: [], DELTA.name: []}
    for out in host.run():
        texts[out.request_id].append(out.outputs[0].text)
    assert texts[CUMULATIVE.name] == ["a", "a", "a", "a€", "a€b"]
    assert texts[DELTA.name] == ["a", "", "", "€", "b"]


def test_outputs_take_only_final_tokens_not_placeholders():
    """Async scheduling reports after a step's placeholders are resolved; a report with
    placeholders in place takes nothing of them."""
    host = Host(ByteTokenizer())
    host.add("r", list(b"hi!"), SamplingParams(max_tokens=3, output_kind=DELTA, logprobs=0))
    (first,) = host.report(host.step())
    assert first.outputs[0].token_ids == [ord("h")]
    pending = host.step(placeholder=True)
    assert host.report(pending) == []  # nothing final is new
    ((seq, index, token, top),) = pending
    host.scheduler.resolve(seq, index, token, -0.25, (), 0.0, top)
    (second,) = host.report(pending)
    assert second.outputs[0].token_ids == [ord("i")] and second.outputs[0].text == "i"
    assert len(second.outputs[0].logprobs) == 1


def test_final_only_yields_one_output_per_request():
    host = Host(ByteTokenizer())
    for rid, n in (("a", 1), ("b", 3)):
        host.add(rid, list(b"xyz"), SamplingParams(max_tokens=7, n=n, output_kind=FINAL_ONLY))
    outputs = host.run()
    assert sorted(o.request_id for o in outputs) == ["a", "b"]
    assert all(o.finished for o in outputs)
    b = next(o for o in outputs if o.request_id == "b")
    assert [c.index for c in b.outputs] == [0, 1, 2]
    assert [c.text for c in b.outputs] == ["xyzxyzx", "yzxyzxy", "zxyzxyz"]


def test_delta_with_n_reports_only_the_completions_that_advanced():
    host = Host(ByteTokenizer())
    # Completion i generates the script from offset i: "abc" ends at "c", "bc" too.
    host.add("r", list(b"abcd"), SamplingParams(max_tokens=4, n=2, stop="c", output_kind=DELTA))
    outputs = host.run()
    assert [[c.index for c in o.outputs] for o in outputs] == [[0, 1], [0, 1], [0]]
    assert [[c.text for c in o.outputs] for o in outputs] == [["a", "b"], ["b", ""], [""]]
    assert outputs[1].outputs[1].finish_reason == "stop" and not outputs[1].finished
    assert outputs[2].finished and outputs[2].outputs[0].stop_reason == "c"


def test_prompt_token_ids_are_the_requests_own_not_copies():
    host = Host(ByteTokenizer())
    req = host.add("r", list(b"ab"), SamplingParams(max_tokens=3, output_kind=DELTA))
    outputs = host.run()
    assert all(o.prompt_token_ids is req.prompt_token_ids for o in outputs)


def test_each_output_decodes_only_the_new_tokens():
    """A tokenizer with no streaming decoder of its own is decoded over a window of the
    latest tokens: the ids decoded per output do not grow with the length."""

    class Counting(ByteTokenizer):
        decode_stream = None  # decoded through `decode`, as any tokenizer is

        def __init__(self):
            self.sizes = []

        def decode(self, ids):
            self.sizes.append(len(ids))
            return super().decode(ids)

    tokenizer = Counting()
    host = Host(tokenizer)
    text = "ab€😀c" * 20
    tokens = list(text.encode())
    for kind in RequestOutputKind:
        host.add(kind.name, tokens, SamplingParams(max_tokens=len(tokens), output_kind=kind))
    outputs = host.run()
    # The tokens of the previous character and of the new one (4 bytes at most each).
    assert max(tokenizer.sizes) <= 8
    assert {o.outputs[0].text for o in outputs if o.finished and o.request_id != "DELTA"} == {text}


# Stop strings.


def _stopped(tokenizer, tokens, *, eos=(), **params):
    """The final output of one request generating `tokens` (cycled), in every output
    kind and grouping of tokens per report; checks they agree and returns it."""
    finals = []
    for kind, per_report in itertools.product(RequestOutputKind, (1, 2, 5)):
        host = Host(tokenizer, eos=eos)
        p = SamplingParams(output_kind=kind, **{"max_tokens": 40, **params})
        host.add("r", tokens, p)
        outputs = host.run(per_report)
        assert host.pool.num_in_use == 0 and not host.scheduler.has_unfinished()
        if kind is DELTA:
            tokens_d, text_d, _, last = _joined(outputs)
            final = dataclasses.replace(last, token_ids=tokens_d, text=text_d)
        else:
            final = outputs[-1].outputs[0]
        finals.append(final)
    assert all(f == finals[0] for f in finals), finals
    return finals[0]


def test_a_stop_string_split_over_tokens_ends_the_completion_at_its_last_token():
    out = _stopped(ByteTokenizer(), list(b"abcSTOPdef"), stop="STOP")
    assert out.finish_reason == "stop" and out.stop_reason == "STOP"
    assert out.text == "abc" and bytes(out.token_ids) == b"abcSTOP"
    out = _stopped(
        ByteTokenizer(), list(b"abcSTOPdef"), stop="STOP", include_stop_str_in_output=True
    )
    assert out.text == "abcSTOP" and bytes(out.token_ids) == b"abcSTOP"


def test_a_stop_string_at_the_very_first_token():
    out = _stopped(ByteTokenizer(), list(b"xyz"), stop=["q", "x"])
    assert (out.text, out.token_ids, out.stop_reason) == ("", [ord("x")], "x")


def test_the_earliest_of_several_stop_strings_wins():
    out = _stopped(ByteTokenizer(), list(b"abcdefgh"), stop=["fg", "cde", "bcd"])
    assert (out.text, bytes(out.token_ids), out.stop_reason) == ("a", b"abcd", "bcd")


def test_a_stop_string_inside_a_multi_byte_token_cuts_the_text_inside_the_token():
    tokenizer = _bpe()
    tokens = tokenizer.encode(TEXT, add_special_tokens=False)
    out = _stopped(tokenizer, tokens, stop="ö")
    assert out.text == "héllo w" and out.stop_reason == "ö"
    # The tokens end at the one that completed "ö", whose text may go further.
    assert tokenizer.decode(out.token_ids).startswith("héllo wö")
    assert not tokenizer.decode(out.token_ids[:-1]).startswith("héllo wö")


def test_a_stop_token_ends_with_its_id_as_stop_reason_and_its_text_left_out():
    tokens = list(b"abcSTOP")
    stop_id = ord("T")
    out = _stopped(ByteTokenizer(), tokens, stop_token_ids=[stop_id])
    assert out.stop_reason == stop_id and bytes(out.token_ids) == b"abcST"
    assert out.text == "abcS"  # the stop token's text is left out, as vLLM does
    # Overlapping a stop string: the stop token ends it first, its text is not matched.
    out = _stopped(ByteTokenizer(), tokens, stop_token_ids=[stop_id], stop="ST")
    assert out.stop_reason == stop_id and out.text == "abcS"
    # Unless stop strings are kept in the text: then its text completes the string.
    out = _stopped(
        ByteTokenizer(),
        tokens,
        stop_token_ids=[stop_id],
        stop="ST",
        include_stop_str_in_output=True,
    )
    assert out.stop_reason == "ST" and out.text == "abcST" and bytes(out.token_ids) == b"abcST"
    # EOS: no stop reason, as in vLLM.
    out = _stopped(ByteTokenizer(), tokens, eos=[ord("c")])
    assert out.finish_reason == "stop" and out.stop_reason is None and out.text == "ab"


def test_streams_hold_back_what_a_stop_string_may_still_cut():
    host = Host(ByteTokenizer())
    host.add("c", list(b"abSTdSTOPx"), SamplingParams(max_tokens=20, stop="STOP"))
    shown = [o.outputs[0].text for o in host.run()]
    assert shown[-1] == "abSTd"
    assert all("abSTd".startswith(s) for s in shown)  # nothing shown is cut later
    assert shown[:4] == ["", "", "", "a"]  # len("STOP") - 1 characters held back


def test_a_completion_stopped_by_a_string_leaves_its_siblings_running():
    host = Host(ByteTokenizer())
    # Completion i generates the script from offset i: "abcd..." and "bcd...".
    req = host.add("r", list(b"abcdefgh"), SamplingParams(max_tokens=6, n=2, stop="a"))
    host.report(host.step())  # the first tokens: "a" ends completion 0, and frees its pages
    stopped, running = req.seqs
    assert (
        stopped.finish_reason == "stop"
        and host.scheduler.kv_cache_manager.num_pages(stopped) == 0
        and host.scheduler.kv_cache_manager.num_pages(running)
    )
    assert host.pool.num_in_use == host.scheduler.kv_cache_manager.num_pages(running)
    (out,) = [o for o in host.run() if o.finished]
    assert [(c.text, c.finish_reason, c.stop_reason) for c in out.outputs] == [
        ("", "stop", "a"),
        ("bcdefg", "length", None),
    ]
    assert host.pool.num_in_use == 0


def test_stop_strings_are_validated_and_need_a_tokenizer():
    assert SamplingParams(stop="x").stop == ("x",)
    assert SamplingParams(stop=None).stop == () == SamplingParams().stop
    assert SamplingParams(stop=["a", "bc"]).stop == ("a", "bc")
    with pytest.raises(ValueError, match=r"stop\[1\] is an empty string"):
        SamplingParams(stop=["a", ""])
    with pytest.raises(TypeError, match=r"stop\[0\] must be a str, got 3"):
        SamplingParams(stop=[3])
    with pytest.raises(TypeError, match=r"stop must be a str, a list of str or None, got 3"):
        SamplingParams(stop=3)
    with pytest.raises(TypeError, match="include_stop_str_in_output must be a bool"):
        SamplingParams(include_stop_str_in_output=1)
    with pytest.raises(TypeError, match="output_kind must be a RequestOutputKind, got 1"):
        SamplingParams(output_kind=1)
    host = Host(None)
    with pytest.raises(ValueError, match=r"SamplingParams.stop=\['x'\].* need a tokenizer"):
        host.add("r", [1], SamplingParams(stop="x"))
    assert "r" not in host.requests


# The whole engine on the tiny model.


def _engine_outputs(engine, prompts, params):
    """Every output of every request, by request id."""
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, p)
    outputs = {str(i): [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id].append(out)
    return outputs


ENGINES = {
    "sync": {},
    "async": {"async_scheduling": True},
    "multi_step": {"num_decode_steps": 3},
}


@pytest.mark.parametrize("mode", ENGINES)
@pytest.mark.parametrize("name", TOKENIZERS)
def test_engine_deltas_concatenate_to_the_cumulative_output(tiny, name, mode):
    _, model, _ = tiny
    tokenizer = TOKENIZERS[name]()
    prompts = [[10, 20, 30], list(range(40, 57))]
    base = SamplingParams(temperature=1.0, seed=7, max_tokens=13, n=2, logprobs=1, ignore_eos=True)
    kinds = list(RequestOutputKind)
    params = [dataclasses.replace(base, output_kind=k) for k in kinds for _ in prompts]
    engine = _engine(model, tokenizer=tokenizer, **ENGINES[mode])
    outputs = _engine_outputs(engine, prompts * len(kinds), params)
    assert engine.pool.num_in_use == 0
    for j in range(len(prompts)):
        cumulative, delta, final = (outputs[str(k * len(prompts) + j)] for k in range(3))
        assert len(final) == 1 and final[0].finished
        for i in range(2):
            whole = cumulative[-1].outputs[i]
            tokens_d, text_d, logprobs_d, last = _joined(delta, i)
            assert (tokens_d, text_d) == (whole.token_ids, whole.text)
            assert whole.text == tokenizer.decode(whole.token_ids)
            assert len(whole.token_ids) == 13 and len(logprobs_d) == 13
            # The requests ran in other rows of the batch: the same numbers up to rounding.
            chosen = [d[t].logprob for d, t in zip(logprobs_d, tokens_d, strict=True)]
            assert chosen == pytest.approx(whole.token_logprobs, abs=1e-4)
            assert last.cumulative_logprob == pytest.approx(whole.cumulative_logprob, abs=1e-3)
            other = final[0].outputs[i]
            assert (other.token_ids, other.text) == (whole.token_ids, whole.text)
            assert other.token_logprobs == pytest.approx(whole.token_logprobs, abs=1e-4)


@pytest.mark.parametrize("mode", ENGINES)
def test_engine_stop_strings_end_sequences_and_free_their_pages(tiny, mode):
    _, model, _ = tiny
    tokenizer = ByteTokenizer()
    prompts = [[10, 20, 30], list(range(40, 57)), [7]]
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    reference = [
        o.outputs[0] for o in _run_all(_engine(model, tokenizer=tokenizer), prompts, greedy)
    ]
    # Stop strings drawn from each reference output's text (of random bytes: skipping
    # U+FFFD): one, the earliest text, and two of which the later listed comes first.
    texts = [tokenizer.decode(r.token_ids) for r in reference]
    stops = [
        [_substring(texts[0], 5, 3)],
        [_substring(texts[1], 0, 1)],
        [_substring(texts[2], 9, 2), _substring(texts[2], 4, 2)],
    ]
    params = [dataclasses.replace(greedy, stop=s) for s in stops]
    engine = _engine(model, tokenizer=tokenizer, **ENGINES[mode])
    got = [o.outputs[0] for o in _run_all(engine, prompts, params)]
    assert engine.pool.num_in_use == 0
    engine.pool.check_invariants()
    for out, ref, stop in zip(got, reference, stops, strict=True):
        # The first token whose text completes a stop string ends the output, and the
        # text is cut at the string that starts first.
        k = next(
            k for k in range(1, 25) if any(s in tokenizer.decode(ref.token_ids[:k]) for s in stop)
        )
        text = tokenizer.decode(ref.token_ids[:k])
        start, first = min((text.find(s), s) for s in stop if s in text)
        assert (out.finish_reason, out.stop_reason) == ("stop", first)
        assert out.token_ids == ref.token_ids[:k] and out.text == text[:start]


def _substring(text, start, length):
    """The first `length` characters of `text` from `start` on without U+FFFD."""
    i = next(i for i in range(start, len(text)) if "\ufffd" not in text[i : i + length])
    return text[i : i + length]


def _run_all(engine, prompts, params):
    if isinstance(params, SamplingParams):
        params = [params] * len(prompts)
    outputs = _engine_outputs(engine, prompts, params)
    return [outputs[str(i)][-1] for i in range(len(prompts))]


# The LLM API.


@pytest.fixture(scope="module")
def llm():
    return LLM(
        "tiny",
        dtype="float32",
        max_model_len=64,
        warmup=False,
        num_pages=64,
        page_size=8,
        max_num_seqs=4,
        max_num_batched_tokens=32,
    )


def test_generate_returns_final_outputs_whatever_the_kind_and_keeps_the_params(llm):
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, output_kind=DELTA)
    (delta_asked,) = llm.generate(["def f"], params, use_tqdm=False)
    assert params.output_kind is DELTA  # the caller's params are not changed
    (plain,) = llm.generate(["def f"], dataclasses.replace(params, output_kind=CUMULATIVE))
    assert delta_asked.outputs == plain.outputs and len(plain.outputs[0].token_ids) == 6


def test_generate_stream_follows_the_params_output_kind(llm):
    base = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    (final,) = llm.generate(["def f"], base, use_tqdm=False)
    cumulative = list(llm.generate_stream(["def f"], base))
    assert [len(o.outputs[0].token_ids) for o in cumulative] == [1, 2, 3, 4, 5, 6]
    delta = list(llm.generate_stream(["def f"], dataclasses.replace(base, output_kind=DELTA)))
    assert [len(o.outputs[0].token_ids) for o in delta] == [1] * 6
    assert "".join(o.outputs[0].text for o in delta) == final.outputs[0].text
    only = list(llm.generate_stream(["def f"], dataclasses.replace(base, output_kind=FINAL_ONLY)))
    assert len(only) == 1 and only[0].outputs == final.outputs
    assert cumulative[-1].outputs == final.outputs


def test_the_progress_bar_counts_delta_outputs_tokens(llm):
    bars = []

    class Bar:
        def __init__(self, **kwargs):
            self.n, self.format_dict = 0, {"elapsed": 2.0}
            bars.append(self)

        def set_postfix_str(self, text, refresh=True):
            self.postfix = text

        def update(self, n):
            self.n += n

        def close(self):
            pass

    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, output_kind=DELTA)
    list(llm.generate_stream(["a", "bc"], params, use_tqdm=Bar))
    # 1 + 2 prompt bytes and 2 x 5 tokens over the bar's 2 s, as for cumulative outputs.
    assert bars[0].n == 2
    assert bars[0].postfix == "est. speed input: 1.50 toks/s, output: 5.00 toks/s"


def test_generate_with_stop_strings(llm):
    base = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    (ref,) = llm.generate(["def f"], base, use_tqdm=False)
    text = ref.outputs[0].text
    stop = text[3:5]
    (out,) = llm.generate(["def f"], dataclasses.replace(base, stop=[stop]), use_tqdm=False)
    assert out.outputs[0].text == text[: text.find(stop)]
    assert out.outputs[0].stop_reason == stop and out.outputs[0].finish_reason == "stop"
    assert llm.engine.pool.num_in_use == 0
