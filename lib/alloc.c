/* alloc.c — a size-class caching allocator: blocks are powers of two,
 * 64-byte aligned. Small blocks are cached per thread (no lock, no malloc in
 * steady state); large ones in one global cache with a byte budget, so big
 * eager temporaries don't pay page faults on every op. */
#include <pthread.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <unistd.h>

#include "runtime.h"

enum {
  MIN_CLASS = 7,     /* 128 bytes */
  SMALL_MAX = 16,    /* <= 64 KiB: per-thread cache */
  MAX_CLASS = 48,
  HUGE_CLASS = 21,   /* 2 MiB: transparent huge pages */
};
/* bytes kept per small class and thread: a scope of a few thousand small
 * results recycles without touching malloc */
#define SMALL_KEEP_BYTES ((int64_t)8 << 20)
/* bytes kept in the global cache: half the machine's memory, at least 1
 * GiB. The cache holds only blocks the process had live at once before, so
 * a step that peaks at P bytes keeps at most about P; with the budget under
 * the peak, every step gave the excess back and faulted it in again
 * (ResNet-50's eager training at batch 8 peaks near 7 GB: with a quarter of
 * 23 GB it faulted 1.3 GB of fresh pages in per step, 1.2 s of system time
 * in a 2.5-3 s step; with half, 0.09 GB and 0.3 s, 2.2 s per step). Read
 * under large_lock. */
static size_t large_budget(void) {
  static size_t budget;
  if (!budget) {
    long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
    size_t half = pages > 0 && page > 0 ? (size_t)pages / 2 * (size_t)page : 0;
    budget = half > ((size_t)1 << 30) ? half : (size_t)1 << 30;
  }
  return budget;
}

typedef struct free_block {
  struct free_block *next;
} free_block;

typedef struct {
  free_block *head[SMALL_MAX + 1];
  int64_t count[SMALL_MAX + 1];
  bool registered;
} thread_cache;

static _Thread_local thread_cache tcache KILN_TLS_FAST;
static pthread_key_t tcache_key;
static pthread_once_t tcache_once = PTHREAD_ONCE_INIT;

static pthread_mutex_t large_lock = PTHREAD_MUTEX_INITIALIZER;
static free_block *large_head[MAX_CLASS + 1];
static size_t large_bytes;

static void tcache_flush(void *arg) {
  thread_cache *c = arg;
  for (int k = 0; k <= SMALL_MAX; k++) {
    while (c->head[k]) {
      free_block *b = c->head[k];
      c->head[k] = b->next;
      free(b);
    }
    c->count[k] = 0;
  }
}

static void tcache_key_init(void) { pthread_key_create(&tcache_key, tcache_flush); }

static int size_class(size_t bytes) {
  if (bytes <= ((size_t)1 << MIN_CLASS)) return MIN_CLASS;
  int k = 64 - __builtin_clzll((unsigned long long)(bytes - 1));
  return k;
}

/* A block of 2 MiB or more is aligned to 2 MiB and asks for transparent
 * huge pages (where THP is "madvise", as on Debian): a fresh block then
 * faults in 2 MiB at a time instead of 4 KiB (ResNet-50's eager training
 * faulted 6-17 thousand 4 KiB pages per step, each tens of microseconds on
 * a virtual machine), and the kernels that stream activations miss the TLB
 * less. Without THP the advice is ignored. */
static void *huge_alloc(size_t size) {
  void *p = aligned_alloc((size_t)1 << HUGE_CLASS, size);
#ifdef MADV_HUGEPAGE
  if (p) (void)madvise(p, size, MADV_HUGEPAGE);
#endif
  return p;
}

void *mem_alloc(size_t bytes, int32_t *cls) {
  int k = size_class(bytes);
  if (KILN_UNLIKELY(k > MAX_CLASS)) return NULL;
  *cls = k;
  if (k <= SMALL_MAX) {
    free_block *b = tcache.head[k];
    if (KILN_LIKELY(b != NULL)) {
      tcache.head[k] = b->next;
      tcache.count[k]--;
      return b;
    }
  } else {
    pthread_mutex_lock(&large_lock);
    free_block *b = large_head[k];
    if (b) {
      large_head[k] = b->next;
      large_bytes -= (size_t)1 << k;
    }
    pthread_mutex_unlock(&large_lock);
    if (b) return b;
  }
  if (k < HUGE_CLASS) return aligned_alloc(KILN_ALIGN, (size_t)1 << k);
  return huge_alloc((size_t)1 << k);
}

void mem_free(void *p, int32_t k) {
  if (!p) return;
  free_block *b = p;
  if (k <= SMALL_MAX) {
    if (KILN_UNLIKELY(!tcache.registered)) {
      pthread_once(&tcache_once, tcache_key_init);
      pthread_setspecific(tcache_key, &tcache);
      tcache.registered = true;
    }
    if (tcache.count[k] << k < SMALL_KEEP_BYTES) {
      b->next = tcache.head[k];
      tcache.head[k] = b;
      tcache.count[k]++;
      return;
    }
  } else {
    size_t size = (size_t)1 << k;
    pthread_mutex_lock(&large_lock);
    bool keep = large_bytes + size <= large_budget();
    if (keep) {
      b->next = large_head[k];
      large_head[k] = b;
      large_bytes += size;
    }
    pthread_mutex_unlock(&large_lock);
    if (keep) return;
  }
  free(p);
}
