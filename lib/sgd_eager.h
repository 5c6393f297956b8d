/* sgd_eager.h — SGD with momentum's eager CPU step in one pass
 * (sgd_eager.c). Internal. */
#ifndef KILN_SGD_EAGER_H
#define KILN_SGD_EAGER_H

#include "runtime.h"

/* m = m * momentum + g; delta = m * lr (nesterov: (g + m * momentum) * lr);
 * var = var - delta: optimizer.c's update of one variable (var, its
 * velocity slot m) with the bits of those ops, reading var, m and g once
 * and writing var's and m's new values once each (the ops and the copy
 * each assignment makes passed over the 25M parameters of a ResNet-50 ten
 * times). var's value is read and replaced under its lock, as
 * kiln_variable_assign_sub does. 0; 1 where it does not apply (a trace, a
 * device, other dtypes than f32 and f64), and the caller runs the ops; -1
 * with the error set. */
int sgd_momentum_eager(kiln_variable *var, kiln_variable *m, kiln_tensor *g, double momentum, double lr,
                       bool nesterov);

#endif
