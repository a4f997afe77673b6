#!/usr/bin/env bash
# Runs the test suite on a loaded machine: two CPU-bound hogs (stress-ng --cpu 2, from Debian)
# beside `ctest --output-on-failure -j 2`, N times, and reports pass/fail per run. A test that
# passes only when its threads and processes are scheduled promptly fails here. The hogs are
# stopped on exit, however the script ends. Installs stress-ng with apt-get when it is missing.
#
#   scripts/test_under_load.sh [--repeat N] [--hogs N] [BUILD_DIR] [-- CTEST_ARGS...]
#
#   --repeat N   run the suite N times (default 1)
#   --hogs N     CPU hogs beside it (default 2)
#   BUILD_DIR    a configured and built tree (default build/)
#   CTEST_ARGS   passed on to ctest, e.g. -R test_faults or -L comm (also accepted without --
#                once BUILD_DIR is given or when they start with a dash)
# Exits 0 when every run passed, 1 otherwise.
set -uo pipefail
cd "$(dirname "$0")/.."

repeat=1
hogs=2
build=build
ctest_args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --repeat) repeat=${2:?--repeat needs a count}; shift 2 ;;
    --repeat=*) repeat=${1#--repeat=}; shift ;;
    --hogs) hogs=${2:?--hogs needs a count}; shift 2 ;;
    --hogs=*) hogs=${1#--hogs=}; shift ;;
    -h|--help) sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    --) shift; ctest_args+=("$@"); break ;;
    -*) ctest_args+=("$@"); break ;;
    *) build=$1; shift; ctest_args+=("$@"); break ;;
  esac
done
case "$repeat" in ''|*[!0-9]*|0) echo "test_under_load: --repeat must be a positive number" >&2; exit 2 ;; esac
case "$hogs" in ''|*[!0-9]*) echo "test_under_load: --hogs must be a number" >&2; exit 2 ;; esac
if [ ! -f "$build/CTestTestfile.cmake" ]; then
  echo "test_under_load: $build is not a configured build tree (cmake -S . -B $build; cmake --build $build)" >&2
  exit 2
fi

if ! command -v stress-ng >/dev/null; then
  echo "test_under_load: installing stress-ng (apt-get)"
  sudo_cmd=()
  [ "$(id -u)" -ne 0 ] && sudo_cmd=(sudo)
  if ! { "${sudo_cmd[@]}" apt-get install -y stress-ng >/dev/null ||
         { "${sudo_cmd[@]}" apt-get update >/dev/null && "${sudo_cmd[@]}" apt-get install -y stress-ng >/dev/null; }; }; then
    echo "test_under_load: cannot install stress-ng" >&2
    exit 2
  fi
fi

hog_pid=""
ctest_pid=""
stop_hogs() {
  if [ -n "$ctest_pid" ]; then  # interrupted: end the run in progress and its tests too
    pkill -TERM -P "$ctest_pid" 2>/dev/null
    kill -TERM "$ctest_pid" 2>/dev/null
    wait "$ctest_pid" 2>/dev/null
    ctest_pid=""
  fi
  if [ -n "$hog_pid" ]; then
    # stress-ng's parent stops its workers on SIGTERM; they are killed outright if it does not.
    kill -TERM "$hog_pid" 2>/dev/null
    for _ in $(seq 100); do kill -0 "$hog_pid" 2>/dev/null || break; sleep 0.1; done
    pkill -KILL -P "$hog_pid" 2>/dev/null
    kill -KILL "$hog_pid" 2>/dev/null
    wait "$hog_pid" 2>/dev/null
    hog_pid=""
  fi
}
trap stop_hogs EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

if [ "$hogs" -gt 0 ]; then
  stress-ng --cpu "$hogs" --quiet &
  hog_pid=$!
  echo "test_under_load: $hogs CPU hog(s) running (stress-ng pid $hog_pid); ctest -j 2 in $build" \
       "${ctest_args[*]:+with ${ctest_args[*]}}"
fi

failed_runs=0
results=()
for run in $(seq "$repeat"); do
  started=$SECONDS
  echo "=== run $run of $repeat: $(date -u '+%H:%M:%S') load $(cut -d' ' -f1-3 /proc/loadavg)"
  log=$(mktemp)
  # In the background and waited for, so that a signal to this script is acted on at once (a
  # trap waits for a foreground command to end); ctest writes its output to the log as well.
  (cd "$build" && exec ctest --output-on-failure -j 2 --output-log "$log" "${ctest_args[@]}") &
  ctest_pid=$!
  wait "$ctest_pid"
  status=$?
  ctest_pid=""
  took=$((SECONDS - started))
  summary=$(grep -E "tests passed|No tests were found" "$log" | tail -n 1)
  failed=$(sed -n '/The following tests FAILED:/,$p' "$log" | grep -E '^[[:space:]]+[0-9]+ - ' |
           sed -E 's/^[[:space:]]+[0-9]+ - //' | paste -sd ';')
  rm -f "$log"
  if [ "$status" -eq 0 ] && [ -n "$summary" ] && ! grep -q "No tests were found" <<<"$summary"; then
    results+=("run $run: PASS in ${took} s: $summary")
  else
    failed_runs=$((failed_runs + 1))
    results+=("run $run: FAIL in ${took} s: ${summary:-ctest exited $status}${failed:+; failed: $failed}")
  fi
done

stop_hogs
echo "=== under $hogs CPU hog(s):"
printf '  %s\n' "${results[@]}"
if [ "$failed_runs" -ne 0 ]; then
  echo "test_under_load: $failed_runs of $repeat run(s) failed"
  exit 1
fi
echo "test_under_load: all $repeat run(s) passed"
