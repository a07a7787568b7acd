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
#define STBI_ASSERT(x) ((void)0)          /* its asserts fire on corrupt input; nothing aborts on user input */
/* every allocation of the decoder goes through a per-thread cap (image_alloc_cap below): a PNG chunk length or a
   zlib stream may claim gigabytes that a file of a few hundred bytes cannot hold */
static void *image_malloc(size_t n);
static void *image_realloc(void *p, size_t n);
#define STBI_MALLOC(n) image_malloc(n)
#define STBI_REALLOC(p, n) image_realloc(p, n)
#define STBI_FREE(p) free(p)
#if defined(__GNUC__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-function"
#pragma GCC diagnostic ignored "-Wsign-compare"
#pragma GCC diagnostic ignored "-Wmissing-prototypes"
#pragma GCC diagnostic ignored "-Wimplicit-fallthrough"
#endif
/* stb_image 2.27 has undefined behaviour on some corrupt inputs that later releases refuse (a Huffman symbol id
   used unchecked as an index inside the decoder's struct, shifts by 32 on bad JPEG bit streams, adding 0 to a NULL
   buffer for an empty IDAT chunk); the fuzz lane's UBSan would stop there, so UBSan is off for stb's functions
   while ASan still checks every memory access (the write past the Huffman tables is refused first: jpeg_bad_dht) */
#if defined(__clang__)
#pragma clang attribute push(__attribute__((no_sanitize("undefined"))), apply_to = function)
#endif
#include <stb/stb_image.h>
#if defined(__clang__)
#pragma clang attribute pop
#endif
#if defined(__GNUC__)
#pragma GCC diagnostic pop
#endif

#define TIDE_IMAGE_MAX_BYTES ((int64_t)64 << 20)     /* 64 MiB per file */
#define TIDE_IMAGE_MAX_SIDE ((int64_t)16384)         /* per side */
#define TIDE_IMAGE_MAX_PIXELS ((int64_t)64 << 20)    /* 64 Mi pixels (e.g. 8192 x 8192) */

/* The most one decoder allocation may take, for the image being decoded on this thread. A valid file never
   needs more than twice its compressed bytes (the IDAT buffer grows by doubling) or a few dozen bytes per
   (MCU-padded) pixel: 16-bit RGBA is 8, the zlib output may double once for an interlaced PNG, a progressive
   JPEG keeps 2 bytes of coefficients per pixel and component. A request above the cap (a chunk length or a zlib
   stream that expands past anything the declared size can use) is refused and reported as such. */
static _Thread_local size_t image_alloc_cap, image_refused;

static void *image_malloc(size_t n)
{
    if (n > image_alloc_cap) { image_refused = n; return NULL; }
    /* zeroed: stb_image 2.27 mallocs its JPEG decoder state, and a progressive scan that names a Huffman table
       no DHT segment defined decodes through uninitialised tables, indexing past them (the fuzz lane's finding;
       2.28 checks the symbol id). A zeroed table decodes every code as an end-of-band: an in-bounds, wrong image
       of a corrupt file, as libjpeg gives with a warning. */
    return calloc(1, n);
}

static void *image_realloc(void *p, size_t n)
{
    if (n > image_alloc_cap) { image_refused = n; return NULL; }
    return realloc(p, n);
}

/* stb_image 2.27 builds a Huffman table from 16 counts without checking that they sum to at most 256 (the JPEG
   limit), writing past its 257-entry arrays; later releases refuse such a DHT segment. Every DHT stb could parse
   is checked here first, as stb reads it (bytes past the end read as 0): the header is walked segment by segment
   (APPn and COM payloads skipped by their length, as stb skips them); from the first scan on, where entropy-coded
   data cannot hold FF C4, every FF C4 is checked. Returns 0 when fine, else the offset of the bad table + 1. */
static size_t jpeg_bad_dht(const stbi_uc *b, size_t n)
{
    size_t pos = 2;
    int header = 1;
    while (pos < n) {
        if (header) {
            if (b[pos] != 0xff) { pos++; continue; }
            while (pos < n && b[pos] == 0xff) pos++;
            if (pos >= n) break;
        } else {
            if (b[pos] != 0xff || pos + 1 >= n || b[pos + 1] != 0xc4) { pos++; continue; }
            pos++;
        }
        stbi_uc m = b[pos++];
        if (m == 0xd9) { if (header) break; continue; }
        if (!header && m != 0xc4) continue;
        if (m == 0x01 || (m >= 0xd0 && m <= 0xd8)) continue;
        size_t seg = pos;
        long len = (long)(((pos < n ? b[pos] : 0) << 8) | (pos + 1 < n ? b[pos + 1] : 0)), L = len;
        if (m == 0xc4) {
            size_t q = pos + 2;
            L -= 2;
            while (L > 0) {
                stbi_uc tc_th = q < n ? b[q] : 0;
                if ((tc_th >> 4) > 1 || (tc_th & 15) > 3) break;   /* stb refuses the segment here */
                long codes = 0;
                for (size_t i = 1; i <= 16; i++) codes += q + i < n ? b[q + i] : 0;
                if (codes > 256) return q + 1;
                q += 17 + (size_t)codes;
                L -= 17 + codes;
            }
        }
        if (!header) continue;
        if (m == 0xda) { header = 0; continue; }   /* the scans: from here on only FF C4 is looked at */
        pos = seg + (size_t)len;
    }
    return 0;
}

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
    size_t bad = is_jpeg ? jpeg_bad_dht(buf, n) : 0;
    TIDE_CHECK(!bad, "image '%s': corrupt JPEG: the Huffman table at byte %zu declares more than 256 codes", label,
               bad - 1);
    /* the header alone, through the one format's reader (stbi_info would report the last format it tried):
       nothing the size of the image is allocated before the caps are checked */
    image_alloc_cap = 2 * n + ((size_t)1 << 20);
    image_refused = 0;
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
    image_alloc_cap = 2 * n + 32 * (size_t)(w + 16) * (size_t)(h + 16) + ((size_t)1 << 20);
    image_refused = 0;
    stbi_uc *px = stbi_load_from_memory(buf, len, &dw, &dh, &dc, 3);
    if (!px && image_refused) {
        tide_set_error("image '%s' (%d x %d): corrupt %s: decoding it asks for %zu bytes, more than a valid "
                       "%zu-byte file of this size needs (at most %zu)", label, w, h, is_png ? "PNG" : "JPEG",
                       image_refused, n, image_alloc_cap);
        return NULL;
    }
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
