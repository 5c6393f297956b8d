/* conv_cache.c — the packed filters of eager convolutions, kept for the
 * next call on the same filter. conv_direct packs its filter into the
 * micro-kernel's panels on every call; an eager network calls each conv on
 * the same weight tensor step after step (ResNet-50's eager inference spent
 * 4.5% of a step re-packing them), as oneDNN's primitive cache keeps
 * reordered weights. Compiled code's convolutions whose filter is a
 * parameter of the program (a variable's value, a capture, an input) key
 * on that tensor too (backends/cpu/run.c), except one the call writes over
 * in place: its serial is the new value's before the old bytes are read.
 *
 * An entry is keyed on the filter tensor's serial (runtime.h: distinct for
 * every tensor made and renewed by a donation's write over its data), never
 * on its address alone, and on the layout (the shape and the taps read).
 * The serial makes a stale hit impossible: tensors are immutable, so the
 * same serial means the same bytes. Nothing is retained: an entry whose
 * filter died just stops matching and ages out.
 *
 * The first packing of a key only leaves a note; the second keeps the
 * panels. A training step's filters are new tensors every step and packed
 * once per layout, so they are never kept. Bounded: CACHE_ENTRIES keys and
 * CACHE_BYTES of panels; notes go out before packings, each the least
 * recently used first; an entry in use is pinned. */
#include <pthread.h>

#include "conv.h"

enum { CACHE_ENTRIES = 128 };
#define CACHE_BYTES ((size_t)256 << 20)

typedef struct {
  uint64_t serial;
  const void *f;
  int64_t dt, nr, kh, kw, c, o, flip, fkh, fkw, fy0, fx0, fys, fxs;
} pack_key;

typedef struct {
  pack_key key;
  bool used;    /* holds a key */
  bool ready;   /* panels hold the packed filter */
  int pins;     /* calls reading (or filling) panels */
  uint64_t last; /* tick of the last use */
  void *panels; /* NULL for a note */
  int32_t cls;
  size_t bytes;
} entry;

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static entry table[CACHE_ENTRIES];
static size_t held; /* bytes of panels */
static uint64_t tick;
static int64_t hits, fills;

static pack_key key_of(const kiln_tensor *owner, const void *f, const conv_shape *s, kiln_dtype dt, int64_t nr) {
  pack_key k;
  memset(&k, 0, sizeof k); /* compared with memcmp */
  k.serial = owner->serial, k.f = f, k.dt = dt, k.nr = nr;
  k.kh = s->kh, k.kw = s->kw, k.c = s->c, k.o = s->o, k.flip = s->flip;
  k.fkh = s->fkh, k.fkw = s->fkw, k.fy0 = s->fy0, k.fx0 = s->fx0, k.fys = s->fys, k.fxs = s->fxs;
  return k;
}

static void drop(entry *e) {
  if (e->panels) mem_free(e->panels, e->cls);
  held -= e->bytes;
  memset(e, 0, sizeof *e);
}

/* The entry to give up, or NULL: for bytes (want_bytes), the least
 * recently used unpinned one with panels; for a key, a free one, else the
 * least recently used note, else the least recently used unpinned one with
 * panels. Notes go first: a training step leaves a note for every filter
 * it packs (new tensors every step), and those must not push out the
 * packings an evaluation between steps keeps. Under mu. */
static entry *victim(bool want_bytes) {
  entry *note = NULL, *kept = NULL;
  for (int i = 0; i < CACHE_ENTRIES; i++) {
    entry *e = &table[i];
    if (!e->used) {
      if (!want_bytes) return e;
      continue;
    }
    if (e->pins) continue;
    entry **v = e->panels ? &kept : &note;
    if (!*v || e->last < (*v)->last) *v = e;
  }
  return want_bytes ? kept : note ? note : kept;
}

const void *conv_cache_find(const kiln_tensor *owner, const void *f, const conv_shape *s, kiln_dtype dt, int64_t nr,
                            size_t bytes, conv_cache_pin *pin) {
  pin->e = NULL, pin->fill = NULL;
  /* a view's bytes are its base's (a variable's value is read as a new
   * view each time), immutable while the view retains the base */
  if (owner && owner->base) owner = owner->base;
  if (!owner || !owner->serial || bytes > CACHE_BYTES / 4) return NULL; /* serial 0: a header over a buffer */
  pack_key k = key_of(owner, f, s, dt, nr);
  pthread_mutex_lock(&mu);
  tick++;
  entry *e = NULL;
  for (int i = 0; i < CACHE_ENTRIES && !e; i++)
    if (table[i].used && table[i].key.serial == k.serial && !memcmp(&table[i].key, &k, sizeof k)) e = &table[i];
  const void *found = NULL;
  if (e && e->ready) { /* a hit */
    e->pins++, e->last = tick, hits++;
    pin->e = e, found = e->panels;
  } else if (e && !e->pins) { /* the second packing: keep it */
    while (held + bytes > CACHE_BYTES) {
      entry *v = victim(true);
      if (!v) break;
      drop(v);
    }
    if (held + bytes <= CACHE_BYTES && (e->panels = mem_alloc(bytes, &e->cls))) {
      e->bytes = bytes, held += bytes;
      e->pins = 1, e->last = tick, fills++;
      pin->e = e, pin->fill = e->panels;
    }
  } else if (!e) { /* the first: a note */
    entry *v = victim(false);
    if (v) {
      if (v->used) drop(v);
      v->key = k, v->used = true, v->last = tick;
    }
  }
  pthread_mutex_unlock(&mu);
  return found;
}

void conv_cache_unpin(conv_cache_pin *pin) {
  entry *e = pin->e;
  if (!e) return;
  pthread_mutex_lock(&mu);
  if (pin->fill) e->ready = true;
  e->pins--;
  pthread_mutex_unlock(&mu);
  pin->e = NULL, pin->fill = NULL;
}

void conv_cache_discard(conv_cache_pin *pin) {
  entry *e = pin->e;
  if (!e) return;
  pthread_mutex_lock(&mu);
  e->pins--;
  if (pin->fill) { /* never packed: back to a note */
    mem_free(e->panels, e->cls);
    held -= e->bytes;
    e->panels = NULL, e->bytes = 0;
  }
  pthread_mutex_unlock(&mu);
  pin->e = NULL, pin->fill = NULL;
}

void conv_cache_stats(int64_t *entries, int64_t *bytes, int64_t *n_hits, int64_t *n_fills) {
  pthread_mutex_lock(&mu);
  int64_t n = 0;
  for (int i = 0; i < CACHE_ENTRIES; i++) n += table[i].panels != NULL;
  *entries = n, *bytes = (int64_t)held, *n_hits = hits, *n_fills = fills;
  pthread_mutex_unlock(&mu);
}

void conv_cache_clear(void) {
  pthread_mutex_lock(&mu);
  for (int i = 0; i < CACHE_ENTRIES; i++)
    if (table[i].used && !table[i].pins) drop(&table[i]);
  pthread_mutex_unlock(&mu);
}
