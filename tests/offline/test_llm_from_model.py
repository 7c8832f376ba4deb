"""`LLM.from_model` and `LLM.get_weights`: an engine over a model already built, token
for token against `LLM("tiny")` and against an engine built fresh from new weights; the
weights read back as the engine's own arrays, in the model's layout, and fed back."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from paxkv import LLM, SamplingParams
from paxkv.models import load_model

ENGINE = dict(
    num_pages=64,
    page_size=16,
    max_num_seqs=4,
    max_num_batched_tokens=64,
    max_model_len=256,
    warmup=False,
)
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
_RNG = np.random.default_rng(11)
PROMPTS = [{"prompt_token_ids": _RNG.integers(1, 256, n).tolist()} for n in (5, 23, 70)]
TEXTS = ["def f(x):", "hello, world"]


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny", seed=0)


@pytest.fixture(scope="module")
def reference():
    return LLM("tiny", seed=0, **ENGINE)


def _tokens(llm, prompts=PROMPTS) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def _by_path(tree) -> dict[tuple, jax.Array]:
    """The leaves of a pure dict by their key path."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {tuple(k.key for k in path): leaf for path, leaf in flat}


def _engine_params(llm) -> dict[tuple, jax.Array]:
    """The Param arrays the engine steps with, by path."""
    return {
        tuple(path): var.get_value()
        for path, var in nnx.to_flat_state(llm.engine.runner.params)
        if isinstance(var, nnx.Param)
    }


def _pointers(leaves: dict) -> dict[tuple, int]:
    return {p: x.unsafe_buffer_pointer() for p, x in leaves.items()}


def _perturbed(tree: dict, seed: int) -> dict:
    """`tree` * 1.01 + noise, as host NumPy arrays of the same dtypes."""
    rng = np.random.default_rng(seed)
    return jax.tree.map(
        lambda x: (np.asarray(x) * 1.01 + rng.normal(0, 0.02, x.shape)).astype(x.dtype), tree
    )


def _model_with(model, params: dict):
    """A copy of `model` holding `params`."""
    copy = nnx.clone(model)
    state = nnx.state(copy, nnx.Param)
    nnx.replace_by_pure_dict(state, jax.tree.map(jnp.asarray, params))
    nnx.update(copy, state)
    return copy


def test_from_model_generates_what_llm_of_the_preset_does(tiny, reference):
    _, model, tokenizer = tiny
    expected = _tokens(reference)
    assert len({len(t) for t in expected}) == 1 and len({tuple(t) for t in expected}) == 3
    llm = LLM.from_model(model, **ENGINE)
    assert _tokens(llm) == expected
    assert llm.engine.config == reference.engine.config

    with_text = LLM.from_model(model, tokenizer=tokenizer, **ENGINE)
    assert with_text.get_tokenizer() is tokenizer
    assert _tokens(with_text) == expected
    outs = with_text.generate(TEXTS, GREEDY, use_tqdm=False)
    ref = reference.generate(TEXTS, GREEDY, use_tqdm=False)
    assert [o.prompt for o in outs] == TEXTS
    assert [o.prompt_token_ids for o in outs] == [list(tokenizer.encode(t)) for t in TEXTS]
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
    assert [o.outputs[0].text for o in outs] == [o.outputs[0].text for o in ref]

    # The engine serves the model it is given: other weights, other tokens.
    _, other, _ = load_model("tiny", seed=1)
    assert _tokens(LLM.from_model(other, **ENGINE)) != expected


def test_from_model_without_a_tokenizer_takes_token_ids_only(tiny):
    _, model, _ = tiny
    llm = LLM.from_model(model, **ENGINE)
    assert llm.get_tokenizer() is None
    with pytest.raises(ValueError, match=r"prompt 1: a string prompt needs a tokenizer"):
        llm.generate([PROMPTS[0], "def f(x):"], GREEDY, use_tqdm=False)
    with pytest.raises(
        ValueError, match=r"prompts\[0\] is a string, and the model has no tokenizer"
    ):
        llm.score(["def f(x):"], [[1, 2]])
    assert not llm.engine.has_unfinished()  # the token-id prompt was not submitted either
    assert len(_tokens(llm, PROMPTS[:1])[0]) == GREEDY.max_tokens


def test_get_weights_are_the_engines_own_arrays_in_the_models_layout(tiny):
    _, model, _ = tiny
    expected = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    llm = LLM.from_model(model, **ENGINE)
    weights = llm.get_weights()
    assert type(weights) is dict
    assert jax.tree.structure(weights) == jax.tree.structure(expected)
    got, want = _by_path(weights), _by_path(expected)
    assert list(got) == list(want) and len(got) > 10
    held = _engine_params(llm)
    assert set(held) == set(got)
    for path, leaf in got.items():
        assert isinstance(leaf, jax.Array), path
        np.testing.assert_array_equal(np.asarray(leaf), np.asarray(want[path]), err_msg=str(path))
    # No copy: each leaf is the array the engine steps with, the caller's model's own.
    assert _pointers(got) == _pointers(held) == _pointers(want)


def test_update_weights_shows_in_get_weights_and_round_trips(tiny):
    _, model, _ = tiny
    llm = LLM.from_model(model, **ENGINE)
    before = _tokens(llm)
    old = llm.get_weights()
    old_pointers = _pointers(_by_path(old))
    original = {p: np.asarray(x) for p, x in _by_path(old).items()}

    new = _perturbed(old, seed=1)
    assert llm.update_weights(new) == 1 == llm.engine.weight_version
    after = llm.get_weights()
    got, held = _by_path(after), _engine_params(llm)
    assert jax.tree.structure(after) == jax.tree.structure(old)
    for path, value in _by_path(new).items():
        assert isinstance(got[path], jax.Array), path
        np.testing.assert_array_equal(np.asarray(got[path]), value, err_msg=str(path))
    assert _pointers(got) == _pointers(held)
    assert not set(_pointers(got).values()) & set(old_pointers.values())
    # The dict read before the update still holds the old arrays, alive and unchanged.
    for path, leaf in _by_path(old).items():
        np.testing.assert_array_equal(np.asarray(leaf), original[path], err_msg=str(path))
    fresh = _tokens(LLM.from_model(_model_with(model, new), **ENGINE))
    assert _tokens(llm) == fresh != before

    # Round trip: the engine's own arrays, changed on the device and given back.
    scaled = jax.tree.map(lambda x: x * 0.99, llm.get_weights())
    assert llm.update_weights(scaled) == 2
    for path, value in _by_path(scaled).items():
        np.testing.assert_array_equal(np.asarray(_by_path(llm.get_weights())[path]), value)
    tokens = _tokens(llm)
    assert tokens == _tokens(LLM.from_model(_model_with(model, scaled), **ENGINE))
    # ... and as they are: the same weights again, the same tokens.
    for copy in (True, False):
        same = llm.get_weights()
        assert llm.update_weights(same, copy=copy) == 3 + (not copy)
        pointers = _pointers(_by_path(llm.get_weights()))
        assert (pointers == _pointers(_by_path(same))) is (not copy)
        assert _tokens(llm) == tokens


def test_from_model_checks_its_arguments(tiny):
    _, model, _ = tiny
    with pytest.raises(TypeError, match=r"unknown arguments \['num_page'\]"):
        LLM.from_model(model, num_page=64)
    for warmup in ("fast", 1, 0, None):
        with pytest.raises(ValueError, match=rf"warmup must be one of .*, got {warmup!r}"):
            LLM.from_model(
                model, warmup=warmup, **{k: v for k, v in ENGINE.items() if k != "warmup"}
            )
    with pytest.raises(ValueError, match=r"pause_timeout_s=-1 must be >= 0"):
        LLM.from_model(model, pause_timeout_s=-1, **ENGINE)
