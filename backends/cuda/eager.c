/* eager.c — the eager GPU kernels (DESIGN.md "Backends"): an op on gpu:N is
 * a one-instruction IR function compiled by the CUDA code generator once per
 * (op, attributes, input types, architecture, TF32 mode), cached, and run with
 * cuda_program_launch over the op's tensors. Random draws run the CPU
 * kernel and copy the values to the GPU (the generator is the host's). */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>

#include "runtime.h"
#include "cuda_rt.h"
#include "cuda/ptx.h"

/* The cache key: everything the compiled code depends on, as bytes. */
typedef struct {
  op_id op;
  int n;
  char arch[8];
  bool tf32; /* cuda_use_tf32(): f32 dot on tensor cores */
  op_attrs attrs; /* the fields ops read, copied into zeroed storage (pointers NULL) */
} key_head;

typedef struct entry {
  struct entry *next;
  uint64_t hash;
  size_t key_bytes;
  unsigned char *key;
  cuda_program *prog;
} entry;

enum { N_BUCKETS = 1024 };
static entry *buckets[N_BUCKETS];
static pthread_mutex_t cache_lock = PTHREAD_MUTEX_INITIALIZER;
static cuda_eager_stats stats;

static uint64_t fnv1a(const unsigned char *p, size_t n) {
  uint64_t h = 1469598103934665603ull;
  for (size_t i = 0; i < n; i++) h = (h ^ p[i]) * 1099511628211ull;
  return h;
}

static int clamp_rank(int r) { return r < 0 ? 0 : r > KILN_MAX_RANK ? KILN_MAX_RANK : r; }

/* The key of c on arch: malloc'd, its length in *len; NULL on out of memory. */
static unsigned char *make_key(const op_call *c, const char *arch, size_t *len) {
  size_t bytes = sizeof(key_head) + (size_t)c->n * sizeof(op_type);
  unsigned char *k = calloc(1, bytes);
  if (!k) return NULL;
  key_head h;
  memset(&h, 0, sizeof h);
  h.op = c->op;
  h.n = c->n;
  snprintf(h.arch, sizeof h.arch, "%s", arch);
  h.tf32 = cuda_use_tf32();
  const op_attrs *a = c->attrs;
  h.attrs.rank = a->rank;
  for (int d = 0; d < clamp_rank(a->rank); d++) h.attrs.shape[d] = a->shape[d], h.attrs.begin[d] = a->begin[d];
  h.attrs.naxes = a->naxes;
  for (int d = 0; d < clamp_rank(a->naxes); d++) h.attrs.axes[d] = a->axes[d];
  h.attrs.axis = a->axis;
  h.attrs.keepdims = a->keepdims;
  h.attrs.dtype = a->dtype;
  h.attrs.lo = a->lo;
  h.attrs.hi = a->hi;
  for (int i = 0; i < 2; i++) /* the window ops' */
    h.attrs.stride[i] = a->stride[i], h.attrs.dilation[i] = a->dilation[i], h.attrs.window[i] = a->window[i];
  for (int i = 0; i < 4; i++) h.attrs.padding[i] = a->padding[i];
  h.attrs.groups = a->groups;
  memcpy(k, &h, sizeof h);
  for (int i = 0; i < c->n; i++) {
    op_type t;
    memset(&t, 0, sizeof t);
    t.dtype = (kiln_dtype)c->in[i]->dtype;
    t.rank = c->in[i]->rank;
    for (int d = 0; d < t.rank; d++) t.shape[d] = c->in[i]->shape[d];
    memcpy(k + sizeof h + (size_t)i * sizeof t, &t, sizeof t);
  }
  *len = bytes;
  return k;
}

static entry *find(uint64_t hash, const unsigned char *key, size_t len) {
  for (entry *e = buckets[hash % N_BUCKETS]; e; e = e->next)
    if (e->hash == hash && e->key_bytes == len && !memcmp(e->key, key, len)) return e;
  return NULL;
}

/* The one-instruction function of c, compiled for arch. */
static cuda_program *compile_op(const op_call *c, const char *arch) {
  const op_info *info = &kiln_ops[c->op];
  ir_module *m = ir_module_new();
  op_type small[4], *types = c->n <= 4 ? small : malloc((size_t)c->n * sizeof *types);
  ir_value vsmall[4], *vs = c->n <= 4 ? vsmall : malloc((size_t)c->n * sizeof *vs);
  cuda_program *p = NULL;
  if (!m || !types || !vs) {
    kiln_set_error("%s: out of memory", info->api);
    goto done;
  }
  for (int i = 0; i < c->n; i++) {
    memset(&types[i], 0, sizeof types[i]);
    types[i].dtype = (kiln_dtype)c->in[i]->dtype;
    types[i].rank = c->in[i]->rank;
    for (int d = 0; d < types[i].rank; d++) types[i].shape[d] = c->in[i]->shape[d];
    vs[i] = i;
  }
  ir_func *f = ir_func_new(m, info->name, c->n, types);
  ir_loc loc = {NULL, 0};
  ir_value v = f ? ir_append(f, c->op, c->attrs, c->n, vs, loc) : -1;
  if (v < 0 || ir_set_results(f, 1, &v)) goto done;
  p = cuda_compile(f, arch);
done:
  if (types != small) free(types);
  if (vs != vsmall) free(vs);
  ir_module_free(m);
  return p;
}

/* The cached program for c on arch, compiled on a miss (outside the lock:
 * another thread's hit does not wait for a compile). */
static cuda_program *eager_program(const op_call *c, const char *arch) {
  size_t len = 0;
  unsigned char *key = make_key(c, arch, &len);
  if (!key) {
    kiln_set_error("%s: out of memory", kiln_ops[c->op].api);
    return NULL;
  }
  uint64_t hash = fnv1a(key, len);
  pthread_mutex_lock(&cache_lock);
  entry *e = find(hash, key, len);
  if (e) stats.hits++;
  pthread_mutex_unlock(&cache_lock);
  if (e) {
    free(key);
    return e->prog;
  }
  cuda_program *p = compile_op(c, arch);
  entry *fresh = p ? malloc(sizeof *fresh) : NULL;
  if (!fresh) {
    if (p) kiln_set_error("%s: out of memory", kiln_ops[c->op].api);
    cuda_program_free(p);
    free(key);
    return NULL;
  }
  pthread_mutex_lock(&cache_lock);
  stats.compiles++;
  if (p->from_cache) stats.disk_hits++;
  if ((e = find(hash, key, len))) { /* another thread was first */
    pthread_mutex_unlock(&cache_lock);
    free(fresh);
    free(key);
    cuda_program_free(p);
    return e->prog;
  }
  *fresh = (entry){buckets[hash % N_BUCKETS], hash, len, key, p};
  buckets[hash % N_BUCKETS] = fresh;
  stats.entries++;
  pthread_mutex_unlock(&cache_lock);
  return p;
}

void kiln_debug_cuda_eager_stats(cuda_eager_stats *out) {
  if (!out) return;
  pthread_mutex_lock(&cache_lock);
  *out = stats;
  pthread_mutex_unlock(&cache_lock);
}

/* A random draw: the CPU kernel, then a copy to the GPU. */
static int random_kernel(const op_call *c, int gpu) {
  const char *api = kiln_ops[c->op].api;
  kiln_tensor *host = tensor_alloc(api, (kiln_dtype)c->out->dtype, c->out->rank, c->out->shape);
  if (!host) return -1;
  kernel_fn fn = kiln_kernels[c->op][0][c->out->dtype];
  op_call hc = {c->op, c->attrs, 0, NULL, host};
  int r = fn ? fn(&hc) : kiln_set_error("%s: no CPU kernel for %s", api, kiln_dtype_name((kiln_dtype)c->out->dtype));
  if (!r) r = cuda_copy(api, gpu, c->out->data, -1, host->data, tensor_bytes(host));
  kiln_release(host);
  return r;
}

/* Prefixes a "cuda: ..." message with the op: errors begin with the op. */
static int name_the_op(op_id op) {
  const char *m = kiln_last_error();
  if (strncmp(m, "cuda:", 5)) return -1;
  char msg[1024];
  snprintf(msg, sizeof msg, "%s", m);
  return kiln_set_error("%s: %s", kiln_ops[op].api, msg);
}

static int gpu_kernel(const op_call *c) {
  int gpu = c->out->device - 1;
  if (kiln_ops[c->op].kind == OPK_RANDOM) return random_kernel(c, gpu);
  cuda_program *p = eager_program(c, cuda_arch_of(gpu));
  if (!p) return name_the_op(c->op);
  if (p->n_results != 1 || p->results[0].kind != CUDA_RES_OWN)
    return kiln_set_error("%s: internal error: the GPU program of one op does not compute its result",
                          kiln_ops[c->op].api);
  void *small[4], **pp = c->n <= 4 ? small : malloc((size_t)c->n * sizeof *pp);
  if (!pp) return kiln_set_error("%s: out of memory", kiln_ops[c->op].api);
  for (int i = 0; i < c->n; i++) pp[i] = c->in[i]->data;
  void *rp[1] = {c->out->data};
  int r = cuda_program_launch(p, gpu, pp, rp);
  if (pp != small) free(pp);
  return r ? name_the_op(c->op) : 0;
}

/* Every op a GPU can run, on every device a GPU may be (the driver is not
 * asked here: nothing runs until a GPU is named). */
static KILN_CONSTRUCTOR void cuda_eager_register(void) {
  for (int op = 0; op < OP_COUNT; op++) {
    op_kind k = kiln_ops[op].kind;
    if (k == OPK_VIEW || k == OPK_CONST || k == OPK_CALL || k == OPK_HOST) continue;
    for (int dev = 1; dev < KILN_MAX_DEVICES; dev++)
      for (int dt = 0; dt < KILN_DTYPE_COUNT; dt++)
        if (kiln_ops[op].dtypes & DT_BIT(dt)) dispatch_register((op_id)op, dev, (kiln_dtype)dt, gpu_kernel);
  }
}
