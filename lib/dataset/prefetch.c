/* prefetch.c — kiln_dataset_prefetch: a thread pulls from upstream into a
 * ring of depth elements while the caller works; next takes from the ring.
 * Results come in upstream's order, errors included (each carries its
 * message across: kiln_last_error is per thread) and the end last.
 *
 * The thread starts at the first next and runs until upstream's end; a
 * reset or free stops it sooner: the flag `stop` under the lock wakes it
 * from a full ring, and it finishes the element it is making (upstream is
 * never left mid-call), then is joined.
 *
 * Keeping the ring full should cost the consumer little: waking a thread
 * asleep on a condition is a futex syscall that, on a virtual machine
 * whose other vCPU is halted, sends an interrupt through the hypervisor
 * (35-50 us per next measured on this project's 2-vCPU machines, as long
 * as making a batch of 64). So next wakes the thread only when the ring
 * has drained below half, and the thread then refills it in one burst: one
 * wake per depth/2 elements, not one per element. (A thread napping on a
 * timer instead never costs the consumer a wake, but its wake-ups land in
 * the middle of the step's kernels: slower with 2 pool threads.) No
 * element is ever waited for in vain: the count passes below half before
 * it reaches 0. */
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>

#include "dataset.h"

typedef struct {
  int rc;      /* 1 an element, 0 the end, -1 an error */
  char *error; /* rc -1: the message (malloc'd) */
} slot;

typedef struct {
  kiln_dataset base;
  int depth;
  slot *ring;
  ds_part *parts; /* depth elements of arity parts, beside ring */
  int head, count;
  pthread_mutex_t mu;
  pthread_cond_t filled, drained;
  pthread_t thread;
  bool running; /* a thread was started and not yet joined */
  bool stop;    /* asks the thread to finish */
  bool ended;   /* the consumer took the end */
  char device[32]; /* the consumer's device scope, for the thread */
} prefetch;

static void *produce(void *arg) {
  prefetch *p = arg;
  kiln_dataset *ds = &p->base;
  int a = ds->arity;
  bool pushed = strcmp(p->device, "cpu:0") && !kiln_device_push(p->device);
#ifdef SCHED_BATCH
  /* Linux: a woken producer does not preempt the consumer (the step it
   * should hide behind); it runs on idle time, as a background job */
  pthread_setschedparam(pthread_self(), SCHED_BATCH, &(struct sched_param){0});
#endif
  ds_part *tmp = ds->up->scratch; /* upstream's own next slot: unused while it is ours */
  pthread_mutex_lock(&p->mu);
  while (!p->stop) {
    while (p->count == p->depth && !p->stop) pthread_cond_wait(&p->drained, &p->mu);
    if (p->stop) break;
    pthread_mutex_unlock(&p->mu);
    kiln_clear_error();
    int rc = ds_next(ds->up, tmp);
    /* NULL for an error when out of memory: the consumer says so itself */
    char *error = rc < 0 ? strdup(kiln_last_error()[0] ? kiln_last_error() : "kiln_dataset_next: failed") : NULL;
    pthread_mutex_lock(&p->mu);
    if (p->stop) { /* nobody will take it */
      if (rc == 1) parts_release(a, tmp);
      free(error);
      break;
    }
    int at = (p->head + p->count) % p->depth;
    p->ring[at] = (slot){rc, error};
    if (rc == 1) memcpy(p->parts + at * a, tmp, (size_t)a * sizeof *tmp);
    p->count++;
    pthread_cond_signal(&p->filled);
    if (rc == 0) break;
  }
  pthread_mutex_unlock(&p->mu);
  if (pushed) kiln_device_pop();
  return NULL;
}

/* stops and joins the thread, and drops what the ring holds */
static void halt(prefetch *p) {
  if (p->running) {
    pthread_mutex_lock(&p->mu);
    p->stop = true;
    pthread_cond_broadcast(&p->drained);
    pthread_mutex_unlock(&p->mu);
    pthread_join(p->thread, NULL);
    p->running = false;
    p->stop = false;
  }
  for (; p->count; p->count--, p->head = (p->head + 1) % p->depth) {
    slot *s = &p->ring[p->head];
    if (s->rc == 1) parts_release(p->base.arity, p->parts + p->head * p->base.arity);
    free(s->error);
    s->error = NULL;
  }
  p->head = 0;
}

static int prefetch_next(kiln_dataset *ds, ds_part *out) {
  prefetch *p = (prefetch *)ds;
  if (p->ended) return 0;
  if (!p->running) {
    snprintf(p->device, sizeof p->device, "%s", kiln_device_current());
    int err = pthread_create(&p->thread, NULL, produce, p);
    if (err) return kiln_set_error("kiln_dataset_next: prefetch: cannot start its thread (%s)", strerror(err));
    p->running = true;
  }
  pthread_mutex_lock(&p->mu);
  while (!p->count) pthread_cond_wait(&p->filled, &p->mu);
  slot s = p->ring[p->head];
  if (s.rc == 1) memcpy(out, p->parts + p->head * ds->arity, (size_t)ds->arity * sizeof *out);
  p->ring[p->head].error = NULL;
  p->head = (p->head + 1) % p->depth;
  p->count--;
  if (p->count < (p->depth + 1) / 2) pthread_cond_signal(&p->drained); /* below half: refill */
  pthread_mutex_unlock(&p->mu);
  if (s.rc == 0) {
    p->ended = true;
    halt(p); /* the thread has finished: join it now */
    return 0;
  }
  if (s.rc < 0) {
    if (!s.error) return kiln_set_error("kiln_dataset_next: prefetch: out of memory for an error message");
    kiln_set_error("%s", s.error);
    free(s.error);
    return -1;
  }
  return 1;
}

static void prefetch_reset(kiln_dataset *ds) {
  prefetch *p = (prefetch *)ds;
  halt(p);
  p->ended = false;
  ds->up->ops->reset(ds->up);
}

static void prefetch_release(kiln_dataset *ds) {
  prefetch *p = (prefetch *)ds;
  if (!p->ring) return; /* never fully made */
  halt(p);
  pthread_mutex_destroy(&p->mu);
  pthread_cond_destroy(&p->filled);
  pthread_cond_destroy(&p->drained);
  free(p->ring);
  free(p->parts);
}

static const ds_ops prefetch_ops = {prefetch_next, prefetch_reset, prefetch_release};

kiln_dataset *kiln_dataset_prefetch(kiln_dataset *up, int depth) {
  const char *who = "kiln_dataset_prefetch";
  if (!ds_input_ok(who, up)) return NULL;
  if (depth <= 0 || depth > (1 << 20)) {
    kiln_set_error("%s: depth = %d; in [1, %d]", who, depth, 1 << 20);
    return NULL;
  }
  prefetch *p = (prefetch *)ds_new(who, &prefetch_ops, sizeof(prefetch), up, up->arity);
  if (!p) return NULL;
  p->depth = depth;
  slot *ring = calloc((size_t)depth, sizeof *ring);
  p->parts = calloc((size_t)depth * (size_t)up->arity, sizeof *p->parts);
  if (!ring || !p->parts || pthread_mutex_init(&p->mu, NULL)) {
    free(ring);
    free(p->parts);
    kiln_set_error("%s: out of memory", who);
    ds_discard(&p->base);
    return NULL;
  }
  pthread_cond_init(&p->filled, NULL);
  pthread_cond_init(&p->drained, NULL);
  p->ring = ring;
  return ds_adopt(&p->base);
}
