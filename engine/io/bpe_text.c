/*
 * bpe_text.c — the text side of byte-level BPE (formats.md §4): code point classes, the GPT-2 byte map, the
 * pre-tokenizer regexes as hand-written matchers over UTF-8, and the added-token splitter.
 *
 * The matchers reproduce the leftmost-first alternation of the regexes exactly (backtracking included: the
 * `\s+(?!\S)` branch leaves the last space of a run for the next word). The classes come from
 * unicode_tables.h (scripts/gen_unicode_tables.py). Bytes that start no valid UTF-8 sequence are characters
 * of no class, so any byte string pre-tokenizes, and the concatenated pieces are always the input.
 */
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "bpe_internal.h"
#include "unicode_tables.h"

/* ---- classes ------------------------------------------------------------------------------------- */
uint8_t bpe_bmp_class[65536];
static pthread_once_t g_uc_once = PTHREAD_ONCE_INIT;

static int in_table(const uint32_t (*t)[2], size_t n, uint32_t cp)
{
    size_t lo = 0, hi = n;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (cp < t[mid][0]) hi = mid;
        else if (cp > t[mid][1]) lo = mid + 1;
        else return 1;
    }
    return 0;
}

#define TABLE_N(t) (sizeof(t) / sizeof((t)[0]))

int bpe_class_slow(uint32_t cp)
{
    int k = 0;
    if (in_table(tide_uc_letter, TABLE_N(tide_uc_letter), cp)) k |= UC_L;
    if (in_table(tide_uc_number, TABLE_N(tide_uc_number), cp)) k |= UC_N;
    if (in_table(tide_uc_space, TABLE_N(tide_uc_space), cp)) k |= UC_S;
    if (in_table(tide_uc_word, TABLE_N(tide_uc_word), cp)) k |= UC_W;
    return k;
}

static void fill(const uint32_t (*t)[2], size_t n, int bit)
{
    for (size_t r = 0; r < n; r++)
        for (uint32_t cp = t[r][0]; cp <= t[r][1] && cp < 65536; cp++) bpe_bmp_class[cp] |= (uint8_t)bit;
}

uint16_t bpe_byte_cp[256];
int16_t bpe_cp_byte[324];

static void init_once(void)
{
    fill(tide_uc_letter, TABLE_N(tide_uc_letter), UC_L);
    fill(tide_uc_number, TABLE_N(tide_uc_number), UC_N);
    fill(tide_uc_space, TABLE_N(tide_uc_space), UC_S);
    fill(tide_uc_word, TABLE_N(tide_uc_word), UC_W);
    /* GPT-2 bytes_to_unicode: the 188 printable bytes keep their code point, the other 68 take 256, 257, ...
       in ascending byte order */
    for (int c = 0; c < 324; c++) bpe_cp_byte[c] = -1;
    int next = 256;
    for (int b = 0; b < 256; b++) {
        int keep = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
        bpe_byte_cp[b] = (uint16_t)(keep ? b : next++);
        bpe_cp_byte[bpe_byte_cp[b]] = (int16_t)b;
    }
}

void bpe_unicode_init(void) { pthread_once(&g_uc_once, init_once); }

int bpe_class_before(const uint8_t *s, size_t end)
{
    if (end == 0) return 0;
    /* the last character: back over up to 3 continuation bytes to a lead byte whose sequence ends at `end` */
    size_t start = end - 1;
    for (int k = 0; k < 3 && start > 0 && bpe_cont(s[start]); k++) start--;
    uint32_t cp;
    size_t len = bpe_utf8(s, end, start, &cp);
    if (start + len != end) return 0;   /* the last byte alone: no class */
    return bpe_class(cp);
}

size_t bpe_utf8_put(uint32_t cp, char *out)
{
    if (cp < 0x80) { out[0] = (char)cp; return 1; }
    if (cp < 0x800) { out[0] = (char)(0xC0 | (cp >> 6)); out[1] = (char)(0x80 | (cp & 0x3F)); return 2; }
    if (cp < 0x10000) {
        out[0] = (char)(0xE0 | (cp >> 12));
        out[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
        out[2] = (char)(0x80 | (cp & 0x3F));
        return 3;
    }
    out[0] = (char)(0xF0 | (cp >> 18));
    out[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
    out[2] = (char)(0x80 | ((cp >> 6) & 0x3F));
    out[3] = (char)(0x80 | (cp & 0x3F));
    return 4;
}

int64_t bpe_unmap(const char *t, size_t tn, uint8_t *out)
{
    const uint8_t *s = (const uint8_t *)t;
    size_t k = 0;
    for (size_t i = 0; i < tn;) {
        uint32_t cp;
        size_t len = bpe_utf8(s, tn, i, &cp);
        if (cp >= 324 || bpe_cp_byte[cp] < 0) return -1;
        out[k++] = (uint8_t)bpe_cp_byte[cp];
        i += len;
    }
    return (int64_t)k;
}

size_t bpe_map(const uint8_t *b, size_t n, char *out)
{
    size_t k = 0;
    for (size_t i = 0; i < n; i++) k += bpe_utf8_put(bpe_byte_cp[b[i]], out + k);
    return k;
}

/* ---- pre-tokenizers ------------------------------------------------------------------------------- */
const char *const bpe_pattern_gpt2 =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";
const char *const bpe_pattern_llama3 =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|"
    "\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";

/* the end of the run of characters from i whose class has a bit of `any` (or, with any == 0, no bit of
   UC_L | UC_N | UC_S: the "other" characters) */
static size_t run(const uint8_t *s, size_t n, size_t i, int any)
{
    while (i < n) {
        size_t len;
        int k = bpe_class_at(s, n, i, &len);
        int in = any ? (k & any) != 0 : (k & (UC_L | UC_N | UC_S)) == 0;
        if (!in) break;
        i += len;
    }
    return i;
}

static int is_other(int k) { return (k & (UC_L | UC_N | UC_S)) == 0; }

/* a run of white space from i (s[i] is white space): `\s+(?!\S)|\s+`, and with crlf first `\s*[\r\n]+` */
static size_t space_end(const uint8_t *s, size_t n, size_t i, int crlf)
{
    size_t j = i, last = i, count = 0, last_nl = (size_t)-1;
    while (j < n) {
        size_t len;
        int k = bpe_class_at(s, n, j, &len);
        if (!(k & UC_S)) break;
        if (s[j] == '\r' || s[j] == '\n') last_nl = j;
        last = j;
        j += len;
        count++;
    }
    if (crlf && last_nl != (size_t)-1) return last_nl + 1;   /* \s*[\r\n]+ ends after the run's last CR/LF */
    if (j == n || count == 1) return j;                      /* \s+(?!\S) to the end, or a lone \s+ */
    return last;                                             /* backtracked: the last space stays */
}

static size_t gpt2_end(const uint8_t *s, size_t n, size_t i)
{
    uint8_t c = s[i];
    if (c == '\'' && i + 1 < n) {
        uint8_t d = s[i + 1];
        if (d == 's' || d == 't' || d == 'm' || d == 'd') return i + 2;
        if (i + 2 < n && ((d == 'r' && s[i + 2] == 'e') || (d == 'v' && s[i + 2] == 'e') || (d == 'l' && s[i + 2] == 'l')))
            return i + 3;
    }
    size_t len;
    int k = bpe_class_at(s, n, i, &len);
    if (c == ' ' && i + 1 < n) {
        size_t l2;
        int k2 = bpe_class_at(s, n, i + 1, &l2);
        if (k2 & UC_L) return run(s, n, i + 1, UC_L);
        if (k2 & UC_N) return run(s, n, i + 1, UC_N);
        if (is_other(k2)) return run(s, n, i + 1, 0);
    }
    if (k & UC_L) return run(s, n, i, UC_L);
    if (k & UC_N) return run(s, n, i, UC_N);
    if (is_other(k)) return run(s, n, i, 0);
    return space_end(s, n, i, 0);
}

/* (?i:'s|'t|'re|'ve|'m|'ll|'d) after the apostrophe at j - 1: the end, or 0. Case folding maps U+017F (long s)
   to s as well. */
static size_t contraction_ci(const uint8_t *s, size_t n, size_t j)
{
    uint8_t d = (uint8_t)(s[j] | 0x20);
    int ascii = s[j] < 0x80 && ((s[j] >= 'a' && s[j] <= 'z') || (s[j] >= 'A' && s[j] <= 'Z'));
    if (ascii && (d == 's' || d == 't' || d == 'm' || d == 'd')) return j + 1;
    if (s[j] == 0xC5 && j + 1 < n && s[j + 1] == 0xBF) return j + 2;
    if (ascii && j + 1 < n && s[j + 1] < 0x80) {
        uint8_t e = (uint8_t)(s[j + 1] | 0x20);
        int e_ascii = (s[j + 1] >= 'a' && s[j + 1] <= 'z') || (s[j + 1] >= 'A' && s[j + 1] <= 'Z');
        if (e_ascii && ((d == 'r' && e == 'e') || (d == 'v' && e == 'e') || (d == 'l' && e == 'l'))) return j + 2;
    }
    return 0;
}

static size_t llama3_end(const uint8_t *s, size_t n, size_t i)
{
    uint8_t c = s[i];
    if (c == '\'' && i + 1 < n) {
        size_t e = contraction_ci(s, n, i + 1);
        if (e) return e;
    }
    size_t len;
    int k = bpe_class_at(s, n, i, &len);
    /* [^\r\n\p{L}\p{N}]?\p{L}+ */
    if (k & UC_L) return run(s, n, i, UC_L);
    if (c != '\r' && c != '\n' && !(k & UC_N) && i + len < n) {
        size_t l2;
        if (bpe_class_at(s, n, i + len, &l2) & UC_L) return run(s, n, i + len, UC_L);
    }
    /* \p{N}{1,3} */
    if (k & UC_N) {
        size_t j = i;
        for (int t = 0; t < 3 && j < n; t++) {
            size_t l;
            if (!(bpe_class_at(s, n, j, &l) & UC_N)) break;
            j += l;
        }
        return j;
    }
    /*  ?[^\s\p{L}\p{N}]+[\r\n]* */
    size_t j = 0;
    if (c == ' ' && i + 1 < n) {
        size_t l2;
        if (is_other(bpe_class_at(s, n, i + 1, &l2))) j = run(s, n, i + 1, 0);
    }
    if (!j && is_other(k)) j = run(s, n, i, 0);
    if (j) {
        while (j < n && (s[j] == '\r' || s[j] == '\n')) j++;
        return j;
    }
    return space_end(s, n, i, 1);
}

size_t bpe_piece_end(int pat, const uint8_t *s, size_t n, size_t i)
{
    return pat == BPE_PAT_LLAMA3 ? llama3_end(s, n, i) : gpt2_end(s, n, i);
}

/* ---- added tokens --------------------------------------------------------------------------------- */
static int by_first_then_longest(const void *pa, const void *pb)
{
    const bpe_added *a = *(const bpe_added *const *)pa, *b = *(const bpe_added *const *)pb;
    if (a->content[0] != b->content[0]) return a->content[0] < b->content[0] ? -1 : 1;
    if (a->len != b->len) return a->len > b->len ? -1 : 1;
    return a->id < b->id ? -1 : a->id > b->id;
}

int bpe_added_set_build(bpe_added_set *set, const bpe_added *tokens, int n, int normalized)
{
    memset(set, 0, sizeof *set);
    int k = 0;
    for (int i = 0; i < n; i++) k += (tokens[i].normalized != 0) == (normalized != 0);
    set->tok = malloc((size_t)(k ? k : 1) * sizeof *set->tok);
    if (!set->tok) return tide_set_error("tokenizer: out of memory for %d added tokens", k);
    for (int i = 0; i < n; i++)
        if ((tokens[i].normalized != 0) == (normalized != 0)) set->tok[set->n++] = &tokens[i];
    qsort(set->tok, (size_t)set->n, sizeof *set->tok, by_first_then_longest);
    int t = 0;
    for (int c = 0; c <= 256; c++) {
        while (t < set->n && set->tok[t]->content[0] < c) t++;
        set->first[c] = t;
    }
    return 0;
}

void bpe_added_set_free(bpe_added_set *set)
{
    free(set->tok);
    memset(set, 0, sizeof *set);
}

static int segs_push(bpe_segs *o, size_t a, size_t b, int32_t id)
{
    if (o->n == o->cap) {
        size_t nc = o->cap ? o->cap * 2 : 64;
        bpe_seg *v = realloc(o->v, nc * sizeof *v);
        if (!v) return tide_set_error("tokenizer: out of memory splitting added tokens");
        o->v = v;
        o->cap = nc;
    }
    o->v[o->n++] = (bpe_seg){ a, b, id };
    return 0;
}

/* the longest token of `set` that starts at s[i] and ends by hi */
static const bpe_added *longest_at(const bpe_added_set *set, const uint8_t *s, size_t i, size_t hi)
{
    int c = s[i];
    for (int t = set->first[c]; t < set->first[c + 1]; t++) {
        const bpe_added *a = set->tok[t];
        if (a->len <= hi - i && !memcmp(s + i, a->content, a->len)) return a;
    }
    return NULL;
}

int bpe_added_split(const bpe_added_set *set, const uint8_t *s, size_t lo, size_t hi, bpe_segs *out)
{
    if (set->n == 0) return hi > lo ? segs_push(out, lo, hi, -1) : 0;
    size_t start_offset = lo, i = lo;
    while (i < hi) {
        /* leftmost, then longest (an Aho-Corasick LeftmostLongest scan over the slice) */
        if (set->first[s[i]] == set->first[s[i] + 1]) { i++; continue; }
        const bpe_added *a = longest_at(set, s, i, hi);
        if (!a) { i++; continue; }
        size_t start = i, stop = i + a->len;
        i = stop;   /* the scan goes on after the match, whatever the options below make of it */
        if (a->single_word) {
            int start_space = start == lo || !(bpe_class_before(s + lo, start - lo) & UC_W);
            size_t l;
            int stop_space = stop == hi || !(bpe_class_at(s, hi, stop, &l) & UC_W);
            if (!start_space || !stop_space) continue;
        }
        if (a->lstrip) {
            size_t ns = start;   /* the start of the white space that ends at `start` */
            while (ns > lo) {
                size_t back = ns - 1;
                for (int k = 0; k < 3 && back > lo && bpe_cont(s[back]); k++) back--;
                uint32_t cp;
                size_t len = bpe_utf8(s, ns, back, &cp);
                if (back + len != ns || !(bpe_class(cp) & UC_S)) break;
                ns = back;
            }
            start = ns > start_offset ? ns : start_offset;
        }
        if (a->rstrip) {
            while (stop < hi) {
                size_t len;
                if (!(bpe_class_at(s, hi, stop, &len) & UC_S)) break;
                stop += len;
            }
        }
        if (start_offset < start && segs_push(out, start_offset, start, -1)) return -1;
        if (segs_push(out, start, stop, a->id)) return -1;
        start_offset = stop;
    }
    if (start_offset < hi && segs_push(out, start_offset, hi, -1)) return -1;
    return 0;
}

/* ---- buffers -------------------------------------------------------------------------------------- */
int bpe_ivec_grow(bpe_ivec *a, size_t need)
{
    if (a->n + need <= a->cap) return 0;
    size_t nc = a->cap ? a->cap : 256;
    while (nc < a->n + need) nc *= 2;
    int32_t *v = realloc(a->v, nc * sizeof *v);
    if (!v) return tide_set_error("tokenizer: out of memory for %zu token ids", nc);
    a->v = v;
    a->cap = nc;
    return 0;
}

int bpe_zvec_push(bpe_zvec *a, size_t x)
{
    if (a->n == a->cap) {
        size_t nc = a->cap ? a->cap * 2 : 64;
        size_t *v = realloc(a->v, nc * sizeof *v);
        if (!v) return tide_set_error("tokenizer: out of memory");
        a->v = v;
        a->cap = nc;
    }
    a->v[a->n++] = x;
    return 0;
}

int bpe_buf_put(bpe_buf *b, const void *p, size_t n)
{
    if (b->n + n + 1 > b->cap) {
        size_t nc = b->cap ? b->cap : 4096;
        while (nc < b->n + n + 1) nc *= 2;
        char *v = realloc(b->v, nc);
        if (!v) return tide_set_error("tokenizer: out of memory for %zu bytes", nc);
        b->v = v;
        b->cap = nc;
    }
    memcpy(b->v + b->n, p, n);
    b->n += n;
    b->v[b->n] = 0;
    return 0;
}

int bpe_buf_printf(bpe_buf *b, const char *fmt, ...)
{
    char tmp[512];
    va_list ap;
    va_start(ap, fmt);
    int k = vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    if (k < 0 || (size_t)k >= sizeof tmp) return tide_set_error("tokenizer: formatted text too long");
    return bpe_buf_put(b, tmp, (size_t)k);
}

int bpe_buf_json_string(bpe_buf *b, const char *s, size_t n)
{
    size_t run_start = 0;
    for (size_t i = 0; i < n; i++) {
        uint8_t c = (uint8_t)s[i];
        if (c >= 0x20 && c != '"' && c != '\\') continue;
        if (bpe_buf_put(b, s + run_start, i - run_start)) return -1;
        char esc[8];
        if (c == '"') memcpy(esc, "\\\"", 3);
        else if (c == '\\') memcpy(esc, "\\\\", 3);
        else if (c == '\n') memcpy(esc, "\\n", 3);
        else if (c == '\t') memcpy(esc, "\\t", 3);
        else if (c == '\r') memcpy(esc, "\\r", 3);
        else snprintf(esc, sizeof esc, "\\u%04x", c);
        if (bpe_buf_put(b, esc, strlen(esc))) return -1;
        run_start = i + 1;
    }
    return bpe_buf_put(b, s + run_start, n - run_start);
}

const char *bpe_show(const void *p, size_t n, char *buf, size_t bufn)
{
    const uint8_t *s = p;
    size_t k = 0;
    size_t lim = bufn > 8 ? bufn - 8 : 0;
    buf[k++] = '\'';
    for (size_t i = 0; i < n && k < lim; i++) {
        if (i >= 40) { memcpy(buf + k, "...", 3); k += 3; break; }
        if (s[i] < 0x20 || s[i] == 0x7F) k += (size_t)snprintf(buf + k, bufn - k, "\\x%02x", s[i]);
        else buf[k++] = (char)s[i];
    }
    buf[k++] = '\'';
    buf[k] = 0;
    return buf;
}

/* ---- independent chunks of a document ------------------------------------------------------------ */
static int printable(uint8_t c) { return c > 0x20 && c < 0x7F; }

static int boundary_ok(const uint8_t *s, size_t n, size_t p, const bpe_added *added, int n_added)
{
    if (p < 2 || p >= n || s[p - 1] != '\n' || !printable(s[p - 2]) || !printable(s[p])) return 0;
    for (int t = 0; t < n_added; t++) {
        const bpe_added *a = &added[t];
        if (a->lstrip && a->len <= n - p && !memcmp(s + p, a->content, a->len)) return 0;
        /* an occurrence that starts before p and ends after it */
        for (size_t q = p >= a->len ? p - a->len + 1 : 0; q < p; q++)
            if (q + a->len <= n && !memcmp(s + q, a->content, a->len)) return 0;
    }
    return 1;
}

int bpe_chunk_ends(const uint8_t *s, size_t n, size_t target, const bpe_added *added, int n_added, bpe_zvec *ends)
{
    size_t from = 0;
    while (n - from > target + target / 2) {
        size_t p = from + target;
        const uint8_t *nl;
        while (p < n && (nl = memchr(s + p, '\n', n - p)) != NULL) {
            p = (size_t)(nl - s) + 1;
            if (boundary_ok(s, n, p, added, n_added)) break;
        }
        if (p >= n || !boundary_ok(s, n, p, added, n_added)) break;
        if (bpe_zvec_push(ends, p)) return -1;
        from = p;
    }
    return bpe_zvec_push(ends, n);
}
