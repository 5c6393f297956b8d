/* tape.c — gradient tapes (API.md §4): recording primitive applications on
 * the tapes active on this thread, and walking them backwards with each
 * op's gradient rule. The backward pass is made of ordinary ops, so an
 * outer tape records it (higher order) and the tracer will stage it. */
#include <stdlib.h>

#include "autodiff.h"

/* ---- a pointer-keyed hash map (open addressing) ---- */

typedef struct {
  kiln_tensor *key;
  kiln_tensor *value;
} map_entry;

typedef struct {
  map_entry *slots;
  int64_t cap, len; /* cap is a power of two */
} ptr_map;

static uint64_t ptr_hash(const void *p) {
  uint64_t x = (uint64_t)(uintptr_t)p;
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdULL;
  x ^= x >> 33;
  return x;
}

static map_entry *map_find(const ptr_map *m, const kiln_tensor *key) {
  if (!m->cap) return NULL;
  for (uint64_t i = ptr_hash(key) & (uint64_t)(m->cap - 1);; i = (i + 1) & (uint64_t)(m->cap - 1)) {
    if (m->slots[i].key == key) return &m->slots[i];
    if (!m->slots[i].key) return NULL;
  }
}

/* The entry for key, inserted with value NULL if absent; NULL when out of memory. */
static map_entry *map_insert(ptr_map *m, kiln_tensor *key, bool *added) {
  if ((m->len + 1) * 2 > m->cap) {
    int64_t cap = m->cap ? 2 * m->cap : 64;
    map_entry *slots = calloc((size_t)cap, sizeof *slots);
    if (!slots) return NULL;
    for (int64_t i = 0; i < m->cap; i++) {
      if (!m->slots[i].key) continue;
      uint64_t j = ptr_hash(m->slots[i].key) & (uint64_t)(cap - 1);
      while (slots[j].key) j = (j + 1) & (uint64_t)(cap - 1);
      slots[j] = m->slots[i];
    }
    free(m->slots);
    m->slots = slots;
    m->cap = cap;
  }
  uint64_t i = ptr_hash(key) & (uint64_t)(m->cap - 1);
  while (m->slots[i].key && m->slots[i].key != key) i = (i + 1) & (uint64_t)(m->cap - 1);
  *added = !m->slots[i].key;
  if (*added) {
    m->slots[i].key = key;
    m->slots[i].value = NULL;
    m->len++;
  }
  return &m->slots[i];
}

/* The value of a tracked entry whose key a walk has released already (the
 * tracked map's values are otherwise NULL): the key stays as a tombstone. */
static kiln_tensor released_key_mark;
#define RELEASED_KEY (&released_key_mark)

/* Releases every key (and value, if owned) and the table. */
static void map_free(ptr_map *m, bool release_keys, bool release_values) {
  for (int64_t i = 0; i < m->cap; i++) {
    if (!m->slots[i].key) continue;
    if (release_keys && m->slots[i].value != RELEASED_KEY) kiln_release(m->slots[i].key);
    if (release_values) kiln_release(m->slots[i].value);
  }
  free(m->slots);
  memset(m, 0, sizeof *m);
}

/* ---- tapes ---- */

/* Kept small: recording is on the hot path of every taped op. Inputs and
 * attributes are stored out of line only for the ops that need it. */
enum { NODE_SMALL = 2 };
typedef struct {
  op_id op; /* OP_COUNT for a custom gradient */
  int n;
  kiln_tensor *small[NODE_SMALL]; /* the inputs when n <= NODE_SMALL, retained */
  kiln_tensor **big;               /* else malloc'd, retained */
  kiln_tensor *out;                /* retained */
  op_attrs *attrs;                 /* malloc'd copy; NULL for ops without attributes */
  kiln_gradient_fn custom;
  void *user;
  const tape_closure *closure; /* user's retain/release, or NULL (user not owned) */
} tape_node;

static kiln_tensor **node_inputs(tape_node *nd) { return nd->n <= NODE_SMALL ? nd->small : nd->big; }

typedef struct {
  kiln_variable *var;
  kiln_tensor *t; /* tracked, so retained by the tape */
} var_read;

struct kiln_tape {
  bool persistent, active, used;
  kiln_tape *outer; /* next active tape out */
  ptr_map tracked;  /* tensors that depend on a watched one; keys retained */
  tape_node *nodes;
  int64_t n_nodes, cap_nodes;
  var_read *reads;
  int64_t n_reads, cap_reads;
};

_Thread_local int tape_active_count KILN_TLS_FAST;
static _Thread_local kiln_tape *innermost;
static _Thread_local int paused_count; /* tapes still active under a pause */

static bool differentiable(const kiln_tensor *t) {
  return t->dtype == KILN_F32 || t->dtype == KILN_F64;
}

static bool tracks(const kiln_tape *tape, const kiln_tensor *t) {
  return map_find(&tape->tracked, t) != NULL;
}

static int track(kiln_tape *tape, kiln_tensor *t) {
  bool added;
  map_entry *e = map_insert(&tape->tracked, t, &added);
  if (!e) return kiln_set_error("tape: out of memory");
  if (added) kiln_retain(t);
  return 0;
}

kiln_tape *kiln_tape_begin(bool persistent) {
  kiln_tape *t = calloc(1, sizeof *t);
  if (!t) {
    kiln_set_error("tape_begin: out of memory");
    return NULL;
  }
  t->persistent = persistent;
  t->active = true;
  t->outer = innermost;
  innermost = t;
  tape_active_count++;
  return t;
}

void kiln_tape_watch(kiln_tape *tape, kiln_tensor *t) {
  if (!tape || !t || !differentiable(t)) return;
  track(tape, t);
}

void kiln_tape_end(kiln_tape *tape) {
  if (!tape || !tape->active) return;
  if (innermost != tape) {
    kiln_set_error("tape_end: the tape is not the innermost active tape of this thread");
    return;
  }
  innermost = tape->outer;
  tape->outer = NULL;
  tape->active = false;
  tape_active_count--;
}

/* Drops what node nd holds (its inputs, result, attributes and closure);
 * it is left empty, so dropping it again does nothing. */
static void drop_node(tape_node *nd) {
  kiln_tensor **ins = node_inputs(nd);
  for (int j = 0; j < nd->n; j++) kiln_release(ins[j]);
  kiln_release(nd->out);
  if (nd->closure) nd->closure->release(nd->user);
  free(nd->big);
  free(nd->attrs);
  *nd = (tape_node){.op = OP_COUNT};
}

static void free_nodes(kiln_tape *tape) {
  for (int64_t i = 0; i < tape->n_nodes; i++) drop_node(&tape->nodes[i]);
  free(tape->nodes);
  tape->nodes = NULL;
  tape->n_nodes = tape->cap_nodes = 0;
  free(tape->reads);
  tape->reads = NULL;
  tape->n_reads = tape->cap_reads = 0;
  map_free(&tape->tracked, true, false);
}

void kiln_tape_free(kiln_tape *tape) {
  if (!tape) return;
  if (tape->active) {
    /* unlink from wherever it sits in the active list */
    kiln_tape **p = &innermost;
    while (*p && *p != tape) p = &(*p)->outer;
    if (*p) {
      *p = tape->outer;
      tape_active_count--;
    }
  }
  free_nodes(tape);
  free(tape);
}

bool tape_tracks(const kiln_tensor *t) {
  for (kiln_tape *tape = innermost; tape; tape = tape->outer)
    if (tracks(tape, t)) return true;
  return false;
}

tape_state tape_pause(void) {
  tape_state s = {innermost, tape_active_count};
  innermost = NULL;
  tape_active_count = 0;
  paused_count += s.count;
  return s;
}

void tape_resume(tape_state s) {
  paused_count -= s.count;
  innermost = s.innermost;
  tape_active_count = s.count;
}

static int push_node(kiln_tape *tape, op_id op, const op_attrs *attrs, int n, kiln_tensor *const *in,
                     kiln_tensor *out, kiln_gradient_fn custom, void *user, const tape_closure *closure) {
  if (tape->n_nodes == tape->cap_nodes) {
    int64_t cap = tape->cap_nodes ? 2 * tape->cap_nodes : 64;
    tape_node *nodes = realloc(tape->nodes, (size_t)cap * sizeof *nodes);
    if (!nodes) return kiln_set_error("tape: out of memory");
    tape->nodes = nodes;
    tape->cap_nodes = cap;
  }
  tape_node nd = {.op = op, .n = n, .custom = custom, .user = user, .closure = closure};
  if (n > NODE_SMALL && !(nd.big = malloc((size_t)n * sizeof *nd.big)))
    return kiln_set_error("tape: out of memory");
  if (attrs && op < OP_COUNT && kiln_ops[op].attrs[0]) {
    if (!(nd.attrs = malloc(sizeof *nd.attrs))) {
      free(nd.big);
      return kiln_set_error("tape: out of memory");
    }
    *nd.attrs = *attrs;
  }
  if (track(tape, out)) {
    free(nd.big);
    free(nd.attrs);
    return -1;
  }
  kiln_tensor **ins = node_inputs(&nd);
  for (int i = 0; i < n; i++) ins[i] = kiln_retain(in[i]);
  nd.out = kiln_retain(out);
  if (closure) closure->retain(user);
  tape->nodes[tape->n_nodes++] = nd;
  return 0;
}

static int record(op_id op, const op_attrs *attrs, int n, kiln_tensor *const *in, kiln_tensor *out,
                  kiln_gradient_fn custom, void *user, const tape_closure *closure) {
  if (!differentiable(out)) return 0;
  for (kiln_tape *tape = innermost; tape; tape = tape->outer) {
    bool depends = false;
    for (int i = 0; i < n && !depends; i++) depends = tracks(tape, in[i]);
    if (depends && push_node(tape, op, attrs, n, in, out, custom, user, closure)) return -1;
  }
  return 0;
}

int tape_record_custom(int n, kiln_tensor *const *in, kiln_tensor *out, kiln_gradient_fn grad, void *user,
                       const tape_closure *closure) {
  return tape_active_count ? record(OP_COUNT, NULL, n, in, out, grad, user, closure) : 0;
}

void tape_record(op_id op, const op_attrs *attrs, int n, kiln_tensor *const *in, kiln_tensor *out) {
  if (op == OP_STOP_GRADIENT || !kiln_grads[op]) return;
  record(op, attrs, n, in, out, NULL, NULL, NULL);
}

void tape_watch_variable_read(kiln_variable *var, kiln_tensor *t) {
  if (!differentiable(t)) return;
  for (kiln_tape *tape = innermost; tape; tape = tape->outer) {
    if (track(tape, t)) return;
    if (tape->n_reads == tape->cap_reads) {
      int64_t cap = tape->cap_reads ? 2 * tape->cap_reads : 16;
      var_read *r = realloc(tape->reads, (size_t)cap * sizeof *r);
      if (!r) return;
      tape->reads = r;
      tape->cap_reads = cap;
    }
    tape->reads[tape->n_reads++] = (var_read){var, t};
  }
}

kiln_tensor *kiln_custom_gradient(kiln_forward_fn fwd, kiln_gradient_fn grad, void *user, int n,
                                  kiln_tensor *const *xs) {
  return tape_custom_gradient(fwd, grad, user, NULL, n, xs);
}

kiln_tensor *tape_custom_gradient(kiln_forward_fn fwd, kiln_gradient_fn grad, void *user, const tape_closure *closure,
                                  int n, kiln_tensor *const *xs) {
  if (!fwd || !grad) {
    kiln_set_error("custom_gradient: %s is NULL", fwd ? "grad" : "fwd");
    return NULL;
  }
  if (n < 0 || (n > 0 && !xs)) {
    kiln_set_error("custom_gradient: %d inputs with %s", n, xs ? "a negative count" : "xs NULL");
    return NULL;
  }
  for (int i = 0; i < n; i++) {
    if (!xs[i]) {
      if (!kiln_has_error()) kiln_set_error("custom_gradient: xs[%d] is NULL", i);
      return NULL;
    }
  }
  tape_state saved = tape_pause();
  kiln_tensor *y = fwd(user, n, xs);
  /* The node needs a result of its own: an fwd that hands back one of xs
   * (or another tensor a tape already tracks; what fwd computes is never
   * tracked) gets a fresh view of it, else the node's gradient would mix
   * with that tensor's. */
  bool fresh = y != NULL;
  for (int i = 0; fresh && i < n; i++) fresh = y != xs[i];
  for (kiln_tape *tape = saved.innermost; fresh && tape; tape = tape->outer) fresh = !tracks(tape, y);
  if (y && !fresh) y = kiln_identity(y);
  tape_resume(saved);
  if (!y) {
    if (!kiln_has_error()) kiln_set_error("custom_gradient: fwd returned NULL without an error");
    return NULL;
  }
  if (tape_active_count && record(OP_COUNT, NULL, n, xs, y, grad, user, closure)) {
    kiln_set_error("custom_gradient: out of memory");
    return NULL;
  }
  return y;
}

/* ---- the backward walk ---- */

static int check_grad_shape(const char *what, int i, const kiln_tensor *dx, const kiln_tensor *x) {
  bool ok = dx->rank == x->rank && dx->dtype == x->dtype;
  for (int k = 0; ok && k < x->rank; k++) ok = dx->shape[k] == x->shape[k];
  if (ok) return 0;
  char a[160], b[160];
  return kiln_set_error("tape_gradient: the gradient of %s input %d is %s%s, expected %s%s", what, i,
                        kiln_dtype_name((kiln_dtype)dx->dtype), shape_str(a, sizeof a, dx->rank, dx->shape),
                        kiln_dtype_name((kiln_dtype)x->dtype), shape_str(b, sizeof b, x->rank, x->shape));
}

/* The tensors of nodes [0, end) through which some source is reached:
 * the sources, and the outputs of nodes with such an input. Gradients are
 * worth computing only for these (a batch of inputs to a model needs none). */
static int mark_useful(kiln_tape *tape, int64_t end, int n, kiln_tensor *const *sources, ptr_map *useful) {
  bool added;
  for (int i = 0; i < n; i++)
    if (!map_insert(useful, sources[i], &added)) return kiln_set_error("tape_gradient: out of memory");
  for (int64_t k = 0; k < end; k++) {
    tape_node *nd = &tape->nodes[k];
    kiln_tensor **in = node_inputs(nd);
    for (int i = 0; i < nd->n; i++) {
      if (!map_find(useful, in[i])) continue;
      if (!map_insert(useful, nd->out, &added)) return kiln_set_error("tape_gradient: out of memory");
      break;
    }
  }
  return 0;
}

/* Has the walk done with t's gradient (it is no source)? Then the walk
 * gives it up, and a tape that is done with t (drop) gives t up too. */
static void forget(kiln_tape *tape, ptr_map *grads, const ptr_map *sources, kiln_tensor *t, bool drop) {
  if (!t || map_find(sources, t)) return;
  map_entry *g = map_find(grads, t);
  if (g && g->value) {
    kiln_release(g->value);
    g->value = NULL;
  }
  map_entry *k = drop ? map_find(&tape->tracked, t) : NULL;
  if (k && k->value != RELEASED_KEY) {
    k->value = RELEASED_KEY;
    kiln_release(t);
  }
}

/* The walk from node end - 1 down to node 0. grads owns its values (one
 * reference each). Each node's rule runs in a scope of its own, which
 * closes once its results are added in: only the gradients still to be
 * used stay alive, as in PyTorch's engine, not every intermediate of the
 * backward pass. The gradient of a node's result is given up once the
 * node is done: every node that reads the result was walked before it.
 * With drop (a tape that takes one gradient), the tape also gives up each
 * node as it is walked, and with it the forward's intermediates it kept,
 * so that the step's memory shrinks as the walk goes on. A tensor given up
 * may be freed and its address reused, but only by a tensor made during
 * the walk, which no later lookup asks about: every key still looked up
 * belongs to a node not walked yet, which keeps it alive. */
static int backward(kiln_tape *tape, int64_t end, const ptr_map *useful, const ptr_map *sources, ptr_map *grads,
                    bool drop) {
  enum { SMALL = 8 };
  for (int64_t k = end; k-- > 0;) {
    /* a copy: the rules may record onto this tape and move its node array */
    tape_node node = tape->nodes[k], *nd = &node;
    kiln_tensor **in = node_inputs(nd);
    map_entry *e = nd->out ? map_find(grads, nd->out) : NULL;
    if (!e || !e->value || !map_find(useful, nd->out)) {
      forget(tape, grads, sources, nd->out, drop);
      if (drop) drop_node(&tape->nodes[k]);
      continue;
    }
    kiln_tensor *small[SMALL] = {NULL}, **dx = nd->n <= SMALL ? small : calloc((size_t)nd->n, sizeof *dx);
    bool need_small[SMALL] = {false}, *need = nd->n <= SMALL ? need_small : calloc((size_t)nd->n, sizeof *need);
    if (!dx || !need) {
      if (dx != small) free(dx);
      if (need != need_small) free(need);
      return kiln_set_error("tape_gradient: out of memory");
    }
    for (int i = 0; i < nd->n; i++)
      need[i] = differentiable(in[i]) && tracks(tape, in[i]) && map_find(useful, in[i]);
    kiln_scope_push();
    int rc;
    const char *what;
    if (nd->custom) {
      what = nd->closure ? nd->closure->what : "custom_gradient";
      rc = nd->custom(nd->user, nd->n, in, nd->out, e->value, dx);
      if (rc && !kiln_has_error()) kiln_set_error("tape_gradient: a custom gradient failed without an error");
    } else {
      what = kiln_ops[nd->op].api;
      static const op_attrs no_attrs;
      grad_args g = {nd->op, nd->attrs ? nd->attrs : &no_attrs, nd->n, in, nd->out, e->value, dx, need};
      rc = kiln_grads[nd->op](&g);
    }
    for (int i = 0; rc == 0 && i < nd->n; i++) {
      if (!dx[i] || !need[i]) continue;
      if ((rc = check_grad_shape(what, i, dx[i], in[i]))) break;
      bool added;
      map_entry *acc = map_insert(grads, in[i], &added);
      if (!acc) {
        rc = kiln_set_error("tape_gradient: out of memory");
        break;
      }
      kiln_tensor *sum = acc->value ? kiln_add(acc->value, dx[i]) : dx[i];
      if (!sum) {
        rc = -1;
        break;
      }
      kiln_retain(sum); /* past the node's scope */
      kiln_release(acc->value);
      acc->value = sum;
    }
    kiln_scope_pop();
    if (dx != small) free(dx);
    if (need != need_small) free(need);
    if (rc) return -1;
    forget(tape, grads, sources, nd->out, drop);
    if (drop) drop_node(&tape->nodes[k]);
  }
  return 0;
}

static int gradient_setup(const char *who, kiln_tape *tape, kiln_tensor *target) {
  if (!tape) return kiln_set_error("%s: tape is NULL", who);
  if (!target) return kiln_has_error() ? -1 : kiln_set_error("%s: target is NULL", who);
  if (tape->used && !tape->persistent)
    return kiln_set_error("%s: a non-persistent tape computes one gradient; "
                          "use kiln_tape_begin(true) to take several", who);
  return 0;
}

/* out[i] = the sum of the gradients of flat[group_end[i-1] .. group_end[i]) (the
 * reads of one variable), NULL where none is connected */
static _Thread_local kiln_tensor *seed_override; /* tape_gradient_seeded: the target's gradient */

/* the sources of the walk under way on this thread (tape_walk_source) */
static _Thread_local kiln_tensor *const *walk_sources;
static _Thread_local int64_t walk_n_sources;

bool tape_walk_source(const kiln_tensor *t) {
  for (int64_t i = 0; i < walk_n_sources; i++)
    if (walk_sources[i] == t) return true;
  return false;
}

int tape_recent(const kiln_tensor *out, op_id op, kiln_gradient_fn custom, kiln_tensor *const **in) {
  if (tape_active_count != 1 || !innermost) return -1;
  kiln_tape *tape = innermost;
  for (int64_t k = tape->n_nodes, seen = 0; k-- > 0 && seen < TAPE_RECENT; seen++) {
    tape_node *nd = &tape->nodes[k];
    if (nd->out != out) continue;
    if (nd->op != op || nd->custom != custom) return -1;
    *in = node_inputs(nd);
    return nd->n;
  }
  return -1;
}

static int walk(const char *who, kiln_tape *tape, kiln_tensor *target, int n, kiln_tensor *const *flat,
                const int *group_end, kiln_tensor **out) {
  int64_t end = tape->n_nodes; /* a persistent tape's walk may record onto it */
  tape->used = true;
  if (!differentiable(target)) { /* integer and bool results carry no gradient (as TF: None) */
    for (int i = 0; i < n; i++) out[i] = NULL;
    if (!tape->persistent) free_nodes(tape);
    return 0;
  }
  ptr_map grads = {0}, useful = {0}, sources = {0};
  int n_flat = group_end[n > 0 ? n - 1 : 0] * (n > 0);
  int rc = mark_useful(tape, end, n_flat, flat, &useful);
  bool added;
  for (int i = 0; rc == 0 && i < n_flat; i++)
    if (!map_insert(&sources, flat[i], &added)) rc = kiln_set_error("%s: out of memory", who);
  kiln_scope_push();
  kiln_tensor *seed = seed_override ? seed_override : kiln_ones((kiln_dtype)target->dtype, target->rank, target->shape);
  seed_override = NULL;
  map_entry *e = seed ? map_insert(&grads, target, &added) : NULL;
  if (!e) {
    rc = seed ? kiln_set_error("%s: out of memory", who) : -1;
  } else if (rc == 0) {
    e->value = kiln_retain(seed);
    kiln_tensor *const *outer_sources = walk_sources;
    int64_t outer_n = walk_n_sources;
    walk_sources = flat, walk_n_sources = n_flat;
    rc = backward(tape, end, &useful, &sources, &grads, !tape->persistent);
    walk_sources = outer_sources, walk_n_sources = outer_n;
  }
  for (int i = 0, j = 0; rc == 0 && i < n; i++) {
    kiln_tensor *sum = NULL;
    for (; j < group_end[i]; j++) {
      bool dup = false; /* a tensor listed twice in a group counts once */
      for (int k = i ? group_end[i - 1] : 0; k < j; k++) dup |= flat[k] == flat[j];
      map_entry *g = dup ? NULL : map_find(&grads, flat[j]);
      if (!g || !g->value) continue;
      sum = sum ? kiln_add(sum, g->value) : g->value;
    }
    /* a fresh header per result, so each can escape to the caller's scope */
    out[i] = sum ? kiln_identity(sum) : NULL;
    if (sum && !out[i]) rc = -1;
  }
  for (int i = 0; i < n; i++) {
    if (rc == 0 && out[i]) kiln_scope_escape(out[i]);
    else out[i] = NULL;
  }
  kiln_scope_pop();
  map_free(&grads, false, true);
  map_free(&useful, false, false);
  map_free(&sources, false, false);
  if (!tape->persistent) free_nodes(tape);
  return rc;
}

/* A non-persistent tape computes one gradient and then drops its nodes, so
 * its walk's own ops need not be recorded on it: it leaves the active list
 * for the walk (outer tapes still record them, for higher derivatives).
 * Recorded, they kept every intermediate of the backward alive until the
 * end of the walk and cost a node each. */
static bool detach(kiln_tape *tape) {
  if (tape->persistent || !tape->active) return false;
  kiln_tape **link = &innermost;
  while (*link && *link != tape) link = &(*link)->outer;
  if (!*link) return false; /* paused */
  *link = tape->outer;
  tape_active_count--;
  return true;
}

/* back in the active list, just inside the tape that was next out of it */
static void reattach(kiln_tape *tape) {
  kiln_tape **link = &innermost;
  while (*link && *link != tape->outer) link = &(*link)->outer;
  tape->outer = *link;
  *link = tape;
  tape_active_count++;
}

static int gradient(const char *who, kiln_tape *tape, kiln_tensor *target, int n, kiln_tensor *const *flat,
                    const int *group_end, kiln_tensor **out) {
  bool detached = detach(tape);
  int rc = walk(who, tape, target, n, flat, group_end, out);
  if (detached) reattach(tape);
  return rc;
}

int kiln_tape_gradient(kiln_tape *tape, kiln_tensor *target, int n, kiln_tensor *const *sources,
                       kiln_tensor **grads) {
  const char *who = "tape_gradient";
  if (n < 0 || (n > 0 && (!sources || !grads)))
    return kiln_set_error("%s: %d sources with %s NULL", who, n, sources ? "grads" : "sources");
  for (int i = 0; i < n; i++) grads[i] = NULL;
  if (gradient_setup(who, tape, target)) return -1;
  for (int i = 0; i < n; i++)
    if (!sources[i]) return kiln_set_error("%s: sources[%d] is NULL", who, i);
  int small[16] = {0}, *ends = n <= 16 ? small : malloc((size_t)n * sizeof *ends);
  if (!ends) return kiln_set_error("%s: out of memory", who);
  for (int i = 0; i < n; i++) ends[i] = i + 1;
  int rc = gradient(who, tape, target, n, sources, ends, grads);
  if (ends != small) free(ends);
  return rc;
}

int tape_gradient_seeded(kiln_tape *tape, kiln_tensor *target, kiln_tensor *dy, int n, kiln_tensor *const *sources,
                         kiln_tensor **grads) {
  seed_override = dy;
  int rc = kiln_tape_gradient(tape, target, n, sources, grads);
  seed_override = NULL;
  return rc;
}

int kiln_tape_gradient_vars(kiln_tape *tape, kiln_tensor *target, int n, kiln_variable *const *vars,
                            kiln_tensor **grads) {
  const char *who = "tape_gradient_vars";
  if (n < 0 || (n > 0 && (!vars || !grads)))
    return kiln_set_error("%s: %d variables with %s NULL", who, n, vars ? "grads" : "vars");
  for (int i = 0; i < n; i++) grads[i] = NULL;
  if (gradient_setup(who, tape, target)) return -1;
  for (int i = 0; i < n; i++)
    if (!vars[i]) return kiln_set_error("%s: vars[%d] is NULL", who, i);
  /* each variable's reads, grouped in order */
  int64_t total = 0;
  for (int i = 0; i < n; i++)
    for (int64_t r = 0; r < tape->n_reads; r++) total += tape->reads[r].var == vars[i];
  kiln_tensor **flat = malloc((size_t)(total ? total : 1) * sizeof *flat);
  int *ends = malloc((size_t)(n ? n : 1) * sizeof *ends);
  int rc;
  if (!flat || !ends) {
    rc = kiln_set_error("%s: out of memory", who);
  } else {
    int j = 0;
    for (int i = 0; i < n; i++) {
      for (int64_t r = 0; r < tape->n_reads; r++)
        if (tape->reads[r].var == vars[i]) flat[j++] = tape->reads[r].t;
      ends[i] = j;
    }
    rc = gradient(who, tape, target, n, flat, ends, grads);
  }
  free(flat);
  free(ends);
  return rc;
}
