/*
 * fuzz_gunzip.c — the bounded .gz reader (engine/io/gunzip.c, tide_gunzip_file) on hostile files.
 *
 * The input is a file's bytes. A success returns as many bytes as the trailer's ISIZE declares, NUL-terminated,
 * within the cap; the same file under a cap one byte below that size is refused with the cap's message. A failure
 * sets one non-empty line that names the file. The harness caps the output at 1 MiB (the engine's default is
 * 256 MiB) so that a mutated trailer cannot make every execution allocate hundreds of megabytes.
 */
#include "fuzz.h"

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    fuzz_init_engine();
    return 0;
}

#define FUZZ_MAX_OUT ((size_t)1 << 20)

static void check_error(const char *path)
{
    const char *e = tide_last_error();
    FUZZ_CHECK(e && e[0], "a failed gunzip sets an error");
    FUZZ_CHECK(!strchr(e, '\n'), "the error is one line: %s", e);
    FUZZ_CHECK(strstr(e, path), "the error names the file: %s", e);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    const char *path = fuzz_path(0, "in.gz");
    fuzz_write(path, data, size);
    tide_clear_error();
    size_t n = 12345;
    char *out = tide_gunzip_file(path, FUZZ_MAX_OUT, &n);
    if (!out) {
        check_error(path);
        return 0;
    }
    FUZZ_CHECK(size >= 18, "a %zu-byte file decompressed", size);
    size_t isize = (size_t)data[size - 4] | (size_t)data[size - 3] << 8 | (size_t)data[size - 2] << 16 |
                   (size_t)data[size - 1] << 24;
    FUZZ_CHECK(n == isize && n <= FUZZ_MAX_OUT && out[n] == 0, "%zu bytes out, the trailer declares %zu", n, isize);
    volatile char sink = 0;
    for (size_t i = 0; i < n; i++) sink ^= out[i];     /* every byte is readable (ASan) */
    (void)sink;
    tide_free(out);
    if (n > 0) {
        char *again = tide_gunzip_file(path, n - 1, &n);
        FUZZ_CHECK(!again, "decompressed under a cap one byte below its size");
        check_error(path);
        FUZZ_CHECK(strstr(tide_last_error(), "over the limit"), "the cap's message: %s", tide_last_error());
    }
    return 0;
}
