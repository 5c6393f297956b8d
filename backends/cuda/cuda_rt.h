/* cuda_rt.h — the CUDA device runtime: the driver loaded with dlopen at first
 * use (nothing links against CUDA), one context and one stream per GPU, and a
 * caching device allocator. Internal to the library; lib/ reaches it only
 * through the device_backend hook it registers (lib/runtime.h). */
#ifndef KILN_CUDA_RT_H
#define KILN_CUDA_RT_H

#include <stddef.h>
#include <stdint.h>

#include "compat.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The few driver types Kiln uses, declared here so that building needs no
 * cuda.h; their ABI is fixed (CUdeviceptr is 64-bit since CUDA 3.2). */
typedef int CUresult; /* an enum in cuda.h: 0 = CUDA_SUCCESS */
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef struct CUctx_st *CUcontext;
typedef struct CUstream_st *CUstream;
typedef struct CUmod_st *CUmodule;
typedef struct CUfunc_st *CUfunction;

enum {
  CUDA_SUCCESS = 0,
  CUDA_ERROR_INVALID_VALUE = 1,
  CUDA_ERROR_OUT_OF_MEMORY = 2,
  CUDA_ERROR_NOT_INITIALIZED = 3,
  CUDA_ERROR_STUB_LIBRARY = 34,
  CUDA_ERROR_NO_DEVICE = 100,
  CUDA_ERROR_INVALID_DEVICE = 101,
  CUDA_ERROR_INVALID_IMAGE = 200,
  CUDA_ERROR_INVALID_CONTEXT = 201,
  CUDA_ERROR_INVALID_PTX = 218,
  CUDA_ERROR_INVALID_HANDLE = 400,
  CUDA_ERROR_NOT_FOUND = 500,
  CUDA_ERROR_ILLEGAL_ADDRESS = 700,
  CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES = 701,
  CUDA_ERROR_LAUNCH_FAILED = 719,
  CUDA_ERROR_NOT_SUPPORTED = 801,
  CUDA_ERROR_UNKNOWN = 999,
};
enum {
  CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75,
  CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 76,
};
enum { CU_STREAM_NON_BLOCKING = 1 };

/* The most GPUs listed (t->device is gpu + 1 and lib's kernel table has
 * KILN_MAX_DEVICES = 16 columns, cpu:0 included). */
#define CUDA_MAX_GPUS 15

/* ---- the driver (driver.c) ---- */

/* Entry points: X(required, name, exported symbol, parameters). Each is
 * resolved through cuGetProcAddress (the driver picks the ABI version for
 * CUDA 12.0), or by its versioned symbol with dlsym where that fails. */
#define CUDA_ENTRY_POINTS(X)                                                                      \
  X(1, cuGetErrorName, cuGetErrorName, (CUresult, const char **))                                 \
  X(1, cuGetErrorString, cuGetErrorString, (CUresult, const char **))                             \
  X(1, cuInit, cuInit, (unsigned))                                                                \
  X(1, cuDeviceGetCount, cuDeviceGetCount, (int *))                                               \
  X(1, cuDeviceGet, cuDeviceGet, (CUdevice *, int))                                               \
  X(1, cuDeviceGetName, cuDeviceGetName, (char *, int, CUdevice))                                 \
  X(1, cuDeviceGetAttribute, cuDeviceGetAttribute, (int *, int, CUdevice))                        \
  X(1, cuDeviceTotalMem, cuDeviceTotalMem_v2, (size_t *, CUdevice))                               \
  X(1, cuDevicePrimaryCtxRetain, cuDevicePrimaryCtxRetain, (CUcontext *, CUdevice))               \
  X(1, cuCtxPushCurrent, cuCtxPushCurrent_v2, (CUcontext))                                        \
  X(1, cuCtxPopCurrent, cuCtxPopCurrent_v2, (CUcontext *))                                        \
  X(1, cuStreamCreate, cuStreamCreate, (CUstream *, unsigned))                                    \
  X(1, cuStreamSynchronize, cuStreamSynchronize, (CUstream))                                      \
  X(1, cuMemAlloc, cuMemAlloc_v2, (CUdeviceptr *, size_t))                                        \
  X(1, cuMemFree, cuMemFree_v2, (CUdeviceptr))                                                    \
  X(1, cuMemcpyHtoDAsync, cuMemcpyHtoDAsync_v2, (CUdeviceptr, const void *, size_t, CUstream))    \
  X(1, cuMemcpyDtoHAsync, cuMemcpyDtoHAsync_v2, (void *, CUdeviceptr, size_t, CUstream))          \
  X(1, cuMemcpyDtoDAsync, cuMemcpyDtoDAsync_v2, (CUdeviceptr, CUdeviceptr, size_t, CUstream))     \
  X(1, cuMemcpyPeerAsync, cuMemcpyPeerAsync,                                                      \
    (CUdeviceptr, CUcontext, CUdeviceptr, CUcontext, size_t, CUstream))                           \
  /* for the code generator; a driver without them still lists its GPUs */                        \
  X(0, cuModuleLoadData, cuModuleLoadData, (CUmodule *, const void *))                            \
  X(0, cuModuleGetFunction, cuModuleGetFunction, (CUfunction *, CUmodule, const char *))          \
  X(0, cuModuleUnload, cuModuleUnload, (CUmodule))                                                \
  X(0, cuLaunchKernel, cuLaunchKernel,                                                            \
    (CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, CUstream,  \
     void **, void **))                                                                           \
  X(0, cuMemsetD8Async, cuMemsetD8Async, (CUdeviceptr, unsigned char, size_t, CUstream))

typedef struct cuda_api {
#define CUDA_FIELD(req, name, sym, params) CUresult (*name) params;
  CUDA_ENTRY_POINTS(CUDA_FIELD)
#undef CUDA_FIELD
} cuda_api;
/* The driver's entry points; filled once cuda_device_count() > 0. */
extern cuda_api cuda_drv;

/* Loads the driver on the first call (KILN_CUDA_DRIVER=/path overrides
 * "libcuda.so.1") and returns the GPUs it lists; 0 when there is no driver,
 * a stub driver or no device — never an error. Thread-safe. */
int cuda_device_count(void);
/* Why no GPU is listed ("" when some are): "cannot load libcuda.so.1: ...". */
KILN_EXPORT const char *kiln_debug_cuda_status(void);

typedef struct cuda_device_info {
  char name[256]; /* "NVIDIA H100 80GB HBM3" */
  int cc_major, cc_minor;
  size_t total_bytes;
} cuda_device_info;
/* The device's name, compute capability and memory. 0, or -1 (gpu out of range). */
KILN_EXPORT int kiln_debug_cuda_device(int gpu, cuda_device_info *out);

/* Sets the error "op: CUDA_ERROR_NAME: description" for a failed driver
 * call (what, when not NULL, is appended in parentheses); returns -1. */
int cuda_fail(const char *op, CUresult r, const char *what);

/* Makes gpu's context current on this thread (creating the context and its
 * stream on first use) and hands back its stream; pair with cuda_leave.
 * -1 with "op: ..." on failure (then no cuda_leave). */
int cuda_enter(const char *op, int gpu, CUstream *stream);
void cuda_leave(void);

/* Waits for everything queued on gpu's stream. 0, or -1 with "op: ...". */
int cuda_sync(const char *op, int gpu);

/* Copies bytes between host (gpu -1) and device memory, in stream order.
 * From the host it may return before the copy ends (the driver has taken
 * the source); to the host it returns once dst holds the data. 0 / -1. */
int cuda_copy(const char *op, int dst_gpu, void *dst, int src_gpu, const void *src, size_t bytes);

/* For benchmarks: waits for gpu's stream (what timing needs), and a
 * device-to-device copy of bytes on gpu (cuMemcpyDtoDAsync on its stream,
 * as tensors' copies are queued). 0, or -1 with "cuda_sync: ..." /
 * "cuda_copy: ...". */
KILN_EXPORT int kiln_debug_cuda_sync(int gpu);
KILN_EXPORT int kiln_debug_cuda_copy(int gpu, void *dst, const void *src, size_t bytes);

/* ---- the caching allocator (alloc.c) ----
 * Blocks come in size classes (four per power of two from 512 bytes); a
 * freed block goes back to its class's list and the next allocation of that
 * class takes it without calling the driver. All work on a GPU is ordered on
 * its one stream, so a block freed while a copy that uses it is still queued
 * can be handed out at once: the next user's work queues after it. When the
 * driver runs out of memory the cache is returned to it and the allocation
 * retried once. */

/* A device pointer (as void *) of at least bytes on gpu (0 counts as 1)
 * and its class. NULL with "op: ..." on failure. */
KILN_EXPORT void *cuda_alloc(const char *op, int gpu, size_t bytes, int32_t *cls); /* exported for the tests */
KILN_EXPORT void cuda_free(int gpu, void *p, int32_t cls); /* NULL is fine */

typedef struct cuda_mem_stats {
  size_t in_use;           /* bytes of blocks handed out (class sizes) */
  size_t cached;           /* bytes of freed blocks kept for reuse */
  size_t peak_in_use;
  int64_t driver_allocs;   /* cuMemAlloc calls that succeeded */
  int64_t driver_frees;    /* cuMemFree calls */
  int64_t reuses;          /* allocations served from the cache */
} cuda_mem_stats;
/* The allocator's figures for gpu. 0, or -1 (gpu out of range). */
KILN_EXPORT int kiln_debug_cuda_memory(int gpu, cuda_mem_stats *out);
/* Returns gpu's cached blocks to the driver (after its stream drains). 0 / -1. */
KILN_EXPORT int kiln_debug_cuda_trim(int gpu);
int cuda_trim(const char *op, int gpu);

/* ---- running compiled programs (launch.c, eager.c) ---- */
struct cuda_program;
struct kiln_tensor;

/* "sm_90" for a GPU of compute capability 9.x, else "sm_80". */
KILN_EXPORT const char *cuda_arch_of(int gpu);
/* Runs p (from cuda_compile, for gpu's architecture) on gpu: arguments on
 * other devices are copied there, results are new tensors on gpu owned as
 * op results are. The PTX is loaded on the GPU's first run (module and
 * functions kept in p); kernels are queued on the GPU's stream in schedule
 * order over a device arena, and the call returns before they end unless a
 * kernel can fail (gather, scatter_add, integer division), a host step
 * (random draws, host callbacks) runs, or a check needs the data: then the
 * error word is read back and turned into the eager op's message. Driver
 * failures read "cuda: @f: kernel3 (add): CUDA_ERROR_...". 0 / -1. */
KILN_EXPORT int cuda_program_run(struct cuda_program *p, int gpu, struct kiln_tensor *const *args,
                                 struct kiln_tensor **results);
/* cuda_program_run over device pointers on gpu (params, results: one per
 * parameter and result of p; results must be CUDA_RES_OWN). 0 / -1. */
KILN_EXPORT int cuda_program_launch(struct cuda_program *p, int gpu, void *const *params, void *const *results);

/* The eager GPU kernels' cache (eager.c): single-op programs compiled once
 * per (op, attributes, input types, architecture). */
typedef struct cuda_eager_stats {
  int64_t compiles; /* programs compiled (cache misses) */
  int64_t hits;     /* calls served from the cache */
  int64_t entries;
  int64_t disk_hits; /* of the compiles: PTX read from the disk cache (ptx.h) */
} cuda_eager_stats;
KILN_EXPORT void kiln_debug_cuda_eager_stats(cuda_eager_stats *out);

#ifdef __cplusplus
}
#endif
#endif
