"""Generates completions of prompts with the paged engine, and prints them with the run's stats.

    paxkv-generate                               # tiny-py completes two Python snippets
    paxkv-generate --prompt="def f(x):" --prompt="Once upon a time" --max_tokens=32
    paxkv-generate --setup=llama-3.1-8b --model_dir=/ckpt/Llama-3.1-8B --prompts_file=p.jsonl

Prompts come from `--prompt` (repeatable) and `--prompts_file` (one per line: text, or
JSONL with {"prompt": ...} or {"prompt_token_ids": [...]}; see
`paxkv.launch.read_prompts`); with neither, two Python snippets. The default config,
tiny-py, is the tiny byte-level model trained on the Python standard library, whose
weights ship with the package: it runs on the CPU with nothing to download and writes
Python-like text. `--setup=tiny` is the same model with random weights.

A checkpoint that cannot be loaded (a `config.json` missing a field, a truncated
weights file, an unreadable tokenizer, weights holding NaN) ends the run with one line
naming the file and the field or tensor, and exit status 2.
"""

from __future__ import annotations

import time

from absl import flags

from paxkv.host.request import RequestOutput, SamplingParams
from paxkv.launch import exit_with_error, list_in_help, platform, read_prompts, run_app
from paxkv.launch import flags as launch_flags

# What the default run (no --prompt, no --prompts_file) completes.
DEFAULT_PROMPTS = ("import os", "class Stack:")
DEFAULT_SETUP = "tiny-py"

_PROMPT = flags.DEFINE_multi_string(
    "prompt", [], f"A prompt; repeat the flag for more. Without any: {list(DEFAULT_PROMPTS)}."
)
_PROMPTS_FILE = flags.DEFINE_string(
    "prompts_file", None, "File of prompts, one per line: text, or JSONL objects."
)
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 32, "Tokens to generate per prompt.")
_TEMPERATURE = flags.DEFINE_float("temperature", 1.0, "Sampling temperature; 0 is greedy.")
_TOP_K = flags.DEFINE_integer("top_k", 0, "Keep the k likeliest tokens; 0 keeps all.")
_TOP_P = flags.DEFINE_float("top_p", 1.0, "Keep the smallest set of tokens with this mass.")


def main(argv: list[str]) -> None:
    """The absl main: generates completions of the flags' prompts."""
    if len(argv) > 1:
        exit_with_error(f"unexpected arguments {argv[1:]}; prompts go in --prompt")
    try:
        launch_flags.init_runtime()
        setup = launch_flags.serving_setup()
        platform.announce("paxkv-generate", setup.engine.attention_backend)
        prompts = list(_PROMPT.value)
        if _PROMPTS_FILE.value is not None:
            try:
                prompts += read_prompts(_PROMPTS_FILE.value)
            except OSError as e:
                raise ValueError(f"--prompts_file={_PROMPTS_FILE.value}: {e.strerror}") from None
        elif not prompts:
            prompts = list(DEFAULT_PROMPTS)
        params = SamplingParams(
            max_tokens=_MAX_TOKENS.value,
            temperature=_TEMPERATURE.value,
            top_k=_TOP_K.value,
            top_p=_TOP_P.value,
        )
        llm = launch_flags.build_llm(setup)
        start = time.perf_counter()
        outputs = llm.generate(prompts, params)  # validates every prompt before running any
        elapsed = time.perf_counter() - start
    except (ValueError, OSError) as e:
        exit_with_error(str(e))
    for out in outputs:
        print(_format_output(out))
    print(_format_stats(outputs, llm.stats(), elapsed))


def _format_output(out: RequestOutput) -> str:
    prompt = out.prompt if out.prompt is not None else out.prompt_token_ids
    lines = [f"[{out.request_id}] prompt: {prompt!r}"]
    for c in out.outputs:
        text = c.text if c.text is not None else c.token_ids
        lines.append(
            f"[{out.request_id}] completion: {text!r} ({len(c.token_ids)} tokens, {c.finish_reason})"
        )
    return "\n".join(lines)


def _format_stats(outputs: list[RequestOutput], stats: dict, elapsed: float) -> str:
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    generated = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    spec = []
    if "spec_decode_num_drafts" in stats:
        spec = [
            f"speculation: {stats['spec_decode_num_drafts']} drafts, "
            f"{stats['spec_decode_num_accepted_tokens']}/{stats['spec_decode_num_draft_tokens']} "
            f"proposed tokens accepted, mean accepted length "
            f"{stats['spec_decode_mean_accepted_length']:.2f}"
        ]
    return "\n".join(
        [
            "--- stats ---",
            f"requests: {len(outputs)}, prompt tokens: {prompt_tokens}, generated tokens: {generated}",
            f"compilations: {stats['num_compilations']}, steps: {stats['num_steps']}, "
            f"preemptions: {stats['num_preemptions']}",
            f"throughput: {generated / elapsed:.1f} tokens/s ({generated} tokens in {elapsed:.2f} s, "
            f"compilation included; device {stats['device_time_s']:.2f} s, host {stats['host_time_s']:.2f} s)",
            *spec,
        ]
    )


def run() -> None:
    """Console-script entry point (`paxkv-generate`)."""
    flags.FLAGS.set_default("setup", DEFAULT_SETUP)
    list_in_help(__name__, __doc__, launch_flags.__name__)
    run_app(main)


if __name__ == "__main__":
    run()
