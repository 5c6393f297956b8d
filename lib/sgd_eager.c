/* sgd_eager.c — SGD with momentum's eager CPU step in one pass
 * (sgd_eager.h): each element with the op-by-op roundings in the same
 * order (m * momentum, + g, * lr, var - that; no contraction: ISO C), so
 * its bits equal optimizer.c's ops while each value is read and written
 * once. */
#include "autodiff.h"
#include "sgd_eager.h"
#include "variable.h"
#include "../jit/jit.h"

enum { SGD_GRAIN = 1 << 14 }; /* elements a task takes at least */

typedef struct {
  const void *p, *m, *g;
  void *p1, *m1;
  double momentum, lr;
  bool nesterov, f32;
} sgd_pass;

#define SGD_ROWS(T)                                                                                  \
  KILN_HOT static void sgd_##T(const sgd_pass *s, int64_t b, int64_t e) {                           \
    const T *KILN_RESTRICT p = s->p, *KILN_RESTRICT m = s->m, *KILN_RESTRICT g = s->g;              \
    T *KILN_RESTRICT p1 = s->p1, *KILN_RESTRICT m1 = s->m1;                                          \
    T mom = (T)s->momentum, lr = (T)s->lr;                                                           \
    if (s->nesterov) {                                                                               \
      for (int64_t i = b; i < e; i++) {                                                              \
        T v = m[i] * mom;                                                                            \
        v = v + g[i];                                                                                \
        m1[i] = v;                                                                                   \
        T t = v * mom;                                                                               \
        t = g[i] + t;                                                                                \
        t = t * lr;                                                                                  \
        p1[i] = p[i] - t;                                                                            \
      }                                                                                              \
    } else {                                                                                         \
      for (int64_t i = b; i < e; i++) {                                                              \
        T v = m[i] * mom;                                                                            \
        v = v + g[i];                                                                                \
        m1[i] = v;                                                                                   \
        T t = v * lr;                                                                                \
        p1[i] = p[i] - t;                                                                            \
      }                                                                                              \
    }                                                                                                \
  }
SGD_ROWS(float)
SGD_ROWS(double)

static void sgd_task(void *ctx, int64_t b, int64_t e) {
  const sgd_pass *s = ctx;
  if (s->f32)
    sgd_float(s, b, e);
  else
    sgd_double(s, b, e);
}

/* a dense value of g's dtype and size on the CPU, outside a trace */
static bool host_like(const kiln_tensor *t, const kiln_tensor *g) {
  return t && !t->device && !(t->flags & TF_SYMBOLIC) && t->dtype == g->dtype && t->size == g->size;
}

int sgd_momentum_eager(kiln_variable *var, kiln_variable *mv, kiln_tensor *g, double momentum, double lr,
                       bool nesterov) {
  if (trace_current || device_now || !g || g->device || (g->flags & TF_SYMBOLIC) ||
      (g->dtype != KILN_F32 && g->dtype != KILN_F64))
    return 1;
  kiln_tensor *m = variable_acquire(mv);
  if (!host_like(m, g)) {
    kiln_release(m);
    return 1;
  }
  const char *op = "optimizer_apply";
  kiln_tensor *m1 = tensor_alloc(op, (kiln_dtype)g->dtype, g->rank, g->shape);
  kiln_tensor *p1 = m1 ? tensor_alloc(op, (kiln_dtype)g->dtype, g->rank, g->shape) : NULL;
  if (!p1) {
    kiln_release(m), kiln_release(m1);
    return -1;
  }
  int rc = 0;
  variable_lock(var);
  kiln_tensor *p = variable_value_locked(var);
  if (!host_like(p, g)) {
    rc = 1;
  } else {
    sgd_pass s = {p->data, m->data, g->data, p1->data, m1->data, momentum, lr, nesterov, g->dtype == KILN_F32};
    parallel_for(g->size, SGD_GRAIN, sgd_task, &s);
    variable_set_value_locked(var, p1);
    p1 = NULL;
  }
  variable_unlock(var);
  kiln_release(m), kiln_release(p1);
  if (rc) {
    kiln_release(m1);
    return rc;
  }
  variable_lock(mv);
  variable_set_value_locked(mv, m1);
  variable_unlock(mv);
  return 0;
}
