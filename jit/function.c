/* function.c — staged functions (API.md §5, §6): a trace cache keyed by the
 * inputs' dtypes, shapes and devices, the device scope and the values of
 * static arguments (kiln_jit). A miss traces the body once with symbolic
 * tensors (trace.c), runs the pass pipeline over the verified IR and
 * compiles the result (compile.c); every call then runs that code, with
 * fresh random draws and the variables' current values.
 *
 * The cache is a hash table that calls read without a lock. Tracing,
 * inserting and evicting (LRU, KILN_TRACE_CACHE_MAX entries) hold the
 * function's lock; an evicted entry or a replaced table is retired and
 * freed only once every call that might still be reading it has returned
 * (epoch-based reclamation: each thread announces the epoch it entered at). */
#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "autodiff.h"
#include "function.h"
#include "../passes/buffers.h"
#include "../lib/variable.h"

typedef struct {
  uint8_t dtype, device;
  int8_t rank;
  int64_t shape[KILN_MAX_RANK];
} arg_sig;

struct cached_trace {
  uint64_t hash;       /* of key */
  uint8_t *key;        /* the packed signature (pack_key): what a lookup compares */
  size_t key_len;
  const uint8_t *statics; /* the static arguments' bytes: the tail of key */
  size_t statics_len;
  arg_sig *args;       /* n_in of them, for KILN_LOG=retrace */
  int device_scope;
  int index;           /* its number among the function's traces (kiln_function_ir) */
  _Atomic uint64_t last_use; /* the function's tick at its latest call (LRU) */
  uint64_t retired_at; /* the epoch it was evicted in */
  cached_trace *next_retired;
  traced_fn fn;
  int traced_ops;
  double trace_ms;
};

/* Open addressing, linear probing; cap a power of two, at most half used
 * (entries and tombstones). Replaced, never resized in place. */
struct trace_table {
  uint32_t cap;
  uint64_t retired_at;
  trace_table *next_retired;
  _Atomic(cached_trace *) slot[];
};
#define TOMBSTONE ((cached_trace *)(uintptr_t)1)

static atomic_llong live_traces; /* kiln_debug_live_traces */

int64_t kiln_debug_live_traces(void) { return atomic_load(&live_traces); }

static double now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

/* ---- epoch-based reclamation ----
 * A call announces the global epoch while it may hold a cache entry (its
 * thread's record, outermost call only); retiring an entry tags it with the
 * epoch and advances it. An entry is freed once every announcing thread
 * entered after it was retired: such a call loaded the table after the
 * entry left it. The announcement is a store to a record of the thread's
 * own, so concurrent calls share no written cache line here. */
typedef struct ebr_reader {
  _Atomic uint64_t epoch; /* 0: not in a call */
  int depth;
  bool in_use;
  struct ebr_reader *next;
} ebr_reader;

static _Atomic uint64_t ebr_epoch = 1;
static pthread_mutex_t ebr_lock = PTHREAD_MUTEX_INITIALIZER;
static _Atomic(ebr_reader *) ebr_readers; /* only grows; a record is reused after its thread exits */
static _Thread_local ebr_reader *ebr_me KILN_TLS_FAST;
static pthread_key_t ebr_key;
static pthread_once_t ebr_once = PTHREAD_ONCE_INIT;

static void ebr_thread_exit(void *p) {
  ebr_reader *r = p;
  atomic_store(&r->epoch, 0);
  r->depth = 0;
  ebr_me = NULL;
  pthread_mutex_lock(&ebr_lock);
  r->in_use = false;
  pthread_mutex_unlock(&ebr_lock);
}

static void ebr_init(void) { pthread_key_create(&ebr_key, ebr_thread_exit); }

static ebr_reader *ebr_register(void) {
  pthread_once(&ebr_once, ebr_init);
  pthread_mutex_lock(&ebr_lock);
  ebr_reader *r = atomic_load(&ebr_readers);
  while (r && r->in_use) r = r->next;
  if (!r && (r = calloc(1, sizeof *r))) {
    r->next = atomic_load(&ebr_readers);
    atomic_store(&ebr_readers, r);
  }
  if (r) r->in_use = true;
  pthread_mutex_unlock(&ebr_lock);
  if (r) pthread_setspecific(ebr_key, r);
  return ebr_me = r;
}

static inline bool ebr_enter(void) {
  ebr_reader *r = ebr_me;
  if (KILN_UNLIKELY(!r) && !(r = ebr_register())) return false;
  if (r->depth++ == 0)
    atomic_store_explicit(&r->epoch, atomic_load_explicit(&ebr_epoch, memory_order_acquire), memory_order_seq_cst);
  return true;
}

static void try_reclaim(kiln_function *f);

static inline void ebr_exit(kiln_function *f) {
  ebr_reader *r = ebr_me;
  if (--r->depth) return;
  atomic_store_explicit(&r->epoch, 0, memory_order_release);
  if (KILN_UNLIKELY(atomic_load_explicit(&f->reclaim, memory_order_relaxed))) try_reclaim(f);
}

/* The oldest epoch a running call announced; UINT64_MAX if none runs. */
static uint64_t ebr_oldest(void) {
  uint64_t min = UINT64_MAX;
  for (ebr_reader *r = atomic_load(&ebr_readers); r; r = r->next) {
    uint64_t e = atomic_load_explicit(&r->epoch, memory_order_seq_cst);
    if (e && e < min) min = e;
  }
  return min;
}

/* ---- the function ---- */

/* KILN_TRACE_CACHE_MAX: traces kept per function (LRU), default 1024 */
enum { TRACE_CACHE_DEFAULT = 1024, TRACE_CACHE_LIMIT = 1 << 24 };
static int cache_max(void) {
  const char *env = getenv("KILN_TRACE_CACHE_MAX");
  if (!env || !*env) return TRACE_CACHE_DEFAULT;
  char *end;
  long long v = strtoll(env, &end, 10);
  if (*end || v < 1 || v > TRACE_CACHE_LIMIT) {
    static atomic_bool warned;
    if (!atomic_exchange(&warned, true))
      fprintf(stderr, "kiln: KILN_TRACE_CACHE_MAX='%s' is not a count from 1 to %d; using %d\n", env,
              TRACE_CACHE_LIMIT, TRACE_CACHE_DEFAULT);
    return TRACE_CACHE_DEFAULT;
  }
  return (int)v;
}

kiln_function *kiln_function_new(const char *name, kiln_body_fn body, void *user, int n_in, int n_out) {
  const char *who = "function_new";
  if (!body) {
    kiln_set_error("%s: body is NULL", who);
    return NULL;
  }
  if (n_in < 0 || n_out < 0) {
    kiln_set_error("%s: n_in = %d and n_out = %d must not be negative", who, n_in, n_out);
    return NULL;
  }
  kiln_function *f = calloc(1, sizeof *f);
  if (!f || !(f->name = strdup(name && *name ? name : "f"))) {
    free(f);
    kiln_set_error("%s: out of memory", who);
    return NULL;
  }
  f->body = body;
  f->user = user;
  f->n_in = n_in;
  f->n_out = n_out;
  f->max = cache_max();
  atomic_init(&f->eager, false);
  atomic_init(&f->inference, false);
  atomic_init(&f->refs, 1);
  pthread_mutex_init(&f->lock, NULL);
  return f;
}

static void entry_free(cached_trace *c) {
  if (!c) return;
  traced_fn_free(&c->fn);
  free(c->args);
  free(c->key);
  free(c);
  atomic_fetch_sub(&live_traces, 1);
}

/* A call a tape watches is two kinds of trace of the body, made together:
 * the forward, which returns the outputs and then the residuals (the values
 * the backward needs), and per float output k a backward trace (dy,
 * residuals) -> d(sum(y_k * dy))/d(inputs), recorded by running the tape's
 * gradient over the forward's symbolic values while the backward trace
 * records (trace_taped). The function's list holds one reference, each tape
 * node of such a call another (and one on the function). */
struct taped_trace {
  _Atomic(taped_trace *) next;
  uint8_t *key; /* packed as a cached_trace's */
  size_t key_len, statics_off, statics_len;
  uint64_t hash;
  int n_out;
  atomic_int refs;
  _Atomic uint64_t last_use; /* as a cached_trace's */
  uint64_t retired_at;
  taped_trace *next_retired;
  traced_fn fwd;
  traced_fn *bwd;  /* per output; func NULL for outputs without gradients */
  int **res_idx;   /* per output: its residual parameters, as indices of fwd's residual results */
  taped_slot *slots;
};

static void taped_free(taped_trace *t) {
  if (!t) return;
  traced_fn_free(&t->fwd);
  for (int k = 0; t->bwd && k < t->n_out; k++) traced_fn_free(&t->bwd[k]);
  for (int k = 0; t->res_idx && k < t->n_out; k++) free(t->res_idx[k]);
  free(t->bwd);
  free(t->res_idx);
  free(t->slots);
  free(t->key);
  free(t);
  atomic_fetch_sub(&live_traces, 1);
}

static void taped_release(taped_trace *t) {
  if (atomic_fetch_sub_explicit(&t->refs, 1, memory_order_acq_rel) == 1) taped_free(t);
}

/* Frees what was retired before every running call began; caller holds
 * the lock. */
static void reclaim(kiln_function *f) {
  uint64_t oldest = ebr_oldest();
  for (cached_trace **p = &f->retired; *p;) {
    cached_trace *c = *p;
    if (c->retired_at < oldest) {
      *p = c->next_retired;
      entry_free(c);
    } else {
      p = &c->next_retired;
    }
  }
  for (trace_table **p = &f->retired_tables; *p;) {
    trace_table *t = *p;
    if (t->retired_at < oldest) {
      *p = t->next_retired;
      free(t);
    } else {
      p = &t->next_retired;
    }
  }
  for (taped_trace **p = &f->retired_taped; *p;) {
    taped_trace *t = *p;
    if (t->retired_at < oldest) {
      *p = t->next_retired;
      taped_release(t);
    } else {
      p = &t->next_retired;
    }
  }
  atomic_store_explicit(&f->reclaim, f->retired || f->retired_tables || f->retired_taped, memory_order_relaxed);
}

static void try_reclaim(kiln_function *f) {
  if (pthread_mutex_trylock(&f->lock)) return;
  reclaim(f);
  pthread_mutex_unlock(&f->lock);
}

static void function_release(kiln_function *f) {
  if (atomic_fetch_sub_explicit(&f->refs, 1, memory_order_acq_rel) != 1) return;
  trace_table *t = atomic_load(&f->table);
  for (uint32_t i = 0; t && i < t->cap; i++) {
    cached_trace *c = atomic_load(&t->slot[i]);
    if (c && c != TOMBSTONE) entry_free(c);
  }
  free(t);
  for (cached_trace *c = f->retired, *n; c; c = n) {
    n = c->next_retired;
    entry_free(c);
  }
  for (trace_table *r = f->retired_tables, *n; r; r = n) {
    n = r->next_retired;
    free(r);
  }
  function_free_gradients(f);
  for (taped_trace *t = atomic_load(&f->taped), *n; t; t = n) {
    n = atomic_load(&t->next);
    taped_release(t);
  }
  for (taped_trace *t = f->retired_taped, *n; t; t = n) {
    n = t->next_retired;
    taped_release(t);
  }
  for (int i = 0; i < f->n_owned; i++) kiln_variable_free(f->owned[i]);
  free(f->owned);
  free(f->static_letters);
  free(f->tensor_pos);
  free(f->static_pos);
  pthread_mutex_destroy(&f->lock);
  free(f->name);
  if (f->user_free) f->user_free(f->user);
  free(f);
}

void kiln_function_free(kiln_function *f) {
  if (f) function_release(f);
}

void kiln_function_set_eager(kiln_function *f, bool eager) {
  if (f) atomic_store(&f->eager, eager);
}

int kiln_function_set_optimize_for_inference(kiln_function *f, bool on) {
  if (!f) return kiln_set_error("function_set_optimize_for_inference: function is NULL");
  if (atomic_load(&f->made))
    return kiln_set_error("function_set_optimize_for_inference: @%s has been traced already: set it before the "
                          "first call",
                          f->name);
  atomic_store(&f->inference, on);
  return 0;
}

int kiln_function_trace_count(const kiln_function *f) {
  if (!f) return kiln_set_error("function_trace_count: function is NULL");
  return atomic_load(&((kiln_function *)f)->made);
}

/* ---- static arguments ---- */

typedef struct {
  const kiln_function *f;
  const void *bytes;
  size_t len;
} call_key;

static _Thread_local call_key current_key KILN_TLS_FAST;

int function_call_keyed(kiln_function *f, kiln_tensor *const *in, kiln_tensor **out, const void *key, size_t len) {
  call_key saved = current_key;
  current_key = (call_key){f, key, len};
  int rc = kiln_function_call(f, in, out);
  current_key = saved;
  return rc;
}

const void *function_body_key(const kiln_function *f, size_t *len) {
  if (!f || current_key.f != f) {
    *len = 0;
    return NULL;
  }
  *len = current_key.len;
  return current_key.bytes;
}

/* the static key f's traces depend on in this call */
static const void *statics_of(const kiln_function *f, size_t *len) {
  if (KILN_LIKELY(!f->key_of)) {
    *len = 0;
    return NULL;
  }
  return function_body_key(f->key_of, len);
}

int function_set_statics(kiln_function *f, const char *letters, const int *tensor_pos, const int *static_pos) {
  int ns = (int)strlen(letters);
  f->key_of = f;
  f->static_letters = strdup(letters);
  f->tensor_pos = malloc(((size_t)f->n_in + 1) * sizeof *f->tensor_pos);
  f->static_pos = malloc(((size_t)ns + 1) * sizeof *f->static_pos);
  if (!f->static_letters || !f->tensor_pos || !f->static_pos) return kiln_set_error("jit: out of memory");
  memcpy(f->tensor_pos, tensor_pos, (size_t)f->n_in * sizeof *tensor_pos);
  memcpy(f->static_pos, static_pos, (size_t)ns * sizeof *static_pos);
  return 0;
}

/* ---- signatures ---- */

static void sig_of(const kiln_tensor *t, arg_sig *s) {
  memset(s, 0, sizeof *s);
  s->dtype = t->dtype;
  s->device = t->device;
  s->rank = t->rank;
  for (int i = 0; i < t->rank; i++) s->shape[i] = t->shape[i];
}

static bool sig_eq(const arg_sig *a, const arg_sig *b) {
  if (a->dtype != b->dtype || a->device != b->device || a->rank != b->rank) return false;
  for (int i = 0; i < a->rank; i++)
    if (a->shape[i] != b->shape[i]) return false;
  return true;
}

static char *sig_str(char *buf, size_t n, const arg_sig *s) {
  op_type ty = {(kiln_dtype)s->dtype, s->rank, {0}};
  for (int i = 0; i < s->rank; i++) ty.shape[i] = s->shape[i];
  ir_type_str(buf, n, &ty);
  if (s->device) {
    size_t len = strlen(buf);
    snprintf(buf + len, n - len, " on %s", kiln_device_name(s->device));
  }
  return buf;
}

/* A call's trace key packed into bytes: the device scope, each input's
 * dtype, device, rank and dims, then the static arguments' bytes. */
typedef struct {
  uint8_t *p;
  size_t n;
  const uint8_t *statics;
  size_t statics_len;
  int device_scope;
  uint8_t small[248];
} packed_key;

static int pack_key(packed_key *k, const kiln_function *f, kiln_tensor *const *in) {
  size_t sl;
  const void *st = statics_of(f, &sl);
  int32_t scope = device_current();
  size_t need = sizeof scope + sl;
  for (int i = 0; i < f->n_in; i++) need += 3 + (size_t)in[i]->rank * sizeof(int64_t);
  k->p = need <= sizeof k->small ? k->small : malloc(need);
  if (!k->p) return kiln_set_error("function_call: out of memory");
  uint8_t *p = k->p;
  memcpy(p, &scope, sizeof scope);
  p += sizeof scope;
  for (int i = 0; i < f->n_in; i++) {
    const kiln_tensor *t = in[i];
    *p++ = t->dtype;
    *p++ = t->device;
    *p++ = (uint8_t)t->rank;
    size_t b = (size_t)t->rank * sizeof(int64_t);
    memcpy(p, t->shape, b);
    p += b;
  }
  if (sl) memcpy(p, st, sl);
  k->statics = p;
  k->statics_len = sl;
  k->n = need;
  k->device_scope = scope;
  return 0;
}

static void packed_free(packed_key *k) {
  if (k->p != k->small) free(k->p);
}

static uint64_t hash_bytes(const uint8_t *p, size_t n) {
  uint64_t h = 0x9e3779b97f4a7c15ull ^ n;
  for (; n >= 8; p += 8, n -= 8) {
    uint64_t w;
    memcpy(&w, p, 8);
    h = (h ^ w) * 0xff51afd7ed558ccdull;
    h ^= h >> 32;
  }
  uint64_t w = 0;
  memcpy(&w, p, n);
  h = (h ^ w) * 0xc4ceb9fe1a85ec53ull;
  return h ^ (h >> 29);
}

/* ---- the table ---- */

/* Lock-free: the entry with this key, or NULL. */
static cached_trace *table_find(const trace_table *t, uint64_t h, const uint8_t *key, size_t len) {
  uint32_t m = t->cap - 1;
  for (uint32_t i = (uint32_t)h & m, n = 0; n < t->cap; i = (i + 1) & m, n++) {
    cached_trace *c = atomic_load_explicit(&((trace_table *)t)->slot[i], memory_order_seq_cst);
    if (!c) return NULL;
    if (c != TOMBSTONE && c->hash == h && c->key_len == len && memcmp(c->key, key, len) == 0) return c;
  }
  return NULL;
}

static cached_trace *lookup(kiln_function *f, const packed_key *k, uint64_t h) {
  trace_table *t = atomic_load_explicit(&f->table, memory_order_seq_cst);
  return t ? table_find(t, h, k->p, k->n) : NULL;
}

/* the LRU stamp: racy between threads, which only blurs near-ties */
static inline void touch(kiln_function *f, cached_trace *c) {
  uint64_t tick = atomic_load_explicit(&f->tick, memory_order_relaxed) + 1;
  atomic_store_explicit(&f->tick, tick, memory_order_relaxed);
  atomic_store_explicit(&c->last_use, tick, memory_order_relaxed);
}

static void slot_put(trace_table *t, cached_trace *c) {
  uint32_t m = t->cap - 1, i = (uint32_t)c->hash & m;
  while (atomic_load_explicit(&t->slot[i], memory_order_relaxed)) i = (i + 1) & m;
  atomic_store_explicit(&t->slot[i], c, memory_order_relaxed);
}

/* A new table for f's entries plus one more, published; the old one is
 * retired. Caller holds the lock. 0 / -1. */
static int table_rebuild(kiln_function *f) {
  trace_table *old = atomic_load(&f->table);
  uint32_t cap = 16;
  while (cap < 4u * (uint32_t)(f->live + 1)) cap *= 2;
  trace_table *t = calloc(1, sizeof *t + (size_t)cap * sizeof *t->slot);
  if (!t) return kiln_set_error("function_call: out of memory");
  t->cap = cap;
  for (uint32_t i = 0; old && i < old->cap; i++) {
    cached_trace *c = atomic_load_explicit(&old->slot[i], memory_order_relaxed);
    if (c && c != TOMBSTONE) slot_put(t, c);
  }
  atomic_store_explicit(&f->table, t, memory_order_seq_cst);
  f->used = f->live;
  if (old) {
    old->retired_at = atomic_fetch_add(&ebr_epoch, 1);
    old->next_retired = f->retired_tables;
    f->retired_tables = old;
    atomic_store(&f->reclaim, true);
  }
  return 0;
}

static bool log_retrace(void) {
  const char *env = getenv("KILN_LOG");
  return env && strstr(env, "retrace");
}

static const char *static_type(char letter) {
  switch (letter) {
  case 'i': return "int";
  case 'l': return "int64";
  case 'd': return "double";
  case 'b': return "bool";
  default: return "pointer";
  }
}

void function_static_str(char *buf, size_t n, char letter, const uint8_t *p) {
  union {
    int i;
    int64_t l;
    double d;
    bool b;
    void *p;
    uint8_t bytes[8];
  } v;
  memcpy(v.bytes, p, 8);
  switch (letter) {
  case 'i': snprintf(buf, n, "%d", v.i); break;
  case 'l': snprintf(buf, n, "%" PRId64, v.l); break;
  case 'd': snprintf(buf, n, "%.17g", v.d); break;
  case 'b': snprintf(buf, n, "%s", v.b ? "true" : "false"); break;
  default: snprintf(buf, n, "%p", v.p); break;
  }
}

/* How many arguments (inputs, statics, the device scope) of b differ from
 * a's; with what non-NULL, each of them as "arg 1: f32[3] -> f64[3]". */
static int sig_diff(const kiln_function *f, const cached_trace *a, const cached_trace *b, char *what, size_t n) {
  int count = 0;
  size_t used = 0;
  if (a->device_scope != b->device_scope) {
    if (what && used < n)
      used += (size_t)snprintf(what + used, n - used, "device scope: %s -> %s", kiln_device_name(a->device_scope),
                               kiln_device_name(b->device_scope));
    count++;
  }
  for (int i = 0; i < f->n_in; i++) {
    if (sig_eq(&a->args[i], &b->args[i])) continue;
    if (what && used < n) {
      char x[280], y[280];
      used += (size_t)snprintf(what + used, n - used, "%sarg %d: %s -> %s", count ? ", " : "",
                               f->tensor_pos ? f->tensor_pos[i] : i, sig_str(x, sizeof x, &a->args[i]),
                               sig_str(y, sizeof y, &b->args[i]));
    }
    count++;
  }
  const char *letters = f->key_of == f ? f->static_letters : NULL;
  size_t ns = letters ? strlen(letters) : 0;
  if (letters && a->statics_len == 8 * ns && b->statics_len == 8 * ns) {
    for (size_t s = 0; s < ns; s++) {
      if (!memcmp(a->statics + 8 * s, b->statics + 8 * s, 8)) continue;
      if (what && used < n) {
        char x[64], y[64];
        function_static_str(x, sizeof x, letters[s], a->statics + 8 * s);
        function_static_str(y, sizeof y, letters[s], b->statics + 8 * s);
        used += (size_t)snprintf(what + used, n - used, "%sarg %d (static %s): %s -> %s", count ? ", " : "",
                                 f->static_pos[s], static_type(letters[s]), x, y);
      }
      count++;
    }
  } else if (a->statics_len != b->statics_len ||
             (a->statics_len && memcmp(a->statics, b->statics, a->statics_len))) {
    if (what && used < n)
      used += (size_t)snprintf(what + used, n - used, "%sstatic arguments of @%s", count ? ", " : "",
                               f->key_of ? f->key_of->name : f->name);
    count++;
  }
  return count;
}

/* KILN_LOG=retrace: every argument in which the new trace c differs from
 * the nearest cached one (fewest differing arguments; the newest of ties).
 * Caller holds the lock; c is not in the table yet. */
static void report_retrace(kiln_function *f, const cached_trace *c) {
  trace_table *t = atomic_load(&f->table);
  const cached_trace *best = NULL;
  int best_n = 0;
  for (uint32_t i = 0; t && i < t->cap; i++) {
    cached_trace *e = atomic_load_explicit(&t->slot[i], memory_order_relaxed);
    if (!e || e == TOMBSTONE) continue;
    int d = sig_diff(f, e, c, NULL, 0);
    if (!best || d < best_n || (d == best_n && e->index > best->index)) best = e, best_n = d;
  }
  if (!best) return;
  char what[1200] = "no argument changed";
  if (best_n) sig_diff(f, best, c, what, sizeof what);
  fprintf(stderr, "kiln: retrace @%s: %s (%.2f ms)\n", f->name, what, c->trace_ms);
}

/* Evicts the least recently used entry; caller holds the lock. */
static void evict_lru(kiln_function *f) {
  trace_table *t = atomic_load(&f->table);
  uint32_t at = 0;
  cached_trace *lru = NULL;
  for (uint32_t i = 0; t && i < t->cap; i++) {
    cached_trace *e = atomic_load_explicit(&t->slot[i], memory_order_relaxed);
    if (!e || e == TOMBSTONE) continue;
    if (!lru || atomic_load_explicit(&e->last_use, memory_order_relaxed) <
                    atomic_load_explicit(&lru->last_use, memory_order_relaxed))
      lru = e, at = i;
  }
  if (!lru) return;
  atomic_store_explicit(&t->slot[at], TOMBSTONE, memory_order_seq_cst);
  f->live--;
  lru->retired_at = atomic_fetch_add(&ebr_epoch, 1);
  lru->next_retired = f->retired;
  f->retired = lru;
  atomic_store(&f->reclaim, true);
  if (log_retrace()) {
    char what[1024] = "", sig[280];
    size_t used = 0;
    for (int i = 0; i < f->n_in && used < sizeof what; i++)
      used += (size_t)snprintf(what + used, sizeof what - used, "%sarg %d: %s", i ? ", " : "",
                               f->tensor_pos ? f->tensor_pos[i] : i, sig_str(sig, sizeof sig, &lru->args[i]));
    fprintf(stderr, "kiln: retrace @%s: evicted trace %d (%s), the least recently used of %d "
            "(KILN_TRACE_CACHE_MAX=%d)\n", f->name, lru->index, f->n_in ? what : "no inputs", f->max, f->max);
  }
}

/* Adds c as trace number f->made, evicting the LRU entry when the cache is
 * full. Caller holds the lock. 0 / -1. */
static int insert(kiln_function *f, cached_trace *c) {
  trace_table *t = atomic_load(&f->table);
  if (!t || 2 * (f->used + 1) > (int)t->cap) {
    if (table_rebuild(f)) return -1;
    t = atomic_load(&f->table);
  }
  if (log_retrace()) report_retrace(f, c);
  if (f->live >= f->max) evict_lru(f);
  c->index = atomic_load(&f->made);
  uint32_t m = t->cap - 1, i = (uint32_t)c->hash & m;
  for (;;) {
    cached_trace *e = atomic_load_explicit(&t->slot[i], memory_order_relaxed);
    if (!e || e == TOMBSTONE) {
      if (!e) f->used++;
      break;
    }
    i = (i + 1) & m;
  }
  atomic_store_explicit(&t->slot[i], c, memory_order_seq_cst);
  f->live++;
  atomic_fetch_add(&f->made, 1);
  return 0;
}

/* KILN_CHECK_ROUNDTRIP=1 (the test suite sets it): every trace's text must
 * parse back to the same text, so a trace that cannot be replayed from its
 * dump fails loudly where it was made. */
static bool check_roundtrip(void) {
  const char *env = getenv("KILN_CHECK_ROUNDTRIP");
  return env && *env == '1';
}

static int roundtrip(const kiln_function *f, traced_fn *fn) {
  char *text = ir_print_module(fn->module), *again = NULL;
  ir_module *m = text ? ir_parse(text, f->name) : NULL;
  if (m) again = ir_print_module(m);
  int rc = 0;
  if (!again || strcmp(text, again))
    rc = kiln_set_error("function_call: @%s: the traced IR does not round-trip through its text (%s)", f->name,
                        m ? "different text" : kiln_last_error());
  free(text);
  free(again);
  ir_module_free(m);
  return rc;
}

int function_traces(kiln_function *f, function_trace_view **out) {
  trace_table *t = atomic_load(&f->table);
  int n = 0;
  *out = calloc((size_t)f->live + 1, sizeof **out);
  if (!*out) return -1;
  for (uint32_t i = 0; t && i < t->cap; i++) {
    cached_trace *c = atomic_load_explicit(&t->slot[i], memory_order_relaxed);
    if (!c || c == TOMBSTONE || n == f->live) continue;
    function_trace_view *v = &(*out)[n++];
    *v = (function_trace_view){&c->fn, c->index, c->device_scope, c->statics, c->statics_len,
                               malloc((size_t)f->n_in + 1)};
    if (!v->in_device) {
      for (int k = 0; k < n; k++) free((*out)[k].in_device);
      free(*out);
      return -1;
    }
    for (int k = 0; k < f->n_in; k++) v->in_device[k] = c->args[k].device;
  }
  for (int a = 1; a < n; a++) /* by index: few traces, insertion sort */
    for (int b = a; b > 0 && (*out)[b - 1].index > (*out)[b].index; b--) {
      function_trace_view x = (*out)[b];
      (*out)[b] = (*out)[b - 1];
      (*out)[b - 1] = x;
    }
  return n;
}

/* ---- tracing ---- */

/* A failed trace's error names the function: "@name: matmul: ..." unless
 * the message names it already. */
static void name_error(const kiln_function *f) {
  char tag[300];
  int n = snprintf(tag, sizeof tag, "@%s", f->name);
  const char *msg = kiln_last_error();
  for (const char *p = strstr(msg, tag); p && n > 0 && n < (int)sizeof tag; p = strstr(p + 1, tag))
    if (p[n] == ':' || p[n] == ' ' || !p[n]) return;
  char copy[1024];
  snprintf(copy, sizeof copy, "%s", msg);
  kiln_set_error("@%s: %s", f->name, *copy ? copy : "the trace failed without an error");
}

/* What the body's run on trace tr (ended) amounts to: 0 when the trace can
 * be finished, else -1 with the error set and naming f. A read of a traced
 * value fails the trace whatever the body returned; a NULL output does not
 * hide the error that caused it. */
static int body_outcome(kiln_function *f, const trace *tr, int rc, kiln_tensor *const *outs) {
  const char *reader = trace_poisoned(tr);
  if (reader) {
    if (!strstr(kiln_last_error(), "read a traced value")) /* a nested function's says which */
      kiln_set_error("function_call: @%s: %s read a traced value: the tensor is symbolic (being traced) and has "
                     "no value yet; C control flow on it cannot be staged: use kiln_cond / kiln_while_loop "
                     "(or kiln_function_set_eager to run the body op by op)", f->name, reader);
    rc = -1;
  } else if (rc) {
    if (!kiln_has_error()) kiln_set_error("function_call: @%s: the body failed without an error", f->name);
    rc = -1;
  } else {
    for (int k = 0; k < f->n_out && !rc; k++)
      if (!outs[k])
        rc = kiln_has_error() ? -1 : kiln_set_error("function_call: @%s: the body left output %d NULL", f->name, k);
  }
  if (rc) name_error(f);
  return rc;
}

/* State creation (API.md §5): the variables the body created on trace tr
 * become f's (an optimizer's slots are not among them). 0: none were
 * created, or the body failed (its error stands); 1: some were, on the
 * first trace, which must be made again; -1: a later trace created one
 * (the error set). */
static int take_created(kiln_function *f, trace *tr, bool retraced, bool failed) {
  kiln_variable **made;
  int n = trace_take_created(tr, &made);
  if (!n) {
    free(made);
    return 0;
  }
  kiln_variable **all = realloc(f->owned, ((size_t)f->n_owned + (size_t)n) * sizeof *all);
  if (!all) { /* the trace frees what it could not hand over */
    for (int i = 0; i < n; i++) kiln_variable_free(made[i]);
    free(made);
    return kiln_set_error("function_call: out of memory");
  }
  memcpy(all + f->n_owned, made, (size_t)n * sizeof *made);
  f->owned = all;
  f->n_owned += n;
  const char *name = kiln_variable_name(made[0]);
  free(made);
  if (failed) return 0;
  if (!f->settled && !retraced) return 1;
  return kiln_set_error("function_call: @%s: the body created variable '%s' on a later trace; a staged "
                        "function may create variables during its first trace only: create it once (before "
                        "the first call, or on first use: if (!v) v = kiln_variable_new(...))", f->name, name);
}

/* Traces f's body on in's signature (key k, hash h); a cache entry, or NULL
 * with the error set, naming f (the body's own message when it failed).
 * Caller holds the lock. */
static cached_trace *trace_body(kiln_function *f, kiln_tensor *const *in, const packed_key *k, uint64_t h) {
  cached_trace *c = calloc(1, sizeof *c);
  kiln_tensor **sym_in = calloc((size_t)f->n_in + 1, sizeof *sym_in);
  kiln_tensor **outs = calloc((size_t)f->n_out + 1, sizeof *outs);
  if (c) atomic_fetch_add(&live_traces, 1);
  if (!c || !sym_in || !outs || !(c->args = malloc((size_t)(f->n_in + 1) * sizeof *c->args)) ||
      !(c->key = malloc(k->n))) {
    kiln_set_error("function_call: out of memory");
    goto fail;
  }
  for (int i = 0; i < f->n_in; i++) sig_of(in[i], &c->args[i]);
  memcpy(c->key, k->p, k->n);
  c->key_len = k->n;
  c->statics = c->key + (k->statics - k->p);
  c->statics_len = k->statics_len;
  c->device_scope = k->device_scope;
  c->hash = h;
  char saved[1024]; /* a trace starts with no error; the caller's comes back if it succeeds */
  snprintf(saved, sizeof saved, "%s", kiln_last_error());
  kiln_clear_error();
  double t0 = now_ms();
  int rc = -1;
  if (f->saved) rc = saved_trace_fn(f, in, &c->fn); /* a loaded function: its saved IR, not a body */
  for (int attempt = 0; attempt < 2 && !f->saved; attempt++) {
    tape_state paused = tape_pause(); /* a trace records nothing on tapes */
    kiln_scope_push();                 /* the symbolic tensors die with it */
    memset(outs, 0, (size_t)f->n_out * sizeof *outs);
    trace *tr = trace_begin(f->n_in, in, sym_in);
    int again = 0;
    rc = -1;
    if (tr) {
      trace_set_owner(tr, f);
      rc = f->body(f->user, f->n_in, sym_in, f->n_out, outs);
      trace_end(tr);
      rc = body_outcome(f, tr, rc, outs);
      int made = take_created(f, tr, attempt > 0, rc != 0);
      if (made < 0 && !rc) rc = -1;
      again = !rc && made == 1;
      if (rc || again)
        trace_free(tr);
      else
        rc = trace_finish(tr, f->name, f->n_out, outs, &c->fn);
    }
    kiln_scope_pop();
    tape_resume(paused);
    if (!again) break;
  }
  if (!rc && check_roundtrip() && roundtrip(f, &c->fn)) {
    traced_fn_free(&c->fn);
    rc = -1;
  }
  if (rc) {
    name_error(f);
    goto fail;
  }
  if (*saved) kiln_set_error("%s", saved);
  c->trace_ms = now_ms() - t0;
  c->traced_ops = c->fn.func->n_instrs;
  free(sym_in);
  free(outs);
  return c;
fail:
  if (c) {
    free(c->args);
    free(c->key);
    free(c);
    atomic_fetch_sub(&live_traces, 1);
  }
  free(sym_in);
  free(outs);
  return NULL;
}

/* A variable of a trace, in the order calls lock them. */
typedef struct {
  uint64_t id;
  int var;      /* index into fn->vars */
  bool written; /* the call writes it: its lock is held to the end of the call */
} var_ref;

static int by_id(const void *a, const void *b) {
  uint64_t x = ((const var_ref *)a)->id, y = ((const var_ref *)b)->id;
  return (x > y) - (x < y);
}

/* Takes fn's variables' values into vals. Every variable is locked in
 * increasing id, so no two calls wait for each other (a call that reads u
 * and writes v runs beside one that reads v and writes u); the locks of
 * the variables fn writes stay held (see unlock_writes). */
static void acquire_vars(const traced_fn *fn, var_ref *order, kiln_tensor **vals) {
  for (int i = 0; i < fn->n_vars; i++) order[i] = (var_ref){variable_id(fn->vars[i]), i, false};
  for (int w = 0; w < fn->n_writes; w++) order[fn->writes[w]].written = true;
  if (fn->n_vars > 1) qsort(order, (size_t)fn->n_vars, sizeof *order, by_id);
  for (int k = 0; k < fn->n_vars; k++) {
    kiln_variable *v = fn->vars[order[k].var];
    variable_lock(v);
    vals[order[k].var] = kiln_retain(variable_value_locked(v));
    if (!order[k].written) variable_unlock(v);
  }
}

static void unlock_writes(const traced_fn *fn, const var_ref *order) {
  for (int k = fn->n_vars; k-- > 0;)
    if (order[k].written) variable_unlock(fn->vars[order[k].var]);
}

/* Runs a trace: explicit inputs, captures, variables' current values; the
 * IR's random instructions draw fresh blocks of the global stream, in
 * program order, as the eager body would. Variable writes land after.
 * The variables the call writes stay locked from the read of their values
 * to the write of the results (API.md §8): concurrent calls lose no update. */
static int run_trace(const cached_trace *c, int n_in, kiln_tensor *const *in, kiln_tensor **out) {
  const traced_fn *fn = &c->fn;
  int np = fn->func->n_params, nr = fn->func->n_results, rc;
  kiln_tensor *small[16], **args = np + nr <= 16 ? small : malloc((size_t)(np + nr) * sizeof *args);
  var_ref small_o[8], *order = fn->n_vars <= 8 ? small_o : malloc((size_t)fn->n_vars * sizeof *order);
  if (!args || !order) {
    if (args != small) free(args);
    if (order != small_o) free(order);
    return kiln_set_error("function_call: out of memory");
  }
  kiln_tensor **res = args + np;
  for (int i = 0; i < n_in; i++) args[i] = in[i];
  for (int i = 0; i < fn->n_caps; i++) args[n_in + i] = fn->caps[i];
  acquire_vars(fn, order, args + n_in + fn->n_caps);
  /* A variable assigned here whose value nothing else holds (the variable
   * and args[] are its only references, and it is no view) gives its
   * buffer up: the new value may be written over the old in place, as
   * XLA does with donated buffers. Race-free: the variable is locked, and
   * a new reference to its value is only ever taken under its lock. */
  bool small_d[16], *donate = NULL;
  if (fn->n_writes && fn->cpu) {
    donate = np <= 16 ? small_d : calloc((size_t)np, sizeof *donate);
    if (donate) memset(donate, 0, (size_t)np * sizeof *donate);
    for (int w = 0; donate && w < fn->n_writes; w++) {
      const kiln_tensor *t = args[n_in + fn->n_caps + fn->writes[w]];
      donate[n_in + fn->n_caps + fn->writes[w]] = atomic_load(&t->refs) == 2 && !t->base;
    }
  }
  kiln_scope_push(); /* the results, until they are handed out */
  int dev = device_current();
  rc = KILN_UNLIKELY(device_is_remote(dev)) ? remote_call((traced_fn *)fn, dev, args, res)
                                            : jit_exec_donating(fn, args, res, donate);
  if (donate != small_d) free(donate);
  int n_out = nr - fn->n_writes;
  if (!rc) {
    for (int w = 0; w < fn->n_writes; w++)
      variable_set_value_locked(fn->vars[fn->writes[w]], kiln_retain(res[n_out + w]));
    for (int k = 0; k < n_out; k++) kiln_retain(res[k]);
  }
  unlock_writes(fn, order);
  kiln_scope_pop();
  if (!rc)
    for (int k = 0; k < n_out; k++) out[k] = scope_own(res[k]);
  for (int i = 0; i < fn->n_vars; i++) kiln_release(args[n_in + fn->n_caps + i]);
  if (args != small) free(args);
  if (order != small_o) free(order);
  return rc;
}

/* The body run op by op on in: eagerly, or inlined into the trace that is
 * recording (kiln_function_set_eager, or a tape watches an input). */
int function_run_body(kiln_function *f, kiln_tensor *const *in, kiln_tensor **out) {
  const char *who = "function_call";
  kiln_tensor **o = calloc((size_t)f->n_out + 1, sizeof *o);
  if (!o) return kiln_set_error("%s: out of memory", who);
  char saved[1024]; /* the body starts with no error; the caller's comes back if it succeeds */
  snprintf(saved, sizeof saved, "%s", kiln_last_error());
  kiln_clear_error();
  int rc = f->body(f->user, f->n_in, in, f->n_out, o);
  if (rc && !kiln_has_error()) kiln_set_error("%s: @%s: the body failed without an error", who, f->name);
  for (int i = 0; i < f->n_out && !rc; i++) /* a NULL output keeps the error that caused it */
    if (!o[i]) rc = kiln_has_error() ? -1 : kiln_set_error("%s: @%s: the body left output %d NULL", who, f->name, i);
  if (!rc) memcpy(out, o, (size_t)f->n_out * sizeof *o);
  if (!rc && *saved) kiln_set_error("%s", saved);
  free(o);
  return rc;
}

/* KILN_DUMP: the module after each pass */
typedef struct {
  const char *name;
  int trace;
  bool failed;
  traced_fn *fn;
} dump_ctx;

static void dump_step(void *ctx, int step, const char *pass, const ir_func *g) {
  (void)g; /* the whole optimized module is printed */
  dump_ctx *d = ctx;
  if (d->failed || !getenv("KILN_DUMP")) return;
  char *text = traced_fn_print_optimized(d->fn);
  d->failed = jit_dump(d->name, d->trace, step, pass, text) != 0;
  free(text);
}

/* The optimized copy of a new trace: the default pipeline (the inference
 * one, kiln_function_set_optimize_for_inference) over every
 * function of a copy of the traced module (callees first, as printed).
 * *step: the next dump step, *dump_no: the trace number to dump as (-1:
 * none). */
static int optimize_only(kiln_function *f, traced_fn *fn, int trace_no, int *step, int *dump_no) {
  dump_ctx d = {f->name, trace_no, trace_no < 0, fn}; /* trace_no < 0: no dump */
  if (!d.failed && getenv("KILN_DUMP")) {
    char *text = traced_fn_print(fn);
    d.failed = jit_dump(f->name, trace_no, 0, "traced", text) != 0;
    free(text);
  }
  double t0 = now_ms();
  if (!(fn->opt_module = ir_module_clone(fn->module))) return -1;
  fn->opt_func = ir_module_find(fn->opt_module, fn->func->name);
  pass_report rep;
  int rc = 0;
  const char *pipeline = atomic_load(&f->inference) ? PASS_INFERENCE_PIPELINE : PASS_DEFAULT_PIPELINE;
  for (int i = 0; i < fn->opt_module->n_funcs && !rc; i++) {
    ir_func *g = fn->opt_module->funcs[i];
    rc = pass_run_pipeline(g, pipeline, &rep, g == fn->opt_func ? dump_step : NULL, &d);
  }
  fn->optimize_ms = now_ms() - t0;
  if (rc) {
    char msg[1024];
    snprintf(msg, sizeof msg, "%s", kiln_last_error());
    return kiln_set_error("function_call: @%s: optimizing: %s", f->name, msg);
  }
  if (!d.failed && getenv("KILN_DUMP")) {
    char *text = traced_fn_print_optimized(fn);
    jit_dump(f->name, trace_no, rep.n + 1, "optimized", text);
    free(text);
  }
  *step = rep.n + 2, *dump_no = d.failed ? -1 : trace_no;
  return 0;
}

int function_optimize(kiln_function *f, traced_fn *fn) {
  int step, dump_no;
  return optimize_only(f, fn, -1, &step, &dump_no);
}

/* optimize_only, then the backend's code (jit_compile) */
static int optimize(kiln_function *f, traced_fn *fn, int trace_no) {
  int step, dump_no;
  if (optimize_only(f, fn, trace_no, &step, &dump_no)) return -1;
  return jit_compile(fn, f->name, dump_no, step);
}

int jit_prepare(traced_fn *fn, const char *name) {
  kiln_function f;
  memset(&f, 0, sizeof f);
  f.name = (char *)name;
  atomic_init(&f.inference, false);
  return optimize(&f, fn, -1);
}

/* The cache entry for in's signature (and the call's static arguments),
 * traced on a miss; the caller has entered (ebr_enter) and keeps the entry
 * only until it exits. NULL with the error set. */
static cached_trace *get_trace(kiln_function *f, kiln_tensor *const *in) {
  packed_key k;
  if (pack_key(&k, f, in)) return NULL;
  uint64_t h = hash_bytes(k.p, k.n);
  cached_trace *c = lookup(f, &k, h);
  if (KILN_UNLIKELY(!c)) {
    if (trace_owned_by(f)) {
      kiln_set_error("function_call: @%s calls itself while being traced (recursion cannot be staged)", f->name);
      packed_free(&k);
      return NULL;
    }
    pthread_mutex_lock(&f->lock);
    if (!(c = lookup(f, &k, h)) && (c = trace_body(f, in, &k, h))) {
      if (optimize(f, &c->fn, atomic_load(&f->made)) || insert(f, c)) {
        entry_free(c);
        c = NULL;
      } else {
        f->settled = true;
      }
    }
    if (c) touch(f, c);
    if (f->retired || f->retired_tables) reclaim(f);
    pthread_mutex_unlock(&f->lock);
  } else {
    touch(f, c);
  }
  packed_free(&k);
  return c;
}

int function_run_staged(kiln_function *f, kiln_tensor *const *in, kiln_tensor **out) {
  if (!ebr_enter()) return kiln_set_error("function_call: out of memory");
  cached_trace *c = get_trace(f, in);
  int rc = c ? run_trace(c, f->n_in, in, out) : -1;
  ebr_exit(f);
  return rc;
}

/* ---- calls a tape watches (struct taped_trace above) ---- */

static bool float_dtype(const kiln_tensor *t) { return t->dtype == KILN_F32 || t->dtype == KILN_F64; }

/* Traces the forward and backward traces of a taped call; NULL with the
 * error set, or with *again set where the body created variables on the
 * function's first trace (then it is traced again). Caller holds f->lock. */
static taped_trace *trace_taped(kiln_function *f, kiln_tensor *const *in, const packed_key *key, uint64_t hash,
                                bool retraced, bool *again) {
  const char *who = "function_call";
  int n_in = f->n_in, n_out = f->n_out;
  taped_trace *t = calloc(1, sizeof *t);
  kiln_tensor **sym_in = calloc((size_t)n_in + 1, sizeof *sym_in), **outs = calloc((size_t)n_out + 1, sizeof *outs);
  kiln_tensor **grads = calloc((size_t)n_in + 1, sizeof *grads);
  int *extras = NULL, n_extras = 0, rc = -1;
  if (t) {
    atomic_fetch_add(&live_traces, 1);
    atomic_init(&t->refs, 1);
    t->n_out = n_out;
    t->key = malloc(key->n);
    t->bwd = calloc((size_t)n_out + 1, sizeof *t->bwd);
    t->res_idx = calloc((size_t)n_out + 1, sizeof *t->res_idx);
    t->slots = calloc((size_t)n_out + 1, sizeof *t->slots);
  }
  if (!t || !sym_in || !outs || !grads || !t->key || !t->bwd || !t->res_idx || !t->slots) {
    kiln_set_error("%s: out of memory", who);
    free(sym_in), free(outs), free(grads);
    taped_free(t);
    return NULL;
  }
  memcpy(t->key, key->p, key->n);
  t->key_len = key->n;
  t->statics_off = (size_t)(key->statics - key->p);
  t->statics_len = key->statics_len;
  t->hash = hash;
  char saved_error[1024]; /* a trace starts with no error; the caller's comes back if it succeeds */
  snprintf(saved_error, sizeof saved_error, "%s", kiln_last_error());
  kiln_clear_error();
  tape_state saved = tape_pause();
  kiln_scope_push();
  kiln_tape *tape = NULL;
  trace *fwd = trace_begin(n_in, in, sym_in);
  if (fwd) {
    trace_set_owner(fwd, f);
    tape = kiln_tape_begin(true);
    for (int i = 0; i < n_in; i++)
      if (float_dtype(sym_in[i])) kiln_tape_watch(tape, sym_in[i]);
    rc = f->body(f->user, n_in, sym_in, n_out, outs);
    kiln_tape_end(tape);
    trace_end(fwd);
    rc = body_outcome(f, fwd, rc, outs);
    int made = take_created(f, fwd, retraced, rc != 0);
    if (made < 0 && !rc) rc = -1;
    if (!rc && made == 1) *again = true, rc = -1; /* no error: traced again */
  }
  for (int k = 0; k < n_out && !rc; k++) {
    t->slots[k] = (taped_slot){f, t, k};
    if (!float_dtype(outs[k])) continue;
    kiln_tensor *dy = NULL;
    trace *bwd = trace_begin(1, &outs[k], &dy);
    if (!bwd) {
      rc = -1;
      break;
    }
    trace_set_forward(bwd, fwd);
    trace_set_owner(bwd, f);
    rc = tape_gradient_seeded(tape, outs[k], dy, n_in, sym_in, grads);
    for (int i = 0; i < n_in && !rc; i++)
      if (!grads[i] && !(grads[i] = kiln_zeros((kiln_dtype)in[i]->dtype, in[i]->rank, in[i]->shape))) rc = -1;
    trace_end(bwd);
    const int *nodes;
    int nr = trace_residuals(bwd, &nodes);
    if (!rc && !(t->res_idx[k] = malloc(((size_t)nr + 1) * sizeof **t->res_idx))) rc = kiln_set_error("%s: out of memory", who);
    for (int j = 0; j < nr && !rc; j++) { /* the union of every backward's residuals */
      int e = 0;
      while (e < n_extras && extras[e] != nodes[j]) e++;
      if (e == n_extras) {
        int *q = realloc(extras, ((size_t)n_extras + 1) * sizeof *q);
        if (!q) {
          rc = kiln_set_error("%s: out of memory", who);
          break;
        }
        extras = q;
        extras[n_extras++] = nodes[j];
      }
      t->res_idx[k][j] = e;
    }
    char name[160];
    snprintf(name, sizeof name, "%s.grad%d", f->name, k);
    if (rc)
      trace_free(bwd);
    else
      rc = trace_finish(bwd, name, n_in, grads, &t->bwd[k]);
    if (!rc && (t->bwd[k].n_vars || t->bwd[k].n_writes))
      rc = kiln_set_error("%s: @%s: its gradient reads variables; gradients through a staged call reach its "
                          "explicit inputs only (pass the variable's value as an input)", who, f->name);
  }
  if (tape) kiln_tape_free(tape);
  if (fwd) {
    if (rc)
      trace_free(fwd);
    else
      rc = trace_finish_ex(fwd, f->name, n_out, outs, n_extras, extras, &t->fwd);
  }
  kiln_scope_pop();
  tape_resume(saved);
  if (!rc && (t->fwd.n_vars || t->fwd.n_writes))
    rc = kiln_set_error("%s: @%s: reads or assigns variables while a gradient tape watches its inputs; "
                        "gradients through staged calls reach their explicit inputs only (pass the "
                        "variable's value as an input, or kiln_function_set_eager)", who, f->name);
  if (!rc) rc = optimize(f, &t->fwd, -1);
  for (int k = 0; k < n_out && !rc; k++)
    if (t->bwd[k].func) rc = optimize(f, &t->bwd[k], -1);
  free(extras);
  free(sym_in);
  free(outs);
  free(grads);
  if (rc) {
    if (!*again) name_error(f);
    taped_free(t);
    return NULL;
  }
  if (*saved_error) kiln_set_error("%s", saved_error);
  return t;
}

/* Unlinks the least recently used taped trace and retires it; caller
 * holds the lock. */
static void evict_taped(kiln_function *f) {
  _Atomic(taped_trace *) *at = NULL;
  taped_trace *lru = NULL;
  for (_Atomic(taped_trace *) *p = &f->taped; atomic_load(p); p = &atomic_load(p)->next) {
    taped_trace *t = atomic_load(p);
    if (!lru || atomic_load_explicit(&t->last_use, memory_order_relaxed) <
                    atomic_load_explicit(&lru->last_use, memory_order_relaxed))
      lru = t, at = p;
  }
  if (!lru) return;
  atomic_store(at, atomic_load(&lru->next)); /* a reader on lru still finds its next */
  f->n_taped--;
  lru->retired_at = atomic_fetch_add(&ebr_epoch, 1);
  lru->next_retired = f->retired_taped;
  f->retired_taped = lru;
  atomic_store(&f->reclaim, true);
  if (log_retrace())
    fprintf(stderr, "kiln: retrace @%s: evicted a taped trace, the least recently used of %d "
            "(KILN_TRACE_CACHE_MAX=%d)\n", f->name, f->max, f->max);
}

/* The taped trace for in's signature, traced on a miss. The caller is
 * inside ebr_enter. */
static taped_trace *get_taped(kiln_function *f, kiln_tensor *const *in) {
  packed_key k;
  if (pack_key(&k, f, in)) return NULL;
  uint64_t h = hash_bytes(k.p, k.n);
  taped_trace *t = NULL;
  for (int pass = 0; pass < 2 && !t; pass++) {
    if (pass) pthread_mutex_lock(&f->lock);
    for (t = atomic_load(&f->taped); t; t = atomic_load(&t->next))
      if (t->hash == h && t->key_len == k.n && !memcmp(t->key, k.p, k.n)) break;
    if (pass && !t) {
      bool again = false;
      t = trace_taped(f, in, &k, h, false, &again);
      if (!t && again) t = trace_taped(f, in, &k, h, true, &again);
      if (t) {
        f->settled = true;
        if (f->n_taped >= f->max) evict_taped(f);
        atomic_store(&t->next, atomic_load(&f->taped));
        atomic_store(&f->taped, t);
        f->n_taped++;
      }
    }
    if (pass) pthread_mutex_unlock(&f->lock);
  }
  if (t) atomic_store_explicit(&t->last_use, atomic_fetch_add_explicit(&f->tick, 1, memory_order_relaxed) + 1,
                               memory_order_relaxed);
  packed_free(&k);
  return t;
}

/* A tape node of a taped call holds its trace and its function. */
static void slot_retain(void *user) {
  taped_slot *s = user;
  atomic_fetch_add_explicit(&s->t->refs, 1, memory_order_relaxed);
  atomic_fetch_add_explicit(&s->f->refs, 1, memory_order_relaxed);
}
static void slot_release(void *user) {
  taped_slot *s = user;
  kiln_function *f = s->f;
  taped_release(s->t);
  function_release(f);
}
static const tape_closure slot_closure = {slot_retain, slot_release, "function_call"};

static _Thread_local kiln_tensor *pending_y;

static kiln_tensor *forward_done(void *user, int n, kiln_tensor *const *xs) {
  (void)user, (void)n, (void)xs;
  return pending_y;
}

/* The backward of output k: the staged backward trace with the residuals
 * the forward saved; where a tape records the gradient itself (higher
 * order), the differentiable staged VJP (grad.c) instead. */
static int backward(void *user, int n, kiln_tensor *const *xs, kiln_tensor *y, kiln_tensor *dy, kiln_tensor **dxs) {
  (void)y;
  taped_slot *s = user;
  kiln_function *f = s->f;
  int n_in = f->n_in;
  for (int i = n_in; i < n; i++) dxs[i] = NULL; /* residuals: no gradient */
  if (tape_active_count) { /* with the static arguments of the forward call */
    call_key saved = current_key;
    if (f->key_of) current_key = (call_key){f->key_of, s->t->key + s->t->statics_off, s->t->statics_len};
    int rc = grad_recompute_vjp(f, s->k, xs, dy, dxs);
    current_key = saved;
    return rc;
  }
  const traced_fn *b = &s->t->bwd[s->k];
  int np = b->opt_func->n_params;
  kiln_tensor *small[16], **args = np <= 16 ? small : malloc((size_t)np * sizeof *args);
  if (!args) return kiln_set_error("function_call: out of memory");
  args[0] = dy;
  for (int i = 0; i < b->n_caps; i++) args[1 + i] = b->caps[i];
  for (int j = 0; j < b->n_residuals; j++) args[1 + b->n_caps + j] = xs[n_in + j];
  int rc = jit_exec(b, args, dxs);
  for (int i = 0; i < n_in && !rc; i++)
    if (!float_dtype(xs[i])) dxs[i] = NULL;
  if (args != small) free(args);
  return rc;
}

int function_call_taped(kiln_function *f, kiln_tensor *const *in, kiln_tensor **out) {
  taped_trace *t = get_taped(f, in);
  if (!t) return -1;
  const traced_fn *fw = &t->fwd;
  int np = fw->opt_func->n_params, nr = fw->opt_func->n_results, n_in = f->n_in, rc;
  kiln_tensor **args = malloc(((size_t)np + nr + n_in + nr + 1) * sizeof *args);
  if (!args) return kiln_set_error("function_call: out of memory");
  kiln_tensor **res = args + np, **xs = res + nr;
  for (int i = 0; i < n_in; i++) args[i] = in[i];
  for (int i = 0; i < fw->n_caps; i++) args[n_in + i] = fw->caps[i];
  tape_state saved = tape_pause();
  rc = jit_exec(fw, args, res);
  tape_resume(saved);
  kiln_tensor **extras = res + f->n_out;
  for (int k = 0; k < f->n_out && !rc; k++) {
    if (!t->bwd[k].func) {
      out[k] = res[k];
      continue;
    }
    for (int i = 0; i < n_in; i++) xs[i] = in[i];
    for (int j = 0; j < t->bwd[k].n_residuals; j++) xs[n_in + j] = extras[t->res_idx[k][j]];
    pending_y = res[k];
    out[k] = tape_custom_gradient(forward_done, backward, &t->slots[k], &slot_closure, n_in + t->bwd[k].n_residuals, xs);
    pending_y = NULL;
    if (!out[k]) rc = -1;
  }
  free(args);
  return rc;
}

int kiln_function_call(kiln_function *f, kiln_tensor *const *in, kiln_tensor **out) {
  const char *who = "function_call";
  if (!f) return kiln_set_error("%s: function is NULL", who);
  if (f->n_in && !in) return kiln_set_error("%s: @%s: in is NULL for %d inputs", who, f->name, f->n_in);
  if (f->n_out && !out) return kiln_set_error("%s: @%s: out is NULL for %d outputs", who, f->name, f->n_out);
  for (int i = 0; i < f->n_in; i++) {
    if (!in[i]) return kiln_has_error() ? -1 : kiln_set_error("%s: @%s: input %d is NULL", who, f->name, i);
    if ((in[i]->flags & TF_SYMBOLIC) && !trace_current)
      return kiln_set_error("%s: @%s: input %d is a symbolic tensor that escaped a staged function's body",
                            who, f->name, i);
  }
  bool taped = false;
  if (KILN_UNLIKELY(tape_active_count))
    for (int i = 0; i < f->n_in && !taped; i++) taped = tape_tracks(in[i]);
  if (atomic_load(&f->eager)) return function_run_body(f, in, out);
  if (!ebr_enter()) return kiln_set_error("%s: out of memory", who);
  int rc = -1;
  if (trace_current) {
    /* inside another body: a call instruction; inlined where a tape of that
     * body watches an input, so that the tape sees the ops */
    if (taped || KILN_UNLIKELY(tape_active_count)) {
      rc = function_run_body(f, in, out);
    } else {
      cached_trace *c = get_trace(f, in);
      rc = c ? trace_call(&c->fn, f->n_in, in, out) : -1;
    }
  } else if (KILN_UNLIKELY(taped)) {
    rc = function_call_taped(f, in, out);
  } else {
    cached_trace *c = get_trace(f, in);
    rc = c ? 0 : -1;
    if (c && KILN_UNLIKELY(tape_active_count))
      for (int i = 0; i < c->fn.n_vars && !rc; i++) {
        const kiln_tensor *v = variable_type(c->fn.vars[i]);
        if (v->dtype == KILN_F32 || v->dtype == KILN_F64)
          rc = kiln_set_error("%s: @%s: reads variable '%s' while a gradient tape is active; gradients "
                              "through staged functions reach their explicit inputs only (pass the "
                              "variable's value as an input, or kiln_function_set_eager)", who, f->name,
                              kiln_variable_name(c->fn.vars[i]));
      }
    if (!rc) rc = run_trace(c, f->n_in, in, out);
  }
  ebr_exit(f);
  return rc;
}

/* Trace number trace (kiln_function_ir, kiln_function_stats); caller
 * holds the lock. NULL with the error set: never made, or evicted. */
static const cached_trace *trace_at(const char *who, kiln_function *f, int trace) {
  int n = atomic_load(&f->made);
  if (trace < 0 || trace >= n) {
    kiln_set_error("%s: @%s: trace %d does not exist (%d made so far)", who, f->name, trace, n);
    return NULL;
  }
  trace_table *t = atomic_load(&f->table);
  for (uint32_t i = 0; t && i < t->cap; i++) {
    cached_trace *c = atomic_load_explicit(&t->slot[i], memory_order_relaxed);
    if (c && c != TOMBSTONE && c->index == trace) return c;
  }
  kiln_set_error("%s: @%s: trace %d was evicted from the trace cache (it keeps the %d most recently used: "
                 "KILN_TRACE_CACHE_MAX)", who, f->name, trace, f->max);
  return NULL;
}

char *kiln_function_ir(kiln_function *f, int trace, const char *stage) {
  const char *who = "function_ir";
  if (!f || !stage) {
    kiln_set_error("%s: %s is NULL", who, f ? "stage" : "function");
    return NULL;
  }
  bool ir = !strcmp(stage, "traced") || !strcmp(stage, "optimized");
  bool mlir = !strcmp(stage, "mlir");
  if (!ir && !mlir && strcmp(stage, "llvm") && strcmp(stage, "asm") && strcmp(stage, "ptx")) {
    kiln_set_error("%s: unknown stage '%s' (traced, optimized, llvm, asm, ptx, mlir)", who, stage);
    return NULL;
  }
  pthread_mutex_lock(&f->lock);
  cached_trace *c = (cached_trace *)trace_at(who, f, trace);
  char *text = !c                         ? NULL
               : !strcmp(stage, "traced") ? traced_fn_print(&c->fn)
               : ir                       ? traced_fn_print_optimized(&c->fn)
               : mlir                     ? jit_mlir_text(&c->fn, f->name)
                                          : jit_stage_text(&c->fn, f->name, stage);
  pthread_mutex_unlock(&f->lock);
  if (c && ir && !text) kiln_set_error("%s: out of memory", who);
  return text;
}

int kiln_function_stats(kiln_function *f, int trace, kiln_stats *out) {
  const char *who = "function_stats";
  if (!f || !out) return kiln_set_error("%s: %s is NULL", who, f ? "out" : "function");
  pthread_mutex_lock(&f->lock);
  const cached_trace *c = trace_at(who, f, trace);
  if (c) {
    memset(out, 0, sizeof *out);
    out->traced_ops = c->traced_ops;
    out->optimized_ops = c->fn.opt_func->n_instrs;
    for (int i = 0; i < c->fn.opt_func->n_instrs; i++) { /* a kernel: each fusion and each unfused op */
      const ir_instr *in = &c->fn.opt_func->instrs[i];
      if (in->op == OP_CONSTANT) continue;
      out->kernels++;
      if (in->op == OP_FUSION) out->fused_ops += in->attrs.callee->n_instrs;
    }
    pass_buffer_stats bs;
    if (pass_buffer_stats_of(c->fn.opt_func, &bs) == 0) {
      out->kernels = bs.kernels;
      out->peak_bytes = (size_t)bs.peak_bytes;
      out->unshared_bytes = (size_t)bs.unshared_bytes;
    } else {
      kiln_clear_error();
    }
    out->trace_ms = c->trace_ms;
    out->optimize_ms = c->fn.optimize_ms;
    out->compile_ms = c->fn.compile_ms;
  }
  pthread_mutex_unlock(&f->lock);
  return c ? 0 : -1;
}

const ir_func *jit_optimized_func(kiln_function *f, int trace) {
  if (!f) return NULL;
  pthread_mutex_lock(&f->lock);
  const cached_trace *c = trace_at("function_stats", f, trace);
  pthread_mutex_unlock(&f->lock);
  return c ? c->fn.opt_func : NULL;
}
