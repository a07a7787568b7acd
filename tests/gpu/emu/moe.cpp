// moe.cpp — runs the real kernels/cuda/moe.cu under the host emulator (emu.h) against the cpu kernels (spec/moe.md
// §6, §2, §8): SiTU-GLU and its backward, top-k (exact); the device counting sort (moe_sort) against a reference
// stable sort, exactly (random and skewed routings, empty experts, every assignment on one expert, several tiles,
// capacities, i32 ids); moe_experts forward/backward: the routing (perm, pos, offsets) must equal the cpu's exactly,
// the outputs and gradients within 1e-5 of max|cpu| in f32 (the products differ only in summation order), 1/64 in
// bf16 (both sides get the bf16-rounded inputs; the gpu also rounds pre, h and y, step 2^-8). cuBLAS cannot run here:
// cublasGemmGroupedBatchedEx is a host loop with cuBLAS's column-major semantics and its documented argument rules
// (pointer arrays in device memory, bf16 pointers 16-byte aligned), tide_cuda_gemm (the per-product fallback of a
// misaligned bf16 stage) a row-major one. Both count their calls: every GEMM stage must be ONE grouped call, unless
// the loaded cuBLAS is older than 12.5 (cublasGetVersion's stand-in says so for one case): then a GEMM per product.
// The forward with no host offsets asked (no backward follows) on a small dropless batch: no sync, no cuBLAS call,
// the route exact, out / pre / y within the same tolerances; with a capacity or past TIDE_MOE_DEVICE_ROWS rows the
// grouped path. Usage: tests/gpu/emu/run_one.sh moe (EMU_SEED=n reorders threads).
#include "emu.h"
#include "common.cuh"
#include <cstdarg>
#include <numeric>
#include <string>

#include "emu_host.h"

static int n_grouped = 0, n_gemm = 0;   // calls of the two GEMM stand-ins
static int cublas_version = CUBLAS_VERSION;   // what cublasGetVersion's stand-in reports

static double ld_any(int dtype, const void *p, int64_t i)
{
    if (dtype == TIDE_F64) return ((const double *)p)[i];
    if (dtype == TIDE_F32) return ((const float *)p)[i];
    return __bfloat162float(((const __nv_bfloat16 *)p)[i]);
}
static void st_any(int dtype, void *p, int64_t i, double v)
{
    if (dtype == TIDE_F64) ((double *)p)[i] = v;
    else if (dtype == TIDE_F32) ((float *)p)[i] = (float)v;
    else ((__nv_bfloat16 *)p)[i] = __float2bfloat16((float)v);
}

// the stand-in for gemm.cu (row-major): C = op(A) op(B) (alpha 1, beta 0 only: what moe.cu asks), fp64 accumulate
int tide_cuda_gemm(int dtype, int ta, int tb, int64_t M, int64_t N, int64_t K, double alpha, const void *A, int64_t lda,
                   const void *B, int64_t ldb, double beta, void *C, int64_t ldc)
{
    n_gemm++;
    if (alpha != 1.0 || beta != 0.0) return tide_set_error("emu gemm: only alpha 1, beta 0");
    for (int64_t i = 0; i < M; i++)
        for (int64_t j = 0; j < N; j++) {
            double acc = 0;
            for (int64_t k = 0; k < K; k++)
                acc += ld_any(dtype, A, ta ? k * lda + i : i * lda + k) * ld_any(dtype, B, tb ? j * ldb + k : k * ldb + j);
            st_any(dtype, C, i * ldc + j, acc);
        }
    return 0;
}

int tide_cuda_get_cublas(cublasHandle_t *out)
{
    *out = nullptr;
    return 0;
}
cublasStatus_t cublasGetVersion(cublasHandle_t, int *v)
{
    *v = cublas_version;
    return CUBLAS_STATUS_SUCCESS;
}
const char *cublasGetStatusString(cublasStatus_t s)
{
    static char b[64];
    snprintf(b, sizeof b, "emu cublas status %d", (int)s);
    return b;
}

// cuBLAS's grouped GEMM as its documentation states it: column-major; group i has m, n, k, lda, ldb, ldc, alpha and
// beta (host arrays) for group_size[i] problems whose matrices come from the pointer arrays (device memory) in turn;
// types R_32F or R_16BF with COMPUTE_32F (float scalars), R_64F with COMPUTE_64F (double scalars). The argument
// checks are the documented ones; a failure says why, since a status alone says little.
cublasStatus_t cublasGemmGroupedBatchedEx(cublasHandle_t, const cublasOperation_t transa_array[],
                                          const cublasOperation_t transb_array[], const int m_array[], const int n_array[],
                                          const int k_array[], const void *alpha_array, const void *const Aarray[],
                                          cudaDataType_t Atype, const int lda_array[], const void *const Barray[],
                                          cudaDataType_t Btype, const int ldb_array[], const void *beta_array,
                                          void *const Carray[], cudaDataType_t Ctype, const int ldc_array[], int group_count,
                                          const int group_size[], cublasComputeType_t computeType)
{
    n_grouped++;
    auto fail = [](cublasStatus_t st, const char *why) {
        printf("  emu cublasGemmGroupedBatchedEx: %s\n", why);
        return st;
    };
    if (!transa_array || !transb_array || !m_array || !n_array || !k_array || !alpha_array || !lda_array || !ldb_array ||
        !beta_array || !ldc_array || !group_size || group_count < 0)
        return fail(CUBLAS_STATUS_INVALID_VALUE, "a NULL host array or a negative group count");
    int dtype;
    if (Atype != Btype || Atype != Ctype) return fail(CUBLAS_STATUS_NOT_SUPPORTED, "A, B and C types differ");
    if (Atype == CUDA_R_32F && computeType == CUBLAS_COMPUTE_32F) dtype = TIDE_F32;
    else if (Atype == CUDA_R_16BF && computeType == CUBLAS_COMPUTE_32F) dtype = TIDE_BF16;
    else if (Atype == CUDA_R_64F && computeType == CUBLAS_COMPUTE_64F) dtype = TIDE_F64;
    else return fail(CUBLAS_STATUS_NOT_SUPPORTED, "type and compute type");
    int64_t problems = 0;
    for (int i = 0; i < group_count; i++) {
        cublasOperation_t ta = transa_array[i], tb = transb_array[i];
        int m = m_array[i], n = n_array[i], k = k_array[i];
        bool ops = (ta == CUBLAS_OP_N || ta == CUBLAS_OP_T || ta == CUBLAS_OP_C) &&
                   (tb == CUBLAS_OP_N || tb == CUBLAS_OP_T || tb == CUBLAS_OP_C);
        if (!ops || m < 0 || n < 0 || k < 0 || group_size[i] < 0 ||
            lda_array[i] < std::max(1, ta == CUBLAS_OP_N ? m : k) || ldb_array[i] < std::max(1, tb == CUBLAS_OP_N ? k : n) ||
            ldc_array[i] < std::max(1, m))
            return fail(CUBLAS_STATUS_INVALID_VALUE, "a size, operation or leading dimension");
        problems += group_size[i];
    }
    size_t pa = (size_t)problems * sizeof(void *);
    if (problems && !(emu::is_device(Aarray, pa) && emu::is_device(Barray, pa) && emu::is_device(Carray, pa)))
        return fail(CUBLAS_STATUS_EXECUTION_FAILED, "the pointer arrays are not in device memory");
    int64_t idx = 0;
    for (int i = 0; i < group_count; i++) {
        double alpha = dtype == TIDE_F64 ? ((const double *)alpha_array)[i] : ((const float *)alpha_array)[i];
        double beta = dtype == TIDE_F64 ? ((const double *)beta_array)[i] : ((const float *)beta_array)[i];
        bool ta = transa_array[i] != CUBLAS_OP_N, tb = transb_array[i] != CUBLAS_OP_N;
        int64_t m = m_array[i], n = n_array[i], k = k_array[i], lda = lda_array[i], ldb = ldb_array[i], ldc = ldc_array[i];
        for (int j = 0; j < group_size[i]; j++, idx++) {
            const void *A = Aarray[idx], *B = Barray[idx];
            void *C = Carray[idx];
            if (dtype == TIDE_BF16 && (((uintptr_t)A | (uintptr_t)B | (uintptr_t)C) & 15))
                return fail(CUBLAS_STATUS_EXECUTION_FAILED, "a bf16 matrix pointer is not 16-byte aligned");
            for (int64_t c = 0; c < n; c++)
                for (int64_t r = 0; r < m; r++) {
                    double acc = 0;
                    for (int64_t l = 0; l < k; l++)
                        acc += ld_any(dtype, A, ta ? l + r * lda : r + l * lda) * ld_any(dtype, B, tb ? c + l * ldb : l + c * ldb);
                    int64_t ic = r + c * ldc;
                    st_any(dtype, C, ic, alpha * acc + (beta != 0 ? beta * ld_any(dtype, C, ic) : 0.0));
                }
        }
    }
    return CUBLAS_STATUS_SUCCESS;
}

#include "moe_emu.inc"

static std::mt19937_64 gen(17);
static float randn()
{
    std::normal_distribution<double> d(0.0, 1.0);
    return (float)d(gen);
}
static int n_fail = 0, n_pass = 0;
static void check(const char *name, const std::vector<float> &got, const std::vector<float> &ref, double tol)
{
    double mx = 0, e = 0;
    int nonfin = 0;
    for (size_t i = 0; i < ref.size(); i++) mx = std::max(mx, (double)std::fabs(ref[i]));
    for (size_t i = 0; i < ref.size() && i < got.size(); i++) {
        if (!std::isfinite(got[i])) { nonfin++; continue; }
        e = std::max(e, (double)std::fabs(got[i] - ref[i]));
    }
    double rel = mx > 0 ? e / mx : e;
    bool ok = nonfin == 0 && rel <= tol && got.size() == ref.size();
    printf("  %-40s %s err/max %.2e (tol %.1e)%s\n", name, ok ? "ok  " : "FAIL", rel, tol, nonfin ? "  NONFINITE" : "");
    if (ok) n_pass++; else n_fail++;
}
template <class T> static bool same_bits(const std::vector<T> &a, const std::vector<T> &b)
{
    return a.size() == b.size() && !memcmp(a.data(), b.data(), a.size() * sizeof(T));
}
static void check_exact(const char *name, bool ok)
{
    printf("  %-40s %s\n", name, ok ? "ok  " : "FAIL");
    if (ok) n_pass++; else n_fail++;
}
static std::vector<float> rv(size_t n, float s = 1)
{
    std::vector<float> v(n);
    for (auto &x : v) x = s * randn();
    return v;
}
static float bf16_round(float x) { return __bfloat162float(__float2bfloat16(x)); }
template <class T> static std::vector<T> to_dev(const std::vector<float> &x)
{
    std::vector<T> o(x.size());
    for (size_t i = 0; i < x.size(); i++) {
        if constexpr (std::is_same<T, float>::value) o[i] = x[i];
        else o[i] = __float2bfloat16(x[i]);
    }
    return o;
}
template <class T> static std::vector<float> from_dev(const std::vector<T> &x)
{
    std::vector<float> o(x.size());
    for (size_t i = 0; i < x.size(); i++) {
        if constexpr (std::is_same<T, float>::value) o[i] = x[i];
        else o[i] = __bfloat162float(x[i]);
    }
    return o;
}

// moe_sort against std::stable_sort by expert (ties keep the (t, slot) order), each expert keeping its first cap
// (cap < 0: all): route = [perm | pos | offsets], the host offsets and the dropped count, all exactly
static void run_sort(const char *what, const std::vector<int64_t> &sel, int64_t n, int64_t cap, bool i32)
{
    int64_t A = (int64_t)sel.size();
    char name[160];
    snprintf(name, sizeof name, "sort %s (A %lld, n %lld%s%s)", what, (long long)A, (long long)n, cap >= 0 ? ", cap" : "",
             i32 ? ", i32" : "");
    std::vector<int64_t> order(A), count(n, 0), taken(n, 0), ref(2 * A + n + 1, -1);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return sel[a] < sel[b]; });
    for (int64_t e : sel) count[e]++;
    int64_t *perm = ref.data(), *pos = perm + A, *off = pos + A, dropped = 0;
    off[0] = 0;
    for (int64_t e = 0; e < n; e++) {
        int64_t kept = cap >= 0 && count[e] > cap ? cap : count[e];
        off[e + 1] = off[e] + kept;
        dropped += count[e] - kept;
    }
    for (int64_t a : order) {
        int64_t e = sel[a];
        if (cap >= 0 && taken[e] >= cap) continue;   // pos stays -1
        perm[off[e] + taken[e]] = a;
        pos[a] = off[e] + taken[e]++;
    }
    std::vector<int64_t> route(2 * A + n + 1, -7), hoff(n + 2, -7);
    std::vector<int32_t> sel32(sel.begin(), sel.end());
    int rc = moe_sort(route.data(), hoff.data(), i32 ? (const void *)sel32.data() : (const void *)sel.data(), !i32, A, n,
                      cap, 0);
    if (rc) printf("  failed: %s\n", err_buf);
    bool ok = rc == 0 && route == ref && std::equal(off, off + n + 1, hoff.begin()) && hoff[n + 1] == dropped;
    check_exact(name, ok);
}

static void sort_cases()
{
    printf("device counting sort vs std::stable_sort\n");
    auto draw = [](int64_t A, int64_t n, auto pick) {
        std::vector<int64_t> s(A);
        for (auto &v : s) v = pick(n);
        return s;
    };
    auto uniform = [](int64_t n) { return (int64_t)(gen() % (uint64_t)n); };
    // experts 2 and 5 never drawn
    auto holes = [](int64_t) {
        static const int64_t used[] = {0, 1, 3, 4, 6, 7};
        return used[gen() % 6];
    };
    // p(e) ∝ 1/(e + 1): a few hot experts, a long cold tail, some empty
    auto skewed = [](int64_t n) {
        double u = std::uniform_real_distribution<double>(0, 1)(gen);
        return std::min(n - 1, (int64_t)std::floor(std::exp(u * std::log((double)n + 1)) - 1));
    };
    run_sort("empty experts, 3 tiles", draw(3000, 8, holes), 8, -1, false);
    run_sort("all on expert 3", std::vector<int64_t>(2500, 3), 6, -1, false);
    run_sort("all on expert 3, capacity 700", std::vector<int64_t>(2500, 3), 6, 700, false);
    run_sort("skewed", draw(4000, 64, skewed), 64, -1, false);
    run_sort("skewed, capacity", draw(4000, 64, skewed), 64, 4000 / 64, false);
    run_sort("uniform", draw(700, 5, uniform), 5, -1, true);
    run_sort("1100 experts (tiles of 1280)", draw(3000, 1100, skewed), 1100, -1, false);
    run_sort("one assignment", std::vector<int64_t>(1, 2), 3, -1, false);
    run_sort("no assignments", std::vector<int64_t>(), 4, -1, false);
}

// moe_experts forward and backward on storage type T (float or bf16) against the cpu in f32; `grouped`: whether the
// GEMM stages must be one grouped call each (else a bf16 stage with misaligned rows: tide_cuda_gemm per product)
template <class T>
static void run_moe(const char *name, int64_t m, int64_t k, int64_t n, int64_t din, int64_t de, int64_t dout, int act,
                    double cf, int full_expert, double tol, bool grouped)
{
    const bool bf = !std::is_same<T, float>::value;
    const int dt = bf ? TIDE_BF16 : TIDE_F32;
    printf("%s: %s, m %lld k %lld n %lld, d %lld/%lld/%lld, %s, capacity %g\n", name, bf ? "bf16" : "f32", (long long)m,
           (long long)k, (long long)n, (long long)din, (long long)de, (long long)dout, act ? "swiglu" : "situ", cf);
    int64_t A = m * k, cap = cf > 0 ? (int64_t)ceil(cf * (double)A / (double)n) : -1;
    std::vector<int64_t> sel(A);
    for (int64_t a = 0; a < A; a++) sel[a] = full_expert >= 0 && a % k == 0 ? full_expert : (int64_t)(gen() % (uint64_t)(n > 2 ? n - 2 : n));
    auto x = rv(m * din), wgu = rv(n * 2 * de * din, 0.3f), wd = rv(n * dout * de, 0.3f), du = rv(m * dout);
    std::vector<float> p(A);
    for (auto &v : p) v = 0.1f + 0.9f * (float)(gen() % 1000) / 1000.0f;
    if (bf)
        for (auto *v : {&x, &wgu, &wd, &du, &p})
            for (auto &e : *v) e = bf16_round(e);
    // cpu
    std::vector<int64_t> rc(2 * A + n + 1);
    std::vector<float> oc(m * dout), prc(A * 2 * de), yc(A * dout), dxc(m * din), dpc(A), dwguc(wgu.size()), dwdc(wd.size());
    int64_t dropc = -1, dropg = -2;
    std::vector<int64_t> hoc(n + 1, -3), hog(n + 1, -4);
    tide_cpu_backend.moe_experts(TIDE_F32, oc.data(), rc.data(), prc.data(), yc.data(), x.data(), sel.data(), TIDE_I64, p.data(),
                                 wgu.data(), wd.data(), m, k, n, din, de, dout, act, 1.5, 2.0, cap, &dropc, hoc.data());
    tide_cpu_backend.moe_experts_backward(TIDE_F32, dxc.data(), dpc.data(), dwguc.data(), dwdc.data(), du.data(), rc.data(),
                                          hoc.data(), prc.data(), yc.data(), x.data(), p.data(), wgu.data(), wd.data(), m,
                                          k, n, din, de, dout, act, 1.5, 2.0);
    // emulated cuda, outputs poisoned with NaN
    auto xd = to_dev<T>(x), wgud = to_dev<T>(wgu), wdd = to_dev<T>(wd), dud = to_dev<T>(du), pd = to_dev<T>(p);
    auto nan = [](size_t sz) { return to_dev<T>(std::vector<float>(sz, NAN)); };
    std::vector<int64_t> rg(2 * A + n + 1, -7);
    std::vector<T> og = nan(m * dout), prg = nan(A * 2 * de), yg = nan(A * dout), dxg = nan(m * din), dpg = nan(A),
                   dwgug = nan(wgu.size()), dwdg = nan(wd.size());
    n_grouped = n_gemm = 0;
    int syncs0 = emu::n_syncs, syncs1 = 0, syncs2 = 0;
    // the backward given the forward's host offsets (the op's route), then without them (read back from the route)
    std::vector<T> dxg2 = nan(m * din), dpg2 = nan(A), dwgug2 = nan(wgu.size()), dwdg2 = nan(wd.size());
    bool failed = tide_cuda_moe_experts(dt, og.data(), rg.data(), prg.data(), yg.data(), xd.data(), sel.data(), TIDE_I64,
                                        pd.data(), wgud.data(), wdd.data(), m, k, n, din, de, dout, act, 1.5, 2.0, cap,
                                        &dropg, hog.data());
    syncs1 = emu::n_syncs;
    failed = failed || tide_cuda_moe_experts_backward(dt, dxg.data(), dpg.data(), dwgug.data(), dwdg.data(), dud.data(),
                                                      rg.data(), hog.data(), prg.data(), yg.data(), xd.data(), pd.data(),
                                                      wgud.data(), wdd.data(), m, k, n, din, de, dout, act, 1.5, 2.0);
    syncs2 = emu::n_syncs;
    int grouped_fb = n_grouped, gemm_fb = n_gemm;
    failed = failed || tide_cuda_moe_experts_backward(dt, dxg2.data(), dpg2.data(), dwgug2.data(), dwdg2.data(), dud.data(),
                                                      rg.data(), nullptr, prg.data(), yg.data(), xd.data(), pd.data(),
                                                      wgud.data(), wdd.data(), m, k, n, din, de, dout, act, 1.5, 2.0);
    n_grouped = grouped_fb, n_gemm = gemm_fb;
    if (failed) {
        printf("  failed: %s\n", err_buf);
        n_fail++;
        return;
    }
    check_exact("host offsets == the route's, cpu and cuda", hoc == std::vector<int64_t>(rc.begin() + 2 * A, rc.end()) &&
                                                              hog == hoc);
    check_exact("one sync in the forward, none in the backward given the host offsets",
                syncs1 - syncs0 == 1 && syncs2 == syncs1);
    check_exact("the backward without them: one sync, the same bits", emu::n_syncs - syncs2 == 1 && same_bits(dxg, dxg2) &&
                same_bits(dpg, dpg2) && same_bits(dwgug, dwgug2) && same_bits(dwdg, dwdg2));
    check_exact("route (perm | pos | offsets) == cpu", rg == rc);
    check_exact("dropped count == cpu", dropg == dropc);
    if (grouped) check_exact("one grouped GEMM per stage (2 + 2)", n_grouped == 4 && n_gemm == 0);
    else check_exact("misaligned bf16 or cuBLAS < 12.5: a GEMM per product", n_grouped == 0 && n_gemm > 0);
    int64_t R = rc[2 * A + n];
    auto prf = from_dev(prg);
    check("out", from_dev(og), oc, tol);
    check("pre (kept rows)", std::vector<float>(prf.begin(), prf.begin() + R * 2 * de),
          std::vector<float>(prc.begin(), prc.begin() + R * 2 * de), tol);
    check("dx", from_dev(dxg), dxc, tol);
    check("dp", from_dev(dpg), dpc, tol);
    check("dw_gate_up", from_dev(dwgug), dwguc, tol);
    check("dw_down", from_dev(dwdg), dwdc, tol);
}

// the forward without host offsets (no backward follows): a dropless batch of at most TIDE_MOE_DEVICE_ROWS rows runs
// without a sync and without cuBLAS (moe_rows_gemm_kernel reads the offsets on the device); the route equals the
// cpu's exactly, out and pre within tol; a batch with a capacity or more rows takes the grouped path (one sync)
template <class T>
static void run_moe_device(const char *name, int64_t m, int64_t k, int64_t n, int64_t din, int64_t de, int64_t dout,
                           int act, double cf, double tol, bool device)
{
    const bool bf = !std::is_same<T, float>::value;
    const int dt = bf ? TIDE_BF16 : TIDE_F32;
    printf("%s: %s, m %lld k %lld n %lld, d %lld/%lld/%lld, no host offsets\n", name, bf ? "bf16" : "f32", (long long)m,
           (long long)k, (long long)n, (long long)din, (long long)de, (long long)dout);
    int64_t A = m * k, cap = cf > 0 ? (int64_t)ceil(cf * (double)A / (double)n) : -1;
    std::vector<int64_t> sel(A);
    // experts 0 and n - 1 idle, expert 1 in every token (more rows than a pass of the kernel holds)
    for (int64_t a = 0; a < A; a++) sel[a] = a % k == 0 ? 1 : 1 + (int64_t)(gen() % (uint64_t)(n - 2));
    auto x = rv(m * din), wgu = rv(n * 2 * de * din, 0.3f), wd = rv(n * dout * de, 0.3f);
    std::vector<float> p(A);
    for (auto &v : p) v = 0.1f + 0.9f * (float)(gen() % 1000) / 1000.0f;
    if (bf)
        for (auto *v : {&x, &wgu, &wd, &p})
            for (auto &e : *v) e = bf16_round(e);
    std::vector<int64_t> rc(2 * A + n + 1);
    std::vector<float> oc(m * dout), prc(A * 2 * de), yc(A * dout);
    int64_t dropc = -1, dropg = -2;
    tide_cpu_backend.moe_experts(TIDE_F32, oc.data(), rc.data(), prc.data(), yc.data(), x.data(), sel.data(), TIDE_I64, p.data(),
                                 wgu.data(), wd.data(), m, k, n, din, de, dout, act, 1.5, 2.0, cap, &dropc, nullptr);
    auto xd = to_dev<T>(x), wgud = to_dev<T>(wgu), wdd = to_dev<T>(wd), pd = to_dev<T>(p);
    auto nan = [](size_t sz) { return to_dev<T>(std::vector<float>(sz, NAN)); };
    std::vector<int64_t> rg(2 * A + n + 1, -7);
    std::vector<T> og = nan(m * dout), prg = nan(A * 2 * de), yg = nan(A * dout);
    n_grouped = n_gemm = 0;
    int syncs0 = emu::n_syncs;
    if (tide_cuda_moe_experts(dt, og.data(), rg.data(), prg.data(), yg.data(), xd.data(), sel.data(), TIDE_I64, pd.data(),
                              wgud.data(), wdd.data(), m, k, n, din, de, dout, act, 1.5, 2.0, cap, &dropg, nullptr)) {
        printf("  failed: %s\n", err_buf);
        n_fail++;
        return;
    }
    if (device)
        check_exact("no sync, no cuBLAS call", emu::n_syncs == syncs0 && n_grouped == 0 && n_gemm == 0);
    else
        check_exact("the grouped path: one sync, a grouped GEMM per stage", emu::n_syncs - syncs0 == 1 && n_grouped == 2);
    check_exact("route (perm | pos | offsets) == cpu", rg == rc);
    check_exact("dropped count == cpu", dropg == dropc);
    int64_t R = rc[2 * A + n];
    auto prf = from_dev(prg), yf = from_dev(yg);
    check("out", from_dev(og), oc, tol);
    check("pre (kept rows)", std::vector<float>(prf.begin(), prf.begin() + R * 2 * de),
          std::vector<float>(prc.begin(), prc.begin() + R * 2 * de), tol);
    check("y (kept rows)", std::vector<float>(yf.begin(), yf.begin() + R * dout),
          std::vector<float>(yc.begin(), yc.begin() + R * dout), tol);
}

// an expert id outside [0, n) (the op's deferred check reports it at the next synchronisation): the kernels leave it
// unrouted (pos -1) on both paths and read nothing out of bounds; out equals the cpu's with that slot's p at 0
static void run_moe_bad_id(bool device)
{
    const int64_t m = 9, k = 1, n = 5, din = 7, de = 6, dout = 8, A = m * k, badpos = 7;   // k 1: a tail row would read x[-din]
    printf("bad expert id, %s path\n", device ? "no-sync" : "grouped");
    std::vector<int64_t> sel(A), selc(A);
    for (int64_t a = 0; a < A; a++) sel[a] = (int64_t)(gen() % (uint64_t)n);
    selc = sel;
    sel[badpos] = n + 3;
    auto x = rv(m * din), wgu = rv(n * 2 * de * din, 0.3f), wd = rv(n * dout * de, 0.3f);
    std::vector<float> p(A), pc;
    for (auto &v : p) v = 0.1f + 0.9f * (float)(gen() % 1000) / 1000.0f;
    pc = p;
    pc[badpos] = 0;
    std::vector<int64_t> rc(2 * A + n + 1), rg(2 * A + n + 1, -7), hog(n + 1, -4);
    std::vector<float> oc(m * dout), prc(A * 2 * de), yc(A * dout);
    std::vector<float> og(m * dout, NAN), prg(A * 2 * de, NAN), yg(A * dout, NAN);
    int64_t dropc = -1, dropg = -2;
    tide_cpu_backend.moe_experts(TIDE_F32, oc.data(), rc.data(), prc.data(), yc.data(), x.data(), selc.data(), TIDE_I64,
                                 pc.data(), wgu.data(), wd.data(), m, k, n, din, de, dout, TIDE_MOE_SITU, 1.5, 2.0, -1,
                                 &dropc, nullptr);
    int syncs0 = emu::n_syncs;
    int r = tide_cuda_moe_experts(TIDE_F32, og.data(), rg.data(), prg.data(), yg.data(), x.data(), sel.data(), TIDE_I64,
                                  p.data(), wgu.data(), wd.data(), m, k, n, din, de, dout, TIDE_MOE_SITU, 1.5, 2.0, -1,
                                  &dropg, device ? nullptr : hog.data());
    if (r) printf("  failed: %s\n", err_buf);
    check_exact("runs, the bad assignment unrouted (pos -1), one row fewer", r == 0 && rg[A + badpos] == -1 &&
                rg[2 * A + n] == A - 1 && (device ? emu::n_syncs == syncs0 : hog[n] == A - 1));
    check("out (the bad slot contributes nothing)", og, oc, 1e-5);
}

int main()
{
    if (getenv("EMU_SEED")) emu::rng.seed(atoi(getenv("EMU_SEED")));
    {
        printf("situ_glu and topk\n");
        int64_t N = 300;
        auto g = rv(N, 3), u = rv(N, 3), d = rv(N);
        std::vector<float> hc(N), hg(N, NAN), dgc(N), duc(N), dgg(N, NAN), dug(N, NAN);
        tide_cpu_backend.situ_glu(TIDE_F32, hc.data(), g.data(), u.data(), N, 1.5, 2.0);
        tide_cpu_backend.situ_glu_backward(TIDE_F32, dgc.data(), duc.data(), d.data(), g.data(), u.data(), N, 1.5, 2.0);
        tide_cuda_situ_glu(TIDE_F32, hg.data(), g.data(), u.data(), N, 1.5, 2.0);
        tide_cuda_situ_glu_backward(TIDE_F32, dgg.data(), dug.data(), d.data(), g.data(), u.data(), N, 1.5, 2.0);
        check("situ_glu", hg, hc, 1e-6);
        check("situ_glu dg", dgg, dgc, 1e-6);
        check("situ_glu du", dug, duc, 1e-6);
        int64_t rows = 41, C = 13, kk = 4;
        auto x = rv(rows * C);
        for (int64_t c = 0; c < C; c += 3) x[5 * C + c] = 1.0f;   // ties in row 5
        std::vector<float> vc(rows * kk), vg(rows * kk, NAN);
        std::vector<int64_t> ic(rows * kk), ig(rows * kk, -1);
        tide_cpu_backend.topk(TIDE_F32, vc.data(), ic.data(), x.data(), rows, C, kk);
        tide_cuda_topk(TIDE_F32, vg.data(), ig.data(), x.data(), rows, C, kk);
        check_exact("topk values and indices == cpu", vc == vg && ic == ig);
        // a row wider than a warp (K3's 384 experts, top-8), with ties across lanes: the warp argmax's order
        int64_t rows2 = 9, C2 = 384, k2 = 8;
        auto x2 = rv(rows2 * C2);
        for (int64_t c = 5; c < C2; c += 37) x2[3 * C2 + c] = 2.5f;   // ties in row 3 on different lanes
        std::vector<float> vc2(rows2 * k2), vg2(rows2 * k2, NAN);
        std::vector<int64_t> ic2(rows2 * k2), ig2(rows2 * k2, -1);
        tide_cpu_backend.topk(TIDE_F32, vc2.data(), ic2.data(), x2.data(), rows2, C2, k2);
        tide_cuda_topk(TIDE_F32, vg2.data(), ig2.data(), x2.data(), rows2, C2, k2);
        check_exact("topk 384 wide, top-8, ties across lanes == cpu", vc2 == vg2 && ic2 == ig2);
    }
    sort_cases();
    run_moe<float>("dropless, one expert in every token, two idle", 29, 2, 8, 12, 8, 10, TIDE_MOE_SITU, 0, 3, 1e-5, true);
    run_moe<float>("swiglu, k 3", 17, 3, 5, 7, 6, 9, TIDE_MOE_SWIGLU, 0, -1, 1e-5, true);
    run_moe<float>("capacity 0.75", 31, 2, 6, 8, 5, 7, TIDE_MOE_SITU, 0.75, 1, 1e-5, true);
    run_moe<float>("several sort tiles", 700, 2, 8, 4, 3, 5, TIDE_MOE_SITU, 0, 2, 1e-5, true);
    // bf16 rows of 16, 8 and 24 elements: every segment pointer is 16-byte aligned, so the grouped calls run
    run_moe<__nv_bfloat16>("bf16, aligned rows", 23, 2, 6, 16, 8, 24, TIDE_MOE_SITU, 0, 2, 1.0 / 64, true);
    run_moe<__nv_bfloat16>("bf16, odd rows", 19, 2, 5, 7, 5, 9, TIDE_MOE_SWIGLU, 0.75, 0, 1.0 / 64, false);
    // a cuBLAS without the grouped GEMM (12.4): the same products, one plain GEMM each
    cublas_version = 120400;
    run_moe<float>("cuBLAS 12.4", 29, 2, 8, 12, 8, 10, TIDE_MOE_SITU, 0, 3, 1e-5, false);
    run_moe<__nv_bfloat16>("cuBLAS 12.4, bf16 aligned rows", 23, 2, 6, 16, 8, 24, TIDE_MOE_SITU, 0, 2, 1.0 / 64, false);
    cublas_version = CUBLAS_VERSION;
    // decoding-sized batches with no backward: widths past a warp's 32 lanes and past a block's column tile, rows of
    // expert 1 past a pass of 8; then a capacity and a batch past TIDE_MOE_DEVICE_ROWS, which read the offsets back
    run_moe_device<float>("device offsets", 13, 2, 7, 45, 21, 37, TIDE_MOE_SITU, 0, 1e-5, true);
    run_moe_device<float>("device offsets, swiglu, k 4", 5, 4, 9, 70, 17, 40, TIDE_MOE_SWIGLU, 0, 1e-5, true);
    run_moe_device<__nv_bfloat16>("device offsets, bf16", 11, 2, 6, 33, 9, 19, TIDE_MOE_SITU, 0, 1.0 / 64, true);
    run_moe_device<float>("capacity 0.75 (host offsets)", 13, 2, 7, 12, 8, 10, TIDE_MOE_SITU, 0.75, 1e-5, false);
    run_moe_device<float>("1,026 rows (host offsets)", 513, 2, 5, 6, 4, 5, TIDE_MOE_SITU, 0, 1e-5, false);
    run_moe_bad_id(true);
    run_moe_bad_id(false);
    printf("%d passed, %d failed\n", n_pass, n_fail);
    return n_fail ? 1 : 0;
}
