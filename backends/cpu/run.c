/* run.c — running compiled CPU programs: argument checks, result tensors
 * and the per-call arena around one call of the entry function; and the
 * runtime helpers the generated code calls: the eager kernels over raw
 * buffers (dot, gather, random draws, ...), host callbacks, and the message
 * of a kernel that failed. */
#include <stdio.h>
#include <stdlib.h>

#include "cpu/cpu.h"
#include "dist.h"
#include "raw_call.h"

static int arg_error(const cpu_program *p, int i, const kiln_tensor *t) {
  char want[256], have[256] = "NULL";
  ir_type_str(want, sizeof want, &p->param_types[i]);
  if (t && (t->flags & TF_SYMBOLIC)) {
    snprintf(have, sizeof have, "a symbolic tensor");
  } else if (t && t->device != 0) {
    snprintf(have, sizeof have, "a tensor on device %d", t->device);
  } else if (t) {
    op_type ty;
    op_type_of(t, &ty);
    ir_type_str(have, sizeof have, &ty);
  }
  return kiln_set_error("cpu: @%s: argument %d is %s, the parameter is %s", p->name, i, have, want);
}

/* KILN_POISON=1 (tests, debugging): every call starts with its arena and
 * its new result buffers filled with 0xff bytes (NaN, -1, true), so code
 * that reads a buffer before writing it, or after another value took it
 * over, gives visibly wrong results instead of yesterday's right ones. Read
 * once per process. */
static bool poison_buffers(void) {
  static _Atomic int state; /* 0 unread, 1 off, 2 on */
  int s = atomic_load_explicit(&state, memory_order_relaxed);
  if (!s) {
    const char *env = getenv("KILN_POISON");
    s = env && !strcmp(env, "1") ? 2 : 1;
    atomic_store_explicit(&state, s, memory_order_relaxed);
  }
  return s == 2;
}

int cpu_run(cpu_program *p, kiln_tensor *const *args, kiln_tensor **results) {
  return cpu_run_donating(p, args, results, NULL);
}

int cpu_program_donor(const cpu_program *p, int r) {
  return p && p->donor && r >= 0 && r < p->n_results ? p->donor[r] : -1;
}

int cpu_run_donating(cpu_program *p, kiln_tensor *const *args, kiln_tensor **results, const bool *donate) {
  if (!p) return kiln_set_error("cpu: no program");
  if ((p->n_params && !args) || (p->n_results && !results))
    return kiln_set_error("cpu: @%s: args or results is NULL", p->name);
  for (int i = 0; i < p->n_params; i++) {
    const kiln_tensor *t = args[i];
    if (!t || (t->flags & TF_SYMBOLIC) || t->device != 0 || !op_type_is(t, &p->param_types[i]))
      return arg_error(p, i, t);
  }
  enum { SMALL = 16 };
  void *small_p[SMALL], *small_r[SMALL];
  kiln_tensor *small_o[SMALL];
  void **pp = p->n_params <= SMALL ? small_p : malloc((size_t)p->n_params * sizeof *pp);
  void **rp = p->n_results <= SMALL ? small_r : malloc((size_t)p->n_results * sizeof *rp);
  kiln_tensor **outs = p->n_results <= SMALL ? small_o : calloc((size_t)p->n_results, sizeof *outs);
  int rc = 0;
  bool poison = poison_buffers();
  if (!pp || !rp || !outs) rc = kiln_set_error("cpu: out of memory");
  for (int i = 0; !rc && i < p->n_params; i++) pp[i] = args[i]->data;
  for (int r = 0; !rc && r < p->n_results; r++) {
    outs[r] = NULL;
    rp[r] = NULL;
    if (p->results[r].kind != CPU_RES_OWN) continue;
    int q = donate ? cpu_program_donor(p, r) : -1;
    if (q >= 0 && donate[q]) { /* written in place: a new value, so a new serial */
      args[q]->serial = tensor_new_serial();
      outs[r] = kiln_retain(args[q]);
      rp[r] = outs[r]->data;
      continue;
    }
    const op_type *t = &p->result_types[r];
    if (!(outs[r] = tensor_alloc("cpu", t->dtype, t->rank, t->shape))) rc = -1;
    if (outs[r]) rp[r] = outs[r]->data;
    if (outs[r] && poison) memset(rp[r], 0xff, (size_t)outs[r]->size * kiln_dtype_size(outs[r]->dtype));
  }
  int32_t cls = 0;
  _Alignas(KILN_ALIGN) char none[KILN_ALIGN]; /* kernels may assume 64-byte alignment */
  void *arena = none;
  if (!rc && p->arena_bytes) {
    void *spare = __atomic_exchange_n(&p->spare_arena, NULL, __ATOMIC_ACQUIRE);
    if (spare) {
      arena = spare, cls = __atomic_load_n(&p->arena_cls, __ATOMIC_RELAXED);
    } else if (!(arena = mem_alloc(p->arena_bytes, &cls))) {
      rc = kiln_set_error("cpu: @%s: out of memory for a %zu-byte arena", p->name, p->arena_bytes);
    }
  }
  if (!rc && poison && arena != none) memset(arena, 0xff, p->arena_bytes);
  dist_job *small_j[SMALL], **jobs = NULL; /* per helper: its collective in flight */
  if (!rc && p->collectives) {
    jobs = p->n_helpers <= SMALL ? small_j : malloc((size_t)p->n_helpers * sizeof *jobs);
    if (!jobs) rc = kiln_set_error("cpu: out of memory");
    for (int h = 0; jobs && h < p->n_helpers; h++) jobs[h] = NULL;
  }
  if (!rc) {
    cpu_call call = {0, -1, p, jobs, args, donate};
    rc = p->entry(pp, rp, arena, &call);
    if (rc && !kiln_has_error()) kiln_set_error("cpu: @%s failed", p->name);
  }
  /* a step that failed leaves the collectives it passed in flight: they end
   * before their buffers go (the failure's message stays) */
  for (int h = 0; jobs && h < p->n_helpers; h++) dist_async_wait(jobs[h], false);
  if (jobs != small_j) free(jobs);
  if (arena && arena != none) { /* kept for the next call, unless another call's already is */
    void *empty = NULL;
    __atomic_store_n(&p->arena_cls, cls, __ATOMIC_RELAXED);
    if (!__atomic_compare_exchange_n(&p->spare_arena, &empty, arena, false, __ATOMIC_RELEASE, __ATOMIC_RELAXED))
      mem_free(arena, cls);
  }
  for (int r = 0; outs && r < p->n_results; r++) {
    if (rc) {
      kiln_release(outs[r]);
      continue;
    }
    const cpu_result *res = &p->results[r];
    switch (res->kind) {
      case CPU_RES_OWN: results[r] = scope_own(outs[r]); break;
      case CPU_RES_PARAM: results[r] = scope_own(kiln_retain(args[res->index])); break;
      case CPU_RES_CONST: results[r] = scope_own(kiln_retain(res->cst)); break;
      default: results[r] = scope_own(kiln_retain(results[res->index])); break;
    }
  }
  if (pp != small_p) free(pp);
  if (rp != small_r) free(rp);
  if (outs != small_o) free(outs);
  return rc;
}

/* ---- helpers called by generated code ---- */

/* A C callback: its inputs are copied into real tensors (it may keep
 * them), its outputs checked as the interpreter does and copied out. */
static int run_host(const cpu_helper *h, void **bufs) {
  if (!h->host_fn)
    return kiln_set_error(
        "host_call: @%s: no callback is bound (IR read from text, and the process has no "
        "symbol of that name)",
        h->host_name);
  kiln_tensor **io = calloc((size_t)(h->n_in + h->n_out) + 1, sizeof *io);
  if (!io) return kiln_set_error("host_call: out of memory");
  kiln_tensor **ins = io, **outs = io + h->n_in;
  int rc = 0;
  kiln_scope_push();
  for (int k = 0; k < h->n_in && !rc; k++) {
    const op_type *t = &h->in_types[k];
    kiln_tensor *x = tensor_alloc("host_call", t->dtype, t->rank, t->shape);
    if (!x) {
      rc = -1;
      break;
    }
    memcpy(x->data, bufs[h->n_out + k], tensor_bytes(x));
    ins[k] = scope_own(x);
  }
  if (!rc && h->host_fn(h->host_user, h->n_in, ins, h->n_out, outs)) {
    if (!kiln_has_error()) kiln_set_error("host_call: @%s failed without an error", h->host_name);
    rc = -1;
  }
  for (int k = 0; k < h->n_out && !rc; k++) {
    const kiln_tensor *t = outs[k];
    if (!t || (t->flags & TF_SYMBOLIC) || t->device != 0 || !op_type_is(t, &h->out_types[k])) {
      char w[256], g[256] = "NULL";
      ir_type_str(w, sizeof w, &h->out_types[k]);
      if (t) {
        op_type ty;
        op_type_of(t, &ty);
        ir_type_str(g, sizeof g, &ty);
      }
      rc = kiln_set_error("host_call: @%s returned %s for output %d, declared %s", h->host_name, g, k, w);
      break;
    }
    memcpy(bufs[k], t->data, tensor_bytes(t));
  }
  kiln_scope_pop();
  free(io);
  return rc;
}

int cpu_rt_helper(cpu_call *call, int32_t index, void **bufs) {
  if (index < 0) { /* the wait of helper -1 - index's collective (overlap.c) */
    dist_job **job = &call->jobs[-1 - index];
    int rc = dist_async_wait(*job, true);
    *job = NULL;
    return rc;
  }
  const cpu_helper *h = &call->prog->helpers[index];
  if (kiln_ops[h->op].kind == OPK_HOST) return run_host(h, bufs);
  if (kiln_ops[h->op].kind == OPK_COLLECTIVE) /* started; waited for by a later step */
    return dist_staged_start(h->op, &h->attrs, h->in_types, h->out_types, bufs[1], bufs[0], &call->jobs[index]);
  raw_call c = {h->op, &h->attrs, h->n_in, h->n_out, h->in_types, h->out_types, h->epilogue, h->trans_a, h->trans_b,
                NULL};
  /* a convolution's filter that is a parameter (a variable's value, a
   * capture) reads as that tensor, serial included: its packing is then
   * kept across calls (conv_cache.c), as an eager call's is. Not one this
   * call writes over in place: its serial is already the new value's. */
  uint64_t serials[4] = {0}; /* a convolution's inputs: x, the filter, a bias, a residual */
  if ((h->op == OP_CONV2D || h->op == OP_CONV2D_BP_INPUT) && h->n_in <= 4) {
    const void *f = h->n_in > 1 ? bufs[h->n_out + 1] : NULL;
    for (int i = 0; f && call->args && i < call->prog->n_params; i++)
      if (call->args[i]->data == f && op_type_is(call->args[i], &h->in_types[1]) &&
          !(call->donate && call->donate[i])) {
        serials[1] = call->args[i]->serial;
        c.serials = serials;
        break;
      }
  }
  return raw_call_run(&c, bufs);
}

void cpu_rt_kernel_fail(cpu_call *call, int32_t kernel) {
  op_id op = call->prog->kernel_fail_op[kernel];
  /* the only check a compiled kernel makes today */
  kiln_set_error("%s: integer division by zero", op < OP_COUNT ? kiln_ops[op].api : "cpu");
}

/* ---- the program ---- */

int cpu_program_kernels(const cpu_program *p) { return p ? p->n_kernels : 0; }
int cpu_program_chains(const cpu_program *p) { return p ? p->n_chains : 0; }
double cpu_program_compile_ms(const cpu_program *p) { return p ? p->compile_ms : 0; }
bool cpu_program_from_cache(const cpu_program *p) { return p && p->from_cache; }
int cpu_program_parts(const cpu_program *p) { return p ? p->parts : 0; }

void cpu_program_free(cpu_program *p) {
  if (!p) return;
  cpu_jit_forget(p->jit_lib);
  if (p->spare_arena) mem_free(p->spare_arena, p->arena_cls);
  for (int i = 0; i < p->n_consts; i++) kiln_release(p->consts[i]);
  for (int i = 0; i < p->n_helpers; i++) {
    free(p->helpers[i].in_types);
    free(p->helpers[i].out_types);
    free(p->helpers[i].host_name);
  }
  free(p->consts);
  free(p->helpers);
  free(p->results);
  free(p->param_types);
  free(p->result_types);
  free(p->kernel_fail_op);
  free(p->donor);
  free(p->bitcode);
  free(p->name);
  free(p);
}
