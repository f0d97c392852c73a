#!/usr/bin/env bash
# Run GPU stages on a machine where vLLM 0.30.0 is staged (see docs/gpu-runs.md), e.g.
#     OUT=/some/dir bash scripts/gpu/session.sh smoke hook mem
# Installs this checkout next to vLLM, runs each stage with its own time limit, writes results
# under $OUT (small summaries as files, every log in $OUT/logs-<stages>.tar.gz), and kills
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
# Install once per source tree: a second session.sh beside a running one (a detached soak)
# must not rewrite the package under it.
src_hash=$(find vllm_dualgpu csrc kernel_configs setup.py pyproject.toml -type f ! -name '*.pyc' \
           -print0 | sort -z | xargs -0 sha1sum | sha1sum | cut -c1-16)
if [ -f "$SITE/.source-hash" ] && [ "$(cat "$SITE/.source-hash")" = "$src_hash" ]; then
  echo "vllm-dualgpu already installed from this tree ($src_hash)"
else
  python3 -m pip install -q --no-deps --no-build-isolation --no-compile --upgrade --target "$SITE" . \
      > "$WORK/install.log" 2>&1 || { tail -20 "$WORK/install.log"; exit 1; }
  echo "$src_hash" > "$SITE/.source-hash"
  echo "installed vllm-dualgpu in $(( $(date +%s) - t0 )) s"
fi
# The suite stage needs pytest, which vLLM's staging does not promise: install it from the wheels
# uploaded as .gputest (scripts/gpu/test_wheels.sh pack) when they are here.
if [[ " $* " == *" suite "* ]] && [ -d .gputest ]; then
  DUALGPU_SITE=$SITE bash scripts/gpu/test_wheels.sh install .gputest || exit 1
fi
nvidia-smi --query-gpu=index,name,memory.total,memory.used --format=csv,noheader

declare -A CMD=(
  [smoke]="python3 scripts/gpu/serve_smoke.py"
  [smoke-hook]="python3 scripts/gpu/serve_smoke.py --compare-hook"
  [hook]="python3 scripts/gpu/check_sm_hook.py"
  [fp8]="python3 scripts/gpu/tune_and_bench_fp8.py"
  [mem]="python3 scripts/gpu/bench_memory.py"
  [spec]="python3 scripts/gpu/spec_decode_pp.py"
  [vision]="python3 scripts/gpu/vision_pp.py"
  [embedq]="python3 scripts/gpu/embed_quant_pp.py"
  [e2e]="python3 scripts/gpu/e2e_correctness.py --quick"
  [e2e-full]="python3 scripts/gpu/e2e_correctness.py"
  [soak]="python3 scripts/gpu/soak.py"
  [suite]="bash scripts/gpu/run_gpu_suite.sh"
)
# e2e: 4 engine boots (~6 min); e2e-full: 6 (~9 min); suite: pytest -m gpu (e2e quick inside);
# soak: boot + 10 min of load + drain, longer than one 10-minute command: run it detached; its
# boot took 3.7 min beside other stages and 6.3 min alone on a fresh machine (JIT caches empty),
# so its limit leaves 10 min for the boot. embedq: three boots of the small hybrid (92-208 s each
# right after staging) within the script's own --timeout of 480 s, plus writing the checkpoints.
declare -A LIMIT=([smoke]=420 [smoke-hook]=580 [hook]=90 [fp8]=330 [mem]=560 [spec]=300 [vision]=240 [e2e]=540 [e2e-full]=590
                  [soak]=1320 [suite]=590 [embedq]=540)
# Configs tuned by the fp8 stage earlier on this machine are what the plugin's lookup reads.
if [ -d "$WORK/fp8/configs" ] && [ -z "${VLLM_DUALGPU_KERNEL_CONFIGS:-}" ]; then
  export VLLM_DUALGPU_KERNEL_CONFIGS="$WORK/fp8/configs"
fi
kill_stage() {  # SIGKILL what stage $1 (tag $2) left: its tag in the environment, or output
  # into its folder (vLLM's renamed processes, VLLM::Worker..., overwrite their environment).
  local p
  for p in /proc/[0-9]*; do
    if grep -qzx "DUALGPU_STAGE_TAG=$2" "$p/environ" 2>/dev/null \
       || readlink "$p/fd/1" "$p/fd/2" 2>/dev/null | grep -q "^$1/"; then
      kill -9 "${p#/proc/}" 2>/dev/null
    fi
  done
}
status=0
for stage in "$@"; do
  dir="$WORK/$stage"; rm -rf "$dir"; mkdir -p "$dir"
  s=$(date +%s)
  limit=${STAGE_LIMIT:-${LIMIT[$stage]:-300}}  # STAGE_LIMIT overrides every stage's limit
  echo "=== $stage (limit $limit s)"
  tag="$stage-$$-$s"
  DUALGPU_STAGE_TAG=$tag timeout -k 10 "$limit" ${CMD[$stage]} "$dir" > "$dir/stage.log" 2>&1
  rc=$?
  echo "=== $stage rc=$rc in $(( $(date +%s) - s )) s"; tail -15 "$dir/stage.log"
  [ $rc -eq 0 ] || status=1
  # Anything this stage left behind (vLLM workers, ballast) must not leak into the next one;
  # processes of other session.sh runs (a detached soak) carry another tag and stay.
  kill_stage "$dir" "$tag"; sleep 2
  find "$dir" -maxdepth 1 \( -name '*.json' -o -name '*.md' -o -name '*.png' -o -name '*.xml' \) -size -4M -exec cp {} "$OUT/" \;
done
# One archive with every stage's logs (results come back as a few files only), named for the
# stages, so a detached run's archive copied into the same $OUT does not replace this one.
tar czf "$OUT/logs-$(IFS=-; echo "$*").tar.gz" -C "$WORK" --exclude='models' --exclude='*.safetensors' "$@"
exit $status
