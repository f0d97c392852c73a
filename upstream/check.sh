#!/usr/bin/env bash
# The upstream drafts still apply to vLLM's released source, and their CPU tests pass.
#
#   bash upstream/check.sh [PYTHON]
#
# 1. Downloads vLLM's sdist (VERSION below) once into the cache folder and unpacks it there.
# 2. `git apply --check`s every upstream/*/*.patch against that source; a patch that no longer
#    applies fails the check.
# 3. Applies all patches in turn to a scratch copy of the files they touch, lays the patched
#    vllm/ files over the installed vLLM of PYTHON (upstream/overlay.py: links to the installed
#    package, copies of the patched files), and runs the tests each draft lists in its
#    cpu-tests.txt there, on the CPU, in one pytest run, without vLLM's tests/conftest.py (its
#    test-only dependencies are not installed) and without plugins (VLLM_PLUGINS empty, so this
#    package's patches do not mix in).
#
# PYTHON (default python3) must have this VERSION of vLLM and pytest installed; without vLLM the
# tests are skipped with a note and only the apply checks run. Environment: UPSTREAM_CACHE
# (default $TEST_VENVS/upstream, TEST_VENVS defaulting to .venvs/test as in scripts/test.sh)
# holds the sdist; UPSTREAM_SDIST names an already downloaded sdist to use instead of PyPI;
# UPSTREAM_DRAFTS (default upstream/) is the folder of drafts.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
VERSION=0.33.0
PY=${1:-python3}
CACHE=${UPSTREAM_CACHE:-${TEST_VENVS:-$ROOT/.venvs/test}/upstream}
mkdir -p "$CACHE"
CACHE=$(cd "$CACHE" && pwd)
SDIST=$CACHE/vllm-$VERSION.tar.gz
TREE=$CACHE/vllm-$VERSION
# The cache may lie inside this repository: keep git from treating the unpacked source as a
# subdirectory of it (git apply would skip every path outside that subdirectory).
export GIT_CEILING_DIRECTORIES=$CACHE:${TMPDIR:-/tmp}
failures=0

if [ ! -f "$TREE/.unpacked" ]; then
    if [ -n "${UPSTREAM_SDIST:-}" ]; then
        cp "$UPSTREAM_SDIST" "$SDIST.part" && mv "$SDIST.part" "$SDIST" || exit 1
    elif [ ! -f "$SDIST" ]; then
        # pip cannot download an sdist without building its metadata (which for vLLM installs
        # torch): the file and its sha256 come from the package index's simple page (PEP 503,
        # what pip reads; the JSON API is not served by every mirror).
        "$PY" - "$VERSION" "$SDIST" <<'PYEOF' || { echo "FAILED: download of the vLLM $VERSION sdist"; exit 1; }
import hashlib, os, re, sys, urllib.parse, urllib.request
version, dest = sys.argv[1], sys.argv[2]
index = os.environ.get("UPSTREAM_INDEX", "https://pypi.org/simple/")
page = urllib.parse.urljoin(index, "vllm/")
with urllib.request.urlopen(page, timeout=60) as r:
    html = r.read().decode()
name = f"vllm-{version}.tar.gz"
links = re.findall(r'href="([^"]*/' + re.escape(name) + r'#sha256=([0-9a-f]{64}))"', html)
if not links:
    sys.exit(f"{page} lists no {name}")
url, sha = links[0]
with urllib.request.urlopen(urllib.parse.urljoin(page, url.split("#")[0]), timeout=600) as r:
    data = r.read()
if hashlib.sha256(data).hexdigest() != sha:
    sys.exit(f"{name}: sha256 differs from the index's")
with open(dest + ".part", "wb") as f:
    f.write(data)
os.replace(dest + ".part", dest)
print(f"downloaded {name} ({len(data) >> 20} MiB)")
PYEOF
    fi
    rm -rf "$TREE" "$TREE.part"
    mkdir -p "$TREE.part"
    tar -xzf "$SDIST" -C "$TREE.part" --strip-components=1 || { echo "FAILED: unpacking $SDIST"; exit 1; }
    mv "$TREE.part" "$TREE" && touch "$TREE/.unpacked"
fi

DRAFTS=${UPSTREAM_DRAFTS:-$ROOT/upstream}
patches=("$DRAFTS"/*/*.patch)
for p in "${patches[@]}"; do
    name=${p#"$DRAFTS"/}
    if (cd "$TREE" && git apply --check "$p"); then
        echo "applies to vLLM $VERSION: $name"
    else
        echo "FAILED: $name no longer applies to vLLM $VERSION's source"
        failures=$((failures + 1))
    fi
done

installed=$("$PY" -c 'import importlib.util as u, os; s = u.find_spec("vllm"); print(os.path.dirname(s.origin))' 2>/dev/null)
have=$("$PY" -c 'import importlib.metadata as m; print(m.version("vllm"))' 2>/dev/null)
tests=()
for list in "$DRAFTS"/*/cpu-tests.txt; do
    [ -f "$list" ] || continue
    while read -r t; do [ -n "$t" ] && tests+=("$t"); done < <(grep -v '^#' "$list")
done
if [ ${#tests[@]} = 0 ]; then
    echo "no cpu-tests.txt lists a test"
elif [ "$have" != "$VERSION" ] || [ -z "$installed" ]; then
    echo "skipping the drafts' tests: $PY has vLLM '${have:-none}', not $VERSION"
elif [ $failures = 0 ]; then
    scratch=$(mktemp -d)
    trap 'rm -rf "$scratch"' EXIT
    mkdir -p "$scratch/src" "$scratch/overlay"
    touched=()
    for p in "${patches[@]}"; do
        while read -r f; do touched+=("$f"); done < <(cd "$TREE" && git apply --numstat "$p" | cut -f3)
    done
    for f in "${touched[@]}"; do
        [ -f "$TREE/$f" ] && [ ! -f "$scratch/src/$f" ] && install -D -m 644 "$TREE/$f" "$scratch/src/$f"
    done
    for p in "${patches[@]}"; do
        (cd "$scratch/src" && git apply "$p") || { echo "FAILED: ${p#"$DRAFTS"/} conflicts with the drafts before it"; failures=$((failures + 1)); }
    done
    if [ $failures = 0 ]; then
        "$PY" "$ROOT/upstream/overlay.py" "$installed" "$scratch/src" "$scratch/overlay" \
            $(printf '%s\n' "${touched[@]}" | grep '^vllm/' | sort -u) || exit 1
        (cd "$scratch/src" && VLLM_PLUGINS= VLLM_TARGET_DEVICE=cpu PYTHONPATH="$scratch/overlay" \
            "$PY" -P -m pytest -q -p no:cacheprovider --noconftest --import-mode=importlib "${tests[@]}") \
            || { echo "FAILED: the drafts' tests"; failures=$((failures + 1)); }
    fi
fi

[ $failures = 0 ] && echo "upstream drafts: all apply to vLLM $VERSION; their CPU tests pass" && exit 0
exit 1
