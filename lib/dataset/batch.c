/* batch.c — kiln_dataset_batch: batch_size consecutive elements stacked
 * along a new axis 0, tensor by tensor; the last, shorter batch kept unless
 * drop_remainder. Every element of a batch must match the first in dtype
 * and shape. An error from upstream drops the elements gathered so far. */
#include <stdlib.h>

#include "dataset.h"

typedef struct {
  kiln_dataset base;
  int64_t size;
  bool drop;
  ds_part *parts; /* size elements of arity parts */
} batch;

static const char *const in_next = "kiln_dataset_next"; /* stack fails inside next */

/* Tensor j of the k elements in parts, stacked; NULL with the error set. */
static kiln_tensor *stack(const batch *b, int64_t k, int j) {
  int a = b->base.arity;
  ds_part first = b->parts[j];
  int rank = part_rank(first);
  const int64_t *shape = part_shape(first);
  char s1[256], s2[256];
  if (rank == KILN_MAX_RANK) {
    kiln_set_error("%s: batch: tensor %d of the elements has rank %d already; a batch would exceed %d", in_next, j,
                   rank, KILN_MAX_RANK);
    return NULL;
  }
  for (int64_t e = 1; e < k; e++) {
    ds_part p = b->parts[e * a + j];
    if (p.t->dtype != first.t->dtype || part_rank(p) != rank ||
        memcmp(part_shape(p), shape, (size_t)rank * sizeof *shape)) {
      kiln_set_error("%s: batch: tensor %d of element %lld is %s %s, of the batch's first %s %s", in_next, j,
                     (long long)e, kiln_dtype_name((kiln_dtype)p.t->dtype),
                     shape_str(s1, sizeof s1, part_rank(p), part_shape(p)),
                     kiln_dtype_name((kiln_dtype)first.t->dtype), shape_str(s2, sizeof s2, rank, shape));
      return NULL;
    }
  }
  int64_t out_shape[KILN_MAX_RANK];
  out_shape[0] = k;
  memcpy(out_shape + 1, shape, (size_t)rank * sizeof *shape);
  kiln_tensor *t = tensor_alloc(in_next, (kiln_dtype)first.t->dtype, rank + 1, out_shape);
  if (!t) return NULL;
  size_t bytes = part_bytes(first);
  for (int64_t e = 0; e < k; e++) {
    if (part_read(in_next, b->parts[e * a + j], (char *)t->data + (size_t)e * bytes)) {
      kiln_release(t);
      return NULL;
    }
  }
  return t;
}

static int batch_next(kiln_dataset *ds, ds_part *out) {
  batch *b = (batch *)ds;
  int a = ds->arity;
  int64_t k = 0;
  int rc = 1;
  while (k < b->size && (rc = ds_next(ds->up, b->parts + k * a)) == 1) k++;
  if (rc < 0 || k == 0 || (k < b->size && b->drop)) {
    parts_release((int)(k * a), b->parts);
    return rc < 0 ? -1 : 0;
  }
  rc = 1;
  for (int j = 0; j < a; j++) {
    out[j] = (ds_part){stack(b, k, j), -1};
    if (!out[j].t) {
      parts_release(j, out);
      rc = -1;
      break;
    }
  }
  parts_release((int)(k * a), b->parts);
  return rc;
}

static void batch_reset(kiln_dataset *ds) { ds->up->ops->reset(ds->up); }

static void batch_release(kiln_dataset *ds) { free(((batch *)ds)->parts); }

static const ds_ops batch_ops = {batch_next, batch_reset, batch_release};

kiln_dataset *kiln_dataset_batch(kiln_dataset *up, int64_t batch_size, bool drop_remainder) {
  const char *who = "kiln_dataset_batch";
  if (!ds_input_ok(who, up)) return NULL;
  if (batch_size <= 0 || batch_size > (INT32_MAX / up->arity)) {
    kiln_set_error("%s: batch_size = %lld; in [1, %d]", who, (long long)batch_size, INT32_MAX / up->arity);
    return NULL;
  }
  batch *b = (batch *)ds_new(who, &batch_ops, sizeof(batch), up, up->arity);
  if (!b) return NULL;
  b->size = batch_size;
  b->drop = drop_remainder;
  if (!(b->parts = calloc((size_t)(batch_size * up->arity), sizeof *b->parts))) {
    kiln_set_error("%s: out of memory for a batch of %lld", who, (long long)batch_size);
    ds_discard(&b->base);
    return NULL;
  }
  return ds_adopt(&b->base);
}
