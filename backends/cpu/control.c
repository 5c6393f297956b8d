/* control.c — the control steps of a plan (plan.h) in the entry function:
 * a cond is a branch on its predicate's byte, a while a loop that runs the
 * predicate's steps then the body's (counting iterations when bounded), a
 * scan a counted loop whose rows (of xs read, ys written) are pointers
 * recomputed from the iteration each time round. The nested steps are
 * emitted once, as the top level's are: a loop of T iterations is one copy
 * of its body. A step failing inside returns -1 from the entry as anywhere
 * else. */
#include "cpu/compile.h"

static LLVMBasicBlockRef block(cpu_build *cb, const char *name) {
  return LLVMAppendBasicBlockInContext(cb->e.ctx, cb->entry, name);
}

/* whether the byte at slot s is nonzero */
static LLVMValueRef pred_true(cpu_build *cb, int s) {
  llvm_emit *e = &cb->e;
  LLVMValueRef byte = LLVMBuildLoad2(cb->eb, e->t_i8, cb->slot_ptr[s], "pred");
  return LLVMBuildICmp(cb->eb, LLVMIntNE, byte, LLVMConstInt(e->t_i8, 0, 0), "");
}

static int emit_cond(cpu_build *cb, const plan_step *st) {
  LLVMBuilderRef b = cb->eb;
  LLVMBasicBlockRef yes = block(cb, "then"), no = block(cb, "else"), done = block(cb, "endif");
  LLVMBuildCondBr(b, pred_true(cb, st->slots[0]), yes, no);
  LLVMBasicBlockRef arm[2] = {yes, no};
  for (int k = 0; k < 2; k++) {
    LLVMPositionBuilderAtEnd(b, arm[k]);
    if (cpu_emit_steps(cb, st->sub[k], st->n_sub[k])) return -1;
    LLVMBuildBr(b, done);
  }
  LLVMPositionBuilderAtEnd(b, done);
  return 0;
}

/* The head of a loop counting i from 0: the builder is left in the block
 * after the head (entered while i < trip, or always for trip < 0); *i the
 * count, *head the block to branch back to, *exit the block after. */
static void loop_head(cpu_build *cb, int64_t trip, const char *name, LLVMValueRef *i, LLVMBasicBlockRef *head,
                      LLVMBasicBlockRef *exit) {
  llvm_emit *e = &cb->e;
  LLVMBuilderRef b = cb->eb;
  LLVMBasicBlockRef pre = LLVMGetInsertBlock(b), body = block(cb, name);
  *head = block(cb, "head");
  *exit = block(cb, "end");
  LLVMBuildBr(b, *head);
  LLVMPositionBuilderAtEnd(b, *head);
  *i = LLVMBuildPhi(b, e->t_i64, "i");
  LLVMValueRef zero = llvm_i64(e, 0);
  LLVMAddIncoming(*i, &zero, &pre, 1);
  if (trip >= 0)
    LLVMBuildCondBr(b, LLVMBuildICmp(b, LLVMIntSLT, *i, llvm_i64(e, trip), ""), body, *exit);
  else
    LLVMBuildBr(b, body);
  LLVMPositionBuilderAtEnd(b, body);
}

/* closes the loop: i + 1 back to head, the builder left at exit */
static void loop_back(cpu_build *cb, LLVMValueRef i, LLVMBasicBlockRef head, LLVMBasicBlockRef exit) {
  llvm_emit *e = &cb->e;
  LLVMBuilderRef b = cb->eb;
  LLVMValueRef next = LLVMBuildAdd(b, i, llvm_i64(e, 1), "");
  LLVMBasicBlockRef latch = LLVMGetInsertBlock(b);
  LLVMBuildBr(b, head);
  LLVMAddIncoming(i, &next, &latch, 1);
  LLVMPositionBuilderAtEnd(b, exit);
}

static int emit_while(cpu_build *cb, const plan_step *st) {
  LLVMValueRef i;
  LLVMBasicBlockRef head, exit;
  loop_head(cb, st->trip, "while", &i, &head, &exit);
  if (cpu_emit_steps(cb, st->sub[0], st->n_sub[0])) return -1;
  LLVMBasicBlockRef body = block(cb, "body");
  LLVMBuildCondBr(cb->eb, pred_true(cb, st->slots[0]), body, exit);
  LLVMPositionBuilderAtEnd(cb->eb, body);
  if (cpu_emit_steps(cb, st->sub[1], st->n_sub[1])) return -1;
  loop_back(cb, i, head, exit);
  return 0;
}

static int emit_scan(cpu_build *cb, const plan_step *st) {
  llvm_emit *e = &cb->e;
  LLVMBuilderRef b = cb->eb;
  LLVMValueRef i;
  LLVMBasicBlockRef head, exit;
  loop_head(cb, st->trip, "scan", &i, &head, &exit);
  LLVMValueRef t = st->reverse ? LLVMBuildSub(b, llvm_i64(e, st->trip - 1), i, "t") : i;
  for (int k = 0; k < st->n_slots; k++) { /* the rows at t */
    const plan_slot *row = &cb->pl.slots[st->slots[k]];
    LLVMValueRef off = LLVMBuildMul(b, t, llvm_i64(e, row->offset), "");
    cb->slot_ptr[st->slots[k]] = LLVMBuildGEP2(b, e->t_i8, cb->slot_ptr[row->index], &off, 1, "row");
  }
  if (cpu_emit_steps(cb, st->sub[0], st->n_sub[0])) return -1;
  loop_back(cb, i, head, exit);
  return 0;
}

int cpu_emit_control(cpu_build *cb, const plan_step *st) {
  switch (st->kind) {
    case PLAN_STEP_COND: return emit_cond(cb, st);
    case PLAN_STEP_WHILE: return emit_while(cb, st);
    case PLAN_STEP_SCAN: return emit_scan(cb, st);
    default: return kiln_set_error("cpu: @%s: unknown step %d", cb->f->name, st->kind);
  }
}
