#!/usr/bin/env bash
# progress.sh LABEL CMD...: run CMD, printing "  ... LABEL, N s" every PROGRESS_EVERY_S seconds (default 5) while it
# runs, and exit with its status. pip unpacks its wheels without a word, for tens of seconds on a busy machine: make
# install says it is still at work instead of leaving a silent gap.
set -uo pipefail
label=$1
shift
"$@" &
pid=$!
now_us() {  # bash 5's clock; whole seconds on an older bash (macOS's 3.2)
  if [[ -n "${EPOCHREALTIME:-}" ]]; then echo "${EPOCHREALTIME/./}"; else echo $((SECONDS * 1000000)); fi
}
every_us=$(( ${PROGRESS_EVERY_S:-5} * 1000000 ))
started=$(now_us)
next=$((started + every_us))
while kill -0 "$pid" 2>/dev/null; do
  sleep 0.2
  now=$(now_us)
  if ((now >= next)) && kill -0 "$pid" 2>/dev/null; then
    echo "  ... $label, $(((now - started) / 1000000)) s"
    next=$((next + every_us))
  fi
done
wait "$pid"
