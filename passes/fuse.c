/* fuse.c — groups instructions into kernels, in the manner of XLA's
 * instruction fusion: each dot first takes its epilogue (bias add,
 * activation); then, consumers first, each kernel takes in the producers of
 * its operands (elementwise chains with the broadcasts, reshapes and
 * transposes that feed them, elementwise producers into reductions); a
 * kernel that reads another's result over the same domain joins it; and
 * siblings that read one large input merge into one multi-output kernel.
 * A group of two or more instructions becomes a function of the module
 * (@f.fusedN) called by one fusion instruction. The refusals are the named
 * predicates below (is_expensive, would_recompute, moves_expensive,
 * makes_cycle, ...). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "buffers.h"
#include "rewrite.h"
#include "runtime.h"

enum {
  FUSE_MAX_REDUCTIONS = 2,       /* reductions in one kernel */
  FUSE_SIBLING_MIN_ELEMS = 1024, /* a shared input this large is worth reading once */
};

/* What an instruction can be in a kernel. */
typedef enum {
  CLS_ELEM,   /* unary, binary, compare, select, convert: one element from the same element */
  CLS_MOVE,   /* broadcast, reshape, transpose, slice, identity, iota, scalar constant: cheap, copied into
                 every consumer that fuses it */
  CLS_REDUCE, /* reductions and argmax: the roots of their kernel */
  CLS_DOT,    /* dot and conv2d: leads a kernel of its epilogue */
  CLS_OPAQUE, /* never fused: gather, scatter, concat, big constants, random, calls, host calls, control flow */
} fz_class;

/* One instruction of the graph the pass groups: an instruction of f, or a
 * copy of a cheap producer made for one of its consumers. */
typedef struct fz_node {
  const ir_instr *ins; /* op, attributes, loc; its results' types are those of ins->out.. */
  int n_in;
  int32_t *in; /* operands, in the extended value space */
  int32_t out; /* first result in the extended value space */
  int n_out;
  fz_class cls;
  int epoch;   /* host calls and impure calls before it: never fused across */
  bool effect; /* random draws, host calls, impure calls: emitted in their order */
  bool clone;
} fz_node;

typedef struct fz {
  ir_func *f;
  /* the extended value space: f's values, then the results of copies */
  int n_vals, cap_vals;
  op_type *vtype;
  int32_t *vdef; /* defining node, -1 for parameters */
  bool *is_result;
  /* nodes, in creation order while building, then in topological order */
  int n, cap;
  fz_node *nodes;
  /* users by value while building (creation ids), then a CSR by value */
  int32_t **ul;
  int *un, *ucap;
  int32_t *ustart, *users;
  /* union-find groups; a group's data lives at its root */
  int32_t *parent, *head, *next, *tail, *gmin, *gmax, *nred, *gdot, *gred;
  bool *has_elem;
  bool *copied; /* per instruction of f: copied for its consumers (same_in_kernel) */
  uint8_t *gmoves; /* GROUP_EXPENSIVE | GROUP_MOVES of its members (moves_expensive) */
  op_type *dom; /* the loop domain: the root's shape, a reduction's input */
  /* graph walks */
  int32_t *mark, *stack, *expmark, *scratch, *work;
  int32_t stamp;
} fz;

enum { GROUP_EXPENSIVE = 1, GROUP_MOVES = 2 };

/* ---- what an instruction is ---- */

static fz_class classify(const ir_func *f, const ir_instr *ins) {
  if (ins->n_out != 1 || (unsigned)ins->op >= OP_COUNT) return CLS_OPAQUE;
  switch (ins->op) {
  case OP_BROADCAST:
  case OP_RESHAPE:
  case OP_TRANSPOSE:
  case OP_SLICE:
  case OP_IDENTITY:
  case OP_STOP_GRADIENT:
  case OP_IOTA:
    return CLS_MOVE;
  case OP_CONSTANT: /* scalars are copied into kernels; bigger ones stay inputs */
    return pass_elems(&f->types[ins->out]) <= 1 ? CLS_MOVE : CLS_OPAQUE;
  case OP_DOT:
  case OP_CONV2D: /* its bias and activation are the conv kernel's epilogue (backends/cpu/plan.c) */
    return CLS_DOT;
  default:
    break;
  }
  switch (kiln_ops[ins->op].kind) {
  case OPK_UNARY:
  case OPK_BINARY:
  case OPK_COMPARE:
  case OPK_SELECT:
  case OPK_CONVERT:
    return CLS_ELEM;
  case OPK_REDUCE:
    return CLS_REDUCE;
  case OPK_CONTROL: /* cond, while, scan: never fused (their regions are fused inside, see manager.c) */
  default:
    return CLS_OPAQUE;
  }
}

/* Work worth computing once: never copied, never recomputed per element of
 * a broadcast. */
static bool is_expensive(op_id op) {
  switch (op) {
  case OP_EXP:
  case OP_LOG:
  case OP_LOG1P:
  case OP_SQRT:
  case OP_RSQRT:
  case OP_SIN:
  case OP_COS:
  case OP_TANH:
  case OP_SIGMOID:
  case OP_POW:
  case OP_DOT:
  case OP_CONV2D:
    return true;
  default:
    return kiln_ops[op].kind == OPK_REDUCE;
  }
}

/* An instruction with an effect: its order among the others stays. */
static bool has_effect(const ir_instr *ins) { return pass_has_effect(ins); }

/* Host calls, impure calls and impure control flow: nothing is fused across
 * them. The library's checks (the label check of a staged loss) are not
 * barriers: they change nothing a kernel reads, so the forward and backward
 * passes around a loss still fuse. */
static bool is_barrier(const ir_instr *ins) {
  if (kiln_ops[ins->op].kind == OPK_HOST && ins->attrs.host && host_builtin_is_check(ins->attrs.host->fn)) return false;
  return kiln_ops[ins->op].kind != OPK_RANDOM && pass_has_effect(ins);
}

/* A consumer that takes its producers in: they are copied for it. */
static bool takes_producers(fz_class c) { return c == CLS_ELEM || c == CLS_MOVE || c == CLS_REDUCE; }

static bool same_shape(const op_type *a, const op_type *b) {
  if (a->rank != b->rank) return false;
  for (int i = 0; i < a->rank; i++)
    if (a->shape[i] != b->shape[i]) return false;
  return true;
}

static int cmp_i32(const void *a, const void *b) {
  int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
  return (x > y) - (x < y);
}

/* ---- building the graph ---- */

static int grow(void **p, int *cap, int need, size_t sz) {
  if (need <= *cap) return 0;
  int c = *cap ? *cap : 16;
  while (c < need) c *= 2;
  void *q = realloc(*p, (size_t)c * sz);
  if (!q) return kiln_set_error("fuse: out of memory");
  *p = q;
  *cap = c;
  return 0;
}

/* a new value of the extended space (a copy's result) */
static int32_t new_val(fz *z, const op_type *t) {
  int cap = z->cap_vals, need = z->n_vals + 1;
  if (need > cap) {
    int c = 2 * cap;
    op_type *vt = realloc(z->vtype, (size_t)c * sizeof *vt);
    if (vt) z->vtype = vt;
    bool *r = vt ? realloc(z->is_result, (size_t)c * sizeof *r) : NULL;
    if (r) z->is_result = r;
    int32_t **ul = r ? realloc(z->ul, (size_t)c * sizeof *ul) : NULL;
    if (ul) z->ul = ul;
    int *un = ul ? realloc(z->un, (size_t)c * sizeof *un) : NULL;
    if (un) z->un = un;
    int *uc = un ? realloc(z->ucap, (size_t)c * sizeof *uc) : NULL;
    if (uc) z->ucap = uc;
    if (!uc) return kiln_set_error("fuse: out of memory");
    z->cap_vals = c;
  }
  int32_t v = z->n_vals++;
  z->vtype[v] = *t;
  z->is_result[v] = false;
  z->ul[v] = NULL;
  z->un[v] = z->ucap[v] = 0;
  return v;
}

static int add_user(fz *z, int32_t v, int32_t node) {
  if (z->un[v] && z->ul[v][z->un[v] - 1] == node) return 0; /* the same node twice in a row */
  if (grow((void **)&z->ul[v], &z->ucap[v], z->un[v] + 1, sizeof **z->ul)) return -1;
  z->ul[v][z->un[v]++] = node;
  return 0;
}

/* appends a node (creation order) using a copy of in; its id or -1 */
static int add_node(fz *z, const ir_instr *ins, const int32_t *in, int32_t out, fz_class cls, int epoch, bool clone) {
  if (grow((void **)&z->nodes, &z->cap, z->n + 1, sizeof *z->nodes)) return -1;
  fz_node *nd = &z->nodes[z->n];
  memset(nd, 0, sizeof *nd);
  if (ins->n_in && !(nd->in = malloc((size_t)ins->n_in * sizeof *nd->in))) return kiln_set_error("fuse: out of memory");
  if (ins->n_in) memcpy(nd->in, in, (size_t)ins->n_in * sizeof *in);
  nd->ins = ins;
  nd->n_in = ins->n_in;
  nd->out = out;
  nd->n_out = clone ? 1 : ins->n_out;
  nd->cls = cls;
  nd->epoch = epoch;
  nd->effect = !clone && has_effect(ins);
  nd->clone = clone;
  int id = z->n++;
  for (int k = 0; k < nd->n_in; k++)
    if (add_user(z, nd->in[k], id)) return -1;
  return id;
}

/* ---- cheap elementwise work computed again by its consumers ----
 * An elementwise chain of cheap steps over one or two large values that are
 * written anyway (parameters, the results of opaque instructions, conv2d
 * results read twice, so never a conv's epilogue), whose other operands are
 * small (scalars, per-channel vectors broadcast), is copied into each
 * kernel that reads it, as XLA duplicates cheap producers: each consumer
 * reads the large values in its place, and the chain's result is never
 * written. A training step's batch norm is the case: x - mean and the
 * pre-relu output, read again by the backward, were written by the forward
 * only to be read back; and the backward's relu-masked gradient, a chain
 * over x and the incoming gradient, was written by the kernel that sums it
 * only to be read back by the one that makes dx, which reads x anyway. A
 * chain over two values is copied for at most RECOMPUTE_TWO_USERS readers:
 * each may read one value more than it would have, and a write costs about
 * two reads. */
enum { RECOMPUTE_MAX_DEPTH = 8, RECOMPUTE_TWO_USERS = 3 };

/* Does operand v of an instruction with n result elements stand for fewer
 * elements: a scalar or a broadcast of a smaller value? */
static bool small_source(const ir_func *f, ir_value v, int64_t n) {
  if (pass_elems(&f->types[v]) < n) return true;
  const ir_instr *d = f->def[v] >= 0 ? &f->instrs[f->def[v]] : NULL;
  return d && d->op == OP_BROADCAST && pass_elems(&f->types[d->in[0]]) < n;
}

/* depth[v]: the steps of the cheap chain value v ends, computed from one or
 * two large values written anyway (leaf[2 v], leaf[2 v + 1], -1 for none);
 * 0 for such a large value (a parameter, an opaque result, an elementwise
 * one that must be written for a reader that cannot compute it: a
 * residual block's output, which the next conv reads), -1 for anything
 * else. */
static int recompute_depths(const ir_func *f, int8_t *depth) {
  int32_t *users = calloc((size_t)f->n_values + 1, sizeof *users);
  int32_t *leaf = malloc(((size_t)f->n_values + 1) * 2 * sizeof *leaf);
  bool *kept = calloc((size_t)f->n_values + 1, sizeof *kept);
  if (!users || !leaf || !kept) {
    free(users);
    free(leaf);
    free(kept);
    return kiln_set_error("fuse: out of memory");
  }
  for (int i = 0; i < f->n_instrs; i++)
    for (int j = 0; j < f->instrs[i].n_in; j++)
      if (j == 0 || f->instrs[i].in[j] != f->instrs[i].in[j - 1]) users[f->instrs[i].in[j]]++;
  /* written anyway: a result, or read by something that does not compute
   * with its copy (a conv, a call, a reshape that views it) */
  for (int r = 0; r < f->n_results; r++) kept[f->results[r]] = true;
  for (int i = 0; i < f->n_instrs; i++) {
    fz_class c = classify(f, &f->instrs[i]);
    if (c != CLS_ELEM && c != CLS_REDUCE)
      for (int j = 0; j < f->instrs[i].n_in; j++) kept[f->instrs[i].in[j]] = true;
  }
  for (int v = 0; v < f->n_values; v++) depth[v] = -1, leaf[2 * v] = v, leaf[2 * v + 1] = -1;
  for (int p = 0; p < f->n_params; p++) depth[p] = 0;
  for (int i = 0; i < f->n_instrs; i++) {
    const ir_instr *ins = &f->instrs[i];
    fz_class cls = classify(f, ins);
    if (cls == CLS_OPAQUE || (ins->op == OP_CONV2D && users[ins->out] >= 2) ||
        (cls == CLS_ELEM && kept[ins->out])) {
      for (int r = 0; r < ins->n_out; r++) depth[ins->out + r] = 0;
      continue;
    }
    if (cls != CLS_ELEM || is_expensive(ins->op) || has_effect(ins)) continue;
    int64_t n = pass_elems(&f->types[ins->out]);
    int32_t set[2] = {-1, -1};
    int d = -1;
    bool ok = true;
    for (int j = 0; j < ins->n_in && ok; j++) {
      ir_value v = ins->in[j];
      if (small_source(f, v, n)) continue;
      ok = pass_elems(&f->types[v]) == n && depth[v] >= 0 && depth[v] < RECOMPUTE_MAX_DEPTH;
      if (depth[v] > d) d = depth[v];
      for (int k = 0; k < 2 && ok; k++) { /* v's large values join the set */
        int32_t l = leaf[2 * v + k];
        if (l < 0 || l == set[0] || l == set[1]) continue;
        if (set[0] < 0)
          set[0] = l;
        else if (set[1] < 0)
          set[1] = l;
        else
          ok = false;
      }
    }
    if (ok && set[1] >= 0 && users[ins->out] > RECOMPUTE_TWO_USERS) ok = false;
    if (ok) { /* (from small values alone, a broadcast's worth of work: depth 1) */
      depth[ins->out] = (int8_t)(d + 1 > 1 ? d + 1 : 1);
      leaf[2 * ins->out] = set[0], leaf[2 * ins->out + 1] = set[1];
    }
  }
  free(users);
  free(leaf);
  free(kept);
  return 0;
}

/* Copies the cheap producer ins (results value v) for each consumer that
 * will take it in, so that each kernel computes its own broadcast or
 * transpose (or cheap chain, above) instead of reading a materialized one.
 * The original stays for the others (or for the first consumer when there
 * are no others). Runs before ins's own node is made: its consumers are all
 * made already. */
static int copy_for_consumers(fz *z, const ir_instr *ins, int epoch, fz_class cls) {
  int32_t v = ins->out;
  int nf = 0, n_other = z->is_result[v] ? 1 : 0;
  int32_t *fus = malloc(((size_t)z->un[v] + 1) * sizeof *fus);
  if (!fus) return kiln_set_error("fuse: out of memory");
  for (int j = 0; j < z->un[v]; j++) {
    int32_t u = z->ul[v][j];
    bool dup = false;
    for (int q = 0; q < nf && !dup; q++) dup = fus[q] == u;
    if (dup) continue;
    fz_class uc = z->nodes[u].cls;
    if (takes_producers(uc) && z->nodes[u].epoch == epoch && (cls == CLS_MOVE || uc != CLS_MOVE))
      fus[nf++] = u;
    else
      n_other++;
  }
  int rc = 0;
  /* a cheap chain is copied only when every consumer computes with it: one
   * that does not (a call, a conv, a result, a reshape that views it) needs
   * it written anyway, and the copies would only compute it again */
  if (cls == CLS_ELEM && n_other > 0) nf = 0;
  if (nf >= 1 && nf + (n_other > 0) >= 2) {
    for (int j = n_other ? 0 : 1; j < nf && !rc; j++) {
      int32_t u = fus[j], c = new_val(z, &z->f->types[v]);
      if (c < 0) {
        rc = -1;
        break;
      }
      fz_node *un = &z->nodes[u];
      for (int k = 0; k < un->n_in; k++)
        if (un->in[k] == v) un->in[k] = c;
      if (add_node(z, ins, ins->in, c, cls, epoch, true) < 0 || add_user(z, c, u)) rc = -1;
      z->copied[ins - z->f->instrs] = true;
    }
  }
  free(fus);
  return rc;
}

/* The nodes of f (copies of cheap producers included) in topological
 * order, the users of every value, and one singleton group per node. */
static int build(fz *z) {
  ir_func *f = z->f;
  int cap = f->n_values + 16;
  z->vtype = malloc((size_t)cap * sizeof *z->vtype);
  z->is_result = malloc((size_t)cap * sizeof *z->is_result);
  z->ul = malloc((size_t)cap * sizeof *z->ul);
  z->un = malloc((size_t)cap * sizeof *z->un);
  z->ucap = malloc((size_t)cap * sizeof *z->ucap);
  int *epoch = malloc(((size_t)f->n_instrs + 1) * sizeof *epoch);
  int8_t *depth = malloc((size_t)f->n_values + 1);
  z->copied = calloc((size_t)f->n_instrs + 1, sizeof *z->copied);
  if (!z->vtype || !z->is_result || !z->ul || !z->un || !z->ucap || !epoch || !depth || !z->copied) {
    free(epoch);
    free(depth);
    return kiln_set_error("fuse: out of memory");
  }
  z->cap_vals = cap;
  for (int v = 0; v < f->n_values; v++) {
    z->vtype[v] = f->types[v];
    z->is_result[v] = false;
    z->ul[v] = NULL;
    z->un[v] = z->ucap[v] = 0;
  }
  z->n_vals = f->n_values;
  for (int r = 0; r < f->n_results; r++) z->is_result[f->results[r]] = true;
  for (int i = 0, e = 0; i < f->n_instrs; i++) {
    epoch[i] = e;
    if (is_barrier(&f->instrs[i])) e++;
  }
  /* consumers before producers, so a producer sees all its consumers */
  int rc = recompute_depths(f, depth);
  for (int i = f->n_instrs - 1; i >= 0 && !rc; i--) {
    const ir_instr *ins = &f->instrs[i];
    fz_class cls = classify(f, ins);
    bool copied = cls == CLS_MOVE || (cls == CLS_ELEM && depth[ins->out] > 0);
    if (copied && copy_for_consumers(z, ins, epoch[i], cls)) rc = -1;
    if (!rc && add_node(z, ins, ins->in, ins->out, cls, epoch[i], false) < 0) rc = -1;
  }
  free(epoch);
  free(depth);
  if (rc) return -1;
  /* creation order reversed is a topological order */
  for (int a = 0, b = z->n - 1; a < b; a++, b--) {
    fz_node t = z->nodes[a];
    z->nodes[a] = z->nodes[b];
    z->nodes[b] = t;
  }
  int n = z->n;
  z->vdef = malloc(((size_t)z->n_vals + 1) * sizeof *z->vdef);
  z->ustart = calloc((size_t)z->n_vals + 1, sizeof *z->ustart);
  size_t n_uses = 0;
  for (int k = 0; k < n; k++) n_uses += (size_t)z->nodes[k].n_in;
  z->users = malloc((n_uses + 1) * sizeof *z->users);
  z->parent = malloc(((size_t)n + 1) * sizeof *z->parent);
  z->head = malloc(((size_t)n + 1) * sizeof *z->head);
  z->next = malloc(((size_t)n + 1) * sizeof *z->next);
  z->tail = malloc(((size_t)n + 1) * sizeof *z->tail);
  z->gmin = malloc(((size_t)n + 1) * sizeof *z->gmin);
  z->gmax = malloc(((size_t)n + 1) * sizeof *z->gmax);
  z->nred = malloc(((size_t)n + 1) * sizeof *z->nred);
  z->gdot = malloc(((size_t)n + 1) * sizeof *z->gdot);
  z->gred = malloc(((size_t)n + 1) * sizeof *z->gred);
  z->has_elem = malloc(((size_t)n + 1) * sizeof *z->has_elem);
  z->gmoves = malloc(((size_t)n + 1) * sizeof *z->gmoves);
  z->dom = malloc(((size_t)n + 1) * sizeof *z->dom);
  z->mark = calloc((size_t)n + 1, sizeof *z->mark);
  z->stack = malloc(((size_t)n + 1) * sizeof *z->stack);
  z->expmark = calloc((size_t)n + 1, sizeof *z->expmark);
  z->scratch = malloc(((size_t)n + 1) * sizeof *z->scratch);
  z->work = malloc(((size_t)n + 1) * sizeof *z->work);
  if (!z->vdef || !z->ustart || !z->users || !z->parent || !z->head || !z->next || !z->tail || !z->gmin ||
      !z->gmax || !z->nred || !z->gdot || !z->gred || !z->has_elem || !z->gmoves || !z->dom || !z->mark || !z->stack ||
      !z->expmark || !z->scratch || !z->work)
    return kiln_set_error("fuse: out of memory");
  for (int v = 0; v < z->n_vals; v++) z->vdef[v] = -1;
  /* users by value, as a CSR over node indices */
  for (int k = 0; k < n; k++) {
    fz_node *nd = &z->nodes[k];
    for (int r = 0; r < nd->n_out; r++) z->vdef[nd->out + r] = k;
    for (int j = 0; j < nd->n_in; j++) z->ustart[nd->in[j] + 1]++;
  }
  for (int v = 0; v < z->n_vals; v++) z->ustart[v + 1] += z->ustart[v];
  int32_t *fill = malloc(((size_t)z->n_vals + 1) * sizeof *fill);
  if (!fill) return kiln_set_error("fuse: out of memory");
  memcpy(fill, z->ustart, (size_t)z->n_vals * sizeof *fill);
  for (int k = 0; k < n; k++)
    for (int j = 0; j < z->nodes[k].n_in; j++) z->users[fill[z->nodes[k].in[j]]++] = k;
  free(fill);
  for (int k = 0; k < n; k++) {
    const fz_node *nd = &z->nodes[k];
    z->parent[k] = z->head[k] = z->tail[k] = z->gmin[k] = z->gmax[k] = k;
    z->next[k] = -1;
    z->nred[k] = nd->cls == CLS_REDUCE;
    z->gdot[k] = nd->cls == CLS_DOT ? k : -1;
    z->gred[k] = nd->cls == CLS_REDUCE ? k : -1;
    z->has_elem[k] = nd->cls == CLS_ELEM;
    op_id op = nd->ins->op;
    z->gmoves[k] = (uint8_t)((is_expensive(op) ? GROUP_EXPENSIVE : 0) |
                             (op == OP_TRANSPOSE || op == OP_BROADCAST || op == OP_SLICE ? GROUP_MOVES : 0));
    z->dom[k] = nd->cls == CLS_REDUCE ? z->vtype[nd->in[0]] : z->vtype[nd->out];
  }
  return 0;
}

static void fz_free(fz *z) {
  for (int k = 0; k < z->n; k++) free(z->nodes[k].in);
  for (int v = 0; z->ul && v < z->n_vals; v++) free(z->ul[v]);
  free(z->nodes);
  free(z->vtype);
  free(z->vdef);
  free(z->is_result);
  free(z->ul);
  free(z->un);
  free(z->ucap);
  free(z->ustart);
  free(z->users);
  free(z->parent);
  free(z->head);
  free(z->next);
  free(z->tail);
  free(z->gmin);
  free(z->gmax);
  free(z->nred);
  free(z->gdot);
  free(z->gred);
  free(z->has_elem);
  free(z->copied);
  free(z->gmoves);
  free(z->dom);
  free(z->mark);
  free(z->stack);
  free(z->expmark);
  free(z->scratch);
  free(z->work);
}

/* ---- groups ---- */

static int32_t find(fz *z, int32_t k) {
  while (z->parent[k] != k) {
    z->parent[k] = z->parent[z->parent[k]];
    k = z->parent[k];
  }
  return k;
}

/* b's members join a; a's domain stays */
static void merge(fz *z, int32_t a, int32_t b) {
  z->parent[b] = a;
  z->next[z->tail[a]] = z->head[b];
  z->tail[a] = z->tail[b];
  if (z->gmin[b] < z->gmin[a]) z->gmin[a] = z->gmin[b];
  if (z->gmax[b] > z->gmax[a]) z->gmax[a] = z->gmax[b];
  z->nred[a] += z->nred[b];
  if (z->gdot[a] < 0) z->gdot[a] = z->gdot[b];
  if (z->gred[a] < 0) z->gred[a] = z->gred[b];
  z->has_elem[a] |= z->has_elem[b];
  z->gmoves[a] |= z->gmoves[b];
}

static bool single(const fz *z, int32_t g) { return z->gmin[g] == z->gmax[g]; }

/* Is there a path from group a to group b? Kernels are the units: a path
 * may enter a kernel at one member and leave it at another. With
 * through_others, only paths through at least one other group count (a
 * direct edge a -> b is a producer feeding its consumer, fine to fuse). */
static bool path(fz *z, int32_t a, int32_t b, bool through_others) {
  int32_t stamp = ++z->stamp, top = 0;
  z->mark[a] = stamp;
  for (int32_t g = a; g >= 0; g = top ? z->stack[--top] : -1) {
    bool first = g == a;
    for (int32_t m = z->head[g]; m >= 0; m = z->next[m]) {
      const fz_node *nd = &z->nodes[m];
      for (int r = 0; r < nd->n_out; r++) {
        int32_t v = nd->out + r;
        for (int32_t j = z->ustart[v]; j < z->ustart[v + 1]; j++) {
          int32_t h = find(z, z->users[j]);
          if (h == b) {
            if (!first || !through_others) return true;
            continue;
          }
          /* no pruning by index: a kernel that starts after b may still
           * reach it through a kernel that spans it */
          if (h == a || z->mark[h] == stamp) continue;
          z->mark[h] = stamp;
          z->stack[top++] = h;
        }
      }
    }
  }
  return false;
}

/* Merging p into g would make a kernel wait on itself. */
static bool makes_cycle(fz *z, int32_t p, int32_t g) { return path(z, p, g, true) || path(z, g, p, true); }

/* Does value v have a user outside group g, or is it a result? */
static bool value_escapes(fz *z, int32_t v, int32_t g) {
  if (z->is_result[v]) return true;
  for (int32_t j = z->ustart[v]; j < z->ustart[v + 1]; j++)
    if (find(z, z->users[j]) != g) return true;
  return false;
}

static bool escapes(fz *z, int32_t p, int32_t g) {
  for (int r = 0; r < z->nodes[p].n_out; r++)
    if (value_escapes(z, z->nodes[p].out + r, g)) return true;
  return false;
}

/* An expensive producer smaller than the kernel's domain would be computed
 * again for every element it is broadcast to. */
static bool would_recompute(fz *z, int32_t p, int32_t g) {
  const fz_node *nd = &z->nodes[p];
  return is_expensive(nd->ins->op) && pass_elems(&z->vtype[nd->out]) < pass_elems(&z->dom[g]);
}

/* Is node p an ancestor of the dot that leads group g? A dot reads only
 * values computed before its kernel. */
static bool feeds_dot(fz *z, int32_t p, int32_t g) {
  int32_t dot = z->gdot[g], stamp = ++z->stamp, top = 0;
  z->stack[top++] = p;
  z->mark[p] = stamp;
  while (top) {
    const fz_node *nd = &z->nodes[z->stack[--top]];
    for (int r = 0; r < nd->n_out; r++)
      for (int32_t j = z->ustart[nd->out + r]; j < z->ustart[nd->out + r + 1]; j++) {
        int32_t u = z->users[j];
        if (u == dot) return true;
        if (u > dot || z->mark[u] == stamp) continue;
        z->mark[u] = stamp;
        z->stack[top++] = u;
      }
  }
  return false;
}

/* Would the kernel made of groups a and b read expensive work through a
 * transpose, broadcast or slice? Its elements would then be computed again
 * for every index they are read at. */
static bool moves_expensive(fz *z, int32_t a, int32_t b) {
  /* only a kernel with both can (this keeps a long chain of cheap ops from
   * sorting its kernel's members at every merge: quadratic) */
  uint8_t kinds = (uint8_t)(z->gmoves[a] | (b >= 0 ? z->gmoves[b] : 0));
  if (kinds != (GROUP_EXPENSIVE | GROUP_MOVES)) return false;
  int n = 0;
  for (int32_t g = a;; g = b) {
    for (int32_t m = z->head[g]; m >= 0; m = z->next[m]) z->scratch[n++] = m;
    if (g == b || b < 0) break;
  }
  qsort(z->scratch, (size_t)n, sizeof *z->scratch, cmp_i32);
  int32_t stamp = ++z->stamp;
  for (int i = 0; i < n; i++) {
    const fz_node *nd = &z->nodes[z->scratch[i]];
    bool dep = is_expensive(nd->ins->op);
    for (int j = 0; j < nd->n_in && !dep; j++) {
      int32_t d = z->vdef[nd->in[j]];
      dep = d >= 0 && z->expmark[d] == stamp;
    }
    if (!dep) continue;
    op_id op = nd->ins->op;
    if (!is_expensive(op) && (op == OP_TRANSPOSE || op == OP_BROADCAST || op == OP_SLICE)) return true;
    z->expmark[z->scratch[i]] = stamp;
  }
  return false;
}

/* Is g a kernel led by a conv2d? */
static bool conv_led(const fz *z, int32_t g) { return z->gdot[g] >= 0 && z->nodes[z->gdot[g]].ins->op == OP_CONV2D; }

/* A dot may lead g: g has no dot and no reduction (a dot kernel holds only
 * its epilogue), the epilogue runs over the dot's result, and no member of
 * g computes an operand of the dot. */
static bool dot_can_lead(fz *z, int32_t p, int32_t g) {
  const fz_node *nd = &z->nodes[p];
  if (z->gdot[g] >= 0 || z->nred[g] > 0 || !same_shape(&z->vtype[nd->out], &z->dom[g])) return false;
  for (int k = 0; k < nd->n_in; k++)
    if (z->vdef[nd->in[k]] >= 0 && find(z, z->vdef[nd->in[k]]) == g) return false;
  return true;
}

/* Should producer p (a group of its own) join consumer group g? */
static bool should_fuse(fz *z, int32_t p, int32_t g) {
  const fz_node *nd = &z->nodes[p];
  if (nd->cls != CLS_ELEM && nd->cls != CLS_MOVE && nd->cls != CLS_DOT) return false; /* reductions are roots */
  if (nd->epoch != z->nodes[g].epoch) return false;                                   /* a host call between */
  bool out = escapes(z, p, g);
  if (nd->cls == CLS_MOVE && out) return false; /* copied, never a kernel's output */
  if (nd->cls == CLS_DOT && !dot_can_lead(z, p, g)) return false;
  if (nd->cls == CLS_ELEM && would_recompute(z, p, g)) return false;
  if (z->gdot[g] >= 0 && feeds_dot(z, p, g)) return false;
  /* a conv2d leads only its epilogue (fuse_conv_epilogue): it joins no
   * other kernel, and its kernel takes in no producer (the bias and the
   * residual are read as they are) */
  if (nd->ins->op == OP_CONV2D || conv_led(z, g)) return false;
  /* a kernel writes all its outputs over one domain */
  if (out && !same_shape(&z->vtype[nd->out], &z->dom[g])) return false;
  if (moves_expensive(z, g, p)) return false;
  return !makes_cycle(z, p, g);
}

/* The axes a reduction reduces, as a key that two reductions of one kernel
 * must share. */
static bool same_reduction(const fz_node *a, const fz_node *b) {
  const op_attrs *x = &a->ins->attrs, *y = &b->ins->attrs;
  bool am = a->ins->op == OP_ARGMAX, bm = b->ins->op == OP_ARGMAX;
  int xn = am ? 1 : x->naxes, yn = bm ? 1 : y->naxes;
  if (xn != yn || xn > KILN_MAX_RANK || (!am && !bm && x->keepdims != y->keepdims) ||
      (am != bm && (am ? y : x)->keepdims))
    return false;
  for (int i = 0; i < xn; i++)
    if ((am ? x->axis : x->axes[i]) != (bm ? y->axis : y->axes[i])) return false;
  return true;
}

/* A group that may take a sibling: a loop or reduction kernel (no dot, no
 * opaque instruction, not only data movement). */
static bool sibling_kind(fz *z, int32_t g) {
  if (z->gdot[g] >= 0) return false;
  if (single(z, g) && z->nodes[g].cls == CLS_OPAQUE) return false;
  return z->has_elem[g] || z->nred[g] > 0;
}

/* Two kernels reading the same input become one: the same domain, the
 * same epoch, few enough reductions over the same axes, and neither
 * depends on the other. */
static bool should_merge_siblings(fz *z, int32_t a, int32_t b) {
  if (z->nodes[a].epoch != z->nodes[b].epoch || !same_shape(&z->dom[a], &z->dom[b])) return false;
  if (z->nred[a] + z->nred[b] > FUSE_MAX_REDUCTIONS) return false;
  if (z->gred[a] >= 0 && z->gred[b] >= 0 && !same_reduction(&z->nodes[z->gred[a]], &z->nodes[z->gred[b]]))
    return false;
  if (moves_expensive(z, a, b)) return false;
  return !path(z, a, b, false) && !path(z, b, a, false);
}

/* Does a member of group c read the result of a reduction in group g? A
 * reduction ends its kernel: nothing in the kernel reads it. */
static bool reads_reduction(fz *z, int32_t c, int32_t g) {
  for (int32_t m = z->head[c]; m >= 0; m = z->next[m])
    for (int j = 0; j < z->nodes[m].n_in; j++) {
      int32_t d = z->vdef[z->nodes[m].in[j]];
      if (d >= 0 && z->nodes[d].cls == CLS_REDUCE && find(z, d) == g) return true;
    }
  return false;
}

/* A kernel that computes something (not only data movement, nothing opaque). */
static bool computes(fz *z, int32_t g) {
  if (single(z, g) && z->nodes[g].cls == CLS_OPAQUE) return false;
  return z->has_elem[g] || z->nred[g] > 0 || z->gdot[g] >= 0;
}

/* Should consumer group c (which reads an output of group g) join g? Both
 * compute over the same domain; a dot still leads with only its epilogue;
 * few enough reductions, none read inside the kernel; no cycle. */
static bool should_merge_consumer(fz *z, int32_t g, int32_t c) {
  if (!computes(z, g) || !computes(z, c) || z->gdot[c] >= 0) return false;
  if (z->nodes[g].epoch != z->nodes[c].epoch || !same_shape(&z->dom[g], &z->dom[c])) return false;
  if (z->gdot[g] >= 0 && z->nred[c] > 0) return false;
  if (z->nred[g] + z->nred[c] > FUSE_MAX_REDUCTIONS) return false;
  if (z->gred[g] >= 0 && z->gred[c] >= 0 && !same_reduction(&z->nodes[z->gred[g]], &z->nodes[z->gred[c]]))
    return false;
  if (reads_reduction(z, c, g)) return false;
  for (int32_t m = z->head[c]; z->gdot[g] >= 0 && m >= 0; m = z->next[m])
    if (feeds_dot(z, m, g)) return false;
  if (moves_expensive(z, g, c)) return false;
  return !makes_cycle(z, g, c);
}

/* ---- the four steps of grouping ---- */

/* Is operand v of an epilogue small next to the dot's result of n
 * elements: a bias, a scale, a broadcast of one? */
static bool small_operand(fz *z, int32_t v, int64_t n) {
  if (pass_elems(&z->vtype[v]) < n) return true;
  int32_t d = z->vdef[v];
  return d >= 0 && z->nodes[d].ins->op == OP_BROADCAST && pass_elems(&z->vtype[z->nodes[d].in[0]]) < n;
}

/* Is node u a step of the epilogue of group g's dot: elementwise over the
 * dot's result, reading the dot's kernel and small operands only (the
 * bias add, the activation, a scale)? */
static bool is_epilogue(fz *z, int32_t u, int32_t g) {
  const fz_node *nd = &z->nodes[u], *dot = &z->nodes[z->gdot[g]];
  if (nd->cls != CLS_ELEM || !single(z, u) || !same_shape(&z->vtype[nd->out], &z->vtype[dot->out])) return false;
  int64_t n = pass_elems(&z->vtype[dot->out]);
  for (int j = 0; j < nd->n_in; j++) {
    int32_t d = z->vdef[nd->in[j]];
    if (!(d >= 0 && find(z, d) == g) && !small_operand(z, nd->in[j], n)) return false;
  }
  return true;
}

/* The sole user of node k's result when k has one result, which is not a
 * result of the function and is read once; else -1. */
static int32_t sole_user(const fz *z, int32_t k) {
  const fz_node *nd = &z->nodes[k];
  if (nd->n_out != 1 || z->is_result[nd->out] || z->ustart[nd->out + 1] - z->ustart[nd->out] != 1) return -1;
  return z->users[z->ustart[nd->out]];
}

/* Conv2d k's epilogue, the shape a convolution applies as it stores its
 * tiles (backends/cpu/plan.c, conv2d_epilogue): + a bias (fewer elements:
 * one per channel), then maybe + a residual (the result's shape), then
 * maybe relu or tanh, each the previous step's sole user. Nothing else
 * joins a conv: a conv2d with another consumer stays a call of its own. */
static void fuse_conv_epilogue(fz *z, int32_t k) {
  int64_t n = pass_elems(&z->vtype[z->nodes[k].out]);
  if (z->vtype[z->nodes[k].out].rank != 4) return;
  int32_t at = k;
  for (int step = 0; step < 3; step++) {
    int32_t u = sole_user(z, at), g = find(z, k);
    /* u a group of its own (a residual add may have joined the other
     * operand's conv already: merging it again would corrupt both) */
    if (u < 0 || find(z, u) != u || !single(z, u) || z->nodes[u].cls != CLS_ELEM) return;
    const fz_node *nd = &z->nodes[u];
    if (!same_shape(&z->vtype[nd->out], &z->vtype[z->nodes[k].out])) return;
    op_id op = nd->ins->op;
    bool ok = false;
    if (op == OP_ADD && step < 2 && nd->n_in == 2 && nd->in[0] != nd->in[1]) {
      int32_t other = nd->in[0] == z->nodes[at].out ? nd->in[1] : nd->in[0];
      const op_type *t = &z->vtype[other], *ct = &z->vtype[z->nodes[k].out];
      int64_t o = ct->shape[ct->rank - 1];
      /* step 0: a bias of the channels' count, along the last axis; then a
       * residual of the result's shape */
      ok = step == 0 ? t->rank >= 1 && pass_elems(t) == o && t->shape[t->rank - 1] == o && o < n
                     : pass_elems(t) == n && same_shape(t, ct);
    } else if ((op == OP_RELU || op == OP_TANH) && step > 0) {
      ok = true;
      step = 3;
    }
    if (!ok || !should_merge_consumer(z, g, u)) return;
    merge(z, g, u);
    at = u;
  }
}

/* Each dot takes in its epilogue first, before the consumers further down
 * (a backward pass's reductions) claim the same instructions. */
static void fuse_epilogues(fz *z) {
  for (int32_t k = 0; k < z->n; k++) {
    if (z->nodes[k].cls != CLS_DOT || !single(z, k)) continue;
    if (z->nodes[k].ins->op == OP_CONV2D) {
      fuse_conv_epilogue(z, k);
      continue;
    }
    int top = 0;
    z->work[top++] = k;
    while (top) {
      const fz_node *nd = &z->nodes[z->work[--top]];
      for (int r = 0; r < nd->n_out; r++)
        for (int32_t j = z->ustart[nd->out + r]; j < z->ustart[nd->out + r + 1]; j++) {
          int32_t u = z->users[j], g = find(z, k);
          if (find(z, u) != u || !is_epilogue(z, u, g) || !should_merge_consumer(z, g, u)) continue;
          merge(z, g, u);
          z->work[top++] = u;
        }
    }
  }
}

/* Consumers first (as XLA does): each takes in the producers of its
 * operands that may join it. */
static void fuse_producers(fz *z) {
  for (int32_t k = z->n - 1; k >= 0; k--) {
    const fz_node *c = &z->nodes[k];
    if (!takes_producers(c->cls)) continue;
    for (int j = 0; j < c->n_in; j++) {
      int32_t p = z->vdef[c->in[j]], g = find(z, k);
      if (p < 0 || find(z, p) == g || !single(z, find(z, p))) continue;
      if (should_fuse(z, p, g)) merge(z, g, p);
    }
  }
}

/* A kernel that reads what another computes joins it when their domains
 * agree (multi-output producer-consumer fusion): the relu that reads a
 * dot's pre-activation, which its backward pass also reads. */
static void fuse_consumers(fz *z) {
  for (int32_t k = 0; k < z->n; k++) {
    const fz_node *c = &z->nodes[k];
    for (int j = 0; j < c->n_in; j++) {
      int32_t p = z->vdef[c->in[j]];
      if (p < 0) continue;
      int32_t g = find(z, p), h = find(z, k);
      if (g != h && !conv_led(z, g) && should_merge_consumer(z, g, h)) merge(z, g, h);
    }
  }
}

/* Kernels that read the same large input merge into one multi-output
 * kernel, which reads it once. */
static int fuse_siblings(fz *z) {
  int32_t *cand = malloc(((size_t)z->n + 1) * sizeof *cand);
  if (!cand) return kiln_set_error("fuse: out of memory");
  for (int32_t v = 0; v < z->n_vals; v++) {
    if (pass_elems(&z->vtype[v]) < FUSE_SIBLING_MIN_ELEMS) continue;
    int nc = 0;
    for (int32_t j = z->ustart[v]; j < z->ustart[v + 1]; j++) {
      int32_t g = find(z, z->users[j]);
      bool seen = false;
      for (int q = 0; q < nc && !seen; q++) seen = find(z, cand[q]) == g;
      if (!seen && sibling_kind(z, g)) cand[nc++] = g;
    }
    for (int a = 0; a < nc; a++)
      for (int b = a + 1; b < nc; b++) {
        int32_t ga = find(z, cand[a]), gb = find(z, cand[b]);
        if (ga != gb && should_merge_siblings(z, ga, gb)) merge(z, ga, gb);
      }
  }
  free(cand);
  return 0;
}

/* ---- writing the result ---- */

/* a min-heap of group roots by key */
static void heap_push(int32_t *h, int *n, int32_t g, const int32_t *key) {
  int i = (*n)++;
  h[i] = g;
  while (i > 0 && key[h[(i - 1) / 2]] > key[h[i]]) {
    int32_t t = h[i];
    h[i] = h[(i - 1) / 2];
    h[(i - 1) / 2] = t;
    i = (i - 1) / 2;
  }
}

static int32_t heap_pop(int32_t *h, int *n, const int32_t *key) {
  int32_t top = h[0];
  h[0] = h[--*n];
  for (int i = 0;;) {
    int l = 2 * i + 1, r = l + 1, m = i;
    if (l < *n && key[h[l]] < key[h[m]]) m = l;
    if (r < *n && key[h[r]] < key[h[m]]) m = r;
    if (m == i) break;
    int32_t t = h[i];
    h[i] = h[m];
    h[m] = t;
    i = m;
  }
  return top;
}

/* The groups in an order that respects every dependence and the order of
 * the instructions with effects; otherwise as in f, by the first
 * instruction of each group that is not cheap data movement (copies of a
 * broadcast or a constant do not move their consumer up). Writes the roots
 * into order; their count, or -1. */
static int schedule(fz *z, int32_t *order) {
  int n = z->n, n_edges = 0;
  int32_t *key = malloc(((size_t)n + 1) * sizeof *key);
  int32_t *indeg = calloc((size_t)n + 1, sizeof *indeg), *estart = calloc((size_t)n + 2, sizeof *estart);
  int32_t *heap = malloc(((size_t)n + 1) * sizeof *heap);
  size_t cap = 1;
  for (int k = 0; k < n; k++) cap += (size_t)z->nodes[k].n_in + 1;
  int32_t *efrom = malloc(cap * sizeof *efrom), *eto = malloc(cap * sizeof *eto), *edge = malloc(cap * sizeof *edge);
  int count = -1;
  if (!key || !indeg || !estart || !heap || !efrom || !eto || !edge) {
    kiln_set_error("fuse: out of memory");
    goto done;
  }
  for (int k = 0; k < n; k++) key[k] = INT32_MAX;
  for (int k = 0; k < n; k++) { /* instruction index * 2, +1 for data movement: real work first */
    int32_t g = find(z, k), i = (int32_t)(z->nodes[k].ins - z->f->instrs) * 2 + (z->nodes[k].cls == CLS_MOVE);
    if (i < key[g]) key[g] = i;
  }
  int32_t prev_effect = -1;
  for (int k = 0; k < n; k++) {
    const fz_node *nd = &z->nodes[k];
    int32_t to = find(z, k);
    for (int j = 0; j < nd->n_in; j++) {
      int32_t d = z->vdef[nd->in[j]];
      if (d >= 0 && find(z, d) != to) efrom[n_edges] = find(z, d), eto[n_edges++] = to;
    }
    if (nd->effect) {
      if (prev_effect >= 0 && find(z, prev_effect) != to) efrom[n_edges] = find(z, prev_effect), eto[n_edges++] = to;
      prev_effect = k;
    }
  }
  for (int e = 0; e < n_edges; e++) estart[efrom[e] + 1]++, indeg[eto[e]]++;
  for (int k = 0; k < n; k++) estart[k + 1] += estart[k];
  for (int e = 0; e < n_edges; e++) edge[estart[efrom[e]]++] = eto[e];
  for (int k = n; k > 0; k--) estart[k] = estart[k - 1]; /* back to the starts */
  estart[0] = 0;
  int hn = 0;
  count = 0;
  for (int k = 0; k < n; k++)
    if (find(z, k) == k && !indeg[k]) heap_push(heap, &hn, k, key);
  while (hn) {
    int32_t g = heap_pop(heap, &hn, key);
    order[count++] = g;
    for (int32_t e = estart[g]; e < estart[g + 1]; e++)
      if (!--indeg[edge[e]]) heap_push(heap, &hn, edge[e], key);
  }
  int groups = 0;
  for (int k = 0; k < n; k++) groups += find(z, k) == k;
  if (count != groups) count = kiln_set_error("fuse: @%s: internal error: the kernels depend on each other in a cycle",
                                              z->f->name);
done:
  free(key);
  free(indeg);
  free(estart);
  free(heap);
  free(efrom);
  free(eto);
  free(edge);
  return count;
}

typedef struct emitter {
  fz *z;
  pass_builder b;
  int32_t *map;  /* extended value -> value of f's new body */
  int32_t *bmap; /* extended value -> value of the kernel being written */
  int32_t *tmp;  /* scratch: operands */
  int next_kernel;
} emitter;

/* node k as an instruction of f's new body */
static int emit_plain(emitter *e, int32_t k) {
  fz *z = e->z;
  const fz_node *nd = &z->nodes[k];
  int32_t orig = nd->ins->out;
  if (e->map[orig] >= 0) { /* copies that no kernel took are one instruction again */
    e->map[nd->out] = e->map[orig];
    return 0;
  }
  for (int j = 0; j < nd->n_in; j++)
    if ((e->tmp[j] = e->map[nd->in[j]]) < 0)
      return kiln_set_error("fuse: @%s: internal error: an operand has no value", z->f->name);
  ir_value first = pass_emit(&e->b, nd->ins->op, &nd->ins->attrs, nd->n_in, e->tmp, nd->ins->loc);
  if (first < 0) return -1;
  for (int r = 0; r < nd->n_out; r++) {
    e->map[nd->out + r] = first + r;
    if (!nd->clone && pass_replace(&e->b, nd->out + r, first + r, true)) return -1;
  }
  if (nd->clone) { /* the original, if it is emitted later, is this one */
    e->map[orig] = first;
    if (pass_replace(&e->b, orig, first, true)) return -1;
  }
  return 0;
}

/* The value of the kernel being written that member i of mem (its operands'
 * values in e->tmp) computes already: an earlier member that is the same
 * instruction (a copy, or the original, of a cheap producer) on the same
 * values, or -1. */
static ir_value same_in_kernel(const fz *z, const emitter *e, const int32_t *mem, int i) {
  const fz_node *nd = &z->nodes[mem[i]];
  if (nd->n_out != 1 || !z->copied[nd->ins - z->f->instrs]) return -1;
  for (int k = 0; k < i; k++) {
    const fz_node *o = &z->nodes[mem[k]];
    if (o->ins != nd->ins) continue;
    bool same = true;
    for (int j = 0; j < nd->n_in && same; j++) same = e->bmap[o->in[j]] == e->tmp[j];
    if (same) return e->bmap[o->out];
  }
  return -1;
}

/* group g (members sorted, n of them) as a kernel: its body, a function of
 * the module, and one fusion instruction calling it */
static int emit_kernel(emitter *e, int32_t g, int32_t *mem, int n) {
  fz *z = e->z;
  ir_func *f = z->f;
  if (z->gdot[g] >= 0) { /* the dot leads: nothing in the kernel feeds it */
    int i = 0;
    while (mem[i] != z->gdot[g]) i++;
    memmove(mem + 1, mem, (size_t)i * sizeof *mem);
    mem[0] = z->gdot[g];
  }
  /* inputs: values the members read from outside, in order of first use */
  int n_in = 0, n_out = 0;
  int32_t *in = malloc(((size_t)z->n_vals + 1) * sizeof *in), *outs = malloc(((size_t)z->n_vals + 1) * sizeof *outs);
  op_type *types = malloc(((size_t)z->n_vals + 1) * sizeof *types);
  ir_value *args = malloc(((size_t)z->n_vals + 1) * sizeof *args);
  int rc = 0;
  if (!in || !outs || !types || !args) {
    rc = kiln_set_error("fuse: out of memory");
    goto done;
  }
  for (int i = 0; i < n; i++) {
    const fz_node *nd = &z->nodes[mem[i]];
    for (int j = 0; j < nd->n_in; j++) {
      int32_t v = nd->in[j];
      if ((z->vdef[v] >= 0 && find(z, z->vdef[v]) == g) || e->bmap[v] >= 0) continue;
      e->bmap[v] = n_in; /* the parameter's index, for now */
      types[n_in] = z->vtype[v];
      in[n_in++] = v;
    }
  }
  char name[256];
  do
    snprintf(name, sizeof name, "%s.fused%d", f->name, e->next_kernel++);
  while (ir_module_find(f->module, name));
  ir_func *body = ir_func_new(f->module, name, n_in, types);
  if (!body) {
    rc = -1;
    goto done;
  }
  for (int i = 0; i < n_in && !rc; i++) {
    if ((args[i] = e->map[in[i]]) < 0)
      rc = kiln_set_error("fuse: @%s: internal error: a kernel input has no value", f->name);
    else if (in[i] < f->n_values && f->names[in[i]])
      rc = ir_set_name(body, i, f->names[in[i]]);
  }
  for (int i = 0; i < n && !rc; i++) {
    const fz_node *nd = &z->nodes[mem[i]];
    for (int j = 0; j < nd->n_in; j++) e->tmp[j] = e->bmap[nd->in[j]];
    ir_value v = same_in_kernel(z, e, mem, i);
    if (v >= 0) { /* copies of one instruction that met in one kernel: computed once */
      e->bmap[nd->out] = v;
      continue;
    }
    v = ir_append(body, nd->ins->op, &nd->ins->attrs, nd->n_in, e->tmp, nd->ins->loc);
    if (v < 0) {
      rc = -1;
      break;
    }
    for (int r = 0; r < nd->n_out && !rc; r++) {
      int32_t x = nd->out + r;
      e->bmap[x] = v + r;
      if (!nd->clone && f->names[x]) rc = ir_set_name(body, v + r, f->names[x]);
      /* an output: read outside the kernel, a result of f, or read by nobody */
      if (z->ustart[x] == z->ustart[x + 1] || value_escapes(z, x, g)) outs[n_out++] = x;
    }
  }
  for (int i = 0; i < n_out && !rc; i++) e->tmp[i] = e->bmap[outs[i]];
  if (!rc) rc = ir_set_results(body, n_out, e->tmp);
  if (!rc) {
    op_attrs a = {0};
    a.callee = body;
    ir_value first = pass_emit(&e->b, OP_FUSION, &a, n_in, args, z->nodes[mem[n - 1]].ins->loc);
    if (first < 0) rc = -1;
    for (int i = 0; i < n_out && !rc; i++) {
      e->map[outs[i]] = first + i;
      if (outs[i] < f->n_values) rc = pass_replace(&e->b, outs[i], first + i, true);
    }
  }
done:
  for (int i = 0; in && i < n_in; i++) e->bmap[in[i]] = -1;
  for (int i = 0; i < n; i++)
    for (int r = 0; r < z->nodes[mem[i]].n_out; r++) e->bmap[z->nodes[mem[i]].out + r] = -1;
  free(in);
  free(outs);
  free(types);
  free(args);
  return rc;
}

/* Rewrites f: each group of two or more instructions (scalar constants not
 * counted) as a kernel, the rest as they were. */
static int emit(fz *z) {
  ir_func *f = z->f;
  int keep = f->module->n_funcs, max_in = 1, rc = 0;
  for (int k = 0; k < z->n; k++)
    if (z->nodes[k].n_in > max_in) max_in = z->nodes[k].n_in;
  emitter e = {.z = z};
  int32_t *order = malloc(((size_t)z->n + 1) * sizeof *order), *mem = malloc(((size_t)z->n + 1) * sizeof *mem);
  e.map = malloc(((size_t)z->n_vals + 1) * sizeof *e.map);
  e.bmap = malloc(((size_t)z->n_vals + 1) * sizeof *e.bmap);
  e.tmp = malloc(((size_t)(z->n_vals > max_in ? z->n_vals : max_in) + 1) * sizeof *e.tmp);
  if (!order || !mem || !e.map || !e.bmap || !e.tmp) {
    rc = kiln_set_error("fuse: out of memory");
    goto done;
  }
  int n_groups = schedule(z, order);
  if (n_groups < 0 || pass_begin(&e.b, f)) {
    rc = -1;
    goto done;
  }
  for (int32_t v = 0; v < z->n_vals; v++) e.map[v] = v < f->n_params ? v : -1, e.bmap[v] = -1;
  for (int i = 0; i < n_groups && !rc; i++) {
    int32_t g = order[i];
    int n = 0, real = 0;
    for (int32_t m = z->head[g]; m >= 0; m = z->next[m]) {
      mem[n++] = m;
      real += z->nodes[m].ins->op != OP_CONSTANT;
    }
    qsort(mem, (size_t)n, sizeof *mem, cmp_i32);
    if (real >= 2) {
      rc = emit_kernel(&e, g, mem, n);
    } else { /* a group of one stays as it was */
      for (int j = 0; j < n && !rc; j++) rc = emit_plain(&e, mem[j]);
    }
  }
  if (rc)
    pass_abort(&e.b);
  else
    rc = pass_commit(&e.b);
done:
  if (rc) ir_module_truncate(f->module, keep);
  free(order);
  free(mem);
  free(e.map);
  free(e.bmap);
  free(e.tmp);
  return rc;
}

bool pass_is_kernel_body(const ir_func *f) {
  const ir_module *m = f->module;
  for (int i = 0; m && i < m->n_funcs; i++)
    for (int j = 0; j < m->funcs[i]->n_instrs; j++)
      if (m->funcs[i]->instrs[j].op == OP_FUSION && m->funcs[i]->instrs[j].attrs.callee == f) return true;
  return false;
}

int kiln_pass_fuse(ir_func *f) {
  if (!f) return kiln_set_error("fuse: no function");
  if (!f->module) return kiln_set_error("fuse: @%s belongs to no module", f->name);
  if (pass_is_kernel_body(f)) return 0; /* bodies are not fused again */
  fz z = {.f = f};
  int rc = build(&z);
  if (!rc) {
    fuse_epilogues(&z);
    fuse_producers(&z);
    fuse_consumers(&z);
    rc = fuse_siblings(&z);
  }
  bool any = false; /* a group with two instructions other than constants */
  for (int k = 0; !rc && k < z.n && !any; k++) {
    int32_t g = find(&z, k);
    any = k != g && z.nodes[k].ins->op != OP_CONSTANT && z.nodes[g].ins->op != OP_CONSTANT;
  }
  if (!rc && any) rc = emit(&z);
  fz_free(&z);
  return rc ? pass_fail("fuse") : 0;
}
