/*
 * bpe_jsonl.c — the text of JSONL documents (formats.md §5), the input of tokenization: one JSON object per line,
 * its `field` string is the document. Blank lines are skipped; a line over 64 MiB, nested deeper than 64, not
 * an object, without the field, with a field that is not a string, or holding \u0000 (which a C string cannot
 * carry) is an error naming label:line. Lines are parsed on all threads in contiguous blocks, so the documents
 * keep their order and the first error reported is the one on the earliest line.
 */
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cjson/cJSON.h>
#include "bpe_internal.h"

enum { LINE_MAX_BYTES = 64 << 20, DEPTH_MAX = 64 };

/* nesting depth of the JSON text p[0, n) outside strings (the parser's own limit is far larger) */
static int depth_of(const char *p, size_t n)
{
    int depth = 0, worst = 0, in_str = 0;
    for (size_t i = 0; i < n; i++) {
        char c = p[i];
        if (in_str) {
            if (c == '\\') i++;
            else if (c == '"') in_str = 0;
        } else if (c == '"') in_str = 1;
        else if (c == '{' || c == '[') { if (++depth > worst) worst = depth; }
        else if (c == '}' || c == ']') depth--;
    }
    return worst;
}

/* a \u0000 escape in a JSON string (an odd run of backslashes before "u0000") */
static int has_nul_escape(const char *p, size_t n)
{
    for (size_t i = 0; i + 6 <= n; i++) {
        if (p[i] != '\\' || memcmp(p + i + 1, "u0000", 5)) continue;
        size_t k = 0;
        while (k < i && p[i - 1 - k] == '\\') k++;
        if (k % 2 == 0) return 1;
    }
    return 0;
}

static int blank(const char *p, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (p[i] != ' ' && p[i] != '\t' && p[i] != '\r') return 0;
    return 1;
}

typedef struct {
    bpe_buf text;
    bpe_zvec lens;
    size_t err_line;               /* 1-based; 0 = none */
    char err[512];
} block;

static const char *kind(const cJSON *x)
{
    if (cJSON_IsNull(x)) return "null";
    if (cJSON_IsBool(x)) return "a boolean";
    if (cJSON_IsNumber(x)) return "a number";
    if (cJSON_IsString(x)) return "a string";
    if (cJSON_IsArray(x)) return "an array";
    return "an object";
}

/* one line: 0 and the text appended, or an error message in blk->err */
static int one_line(block *blk, const char *p, size_t n, const char *fieldname)
{
    if (n > LINE_MAX_BYTES) {
        snprintf(blk->err, sizeof blk->err, "the line is %zu bytes, over the limit of %d", n, LINE_MAX_BYTES);
        return -1;
    }
    if (blank(p, n)) return 0;
    if (depth_of(p, n) > DEPTH_MAX) {
        snprintf(blk->err, sizeof blk->err, "JSON nested deeper than %d", DEPTH_MAX);
        return -1;
    }
    const char *end = NULL;
    cJSON *doc = cJSON_ParseWithLengthOpts(p, n, &end, 0);
    if (!doc) {
        size_t col = end && end >= p && end <= p + n ? (size_t)(end - p) + 1 : 1;
        snprintf(blk->err, sizeof blk->err, "malformed JSON (at column %zu)", col);
        return -1;
    }
    int rc = -1;
    if (end && end < p + n && !blank(end, (size_t)(p + n - end)))
        snprintf(blk->err, sizeof blk->err, "text after the JSON value (at column %zu)", (size_t)(end - p) + 1);
    else if (!cJSON_IsObject(doc))
        snprintf(blk->err, sizeof blk->err, "expected a JSON object, got %s", kind(doc));
    else {
        const cJSON *f = cJSON_GetObjectItemCaseSensitive(doc, fieldname);
        if (!f) snprintf(blk->err, sizeof blk->err, "no \"%s\" field", fieldname);
        else if (!cJSON_IsString(f)) snprintf(blk->err, sizeof blk->err, "\"%s\" must be a string, got %s", fieldname, kind(f));
        else if (has_nul_escape(p, n)) snprintf(blk->err, sizeof blk->err, "the line holds \\u0000, which tide's text cannot hold");
        else {
            size_t len = strlen(f->valuestring);
            rc = bpe_buf_put(&blk->text, f->valuestring, len) || bpe_zvec_push(&blk->lens, len) ? -1 : 0;
            if (rc) snprintf(blk->err, sizeof blk->err, "out of memory");
        }
    }
    cJSON_Delete(doc);
    return rc;
}

char *tide_jsonl_texts(const char *buf, size_t n, const char *fieldname, const char *label, int64_t **offsets,
                       int64_t *n_docs)
{
    const char *lab = label && label[0] ? label : "(jsonl)";
    if (offsets) *offsets = NULL;
    if (n_docs) *n_docs = 0;
    if ((!buf && n) || !fieldname || !fieldname[0] || !offsets || !n_docs) {
        tide_set_error("jsonl '%s': bad arguments", lab);
        return NULL;
    }
    if (n >= 3 && !memcmp(buf, "\xEF\xBB\xBF", 3)) {
        tide_set_error("%s:1: the file starts with a byte order mark (JSONL has none)", lab);
        return NULL;
    }
    /* line starts */
    bpe_zvec starts = { 0 };
    int rc = 0;
    for (size_t at = 0; at < n && !rc;) {
        rc = bpe_zvec_push(&starts, at);
        const char *nl = memchr(buf + at, '\n', n - at);
        at = nl ? (size_t)(nl - buf) + 1 : n;
    }
    if (!rc) rc = bpe_zvec_push(&starts, n);
    if (rc) { free(starts.v); return NULL; }
    size_t n_lines = starts.n - 1;
    int nt = omp_get_max_threads();
    if (nt < 1) nt = 1;
    if ((size_t)nt > n_lines / 64 + 1) nt = (int)(n_lines / 64 + 1);
    block *blocks = calloc((size_t)nt, sizeof *blocks);
    if (!blocks) { free(starts.v); tide_set_error("jsonl '%s': out of memory", lab); return NULL; }
    #pragma omp parallel for num_threads(nt) schedule(static, 1)
    for (int k = 0; k < nt; k++) {
        size_t lo = n_lines * (size_t)k / (size_t)nt, hi = n_lines * (size_t)(k + 1) / (size_t)nt;
        for (size_t l = lo; l < hi; l++) {
            size_t a = starts.v[l], e = starts.v[l + 1];
            if (e > a && buf[e - 1] == '\n') e--;
            if (one_line(&blocks[k], buf + a, e - a, fieldname)) { blocks[k].err_line = l + 1; break; }
        }
    }
    free(starts.v);
    char *text = NULL;
    int64_t *offs = NULL;
    size_t total = 0, docs = 0;
    for (int k = 0; k < nt; k++) {
        if (blocks[k].err_line) {
            tide_set_error("%s:%zu: %s", lab, blocks[k].err_line, blocks[k].err);
            rc = -1;
            break;
        }
        total += blocks[k].text.n;
        docs += blocks[k].lens.n;
    }
    if (!rc) {
        text = malloc(total ? total : 1);
        offs = malloc((docs + 1) * sizeof *offs);
        if (!text || !offs) { rc = tide_set_error("jsonl '%s': out of memory for %zu bytes", lab, total); }
    }
    if (!rc) {
        size_t pos = 0, d = 0;
        for (int k = 0; k < nt; k++) {
            if (blocks[k].text.n) memcpy(text + pos, blocks[k].text.v, blocks[k].text.n);
            for (size_t j = 0; j < blocks[k].lens.n; j++) {
                offs[d++] = (int64_t)pos;
                pos += blocks[k].lens.v[j];
            }
        }
        offs[d] = (int64_t)pos;
        *offsets = offs;
        *n_docs = (int64_t)docs;
    }
    for (int k = 0; k < nt; k++) {
        free(blocks[k].text.v);
        free(blocks[k].lens.v);
    }
    free(blocks);
    if (rc) {
        free(text);
        free(offs);
        return NULL;
    }
    return text;
}
