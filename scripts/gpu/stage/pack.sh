#!/usr/bin/env bash
# Packs one vLLM release and the wheels the offline GPU machine lacks for it into parts small
# enough to upload one at a time. Run it from anywhere in the project checkout, on a machine that
# reaches the package index:
#     bash scripts/gpu/stage/pack.sh 0.33.0
# It reads vllm-<release>.txt beside this file, downloads those wheels once (cached under
# ~/.cache/gpukit, or $GPUKIT_CACHE), writes .gpukit/p00 ... .gpukit/pNN at the checkout's root
# (git-ignored through .git/info/exclude; the last part also holds MANIFEST) and prints the
# upload order. README.md beside this file explains the whole procedure.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
RELEASE=${1:-}
LIST="$HERE/vllm-$RELEASE.txt"
if [ -z "$RELEASE" ] || [ ! -f "$LIST" ]; then
    echo "usage: bash scripts/gpu/stage/pack.sh RELEASE, with RELEASE one of:" \
        $(cd "$HERE" && ls vllm-*.txt | sed 's/^vllm-//; s/\.txt$//') >&2
    exit 2
fi
ROOT=$(git -C "$HERE" rev-parse --show-toplevel)
CACHE=${GPUKIT_CACHE:-$HOME/.cache/gpukit}
PART_MIB=${GPUKIT_PART_MIB:-60}
UPLOAD_MIB=64

mkdir -p "$CACHE/wheels"
platforms=()
for p in 2_5 2_17 2_24 2_27 2_28 2_31 2_34 2_35; do platforms+=(--platform "manylinux_${p}_x86_64"); done
python3 -m pip download -q --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp "${platforms[@]}" \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
    -d "$CACHE/wheels" -r "$LIST" 2>&1 | { grep -v 'is ignored' || true; }

# The cache holds every release's wheels: pick exactly this list's, one file per line.
python3 "$HERE/select_wheels.py" "$LIST" "$CACHE/wheels" > "$CACHE/$RELEASE.files"

EXCLUDE=$(git -C "$ROOT" rev-parse --path-format=absolute --git-path info/exclude)
mkdir -p "$(dirname "$EXCLUDE")"
grep -qx '/.gpukit/' "$EXCLUDE" 2>/dev/null || echo '/.gpukit/' >> "$EXCLUDE"
rm -rf "$ROOT/.gpukit" && mkdir -p "$ROOT/.gpukit/split"
(cd "$CACHE/wheels" && tar cf - -T "$CACHE/$RELEASE.files") \
    | split -b "${PART_MIB}M" -d -a 2 - "$ROOT/.gpukit/split/part."
sha=$(cat "$ROOT"/.gpukit/split/part.* | sha256sum | cut -d' ' -f1)
n=0
for f in "$ROOT"/.gpukit/split/part.*; do
    d="$ROOT/.gpukit/p$(printf %02d $n)"; mkdir -p "$d"; mv "$f" "$d/"; n=$((n + 1))
done
last=$(printf %02d $((n - 1)))
{
    echo "release=$RELEASE"
    echo "parts=$n"
    echo "sha256=$sha"
} > "$ROOT/.gpukit/p$last/MANIFEST"
rm -rf "$ROOT/.gpukit/split"

total_mib=$(du -cm "$ROOT"/.gpukit/p*/part.* | tail -1 | cut -f1)
tree_mib=$(git -C "$ROOT" ls-files -co --exclude-standard -z | xargs -0 du -ck 2>/dev/null | tail -1 | cut -f1)
tree_mib=$(( (tree_mib + 1023) / 1024 ))
echo
echo "vLLM $RELEASE: $(wc -l < "$CACHE/$RELEASE.files") wheels, $total_mib MiB, in $n parts of at most $PART_MIB MiB under .gpukit/"
if [ $((PART_MIB + tree_mib)) -gt $UPLOAD_MIB ]; then
    echo "WARNING: a part plus the working tree (~$tree_mib MiB) exceeds $UPLOAD_MIB MiB: set GPUKIT_PART_MIB lower" >&2
fi
echo "upload .gpukit/p00 ... .gpukit/p$last in order, one per upload (the working tree adds ~$tree_mib MiB); on the GPU machine:"
echo "  first:  mkdir -p /tmp/gpukit && rm -f /tmp/gpukit/part.* /tmp/gpukit/MANIFEST && mv .gpukit/p00/* /tmp/gpukit/"
echo "  each:   mv .gpukit/pNN/* /tmp/gpukit/"
echo "  last:   mv .gpukit/p$last/* /tmp/gpukit/ && bash scripts/gpu/stage/install.sh"
echo "  then start every command with: source /tmp/gpukit/env.sh &&"
