#!/usr/bin/env bash
# The device checks, as one prepared run for a session that has a GPU (device tool: `run` with
# command `bash bench/gpu_check.sh`, timeout_s 590). Writes everything under $OUT (default
# ./gpu_out): kernel tests on the GPU at realistic shapes, kernel benchmarks (GB/s, % of HBM peak),
# and a quick measured calibration for Llama-3.1-8B, its eviction and quantize-on-write ops checked
# through the cost model (bench/check_profile_kv_ops.py). Each stage has its own time limit so one slow
# stage cannot take the others' results with it. kvsim's simulator is not needed there (no simpy).
set -uo pipefail
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
PEAK_GBPS=${PEAK_GBPS:-4800}  # H200 HBM3e 4.8 TB/s; use 3350 on an H100 SXM
{ nvidia-smi; python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name())'; } \
  > "$OUT/device.txt" 2>&1
timeout 180 python3 -m pytest tests/kernels -q -rfE --durations=10 -p no:cacheprovider \
  --junitxml="$OUT/kernel_tests.xml" 2>&1 | tee "$OUT/kernel_tests.log" | tail -25
timeout 170 python3 bench/bench_kernels.py --hbm-peak-gbps "$PEAK_GBPS" --out "$OUT/bench_kernels.json" \
  > "$OUT/bench_kernels.log" 2>&1; tail -40 "$OUT/bench_kernels.log"
PROFILE="$OUT/profile-quick-llama-3.1-8b.json"
timeout 110 python3 -m calibrate --device cuda --quick --model llama-3.1-8b --no-progress \
  --ops gemm,decode,prefill,copy --out "$PROFILE" 2>&1 | tee "$OUT/calibrate.log" | tail -5
# The eviction and quantize-on-write ops (Triton h2o_accumulate, compact_kv, kv_write; torch
# h2o_select), added to the same profile (a re-run with the same settings resumes it), then the cost
# model's prices from them against the analytic model's (exit 1 names an op still analytic).
timeout 80 python3 -m calibrate --device cuda --quick --model llama-3.1-8b --no-progress \
  --ops score,select,compact,write --out "$PROFILE" 2>&1 | tee "$OUT/calibrate_kv_ops.log" | tail -5
timeout 30 python3 bench/check_profile_kv_ops.py "$PROFILE" --out "$OUT/check_profile_kv_ops.json" \
  > "$OUT/check_profile_kv_ops.log" 2>&1; echo "check_profile_kv_ops: exit $?" >> "$OUT/check_profile_kv_ops.log"
tail -30 "$OUT/check_profile_kv_ops.log"
ls -la "$OUT"
