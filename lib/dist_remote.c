/* dist_remote.c — remote devices (API.md §12, the TF Eager paper's §4.5).
 * A rank >= 1 that calls kiln_dist_serve announces its devices to rank 0
 * and then runs rank 0's requests: one primitive op at a time (its name,
 * its attributes, its inputs as handles or as host data), with its own
 * eager dispatcher, keeping each result under a handle. On rank 0 the
 * worker's devices are task:K/cpu:0 (and task:K/gpu:G); a tensor there is
 * a header whose data_block is its handle, never dereferenced: reading it,
 * printing it or moving it asks the worker for its bytes, and releasing it
 * queues a free that travels with the next request.
 *
 * A staged call under a remote scope sends the trace's .kir text the first
 * time that worker runs it (keyed by traced_fn.remote_key), then only its
 * arguments; the worker parses, optimizes and compiles its copy. The
 * trace's captured tensors (constants it closed over, the same for every
 * call) travel with the text and stay with the worker's copy: later calls
 * name them instead of sending their bytes again.
 *
 * Every process runs the same Kiln build: op_attrs travels as bytes (its
 * pointers, which only IR-only ops use, cleared), and the announcement
 * carries the op table's size and op_attrs' so a mismatch is refused. */
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "dist.h"
#include "json.h"
#include "ops.h"
#include "../jit/jit.h"

enum { TAG_HELLO = 1, TAG_REQ, TAG_REP };
enum { R_OP = 1, R_PUT, R_GET, R_LIVE, R_STALL, R_STOP, R_CALL };
enum { REP_OK, REP_ERROR, REP_ACK };
enum { HELLO_MAGIC = 0x4b524d31 /* "KRM1" */ };

/* ---- byte buffers ---- */

/* a growing message (json_buf is binary-safe) */
typedef json_buf wbuf;
static void put(wbuf *b, const void *src, size_t n) {
  if (n) json_buf_put(b, src, n);
}
static void put_i64(wbuf *b, int64_t v) { put(b, &v, sizeof v); }
static void put_str(wbuf *b, const char *s) {
  int64_t n = (int64_t)strlen(s);
  put_i64(b, n);
  put(b, s, (size_t)n);
}

typedef struct {
  const char *p;
  size_t n, at;
  bool bad;
} rbuf;

static const void *take(rbuf *b, size_t n) {
  if (b->bad || n > b->n - b->at) {
    b->bad = true;
    return NULL;
  }
  const void *p = b->p + b->at;
  b->at += n;
  return p;
}
static int64_t get_i64(rbuf *b) {
  int64_t v = 0;
  const void *p = take(b, sizeof v);
  if (p) memcpy(&v, p, sizeof v);
  return v;
}
/* a string of the message, copied into buf (NUL-terminated, cut to fit) */
static void get_str(rbuf *b, char *buf, size_t cap) {
  int64_t n = get_i64(b);
  const char *s = n >= 0 ? take(b, (size_t)n) : NULL;
  if (!s) {
    b->bad = true;
    buf[0] = '\0';
    return;
  }
  size_t k = (size_t)n < cap - 1 ? (size_t)n : cap - 1;
  memcpy(buf, s, k);
  buf[k] = '\0';
}

/* A tensor's type on the wire: dtype, rank, shape. */
static void put_type(wbuf *b, const kiln_tensor *t) {
  put_i64(b, t->dtype);
  put_i64(b, t->rank);
  for (int i = 0; i < t->rank; i++) put_i64(b, t->shape[i]);
}
static int get_type(rbuf *b, op_type *ty) {
  int64_t dt = get_i64(b), rank = get_i64(b);
  if (b->bad || !dtype_valid((int)dt) || rank < 0 || rank > KILN_MAX_RANK) return b->bad = true, -1;
  ty->dtype = (kiln_dtype)dt;
  ty->rank = (int)rank;
  for (int i = 0; i < ty->rank; i++) ty->shape[i] = get_i64(b);
  return b->bad ? -1 : 0;
}

/* A host tensor's type and bytes. */
static void put_host(wbuf *b, const kiln_tensor *h) {
  put_type(b, h);
  put(b, h->data, tensor_bytes(h));
}
/* A host tensor from the message, owned by the caller; NULL + error. */
static kiln_tensor *get_host(const char *who, rbuf *b) {
  op_type ty;
  if (get_type(b, &ty)) {
    kiln_set_error("%s: a malformed tensor in the message", who);
    return NULL;
  }
  kiln_tensor *t = tensor_alloc(who, ty.dtype, ty.rank, ty.shape);
  if (!t) return NULL;
  const void *data = take(b, tensor_bytes(t));
  if (!data) {
    kiln_release(t);
    kiln_set_error("%s: a malformed tensor in the message", who);
    return NULL;
  }
  if (tensor_bytes(t)) memcpy(t->data, data, tensor_bytes(t));
  return t;
}

/* ==== the worker ==== */

static struct {
  kiln_tensor **t; /* by handle; slot 0 unused */
  size_t n, cap;
  int64_t live;
  bool stopped; /* kiln_dist_serve ended on rank 0's word: finalize has nothing to hear */
} held;

static uint64_t hold(kiln_tensor *t) {
  if (held.n + 1 >= held.cap) {
    size_t cap = held.cap ? 2 * held.cap : 1024;
    kiln_tensor **p = realloc(held.t, cap * sizeof *p);
    if (!p) return 0;
    memset(p + held.cap, 0, (cap - held.cap) * sizeof *p);
    held.t = p;
    held.cap = cap;
  }
  if (held.n == 0) held.n = 1;
  held.t[held.n] = t;
  held.live++;
  return held.n++;
}

static kiln_tensor *held_get(uint64_t h) { return h > 0 && h < held.n ? held.t[h] : NULL; }

static void held_free(uint64_t h) {
  if (!held_get(h)) return;
  kiln_release(held.t[h]);
  held.t[h] = NULL;
  held.live--;
}

static void held_clear(void) {
  for (size_t h = 1; h < held.n; h++) held_free(h);
  free(held.t);
  held.t = NULL;
  held.n = held.cap = 0;
}

/* How an argument travels (put_arg, remote_call; get_args): */
enum { ARG_HANDLE, ARG_HOST, ARG_KEEP /* host data the program keeps */, ARG_KEPT /* what it kept */ };

/* The staged functions rank 0 has sent, by key; kept[i]: the value of
 * parameter i when it is one of the trace's captured tensors (or NULL). */
typedef struct {
  uint64_t key;
  traced_fn fn;
  kiln_tensor **kept;
} program;
static struct {
  program *p;
  size_t n, cap;
} programs;

static void program_free(program *p) {
  for (int i = 0; p->kept && i < p->fn.func->n_params; i++) kiln_release(p->kept[i]);
  free(p->kept);
  traced_fn_free(&p->fn);
}

static void programs_clear(void) {
  for (size_t i = 0; i < programs.n; i++) program_free(&programs.p[i]);
  free(programs.p);
  memset(&programs, 0, sizeof programs);
}

/* The worker's device `dev` (0 = cpu:0, g + 1 = gpu:g) as a scope name. */
static int push_local(const char *who, int64_t dev) {
  const char *name = dev >= 0 && dev < kiln_device_count() ? kiln_device_name((int)dev) : NULL;
  if (!name) return kiln_set_error("%s: this worker has no device %lld", who, (long long)dev);
  return kiln_device_push(name);
}

static op_id op_named(const char *name) {
  for (int i = 0; i < OP_COUNT; i++)
    if (!strcmp(kiln_ops[i].name, name)) return (op_id)i;
  return OP_COUNT;
}

static int get_args(const char *who, rbuf *in, int64_t n, kiln_tensor **args, bool *own, program *p);

/* R_OP: device, op name, attrs, inputs -> handle and type */
static int serve_op(rbuf *in, wbuf *out) {
  int64_t dev = get_i64(in);
  char name[64];
  get_str(in, name, sizeof name);
  op_id op = op_named(name);
  if (op == OP_COUNT) return kiln_set_error("dist_serve: unknown op '%s'", name);
  op_attrs attrs;
  int64_t asize = get_i64(in);
  const void *a = take(in, sizeof attrs);
  if (asize != (int64_t)sizeof attrs || !a) return kiln_set_error("%s: malformed attributes", kiln_ops[op].api);
  memcpy(&attrs, a, sizeof attrs);
  int64_t n = get_i64(in);
  if (in->bad || n < 0 || n > 1 << 20) return kiln_set_error("%s: malformed inputs", kiln_ops[op].api);
  kiln_tensor **args = calloc((size_t)n + 1, sizeof *args);
  bool *own = calloc((size_t)n + 1, sizeof *own);
  int rc = args && own ? get_args(kiln_ops[op].api, in, n, args, own, NULL)
                       : kiln_set_error("%s: out of memory", kiln_ops[op].api);
  kiln_tensor *r = NULL;
  if (!rc && !(rc = push_local(kiln_ops[op].api, dev))) {
    r = op_apply(op, &attrs, (int)n, args);
    kiln_device_pop();
    if (!r) rc = -1;
  }
  for (int64_t i = 0; args && i < n; i++)
    if (own[i]) kiln_release(args[i]);
  free(args);
  free(own);
  if (rc) return -1;
  uint64_t h = hold(r);
  if (!h) {
    kiln_release(r);
    return kiln_set_error("%s: out of memory", kiln_ops[op].api);
  }
  put_i64(out, (int64_t)h);
  put_type(out, r);
  return 0;
}

/* R_PUT: device, host tensor -> handle */
static int serve_put(rbuf *in, wbuf *out) {
  int64_t dev = get_i64(in);
  kiln_tensor *t = get_host("to_device", in), *there = t;
  if (!t) return -1;
  if (dev != 0) {
    if (push_local("to_device", dev)) {
      kiln_release(t);
      return -1;
    }
    kiln_device_pop();
    there = tensor_to_device("to_device", t, (int)dev);
    kiln_release(t);
    if (!there) return -1;
  }
  uint64_t h = hold(there);
  if (!h) {
    kiln_release(there);
    return kiln_set_error("to_device: out of memory");
  }
  put_i64(out, (int64_t)h);
  return 0;
}

/* R_GET: handle -> its bytes */
static int serve_get(rbuf *in, wbuf *out) {
  kiln_tensor *t = held_get((uint64_t)get_i64(in));
  if (!t) return kiln_set_error("tensor_read: not a tensor this worker holds");
  size_t bytes = tensor_bytes(t);
  char *tmp = malloc(bytes + 1);
  if (!tmp) return kiln_set_error("tensor_read: out of memory");
  int rc = kiln_tensor_read(t, tmp, bytes);
  if (!rc) put(out, tmp, bytes);
  free(tmp);
  return rc;
}

/* Reads n arguments, handles or host data, into args (own[i]: a host copy
 * to release); a staged call's (p non-NULL) may be kept by or taken from
 * its program. 0 / -1. */
static int get_args(const char *who, rbuf *in, int64_t n, kiln_tensor **args, bool *own, program *p) {
  for (int64_t i = 0; i < n; i++) {
    int64_t how = get_i64(in);
    if (how == ARG_HOST || (how == ARG_KEEP && p)) {
      if (!(args[i] = get_host(who, in))) return -1;
      own[i] = true;
      if (how == ARG_KEEP) {
        kiln_release(p->kept[i]);
        p->kept[i] = kiln_retain(args[i]);
      }
    } else if (how == ARG_KEPT && p) {
      if (!(args[i] = p->kept[i]))
        return kiln_set_error("%s: @%s: input %lld was never sent to this worker", who, p->fn.func->name,
                              (long long)i);
    } else if (how != ARG_HANDLE || !(args[i] = held_get((uint64_t)get_i64(in)))) {
      return kiln_set_error("%s: input %lld is not a tensor this worker holds", who, (long long)i);
    }
  }
  return 0;
}

/* The program of key: parsed from the text that comes with its first call. */
static program *program_get(rbuf *in, uint64_t key) {
  char name[256];
  int64_t has_text = get_i64(in);
  get_str(in, name, sizeof name);
  int64_t len = get_i64(in);
  const char *text = len >= 0 ? take(in, (size_t)len) : NULL;
  for (size_t i = 0; i < programs.n; i++)
    if (programs.p[i].key == key) return &programs.p[i];
  if (!has_text || !text) {
    kiln_set_error("function_call: @%s: this worker has no program %llu", name, (unsigned long long)key);
    return NULL;
  }
  if (programs.n == programs.cap) {
    size_t cap = programs.cap ? 2 * programs.cap : 16;
    program *p = realloc(programs.p, cap * sizeof *p);
    if (!p) {
      kiln_set_error("function_call: out of memory");
      return NULL;
    }
    programs.p = p;
    programs.cap = cap;
  }
  char *copy = malloc((size_t)len + 1);
  if (!copy) {
    kiln_set_error("function_call: out of memory");
    return NULL;
  }
  memcpy(copy, text, (size_t)len);
  copy[len] = '\0';
  traced_fn fn;
  memset(&fn, 0, sizeof fn);
  fn.module = ir_parse(copy, name);
  free(copy);
  fn.func = fn.module ? ir_module_find(fn.module, name) : NULL;
  kiln_tensor **kept = fn.func ? calloc((size_t)fn.func->n_params + 1, sizeof *kept) : NULL;
  if (!fn.func || !kept || jit_prepare(&fn, name)) {
    if (fn.module && !fn.func) kiln_set_error("function_call: @%s: not in the text sent", name);
    else if (fn.func && !kept) kiln_set_error("function_call: out of memory");
    free(kept);
    traced_fn_free(&fn);
    return NULL;
  }
  programs.p[programs.n] = (program){key, fn, kept};
  return &programs.p[programs.n++];
}

/* R_CALL: key, device, [text], arguments -> each result's handle and type */
static int serve_call(rbuf *in, wbuf *out) {
  uint64_t key = (uint64_t)get_i64(in);
  int64_t dev = get_i64(in);
  program *prog = program_get(in, key);
  if (!prog) return -1;
  traced_fn *fn = &prog->fn;
  const char *name = fn->func->name;
  int64_t n = get_i64(in);
  int np = fn->opt_func->n_params, nr = fn->opt_func->n_results;
  if (in->bad || n != np) return kiln_set_error("function_call: @%s: %lld arguments for %d parameters", name,
                                                (long long)n, np);
  kiln_tensor **args = calloc((size_t)(np + nr) + 1, sizeof *args), **res = args + np;
  bool *own = calloc((size_t)np + 1, sizeof *own);
  int rc =
      args && own ? get_args("function_call", in, n, args, own, prog) : kiln_set_error("function_call: out of memory");
  if (!rc && !(rc = push_local("function_call", dev))) {
    kiln_scope_push(); /* the results, until held */
    rc = jit_exec(fn, args, res);
    for (int k = 0; !rc && k < nr; k++) kiln_retain(res[k]);
    kiln_scope_pop();
    kiln_device_pop();
  }
  for (int k = 0; !rc && k < nr; k++) {
    uint64_t h = hold(res[k]);
    if (!h) {
      for (int j = k; j < nr; j++) kiln_release(res[j]);
      rc = kiln_set_error("function_call: out of memory");
      break;
    }
    put_i64(out, (int64_t)h);
    put_type(out, res[k]);
  }
  for (int i = 0; args && i < np; i++)
    if (own[i]) kiln_release(args[i]);
  free(args);
  free(own);
  return rc;
}

/* One request: [kind][frees][body]; the reply, [status][body or message],
 * into out. Returns the kind (R_STOP ends the loop). */
static int64_t serve_one(const char *msg, size_t bytes, wbuf *out) {
  rbuf in = {msg, bytes, 0, false};
  int64_t kind = get_i64(&in), nfree = get_i64(&in);
  for (int64_t i = 0; !in.bad && i < nfree; i++) held_free((uint64_t)get_i64(&in));
  int64_t status = REP_OK;
  wbuf body = {0};
  int rc = 0;
  kiln_clear_error();
  switch (in.bad ? 0 : kind) {
  case R_OP: rc = serve_op(&in, &body); break;
  case R_PUT: rc = serve_put(&in, &body); break;
  case R_GET: rc = serve_get(&in, &body); break;
  case R_CALL: rc = serve_call(&in, &body); break;
  case R_LIVE: put_i64(&body, held.live), put_i64(&body, (int64_t)programs.n); break;
  case R_STALL: { /* tests only: a worker that hangs (seconds > 0) or dies at once (< 0) */
    double s = 0;
    const void *p = take(&in, sizeof s);
    if (p) memcpy(&s, p, sizeof s);
    if (s < 0) raise(SIGKILL);
    if (s > 0 && s < 3600) nanosleep(&(struct timespec){(time_t)s, (long)((s - floor(s)) * 1e9)}, NULL);
    break;
  }
  case R_STOP: status = REP_ACK, put_i64(&body, 1); break;
  default: rc = kiln_set_error("dist_serve: a malformed request (kind %lld)", (long long)kind);
  }
  if (!rc && (in.bad || body.oom)) rc = kiln_set_error("dist_serve: a malformed request, or out of memory");
  if (rc) {
    put_i64(out, REP_ERROR);
    put_str(out, kiln_has_error() ? kiln_last_error() : "dist_serve: failed");
  } else {
    put_i64(out, status);
    put(out, body.s, body.n);
  }
  free(body.s);
  return kind;
}

int kiln_dist_serve(void) {
  const char *who = "dist_serve";
  if (dist_join(who)) return -1;
  if (dist_world_size() == 1)
    return kiln_set_error("%s: the world has one process: start workers under an MPI launcher "
                          "(mpirun -np 3 ...; rank 0 is the client)", who);
  if (dist_world_rank() == 0) return kiln_set_error("%s: rank 0 is the client; ranks >= 1 serve", who);
  if (held.stopped) return kiln_set_error("%s: this process has served already, and rank 0 ended it", who);
  int64_t hello[4] = {HELLO_MAGIC, OP_COUNT, (int64_t)sizeof(op_attrs), kiln_device_count() - 1};
  if (dist_send(who, 0, TAG_HELLO, hello, sizeof hello)) return -1;
  for (;;) {
    void *msg;
    size_t bytes;
    if (dist_recv(who, 0, TAG_REQ, 0, &msg, &bytes, NULL)) return -1;
    wbuf out = {0};
    int64_t kind = serve_one(msg, bytes, &out);
    free(msg);
    int rc = out.oom ? kiln_set_error("%s: out of memory for a reply", who)
                     : dist_send(who, 0, TAG_REP, out.s, out.n);
    free(out.s);
    if (kind == R_STOP) {
      held_clear();
      programs_clear();
      held.stopped = true;
      return rc;
    }
    if (rc) return -1;
  }
}

/* ==== rank 0: the client ==== */

typedef struct {
  int task;   /* the worker's rank */
  int local;  /* the device's index on the worker */
} remote_dev;

typedef struct {
  bool announced, lost;
  int64_t gpus;
  uint64_t *frees; /* handles released here, not yet freed there */
  size_t n_free, cap_free;
  uint64_t *sent; /* the keys of the staged functions it has */
  size_t n_sent, cap_sent;
} worker;

static struct {
  worker *w;      /* by rank */
  int size;
  remote_dev dev[KILN_MAX_DEVICES]; /* by device index */
  char why[160];  /* why the last task: name was unknown */
} client;

static pthread_mutex_t free_mutex = PTHREAD_MUTEX_INITIALIZER;

static int client_ready(void) {
  int size = dist_world_size();
  if (client.w && client.size == size) return 0;
  worker *w = calloc((size_t)size, sizeof *w);
  if (!w) return kiln_set_error("device: out of memory");
  free(client.w);
  client.w = w;
  client.size = size;
  return 0;
}

/* Takes one announcement; 1 none within wait, 0 one, -1 error (locked). */
static int take_hello(const char *who, double wait) {
  void *msg;
  size_t bytes;
  int from = -1, r = dist_recv(who, -1, TAG_HELLO, wait, &msg, &bytes, &from);
  if (r) return r;
  int64_t h[4] = {0};
  if (bytes == sizeof h) memcpy(h, msg, sizeof h);
  free(msg);
  if (from < 1 || from >= client.size) return 0;
  worker *w = &client.w[from];
  w->announced = true;
  if (h[0] != HELLO_MAGIC || h[1] != OP_COUNT || h[2] != (int64_t)sizeof(op_attrs)) {
    w->lost = true; /* listed, so that using it says why */
    snprintf(client.why, sizeof client.why, "rank %d runs another Kiln build", from);
  }
  w->gpus = h[3] > 0 ? h[3] : 0;
  char name[32];
  snprintf(name, sizeof name, "task:%d/cpu:0", from);
  for (int64_t g = -1; g < w->gpus; g++) {
    if (g >= 0) snprintf(name, sizeof name, "task:%d/gpu:%d", from, (int)g);
    int d = device_add(name);
    if (d < 0) break; /* the table is full: those devices stay unlisted */
    client.dev[d] = (remote_dev){from, (int)g + 1};
  }
  return 0;
}

static bool is_client(void) {
  return dist_world_size() > 1 && dist_world_rank() == 0;
}

void remote_refresh(void) {
  if (!is_client()) return;
  char kept[1024]; /* listing devices leaves the caller's error as it was */
  snprintf(kept, sizeof kept, "%s", kiln_last_error());
  dist_lock();
  if (!client_ready())
    while (take_hello("device_count", -1) == 0) {
    }
  dist_unlock();
  if (kept[0])
    kiln_set_error("%s", kept);
  else
    kiln_clear_error();
}

int remote_find(const char *name) {
  int task = -1, dev = -1, used = 0;
  char kind[4] = "";
  client.why[0] = '\0';
  if (sscanf(name, "task:%d/%3[a-z]:%d%n", &task, kind, &dev, &used) != 3 || name[used] || task < 0 || dev < 0 ||
      (strcmp(kind, "cpu") && strcmp(kind, "gpu")) || (!strcmp(kind, "cpu") && dev != 0)) {
    snprintf(client.why, sizeof client.why, "remote devices are named task:K/cpu:0 or task:K/gpu:G");
    return -1;
  }
  if (!is_client()) {
    snprintf(client.why, sizeof client.why, "%s",
             dist_world_size() > 1 ? "only rank 0 uses remote devices"
                                   : "the world has one process (no MPI launcher, or kiln_dist_init not called)");
    return -1;
  }
  if (task == 0 || task >= dist_world_size()) {
    snprintf(client.why, sizeof client.why, "no task:%d in a world of %d processes", task, dist_world_size());
    return -1;
  }
  dist_lock();
  int rc = client_ready();
  /* a worker that has not announced itself yet: wait for it */
  while (!rc && !client.w[task].announced) {
    int r = take_hello("device_push", dist_timeout());
    if (r) {
      kiln_clear_error();
      snprintf(client.why, sizeof client.why, "rank %d has not called kiln_dist_serve within %g s", task,
               dist_timeout());
      rc = -1;
    }
  }
  dist_unlock();
  if (rc) return -1;
  for (int d = 1; d < KILN_MAX_DEVICES; d++) {
    const char *n = device_is_remote(d) ? kiln_device_name(d) : NULL;
    if (n && !strcmp(n, name)) return d;
  }
  snprintf(client.why, sizeof client.why, "task:%d has %lld GPUs", task, (long long)client.w[task].gpus);
  return -1;
}

const char *remote_why(void) { return client.why; }

void remote_free(int device, void *handle) {
  if (!is_client() || !client.w) return; /* the world is gone, and the worker's tensors with it */
  worker *w = &client.w[client.dev[device].task];
  pthread_mutex_lock(&free_mutex);
  if (w->n_free == w->cap_free) {
    size_t cap = w->cap_free ? 2 * w->cap_free : 64;
    uint64_t *p = realloc(w->frees, cap * sizeof *p);
    if (p) w->frees = p, w->cap_free = cap;
  }
  if (w->n_free < w->cap_free) w->frees[w->n_free++] = (uint64_t)(uintptr_t)handle;
  pthread_mutex_unlock(&free_mutex);
}

/* Sends [kind][frees][body] to task and waits for its reply (locked by the
 * caller). The reply's body in *rep (rep->p malloc'd: free((void *)rep->p)).
 * An error reply becomes the worker's message with where it ran. */
static int request(const char *who, int device, int kind, const wbuf *body, rbuf *rep) {
  int task = client.dev[device].task;
  worker *w = &client.w[task];
  memset(rep, 0, sizeof *rep);
  if (w->lost)
    return kiln_set_error("%s: %s is unusable: an earlier request went unanswered (the worker died or hangs)%s%s",
                          who, kiln_device_name(device), client.why[0] ? "; " : "", client.why);
  wbuf m = {0};
  put_i64(&m, kind);
  pthread_mutex_lock(&free_mutex);
  put_i64(&m, (int64_t)w->n_free);
  put(&m, w->frees, w->n_free * sizeof *w->frees);
  size_t sent_frees = w->n_free;
  pthread_mutex_unlock(&free_mutex);
  if (body) put(&m, body->s, body->n);
  if (m.oom || (body && body->oom)) {
    free(m.s);
    return kiln_set_error("%s: out of memory", who);
  }
  int rc = dist_send(who, task, TAG_REQ, m.s, m.n);
  free(m.s);
  if (!rc && sent_frees) { /* the frees went: later ones stay queued */
    pthread_mutex_lock(&free_mutex);
    memmove(w->frees, w->frees + sent_frees, (w->n_free - sent_frees) * sizeof *w->frees);
    w->n_free -= sent_frees;
    pthread_mutex_unlock(&free_mutex);
  }
  void *msg = NULL;
  size_t bytes = 0;
  int r = rc ? -1 : dist_recv(who, task, TAG_REP, dist_timeout(), &msg, &bytes, NULL);
  if (r) {
    w->lost = true;
    if (r == 1)
      kiln_set_error("%s: %s did not answer within %g s (KILN_DIST_TIMEOUT_S): the worker died or hangs, "
                     "and its devices are unusable from now on",
                     who, kiln_device_name(device), dist_timeout());
    return -1;
  }
  rbuf in = {msg, bytes, 0, false};
  int64_t status = get_i64(&in);
  if (status == REP_OK) {
    rep->p = msg;
    rep->n = bytes;
    rep->at = in.at;
    return 0;
  }
  char text[900];
  if (status == REP_ERROR) {
    get_str(&in, text, sizeof text);
    kiln_set_error("%s (on %s)", text, kiln_device_name(device));
  } else {
    kiln_set_error("%s: %s sent a malformed reply", who, kiln_device_name(device));
  }
  free(msg);
  return -1;
}

/* A tensor header on a remote device holding handle h. */
static kiln_tensor *remote_tensor(const char *who, const op_type *ty, int device, uint64_t h) {
  kiln_tensor *t = tensor_alloc(who, ty->dtype, 0, NULL);
  if (!t) {
    remote_free(device, (void *)(uintptr_t)h);
    return NULL;
  }
  t->rank = (int8_t)ty->rank;
  int64_t size = 1;
  for (int i = 0; i < ty->rank; i++) size *= (t->shape[i] = ty->shape[i]);
  t->size = size;
  t->device = (uint8_t)device;
  t->data = t->data_block = (void *)(uintptr_t)h;
  return t;
}

/* t's bytes into a new host tensor, asking its worker (locked). */
static kiln_tensor *fetch_locked(const char *who, const kiln_tensor *t) {
  wbuf b = {0};
  put_i64(&b, (int64_t)(uintptr_t)t->data_block);
  rbuf rep;
  int rc = request(who, t->device, R_GET, &b, &rep);
  free(b.s);
  if (rc) return NULL;
  kiln_tensor *h = tensor_alloc(who, (kiln_dtype)t->dtype, t->rank, t->shape);
  const void *data = h ? take(&rep, tensor_bytes(h)) : NULL;
  if (h && !data) {
    kiln_release(h);
    h = NULL;
    kiln_set_error("%s: %s sent a short tensor", who, kiln_device_name(t->device));
  }
  if (h && tensor_bytes(h)) memcpy(h->data, data, tensor_bytes(h));
  free((void *)rep.p);
  return h;
}

/* A host tensor's copy on remote device (locked). */
static kiln_tensor *send_locked(const char *who, const kiln_tensor *h, int device) {
  wbuf b = {0};
  put_i64(&b, client.dev[device].local);
  put_host(&b, h);
  rbuf rep;
  int rc = request(who, device, R_PUT, &b, &rep);
  free(b.s);
  if (rc) return NULL;
  uint64_t handle = (uint64_t)get_i64(&rep);
  free((void *)rep.p);
  op_type ty;
  op_type_of(h, &ty);
  return remote_tensor(who, &ty, device, handle);
}

kiln_tensor *remote_copy(const char *who, const kiln_tensor *t, int device) {
  kiln_tensor *host = NULL, *out = NULL, *copy = NULL;
  if (device_is_remote(t->device)) {
    dist_lock();
    host = fetch_locked(who, t);
    dist_unlock();
  } else {
    const kiln_tensor *h = tensor_on_host(who, t, &copy);
    host = h ? kiln_retain((kiln_tensor *)h) : NULL;
    kiln_release(copy);
  }
  if (!host || device == 0) return host;
  if (device_is_remote(device)) {
    dist_lock();
    out = send_locked(who, host, device);
    dist_unlock();
  } else {
    out = tensor_to_device(who, host, device);
  }
  kiln_release(host);
  return out;
}

int remote_read(const char *who, const kiln_tensor *t, void *dst, size_t bytes) {
  dist_lock();
  kiln_tensor *h = fetch_locked(who, t);
  dist_unlock();
  if (!h) return -1;
  memcpy(dst, h->data, bytes);
  kiln_release(h);
  return 0;
}

/* An argument for device: its handle where it lives there, else its value
 * sent from the host. 0 / -1. */
static int put_arg(const char *who, wbuf *b, const kiln_tensor *t, int device, int how) {
  if (t->device == device) {
    put_i64(b, ARG_HANDLE);
    put_i64(b, (int64_t)(uintptr_t)t->data_block);
    return 0;
  }
  kiln_tensor *h = device_is_remote(t->device) ? remote_copy(who, t, 0) : NULL, *copy = NULL;
  const kiln_tensor *host = h ? h : device_is_remote(t->device) ? NULL : tensor_on_host(who, t, &copy);
  if (host) {
    put_i64(b, how);
    put_host(b, host);
  }
  kiln_release(h);
  kiln_release(copy);
  return host ? 0 : -1;
}

kiln_tensor *remote_apply(op_id op, const op_attrs *attrs, int n, kiln_tensor *const *in, const op_type *ty,
                          int device) {
  const char *who = kiln_ops[op].api;
  op_attrs a = *attrs;
  a.value = NULL, a.callee = a.callee2 = NULL, a.host = NULL; /* IR only: never set for an eager op */
  wbuf b = {0};
  put_i64(&b, client.dev[device].local);
  put_str(&b, kiln_ops[op].name);
  put_i64(&b, (int64_t)sizeof a);
  put(&b, &a, sizeof a);
  put_i64(&b, n);
  int rc = 0;
  for (int i = 0; i < n && !rc; i++) rc = put_arg(who, &b, in[i], device, ARG_HOST);
  kiln_tensor *out = NULL;
  rbuf rep;
  dist_lock();
  if (!rc && !request(who, device, R_OP, &b, &rep)) {
    uint64_t handle = (uint64_t)get_i64(&rep);
    op_type got;
    if (get_type(&rep, &got) || got.dtype != ty->dtype || got.rank != ty->rank ||
        memcmp(got.shape, ty->shape, (size_t)ty->rank * sizeof *ty->shape)) {
      remote_free(device, (void *)(uintptr_t)handle);
      kiln_set_error("%s: %s answered with another type than inferred here", who, kiln_device_name(device));
    } else {
      out = remote_tensor(who, ty, device, handle);
    }
    free((void *)rep.p);
  }
  dist_unlock();
  free(b.s);
  return out;
}

static _Atomic int64_t texts_sent, caps_sent; /* the staged functions' texts and captures sent, for tests */

/* Has worker w run the program of key? (the keys sent to it, locked) */
static bool sent_before(worker *w, uint64_t key) {
  for (size_t i = 0; i < w->n_sent; i++)
    if (w->sent[i] == key) return true;
  return false;
}

static void mark_sent(worker *w, uint64_t key) {
  if (w->n_sent == w->cap_sent) {
    size_t cap = w->cap_sent ? 2 * w->cap_sent : 16;
    uint64_t *p = realloc(w->sent, cap * sizeof *p);
    if (!p) return; /* sent again next time */
    w->sent = p;
    w->cap_sent = cap;
  }
  w->sent[w->n_sent++] = key;
}

int remote_call(traced_fn *fn, int device, kiln_tensor *const *args, kiln_tensor **res) {
  static _Atomic uint64_t next_key = 1;
  const char *who = "function_call", *name = fn->func->name;
  int np = fn->func->n_params, nr = fn->func->n_results;
  uint64_t key = __atomic_load_n(&fn->remote_key, __ATOMIC_ACQUIRE);
  if (!key) { /* first sent now: concurrent first calls agree on one key */
    uint64_t mine = next_key++, none = 0;
    key = __atomic_compare_exchange_n(&fn->remote_key, &none, mine, false, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)
              ? mine
              : none;
  }
  dist_lock();
  worker *w = &client.w[client.dev[device].task];
  bool with_text = !sent_before(w, key);
  dist_unlock();
  char *text = with_text ? ir_print_module(fn->module) : NULL;
  if (with_text && !text) return kiln_set_error("%s: @%s: out of memory", who, name);
  wbuf b = {0};
  put_i64(&b, (int64_t)key);
  put_i64(&b, client.dev[device].local);
  put_i64(&b, with_text);
  put_str(&b, name);
  put_i64(&b, text ? (int64_t)strlen(text) : 0);
  if (text) put(&b, text, strlen(text));
  free(text);
  put_i64(&b, np);
  int rc = 0, first_cap = np - fn->n_residuals - fn->n_vars - fn->n_caps, keeps = 0;
  for (int i = 0; i < np && !rc; i++) {
    bool cap = i >= first_cap && i - first_cap < fn->n_caps && args[i] == fn->caps[i - first_cap] &&
               args[i]->device != device;
    if (cap && !with_text) { /* the worker kept it with the text */
      put_i64(&b, ARG_KEPT);
      continue;
    }
    keeps += cap;
    rc = put_arg(who, &b, args[i], device, cap ? ARG_KEEP : ARG_HOST);
  }
  rbuf rep;
  dist_lock();
  if (!rc) rc = request(who, device, R_CALL, &b, &rep);
  if (!rc) {
    if (with_text) {
      mark_sent(w, key);
      texts_sent++;
      caps_sent += keeps;
    }
    for (int k = 0; k < nr; k++) {
      uint64_t handle = (uint64_t)get_i64(&rep);
      op_type ty;
      if (get_type(&rep, &ty)) {
        res[k] = NULL;
        rc = kiln_set_error("%s: @%s: %s sent a malformed reply", who, name, kiln_device_name(device));
      } else {
        res[k] = scope_own(remote_tensor(who, &ty, device, handle));
        if (!res[k]) rc = -1;
      }
    }
    free((void *)rep.p);
  }
  dist_unlock();
  free(b.s);
  return rc;
}

/* ---- for tests (kiln_internal) ---- */

static int debug_device(const char *who, const char *name) {
  int d = device_find(name);
  if (d < 0 || !device_is_remote(d)) return kiln_set_error("%s: '%s' is not a remote device", who, name);
  return d;
}

/* The tensors (programs: the staged functions) the worker behind `name`
 * holds, its pending frees done first; -1 + error. */
static int64_t worker_count(const char *who, const char *name, bool programs) {
  int d = debug_device(who, name);
  if (d < 0) return -1;
  dist_lock();
  rbuf rep;
  int64_t live = -1, progs = -1;
  if (!request(who, d, R_LIVE, NULL, &rep)) {
    live = get_i64(&rep), progs = get_i64(&rep);
    free((void *)rep.p);
  }
  dist_unlock();
  return programs ? progs : live;
}
KILN_EXPORT int64_t dist_remote_live(const char *name) { return worker_count("dist_remote_live", name, false); }
KILN_EXPORT int64_t dist_remote_programs(const char *name) {
  return worker_count("dist_remote_programs", name, true);
}
KILN_EXPORT int64_t dist_remote_texts_sent(void) { return texts_sent; }
KILN_EXPORT int64_t dist_remote_caps_sent(void) { return caps_sent; }

/* Makes the worker behind `name` sleep `seconds` before its reply: a hung
 * worker, as the next request sees it. 0 / -1 (the timeout's error). */
KILN_EXPORT int dist_remote_stall(const char *name, double seconds) {
  int d = debug_device("dist_remote_stall", name);
  if (d < 0) return -1;
  wbuf b = {0};
  put(&b, &seconds, sizeof seconds);
  dist_lock();
  rbuf rep;
  int rc = request("dist_remote_stall", d, R_STALL, &b, &rep);
  dist_unlock();
  free(b.s);
  if (!rc) free((void *)rep.p);
  return rc;
}

/* ==== leaving the world ==== */

/* Rank 0: a STOP to every other rank, then each one's ACK (a lost worker's
 * late replies skipped), and the announcement of every rank that served.
 * The others: a rank that served heard its STOP in kiln_dist_serve; one
 * that did not hears it now. */
int dist_remote_finish(void) {
  const char *who = "dist_finalize";
  int size = dist_world_size(), rc = 0;
  if (size == 1) return 0;
  if (dist_world_rank() != 0) {
    if (held.stopped) return held.stopped = false, 0;
    void *msg;
    size_t bytes;
    int r = dist_recv(who, 0, TAG_REQ, dist_timeout(), &msg, &bytes, NULL);
    if (r) return -1;
    wbuf out = {0};
    int64_t ack[2] = {REP_ACK, 0}; /* served nothing */
    put(&out, ack, sizeof ack);
    free(msg);
    rc = dist_send(who, 0, TAG_REP, out.s, out.n);
    free(out.s);
    return rc;
  }
  if (client_ready()) return -1;
  int64_t stop[2] = {R_STOP, 0};
  for (int r = 1; r < size; r++)
    if (dist_send(who, r, TAG_REQ, stop, sizeof stop)) rc = -1;
  for (int r = 1; r < size && !rc; r++) {
    for (;;) {
      void *msg;
      size_t bytes;
      if (dist_recv(who, r, TAG_REP, dist_timeout(), &msg, &bytes, NULL)) {
        rc = -1;
        break;
      }
      rbuf in = {msg, bytes, 0, false};
      int64_t status = get_i64(&in), served = get_i64(&in);
      free(msg);
      if (status != REP_ACK) continue; /* a lost worker's late reply */
      while (served && !rc && !client.w[r].announced)
        if (take_hello(who, dist_timeout())) rc = -1;
      break;
    }
  }
  /* the tensors there are gone: remote devices stay listed, unusable */
  for (int r = 1; r < size; r++) {
    free(client.w[r].frees);
    client.w[r].frees = NULL;
    client.w[r].n_free = client.w[r].cap_free = 0;
    free(client.w[r].sent);
    client.w[r].sent = NULL;
    client.w[r].n_sent = client.w[r].cap_sent = 0;
    client.w[r].lost = true;
  }
  snprintf(client.why, sizeof client.why, "kiln_dist_finalize ended the workers");
  return rc;
}
