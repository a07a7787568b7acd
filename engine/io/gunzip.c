/*
 * gunzip.c — a bounded reader of single-member .gz files (RFC 1952), for small data files such as sklearn's
 * digits.csv.gz (data/multimodal.lua). The deflate stream is inflated by stb_image's zlib decoder (compiled in
 * image.c) into a buffer of exactly the size the trailer declares, so nothing grows past the caller's cap: a
 * stream that would write more is refused by the decoder, one that writes less or whose CRC-32 differs is an error.
 * Input is hostile: the header fields are bounds-checked, every error is one line naming the file.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "internal.h"

#define STBI_NO_STDIO
#include <stb/stb_image.h>

#define TIDE_GUNZIP_MAX_IN ((size_t)256 << 20)          /* compressed bytes read */
#define TIDE_GUNZIP_DEFAULT_OUT ((size_t)256 << 20)     /* decompressed bytes, when the caller gives 0 */
#define TIDE_GUNZIP_MAX_OUT ((size_t)1 << 30)           /* the decoder counts in int */

static uint32_t crc32_of(const unsigned char *p, size_t n)
{
    static uint32_t table[256];
    static int ready;
    if (!ready) {
        for (uint32_t i = 0; i < 256; i++) {
            uint32_t c = i;
            for (int k = 0; k < 8; k++) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
            table[i] = c;
        }
        ready = 1;
    }
    uint32_t c = 0xFFFFFFFFu;
    for (size_t i = 0; i < n; i++) c = table[(c ^ p[i]) & 0xFF] ^ (c >> 8);
    return c ^ 0xFFFFFFFFu;
}

static uint32_t le32(const unsigned char *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

char *tide_gunzip_file(const char *path, size_t max_bytes, size_t *n)
{
    TIDE_CHECK(path && path[0], "gunzip: the path is %s", path ? "empty" : "NULL");
    TIDE_CHECK(n, "gunzip '%s': the length pointer is NULL", path);
    if (max_bytes == 0) max_bytes = TIDE_GUNZIP_DEFAULT_OUT;
    TIDE_CHECK(max_bytes <= TIDE_GUNZIP_MAX_OUT, "gunzip '%s': max_bytes = %zu, expected at most %zu", path, max_bytes,
               TIDE_GUNZIP_MAX_OUT);
    size_t len = 0;
    char *raw = tide_read_file(path, &len, TIDE_GUNZIP_MAX_IN);
    if (!raw) return NULL;
    const unsigned char *b = (const unsigned char *)raw;
    char *out = NULL;
    const char *why = NULL;
    char detail[160] = "";
    size_t pos = 10;
    if (len < 18) { why = "truncated gzip file"; snprintf(detail, sizeof detail, " (%zu bytes; header and trailer need 18)", len); goto fail; }
    if (b[0] != 0x1f || b[1] != 0x8b) { why = "not a gzip file (no 1f 8b signature at byte 0)"; goto fail; }
    if (b[2] != 8) { why = "unsupported gzip compression method"; snprintf(detail, sizeof detail, " %d (only 8, deflate)", b[2]); goto fail; }
    unsigned flg = b[3];
    if (flg & 0xE0) { why = "corrupt gzip header: reserved flag bits set"; goto fail; }
    if (flg & 4) {                                            /* FEXTRA: 2-byte length, then the field */
        if (pos + 2 > len - 8) { why = "truncated gzip header (extra field)"; goto fail; }
        size_t xlen = (size_t)b[pos] | (size_t)b[pos + 1] << 8;
        pos += 2;
        if (xlen > len - 8 - pos) { why = "truncated gzip header (extra field)"; goto fail; }
        pos += xlen;
    }
    for (unsigned bit = 8; bit <= 16; bit <<= 1) {            /* FNAME, FCOMMENT: NUL-terminated */
        if (!(flg & bit)) continue;
        while (pos < len - 8 && b[pos]) pos++;
        if (pos >= len - 8) { why = bit == 8 ? "truncated gzip header (file name)" : "truncated gzip header (comment)"; goto fail; }
        pos++;
    }
    if (flg & 2) {                                            /* FHCRC: the low 16 bits of the header's CRC-32 */
        if (pos + 2 > len - 8) { why = "truncated gzip header (header CRC)"; goto fail; }
        if ((crc32_of(b, pos) & 0xFFFF) != ((unsigned)b[pos] | (unsigned)b[pos + 1] << 8)) {
            why = "corrupt gzip header: header CRC mismatch";
            goto fail;
        }
        pos += 2;
    }
    uint32_t want_crc = le32(b + len - 8), isize = le32(b + len - 4);
    if ((size_t)isize > max_bytes) {
        why = "decompressed size over the limit";
        snprintf(detail, sizeof detail, ": the trailer declares %u bytes, the limit is %zu (or the file is cut short)",
                 isize, max_bytes);
        goto fail;
    }
    out = malloc((size_t)isize + 1);
    if (!out) { why = "out of memory"; snprintf(detail, sizeof detail, " for %u bytes", isize); goto fail; }
    /* the trailer's 8 bytes stay in the decoder's input: stb's decoder refuses a stream whose last codes lie in
       its final bytes (it checks for the end before refilling its bit buffer), and stops at the final block anyway */
    size_t deflate_len = len - pos;
    if (deflate_len > (size_t)INT32_MAX) { why = "compressed data too large"; goto fail; }
    int got = stbi_zlib_decode_noheader_buffer(out, (int)isize, (const char *)b + pos, (int)deflate_len);
    if (got < 0) {
        why = "corrupt or truncated deflate data";
        snprintf(detail, sizeof detail, " (it does not inflate to the %u bytes its trailer declares)", isize);
        goto fail;
    }
    if ((uint32_t)got != isize) {
        why = "corrupt or truncated gzip file";
        snprintf(detail, sizeof detail, ": the data inflates to %d bytes, the trailer declares %u", got, isize);
        goto fail;
    }
    uint32_t crc = crc32_of((const unsigned char *)out, (size_t)got);
    if (crc != want_crc) {
        why = "corrupt gzip file: CRC-32 mismatch";
        snprintf(detail, sizeof detail, " (data %08x, trailer %08x)", crc, want_crc);
        goto fail;
    }
    out[got] = 0;
    *n = (size_t)got;
    free(raw);
    return out;
fail:
    tide_set_error("gunzip '%s': %s%s", path, why, detail);
    free(out);
    free(raw);
    return NULL;
}
