/* dist_mpi.c — the world's transport: joining and leaving the world, the
 * header every rank exchanges before a collective, and the data movement of
 * collectives on host buffers, nonblocking MPI calls polled against
 * KILN_DIST_TIMEOUT_S so that a rank that never comes fails the others
 * instead of hanging them. Built without MPI (KILN_HAVE_MPI unset) the
 * world is this one process and every movement is a copy. */
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdlib.h>
#include <time.h>

#include "dist.h"

#ifdef KILN_HAVE_MPI
#include <mpi.h>
#endif

enum { DIST_OUT, DIST_IN, DIST_DONE }; /* world.state */

static struct {
  int state;
  int rank, size;
  int local_size;   /* the processes of this world on this machine (this one included) */
  bool broken;      /* a wait expired: a collective is half done for good */
  int64_t seq;      /* collectives this process has begun in the world */
  double waited;    /* seconds in wait_for */
#ifdef KILN_HAVE_MPI
  MPI_Comm comm;    /* Kiln's own duplicate of MPI_COMM_WORLD: the user's traffic never matches ours */
  MPI_Comm remote;  /* another, for remote devices' messages: they never mix with collectives */
  bool owns_mpi;    /* Kiln initialized MPI, so Kiln finalizes it */
  int level;        /* the thread level MPI granted */
#endif
} world = {.size = 1, .local_size = 1};

static pthread_mutex_t world_mutex = PTHREAD_MUTEX_INITIALIZER;
void dist_lock(void) {
  dist_async_drain(); /* after the staged collectives already started */
  pthread_mutex_lock(&world_mutex);
}
void dist_unlock(void) { pthread_mutex_unlock(&world_mutex); }

int dist_world_rank(void) { return world.rank; }
int dist_world_size(void) { return world.size; }
KILN_EXPORT double dist_wait_seconds(void) { return world.waited; }

#ifdef KILN_HAVE_MPI
static int mpi_fail(const char *who, int rc) {
  char msg[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(rc, msg, &len) != MPI_SUCCESS) snprintf(msg, sizeof msg, "error %d", rc);
  return kiln_set_error("%s: MPI failed: %s", who, msg);
}
#endif

/* ---- joining and leaving ---- */

static int join_locked(const char *who) {
  if (world.state == DIST_IN) return 0;
#ifdef KILN_HAVE_MPI
  int inited = 0, finalized = 0;
  MPI_Initialized(&inited);
  MPI_Finalized(&finalized);
  if (finalized)
    return kiln_set_error("%s: MPI has been finalized in this process; it cannot start again", who);
  int provided = 0, rc;
  if (!inited) {
    if ((rc = MPI_Init_thread(NULL, NULL, MPI_THREAD_MULTIPLE, &provided)) != MPI_SUCCESS) return mpi_fail(who, rc);
    world.owns_mpi = true;
  } else {
    MPI_Query_thread(&provided);
  }
  world.level = provided;
  if ((rc = MPI_Comm_dup(MPI_COMM_WORLD, &world.comm)) != MPI_SUCCESS) return mpi_fail(who, rc);
  if ((rc = MPI_Comm_dup(MPI_COMM_WORLD, &world.remote)) != MPI_SUCCESS) return mpi_fail(who, rc);
  MPI_Comm_set_errhandler(world.comm, MPI_ERRORS_RETURN);
  MPI_Comm_set_errhandler(world.remote, MPI_ERRORS_RETURN);
  MPI_Comm_rank(world.comm, &world.rank);
  MPI_Comm_size(world.comm, &world.size);
  MPI_Comm node;
  world.local_size = world.size; /* if MPI cannot tell: all of them here, the careful guess */
  if (MPI_Comm_split_type(world.comm, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node) == MPI_SUCCESS) {
    MPI_Comm_size(node, &world.local_size);
    MPI_Comm_free(&node);
  }
#else
  (void)who;
  world.rank = 0;
  world.size = 1;
#endif
  world.broken = false;
  world.seq = 0;
  __atomic_store_n(&world.state, DIST_IN, __ATOMIC_RELEASE);
  return 0;
}

int dist_join(const char *who) {
  if (KILN_LIKELY(__atomic_load_n(&world.state, __ATOMIC_ACQUIRE) == DIST_IN)) return 0;
  dist_lock();
  int rc = join_locked(who);
  dist_unlock();
  return rc;
}

int dist_local_size(void) { return world.local_size; }

bool dist_threads_ok(void) {
#ifdef KILN_HAVE_MPI
  return world.level >= MPI_THREAD_MULTIPLE;
#else
  return true;
#endif
}

int kiln_dist_init(void) { return dist_join("dist_init"); }

int kiln_dist_rank(void) { return dist_join("dist_rank") ? -1 : world.rank; }

int kiln_dist_size(void) { return dist_join("dist_size") ? -1 : world.size; }

void kiln_dist_finalize(void) {
  dist_async_finish();
  dist_lock();
  if (world.state == DIST_IN) {
#ifdef KILN_HAVE_MPI
    /* rank 0 ends the servers, the others hear it: no message is left unmatched */
    bool remote_ok = dist_remote_finish() == 0;
    /* a broken world's communicator has a collective pending for good */
    if (!world.broken) MPI_Comm_free(&world.comm);
    if (remote_ok) MPI_Comm_free(&world.remote);
    if (world.owns_mpi) MPI_Finalize();
    __atomic_store_n(&world.state, world.owns_mpi ? DIST_DONE : DIST_OUT, __ATOMIC_RELEASE);
#else
    __atomic_store_n(&world.state, DIST_OUT, __ATOMIC_RELEASE);
#endif
    world.rank = 0;
    world.size = 1;
  }
  dist_unlock();
}

/* ---- waiting ---- */

#ifdef KILN_HAVE_MPI
/* KILN_DIST_TIMEOUT_S: seconds, 0 = wait forever; 60 when unset or unreadable */
static double timeout_seconds(void) {
  const char *s = getenv("KILN_DIST_TIMEOUT_S");
  char *end;
  double v = s ? strtod(s, &end) : NAN;
  return s && end != s && v >= 0 && isfinite(v) ? v : 60.0;
}

static double now_seconds(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Polls req to completion: spinning first (MPI makes progress only inside
 * its calls), then yielding the core, then napping, so that oversubscribed
 * ranks let each other run. */
static int wait_for(const char *who, MPI_Request *req) {
  double limit = timeout_seconds(), start = now_seconds(), elapsed = 0;
  for (long spin = 0;; spin++) {
    int done = 0, rc = MPI_Test(req, &done, MPI_STATUS_IGNORE);
    if (rc != MPI_SUCCESS) return mpi_fail(who, rc);
    if (done) break;
    if (spin % 64) continue;
    elapsed = now_seconds() - start;
    if (limit > 0 && elapsed > limit) {
      world.broken = true;
      world.waited += elapsed;
      return kiln_set_error("%s: timed out after %g s waiting for the other ranks (KILN_DIST_TIMEOUT_S): "
                            "a rank skipped this collective, or died; the world is unusable from now on",
                            who, limit);
    }
    if (elapsed > 0.01) {
      nanosleep(&(struct timespec){0, 50000}, NULL);
    } else if (elapsed > 1e-4) {
      sched_yield();
    }
  }
  world.waited += now_seconds() - start;
  return 0;
}

static MPI_Datatype mpi_type(kiln_dtype dt) {
  switch (dt) {
  case KILN_F32: return MPI_FLOAT;
  case KILN_F64: return MPI_DOUBLE;
  case KILN_I32: return MPI_INT32_T;
  case KILN_I64: return MPI_INT64_T;
  default: return MPI_UINT8_T; /* bool */
  }
}

static MPI_Op mpi_op(dist_op op) { return op == DIST_MAX ? MPI_MAX : op == DIST_MIN ? MPI_MIN : MPI_SUM; }
#endif

static int check_world(const char *who) {
  if (world.state != DIST_IN)
    return kiln_set_error("%s: this process is not in the world (kiln_dist_finalize was called)", who);
  if (world.broken)
    return kiln_set_error("%s: the world is unusable after an earlier collective timed out", who);
  return 0;
}

/* ---- the header ---- */

enum { H_SEQ, H_OK, H_KIND, H_OP, H_DTYPE, H_RANK, H_SHAPE, H_ARG = H_SHAPE + KILN_MAX_RANK, H_DIGEST, H_FIELDS };

static void pack_header(const dist_header *h, bool ok, int64_t *f) {
  memset(f, 0, H_FIELDS * sizeof *f);
  f[H_SEQ] = world.seq;
  f[H_OK] = ok;
  f[H_KIND] = h->kind;
  f[H_OP] = h->op;
  f[H_DTYPE] = h->dtype;
  f[H_RANK] = h->rank;
  for (int i = 0; i < h->rank && i < KILN_MAX_RANK; i++) f[H_SHAPE + i] = h->shape[i];
  f[H_ARG] = h->arg;
  f[H_DIGEST] = (int64_t)h->digest;
}

#ifdef KILN_HAVE_MPI
static const char *const kind_names[] = {
    [DIST_ALL_REDUCE] = "all_reduce",
    [DIST_ALL_GATHER] = "all_gather",
    [DIST_REDUCE_SCATTER] = "reduce_scatter",
    [DIST_BROADCAST] = "broadcast_from",
    [DIST_AVERAGE_GRADIENTS] = "dist_average_gradients",
    [DIST_SYNC_VARIABLES] = "dist_sync_variables",
};

static const char *kind_name(int64_t k) {
  return k >= DIST_ALL_REDUCE && k <= DIST_SYNC_VARIABLES ? kind_names[k] : "?";
}

/* The error for headers all[rank * H_FIELDS ...] that do not agree, the
 * same words on every rank but for who. */
static int mismatch(const char *who, const int64_t *all, int size, bool ok) {
  for (int r = 0; r < size; r++) {
    if (all[r * H_FIELDS + H_OK]) continue;
    if (!ok) return -1; /* this rank's own error says why */
    return kiln_set_error("%s: rank %d's call failed (its error says why); no data moved", who, r);
  }
  const int64_t *a = all;
  for (int r = 1; r < size; r++) {
    const int64_t *b = all + (size_t)r * H_FIELDS;
    if (b[H_SEQ] != a[H_SEQ])
      return kiln_set_error("%s: rank %d is at its collective #%lld where rank 0 is at #%lld "
                            "(a rank skipped or added a collective)",
                            who, r, (long long)b[H_SEQ], (long long)a[H_SEQ]);
    if (b[H_KIND] != a[H_KIND])
      return kiln_set_error("%s: rank %d called %s where rank 0 called %s", who, r, kind_name(b[H_KIND]),
                            kind_name(a[H_KIND]));
    if (b[H_OP] != a[H_OP])
      return kiln_set_error("%s: rank %d reduces with \"%s\" where rank 0 with \"%s\"", who, r,
                            dist_op_name((dist_op)b[H_OP]), dist_op_name((dist_op)a[H_OP]));
    if (b[H_DTYPE] != a[H_DTYPE])
      return kiln_set_error("%s: rank %d has dtype %s where rank 0 has %s", who, r,
                            kiln_dtype_name((kiln_dtype)b[H_DTYPE]), kiln_dtype_name((kiln_dtype)a[H_DTYPE]));
    bool same = b[H_RANK] == a[H_RANK];
    for (int i = 0; same && i < KILN_MAX_RANK; i++) same = b[H_SHAPE + i] == a[H_SHAPE + i];
    if (!same) {
      char sa[160], sb[160];
      return kiln_set_error("%s: rank %d has shape %s where rank 0 has %s", who, r,
                            shape_str(sb, sizeof sb, (int)b[H_RANK], b + H_SHAPE),
                            shape_str(sa, sizeof sa, (int)a[H_RANK], a + H_SHAPE));
    }
    if (b[H_ARG] != a[H_ARG]) {
      const char *what = a[H_KIND] == DIST_BROADCAST || a[H_KIND] == DIST_SYNC_VARIABLES ? "root" : "axis";
      return kiln_set_error("%s: rank %d passed %s %lld where rank 0 passed %lld", who, r, what,
                            (long long)b[H_ARG], (long long)a[H_ARG]);
    }
    if (b[H_DIGEST] != a[H_DIGEST])
      return kiln_set_error("%s: rank %d's tensors differ in count, dtype or shape from rank 0's", who, r);
  }
  return kiln_set_error("%s: the ranks' headers disagree", who); /* unreachable: some field differed */
}
#endif

int dist_agree(const char *who, const dist_header *h, bool ok) {
  if (check_world(who)) return -1;
  int64_t f[H_FIELDS];
  pack_header(h, ok, f);
  world.seq++;
  if (world.size == 1) return ok ? 0 : -1;
#ifdef KILN_HAVE_MPI
  /* one allreduce gives every field's max and (through ~) min: they differ
   * only where some rank disagrees */
  int64_t v[2 * H_FIELDS];
  for (int i = 0; i < H_FIELDS; i++) v[i] = f[i], v[H_FIELDS + i] = ~f[i];
  MPI_Request req;
  int rc = MPI_Iallreduce(MPI_IN_PLACE, v, 2 * H_FIELDS, MPI_INT64_T, MPI_MAX, world.comm, &req);
  if (rc != MPI_SUCCESS) return mpi_fail(who, rc);
  if (wait_for(who, &req)) return -1;
  bool agree = true;
  for (int i = 0; i < H_FIELDS && agree; i++) agree = v[i] == ~v[H_FIELDS + i];
  if (agree) return ok ? 0 : -1;
  /* every rank saw the disagreement: all of them gather the headers to say what it is */
  int64_t *all = malloc((size_t)world.size * sizeof f);
  if (!all) return kiln_set_error("%s: out of memory", who);
  rc = MPI_Iallgather(f, H_FIELDS, MPI_INT64_T, all, H_FIELDS, MPI_INT64_T, world.comm, &req);
  if (rc != MPI_SUCCESS) {
    free(all);
    return mpi_fail(who, rc);
  }
  if (wait_for(who, &req)) {
    free(all);
    return -1;
  }
  world.seq = v[H_SEQ]; /* the latest rank's count: the ranks agree again from here */
  mismatch(who, all, world.size, ok);
  free(all);
  return -1;
#else
  return kiln_set_error("%s: a world of %d processes without MPI", who, world.size);
#endif
}

/* ---- data movement ---- */

#ifdef KILN_HAVE_MPI
/* The payload of a collective moves with MPI's blocking calls: by then the
 * header exchange (dist_agree, bounded by KILN_DIST_TIMEOUT_S) has shown
 * every rank here with the same call, so nothing is left to wait for but
 * the data, and Open MPI's blocking collectives (coll/tuned) move large
 * buffers about twice as fast as its non-blocking ones (coll/libnbc): an
 * MPI_Iallreduce polled with MPI_Test made kiln_all_reduce 0.52x a plain
 * MPI_Allreduce at 16 MB on 2 processes. A rank that dies mid-payload
 * brings the job down through mpirun, as it would any MPI program.
 * payload_done: the call's rc, its time (from start) counted as waiting */
static int payload_done(const char *who, int rc, double start) {
  world.waited += now_seconds() - start;
  return rc != MPI_SUCCESS ? mpi_fail(who, rc) : 0;
}

/* MPI counts are ints: larger buffers go in pieces */
enum { CHUNK = 1 << 28 };

static int count_fits(const char *who, int64_t count) {
  if (count <= INT32_MAX) return 0;
  return kiln_set_error("%s: %lld elements (or bytes) per rank is more than MPI's int count allows", who,
                        (long long)count);
}

/* send -> buf (send == buf: in place); every rank ends with the bytes one
 * rank computed for each element: for floats the reduction is done once per
 * element (reduce-scatter, then each rank's part gathered) unless it is a
 * sum of two ranks, which is commutative and so the same bits on both */
static int allreduce_piece(const char *who, const char *send, char *buf, int count, kiln_dtype dt, dist_op op) {
  MPI_Datatype type = mpi_type(dt);
  double start = now_seconds();
  if (!dtype_is_float(dt) || (op == DIST_SUM && world.size == 2))
    return payload_done(who, MPI_Allreduce(send == buf ? MPI_IN_PLACE : send, buf, count, type, mpi_op(op), world.comm),
                        start);
  int n = world.size, *counts = malloc(2 * (size_t)n * sizeof *counts), *displs = counts + n;
  size_t esize = kiln_dtype_sizes[dt];
  if (!counts) return kiln_set_error("%s: out of memory", who);
  for (int r = 0, at = 0; r < n; r++) {
    counts[r] = count / n + (r < count % n);
    displs[r] = at;
    at += counts[r];
  }
  char *mine = malloc((size_t)counts[world.rank] * esize + 1);
  if (!mine) {
    free(counts);
    return kiln_set_error("%s: out of memory", who);
  }
  int err = payload_done(who, MPI_Reduce_scatter(send, mine, counts, type, mpi_op(op), world.comm), start);
  if (!err) {
    memcpy(buf + (size_t)displs[world.rank] * esize, mine, (size_t)counts[world.rank] * esize);
    start = now_seconds();
    err = payload_done(
        who, MPI_Allgatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, buf, counts, displs, type, world.comm), start);
  }
  free(mine);
  free(counts);
  return err;
}
#endif

int dist_allreduce(const char *who, const void *send, void *buf, int64_t count, kiln_dtype dt, dist_op op) {
  if (check_world(who)) return -1;
  if (world.size == 1) {
    if (count && send != buf) memcpy(buf, send, (size_t)count * kiln_dtype_sizes[dt]);
    return 0;
  }
  if (count == 0) return 0;
#ifdef KILN_HAVE_MPI
  size_t esize = kiln_dtype_sizes[dt];
  for (int64_t at = 0; at < count; at += CHUNK) {
    int piece = (int)(count - at < CHUNK ? count - at : CHUNK);
    if (allreduce_piece(who, (const char *)send + (size_t)at * esize, (char *)buf + (size_t)at * esize, piece, dt, op))
      return -1;
  }
  return 0;
#else
  (void)op;
  return -1;
#endif
}

int dist_allgather(const char *who, const void *send, void *recv, size_t bytes) {
  if (check_world(who)) return -1;
  if (world.size == 1) {
    if (bytes) memcpy(recv, send, bytes);
    return 0;
  }
  if (bytes == 0) return 0;
#ifdef KILN_HAVE_MPI
  if (count_fits(who, (int64_t)bytes)) return -1;
  double start = now_seconds();
  return payload_done(who, MPI_Allgather(send, (int)bytes, MPI_BYTE, recv, (int)bytes, MPI_BYTE, world.comm), start);
#else
  return -1;
#endif
}

int dist_reduce_scatter(const char *who, const void *send, void *recv, int64_t count, kiln_dtype dt, dist_op op) {
  if (check_world(who)) return -1;
  if (world.size == 1) {
    if (count) memcpy(recv, send, (size_t)count * kiln_dtype_sizes[dt]);
    return 0;
  }
  if (count == 0) return 0;
#ifdef KILN_HAVE_MPI
  if (count_fits(who, count)) return -1;
  double start = now_seconds();
  return payload_done(
      who, MPI_Reduce_scatter_block(send, recv, (int)count, mpi_type(dt), mpi_op(op), world.comm), start);
#else
  (void)op;
  return -1;
#endif
}

int dist_broadcast(const char *who, void *buf, size_t bytes, int root) {
  if (check_world(who)) return -1;
  if (world.size == 1 || bytes == 0) return 0;
#ifdef KILN_HAVE_MPI
  if (count_fits(who, (int64_t)bytes)) return -1;
  double start = now_seconds();
  return payload_done(who, MPI_Bcast(buf, (int)bytes, MPI_BYTE, root, world.comm), start);
#else
  (void)buf, (void)root;
  return -1;
#endif
}

/* ---- point to point (remote devices) ----
 * On the world's second communicator, so that requests and replies never
 * match a collective's messages. An expired wait here breaks nothing: the
 * caller decides what the peer's silence means. */

#ifdef KILN_HAVE_MPI
/* Polls test(ctx, &done) until done or `limit` seconds (0: forever, < 0: once);
 * 1 when it expired, 0 done, -1 MPI failed. Paces itself as wait_for does. */
static int poll_until(const char *who, int (*test)(void *ctx, int *done), void *ctx, double limit) {
  double start = now_seconds();
  for (long spin = 0;; spin++) {
    int done = 0, rc = test(ctx, &done);
    if (rc != MPI_SUCCESS) return mpi_fail(who, rc);
    if (done) return 0;
    if (limit < 0) return 1;
    if (spin % 64) continue;
    double elapsed = now_seconds() - start;
    if (limit > 0 && elapsed > limit) return 1;
    if (elapsed > 0.01) {
      nanosleep(&(struct timespec){0, elapsed > 1 ? 1000000 : 50000}, NULL);
    } else if (elapsed > 1e-4) {
      sched_yield();
    }
  }
}

static int test_request(void *ctx, int *done) { return MPI_Test(ctx, done, MPI_STATUS_IGNORE); }

typedef struct {
  int from, tag;
  MPI_Message msg;
  MPI_Status status;
} probe_ctx;

static int test_probe(void *ctx, int *done) {
  probe_ctx *p = ctx;
  return MPI_Improbe(p->from, p->tag, world.remote, done, &p->msg, &p->status);
}
#endif

double dist_timeout(void) {
#ifdef KILN_HAVE_MPI
  return timeout_seconds();
#else
  return 60.0;
#endif
}

int dist_send(const char *who, int to, int tag, const void *buf, size_t bytes) {
  if (world.state != DIST_IN) return kiln_set_error("%s: this process is not in the world", who);
#ifdef KILN_HAVE_MPI
  if (count_fits(who, (int64_t)bytes)) return -1;
  MPI_Request req;
  int rc = MPI_Isend(buf, (int)bytes, MPI_BYTE, to, tag, world.remote, &req);
  if (rc != MPI_SUCCESS) return mpi_fail(who, rc);
  double limit = timeout_seconds();
  int r = poll_until(who, test_request, &req, limit);
  if (r == 1) {
    MPI_Request_free(&req); /* completes, or not, on its own */
    return kiln_set_error("%s: rank %d took no message for %g s (KILN_DIST_TIMEOUT_S): it died or hangs", who,
                          to, limit);
  }
  return r;
#else
  (void)to, (void)tag, (void)buf, (void)bytes;
  return kiln_set_error("%s: Kiln was built without MPI: a world of one process", who);
#endif
}

int dist_recv(const char *who, int from, int tag, double wait, void **buf, size_t *bytes, int *source) {
  *buf = NULL;
  *bytes = 0;
  if (world.state != DIST_IN) return kiln_set_error("%s: this process is not in the world", who);
#ifdef KILN_HAVE_MPI
  probe_ctx p = {.from = from < 0 ? MPI_ANY_SOURCE : from, .tag = tag};
  int r = poll_until(who, test_probe, &p, wait);
  if (r) return r;
  int count = 0;
  MPI_Get_count(&p.status, MPI_BYTE, &count);
  char *b = malloc((size_t)count + 1);
  if (!b) {
    MPI_Mrecv(NULL, 0, MPI_BYTE, &p.msg, MPI_STATUS_IGNORE); /* a truncation error, but matched */
    return kiln_set_error("%s: out of memory for a message of %d bytes", who, count);
  }
  int rc = MPI_Mrecv(b, count, MPI_BYTE, &p.msg, MPI_STATUS_IGNORE);
  if (rc != MPI_SUCCESS) {
    free(b);
    return mpi_fail(who, rc);
  }
  *buf = b;
  *bytes = (size_t)count;
  if (source) *source = p.status.MPI_SOURCE;
  return 0;
#else
  (void)from, (void)tag, (void)wait, (void)source;
  return kiln_set_error("%s: Kiln was built without MPI: a world of one process", who);
#endif
}
