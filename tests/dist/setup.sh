# setup.sh — sourced by the tests/dist/*_check.sh scripts: the repository root as working directory, $tide (from the
# build directory $1, default build), mpirun ($MPIEXEC) with the flags the tests run it with as the array mp, a $tmp
# directory removed at exit; a build without MPI, or a machine without mpirun, skips the script (exit 0). $who names
# the script in the skip lines. bad WANT CMD...: CMD must fail and print WANT (a layout that does not fit).
set -euo pipefail
cd "$(dirname "$0")/../.."
build=${1:-build}
tide="$build/tide"
mpirun=${MPIEXEC:-mpirun}
if ! command -v "$mpirun" > /dev/null; then echo "$who: no mpirun: skipped"; exit 0; fi
if [ "$("$tide" run tests/dist/dp_mpi.lua 2>&1 | tail -1)" != "mpi available" ]; then
    echo "$who: this build has no MPI: skipped"; exit 0
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mp=("$mpirun" --oversubscribe --allow-run-as-root -x OMP_NUM_THREADS=1)
bad() {
    local want=$1; shift
    local o
    if o=$("$@" 2>&1); then echo "FAIL accepted: $*"; exit 1; fi
    grep -qF "$want" <<< "$o" || { echo "FAIL expected '$want', got:"; echo "$o" | head -5; exit 1; }
}
