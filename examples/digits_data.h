/* digits_data.h — scikit-learn's digits set as Kiln tensors, read from the
 * uint8 .npy files scripts/make_digits.py wrote under examples/data/:
 * images f32 [n, 8, 8, 1] (NHWC) scaled to [0, 1], labels i64 [n] in 0..9.
 * A small reader of NumPy's format for one dtype ('|u1', C order), written
 * against <kiln.h> alone, as a user of the library would. Shared by
 * examples/digits_cnn.c, bench/bench_digits.c and tests/digits_cnn_test.cc
 * (it compiles as C11 and as C++). */
#ifndef KILN_EXAMPLES_DIGITS_DATA_H
#define KILN_EXAMPLES_DIGITS_DATA_H

#include <kiln.h>

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The data folder: $KILN_DIGITS_DATA, else DIGITS_DATA_DIR (the source
   tree's examples/data, which CMake passes), else examples/data (a run from
   the repository's root). */
#ifndef DIGITS_DATA_DIR
#define DIGITS_DATA_DIR "examples/data"
#endif
static inline const char *digits_data_dir(void) {
  const char *env = getenv("KILN_DIGITS_DATA");
  return env && *env ? env : DIGITS_DATA_DIR;
}

/* Reads a C-order uint8 .npy file (format versions 1 to 3) of rank <= 4
   into a malloc'd buffer: *data (free() it), *rank, shape[0..rank).
   0, or -1 with Kiln's error set (kiln_fail) naming the file. */
static inline int digits_read_u8_npy(const char *path, int *rank, int64_t shape[4], unsigned char **data) {
  FILE *f = fopen(path, "rb");
  if (!f) return kiln_fail("digits: cannot open %s", path);
  unsigned char pre[12];
  char *header = NULL;
  unsigned char *buf = NULL;
  int rc = -1;
  size_t hlen;
  if (fread(pre, 1, 10, f) != 10 || memcmp(pre, "\x93NUMPY", 6) != 0) {
    kiln_fail("digits: %s is not a .npy file", path);
    goto done;
  }
  if (pre[6] == 1) {
    hlen = (size_t)pre[8] | (size_t)pre[9] << 8;
  } else if (pre[6] == 2 || pre[6] == 3) {
    if (fread(pre + 10, 1, 2, f) != 2) {
      kiln_fail("digits: %s: truncated header", path);
      goto done;
    }
    hlen = (size_t)pre[8] | (size_t)pre[9] << 8 | (size_t)pre[10] << 16 | (size_t)pre[11] << 24;
  } else {
    kiln_fail("digits: %s: .npy format version %d is not 1, 2 or 3", path, pre[6]);
    goto done;
  }
  if (hlen == 0 || hlen > 65536) {
    kiln_fail("digits: %s: header of %zu bytes", path, hlen);
    goto done;
  }
  header = (char *)malloc(hlen + 1);
  if (!header || fread(header, 1, hlen, f) != hlen) {
    kiln_fail("digits: %s: truncated header", path);
    goto done;
  }
  header[hlen] = 0;
  if (!strstr(header, "'descr': '|u1'") && !strstr(header, "'descr': '<u1'")) {
    kiln_fail("digits: %s: dtype is not uint8 ('|u1'): %s", path, header);
    goto done;
  }
  if (!strstr(header, "'fortran_order': False")) {
    kiln_fail("digits: %s: not in C order", path);
    goto done;
  }
  {
    const char *p = strstr(header, "'shape': (");
    if (!p) {
      kiln_fail("digits: %s: no shape in the header", path);
      goto done;
    }
    p += strlen("'shape': (");
    int r = 0;
    int64_t n = 1;
    while (*p && *p != ')') {
      char *end;
      long long d = strtoll(p, &end, 10);
      if (end == p || d < 0 || r == 4) {
        kiln_fail("digits: %s: bad shape in the header", path);
        goto done;
      }
      shape[r++] = d;
      n *= d;
      p = end;
      while (*p == ',' || *p == ' ') p++;
    }
    if (*p != ')' || n > ((int64_t)1 << 30)) {
      kiln_fail("digits: %s: bad shape in the header", path);
      goto done;
    }
    buf = (unsigned char *)malloc(n ? (size_t)n : 1);
    if (!buf || fread(buf, 1, (size_t)n, f) != (size_t)n) {
      kiln_fail("digits: %s: %lld data bytes expected, fewer found", path, (long long)n);
      goto done;
    }
    if (fgetc(f) != EOF) {
      kiln_fail("digits: %s: bytes after the data", path);
      goto done;
    }
    *rank = r;
    *data = buf;
    buf = NULL;
    rc = 0;
  }
done:
  free(header);
  free(buf);
  fclose(f);
  return rc;
}

/* split "train" or "test" from dir (NULL: digits_data_dir()): *images f32
   [n, 8, 8, 1] in [0, 1] (the pixels 0..16 divided by 16), *labels i64 [n].
   Both caller-owned (or the innermost scope's). 0, or -1 with the error set. */
static inline int digits_load(const char *dir, const char *split, kiln_tensor **images, kiln_tensor **labels) {
  char path[4096];
  int rank_x = 0, rank_y = 0;
  int64_t shape_x[4] = {0}, shape_y[4] = {0};
  unsigned char *x8 = NULL, *y8 = NULL;
  if (!dir) dir = digits_data_dir();
  snprintf(path, sizeof path, "%s/digits_%s_images.npy", dir, split);
  if (digits_read_u8_npy(path, &rank_x, shape_x, &x8)) return -1;
  snprintf(path, sizeof path, "%s/digits_%s_labels.npy", dir, split);
  if (digits_read_u8_npy(path, &rank_y, shape_y, &y8)) {
    free(x8);
    return -1;
  }
  int rc = -1;
  int64_t n = shape_x[0];
  if (rank_x != 4 || shape_x[1] != 8 || shape_x[2] != 8 || shape_x[3] != 1 || rank_y != 1 || shape_y[0] != n) {
    kiln_fail("digits: %s: images and labels are not [n, 8, 8, 1] and [n]", dir);
  } else {
    float *xf = (float *)malloc((size_t)(n * 64) * sizeof *xf + 1);
    int64_t *yi = (int64_t *)malloc((size_t)n * sizeof *yi + 1);
    int bad = 0;
    for (int64_t i = 0; xf && i < n * 64; i++) {
      bad |= x8[i] > 16;
      xf[i] = (float)x8[i] / 16.0f;
    }
    for (int64_t i = 0; yi && i < n; i++) {
      bad |= y8[i] > 9;
      yi[i] = y8[i];
    }
    if (!xf || !yi) {
      kiln_fail("digits: out of memory");
    } else if (bad) {
      kiln_fail("digits: %s: a pixel above 16 or a label above 9", dir);
    } else {
      int64_t xs[4] = {n, 8, 8, 1};
      *images = kiln_tensor_new(KILN_F32, 4, xs, xf);
      *labels = kiln_tensor_new(KILN_I64, 1, &n, yi);
      rc = *images && *labels ? 0 : -1;
    }
    free(xf);
    free(yi);
  }
  free(x8);
  free(y8);
  return rc;
}

#endif
