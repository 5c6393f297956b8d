/* map.c — kiln_dataset_map: each element's tensors through a staged
 * function, its outputs the new element. A call that fails comes out of
 * kiln_dataset_next as -1 with the function's name in the message; the
 * next call goes on with the following element. */
#include <stdio.h>
#include <stdlib.h>

#include "dataset.h"
#include "../../jit/function.h" /* f's name and arity: the one look inside jit/ */

typedef struct {
  kiln_dataset base;
  kiln_function *f; /* the caller's */
  int64_t index;    /* of the element upstream gives next, for messages */
  kiln_tensor **in, **res;
} map;

static int map_next(kiln_dataset *ds, ds_part *out) {
  map *m = (map *)ds;
  kiln_dataset *up = ds->up;
  int n_in = up->arity, n_out = ds->arity;
  int rc = ds_next(up, up->scratch);
  if (rc != 1) return rc;
  int64_t index = m->index++;
  for (int i = 0; i < n_in; i++) {
    m->in[i] = part_take("kiln_dataset_next", up->scratch[i]);
    up->scratch[i].t = NULL;
    if (!m->in[i]) rc = -1;
  }
  kiln_tensor **res = m->res;
  if (rc == 1) {
    /* a scope of our own: the outputs must outlive the caller's scopes */
    kiln_scope_push();
    rc = kiln_function_call(m->f, m->in, res) ? -1 : 1;
    for (int j = 0; j < n_out && rc == 1; j++) out[j] = (ds_part){kiln_retain(res[j]), -1};
    kiln_scope_pop();
  }
  for (int i = 0; i < n_in; i++) kiln_release(m->in[i]);
  if (rc == 1) return 1;
  char inner[1024];
  snprintf(inner, sizeof inner, "%s", kiln_last_error());
  size_t len = strlen(m->f->name);
  if (inner[0] == '@' && !strncmp(inner + 1, m->f->name, len) && inner[len + 1] == ':') /* "@f: ..." already */
    return kiln_set_error("kiln_dataset_next: map: element %lld: %s", (long long)index, inner);
  return kiln_set_error("kiln_dataset_next: map: element %lld: @%s: %s", (long long)index, m->f->name,
                        inner[0] ? inner : "failed");
}

static void map_reset(kiln_dataset *ds) {
  ((map *)ds)->index = 0;
  ds->up->ops->reset(ds->up);
}

static void map_release(kiln_dataset *ds) {
  free(((map *)ds)->in);
  free(((map *)ds)->res);
}

static const ds_ops map_ops = {map_next, map_reset, map_release};

kiln_dataset *kiln_dataset_map(kiln_dataset *up, kiln_function *f) {
  const char *who = "kiln_dataset_map";
  if (!ds_input_ok(who, up)) return NULL;
  if (!f) {
    kiln_set_error("%s: function is NULL", who);
    return NULL;
  }
  if (f->n_in != up->arity || f->n_out < 1) {
    kiln_set_error("%s: @%s takes %d inputs and gives %d outputs; the elements have %d tensors (and an element "
                   "needs at least one)", who, f->name, f->n_in, f->n_out, up->arity);
    return NULL;
  }
  map *m = (map *)ds_new(who, &map_ops, sizeof(map), up, f->n_out);
  if (!m) return NULL;
  m->f = f;
  m->in = calloc((size_t)up->arity, sizeof *m->in);
  m->res = calloc((size_t)f->n_out, sizeof *m->res);
  if (!m->in || !m->res) {
    kiln_set_error("%s: out of memory", who);
    ds_discard(&m->base);
    return NULL;
  }
  return ds_adopt(&m->base);
}
