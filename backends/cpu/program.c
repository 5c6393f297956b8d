/* program.c — the entry function of a compiled program: a pointer to each
 * slot computed up front, then the plan's steps in order: each kernel
 * called on this thread or over the pool, each runtime helper through
 * kiln_rt_helper (a collective's start, and its wait later: a negative
 * index), each copy into a result's buffer, returning -1 after a
 * step that failed. Constants are read through the symbols kiln_const<i>. */
#include <stdio.h>
#include <stdlib.h>

#include "cpu/compile.h"

enum {
  PAR_MIN = 65536,   /* elements of work below which a kernel stays on the calling thread */
  PAR_GRAIN = 16384, /* elements of work per task, at least */
  /* ... for a kernel of cheap ops: its inputs are usually in this core's
   * caches (the kernel before wrote them), and another core would first
   * have to pull its half over (the MLP batch-1 training step ran in 0.062
   * ms on one thread and 0.095 ms on two, measured) */
  PAR_MIN_CHEAP = 1 << 19,
};

/* the alignment the code may assume of a constant's data (part of the key) */
unsigned cpu_const_align(const kiln_tensor *t) {
  unsigned a = 1;
  while (a < KILN_ALIGN && (uintptr_t)t->data % (2 * a) == 0) a *= 2;
  return a;
}

/* The symbol kiln_const<i> of t's first listing (the program retains every
 * constant, so its data stays put while the code lives). */
LLVMValueRef cpu_const_data(void *user, const kiln_tensor *t) {
  cpu_build *cb = user;
  llvm_emit *e = &cb->e;
  int i = 0;
  while (i < cb->pl.n_consts && cb->pl.consts[i] != t) i++;
  if (i == cb->pl.n_consts) return NULL;
  char name[32];
  snprintf(name, sizeof name, "kiln_const%d", i);
  LLVMValueRef g = LLVMGetNamedGlobal(e->mod, name);
  if (!g) { /* a declaration: the JITDylib has its address, the code loads it from the GOT */
    g = LLVMAddGlobal(e->mod, LLVMArrayType2(e->t_i8, 0), name);
    LLVMSetAlignment(g, cpu_const_align(t));
  }
  return g;
}


/* Whether the program runs a matmul big enough for the eager kernel to
 * thread it (lib/kernels_matmul.c splits from 2 x 2^18 multiply-adds): the
 * pool's workers are then awake anyway, and keeping its cheap kernels on
 * one thread only lets them fall asleep in between (the MLP batch-64 step:
 * 0.54 ms per step with those split, 0.65 without, measured) */
static bool threaded_matmuls(const cpu_build *cb) {
  for (int s = 0; s < cb->pl.n_steps; s++) {
    const plan_step *st = &cb->pl.steps[s];
    if (st->kind != PLAN_STEP_CALL || cb->p->helpers[st->index].op != OP_DOT) continue;
    const cpu_helper *h = &cb->p->helpers[st->index];
    const op_type *a = &h->in_types[0], *c = &h->out_types[0];
    if (a->rank < 1) continue;
    if (plan_type_size(c) * a->shape[a->rank - 1] >= (int64_t)1 << 19) return true;
  }
  return false;
}


/* the entry function's pointer to each slot, computed up front */
static void emit_slot_ptrs(cpu_build *cb, LLVMValueRef params, LLVMValueRef results, LLVMValueRef arena) {
  llvm_emit *e = &cb->e;
  LLVMBuilderRef b = cb->eb;
  for (int s = 0; s < cb->pl.n_slots; s++) {
    const plan_slot *sl = &cb->pl.slots[s];
    LLVMValueRef ix;
    switch (sl->kind) {
      case PLAN_SLOT_PARAM:
      case PLAN_SLOT_RESULT:
        ix = llvm_i64(e, sl->index);
        cb->slot_ptr[s] = LLVMBuildLoad2(
            b, e->t_ptr, LLVMBuildGEP2(b, e->t_ptr, sl->kind == PLAN_SLOT_PARAM ? params : results, &ix, 1, ""), "");
        break;
      case PLAN_SLOT_ARENA:
        ix = llvm_i64(e, sl->offset);
        cb->slot_ptr[s] = LLVMBuildGEP2(b, e->t_i8, arena, &ix, 1, "");
        break;
      case PLAN_SLOT_CONST: cb->slot_ptr[s] = cpu_const_data(cb, sl->cst); break;
      default: break; /* a row: set by its scan's loop */
    }
  }
}

/* if (cond) return -1 after calling fail (when given) */
void cpu_emit_bail(cpu_build *cb, LLVMValueRef cond, int32_t kernel) {
  llvm_emit *e = &cb->e;
  LLVMBuilderRef b = cb->eb;
  LLVMBasicBlockRef bad = LLVMAppendBasicBlockInContext(e->ctx, cb->entry, "bail");
  LLVMBasicBlockRef next = LLVMAppendBasicBlockInContext(e->ctx, cb->entry, "next");
  LLVMBuildCondBr(b, cond, bad, next);
  LLVMPositionBuilderAtEnd(b, bad);
  if (kernel >= 0) {
    LLVMValueRef args[2] = {cb->call_arg, llvm_i32(e, kernel)};
    LLVMBuildCall2(b, cb->ty_fail, cb->fn_fail, args, 2, "");
  }
  LLVMBuildRet(b, llvm_i32(e, -1));
  LLVMPositionBuilderAtEnd(b, next);
}

/* The entry's call of kernel id (ki just emitted): on this thread, or over
 * the pool when it is big enough (cheap: it waits on memory), then a bail
 * when it can fail. 0, or -1 with the error set. */
static int emit_kernel_call(cpu_build *cb, const kinfo *ki, int id, bool cheap) {
  llvm_emit *e = &cb->e;
  cpu_program *p = cb->p;
  LLVMBuilderRef b = cb->eb;
  p->kernel_fail_op[id] = ki->can_fail ? ki->fail_op : OP_COUNT;
  p->n_kernels++;
  if (ki->units == 0) return 0;
  LLVMValueRef *args = malloc(((size_t)ki->n_bufs + 3) * sizeof *args);
  if (!args) return cpu_oom();
  for (int k = 0; k < ki->n_bufs; k++) args[k] = cb->slot_ptr[ki->buf_slot[k]];
  args[ki->n_bufs] = cb->call_arg;
  int64_t work = ki->units * (ki->per_unit > 0 ? ki->per_unit : 1);
  if ((ki->work ? ki->work : work) > cb->max_work) cb->max_work = ki->work ? ki->work : work;
  if (work >= (cheap ? PAR_MIN_CHEAP : PAR_MIN) && ki->units >= 2) { /* over the pool */
    LLVMValueRef ctx = cb->ctx_array;
    if (ki->n_bufs > cb->max_bufs) { /* a chain passes more than any step the plan counted: an array of its own */
      LLVMBuilderRef tb = LLVMCreateBuilderInContext(e->ctx);
      LLVMPositionBuilderBefore(tb, LLVMGetFirstInstruction(LLVMGetEntryBasicBlock(cb->entry)));
      ctx = LLVMBuildAlloca(tb, LLVMArrayType2(e->t_ptr, (uint64_t)ki->n_bufs + 1), "bufs");
      LLVMDisposeBuilder(tb);
    }
    for (int k = 0; k <= ki->n_bufs; k++) {
      LLVMValueRef ix = llvm_i64(e, k);
      LLVMBuildStore(b, args[k], LLVMBuildGEP2(b, e->t_ptr, ctx, &ix, 1, ""));
    }
    int64_t grain = PAR_GRAIN / (ki->per_unit > 0 ? ki->per_unit : 1);
    LLVMValueRef pa[4] = {llvm_i64(e, ki->units), llvm_i64(e, grain > 0 ? grain : 1), ki->task, ctx};
    LLVMBuildCall2(b, cb->ty_par, cb->fn_par, pa, 4, "");
  } else {
    args[ki->n_bufs + 1] = llvm_i64(e, 0);
    args[ki->n_bufs + 2] = llvm_i64(e, ki->units);
    LLVMBuildCall2(b, ki->fn_type, ki->fn, args, (unsigned)ki->n_bufs + 3, "");
  }
  free(args);
  if (ki->can_fail) {
    LLVMValueRef flag = LLVMBuildLoad2(b, e->t_i32, cb->call_arg, "");
    LLVMSetOrdering(flag, LLVMAtomicOrderingMonotonic);
    LLVMSetAlignment(flag, 4);
    cpu_emit_bail(cb, LLVMBuildICmp(b, LLVMIntNE, flag, llvm_i32(e, 0), ""), id);
  }
  return 0;
}

/* Emits steps (n of them) into the entry function at the builder's place:
 * each kernel called on this thread or over the pool, each runtime helper,
 * each copy, each control step (control.c) with its nested lists. */
int cpu_emit_steps(cpu_build *cb, const plan_step *steps, int n) {
  llvm_emit *e = &cb->e;
  cpu_program *p = cb->p;
  LLVMBuilderRef b = cb->eb;
  bool pool_busy = cb->pool_busy;
  for (int s = 0; s < n; s++) {
    const plan_step *st = &steps[s];
    if (st->kind == PLAN_STEP_KERNEL) {
      kinfo ki;
      int id = st->index, len = cpu_chain_length(cb, st, n - s);
      bool cheap = false;
      int rc;
      if (len > 0) { /* kernels id .. as one (chain.c): the others emit nothing */
        rc = cpu_emit_chain(cb, st, len, id, &ki);
        p->n_chains++;
        for (int k = 1; k < len; k++) p->kernel_fail_op[steps[s + k].index] = OP_COUNT;
        s += len - 1;
      } else {
        rc = cpu_emit_kernel(cb, &cb->pl.kernels[id], id, &ki);
        cheap = !pool_busy && cpu_cheap_kernel(&cb->pl.kernels[id]);
        if (!cb->pl.kernels[id].special) ki.work = cpu_kernel_work(&cb->pl.kernels[id]);
      }
      if (!rc) rc = cpu_reuse_kernel(cb, &ki) < 0 ? -1 : 0;
      if (!rc) rc = emit_kernel_call(cb, &ki, id, cheap);
      free(ki.buf_slot);
      if (rc) return -1;
    } else if (st->kind == PLAN_STEP_CALL) {
      /* bufs = {outs..., ins...}; kiln_rt_helper(call, h, bufs) */
      for (int k = 0; k < st->n_slots; k++) {
        LLVMValueRef ix = llvm_i64(e, k);
        LLVMBuildStore(b, cb->slot_ptr[st->slots[k]], LLVMBuildGEP2(b, e->t_ptr, cb->ctx_array, &ix, 1, ""));
      }
      LLVMValueRef ha[3] = {cb->call_arg, llvm_i32(e, st->index), cb->ctx_array};
      LLVMValueRef rc = LLVMBuildCall2(b, cb->ty_helper, cb->fn_helper, ha, 3, "");
      cpu_emit_bail(cb, LLVMBuildICmp(b, LLVMIntNE, rc, llvm_i32(e, 0), ""), -1);
    } else if (st->kind == PLAN_STEP_WAIT) { /* kiln_rt_helper(call, -1 - h, bufs): the wait of h's collective */
      LLVMValueRef ha[3] = {cb->call_arg, llvm_i32(e, -1 - st->index), cb->ctx_array};
      LLVMValueRef rc = LLVMBuildCall2(b, cb->ty_helper, cb->fn_helper, ha, 3, "");
      cpu_emit_bail(cb, LLVMBuildICmp(b, LLVMIntNE, rc, llvm_i32(e, 0), ""), -1);
    } else if (st->kind == PLAN_STEP_COPY && st->bytes > 0) { /* a result computed elsewhere, into its buffer */
      LLVMBuildMemCpy(b, cb->slot_ptr[st->slots[0]], 1, cb->slot_ptr[st->slots[1]], 1, llvm_i64(e, st->bytes));
    } else if (st->kind >= PLAN_STEP_COND && cpu_emit_control(cb, st)) {
      return -1;
    }
  }
  return 0;
}

int cpu_emit_program(cpu_build *cb, const char *entry_name) {
  llvm_emit *e = &cb->e;
  cpu_program *p = cb->p;
  LLVMTypeRef pp[4] = {e->t_i64, e->t_i64, e->t_ptr, e->t_ptr}; /* parallel_for(n, grain, fn, ctx) */
  cb->ty_par = LLVMFunctionType(e->t_void, pp, 4, 0);
  cb->fn_par = LLVMAddFunction(e->mod, "kiln_rt_parallel_for", cb->ty_par);
  LLVMTypeRef hp[3] = {e->t_ptr, e->t_i32, e->t_ptr};
  cb->ty_helper = LLVMFunctionType(e->t_i32, hp, 3, 0);
  cb->fn_helper = LLVMAddFunction(e->mod, "kiln_rt_helper", cb->ty_helper);
  cb->ty_fail = LLVMFunctionType(e->t_void, hp, 2, 0);
  cb->fn_fail = LLVMAddFunction(e->mod, "kiln_rt_kernel_fail", cb->ty_fail);
  LLVMTypeRef tp[3] = {e->t_ptr, e->t_i64, e->t_i64};
  cb->ty_task = LLVMFunctionType(e->t_void, tp, 3, 0);

  LLVMTypeRef ep[4] = {e->t_ptr, e->t_ptr, e->t_ptr, e->t_ptr};
  LLVMTypeRef ety = LLVMFunctionType(e->t_i32, ep, 4, 0);
  cb->entry = LLVMAddFunction(e->mod, entry_name, ety);
  cpu_add_fn_attr(e->ctx, cb->entry, "nounwind");
  cpu_add_target_attrs(e->ctx, cb->entry);
  cb->eb = LLVMCreateBuilderInContext(e->ctx);
  LLVMPositionBuilderAtEnd(cb->eb, LLVMAppendBasicBlockInContext(e->ctx, cb->entry, "entry"));
  cb->call_arg = LLVMGetParam(cb->entry, 3);
  cb->slot_ptr = calloc((size_t)cb->pl.n_slots + 1, sizeof *cb->slot_ptr);
  p->kernel_fail_op = calloc((size_t)cb->pl.n_kernels + 1, sizeof *p->kernel_fail_op);
  if (!cb->slot_ptr || !p->kernel_fail_op) return kiln_set_error("cpu: out of memory");
  LLVMTypeRef arr = LLVMArrayType2(e->t_ptr, (uint64_t)cb->max_bufs + 1);
  cb->ctx_array = LLVMBuildAlloca(cb->eb, arr, "bufs");
  emit_slot_ptrs(cb, LLVMGetParam(cb->entry, 0), LLVMGetParam(cb->entry, 1), LLVMGetParam(cb->entry, 2));
  cb->pool_busy = threaded_matmuls(cb);
  if (cpu_emit_steps(cb, cb->pl.steps, cb->pl.n_steps)) return -1;
  LLVMBuildRet(cb->eb, llvm_i32(e, 0));
  return 0;
}
