/* ptx_cache.c — the disk cache of generated PTX: the CPU backend's cache
 * (backends/cpu/cache.c: same directory, KILN_CACHE_DIR rules, file format
 * and trimming) holding, per CUDA program, its PTX and what emission adds to
 * the launch plan (each kernel step's launch shape and buffers), keyed by a
 * hash of the printed IR with its callees, the architecture, the LLVM
 * version and the build of the library. The plan itself is cheap and made
 * on every compile; a hit skips LLVM. An entry that does not fit the plan
 * is a miss (and is rewritten); nothing here fails a compile. PTX is code
 * that runs, so the CPU cache's rules hold through the same functions: a
 * private directory of this user's, entries read only as regular files of
 * ours (no links, no FIFOs) of a sane size, stores atomic and 0600, trimming
 * amortized. */
#include <llvm-c/Core.h>
#include <stdio.h>
#include <stdlib.h>

#include "cpu/cpu.h"
#include "cuda/ptx.h"

/* The launch fields of the kernel steps (every one in the step tree, loop
 * bodies' included, in pre-order), as int64 words: a header (magic,
 * format, steps of the tree, kernels, arena bytes, kernel records), then per
 * kernel step its number, grid[3], block[3], shared bytes, op, index buffer, index
 * count, index dim, index dtype, buffers, and per buffer kind, index, offset and
 * the plan's slot. */
enum { PLAN_MAGIC = 0x4c50434b /* "KCPL" */, PLAN_FORMAT = 3, HEAD = 6, REC = 14, BUF = 4 };

static char *cache_meta(const cuda_program *p) {
  unsigned maj, min, pat;
  LLVMGetVersion(&maj, &min, &pat);
  size_t n = 512;
  char *m = malloc(n);
  if (!m) return NULL;
  int k = snprintf(m, n,
                   "kiln cuda program 1\nllvm %u.%u.%u\ntriple nvptx64-nvidia-cuda\narch %s\nfeatures +ptx80\n%s\n"
                   "tf32 %d\nscan loops %d\narena %lld",
                   maj, min, pat, p->arch, cpu_cache_build_id(), cuda_use_tf32(), cuda_scan_loops(),
                   (long long)p->arena_bytes);
  if (k <= 0 || (size_t)k >= n) {
    free(m);
    return NULL;
  }
  return m;
}

static int64_t *plan_words(const cuda_program *p, size_t *len) {
  size_t n = HEAD;
  for (int s = 0; s < p->n_all; s++)
    if (p->all[s]->kind == CUDA_STEP_KERNEL) n += REC + BUF * (size_t)p->all[s]->n_bufs;
  int64_t *w = malloc(n * sizeof *w);
  if (!w) return NULL;
  size_t at = HEAD;
  int64_t recs = 0;
  for (int s = 0; s < p->n_all; s++) {
    const cuda_step *st = p->all[s];
    if (st->kind != CUDA_STEP_KERNEL) continue;
    int64_t r[REC] = {s,         st->grid[0],     st->grid[1],    st->grid[2],       st->block[0],
                      st->block[1], st->block[2], st->shared_bytes, st->op,          st->index_buf,
                      st->index_count, st->index_dim, st->index_dtype, st->n_bufs};
    memcpy(w + at, r, sizeof r);
    at += REC;
    for (int q = 0; q < st->n_bufs; q++) {
      w[at++] = st->bufs[q].kind;
      w[at++] = st->bufs[q].index;
      w[at++] = st->bufs[q].offset;
      w[at++] = st->bufs[q].slot;
    }
    recs++;
  }
  int64_t h[HEAD] = {PLAN_MAGIC, PLAN_FORMAT, p->n_all, p->n_kernels, (int64_t)p->arena_bytes, recs};
  memcpy(w, h, sizeof h);
  *len = n * sizeof *w;
  return w;
}

static bool in(int64_t x, int64_t lo, int64_t hi) { return x >= lo && x <= hi; }

/* Whether the words fit p's plan: the same steps, every buffer a parameter,
 * result or arena place of p or one of its rows, launch shapes a GPU takes, and an .entry in
 * the PTX for each kernel. */
static bool plan_fits(const cuda_program *p, const int64_t *w, size_t n, const char *ptx) {
  if (n < HEAD || w[0] != PLAN_MAGIC || w[1] != PLAN_FORMAT || w[2] != p->n_all || w[3] != p->n_kernels ||
      w[4] != (int64_t)p->arena_bytes)
    return false;
  size_t at = HEAD;
  int64_t recs = 0;
  for (int s = 0; s < p->n_all; s++) {
    if (p->all[s]->kind != CUDA_STEP_KERNEL) continue;
    if (at + REC > n) return false;
    const int64_t *r = w + at;
    bool ok = r[0] == s && in(r[1], 0, 0x7fffffff) && in(r[2], 0, 65535) && in(r[3], 0, 65535) &&
              in(r[4], 1, 1024) && in(r[5], 1, 1024) && in(r[6], 1, 64) && r[4] * r[5] * r[6] <= 1024 &&
              in(r[7], 0, 228 * 1024) && in(r[8], 0, OP_COUNT) && in(r[12], 0, KILN_DTYPE_COUNT - 1) &&
              in(r[13], 0, 1 << 20) && in(r[9], -1, r[13] - 1) && r[10] >= 0 && r[11] >= 0;
    if (!ok || at + REC + BUF * (size_t)r[13] > n) return false;
    for (int64_t q = 0; q < r[13]; q++) {
      const int64_t *b = r + REC + BUF * q;
      ok = ok && in(b[3], 0, p->n_slots - 1);
      if (b[0] == CUDA_REF_PARAM)
        ok = ok && in(b[1], 0, p->n_params - 1);
      else if (b[0] == CUDA_REF_RESULT)
        ok = ok && in(b[1], 0, p->n_results - 1);
      else if (b[0] == CUDA_REF_ARENA)
        ok = ok && in(b[2], 0, (int64_t)p->arena_bytes);
      else if (b[0] == CUDA_REF_ROW)
        ok = ok && in(b[1], 0, p->n_slots - 1) && p->slots[b[1]].kind == PLAN_SLOT_ROW;
      else
        ok = false;
    }
    char entry[48];
    snprintf(entry, sizeof entry, ".entry kernel%d(", s);
    if (!ok || !strstr(ptx, entry)) return false;
    at += REC + BUF * (size_t)r[13];
    recs++;
  }
  return at == n && recs == w[5];
}

/* Takes the words into p's kernel steps (they fit). 0, or -1 out of memory
 * with p untouched. */
static int take_plan(cuda_program *p, const int64_t *w) {
  cuda_ref **all = calloc((size_t)p->n_all + 1, sizeof *all);
  bool ok = all != NULL;
  size_t at = HEAD;
  for (int s = 0; ok && s < p->n_all; s++) {
    if (p->all[s]->kind != CUDA_STEP_KERNEL) continue;
    const int64_t *r = w + at;
    if (!(all[s] = calloc((size_t)r[13] + 1, sizeof **all))) ok = false;
    for (int64_t q = 0; ok && q < r[13]; q++) {
      const int64_t *b = r + REC + BUF * q;
      all[s][q] = (cuda_ref){(int)b[0], (int)b[1], b[2], NULL, (int)b[3]};
    }
    at += REC + BUF * (size_t)r[13];
  }
  at = HEAD;
  for (int s = 0; ok && s < p->n_all; s++) {
    cuda_step *st = p->all[s];
    if (st->kind != CUDA_STEP_KERNEL) continue;
    const int64_t *r = w + at;
    free(st->bufs);
    st->bufs = all[s];
    all[s] = NULL;
    st->n_bufs = (int)r[13];
    snprintf(st->name, sizeof st->name, "kernel%d", s);
    for (int d = 0; d < 3; d++) st->grid[d] = (unsigned)r[1 + d], st->block[d] = (unsigned)r[4 + d];
    st->shared_bytes = (unsigned)r[7];
    st->op = (op_id)r[8];
    st->index_buf = (int)r[9];
    st->index_count = r[10];
    st->index_dim = r[11];
    st->index_dtype = (kiln_dtype)r[12];
    at += REC + BUF * (size_t)r[13];
  }
  for (int s = 0; all && s < p->n_all; s++) free(all[s]);
  free(all);
  return ok ? 0 : -1;
}

int cuda_cache_get(const ir_func *f, cuda_program *p, cuda_cache_ref *ref) {
  memset(ref, 0, sizeof *ref);
  if (!cpu_cache_dir(ref->dir, sizeof ref->dir)) return 0;
  if (!(ref->meta = cache_meta(p)) || cpu_cache_key(f, ref->meta, ref->key)) {
    cuda_cache_ref_free(ref);
    return 0;
  }
  ref->on = true;
  cpu_cache_entry e;
  if (cpu_cache_load(ref->dir, ref->key, ref->meta, &e) != 1) return 0;
  int hit = 0;
  size_t nw = e.bc_len / sizeof(int64_t);
  int64_t *w = e.bc_len % sizeof(int64_t) == 0 ? malloc(e.bc_len) : NULL;
  char *ptx = malloc(e.obj_len + 1);
  if (w && ptx) {
    memcpy(w, e.bc, e.bc_len);
    memcpy(ptx, e.obj, e.obj_len);
    ptx[e.obj_len] = 0;
    if (strlen(ptx) == e.obj_len && plan_fits(p, w, nw, ptx) && !take_plan(p, w)) {
      p->ptx = ptx, ptx = NULL;
      hit = 1;
    }
  }
  if (!hit && cpu_cache_log())
    fprintf(stderr, "kiln: cache: @%s: a cached PTX entry does not fit the plan; recompiling\n", p->name);
  free(w);
  free(ptx);
  cpu_cache_entry_free(&e);
  return hit;
}

void cuda_cache_put(const cuda_cache_ref *ref, const cuda_program *p) {
  if (!ref->on || !p->ptx) return;
  size_t len = 0;
  int64_t *w = plan_words(p, &len);
  if (!w) return;
  /* the entry's parts: no kernel info, the PTX as the code, the launch
   * fields as the second part */
  cpu_cache_entry e = {.info = NULL, .info_len = 0, .obj = p->ptx, .obj_len = strlen(p->ptx), .bc = w, .bc_len = len};
  cpu_cache_store(ref->dir, ref->key, ref->meta, &e);
  free(w);
}

void cuda_cache_ref_free(cuda_cache_ref *ref) {
  free(ref->meta);
  ref->meta = NULL;
  ref->on = false;
}
