/*
 * shards.c — token shards in llm.c's layout (formats.md §3):
 *
 *   int32 LE header[256] = { magic, version, token count, 0, ... }   then count tokens
 *   GPT-2:   magic 20240520, version 1, uint16 tokens
 *   Llama-3: magic 20240801, version 7, uint32 tokens
 *
 * Readers check the magic, the version, that the file size is exactly 1024 + count x width, and that
 * every token is below the vocabulary size; errors name the file, and the token index and value.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include "internal.h"

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "tide's file formats assume a little-endian host"
#endif

enum {
    SHARD_HEADER_INTS = 256,
    SHARD_HEADER_BYTES = SHARD_HEADER_INTS * 4,
    SHARD_MAGIC_U16 = 20240520, SHARD_VERSION_U16 = 1,
    SHARD_MAGIC_U32 = 20240801, SHARD_VERSION_U32 = 7,
    SHARD_MAGIC_EVAL = 20240522,                 /* llm.c eval files: a different layout */
    SHARD_CHUNK = 1 << 16,                       /* tokens converted per step */
};

/* ---- writing -------------------------------------------------------------------------------------- */
int tide_shard_write(const char *path, const uint32_t *tokens, int64_t n, int width)
{
    if (!path || !path[0]) return tide_set_error("shard_write: the path is %s", path ? "empty" : "NULL");
    if (width != 2 && width != 4)
        return tide_set_error("shard_write '%s': width must be 2 (uint16) or 4 (uint32), got %d", path, width);
    if (n < 0 || n > INT32_MAX)
        return tide_set_error("shard_write '%s': %lld tokens; a shard holds 0 to %d", path, (long long)n,
                              INT32_MAX);
    if (n > 0 && !tokens) return tide_set_error("shard_write '%s': tokens is NULL", path);
    if (width == 2)
        for (int64_t i = 0; i < n; i++)
            if (tokens[i] > 0xFFFF)
                return tide_set_error("shard_write '%s': token %u at index %lld does not fit uint16 (width 2); "
                                      "use width 4", path, (unsigned)tokens[i], (long long)i);
    int32_t header[SHARD_HEADER_INTS] = { 0 };
    header[0] = width == 2 ? SHARD_MAGIC_U16 : SHARD_MAGIC_U32;
    header[1] = width == 2 ? SHARD_VERSION_U16 : SHARD_VERSION_U32;
    header[2] = (int32_t)n;
    tide_atomic_file *f = tide_atomic_open(path);
    if (!f) return -1;
    int rc = tide_atomic_write(f, header, sizeof header);
    if (width == 4) {
        if (!rc) rc = tide_atomic_write(f, tokens, (size_t)n * 4);
    } else {
        uint16_t *buf = malloc(SHARD_CHUNK * sizeof *buf);
        if (!buf && !rc) rc = tide_set_error("shard_write '%s': out of memory", path);
        for (int64_t at = 0; at < n && !rc; at += SHARD_CHUNK) {
            int64_t k = n - at < SHARD_CHUNK ? n - at : SHARD_CHUNK;
            for (int64_t i = 0; i < k; i++) buf[i] = (uint16_t)tokens[at + i];
            rc = tide_atomic_write(f, buf, (size_t)k * 2);
        }
        free(buf);
    }
    if (rc) {
        tide_atomic_abort(f);
        return rc;
    }
    return tide_atomic_commit(f);
}

int tide_shard_write_tensor(const char *path, const tide_tensor *tokens, int width)
{
    const char *p = path ? path : "(null)";
    if (!tokens) return tide_set_error("shard_write '%s': tokens is NULL", p);
    if (tokens->ndim != 1 || (tokens->dtype != TIDE_I32 && tokens->dtype != TIDE_I64))
        return tide_set_error("shard_write '%s': tokens must be a 1-D i32 or i64 tensor, got %s with %d dims",
                              p, tide_dtype_name(tokens->dtype) ? tide_dtype_name(tokens->dtype) : "?",
                              tokens->ndim);
    int64_t n = tokens->numel;
    size_t es = tide_dtype_size(tokens->dtype);
    void *raw = malloc(n ? (size_t)n * es : 1);
    uint32_t *u = malloc(n ? (size_t)n * 4 : 1);
    int rc = 0;
    if (!raw || !u) rc = tide_set_error("shard_write '%s': out of memory for %lld tokens", p, (long long)n);
    if (!rc) rc = tide_read_bytes(tokens, raw, (size_t)n * es);
    for (int64_t i = 0; i < n && !rc; i++) {
        int64_t v = tokens->dtype == TIDE_I32 ? ((const int32_t *)raw)[i] : ((const int64_t *)raw)[i];
        if (v < 0 || v > (int64_t)UINT32_MAX)
            rc = tide_set_error("shard_write '%s': token %lld at index %lld is not a uint32", p, (long long)v,
                                (long long)i);
        else
            u[i] = (uint32_t)v;
    }
    if (!rc) rc = tide_shard_write(path, u, n, width);
    free(raw);
    free(u);
    return rc;
}

/* ---- reading -------------------------------------------------------------------------------------- */
static int pread_all(int fd, void *buf, size_t n, uint64_t off)
{
    char *p = buf;
    while (n > 0) {
        ssize_t r = pread(fd, p, n, (off_t)off);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) return -1;
        if (r == 0) { errno = EIO; return 1; }
        p += r;
        n -= (size_t)r;
        off += (uint64_t)r;
    }
    return 0;
}

static int open_regular(const char *path, const char *what, int *fd, uint64_t *size)
{
    int64_t n = 0;
    *fd = tide_open_regular(path, what, &n);
    if (*fd < 0) return -1;
    *size = (uint64_t)n;
    return 0;
}

/* opens a shard and validates its header against the file size; fd stays open on success */
static int shard_open(const char *path, int *fd, int *width, int64_t *count)
{
    uint64_t size = 0;
    if (open_regular(path, "shard", fd, &size)) return -1;
    int32_t h[3];
    int rc = 0;
    if (size < SHARD_HEADER_BYTES) {
        rc = tide_set_error("shard '%s': the file is %llu bytes, shorter than the %d-byte header", path,
                            (unsigned long long)size, SHARD_HEADER_BYTES);
    } else if (pread_all(*fd, h, sizeof h, 0) != 0) {
        rc = tide_set_error("cannot read '%s': %s", path, strerror(errno));
    } else if (h[0] == SHARD_MAGIC_EVAL) {
        rc = tide_set_error("shard '%s': magic %d marks an llm.c eval file, not a token shard", path, h[0]);
    } else if (h[0] != SHARD_MAGIC_U16 && h[0] != SHARD_MAGIC_U32) {
        rc = tide_set_error("shard '%s': magic %d is not a token shard's (%d for uint16 GPT-2 shards, %d for "
                            "uint32 Llama-3 shards)", path, h[0], SHARD_MAGIC_U16, SHARD_MAGIC_U32);
    } else {
        int want = h[0] == SHARD_MAGIC_U16 ? SHARD_VERSION_U16 : SHARD_VERSION_U32;
        *width = h[0] == SHARD_MAGIC_U16 ? 2 : 4;
        if (h[1] != want)
            rc = tide_set_error("shard '%s': magic %d needs version %d, found %d", path, h[0], want, h[1]);
        else if (h[2] < 0)
            rc = tide_set_error("shard '%s': negative token count %d in the header", path, h[2]);
        else if (size != SHARD_HEADER_BYTES + (uint64_t)h[2] * (uint64_t)*width)
            rc = tide_set_error("shard '%s': the header says %d tokens of %d bytes (a %llu-byte file) but the "
                                "file is %llu bytes", path, h[2], *width,
                                (unsigned long long)(SHARD_HEADER_BYTES + (uint64_t)h[2] * (uint64_t)*width),
                                (unsigned long long)size);
        *count = h[2];
    }
    if (rc) {
        close(*fd);
        *fd = -1;
    }
    return rc;
}

/* tokens [start, start + count) of width bytes each, from byte `base`, as an i32 tensor */
static tide_tensor *read_tokens(const char *what, const char *path, int fd, uint64_t base, int width, int64_t start,
                                int64_t count, int64_t vocab_size)
{
    int32_t *out = malloc(count ? (size_t)count * 4 : 4);
    unsigned char *chunk = malloc((size_t)SHARD_CHUNK * (size_t)width);
    if (!out || !chunk) {
        free(out);
        free(chunk);
        tide_set_error("%s '%s': out of memory for %lld tokens", what, path, (long long)count);
        return NULL;
    }
    int rc = 0;
    for (int64_t at = 0; at < count && !rc; at += SHARD_CHUNK) {
        int64_t k = count - at < SHARD_CHUNK ? count - at : SHARD_CHUNK;
        if (pread_all(fd, chunk, (size_t)k * (size_t)width, base + (uint64_t)(start + at) * (uint64_t)width)) {
            rc = tide_set_error("cannot read '%s': %s", path, strerror(errno));
            break;
        }
        for (int64_t i = 0; i < k; i++) {
            uint32_t v;
            if (width == 2) {
                uint16_t s;
                memcpy(&s, chunk + i * 2, 2);
                v = s;
            } else {
                memcpy(&v, chunk + i * 4, 4);
            }
            if ((vocab_size > 0 && (int64_t)v >= vocab_size) || v > INT32_MAX) {
                int64_t idx = start + at + i;
                rc = vocab_size > 0
                   ? tide_set_error("%s '%s': token %u at index %lld (byte %llu) is >= the vocabulary size "
                                    "%lld", what, path, v, (long long)idx,
                                    (unsigned long long)(base + (uint64_t)idx * (uint64_t)width),
                                    (long long)vocab_size)
                   : tide_set_error("%s '%s': token %u at index %lld does not fit i32", what, path, v,
                                    (long long)idx);
                break;
            }
            out[at + i] = (int32_t)v;
        }
    }
    free(chunk);
    tide_tensor *t = NULL;
    if (!rc) {
        int64_t shape[1] = { count };
        t = tide_from_bytes(TIDE_I32, 1, shape, TIDE_CPU, out, (size_t)count * 4);
    }
    free(out);
    return t;
}

int64_t tide_shard_count(const char *path)
{
    int fd, width;
    int64_t count;
    if (shard_open(path, &fd, &width, &count)) return -1;
    close(fd);
    return count;
}

tide_tensor *tide_shard_read_range(const char *path, int64_t start, int64_t count, int64_t vocab_size)
{
    if (vocab_size < 0) {
        tide_set_error("shard '%s': vocab_size %lld is negative", path ? path : "(null)", (long long)vocab_size);
        return NULL;
    }
    int fd, width;
    int64_t total;
    if (shard_open(path, &fd, &width, &total)) return NULL;
    tide_tensor *t = NULL;
    if (start < 0 || count < 0 || start > total || count > total - start)
        tide_set_error("shard '%s': range [%lld, %lld + %lld) is outside its %lld tokens", path, (long long)start,
                       (long long)start, (long long)count, (long long)total);
    else
        t = read_tokens("shard", path, fd, SHARD_HEADER_BYTES, width, start, count, vocab_size);
    close(fd);
    return t;
}

tide_tensor *tide_shard_read(const char *path, int64_t vocab_size)
{
    if (vocab_size < 0) {
        tide_set_error("shard '%s': vocab_size %lld is negative", path ? path : "(null)", (long long)vocab_size);
        return NULL;
    }
    int fd, width;
    int64_t total;
    if (shard_open(path, &fd, &width, &total)) return NULL;
    tide_tensor *t = read_tokens("shard", path, fd, SHARD_HEADER_BYTES, width, 0, total, vocab_size);
    close(fd);
    return t;
}

tide_tensor *tide_raw_tokens_read(const char *path, int width, int64_t vocab_size)
{
    if (width != 2 && width != 4) {
        tide_set_error("raw tokens '%s': width must be 2 or 4, got %d", path ? path : "(null)", width);
        return NULL;
    }
    if (vocab_size < 0) {
        tide_set_error("raw tokens '%s': vocab_size %lld is negative", path ? path : "(null)",
                       (long long)vocab_size);
        return NULL;
    }
    int fd = -1;
    uint64_t size = 0;
    if (open_regular(path, "raw tokens", &fd, &size)) return NULL;
    tide_tensor *t = NULL;
    if (size % (uint64_t)width != 0)
        tide_set_error("raw tokens '%s': the file is %llu bytes, not a multiple of the %d-byte token width",
                       path, (unsigned long long)size, width);
    else if (size / (uint64_t)width > (uint64_t)INT64_MAX / 4)
        tide_set_error("raw tokens '%s': too many tokens", path);
    else
        t = read_tokens("raw tokens", path, fd, 0, width, 0, (int64_t)(size / (uint64_t)width), vocab_size);
    close(fd);
    return t;
}
