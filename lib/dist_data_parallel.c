/* dist_data_parallel.c — data-parallel training's two helpers (Horovod's
 * and DDP's model): averaging gradients across the world, fused into
 * buckets (tensor fusion: many small tensors packed into one buffer, one
 * all-reduce per buffer), and copying root's variables to every rank. */
#include <stdlib.h>

#include "dist.h"
#include "variable.h"

/* KILN_DIST_FUSION_BYTES: a bucket's size on the wire; 64 MiB by default */
static size_t fusion_bytes(void) {
  const char *s = getenv("KILN_DIST_FUSION_BYTES");
  char *end;
  long long v = s ? strtoll(s, &end, 10) : 0;
  return s && end != s && v > 0 ? (size_t)v : (size_t)64 << 20;
}

/* FNV-1a over what must match across ranks */
static uint64_t digest_add(uint64_t h, int64_t v) {
  for (int i = 0; i < 8; i++) h = (h ^ (uint8_t)(v >> (8 * i))) * 1099511628211u;
  return h;
}

static uint64_t digest_tensor(uint64_t h, const kiln_tensor *t) {
  h = digest_add(h, t ? t->dtype : -1);
  h = digest_add(h, t ? t->rank : -1);
  for (int i = 0; t && i < t->rank; i++) h = digest_add(h, t->shape[i]);
  return h;
}

static int check_grads(const char *who, int n, kiln_tensor *const *grads) {
  if (n < 0 || (n > 0 && !grads)) return kiln_set_error("%s: %d gradients with grads %s", who, n, grads ? "" : "NULL");
  for (int i = 0; i < n; i++) {
    kiln_tensor *g = grads[i];
    if (!g) continue; /* a source the loss does not reach: stays NULL */
    if (g->flags & TF_SYMBOLIC)
      return kiln_set_error("%s: grads[%d] is symbolic; the collectives run eagerly only", who, i);
    if (dist_wire_dtype((kiln_dtype)g->dtype, DIST_MEAN) != KILN_F32 && g->dtype != KILN_F64)
      return kiln_set_error("%s: grads[%d] is %s, not a float tensor", who, i, kiln_dtype_name((kiln_dtype)g->dtype));
  }
  return 0;
}

/* Averages grads[first .. last) whose wire dtype is wire through buf;
 * out[i] gets the new tensors. */
static int average_bucket(const char *who, kiln_tensor *const *grads, kiln_tensor **out, int first, int last,
                          kiln_dtype wire, char *buf) {
  size_t ws = kiln_dtype_sizes[wire], at = 0;
  int64_t count = 0;
  for (int i = first; i < last; i++) {
    kiln_tensor *g = grads[i];
    if (!g || dist_wire_dtype((kiln_dtype)g->dtype, DIST_MEAN) != wire) continue;
    kiln_tensor *host = dist_host(who, g);
    if (!host) return -1;
    dist_convert((kiln_dtype)g->dtype, host->data, wire, buf + at, g->size);
    kiln_release(host);
    at += (size_t)g->size * ws;
    count += g->size;
  }
  if (dist_allreduce(who, buf, buf, count, wire, DIST_SUM)) return -1;
  dist_divide(wire, buf, count, dist_world_size());
  at = 0;
  for (int i = first; i < last; i++) {
    kiln_tensor *g = grads[i];
    if (!g || dist_wire_dtype((kiln_dtype)g->dtype, DIST_MEAN) != wire) continue;
    kiln_tensor *avg = tensor_alloc(who, (kiln_dtype)g->dtype, g->rank, g->shape);
    if (!avg) return -1;
    dist_convert(wire, buf + at, (kiln_dtype)g->dtype, avg->data, g->size);
    at += (size_t)g->size * ws;
    if (g->device != 0) {
      kiln_tensor *there = tensor_to_device(who, avg, g->device);
      kiln_release(avg);
      if (!(avg = there)) return -1;
    }
    out[i] = avg;
  }
  return 0;
}

/* Buckets in grads' order, one wire dtype at a time: consecutive tensors
 * of that dtype while they fit in the fusion buffer (a larger one alone). */
static int average(const char *who, int n, kiln_tensor *const *grads, kiln_tensor **out) {
  size_t limit = fusion_bytes(), biggest = 0, total = 0;
  for (int i = 0; i < n; i++) {
    size_t bytes = grads[i] ? (size_t)grads[i]->size * 8 : 0; /* at most 8 bytes an element on the wire */
    total += bytes;
    if (bytes > biggest) biggest = bytes;
  }
  size_t cap = limit > biggest ? limit : biggest;
  char *buf = malloc((total < cap ? total : cap) + 64);
  if (!buf) return kiln_set_error("%s: out of memory", who);
  int rc = 0;
  const kiln_dtype wires[2] = {KILN_F32, KILN_F64};
  for (int w = 0; w < 2 && !rc; w++) {
    size_t ws = kiln_dtype_sizes[wires[w]], used = 0;
    int first = 0;
    for (int i = 0; i <= n && !rc; i++) {
      kiln_tensor *g = i < n ? grads[i] : NULL;
      bool mine = g && dist_wire_dtype((kiln_dtype)g->dtype, DIST_MEAN) == wires[w];
      size_t bytes = mine ? (size_t)g->size * ws : 0;
      if (i == n || (mine && used > 0 && used + bytes > limit)) {
        if (used > 0) rc = average_bucket(who, grads, out, first, i, wires[w], buf);
        first = i;
        used = 0;
      }
      used += bytes;
    }
  }
  free(buf);
  return rc;
}

int kiln_dist_average_gradients(int n, kiln_tensor **grads) {
  const char *who = "dist_average_gradients";
  if (dist_join(who)) return -1;
  bool ok = check_grads(who, n, grads) == 0;
  dist_header h = {.kind = DIST_AVERAGE_GRADIENTS, .op = DIST_MEAN, .dtype = -1, .arg = ok ? n : -1};
  uint64_t digest = 14695981039346656037u;
  for (int i = 0; ok && i < n; i++) digest = digest_tensor(digest, grads[i]);
  h.digest = digest;
  kiln_tensor **out = ok && n > 0 ? calloc((size_t)n, sizeof *out) : NULL;
  if (ok && n > 0 && !out) ok = kiln_set_error("%s: out of memory", who) == 0;
  dist_lock();
  int rc = dist_agree(who, &h, ok);
  /* one process: each gradient is already its own average */
  if (!rc && dist_world_size() > 1) rc = average(who, n, grads, out);
  dist_unlock();
  if (!rc && dist_world_size() > 1) {
    /* the old tensors: the caller's (released here) with no scope open,
     * else their scopes' */
    bool release = !scope_is_open();
    for (int i = 0; i < n; i++) {
      if (!grads[i]) continue;
      if (release) kiln_release(grads[i]);
      grads[i] = scope_own(out[i]);
    }
  } else if (out) {
    for (int i = 0; i < n; i++) kiln_release(out[i]);
  }
  free(out);
  return rc;
}

int kiln_dist_sync_variables(int n, kiln_variable *const *vars, int root) {
  const char *who = "dist_sync_variables";
  if (dist_join(who)) return -1;
  int size = dist_world_size();
  bool ok = true;
  if (n < 0 || (n > 0 && !vars)) {
    ok = kiln_set_error("%s: %d variables with vars %s", who, n, vars ? "" : "NULL") == 0;
  } else if (root < 0 || root >= size) {
    ok = kiln_set_error("%s: root %d is not a rank of this world of %d process%s", who, root, size,
                        size == 1 ? "" : "es") == 0;
  }
  for (int i = 0; ok && i < n; i++)
    if (!vars[i]) ok = kiln_set_error("%s: vars[%d] is NULL", who, i) == 0;
  dist_header h = {.kind = DIST_SYNC_VARIABLES, .op = -1, .dtype = -1, .arg = root};
  uint64_t digest = 14695981039346656037u;
  for (int i = 0; ok && i < n; i++) digest = digest_tensor(digest, variable_type(vars[i]));
  h.digest = digest_add(digest, ok ? n : -1);
  dist_lock();
  int rc = dist_agree(who, &h, ok);
  for (int i = 0; !rc && size > 1 && i < n; i++) {
    kiln_tensor *value = variable_acquire(vars[i]), *host = dist_host(who, value), *copy = NULL;
    if (!host || !(copy = tensor_alloc(who, (kiln_dtype)host->dtype, host->rank, host->shape))) {
      rc = -1;
    } else {
      if (tensor_bytes(host)) memcpy(copy->data, host->data, tensor_bytes(host));
      rc = dist_broadcast(who, copy->data, tensor_bytes(copy), root);
    }
    if (!rc && dist_world_rank() != root) {
      kiln_tensor *there = value->device ? tensor_to_device(who, copy, value->device) : kiln_retain(copy);
      rc = there ? kiln_variable_assign(vars[i], there) : -1;
      kiln_release(there);
    }
    kiln_release(copy);
    kiln_release(host);
    kiln_release(value);
  }
  dist_unlock();
  return rc;
}
