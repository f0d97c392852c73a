#!/usr/bin/env bash
# pytest and pytest-timeout for the GPU host, which reaches no package index and whose staging (vLLM's wheels)
# does not promise them: scripts/gpu/run.sh tests needs them. (The
# host's Python has had pytest 9.1.1 preinstalled; then `install` leaves it as it is.)
#
#     bash scripts/gpu/test_wheels.sh pack [DIR]      # here, with the index: wheels into DIR
#     bash scripts/gpu/test_wheels.sh install [DIR]   # on the GPU host, after staging
#
# DIR defaults to .gputest (git-ignored; about 2 MB, so it travels with one upload). `pack`
# downloads pytest, pytest-timeout and the wheels they need (pluggy, iniconfig, packaging, pygments) for Python
# 3.12. `install` puts each wheel whose module the staged Python cannot import yet into SITE
# (DUALGPU_SITE, default /tmp/dualgpu-site, where run.sh installs this checkout), with
# --no-index --no-deps: what the host already has (e.g. packaging) is left as it is.
# PYTHON overrides the interpreter (default python3).
set -euo pipefail
mode=${1:?usage: test_wheels.sh pack|install [DIR]}
dir=${2:-.gputest}
PY=${PYTHON:-python3}
PACKAGES=(pytest pytest_timeout pluggy iniconfig packaging pygments)   # module names; wheels: pytest_timeout-*.whl

case "$mode" in
  pack)
    mkdir -p "$dir"
    "$PY" -m pip download -q --only-binary :all: --python-version 3.12 -d "$dir" pytest pytest-timeout
    ls "$dir"
    ;;
  install)
    SITE=${DUALGPU_SITE:-/tmp/dualgpu-site}
    [ -d "$dir" ] || { echo "test_wheels.sh: no wheel folder $dir (run 'test_wheels.sh pack' where the index is reachable, then upload it)" >&2; exit 2; }
    mkdir -p "$SITE"
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
    for dist in "${PACKAGES[@]}"; do
      if "$PY" -c "import $dist" 2>/dev/null; then
        echo "$dist: already importable"
        continue
      fi
      shopt -s nullglob nocaseglob
      wheels=("$dir/$dist"-*.whl)
      shopt -u nullglob nocaseglob
      [ ${#wheels[@]} -gt 0 ] || { echo "test_wheels.sh: $dist is not importable and $dir has no wheel for it" >&2; exit 2; }
      "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "${wheels[-1]}" \
        || { echo "test_wheels.sh: installing ${wheels[-1]} failed" >&2; exit 2; }
      echo "$dist: installed $(basename "${wheels[-1]}") into $SITE"
    done
    "$PY" -c 'import pytest; print("pytest", pytest.__version__, "from", pytest.__file__)'
    ;;
  *) echo "usage: test_wheels.sh pack|install [DIR]" >&2; exit 2 ;;
esac
