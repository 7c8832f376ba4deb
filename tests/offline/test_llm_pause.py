"""A call running while the engine is paused (from another thread) waits without
spinning, and goes on with its exact outputs once resumed; or, with a timeout, raises."""

import threading
import time

import pytest
from engine_configs import small_config

from paxkv import LLM, RequestOutputKind, SamplingParams

PROMPT = {"prompt_token_ids": [5, 6, 7]}
PARAMS = SamplingParams(
    temperature=0.0, max_tokens=12, ignore_eos=True, output_kind=RequestOutputKind.DELTA
)


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny", dtype="float32", warmup=False, config=small_config(64))


def _tokens(outs):
    return [t for o in outs for t in o.outputs[0].token_ids]


def test_a_paused_stream_waits_without_spinning_and_resumes(llm):
    want = _tokens(llm.generate_stream([PROMPT], PARAMS))
    stream = llm.generate_stream([PROMPT], PARAMS)
    got = [next(stream)]  # running (its programs compiled)
    llm.engine.pause()
    reader = threading.Thread(target=lambda: got.extend(stream))
    reader.start()
    # The reader thread's own CPU clock (other threads of this process may compile).
    clock = time.pthread_getcpuclockid(reader.ident)
    cpu = time.clock_gettime(clock)
    time.sleep(1.0)
    cpu = time.clock_gettime(clock) - cpu
    assert reader.is_alive()  # waiting for resume()
    # A reader that polled step() would use a core for the whole second.
    assert cpu < 0.3, f"the paused reader used {cpu:.2f} s of CPU in 1 s"
    llm.engine.resume()
    reader.join(60)
    assert not reader.is_alive()
    assert _tokens(got) == want
    assert llm.engine.pool.num_in_use == 0


def test_a_pause_past_the_timeout_raises(llm):
    impatient = LLM(
        "tiny", dtype="float32", warmup=False, config=small_config(64), pause_timeout_s=0.2
    )
    stream = impatient.generate_stream([PROMPT], PARAMS)
    next(stream)
    impatient.engine.pause()
    with pytest.raises(TimeoutError, match=r"paused for pause_timeout_s=0\.2"):
        list(stream)
    impatient.engine.resume()
    impatient.engine.run_until_done()  # the aborted request is reported; nothing leaks
    assert impatient.engine.pool.num_in_use == 0
    with pytest.raises(ValueError, match="pause_timeout_s=-1"):
        LLM("tiny", warmup=False, pause_timeout_s=-1)
