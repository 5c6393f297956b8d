/* dataset.h — the insides of kiln_dataset (API.md §13): a pull-based chain
 * of stages, each a small vtable over its upstream. Internal; shared by the
 * files of lib/dataset/, one stage each.
 *
 * Between stages an element travels as `arity` parts. A part is either a
 * tensor the part owns (row < 0: one reference, released with the part) or
 * row `row` of a from_tensors source tensor, borrowed: from_tensors keeps
 * its sources until the chain is freed, and every stage releases the parts
 * it holds before its upstream goes. Rows are copied once, where they leave
 * the chain (kiln_dataset_next), enter a staged function (map), or are
 * stacked (batch): shuffling and queueing move 16-byte parts, not data. */
#ifndef KILN_DATASET_H
#define KILN_DATASET_H

#include "../runtime.h"

typedef struct {
  kiln_tensor *t;
  int64_t row; /* >= 0: row of t (borrowed); < 0: t itself (owned) */
} ds_part;

typedef struct ds_ops {
  /* The next element into out[0..arity): 1, 0 at the end (and on every
   * later call until a reset), -1 with the error set (the stage goes on
   * with the following element at the next call). */
  int (*next)(kiln_dataset *ds, ds_part *out);
  /* Back to the first element (repeat's new epoch); upstream too. */
  void (*reset)(kiln_dataset *ds);
  /* Releases the stage's own state (not ds itself, not upstream). */
  void (*release)(kiln_dataset *ds);
} ds_ops;

struct kiln_dataset {
  const ds_ops *ops;
  kiln_dataset *up; /* NULL for from_tensors */
  int arity;        /* tensors per element */
  bool taken;       /* the input of another stage already */
  ds_part *scratch; /* arity parts: kiln_dataset_next's element */
};

/* up can be a stage's input: not NULL (the error kept), not another's
 * input already. false with the error set (who names the public function). */
bool ds_input_ok(const char *who, const kiln_dataset *up);
/* A stage of `bytes` (its struct, kiln_dataset first) over up (NULL for a
 * source) with elements of arity tensors. It takes up over only through
 * ds_adopt. NULL with the error set. */
kiln_dataset *ds_new(const char *who, const ds_ops *ops, size_t bytes, kiln_dataset *up, int arity);
/* The stage ds_new made is complete: it owns up from now on. Returns ds. */
kiln_dataset *ds_adopt(kiln_dataset *ds);
/* Frees a stage ds_new made that never adopted its upstream. */
void ds_discard(kiln_dataset *ds);

static inline int ds_next(kiln_dataset *ds, ds_part *out) { return ds->ops->next(ds, out); }

/* ---- parts ---- */
static inline int part_rank(ds_part p) { return p.row >= 0 ? p.t->rank - 1 : p.t->rank; }
static inline const int64_t *part_shape(ds_part p) { return p.row >= 0 ? p.t->shape + 1 : p.t->shape; }
static inline size_t part_bytes(ds_part p) {
  return p.row >= 0 ? tensor_bytes(p.t) / (size_t)p.t->shape[0] : tensor_bytes(p.t);
}
void parts_release(int n, ds_part *p); /* releases the owned ones; NULL-safe entries */
/* Copies p's data to host dst (part_bytes(p) bytes). 0 / -1. */
int part_read(const char *who, ds_part p, void *dst);
/* p as a tensor owned by the caller: an owned part's tensor (p is spent),
 * a row's copy. NULL with the error set. */
kiln_tensor *part_take(const char *who, ds_part p);

#endif
