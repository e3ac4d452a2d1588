# Step accounting for the GPU check scripts (gpu_smoke.sh, gpu_day.sh), sourced by them:
# every step runs, under its own time limit, whatever happened to the steps before it; each
# one's result goes to one summary file as it ends (a script killed half-way leaves the steps
# it finished there), and the script exits non-zero when any step failed.
#
#   . benchmarks/steps.sh
#   steps_begin runs/gpu_day/summary.md "gpu_day" [NOTE]   # a fresh summary (and its logs/ folder)
#   step NAME SECONDS COMMAND [ARG...]              # run it; PASS, or FAIL with its exit status
#   skip NAME REASON                                # a step this machine cannot run (not a failure)
#   steps_end                                       # the totals; returns 1 when a step failed
#
# A step's output goes to the terminal and to logs/<n>-<name>.log beside the summary. `timeout`
# stops a step past its limit (SIGTERM, SIGKILL 60 s later): that is a failure too (exit 124).

STEPS_SUMMARY=""
STEPS_TITLE=""
STEPS_RUN=0
STEPS_FAILED=()
STEPS_SKIPPED=0

steps_begin() {  # steps_begin SUMMARY_FILE TITLE [NOTE]
  STEPS_SUMMARY=$1 STEPS_TITLE=$2 STEPS_RUN=0 STEPS_FAILED=() STEPS_SKIPPED=0
  mkdir -p "$(dirname "$STEPS_SUMMARY")/logs"
  {
    echo "# $STEPS_TITLE, $(date -u '+%Y-%m-%d %H:%M UTC') on $(hostname)"
    echo
    [ -z "${3:-}" ] || printf '%s\n\n' "$3"
    echo "| # | step | result | seconds | log |"
    echo "|---|---|---|---|---|"
  } > "$STEPS_SUMMARY"
}

_steps_row() {  # _steps_row NAME RESULT SECONDS LOG
  printf '| %d | %s | %s | %s | %s |\n' "$((STEPS_RUN + STEPS_SKIPPED))" "$1" "$2" "$3" "$4" >> "$STEPS_SUMMARY"
}

step() {  # step NAME SECONDS COMMAND [ARG...]; returns the command's exit status
  local name=$1 limit=$2
  shift 2
  STEPS_RUN=$((STEPS_RUN + 1))
  local log
  log="logs/$(printf '%02d' "$((STEPS_RUN + STEPS_SKIPPED))")-${name//[^A-Za-z0-9._-]/_}.log"
  echo "== $name"
  local start=$SECONDS
  timeout --kill-after=60 "$limit" "$@" 2>&1 | tee "$(dirname "$STEPS_SUMMARY")/$log"
  local rc=${PIPESTATUS[0]}
  local result="PASS"
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    result="FAIL (over its ${limit} s limit)"
  elif [ "$rc" -ne 0 ]; then
    result="FAIL (exit $rc)"
  fi
  [ "$rc" -eq 0 ] || STEPS_FAILED+=("$name")
  echo "== $name: $result, $((SECONDS - start)) s"
  _steps_row "$name" "$result" "$((SECONDS - start))" "$log"
  return "$rc"
}

skip() {  # skip NAME REASON
  STEPS_SKIPPED=$((STEPS_SKIPPED + 1))
  echo "== $1: skipped ($2)"
  _steps_row "$1" "skipped: $2" "" ""
}

steps_end() {  # the totals, to the summary and the terminal; 1 when a step failed
  local passed=$((STEPS_RUN - ${#STEPS_FAILED[@]}))
  local line="$STEPS_TITLE: $passed passed, ${#STEPS_FAILED[@]} failed, $STEPS_SKIPPED skipped"
  if [ "${#STEPS_FAILED[@]}" -gt 0 ]; then
    local joined
    joined=$(printf ', %s' "${STEPS_FAILED[@]}")
    line="$line; failed: ${joined:2}"
  fi
  printf '\n%s\n' "$line" >> "$STEPS_SUMMARY"
  echo "$line (summary: $STEPS_SUMMARY)"
  [ "${#STEPS_FAILED[@]}" -eq 0 ]
}
