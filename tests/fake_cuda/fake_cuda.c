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
 * fake_cuda_ctx_depth().
 *
 * Modules: cuModuleLoadData takes PTX text (.version, .target and .entry
 * lines) and records each kernel's name and parameter count; it refuses a
 * .target newer than the device. Kernels cannot run here: cuLaunchKernel
 * checks its arguments (the function's module on the current context's
 * device, the stream, the launch shape, every pointer parameter 0 or memory
 * of that device) and records the launch (its pointer values included);
 * scripted launches store given values into a parameter's memory, in stream
 * order, standing in for what the kernel would compute (a loop's
 * predicate, an error word); fake_cuda.h lists what tests can read and
 * inject. */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda/cuda_rt.h"
#include "fake_cuda.h"

#define EXPORT __attribute__((visibility("default")))
#define FAKE_BASE 0xdead00000000ull /* above the 47-bit user space: never a host address */
#define MAX_DEVICES 8

typedef struct fake_ctx {
  int dev;
} fake_ctx;

typedef struct op {
  struct op *next;
  int kind; /* 0 to device from staging, 1 to host, 2 device to device, 3 memset to bytes[0]'s value */
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
    "cuModuleLoadData", "cuModuleGetFunction", "cuModuleUnload", "cuLaunchKernel", "cuMemsetD8Async",
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
    } else if (o->kind == 3) {
      unsigned char *d = translate(o->dst_dev, o->bytes, dev);
      if (d) memset(d, o->staging[0], o->bytes);
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
    {CUDA_ERROR_INVALID_IMAGE, "CUDA_ERROR_INVALID_IMAGE", "device kernel image is invalid"},
    {CUDA_ERROR_INVALID_PTX, "CUDA_ERROR_INVALID_PTX", "a PTX JIT compilation failed"},
    {CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES, "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES", "too many resources requested for launch"},
    {CUDA_ERROR_LAUNCH_FAILED, "CUDA_ERROR_LAUNCH_FAILED", "unspecified launch failure"},
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

EXPORT CUresult cuMemsetD8Async(CUdeviceptr dst, unsigned char value, size_t bytes, CUstream s) {
  CUresult r = enter("cuMemsetD8Async", true);
  fake_ctx *c = current();
  if (r == CUDA_SUCCESS && (!c || !translate(dst, bytes, c->dev))) r = CUDA_ERROR_INVALID_VALUE;
  op *o = NULL;
  if (r == CUDA_SUCCESS && (!(o = calloc(1, sizeof *o)) || !(o->staging = malloc(1)))) {
    free(o);
    r = CUDA_ERROR_OUT_OF_MEMORY;
  }
  if (r == CUDA_SUCCESS) {
    o->kind = 3;
    o->staging[0] = value;
    o->dst_dev = dst;
    o->bytes = bytes;
    r = enqueue(s, o);
  }
  return leave(r);
}

/* ---- modules and launches ---- */

typedef struct CUfunc_st {
  struct CUmod_st *mod;
  char name[64];
  int n_params;
} fake_func;

typedef struct CUmod_st {
  int dev;
  bool live;
  int n_fns;
  fake_func *fns;
  struct CUmod_st *next_mod; /* every module ever loaded: handles stay checkable */
} fake_module;

static fake_module *modules;
static fake_launch *launch_log;
static int n_launches, cap_launches;
static char fail_name[64], write_name[64];
static bool fail_any;
static CUresult fail_code;
static int write_value;

typedef struct {
  char name[64]; /* "" when unused */
  int param, width, n, at;
  int *values;
} script;
static script scripts[8];

EXPORT int fake_cuda_launch_count(void) {
  pthread_mutex_lock(&lock);
  int n = n_launches;
  pthread_mutex_unlock(&lock);
  return n;
}

EXPORT int fake_cuda_launch_get(int i, fake_launch *out) {
  pthread_mutex_lock(&lock);
  int rc = i >= 0 && i < n_launches ? 0 : -1;
  if (!rc) *out = launch_log[i];
  pthread_mutex_unlock(&lock);
  return rc;
}

EXPORT void fake_cuda_launch_clear(void) {
  pthread_mutex_lock(&lock);
  n_launches = 0;
  pthread_mutex_unlock(&lock);
}

EXPORT void fake_cuda_fail_launch(const char *name, int code) {
  pthread_mutex_lock(&lock);
  fail_code = (CUresult)code;
  fail_any = !name;
  snprintf(fail_name, sizeof fail_name, "%s", name ? name : "");
  pthread_mutex_unlock(&lock);
}

EXPORT void fake_cuda_launch_write(const char *name, int value) {
  pthread_mutex_lock(&lock);
  snprintf(write_name, sizeof write_name, "%s", name ? name : "");
  write_value = value;
  pthread_mutex_unlock(&lock);
}

EXPORT void fake_cuda_launch_script(const char *name, int param, int width, const int *values, int n) {
  pthread_mutex_lock(&lock);
  for (int i = 0; i < 8; i++) /* the kernel's old script (or every one) ends */
    if (scripts[i].name[0] && (!name || strcmp(scripts[i].name, name) == 0)) {
      free(scripts[i].values);
      memset(&scripts[i], 0, sizeof scripts[i]);
    }
  for (int i = 0; name && n > 0 && values && i < 8; i++) {
    if (scripts[i].name[0]) continue;
    script *sc = &scripts[i];
    if (!(sc->values = malloc((size_t)n * sizeof *sc->values))) break;
    memcpy(sc->values, values, (size_t)n * sizeof *sc->values);
    snprintf(sc->name, sizeof sc->name, "%s", name);
    sc->param = param, sc->width = width == 1 ? 1 : 4, sc->n = n, sc->at = 0;
    break;
  }
  pthread_mutex_unlock(&lock);
}

/* queues a store of width bytes of value at dst on s (as the kernel's own
 * store would be ordered); CUDA_ERROR_ILLEGAL_ADDRESS where dst is no
 * memory of dev */
static CUresult queue_store(fake_stream *s, int dev, CUdeviceptr dst, int width, int value) {
  op *o = calloc(1, sizeof *o);
  unsigned char *v = o ? malloc(sizeof(int)) : NULL;
  if (!o || !v || !translate(dst, (size_t)width, dev)) {
    free(o);
    free(v);
    return CUDA_ERROR_ILLEGAL_ADDRESS;
  }
  if (width == 1)
    v[0] = (unsigned char)value;
  else
    memcpy(v, &value, sizeof(int));
  o->kind = 0;
  o->staging = v;
  o->dst_dev = dst;
  o->bytes = (size_t)width;
  return enqueue(s, o);
}

EXPORT int fake_cuda_modules_live(void) {
  pthread_mutex_lock(&lock);
  int n = 0;
  for (fake_module *m = modules; m; m = m->next_mod) n += m->live;
  pthread_mutex_unlock(&lock);
  return n;
}

static char *last_ptx; /* the text of the last module loaded (under lock: enter/leave) */

EXPORT size_t fake_cuda_last_ptx(char *buf, size_t n) {
  pthread_mutex_lock(&lock);
  size_t len = last_ptx ? strlen(last_ptx) : 0;
  if (buf && n) snprintf(buf, n, "%s", last_ptx ? last_ptx : "");
  pthread_mutex_unlock(&lock);
  return len;
}

/* The sm number of a ".target sm_XY" line, or -1. */
static int ptx_target(const char *text) {
  const char *t = strstr(text, ".target");
  if (!t) return -1;
  t += 7;
  while (*t == ' ' || *t == '\t') t++;
  return strncmp(t, "sm_", 3) == 0 ? atoi(t + 3) : -1;
}

/* The .entry functions of PTX text: names and parameter counts. */
static CUresult ptx_entries(const char *text, fake_module *m) {
  for (const char *e = strstr(text, ".entry"); e; e = strstr(e + 6, ".entry")) {
    const char *p = e + 6;
    while (*p == ' ' || *p == '\t') p++;
    size_t len = strcspn(p, " \t\n(");
    if (!len || len >= sizeof m->fns[0].name) return CUDA_ERROR_INVALID_PTX;
    const char *open = strchr(p, '('), *close = open ? strchr(open, ')') : NULL;
    if (!close) return CUDA_ERROR_INVALID_PTX;
    fake_func *q = realloc(m->fns, (size_t)(m->n_fns + 1) * sizeof *q);
    if (!q) return CUDA_ERROR_OUT_OF_MEMORY;
    m->fns = q;
    fake_func *f = &m->fns[m->n_fns++];
    memset(f, 0, sizeof *f);
    memcpy(f->name, p, len);
    for (const char *a = strstr(open, ".param"); a && a < close; a = strstr(a + 6, ".param")) f->n_params++;
  }
  return CUDA_SUCCESS;
}

EXPORT CUresult cuModuleLoadData(CUmodule *mod, const void *image) {
  CUresult r = enter("cuModuleLoadData", true);
  fake_ctx *c = current();
  if (r == CUDA_SUCCESS && !c) r = CUDA_ERROR_INVALID_CONTEXT;
  const char *text = image;
  if (r == CUDA_SUCCESS && (!mod || !text)) r = CUDA_ERROR_INVALID_VALUE;
  if (r == CUDA_SUCCESS && (!strstr(text, ".version") || ptx_target(text) < 0)) r = CUDA_ERROR_INVALID_IMAGE;
  /* device 0 is 9.0, the others 8.0 (cuDeviceGetAttribute) */
  if (r == CUDA_SUCCESS && ptx_target(text) > (c->dev == 0 ? 90 : 80)) r = CUDA_ERROR_INVALID_PTX;
  fake_module *m = NULL;
  if (r == CUDA_SUCCESS && !(m = calloc(1, sizeof *m))) r = CUDA_ERROR_OUT_OF_MEMORY;
  if (r == CUDA_SUCCESS && (r = ptx_entries(text, m)) != CUDA_SUCCESS) {
    free(m->fns);
    free(m);
  }
  if (r == CUDA_SUCCESS) {
    free(last_ptx);
    last_ptx = strdup(text);
    for (int i = 0; i < m->n_fns; i++) m->fns[i].mod = m;
    m->dev = c->dev;
    m->live = true;
    m->next_mod = modules;
    modules = m;
    *mod = m;
  }
  return leave(r);
}

static bool module_ok(const fake_module *m) {
  for (fake_module *q = modules; q; q = q->next_mod)
    if (q == m) return q->live;
  return false;
}

EXPORT CUresult cuModuleGetFunction(CUfunction *fn, CUmodule mod, const char *name) {
  CUresult r = enter("cuModuleGetFunction", true);
  if (r == CUDA_SUCCESS && (!fn || !name || !module_ok(mod))) r = CUDA_ERROR_INVALID_HANDLE;
  if (r == CUDA_SUCCESS) {
    r = CUDA_ERROR_NOT_FOUND;
    for (int i = 0; i < mod->n_fns; i++)
      if (strcmp(mod->fns[i].name, name) == 0) {
        *fn = &mod->fns[i];
        r = CUDA_SUCCESS;
      }
  }
  return leave(r);
}

EXPORT CUresult cuModuleUnload(CUmodule mod) {
  CUresult r = enter("cuModuleUnload", true);
  fake_ctx *c = current();
  if (r == CUDA_SUCCESS && !c) r = CUDA_ERROR_INVALID_CONTEXT;
  if (r == CUDA_SUCCESS && !module_ok(mod)) r = CUDA_ERROR_INVALID_HANDLE;
  if (r == CUDA_SUCCESS && mod->dev != c->dev) r = CUDA_ERROR_INVALID_CONTEXT;
  if (r == CUDA_SUCCESS) mod->live = false; /* the record stays: a stale handle is then caught */
  return leave(r);
}

EXPORT CUresult cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                               unsigned bz, unsigned shared, CUstream s, void **params, void **extra) {
  CUresult r = enter("cuLaunchKernel", true);
  fake_ctx *c = current();
  if (r == CUDA_SUCCESS && !c) r = CUDA_ERROR_INVALID_CONTEXT;
  if (r == CUDA_SUCCESS && (!f || !module_ok(f->mod))) r = CUDA_ERROR_INVALID_HANDLE;
  if (r == CUDA_SUCCESS && f->mod->dev != c->dev) r = CUDA_ERROR_INVALID_CONTEXT;
  if (r == CUDA_SUCCESS && (!s || s->ctx != c)) r = CUDA_ERROR_INVALID_HANDLE;
  if (r == CUDA_SUCCESS && (!gx || !gy || !gz || !bx || !by || !bz || gy > 65535 || gz > 65535))
    r = CUDA_ERROR_INVALID_VALUE;
  if (r == CUDA_SUCCESS && ((unsigned long)bx * by * bz > 1024 || shared > 48 * 1024))
    r = CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES;
  if (r == CUDA_SUCCESS && ((f->n_params && !params) || extra)) r = CUDA_ERROR_INVALID_VALUE;
  if (r == CUDA_SUCCESS && (fail_any || (fail_name[0] && strcmp(fail_name, f->name) == 0)) && fail_code)
    r = fail_code;
  if (r == CUDA_SUCCESS && n_launches == cap_launches) {
    int cap = cap_launches ? 2 * cap_launches : 64;
    fake_launch *q = realloc(launch_log, (size_t)cap * sizeof *q);
    if (!q) r = CUDA_ERROR_OUT_OF_MEMORY;
    else launch_log = q, cap_launches = cap;
  }
  if (r == CUDA_SUCCESS) {
    fake_launch *l = &launch_log[n_launches++];
    memset(l, 0, sizeof *l);
    snprintf(l->name, sizeof l->name, "%s", f->name);
    l->dev = c->dev;
    l->grid[0] = gx, l->grid[1] = gy, l->grid[2] = gz;
    l->block[0] = bx, l->block[1] = by, l->block[2] = bz;
    l->shared_bytes = shared;
    l->n_params = f->n_params;
    for (int i = 0; i < f->n_params; i++) { /* every Kiln kernel parameter is a pointer */
      CUdeviceptr p = *(const CUdeviceptr *)params[i];
      if (p && !translate(p, 1, c->dev)) l->bad_params++;
      if (i < 16) l->ptr[i] = p;
    }
    if (write_name[0] && strcmp(write_name, f->name) == 0 && f->n_params)
      r = queue_store(s, c->dev, *(const CUdeviceptr *)params[f->n_params - 1], 4, write_value);
    for (int i = 0; r == CUDA_SUCCESS && i < 8; i++) {
      script *sc = &scripts[i];
      if (!sc->name[0] || strcmp(sc->name, f->name) != 0) continue;
      int q = sc->param < 0 ? f->n_params + sc->param : sc->param;
      int v = sc->values[sc->at < sc->n ? sc->at : sc->n - 1];
      sc->at++;
      if (q < 0 || q >= f->n_params) r = CUDA_ERROR_INVALID_VALUE;
      else if (v != FAKE_CUDA_SKIP) r = queue_store(s, c->dev, *(const CUdeviceptr *)params[q], sc->width, v);
    }
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
    {"cuMemsetD8Async", (void *)cuMemsetD8Async},
    {"cuModuleLoadData", (void *)cuModuleLoadData},
    {"cuModuleGetFunction", (void *)cuModuleGetFunction},
    {"cuModuleUnload", (void *)cuModuleUnload},
    {"cuLaunchKernel", (void *)cuLaunchKernel},
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
