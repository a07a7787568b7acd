/*
 * image.c — PNG and JPEG files (or bytes) -> u8 tensors [H, W, 3] (vision.md §2, the first step of the pipeline).
 *
 * Images are hostile input (formats.md: bounds-checked, size-capped, fuzzed): only regular files are opened, the
 * file is capped at TIDE_IMAGE_MAX_BYTES, and the dimensions are read from the header and checked against the caps
 * BEFORE the decoder allocates anything for the pixels. Decoding is stb_image's, restricted to PNG and JPEG and
 * always to 8-bit RGB (alpha dropped, grey and palette expanded, 16-bit channels reduced to their high byte).
 */
#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include "internal.h"

/* the decoder compiles here and nowhere else: PNG and JPEG only, from memory only, descriptive failure strings */
#define STB_IMAGE_IMPLEMENTATION
#define STBI_ONLY_PNG
#define STBI_ONLY_JPEG
#define STBI_NO_STDIO
#define STBI_NO_LINEAR
#define STBI_NO_HDR
#define STBI_FAILURE_USERMSG
#if defined(__GNUC__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-function"
#pragma GCC diagnostic ignored "-Wsign-compare"
#pragma GCC diagnostic ignored "-Wmissing-prototypes"
#pragma GCC diagnostic ignored "-Wimplicit-fallthrough"
#endif
#include <stb/stb_image.h>
#if defined(__GNUC__)
#pragma GCC diagnostic pop
#endif

#define TIDE_IMAGE_MAX_BYTES ((int64_t)64 << 20)     /* 64 MiB per file */
#define TIDE_IMAGE_MAX_SIDE ((int64_t)16384)         /* per side */
#define TIDE_IMAGE_MAX_PIXELS ((int64_t)64 << 20)    /* 64 Mi pixels (e.g. 8192 x 8192) */

tide_tensor *tide_image_decode_memory(const void *bytes, size_t n, const char *label, int64_t max_side)
{
    if (!label) label = "<memory>";
    int64_t side = TIDE_IMAGE_MAX_SIDE;
    TIDE_CHECK(max_side >= 0 && max_side <= TIDE_IMAGE_MAX_SIDE,
               "image '%s': max_side = %lld, expected 0 (the default %lld) up to %lld", label, (long long)max_side,
               (long long)TIDE_IMAGE_MAX_SIDE, (long long)TIDE_IMAGE_MAX_SIDE);
    if (max_side > 0) side = max_side;
    TIDE_CHECK(bytes || n == 0, "image '%s': the bytes are NULL", label);
    TIDE_CHECK(n > 0, "image '%s' is empty (0 bytes)", label);
    TIDE_CHECK((int64_t)n <= TIDE_IMAGE_MAX_BYTES, "image '%s' is %zu bytes, over the limit of %lld bytes", label, n,
               (long long)TIDE_IMAGE_MAX_BYTES);
    const stbi_uc *buf = bytes;
    int len = (int)n, w = 0, h = 0, comp = 0;
    static const stbi_uc png_sig[8] = { 0x89, 'P', 'N', 'G', '\r', '\n', 0x1a, '\n' };
    int is_png = n >= 8 && !memcmp(buf, png_sig, 8);
    int is_jpeg = n >= 3 && buf[0] == 0xff && buf[1] == 0xd8 && buf[2] == 0xff;
    TIDE_CHECK(is_png || is_jpeg, "image '%s': not a PNG or JPEG (neither signature at byte 0)", label);
    /* signature, chunk length, "IHDR", 13 bytes of header, CRC: 33 bytes (stb would read zeros past the end) */
    TIDE_CHECK(!is_png || n >= 33, "image '%s': truncated PNG header (%zu bytes; the IHDR chunk ends at 33)", label, n);
    if (is_png && !memcmp(buf + 12, "IHDR", 4)) {
        /* IHDR's size first: stb's own header check refuses images over 1 GiB with a vaguer message */
        uint32_t pw = (uint32_t)buf[16] << 24 | (uint32_t)buf[17] << 16 | (uint32_t)buf[18] << 8 | buf[19];
        uint32_t ph = (uint32_t)buf[20] << 24 | (uint32_t)buf[21] << 16 | (uint32_t)buf[22] << 8 | buf[23];
        TIDE_CHECK(pw <= side && ph <= side, "image '%s' is %u x %u pixels (W x H), over the limit of %lld per side",
                   label, pw, ph, (long long)side);
    }
    /* the header alone, through the one format's reader (stbi_info would report the last format it tried):
       nothing the size of the image is allocated before the caps are checked */
    stbi__context ctx;
    stbi__start_mem(&ctx, buf, len);
    if (!(is_png ? stbi__png_info(&ctx, &w, &h, &comp) : stbi__jpeg_info(&ctx, &w, &h, &comp))) {
        tide_set_error("image '%s': not a readable %s header: %s", label, is_png ? "PNG" : "JPEG",
                       stbi_failure_reason());
        return NULL;
    }
    TIDE_CHECK(w > 0 && h > 0, "image '%s': the header declares %d x %d pixels", label, w, h);
    TIDE_CHECK(w <= side && h <= side, "image '%s' is %d x %d pixels (W x H), over the limit of %lld per side", label,
               w, h, (long long)side);
    TIDE_CHECK((int64_t)w * h <= TIDE_IMAGE_MAX_PIXELS,
               "image '%s' is %d x %d = %lld pixels, over the limit of %lld", label, w, h, (long long)w * h,
               (long long)TIDE_IMAGE_MAX_PIXELS);
    int dw = 0, dh = 0, dc = 0;
    stbi_uc *px = stbi_load_from_memory(buf, len, &dw, &dh, &dc, 3);
    if (!px) {
        tide_set_error("image '%s' (%d x %d): cannot decode: %s", label, w, h, stbi_failure_reason());
        return NULL;
    }
    if (dw != w || dh != h) {
        stbi_image_free(px);
        tide_set_error("image '%s': the header says %d x %d, the decoder gave %d x %d", label, w, h, dw, dh);
        return NULL;
    }
    int64_t shape[3] = { h, w, 3 };
    tide_tensor *t = tide_from_bytes(TIDE_U8, 3, shape, TIDE_CPU, px, (size_t)h * (size_t)w * 3);
    stbi_image_free(px);
    return t;
}

tide_tensor *tide_image_read(const char *path, int64_t max_side)
{
    TIDE_CHECK(path && path[0], "image_read: the path is %s", path ? "empty" : "NULL");
    int64_t size = 0;
    int fd = tide_open_regular(path, "image", &size);
    if (fd < 0) return NULL;
    if (size > TIDE_IMAGE_MAX_BYTES || size == 0) {
        close(fd);
        if (size == 0) tide_set_error("image '%s' is empty (0 bytes)", path);
        else tide_set_error("image '%s' is %lld bytes, over the limit of %lld bytes", path, (long long)size,
                            (long long)TIDE_IMAGE_MAX_BYTES);
        return NULL;
    }
    unsigned char *buf = malloc((size_t)size);
    if (!buf) {
        close(fd);
        tide_set_error("image '%s': out of memory for %lld bytes", path, (long long)size);
        return NULL;
    }
    size_t got = 0;
    while (got < (size_t)size) {
        ssize_t r = pread(fd, buf + got, (size_t)size - got, (off_t)got);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) {
            if (r < 0) tide_set_error("image '%s': cannot read: %s", path, strerror(errno));
            else tide_set_error("image '%s': the file shrank to %zu bytes while being read", path, got);
            free(buf);
            close(fd);
            return NULL;
        }
        got += (size_t)r;
    }
    close(fd);
    tide_tensor *t = tide_image_decode_memory(buf, got, path, max_side);
    free(buf);
    return t;
}
