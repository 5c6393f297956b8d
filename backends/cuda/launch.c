/* launch.c — running a compiled CUDA program (ptx.c's PTX and launch plan)
 * on one GPU: the module loaded once per device, results and a per-call
 * arena from the caching allocator, the plan's steps queued in schedule
 * order on the device's stream, the steps the GPU cannot run done on the
 * host, control flow run by the host over the queued launches (a
 * predicate's byte read back in stream order, a scan's rows recomputed
 * each iteration), and the error word the kernels raise turned into the
 * eager op's message. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "runtime.h"
#include "cuda_rt.h"
#include "cuda/ptx.h"

/* What one GPU holds of a program: set once under load_lock, then only read. */
typedef struct {
  CUmodule mod;           /* NULL until loaded */
  CUfunction *fn;         /* per step of the tree (cuda_step.no): its kernel's function (NULL for other steps) */
  kiln_tensor **res_cst;  /* per result of kind CUDA_RES_CONST: its copy on this GPU */
  kiln_tensor **slot_cst; /* per slot: a constant that rows are taken of, its copy on this GPU */
} gpu_image;

typedef struct {
  gpu_image gpu[CUDA_MAX_GPUS];
} program_rt;

/* Loading is rare (a program's first run on a GPU); runs take the lock
 * only to find the loaded image. */
static pthread_mutex_t load_lock = PTHREAD_MUTEX_INITIALIZER;

const char *cuda_arch_of(int gpu) {
  cuda_device_info d;
  return kiln_debug_cuda_device(gpu, &d) == 0 && d.cc_major >= 9 ? "sm_90" : "sm_80";
}

/* "cuda: @f: what: CUDA_ERROR_X: description (call)"; -1 */
static int drv_fail(const cuda_program *p, const char *what, CUresult r, const char *call) {
  char op[200];
  snprintf(op, sizeof op, "cuda: @%s: %s", p->name, what);
  return cuda_fail(op, r, call);
}

/* "kernel3 (add)" */
static const char *kernel_label(const cuda_step *st, char *buf, size_t n) {
  if (st->kernel_op < OP_COUNT)
    snprintf(buf, n, "%s (%s)", st->name, kiln_ops[st->kernel_op].name);
  else
    snprintf(buf, n, "%s", st->name);
  return buf;
}

static void image_close(gpu_image *im, int gpu, int n_results, int n_slots) {
  if (im->mod) {
    CUstream s;
    if (cuda_enter("cuda", gpu, &s) == 0) { /* queued launches may still use it */
      cuda_drv.cuStreamSynchronize(s);
      cuda_drv.cuModuleUnload(im->mod);
      cuda_leave();
    }
  }
  if (im->res_cst)
    for (int r = 0; r < n_results; r++) kiln_release(im->res_cst[r]);
  free(im->res_cst);
  if (im->slot_cst)
    for (int s = 0; s < n_slots; s++) kiln_release(im->slot_cst[s]);
  free(im->slot_cst);
  free(im->fn);
  memset(im, 0, sizeof *im);
}

/* The module and its functions on gpu, and the constant results there. */
static int image_open(cuda_program *p, int gpu, gpu_image *im) {
  if (!cuda_drv.cuModuleLoadData || !cuda_drv.cuModuleGetFunction || !cuda_drv.cuModuleUnload ||
      !cuda_drv.cuLaunchKernel || !cuda_drv.cuMemsetD8Async)
    return kiln_set_error("cuda: @%s: the CUDA driver has no cuModuleLoadData, cuModuleGetFunction, "
                          "cuLaunchKernel or cuMemsetD8Async",
                          p->name);
  if (!p->ptx) return kiln_set_error("cuda: @%s: the program has no PTX", p->name);
  im->fn = calloc((size_t)p->n_all + 1, sizeof *im->fn);
  im->res_cst = calloc((size_t)p->n_results + 1, sizeof *im->res_cst);
  im->slot_cst = calloc((size_t)p->n_slots + 1, sizeof *im->slot_cst);
  if (!im->fn || !im->res_cst || !im->slot_cst) {
    image_close(im, gpu, p->n_results, p->n_slots);
    return kiln_set_error("cuda: out of memory");
  }
  char what[64];
  snprintf(what, sizeof what, "loading its PTX on gpu:%d", gpu);
  if (cuda_enter("cuda", gpu, NULL)) {
    image_close(im, gpu, p->n_results, p->n_slots);
    return -1;
  }
  CUresult r = cuda_drv.cuModuleLoadData(&im->mod, p->ptx);
  int rc = r == CUDA_SUCCESS ? 0 : drv_fail(p, what, r, "cuModuleLoadData");
  if (rc) im->mod = NULL;
  for (int s = 0; !rc && s < p->n_all; s++) {
    const cuda_step *st = p->all[s];
    if (st->kind != CUDA_STEP_KERNEL) continue;
    if ((r = cuda_drv.cuModuleGetFunction(&im->fn[s], im->mod, st->name)) != CUDA_SUCCESS) {
      char label[64];
      rc = drv_fail(p, kernel_label(st, label, sizeof label), r, "cuModuleGetFunction");
    }
  }
  cuda_leave();
  for (int i = 0; !rc && i < p->n_results; i++)
    if (p->results[i].kind == CUDA_RES_CONST && !(im->res_cst[i] = tensor_to_device("cuda", p->results[i].cst, gpu + 1)))
      rc = -1;
  for (int s = 0; !rc && s < p->n_slots; s++) { /* a scan over a constant's rows reads them on the GPU */
    int b = p->slots[s].index;
    if (p->slots[s].kind != PLAN_SLOT_ROW || p->slots[b].kind != PLAN_SLOT_CONST || im->slot_cst[b]) continue;
    if (!(im->slot_cst[b] = tensor_to_device("cuda", p->slots[b].cst, gpu + 1))) rc = -1;
  }
  if (rc) image_close(im, gpu, p->n_results, p->n_slots);
  return rc;
}

static gpu_image *program_image(cuda_program *p, int gpu) {
  pthread_mutex_lock(&load_lock);
  program_rt *rt = p->rt;
  if (!rt && !(rt = p->rt = calloc(1, sizeof *rt))) {
    pthread_mutex_unlock(&load_lock);
    kiln_set_error("cuda: out of memory");
    return NULL;
  }
  gpu_image *im = &rt->gpu[gpu];
  int rc = im->mod ? 0 : image_open(p, gpu, im);
  pthread_mutex_unlock(&load_lock);
  return rc ? NULL : im;
}

void cuda_program_rt_free(cuda_program *p) {
  program_rt *rt = p ? p->rt : NULL;
  if (!rt) return;
  /* a free path sets no error: keep the caller's message */
  char saved[1024] = "";
  bool had = kiln_has_error();
  if (had) snprintf(saved, sizeof saved, "%s", kiln_last_error());
  for (int g = 0; g < CUDA_MAX_GPUS; g++)
    if (rt->gpu[g].mod) image_close(&rt->gpu[g], g, p->n_results, p->n_slots);
  if (had)
    kiln_set_error("%s", saved);
  else
    kiln_clear_error();
  free(rt);
  p->rt = NULL;
}

/* ---- one call ---- */

typedef struct {
  cuda_program *p;
  int gpu;
  void *const *params, *const *results;
  unsigned char *arena;
  CUstream stream;
  const gpu_image *im;
  CUdeviceptr err;  /* the error word */
  bool can_fail;    /* some kernel may raise it */
  bool stop;        /* it was seen raised while reading a predicate back: run no more steps */
  unsigned char **row; /* per slot: a row's address in the current iteration of its scan (NULL before) */
  unsigned char **place; /* per slot: where a loop moved it (cuda_step.move), NULL: its own */
  CUdeviceptr *vals;   /* a kernel's parameters (as many as the most buffers of a step) */
  void **kp;
} run_ctx;

/* The device address of a buffer; constants (host tensors) give NULL with
 * *host set. */
static void *ref_ptr(const run_ctx *rc, const cuda_ref *r, const void **host) {
  if (host) *host = NULL;
  if (r->kind != CUDA_REF_CONST && r->slot >= 0 && r->slot < rc->p->n_slots && rc->place[r->slot])
    return rc->place[r->slot];
  switch (r->kind) {
    case CUDA_REF_PARAM: return rc->params[r->index];
    case CUDA_REF_RESULT: return rc->results[r->index];
    case CUDA_REF_ARENA: return rc->arena + r->offset;
    case CUDA_REF_ROW: return rc->row[r->index];
    default:
      if (host) *host = r->cst->data;
      return NULL;
  }
}

/* The device address of the program's slot s (a row's base): a constant's
 * is its copy on this GPU. */
static unsigned char *slot_ptr(const run_ctx *rc, int s) {
  const plan_slot *sl = &rc->p->slots[s];
  if (rc->place[s]) return rc->place[s];
  switch (sl->kind) {
    case PLAN_SLOT_ROW: return rc->row[s];
    case PLAN_SLOT_CONST: return rc->im->slot_cst[s] ? rc->im->slot_cst[s]->data : NULL;
    default: {
      cuda_ref r = {sl->kind, sl->index, sl->offset, sl->cst, -1};
      return ref_ptr(rc, &r, NULL);
    }
  }
}

static bool same_type(const kiln_tensor *t, const op_type *want) {
  if (t->dtype != want->dtype || t->rank != want->rank) return false;
  for (int k = 0; k < t->rank; k++)
    if (t->shape[k] != want->shape[k]) return false;
  return true;
}

/* A host callback: inputs brought to the host as tensors it may keep, its
 * outputs checked as the interpreter does, then copied to the GPU. */
static int host_callback(const run_ctx *rc, const cuda_step *st, kiln_tensor **ins) {
  const ir_host *h = st->attrs.host;
  const char *who = "host_call";
  if (!h || !h->fn)
    return kiln_set_error("host_call: @%s: no callback is bound (IR read from text, and the process has no "
                          "symbol of that name)",
                          h ? h->name : "host");
  int n_in = st->n_bufs - st->n_out;
  kiln_tensor **outs = calloc((size_t)st->n_out + 1, sizeof *outs);
  if (!outs) return kiln_set_error("host_call: out of memory");
  int r = 0;
  if (h->fn(h->user, n_in, ins, st->n_out, outs)) {
    if (!kiln_has_error()) kiln_set_error("host_call: @%s failed without an error", h->name);
    r = -1;
  }
  for (int k = 0; k < st->n_out && !r; k++) {
    const kiln_tensor *t = outs[k];
    if (!t || (t->flags & TF_SYMBOLIC) || !same_type(t, &st->types[k])) {
      char w[256], g[256] = "NULL";
      ir_type_str(w, sizeof w, &st->types[k]);
      if (t) {
        op_type ty = {(kiln_dtype)t->dtype, t->rank, {0}};
        for (int d = 0; d < t->rank; d++) ty.shape[d] = t->shape[d];
        ir_type_str(g, sizeof g, &ty);
      }
      r = kiln_set_error("host_call: @%s returned %s for output %d, declared %s", h->name, g, k, w);
      break;
    }
    r = cuda_copy(who, rc->gpu, ref_ptr(rc, &st->bufs[k], NULL), t->device - 1, t->data, tensor_bytes(t));
  }
  free(outs);
  return r;
}

/* A step the GPU cannot run (random draws, host callbacks): its inputs
 * copied to the host, the eager CPU kernel or the callback, its outputs
 * copied back. */
static int host_step(const run_ctx *rc, const cuda_step *st) {
  const char *who = kiln_ops[st->op].api;
  int n_in = st->n_bufs - st->n_out, r = 0;
  kiln_tensor **io = calloc((size_t)st->n_bufs + 1, sizeof *io);
  if (!io) return kiln_set_error("%s: out of memory", who);
  kiln_scope_push();
  for (int k = 0; k < st->n_bufs && !r; k++) { /* outputs, then inputs */
    const op_type *t = &st->types[k];
    kiln_tensor *x = tensor_alloc(who, t->dtype, t->rank, t->shape);
    if (!x) {
      r = -1;
      break;
    }
    io[k] = scope_own(x);
    if (k < st->n_out) continue;
    const void *host;
    void *dev = ref_ptr(rc, &st->bufs[k], &host);
    if (host)
      memcpy(x->data, host, tensor_bytes(x));
    else
      r = cuda_copy(who, -1, x->data, rc->gpu, dev, tensor_bytes(x));
  }
  if (!r && kiln_ops[st->op].kind == OPK_HOST) {
    r = host_callback(rc, st, io + st->n_out);
  } else if (!r) {
    op_attrs a = st->attrs;
    kiln_tensor *out = io[0];
    if (kiln_ops[st->op].kind == OPK_RANDOM && a.stateful) /* this call's block of the global stream */
      a.counter = rng_reserve(((uint64_t)out->size + 1) / 2, &a.seed);
    kiln_dtype key = dispatch_key(st->op, n_in, io + st->n_out, out->dtype);
    kernel_fn fn = kiln_kernels[st->op][0][key];
    if (!fn) {
      r = kiln_set_error("%s: no CPU kernel for %s", who, kiln_dtype_name(key));
    } else {
      op_call c = {st->op, &a, n_in, io + st->n_out, out};
      r = fn(&c);
    }
    for (int k = 0; k < st->n_out && !r; k++)
      r = cuda_copy(who, rc->gpu, ref_ptr(rc, &st->bufs[k], NULL), -1, io[k]->data, tensor_bytes(io[k]));
  }
  kiln_scope_pop();
  free(io);
  return r;
}

/* The message of the step whose kernel raised the error word: the eager
 * op's, the bad index looked up on the host. */
static int kernel_check_failed(const run_ctx *rc, const cuda_step *st) {
  op_id op = st->op;
  const char *api = op < OP_COUNT ? kiln_ops[op].api : "cuda";
  if (op != OP_GATHER && op != OP_SCATTER_ADD) return kiln_set_error("%s: integer division by zero", api);
  if (st->index_buf < 0 || st->index_buf >= st->n_bufs)
    return kiln_set_error("%s: an index is not in [0, %lld)", api, (long long)st->index_dim);
  size_t esize = kiln_dtype_sizes[st->index_dtype], bytes = (size_t)st->index_count * esize;
  void *at = ref_ptr(rc, &st->bufs[st->index_buf], NULL);
  /* a row of indices: the failing iteration's row may be gone; the message
   * then names no index */
  if (!at || st->bufs[st->index_buf].kind == CUDA_REF_ROW)
    return kiln_set_error("%s: an index is not in [0, %lld)", api, (long long)st->index_dim);
  void *idx = malloc(bytes + 1);
  if (!idx) return kiln_set_error("%s: out of memory", api);
  if (cuda_copy(api, -1, idx, rc->gpu, at, bytes)) {
    free(idx);
    return -1;
  }
  int r = kiln_set_error("%s: an index is not in [0, %lld)", api, (long long)st->index_dim);
  for (int64_t j = 0; j < st->index_count; j++) {
    int64_t x = st->index_dtype == KILN_I32 ? ((const int32_t *)idx)[j] : ((const int64_t *)idx)[j];
    if ((uint64_t)x >= (uint64_t)st->index_dim) {
      r = kiln_set_error("%s: indices[%lld] = %lld is not in [0, %lld)", api, (long long)j, (long long)x,
                         (long long)st->index_dim);
      break;
    }
  }
  free(idx);
  return r;
}

static int run_steps(run_ctx *rc, const cuda_step *steps, int n);

/* Whether the predicate (a bool in the step's bufs[0]) is true: its byte
 * read back after the work queued before it (and the error word with it:
 * once a kernel has raised it, rc->stop and false). With ctx pushed. */
static int read_pred(run_ctx *rc, const cuda_step *st, bool *yes) {
  const void *host;
  void *dev = ref_ptr(rc, &st->bufs[0], &host);
  unsigned char byte = host ? *(const unsigned char *)host : 0;
  int32_t word = 0;
  CUresult cr = CUDA_SUCCESS;
  const char *call = "cuMemcpyDtoHAsync";
  if (!host) cr = cuda_drv.cuMemcpyDtoHAsync(&byte, (CUdeviceptr)(uintptr_t)dev, 1, rc->stream);
  if (cr == CUDA_SUCCESS && rc->can_fail) cr = cuda_drv.cuMemcpyDtoHAsync(&word, rc->err, sizeof word, rc->stream);
  if (cr == CUDA_SUCCESS && (!host || rc->can_fail)) {
    call = "cuStreamSynchronize";
    cr = cuda_drv.cuStreamSynchronize(rc->stream);
  }
  if (cr != CUDA_SUCCESS) {
    char label[64];
    snprintf(label, sizeof label, "step %d (%s predicate)", st->no, st->kind == CUDA_STEP_COND ? "cond" : "while");
    return drv_fail(rc->p, label, cr, call);
  }
  rc->stop = word != 0;
  *yes = byte != 0 && !rc->stop;
  return 0;
}

/* ---- the state's places moving (cuda_step.move): double buffering ---- */

typedef struct {
  unsigned char **saved; /* per move: its slot's place entry before the loop */
  unsigned char **own;   /* per move: its slot's address before the loop */
  unsigned char **to;    /* per move: scratch for the moves at an iteration's end */
} moving;

static int moves_begin(const run_ctx *rc, const cuda_step *st, moving *m) {
  memset(m, 0, sizeof *m);
  if (!st->n_move) return 0;
  size_t n = (size_t)st->n_move + 1;
  m->saved = malloc(n * sizeof *m->saved), m->own = malloc(n * sizeof *m->own), m->to = malloc(n * sizeof *m->to);
  if (!m->saved || !m->own || !m->to) return kiln_set_error("cuda: out of memory");
  for (int k = 0; k < st->n_move; k++) {
    m->saved[k] = rc->place[st->move[2 * k]];
    m->own[k] = slot_ptr(rc, st->move[2 * k]);
  }
  return 0;
}

/* the moves, all at once (every source's place read first) */
static void moves_latch(run_ctx *rc, const cuda_step *st, moving *m) {
  for (int k = 0; k < st->n_move; k++) m->to[k] = slot_ptr(rc, st->move[2 * k + 1]);
  for (int k = 0; k < st->n_move; k++) rc->place[st->move[2 * k]] = m->to[k];
}

/* After the loop: each state whose place moved copied back to its own
 * (through its scratch slot first where it has one: the place may be
 * another state's own, so every copy out precedes every copy back); every
 * moved slot's place as before. Frees m. */
static int moves_end(run_ctx *rc, const cuda_step *st, moving *m) {
  int r = 0;
  if (!m->saved || !m->own || !m->to) { /* nothing moved (or out of memory at the start) */
    free(m->saved), free(m->own), free(m->to);
    return 0;
  }
  for (int pass = 0; pass < 2 && !r; pass++)
    for (int q = 0; q < st->n_state && !r; q++)
      for (int k = 0; k < st->n_move && !r; k++) {
        int sc = st->scratch ? st->scratch[q] : -1;
        if (st->move[2 * k] != st->state[q] || (pass == 0 && sc < 0)) continue;
        unsigned char *cur = slot_ptr(rc, st->state[q]);
        if (cur == m->own[k] || st->state_bytes[q] <= 0) continue;
        unsigned char *dst = pass == 0 ? slot_ptr(rc, sc) : m->own[k], *src = pass == 1 && sc >= 0 ? slot_ptr(rc, sc) : cur;
        CUresult cr = cuda_drv.cuMemcpyDtoDAsync((CUdeviceptr)(uintptr_t)dst, (CUdeviceptr)(uintptr_t)src,
                                                 (size_t)st->state_bytes[q], rc->stream);
        if (cr != CUDA_SUCCESS) {
          char label[64];
          snprintf(label, sizeof label, "step %d (a loop's state copied back)", st->no);
          r = drv_fail(rc->p, label, cr, "cuMemcpyDtoDAsync");
        }
      }
  for (int k = 0; k < st->n_move; k++) rc->place[st->move[2 * k]] = m->saved[k];
  free(m->saved), free(m->own), free(m->to);
  return r;
}

static int run_cond(run_ctx *rc, const cuda_step *st) {
  bool yes;
  if (read_pred(rc, st, &yes)) return -1;
  if (rc->stop) return 0;
  int b = yes ? 0 : 1;
  return run_steps(rc, st->sub[b], st->n_sub[b]);
}

/* the predicate's steps, then the body's while it holds, at most trip
 * times (then the loop stops, as the interpreter's does) */
static int run_while(run_ctx *rc, const cuda_step *st) {
  moving m;
  int r = moves_begin(rc, st, &m);
  for (int64_t i = 0; !r && (st->trip < 0 || i < st->trip) && !rc->stop; i++) {
    bool yes = false;
    if ((r = run_steps(rc, st->sub[0], st->n_sub[0])) || rc->stop) break;
    if ((r = read_pred(rc, st, &yes)) || !yes) break;
    if ((r = run_steps(rc, st->sub[1], st->n_sub[1]))) break;
    moves_latch(rc, st, &m);
  }
  int e = moves_end(rc, st, &m);
  return r ? r : e;
}

/* the body trip times, its rows at t = 0 .. trip-1 (or down) */
static int run_scan(run_ctx *rc, const cuda_step *st) {
  const plan_slot *slots = rc->p->slots;
  moving m;
  int r = moves_begin(rc, st, &m);
  for (int64_t i = 0; !r && i < st->trip && !rc->stop; i++) {
    int64_t t = st->reverse ? st->trip - 1 - i : i;
    for (int k = 0; k < st->n_bufs && !r; k++) {
      int s = st->bufs[k].index;
      unsigned char *base = slot_ptr(rc, slots[s].index);
      if (!base) r = kiln_set_error("cuda: @%s: step %d (scan): row %d has no base on the GPU", rc->p->name, st->no, k);
      else rc->row[s] = base + t * slots[s].offset;
    }
    if (!r && !(r = run_steps(rc, st->sub[0], st->n_sub[0]))) moves_latch(rc, st, &m);
  }
  int e = moves_end(rc, st, &m);
  return r ? r : e;
}

/* Queues the kernels and copies of n steps (host steps in between, in
 * order; control flow run here); with ctx pushed. Stops early once
 * rc->stop is set. */
static int run_steps(run_ctx *rc, const cuda_step *steps, int n) {
  cuda_program *p = rc->p;
  int r = 0;
  for (int s = 0; s < n && !r && !rc->stop; s++) {
    const cuda_step *st = &steps[s];
    char label[64];
    CUresult cr = CUDA_SUCCESS;
    if (st->kind == CUDA_STEP_KERNEL) {
      if (st->grid[0] == 0) continue; /* nothing to do */
      for (int q = 0; q < st->n_bufs; q++) {
        rc->vals[q] = (CUdeviceptr)(uintptr_t)ref_ptr(rc, &st->bufs[q], NULL);
        rc->kp[q] = &rc->vals[q];
      }
      rc->kp[st->n_bufs] = &rc->err;
      cr = cuda_drv.cuLaunchKernel(rc->im->fn[st->no], st->grid[0], st->grid[1], st->grid[2], st->block[0],
                                   st->block[1], st->block[2], st->shared_bytes, rc->stream, rc->kp, NULL);
      if (cr != CUDA_SUCCESS) r = drv_fail(p, kernel_label(st, label, sizeof label), cr, "cuLaunchKernel");
    } else if (st->kind == CUDA_STEP_COPY) {
      const void *host;
      CUdeviceptr dst = (CUdeviceptr)(uintptr_t)ref_ptr(rc, &st->bufs[0], NULL);
      CUdeviceptr src = (CUdeviceptr)(uintptr_t)ref_ptr(rc, &st->bufs[1], &host);
      if (st->bytes <= 0) continue;
      cr = host ? cuda_drv.cuMemcpyHtoDAsync(dst, host, (size_t)st->bytes, rc->stream)
                : cuda_drv.cuMemcpyDtoDAsync(dst, src, (size_t)st->bytes, rc->stream);
      snprintf(label, sizeof label, "step %d (copy)", st->no);
      if (cr != CUDA_SUCCESS) r = drv_fail(p, label, cr, host ? "cuMemcpyHtoDAsync" : "cuMemcpyDtoDAsync");
    } else if (st->kind == CUDA_STEP_HOST) {
      r = host_step(rc, st);
    } else if (st->kind == CUDA_STEP_COND) {
      r = run_cond(rc, st);
    } else if (st->kind == CUDA_STEP_WHILE) {
      r = run_while(rc, st);
    } else {
      r = run_scan(rc, st);
    }
  }
  return r;
}

int cuda_program_launch(cuda_program *p, int gpu, void *const *params, void *const *results) {
  if (!p) return kiln_set_error("cuda: no program");
  if (gpu < 0 || gpu >= cuda_device_count()) return kiln_set_error("cuda: @%s: no gpu:%d", p->name, gpu);
  gpu_image *im = program_image(p, gpu);
  if (!im) return -1;
  bool can_fail = false;
  int max_bufs = 0;
  for (int s = 0; s < p->n_all; s++) {
    can_fail = can_fail || (p->all[s]->kind == CUDA_STEP_KERNEL && p->all[s]->op != OP_COUNT);
    if (p->all[s]->n_bufs > max_bufs) max_bufs = p->all[s]->n_bufs;
  }
  /* the error word lives after the arena */
  size_t arena_bytes = (p->arena_bytes + KILN_ALIGN - 1) / KILN_ALIGN * KILN_ALIGN;
  int32_t cls;
  char who[160];
  snprintf(who, sizeof who, "cuda: @%s", p->name);
  unsigned char *arena = cuda_alloc(who, gpu, arena_bytes + sizeof(int32_t), &cls);
  if (!arena) return -1;
  CUdeviceptr err = (CUdeviceptr)(uintptr_t)(arena + arena_bytes);
  run_ctx rc = {.p = p, .gpu = gpu, .params = params, .results = results, .arena = arena, .im = im, .err = err,
                .can_fail = can_fail};
  rc.row = calloc((size_t)p->n_slots + 1, sizeof *rc.row);
  rc.place = calloc((size_t)p->n_slots + 1, sizeof *rc.place);
  rc.vals = malloc(((size_t)max_bufs + 1) * sizeof *rc.vals);
  rc.kp = malloc(((size_t)max_bufs + 1) * sizeof *rc.kp);
  int r = rc.row && rc.place && rc.vals && rc.kp ? cuda_enter(who, gpu, &rc.stream) : kiln_set_error("cuda: out of memory");
  if (r) {
    free(rc.row), free(rc.place), free(rc.vals), free(rc.kp);
    cuda_free(gpu, arena, cls);
    return -1;
  }
  CUresult cr = CUDA_SUCCESS;
  if (can_fail && (cr = cuda_drv.cuMemsetD8Async(err, 0, sizeof(int32_t), rc.stream)) != CUDA_SUCCESS)
    r = drv_fail(p, "clearing the error word", cr, "cuMemsetD8Async");
  if (!r) r = run_steps(&rc, p->steps, p->n_steps);
  int32_t word = 0;
  if (!r && can_fail) {
    if ((cr = cuda_drv.cuMemcpyDtoHAsync(&word, err, sizeof word, rc.stream)) == CUDA_SUCCESS)
      cr = cuda_drv.cuStreamSynchronize(rc.stream);
    if (cr != CUDA_SUCCESS) r = drv_fail(p, "reading the error word", cr, "cuMemcpyDtoHAsync");
  }
  if (!r && word > 0 && word <= p->n_all && p->all[word - 1]->kind == CUDA_STEP_KERNEL) {
    r = kernel_check_failed(&rc, p->all[word - 1]);
  } else if (!r && word != 0) {
    r = kiln_set_error("cuda: @%s: the kernels raised the error word %d, which names no step", p->name, (int)word);
  }
  cuda_leave();
  cuda_free(gpu, arena, cls); /* stream order: safe while kernels still run */
  free(rc.row), free(rc.place), free(rc.vals), free(rc.kp);
  return r;
}

static int arg_error(const cuda_program *p, int i, const kiln_tensor *t) {
  char want[256], have[256] = "NULL";
  ir_type_str(want, sizeof want, &p->param_types[i]);
  if (t && (t->flags & TF_SYMBOLIC)) {
    snprintf(have, sizeof have, "a symbolic tensor");
  } else if (t) {
    op_type ty = {(kiln_dtype)t->dtype, t->rank, {0}};
    for (int d = 0; d < t->rank; d++) ty.shape[d] = t->shape[d];
    ir_type_str(have, sizeof have, &ty);
  }
  return kiln_set_error("cuda: @%s: argument %d is %s, the parameter is %s", p->name, i, have, want);
}

int cuda_program_run(cuda_program *p, int gpu, kiln_tensor *const *args, kiln_tensor **results) {
  if (!p) return kiln_set_error("cuda: no program");
  if ((p->n_params && !args) || (p->n_results && !results))
    return kiln_set_error("cuda: @%s: args or results is NULL", p->name);
  if (gpu < 0 || gpu >= cuda_device_count()) return kiln_set_error("cuda: @%s: no gpu:%d", p->name, gpu);
  for (int i = 0; i < p->n_params; i++) {
    const kiln_tensor *t = args[i];
    if (!t || (t->flags & TF_SYMBOLIC) || !same_type(t, &p->param_types[i])) return arg_error(p, i, t);
  }
  char who[160];
  snprintf(who, sizeof who, "cuda: @%s", p->name);
  int np = p->n_params, nr = p->n_results, dev = gpu + 1;
  kiln_tensor **moved = calloc((size_t)np + 1, sizeof *moved), **outs = calloc((size_t)nr + 1, sizeof *outs);
  void **pp = calloc((size_t)np + 1, sizeof *pp), **rp = calloc((size_t)nr + 1, sizeof *rp);
  int r = moved && outs && pp && rp ? 0 : kiln_set_error("cuda: out of memory");
  /* arguments that live elsewhere are copied to the GPU first */
  for (int i = 0; !r && i < np; i++) {
    moved[i] = args[i]->device == dev ? kiln_retain(args[i]) : tensor_to_device(who, args[i], dev);
    if (!moved[i]) r = -1;
    else pp[i] = moved[i]->data;
  }
  for (int i = 0; !r && i < nr; i++) {
    if (p->results[i].kind != CUDA_RES_OWN) continue;
    const op_type *t = &p->result_types[i];
    if (!(outs[i] = tensor_alloc_device(who, t->dtype, t->rank, t->shape, dev))) r = -1;
    else rp[i] = outs[i]->data;
  }
  gpu_image *im = r ? NULL : program_image(p, gpu);
  if (!r && !im) r = -1;
  if (!r) r = cuda_program_launch(p, gpu, pp, rp);
  for (int i = 0; outs && i < nr; i++) {
    if (r) {
      kiln_release(outs[i]);
      continue;
    }
    const cuda_result *res = &p->results[i];
    switch (res->kind) {
      case CUDA_RES_OWN: results[i] = scope_own(outs[i]); break;
      case CUDA_RES_PARAM: results[i] = scope_own(kiln_retain(moved[res->index])); break;
      case CUDA_RES_CONST: results[i] = scope_own(kiln_retain(im->res_cst[i])); break;
      default: results[i] = scope_own(kiln_retain(results[res->index])); break;
    }
  }
  for (int i = 0; moved && i < np; i++) kiln_release(moved[i]);
  free(moved);
  free(outs);
  free(pp);
  free(rp);
  return r;
}
