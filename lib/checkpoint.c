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
#include "json.h"

/* The reference implementation's limit; a larger header is corrupt. */
#define MAX_HEADER_BYTES 100000000ull

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

/* [a, b, ...] of non-negative integers into v[0..max); the count in *count */
static int juint_array(json_parser *p, const char *elem, const char *list, int max, uint64_t *v, int *count) {
  if (json_expect(p, '[')) return -1;
  *count = 0;
  json_ws(p);
  if (json_at(p, ']')) {
    p->i++;
    return 0;
  }
  char b[JSON_FOUND_BYTES];
  for (;;) {
    if (*count == max)
      return json_fail(p, "%s has more than %d entries", list, max);
    if (json_uint(p, elem, &v[*count])) return -1;
    ++*count;
    json_ws(p);
    if (json_at(p, ',')) {
      p->i++;
      continue;
    }
    if (json_at(p, ']')) {
      p->i++;
      return 0;
    }
    return json_fail(p, "expected ',' or ']' in %s, found %s", list, json_found(p, b, sizeof b));
  }
}

static bool key_is(const char *k, size_t len, const char *want) {
  return len == strlen(want) && memcmp(k, want, len) == 0;
}

/* {"dtype": ..., "shape": [...], "data_offsets": [b, e]} into e */
static int jtensor(json_parser *p, ck_entry *e) {
  char nb[128], b[16], elem[200], list[200];
  const char *name = printable(e->name, e->name_len, nb, sizeof nb);
  json_ws(p);
  if (!json_at(p, '{')) return json_fail(p, "tensor '%s' is not an object", name);
  p->i++;
  bool seen_dtype = false, seen_shape = false, seen_offsets = false;
  json_ws(p);
  if (json_at(p, '}')) goto close;
  for (;;) {
    char *key;
    size_t klen;
    size_t key_at = p->i;
    if (json_string(p, &key, &klen)) return -1;
    int rc = json_expect(p, ':');
    if (rc == 0 && key_is(key, klen, "dtype")) {
      char *dt;
      size_t dlen;
      json_ws(p);
      size_t dt_at = p->i;
      if (seen_dtype) {
        p->i = key_at;
        rc = json_fail(p, "tensor '%s' has two \"dtype\" keys", name);
      } else if ((rc = json_string(p, &dt, &dlen)) == 0) {
        e->dtype = -1;
        for (int k = 0; k < ST_DTYPE_COUNT; k++)
          if (key_is(dt, dlen, st_dtypes[k].name)) e->dtype = k;
        if (e->dtype < 0) {
          char db[48];
          p->i = dt_at;
          rc = json_fail(p, "tensor '%s' has an unknown dtype \"%s\"", name, printable(dt, dlen, db, sizeof db));
        }
        free(dt);
      }
      seen_dtype = true;
    } else if (rc == 0 && key_is(key, klen, "shape")) {
      uint64_t dims[KILN_MAX_RANK] = {0};
      if (seen_shape) {
        p->i = key_at;
        rc = json_fail(p, "tensor '%s' has two \"shape\" keys", name);
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
      json_ws(p);
      size_t off_at = p->i;
      if (seen_offsets) {
        p->i = key_at;
        rc = json_fail(p, "tensor '%s' has two \"data_offsets\" keys", name);
      } else {
        snprintf(elem, sizeof elem, "a data offset of tensor '%s'", name);
        snprintf(list, sizeof list, "the data_offsets of tensor '%s'", name);
        rc = juint_array(p, elem, list, 2, off, &count);
        if (rc == 0 && count != 2) {
          p->i = off_at;
          rc = json_fail(p, "the data_offsets of tensor '%s' need 2 entries, not %d", name, count);
        }
      }
      e->begin = off[0];
      e->end = off[1];
      seen_offsets = true;
    } else if (rc == 0) {
      rc = json_skip(p, 2);
    }
    free(key);
    if (rc) return -1;
    json_ws(p);
    if (json_at(p, ',')) {
      p->i++;
      continue;
    }
    if (json_at(p, '}')) break;
    return json_fail(p, "expected ',' or '}' in tensor '%s', found %s", name, json_found(p, b, sizeof b));
  }
close:
  if (!seen_dtype || !seen_shape || !seen_offsets)
    return json_fail(p, "tensor '%s' has no \"%s\"", name,
                 !seen_dtype ? "dtype" : !seen_shape ? "shape" : "data_offsets");
  p->i++;
  return 0;
}

/* The whole header: one object of tensors and an optional __metadata__. */
static int jheader(json_parser *p, ck_index *ix) {
  char b[JSON_FOUND_BYTES];
  if (json_expect(p, '{')) return -1;
  json_ws(p);
  if (json_at(p, '}')) {
    p->i++;
  } else {
    for (;;) {
      char *name;
      size_t len;
      if (json_string(p, &name, &len)) return -1;
      if (json_expect(p, ':')) {
        free(name);
        return -1;
      }
      if (key_is(name, len, "__metadata__")) {
        free(name);
        if (json_skip(p, 1)) return -1;
      } else {
        if (ix->n == ix->cap) {
          size_t cap = ix->cap ? 2 * ix->cap : 16;
          ck_entry *grown = realloc(ix->e, cap * sizeof *grown);
          if (!grown) {
            free(name);
            return json_fail(p, "out of memory");
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
      json_ws(p);
      if (json_at(p, ',')) {
        p->i++;
        continue;
      }
      if (json_at(p, '}')) {
        p->i++;
        break;
      }
      return json_fail(p, "expected ',' or '}', found %s", json_found(p, b, sizeof b));
    }
  }
  json_ws(p);
  if (p->i != p->n) return json_fail(p, "%s after the end of the header object", json_found(p, b, sizeof b));
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
  json_parser p = {.s = *header, .n = hlen, .what = "header", .base = 8};
  size_t bad;
  if (!json_utf8_valid(*header, hlen, &bad)) {
    p.i = bad;
    json_fail(&p, "not UTF-8");
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
    if (!files_host_little_endian()) files_swap_bytes(t->data, tensor_bytes(t), kiln_dtype_sizes[dt]);
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

/* The data of one tensor, little-endian whatever the host. */
static int write_tensor(int fd, const kiln_tensor *t) {
  return files_write_le(fd, kiln_tensor_data(t), tensor_bytes(t), kiln_dtype_size(kiln_tensor_dtype(t)));
}

/* The header and the items' values, in items' order. */
static int build_header(save_item *items, int n, json_buf *h) {
  uint64_t offset = 0;
  json_buf_str(h, "{");
  for (int i = 0; i < n; i++) {
    const kiln_tensor *t = items[i].value;
    if (i) json_buf_str(h, ",");
    json_buf_quoted(h, items[i].name);
    json_buf_str(h, ":{\"dtype\":\"");
    json_buf_str(h, st_dtypes[st_index(kiln_tensor_dtype(t))].name);
    json_buf_str(h, "\",\"shape\":[");
    for (int k = 0; k < kiln_tensor_rank(t); k++) {
      if (k) json_buf_str(h, ",");
      json_buf_u64(h, (uint64_t)kiln_tensor_shape(t)[k]);
    }
    json_buf_str(h, "],\"data_offsets\":[");
    json_buf_u64(h, offset);
    json_buf_str(h, ",");
    offset += tensor_bytes(t);
    json_buf_u64(h, offset);
    json_buf_str(h, "]}");
  }
  json_buf_str(h, "}");
  while (h->n % 8) json_buf_str(h, " "); /* the data starts 8-aligned, as the reference pads */
  return h->oom ? kiln_set_error("checkpoint_save: out of memory") : 0;
}

/* The whole file: header length, header, the items' data. */
typedef struct {
  const json_buf *h;
  const save_item *items;
  int n;
} save_file;

static int write_file(int fd, void *ctx) {
  const save_file *f = ctx;
  uint8_t len8[8];
  for (int k = 0; k < 8; k++) len8[k] = (uint8_t)((uint64_t)f->h->n >> (8 * k));
  if (files_write_all(fd, len8, 8) || files_write_all(fd, f->h->s, f->h->n)) return -1;
  for (int i = 0; i < f->n; i++)
    if (write_tensor(fd, f->items[i].value)) return -1;
  return 0;
}

static int save(const char *path, int n, kiln_variable *const *vars, save_item *items) {
  const char *who = "checkpoint_save";
  char nb[128];
  for (int i = 0; i < n; i++) {
    const char *name = kiln_variable_name(vars[i]);
    size_t bad;
    if (!json_utf8_valid((const uint8_t *)name, strlen(name), &bad))
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

  json_buf h = {0};
  if (build_header(items, n, &h)) {
    free(h.s);
    return -1;
  }
  const char *kind = files_not_regular(path);
  if (kind) {
    free(h.s);
    return kiln_set_error("%s: %s is not a regular file (%s); a save replaces only a regular file", who,
                          path, kind);
  }
  save_file file = {&h, items, n};
  const char *stage;
  int rc = files_replace(path, 0666, write_file, &file, &stage);
  int e = errno;
  free(h.s);
  if (rc && !strcmp(stage, "create"))
    return kiln_set_error("%s: %s: cannot create a file there: %s", who, path, errno_str(e));
  if (rc) return kiln_set_error("%s: %s: cannot write: %s", who, path, errno_str(e));
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
