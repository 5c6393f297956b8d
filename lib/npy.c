/* npy.c — tensors to and from NumPy's .npy files (format 1.0, 2.0, 3.0):
 * a magic string, a version, a header that is a Python dict literal
 * {'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), } and the raw
 * elements. The reader trusts nothing: the header is parsed by a small
 * parser for exactly that literal, and its shape checked against the file's
 * size before anything is allocated. */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include "files.h"
#include "json.h"
#include "runtime.h"

#define LOAD "load_npy"
#define SAVE "save_npy"

/* A version 1.0 header's length field is 16 bits; NumPy's reader refuses
 * headers over 10000 bytes. Anything longer is not a header of ours. */
#define MAX_HEADER_BYTES 65535u

static const char magic[6] = {'\x93', 'N', 'U', 'M', 'P', 'Y'};

/* ---- dtypes ----
 * The element types a file may hold: Kiln's own, and narrower or unsigned
 * integers, which load widened to the Kiln integer that holds every value. */
typedef enum { K_FLOAT, K_INT, K_UINT, K_BOOL } npy_kind;

typedef struct {
  char code;    /* the descr's kind letter */
  int size;     /* bytes */
  npy_kind kind;
  int kiln;     /* the dtype it loads as */
  bool exact;   /* the bytes are already Kiln's (after byte order) */
} npy_type;

static const npy_type npy_types[] = {
    {'f', 4, K_FLOAT, KILN_F32, true}, {'f', 8, K_FLOAT, KILN_F64, true}, {'f', 2, K_FLOAT, KILN_F16, true},
    {'i', 4, K_INT, KILN_I32, true},   {'i', 8, K_INT, KILN_I64, true},   {'b', 1, K_BOOL, KILN_BOOL, false},
    {'i', 1, K_INT, KILN_I32, false},  {'i', 2, K_INT, KILN_I32, false},  {'u', 1, K_UINT, KILN_I32, false},
    {'u', 2, K_UINT, KILN_I32, false}, {'u', 4, K_UINT, KILN_I64, false}, {'u', 8, K_UINT, KILN_I64, false},
};

/* ---- the header ---- */

typedef struct {
  const char *s, *end;
} cursor;

static void skip_space(cursor *c) {
  while (c->s < c->end && (*c->s == ' ' || *c->s == '\t' || *c->s == '\n' || *c->s == '\r')) c->s++;
}

static bool eat(cursor *c, char ch) {
  skip_space(c);
  if (c->s < c->end && *c->s == ch) {
    c->s++;
    return true;
  }
  return false;
}

/* A quoted Python string without escapes into buf (n bytes). */
static bool parse_string(cursor *c, char *buf, size_t n) {
  skip_space(c);
  if (c->s >= c->end || (*c->s != '\'' && *c->s != '"')) return false;
  char q = *c->s++;
  size_t k = 0;
  while (c->s < c->end && *c->s != q) {
    if (*c->s == '\\' || k + 1 >= n) return false;
    buf[k++] = *c->s++;
  }
  if (c->s >= c->end) return false;
  c->s++;
  buf[k] = '\0';
  return true;
}

static bool parse_word(cursor *c, const char *w) {
  skip_space(c);
  size_t n = strlen(w);
  if ((size_t)(c->end - c->s) < n || memcmp(c->s, w, n)) return false;
  c->s += n;
  return true;
}

typedef struct {
  char descr[16];
  bool fortran;
  int rank;
  int64_t shape[KILN_MAX_RANK];
} npy_header;

/* "(2, 3)", "(3,)", "()": non-negative dims, at most KILN_MAX_RANK. */
static int parse_shape(cursor *c, const char *path, npy_header *h) {
  if (!eat(c, '(')) return kiln_set_error("%s: %s: the header's shape is not a tuple", LOAD, path);
  h->rank = 0;
  while (!eat(c, ')')) {
    skip_space(c);
    if (h->rank == KILN_MAX_RANK)
      return kiln_set_error("%s: %s: the shape has more than %d dimensions", LOAD, path, KILN_MAX_RANK);
    int64_t d = 0;
    const char *start = c->s;
    while (c->s < c->end && *c->s >= '0' && *c->s <= '9') {
      if (d > (INT64_MAX - 9) / 10) return kiln_set_error("%s: %s: a dimension overflows", LOAD, path);
      d = d * 10 + (*c->s++ - '0');
    }
    if (c->s == start) return kiln_set_error("%s: %s: the shape holds something other than sizes", LOAD, path);
    if (c->s < c->end && *c->s == 'L') c->s++; /* Python 2's long */
    h->shape[h->rank++] = d;
    if (!eat(c, ',')) {
      if (!eat(c, ')')) return kiln_set_error("%s: %s: the header's shape is malformed", LOAD, path);
      break;
    }
  }
  return 0;
}

/* The dict literal: exactly the keys descr, fortran_order and shape. */
static int parse_header(const char *text, size_t n, const char *path, npy_header *h) {
  cursor c = {text, text + n};
  bool seen[3] = {false, false, false};
  if (!eat(&c, '{')) return kiln_set_error("%s: %s: the header is not a dict", LOAD, path);
  while (!eat(&c, '}')) {
    char key[32];
    if (!parse_string(&c, key, sizeof key) || !eat(&c, ':'))
      return kiln_set_error("%s: %s: the header is malformed", LOAD, path);
    int k = !strcmp(key, "descr") ? 0 : !strcmp(key, "fortran_order") ? 1 : !strcmp(key, "shape") ? 2 : -1;
    if (k < 0) return kiln_set_error("%s: %s: the header has an unknown key '%s'", LOAD, path, key);
    if (seen[k]) return kiln_set_error("%s: %s: the header repeats '%s'", LOAD, path, key);
    seen[k] = true;
    if (k == 0) {
      skip_space(&c);
      if (c.s < c.end && *c.s == '[')
        return kiln_set_error("%s: %s: a structured dtype (a record per element) is not supported", LOAD,
                              path);
      if (!parse_string(&c, h->descr, sizeof h->descr))
        return kiln_set_error("%s: %s: the header's descr is not a short string", LOAD, path);
    } else if (k == 1) {
      if (parse_word(&c, "True"))
        h->fortran = true;
      else if (parse_word(&c, "False"))
        h->fortran = false;
      else
        return kiln_set_error("%s: %s: fortran_order is neither True nor False", LOAD, path);
    } else if (parse_shape(&c, path, h)) {
      return -1;
    }
    if (!eat(&c, ',')) {
      if (!eat(&c, '}')) return kiln_set_error("%s: %s: the header is malformed", LOAD, path);
      break;
    }
  }
  skip_space(&c);
  if (c.s != c.end) return kiln_set_error("%s: %s: the header has bytes after its dict", LOAD, path);
  for (int k = 0; k < 3; k++)
    if (!seen[k])
      return kiln_set_error("%s: %s: the header lacks '%s'", LOAD, path,
                            k == 0 ? "descr" : k == 1 ? "fortran_order" : "shape");
  return 0;
}

/* descr "<f4", ">i8", "|b1", "=u2": the type, and whether its bytes need
 * reversing on this host. */
static const npy_type *parse_descr(const char *d, const char *path, bool *swap) {
  size_t n = strlen(d);
  char order = n ? d[0] : 0;
  const char *t = d;
  if (order == '<' || order == '>' || order == '|' || order == '=') t++;
  char code = t[0] == '?' ? 'b' : t[0];
  int size = t[0] == '?' && !t[1] ? 1 : 0;
  if (!size && t[0] && t[1] >= '1' && t[1] <= '9' && !t[2]) size = t[1] - '0';
  const npy_type *ty = NULL;
  for (size_t i = 0; size && i < sizeof npy_types / sizeof npy_types[0]; i++)
    if (npy_types[i].code == code && npy_types[i].size == size) ty = &npy_types[i];
  if (!ty) {
    kiln_set_error("%s: %s: dtype '%s' is not supported (f2, f4, f8, i1-i8, u1-u8 and b1 are)", LOAD, path, d);
    return NULL;
  }
  if (order == '|' && size > 1) {
    kiln_set_error("%s: %s: dtype '%s' has no byte order", LOAD, path, d);
    return NULL;
  }
  bool little = order == '<' || (order != '>' && files_host_little_endian());
  *swap = size > 1 && little != (bool)files_host_little_endian();
  return ty;
}

/* ---- load ---- */

/* n elements of type ty (host byte order) at src into dst of dtype ty->kiln:
 * widened integers, and bools as 0 or 1. -1 when a u8 does not fit i64. */
static int widen(const npy_type *ty, const uint8_t *src, void *dst, int64_t n) {
  for (int64_t i = 0; i < n; i++) {
    const uint8_t *p = src + i * ty->size;
    if (ty->kind == K_BOOL) {
      ((uint8_t *)dst)[i] = *p != 0;
      continue;
    }
    int64_t v;
    if (ty->size == 1) {
      v = ty->kind == K_INT ? (int64_t)(int8_t)*p : (int64_t)*p;
    } else if (ty->size == 2) {
      uint16_t u;
      memcpy(&u, p, 2);
      v = ty->kind == K_INT ? (int64_t)(int16_t)u : (int64_t)u;
    } else if (ty->size == 4) {
      uint32_t u;
      memcpy(&u, p, 4);
      v = ty->kind == K_INT ? (int64_t)(int32_t)u : (int64_t)u;
    } else {
      uint64_t u;
      memcpy(&u, p, 8);
      if (ty->kind == K_UINT && u > (uint64_t)INT64_MAX) return -1;
      v = (int64_t)u;
    }
    if (ty->kiln == KILN_I32)
      ((int32_t *)dst)[i] = (int32_t)v;
    else
      ((int64_t *)dst)[i] = v;
  }
  return 0;
}

/* dst (C order) from src holding the same shape in Fortran order: element
 * (i0, ..., ik) of src lies at i0 + d0 * (i1 + d1 * (...)). */
static void from_fortran(const uint8_t *src, uint8_t *dst, int rank, const int64_t *shape, int64_t size,
                         size_t elem) {
  int64_t idx[KILN_MAX_RANK] = {0}, stride[KILN_MAX_RANK];
  int64_t s = 1;
  for (int k = 0; k < rank; k++) {
    stride[k] = s;
    s *= shape[k];
  }
  int64_t off = 0;
  for (int64_t i = 0; i < size; i++) {
    memcpy(dst + (size_t)i * elem, src + (size_t)off * elem, elem);
    for (int k = rank - 1; k >= 0; k--) { /* the next C-order index */
      off += stride[k];
      if (++idx[k] < shape[k]) break;
      off -= stride[k] * shape[k];
      idx[k] = 0;
    }
  }
}

/* The tensor of an open file of size bytes; NULL with the error set. */
static kiln_tensor *load_fd(int fd, int64_t size, const char *path) {
  uint8_t pre[12];
  if (size < 10 || files_read_all(fd, pre, 10) || memcmp(pre, magic, 6)) {
    kiln_set_error("%s: %s: not a .npy file (no \\x93NUMPY magic)", LOAD, path);
    return NULL;
  }
  int major = pre[6];
  size_t hlen, pre_n = 10;
  if (major == 1) {
    hlen = (size_t)pre[8] | (size_t)pre[9] << 8;
  } else if (major == 2 || major == 3) {
    if (size < 12 || files_read_all(fd, pre + 10, 2)) {
      kiln_set_error("%s: %s: truncated in its preamble", LOAD, path);
      return NULL;
    }
    pre_n = 12;
    hlen = (size_t)pre[8] | (size_t)pre[9] << 8 | (size_t)pre[10] << 16 | (size_t)pre[11] << 24;
  } else {
    kiln_set_error("%s: %s: format version %d.%d is not supported (1.0, 2.0 and 3.0 are)", LOAD, path, major,
                   pre[7]);
    return NULL;
  }
  if (hlen > MAX_HEADER_BYTES) {
    kiln_set_error("%s: %s: the header claims %zu bytes (at most %u are read)", LOAD, path, hlen,
                   MAX_HEADER_BYTES);
    return NULL;
  }
  if ((int64_t)(pre_n + hlen) > size) {
    kiln_set_error("%s: %s: truncated in its header (%zu bytes claimed, %lld there)", LOAD, path, hlen,
                   (long long)(size - (int64_t)pre_n));
    return NULL;
  }
  char *text = malloc(hlen + 1);
  npy_header h = {0};
  if (!text || files_read_all(fd, text, hlen)) {
    kiln_set_error("%s: %s: cannot read: %s", LOAD, path, text ? strerror(errno) : "out of memory");
    free(text);
    return NULL;
  }
  int bad = parse_header(text, hlen, path, &h);
  free(text);
  if (bad) return NULL;
  bool swap;
  const npy_type *ty = parse_descr(h.descr, path, &swap);
  if (!ty) return NULL;
  int64_t count;
  if (shape_check(LOAD, h.rank, h.shape, &count)) { /* "load_npy: the element count ... overflows" */
    char why[512];
    snprintf(why, sizeof why, "%s", kiln_last_error() + strlen(LOAD ": "));
    kiln_set_error("%s: %s: %s", LOAD, path, why);
    return NULL;
  }
  int64_t want = count * ty->size, have = size - (int64_t)(pre_n + hlen);
  if (have != want) {
    char sb[256];
    kiln_set_error("%s: %s: %s: %lld bytes of data, but shape %s of '%s' takes %lld", LOAD, path,
                   have < want ? "truncated" : "trailing bytes", (long long)have,
                   shape_str(sb, sizeof sb, h.rank, h.shape), h.descr, (long long)want);
    return NULL;
  }
  kiln_tensor *t = tensor_alloc(LOAD, (kiln_dtype)ty->kiln, h.rank, h.shape);
  if (!t) return NULL;
  size_t bytes = (size_t)want;
  /* the raw bytes go straight into t when nothing is to be rearranged */
  bool direct = ty->exact && !(h.fortran && h.rank > 1);
  uint8_t *raw = direct ? t->data : malloc(bytes ? bytes : 1);
  if (!raw) {
    kiln_release(t);
    kiln_set_error("%s: %s: out of memory for %zu bytes", LOAD, path, bytes);
    return NULL;
  }
  if (files_read_all(fd, raw, bytes)) {
    kiln_set_error("%s: %s: cannot read: %s", LOAD, path, strerror(errno));
    if (!direct) free(raw);
    kiln_release(t);
    return NULL;
  }
  if (swap) files_swap_bytes(raw, bytes, (size_t)ty->size);
  if (!direct) {
    uint8_t *c_order = raw;
    if (h.fortran && h.rank > 1) {
      c_order = malloc(bytes ? bytes : 1);
      if (!c_order) {
        free(raw);
        kiln_release(t);
        kiln_set_error("%s: %s: out of memory for %zu bytes", LOAD, path, bytes);
        return NULL;
      }
      from_fortran(raw, c_order, h.rank, h.shape, count, (size_t)ty->size);
      free(raw);
    }
    if (ty->exact) {
      if (bytes) memcpy(t->data, c_order, bytes);
    } else if (widen(ty, c_order, t->data, count)) {
      free(c_order);
      kiln_release(t);
      kiln_set_error("%s: %s: a uint64 value does not fit i64", LOAD, path);
      return NULL;
    }
    free(c_order);
  }
  return t;
}

kiln_tensor *kiln_load_npy(const char *path) {
  if (!path) {
    kiln_set_error("%s: path is NULL", LOAD);
    return NULL;
  }
  /* O_NONBLOCK: opening a FIFO must not wait for a writer; it is refused below */
  int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) {
    kiln_set_error("%s: %s: cannot open: %s", LOAD, path, strerror(errno));
    return NULL;
  }
  struct stat st;
  kiln_tensor *t = NULL;
  if (fstat(fd, &st) || !S_ISREG(st.st_mode))
    kiln_set_error("%s: %s: not a regular file", LOAD, path);
  else
    t = load_fd(fd, (int64_t)st.st_size, path);
  close(fd);
  return t ? scope_own(t) : NULL;
}

/* ---- save ---- */

typedef struct {
  const json_buf *header; /* magic to the final newline */
  const kiln_tensor *t;
} npy_file;

static int write_npy(int fd, void *ctx) {
  const npy_file *f = ctx;
  if (files_write_all(fd, f->header->s, f->header->n)) return -1;
  return files_write_le(fd, f->t->data, tensor_bytes(f->t), kiln_dtype_sizes[f->t->dtype]);
}

/* What NumPy writes: version 1.0, the dict padded with spaces and a newline
 * so that the data starts 64-byte aligned. */
static void build_header(const kiln_tensor *t, json_buf *b) {
  static const char *descrs[KILN_DTYPE_COUNT] = {
      [KILN_F32] = "<f4", [KILN_F64] = "<f8", [KILN_I32] = "<i4", [KILN_I64] = "<i8",
      [KILN_BOOL] = "|b1", [KILN_F16] = "<f2",
  };
  json_buf_put(b, magic, 6);
  json_buf_put(b, "\x01\x00\x00\x00", 4); /* version 1.0, length filled in below */
  json_buf_str(b, "{'descr': '");
  json_buf_str(b, descrs[t->dtype]);
  json_buf_str(b, "', 'fortran_order': False, 'shape': (");
  for (int k = 0; k < t->rank; k++) {
    if (k) json_buf_str(b, ", ");
    json_buf_u64(b, (uint64_t)t->shape[k]);
  }
  json_buf_str(b, t->rank == 1 ? ",), }" : "), }");
  while ((b->n + 1) % 64) json_buf_str(b, " ");
  json_buf_str(b, "\n");
  if (b->oom) return;
  size_t hlen = b->n - 10; /* under 64 KiB: rank <= 8 */
  b->s[8] = (char)(hlen & 0xff);
  b->s[9] = (char)(hlen >> 8);
}

int kiln_save_npy(const char *path, const kiln_tensor *t) {
  if (!path) return kiln_set_error("%s: path is NULL", SAVE);
  if (!*path) return kiln_set_error("%s: path is empty", SAVE);
  if (!t) return kiln_has_error() ? -1 : kiln_set_error("%s: tensor is NULL", SAVE);
  if (t->dtype == KILN_BF16)
    return kiln_set_error("%s: %s: bf16 has no NumPy dtype; kiln_cast the tensor to f32 (exact) first", SAVE,
                          path);
  const char *kind = files_not_regular(path);
  if (kind)
    return kiln_set_error("%s: %s is not a regular file (%s); a save replaces only a regular file", SAVE, path,
                          kind);
  kiln_tensor *copy;
  const kiln_tensor *host = tensor_on_host(SAVE, t, &copy);
  if (!host) return -1;
  json_buf b = {0};
  build_header(host, &b);
  int rc;
  if (b.oom) {
    rc = kiln_set_error("%s: out of memory", SAVE);
  } else {
    npy_file f = {&b, host};
    const char *stage;
    rc = files_replace(path, 0666, write_npy, &f, &stage);
    if (rc)
      kiln_set_error("%s: %s: cannot %s: %s", SAVE, path, !strcmp(stage, "create") ? "create a file there" : "write",
                     strerror(errno));
  }
  free(b.s);
  kiln_release(copy);
  return rc;
}
