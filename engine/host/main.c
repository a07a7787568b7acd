/*
 * main.c — the `tide` executable: embeds LuaJIT and hands the command line to lua/tide/cli.lua.
 *
 * libtide is linked with --no-as-needed and this executable exports its symbols, so the Lua side
 * reaches the engine through ffi.C. The few functions below named tide_host_* are the host's own
 * (line editing for the REPL); they are declared for the FFI in lua/tide/repl.lua, not in tide.h.
 */
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <lauxlib.h>
#include <lua.h>
#include <luajit.h>
#include <lualib.h>

#include "tide.h"

#ifdef TIDE_HAVE_READLINE
#include <readline/history.h>
#include <readline/readline.h>
#endif

#ifndef TIDE_SOURCE_DIR
#define TIDE_SOURCE_DIR "."
#endif

#define TIDE_HISTORY_LINES 2000

/* exported to the Lua side (ffi.C); repl.lua carries the matching declarations */
const char *tide_host_readline(const char *prompt);
void tide_host_add_history(const char *line);
void tide_host_set_completions(const char *words);
int tide_host_has_readline(void);
void tide_host_catch_interrupts(int on);
int tide_host_interrupted(void);

/* ---- line editing (exported for the REPL) ------------------------------------------------------ */

/* completion words, one per line, replaced by the REPL before each prompt */
static char *g_words;
static size_t g_words_len;
static int g_history_ready;
static char g_history_path[PATH_MAX];

void tide_host_set_completions(const char *words)
{
    size_t n = words ? strlen(words) : 0;
    char *copy = malloc(n + 1);
    if (!copy) return;                 /* keep the old list; completion is a convenience */
    if (n) memcpy(copy, words, n);
    copy[n] = '\0';
    free(g_words);
    g_words = copy;
    g_words_len = n;
}

int tide_host_has_readline(void)
{
#ifdef TIDE_HAVE_READLINE
    return isatty(0) ? 1 : 0;
#else
    return 0;
#endif
}

#ifdef TIDE_HAVE_READLINE
static char *completion_generator(const char *text, int state)
{
    static size_t pos;
    size_t tlen = strlen(text);
    if (state == 0) pos = 0;
    while (g_words && pos < g_words_len) {
        const char *w = g_words + pos;
        const char *nl = memchr(w, '\n', g_words_len - pos);
        size_t wlen = nl ? (size_t)(nl - w) : g_words_len - pos;
        pos += wlen + 1;
        if (wlen >= tlen && strncmp(w, text, tlen) == 0) {
            char *m = malloc(wlen + 1);
            if (!m) return NULL;
            memcpy(m, w, wlen);
            m[wlen] = '\0';
            return m;
        }
    }
    return NULL;
}

static char **completion(const char *text, int start, int end)
{
    rl_attempted_completion_over = 1;  /* no file-name completion */
    rl_completion_append_character = '\0';
    return rl_completion_matches(text, completion_generator);
}

static void history_init(void)
{
    if (g_history_ready) return;
    g_history_ready = 1;
    const char *home = getenv("HOME");
    if (home && *home) {
        snprintf(g_history_path, sizeof g_history_path, "%s/.tide_history", home);
        read_history(g_history_path);  /* a missing file is fine */
    }
    stifle_history(TIDE_HISTORY_LINES);
    rl_readline_name = "tide";
    /* '.' and ':' are part of the names we complete (tide.F.softmax, x:sum) */
    rl_completer_word_break_characters = " \t\n\"'`@$><=;|&{(,)}[]+-*/%^~#";
    rl_attempted_completion_function = completion;
}
#endif

/* ---- Ctrl-C in the REPL --------------------------------------------------------------------------
   At the prompt it discards the line being typed; while a command runs it raises "interrupted" in
   Lua at the next hook point (interpreted code; engine calls finish first), like the stock lua REPL.
   JIT-compiled loops never reach a hook, so a second Ctrl-C before the first took effect terminates. */
static lua_State *g_L;
static volatile sig_atomic_t g_in_readline, g_interrupted, g_stop_pending;

static void stop_hook(lua_State *L, lua_Debug *ar)
{
    (void)ar;
    g_stop_pending = 0;
    lua_sethook(L, NULL, 0, 0);
    luaL_error(L, "interrupted");
}

static void on_sigint(int sig)
{
    (void)sig;
    g_interrupted = 1;
    if (g_in_readline) {
#ifdef TIDE_HAVE_READLINE
        (void)!write(1, "\n", 1);
        rl_on_new_line();
        rl_replace_line("", 0);
        rl_redisplay();
#endif
        return;
    }
    if (g_stop_pending) {
        signal(SIGINT, SIG_DFL);
        raise(SIGINT);
        return;
    }
    g_stop_pending = 1;
    if (g_L) lua_sethook(g_L, stop_hook, LUA_MASKCALL | LUA_MASKRET | LUA_MASKCOUNT, 1);
}

/* on = 1: Ctrl-C is handled as above (only on a terminal); on = 0: the default (terminate) again */
void tide_host_catch_interrupts(int on)
{
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sigemptyset(&sa.sa_mask);
    sa.sa_handler = (on && isatty(0)) ? on_sigint : SIG_DFL;
    sigaction(SIGINT, &sa, NULL);
#ifdef TIDE_HAVE_READLINE
    rl_catch_signals = 0;   /* our handler does readline's cleanup */
#endif
}

/* 1 when Ctrl-C was pressed since the last call (the REPL then drops a half-typed chunk) */
int tide_host_interrupted(void)
{
    int r = g_interrupted;
    g_interrupted = 0;
    g_stop_pending = 0;
    return r;
}

/* Reads one line without its newline; NULL at end of input. The string stays valid until the next
   call. Uses GNU readline on a terminal, plain stdio otherwise. */
const char *tide_host_readline(const char *prompt)
{
    static char *line;
    free(line);
    line = NULL;
#ifdef TIDE_HAVE_READLINE
    if (isatty(0)) {
        history_init();
        g_in_readline = 1;
        line = readline(prompt ? prompt : "");
        g_in_readline = 0;
        return line;
    }
#endif
    if (prompt) { fputs(prompt, stdout); fflush(stdout); }
    size_t cap = 0;
    ssize_t n = getline(&line, &cap, stdin);
    if (n < 0) { free(line); line = NULL; return NULL; }
    if (n > 0 && line[n - 1] == '\n') line[n - 1] = '\0';
    return line;
}

/* Adds a line to the in-memory history and appends it to ~/.tide_history. */
void tide_host_add_history(const char *line)
{
#ifdef TIDE_HAVE_READLINE
    if (!line || !*line || !isatty(0)) return;
    history_init();
    HIST_ENTRY *last = history_length > 0 ? history_get(history_base + history_length - 1) : NULL;
    if (last && last->line && strcmp(last->line, line) == 0) return;
    add_history(line);
    if (g_history_path[0]) {
        FILE *f = fopen(g_history_path, "a");   /* append_history needs an existing file */
        if (f) fclose(f);
        append_history(1, g_history_path);
        history_truncate_file(g_history_path, TIDE_HISTORY_LINES);
    }
#else
    (void)line;
#endif
}

/* ---- Lua state ---------------------------------------------------------------------------------- */

static int dir_has_tide(const char *dir)
{
    char path[PATH_MAX];
    struct stat st;
    if (snprintf(path, sizeof path, "%s/tide/init.lua", dir) >= (int)sizeof path) return 0;
    return stat(path, &st) == 0;
}

/* The Lua library directory: $TIDE_LUA_DIR, else <exe dir>/../lua, else the source tree's lua/. */
static void find_lua_dir(char *out, size_t n)
{
    const char *env = getenv("TIDE_LUA_DIR");
    if (env && *env) { snprintf(out, n, "%s", env); return; }
    char exe[PATH_MAX];
    ssize_t len = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (len > 0) {
        exe[len] = '\0';
        char *slash = strrchr(exe, '/');
        if (slash) {
            *slash = '\0';
            char cand[PATH_MAX];
            if (snprintf(cand, sizeof cand, "%s/../lua", exe) < (int)sizeof cand && dir_has_tide(cand)) {
                char *real = realpath(cand, NULL);
                snprintf(out, n, "%s", real ? real : cand);
                free(real);
                return;
            }
        }
    }
    snprintf(out, n, "%s/lua", TIDE_SOURCE_DIR);
}

/* message handler: an error is one line (its message, which names the file:line or the option at fault); the
   Lua traceback is added only when TIDE_TRACEBACK=1 (or any value but 0) or `--debug` asked for it. Error objects
   with __tostring (the CLI's usage errors) are shown as they are */
static int g_traceback;

static int on_error(lua_State *L)
{
    if (lua_type(L, 1) == LUA_TSTRING) {
        const char *msg = lua_tostring(L, 1);
        if (!g_traceback) return 1;
        lua_getglobal(L, "debug");
        lua_getfield(L, -1, "traceback");
        lua_pushstring(L, msg);
        lua_pushinteger(L, 2);
        lua_call(L, 2, 1);
        return 1;
    }
    if (luaL_callmeta(L, 1, "__tostring") && lua_type(L, -1) == LUA_TSTRING) return 1;
    lua_pushfstring(L, "(error object is a %s value)", luaL_typename(L, 1));
    return 1;
}

static int run(lua_State *L, int argc, char **argv)
{
    char luadir[PATH_MAX];
    find_lua_dir(luadir, sizeof luadir);

    /* package.path = <luadir>/?.lua;<luadir>/?/init.lua;<previous> */
    lua_getglobal(L, "package");
    lua_getfield(L, -1, "path");
    const char *old = lua_tostring(L, -1);
    lua_pushfstring(L, "%s/?.lua;%s/?/init.lua;%s", luadir, luadir, old ? old : "");
    lua_setfield(L, -3, "path");
    lua_pop(L, 2);

    /* refuse to run without GC64: tensors and recipes may need more than 2 GiB of Lua heap */
    if (luaL_dostring(L, "return require('ffi').abi('gc64')") != 0 || !lua_toboolean(L, -1)) {
        fprintf(stderr, "tide: this LuaJIT was built without GC64 (LUAJIT_ENABLE_GC64); rebuild it with GC64\n");
        return 1;
    }
    lua_pop(L, 1);

    lua_pushcfunction(L, on_error);
    int handler = lua_gettop(L);
    const char *tb = getenv("TIDE_TRACEBACK");
    g_traceback = tb && *tb && strcmp(tb, "0") != 0;
    lua_getglobal(L, "require");
    lua_pushstring(L, "tide.cli");
    if (lua_pcall(L, 1, 1, handler) != 0) {
        fprintf(stderr, "tide: %s\n(lua library directory: %s; set TIDE_LUA_DIR to override)\n",
                lua_tostring(L, -1), luadir);
        return 1;
    }
    lua_getfield(L, -1, "main");
    lua_createtable(L, argc > 1 ? argc - 1 : 0, 1);
    lua_pushstring(L, argv[0]);
    lua_rawseti(L, -2, 0);
    int na = 0;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--debug") == 0) { g_traceback = 1; continue; }   /* the host's flag, not the CLI's */
        lua_pushstring(L, argv[i]);
        lua_rawseti(L, -2, ++na);
    }
    if (lua_pcall(L, 1, 1, handler) != 0) {
        if (tide_dist_active()) fprintf(stderr, "tide [rank %d]: %s\n", tide_dist_rank(), lua_tostring(L, -1));
        else fprintf(stderr, "tide: %s\n", lua_tostring(L, -1));
        return 1;
    }
    int code = lua_isnumber(L, -1) ? (int)lua_tointeger(L, -1) : 0;
    return code;
}

/* The environment the libraries read once, when they are loaded, before main runs; when it needs a change the
   executable sets it and re-executes itself once (TIDE_NO_REEXEC marks the second start; "spin" while the spin
   below is ours).

   OpenMP worker threads that spin between parallel regions take the cores away from everything else
   on the machine (a second process, or OpenBLAS and the main thread under load): libgomp's default (about
   300,000 spins, a few ms) measured 10x slower training steps on 2 cores. Workers that never spin (PASSIVE)
   sleep in the kernel after every parallel region, and waking them costs more than a small op: the
   quickstart model's step at 2,048 tokens took 0.129 s passive and 0.102 s with a short spin (GOMP_SPINCOUNT
   = 3000, tens of microseconds), while two such processes sharing the 2 cores took 0.309 s passive and 0.357 s
   with that spin per 4,096-token step (a spin of 20,000 doubled it). So when the user has chosen neither we set
   PASSIVE with the short spin (libgomp also cuts the spin to 100 when it has more threads than CPUs).

   OpenBLAS falls back to its generic SSE3 kernels on a CPU model newer than the library (tide_blas_core_hint:
   4.6x slower sgemm on an AVX-512 Xeon that Debian 12's OpenBLAS does not know); OPENBLAS_CORETYPE then names
   the kernels that fit the CPU's vector units. The processes tide starts inherit it (a PyTorch baseline on the
   same OpenBLAS gets the same kernels). */
static void ensure_runtime_env(char **argv)
{
    if (getenv("TIDE_NO_REEXEC")) return;
    unsetenv("TIDE_BLAS_FALLBACK");   /* ours alone: set below when this start replaces OpenBLAS's choice */
    int spin = 0, again = 0;
    if (!getenv("OMP_WAIT_POLICY") && !getenv("GOMP_SPINCOUNT")) {
        setenv("OMP_WAIT_POLICY", "PASSIVE", 1);
        setenv("GOMP_SPINCOUNT", "3000", 1);
        spin = again = 1;
    }
    const char *core = tide_blas_core_hint();
    if (core) {
        /* what OpenBLAS chose itself, for `tide info`: the word before " (" in "OpenBLAS <version> <core> (...)" */
        const char *info = tide_blas_info(), *par = strstr(info, " (");
        char detected[64] = "generic";
        if (par) {
            const char *w = par;
            while (w > info && w[-1] != ' ') w--;
            size_t len = (size_t)(par - w);
            if (len > 0 && len < sizeof detected) {
                memcpy(detected, w, len);
                detected[len] = '\0';
            }
        }
        setenv("TIDE_BLAS_FALLBACK", detected, 1);
        setenv("OPENBLAS_CORETYPE", core, 1);
        again = 1;
    }
    if (!again) return;
    setenv("TIDE_NO_REEXEC", spin ? "spin" : "1", 1);
    /* by its real path, so the process keeps its name (ps, top and perf show "tide", not "exe") */
    char self[PATH_MAX];
    ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
    if (n > 0) {
        self[n] = '\0';
        execv(self, argv);
    }
    execv("/proc/self/exe", argv);
    /* exec failed (no /proc): carry on as loaded */
}

/* after the re-exec libgomp has read the spin: the processes tide starts (a PyTorch baseline, a helper) see
   PASSIVE alone, as they did before the spin was added, and choose their own */
static void forget_spin(void)
{
    const char *v = getenv("TIDE_NO_REEXEC");
    if (!v || strcmp(v, "spin") != 0) return;
    unsetenv("GOMP_SPINCOUNT");
    setenv("TIDE_NO_REEXEC", "1", 1);
}

int main(int argc, char **argv)
{
    ensure_runtime_env(argv);
    forget_spin();
    /* past a file-size limit (ulimit -f) write() then fails with EFBIG, reported like a full disk, instead of
       SIGXFSZ killing the process with no message in the middle of a save */
    signal(SIGXFSZ, SIG_IGN);
    lua_State *L = luaL_newstate();
    if (!L) {
        fprintf(stderr, "tide: cannot create the Lua state (out of memory)\n");
        return 1;
    }
    luaL_openlibs(L);
    g_L = L;
    int code = run(L, argc, argv);
    g_L = NULL;
    fflush(stdout);
    fflush(stderr);
    /* a multi-rank job: a rank that failed ends every rank at once (the others would wait on it in their next
       collective); a rank that finished leaves MPI cleanly */
    if (tide_dist_active()) {
        if (code != 0) tide_dist_abort(code);
        tide_dist_finalize();
    }
    lua_close(L);
    return code;
}
