/* summary.c — TensorBoard event files: TFRecord records (a little-endian
 * 64-bit length, its masked CRC-32C, the data, the data's masked CRC-32C),
 * each an Event protobuf (tensorflow/core/util/event.proto) encoded by hand:
 * first the file version, then Summary values, scalars as simple_value and
 * histograms as HistogramProto with TensorFlow's default bucket edges. */
#include <errno.h>
#include <fcntl.h>
#include <float.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

#include "crc32c.h"
#include "files.h"
#include "json.h"
#include "runtime.h"

struct kiln_summary_writer {
  pthread_mutex_t mu; /* one record at a time, from any thread */
  FILE *f;
  char *path;
  int n_limits;
  double *limits; /* the histogram bucket edges */
};

/* ---- a protobuf encoder: just the wire types an Event uses ---- */

enum { WIRE_VARINT = 0, WIRE_FIXED64 = 1, WIRE_BYTES = 2, WIRE_FIXED32 = 5 };

static void pb_varint(json_buf *b, uint64_t v) {
  char tmp[10];
  size_t n = 0;
  do {
    tmp[n++] = (char)((v & 0x7f) | (v > 0x7f ? 0x80 : 0));
    v >>= 7;
  } while (v);
  json_buf_put(b, tmp, n);
}

static void pb_key(json_buf *b, int field, int wire) { pb_varint(b, (uint64_t)field << 3 | (uint64_t)wire); }

static void put_le(json_buf *b, uint64_t v, int bytes) {
  char tmp[8];
  for (int k = 0; k < bytes; k++) tmp[k] = (char)(v >> (8 * k));
  json_buf_put(b, tmp, (size_t)bytes);
}

static uint64_t f64_bits(double d) {
  uint64_t u;
  memcpy(&u, &d, 8);
  return u;
}

/* Fields holding their type's default (0, +0.0) are left out, as
 * protobuf's own encoder does for proto3 (outside a oneof): the bytes are
 * then those protobuf would write. */
static void pb_double(json_buf *b, int field, double v) {
  if (!f64_bits(v)) return;
  pb_key(b, field, WIRE_FIXED64);
  put_le(b, f64_bits(v), 8);
}

static void pb_bytes(json_buf *b, int field, const void *p, size_t n) {
  pb_key(b, field, WIRE_BYTES);
  pb_varint(b, n);
  json_buf_put(b, p, n);
}

/* a nested message, taken over (freed) */
static void pb_message(json_buf *b, int field, json_buf *m) {
  if (m->oom) b->oom = true;
  pb_bytes(b, field, m->s, m->n);
  free(m->s);
  *m = (json_buf){0};
}

/* a packed repeated double */
static void pb_doubles(json_buf *b, int field, const double *v, int n) {
  json_buf p = {0};
  for (int i = 0; i < n; i++) put_le(&p, f64_bits(v[i]), 8);
  pb_message(b, field, &p);
}

/* ---- records ---- */

static double wall_time(void) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Event{wall_time, step, summary{value}}; value is taken over. */
static void event_with_value(json_buf *ev, int64_t step, json_buf *value) {
  json_buf summary = {0};
  pb_double(ev, 1, wall_time());
  if (step) {
    pb_key(ev, 2, WIRE_VARINT);
    pb_varint(ev, (uint64_t)step); /* a negative int64 takes ten bytes, as protobuf writes it */
  }
  pb_message(&summary, 1, value);
  pb_message(ev, 5, &summary);
}

/* Frames ev as a TFRecord and writes it (under w->mu). 0 / -1. */
static int write_record(kiln_summary_writer *w, const char *who, json_buf *ev) {
  if (ev->oom) return kiln_set_error("%s: out of memory", who);
  uint8_t head[12];
  for (int k = 0; k < 8; k++) head[k] = (uint8_t)((uint64_t)ev->n >> (8 * k));
  uint32_t c = crc32c_masked(head, 8);
  for (int k = 0; k < 4; k++) head[8 + k] = (uint8_t)(c >> (8 * k));
  uint8_t tail[4];
  c = crc32c_masked(ev->s, ev->n);
  for (int k = 0; k < 4; k++) tail[k] = (uint8_t)(c >> (8 * k));
  pthread_mutex_lock(&w->mu);
  bool ok = fwrite(head, 1, 12, w->f) == 12 && fwrite(ev->s, 1, ev->n, w->f) == ev->n &&
            fwrite(tail, 1, 4, w->f) == 4;
  int e = errno;
  pthread_mutex_unlock(&w->mu);
  if (!ok) return kiln_set_error("%s: %s: cannot write: %s", who, w->path, strerror(e));
  return 0;
}

static int check_tag(const char *who, kiln_summary_writer *w, const char *tag) {
  if (!w) return kiln_set_error("%s: writer is NULL", who);
  if (!tag) return kiln_set_error("%s: tag is NULL", who);
  size_t bad;
  if (!*tag) return kiln_set_error("%s: tag is empty", who);
  if (!json_utf8_valid((const uint8_t *)tag, strlen(tag), &bad))
    return kiln_set_error("%s: tag is not UTF-8 (byte %zu)", who, bad);
  return 0;
}

int kiln_summary_scalar(kiln_summary_writer *w, const char *tag, double value, int64_t step) {
  const char *who = "summary_scalar";
  if (check_tag(who, w, tag)) return -1;
  json_buf v = {0}, ev = {0};
  pb_bytes(&v, 1, tag, strlen(tag));
  pb_key(&v, 2, WIRE_FIXED32); /* simple_value is a float */
  float f = isfinite(value) && fabs(value) > FLT_MAX ? (float)copysign(INFINITY, value) : (float)value;
  put_le(&v, f32_bits(f), 4);
  event_with_value(&ev, step, &v);
  int rc = write_record(w, who, &ev);
  free(ev.s);
  return rc;
}

/* TensorFlow's default edges (tsl/lib/histogram): 0, then +-1e-12 growing
 * by 10% up to 1e20, then +-DBL_MAX; bucket i holds [edge[i-1], edge[i]). */
static double *default_limits(int *n) {
  int half = 0;
  for (double v = 1e-12; v < 1e20; v *= 1.1) half++;
  double *l = malloc(sizeof *l * (size_t)(2 * half + 3));
  if (!l) return NULL;
  int k = half + 1;
  l[k] = 0.0;
  double v = 1e-12;
  for (int i = 1; i <= half; i++, v *= 1.1) {
    l[k + i] = v;
    l[k - i] = -v;
  }
  l[0] = -DBL_MAX;
  l[2 * half + 2] = DBL_MAX;
  *n = 2 * half + 3;
  return l;
}

/* The first edge above v (std::upper_bound); DBL_MAX itself goes last. */
static int bucket_of(const double *l, int n, double v) {
  int lo = 0, hi = n;
  while (lo < hi) {
    int mid = (lo + hi) / 2;
    if (l[mid] > v)
      hi = mid;
    else
      lo = mid + 1;
  }
  return lo < n ? lo : n - 1;
}

/* HistogramProto of x's values (on the host), runs of empty buckets merged
 * into one as TensorFlow's EncodeToProto does. */
static int histogram(kiln_summary_writer *w, const char *who, const kiln_tensor *x, json_buf *h) {
  double *count = calloc((size_t)w->n_limits, sizeof *count);
  double *lim = malloc(sizeof *lim * (size_t)w->n_limits), *cnt = malloc(sizeof *cnt * (size_t)w->n_limits);
  if (!count || !lim || !cnt) {
    free(count), free(lim), free(cnt);
    return kiln_set_error("%s: out of memory", who);
  }
  double lo = DBL_MAX, hi = -DBL_MAX, sum = 0, sum_sq = 0;
  for (int64_t i = 0; i < x->size; i++) {
    double v = dtype_load((kiln_dtype)x->dtype, x->data, i);
    if (!isfinite(v)) {
      free(count), free(lim), free(cnt);
      return kiln_set_error("%s: values[%lld] is %g; a histogram takes finite values", who, (long long)i, v);
    }
    count[bucket_of(w->limits, w->n_limits, v)] += 1;
    lo = v < lo ? v : lo;
    hi = v > hi ? v : hi;
    sum += v;
    sum_sq += v * v;
  }
  int m = 0;
  for (int i = 0; i < w->n_limits;) {
    double end = w->limits[i], c = count[i++];
    if (c <= 0)
      while (i < w->n_limits && count[i] <= 0) end = w->limits[i++];
    lim[m] = end;
    cnt[m++] = c;
  }
  pb_double(h, 1, lo);
  pb_double(h, 2, hi);
  pb_double(h, 3, (double)x->size);
  pb_double(h, 4, sum);
  pb_double(h, 5, sum_sq);
  pb_doubles(h, 6, lim, m);
  pb_doubles(h, 7, cnt, m);
  free(count), free(lim), free(cnt);
  return 0;
}

int kiln_summary_histogram(kiln_summary_writer *w, const char *tag, kiln_tensor *values, int64_t step) {
  const char *who = "summary_histogram";
  if (check_tag(who, w, tag)) return -1;
  if (!values) return kiln_has_error() ? -1 : kiln_set_error("%s: values is NULL", who);
  kiln_tensor *copy;
  const kiln_tensor *x = tensor_on_host(who, values, &copy);
  if (!x) return -1;
  json_buf h = {0}, v = {0}, ev = {0};
  int rc = histogram(w, who, x, &h);
  kiln_release(copy);
  if (!rc) {
    pb_bytes(&v, 1, tag, strlen(tag));
    pb_message(&v, 5, &h);
    event_with_value(&ev, step, &v);
    rc = write_record(w, who, &ev);
  }
  free(h.s), free(v.s), free(ev.s);
  return rc;
}

int kiln_summary_flush(kiln_summary_writer *w) {
  if (!w) return kiln_set_error("summary_flush: writer is NULL");
  pthread_mutex_lock(&w->mu);
  int rc = fflush(w->f);
  int e = errno;
  pthread_mutex_unlock(&w->mu);
  return rc ? kiln_set_error("summary_flush: %s: cannot write: %s", w->path, strerror(e)) : 0;
}

void kiln_summary_writer_free(kiln_summary_writer *w) {
  if (!w) return;
  if (w->f && fclose(w->f)) kiln_set_error("summary_writer_free: %s: cannot write: %s", w->path, strerror(errno));
  pthread_mutex_destroy(&w->mu);
  free(w->limits);
  free(w->path);
  free(w);
}

/* ---- the file ---- */

/* logdir/events.out.tfevents.<seconds>.<host>, created new (never through a
 * link); ".<pid>.<k>" is added when another writer took that name this
 * second. The descriptor, its name in *path; -1 with errno set. */
static int create_event_file(const char *logdir, char **path) {
  char host[256] = "localhost";
  if (gethostname(host, sizeof host - 1) || !host[0]) snprintf(host, sizeof host, "localhost");
  host[sizeof host - 1] = '\0';
  for (char *c = host; *c; c++)
    if (*c == '/') *c = '_';
  long long now = (long long)time(NULL);
  for (int k = 0; k < 100; k++) {
    char name[400];
    if (k == 0)
      snprintf(name, sizeof name, "events.out.tfevents.%010lld.%s", now, host);
    else
      snprintf(name, sizeof name, "events.out.tfevents.%010lld.%s.%ld.%d", now, host, (long)getpid(), k);
    *path = files_join(logdir, name);
    if (!*path) {
      errno = ENOMEM;
      return -1;
    }
    int fd = open(*path, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0666);
    if (fd >= 0 || errno != EEXIST) return fd;
    free(*path);
    *path = NULL;
  }
  errno = EEXIST;
  return -1;
}

kiln_summary_writer *kiln_summary_writer_new(const char *logdir) {
  const char *who = "summary_writer_new";
  if (!logdir || !*logdir) {
    kiln_set_error("%s: logdir is %s", who, logdir ? "empty" : "NULL");
    return NULL;
  }
  if (files_mkdirs(logdir, 0777)) {
    kiln_set_error("%s: %s: cannot create the directory: %s", who, logdir, strerror(errno));
    return NULL;
  }
  kiln_summary_writer *w = calloc(1, sizeof *w);
  if (!w || !(w->limits = default_limits(&w->n_limits))) {
    free(w);
    kiln_set_error("%s: out of memory", who);
    return NULL;
  }
  pthread_mutex_init(&w->mu, NULL);
  int fd = create_event_file(logdir, &w->path);
  if (fd < 0) {
    kiln_set_error("%s: %s: cannot create an event file there: %s", who, logdir, strerror(errno));
    kiln_summary_writer_free(w);
    return NULL;
  }
  w->f = fdopen(fd, "wb");
  if (!w->f) {
    kiln_set_error("%s: %s: cannot open: %s", who, w->path, strerror(errno));
    close(fd);
    unlink(w->path);
    kiln_summary_writer_free(w);
    return NULL;
  }
  /* the first record names the format; TensorBoard reads nothing else in it */
  json_buf ev = {0};
  pb_double(&ev, 1, wall_time());
  pb_bytes(&ev, 3, "brain.Event:2", 13);
  int rc = write_record(w, who, &ev);
  free(ev.s);
  if (rc || fflush(w->f)) {
    if (!rc) kiln_set_error("%s: %s: cannot write: %s", who, w->path, strerror(errno));
    fclose(w->f);
    w->f = NULL;
    unlink(w->path);
    kiln_summary_writer_free(w);
    return NULL;
  }
  return w;
}
