/* control_grad.c — gradients of staged cond and scan (a staged while_loop
 * with max_iterations is a scan under a tape: control.c). The backward is
 * control flow again, staged into the backward trace: a cond of each
 * branch's VJP, and a reverse scan of the body's VJP over the carries each
 * step received (the forward stacks them). Each VJP recomputes its branch
 * or step by replaying the traced region op by op under a tape of its own
 * (not the C body: its user data may be gone by then), so the backward
 * differentiates again (higher orders). The regions' environment (what the
 * bodies closed over) gets gradients too, summed over the steps. */
#include <stdlib.h>

#include "autodiff.h"
#include "control.h"

/* ---- replaying a region ----
 * Each instruction again through op_apply, on the tensors of the trace now
 * recording: the tapes see the ops. Nested control flow goes through the
 * public calls, whose bodies replay the nested regions. A region traced
 * under a tape returns its draws (control.c): its own random instructions'
 * values, and the draws of the conds and scans nested in it, which return
 * theirs as their last outputs (a scan's stacked per step); the replay
 * uses the forward's draws in that order instead of drawing again. */

static int replay(const ir_func *g, kiln_tensor *const *args, kiln_tensor **results, int depth,
                  kiln_tensor *const *draws);

static int region_draws(const ir_func *g, int depth);

/* How many draws instruction in of a region returns (see above): a random
 * instruction one, a cond both branches', a scan its body's (stacked). A
 * while_loop or staged call returns none (their draws, if any, cannot be
 * replayed). -1 when nested too deeply. */
static int instr_draws(const ir_instr *in, int depth) {
  if (kiln_ops[in->op].kind == OPK_RANDOM) return 1;
  if (in->op != OP_COND && in->op != OP_SCAN) return 0;
  int a = region_draws(in->attrs.callee, depth + 1);
  int b = in->op == OP_COND ? region_draws(in->attrs.callee2, depth + 1) : 0;
  return a < 0 || b < 0 ? -1 : a + b;
}

/* How many draws region g returns, -1 when nested too deeply */
static int region_draws(const ir_func *g, int depth) {
  if (depth > 64) return kiln_set_error("trace: regions nested too deeply to replay");
  int n = 0;
  for (int i = 0; i < g->n_instrs; i++) {
    int k = instr_draws(&g->instrs[i], depth);
    if (k < 0) return -1;
    n += k;
  }
  return n;
}

typedef struct {
  const ir_func *r[2];
  int n_env;
  kiln_tensor *const *env; /* the instruction's operands past its own inputs */
  int depth;
  bool has_draws; /* the last n_draws inputs are the forward's draws (cond: the then branch's nd0 first) */
  int n_draws, nd0;
} replay_ctx;

static int replay_region(void *user, int b, int n, kiln_tensor *const *in, kiln_tensor **out) {
  const replay_ctx *c = user;
  int n_own = n - c->n_draws;
  kiln_tensor **args = malloc(((size_t)n_own + c->n_env + 1) * sizeof *args);
  if (!args) return kiln_set_error("trace: out of memory");
  for (int i = 0; i < n_own; i++) args[i] = in[i];
  for (int i = 0; i < c->n_env; i++) args[n_own + i] = c->env[i];
  int rc = replay(c->r[b], args, out, c->depth + 1, c->has_draws ? in + n_own + (b ? c->nd0 : 0) : NULL);
  free(args);
  return rc;
}

static int replay_first(void *user, int n, kiln_tensor *const *in, int n_out, kiln_tensor **out) {
  (void)n_out;
  return replay_region(user, 0, n, in, out);
}

static int replay_second(void *user, int n, kiln_tensor *const *in, int n_out, kiln_tensor **out) {
  (void)n_out;
  return replay_region(user, 1, n, in, out);
}

/* ins[0..in->n_in), then with draws the forward's draws of the instruction
 * (its last outputs, nd of them): the regions' replays read them. */
static int replay_control(const ir_instr *in, kiln_tensor *const *ins, kiln_tensor **outs, int depth,
                          kiln_tensor *const *draws, int nd) {
  const op_attrs *a = &in->attrs;
  replay_ctx c = {{a->callee, a->callee2}, 0, NULL, depth, draws != NULL, draws ? nd : 0, 0};
  if (in->op == OP_WHILE) { /* under a tape a bounded loop is a scan: this one never drew for a gradient */
    c.has_draws = false;
    c.n_draws = 0;
    c.n_env = in->n_in - a->n_state;
    c.env = ins + a->n_state;
    return kiln_while_loop(replay_first, replay_second, &c, a->n_state, ins, a->trip, outs);
  }
  /* cond: its regions take every operand past pred; scan: the carries and
   * xs, then the environment. The draws follow as more inputs (a scan's as
   * more xs, sliced per step as the forward stacked them). */
  int lead = in->op == OP_COND ? in->n_in - 1 : a->n_state + a->n_xs, n_all = lead + c.n_draws;
  if (in->op == OP_SCAN) {
    c.n_env = in->n_in - lead;
    c.env = ins + lead;
  } else if (draws && (c.nd0 = region_draws(a->callee, depth + 1)) < 0) {
    return -1;
  }
  kiln_tensor **all = malloc(((size_t)n_all + 1) * sizeof *all);
  if (!all) return kiln_set_error("trace: out of memory");
  for (int i = 0; i < lead; i++) all[i] = ins[(in->op == OP_COND) + i];
  for (int i = 0; i < c.n_draws; i++) all[lead + i] = draws[i];
  int rc, nc = a->n_state;
  if (in->op == OP_COND)
    rc = kiln_cond(ins[0], replay_first, replay_second, &c, n_all, all, in->n_out, outs);
  else
    rc = kiln_scan(replay_first, &c, nc, all, n_all - nc, all + nc, a->trip, a->reverse, in->n_out - nc, outs,
                   outs + nc);
  free(all);
  return rc;
}

/* draws: the values of g's draws (above), in order (the forward step's),
 * or NULL (a region that draws has no gradient then) */
static int replay(const ir_func *g, kiln_tensor *const *args, kiln_tensor **results, int depth,
                  kiln_tensor *const *draws) {
  if (depth > 64) return kiln_set_error("trace: regions nested too deeply to replay");
  kiln_tensor **v = calloc((size_t)g->n_values + 1, sizeof *v), **ins = NULL;
  int cap = 0, rc = v ? 0 : kiln_set_error("trace: out of memory"), drawn = 0;
  for (int i = 0; i < g->n_params && !rc; i++) v[i] = args[i];
  for (int i = 0; i < g->n_instrs && !rc; i++) {
    const ir_instr *in = &g->instrs[i];
    if (in->n_in > cap) {
      kiln_tensor **q = realloc(ins, (size_t)in->n_in * sizeof *q);
      if (!q) {
        rc = kiln_set_error("trace: out of memory");
        break;
      }
      ins = q;
      cap = in->n_in;
    }
    for (int k = 0; k < in->n_in; k++) ins[k] = v[in->in[k]];
    op_kind kind = kiln_ops[in->op].kind;
    if (in->op == OP_CONSTANT) {
      v[in->out] = in->attrs.value;
    } else if (kind == OPK_CALL) {
      rc = replay(in->attrs.callee, ins, v + in->out, depth + 1, NULL);
    } else if (kind == OPK_CONTROL) {
      int nd = draws ? instr_draws(in, depth) : 0; /* its draws: the last nd of its outputs, the next nd of g's */
      rc = nd < 0 ? -1 : replay_control(in, ins, v + in->out, depth, draws ? draws + drawn : NULL, nd);
      drawn += nd;
    } else if (kind == OPK_RANDOM && draws) { /* the forward's draw, not a new one */
      v[in->out] = draws[drawn++];
    } else if (kind == OPK_RANDOM) {
      rc = kiln_set_error("%s: drawn in a staged while_loop without max_iterations (or a staged call) inside a "
                          "differentiated staged loop or branch: no gradient, its draws would differ in the "
                          "backward pass (give the while_loop max_iterations)",
                          kiln_ops[in->op].api);
    } else if (kind == OPK_HOST) {
      const ir_host *h = in->attrs.host;
      kiln_spec *specs = calloc((size_t)h->n_out + 1, sizeof *specs);
      if (!specs) rc = kiln_set_error("trace: out of memory");
      for (int k = 0; !rc && k < h->n_out; k++) {
        specs[k].dtype = h->out[k].dtype;
        specs[k].rank = h->out[k].rank;
        for (int d = 0; d < h->out[k].rank; d++) specs[k].shape[d] = h->out[k].shape[d];
      }
      if (!rc) rc = kiln_host_call(h->fn, h->user, in->n_in, ins, h->n_out, specs, v + in->out);
      free(specs);
    } else {
      if (!(v[in->out] = op_apply(in->op, &in->attrs, in->n_in, ins))) rc = -1;
    }
  }
  for (int r = 0; r < g->n_results && !rc; r++) results[r] = v[g->results[r]];
  free(ins);
  free(v);
  return rc;
}

typedef struct cf_node cf_node;
typedef struct {
  cf_node *node;
  int k; /* the output this slot's tape node stands for */
} cf_slot;

struct cf_node {
  int refs;
  cf_spec s;
  ir_module *m;          /* copies of the regions */
  const ir_func *r[2];
  int n_head, n_env;
  kiln_tensor **head, **env, **stack, **draws; /* retained */
  cf_slot *slots;
};

static bool is_float(const kiln_tensor *t) { return t->dtype == KILN_F32 || t->dtype == KILN_F64; }

static kiln_tensor *zeros_like(const kiln_tensor *t) { return kiln_zeros((kiln_dtype)t->dtype, t->rank, t->shape); }

static void release_n(int n, kiln_tensor **t) {
  for (int i = 0; t && i < n; i++) kiln_release(t[i]);
  free(t);
}

static void node_retain(void *p) { __atomic_add_fetch(&((cf_slot *)p)->node->refs, 1, __ATOMIC_RELAXED); }

static void node_free(cf_node *nd) {
  ir_module_free(nd->m);
  release_n(nd->n_head, nd->head);
  release_n(nd->n_env, nd->env);
  release_n(nd->s.nc, nd->stack);
  release_n(nd->s.n_draws, nd->draws);
  free(nd->slots);
  free(nd);
}

static void node_release(void *p) {
  cf_node *nd = ((cf_slot *)p)->node;
  if (!__atomic_sub_fetch(&nd->refs, 1, __ATOMIC_ACQ_REL)) node_free(nd);
}

static const tape_closure cond_closure = {node_retain, node_release, "cond"};
static const tape_closure scan_closure = {node_retain, node_release, "scan"};

/* ---- the VJP of one body ---- */

/* g[0..n_in + n_env) = d L / d (in, env), L = sum_j <out_j, seeds[j]> over
 * the body's float outputs with a seed; zeros where L does not depend. */
static int body_vjp(const cf_node *nd, int b, int n_in, kiln_tensor *const *in, kiln_tensor *const *seeds,
                    kiln_tensor *const *draws, kiln_tensor **g) {
  const char *who = kiln_ops[nd->s.op].api;
  int n_src = n_in + nd->n_env, n_out = nd->r[b]->n_results, rc = 0;
  kiln_tensor **src = calloc((size_t)n_src + n_out + 1, sizeof *src), **o = src + n_src;
  if (!src) return kiln_set_error("%s: out of memory", who);
  for (int i = 0; i < n_src; i++) src[i] = i < n_in ? in[i] : nd->env[i - n_in];
  kiln_tape *tape = kiln_tape_begin(false);
  if (!tape) rc = -1;
  for (int i = 0; i < n_src && !rc; i++)
    if (is_float(src[i])) kiln_tape_watch(tape, src[i]);
  /* the draws the forward kept for this region, as many as the replay reads */
  int want = nd->s.op == OP_COND ? (b ? nd->s.n_draws - nd->s.n_draws0 : nd->s.n_draws0) : nd->s.n_draws;
  int got = rc ? 0 : region_draws(nd->r[b], 0);
  if (!rc && got != want)
    rc = got < 0 ? -1 : kiln_set_error("%s: the region replays %d draws, the forward kept %d", who, got, want);
  if (!rc) rc = replay(nd->r[b], src, o, 0, draws); /* the region's parameters: its inputs, then the environment */
  kiln_tensor *loss = NULL;
  for (int j = 0; j < nd->s.n_out && !rc; j++) {
    if (!seeds[j] || !is_float(o[j])) continue;
    kiln_tensor *term = kiln_reduce_sum(kiln_mul(o[j], seeds[j]), 0, NULL, false);
    loss = loss ? kiln_add(loss, term) : term;
    if (!loss) rc = -1;
  }
  if (tape) kiln_tape_end(tape);
  for (int i = 0; i < n_src; i++) g[i] = NULL;
  if (!rc && loss) rc = kiln_tape_gradient(tape, loss, n_src, src, g);
  for (int i = 0; i < n_src && !rc; i++)
    if (!g[i] && !(g[i] = zeros_like(src[i]))) rc = -1;
  kiln_tape_free(tape);
  free(src);
  return rc;
}

/* ---- cond ---- */

/* in: the branch's inputs, dy, then the draws of both branches; out: the
 * inputs' gradients, then the environment's */
static int cond_vjp(void *user, int b, int n, kiln_tensor *const *in, kiln_tensor **out) {
  const cf_slot *sl = user;
  const cf_node *nd = sl->node;
  int n_in = n - 1 - nd->s.n_draws;
  kiln_tensor **seeds = calloc((size_t)nd->s.n_out + 1, sizeof *seeds);
  if (!seeds) return kiln_set_error("cond: out of memory");
  seeds[sl->k] = in[n_in];
  kiln_tensor *const *draws = in + n_in + 1 + (b ? nd->s.n_draws0 : 0);
  int rc = body_vjp(nd, b, n_in, in, seeds, draws, out);
  free(seeds);
  return rc;
}

static int cond_vjp_then(void *user, int n, kiln_tensor *const *in, int n_out, kiln_tensor **out) {
  (void)n_out;
  return cond_vjp(user, 0, n, in, out);
}

static int cond_vjp_else(void *user, int n, kiln_tensor *const *in, int n_out, kiln_tensor **out) {
  (void)n_out;
  return cond_vjp(user, 1, n, in, out);
}

/* xs: pred, the inputs, the environment */
static int cond_grad(void *user, int n, kiln_tensor *const *xs, kiln_tensor *y, kiln_tensor *dy, kiln_tensor **dxs) {
  (void)y;
  const cf_slot *sl = user;
  const cf_node *nd = sl->node;
  int n_in = nd->s.n_in, n_g = n_in + nd->n_env, n_args = n_in + 1 + nd->s.n_draws;
  kiln_tensor **args = calloc((size_t)n_args + 1 + n_g, sizeof *args), **g = args + n_args;
  if (!args) return kiln_set_error("cond: out of memory");
  for (int i = 0; i < n_in; i++) args[i] = xs[1 + i];
  args[n_in] = dy;
  for (int i = 0; i < nd->s.n_draws; i++) args[n_in + 1 + i] = nd->draws[i];
  int rc = kiln_cond(xs[0], cond_vjp_then, cond_vjp_else, user, n_args, args, n_g, g);
  dxs[0] = NULL;
  for (int i = 1; i < n; i++) dxs[i] = !rc && is_float(xs[i]) ? g[i - 1] : NULL;
  free(args);
  return rc;
}

/* ---- scan ---- */

/* in: dcarry (nc), denv (n_env), the step's carry (nc), x_t (nx), dy_t
 * where the slot's output is a y, then the step's draws; out: dcarry, denv
 * + this step's, dx_t */
static int scan_vjp(void *user, int n, kiln_tensor *const *in, int n_out, kiln_tensor **out) {
  (void)n, (void)n_out;
  const cf_slot *sl = user;
  const cf_node *nd = sl->node;
  int nc = nd->s.nc, nx = nd->s.nx, ne = nd->n_env, n_in = nc + nx, rc = 0;
  kiln_tensor *const *dc = in, *const *denv = in + nc, *const *step_in = in + nc + ne;
  kiln_tensor **seeds = calloc((size_t)nd->s.n_out + n_in + ne + 1, sizeof *seeds), **g = seeds + nd->s.n_out;
  if (!seeds) return kiln_set_error("scan: out of memory");
  for (int j = 0; j < nc; j++) seeds[j] = dc[j];
  if (sl->k >= nc) seeds[sl->k] = in[nc + ne + n_in];
  rc = body_vjp(nd, 0, n_in, step_in, seeds, step_in + n_in + (sl->k >= nc), g);
  for (int j = 0; j < nc && !rc; j++) out[j] = g[j];
  for (int j = 0; j < ne && !rc; j++) /* summed over the steps; none for integers and bools */
    if (!(out[nc + j] = is_float(denv[j]) ? kiln_add(denv[j], g[n_in + j]) : denv[j])) rc = -1;
  for (int i = 0; i < nx && !rc; i++) out[nc + ne + i] = g[nc + i];
  free(seeds);
  return rc;
}

/* xs: the carries, the xs, the environment */
static int scan_grad(void *user, int n, kiln_tensor *const *xs, kiln_tensor *y, kiln_tensor *dy, kiln_tensor **dxs) {
  (void)y;
  const cf_slot *sl = user;
  const cf_node *nd = sl->node;
  int nc = nd->s.nc, nx = nd->s.nx, ne = nd->n_env, k = sl->k, rc = 0;
  int n_carry = nc + ne, n_xs = nc + nx + (k >= nc) + nd->s.n_draws;
  kiln_tensor **init = calloc((size_t)n_carry + n_xs + n_carry + nx + 1, sizeof *init);
  if (!init) return kiln_set_error("scan: out of memory");
  kiln_tensor **seq = init + n_carry, **fin = seq + n_xs, **dxt = fin + n_carry;
  for (int j = 0; j < nc && !rc; j++)
    if (!(init[j] = j == k ? dy : zeros_like(xs[j]))) rc = -1;
  for (int j = 0; j < ne && !rc; j++)
    if (!(init[nc + j] = zeros_like(nd->env[j]))) rc = -1;
  for (int j = 0; j < nc; j++) seq[j] = nd->stack[j];
  for (int i = 0; i < nx; i++) seq[nc + i] = xs[nc + i];
  if (k >= nc) seq[nc + nx] = dy;
  for (int i = 0; i < nd->s.n_draws; i++) seq[nc + nx + (k >= nc) + i] = nd->draws[i];
  if (!rc)
    rc = kiln_scan(scan_vjp, user, n_carry, init, n_xs, seq, nd->s.len, !nd->s.reverse, nx, fin, nx ? dxt : NULL);
  for (int i = 0; i < n; i++) dxs[i] = NULL;
  for (int j = 0; j < nc && !rc; j++) dxs[j] = is_float(xs[j]) ? fin[j] : NULL;
  for (int i = 0; i < nx && !rc; i++) dxs[nc + i] = is_float(xs[nc + i]) ? dxt[i] : NULL;
  for (int j = 0; j < ne && !rc; j++) dxs[nc + nx + j] = is_float(xs[nc + nx + j]) ? fin[nc + j] : NULL;
  free(init);
  return rc;
}

/* ---- recording ---- */

static _Thread_local kiln_tensor *pending;

static kiln_tensor *forward_done(void *user, int n, kiln_tensor *const *xs) {
  (void)user, (void)n, (void)xs;
  return pending;
}

int cf_record_gradients(const cf_spec *s, const ir_func *const *regions, int n_head, kiln_tensor *const *head,
                        int n_env, kiln_tensor *const *env, kiln_tensor **outs, kiln_tensor *const *stack) {
  const char *who = kiln_ops[s->op].api;
  cf_node *nd = calloc(1, sizeof *nd);
  kiln_tensor **ops = calloc((size_t)n_head + n_env + 1, sizeof *ops);
  ir_clone_memo memo = {0};
  if (nd && (nd->m = ir_module_new())) {
    for (int b = 0; b < 2; b++)
      if (regions[b] && !(nd->r[b] = ir_clone_func(nd->m, regions[b], &memo))) {
        ir_clone_memo_free(&memo);
        node_free(nd);
        free(ops);
        return -1;
      }
  }
  ir_clone_memo_free(&memo);
  if (nd) {
    nd->refs = 1;
    nd->s = *s;
    nd->n_head = n_head;
    nd->n_env = n_env;
    nd->head = calloc((size_t)n_head + 1, sizeof *nd->head);
    nd->env = calloc((size_t)n_env + 1, sizeof *nd->env);
    nd->stack = calloc((size_t)s->nc + 1, sizeof *nd->stack);
    nd->draws = calloc((size_t)s->n_draws + 1, sizeof *nd->draws);
    nd->slots = calloc((size_t)s->n_out + 1, sizeof *nd->slots);
  }
  if (!nd || !ops || !nd->m || !nd->head || !nd->env || !nd->stack || !nd->draws || !nd->slots) {
    if (nd) node_free(nd);
    free(ops);
    return kiln_set_error("%s: out of memory", who);
  }
  for (int i = 0; i < n_head; i++) ops[i] = nd->head[i] = kiln_retain(head[i]);
  for (int i = 0; i < n_env; i++) ops[n_head + i] = nd->env[i] = kiln_retain(env[i]);
  for (int j = 0; s->op == OP_SCAN && j < s->nc; j++) nd->stack[j] = kiln_retain(stack[j]);
  for (int j = 0; j < s->n_draws; j++) nd->draws[j] = kiln_retain(stack[s->nc + j]);
  int rc = 0;
  for (int k = 0; k < s->n_out && !rc; k++) {
    nd->slots[k] = (cf_slot){nd, k};
    if (!is_float(outs[k]) || k >= s->n_out - s->n_draws) continue; /* draws depend on nothing */
    pending = outs[k];
    kiln_tensor *y = tape_custom_gradient(forward_done, s->op == OP_COND ? cond_grad : scan_grad, &nd->slots[k],
                                          s->op == OP_COND ? &cond_closure : &scan_closure, n_head + n_env, ops);
    pending = NULL;
    if (!y) rc = -1;
    else outs[k] = y;
  }
  node_release(&(cf_slot){nd, 0});
  free(ops);
  return rc;
}
