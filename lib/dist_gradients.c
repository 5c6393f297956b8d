/* dist_gradients.c — the adjoints of the collectives under tapes. The
 * world's loss is the sum of every rank's loss, so each adjoint is itself a
 * collective: all_reduce(sum) <-> all_reduce(sum), mean <-> mean,
 * all_gather <-> reduce_scatter(sum), broadcast_from(root) <-> a sum to
 * root. max and min send the gradient to the elements equal to the result,
 * shared equally between the ranks that tie (as reduce_max does). The rules
 * are written with the public collectives, so an outer tape records them
 * and differentiates again. Every rank must take the gradient through the
 * same collectives in the same order, as it ran them forward. */
#include <stdlib.h>

#include "autodiff.h"
#include "dist.h"

typedef struct {
  atomic_int refs;
  dist_kind kind;
  dist_op op;
  int64_t arg;
} collective_node;

static void node_retain(void *user) { atomic_fetch_add(&((collective_node *)user)->refs, 1); }
static void node_release(void *user) {
  if (atomic_fetch_sub(&((collective_node *)user)->refs, 1) == 1) free(user);
}

static const tape_closure closures[] = {
    [DIST_ALL_REDUCE] = {node_retain, node_release, "all_reduce"},
    [DIST_ALL_GATHER] = {node_retain, node_release, "all_gather"},
    [DIST_REDUCE_SCATTER] = {node_retain, node_release, "reduce_scatter"},
    [DIST_BROADCAST] = {node_retain, node_release, "broadcast_from"},
};

/* x's share of the gradient of an extremum y (x and y of one shape; dy_sum
 * the world's gradient of y): dy_sum where x equals y, split between the
 * ranks that tie, 0 elsewhere */
static kiln_tensor *extremum_share(kiln_tensor *x, kiln_tensor *y, kiln_tensor *dy_sum) {
  kiln_dtype dt = (kiln_dtype)x->dtype;
  kiln_tensor *hit = kiln_cast(kiln_equal(x, y), dt);
  kiln_tensor *ties = kiln_maximum(kiln_all_reduce(hit, "sum"), kiln_scalar(dt, 1));
  return kiln_mul(hit, kiln_div(dy_sum, ties));
}

static int gradient(void *user, int n, kiln_tensor *const *xs, kiln_tensor *y, kiln_tensor *dy, kiln_tensor **dxs) {
  (void)n;
  const collective_node *c = user;
  kiln_tensor *x = xs[0];
  int axis = (int)c->arg;
  switch (c->kind) {
  case DIST_ALL_REDUCE:
    if (c->op == DIST_SUM || c->op == DIST_MEAN) {
      dxs[0] = kiln_all_reduce(dy, c->op == DIST_SUM ? "sum" : "mean");
    } else {
      dxs[0] = extremum_share(x, y, kiln_all_reduce(dy, "sum"));
    }
    break;
  case DIST_ALL_GATHER:
    dxs[0] = kiln_reduce_scatter(dy, axis, "sum");
    break;
  case DIST_REDUCE_SCATTER:
    if (c->op == DIST_SUM) {
      dxs[0] = kiln_all_gather(dy, axis);
    } else if (c->op == DIST_MEAN) {
      dxs[0] = kiln_div(kiln_all_gather(dy, axis), kiln_scalar_like(dy, kiln_dist_size()));
    } else {
      /* rank r's block s went to rank s: compare it with the gathered results */
      dxs[0] = extremum_share(x, kiln_all_gather(y, axis), kiln_all_gather(dy, axis));
    }
    break;
  default: {
    kiln_tensor *sum = kiln_all_reduce(dy, "sum");
    dxs[0] = kiln_dist_rank() == c->arg ? sum : sum ? kiln_zeros((kiln_dtype)x->dtype, x->rank, x->shape) : NULL;
    break;
  }
  }
  return dxs[0] ? 0 : -1;
}

int dist_record(dist_kind kind, dist_op op, int64_t arg, kiln_tensor *in, kiln_tensor *out) {
  if (!tape_active_count) return 0;
  collective_node *c = malloc(sizeof *c);
  if (!c) return kiln_set_error("%s: out of memory", closures[kind].what);
  atomic_init(&c->refs, 1);
  c->kind = kind;
  c->op = op;
  c->arg = arg;
  int rc = tape_record_custom(1, &in, out, gradient, c, &closures[kind]);
  node_release(c); /* the tapes' nodes hold their own references */
  return rc;
}

int dist_grad_rule(const grad_args *g) {
  const op_attrs *a = g->attrs;
  dist_kind kind = dist_kind_of(g->op);
  collective_node c = {.kind = kind, .op = (dist_op)-1, .arg = a->axis};
  if (kind == DIST_ALL_REDUCE || kind == DIST_REDUCE_SCATTER) c.op = (dist_op)a->reduce;
  if (kind == DIST_BROADCAST) c.arg = a->root;
  if (!g->need[0]) return 0;
  kiln_tensor *x = g->in[0];
  return gradient(&c, 1, &x, g->out, g->dout, &g->dx[0]);
}
