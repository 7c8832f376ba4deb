"""LoRA adapters against PEFT: each request's tokens and logits equal transformers'
model with that adapter merged (`merge_and_unload`), float32, in a batch mixing four
adapters and the base model, with chunked prefill, preemption and slot evictions."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
from hf_reference import greedy
from peft_adapters import ALL_TARGETS, write_adapter, write_checkpoint

from paxkv import Engine, EngineConfig, LoRARequest, SamplingParams
from paxkv.models import load_hf_checkpoint
from paxkv.models.gemma_config import TINY_GEMMA3
from paxkv.models.llama_config import TINY

pytest.importorskip("peft")

FAMILIES = {"llama": TINY, "gemma3": TINY_GEMMA3.replace(sliding_window=8)}
# Four adapters unlike each other: ranks, scalings (rsLoRA, a per-module rank) and targets.
ADAPTERS = {
    "all-r4": dict(r=4, alpha=8, targets=ALL_TARGETS),
    "qv-rslora": dict(r=8, alpha=16, targets=["q_proj", "v_proj"], rslora=True),
    "mlp-r2": dict(r=2, alpha=4, targets=["gate_proj", "up_proj", "down_proj"]),
    "attn-pattern": dict(
        r=8, alpha=8, targets=["q_proj", "k_proj", "v_proj", "o_proj"], rank_pattern={"o_proj": 4}
    ),
}
MAX_RANK = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


_BUILT: dict = {}


def _family(name, tmp_path_factory):
    """(config, base dir, base torch model, {name: (adapter dir, merged torch model)}),
    made once per family."""
    if name not in _BUILT:
        config = FAMILIES[name]
        root = tmp_path_factory.mktemp(f"lora-{name}")
        base = write_checkpoint(config, root / "base")
        adapters = {}
        for i, (adapter, spec) in enumerate(sorted(ADAPTERS.items())):
            path = root / adapter
            adapters[adapter] = (str(path), write_adapter(base, path, seed=i + 1, **spec))
        _BUILT[name] = config, str(root / "base"), base, adapters
    return _BUILT[name]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def setup(request, tmp_path_factory):
    """Each family: the parity of the logits and of a mixed batch."""
    return _family(request.param, tmp_path_factory)


@pytest.fixture(scope="module", params=["llama", pytest.param("gemma3", marks=pytest.mark.slow)])
def engine_setup(request, tmp_path_factory):
    """The engine's adapter bookkeeping (methods, updates, keys, errors, removal,
    preemption), which no family changes: Llama in CI, Gemma 3 too with -m slow."""
    return _family(request.param, tmp_path_factory)


def test_logits_equal_the_merged_models(setup):
    torch = pytest.importorskip("torch")
    config, base_dir, base, adapters = setup
    _, model = load_hf_checkpoint(base_dir)
    model.add_lora_slots(len(adapters), MAX_RANK)
    names = sorted(adapters)
    for slot, name in enumerate(names, start=1):
        contents = model.lora_slot_contents(adapters[name][0], MAX_RANK)
        _write(model, slot, contents)
    tokens = np.random.default_rng(1).integers(0, config.vocab_size, 24)
    t = jnp.asarray(tokens, jnp.int32)
    with torch.no_grad():
        for slot, name in [(0, None), *enumerate(names, start=1)]:
            reference = base if name is None else adapters[name][1]
            expected = reference(torch.tensor(tokens)[None]).logits[0].numpy()
            got = np.asarray(model.dense_logits(t, lora=jnp.full(24, slot, jnp.int32)))
            np.testing.assert_allclose(got, expected, rtol=0, atol=1e-4, err_msg=f"{name}")
        # Rows of one call under different slots: each row its own adapter.
        mixed = jnp.asarray(np.arange(24) % (len(names) + 1), jnp.int32)
        got = np.asarray(model.dense_logits(t, lora=mixed))
        assert not np.allclose(got[1], np.asarray(model.dense_logits(t))[1], atol=1e-3)


def _write(model, slot, contents):
    """Sets slot `slot` of `model`'s slot arrays to `contents` (by state path)."""
    from flax import nnx

    from paxkv.models.lora import LoRAWeight

    for path, node in nnx.iter_graph(model):
        if isinstance(node, LoRAWeight):
            value = node.get_value()
            lead = (slice(None),) * (value.ndim - 3)
            node.set_value(value.at[(*lead, slot)].set(contents[path]))


def test_ragged_method_equals_gather(engine_setup):
    config, base_dir, _, adapters = engine_setup
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, config.vocab_size, 20), jnp.int32)
    slots = jnp.asarray(np.random.default_rng(3).integers(0, 3, 20), jnp.int32)
    out = {}
    for method in ("gather", "ragged"):
        _, model = load_hf_checkpoint(base_dir)
        model.add_lora_slots(2, MAX_RANK, method)
        for slot, name in enumerate(sorted(adapters)[:2], start=1):
            _write(model, slot, model.lora_slot_contents(adapters[name][0], MAX_RANK))
        out[method] = np.asarray(model.dense_logits(tokens, lora=slots))
    np.testing.assert_allclose(out["ragged"], out["gather"], rtol=0, atol=1e-5)


def _engine(base_dir, **overrides):
    _, model = load_hf_checkpoint(base_dir)
    config = dict(
        num_pages=64,
        page_size=8,
        max_model_len=64,
        max_num_seqs=4,
        max_num_batched_tokens=16,  # prompts of 20+ tokens prefill in chunks
        token_buckets=(16,),
        page_buckets=(8,),
        enable_lora=True,
        max_loras=2,  # fewer than the four adapters: slots are evicted and reloaded
        max_lora_rank=MAX_RANK,
    )
    return Engine(model, EngineConfig(**(config | overrides)))


def _run(engine, submissions):
    """Runs `(prompt ids, lora_request)` pairs; their greedy token ids, in order."""
    for i, (prompt, lora) in enumerate(submissions):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, GREEDY, lora_request=lora)
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    for i, (_, lora) in enumerate(submissions):  # each output names its adapter, as vLLM's
        named = lora if lora is None or isinstance(lora, LoRARequest) else None
        if isinstance(lora, str):
            named = next(r for r in engine.list_loras() if r.lora_name == lora)
        assert done[str(i)].lora_request == named
    return [done[str(i)].outputs[0].token_ids for i in range(len(submissions))]


def test_engine_mixed_batch_equals_the_merged_models(setup):
    config, base_dir, base, adapters = setup
    rng = np.random.default_rng(4)
    shared = rng.integers(1, config.vocab_size, 16).tolist()  # two pages every prompt shares
    names = [*sorted(adapters), None]
    submissions = []
    for i in range(10):
        prompt = shared + rng.integers(1, config.vocab_size, 4 + 3 * i % 11).tolist()
        name = names[i % len(names)]
        lora = (
            None
            if name is None
            else LoRARequest(name, 1 + sorted(adapters).index(name), adapters[name][0])
        )
        submissions.append((prompt, lora))
    expected = [
        greedy(base if lora is None else adapters[lora.lora_name][1], p, GREEDY.max_tokens)
        for p, lora in submissions
    ]
    # 13 usable pages a group: fewer than four long prompts need (Gemma 3 has two groups).
    engine = _engine(base_dir, num_pages=14 if config is TINY else 27)
    engine.warmup()
    compiled = engine.num_compilations
    assert _run(engine, submissions) == expected
    stats = engine.stats()
    # What the test claims to cover happened: chunks, preemption, evictions, cache hits.
    assert stats["num_preemptions"] > 0
    assert stats["lora_evictions"] > 0 and stats["lora_loads"] > len(adapters)
    if config is TINY:  # (Gemma 3's window groups keep too few pages here to hit)
        assert stats["prefix_cache_hits"] > 0
    assert engine.num_compilations == compiled, engine.runner.programs_compiled
    assert engine.pool.num_free == engine.pool.num_usable  # nothing leaked


def test_update_lora_serves_the_new_weights(engine_setup, tmp_path):
    from safetensors.numpy import load_file

    config, base_dir, _, adapters = engine_setup
    old, new = sorted(adapters)[:2]
    engine = _engine(base_dir, max_loras=1)
    prompt = np.random.default_rng(5).integers(1, config.vocab_size, 12).tolist()
    first = _run(engine, [(prompt, LoRARequest("tuned", 1, adapters[old][0]))])
    assert first == [greedy(adapters[old][1], prompt, GREEDY.max_tokens)]
    compiled = engine.num_compilations
    tensors = load_file(f"{adapters[new][0]}/adapter_model.safetensors")
    with open(f"{adapters[new][0]}/adapter_config.json") as f:
        adapter_config = json.load(f)
    engine.update_lora("tuned", tensors, adapter_config)
    # The same prompt again: its cached pages were computed under the old weights.
    assert _run(engine, [(prompt, "tuned")]) == [
        greedy(adapters[new][1], prompt, GREEDY.max_tokens)
    ]
    assert engine.num_compilations == compiled


def test_a_page_computed_under_one_adapter_never_serves_another(engine_setup):
    config, base_dir, base, adapters = engine_setup
    a, b = sorted(adapters)[:2]
    engine = _engine(base_dir)
    prompt = np.random.default_rng(6).integers(1, config.vocab_size, 33).tolist()
    requests = {n: LoRARequest(n, i, adapters[n][0]) for i, n in enumerate((a, b), start=1)}
    hits = []
    for name in (a, b, None, a):
        lora = requests.get(name)
        reference = base if name is None else adapters[name][1]
        assert _run(engine, [(prompt, lora)]) == [greedy(reference, prompt, GREEDY.max_tokens)]
        hits.append(engine.stats()["prefix_cache_hits"])
    assert hits[0] == hits[1] == hits[2]  # the same prompt under another adapter: no hit
    if config is TINY:
        assert hits[3] > hits[2]  # under its own adapter again: a hit


def test_bad_adapters_are_refused_and_the_batch_runs_on(engine_setup, tmp_path):
    from peft_adapters import write_random_adapter

    config, base_dir, base, adapters = engine_setup
    engine = _engine(base_dir, max_lora_rank=4)
    prompt = np.random.default_rng(7).integers(1, config.vocab_size, 10).tolist()
    good = sorted(adapters)[0]  # rank 4
    engine.add_request("ok", {"prompt_token_ids": prompt}, GREEDY)
    engine.add_request(
        "ok-lora",
        {"prompt_token_ids": prompt},
        GREEDY,
        lora_request=LoRARequest(good, 1, adapters[good][0]),
    )
    too_big = "qv-rslora"  # rank 8
    with pytest.raises(ValueError, match="rank r=8 exceeds max_lora_rank=4"):
        engine.add_request(
            "x",
            {"prompt_token_ids": prompt},
            GREEDY,
            lora_request=LoRARequest(too_big, 2, adapters[too_big][0]),
        )
    other = config.replace(hidden_size=config.hidden_size // 2)
    wrong_base = write_random_adapter(
        tmp_path / "other", other, r=2, alpha=2, targets=["q_proj"], seed=0
    )
    with pytest.raises(ValueError, match="does not match the base model"):
        engine.add_lora(LoRARequest("other", 3, wrong_base))
    head = write_random_adapter(tmp_path / "head", config, r=2, alpha=2, targets=["q_proj"], seed=0)
    with open(f"{head}/adapter_config.json") as f:
        cfg = json.load(f)
    from safetensors.numpy import load_file, save_file

    tensors = load_file(f"{head}/adapter_model.safetensors")
    tensors["base_model.model.lm_head.lora_A.weight"] = np.ones((2, config.hidden_size), np.float32)
    save_file(tensors, f"{head}/adapter_model.safetensors")
    with pytest.raises(ValueError, match="lm_head"):
        engine.add_lora(LoRARequest("head", 4, head))
    cfg["use_dora"] = True
    with pytest.raises(ValueError, match="use_dora"):
        engine.update_lora("dora", load_file(f"{adapters[good][0]}/adapter_model.safetensors"), cfg)
    with pytest.raises(ValueError, match="'nobody' is not loaded"):
        engine.add_request("y", {"prompt_token_ids": prompt}, GREEDY, lora_request="nobody")
    with pytest.raises(ValueError, match="enable_lora=False"):
        _engine(base_dir, enable_lora=False).add_request(
            "z", {"prompt_token_ids": prompt}, GREEDY, lora_request=good
        )
    # The requests admitted before every refusal finish, each as its reference says.
    done = {}
    while engine.has_unfinished():
        done |= {o.request_id: o for o in engine.step() if o.finished}
    assert sorted(done) == ["ok", "ok-lora"]
    assert done["ok"].outputs[0].token_ids == greedy(base, prompt, GREEDY.max_tokens)
    assert done["ok-lora"].outputs[0].token_ids == greedy(
        adapters[good][1], prompt, GREEDY.max_tokens
    )
    assert [r.lora_name for r in engine.list_loras()] == [good]


def test_a_removed_adapter_ends_its_queued_requests_with_the_reason(engine_setup):
    config, base_dir, _, adapters = engine_setup
    engine = _engine(base_dir, max_num_seqs=1, max_loras=1)
    a, b = sorted(adapters)[:2]
    prompt = np.random.default_rng(8).integers(1, config.vocab_size, 10).tolist()
    engine.add_request(
        "first",
        {"prompt_token_ids": prompt},
        GREEDY,
        lora_request=LoRARequest(a, 1, adapters[a][0]),
    )
    engine.add_request(
        "queued",
        {"prompt_token_ids": prompt},
        GREEDY,
        lora_request=LoRARequest(b, 2, adapters[b][0]),
    )
    engine.step()  # "first" runs; "queued" waits for the one sequence slot
    assert engine.remove_lora(b)
    done = {}
    while engine.has_unfinished():
        done |= {o.request_id: o for o in engine.step() if o.finished}
    assert done["first"].outputs[0].finish_reason == "length"
    assert done["queued"].outputs[0].finish_reason == "abort"
    assert f"{b!r} was removed" in done["queued"].error
    assert engine.pool.num_free == engine.pool.num_usable


def test_requests_started_under_an_adapter_finish_under_it_through_preemption(engine_setup):
    from safetensors.numpy import load_file

    config, base_dir, _, adapters = engine_setup
    old, new = sorted(adapters)[:2]
    # Room for one long sequence at a time (7 pages, uniform paging: Gemma 3's window
    # groups would give pages back): the second preempts the first.
    engine = _engine(base_dir, max_loras=1, num_pages=12, hybrid_kv_cache=False)
    rng = np.random.default_rng(9)
    prompts = [rng.integers(1, config.vocab_size, 40).tolist() for _ in range(2)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    lora = LoRARequest("tuned", 1, adapters[old][0])
    for i, p in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": p}, params, lora_request=lora)
    done = {}
    for _ in range(3):  # both have started
        done |= {o.request_id: o for o in engine.step() if o.finished}
    tensors = load_file(f"{adapters[new][0]}/adapter_model.safetensors")
    with open(f"{adapters[new][0]}/adapter_config.json") as f:
        engine.update_lora("tuned", tensors, json.load(f))
    while engine.has_unfinished():
        done |= {o.request_id: o for o in engine.step() if o.finished}
    assert engine.stats()["num_preemptions"] > 0
    for i, p in enumerate(prompts):
        assert done[str(i)].outputs[0].token_ids == greedy(adapters[old][1], p, 16)
