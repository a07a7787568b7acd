/* error.c — the thread-local error message (DESIGN.md §6). */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include "internal.h"

static _Thread_local char g_error[2048];

const char *tide_last_error(void) { return g_error; }
void tide_clear_error(void) { g_error[0] = 0; }

void tide_set_error_str(const char *msg)
{
    snprintf(g_error, sizeof g_error, "%s", msg ? msg : "");
}

int tide_set_error(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(g_error, sizeof g_error, fmt, ap);
    va_end(ap);
    return -1;
}
