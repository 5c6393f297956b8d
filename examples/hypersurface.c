/* hypersurface.c — gradient tapes by example: the surface area of a 4-d box
 * and its gradient, a second derivative with nested tapes, a gradient
 * through C control flow, and two custom gradients (a numerically stable
 * log(1 + e^x), and gradient clipping). Each prints what it computes. */
#include <kiln.h>

/* The surface area of a 4-d box with sides x1..x4:
 * f4 = 2 (x1x2x3 + x1x2x4 + x1x3x4 + x2x3x4). */
static kiln_tensor *f4(kiln_tensor *const *x) {
  kiln_tensor *a = kiln_mul(kiln_mul(x[0], x[1]), x[2]);
  kiln_tensor *b = kiln_mul(kiln_mul(x[0], x[1]), x[3]);
  kiln_tensor *c = kiln_mul(kiln_mul(x[0], x[2]), x[3]);
  kiln_tensor *d = kiln_mul(kiln_mul(x[1], x[2]), x[3]);
  return kiln_mul(kiln_scalar_like(x[0], 2), kiln_add(kiln_add(a, b), kiln_add(c, d)));
}

static int hypersurface(void) {
  kiln_tensor *x[4];
  for (int i = 0; i < 4; i++) x[i] = kiln_scalar(KILN_F32, i + 1);
  kiln_tape *tape = kiln_tape_begin(false);
  for (int i = 0; i < 4; i++) kiln_tape_watch(tape, x[i]);
  kiln_tensor *y = f4(x), *g[4];
  int rc = kiln_tape_gradient(tape, y, 4, x, g);
  kiln_tape_free(tape);
  if (rc) return -1;
  printf("f4(1, 2, 3, 4) = %g, gradient (%g, %g, %g, %g)   [expect 100, (52, 38, 28, 22)]\n",
         kiln_tensor_item(y), kiln_tensor_item(g[0]), kiln_tensor_item(g[1]), kiln_tensor_item(g[2]),
         kiln_tensor_item(g[3]));
  return 0;
}

/* d(x x)/dx and d2(x x)/dx2 at 3: the outer tape records the inner
 * tape's gradient computation, so it can differentiate it again. */
static int second_derivative(void) {
  kiln_tensor *x = kiln_scalar(KILN_F32, 3), *dy, *d2y;
  kiln_tape *outer = kiln_tape_begin(false);
  kiln_tape_watch(outer, x);
  kiln_tape *inner = kiln_tape_begin(false);
  kiln_tape_watch(inner, x);
  kiln_tensor *y = kiln_mul(x, x);
  kiln_tape_end(inner);
  int rc = kiln_tape_gradient(inner, y, 1, &x, &dy);
  kiln_tape_end(outer);
  if (rc == 0) rc = kiln_tape_gradient(outer, dy, 1, &x, &d2y);
  kiln_tape_free(inner);
  kiln_tape_free(outer);
  if (rc) return -1;
  printf("x*x at 3: first derivative %g, second %g   [expect 6, 2]\n", kiln_tensor_item(dy),
         kiln_tensor_item(d2y));
  return 0;
}

/* abs written with C control flow: the tape records whichever branch ran. */
static kiln_tensor *my_abs(kiln_tensor *x) { return kiln_tensor_item(x) > 0 ? x : kiln_neg(x); }

static int control_flow(void) {
  for (int s = 1; s >= -1; s -= 2) {
    kiln_tensor *x = kiln_scalar(KILN_F32, 2.0 * s), *g;
    kiln_tape *tape = kiln_tape_begin(false);
    kiln_tape_watch(tape, x);
    int rc = kiln_tape_gradient(tape, my_abs(x), 1, &x, &g);
    kiln_tape_free(tape);
    if (rc) return -1;
    printf("d my_abs(x)/dx at %g = %g   [expect %d]\n", kiln_tensor_item(x), kiln_tensor_item(g), s);
  }
  return 0;
}

/* log(1 + e^x): in f32, e^100 overflows and the plain gradient
 * e^x / (1 + e^x) is inf / inf = NaN. The custom gradient
 * 1 - 1 / (1 + e^x) stays 1. */
static kiln_tensor *log1pexp(void *user, int n, kiln_tensor *const *xs) {
  (void)user, (void)n;
  return kiln_log(kiln_add(kiln_scalar_like(xs[0], 1), kiln_exp(xs[0])));
}
static int log1pexp_grad(void *user, int n, kiln_tensor *const *xs, kiln_tensor *y, kiln_tensor *dy,
                         kiln_tensor **dxs) {
  (void)user, (void)n, (void)y;
  kiln_tensor *one = kiln_scalar_like(xs[0], 1);
  dxs[0] = kiln_mul(dy, kiln_sub(one, kiln_div(one, kiln_add(one, kiln_exp(xs[0])))));
  return dxs[0] ? 0 : -1;
}

static int stable_gradient(void) {
  kiln_tensor *x = kiln_scalar(KILN_F32, 100), *plain, *custom;
  kiln_tape *tape = kiln_tape_begin(false);
  kiln_tape_watch(tape, x);
  int rc = kiln_tape_gradient(tape, log1pexp(NULL, 1, &x), 1, &x, &plain);
  kiln_tape_free(tape);
  tape = kiln_tape_begin(false);
  kiln_tape_watch(tape, x);
  kiln_tensor *y = kiln_custom_gradient(log1pexp, log1pexp_grad, NULL, 1, &x);
  if (rc == 0) rc = kiln_tape_gradient(tape, y, 1, &x, &custom);
  kiln_tape_free(tape);
  if (rc) return -1;
  printf("log(1 + e^x) at 100: plain gradient %g, custom gradient %g   [expect nan, 1]\n",
         kiln_tensor_item(plain), kiln_tensor_item(custom));
  return 0;
}

/* Gradient clipping: the identity forward, clip_by_norm of dy backward. */
static kiln_tensor *identity(void *user, int n, kiln_tensor *const *xs) {
  (void)user, (void)n;
  return kiln_identity(xs[0]);
}
static int clip_grad(void *user, int n, kiln_tensor *const *xs, kiln_tensor *y, kiln_tensor *dy,
                     kiln_tensor **dxs) {
  (void)n, (void)xs, (void)y;
  dxs[0] = kiln_clip_by_norm(dy, *(const double *)user);
  return dxs[0] ? 0 : -1;
}

static int clipping(void) {
  double max_norm = 2;
  kiln_tensor *x = kiln_tensor_new(KILN_F32, KILN_SHAPE(2), (float[]){1, 1}), *g;
  kiln_tensor *w = kiln_tensor_new(KILN_F32, KILN_SHAPE(2), (float[]){3, 4});
  kiln_tape *tape = kiln_tape_begin(false);
  kiln_tape_watch(tape, x);
  kiln_tensor *y = kiln_mul(kiln_custom_gradient(identity, clip_grad, &max_norm, 1, &x), w);
  int rc = kiln_tape_gradient(tape, y, 1, &x, &g);
  kiln_tape_free(tape);
  if (rc) return -1;
  float v[2];
  kiln_tensor_read(g, v, sizeof v);
  printf("gradient (3, 4) clipped to norm 2: (%g, %g)   [expect (1.2, 1.6)]\n", v[0], v[1]);
  return 0;
}

int main(void) {
  kiln_scope_push();
  int rc = hypersurface();
  if (rc == 0) rc = second_derivative();
  if (rc == 0) rc = control_flow();
  if (rc == 0) rc = stable_gradient();
  if (rc == 0) rc = clipping();
  if (rc) fprintf(stderr, "error: %s\n", kiln_last_error());
  kiln_scope_pop();
  return rc ? 1 : 0;
}
