/*
 * fuzz_checkpoint.c — loading a checkpoint directory (formats.md §6) through the C entry points that
 * lua/tide/checkpoint.lua calls: tide_is_dir, tide_list_dir, tide_path_exists, tide_file_size, tide_read_file
 * (state.json and `latest`), and the safetensors reader (open, count, name, find, get, metadata) on
 * model.safetensors and optim.safetensors.
 *
 * The input is a whole directory: state.json, model.safetensors, optim.safetensors and latest, in that order,
 * separated by the line "--tide-ckpt--"; a part that is absent removes its file. state.json is parsed with
 * cJSON here (the Lua side uses tide.json) and every string in it is looked up in both tensor files, as
 * the optimiser's state names are. Each call succeeds or sets an error; an opened file's tensors all load
 * or fail with an error, and the sizes and listings agree with what was written.
 */
#include <cjson/cJSON.h>
#include "fuzz.h"

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static const char SEP[] = "\n--tide-ckpt--\n";
enum { NPARTS = 4 };
static const char *const part_names[NPARTS] = { "state.json", "model.safetensors", "optim.safetensors", "latest" };
static char run_ckpt[512], step_dir[512];

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    fuzz_init_engine();
    snprintf(run_ckpt, sizeof run_ckpt, "%s/run/ckpt", fuzz_dir());
    snprintf(step_dir, sizeof step_dir, "%s/step_00000001", run_ckpt);
    FUZZ_CHECK(tide_mkdir_p(step_dir) == 0, "mkdir %s", step_dir);
    return 0;
}

static const uint8_t *find_sep(const uint8_t *p, const uint8_t *end)
{
    size_t k = sizeof SEP - 1;
    for (; p + k <= end; p++)
        if (!memcmp(p, SEP, k)) return p;
    return NULL;
}

/* every string value in the state, looked up by name in both files (as optim.lua does with its state names) */
static void lookup_strings(const cJSON *x, tide_safetensors *const *files, int depth)
{
    if (!x || depth > 64) return;
    if (cJSON_IsString(x) && x->valuestring) {
        for (int f = 0; f < 2; f++) {
            if (!files[f]) continue;
            int i = tide_safetensors_find(files[f], x->valuestring);
            FUZZ_CHECK(i >= -1 && i < tide_safetensors_count(files[f]), "find gave %d", i);
            if (i >= 0) {
                FUZZ_CHECK(!strcmp(tide_safetensors_name(files[f], i), x->valuestring), "find('%.60s')",
                           x->valuestring);
                tide_tensor *t = tide_safetensors_get(files[f], i, TIDE_CPU);
                FUZZ_CHECK(t || tide_last_error()[0], "get without an error");
                tide_tensor_release(t);
            }
        }
    }
    for (const cJSON *c = x->child; c; c = c->next) lookup_strings(c, files, depth + 1);
}

static void check_file(tide_safetensors *h)
{
    const char *meta = tide_safetensors_metadata(h);
    cJSON *m = cJSON_Parse(meta);
    FUZZ_CHECK(m && cJSON_IsObject(m), "metadata '%.80s' is not an object", meta);
    cJSON_Delete(m);
    int n = tide_safetensors_count(h);
    for (int i = 0; i < n; i++) {
        const char *name = tide_safetensors_name(h, i);
        FUZZ_CHECK(name && tide_safetensors_find(h, name) == i, "name %d", i);
        tide_tensor *t = tide_safetensors_get(h, i, TIDE_CPU);
        FUZZ_CHECK(t || tide_last_error()[0], "get %d without an error", i);
        tide_tensor_release(t);
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    const uint8_t *at = data, *end = data + size;
    size_t part_size[NPARTS];
    int present[NPARTS];
    char path[NPARTS][600];
    for (int k = 0; k < NPARTS; k++) {
        snprintf(path[k], sizeof path[k], "%s/%s", k == 3 ? run_ckpt : step_dir, part_names[k]);
        present[k] = at != NULL;
        if (!at) {
            unlink(path[k]);
            continue;
        }
        const uint8_t *s = k < NPARTS - 1 ? find_sep(at, end) : NULL;
        const uint8_t *stop = s ? s : end;
        part_size[k] = (size_t)(stop - at);
        fuzz_write(path[k], at, part_size[k]);
        at = s ? s + sizeof SEP - 1 : NULL;
    }

    /* checkpoint.list and checkpoint.latest */
    FUZZ_CHECK(tide_is_dir(run_ckpt) == 1, "the ckpt directory");
    size_t ln = 0;
    char *names = tide_list_dir(run_ckpt, &ln);
    FUZZ_CHECK(names, "list_dir");
    int saw_step = 0;
    for (size_t p = 0; p < ln; p += strlen(names + p) + 1) saw_step |= !strcmp(names + p, "step_00000001");
    FUZZ_CHECK(saw_step, "list_dir misses step_00000001");
    tide_free(names);
    for (int k = 0; k < NPARTS; k++) {
        FUZZ_CHECK(tide_path_exists(path[k]) == present[k], "%s exists: %d", part_names[k], present[k]);
        if (present[k])
            FUZZ_CHECK(tide_file_size(path[k]) == (int64_t)part_size[k], "%s: size %lld, wrote %zu", part_names[k],
                       (long long)tide_file_size(path[k]), part_size[k]);
    }
    if (present[3]) {
        size_t n = 0;
        char *latest = tide_read_file(path[3], &n, 4096);
        FUZZ_CHECK(latest ? n == part_size[3] : part_size[3] > 4096, "latest: %zu bytes", part_size[3]);
        tide_free(latest);
    }

    /* checkpoint.open and Reader:tensors / Reader:get */
    tide_safetensors *files[2] = { NULL, NULL };
    for (int f = 0; f < 2; f++) {
        files[f] = tide_safetensors_open(path[1 + f]);
        FUZZ_CHECK(files[f] || tide_last_error()[0], "%s: open without an error", part_names[1 + f]);
        if (files[f]) check_file(files[f]);
    }
    size_t sn = 0;
    char *state = tide_read_file(path[0], &sn, 1 << 20);
    FUZZ_CHECK(!present[0] || state || part_size[0] > (1 << 20), "state.json: %s", tide_last_error());
    if (state) {
        cJSON *root = cJSON_ParseWithLength(state, sn);
        lookup_strings(root, files, 0);
        cJSON_Delete(root);
        tide_free(state);
    }
    for (int f = 0; f < 2; f++) tide_safetensors_close(files[f]);
    return 0;
}
