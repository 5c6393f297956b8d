/* files.c — careful file handling (files.h): making directories, temporary
 * files renamed into place, and opening only what is a regular file of ours,
 * for the disk caches of code we execute, checkpoints and KILN_DUMP. */
#include "files.h"

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

int files_open_temp(const char *path, char *tmp, size_t n, mode_t mode) {
  static _Atomic uint64_t counter;
  for (int tries = 0; tries < 100; tries++) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    uint64_t r = mix64((uint64_t)ts.tv_nsec ^ ((uint64_t)getpid() << 32) ^ atomic_fetch_add(&counter, 1));
    int k = snprintf(tmp, n, "%s.tmp-%ld-%016llx", path, (long)getpid(), (unsigned long long)r);
    if (k < 0 || (size_t)k >= n) {
      errno = ENAMETOOLONG;
      return -1;
    }
    int fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, mode);
    if (fd >= 0 || errno != EEXIST) return fd;
  }
  return -1;
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
