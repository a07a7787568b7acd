/*
 * fuzz_text.c — the text reader (engine/io/file.c: tide_read_file, tide_text_read_bytes) on hostile files.
 *
 * The input is a file's bytes. As a regular file, tide_read_file must return exactly those bytes (NUL-terminated),
 * refuse it under a byte limit one below its size and accept it at its size; tide_text_read_bytes must give the
 * same bytes as a u8 tensor, and an error for an empty file. The same bytes offered through a pipe (/dev/fd/N,
 * what a FIFO looks like) must be refused with a one-line error that names the path.
 */
#include "fuzz.h"

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    fuzz_init_engine();
    return 0;
}

static void check_read(const char *path, const uint8_t *data, size_t size, size_t limit, const char *what)
{
    size_t n = 12345;
    char *buf = tide_read_file(path, &n, limit);
    int fits = limit == 0 || size <= limit;
    FUZZ_CHECK(!buf == !fits, "%s: %zu bytes under limit %zu: %s", what, size, limit, buf ? "read" : "refused");
    if (buf) {
        FUZZ_CHECK(n == size && !memcmp(buf, data, size) && buf[size] == 0, "%s: %zu bytes back for %zu", what, n,
                   size);
        tide_free(buf);
    } else {
        FUZZ_CHECK(tide_last_error()[0], "%s: a refusal sets an error", what);
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    const char *path = fuzz_path(0, "in.txt");
    fuzz_write(path, data, size);
    check_read(path, data, size, 0, "read_file");
    check_read(path, data, size, size, "read_file at its size");
    if (size > 0) check_read(path, data, size, size - 1, "read_file one byte short");

    tide_tensor *t = tide_text_read_bytes(path);
    FUZZ_CHECK(!t == (size == 0), "text_read_bytes of %zu bytes: %s", size, t ? "read" : "refused");
    if (t) {
        FUZZ_CHECK(t->dtype == TIDE_U8 && t->ndim == 1 && t->shape[0] == (int64_t)size, "u8 [%zu]", size);
        size_t n = 0;
        unsigned char *b = fuzz_tensor_bytes(t, &n);
        FUZZ_CHECK(n == size && !memcmp(b, data, size), "text tensor bytes");
        free(b);
        tide_tensor_release(t);
    }

    /* the same bytes through a pipe: refused before any byte is read (a reader never blocks on, or reads
       without end from, a file without a size); a pipe holds 64 KiB before its writer blocks */
    if (size < 60000) {
        int p[2];
        FUZZ_CHECK(pipe(p) == 0, "pipe");
        for (size_t at = 0; at < size;) {
            ssize_t w = write(p[1], data + at, size - at);
            FUZZ_CHECK(w > 0, "pipe write");
            at += (size_t)w;
        }
        char fd_path[64];
        snprintf(fd_path, sizeof fd_path, "/dev/fd/%d", p[0]);
        size_t n = 0;
        char *buf = tide_read_file(fd_path, &n, 0);
        const char *e = tide_last_error();
        FUZZ_CHECK(!buf && strstr(e, fd_path) && !strchr(e, '\n'), "a pipe: %s", buf ? "read" : e);
        tide_tensor *pt = tide_text_read_bytes(fd_path);
        FUZZ_CHECK(!pt, "text_read_bytes read a pipe");
        close(p[1]);
        close(p[0]);
    }
    return 0;
}
