/* dataset.c — what every stage of a kiln_dataset shares: making a stage over
 * its upstream, the parts elements travel as, and the public
 * kiln_dataset_next and kiln_dataset_free (API.md §13). */
#include <stdlib.h>

#include "dataset.h"

bool ds_input_ok(const char *who, const kiln_dataset *up) {
  if (!up) {
    if (!kiln_has_error()) kiln_set_error("%s: dataset is NULL", who);
    return false;
  }
  if (up->taken) {
    kiln_set_error("%s: the dataset is already the input of another stage (a chain is a line, not a tree)", who);
    return false;
  }
  return true;
}

kiln_dataset *ds_new(const char *who, const ds_ops *ops, size_t bytes, kiln_dataset *up, int arity) {
  kiln_dataset *ds = calloc(1, bytes);
  ds_part *scratch = calloc((size_t)arity, sizeof *scratch);
  if (!ds || !scratch) {
    free(ds);
    free(scratch);
    kiln_set_error("%s: out of memory", who);
    return NULL;
  }
  ds->ops = ops;
  ds->up = up;
  ds->arity = arity;
  ds->scratch = scratch;
  return ds;
}

kiln_dataset *ds_adopt(kiln_dataset *ds) {
  if (ds->up) ds->up->taken = true;
  return ds;
}

void ds_discard(kiln_dataset *ds) {
  if (!ds) return;
  ds->ops->release(ds);
  free(ds->scratch);
  free(ds);
}

void parts_release(int n, ds_part *p) {
  for (int i = 0; i < n; i++) {
    if (p[i].row < 0) kiln_release(p[i].t);
    p[i].t = NULL;
  }
}

int part_read(const char *who, ds_part p, void *dst) {
  size_t bytes = part_bytes(p);
  if (p.row >= 0) { /* from_tensors keeps its sources on the host */
    memcpy(dst, (const char *)p.t->data + (size_t)p.row * bytes, bytes);
    return 0;
  }
  if (!p.t->device) {
    memcpy(dst, p.t->data, bytes);
    return 0;
  }
  return device_read(who, p.t, dst, bytes);
}

kiln_tensor *part_take(const char *who, ds_part p) {
  if (p.row < 0) return p.t;
  kiln_tensor *t = tensor_alloc(who, (kiln_dtype)p.t->dtype, part_rank(p), part_shape(p));
  if (t) part_read(who, p, t->data);
  return t;
}

int kiln_dataset_next(kiln_dataset *ds, int n, kiln_tensor **out) {
  const char *who = "kiln_dataset_next";
  if (!ds) return kiln_has_error() ? -1 : kiln_set_error("%s: dataset is NULL", who);
  if (!out) return kiln_set_error("%s: out is NULL", who);
  for (int i = 0; i < n; i++) out[i] = NULL;
  if (n < ds->arity)
    return kiln_set_error("%s: out has %d slots, the elements have %d tensors", who, n, ds->arity);
  int rc = ds_next(ds, ds->scratch);
  if (rc != 1) return rc;
  for (int i = 0; i < ds->arity; i++) {
    kiln_tensor *t = part_take(who, ds->scratch[i]);
    ds->scratch[i].t = NULL;
    if (!t) { /* out of memory: nothing half-delivered */
      parts_release(ds->arity - i - 1, ds->scratch + i + 1);
      for (int j = 0; j < i; j++) kiln_release(out[j]);
      for (int j = 0; j < i; j++) out[j] = NULL;
      return -1;
    }
    out[i] = t;
  }
  /* into the caller's scope only now: a failure above releases what it made */
  for (int i = 0; i < ds->arity; i++)
    if (!(out[i] = scope_own(out[i]))) rc = -1; /* the scope's array could not grow */
  return rc;
}

void kiln_dataset_free(kiln_dataset *ds) {
  while (ds) { /* downstream first: a prefetch thread stops before its upstream goes */
    kiln_dataset *up = ds->up;
    ds_discard(ds);
    ds = up;
  }
}
