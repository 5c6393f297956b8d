/* tensor.c — tensor lifetime: allocation (header and data in one block for
 * small tensors), views, reference counts, per-thread scopes, and the
 * constructors and accessors of API.md §2. */
#include <math.h>
#include <pthread.h>
#include <stdlib.h>

#include "ops.h"
#include "../jit/jit.h"

/* header size rounded so inline data stays 64-byte aligned */
#define HEADER_BYTES ((sizeof(kiln_tensor) + KILN_ALIGN - 1) / KILN_ALIGN * KILN_ALIGN)
#define INLINE_MAX (((size_t)1 << 16) - HEADER_BYTES) /* data up to this lives in the header block */

static atomic_llong live_tensors;

int64_t kiln_debug_live_tensors(void) { return atomic_load(&live_tensors); }

int shape_check(const char *op, int rank, const int64_t *shape, int64_t *size) {
  if (rank < 0 || rank > KILN_MAX_RANK)
    return kiln_set_error("%s: rank %d is not in [0, %d]", op, rank, KILN_MAX_RANK);
  if (rank > 0 && !shape) return kiln_set_error("%s: shape is NULL for rank %d", op, rank);
  int64_t n = 1;
  bool empty = false; /* a 0 anywhere makes the size 0, whatever the other dims (0 x 2^62 x 2^62) */
  for (int i = 0; i < rank; i++) {
    if (shape[i] < 0) return kiln_set_error("%s: shape[%d] = %lld is negative", op, i, (long long)shape[i]);
    empty |= shape[i] == 0;
  }
  for (int i = 0; i < rank && !empty; i++) {
    if (KILN_MUL_OVERFLOW(n, shape[i], &n) || n > (INT64_MAX >> 4)) {
      char buf[256];
      return kiln_set_error("%s: the element count of shape %s overflows", op,
                            shape_str(buf, sizeof buf, rank, shape));
    }
  }
  *size = empty ? 0 : n;
  return 0;
}

/* Serials come from the global counter in blocks, so that making a tensor
 * touches no shared cache line (0 is never one). */
enum { SERIAL_BLOCK = 1 << 16 };
static _Atomic uint64_t serial_blocks = 1;
static _Thread_local uint64_t serial_next KILN_TLS_FAST, serial_end KILN_TLS_FAST;

uint64_t tensor_new_serial(void) {
  if (KILN_UNLIKELY(serial_next == serial_end)) {
    serial_next = atomic_fetch_add_explicit(&serial_blocks, 1, memory_order_relaxed) * SERIAL_BLOCK;
    serial_end = serial_next + SERIAL_BLOCK;
  }
  return serial_next++;
}

static kiln_tensor *header_alloc(size_t data_bytes, int32_t *cls) {
  size_t bytes = HEADER_BYTES + (data_bytes <= INLINE_MAX ? data_bytes : 0);
  return mem_alloc(bytes, cls);
}

kiln_tensor *tensor_alloc(const char *op, kiln_dtype dt, int rank, const int64_t *shape) {
  int64_t size = 0;
  if (shape_check(op, rank, shape, &size)) return NULL;
  size_t bytes = (size_t)size * kiln_dtype_sizes[dt];
  int32_t cls;
  kiln_tensor *t = header_alloc(bytes, &cls);
  if (!t) {
    kiln_set_error("%s: out of memory", op);
    return NULL;
  }
  atomic_init(&t->refs, 1);
  t->dtype = (uint8_t)dt;
  t->rank = (int8_t)rank;
  t->device = 0;
  t->flags = 0;
  t->mem_class = cls;
  t->size = size;
  for (int i = 0; i < rank; i++) t->shape[i] = shape[i];
  t->base = NULL;
  t->sym = NULL;
  t->serial = tensor_new_serial();
  t->data_block = NULL;
  if (bytes <= INLINE_MAX) {
    t->data = (char *)t + HEADER_BYTES;
  } else {
    t->data_block = mem_alloc(bytes, &t->data_class);
    if (!t->data_block) {
      mem_free(t, cls);
      kiln_set_error("%s: out of memory allocating %zu bytes", op, bytes);
      return NULL;
    }
    t->data = t->data_block;
  }
  atomic_fetch_add_explicit(&live_tensors, 1, memory_order_relaxed);
  return t;
}

/* A GPU tensor: a header block on the host, data from the device's allocator. */
kiln_tensor *tensor_alloc_device(const char *op, kiln_dtype dt, int rank, const int64_t *shape, int device) {
  if (device == 0) return tensor_alloc(op, dt, rank, shape);
  kiln_tensor *t = tensor_alloc(op, dt, 0, NULL); /* a header with 8 inline bytes, unused */
  if (!t) return NULL;
  int64_t size = 0;
  if (shape_check(op, rank, shape, &size) ||
      (size && !(t->data_block = device_alloc(op, device, (size_t)size * kiln_dtype_sizes[dt], &t->data_class)))) {
    kiln_release(t);
    return NULL;
  }
  t->rank = (int8_t)rank;
  for (int i = 0; i < rank; i++) t->shape[i] = shape[i];
  t->size = size;
  t->device = (uint8_t)device;
  t->data = t->data_block;
  return t;
}

kiln_tensor *tensor_view(kiln_tensor *base, int rank, const int64_t *shape) {
  int32_t cls;
  kiln_tensor *t = header_alloc(0, &cls);
  if (!t) {
    kiln_set_error("view: out of memory");
    return NULL;
  }
  /* field by field: base may be shared, and other threads change its refs */
  atomic_init(&t->refs, 1);
  t->dtype = base->dtype;
  t->device = base->device;
  t->flags = base->flags;
  t->size = base->size;
  t->data = base->data;
  t->data_class = base->data_class;
  t->sym = base->sym;
  t->mem_class = cls;
  t->rank = (int8_t)rank;
  for (int i = 0; i < rank; i++) t->shape[i] = shape[i];
  t->data_block = NULL;
  t->serial = tensor_new_serial();
  t->base = kiln_retain(base->base ? base->base : base);
  atomic_fetch_add_explicit(&live_tensors, 1, memory_order_relaxed);
  return t;
}

kiln_tensor *kiln_retain(kiln_tensor *t) {
  if (t) atomic_fetch_add_explicit(&t->refs, 1, memory_order_relaxed);
  return t;
}

void kiln_release(kiln_tensor *t) {
  while (t) {
    if (atomic_fetch_sub_explicit(&t->refs, 1, memory_order_acq_rel) != 1) return;
    kiln_tensor *base = t->base;
    if (t->data_block) {
      if (KILN_UNLIKELY(t->device))
        device_free(t->device, t->data_block, t->data_class);
      else
        mem_free(t->data_block, t->data_class);
    }
    mem_free(t, t->mem_class);
    atomic_fetch_sub_explicit(&live_tensors, 1, memory_order_relaxed);
    t = base; /* a view drops its owner: iterate instead of recursing */
  }
}

/* ---- scopes: one array per thread, each scope a range of it ---- */

typedef struct {
  kiln_tensor **items;
  int64_t len, cap;
  int64_t *marks; /* marks[d] = where scope d starts */
  int depth, mark_cap;
} scope_stack;

static _Thread_local scope_stack scopes KILN_TLS_FAST;
static _Thread_local bool scopes_registered;
static pthread_key_t scopes_key;
static pthread_once_t scopes_once = PTHREAD_ONCE_INIT;

/* at thread exit: release what open scopes still own, free the arrays */
static void scopes_free(void *arg) {
  scope_stack *s = arg;
  for (int64_t i = s->len; i-- > 0;) kiln_release(s->items[i]);
  free(s->items);
  free(s->marks);
  memset(s, 0, sizeof *s);
}

static void scopes_key_init(void) { pthread_key_create(&scopes_key, scopes_free); }

void kiln_scope_push(void) {
  scope_stack *s = &scopes;
  if (KILN_UNLIKELY(!scopes_registered)) {
    pthread_once(&scopes_once, scopes_key_init);
    pthread_setspecific(scopes_key, s);
    scopes_registered = true;
  }
  if (s->depth == s->mark_cap) {
    int cap = s->mark_cap ? 2 * s->mark_cap : 16;
    int64_t *m = realloc(s->marks, (size_t)cap * sizeof *m);
    if (!m) return; /* out of memory: the scope is not opened, and pop will be a no-op */
    s->marks = m;
    s->mark_cap = cap;
  }
  s->marks[s->depth++] = s->len;
}

void kiln_scope_pop(void) {
  scope_stack *s = &scopes;
  if (s->depth == 0) return;
  int64_t mark = s->marks[--s->depth];
  /* releasing may not open scopes, so the range is stable while we walk it */
  for (int64_t i = s->len; i-- > mark;) kiln_release(s->items[i]);
  s->len = mark;
}

bool scope_is_open(void) { return scopes.depth > 0; }

kiln_tensor *scope_own(kiln_tensor *t) {
  scope_stack *s = &scopes;
  if (!t || s->depth == 0) return t;
  if (KILN_UNLIKELY(s->len == s->cap)) {
    int64_t cap = s->cap ? 2 * s->cap : 256;
    kiln_tensor **items = realloc(s->items, (size_t)cap * sizeof *items);
    if (!items) {
      kiln_release(t);
      kiln_set_error("scope: out of memory");
      return NULL;
    }
    s->items = items;
    s->cap = cap;
  }
  s->items[s->len++] = t;
  return t;
}

kiln_tensor *kiln_scope_escape(kiln_tensor *t) {
  scope_stack *s = &scopes;
  if (!t) return NULL;
  if (s->depth == 0) {
    kiln_set_error("scope_escape: no scope is open");
    return NULL;
  }
  int64_t mark = s->marks[s->depth - 1];
  for (int64_t i = s->len; i-- > mark;) {
    if (s->items[i] != t) continue;
    if (s->depth == 1) { /* to the caller: out of the array */
      s->items[i] = s->items[--s->len];
    } else { /* to the parent: swap to the scope's first slot and move the mark past it */
      s->items[i] = s->items[mark];
      s->items[mark] = t;
      s->marks[s->depth - 1]++;
    }
    return t;
  }
  kiln_set_error("scope_escape: the tensor is not owned by the current scope");
  return NULL;
}

/* ---- constructors ---- */

static bool check_dtype(const char *op, kiln_dtype dt) {
  if (dtype_valid(dt)) return true;
  kiln_set_error("%s: invalid dtype %d", op, (int)dt);
  return false;
}

/* Fills t with v: one element converted, then doubled by memcpy. */
static void fill_value(kiln_tensor *t, double v) {
  size_t es = kiln_dtype_sizes[t->dtype], bytes = tensor_bytes(t);
  if (bytes == 0) return;
  if (v == 0) {
    memset(t->data, 0, bytes);
    return;
  }
  dtype_store(t->dtype, t->data, 0, v);
  for (size_t done = es; done < bytes;) {
    size_t n = done < bytes - done ? done : bytes - done;
    memcpy((char *)t->data + done, t->data, n);
    done += n;
  }
}

kiln_tensor *kiln_fill(kiln_dtype dt, int rank, const int64_t *shape, double value) {
  if (!check_dtype("fill", dt)) return NULL;
  kiln_tensor *t = tensor_alloc("fill", dt, rank, shape);
  if (!t) return NULL;
  fill_value(t, value);
  return scope_own(t);
}

kiln_tensor *kiln_tensor_new(kiln_dtype dt, int rank, const int64_t *shape, const void *data) {
  if (!check_dtype("tensor_new", dt)) return NULL;
  kiln_tensor *t = tensor_alloc("tensor_new", dt, rank, shape);
  if (!t) return NULL;
  if (data)
    memcpy(t->data, data, tensor_bytes(t));
  else
    memset(t->data, 0, tensor_bytes(t));
  if (data && dt == KILN_BOOL) /* keep bools canonical: 0 or 1 */
    for (int64_t i = 0; i < t->size; i++) ((uint8_t *)t->data)[i] = ((uint8_t *)t->data)[i] != 0;
  return scope_own(t);
}

kiln_tensor *kiln_scalar(kiln_dtype dt, double value) {
  if (!check_dtype("scalar", dt)) return NULL;
  kiln_tensor *t = tensor_alloc("scalar", dt, 0, NULL);
  if (!t) return NULL;
  dtype_store(dt, t->data, 0, value);
  return scope_own(t);
}

kiln_tensor *kiln_scalar_like(const kiln_tensor *like, double value) {
  if (!like) {
    if (!kiln_has_error()) kiln_set_error("scalar_like: input is NULL");
    return NULL;
  }
  if (like->device == 0) return kiln_scalar((kiln_dtype)like->dtype, value);
  /* on a GPU (like may be symbolic, traced under a GPU scope): made on the host, copied there */
  kiln_tensor *h = tensor_alloc("scalar_like", (kiln_dtype)like->dtype, 0, NULL), *t = NULL;
  if (h) {
    dtype_store((kiln_dtype)like->dtype, h->data, 0, value);
    t = tensor_to_device("scalar_like", h, like->device);
    kiln_release(h);
  }
  return scope_own(t);
}

kiln_tensor *kiln_zeros(kiln_dtype dt, int rank, const int64_t *shape) {
  if (!check_dtype("zeros", dt)) return NULL;
  kiln_tensor *t = tensor_alloc("zeros", dt, rank, shape);
  if (!t) return NULL;
  memset(t->data, 0, tensor_bytes(t));
  return scope_own(t);
}

kiln_tensor *kiln_ones(kiln_dtype dt, int rank, const int64_t *shape) {
  if (!check_dtype("ones", dt)) return NULL;
  kiln_tensor *t = tensor_alloc("ones", dt, rank, shape);
  if (!t) return NULL;
  fill_value(t, 1);
  return scope_own(t);
}

kiln_tensor *kiln_eye(kiln_dtype dt, int64_t n) {
  if (!check_dtype("eye", dt)) return NULL;
  if (n < 0) {
    kiln_set_error("eye: n = %lld is negative", (long long)n);
    return NULL;
  }
  int64_t shape[2] = {n, n};
  kiln_tensor *t = tensor_alloc("eye", dt, 2, shape);
  if (!t) return NULL;
  memset(t->data, 0, tensor_bytes(t));
  for (int64_t i = 0; i < n; i++) dtype_store(dt, t->data, i * n + i, 1);
  return scope_own(t);
}

/* ---- accessors ---- */

kiln_dtype kiln_tensor_dtype(const kiln_tensor *t) { return t ? (kiln_dtype)t->dtype : KILN_F32; }
int kiln_tensor_rank(const kiln_tensor *t) { return t ? t->rank : -1; }
const int64_t *kiln_tensor_shape(const kiln_tensor *t) { return t ? t->shape : NULL; }
int64_t kiln_tensor_size(const kiln_tensor *t) { return t ? t->size : -1; }

const char *kiln_tensor_device(const kiln_tensor *t) {
  return t ? kiln_device_name(t->device) : NULL;
}

/* A symbolic tensor has no value: reading it fails the trace that is
 * recording (trace_poison), even if the body ignores this call's error. */
static int check_readable(const char *op, const char *api, const kiln_tensor *t) {
  if (!t) return kiln_has_error() ? -1 : kiln_set_error("%s: tensor is NULL", op);
  if (t->flags & TF_SYMBOLIC) {
    trace_poison(api);
    return kiln_set_error("%s: the tensor is symbolic (being traced) and has no value yet", op);
  }
  return 0;
}

const void *kiln_tensor_data(const kiln_tensor *t) {
  if (check_readable("tensor_data", "kiln_tensor_data", t)) return NULL;
  if (t->device != 0) {
    kiln_set_error("tensor_data: tensor lives on %s, not on the host", kiln_tensor_device(t));
    return NULL;
  }
  return t->data;
}

int kiln_tensor_read(const kiln_tensor *t, void *dst, size_t bytes) {
  if (check_readable("tensor_read", "kiln_tensor_read", t)) return -1;
  size_t need = tensor_bytes(t);
  if (!dst && need) return kiln_set_error("tensor_read: destination is NULL");
  if (bytes < need)
    return kiln_set_error("tensor_read: buffer of %zu bytes is too small for %lld %s elements (%zu bytes)",
                          bytes, (long long)t->size, kiln_dtype_name((kiln_dtype)t->dtype), need);
  return device_read("tensor_read", t, dst, need); /* from a GPU: waits for its stream */
}

double kiln_tensor_item(const kiln_tensor *t) {
  if (check_readable("item", "kiln_tensor_item", t)) return NAN;
  if (t->size != 1) {
    kiln_set_error("item: tensor has %lld elements, not 1", (long long)t->size);
    return NAN;
  }
  if (t->device == 0) return dtype_load((kiln_dtype)t->dtype, t->data, 0);
  uint64_t v; /* the one element, copied from the GPU */
  if (device_read("item", t, &v, kiln_dtype_sizes[t->dtype])) return NAN;
  return dtype_load((kiln_dtype)t->dtype, &v, 0);
}
