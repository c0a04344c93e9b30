#!/usr/bin/env bash
# Run pytest on a busy machine: a CPU hog of STRESS_PER_CORE (default 4) busy
# processes per core runs beside it, at the same priority, for as long as
# pytest runs.
#
#   tests/stress_load.sh                          # the README's test command's arguments
#   tests/stress_load.sh -q tests/daemon/test_daemon.py  # any pytest arguments
#   STRESS_PER_CORE=2 tests/stress_load.sh -q -m "not slow"
#
# The hog is bounded: it is stopped when pytest ends (passed, failed or
# interrupted with Ctrl-C), and each hog process also ends on its own within a
# fraction of a second once this script is gone (even after a SIGKILL), so no
# process is left behind. The exit status is pytest's.
set -u
cd "$(dirname "$0")/.." || exit 2

per_core=${STRESS_PER_CORE:-4}
cores=$(nproc)
count=$((per_core * cores))
python=${PYTHON:-.venv/bin/python}
[ -x "$python" ] || python=python3
[ $# -gt 0 ] || set -- -q -n 2 --dist worksteal # what the README's test command runs

me=$$
hogs=()
stop_hogs() {
    if [ ${#hogs[@]} -gt 0 ]; then
        kill "${hogs[@]}" 2>/dev/null
        wait "${hogs[@]}" 2>/dev/null
        hogs=()
    fi
}
trap stop_hogs EXIT
trap 'stop_hogs; exit 130' INT
trap 'stop_hogs; exit 143' TERM

for ((k = 0; k < count; k++)); do
    # Busy in bash arithmetic; between rounds (a fraction of a second each) it
    # checks that this script still runs, so an orphaned hog ends by itself.
    (
        while kill -0 "$me" 2>/dev/null; do
            for ((i = 0; i < 20000; i++)); do :; done
        done
    ) &
    hogs+=($!)
done

echo "stress_load: $count busy processes ($per_core per core, $cores cores) beside: $python -m pytest $*" >&2
"$python" -m pytest "$@"
rc=$?
echo "stress_load: pytest exited $rc; load average $(cut -d' ' -f1-3 /proc/loadavg)" >&2
stop_hogs
exit $rc
