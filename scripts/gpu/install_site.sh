#!/usr/bin/env bash
# Installs this checkout next to the staged vLLM, once per source tree:
#
#     bash scripts/gpu/install_site.sh SITE LOG
#
# Into SITE (pip --target; run.sh's DUALGPU_SITE), unless SITE/.source-hash already names this
# tree's sources. Several run.sh calls may start side by side (a soak beside the tests): they wait
# for one another on SITE.lock, and only the first installs. pip's output goes to LOG.
set -uo pipefail
site=${1:?usage: install_site.sh SITE LOG}
log=${2:?usage: install_site.sh SITE LOG}
cd "$(dirname "$0")/../.."
src_hash=$(find vllm_dualgpu csrc kernel_configs setup.py pyproject.toml -type f ! -name '*.pyc' -print0 \
           | sort -z | xargs -0 sha1sum | sha1sum | cut -c1-16)
mkdir -p "$(dirname "$site")"
exec 9> "$site.lock"
flock 9
if [ "$(cat "$site/.source-hash" 2>/dev/null)" != "$src_hash" ]; then
  python3 -m pip install -q --no-deps --no-build-isolation --no-compile --upgrade --target "$site" . \
      > "$log" 2>&1 || { tail -20 "$log"; exit 1; }
  mkdir -p "$site" && echo "$src_hash" > "$site/.source-hash"
fi
