/* trace.c — the tracer: while a staged function's body runs, ops on
 * symbolic tensors (and random draws) are recorded here instead of run;
 * concrete tensors they meet become captured inputs and variable reads
 * by-reference inputs. At the end the recording is built into an ir_func,
 * whose parameters are only known then. */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "jit.h"
#include "../lib/variable.h"
#include "cpu/cpu.h"
#include "cuda/ptx.h"

_Thread_local trace *trace_current KILN_TLS_FAST;

enum { NODE_ARG, NODE_CAP, NODE_VAR, NODE_INSTR, NODE_RES, NODE_OUTER };

/* Each symbolic tensor's sym holds its node id + 1; the node remembers the
 * tensor (unretained) so that a stale symbolic tensor of another trace is
 * recognised rather than misread. */
typedef struct {
  int kind, index;
  int sub; /* which result of a multi-result record */
  const kiln_tensor *t;
} node;

typedef struct {
  op_id op;
  op_attrs attrs;
  int n;
  int *in; /* node ids; captures and variables are nodes too */
  void *pc; /* the user's call (loc.c) */
  int n_out;
  const ir_func *callee; /* call: the inner trace's function, cloned into this module at the end */
  kiln_host_fn host_fn;  /* host_call */
  void *host_user;
  op_type *host_out;     /* host_call: declared types (malloc'd) */
  traced_fn *regions[2]; /* cond, while, scan: the traced regions (owned), cloned in at the end */
} record;

struct trace {
  trace *prev; /* the trace this one interrupted (a nested staged call) */
  trace *fwd;  /* a forward trace whose values this one may read, as residual parameters */
  int *res_fwd; /* per residual: its node in fwd */
  op_type *res_types;
  int n_res, cap_res;
  const void *owner;
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
  int *var_write; /* per variable: the node of its latest assignment, or -1 */
  int n_vars, cap_vars;
  const char *poison; /* the reader (kiln_tensor_item, ...) that read a traced value, or NULL */
  kiln_variable **created; /* variables the body created, until function.c takes them */
  int n_created, cap_created;
  /* A region of a control-flow instruction (control.c): symbolic tensors of
   * the traces it interrupted become parameters too (outer, retained). */
  bool region;
  kiln_tensor **outer;
  int n_outer, cap_outer;
  /* its random draws, in order: each one's record, result and type (its
   * own random instructions, and the draws nested control flow returns) */
  int *draw_rec, *draw_sub;
  op_type *draw_type;
  int n_draws, cap_draws, cap_draw_subs, cap_draw_types;
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

static int add_node(trace *tr, int kind, int index, int sub, const kiln_tensor *t) {
  if (grow((void **)&tr->nodes, &tr->cap_nodes, tr->n_nodes + 1, sizeof *tr->nodes)) return -1;
  tr->nodes[tr->n_nodes] = (node){kind, index, sub, t};
  return tr->n_nodes++;
}

/* A header of the given type with no data, flagged symbolic. */
static kiln_tensor *sym_tensor_sub(trace *tr, const char *who, const op_type *ty, int kind, int index, int sub) {
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
  int id = add_node(tr, kind, index, sub, t);
  if (id < 0) {
    kiln_release(t);
    return NULL;
  }
  t->sym = (void *)(intptr_t)(id + 1);
  return t;
}

static kiln_tensor *sym_tensor(trace *tr, const char *who, const op_type *ty, int kind, int index) {
  return sym_tensor_sub(tr, who, ty, kind, index, 0);
}

/* The node of an input: its own for a symbolic tensor of this trace, a
 * (deduplicated) capture for a concrete one. -1 with the error set. */
/* A value of tr->fwd read by tr: a residual parameter (deduplicated). */
static int residual_node(trace *tr, int fwd_id, const kiln_tensor *t) {
  for (int k = 0; k < tr->n_res; k++)
    if (tr->res_fwd[k] == fwd_id) {
      for (int id = 0; id < tr->n_nodes; id++)
        if (tr->nodes[id].kind == NODE_RES && tr->nodes[id].index == k) return id;
    }
  if (tr->n_res == tr->cap_res) {
    int cap = tr->cap_res;
    if (grow((void **)&tr->res_fwd, &cap, tr->n_res + 1, sizeof *tr->res_fwd)) return -1;
    op_type *q = realloc(tr->res_types, (size_t)cap * sizeof *q);
    if (!q) return kiln_set_error("trace: out of memory");
    tr->res_types = q;
    tr->cap_res = cap;
  }
  int id = add_node(tr, NODE_RES, tr->n_res, 0, NULL);
  if (id < 0) return -1;
  tr->res_fwd[tr->n_res] = fwd_id;
  op_type_of(t, &tr->res_types[tr->n_res++]);
  return id;
}

/* Two concrete host tensors holding the same bits. Tensors are immutable, so
 * a trace may capture one for both: constants made afresh by each pass of
 * the body (a kiln_scalar(0.5), a transpose of a captured weight that ran
 * eagerly) become one parameter, and CSE can then merge what they feed, as
 * XLA's CSE merges equal constants. Bounded so that tracing stays cheap. */
enum { CAP_DEDUP_BYTES = 1 << 14 };
static bool same_bits(const kiln_tensor *a, const kiln_tensor *b) {
  if (a->device || b->device || a->dtype != b->dtype || a->rank != b->rank) return false;
  for (int d = 0; d < a->rank; d++)
    if (a->shape[d] != b->shape[d]) return false;
  size_t bytes = (size_t)a->size * kiln_dtype_sizes[a->dtype];
  return bytes <= CAP_DEDUP_BYTES && (!bytes || memcmp(a->data, b->data, bytes) == 0);
}

/* Is t a symbolic tensor of tr? */
static bool owns(const trace *tr, const kiln_tensor *t) {
  intptr_t id = (intptr_t)t->sym - 1;
  return id >= 0 && id < tr->n_nodes && tr->nodes[id].t == t;
}

/* A symbolic tensor of a trace that region tr interrupted: a parameter of
 * tr (deduplicated), an operand of the control-flow instruction. */
static int outer_node(trace *tr, kiln_tensor *t) {
  for (int id = 0; id < tr->n_nodes; id++)
    if (tr->nodes[id].kind == NODE_OUTER && tr->outer[tr->nodes[id].index] == t) return id;
  if (grow((void **)&tr->outer, &tr->cap_outer, tr->n_outer + 1, sizeof *tr->outer)) return -1;
  int id = add_node(tr, NODE_OUTER, tr->n_outer, 0, NULL);
  if (id < 0) return -1;
  tr->outer[tr->n_outer++] = kiln_retain(t);
  return id;
}

static int node_of(trace *tr, const char *who, int i, kiln_tensor *t) {
  if (t->flags & TF_SYMBOLIC) {
    intptr_t id = (intptr_t)t->sym - 1;
    if (id >= 0 && id < tr->n_nodes && tr->nodes[id].t == t) return (int)id;
    if (tr->fwd && id >= 0 && id < tr->fwd->n_nodes && tr->fwd->nodes[id].t == t) return residual_node(tr, (int)id, t);
    for (const trace *p = tr; p->region && p->prev; p = p->prev) /* (a backward trace reads its forward's) */
      if (owns(p->prev, t) || (p->prev->fwd && owns(p->prev->fwd, t))) return outer_node(tr, t);
    return kiln_set_error("%s: input %d is a symbolic tensor of another trace (it escaped the body "
                          "of a staged function)", who, i);
  }
  for (int k = 0; k < tr->n_caps; k++)
    if (tr->caps[k] == t) return tr->cap_node[k];
  for (int k = 0; k < tr->n_caps; k++)
    if (same_bits(tr->caps[k], t)) return tr->cap_node[k];
  if (tr->n_caps == tr->cap_caps) { /* caps and cap_node grow together */
    int cap = tr->cap_caps;
    if (grow((void **)&tr->caps, &cap, tr->n_caps + 1, sizeof *tr->caps)) return -1;
    int *q = realloc(tr->cap_node, (size_t)cap * sizeof *q);
    if (!q) return kiln_set_error("trace: out of memory");
    tr->cap_node = q;
    tr->cap_caps = cap;
  }
  int id = add_node(tr, NODE_CAP, tr->n_caps, 0, NULL);
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
    op_type_of(in[i], &types[i]);
    if ((ids[i] = node_of(tr, who, i, in[i])) < 0) goto fail;
  }
  if (ir_check_op(op, attrs, n, types, &out)) goto fail;
  if (grow((void **)&tr->recs, &tr->cap_recs, tr->n_recs + 1, sizeof *tr->recs)) goto fail;
  if (!(t = sym_tensor(tr, who, &out, NODE_INSTR, tr->n_recs))) goto fail;
  tr->recs[tr->n_recs] = (record){.op = op, .attrs = *attrs, .n = n, .in = ids, .pc = loc_caller_pc(), .n_out = 1};
  if (kiln_ops[op].kind == OPK_RANDOM) { /* each call draws afresh from the global stream */
    op_attrs *a = &tr->recs[tr->n_recs].attrs;
    a->stateful = true;
    a->seed = a->counter = 0;
    if (grow((void **)&tr->draw_rec, &tr->cap_draws, tr->n_draws + 1, sizeof *tr->draw_rec) ||
        grow((void **)&tr->draw_sub, &tr->cap_draw_subs, tr->n_draws + 1, sizeof *tr->draw_sub) ||
        grow((void **)&tr->draw_type, &tr->cap_draw_types, tr->n_draws + 1, sizeof *tr->draw_type)) {
      kiln_release(t);
      t = NULL;
      goto fail; /* the record was not counted yet: fail frees its ids */
    }
    tr->draw_rec[tr->n_draws] = tr->n_recs;
    tr->draw_sub[tr->n_draws] = 0;
    tr->draw_type[tr->n_draws++] = out;
  }
  tr->n_recs++;
  if (types != small) free(types);
  return t;
fail:
  if (types != small) free(types);
  free(ids);
  return NULL;
}

/* v's index among the trace's variables, added on first use; -1 on error */
static int var_index(trace *tr, kiln_variable *v, const kiln_tensor *value) {
  int k = 0;
  while (k < tr->n_vars && tr->vars[k] != v) k++;
  if (k < tr->n_vars) return k;
  int cap = tr->cap_vars;
  if (grow((void **)&tr->vars, &cap, k + 1, sizeof *tr->vars)) return -1;
  op_type *q = realloc(tr->var_types, (size_t)cap * sizeof *q);
  if (q) tr->var_types = q;
  int *w = q ? realloc(tr->var_write, (size_t)cap * sizeof *w) : NULL;
  if (!q || !w) return kiln_set_error("variable_read: out of memory");
  tr->var_write = w;
  tr->cap_vars = cap;
  tr->vars[k] = v;
  op_type_of(value, &tr->var_types[k]);
  tr->var_write[k] = -1;
  tr->n_vars++;
  return k;
}

kiln_tensor *trace_variable_read(kiln_variable *v, const kiln_tensor *value) {
  trace *tr = trace_current;
  int k = var_index(tr, v, value);
  if (k < 0) return NULL;
  if (tr->var_write[k] < 0) return sym_tensor(tr, "variable_read", &tr->var_types[k], NODE_VAR, k);
  /* read after an assignment in the same body: that value, as an identity
   * of its node (the assigned tensor itself may be gone by now) */
  int *ids = malloc(sizeof *ids);
  if (!ids || grow((void **)&tr->recs, &tr->cap_recs, tr->n_recs + 1, sizeof *tr->recs)) {
    free(ids);
    if (!kiln_has_error()) kiln_set_error("variable_read: out of memory");
    return NULL;
  }
  kiln_tensor *t = sym_tensor(tr, "variable_read", &tr->var_types[k], NODE_INSTR, tr->n_recs);
  if (!t) {
    free(ids);
    return NULL;
  }
  ids[0] = tr->var_write[k];
  tr->recs[tr->n_recs++] = (record){.op = OP_IDENTITY, .n = 1, .in = ids, .pc = loc_caller_pc(), .n_out = 1};
  return t;
}

int trace_variable_write(kiln_variable *v, const kiln_tensor *current, kiln_tensor *value) {
  trace *tr = trace_current;
  int k = var_index(tr, v, current);
  if (k < 0) return -1;
  int id = node_of(tr, "variable_assign", 0, value);
  if (id < 0) return -1;
  tr->var_write[k] = id;
  return 0;
}

/* Appends a record of op with n_out results (types outs) on the active
 * trace; writes the results' symbolic tensors (owned by the caller's scope).
 * The record takes host_out. 0 / -1. */
/* what a record owns, when it is not kept */
static void drop_extra(record *e) {
  free(e->host_out);
  for (int k = 0; k < 2; k++)
    if (e->regions[k]) traced_fn_free(e->regions[k]), free(e->regions[k]);
}

static int record_multi(const char *who, op_id op, const op_attrs *attrs, int n, kiln_tensor *const *in, int n_out,
                        const op_type *outs, record extra, kiln_tensor **res) {
  trace *tr = trace_current;
  int *ids = malloc((size_t)(n ? n : 1) * sizeof *ids);
  if (!ids) {
    drop_extra(&extra);
    return kiln_set_error("%s: out of memory", who);
  }
  for (int i = 0; i < n; i++)
    if ((ids[i] = node_of(tr, who, i, in[i])) < 0) {
      free(ids);
      drop_extra(&extra);
      return -1;
    }
  if (grow((void **)&tr->recs, &tr->cap_recs, tr->n_recs + 1, sizeof *tr->recs)) {
    free(ids);
    drop_extra(&extra);
    return -1;
  }
  extra.op = op;
  extra.attrs = *attrs;
  extra.n = n;
  extra.in = ids;
  extra.pc = loc_caller_pc();
  extra.n_out = n_out;
  tr->recs[tr->n_recs] = extra;
  int r = tr->n_recs++;
  for (int k = 0; k < n_out; k++) {
    if (!(res[k] = scope_own(sym_tensor_sub(tr, who, &outs[k], NODE_INSTR, r, k)))) {
      for (int j = 0; j < k; j++) res[j] = NULL;
      return -1; /* the record stays, unused: dead code the trace never returns */
    }
  }
  return 0;
}

int trace_call(const traced_fn *callee, int n_in, kiln_tensor *const *in, kiln_tensor **out) {
  const ir_func *g = callee->func;
  int n_args = g->n_params, n_res = g->n_results;
  kiln_tensor **args = calloc((size_t)n_args + 1, sizeof *args);
  kiln_tensor **res = calloc((size_t)n_res + 1, sizeof *res);
  op_type *types = malloc(((size_t)n_res + 1) * sizeof *types);
  int rc = -1;
  if (!args || !res || !types) {
    kiln_set_error("function_call: out of memory");
    goto done;
  }
  /* explicit inputs, the callee's captures, its variables as this trace sees them */
  for (int i = 0; i < n_in; i++) args[i] = in[i];
  for (int i = 0; i < callee->n_caps; i++) args[n_in + i] = callee->caps[i];
  for (int i = 0; i < callee->n_vars; i++)
    if (!(args[n_in + callee->n_caps + i] = kiln_variable_read(callee->vars[i]))) goto done;
  for (int k = 0; k < n_res; k++) types[k] = g->types[g->results[k]];
  op_attrs a = {0};
  if (record_multi("function_call", OP_CALL, &a, n_args, args, n_res, types, (record){.callee = g}, res)) goto done;
  int n_out = n_res - callee->n_writes;
  for (int k = 0; k < n_out; k++) out[k] = res[k];
  rc = 0;
  for (int w = 0; w < callee->n_writes && !rc; w++) {
    kiln_variable *v = callee->vars[callee->writes[w]];
    rc = trace_variable_write(v, variable_type(v), res[n_out + w]);
  }
done:
  free(args);
  free(res);
  free(types);
  return rc;
}

int trace_host_call(kiln_host_fn fn, void *user, int n_in, kiln_tensor *const *in, int n_out, const op_type *specs,
                    kiln_tensor **out) {
  op_type *copy = malloc((size_t)n_out * sizeof *copy);
  if (!copy) return kiln_set_error("host_call: out of memory");
  memcpy(copy, specs, (size_t)n_out * sizeof *copy);
  op_attrs a = {0};
  return record_multi("host_call", OP_HOST_CALL, &a, n_in, in, n_out, specs,
                      (record){.host_fn = fn, .host_user = user, .host_out = copy}, out);
}

trace *trace_begin(int n_in, kiln_tensor *const *in, kiln_tensor **sym_in) {
  trace *tr = calloc(1, sizeof *tr);
  if (!tr) {
    kiln_set_error("function_call: out of memory");
    return NULL;
  }
  tr->n_in = n_in;
  tr->prev = trace_current;
  for (int i = 0; i < n_in; i++) {
    op_type ty;
    op_type_of(in[i], &ty);
    if (!(sym_in[i] = scope_own(sym_tensor(tr, "function_call", &ty, NODE_ARG, i)))) {
      trace_free(tr);
      return NULL;
    }
  }
  trace_current = tr;
  return tr;
}

void trace_end(trace *tr) {
  if (trace_current == tr) trace_current = tr->prev;
}

bool trace_owned_by(const void *owner) {
  for (trace *t = trace_current; t; t = t->prev)
    if (t->owner == owner) return true;
  return false;
}

void trace_set_owner(trace *tr, const void *owner) { tr->owner = owner; }

void trace_poison(const char *reader) {
  for (trace *t = trace_current; t; t = t->prev)
    if (!t->poison) t->poison = reader;
}

const char *trace_poisoned(const trace *tr) { return tr->poison; }

int trace_variable_created(kiln_variable *v) {
  trace *tr = trace_current;
  if (grow((void **)&tr->created, &tr->cap_created, tr->n_created + 1, sizeof *tr->created)) return -1;
  tr->created[tr->n_created++] = v;
  return 0;
}

void trace_variable_disown(kiln_variable *v) {
  for (trace *t = trace_current; t; t = t->prev)
    for (int i = 0; i < t->n_created; i++)
      if (t->created[i] == v) {
        t->created[i] = t->created[--t->n_created];
        return;
      }
}

int trace_take_created(trace *tr, kiln_variable ***vars) {
  int n = tr->n_created;
  *vars = tr->created;
  tr->created = NULL;
  tr->n_created = tr->cap_created = 0;
  return n;
}

void trace_free(trace *tr) {
  if (!tr) return;
  trace_end(tr);
  for (int i = 0; i < tr->n_recs; i++) {
    free(tr->recs[i].in), free(tr->recs[i].host_out);
    for (int k = 0; k < 2; k++)
      if (tr->recs[i].regions[k]) traced_fn_free(tr->recs[i].regions[k]), free(tr->recs[i].regions[k]);
  }
  for (int i = 0; i < tr->n_outer; i++) kiln_release(tr->outer[i]);
  free(tr->outer);
  for (int i = 0; i < tr->n_caps; i++) kiln_release(tr->caps[i]);
  for (int i = 0; i < tr->n_created; i++) kiln_variable_free(tr->created[i]); /* nobody took them */
  free(tr->created);
  free(tr->recs);
  free(tr->nodes);
  free(tr->caps);
  free(tr->cap_node);
  free(tr->vars);
  free(tr->var_types);
  free(tr->var_write);
  free(tr->res_fwd);
  free(tr->res_types);
  free(tr->draw_rec);
  free(tr->draw_sub);
  free(tr->draw_type);
  free(tr);
}

int trace_draw_count(const trace *tr) { return tr ? tr->n_draws : 0; }

const op_type *trace_draw_type(const trace *tr, int k) {
  return tr && k >= 0 && k < tr->n_draws ? &tr->draw_type[k] : NULL;
}

kiln_tensor *trace_draw(trace *tr, int k) {
  if (!tr || k < 0 || k >= tr->n_draws) return kiln_set_error("trace: no draw %d", k), NULL;
  return scope_own(sym_tensor_sub(tr, "trace", &tr->draw_type[k], NODE_INSTR, tr->draw_rec[k], tr->draw_sub[k]));
}

int trace_add_draws(trace *tr, int n, kiln_tensor *const *t) {
  for (int k = 0; k < n; k++) {
    intptr_t id = t[k] && (t[k]->flags & TF_SYMBOLIC) ? (intptr_t)t[k]->sym - 1 : -1;
    if (!tr || id < 0 || !owns(tr, t[k]) || tr->nodes[id].kind != NODE_INSTR)
      return kiln_set_error("trace: draw %d is not a result of an instruction of the trace", k);
    if (grow((void **)&tr->draw_rec, &tr->cap_draws, tr->n_draws + 1, sizeof *tr->draw_rec) ||
        grow((void **)&tr->draw_sub, &tr->cap_draw_subs, tr->n_draws + 1, sizeof *tr->draw_sub) ||
        grow((void **)&tr->draw_type, &tr->cap_draw_types, tr->n_draws + 1, sizeof *tr->draw_type))
      return -1;
    tr->draw_rec[tr->n_draws] = tr->nodes[id].index;
    tr->draw_sub[tr->n_draws] = tr->nodes[id].sub;
    op_type_of(t[k], &tr->draw_type[tr->n_draws++]);
  }
  return 0;
}

void traced_fn_free(traced_fn *fn) {
  if (!fn) return;
  traced_fn_free_locs(fn);
  ir_module_free(fn->module);
  ir_module_free(fn->opt_module);
  cpu_program_free(fn->cpu);
  cuda_program_free(fn->cuda);
  for (int i = 0; i < fn->n_caps; i++) kiln_release(fn->caps[i]);
  free(fn->caps);
  free(fn->vars);
  free(fn->writes);
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

/* the callback's symbol name, when the process has one */
static const char *host_name(kiln_host_fn fn, char *buf, size_t n) {
  const char *builtin = host_builtin_name(fn);
  if (builtin) return builtin;
  Dl_info info;
  void *p;
  memcpy(&p, &fn, sizeof p);
  if (dladdr(p, &info) && info.dli_sname && info.dli_saddr == p) {
    snprintf(buf, n, "%s", info.dli_sname);
    return buf;
  }
  return "host";
}

void trace_set_forward(trace *tr, trace *fwd) { tr->fwd = fwd; }

int trace_residuals(const trace *tr, const int **fwd_nodes) {
  *fwd_nodes = tr->res_fwd;
  return tr->n_res;
}

int trace_finish(trace *tr, const char *name, int n_out, kiln_tensor *const *outs, traced_fn *fn) {
  return trace_finish_ex(tr, name, n_out, outs, 0, NULL, fn);
}

static int env_find(const trace_env *env, const kiln_tensor *t, const kiln_variable *v) {
  for (int k = 0; k < env->n; k++)
    if (t ? env->t[k] == t : env->v[k] == v) return k;
  return -1;
}

static int finish(trace *tr, const char *name, int n_out, kiln_tensor *const *outs, int n_extra,
                  const int *extra_nodes, const trace_env *env, traced_fn *fn);

int trace_finish_ex(trace *tr, const char *name, int n_out, kiln_tensor *const *outs, int n_extra,
                    const int *extra_nodes, traced_fn *fn) {
  return finish(tr, name, n_out, outs, n_extra, extra_nodes, NULL, fn);
}

/* ---- regions of control flow (control.c) ---- */

trace *trace_begin_region(int n, const op_type *types, kiln_tensor **sym_in) {
  trace *tr = calloc(1, sizeof *tr);
  if (!tr) {
    kiln_set_error("trace: out of memory");
    return NULL;
  }
  tr->n_in = n;
  tr->prev = trace_current;
  tr->region = true;
  tr->owner = tr->prev ? tr->prev->owner : NULL;
  for (int i = 0; i < n; i++)
    if (!(sym_in[i] = scope_own(sym_tensor(tr, "trace", &types[i], NODE_ARG, i)))) {
      trace_free(tr);
      return NULL;
    }
  trace_current = tr;
  return tr;
}

static int env_add(trace_env *env, kiln_tensor *t, kiln_variable *v, const op_type *type) {
  if (env_find(env, t, v) >= 0) return 0;
  if (env->n == env->cap) {
    int cap = env->cap ? 2 * env->cap : 8;
    kiln_tensor **a = realloc(env->t, (size_t)cap * sizeof *a);
    if (a) env->t = a;
    kiln_variable **b = a ? realloc(env->v, (size_t)cap * sizeof *b) : NULL;
    if (b) env->v = b;
    op_type *c = b ? realloc(env->type, (size_t)cap * sizeof *c) : NULL;
    if (!c) return kiln_set_error("trace: out of memory");
    env->type = c;
    env->cap = cap;
  }
  env->t[env->n] = t ? kiln_retain(t) : NULL;
  env->v[env->n] = v;
  env->type[env->n++] = *type;
  return 0;
}

void trace_env_free(trace_env *env) {
  for (int k = 0; k < env->n; k++) kiln_release(env->t[k]);
  free(env->t);
  free(env->v);
  free(env->type);
  memset(env, 0, sizeof *env);
}

int trace_region_close(trace *tr, const char *who, int n_out, kiln_tensor *const *outs, trace_env *env) {
  trace_end(tr);
  for (int i = 0; i < n_out; i++) /* concrete outputs become captures, outer ones parameters */
    if (node_of(tr, who, i, outs[i]) < 0) return -1;
  for (int k = 0; k < tr->n_vars; k++)
    if (tr->var_write[k] >= 0)
      return kiln_set_error("%s: assigns variable '%s' inside its body: not supported yet (carry the value "
                            "through the loop state and assign it after the loop)", who,
                            kiln_variable_name(tr->vars[k]));
  for (int i = 0; i < tr->n_created; i++) { /* state creation: the enclosing trace's */
    trace *p = tr->prev;
    if (p && (grow((void **)&p->created, &p->cap_created, p->n_created + 1, sizeof *p->created))) return -1;
    if (p) p->created[p->n_created++] = tr->created[i];
  }
  if (tr->prev) tr->n_created = 0;
  op_type ty;
  for (int k = 0; k < tr->n_caps; k++) {
    op_type_of(tr->caps[k], &ty);
    if (env_add(env, tr->caps[k], NULL, &ty)) return -1;
  }
  for (int k = 0; k < tr->n_vars; k++)
    if (env_add(env, NULL, tr->vars[k], &tr->var_types[k])) return -1;
  for (int k = 0; k < tr->n_outer; k++) {
    op_type_of(tr->outer[k], &ty);
    if (env_add(env, tr->outer[k], NULL, &ty)) return -1;
  }
  return 0;
}

int trace_region_written(const trace *tr, kiln_variable ***vars) {
  int n = 0;
  *vars = NULL;
  for (int k = 0; k < tr->n_vars; k++) n += tr->var_write[k] >= 0;
  if (!n) return 0;
  if (!(*vars = malloc((size_t)n * sizeof **vars))) return kiln_set_error("trace: out of memory");
  for (int k = 0, w = 0; k < tr->n_vars; k++)
    if (tr->var_write[k] >= 0) (*vars)[w++] = tr->vars[k];
  return n;
}

void trace_variable_unwrite(kiln_variable *v) {
  trace *tr = trace_current;
  for (int k = 0; tr && k < tr->n_vars; k++)
    if (tr->vars[k] == v) tr->var_write[k] = -1;
}

int trace_finish_region(trace *tr, const char *name, int n_out, kiln_tensor *const *outs, const trace_env *env,
                        traced_fn *fn) {
  return finish(tr, name, n_out, outs, 0, NULL, env, fn);
}

int trace_control(op_id op, const op_attrs *attrs, traced_fn *r0, traced_fn *r1, int n, kiln_tensor *const *in,
                  int n_out, const op_type *types, kiln_tensor **out) {
  return record_multi(kiln_ops[op].api, op, attrs, n, in, n_out, types, (record){.regions = {r0, r1}}, out);
}

/* The value of node id in a region's function: parameters after the
 * explicit ones are the environment's (finish stored each capture's and
 * variable's position there in cap_node and var_write). */
static ir_value region_val(const trace *tr, const trace_env *env, const ir_value *rec_val, int id) {
  const node *nd = &tr->nodes[id];
  switch (nd->kind) {
  case NODE_ARG: return nd->index;
  case NODE_CAP: return tr->n_in + tr->cap_node[nd->index];
  case NODE_VAR: return tr->n_in + tr->var_write[nd->index];
  case NODE_OUTER: return tr->n_in + env_find(env, tr->outer[nd->index], NULL);
  default: return rec_val[nd->index] + nd->sub;
  }
}

/* A cloned region's instructions carry line numbers of its own trace's
 * records, not of the enclosing function's: dropped (no loc inside bodies). */
static void region_forget_locs(ir_func *g, int depth) {
  for (int i = 0; i < g->n_instrs && depth < 64; i++) {
    if (!g->instrs[i].loc.file) g->instrs[i].loc.line = 0;
    const ir_func *r[2];
    int nr = ir_regions(&g->instrs[i], r);
    for (int k = 0; k < nr; k++) region_forget_locs((ir_func *)r[k], depth + 1);
  }
}

static int finish(trace *tr, const char *name, int n_out, kiln_tensor *const *outs, int n_extra,
                  const int *extra_nodes, const trace_env *env, traced_fn *fn) {
  memset(fn, 0, sizeof *fn);
  trace_end(tr);
  int n_writes = 0;
  for (int k = 0; k < tr->n_vars; k++) n_writes += tr->var_write[k] >= 0;
  int n_res = n_out + n_writes + n_extra;
  int rc = -1, *out_ids = malloc((size_t)(n_res ? n_res : 1) * sizeof *out_ids);
  ir_value *res = NULL, *rec_val = NULL;
  op_type *params = NULL;
  ir_clone_memo memo = {0};
  if (!out_ids) goto oom;
  for (int i = 0; i < n_out; i++) /* concrete outputs become captures */
    if ((out_ids[i] = node_of(tr, "function_call", i, outs[i])) < 0) goto done;
  for (int i = 0; i < n_extra; i++) out_ids[n_out + n_writes + i] = extra_nodes[i];
  int np = env ? tr->n_in + env->n : tr->n_in + tr->n_caps + tr->n_vars + tr->n_res;
  params = malloc((size_t)(np ? np : 1) * sizeof *params);
  res = malloc((size_t)(n_res ? n_res : 1) * sizeof *res);
  rec_val = malloc((size_t)(tr->n_recs ? tr->n_recs : 1) * sizeof *rec_val);
  fn->pcs = malloc((size_t)(tr->n_recs ? tr->n_recs : 1) * sizeof *fn->pcs);
  fn->writes = malloc((size_t)(n_writes ? n_writes : 1) * sizeof *fn->writes);
  if (!params || !res || !rec_val || !fn->pcs || !fn->writes) goto oom;
  for (int k = 0, w = 0; k < tr->n_vars; k++)
    if (tr->var_write[k] >= 0) fn->writes[w] = k, out_ids[n_out + w++] = tr->var_write[k];
  fn->n_writes = n_writes;
  for (int r = 0; r < tr->n_recs; r++) fn->pcs[r] = tr->recs[r].pc; /* instruction r is record r */
  for (int id = 0; id < tr->n_nodes; id++)
    if (tr->nodes[id].kind == NODE_ARG) op_type_of(tr->nodes[id].t, &params[tr->nodes[id].index]);
  if (env) { /* a region: its captures, variables and outer values are the environment's */
    for (int k = 0; k < env->n; k++) params[tr->n_in + k] = env->type[k];
    for (int k = 0; k < tr->n_caps; k++) tr->cap_node[k] = env_find(env, tr->caps[k], NULL);
    for (int k = 0; k < tr->n_vars; k++) tr->var_write[k] = env_find(env, NULL, tr->vars[k]);
  } else {
    for (int k = 0; k < tr->n_caps; k++) op_type_of(tr->caps[k], &params[tr->n_in + k]);
    for (int k = 0; k < tr->n_vars; k++) params[tr->n_in + tr->n_caps + k] = tr->var_types[k];
    for (int k = 0; k < tr->n_res; k++) params[tr->n_in + tr->n_caps + tr->n_vars + k] = tr->res_types[k];
  }
  fn->n_residuals = tr->n_res;
  char fname[128];
  ir_name(fname, sizeof fname, name);
  if (!(fn->module = ir_module_new())) goto oom;
  if (!(fn->func = ir_func_new(fn->module, fname, np, params))) goto done;
  for (int k = 0; k < tr->n_vars && !env; k++) { /* %W for variable W, where that name is free */
    char vname[128];
    ir_name(vname, sizeof vname, kiln_variable_name(tr->vars[k]));
    if (ir_set_name(fn->func, tr->n_in + tr->n_caps + k, vname)) kiln_clear_error();
  }
#define VAL(id) (env ? region_val(tr, env, rec_val, id) : VAL0(id))
#define VAL0(id)                                                                                   \
  (tr->nodes[id].kind == NODE_ARG   ? tr->nodes[id].index                                          \
   : tr->nodes[id].kind == NODE_CAP ? tr->n_in + tr->nodes[id].index                               \
   : tr->nodes[id].kind == NODE_VAR ? tr->n_in + tr->n_caps + tr->nodes[id].index                  \
   : tr->nodes[id].kind == NODE_RES ? tr->n_in + tr->n_caps + tr->n_vars + tr->nodes[id].index     \
                                    : rec_val[tr->nodes[id].index] + tr->nodes[id].sub)
  for (int r = 0; r < tr->n_recs; r++) {
    record *rec = &tr->recs[r];
    op_attrs a = rec->attrs;
    if (rec->callee && !(a.callee = ir_clone_func(fn->module, rec->callee, &memo))) goto done;
    for (int k = 0; k < 2; k++) {
      if (!rec->regions[k]) continue;
      ir_func *g = ir_clone_func(fn->module, rec->regions[k]->func, &memo);
      if (!g) goto done;
      region_forget_locs(g, 0);
      *(k ? &a.callee2 : &a.callee) = g;
    }
    if (rec->host_out) {
      char hname[128];
      if (!(a.host = ir_module_add_host(fn->module, rec->host_fn, rec->host_user,
                                        host_name(rec->host_fn, hname, sizeof hname), rec->n_out, rec->host_out)))
        goto done;
    }
    ir_value small[8], *in = rec->n > 8 ? malloc((size_t)rec->n * sizeof *in) : small;
    if (!in) goto oom;
    for (int i = 0; i < rec->n; i++) in[i] = VAL(rec->in[i]);
    rec_val[r] = ir_append(fn->func, rec->op, &a, rec->n, in, (ir_loc){NULL, r + 1}); /* locs[r], once resolved */
    if (in != small) free(in);
    if (rec_val[r] < 0) goto done;
  }
  for (int i = 0; i < n_res; i++) res[i] = VAL(out_ids[i]);
#undef VAL
#undef VAL0
  if (ir_set_results(fn->func, n_res, res) || ir_verify(fn->func)) goto done;
  if (env) { /* a region's parameters are the instruction's operands: nothing to bind */
    rc = 0;
    goto done;
  }
  fn->caps = tr->caps, fn->n_caps = tr->n_caps; /* the trace's references move over */
  tr->caps = NULL, tr->n_caps = 0;
  fn->vars = tr->vars, fn->n_vars = tr->n_vars;
  tr->vars = NULL, tr->n_vars = 0;
  rc = 0;
  goto done;
oom:
  kiln_set_error("function_call: out of memory");
done:
  ir_clone_memo_free(&memo);
  free(out_ids);
  free(params);
  free(rec_val);
  free(res);
  trace_free(tr);
  if (rc) traced_fn_free(fn);
  return rc;
}
