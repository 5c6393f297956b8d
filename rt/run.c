/* run.c — libkiln_rt: what an object from kiln-aot calls at run time, with
 * no LLVM and no libkiln. NAME_run hands its program record (rt.h) to
 * kiln_rt_run, which checks the buffers and runs the entry over an arena
 * kept per thread; the entry's code calls back for the thread pool, the
 * runtime helpers (the eager kernels over raw buffers, lib/raw_call.c) and
 * the message of a kernel that failed. Errors are the thread's message
 * (lib/error.c), read by kiln_rt_last_error. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>

#include "raw_call.h"
#include "rt.h"

/* ---- the arena: one per thread, kept between calls ---- */

typedef struct {
  void *mem;
  size_t bytes;
  int32_t cls;
} arena;

static _Thread_local arena spare;
static pthread_key_t spare_key;
static pthread_once_t spare_once = PTHREAD_ONCE_INIT;

static void spare_free(void *arg) {
  arena *a = arg;
  mem_free(a->mem, a->cls);
  a->mem = NULL, a->bytes = 0;
}

static void spare_key_init(void) { pthread_key_create(&spare_key, spare_free); }

/* The thread's arena of at least bytes (64-byte aligned); NULL out of memory. */
static void *arena_get(size_t bytes) {
  if (spare.mem && spare.bytes >= bytes) return spare.mem;
  if (!spare.mem) { /* freed when the thread ends */
    pthread_once(&spare_once, spare_key_init);
    pthread_setspecific(spare_key, &spare);
  }
  spare_free(&spare);
  if (!(spare.mem = mem_alloc(bytes, &spare.cls))) return NULL;
  spare.bytes = bytes;
  return spare.mem;
}

/* ---- running ---- */

static bool record_fits(const kiln_rt_program_rec *p) {
  return p->magic == KILN_RT_MAGIC && p->version == KILN_RT_VERSION && p->attrs_size == sizeof(op_attrs) &&
         p->type_size == sizeof(op_type) && p->op_count == OP_COUNT;
}

KILN_EXPORT int kiln_rt_run(const kiln_rt_program_rec *p, const void *const *inputs, void *const *outputs) {
  if (!p) return kiln_set_error("kiln_rt_run: no program");
  if (!record_fits(p))
    return kiln_set_error("%s_run: the object was written by a kiln-aot of another Kiln build (record version %u, "
                          "this libkiln_rt reads version %u of this build's layout)",
                          p->name, p->version, KILN_RT_VERSION);
  if ((p->n_in && !inputs) || (p->n_out && !outputs))
    return kiln_set_error("%s_run: %s is NULL", p->name, p->n_in && !inputs ? "inputs" : "outputs");
  for (int i = 0; i < p->n_in; i++)
    if (!inputs[i] || (uintptr_t)inputs[i] % KILN_ALIGN)
      return kiln_set_error("%s_run: input %d is %s", p->name, i, inputs[i] ? "not 64-byte aligned" : "NULL");
  for (int r = 0; r < p->n_out; r++)
    if (!outputs[r] || (uintptr_t)outputs[r] % KILN_ALIGN)
      return kiln_set_error("%s_run: output %d is %s", p->name, r, outputs[r] ? "not 64-byte aligned" : "NULL");
  enum { SMALL = 16 };
  void *small_p[SMALL], *small_r[SMALL];
  void **params = p->n_params <= SMALL ? small_p : malloc((size_t)p->n_params * sizeof *params);
  void **results = p->n_out <= SMALL ? small_r : malloc((size_t)p->n_out * sizeof *results);
  int rc = 0;
  if (!params || !results) rc = kiln_set_error("%s_run: out of memory", p->name);
  for (int i = 0; !rc && i < p->n_params; i++) /* the code only reads its parameters */
    params[i] = i < p->n_in ? (void *)(uintptr_t)inputs[i] : (void *)(uintptr_t)p->data[i - p->n_in];
  for (int r = 0; !rc && r < p->n_out; r++) results[r] = p->results[r].kind == KILN_RT_RES_OWN ? outputs[r] : NULL;
  _Alignas(KILN_ALIGN) char none[KILN_ALIGN]; /* kernels may assume 64-byte alignment */
  void *mem = none;
  if (!rc && p->arena_bytes && !(mem = arena_get(p->arena_bytes)))
    rc = kiln_set_error("%s_run: out of memory for a %llu-byte arena", p->name, (unsigned long long)p->arena_bytes);
  if (!rc) {
    kiln_rt_call call = {0, -1, p};
    char msg[1024] = "";
    if (p->entry(params, results, mem, &call)) {
      snprintf(msg, sizeof msg, "%s", kiln_has_error() ? kiln_last_error() : "failed");
      rc = kiln_set_error("%s_run: %s", p->name, msg);
    }
  }
  for (int r = 0; !rc && r < p->n_out; r++) { /* outputs the entry does not write */
    const kiln_rt_result_rec *res = &p->results[r];
    const void *from = res->kind == KILN_RT_RES_PARAM   ? params[res->index]
                       : res->kind == KILN_RT_RES_CONST ? res->data
                       : res->kind == KILN_RT_RES_SAME  ? outputs[res->index]
                                                        : NULL;
    if (from && res->bytes) memcpy(outputs[r], from, res->bytes);
  }
  if (params != small_p) free(params);
  if (results != small_r) free(results);
  return rc;
}

/* ---- what the generated code calls ---- */

KILN_EXPORT void kiln_rt_parallel_for(int64_t n, int64_t grain, void (*fn)(void *, int64_t, int64_t), void *ctx) {
  parallel_for(n, grain, fn, ctx);
}

KILN_EXPORT int32_t kiln_rt_helper(kiln_rt_call *call, int32_t index, void **bufs) {
  if (index < 0) return 0; /* a collective's wait (the JIT's overlap.c): this runtime has none in flight */
  const kiln_rt_helper_rec *h = &call->prog->helpers[index];
  const op_type *types = h->types;
  raw_call c = {(op_id)h->op, h->attrs, h->n_in, h->n_out, types, types + h->n_in, h->epilogue,
                h->trans_a != 0, h->trans_b != 0, NULL};
  return raw_call_run(&c, bufs);
}

KILN_EXPORT void kiln_rt_kernel_fail(kiln_rt_call *call, int32_t kernel) {
  int32_t op = call->prog->kernel_fail_op[kernel];
  /* the only check a compiled kernel makes today (as the JIT's cpu_rt_kernel_fail) */
  kiln_set_error("%s: integer division by zero", op >= 0 && op < OP_COUNT ? kiln_ops[op].api : "kernel");
}

KILN_EXPORT const char *kiln_rt_last_error(void) { return kiln_last_error(); }
