"""The host KV tier (`kv_host_cache_gib`): pages the device evicts come back bit for bit,
give a device hit's results, never cross weights or salts, stay within the tier's bound,
compile nothing after warm-up and leak no page."""

import jax
import numpy as np
import pytest
from engine_configs import small_config

from paxkv import SamplingParams
from paxkv.engine import Engine
from paxkv.host.prefix_cache import page_keys
from paxkv.models import load_model

PS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0)


def _go(engine, rid, prompt, params=GREEDY, **kw):
    engine.add_request(rid, {"prompt_token_ids": prompt}, params, **kw)
    return engine.run_until_done()[rid]


def _pages(engine, keys):
    """Each cache array's rows of the pages holding `keys` (None: a key not on the device)."""
    pages = [engine.pool.lookup(k) for k in keys]
    if None in pages:
        return None
    return [np.asarray(a)[pages] for a in jax.tree.leaves(engine.kv_cache)]


def _flood(engine, vocab, n, seed=1, length=40):
    rng = np.random.default_rng(seed)
    for i in range(n):
        _go(engine, f"flood{seed}-{i}", rng.integers(0, vocab, length).tolist())


def _engine(model, num_pages=24, gib=0.001, draft_model=None, **kw):
    config = small_config(num_pages=num_pages, kv_host_cache_gib=gib, **kw)
    return Engine(model, config, draft_model=draft_model)


DRAFT = {"method": "draft_model", "model": "unused-by-Engine", "num_speculative_tokens": 3}


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8", "fp8"])
def test_restored_pages_equal_the_evicted_ones_bit_for_bit(tiny, kv_cache_dtype):
    config, model, _ = tiny
    engine = _engine(model, kv_cache_dtype=kv_cache_dtype)
    prompt = np.random.default_rng(0).integers(0, config.vocab_size, 41).tolist()
    keys = page_keys(prompt, PS)  # 5 full pages
    _go(engine, "a", prompt)
    before = _pages(engine, keys)
    assert before is not None
    _flood(engine, config.vocab_size, 6)
    assert all(engine.pool.lookup(k) is None for k in keys)  # gone from the device...
    tier = engine.scheduler.kv_cache_manager.host_tier
    assert all(k in tier for k in keys)  # ... kept on the host
    again = _go(engine, "b", prompt)
    assert again.num_cached_tokens == 40
    after = _pages(engine, keys)
    assert after is not None and len(after) == len(before) == (4 if kv_cache_dtype != "auto" else 2)
    for a, b in zip(after, before, strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))
    stats = engine.stats()
    assert stats["kv_offload_pages_to_device"] == 5
    assert stats["kv_offload_bytes_to_device"] == 5 * tier.page_bytes
    assert engine.pool.num_in_use == 0


def test_a_stacked_cache_restores_every_slot(tiny):
    """Scanned layers hold a page at one row per layer (`page_rows`)."""
    config, _, _ = tiny
    _, model, _ = load_model("tiny", dtype="float32", seed=0, scan_layers=True)
    engine = _engine(model)
    assert engine.kv_cache.stacked
    prompt = np.random.default_rng(2).integers(0, config.vocab_size, 33).tolist()
    keys = page_keys(prompt, PS)
    _go(engine, "a", prompt)
    pool = engine.pool
    rows = engine.kv_cache.num_slots
    offsets = np.arange(rows) * engine.kv_cache.slot_pages

    def stacked_rows():
        pages = np.asarray([pool.lookup(k) for k in keys])
        return np.asarray(engine.kv_cache.kv[0])[(pages[:, None] + offsets).reshape(-1)]

    before = stacked_rows()
    _flood(engine, config.vocab_size, 6)
    assert all(pool.lookup(k) is None for k in keys)
    assert _go(engine, "b", prompt).num_cached_tokens == 32
    np.testing.assert_array_equal(stacked_rows(), before)


@pytest.mark.parametrize("mode", ["sync", "async", "draft"])
def test_a_host_hit_gives_a_device_hits_tokens_and_logprobs(tiny, mode):
    """Multi-turn: each turn's prompt is the whole history. With a pool too small to
    keep the first turn, the tier's restored pages give exactly what a pool large
    enough to keep them gives; without the tier the history is recomputed. With a
    draft model (the target itself) its cache's pages come back too: it has accepted
    exactly what it has when it recomputes them."""
    config, model, _ = tiny
    async_scheduling = mode == "async"
    kw = {"async_scheduling": True} if async_scheduling else {}
    if mode == "draft":
        kw = {"speculative_config": DRAFT, "draft_model": model}
    rng = np.random.default_rng(3)
    history = rng.integers(0, config.vocab_size, 30).tolist()
    turns = [rng.integers(0, config.vocab_size, 5).tolist() for _ in range(3)]
    runs = {}
    for name, pages, gib in (("large", 96, 0.0), ("tier", 24, 0.001), ("off", 24, 0.0)):
        engine = _engine(model, pages, gib, **kw)
        prompt, outs = list(history), []
        for t, turn in enumerate(turns):
            prompt += turn
            out = _go(engine, f"t{t}", prompt)
            outs.append(out)
            prompt += out.outputs[0].token_ids
            _flood(engine, config.vocab_size, 6 if pages == 24 else 0, seed=10 + t)
        assert engine.pool.num_in_use == 0
        engine.scheduler.kv_cache_manager.check_invariants()
        runs[name] = outs
        if mode == "draft":
            accepted = engine.stats()["spec_decode_num_accepted_tokens"]
            runs[name + "-accepted"] = accepted
            assert accepted > 0
    if mode == "draft":
        assert runs["tier-accepted"] == runs["off-accepted"]  # the same floods beside
    for large, tier in zip(runs["large"], runs["tier"], strict=True):
        assert tier.outputs[0].token_ids == large.outputs[0].token_ids
        assert tier.outputs[0].cumulative_logprob == large.outputs[0].cumulative_logprob
        assert tier.num_cached_tokens == large.num_cached_tokens
    # Whole pages; under async scheduling the last output page is not cached yet.
    assert [o.num_cached_tokens for o in runs["tier"][1:]] == (
        [32, 40] if async_scheduling else [40, 48]
    )
    assert [o.num_cached_tokens for o in runs["off"][1:]] == [0, 0]


def test_a_hybrid_models_window_and_global_groups_come_back():
    """Gemma 3 (sliding-window and global layers, a page table each): the window group
    needs only the pages inside its window at the prefix's end; restored pages of both
    groups give a device hit's tokens and logprobs."""
    config, model, _ = load_model("tiny-gemma3", dtype="float32", seed=0)
    rng = np.random.default_rng(8)
    prompt = rng.integers(0, config.vocab_size, 57).tolist()
    follow = prompt + rng.integers(0, config.vocab_size, 4).tolist()
    runs = {}
    for name, pages, gib in (("large", 400, 0.0), ("tier", 64, 0.004)):
        engine = _engine(model, pages, gib)
        assert engine.scheduler.kv_cache_manager.num_groups > 1
        _go(engine, "a", prompt)
        _flood(engine, config.vocab_size, 8 if pages == 64 else 0)
        runs[name] = _go(engine, "b", follow)
        assert engine.pool.num_in_use == 0
        engine.scheduler.kv_cache_manager.check_invariants()
        if gib:
            assert engine.stats()["kv_offload_pages_to_device"] > 0
    assert runs["tier"].num_cached_tokens == runs["large"].num_cached_tokens == 56
    assert runs["tier"].outputs[0].token_ids == runs["large"].outputs[0].token_ids
    assert runs["tier"].outputs[0].cumulative_logprob == runs["large"].outputs[0].cumulative_logprob


def test_another_salt_or_new_weights_never_restore_the_pages(tiny):
    config, model, _ = tiny
    engine = _engine(model)
    prompt = np.random.default_rng(4).integers(0, config.vocab_size, 41).tolist()
    _go(engine, "a", prompt, cache_salt="tenant-1")
    _flood(engine, config.vocab_size, 6)
    assert _go(engine, "b", prompt, cache_salt="tenant-2").num_cached_tokens == 0
    _flood(engine, config.vocab_size, 6, seed=2)
    assert _go(engine, "c", prompt, cache_salt="tenant-1").num_cached_tokens == 40
    _flood(engine, config.vocab_size, 6, seed=3)
    engine.update_weights(engine.runner.params)  # a new weight version
    assert engine.scheduler.kv_cache_manager.host_tier.num_used == 0
    assert _go(engine, "d", prompt, cache_salt="tenant-1").num_cached_tokens == 0


def test_a_flood_keeps_the_tier_within_its_bound_and_no_page_leaks(tiny):
    config, model, _ = tiny
    engine = _engine(model, gib=0.0)
    page_bytes = engine.runner.page_bytes()
    engine = _engine(model, gib=6 * page_bytes / 2**30)  # six host pages
    tier = engine.scheduler.kv_cache_manager.host_tier
    assert tier.num_slots == 6
    rng = np.random.default_rng(5)
    for i in range(12):  # four prompts at once, 60 pages evicted in all
        for j in range(4):
            engine.add_request(
                f"{i}-{j}", {"prompt_token_ids": rng.integers(0, config.vocab_size, 41).tolist()},
                SamplingParams(max_tokens=2),
            )  # fmt: skip
        engine.run_until_done()
        assert tier.num_used <= 6
        tier.check_invariants()
    stats = engine.stats()
    assert stats["kv_host_tier_evictions"] > 0 and stats["kv_host_tier_used"] == 6
    assert engine.pool.num_in_use == 0
    engine.pool.check_invariants()


def test_nothing_compiles_after_warmup_with_the_tier(tiny):
    config, model, _ = tiny
    engine = _engine(model)
    engine.warmup()
    compiled = engine.num_compilations
    rng = np.random.default_rng(6)
    prompt = rng.integers(0, config.vocab_size, 41).tolist()
    _go(engine, "a", prompt)
    for i in range(3):  # 4 to 12 prompts a step: copies of every bucket size
        for j in range(4 * i + 4):
            engine.add_request(
                f"{i}-{j}", {"prompt_token_ids": rng.integers(0, config.vocab_size, 17).tolist()},
                SamplingParams(max_tokens=1),
            )  # fmt: skip
        engine.run_until_done()
    assert _go(engine, "b", prompt).num_cached_tokens == 40
    assert engine.stats()["kv_offload_pages_to_host"] > 16
    assert engine.num_compilations == compiled


@pytest.mark.parametrize("broken", ["write_pages", "read_pages"])
def test_a_failed_copy_aborts_the_running_requests_and_leaks_nothing(tiny, broken):
    """A copy that raises is a lost KV cache: running requests end aborted with why,
    pages go back, no key whose bytes never reached the host stays in the tier, and
    the engine serves the next request."""
    config, model, _ = tiny
    engine = _engine(model)
    tier = engine.scheduler.kv_cache_manager.host_tier
    prompt = np.random.default_rng(7).integers(0, config.vocab_size, 41).tolist()
    _go(engine, "a", prompt)
    _flood(engine, config.vocab_size, 6)
    held = tier.num_used
    working = getattr(engine.runner, broken)

    def fails(*args):
        raise OSError("host memory unreadable")

    setattr(engine.runner, broken, fails)
    engine.add_request("b", {"prompt_token_ids": prompt}, GREEDY)
    engine.add_request("c", {"prompt_token_ids": [7] * 60}, GREEDY)  # evicts more pages
    with pytest.raises(Exception, match="host KV tier copy failed"):
        engine.step()
    setattr(engine.runner, broken, working)
    done = engine.run_until_done()
    assert done["b"].outputs[0].finish_reason == "abort"
    assert "KV cache was lost" in done["b"].error
    assert engine.pool.num_in_use == 0
    engine.pool.check_invariants()
    tier.check_invariants()
    if broken == "read_pages":  # the saves that could not read their pages are forgotten
        assert tier.num_used == held
    assert _go(engine, "d", prompt).outputs[0].finish_reason == "length"


def test_sleep_keeps_the_prefix_cache_in_the_host_tier(tiny):
    """Sleep frees the device pool; its cached pages go to the host tier first, so after
    waking a repeated prompt loads them and computes the same."""
    config, model, _ = tiny
    engine = _engine(model)
    prompt = np.random.default_rng(9).integers(0, config.vocab_size, 41).tolist()
    first = _go(engine, "a", prompt)
    engine.sleep(level=1)
    engine.wake_up()
    again = _go(engine, "b", prompt)
    assert again.num_cached_tokens == 40
    assert engine.stats()["kv_offload_pages_to_device"] == 5
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert again.outputs[0].cumulative_logprob == first.outputs[0].cumulative_logprob
