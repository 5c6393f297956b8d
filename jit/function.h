/* function.h — kiln_function's insides, shared by function.c (the trace
 * cache and calls) and grad.c (gradients of and through staged functions).
 * Internal. */
#ifndef KILN_FUNCTION_H
#define KILN_FUNCTION_H

#include <pthread.h>

#include "jit.h"

typedef struct vjp_slot vjp_slot;
typedef struct cached_trace cached_trace;

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
};

/* The body run op by op (eagerly, or inlined into the recording trace). */
int function_run_body(kiln_function *f, kiln_tensor *const *in, kiln_tensor **out);
/* The staged path: the trace for in's signature (traced on a miss), run. */
int function_run_staged(kiln_function *f, kiln_tensor *const *in, kiln_tensor **out);
/* A call whose input a tape watches (grad.c): the staged forward, and for
 * each float output one tape node whose backward is a staged function. */
int function_call_taped(kiln_function *f, kiln_tensor *const *in, kiln_tensor **out);
void function_free_gradients(kiln_function *f);

#endif
