#!/usr/bin/env bash
# The mutation audit (issue 30): plants realistic bugs, one at a time, in a scratch clone of this
# checkout and says for each which tests caught it, or that it SURVIVED.
#
# The scratch clone is build-mutation/src (ignored by git), at HEAD plus this checkout's
# uncommitted changes to tracked files; its build folder build-mutation/src/build is kept between
# runs, and ccache (CCACHE_BASEDIR is the checkout, CMakeLists.txt) makes its first build mostly
# hits after a build of this checkout. For each mutation: apply it (a replacement that must match
# the source exactly, so a mutation that no longer applies is an error, not a catch), build only
# the targets its tests need, run each test with ctest -R '^name$' (a GoogleTest filter, when
# given, through GTEST_FILTER), revert. The unmutated tree must pass every chosen test first.
#
# Each mutation names tests that need no Python and, for the numeric ones, PyTorch-oracle tests
# (Debian's /usr/bin/python3 with torch): a mutation counts as caught only when a test without
# Python caught it, and with the oracles run, only when an oracle caught it too.
#
# Usage: scripts/mutation_check.sh [--only NAME[,NAME...]] [--no-oracles] [--list] [-j N]
#   --only NAME     run just these mutations (names from --list)
#   --no-oracles    skip the PyTorch-oracle tests (quicker; the Python-free tests still run)
#   --list          print the mutations and their tests, and exit
#   -j N            build jobs (default 2)
# Exit status: 0 every mutation caught; 1 a mutation survived, was caught by oracles only, or
# (oracles on) by no oracle; 2 the unmutated tree fails a chosen test, or a mutation did not apply
# or did not build. The scratch clone and its build (~600 MB) stay in build-mutation/ for the next
# run; remove the folder to reclaim the space.
set -uo pipefail

REPO=$(git -C "$(dirname "$0")/.." rev-parse --show-toplevel) || exit 2
WORK=${SHOAL_MUTATION_DIR:-$REPO/build-mutation}
SRC=$WORK/src
BUILD=$SRC/build
LOGS=$WORK/logs
FAKE_PYTHON=$WORK/silent-python3

# ---- the mutations ---------------------------------------------------------------------------------
# mutation NAME FILE FIND REPLACE TESTS ORACLES DESCRIPTION
#   FIND must occur exactly once in FILE (FILE "tests/*": every occurrence in every file under
#   tests/). TESTS and ORACLES: space-separated CTest names, each with an optional
#   ":GoogleTest filter".
NAMES=()
declare -A FILE FIND REPLACE TESTS ORACLES WHAT
mutation() {
  NAMES+=("$1")
  FILE[$1]=$2
  FIND[$1]=$3
  REPLACE[$1]=$4
  TESTS[$1]=$5
  ORACLES[$1]=$6
  WHAT[$1]=$7
}

DDP=test_distributed_data_parallel
DDP_ORACLE="test_ddp_vs_pytorch:Cases.*"
SAMPLER_CPP="test_distributed_sampler:-*Python*:*BrokenOracle*"
SAMPLER_ORACLE="test_distributed_sampler:*EqualsPythons*"

mutation sampler_drop_last_divisible src/data/distributed_sampler.cpp \
  'if (options_.drop_last && n % r != 0) {' \
  'if (options_.drop_last) {' \
  "$SAMPLER_CPP" "$SAMPLER_ORACLE" \
  "drop_last applies its formula when the dataset divides evenly (12 on 3 ranks gives 3 each)"

mutation state_dict_prefix_first_key_only src/checkpoint/state_dict.cpp \
  $'  for (const auto& item : state) {\n    if (item.key().compare(0, prefix.size(), prefix) != 0) return false;\n  }\n  return true;' \
  $'  return state.begin()->key().compare(0, prefix.size(), prefix) == 0;' \
  "test_checkpoint_format:-*CrossesToPython*" "test_checkpoint_format:*CrossesToPython*" \
  "the \"module.\" prefix is stripped when only the first key has it"

mutation ddp_used_map_not_allreduced src/parallel/reducer.cpp \
  $'    for (size_t i = 0; i < params_.size(); ++i) acc[i] = locally_used_[i];\n    used_work = group_->allreduce(used_map);' \
  $'    for (size_t i = 0; i < params_.size(); ++i) acc[i] = locally_used_[i];' \
  "$DDP:DdpUnused.*" "$DDP_ORACLE" \
  "find_unused_parameters: the used-parameter map is not allreduced (each rank trusts its own)"

mutation syncbn_no_between_rank_variance src/parallel/sync_batch_norm.cpp \
  'auto var = ((vars + deviation * deviation) * counts).sum(0) / count;' \
  'auto var = (vars * counts).sum(0) / count;' \
  "$DDP:SyncBatchNorm.*" "$DDP_ORACLE" \
  "SyncBatchNorm's variance without the between-rank term (the variance of the ranks' means)"

mutation ddp_bucket_order_not_reversed src/parallel/reducer.cpp \
  'for (size_t i = 0; i < order.size(); ++i) order[i] = order.size() - 1 - i;' \
  'for (size_t i = 0; i < order.size(); ++i) order[i] = i;' \
  "$DDP:DdpBuckets.*" "$DDP_ORACLE" \
  "the initial DDP buckets are filled in registration order, not in reverse"

mutation python_prints_nothing 'tests/*' \
  '/usr/bin/python3' \
  "$FAKE_PYTHON" \
  "test_checkpoint_resume test_cli_consistency test_checkpoint_format:*CrossesToPython* $SAMPLER_ORACLE test_shuffle_pytorch test_models_pytorch test_harness" "" \
  "/usr/bin/python3 replaced (for the tests) by an interpreter that prints nothing and exits 0"

mutation ddp_sums_instead_of_averaging src/parallel/comm_hooks.cpp \
  'options.op = comm::ReduceOp::kAvg;' \
  'options.op = comm::ReduceOp::kSum;' \
  "$DDP:Ddp/Equivalence.*" "test_ddp_vs_pytorch:VsPyTorch.*" \
  "DDP's default hook sums the gradients instead of averaging them"

mutation ddp_no_initial_broadcast src/parallel/distributed_data_parallel.cpp \
  '    broadcast_coalesced(*group_, state);' \
  '' \
  "$DDP:Ddp/Equivalence.*" "test_ddp_vs_pytorch:VsPyTorch.*" \
  "DDP's constructor does not broadcast rank 0's parameters and buffers"

mutation sampler_epoch_ignored src/data/distributed_sampler.cpp \
  'make_generator<at::CPUGeneratorImpl>(options_.seed + epoch_)' \
  'make_generator<at::CPUGeneratorImpl>(options_.seed)' \
  "$SAMPLER_CPP" "$SAMPLER_ORACLE" \
  "the sampler's shuffle ignores set_epoch (every epoch the same order)"

mutation sampler_pads_from_the_end src/data/distributed_sampler.cpp \
  'for (size_t i = 0; all.size() < total; ++i) all.push_back(all[i % n]);' \
  'for (size_t i = 0; all.size() < total; ++i) all.push_back(all[n - 1 - i % n]);' \
  "$SAMPLER_CPP" "$SAMPLER_ORACLE" \
  "the sampler pads with the last indices instead of the first"

mutation syncbn_biased_running_var src/parallel/sync_batch_norm.cpp \
  '.add_((results[2] * (n / std::max(n - 1, 1.0))).to(running_var.scalar_type()), momentum);' \
  '.add_(results[2].to(running_var.scalar_type()), momentum);' \
  "$DDP:SyncBatchNorm.*" "$DDP_ORACLE" \
  "SyncBatchNorm's running_var is updated with the biased variance"

mutation syncbn_input_grad_local src/parallel/sync_batch_norm.cpp \
  '    group->allreduce(global)->wait();' \
  '' \
  "$DDP:SyncBatchNorm.*" "$DDP_ORACLE" \
  "SyncBatchNorm's backward uses the local sums of dy and dy * (x - mean), not the global ones"

mutation strict_load_accepts_unexpected_keys src/checkpoint/state_dict.cpp \
  'if (strict && !result.unexpected_keys.empty()) {' \
  'if (false && strict && !result.unexpected_keys.empty()) {' \
  "test_checkpoint_format:-*CrossesToPython*" "" \
  "a strict load_state_dict accepts keys the module does not have"

mutation dp_tied_weight_fed_twice src/parallel/data_parallel.cpp \
  'if (std::find(seen.begin(), seen.end(), leaf.unsafeGetTensorImpl()) != seen.end()) continue;' \
  '' \
  "test_data_parallel:*TiedWeights*" "" \
  "DataParallel feeds a tied weight's one replica leaf once per name: its gradient doubles (#29)"

mutation recompute_rng_not_replayed src/pipeline/pipeline.cpp \
  'if (replay) checkpoint::set_rng_state(mb.rng_state);' \
  '' \
  "test_pipeline:PipelineRecompute.*" "" \
  "pipeline --recompute re-runs Dropout with fresh masks instead of the forward's (#29)"

# ---- options ---------------------------------------------------------------------------------------
ONLY=""
ORACLES_ON=1
JOBS=2
while [ $# -gt 0 ]; do
  case "$1" in
    --only) ONLY=$2; shift 2 ;;
    --only=*) ONLY=${1#--only=}; shift ;;
    --no-oracles) ORACLES_ON=0; shift ;;
    -j) JOBS=$2; shift 2 ;;
    --list)
      for name in "${NAMES[@]}"; do
        printf '%s: %s\n    %s\n    tests: %s\n    oracles: %s\n' "$name" "${WHAT[$name]}" \
          "${FILE[$name]}" "${TESTS[$name]}" "${ORACLES[$name]:-none}"
      done
      exit 0 ;;
    -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d'; exit 0 ;;
    *) echo "mutation_check: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
CHOSEN=()
if [ -n "$ONLY" ]; then
  IFS=, read -r -a wanted <<<"$ONLY"
  for name in "${wanted[@]}"; do
    if [ -z "${FILE[$name]+x}" ]; then
      echo "mutation_check: no mutation named '$name' (see --list)" >&2
      exit 2
    fi
    CHOSEN+=("$name")
  done
else
  CHOSEN=("${NAMES[@]}")
fi

# ---- the scratch clone -----------------------------------------------------------------------------
rm -rf "$LOGS"
mkdir -p "$WORK" "$LOGS"
printf '#!/bin/sh\n# An interpreter that prints nothing and exits 0 (mutation python_prints_nothing).\nexit 0\n' \
  >"$FAKE_PYTHON"
chmod +x "$FAKE_PYTHON"
if [ ! -d "$SRC/.git" ]; then
  git clone --quiet --no-checkout "$REPO" "$SRC" || exit 2
fi
HEAD_COMMIT=$(git -C "$REPO" rev-parse HEAD)
git -C "$SRC" fetch --quiet "$REPO" "$HEAD_COMMIT" || exit 2
# reset --hard touches only the files that differ, so ninja rebuilds only what changed.
git -C "$SRC" checkout --quiet --force --detach "$HEAD_COMMIT" || exit 2
git -C "$SRC" reset --quiet --hard "$HEAD_COMMIT" || exit 2
git -C "$SRC" clean -fdq -e /build || exit 2
if ! git -C "$REPO" diff --quiet HEAD; then
  # The checkout's uncommitted changes, committed in the scratch clone: the pristine tree that
  # each mutation is reverted to.
  git -C "$REPO" diff --binary HEAD | git -C "$SRC" apply --whitespace=nowarn || exit 2
  git -C "$SRC" -c user.name=mutation_check -c user.email=mutation_check@localhost \
    commit --quiet --all --message "uncommitted changes of $REPO" || exit 2
  echo "mutation_check: HEAD ${HEAD_COMMIT:0:10} plus the checkout's uncommitted changes"
else
  echo "mutation_check: HEAD ${HEAD_COMMIT:0:10}"
fi
revert() {
  git -C "$SRC" reset --quiet --hard || { echo "mutation_check: could not revert" >&2; exit 2; }
}

if [ ! -f "$BUILD/build.ninja" ]; then
  cmake -S "$SRC" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release >"$LOGS/configure.log" 2>&1 || {
    echo "mutation_check: cmake failed, see $LOGS/configure.log" >&2
    exit 2
  }
fi

# ---- helpers ---------------------------------------------------------------------------------------
# The tests of `name`: its Python-free tests, and its oracles when they are on.
specs_of() {
  local name=$1
  echo "${TESTS[$name]}"
  if [ "$ORACLES_ON" = 1 ] && [ -n "${ORACLES[$name]}" ]; then echo "${ORACLES[$name]}"; fi
}

# Builds what the test specs need: every spec whose CTest name is a build target, and the CLI
# (the CLI and script tests run it).
build_for() {
  local targets=(shoal_cli) spec test
  for spec in "$@"; do
    test=${spec%%:*}
    if ninja -C "$BUILD" -t query "$test" >/dev/null 2>&1; then targets+=("$test"); fi
  done
  # test_harness runs harness_fixture (a dependency in CMake already).
  cmake --build "$BUILD" -j "$JOBS" --target "${targets[@]}" >"$LOGS/build.log" 2>&1
}

# Runs one test spec "name[:filter]"; prints passed, FAILED, SKIPPED or EMPTY (a filter that
# selected no test).
run_spec() {
  local spec=$1 log=$2 test filter=""
  test=${spec%%:*}
  if [ "$spec" != "$test" ]; then filter=${spec#*:}; fi
  (
    cd "$BUILD" || exit 2
    if [ -n "$filter" ]; then export GTEST_FILTER=$filter; else unset GTEST_FILTER; fi
    ctest -R "^${test}\$" --verbose --no-tests=error
  ) >"$log" 2>&1
  local status=$?
  if [ $status -ne 0 ]; then
    echo FAILED
  elif grep -q "Not Run\|\*\*\*Skipped" "$log"; then
    echo SKIPPED
  elif [ -n "$filter" ] && ! grep -q "^[0-9]*: \[  PASSED  \] [1-9]" "$log"; then
    echo EMPTY
  else
    echo passed
  fi
}

# Applies mutation `name` to the scratch clone; fails when FIND does not occur as required.
apply_mutation() {
  local name=$1
  MUTATION_FILE=${FILE[$name]} MUTATION_FIND=${FIND[$name]} MUTATION_REPLACE=${REPLACE[$name]} \
    /usr/bin/python3 - "$SRC" <<'EOF'
import glob, os, sys
root = sys.argv[1]
pattern, find, replace = (os.environ[k] for k in ("MUTATION_FILE", "MUTATION_FIND", "MUTATION_REPLACE"))
if pattern.endswith("*"):
    # Every occurrence in every file under the folder.
    files = [p for p in glob.glob(os.path.join(root, pattern[:-1], "**"), recursive=True)
             if os.path.isfile(p)]
    hits = 0
    for path in files:
        try:
            text = open(path).read()
        except UnicodeDecodeError:
            continue
        if find in text:
            hits += text.count(find)
            open(path, "w").write(text.replace(find, replace))
    if hits == 0:
        sys.exit("no occurrence of %r under %s" % (find, pattern))
else:
    path = os.path.join(root, pattern)
    text = open(path).read()
    if text.count(find) != 1:
        sys.exit("%r occurs %d times in %s (expected once)" % (find, text.count(find), pattern))
    open(path, "w").write(text.replace(find, replace))
EOF
}

# ---- baseline: the unmutated tree passes every chosen test ----------------------------------------
ALL_SPECS=()
for name in "${CHOSEN[@]}"; do
  for spec in $(specs_of "$name"); do
    case " ${ALL_SPECS[*]} " in *" $spec "*) ;; *) ALL_SPECS+=("$spec") ;; esac
  done
done
echo "mutation_check: building the unmutated tree (log: $LOGS/build.log)"
if ! build_for "${ALL_SPECS[@]}"; then
  echo "mutation_check: the unmutated tree does not build, see $LOGS/build.log" >&2
  exit 2
fi
baseline_failed=0
for spec in "${ALL_SPECS[@]}"; do
  log="$LOGS/baseline.$(printf '%s' "$spec" | tr -c 'A-Za-z0-9_.-' '_').log"
  result=$(run_spec "$spec" "$log")
  echo "  baseline $spec: $result"
  if [ "$result" != passed ]; then baseline_failed=1; fi
done
if [ $baseline_failed -ne 0 ]; then
  echo "mutation_check: the unmutated tree must pass (and not skip) every chosen test first; logs in $LOGS" >&2
  exit 2
fi

# ---- the mutations -----------------------------------------------------------------------------------
survived=()
errors=()
i=0
for name in "${CHOSEN[@]}"; do
  i=$((i + 1))
  prefix="[$i/${#CHOSEN[@]}] $name"
  if ! apply_mutation "$name" 2>"$LOGS/$name.apply.log"; then
    echo "$prefix: NOT APPLIED ($(cat "$LOGS/$name.apply.log"))"
    errors+=("$name")
    revert
    continue
  fi
  read -r -a specs <<<"$(specs_of "$name" | tr '\n' ' ')"
  if ! build_for "${specs[@]}"; then
    cp "$LOGS/build.log" "$LOGS/$name.build.log"
    echo "$prefix: DOES NOT BUILD (see $LOGS/$name.build.log)"
    errors+=("$name")
    revert
    continue
  fi
  caught=()
  caught_plain=0
  caught_oracle=0
  for spec in "${specs[@]}"; do
    log="$LOGS/$name.$(printf '%s' "$spec" | tr -c 'A-Za-z0-9_.-' '_').log"
    result=$(run_spec "$spec" "$log")
    if [ "$result" = FAILED ]; then
      caught+=("$spec")
      case " ${TESTS[$name]} " in *" $spec "*) caught_plain=1 ;; *) caught_oracle=1 ;; esac
    elif [ "$result" = SKIPPED ]; then
      echo "  note: $spec was skipped under $name"
    fi
  done
  revert
  if [ ${#caught[@]} -eq 0 ]; then
    echo "$prefix: SURVIVED (${WHAT[$name]})"
    survived+=("$name")
  elif [ $caught_plain -eq 0 ]; then
    echo "$prefix: caught only by oracles: ${caught[*]} (no Python-free test caught it)"
    survived+=("$name")
  elif [ "$ORACLES_ON" = 1 ] && [ -n "${ORACLES[$name]}" ] && [ $caught_oracle -eq 0 ]; then
    echo "$prefix: caught by ${caught[*]}, but by no oracle test"
    survived+=("$name")
  else
    echo "$prefix: caught by ${caught[*]}"
  fi
done
# Leave the scratch build matching the pristine tree, so the next run starts from it.
build_for "${ALL_SPECS[@]}" || true

echo "mutation_check: ${#CHOSEN[@]} mutations, $((${#CHOSEN[@]} - ${#survived[@]} - ${#errors[@]})) caught, ${#survived[@]} survived or caught short, ${#errors[@]} errors"
if [ ${#errors[@]} -ne 0 ]; then exit 2; fi
if [ ${#survived[@]} -ne 0 ]; then exit 1; fi
exit 0
