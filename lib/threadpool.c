/* threadpool.c — a small pool for splitting large eager kernels. Workers
 * sleep on a condition variable; a job is a range that the caller and the
 * workers claim in chunks through an atomic counter. One job at a time: a
 * second caller (another thread, or a kernel inside a job) runs serially. */
#include <pthread.h>
#include <stdlib.h>
#include <unistd.h>

#include "runtime.h"

enum { MAX_WORKERS = 63 };

typedef struct {
  pthread_mutex_t lock;       /* guards job fields and generation */
  pthread_cond_t wake, done;
  pthread_mutex_t busy;       /* held by the caller that owns the pool */
  int n_workers;
  uint64_t generation;        /* bumped per job */
  parallel_fn fn;
  void *ctx;
  int64_t n, chunk;
  atomic_llong next;          /* next unclaimed index */
  int active;                 /* workers still in the current job */
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
  pthread_mutex_lock(&pool.lock);
  for (;;) {
    while (pool.generation == seen) pthread_cond_wait(&pool.wake, &pool.lock);
    seen = pool.generation;
    pthread_mutex_unlock(&pool.lock);
    run_chunks();
    pthread_mutex_lock(&pool.lock);
    if (--pool.active == 0) pthread_cond_signal(&pool.done);
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
  pthread_mutex_lock(&pool.lock);
  pool.fn = fn;
  pool.ctx = ctx;
  pool.n = n;
  pool.chunk = chunk;
  atomic_store(&pool.next, 0);
  pool.active = pool.n_workers;
  pool.generation++;
  pthread_cond_broadcast(&pool.wake);
  pthread_mutex_unlock(&pool.lock);

  in_pool_task = true;
  run_chunks();
  in_pool_task = false;

  pthread_mutex_lock(&pool.lock);
  while (pool.active > 0) pthread_cond_wait(&pool.done, &pool.lock);
  pthread_mutex_unlock(&pool.lock);
  pthread_mutex_unlock(&pool.busy);
}
