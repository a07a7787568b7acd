#!/usr/bin/env bash
# The fuzz lane: builds the libFuzzer harnesses of tests/fuzz (TIDE_FUZZ=ON: clang, libtide with coverage and
# ASan + UBSan) into build-fuzz and runs each for a bounded number of executions, starting from its seed corpus
# (tests/fuzz/corpus/<name>, copied: the repository's corpus is never written), then the Lua-level fuzzer of
# the command line's overrides and the JSON reader (tests/fuzz/fuzz_overrides.lua, plain luajit). Prints each
# harness's execution count. A crash leaves its input in build-fuzz/fuzz-artifacts/ and fails the lane;
# reproduce it with ./build-fuzz/fuzz-<name> build-fuzz/fuzz-artifacts/crash-<hash>.
#
#   bash scripts/lane_fuzz.sh                  the CI budget (about 1-2 minutes of fuzzing on 2 cores)
#   TIDE_FUZZ_SCALE=20 bash scripts/lane_fuzz.sh   20x the executions (a longer local campaign)
#   TIDE_FUZZ_CC=clang bash scripts/lane_fuzz.sh   another clang
set -euo pipefail
cd "$(dirname "$0")/.."
build=${TIDE_FUZZ_BUILD:-build-fuzz}
scale=${TIDE_FUZZ_SCALE:-1}
# executions per harness: sized so each takes 10-15 s on an idle core, 20-60 s on a busy one (exec/s measured on
# 2 cores at load 5: safetensors 10K, json 14K, text 6K, checkpoint 2.2K, shards 1.4K, bpe 0.3K; about 3x that
# when idle)
declare -A runs=([safetensors]=300000 [json]=300000 [text]=120000 [checkpoint]=50000 [shards]=30000 [bpe]=6000
  [image]=100000)   # image: 2.5-4.3K exec/s, 25-40 s on a busy core (the vision issue asks for 10^5)
lua_iters=$((100000 * scale))
t0=$(date +%s)

lua_lane() {
  if ! command -v luajit >/dev/null; then echo "lane-fuzz: SKIPPED fuzz_overrides.lua: luajit is not installed"; return 1; fi
  luajit tests/fuzz/fuzz_overrides.lua "$lua_iters" 1
}

cc=${TIDE_FUZZ_CC:-}
if [ -z "$cc" ]; then
  for c in clang-14 clang; do command -v "$c" >/dev/null && { cc=$c; break; }; done
fi
if [ -z "$cc" ]; then
  echo "lane-fuzz: SKIPPED the libFuzzer harnesses: clang is not installed (scripts/bootstrap.sh installs clang-14)"
  lua_lane
  exit $?
fi
# libFuzzer ships in the compiler-rt package (Debian: libclang-rt-14-dev); check that a fuzzer links
probe=$(mktemp -d)
trap 'rm -rf "$probe"' EXIT
printf '#include <stddef.h>\n#include <stdint.h>\nint LLVMFuzzerTestOneInput(const uint8_t *d, size_t n) { return 0; }\n' > "$probe/p.c"
if ! "$cc" -fsanitize=fuzzer,address,undefined "$probe/p.c" -o "$probe/p" 2>"$probe/err"; then
  echo "lane-fuzz: SKIPPED the libFuzzer harnesses: $cc cannot link -fsanitize=fuzzer ($(head -1 "$probe/err"));" \
       "install libclang-rt-14-dev"
  lua_lane
  exit $?
fi

# clang's own OpenMP runtime would be a second one beside OpenBLAS's libgomp: -fopenmp=libgomp links libgomp
# and leaves the engine's loops serial, which the readers under test are anyway
gomp=$(gcc -print-file-name=libgomp.so 2>/dev/null || true)
omp_args=()
[ -f "$gomp" ] && omp_args=(-DOpenMP_C_FLAGS=-fopenmp=libgomp -DOpenMP_C_LIB_NAMES=gomp -DOpenMP_gomp_LIBRARY="$gomp")
# CC picks the compiler when the build directory is first configured (a cached one keeps its own)
CC="$cc" cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_C_FLAGS_RELWITHDEBINFO="-O1 -g" -DTIDE_FUZZ=ON -DTIDE_CUDA=OFF "${omp_args[@]}" >/dev/null
cmake --build "$build" --target fuzzers -j"$(nproc)" >"$build/lane-build.log" 2>&1 || { tail -50 "$build/lane-build.log"; exit 1; }
t1=$(date +%s)
echo "lane-fuzz: built the harnesses in $build in $((t1 - t0)) s"

scratch=$(mktemp -d "$( [ -w /dev/shm ] && echo /dev/shm || echo /tmp )/tide-fuzz-lane.XXXXXX")
trap 'rm -rf "$probe" "$scratch"' EXIT
mkdir -p "$build/fuzz-artifacts" "$build/fuzz-logs"
names=()
for src in tests/fuzz/fuzz_*.c; do n=${src#tests/fuzz/fuzz_}; names+=("${n%.c}"); done
run_one() {
  local name=$1 n=$(( ${runs[$1]:-20000} * scale ))
  local work="$scratch/corpus-$name"
  mkdir -p "$work"
  # -seed=1: the same mutations every run; -max_total_time caps a harness on a very slow machine (its count
  # is then below N, and printed as it is); LeakSanitizer stays on (libFuzzer's -detect_leaks=1)
  TIDE_FUZZ_TMP="$scratch" UBSAN_OPTIONS=print_stacktrace=1 \
    "$build/fuzz-$name" -runs="$n" -seed=1 -timeout=30 -rss_limit_mb=2048 -max_total_time=$((120 * scale)) \
    -print_final_stats=1 -artifact_prefix="$build/fuzz-artifacts/$name-" "$work" "tests/fuzz/corpus/$name" \
    >"$build/fuzz-logs/$name.log" 2>&1
}
# the harnesses two at a time (one per core)
declare -A pid_of
for name in "${names[@]}"; do
  run_one "$name" & pid_of[$name]=$!
  while [ "$(jobs -rp | wc -l)" -ge "$(nproc)" ]; do sleep 0.2; done
done
fail=0
printf 'lane-fuzz: %-12s %12s %8s %8s  %s\n' harness executions seconds corpus result
for name in "${names[@]}"; do
  rc=0; wait "${pid_of[$name]}" || rc=$?
  log="$build/fuzz-logs/$name.log"
  done_line=$(grep -E '^Done [0-9]+ runs in [0-9]+ second' "$log" | tail -1 || true)
  execs=$(sed -nE 's/^Done ([0-9]+) runs in ([0-9]+) second.*/\1/p' <<<"$done_line")
  secs=$(sed -nE 's/^Done ([0-9]+) runs in ([0-9]+) second.*/\2/p' <<<"$done_line")
  corpus=$(ls "$scratch/corpus-$name" | wc -l)
  if [ $rc -eq 0 ] && [ -n "$done_line" ]; then result=ok; else result="FAILED (exit $rc)"; fail=1; fi
  printf 'lane-fuzz: %-12s %12s %8s %8s  %s\n' "$name" "${execs:-?}" "${secs:-?}" "$corpus" "$result"
  if [ "$result" != ok ]; then
    echo "---- $log (last 60 lines)"; tail -60 "$log"
    ls "$build/fuzz-artifacts" | sed "s|^|lane-fuzz: artifact $build/fuzz-artifacts/|"
  fi
done
lua_rc=0
lua_lane || lua_rc=$?
t2=$(date +%s)
[ $lua_rc -ne 0 ] && fail=1
echo "lane-fuzz: $( [ $fail -eq 0 ] && echo passed || echo FAILED ) in $((t2 - t0)) s (build $((t1 - t0)) s, fuzzing $((t2 - t1)) s)"
exit $fail
