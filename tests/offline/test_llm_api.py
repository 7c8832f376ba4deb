"""The offline `LLM` API: progress bars, warm-up, and `chat` end to end."""

import pytest

from paxkv import LLM, SamplingParams
from paxkv.models import ByteTokenizer, init_model, save_hf_checkpoint
from paxkv.models.llama_config import TINY

SMALL = dict(num_pages=64, page_size=8, max_num_seqs=4, max_num_batched_tokens=32)
GREEDY = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny", dtype="float32", max_model_len=64, warmup=False, **SMALL)


def test_generate_shows_the_processed_prompts_bar_unless_told_not_to(llm, capsys):
    prompts = ["def f(x):", {"prompt_token_ids": [10, 20, 30]}]
    with_bar = llm.generate(prompts, GREEDY)
    err = capsys.readouterr().err  # not a terminal: the bar must cope
    assert "Processed prompts: 100%" in err and "2/2" in err
    assert "est. speed input: " in err and " toks/s, output: " in err
    without = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert capsys.readouterr().err == ""
    assert [o.outputs[0].token_ids for o in with_bar] == [o.outputs[0].token_ids for o in without]


def test_use_tqdm_takes_a_tqdm_like_class_and_rejects_the_rest(llm, capsys):
    bars = []

    class Bar:
        def __init__(self, **kwargs):
            self.kwargs, self.n, self.closed, self.format_dict = kwargs, 0, False, {"elapsed": 2.0}
            bars.append(self)

        def set_postfix_str(self, text, refresh=True):
            self.postfix = text

        def update(self, n):
            self.n += n

        def close(self):
            self.closed = True

    llm.generate(["a", "bc"], GREEDY, use_tqdm=Bar)
    (bar,) = bars
    assert bar.kwargs["total"] == 2 and bar.kwargs["desc"] == "Processed prompts"
    assert bar.n == 2 and bar.closed
    # 1 + 2 prompt bytes and 2 x 5 tokens over the bar's 2 s.
    assert bar.postfix == "est. speed input: 1.50 toks/s, output: 5.00 toks/s"
    with pytest.raises(TypeError, match="use_tqdm must be a bool or a tqdm-like class, got str"):
        llm.generate(["a"], GREEDY, use_tqdm="yes")
    assert not llm.engine.has_unfinished()
    assert capsys.readouterr().err == ""


def test_generate_stream_has_no_bar_by_default(llm, capsys):
    quiet = list(llm.generate_stream(["def f(x):"], GREEDY))
    assert capsys.readouterr().err == ""
    shown = list(llm.generate_stream(["def f(x):"], GREEDY, use_tqdm=True))
    assert "Processed prompts: 100%" in capsys.readouterr().err
    assert [o.outputs[0].token_ids for o in quiet] == [o.outputs[0].token_ids for o in shown]


def test_warmup_compiles_every_step_shape_with_a_bar(capsys):
    with pytest.raises(ValueError, match=r"warmup must be one of .*, got 1"):
        LLM("tiny", warmup=1)
    llm = LLM("tiny", dtype="float32", max_model_len=48, warmup="full", **SMALL)
    first, second = llm.engine.runner.warmup_programs(llm.engine.config.buckets().shapes())
    num_programs = len(first) + len(second)
    err = capsys.readouterr().err
    assert "Compiling step programs: 100%" in err and f"{num_programs}/{num_programs}" in err
    compiled = llm.engine.num_compilations  # fewer when this process compiled them before
    # One forward per shape and the samplers of penalties and scored rows, each once.
    runner = llm.engine.runner
    assert compiled <= num_programs
    assert len(runner.programs_compiled) + runner.programs_reused == num_programs
    long_prompt = {"prompt_token_ids": list(range(40))}  # two chunks, then decode
    llm.generate(["def f(x):", long_prompt], GREEDY, use_tqdm=False)
    penalised = SamplingParams(max_tokens=5, frequency_penalty=0.5, logprobs=3, n=2, seed=1)
    llm.generate(["def f(x):", long_prompt], penalised, use_tqdm=False)
    scoring = SamplingParams(max_tokens=3, prompt_logprobs=2, stop=["\n"], presence_penalty=0.2)
    outs = llm.generate(["def f(x):", long_prompt], scoring, use_tqdm=False)
    assert all(len(o.prompt_logprobs) == len(o.prompt_token_ids) for o in outs)
    scores = llm.score(["def f(x):", list(range(30))], [" return x", list(range(3, 9))])
    assert [len(s) for s in scores] == [9, 6]
    # Only the sampler of scored rows with penalties (a mix warm-up leaves) compiled since.
    later = runner.programs_compiled[num_programs - runner.programs_reused :]
    assert all(name == "resample" and key[2] and key[3] for name, key in later), later
    assert llm.engine.num_compilations <= compiled + len(later)


def test_chat_needs_a_template_or_one_passed(llm):
    conversation = [{"role": "user", "content": "Hi"}]
    with pytest.raises(ValueError, match=r"has no chat template .*pass chat_template="):
        llm.chat(conversation)
    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
    template += "{% if add_generation_prompt %}<assistant>{% endif %}"
    (out,) = llm.chat(conversation, GREEDY, chat_template=template, use_tqdm=False)
    assert out.prompt == "<user>Hi\n<assistant>"
    assert out.prompt_token_ids == ByteTokenizer().encode(out.prompt)
    (ref,) = llm.generate(out.prompt, GREEDY, use_tqdm=False)
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids


def test_chat_checks_everything_before_submitting(llm):
    template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    good = [{"role": "user", "content": "Hi"}]
    long = [{"role": "user", "content": "x" * 80}]  # over max_model_len=64
    cases = [
        (
            [good, [{"role": "user", "content": 3}]],
            {},
            TypeError,
            "conversation 1, message 0: content must be a str",
        ),
        ([good, long], {}, ValueError, r"conversation 1: "),
        (
            [good, good],
            {"sampling_params": [GREEDY] * 3},
            ValueError,
            "3 sampling_params for 2 conversations",
        ),
        (
            good,
            {"add_generation_prompt": True, "continue_final_message": True},
            ValueError,
            "cannot both be True",
        ),
    ]
    for messages, kwargs, error, match in cases:
        with pytest.raises(error, match=match):
            llm.chat(messages, chat_template=template, use_tqdm=False, **kwargs)
        assert not llm.engine.has_unfinished()


@pytest.fixture(scope="module")
def chat_checkpoint(tmp_path_factory):
    """A random tiny model in Hugging Face layout with a BPE tokenizer and Llama 3's template."""
    from chat_checkpoints import LLAMA3, write_tokenizer

    path = tmp_path_factory.mktemp("chat_checkpoint")
    save_hf_checkpoint(init_model(TINY.replace(vocab_size=320), seed=3), path)
    write_tokenizer(path, LLAMA3)
    return path


def test_chat_equals_generate_on_the_rendered_prompt(chat_checkpoint, capsys):
    pytest.importorskip("jinja2")
    pytest.importorskip("tokenizers")
    from chat_checkpoints import CONVERSATIONS, SYSTEM, USER, transformers_side

    llm = LLM(str(chat_checkpoint), max_model_len=256, warmup=False, **SMALL)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outs = llm.chat(CONVERSATIONS, params)
    assert "Processed prompts: 100%" in capsys.readouterr().err
    texts, ids = transformers_side(chat_checkpoint, CONVERSATIONS, add_generation_prompt=True)
    assert [o.prompt for o in outs] == texts
    assert [o.prompt_token_ids for o in outs] == ids
    ref = llm.generate([{"prompt_token_ids": i} for i in ids], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [r.outputs[0].token_ids for r in ref]
    assert all(len(o.outputs[0].token_ids) == 6 for o in outs)
    # One conversation, not a list of them, gives a list of one output.
    (one,) = llm.chat(CONVERSATIONS[1], params, use_tqdm=False)
    assert one.outputs[0].token_ids == outs[1].outputs[0].token_ids
    partial = [SYSTEM, USER, {"role": "assistant", "content": "I am"}]
    (cont,) = llm.chat(
        partial, params, add_generation_prompt=False, continue_final_message=True, use_tqdm=False
    )
    assert cont.prompt.endswith("<|end_header_id|>\n\nI am")
    (texts, ids) = transformers_side(chat_checkpoint, [partial], continue_final_message=True)
    assert cont.prompt_token_ids == ids[0]


def test_chat_without_a_tokenizer_says_so(tmp_path):
    save_hf_checkpoint(init_model(TINY, seed=0), tmp_path)
    llm = LLM(str(tmp_path), max_model_len=64, warmup=False, **SMALL)
    with pytest.raises(ValueError, match="chat\\(\\) needs a tokenizer, and this model has none"):
        llm.chat([{"role": "user", "content": "Hi"}], chat_template="{{ messages }}")
    # A text prompt's error says how to give the engine one, by a name that exists.
    with pytest.raises(ValueError, match=r"pip install -e '.\[tokenizers\]'") as e:
        llm.generate("Hi", use_tqdm=False)
    assert "tokenizer= to Engine(...) or LLM.from_model(...)" in str(e.value)
    assert "paxkv.models.load_tokenizer(checkpoint_dir)" in str(e.value)
    import paxkv.models

    assert callable(paxkv.models.load_tokenizer)
