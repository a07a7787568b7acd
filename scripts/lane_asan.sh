#!/usr/bin/env bash
# The sanitizer lane: builds tide with AddressSanitizer + UndefinedBehaviorSanitizer into build-asan
# (TIDE_SANITIZE=ON, gcc, -O1 -g, no CUDA) and runs its ctest suite: every C test, the MPI test, the GPU parity
# test (it skips without a GPU), the whole Lua suite (`tide test`, the host linked with the ASan runtime;
# plain `luajit` started by the tests gets it preloaded) and the long-context plan. Not run here: the two
# end-to-end training runs (quickstart, long-context-smoke), which take minutes without the sanitizers and
# whose code paths (the step, checkpoints, resume) the Lua suite already runs. The run-time options
# (ASAN_OPTIONS, UBSAN_OPTIONS per test) are set by CMakeLists.txt; README "Testing" says why.
#
#   bash scripts/lane_asan.sh            (TIDE_ASAN_BUILD=DIR builds elsewhere; TIDE_ASAN_CC=CC picks the compiler of a new DIR)
set -euo pipefail
cd "$(dirname "$0")/.."
build=${TIDE_ASAN_BUILD:-build-asan}
cc=${TIDE_ASAN_CC:-gcc}
if ! command -v "$cc" >/dev/null; then
  echo "lane-asan: SKIPPED: the C compiler '$cc' is not installed"
  exit 0
fi
t0=$(date +%s)
# CC picks the compiler when the build directory is first configured (a cached one keeps its own)
CC="$cc" cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_C_FLAGS_RELWITHDEBINFO="-O1 -g" -DTIDE_SANITIZE=ON -DTIDE_CUDA=OFF >/dev/null
cmake --build "$build" -j"$(nproc)" >"$build/lane-build.log" 2>&1 || { tail -50 "$build/lane-build.log"; exit 1; }
t1=$(date +%s)
echo "lane-asan: built $build in $((t1 - t0)) s"
rc=0
ctest --test-dir "$build" --output-on-failure -E '^(quickstart|long-context-smoke)$' || rc=$?
t2=$(date +%s)
# the counts inside each ctest entry (ctest shows a passing test's output only on failure): the last
# "N passed, M failed" line of each test's output in ctest's log
log="$build/Testing/Temporary/LastTest.log"
awk '/^[0-9]+\/[0-9]+ Testing: /{name=$3}
     /^([a-z-]+: )?[0-9]+ passed, [0-9]+ failed$/{sub(/^[a-z-]+: /, ""); last[name]=$1 " " $3}
     END{for (n in last) print n, last[n]}' "$log" | sort > "$build/lane-counts.txt"
c_pass=0; c_fail=0; lua_line="no summary line"
while read -r name p f; do
  if [ "$name" = lua-tests ]; then lua_line="$p passed, $f failed"
  else c_pass=$((c_pass + p)); c_fail=$((c_fail + f)); fi
done < "$build/lane-counts.txt"
echo "lane-asan: C test checks under ASan+UBSan: $c_pass passed, $c_fail failed; Lua suite under ASan: $lua_line"
echo "lane-asan: $( [ $rc -eq 0 ] && echo passed || echo FAILED ) in $((t2 - t0)) s (build $((t1 - t0)) s, tests $((t2 - t1)) s)"
exit $rc
