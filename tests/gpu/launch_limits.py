# launch_limits.py — the CUDA launch limits, checked without a GPU (ctest gpu-launch-limits). Every launch shape
# the host code chooses over the shipped configs (tests/gpu/launch_shapes.c, from kernels/cuda/launch.h) is held
# against the compiled kernels' resources (ptxas's report for each target architecture, kept beside each object by
# scripts/nvcc_resources.sh) and the device limits:
#   registers: warps x (registers x 32 rounded up to the 256-register allocation unit) <= 65,536 per block
#     (at least registers x threads; the table shows both)
#   threads <= 1,024 (x, y <= 1,024, z <= 64) and <= the kernel's __launch_bounds__
#   shared memory: static + dynamic <= 48 KiB, or the opt-in limit (sm_80 163 KiB, sm_90 227 KiB) for a kernel
#     that raises its limit with cudaFuncSetAttribute (directly, or through a helper named *_smem_attr whose first
#     argument is the kernel)
#   grid: x <= 2^31 - 1, y, z <= 65,535
#   64-bit indexing: a kernel addressing more than 2^31 - 1 elements may not form a block offset in 32 bits
#     (blockIdx * blockDim without a 64-bit cast) nor keep one in an int (a static read of its source)
# Every compiled kernel must appear in the launch table and every table entry must match a compiled kernel.
# Prints the worst cases per kernel; a violation fails with one line naming the kernel, the shape and the numbers.
import argparse, fnmatch, glob, os, re, subprocess, sys

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, here)
import ptxas_report

REG_FILE, REG_UNIT, MAX_THREADS = 65536, 256, 1024
SMEM_DEFAULT = 48 * 1024
SMEM_OPTIN = {"sm_80": 166912, "sm_90": 232448}     # cudaDevAttrMaxSharedMemoryPerBlockOptin: 163 KiB, 227 KiB
INT32_MAX = 2**31 - 1


def defines(src_dir):
    """integer #defines of the CUDA sources, (A / B) forms of known names included"""
    out = {}
    for p in sorted(glob.glob(os.path.join(src_dir, "*.cu")) + glob.glob(os.path.join(src_dir, "*.cuh")) +
                    glob.glob(os.path.join(src_dir, "*.h"))):
        for m in re.finditer(r"^#define\s+(\w+)\s+([^/\n]+)", open(p).read(), re.M):
            expr = m.group(2).strip()
            try:
                out[m.group(1)] = int(eval(re.sub(r"\b([A-Z_]\w*)\b", lambda n: str(out[n.group(1)]), expr), {}))
            except Exception:
                pass
    return out


def kernel_sources(src_dir):
    """{kernel base name: (file, signature + body text, launch-bounds expression or None)}"""
    out = {}
    for p in sorted(glob.glob(os.path.join(src_dir, "*.cu")) + glob.glob(os.path.join(src_dir, "*.cuh"))):
        s = open(p).read()
        for m in re.finditer(r"__global__\s+void\s+(?:__launch_bounds__\(([^)]*)\)\s*)?(\w+)\s*\(", s):
            i = s.find("{", m.end())
            depth, j = 0, i
            while j < len(s):
                if s[j] == "{":
                    depth += 1
                elif s[j] == "}":
                    depth -= 1
                    if depth == 0:
                        break
                j += 1
            out[m.group(2)] = (os.path.basename(p), s[m.start():j + 1], m.group(1))
    return out


WIDE = r"\(\s*(?:int64_t|size_t|uint64_t|long long|long|unsigned long long)\s*\)\s*"


def index32_hazards(body):
    """32-bit block offsets in a kernel's source"""
    found = []
    for m in re.finditer(r"(" + WIDE + r")?\b(blockIdx|gridDim|blockDim)\.[xyz]\s*\*\s*(blockIdx|gridDim|blockDim)\.[xyz]",
                         body):
        if not m.group(1):
            found.append(m.group(0))
    for m in re.finditer(r"\b(?:int|unsigned|int32_t|uint32_t)\s+(\w+)\s*=\s*([^;,]*)", body):
        init = m.group(2)
        if "*" in init and re.search(r"\b(blockIdx|gridDim)\b", init):
            found.append("int %s = %s" % (m.group(1), init.strip()))
    return found


def base_name(kernel):
    return kernel.split("<", 1)[0]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", required=True, help="the launch_shapes program")
    ap.add_argument("--reports", required=True, help="the folder of the <name>.cu.o.resources reports")
    ap.add_argument("--src", default=os.path.join(here, "..", "..", "kernels", "cuda"))
    ap.add_argument("--cmake", default=os.path.join(here, "..", "..", "CMakeLists.txt"))
    ap.add_argument("--show", type=int, default=40, help="rows of the worst-case table")
    a = ap.parse_args()

    archs = ["sm_" + x for x in re.search(r'CUDA_ARCHITECTURES\s+"([^"]+)"', open(a.cmake).read()).group(1).split(";")]
    texts = []
    for cu in sorted(glob.glob(os.path.join(a.src, "*.cu"))):
        rp = os.path.join(a.reports, os.path.basename(cu) + ".o.resources")
        if not os.path.exists(rp):
            print("launch_limits: no ptxas report %s for %s (libtide_cuda built without scripts/nvcc_resources.sh?)" %
                  (rp, os.path.basename(cu)))
            return 1
        texts.append(open(rp).read())
    res = ptxas_report.parse(texts)
    kernels = sorted({k for (_, k) in res})
    for arch in archs:
        if not any(ar == arch for (ar, _) in res):
            print("launch_limits: the ptxas reports have no %s code (CMakeLists builds %s)" % (arch, ", ".join(archs)))
            return 1
    defs = defines(a.src)
    srcs = kernel_sources(a.src)
    optin_src = {}
    for cu in glob.glob(os.path.join(a.src, "*.cu")):
        for m in re.finditer(r"(?:cudaFuncSetAttribute|\w+_smem_attr)\(\s*(\w+)", open(cu).read()):
            optin_src[m.group(1)] = True

    out = subprocess.run([a.shapes], capture_output=True, text=True, check=True).stdout.splitlines()
    rows, fails, covered, launches = [], [], set(), 0
    for line in out:
        pat, shape, grid, block, smem, optin, elems = line.split("\t")
        grid = [int(x) for x in grid.split()]
        block = [int(x) for x in block.split()]
        smem, optin, elems = int(smem), int(optin), int(elems)
        matched = [k for k in kernels if fnmatch.fnmatchcase(k, pat)]
        if not matched:
            fails.append("%s (%s): the launch table names it but no compiled kernel matches" % (pat, shape))
            continue
        for k in matched:
            covered.add(k)
            src = srcs.get(base_name(k))
            if src is None:
                fails.append("%s: compiled but its __global__ definition was not found in %s" % (k, a.src))
                continue
            bounds = src[2]
            bound = None
            if bounds:
                bexpr = bounds.split(",")[0].strip()
                bound = defs.get(bexpr) if not bexpr.isdigit() else int(bexpr)
                if bound is None:
                    fails.append("%s: __launch_bounds__(%s) is not a known constant" % (k, bexpr))
                    continue
            b = block
            if b == [0, 0, 0]:
                if bound is None:
                    fails.append("%s (%s): launched with its __launch_bounds__ block, but it has none" % (k, shape))
                    continue
                b = [bound, 1, 1]
            threads = b[0] * b[1] * b[2]
            for arch in archs:
                r = res.get((arch, k))
                if r is None:
                    fails.append("%s: no %s code in the ptxas report" % (k, arch))
                    continue
                launches += 1
                warps = (threads + 31) // 32
                alloc = warps * ((r["regs"] * 32 + REG_UNIT - 1) // REG_UNIT * REG_UNIT)
                opts_in = base_name(k) in optin_src
                limit = SMEM_OPTIN[arch] if opts_in else SMEM_DEFAULT
                dyn = 0 if smem < 0 else smem
                total = r["smem"] + dyn
                where = "%s, %s, %s" % (k, arch, shape)
                if threads > MAX_THREADS or b[0] > 1024 or b[1] > 1024 or b[2] > 64:
                    fails.append("%s: block %s = %d threads exceeds the device's 1,024 (x, y <= 1,024, z <= 64)" %
                                 (where, "x".join(map(str, b)), threads))
                if bound is not None and threads > bound:
                    fails.append("%s: %d threads > its __launch_bounds__(%d)" % (where, threads, bound))
                if alloc > REG_FILE or r["regs"] * threads > REG_FILE:
                    fails.append("%s: %d registers x %d threads = %d (allocated %d) > 65,536 registers per block" %
                                 (where, r["regs"], threads, r["regs"] * threads, alloc))
                if optin and not opts_in:
                    fails.append("%s: the launch table says it opts in to more shared memory but its .cu never calls "
                                 "cudaFuncSetAttribute on it" % where)
                if total > limit:
                    fails.append("%s: shared memory %d static + %d dynamic = %d bytes > %d (%s)" %
                                 (where, r["smem"], dyn, total, limit, "opt-in limit" if opts_in else "48 KiB, no opt-in"))
                if grid[0] < 1 or grid[0] > INT32_MAX or not (1 <= grid[1] <= 65535) or not (1 <= grid[2] <= 65535):
                    fails.append("%s: grid %d x %d x %d outside x <= 2^31 - 1, y, z <= 65,535" % (where, *grid))
                span = max(elems, grid[0] * grid[1] * grid[2] * threads)
                hz = index32_hazards(src[1]) if span > INT32_MAX else []
                if hz:
                    fails.append("%s: addresses %d elements (> 2^31 - 1) but forms 32-bit offsets: %s" %
                                 (where, span, "; ".join(hz)))
                rows.append((alloc / REG_FILE, k, arch, shape, r["regs"], threads, r["regs"] * threads, alloc,
                             r["smem"], "runtime" if smem < 0 else str(dyn), "x".join(map(str, grid)), span))
    for k in kernels:
        if k not in covered:
            fails.append("%s: compiled but tests/gpu/launch_shapes.c has no launch shape for it" % k)

    # the worst case of each kernel instance (highest register use, then largest grid)
    worst = {}
    for row in rows:
        key = row[1]
        if key not in worst or row[0] > worst[key][0]:
            worst[key] = row
    table = sorted(worst.values(), key=lambda x: -x[0])
    print("%-46s %-5s %-30s %5s %7s %11s %9s %6s %8s %-16s" %
          ("kernel", "arch", "shape", "regs", "threads", "regs*thr", "allocated", "smem", "dyn smem", "grid"))
    for row in table[:a.show]:
        print("%-46s %-5s %-30s %5d %7d %11d %9d %6d %8s %-16s" % (row[1][:46], row[2], row[3][:30], row[4], row[5],
                                                                 row[6], row[7], row[8], row[9], row[10]))
    print("launch_limits: %d kernels, %d launches (shape x kernel x arch) over %s" %
          (len(kernels), launches, ", ".join(archs)))
    # the first 3 violations of each kernel instance, then their count
    seen = {}
    for f in fails:
        k = re.split(r", sm_\d+|: | \(", f)[0]
        seen[k] = seen.get(k, 0) + 1
        if seen[k] <= 3:
            print("launch_limits: FAIL " + f)
    for k, n in sorted(seen.items()):
        if n > 3:
            print("launch_limits: FAIL %s: %d more violations at other shapes" % (k, n - 3))
    if fails:
        print("launch_limits: %d violations" % len(fails))
        return 1
    print("launch_limits: every launch within the limits")
    return 0


if __name__ == "__main__":
    sys.exit(main())
