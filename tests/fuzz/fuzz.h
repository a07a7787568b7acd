/*
 * fuzz.h — what the libFuzzer harnesses in tests/fuzz share: a private scratch directory (in /dev/shm when
 * there is one, so the file paths cost no disk I/O), plain file writes, and a check that aborts with a message
 * (an abort is a crash to libFuzzer, which then saves the input).
 *
 * Every harness feeds hostile bytes to a reader through its public entry point (engine/tide.h) and checks
 * the contract of tide.h: the call either succeeds with a result that agrees with the input, or fails with
 * an error message; it never crashes, leaks or reads out of bounds (ASan, UBSan and LSan watch).
 */
#ifndef TIDE_FUZZ_H
#define TIDE_FUZZ_H
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include "tide.h"

#define FUZZ_CHECK(cond, ...)                                                     \
    do {                                                                          \
        if (!(cond)) {                                                            \
            fprintf(stderr, "fuzz check failed at %s:%d: %s: ", __FILE__, __LINE__, #cond); \
            fprintf(stderr, __VA_ARGS__);                                         \
            fprintf(stderr, " (last error: %s)\n", tide_last_error());            \
            abort();                                                              \
        }                                                                         \
    } while (0)

/* a scratch directory for this process, made once under $TIDE_FUZZ_TMP (the lane script's, which it removes
   afterwards), else /dev/shm or /tmp */
static inline const char *fuzz_dir(void)
{
    static char dir[256];
    if (!dir[0]) {
        const char *base = getenv("TIDE_FUZZ_TMP");
        if (!base || !base[0]) base = access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp";
        snprintf(dir, sizeof dir, "%s/tide-fuzz-XXXXXX", base);
        if (!mkdtemp(dir)) { perror("mkdtemp"); abort(); }
    }
    return dir;
}

/* <scratch>/<name>, in a static buffer per slot (0..3) */
static inline const char *fuzz_path(int slot, const char *name)
{
    static char buf[4][512];
    snprintf(buf[slot], sizeof buf[slot], "%s/%s", fuzz_dir(), name);
    return buf[slot];
}

static inline void fuzz_write(const char *path, const void *bytes, size_t n)
{
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) { perror(path); abort(); }
    const char *p = bytes;
    while (n > 0) {
        ssize_t w = write(fd, p, n);
        if (w <= 0) { perror(path); abort(); }
        p += w;
        n -= (size_t)w;
    }
    close(fd);
}

/* the bytes of a CPU tensor (malloc'd; the caller frees) */
static inline unsigned char *fuzz_tensor_bytes(const tide_tensor *t, size_t *n)
{
    *n = (size_t)tide_tensor_nbytes(t);
    unsigned char *b = malloc(*n ? *n : 1);
    FUZZ_CHECK(b, "out of memory for %zu bytes", *n);
    FUZZ_CHECK(tide_read_bytes(t, b, *n) == 0, "read_bytes of a tensor the reader returned");
    return b;
}

/* one engine thread: the readers are serial, and a thread pool per input would only cost time */
static inline void fuzz_init_engine(void)
{
    tide_set_num_threads(1);
    tide_clear_error();
}

#endif
