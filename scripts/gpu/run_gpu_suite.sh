#!/usr/bin/env bash
# Run the whole GPU test suite (`pytest -m gpu tests/`) on a GPU machine where vLLM 0.30.0 and this
# checkout are already staged; stages and installs nothing itself.
#
#     OUT=/some/dir bash scripts/gpu/run_gpu_suite.sh [OUTDIR] [extra pytest args]
#     OUT=/some/dir bash scripts/gpu/session.sh suite      # the same, after installing the checkout
#
# DUALGPU_SUITE_TESTS overrides the test paths (default tests/); PYTHON the interpreter.
# Writes OUTDIR (default $OUT) /gpu-junit.xml (JUnit), /gpu-suite-summary.json and
# /gpu-suite.log, prints a summary, and kills every process the run started: each process it
# starts carries DUALGPU_SUITE_TOKEN in its environment (vLLM engines and workers, ballast,
# servers; also those in process groups of their own), and whatever still carries it at the
# end is terminated, then killed. Expected time: ~6-7 min (tests/e2e runs
# scripts/gpu/e2e_correctness.py --quick). Exit code: pytest's; 3 when no test ran (e.g. no GPU
# visible to NVML, so every test was skipped); 4 when pytest or vLLM is missing.
set -uo pipefail
OUTDIR=${1:-${OUT:?set OUT or pass OUTDIR}}
[ $# -gt 0 ] && shift
mkdir -p "$OUTDIR"
OUTDIR=$(cd "$OUTDIR" && pwd)
cd "$(dirname "$0")/../.."
# The staging step's environment (vLLM on PYTHONPATH), if given; else source it before running.
[ -n "${STAGING_ENV:-}" ] && source "$STAGING_ENV"
PY=${PYTHON:-python3}

if ! "$PY" -c 'import pytest' 2>/dev/null; then
  echo "pytest is not importable by $PY: stage it first (scripts/gpu/test_wheels.sh pack here, upload .gputest, then test_wheels.sh install there; session.sh suite does the install)" >&2
  exit 4
fi
if ! "$PY" -c 'import importlib.util as u, sys; sys.exit(not (u.find_spec("vllm") and u.find_spec("vllm_dualgpu")))' 2>/dev/null; then
  echo "vllm or vllm_dualgpu is not importable by $PY: stage vLLM and install this checkout first" >&2
  exit 4
fi
"$PY" -c 'import pynvml' 2>/dev/null || echo "warning: pynvml is missing: tests/conftest.py will see no GPU and skip every GPU test" >&2
nvidia-smi --query-gpu=index,name,memory.total,memory.used --format=csv,noheader 2>/dev/null

TOKEN="suite-$$-$(date +%s)-$RANDOM"
export DUALGPU_SUITE_TOKEN=$TOKEN
export OUT=$OUTDIR   # tests/e2e keeps its run folder under $OUT/e2e-pytest
start=$(date +%s)
"$PY" -m pytest -m gpu ${DUALGPU_SUITE_TESTS:-tests/} -v -rA --junitxml "$OUTDIR/gpu-junit.xml" "$@" > "$OUTDIR/gpu-suite.log" 2>&1
rc=$?
unset DUALGPU_SUITE_TOKEN
[ $rc -eq 0 ] || tail -40 "$OUTDIR/gpu-suite.log"

# Kill what the run left behind: every process whose environment carries this run's token.
# The killer itself runs without the token; this shell is excluded by pid.
env -u DUALGPU_SUITE_TOKEN "$PY" - "$TOKEN" "$$" <<'EOF'
import os, signal, sys, time
token, me = ("DUALGPU_SUITE_TOKEN=" + sys.argv[1]).encode(), {int(sys.argv[2]), os.getpid()}

def tagged():
    pids = []
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) in me:
            continue
        try:
            with open(f"/proc/{d}/environ", "rb") as f:
                if token in f.read().split(b"\0"):
                    pids.append(int(d))
        except OSError:
            pass
    return pids

left = found = tagged()
for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 2.0)):
    for pid in left:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
    end = time.time() + wait
    while time.time() < end and tagged():
        time.sleep(0.2)
    left = tagged()
    if not left:
        break
print(f"leftover processes of this run: {len(found)} found {sorted(found)}, "
      f"{'all ended' if not left else 'STILL ALIVE: ' + str(left)}")
EOF

# Summary from the JUnit file (stdlib only).
"$PY" - "$OUTDIR" "$rc" "$(( $(date +%s) - start ))" <<'EOF'
import json, sys, xml.etree.ElementTree as ET
from pathlib import Path
out, rc, wall = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
s = {"pytest_rc": rc, "wall_s": wall, "tests": 0, "passed": 0, "failed": 0, "errors": 0, "skipped": 0,
     "cases": []}
junit = out / "gpu-junit.xml"
if junit.exists():
    for case in ET.parse(junit).getroot().iter("testcase"):
        kind = "passed"
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is not None:
                kind = {"failure": "failed", "error": "errors", "skipped": "skipped"}[tag]
                msg = (el.get("message") or "")[:300]
                break
        else:
            msg = ""
        s["tests"] += 1
        s[kind] += 1
        s["cases"].append({"name": f"{case.get('classname')}::{case.get('name')}", "outcome": kind,
                           "time_s": round(float(case.get("time") or 0), 1), "message": msg})
ran = s["passed"] + s["failed"] + s["errors"]
(out / "gpu-suite-summary.json").write_text(json.dumps(s, indent=1))
for c in s["cases"]:
    print(f"{c['outcome']:>7} {c['time_s']:>7.1f}s {c['name']} {c['message']}")
print(f"GPU suite: {s['passed']} passed, {s['failed']} failed, {s['errors']} errors, {s['skipped']} skipped "
      f"in {wall} s (pytest rc={rc})")
if ran == 0:
    print("no GPU test ran: see the skip reasons above (tests/conftest.py skips GPU tests when NVML sees no GPU)")
EOF
if [ $rc -eq 0 ] && ! grep -q 'outcome": "passed"' "$OUTDIR/gpu-suite-summary.json" 2>/dev/null; then
  exit 3
fi
[ $rc -eq 5 ] && exit 3   # pytest: no tests collected
exit $rc
