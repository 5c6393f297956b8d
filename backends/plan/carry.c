/* carry.c — buffer assignment for a loop's state (control.c plans the
 * loops): where it is safe, the body's kernel that computes carry k stores
 * it straight into the state's slot k (in place), so no step copies it back
 * each iteration. Safe when that kernel reads state k only at the element
 * it stores (elementwise over the state's shape: plan_at_store_index), the
 * body's steps before it read state k as they like, and none after it does
 * (nor the copies of the other carries and ys, which follow the body). The
 * backend opts in (plan_policy.state_in_place). Where it also moves the
 * state between buffers (plan_policy.swap_state), the other carries need
 * no copy either: at each iteration's end the state's slots take the
 * places of the new values (another state's, a temporary's, a row of ys)
 * and the temporaries the places freed (double buffering). */
#include <stdlib.h>

#include "plan/build.h"

void plan_at_store_index(const plan_kernel *g, bool *at) {
  const ir_func *f = g->f;
  bool *used = calloc((size_t)f->n_values + 1, sizeof *used);
  for (int v = 0; v < f->n_values; v++) at[v] = used ? true : false; /* out of memory: nothing is */
  if (!used) return;
  for (int k = 0; k < g->n_out; k++) used[g->out[k]] = true;
  for (int i = f->n_instrs - 1; i >= 0; i--) {
    const ir_instr *in = &f->instrs[i];
    if (!g->member[i]) continue;
    op_kind kind = kiln_ops[in->op].kind;
    bool elementwise =
        kind == OPK_UNARY || kind == OPK_BINARY || kind == OPK_COMPARE || kind == OPK_SELECT || kind == OPK_CONVERT;
    bool ok = elementwise && in->n_out == 1 && used[in->out] && at[in->out];
    for (int k = 0; k < in->n_in; k++) {
      ir_value u = in->in[k];
      const op_type *a = &f->types[in->out], *b = &f->types[u];
      bool same = a->rank == b->rank;
      for (int d = 0; same && d < a->rank; d++) same = a->shape[d] == b->shape[d];
      used[u] = true;
      at[u] = at[u] && ok && same;
    }
  }
  for (int v = 0; v < f->n_values; v++) at[v] = at[v] && used[v];
  free(used);
}

/* the slot whose bytes s lies in (a row's stacked slot, followed down) */
static int base_of(const plan *pl, int s) {
  while (s >= 0 && pl->slots[s].kind == PLAN_SLOT_ROW) s = pl->slots[s].index;
  return s;
}

static bool kernel_touches(const plan *pl, const plan_kernel *g, int s) {
  for (int k = 0; k < g->n_out; k++)
    if (base_of(pl, g->out_slot[k]) == s) return true;
  for (int v = 0; v < g->f->n_values; v++)
    if (g->leaf[v] >= 0 && base_of(pl, g->leaf[v]) == s) return true;
  return false;
}

/* whether any of steps (n, nested lists included) reads or writes slot s's bytes */
static bool steps_touch(const plan *pl, const plan_step *steps, int n, int s) {
  for (int i = 0; i < n; i++) {
    const plan_step *st = &steps[i];
    if (st->kind == PLAN_STEP_KERNEL) {
      if (kernel_touches(pl, &pl->kernels[st->index], s)) return true;
      continue;
    }
    for (int k = 0; k < st->n_slots; k++)
      if (base_of(pl, st->slots[k]) == s) return true;
    for (int b = 0; b < 2; b++)
      if (steps_touch(pl, st->sub[b], st->n_sub[b], s)) return true;
  }
  return false;
}

static void rename_slot(int *s, int from, int to) {
  if (*s == from) *s = to;
}

/* every use of slot from in steps (n, nested lists included) made a use of to */
static void rename_in(plan *pl, plan_step *steps, int n, int from, int to) {
  for (int i = 0; i < n; i++) {
    plan_step *st = &steps[i];
    if (st->kind == PLAN_STEP_KERNEL) {
      plan_kernel *g = &pl->kernels[st->index];
      for (int k = 0; k < g->n_out; k++) rename_slot(&g->out_slot[k], from, to);
      for (int v = 0; v < g->f->n_values; v++) rename_slot(&g->leaf[v], from, to);
      continue;
    }
    for (int k = 0; k < st->n_slots; k++) rename_slot(&st->slots[k], from, to);
    for (int b = 0; b < 2; b++) rename_in(pl, st->sub[b], st->n_sub[b], from, to);
  }
}

/* Whether the kernel of step i of the body (steps, n) may store its output
 * in slot r over state slot s (of type t) instead. */
static bool may_store_over(const plan *pl, const plan_step *steps, int n, int i, int s, const op_type *t) {
  const plan_kernel *g = &pl->kernels[steps[i].index];
  if (!pl->policy->state_in_place(g) || steps_touch(pl, steps + i + 1, n - i - 1, s)) return false;
  bool reads = false;
  for (int v = 0; v < g->f->n_values && !reads; v++) reads = g->leaf[v] >= 0 && base_of(pl, g->leaf[v]) == s;
  if (!reads) return true;
  if (g->special) return false;
  bool *at = malloc(((size_t)g->f->n_values + 1) * sizeof *at);
  if (!at) return false; /* only a lost optimisation */
  plan_at_store_index(g, at);
  bool ok = true;
  for (int v = 0; v < g->f->n_values && ok; v++) {
    if (g->leaf[v] < 0 || base_of(pl, g->leaf[v]) != s) continue;
    const op_type *u = &g->f->types[v];
    bool same = g->leaf[v] == s && u->dtype == t->dtype && u->rank == t->rank;
    for (int d = 0; same && d < t->rank; d++) same = u->shape[d] == t->shape[d];
    ok = same && at[v];
  }
  free(at);
  return ok;
}

void plan_carries_in_place(plan *pl, plan_step *steps, int n, const int *st, int *rs, int ns, const op_type *ty,
                           int first_slot) {
  if (!pl->policy->state_in_place) return;
  for (int k = 0; k < ns; k++) {
    int r = rs[k], s = st[k];
    if (r == s || r < first_slot || pl->slots[r].kind != PLAN_SLOT_ARENA) continue;
    bool shared = false; /* a value two carries return, or a state another carry returns (copied after the body) */
    for (int j = 0; j < ns && !shared; j++) shared = j != k && (rs[j] == r || rs[j] == s);
    if (shared) continue;
    int i = n - 1; /* the top-level kernel step that makes it */
    bool made = false;
    for (; i >= 0 && !made; i--) {
      if (steps[i].kind != PLAN_STEP_KERNEL) continue;
      const plan_kernel *g = &pl->kernels[steps[i].index];
      for (int q = 0; q < g->n_out && !made; q++) made = g->out_slot[q] == r;
    }
    i++;
    if (!made || !may_store_over(pl, steps, n, i, s, &ty[k])) continue;
    rename_in(pl, steps, n, r, s);
    rs[k] = s;
  }
}

/* ---- double buffering (plan_policy.swap_state) ---- */

static bool is_row(int r, const int *ys, int ny) {
  for (int j = 0; j < ny; j++)
    if (r == ys[j]) return true;
  return false;
}

/* Whether slot r, the body's new value of carry k, may become the state's
 * place: a state slot (its old value), a temporary the body writes every
 * iteration before reading it, or (a scan's) its row of a ys, at full
 * alignment, which no later iteration writes; then the state's place is a
 * row from the second iteration on, so none may flow on from it: no other
 * carry returns state k (nor may a temporary take it, plan_swap_state). */
static bool movable(const plan *pl, int k, int r, const int *state, const int *rs, int ns, int first_slot,
                    const int *ys, int ny) {
  for (int j = 0; j < ns; j++)
    if (r == state[j]) return true;
  if (r >= first_slot && pl->slots[r].kind == PLAN_SLOT_ARENA) return true;
  if (!is_row(r, ys, ny) || plan_slot_align(pl, r) != KILN_ALIGN) return false;
  for (int j = 0; j < ns; j++)
    if (j != k && rs[j] == state[k]) return false;
  return true;
}

int plan_swap_state(plan *pl, plan_step *st, int b, const int *state, const int *rs, int ns, const op_type *ty,
                    int first_slot, const int *ys, int ny) {
  int *src = malloc(((size_t)ns + 1) * sizeof *src);
  bool *taken = calloc((size_t)pl->n_slots + (size_t)ns + 1, sizeof *taken); /* slots claimed as a state's new place */
  st->state = malloc(((size_t)ns + 1) * sizeof *st->state);
  st->state_bytes = malloc(((size_t)ns + 1) * sizeof *st->state_bytes);
  st->move = malloc(((size_t)ns * 4 + 1) * sizeof *st->move);
  if (!src || !taken || !st->state || !st->state_bytes || !st->move) {
    free(src), free(taken);
    return plan_oom(pl);
  }
  st->n_state = ns;
  int rc = 0;
  for (int k = 0; k < ns; k++) {
    st->state[k] = state[k];
    st->state_bytes[k] = plan_type_bytes(&ty[k]);
    src[k] = -1;
    if (rs[k] == state[k]) src[k] = state[k], taken[state[k]] = true; /* unchanged, or made in place */
  }
  for (int k = 0; k < ns && !rc; k++) {
    if (src[k] >= 0) continue;
    int r = rs[k];
    if (!taken[r] && movable(pl, k, r, state, rs, ns, first_slot, ys, ny)) {
      src[k] = r, taken[r] = true;
      continue;
    }
    int tmp = plan_arena_slot(pl, &ty[k]); /* a place of its own, written each iteration */
    if (tmp < 0) {
      rc = -1;
      break;
    }
    rc = plan_copy_into(pl, &st->sub[b], &st->n_sub[b], tmp, r, &ty[k]);
    src[k] = tmp; /* fresh: not in taken (sized before it) */
  }
  /* the states take their new places; the temporaries those no state holds
   * (but for the states whose place is a row: not a buffer after the first
   * iteration) */
  for (int k = 0; k < ns; k++)
    if (is_row(src[k], ys, ny)) taken[state[k]] = true;
  int nm = 0, free_at = 0;
  for (int k = 0; k < ns && !rc; k++) {
    if (src[k] == state[k]) continue;
    st->move[2 * nm] = state[k], st->move[2 * nm + 1] = src[k], nm++;
  }
  for (int k = 0; k < ns && !rc; k++) {
    bool temp = src[k] != state[k];
    for (int j = 0; j < ns && temp; j++) temp = src[k] != state[j];
    temp = temp && !is_row(src[k], ys, ny);
    if (!temp) continue;
    while (free_at < ns && taken[state[free_at]]) free_at++;
    if (free_at == ns) { /* cannot happen: as many places freed as temporaries */
      rc = kiln_set_error("%s: @%s: a loop's state has no place", pl->policy->who, pl->f->name);
      break;
    }
    st->move[2 * nm] = src[k], st->move[2 * nm + 1] = state[free_at], nm++;
    taken[state[free_at]] = true;
  }
  st->n_move = nm;
  /* two states or more moving among buffers: at the end one's place may be
   * another's own buffer, so their copies back go through scratch places */
  int moved = 0;
  for (int k = 0; k < ns && !rc; k++) moved += src[k] != state[k] && !is_row(src[k], ys, ny);
  st->scratch = malloc(((size_t)ns + 1) * sizeof *st->scratch);
  if (!rc && !st->scratch) rc = plan_oom(pl);
  for (int k = 0; k < ns && !rc; k++) {
    st->scratch[k] = -1;
    bool scratch = moved >= 2 && src[k] != state[k] && !is_row(src[k], ys, ny);
    if (scratch && (st->scratch[k] = plan_arena_slot(pl, &ty[k])) < 0) rc = -1;
  }
  free(src), free(taken);
  return rc;
}
