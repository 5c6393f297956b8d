/* driver.c — the CUDA driver, opened with dlopen at first use so that Kiln
 * builds and runs where CUDA is absent (TOOLCHAIN.md); GPUs listed, one
 * primary context and one stream per GPU, driver errors as Kiln errors, and
 * the device_backend that lib/ calls for GPU tensors. */
#include <dlfcn.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>

#include "runtime.h"
#include "cuda_rt.h"

cuda_api cuda_drv;

typedef struct {
  CUdevice dev;
  cuda_device_info info;
  pthread_mutex_t lock;  /* first use: creating the context and stream */
  atomic_bool open;      /* ctx and stream are made */
  CUcontext ctx;
  CUstream stream;
} gpu_state;

static gpu_state gpus[CUDA_MAX_GPUS];
static int n_gpus;
static char status[512]; /* why no GPU is listed */
static pthread_once_t load_once = PTHREAD_ONCE_INIT;

/* cuGetProcAddress_v2 (CUDA >= 12.0) */
typedef CUresult (*get_proc_fn)(const char *symbol, void **fn, int version, unsigned long long flags,
                                int *symbol_status);

static void *resolve(void *lib, get_proc_fn get_proc, const char *name, const char *symbol) {
  void *fn = NULL;
  int found = 0;
  if (get_proc && get_proc(name, &fn, 12000, 0 /* CU_GET_PROC_ADDRESS_DEFAULT */, &found) == CUDA_SUCCESS && fn)
    return fn;
  return dlsym(lib, symbol);
}

static const char *error_name(CUresult r) {
  const char *s = NULL;
  return cuda_drv.cuGetErrorName && cuda_drv.cuGetErrorName(r, &s) == CUDA_SUCCESS && s ? s : NULL;
}

static const char *error_string(CUresult r) {
  const char *s = NULL;
  return cuda_drv.cuGetErrorString && cuda_drv.cuGetErrorString(r, &s) == CUDA_SUCCESS && s ? s : "";
}

int cuda_fail(const char *op, CUresult r, const char *what) {
  const char *name = error_name(r);
  char code[32];
  if (!name) {
    snprintf(code, sizeof code, "CUDA error %d", (int)r);
    name = code;
  }
  const char *desc = error_string(r);
  return kiln_set_error("%s: %s%s%s%s%s%s", op, name, *desc ? ": " : "", desc, what ? " (" : "",
                        what ? what : "", what ? ")" : "");
}

/* Lists the devices; any failure leaves status saying why and no GPU. */
static void driver_load(void) {
  const char *path = getenv("KILN_CUDA_DRIVER");
  if (!path || !*path) path = "libcuda.so.1";
  void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    const char *e = dlerror();
    snprintf(status, sizeof status, "cannot load the CUDA driver: %s", e ? e : path);
    return;
  }
  get_proc_fn get_proc = (get_proc_fn)dlsym(lib, "cuGetProcAddress_v2");
  const char *missing = NULL;
#define CUDA_RESOLVE(req, name, sym, params)                              \
  cuda_drv.name = (CUresult(*) params)resolve(lib, get_proc, #name, #sym); \
  if (req && !cuda_drv.name && !missing) missing = #sym;
  CUDA_ENTRY_POINTS(CUDA_RESOLVE)
#undef CUDA_RESOLVE
  CUresult r = CUDA_SUCCESS;
  int n = 0;
  if (missing) {
    snprintf(status, sizeof status, "%s has no entry point %s", path, missing);
    goto fail;
  }
  if ((r = cuda_drv.cuInit(0)) == CUDA_ERROR_STUB_LIBRARY) {
    snprintf(status, sizeof status, "%s is the CUDA toolkit's stub library, not a driver", path);
    goto fail;
  }
  if (r == CUDA_ERROR_NO_DEVICE || (r == CUDA_SUCCESS && (r = cuda_drv.cuDeviceGetCount(&n)) == CUDA_SUCCESS && n <= 0)) {
    snprintf(status, sizeof status, "the CUDA driver finds no device");
    goto fail;
  }
  if (r != CUDA_SUCCESS) goto driver_error;
  if (n > CUDA_MAX_GPUS) n = CUDA_MAX_GPUS;
  for (int i = 0; i < n; i++) {
    gpu_state *g = &gpus[i];
    cuda_device_info *d = &g->info;
    if ((r = cuda_drv.cuDeviceGet(&g->dev, i)) || (r = cuda_drv.cuDeviceGetName(d->name, sizeof d->name, g->dev)) ||
        (r = cuda_drv.cuDeviceGetAttribute(&d->cc_major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, g->dev)) ||
        (r = cuda_drv.cuDeviceGetAttribute(&d->cc_minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, g->dev)) ||
        (r = cuda_drv.cuDeviceTotalMem(&d->total_bytes, g->dev)))
      goto driver_error;
    d->name[sizeof d->name - 1] = '\0';
    pthread_mutex_init(&g->lock, NULL);
  }
  n_gpus = n;
  return;
driver_error: {
  const char *name = error_name(r);
  snprintf(status, sizeof status, "listing the devices of %s failed: %s%s%s", path, name ? name : "CUDA error",
           name ? ": " : "", error_string(r));
}
fail:
  memset(&cuda_drv, 0, sizeof cuda_drv);
  dlclose(lib);
}

int cuda_device_count(void) {
  pthread_once(&load_once, driver_load);
  return n_gpus;
}

const char *kiln_debug_cuda_status(void) {
  cuda_device_count();
  return status;
}

int kiln_debug_cuda_device(int gpu, cuda_device_info *out) {
  if (gpu < 0 || gpu >= cuda_device_count() || !out) return -1;
  *out = gpus[gpu].info;
  return 0;
}

/* First use of a GPU: its primary context (shared with any other CUDA code
 * in the process, as the runtime API's is) and a stream that does not wait
 * for the legacy default stream. */
static int gpu_open(const char *op, int gpu) {
  gpu_state *g = &gpus[gpu];
  char what[64];
  CUresult r = CUDA_SUCCESS;
  pthread_mutex_lock(&g->lock);
  if (!atomic_load_explicit(&g->open, memory_order_acquire)) {
    CUcontext popped;
    if ((r = cuda_drv.cuDevicePrimaryCtxRetain(&g->ctx, g->dev)) == CUDA_SUCCESS &&
        (r = cuda_drv.cuCtxPushCurrent(g->ctx)) == CUDA_SUCCESS) {
      r = cuda_drv.cuStreamCreate(&g->stream, CU_STREAM_NON_BLOCKING);
      cuda_drv.cuCtxPopCurrent(&popped);
    }
    if (r == CUDA_SUCCESS) atomic_store_explicit(&g->open, true, memory_order_release);
  }
  pthread_mutex_unlock(&g->lock);
  if (r == CUDA_SUCCESS) return 0;
  snprintf(what, sizeof what, "opening gpu:%d", gpu);
  return cuda_fail(op, r, what);
}

int cuda_enter(const char *op, int gpu, CUstream *stream) {
  gpu_state *g = &gpus[gpu];
  if (!atomic_load_explicit(&g->open, memory_order_acquire) && gpu_open(op, gpu)) return -1;
  CUresult r = cuda_drv.cuCtxPushCurrent(g->ctx);
  if (r != CUDA_SUCCESS) return cuda_fail(op, r, "cuCtxPushCurrent");
  if (stream) *stream = g->stream;
  return 0;
}

void cuda_leave(void) {
  CUcontext popped;
  cuda_drv.cuCtxPopCurrent(&popped);
}

int cuda_sync(const char *op, int gpu) {
  CUstream s;
  if (cuda_enter(op, gpu, &s)) return -1;
  CUresult r = cuda_drv.cuStreamSynchronize(s);
  cuda_leave();
  return r == CUDA_SUCCESS ? 0 : cuda_fail(op, r, "cuStreamSynchronize");
}

int kiln_debug_cuda_sync(int gpu) {
  if (gpu < 0 || gpu >= cuda_device_count()) return kiln_set_error("cuda_sync: no gpu:%d", gpu);
  return cuda_sync("cuda_sync", gpu);
}

int kiln_debug_cuda_copy(int gpu, void *dst, const void *src, size_t bytes) {
  if (gpu < 0 || gpu >= cuda_device_count()) return kiln_set_error("cuda_copy: no gpu:%d", gpu);
  if (bytes && (!dst || !src)) return kiln_set_error("cuda_copy: a NULL buffer");
  return cuda_copy("cuda_copy", gpu, dst, gpu, src, bytes);
}

/* Between two GPUs: the source's stream has drained first, and the copy
 * has ended before return, so neither side's cache can hand its block to
 * new work while the other stream still uses it. */
static int copy_peer(const char *op, int dst_gpu, CUdeviceptr dst, int src_gpu, CUdeviceptr src, size_t bytes) {
  CUstream s;
  if (cuda_sync(op, src_gpu) || cuda_enter(op, dst_gpu, &s)) return -1;
  CUresult r = cuda_drv.cuMemcpyPeerAsync(dst, gpus[dst_gpu].ctx, src, gpus[src_gpu].ctx, bytes, s);
  if (r == CUDA_SUCCESS) r = cuda_drv.cuStreamSynchronize(s);
  cuda_leave();
  return r == CUDA_SUCCESS ? 0 : cuda_fail(op, r, "copying between GPUs");
}

int cuda_copy(const char *op, int dst_gpu, void *dst, int src_gpu, const void *src, size_t bytes) {
  CUdeviceptr d = (CUdeviceptr)(uintptr_t)dst, s = (CUdeviceptr)(uintptr_t)src;
  if (!bytes) return 0;
  if (dst_gpu >= 0 && src_gpu >= 0 && dst_gpu != src_gpu) return copy_peer(op, dst_gpu, d, src_gpu, s, bytes);
  int gpu = dst_gpu >= 0 ? dst_gpu : src_gpu;
  CUstream stream;
  if (cuda_enter(op, gpu, &stream)) return -1;
  CUresult r;
  const char *what;
  if (src_gpu < 0) {
    /* from pageable host memory the driver has staged the source on return */
    r = cuda_drv.cuMemcpyHtoDAsync(d, src, bytes, stream);
    what = "copying to the GPU";
  } else if (dst_gpu < 0) {
    r = cuda_drv.cuMemcpyDtoHAsync(dst, s, bytes, stream);
    if (r == CUDA_SUCCESS) r = cuda_drv.cuStreamSynchronize(stream); /* dst is read next */
    what = "copying from the GPU";
  } else {
    r = cuda_drv.cuMemcpyDtoDAsync(d, s, bytes, stream);
    what = "copying on the GPU";
  }
  cuda_leave();
  return r == CUDA_SUCCESS ? 0 : cuda_fail(op, r, what);
}

/* lib/ sees GPUs through this from load time; nothing here runs until a
 * device is named (the constructor only stores a pointer). */
static const device_backend cuda_backend = {
    .count = cuda_device_count,
    .status = kiln_debug_cuda_status,
    .alloc = cuda_alloc,
    .free = cuda_free,
    .copy = cuda_copy,
};

static KILN_CONSTRUCTOR void cuda_register(void) { device_register(&cuda_backend); }
