/*
 * fuzz_bpe.c — the byte-level BPE (engine/io/bpe*.c; formats.md §4): the tokenizer.json loader, encoding and
 * decoding, training, and the JSONL text reader, on hostile bytes.
 *
 * The first input byte picks what the rest is:
 *   0  a tokenizer.json: it loads or fails with a one-line error naming it; a loaded one encodes fixed texts and
 *      the start of the input to ids below its vocab_size that decode, and encoding the input as two documents gives
 *      each document's ids behind the separator
 *   1  text for two fixed tokenizers (the GPT-2 and the Llama-3 pre-tokenizer, merges, a special token): decode
 *      gives the text back byte for byte, and the documents' ids are the texts' ids
 *   2  text to train on: the trained tokenizer.json loads, has the vocabulary it reports, and round trips the text
 *   3  JSONL: tide_jsonl_texts succeeds with ascending offsets inside its text, or fails with a one-line error
 */
#include "fuzz.h"

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static tide_bpe *g_tok[2];

/* a small byte-level tokenizer: the 256 byte symbols, a few merges, two specials; pre_tokenizer `pre` */
static tide_bpe *fixed_tokenizer(const char *pre, const char *label)
{
    static char json[64 << 10];
    size_t k = 0;
    k += (size_t)snprintf(json + k, sizeof json - k,
                          "{\"added_tokens\": [{\"id\": 262, \"content\": \"<|endoftext|>\", \"special\": true, "
                          "\"normalized\": false}, {\"id\": 263, \"content\": \"<mask>\", \"special\": true, "
                          "\"lstrip\": true, \"normalized\": false}], \"normalizer\": null, \"pre_tokenizer\": %s, "
                          "\"decoder\": {\"type\": \"ByteLevel\"}, \"model\": {\"type\": \"BPE\", \"vocab\": {", pre);
    for (int b = 0; b < 256; b++) {
        /* GPT-2 bytes_to_unicode (formats.md §4) */
        int keep = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
        int cp = b, n = 0;
        if (!keep) {
            for (int c = 0; c < b; c++)
                n += !((c >= 0x21 && c <= 0x7E) || (c >= 0xA1 && c <= 0xAC) || (c >= 0xAE && c <= 0xFF));
            cp = 256 + n;
        }
        if (cp == '"' || cp == '\\') k += (size_t)snprintf(json + k, sizeof json - k, "\"\\%c\": %d, ", cp, b);
        else if (cp < 0x80) k += (size_t)snprintf(json + k, sizeof json - k, "\"%c\": %d, ", cp, b);
        else k += (size_t)snprintf(json + k, sizeof json - k, "\"%c%c\": %d, ", 0xC0 | (cp >> 6), 0x80 | (cp & 0x3F), b);
    }
    k += (size_t)snprintf(json + k, sizeof json - k,
                          "\"\xc4\xa0t\": 256, \"he\": 257, \"\xc4\xa0the\": 258, \"in\": 259, \"\xc4\xa0\xc4\xa0\": 260, "
                          "\"<|endoftext|>\": 262, \"\xc4\xa0" "a\": 261}, \"merges\": [\"\xc4\xa0 t\", \"h e\", "
                          "[\"\xc4\xa0t\", \"he\"], \"i n\", \"\xc4\xa0 \xc4\xa0\", \"\xc4\xa0 a\"]}}");
    tide_bpe *b = tide_bpe_load_memory(json, k, label);
    FUZZ_CHECK(b, "the fixed tokenizer %s loads", label);
    return b;
}

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    fuzz_init_engine();
    g_tok[0] = fixed_tokenizer("{\"type\": \"ByteLevel\", \"add_prefix_space\": false, \"use_regex\": true}", "gpt2");
    g_tok[1] = fixed_tokenizer(
        "{\"type\": \"Sequence\", \"pretokenizers\": [{\"type\": \"Split\", \"pattern\": {\"Regex\": "
        "\"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\\\r\\\\n\\\\p{L}\\\\p{N}]?\\\\p{L}+|\\\\p{N}{1,3}| ?[^\\\\s\\\\p{L}\\\\p{N}]+"
        "[\\\\r\\\\n]*|\\\\s*[\\\\r\\\\n]+|\\\\s+(?!\\\\S)|\\\\s+\"}, \"behavior\": \"Isolated\", \"invert\": false}, "
        "{\"type\": \"ByteLevel\", \"add_prefix_space\": false, \"use_regex\": false}]}", "llama3");
    return 0;
}

/* ids of text[0, n) (malloc'd) and their count */
static int32_t *encode(tide_bpe *b, const char *text, size_t n, int64_t *count)
{
    /* at most one id per byte, plus one per piece for the ByteLevel prefix space */
    int64_t cap = 2 * (int64_t)n + 1;
    int32_t *ids = malloc((size_t)cap * sizeof *ids);
    FUZZ_CHECK(ids, "out of memory");
    int64_t k = tide_bpe_encode(b, text, n, ids, cap);
    FUZZ_CHECK(k >= 0 && k <= cap, "encode of %zu bytes gave %lld ids", n, (long long)k);
    int64_t V = tide_bpe_vocab_size(b);
    for (int64_t i = 0; i < k; i++) FUZZ_CHECK(ids[i] >= 0 && ids[i] < V, "id %d outside [0, %lld)", ids[i], (long long)V);
    *count = k;
    return ids;
}

/* the decoded bytes of ids (malloc'd), their count in *n */
static char *decode(const tide_bpe *b, const int32_t *ids, int64_t k, size_t *n)
{
    int64_t len = tide_bpe_decode(b, ids, k, 0, NULL, 0);
    FUZZ_CHECK(len >= 0, "encoded ids decode");
    char *out = malloc((size_t)len + 1);
    FUZZ_CHECK(out, "out of memory");
    FUZZ_CHECK(tide_bpe_decode(b, ids, k, 0, out, len) == len, "the same length twice");
    *n = (size_t)len;
    return out;
}

/* the input as two documents (split in the middle): each document's ids behind sep, as split_special = 1 */
static void check_docs(tide_bpe *b, const char *text, size_t n)
{
    int64_t offs[3] = { 0, (int64_t)(n / 2), (int64_t)n }, starts[3], total = 0;
    int32_t sep = (int32_t)tide_bpe_vocab_size(b) - 1;
    int32_t *all = tide_bpe_encode_docs(b, text, offs, 2, sep, 1, starts, &total);
    FUZZ_CHECK(all, "encode_docs");
    for (int d = 0; d < 2; d++) {
        int64_t k;
        int32_t *ids = encode(b, text + offs[d], (size_t)(offs[d + 1] - offs[d]), &k);
        FUZZ_CHECK(starts[d + 1] - starts[d] == k + 1 && all[starts[d]] == sep, "document %d: %lld ids + sep", d,
                   (long long)k);
        FUZZ_CHECK(!memcmp(all + starts[d] + 1, ids, (size_t)k * sizeof *ids), "document %d ids", d);
        free(ids);
    }
    FUZZ_CHECK(starts[2] == total, "the documents end the array");
    tide_free(all);
}

static void roundtrip(tide_bpe *b, const char *text, size_t n)
{
    int64_t k;
    int32_t *ids = encode(b, text, n, &k);
    size_t m;
    char *back = decode(b, ids, k, &m);
    FUZZ_CHECK(m == n && !memcmp(back, text, n), "decode(encode(%zu bytes)) gave %zu bytes", n, m);
    free(back);
    free(ids);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1 || size > (256 << 10)) return 0;
    const char *rest = (const char *)data + 1;
    size_t n = size - 1;
    switch (data[0] % 4) {
    case 0: {
        tide_clear_error();
        tide_bpe *b = tide_bpe_load_memory(rest, n, "fuzz.json");
        if (!b) {
            const char *e = tide_last_error();
            FUZZ_CHECK(strstr(e, "fuzz.json") && !strchr(e, '\n'), "a one-line error naming the file: %s", e);
            return 0;
        }
        static const char *texts[] = { "Hello, world! It's 3.14 \xf0\x9f\x98\x80", "  \n\t\r\n x<|endoftext|>y", "" };
        for (int t = 0; t < 3; t++) {
            int64_t k;
            int32_t *ids = encode(b, texts[t], strlen(texts[t]), &k);
            size_t m;
            free(decode(b, ids, k, &m));
            free(ids);
        }
        if (tide_bpe_vocab_size(b) > 0) check_docs(b, rest, n > 256 ? 256 : n);
        size_t jn = 0;
        const char *j = tide_bpe_json(b, &jn);
        FUZZ_CHECK(jn == n && !memcmp(j, rest, n), "json() is the file");
        tide_bpe_free(b);
        break;
    }
    case 1:
        for (int t = 0; t < 2; t++) {
            /* <mask> strips spaces on its left: text with it does not round trip, so leave such inputs alone */
            if (memmem(rest, n, "<mask>", 6)) break;
            roundtrip(g_tok[t], rest, n);
            check_docs(g_tok[t], rest, n);
        }
        break;
    case 2: {
        if (n > 2048) return 0;
        const char *sp[2] = { "<|endoftext|>", "<pop>" };
        tide_bpe_trainer *tr = tide_bpe_trainer_new(sp, 2);
        FUZZ_CHECK(tr, "trainer");
        int64_t offs[2] = { 0, (int64_t)n };
        FUZZ_CHECK(tide_bpe_trainer_add_docs(tr, rest, offs, 1) == 0, "add_docs");
        int64_t made;
        while ((made = tide_bpe_trainer_merge(tr, 300, 1 + (data[0] >> 7), 8)) > 0) {}
        FUZZ_CHECK(made == 0, "merge");
        size_t jn;
        char *j = tide_bpe_trainer_json(tr, &jn);
        FUZZ_CHECK(j, "json");
        tide_bpe *b = tide_bpe_load_memory(j, jn, "trained");
        FUZZ_CHECK(b, "the trained tokenizer loads");
        FUZZ_CHECK(tide_bpe_vocab_size(b) == tide_bpe_trainer_vocab_size(tr), "vocab %lld vs %lld",
                   (long long)tide_bpe_vocab_size(b), (long long)tide_bpe_trainer_vocab_size(tr));
        roundtrip(b, rest, n);
        tide_bpe_free(b);
        tide_free(j);
        tide_bpe_trainer_free(tr);
        break;
    }
    case 3: {
        int64_t *offs = NULL, nd = -1;
        tide_clear_error();
        char *text = tide_jsonl_texts(rest, n, "text", "fuzz.jsonl", &offs, &nd);
        if (!text) {
            const char *e = tide_last_error();
            FUZZ_CHECK(strstr(e, "fuzz.jsonl") && !strchr(e, '\n'), "a one-line error naming the file: %s", e);
            FUZZ_CHECK(!offs, "no offsets on failure");
            return 0;
        }
        FUZZ_CHECK(nd >= 0 && offs && offs[0] == 0, "offsets");
        for (int64_t d = 0; d < nd; d++) FUZZ_CHECK(offs[d + 1] >= offs[d], "ascending offsets");
        FUZZ_CHECK(offs[nd] <= (int64_t)n, "the texts are no longer than the file");
        tide_free(text);
        tide_free(offs);
        break;
    }
    }
    return 0;
}
