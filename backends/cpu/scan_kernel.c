/* scan_kernel.c — a scan whose body is elementwise (plan_scan_elementwise)
 * as one kernel with the loop over t inside (plan_policy.scan_one_kernel):
 * each task unit is a tile of up to SCAN_COLS elements of the row; the
 * tile's carries live in small arrays (registers once vectorized) across
 * the loop over t, inside which the body's values are computed for every
 * element of the tile by the element emitter (that innermost loop runs
 * along contiguous memory and vectorizes), the xs read and the ys written
 * at row t. A cumulative sum, a moving average, a leaky integrator: no
 * call, no pass over the carries in memory per step. */
#include <stdlib.h>

#include "cpu/compile.h"

enum {
  SCAN_COLS = 4096,   /* elements of a tile: its carries stay in L1 (or registers) */
  SCAN_INSTRS = 64,  /* a body of at most this many instructions (fusions' included) */
  /* rows of at most this many elements: wider, a loop over the body's
   * kernel (its state in place) went as fast or faster (cumsum, ms per
   * call, one kernel vs loop: rows of 16 0.48 vs 0.97, of 256 1.5 vs 3.1,
   * of 1024 1.9 vs 1.4, of 4096 1.6 vs 1.3, measured) */
  SCAN_ROW_MAX = 512,
};

bool cpu_scan_one_kernel(const ir_func *f, const ir_instr *in) {
  return cpu_scan_one_kernel_any(f, in) && plan_type_size(&in->attrs.callee->types[0]) <= SCAN_ROW_MAX;
}

bool cpu_scan_one_kernel_any(const ir_func *f, const ir_instr *in) {
  return plan_scan_elementwise(f, in, SCAN_INSTRS);
}

/* ORs g->bad into the kernel's flag (first failing op in *bad_op) */
static void flush(llvm_emit *e, llvm_group *g, LLVMValueRef bad_slot, op_id *bad_op) {
  if (g->bad_op != OP_COUNT && *bad_op == OP_COUNT) *bad_op = g->bad_op;
  if (!g->bad) return;
  LLVMValueRef old = LLVMBuildLoad2(e->b, e->t_i1, bad_slot, "");
  LLVMBuildStore(e->b, LLVMBuildOr(e->b, old, g->bad, ""), bad_slot);
  g->bad = NULL;
}

int cpu_emit_scan_kernel(cpu_build *cb, const plan_kernel *g, LLVMValueRef fn, LLVMValueRef *buf, LLVMValueRef begin,
                         LLVMValueRef end, LLVMValueRef bad_slot, kinfo *ki, op_id *bad_op) {
  llvm_emit *e = &cb->e;
  LLVMBuilderRef b = e->b;
  const ir_instr *sc = g->special;
  const ir_func *body = sc->attrs.callee;
  int nc = sc->attrs.n_state, nx = sc->attrs.n_xs, ny = sc->n_out - nc, nr = body->n_results;
  int64_t T = sc->attrs.trip, n = plan_type_size(&body->types[0]);
  int64_t cols = n < SCAN_COLS ? n : SCAN_COLS;
  ki->units = cols > 0 ? (n + cols - 1) / cols : 0;
  ki->per_unit = cols * (T > 0 ? T : 1);
  if (ki->units == 0) return 0;
  /* the groups: the body's (its captures read from their buffers), one per fusion */
  LLVMValueRef *bbuf = calloc((size_t)body->n_values + 1, sizeof *bbuf), *vals = calloc((size_t)nr + 1, sizeof *vals);
  LLVMValueRef *acc = calloc((size_t)nc + 1, sizeof *acc);
  llvm_group bg = {.e = e, .f = body, .buf = bbuf};
  llvm_group *fg = calloc((size_t)body->n_instrs + 1, sizeof *fg);
  if (!bbuf || !vals || !acc || !fg) {
    free(bbuf), free(vals), free(acc), free(fg);
    return cpu_oom();
  }
  int rc = 0;
  for (int k = nc + nx; k < sc->n_in; k++) bbuf[k] = buf[sc->in[k]];
  llvm_group_init(&bg);
  for (int i = 0; i < body->n_instrs && !rc; i++) {
    const ir_instr *in = &body->instrs[i];
    if (in->op != OP_FUSION) continue;
    const ir_func *c = in->attrs.callee;
    LLVMValueRef *cbuf = calloc((size_t)c->n_values + 1, sizeof *cbuf);
    if (!cbuf) {
      rc = cpu_oom();
      break;
    }
    for (int k = 0; k < in->n_in; k++) cbuf[k] = bbuf[in->in[k]]; /* a capture's buffer, else NULL: given per element */
    fg[i] = (llvm_group){.e = e, .f = c, .buf = cbuf};
    llvm_group_init(&fg[i]);
  }
  const op_type *s = &body->types[0];
  for (int k = 0; k < nc && !rc; k++) {
    acc[k] = LLVMBuildAlloca(b, LLVMArrayType2(llvm_memory_type(e, body->types[k].dtype), (uint64_t)cols), "carry");
    LLVMSetAlignment(acc[k], 64);
  }
  llvm_loop lu, lj, lt;
  LLVMValueRef u = rc ? NULL : llvm_loop_begin(e, &lu, begin, end, "tile");
  LLVMValueRef j0 = NULL, w = NULL;
  if (!rc) {
    j0 = LLVMBuildMul(b, u, llvm_i64(e, cols), "");
    LLVMValueRef left = LLVMBuildSub(b, llvm_i64(e, n), j0, "");
    w = n % cols == 0 ? llvm_i64(e, cols) /* every tile whole: a static trip count */
                      : LLVMBuildSelect(b, LLVMBuildICmp(b, LLVMIntSLT, left, llvm_i64(e, cols), ""), left,
                                        llvm_i64(e, cols), "");
    /* the carries in: the scan's first operands */
    LLVMValueRef jj = llvm_loop_begin(e, &lj, llvm_i64(e, 0), w, "in");
    for (int k = 0; k < nc; k++) {
      kiln_dtype dt = body->types[k].dtype;
      llvm_emit_store(e, dt, acc[k], jj, llvm_emit_load(e, dt, buf[sc->in[k]], LLVMBuildAdd(b, j0, jj, "")));
    }
    llvm_loop_end(e, &lj);
    /* t = 0 .. T-1 (from the end when reversed), each element of the tile */
    LLVMValueRef t = llvm_loop_begin(e, &lt, llvm_i64(e, 0), llvm_i64(e, T), "t");
    if (sc->attrs.reverse) t = LLVMBuildSub(b, llvm_i64(e, T - 1), t, "");
    LLVMValueRef rowbase = LLVMBuildAdd(b, LLVMBuildMul(b, t, llvm_i64(e, n), ""), j0, "");
    jj = llvm_loop_begin(e, &lj, llvm_i64(e, 0), w, "j");
    llvm_index idx;
    llvm_index_linear(&idx, s, LLVMBuildAdd(b, j0, jj, ""));
    LLVMValueRef at = LLVMBuildAdd(b, rowbase, jj, "");
    for (int k = 0; k < nc; k++) llvm_group_set(&bg, k, &idx, llvm_emit_load(e, body->types[k].dtype, acc[k], jj));
    for (int k = nc; k < nc + nx; k++)
      llvm_group_set(&bg, k, &idx, llvm_emit_load(e, body->types[k].dtype, buf[sc->in[k]], at));
    rc = llvm_scan_body_values(body, &bg, fg, &idx, vals);
    if (!rc) { /* every value first, then the stores (a carry may be another's new value) */
      for (int k = 0; k < nc; k++) llvm_emit_store(e, body->types[k].dtype, acc[k], jj, vals[k]);
      for (int k = 0; k < ny; k++)
        llvm_emit_store(e, body->types[body->results[nc + k]].dtype, LLVMGetParam(fn, (unsigned)(nc + k)), at,
                        vals[nc + k]);
    }
    flush(e, &bg, bad_slot, bad_op);
    for (int i = 0; i < body->n_instrs; i++)
      if (fg[i].f) flush(e, &fg[i], bad_slot, bad_op), llvm_group_forget(&fg[i]);
    llvm_group_forget(&bg);
  }
  if (!rc) {
    llvm_loop_end(e, &lj);
    llvm_loop_end(e, &lt);
    /* the carries out: the scan's first results */
    LLVMValueRef jj = llvm_loop_begin(e, &lj, llvm_i64(e, 0), w, "out");
    for (int k = 0; k < nc; k++) {
      kiln_dtype dt = body->types[k].dtype;
      LLVMValueRef v = llvm_emit_load(e, dt, acc[k], jj);
      llvm_emit_store(e, dt, LLVMGetParam(fn, (unsigned)k), LLVMBuildAdd(b, j0, jj, ""), v);
    }
    llvm_loop_end(e, &lj);
    llvm_loop_end(e, &lu);
  }
  for (int i = 0; i < body->n_instrs; i++)
    if (fg[i].f) free(fg[i].buf), llvm_group_dispose(&fg[i]);
  llvm_group_dispose(&bg);
  free(bbuf), free(vals), free(acc), free(fg);
  return rc;
}
