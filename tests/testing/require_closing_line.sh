#!/bin/bash
# Runs a script test for CTest and requires its closing line: a script that exits 0 passes only
# when the last non-empty line it printed starts with "ORACLE OK" (tests/testing/python.h,
# kOracleClosing), so an interpreter that prints nothing and exits 0, or a script cut short, fails
# instead of passing. Any other exit status is passed through as it is (77: skipped).
#
# Usage: require_closing_line.sh COMMAND [ARGS...]
set -u
out=$(mktemp "${TMPDIR:-/tmp}/shoal-script-out.XXXXXX") || exit 1
trap 'rm -f "$out"' EXIT
# tee: CTest shows the output as it comes, and a killed test still shows what it printed.
"$@" | tee "$out"
status=${PIPESTATUS[0]}
if [ "$status" -ne 0 ]; then
  exit "$status"
fi
last=$(grep -v '^[[:space:]]*$' "$out" | tail -n 1)
case "$last" in
  "ORACLE OK"*) exit 0 ;;
esac
echo "require_closing_line.sh: '$*' exited 0 without its closing line 'ORACLE OK ...' as its last" \
     "line (it did not run its checks to the end); its last line was: '${last}'" >&2
exit 1
