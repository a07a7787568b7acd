/*
 * file.c — small file-system helpers: atomic writes (temp file, fsync, rename, fsync of the directory),
 * directories, whole-file reads, and text files as byte tensors (DESIGN.md §6, formats.md §6).
 * Every reader of the engine opens its file through tide_open_regular: regular files only, never blocking.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>
#include "internal.h"

void tide_free(void *p) { free(p); }

static int check_path(const char *path, const char *what)
{
    if (!path || !path[0]) return tide_set_error("%s: the path is %s", what, path ? "empty" : "NULL");
    return 0;
}

/* the directory part of path ("." when there is none); malloc'd */
static char *dir_of(const char *path)
{
    const char *slash = strrchr(path, '/');
    if (!slash) return strdup(".");
    if (slash == path) return strdup("/");
    size_t n = (size_t)(slash - path);
    char *d = malloc(n + 1);
    if (!d) return NULL;
    memcpy(d, path, n);
    d[n] = 0;
    return d;
}

int tide_fsync_dir(const char *dir)
{
    if (check_path(dir, "fsync_dir")) return -1;
    int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) return tide_set_error("cannot open directory '%s': %s", dir, strerror(errno));
    int rc = 0;
    if (fsync(fd) != 0 && errno != EINVAL && errno != EROFS)   /* some file systems cannot sync dirs */
        rc = tide_set_error("cannot fsync directory '%s': %s", dir, strerror(errno));
    close(fd);
    return rc;
}

static int fsync_dir_of(const char *path)
{
    char *d = dir_of(path);
    if (!d) return tide_set_error("fsync of the directory of '%s': out of memory", path);
    int rc = tide_fsync_dir(d);
    free(d);
    return rc;
}

/* "<what> '<path>' is a FIFO (named pipe), not a regular file" */
static int not_regular(const char *path, const char *what, mode_t m)
{
    const char *kind = S_ISDIR(m) ? "a directory" : S_ISFIFO(m) ? "a FIFO (named pipe)"
                     : S_ISCHR(m) ? "a character device" : S_ISBLK(m) ? "a block device"
                     : S_ISSOCK(m) ? "a socket" : "something else";
    return tide_set_error("%s '%s' is %s, not a regular file", what, path, kind);
}

/* ---- atomic files ------------------------------------------------------------------------------ */
struct tide_atomic_file {
    int fd;
    char *path;                   /* final name */
    char *tmp;                    /* path + ".tmp" */
};

tide_atomic_file *tide_atomic_open(const char *path)
{
    if (check_path(path, "atomic write")) return NULL;
    tide_atomic_file *f = calloc(1, sizeof *f);
    size_t n = strlen(path);
    if (f) {
        f->path = strdup(path);
        f->tmp = malloc(n + 5);
    }
    if (!f || !f->path || !f->tmp) {
        if (f) { free(f->path); free(f->tmp); free(f); }
        tide_set_error("cannot write '%s': out of memory", path);
        return NULL;
    }
    memcpy(f->tmp, path, n);
    memcpy(f->tmp + n, ".tmp", 5);
    /* O_TRUNC: a .tmp left behind by a crashed writer is simply overwritten. Anything else of that name (a FIFO
       would block the open until a reader came) is refused; O_NONBLOCK covers one made meanwhile. */
    struct stat st;
    int bad = lstat(f->tmp, &st) == 0 && !S_ISREG(st.st_mode);
    if (bad) not_regular(f->tmp, "temporary file", st.st_mode);
    f->fd = bad ? -1 : open(f->tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NONBLOCK, 0644);
    if (f->fd < 0) {
        if (!bad) tide_set_error("cannot create '%s': %s", f->tmp, strerror(errno));
        free(f->path); free(f->tmp); free(f);
        return NULL;
    }
    int fl = fcntl(f->fd, F_GETFL);
    if (fl >= 0) fcntl(f->fd, F_SETFL, fl & ~O_NONBLOCK);
    return f;
}

static void atomic_free(tide_atomic_file *f)
{
    free(f->path);
    free(f->tmp);
    free(f);
}

void tide_atomic_abort(tide_atomic_file *f)
{
    if (!f) return;
    if (f->fd >= 0) close(f->fd);
    unlink(f->tmp);
    atomic_free(f);
}

int tide_atomic_write(tide_atomic_file *f, const void *bytes, size_t n)
{
    if (!f) return tide_set_error("atomic write: the file handle is NULL");
    if (f->fd < 0) return tide_set_error("cannot write '%s': an earlier write failed", f->path);
    if (n && !bytes) return tide_set_error("cannot write '%s': %zu bytes from a NULL pointer", f->path, n);
    const char *p = bytes;
    while (n > 0) {
        size_t chunk = n > ((size_t)1 << 30) ? ((size_t)1 << 30) : n;
        ssize_t w = write(f->fd, p, chunk);
        if (w < 0) {
            if (errno == EINTR) continue;
            int e = errno;
            close(f->fd);
            f->fd = -1;
            return tide_set_error("cannot write '%s': %s", f->tmp, strerror(e));
        }
        p += w;
        n -= (size_t)w;
    }
    return 0;
}

int tide_atomic_commit(tide_atomic_file *f)
{
    if (!f) return tide_set_error("atomic write: the file handle is NULL");
    int rc = 0;
    if (f->fd < 0) {
        rc = tide_set_error("cannot write '%s': an earlier write failed", f->path);
    } else if (fsync(f->fd) != 0) {
        rc = tide_set_error("cannot fsync '%s': %s", f->tmp, strerror(errno));
    }
    if (f->fd >= 0 && close(f->fd) != 0 && rc == 0)
        rc = tide_set_error("cannot close '%s': %s", f->tmp, strerror(errno));
    f->fd = -1;
    if (rc == 0 && rename(f->tmp, f->path) != 0)
        rc = tide_set_error("cannot rename '%s' to '%s': %s", f->tmp, f->path, strerror(errno));
    if (rc != 0) {
        unlink(f->tmp);
        atomic_free(f);
        return rc;
    }
    rc = fsync_dir_of(f->path);
    atomic_free(f);
    return rc;
}

int tide_file_write_atomic(const char *path, const void *bytes, size_t n)
{
    tide_atomic_file *f = tide_atomic_open(path);
    if (!f) return -1;
    if (tide_atomic_write(f, bytes, n) != 0) {
        tide_atomic_abort(f);
        return -1;
    }
    return tide_atomic_commit(f);
}

int tide_file_write_text_atomic(const char *path, const char *text)
{
    if (!text) return tide_set_error("write_text_atomic '%s': the text is NULL", path ? path : "(null)");
    return tide_file_write_atomic(path, text, strlen(text));
}

int tide_rename_atomic(const char *from, const char *to)
{
    if (check_path(from, "rename") || check_path(to, "rename")) return -1;
    if (rename(from, to) != 0)
        return tide_set_error("cannot rename '%s' to '%s': %s", from, to, strerror(errno));
    char *a = dir_of(from), *b = dir_of(to);
    int rc;
    if (!a || !b) rc = tide_set_error("rename '%s': out of memory", from);
    else rc = (tide_fsync_dir(b) != 0 || (strcmp(a, b) != 0 && tide_fsync_dir(a) != 0)) ? -1 : 0;
    free(a);
    free(b);
    return rc;
}

/* ---- directories and paths ----------------------------------------------------------------------- */
int tide_path_exists(const char *path)
{
    struct stat st;
    return path && path[0] && lstat(path, &st) == 0;
}

int tide_is_dir(const char *path)
{
    struct stat st;
    return path && path[0] && stat(path, &st) == 0 && S_ISDIR(st.st_mode);
}

int64_t tide_file_size(const char *path)
{
    if (check_path(path, "file_size")) return -1;
    struct stat st;
    if (stat(path, &st) != 0) {
        tide_set_error("cannot stat '%s': %s", path, strerror(errno));
        return -1;
    }
    return (int64_t)st.st_size;
}

int tide_mkdir_p(const char *path)
{
    if (check_path(path, "mkdir_p")) return -1;
    char *p = strdup(path);
    if (!p) return tide_set_error("mkdir_p '%s': out of memory", path);
    size_t n = strlen(p);
    while (n > 1 && p[n - 1] == '/') p[--n] = 0;
    int rc = 0;
    /* create each prefix ending before a '/', then the whole path */
    for (char *s = p + 1; ; s++) {
        if (*s != '/' && *s != 0) continue;
        char saved = *s;
        *s = 0;
        if (mkdir(p, 0755) != 0 && errno != EEXIST) {
            rc = tide_set_error("cannot create directory '%s': %s", p, strerror(errno));
            break;
        }
        *s = saved;
        if (saved == 0) break;
    }
    if (rc == 0 && !tide_is_dir(p))
        rc = tide_set_error("cannot create directory '%s': a file of that name exists", p);
    free(p);
    return rc;
}

static int remove_at(int parent, const char *name, const char *shown, int depth)
{
    struct stat st;
    if (fstatat(parent, name, &st, AT_SYMLINK_NOFOLLOW) != 0) {
        if (errno == ENOENT) return 0;
        return tide_set_error("cannot stat '%s': %s", shown, strerror(errno));
    }
    if (!S_ISDIR(st.st_mode)) {
        if (unlinkat(parent, name, 0) != 0 && errno != ENOENT)
            return tide_set_error("cannot remove '%s': %s", shown, strerror(errno));
        return 0;
    }
    if (depth > 256) return tide_set_error("cannot remove '%s': directories nest too deeply", shown);
    int fd = openat(parent, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0) return tide_set_error("cannot open directory '%s': %s", shown, strerror(errno));
    DIR *d = fdopendir(fd);
    if (!d) {
        close(fd);
        return tide_set_error("cannot read directory '%s': %s", shown, strerror(errno));
    }
    int rc = 0;
    struct dirent *e;
    while (rc == 0 && (e = readdir(d)) != NULL) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
        rc = remove_at(dirfd(d), e->d_name, shown, depth + 1);
    }
    closedir(d);
    if (rc == 0 && unlinkat(parent, name, AT_REMOVEDIR) != 0 && errno != ENOENT)
        rc = tide_set_error("cannot remove directory '%s': %s", shown, strerror(errno));
    return rc;
}

int tide_remove_tree(const char *path)
{
    if (check_path(path, "remove_tree")) return -1;
    return remove_at(AT_FDCWD, path, path, 0);
}

static int cmp_str(const void *a, const void *b)
{
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

char *tide_list_dir(const char *path, size_t *n)
{
    if (check_path(path, "list_dir")) return NULL;
    DIR *d = opendir(path);
    if (!d) {
        tide_set_error("cannot open directory '%s': %s", path, strerror(errno));
        return NULL;
    }
    char **names = NULL;
    size_t count = 0, cap = 0, total = 0;
    struct dirent *e;
    int oom = 0;
    while (!oom && (e = readdir(d)) != NULL) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
        if (count == cap) {
            size_t nc = cap ? cap * 2 : 64;
            char **nn = realloc(names, nc * sizeof *nn);
            if (!nn) { oom = 1; break; }
            names = nn;
            cap = nc;
        }
        if (!(names[count] = strdup(e->d_name))) { oom = 1; break; }
        total += strlen(e->d_name) + 1;
        count++;
    }
    closedir(d);
    char *out = oom ? NULL : malloc(total + 1);
    if (out) {
        if (count) qsort(names, count, sizeof *names, cmp_str);
        size_t at = 0;
        for (size_t i = 0; i < count; i++) {
            size_t k = strlen(names[i]) + 1;
            memcpy(out + at, names[i], k);
            at += k;
        }
        out[total] = 0;
        if (n) *n = total;
    } else {
        tide_set_error("list_dir '%s': out of memory", path);
    }
    for (size_t i = 0; i < count; i++) free(names[i]);
    free(names);
    return out;
}

/* ---- reading ------------------------------------------------------------------------------------- */
/* stat before open: open() of a FIFO blocks until a writer appears, and a device may act on being opened.
   O_NONBLOCK covers a FIFO swapped in between the two calls; it means nothing for a regular file. */
int tide_open_regular(const char *path, const char *what, int64_t *size)
{
    if (!what) what = "file";
    if (check_path(path, what)) return -1;
    struct stat st;
    if (stat(path, &st) != 0) return tide_set_error("cannot open '%s': %s", path, strerror(errno));
    if (!S_ISREG(st.st_mode)) return not_regular(path, what, st.st_mode);
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) return tide_set_error("cannot open '%s': %s", path, strerror(errno));
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        int rc = S_ISREG(st.st_mode) ? tide_set_error("cannot stat '%s': %s", path, strerror(errno))
                                     : not_regular(path, what, st.st_mode);
        close(fd);
        return rc;
    }
    int fl = fcntl(fd, F_GETFL);
    if (fl >= 0) fcntl(fd, F_SETFL, fl & ~O_NONBLOCK);
    if (size) *size = (int64_t)st.st_size;
    return fd;
}

char *tide_read_file(const char *path, size_t *n, size_t max_bytes)
{
    if (check_path(path, "read_file")) return NULL;
    int64_t size = 0;
    int fd = tide_open_regular(path, "file", &size);
    if (fd < 0) return NULL;
    /* the size a regular file reports; files of /proc report 0 and are read until EOF */
    size_t cap = (size_t)size + 1;
    if (max_bytes && (size_t)size > max_bytes) {
        tide_set_error("file '%s' is %lld bytes, over the limit of %zu bytes", path, (long long)size, max_bytes);
        close(fd);
        return NULL;
    }
    char *buf = malloc(cap);
    size_t len = 0;
    while (buf) {
        if (len + 1 >= cap) {
            /* full: probe one byte for EOF before growing (regular files usually end here) */
            char probe;
            ssize_t r = read(fd, &probe, 1);
            if (r < 0 && errno == EINTR) continue;
            if (r < 0) {
                tide_set_error("cannot read '%s': %s", path, strerror(errno));
                free(buf);
                close(fd);
                return NULL;
            }
            if (r == 0) break;
            if (max_bytes && len + 1 > max_bytes) { len++; break; }
            size_t nc = cap * 2;
            char *nb = realloc(buf, nc);
            if (!nb) { free(buf); buf = NULL; break; }
            buf = nb;
            cap = nc;
            buf[len++] = probe;
            continue;
        }
        ssize_t r = read(fd, buf + len, cap - 1 - len);
        if (r < 0) {
            if (errno == EINTR) continue;
            tide_set_error("cannot read '%s': %s", path, strerror(errno));
            free(buf);
            close(fd);
            return NULL;
        }
        if (r == 0) break;
        len += (size_t)r;
    }
    close(fd);
    if (!buf) {
        tide_set_error("cannot read '%s': out of memory", path);
        return NULL;
    }
    if (max_bytes && len > max_bytes) {
        tide_set_error("file '%s' is over the limit of %zu bytes", path, max_bytes);
        free(buf);
        return NULL;
    }
    buf[len] = 0;
    if (n) *n = len;
    return buf;
}

tide_tensor *tide_text_read_bytes(const char *path)
{
    size_t n = 0;
    char *buf = tide_read_file(path, &n, 0);
    if (!buf) return NULL;
    if (n == 0) {
        free(buf);
        tide_set_error("text file '%s' is empty", path);
        return NULL;
    }
    int64_t shape[1] = { (int64_t)n };
    tide_tensor *t = tide_from_bytes(TIDE_U8, 1, shape, TIDE_CPU, buf, n);
    free(buf);
    return t;
}
