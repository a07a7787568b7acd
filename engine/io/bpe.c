/*
 * bpe.c — HuggingFace tokenizer.json byte-level BPE (formats.md §4): loading, encoding, decoding.
 *
 * Encoding follows the tokenizers library step by step, so the ids are the same:
 *   1. added tokens are split out of the text: first those with normalized = false, then, in the text left
 *      over, those with normalized = true (leftmost-longest matches; lstrip, rstrip and single_word as there);
 *   2. each remaining piece is pre-tokenized: the Split regex (Sequence) and/or the ByteLevel regex, with the
 *      ByteLevel prefix space when asked for;
 *   3. each pre-token's bytes are byte-mapped symbols, merged by rank: the adjacent pair of lowest rank (its
 *      index in model.merges), leftmost first, until no pair has a rank (a heap of (rank, position));
 *      with ignore_merges a pre-token that is itself in model.vocab is that one id.
 * Symbols are kept as ids and pre-tokens as raw bytes: the byte map is a bijection, so model.vocab is looked
 * up by the bytes of its tokens (every byte-mapped token has them) and no mapped string is ever built.
 * Pre-tokens are cached per thread (raw bytes -> ids).
 * Decoding is the ByteLevel decoder: a token whose characters are all in the byte map gives those bytes, any
 * other token its own UTF-8 bytes.
 *
 * The file is hostile input: its size, counts, ids and token lengths are capped, every field is type-checked,
 * and each error is one line naming the file, the field and the value.
 */
#include <omp.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cjson/cJSON.h>
#include "bpe_internal.h"

enum {
    FILE_MAX = 256 << 20,          /* tokenizer.json bytes */
    ID_LIMIT = 1 << 22,            /* every id is below this */
    TOKEN_MAX = 1 << 16,           /* bytes of one token string */
    ADDED_MAX = 1 << 20,           /* added tokens */
    CACHE_KEY_MAX = 256,           /* longer pre-tokens are not cached */
    CACHE_SLOTS_MAX = 1 << 18,
    CHUNK_BYTES = 1 << 20,         /* a longer document is encoded in chunks of about this size */
};
enum { F_MODEL = 1, F_ADDED = 2, F_SPECIAL = 4 };

/* ---- maps ------------------------------------------------------------------------------------------ */
/* strings (in an arena, by offset) -> int32 */
typedef struct { uint64_t hash; uint32_t off, len; int32_t val; } sslot;
typedef struct { sslot *s; size_t cap, n; } smap;

static int smap_init(smap *m, size_t want)
{
    size_t cap = 16;
    while (cap < want * 2) cap *= 2;
    m->s = calloc(cap, sizeof *m->s);
    m->cap = cap;
    m->n = 0;
    if (!m->s) return -1;
    for (size_t i = 0; i < cap; i++) m->s[i].val = -1;
    return 0;
}

static int32_t smap_get(const smap *m, const char *arena, const void *key, size_t len, uint64_t h)
{
    if (!m->cap) return -1;
    size_t i = h & (m->cap - 1);
    for (;;) {
        const sslot *e = &m->s[i];
        if (e->val < 0) return -1;
        if (e->hash == h && e->len == len && !memcmp(arena + e->off, key, len)) return e->val;
        i = (i + 1) & (m->cap - 1);
    }
}

/* inserts key (already in the arena at off); returns the existing value when the key is present, else -1 */
static int32_t smap_put(smap *m, const char *arena, uint32_t off, uint32_t len, int32_t val)
{
    uint64_t h = bpe_hash((const uint8_t *)arena + off, len);
    size_t i = h & (m->cap - 1);
    for (;;) {
        sslot *e = &m->s[i];
        if (e->val < 0) {
            *e = (sslot){ h, off, len, val };
            m->n++;
            return -1;
        }
        if (e->hash == h && e->len == len && !memcmp(arena + e->off, arena + off, len)) return e->val;
        i = (i + 1) & (m->cap - 1);
    }
}

/* merges: (left id, right id) -> (rank, merged id) */
typedef struct { uint64_t key; int32_t rank, id; } pslot;
typedef struct { pslot *s; size_t cap; } pmap;
#define PAIR_EMPTY UINT64_MAX

static inline uint64_t pair_key(int32_t a, int32_t b) { return ((uint64_t)(uint32_t)a << 32) | (uint32_t)b; }

static int pmap_init(pmap *m, size_t want)
{
    size_t cap = 16;
    while (cap < want * 2) cap *= 2;
    m->s = malloc(cap * sizeof *m->s);
    m->cap = cap;
    if (!m->s) return -1;
    for (size_t i = 0; i < cap; i++) m->s[i].key = PAIR_EMPTY;
    return 0;
}

static inline const pslot *pmap_get(const pmap *m, uint64_t key)
{
    size_t i = bpe_mix64(key) & (m->cap - 1);
    for (;;) {
        const pslot *e = &m->s[i];
        if (e->key == key) return e;
        if (e->key == PAIR_EMPTY) return NULL;
        i = (i + 1) & (m->cap - 1);
    }
}

/* a repeated pair takes its later rank (tokenizers builds a hash map from the list) */
static void pmap_put(pmap *m, uint64_t key, int32_t rank, int32_t id)
{
    size_t i = bpe_mix64(key) & (m->cap - 1);
    while (m->s[i].key != PAIR_EMPTY && m->s[i].key != key) i = (i + 1) & (m->cap - 1);
    m->s[i] = (pslot){ key, rank, id };
}

/* ---- the tokenizer ------------------------------------------------------------------------------------- */
typedef struct { uint64_t hash; uint32_t key_off, key_len, ids_off, ids_n; } cslot;

typedef struct {
    cslot *slots;
    size_t cap, n;
    bpe_buf keys;
    bpe_ivec ids;
    /* scratch of one pre-token's merge */
    int32_t *sym, *nxt, *prv;
    uint64_t *heap;
    size_t scratch;
    bpe_buf tmp;                   /* a piece with the ByteLevel prefix space */
    bpe_segs segs1, segs2;
} bpe_cache;

struct tide_bpe {
    char label[256];
    char *json;
    size_t json_n;
    char sha[65];
    int split_pattern;             /* Sequence[Split(regex), ByteLevel]: BPE_PAT_*, else 0 */
    int prefix_space, bl_regex;    /* ByteLevel add_prefix_space, use_regex */
    int ignore_merges;
    int32_t vocab_size;            /* largest id + 1 */
    int32_t n_model;
    uint32_t *tok_off, *tok_len;   /* per id: its string in `strs` (tok_len UINT32_MAX: no token) */
    uint32_t *dec_off, *dec_len;   /* per id: its decoded bytes */
    uint8_t *flags;
    bpe_buf strs;
    smap model_by_str, model_by_bytes, added_by_str;
    pmap merges;
    int32_t byte_id[256];
    int n_added;
    bpe_added *added;
    bpe_added_set pass1, pass2;    /* normalized = false, normalized = true */
    bpe_added_set text1, text2;    /* the same without the special tokens (their names read as text) */
    bpe_added *plain;              /* the added tokens that are not special */
    int n_plain;
    int n_caches;
    bpe_cache **caches;
};

static void cache_free(bpe_cache *c)
{
    if (!c) return;
    free(c->slots);
    free(c->keys.v);
    free(c->ids.v);
    free(c->sym);
    free(c->nxt);
    free(c->prv);
    free(c->heap);
    free(c->tmp.v);
    free(c->segs1.v);
    free(c->segs2.v);
    free(c);
}

void tide_bpe_free(tide_bpe *b)
{
    if (!b) return;
    free(b->json);
    free(b->tok_off);
    free(b->tok_len);
    free(b->dec_off);
    free(b->dec_len);
    free(b->flags);
    free(b->strs.v);
    free(b->model_by_str.s);
    free(b->model_by_bytes.s);
    free(b->added_by_str.s);
    free(b->merges.s);
    free(b->added);
    bpe_added_set_free(&b->pass1);
    bpe_added_set_free(&b->pass2);
    bpe_added_set_free(&b->text1);
    bpe_added_set_free(&b->text2);
    free(b->plain);
    for (int i = 0; i < b->n_caches; i++) cache_free(b->caches[i]);
    free(b->caches);
    free(b);
}

/* ---- loading ------------------------------------------------------------------------------------------ */
typedef struct {
    tide_bpe *b;
    cJSON *root;
    int32_t *model_ids;            /* per model.vocab entry: its id, in file order */
    uint32_t *model_off, *model_len;
} loader;

static tide_bpe *load_fail(loader *L, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static tide_bpe *load_fail(loader *L, const char *fmt, ...)
{
    char msg[1536];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    tide_set_error("tokenizer '%s': %s", L->b->label, msg);
    cJSON_Delete(L->root);
    free(L->model_ids);
    free(L->model_off);
    free(L->model_len);
    tide_bpe_free(L->b);
    return NULL;
}

static const char *type_name(const cJSON *x)
{
    if (!x) return "missing";
    if (cJSON_IsNull(x)) return "null";
    if (cJSON_IsBool(x)) return "a boolean";
    if (cJSON_IsNumber(x)) return "a number";
    if (cJSON_IsString(x)) return "a string";
    if (cJSON_IsArray(x)) return "an array";
    if (cJSON_IsObject(x)) return "an object";
    return "invalid";
}

/* a field of object o: NULL when absent */
static const cJSON *field(const cJSON *o, const char *name) { return cJSON_GetObjectItemCaseSensitive(o, name); }

/* -1: wrong type (the caller reports it); absent or null gives `dflt` */
static int get_bool(const cJSON *o, const char *name, int dflt)
{
    const cJSON *x = field(o, name);
    if (!x || cJSON_IsNull(x)) return dflt;
    if (!cJSON_IsBool(x)) return -1;
    return cJSON_IsTrue(x) ? 1 : 0;
}

static int is_id(const cJSON *x, int32_t *id)
{
    if (!cJSON_IsNumber(x)) return 0;
    double v = x->valuedouble;
    if (!(v >= 0 && v < ID_LIMIT) || v != (double)(int64_t)v) return 0;
    *id = (int32_t)v;
    return 1;
}

static int arena_add(bpe_buf *a, const void *p, size_t n, uint32_t *off)
{
    if (a->n + n >= 0xFFFFFFF0u) return tide_set_error("tokenizer: strings over 4 GiB");
    *off = (uint32_t)a->n;
    return bpe_buf_put(a, p, n);
}

static const char *pattern_name(int p) { return p == BPE_PAT_LLAMA3 ? "llama3" : "gpt2"; }

/* the pre_tokenizer: ByteLevel, or Sequence [Split(known regex, Isolated), ByteLevel] (or [ByteLevel]) */
static tide_bpe *parse_byte_level(loader *L, const cJSON *bl, const char *where)
{
    tide_bpe *b = L->b;
    int aps = get_bool(bl, "add_prefix_space", 1), ur = get_bool(bl, "use_regex", 1);
    if (aps < 0) return load_fail(L, "%s.add_prefix_space must be a boolean, got %s", where, type_name(field(bl, "add_prefix_space")));
    if (ur < 0) return load_fail(L, "%s.use_regex must be a boolean, got %s", where, type_name(field(bl, "use_regex")));
    b->prefix_space = aps;
    b->bl_regex = ur;
    return b;
}

static tide_bpe *parse_pre_tokenizer(loader *L, const cJSON *pt)
{
    char show[96];
    if (!pt || cJSON_IsNull(pt))
        return load_fail(L, "pre_tokenizer is %s; a byte-level BPE needs ByteLevel or Sequence [Split, ByteLevel]",
                         type_name(pt));
    if (!cJSON_IsObject(pt)) return load_fail(L, "pre_tokenizer must be an object, got %s", type_name(pt));
    const cJSON *type = field(pt, "type");
    if (!cJSON_IsString(type)) return load_fail(L, "pre_tokenizer.type must be a string, got %s", type_name(type));
    if (!strcmp(type->valuestring, "ByteLevel")) return parse_byte_level(L, pt, "pre_tokenizer");
    if (strcmp(type->valuestring, "Sequence"))
        return load_fail(L, "pre_tokenizer.type %s is not supported (ByteLevel or Sequence [Split, ByteLevel])",
                         bpe_show(type->valuestring, strlen(type->valuestring), show, sizeof show));
    const cJSON *seq = field(pt, "pretokenizers");
    if (!cJSON_IsArray(seq)) return load_fail(L, "pre_tokenizer.pretokenizers must be an array, got %s", type_name(seq));
    int n = cJSON_GetArraySize(seq);
    const cJSON *first = cJSON_GetArrayItem(seq, 0), *last = cJSON_GetArrayItem(seq, n - 1);
    const cJSON *t0 = first ? field(first, "type") : NULL, *t1 = last ? field(last, "type") : NULL;
    int last_bl = cJSON_IsString(t1) && !strcmp(t1->valuestring, "ByteLevel");
    if (n == 1 && last_bl) return parse_byte_level(L, last, "pre_tokenizer.pretokenizers[0]");
    if (n != 2 || !cJSON_IsString(t0) || strcmp(t0->valuestring, "Split") || !last_bl)
        return load_fail(L, "pre_tokenizer Sequence must be [Split, ByteLevel] or [ByteLevel] (%d entries)", n);
    const cJSON *pat = field(first, "pattern");
    const cJSON *re = cJSON_IsObject(pat) ? field(pat, "Regex") : NULL;
    if (!cJSON_IsString(re))
        return load_fail(L, "pre_tokenizer.pretokenizers[0].pattern must be {\"Regex\": ...}, got %s",
                         cJSON_IsObject(pat) && field(pat, "String") ? "a String pattern" : type_name(pat));
    if (!strcmp(re->valuestring, bpe_pattern_gpt2)) L->b->split_pattern = BPE_PAT_GPT2;
    else if (!strcmp(re->valuestring, bpe_pattern_llama3)) L->b->split_pattern = BPE_PAT_LLAMA3;
    else
        return load_fail(L, "pre_tokenizer Split regex %s is not supported (tide matches the GPT-2 and the Llama-3 "
                         "patterns exactly)", bpe_show(re->valuestring, strlen(re->valuestring), show, sizeof show));
    const cJSON *beh = field(first, "behavior");
    if (!cJSON_IsString(beh) || strcmp(beh->valuestring, "Isolated"))
        return load_fail(L, "pre_tokenizer Split behavior must be \"Isolated\", got %s",
                         cJSON_IsString(beh) ? bpe_show(beh->valuestring, strlen(beh->valuestring), show, sizeof show)
                                             : type_name(beh));
    if (get_bool(first, "invert", 0) != 0) return load_fail(L, "pre_tokenizer Split invert must be false");
    return parse_byte_level(L, last, "pre_tokenizer.pretokenizers[1]");
}

static int32_t model_id(const tide_bpe *b, const char *s, size_t n)
{
    return smap_get(&b->model_by_str, b->strs.v, s, n, bpe_hash((const uint8_t *)s, n));
}

static tide_bpe *parse_model(loader *L, const cJSON *model)
{
    tide_bpe *b = L->b;
    char s1[96];
    if (!cJSON_IsObject(model)) return load_fail(L, "model must be an object, got %s", type_name(model));
    const cJSON *type = field(model, "type");
    if (type && !(cJSON_IsString(type) && !strcmp(type->valuestring, "BPE")))
        return load_fail(L, "model.type must be \"BPE\", got %s",
                         cJSON_IsString(type) ? bpe_show(type->valuestring, strlen(type->valuestring), s1, sizeof s1)
                                              : type_name(type));
    const cJSON *drop = field(model, "dropout");
    if (drop && !cJSON_IsNull(drop) && !(cJSON_IsNumber(drop) && drop->valuedouble == 0))
        return load_fail(L, "model.dropout must be null (BPE dropout is not supported)");
    int bf = get_bool(model, "byte_fallback", 0);
    if (bf != 0) return load_fail(L, "model.byte_fallback must be false (a byte-level BPE has every byte)");
    const char *affix[2] = { "continuing_subword_prefix", "end_of_word_suffix" };
    for (int k = 0; k < 2; k++) {
        const cJSON *x = field(model, affix[k]);
        if (x && !cJSON_IsNull(x) && !(cJSON_IsString(x) && !x->valuestring[0]))
            return load_fail(L, "model.%s must be null or \"\", got %s", affix[k], type_name(x));
    }
    b->ignore_merges = get_bool(model, "ignore_merges", 0);
    if (b->ignore_merges < 0) return load_fail(L, "model.ignore_merges must be a boolean, got %s",
                                               type_name(field(model, "ignore_merges")));
    const cJSON *unk = field(model, "unk_token");
    if (unk && !cJSON_IsNull(unk) && !cJSON_IsString(unk))
        return load_fail(L, "model.unk_token must be a string or null, got %s", type_name(unk));

    /* vocab */
    const cJSON *vocab = field(model, "vocab");
    if (!cJSON_IsObject(vocab)) return load_fail(L, "model.vocab must be an object of token: id, got %s", type_name(vocab));
    int nv = 0;
    for (const cJSON *c = vocab->child; c; c = c->next)
        if (++nv > ID_LIMIT) return load_fail(L, "model.vocab has more than %d tokens", ID_LIMIT);
    if (smap_init(&b->model_by_str, (size_t)nv) || smap_init(&b->model_by_bytes, (size_t)nv))
        return load_fail(L, "out of memory for %d tokens", nv);
    L->model_ids = malloc((size_t)(nv ? nv : 1) * sizeof *L->model_ids);
    L->model_off = malloc((size_t)(nv ? nv : 1) * sizeof *L->model_off);
    L->model_len = malloc((size_t)(nv ? nv : 1) * sizeof *L->model_len);
    if (!L->model_ids || !L->model_off || !L->model_len) return load_fail(L, "out of memory for %d tokens", nv);
    int k = 0;
    for (const cJSON *c = vocab->child; c; c = c->next, k++) {
        size_t len = strlen(c->string);
        int32_t id;
        if (len == 0) return load_fail(L, "model.vocab has an empty token");
        if (len > TOKEN_MAX) return load_fail(L, "model.vocab token %s is %zu bytes, over the limit of %d",
                                              bpe_show(c->string, len, s1, sizeof s1), len, TOKEN_MAX);
        if (!is_id(c, &id))
            return load_fail(L, "model.vocab[%s] must be an integer id in [0, %d), got %s",
                             bpe_show(c->string, len, s1, sizeof s1), ID_LIMIT,
                             cJSON_IsNumber(c) ? "a number outside it" : type_name(c));
        uint32_t off = 0;
        if (arena_add(&b->strs, c->string, len, &off)) return load_fail(L, "%s", tide_last_error());
        if (smap_put(&b->model_by_str, b->strs.v, off, (uint32_t)len, id) >= 0)
            return load_fail(L, "model.vocab has the token %s twice", bpe_show(c->string, len, s1, sizeof s1));
        L->model_ids[k] = id;
        L->model_off[k] = off;
        L->model_len[k] = (uint32_t)len;
        if (id + 1 > b->vocab_size) b->vocab_size = id + 1;
    }
    b->n_model = nv;
    return b;
}

/* per-id tables once every id is known; model ids first (duplicates refused) */
static tide_bpe *build_ids(loader *L)
{
    tide_bpe *b = L->b;
    char s1[96], s2[96];
    size_t V = (size_t)b->vocab_size;
    b->tok_off = malloc((V ? V : 1) * sizeof *b->tok_off);
    b->tok_len = malloc((V ? V : 1) * sizeof *b->tok_len);
    b->dec_off = malloc((V ? V : 1) * sizeof *b->dec_off);
    b->dec_len = malloc((V ? V : 1) * sizeof *b->dec_len);
    b->flags = calloc(V ? V : 1, 1);
    if (!b->tok_off || !b->tok_len || !b->dec_off || !b->dec_len || !b->flags)
        return load_fail(L, "out of memory for %zu ids", V);
    for (size_t i = 0; i < V; i++) b->tok_len[i] = UINT32_MAX;
    for (int k = 0; k < b->n_model; k++) {
        int32_t id = L->model_ids[k];
        if (b->flags[id] & F_MODEL)
            return load_fail(L, "model.vocab gives id %d to both %s and %s", id,
                             bpe_show(b->strs.v + b->tok_off[id], b->tok_len[id], s1, sizeof s1),
                             bpe_show(b->strs.v + L->model_off[k], L->model_len[k], s2, sizeof s2));
        b->flags[id] |= F_MODEL;
        b->tok_off[id] = L->model_off[k];
        b->tok_len[id] = L->model_len[k];
    }
    return b;
}

static tide_bpe *parse_merges(loader *L, const cJSON *model)
{
    tide_bpe *b = L->b;
    char s1[96], s2[96], s3[96];
    const cJSON *merges = field(model, "merges");
    if (!merges || cJSON_IsNull(merges)) merges = NULL;
    else if (!cJSON_IsArray(merges)) return load_fail(L, "model.merges must be an array, got %s", type_name(merges));
    int nm = 0;
    if (merges)
        for (const cJSON *c = merges->child; c; c = c->next)
            if (++nm > ID_LIMIT) return load_fail(L, "model.merges has more than %d entries", ID_LIMIT);
    if (pmap_init(&b->merges, (size_t)nm)) return load_fail(L, "out of memory for %d merges", nm);
    char *cat = malloc(2 * TOKEN_MAX + 1);
    if (!cat) return load_fail(L, "out of memory");
    int rank = 0;
    for (const cJSON *c = merges ? merges->child : NULL; c; c = c->next, rank++) {
        const char *a, *bb;
        size_t na, nb;
        if (cJSON_IsString(c)) {
            /* "a b": exactly one space (tokenizers splits on ' ' and wants two parts) */
            const char *s = c->valuestring, *sp = strchr(s, ' ');
            if (!sp || strchr(sp + 1, ' ')) {
                free(cat);
                return load_fail(L, "model.merges[%d] %s must be two tokens separated by one space", rank,
                                 bpe_show(s, strlen(s), s1, sizeof s1));
            }
            a = s;
            na = (size_t)(sp - s);
            bb = sp + 1;
            nb = strlen(bb);
        } else if (cJSON_IsArray(c) && cJSON_GetArraySize(c) == 2 && cJSON_IsString(c->child) &&
                   cJSON_IsString(c->child->next)) {
            a = c->child->valuestring;
            na = strlen(a);
            bb = c->child->next->valuestring;
            nb = strlen(bb);
        } else {
            free(cat);
            return load_fail(L, "model.merges[%d] must be \"a b\" or [\"a\", \"b\"], got %s", rank, type_name(c));
        }
        int32_t ia = na <= TOKEN_MAX ? model_id(b, a, na) : -1, ib = nb <= TOKEN_MAX ? model_id(b, bb, nb) : -1;
        int32_t im = -1;
        if (ia >= 0 && ib >= 0) {
            memcpy(cat, a, na);
            memcpy(cat + na, bb, nb);
            im = model_id(b, cat, na + nb);
        }
        if (ia < 0 || ib < 0 || im < 0) {
            const char *miss = ia < 0 ? a : ib < 0 ? bb : cat;
            size_t nmiss = ia < 0 ? na : ib < 0 ? nb : na + nb;
            bpe_show(a, na, s1, sizeof s1);
            bpe_show(bb, nb, s2, sizeof s2);
            tide_bpe *r = load_fail(L, "model.merges[%d] (%s %s): %s is not in model.vocab", rank, s1, s2,
                                    bpe_show(miss, nmiss, s3, sizeof s3));
            free(cat);
            return r;
        }
        pmap_put(&b->merges, pair_key(ia, ib), rank, im);
    }
    free(cat);
    return b;
}

/* the 256 byte symbols, and model.vocab by the bytes of its tokens */
static tide_bpe *build_bytes(loader *L)
{
    tide_bpe *b = L->b;
    for (int c = 0; c < 256; c++) {
        char sym[4];
        size_t n = bpe_utf8_put(bpe_byte_cp[c], sym);
        b->byte_id[c] = model_id(b, sym, n);
        if (b->byte_id[c] < 0)
            return load_fail(L, "model.vocab lacks the symbol U+%04X of byte 0x%02X (a byte-level BPE vocabulary "
                             "holds all 256 byte symbols)", bpe_byte_cp[c], c);
    }
    uint8_t *raw = malloc(TOKEN_MAX);
    if (!raw) return load_fail(L, "out of memory");
    for (int32_t id = 0; id < b->vocab_size; id++) {
        if (!(b->flags[id] & F_MODEL)) continue;
        int64_t n = bpe_unmap(b->strs.v + b->tok_off[id], b->tok_len[id], raw);
        if (n <= 0) continue;   /* a token outside the byte map: no pre-token is ever that string */
        uint32_t off = 0;
        if (arena_add(&b->strs, raw, (size_t)n, &off)) { free(raw); return load_fail(L, "%s", tide_last_error()); }
        smap_put(&b->model_by_bytes, b->strs.v, off, (uint32_t)n, id);
    }
    free(raw);
    return b;
}

/* added_tokens, with the ids tokenizers gives them: the model's id for a token in model.vocab, else the next
   one after model.vocab's size (its entry count) or the largest added id */
static tide_bpe *parse_added(loader *L, const cJSON *list)
{
    tide_bpe *b = L->b;
    char s1[96], s2[96];
    if (!list || cJSON_IsNull(list)) return b;
    if (!cJSON_IsArray(list)) return load_fail(L, "added_tokens must be an array, got %s", type_name(list));
    int n = cJSON_GetArraySize(list);
    if (n > ADDED_MAX) return load_fail(L, "added_tokens has %d entries, over the limit of %d", n, ADDED_MAX);
    b->added = calloc((size_t)(n ? n : 1), sizeof *b->added);
    uint32_t *offs = malloc((size_t)(n ? n : 1) * sizeof *offs);
    if (!b->added || !offs || smap_init(&b->added_by_str, (size_t)n)) {
        free(offs);
        return load_fail(L, "out of memory for %d added tokens", n);
    }
    int32_t max_added = -1;
    int i = 0;
    for (const cJSON *t = list->child; t; t = t->next, i++) {
        if (!cJSON_IsObject(t)) { free(offs); return load_fail(L, "added_tokens[%d] must be an object, got %s", i, type_name(t)); }
        const cJSON *content = field(t, "content"), *idj = field(t, "id");
        if (!cJSON_IsString(content) || !content->valuestring[0]) {
            free(offs);
            return load_fail(L, "added_tokens[%d].content must be a non-empty string, got %s", i,
                             cJSON_IsString(content) ? "\"\"" : type_name(content));
        }
        const char *cs = content->valuestring;
        size_t len = strlen(cs);
        int32_t id;
        if (len > TOKEN_MAX) { free(offs); return load_fail(L, "added_tokens[%d].content is %zu bytes, over the limit of %d", i, len, TOKEN_MAX); }
        if (!is_id(idj, &id)) {
            free(offs);
            return load_fail(L, "added_tokens[%d].id must be an integer in [0, %d), got %s", i, ID_LIMIT,
                             cJSON_IsNumber(idj) ? "a number outside it" : type_name(idj));
        }
        static const char *flag_names[5] = { "special", "lstrip", "rstrip", "single_word", "normalized" };
        int flags[5];
        for (int f = 0; f < 5; f++) {
            /* AddedToken::default(): normalized true, the others false */
            flags[f] = get_bool(t, flag_names[f], f == 4);
            if (flags[f] < 0) {
                free(offs);
                return load_fail(L, "added_tokens[%d].%s must be a boolean, got %s", i, flag_names[f],
                                 type_name(field(t, flag_names[f])));
            }
        }
        uint32_t off = 0;
        if (arena_add(&b->strs, cs, len, &off)) { free(offs); return load_fail(L, "%s", tide_last_error()); }
        int32_t mid = model_id(b, cs, len);
        int32_t want = mid >= 0 ? mid
                     : max_added < 0 ? b->n_model
                     : (max_added >= b->n_model || b->n_model == 0) ? max_added + 1 : b->n_model;
        if (smap_put(&b->added_by_str, b->strs.v, off, (uint32_t)len, want) >= 0) {
            free(offs);
            return load_fail(L, "added_tokens[%d]: %s is listed twice", i, bpe_show(cs, len, s1, sizeof s1));
        }
        if (id != want) {
            free(offs);
            return load_fail(L, "added_tokens[%d] %s has id %d, but tokenizers gives it id %d (%s)", i,
                             bpe_show(cs, len, s1, sizeof s1), id, want,
                             mid >= 0 ? "its id in model.vocab" : "ids outside model.vocab follow on from its size");
        }
        if (mid < 0 && id < b->vocab_size && (b->flags[id] & F_MODEL)) {
            free(offs);
            return load_fail(L, "added_tokens[%d] %s has id %d, which model.vocab gives to %s", i,
                             bpe_show(cs, len, s1, sizeof s1), id,
                             bpe_show(b->strs.v + b->tok_off[id], b->tok_len[id], s2, sizeof s2));
        }
        if (id > max_added) max_added = id;
        offs[i] = off;
        b->added[i] = (bpe_added){ NULL, (uint32_t)len, id, (uint8_t)flags[0], (uint8_t)flags[1], (uint8_t)flags[2],
                                   (uint8_t)flags[3], (uint8_t)flags[4] };
    }
    b->n_added = n;
    /* the per-id tables grow to the added ids */
    if (max_added + 1 > b->vocab_size) {
        size_t V = (size_t)max_added + 1, old = (size_t)b->vocab_size;
        uint32_t *a1 = realloc(b->tok_off, V * sizeof *a1);
        if (a1) b->tok_off = a1;
        uint32_t *a2 = realloc(b->tok_len, V * sizeof *a2);
        if (a2) b->tok_len = a2;
        uint8_t *a3 = realloc(b->flags, V);
        if (a3) b->flags = a3;
        uint32_t *a4 = realloc(b->dec_off, V * sizeof *a4);
        if (a4) b->dec_off = a4;
        uint32_t *a5 = realloc(b->dec_len, V * sizeof *a5);
        if (a5) b->dec_len = a5;
        if (!a1 || !a2 || !a3 || !a4 || !a5) { free(offs); return load_fail(L, "out of memory for %zu ids", V); }
        for (size_t k = old; k < V; k++) { b->tok_len[k] = UINT32_MAX; b->flags[k] = 0; }
        b->vocab_size = (int32_t)V;
    }
    for (int k = 0; k < n; k++) {
        int32_t id = b->added[k].id;
        b->flags[id] |= F_ADDED | (b->added[k].special ? F_SPECIAL : 0);
        b->tok_off[id] = offs[k];
        b->tok_len[id] = b->added[k].len;
        b->added[k].content = (const uint8_t *)(uintptr_t)offs[k];   /* an offset until the arena is final */
    }
    free(offs);
    return b;
}

/* decoded bytes of every id (the ByteLevel decoder) */
static tide_bpe *build_decoded(loader *L)
{
    tide_bpe *b = L->b;
    uint8_t *raw = malloc(TOKEN_MAX);
    if (!raw) return load_fail(L, "out of memory");
    for (int32_t id = 0; id < b->vocab_size; id++) {
        b->dec_off[id] = 0;
        b->dec_len[id] = 0;
        if (b->tok_len[id] == UINT32_MAX) continue;
        int64_t n = bpe_unmap(b->strs.v + b->tok_off[id], b->tok_len[id], raw);
        uint32_t off = 0;
        int rc = n >= 0 ? arena_add(&b->strs, raw, (size_t)n, &off) : 0;
        if (n < 0) { off = b->tok_off[id]; n = b->tok_len[id]; }   /* not byte-mapped: its own bytes */
        if (rc) { free(raw); return load_fail(L, "%s", tide_last_error()); }
        b->dec_off[id] = off;
        b->dec_len[id] = (uint32_t)n;
    }
    free(raw);
    return b;
}

static void sha256_hex(const void *p, size_t n, char out[65]);

tide_bpe *tide_bpe_load_memory(const char *json, size_t n, const char *label)
{
    bpe_unicode_init();
    loader L = { 0 };
    L.b = calloc(1, sizeof *L.b);
    if (!L.b) { tide_set_error("tokenizer: out of memory"); return NULL; }
    tide_bpe *b = L.b;
    snprintf(b->label, sizeof b->label, "%s", label && label[0] ? label : "(memory)");
    if (!json && n) return load_fail(&L, "the text is NULL");
    if (n == 0) return load_fail(&L, "the file is empty");
    if (n > FILE_MAX) return load_fail(&L, "%zu bytes, over the limit of %d", n, FILE_MAX);
    b->json = malloc(n + 1);
    if (!b->json) return load_fail(&L, "out of memory for %zu bytes", n);
    memcpy(b->json, json, n);
    b->json[n] = 0;
    b->json_n = n;
    const char *end = NULL;
    L.root = cJSON_ParseWithLengthOpts(b->json, n, &end, 0);
    if (!L.root) {
        size_t at = end && end >= b->json && end <= b->json + n ? (size_t)(end - b->json) : 0;
        if (!end) end = cJSON_GetErrorPtr();
        if (end && end >= b->json && end <= b->json + n) at = (size_t)(end - b->json);
        return load_fail(&L, "not valid JSON (at byte %zu of %zu)", at, n);
    }
    if (!cJSON_IsObject(L.root)) return load_fail(&L, "the top level must be an object, got %s", type_name(L.root));
    const cJSON *norm = field(L.root, "normalizer");
    if (norm && !cJSON_IsNull(norm)) {
        const cJSON *t = cJSON_IsObject(norm) ? field(norm, "type") : NULL;
        char s1[96];
        return load_fail(&L, "normalizer %s is not supported (a byte-level BPE has none: null)",
                         cJSON_IsString(t) ? bpe_show(t->valuestring, strlen(t->valuestring), s1, sizeof s1)
                                           : type_name(norm));
    }
    if (!parse_pre_tokenizer(&L, field(L.root, "pre_tokenizer"))) return NULL;
    const cJSON *dec = field(L.root, "decoder");
    const cJSON *dt = cJSON_IsObject(dec) ? field(dec, "type") : NULL;
    if (!cJSON_IsString(dt) || strcmp(dt->valuestring, "ByteLevel")) {
        char s1[96];
        return load_fail(&L, "decoder must be {\"type\": \"ByteLevel\"}, got %s",
                         cJSON_IsString(dt) ? bpe_show(dt->valuestring, strlen(dt->valuestring), s1, sizeof s1)
                                            : type_name(dec));
    }
    const cJSON *model = field(L.root, "model");
    if (!parse_model(&L, model)) return NULL;
    if (!build_ids(&L)) return NULL;
    if (!parse_merges(&L, model)) return NULL;
    if (!build_bytes(&L)) return NULL;
    if (!parse_added(&L, field(L.root, "added_tokens"))) return NULL;
    if (!build_decoded(&L)) return NULL;
    /* the arena is final: added-token contents become pointers */
    for (int k = 0; k < b->n_added; k++)
        b->added[k].content = (const uint8_t *)b->strs.v + (uintptr_t)b->added[k].content;
    b->plain = malloc((size_t)(b->n_added ? b->n_added : 1) * sizeof *b->plain);
    if (!b->plain) return load_fail(&L, "out of memory");
    for (int k = 0; k < b->n_added; k++)
        if (!b->added[k].special) b->plain[b->n_plain++] = b->added[k];
    if (bpe_added_set_build(&b->pass1, b->added, b->n_added, 0) ||
        bpe_added_set_build(&b->pass2, b->added, b->n_added, 1) ||
        bpe_added_set_build(&b->text1, b->plain, b->n_plain, 0) ||
        bpe_added_set_build(&b->text2, b->plain, b->n_plain, 1))
        return load_fail(&L, "%s", tide_last_error());
    cJSON_Delete(L.root);
    free(L.model_ids);
    free(L.model_off);
    free(L.model_len);
    sha256_hex(b->json, b->json_n, b->sha);
    return b;
}

tide_bpe *tide_bpe_load(const char *path)
{
    if (!path || !path[0]) { tide_set_error("tokenizer: the path is %s", path ? "empty" : "NULL"); return NULL; }
    size_t n = 0;
    char *buf = tide_read_file(path, &n, FILE_MAX);
    if (!buf) {
        char msg[2048];
        snprintf(msg, sizeof msg, "tokenizer: %s", tide_last_error());
        tide_set_error_str(msg);
        return NULL;
    }
    tide_bpe *b = tide_bpe_load_memory(buf, n, path);
    free(buf);
    return b;
}

/* ---- queries -------------------------------------------------------------------------------------------- */
int64_t tide_bpe_vocab_size(const tide_bpe *b) { return b ? b->vocab_size : -1; }
const char *tide_bpe_sha256(const tide_bpe *b) { return b ? b->sha : ""; }
const char *tide_bpe_pretokenizer(const tide_bpe *b)
{
    if (!b) return "";
    if (b->split_pattern) return pattern_name(b->split_pattern);
    return b->bl_regex ? "gpt2" : "none";
}

const char *tide_bpe_json(const tide_bpe *b, size_t *n)
{
    if (n) *n = b ? b->json_n : 0;
    return b ? b->json : NULL;
}

int32_t tide_bpe_token_id(const tide_bpe *b, const char *token, size_t n)
{
    if (!b || !token) return -1;
    uint64_t h = bpe_hash((const uint8_t *)token, n);
    int32_t id = smap_get(&b->added_by_str, b->strs.v, token, n, h);
    return id >= 0 ? id : smap_get(&b->model_by_str, b->strs.v, token, n, h);
}

const char *tide_bpe_token(const tide_bpe *b, int32_t id, size_t *n)
{
    if (!b || id < 0 || id >= b->vocab_size || b->tok_len[id] == UINT32_MAX) {
        tide_set_error("tokenizer '%s': no token has id %d", b ? b->label : "?", id);
        return NULL;
    }
    if (n) *n = b->tok_len[id];
    return b->strs.v + b->tok_off[id];
}

int tide_bpe_added_count(const tide_bpe *b) { return b ? b->n_added : 0; }

int32_t tide_bpe_added(const tide_bpe *b, int i, int *special)
{
    if (!b || i < 0 || i >= b->n_added) return tide_set_error("tokenizer: no added token %d", i);
    if (special) *special = b->added[i].special;
    return b->added[i].id;
}

/* ---- encoding ------------------------------------------------------------------------------------------- */
static bpe_cache *cache_new(void)
{
    bpe_cache *c = calloc(1, sizeof *c);
    if (!c) return NULL;
    c->cap = 256;
    c->slots = calloc(c->cap, sizeof *c->slots);
    if (!c->slots) { free(c); return NULL; }
    return c;
}

static void cache_clear(bpe_cache *c)
{
    memset(c->slots, 0, c->cap * sizeof *c->slots);
    c->n = 0;
    c->keys.n = 0;
    c->ids.n = 0;
}

static int cache_grow(bpe_cache *c)
{
    size_t nc = c->cap * 2;
    cslot *s = calloc(nc, sizeof *s);
    if (!s) return -1;
    for (size_t i = 0; i < c->cap; i++) {
        if (!c->slots[i].key_len) continue;
        size_t j = c->slots[i].hash & (nc - 1);
        while (s[j].key_len) j = (j + 1) & (nc - 1);
        s[j] = c->slots[i];
    }
    free(c->slots);
    c->slots = s;
    c->cap = nc;
    return 0;
}

static int scratch(bpe_cache *c, size_t n)
{
    if (n <= c->scratch) return 0;
    size_t m = c->scratch ? c->scratch : 64;
    while (m < n) m *= 2;
    int32_t *a = realloc(c->sym, m * sizeof *a);
    if (a) c->sym = a;
    int32_t *b2 = realloc(c->nxt, m * sizeof *b2);
    if (b2) c->nxt = b2;
    int32_t *d = realloc(c->prv, m * sizeof *d);
    if (d) c->prv = d;
    uint64_t *h = realloc(c->heap, 2 * m * sizeof *h);
    if (h) c->heap = h;
    if (!a || !b2 || !d || !h) return tide_set_error("tokenizer: out of memory for a pre-token of %zu bytes", n);
    c->scratch = m;
    return 0;
}

/* the binary min-heap of (rank << 32 | position) */
static inline void heap_push(uint64_t *h, size_t *n, uint64_t x)
{
    size_t i = (*n)++;
    while (i > 0) {
        size_t p = (i - 1) / 2;
        if (h[p] <= x) break;
        h[i] = h[p];
        i = p;
    }
    h[i] = x;
}

static inline uint64_t heap_pop(uint64_t *h, size_t *n)
{
    uint64_t top = h[0], x = h[--(*n)];
    size_t i = 0, m = *n;
    for (;;) {
        size_t l = 2 * i + 1;
        if (l >= m) break;
        size_t r = l + 1, c = r < m && h[r] < h[l] ? r : l;
        if (h[c] >= x) break;
        h[i] = h[c];
        i = c;
    }
    if (m) h[i] = x;
    return top;
}

/* the ids of one pre-token (raw bytes p[0, n), n >= 1), appended to out */
static int bpe_word(const tide_bpe *b, bpe_cache *c, const uint8_t *p, size_t n, bpe_ivec *out)
{
    if (n == 1) return bpe_ivec_push(out, b->byte_id[p[0]]);
    uint64_t h = bpe_hash(p, n);
    if (b->ignore_merges) {
        int32_t id = smap_get(&b->model_by_bytes, b->strs.v, p, n, h);
        if (id >= 0) return bpe_ivec_push(out, id);
    }
    size_t slot = 0;
    int cacheable = n <= CACHE_KEY_MAX;
    if (cacheable) {
        slot = h & (c->cap - 1);
        for (;;) {
            cslot *e = &c->slots[slot];
            if (!e->key_len) break;
            if (e->hash == h && e->key_len == n && !memcmp(c->keys.v + e->key_off, p, n)) {
                if (bpe_ivec_grow(out, e->ids_n)) return -1;
                memcpy(out->v + out->n, c->ids.v + e->ids_off, e->ids_n * sizeof(int32_t));
                out->n += e->ids_n;
                return 0;
            }
            slot = (slot + 1) & (c->cap - 1);
        }
    }
    if (scratch(c, n)) return -1;
    int32_t *sym = c->sym, *nxt = c->nxt, *prv = c->prv;
    uint64_t *heap = c->heap;
    size_t hn = 0;
    for (size_t k = 0; k < n; k++) {
        sym[k] = b->byte_id[p[k]];
        nxt[k] = (int32_t)k + 1;
        prv[k] = (int32_t)k - 1;
    }
    for (size_t k = 0; k + 1 < n; k++) {
        const pslot *m = pmap_get(&b->merges, pair_key(sym[k], sym[k + 1]));
        if (m) heap_push(heap, &hn, ((uint64_t)(uint32_t)m->rank << 32) | k);
    }
    while (hn) {
        uint64_t top = heap_pop(heap, &hn);
        int32_t pos = (int32_t)(uint32_t)top, rank = (int32_t)(top >> 32);
        if (sym[pos] < 0) continue;                      /* merged into its left neighbour */
        int32_t r = nxt[pos];
        if (r >= (int32_t)n) continue;
        const pslot *m = pmap_get(&b->merges, pair_key(sym[pos], sym[r]));
        if (!m || m->rank != rank) continue;             /* a stale entry */
        sym[pos] = m->id;
        sym[r] = -1;
        nxt[pos] = nxt[r];
        if (nxt[r] < (int32_t)n) prv[nxt[r]] = pos;
        if (prv[pos] >= 0) {
            const pslot *ml = pmap_get(&b->merges, pair_key(sym[prv[pos]], sym[pos]));
            if (ml) heap_push(heap, &hn, ((uint64_t)(uint32_t)ml->rank << 32) | (uint32_t)prv[pos]);
        }
        if (nxt[pos] < (int32_t)n) {
            const pslot *mr = pmap_get(&b->merges, pair_key(sym[pos], sym[nxt[pos]]));
            if (mr) heap_push(heap, &hn, ((uint64_t)(uint32_t)mr->rank << 32) | (uint32_t)pos);
        }
    }
    size_t first = out->n;
    for (int32_t k = 0; k < (int32_t)n; k = nxt[k])
        if (bpe_ivec_push(out, sym[k])) return -1;
    if (cacheable) {
        size_t count = out->n - first;
        if (c->n + 1 > c->cap / 2) {
            if (c->cap >= CACHE_SLOTS_MAX || cache_grow(c)) cache_clear(c);
            slot = h & (c->cap - 1);
            while (c->slots[slot].key_len) slot = (slot + 1) & (c->cap - 1);
        }
        size_t koff = c->keys.n, ioff = c->ids.n;
        if (bpe_buf_put(&c->keys, p, n) || bpe_ivec_grow(&c->ids, count)) return -1;
        memcpy(c->ids.v + ioff, out->v + first, count * sizeof(int32_t));
        c->ids.n += count;
        c->slots[slot] = (cslot){ h, (uint32_t)koff, (uint32_t)n, (uint32_t)ioff, (uint32_t)count };
        c->n++;
        if (c->keys.n > (64u << 20) || c->ids.n > (16u << 20)) cache_clear(c);
    }
    return 0;
}

/* the ByteLevel stage on one piece: the prefix space, the GPT-2 regex when use_regex, then BPE */
static int byte_level(const tide_bpe *b, bpe_cache *c, const uint8_t *s, size_t n, bpe_ivec *out)
{
    if (b->prefix_space && s[0] != ' ') {
        c->tmp.n = 0;
        if (bpe_buf_put(&c->tmp, " ", 1) || bpe_buf_put(&c->tmp, s, n)) return -1;
        s = (const uint8_t *)c->tmp.v;
        n = c->tmp.n;
    }
    if (!b->bl_regex) return bpe_word(b, c, s, n, out);
    for (size_t i = 0; i < n;) {
        size_t e = bpe_piece_end(BPE_PAT_GPT2, s, n, i);
        if (bpe_word(b, c, s + i, e - i, out)) return -1;
        i = e;
    }
    return 0;
}

/* one text piece left by the added tokens */
static int pre_tokenize(const tide_bpe *b, bpe_cache *c, const uint8_t *s, size_t n, bpe_ivec *out)
{
    if (!b->split_pattern) return byte_level(b, c, s, n, out);
    for (size_t i = 0; i < n;) {
        size_t e = bpe_piece_end(b->split_pattern, s, n, i);
        if (byte_level(b, c, s + i, e - i, out)) return -1;
        i = e;
    }
    return 0;
}

/* ordinary: special added tokens are not split out (their names are text, as for the byte-level tokenizer) */
static int encode_text(const tide_bpe *b, bpe_cache *c, const uint8_t *s, size_t n, int ordinary, bpe_ivec *out)
{
    if (n == 0) return 0;
    const bpe_added_set *p1 = ordinary ? &b->text1 : &b->pass1, *p2 = ordinary ? &b->text2 : &b->pass2;
    if (p1->n + p2->n == 0) return pre_tokenize(b, c, s, n, out);
    c->segs1.n = 0;
    if (bpe_added_split(p1, s, 0, n, &c->segs1)) return -1;
    for (size_t i = 0; i < c->segs1.n; i++) {
        bpe_seg g = c->segs1.v[i];
        if (g.id >= 0) {
            if (bpe_ivec_push(out, g.id)) return -1;
            continue;
        }
        c->segs2.n = 0;
        if (bpe_added_split(p2, s, g.a, g.b, &c->segs2)) return -1;
        for (size_t j = 0; j < c->segs2.n; j++) {
            bpe_seg h = c->segs2.v[j];
            if (h.id >= 0) { if (bpe_ivec_push(out, h.id)) return -1; }
            else if (pre_tokenize(b, c, s + h.a, h.b - h.a, out)) return -1;
        }
    }
    return 0;
}

/* the cache of OpenMP thread t (made on first use) */
static int ensure_caches(tide_bpe *b, int n)
{
    if (n <= b->n_caches) return 0;
    bpe_cache **v = realloc(b->caches, (size_t)n * sizeof *v);
    if (!v) return tide_set_error("tokenizer: out of memory");
    for (int i = b->n_caches; i < n; i++) v[i] = NULL;
    b->caches = v;
    b->n_caches = n;
    return 0;
}

static bpe_cache *cache_of(tide_bpe *b, int t)
{
    if (!b->caches[t]) b->caches[t] = cache_new();
    return b->caches[t];
}

int64_t tide_bpe_encode(tide_bpe *b, const char *text, size_t n, int32_t *out, int64_t cap)
{
    if (!b) return tide_set_error("tokenizer encode: the tokenizer is NULL");
    if (!text && n) return tide_set_error("tokenizer encode: the text is NULL");
    if (ensure_caches(b, 1)) return -1;
    bpe_cache *c = cache_of(b, 0);
    if (!c) return tide_set_error("tokenizer encode: out of memory");
    bpe_ivec v = { 0 };
    if (encode_text(b, c, (const uint8_t *)text, n, 0, &v)) { free(v.v); return -1; }
    if (out && cap > 0 && v.n) memcpy(out, v.v, (size_t)((int64_t)v.n < cap ? (int64_t)v.n : cap) * sizeof *out);
    free(v.v);
    return (int64_t)v.n;
}

typedef struct { size_t doc, a, e; int first; } work_item;

int32_t *tide_bpe_encode_docs(tide_bpe *b, const char *text, const int64_t *offsets, int64_t n_docs, int32_t sep_id,
                              int split_special, int64_t *doc_starts, int64_t *n_out)
{
    int ordinary = !split_special;
    if (n_out) *n_out = 0;
    if (!b || !offsets || n_docs < 0 || !n_out) { tide_set_error("tokenizer encode_docs: bad arguments"); return NULL; }
    if (!text && n_docs > 0 && offsets[n_docs] > offsets[0]) { tide_set_error("tokenizer encode_docs: the text is NULL"); return NULL; }
    for (int64_t d = 0; d < n_docs; d++)
        if (offsets[d] < 0 || offsets[d + 1] < offsets[d]) {
            tide_set_error("tokenizer encode_docs: offsets[%lld] = %lld and offsets[%lld] = %lld are not ascending",
                           (long long)d, (long long)offsets[d], (long long)d + 1, (long long)offsets[d + 1]);
            return NULL;
        }
    if (sep_id >= b->vocab_size) { tide_set_error("tokenizer encode_docs: separator id %d >= vocab size %d", sep_id, b->vocab_size); return NULL; }
    /* work items: documents, long ones cut where pre-tokens end whatever the context (bpe_chunk_ends) */
    work_item *items = NULL;
    size_t n_items = 0, cap_items = 0;
    bpe_zvec ends = { 0 };
    int failed = 0;
    for (int64_t d = 0; d < n_docs && !failed; d++) {
        const uint8_t *s = (const uint8_t *)text + offsets[d];
        size_t len = (size_t)(offsets[d + 1] - offsets[d]);
        ends.n = 0;
        if (len > 2 * CHUNK_BYTES && !b->prefix_space) {
            if (bpe_chunk_ends(s, len, CHUNK_BYTES, b->added, b->n_added, &ends)) failed = 1;
        } else if (bpe_zvec_push(&ends, len)) failed = 1;
        size_t from = 0;
        for (size_t k = 0; k < ends.n && !failed; k++) {
            if (n_items == cap_items) {
                size_t nc = cap_items ? cap_items * 2 : 1024;
                work_item *v = realloc(items, nc * sizeof *v);
                if (!v) { failed = 1; tide_set_error("tokenizer encode_docs: out of memory"); break; }
                items = v;
                cap_items = nc;
            }
            items[n_items++] = (work_item){ (size_t)d, (size_t)offsets[d] + from, (size_t)offsets[d] + ends.v[k], k == 0 };
            from = ends.v[k];
        }
    }
    free(ends.v);
    int nt = omp_get_max_threads();
    if (nt < 1) nt = 1;
    if (!failed && ensure_caches(b, nt)) failed = 1;
    for (int t = 0; t < nt && !failed; t++)
        if (!cache_of(b, t)) { failed = 1; tide_set_error("tokenizer encode_docs: out of memory"); }
    bpe_ivec *outs = failed ? NULL : calloc((size_t)nt, sizeof *outs);
    size_t *item_thread = failed ? NULL : malloc((n_items ? n_items : 1) * sizeof *item_thread);
    size_t *item_at = failed ? NULL : malloc((n_items ? n_items : 1) * sizeof *item_at);
    size_t *item_n = failed ? NULL : malloc((n_items ? n_items : 1) * sizeof *item_n);
    if (!failed && (!outs || !item_thread || !item_at || !item_n)) { failed = 1; tide_set_error("tokenizer encode_docs: out of memory"); }
    char err[2048] = "";
    if (!failed) {
        #pragma omp parallel num_threads(nt)
        {
            int t = omp_get_thread_num();
            bpe_cache *c = b->caches[t];
            bpe_ivec *o = &outs[t];
            #pragma omp for schedule(dynamic, 1)
            for (size_t i = 0; i < n_items; i++) {
                size_t at = o->n;
                int rc = 0;
                if (items[i].first && sep_id >= 0) rc = bpe_ivec_push(o, sep_id);
                if (!rc) rc = encode_text(b, c, (const uint8_t *)text + items[i].a, items[i].e - items[i].a, ordinary, o);
                if (rc) {
                    #pragma omp critical(tide_bpe_err)
                    if (!err[0]) snprintf(err, sizeof err, "%s", tide_last_error());
                }
                item_thread[i] = (size_t)t;
                item_at[i] = at;
                item_n[i] = o->n - at;
            }
        }
        if (err[0]) { failed = 1; tide_set_error_str(err); }
    }
    int32_t *res = NULL;
    if (!failed) {
        size_t total = 0;
        for (size_t i = 0; i < n_items; i++) total += item_n[i];
        res = malloc((total ? total : 1) * sizeof *res);
        if (!res) { failed = 1; tide_set_error("tokenizer encode_docs: out of memory for %zu ids", total); }
        else {
            size_t pos = 0;
            for (size_t i = 0; i < n_items; i++) {
                if (doc_starts && items[i].first) doc_starts[items[i].doc] = (int64_t)pos;
                if (item_n[i]) memcpy(res + pos, outs[item_thread[i]].v + item_at[i], item_n[i] * sizeof *res);
                pos += item_n[i];
            }
            if (doc_starts) {
                /* documents without items (none: every document has one) and the end */
                doc_starts[n_docs] = (int64_t)pos;
            }
            *n_out = (int64_t)pos;
        }
    }
    if (outs) for (int t = 0; t < nt; t++) free(outs[t].v);
    free(outs);
    free(items);
    free(item_thread);
    free(item_at);
    free(item_n);
    return failed ? NULL : res;
}

/* ---- decoding ------------------------------------------------------------------------------------------- */
int64_t tide_bpe_decode(const tide_bpe *b, const int32_t *ids, int64_t n, int skip_special, char *out, int64_t cap)
{
    if (!b || (n > 0 && !ids)) return tide_set_error("tokenizer decode: bad arguments");
    int64_t k = 0;
    for (int64_t i = 0; i < n; i++) {
        int32_t id = ids[i];
        if (id < 0 || id >= b->vocab_size || b->tok_len[id] == UINT32_MAX)
            return tide_set_error("tokenizer decode: id %d at position %lld is not in the vocabulary of %d ('%s')", id,
                                  (long long)i + 1, b->vocab_size, b->label);
        if (skip_special && (b->flags[id] & F_SPECIAL)) continue;
        uint32_t len = b->dec_len[id];
        if (out && k + len <= cap) memcpy(out + k, b->strs.v + b->dec_off[id], len);
        k += len;
    }
    return k;
}

/* ---- SHA-256 (FIPS 180-4), the tokenizer's identity in checkpoints ----------------------------------------- */
static const uint32_t K256[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5, 0xd807aa98,
    0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174, 0xe49b69c1, 0xefbe4786,
    0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da, 0x983e5152, 0xa831c66d, 0xb00327c8,
    0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967, 0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13,
    0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85, 0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819,
    0xd6990624, 0xf40e3585, 0x106aa070, 0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a,
    0x5b9cca4f, 0x682e6ff3, 0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7,
    0xc67178f2,
};

static inline uint32_t ror(uint32_t x, int r) { return (x >> r) | (x << (32 - r)); }

static void sha256_block(uint32_t h[8], const uint8_t *p)
{
    uint32_t w[64];
    for (int i = 0; i < 16; i++)
        w[i] = ((uint32_t)p[4 * i] << 24) | ((uint32_t)p[4 * i + 1] << 16) | ((uint32_t)p[4 * i + 2] << 8) | p[4 * i + 3];
    for (int i = 16; i < 64; i++) {
        uint32_t s0 = ror(w[i - 15], 7) ^ ror(w[i - 15], 18) ^ (w[i - 15] >> 3);
        uint32_t s1 = ror(w[i - 2], 17) ^ ror(w[i - 2], 19) ^ (w[i - 2] >> 10);
        w[i] = w[i - 16] + s0 + w[i - 7] + s1;
    }
    uint32_t a = h[0], b = h[1], c = h[2], d = h[3], e = h[4], f = h[5], g = h[6], hh = h[7];
    for (int i = 0; i < 64; i++) {
        uint32_t t1 = hh + (ror(e, 6) ^ ror(e, 11) ^ ror(e, 25)) + ((e & f) ^ (~e & g)) + K256[i] + w[i];
        uint32_t t2 = (ror(a, 2) ^ ror(a, 13) ^ ror(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
        hh = g; g = f; f = e; e = d + t1; d = c; c = b; b = a; a = t1 + t2;
    }
    h[0] += a; h[1] += b; h[2] += c; h[3] += d; h[4] += e; h[5] += f; h[6] += g; h[7] += hh;
}

static void sha256_hex(const void *data, size_t n, char out[65])
{
    uint32_t h[8] = { 0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19 };
    const uint8_t *p = data;
    size_t left = n;
    while (left >= 64) { sha256_block(h, p); p += 64; left -= 64; }
    uint8_t tail[128] = { 0 };
    memcpy(tail, p, left);
    tail[left] = 0x80;
    size_t tn = left + 1 + 8 <= 64 ? 64 : 128;
    uint64_t bits = (uint64_t)n * 8;
    for (int i = 0; i < 8; i++) tail[tn - 1 - i] = (uint8_t)(bits >> (8 * i));
    sha256_block(h, tail);
    if (tn == 128) sha256_block(h, tail + 64);
    for (int i = 0; i < 8; i++) snprintf(out + 8 * i, 9, "%08x", h[i]);
}

int tide_sha256_hex(const void *bytes, size_t n, char *out)
{
    if (!out || (!bytes && n)) return tide_set_error("sha256: bad arguments");
    sha256_hex(bytes, n, out);
    return 0;
}
