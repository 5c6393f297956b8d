/* linear_regression.c — the TF eager guide's first training loop in Kiln:
 * fit y = W x + B to noisy samples of y = 3x + 2 with a gradient tape,
 * variables and plain SGD on the mean squared error.
 *
 * Each SGD step shrinks the distance to (3, 2) by about 1 - 2 * 0.01, so
 * from (5, 10) B is within 8 * 0.98^steps of 2: about 0.14 after 200 steps
 * and 0.02 after 300, the guide's count. Pass the step count as argv[1]. */
#include <kiln.h>
#include <stdlib.h>

/* mean((W x + B - y)^2): the variables are read, so every active tape watches them */
static kiln_tensor *loss(kiln_variable *w, kiln_variable *b, kiln_tensor *x, kiln_tensor *y) {
  kiln_tensor *pred = kiln_add(kiln_mul(x, kiln_variable_read(w)), kiln_variable_read(b));
  return kiln_reduce_mean(kiln_square(kiln_sub(pred, y)), 0, NULL, false);
}

int main(int argc, char **argv) {
  int steps = argc > 1 ? atoi(argv[1]) : 300;
  const int64_t n = 1000;
  kiln_random_seed(42);
  kiln_scope_push();
  kiln_tensor *x = kiln_random_normal(KILN_F32, KILN_SHAPE(n));
  kiln_tensor *noise = kiln_random_normal(KILN_F32, KILN_SHAPE(n));
  kiln_tensor *y = kiln_add(kiln_add(kiln_mul(x, kiln_scalar(KILN_F32, 3)), kiln_scalar(KILN_F32, 2)), noise);

  kiln_variable *vars[2] = {kiln_variable_new(kiln_scalar(KILN_F32, 5), "W"),
                            kiln_variable_new(kiln_scalar(KILN_F32, 10), "B")};
  kiln_optimizer *sgd = kiln_sgd_new(0.01);
  int rc = y && vars[0] && vars[1] && sgd ? 0 : -1;
  if (rc == 0) printf("initial loss %.4f\n", kiln_tensor_item(loss(vars[0], vars[1], x, y)));

  for (int step = 0; step < steps && rc == 0; step++) {
    kiln_scope_push(); /* this step's tensors die at its end */
    kiln_tape *tape = kiln_tape_begin(false);
    kiln_tensor *l = loss(vars[0], vars[1], x, y);
    kiln_tensor *grads[2];
    rc = kiln_tape_gradient_vars(tape, l, 2, vars, grads);
    kiln_tape_free(tape);
    if (rc == 0) rc = kiln_optimizer_apply(sgd, 2, vars, grads);
    if (rc == 0 && (step % 50 == 0 || step == steps - 1))
      printf("step %3d  loss %.4f  W %.4f  B %.4f\n", step, kiln_tensor_item(l),
             kiln_tensor_item(kiln_variable_read(vars[0])), kiln_tensor_item(kiln_variable_read(vars[1])));
    kiln_scope_pop();
  }
  if (rc == 0)
    printf("after %d steps: W = %.4f (true 3), B = %.4f (true 2), loss %.4f\n", steps,
           kiln_tensor_item(kiln_variable_read(vars[0])), kiln_tensor_item(kiln_variable_read(vars[1])),
           kiln_tensor_item(loss(vars[0], vars[1], x, y)));
  else
    fprintf(stderr, "error: %s\n", kiln_last_error());

  kiln_optimizer_free(sgd);
  kiln_variable_free(vars[0]);
  kiln_variable_free(vars[1]);
  kiln_scope_pop();
  return rc == 0 ? 0 : 1;
}
