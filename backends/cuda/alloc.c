/* alloc.c — the caching device allocator (cuda_rt.h): per-GPU free lists by
 * size class, so that eager GPU tensors of recurring sizes cost no cuMemAlloc
 * (which synchronizes and takes ~µs) after the first step of a loop. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>

#include "runtime.h"
#include "cuda_rt.h"

/* Class 0 is 512 bytes (the driver's own granularity is no finer); above,
 * four classes per power of two: 2^e + j 2^(e-2), j = 1..4, so at most 25%
 * of a block is slack. */
enum { MIN_SHIFT = 9, STEPS = 4, MAX_SHIFT = 46, N_CLASSES = 1 + (MAX_SHIFT - MIN_SHIFT) * STEPS };

static int size_class(size_t bytes) {
  if (bytes <= ((size_t)1 << MIN_SHIFT)) return 0;
  int e = 63 - __builtin_clzll((unsigned long long)(bytes - 1)); /* 2^e < bytes <= 2^(e+1) */
  size_t step = (size_t)1 << (e - 2), j = (bytes - ((size_t)1 << e) + step - 1) / step;
  return 1 + (e - MIN_SHIFT) * STEPS + (int)(j - 1);
}

static size_t class_bytes(int c) {
  if (c == 0) return (size_t)1 << MIN_SHIFT;
  int e = MIN_SHIFT + (c - 1) / STEPS, j = (c - 1) % STEPS + 1;
  return ((size_t)1 << e) + ((size_t)j << (e - 2));
}

/* A cached block. Records are made with the blocks they describe and kept
 * on spare while the block is in use, so freeing never calls malloc. */
typedef struct block {
  CUdeviceptr ptr;
  struct block *next;
} block;

typedef struct {
  pthread_mutex_t lock;
  block *free[N_CLASSES];
  block *spare;
  cuda_mem_stats stats;
} pool;

static pool pools[CUDA_MAX_GPUS];
static pthread_once_t pools_once = PTHREAD_ONCE_INIT;

static void pools_init(void) {
  for (int i = 0; i < CUDA_MAX_GPUS; i++) pthread_mutex_init(&pools[i].lock, NULL);
}

/* Gives p's cached blocks back to the driver once gpu's stream has drained
 * (queued work may still use them). Called with p->lock held. */
static int trim_locked(const char *op, int gpu, pool *p) {
  if (!p->stats.cached) return 0;
  CUstream s;
  if (cuda_enter(op, gpu, &s)) return -1;
  CUresult r = cuda_drv.cuStreamSynchronize(s);
  for (int c = 0; c < N_CLASSES && r == CUDA_SUCCESS; c++) {
    while (p->free[c] && r == CUDA_SUCCESS) {
      block *b = p->free[c];
      if ((r = cuda_drv.cuMemFree(b->ptr)) != CUDA_SUCCESS) break;
      p->free[c] = b->next;
      b->next = p->spare;
      p->spare = b;
      p->stats.cached -= class_bytes(c);
      p->stats.driver_frees++;
    }
  }
  cuda_leave();
  return r == CUDA_SUCCESS ? 0 : cuda_fail(op, r, "returning cached GPU memory");
}

/* A new block of class c from the driver, the cache given back first when
 * the driver is out of memory. Called with p->lock held. */
static CUdeviceptr driver_block(const char *op, int gpu, pool *p, int c) {
  size_t bytes = class_bytes(c);
  char what[96];
  CUdeviceptr ptr = 0;
  block *b = malloc(sizeof *b); /* its record, for when it is freed */
  if (!b) {
    kiln_set_error("%s: out of memory", op);
    return 0;
  }
  if (cuda_enter(op, gpu, NULL)) {
    free(b);
    return 0;
  }
  CUresult r = cuda_drv.cuMemAlloc(&ptr, bytes);
  int trim_failed = 0; /* then trim_locked has set the error */
  if (r == CUDA_ERROR_OUT_OF_MEMORY && p->stats.cached && !(trim_failed = trim_locked(op, gpu, p)))
    r = cuda_drv.cuMemAlloc(&ptr, bytes);
  cuda_leave();
  if (trim_failed || r != CUDA_SUCCESS) {
    free(b);
    snprintf(what, sizeof what, "allocating %zu bytes on gpu:%d", bytes, gpu);
    if (!trim_failed) cuda_fail(op, r, what);
    return 0;
  }
  b->next = p->spare;
  p->spare = b;
  p->stats.driver_allocs++;
  return ptr;
}

void *cuda_alloc(const char *op, int gpu, size_t bytes, int32_t *cls) {
  if (bytes > ((size_t)1 << MAX_SHIFT)) {
    kiln_set_error("%s: %zu bytes is more than a GPU holds", op, bytes);
    return NULL;
  }
  pthread_once(&pools_once, pools_init);
  int c = size_class(bytes ? bytes : 1);
  pool *p = &pools[gpu];
  pthread_mutex_lock(&p->lock);
  CUdeviceptr ptr = 0;
  block *b = p->free[c];
  if (b) { /* stream order makes it safe at once (see cuda_rt.h) */
    p->free[c] = b->next;
    ptr = b->ptr;
    b->next = p->spare;
    p->spare = b;
    p->stats.cached -= class_bytes(c);
    p->stats.reuses++;
  } else {
    ptr = driver_block(op, gpu, p, c);
  }
  if (ptr) {
    p->stats.in_use += class_bytes(c);
    if (p->stats.in_use > p->stats.peak_in_use) p->stats.peak_in_use = p->stats.in_use;
  }
  pthread_mutex_unlock(&p->lock);
  *cls = c;
  return (void *)(uintptr_t)ptr;
}

void cuda_free(int gpu, void *ptr, int32_t c) {
  if (!ptr) return;
  pool *p = &pools[gpu];
  pthread_mutex_lock(&p->lock);
  block *b = p->spare; /* never NULL: every block in use has a spare record */
  p->spare = b->next;
  b->ptr = (CUdeviceptr)(uintptr_t)ptr;
  b->next = p->free[c];
  p->free[c] = b;
  p->stats.in_use -= class_bytes(c);
  p->stats.cached += class_bytes(c);
  pthread_mutex_unlock(&p->lock);
}

int cuda_trim(const char *op, int gpu) {
  if (gpu < 0 || gpu >= cuda_device_count()) return kiln_set_error("%s: no gpu:%d", op, gpu);
  pthread_once(&pools_once, pools_init);
  pool *p = &pools[gpu];
  pthread_mutex_lock(&p->lock);
  int rc = trim_locked(op, gpu, p);
  pthread_mutex_unlock(&p->lock);
  return rc;
}

int kiln_debug_cuda_trim(int gpu) { return cuda_trim("cuda_trim", gpu); }

int kiln_debug_cuda_memory(int gpu, cuda_mem_stats *out) {
  if (gpu < 0 || gpu >= cuda_device_count() || !out) return -1;
  pthread_once(&pools_once, pools_init);
  pool *p = &pools[gpu];
  pthread_mutex_lock(&p->lock);
  *out = p->stats;
  pthread_mutex_unlock(&p->lock);
  return 0;
}
