/* metrics.c — running means over a training or evaluation loop, as
 * tf.keras.metrics keeps them: Mean (of every element seen) and Accuracy
 * (of class predictions against labels). Sums are kept in double on the
 * host, whatever the tensors' dtype or device. */
#include <math.h>
#include <stdlib.h>

#include "runtime.h"

#define UPDATE "metric_update"

typedef enum { METRIC_MEAN, METRIC_ACCURACY } metric_kind;

struct kiln_metric {
  metric_kind kind;
  double sum;    /* of the values (mean), of the correct predictions (accuracy) */
  int64_t count; /* elements (mean), examples (accuracy) */
};

static kiln_metric *metric_new(metric_kind kind) {
  kiln_metric *m = calloc(1, sizeof *m);
  if (!m) kiln_set_error("metric_new: out of memory");
  if (m) m->kind = kind;
  return m;
}

kiln_metric *kiln_metric_mean_new(void) { return metric_new(METRIC_MEAN); }
kiln_metric *kiln_metric_accuracy_new(void) { return metric_new(METRIC_ACCURACY); }

void kiln_metric_reset(kiln_metric *m) {
  if (!m) return;
  m->sum = 0;
  m->count = 0;
}

void kiln_metric_free(kiln_metric *m) { free(m); }

double kiln_metric_result(const kiln_metric *m) {
  if (!m) {
    kiln_set_error("metric_result: metric is NULL");
    return NAN;
  }
  return m->count ? m->sum / (double)m->count : NAN;
}

/* The class of row i of x [n, c]: the first index of its largest value;
 * -1 when the row holds a NaN (it predicts nothing). */
static int64_t row_argmax(const kiln_tensor *x, int64_t i) {
  int64_t c = x->shape[1], best = -1;
  double top = 0;
  for (int64_t j = 0; j < c; j++) {
    double v = dtype_load((kiln_dtype)x->dtype, x->data, i * c + j);
    if (isnan(v)) return -1;
    if (best < 0 || v > top) best = j, top = v;
  }
  return best;
}

/* The class of example i: an integer of a [n] tensor, or a row's argmax. */
static int64_t class_of(const kiln_tensor *x, int64_t i) {
  if (x->rank == 2) return row_argmax(x, i);
  return x->dtype == KILN_I32 ? ((const int32_t *)x->data)[i] : ((const int64_t *)x->data)[i];
}

/* labels [n] integers or [n, c] one-hot; predictions [n] integers or [n, c]
 * scores. Both on the host. */
static int update_accuracy(kiln_metric *m, const kiln_tensor *labels, const kiln_tensor *pred) {
  char sa[256], sb[256];
  const kiln_tensor *ts[2] = {labels, pred};
  const char *names[2] = {"labels", "predictions"};
  for (int k = 0; k < 2; k++) {
    const kiln_tensor *x = ts[k];
    if (x->rank == 1 && !dtype_is_int((kiln_dtype)x->dtype))
      return kiln_set_error("%s: %s of shape %s are %s; [n] %s must be i32 or i64 class ids (or pass [n, "
                            "classes] scores)", UPDATE, names[k], shape_str(sa, sizeof sa, x->rank, x->shape),
                            kiln_dtype_name((kiln_dtype)x->dtype), names[k]);
    if (x->rank != 1 && x->rank != 2)
      return kiln_set_error("%s: %s have shape %s; accuracy takes [n] class ids or [n, classes] scores", UPDATE,
                            names[k], shape_str(sa, sizeof sa, x->rank, x->shape));
    if (x->rank == 2 && x->dtype == KILN_BOOL)
      return kiln_set_error("%s: %s are bool; [n, classes] scores must be numbers", UPDATE, names[k]);
  }
  bool same_n = labels->shape[0] == pred->shape[0];
  bool same_c = labels->rank == 1 || pred->rank == 1 || labels->shape[1] == pred->shape[1];
  if (!same_n || !same_c)
    return kiln_set_error("%s: labels of shape %s do not match predictions of shape %s", UPDATE,
                          shape_str(sa, sizeof sa, labels->rank, labels->shape),
                          shape_str(sb, sizeof sb, pred->rank, pred->shape));
  int64_t n = labels->shape[0], correct = 0;
  for (int64_t i = 0; i < n; i++) {
    int64_t want = class_of(labels, i), got = class_of(pred, i);
    correct += got >= 0 && got == want;
  }
  m->sum += (double)correct;
  m->count += n;
  return 0;
}

static int update_mean(kiln_metric *m, const kiln_tensor *x) {
  double s = 0;
  for (int64_t i = 0; i < x->size; i++) s += dtype_load((kiln_dtype)x->dtype, x->data, i);
  m->sum += s;
  m->count += x->size;
  return 0;
}

int kiln_metric_update(kiln_metric *m, kiln_tensor *a, kiln_tensor *b) {
  if (!m) return kiln_set_error("%s: metric is NULL", UPDATE);
  if (!a) return kiln_has_error() ? -1 : kiln_set_error("%s: the first tensor is NULL", UPDATE);
  if (m->kind == METRIC_MEAN && b)
    return kiln_set_error("%s: a mean takes one tensor (pass NULL as the second)", UPDATE);
  if (m->kind == METRIC_ACCURACY && !b)
    return kiln_has_error() ? -1 : kiln_set_error("%s: accuracy needs predictions (the second tensor is NULL)", UPDATE);
  kiln_tensor *ca = NULL, *cb = NULL;
  const kiln_tensor *ha = tensor_on_host(UPDATE, a, &ca);
  const kiln_tensor *hb = ha && b ? tensor_on_host(UPDATE, b, &cb) : NULL;
  int rc = -1;
  if (ha && m->kind == METRIC_MEAN) rc = update_mean(m, ha);
  if (ha && hb && m->kind == METRIC_ACCURACY) rc = update_accuracy(m, ha, hb);
  kiln_release(ca);
  kiln_release(cb);
  return rc;
}
