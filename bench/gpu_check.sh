#!/usr/bin/env bash
# The device checks, as one prepared run for a session that has a GPU (device tool: `run` with
# command `bash bench/gpu_check.sh`, timeout_s 540). Writes everything under $OUT (default
# ./gpu_out): kernel tests on the GPU at realistic shapes, kernel benchmarks (GB/s, % of HBM peak),
# and a quick measured calibration for Llama-3.1-8B. Each stage has its own time limit so one slow
# stage cannot take the others' results with it. kvsim's simulator is not needed there (no simpy).
set -uo pipefail
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
PEAK_GBPS=${PEAK_GBPS:-4800}  # H200 HBM3e 4.8 TB/s; use 3350 on an H100 SXM
{ nvidia-smi; python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name())'; } \
  > "$OUT/device.txt" 2>&1
timeout 200 python3 -m pytest tests/kernels -q -rfE --durations=10 -p no:cacheprovider \
  --junitxml="$OUT/kernel_tests.xml" 2>&1 | tee "$OUT/kernel_tests.log" | tail -25
timeout 200 python3 bench/bench_kernels.py --hbm-peak-gbps "$PEAK_GBPS" --out "$OUT/bench_kernels.json" \
  > "$OUT/bench_kernels.log" 2>&1; tail -40 "$OUT/bench_kernels.log"
timeout 120 python3 -m calibrate --device cuda --quick --model llama-3.1-8b --no-progress \
  --out "$OUT/profile-quick-llama-3.1-8b.json" 2>&1 | tee "$OUT/calibrate.log" | tail -5
ls -la "$OUT"
