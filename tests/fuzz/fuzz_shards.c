/*
 * fuzz_shards.c — the token-shard readers (engine/io/shards.c, formats.md §3) on hostile files.
 *
 * The input is a whole file, read as an llm.c shard (tide_shard_count, tide_shard_read, tide_shard_read_range)
 * and as headerless uint16 / uint32 tokens (tide_raw_tokens_read). The readers must agree with each other and
 * with the bytes: the count is the header's, every token is the file's little-endian word at its place and
 * below the vocabulary size asked for, and a range is the same slice of the full read.
 */
#include "fuzz.h"

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    fuzz_init_engine();
    return 0;
}

static uint32_t word(const uint8_t *p, int width)
{
    return width == 2 ? (uint32_t)p[0] | (uint32_t)p[1] << 8
                      : (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

/* t holds count tokens read from data + base; checks each against the bytes */
static void check_tokens(const tide_tensor *t, const uint8_t *data, size_t base, int width, int64_t count,
                         int64_t vocab, const char *what)
{
    FUZZ_CHECK(t->dtype == TIDE_I32 && t->ndim == 1 && t->shape[0] == count, "%s: dtype %d, shape [%lld]", what,
               t->dtype, (long long)t->shape[0]);
    size_t n = 0;
    int32_t *v = (int32_t *)fuzz_tensor_bytes(t, &n);
    for (int64_t i = 0; i < count; i++) {
        uint32_t w = word(data + base + (size_t)i * (size_t)width, width);
        FUZZ_CHECK((uint32_t)v[i] == w, "%s: token %lld is %d, the file holds %u", what, (long long)i, v[i], w);
        FUZZ_CHECK(vocab == 0 || v[i] < vocab, "%s: token %d passed vocab %lld", what, v[i], (long long)vocab);
    }
    free(v);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    const char *path = fuzz_path(0, "in.bin");
    fuzz_write(path, data, size);
    /* the vocabulary sizes asked for: none, GPT-2's, and one the last input byte picks */
    int64_t vocabs[3] = { 0, 50257, size ? 1 + (int64_t)data[size - 1] * 257 : 1 };

    int64_t count = tide_shard_count(path);
    int width = 0;
    if (count >= 0) {
        FUZZ_CHECK(size >= 1024, "a %zu-byte file has a shard header", size);
        int32_t magic;
        memcpy(&magic, data, 4);
        width = magic == 20240520 ? 2 : 4;
        FUZZ_CHECK((uint64_t)size == 1024 + (uint64_t)count * (uint64_t)width, "count %lld for %zu bytes",
                   (long long)count, size);
    } else {
        FUZZ_CHECK(tide_last_error()[0], "a failed count sets an error");
    }
    for (int k = 0; k < 3; k++) {
        tide_tensor *t = tide_shard_read(path, vocabs[k]);
        FUZZ_CHECK(!t || count >= 0, "shard_read succeeded where shard_count failed");
        if (t) check_tokens(t, data, 1024, width, count, vocabs[k], "shard_read");
        if (count >= 0 && vocabs[k] == 0) FUZZ_CHECK(t || tide_last_error()[0], "shard_read error");
        tide_tensor_release(t);
    }
    if (count >= 0) {
        /* a range picked by the first header padding bytes (they are free for the fuzzer to vary) */
        int64_t start = (int64_t)(data[12] | data[13] << 8) % (count + 2);
        int64_t len = (int64_t)(data[14] | data[15] << 8) % (count + 2);
        if (data[16] & 1) start = -start;
        tide_tensor *r = tide_shard_read_range(path, start, len, 0);
        int inside = start >= 0 && len >= 0 && start + len <= count;
        tide_tensor *full = tide_shard_read(path, 0);
        FUZZ_CHECK(!r || inside, "range [%lld, +%lld) of %lld tokens accepted", (long long)start, (long long)len,
                   (long long)count);
        if (r) check_tokens(r, data, 1024 + (size_t)start * (size_t)width, width, len, 0, "shard_read_range");
        FUZZ_CHECK(!inside || r || !full, "an in-range read failed where the full read did not: %s",
                   tide_last_error());
        tide_tensor_release(r);
        tide_tensor_release(full);
    }
    for (int w = 2; w <= 4; w += 2)
        for (int k = 0; k < 3; k++) {
            tide_tensor *t = tide_raw_tokens_read(path, w, vocabs[k]);
            FUZZ_CHECK(!t || size % (size_t)w == 0, "raw width %d accepted %zu bytes", w, size);
            if (t) check_tokens(t, data, 0, w, (int64_t)(size / (size_t)w), vocabs[k], "raw_tokens_read");
            tide_tensor_release(t);
        }
    FUZZ_CHECK(tide_raw_tokens_read(path, 3, 0) == NULL, "width 3 is an error");
    return 0;
}
