/*
 * fuzz_image.c — the PNG/JPEG decoder (engine/io/image.c, vision.md §2) on hostile bytes.
 *
 * The input is a whole file, decoded from memory (tide_image_decode_memory). A failure sets one non-empty line
 * that names the label. A success keeps its promises: a CPU u8 tensor [H, W, 3] within the cap it was given,
 * holding H·W·3 bytes, and the caps come from the header: the same bytes with max_side one below the larger side
 * fail with the cap's message. The harness caps each side at 512 (the engine's default is 16,384) so that a
 * mutated header cannot make every execution decode hundreds of megabytes; the cap logic is the same.
 */
#include "fuzz.h"

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    fuzz_init_engine();
    return 0;
}

#define FUZZ_MAX_SIDE 512

static void check_error(void)
{
    const char *e = tide_last_error();
    FUZZ_CHECK(e && e[0], "a failed decode sets an error");
    FUZZ_CHECK(!strchr(e, '\n'), "the error is one line: %s", e);
    FUZZ_CHECK(strstr(e, "'fuzz'"), "the error names the label: %s", e);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    tide_clear_error();
    tide_tensor *t = tide_image_decode_memory(data, size, "fuzz", FUZZ_MAX_SIDE);
    if (!t) {
        check_error();
        return 0;
    }
    FUZZ_CHECK(t->dtype == TIDE_U8 && t->device == TIDE_CPU && t->ndim == 3, "dtype %d device %d ndim %d",
               t->dtype, t->device, t->ndim);
    int64_t h = t->shape[0], w = t->shape[1];
    FUZZ_CHECK(t->shape[2] == 3, "channels %lld", (long long)t->shape[2]);
    FUZZ_CHECK(h >= 1 && w >= 1 && h <= FUZZ_MAX_SIDE && w <= FUZZ_MAX_SIDE, "shape %lld x %lld", (long long)h,
               (long long)w);
    FUZZ_CHECK(tide_tensor_nbytes(t) == h * w * 3, "nbytes %lld for %lld x %lld",
               (long long)tide_tensor_nbytes(t), (long long)h, (long long)w);
    size_t n = 0;
    free(fuzz_tensor_bytes(t, &n));                 /* every byte is readable (ASan checks the copy) */
    tide_tensor_release(t);
    int64_t big = h > w ? h : w;
    if (big > 1) {
        tide_tensor *u = tide_image_decode_memory(data, size, "fuzz", big - 1);
        FUZZ_CHECK(!u, "a %lld x %lld image decoded with max_side %lld", (long long)w, (long long)h,
                   (long long)(big - 1));
        check_error();
        FUZZ_CHECK(strstr(tide_last_error(), "per side"), "the cap's message: %s", tide_last_error());
    }
    return 0;
}
