"""The multi-turn benchmark runs small: its replies are equal with the host tier on and
off, and the tier saves prefill at equal device memory."""

import dataclasses

from benchmarks import multi_turn
from paxkv.models import load_model


def test_the_tier_saves_prefill_and_changes_no_reply():
    config, model, _ = load_model("tiny-py", dtype="float32")
    convs = multi_turn.conversations(3, config.vocab_size, seed=1, turns=(3, 4))
    engine = dataclasses.replace(
        multi_turn.engine_config(24, 16, 3),
        max_num_batched_tokens=64,
        max_model_len=256,
        token_buckets=(64,),
        seq_buckets=(3,),
        page_buckets=(16,),
    )
    off = multi_turn.run(model, convs, 0.0, engine)
    on = multi_turn.run(model, convs, 0.01, engine)
    assert on["replies"] == off["replies"]
    assert on["prompt_tokens"] == off["prompt_tokens"]
    assert on["host_tier_hit_tokens"] > 0 and off["host_tier_hit_tokens"] == 0
    assert on["prefill_tokens_computed"] < off["prefill_tokens_computed"]
    assert on["compiled_after_warmup"] == off["compiled_after_warmup"] == 0
