/* checkpoint_fuzz.c — libFuzzer target for the safetensors reader: every
 * input is a whole file, fed to the restore path from memory (fmemopen) with
 * variables named like those of the seed corpus, so the header parser, the
 * layout checks, the variable checks and the data reads all run. Built and
 * run by scripts/fuzz.sh checkpoint (clang, outside the CMake build). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "checkpoint.h"

enum { NVARS = 6 };
static kiln_variable *vars[NVARS];

/* The variables every run restores into; scripts/fuzz.sh writes seeds that
 * hold tensors of exactly these names, dtypes and shapes. */
static void make_vars(void) {
  float w[6] = {1, 2, 3, 4, 5, 6};
  int64_t step = 7;
  uint16_t h[3] = {0x3c00, 0x4000, 0xbc00};
  uint8_t m[2] = {1, 0};
  double d = 0.5;
  kiln_tensor *init[NVARS] = {
      kiln_tensor_new(KILN_F32, KILN_SHAPE(2, 3), w),  kiln_tensor_new(KILN_I64, 0, NULL, &step),
      kiln_tensor_new(KILN_F16, KILN_SHAPE(3), h),     kiln_tensor_new(KILN_BOOL, KILN_SHAPE(2), m),
      kiln_tensor_new(KILN_F64, KILN_SHAPE(1, 1), &d), kiln_zeros(KILN_BF16, KILN_SHAPE(0, 2)),
  };
  const char *names[NVARS] = {"w", "step", "h", "m", "d", "e"};
  for (int i = 0; i < NVARS; i++) {
    vars[i] = kiln_variable_new(init[i], names[i]);
    kiln_release(init[i]);
    if (!vars[i]) {
      fprintf(stderr, "checkpoint_fuzz: %s\n", kiln_last_error());
      abort(); /* the harness itself is broken, not the input */
    }
  }
}

static void restore(const uint8_t *data, size_t size, int first, int n) {
  /* fmemopen refuses a zero-size buffer; /dev/null is an empty seekable file */
  FILE *f = size ? fmemopen((void *)data, size, "rb") : fopen("/dev/null", "rb");
  if (!f) return;
  int rc = checkpoint_restore_stream("fuzz", f, n, vars + first);
  fclose(f);
  if (rc != 0 && (rc != -1 || strncmp(kiln_last_error(), "checkpoint_restore: ", 20) != 0)) {
    fprintf(stderr, "checkpoint_fuzz: rc %d, error '%s'\n", rc, kiln_last_error());
    abort();
  }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (!vars[0]) make_vars();
  kiln_clear_error();
  restore(data, size, 0, NVARS); /* all of them */
  restore(data, size, 0, 0);     /* only the file's own checks */
  for (int i = 0; i < NVARS; i++) restore(data, size, i, 1);
  /* the variables keep their dtypes and shapes whatever happened */
  kiln_scope_push();
  kiln_tensor *w = kiln_variable_read(vars[0]);
  if (kiln_tensor_rank(w) != 2 || kiln_tensor_shape(w)[0] != 2 || kiln_tensor_shape(w)[1] != 3) abort();
  kiln_scope_pop();
  return 0;
}
