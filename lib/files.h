/* files.h — careful file handling shared by the writers of files that must
 * not be confused or hijacked: the disk caches of compiled code
 * (backends/cpu/cache.c, which the PTX cache also goes through),
 * checkpoints (checkpoint.c), .npy files (npy.c), TensorBoard summaries
 * (summary.c) and KILN_DUMP (jit/loc.c). Internal. */
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

/* Creates a new directory "<path>.<tag>-<pid>-<random>" beside path with
 * mode (less the umask), its name into tmp (n bytes): a save writes there
 * and renames it into place. 0, or -1 with errno set. */
int files_make_temp_dir(const char *path, const char *tag, char *tmp, size_t n, mode_t mode);
/* Writes all n bytes to fd (retrying short writes). 0, or -1 with errno set. */
int files_write_all(int fd, const void *p, size_t n);
/* Reads exactly n bytes from fd (retrying short reads). 0, or -1 with errno
 * set (EIO when the file ends first). */
int files_read_all(int fd, void *p, size_t n);
/* Replaces path atomically with what write(fd, ctx) writes to a temporary
 * file beside it (files_open_temp, mode), synced and renamed into place.
 * write returns 0, or -1 with errno set. 0, or -1 with errno set, path
 * untouched and no temporary left; *stage says which step failed ("create",
 * "write"). */
int files_replace(const char *path, mode_t mode, int (*write)(int fd, void *ctx), void *ctx,
                  const char **stage);
/* What lstat says path is, when it is something a save must not replace:
 * a save renames a new file over path, which would swap a device, a FIFO or
 * a link (run as root, /dev/null) for a regular file. "a directory", "a
 * symbolic link", ...; NULL when path is a regular file or absent. */
const char *files_not_regular(const char *path);
/* Creates path (which must not exist; never through a link), writes p and
 * syncs it. 0, or -1 with errno set (and no file left). */
int files_write_new(const char *path, const void *p, size_t n, mode_t mode);
/* The bytes of path, a regular file of at most max_bytes (as
 * files_open_regular, any owner), malloc'd with a NUL after them, the count
 * in *size; NULL with errno set and *why saying what is wrong. */
char *files_read_regular(const char *path, int64_t max_bytes, size_t *size, const char **why);
/* On-disk formats are little-endian: true on a little-endian host. */
int files_host_little_endian(void);
/* Reverses each elem-byte element of p (bytes long) in place. */
void files_swap_bytes(void *p, size_t bytes, size_t elem);
/* Writes bytes of elem-byte elements to fd little-endian, whatever the
 * host (files_write_all's result). */
int files_write_le(int fd, const void *data, size_t bytes, size_t elem);
/* "dir/name", malloc'd; NULL on out of memory. */
char *files_join(const char *dir, const char *name);
/* Removes the files of directory path (not directories) and then path. 0 / -1. */
int files_remove_dir(const char *path);

/* Opens path for reading only if it is a regular file (not a link: O_NOFOLLOW;
 * never blocking on a FIFO or device: O_NONBLOCK, then fstat) owned by this
 * user (when own) and of at most max_bytes. The descriptor with its size in
 * *size, or -1 with errno set (ENOENT: there is none) and *why saying what
 * was refused ("a symbolic link", "not a regular file", ...). */
int files_open_regular(const char *path, int64_t max_bytes, int own, int64_t *size, const char **why);

#endif
