#!/usr/bin/env bash
# Runs a command while keeping a compressed copy of a results folder up to date, so that a call cut
# by its time limit still leaves its latest results behind in one file:
#
#     bash scripts/gpu/with_bundle.sh BUNDLE.tgz DIR -- COMMAND [ARGS...]
#
# Every BUNDLE_EVERY seconds (default 40) DIR is packed into BUNDLE.tgz (written beside it under a
# dot-name and renamed, so the bundle is always whole); once COMMAND ends, a last time. Exits with
# COMMAND's status. A GPU call that returns only a few files (the run folder holds many: arms,
# logs, plans) names BUNDLE.tgz under its output folder; unpack with `tar xzf BUNDLE.tgz -C DEST`.
# A call brings back files of at most 16 MiB each (8 files, 64 MiB in all): the compile caches'
# parts (caches.tar.gz.NN anywhere in DIR, scripts/gpu/caches.sh, 15 MiB each) stay out of the
# bundle and are copied beside it instead, where they come back one file each (the twenty-ninth
# session's bundle with a 37 MiB cache inside came back not at all).
set -uo pipefail
bundle=${1:?usage: with_bundle.sh BUNDLE.tgz DIR -- COMMAND [ARGS...]}
dir=${2:?usage: with_bundle.sh BUNDLE.tgz DIR -- COMMAND [ARGS...]}
[ "${3:-}" = "--" ] || { echo "with_bundle.sh: expected -- before the command" >&2; exit 2; }
shift 3
[ $# -gt 0 ] || { echo "with_bundle.sh: no command given" >&2; exit 2; }
every=${BUNDLE_EVERY:-40}
mkdir -p "$dir" "$(dirname "$bundle")"
tmp="$(dirname "$bundle")/.$(basename "$bundle").part"

pack() {
  find "$dir" -type f -name 'caches.tar.*.[0-9][0-9]' -exec cp -fu {} "$(dirname "$bundle")/" \; 2>/dev/null
  tar czf "$tmp" -C "$dir" --exclude='caches.tar.*.[0-9][0-9]' . 2>/dev/null && mv -f "$tmp" "$bundle"
}

(while sleep "$every"; do pack; done) &
packer=$!
"$@"
status=$?
kill "$packer" 2>/dev/null
wait "$packer" 2>/dev/null
pack
rm -f "$tmp"
exit $status
