/* parse.c — reads the text form (.kir) back into IR: a hand-written
 * recursive-descent parser over characters. Every instruction goes through
 * ir_append, so the parser accepts exactly what the builder accepts; errors
 * are "file:line:col: reason" at the offending token. */
#include <dlfcn.h>
#include <errno.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

#include "ir_internal.h"

typedef struct sym {
  const char *s; /* name in the source text (no %) */
  size_t n;
  ir_value v;
} sym;

typedef struct parser {
  const char *text, *p, *file;
  bool failed;
  ir_module *m;
  ir_func *f;
  sym *syms; /* open-addressed table of the current function's names */
  size_t cap, used;
  int64_t *plan; /* buf(...) offsets of the current function by value, -1 = none */
  int plan_cap;
  bool planned;
} parser;

static int fail_at(parser *ps, const char *at, const char *fmt, ...) KILN_PRINTF(3, 4);

static int fail_at(parser *ps, const char *at, const char *fmt, ...) {
  if (ps->failed) return -1;
  ps->failed = true;
  int line = 1, col = 1;
  for (const char *q = ps->text; q < at && *q; q++) {
    if (*q == '\n') {
      line++;
      col = 1;
    } else {
      col++;
    }
  }
  char msg[768];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  return kiln_set_error("%s:%d:%d: %s", ps->file, line, col, msg);
}

/* ---- characters ---- */

static void skip_ws(parser *ps) {
  for (;;) {
    char c = *ps->p;
    if (c == ' ' || c == '\t' || c == '\n' || c == '\r') {
      ps->p++;
    } else if (c == '/' && ps->p[1] == '/') {
      while (*ps->p && *ps->p != '\n') ps->p++;
    } else {
      return;
    }
  }
}

static bool is_alpha(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_'; }
static bool is_digit(char c) { return c >= '0' && c <= '9'; }
static bool is_ident(char c) { return is_alpha(c) || is_digit(c) || c == '.'; }

/* a short description of what is at p, for "expected X, got Y" */
static const char *got(const char *p, char *buf, size_t n) {
  if (!*p) return "end of input";
  size_t k = 0;
  if (is_ident(*p)) {
    while (is_ident(p[k]) && k < 24) k++;
  } else {
    k = 1;
  }
  snprintf(buf, n, "'%.*s'", (int)k, p);
  return buf;
}

static int expect(parser *ps, const char *tok, const char *what) {
  skip_ws(ps);
  size_t n = strlen(tok);
  if (!strncmp(ps->p, tok, n)) {
    ps->p += n;
    return 0;
  }
  char b[48];
  return fail_at(ps, ps->p, "expected %s, got %s", what, got(ps->p, b, sizeof b));
}

static bool accept(parser *ps, const char *tok) {
  skip_ws(ps);
  size_t n = strlen(tok);
  if (strncmp(ps->p, tok, n)) return false;
  ps->p += n;
  return true;
}

/* an identifier [A-Za-z_][A-Za-z0-9_.]* at p; its length, 0 if none */
static size_t ident_len(const char *p) {
  if (!is_alpha(*p)) return 0;
  size_t n = 1;
  while (is_ident(p[n])) n++;
  return n;
}

static bool keyword(parser *ps, const char *kw) {
  skip_ws(ps);
  size_t n = strlen(kw);
  if (ident_len(ps->p) != n || strncmp(ps->p, kw, n)) return false;
  ps->p += n;
  return true;
}

static int hexval(char c) {
  return c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
}

/* "..." with \" \\ \xHH escapes into a malloc'd string, or a bare run of
 * name characters (file: also / - +) */
static char *name_or_string(parser *ps, bool file, const char *what) {
  skip_ws(ps);
  const char *start = ps->p;
  ir_buf b = {0};
  if (*ps->p == '"') {
    ps->p++;
    while (*ps->p != '"') {
      char c = *ps->p;
      if (!c || c == '\n') {
        free(b.s);
        fail_at(ps, start, "unterminated string");
        return NULL;
      }
      if (c == '\\') {
        char e = ps->p[1];
        if (e == '"' || e == '\\') {
          ir_buf_put(&b, &e, 1);
          ps->p += 2;
          continue;
        }
        /* \xHH: read the second digit only after a valid first one */
        int hi = e == 'x' ? hexval(ps->p[2]) : -1, lo = hi >= 0 ? hexval(ps->p[3]) : -1;
        if (hi < 0 || lo < 0 || (hi == 0 && lo == 0)) {
          free(b.s);
          fail_at(ps, ps->p, "bad escape in string");
          return NULL;
        }
        char v = (char)(hi * 16 + lo);
        ir_buf_put(&b, &v, 1);
        ps->p += 4;
        continue;
      }
      ir_buf_put(&b, &c, 1);
      ps->p++;
    }
    ps->p++;
    if (!b.len) {
      free(b.s);
      fail_at(ps, start, "empty %s", what);
      return NULL;
    }
  } else {
    size_t n = 0;
    if (file) {
      while (is_ident(ps->p[n]) || ps->p[n] == '/' || ps->p[n] == '-' || ps->p[n] == '+') n++;
    } else {
      n = ident_len(ps->p);
    }
    if (!n) {
      char g[48];
      fail_at(ps, start, "expected %s, got %s", what, got(start, g, sizeof g));
      return NULL;
    }
    ir_buf_put(&b, ps->p, n);
    ps->p += n;
  }
  return ir_buf_take(&b);
}

/* A decimal integer in [lo, hi]. */
static int parse_int(parser *ps, long long lo, long long hi, const char *what, long long *out) {
  skip_ws(ps);
  const char *start = ps->p;
  if (!(is_digit(*ps->p) || (*ps->p == '-' && is_digit(ps->p[1])))) {
    char g[48];
    return fail_at(ps, start, "expected %s, got %s", what, got(start, g, sizeof g));
  }
  char *end;
  errno = 0;
  long long v = strtoll(ps->p, &end, 10);
  if (is_ident(*end)) return fail_at(ps, start, "expected %s (an integer)", what);
  if (errno == ERANGE || v < lo || v > hi)
    return fail_at(ps, start, "%s %.*s is out of range [%lld, %lld]", what, (int)(end - start), start, lo, hi);
  ps->p = end;
  *out = v;
  return 0;
}

/* ---- symbols ---- */

static uint64_t hash(const char *s, size_t n) {
  uint64_t h = 1469598103934665603ull;
  for (size_t i = 0; i < n; i++) h = (h ^ (unsigned char)s[i]) * 1099511628211ull;
  return h;
}

static sym *sym_slot(parser *ps, const char *s, size_t n) {
  for (size_t i = hash(s, n) & (ps->cap - 1);; i = (i + 1) & (ps->cap - 1))
    if (!ps->syms[i].s || (ps->syms[i].n == n && !memcmp(ps->syms[i].s, s, n))) return &ps->syms[i];
}

static int sym_add(parser *ps, const char *s, size_t n, ir_value v) {
  if (2 * (ps->used + 1) > ps->cap) {
    size_t cap = ps->cap ? 2 * ps->cap : 64;
    sym *old = ps->syms;
    size_t oldcap = ps->cap;
    if (!(ps->syms = calloc(cap, sizeof *ps->syms))) {
      ps->syms = old;
      return fail_at(ps, s, "out of memory");
    }
    ps->cap = cap;
    for (size_t i = 0; i < oldcap; i++)
      if (old[i].s) *sym_slot(ps, old[i].s, old[i].n) = old[i];
    free(old);
  }
  sym *slot = sym_slot(ps, s, n);
  if (slot->s) return fail_at(ps, s - 1, "redefinition of %%%.*s", (int)n, s);
  *slot = (sym){s, n, v};
  ps->used++;
  return 0;
}

/* %name or %123: its text (after %) */
static int value_name(parser *ps, const char **s, size_t *n) {
  skip_ws(ps);
  const char *start = ps->p;
  if (*ps->p != '%') {
    char g[48];
    return fail_at(ps, start, "expected a value (%%name), got %s", got(start, g, sizeof g));
  }
  size_t k = 0;
  if (is_digit(ps->p[1])) {
    while (is_digit(ps->p[1 + k])) k++;
    if (is_ident(ps->p[1 + k])) k = 0;
  } else {
    k = ident_len(ps->p + 1);
  }
  if (!k) return fail_at(ps, start, "bad value name");
  *s = ps->p + 1;
  *n = k;
  ps->p += 1 + k;
  return 0;
}

static int use_value(parser *ps, ir_value *v) {
  const char *s;
  size_t n;
  if (value_name(ps, &s, &n)) return -1;
  sym *slot = ps->cap ? sym_slot(ps, s, n) : NULL;
  if (!slot || !slot->s) return fail_at(ps, s - 1, "undefined value %%%.*s", (int)n, s);
  *v = slot->v;
  return 0;
}

/* names v as written, unless it is a number (numbers are reassigned) */
static int def_value(parser *ps, const char *s, size_t n, ir_value v) {
  if (sym_add(ps, s, n, v)) return -1;
  if (is_digit(*s)) return 0;
  char *d = malloc(n + 1);
  if (!d) return fail_at(ps, s, "out of memory");
  memcpy(d, s, n);
  d[n] = '\0';
  ps->f->names[v] = d;
  return 0;
}

/* ---- types and attributes ---- */

static int parse_dtype(parser *ps, kiln_dtype *dt) {
  skip_ws(ps);
  size_t n = ident_len(ps->p);
  for (int d = 0; d < KILN_DTYPE_COUNT; d++) {
    const char *name = kiln_dtype_name((kiln_dtype)d);
    if (n == strlen(name) && !strncmp(ps->p, name, n)) {
      *dt = (kiln_dtype)d;
      ps->p += n;
      return 0;
    }
  }
  char g[48];
  return fail_at(ps, ps->p, "expected a dtype (f32, f64, i32, i64, bool, f16, bf16), got %s",
                 got(ps->p, g, sizeof g));
}

/* [a,b,...] of at most KILN_MAX_RANK integers in [lo, hi] */
static int parse_list(parser *ps, long long lo, long long hi, const char *what, int *n, int64_t *v) {
  if (expect(ps, "[", "'['")) return -1;
  *n = 0;
  if (accept(ps, "]")) return 0;
  do {
    skip_ws(ps);
    if (*n == KILN_MAX_RANK) return fail_at(ps, ps->p, "more than %d entries in %s", KILN_MAX_RANK, what);
    long long x;
    if (parse_int(ps, lo, hi, what, &x)) return -1;
    v[(*n)++] = x;
  } while (accept(ps, ","));
  return expect(ps, "]", "',' or ']'");
}

static int parse_type(parser *ps, op_type *t) {
  skip_ws(ps);
  const char *start = ps->p;
  memset(t, 0, sizeof *t);
  if (parse_dtype(ps, &t->dtype)) return -1;
  if (*ps->p != '[') return fail_at(ps, ps->p, "expected '[' after the dtype of a type");
  if (parse_list(ps, 0, INT64_MAX, "dimension", &t->rank, t->shape)) return -1;
  if (ir_type_check("type", t)) return fail_at(ps, start, "%s", kiln_last_error());
  return 0;
}

/* {name=value, ...}; names must be the op's (ops.def) and appear once */
static int parse_attrs(parser *ps, op_id op, op_attrs *a) {
  const char *list = kiln_ops[op].attrs;
  unsigned seen = 0;
  int nbegin = -1;
  skip_ws(ps);
  const char *open = ps->p;
  bool braces = accept(ps, "{");
  if (braces && !accept(ps, "}")) {
    do {
      skip_ws(ps);
      const char *key = ps->p;
      size_t n = ident_len(key);
      int idx = 0, found = -1;
      for (const char *p = list; *p; idx++) {
        const char *e = strchr(p, ',');
        size_t k = e ? (size_t)(e - p) : strlen(p);
        if (n && k == n && !strncmp(p, key, n)) found = idx;
        p = e ? e + 1 : p + k;
      }
      if (found < 0 || op == OP_CONSTANT)
        return fail_at(ps, key, "bad attribute: %s has no attribute '%.*s'", kiln_ops[op].name,
                       (int)(n ? n : 1), key);
      if (seen & (1u << found)) return fail_at(ps, key, "bad attribute: '%.*s' given twice", (int)n, key);
      seen |= 1u << found;
      ps->p += n;
      if (expect(ps, "=", "'='")) return -1;
      skip_ws(ps);
      const char *at = ps->p;
      long long x;
      int cnt;
      int64_t v[KILN_MAX_RANK];
#define IS(k) (n == sizeof(k) - 1 && !strncmp(key, k, n))
      if (IS("dtype")) {
        if (parse_dtype(ps, &a->dtype)) return -1;
      } else if (IS("shape") || IS("size") || IS("begin")) {
        if (parse_list(ps, IS("size") ? -1 : 0, INT64_MAX, "dimension", &cnt, v)) return -1;
        if (IS("begin")) {
          nbegin = cnt;
          memcpy(a->begin, v, (size_t)cnt * sizeof *v);
        } else {
          a->rank = cnt;
          memcpy(a->shape, v, (size_t)cnt * sizeof *v);
        }
      } else if (IS("axes") || IS("perm")) {
        if (parse_list(ps, 0, KILN_MAX_RANK - 1, "axis", &cnt, v)) return -1;
        a->naxes = cnt;
        for (int i = 0; i < cnt; i++) a->axes[i] = (int)v[i];
      } else if (IS("axis")) {
        if (parse_int(ps, 0, KILN_MAX_RANK - 1, "axis", &x)) return -1;
        a->axis = (int)x;
      } else if (IS("keepdims")) {
        if (keyword(ps, "true"))
          a->keepdims = true;
        else if (keyword(ps, "false"))
          a->keepdims = false;
        else
          return fail_at(ps, at, "bad attribute: keepdims must be true or false");
      } else if (IS("lo") || IS("hi")) {
        char *end;
        double d = strtod(ps->p, &end);
        if (end == ps->p || is_ident(*end))
          return fail_at(ps, at, "bad attribute: %.*s must be a number", (int)n, key);
        ps->p = end;
        *(IS("lo") ? &a->lo : &a->hi) = d;
      } else if ((IS("seed") || IS("counter")) && keyword(ps, "global")) {
        if (IS("counter") && !a->stateful)
          return fail_at(ps, at, "bad attribute: counter=global needs seed=global before it");
        a->stateful = true;
      } else if (IS("seed") || IS("counter")) {
        if (a->stateful) return fail_at(ps, at, "bad attribute: seed=global needs counter=global");
        char *end;
        errno = 0;
        unsigned long long u = strtoull(ps->p, &end, 10);
        if (!is_digit(*ps->p) || errno == ERANGE || is_ident(*end))
          return fail_at(ps, at, "bad attribute: %.*s must be an unsigned 64-bit integer", (int)n, key);
        ps->p = end;
        *(IS("seed") ? &a->seed : &a->counter) = u;
      } else if (IS("state") || IS("carry") || IS("xs")) {
        if (parse_int(ps, 0, INT32_MAX, "count", &x)) return -1;
        *(IS("xs") ? &a->n_xs : &a->n_state) = (int)x;
      } else if (IS("max_iterations") || IS("length")) {
        if (parse_int(ps, IS("length") ? 0 : -1, INT64_MAX, "count", &x)) return -1;
        a->trip = x;
      } else if (IS("stride") || IS("dilation") || IS("padding") || IS("window")) {
        int want = IS("padding") ? 4 : 2; /* values are checked by the op's inference */
        if (parse_list(ps, INT32_MIN, INT32_MAX, "a window attribute", &cnt, v)) return -1;
        if (cnt != want)
          return fail_at(ps, at, "bad attribute: %.*s needs %d entries, got %d", (int)n, key, want, cnt);
        int *dst = IS("stride") ? a->stride : IS("dilation") ? a->dilation : IS("padding") ? a->padding : a->window;
        for (int i = 0; i < cnt; i++) dst[i] = (int)v[i];
      } else if (IS("groups")) {
        if (parse_int(ps, INT32_MIN, INT32_MAX, "groups", &x)) return -1;
        a->groups = (int)x;
      } else if (IS("reduce")) {
        int r = 0;
        while (r < 4 && !keyword(ps, ir_reduce_names[r])) r++;
        if (r == 4) return fail_at(ps, at, "bad attribute: reduce must be sum, mean, max or min");
        a->reduce = r;
      } else if (IS("root") || IS("world")) {
        if (parse_int(ps, IS("world") ? 1 : 0, INT32_MAX, IS("world") ? "world size" : "rank", &x)) return -1;
        *(IS("world") ? &a->world : &a->root) = (int)x;
      } else if (IS("reverse")) {
        if (keyword(ps, "true"))
          a->reverse = true;
        else if (keyword(ps, "false"))
          a->reverse = false;
        else
          return fail_at(ps, at, "bad attribute: reverse must be true or false");
      }
#undef IS
    } while (accept(ps, ","));
    if (expect(ps, "}", "',' or '}' after an attribute")) return -1;
  }
  if (nbegin >= 0 && (seen & 3u) == 3u && nbegin != a->rank)
    return fail_at(ps, open, "bad attribute: begin has %d entries, size %d", nbegin, a->rank);
  /* every attribute but keepdims is required */
  int idx = 0;
  for (const char *p = list; *p && op != OP_CONSTANT; idx++) {
    const char *e = strchr(p, ',');
    size_t k = e ? (size_t)(e - p) : strlen(p);
    if (!(seen & (1u << idx)) && strncmp(p, "keepdims", k))
      return fail_at(ps, braces ? open : ps->p, "bad attribute: %s needs attribute '%.*s'", kiln_ops[op].name,
                     (int)k, p);
    p = e ? e + 1 : p + k;
  }
  return 0;
}

/* ---- constants ---- */


typedef struct literal {
  const char *at;
  bool hex, bracketed;
  const char *hexs; /* hex digits */
  size_t nhex;
  const char **tok; /* element tokens */
  size_t *len;
  int64_t n, cap;
} literal;

static void literal_free(literal *l) {
  free(l->tok);
  free(l->len);
}

/* dense<...>: scanned now, converted once the type is known */
static int parse_literal(parser *ps, literal *l) {
  if (!keyword(ps, "dense")) {
    char g[48];
    return fail_at(ps, ps->p, "expected dense<...> after constant, got %s", got(ps->p, g, sizeof g));
  }
  if (expect(ps, "<", "'<'")) return -1;
  skip_ws(ps);
  l->at = ps->p;
  if (ps->p[0] == '0' && (ps->p[1] == 'x' || ps->p[1] == 'X')) {
    l->hex = true;
    ps->p += 2;
    l->hexs = ps->p;
    while (hexval(*ps->p) >= 0) ps->p++;
    l->nhex = (size_t)(ps->p - l->hexs);
    if (l->nhex % 2) return fail_at(ps, l->at, "odd number of hex digits in constant");
  } else {
    l->bracketed = accept(ps, "[");
    if (!(l->bracketed && accept(ps, "]"))) {
      do {
        skip_ws(ps);
        const char *s = ps->p;
        while (is_ident(*ps->p) || *ps->p == '-' || *ps->p == '+') ps->p++;
        if (s == ps->p) {
          char g[48];
          return fail_at(ps, s, "expected a constant element, got %s", got(s, g, sizeof g));
        }
        if (l->n == l->cap) {
          int64_t cap = l->cap ? 2 * l->cap : 16;
          const char **tok = realloc(l->tok, (size_t)cap * sizeof *tok);
          if (tok) l->tok = tok;
          size_t *len = realloc(l->len, (size_t)cap * sizeof *len);
          if (len) l->len = len;
          if (!tok || !len) return fail_at(ps, s, "out of memory");
          l->cap = cap;
        }
        l->tok[l->n] = s;
        l->len[l->n++] = (size_t)(ps->p - s);
      } while (l->bracketed && accept(ps, ","));
      if (l->bracketed && expect(ps, "]", "',' or ']' in constant")) return -1;
    }
  }
  return expect(ps, ">", "'>' closing the constant");
}

static kiln_tensor *literal_tensor(parser *ps, const literal *l, const op_type *t, const char *type_at) {
  char ts[256];
  int64_t size = 1;
  for (int i = 0; i < t->rank; i++) size *= t->shape[i];
  size_t es = kiln_dtype_sizes[t->dtype];
  if (l->hex) {
    if ((uint64_t)size > l->nhex / 2 / es || (size_t)size * es != l->nhex / 2) {
      fail_at(ps, l->at, "constant has %zu bytes, type %s needs %lld", l->nhex / 2,
              ir_type_str(ts, sizeof ts, t), (long long)((uint64_t)size * es));
      return NULL;
    }
  } else {
    if (l->bracketed != (t->rank > 0)) {
      fail_at(ps, l->at, "constant of rank %d is written %s", t->rank,
              t->rank ? "[...], with brackets" : "without brackets");
      return NULL;
    }
    if (size != l->n) {
      fail_at(ps, type_at, "constant has %lld elements, type %s has %lld", (long long)l->n,
              ir_type_str(ts, sizeof ts, t), (long long)size);
      return NULL;
    }
  }
  kiln_tensor *v = tensor_alloc("constant", t->dtype, t->rank, t->shape);
  if (!v) {
    fail_at(ps, l->at, "%s", kiln_last_error());
    return NULL;
  }
  unsigned char *d = v->data;
  if (l->hex) {
    for (size_t i = 0; i < l->nhex / 2; i++)
      d[i] = (unsigned char)(hexval(l->hexs[2 * i]) * 16 + hexval(l->hexs[2 * i + 1]));
    return v;
  }
  for (int64_t i = 0; i < l->n; i++) {
    if (ir_elem_from_text(t->dtype, l->tok[i], l->len[i], d, i)) {
      fail_at(ps, l->tok[i], "'%.*s' is not a %s value", (int)(l->len[i] < 40 ? l->len[i] : 40), l->tok[i],
              kiln_dtype_name(t->dtype));
      kiln_release(v);
      return NULL;
    }
  }
  return v;
}

/* ---- instructions and functions ---- */

/* buf(OFFSET, BYTES) after a result type: value v's place in the arena plan
 * of the buffers pass, attached to the function once it is read */
static int parse_buf(parser *ps, const op_type *t, ir_value v) {
  const char *at = ps->p - 3; /* the keyword */
  long long off, bytes;
  if (expect(ps, "(", "'(' after buf") || parse_int(ps, 0, INT64_MAX / 4, "buffer offset", &off) ||
      expect(ps, ",", "',' after the buffer offset") || parse_int(ps, 0, INT64_MAX / 4, "buffer size", &bytes) ||
      expect(ps, ")", "')' closing buf"))
    return -1;
  if (off % IR_BUF_ALIGN) return fail_at(ps, at, "buffer offset %lld is not a multiple of %d", off, IR_BUF_ALIGN);
  if (bytes != ir_type_bytes(t))
    return fail_at(ps, at, "buffer of %lld bytes for a value of %lld", bytes, (long long)ir_type_bytes(t));
  if (v >= ps->plan_cap) {
    int cap = ps->plan_cap ? 2 * ps->plan_cap : 64;
    while (cap <= v) cap *= 2;
    int64_t *q = realloc(ps->plan, (size_t)cap * sizeof *q);
    if (!q) return fail_at(ps, at, "out of memory");
    for (int i = ps->plan_cap; i < cap; i++) q[i] = -1;
    ps->plan = q;
    ps->plan_cap = cap;
  }
  ps->plan[v] = off;
  ps->planned = true;
  return 0;
}

static int parse_loc(parser *ps, ir_loc *loc) {
  if (!keyword(ps, "loc")) return 0;
  if (expect(ps, "(", "'(' after loc")) return -1;
  char *file = name_or_string(ps, true, "file name");
  if (!file) return -1;
  long long line;
  int rc = expect(ps, ":", "':' between file and line in loc");
  if (!rc) rc = parse_int(ps, 0, INT32_MAX, "line", &line);
  if (!rc) rc = expect(ps, ")", "')' closing loc");
  if (!rc && !(loc->file = ir_intern_file(ps->m, file))) rc = fail_at(ps, ps->p, "out of memory");
  free(file);
  if (rc) return -1;
  loc->line = (int)line;
  return 0;
}

/* the callee of call/fusion (a function defined above) or host_call (a
 * symbol of this process, found with dlsym; unbound when there is none) */
static int parse_callee(parser *ps, op_id op, op_attrs *a, int n_out, const op_type *outs, const char **name_at) {
  if (expect(ps, "@", "'@' and the callee's name")) return -1;
  *name_at = ps->p;
  char *name = name_or_string(ps, false, "callee name");
  if (!name) return -1;
  int rc = 0;
  if (kiln_ops[op].kind == OPK_CALL) {
    if (!(a->callee = ir_module_find(ps->m, name)))
      rc = fail_at(ps, *name_at, "unknown function @%s (a callee must be defined before its caller)", name);
    else if (a->callee == ps->f)
      rc = fail_at(ps, *name_at, "@%s calls itself (recursion is not supported)", name);
  } else {
    kiln_host_fn fn = host_builtin_fn(name); /* the library's own, else a symbol of the process */
    void *sym = fn ? NULL : dlsym(RTLD_DEFAULT, name);
    if (!fn) memcpy(&fn, &sym, sizeof fn < sizeof sym ? sizeof fn : sizeof sym);
    if (!(a->host = ir_module_add_host(ps->m, fn, NULL, name, n_out, outs)))
      rc = fail_at(ps, *name_at, "%s", kiln_last_error());
  }
  free(name);
  return rc;
}

static int parse_func(parser *ps);

/* The regions of a control-flow instruction, each "role func @name ..."
 * nested under it: parsed as functions of their own (the enclosing
 * function's names and plan set aside meanwhile). */
static int parse_regions(parser *ps, op_id op, op_attrs *a) {
  static const char *roles[][2] = {{"then", "else"}, {"cond", "body"}, {"body", NULL}};
  const char *const *role = roles[op == OP_COND ? 0 : op == OP_WHILE ? 1 : 2];
  for (int k = 0; k < 2 && role[k]; k++) {
    skip_ws(ps);
    if (!keyword(ps, role[k])) {
      char g[48];
      return fail_at(ps, ps->p, "expected the '%s' region of %s, got %s", role[k], kiln_ops[op].name,
                     got(ps->p, g, sizeof g));
    }
    skip_ws(ps);
    parser outer = *ps;
    ps->f = NULL;
    ps->syms = NULL;
    ps->cap = ps->used = 0;
    ps->plan = NULL;
    ps->plan_cap = 0;
    ps->planned = false;
    int rc = parse_func(ps);
    ir_func *g = ps->f;
    free(ps->syms);
    free(ps->plan);
    const char *at = ps->p;
    bool failed = ps->failed;
    *ps = outer;
    ps->p = at;
    ps->failed = failed;
    if (rc) return -1;
    g->region = true;
    *(k ? &a->callee2 : &a->callee) = g;
  }
  return 0;
}

static int parse_instr(parser *ps) {
  struct { const char *s; size_t n; } names[8], *nm = names;
  int n_names = 0, cap_names = 8;
  int rc = 0;
  do { /* %a, %b = ... */
    if (n_names == cap_names) {
      void *q = malloc((size_t)cap_names * 2 * sizeof *nm);
      if (!q) return fail_at(ps, ps->p, "out of memory");
      memcpy(q, nm, (size_t)n_names * sizeof *nm);
      if (nm != names) free(nm);
      nm = q;
      cap_names *= 2;
    }
    if ((rc = value_name(ps, &nm[n_names].s, &nm[n_names].n))) break;
    n_names++;
  } while (accept(ps, ","));
  if (!rc) rc = expect(ps, "=", "'='");
  if (rc) {
    if (nm != names) free(nm);
    return -1;
  }
  skip_ws(ps);
  const char *op_at = ps->p;
  size_t n = ident_len(op_at);
  int op = -1;
  for (int i = 0; i < OP_COUNT && n; i++)
    if (strlen(kiln_ops[i].name) == n && !strncmp(kiln_ops[i].name, op_at, n)) op = i;
  if (op < 0) {
    char g[48];
    if (nm != names) free(nm);
    if (n) return fail_at(ps, op_at, "unknown op '%.*s'", (int)n, op_at);
    return fail_at(ps, op_at, "expected an op name, got %s", got(op_at, g, sizeof g));
  }
  ps->p += n;
  bool called = kiln_ops[op].kind == OPK_CALL || kiln_ops[op].kind == OPK_HOST;
  bool control = kiln_ops[op].kind == OPK_CONTROL;
  if (!called && !control && n_names != 1) {
    if (nm != names) free(nm);
    return fail_at(ps, op_at, "%s has one result, %d are named", kiln_ops[op].name, n_names);
  }
  op_attrs a = {0};
  literal lit = {0};
  ir_value small[8], *in = small;
  int n_in = 0, cap = 8;
  const char *callee_at = NULL, *args_at = NULL;
  if (op == OP_CONSTANT) {
    rc = parse_literal(ps, &lit);
  } else {
    skip_ws(ps);
    if (called) { /* @callee( — the callee is resolved once the result types are known */
      if (!(rc = expect(ps, "@", "'@' and the callee's name"))) {
        callee_at = ps->p;
        char *name = name_or_string(ps, false, "callee name");
        if (!name) rc = -1;
        free(name);
      }
      if (!rc) rc = expect(ps, "(", "'(' and the arguments");
      skip_ws(ps);
      args_at = ps->p;
    }
    if (!rc && *ps->p == '%') {
      do {
        if (n_in == cap) {
          ir_value *big = malloc((size_t)cap * 2 * sizeof *big);
          if (!big) {
            rc = fail_at(ps, ps->p, "out of memory");
            break;
          }
          memcpy(big, in, (size_t)n_in * sizeof *in);
          if (in != small) free(in);
          in = big;
          cap *= 2;
        }
        if ((rc = use_value(ps, &in[n_in]))) break;
        n_in++;
      } while (accept(ps, ","));
    }
    if (!rc && called) rc = expect(ps, ")", "',' or ')' after an argument");
    if (!rc && !called) rc = parse_attrs(ps, (op_id)op, &a);
  }
  (void)args_at;
  op_type tsmall[8], *t = tsmall;
  int n_t = 0, cap_t = 8;
  const char *type_at = NULL;
  if (!rc) rc = expect(ps, ":", "':' before the result type");
  if (!rc) {
    skip_ws(ps);
    type_at = ps->p;
    do {
      if (n_t == cap_t) {
        op_type *q = malloc((size_t)cap_t * 2 * sizeof *q);
        if (!q) {
          rc = fail_at(ps, ps->p, "out of memory");
          break;
        }
        memcpy(q, t, (size_t)n_t * sizeof *t);
        if (t != tsmall) free(t);
        t = q;
        cap_t *= 2;
      }
      skip_ws(ps);
      if ((rc = parse_type(ps, &t[n_t]))) break;
      if (keyword(ps, "buf") && (rc = parse_buf(ps, &t[n_t], ps->f->n_values + n_t))) break;
      n_t++;
    } while ((called || control) && accept(ps, ","));
  }
  if (!rc && n_t != n_names)
    rc = fail_at(ps, type_at, "%d result%s named, %d type%s given", n_names, n_names == 1 ? "" : "s", n_t,
                 n_t == 1 ? "" : "s");
  if (!rc && called) { /* now resolve the callee */
    const char *save = ps->p, *name_at;
    ps->p = callee_at - 1;
    rc = parse_callee(ps, (op_id)op, &a, n_t, t, &name_at);
    ps->p = save;
  }
  ir_loc loc = {NULL, 0};
  if (!rc) rc = parse_loc(ps, &loc);
  if (!rc && control) rc = parse_regions(ps, (op_id)op, &a);
  if (!rc && op == OP_CONSTANT && !(a.value = literal_tensor(ps, &lit, &t[0], type_at))) rc = -1;
  ir_value v = -1;
  if (!rc && (v = ir_append(ps->f, (op_id)op, &a, n_in, in, loc)) < 0) {
    char msg[1024];
    snprintf(msg, sizeof msg, "%s", kiln_last_error());
    rc = fail_at(ps, op_at, "%s", msg);
  }
  if (op == OP_CONSTANT) kiln_release(a.value); /* ir_append took its own reference */
  literal_free(&lit);
  if (in != small) free(in);
  for (int k = 0; !rc && k < n_t; k++) {
    if (!ir_type_eq(&ps->f->types[v + k], &t[k])) {
      char x[256], y[256];
      rc = fail_at(ps, type_at, "type mismatch: %s annotated, %s inferred by %s", ir_type_str(x, sizeof x, &t[k]),
                   ir_type_str(y, sizeof y, &ps->f->types[v + k]), kiln_ops[op].name);
    }
  }
  for (int k = 0; !rc && k < n_names; k++) rc = def_value(ps, nm[k].s, nm[k].n, v + k);
  if (t != tsmall) free(t);
  if (nm != names) free(nm);
  return rc;
}

static int parse_func(parser *ps) {
  const char *func_at = ps->p;
  if (!keyword(ps, "func")) {
    char g[48];
    return fail_at(ps, ps->p, "expected 'func', got %s", got(ps->p, g, sizeof g));
  }
  if (expect(ps, "@", "'@' and the function name")) return -1;
  const char *name_at = ps->p;
  char *name = name_or_string(ps, false, "function name");
  if (!name) return -1;
  /* parameters: parsed before the function exists, so kept here */
  struct param {
    const char *s;
    size_t n;
    op_type t;
  } *params = NULL;
  int np = 0, capp = 0, rc = expect(ps, "(", "'(' after the function name");
  if (!rc) {
    skip_ws(ps);
    if (*ps->p != ')') {
      do {
        if (np == capp) {
          capp = capp ? 2 * capp : 8;
          struct param *q = realloc(params, (size_t)capp * sizeof *q);
          if (!q) {
            rc = fail_at(ps, ps->p, "out of memory");
            break;
          }
          params = q;
        }
        if ((rc = value_name(ps, &params[np].s, &params[np].n))) break;
        if ((rc = expect(ps, ":", "':' after the parameter name"))) break;
        if ((rc = parse_type(ps, &params[np].t))) break;
        np++;
      } while (accept(ps, ","));
    }
    if (!rc) rc = expect(ps, ")", "',' or ')' after a parameter");
  }
  op_type *rtypes = NULL;
  int nr = 0;
  const char *rtypes_at = NULL;
  if (!rc) rc = expect(ps, "->", "'->' and the result types");
  if (!rc) {
    skip_ws(ps);
    rtypes_at = ps->p;
    bool paren = accept(ps, "(");
    skip_ws(ps);
    if (!(paren && accept(ps, ")"))) {
      int capr = 0;
      do {
        if (nr == capr) {
          capr = capr ? 2 * capr : 4;
          op_type *q = realloc(rtypes, (size_t)capr * sizeof *q);
          if (!q) {
            rc = fail_at(ps, ps->p, "out of memory");
            break;
          }
          rtypes = q;
        }
        if ((rc = parse_type(ps, &rtypes[nr]))) break;
        nr++;
      } while (paren && accept(ps, ","));
      if (!rc && paren) rc = expect(ps, ")", "',' or ')' after a result type");
    }
  }
  if (!rc) rc = expect(ps, "{", "'{' opening the function body");
  if (!rc) {
    op_type *pt = malloc(((size_t)np + 1) * sizeof *pt);
    if (!pt) rc = fail_at(ps, ps->p, "out of memory");
    for (int i = 0; !rc && i < np; i++) pt[i] = params[i].t;
    if (!rc && ir_module_find(ps->m, name)) rc = fail_at(ps, name_at, "redefinition of function @%s", name);
    if (!rc && !(ps->f = ir_func_new(ps->m, name, np, pt))) rc = fail_at(ps, name_at, "%s", kiln_last_error());
    free(pt);
  }
  ps->used = 0;
  if (ps->syms) memset(ps->syms, 0, ps->cap * sizeof *ps->syms);
  for (int i = 0; !rc && i < np; i++) rc = def_value(ps, params[i].s, params[i].n, i);
  free(params);
  free(name);
  /* the body */
  const char *ret_at = ps->p;
  while (!rc) {
    skip_ws(ps);
    ret_at = ps->p;
    if (keyword(ps, "return")) break;
    if (!*ps->p) {
      rc = fail_at(ps, ps->p, "unexpected end of input in the body of @%s (missing return)", ps->f->name);
      break;
    }
    if (*ps->p != '%') {
      char g[48];
      rc = fail_at(ps, ps->p, "expected an instruction (%%name = op ...) or return, got %s",
                   got(ps->p, g, sizeof g));
      break;
    }
    rc = parse_instr(ps);
  }
  ir_value small[8], *res = small;
  int n_res = 0, capres = 8;
  if (!rc) {
    skip_ws(ps);
    if (*ps->p == '%') {
      do {
        if (n_res == capres) {
          ir_value *big = malloc((size_t)capres * 2 * sizeof *big);
          if (!big) {
            rc = fail_at(ps, ps->p, "out of memory");
            break;
          }
          memcpy(big, res, (size_t)n_res * sizeof *res);
          if (res != small) free(res);
          res = big;
          capres *= 2;
        }
        if ((rc = use_value(ps, &res[n_res]))) break;
        n_res++;
      } while (accept(ps, ","));
    }
  }
  if (!rc && n_res != nr)
    rc = fail_at(ps, ret_at, "return has %d value%s, the signature of @%s declares %d", n_res,
                 n_res == 1 ? "" : "s", ps->f->name, nr);
  for (int i = 0; !rc && i < nr; i++) {
    if (!ir_type_eq(&ps->f->types[res[i]], &rtypes[i])) {
      char x[256], y[256];
      rc = fail_at(ps, rtypes_at, "type mismatch: result %d is %s, the signature says %s", i,
                   ir_type_str(x, sizeof x, &ps->f->types[res[i]]), ir_type_str(y, sizeof y, &rtypes[i]));
    }
  }
  if (!rc && ir_set_results(ps->f, n_res, res)) rc = fail_at(ps, ret_at, "%s", kiln_last_error());
  if (!rc) rc = expect(ps, "}", "'}' closing the function after return");
  if (!rc && ir_verify(ps->f)) {
    char msg[1024];
    snprintf(msg, sizeof msg, "%s", kiln_last_error());
    rc = fail_at(ps, func_at, "%s", msg);
  }
  if (!rc && ps->planned) { /* the arena plan, read from buf(...) */
    ir_func *f = ps->f;
    if (!(f->buf_offset = malloc(((size_t)f->n_values + 1) * sizeof *f->buf_offset)))
      rc = fail_at(ps, func_at, "out of memory");
    for (int v = 0; !rc && v < f->n_values; v++) {
      f->buf_offset[v] = v < ps->plan_cap ? ps->plan[v] : -1;
      if (f->buf_offset[v] >= 0 && f->buf_offset[v] + ir_buf_bytes(&f->types[v]) > f->arena_bytes)
        f->arena_bytes = f->buf_offset[v] + ir_buf_bytes(&f->types[v]);
    }
    for (int i = 0; i < ps->plan_cap; i++) ps->plan[i] = -1;
    ps->planned = false;
  }
  if (res != small) free(res);
  free(rtypes);
  return rc;
}

ir_module *ir_parse(const char *text, const char *filename) {
  parser ps = {.text = text, .p = text, .file = filename ? filename : "<input>"};
  if (!text) {
    kiln_set_error("%s: no text", ps.file);
    return NULL;
  }
  if (!(ps.m = ir_module_new())) return NULL;
  int rc = 0;
  for (;;) {
    skip_ws(&ps);
    if (!*ps.p) break;
    if ((rc = parse_func(&ps))) break;
  }
  free(ps.syms);
  free(ps.plan);
  if (rc) {
    ir_module_free(ps.m);
    return NULL;
  }
  return ps.m;
}
