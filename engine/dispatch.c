/*
 * dispatch.c — from a device to its kernel table, and the one guarded path every backend call in engine/
 * takes (TIDE_DISPATCH in internal.h): a NULL entry is an error naming the op, the entry and the device,
 * never a jump through NULL (kernels/backend.h).
 */
#include <stdio.h>
#include <string.h>
#include "internal.h"

#define N_TABLE_DEVICES 9   /* cpu, cuda:0 .. cuda:7 */

static const tide_backend *g_override[N_TABLE_DEVICES];

const char *tide_device_str(int device, char *buf, size_t n)
{
    if (device == TIDE_CPU) snprintf(buf, n, "cpu");
    else snprintf(buf, n, "cuda:%d", device - 1);
    return buf;
}

const tide_backend *tide_backend_for(int device)
{
    if (device >= 0 && device < N_TABLE_DEVICES && g_override[device]) return g_override[device];
    if (device == TIDE_CPU) return &tide_cpu_backend;
#ifdef TIDE_HAVE_CUDA
    if (device >= 1 && device <= 8) {
        if (device > 1) {   /* the CUDA table drives one GPU; multi-GPU comes with per-device tables */
            tide_set_error("device cuda:%d: this build drives cuda:0 only", device - 1);
            return NULL;
        }
        if (device - 1 >= tide_cuda_runtime_device_count()) {
            tide_set_error("device cuda:%d is not available (%s)", device - 1, tide_cuda_runtime_info());
            return NULL;
        }
        return &tide_cuda_backend;
    }
#endif
    if (device >= 1 && device <= 8)
        tide_set_error("device cuda:%d requested but this build has no CUDA backend", device - 1);
    else
        tide_set_error("unknown device %d", device);
    return NULL;
}

int tide_backend_override(int device, const tide_backend *bk)
{
    if (device < 0 || device >= N_TABLE_DEVICES)
        return tide_set_error("backend_override: device %d is outside [0, %d)", device, N_TABLE_DEVICES);
    g_override[device] = bk;
    return 0;
}

int tide_kernel_missing(int device, size_t entry_offset, const char *entry, const char *op)
{
    const tide_backend *bk = tide_backend_for(device);
    if (!bk) {
        char msg[512];
        snprintf(msg, sizeof msg, "%s: %s", op, tide_last_error());
        tide_set_error_str(msg);
        return -1;
    }
    /* every entry the macros name is a function pointer; they all share one representation */
    void (*fn)(void);
    memcpy(&fn, (const char *)bk + entry_offset, sizeof fn);
    if (fn) return 0;
    char d[32];
    return tide_set_error("%s: no %s kernel on the %s backend (device %s)", op, entry, bk->name,
                          tide_device_str(device, d, sizeof d));
}
