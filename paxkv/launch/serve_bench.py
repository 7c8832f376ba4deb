"""Benchmarks a running OpenAI-compatible server over HTTP (`paxkv.serve.bench_client`).

    paxkv-serve &                                  # tiny-py on 127.0.0.1:8000
    paxkv-serve-bench --num_requests=64 --request_rate=8 --max_model_len=128
    paxkv-serve-bench --server_url=http://10.0.0.2:8000/v1 --workload=sharegpt --request_rate=inf

Prompts are random token ids below `--vocab_size`, with the load benchmark's lengths
(`paxkv.measure.load_bench.make_workload`), sent at Poisson arrivals (`--burstiness` != 1:
gamma); prints TTFT / TPOT / ITL / end-to-end percentiles and throughput.
"""

from __future__ import annotations

import asyncio
import json

from absl import flags

from paxkv.launch import define_seed, exit_with_error, run_app

_URL = flags.DEFINE_string("server_url", "http://127.0.0.1:8000/v1", "The server's API root.")
_MODEL = flags.DEFINE_string("model", None, "Model name to send; unset: the server's default.")
_WORKLOAD = flags.DEFINE_enum("workload", "fixed", ["sharegpt", "fixed"], "Request lengths.")
_NUM_REQUESTS = flags.DEFINE_integer("num_requests", 64, "Requests to send.", lower_bound=1)
_RATE = flags.DEFINE_float("request_rate", 8.0, "Mean arrivals per second (inf: all at once).")
_BURSTINESS = flags.DEFINE_float("burstiness", 1.0, "Gamma shape of the gaps; 1 is Poisson.")
_MAX_CONCURRENCY = flags.DEFINE_integer("max_concurrency", None, "Most requests in flight.")
_MAX_MODEL_LEN = flags.DEFINE_integer("max_model_len", 512, "The server's max_model_len.")
_VOCAB_SIZE = flags.DEFINE_integer("vocab_size", 256, "Prompt token ids are drawn below this.")
_PROMPT_LEN = flags.DEFINE_list("prompt_len", ["16", "64"], "fixed: prompt length range lo,hi.")
_OUTPUT_LEN = flags.DEFINE_list("output_len", ["16", "64"], "fixed: output length range lo,hi.")
_SEED = define_seed(0, "Seed of lengths, prompts and arrivals.")
_JSON_OUT = flags.DEFINE_string("json_out", None, "Write the summary as JSON here.")


def main(argv: list[str]) -> None:
    """The absl main: replays the workload against the server and prints the summary."""
    if len(argv) > 1:
        exit_with_error(f"unexpected arguments {argv[1:]}")
    from paxkv.measure.load_bench import make_workload
    from paxkv.serve import bench_client

    try:
        trace = make_workload(
            _WORKLOAD.value,
            num_requests=_NUM_REQUESTS.value,
            vocab_size=_VOCAB_SIZE.value,
            max_model_len=_MAX_MODEL_LEN.value,
            seed=_SEED.value,
            request_rate=_RATE.value,
            burstiness=_BURSTINESS.value,
            fixed_prompt_len=_range(_PROMPT_LEN),
            fixed_output_len=_range(_OUTPUT_LEN),
        )
    except ValueError as e:
        exit_with_error(str(e))
    results, duration = asyncio.run(
        bench_client.run_trace(
            _URL.value, trace, model=_MODEL.value, max_concurrency=_MAX_CONCURRENCY.value
        )
    )
    summary = bench_client.summarize(results, duration)
    print(bench_client.format_summary(summary))
    if _JSON_OUT.value is not None:
        with open(_JSON_OUT.value, "w") as f:
            json.dump(summary, f, indent=2)


def _range(flag: flags.FlagHolder) -> tuple[int, int]:
    try:
        lo, hi = (int(x) for x in flag.value)
    except ValueError:
        exit_with_error(f"--{flag.name}={','.join(flag.value)} must be two integers lo,hi")
    return lo, hi


def run() -> None:
    """Console-script entry point (`paxkv-serve-bench`)."""
    run_app(main)


if __name__ == "__main__":
    run()
