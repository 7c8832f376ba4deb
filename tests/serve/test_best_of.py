"""`best_of` > `n` on /v1/completions, over HTTP with the `openai` client: the server
samples best_of completions and answers the n of highest cumulative logprob, as the
same seeded request with n = best_of shows; logprobs only if asked; bad values 400."""

import httpx
import openai
import pytest

MODEL = "tiny-py"


def _ranked(server, prompt, best_of, seed):
    """The best_of completions of the same seeded request, with their cumulative logprobs."""
    client = openai.OpenAI(base_url=server.url, api_key="none")
    out = client.completions.create(
        model=MODEL, prompt=prompt, n=best_of, max_tokens=8, temperature=1.8, seed=seed, logprobs=0
    )
    return [
        (c.text, sum(c.logprobs.token_logprobs)) for c in sorted(out.choices, key=lambda c: c.index)
    ]


@pytest.mark.parametrize("logprobs", [None, 1])
def test_best_of_answers_the_n_most_likely(server, logprobs):
    client = openai.OpenAI(base_url=server.url, api_key="none")
    prompt, seed = "# ", 11
    extra = {} if logprobs is None else {"logprobs": logprobs}
    out = client.completions.create(
        model=MODEL,
        prompt=prompt,
        n=2,
        best_of=5,
        max_tokens=8,
        temperature=1.8,
        seed=seed,
        **extra,
    )
    samples = _ranked(server, prompt, 5, seed)
    assert len({t for t, _ in samples}) > 2  # distinct samples: the choice is a real one
    top = sorted(range(5), key=lambda j: -samples[j][1])[:2]
    want = [samples[j][0] for j in sorted(top)]
    assert [c.index for c in out.choices] == [0, 1]
    assert [c.text for c in out.choices] == want
    assert all((c.logprobs is None) == (logprobs is None) for c in out.choices)
    assert out.usage.completion_tokens == 5 * 8  # every sample made is counted


def test_bad_best_of_is_refused_naming_it(server):
    for body in (
        {"prompt": "x", "n": 3, "best_of": 2},
        {"prompt": "x", "best_of": 0},
        {"prompt": "x", "best_of": "two"},
        {"prompt": "x", "best_of": 3, "stream": True},
    ):
        r = httpx.post(f"{server.url}/completions", json={"model": MODEL, **body}, timeout=30)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["param"] == "best_of", (body, r.json())


def test_user_is_taken_and_suffix_refused(server):
    client = openai.OpenAI(base_url=server.url, api_key="none", max_retries=0)
    out = client.completions.create(model=MODEL, prompt="x", max_tokens=2, user="alice")
    assert len(out.choices) == 1
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, suffix="}")
    assert e.value.body["param"] == "suffix"


def test_a_seed_gives_each_choice_its_own_sample_reproducibly(server):
    client = openai.OpenAI(base_url=server.url, api_key="none", max_retries=0)

    def texts(seed):
        out = client.completions.create(
            model=MODEL, prompt="# ", n=3, max_tokens=8, temperature=1.8, seed=seed
        )
        return [c.text for c in sorted(out.choices, key=lambda c: c.index)]

    first = texts(5)
    assert len(set(first)) == 3  # each choice samples on its own
    assert texts(5) == first  # and the seed makes them again
    assert texts(6) != first
