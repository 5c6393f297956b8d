/* runtime.h — the tensor runtime shared by every file of lib/: the tensor
 * struct, the allocator, errors, scopes, devices and the thread pool.
 * Internal: only include/kiln.h is public. */
#ifndef KILN_RUNTIME_H
#define KILN_RUNTIME_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <string.h>

#include "compat.h"
#include "kiln.h"

#define KILN_ALIGN 64

enum { TF_SYMBOLIC = 1 }; /* kiln_tensor.flags */

struct kiln_tensor {
  atomic_int refs;
  uint8_t dtype;   /* kiln_dtype */
  int8_t rank;
  uint8_t device;  /* index into the device list; 0 = cpu:0 */
  uint8_t flags;   /* TF_* */
  int32_t mem_class; /* allocator class of this block (see alloc.c) */
  int64_t size;      /* number of elements */
  int64_t shape[KILN_MAX_RANK];
  void *data;        /* 64-byte aligned; inside this block, in base, or separate */
  kiln_tensor *base; /* a view's owner of data (retained), else NULL */
  void *data_block;  /* separately allocated data, else NULL */
  int32_t data_class;
  void *sym;         /* the tracer's value when TF_SYMBOLIC (staging issue) */
  /* distinct for every tensor made and renewed by every write over its data
   * (a staged call's donation): what a cache of data derived from the
   * tensor's keys on (conv_cache.c), since an address is reused */
  uint64_t serial;
};

/* A serial no tensor had before (tensor.c). */
uint64_t tensor_new_serial(void);

/* ---- dtypes ---- */
extern const uint8_t kiln_dtype_sizes[KILN_DTYPE_COUNT];
static inline bool dtype_valid(int dt) { return dt >= 0 && dt < KILN_DTYPE_COUNT; }
static inline bool dtype_is_float(kiln_dtype dt) { return dt == KILN_F32 || dt == KILN_F64; }
static inline bool dtype_is_int(kiln_dtype dt) { return dt == KILN_I32 || dt == KILN_I64; }
/* the bits of a float and back, without aliasing trouble */
static inline uint32_t f32_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}
static inline float bits_f32(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}
/* element i of t's data as double (any dtype, f16/bf16 included) */
double dtype_load(kiln_dtype dt, const void *data, int64_t i);
/* stores v into element i, converting as kiln_cast does */
void dtype_store(kiln_dtype dt, void *data, int64_t i, double v);
float kiln_f16_to_f32(uint16_t h);
uint16_t kiln_f32_to_f16(float f); /* round to nearest even */
float kiln_bf16_to_f32(uint16_t h);
uint16_t kiln_f32_to_bf16(float f); /* round to nearest even */

/* ---- errors (error.c) ---- */
/* Sets the thread's error message (printf format); returns -1. */
int kiln_set_error(const char *fmt, ...) KILN_PRINTF(1, 2);
/* true when a previous failure left a message */
bool kiln_has_error(void);
/* "(2, 3)" into buf; returns buf */
char *shape_str(char *buf, size_t n, int rank, const int64_t *shape);

/* ---- memory (alloc.c): size-class caching, 64-byte aligned ---- */
void *mem_alloc(size_t bytes, int32_t *cls);
void mem_free(void *p, int32_t cls);
/* A kernel's temporary buffer from the same caches: a packed filter or a
 * padded image taken and given back on every call would otherwise come
 * from malloc, whose big blocks go back to the kernel when freed and fault
 * in again on the next call (NULL p: nothing to give back). */
typedef struct {
  void *p;
  int32_t cls;
} mem_scratch;
static inline void *mem_scratch_get(mem_scratch *s, size_t bytes) { return s->p = mem_alloc(bytes, &s->cls); }
static inline void mem_scratch_put(mem_scratch *s) {
  if (s->p) mem_free(s->p, s->cls);
  s->p = NULL;
}

/* ---- tensors (tensor.c) ---- */
/* Checks rank and dims (>= 0, no overflow); writes the element count. */
int shape_check(const char *op, int rank, const int64_t *shape, int64_t *size);
/* A fresh tensor with uninitialised data, owned by the caller (refs 1), not
 * yet in any scope. Fails (NULL) on bad shape or out of memory. */
kiln_tensor *tensor_alloc(const char *op, kiln_dtype dt, int rank, const int64_t *shape);
/* A header sharing base's data with another shape of the same size. */
kiln_tensor *tensor_view(kiln_tensor *base, int rank, const int64_t *shape);
/* Has this thread a scope open (so that new tensors belong to it)? */
bool scope_is_open(void);
/* Hands a caller-owned tensor to the innermost scope (if any); returns t. */
kiln_tensor *scope_own(kiln_tensor *t);
static inline size_t tensor_bytes(const kiln_tensor *t) {
  return (size_t)t->size * kiln_dtype_sizes[t->dtype];
}

/* ---- devices (device.c) ----
 * Device 0 is cpu:0, device g + 1 is gpu:g. The GPU backend (backends/cuda)
 * registers itself from a constructor; lib/ calls it only for tensors and
 * device scopes on its devices, so CPU-only work never touches it. */
typedef struct device_backend {
  int (*count)(void);          /* its GPUs; loads the driver on the first call; 0 = none */
  const char *(*status)(void); /* why there is none, for error messages */
  void *(*alloc)(const char *op, int gpu, size_t bytes, int32_t *cls); /* NULL + error */
  void (*free)(int gpu, void *p, int32_t cls);
  /* gpu -1 = host; to the host it returns once dst holds the data. 0 / -1 */
  int (*copy)(const char *op, int dst_gpu, void *dst, int src_gpu, const void *src, size_t bytes);
} device_backend;
void device_register(const device_backend *b);
/* the innermost device scope of this thread (0 = cpu:0): read by op_apply */
extern _Thread_local int device_now KILN_TLS_FAST;
int device_current(void); /* index of the innermost device scope */
int device_find(const char *name); /* -1 if unknown */
/* Device memory for a tensor on device (> 0); NULL with the error set. */
void *device_alloc(const char *op, int device, size_t bytes, int32_t *cls);
void device_free(int device, void *p, int32_t cls);
/* tensor_alloc on any device (tensor.c): data on device, uninitialised. */
kiln_tensor *tensor_alloc_device(const char *op, kiln_dtype dt, int rank, const int64_t *shape, int device);
/* A copy of t's value on device, owned by the caller (not in a scope). */
kiln_tensor *tensor_to_device(const char *op, const kiln_tensor *t, int device);
/* t's value on the host: t itself, or a copy from its GPU (into *copy, for
 * the caller to release; NULL otherwise). NULL with "op: ..." set when t
 * is symbolic (being traced: it has no value). */
const kiln_tensor *tensor_on_host(const char *op, const kiln_tensor *t, kiln_tensor **copy);
/* Copies the first bytes of t's data (any device) to host dst. 0 / -1. */
int device_read(const char *op, const kiln_tensor *t, void *dst, size_t bytes);

/* ---- remote devices (device.c, dist_remote.c) ----
 * On rank 0, the devices other ranks serve (task:K/cpu:0, task:K/gpu:G)
 * come after the local ones in the device list. A tensor there has no data
 * here: its data_block is the worker's handle, never dereferenced; the
 * functions above send it to these. */
/* Appends a device to the list; its index, or -1 when the list is full. */
int device_add(const char *name);
bool device_is_remote(int device);
/* dist_remote.c: the index of "task:K/...", waiting for K's announcement
 * up to KILN_DIST_TIMEOUT_S; -1 (no error set) with remote_why() saying why */
int remote_find(const char *name);
const char *remote_why(void);
/* takes the announcements that have arrived, without waiting */
void remote_refresh(void);
void remote_free(int device, void *handle);
/* a copy of t on device where t or device is remote, owned by the caller */
kiln_tensor *remote_copy(const char *op, const kiln_tensor *t, int device);
int remote_read(const char *op, const kiln_tensor *t, void *dst, size_t bytes);

/* ---- random numbers (random.c) ----
 * Philox-4x32-10 keyed by the 64-bit seed; block c gives four 32-bit words.
 * Element i of a draw that starts at counter c0 uses block c0 + i/2: words
 * 0-1 for even i, words 2-3 for odd i (a normal pair uses all four for
 * elements 2j and 2j+1). A draw of n elements advances the stream by
 * (n + 1) / 2 blocks. */
/* Reserves blocks of the global stream atomically; returns the first
 * counter and writes the seed. */
uint64_t rng_reserve(uint64_t blocks, uint64_t *seed);
/* One Philox-4x32-10 block. */
void philox4x32(uint64_t seed, uint64_t counter, uint32_t out[4]);

/* ---- the library's own host callbacks (host_names.c) ----
 * Staged composites may embed a host call of libkiln (the label check of
 * sparse_softmax_cross_entropy). They carry no user data and are named
 * "kiln.<what>" in IR text, so that a parsed or loaded trace binds them
 * again; user callbacks are named by their symbol (dladdr, dlsym). */
/* the callback named name, or NULL */
kiln_host_fn host_builtin_fn(const char *name);
/* fn's name, or NULL when it is not one of the library's */
const char *host_builtin_name(kiln_host_fn fn);
/* Is fn one of the library's checks, whose only effect is to fail (it
 * writes nothing another instruction reads)? Fusion runs across them. */
bool host_builtin_is_check(kiln_host_fn fn);
/* composite.c: the staged label check (in: labels, and a [0, classes] tensor
 * that gives the class count by its shape; out: the labels) */
int composite_check_labels_host(void *user, int n_in, kiln_tensor *const *in, int n_out, kiln_tensor **out);

/* ---- threads (threadpool.c) ---- */
/* Calls fn(ctx, begin, end) over [0, n) in chunks of at least grain,
 * on the pool and the calling thread; serial when n <= grain, when the
 * pool is busy, or inside a pool task. */
typedef void (*parallel_fn)(void *ctx, int64_t begin, int64_t end);
void parallel_for(int64_t n, int64_t grain, parallel_fn fn, void *ctx);

#endif
