/* arena.c — the arena's layout, once every step is planned: arena slots
 * that are never live at once share bytes. The buffers pass places the
 * top-level function's temporaries, but the plan makes more that it never
 * saw (the values of inlined calls and of fusions that are not one kernel,
 * of control flow's regions, a split reduction's partials, loop carries'
 * temporaries), which plan_arena_slot appends at the arena's end, none
 * sharing. Here each arena slot lives from the first step that touches it
 * to the last, over the steps flattened in order (nested lists included),
 * and the slots are placed anew best-fit, in two orders (largest first,
 * earliest first), as the buffers pass and XLA's heap simulator do; the
 * smaller arena wins, and the old layout stays where it is smaller still.
 *
 * - Slots whose old bytes overlap while both are live (an in-place kernel
 *   writing its result over an operand that dies there, as the buffers
 *   pass decided) form one block that keeps its inner layout.
 * - A slot touched inside a loop (WHILE, SCAN) and outside it, or first
 *   read there (a value from an earlier iteration), lives over the whole
 *   loop; so do the slots the loop moves between (plan_step.move) and its
 *   copies back after the loop. A row's bytes are its stacked slot's.
 * - A cond's branches are flattened one after the other: only one runs,
 *   so their temporaries may share bytes; the results they both write
 *   live from the first branch's write on. */
#include <stdlib.h>
#include <string.h>

#include "plan/build.h"

typedef struct ar_live {
  int32_t *first, *last; /* per slot: steps (flattened) that touch it, -1 none */
  bool *first_read;      /* its first touch reads it */
  int32_t *loops;        /* [lo, hi] pairs of each loop, inner ones first */
  int n_loops, cap_loops;
  int32_t t; /* the next step's number */
} ar_live;

static int base_slot(const plan *pl, int s) {
  while (s >= 0 && pl->slots[s].kind == PLAN_SLOT_ROW) s = pl->slots[s].index;
  return s;
}

/* slot s touched at step t (reads: before any write of the same step; a
 * loop's own slots are touched at its start after its body's steps) */
static void touch(const plan *pl, ar_live *lv, int s, int32_t t, bool read) {
  s = base_slot(pl, s);
  if (s < 0 || pl->slots[s].kind != PLAN_SLOT_ARENA) return;
  if (lv->first[s] < 0 || t < lv->first[s]) lv->first[s] = t, lv->first_read[s] = read;
  if (t > lv->last[s]) lv->last[s] = t;
}

static int walk(const plan *pl, ar_live *lv, const plan_step *steps, int n);

static int walk_step(const plan *pl, ar_live *lv, const plan_step *st) {
  int32_t t = lv->t++;
  switch (st->kind) {
    case PLAN_STEP_KERNEL: {
      const plan_kernel *g = &pl->kernels[st->index];
      for (int v = 0; v < g->f->n_values; v++)
        if (g->leaf[v] >= 0) touch(pl, lv, g->leaf[v], t, true);
      for (int k = 0; k < g->n_out; k++) touch(pl, lv, g->out_slot[k], t, false);
      return 0;
    }
    case PLAN_STEP_CALL: {
      int n_out = pl->calls[st->index].n_out;
      for (int k = n_out; k < st->n_slots; k++) touch(pl, lv, st->slots[k], t, true);
      for (int k = 0; k < n_out && k < st->n_slots; k++) touch(pl, lv, st->slots[k], t, false);
      return 0;
    }
    case PLAN_STEP_COPY:
      touch(pl, lv, st->slots[1], t, true);
      touch(pl, lv, st->slots[0], t, false);
      return 0;
    default: break;
  }
  /* control flow: its own slots (a predicate, rows), the moves and copies
   * back are touched over all of it, read first */
  bool loop = st->kind != PLAN_STEP_COND;
  if (!loop && st->n_slots) touch(pl, lv, st->slots[0], t, true);
  for (int b = 0; b < 2; b++)
    if (walk(pl, lv, st->sub[b], st->n_sub[b])) return -1;
  if (!loop) return 0;
  int32_t end = lv->t++;
  int32_t at[2] = {t, end};
  for (int e = 0; e < 2; e++) {
    for (int k = 0; k < st->n_slots; k++) touch(pl, lv, st->slots[k], at[e], true);
    for (int k = 0; k < 2 * st->n_move; k++) touch(pl, lv, st->move[k], at[e], true);
    for (int k = 0; k < st->n_state; k++) {
      touch(pl, lv, st->state[k], at[e], true);
      if (st->scratch && st->scratch[k] >= 0) touch(pl, lv, st->scratch[k], at[e], true);
    }
  }
  if (lv->n_loops == lv->cap_loops) {
    int cap = lv->cap_loops ? 2 * lv->cap_loops : 8;
    int32_t *q = realloc(lv->loops, (size_t)cap * 2 * sizeof *q);
    if (!q) return plan_oom(pl);
    lv->loops = q, lv->cap_loops = cap;
  }
  lv->loops[2 * lv->n_loops] = t, lv->loops[2 * lv->n_loops + 1] = end;
  lv->n_loops++;
  return 0;
}

static int walk(const plan *pl, ar_live *lv, const plan_step *steps, int n) {
  for (int i = 0; i < n; i++)
    if (walk_step(pl, lv, &steps[i])) return -1;
  return 0;
}

/* slots live across a loop's iterations live over the whole loop (inner
 * loops first: a slot widened to an inner loop may then span an outer one) */
static void widen_loops(const plan *pl, ar_live *lv) {
  for (int l = 0; l < lv->n_loops; l++) {
    int32_t lo = lv->loops[2 * l], hi = lv->loops[2 * l + 1];
    for (int s = 0; s < pl->n_slots; s++) {
      if (lv->first[s] < 0 || lv->last[s] < lo || lv->first[s] > hi) continue;
      if (lv->first[s] < lo || lv->last[s] > hi || lv->first_read[s]) {
        if (lo < lv->first[s]) lv->first[s] = lo;
        if (hi > lv->last[s]) lv->last[s] = hi;
      }
    }
  }
}

/* ---- blocks: slots that keep their old layout among themselves ---- */

typedef struct ar_block {
  int64_t lo, hi;     /* old bytes [lo, hi) */
  int64_t size, off;  /* new: hi - lo rounded up, and where it goes */
  int32_t start, end; /* live over these steps */
  int32_t id;
} ar_block;

static int find(int32_t *up, int32_t x) {
  while (up[x] != x) x = up[x] = up[up[x]];
  return x;
}

static const plan *sort_pl;
static int by_old_offset(const void *a, const void *b) {
  int x = *(const int *)a, y = *(const int *)b;
  int64_t ox = sort_pl->slots[x].offset, oy = sort_pl->slots[y].offset;
  if (ox != oy) return ox < oy ? -1 : 1;
  return (x > y) - (x < y);
}

static int by_size(const void *a, const void *b) {
  const ar_block *x = *(ar_block *const *)a, *y = *(ar_block *const *)b;
  if (x->size != y->size) return x->size > y->size ? -1 : 1;
  if (x->start != y->start) return x->start < y->start ? -1 : 1;
  return (x->id > y->id) - (x->id < y->id);
}

static int by_first_use(const void *a, const void *b) {
  const ar_block *x = *(ar_block *const *)a, *y = *(ar_block *const *)b;
  if (x->start != y->start) return x->start < y->start ? -1 : 1;
  if (x->size != y->size) return x->size > y->size ? -1 : 1;
  return (x->id > y->id) - (x->id < y->id);
}

/* Places the blocks in the order given, each in the smallest gap among the
 * blocks already placed that live at the same time (best fit), or above
 * them all; writes each off and returns the arena size. placed holds n
 * pointers: the blocks placed so far, by offset. */
static int64_t place(ar_block **order, int n, ar_block **placed) {
  int64_t arena = 0;
  int np = 0;
  for (int i = 0; i < n; i++) {
    ar_block *b = order[i];
    int64_t cur = 0, best = -1, best_gap = 0;
    for (int j = 0; j < np; j++) {
      const ar_block *q = placed[j];
      if (q->start > b->end || b->start > q->end) continue;
      int64_t gap = q->off - cur;
      if (gap >= b->size && (best < 0 || gap < best_gap)) best = cur, best_gap = gap;
      if (q->off + q->size > cur) cur = q->off + q->size;
    }
    b->off = best >= 0 ? best : cur;
    if (b->off + b->size > arena) arena = b->off + b->size;
    int j = np++; /* insert by offset */
    while (j > 0 && placed[j - 1]->off > b->off) placed[j] = placed[j - 1], j--;
    placed[j] = b;
  }
  return arena;
}

int plan_pack_arena(plan *pl) {
  int ns = pl->n_slots, rc = 0;
  pl->arena_unpacked = pl->arena_bytes;
  if (!ns || !pl->arena_bytes) return 0;
  ar_live lv = {0};
  lv.first = malloc((size_t)ns * sizeof *lv.first);
  lv.last = malloc((size_t)ns * sizeof *lv.last);
  lv.first_read = calloc((size_t)ns, sizeof *lv.first_read);
  int64_t *bytes = calloc((size_t)ns, sizeof *bytes);
  int32_t *up = malloc((size_t)ns * sizeof *up), *block_of = malloc((size_t)ns * sizeof *block_of);
  int *live = malloc((size_t)ns * sizeof *live);
  ar_block *blocks = malloc((size_t)ns * sizeof *blocks);
  ar_block **order = malloc((size_t)ns * sizeof *order), **placed = malloc((size_t)ns * sizeof *placed);
  int64_t *off_a = malloc((size_t)ns * sizeof *off_a);
  if (!lv.first || !lv.last || !lv.first_read || !bytes || !up || !block_of || !live || !blocks || !order ||
      !placed || !off_a) {
    rc = plan_oom(pl);
    goto done;
  }
  for (int s = 0; s < ns; s++) lv.first[s] = lv.last[s] = -1, up[s] = s, block_of[s] = -1;
  if ((rc = walk(pl, &lv, pl->steps, pl->n_steps))) goto done;
  widen_loops(pl, &lv);
  for (int s = 0; s < ns; s++) bytes[s] = pl->slots[s].kind == PLAN_SLOT_ARENA ? pl->slot_bytes[s] : 0;
  int nl = 0;
  for (int s = 0; s < ns; s++)
    if (pl->slots[s].kind == PLAN_SLOT_ARENA && lv.first[s] >= 0 && bytes[s] > 0) live[nl++] = s;
  /* blocks: old bytes overlapping while both live */
  sort_pl = pl;
  qsort(live, (size_t)nl, sizeof *live, by_old_offset);
  for (int i = 0; i < nl; i++) {
    int a = live[i];
    int64_t hi = pl->slots[a].offset + bytes[a];
    for (int j = i + 1; j < nl && pl->slots[live[j]].offset < hi; j++) {
      int b = live[j];
      if (lv.first[a] <= lv.last[b] && lv.first[b] <= lv.last[a]) {
        int ra = find(up, a), rb = find(up, b);
        if (ra != rb) up[ra] = rb;
      }
    }
  }
  int nb = 0;
  for (int i = 0; i < nl; i++) {
    int s = live[i], r = find(up, s);
    if (block_of[r] < 0) {
      block_of[r] = nb;
      blocks[nb] = (ar_block){pl->slots[s].offset, pl->slots[s].offset, 0, 0, lv.first[s], lv.last[s], nb};
      nb++;
    }
    ar_block *b = &blocks[block_of[r]];
    int64_t lo = pl->slots[s].offset, hi = lo + bytes[s];
    if (lo < b->lo) b->lo = lo;
    if (hi > b->hi) b->hi = hi;
    if (lv.first[s] < b->start) b->start = lv.first[s];
    if (lv.last[s] > b->end) b->end = lv.last[s];
  }
  for (int b = 0; b < nb; b++) blocks[b].size = (blocks[b].hi - blocks[b].lo + KILN_ALIGN - 1) / KILN_ALIGN * KILN_ALIGN;
  for (int b = 0; b < nb; b++) order[b] = &blocks[b];
  qsort(order, (size_t)nb, sizeof *order, by_size);
  int64_t arena_a = place(order, nb, placed);
  for (int b = 0; b < nb; b++) off_a[b] = blocks[b].off;
  qsort(order, (size_t)nb, sizeof *order, by_first_use);
  int64_t arena = place(order, nb, placed);
  if (arena_a <= arena) {
    arena = arena_a;
    for (int b = 0; b < nb; b++) blocks[b].off = off_a[b];
  }
  if (arena >= (int64_t)pl->arena_bytes) goto done; /* the old layout is no bigger */
  for (int s = 0; s < ns; s++) {
    if (pl->slots[s].kind != PLAN_SLOT_ARENA) continue;
    if (lv.first[s] < 0 || bytes[s] <= 0) { /* no step touches its bytes */
      pl->slots[s].offset = 0;
      continue;
    }
    const ar_block *b = &blocks[block_of[find(up, s)]];
    pl->slots[s].offset = b->off + (pl->slots[s].offset - b->lo);
  }
  pl->arena_bytes = (size_t)arena;
done:
  free(lv.first), free(lv.last), free(lv.first_read), free(lv.loops);
  free(bytes), free(up), free(block_of), free(live), free(blocks), free(order), free(placed), free(off_a);
  return rc;
}
