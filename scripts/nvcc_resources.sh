#!/bin/sh
# nvcc_resources.sh NVCC ARGS...: the CUDA compiler launcher of libtide_cuda (CMakeLists.txt). Runs the compile with
# --resource-usage and keeps ptxas's report of every kernel (registers, static shared memory, stack, per target
# architecture) beside the object as <object>.resources, for the launch-limit check (tests/gpu/launch_limits.py)
# and the emulator's register table (tests/gpu/emu); every other line of the compiler's output passes through.
obj=
prev=
for a in "$@"; do
    [ "$prev" = "-o" ] && obj=$a
    prev=$a
done
log=$(mktemp "${TMPDIR:-/tmp}/tide-nvcc.XXXXXX") || exit 1
"$@" --resource-usage >"$log" 2>&1
rc=$?
grep -v -e '^ptxas info' -e 'bytes stack frame' "$log" >&2
if [ -n "$obj" ] && [ $rc -eq 0 ]; then
    grep -e '^ptxas info' -e 'bytes stack frame' "$log" >"$obj.resources"
fi
rm -f "$log"
exit $rc
