/* dist_async.c — staged collectives started now and waited for later
 * (API.md §12, issue 18): one communication thread per process runs the
 * collectives queued by dist_async_start, strictly in the order they were
 * started (every rank issues its collectives in the same order), each the
 * blocking dist_run_into, as Horovod's background thread does (Open MPI's
 * non-blocking collectives move large buffers about half as fast as its
 * blocking ones; dist_mpi.c). The thread is made at the first start and
 * joined at kiln_dist_finalize or exit. Any other use of the world waits
 * for the queue to empty first (dist_lock), so an eager collective issued
 * while a staged one is in flight comes after it. Where MPI does not let
 * every thread call it at any time (below MPI_THREAD_MULTIPLE: remote
 * devices' messages do not all pass dist_lock), or where overlap is off
 * (overlap_on), a start runs the collective at once on the caller's thread. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "dist.h"

struct dist_job {
  const char *who;
  dist_kind kind;
  int op, world;
  int64_t arg;
  kiln_tensor in, out; /* headers over the caller's buffers */
  int rc;
  bool done;
  char msg[1024]; /* the worker's error, for the waiting thread */
  struct dist_job *next;
};

static struct {
  pthread_mutex_t mu;
  pthread_cond_t work, finished;
  pthread_t thread;
  bool running, stop;
  dist_job *head, *tail; /* queued, not yet taken */
  int pending;            /* started, not yet finished */
} q = {.mu = PTHREAD_MUTEX_INITIALIZER, .work = PTHREAD_COND_INITIALIZER, .finished = PTHREAD_COND_INITIALIZER};

static _Thread_local bool on_worker;

static void *worker(void *arg) {
  (void)arg;
  on_worker = true;
  pthread_mutex_lock(&q.mu);
  for (;;) {
    while (!q.head && !q.stop) pthread_cond_wait(&q.work, &q.mu);
    if (!q.head) break;
    dist_job *j = q.head;
    if (!(q.head = j->next)) q.tail = NULL;
    pthread_mutex_unlock(&q.mu);
    kiln_clear_error();
    int rc = dist_run_into(j->who, j->kind, j->op, j->arg, j->world, &j->in, &j->out);
    pthread_mutex_lock(&q.mu);
    j->rc = rc;
    if (rc) snprintf(j->msg, sizeof j->msg, "%s", kiln_has_error() ? kiln_last_error() : "");
    j->done = true;
    __atomic_sub_fetch(&q.pending, 1, __ATOMIC_RELAXED);
    pthread_cond_broadcast(&q.finished);
  }
  pthread_mutex_unlock(&q.mu);
  return NULL;
}

/* KILN_DIST_OVERLAP (read at each start): "0" runs every start at once,
 * "1" overlaps. Unset: overlap where each of this machine's processes can
 * have a core for its communication thread beside its pool's threads.
 * Without one the shared-memory collective is CPU work time-sliced with
 * the kernels it was to hide behind: 0.64x the step without overlap on 2
 * processes on 2 cores (bench/README.md). */
static bool overlap_on(void) {
  const char *s = getenv("KILN_DIST_OVERLAP");
  if (s && *s) return strcmp(s, "0") != 0;
  long cores = sysconf(_SC_NPROCESSORS_ONLN);
  return cores > 0 && cores >= (long)dist_local_size() * (kiln_num_threads() + 1);
}

bool dist_async_enabled(void) { return overlap_on() && dist_threads_ok(); }

static void stop_worker(void) {
  pthread_mutex_lock(&q.mu);
  bool running = q.running;
  q.stop = true;
  pthread_cond_broadcast(&q.work);
  pthread_mutex_unlock(&q.mu);
  if (running) pthread_join(q.thread, NULL);
  pthread_mutex_lock(&q.mu);
  q.running = q.stop = false;
  pthread_mutex_unlock(&q.mu);
}

static void at_exit(void) { stop_worker(); }

int dist_async_start(const char *who, dist_kind kind, int op, int64_t arg, int world, const kiln_tensor *in,
                     const kiln_tensor *out, dist_job **job) {
  *job = NULL;
  if (dist_join(who)) return -1; /* MPI starts on the caller's thread */
  if (!dist_async_enabled())
    return dist_run_into(who, kind, op, arg, world, (kiln_tensor *)in, (kiln_tensor *)out);
  dist_job *j = calloc(1, sizeof *j);
  if (!j) return kiln_set_error("%s: out of memory", who);
  *j = (dist_job){.who = who, .kind = kind, .op = op, .world = world, .arg = arg, .in = *in, .out = *out};
  pthread_mutex_lock(&q.mu);
  if (!q.running) {
    if (pthread_create(&q.thread, NULL, worker, NULL)) {
      pthread_mutex_unlock(&q.mu);
      free(j);
      return kiln_set_error("%s: could not start the communication thread", who);
    }
    q.running = true;
  }
  if (q.tail) q.tail->next = j;
  else q.head = j;
  q.tail = j;
  __atomic_add_fetch(&q.pending, 1, __ATOMIC_RELAXED);
  pthread_cond_signal(&q.work);
  pthread_mutex_unlock(&q.mu);
  *job = j;
  return 0;
}

int dist_async_wait(dist_job *j, bool keep_error) {
  if (!j) return 0;
  pthread_mutex_lock(&q.mu);
  while (!j->done) pthread_cond_wait(&q.finished, &q.mu);
  pthread_mutex_unlock(&q.mu);
  int rc = j->rc;
  if (rc && keep_error) kiln_set_error("%s", j->msg[0] ? j->msg : j->who);
  free(j);
  return rc;
}

void dist_async_drain(void) {
  if (on_worker || !__atomic_load_n(&q.pending, __ATOMIC_RELAXED)) return;
  pthread_mutex_lock(&q.mu);
  while (__atomic_load_n(&q.pending, __ATOMIC_RELAXED)) pthread_cond_wait(&q.finished, &q.mu);
  pthread_mutex_unlock(&q.mu);
}

void dist_async_finish(void) { stop_worker(); }

KILN_CONSTRUCTOR static void register_exit(void) { atexit(at_exit); }
