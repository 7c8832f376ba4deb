"""lm-evaluation-harness against a started `paxkv-serve`, run as a user runs it:
`local-completions` with `tokenizer_backend=remote` (the server's /tokenize, /detokenize
and /tokenizer_info) and `max_length` the server's `max_model_len`, on three tasks of
local documents (tests/serve/lm_eval_tasks/): multiple choice (loglikelihood), perplexity
(loglikelihood_rolling) and generate_until; and `local-chat-completions` generating from
chat messages. What lm-eval computed, read from its logged samples, must be `LLM.score`'s
teacher-forced logprobs and `LLM.generate` / `LLM.chat`'s greedy text, in process.

tiny-py's tokens are the UTF-8 bytes of the text, and it has no BOS or EOS: lm-eval's
rolling windows start with `prefix_token_id`, None without either, so the model args
name one (`custom_prefix_token_id`).
"""

from pathlib import Path

import numpy as np
import pytest
from serve_env import CHAT_TEMPLATE, MAX_MODEL_LEN

from paxkv import SamplingParams
from paxkv.models import CHECKPOINTS

lm_eval = pytest.importorskip("lm_eval")
lm_eval_tasks = pytest.importorskip("lm_eval.tasks")

MODEL = "tiny-py"
TASKS_DIR = Path(__file__).parent / "lm_eval_tasks"
PREFIX = "\n"  # the token rolling windows start with (lm-eval's custom_prefix_token_id)
MAX_GEN_TOKS = 16  # lm_eval_tasks/paxkv_until.yaml
STOP = "\n"  # paxkv_until.yaml's `until`
CHAT_STOP = "\n\n"  # tiny-py answers a chat with a newline first: a stop further on


def _evaluate(
    model: str, base_url: str, tasks: list[str], backend: str = "remote", **kwargs
) -> dict:
    """lm-eval's `simple_evaluate` of `tasks` on `model` at `base_url`, one request at a
    time, failing at the first refusal; with every sample logged. `backend`: where
    `local-completions` tokenizes, "remote" (the server) or "huggingface" (tiny-py's
    shipped tokenizer.json, through transformers)."""
    args = {
        "model": MODEL,
        "base_url": base_url,
        "num_concurrent": 1,
        "max_retries": 1,
        "max_length": MAX_MODEL_LEN,
    }
    if model == "local-completions":
        args |= {"tokenizer_backend": backend, "custom_prefix_token_id": ord(PREFIX)}
        if backend == "huggingface":
            args["tokenizer"] = CHECKPOINTS["tiny-py"]
    model_args = ",".join(f"{k}={v}" for k, v in args.items())
    manager = lm_eval_tasks.TaskManager(include_path=str(TASKS_DIR), include_defaults=False)
    results = lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=tasks,
        task_manager=manager,
        log_samples=True,
        bootstrap_iters=0,
        # Leave the process's global RNGs alone: other test files share this worker.
        random_seed=None,
        numpy_random_seed=None,
        torch_random_seed=None,
        **kwargs,
    )
    assert set(results["results"]) == set(tasks)
    return results


def _samples(results: dict, task: str) -> list[dict]:
    """The task's logged samples in document order."""
    samples = sorted(results["samples"][task], key=lambda s: s["doc_id"])
    assert [s["doc_id"] for s in samples] == list(range(len(samples)))
    return samples


def _cut(text: str, stop: str) -> str:
    """`text` up to `stop`, as the server cuts a completion at a stop string."""
    return text.split(stop, 1)[0]


def _greedy(llm, prompts: list[list[int]], continuations: list[list[int]]) -> list[bool]:
    """Whether every continuation token is its position's most likely one."""
    outs = llm.generate(
        [{"prompt_token_ids": p + c} for p, c in zip(prompts, continuations, strict=True)],
        SamplingParams(max_tokens=0, prompt_logprobs=1),
        use_tqdm=False,
    )
    return [
        all(
            o.prompt_logprobs[i][o.prompt_token_ids[i]].rank == 1
            for i in range(len(p), len(p) + len(c))
        )
        for o, p, c in zip(outs, prompts, continuations, strict=True)
    ]


@pytest.fixture(scope="module")
def completions(server):
    return _evaluate(
        "local-completions",
        f"{server.url}/completions",
        ["paxkv_choice", "paxkv_rolling", "paxkv_until"],
    )


def test_multiple_choice_loglikelihoods_are_llm_score(completions, llm):
    samples = _samples(completions, "paxkv_choice")
    # The documents have no trailing space and the task no target delimiter, so lm-eval
    # scores each choice's bytes right after the context's.
    ctx = [list(s["doc"]["context"].encode()) for s in samples for _ in s["doc"]["choices"]]
    cont = [list(c.encode()) for s in samples for c in s["doc"]["choices"]]
    got = [r for s in samples for r in s["filtered_resps"]]
    assert len(got) == len(ctx) == 15
    want = [float(np.sum(s, dtype=np.float64)) for s in llm.score(ctx, cont)]
    np.testing.assert_allclose([ll for ll, _ in got], want, rtol=0, atol=1e-5)
    greedy = _greedy(llm, ctx, cont)
    assert any(greedy) and not all(greedy)
    assert [g for _, g in got] == greedy


def test_the_huggingface_tokenizer_backend_reads_tiny_py_as_the_server_does(server, completions):
    """tiny-py's tokenizer.json, read by transformers in lm-eval: the same token ids and
    so the same loglikelihoods as tokenizing on the server."""
    pytest.importorskip("transformers")
    local = _evaluate(
        "local-completions", f"{server.url}/completions", ["paxkv_choice"], backend="huggingface"
    )
    got = [r for s in _samples(local, "paxkv_choice") for r in s["filtered_resps"]]
    want = [r for s in _samples(completions, "paxkv_choice") for r in s["filtered_resps"]]
    assert len(got) == 15 and got == want


def test_rolling_loglikelihoods_are_llm_score(completions, llm):
    samples = _samples(completions, "paxkv_rolling")
    texts = [list(s["doc"]["text"].encode()) for s in samples]
    # One window each: lm-eval's hold max_length less the prefix and the generated token.
    assert all(len(t) <= MAX_MODEL_LEN - 2 for t in texts)
    assert any(len(t) > len(s["doc"]["text"]) for t, s in zip(texts, samples, strict=True))
    want = [
        float(np.sum(s, dtype=np.float64))
        for s in llm.score([list(PREFIX.encode())] * len(texts), texts)
    ]
    got = [s["filtered_resps"][0] for s in samples]
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    # Perplexity per byte: exp of minus the loglikelihood over the bytes, pooled.
    byte_perplexity = np.exp(-np.sum(want) / sum(len(t) for t in texts))
    np.testing.assert_allclose(
        completions["results"]["paxkv_rolling"]["byte_perplexity,none"], byte_perplexity, rtol=1e-6
    )


def test_generate_until_is_greedy_generate_cut_at_the_stop(completions, llm):
    samples = _samples(completions, "paxkv_until")
    prompts = [s["doc"]["prompt"] for s in samples]
    outs = llm.generate(
        prompts, SamplingParams(temperature=0, max_tokens=MAX_GEN_TOKS), use_tqdm=False
    )
    texts = [o.outputs[0].text for o in outs]
    assert any(STOP in t for t in texts)  # the cut is exercised
    assert [s["filtered_resps"][0] for s in samples] == [_cut(t, STOP) for t in texts]


def test_chat_completions_generate_as_llm_chat(server, llm):
    results = _evaluate(
        "local-chat-completions",
        f"{server.url}/chat/completions",
        ["paxkv_until"],
        apply_chat_template=True,
        gen_kwargs={"until": [CHAT_STOP]},
    )
    samples = _samples(results, "paxkv_until")
    conversations = [[{"role": "user", "content": s["doc"]["prompt"]}] for s in samples]
    outs = llm.chat(
        conversations,
        SamplingParams(temperature=0, max_tokens=MAX_GEN_TOKS),
        use_tqdm=False,
        chat_template=CHAT_TEMPLATE,
    )
    want = [_cut(o.outputs[0].text, CHAT_STOP) for o in outs]
    assert any(want)  # something to compare
    assert [s["filtered_resps"][0] for s in samples] == want
