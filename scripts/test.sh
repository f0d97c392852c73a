#!/usr/bin/env bash
# The test command: bash scripts/test.sh
#
# Over the supported vLLM range (vllm_dualgpu/_version.py SUPPORTED_VLLM) on a CPU-only machine:
#   - the oldest (0.30.0, torch 2.13.0), the newest that PyPI installs (0.33.0, torch 2.14.0) and
#     the newest (0.34.0, torch 2.14.0; installed by install_vllm_034 below) release each get a
#     venv, this package's wheel (built once, installed as users get it, not editable) and the
#     full suite (VLLM_TARGET_DEVICE=cpu pytest);
#   - after 0.33.0's suite, upstream/check.sh: every upstream/ draft still applies to vLLM
#     0.33.0's sdist (downloaded once into TEST_VENVS/upstream, 47 MB) and the drafts' CPU tests
#     pass against the patched files (about 1.5 min with the sdist cached);
#   - the middle releases (0.31.0, 0.32.0) get the registry's static checks against their
#     released sources (every entry in range: target, parameters, pinned source; every
#     `from x import f` copy of a patched function that the entry does not rebind and every
#     subclass override of a patched method; the interventions' objects in vLLM's tree), without
#     installing or importing them (the installed 0.30.0, 0.33.0 and 0.34.0 get the same check), and the sm hook's coverage report of their library where
#     this package has one.
# Exits non-zero on any failure (pytest collecting no tests counts as one).
#
# Disk: the venvs are large (about 6 GB for 0.30.0 with the CPU torch, 10 GB for 0.33.0 with the
# CUDA torch), so they are built one at a time without pip's cache and each is removed after its
# suite; the peak is about 12 GB free on TEST_VENVS' filesystem, checked before each install.
#
# Environment: TEST_VENVS (default .venvs/test) holds the venvs and downloaded wheels.
# TEST_KEEP_VENVS=1 keeps each venv after its suite, and a kept venv that already has the right
# vLLM is reused. TEST_RELEASES_FULL / TEST_RELEASES_STATIC override the release lists
# ("0.30.0:2.13.0 0.33.0:2.14.0 0.34.0:2.14.0" / "0.31.0 0.32.0"). Extra arguments go to pytest.
set -uo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1
# pip's cache would hold a second copy of every wheel (GBs for the CUDA torch); nothing here
# installs the same wheel twice.
export PIP_NO_CACHE_DIR=1
ROOT=$(pwd)
VENVS=${TEST_VENVS:-$ROOT/.venvs/test}
FULL=${TEST_RELEASES_FULL-"0.30.0:2.13.0 0.33.0:2.14.0 0.34.0:2.14.0"}
STATIC=${TEST_RELEASES_STATIC-"0.31.0 0.32.0"}
PYTHON=${PYTHON:-python3}
mkdir -p "$VENVS"
start=$(date +%s)
failures=()
note_removed=0

KEEP=${TEST_KEEP_VENVS:-0}

step() { echo; echo "=== $* ($(( $(date +%s) - start )) s)"; }
fail() { echo "FAILED: $*"; failures+=("$*"); }

step "building the vllm-dualgpu wheel"
builder="$VENVS/build"
[ -x "$builder/bin/pip" ] || "$PYTHON" -m venv "$builder"
rm -rf "$VENVS/dist"
if ! "$builder/bin/pip" wheel -q --no-deps -w "$VENVS/dist" "$ROOT"; then
    fail "wheel build"
    exit 1
fi
wheel=$(ls "$VENVS"/dist/vllm_dualgpu-*.whl)
# The static checks read sources only: the wheel without its dependencies is enough for them,
# and capstone for the sm hook's coverage analysis of each release's library.
"$builder/bin/pip" install -q --no-deps --force-reinstall "$wheel" packaging capstone >&2 || fail "wheel install for the static checks"
checker=$builder/bin/python

# free_gb: GB free on the filesystem that holds the venvs.
free_gb() { df -Pk "$VENVS" | awk 'NR == 2 { printf "%d", $4 / 1048576 }'; }

# need_disk GB WHAT: stop with the reason when less than GB is free for WHAT.
need_disk() {
    local have
    have=$(free_gb)
    if [ "$have" -lt "$1" ]; then
        echo "not enough disk for $2: $have GB free on $(df -P "$VENVS" | awk 'NR == 2 { print $6 }'), about $1 GB needed" \
             "(free some, or point TEST_VENVS at a larger disk)" >&2
        return 1
    fi
}

# install_vllm_034 VENV: vLLM 0.34.0's wheel pins flashinfer-python==0.7.3, which PyPI does not
# serve (0.7.2.post1 and 0.7.4 are there), so `pip install vllm==0.34.0` cannot resolve. Install
# the wheel without dependencies, then every requirement it declares as declared, except that
# pin, and flashinfer-python 0.7.4 in its place (the CPU suite imports none of FlashInfer's
# kernels), and without the torch companions that make_venv removes anyway.
install_vllm_034() {
    local venv=$1
    "$venv/bin/pip" install -q --no-deps "vllm==0.34.0" packaging >&2 || return 1
    "$venv/bin/python" - > "$venv/vllm-requirements.txt" <<'PY' || return 1
import importlib.metadata as m
from packaging.requirements import Requirement
for line in m.requires("vllm") or []:
    r = Requirement(line)
    if r.marker is not None and "extra" in str(r.marker):
        continue
    if r.name == "flashinfer-python":
        print("flashinfer-python==0.7.4")
    elif r.name not in ("torchvision", "torchaudio", "torchcodec"):  # removed below in any case
        print(line)
PY
    echo "vLLM 0.34.0: its flashinfer-python==0.7.3 pin is not on PyPI; installing 0.7.4 in its place" >&2
    "$venv/bin/pip" install -q -r "$venv/vllm-requirements.txt" >&2
}

# venv VERSION TORCH: a venv with vLLM VERSION on torch TORCH and this wheel; prints its path.
make_venv() {
    local version=$1 torch=$2 venv="$VENVS/vllm-$1" t0
    t0=$(date +%s)
    if [ "$("$venv/bin/python" -c 'import importlib.metadata as m; print(m.version("vllm"))' 2>/dev/null)" != "$version" ]; then
        rm -rf "$venv"
        # The CUDA build of torch (and the NVIDIA libraries it loads) is about 6 GB installed
        # and is unpacked from about 4 GB of downloaded wheels.
        case $torch in 2.13.*) need=7 ;; *) need=12 ;; esac
        need_disk $need "the vLLM $version venv" || return 1
        "$PYTHON" -m venv "$venv" || return 1
        # torch first and pinned: vLLM's pin alone would pull whatever build the index prefers.
        # 2.13.0 resolves to a CPU build where one is served; 2.14.0 only as the CUDA build,
        # which imports fine without a GPU.
        "$venv/bin/pip" install -q "torch==$torch" >&2 || return 1
        echo "torch $torch: $(( $(date +%s) - t0 )) s" >&2
        # The test extra (pytest, pytest-timeout), capstone (the sm hook coverage analysis) and
        # Ray (dualgpu-ray's tests run a local Ray cluster).
        if [ "$version" = 0.34.0 ]; then
            install_vllm_034 "$venv" || return 1
        else
            "$venv/bin/pip" install -q "vllm==$version" >&2 || return 1
        fi
        "$venv/bin/pip" install -q "pytest>=8" "pytest-timeout>=2" "capstone>=5" "ray==2.60.0" >&2 || return 1
        echo "vLLM $version: $(( $(date +%s) - t0 )) s, $(du -sh "$venv" | cut -f1) in the venv, $(free_gb) GB left free" >&2
    fi
    "$venv/bin/pip" install -q --no-deps --force-reinstall "$wheel" >&2 || return 1
    if [ $note_removed = 0 ]; then
        echo "Removing torchvision, torchaudio and torchcodec from the test venvs: vLLM pulls" \
             "them in, and without a GPU driver they break 'import vllm'." >&2
    fi
    "$venv/bin/pip" uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1
    echo "$venv"
}

# coverage PYTHON LIBRARY: the sm hook's report for a vLLM library, if this package has one.
coverage() {
    local py=$1 lib=$2
    if ! "$py" - <<'EOF' 2>/dev/null; then
import importlib.util, sys
spec = importlib.util.find_spec("vllm_dualgpu.kernels.sm_hook")
sys.exit(0 if spec and "--coverage" in open(spec.origin).read() else 1)
EOF
        echo "(sm hook coverage: this package has no 'python -m vllm_dualgpu.kernels.sm_hook --coverage'; skipped)"
        return 0
    fi
    [ -f "$lib" ] || { fail "sm hook coverage: $lib missing"; return 0; }
    "$py" -m vllm_dualgpu.kernels.sm_hook --coverage "$lib" || fail "sm hook coverage of $lib"
}

echo "disk: $(free_gb) GB free for the venvs"
for pair in $FULL; do
    version=${pair%%:*} torch=${pair#*:}
    step "vLLM $version (torch $torch): installing"
    if ! venv=$(make_venv "$version" "$torch"); then
        fail "install of vLLM $version"
        continue
    fi
    note_removed=1
    step "vLLM $version: static checks of the installed release"
    site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    "$venv/bin/python" -m vllm_dualgpu.patching.static_check --vllm-tree "$site" --version "$version" \
        || fail "static checks on vLLM $version"
    coverage "$venv/bin/python" "$site/vllm/_C_stable_libtorch.abi3.so"
    step "vLLM $version: full suite"
    # Run from the tests' folder's parent with the installed wheel (the source tree is not on
    # sys.path: pytest is the venv's script, not python -m pytest).
    (cd "$ROOT" && VLLM_TARGET_DEVICE=cpu "$venv/bin/pytest" -q -p no:cacheprovider "$@")
    rc=$?
    [ $rc = 5 ] && echo "pytest collected no tests"
    [ $rc = 0 ] || fail "suite on vLLM $version (pytest exit $rc)"
    if [ "$version" = 0.33.0 ]; then
        step "vLLM $version: upstream drafts (apply to the released sdist, CPU tests)"
        UPSTREAM_CACHE="$VENVS/upstream" bash "$ROOT/upstream/check.sh" "$venv/bin/python" \
            || fail "upstream drafts on vLLM $version"
    fi
    [ "$KEEP" = 1 ] || rm -rf "$venv"
done

for version in $STATIC; do
    step "vLLM $version: static checks against the released wheel"
    tree="$VENVS/src-$version"
    if [ ! -f "$tree/vllm/__init__.py" ]; then
        rm -rf "$tree" "$VENVS/wheels-$version"
        if ! "$checker" -m pip download -q --no-deps "vllm==$version" -d "$VENVS/wheels-$version"; then
            fail "download of the vLLM $version wheel"
            continue
        fi
        mkdir -p "$tree"
        unzip -q "$VENVS"/wheels-$version/vllm-*.whl 'vllm/*.py' 'vllm/_C_stable_libtorch.abi3.so' -d "$tree" \
            || { fail "unpacking the vLLM $version wheel"; continue; }
        rm -rf "$VENVS/wheels-$version"
    fi
    "$checker" -m vllm_dualgpu.patching.static_check --vllm-tree "$tree" --version "$version" \
        || fail "static checks on vLLM $version"
    coverage "$checker" "$tree/vllm/_C_stable_libtorch.abi3.so"
done

step "done"
if [ ${#failures[@]} -gt 0 ]; then
    printf 'FAILED: %s\n' "${failures[@]}"
    exit 1
fi
echo "all passed: full suite on ${FULL// /, }; static checks on ${STATIC// /, }"
