"""The LoRA slot LRU: exact slots, loads and evictions; a slot in use is never taken."""

import pytest

from paxkv.host.lora_slots import LoRARequest, LoRASlots


def test_slots_fill_then_evict_the_least_recent_unused():
    in_use: set[int] = set()
    slots = LoRASlots(2, in_use.__contains__)
    assert slots.acquire("a") == 1 and slots.acquire("b") == 2
    assert slots.take_loads() == [(1, "a"), (2, "b")]
    assert slots.acquire("a") == 1  # resident: no load, and now the most recent
    assert slots.take_loads() == []
    assert slots.acquire("c") == 2  # b was the least recent
    assert slots.take_loads() == [(2, "c")] and slots.evictions == 1
    in_use.update({1, 2})
    assert slots.acquire("d") is None  # every slot runs a sequence: d waits
    in_use.discard(1)
    assert slots.acquire("d") == 1
    assert slots.resident == {"c": 2, "d": 1} and slots.loads == 4


def test_forgetting_frees_a_slot_once_unused_and_drops_its_pending_load():
    in_use: set[int] = {1}
    slots = LoRASlots(2, in_use.__contains__)
    slots.acquire("a")
    slots.acquire("b")
    slots.forget("b")  # not in use: free at once, its load not made
    assert slots.take_loads() == [(1, "a")]
    slots.forget("a")  # in use: held until its sequences leave
    assert slots.acquire("c") == 2
    in_use.add(2)
    assert slots.acquire("d") is None  # a's slot is still in use
    in_use.discard(1)
    assert slots.acquire("d") == 1  # a's slot, once its sequences left
    assert slots.resident == {"c": 2, "d": 1}


def test_requests_are_checked():
    assert LoRARequest("x", 3, "/p").adapter_id == 3
    with pytest.raises(ValueError, match="lora_int_id=0"):
        LoRARequest("x", 0)
    with pytest.raises(ValueError, match="lora_name"):
        LoRARequest("", 1)
    with pytest.raises(TypeError, match="lora_int_id"):
        LoRARequest("x", "1")
    with pytest.raises(ValueError, match="max_loras=0"):
        LoRASlots(0, lambda s: False)
