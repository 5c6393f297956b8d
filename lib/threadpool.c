/* threadpool.c — a small pool for splitting large eager kernels. Workers
 * spin briefly, then sleep on a condition variable; a job is a range that the caller and the
 * workers claim in chunks through an atomic counter. One job at a time: a
 * second caller (another thread, or a kernel inside a job) runs serially. */
#include <pthread.h>
#include <stdlib.h>
#include <unistd.h>

#include "runtime.h"

enum {
  MAX_WORKERS = 63,
  SPIN = 2000, /* pause loops (tens of microseconds) before sleeping: back-to-back
                  ops then skip the futex round trip that costs more than the op */
};

typedef struct {
  pthread_mutex_t lock; /* guards the sleeps on wake and done */
  pthread_cond_t wake, done;
  pthread_mutex_t busy; /* held by the caller that owns the pool */
  int n_workers;
  atomic_ullong generation; /* bumped per job; the job's fields are written before */
  atomic_int sleepers;      /* workers waiting on wake */
  parallel_fn fn;
  void *ctx;
  int64_t n, chunk;
  atomic_llong next;      /* next unclaimed index */
  atomic_ullong open_gen; /* the job workers may still join; 0 = closed */
  atomic_int inflight;    /* workers inside the current job */
} thread_pool;

static thread_pool pool = {.lock = PTHREAD_MUTEX_INITIALIZER,
                           .wake = PTHREAD_COND_INITIALIZER,
                           .done = PTHREAD_COND_INITIALIZER,
                           .busy = PTHREAD_MUTEX_INITIALIZER};
static pthread_once_t pool_once = PTHREAD_ONCE_INIT;
static _Thread_local bool in_pool_task;

static void run_chunks(void) {
  for (;;) {
    int64_t b = atomic_fetch_add(&pool.next, pool.chunk);
    if (b >= pool.n) return;
    int64_t e = b + pool.chunk < pool.n ? b + pool.chunk : pool.n;
    pool.fn(pool.ctx, b, e);
  }
}

static void *worker_main(void *arg) {
  (void)arg;
  in_pool_task = true;
  uint64_t seen = 0;
  for (;;) {
    for (int i = 0; i < SPIN && atomic_load(&pool.generation) == seen; i++) KILN_CPU_RELAX();
    if (atomic_load(&pool.generation) == seen) {
      /* sleepers is raised before the generation is read again, and the
       * caller bumps the generation before reading sleepers: one of the two
       * sees the other, so no wake-up is lost */
      pthread_mutex_lock(&pool.lock);
      atomic_fetch_add(&pool.sleepers, 1);
      while (atomic_load(&pool.generation) == seen) pthread_cond_wait(&pool.wake, &pool.lock);
      atomic_fetch_sub(&pool.sleepers, 1);
      pthread_mutex_unlock(&pool.lock);
    }
    seen = atomic_load(&pool.generation);
    /* join only a job that is still open: the caller does not wait for a
     * worker the scheduler left asleep while it did every chunk itself */
    atomic_fetch_add(&pool.inflight, 1);
    if (atomic_load(&pool.open_gen) == seen) run_chunks();
    if (atomic_fetch_sub(&pool.inflight, 1) == 1) {
      pthread_mutex_lock(&pool.lock);
      pthread_cond_signal(&pool.done);
      pthread_mutex_unlock(&pool.lock);
    }
  }
  return NULL;
}

static void pool_start(void) {
  long cpus = sysconf(_SC_NPROCESSORS_ONLN);
  const char *env = getenv("KILN_NUM_THREADS");
  if (env && atoi(env) > 0) cpus = atoi(env);
  int n = cpus > 1 ? (int)cpus - 1 : 0;
  if (n > MAX_WORKERS) n = MAX_WORKERS;
  for (int i = 0; i < n; i++) {
    pthread_t th;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    if (pthread_create(&th, &attr, worker_main, NULL) == 0) pool.n_workers++;
    pthread_attr_destroy(&attr);
  }
}

int kiln_num_threads(void) {
  pthread_once(&pool_once, pool_start);
  return pool.n_workers + 1;
}

void parallel_for(int64_t n, int64_t grain, parallel_fn fn, void *ctx) {
  if (n <= 0) return;
  if (grain < 1) grain = 1;
  if (n <= grain || in_pool_task || kiln_num_threads() == 1 || pthread_mutex_trylock(&pool.busy)) {
    fn(ctx, 0, n);
    return;
  }
  int parts = pool.n_workers + 1;
  int64_t chunk = (n + parts * 4 - 1) / (parts * 4); /* a few chunks each, for balance */
  if (chunk < grain) chunk = grain;
  pool.fn = fn;
  pool.ctx = ctx;
  pool.n = n;
  pool.chunk = chunk;
  atomic_store(&pool.next, 0);
  uint64_t gen = atomic_fetch_add(&pool.generation, 1) + 1;
  atomic_store(&pool.open_gen, gen);
  if (atomic_load(&pool.sleepers) > 0) {
    pthread_mutex_lock(&pool.lock);
    pthread_cond_broadcast(&pool.wake);
    pthread_mutex_unlock(&pool.lock);
  }

  in_pool_task = true;
  run_chunks();
  in_pool_task = false;

  /* every chunk is claimed: close the job, then wait for those inside it */
  atomic_store(&pool.open_gen, 0);
  for (int i = 0; i < SPIN && atomic_load(&pool.inflight) > 0; i++) KILN_CPU_RELAX();
  if (atomic_load(&pool.inflight) > 0) {
    pthread_mutex_lock(&pool.lock);
    while (atomic_load(&pool.inflight) > 0) pthread_cond_wait(&pool.done, &pool.lock);
    pthread_mutex_unlock(&pool.lock);
  }
  pthread_mutex_unlock(&pool.busy);
}
