/* files.h — careful file handling shared by the writers of files that must
 * not be confused or hijacked: the disk caches of compiled code
 * (backends/cpu/cache.c, which the PTX cache also goes through),
 * checkpoints (checkpoint.c) and KILN_DUMP (jit/loc.c). Internal. */
#ifndef KILN_FILES_H
#define KILN_FILES_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

/* mkdir -p: creates path and its missing parents with mode (less the
 * umask). 0 when path is then a directory; -1 with errno set otherwise
 * (ENOTDIR when something else is in the way). */
int files_mkdirs(const char *path, mode_t mode);

/* Creates a new, empty file next to path ("<path>.tmp-<pid>-<random>",
 * O_EXCL|O_NOFOLLOW, so never an existing file or a link) for writing with
 * mode, its name into tmp (n bytes); rename(tmp, path) then replaces path
 * atomically. The descriptor, or -1 with errno set. */
int files_open_temp(const char *path, char *tmp, size_t n, mode_t mode);

/* Opens path for reading only if it is a regular file (not a link: O_NOFOLLOW;
 * never blocking on a FIFO or device: O_NONBLOCK, then fstat) owned by this
 * user (when own) and of at most max_bytes. The descriptor with its size in
 * *size, or -1 with errno set (ENOENT: there is none) and *why saying what
 * was refused ("a symbolic link", "not a regular file", ...). */
int files_open_regular(const char *path, int64_t max_bytes, int own, int64_t *size, const char **why);

#endif
