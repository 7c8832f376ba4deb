"""Measures what the int8 and fp8 KV caches cost the trained model, against the unquantized one.

    paxkv-quality                                    # tiny-py, auto/int8/fp8, a few minutes
    paxkv-quality --num_windows=256 --json_out=quality.json

Reports, per `--kv_cache_dtypes`, the held-out perplexity teacher-forced through the
paged cache and the greedy agreement with the "auto" cache (see `paxkv.measure.kv_quality`), as a
Markdown table; `--json_out` also writes every number.
"""

from __future__ import annotations

import json
import sys

from absl import flags
from tqdm import tqdm

from paxkv.launch import exit_with_error, list_in_help, platform, run_app
from paxkv.measure import kv_quality as quality
from paxkv.models import load_model
from paxkv.models.training import load_corpus, stdlib_root
from paxkv.offline.progress import logging_above_bars
from paxkv.pallas_kernels.layout import KV_CACHE_DTYPES

_DEFAULTS = quality.QualityConfig()
_MODEL = flags.DEFINE_string(
    "model", "tiny-py", "A trained checkpoint name (tiny-py) or an orbax/Hugging Face directory."
)
_KV_CACHE_DTYPES = flags.DEFINE_multi_enum(
    "kv_cache_dtypes", list(_DEFAULTS.kv_cache_dtypes), KV_CACHE_DTYPES, "Cache dtypes to compare."
)
_WEIGHTS = flags.DEFINE_multi_enum(
    "weight_quantizations",
    ["none"],
    ["none", "int8", "fp8", "w8a8-int8", "w8a8-fp8"],
    "Weights to measure: none (the model's dtype), int8, fp8, or W8A8 (activations "
    "quantized too), each with every --kv_cache_dtypes; repeat the flag for several.",
)
_NUM_WINDOWS = flags.DEFINE_integer(
    "num_windows", _DEFAULTS.num_windows, "Held-out windows for perplexity.", lower_bound=1
)
_WINDOW_LEN = flags.DEFINE_integer(
    "window_len", _DEFAULTS.window_len, "Predicted bytes per window.", lower_bound=1
)
_CHUNK_LEN = flags.DEFINE_integer(
    "chunk_len", _DEFAULTS.chunk_len, "Prefill chunk; divides --window_len.", lower_bound=1
)
_BATCH_SIZE = flags.DEFINE_integer(
    "batch_size", _DEFAULTS.batch_size, "Windows per paged step.", lower_bound=1
)
_NUM_PROMPTS = flags.DEFINE_integer(
    "num_prompts", _DEFAULTS.num_prompts, "Held-out prompts for greedy agreement.", lower_bound=1
)
_PROMPT_LEN = flags.DEFINE_integer(
    "prompt_len", _DEFAULTS.prompt_len, "Bytes per prompt.", lower_bound=1
)
_MAX_TOKENS = flags.DEFINE_integer(
    "max_tokens", _DEFAULTS.max_tokens, "Greedy tokens per prompt.", lower_bound=1
)
_PAGE_SIZE = flags.DEFINE_integer(
    "page_size", _DEFAULTS.page_size, "Tokens per KV page.", lower_bound=1
)
_ATTENTION_BACKEND = flags.DEFINE_enum(
    "attention_backend",
    _DEFAULTS.attention_backend,
    ["auto", "reference", "tpu", "gpu"],
    "Attention implementation.",
)
_JSON_OUT = flags.DEFINE_string("json_out", None, "Also write the results as JSON here.")


def main(argv: list[str]) -> None:
    """The absl main: perplexity and greedy agreement per KV cache dtype."""
    if len(argv) > 1:
        exit_with_error(f"unexpected arguments {argv[1:]}")
    config = quality.QualityConfig(
        kv_cache_dtypes=tuple(_KV_CACHE_DTYPES.value),
        weight_quantizations=tuple(_WEIGHTS.value),
        num_windows=_NUM_WINDOWS.value,
        window_len=_WINDOW_LEN.value,
        chunk_len=_CHUNK_LEN.value,
        batch_size=_BATCH_SIZE.value,
        num_prompts=_NUM_PROMPTS.value,
        prompt_len=_PROMPT_LEN.value,
        max_tokens=_MAX_TOKENS.value,
        page_size=_PAGE_SIZE.value,
        attention_backend=_ATTENTION_BACKEND.value,
    )
    try:
        platform.require_platform()
        platform.announce("paxkv-quality", config.attention_backend)
        _, model, _ = load_model(_MODEL.value)
        result = _evaluate_with_a_bar(model, config)
    except (ValueError, OSError) as e:
        exit_with_error(str(e))
    result |= {"model": _MODEL.value, "python": sys.version.split()[0], "stdlib": stdlib_root()}
    dense = result["dense"]
    print(
        f"{_MODEL.value}: {config.num_windows} held-out windows of {config.window_len} bytes "
        f"(prefilled in chunks of {config.chunk_len}), {config.num_prompts} greedy "
        f"continuations of {config.max_tokens} tokens; dense forward {dense['bits_per_byte']:.4f} "
        f"bits/byte, perplexity {dense['perplexity']:.4f}"
    )
    print(quality.markdown_table(result))
    if _JSON_OUT.value is not None:
        with open(_JSON_OUT.value, "w") as f:
            json.dump(result, f, indent=2)


def _evaluate_with_a_bar(model, config: quality.QualityConfig) -> dict:
    """`quality.evaluate` on the held-out corpus, its stages shown as a bar on stderr."""
    with tqdm(desc="paxkv-quality", unit="stage") as bar, logging_above_bars():

        def progress(done: int, total: int, stage: str) -> None:
            bar.total = total
            bar.set_postfix_str(stage)
            bar.update(done - bar.n)

        return quality.evaluate(model, load_corpus("eval"), config, progress=progress)


def run() -> None:
    """Console-script entry point (`paxkv-quality`)."""
    list_in_help(__name__, __doc__)
    run_app(main)


if __name__ == "__main__":
    run()
