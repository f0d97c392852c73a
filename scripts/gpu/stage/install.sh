#!/usr/bin/env bash
# Runs ON the GPU machine, from the project checkout that travelled with the uploads, after every
# part made by pack.sh has been moved into /tmp/gpukit:
#     bash scripts/gpu/stage/install.sh
# Checks that the parts are complete (MANIFEST, written by pack.sh into the last part), rebuilds
# the wheel archive, installs it into /tmp/gpukit/site (replacing any earlier release there),
# writes /tmp/gpukit/env.sh (the wheels ahead of the image's own packages through PYTHONPATH,
# NVLink multicast off), installs this checkout into the same folder so vLLM finds its entry
# points, and ends with check_site.py: versions, GPU count, NCCL version, unmet requirements.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../../.." && pwd)
G=${GPUKIT_DIR:-/tmp/gpukit}  # overridable for tests only: env.sh and the docs say /tmp/gpukit
SITE=$G/site

[ -f "$G/MANIFEST" ] || { echo "install.sh: no $G/MANIFEST: move every part (the last one holds MANIFEST) into $G first" >&2; exit 2; }
release=$(sed -n 's/^release=//p' "$G/MANIFEST")
parts=$(sed -n 's/^parts=//p' "$G/MANIFEST")
sha256=$(sed -n 's/^sha256=//p' "$G/MANIFEST")
LIST="$HERE/vllm-$release.txt"
[ -f "$LIST" ] || { echo "install.sh: the parts are for vLLM $release but this checkout has no $LIST: upload the checkout they were packed from" >&2; exit 2; }
missing=()
for ((i = 0; i < parts; i++)); do
    [ -f "$G/part.$(printf %02d $i)" ] || missing+=("p$(printf %02d $i)")
done
[ ${#missing[@]} -eq 0 ] || { echo "install.sh: parts missing from $G: ${missing[*]}: upload each and move it there, then run this again" >&2; exit 2; }
extra=$(ls "$G"/part.* | wc -l)
[ "$extra" -eq "$parts" ] || { echo "install.sh: $G holds $extra parts but MANIFEST names $parts: clear $G and move this release's parts in again" >&2; exit 2; }
echo "checking $parts parts of vLLM $release"
got=$(cat "$G"/part.* | sha256sum | cut -d' ' -f1)
[ "$got" = "$sha256" ] || { echo "install.sh: the parts' checksum is $got, MANIFEST says $sha256: a part is damaged or from another pack; upload them again" >&2; exit 2; }

t0=$(date +%s)
rm -rf "$G/whl" "$SITE" && mkdir -p "$G/whl"
cat "$G"/part.* | tar xf - -C "$G/whl"
# One pip call for the wheels and this checkout (built against the image's setuptools and
# pybind11): a second `pip install --target --upgrade` would replace the folder's bin/ (vllm's
# commands) with the checkout's.
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --no-cache-dir \
    --target "$SITE" "$G"/whl/*.whl "$ROOT"
rm -rf "$G/whl" "$G"/part.*
echo "installed $(grep -v '^#' "$LIST" | grep -c .) wheels and $(cd "$ROOT" && python3 -c 'exec(open("vllm_dualgpu/_version.py").read()); print("vllm-dualgpu", __version__)') into $SITE in $(( $(date +%s) - t0 )) s"

cat > "$G/env.sh" <<EOF
# vLLM $release staged by scripts/gpu/stage/install.sh; source before every command.
export PYTHONPATH=$SITE\${PYTHONPATH:+:\$PYTHONPATH}
export PATH=$SITE/bin:\$PATH
# NVLink multicast must stay off on these shared machines.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 CUDA_DEVICE_ORDER=PCI_BUS_ID
export GPUKIT_RELEASE=$release
EOF
source "$G/env.sh"

cd /tmp && python3 "$HERE/check_site.py" "$LIST" "$SITE"
echo "ready: start every command with: source $G/env.sh &&"
