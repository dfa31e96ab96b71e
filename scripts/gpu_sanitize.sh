#!/usr/bin/env bash
# compute-sanitizer over a fast subset of the GPU tests (reliability issue #6, item 2; target: under
# 5 minutes on an H200 after the build). Every pytest run goes through scripts/gpu_tests.sh's
# QMOE_SANITIZER switch (so the build, PYTHONPATH and pytest options are the suite's own):
#   memcheck   a broad subset: odd shapes (N, K, rows not multiples of any tile) with every tactic,
#              the hostile-call tests, determinism of the GEMM and routing, two threads on two
#              streams, recovery after refused calls, a few cases of the older GPU test files;
#   racecheck  the tiny odd shapes (every GEMM tactic, routing with one and two CTAs, the fused op);
#   synccheck  the same tiny subset;
#   initcheck  the tiny and small odd shapes; there the tests leave unread rows and the routing
#              outputs uninitialized and give the fused op a workspace from fresh memory;
# plus the C++ GEMM check program (tests/gpu/w4a8_gemm_check.cu) under memcheck.
# Prints one summary line per tool: tests run, errors reported (those in qmoe's code, and the others).
# Exit status 0 only when every pytest run passed, nothing timed out and no report names qmoe.
#
# Usage (device machine):  bash scripts/gpu_sanitize.sh        (QMOE_SKIP_BUILD=1: reuse build/device)
# Logs: build/sanitize: sanitize_{memcheck,racecheck,synccheck,initcheck,gemm_check}.log (and the shards'
# logs, their pytest output pytest_<tool>_shard<i>.log, id lists and .done lists). With $OUT set (the
# device tool's output folder, which returns at most 8 files) they are packed into
# $OUT/sanitize_logs.tgz at the end, and each *_left.ids is copied there.
# Switches: QMOE_SANITIZE_TOOLS="memcheck racecheck synccheck initcheck gemm_check" (a subset to run);
#   QMOE_SANITIZE_FULL=1 selects every GPU test for each tool (slow: one tool per device call);
#   QMOE_SANITIZE_K_<TOOL>=<pytest -k expression> replaces a selection; QMOE_SANITIZE_LIMIT_<TOOL>=<s>
#   a time limit (defaults below sum to 360 s; a run past its limit is killed and reported TIMEOUT);
#   QMOE_SANITIZE_JOBS=N (default 1) splits each tool's pytest run into N concurrent shards;
#   QMOE_SANITIZE_IDS=<file> (with JOBS > 1) runs exactly the node ids listed there, one a line, in
#   place of a selection: e.g. the sanitize_<tool>_left.ids a timed-out call wrote (a tool's run can
#   so be finished over several device calls). Ids are dealt round-robin in the list's order and each
#   shard runs its ids in that order: put quick tests first so a slow one cannot starve them.
#   Each finished test's wall time under the tool: sanitize_<tool>_times.txt (slowest first).
#
# Shards (QMOE_SANITIZE_JOBS > 1): a sanitizer process is CPU-bound on one core while the GPU has
# room for several, so the full suite needs N processes to fit a device call. The selected node ids
# are collected once (no sanitizer; sanitize_<tool>_collect.log), dealt round-robin into
# sanitize_<tool>_shard<i>.ids (heavy and light tests mixed), and each shard runs gpu_tests.sh under
# the tool with a pytest plugin (-p, temporary) that keeps only its ids (no quoting, no long command
# line). Logs sanitize_<tool>_shard<i>.log; the tool's line sums the shards; any failed, silent or
# timed-out shard fails the tool. The limit is the tool's wall time, collection included.
#
# Options added to gpu_tests.sh's sanitizer command line, through a wrapper put first on PATH (its
# switch takes no extra options), each only when this compute-sanitizer's --help lists it:
#   --kernel-name kns=qmoe   (memcheck, racecheck, synccheck) instrument qmoe's kernels only: torch's
#       own kernels are not under test, and skipping them is what makes the runs fast. Checks are per
#       access (memcheck) or per kernel (racecheck: shared memory; synccheck: barriers), so kernels
#       left out cannot hide an error in ours.
#   not for initcheck: it must see every write (torch's kernels fill the inputs and poison the
#       outputs) to know what is initialized. Its reports in torch's kernels are counted as "other".
#   initcheck's unused-allocation reports stay off (its default; torch's caching allocator reserves
#       blocks it may never hand out).
#   --report-api-errors=no   CUDA API calls that fail on purpose (torch probing the device; the tests
#       that provoke errors skip under the sanitizer anyway) are not reports; a failing CUDA call in
#       qmoe raises a qmoe::Error, which fails its test.
# --target-processes all (in gpu_tests.sh) follows pytest's child processes.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
ROOT=$PWD
LOGDIR=$ROOT/build/sanitize
mkdir -p "$LOGDIR"
# Shards go round-robin over the visible GPUs (a sanitizer shard is CPU-bound; a machine with more
# GPUs has more cores too). CUDA_VISIBLE_DEVICES set by the caller is left alone.
NGPU=1
if [[ -z "${CUDA_VISIBLE_DEVICES:-}" ]] && command -v nvidia-smi > /dev/null; then
  NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
  (( NGPU >= 1 )) || NGPU=1
fi
pack_logs() {  # into the device tool's output folder, as one file
  [[ -n "${OUT:-}" ]] || return 0
  mkdir -p "$OUT"
  tar -C "$LOGDIR" -czf "$OUT/sanitize_logs.tgz" . 2>/dev/null
  cp "$LOGDIR"/sanitize_*_left.ids "$OUT/" 2>/dev/null
  return 0
}
T0=$(date +%s)
TOOLS=${QMOE_SANITIZE_TOOLS:-memcheck racecheck synccheck initcheck gemm_check}
JOBS=${QMOE_SANITIZE_JOBS:-1}
[[ "$JOBS" =~ ^[1-9][0-9]*$ ]] || { echo "QMOE_SANITIZE_JOBS must be a positive integer (got '$JOBS')"; exit 2; }

REAL=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -n1)
[[ -n "$REAL" && -x "$REAL" ]] || { echo "compute-sanitizer not found"; exit 2; }
HELP=$("$REAL" --help 2>&1)
has() { grep -q -- "$1" <<<"$HELP"; }
COMMON=""
has "--report-api-errors" && COMMON="--report-api-errors=no"
FILTER=""
if has "--kernel-name "; then FILTER="--kernel-name=kns=qmoe"; elif has "--kernel-regex "; then FILTER="--kernel-regex=kns=qmoe"; fi
# Unused-allocation reports are off by default (--track-unused-memory is an opt-in flag in 2025.3;
# "=no" is refused there and made the first initcheck run exit 255 before any test).
UNUSED=""
echo "compute-sanitizer: $REAL ($("$REAL" --version 2>/dev/null | tail -n1)); added options: ${COMMON:-none} ${FILTER:-(no kernel filter)} ${UNUSED}"

WRAP=$(mktemp -d)
trap 'rm -rf "$WRAP"' EXIT
cat > "$WRAP/compute-sanitizer" <<EOF
#!/usr/bin/env bash
exec "$REAL" \${QMOE_SANITIZER_EXTRA_ARGS:-} "\$@"
EOF
chmod +x "$WRAP/compute-sanitizer"
# The shard filter: a pytest plugin loaded with -p qmoe_shard_select (on PYTHONPATH for shards only).
mkdir -p "$WRAP/py"
cat > "$WRAP/py/qmoe_shard_select.py" <<'EOF'
"""Keeps only the tests whose node ids are listed in $QMOE_SHARD_IDS (one per line): one shard of
scripts/gpu_sanitize.sh. An id that is not collected is a usage error (the shard must run them all).
At the end of the session it prints how many skips pytest's count line holds from collection (a
module skipped as a whole; every shard collects every module, so the merge counts those once); a
shard log without that line (crash, timeout, usage error) gave no result."""
import os

import pytest

_collection_skips = 0


def pytest_collectreport(report):
    global _collection_skips
    _collection_skips += report.skipped


_seconds = {}


def pytest_runtest_logreport(report):
    # One line per finished test (its teardown), written at once: what a shard killed at its time
    # limit or ended by a crash did finish, so the script can list the ids left for another call.
    # Beside it (.times) the test's wall time under the tool, to plan the shards of later calls.
    _seconds[report.nodeid] = _seconds.get(report.nodeid, 0.0) + report.duration
    if report.when == "teardown" and os.environ.get("QMOE_SHARD_DONE"):
        done = os.environ["QMOE_SHARD_DONE"]
        with open(done, "a", encoding="utf-8") as f:
            f.write(report.nodeid + "\n")
        with open(done[: -len(".done")] + ".times", "a", encoding="utf-8") as f:
            f.write(f"{_seconds[report.nodeid]:8.1f} s  {report.nodeid}\n")


def pytest_terminal_summary(terminalreporter):
    terminalreporter.write_line(f"qmoe_shard_select: collection skips {_collection_skips}")


@pytest.hookimpl(trylast=True)  # after -m / -k
def pytest_collection_modifyitems(config, items):
    with open(os.environ["QMOE_SHARD_IDS"], encoding="utf-8") as f:
        wanted = {line.rstrip("\n") for line in f if line.strip()}
    keep = [it for it in items if it.nodeid in wanted]
    order = {}
    with open(os.environ["QMOE_SHARD_IDS"], encoding="utf-8") as f:
        for line in f:
            order.setdefault(line.rstrip("\n"), len(order))
    keep.sort(key=lambda it: order[it.nodeid])  # the list's order: callers put quick tests first
    drop = [it for it in items if it.nodeid not in wanted]
    missing = wanted - {it.nodeid for it in keep}
    if missing:
        raise pytest.UsageError(f"QMOE_SHARD_IDS: {len(missing)} of {len(wanted)} node ids were not "
                                f"collected, e.g. {sorted(missing)[:3]}")
    if drop:
        config.hook.pytest_deselected(items=drop)
    items[:] = keep
EOF

if [[ "${QMOE_SKIP_BUILD:-0}" != 1 ]]; then
  echo "== build (scripts/device_build.sh)"
  bash scripts/device_build.sh > /tmp/qmoe_sanitize_build.log 2>&1 || { tail -n 40 /tmp/qmoe_sanitize_build.log; exit 1; }
fi

HAVE_SETSID=$(command -v setsid || true)
# run_limited SECONDS LOG CMD...: CMD in its own process group, killed as a group past SECONDS.
run_limited() {
  local limit=$1 log=$2 waited=0
  shift 2
  if [[ -n "$HAVE_SETSID" ]]; then setsid "$@" > "$log" 2>&1 & else timeout -k 5 "$limit" "$@" > "$log" 2>&1 & fi
  local pid=$!
  if [[ -z "$HAVE_SETSID" ]]; then wait "$pid"; return; fi  # started under timeout(1) below
  while kill -0 "$pid" 2>/dev/null; do
    if (( waited >= limit )); then
      echo "TIMEOUT: killed after ${limit}s" >> "$log"
      kill -TERM -- "-$pid" 2>/dev/null; sleep 5; kill -KILL -- "-$pid" 2>/dev/null
      wait "$pid" 2>/dev/null
      return 124
    fi
    sleep 1
    waited=$((waited + 1))
  done
  wait "$pid"
}

# parse LOG: "tests ran|failed|skipped|errors reported|in qmoe|other|warnings" from pytest's last
# count line and the sanitizer's reports. A report is a top-level "========= X" line (X not a
# summary or status line) with its indented lines; it is qmoe's when any of them names qmoe (the
# kernel, or the host backtrace through the extension / libqmoe).
parse() {
  python3 - "$1" <<'EOF'
import re, sys
text = open(sys.argv[1], errors="replace").read().splitlines()
counts = {}
for line in text:
    if re.search(r"\d+ (passed|failed|skipped|deselected|error)", line) and " in " in line:
        counts = {k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed)", line)}
summary = sum(int(n) for n in re.findall(r"^========= ERROR SUMMARY: (\d+) error", "\n".join(text), re.M))
skip = ("COMPUTE-SANITIZER", "ERROR SUMMARY", "RACECHECK SUMMARY", "LEAK SUMMARY", "Target application",
        "Error: process didn't terminate", "TIMEOUT")
records, cur = [], None
for line in text:
    m = re.match(r"^========= (\S.*)$", line)
    if m:
        cur = None if m.group(1).startswith(skip) else [m.group(1)]
        if cur is not None:
            records.append(cur)
    elif cur is not None and line.startswith("=========  "):
        cur.append(line)
    elif not line.startswith("========="):
        cur = None
# The tool's own failure ("Internal Sanitizer Error: ..."), which may follow pytest's progress dots on
# the same line (so it is no record above): an error outside qmoe, counted once per line.
records += [[line] for line in text if "Internal Sanitizer Error" in line and not line.startswith("=========")]
warn = [r for r in records if r[0].lower().startswith("warning")]
errs = [r for r in records if not r[0].lower().startswith("warning")]
mine = [r for r in errs if any("qmoe" in l for l in r)]
ran = counts.get("passed", 0) + counts.get("failed", 0) + counts.get("error", 0) + counts.get("errors", 0)
failed = counts.get("failed", 0) + counts.get("error", 0) + counts.get("errors", 0)
print(ran, failed, counts.get("skipped", 0), max(summary, len(errs)), len(mine), len(errs) - len(mine), len(warn))
EOF
}

declare -A SEL LIMIT
SEL[memcheck]="(test_odd or test_hostile or test_det_gemm_and_mm_data or test_det_runs_streams_graph or \
test_concurrent_threads_match_serial or test_fault_validation or test_mm_data_worked_example or \
test_gemm_gaps_per_row_negative_scales or test_token_without_local_expert_is_zero or test_hidden_and_inter_sizes) \
and not big and not cuda1"
SEL[racecheck]="test_odd and tiny"
SEL[synccheck]="test_odd and tiny"
SEL[initcheck]="test_odd and (tiny or small)"
LIMIT=([memcheck]=110 [racecheck]=50 [synccheck]=40 [initcheck]=120 [gemm_check]=40)
# QMOE_SANITIZE_FULL=1: the whole GPU suite under each tool (issue #6's "every GPU test"), one tool
# per device call (QMOE_SANITIZE_TOOLS=<tool>), each limited to 570 s unless QMOE_SANITIZE_LIMIT_<TOOL>.
if [[ "${QMOE_SANITIZE_FULL:-0}" == 1 ]]; then
  for t in memcheck racecheck synccheck initcheck; do SEL[$t]="not __no_such_test__"; LIMIT[$t]=570; done
fi

# run_shards TOOL LIMIT: the tool's selection in QMOE_SANITIZE_JOBS concurrent shards (see the header).
# Sets rc (124 when a step timed out), ran, failed, errors, mine, other, warnings and log.
run_shards() {
  local tool=$1 limit=$2 up=${1^^} t0 sel_var sel extra ids collected nshards i left clog
  local -a pids=() rcs=()
  t0=$(date +%s)
  sel_var=QMOE_SANITIZE_K_$up
  sel=${!sel_var:-${SEL[$tool]}}
  extra="$COMMON $([[ $tool == initcheck ]] && echo "$UNUSED" || echo "$FILTER")"
  errors=0 mine=0 other=0 warnings=0
  clog="$LOGDIR/sanitize_${tool}_collect.log"
  rm -f "$LOGDIR/sanitize_${tool}_shard"*.ids "$LOGDIR/sanitize_${tool}_shard"*.log "$LOGDIR/sanitize_${tool}_shard"*.done \
    "$LOGDIR/sanitize_${tool}_shard"*.times "$LOGDIR/pytest_${tool}_shard"*.log
  ids="$WRAP/ids_$tool"
  if [[ -n "${QMOE_SANITIZE_IDS:-}" ]]; then
    # A list of node ids (e.g. a previous call's sanitize_<tool>_left.ids) in place of a selection.
    echo "collection skipped: ids from QMOE_SANITIZE_IDS=$QMOE_SANITIZE_IDS" > "$clog"
    grep -E '^tests/python/[^:]*::' "$QMOE_SANITIZE_IDS" | awk '!seen[$0]++' > "$ids"
    sel="not __no_such_test__" rc=0
  else
    QMOE_SANITIZER="" QMOE_SKIP_BUILD=1 QMOE_SKIP_CPP=1 QMOE_PYTEST_LOG="$WRAP/pytest_${tool}_collect.log" \
      run_limited "$limit" "$clog" bash scripts/gpu_tests.sh -k "$sel" --collect-only
    rc=$?
    # pytest -q --collect-only prints one node id a line; a warnings summary may repeat some.
    grep -E '^tests/python/[^:]*::' "$clog" | awk '!seen[$0]++' > "$ids"
  fi
  collected=$(wc -l < "$ids")
  if (( rc != 0 || collected == 0 )); then
    ran="collection failed (exit $rc, $collected ids)"; failed=1; log=$clog
    return 0
  fi
  nshards=$(( JOBS < collected ? JOBS : collected ))
  awk -v n="$nshards" -v pre="$LOGDIR/sanitize_${tool}_shard" '{ print > (pre ((NR - 1) % n + 1) ".ids") }' "$ids"
  left=$(( limit - ($(date +%s) - t0) ))
  (( left < 1 )) && left=1
  echo "$tool: $collected tests collected in $(( $(date +%s) - t0 ))s; $nshards shards of about $(( (collected + nshards - 1) / nshards )) tests, ${left}s each"
  for (( i = 1; i <= nshards; i++ )); do
    (( NGPU > 1 )) && export CUDA_VISIBLE_DEVICES=$(( (i - 1) % NGPU ))
    QMOE_SANITIZER=$tool QMOE_SKIP_BUILD=1 QMOE_SKIP_CPP=1 PATH="$WRAP:$PATH" QMOE_SANITIZER_EXTRA_ARGS="$extra" \
      QMOE_PYTEST_LOG="$LOGDIR/pytest_${tool}_shard$i.log" QMOE_SHARD_IDS="$LOGDIR/sanitize_${tool}_shard$i.ids" \
      QMOE_SHARD_DONE="$LOGDIR/sanitize_${tool}_shard$i.done" \
      PYTHONPATH="$WRAP/py${PYTHONPATH:+:$PYTHONPATH}" \
      run_limited "$left" "$LOGDIR/sanitize_${tool}_shard$i.log" bash scripts/gpu_tests.sh -p qmoe_shard_select -k "$sel" &
    pids[i]=$!
  done
  (( NGPU > 1 )) && unset CUDA_VISIBLE_DEVICES
  for (( i = 1; i <= nshards; i++ )); do wait "${pids[i]}"; rcs[i]=$?; done
  local sn sf ss se sm so sw sk kmax=0 n=0 skipped=0 timeouts="" noresult="" slog
  failed=0 rc=0
  for (( i = 1; i <= nshards; i++ )); do
    sn=0 sf=0 ss=0 se=0 sm=0 so=0 sw=0
    slog="$LOGDIR/sanitize_${tool}_shard$i.log"
    read -r sn sf ss se sm so sw < <(parse "$slog")
    sk=$(sed -n 's/^qmoe_shard_select: collection skips \([0-9]*\)$/\1/p' "$slog" | tail -n1)
    [[ -z "$sk" ]] && { sk=0; noresult+=" $i"; }  # crashed, timed out or refused its ids (fails the tool below)
    echo "  shard $i/$nshards: $sn tests ($sf failed, $ss skipped, $sk of them at collection) of $(wc -l < "${slog%.log}.ids") ids; errors reported $se (qmoe $sm, other $so; warnings $sw); exit ${rcs[i]}"
    n=$((n + sn)) skipped=$((skipped + ss - sk)) failed=$((failed + sf))
    (( sk > kmax )) && kmax=$sk
    errors=$((errors + se)) mine=$((mine + sm)) other=$((other + so)) warnings=$((warnings + sw))
    (( rcs[i] == 124 )) && { rc=124; timeouts+=" $i"; }
  done
  skipped=$((skipped + kmax))  # modules skipped at collection: once, as in one run
  # Ids no shard finished (timed out or never reached): input for QMOE_SANITIZE_IDS in another call.
  local finished
  cat "$LOGDIR/sanitize_${tool}_shard"*.done 2>/dev/null | sort -u > "$WRAP/done_$tool"
  cat "$LOGDIR/sanitize_${tool}_shard"*.times 2>/dev/null | sort -rn > "$LOGDIR/sanitize_${tool}_times.txt"
  finished=$(wc -l < "$WRAP/done_$tool")
  grep -Fxv -f "$WRAP/done_$tool" "$ids" > "$LOGDIR/sanitize_${tool}_left.ids"
  ran="$n tests ($failed failed, $skipped skipped; $nshards shards; $finished of $collected ids finished)"
  [[ -n "$noresult" ]] && ran+=", no result from shard${noresult}"
  [[ -n "$timeouts" ]] && ran+=", timed out: shard${timeouts}"
  (( finished < collected )) && ran+=", $((collected - finished)) left in sanitize_${tool}_left.ids"
  (( n == 0 && failed == 0 )) && failed=1
  [[ -n "$noresult" ]] && failed_shards=1 || failed_shards=0
  log="$LOGDIR/sanitize_${tool}_shard*.log"
  return 0
}

status=0
declare -a LINES
for tool in $TOOLS; do
  up=${tool^^}
  limit_var=QMOE_SANITIZE_LIMIT_$up
  limit=${!limit_var:-${LIMIT[$tool]:-120}}
  log="$LOGDIR/sanitize_$tool.log"
  t=$(date +%s) failed_shards=0
  if [[ "$tool" == gemm_check ]]; then
    # The C++ GEMM check (every tactic, ragged experts, both scale layouts, E = 1024) under memcheck.
    if bash tests/gpu/build_w4a8_check.sh build/w4a8_check > "$log" 2>&1; then
      run_limited "$limit" "$log.run" "$REAL" --tool memcheck --error-exitcode 86 $COMMON $FILTER build/w4a8_check
      rc=$?
      cat "$log.run" >> "$log"; rm -f "$log.run"
      [[ $rc -eq 0 ]] && ran="1 check program (PASS)" || ran="1 check program (exit $rc)"
    else
      rc=2; ran="check program did not build"
    fi
    errors=0 mine=0 other=0 warnings=0
    read -r _ _ _ errors mine other warnings < <(parse "$log")
    failed=$([[ $rc -eq 0 || $rc -eq 86 ]] && echo 0 || echo 1)
    grep -q "correctness: PASS" "$log" || failed=1
  elif (( JOBS == 1 )); then
    sel_var=QMOE_SANITIZE_K_$up
    sel=${!sel_var:-${SEL[$tool]}}
    QMOE_SANITIZER=$tool QMOE_SKIP_BUILD=1 QMOE_SKIP_CPP=1 PATH="$WRAP:$PATH" \
      QMOE_SANITIZER_EXTRA_ARGS="$COMMON $([[ $tool == initcheck ]] && echo "$UNUSED" || echo "$FILTER")" \
      run_limited "$limit" "$log" bash scripts/gpu_tests.sh -k "$sel"
    rc=$?
    n=0 failed=1 skipped=0 errors=0 mine=0 other=0 warnings=0
    read -r n failed skipped errors mine other warnings < <(parse "$log")
    ran="$n tests ($failed failed, $skipped skipped)"
    (( n == 0 )) && failed=1  # pytest crashed or selected nothing
  else
    run_shards "$tool" "$limit"  # sets rc, ran, failed, errors, mine, other, warnings, log
  fi
  secs=$(( $(date +%s) - t ))
  verdict=ok
  (( failed > 0 || ${failed_shards:-0} > 0 )) && verdict=FAILED
  (( mine > 0 )) && verdict="FAILED (reports in qmoe)"
  [[ $rc -eq 124 ]] && verdict="TIMEOUT (raise QMOE_SANITIZE_LIMIT_$up or narrow QMOE_SANITIZE_K_$up)"
  [[ "$verdict" != ok ]] && status=1
  [[ "$verdict" == ok && "$other" -gt 0 ]] && verdict="ok (WARN: $other reports outside qmoe, see log)"
  LINES+=("$(printf '%-10s %-38s errors reported %3s (qmoe %s, other %s; warnings %s)  %4ss  %s  %s' \
    "$tool" "$ran" "$errors" "$mine" "$other" "$warnings" "$secs" "$verdict" "$log")")
  echo "${LINES[-1]}"
done

echo
echo "== compute-sanitizer summary ($(( $(date +%s) - T0 ))s in all)"
printf '  %s\n' "${LINES[@]}"
pack_logs
exit $status
