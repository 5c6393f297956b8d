/* overlap.c — staged collectives overlapping the kernels that do not
 * depend on them (issue 18): the call step of a collective (all_reduce,
 * all_gather, reduce_scatter, broadcast_from) starts it on the process's
 * communication thread (lib/dist_async.c) and a wait step (PLAN_STEP_WAIT)
 * is placed just before the first later step of the same list that reads
 * its output's bytes, writes its input's or output's bytes (an in-place
 * kernel, an arena slot that takes the bytes over), or is control flow, or
 * at the list's end: a loop's or a branch's collectives are waited for
 * inside it. Buffers are compared by their final places (after the arena
 * is packed), so the steps between a start and its wait never touch what
 * the collective reads or writes. KILN_DIST_OVERLAP=0 makes each start run
 * the collective at once (the runtime's choice, so the code is the same). */
#include <stdlib.h>

#include "cpu/compile.h"

typedef struct {
  int kind, index;
  int64_t lo, hi; /* arena bytes */
} place_t;

static place_t place_of(const plan *pl, int s) {
  while (s >= 0 && pl->slots[s].kind == PLAN_SLOT_ROW) s = pl->slots[s].index; /* a row: its whole stack */
  const plan_slot *sl = &pl->slots[s];
  place_t p = {sl->kind, sl->index, 0, 0};
  if (sl->kind == PLAN_SLOT_ARENA) {
    int64_t bytes = pl->slot_bytes ? pl->slot_bytes[s] : 0;
    p.lo = sl->offset, p.hi = sl->offset + (bytes > 0 ? bytes : 1);
  }
  return p;
}

static bool same_bytes(const plan *pl, int a, int b) {
  place_t x = place_of(pl, a), y = place_of(pl, b);
  if (x.kind != y.kind || x.kind == PLAN_SLOT_CONST) return false; /* constants are never written */
  if (x.kind == PLAN_SLOT_ARENA) return x.lo < y.hi && y.lo < x.hi;
  return x.index == y.index;
}

/* whether slot s overlaps any of the n slots at list */
static bool touches(const plan *pl, int s, const int *list, int n) {
  for (int k = 0; k < n; k++)
    if (same_bytes(pl, s, list[k])) return true;
  return false;
}

/* Whether step x must come after the wait of collective call step c:
 * it reads or writes c's output, writes c's input, or is control flow. */
static bool conflicts(const plan *pl, const plan_step *c, const plan_step *x) {
  int c_out = pl->calls[c->index].n_out;
  const int *outs = c->slots, *ins = c->slots + c_out;
  int n_ins = c->n_slots - c_out;
  switch (x->kind) {
    case PLAN_STEP_KERNEL: {
      const plan_kernel *g = &pl->kernels[x->index];
      for (int v = 0; v < g->f->n_values; v++)
        if (g->leaf[v] >= 0 && touches(pl, g->leaf[v], outs, c_out)) return true;
      for (int k = 0; k < g->n_out; k++)
        if (touches(pl, g->out_slot[k], outs, c_out) || touches(pl, g->out_slot[k], ins, n_ins)) return true;
      return false;
    }
    case PLAN_STEP_CALL:
    case PLAN_STEP_WAIT:
    case PLAN_STEP_COPY: {
      int x_out = x->kind == PLAN_STEP_COPY ? 1 : pl->calls[x->index].n_out;
      for (int k = 0; k < x->n_slots; k++)
        if (touches(pl, x->slots[k], outs, c_out) || (k < x_out && touches(pl, x->slots[k], ins, n_ins)))
          return true;
      return false;
    }
    default: return true;
  }
}

static bool starts(const cpu_build *cb, const plan_step *st) {
  return st->kind == PLAN_STEP_CALL && kiln_ops[cb->pl.calls[st->index].op].kind == OPK_COLLECTIVE;
}

/* the wait of call step c, appended to out */
static int add_wait(plan_step *out, int *n, const plan_step *c) {
  int *slots = malloc(((size_t)c->n_slots + 1) * sizeof *slots);
  if (!slots) return cpu_oom();
  memcpy(slots, c->slots, (size_t)c->n_slots * sizeof *slots);
  out[(*n)++] = (plan_step){.kind = PLAN_STEP_WAIT, .index = c->index, .n_slots = c->n_slots, .slots = slots};
  return 0;
}

/* the waits of list (n steps; nested lists first) placed, in a new array */
static int overlap_list(cpu_build *cb, plan_step **list, int *n) {
  plan_step *steps = *list;
  int n_starts = 0;
  for (int s = 0; s < *n; s++) {
    for (int k = 0; k < 2; k++)
      if (steps[s].kind >= PLAN_STEP_COND && overlap_list(cb, &steps[s].sub[k], &steps[s].n_sub[k])) return -1;
    n_starts += starts(cb, &steps[s]);
  }
  if (!n_starts) return 0;
  plan_step *out = malloc(((size_t)*n + (size_t)n_starts) * sizeof *out);
  int *pending = malloc((size_t)n_starts * sizeof *pending); /* steps started, not waited for */
  if (!out || !pending) {
    free(out), free(pending);
    return cpu_oom();
  }
  int n_out = 0, n_pending = 0, rc = 0;
  for (int s = 0; s <= *n && !rc; s++) {
    int kept = 0;
    for (int k = 0; k < n_pending && !rc; k++) {
      const plan_step *c = &steps[pending[k]];
      if (s == *n || conflicts(&cb->pl, c, &steps[s])) rc = add_wait(out, &n_out, c);
      else pending[kept++] = pending[k];
    }
    n_pending = kept;
    if (s == *n || rc) break;
    if (n_pending) cb->p->n_overlapped++; /* runs while a collective is in flight */
    out[n_out++] = steps[s];
    if (starts(cb, &steps[s])) pending[n_pending++] = s;
  }
  free(pending);
  if (rc) { /* the steps stay the old list's; the waits made are freed */
    for (int k = 0; k < n_out; k++)
      if (out[k].kind == PLAN_STEP_WAIT) free(out[k].slots);
    free(out);
    return -1;
  }
  free(steps);
  *list = out;
  *n = n_out;
  return 0;
}

int cpu_plan_overlap(cpu_build *cb) { return overlap_list(cb, &cb->pl.steps, &cb->pl.n_steps); }

int cpu_program_overlapped(const cpu_program *p) { return p ? p->n_overlapped : 0; }
