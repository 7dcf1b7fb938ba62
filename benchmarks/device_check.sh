#!/usr/bin/env bash
# One short run for a lent accelerator, the GPU rows of the performance issue: the side-by-side
# table at the referee's sizes (benchmarks/side_by_side.py) and the transformer's throughput
# and memory (benchmarks/transformer.py, with the programs' peak device memory). About 5-8
# minutes on an H200, at most about 9 1/2: each script has its own time limit (200 s, 340 s),
# so that the run fits one device call of 10 minutes; one that fails does not stop the other.
#
#   bash benchmarks/device_check.sh "$OUT"      # results and logs in $OUT (7 files)
#   SMOKE=1 bash benchmarks/device_check.sh /tmp/dc   # tiny sizes, any machine (the tests)
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
timeout 200 "$py" benchmarks/side_by_side.py "${sbs[@]}" --out "$out" --tag _gpu 2>&1 |
  tee "$out/side_by_side.log" || status=1
timeout 340 "$py" benchmarks/transformer.py "${tf[@]}" --out "$out" --tag _gpu 2>&1 |
  tee "$out/transformer.log" || status=1
exit $status
