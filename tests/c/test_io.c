/*
 * test_io.c — files: atomic writes and directories, safetensors (formats.md §1, oracles 1 and 2),
 * token shards (§3, oracle 3), checkpoint atomicity (§6, oracle 7). Temporary files live in a
 * mkdtemp directory that is removed at the end.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include "tide.h"

#ifndef TIDE_IO_FUZZ_ITERS
#define TIDE_IO_FUZZ_ITERS 100000          /* oracle 1: 10^5 mutations */
#endif

static int g_pass, g_fail;
static char g_dir[64];

#define CHECK(cond, ...) do {                                                              \
        if (cond) g_pass++;                                                                \
        else { g_fail++; printf("FAIL %s:%d: ", __FILE__, __LINE__); printf(__VA_ARGS__); printf("\n"); } \
    } while (0)

/* the last error contains `part` */
#define CHECK_ERROR(part, what) do {                                                       \
        const char *e_ = tide_last_error();                                                \
        CHECK(strstr(e_, (part)) != NULL, "%s: error '%s' lacks '%s'", (what), e_, (part)); \
    } while (0)

/* a path in the test directory; names live in a ring of 4 buffers (copy those that must last) */
static const char *tmp(const char *name)
{
    static char buf[4][512];
    static int k;
    k = (k + 1) % 4;
    snprintf(buf[k], sizeof buf[k], "%s/%s", g_dir, name);
    return buf[k];
}

static void write_raw(const char *path, const void *bytes, size_t n)
{
    FILE *f = fopen(path, "wb");
    if (!f) { printf("cannot write %s\n", path); exit(2); }
    if (n) fwrite(bytes, 1, n, f);
    fclose(f);
}

static unsigned char *slurp(const char *path, size_t *n)
{
    return (unsigned char *)tide_read_file(path, n, 0);
}

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;
static uint64_t rnd(void)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return rng_state;
}

/* ---- file helpers -------------------------------------------------------------------------------- */
static void test_files(void)
{
    char p[512], f[512];
    snprintf(p, sizeof p, "%s", tmp("a/b/c"));
    snprintf(f, sizeof f, "%s", tmp("a/hello.txt"));
    CHECK(tide_mkdir_p(p) == 0, "mkdir_p: %s", tide_last_error());
    CHECK(tide_is_dir(p) && tide_path_exists(p), "mkdir_p made a directory");
    CHECK(tide_mkdir_p(p) == 0, "mkdir_p of an existing directory is fine");
    CHECK(tide_mkdir_p(tmp("a/b/c/")) == 0, "trailing slash is fine");

    CHECK(tide_file_write_atomic(f, "hello\n", 6) == 0, "write_atomic: %s", tide_last_error());
    CHECK(!tide_path_exists(tmp("a/hello.txt.tmp")), "no .tmp left after a write");
    CHECK(tide_file_size(f) == 6, "file_size %lld", (long long)tide_file_size(f));
    size_t n = 0;
    char *s = tide_read_file(f, &n, 0);
    CHECK(s && n == 6 && !memcmp(s, "hello\n", 7), "read_file returns the bytes and a NUL");
    tide_free(s);
    CHECK(tide_read_file(f, &n, 5) == NULL, "max_bytes limit");
    CHECK_ERROR("over the limit of 5 bytes", "read_file limit");
    s = tide_read_file(f, &n, 6);
    CHECK(s && n == 6, "max_bytes equal to the size is fine");
    tide_free(s);

    CHECK(tide_mkdir_p(tmp("a/hello.txt/x")) != 0, "mkdir_p through a file fails");
    CHECK(tide_mkdir_p(f) != 0, "mkdir_p over a file fails");
    CHECK_ERROR("a file of that name exists", "mkdir_p over a file");

    CHECK(tide_read_file(tmp("missing.txt"), &n, 0) == NULL, "missing file");
    char want[600];
    snprintf(want, sizeof want, "cannot open '%s': No such file or directory", tmp("missing.txt"));
    CHECK_ERROR(want, "read_file of a missing file");
    CHECK(!tide_path_exists(tmp("missing.txt")) && tide_file_size(tmp("missing.txt")) == -1, "missing");
    CHECK(tide_read_file(tmp("a"), &n, 0) == NULL, "reading a directory fails");

    /* text files as byte tensors */
    tide_tensor *t = tide_text_read_bytes(f);
    CHECK(t && t->dtype == TIDE_U8 && t->ndim == 1 && t->shape[0] == 6, "text_read_bytes shape");
    if (t) {
        unsigned char b[6];
        CHECK(tide_read_bytes(t, b, 6) == 0 && !memcmp(b, "hello\n", 6), "text_read_bytes bytes");
    }
    tide_tensor_release(t);
    write_raw(tmp("empty.txt"), "", 0);
    CHECK(tide_text_read_bytes(tmp("empty.txt")) == NULL, "empty text file");
    snprintf(want, sizeof want, "text file '%s' is empty", tmp("empty.txt"));
    CHECK_ERROR(want, "empty text file");
    CHECK(tide_text_read_bytes(tmp("missing.txt")) == NULL, "missing text file");
    CHECK_ERROR("No such file or directory", "missing text file");

    /* listing is sorted and NUL separated */
    write_raw(tmp("a/b/z"), "1", 1);
    write_raw(tmp("a/b/m"), "1", 1);
    char *list = tide_list_dir(tmp("a/b"), &n);
    CHECK(list && n == 6 && !memcmp(list, "c\0m\0z\0", 6), "list_dir sorted");
    tide_free(list);
    list = tide_list_dir(tmp("a/b/c"), &n);
    CHECK(list && n == 0, "list_dir of an empty directory");
    tide_free(list);
    CHECK(tide_list_dir(tmp("nope"), &n) == NULL, "list_dir of a missing directory");

    CHECK(tide_remove_tree(tmp("a")) == 0 && !tide_path_exists(tmp("a")), "remove_tree: %s", tide_last_error());
    CHECK(tide_remove_tree(tmp("a")) == 0, "remove_tree of a missing path is fine");
}

/* oracle 7 in miniature: a leftover .tmp never hides or corrupts the committed file */
static void test_atomic(void)
{
    const char *latest = tmp("latest");
    CHECK(tide_file_write_text_atomic(latest, "step_00000001") == 0, "write latest");
    write_raw(tmp("latest.tmp"), "step_9999 (torn write", 21);   /* a writer killed mid-way */
    size_t n;
    char *s = tide_read_file(latest, &n, 0);
    CHECK(s && !strcmp(s, "step_00000001"), "latest unchanged by a stale .tmp: '%s'", s ? s : "(null)");
    tide_free(s);
    CHECK(tide_file_write_text_atomic(latest, "step_00000002") == 0, "replace latest over a stale .tmp");
    s = tide_read_file(latest, &n, 0);
    CHECK(s && !strcmp(s, "step_00000002"), "latest replaced: '%s'", s ? s : "(null)");
    tide_free(s);
    CHECK(!tide_path_exists(tmp("latest.tmp")), "the .tmp is gone after the rename");

    /* checkpoint directory protocol (formats.md §6) */
    const char *ck = tmp("run/ckpt/step_00000001.tmp");
    CHECK(tide_mkdir_p(ck) == 0, "mkdir ckpt");
    int64_t shape[1] = { 3 };
    float v[3] = { 1.5f, -2.0f, 3.25f };
    tide_tensor *w = tide_from_bytes(TIDE_F32, 1, shape, TIDE_CPU, v, sizeof v);
    const char *names[1] = { "model.norm.weight" };
    char path[600];
    snprintf(path, sizeof path, "%s/model.safetensors", ck);
    CHECK(tide_safetensors_save(path, 1, names, &w, "{\"format\":\"pt\",\"tide.step\":\"1\"}") == 0,
          "save into the tmp dir: %s", tide_last_error());
    CHECK(tide_fsync_dir(ck) == 0, "fsync the tmp dir");
    CHECK(tide_rename_atomic(ck, tmp("run/ckpt/step_00000001")) == 0, "rename the checkpoint dir: %s",
          tide_last_error());
    CHECK(tide_file_write_text_atomic(tmp("run/ckpt/latest"), "step_00000001") == 0, "latest");
    /* the next checkpoint is aborted between writing its .tmp and the rename */
    CHECK(tide_mkdir_p(tmp("run/ckpt/step_00000002.tmp")) == 0, "mkdir 2");
    write_raw(tmp("run/ckpt/step_00000002.tmp/model.safetensors"), "\x10\0\0", 3);
    s = tide_read_file(tmp("run/ckpt/latest"), &n, 0);
    CHECK(s && !strcmp(s, "step_00000001"), "latest still names the last good checkpoint");
    if (s) {
        char mp[600];
        snprintf(mp, sizeof mp, "%s/%s/model.safetensors", tmp("run/ckpt"), s);
        tide_safetensors *h = tide_safetensors_open(mp);
        CHECK(h != NULL, "the last good checkpoint opens: %s", tide_last_error());
        tide_tensor *r = h ? tide_safetensors_get(h, 0, TIDE_CPU) : NULL;
        float got[3] = { 0 };
        CHECK(r && tide_read_bytes(r, got, sizeof got) == 0 && !memcmp(got, v, sizeof v), "its bytes");
        CHECK(h && !strcmp(tide_safetensors_metadata(h), "{\"format\":\"pt\",\"tide.step\":\"1\"}"),
              "its metadata: %s", h ? tide_safetensors_metadata(h) : "");
        tide_tensor_release(r);
        tide_safetensors_close(h);
    }
    tide_free(s);
    size_t ln;
    char *list = tide_list_dir(tmp("run/ckpt"), &ln);
    const char want[] = "latest\0step_00000001\0step_00000002.tmp\0";
    CHECK(list && ln == sizeof want - 1 && !memcmp(list, want, ln), "ckpt listing");
    tide_free(list);

    /* a failed save leaves the existing file as it was */
    const char *dup[2] = { "x", "x" };
    tide_tensor *two[2] = { w, w };
    size_t before_n, after_n;
    unsigned char *before = slurp(tmp("run/ckpt/step_00000001/model.safetensors"), &before_n);
    CHECK(tide_safetensors_save(tmp("run/ckpt/step_00000001/model.safetensors"), 2, dup, two, NULL) != 0,
          "duplicate names are refused");
    CHECK_ERROR("duplicate tensor name 'x'", "save with duplicate names");
    unsigned char *after = slurp(tmp("run/ckpt/step_00000001/model.safetensors"), &after_n);
    CHECK(before && after && before_n == after_n && !memcmp(before, after, before_n), "file untouched");
    tide_free(before);
    tide_free(after);
    tide_tensor_release(w);
    CHECK(tide_remove_tree(tmp("run")) == 0, "cleanup");
}

/* ---- safetensors ----------------------------------------------------------------------------------- */
static void test_spec_example(void)
{
    float v[2] = { 1.0f, -2.5f };
    int64_t shape[1] = { 2 };
    tide_tensor *w = tide_from_bytes(TIDE_F32, 1, shape, TIDE_CPU, v, sizeof v);
    const char *names[1] = { "w" };
    const char *path = tmp("example.safetensors");
    CHECK(w && tide_safetensors_save(path, 1, names, &w, "{\"format\":\"pt\"}") == 0, "save: %s",
          tide_last_error());
    size_t n = 0;
    unsigned char *b = slurp(path, &n);
    const char *json = "{\"__metadata__\":{\"format\":\"pt\"},\"w\":{\"dtype\":\"F32\",\"shape\":[2],"
                       "\"data_offsets\":[0,8]}}";
    CHECK(strlen(json) == 85, "the spec's JSON is 85 bytes");
    CHECK(b && n == 104, "file is 104 bytes, got %zu", n);
    if (b && n == 104) {
        unsigned char want[104];
        memset(want, 0, 8);
        want[0] = 88;
        memcpy(want + 8, json, 85);
        memset(want + 93, ' ', 3);
        memcpy(want + 96, v, 8);
        CHECK(!memcmp(b, want, 104), "byte-exact file");
    }
    tide_free(b);

    tide_safetensors *h = tide_safetensors_open(path);
    CHECK(h != NULL, "open: %s", tide_last_error());
    if (h) {
        CHECK(tide_safetensors_count(h) == 1 && !strcmp(tide_safetensors_name(h, 0), "w"), "count, name");
        CHECK(!strcmp(tide_safetensors_dtype(h, 0), "F32"), "dtype");
        int64_t s[8];
        CHECK(tide_safetensors_shape(h, 0, s) == 1 && s[0] == 2, "shape");
        CHECK(tide_safetensors_find(h, "w") == 0 && tide_safetensors_find(h, "v") == -1, "find");
        CHECK(!strcmp(tide_safetensors_metadata(h), "{\"format\":\"pt\"}"), "metadata");
        tide_tensor *r = tide_safetensors_get(h, 0, TIDE_CPU);
        float got[2] = { 0 };
        CHECK(r && r->dtype == TIDE_F32 && r->ndim == 1 && r->shape[0] == 2 &&
              tide_read_bytes(r, got, 8) == 0 && !memcmp(got, v, 8), "tensor read back");
        tide_tensor_release(r);
        CHECK(tide_safetensors_name(h, 1) == NULL, "name out of range");
        CHECK_ERROR("index 1 out of range", "name out of range");
        CHECK(tide_safetensors_get(h, -1, TIDE_CPU) == NULL, "get out of range");
        tide_safetensors_close(h);
    }
    tide_tensor_release(w);

    /* no metadata and no tensors: "{}" padded to N = 8 */
    CHECK(tide_safetensors_save(path, 0, NULL, NULL, NULL) == 0, "empty save: %s", tide_last_error());
    b = slurp(path, &n);
    CHECK(b && n == 16 && b[0] == 8 && !memcmp(b + 8, "{}      ", 8), "empty file layout");
    tide_free(b);
    h = tide_safetensors_open(path);
    CHECK(h && tide_safetensors_count(h) == 0 && !strcmp(tide_safetensors_metadata(h), "{}"), "empty file");
    tide_safetensors_close(h);

    /* writer argument checks */
    CHECK(tide_safetensors_save(path, 0, NULL, NULL, "[1]") != 0, "metadata must be an object");
    CHECK_ERROR("metadata must be a JSON object", "bad metadata");
    CHECK(tide_safetensors_save(path, 0, NULL, NULL, "{\"a\":1}") != 0, "metadata values are strings");
    CHECK_ERROR("must have a string value", "metadata number");
    CHECK(tide_safetensors_save(path, 0, NULL, NULL, "{\"a\":\"1\",\"b\":\"2\",\"a\":\"3\"}") != 0, "dup meta");
    CHECK_ERROR("metadata key 'a' appears twice", "duplicate metadata key");
    const char *meta_name[1] = { "__metadata__" };
    tide_tensor *one = tide_zeros(TIDE_F32, 0, NULL, TIDE_CPU);
    CHECK(tide_safetensors_save(path, 1, meta_name, &one, NULL) != 0, "__metadata__ is no tensor name");
    tide_tensor_release(one);
}

/* every dtype, scalars, zero-size and 8-d shapes, a non-contiguous view: bitwise round trip */
static void test_roundtrip(void)
{
    enum { NSHAPES = 6, NT = TIDE_DTYPE_COUNT * NSHAPES + 1 };
    static const int nd[NSHAPES] = { 0, 1, 3, 2, 8, 1 };
    static const int64_t shapes[NSHAPES][8] = {
        { 0 }, { 0 }, { 3, 0, 2 }, { 5, 7 }, { 1, 2, 3, 1, 2, 1, 2, 1 }, { 1000 },
    };
    tide_tensor *ts[NT];
    char namebuf[NT][48];
    const char *names[NT];
    unsigned char *want[NT];
    size_t wn[NT];
    int k = 0;
    for (int dt = 0; dt < TIDE_DTYPE_COUNT; dt++)
        for (int s = 0; s < NSHAPES; s++, k++) {
            int64_t numel = 1;
            for (int d = 0; d < nd[s]; d++) numel *= shapes[s][d];
            wn[k] = (size_t)numel * tide_dtype_size(dt);
            want[k] = malloc(wn[k] + 1);
            for (size_t i = 0; i < wn[k]; i++) want[k][i] = (unsigned char)rnd();   /* any bit pattern */
            ts[k] = tide_from_bytes(dt, nd[s], shapes[s], TIDE_CPU, want[k], wn[k]);
            snprintf(namebuf[k], sizeof namebuf[k], "t.%s.%d", tide_dtype_name(dt), s);
            names[k] = namebuf[k];
            CHECK(ts[k] != NULL, "from_bytes %s: %s", names[k], tide_last_error());
        }
    /* a transposed view: the file holds its row-major bytes */
    int64_t s34[2] = { 3, 4 };
    int32_t base[12];
    for (int i = 0; i < 12; i++) base[i] = i * 10 - 7;
    tide_tensor *m = tide_from_bytes(TIDE_I32, 2, s34, TIDE_CPU, base, sizeof base);
    ts[k] = tide_transpose(m, 0, 1);
    tide_tensor_release(m);
    CHECK(ts[k] && !tide_is_contiguous(ts[k]), "transpose gives a non-contiguous view");
    wn[k] = sizeof base;
    want[k] = malloc(wn[k]);
    for (int i = 0; i < 4; i++)
        for (int j = 0; j < 3; j++) ((int32_t *)want[k])[i * 3 + j] = base[j * 4 + i];
    names[k] = "transposed";
    k++;

    int ok = 1;
    for (int i = 0; i < NT; i++) ok &= ts[i] != NULL;
    const char *path = tmp("all.safetensors");
    CHECK(ok && tide_safetensors_save(path, NT, names, ts, "{\"format\":\"pt\",\"note\":\"\\u00e9\\n\"}") == 0,
          "save all dtypes: %s", tide_last_error());
    size_t fn = 0;
    unsigned char *file = slurp(path, &fn);
    CHECK(file && fn >= 8 && (8 + (file[0] | (file[1] << 8) | (file[2] << 16))) % 8 == 0, "8 + N is aligned");
    tide_safetensors *h = tide_safetensors_open(path);
    tide_safetensors *hm = file ? tide_safetensors_open_memory(file, fn, "all (memory)") : NULL;
    CHECK(h && hm, "open: %s", tide_last_error());
    for (int pass = 0; pass < 2 && h && hm; pass++) {
        tide_safetensors *x = pass ? hm : h;
        CHECK(tide_safetensors_count(x) == NT, "count");
        CHECK(!strcmp(tide_safetensors_metadata(x), "{\"format\":\"pt\",\"note\":\"\\u00e9\\n\"}") ||
              !strcmp(tide_safetensors_metadata(x), "{\"format\":\"pt\",\"note\":\"\xc3\xa9\\n\"}"),
              "metadata: %s", tide_safetensors_metadata(x));
        for (int i = 0; i < NT; i++) {
            CHECK(!strcmp(tide_safetensors_name(x, i), names[i]), "order %d", i);
            CHECK(tide_safetensors_find(x, names[i]) == i, "find %s", names[i]);
            tide_tensor *r = tide_safetensors_get(x, i, TIDE_CPU);
            CHECK(r != NULL, "get %s: %s", names[i], tide_last_error());
            if (!r) continue;
            int same = r->dtype == ts[i]->dtype && r->ndim == ts[i]->ndim;
            for (int d = 0; same && d < r->ndim; d++) same = r->shape[d] == ts[i]->shape[d];
            CHECK(same, "%s dtype/shape", names[i]);
            unsigned char *got = malloc(wn[i] + 1);
            CHECK(tide_read_bytes(r, got, wn[i]) == 0 && !memcmp(got, want[i], wn[i]), "%s bytes", names[i]);
            free(got);
            tide_tensor_release(r);
        }
    }
    tide_safetensors_close(h);
    tide_safetensors_close(hm);
    tide_free(file);
    for (int i = 0; i < NT; i++) {
        tide_tensor_release(ts[i]);
        free(want[i]);
    }
}

/* a file with N = strlen(header) (no padding) followed by `data` bytes of 0x11 */
static unsigned char *make_st(const char *header, size_t data, size_t *n)
{
    size_t hn = strlen(header);
    *n = 8 + hn + data;
    unsigned char *b = malloc(*n + 1);
    for (int i = 0; i < 8; i++) b[i] = (unsigned char)((uint64_t)hn >> (8 * i));
    memcpy(b + 8, header, hn);
    memset(b + 8 + hn, 0x11, data);
    return b;
}

static void expect_reject(const char *header, size_t data, const char *part)
{
    size_t n;
    unsigned char *b = make_st(header, data, &n);
    tide_safetensors *h = tide_safetensors_open_memory(b, n, "bad.st");
    CHECK(h == NULL, "accepted a bad file: %s", header);
    if (h) tide_safetensors_close(h);
    else {
        const char *e = tide_last_error();
        CHECK(strstr(e, "safetensors 'bad.st'") && strstr(e, part), "header %s: error '%s' lacks '%s'", header,
              e, part);
    }
    free(b);
}

static void expect_accept(const char *header, size_t data, int count)
{
    size_t n;
    unsigned char *b = make_st(header, data, &n);
    tide_safetensors *h = tide_safetensors_open_memory(b, n, "good.st");
    CHECK(h && tide_safetensors_count(h) == count, "rejected a good file %s: %s", header, tide_last_error());
    tide_safetensors_close(h);
    free(b);
}

static void test_reject(void)
{
    /* prefix rules */
    unsigned char shortf[5] = { 1, 0, 0, 0, 0 };
    CHECK(tide_safetensors_open_memory(shortf, 5, "bad.st") == NULL, "5-byte file");
    CHECK_ERROR("shorter than the 8-byte header length", "short file");
    size_t n;
    unsigned char *b = make_st("{}", 0, &n);
    b[0] = 200;                   /* N = 200 in a 10-byte file */
    CHECK(tide_safetensors_open_memory(b, n, "bad.st") == NULL, "N > file size");
    CHECK_ERROR("header length N = 200 exceeds the file size (10 bytes)", "N > file size");
    b[0] = 0x01; b[1] = 0xE1; b[2] = 0xF5; b[3] = 0x05;   /* 100,000,001 */
    CHECK(tide_safetensors_open_memory(b, n, "bad.st") == NULL, "N > 100 MB");
    CHECK_ERROR("exceeds the 100 MB limit", "N > 100 MB");
    free(b);
    /* the same rules through the file reader */
    unsigned char big[16] = { 0, 0x10, 0, 0, 0, 0, 0, 0, '{', '}' };
    write_raw(tmp("big.st"), big, 16);
    CHECK(tide_safetensors_open(tmp("big.st")) == NULL, "file: N > file size");
    CHECK_ERROR("exceeds the file size (16 bytes)", "file: N > file size");
    big[1] = 0; big[3] = 0x10;
    write_raw(tmp("big.st"), big, 16);
    CHECK(tide_safetensors_open(tmp("big.st")) == NULL, "file: N > 100 MB");
    CHECK_ERROR("100 MB limit", "file: N > 100 MB");
    write_raw(tmp("big.st"), big, 3);
    CHECK(tide_safetensors_open(tmp("big.st")) == NULL, "file: 3 bytes");
    CHECK_ERROR("shorter than the 8-byte", "file: 3 bytes");
    CHECK(tide_safetensors_open(tmp("nothing.st")) == NULL, "missing file");
    CHECK_ERROR("No such file or directory", "missing safetensors");

    /* header text */
    expect_reject("", 0, "does not start with '{'");
    expect_reject(" {}", 0, "does not start with '{'");
    expect_reject("[1,2]", 0, "does not start with '{'");
    expect_reject("{\"w\":", 0, "not valid JSON");
    expect_reject("{\"w\":{}", 0, "not valid JSON");
    expect_reject("{} x", 0, "bytes after its JSON object");
    expect_reject("{}{}", 0, "bytes after its JSON object");
    expect_reject("{\"\xff\":1}", 0, "not valid UTF-8");
    expect_reject("{\"\xc0\xaf\":1}", 0, "not valid UTF-8");          /* overlong '/' */
    expect_reject("{\"\xed\xa0\x80\":1}", 0, "not valid UTF-8");      /* a surrogate */
    expect_accept("{}  \n ", 0, 0);
    {   /* nesting far beyond any real header: refused, not a stack overflow */
        enum { DEPTH = 100000 };
        char *deep = malloc(2 * DEPTH + 16);
        size_t at = 0;
        memcpy(deep, "{\"a\":", 5);
        at = 5;
        for (int i = 0; i < DEPTH; i++) deep[at++] = '[';
        for (int i = 0; i < DEPTH; i++) deep[at++] = ']';
        deep[at++] = '}';
        deep[at] = 0;
        expect_reject(deep, 0, "not valid JSON");
        free(deep);
    }
    {   /* many metadata keys: duplicate detection stays fast */
        enum { KEYS = 200000 };
        char *big = malloc((size_t)KEYS * 24 + 64);
        size_t at = (size_t)sprintf(big, "{\"__metadata__\":{");
        for (int i = 0; i < KEYS; i++) at += (size_t)sprintf(big + at, "%s\"k%d\":\"v\"", i ? "," : "", i);
        at += (size_t)sprintf(big + at, ",\"k77\":\"v\"}}");
        expect_reject(big, 0, "duplicate key 'k77' in __metadata__");
        free(big);
    }
    expect_accept("{\"\xc3\xa9\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]}}", 1, 1);

    /* keys */
    expect_reject("{\"w\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]},"
                  "\"w\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[1,2]}}", 2, "duplicate key 'w'");
    expect_reject("{\"__metadata__\":{},\"__metadata__\":{}}", 0, "duplicate key '__metadata__'");
    expect_reject("{\"w\":{\"dtype\":\"U8\",\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]}}", 1,
                  "duplicate key 'dtype'");
    expect_reject("{\"__metadata__\":{\"a\":\"x\",\"a\":\"y\"}}", 0, "duplicate key 'a' in __metadata__");
    expect_reject("{\"w\":3}", 0, "tensor 'w' must be an object");
    expect_reject("{\"w\":{\"dtype\":\"F32\",\"shape\":[1]}}", 4, "lacks 'data_offsets'");
    expect_accept("{\"w\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1],\"extra\":[]}}", 1, 1);

    /* metadata */
    expect_reject("{\"__metadata__\":{\"step\":3}}", 0, "__metadata__ value 'step' must be a string");
    expect_reject("{\"__metadata__\":[\"a\"]}", 0, "__metadata__ must be an object");
    expect_accept("{\"__metadata__\":{\"format\":\"pt\"}}", 0, 0);

    /* dtype */
    expect_reject("{\"w\":{\"shape\":[2],\"data_offsets\":[0,8]}}", 8, "tensor 'w' lacks 'dtype'");
    expect_reject("{\"w\":{\"dtype\":\"F17\",\"shape\":[2],\"data_offsets\":[0,8]}}", 8, "unknown dtype 'F17'");
    expect_reject("{\"w\":{\"dtype\":\"f32\",\"shape\":[2],\"data_offsets\":[0,8]}}", 8, "unknown dtype 'f32'");
    expect_reject("{\"w\":{\"dtype\":4,\"shape\":[2],\"data_offsets\":[0,8]}}", 8, "dtype must be a string");

    /* shape */
    expect_reject("{\"w\":{\"dtype\":\"F32\",\"shape\":2,\"data_offsets\":[0,8]}}", 8,
                  "shape must be a list of non-negative integers");
    expect_reject("{\"w\":{\"dtype\":\"F32\",\"shape\":[-2],\"data_offsets\":[0,8]}}", 8,
                  "shape must be a list of non-negative integers");
    expect_reject("{\"w\":{\"dtype\":\"F32\",\"shape\":[1.5],\"data_offsets\":[0,8]}}", 8,
                  "shape must be a list of non-negative integers");
    expect_reject("{\"w\":{\"dtype\":\"F32\",\"shape\":[\"2\"],\"data_offsets\":[0,8]}}", 8,
                  "shape must be a list of non-negative integers");
    expect_reject("{\"w\":{\"dtype\":\"F32\",\"shape\":[1e300],\"data_offsets\":[0,8]}}", 8,
                  "shape must be a list of non-negative integers");
    expect_reject("{\"w\":{\"dtype\":\"F32\",\"shape\":[4294967296,4294967296,4],\"data_offsets\":[0,8]}}", 8,
                  "numel overflows");
    expect_reject("{\"w\":{\"dtype\":\"F64\",\"shape\":[4611686018427387904],\"data_offsets\":[0,8]}}", 8,
                  "shape must be a list");                      /* 2^62 is beyond exact JSON integers */
    expect_reject("{\"w\":{\"dtype\":\"F64\",\"shape\":[9007199254740992,4096],\"data_offsets\":[0,8]}}", 8,
                  "numel overflows");

    /* offsets */
    expect_reject("{\"w\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,12]}}", 12,
                  "tensor 'w' data_offsets [0, 12] hold 12 bytes but F32 [2] needs 8");
    expect_reject("{\"w\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0]}}", 8,
                  "data_offsets must be two non-negative integers");
    expect_reject("{\"w\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8,8]}}", 8,
                  "data_offsets must be two non-negative integers");
    expect_reject("{\"w\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[-8,0]}}", 8,
                  "data_offsets must be two non-negative integers");
    expect_reject("{\"w\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[8,0]}}", 8, "end before begin");
    expect_reject("{\"w\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[8,16]}}", 8,
                  "point past the end of the 8-byte data buffer");
    expect_reject("{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},"
                  "\"b\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[8,12]}}", 12,
                  "hole in the data buffer: bytes [4, 8)");
    expect_reject("{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}", 8,
                  "hole in the data buffer: bytes [4, 8) at its end");
    expect_reject("{}", 3, "hole in the data buffer: bytes [0, 3)");
    expect_reject("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
                  "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]}}", 12, "overlap");
    expect_reject("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
                  "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", 8, "overlap");
    expect_reject("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
                  "\"z\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[4,4]}}", 8, "overlap");
    /* tensors may be listed in any order, and zero-size tensors sit between others */
    expect_accept("{\"b\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]},"
                  "\"z\":{\"dtype\":\"I64\",\"shape\":[3,0],\"data_offsets\":[4,4]},"
                  "\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}", 8, 3);

    /* valid files with tensors tide cannot hold: open works, get names the tensor and dtype */
    b = make_st("{\"h\":{\"dtype\":\"F16\",\"shape\":[2],\"data_offsets\":[0,4]},"
                "\"m\":{\"dtype\":\"BOOL\",\"shape\":[],\"data_offsets\":[4,5]},"
                "\"d\":{\"dtype\":\"U8\",\"shape\":[1,1,1,1,1,1,1,1,1],\"data_offsets\":[5,6]},"
                "\"ok\":{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[6,8]}}", 8, &n);
    tide_safetensors *h = tide_safetensors_open_memory(b, n, "mixed.st");
    CHECK(h != NULL, "open mixed: %s", tide_last_error());
    if (h) {
        CHECK(tide_safetensors_get(h, 0, TIDE_CPU) == NULL, "F16 get");
        CHECK_ERROR("tensor 'h' has dtype F16, which tide cannot hold", "F16");
        CHECK(tide_safetensors_get(h, 1, TIDE_CPU) == NULL, "BOOL get");
        CHECK_ERROR("tensor 'm' has dtype BOOL", "BOOL");
        int64_t s[8];
        CHECK(tide_safetensors_shape(h, 2, s) == 9, "9-d shape is reported");
        CHECK(tide_safetensors_get(h, 2, TIDE_CPU) == NULL, "9-d get");
        CHECK_ERROR("tensor 'd' has 9 dimensions", "9-d");
        tide_tensor *t = tide_safetensors_get(h, 3, TIDE_CPU);
        unsigned char got[2] = { 0 };
        CHECK(t && tide_read_bytes(t, got, 2) == 0 && got[0] == 0x11 && got[1] == 0x11, "U8 get");
        tide_tensor_release(t);
        tide_safetensors_close(h);
    }
    free(b);
}

/* random corruption of a valid file: open + get everything must end in success or an error */
static void test_fuzz(void)
{
    int64_t s23[2] = { 2, 3 }, s2[1] = { 2 }, s0[1] = { 0 };
    float f[6] = { 1, 2, 3, 4, 5, 6 };
    int64_t i[2] = { -1, 1LL << 40 };
    uint16_t bf = 0x3F80;
    tide_tensor *ts[4] = {
        tide_from_bytes(TIDE_F32, 2, s23, TIDE_CPU, f, sizeof f),
        tide_from_bytes(TIDE_I64, 1, s2, TIDE_CPU, i, sizeof i),
        tide_from_bytes(TIDE_BF16, 0, NULL, TIDE_CPU, &bf, 2),
        tide_from_bytes(TIDE_U8, 1, s0, TIDE_CPU, f, 0),
    };
    const char *names[4] = { "model.layers.0.w", "idx", "scale", "empty" };
    const char *path = tmp("fuzz.safetensors");
    CHECK(tide_safetensors_save(path, 4, names, ts, "{\"format\":\"pt\",\"tide.step\":\"7\"}") == 0, "save");
    for (int k = 0; k < 4; k++) tide_tensor_release(ts[k]);
    size_t n = 0;
    unsigned char *orig = slurp(path, &n);
    if (!orig) { CHECK(0, "read fuzz base"); return; }
    size_t hn = (size_t)orig[0] | ((size_t)orig[1] << 8);
    unsigned char *m = malloc(n + 64);
    static const char jchars[] = "{}[]\":,0123456789-.e \\ufF";
    int ok = 0, err = 0, got_ok = 0;
    const int iters = TIDE_IO_FUZZ_ITERS;
    double t0 = (double)clock() / CLOCKS_PER_SEC;
    for (int it = 0; it < iters; it++) {
        size_t len = n;
        memcpy(m, orig, n);
        int kind = (int)(rnd() % 7);
        int edits = 1 + (int)(rnd() % 4);
        for (int e = 0; e < edits; e++) {
            if (len == 0) break;
            size_t at = 8 + (size_t)(rnd() % (hn + 8));      /* mostly the header */
            if (at >= len) at = (size_t)(rnd() % len);
            switch (kind) {
            case 0: m[at] ^= (unsigned char)(1u << (rnd() % 8)); break;
            case 1: m[at] = (unsigned char)rnd(); break;
            case 2: m[at] = (unsigned char)jchars[rnd() % (sizeof jchars - 1)]; break;
            case 3: len = (size_t)(rnd() % (len + 1)); break;
            case 4: {                                        /* header length edits */
                uint64_t v;
                switch (rnd() % 4) {
                case 0: v = hn + (rnd() % 17) - 8; break;
                case 1: v = rnd() % (n + 16); break;
                case 2: v = rnd(); break;
                default: v = (uint64_t)hn ^ (1ull << (rnd() % 64)); break;
                }
                for (int q = 0; q < 8; q++) m[q] = (unsigned char)(v >> (8 * q));
                break;
            }
            case 5: {                                        /* rewrite a digit: offsets and shapes */
                size_t p = 8 + (size_t)(rnd() % (hn ? hn : 1));
                for (size_t q = 0; q < hn && p < len; q++, p = 8 + (p - 8 + 1) % hn)
                    if (m[p] >= '0' && m[p] <= '9') { m[p] = (unsigned char)('0' + rnd() % 10); break; }
                break;
            }
            default: {                                       /* insert or delete a byte inside the header */
                if (len < 10) break;
                size_t p = 8 + (size_t)(rnd() % (len - 8));
                if (rnd() % 2) { memmove(m + p, m + p + 1, len - p - 1); len--; }
                else { memmove(m + p + 1, m + p, len - p); m[p] = (unsigned char)jchars[rnd() % 8]; len++; }
                break;
            }
            }
        }
        tide_safetensors *h = tide_safetensors_open_memory(m, len, "fuzz");
        if (!h) { err++; continue; }
        ok++;
        int c = tide_safetensors_count(h);
        (void)tide_safetensors_metadata(h);
        for (int j = 0; j < c; j++) {
            int64_t sh[8];
            (void)tide_safetensors_shape(h, j, sh);
            (void)tide_safetensors_find(h, tide_safetensors_name(h, j));
            tide_tensor *t = tide_safetensors_get(h, j, TIDE_CPU);
            if (t) got_ok++;
            tide_tensor_release(t);
        }
        tide_safetensors_close(h);
    }
    double t1 = (double)clock() / CLOCKS_PER_SEC;
    printf("fuzz: %d mutations, %d opened, %d rejected, %d tensors read, %.1f s\n", iters, ok, err, got_ok, t1 - t0);
    CHECK(ok + err == iters && ok > 0 && err > 0, "both outcomes occur");
    /* the file path (pread) on a few hundred mutants too */
    for (int it = 0; it < 300; it++) {
        memcpy(m, orig, n);
        size_t len = n;
        if (it % 3 == 0) len = (size_t)(rnd() % (n + 1));
        else m[8 + rnd() % hn] = (unsigned char)jchars[rnd() % (sizeof jchars - 1)];
        write_raw(path, m, len);
        tide_safetensors *h = tide_safetensors_open(path);
        for (int j = 0; h && j < tide_safetensors_count(h); j++) tide_tensor_release(tide_safetensors_get(h, j, 0));
        tide_safetensors_close(h);
    }
    CHECK(1, "file-path mutants");
    free(m);
    tide_free(orig);
}

/* ---- token shards ---------------------------------------------------------------------------------- */
static int tensor_equals_u32(tide_tensor *t, const uint32_t *v, int64_t n)
{
    if (!t || t->dtype != TIDE_I32 || t->ndim != 1 || t->shape[0] != n) return 0;
    int32_t *got = malloc((size_t)(n ? n : 1) * 4);
    int same = tide_read_bytes(t, got, (size_t)n * 4) == 0;
    for (int64_t i = 0; same && i < n; i++) same = (uint32_t)got[i] == v[i];
    free(got);
    return same;
}

static void test_shards(void)
{
    enum { N = 100000 };
    uint32_t *tok = malloc(N * sizeof *tok);
    for (int i = 0; i < N; i++) tok[i] = (uint32_t)(rnd() % 50257);
    tok[0] = 50256;
    const char *p16 = tmp("gpt2.bin"), *p32 = tmp("llama.bin");
    CHECK(tide_shard_write(p16, tok, N, 2) == 0, "write uint16: %s", tide_last_error());
    CHECK(tide_file_size(p16) == 1024 + 2 * N, "uint16 file size");
    size_t n;
    unsigned char *b = slurp(p16, &n);
    int32_t hdr[3];
    if (b) memcpy(hdr, b, 12);
    CHECK(b && hdr[0] == 20240520 && hdr[1] == 1 && hdr[2] == N, "uint16 header");
    int zero = 1;
    for (size_t i = 12; b && i < 1024; i++) zero &= b[i] == 0;
    CHECK(zero, "header rest is zero");
    uint16_t t5;
    if (b) memcpy(&t5, b + 1024 + 5 * 2, 2);
    CHECK(b && t5 == tok[5], "token 5 stored as uint16 little-endian");
    tide_free(b);
    CHECK(tide_shard_count(p16) == N, "count");
    tide_tensor *t = tide_shard_read(p16, 50257);
    CHECK(tensor_equals_u32(t, tok, N), "uint16 round trip: %s", tide_last_error());
    tide_tensor_release(t);
    t = tide_shard_read_range(p16, 500, 1000, 50257);
    CHECK(tensor_equals_u32(t, tok + 500, 1000), "uint16 range");
    tide_tensor_release(t);
    CHECK(tide_shard_read_range(p16, N - 10, 11, 50257) == NULL, "range past the end");
    CHECK_ERROR("outside its 100000 tokens", "range");

    /* uint32 with Kimi's vocabulary size */
    for (int i = 0; i < N; i++) tok[i] = (uint32_t)(rnd() % 163840);
    tok[7] = 163839;
    CHECK(tide_shard_write(p32, tok, N, 4) == 0, "write uint32");
    CHECK(tide_file_size(p32) == 1024 + 4 * N, "uint32 file size");
    b = slurp(p32, &n);
    if (b) memcpy(hdr, b, 12);
    CHECK(b && hdr[0] == 20240801 && hdr[1] == 7 && hdr[2] == N, "uint32 header");
    tide_free(b);
    t = tide_shard_read(p32, 163840);
    CHECK(tensor_equals_u32(t, tok, N), "uint32 round trip: %s", tide_last_error());
    tide_tensor_release(t);

    /* token >= V: the error names the index and the token */
    CHECK(tide_shard_read(p32, 163839) == NULL, "token >= V");
    CHECK_ERROR("token 163839 at index 7", "token >= V");
    CHECK_ERROR("vocabulary size 163839", "token >= V");
    t = tide_shard_read(p32, 0);
    CHECK(t != NULL, "vocab 0 skips the check");
    tide_tensor_release(t);
    CHECK(tide_shard_write(p16, tok, N, 2) != 0, "uint16 refuses a large token");
    CHECK_ERROR("does not fit uint16", "width 2");
    CHECK(tide_shard_count(p16) == N, "the refused write left the old shard");
    CHECK(tide_shard_write(p16, tok, 10, 3) != 0, "width 3");

    /* wrong sizes, magics, versions */
    b = slurp(p16, &n);
    write_raw(tmp("long.bin"), b, n - 1);
    CHECK(tide_shard_read(tmp("long.bin"), 50257) == NULL, "truncated shard");
    CHECK_ERROR("the header says 100000 tokens of 2 bytes (a 201024-byte file) but the file is 201023 bytes",
                "truncated");
    unsigned char *c = malloc(n + 2);
    memcpy(c, b, n);
    c[n] = c[n + 1] = 0;
    write_raw(tmp("long.bin"), c, n + 2);
    CHECK(tide_shard_count(tmp("long.bin")) == -1, "shard with an extra token");
    CHECK_ERROR("but the file is 201026 bytes", "extra");
    write_raw(tmp("long.bin"), c, 100);
    CHECK(tide_shard_count(tmp("long.bin")) == -1, "shorter than the header");
    CHECK_ERROR("shorter than the 1024-byte header", "short");
    int32_t v = 20240522;
    memcpy(c, &v, 4);
    write_raw(tmp("long.bin"), c, n);
    CHECK(tide_shard_count(tmp("long.bin")) == -1, "eval magic");
    CHECK_ERROR("llm.c eval file", "eval");
    v = 12345;
    memcpy(c, &v, 4);
    write_raw(tmp("long.bin"), c, n);
    CHECK(tide_shard_count(tmp("long.bin")) == -1, "bad magic");
    CHECK_ERROR("magic 12345 is not a token shard's", "magic");
    v = 20240520;
    memcpy(c, &v, 4);
    v = 7;
    memcpy(c + 4, &v, 4);
    write_raw(tmp("long.bin"), c, n);
    CHECK(tide_shard_count(tmp("long.bin")) == -1, "bad version");
    CHECK_ERROR("magic 20240520 needs version 1, found 7", "version");
    v = -5;
    memcpy(c + 4, (int32_t[]){ 1 }, 4);
    memcpy(c + 8, &v, 4);
    write_raw(tmp("long.bin"), c, n);
    CHECK(tide_shard_count(tmp("long.bin")) == -1, "negative count");
    free(c);
    tide_free(b);
    CHECK(tide_shard_count(tmp("none.bin")) == -1, "missing shard");
    CHECK_ERROR("No such file or directory", "missing shard");

    /* empty shard, tensor writer, raw tokens */
    CHECK(tide_shard_write(tmp("empty.bin"), NULL, 0, 2) == 0 && tide_shard_count(tmp("empty.bin")) == 0,
          "empty shard");
    t = tide_shard_read(tmp("empty.bin"), 10);
    CHECK(t && t->ndim == 1 && t->shape[0] == 0, "empty shard reads as [0]");
    tide_tensor_release(t);
    int64_t ids[5] = { 256, 0, 65, 300, 256 }, s5[1] = { 5 };
    tide_tensor *it = tide_from_bytes(TIDE_I64, 1, s5, TIDE_CPU, ids, sizeof ids);
    CHECK(tide_shard_write_tensor(tmp("t.bin"), it, 2) == 0, "write from an i64 tensor: %s", tide_last_error());
    uint32_t idu[5] = { 256, 0, 65, 300, 256 };
    t = tide_shard_read(tmp("t.bin"), 320);
    CHECK(tensor_equals_u32(t, idu, 5), "i64 tensor round trip");
    tide_tensor_release(t);
    ids[2] = -1;
    tide_tensor *neg = tide_from_bytes(TIDE_I64, 1, s5, TIDE_CPU, ids, sizeof ids);
    CHECK(tide_shard_write_tensor(tmp("t.bin"), neg, 2) != 0, "negative token");
    CHECK_ERROR("token -1 at index 2", "negative");
    tide_tensor_release(neg);
    tide_tensor_release(it);
    uint16_t raw[4] = { 1, 2, 3, 60000 };
    write_raw(tmp("raw.bin"), raw, sizeof raw);
    uint32_t rawu[4] = { 1, 2, 3, 60000 };
    t = tide_raw_tokens_read(tmp("raw.bin"), 2, 65536);
    CHECK(tensor_equals_u32(t, rawu, 4), "raw uint16 tokens");
    tide_tensor_release(t);
    CHECK(tide_raw_tokens_read(tmp("raw.bin"), 4, 0) == NULL, "uint32 view: 60000 << 16 | 3 exceeds i32");
    CHECK_ERROR("token 3932160003 at index 1 does not fit i32", "raw width 4");
    write_raw(tmp("raw.bin"), raw, 7);
    CHECK(tide_raw_tokens_read(tmp("raw.bin"), 2, 65536) == NULL, "odd raw size");
    CHECK_ERROR("not a multiple of the 2-byte token width", "raw size");
    free(tok);
}

/* ---- readers open regular files only ------------------------------------------------------------------ */
/* a FIFO, /dev/zero and a directory where each reader expects a file: one line naming the file and what it is,
   at once (alarm: a reader blocking in open() on the FIFO kills the test instead of hanging it) */
static void test_not_regular(void)
{
    char fifo[512], dir[512], want[700];
    snprintf(fifo, sizeof fifo, "%s", tmp("fifo"));
    snprintf(dir, sizeof dir, "%s", tmp("dir.safetensors"));
    CHECK(mkfifo(fifo, 0600) == 0, "mkfifo");
    CHECK(tide_mkdir_p(dir) == 0, "mkdir");
    alarm(10);
    size_t n = 0;
    int64_t size = -1;
    CHECK(tide_open_regular(fifo, "shard", &size) == -1, "open_regular refuses a FIFO");
    snprintf(want, sizeof want, "shard '%s' is a FIFO (named pipe), not a regular file", fifo);
    CHECK_ERROR(want, "open_regular of a FIFO");
    CHECK(tide_read_file(fifo, &n, 0) == NULL, "read_file refuses a FIFO");
    snprintf(want, sizeof want, "file '%s' is a FIFO (named pipe), not a regular file", fifo);
    CHECK_ERROR(want, "read_file of a FIFO");
    CHECK(tide_text_read_bytes(fifo) == NULL, "text_read_bytes refuses a FIFO");
    CHECK_ERROR("is a FIFO (named pipe)", "text_read_bytes of a FIFO");
    CHECK(tide_safetensors_open(fifo) == NULL, "safetensors_open refuses a FIFO");
    snprintf(want, sizeof want, "safetensors file '%s' is a FIFO (named pipe), not a regular file", fifo);
    CHECK_ERROR(want, "safetensors_open of a FIFO");
    CHECK(tide_shard_count(fifo) == -1 && tide_shard_read(fifo, 0) == NULL, "shards refuse a FIFO");
    CHECK_ERROR("is a FIFO (named pipe)", "shard_read of a FIFO");
    CHECK(tide_raw_tokens_read(fifo, 2, 0) == NULL, "raw tokens refuse a FIFO");
    CHECK_ERROR("is a FIFO (named pipe)", "raw_tokens_read of a FIFO");
    /* a FIFO where an atomic write puts its temporary file */
    char out[512], out_tmp[520];
    snprintf(out, sizeof out, "%s", tmp("written"));
    snprintf(out_tmp, sizeof out_tmp, "%s.tmp", out);
    CHECK(mkfifo(out_tmp, 0600) == 0, "mkfifo");
    CHECK(tide_file_write_atomic(out, "x", 1) != 0, "an atomic write refuses a FIFO as its temporary file");
    snprintf(want, sizeof want, "temporary file '%s' is a FIFO (named pipe), not a regular file", out_tmp);
    CHECK_ERROR(want, "atomic write over a FIFO");
    alarm(0);

    if (tide_path_exists("/dev/zero")) {
        CHECK(tide_read_file("/dev/zero", &n, 0) == NULL, "read_file refuses /dev/zero");
        CHECK_ERROR("file '/dev/zero' is a character device, not a regular file", "read_file of /dev/zero");
        CHECK(tide_text_read_bytes("/dev/zero") == NULL, "text_read_bytes refuses /dev/zero");
        CHECK(tide_shard_read("/dev/zero", 0) == NULL, "shard_read refuses /dev/zero");
        CHECK_ERROR("shard '/dev/zero' is a character device", "shard_read of /dev/zero");
        CHECK(tide_safetensors_open("/dev/zero") == NULL, "safetensors_open refuses /dev/zero");
        CHECK_ERROR("is a character device", "safetensors_open of /dev/zero");
    }
    CHECK(tide_safetensors_open(dir) == NULL, "safetensors_open refuses a directory");
    snprintf(want, sizeof want, "safetensors file '%s' is a directory, not a regular file", dir);
    CHECK_ERROR(want, "safetensors_open of a directory");
    CHECK(tide_shard_read(dir, 0) == NULL, "shard_read refuses a directory");
    CHECK_ERROR("is a directory, not a regular file", "shard_read of a directory");
    /* a regular file still opens, with its size */
    write_raw(tmp("plain"), "12345", 5);
    int fd = tide_open_regular(tmp("plain"), "file", &size);
    CHECK(fd >= 0 && size == 5, "open_regular of a regular file: fd %d size %lld", fd, (long long)size);
    if (fd >= 0) {
        char b[8];
        CHECK(read(fd, b, 8) == 5 && !memcmp(b, "12345", 5), "reads the file");
        close(fd);
    }
    CHECK(tide_open_regular(tmp("missing"), "file", &size) == -1, "missing file");
    CHECK_ERROR("No such file or directory", "open_regular of a missing file");
}

int main(void)
{
    snprintf(g_dir, sizeof g_dir, "/tmp/tide-io-XXXXXX");
    if (!mkdtemp(g_dir)) { perror("mkdtemp"); return 2; }
    test_files();
    test_atomic();
    test_spec_example();
    test_roundtrip();
    test_reject();
    test_shards();
    test_not_regular();
    test_fuzz();
    int64_t live = tide_live_tensors();
    CHECK(live == 0, "live tensors at the end: %lld", (long long)live);
    if (tide_remove_tree(g_dir) != 0) printf("cleanup: %s\n", tide_last_error());
    printf("%d passed, %d failed\n", g_pass, g_fail);
    return g_fail != 0;
}
