/* repeat.c — kiln_dataset_repeat: upstream again and again, resetting it at
 * each end (each reset is a new epoch: a shuffle upstream draws a new
 * order). An upstream that ends without giving anything ends the repeat,
 * forever included, as tf.data's does. */
#include "dataset.h"

typedef struct {
  kiln_dataset base;
  int64_t count, done; /* count < 0: forever; done: epochs finished */
  bool gave;           /* this epoch gave an element or an error */
  bool dry;            /* an epoch gave nothing: the end */
} repeat;

static int repeat_next(kiln_dataset *ds, ds_part *out) {
  repeat *r = (repeat *)ds;
  for (;;) {
    if (r->dry || (r->count >= 0 && r->done >= r->count)) return 0;
    int rc = ds_next(ds->up, out);
    if (rc) {
      r->gave = true;
      return rc;
    }
    if (!r->gave) {
      r->dry = true;
      return 0;
    }
    r->done++;
    r->gave = false;
    if (r->count < 0 || r->done < r->count) ds->up->ops->reset(ds->up);
  }
}

static void repeat_reset(kiln_dataset *ds) {
  repeat *r = (repeat *)ds;
  r->done = 0;
  r->gave = r->dry = false;
  ds->up->ops->reset(ds->up);
}

static void repeat_release(kiln_dataset *ds) { (void)ds; }

static const ds_ops repeat_ops = {repeat_next, repeat_reset, repeat_release};

kiln_dataset *kiln_dataset_repeat(kiln_dataset *up, int64_t count) {
  const char *who = "kiln_dataset_repeat";
  if (!ds_input_ok(who, up)) return NULL;
  if (count < -1) {
    kiln_set_error("%s: count = %lld; -1 (forever) or >= 0", who, (long long)count);
    return NULL;
  }
  repeat *r = (repeat *)ds_new(who, &repeat_ops, sizeof(repeat), up, up->arity);
  if (!r) return NULL;
  r->count = count;
  return ds_adopt(&r->base);
}
