#!/usr/bin/env bash
# The prepared device check for a session lent an NVIDIA H200, sized for one `device` run. A session now gets
# 15 minutes of device time in all (start, idle and give-back included; a start took ~30 s on 2026-12-04), so
# the defaults take ~7 minutes and leave room for one shorter re-run:
#
#   device run:  command="bash scripts/h200.sh", timeout_s=480      then give_back
#
# The first run (2026-12-04, BENCH_MIN=3) reached 13 of the llm tier's 115 bench shapes (the first of each op)
# and 17 of 53 conformance batches; to cover others, name them: BENCH_ARGS="--op attention --op rmsnorm"
# CONF_ARGS="--op attention --op matmul" (passed on to opport bench / opport conformance).
# No install: the machine's python3 already has torch, triton 3.6, numpy, ml_dtypes, rich, hypothesis and
# matplotlib, and nothing can be fetched there, so opport runs from the checkout (PYTHONPATH=.).
# Steps, each under its own time limit so that a hang in one still returns the others' results:
#   1. versions, GPU and clocks; `opport doctor`                                  (~20 s)
#   1b. `python tools/cuda_aot.py --cold` on all cores: compiles every kernel configuration the later
#      steps launch into Triton's cache (same target, options and specialisations as the JIT on the H200,
#      so those steps find them compiled), and repeats the sm_90 checks there; --cold because a
#      configuration taken from tools/cuda_aot_record.json would not be compiled    (<= 90 s)
#   2. `opport bench --backend cuda`: stops starting new shapes after BENCH_MIN   (default 3 min, ~4 in all)
#   3. `opport bench --overhead`: dispatch overhead for numpy, torch-cpu and torch-cuda inputs (<= 60 s)
#   4. the cuda conformance suite compiled on the GPU: fixed cases and CONF_EXAMPLES Hypothesis examples
#      per op x dtype, until CONF_S seconds, 12 workers (compiling is the CPU's work) (default 90 s)
# Before spending device time, `python tools/cuda_aot.py` (any machine) must pass: it compiles
# every kernel configuration these steps launch for sm_90 and checks shared memory, grids and spills.
# Results land in $OUT (the device tool brings that folder back) or ./h200-out:
#   env.txt, bench.log, cuda.json, cuda.png, overhead.log, overhead.json, conformance.log, conformance-cuda.json
# Record the figures in docs/performance.md with the command cuda.json names.
set -u
out=${OUT:-$PWD/h200-out}
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
bench_min=${BENCH_MIN:-3}
conf_s=${CONF_S:-90}

{
  date -u
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,clocks.max.sm,power.limit --format=csv
  "$py" -c "import sys, torch, triton, numpy; print(sys.version); print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'numpy', numpy.__version__)"
  timeout 60 "$py" -m opport doctor
} >"$out/env.txt" 2>&1
cat "$out/env.txt"

echo "== sm_90 compile check, warming Triton's cache"
timeout 90 "$py" tools/cuda_aot.py --cold --jobs "$(nproc)" 2>/dev/null | tail -n 8
echo "aot exit status ${PIPESTATUS[0]}"

echo "== bench (no new shape after ${bench_min} min)"
timeout $(( bench_min * 60 + 90 )) "$py" -m opport bench --backend cuda --max-minutes "$bench_min" ${BENCH_ARGS:-} \
  --json "$out/cuda.json" --plot "$out/cuda.png" >"$out/bench.log" 2>&1
echo "bench exit status $?"
grep -v -E "^ *[0-9.]+ s  " "$out/bench.log" | tail -n 150

echo "== dispatch overhead"
timeout 60 "$py" -m opport bench --overhead --budget-ms 100 --json "$out/overhead.json" >"$out/overhead.log" 2>&1
echo "overhead exit status $?"
tail -n 45 "$out/overhead.log"

echo "== conformance (compiled, ${conf_s} s)"
timeout "$conf_s" "$py" -m opport conformance --backend cuda --tier fast --examples "${CONF_EXAMPLES:-5}" \
  --workers "${CONF_WORKERS:-12}" --compile-timeout 150 ${CONF_ARGS:-} \
  --json "$out/conformance-cuda.json" >"$out/conformance.log" 2>&1
echo "conformance exit status $? (124: stopped at ${conf_s} s; the log holds the cases that ran)"
grep -E "FAIL|ERROR|CRASH|TIMEOUT|^conformance:" "$out/conformance.log" | tail -n 40
