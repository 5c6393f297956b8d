/* cache.c — the on-disk cache of compiled CPU programs: object code (and the
 * optimized module's bitcode, for the text stages) keyed by a 128-bit hash of
 * the IR with its callees, the LLVM version, the host CPU and features, the
 * options and the build of the library itself, so that a second process
 * skips LLVM. An entry is one file, written to a temporary name and renamed
 * into place (readers never see half an entry); a reader checks its magic,
 * version, key and checksum and treats anything else as a miss. Nothing here
 * fails a compile: an unreadable, corrupt or unwritable cache is no cache.
 * The entries are code this process executes, so the directory must be this
 * user's and writable by no one else (else no cache, said once on stderr),
 * and an entry is read only if it is a regular file of ours of a sane size
 * (never following a link or blocking on a FIFO: lib/files.c).
 * KILN_CACHE_MAX_MB (default 1024) bounds the directory: stores count the
 * bytes they add to a total taken by one scan, and trim the least recently
 * used entries (down to 90%) only when it passes the bound, or after a tenth
 * of it was written (other processes store too), so a store costs O(1)
 * amortized rather than a scan of the directory. */
#include <dirent.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <link.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#undef DT_NUM /* elf.h's (link.h); ops.h has its own */

#include "cpu/cpu.h"
#include "files.h"

/* ---- hashing: MurmurHash3 x64-128 (Austin Appleby, public domain) ---- */

static uint64_t rotl64(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

static uint64_t fmix64(uint64_t k) {
  k ^= k >> 33;
  k *= 0xff51afd7ed558ccdULL;
  k ^= k >> 33;
  k *= 0xc4ceb9fe1a85ec53ULL;
  k ^= k >> 33;
  return k;
}

void cpu_hash128(const void *data, size_t len, uint8_t out[16]) {
  const unsigned char *p = data;
  const uint64_t c1 = 0x87c37b91114253d5ULL, c2 = 0x4cf5ad432745937fULL;
  uint64_t h1 = 0x6b696c6e, h2 = 0x6b696c6e; /* the seed: "kiln" */
  size_t nblocks = len / 16;
  for (size_t i = 0; i < nblocks; i++) {
    uint64_t k1, k2;
    memcpy(&k1, p + 16 * i, 8);
    memcpy(&k2, p + 16 * i + 8, 8);
    k1 *= c1, k1 = rotl64(k1, 31), k1 *= c2, h1 ^= k1;
    h1 = rotl64(h1, 27), h1 += h2, h1 = h1 * 5 + 0x52dce729;
    k2 *= c2, k2 = rotl64(k2, 33), k2 *= c1, h2 ^= k2;
    h2 = rotl64(h2, 31), h2 += h1, h2 = h2 * 5 + 0x38495ab5;
  }
  const unsigned char *tail = p + 16 * nblocks;
  size_t rest = len & 15;
  uint64_t k1 = 0, k2 = 0; /* the tail's bytes, little-endian */
  for (size_t i = rest; i > 8; i--) k2 = (k2 << 8) | tail[i - 1];
  for (size_t i = rest < 8 ? rest : 8; i > 0; i--) k1 = (k1 << 8) | tail[i - 1];
  if (rest > 8) k2 *= c2, k2 = rotl64(k2, 33), k2 *= c1, h2 ^= k2;
  if (rest > 0) k1 *= c1, k1 = rotl64(k1, 31), k1 *= c2, h1 ^= k1;
  h1 ^= (uint64_t)len, h2 ^= (uint64_t)len;
  h1 += h2, h2 += h1;
  h1 = fmix64(h1), h2 = fmix64(h2);
  h1 += h2, h2 += h1;
  memcpy(out, &h1, 8);
  memcpy(out + 8, &h2, 8);
}

/* ---- the build of this library ----
 * Generated code calls the runtime by helper index and ABI, so an entry
 * written by another build of Kiln is stale even for the same IR and LLVM:
 * the key holds the library's GNU build id (or, without one, its file's
 * size and modification time). */

typedef struct {
  uintptr_t addr;
  char id[80];
} build_query;

static int find_build_id(struct dl_phdr_info *info, size_t size, void *data) {
  build_query *q = data;
  (void)size;
  bool mine = false;
  for (int i = 0; i < info->dlpi_phnum && !mine; i++) {
    const ElfW(Phdr) *ph = &info->dlpi_phdr[i];
    uintptr_t lo = info->dlpi_addr + ph->p_vaddr;
    mine = ph->p_type == PT_LOAD && q->addr >= lo && q->addr < lo + ph->p_memsz;
  }
  if (!mine) return 0;
  for (int i = 0; i < info->dlpi_phnum; i++) {
    const ElfW(Phdr) *ph = &info->dlpi_phdr[i];
    if (ph->p_type != PT_NOTE) continue;
    const unsigned char *n = (const unsigned char *)(info->dlpi_addr + ph->p_vaddr), *end = n + ph->p_memsz;
    while (n + sizeof(ElfW(Nhdr)) <= end) {
      ElfW(Nhdr) h;
      memcpy(&h, n, sizeof h);
      const unsigned char *name = n + sizeof h, *desc = name + ((h.n_namesz + 3) & ~3u);
      if (desc + h.n_descsz > end) break;
      if (h.n_type == NT_GNU_BUILD_ID && h.n_namesz == 4 && !memcmp(name, "GNU", 4) && h.n_descsz > 0) {
        size_t k = 0;
        for (unsigned j = 0; j < h.n_descsz && k + 3 < sizeof q->id; j++)
          k += (size_t)snprintf(q->id + k, sizeof q->id - k, "%02x", desc[j]);
        return 1;
      }
      n = desc + ((h.n_descsz + 3) & ~3u);
    }
  }
  return 1;
}

static char build_id[128];
static pthread_once_t build_once = PTHREAD_ONCE_INIT;

static void build_init(void) {
  build_query q = {(uintptr_t)cpu_compile_with, ""};
  dl_iterate_phdr(find_build_id, &q);
  if (q.id[0]) {
    snprintf(build_id, sizeof build_id, "build-id %s", q.id);
    return;
  }
  Dl_info di;
  struct stat st;
  if (dladdr((void *)(uintptr_t)cpu_compile_with, &di) && di.dli_fname && !stat(di.dli_fname, &st))
    snprintf(build_id, sizeof build_id, "file %lld %lld.%09ld %llu", (long long)st.st_size,
             (long long)st.st_mtim.tv_sec, (long)st.st_mtim.tv_nsec, (unsigned long long)st.st_ino);
  else
    snprintf(build_id, sizeof build_id, "unknown build %s %s", __DATE__, __TIME__);
}

const char *cpu_cache_build_id(void) {
  pthread_once(&build_once, build_init);
  return build_id;
}

/* ---- where ---- */

bool cpu_cache_log(void) {
  const char *env = getenv("KILN_LOG");
  return env && strstr(env, "cache");
}

/* The directories refused (or found unusable) so far: each is said once. */
static pthread_mutex_t said_lock = PTHREAD_MUTEX_INITIALIZER;
static uint64_t said[32];
static int n_said;

static bool first_time(const char *what) {
  uint8_t h[16];
  uint64_t k;
  cpu_hash128(what, strlen(what), h);
  memcpy(&k, h, 8);
  pthread_mutex_lock(&said_lock);
  bool first = true;
  for (int i = 0; i < n_said && i < 32 && first; i++) first = said[i] != k;
  if (first) said[n_said++ % 32] = k;
  pthread_mutex_unlock(&said_lock);
  return first;
}

/* Whether dir (created, private, if missing) may hold code we execute: a
 * directory owned by this user that no one else may write. */
static bool dir_usable(const char *dir) {
  struct stat st;
  const char *why = NULL;
  char buf[64];
  if (stat(dir, &st) && errno == ENOENT && files_mkdirs(dir, 0700)) {
    /* cannot be made (read-only, under a file): no cache, as before */
    if (cpu_cache_log() && first_time(dir))
      fprintf(stderr, "kiln: cache: %s: cannot create the directory (%s); not caching\n", dir, strerror(errno));
    return false;
  }
  if (stat(dir, &st))
    why = strerror(errno);
  else if (!S_ISDIR(st.st_mode))
    why = "not a directory";
  else if (st.st_uid != geteuid())
    snprintf(buf, sizeof buf, "owned by uid %lu, not by this user (uid %lu)", (unsigned long)st.st_uid,
             (unsigned long)geteuid()),
        why = buf;
  else if (st.st_mode & (S_IWGRP | S_IWOTH))
    snprintf(buf, sizeof buf, "writable by %s (mode %03o)", st.st_mode & S_IWOTH ? "others" : "its group",
             (unsigned)(st.st_mode & 0777)),
        why = buf;
  if (why && first_time(dir))
    fprintf(stderr, "kiln: cache: %s: %s; it holds code that runs, so it must be a directory of this user's "
                    "that no one else may write: not caching (chmod 700 it or set KILN_CACHE_DIR)\n",
            dir, why);
  return why == NULL;
}

bool cpu_cache_dir(char *buf, size_t n) {
  const char *dir = getenv("KILN_CACHE_DIR");
  int len;
  if (dir) {
    if (!*dir || !strcmp(dir, "off")) return false;
    len = snprintf(buf, n, "%s", dir);
  } else if ((dir = getenv("XDG_CACHE_HOME")) && *dir == '/') {
    len = snprintf(buf, n, "%s/kiln", dir);
  } else if ((dir = getenv("HOME")) && *dir) {
    len = snprintf(buf, n, "%s/.cache/kiln", dir);
  } else {
    return false;
  }
  return len > 0 && (size_t)len < n && dir_usable(buf);
}

/* ---- the key ---- */

static int add_callees(const ir_func *f, const ir_func ***list, int *n, int *cap, int depth) {
  if (depth > 100) return -1;
  for (int j = 0; j < 2 * f->n_instrs; j++) { /* callee, and a control instruction's second region */
    const ir_func *c = j % 2 ? f->instrs[j / 2].attrs.callee2 : f->instrs[j / 2].attrs.callee;
    if (!c) continue;
    bool seen = false;
    for (int k = 0; k < *n && !seen; k++) seen = (*list)[k] == c;
    if (seen) continue;
    if (*n == *cap) {
      int nc = *cap ? 2 * *cap : 8;
      const ir_func **q = realloc(*list, (size_t)nc * sizeof *q);
      if (!q) return -1;
      *list = q;
      *cap = nc;
    }
    (*list)[(*n)++] = c;
    if (add_callees(c, list, n, cap, depth + 1)) return -1;
  }
  return 0;
}

int cpu_cache_key(const ir_func *f, const char *meta, uint8_t key[16]) {
  const ir_func **funcs = NULL;
  int n = 0, cap = 0;
  if (add_callees(f, &funcs, &n, &cap, 0)) {
    free(funcs);
    return -1;
  }
  size_t meta_len = strlen(meta), len = meta_len + 1, used = 0;
  char **texts = calloc((size_t)n + 1, sizeof *texts);
  int rc = texts ? 0 : -1;
  for (int i = 0; !rc && i <= n; i++) {
    texts[i] = ir_print_func(i == 0 ? f : funcs[i - 1]);
    if (!texts[i])
      rc = -1;
    else
      len += strlen(texts[i]) + 1;
  }
  char *all = rc ? NULL : malloc(len + 1);
  if (all) {
    memcpy(all, meta, meta_len);
    all[meta_len] = '\n';
    used = meta_len + 1;
    for (int i = 0; i <= n; i++) {
      size_t k = strlen(texts[i]);
      memcpy(all + used, texts[i], k);
      all[used + k] = '\n';
      used += k + 1;
    }
    cpu_hash128(all, used, key);
  } else {
    rc = -1;
  }
  for (int i = 0; texts && i <= n; i++) free(texts[i]);
  free(texts);
  free(funcs);
  free(all);
  return rc;
}

/* ---- entries ----
 * <dir>/<32 hex digits of the key>.kco: a header, then the payload: the key
 * text (meta), the program's kernel info, the object code, the bitcode. */

#define CACHE_MAGIC "KILNCPU\x1a"
enum { CACHE_FORMAT = 1 };
typedef struct {
  char magic[8];
  uint32_t format, header_bytes;
  uint8_t key[16];
  uint64_t len[4]; /* meta, info, object, bitcode */
  uint8_t sum[16]; /* cpu_hash128 of the payload */
} cache_header;

static void entry_path(char *buf, size_t n, const char *dir, const uint8_t key[16]) {
  char hex[33];
  for (int i = 0; i < 16; i++) snprintf(hex + 2 * i, 3, "%02x", key[i]);
  snprintf(buf, n, "%s/%s.kco", dir, hex);
}

static int read_all(int fd, void *buf, size_t n) {
  size_t got = 0;
  while (got < n) {
    ssize_t r = read(fd, (char *)buf + got, n - got);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return -1;
    got += (size_t)r;
  }
  return 0;
}

static int write_all(int fd, const void *buf, size_t n) {
  size_t put = 0;
  while (put < n) {
    ssize_t r = write(fd, (const char *)buf + put, n - put);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return -1;
    put += (size_t)r;
  }
  return 0;
}

/* The most an entry may hold: a program's objects are megabytes at most;
 * anything near this is not ours (and is never read whole into memory). */
static int64_t entry_max_bytes(void) {
  int64_t cap = (int64_t)256 << 20, limit = cpu_cache_limit_bytes();
  return limit < cap ? limit : cap;
}

int cpu_cache_load(const char *dir, const uint8_t key[16], const char *meta, cpu_cache_entry *e) {
  char path[4200];
  memset(e, 0, sizeof *e);
  entry_path(path, sizeof path, dir, key);
  int64_t size = 0;
  const char *why = NULL;
  int fd = files_open_regular(path, entry_max_bytes(), 1, &size, &why);
  if (fd < 0 && errno == ENOENT) return 0;
  cache_header h;
  memset(&h, 0, sizeof h);
  unsigned char *file = NULL;
  if (fd < 0) {
    /* why says it: a link, a FIFO, another user's, too large */
  } else if ((uint64_t)size < sizeof h) {
    why = "truncated";
  } else if (!(file = malloc((size_t)size))) {
    why = "out of memory";
  } else if (read_all(fd, file, (size_t)size)) {
    why = "unreadable";
  } else {
    memcpy(&h, file, sizeof h);
    uint64_t total = sizeof h;
    bool fits = true;
    for (int k = 0; k < 4; k++) {
      fits = fits && h.len[k] <= (uint64_t)size;
      total += fits ? h.len[k] : 0;
    }
    size_t meta_len = strlen(meta);
    uint8_t sum[16] = {0};
    if (fits && total == (uint64_t)size) cpu_hash128(file + sizeof h, (size_t)(total - sizeof h), sum);
    if (memcmp(h.magic, CACHE_MAGIC, 8))
      why = "bad magic";
    else if (h.format != CACHE_FORMAT || h.header_bytes != sizeof h)
      why = "another format";
    else if (memcmp(h.key, key, 16))
      why = "another key";
    else if (!fits || total != (uint64_t)size)
      why = "truncated";
    else if (memcmp(sum, h.sum, 16))
      why = "bad checksum";
    else if (h.len[0] != meta_len || memcmp(file + sizeof h, meta, meta_len))
      why = "another key text";
    else if (h.len[2] == 0 || h.len[3] == 0)
      why = "empty";
  }
  if (!why) futimens(fd, NULL); /* recently used: the trimming keeps it longest */
  if (fd >= 0) close(fd);
  if (why) {
    if (cpu_cache_log()) fprintf(stderr, "kiln: cache: %s: %s; rebuilding it\n", path, why);
    free(file);
    return -1;
  }
  unsigned char *at = file + sizeof h + h.len[0];
  e->file = file;
  e->info = at, e->info_len = (size_t)h.len[1], at += h.len[1];
  e->obj = at, e->obj_len = (size_t)h.len[2], at += h.len[2];
  e->bc = at, e->bc_len = (size_t)h.len[3];
  return 1;
}

void cpu_cache_entry_free(cpu_cache_entry *e) {
  free(e->file);
  memset(e, 0, sizeof *e);
}

/* ---- the bound: KILN_CACHE_MAX_MB, a positive number of megabytes (a
 * fraction too); anything else is said once and replaced, never read as a
 * negative or wrapped size that would empty the directory ---- */

#define LIMIT_DEFAULT_MB 1024.0
#define LIMIT_MAX_MB 1099511627776.0 /* 2^40 MB = 2^60 bytes: "no bound" */

int64_t cpu_cache_limit_bytes(void) {
  const char *env = getenv("KILN_CACHE_MAX_MB");
  if (!env || !*env) return (int64_t)LIMIT_DEFAULT_MB << 20;
  char *end = NULL;
  double mb = strtod(env, &end);
  while (end && (*end == ' ' || *end == '\t' || *end == '\n')) end++;
  const char *why = NULL;
  if (end == env || !end || *end || mb != mb || mb <= 0)
    why = "is not a positive number of megabytes; using the default, 1024", mb = LIMIT_DEFAULT_MB;
  else if (mb > LIMIT_MAX_MB)
    why = "is more than 2^40 MB; using 2^40 MB (no bound)", mb = LIMIT_MAX_MB;
  if (why) {
    char what[160];
    snprintf(what, sizeof what, "KILN_CACHE_MAX_MB=%s", env);
    if (first_time(what)) fprintf(stderr, "kiln: cache: KILN_CACHE_MAX_MB=\"%.60s\" %s\n", env, why);
  }
  double bytes = mb * 1048576.0;
  return bytes < 1 ? 1 : (int64_t)bytes;
}

/* ---- trimming: entries beyond the size limit go, least recently used
 * first (a hit touches its entry), and temporary files that a writer left
 * more than an hour ago (it crashed) are swept ---- */

typedef struct {
  char name[80];
  struct timespec mtime;
  off_t size;
} entry_stat;

static int by_mtime(const void *a, const void *b) {
  const entry_stat *x = a, *y = b;
  if (x->mtime.tv_sec != y->mtime.tv_sec)
    return (x->mtime.tv_sec > y->mtime.tv_sec) - (x->mtime.tv_sec < y->mtime.tv_sec);
  return (x->mtime.tv_nsec > y->mtime.tv_nsec) - (x->mtime.tv_nsec < y->mtime.tv_nsec);
}

int64_t cpu_cache_trim(const char *dir, int64_t limit) {
  DIR *d = opendir(dir);
  if (!d) return 0;
  int dfd = dirfd(d);
  entry_stat *es = NULL;
  int n = 0, cap = 0;
  int64_t total = 0;
  time_t now = time(NULL);
  for (struct dirent *de; (de = readdir(d));) {
    const char *nm = de->d_name;
    size_t len = strlen(nm);
    bool tmp = strstr(nm, ".kco.tmp-") != NULL, entry = len > 4 && !strcmp(nm + len - 4, ".kco");
    struct stat st;
    if ((!tmp && !entry) || len >= sizeof es->name) continue;
    if (fstatat(dfd, nm, &st, AT_SYMLINK_NOFOLLOW)) continue;
    if (tmp) {
      if (S_ISREG(st.st_mode) && now - st.st_mtime > 3600) unlinkat(dfd, nm, 0);
      continue;
    }
    if (n == cap) {
      entry_stat *q = realloc(es, (size_t)(cap = cap ? 2 * cap : 64) * sizeof *q);
      if (!q) break;
      es = q;
    }
    /* a link or FIFO named like an entry is never read; it goes first */
    bool odd = !S_ISREG(st.st_mode);
    snprintf(es[n].name, sizeof es[n].name, "%s", nm);
    es[n].mtime = odd ? (struct timespec){0, 0} : st.st_mtim;
    es[n].size = odd ? 0 : st.st_size;
    total += es[n].size;
    n++;
  }
  if (total > limit) {
    qsort(es, (size_t)n, sizeof *es, by_mtime);
    for (int i = 0; i < n && total > limit - limit / 10; i++) { /* down to 90%: not again at the next store */
      if (!unlinkat(dfd, es[i].name, 0)) total -= es[i].size;
      if (cpu_cache_log()) fprintf(stderr, "kiln: cache: trimmed %s/%s\n", dir, es[i].name);
    }
  }
  closedir(d);
  free(es);
  return total;
}

/* What this process knows of the directory it stores into: the bytes of
 * its entries at the last scan plus what it stored since. Other processes'
 * stores are not counted, so a scan also comes after this one wrote a tenth
 * of the bound. */
static struct {
  pthread_mutex_t lock;
  char dir[4096];
  int64_t limit, total, since_scan;
  bool known;
} usage = {PTHREAD_MUTEX_INITIALIZER, "", 0, 0, 0, false};

static void account(const char *dir, int64_t bytes) {
  int64_t limit = cpu_cache_limit_bytes();
  pthread_mutex_lock(&usage.lock);
  bool same = usage.known && usage.limit == limit && !strcmp(usage.dir, dir);
  if (same) usage.total += bytes, usage.since_scan += bytes;
  if (!same || usage.total > limit || usage.since_scan > limit / 10) {
    usage.total = cpu_cache_trim(dir, limit);
    usage.since_scan = 0;
    usage.limit = limit;
    usage.known = strlen(dir) < sizeof usage.dir;
    if (usage.known) memcpy(usage.dir, dir, strlen(dir) + 1);
  }
  pthread_mutex_unlock(&usage.lock);
}

int cpu_cache_store(const char *dir, const uint8_t key[16], const char *meta, const cpu_cache_entry *e) {
  cache_header h;
  memset(&h, 0, sizeof h);
  memcpy(h.magic, CACHE_MAGIC, 8);
  h.format = CACHE_FORMAT;
  h.header_bytes = sizeof h;
  memcpy(h.key, key, 16);
  h.len[0] = strlen(meta), h.len[1] = e->info_len, h.len[2] = e->obj_len, h.len[3] = e->bc_len;
  size_t total = sizeof h + (size_t)(h.len[0] + h.len[1] + h.len[2] + h.len[3]);
  if ((uint64_t)total > (uint64_t)entry_max_bytes()) {
    if (cpu_cache_log())
      fprintf(stderr, "kiln: cache: %s: an entry of %zu bytes is over the bound; not cached\n", dir, total);
    account(dir, 0); /* a new, smaller bound still trims what is there */
    return -1;
  }
  unsigned char *file = malloc(total);
  if (!file) return -1;
  unsigned char *at = file + sizeof h;
  memcpy(at, meta, (size_t)h.len[0]), at += h.len[0];
  if (e->info_len) memcpy(at, e->info, e->info_len), at += e->info_len;
  memcpy(at, e->obj, e->obj_len), at += e->obj_len;
  memcpy(at, e->bc, e->bc_len);
  cpu_hash128(file + sizeof h, total - sizeof h, h.sum);
  memcpy(file, &h, sizeof h);

  char path[4200], tmp[4300];
  entry_path(path, sizeof path, dir, key);
  const char *why = files_mkdirs(dir, 0700) ? "cannot create the directory" : NULL;
  int fd = why ? -1 : files_open_temp(path, tmp, sizeof tmp, 0600);
  if (!why && fd < 0) why = "cannot create a file";
  if (!why) {
    if (write_all(fd, file, total)) why = "cannot write";
    if (close(fd) && !why) why = "cannot write";
    if (!why && rename(tmp, path)) why = "cannot rename";
    if (why) unlink(tmp);
  }
  int err = errno;
  free(file);
  if (why) {
    if (cpu_cache_log()) fprintf(stderr, "kiln: cache: %s: %s (%s); not cached\n", dir, why, strerror(err));
    return -1;
  }
  if (cpu_cache_log()) fprintf(stderr, "kiln: cache: stored %s\n", path);
  account(dir, (int64_t)total);
  return 0;
}

/* ---- several buffers as one ---- */

#define PARTS_TAG "KILNPRT1"

void *cpu_parts_pack(int n, const void *const *data, const size_t *len, size_t *out_len) {
  size_t total = 8 + 4;
  for (int i = 0; i < n; i++) total += 8 + len[i];
  unsigned char *buf = malloc(total), *at = buf;
  if (!buf) return NULL;
  uint32_t count = (uint32_t)n;
  memcpy(at, PARTS_TAG, 8), at += 8;
  memcpy(at, &count, 4), at += 4;
  for (int i = 0; i < n; i++) {
    uint64_t l = len[i];
    memcpy(at, &l, 8), at += 8;
    memcpy(at, data[i], len[i]), at += len[i];
  }
  *out_len = total;
  return buf;
}

int cpu_parts_unpack(const void *buf, size_t len, int max, const void **data, size_t *lens) {
  const unsigned char *at = buf, *end = at + len;
  if (len < 12 || memcmp(at, PARTS_TAG, 8)) {
    if (max < 1) return -1;
    data[0] = buf, lens[0] = len;
    return 1;
  }
  uint32_t count;
  memcpy(&count, at + 8, 4);
  at += 12;
  if (count < 1 || count > (uint32_t)max) return -1;
  for (uint32_t i = 0; i < count; i++) {
    uint64_t l;
    if ((size_t)(end - at) < 8) return -1;
    memcpy(&l, at, 8);
    at += 8;
    if (l == 0 || l > (uint64_t)(end - at)) return -1;
    data[i] = at, lens[i] = (size_t)l;
    at += l;
  }
  return at == end ? (int)count : -1;
}
