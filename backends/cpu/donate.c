/* donate.c — buffer donation: which results of a compiled program may be
 * written over a parameter's buffer (cpu_program_donor), read off the plan:
 * the kernel storing the result reads that parameter only at the element it
 * writes, and nothing after it reads the parameter or can fail. */
#include <stdlib.h>

#include "cpu/compile.h"

static bool same_shape(const op_type *a, const op_type *b) {
  if (a->rank != b->rank) return false;
  for (int i = 0; i < a->rank; i++)
    if (a->shape[i] != b->shape[i]) return false;
  return true;
}

static bool same_type(const op_type *a, const op_type *b) { return a->dtype == b->dtype && same_shape(a, b); }

/* whether a step reads slot s, or can fail (a control step: assumed) */
static bool step_reads(const plan *pl, const plan_step *st, int s) {
  if (st->kind >= PLAN_STEP_COND) return true;
  if (st->kind == PLAN_STEP_CALL || st->kind == PLAN_STEP_WAIT) {
    for (int k = 0; k < st->n_slots; k++)
      if (st->slots[k] == s) return true;
    return false;
  }
  if (st->kind == PLAN_STEP_COPY) return st->slots[1] == s;
  const plan_kernel *g = &pl->kernels[st->index];
  for (int v = 0; v < g->f->n_values; v++)
    if (g->leaf[v] == s) return true;
  return false;
}

static bool step_can_fail(const plan *pl, const plan_step *st) {
  if (st->kind == PLAN_STEP_CALL || st->kind == PLAN_STEP_WAIT || st->kind >= PLAN_STEP_COND) return true;
  if (st->kind == PLAN_STEP_COPY) return false;
  const plan_kernel *g = &pl->kernels[st->index]; /* integer division checks its divisors */
  for (int i = 0; i < g->f->n_instrs; i++) {
    const ir_instr *in = &g->f->instrs[i];
    if (g->member[i] && (in->op == OP_DIV || in->op == OP_MOD) && dtype_is_int(g->f->types[in->out].dtype)) return true;
  }
  return false;
}

/* For each result a kernel stores, a parameter of its type it may be
 * written over (cpu_program_donor): nothing after that kernel reads the
 * parameter or can fail (a failed call leaves the caller's tensors as they
 * were), the kernel reads it only at the element it writes (in place is
 * then the same computation), and no result returns the parameter. */
int cpu_plan_donors(cpu_build *cb) {
  const plan *pl = &cb->pl;
  const ir_func *f = cb->f;
  cpu_program *p = cb->p;
  p->donor = malloc(((size_t)f->n_results + 1) * sizeof *p->donor);
  bool *taken = calloc((size_t)f->n_params + 1, sizeof *taken);
  int *pslot = malloc(((size_t)f->n_params + 1) * sizeof *pslot);
  if (!p->donor || !taken || !pslot) {
    free(taken);
    free(pslot);
    return cpu_oom();
  }
  for (int r = 0; r < f->n_results; r++) {
    p->donor[r] = -1;
    if (p->results[r].kind == CPU_RES_PARAM) taken[p->results[r].index] = true;
  }
  for (int s = 0; s < pl->n_slots; s++)
    if (pl->slots[s].kind == PLAN_SLOT_PARAM) pslot[pl->slots[s].index] = s;
  int rc = 0, first_fail = pl->n_steps; /* steps from first_fail on may fail */
  while (first_fail > 0 && !step_can_fail(pl, &pl->steps[first_fail - 1])) first_fail--;
  for (int s = first_fail; s < pl->n_steps && !rc; s++) {
    const plan_step *st = &pl->steps[s];
    if (st->kind != PLAN_STEP_KERNEL) continue;
    const plan_kernel *g = &pl->kernels[st->index];
    /* One output: its element's loads of the parameter all come before its
     * store, which depends on them, so the code stays right with noalias
     * kept on both (dropping it costs the vectorizer's overlap check, which
     * sends an exact overlap to the scalar loop: 2.3x slower, measured). */
    if (g->n_out != 1 || llvm_op_is_reduce(g->f->instrs[g->f->def[g->out[0]]].op)) continue;
    for (int k = 0; k < g->n_out; k++) {
      const plan_slot *os = &pl->slots[g->out_slot[k]];
      if (os->kind != PLAN_SLOT_RESULT || p->results[os->index].kind != CPU_RES_OWN) continue;
      for (int q = 0; q < f->n_params && p->donor[os->index] < 0; q++) {
        if (taken[q] || !same_type(&f->types[q], &p->result_types[os->index])) continue;
        bool ok = true;
        for (int later = s + 1; later < pl->n_steps && ok; later++) ok = !step_reads(pl, &pl->steps[later], pslot[q]);
        bool *at = calloc((size_t)g->f->n_values + 1, sizeof *at);
        if (!at) {
          rc = cpu_oom();
          break;
        }
        plan_at_store_index(g, at);
        for (int v = 0; v < g->f->n_values && ok; v++)
          if (g->leaf[v] == pslot[q]) ok = same_type(&g->f->types[v], &f->types[q]) && at[v];
        free(at);
        if (ok) p->donor[os->index] = q, taken[q] = true;
      }
    }
  }
  free(taken);
  free(pslot);
  return rc;
}
