/* shuffle.c — kiln_dataset_shuffle, tf.data's algorithm: a buffer filled
 * from upstream up to buffer_size elements; each element given is one of the
 * buffer's drawn uniformly, its slot refilled. A buffer as large as the data
 * makes every permutation equally likely.
 *
 * Draws come from Philox-4x32-10 keyed by the seed, counter (epoch << 40) +
 * block: the same seed gives the same orders, and each reset (a repeat
 * downstream starting an epoch) draws from a stream of its own, as tf.data's
 * reshuffle_each_iteration. */
#include <stdlib.h>

#include "dataset.h"

typedef struct {
  kiln_dataset base;
  int64_t size;  /* buffer_size */
  ds_part *buf;  /* len elements of arity parts, room for cap */
  int64_t len, cap;
  bool up_done;
  uint64_t seed, epoch, block;
  uint32_t words[4];
  int used; /* words of the current block already drawn */
} shuffle;

static uint32_t draw32(shuffle *s) {
  if (s->used == 4) {
    philox4x32(s->seed, (s->epoch << 40) + s->block++, s->words);
    s->used = 0;
  }
  return s->words[s->used++];
}

/* uniform in [0, n) without bias (Lemire's multiply and reject); n < 2^32
 * here, else two words */
static int64_t draw_below(shuffle *s, int64_t n) {
  if (n <= (int64_t)UINT32_MAX) {
    uint32_t k = (uint32_t)n;
    uint64_t m = (uint64_t)draw32(s) * k;
    if ((uint32_t)m < k) {
      uint32_t floor = -k % k;
      while ((uint32_t)m < floor) m = (uint64_t)draw32(s) * k;
    }
    return (int64_t)(m >> 32);
  }
  uint64_t limit = UINT64_MAX - UINT64_MAX % (uint64_t)n, x;
  do x = (uint64_t)draw32(s) << 32 | draw32(s);
  while (x >= limit);
  return (int64_t)(x % (uint64_t)n);
}

/* room for one more element; false when memory ran out */
static bool grow(shuffle *s) {
  if (s->len < s->cap) return true;
  int64_t cap = s->cap ? 2 * s->cap : 64;
  if (cap > s->size) cap = s->size;
  ds_part *buf = realloc(s->buf, (size_t)(cap * s->base.arity) * sizeof *buf);
  if (!buf) return false;
  s->buf = buf;
  s->cap = cap;
  return true;
}

static int shuffle_next(kiln_dataset *ds, ds_part *out) {
  shuffle *s = (shuffle *)ds;
  int a = ds->arity;
  while (!s->up_done && s->len < s->size) {
    if (!grow(s)) {
      if (s->len) break; /* go on with the buffer as it is */
      return kiln_set_error("kiln_dataset_next: shuffle: out of memory for its buffer");
    }
    int rc = ds_next(ds->up, s->buf + s->len * a);
    if (rc < 0) return -1;
    if (rc == 0) s->up_done = true;
    else s->len++;
  }
  if (!s->len) return 0;
  int64_t i = draw_below(s, s->len);
  memcpy(out, s->buf + i * a, (size_t)a * sizeof *out);
  s->len--;
  if (i != s->len) memcpy(s->buf + i * a, s->buf + s->len * a, (size_t)a * sizeof *out);
  return 1;
}

static void shuffle_drop(shuffle *s) {
  parts_release((int)(s->len * s->base.arity), s->buf);
  s->len = 0;
}

static void shuffle_reset(kiln_dataset *ds) {
  shuffle *s = (shuffle *)ds;
  shuffle_drop(s);
  s->up_done = false;
  s->epoch++;
  s->block = 0;
  s->used = 4;
  ds->up->ops->reset(ds->up);
}

static void shuffle_release(kiln_dataset *ds) {
  shuffle *s = (shuffle *)ds;
  shuffle_drop(s);
  free(s->buf);
}

static const ds_ops shuffle_ops = {shuffle_next, shuffle_reset, shuffle_release};

kiln_dataset *kiln_dataset_shuffle(kiln_dataset *up, int64_t buffer_size, uint64_t seed) {
  const char *who = "kiln_dataset_shuffle";
  if (!ds_input_ok(who, up)) return NULL;
  if (buffer_size <= 0) {
    kiln_set_error("%s: buffer_size = %lld; at least 1", who, (long long)buffer_size);
    return NULL;
  }
  if (buffer_size > INT64_MAX / 16 / up->arity) buffer_size = INT64_MAX / 16 / up->arity; /* "all": grows as filled */
  shuffle *s = (shuffle *)ds_new(who, &shuffle_ops, sizeof(shuffle), up, up->arity);
  if (!s) return NULL;
  s->size = buffer_size;
  s->seed = seed;
  s->used = 4;
  return ds_adopt(&s->base);
}
