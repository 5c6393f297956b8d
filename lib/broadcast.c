/* broadcast.c — strides for reading an input under NumPy broadcasting. */
#include "ops.h"

void broadcast_strides(int rank, const int64_t *shape, int out_rank, const int64_t *out_shape,
                       int64_t *strides) {
  int64_t s = 1;
  for (int i = out_rank - 1; i >= 0; i--) {
    int j = rank - out_rank + i;
    if (j < 0 || shape[j] == 1) {
      strides[i] = 0;
    } else {
      strides[i] = s;
    }
    if (j >= 0) s *= shape[j];
    (void)out_shape;
  }
}
