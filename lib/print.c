/* print.c — kiln_tensor_str and kiln_tensor_print (API.md §2): a tensor as
 * one line of NumPy-style text, "kiln.Tensor([[2. 3.] [4. 5.]], shape=(2, 2),
 * dtype=f32)", summarised with "..." past 1000 elements as NumPy does. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "runtime.h"

/* NumPy's print options: summarise above this many elements, showing this
 * many items at each end of every axis longer than twice as many. */
#define SUMMARY_THRESHOLD 1000
#define EDGE_ITEMS 3

/* ---- a growing string; on out of memory it stops growing and says so ---- */

typedef struct {
  char *p;
  size_t len, cap;
  bool oom;
} strbuf;

static void sb_add(strbuf *b, const char *s, size_t n) {
  if (b->oom) return;
  if (b->len + n + 1 > b->cap) {
    size_t cap = b->cap ? b->cap : 256;
    while (cap < b->len + n + 1) cap *= 2;
    char *p = realloc(b->p, cap);
    if (!p) {
      b->oom = true;
      return;
    }
    b->p = p;
    b->cap = cap;
  }
  memcpy(b->p + b->len, s, n);
  b->len += n;
  b->p[b->len] = '\0';
}

static void sb_puts(strbuf *b, const char *s) { sb_add(b, s, strlen(s)); }

/* ---- floats ----
 * Each value is written in its shortest form that reads back to the same
 * value of its own dtype, with at most 8 significant digits (16 for f64).
 * As NumPy decides per array, a tensor is written in scientific notation
 * when a shown finite nonzero magnitude is below 1e-4 or reaches 10^digits
 * (1e8 for f32, 1e16 for f64), so the elements of one tensor read alike.
 * Unlike NumPy's multi-line layout, nothing is padded to a common width:
 * "[1.5 2.]", not "[1.5 2. ]". Integral values keep a trailing dot ("2."),
 * scientific mantissas do not ("1e+20", as Python's repr). */

static int max_digits(kiln_dtype dt) { return dt == KILN_F64 ? 16 : 8; }

/* Does the text s read back to v as dtype dt? */
static bool round_trips(kiln_dtype dt, const char *s, double v) {
  switch (dt) {
    case KILN_F64: return strtod(s, NULL) == v;
    case KILN_F16: return kiln_f16_to_f32(kiln_f32_to_f16(strtof(s, NULL))) == (float)v;
    case KILN_BF16: return kiln_bf16_to_f32(kiln_f32_to_bf16(strtof(s, NULL))) == (float)v;
    default: return strtof(s, NULL) == (float)v;
  }
}

/* The shortest significant digits of |v| (finite, nonzero or zero) into
 * digits, without trailing zeros; returns the decimal exponent of the first. */
static int shortest_digits(kiln_dtype dt, double v, char *digits) {
  char buf[48];
  int maxp = max_digits(dt);
  for (int p = 1; p <= maxp; p++) {
    snprintf(buf, sizeof buf, "%.*e", p - 1, v);
    if (p == maxp || round_trips(dt, buf, v)) break;
  }
  /* buf is "[-]d[.ddd]e[+-]xx"; read the digits whatever the locale's radix */
  int n = 0;
  const char *c = buf;
  for (; *c && *c != 'e'; c++)
    if (*c >= '0' && *c <= '9') digits[n++] = *c;
  while (n > 1 && digits[n - 1] == '0') n--;
  digits[n] = '\0';
  return *c == 'e' ? atoi(c + 1) : 0;
}

static void format_float(strbuf *b, kiln_dtype dt, double v, bool sci) {
  if (isnan(v) || isinf(v)) {
    sb_puts(b, isnan(v) ? "nan" : v < 0 ? "-inf" : "inf");
    return;
  }
  char digits[32], out[96];
  int e = shortest_digits(dt, fabs(v), digits), n = (int)strlen(digits), k = 0;
  if (signbit(v)) out[k++] = '-';
  if (sci) {
    out[k++] = digits[0];
    if (n > 1) {
      out[k++] = '.';
      for (int i = 1; i < n; i++) out[k++] = digits[i];
    }
    k += snprintf(out + k, sizeof out - (size_t)k, "e%c%02d", e < 0 ? '-' : '+', abs(e));
  } else if (e >= 0) { /* digits[0..e] before the point, zeros past the digits */
    for (int i = 0; i <= e; i++) out[k++] = i < n ? digits[i] : '0';
    out[k++] = '.';
    for (int i = e + 1; i < n; i++) out[k++] = digits[i];
  } else { /* 0.000ddd */
    out[k++] = '0';
    out[k++] = '.';
    for (int i = 0; i < -e - 1; i++) out[k++] = '0';
    for (int i = 0; i < n; i++) out[k++] = digits[i];
  }
  sb_add(b, out, (size_t)k);
}

/* ---- walking the shown elements ---- */

typedef struct {
  const kiln_tensor *t;
  kiln_dtype dt;
  bool summarise, sci;
  double min_abs, max_abs; /* over shown finite nonzero floats; max_abs < 0: none */
  strbuf *out;             /* NULL: only measure */
} walk;

static void element(walk *w, int64_t i) {
  const void *data = w->t->data;
  char buf[32];
  switch (w->dt) {
    case KILN_I32: snprintf(buf, sizeof buf, "%d", (int)((const int32_t *)data)[i]); break;
    case KILN_I64: snprintf(buf, sizeof buf, "%lld", (long long)((const int64_t *)data)[i]); break;
    case KILN_BOOL: snprintf(buf, sizeof buf, "%s", ((const uint8_t *)data)[i] ? "True" : "False"); break;
    default: {
      double v = dtype_load(w->dt, data, i);
      if (!w->out) {
        double a = fabs(v);
        if (isfinite(v) && a != 0) {
          if (w->max_abs < 0) w->min_abs = w->max_abs = a;
          w->max_abs = a > w->max_abs ? a : w->max_abs;
          w->min_abs = a < w->min_abs ? a : w->min_abs;
        }
      } else {
        format_float(w->out, w->dt, v, w->sci);
      }
      return;
    }
  }
  if (w->out) sb_puts(w->out, buf);
}

/* The sub-tensor at flat offset `base` from axis `axis` on, as nested
 * brackets; with summarise, long axes show EDGE_ITEMS at each end. */
static void walk_axis(walk *w, int axis, int64_t base, int64_t stride) {
  if (axis == w->t->rank) {
    element(w, base);
    return;
  }
  int64_t dim = w->t->shape[axis], inner = stride / (dim ? dim : 1);
  bool cut = w->summarise && dim > 2 * EDGE_ITEMS;
  if (w->out) sb_puts(w->out, "[");
  for (int64_t i = 0; i < dim; i++) {
    if (cut && i == EDGE_ITEMS) {
      if (w->out) sb_puts(w->out, " ...");
      i = dim - EDGE_ITEMS;
    }
    if (w->out && i > 0) sb_puts(w->out, " ");
    walk_axis(w, axis + 1, base + i * inner, inner);
  }
  if (w->out) sb_puts(w->out, "]");
}

static char *tensor_text(const char *op, const kiln_tensor *t) {
  if (!t) {
    if (!kiln_has_error()) kiln_set_error("%s: tensor is NULL", op);
    return NULL;
  }
  if (t->flags & TF_SYMBOLIC) {
    kiln_set_error("%s: the tensor is symbolic (being traced) and has no value yet", op);
    return NULL;
  }
  if (t->device != 0) { /* a GPU tensor: print a host copy */
    kiln_tensor *host = tensor_to_device(op, t, 0);
    char *s = host ? tensor_text(op, host) : NULL;
    kiln_release(host);
    return s;
  }
  strbuf b = {0};
  sb_puts(&b, "kiln.Tensor(");
  if (t->size == 0 && t->rank > 0) {
    sb_puts(&b, "[]"); /* as NumPy, whatever the empty shape */
  } else {
    walk w = {.t = t, .dt = (kiln_dtype)t->dtype, .summarise = t->size > SUMMARY_THRESHOLD,
              .min_abs = -1, .max_abs = -1};
    if (!dtype_is_int(w.dt) && w.dt != KILN_BOOL) {
      walk_axis(&w, 0, 0, t->size);
      /* the limits in the dtype's own precision: 0.0001f is just below 1e-4 */
      double small = w.dt == KILN_F64 ? 1e-4 : (double)1e-4f, big = w.dt == KILN_F64 ? 1e16 : 1e8;
      w.sci = w.max_abs >= 0 && (w.min_abs < small || w.max_abs >= big);
    }
    w.out = &b;
    walk_axis(&w, 0, 0, t->size);
  }
  char shape[256];
  sb_puts(&b, ", shape=");
  sb_puts(&b, shape_str(shape, sizeof shape, t->rank, t->shape));
  sb_puts(&b, ", dtype=");
  sb_puts(&b, kiln_dtype_name((kiln_dtype)t->dtype));
  sb_puts(&b, ")");
  if (b.oom) {
    free(b.p);
    kiln_set_error("%s: out of memory", op);
    return NULL;
  }
  return b.p;
}

char *kiln_tensor_str(const kiln_tensor *t) { return tensor_text("tensor_str", t); }

int kiln_tensor_print(const kiln_tensor *t, FILE *f) {
  if (!f) return kiln_set_error("tensor_print: FILE is NULL");
  char *s = tensor_text("tensor_print", t);
  if (!s) return -1;
  int rc = fputs(s, f) < 0 || fputc('\n', f) == EOF ? kiln_set_error("tensor_print: write failed") : 0;
  free(s);
  return rc;
}
