/*
 * fuzz_json.c — the JSON that engine/io reads with cJSON (formats.md §1): a safetensors header and the
 * metadata object that tide_safetensors_save accepts.
 *
 * The input is JSON text. (1) As the header of a file with an empty data buffer (the 8-byte length is
 * written here, so every mutation lands in the JSON): it opens only when every tensor it names has zero
 * bytes, and then its metadata is a JSON object of strings. (2) As metadata_json of a save with no tensors:
 * when the save accepts it, the file opens again and its metadata is the accepted object exactly
 * (cJSON's own rendering of the input), so the writer's and the reader's escaping agree.
 */
#include <cjson/cJSON.h>
#include "fuzz.h"

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    fuzz_init_engine();
    return 0;
}

/* metadata text as the reader returns it: a JSON object whose values are strings */
static void check_metadata(const char *text, const char *what)
{
    FUZZ_CHECK(text, "%s: metadata is NULL", what);
    cJSON *m = cJSON_Parse(text);
    FUZZ_CHECK(m && cJSON_IsObject(m), "%s: metadata '%.80s' is not a JSON object", what, text);
    for (const cJSON *c = m->child; c; c = c->next)
        FUZZ_CHECK(cJSON_IsString(c), "%s: metadata value of '%.60s' is not a string", what, c->string);
    cJSON_Delete(m);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size > 1 << 20) return 0;
    /* (1) a header with an empty data buffer */
    unsigned char *file = malloc(size + 8);
    FUZZ_CHECK(file, "out of memory");
    for (int k = 0; k < 8; k++) file[k] = (unsigned char)((uint64_t)size >> (8 * k));
    memcpy(file + 8, data, size);
    tide_safetensors *h = tide_safetensors_open_memory(file, size + 8, "fuzz-header");
    free(file);
    if (h) {
        check_metadata(tide_safetensors_metadata(h), "header");
        for (int i = 0; i < tide_safetensors_count(h); i++) {
            tide_tensor *t = tide_safetensors_get(h, i, TIDE_CPU);
            FUZZ_CHECK(!t || tide_tensor_nbytes(t) == 0, "tensor %d of an empty data buffer has bytes", i);
            tide_tensor_release(t);
        }
        tide_safetensors_close(h);
    } else {
        FUZZ_CHECK(tide_last_error()[0], "a refused header sets an error");
    }

    /* (2) the same text as save's metadata (a C string: it ends at the first NUL) */
    char *text = malloc(size + 1);
    FUZZ_CHECK(text, "out of memory");
    memcpy(text, data, size);
    text[size] = 0;
    const char *path = fuzz_path(0, "meta.safetensors");
    if (tide_safetensors_save(path, 0, NULL, NULL, text) == 0) {
        tide_safetensors *r = tide_safetensors_open(path);
        FUZZ_CHECK(r, "a file save wrote does not open");
        const char *got = tide_safetensors_metadata(r);
        check_metadata(got, "saved");
        cJSON *want = cJSON_Parse(text);
        char *w = want ? cJSON_PrintUnformatted(want) : NULL;
        FUZZ_CHECK(w && !strcmp(got, w), "metadata written '%.80s', read back '%.80s'", w ? w : "(unparsed)", got);
        free(w);
        cJSON_Delete(want);
        FUZZ_CHECK(tide_safetensors_count(r) == 0, "no tensors were saved");
        tide_safetensors_close(r);
    } else {
        FUZZ_CHECK(tide_last_error()[0], "a refused save sets an error");
    }
    free(text);
    return 0;
}
