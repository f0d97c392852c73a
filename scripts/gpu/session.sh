#!/usr/bin/env bash
# Run GPU stages on a machine where vLLM 0.30.0 is staged (see docs/gpu-runs.md), e.g.
#     OUT=/some/dir bash scripts/gpu/session.sh smoke hook mem
# Installs this checkout next to vLLM, runs each stage with its own time limit, writes results
# under $OUT (small summaries as files, every log in $OUT/<stage>-logs.tar.gz), and kills
# everything it started.
set -uo pipefail
: "${OUT:?set OUT to the results folder}"
# The staging step's environment (vLLM on PYTHONPATH), if given; else source it before running.
[ -n "${STAGING_ENV:-}" ] && source "$STAGING_ENV"
SITE=${DUALGPU_SITE:-/tmp/dualgpu-site}
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" PATH="$SITE/bin:$PATH"
WORK=${DUALGPU_WORK:-/tmp/dualgpu-work}
mkdir -p "$WORK" "$OUT"
t0=$(date +%s)
python3 -m pip install -q --no-deps --no-build-isolation --no-compile --upgrade --target "$SITE" . \
    > "$WORK/install.log" 2>&1 || { tail -20 "$WORK/install.log"; exit 1; }
echo "installed vllm-dualgpu in $(( $(date +%s) - t0 )) s"
nvidia-smi --query-gpu=index,name,memory.total,memory.used --format=csv,noheader

declare -A CMD=(
  [smoke]="python3 scripts/gpu/serve_smoke.py"
  [smoke-hook]="python3 scripts/gpu/serve_smoke.py --compare-hook"
  [hook]="python3 scripts/gpu/check_sm_hook.py"
  [fp8]="python3 scripts/gpu/tune_and_bench_fp8.py"
  [mem]="python3 scripts/gpu/bench_memory.py"
  [spec]="python3 scripts/gpu/spec_decode_pp.py"
  [e2e]="python3 scripts/gpu/e2e_correctness.py --quick"
  [e2e-full]="python3 scripts/gpu/e2e_correctness.py"
  [soak]="python3 scripts/gpu/soak.py"
  [suite]="bash scripts/gpu/run_gpu_suite.sh"
)
# e2e: 4 engine boots (~6 min); e2e-full: 6 (~9 min); suite: pytest -m gpu (e2e quick inside);
# soak: ~2 min boot + 10 min of load + drain, longer than one 10-minute command: run it detached.
declare -A LIMIT=([smoke]=420 [smoke-hook]=580 [hook]=90 [fp8]=330 [mem]=560 [spec]=300 [e2e]=540 [e2e-full]=590
                  [soak]=800 [suite]=590)
# Configs tuned by the fp8 stage earlier on this machine are what the plugin's lookup reads.
if [ -d "$WORK/fp8/configs" ] && [ -z "${VLLM_DUALGPU_KERNEL_CONFIGS:-}" ]; then
  export VLLM_DUALGPU_KERNEL_CONFIGS="$WORK/fp8/configs"
fi
status=0
for stage in "$@"; do
  dir="$WORK/$stage"; rm -rf "$dir"; mkdir -p "$dir"
  s=$(date +%s)
  echo "=== $stage (limit ${LIMIT[$stage]:-300} s)"
  timeout -k 10 "${LIMIT[$stage]:-300}" ${CMD[$stage]} "$dir" > "$dir/stage.log" 2>&1
  rc=$?
  echo "=== $stage rc=$rc in $(( $(date +%s) - s )) s"; tail -15 "$dir/stage.log"
  [ $rc -eq 0 ] || status=1
  # Anything a stage left behind (vLLM workers, ballast) must not leak into the next one.
  pkill -9 -f 'boot_llm.py|e2e_correctness.py|vllm serve|vllm.entrypoints.cli.main|ballast.py|VLLM::' 2>/dev/null; sleep 1
  find "$dir" -maxdepth 1 \( -name '*.json' -o -name '*.md' -o -name '*.png' -o -name '*.xml' \) -size -4M -exec cp {} "$OUT/" \;
done
# One archive with every stage's logs (results come back as a few files only).
tar czf "$OUT/logs.tar.gz" -C "$WORK" --exclude='models' --exclude='*.safetensors' "$@"
exit $status
