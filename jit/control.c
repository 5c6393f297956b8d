/* control.c — staged control flow (API.md §9): kiln_cond, kiln_while_loop
 * and kiln_scan. Eagerly they run their bodies as C calls, so tapes record
 * every iteration. While tracing, each branch or body is traced once as a
 * region (trace.c) and the call records one cond, while or scan
 * instruction: a 1,000-step loop compiles like a 1-step one. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "autodiff.h"
#include "control.h"

static bool scalar_bool(const kiln_tensor *t) { return t->dtype == KILN_BOOL && t->rank == 0; }

/* n tensors, none NULL (a NULL keeps the error that made it) */
static int check_list(const char *who, const char *what, int n, kiln_tensor *const *ts) {
  if (n < 0) return kiln_set_error("%s: %d %s", who, n, what);
  if (n > 0 && !ts) return kiln_set_error("%s: %s is NULL for %d tensors", who, what, n);
  for (int i = 0; i < n; i++)
    if (!ts[i]) return kiln_has_error() ? -1 : kiln_set_error("%s: %s[%d] is NULL", who, what, i);
  return 0;
}

/* Runs one body; its outputs must all be set. */
static int run_body(const char *who, const char *role, kiln_body_fn fn, void *user, int n_in,
                    kiln_tensor *const *in, int n_out, kiln_tensor **out) {
  for (int k = 0; k < n_out; k++) out[k] = NULL;
  int rc = fn(user, n_in, in, n_out, out);
  if (rc) return kiln_has_error() ? -1 : kiln_set_error("%s: the %s failed without an error", who, role);
  for (int k = 0; k < n_out; k++)
    if (!out[k]) return kiln_has_error() ? -1 : kiln_set_error("%s: the %s left output %d NULL", who, role, k);
  return 0;
}

static int type_changed(const char *who, const char *role, const char *what, int k, const op_type *want,
                        const kiln_tensor *got) {
  char a[256], b[256];
  op_type g;
  op_type_of(got, &g);
  return kiln_set_error("%s: the %s returned %s %d as %s, expected %s", who, role, what, k,
                        ir_type_str(a, sizeof a, &g), ir_type_str(b, sizeof b, want));
}

static void release_all(int n, kiln_tensor **t) {
  for (int i = 0; i < n; i++) {
    kiln_release(t[i]);
    t[i] = NULL;
  }
}

/* ---- staging ---- */

/* Does a tape watch one of the n tensors? */
static bool taped(int n, kiln_tensor *const *t) {
  for (int i = 0; tape_active_count && i < n; i++)
    if (tape_tracks(t[i])) return true;
  return false;
}

typedef struct region_job {
  const char *role, *name;
  kiln_body_fn fn;
  int n_out;
  trace *tr;
  kiln_tensor **outs;
} region_job;

/* Variables the bodies assign: carried through the instruction as extra
 * inputs and outputs (loop state), then assigned in the enclosing trace.
 * A wrapped body first binds each variable to its input (later reads see
 * it), and returns each one's value after the body. */
typedef struct {
  int n;
  kiln_variable **v;
} written;

static int add_written(written *w, int n, kiln_variable **vs) {
  for (int i = 0; i < n; i++) {
    int k = 0;
    while (k < w->n && w->v[k] != vs[i]) k++;
    if (k < w->n) continue;
    kiln_variable **q = realloc(w->v, ((size_t)w->n + 1) * sizeof *q);
    if (!q) return kiln_set_error("trace: out of memory");
    w->v = q;
    w->v[w->n++] = vs[i];
  }
  return 0;
}

typedef struct {
  kiln_body_fn fn[2];
  void *user;
  int in_split;     /* a body's own inputs before the variables (the rest come after them) */
  int out_split[2]; /* per body: its own outputs before the variables' values; -1: none (a while's cond) */
  written w;
} carrying;

static int carried_body(const carrying *c, int b, int n, kiln_tensor *const *in, int n_out, kiln_tensor **out) {
  int nw = c->w.n, split = c->out_split[b], own_in = n - nw, own_out = split < 0 ? n_out : n_out - nw, rc = 0;
  kiln_tensor **bin = calloc((size_t)n + n_out + 1, sizeof *bin), **bout = bin + own_in;
  if (!bin) return kiln_set_error("trace: out of memory");
  for (int i = 0; i < own_in; i++) bin[i] = i < c->in_split ? in[i] : in[i + nw];
  for (int j = 0; j < nw && !rc; j++) rc = kiln_variable_assign(c->w.v[j], in[c->in_split + j]);
  if (!rc && (rc = c->fn[b](c->user, own_in, bin, own_out, bout)) && !kiln_has_error())
    rc = kiln_set_error("trace: a body failed without an error");
  for (int k = 0; k < own_out && !rc; k++) out[split < 0 || k < split ? k : k + nw] = bout[k];
  for (int j = 0; j < nw && !rc && split >= 0; j++)
    if (!(out[split + j] = kiln_variable_read(c->w.v[j]))) rc = -1;
  for (int j = 0; j < nw; j++) trace_variable_unwrite(c->w.v[j]);
  free(bin);
  return rc;
}

/* in[0..n) then the current values of w's variables (read in the trace
 * now recording) into a new array; NULL with the error set */
static kiln_tensor **with_vars(int n, kiln_tensor *const *in, const written *w) {
  kiln_tensor **all = calloc((size_t)n + w->n + 1, sizeof *all);
  if (!all) {
    kiln_set_error("trace: out of memory");
    return NULL;
  }
  for (int i = 0; i < n; i++) all[i] = in[i];
  for (int j = 0; j < w->n; j++)
    if (!(all[n + j] = kiln_variable_read(w->v[j]))) {
      free(all);
      return NULL;
    }
  return all;
}

/* assigns w's variables the values vals[0..w->n) in the trace now recording */
static int assign_vars(const written *w, kiln_tensor *const *vals) {
  for (int j = 0; j < w->n; j++)
    if (kiln_variable_assign(w->v[j], vals[j])) return -1;
  return 0;
}

static int carried_first(void *user, int n, kiln_tensor *const *in, int n_out, kiln_tensor **out) {
  return carried_body(user, 0, n, in, n_out, out);
}

static int carried_second(void *user, int n, kiln_tensor *const *in, int n_out, kiln_tensor **out) {
  return carried_body(user, 1, n, in, n_out, out);
}

/* Traces each job's body over inputs of types in_types as regions sharing
 * one environment, builds their functions, and records the instruction op
 * with operands head (the pred / state / carries and xs) then the
 * environment; outputs as trace_call's. With grad, a tape watching an
 * operand gives it tape nodes (control_grad.c). 0 / -1, or 1 (nothing
 * recorded) when a body assigns variables: they are added to w, and the
 * caller stages again with bodies that carry them. */
static int stage(const char *who, op_id op, op_attrs *a, int n_jobs, region_job *jobs, void *user, int n_in,
                 const op_type *in_types, int n_head, kiln_tensor *const *head, kiln_tensor **out,
                 const cf_spec *grad, written *w) {
  trace_env env = {0};
  traced_fn *r[2] = {NULL, NULL};
  kiln_tensor **sym = calloc((size_t)n_in + 1, sizeof *sym), **ops = NULL;
  op_type *types = NULL, *outs = NULL;
  int rc = sym ? 0 : kiln_set_error("%s: out of memory", who), n_ops = 0, n_res = 0;
  kiln_scope_push();
  for (int k = 0; k < n_jobs && !rc; k++) {
    region_job *j = &jobs[k];
    if (!(j->outs = calloc((size_t)j->n_out + 1, sizeof *j->outs)) || !(j->tr = trace_begin_region(n_in, in_types, sym))) {
      rc = kiln_has_error() ? -1 : kiln_set_error("%s: out of memory", who);
      break;
    }
    rc = run_body(who, j->role, j->fn, user, n_in, sym, j->n_out, j->outs);
    kiln_variable **vs = NULL;
    int nw = rc ? 0 : trace_region_written(j->tr, &vs);
    if (nw > 0 && !add_written(w, nw, vs)) rc = 1; /* staged again, carrying them */
    else if (nw < 0) rc = -1;
    free(vs);
    if (!rc) rc = trace_region_close(j->tr, who, j->n_out, j->outs, &env);
    trace_end(j->tr);
  }
  for (int k = 0; rc == 1 && k < n_jobs; k++) /* the other regions may assign more */
    if (!jobs[k].tr) {
      region_job *j = &jobs[k];
      if (!(j->outs = calloc((size_t)j->n_out + 1, sizeof *j->outs)) || !(j->tr = trace_begin_region(n_in, in_types, sym)))
        break;
      kiln_variable **vs = NULL;
      int nw = run_body(who, j->role, j->fn, user, n_in, sym, j->n_out, j->outs) ? 0 : trace_region_written(j->tr, &vs);
      if (nw > 0) add_written(w, nw, vs);
      free(vs);
      trace_end(j->tr);
    }
  for (int k = 0; k < n_jobs; k++) {
    region_job *j = &jobs[k];
    if (!j->tr) continue;
    if (rc) {
      trace_free(j->tr);
    } else if (!(r[k] = calloc(1, sizeof *r[k]))) {
      trace_free(j->tr);
      rc = kiln_set_error("%s: out of memory", who);
    } else if (trace_finish_region(j->tr, j->name, j->n_out, j->outs, &env, r[k])) {
      free(r[k]);
      r[k] = NULL;
      rc = -1;
    }
    j->tr = NULL;
  }
  n_ops = n_head + env.n;
  if (!rc && (!(ops = calloc((size_t)n_ops + 1, sizeof *ops)) || !(types = calloc((size_t)n_ops + 1, sizeof *types))))
    rc = kiln_set_error("%s: out of memory", who);
  for (int i = 0; i < n_ops && !rc; i++) {
    ops[i] = i < n_head ? head[i] : env.t[i - n_head] ? env.t[i - n_head] : kiln_variable_read(env.v[i - n_head]);
    if (!ops[i]) rc = -1;
    else op_type_of(ops[i], &types[i]);
  }
  if (!rc) {
    a->callee = r[0] ? r[0]->func : NULL;
    a->callee2 = r[1] ? r[1]->func : NULL;
    rc = ir_check_instr(NULL, op, a, n_ops, types, &n_res, &outs);
  }
  /* a tape watching an operand gives the instruction a gradient (the
   * regions are copied for its backward before the trace takes them) */
  bool with_grad = !rc && taped(n_ops, ops);
  ir_module *copies = NULL;
  const ir_func *rg[2] = {NULL, NULL};
  if (with_grad && !grad)
    rc = kiln_set_error("%s: a gradient tape watches an operand of a staged while_loop without a bound: "
                        "give it max_iterations (>= 0) to make it differentiable", who);
  if (with_grad && !rc) {
    ir_clone_memo memo = {0};
    if (!(copies = ir_module_new())) rc = -1;
    for (int k = 0; k < 2 && !rc; k++)
      if (r[k] && !(rg[k] = ir_clone_func(copies, r[k]->func, &memo))) rc = -1;
    ir_clone_memo_free(&memo);
  }
  if (!rc) {
    rc = trace_control(op, a, r[0], r[1], n_ops, ops, n_res, outs, out);
    r[0] = r[1] = NULL; /* taken */
  }
  /* the draws it returns are draws of the enclosing trace too: a loop or
   * branch around it returns them as its residuals (stacked per step), and
   * the backward's replay of that body hands them back to this one's */
  if (!rc && grad && grad->n_draws)
    rc = trace_add_draws(trace_current, grad->n_draws, out + grad->n_out - grad->n_draws);
  if (with_grad && !rc)
    rc = cf_record_gradients(grad, rg, n_head, head, n_ops - n_head, ops + n_head, out,
                             out + grad->n_out - grad->nc - grad->n_draws);
  ir_module_free(copies);
  for (int k = 0; k < n_res && !rc; k++) kiln_scope_escape(out[k]);
  for (int k = 0; k < 2; k++)
    if (r[k]) traced_fn_free(r[k]), free(r[k]);
  for (int k = 0; k < n_jobs; k++) free(jobs[k].outs);
  kiln_scope_pop();
  trace_env_free(&env);
  free(sym);
  free(ops);
  free(types);
  free(outs);
  return rc;
}

/* How many random tensors the body draws (its own random ops, and the
 * draws that staged conds and scans nested in it return: stacked per step
 * for a scan), from a trace of it that is thrown away; with types, their
 * types too (malloc'd). -1 on error. */
static int count_draws(const char *who, kiln_body_fn body, void *user, int n_in, const op_type *in_types, int n_out,
                       op_type **types) {
  kiln_tensor **sym = calloc((size_t)n_in + n_out + 1, sizeof *sym), **outs = sym + n_in;
  if (!sym) return kiln_set_error("%s: out of memory", who);
  kiln_scope_push();
  trace *tr = trace_begin_region(n_in, in_types, sym);
  int rc = tr ? run_body(who, "body", body, user, n_in, sym, n_out, outs) : -1, n = trace_draw_count(tr);
  if (!rc && types && !(*types = malloc(((size_t)n + 1) * sizeof **types)))
    rc = kiln_set_error("%s: out of memory", who);
  for (int k = 0; !rc && types && k < n; k++) (*types)[k] = *trace_draw_type(tr, k);
  trace_free(tr); /* what it recorded, variables' assignments included, is dropped */
  kiln_scope_pop();
  free(sym);
  return rc ? -1 : n;
}

/* ---- cond ---- */

/* Under a tape, branches that draw random numbers also return their draws
 * (the backward replays the taken branch with them): the then branch's
 * draws, then the else branch's, each branch giving zeros for the other's. */
typedef struct {
  kiln_body_fn fn[2];
  void *user;
  int n_out, nd[2];
  op_type *types[2];
} cond_aug;

static int cond_augmented(const cond_aug *c, int b, int n, kiln_tensor *const *in, kiln_tensor **out) {
  int first = trace_draw_count(trace_current);
  if (run_body("cond", b ? "else branch" : "then branch", c->fn[b], c->user, n, in, c->n_out, out)) return -1;
  if (trace_draw_count(trace_current) - first != c->nd[b])
    return kiln_set_error("cond: the branch drew %d random tensors, then %d: it must draw the same each time",
                          c->nd[b], trace_draw_count(trace_current) - first);
  int at = c->n_out;
  for (int side = 0; side < 2; side++)
    for (int k = 0; k < c->nd[side]; k++, at++) {
      const op_type *t = &c->types[side][k];
      if (!(out[at] = side == b ? trace_draw(trace_current, first + k) : kiln_zeros(t->dtype, t->rank, t->shape)))
        return -1;
    }
  return 0;
}

static int cond_aug_then(void *user, int n, kiln_tensor *const *in, int n_out, kiln_tensor **out) {
  (void)n_out;
  return cond_augmented(user, 0, n, in, out);
}

static int cond_aug_else(void *user, int n, kiln_tensor *const *in, int n_out, kiln_tensor **out) {
  (void)n_out;
  return cond_augmented(user, 1, n, in, out);
}

int kiln_cond(kiln_tensor *pred, kiln_body_fn then_fn, kiln_body_fn else_fn, void *user, int n,
              kiln_tensor *const *in, int n_out, kiln_tensor **out) {
  const char *who = "cond";
  if (!then_fn || !else_fn) return kiln_set_error("%s: %s is NULL", who, then_fn ? "else_fn" : "then_fn");
  if (!pred) return kiln_has_error() ? -1 : kiln_set_error("%s: pred is NULL", who);
  if (check_list(who, "in", n, in)) return -1;
  if (n_out < 1 || !out) return kiln_set_error("%s: needs at least one output (n_out = %d, out %s)", who, n_out,
                                               out ? "given" : "NULL");
  if (!scalar_bool(pred)) {
    char t[256];
    op_type ty;
    op_type_of(pred, &ty);
    return kiln_set_error("%s: the predicate is %s, expected bool[] (a scalar)", who, ir_type_str(t, sizeof t, &ty));
  }
  if (!(pred->flags & TF_SYMBOLIC)) { /* eager, or a known predicate while tracing: C control flow */
    bool p = kiln_tensor_item(pred) != 0;
    return run_body(who, p ? "then branch" : "else branch", p ? then_fn : else_fn, user, n, in, n_out, out);
  }
  kiln_tensor **head = malloc(((size_t)n + 1) * sizeof *head);
  op_type *types = malloc(((size_t)n + 1) * sizeof *types);
  int rc = head && types ? 0 : kiln_set_error("%s: out of memory", who);
  if (!rc) {
    head[0] = pred;
    for (int i = 0; i < n; i++) head[1 + i] = in[i], op_type_of(in[i], &types[i]);
    cond_aug aug = {{then_fn, else_fn}, user, n_out, {0, 0}, {NULL, NULL}};
    for (int b = 0; b < 2 && !rc && tape_active_count > 0; b++)
      if ((aug.nd[b] = count_draws(who, aug.fn[b], user, n, types, n_out, &aug.types[b])) < 0) rc = -1;
    int nd = aug.nd[0] + aug.nd[1];
    kiln_tensor **all = nd ? calloc((size_t)n_out + nd + 1, sizeof *all) : out;
    if (!all) rc = kiln_set_error("%s: out of memory", who);
    region_job jobs[2] = {{"then branch", "cond.then", nd ? cond_aug_then : then_fn, n_out + nd, NULL, NULL},
                          {"else branch", "cond.else", nd ? cond_aug_else : else_fn, n_out + nd, NULL, NULL}};
    op_attrs a = {0};
    cf_spec g = {.op = OP_COND, .n_in = n, .n_out = n_out + nd, .n_draws = nd, .n_draws0 = aug.nd[0]};
    written w = {0, NULL};
    if (!rc) rc = stage(who, OP_COND, &a, 2, jobs, nd ? (void *)&aug : user, n, types, n + 1, head, all, &g, &w);
    if (!rc && nd) memcpy(out, all, (size_t)n_out * sizeof *out);
    if (all != out) free(all);
    free(aug.types[0]), free(aug.types[1]);
    if (rc == 1) { /* the branches assign variables: carried as extra inputs and outputs */
      carrying c = {{then_fn, else_fn}, user, n, {n_out, n_out}, w};
      kiln_tensor **in2 = with_vars(n, in, &w), **out2 = calloc((size_t)n_out + w.n + 1, sizeof *out2);
      rc = in2 && out2 ? kiln_cond(pred, carried_first, carried_second, &c, n + w.n, in2, n_out + w.n, out2) : -1;
      if (!rc) rc = assign_vars(&w, out2 + n_out);
      if (!rc) memcpy(out, out2, (size_t)n_out * sizeof *out);
      free(in2);
      free(out2);
    }
    free(w.v);
  }
  free(head);
  free(types);
  return rc;
}

/* ---- while_loop ---- */

static int while_eager(const char *who, kiln_body_fn cond_fn, kiln_body_fn body_fn, void *user, int n,
                       kiln_tensor *const *init, int64_t max_iterations, kiln_tensor **final) {
  kiln_tensor **cur = calloc(2 * (size_t)n + 1, sizeof *cur), **next = cur + n;
  op_type *types = malloc((size_t)n * sizeof *types);
  int rc = cur && types ? 0 : kiln_set_error("%s: out of memory", who);
  for (int i = 0; i < n && !rc; i++) cur[i] = kiln_retain(init[i]), op_type_of(init[i], &types[i]);
  for (int64_t it = 0; !rc && (max_iterations < 0 || it < max_iterations); it++) {
    kiln_scope_push();
    kiln_tensor *p = NULL;
    rc = run_body(who, "cond", cond_fn, user, n, cur, 1, &p);
    if (!rc && !scalar_bool(p)) {
      op_type want = {KILN_BOOL, 0, {0}};
      rc = type_changed(who, "cond", "its output", 0, &want, p);
    }
    bool go = !rc && kiln_tensor_item(p) != 0;
    if (go) rc = run_body(who, "body", body_fn, user, n, cur, n, next);
    for (int k = 0; go && !rc && k < n; k++)
      if (!op_type_is(next[k], &types[k])) rc = type_changed(who, "body", "state", k, &types[k], next[k]);
    for (int k = 0; go && !rc && k < n; k++) kiln_retain(next[k]);
    kiln_scope_pop();
    if (rc || !go) break;
    release_all(n, cur);
    memcpy(cur, next, (size_t)n * sizeof *cur);
  }
  for (int k = 0; k < n && !rc; k++) final[k] = scope_own(cur[k]);
  if (rc && cur) release_all(n, cur);
  free(cur);
  free(types);
  return rc;
}

/* A bounded while_loop under a tape (TF while_v2's bounded loop): a scan of
 * max_iterations steps over (state, active) whose step runs the body in a
 * cond only while the loop would still run; its gradient is the scan's. */
typedef struct {
  kiln_body_fn cond_fn, body_fn;
  void *user;
} while_ctx;

static int keep_state(void *user, int n, kiln_tensor *const *in, int n_out, kiln_tensor **out) {
  (void)user, (void)n_out;
  for (int i = 0; i < n; i++) out[i] = in[i];
  return 0;
}

static int run_while_body(void *user, int n, kiln_tensor *const *in, int n_out, kiln_tensor **out) {
  const while_ctx *c = user;
  return run_body("while_loop", "body", c->body_fn, c->user, n, in, n_out, out);
}

static int while_step(void *user, int n1, kiln_tensor *const *in, int n_out, kiln_tensor **out) {
  (void)n_out;
  const while_ctx *c = user;
  int n = n1 - 1;
  kiln_tensor *p = NULL;
  if (run_body("while_loop", "cond", c->cond_fn, c->user, n, in, 1, &p)) return -1;
  if (!scalar_bool(p)) {
    op_type want = {KILN_BOOL, 0, {0}};
    return type_changed("while_loop", "cond", "its output", 0, &want, p);
  }
  kiln_tensor *go = kiln_logical_and(p, in[n]);
  if (!go || kiln_cond(go, run_while_body, keep_state, user, n, in, n, out)) return -1;
  out[n] = go;
  return 0;
}

static int while_as_scan(kiln_body_fn cond_fn, kiln_body_fn body_fn, void *user, int n, kiln_tensor *const *init,
                         int64_t max_iterations, kiln_tensor **final) {
  while_ctx c = {cond_fn, body_fn, user};
  kiln_tensor **state = calloc(2 * ((size_t)n + 1), sizeof *state), **fin = state + n + 1;
  if (!state) return kiln_set_error("while_loop: out of memory");
  for (int i = 0; i < n; i++) state[i] = init[i];
  int rc = (state[n] = kiln_scalar(KILN_BOOL, 1)) ? 0 : -1;
  if (!rc) rc = kiln_scan(while_step, &c, n + 1, state, 0, NULL, max_iterations, false, 0, fin, NULL);
  if (!rc) memcpy(final, fin, (size_t)n * sizeof *final);
  free(state);
  return rc;
}

int kiln_while_loop(kiln_body_fn cond_fn, kiln_body_fn body_fn, void *user, int n, kiln_tensor *const *init,
                    int64_t max_iterations, kiln_tensor **final) {
  const char *who = "while_loop";
  if (!cond_fn || !body_fn) return kiln_set_error("%s: %s is NULL", who, cond_fn ? "body_fn" : "cond_fn");
  if (n < 1) return kiln_set_error("%s: the state needs at least one tensor (n = %d)", who, n);
  if (check_list(who, "init", n, init)) return -1;
  if (!final) return kiln_set_error("%s: final is NULL", who);
  if (max_iterations < -1)
    return kiln_set_error("%s: max_iterations = %lld (>= 0, or -1 for unbounded)", who, (long long)max_iterations);
  if (!trace_current) return while_eager(who, cond_fn, body_fn, user, n, init, max_iterations, final);
  if (tape_active_count && max_iterations >= 0) /* differentiable: a scan under a tape */
    return while_as_scan(cond_fn, body_fn, user, n, init, max_iterations, final);
  op_type *types = malloc((size_t)n * sizeof *types);
  if (!types) return kiln_set_error("%s: out of memory", who);
  for (int i = 0; i < n; i++) op_type_of(init[i], &types[i]);
  region_job jobs[2] = {{"cond", "while.cond", cond_fn, 1, NULL, NULL},
                        {"body", "while.body", body_fn, n, NULL, NULL}};
  op_attrs a = {0};
  a.n_state = n;
  a.trip = max_iterations;
  written w = {0, NULL};
  int rc = stage(who, OP_WHILE, &a, 2, jobs, user, n, types, n, init, final, NULL, &w);
  free(types);
  if (rc == 1) { /* the bodies assign variables: part of the loop state */
    carrying c = {{cond_fn, body_fn}, user, n, {-1, n}, w};
    kiln_tensor **init2 = with_vars(n, init, &w), **fin2 = calloc((size_t)n + w.n + 1, sizeof *fin2);
    rc = init2 && fin2 ? kiln_while_loop(carried_first, carried_second, &c, n + w.n, init2, max_iterations, fin2) : -1;
    if (!rc) rc = assign_vars(&w, fin2 + n);
    if (!rc) memcpy(final, fin2, (size_t)n * sizeof *final);
    free(init2);
    free(fin2);
  }
  free(w.v);
  return rc;
}

/* ---- scan ---- */

/* The types of a body's ys without running it: traced once and dropped
 * (an eager scan of length 0 still returns ys of shape (0, ...)). */
static int ys_types(const char *who, kiln_body_fn body, void *user, int n_in, const op_type *in_types, int nc,
                    int n_ys, op_type *ys) {
  kiln_tensor **sym = calloc((size_t)n_in + nc + n_ys + 1, sizeof *sym), **outs = sym + n_in;
  if (!sym) return kiln_set_error("%s: out of memory", who);
  kiln_scope_push();
  trace *tr = trace_begin_region(n_in, in_types, sym);
  int rc = tr ? run_body(who, "body", body, user, n_in, sym, nc + n_ys, outs) : -1;
  for (int k = 0; k < n_ys && !rc; k++) op_type_of(outs[nc + k], &ys[k]);
  trace_free(tr);
  kiln_scope_pop();
  free(sym);
  return rc;
}

static int scan_eager(const char *who, kiln_body_fn body, void *user, int nc, kiln_tensor *const *init, int nx,
                      kiln_tensor *const *xs, int64_t len, bool reverse, int n_ys, kiln_tensor **final_carry,
                      kiln_tensor **ys) {
  int n_in = nc + nx, n_out = nc + n_ys;
  kiln_tensor **cur = calloc((size_t)n_in + n_out + 1, sizeof *cur), **res = cur + n_in;
  kiln_tensor **steps = calloc((size_t)n_ys * (size_t)len + 1, sizeof *steps); /* y k of step t at k * len + t */
  op_type *types = malloc(((size_t)n_in + n_ys + 1) * sizeof *types), *yt = types ? types + n_in : NULL;
  int rc = cur && steps && types ? 0 : kiln_set_error("%s: out of memory", who);
  for (int i = 0; i < nc && !rc; i++) cur[i] = kiln_retain(init[i]), op_type_of(init[i], &types[i]);
  for (int i = 0; i < nx && !rc; i++) {
    op_type_of(xs[i], &types[nc + i]);
    types[nc + i].rank--;
    memmove(types[nc + i].shape, types[nc + i].shape + 1, (size_t)types[nc + i].rank * sizeof *types->shape);
  }
  for (int64_t s = 0; s < len && !rc; s++) {
    int64_t t = reverse ? len - 1 - s : s;
    kiln_scope_push();
    for (int i = 0; i < nx && !rc; i++)
      if (!(cur[nc + i] = kiln_index(xs[i], t))) rc = -1;
    if (!rc) rc = run_body(who, "body", body, user, n_in, cur, n_out, res);
    for (int k = 0; k < nc && !rc; k++)
      if (!op_type_is(res[k], &types[k])) rc = type_changed(who, "body", "carry", k, &types[k], res[k]);
    for (int k = 0; k < n_ys && !rc; k++) {
      if (s == 0) op_type_of(res[nc + k], &yt[k]);
      if (!op_type_is(res[nc + k], &yt[k])) rc = type_changed(who, "body", "y", k, &yt[k], res[nc + k]);
    }
    for (int k = 0; k < n_out && !rc; k++) kiln_retain(res[k]);
    kiln_scope_pop();
    for (int i = 0; i < nx; i++) cur[nc + i] = NULL;
    if (rc) break;
    release_all(nc, cur);
    memcpy(cur, res, (size_t)nc * sizeof *cur);
    for (int k = 0; k < n_ys; k++) steps[(size_t)k * (size_t)len + (size_t)t] = res[nc + k];
  }
  if (!rc && len == 0 && n_ys) rc = ys_types(who, body, user, n_in, types, nc, n_ys, yt);
  for (int k = 0; k < n_ys && !rc; k++) {
    if (len) {
      ys[k] = kiln_stack((int)len, steps + (size_t)k * (size_t)len, 0);
    } else {
      int64_t shape[KILN_MAX_RANK] = {0};
      for (int d = 0; d < yt[k].rank; d++) shape[d + 1] = yt[k].shape[d];
      ys[k] = kiln_zeros(yt[k].dtype, yt[k].rank + 1, shape);
    }
    if (!ys[k]) rc = -1;
  }
  for (int k = 0; k < nc && !rc; k++) final_carry[k] = scope_own(cur[k]);
  if (rc && cur) release_all(nc, cur);
  for (size_t i = 0; steps && i < (size_t)n_ys * (size_t)len; i++) kiln_release(steps[i]);
  free(steps);
  free(cur);
  free(types);
  return rc;
}

/* A scan body that also returns the carries it received and the random
 * numbers it drew (the backward's residuals: it replays the step with the
 * same draws). */
typedef struct {
  kiln_body_fn body;
  void *user;
  int nc, n_ys, n_draws;
} scan_aug;

static int augmented(void *user, int n, kiln_tensor *const *in, int n_out, kiln_tensor **out) {
  (void)n_out;
  const scan_aug *s = user;
  int first = trace_draw_count(trace_current);
  if (run_body("scan", "body", s->body, s->user, n, in, s->nc + s->n_ys, out)) return -1;
  for (int j = 0; j < s->nc; j++) out[s->nc + s->n_ys + j] = in[j];
  if (trace_draw_count(trace_current) - first != s->n_draws)
    return kiln_set_error("scan: the body drew %d random tensors, then %d: it must draw the same each time",
                          s->n_draws, trace_draw_count(trace_current) - first);
  for (int k = 0; k < s->n_draws; k++)
    if (!(out[2 * s->nc + s->n_ys + k] = trace_draw(trace_current, first + k))) return -1;
  return 0;
}

int kiln_scan(kiln_body_fn body, void *user, int n_carry, kiln_tensor *const *init, int n_xs, kiln_tensor *const *xs,
              int64_t length, bool reverse, int n_ys, kiln_tensor **final_carry, kiln_tensor **ys) {
  const char *who = "scan";
  if (!body) return kiln_set_error("%s: body is NULL", who);
  if (check_list(who, "init", n_carry, init) || check_list(who, "xs", n_xs, xs)) return -1;
  if (n_ys < 0) return kiln_set_error("%s: %d ys", who, n_ys);
  if (n_carry + n_ys < 1) return kiln_set_error("%s: the body returns nothing (no carry and no ys)", who);
  if ((n_carry && !final_carry) || (n_ys && !ys))
    return kiln_set_error("%s: %s is NULL", who, n_carry && !final_carry ? "final_carry" : "ys");
  for (int i = 0; i < n_xs; i++) {
    if (xs[i]->rank < 1) return kiln_set_error("%s: xs[%d] is a scalar: xs are sliced along axis 0", who, i);
    if (xs[i]->shape[0] != xs[0]->shape[0])
      return kiln_set_error("%s: xs[%d] has length %lld, xs[0] %lld (all the same length)", who, i,
                            (long long)xs[i]->shape[0], (long long)xs[0]->shape[0]);
  }
  if (n_xs && length != -1 && length != xs[0]->shape[0])
    return kiln_set_error("%s: length = %lld, but the xs have length %lld", who, (long long)length,
                          (long long)xs[0]->shape[0]);
  if (!n_xs && length < 0) return kiln_set_error("%s: without xs, length = %lld must be given (>= 0)", who,
                                                 (long long)length);
  int64_t len = n_xs ? xs[0]->shape[0] : length;
  if (!trace_current) return scan_eager(who, body, user, n_carry, init, n_xs, xs, len, reverse, n_ys, final_carry, ys);
  int n_in = n_carry + n_xs;
  kiln_tensor **head = malloc(((size_t)n_in + 1) * sizeof *head);
  kiln_tensor **out = malloc((2 * (size_t)n_carry + n_ys + 1) * sizeof *out);
  op_type *types = malloc(((size_t)n_in + 1) * sizeof *types);
  int rc = head && out && types ? 0 : kiln_set_error("%s: out of memory", who);
  for (int i = 0; i < n_in && !rc; i++) {
    head[i] = i < n_carry ? init[i] : xs[i - n_carry];
    op_type_of(head[i], &types[i]);
    if (i >= n_carry) { /* x_t: one slice along axis 0 */
      types[i].rank--;
      memmove(types[i].shape, types[i].shape + 1, (size_t)types[i].rank * sizeof *types->shape);
    }
  }
  if (!rc) {
    /* under a tape, the steps' incoming carries are stacked too (extra ys):
     * the backward scan reads them */
    bool grad = tape_active_count > 0;
    int n_draws = grad ? count_draws(who, body, user, n_in, types, n_carry + n_ys, NULL) : 0;
    if (n_draws < 0) rc = -1, n_draws = 0;
    kiln_tensor **more = n_draws ? realloc(out, (2 * (size_t)n_carry + n_ys + n_draws + 1) * sizeof *out) : out;
    if (!more) rc = kiln_set_error("%s: out of memory", who);
    else out = more;
    scan_aug aug = {body, user, n_carry, n_ys, n_draws};
    region_job job = {"body", "scan.body", grad ? augmented : body, n_carry + n_ys + (grad ? n_carry + n_draws : 0),
                      NULL, NULL};
    op_attrs a = {0};
    a.n_state = n_carry;
    a.n_xs = n_xs;
    a.trip = len;
    a.reverse = reverse;
    cf_spec g = {.op = OP_SCAN, .n_in = n_in, .n_out = 2 * n_carry + n_ys + n_draws, .nc = n_carry, .nx = n_xs,
                 .n_ys = n_ys + n_carry + n_draws, .n_draws = n_draws, .len = len, .reverse = reverse};
    written w = {0, NULL};
    if (!rc) rc = stage(who, OP_SCAN, &a, 1, &job, grad ? (void *)&aug : user, n_in, types, n_in, head, out,
               grad ? &g : NULL, &w);
    if (rc == 1) { /* the body assigns variables: carried after the carries */
      carrying c = {{body, NULL}, user, n_carry, {n_carry, n_carry}, w};
      kiln_tensor **init2 = with_vars(n_carry, init, &w), **fin2 = calloc((size_t)n_carry + w.n + 1, sizeof *fin2);
      rc = init2 && fin2 ? kiln_scan(carried_first, &c, n_carry + w.n, init2, n_xs, xs, len, reverse, n_ys, fin2, ys)
                         : -1;
      if (!rc) rc = assign_vars(&w, fin2 + n_carry);
      for (int k = 0; k < n_carry && !rc; k++) final_carry[k] = fin2[k];
      free(init2);
      free(fin2);
      free(w.v);
      free(head);
      free(out);
      free(types);
      return rc;
    }
    free(w.v);
  }
  for (int k = 0; k < n_carry && !rc; k++) final_carry[k] = out[k];
  for (int k = 0; k < n_ys && !rc; k++) ys[k] = out[n_carry + k];
  free(head);
  free(out);
  free(types);
  return rc;
}
