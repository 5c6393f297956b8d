/* checkpoint.c — variables to and from safetensors files: an 8-byte
 * little-endian header length N, N bytes of JSON naming each tensor's dtype,
 * shape and byte range, then the raw little-endian row-major data. The reader
 * trusts nothing in the file: a small JSON parser for exactly this format, and
 * every length and offset checked against the file before it is used. */
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#include "autodiff.h"
#include "checkpoint.h"
#include "files.h"

/* The reference implementation's limit; a larger header is corrupt. */
#define MAX_HEADER_BYTES 100000000ull
#define MAX_JSON_DEPTH 64

/* ---- dtypes ----
 * Every dtype of the format, so that a file with tensors kiln cannot hold
 * still opens for the tensors it can; in the reference's order (by
 * alignment), which also orders the tensors of a saved file. bits: size of
 * one element. */
typedef struct {
  const char *name;
  int bits;
  int kiln; /* kiln_dtype, or -1 */
} st_dtype;

static const st_dtype st_dtypes[] = {
    {"BOOL", 8, KILN_BOOL}, {"F4", 4, -1},      {"F6_E2M3", 6, -1},      {"F6_E3M2", 6, -1},
    {"U8", 8, -1},          {"I8", 8, -1},      {"F8_E5M2", 8, -1},      {"F8_E4M3", 8, -1},
    {"F8_E8M0", 8, -1},     {"I16", 16, -1},    {"U16", 16, -1},         {"F16", 16, KILN_F16},
    {"BF16", 16, KILN_BF16}, {"I32", 32, KILN_I32}, {"U32", 32, -1},     {"F32", 32, KILN_F32},
    {"C64", 64, -1},        {"F64", 64, KILN_F64}, {"I64", 64, KILN_I64}, {"U64", 64, -1},
};
#define ST_DTYPE_COUNT ((int)(sizeof st_dtypes / sizeof st_dtypes[0]))

static int st_index(kiln_dtype dt) {
  for (int i = 0; i < ST_DTYPE_COUNT; i++)
    if (st_dtypes[i].kiln == (int)dt) return i;
  return 0; /* unreachable: every kiln dtype is in the table */
}

static bool host_little_endian(void) {
  const uint16_t one = 1;
  uint8_t b;
  memcpy(&b, &one, 1);
  return b == 1;
}

/* Reverses each elem-byte element of p in place (big-endian hosts only). */
static void swap_bytes(void *p, size_t bytes, size_t elem) {
  uint8_t *q = p;
  for (size_t i = 0; elem > 1 && i + elem <= bytes; i += elem)
    for (size_t a = i, b = i + elem - 1; a < b; a++, b--) {
      uint8_t t = q[a];
      q[a] = q[b];
      q[b] = t;
    }
}

static const char *errno_str(int e) {
  /* strerror is thread-safe in glibc for valid errno values; kept in one place */
  return strerror(e);
}

/* A name as it may appear in a message: control bytes become '?', long names
 * are cut (at a character boundary). */
static const char *printable(const char *s, size_t len, char *buf, size_t n) {
  size_t j = 0;
  for (size_t i = 0; i < len && j + 4 < n; i++) {
    unsigned char c = (unsigned char)s[i];
    buf[j++] = c < 0x20 || c == 0x7f ? '?' : (char)c;
  }
  if (j + 4 >= n && len > j) {
    while (j > 0 && ((unsigned char)buf[j - 1] & 0xc0) == 0x80) j--; /* continuation bytes */
    if (j > 0 && ((unsigned char)buf[j - 1] & 0xc0) == 0xc0) j--;   /* their lead byte */
    memcpy(buf + j, "...", 3);
    j += 3;
  }
  buf[j] = '\0';
  return buf;
}

/* true when s[0..n) is well-formed UTF-8 (no overlong forms, surrogates or
 * code points past U+10FFFF), as the header must be */
static bool utf8_valid(const uint8_t *s, size_t n, size_t *bad) {
  size_t i = 0;
  while (i < n) {
    uint8_t c = s[i];
    size_t k;
    uint32_t lo = 0x80, hi = 0xbf; /* allowed range of the first continuation byte */
    if (c < 0x80) {
      i++;
      continue;
    } else if (c >= 0xc2 && c <= 0xdf) {
      k = 1;
    } else if (c >= 0xe0 && c <= 0xef) {
      k = 2;
      if (c == 0xe0) lo = 0xa0;
      if (c == 0xed) hi = 0x9f;
    } else if (c >= 0xf0 && c <= 0xf4) {
      k = 3;
      if (c == 0xf0) lo = 0x90;
      if (c == 0xf4) hi = 0x8f;
    } else {
      *bad = i;
      return false;
    }
    if (n - i <= k) {
      *bad = i;
      return false;
    }
    for (size_t j = 1; j <= k; j++) {
      uint8_t d = s[i + j];
      if (d < (j == 1 ? lo : 0x80) || d > (j == 1 ? hi : 0xbf)) {
        *bad = i;
        return false;
      }
    }
    i += k + 1;
  }
  return true;
}

/* ---- the header ---- */

typedef struct {
  char *name; /* decoded, NUL-terminated; may hold NULs of its own */
  size_t name_len;
  int dtype; /* index into st_dtypes */
  int rank;
  int64_t shape[KILN_MAX_RANK];
  uint64_t begin, end; /* data_offsets, relative to the data after the header */
} ck_entry;

typedef struct {
  ck_entry *e;
  size_t n, cap;
} ck_index;

static void index_free(ck_index *ix) {
  for (size_t i = 0; i < ix->n; i++) free(ix->e[i].name);
  free(ix->e);
  ix->e = NULL;
  ix->n = ix->cap = 0;
}

/* The JSON parser's state: the header bytes, the position, the first error. */
typedef struct {
  const uint8_t *s;
  size_t n, i;
  char err[320];
} jp;

/* Header byte i is file byte i + 8. */
KILN_PRINTF(2, 3) static int jfail(jp *p, const char *fmt, ...) {
  if (p->err[0]) return -1;
  int used = snprintf(p->err, sizeof p->err, "corrupt header at byte %zu: ", p->i + 8);
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(p->err + used, sizeof p->err - (size_t)used, fmt, ap);
  va_end(ap);
  return -1;
}

/* what is at the current position, for messages */
static const char *found(const jp *p, char *buf, size_t n) {
  if (p->i >= p->n) return "the end of the header";
  unsigned char c = p->s[p->i];
  if (c >= 0x20 && c < 0x7f)
    snprintf(buf, n, "'%c'", c);
  else
    snprintf(buf, n, "byte 0x%02x", c);
  return buf;
}

static void ws(jp *p) {
  while (p->i < p->n) {
    uint8_t c = p->s[p->i];
    if (c != ' ' && c != '\t' && c != '\n' && c != '\r') break;
    p->i++;
  }
}

static bool at(const jp *p, char c) { return p->i < p->n && p->s[p->i] == (uint8_t)c; }

static int expect(jp *p, char c) {
  ws(p);
  if (at(p, c)) {
    p->i++;
    return 0;
  }
  char b[16];
  return jfail(p, "expected '%c', found %s", c, found(p, b, sizeof b));
}

static int hexval(uint8_t c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

/* \uXXXX at p->i (the backslash); advances past it */
static int unicode_escape(jp *p, uint32_t *cp) {
  if (p->n - p->i < 6 || p->s[p->i + 1] != 'u') return jfail(p, "bad \\u escape");
  uint32_t v = 0;
  for (int k = 2; k < 6; k++) {
    int h = hexval(p->s[p->i + (size_t)k]);
    if (h < 0) return jfail(p, "bad \\u escape");
    v = v * 16 + (uint32_t)h;
  }
  p->i += 6;
  *cp = v;
  return 0;
}

static size_t put_utf8(char *o, uint32_t cp) {
  if (cp < 0x80) {
    o[0] = (char)cp;
    return 1;
  }
  if (cp < 0x800) {
    o[0] = (char)(0xc0 | cp >> 6);
    o[1] = (char)(0x80 | (cp & 0x3f));
    return 2;
  }
  if (cp < 0x10000) {
    o[0] = (char)(0xe0 | cp >> 12);
    o[1] = (char)(0x80 | (cp >> 6 & 0x3f));
    o[2] = (char)(0x80 | (cp & 0x3f));
    return 3;
  }
  o[0] = (char)(0xf0 | cp >> 18);
  o[1] = (char)(0x80 | (cp >> 12 & 0x3f));
  o[2] = (char)(0x80 | (cp >> 6 & 0x3f));
  o[3] = (char)(0x80 | (cp & 0x3f));
  return 4;
}

/* A string at p->i. With out, its decoded bytes go to a malloc'd,
 * NUL-terminated buffer (the caller frees it); without, it is checked and
 * skipped. A decoded string is never longer than its JSON spelling. */
static int jstring(jp *p, char **out, size_t *out_len) {
  ws(p);
  char b[16];
  if (!at(p, '"')) return jfail(p, "expected a string, found %s", found(p, b, sizeof b));
  size_t open = p->i++, end = p->i;
  while (end < p->n && p->s[end] != '"') end += p->s[end] == '\\' ? 2 : 1;
  if (end >= p->n) {
    p->i = open;
    return jfail(p, "unterminated string");
  }
  char *o = NULL;
  size_t len = 0;
  if (out && !(o = malloc(end - p->i + 1))) return jfail(p, "out of memory");
  while (p->i < end) {
    uint8_t c = p->s[p->i];
    char tmp[4];
    size_t k = 1;
    if (c < 0x20) {
      free(o);
      return jfail(p, "control byte 0x%02x in a string", c);
    }
    if (c != '\\') {
      tmp[0] = (char)c;
      p->i++;
    } else {
      uint8_t e = p->s[p->i + 1]; /* end points at the closing quote, so this is in bounds */
      const char *simple = strchr("\"\\/bfnrt", e);
      if (e && simple) {
        tmp[0] = "\"\\/\b\f\n\r\t"[simple - "\"\\/bfnrt"];
        p->i += 2;
      } else if (e == 'u') {
        uint32_t cp, lo;
        if (unicode_escape(p, &cp)) {
          free(o);
          return -1;
        }
        if (cp >= 0xdc00 && cp <= 0xdfff) {
          p->i -= 6;
          free(o);
          return jfail(p, "lone surrogate \\u%04x in a string", (unsigned)cp);
        }
        if (cp >= 0xd800 && cp <= 0xdbff) {
          if (p->i + 6 > end || p->s[p->i] != '\\' || unicode_escape(p, &lo) || lo < 0xdc00 ||
              lo > 0xdfff) {
            p->err[0] = '\0'; /* report the pair, not its second half */
            free(o);
            return jfail(p, "lone surrogate \\u%04x in a string", (unsigned)cp);
          }
          cp = 0x10000 + ((cp - 0xd800) << 10) + (lo - 0xdc00);
        }
        k = put_utf8(tmp, cp);
      } else {
        free(o);
        return jfail(p, "bad escape '\\%c' in a string", e >= 0x20 && e < 0x7f ? e : '?');
      }
    }
    if (o) memcpy(o + len, tmp, k);
    len += k;
  }
  p->i = end + 1;
  if (o) {
    o[len] = '\0';
    *out = o;
    *out_len = len;
  }
  return 0;
}

/* A non-negative integer below 2^63 (offsets and dimensions). */
static int juint(jp *p, const char *what, uint64_t *out) {
  ws(p);
  char b[16];
  if (at(p, '-')) return jfail(p, "%s is negative", what);
  if (p->i >= p->n || p->s[p->i] < '0' || p->s[p->i] > '9')
    return jfail(p, "expected %s (an integer), found %s", what, found(p, b, sizeof b));
  size_t start = p->i;
  uint64_t v = 0;
  while (p->i < p->n && p->s[p->i] >= '0' && p->s[p->i] <= '9') {
    uint64_t d = p->s[p->i] - '0';
    if (v > ((uint64_t)INT64_MAX - d) / 10) {
      p->i = start;
      return jfail(p, "%s is too large", what);
    }
    v = v * 10 + d;
    p->i++;
  }
  if (p->s[start] == '0' && p->i - start > 1) {
    p->i = start;
    return jfail(p, "%s has a leading zero", what);
  }
  if (at(p, '.') || at(p, 'e') || at(p, 'E')) {
    p->i = start;
    return jfail(p, "%s is not an integer", what);
  }
  *out = v;
  return 0;
}

/* Any JSON number, checked and skipped. */
static int jnumber(jp *p) {
  size_t i = p->i;
  const uint8_t *s = p->s;
#define DIGIT(j) ((j) < p->n && s[j] >= '0' && s[j] <= '9')
  if (i < p->n && s[i] == '-') i++;
  if (!DIGIT(i)) goto bad;
  if (s[i] == '0')
    i++;
  else
    while (DIGIT(i)) i++;
  if (i < p->n && s[i] == '.') {
    if (!DIGIT(i + 1)) goto bad;
    for (i++; DIGIT(i);) i++;
  }
  if (i < p->n && (s[i] == 'e' || s[i] == 'E')) {
    i++;
    if (i < p->n && (s[i] == '+' || s[i] == '-')) i++;
    if (!DIGIT(i)) goto bad;
    while (DIGIT(i)) i++;
  }
#undef DIGIT
  p->i = i;
  return 0;
bad:
  return jfail(p, "malformed number");
}

/* Any JSON value, checked and skipped (unknown keys, __metadata__). */
static int jskip(jp *p, int depth) {
  ws(p);
  char b[16];
  if (depth > MAX_JSON_DEPTH) return jfail(p, "nested more than %d deep", MAX_JSON_DEPTH);
  if (p->i >= p->n) return jfail(p, "expected a value, found the end of the header");
  uint8_t c = p->s[p->i];
  if (c == '"') return jstring(p, NULL, NULL);
  if (c == '-' || (c >= '0' && c <= '9')) return jnumber(p);
  static const char *const words[] = {"true", "false", "null"};
  for (int w = 0; w < 3; w++) {
    size_t k = strlen(words[w]);
    if (p->n - p->i >= k && memcmp(p->s + p->i, words[w], k) == 0) {
      p->i += k;
      return 0;
    }
  }
  if (c != '{' && c != '[') return jfail(p, "expected a value, found %s", found(p, b, sizeof b));
  char close = c == '{' ? '}' : ']';
  p->i++;
  ws(p);
  if (at(p, close)) {
    p->i++;
    return 0;
  }
  for (;;) {
    if (c == '{' && (jstring(p, NULL, NULL) || expect(p, ':'))) return -1;
    if (jskip(p, depth + 1)) return -1;
    ws(p);
    if (at(p, ',')) {
      p->i++;
      continue;
    }
    if (at(p, close)) {
      p->i++;
      return 0;
    }
    return jfail(p, "expected ',' or '%c', found %s", close, found(p, b, sizeof b));
  }
}

/* [a, b, ...] of non-negative integers into v[0..max); the count in *count */
static int juint_array(jp *p, const char *elem, const char *list, int max, uint64_t *v, int *count) {
  if (expect(p, '[')) return -1;
  *count = 0;
  ws(p);
  if (at(p, ']')) {
    p->i++;
    return 0;
  }
  char b[16];
  for (;;) {
    if (*count == max)
      return jfail(p, "%s has more than %d entries", list, max);
    if (juint(p, elem, &v[*count])) return -1;
    ++*count;
    ws(p);
    if (at(p, ',')) {
      p->i++;
      continue;
    }
    if (at(p, ']')) {
      p->i++;
      return 0;
    }
    return jfail(p, "expected ',' or ']' in %s, found %s", list, found(p, b, sizeof b));
  }
}

static bool key_is(const char *k, size_t len, const char *want) {
  return len == strlen(want) && memcmp(k, want, len) == 0;
}

/* {"dtype": ..., "shape": [...], "data_offsets": [b, e]} into e */
static int jtensor(jp *p, ck_entry *e) {
  char nb[128], b[16], elem[200], list[200];
  const char *name = printable(e->name, e->name_len, nb, sizeof nb);
  ws(p);
  if (!at(p, '{')) return jfail(p, "tensor '%s' is not an object", name);
  p->i++;
  bool seen_dtype = false, seen_shape = false, seen_offsets = false;
  ws(p);
  if (at(p, '}')) goto close;
  for (;;) {
    char *key;
    size_t klen;
    size_t key_at = p->i;
    if (jstring(p, &key, &klen)) return -1;
    int rc = expect(p, ':');
    if (rc == 0 && key_is(key, klen, "dtype")) {
      char *dt;
      size_t dlen;
      ws(p);
      size_t dt_at = p->i;
      if (seen_dtype) {
        p->i = key_at;
        rc = jfail(p, "tensor '%s' has two \"dtype\" keys", name);
      } else if ((rc = jstring(p, &dt, &dlen)) == 0) {
        e->dtype = -1;
        for (int k = 0; k < ST_DTYPE_COUNT; k++)
          if (key_is(dt, dlen, st_dtypes[k].name)) e->dtype = k;
        if (e->dtype < 0) {
          char db[48];
          p->i = dt_at;
          rc = jfail(p, "tensor '%s' has an unknown dtype \"%s\"", name, printable(dt, dlen, db, sizeof db));
        }
        free(dt);
      }
      seen_dtype = true;
    } else if (rc == 0 && key_is(key, klen, "shape")) {
      uint64_t dims[KILN_MAX_RANK] = {0};
      if (seen_shape) {
        p->i = key_at;
        rc = jfail(p, "tensor '%s' has two \"shape\" keys", name);
      } else {
        snprintf(elem, sizeof elem, "a dimension of tensor '%s'", name);
        snprintf(list, sizeof list, "the shape of tensor '%s'", name);
        rc = juint_array(p, elem, list, KILN_MAX_RANK, dims, &e->rank);
        for (int k = 0; k < e->rank; k++) e->shape[k] = (int64_t)dims[k];
      }
      seen_shape = true;
    } else if (rc == 0 && key_is(key, klen, "data_offsets")) {
      uint64_t off[2] = {0, 0};
      int count = 0;
      ws(p);
      size_t off_at = p->i;
      if (seen_offsets) {
        p->i = key_at;
        rc = jfail(p, "tensor '%s' has two \"data_offsets\" keys", name);
      } else {
        snprintf(elem, sizeof elem, "a data offset of tensor '%s'", name);
        snprintf(list, sizeof list, "the data_offsets of tensor '%s'", name);
        rc = juint_array(p, elem, list, 2, off, &count);
        if (rc == 0 && count != 2) {
          p->i = off_at;
          rc = jfail(p, "the data_offsets of tensor '%s' need 2 entries, not %d", name, count);
        }
      }
      e->begin = off[0];
      e->end = off[1];
      seen_offsets = true;
    } else if (rc == 0) {
      rc = jskip(p, 2);
    }
    free(key);
    if (rc) return -1;
    ws(p);
    if (at(p, ',')) {
      p->i++;
      continue;
    }
    if (at(p, '}')) break;
    return jfail(p, "expected ',' or '}' in tensor '%s', found %s", name, found(p, b, sizeof b));
  }
close:
  if (!seen_dtype || !seen_shape || !seen_offsets)
    return jfail(p, "tensor '%s' has no \"%s\"", name,
                 !seen_dtype ? "dtype" : !seen_shape ? "shape" : "data_offsets");
  p->i++;
  return 0;
}

/* The whole header: one object of tensors and an optional __metadata__. */
static int jheader(jp *p, ck_index *ix) {
  char b[16];
  if (expect(p, '{')) return -1;
  ws(p);
  if (at(p, '}')) {
    p->i++;
  } else {
    for (;;) {
      char *name;
      size_t len;
      if (jstring(p, &name, &len)) return -1;
      if (expect(p, ':')) {
        free(name);
        return -1;
      }
      if (key_is(name, len, "__metadata__")) {
        free(name);
        if (jskip(p, 1)) return -1;
      } else {
        if (ix->n == ix->cap) {
          size_t cap = ix->cap ? 2 * ix->cap : 16;
          ck_entry *grown = realloc(ix->e, cap * sizeof *grown);
          if (!grown) {
            free(name);
            return jfail(p, "out of memory");
          }
          ix->e = grown;
          ix->cap = cap;
        }
        ck_entry *e = &ix->e[ix->n++];
        memset(e, 0, sizeof *e);
        e->name = name;
        e->name_len = len;
        if (jtensor(p, e)) return -1;
      }
      ws(p);
      if (at(p, ',')) {
        p->i++;
        continue;
      }
      if (at(p, '}')) {
        p->i++;
        break;
      }
      return jfail(p, "expected ',' or '}', found %s", found(p, b, sizeof b));
    }
  }
  ws(p);
  if (p->i != p->n) return jfail(p, "%s after the end of the header object", found(p, b, sizeof b));
  return 0;
}

static int entry_cmp_name(const void *a, const void *b) {
  const ck_entry *x = a, *y = b;
  size_t n = x->name_len < y->name_len ? x->name_len : y->name_len;
  int r = memcmp(x->name, y->name, n);
  if (r) return r;
  return (x->name_len > y->name_len) - (x->name_len < y->name_len);
}

static int entry_cmp_offsets(const void *a, const void *b) {
  const ck_entry *x = *(const ck_entry *const *)a, *y = *(const ck_entry *const *)b;
  if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
  return (x->end > y->end) - (x->end < y->end);
}

/* "F32[2, 3]" */
static char *file_type_str(char *buf, size_t n, const ck_entry *e) {
  size_t used = (size_t)snprintf(buf, n, "%s[", st_dtypes[e->dtype].name);
  for (int i = 0; i < e->rank && used < n; i++)
    used += (size_t)snprintf(buf + used, n - used, i ? ", %lld" : "%lld", (long long)e->shape[i]);
  if (used < n) snprintf(buf + used, n - used, "]");
  return buf;
}

/* Sizes and offsets: each tensor's range holds exactly its elements, and the
 * ranges tile the data that follows the header, as the reference requires. */
static int check_layout(ck_index *ix, uint64_t data_len, char *err, size_t errn) {
  char nb[128], tb[160];
  if (ix->n > 1) qsort(ix->e, ix->n, sizeof *ix->e, entry_cmp_name); /* e is NULL when n is 0 */
  for (size_t i = 0; i + 1 < ix->n; i++)
    if (entry_cmp_name(&ix->e[i], &ix->e[i + 1]) == 0) {
      snprintf(err, errn, "corrupt header: two tensors are named '%s'",
               printable(ix->e[i].name, ix->e[i].name_len, nb, sizeof nb));
      return -1;
    }
  for (size_t i = 0; i < ix->n; i++) {
    ck_entry *e = &ix->e[i];
    const char *name = printable(e->name, e->name_len, nb, sizeof nb);
    int64_t numel = 1;
    for (int k = 0; k < e->rank; k++)
      if (KILN_MUL_OVERFLOW(numel, e->shape[k], &numel)) {
        snprintf(err, errn, "corrupt header: tensor '%s' has a shape whose size overflows", name);
        return -1;
      }
    uint64_t bits;
    if (KILN_MUL_OVERFLOW((uint64_t)numel, (uint64_t)st_dtypes[e->dtype].bits, &bits)) {
      snprintf(err, errn, "corrupt header: tensor '%s' is too large", name);
      return -1;
    }
    if (bits % 8) {
      snprintf(err, errn, "corrupt header: tensor '%s' (%s) is not a whole number of bytes", name,
               file_type_str(tb, sizeof tb, e));
      return -1;
    }
    if (e->end < e->begin || e->end - e->begin != bits / 8) {
      snprintf(err, errn,
               "corrupt header: tensor '%s' is %s (%llu bytes) but its data_offsets [%llu, %llu] "
               "hold %s",
               name, file_type_str(tb, sizeof tb, e), (unsigned long long)(bits / 8),
               (unsigned long long)e->begin, (unsigned long long)e->end,
               e->end < e->begin ? "a negative size" : "another size");
      return -1;
    }
  }
  const ck_entry **order = malloc((ix->n + 1) * sizeof *order);
  if (!order) {
    snprintf(err, errn, "out of memory");
    return -1;
  }
  for (size_t i = 0; i < ix->n; i++) order[i] = &ix->e[i];
  if (ix->n > 1) qsort(order, ix->n, sizeof *order, entry_cmp_offsets);
  uint64_t next = 0;
  bool tiled = true;
  for (size_t i = 0; i < ix->n && tiled; i++) {
    const ck_entry *e = order[i];
    const char *name = printable(e->name, e->name_len, nb, sizeof nb);
    tiled = e->begin == next;
    if (e->begin < next)
      snprintf(err, errn, "corrupt header: the data of tensor '%s' overlaps the tensor before it", name);
    else if (e->begin > next)
      snprintf(err, errn, "corrupt header: %llu unused bytes before the data of tensor '%s'",
               (unsigned long long)(e->begin - next), name);
    next = e->end;
  }
  free(order);
  if (!tiled) return -1;
  if (next > data_len) {
    snprintf(err, errn, "truncated: the header describes %llu bytes of data, the file holds %llu",
             (unsigned long long)next, (unsigned long long)data_len);
    return -1;
  }
  if (next < data_len) {
    snprintf(err, errn, "corrupt: %llu bytes follow the data of the last tensor",
             (unsigned long long)(data_len - next));
    return -1;
  }
  return 0;
}

static const ck_entry *index_find(const ck_index *ix, const char *name) {
  ck_entry key = {.name = (char *)name, .name_len = strlen(name)};
  return ix->n ? bsearch(&key, ix->e, ix->n, sizeof *ix->e, entry_cmp_name) : NULL;
}

/* ---- restore ---- */

static int read_at(FILE *f, uint64_t offset, void *dst, size_t bytes) {
  if (bytes == 0) return 0;
  if (offset > (uint64_t)INT64_MAX || fseeko(f, (off_t)offset, SEEK_SET)) return -1;
  return fread(dst, 1, bytes, f) == bytes ? 0 : -1;
}

/* vars[i] must name a tensor of the file with its dtype and shape. */
static int check_wanted(const char *label, const ck_index *ix, int n, kiln_variable *const *vars,
                        const ck_entry **found_entry) {
  for (int i = 0; i < n; i++) {
    const char *name = kiln_variable_name(vars[i]);
    const ck_entry *e = index_find(ix, name);
    char nb[128], fb[160], vb[160];
    if (!e)
      return kiln_set_error("checkpoint_restore: no tensor named '%s' in %s",
                            printable(name, strlen(name), nb, sizeof nb), label);
    kiln_tensor *value = kiln_variable_read(vars[i]);
    if (!value) return -1;
    kiln_dtype dt = kiln_tensor_dtype(value);
    int rank = kiln_tensor_rank(value);
    const int64_t *shape = kiln_tensor_shape(value);
    if (st_dtypes[e->dtype].kiln != (int)dt || e->rank != rank ||
        memcmp(e->shape, shape, (size_t)rank * sizeof *shape) != 0)
      return kiln_set_error("checkpoint_restore: %s: '%s' is %s in the file, the variable is %s%s", label,
                            printable(name, strlen(name), nb, sizeof nb), file_type_str(fb, sizeof fb, e),
                            kiln_dtype_name(dt), shape_str(vb, sizeof vb, rank, shape));
    found_entry[i] = e;
  }
  return 0;
}

static int restore(const char *label, FILE *f, int n, kiln_variable *const *vars, ck_index *ix,
                   uint8_t **header, kiln_tensor **staged, const ck_entry **entries) {
  const char *who = "checkpoint_restore";
  if (fseeko(f, 0, SEEK_END)) return kiln_set_error("%s: %s: cannot seek: %s", who, label, errno_str(errno));
  off_t size = ftello(f);
  if (size < 0) return kiln_set_error("%s: %s: cannot tell the file size: %s", who, label, errno_str(errno));
  if (size < 8)
    return kiln_set_error("%s: %s: truncated: %lld bytes, less than the 8-byte header length", who, label,
                          (long long)size);
  uint8_t len8[8];
  if (read_at(f, 0, len8, 8)) return kiln_set_error("%s: %s: read error", who, label);
  uint64_t hlen = 0;
  for (int k = 7; k >= 0; k--) hlen = hlen << 8 | len8[k];
  if (hlen > MAX_HEADER_BYTES)
    return kiln_set_error("%s: %s: corrupt: the header length %llu is over the limit of %llu bytes", who,
                          label, (unsigned long long)hlen, MAX_HEADER_BYTES);
  if (hlen > (uint64_t)size - 8)
    return kiln_set_error("%s: %s: truncated: the header is %llu bytes, only %llu follow its length", who,
                          label, (unsigned long long)hlen, (unsigned long long)size - 8);
  if (!(*header = malloc(hlen ? hlen : 1))) return kiln_set_error("%s: out of memory", who);
  if (read_at(f, 8, *header, hlen)) return kiln_set_error("%s: %s: read error", who, label);
  jp p = {.s = *header, .n = hlen};
  size_t bad;
  if (!utf8_valid(*header, hlen, &bad)) {
    p.i = bad;
    jfail(&p, "not UTF-8");
  } else {
    jheader(&p, ix);
  }
  if (p.err[0]) return kiln_set_error("%s: %s: %s", who, label, p.err);
  char err[400];
  if (check_layout(ix, (uint64_t)size - 8 - hlen, err, sizeof err))
    return kiln_set_error("%s: %s: %s", who, label, err);

  /* every check before any variable changes: restore is all or nothing */
  if (check_wanted(label, ix, n, vars, entries)) return -1;
  for (int i = 0; i < n; i++) {
    const ck_entry *e = entries[i];
    kiln_dtype dt = (kiln_dtype)st_dtypes[e->dtype].kiln;
    kiln_tensor *t = staged[i] = tensor_alloc(who, dt, e->rank, e->shape);
    if (!t) return -1;
    if (read_at(f, 8 + hlen + e->begin, t->data, tensor_bytes(t)))
      return kiln_set_error("%s: %s: cannot read the data of '%s' (was the file truncated?)", who, label,
                            kiln_variable_name(vars[i]));
    if (!host_little_endian()) swap_bytes(t->data, tensor_bytes(t), kiln_dtype_sizes[dt]);
    if (dt == KILN_BOOL) { /* kiln's bool is 0 or 1 */
      uint8_t *q = t->data;
      for (int64_t k = 0; k < t->size; k++) q[k] = q[k] != 0;
    }
  }
  for (int i = 0; i < n; i++)
    if (kiln_variable_assign(vars[i], staged[i])) return -1;
  return 0;
}

static int check_vars(const char *who, int n, kiln_variable *const *vars) {
  if (n < 0) return kiln_set_error("%s: n = %d is negative", who, n);
  if (n > 0 && !vars) return kiln_set_error("%s: vars is NULL", who);
  for (int i = 0; i < n; i++)
    if (!vars[i]) return kiln_set_error("%s: vars[%d] is NULL", who, i);
  return 0;
}

int checkpoint_restore_stream(const char *label, FILE *f, int n, kiln_variable *const *vars) {
  if (check_vars("checkpoint_restore", n, vars)) return -1;
  ck_index ix = {0};
  uint8_t *header = NULL;
  kiln_tensor **staged = calloc((size_t)n + 1, sizeof *staged);
  const ck_entry **entries = calloc((size_t)n + 1, sizeof *entries);
  int rc = -1;
  if (!staged || !entries) {
    kiln_set_error("checkpoint_restore: out of memory");
  } else {
    tape_state saved = tape_pause(); /* reading the variables' types is not a use */
    kiln_scope_push();
    rc = restore(label, f, n, vars, &ix, &header, staged, entries);
    kiln_scope_pop();
    tape_resume(saved);
    for (int i = 0; i < n; i++) kiln_release(staged[i]);
  }
  free(staged);
  free(entries);
  free(header);
  index_free(&ix);
  return rc;
}

int kiln_checkpoint_restore(const char *path, int n, kiln_variable *const *vars) {
  const char *who = "checkpoint_restore";
  if (!path) return kiln_set_error("%s: path is NULL", who);
  if (check_vars(who, n, vars)) return -1;
  /* O_NONBLOCK: opening a FIFO must not wait for a writer; it is refused below */
  int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) return kiln_set_error("%s: %s: cannot open: %s", who, path, errno_str(errno));
  struct stat st;
  if (fstat(fd, &st) || !S_ISREG(st.st_mode)) {
    close(fd);
    return kiln_set_error("%s: %s: not a regular file", who, path);
  }
  FILE *f = fdopen(fd, "rb");
  if (!f) {
    int e = errno;
    close(fd);
    return kiln_set_error("%s: %s: cannot open: %s", who, path, errno_str(e));
  }
  int rc = checkpoint_restore_stream(path, f, n, vars);
  fclose(f);
  return rc;
}

/* ---- save ---- */

typedef struct {
  char *s;
  size_t n, cap;
  bool oom;
} sbuf;

static void sb_put(sbuf *b, const char *s, size_t n) {
  if (b->oom) return;
  if (b->n + n + 1 > b->cap) {
    size_t cap = b->cap ? b->cap : 256;
    while (cap < b->n + n + 1) cap *= 2;
    char *grown = realloc(b->s, cap);
    if (!grown) {
      b->oom = true;
      return;
    }
    b->s = grown;
    b->cap = cap;
  }
  memcpy(b->s + b->n, s, n);
  b->n += n;
  b->s[b->n] = '\0';
}

static void sb_str(sbuf *b, const char *s) { sb_put(b, s, strlen(s)); }

static void sb_u64(sbuf *b, uint64_t v) {
  char tmp[24];
  sb_put(b, tmp, (size_t)snprintf(tmp, sizeof tmp, "%llu", (unsigned long long)v));
}

/* A JSON string, escaped as serde_json (the reference) escapes it. */
static void sb_json_string(sbuf *b, const char *s) {
  sb_put(b, "\"", 1);
  for (; *s; s++) {
    unsigned char c = (unsigned char)*s;
    const char *esc = NULL;
    char u[8];
    switch (c) {
    case '"': esc = "\\\""; break;
    case '\\': esc = "\\\\"; break;
    case '\b': esc = "\\b"; break;
    case '\f': esc = "\\f"; break;
    case '\n': esc = "\\n"; break;
    case '\r': esc = "\\r"; break;
    case '\t': esc = "\\t"; break;
    default:
      if (c < 0x20) {
        snprintf(u, sizeof u, "\\u%04x", c);
        esc = u;
      }
    }
    if (esc)
      sb_str(b, esc);
    else
      sb_put(b, (const char *)&c, 1);
  }
  sb_put(b, "\"", 1);
}

typedef struct {
  const char *name;
  kiln_tensor *value;
  int index; /* in vars */
} save_item;

static int save_item_by_name(const void *a, const void *b) {
  return strcmp(((const save_item *)a)->name, ((const save_item *)b)->name);
}

/* The reference's layout: dtypes in descending order of the table (so
 * larger elements first, and every tensor aligned to its element size, the
 * data starting 8-aligned), then by name. A file saved here is then byte for
 * byte what the reference writes for the same tensors. */
static int save_item_by_layout(const void *a, const void *b) {
  const save_item *x = a, *y = b;
  int dx = st_index(kiln_tensor_dtype(x->value)), dy = st_index(kiln_tensor_dtype(y->value));
  if (dx != dy) return dx > dy ? -1 : 1;
  return strcmp(x->name, y->name);
}

static int write_all(int fd, const void *p, size_t n) {
  const uint8_t *q = p;
  while (n) {
    ssize_t w = write(fd, q, n > ((size_t)1 << 30) ? ((size_t)1 << 30) : n);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return -1;
    q += w;
    n -= (size_t)w;
  }
  return 0;
}

/* The data of one tensor, little-endian whatever the host. */
static int write_tensor(int fd, const kiln_tensor *t) {
  const uint8_t *data = kiln_tensor_data(t);
  size_t bytes = tensor_bytes(t), elem = kiln_dtype_size(kiln_tensor_dtype(t));
  if (host_little_endian() || elem == 1) return write_all(fd, data, bytes);
  uint8_t chunk[1 << 16];
  for (size_t off = 0; off < bytes; off += sizeof chunk) {
    size_t k = bytes - off < sizeof chunk ? bytes - off : sizeof chunk;
    memcpy(chunk, data + off, k);
    swap_bytes(chunk, k, elem);
    if (write_all(fd, chunk, k)) return -1;
  }
  return 0;
}

/* The header and the items' values, in items' order. */
static int build_header(save_item *items, int n, sbuf *h) {
  uint64_t offset = 0;
  sb_str(h, "{");
  for (int i = 0; i < n; i++) {
    const kiln_tensor *t = items[i].value;
    if (i) sb_str(h, ",");
    sb_json_string(h, items[i].name);
    sb_str(h, ":{\"dtype\":\"");
    sb_str(h, st_dtypes[st_index(kiln_tensor_dtype(t))].name);
    sb_str(h, "\",\"shape\":[");
    for (int k = 0; k < kiln_tensor_rank(t); k++) {
      if (k) sb_str(h, ",");
      sb_u64(h, (uint64_t)kiln_tensor_shape(t)[k]);
    }
    sb_str(h, "],\"data_offsets\":[");
    sb_u64(h, offset);
    sb_str(h, ",");
    offset += tensor_bytes(t);
    sb_u64(h, offset);
    sb_str(h, "]}");
  }
  sb_str(h, "}");
  while (h->n % 8) sb_str(h, " "); /* the data starts 8-aligned, as the reference pads */
  return h->oom ? kiln_set_error("checkpoint_save: out of memory") : 0;
}

/* What lstat says path is, when it is something a save must not replace:
 * a save renames a new file over path, which would swap a device, a FIFO
 * or a link (run as root, /dev/null) for a regular file. NULL when path is
 * a regular file or absent. */
static const char *not_regular(const char *path) {
  struct stat st;
  if (lstat(path, &st)) return NULL; /* absent (or unreachable: creating the file says why) */
  if (S_ISREG(st.st_mode)) return NULL;
  return S_ISDIR(st.st_mode)    ? "a directory"
         : S_ISLNK(st.st_mode)  ? "a symbolic link"
         : S_ISFIFO(st.st_mode) ? "a FIFO"
         : S_ISCHR(st.st_mode)  ? "a character device"
         : S_ISBLK(st.st_mode)  ? "a block device"
         : S_ISSOCK(st.st_mode) ? "a socket"
                                : "not a file";
}

static int save(const char *path, int n, kiln_variable *const *vars, save_item *items) {
  const char *who = "checkpoint_save";
  char nb[128];
  for (int i = 0; i < n; i++) {
    const char *name = kiln_variable_name(vars[i]);
    size_t bad;
    if (!utf8_valid((const uint8_t *)name, strlen(name), &bad))
      return kiln_set_error("%s: the name of vars[%d] is not UTF-8", who, i);
    if (strcmp(name, "__metadata__") == 0)
      return kiln_set_error("%s: vars[%d] is named '__metadata__', which the format reserves", who, i);
    kiln_tensor *t = kiln_variable_read(vars[i]);
    if (t && !(t->flags & TF_SYMBOLIC) && strcmp(kiln_tensor_device(t), "cpu:0") != 0)
      t = kiln_to_device(t, "cpu:0");
    if (!t || (t->flags & TF_SYMBOLIC) || (tensor_bytes(t) && !kiln_tensor_data(t))) {
      if (t && (t->flags & TF_SYMBOLIC))
        return kiln_set_error("%s: variable '%s' has no value while a function is being traced; save "
                              "outside the staged function", who, printable(name, strlen(name), nb, sizeof nb));
      char reason[512];
      snprintf(reason, sizeof reason, "%s", kiln_last_error());
      return kiln_set_error("%s: variable '%s': %s", who, printable(name, strlen(name), nb, sizeof nb),
                            reason);
    }
    items[i] = (save_item){name, t, i};
  }
  qsort(items, (size_t)n, sizeof *items, save_item_by_name);
  for (int i = 0; i + 1 < n; i++)
    if (strcmp(items[i].name, items[i + 1].name) == 0) {
      int a = items[i].index < items[i + 1].index ? items[i].index : items[i + 1].index;
      int b = items[i].index ^ items[i + 1].index ^ a;
      return kiln_set_error("%s: vars[%d] and vars[%d] are both named '%s'", who, a, b,
                            printable(items[i].name, strlen(items[i].name), nb, sizeof nb));
    }
  qsort(items, (size_t)n, sizeof *items, save_item_by_layout);

  sbuf h = {0};
  if (build_header(items, n, &h)) {
    free(h.s);
    return -1;
  }
  const char *kind = not_regular(path);
  if (kind) {
    free(h.s);
    return kiln_set_error("%s: %s is not a regular file (%s); a save replaces only a regular file", who,
                          path, kind);
  }
  size_t tmp_n = strlen(path) + 64;
  char *tmp = malloc(tmp_n);
  if (!tmp) {
    free(h.s);
    return kiln_set_error("%s: out of memory", who);
  }
  int fd = files_open_temp(path, tmp, tmp_n, 0666);
  if (fd < 0) {
    int e = errno;
    free(h.s);
    free(tmp);
    return kiln_set_error("%s: %s: cannot create a file there: %s", who, path, errno_str(e));
  }
  uint8_t len8[8];
  for (int k = 0; k < 8; k++) len8[k] = (uint8_t)((uint64_t)h.n >> (8 * k));
  int ok = write_all(fd, len8, 8) == 0 && write_all(fd, h.s, h.n) == 0;
  for (int i = 0; ok && i < n; i++) ok = write_tensor(fd, items[i].value) == 0;
  ok = ok && fsync(fd) == 0;
  int e = errno;
  if (close(fd) && ok) {
    ok = 0;
    e = errno;
  }
  if (ok && rename(tmp, path)) {
    ok = 0;
    e = errno;
  }
  free(h.s);
  if (!ok) {
    unlink(tmp);
    free(tmp);
    return kiln_set_error("%s: %s: cannot write: %s", who, path, errno_str(e));
  }
  free(tmp);
  return 0;
}

int kiln_checkpoint_save(const char *path, int n, kiln_variable *const *vars) {
  const char *who = "checkpoint_save";
  if (!path) return kiln_set_error("%s: path is NULL", who);
  if (!*path) return kiln_set_error("%s: path is empty", who);
  if (check_vars(who, n, vars)) return -1;
  save_item *items = calloc((size_t)n + 1, sizeof *items);
  if (!items) return kiln_set_error("%s: out of memory", who);
  tape_state saved = tape_pause(); /* saving is not a use of the variables */
  kiln_scope_push();
  int rc = save(path, n, vars, items);
  kiln_scope_pop();
  tape_resume(saved);
  free(items);
  return rc;
}
