/* function.h — kiln_function's insides, shared by function.c (the trace
 * cache and calls) and grad.c (gradients of and through staged functions).
 * Internal. */
#ifndef KILN_FUNCTION_H
#define KILN_FUNCTION_H

#include <pthread.h>

#include "jit.h"

typedef struct vjp_slot vjp_slot;
typedef struct cached_trace cached_trace;
typedef struct taped_trace taped_trace;
/* the user of a taped call's tape node: output k of f's taped trace t */
typedef struct taped_slot {
  kiln_function *f;
  taped_trace *t;
  int k;
} taped_slot;

typedef struct trace_table trace_table;

struct kiln_function {
  char *name;
  kiln_body_fn body;
  void *user;
  int n_in, n_out;
  atomic_bool eager;
  atomic_bool inference; /* kiln_function_set_optimize_for_inference: PASS_INFERENCE_PIPELINE */
  pthread_mutex_t lock; /* serialises tracing, adding and evicting traces */
  /* The trace cache (function.c): a hash table read without the lock;
   * evicted entries and replaced tables are retired, and freed once no
   * call that may still see them is running. */
  _Atomic(trace_table *) table;
  int live, used;            /* entries; entries + tombstones (under the lock) */
  int max;                   /* KILN_TRACE_CACHE_MAX when the function was made */
  atomic_int made;           /* traces made so far: kiln_function_trace_count */
  _Atomic uint64_t tick;     /* the LRU clock: a call stamps its trace with it */
  cached_trace *retired;     /* evicted, not yet freed (under the lock) */
  trace_table *retired_tables;
  atomic_bool reclaim;       /* something retired waits to be freed */
  bool settled;              /* a trace succeeded: no more variables may be created */
  kiln_variable **owned;     /* variables its bodies created (state creation): freed with it */
  int n_owned;
  /* Static arguments (kiln_jit): the key bytes of function_call_keyed for
   * key_of are part of this function's trace key. */
  const kiln_function *key_of;
  char *static_letters;      /* their letters (i l d b p), 8 key bytes each, or NULL */
  int *tensor_pos, *static_pos; /* C argument positions, for KILN_LOG=retrace */
  vjp_slot *vjps; /* per output: the staged backward function (grad.c), made on first use */
  /* Traces for calls a tape watches: a list read without the lock, added
   * to and evicted from under it (LRU, at most max); an evicted one is
   * retired as cache entries are, and lives on while tape nodes hold it. */
  _Atomic(taped_trace *) taped;
  int n_taped;
  taped_trace *retired_taped;
  /* Held by the user (kiln_function_free drops it) and by each tape node of
   * a taped call, so that a tape can outlive the function's handle. */
  atomic_int refs;
  void (*user_free)(void *user); /* run with user when the last hold goes (kiln_jit's closure) */
  /* kiln_function_load: its traces come from a saved directory (load.c),
   * never from tracing body; freed through user_free (it is user). */
  struct saved_fn *saved;
};

/* fn's optimized copy (opt_module, opt_func) as f's calls make it, without
 * the backend's code: kiln-aot's (jit/aot.c). 0, or -1 with the error set. */
int function_optimize(kiln_function *f, traced_fn *fn);

/* A trace of f's cache as save.c sees it (function_traces). */
typedef struct {
  traced_fn *fn;
  int index;             /* kiln_function_ir's number */
  int device_scope;
  const uint8_t *statics; /* the static arguments' key bytes (8 each) */
  size_t statics_len;
  uint8_t *in_device;     /* each input's device */
} function_trace_view;
/* The traces in f's cache in the order they were made (malloc'd, the
 * devices with them: free each in_device and the array); their count, -1
 * on out of memory. Caller holds f->lock, which keeps them alive. */
int function_traces(kiln_function *f, function_trace_view **out);

/* kiln_function_call with key (len bytes) as static arguments of f: part
 * of the trace key of f and of every function whose key_of is f; the body
 * reads it back with function_body_key. */
int function_call_keyed(kiln_function *f, kiln_tensor *const *in, kiln_tensor **out, const void *key, size_t len);
/* The static key of the call of f (or of a function keyed on f) running on
 * this thread, or NULL. */
const void *function_body_key(const kiln_function *f, size_t *len);
/* kiln_jit: names the static arguments (letters, 8 key bytes each) and the C
 * argument positions of the tensors and statics, for KILN_LOG=retrace. 0 / -1. */
int function_set_statics(kiln_function *f, const char *letters, const int *tensor_pos, const int *static_pos);

/* A static argument's value (its letter, its 8 key bytes) as text: "3",
 * "2.5", "true", "0x..." (KILN_LOG=retrace, saved manifests). */
void function_static_str(char *buf, size_t n, char letter, const uint8_t *p);

/* The body run op by op (eagerly, or inlined into the recording trace). */
int function_run_body(kiln_function *f, kiln_tensor *const *in, kiln_tensor **out);
/* The staged path: the trace for in's signature (traced on a miss), run. */
int function_run_staged(kiln_function *f, kiln_tensor *const *in, kiln_tensor **out);
/* A call whose input a tape watches: the staged forward (which also returns
 * the residuals), and for each float output one tape node whose backward is
 * a staged backward trace. */
int function_call_taped(kiln_function *f, kiln_tensor *const *in, kiln_tensor **out);
/* grad.c: d(sum(y_k * dy))/d(xs) by the staged VJP function of output k,
 * which recomputes the forward (differentiable again, for higher orders). */
int grad_recompute_vjp(kiln_function *f, int k, kiln_tensor *const *xs, kiln_tensor *dy, kiln_tensor **dxs);
void function_free_gradients(kiln_function *f);

/* load.c: the traced function of f's saved trace for in's signature (f
 * loaded, f->saved set), as trace_body would make it; 0, or -1 with the
 * error listing the saved signatures. */
int saved_trace_fn(kiln_function *f, kiln_tensor *const *in, traced_fn *fn);

#endif
