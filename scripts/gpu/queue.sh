#!/usr/bin/env bash
# A queue of GPU runs that outlives one call: started once, detached, on the GPU machine; each
# later call waits on it for at most its own time and brings back the run folder in one file.
#
#     bash scripts/gpu/queue.sh start QUEUE RUNDIR               # returns at once
#     bash scripts/gpu/queue.sh wait RUNDIR SECONDS BUNDLE.tgz   # until the queue ends or SECONDS pass
#     bash scripts/gpu/queue.sh run QUEUE RUNDIR SECONDS BUNDLE.tgz   # start, then wait
#
# QUEUE: one bash command a line, run in order from this checkout's root with RUN=RUNDIR exported
# (blank lines and lines starting with # are skipped); a failing line does not stop the queue. Each
# line's output goes to RUNDIR/queue/NN.log, and a line "NN rc=R s=S: COMMAND" to
# RUNDIR/queue/status when it ends; RUNDIR/queue/done once all have. The runner is its own process
# group (setsid nohup): a call's end does not stop it, and the next call finds it running.
#
# start needs the staged vLLM (STAGING_ENV, default /tmp/gpukit/env.sh; sourced for the queue) and
# refuses a second queue in a RUNDIR whose runner is alive. wait packs RUNDIR into BUNDLE every
# BUNDLE_EVERY seconds and once at its end (scripts/gpu/with_bundle.sh), then prints the status
# lines and the running line's last log lines. It exits at once with 3 where RUNDIR holds no queue:
# a fresh machine (the previous call's machine went back, and its queue with it) must not spend a
# call waiting on nothing. Exit: 0 the queue ended and every line passed, 1 it ended with a failed
# line, 124 SECONDS passed with the queue still running (it goes on), 2 usage, 3 nothing to run on.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
usage="usage: queue.sh start QUEUE RUNDIR | wait RUNDIR SECONDS BUNDLE.tgz | run QUEUE RUNDIR SECONDS BUNDLE.tgz"
die() { echo "queue.sh: $2" >&2; exit "$1"; }

alive() { [ -f "$1/queue/pid" ] && kill -0 "$(cat "$1/queue/pid")" 2>/dev/null; }

start() {
  local queue=$1 run=$2 env=${STAGING_ENV:-/tmp/gpukit/env.sh}
  [ -f "$queue" ] || die 2 "no queue file $queue"
  [ -f "$env" ] || die 3 "no staged vLLM here ($env is missing: a fresh machine?); stage first (scripts/gpu/stage/README.md)"
  alive "$run" && die 2 "a queue is already running in $run (pid $(cat "$run/queue/pid"))"
  mkdir -p "$run/queue" && run=$(cd "$run" && pwd)
  rm -f "$run/queue/done" && : > "$run/queue/status"
  cp "$queue" "$run/queue/queue.txt"  # the lines as started: a later call may bring another file
  STAGING_ENV=$env setsid nohup bash "$here/queue.sh" _runner "$run" > "$run/queue/runner.log" 2>&1 < /dev/null &
  echo $! > "$run/queue/pid"
  echo "queue.sh: started $(grep -cvE '^[[:space:]]*(#|$)' "$run/queue/queue.txt") line(s) in $run (pid $!)"
}

runner() {
  local run=$1 n=0 line t0 rc
  echo $$ > "$run/queue/pid"  # setsid may have forked: the pid that runs the queue
  # shellcheck disable=SC1090
  source "$STAGING_ENV"
  export RUN=$run
  cd "$root" || exit 1
  while IFS= read -r line || [ -n "$line" ]; do
    [[ "$line" =~ ^[[:space:]]*(#|$) ]] && continue
    n=$((n + 1)); t0=$(date +%s)
    printf -v nn '%02d' "$n"
    echo "$nn started $(date -u +%H:%M:%S): $line" >> "$run/queue/status.running"
    bash -c "$line" > "$run/queue/$nn.log" 2>&1 < /dev/null
    rc=$?
    echo "$nn rc=$rc s=$(( $(date +%s) - t0 )): $line" >> "$run/queue/status"
  done < "$run/queue/queue.txt"
  date -u +%FT%TZ > "$run/queue/done"
}

await() {  # inside with_bundle.sh: until done or the time is up
  local run=$1 limit=$2 t0
  t0=$(date +%s)
  while [ ! -f "$run/queue/done" ] && [ $(( $(date +%s) - t0 )) -lt "$limit" ]; do
    alive "$run" || break
    sleep 2
  done
}

report() {
  local run=$1 last
  echo "--- $run/queue/status"
  cat "$run/queue/status"
  if [ -f "$run/queue/done" ]; then
    grep -qv ' rc=0 ' "$run/queue/status" && return 1
    return 0
  fi
  if ! alive "$run"; then
    echo "queue.sh: the runner is gone before the queue's end (its log: $run/queue/runner.log)"
    return 1
  fi
  last=$(ls "$run"/queue/[0-9]*.log 2>/dev/null | sort | tail -1)
  echo "--- still running: $(tail -1 "$run/queue/status.running")"
  [ -n "$last" ] && tail -5 "$last"
  return 124
}

wait_on() {
  local run=$1 limit=$2 bundle=$3
  [[ "$limit" =~ ^[0-9]+$ ]] || die 2 "SECONDS must be a whole number, not $limit"
  [ -d "$run/queue" ] || die 3 "no queue in $run on this machine: a fresh machine (the one that ran it went back); start it again"
  bash "$here/with_bundle.sh" "$bundle" "$run" -- bash "$here/queue.sh" _await "$run" "$limit"
  report "$run"
}

verb=${1:-}
case "$verb" in
  start) [ $# -eq 3 ] || die 2 "$usage"; start "$2" "$3" ;;
  wait) [ $# -eq 4 ] || die 2 "$usage"; wait_on "$2" "$3" "$4" ;;
  run) [ $# -eq 5 ] || die 2 "$usage"; start "$2" "$3" || exit $?; wait_on "$3" "$4" "$5" ;;
  _runner) runner "$2" ;;
  _await) await "$2" "$3" ;;
  *) die 2 "$usage" ;;
esac
