/* bn_eager.h — batch norm's eager CPU passes (bn_eager.c): the forward in
 * one pass, and the full-size pieces of its backward and of moments'
 * without their op-by-op intermediates. Each returns NULL (or 1) without
 * an error where it does not apply (inside a trace, on a device, symbolic
 * tensors, statistics that are not one value per channel of the last
 * axis) and the caller runs the public ops instead. Internal. */
#ifndef KILN_BN_EAGER_H
#define KILN_BN_EAGER_H

#include "runtime.h"

/* ((x - mean) * rsqrt(ve)) * scale + offset (scale, offset may be NULL),
 * with the bits of those elementwise ops. */
kiln_tensor *bn_eager_forward(kiln_tensor *x, kiln_tensor *mean, kiln_tensor *ve, kiln_tensor *scale,
                              kiln_tensor *offset);

/* (x - a) * b, a and b one value per channel: the bits of kiln_mul(kiln_sub(x,
 * a), b). Not differentiable: NULL while a tape records. */
kiln_tensor *bn_eager_centered_scale(kiln_tensor *x, kiln_tensor *a, kiln_tensor *b);

/* *s0 = sum(dy) and *s1 = sum(dy * (x - mean)) over every axis but the
 * last, each of mean's shape (one value per channel), reading dy and x
 * once. The sums run in a fixed order of blocks of rows (f32 blocks
 * combined in f64), the same for any thread count, not reduce_sum's.
 * 0, 1 where it does not apply (or while a tape records), -1 with the
 * error set. */
int bn_eager_sums(kiln_tensor *dy, kiln_tensor *x, kiln_tensor *mean, kiln_tensor **s0, kiln_tensor **s1);

/* *var = mean((x - mean)^2) over every axis but the last, of the given
 * shape (mean's elements), reading x once (the sum in bn_eager_sums'
 * order, divided in f64). 0, 1 where it does not apply (or while a tape
 * records), -1 with the error set. */
int bn_eager_variance(kiln_tensor *x, kiln_tensor *mean, int rank, const int64_t *shape, kiln_tensor **var);

/* dx = a * dy + b * (x - mean) + c, each of mean, a, b, c one value per
 * channel, in one pass over dy and x. Not differentiable: NULL while a
 * tape records. */
kiln_tensor *bn_eager_dx(kiln_tensor *dy, kiln_tensor *x, kiln_tensor *mean, kiln_tensor *a, kiln_tensor *b,
                         kiln_tensor *c);

/* *dx = relu's gradient select(x > 0, dy, 0), with its bits, in one pass
 * over dy and x (the public ops write and read a mask). 0, 1 where it does
 * not apply (or while a tape records), -1 with the error set. */
int relu_eager_grad(kiln_tensor *dy, kiln_tensor *x, kiln_tensor **dx);

#endif
