/* fake_cuda.c — a CUDA driver for tests on machines without a GPU: the entry
 * points Kiln's runtime uses, on host memory. Device pointers live in a
 * fake address space the host cannot dereference (a stray host read of GPU
 * data crashes), copies are queued on their stream until it is synchronized
 * (a missing synchronization reads stale data), and every call checks that
 * a context is current and owns the memory it touches.
 *
 * Set by the environment, read at each call:
 *   FAKE_CUDA_DEVICES=N        devices listed (default 2)
 *   FAKE_CUDA_MEMORY=BYTES     memory per device (default 1 GiB)
 *   FAKE_CUDA_STUB=1           cuInit fails as the toolkit's stub library does
 *   FAKE_CUDA_NO_PROC=1        cuGetProcAddress finds nothing (dlsym fallback)
 *   FAKE_CUDA_FAIL=name[=code],...  those entry points fail (cuMemAlloc with
 *                              CUDA_ERROR_OUT_OF_MEMORY, others CUDA_ERROR_UNKNOWN)
 * and for the tests, fake_cuda_calls(name), fake_cuda_live_bytes(dev) and
 * fake_cuda_ctx_depth(). */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda/cuda_rt.h"

#define EXPORT __attribute__((visibility("default")))
#define FAKE_BASE 0xdead00000000ull /* above the 47-bit user space: never a host address */
#define MAX_DEVICES 8

typedef struct fake_ctx {
  int dev;
} fake_ctx;

typedef struct op {
  struct op *next;
  int kind; /* 0 to device from staging, 1 to host, 2 device to device */
  CUdeviceptr dst_dev, src_dev;
  void *dst_host;
  unsigned char *staging;
  size_t bytes;
} op;

typedef struct CUstream_st {
  fake_ctx *ctx;
  op *head, *tail;
  struct CUstream_st *next_stream;
} fake_stream;

typedef struct {
  CUdeviceptr va;
  size_t bytes;
  unsigned char *host;
  int dev;
} allocation;

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static bool initialized;
static fake_ctx contexts[MAX_DEVICES];
static fake_stream *streams;
static allocation *allocs;
static int n_allocs, cap_allocs;
static CUdeviceptr next_va = FAKE_BASE;
static size_t live_bytes[MAX_DEVICES];

static _Thread_local fake_ctx *ctx_stack[32];
static _Thread_local int ctx_depth;

/* ---- call counting and injected failures ---- */

static const char *const names[] = {
    "cuInit", "cuDeviceGetCount", "cuDeviceGet", "cuDeviceGetName", "cuDeviceGetAttribute",
    "cuDeviceTotalMem", "cuDevicePrimaryCtxRetain", "cuCtxPushCurrent", "cuCtxPopCurrent",
    "cuStreamCreate", "cuStreamSynchronize", "cuMemAlloc", "cuMemFree", "cuMemcpyHtoDAsync",
    "cuMemcpyDtoHAsync", "cuMemcpyDtoDAsync", "cuMemcpyPeerAsync", "cuGetProcAddress",
};
enum { N_NAMES = sizeof names / sizeof names[0] };
static long calls[N_NAMES];

EXPORT long fake_cuda_calls(const char *name) {
  pthread_mutex_lock(&lock);
  long n = -1;
  for (int i = 0; i < N_NAMES; i++)
    if (strcmp(names[i], name) == 0) n = calls[i];
  pthread_mutex_unlock(&lock);
  return n;
}

EXPORT size_t fake_cuda_live_bytes(int dev) {
  pthread_mutex_lock(&lock);
  size_t n = dev >= 0 && dev < MAX_DEVICES ? live_bytes[dev] : 0;
  pthread_mutex_unlock(&lock);
  return n;
}

/* contexts pushed on the calling thread: Kiln leaves none behind */
EXPORT int fake_cuda_ctx_depth(void) { return ctx_depth; }

static long env_long(const char *name, long dflt) {
  const char *s = getenv(name);
  return s && *s ? strtol(s, NULL, 0) : dflt;
}

/* The code FAKE_CUDA_FAIL injects for this entry point, or CUDA_SUCCESS. */
static CUresult injected(const char *name) {
  const char *s = getenv("FAKE_CUDA_FAIL");
  size_t n = strlen(name);
  while (s && *s) {
    const char *end = strchr(s, ',');
    size_t len = end ? (size_t)(end - s) : strlen(s);
    if (len >= n && strncmp(s, name, n) == 0 && (len == n || s[n] == '=')) {
      if (len > n) return (CUresult)strtol(s + n + 1, NULL, 0);
      return strcmp(name, "cuMemAlloc") == 0 ? CUDA_ERROR_OUT_OF_MEMORY : CUDA_ERROR_UNKNOWN;
    }
    s = end ? end + 1 : NULL;
  }
  return CUDA_SUCCESS;
}

/* Every entry point but the error strings starts here, with lock held. */
static CUresult enter(const char *name, bool needs_init) {
  pthread_mutex_lock(&lock);
  for (int i = 0; i < N_NAMES; i++)
    if (strcmp(names[i], name) == 0) calls[i]++;
  CUresult r = injected(name);
  if (r == CUDA_SUCCESS && needs_init && !initialized) r = CUDA_ERROR_NOT_INITIALIZED;
  return r;
}

static CUresult leave(CUresult r) {
  pthread_mutex_unlock(&lock);
  return r;
}

static int n_devices(void) {
  long n = env_long("FAKE_CUDA_DEVICES", 2);
  return n < 0 ? 0 : n > MAX_DEVICES ? MAX_DEVICES : (int)n;
}

static fake_ctx *current(void) { return ctx_depth ? ctx_stack[ctx_depth - 1] : NULL; }

/* The host bytes behind [p, p + bytes) on device dev (-1: any), or NULL. */
static unsigned char *translate(CUdeviceptr p, size_t bytes, int dev) {
  for (int i = 0; i < n_allocs; i++) {
    allocation *a = &allocs[i];
    if (p >= a->va && p - a->va <= a->bytes && bytes <= a->bytes - (p - a->va))
      return dev < 0 || a->dev == dev ? a->host + (p - a->va) : NULL;
  }
  return NULL;
}

/* Runs what is queued on s, in order. */
static void drain(fake_stream *s) {
  while (s->head) {
    op *o = s->head;
    s->head = o->next;
    int dev = s->ctx->dev;
    if (o->kind == 0) {
      unsigned char *d = translate(o->dst_dev, o->bytes, dev);
      if (d) memcpy(d, o->staging, o->bytes);
    } else if (o->kind == 1) {
      unsigned char *src = translate(o->src_dev, o->bytes, dev);
      if (src) memcpy(o->dst_host, src, o->bytes);
    } else { /* on a device or between two (peer) */
      unsigned char *d = translate(o->dst_dev, o->bytes, -1), *src = translate(o->src_dev, o->bytes, -1);
      if (d && src) memmove(d, src, o->bytes);
    }
    free(o->staging);
    free(o);
  }
  s->tail = NULL;
}

static void drain_device(int dev) {
  for (fake_stream *s = streams; s; s = s->next_stream)
    if (s->ctx->dev == dev) drain(s);
}

static CUresult enqueue(fake_stream *s, op *o) {
  if (!s || s->ctx != current()) {
    free(o->staging);
    free(o);
    return CUDA_ERROR_INVALID_HANDLE;
  }
  o->next = NULL;
  if (s->tail)
    s->tail->next = o;
  else
    s->head = o;
  s->tail = o;
  return CUDA_SUCCESS;
}

/* ---- the entry points ---- */

EXPORT CUresult cuGetErrorName(CUresult r, const char **s);
EXPORT CUresult cuGetErrorString(CUresult r, const char **s);

static const struct {
  CUresult code;
  const char *name, *text;
} errors[] = {
    {CUDA_SUCCESS, "CUDA_SUCCESS", "no error"},
    {CUDA_ERROR_INVALID_VALUE, "CUDA_ERROR_INVALID_VALUE", "invalid argument"},
    {CUDA_ERROR_OUT_OF_MEMORY, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory"},
    {CUDA_ERROR_NOT_INITIALIZED, "CUDA_ERROR_NOT_INITIALIZED", "initialization error"},
    {CUDA_ERROR_STUB_LIBRARY, "CUDA_ERROR_STUB_LIBRARY", "CUDA driver is a stub library"},
    {CUDA_ERROR_NO_DEVICE, "CUDA_ERROR_NO_DEVICE", "no CUDA-capable device is detected"},
    {CUDA_ERROR_INVALID_DEVICE, "CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal"},
    {CUDA_ERROR_INVALID_CONTEXT, "CUDA_ERROR_INVALID_CONTEXT", "invalid device context"},
    {CUDA_ERROR_INVALID_HANDLE, "CUDA_ERROR_INVALID_HANDLE", "invalid resource handle"},
    {CUDA_ERROR_NOT_FOUND, "CUDA_ERROR_NOT_FOUND", "named symbol not found"},
    {CUDA_ERROR_ILLEGAL_ADDRESS, "CUDA_ERROR_ILLEGAL_ADDRESS", "an illegal memory access was encountered"},
    {CUDA_ERROR_NOT_SUPPORTED, "CUDA_ERROR_NOT_SUPPORTED", "operation not supported"},
    {CUDA_ERROR_UNKNOWN, "CUDA_ERROR_UNKNOWN", "unknown error"},
};

EXPORT CUresult cuGetErrorName(CUresult r, const char **s) {
  for (size_t i = 0; i < sizeof errors / sizeof errors[0]; i++)
    if (errors[i].code == r) {
      *s = errors[i].name;
      return CUDA_SUCCESS;
    }
  *s = NULL;
  return CUDA_ERROR_INVALID_VALUE;
}

EXPORT CUresult cuGetErrorString(CUresult r, const char **s) {
  for (size_t i = 0; i < sizeof errors / sizeof errors[0]; i++)
    if (errors[i].code == r) {
      *s = errors[i].text;
      return CUDA_SUCCESS;
    }
  *s = NULL;
  return CUDA_ERROR_INVALID_VALUE;
}

EXPORT CUresult cuInit(unsigned flags) {
  CUresult r = enter("cuInit", false);
  if (r == CUDA_SUCCESS && flags) r = CUDA_ERROR_INVALID_VALUE;
  if (r == CUDA_SUCCESS && env_long("FAKE_CUDA_STUB", 0)) r = CUDA_ERROR_STUB_LIBRARY;
  if (r == CUDA_SUCCESS && n_devices() == 0) r = CUDA_ERROR_NO_DEVICE;
  if (r == CUDA_SUCCESS) initialized = true;
  return leave(r);
}

EXPORT CUresult cuDeviceGetCount(int *n) {
  CUresult r = enter("cuDeviceGetCount", true);
  if (r == CUDA_SUCCESS) *n = n_devices();
  return leave(r);
}

EXPORT CUresult cuDeviceGet(CUdevice *d, int i) {
  CUresult r = enter("cuDeviceGet", true);
  if (r == CUDA_SUCCESS && (i < 0 || i >= n_devices())) r = CUDA_ERROR_INVALID_DEVICE;
  if (r == CUDA_SUCCESS) *d = i;
  return leave(r);
}

EXPORT CUresult cuDeviceGetName(char *name, int len, CUdevice d) {
  CUresult r = enter("cuDeviceGetName", true);
  if (r == CUDA_SUCCESS && (d < 0 || d >= n_devices())) r = CUDA_ERROR_INVALID_DEVICE;
  if (r == CUDA_SUCCESS) snprintf(name, (size_t)len, "Fake GPU");
  return leave(r);
}

EXPORT CUresult cuDeviceGetAttribute(int *v, int attr, CUdevice d) {
  CUresult r = enter("cuDeviceGetAttribute", true);
  if (r == CUDA_SUCCESS && (d < 0 || d >= n_devices())) r = CUDA_ERROR_INVALID_DEVICE;
  if (r == CUDA_SUCCESS) { /* device 0 is a Hopper (9.0), the others Amperes (8.0) */
    if (attr == CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)
      *v = d == 0 ? 9 : 8;
    else if (attr == CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)
      *v = 0;
    else
      r = CUDA_ERROR_INVALID_VALUE;
  }
  return leave(r);
}

EXPORT CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice d) {
  CUresult r = enter("cuDeviceTotalMem", true);
  if (r == CUDA_SUCCESS && (d < 0 || d >= n_devices())) r = CUDA_ERROR_INVALID_DEVICE;
  if (r == CUDA_SUCCESS) *bytes = (size_t)env_long("FAKE_CUDA_MEMORY", 1l << 30);
  return leave(r);
}

EXPORT CUresult cuDevicePrimaryCtxRetain(CUcontext *ctx, CUdevice d) {
  CUresult r = enter("cuDevicePrimaryCtxRetain", true);
  if (r == CUDA_SUCCESS && (d < 0 || d >= n_devices())) r = CUDA_ERROR_INVALID_DEVICE;
  if (r == CUDA_SUCCESS) {
    contexts[d].dev = d;
    *ctx = (CUcontext)&contexts[d];
  }
  return leave(r);
}

EXPORT CUresult cuCtxPushCurrent_v2(CUcontext ctx) {
  CUresult r = enter("cuCtxPushCurrent", true);
  if (r == CUDA_SUCCESS && !ctx) r = CUDA_ERROR_INVALID_CONTEXT;
  if (r == CUDA_SUCCESS && ctx_depth == 32) r = CUDA_ERROR_INVALID_VALUE;
  if (r == CUDA_SUCCESS) ctx_stack[ctx_depth++] = (fake_ctx *)ctx;
  return leave(r);
}

EXPORT CUresult cuCtxPopCurrent_v2(CUcontext *ctx) {
  CUresult r = enter("cuCtxPopCurrent", true);
  if (r == CUDA_SUCCESS && !ctx_depth) r = CUDA_ERROR_INVALID_CONTEXT;
  if (r == CUDA_SUCCESS) {
    fake_ctx *c = ctx_stack[--ctx_depth];
    if (ctx) *ctx = (CUcontext)c;
  }
  return leave(r);
}

EXPORT CUresult cuStreamCreate(CUstream *s, unsigned flags) {
  CUresult r = enter("cuStreamCreate", true);
  (void)flags;
  if (r == CUDA_SUCCESS && !current()) r = CUDA_ERROR_INVALID_CONTEXT;
  fake_stream *st = NULL;
  if (r == CUDA_SUCCESS && !(st = calloc(1, sizeof *st))) r = CUDA_ERROR_OUT_OF_MEMORY;
  if (r == CUDA_SUCCESS) {
    st->ctx = current();
    st->next_stream = streams;
    streams = st;
    *s = st;
  }
  return leave(r);
}

EXPORT CUresult cuStreamSynchronize(CUstream s) {
  CUresult r = enter("cuStreamSynchronize", true);
  if (r == CUDA_SUCCESS && !s) r = CUDA_ERROR_INVALID_HANDLE; /* Kiln never uses stream 0 */
  if (r == CUDA_SUCCESS) drain(s);
  return leave(r);
}

EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t bytes) {
  CUresult r = enter("cuMemAlloc", true);
  fake_ctx *c = current();
  if (r == CUDA_SUCCESS && !c) r = CUDA_ERROR_INVALID_CONTEXT;
  if (r == CUDA_SUCCESS && bytes == 0) r = CUDA_ERROR_INVALID_VALUE;
  if (r == CUDA_SUCCESS && live_bytes[c->dev] + bytes > (size_t)env_long("FAKE_CUDA_MEMORY", 1l << 30))
    r = CUDA_ERROR_OUT_OF_MEMORY;
  if (r == CUDA_SUCCESS && n_allocs == cap_allocs) {
    int cap = cap_allocs ? 2 * cap_allocs : 64;
    allocation *a = realloc(allocs, (size_t)cap * sizeof *a);
    if (!a) r = CUDA_ERROR_OUT_OF_MEMORY;
    else allocs = a, cap_allocs = cap;
  }
  unsigned char *host = NULL;
  if (r == CUDA_SUCCESS && !(host = malloc(bytes))) r = CUDA_ERROR_OUT_OF_MEMORY;
  if (r == CUDA_SUCCESS) {
    memset(host, 0xA5, bytes); /* garbage, as fresh device memory is */
    allocs[n_allocs++] = (allocation){next_va, bytes, host, c->dev};
    *p = next_va;
    next_va += (bytes + 255) / 256 * 256 + 256; /* a gap: overruns hit no block */
    live_bytes[c->dev] += bytes;
  }
  return leave(r);
}

EXPORT CUresult cuMemFree_v2(CUdeviceptr p) {
  CUresult r = enter("cuMemFree", true);
  fake_ctx *c = current();
  if (r == CUDA_SUCCESS && !c) r = CUDA_ERROR_INVALID_CONTEXT;
  int i = 0;
  while (r == CUDA_SUCCESS && i < n_allocs && allocs[i].va != p) i++;
  if (r == CUDA_SUCCESS && (i == n_allocs || allocs[i].dev != c->dev)) r = CUDA_ERROR_INVALID_VALUE;
  if (r == CUDA_SUCCESS) {
    drain_device(c->dev); /* as the driver, finish what may use it */
    free(allocs[i].host);
    live_bytes[c->dev] -= allocs[i].bytes;
    allocs[i] = allocs[--n_allocs];
  }
  return leave(r);
}

EXPORT CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t bytes, CUstream s) {
  CUresult r = enter("cuMemcpyHtoDAsync", true);
  fake_ctx *c = current();
  if (r == CUDA_SUCCESS && (!c || !translate(dst, bytes, c->dev) || !src)) r = CUDA_ERROR_INVALID_VALUE;
  op *o = NULL;
  if (r == CUDA_SUCCESS && (!(o = calloc(1, sizeof *o)) || !(o->staging = malloc(bytes)))) {
    free(o);
    r = CUDA_ERROR_OUT_OF_MEMORY;
  }
  if (r == CUDA_SUCCESS) { /* pageable source: staged before return, as the driver does */
    memcpy(o->staging, src, bytes);
    o->kind = 0;
    o->dst_dev = dst;
    o->bytes = bytes;
    r = enqueue(s, o);
  }
  return leave(r);
}

EXPORT CUresult cuMemcpyDtoHAsync_v2(void *dst, CUdeviceptr src, size_t bytes, CUstream s) {
  CUresult r = enter("cuMemcpyDtoHAsync", true);
  fake_ctx *c = current();
  if (r == CUDA_SUCCESS && (!c || !translate(src, bytes, c->dev) || !dst)) r = CUDA_ERROR_INVALID_VALUE;
  op *o = NULL;
  if (r == CUDA_SUCCESS && !(o = calloc(1, sizeof *o))) r = CUDA_ERROR_OUT_OF_MEMORY;
  if (r == CUDA_SUCCESS) { /* lands at the next synchronization */
    o->kind = 1;
    o->dst_host = dst;
    o->src_dev = src;
    o->bytes = bytes;
    r = enqueue(s, o);
  }
  return leave(r);
}

EXPORT CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, size_t bytes, CUstream s) {
  CUresult r = enter("cuMemcpyDtoDAsync", true);
  fake_ctx *c = current();
  if (r == CUDA_SUCCESS && (!c || !translate(dst, bytes, c->dev) || !translate(src, bytes, c->dev)))
    r = CUDA_ERROR_INVALID_VALUE;
  op *o = NULL;
  if (r == CUDA_SUCCESS && !(o = calloc(1, sizeof *o))) r = CUDA_ERROR_OUT_OF_MEMORY;
  if (r == CUDA_SUCCESS) {
    o->kind = 2;
    o->dst_dev = dst;
    o->src_dev = src;
    o->bytes = bytes;
    r = enqueue(s, o);
  }
  return leave(r);
}

EXPORT CUresult cuMemcpyPeerAsync(CUdeviceptr dst, CUcontext dst_ctx, CUdeviceptr src, CUcontext src_ctx,
                                  size_t bytes, CUstream s) {
  CUresult r = enter("cuMemcpyPeerAsync", true);
  if (r == CUDA_SUCCESS && (!dst_ctx || !src_ctx || !translate(dst, bytes, ((fake_ctx *)dst_ctx)->dev) ||
                            !translate(src, bytes, ((fake_ctx *)src_ctx)->dev)))
    r = CUDA_ERROR_INVALID_VALUE;
  op *o = NULL;
  if (r == CUDA_SUCCESS && !(o = calloc(1, sizeof *o))) r = CUDA_ERROR_OUT_OF_MEMORY;
  if (r == CUDA_SUCCESS) {
    o->kind = 2;
    o->dst_dev = dst;
    o->src_dev = src;
    o->bytes = bytes;
    r = enqueue(s, o);
  }
  return leave(r);
}

/* ---- cuGetProcAddress: base names to the versions above ---- */

static const struct {
  const char *name;
  void *fn;
} table[] = {
    {"cuGetErrorName", (void *)cuGetErrorName},
    {"cuGetErrorString", (void *)cuGetErrorString},
    {"cuInit", (void *)cuInit},
    {"cuDeviceGetCount", (void *)cuDeviceGetCount},
    {"cuDeviceGet", (void *)cuDeviceGet},
    {"cuDeviceGetName", (void *)cuDeviceGetName},
    {"cuDeviceGetAttribute", (void *)cuDeviceGetAttribute},
    {"cuDeviceTotalMem", (void *)cuDeviceTotalMem_v2},
    {"cuDevicePrimaryCtxRetain", (void *)cuDevicePrimaryCtxRetain},
    {"cuCtxPushCurrent", (void *)cuCtxPushCurrent_v2},
    {"cuCtxPopCurrent", (void *)cuCtxPopCurrent_v2},
    {"cuStreamCreate", (void *)cuStreamCreate},
    {"cuStreamSynchronize", (void *)cuStreamSynchronize},
    {"cuMemAlloc", (void *)cuMemAlloc_v2},
    {"cuMemFree", (void *)cuMemFree_v2},
    {"cuMemcpyHtoDAsync", (void *)cuMemcpyHtoDAsync_v2},
    {"cuMemcpyDtoHAsync", (void *)cuMemcpyDtoHAsync_v2},
    {"cuMemcpyDtoDAsync", (void *)cuMemcpyDtoDAsync_v2},
    {"cuMemcpyPeerAsync", (void *)cuMemcpyPeerAsync},
};

EXPORT CUresult cuGetProcAddress_v2(const char *symbol, void **fn, int version, unsigned long long flags,
                                    int *status) {
  (void)flags;
  leave(enter("cuGetProcAddress", false)); /* counted only */
  *fn = NULL;
  if (status) *status = 1; /* CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND */
  if (env_long("FAKE_CUDA_NO_PROC", 0) || version < 12000) return CUDA_ERROR_NOT_FOUND;
  for (size_t i = 0; i < sizeof table / sizeof table[0]; i++)
    if (strcmp(table[i].name, symbol) == 0) {
      *fn = table[i].fn;
      if (status) *status = 0;
      return CUDA_SUCCESS;
    }
  return CUDA_ERROR_NOT_FOUND;
}
