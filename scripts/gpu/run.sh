#!/usr/bin/env bash
# The GPU tests and benchmarks on the GPU machine, results under OUTDIR:
#
#     bash scripts/gpu/run.sh OUTDIR [tests] [memory] [soak] [fp8] [headline] [decode] [-- PYTEST_ARGS...]
#
# Run from this checkout after staging vLLM (source the staging step's environment first, or name
# it in STAGING_ENV). Installs this checkout next to vLLM once per source tree (into DUALGPU_SITE,
# default /tmp/dualgpu-site; scripts/gpu/install_site.sh: run.sh calls started side by side wait
# for the first one's install), and pytest and pytest-timeout from the wheels uploaded as .gputest
# (scripts/gpu/test_wheels.sh) when the staged Python lacks them. Then, in order (default: tests):
#   tests   pytest -m gpu tests/gpu (every test there needs a GPU; the harness's CPU tests are in
#           tests/unit/gpu_support): OUTDIR/gpu-junit.xml (each claim, figures as properties),
#           OUTDIR/gpu-tests.log, every test's vLLM logs under OUTDIR/tests/ (DUALGPU_GPU_OUT)
#   memory  benchmarks/memory_sweep.py OUTDIR/memory   (table, JSON, plot)
#   soak    benchmarks/soak.py OUTDIR/soak             (longer than 10 min: start it with setsid nohup)
#   fp8     benchmarks/fp8_tuning.py OUTDIR/fp8        (tuned files, default-vs-tuned table)
#   headline benchmarks/headline.py OUTDIR/headline $HEADLINE_ARGS (a virtual pair on one GPU, or two
#           GPUs with --virtual none; all arms take hours: start it with setsid nohup, or pass e.g.
#           HEADLINE_ARGS="--launchers fp8-mtp --arms plugin"
#           per call; each call adds its arms to OUTDIR/headline/headline.{json,md})
#   decode  benchmarks/decode_model.py OUTDIR/decode --budget (STEP_LIMIT - 40) $DECODE_ARGS (issue #26:
#           per-layer decode times on one GPU; the same call again resumes where the budget stopped it)
# Each step ends its own processes (gpu_harness.stop_group, also on STEP_LIMIT's SIGTERM). Exit 1 if a step failed.
set -uo pipefail
OUTDIR=${1:?usage: run.sh OUTDIR [tests] [memory] [soak] [fp8] [headline] [decode] [-- PYTEST_ARGS...]}
shift
steps=() pytest_args=()
while [ $# -gt 0 ]; do
  if [ "$1" = "--" ]; then shift; pytest_args=("$@"); break; fi
  steps+=("$1"); shift
done
[ ${#steps[@]} -gt 0 ] || steps=(tests)
mkdir -p "$OUTDIR" && OUTDIR=$(cd "$OUTDIR" && pwd)
cd "$(dirname "$0")/../.."
[ -n "${STAGING_ENV:-}" ] && source "$STAGING_ENV"
SITE=${DUALGPU_SITE:-/tmp/dualgpu-site}
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" PATH="$SITE/bin:$PATH"
bash scripts/gpu/install_site.sh "$SITE" "$OUTDIR/install.log" || exit 1
if [ -d .gputest ]; then DUALGPU_SITE=$SITE bash scripts/gpu/test_wheels.sh install .gputest || exit 1; fi
nvidia-smi --query-gpu=index,name,memory.total,memory.used --format=csv,noheader
status=0
for step in "${steps[@]}"; do
  echo "=== $step"
  case "$step" in
    # -P: the installed package (with its native extension), not this checkout's sources.
    # TESTS_LIMIT: seconds, then SIGINT (pytest still writes its JUnit file).
    tests) DUALGPU_GPU_OUT="$OUTDIR/tests" timeout -s INT -k 30 "${TESTS_LIMIT:-86400}" \
             python3 -P -m pytest -m gpu tests/gpu -v -rA \
             --junitxml "$OUTDIR/gpu-junit.xml" "${pytest_args[@]}" > "$OUTDIR/gpu-tests.log" 2>&1
           rc=$?; tail -40 "$OUTDIR/gpu-tests.log" ;;
    memory) timeout -k 10 "${STEP_LIMIT:-580}" python3 benchmarks/memory_sweep.py "$OUTDIR/memory"; rc=$? ;;
    soak) timeout -k 10 "${STEP_LIMIT:-1320}" python3 benchmarks/soak.py "$OUTDIR/soak"; rc=$? ;;
    fp8) timeout -k 10 "${STEP_LIMIT:-330}" python3 benchmarks/fp8_tuning.py "$OUTDIR/fp8"; rc=$? ;;
    # shellcheck disable=SC2086  # HEADLINE_ARGS is a list of options
    headline) timeout -k 10 "${STEP_LIMIT:-9000}" python3 benchmarks/headline.py "$OUTDIR/headline" \
                ${HEADLINE_ARGS:-}; rc=$? ;;
    # shellcheck disable=SC2086  # DECODE_ARGS is a list of options
    decode) timeout -k 10 "${STEP_LIMIT:-580}" python3 benchmarks/decode_model.py "$OUTDIR/decode" \
              --budget $(( ${STEP_LIMIT:-580} - 40 )) ${DECODE_ARGS:-}; rc=$? ;;
    *) echo "unknown step $step (tests, memory, soak, fp8, headline, decode)" >&2; rc=2 ;;
  esac
  echo "=== $step rc=$rc"
  [ $rc -eq 0 ] || status=1
done
exit $status
