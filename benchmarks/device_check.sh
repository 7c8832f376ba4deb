#!/usr/bin/env bash
# The measurements to take when an accelerator is lent (the device tool runs a command in
# the repository root and brings back $OUT): start-up cold and warm on the device, then
# the kernels' timings. Each part has its own time limit, so one that hangs leaves the
# others' results; run it as `bash benchmarks/device_check.sh` with a timeout that leaves
# room for a rerun. Nothing is installed: the machine's own jax (0.11.2) and packages.
set -uo pipefail
out="${OUT:-/tmp/paxkv-device}"
mkdir -p "$out"
export PYTHONPATH="$PWD"
{ date; uptime; nvidia-smi -L 2>/dev/null; python -c "import jax; print(jax.__version__, jax.devices())"; } \
  >"$out/machine.txt" 2>&1
# Cold and warm start-up: LLM(...) to the first finished request, background and full
# warm-up, and a real shape (llama-3.2-1b, random weights).
timeout 240 python -m benchmarks.startup --scenarios=tiny-py,tiny-py-full,llama-3.2-1b \
  --json_out="$out/startup.json" >"$out/startup.txt" 2>&1
echo "startup exit $?" >>"$out/machine.txt"
timeout 180 python -m benchmarks.kernels >"$out/kernels.txt" 2>&1
echo "kernels exit $?" >>"$out/machine.txt"
# The host KV tier's copies each way, 64 pages of Llama 3.1 8B's KV shape (2 MiB a page).
timeout 120 python -m benchmarks.page_copies >"$out/page_copies.txt" 2>&1
echo "page_copies exit $?" >>"$out/machine.txt"
# Multi-LoRA: the cost of the gathered and grouped (ragged_dot) deltas, and a Zipf run
# over 100 adapters with 8 slots (tiny shapes: the scheduling and the programs).
timeout 240 python -m benchmarks.lora >"$out/lora.txt" 2>&1
echo "lora exit $?" >>"$out/machine.txt"
# Quantized weights: one layer's bytes of a decode step in bfloat16, int8 and fp8
# (whether the device fuses the dequantization into the matmul).
timeout 180 python -m benchmarks.quantized_weights >"$out/quantized_weights.txt" 2>&1
echo "quantized_weights exit $?" >>"$out/machine.txt"
