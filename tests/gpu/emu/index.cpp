// index.cpp — runs the real kernels/cuda/index.cu (index_add: the embedding backward; scatter_add: the gather and
// top-k backward) under the host emulator (emu.h). The additive kernels must be deterministic and add in index
// order: in f32 and f64 the result equals the cpu kernel's bit for bit (gx or out starting non-zero, indices
// repeating: a few hot rows take most positions, as padding tokens do), two runs with the emulated threads in
// different orders give the same bits, bf16 equals the f32 sum in index order rounded once (the atomics this
// replaces rounded the running sum at every add, so a row touched by many tokens lost increments), and an index
// outside its range adds nothing; and the index range check, deferred (reported at the next synchronisation) and
// not. Usage: tests/gpu/emu/run_one.sh index (EMU_SEED=n reorders threads).
#include "emu.h"
#include "common.cuh"
#include <cstdarg>
#include <cstring>
#include <string>

#include "emu_host.h"
#include "host_data.h"

#include "index_emu.inc"

static std::mt19937_64 gen(21);
static double randn()
{
    std::normal_distribution<double> d(0.0, 1.0);
    return d(gen);
}

static void check_true(const std::string &name, bool ok)
{
    printf("  %-66s %s\n", name.c_str(), ok ? "ok" : "FAIL");
    if (ok) n_pass++;
    else n_fail++;
}

template <class T> static T to_t(double x)
{
    if constexpr (std::is_same<T, __nv_bfloat16>::value) return __float2bfloat16((float)x);
    else return (T)x;
}
template <class T> static double from_t(T x)
{
    if constexpr (std::is_same<T, __nv_bfloat16>::value) return (double)__bfloat162float(x);
    else return (double)x;
}
template <class T> static bool same_bits(const std::vector<T> &a, const std::vector<T> &b)
{
    return a.size() == b.size() && !memcmp(a.data(), b.data(), a.size() * sizeof(T));
}

// indices: most positions on a few hot rows, the rest spread; bad > 0 plants that many out-of-range ones
static std::vector<int64_t> make_idx(int64_t n, int64_t range, int bad)
{
    std::vector<int64_t> v(n);
    std::uniform_int_distribution<int64_t> any(0, range - 1), hot(0, range < 3 ? range - 1 : 2);
    for (int64_t i = 0; i < n; i++) v[i] = gen() % 4 ? hot(gen) : any(gen);
    for (int b = 0; b < bad; b++) v[(size_t)(gen() % n)] = b % 2 ? range + 3 : -1;
    return v;
}

// index_add: gx [outer, n_dst, inner] += gy [outer, n_idx, inner] at rows idx
template <class T>
static void index_add_case(int64_t outer, int64_t n_dst, int64_t inner, int64_t n_idx, int idx_dtype, int bad)
{
    char name[160];
    snprintf(name, sizeof name, "index_add %s outer %lld rows %lld inner %lld, %lld %s indices%s",
             tide_dtype_name(dtype_of<T>()), (long long)outer, (long long)n_dst, (long long)inner, (long long)n_idx,
             idx_dtype == TIDE_I64 ? "i64" : "i32", bad ? ", some out of range" : "");
    printf("%s\n", name);
    std::vector<int64_t> id = make_idx(n_idx, n_dst, bad);
    std::vector<int32_t> id32(id.begin(), id.end());
    const void *idx = idx_dtype == TIDE_I64 ? (const void *)id.data() : (const void *)id32.data();
    std::vector<T> gx0((size_t)(outer * n_dst * inner)), gy((size_t)(outer * n_idx * inner));
    for (auto &x : gx0) x = to_t<T>(randn());
    for (auto &x : gy) x = to_t<T>(randn());
    std::vector<T> a = gx0, b = gx0;
    int rc = tide_cuda_index_add(dtype_of<T>(), a.data(), gy.data(), idx, idx_dtype, outer, n_dst, inner, n_idx);
    emu::rng.seed(emu::rng() ^ 0x9e3779b9u);   // a different thread order for the second run
    if (!rc) rc = tide_cuda_index_add(dtype_of<T>(), b.data(), gy.data(), idx, idx_dtype, outer, n_dst, inner, n_idx);
    if (rc) {
        printf("  failed: %s\n", err_buf);
        n_fail++;
        return;
    }
    check_true("two runs give the same bits", same_bits(a, b));
    // the expected result: in index order, the accumulator in the cpu's type (f32 for bf16, rounded once)
    std::vector<T> want = gx0;
    if constexpr (std::is_same<T, __nv_bfloat16>::value) {
        std::vector<float> acc(want.size());
        for (size_t i = 0; i < acc.size(); i++) acc[i] = __bfloat162float(gx0[i]);
        for (int64_t o = 0; o < outer; o++)
            for (int64_t j = 0; j < n_idx; j++)
                if (id[j] >= 0 && id[j] < n_dst)
                    for (int64_t i = 0; i < inner; i++)
                        acc[(size_t)((o * n_dst + id[j]) * inner + i)] += __bfloat162float(gy[(size_t)((o * n_idx + j) * inner + i)]);
        for (size_t i = 0; i < acc.size(); i++) want[i] = __float2bfloat16(acc[i]);
        check_true("bf16: the f32 sum in index order, rounded once", same_bits(a, want));
    } else if (!bad) {
        int crc = tide_cpu_backend.index_add(dtype_of<T>(), want.data(), gy.data(), idx, idx_dtype, outer, n_dst, inner,
                                             n_idx);
        check_true("equals the cpu kernel bit for bit", crc == 0 && same_bits(a, want));
    } else {   // the cpu refuses a bad index; the rule: in range adds in order, out of range adds nothing
        for (int64_t o = 0; o < outer; o++)
            for (int64_t j = 0; j < n_idx; j++)
                if (id[j] >= 0 && id[j] < n_dst)
                    for (int64_t i = 0; i < inner; i++)
                        want[(size_t)((o * n_dst + id[j]) * inner + i)] += gy[(size_t)((o * n_idx + j) * inner + i)];
        check_true("out-of-range indices add nothing, the rest in order", same_bits(a, want));
    }
}

// scatter_add: out [outer, n_out, inner] at idx [outer, n_idx, inner] += src (same shape as idx)
template <class T> static void scatter_add_case(int64_t outer, int64_t n_out, int64_t inner, int64_t n_idx, int bad)
{
    char name[160];
    snprintf(name, sizeof name, "scatter_add %s outer %lld out %lld inner %lld, %lld indices per column%s",
             tide_dtype_name(dtype_of<T>()), (long long)outer, (long long)n_out, (long long)inner, (long long)n_idx,
             bad ? ", some out of range" : "");
    printf("%s\n", name);
    std::vector<int64_t> id = make_idx(outer * n_idx * inner, n_out, bad);
    std::vector<T> out0((size_t)(outer * n_out * inner)), src(id.size());
    for (auto &x : out0) x = to_t<T>(randn());
    for (auto &x : src) x = to_t<T>(randn());
    std::vector<T> a = out0, b = out0;
    int rc = tide_cuda_scatter_add(dtype_of<T>(), a.data(), src.data(), id.data(), TIDE_I64, outer, n_out, n_idx, inner);
    emu::rng.seed(emu::rng() ^ 0x85ebca6bu);
    if (!rc) rc = tide_cuda_scatter_add(dtype_of<T>(), b.data(), src.data(), id.data(), TIDE_I64, outer, n_out, n_idx, inner);
    if (rc) {
        printf("  failed: %s\n", err_buf);
        n_fail++;
        return;
    }
    check_true("two runs give the same bits", same_bits(a, b));
    std::vector<T> want = out0;
    if constexpr (std::is_same<T, __nv_bfloat16>::value) {
        std::vector<float> acc(want.size());
        for (size_t i = 0; i < acc.size(); i++) acc[i] = __bfloat162float(out0[i]);
        for (int64_t o = 0; o < outer; o++)
            for (int64_t j = 0; j < n_idx; j++)
                for (int64_t i = 0; i < inner; i++) {
                    size_t k = (size_t)((o * n_idx + j) * inner + i);
                    if (id[k] >= 0 && id[k] < n_out) acc[(size_t)((o * n_out + id[k]) * inner + i)] += __bfloat162float(src[k]);
                }
        for (size_t i = 0; i < acc.size(); i++) want[i] = __float2bfloat16(acc[i]);
        check_true("bf16: the f32 sum in index order, rounded once", same_bits(a, want));
    } else if (!bad) {
        int crc = tide_cpu_backend.scatter_add(dtype_of<T>(), want.data(), src.data(), id.data(), TIDE_I64, outer, n_out,
                                               n_idx, inner);
        check_true("equals the cpu kernel bit for bit", crc == 0 && same_bits(a, want));
    } else {
        for (int64_t o = 0; o < outer; o++)
            for (int64_t j = 0; j < n_idx; j++)
                for (int64_t i = 0; i < inner; i++) {
                    size_t k = (size_t)((o * n_idx + j) * inner + i);
                    if (id[k] >= 0 && id[k] < n_out) want[(size_t)((o * n_out + id[k]) * inner + i)] += src[k];
                }
        check_true("out-of-range indices add nothing, the rest in order", same_bits(a, want));
    }
}

int main()
{
    if (getenv("EMU_SEED")) emu::rng.seed(atoi(getenv("EMU_SEED")));
    // the embedding backward's shape (outer 1), odd sizes, a non-power-of-two count (sort padding), one index
    index_add_case<float>(1, 37, 45, 1000, TIDE_I64, 0);
    index_add_case<float>(3, 11, 7, 257, TIDE_I32, 0);
    index_add_case<float>(1, 5, 3, 1, TIDE_I64, 0);
    index_add_case<double>(2, 19, 33, 300, TIDE_I64, 0);
    index_add_case<float>(1, 23, 9, 200, TIDE_I32, 6);
    // bf16: 2,000 adds to three hot rows, where rounding each add lost increments
    index_add_case<__nv_bfloat16>(1, 13, 40, 2000, TIDE_I64, 0);
    // the top-k backward's shape (rows x k into rows x E, inner 1) and a gather backward along a middle dim
    scatter_add_case<float>(64, 16, 1, 4, 0);
    scatter_add_case<float>(3, 9, 17, 50, 0);
    scatter_add_case<double>(2, 7, 5, 40, 0);
    scatter_add_case<float>(2, 7, 5, 40, 5);
    scatter_add_case<__nv_bfloat16>(2, 5, 8, 600, 0);
    // the range check: deferred (defer = 1: recorded on the device, the call says ok, the next synchronisation
    // reports the first bad position of the earliest call with its op and value), or answered now (defer = 0)
    printf("check_index\n");
    {
        std::vector<int64_t> good = {0, 3, 4, 1}, bad = {2, 9, 4, -1};
        std::vector<int32_t> bad32 = {1, 1, 7};
        int64_t v = 0;
        int ok = 0;
        int rc = tide_cuda_check_index("embedding", bad.data(), TIDE_I64, 4, 5, 1, &v, &ok);
        int rc2 = tide_cuda_check_index("gather", bad32.data(), TIDE_I32, 3, 5, 1, &v, &ok);
        int rep = tide_cuda_deferred_report();
        std::string e = err_buf;
        check_true("deferred: the calls return ok, the report names the first: " + e,
                   !rc && !rc2 && ok && rep && e.find("embedding: token id 9 at position 1") != std::string::npos);
        check_true("the record is clean after its report", tide_cuda_deferred_report() == 0);
        rc = tide_cuda_check_index("gather", good.data(), TIDE_I64, 4, 5, 1, &v, &ok);
        rc2 = tide_cuda_check_index("gather", bad32.data(), TIDE_I32, 3, 5, 1, &v, &ok);
        rep = tide_cuda_deferred_report();
        e = err_buf;
        check_true("a clean call then a bad one: the bad one's op and value: " + e,
                   !rc && !rc2 && rep && e.find("gather: index 7 at position 2 is out of range [0, 5)") != std::string::npos);
        ok = 1;
        rc = tide_cuda_check_index("moe_experts", bad.data(), TIDE_I64, 4, 5, 0, &v, &ok);
        check_true("defer = 0: answered now (ok 0, the value 9), nothing left to report",
                   !rc && !ok && v == 9 && tide_cuda_deferred_report() == 0);
    }
    printf("%d passed, %d failed\n", n_pass, n_fail);
    return n_fail ? 1 : 0;
}
