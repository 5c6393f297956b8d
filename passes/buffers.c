/* buffers.c — buffer assignment: places every temporary of a function in one
 * arena, as XLA's heap simulator and TFLite's greedy arena planner do. The
 * schedule is the function's kernels in order (fusions and unfused
 * instructions); a temporary lives from its kernel to its last reader; an
 * elementwise kernel writes over an operand that dies at it when the bytes
 * match; buffers then go best-fit, in two orders (largest first, earliest
 * first), and the smaller arena wins. Parameters, results and constants
 * stay outside the arena. A view (identity, stop_gradient, reshape) is an
 * alias: it gets its base's buffer, and the base lives until the last
 * reader of any of its views, or to the end when a view is returned (the
 * backends copy such a result out after the last kernel). The plan is
 * ir_func.buf_offset.
 *
 * Control flow (cond, while, scan) is one step of the schedule whose
 * results are ordinary temporaries, never written over an operand
 * (can_share); its operands live until it is done. Each region gets a plan
 * of its own when the pass manager runs this pass over it (manager.c): its
 * temporaries live in that region's arena for one run of it, which is how
 * the interpreter replays them under KILN_POISON. */
#include <stdlib.h>
#include <string.h>

#include "buffers.h"
#include "rewrite.h"

/* ---- liveness ---- */

/* A temporary: made by a kernel, not a result (results never share memory
 * with temporaries), not a constant (constants live in the program). */
static bool is_temporary(const ir_func *f, const bool *is_result, ir_value v) {
  const ir_instr *d = ir_def(f, v);
  return d && d->op != OP_CONSTANT && !is_result[v];
}

/* A view whose bytes are a temporary's: it lives in that buffer. */
static bool is_alias(const ir_func *f, const bool *is_result, ir_value v) {
  ir_value b = ir_alias_base(f, v);
  return b != v && is_temporary(f, is_result, b);
}

/* each value's last reader (instruction index); its own step when unread */
static void last_uses(const ir_func *f, int32_t *last) {
  for (int v = 0; v < f->n_values; v++) last[v] = f->def[v];
  for (int i = 0; i < f->n_instrs; i++)
    for (int k = 0; k < f->instrs[i].n_in; k++) last[f->instrs[i].in[k]] = i;
}

/* last_uses over aliases: a base's bytes are read until the last reader
 * of any view of it, and until after the last instruction (n_instrs) when
 * a view of it is a result. Views get their base's figure. */
static void alias_last_uses(const ir_func *f, const bool *is_result, int32_t *last) {
  last_uses(f, last);
  for (int v = 0; v < f->n_values; v++) {
    ir_value b = ir_alias_base(f, v);
    int32_t end = b != v && is_result[v] ? f->n_instrs : last[v];
    if (end > last[b]) last[b] = end;
  }
  for (int v = 0; v < f->n_values; v++) last[v] = last[ir_alias_base(f, v)];
}

/* ---- in-place reuse ---- */

static bool elementwise_kind(op_kind k) {
  return k == OPK_UNARY || k == OPK_BINARY || k == OPK_COMPARE || k == OPK_SELECT || k == OPK_CONVERT ||
         k == OPK_VIEW; /* identity and reshape keep the row-major order */
}

/* May the kernel body g write result r over its parameters marked in
 * param? Only a loop kernel (no dot, reduction or opaque op), and only when
 * every instruction that reads the operand, directly or not, is elementwise
 * over as many elements as it has: each element is then read before the
 * same element of the output is written, and never after. */
static bool body_writes_in_place(const ir_func *g, const bool *param, int64_t elems) {
  bool *dep = calloc((size_t)g->n_values + 1, sizeof *dep);
  if (!dep) return false;
  bool ok = true;
  for (int v = 0; v < g->n_params; v++) dep[v] = param[v];
  for (int i = 0; i < g->n_instrs && ok; i++) {
    const ir_instr *in = &g->instrs[i];
    op_kind k = kiln_ops[in->op].kind;
    if (!(elementwise_kind(k) || k == OPK_MOVE || k == OPK_CONST || k == OPK_SOURCE) || in->n_out != 1) {
      ok = false;
      break;
    }
    bool d = false;
    for (int j = 0; j < in->n_in; j++) d |= dep[in->in[j]];
    if (d && (!elementwise_kind(k) || pass_elems(&g->types[in->out]) != elems)) ok = false;
    dep[in->out] = d;
  }
  free(dep);
  return ok;
}

/* May instruction ins write its result k over operand x (which dies at it,
 * and has as many bytes)? */
static bool can_share(const ir_func *f, const ir_instr *ins, int k, ir_value x) {
  int64_t elems = pass_elems(&f->types[x]);
  if (pass_elems(&f->types[ins->out + k]) != elems) return false;
  op_kind kind = kiln_ops[ins->op].kind;
  if (elementwise_kind(kind)) return true;
  if (ins->op != OP_FUSION || !ins->attrs.callee) return false;
  const ir_func *g = ins->attrs.callee;
  /* A kernel of several results stores each as soon as it is computed,
   * and may read the operand again for a later one: only one result may
   * go over an operand, and only a kernel's sole result (found by
   * tests/user_programs_test.cc, seed 134: a gradient's sign flipped) */
  if (g->n_results > 1) return false;
  bool small[16] = {false}, *param = g->n_params > 16 ? calloc((size_t)g->n_params, sizeof *param) : small;
  if (!param) return false;
  for (int j = 0; j < ins->n_in && j < g->n_params; j++) param[j] = ins->in[j] == x;
  bool ok = body_writes_in_place(g, param, elems);
  if (param != small) free(param);
  return ok;
}

/* ---- placement ---- */

typedef struct pl_buf {
  int64_t size, off;
  int32_t start, end; /* live over steps start..end */
  int32_t id;
} pl_buf;

static int by_size(const void *a, const void *b) {
  const pl_buf *x = *(pl_buf *const *)a, *y = *(pl_buf *const *)b;
  if (x->size != y->size) return x->size > y->size ? -1 : 1;
  if (x->start != y->start) return x->start < y->start ? -1 : 1;
  return (x->id > y->id) - (x->id < y->id);
}

static int by_first_use(const void *a, const void *b) {
  const pl_buf *x = *(pl_buf *const *)a, *y = *(pl_buf *const *)b;
  if (x->start != y->start) return x->start < y->start ? -1 : 1;
  if (x->size != y->size) return x->size > y->size ? -1 : 1;
  return (x->id > y->id) - (x->id < y->id);
}

static int by_offset(const void *a, const void *b) {
  const pl_buf *x = *(pl_buf *const *)a, *y = *(pl_buf *const *)b;
  return (x->off > y->off) - (x->off < y->off);
}

/* Places the buffers in the order given, each in the smallest gap between
 * the buffers already placed that live at the same time (best fit), or
 * above them all; writes each off and returns the arena size. tmp holds n
 * pointers. */
static int64_t place(pl_buf **order, int n, pl_buf **tmp) {
  int64_t arena = 0;
  for (int i = 0; i < n; i++) {
    pl_buf *b = order[i];
    int nt = 0;
    for (int j = 0; j < i; j++)
      if (order[j]->start <= b->end && b->start <= order[j]->end && order[j]->size) tmp[nt++] = order[j];
    qsort(tmp, (size_t)nt, sizeof *tmp, by_offset);
    int64_t cur = 0, best = -1, best_gap = 0;
    for (int j = 0; j < nt; j++) {
      int64_t gap = tmp[j]->off - cur;
      if (gap >= b->size && (best < 0 || gap < best_gap)) best = cur, best_gap = gap;
      if (tmp[j]->off + tmp[j]->size > cur) cur = tmp[j]->off + tmp[j]->size;
    }
    b->off = b->size == 0 ? 0 : best >= 0 ? best : cur;
    if (b->off + b->size > arena) arena = b->off + b->size;
  }
  return arena;
}

/* ---- the pass ---- */

int kiln_pass_buffers(ir_func *f) {
  if (!f) return kiln_set_error("buffers: no function");
  ir_plan_drop(f);
  if (pass_is_kernel_body(f)) return 0; /* its values live in registers */
  int nv = f->n_values, rc = 0;
  bool *is_result = calloc((size_t)nv + 1, sizeof *is_result), *taken = calloc((size_t)nv + 1, sizeof *taken);
  int32_t *last = malloc(((size_t)nv + 1) * sizeof *last), *root = malloc(((size_t)nv + 1) * sizeof *root);
  int32_t *buf_of = malloc(((size_t)nv + 1) * sizeof *buf_of);
  pl_buf *bufs = malloc(((size_t)nv + 1) * sizeof *bufs);
  pl_buf **order = malloc(((size_t)nv + 1) * sizeof *order), **tmp = malloc(((size_t)nv + 1) * sizeof *tmp);
  int64_t *off_a = malloc(((size_t)nv + 1) * sizeof *off_a);
  int64_t *plan = malloc(((size_t)nv + 1) * sizeof *plan);
  if (!is_result || !taken || !last || !root || !buf_of || !bufs || !order || !tmp || !off_a || !plan) {
    rc = kiln_set_error("buffers: out of memory");
    goto done;
  }
  for (int r = 0; r < f->n_results; r++) is_result[f->results[r]] = true;
  alias_last_uses(f, is_result, last);
  /* in-place reuse: each result of a kernel may take over the buffer of an
   * operand that dies there, one operand per result */
  for (int v = 0; v < nv; v++) root[v] = v;
  for (int i = 0; i < f->n_instrs; i++) {
    const ir_instr *ins = &f->instrs[i];
    for (int k = 0; k < ins->n_out; k++) {
      ir_value o = ins->out + k;
      if (!is_temporary(f, is_result, o) || ir_alias_base(f, o) != o) continue;
      for (int j = 0; j < ins->n_in; j++) {
        ir_value x = ins->in[j], b = ir_alias_base(f, x); /* x's bytes are b's */
        if (!is_temporary(f, is_result, b) || last[x] != i || taken[root[b]] ||
            ir_type_bytes(&f->types[x]) != ir_type_bytes(&f->types[o]) || !can_share(f, ins, k, x))
          continue;
        root[o] = root[b];
        taken[root[b]] = true; /* until this kernel is done: one result per operand */
        break;
      }
    }
    for (int j = 0; j < ins->n_in; j++) taken[root[ir_alias_base(f, ins->in[j])]] = false;
    for (int k = 0; k < ins->n_out; k++) taken[root[ins->out + k]] = false;
  }
  /* one buffer per root, live from its first kernel to the last reader of
   * any value in it */
  int nb = 0;
  for (int v = 0; v < nv; v++) {
    buf_of[v] = -1;
    if (ir_alias_base(f, v) != v) { /* a view lives where its base does, returned or not */
      if (is_alias(f, is_result, v)) buf_of[v] = buf_of[ir_alias_base(f, v)];
      continue;
    }
    if (!is_temporary(f, is_result, v)) continue;
    if (root[v] == v) {
      bufs[nb] = (pl_buf){ir_buf_bytes(&f->types[v]), 0, f->def[v], last[v], nb};
      buf_of[v] = nb++;
    } else {
      buf_of[v] = buf_of[root[v]];
      if (last[v] > bufs[buf_of[v]].end) bufs[buf_of[v]].end = last[v];
    }
  }
  /* two orders, as XLA's heap simulator tries more than one; the smaller wins */
  for (int b = 0; b < nb; b++) order[b] = &bufs[b];
  qsort(order, (size_t)nb, sizeof *order, by_size);
  int64_t arena_a = place(order, nb, tmp);
  for (int b = 0; b < nb; b++) off_a[b] = bufs[b].off;
  qsort(order, (size_t)nb, sizeof *order, by_first_use);
  int64_t arena = place(order, nb, tmp);
  if (arena_a <= arena) {
    arena = arena_a;
    for (int b = 0; b < nb; b++) bufs[b].off = off_a[b];
  }
  for (int v = 0; v < nv; v++) plan[v] = buf_of[v] >= 0 ? bufs[buf_of[v]].off : -1;
  if (nb) { /* a function without temporaries gets no plan */
    f->buf_offset = plan;
    f->arena_bytes = arena;
    plan = NULL;
  }
done:
  free(is_result);
  free(taken);
  free(last);
  free(root);
  free(buf_of);
  free(bufs);
  free(order);
  free(tmp);
  free(off_a);
  free(plan);
  return rc;
}

/* ---- figures ---- */

static int by_lo(const void *a, const void *b) {
  const int64_t *x = a, *y = b;
  return (x[0] > y[0]) - (x[0] < y[0]);
}

int pass_buffer_stats_of(const ir_func *f, pass_buffer_stats *out) {
  if (!f || !out) return kiln_set_error("buffers: %s is NULL", f ? "out" : "function");
  if (!f->buf_offset) return kiln_set_error("buffers: @%s has no arena plan", f->name);
  memset(out, 0, sizeof *out);
  int nv = f->n_values;
  int32_t *last = malloc(((size_t)nv + 1) * sizeof *last);
  int64_t *iv = malloc(((size_t)nv + 1) * 2 * sizeof *iv); /* [lo, hi) pairs */
  bool *is_result = calloc((size_t)nv + 1, sizeof *is_result);
  if (!last || !iv || !is_result) {
    free(last);
    free(iv);
    free(is_result);
    return kiln_set_error("buffers: out of memory");
  }
  for (int r = 0; r < f->n_results; r++) is_result[f->results[r]] = true;
  alias_last_uses(f, is_result, last);
  free(is_result);
  out->peak_bytes = f->arena_bytes;
  /* a view's bytes are its base's: counted once, with the base */
#define OWN_BUFFER(v) (f->buf_offset[v] >= 0 && ir_alias_base(f, v) == (v))
  for (int v = 0; v < nv; v++)
    if (OWN_BUFFER(v)) out->temporaries++, out->unshared_bytes += ir_buf_bytes(&f->types[v]);
  for (int i = 0; i < f->n_instrs; i++) {
    const ir_instr *ins = &f->instrs[i];
    out->kernels += ins->op != OP_CONSTANT;
    for (int k = 0; k < ins->n_out; k++) {
      ir_value o = ins->out + k;
      bool shared = false;
      for (int j = 0; j < ins->n_in && OWN_BUFFER(o) && !shared; j++)
        shared = f->buf_offset[ins->in[j]] == f->buf_offset[o] && last[ins->in[j]] == i && ir_buf_bytes(&f->types[o]);
      out->in_place += shared;
    }
    /* the bytes live at step i: the union of the live buffers (values that
     * share a buffer in place count once) */
    int n = 0;
    for (int v = 0; v < nv; v++)
      if (OWN_BUFFER(v) && f->def[v] <= i && i <= last[v]) {
        iv[2 * n] = f->buf_offset[v];
        iv[2 * n + 1] = f->buf_offset[v] + ir_buf_bytes(&f->types[v]);
        n++;
      }
    qsort(iv, (size_t)n, 2 * sizeof *iv, by_lo);
    int64_t live = 0, hi = 0;
    for (int j = 0; j < n; j++) {
      int64_t lo = iv[2 * j] > hi ? iv[2 * j] : hi;
      if (iv[2 * j + 1] > lo) live += iv[2 * j + 1] - lo;
      if (iv[2 * j + 1] > hi) hi = iv[2 * j + 1];
    }
    if (live > out->lower_bound) out->lower_bound = live;
  }
#undef OWN_BUFFER
  free(last);
  free(iv);
  return 0;
}
