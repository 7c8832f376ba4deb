"""paxkv-demo: a ragged batch in a paged cache, attention over it, and the memory it saves.

    paxkv-demo [--num_seqs=32] [--max_model_len=4096] [--page_size=16] [--seed=0]

Runs `paxkv.measure.ragged_batch_demo.run_demo` on the platform's attention backend (the "xla" loop on
the CPU) and prints its report. Its flags are its own: it builds no engine, so it
reads none of the serving flags of `paxkv.launch.flags`.
"""

from __future__ import annotations

from absl import flags

from paxkv.launch import define_seed, exit_with_error, platform, run_app
from paxkv.measure.ragged_batch_demo import format_result, run_demo
from paxkv.pallas_kernels.dispatch import BACKENDS

_NUM_SEQS = flags.DEFINE_integer("num_seqs", 32, "Sequences in the ragged batch.")
_MAX_MODEL_LEN = flags.DEFINE_integer("max_model_len", 4096, "Longest sequence the model serves.")
_PAGE_SIZE = flags.DEFINE_integer("page_size", 16, "Tokens per page.")
_SEED = define_seed(0, "Seed of the lengths and values.")
_BACKEND = flags.DEFINE_enum(
    "backend",
    "auto",
    list(BACKENDS),
    "Attention backend; auto: the platform's kernel (tpu, gpu), the 'xla' loop on the CPU. "
    "tpu and gpu need that device.",
)


def main(argv: list[str]) -> None:
    """Runs the demo with the flags' sizes and prints its report."""
    del argv
    try:
        platform.require_platform()
    except ValueError as e:
        exit_with_error(str(e))
    platform.announce("paxkv-demo", _BACKEND.value)
    try:
        result = run_demo(
            num_seqs=_NUM_SEQS.value,
            max_model_len=_MAX_MODEL_LEN.value,
            page_size=_PAGE_SIZE.value,
            seed=_SEED.value,
            backend=_BACKEND.value,
        )
    except ValueError as e:
        exit_with_error(str(e))
    print(format_result(result, max_model_len=_MAX_MODEL_LEN.value, page_size=_PAGE_SIZE.value))


def run() -> None:
    """The `paxkv-demo` console script."""
    run_app(main)


if __name__ == "__main__":
    run()
