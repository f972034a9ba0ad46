#!/usr/bin/env bash
# Times `make test` against an older tree's, taking turns on this machine (issue 26's
# check; docs/BENCHMARKS.md section 11). Each tree is a clone with its own `.venv` that has
# run its suite once already (warm caches on both sides). Nothing else should run meanwhile.
#
#   scripts/suite_against_baseline.sh TODAY_DIR BASELINE_DIR [ROUNDS]
#
# Per round: today's suite as `make test` runs it, then the baseline's own `make test`
# steps (one process: `-m 'not dtype'`, then `-m dtype` with `auto` forced to float32 and
# to bfloat16, as 523bb83's Makefile runs them). Prints pytest's times, how busy the CPUs
# were and the least memory available; the ratio is today's time over the baseline's.
# SUITE_ARGS (default none): more pytest arguments for both trees, e.g. a file to try it on.
set -euo pipefail
today=$(cd "$1" && pwd)
base=$(cd "$2" && pwd)
rounds=${3:-1}
read -r -a extra <<<"${SUITE_ARGS:-}"

cpu() { head -1 /proc/stat | awk '{print $2+$3+$4+$7+$8, $5+$6}'; }
busy_since() { # "busy idle" from before -> share of CPU time busy since
    read -r b0 i0 <<<"$1"
    read -r b1 i1 <<<"$(cpu)"
    awk -v b=$((b1 - b0)) -v i=$((i1 - i0)) 'BEGIN { printf "%.0f%%", 100 * b / (b + i) }'
}
least_memory() { # polls MemAvailable until $1 exists; prints the least seen, in MiB
    local least=999999 now
    while [ ! -e "$1" ]; do
        now=$(awk '/MemAvailable/ {print int($2 / 1024)}' /proc/meminfo)
        ((now < least)) && least=$now
        sleep 2
    done
    echo "$least"
}
timed() { # LABEL DIR CMD...: runs CMD in DIR, prints pytest's times and the CPU share
    local label=$1 dir=$2 out stop before
    shift 2
    out=$(mktemp)
    stop=$(mktemp -u)
    least_memory "$stop" >"$out.mem" &
    before=$(cpu)
    echo "== $label  $(date -u +%H:%M:%S) UTC, load $(cut -d' ' -f1-3 /proc/loadavg)"
    local ok=1
    (cd "$dir" && "$@") >"$out" 2>&1 || { ok=0; echo "   (failed: see $out)"; }
    touch "$stop"
    wait
    grep -E '(passed|failed).* in [0-9.]+s' "$out" | sed 's/^/   /'
    echo "   CPUs busy $(busy_since "$before"), least MemAvailable $(cat "$out.mem") MiB"
    rm -f "$stop" "$out.mem"
    if ((ok)); then rm -f "$out"; fi  # a failed run's output stays, named above
}

lscpu | grep -E '^Model name:'
echo "SIMD flags: $(grep -m1 -o -w -E 'avx[0-9a-z_]*|amx[a-z_0-9]*' /proc/cpuinfo | sort -u | tr '\n' ' ')"
for round in $(seq "$rounds"); do
    timed "today (round $round)" "$today" env PYTHONPATH="$today" PYTHONDONTWRITEBYTECODE= \
        PYTHONPYCACHEPREFIX="$today/.venv/pycache" .venv/bin/python -m pytest -q -n 2 \
        --dist loadfile --durations=20 -p no:cacheprovider "${extra[@]}"
    timed "baseline (round $round)" "$base" env PYTHONPATH="$base" bash -c '
        .venv/bin/python -m pytest -q -p no:cacheprovider -m "not dtype" "$@"
        HETERO_PD_AUTO_DTYPE=float32 .venv/bin/python -m pytest -q -p no:cacheprovider -m dtype "$@"
        HETERO_PD_AUTO_DTYPE=bfloat16 .venv/bin/python -m pytest -q -p no:cacheprovider -m dtype "$@"
    ' baseline "${extra[@]}"
done
