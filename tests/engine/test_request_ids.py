"""One finished output per request id: an id is taken again only after its final output."""

import pytest

from paxkv import SamplingParams
from paxkv.engine import Engine, EngineConfig
from paxkv.engine.fake_runner import FakeRunner


def test_an_aborted_id_is_reused_only_after_its_final_output():
    config = EngineConfig(num_pages=64, page_size=16, max_num_seqs=4, max_model_len=128)
    engine = Engine(None, config, runner=lambda c: FakeRunner(256, c))
    params = SamplingParams(max_tokens=4, temperature=0)
    engine.add_request("a", {"prompt_token_ids": [1, 2, 3]}, params)
    engine.abort("a")
    with pytest.raises(ValueError, match="'a' was aborted"):
        engine.add_request("a", {"prompt_token_ids": [4, 5]}, params)
    finished = [o for o in engine.step() if o.finished]
    assert [(o.request_id, o.outputs[0].finish_reason) for o in finished] == [("a", "abort")]
    engine.add_request("a", {"prompt_token_ids": [4, 5]}, params)  # reported: free again
    outs = engine.run_until_done()
    assert outs["a"].finished and outs["a"].outputs[0].finish_reason == "length"
    assert len(outs["a"].outputs[0].token_ids) == 4
