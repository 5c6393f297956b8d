/* slices.c — kiln_dataset_from_tensors: the source of a chain. Element i is
 * row i of each tensor (axis 0 removed); the rows stay in the sources, which
 * the stage keeps (on the host) until the chain is freed. */
#include <stdlib.h>

#include "dataset.h"

typedef struct {
  kiln_dataset base;
  kiln_tensor **src;
  int64_t rows, at;
} slices;

static int slices_next(kiln_dataset *ds, ds_part *out) {
  slices *s = (slices *)ds;
  if (s->at == s->rows) return 0;
  for (int i = 0; i < ds->arity; i++) out[i] = (ds_part){s->src[i], s->at};
  s->at++;
  return 1;
}

static void slices_reset(kiln_dataset *ds) { ((slices *)ds)->at = 0; }

static void slices_release(kiln_dataset *ds) {
  slices *s = (slices *)ds;
  for (int i = 0; s->src && i < ds->arity; i++) kiln_release(s->src[i]);
  free(s->src);
}

static const ds_ops slices_ops = {slices_next, slices_reset, slices_release};

kiln_dataset *kiln_dataset_from_tensors(int n, kiln_tensor *const *ts) {
  const char *who = "kiln_dataset_from_tensors";
  if (n <= 0) {
    kiln_set_error("%s: n = %d tensors; at least 1", who, n);
    return NULL;
  }
  if (!ts) {
    kiln_set_error("%s: ts is NULL", who);
    return NULL;
  }
  for (int i = 0; i < n; i++) {
    const kiln_tensor *t = ts[i];
    char a[256], b[256];
    if (!t) {
      if (!kiln_has_error()) kiln_set_error("%s: ts[%d] is NULL", who, i);
      return NULL;
    }
    if (t->flags & TF_SYMBOLIC) {
      kiln_set_error("%s: ts[%d] is a symbolic tensor (a dataset is made outside staged functions)", who, i);
      return NULL;
    }
    if (t->rank == 0) {
      kiln_set_error("%s: ts[%d] is a scalar; slicing needs an axis 0", who, i);
      return NULL;
    }
    if (t->shape[0] != ts[0]->shape[0]) {
      kiln_set_error("%s: ts[%d] has shape %s, ts[0] %s: axis 0 must agree", who, i,
                     shape_str(a, sizeof a, t->rank, t->shape), shape_str(b, sizeof b, ts[0]->rank, ts[0]->shape));
      return NULL;
    }
  }
  slices *s = (slices *)ds_new(who, &slices_ops, sizeof(slices), NULL, n);
  if (!s) return NULL;
  s->rows = ts[0]->shape[0];
  if (!(s->src = calloc((size_t)n, sizeof *s->src))) {
    kiln_set_error("%s: out of memory", who);
    ds_discard(&s->base);
    return NULL;
  }
  for (int i = 0; i < n; i++) {
    s->src[i] = ts[i]->device ? tensor_to_device(who, ts[i], 0) : kiln_retain(ts[i]);
    if (!s->src[i]) {
      ds_discard(&s->base);
      return NULL;
    }
  }
  return ds_adopt(&s->base);
}
