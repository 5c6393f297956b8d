/* files.c — careful file handling (files.h): making directories, temporary
 * files renamed into place, and opening only what is a regular file of ours,
 * for the disk caches of code we execute, checkpoints and KILN_DUMP. */
#include "files.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

int files_mkdirs(const char *path, mode_t mode) {
  size_t n = strlen(path);
  char *p = malloc(n + 1);
  if (!p) return -1;
  memcpy(p, path, n + 1);
  int rc = 0;
  for (size_t i = 1; i <= n && !rc; i++) {
    if (p[i] != '/' && p[i] != 0) continue;
    if (p[i - 1] == '/') continue; /* "a//b" */
    char c = p[i];
    p[i] = 0;
    if (mkdir(p, mode) && errno != EEXIST) rc = -1;
    p[i] = c;
  }
  free(p);
  struct stat st;
  if (rc) return -1;
  if (stat(path, &st)) return -1;
  if (!S_ISDIR(st.st_mode)) {
    errno = ENOTDIR;
    return -1;
  }
  return 0;
}

static uint64_t mix64(uint64_t k) {
  k ^= k >> 33;
  k *= 0xff51afd7ed558ccdULL;
  k ^= k >> 33;
  k *= 0xc4ceb9fe1a85ec53ULL;
  k ^= k >> 33;
  return k;
}

/* "<path>.<tag>-<pid>-<random>" into tmp; -1 (ENAMETOOLONG) if it does not fit */
static int temp_name(const char *path, const char *tag, char *tmp, size_t n) {
  static _Atomic uint64_t counter;
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  uint64_t r = mix64((uint64_t)ts.tv_nsec ^ ((uint64_t)getpid() << 32) ^ atomic_fetch_add(&counter, 1));
  int k = snprintf(tmp, n, "%s.%s-%ld-%016llx", path, tag, (long)getpid(), (unsigned long long)r);
  if (k < 0 || (size_t)k >= n) {
    errno = ENAMETOOLONG;
    return -1;
  }
  return 0;
}

int files_open_temp(const char *path, char *tmp, size_t n, mode_t mode) {
  for (int tries = 0; tries < 100; tries++) {
    if (temp_name(path, "tmp", tmp, n)) return -1;
    int fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, mode);
    if (fd >= 0 || errno != EEXIST) return fd;
  }
  return -1;
}

int files_make_temp_dir(const char *path, const char *tag, char *tmp, size_t n, mode_t mode) {
  for (int tries = 0; tries < 100; tries++) {
    if (temp_name(path, tag, tmp, n)) return -1;
    if (!mkdir(tmp, mode)) return 0;
    if (errno != EEXIST) return -1;
  }
  return -1;
}

int files_write_all(int fd, const void *p, size_t n) {
  const uint8_t *q = p;
  while (n) {
    ssize_t w = write(fd, q, n > ((size_t)1 << 30) ? ((size_t)1 << 30) : n);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return -1;
    q += w;
    n -= (size_t)w;
  }
  return 0;
}

int files_read_all(int fd, void *p, size_t n) {
  uint8_t *q = p;
  while (n) {
    ssize_t r = read(fd, q, n > ((size_t)1 << 30) ? ((size_t)1 << 30) : n);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) return -1;
    if (r == 0) {
      errno = EIO;
      return -1;
    }
    q += r;
    n -= (size_t)r;
  }
  return 0;
}

int files_replace(const char *path, mode_t mode, int (*write)(int fd, void *ctx), void *ctx,
                  const char **stage) {
  *stage = "create";
  size_t tmp_n = strlen(path) + 64;
  char *tmp = malloc(tmp_n);
  if (!tmp) {
    errno = ENOMEM;
    return -1;
  }
  int fd = files_open_temp(path, tmp, tmp_n, mode);
  if (fd < 0) {
    int e = errno;
    free(tmp);
    errno = e;
    return -1;
  }
  *stage = "write";
  int ok = write(fd, ctx) == 0 && fsync(fd) == 0;
  int e = errno;
  if (close(fd) && ok) ok = 0, e = errno;
  if (ok && rename(tmp, path)) ok = 0, e = errno;
  if (!ok) unlink(tmp);
  free(tmp);
  errno = e;
  return ok ? 0 : -1;
}

const char *files_not_regular(const char *path) {
  struct stat st;
  if (lstat(path, &st)) return NULL; /* absent (or unreachable: creating the file says why) */
  if (S_ISREG(st.st_mode)) return NULL;
  return S_ISDIR(st.st_mode)    ? "a directory"
         : S_ISLNK(st.st_mode)  ? "a symbolic link"
         : S_ISFIFO(st.st_mode) ? "a FIFO"
         : S_ISCHR(st.st_mode)  ? "a character device"
         : S_ISBLK(st.st_mode)  ? "a block device"
         : S_ISSOCK(st.st_mode) ? "a socket"
                                : "not a file";
}

int files_host_little_endian(void) {
  const uint16_t one = 1;
  uint8_t b;
  memcpy(&b, &one, 1);
  return b == 1;
}

void files_swap_bytes(void *p, size_t bytes, size_t elem) {
  uint8_t *q = p;
  for (size_t i = 0; elem > 1 && i + elem <= bytes; i += elem)
    for (size_t a = i, b = i + elem - 1; a < b; a++, b--) {
      uint8_t t = q[a];
      q[a] = q[b];
      q[b] = t;
    }
}

int files_write_le(int fd, const void *data, size_t bytes, size_t elem) {
  if (files_host_little_endian() || elem == 1) return files_write_all(fd, data, bytes);
  uint8_t chunk[1 << 16];
  const uint8_t *d = data;
  for (size_t off = 0; off < bytes; off += sizeof chunk) {
    size_t k = bytes - off < sizeof chunk ? bytes - off : sizeof chunk;
    memcpy(chunk, d + off, k);
    files_swap_bytes(chunk, k, elem);
    if (files_write_all(fd, chunk, k)) return -1;
  }
  return 0;
}

int files_write_new(const char *path, const void *p, size_t n, mode_t mode) {
  int fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, mode);
  if (fd < 0) return -1;
  int ok = !files_write_all(fd, p, n) && !fsync(fd);
  int e = errno;
  if (close(fd) && ok) ok = 0, e = errno;
  if (!ok) {
    unlink(path);
    errno = e;
  }
  return ok ? 0 : -1;
}

char *files_read_regular(const char *path, int64_t max_bytes, size_t *size, const char **why) {
  int64_t n;
  int fd = files_open_regular(path, max_bytes, 0, &n, why);
  if (fd < 0) return NULL;
  char *buf = malloc((size_t)n + 1);
  size_t got = 0;
  while (buf && got < (size_t)n) {
    ssize_t r = read(fd, buf + got, (size_t)n - got);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) break;
    got += (size_t)r;
  }
  int e = buf ? EIO : ENOMEM;
  close(fd);
  if (!buf || got != (size_t)n) {
    free(buf);
    *why = buf ? "cannot be read" : "too large to hold in memory";
    errno = e;
    return NULL;
  }
  buf[n] = '\0';
  *size = (size_t)n;
  return buf;
}

char *files_join(const char *dir, const char *name) {
  size_t n = strlen(dir) + strlen(name) + 2;
  char *p = malloc(n);
  if (p) snprintf(p, n, "%s/%s", dir, name);
  return p;
}

int files_remove_dir(const char *path) {
  DIR *d = opendir(path);
  if (!d) return -1;
  struct dirent *e;
  int rc = 0;
  while ((e = readdir(d))) {
    if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
    char *p = files_join(path, e->d_name);
    if (!p || unlink(p)) rc = -1;
    free(p);
  }
  closedir(d);
  if (rmdir(path)) rc = -1;
  return rc;
}

int files_open_regular(const char *path, int64_t max_bytes, int own, int64_t *size, const char **why) {
  *why = NULL;
  *size = 0;
  int fd = open(path, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) {
    int e = errno;
    *why = e == ELOOP ? "a symbolic link" : e == ENOENT ? "missing" : "cannot be opened";
    errno = e;
    return -1;
  }
  struct stat st;
  int e = 0;
  if (fstat(fd, &st))
    e = errno, *why = "cannot be read";
  else if (!S_ISREG(st.st_mode))
    e = EINVAL, *why = "not a regular file";
  else if (own && st.st_uid != geteuid())
    e = EPERM, *why = "owned by another user";
  else if (st.st_size < 0 || (int64_t)st.st_size > max_bytes)
    e = EFBIG, *why = "too large";
  if (e) {
    close(fd);
    errno = e;
    return -1;
  }
  *size = (int64_t)st.st_size;
  return fd;
}
