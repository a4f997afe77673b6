#!/bin/bash
# docs/slurm/train.sbatch finds the shoal program without SLURM: $SHOAL first, then `shoal` on
# PATH, then the submit folder's build tree (`sbatch docs/slurm/train.sbatch` in a built clone),
# else one error line. srun is replaced here by a stand-in that records the program it was given:
# the script's own lookup is what is tested, not SLURM (slurm_test.sh runs the real one).
#
# Usage: sbatch_lookup_test.sh SOURCE_DIR
set -u
SRC=$1
SCRIPT="$SRC/docs/slurm/train.sbatch"
WORK=$(mktemp -d "${TMPDIR:-/tmp}/shoal-sbatch-lookup.XXXXXX") || exit 1
trap 'rm -rf "$WORK"' EXIT
failures=0
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }

# A stand-in srun: records the program (the first argument after its own options) and exits 0.
mkdir -p "$WORK/bin" "$WORK/clone/build/apps/shoal" "$WORK/other/bin"
cat > "$WORK/bin/srun" <<'STUB'
#!/bin/bash
while [ "${1#-}" != "$1" ]; do shift; done
echo "$1" > "$SRUN_RECORD"
STUB
printf '#!/bin/sh\nexit 0\n' > "$WORK/clone/build/apps/shoal/shoal"
printf '#!/bin/sh\nexit 0\n' > "$WORK/other/bin/shoal"
chmod +x "$WORK/bin/srun" "$WORK/clone/build/apps/shoal/shoal" "$WORK/other/bin/shoal"
# PATH without any shoal: the stand-in srun and the basic tools only.
BASE_PATH="$WORK/bin:/usr/bin:/bin"
if PATH=$BASE_PATH command -v shoal >/dev/null; then
  echo "skipped: a shoal is installed in /usr/bin or /bin, so the build-tree case cannot be seen"
  exit 77
fi

# Runs the batch script as sbatch would (from SLURM's spool folder: a copy, elsewhere) with the
# environment given; prints what srun was asked to run, or "(none)".
run_script() {
  local spool="$WORK/spool" record="$WORK/record"
  mkdir -p "$spool"
  cp "$SCRIPT" "$spool/slurm_script"
  rm -f "$record"
  (cd "$spool" && env SRUN_RECORD="$record" SLURM_JOB_ID=42 CKPT="$WORK/ckpt" "$@" \
     bash "$spool/slurm_script" >"$WORK/out" 2>"$WORK/err")
  echo $? > "$WORK/status"
  if [ -f "$record" ]; then cat "$record"; else echo "(none)"; fi
}

got=$(run_script PATH="$BASE_PATH" SLURM_SUBMIT_DIR="$WORK/clone")
[ "$got" = "$WORK/clone/build/apps/shoal/shoal" ] ||
  fail "submitted from a built clone: srun ran '$got', not the clone's build/apps/shoal/shoal ($(cat "$WORK/err"))"

got=$(run_script PATH="$WORK/other/bin:$BASE_PATH" SLURM_SUBMIT_DIR="$WORK/clone")
[ "$got" = "$WORK/other/bin/shoal" ] || fail "shoal on PATH: srun ran '$got'"

got=$(run_script PATH="$BASE_PATH" SLURM_SUBMIT_DIR="$WORK/clone" SHOAL=/opt/x/shoal)
[ "$got" = "/opt/x/shoal" ] || fail "SHOAL=/opt/x/shoal: srun ran '$got'"

got=$(run_script PATH="$BASE_PATH" SLURM_SUBMIT_DIR="$WORK/other")
status=$(cat "$WORK/status")
lines=$(grep -c . "$WORK/err")
if [ "$got" != "(none)" ] || [ "$status" -eq 0 ] || [ "$lines" -ne 1 ] ||
   ! grep -q "SHOAL=/path/to/shoal" "$WORK/err"; then
  fail "no shoal anywhere: srun ran '$got', exit $status, stderr: $(cat "$WORK/err")"
fi

if [ "$failures" -ne 0 ]; then
  echo "$failures checks failed"
  exit 1
fi
echo "sbatch lookup: build tree, PATH, \$SHOAL and the refusal checked"
