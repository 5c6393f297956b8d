/* ptx.c — from an IR function to PTX and a launch plan. The plan is the
 * shared one (backends/plan) under the CUDA policy (plan.c): every value
 * gets a place (parameter, result, arena offset, constant, or the place of
 * the value a view reads) and every instruction a step. Fusion groups and
 * elementwise ops become grid-stride kernels whose element is emitted by the shared emitter
 * (backends/llvm); reductions run a thread, a warp or a block per output row
 * (warp shuffles and shared memory), and reductions over leading axes with
 * few outputs a block per tile of columns and range of rows (a shared-memory
 * tree), their partials summed by a second kernel; dot is a shared-memory
 * tiled kernel with 4x4 register blocking (or, with KILN_CUDA_TF32=1, f32
 * on TF32 tensor cores); argmax, concat, gather and scatter_add have
 * kernels of their own, and so have the window ops (conv2d, pooling and
 * their gradients: ptx_window.c, through the helpers compile.h shares); a
 * scan whose body is elementwise is one kernel looping over t on the device
 * (ptx_scan.c). Index checks raise an error word in device memory
 * that the host turns into the eager message. The module is optimised with
 * O3 for nvptx64-nvidia-cuda and printed as PTX, which the disk cache keeps
 * (ptx_cache.c): a process compiling IR another one compiled skips LLVM. */
#include <llvm-c/Analysis.h>
#include <llvm-c/Core.h>
#include <llvm-c/ExecutionEngine.h>
#include <llvm-c/Target.h>
#include <llvm-c/TargetMachine.h>
#include <llvm-c/Transforms/PassBuilder.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "cpu/cpu.h"
#include "cuda/compile.h"

enum {
  THREADS = 256,     /* threads per block of every kernel */
  MAX_BLOCKS = 8192, /* grid-stride kernels launch at most this many blocks */
  WARP = 32,
  BLOCK_ROW = 2048, /* reduction length from which a block reduces one row */
  TILE_M = 64,
  TILE_N = 64,
  TILE_K = 16, /* dot: a block's tile of C and the k step */
  REG_M = 4,
  REG_N = 4, /* dot: a thread's outputs (16 x 16 threads) */
  MAX_GRID_YZ = 65535,
};
#define SHARED_AS 3
#define GLOBAL_AS 1

/* ---- the NVPTX target ---- */

static pthread_once_t nvptx_once = PTHREAD_ONCE_INIT;
static LLVMTargetRef nvptx_target;
static char nvptx_error[256];

static void nvptx_init(void) {
  LLVMInitializeNVPTXTargetInfo();
  LLVMInitializeNVPTXTarget();
  LLVMInitializeNVPTXTargetMC();
  LLVMInitializeNVPTXAsmPrinter();
  char *msg = NULL;
  if (LLVMGetTargetFromTriple("nvptx64-nvidia-cuda", &nvptx_target, &msg)) {
    snprintf(nvptx_error, sizeof nvptx_error, "no NVPTX target in this LLVM: %s", msg ? msg : "");
    nvptx_target = NULL;
  }
  if (msg) LLVMDisposeMessage(msg);
}

static LLVMTargetMachineRef nvptx_machine(const char *arch) {
  pthread_once(&nvptx_once, nvptx_init);
  if (!nvptx_target) return kiln_set_error("cuda: %s", nvptx_error), NULL;
  LLVMTargetMachineRef tm = LLVMCreateTargetMachine(nvptx_target, "nvptx64-nvidia-cuda", arch, "+ptx80",
                                                    LLVMCodeGenLevelAggressive, LLVMRelocDefault, LLVMCodeModelDefault);
  if (!tm) kiln_set_error("cuda: cannot create an NVPTX target machine for %s", arch);
  return tm;
}

static double now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec * 1e-6;
}

/* ---- emission helpers ---- */

static LLVMValueRef call0(llvm_emit *e, const char *name) {
  LLVMTypeRef ft;
  LLVMValueRef fn = llvm_intrinsic(e, name, NULL, 0, &ft);
  return llvm_call(e, fn, ft, NULL, 0);
}

static LLVMValueRef sreg(llvm_emit *e, const char *name) {
  char full[64];
  snprintf(full, sizeof full, "llvm.nvvm.read.ptx.sreg.%s", name);
  return call0(e, full);
}

static void barrier(llvm_emit *e) { call0(e, "llvm.nvvm.barrier0"); }

/* x exchanged with lane ^ mask (all 32 lanes take part); any type of 32 or
 * 64 bits */
static LLVMValueRef shfl_xor(llvm_emit *e, LLVMValueRef x, int mask) {
  LLVMBuilderRef b = e->b;
  LLVMTypeRef t = LLVMTypeOf(x), ft;
  LLVMValueRef fn = llvm_intrinsic(e, "llvm.nvvm.shfl.sync.bfly.i32", NULL, 0, &ft);
  unsigned bits = LLVMGetTypeKind(t) == LLVMDoubleTypeKind  ? 64
                  : LLVMGetTypeKind(t) == LLVMFloatTypeKind ? 32
                                                            : LLVMGetIntTypeWidth(t);
  LLVMValueRef all = llvm_i32(e, -1), lane = llvm_i32(e, mask), clamp = llvm_i32(e, 0x1f);
  if (bits == 32) {
    LLVMValueRef i = LLVMBuildBitCast(b, x, e->t_i32, "");
    LLVMValueRef args[4] = {all, i, lane, clamp};
    return LLVMBuildBitCast(b, llvm_call(e, fn, ft, args, 4), t, "");
  }
  LLVMValueRef i = LLVMBuildBitCast(b, x, e->t_i64, "");
  LLVMValueRef lo = LLVMBuildTrunc(b, i, e->t_i32, "");
  LLVMValueRef hi = LLVMBuildTrunc(b, LLVMBuildLShr(b, i, llvm_i64(e, 32), ""), e->t_i32, "");
  LLVMValueRef a1[4] = {all, lo, lane, clamp}, a2[4] = {all, hi, lane, clamp};
  lo = LLVMBuildZExt(b, llvm_call(e, fn, ft, a1, 4), e->t_i64, "");
  hi = LLVMBuildZExt(b, llvm_call(e, fn, ft, a2, 4), e->t_i64, "");
  LLVMValueRef r = LLVMBuildOr(b, lo, LLVMBuildShl(b, hi, llvm_i64(e, 32), ""), "");
  return LLVMBuildBitCast(b, r, t, "");
}

static LLVMValueRef sloop_begin(llvm_emit *e, sloop *l, LLVMValueRef lo, LLVMValueRef hi, LLVMValueRef step,
                                const char *name) {
  LLVMBasicBlockRef pre = LLVMGetInsertBlock(e->b);
  LLVMValueRef fn = LLVMGetBasicBlockParent(pre);
  l->head = LLVMAppendBasicBlockInContext(e->ctx, fn, name);
  l->body = LLVMAppendBasicBlockInContext(e->ctx, fn, name);
  l->exit = LLVMAppendBasicBlockInContext(e->ctx, fn, name);
  l->step = step;
  LLVMBuildBr(e->b, l->head);
  LLVMPositionBuilderAtEnd(e->b, l->head);
  l->iv = LLVMBuildPhi(e->b, LLVMTypeOf(lo), name);
  LLVMAddIncoming(l->iv, &lo, &pre, 1);
  LLVMBuildCondBr(e->b, LLVMBuildICmp(e->b, LLVMIntSLT, l->iv, hi, ""), l->body, l->exit);
  LLVMPositionBuilderAtEnd(e->b, l->body);
  return l->iv;
}

static void sloop_end(llvm_emit *e, sloop *l) {
  LLVMValueRef next = LLVMBuildAdd(e->b, l->iv, l->step, "");
  LLVMSetNUW(next, 1);
  LLVMSetNSW(next, 1);
  LLVMBasicBlockRef latch = LLVMGetInsertBlock(e->b);
  LLVMAddIncoming(l->iv, &next, &latch, 1);
  LLVMBuildBr(e->b, l->head);
  LLVMPositionBuilderAtEnd(e->b, l->exit);
}

static LLVMValueRef zext64(llvm_emit *e, LLVMValueRef x) {
  if (LLVMTypeOf(x) == e->t_i64) return x;
  LLVMValueRef r = LLVMBuildZExt(e->b, x, e->t_i64, "");
  if (LLVMIsAInstruction(r)) LLVMSetNNeg(r, 1);
  return r;
}

/* The index type of a loop over n items: i32 while every index and index
 * plus the grid's stride fit, else i64. */
static LLVMTypeRef index_type(llvm_emit *e, int64_t n) { return n < ((int64_t)1 << 30) ? e->t_i32 : e->t_i64; }

/* Grid-stride loop over [0, n) with `unit` threads per item: the global
 * thread (or warp, unit 32) id, stepping by all of them. Returns the i64 item. */
static LLVMValueRef grid_loop_begin(llvm_emit *e, sloop *l, int64_t n, int unit) {
  LLVMTypeRef it = index_type(e, n);
  LLVMBuilderRef b = e->b;
  LLVMValueRef tid = sreg(e, "tid.x"), ctaid = sreg(e, "ctaid.x"), ntid = sreg(e, "ntid.x"),
               nctaid = sreg(e, "nctaid.x");
  LLVMValueRef gid =
      LLVMBuildAdd(b, LLVMBuildMul(b, LLVMBuildZExt(b, ctaid, it, ""), LLVMBuildZExt(b, ntid, it, ""), ""),
                   LLVMBuildZExt(b, tid, it, ""), "");
  LLVMValueRef all = LLVMBuildMul(b, LLVMBuildZExt(b, nctaid, it, ""), LLVMBuildZExt(b, ntid, it, ""), "");
  if (unit > 1) {
    gid = LLVMBuildUDiv(b, gid, llvm_const_i(it, unit), "");
    all = LLVMBuildUDiv(b, all, llvm_const_i(it, unit), "");
  }
  return zext64(e, sloop_begin(e, l, gid, llvm_const_i(it, n), all, "i"));
}

static void launch_1d(cuda_step *st, int64_t items, int per_block) {
  int64_t blocks = (items + per_block - 1) / per_block;
  if (blocks > MAX_BLOCKS) blocks = MAX_BLOCKS;
  st->grid[0] = (unsigned)blocks, st->grid[1] = st->grid[2] = 1;
  st->block[0] = THREADS, st->block[1] = st->block[2] = 1;
}

LLVMValueRef cuda_grid_loop_begin(llvm_emit *e, sloop *l, int64_t n) { return grid_loop_begin(e, l, n, 1); }
void cuda_grid_loop_end(llvm_emit *e, sloop *l) { sloop_end(e, l); }
void cuda_launch_1d(cuda_step *st, int64_t items) { launch_1d(st, items, THREADS); }

/* A constant tensor's data as a global of the module (the emitter's
 * const_data hook): one per tensor, in the global address space. */
static LLVMValueRef const_data(void *user, const kiln_tensor *t) {
  cuda_build *cb = user;
  llvm_emit *e = &cb->e;
  for (int i = 0; i < cb->n_cst; i++)
    if (cb->cst_t[i] == t) return cb->cst_g[i];
  const kiln_tensor **qt = realloc(cb->cst_t, (size_t)(cb->n_cst + 1) * sizeof *qt);
  if (qt) cb->cst_t = qt;
  LLVMValueRef *qg = realloc(cb->cst_g, (size_t)(cb->n_cst + 1) * sizeof *qg);
  if (qg) cb->cst_g = qg;
  if (!qt || !qg) return NULL;
  size_t bytes = (size_t)t->size * kiln_dtype_sizes[t->dtype];
  LLVMValueRef init =
      LLVMConstStringInContext(e->ctx, bytes ? (const char *)t->data : "", (unsigned)(bytes ? bytes : 1), 1);
  char name[32];
  snprintf(name, sizeof name, "const%d", cb->n_cst);
  LLVMValueRef g = LLVMAddGlobalInAddressSpace(e->mod, LLVMTypeOf(init), name, GLOBAL_AS);
  LLVMSetInitializer(g, init);
  LLVMSetGlobalConstant(g, 1);
  LLVMSetLinkage(g, LLVMInternalLinkage);
  LLVMSetAlignment(g, 16);
  LLVMValueRef p = LLVMConstAddrSpaceCast(g, e->t_ptr);
  cb->cst_t[cb->n_cst] = t;
  cb->cst_g[cb->n_cst++] = p;
  return p;
}

/* shared memory of n elements of type t, for one kernel */
static LLVMValueRef shared_array(llvm_emit *e, const char *kname, const char *what, LLVMTypeRef t, int64_t n) {
  char name[64];
  snprintf(name, sizeof name, "%s.%s", kname, what);
  LLVMTypeRef at = LLVMArrayType2(t, (uint64_t)n);
  LLVMValueRef g = LLVMAddGlobalInAddressSpace(e->mod, at, name, SHARED_AS);
  LLVMSetInitializer(g, LLVMGetUndef(at));
  LLVMSetLinkage(g, LLVMInternalLinkage);
  LLVMSetAlignment(g, 16);
  return g;
}

static LLVMValueRef shared_gep(llvm_emit *e, LLVMTypeRef t, LLVMValueRef arr, LLVMValueRef i) {
  return LLVMBuildGEP2(e->b, t, arr, &i, 1, "");
}

static void flush_bad(llvm_emit *e, llvm_group *lg, LLVMValueRef bad_slot) {
  if (!lg->bad) return;
  LLVMValueRef old = LLVMBuildLoad2(e->b, e->t_i1, bad_slot, "");
  LLVMBuildStore(e->b, LLVMBuildOr(e->b, old, lg->bad, ""), bad_slot);
  lg->bad = NULL;
}

static void add_annotation(llvm_emit *e, LLVMValueRef fn, const char *key, int value) {
  LLVMMetadataRef md[3] = {LLVMValueAsMetadata(fn), LLVMMDStringInContext2(e->ctx, key, strlen(key)),
                           LLVMValueAsMetadata(llvm_i32(e, value))};
  LLVMAddNamedMetadataOperand(e->mod, "nvvm.annotations",
                              LLVMMetadataAsValue(e->ctx, LLVMMDNodeInContext2(e->ctx, md, 3)));
}

/* The kernel's function: a pointer per output, then per distinct buffer it
 * reads (constants are module globals, not parameters), then the error word. */
static int kernel_begin(kctx *k) {
  cuda_build *cb = k->cb;
  const plan_kernel *g = k->g;
  llvm_emit *e = &cb->e;
  const ir_func *f = g->f;
  int *ref_slot = malloc(((size_t)g->n_out + (size_t)f->n_values + 1) * sizeof *ref_slot);
  k->buf = calloc((size_t)f->n_values + 1, sizeof *k->buf);
  k->outp = calloc((size_t)g->n_out + 1, sizeof *k->outp);
  if (!ref_slot || !k->buf || !k->outp) {
    free(ref_slot);
    return cuda_oom();
  }
  int nb = 0;
  for (int o = 0; o < g->n_out; o++) ref_slot[nb++] = g->out_slot[o];
  for (int v = 0; v < f->n_values; v++) {
    int s = g->leaf[v];
    if (s < 0 || cb->pl.slots[s].kind == PLAN_SLOT_CONST) continue;
    bool seen = false;
    for (int q = 0; q < nb && !seen; q++) seen = ref_slot[q] == s;
    if (!seen) ref_slot[nb++] = s;
  }
  cuda_step *st = k->st;
  free(st->bufs);
  st->bufs = calloc((size_t)nb + 1, sizeof *st->bufs);
  LLVMTypeRef *params = malloc(((size_t)nb + 2) * sizeof *params);
  if (!st->bufs || !params) {
    free(params);
    free(ref_slot);
    return cuda_oom();
  }
  st->n_bufs = nb;
  for (int q = 0; q < nb; q++) st->bufs[q] = cuda_slot_ref(&cb->pl, ref_slot[q]), params[q] = e->t_ptr;
  params[nb] = e->t_ptr;
  LLVMTypeRef ft = LLVMFunctionType(e->t_void, params, (unsigned)nb + 1, 0);
  free(params);
  snprintf(k->name, sizeof k->name, "kernel%d", k->step_no);
  snprintf(st->name, sizeof st->name, "%s", k->name);
  k->fn = LLVMAddFunction(e->mod, k->name, ft);
  LLVMSetFunctionCallConv(k->fn, LLVMPTXKernelCallConv);
  add_annotation(e, k->fn, "kernel", 1);
  add_annotation(e, k->fn, "maxntidx", THREADS);
  unsigned noalias = LLVMGetEnumAttributeKindForName("noalias", 7);
  unsigned align = LLVMGetEnumAttributeKindForName("align", 5);
  unsigned nounwind = LLVMGetEnumAttributeKindForName("nounwind", 8);
  LLVMAddAttributeAtIndex(k->fn, LLVMAttributeFunctionIndex, LLVMCreateEnumAttribute(e->ctx, nounwind, 0));
  for (int q = 0; q < nb; q++) {
    /* noalias unless the buffers pass put an output over an input that dies
     * here (arena bytes; a row counts as arena: its base may be) */
    bool alone = true;
    for (int r = 0; r < nb && alone; r++) {
      if (r == q || (r >= g->n_out && q >= g->n_out)) continue;
      const cuda_ref *x = &st->bufs[q], *y = &st->bufs[r];
      alone = !((x->kind == CUDA_REF_ARENA || x->kind == CUDA_REF_ROW) &&
                (y->kind == CUDA_REF_ARENA || y->kind == CUDA_REF_ROW));
    }
    if (alone) LLVMAddAttributeAtIndex(k->fn, (unsigned)q + 1, LLVMCreateEnumAttribute(e->ctx, noalias, 0));
    /* a row is aligned as its row size allows */
    LLVMAddAttributeAtIndex(k->fn, (unsigned)q + 1,
                            LLVMCreateEnumAttribute(e->ctx, align, (uint64_t)plan_slot_align(&cb->pl, ref_slot[q])));
  }
  LLVMPositionBuilderAtEnd(e->b, LLVMAppendBasicBlockInContext(e->ctx, k->fn, "entry"));
  for (int o = 0; o < g->n_out; o++) k->outp[o] = LLVMGetParam(k->fn, (unsigned)o);
  for (int v = 0; v < f->n_values; v++) {
    int s = g->leaf[v];
    if (s < 0) continue;
    if (cb->pl.slots[s].kind == PLAN_SLOT_CONST) {
      k->buf[v] = const_data(cb, cb->pl.slots[s].cst);
      if (!k->buf[v]) {
        free(ref_slot);
        return cuda_oom();
      }
      continue;
    }
    for (int q = 0; q < nb; q++)
      if (ref_slot[q] == s) k->buf[v] = LLVMGetParam(k->fn, (unsigned)q);
  }
  free(ref_slot);
  k->err = LLVMGetParam(k->fn, (unsigned)nb);
  k->bad = LLVMBuildAlloca(e->b, e->t_i1, "bad");
  LLVMBuildStore(e->b, LLVMConstInt(e->t_i1, 0, 0), k->bad);
  return 0;
}

/* Raises the error word (the first failing step's number + 1) if this
 * thread saw a bad element, and returns. */
static void kernel_end(kctx *k, bool can_fail) {
  llvm_emit *e = &k->cb->e;
  if (can_fail) {
    LLVMBasicBlockRef set = LLVMAppendBasicBlockInContext(e->ctx, k->fn, "fail");
    LLVMBasicBlockRef done = LLVMAppendBasicBlockInContext(e->ctx, k->fn, "done");
    LLVMBuildCondBr(e->b, LLVMBuildLoad2(e->b, e->t_i1, k->bad, ""), set, done);
    LLVMPositionBuilderAtEnd(e->b, set);
    LLVMBuildAtomicCmpXchg(e->b, k->err, llvm_i32(e, 0), llvm_i32(e, k->step_no + 1), LLVMAtomicOrderingMonotonic,
                           LLVMAtomicOrderingMonotonic, 0);
    LLVMBuildBr(e->b, done);
    LLVMPositionBuilderAtEnd(e->b, done);
  }
  LLVMBuildRetVoid(e->b);
}

static void kctx_free(kctx *k) {
  free(k->buf);
  free(k->outp);
}

/* ---- elementwise and fusion kernels ---- */

int cuda_emit_element(llvm_emit *e, llvm_group *lg, const plan_kernel *g, LLVMValueRef const *outp, LLVMValueRef i,
                      LLVMValueRef bad) {
  const ir_func *f = g->f;
  llvm_index idx;
  llvm_index_linear(&idx, &f->types[g->out[0]], i);
  if (llvm_emit_outputs(lg, g->n_out, g->out, outp, &idx, i)) return -1;
  flush_bad(e, lg, bad);
  llvm_group_forget(lg);
  return 0;
}

static int emit_elementwise(kctx *k, llvm_group *lg) {
  llvm_emit *e = &k->cb->e;
  int64_t n = plan_type_size(&k->g->f->types[k->g->out[0]]);
  launch_1d(k->st, n, THREADS);
  sloop l;
  LLVMValueRef i = grid_loop_begin(e, &l, n, 1);
  if (cuda_emit_element(e, lg, k->g, k->outp, i, k->bad)) return -1;
  sloop_end(e, &l);
  return 0;
}

/* ---- reductions ---- */

typedef struct {
  const ir_instr *first;
  ir_value x;
  const op_type *it, *ot;
  bool reduced[KILN_MAX_RANK];
  int64_t n_out, len; /* outputs, elements per output */
  bool trailing_flat; /* input element (o, r) is at o * len + r */
} rplan;

static void rplan_init(rplan *rp, const plan_kernel *g) {
  const ir_func *f = g->f;
  memset(rp, 0, sizeof *rp);
  rp->first = &f->instrs[f->def[g->out[0]]];
  rp->x = rp->first->in[0];
  rp->it = &f->types[rp->x];
  rp->ot = &f->types[g->out[0]];
  for (int q = 0; q < rp->first->attrs.naxes; q++) rp->reduced[rp->first->attrs.axes[q]] = true;
  rp->n_out = plan_type_size(rp->ot);
  rp->len = rp->n_out ? plan_type_size(rp->it) / rp->n_out : 0;
  bool trailing = true;
  for (int q = 0; q < rp->first->attrs.naxes; q++)
    trailing = trailing && rp->first->attrs.axes[q] == rp->it->rank - rp->first->attrs.naxes + q;
  rp->trailing_flat = trailing && llvm_group_is_flat(f, g->member, rp->x);
}


/* Each reduction of the kernel's group takes its input's element at xidx
 * (of dtype dt) into its accumulator acc[q] (of type at[q], by ops[q]); 0,
 * or -1 when an element cannot be emitted. */
static int accumulate(kctx *k, llvm_group *lg, kiln_dtype dt, const op_id *ops, LLVMTypeRef *at, LLVMValueRef *acc,
                      llvm_index *xidx) {
  llvm_emit *e = &k->cb->e;
  const plan_kernel *g = k->g;
  const ir_func *f = g->f;
  int nr = g->n_out - g->n_side;
  for (int q = 0; q < nr; q++) {
    const ir_instr *rk = &f->instrs[f->def[g->out[q]]];
    LLVMValueRef xv = llvm_emit_value(lg, rk->in[0], xidx);
    if (!xv) return -1;
    LLVMBuildStore(e->b, llvm_reduce_combine(e, ops[q], dt, LLVMBuildLoad2(e->b, at[q], acc[q], ""), xv), acc[q]);
  }
  /* the side outputs (plan_kernel.n_side): each element of the input is
   * read by one thread once, which stores them there */
  if (g->n_side && llvm_emit_outputs(lg, g->n_side, g->out + nr, k->outp + nr, xidx, llvm_index_get_linear(e, xidx)))
    return -1;
  flush_bad(e, lg, k->bad);
  llvm_group_forget(lg);
  return 0;
}
/* the input index of output o (i64), reduction position r (i64) */
static void reduce_index(llvm_emit *e, const rplan *rp, LLVMValueRef o, LLVMValueRef r, llvm_index *xidx) {
  LLVMBuilderRef b = e->b;
  if (rp->trailing_flat) {
    llvm_index_linear(xidx, rp->it, LLVMBuildAdd(b, LLVMBuildMul(b, o, llvm_i64(e, rp->len), ""), r, ""));
    return;
  }
  llvm_index oidx;
  llvm_index_linear(&oidx, rp->ot, o);
  llvm_index_get_dims(e, &oidx);
  LLVMValueRef dims[KILN_MAX_RANK];
  for (int d = 0, pos = 0; d < rp->it->rank; d++) {
    if (rp->reduced[d]) {
      dims[d] = NULL;
      if (rp->first->attrs.keepdims) pos++;
    } else {
      dims[d] = oidx.dim[pos++];
    }
  }
  /* r over the reduced dims, row-major */
  LLVMValueRef rest = r;
  int last = -1;
  for (int d = 0; d < rp->it->rank; d++)
    if (rp->reduced[d]) {
      last = d;
      break;
    }
  for (int d = rp->it->rank - 1; d >= 0; d--) {
    if (!rp->reduced[d]) continue;
    int64_t s = rp->it->shape[d];
    if (d == last) {
      dims[d] = rest;
    } else if (s == 1) {
      dims[d] = llvm_i64(e, 0);
    } else {
      dims[d] = LLVMBuildURem(b, rest, llvm_i64(e, s), "");
      rest = LLVMBuildUDiv(b, rest, llvm_i64(e, s), "");
    }
  }
  llvm_index_dims(xidx, rp->it, dims);
}

enum { RED_THREAD, RED_WARP, RED_BLOCK };

static int emit_reduce(kctx *k, llvm_group *lg) {
  llvm_emit *e = &k->cb->e;
  LLVMBuilderRef b = e->b;
  const plan_kernel *g = k->g;
  const ir_func *f = g->f;
  rplan rp;
  rplan_init(&rp, g);
  int nr = g->n_out - g->n_side; /* the reductions, then the side outputs */
  bool column = rp.it->rank > 0 && !rp.reduced[rp.it->rank - 1] && rp.first->attrs.naxes > 0;
  int form = column || rp.len < WARP ? RED_THREAD : rp.len < BLOCK_ROW ? RED_WARP : RED_BLOCK;
  if (g->n_out > 16) return kiln_set_error("cuda: @%s: a kernel with more than 16 reductions", k->cb->f->name);
  LLVMTypeRef at[16];
  LLVMValueRef acc[16] = {0}, shared[16] = {0};
  op_id ops[16];
  kiln_dtype dt = rp.it->dtype;
  for (int o = 0; o < nr; o++) {
    ops[o] = f->instrs[f->def[g->out[o]]].op;
    at[o] = llvm_reduce_type(e, ops[o], dt);
    acc[o] = LLVMBuildAlloca(b, at[o], "acc");
    if (form == RED_BLOCK) {
      char what[16];
      snprintf(what, sizeof what, "part%d", o);
      shared[o] = shared_array(e, k->name, what, at[o], THREADS / WARP);
    }
  }
  /* the loop over outputs: a thread, a warp or a block each */
  sloop lo;
  LLVMValueRef o, lane = NULL, tid = NULL;
  int64_t per_block = form == RED_THREAD ? THREADS : form == RED_WARP ? THREADS / WARP : 1;
  launch_1d(k->st, rp.n_out, (int)per_block);
  if (form == RED_BLOCK) {
    tid = sreg(e, "tid.x");
    LLVMTypeRef it = index_type(e, rp.n_out);
    o = zext64(e, sloop_begin(e, &lo, LLVMBuildZExt(b, sreg(e, "ctaid.x"), it, ""), llvm_const_i(it, rp.n_out),
                              LLVMBuildZExt(b, sreg(e, "nctaid.x"), it, ""), "row"));
  } else {
    if (form == RED_WARP) lane = LLVMBuildAnd(b, sreg(e, "tid.x"), llvm_i32(e, WARP - 1), "");
    o = grid_loop_begin(e, &lo, rp.n_out, form == RED_WARP ? WARP : 1);
  }
  for (int q = 0; q < nr; q++) LLVMBuildStore(b, llvm_reduce_identity(e, ops[q], dt), acc[q]);
  /* this thread's share of the row */
  LLVMTypeRef rt = index_type(e, rp.len);
  LLVMValueRef r0 = form == RED_THREAD ? llvm_const_i(rt, 0)
                    : form == RED_WARP ? LLVMBuildZExt(b, lane, rt, "")
                                       : LLVMBuildZExt(b, tid, rt, "");
  LLVMValueRef rstep = llvm_const_i(rt, form == RED_THREAD ? 1 : form == RED_WARP ? WARP : THREADS);
  sloop lr;
  LLVMValueRef r = zext64(e, sloop_begin(e, &lr, r0, llvm_const_i(rt, rp.len), rstep, "r"));
  llvm_index xidx;
  reduce_index(e, &rp, o, r, &xidx);
  if (accumulate(k, lg, dt, ops, at, acc, &xidx)) return -1;
  sloop_end(e, &lr);
  LLVMValueRef v[16];
  for (int q = 0; q < nr; q++) v[q] = LLVMBuildLoad2(b, at[q], acc[q], "");
  if (form != RED_THREAD) /* across the warp: every lane ends with the total */
    for (int m = WARP / 2; m >= 1; m /= 2)
      for (int q = 0; q < nr; q++) v[q] = llvm_reduce_combine(e, ops[q], dt, v[q], shfl_xor(e, v[q], m));
  LLVMValueRef fn = k->fn;
  if (form == RED_BLOCK) { /* warps' totals through shared memory, then warp 0 */
    LLVMValueRef warp = LLVMBuildLShr(b, tid, llvm_i32(e, 5), "");
    LLVMValueRef wl = LLVMBuildAnd(b, tid, llvm_i32(e, WARP - 1), "");
    LLVMBasicBlockRef put = LLVMAppendBasicBlockInContext(e->ctx, fn, "put"),
                      sync = LLVMAppendBasicBlockInContext(e->ctx, fn, "sync");
    LLVMBuildCondBr(b, LLVMBuildICmp(b, LLVMIntEQ, wl, llvm_i32(e, 0), ""), put, sync);
    LLVMPositionBuilderAtEnd(b, put);
    for (int q = 0; q < nr; q++) LLVMBuildStore(b, v[q], shared_gep(e, at[q], shared[q], warp));
    LLVMBuildBr(b, sync);
    LLVMPositionBuilderAtEnd(b, sync);
    barrier(e);
    LLVMValueRef in_range = LLVMBuildICmp(b, LLVMIntULT, wl, llvm_i32(e, THREADS / WARP), "");
    LLVMValueRef safe = LLVMBuildSelect(b, in_range, wl, llvm_i32(e, 0), "");
    for (int q = 0; q < nr; q++) {
      LLVMValueRef part = LLVMBuildLoad2(b, at[q], shared_gep(e, at[q], shared[q], safe), "");
      v[q] = LLVMBuildSelect(b, in_range, part, llvm_reduce_identity(e, ops[q], dt), "");
      for (int m = WARP / 2; m >= 1; m /= 2) v[q] = llvm_reduce_combine(e, ops[q], dt, v[q], shfl_xor(e, v[q], m));
    }
    barrier(e); /* the next row reuses the shared slots */
    lane = tid;
  }
  LLVMBasicBlockRef store = NULL, next = NULL;
  if (lane) { /* one thread stores */
    store = LLVMAppendBasicBlockInContext(e->ctx, fn, "store");
    next = LLVMAppendBasicBlockInContext(e->ctx, fn, "next");
    LLVMBuildCondBr(b, LLVMBuildICmp(b, LLVMIntEQ, lane, llvm_i32(e, 0), ""), store, next);
    LLVMPositionBuilderAtEnd(b, store);
  }
  for (int q = 0; q < nr; q++)
    llvm_emit_store(e, rp.ot->dtype, k->outp[q], o, llvm_reduce_finish(e, ops[q], dt, v[q]));
  if (lane) {
    LLVMBuildBr(b, next);
    LLVMPositionBuilderAtEnd(b, next);
  }
  sloop_end(e, &lo);
  return 0;
}

/* ---- column reductions (colplan): pass 1, a block per (tile of tx
 * outputs, range of rows) ---- */

static int emit_column(kctx *k, llvm_group *lg) {
  llvm_emit *e = &k->cb->e;
  LLVMBuilderRef b = e->b;
  const plan_kernel *g = k->g;
  const ir_func *f = g->f;
  const colplan *cp = &k->col;
  rplan rp;
  rplan_init(&rp, g);
  int nr = g->n_out - g->n_side; /* the reductions, then the side outputs */
  if (g->n_out > 16) return kiln_set_error("cuda: @%s: a kernel with more than 16 reductions", k->cb->f->name);
  cuda_step *st = k->st;
  st->grid[0] = (unsigned)cp->tiles, st->grid[1] = (unsigned)cp->split, st->grid[2] = 1;
  st->block[0] = THREADS, st->block[1] = st->block[2] = 1;
  kiln_dtype dt = rp.it->dtype;
  LLVMTypeRef at[16];
  LLVMValueRef acc[16], shared[16];
  op_id ops[16];
  for (int q = 0; q < nr; q++) {
    ops[q] = f->instrs[f->def[g->out[q]]].op;
    at[q] = llvm_reduce_type(e, ops[q], dt);
    acc[q] = LLVMBuildAlloca(b, at[q], "acc");
    char what[16];
    snprintf(what, sizeof what, "col%d", q);
    shared[q] = shared_array(e, k->name, what, at[q], THREADS);
    LLVMBuildStore(b, llvm_reduce_identity(e, ops[q], dt), acc[q]);
  }
  int lg_tx = 0;
  while ((1 << lg_tx) < cp->tx) lg_tx++;
  LLVMValueRef tid = sreg(e, "tid.x");
  LLVMValueRef tx = LLVMBuildAnd(b, tid, llvm_i32(e, cp->tx - 1), ""), ty = LLVMBuildLShr(b, tid, llvm_i32(e, lg_tx), "");
  LLVMValueRef part = zext64(e, sreg(e, "ctaid.y"));
  LLVMValueRef o = LLVMBuildAdd(b, LLVMBuildMul(b, zext64(e, sreg(e, "ctaid.x")), llvm_i64(e, cp->tx), ""),
                                zext64(e, tx), "");
  LLVMValueRef ok = LLVMBuildICmp(b, LLVMIntULT, o, llvm_i64(e, rp.n_out), "");
  /* this thread's rows: ty, ty + ty_count, ... of its block's range */
  LLVMBasicBlockRef rows = LLVMAppendBasicBlockInContext(e->ctx, k->fn, "rows"),
                    tree = LLVMAppendBasicBlockInContext(e->ctx, k->fn, "tree");
  LLVMBuildCondBr(b, ok, rows, tree);
  LLVMPositionBuilderAtEnd(b, rows);
  LLVMValueRef lo = LLVMBuildMul(b, part, llvm_i64(e, cp->chunk), "");
  LLVMValueRef hi = LLVMBuildAdd(b, lo, llvm_i64(e, cp->chunk), "");
  hi = LLVMBuildSelect(b, LLVMBuildICmp(b, LLVMIntSLT, hi, llvm_i64(e, rp.len), ""), hi, llvm_i64(e, rp.len), "");
  sloop lr;
  LLVMValueRef r = sloop_begin(e, &lr, LLVMBuildAdd(b, lo, zext64(e, ty), ""), hi, llvm_i64(e, cp->ty), "r");
  llvm_index xidx;
  reduce_index(e, &rp, o, r, &xidx);
  if (accumulate(k, lg, dt, ops, at, acc, &xidx)) return -1;
  sloop_end(e, &lr);
  LLVMBuildBr(b, tree);
  LLVMPositionBuilderAtEnd(b, tree);
  /* the tree over ty: halves fold into the lower half, a barrier each */
  for (int q = 0; q < nr; q++)
    LLVMBuildStore(b, LLVMBuildLoad2(b, at[q], acc[q], ""), shared_gep(e, at[q], shared[q], tid));
  barrier(e);
  for (int half = cp->ty / 2; half >= 1; half /= 2) {
    LLVMBasicBlockRef fold = LLVMAppendBasicBlockInContext(e->ctx, k->fn, "fold"),
                      sync = LLVMAppendBasicBlockInContext(e->ctx, k->fn, "sync");
    LLVMBuildCondBr(b, LLVMBuildICmp(b, LLVMIntULT, ty, llvm_i32(e, half), ""), fold, sync);
    LLVMPositionBuilderAtEnd(b, fold);
    LLVMValueRef other = LLVMBuildAdd(b, tid, llvm_i32(e, half * cp->tx), "");
    for (int q = 0; q < nr; q++) {
      LLVMValueRef mine = shared_gep(e, at[q], shared[q], tid);
      LLVMValueRef v = llvm_reduce_combine(e, ops[q], dt, LLVMBuildLoad2(b, at[q], mine, ""),
                                           LLVMBuildLoad2(b, at[q], shared_gep(e, at[q], shared[q], other), ""));
      LLVMBuildStore(b, v, mine);
    }
    LLVMBuildBr(b, sync);
    LLVMPositionBuilderAtEnd(b, sync);
    barrier(e);
  }
  LLVMBasicBlockRef store = LLVMAppendBasicBlockInContext(e->ctx, k->fn, "store"),
                    done = LLVMAppendBasicBlockInContext(e->ctx, k->fn, "stored");
  LLVMBuildCondBr(b, LLVMBuildAnd(b, ok, LLVMBuildICmp(b, LLVMIntEQ, ty, llvm_i32(e, 0), ""), ""), store, done);
  LLVMPositionBuilderAtEnd(b, store);
  for (int q = 0; q < nr; q++) {
    LLVMValueRef v = LLVMBuildLoad2(b, at[q], shared_gep(e, at[q], shared[q], tid), "");
    if (cp->split == 1) {
      llvm_emit_store(e, rp.ot->dtype, k->outp[q], o, llvm_reduce_finish(e, ops[q], dt, v));
    } else {
      LLVMValueRef i = LLVMBuildAdd(b, LLVMBuildMul(b, part, llvm_i64(e, rp.n_out), ""), o, "");
      LLVMBuildStore(b, v, LLVMBuildGEP2(b, at[q], k->outp[q], &i, 1, ""));
    }
  }
  LLVMBuildBr(b, done);
  LLVMPositionBuilderAtEnd(b, done);
  return 0;
}

/* pass 2: a thread per output adds its column's partials in split order */
static int emit_combine(kctx *k) {
  llvm_emit *e = &k->cb->e;
  LLVMBuilderRef b = e->b;
  const plan_kernel *g = k->g;
  const ir_func *f = g->f;
  rplan rp;
  rplan_init(&rp, g);
  kiln_dtype dt = rp.it->dtype;
  launch_1d(k->st, rp.n_out, THREADS);
  LLVMTypeRef at[16];
  LLVMValueRef acc[16];
  op_id ops[16];
  if (g->n_out > 16) return kiln_set_error("cuda: @%s: a kernel with more than 16 reductions", k->cb->f->name);
  for (int q = 0; q < g->n_out; q++) {
    ops[q] = f->instrs[f->def[g->out[q]]].op;
    at[q] = llvm_reduce_type(e, ops[q], dt);
    acc[q] = LLVMBuildAlloca(b, at[q], "acc");
  }
  sloop l;
  LLVMValueRef o = grid_loop_begin(e, &l, rp.n_out, 1);
  for (int q = 0; q < g->n_out; q++)
    LLVMBuildStore(b, LLVMBuildLoad2(b, at[q], LLVMBuildGEP2(b, at[q], k->buf[g->out[q]], &o, 1, ""), ""), acc[q]);
  llvm_loop ls;
  LLVMValueRef sp = llvm_loop_begin(e, &ls, llvm_i64(e, 1), llvm_i64(e, k->col.split), "split");
  LLVMValueRef i = LLVMBuildAdd(b, LLVMBuildMul(b, sp, llvm_i64(e, rp.n_out), ""), o, "");
  for (int q = 0; q < g->n_out; q++) {
    LLVMValueRef x = LLVMBuildLoad2(b, at[q], LLVMBuildGEP2(b, at[q], k->buf[g->out[q]], &i, 1, ""), "");
    LLVMBuildStore(b, llvm_reduce_combine(e, ops[q], dt, LLVMBuildLoad2(b, at[q], acc[q], ""), x), acc[q]);
  }
  llvm_loop_end(e, &ls);
  for (int q = 0; q < g->n_out; q++)
    llvm_emit_store(e, rp.ot->dtype, k->outp[q], o,
                    llvm_reduce_finish(e, ops[q], dt, LLVMBuildLoad2(b, at[q], acc[q], "")));
  sloop_end(e, &l);
  return 0;
}

/* ---- dot: C[b] = A[b] B[b], batch dims broadcast; a block computes a
 * 64 x 64 tile of C through 16-deep slices of A and B in shared memory,
 * each thread a 4 x 4 set of outputs (rows ty + 16 i, columns tx + 16 j) ---- */

/* the linear batch index of operand t (batch dims right-aligned, size-1
 * dims broadcast) for the output's batch multi-index */
static LLVMValueRef batch_offset(llvm_emit *e, const op_type *t, const op_type *ot, const LLVMValueRef *odims) {
  int nb = t->rank - 2, onb = ot->rank - 2;
  LLVMValueRef lin = llvm_i64(e, 0);
  for (int i = 0; i < nb; i++) {
    int64_t s = t->shape[i];
    LLVMValueRef d = s == 1 ? llvm_i64(e, 0) : odims[onb - nb + i];
    lin = LLVMBuildAdd(e->b, LLVMBuildMul(e->b, lin, llvm_i64(e, s), ""), d, "");
  }
  return lin;
}

static LLVMValueRef mul_add(llvm_emit *e, kiln_dtype dt, LLVMValueRef acc, LLVMValueRef a, LLVMValueRef b) {
  if (!dtype_is_float(dt)) return LLVMBuildAdd(e->b, acc, LLVMBuildMul(e->b, a, b, ""), "");
  LLVMValueRef args[3] = {a, b, acc};
  return llvm_intr(e, "llvm.fmuladd", args, 3);
}

/* f32 to TF32 (round to nearest, ties away: cvt.rna.tf32.f32), as an i32 */
static LLVMValueRef to_tf32(llvm_emit *e, LLVMValueRef x) {
  LLVMTypeRef ft;
  LLVMValueRef fn = llvm_intrinsic(e, "llvm.nvvm.f2tf32.rna", NULL, 0, &ft);
  return llvm_call(e, fn, ft, &x, 1);
}

/* c[0..3] += A (16 x 8) B (8 x 8), one warp's mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 */
static void mma_tf32(llvm_emit *e, LLVMValueRef a[4], LLVMValueRef bb[2], LLVMValueRef c[4]) {
  LLVMTypeRef ft;
  LLVMValueRef fn = llvm_intrinsic(e, "llvm.nvvm.mma.m16n8k8.row.col.tf32", NULL, 0, &ft);
  LLVMValueRef args[10] = {a[0], a[1], a[2], a[3], bb[0], bb[1], c[0], c[1], c[2], c[3]};
  LLVMValueRef d = llvm_call(e, fn, ft, args, 10);
  for (int q = 0; q < 4; q++) c[q] = LLVMBuildExtractValue(e->b, d, (unsigned)q, "");
}

static int emit_dot(kctx *k) {
  llvm_emit *e = &k->cb->e;
  LLVMBuilderRef b = e->b;
  const ir_func *f = k->g->f;
  const ir_instr *in = k->g->special;
  const op_type *at = &f->types[in->in[0]], *bt = &f->types[in->in[1]], *ot = &f->types[in->out];
  kiln_dtype dt = ot->dtype;
  int64_t M = ot->shape[ot->rank - 2], N = ot->shape[ot->rank - 1], K = at->shape[at->rank - 1];
  int64_t batch = plan_type_size(ot) / (M * N > 0 ? M * N : 1);
  if (M * N == 0) batch = 0;
  int64_t tm = (M + TILE_M - 1) / TILE_M, tn = (N + TILE_N - 1) / TILE_N;
  if (tm > MAX_GRID_YZ)
    return kiln_set_error("cuda: @%s: dot with %lld rows is too big for one grid", k->cb->f->name, (long long)M);
  cuda_step *st = k->st;
  st->grid[0] = (unsigned)(batch ? tn : 0);
  st->grid[1] = (unsigned)(batch ? tm : 0);
  st->grid[2] = (unsigned)(batch < MAX_GRID_YZ ? batch : MAX_GRID_YZ);
  st->block[0] = THREADS, st->block[1] = st->block[2] = 1;
  LLVMTypeRef t = llvm_value_type(e, dt);
  LLVMValueRef As = shared_array(e, k->name, "a", t, TILE_K * TILE_M);
  LLVMValueRef Bs = shared_array(e, k->name, "b", t, TILE_K * TILE_N);
  LLVMValueRef acc = LLVMBuildAlloca(b, LLVMArrayType2(t, REG_M * REG_N), "acc");
  LLVMValueRef pa = k->buf[in->in[0]], pb = k->buf[in->in[1]], pc = k->outp[0];
  LLVMValueRef tid = LLVMBuildZExt(b, sreg(e, "tid.x"), e->t_i64, "");
  LLVMValueRef ty = LLVMBuildUDiv(b, tid, llvm_i64(e, 16), ""), tx = LLVMBuildURem(b, tid, llvm_i64(e, 16), "");
  /* TF32 tensor cores: warp w computes rows 16 (w / 2) and columns 32 (w % 2)
   * of the tile as four m16n8k8 products; lane = 4 group + tig holds the
   * PTX ISA's fragment elements (rows group, group + 8; columns 2 tig, 2 tig + 1) */
  bool tf32 = dt == KILN_F32 && k->cb->tf32;
  LLVMValueRef lane = LLVMBuildURem(b, tid, llvm_i64(e, WARP), ""), warp = LLVMBuildUDiv(b, tid, llvm_i64(e, WARP), "");
  LLVMValueRef grp = LLVMBuildUDiv(b, lane, llvm_i64(e, 4), ""), tig = LLVMBuildURem(b, lane, llvm_i64(e, 4), "");
  LLVMValueRef wm = LLVMBuildMul(b, LLVMBuildUDiv(b, warp, llvm_i64(e, 2), ""), llvm_i64(e, 16), "");
  LLVMValueRef wn = LLVMBuildMul(b, LLVMBuildURem(b, warp, llvm_i64(e, 2), ""), llvm_i64(e, 32), "");
  LLVMValueRef m0 = LLVMBuildMul(b, LLVMBuildZExt(b, sreg(e, "ctaid.y"), e->t_i64, ""), llvm_i64(e, TILE_M), "");
  LLVMValueRef n0 = LLVMBuildMul(b, LLVMBuildZExt(b, sreg(e, "ctaid.x"), e->t_i64, ""), llvm_i64(e, TILE_N), "");
  LLVMValueRef zero = dtype_is_float(dt) ? llvm_const_f(t, 0) : llvm_const_i(t, 0);
  sloop lz;
  LLVMValueRef bz =
      zext64(e, sloop_begin(e, &lz, LLVMBuildZExt(b, sreg(e, "ctaid.z"), e->t_i64, ""), llvm_i64(e, batch),
                            LLVMBuildZExt(b, sreg(e, "nctaid.z"), e->t_i64, ""), "batch"));
  /* batch offsets of A, B and C */
  op_type obatch = *ot;
  obatch.rank -= 2;
  llvm_index bidx;
  llvm_index_linear(&bidx, &obatch, bz);
  llvm_index_get_dims(e, &bidx);
  LLVMValueRef abase = LLVMBuildMul(b, batch_offset(e, at, ot, bidx.dim), llvm_i64(e, M * K), "");
  LLVMValueRef bbase = LLVMBuildMul(b, batch_offset(e, bt, ot, bidx.dim), llvm_i64(e, K * N), "");
  LLVMValueRef cbase = LLVMBuildMul(b, bz, llvm_i64(e, M * N), "");
  for (int q = 0; q < REG_M * REG_N; q++)
    LLVMBuildStore(b, zero, LLVMBuildGEP2(b, t, acc, (LLVMValueRef[]){llvm_i64(e, q)}, 1, ""));
  llvm_loop lk;
  LLVMValueRef kt = llvm_loop_begin(e, &lk, llvm_i64(e, 0), llvm_i64(e, (K + TILE_K - 1) / TILE_K), "kt");
  LLVMValueRef k0 = LLVMBuildMul(b, kt, llvm_i64(e, TILE_K), "");
  /* load the slices: 4 elements of each per thread, zero outside */
  for (int q = 0; q < TILE_M * TILE_K / THREADS; q++) {
    LLVMValueRef l = LLVMBuildAdd(b, tid, llvm_i64(e, q * THREADS), "");
    /* A: row mm, column kk (kk fastest: 16 threads read one row's run) */
    LLVMValueRef mm = LLVMBuildUDiv(b, l, llvm_i64(e, TILE_K), ""), kk = LLVMBuildURem(b, l, llvm_i64(e, TILE_K), "");
    LLVMValueRef gm = LLVMBuildAdd(b, m0, mm, ""), gk = LLVMBuildAdd(b, k0, kk, "");
    LLVMValueRef ok = LLVMBuildAnd(b, LLVMBuildICmp(b, LLVMIntSLT, gm, llvm_i64(e, M), ""),
                                   LLVMBuildICmp(b, LLVMIntSLT, gk, llvm_i64(e, K), ""), "");
    LLVMValueRef ai = LLVMBuildAdd(b, abase, LLVMBuildAdd(b, LLVMBuildMul(b, gm, llvm_i64(e, K), ""), gk, ""), "");
    ai = LLVMBuildSelect(b, ok, ai, abase, ""); /* a safe address; the value is dropped */
    LLVMValueRef av = LLVMBuildSelect(b, ok, llvm_emit_load(e, dt, pa, ai), zero, "");
    LLVMBuildStore(b, av, shared_gep(e, t, As, LLVMBuildAdd(b, LLVMBuildMul(b, kk, llvm_i64(e, TILE_M), ""), mm, "")));
    /* B: row kk, column nn */
    LLVMValueRef kb = LLVMBuildUDiv(b, l, llvm_i64(e, TILE_N), ""), nn = LLVMBuildURem(b, l, llvm_i64(e, TILE_N), "");
    LLVMValueRef gkb = LLVMBuildAdd(b, k0, kb, ""), gn = LLVMBuildAdd(b, n0, nn, "");
    LLVMValueRef okb = LLVMBuildAnd(b, LLVMBuildICmp(b, LLVMIntSLT, gkb, llvm_i64(e, K), ""),
                                    LLVMBuildICmp(b, LLVMIntSLT, gn, llvm_i64(e, N), ""), "");
    LLVMValueRef bi = LLVMBuildAdd(b, bbase, LLVMBuildAdd(b, LLVMBuildMul(b, gkb, llvm_i64(e, N), ""), gn, ""), "");
    bi = LLVMBuildSelect(b, okb, bi, bbase, "");
    LLVMValueRef bv = LLVMBuildSelect(b, okb, llvm_emit_load(e, dt, pb, bi), zero, "");
    LLVMBuildStore(b, bv, shared_gep(e, t, Bs, LLVMBuildAdd(b, LLVMBuildMul(b, kb, llvm_i64(e, TILE_N), ""), nn, "")));
  }
  barrier(e);
  LLVMValueRef av[REG_M], bv[REG_N], c[REG_M * REG_N];
  for (int q = 0; q < REG_M * REG_N; q++)
    c[q] = LLVMBuildLoad2(b, t, LLVMBuildGEP2(b, t, acc, (LLVMValueRef[]){llvm_i64(e, q)}, 1, ""), "");
  for (int kk = 0; tf32 && kk < TILE_K; kk += 8) {
    LLVMValueRef a[4], bb[2];
    for (int q = 0; q < 4; q++) { /* a0 (g, t), a1 (g + 8, t), a2 (g, t + 4), a3 (g + 8, t + 4) */
      LLVMValueRef kr = LLVMBuildAdd(b, tig, llvm_i64(e, kk + 4 * (q / 2)), "");
      LLVMValueRef mr = LLVMBuildAdd(b, LLVMBuildAdd(b, wm, grp, ""), llvm_i64(e, 8 * (q % 2)), "");
      LLVMValueRef i = LLVMBuildAdd(b, LLVMBuildMul(b, kr, llvm_i64(e, TILE_M), ""), mr, "");
      a[q] = to_tf32(e, LLVMBuildLoad2(b, t, shared_gep(e, t, As, i), ""));
    }
    for (int j = 0; j < REG_N; j++) {
      for (int q = 0; q < 2; q++) { /* b0 (t, g), b1 (t + 4, g) */
        LLVMValueRef kr = LLVMBuildAdd(b, tig, llvm_i64(e, kk + 4 * q), "");
        LLVMValueRef nc = LLVMBuildAdd(b, LLVMBuildAdd(b, wn, grp, ""), llvm_i64(e, 8 * j), "");
        LLVMValueRef i = LLVMBuildAdd(b, LLVMBuildMul(b, kr, llvm_i64(e, TILE_N), ""), nc, "");
        bb[q] = to_tf32(e, LLVMBuildLoad2(b, t, shared_gep(e, t, Bs, i), ""));
      }
      mma_tf32(e, a, bb, c + 4 * j);
    }
  }
  for (int kk = 0; !tf32 && kk < TILE_K; kk++) {
    for (int i = 0; i < REG_M; i++)
      av[i] =
          LLVMBuildLoad2(b, t, shared_gep(e, t, As, LLVMBuildAdd(b, ty, llvm_i64(e, kk * TILE_M + 16 * i), "")), "");
    for (int j = 0; j < REG_N; j++)
      bv[j] =
          LLVMBuildLoad2(b, t, shared_gep(e, t, Bs, LLVMBuildAdd(b, tx, llvm_i64(e, kk * TILE_N + 16 * j), "")), "");
    for (int i = 0; i < REG_M; i++)
      for (int j = 0; j < REG_N; j++) c[i * REG_N + j] = mul_add(e, dt, c[i * REG_N + j], av[i], bv[j]);
  }
  for (int q = 0; q < REG_M * REG_N; q++)
    LLVMBuildStore(b, c[q], LLVMBuildGEP2(b, t, acc, (LLVMValueRef[]){llvm_i64(e, q)}, 1, ""));
  barrier(e); /* the next slice overwrites the shared arrays */
  llvm_loop_end(e, &lk);
  /* store the outputs inside C */
  for (int i = 0; i < REG_M; i++)
    for (int j = 0; j < REG_N; j++) {
      /* accumulator i * REG_N + j: row ty + 16 i, column tx + 16 j; with TF32
       * n-tile i, fragment element j */
      LLVMValueRef rm = tf32 ? LLVMBuildAdd(b, LLVMBuildAdd(b, wm, grp, ""), llvm_i64(e, 8 * (j / 2)), "")
                             : LLVMBuildAdd(b, ty, llvm_i64(e, 16 * i), "");
      LLVMValueRef cn =
          tf32 ? LLVMBuildAdd(b, LLVMBuildAdd(b, wn, LLVMBuildMul(b, tig, llvm_i64(e, 2), ""), ""), llvm_i64(e, 8 * i + j % 2), "")
               : LLVMBuildAdd(b, tx, llvm_i64(e, 16 * j), "");
      LLVMValueRef gm = LLVMBuildAdd(b, m0, rm, "");
      LLVMValueRef gn = LLVMBuildAdd(b, n0, cn, "");
      LLVMValueRef ok = LLVMBuildAnd(b, LLVMBuildICmp(b, LLVMIntSLT, gm, llvm_i64(e, M), ""),
                                     LLVMBuildICmp(b, LLVMIntSLT, gn, llvm_i64(e, N), ""), "");
      LLVMBasicBlockRef put = LLVMAppendBasicBlockInContext(e->ctx, k->fn, "put"),
                        skip = LLVMAppendBasicBlockInContext(e->ctx, k->fn, "skip");
      LLVMBuildCondBr(b, ok, put, skip);
      LLVMPositionBuilderAtEnd(b, put);
      LLVMValueRef ci = LLVMBuildAdd(b, cbase, LLVMBuildAdd(b, LLVMBuildMul(b, gm, llvm_i64(e, N), ""), gn, ""), "");
      LLVMValueRef cv =
          LLVMBuildLoad2(b, t, LLVMBuildGEP2(b, t, acc, (LLVMValueRef[]){llvm_i64(e, i * REG_N + j)}, 1, ""), "");
      llvm_emit_store(e, dt, pc, ci, cv);
      LLVMBuildBr(b, skip);
      LLVMPositionBuilderAtEnd(b, skip);
    }
  sloop_end(e, &lz);
  return 0;
}

/* ---- argmax: a thread per output; the first maximum wins, NaN counts as
 * the maximum (lib/kernels_reduce.c) ---- */

static int emit_argmax(kctx *k) {
  llvm_emit *e = &k->cb->e;
  LLVMBuilderRef b = e->b;
  const ir_func *f = k->g->f;
  const ir_instr *in = k->g->special;
  const op_type *it = &f->types[in->in[0]];
  kiln_dtype dt = it->dtype;
  int axis = in->attrs.axis;
  int64_t len = it->shape[axis], inner = 1, n = plan_type_size(&f->types[in->out]);
  for (int d = axis + 1; d < it->rank; d++) inner *= it->shape[d];
  launch_1d(k->st, n, THREADS);
  LLVMValueRef px = k->buf[in->in[0]];
  sloop l;
  LLVMValueRef i = grid_loop_begin(e, &l, n, 1);
  LLVMValueRef o = LLVMBuildUDiv(b, i, llvm_i64(e, inner), ""), ip = LLVMBuildURem(b, i, llvm_i64(e, inner), "");
  LLVMValueRef base = LLVMBuildAdd(b, LLVMBuildMul(b, o, llvm_i64(e, len * inner), ""), ip, "");
  LLVMTypeRef t = llvm_value_type(e, dt);
  LLVMValueRef best = LLVMBuildAlloca(b, t, "best"), where = LLVMBuildAlloca(b, e->t_i64, "where");
  LLVMBuildStore(b, llvm_emit_load(e, dt, px, base), best);
  LLVMBuildStore(b, llvm_i64(e, 0), where);
  llvm_loop la;
  LLVMValueRef a = llvm_loop_begin(e, &la, llvm_i64(e, 1), llvm_i64(e, len), "a");
  LLVMValueRef x = llvm_emit_load(e, dt, px, LLVMBuildAdd(b, base, LLVMBuildMul(b, a, llvm_i64(e, inner), ""), ""));
  LLVMValueRef bv = LLVMBuildLoad2(b, t, best, "");
  LLVMValueRef better;
  if (dtype_is_float(dt))
    better = LLVMBuildOr(
        b, LLVMBuildFCmp(b, LLVMRealOGT, x, bv, ""),
        LLVMBuildAnd(b, LLVMBuildFCmp(b, LLVMRealUNO, x, x, ""), LLVMBuildFCmp(b, LLVMRealORD, bv, bv, ""), ""), "");
  else
    better = LLVMBuildICmp(b, LLVMIntSGT, x, bv, "");
  LLVMBuildStore(b, LLVMBuildSelect(b, better, x, bv, ""), best);
  LLVMBuildStore(b, LLVMBuildSelect(b, better, a, LLVMBuildLoad2(b, e->t_i64, where, ""), ""), where);
  llvm_loop_end(e, &la);
  llvm_emit_store(e, KILN_I64, k->outp[0], i, LLVMBuildLoad2(b, e->t_i64, where, ""));
  sloop_end(e, &l);
  return 0;
}

/* ---- concat: each input in turn, a grid-stride loop over its elements ---- */

static int emit_concat(kctx *k) {
  llvm_emit *e = &k->cb->e;
  LLVMBuilderRef b = e->b;
  const ir_func *f = k->g->f;
  const ir_instr *in = k->g->special;
  const op_type *ot = &f->types[in->out];
  int axis = in->attrs.axis;
  int64_t inner = 1, total = ot->shape[axis], off = 0, most = 0;
  for (int d = axis + 1; d < ot->rank; d++) inner *= ot->shape[d];
  for (int q = 0; q < in->n_in; q++) {
    const op_type *t = &f->types[in->in[q]];
    int64_t n = plan_type_size(t), span = t->shape[axis] * inner;
    if (n > most) most = n;
    if (n > 0) {
      sloop l;
      LLVMValueRef i = grid_loop_begin(e, &l, n, 1);
      LLVMValueRef oo = LLVMBuildUDiv(b, i, llvm_i64(e, span), ""), rest = LLVMBuildURem(b, i, llvm_i64(e, span), "");
      LLVMValueRef dst = LLVMBuildAdd(b, LLVMBuildMul(b, oo, llvm_i64(e, total * inner), ""),
                                      LLVMBuildAdd(b, rest, llvm_i64(e, off * inner), ""), "");
      llvm_emit_store(e, ot->dtype, k->outp[0], dst, llvm_emit_load(e, ot->dtype, k->buf[in->in[q]], i));
      sloop_end(e, &l);
    }
    off += t->shape[axis];
  }
  launch_1d(k->st, most, THREADS);
  return 0;
}

/* ---- gather and scatter_add: an index outside [0, dim) raises the error
 * word and reads (or adds) nothing ---- */

static LLVMValueRef load_index(llvm_emit *e, const ir_func *f, ir_value idxv, LLVMValueRef p, LLVMValueRef j) {
  kiln_dtype it = f->types[idxv].dtype;
  LLVMValueRef x = llvm_emit_load(e, it, p, j);
  return it == KILN_I64 ? x : LLVMBuildSExt(e->b, x, e->t_i64, "");
}

static void note_index(kctx *k, ir_value idxv, int64_t dim) {
  const ir_func *f = k->g->f;
  cuda_step *st = k->st;
  st->op = k->g->special->op;
  st->index_count = plan_type_size(&f->types[idxv]);
  st->index_dim = dim;
  st->index_dtype = f->types[idxv].dtype;
  for (int q = 0; q < st->n_bufs; q++) /* -1 for constant indices (a global of the module) */
    if (LLVMGetParam(k->fn, (unsigned)q) == k->buf[idxv]) st->index_buf = q;
}

static int emit_gather(kctx *k) {
  llvm_emit *e = &k->cb->e;
  LLVMBuilderRef b = e->b;
  const ir_func *f = k->g->f;
  const ir_instr *in = k->g->special;
  const op_type *pt = &f->types[in->in[0]];
  int axis = in->attrs.axis;
  int64_t dim = pt->shape[axis], inner = 1, nidx = plan_type_size(&f->types[in->in[1]]);
  int64_t n = plan_type_size(&f->types[in->out]);
  for (int d = axis + 1; d < pt->rank; d++) inner *= pt->shape[d];
  note_index(k, in->in[1], dim);
  launch_1d(k->st, n, THREADS);
  sloop l;
  LLVMValueRef i = grid_loop_begin(e, &l, n, 1);
  LLVMValueRef ip = LLVMBuildURem(b, i, llvm_i64(e, inner), ""), t = LLVMBuildUDiv(b, i, llvm_i64(e, inner), "");
  LLVMValueRef j = LLVMBuildURem(b, t, llvm_i64(e, nidx), ""), o = LLVMBuildUDiv(b, t, llvm_i64(e, nidx), "");
  LLVMValueRef x = load_index(e, f, in->in[1], k->buf[in->in[1]], j);
  LLVMValueRef bad = LLVMBuildICmp(b, LLVMIntUGE, x, llvm_i64(e, dim), "");
  LLVMBuildStore(b, LLVMBuildOr(b, LLVMBuildLoad2(b, e->t_i1, k->bad, ""), bad, ""), k->bad);
  x = LLVMBuildSelect(b, bad, llvm_i64(e, 0), x, "");
  LLVMValueRef src = LLVMBuildAdd(
      b, LLVMBuildMul(b, LLVMBuildAdd(b, LLVMBuildMul(b, o, llvm_i64(e, dim), ""), x, ""), llvm_i64(e, inner), ""), ip,
      "");
  llvm_emit_store(e, pt->dtype, k->outp[0], i, llvm_emit_load(e, pt->dtype, k->buf[in->in[0]], src));
  sloop_end(e, &l);
  return 0;
}

/* a thread per column (outer, inner position) owns that column of the
 * result: zeros, then the updates in index order, as the CPU kernel adds
 * them (no atomics; the same sums, bit for bit) */
static int emit_scatter_add(kctx *k) {
  llvm_emit *e = &k->cb->e;
  LLVMBuilderRef b = e->b;
  const ir_func *f = k->g->f;
  const ir_instr *in = k->g->special;
  const op_type *ot = &f->types[in->out];
  kiln_dtype dt = ot->dtype;
  int axis = in->attrs.axis;
  int64_t dim = ot->shape[axis], inner = 1, outer = 1, nidx = plan_type_size(&f->types[in->in[1]]);
  for (int d = axis + 1; d < ot->rank; d++) inner *= ot->shape[d];
  for (int d = 0; d < axis; d++) outer *= ot->shape[d];
  note_index(k, in->in[1], dim);
  launch_1d(k->st, outer * inner, THREADS);
  LLVMTypeRef t = llvm_value_type(e, dt);
  LLVMValueRef zero = dtype_is_float(dt) ? llvm_const_f(t, 0) : llvm_const_i(t, 0);
  sloop l;
  LLVMValueRef c = grid_loop_begin(e, &l, outer * inner, 1);
  LLVMValueRef o = LLVMBuildUDiv(b, c, llvm_i64(e, inner), ""), ip = LLVMBuildURem(b, c, llvm_i64(e, inner), "");
  LLVMValueRef obase = LLVMBuildAdd(b, LLVMBuildMul(b, o, llvm_i64(e, dim * inner), ""), ip, "");
  LLVMValueRef ubase = LLVMBuildAdd(b, LLVMBuildMul(b, o, llvm_i64(e, nidx * inner), ""), ip, "");
  llvm_loop lz, lj;
  LLVMValueRef z = llvm_loop_begin(e, &lz, llvm_i64(e, 0), llvm_i64(e, dim), "zero");
  llvm_emit_store(e, dt, k->outp[0], LLVMBuildAdd(b, obase, LLVMBuildMul(b, z, llvm_i64(e, inner), ""), ""), zero);
  llvm_loop_end(e, &lz);
  LLVMValueRef j = llvm_loop_begin(e, &lj, llvm_i64(e, 0), llvm_i64(e, nidx), "j");
  LLVMValueRef x = load_index(e, f, in->in[1], k->buf[in->in[1]], j);
  LLVMValueRef bad = LLVMBuildICmp(b, LLVMIntUGE, x, llvm_i64(e, dim), "");
  LLVMBuildStore(b, LLVMBuildOr(b, LLVMBuildLoad2(b, e->t_i1, k->bad, ""), bad, ""), k->bad);
  LLVMBasicBlockRef add = LLVMAppendBasicBlockInContext(e->ctx, k->fn, "add"),
                    skip = LLVMAppendBasicBlockInContext(e->ctx, k->fn, "skip");
  LLVMBuildCondBr(b, bad, skip, add);
  LLVMPositionBuilderAtEnd(b, add);
  LLVMValueRef di = LLVMBuildAdd(b, obase, LLVMBuildMul(b, x, llvm_i64(e, inner), ""), "");
  LLVMValueRef ui = LLVMBuildAdd(b, ubase, LLVMBuildMul(b, j, llvm_i64(e, inner), ""), "");
  LLVMValueRef old = llvm_emit_load(e, dt, k->outp[0], di), u = llvm_emit_load(e, dt, k->buf[in->in[0]], ui);
  llvm_emit_store(e, dt, k->outp[0], di,
                  dtype_is_float(dt) ? LLVMBuildFAdd(b, old, u, "") : LLVMBuildAdd(b, old, u, ""));
  LLVMBuildBr(b, skip);
  LLVMPositionBuilderAtEnd(b, skip);
  llvm_loop_end(e, &lj);
  sloop_end(e, &l);
  return 0;
}

static int emit_kernel(cuda_build *cb, cuda_step *st, const plan_kernel *g) {
  llvm_emit *e = &cb->e;
  kctx k = {.cb = cb, .g = g, .st = st, .step_no = st->no};
  if (g->pass) cuda_column_plan(g->f, g->out[0], &k.col); /* as the plan's split made it */
  int rc = kernel_begin(&k);
  bool can_fail = false;
  if (!rc && kiln_ops[g->op].kind == OPK_WINDOW) { /* both passes of a split one (ptx_window.c) */
    rc = cuda_emit_window(&k);
  } else if (!rc && g->special) {
    switch (g->special->op) {
      case OP_DOT: rc = emit_dot(&k); break;
      case OP_ARGMAX: rc = emit_argmax(&k); break;
      case OP_CONCAT: rc = emit_concat(&k); break;
      case OP_GATHER: rc = emit_gather(&k), can_fail = true; break;
      case OP_SCATTER_ADD: rc = emit_scatter_add(&k), can_fail = true; break;
      case OP_SCAN: rc = cuda_emit_scan(&k, &can_fail); break; /* the device loop (ptx_scan.c) */
      default: rc = kiln_set_error("cuda: @%s: %s has no kernel", cb->f->name, kiln_ops[g->special->op].name);
    }
  } else if (!rc) {
    llvm_group lg = {.e = e, .f = g->f, .buf = k.buf};
    llvm_group_init(&lg);
    const ir_instr *first = &g->f->instrs[g->f->def[g->out[0]]];
    rc = g->pass == 2                  ? emit_combine(&k)
         : g->pass == 1                ? emit_column(&k, &lg)
         : llvm_op_is_reduce(first->op) ? emit_reduce(&k, &lg)
                                        : emit_elementwise(&k, &lg);
    can_fail = lg.bad_op != OP_COUNT;
    if (can_fail) k.st->op = lg.bad_op;
    llvm_group_dispose(&lg);
  }
  if (!rc) kernel_end(&k, can_fail);
  kctx_free(&k);
  return rc;
}

/* ---- compiling ---- */

static void build_free(cuda_build *cb) {
  plan_free(&cb->pl);
  free(cb->cst_t);
  free(cb->cst_g);
  llvm_emit_dispose(&cb->e);
  memset(cb, 0, sizeof *cb);
}

static bool arch_ok(const char *arch) { return !strcmp(arch, "sm_80") || !strcmp(arch, "sm_90"); }

/* the error of a failed LLVM emission (llvm: ...) as cuda: ... */
static void rewrap_error(void) {
  const char *m = kiln_last_error();
  if (!strncmp(m, "cuda:", 5)) return;
  char msg[1024];
  snprintf(msg, sizeof msg, "%s", m);
  kiln_set_error("cuda: %s", msg);
}

static int compile_module(cuda_build *cb, const char *arch) {
  cuda_program *p = cb->p;
  LLVMTargetMachineRef tm = nvptx_machine(arch);
  if (!tm) return -1;
  LLVMContextRef ctx = LLVMContextCreate();
  LLVMModuleRef mod = LLVMModuleCreateWithNameInContext(p->name, ctx);
  LLVMSetTarget(mod, "nvptx64-nvidia-cuda");
  LLVMTargetDataRef td = LLVMCreateTargetDataLayout(tm);
  LLVMSetModuleDataLayout(mod, td);
  LLVMDisposeTargetData(td);
  llvm_emit_init(&cb->e, ctx, mod);
  cb->e.contract = true;
  cb->e.exact_fmod = true;
  cb->e.const_data = const_data;
  cb->e.user = cb;
  int rc = 0;
  for (int s = 0; s < p->n_all && !rc; s++) /* every kernel of the tree, loop bodies' too */
    if (p->all[s]->kind == CUDA_STEP_KERNEL) {
      rc = emit_kernel(cb, p->all[s], &cb->pl.kernels[p->all[s]->kernel]);
      if (rc) rewrap_error();
    }
  char *msg = NULL;
  if (!rc && LLVMVerifyModule(mod, LLVMReturnStatusAction, &msg)) {
    rc = kiln_set_error("cuda: @%s: internal error: invalid LLVM module: %.400s", p->name, msg ? msg : "");
  }
  if (msg) LLVMDisposeMessage(msg);
  msg = NULL;
  if (!rc) {
    LLVMPassBuilderOptionsRef opts = LLVMCreatePassBuilderOptions();
    LLVMPassBuilderOptionsSetLoopUnrolling(opts, 1);
    LLVMErrorRef err = LLVMRunPasses(mod, "default<O3>", tm, opts);
    LLVMDisposePassBuilderOptions(opts);
    if (err) {
      char *m = LLVMGetErrorMessage(err);
      rc = kiln_set_error("cuda: @%s: optimisation failed: %s", p->name, m);
      LLVMDisposeErrorMessage(m);
    }
  }
  LLVMMemoryBufferRef out = NULL;
  if (!rc && LLVMTargetMachineEmitToMemoryBuffer(tm, mod, LLVMAssemblyFile, &msg, &out)) {
    rc = kiln_set_error("cuda: @%s: PTX generation failed: %s", p->name, msg ? msg : "");
    out = NULL;
  }
  if (msg) LLVMDisposeMessage(msg);
  if (out) {
    size_t len = LLVMGetBufferSize(out);
    p->ptx = malloc(len + 1);
    if (p->ptx) {
      memcpy(p->ptx, LLVMGetBufferStart(out), len);
      p->ptx[len] = 0;
    } else {
      rc = cuda_oom();
    }
    LLVMDisposeMemoryBuffer(out);
  }
  llvm_emit_dispose(&cb->e);
  LLVMDisposeModule(mod);
  LLVMContextDispose(ctx);
  LLVMDisposeTargetMachine(tm);
  return rc;
}

cuda_program *cuda_compile(const ir_func *f, const char *arch) {
  if (!arch) arch = "sm_80";
  if (!f) {
    kiln_set_error("cuda: no function");
    return NULL;
  }
  if (!arch_ok(arch)) {
    kiln_set_error("cuda: unknown architecture \"%s\" (sm_80, sm_90)", arch);
    return NULL;
  }
  if (ir_verify(f)) {
    rewrap_error();
    return NULL;
  }
  double t0 = now_ms();
  cuda_program *p = calloc(1, sizeof *p);
  if (!p) {
    cuda_oom();
    return NULL;
  }
  cuda_build cb = {.f = f, .p = p, .tf32 = cuda_use_tf32()};
  snprintf(p->arch, sizeof p->arch, "%s", arch);
  p->name = malloc(strlen(f->name) + 1);
  p->param_types = malloc(((size_t)f->n_params + 1) * sizeof *p->param_types);
  p->result_types = malloc(((size_t)f->n_results + 1) * sizeof *p->result_types);
  if (!p->name || !p->param_types || !p->result_types) {
    cuda_oom();
    goto fail;
  }
  strcpy(p->name, f->name);
  p->n_params = f->n_params;
  p->n_results = f->n_results;
  for (int i = 0; i < f->n_params; i++) p->param_types[i] = f->types[i];
  for (int r = 0; r < f->n_results; r++) {
    p->result_types[r] = f->types[f->results[r]];
  }
  if (cuda_plan(&cb)) goto fail;
  cuda_cache_ref ref;
  p->from_cache = cuda_cache_get(f, p, &ref) == 1;
  if (!p->from_cache) {
    if (compile_module(&cb, arch)) {
      cuda_cache_ref_free(&ref);
      goto fail;
    }
    cuda_cache_put(&ref, p);
  }
  cuda_cache_ref_free(&ref);
  if (cpu_cache_log() && ref.dir[0])
    fprintf(stderr, "kiln: cache: @%s (%s): %s\n", f->name, arch, p->from_cache ? "PTX hit" : "PTX miss");
  for (int r = 0; r < p->n_results; r++)
    if (p->results[r].kind == CUDA_RES_CONST) kiln_retain(p->results[r].cst);
  p->compile_ms = now_ms() - t0;
  build_free(&cb);
  return p;
fail:
  if (p->results)
    for (int r = 0; r < p->n_results; r++) p->results[r].cst = NULL; /* not retained yet */
  build_free(&cb);
  cuda_program_free(p);
  return NULL;
}

char *cuda_ptx_text(const ir_func *f, const char *arch) {
  cuda_program *p = cuda_compile(f, arch);
  if (!p) return NULL;
  char *text = p->ptx;
  p->ptx = NULL;
  cuda_program_free(p);
  return text;
}

const char *cuda_program_ptx(const cuda_program *p) { return p ? p->ptx : NULL; }
int cuda_program_kernels(const cuda_program *p) { return p ? p->n_kernels : 0; }
bool cuda_program_from_cache(const cuda_program *p) { return p && p->from_cache; }

bool cuda_use_tf32(void) {
  const char *env = getenv("KILN_CUDA_TF32");
  return env && !strcmp(env, "1");
}

int cuda_program_unsupported(const cuda_program *p) {
  if (!p) return kiln_set_error("cuda: no program");
  for (int s = 0; s < p->n_all; s++)
    if (p->all[s]->kind == CUDA_STEP_HOST)
      return kiln_set_error("cuda: @%s: %s is not supported on the GPU yet", p->name, kiln_ops[p->all[s]->op].name);
  return 0;
}

void cuda_program_free(cuda_program *p) {
  if (!p) return;
  cuda_program_rt_free(p);
  cuda_steps_free(p->steps, p->n_steps);
  free(p->all);
  free(p->slots);
  for (int i = 0; i < p->n_consts; i++) kiln_release(p->consts[i]);
  free(p->consts);
  if (p->results)
    for (int r = 0; r < p->n_results; r++)
      if (p->results[r].kind == CUDA_RES_CONST && p->results[r].cst) kiln_release(p->results[r].cst);
  free(p->results);
  free(p->param_types);
  free(p->result_types);
  free(p->ptx);
  free(p->name);
  free(p);
}

/* ---- checks of the GPU's element code on the host ---- */

int cuda_host_engine(LLVMModuleRef mod, const char *who, LLVMExecutionEngineRef *ee) {
  LLVMLinkInInterpreter();
  char *msg = NULL;
  int rc = 0;
  *ee = NULL;
  if (LLVMVerifyModule(mod, LLVMReturnStatusAction, &msg)) {
    rc = kiln_set_error("cuda: %s: invalid LLVM module: %.400s", who, msg ? msg : "");
    LLVMDisposeModule(mod);
  } else {
    LLVMDisposeMessage(msg);
    msg = NULL;
    if (LLVMCreateInterpreterForModule(ee, mod, &msg)) { /* takes the module */
      rc = kiln_set_error("cuda: %s: no LLVM interpreter: %s", who, msg ? msg : "");
      *ee = NULL;
      LLVMDisposeModule(mod);
    }
  }
  if (msg) LLVMDisposeMessage(msg);
  return rc;
}

int kiln_debug_cuda_fmod(kiln_dtype dt, int64_t n, const double *x, const double *y, double *out) {
  if (dt != KILN_F32 && dt != KILN_F64) return kiln_set_error("cuda: fmod of %s", kiln_dtype_name(dt));
  LLVMContextRef ctx = LLVMContextCreate();
  LLVMModuleRef mod = LLVMModuleCreateWithNameInContext("fmod", ctx);
  llvm_emit e;
  llvm_emit_init(&e, ctx, mod);
  LLVMTypeRef t = dt == KILN_F32 ? e.t_f32 : e.t_f64, ps[2] = {t, t};
  LLVMValueRef fn = LLVMAddFunction(mod, "f", LLVMFunctionType(t, ps, 2, 0));
  LLVMPositionBuilderAtEnd(e.b, LLVMAppendBasicBlockInContext(ctx, fn, "entry"));
  LLVMBuildRet(e.b, llvm_vm_fmod(&e, LLVMGetParam(fn, 0), LLVMGetParam(fn, 1)));
  llvm_emit_dispose(&e);
  LLVMExecutionEngineRef ee = NULL;
  int rc = cuda_host_engine(mod, "kiln_debug_cuda_fmod", &ee);
  if (!rc) {
    for (int64_t i = 0; i < n; i++) {
      LLVMGenericValueRef a[2] = {LLVMCreateGenericValueOfFloat(t, x[i]), LLVMCreateGenericValueOfFloat(t, y[i])};
      LLVMGenericValueRef r = LLVMRunFunction(ee, fn, 2, a);
      out[i] = LLVMGenericValueToFloat(t, r);
      LLVMDisposeGenericValue(a[0]);
      LLVMDisposeGenericValue(a[1]);
      LLVMDisposeGenericValue(r);
    }
    LLVMDisposeExecutionEngine(ee);
  }
  LLVMContextDispose(ctx);
  return rc;
}
