/* build.h — the planner's parts shared by its files (plan.c: slots, steps,
 * instructions; control.c: cond, while and scan). Internal to backends/plan. */
#ifndef KILN_PLAN_BUILD_H
#define KILN_PLAN_BUILD_H

#include "plan/plan.h"

int plan_oom(const plan *pl); /* -1 with "<who>: out of memory" */
/* a new slot (its index), or -1 */
int plan_add_slot(plan *pl, plan_slot s);
/* a new slot at the arena's end, of t's bytes */
int plan_arena_slot(plan *pl, const op_type *t);
/* a fresh place for value v of f (top: f is the compiled function) */
int plan_value_slot(plan *pl, const ir_func *f, ir_value v, bool top);
/* appends t to the plan's constants (plan.consts) */
int plan_note_const(plan *pl, const kiln_tensor *t);
/* a new kernel of f with n_out outputs, nothing a member, no leaves (freed
 * with the plan); NULL out of memory. A later one may move it. */
plan_kernel *plan_new_kernel(plan *pl, const ir_func *f, int n_out, op_id op);
/* appends st to pl->steps, the list being planned (st.slots is freed on failure) */
int plan_add_step(plan *pl, plan_step st);
/* Plans f's instructions into pl->steps; vs (per value of f) gets each
 * value's slot, the parameters' slots given. */
int plan_func_steps(plan *pl, const ir_func *f, int *vs, const int *param_slots, bool top, int depth);
/* frees n steps (their nested lists too) and the array */
void plan_free_steps(plan_step *steps, int n);
/* carry.c: the new state of a loop (the body's first ns results, in
 * slots rs, of types ty) stored by the body's kernels straight over the
 * state's slots st where that is safe (plan_policy.state_in_place), those
 * uses renamed in the body's steps (n) and rs[k] set to st[k]; first_slot:
 * the first slot the body's planning made. */
void plan_carries_in_place(plan *pl, plan_step *steps, int n, const int *st, int *rs, int ns, const op_type *ty,
                           int first_slot);
/* double buffering (carry.c, plan_policy.swap_state): loop step st's
 * moves (plan_step.move), its body the list sub[b], instead of copies
 * back; a new value no move can take (a capture, a constant, a row of xs,
 * a value two carries return) is copied into a temporary first. ys (ny
 * of them): the scan's rows of ys, which a state may take (NULL for a
 * while). */
int plan_swap_state(plan *pl, plan_step *st, int b, const int *state, const int *rs, int ns, const op_type *ty,
                    int first_slot, const int *ys, int ny);
/* a copy step of t's bytes from slot src into slot dst, appended to
 * *steps (n of them) */
int plan_copy_into(plan *pl, plan_step **steps, int *n, int dst, int src, const op_type *t);
/* scan_kernel.c: scan in (of f), which plan_scan_elementwise accepts, as
 * one kernel of the backend's own (plan_policy.scan_one_kernel) */
int plan_scan_kernel(plan *pl, const ir_func *f, const ir_instr *in, int *vs, bool top);
/* arena.c: arena slots placed anew so that those never live at once share
 * bytes (pl->arena_bytes shrinks; the old layout stays when no smaller) */
int plan_pack_arena(plan *pl);
/* A cond, while or scan (in, of f) as a control step (plan.h). */
int plan_control(plan *pl, const ir_func *f, const ir_instr *in, int *vs, bool top, int depth);

#endif
