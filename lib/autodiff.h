/* autodiff.h — gradient tapes (tape.c), gradient rules (gradients.c) and
 * variables (variable.c). Internal. The eager front end calls tape_record
 * after every op while a tape is active: one thread-local test otherwise. */
#ifndef KILN_AUTODIFF_H
#define KILN_AUTODIFF_H

#include "ops.h"

/* Active, unpaused tapes on this thread (0 = record nothing). */
extern _Thread_local int tape_active_count KILN_TLS_FAST;

/* Records op(in) -> out on every active tape that tracks one of the inputs. */
void tape_record(op_id op, const op_attrs *attrs, int n, kiln_tensor *const *in, kiln_tensor *out);
/* Makes every tape of this thread stop recording until tape_resume. */
typedef struct {
  kiln_tape *innermost;
  int count;
} tape_state;
tape_state tape_pause(void);
/* Does an active tape of this thread track t? (staged calls refuse them) */
bool tape_tracks(const kiln_tensor *t);
void tape_resume(tape_state saved);
/* Every active tape watches t; variable reads remember (var, t). */
void tape_watch_variable_read(kiln_variable *var, kiln_tensor *t);
/* kiln_tape_gradient with dy (target's shape) as the target's gradient in
 * place of ones: the vector-Jacobian product dy^T d(target)/d(sources). */
int tape_gradient_seeded(kiln_tape *tape, kiln_tensor *target, kiln_tensor *dy, int n, kiln_tensor *const *sources,
                         kiln_tensor **grads);

/* Records a node out = f(in) whose gradient is grad (a kiln_custom_gradient
 * rule) on every active tape that tracks one of in. With a closure, each
 * node holds a reference to user (closure->retain) and drops it when the
 * tape frees its nodes (closure->release); what names the node in errors.
 * 0 / -1 (out of memory). */
typedef struct tape_closure {
  void (*retain)(void *user);
  void (*release)(void *user);
  const char *what;
} tape_closure;
int tape_record_custom(int n, kiln_tensor *const *in, kiln_tensor *out, kiln_gradient_fn grad, void *user,
                       const tape_closure *closure);
/* kiln_custom_gradient whose tape nodes hold user through closure (NULL:
 * not owned, as kiln_custom_gradient). */
kiln_tensor *tape_custom_gradient(kiln_forward_fn fwd, kiln_gradient_fn grad, void *user, const tape_closure *closure,
                                  int n, kiln_tensor *const *xs);

/* The inputs of the node of the only active tape whose result is out,
 * among its last TAPE_RECENT nodes, when it applied op (OP_COUNT: the custom
 * gradient custom): their count, *in pointing at them (the tape holds them);
 * -1 when there is no such node, or more or fewer than one active tape. */
enum { TAPE_RECENT = 8 };
int tape_recent(const kiln_tensor *out, op_id op, kiln_gradient_fn custom, kiln_tensor *const **in);
/* Is t a source of the gradient that this thread's tape walk computes
 * (asked by a custom gradient during the walk)? */
bool tape_walk_source(const kiln_tensor *t);
/* ---- gradient rules (gradients.c) ----
 * A rule computes, with public ops, the gradient of each input from dout
 * (the gradient of out, with out's shape and dtype). It writes dx[i] (NULL
 * = no gradient) with exactly in[i]'s shape; returns 0 or -1. */
typedef struct grad_args {
  op_id op;
  const op_attrs *attrs;
  int n;
  kiln_tensor *const *in;
  kiln_tensor *out;
  kiln_tensor *dout;
  kiln_tensor **dx;
  const bool *need; /* need[i]: some source is reached through in[i]; else dx[i] may stay NULL */
} grad_args;
typedef int (*grad_fn)(const grad_args *g);
/* NULL for ops whose results carry no gradient (comparisons, argmax, ...). */
extern const grad_fn kiln_grads[OP_COUNT];

/* Sums g over the axes that broadcasting added or stretched so the result
 * has like's shape. */
kiln_tensor *grad_unbroadcast(kiln_tensor *g, const kiln_tensor *like);

#endif
