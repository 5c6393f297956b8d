/* interp.c — the reference interpreter: runs an IR function instruction by
 * instruction through op_apply, the eager front end, so it gives exactly the
 * eager results. Every compiled path is tested against it, and constant
 * folding evaluates through it. */
#include <stdlib.h>
#include <string.h>

#include "ir_internal.h"

static int arg_error(const ir_func *f, int i, const kiln_tensor *t) {
  char want[256], have[256] = "NULL";
  ir_type_str(want, sizeof want, &f->types[i]);
  if (t) {
    op_type ty = {(kiln_dtype)t->dtype, t->rank, {0}};
    for (int k = 0; k < t->rank; k++) ty.shape[k] = t->shape[k];
    ir_type_str(have, sizeof have, &ty);
  }
  return kiln_set_error("interpret: @%s: argument %d is %s, the parameter is %s", f->name, i, have, want);
}

static int check_args(const ir_func *f, kiln_tensor *const *args) {
  for (int i = 0; i < f->n_params; i++) {
    const kiln_tensor *t = args[i];
    bool ok = t && t->dtype == f->types[i].dtype && t->rank == f->types[i].rank;
    for (int k = 0; ok && k < t->rank; k++) ok = t->shape[k] == f->types[i].shape[k];
    if (!ok) return arg_error(f, i, t);
  }
  return 0;
}

/* A C callback: its outputs must match the declared types exactly. The
 * outputs it returns are owned by the current scope (or retained by it). */
static int run_host(const ir_instr *in, const ir_host *h, kiln_tensor *const *ins, kiln_tensor **outs) {
  if (!h->fn)
    return kiln_set_error("host_call: @%s: no callback is bound (IR read from text, and the process has no "
                          "symbol of that name)", h->name);
  for (int k = 0; k < h->n_out; k++) outs[k] = NULL;
  if (h->fn(h->user, in->n_in, ins, h->n_out, outs)) {
    if (!kiln_has_error()) kiln_set_error("host_call: @%s failed without an error", h->name);
    return -1;
  }
  for (int k = 0; k < h->n_out; k++) {
    const kiln_tensor *t = outs[k];
    const op_type *want = &h->out[k];
    bool ok = t && !(t->flags & TF_SYMBOLIC) && t->dtype == want->dtype && t->rank == want->rank;
    for (int d = 0; ok && d < t->rank; d++) ok = t->shape[d] == want->shape[d];
    if (!ok) {
      char w[256], g[256] = "NULL";
      ir_type_str(w, sizeof w, want);
      if (t) {
        op_type ty = {(kiln_dtype)t->dtype, t->rank, {0}};
        for (int d = 0; d < t->rank; d++) ty.shape[d] = t->shape[d];
        ir_type_str(g, sizeof g, &ty);
      }
      return kiln_set_error("host_call: @%s returned %s for output %d, declared %s", h->name, g, k, w);
    }
  }
  return 0;
}

/* ---- arena plans (test builds) ----
 * With KILN_POISON=1, a function carrying a plan of the buffers pass runs
 * over its arena: each planned value is written at its offset when it is
 * made and read back from there at every use, and its bytes are poisoned
 * (0xff: NaN, -1, ...) once its last user has run. A plan that lets two live
 * values overlap, or lets one outlive its buffer, then changes the results. */
typedef struct arena_run {
  unsigned char *mem; /* NULL: no arena */
  int32_t *last;      /* each value's last user (instruction index; n_instrs for results), -1 if none */
} arena_run;

static int arena_open(const ir_func *f, arena_run *a) {
  const char *s = f->buf_offset ? getenv("KILN_POISON") : NULL;
  if (!s || strcmp(s, "1")) return 0;
  a->mem = malloc((size_t)f->arena_bytes + 1);
  a->last = malloc(((size_t)f->n_values + 1) * sizeof *a->last);
  if (!a->mem || !a->last) return kiln_set_error("interpret: out of memory");
  memset(a->mem, 0xff, (size_t)f->arena_bytes);
  for (int v = 0; v < f->n_values; v++) {
    a->last[v] = -1;
    if (f->buf_offset[v] >= 0 && f->buf_offset[v] + ir_type_bytes(&f->types[v]) > f->arena_bytes) {
      char l[160];
      return kiln_set_error("interpret: @%s: %s: buffer outside the arena", f->name, ir_value_label(f, v, l, sizeof l));
    }
  }
  for (int i = 0; i < f->n_instrs; i++)
    for (int k = 0; k < f->instrs[i].n_in; k++) a->last[f->instrs[i].in[k]] = i;
  for (int r = 0; r < f->n_results; r++) a->last[f->results[r]] = f->n_instrs;
  /* a planned view shares its base's bytes: they are poisoned once, when
   * the last of the base and its views has been read */
  for (int v = 0; v < f->n_values; v++) {
    ir_value b = ir_alias_base(f, v);
    if (b == v || f->buf_offset[v] < 0) continue;
    if (a->last[v] > a->last[b]) a->last[b] = a->last[v];
    a->last[v] = -1;
  }
  return 0;
}

/* planned value v read back from the arena, as a fresh tensor of its type */
static kiln_tensor *arena_read(const ir_func *f, const arena_run *a, ir_value v) {
  const op_type *t = &f->types[v];
  kiln_tensor *x = tensor_alloc("interpret", t->dtype, t->rank, t->shape);
  if (x) memcpy(x->data, a->mem + f->buf_offset[v], (size_t)ir_type_bytes(t));
  return x ? scope_own(x) : NULL;
}

/* after instruction i: poison the operands it was the last user of, then
 * write its planned results (in-place reuse overwrites a dying operand) */
static void arena_step(const ir_func *f, const arena_run *a, int i, kiln_tensor *const *vals) {
  const ir_instr *in = &f->instrs[i];
  for (int k = 0; k < in->n_in; k++) {
    ir_value v = in->in[k];
    if (f->buf_offset[v] >= 0 && a->last[v] == i)
      memset(a->mem + f->buf_offset[v], 0xff, (size_t)ir_type_bytes(&f->types[v]));
  }
  for (int k = 0; k < in->n_out; k++) {
    ir_value v = in->out + k;
    if (f->buf_offset[v] >= 0) memcpy(a->mem + f->buf_offset[v], vals[v]->data, (size_t)ir_type_bytes(&f->types[v]));
  }
}

static int run(const ir_func *f, kiln_tensor *const *args, kiln_tensor **results);

/* ---- control flow ----
 * The regions run as functions; every tensor here is retained by this code
 * (run's results) or by the enclosing run (operands). */

static void release_all(int n, kiln_tensor **t) {
  for (int i = 0; i < n; i++) {
    kiln_release(t[i]);
    t[i] = NULL;
  }
}

/* the bool of a bool[] result (read back from a GPU), released */
static bool take_bool(kiln_tensor *p) {
  bool b = kiln_tensor_item(p) != 0;
  kiln_release(p);
  return b;
}

static int run_cond(const ir_instr *in, kiln_tensor *const *ins, kiln_tensor **outs) {
  const ir_func *g = kiln_tensor_item(ins[0]) != 0 ? in->attrs.callee : in->attrs.callee2;
  return run(g, ins + 1, outs);
}

static int run_while(const ir_instr *in, kiln_tensor *const *ins, kiln_tensor **outs) {
  int n = in->n_in, ns = in->attrs.n_state, rc = 0;
  kiln_tensor **args = malloc(((size_t)n + ns + 1) * sizeof *args), **next = args + n;
  if (!args) return kiln_set_error("while_loop: out of memory");
  for (int i = 0; i < n; i++) args[i] = kiln_retain(ins[i]); /* the state, then the captures */
  for (int64_t it = 0; in->attrs.trip < 0 || it < in->attrs.trip; it++) {
    kiln_tensor *p = NULL;
    if ((rc = run(in->attrs.callee, args, &p))) break;
    if (!take_bool(p)) break;
    if ((rc = run(in->attrs.callee2, args, next))) break;
    release_all(ns, args);
    memcpy(args, next, (size_t)ns * sizeof *args);
  }
  if (!rc) memcpy(outs, args, (size_t)ns * sizeof *outs);
  release_all(rc ? n : n - ns, rc ? args : args + ns);
  free(args);
  return rc;
}

/* row t of x (axis 0), a new tensor (a GPU tensor's by the index op) */
static kiln_tensor *row(kiln_tensor *x, int64_t t) {
  if (x->device) return kiln_retain(kiln_index(x, t));
  kiln_tensor *r = tensor_alloc("scan", (kiln_dtype)x->dtype, x->rank - 1, x->shape + 1);
  size_t bytes = r ? tensor_bytes(r) : 0;
  if (r && bytes) memcpy(r->data, (const char *)x->data + (size_t)t * bytes, bytes);
  return r;
}

static int run_scan(const ir_func *f, const ir_instr *in, kiln_tensor *const *ins, kiln_tensor **outs) {
  int n = in->n_in, nc = in->attrs.n_state, nx = in->attrs.n_xs, nr = in->n_out, rc = 0;
  int64_t len = in->attrs.trip;
  kiln_tensor **args = calloc((size_t)n + nr + 1, sizeof *args), **res = args + n;
  if (!args) return kiln_set_error("scan: out of memory");
  for (int i = 0; i < nr; i++) outs[i] = NULL;
  for (int k = nc; k < nr && !rc; k++) { /* the stacked ys */
    const op_type *t = &f->types[in->out + k];
    if (!(outs[k] = tensor_alloc("scan", t->dtype, t->rank, t->shape))) rc = -1;
  }
  for (int i = 0; i < n; i++)
    if (i < nc || i >= nc + nx) args[i] = kiln_retain(ins[i]);
  for (int64_t s = 0; s < len && !rc; s++) {
    int64_t t = in->attrs.reverse ? len - 1 - s : s;
    for (int i = nc; i < nc + nx && !rc; i++) {
      kiln_release(args[i]);
      if (!(args[i] = row(ins[i], t))) rc = -1;
    }
    if (rc || (rc = run(in->attrs.callee, args, res))) break;
    release_all(nc, args);
    memcpy(args, res, (size_t)nc * sizeof *args);
    for (int k = nc; k < nr; k++) {
      size_t bytes = tensor_bytes(res[k]);
      kiln_tensor *h = rc || !res[k]->device ? res[k] : kiln_to_device(res[k], "cpu:0"); /* a GPU's y: via the host */
      if (!h) rc = -1;
      else if (!rc && bytes) memcpy((char *)outs[k]->data + (size_t)t * bytes, h->data, bytes);
      kiln_release(res[k]);
    }
  }
  for (int k = nc; k < nr && !rc && device_current() != 0; k++) { /* the ys where the ops run */
    kiln_tensor *d = kiln_to_device(outs[k], kiln_device_current());
    if (!d) {
      rc = -1;
      break;
    }
    kiln_release(outs[k]);
    outs[k] = kiln_retain(d);
  }
  for (int k = 0; k < nc; k++) outs[k] = rc ? NULL : kiln_retain(args[k]);
  if (rc) release_all(nr, outs);
  release_all(n, args);
  free(args);
  return rc;
}

static int run_control(const ir_func *f, const ir_instr *in, kiln_tensor *const *ins, kiln_tensor **outs) {
  switch (in->op) {
  case OP_COND: return run_cond(in, ins, outs);
  case OP_WHILE: return run_while(in, ins, outs);
  default: return run_scan(f, in, ins, outs);
  }
}

/* values of the instructions of f, in order; results retained for the caller */
static int run(const ir_func *f, kiln_tensor *const *args, kiln_tensor **results) {
  kiln_tensor **vals = calloc((size_t)f->n_values + 1, sizeof *vals);
  kiln_tensor **ins = NULL;
  int cap = 0, rc = 0;
  arena_run arena = {NULL, NULL};
  if (!vals) return kiln_set_error("interpret: out of memory");
  if (arena_open(f, &arena)) {
    free(arena.mem);
    free(arena.last);
    free(vals);
    return -1;
  }
  for (int i = 0; i < f->n_params; i++) vals[i] = args[i];
  /* intermediates belong to this scope and die with it */
  kiln_scope_push();
  for (int i = 0; i < f->n_instrs && !rc; i++) {
    const ir_instr *in = &f->instrs[i];
    kiln_tensor *out = NULL;
    if (in->n_in > cap) {
      kiln_tensor **q = realloc(ins, (size_t)in->n_in * sizeof *q);
      if (!q) {
        rc = kiln_set_error("interpret: out of memory");
        break;
      }
      ins = q;
      cap = in->n_in;
    }
    for (int k = 0; k < in->n_in; k++) ins[k] = vals[in->in[k]];
    for (int k = 0; arena.mem && k < in->n_in && !rc; k++)
      if (f->buf_offset[in->in[k]] >= 0 && !(ins[k] = arena_read(f, &arena, in->in[k]))) rc = -1;
    if (rc) break;
    op_kind kind = kiln_ops[in->op].kind;
    if (in->op == OP_CONSTANT) {
      out = scope_own(kiln_retain(in->attrs.value));
    } else if (kind == OPK_CALL) {
      if (run(in->attrs.callee, ins, vals + in->out) == 0) {
        for (int k = 0; k < in->n_out; k++) scope_own(vals[in->out + k]);
        out = vals[in->out];
      }
    } else if (kind == OPK_CONTROL) {
      if (run_control(f, in, ins, vals + in->out) == 0) {
        for (int k = 0; k < in->n_out; k++) scope_own(vals[in->out + k]);
        out = vals[in->out];
      }
    } else if (kind == OPK_HOST) {
      if (run_host(in, in->attrs.host, ins, vals + in->out) == 0) out = vals[in->out];
    } else if (kind == OPK_RANDOM && in->attrs.stateful) {
      op_attrs a = in->attrs; /* draw this call's block of the global stream */
      int64_t size = 1;
      for (int d = 0; d < a.rank; d++) size *= a.shape[d];
      a.counter = rng_reserve(((uint64_t)size + 1) / 2, &a.seed);
      out = op_apply(in->op, &a, 0, ins);
    } else {
      out = op_apply(in->op, &in->attrs, in->n_in, ins);
    }
    if (!out) {
      char msg[1024], label[160];
      snprintf(msg, sizeof msg, "%s", kiln_last_error());
      rc = kiln_set_error("interpret: @%s: %s: %s", f->name, ir_value_label(f, in->out, label, sizeof label), msg);
      break;
    }
    vals[in->out] = out;
    if (arena.mem) arena_step(f, &arena, i, vals);
  }
  for (int r = 0; arena.mem && !rc && r < f->n_results; r++)
    if (f->buf_offset[f->results[r]] >= 0 && !(vals[f->results[r]] = arena_read(f, &arena, f->results[r]))) rc = -1;
  if (!rc)
    for (int r = 0; r < f->n_results; r++) results[r] = kiln_retain(vals[f->results[r]]);
  kiln_scope_pop();
  free(arena.mem);
  free(arena.last);
  free(ins);
  free(vals);
  return rc;
}

int ir_run(const ir_func *f, kiln_tensor *const *args, kiln_tensor **results) {
  if ((f->n_params && !args) || (f->n_results && !results))
    return kiln_set_error("interpret: @%s: args or results is NULL", f->name);
  if (check_args(f, args)) return -1;
  kiln_tensor *small[8], **res = f->n_results > 8 ? malloc((size_t)f->n_results * sizeof *res) : small;
  if (!res) return kiln_set_error("interpret: out of memory");
  int rc = run(f, args, res);
  if (!rc)
    for (int r = 0; r < f->n_results; r++) results[r] = scope_own(res[r]);
  if (res != small) free(res);
  return rc;
}

int ir_interpret(const ir_func *f, kiln_tensor *const *args, kiln_tensor **results) {
  if (!f) return kiln_set_error("interpret: no function");
  if (ir_verify(f)) return -1;
  return ir_run(f, args, results);
}
