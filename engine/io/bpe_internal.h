/*
 * bpe_internal.h — what the byte-level BPE files share (formats.md §4): code point classes, UTF-8, the GPT-2
 * byte map, the pre-tokenizer matchers, the added-token splitter, hashing and growable buffers.
 *
 *   bpe_text.c   classes, byte map, pre-tokenizers (GPT-2 and Llama-3 patterns), added-token matching
 *   bpe.c        tokenizer.json loading, encode, decode, parallel encoding of documents
 *   bpe_train.c  byte-level BPE training and the tokenizer.json it writes
 *   bpe_jsonl.c  the text field of JSONL documents
 */
#ifndef TIDE_BPE_INTERNAL_H
#define TIDE_BPE_INTERNAL_H
#include <stdint.h>
#include <stddef.h>
#include <string.h>
#include "internal.h"

/* ---- code points --------------------------------------------------------------------------------- */
enum { UC_L = 1, UC_N = 2, UC_S = 4, UC_W = 8 };   /* \p{L}, \p{N}, \s (White_Space), \w (single_word) */
#define BPE_INVALID 0xFFFFFFFFu                    /* a byte that starts no valid UTF-8 sequence */

void bpe_unicode_init(void);                       /* once per process; every loader calls it */
extern uint8_t bpe_bmp_class[65536];
int bpe_class_slow(uint32_t cp);                   /* code points above the BMP */

static inline int bpe_cont(uint8_t c) { return (c & 0xC0) == 0x80; }

/* one UTF-8 character at s[i] (i < n): its length, *cp its code point; an invalid or truncated sequence is
   one byte with *cp = BPE_INVALID (the pre-tokenizers treat it as a character of no class) */
static inline size_t bpe_utf8(const uint8_t *s, size_t n, size_t i, uint32_t *cp)
{
    uint8_t c = s[i];
    if (c < 0x80) { *cp = c; return 1; }
    if (c >= 0xC2 && c <= 0xDF) {
        if (i + 1 < n && bpe_cont(s[i + 1])) { *cp = ((uint32_t)(c & 0x1F) << 6) | (s[i + 1] & 0x3F); return 2; }
    } else if (c >= 0xE0 && c <= 0xEF) {
        if (i + 2 < n && bpe_cont(s[i + 1]) && bpe_cont(s[i + 2])) {
            uint32_t v = ((uint32_t)(c & 0x0F) << 12) | ((uint32_t)(s[i + 1] & 0x3F) << 6) | (s[i + 2] & 0x3F);
            if (v >= 0x800 && (v < 0xD800 || v > 0xDFFF)) { *cp = v; return 3; }
        }
    } else if (c >= 0xF0 && c <= 0xF4) {
        if (i + 3 < n && bpe_cont(s[i + 1]) && bpe_cont(s[i + 2]) && bpe_cont(s[i + 3])) {
            uint32_t v = ((uint32_t)(c & 0x07) << 18) | ((uint32_t)(s[i + 1] & 0x3F) << 12) |
                         ((uint32_t)(s[i + 2] & 0x3F) << 6) | (s[i + 3] & 0x3F);
            if (v >= 0x10000 && v <= 0x10FFFF) { *cp = v; return 4; }
        }
    }
    *cp = BPE_INVALID;
    return 1;
}

static inline int bpe_class(uint32_t cp)
{
    if (cp < 65536) return bpe_bmp_class[cp];
    return cp == BPE_INVALID ? 0 : bpe_class_slow(cp);
}

/* the class of the character at s[i], its length in *len */
static inline int bpe_class_at(const uint8_t *s, size_t n, size_t i, size_t *len)
{
    if (s[i] < 0x80) { *len = 1; return bpe_bmp_class[s[i]]; }
    uint32_t cp;
    *len = bpe_utf8(s, n, i, &cp);
    return bpe_class(cp);
}

/* the class of the character that ends at s[end] (exclusive), 0 when end == 0 */
int bpe_class_before(const uint8_t *s, size_t end);

size_t bpe_utf8_put(uint32_t cp, char *out);       /* 1-4 bytes */

/* ---- the GPT-2 byte map (formats.md §4) ----------------------------------------------------------- */
extern uint16_t bpe_byte_cp[256];                  /* byte -> code point */
extern int16_t bpe_cp_byte[324];                   /* code point (< 324) -> byte, or -1 */
/* bytes of token string t (UTF-8) under the reverse byte map into out (room for tn bytes): the byte count, or
   -1 when a character is outside the map */
int64_t bpe_unmap(const char *t, size_t tn, uint8_t *out);
/* the byte-mapped string of raw bytes b (room for 2 bytes per input byte): its length */
size_t bpe_map(const uint8_t *b, size_t n, char *out);

/* ---- pre-tokenizers ------------------------------------------------------------------------------- */
enum { BPE_PAT_GPT2 = 1, BPE_PAT_LLAMA3 = 2 };
extern const char *const bpe_pattern_gpt2;
extern const char *const bpe_pattern_llama3;
/* the end of the pre-token that starts at s[i] (i < n) of the string s[0, n) under pattern `pat` */
size_t bpe_piece_end(int pat, const uint8_t *s, size_t n, size_t i);

/* ---- added tokens (tokenizers' AddedVocabulary: leftmost-longest, two passes) ---------------------- */
typedef struct {
    const uint8_t *content;
    uint32_t len;
    int32_t id;
    uint8_t special, lstrip, rstrip, single_word, normalized;
} bpe_added;

typedef struct {
    int n;                     /* tokens in this set */
    const bpe_added **tok;     /* sorted by first byte, then longest first */
    int32_t first[257];        /* tok[first[c] .. first[c + 1]) start with byte c */
} bpe_added_set;

/* a piece of a split: [a, b) of the text, id >= 0 for an added token, -1 for text still to pre-tokenize */
typedef struct { size_t a, b; int32_t id; } bpe_seg;

typedef struct { bpe_seg *v; size_t n, cap; } bpe_segs;

int bpe_added_set_build(bpe_added_set *set, const bpe_added *tokens, int n, int normalized);
void bpe_added_set_free(bpe_added_set *set);
/* appends the splits of s[lo, hi) by `set` to out (tokenizers' find_matches; lstrip, rstrip and single_word
   relative to that slice); empty text pieces are left out. -1 on out of memory. */
int bpe_added_split(const bpe_added_set *set, const uint8_t *s, size_t lo, size_t hi, bpe_segs *out);

/* ---- hashing and buffers --------------------------------------------------------------------------- */
static inline uint64_t bpe_hash(const uint8_t *p, size_t n)
{
    uint64_t h = 0x9E3779B97F4A7C15ull ^ ((uint64_t)n * 0xD6E8FEB86659FD93ull);
    while (n >= 8) {
        uint64_t v;
        memcpy(&v, p, 8);
        h = (h ^ v) * 0xFF51AFD7ED558CCDull;
        h ^= h >> 32;
        p += 8;
        n -= 8;
    }
    uint64_t v = 0;
    for (size_t k = 0; k < n; k++) v |= (uint64_t)p[k] << (8 * k);
    h = (h ^ v) * 0xC4CEB9FE1A85EC53ull;
    h ^= h >> 29;
    return h;
}

static inline uint64_t bpe_mix64(uint64_t x)
{
    x ^= x >> 33;
    x *= 0xFF51AFD7ED558CCDull;
    x ^= x >> 33;
    x *= 0xC4CEB9FE1A85EC53ull;
    x ^= x >> 33;
    return x;
}

typedef struct { int32_t *v; size_t n, cap; } bpe_ivec;
int bpe_ivec_grow(bpe_ivec *a, size_t need);       /* room for `need` more; -1 on out of memory */
static inline int bpe_ivec_push(bpe_ivec *a, int32_t x)
{
    if (a->n == a->cap && bpe_ivec_grow(a, 1)) return -1;
    a->v[a->n++] = x;
    return 0;
}

typedef struct { char *v; size_t n, cap; } bpe_buf;
int bpe_buf_put(bpe_buf *b, const void *p, size_t n);
int bpe_buf_printf(bpe_buf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* s as the body of a JSON string (quotes not included) */
int bpe_buf_json_string(bpe_buf *b, const char *s, size_t n);

/* a short printable rendering of bytes for error messages: at most ~48 characters, control bytes escaped */
const char *bpe_show(const void *p, size_t n, char *buf, size_t bufn);

typedef struct { size_t *v; size_t n, cap; } bpe_zvec;
int bpe_zvec_push(bpe_zvec *a, size_t x);

/* chunks of one document that encode independently: a boundary p follows a lone '\n' between two printable
   ASCII bytes (every pre-tokenizer ends a piece there, whatever the text around it) and no added token spans
   p or starts at p with lstrip. Appends to `ends` the chunk ends of s[0, n), about `target` bytes apart; the
   last is n. Only for tokenizers without add_prefix_space (a chunk start would get the prefix). */
int bpe_chunk_ends(const uint8_t *s, size_t n, size_t target, const bpe_added *added, int n_added, bpe_zvec *ends);

#endif
