/*
 * bpe_train.c — byte-level BPE training, and the tokenizer.json it writes (formats.md §4).
 *
 * Counting: the special tokens are split out of each document (as encoding does), the rest is pre-tokenized
 * with the GPT-2 regex and every distinct pre-token counted (per-thread hash maps, merged after each call;
 * long documents in the chunks bpe_chunk_ends finds, which pre-tokenize as the whole document would).
 * Merging: each word is a sequence of ids (0-255 the bytes); a pair's count is the sum over the words it occurs
 * in, times the word's count. The most frequent pair (ties: the smaller left id, then the smaller right id) is
 * merged everywhere it occurs, left to right; its words' pair counts are updated and the new pairs go on a
 * max-heap whose stale entries are re-pushed when popped (a pair's count only falls once it exists). A merge
 * whose bytes already are a token reuses that id, as the tokenizers trainer does, so vocab entries are unique.
 */
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "bpe_internal.h"

enum { SPECIAL_MAX = 4096, CHUNK = 1 << 20 };

/* ---- word counts: bytes -> count ------------------------------------------------------------------- */
typedef struct { uint64_t hash; uint64_t off; uint32_t len; int64_t count; } wslot;
typedef struct { wslot *s; size_t cap, n; bpe_buf keys; } wmap;

static int wmap_init(wmap *m)
{
    memset(m, 0, sizeof *m);
    m->cap = 1024;
    m->s = calloc(m->cap, sizeof *m->s);
    return m->s ? 0 : tide_set_error("tokenizer train: out of memory");
}

static void wmap_free(wmap *m)
{
    free(m->s);
    free(m->keys.v);
    memset(m, 0, sizeof *m);
}

static int wmap_grow(wmap *m)
{
    size_t nc = m->cap * 2;
    wslot *s = calloc(nc, sizeof *s);
    if (!s) return tide_set_error("tokenizer train: out of memory for %zu words", m->n);
    for (size_t i = 0; i < m->cap; i++) {
        if (!m->s[i].len) continue;
        size_t j = m->s[i].hash & (nc - 1);
        while (s[j].len) j = (j + 1) & (nc - 1);
        s[j] = m->s[i];
    }
    free(m->s);
    m->s = s;
    m->cap = nc;
    return 0;
}

static int wmap_add(wmap *m, const uint8_t *p, size_t n, uint64_t h, int64_t count)
{
    size_t i = h & (m->cap - 1);
    for (;;) {
        wslot *e = &m->s[i];
        if (!e->len) break;
        if (e->hash == h && e->len == n && !memcmp(m->keys.v + e->off, p, n)) { e->count += count; return 0; }
        i = (i + 1) & (m->cap - 1);
    }
    if (n > UINT32_MAX) return tide_set_error("tokenizer train: a pre-token of %zu bytes", n);
    uint64_t off = m->keys.n;
    if (bpe_buf_put(&m->keys, p, n)) return -1;
    m->s[i] = (wslot){ h, off, (uint32_t)n, count };
    m->n++;
    if (m->n * 2 > m->cap && wmap_grow(m)) return -1;
    return 0;
}

/* ---- pairs -------------------------------------------------------------------------------------------- */
typedef struct { int32_t *v; int32_t n, cap; } wlist;
typedef struct { int64_t count; uint64_t key; } hentry;

struct tide_bpe_trainer {
    int n_specials;
    bpe_added *specials;
    bpe_added_set set;
    wmap words;                    /* counting */
    int frozen;                    /* merging started: no more documents */
    /* words as id sequences */
    int64_t n_words;
    int64_t *wcount;
    size_t *woff;                  /* into wsym */
    int32_t *wlen;
    int32_t *wsym;
    int64_t *wstamp;
    /* tokens: bytes of every id */
    int32_t n_tokens;
    bpe_buf tbytes;
    size_t *toff;
    uint32_t *tlen;
    size_t tcap;
    struct { uint64_t hash; size_t off; uint32_t len; int32_t id; } *tmap;   /* token bytes -> id */
    size_t tmap_cap;
    /* merges made */
    int64_t n_merges, merges_cap;
    int32_t *merge_a, *merge_b;
    /* pair statistics */
    uint64_t *pkey;
    int64_t *pcount;
    wlist *pwhere;
    int64_t *pstamp;
    int64_t n_pairs, pairs_cap;
    struct { uint64_t key; int64_t idx; } *pmap;
    size_t pmap_cap;
    hentry *heap;
    int64_t heap_n, heap_cap;
};

static int64_t pair_find(const tide_bpe_trainer *t, uint64_t key)
{
    if (!t->pmap_cap) return -1;
    size_t i = bpe_mix64(key) & (t->pmap_cap - 1);
    for (;;) {
        if (t->pmap[i].idx < 0) return -1;
        if (t->pmap[i].key == key) return t->pmap[i].idx;
        i = (i + 1) & (t->pmap_cap - 1);
    }
}

static int pair_grow_map(tide_bpe_trainer *t)
{
    size_t nc = t->pmap_cap ? t->pmap_cap * 2 : 1 << 10;
    void *m = malloc(nc * sizeof *t->pmap);
    if (!m) return tide_set_error("tokenizer train: out of memory for %lld pairs", (long long)t->n_pairs);
    __typeof__(t->pmap) nm = m;
    for (size_t i = 0; i < nc; i++) nm[i].idx = -1;
    for (size_t i = 0; i < t->pmap_cap; i++) {
        if (t->pmap[i].idx < 0) continue;
        size_t j = bpe_mix64(t->pmap[i].key) & (nc - 1);
        while (nm[j].idx >= 0) j = (j + 1) & (nc - 1);
        nm[j] = t->pmap[i];
    }
    free(t->pmap);
    t->pmap = nm;
    t->pmap_cap = nc;
    return 0;
}

/* the index of pair `key`, made when new; -1 on out of memory */
static int64_t pair_get(tide_bpe_trainer *t, uint64_t key)
{
    int64_t idx = pair_find(t, key);
    if (idx >= 0) return idx;
    if ((size_t)(t->n_pairs + 1) * 2 > t->pmap_cap && pair_grow_map(t)) return -1;
    if (t->n_pairs == t->pairs_cap) {
        int64_t nc = t->pairs_cap ? t->pairs_cap * 2 : 1 << 9;
        uint64_t *k = realloc(t->pkey, (size_t)nc * sizeof *k);
        if (k) t->pkey = k;
        int64_t *c = realloc(t->pcount, (size_t)nc * sizeof *c);
        if (c) t->pcount = c;
        wlist *w = realloc(t->pwhere, (size_t)nc * sizeof *w);
        if (w) t->pwhere = w;
        int64_t *s = realloc(t->pstamp, (size_t)nc * sizeof *s);
        if (s) t->pstamp = s;
        if (!k || !c || !w || !s) { tide_set_error("tokenizer train: out of memory for pairs"); return -1; }
        t->pairs_cap = nc;
    }
    idx = t->n_pairs++;
    t->pkey[idx] = key;
    t->pcount[idx] = 0;
    t->pwhere[idx] = (wlist){ 0 };
    t->pstamp[idx] = -1;
    size_t i = bpe_mix64(key) & (t->pmap_cap - 1);
    while (t->pmap[i].idx >= 0) i = (i + 1) & (t->pmap_cap - 1);
    t->pmap[i].key = key;
    t->pmap[i].idx = idx;
    return idx;
}

static int wlist_push(wlist *l, int32_t w)
{
    if (l->n == l->cap) {
        int32_t nc = l->cap ? l->cap * 2 : 4;
        int32_t *v = realloc(l->v, (size_t)nc * sizeof *v);
        if (!v) return tide_set_error("tokenizer train: out of memory");
        l->v = v;
        l->cap = nc;
    }
    l->v[l->n++] = w;
    return 0;
}

/* max-heap: larger count first, then the smaller key (left id, then right id) */
static inline int hbefore(hentry a, hentry b) { return a.count > b.count || (a.count == b.count && a.key < b.key); }

static int heap_push(tide_bpe_trainer *t, int64_t count, uint64_t key)
{
    if (t->heap_n == t->heap_cap) {
        int64_t nc = t->heap_cap ? t->heap_cap * 2 : 1 << 9;
        hentry *h = realloc(t->heap, (size_t)nc * sizeof *h);
        if (!h) return tide_set_error("tokenizer train: out of memory");
        t->heap = h;
        t->heap_cap = nc;
    }
    hentry x = { count, key };
    int64_t i = t->heap_n++;
    while (i > 0) {
        int64_t p = (i - 1) / 2;
        if (!hbefore(x, t->heap[p])) break;
        t->heap[i] = t->heap[p];
        i = p;
    }
    t->heap[i] = x;
    return 0;
}

static hentry heap_pop(tide_bpe_trainer *t)
{
    hentry top = t->heap[0], x = t->heap[--t->heap_n];
    int64_t i = 0, m = t->heap_n;
    for (;;) {
        int64_t l = 2 * i + 1;
        if (l >= m) break;
        int64_t r = l + 1, c = r < m && hbefore(t->heap[r], t->heap[l]) ? r : l;
        if (!hbefore(t->heap[c], x)) break;
        t->heap[i] = t->heap[c];
        i = c;
    }
    if (m) t->heap[i] = x;
    return top;
}

/* ---- tokens ------------------------------------------------------------------------------------------- */
static int32_t token_find(const tide_bpe_trainer *t, const uint8_t *p, size_t n, uint64_t h)
{
    if (!t->tmap_cap) return -1;
    size_t i = h & (t->tmap_cap - 1);
    for (;;) {
        if (t->tmap[i].id < 0) return -1;
        if (t->tmap[i].hash == h && t->tmap[i].len == n && !memcmp(t->tbytes.v + t->tmap[i].off, p, n))
            return t->tmap[i].id;
        i = (i + 1) & (t->tmap_cap - 1);
    }
}

static int token_add(tide_bpe_trainer *t, const uint8_t *p, size_t n)
{
    if ((size_t)t->n_tokens + 1 > t->tcap) {
        size_t nc = t->tcap ? t->tcap * 2 : 1024;
        size_t *o = realloc(t->toff, nc * sizeof *o);
        if (o) t->toff = o;
        uint32_t *l = realloc(t->tlen, nc * sizeof *l);
        if (l) t->tlen = l;
        if (!o || !l) return tide_set_error("tokenizer train: out of memory");
        t->tcap = nc;
    }
    if ((size_t)(t->n_tokens + 1) * 2 > t->tmap_cap) {
        size_t nc = t->tmap_cap ? t->tmap_cap * 2 : 4096;
        void *m = malloc(nc * sizeof *t->tmap);
        if (!m) return tide_set_error("tokenizer train: out of memory");
        __typeof__(t->tmap) nm = m;
        for (size_t i = 0; i < nc; i++) nm[i].id = -1;
        for (size_t i = 0; i < t->tmap_cap; i++) {
            if (t->tmap[i].id < 0) continue;
            size_t j = t->tmap[i].hash & (nc - 1);
            while (nm[j].id >= 0) j = (j + 1) & (nc - 1);
            nm[j] = t->tmap[i];
        }
        free(t->tmap);
        t->tmap = nm;
        t->tmap_cap = nc;
    }
    size_t off = t->tbytes.n;
    if (bpe_buf_put(&t->tbytes, p, n)) return -1;
    int32_t id = t->n_tokens++;
    t->toff[id] = off;
    t->tlen[id] = (uint32_t)n;
    uint64_t h = bpe_hash(p, n);
    size_t i = h & (t->tmap_cap - 1);
    while (t->tmap[i].id >= 0) i = (i + 1) & (t->tmap_cap - 1);
    t->tmap[i].hash = h;
    t->tmap[i].off = off;
    t->tmap[i].len = (uint32_t)n;
    t->tmap[i].id = id;
    return 0;
}

/* ---- the trainer --------------------------------------------------------------------------------------- */
void tide_bpe_trainer_free(tide_bpe_trainer *t)
{
    if (!t) return;
    for (int i = 0; i < t->n_specials; i++) free((void *)t->specials[i].content);
    free(t->specials);
    bpe_added_set_free(&t->set);
    wmap_free(&t->words);
    free(t->wcount);
    free(t->woff);
    free(t->wlen);
    free(t->wsym);
    free(t->wstamp);
    free(t->tbytes.v);
    free(t->toff);
    free(t->tlen);
    free(t->tmap);
    free(t->merge_a);
    free(t->merge_b);
    for (int64_t i = 0; i < t->n_pairs; i++) free(t->pwhere[i].v);
    free(t->pkey);
    free(t->pcount);
    free(t->pwhere);
    free(t->pstamp);
    free(t->pmap);
    free(t->heap);
    free(t);
}

tide_bpe_trainer *tide_bpe_trainer_new(const char *const *specials, int n_specials)
{
    bpe_unicode_init();
    if (n_specials < 0 || n_specials > SPECIAL_MAX || (n_specials && !specials)) {
        tide_set_error("tokenizer train: %d special tokens; give 0 to %d", n_specials, SPECIAL_MAX);
        return NULL;
    }
    tide_bpe_trainer *t = calloc(1, sizeof *t);
    if (!t) { tide_set_error("tokenizer train: out of memory"); return NULL; }
    t->specials = calloc((size_t)(n_specials ? n_specials : 1), sizeof *t->specials);
    if (!t->specials || wmap_init(&t->words)) goto oom;
    for (int c = 0; c < 256; c++) {
        uint8_t b = (uint8_t)c;
        if (token_add(t, &b, 1)) goto fail;
    }
    for (int i = 0; i < n_specials; i++) {
        const char *s = specials[i];
        size_t len = s ? strlen(s) : 0;
        if (!len || len > 256) {
            tide_set_error("tokenizer train: special token %d is %s", i, len ? "over 256 bytes" : "empty");
            goto fail;
        }
        for (int j = 0; j < i; j++)
            if (!strcmp((const char *)t->specials[j].content, s)) {
                char show[96];
                tide_set_error("tokenizer train: special token %s is given twice", bpe_show(s, len, show, sizeof show));
                goto fail;
            }
        char *copy = strdup(s);
        if (!copy) goto oom;
        t->specials[i] = (bpe_added){ (const uint8_t *)copy, (uint32_t)len, 256 + i, 1, 0, 0, 0, 0 };
        t->n_specials = i + 1;
        /* the special's bytes are its token in model.vocab (ids 256...), so a merge can never make them */
        if (token_add(t, (const uint8_t *)s, len)) goto fail;
    }
    if (bpe_added_set_build(&t->set, t->specials, t->n_specials, 0)) goto fail;
    return t;
oom:
    tide_set_error("tokenizer train: out of memory");
fail:
    tide_bpe_trainer_free(t);
    return NULL;
}

typedef struct { size_t a, e; } span;

/* the pre-tokens of s[0, n) into m */
static int count_text(const tide_bpe_trainer *t, const uint8_t *s, size_t n, wmap *m, bpe_segs *segs)
{
    segs->n = 0;
    if (bpe_added_split(&t->set, s, 0, n, segs)) return -1;
    for (size_t k = 0; k < segs->n; k++) {
        if (segs->v[k].id >= 0) continue;
        const uint8_t *p = s + segs->v[k].a;
        size_t len = segs->v[k].b - segs->v[k].a;
        for (size_t i = 0; i < len;) {
            size_t e = bpe_piece_end(BPE_PAT_GPT2, p, len, i);
            /* one byte has no pair: it never changes the merges */
            if (e - i >= 2 && wmap_add(m, p + i, e - i, bpe_hash(p + i, e - i), 1)) return -1;
            i = e;
        }
    }
    return 0;
}

int tide_bpe_trainer_add_docs(tide_bpe_trainer *t, const char *text, const int64_t *offsets, int64_t n_docs)
{
    if (!t || !offsets || n_docs < 0) return tide_set_error("tokenizer train: bad arguments");
    if (t->frozen) return tide_set_error("tokenizer train: documents added after merging started");
    span *items = NULL;
    size_t n_items = 0, cap = 0;
    bpe_zvec ends = { 0 };
    int rc = 0;
    for (int64_t d = 0; d < n_docs && !rc; d++) {
        if (offsets[d] < 0 || offsets[d + 1] < offsets[d])
            { rc = tide_set_error("tokenizer train: offsets[%lld] are not ascending", (long long)d); break; }
        const uint8_t *s = (const uint8_t *)text + offsets[d];
        size_t len = (size_t)(offsets[d + 1] - offsets[d]);
        ends.n = 0;
        rc = len > 2 * CHUNK ? bpe_chunk_ends(s, len, CHUNK, t->specials, t->n_specials, &ends) : bpe_zvec_push(&ends, len);
        size_t from = 0;
        for (size_t k = 0; k < ends.n && !rc; k++) {
            if (n_items == cap) {
                size_t nc = cap ? cap * 2 : 1024;
                span *v = realloc(items, nc * sizeof *v);
                if (!v) { rc = tide_set_error("tokenizer train: out of memory"); break; }
                items = v;
                cap = nc;
            }
            items[n_items++] = (span){ (size_t)offsets[d] + from, (size_t)offsets[d] + ends.v[k] };
            from = ends.v[k];
        }
    }
    free(ends.v);
    int nt = omp_get_max_threads();
    if (nt < 1) nt = 1;
    wmap *local = rc ? NULL : calloc((size_t)nt, sizeof *local);
    if (!rc && !local) rc = tide_set_error("tokenizer train: out of memory");
    char err[2048] = "";
    if (!rc) {
        #pragma omp parallel num_threads(nt)
        {
            int me = omp_get_thread_num();
            bpe_segs segs = { 0 };
            int bad = wmap_init(&local[me]);
            #pragma omp for schedule(dynamic, 1)
            for (size_t i = 0; i < n_items; i++) {
                if (bad) continue;
                bad = count_text(t, (const uint8_t *)text + items[i].a, items[i].e - items[i].a, &local[me], &segs);
                if (bad) {
                    #pragma omp critical(tide_bpe_train_err)
                    if (!err[0]) snprintf(err, sizeof err, "%s", tide_last_error());
                }
            }
            free(segs.v);
        }
        if (err[0]) rc = tide_set_error("%s", err);
    }
    for (int k = 0; k < nt && local; k++) {
        for (size_t i = 0; i < local[k].cap && !rc; i++) {
            wslot *e = &local[k].s[i];
            if (e->len) rc = wmap_add(&t->words, (const uint8_t *)local[k].keys.v + e->off, e->len, e->hash, e->count);
        }
        wmap_free(&local[k]);
    }
    free(local);
    free(items);
    return rc;
}

int64_t tide_bpe_trainer_words(const tide_bpe_trainer *t) { return t ? (t->frozen ? t->n_words : (int64_t)t->words.n) : -1; }
int64_t tide_bpe_trainer_vocab_size(const tide_bpe_trainer *t) { return t ? t->n_tokens : -1; }

/* adds (sign = +1) or removes (-1) the pairs of word w; with `with` >= 0, the word joins the word list of each of
   its pairs that holds that id, and such pairs are noted in `touched` once per merge (pstamp = stamp) */
static int word_pairs(tide_bpe_trainer *t, int64_t w, int sign, int32_t with, int64_t stamp, bpe_zvec *touched)
{
    const int32_t *s = t->wsym + t->woff[w];
    int32_t n = t->wlen[w];
    int64_t c = sign * t->wcount[w];
    for (int32_t k = 0; k + 1 < n; k++) {
        int64_t idx = pair_get(t, ((uint64_t)(uint32_t)s[k] << 32) | (uint32_t)s[k + 1]);
        if (idx < 0) return -1;
        t->pcount[idx] += c;
        if (with >= 0 && (s[k] == with || s[k + 1] == with)) {
            wlist *l = &t->pwhere[idx];
            if ((l->n == 0 || l->v[l->n - 1] != (int32_t)w) && wlist_push(l, (int32_t)w)) return -1;
            if (t->pstamp[idx] != stamp) {
                t->pstamp[idx] = stamp;
                if (bpe_zvec_push(touched, (size_t)idx)) return -1;
            }
        }
    }
    return 0;
}

static int freeze(tide_bpe_trainer *t)
{
    t->frozen = 1;
    wmap *m = &t->words;
    t->n_words = (int64_t)m->n;
    if (t->n_words > INT32_MAX) return tide_set_error("tokenizer train: %lld distinct words", (long long)t->n_words);
    size_t nw = (size_t)(t->n_words ? t->n_words : 1);
    t->wcount = malloc(nw * sizeof *t->wcount);
    t->woff = malloc(nw * sizeof *t->woff);
    t->wlen = malloc(nw * sizeof *t->wlen);
    t->wstamp = malloc(nw * sizeof *t->wstamp);
    t->wsym = malloc((m->keys.n ? m->keys.n : 1) * sizeof *t->wsym);
    if (!t->wcount || !t->woff || !t->wlen || !t->wstamp || !t->wsym)
        return tide_set_error("tokenizer train: out of memory for %lld words", (long long)t->n_words);
    /* words in byte order of their text, so the pair lists (and everything after) do not depend on hashing */
    size_t w = 0, at = 0;
    for (size_t i = 0; i < m->cap; i++) {
        wslot *e = &m->s[i];
        if (!e->len) continue;
        if (e->len > INT32_MAX) return tide_set_error("tokenizer train: a word of %u bytes", e->len);
        t->wcount[w] = e->count;
        t->woff[w] = at;
        t->wlen[w] = (int32_t)e->len;
        t->wstamp[w] = -1;
        const uint8_t *p = (const uint8_t *)m->keys.v + e->off;
        for (uint32_t k = 0; k < e->len; k++) t->wsym[at + k] = p[k];
        at += e->len;
        w++;
    }
    wmap_free(m);
    for (int64_t k = 0; k < t->n_words; k++) {
        const int32_t *s = t->wsym + t->woff[k];
        for (int32_t j = 0; j + 1 < t->wlen[k]; j++) {
            int64_t idx = pair_get(t, ((uint64_t)(uint32_t)s[j] << 32) | (uint32_t)s[j + 1]);
            if (idx < 0) return -1;
            t->pcount[idx] += t->wcount[k];
            wlist *l = &t->pwhere[idx];
            if ((l->n == 0 || l->v[l->n - 1] != (int32_t)k) && wlist_push(l, (int32_t)k)) return -1;
        }
    }
    for (int64_t i = 0; i < t->n_pairs; i++)
        if (heap_push(t, t->pcount[i], t->pkey[i])) return -1;
    return 0;
}

int64_t tide_bpe_trainer_merge(tide_bpe_trainer *t, int64_t vocab_size, int64_t min_frequency, int64_t max_merges)
{
    if (!t) return tide_set_error("tokenizer train: the trainer is NULL");
    if (vocab_size > (1 << 22)) return tide_set_error("tokenizer train: vocab_size %lld is over %d", (long long)vocab_size, 1 << 22);
    if (!t->frozen && freeze(t)) return -1;
    if (min_frequency < 1) min_frequency = 1;
    int64_t made = 0;
    uint8_t *cat = NULL;
    size_t cat_cap = 0;
    bpe_zvec touched = { 0 };
    while (made < max_merges && t->n_tokens < vocab_size && t->heap_n > 0) {
        hentry top = heap_pop(t);
        int64_t idx = pair_find(t, top.key);
        int64_t now = idx >= 0 ? t->pcount[idx] : 0;
        if (now != top.count) {      /* stale: its count fell since it was pushed */
            if (now > 0 && heap_push(t, now, top.key)) { free(cat); free(touched.v); return -1; }
            continue;
        }
        if (now < min_frequency) { t->heap_n = 0; break; }
        int32_t a = (int32_t)(top.key >> 32), b = (int32_t)(uint32_t)top.key;
        size_t na = t->tlen[a], nb = t->tlen[b];
        if (na + nb > cat_cap) {
            cat_cap = 2 * (na + nb);
            uint8_t *nc = realloc(cat, cat_cap);
            if (!nc) { free(cat); free(touched.v); return tide_set_error("tokenizer train: out of memory"); }
            cat = nc;
        }
        memcpy(cat, t->tbytes.v + t->toff[a], na);
        memcpy(cat + na, t->tbytes.v + t->toff[b], nb);
        int32_t c = token_find(t, cat, na + nb, bpe_hash(cat, na + nb));
        if (c < 0) {
            c = t->n_tokens;
            if (token_add(t, cat, na + nb)) { free(cat); free(touched.v); return -1; }
        }
        if (t->n_merges == t->merges_cap) {
            int64_t nc = t->merges_cap ? t->merges_cap * 2 : 1024;
            int32_t *ma = realloc(t->merge_a, (size_t)nc * sizeof *ma);
            if (ma) t->merge_a = ma;
            int32_t *mb = realloc(t->merge_b, (size_t)nc * sizeof *mb);
            if (mb) t->merge_b = mb;
            if (!ma || !mb) { free(cat); free(touched.v); return tide_set_error("tokenizer train: out of memory"); }
            t->merges_cap = nc;
        }
        t->merge_a[t->n_merges] = a;
        t->merge_b[t->n_merges] = b;
        int64_t stamp = t->n_merges++;   /* wstamp / pstamp: this merge's number */
        /* every word holding (a, b): out with its old pairs, merge, in with its new ones */
        wlist where = t->pwhere[idx];
        t->pwhere[idx] = (wlist){ 0 };
        touched.n = 0;
        int rc = 0;
        for (int32_t k = 0; k < where.n && !rc; k++) {
            int32_t w = where.v[k];
            if (t->wstamp[w] == stamp) continue;
            t->wstamp[w] = stamp;
            int32_t *s = t->wsym + t->woff[w];
            int32_t n = t->wlen[w], hit = 0;
            for (int32_t j = 0; j + 1 < n; j++) if (s[j] == a && s[j + 1] == b) { hit = 1; break; }
            if (!hit) continue;
            rc = word_pairs(t, w, -1, -1, stamp, &touched);
            int32_t o = 0;
            for (int32_t j = 0; j < n && !rc;) {
                if (j + 1 < n && s[j] == a && s[j + 1] == b) { s[o++] = c; j += 2; }
                else s[o++] = s[j++];
            }
            t->wlen[w] = o;
            if (!rc) rc = word_pairs(t, w, +1, c, stamp, &touched);
        }
        free(where.v);
        /* the pairs that hold the new id go on the heap with their counts (the others only fell) */
        for (size_t i = 0; i < touched.n && !rc; i++) {
            int64_t p = (int64_t)touched.v[i];
            if (t->pcount[p] > 0) rc = heap_push(t, t->pcount[p], t->pkey[p]);
        }
        if (rc) { free(cat); free(touched.v); return -1; }
        made++;
    }
    free(cat);
    free(touched.v);
    return made;
}

/* ---- tokenizer.json -------------------------------------------------------------------------------------- */
static int put_token(bpe_buf *o, const tide_bpe_trainer *t, int32_t id, char *tmp)
{
    const uint8_t *p = (const uint8_t *)t->tbytes.v + t->toff[id];
    size_t n = t->tlen[id];
    if (id >= 256 && id < 256 + t->n_specials) return bpe_buf_json_string(o, (const char *)p, n);
    size_t m = bpe_map(p, n, tmp);
    return bpe_buf_json_string(o, tmp, m);
}

char *tide_bpe_trainer_json(const tide_bpe_trainer *t, size_t *n)
{
    if (n) *n = 0;
    if (!t) { tide_set_error("tokenizer train: the trainer is NULL"); return NULL; }
    size_t longest = 1;
    for (int32_t i = 0; i < t->n_tokens; i++) if (t->tlen[i] > longest) longest = t->tlen[i];
    char *tmp = malloc(2 * longest + 1);
    bpe_buf o = { 0 };
    int rc = tmp ? 0 : tide_set_error("tokenizer train: out of memory");
    if (!rc) rc = bpe_buf_printf(&o, "{\n  \"version\": \"1.0\",\n  \"truncation\": null,\n  \"padding\": null,\n"
                                     "  \"added_tokens\": [");
    for (int i = 0; i < t->n_specials && !rc; i++) {
        rc = bpe_buf_printf(&o, "%s\n    {\"id\": %d, \"content\": \"", i ? "," : "", t->specials[i].id);
        if (!rc) rc = bpe_buf_json_string(&o, (const char *)t->specials[i].content, t->specials[i].len);
        if (!rc) rc = bpe_buf_printf(&o, "\", \"single_word\": false, \"lstrip\": false, \"rstrip\": false, "
                                         "\"normalized\": false, \"special\": true}");
    }
    if (!rc) rc = bpe_buf_printf(&o, "%s],\n  \"normalizer\": null,\n"
        "  \"pre_tokenizer\": {\"type\": \"ByteLevel\", \"add_prefix_space\": false, \"trim_offsets\": true, "
        "\"use_regex\": true},\n  \"post_processor\": null,\n"
        "  \"decoder\": {\"type\": \"ByteLevel\", \"add_prefix_space\": true, \"trim_offsets\": true, "
        "\"use_regex\": true},\n", t->n_specials ? "\n  " : "");
    if (!rc) rc = bpe_buf_printf(&o, "  \"model\": {\n    \"type\": \"BPE\",\n    \"dropout\": null,\n"
        "    \"unk_token\": null,\n    \"continuing_subword_prefix\": null,\n    \"end_of_word_suffix\": null,\n"
        "    \"fuse_unk\": false,\n    \"byte_fallback\": false,\n    \"ignore_merges\": false,\n    \"vocab\": {");
    for (int32_t id = 0; id < t->n_tokens && !rc; id++) {
        rc = bpe_buf_printf(&o, "%s\n      \"", id ? "," : "");
        if (!rc) rc = put_token(&o, t, id, tmp);
        if (!rc) rc = bpe_buf_printf(&o, "\": %d", id);
    }
    if (!rc) rc = bpe_buf_printf(&o, "\n    },\n    \"merges\": [");
    for (int64_t k = 0; k < t->n_merges && !rc; k++) {
        rc = bpe_buf_printf(&o, "%s\n      \"", k ? "," : "");
        if (!rc) rc = put_token(&o, t, t->merge_a[k], tmp);
        if (!rc) rc = bpe_buf_put(&o, " ", 1);
        if (!rc) rc = put_token(&o, t, t->merge_b[k], tmp);
        if (!rc) rc = bpe_buf_put(&o, "\"", 1);
    }
    if (!rc) rc = bpe_buf_printf(&o, "%s]\n  }\n}\n", t->n_merges ? "\n    " : "");
    free(tmp);
    if (rc) { free(o.v); return NULL; }
    if (n) *n = o.n;
    return o.v;
}
