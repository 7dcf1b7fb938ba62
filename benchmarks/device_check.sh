#!/usr/bin/env bash
# One short run for a lent accelerator, the GPU rows of the performance issue: the side-by-side
# table at the side-by-side comparison's sizes (benchmarks/side_by_side.py), the transformer's throughput and
# memory (benchmarks/transformer.py, with the programs' peak device memory), and three rows of
# the table again with loops recorded into CUDA graphs. About 6 minutes on an H200 (4 1/2 on
# 2026-11-30 without the last part: 129 s and 132 s for the first two), at most 9 1/2: each
# part has its own time limit (30, 170, 250 and 120 s), so that the run fits one device call
# of 10 minutes; one that fails does not stop the others.
#
#   bash benchmarks/device_check.sh "$OUT"      # results and logs in $OUT (8 files)
#   SMOKE=1 bash benchmarks/device_check.sh /tmp/dc   # tiny sizes, any machine (the tests;
#                                                     # 7 files: no CUDA-graph rows)
set -u -o pipefail
out=${1:-${OUT:-/tmp/device_check}}
mkdir -p "$out"
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
if [ "${SMOKE:-0}" = 1 ]; then
  sbs=(--smoke) tf=(--smoke)
else
  sbs=(--rounds 3 --min-sample-s 0.3 --single-s 8) tf=(--preset gpu --peak)
fi
timeout 30 "$py" -c "import jax, optax; print('jax', jax.__version__, 'optax', optax.__version__, jax.devices())" \
  >"$out/env.log" 2>&1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >>"$out/env.log" 2>&1 || true
status=0
timeout 170 "$py" benchmarks/side_by_side.py "${sbs[@]}" --out "$out" --tag _gpu 2>&1 |
  tee "$out/side_by_side.log" || status=1
timeout 250 "$py" benchmarks/transformer.py "${tf[@]}" --out "$out" --tag _gpu 2>&1 |
  tee "$out/transformer.log" || status=1
if [ "${SMOKE:-0}" != 1 ]; then
  # The launch-bound rows again with XLA:GPU's loops and conditionals recorded into CUDA graphs
  # (off by default): whether that removes the host's wait before each trip of a loop of
  # unknown trip count. Its table is in side_by_side.log, its JSON the eighth file.
  tmp=$(mktemp -d)
  XLA_FLAGS="${XLA_FLAGS:+$XLA_FLAGS }--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL" \
    timeout 120 "$py" benchmarks/side_by_side.py --configs adam:8,adam:256,muon:32 --rounds 3 \
    --min-sample-s 0.3 --single-s 4 --out "$tmp" --tag _gpu_cmdbuf 2>&1 |
    tee -a "$out/side_by_side.log" || status=1
  cp "$tmp/side_by_side_gpu_cmdbuf.json" "$out/" || status=1
fi
exit $status
