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

/* The traces as callers see them without the lock: an immutable array,
 * replaced (not changed) when a trace is added; the old ones are kept until
 * kiln_function_free, since a caller may still be reading one. */
typedef struct snapshot {
  struct snapshot *older;
  int n;
  cached_trace *items[];
} snapshot;

struct kiln_function {
  char *name;
  kiln_body_fn body;
  void *user;
  int n_in, n_out;
  atomic_bool eager;
  pthread_mutex_t lock; /* serialises tracing and adding traces */
  _Atomic(snapshot *) traces; /* NULL until the first trace */
  vjp_slot *vjps; /* per output: the staged backward function (grad.c), made on first use */
  _Atomic(taped_trace *) taped; /* traces for calls a tape watches: a list, added under the lock */
};

/* The body run op by op (eagerly, or inlined into the recording trace). */
int function_run_body(kiln_function *f, kiln_tensor *const *in, kiln_tensor **out);
/* The staged path: the trace for in's signature (traced on a miss), run. */
int function_run_staged(kiln_function *f, kiln_tensor *const *in, kiln_tensor **out);
/* A call whose input a tape watches: the staged forward (which also returns
 * the residuals), and for each float output one tape node whose backward is
 * a staged backward trace. */
int function_call_taped(kiln_function *f, kiln_tensor *const *in, kiln_tensor **out);
void function_free_taped(kiln_function *f);
/* grad.c: d(sum(y_k * dy))/d(xs) by the staged VJP function of output k,
 * which recomputes the forward (differentiable again, for higher orders). */
int grad_recompute_vjp(kiln_function *f, int k, kiln_tensor *const *xs, kiln_tensor *dy, kiln_tensor **dxs);
void function_free_gradients(kiln_function *f);

#endif
