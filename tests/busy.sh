#!/usr/bin/env bash
# `make test-busy`: run a command (default: `make test`, the whole suite) while CPU hogs keep
# every core busy, as on CI's shared 2-core machines: one `python -c 'while True: pass'` per
# core (BUSY_HOGS=n for another count), at nice 0 like the tests themselves. The hogs are this
# script's own children, stopped by their pids on every way out: the command's end, an error,
# Ctrl-C or SIGTERM (which is passed on to the command first).
#
#   tests/busy.sh                       # make test, under load
#   tests/busy.sh .venv/bin/pytest -q tests/test_pipeline.py
set -u
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
count=${BUSY_HOGS:-$(nproc)}
hogs=()
child=
stop_hogs() {
    if ((${#hogs[@]})); then
        kill "${hogs[@]}" 2>/dev/null
        wait "${hogs[@]}" 2>/dev/null
        hogs=()
    fi
}
stop() {  # a signal: SIGTERM to the command's process group, then leave
    trap '' INT TERM HUP
    if [ -n "$child" ]; then
        kill -TERM -- "-$child" 2>/dev/null  # its process group: what the command started too
        wait "$child" 2>/dev/null
    fi
    exit "$1"
}
trap stop_hogs EXIT
trap 'stop 130' INT
trap 'stop 143' TERM
trap 'stop 129' HUP
for _ in $(seq "$count"); do
    "$python" -c 'while True: pass' &
    hogs+=($!)
done
(($#)) || set -- "${MAKE:-make}" --no-print-directory test
echo "busy.sh: $count CPU hog(s), pids ${hogs[*]}, while: $*" >&2
start=$SECONDS
# In the background, so that a signal reaches the traps at once (bash runs them only between
# commands), and in a process group of its own (job control on for the start), so that what
# it started stops with it; job control also leaves SIGINT alone, which a background job of a
# script would otherwise inherit ignored.
set -m
"$@" &
child=$!
set +m
wait "$child"
status=$?
child=
echo "busy.sh: '$*' exited $status after $((SECONDS - start)) s under $count CPU hog(s)" >&2
exit "$status"
