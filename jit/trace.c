/* trace.c — the tracer: while a staged function's body runs, ops on
 * symbolic tensors (and random draws) are recorded here instead of run;
 * concrete tensors they meet become captured inputs and variable reads
 * by-reference inputs. At the end the recording is built into an ir_func,
 * whose parameters are only known then. */
#include <stdio.h>
#include <stdlib.h>

#include "jit.h"

_Thread_local trace *trace_current KILN_TLS_FAST;

enum { NODE_ARG, NODE_CAP, NODE_VAR, NODE_INSTR };

/* Each symbolic tensor's sym holds its node id + 1; the node remembers the
 * tensor (unretained) so that a stale symbolic tensor of another trace is
 * recognised rather than misread. */
typedef struct {
  int kind, index;
  const kiln_tensor *t;
} node;

typedef struct {
  op_id op;
  op_attrs attrs;
  int n;
  int *in; /* node ids; captures and variables are nodes too */
  void *pc; /* the user's call (loc.c) */
} record;

struct trace {
  int n_in;
  node *nodes;
  int n_nodes, cap_nodes;
  record *recs;
  int n_recs, cap_recs;
  kiln_tensor **caps; /* retained */
  int n_caps, cap_caps;
  int *cap_node; /* the node of each capture */
  kiln_variable **vars;
  op_type *var_types;
  int n_vars, cap_vars;
};

static int grow(void **p, int *cap, int need, size_t elem) {
  if (need <= *cap) return 0;
  int c = *cap ? *cap * 2 : 16;
  while (c < need) c *= 2;
  void *q = realloc(*p, (size_t)c * elem);
  if (!q) return kiln_set_error("trace: out of memory");
  *p = q;
  *cap = c;
  return 0;
}

static int add_node(trace *tr, int kind, int index, const kiln_tensor *t) {
  if (grow((void **)&tr->nodes, &tr->cap_nodes, tr->n_nodes + 1, sizeof *tr->nodes)) return -1;
  tr->nodes[tr->n_nodes] = (node){kind, index, t};
  return tr->n_nodes++;
}

/* A header of the given type with no data, flagged symbolic. */
static kiln_tensor *sym_tensor(trace *tr, const char *who, const op_type *ty, int kind, int index) {
  int64_t size;
  if (shape_check(who, ty->rank, ty->shape, &size)) return NULL;
  const int64_t zero = 0;
  kiln_tensor *t = tensor_alloc(who, ty->dtype, 1, &zero);
  if (!t) return NULL;
  t->rank = (int8_t)ty->rank;
  for (int i = 0; i < ty->rank; i++) t->shape[i] = ty->shape[i];
  t->size = size;
  t->flags |= TF_SYMBOLIC;
  t->device = (uint8_t)device_current();
  int id = add_node(tr, kind, index, t);
  if (id < 0) {
    kiln_release(t);
    return NULL;
  }
  t->sym = (void *)(intptr_t)(id + 1);
  return t;
}

static void type_of(const kiln_tensor *t, op_type *ty) {
  ty->dtype = (kiln_dtype)t->dtype;
  ty->rank = t->rank;
  for (int i = 0; i < t->rank; i++) ty->shape[i] = t->shape[i];
}

/* The node of an input: its own for a symbolic tensor of this trace, a
 * (deduplicated) capture for a concrete one. -1 with the error set. */
static int node_of(trace *tr, const char *who, int i, kiln_tensor *t) {
  if (t->flags & TF_SYMBOLIC) {
    intptr_t id = (intptr_t)t->sym - 1;
    if (id < 0 || id >= tr->n_nodes || tr->nodes[id].t != t)
      return kiln_set_error("%s: input %d is a symbolic tensor of another trace (it escaped the body "
                            "of a staged function)", who, i);
    return (int)id;
  }
  for (int k = 0; k < tr->n_caps; k++)
    if (tr->caps[k] == t) return tr->cap_node[k];
  if (tr->n_caps == tr->cap_caps) { /* caps and cap_node grow together */
    int cap = tr->cap_caps;
    if (grow((void **)&tr->caps, &cap, tr->n_caps + 1, sizeof *tr->caps)) return -1;
    int *q = realloc(tr->cap_node, (size_t)cap * sizeof *q);
    if (!q) return kiln_set_error("trace: out of memory");
    tr->cap_node = q;
    tr->cap_caps = cap;
  }
  int id = add_node(tr, NODE_CAP, tr->n_caps, NULL);
  if (id < 0) return -1;
  tr->caps[tr->n_caps] = kiln_retain(t);
  tr->cap_node[tr->n_caps++] = id;
  return id;
}

kiln_tensor *trace_apply(op_id op, const op_attrs *attrs, int n, kiln_tensor *const *in) {
  trace *tr = trace_current;
  const char *who = kiln_ops[op].api;
  op_type small[4], *types = n > 4 ? malloc((size_t)n * sizeof *types) : small, out;
  int *ids = malloc((size_t)(n ? n : 1) * sizeof *ids);
  kiln_tensor *t = NULL;
  if (!types || !ids) {
    kiln_set_error("%s: out of memory", who);
    goto fail;
  }
  for (int i = 0; i < n; i++) {
    type_of(in[i], &types[i]);
    if ((ids[i] = node_of(tr, who, i, in[i])) < 0) goto fail;
  }
  if (ir_check_op(op, attrs, n, types, &out)) goto fail;
  if (grow((void **)&tr->recs, &tr->cap_recs, tr->n_recs + 1, sizeof *tr->recs)) goto fail;
  if (!(t = sym_tensor(tr, who, &out, NODE_INSTR, tr->n_recs))) goto fail;
  tr->recs[tr->n_recs++] = (record){op, *attrs, n, ids, loc_caller_pc()};
  if (types != small) free(types);
  return t;
fail:
  if (types != small) free(types);
  free(ids);
  return NULL;
}

kiln_tensor *trace_variable_read(kiln_variable *v, const kiln_tensor *value) {
  trace *tr = trace_current;
  int k = 0;
  while (k < tr->n_vars && tr->vars[k] != v) k++;
  if (k == tr->n_vars) {
    int cap = tr->cap_vars;
    if (grow((void **)&tr->vars, &cap, k + 1, sizeof *tr->vars)) return NULL;
    op_type *q = realloc(tr->var_types, (size_t)cap * sizeof *q);
    if (!q) {
      kiln_set_error("variable_read: out of memory");
      return NULL;
    }
    tr->var_types = q;
    tr->cap_vars = cap;
    tr->vars[k] = v;
    type_of(value, &tr->var_types[k]);
    tr->n_vars++;
  }
  return sym_tensor(tr, "variable_read", &tr->var_types[k], NODE_VAR, k);
}

trace *trace_begin(int n_in, kiln_tensor *const *in, kiln_tensor **sym_in) {
  trace *tr = calloc(1, sizeof *tr);
  if (!tr) {
    kiln_set_error("function_call: out of memory");
    return NULL;
  }
  tr->n_in = n_in;
  for (int i = 0; i < n_in; i++) {
    op_type ty;
    type_of(in[i], &ty);
    if (!(sym_in[i] = scope_own(sym_tensor(tr, "function_call", &ty, NODE_ARG, i)))) {
      trace_free(tr);
      return NULL;
    }
  }
  trace_current = tr;
  return tr;
}

void trace_end(trace *tr) {
  if (trace_current == tr) trace_current = NULL;
}

void trace_free(trace *tr) {
  if (!tr) return;
  trace_end(tr);
  for (int i = 0; i < tr->n_recs; i++) free(tr->recs[i].in);
  for (int i = 0; i < tr->n_caps; i++) kiln_release(tr->caps[i]);
  free(tr->recs);
  free(tr->nodes);
  free(tr->caps);
  free(tr->cap_node);
  free(tr->vars);
  free(tr->var_types);
  free(tr);
}

void traced_fn_free(traced_fn *fn) {
  if (!fn) return;
  traced_fn_free_locs(fn);
  ir_module_free(fn->module);
  for (int i = 0; i < fn->n_caps; i++) kiln_release(fn->caps[i]);
  free(fn->caps);
  free(fn->vars);
  free(fn->rng);
  memset(fn, 0, sizeof *fn);
}

/* IR names are [A-Za-z_][A-Za-z0-9_.]*: anything else becomes '_' */
static void ir_name(char *buf, size_t n, const char *name) {
  size_t i = 0;
  for (; name[i] && i + 1 < n; i++) {
    char c = name[i];
    bool ok = (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || c == '_' ||
              (i > 0 && ((c >= '0' && c <= '9') || c == '.'));
    buf[i] = ok ? c : '_';
  }
  buf[i] = '\0';
  if (!i) snprintf(buf, n, "f");
}

int trace_finish(trace *tr, const char *name, int n_out, kiln_tensor *const *outs, traced_fn *fn) {
  memset(fn, 0, sizeof *fn);
  trace_end(tr);
  int rc = -1, *out_ids = malloc((size_t)(n_out ? n_out : 1) * sizeof *out_ids);
  ir_value *val = NULL, *res = NULL;
  op_type *params = NULL;
  if (!out_ids) goto oom;
  for (int i = 0; i < n_out; i++) /* concrete outputs become captures */
    if ((out_ids[i] = node_of(tr, "function_call", i, outs[i])) < 0) goto done;
  int np = tr->n_in + tr->n_caps + tr->n_vars;
  params = malloc((size_t)(np ? np : 1) * sizeof *params);
  val = malloc((size_t)(tr->n_nodes ? tr->n_nodes : 1) * sizeof *val);
  res = malloc((size_t)(n_out ? n_out : 1) * sizeof *res);
  fn->rng = malloc((size_t)(tr->n_recs ? tr->n_recs : 1) * sizeof *fn->rng);
  fn->pcs = malloc((size_t)(tr->n_recs ? tr->n_recs : 1) * sizeof *fn->pcs);
  if (!params || !val || !res || !fn->rng || !fn->pcs) goto oom;
  for (int r = 0; r < tr->n_recs; r++) fn->pcs[r] = tr->recs[r].pc; /* instruction r is record r */
  for (int id = 0; id < tr->n_nodes; id++) {
    const node *nd = &tr->nodes[id];
    switch (nd->kind) {
      case NODE_ARG: type_of(nd->t, &params[nd->index]), val[id] = nd->index; break;
      case NODE_CAP: val[id] = tr->n_in + nd->index; break;
      case NODE_VAR: val[id] = tr->n_in + tr->n_caps + nd->index; break;
      default: val[id] = -1;
    }
  }
  for (int k = 0; k < tr->n_caps; k++) type_of(tr->caps[k], &params[tr->n_in + k]);
  for (int k = 0; k < tr->n_vars; k++) params[tr->n_in + tr->n_caps + k] = tr->var_types[k];
  char fname[128];
  ir_name(fname, sizeof fname, name);
  if (!(fn->module = ir_module_new())) goto oom;
  if (!(fn->func = ir_func_new(fn->module, fname, np, params))) goto done;
  /* each record's result node is the one whose index names it */
  int *rec_node = malloc((size_t)(tr->n_recs ? tr->n_recs : 1) * sizeof *rec_node);
  if (!rec_node) goto oom;
  for (int id = 0; id < tr->n_nodes; id++)
    if (tr->nodes[id].kind == NODE_INSTR) rec_node[tr->nodes[id].index] = id;
  for (int r = 0; r < tr->n_recs; r++) {
    record *rec = &tr->recs[r];
    ir_value small[8], *in = rec->n > 8 ? malloc((size_t)rec->n * sizeof *in) : small;
    if (!in) {
      free(rec_node);
      goto oom;
    }
    for (int i = 0; i < rec->n; i++) in[i] = val[rec->in[i]];
    ir_value v = ir_append(fn->func, rec->op, &rec->attrs, rec->n, in, (ir_loc){0});
    if (in != small) free(in);
    if (v < 0) {
      free(rec_node);
      goto done;
    }
    val[rec_node[r]] = v;
    if (kiln_ops[rec->op].kind == OPK_RANDOM) fn->rng[fn->n_rng++] = fn->func->n_instrs - 1;
  }
  free(rec_node);
  for (int i = 0; i < n_out; i++) res[i] = val[out_ids[i]];
  if (ir_set_results(fn->func, n_out, res) || ir_verify(fn->func)) goto done;
  fn->caps = tr->caps, fn->n_caps = tr->n_caps; /* the trace's references move over */
  tr->caps = NULL, tr->n_caps = 0;
  fn->vars = tr->vars, fn->n_vars = tr->n_vars;
  tr->vars = NULL, tr->n_vars = 0;
  rc = 0;
  goto done;
oom:
  kiln_set_error("function_call: out of memory");
done:
  free(out_ids);
  free(params);
  free(val);
  free(res);
  trace_free(tr);
  if (rc) traced_fn_free(fn);
  return rc;
}
