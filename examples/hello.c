#include <kiln.h>

int main(void) {
  kiln_scope_push(); /* owns every tensor made until the pop */
  kiln_tensor *x = kiln_tensor_new(KILN_F32, KILN_SHAPE(2, 2), (float[]){1, 2, 3, 4});
  kiln_tensor *w = kiln_ones(KILN_F32, KILN_SHAPE(2, 2));
  kiln_tensor *y = kiln_relu(kiln_sub(kiln_matmul(x, w), kiln_scalar(KILN_F32, 4)));
  int ok = y != NULL; /* a failure anywhere in the chain ends in NULL */
  if (ok)
    kiln_tensor_print(y, stdout); /* kiln.Tensor([[0. 0.] [3. 3.]], shape=(2, 2), dtype=f32) */
  else
    fprintf(stderr, "error: %s\n", kiln_last_error());
  kiln_scope_pop(); /* releases x, w, y and the temporaries */
  return ok ? 0 : 1;
}
