/*
 * fuzz_safetensors.c — the safetensors reader (engine/io/safetensors.c, formats.md §1) on hostile files.
 *
 * The input is a whole file. It is opened twice, from memory (tide_safetensors_open_memory) and from a file
 * (tide_safetensors_open, pread on demand), and the two must agree: both fail, or both succeed with the same
 * names, dtypes, shapes, metadata and tensor bytes. An opened file must also keep its promises: every name is
 * found at its own index, a tensor's byte count is its numel times its dtype size, and the tensors' bytes are
 * exactly the file's data buffer.
 */
#include "fuzz.h"

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    fuzz_init_engine();
    return 0;
}

static size_t st_dtype_size(const char *name)
{
    static const struct { const char *name; size_t size; } sizes[] = {
        { "BOOL", 1 }, { "U8", 1 }, { "I8", 1 }, { "I16", 2 }, { "U16", 2 }, { "F16", 2 }, { "BF16", 2 },
        { "I32", 4 }, { "U32", 4 }, { "F32", 4 }, { "F64", 8 }, { "I64", 8 }, { "U64", 8 },
        { "F8_E4M3", 1 }, { "F8_E5M2", 1 },
    };
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++)
        if (!strcmp(sizes[i].name, name)) return sizes[i].size;
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    const char *path = fuzz_path(0, "in.safetensors");
    fuzz_write(path, data, size);
    tide_safetensors *m = tide_safetensors_open_memory(data, size, "fuzz");
    const char *merr = m ? "" : strdup(tide_last_error());
    tide_safetensors *f = tide_safetensors_open(path);
    FUZZ_CHECK(!m == !f, "memory open %s, file open %s (memory error: %s)", m ? "succeeded" : "failed",
               f ? "succeeded" : "failed", merr);
    if (!m) {
        FUZZ_CHECK(merr[0] != 0, "a failed open sets an error");
        free((void *)merr);
        return 0;
    }
    int n = tide_safetensors_count(m);
    FUZZ_CHECK(n >= 0 && n == tide_safetensors_count(f), "count %d vs %d", n, tide_safetensors_count(f));
    FUZZ_CHECK(!strcmp(tide_safetensors_metadata(m), tide_safetensors_metadata(f)), "metadata differs");
    uint64_t hn = 0;
    for (int k = 7; k >= 0; k--) hn = (hn << 8) | data[k];
    uint64_t data_bytes = size - 8 - hn, seen = 0;
    int partial = 0;                           /* a tensor with more than 8 dims: its size is not visible */
    for (int i = 0; i < n; i++) {
        const char *name = tide_safetensors_name(m, i);
        FUZZ_CHECK(name && !strcmp(name, tide_safetensors_name(f, i)), "name %d", i);
        FUZZ_CHECK(tide_safetensors_find(m, name) == i, "find('%.60s') = %d, expected %d", name,
                   tide_safetensors_find(m, name), i);
        const char *dt = tide_safetensors_dtype(m, i);
        FUZZ_CHECK(dt && !strcmp(dt, tide_safetensors_dtype(f, i)), "dtype %d", i);
        int64_t sm[8], sf[8];
        int nd = tide_safetensors_shape(m, i, sm);
        FUZZ_CHECK(nd >= 0 && nd == tide_safetensors_shape(f, i, sf), "ndim %d", i);
        FUZZ_CHECK(!memcmp(sm, sf, sizeof(int64_t) * (size_t)(nd < 8 ? nd : 8)), "shape %d", i);
        tide_tensor *tm = tide_safetensors_get(m, i, TIDE_CPU);
        tide_tensor *tf = tide_safetensors_get(f, i, TIDE_CPU);
        FUZZ_CHECK(!tm == !tf, "get %d: memory %p, file %p", i, (void *)tm, (void *)tf);
        if (tm) {
            FUZZ_CHECK(nd <= 8 && tm->ndim == nd, "tensor %d has %d dims, header %d", i, tm->ndim, nd);
            uint64_t numel = 1;                /* unsigned: a zero dim after huge ones may wrap first */
            for (int d = 0; d < nd; d++) {
                FUZZ_CHECK(tm->shape[d] == sm[d], "tensor %d dim %d", i, d);
                numel *= (uint64_t)sm[d];
            }
            size_t nm = 0, nf = 0;
            unsigned char *bm = fuzz_tensor_bytes(tm, &nm), *bf = fuzz_tensor_bytes(tf, &nf);
            FUZZ_CHECK(nm == nf && nm == (size_t)numel * st_dtype_size(dt), "tensor %d: %zu bytes", i, nm);
            FUZZ_CHECK(!memcmp(bm, bf, nm), "tensor %d: memory and file bytes differ", i);
            free(bm);
            free(bf);
        }
        tide_tensor_release(tm);
        tide_tensor_release(tf);
        if (nd > 8) {
            partial = 1;
        } else {
            uint64_t numel = 1;
            for (int d = 0; d < nd; d++) numel *= (uint64_t)sm[d];
            seen += numel * st_dtype_size(dt);
        }
    }
    FUZZ_CHECK(partial || seen == data_bytes, "the tensors cover %llu of the %llu data bytes",
               (unsigned long long)seen, (unsigned long long)data_bytes);
    FUZZ_CHECK(tide_safetensors_get(m, n, TIDE_CPU) == NULL && tide_safetensors_name(m, -1) == NULL,
               "out-of-range indices are errors");
    tide_safetensors_close(m);
    tide_safetensors_close(f);
    return 0;
}
