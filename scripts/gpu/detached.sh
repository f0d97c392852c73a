#!/usr/bin/env bash
# Run session.sh stages that outlast one 10-minute command (the 10-minute soak), detached:
#     bash scripts/gpu/detached.sh start soak          # returns at once
#     OUT=<dir> bash scripts/gpu/detached.sh wait 540  # waits up to 540 s, then reports
# `wait` prints the progress; once the stages have ended it copies their results to $OUT.
set -uo pipefail
WORK=${DUALGPU_WORK:-/tmp/dualgpu-work}
DIR="$WORK/detached"
case "${1:-}" in
  start)
    shift
    rm -rf "$DIR"; mkdir -p "$DIR/out"
    setsid nohup env OUT="$DIR/out" bash scripts/gpu/session.sh "$@" > "$DIR/session.log" 2>&1 &
    echo $! > "$DIR/pid"
    echo "started stages: $* (pid $(cat "$DIR/pid")); log: $DIR/session.log"
    ;;
  wait)
    : "${OUT:?set OUT to the results folder}"
    limit=${2:-540}; end=$(( $(date +%s) + limit ))
    pid=$(cat "$DIR/pid" 2>/dev/null) || { echo "nothing started"; exit 2; }
    while kill -0 "$pid" 2>/dev/null && [ "$(date +%s)" -lt "$end" ]; do sleep 5; done
    tail -20 "$DIR/session.log"
    if kill -0 "$pid" 2>/dev/null; then echo "still running"; exit 3; fi
    cp "$DIR"/out/* "$OUT"/ 2>/dev/null; echo "done; results copied"
    ;;
  *) echo "usage: $0 start STAGE... | wait [SECONDS]"; exit 2 ;;
esac
