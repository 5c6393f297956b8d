/* control.c — the control steps of a plan (plan.h) in the entry function:
 * a cond is a branch on its predicate's byte, a while a loop that runs the
 * predicate's steps then the body's (counting iterations when bounded), a
 * scan a counted loop whose rows (of xs read, ys written) are pointers
 * recomputed from the iteration each time round; the slots of a loop's
 * state that move between buffers (plan_step.move) are phis of its head,
 * copied back after it where they ended in another buffer. The nested
 * steps are emitted once, as the top level's are: a loop of T iterations
 * is one copy of its body. A step failing inside returns -1 from the entry
 * as anywhere else. */
#include <stdlib.h>

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

/* ---- the state's places moving (plan_step.move): double buffering ---- */

typedef struct {
  int n;
  LLVMValueRef *before, *phi; /* per move: its slot's pointer before the loop, and in it */
} moving;

/* Each moved slot's pointer a phi of the loop's head (the builder in the
 * block after it): the pointer it had before the loop, pre the block
 * entering the head. */
static int moves_begin(cpu_build *cb, const plan_step *st, LLVMBasicBlockRef head, LLVMBasicBlockRef pre, moving *m) {
  m->n = st->n_move;
  m->before = malloc(((size_t)m->n + 1) * sizeof *m->before);
  m->phi = malloc(((size_t)m->n + 1) * sizeof *m->phi);
  if (!m->before || !m->phi) return cpu_oom();
  if (!m->n) return 0;
  LLVMBuilderRef b = cb->eb;
  LLVMBasicBlockRef at = LLVMGetInsertBlock(b);
  LLVMPositionBuilderBefore(b, LLVMGetFirstInstruction(head));
  for (int k = 0; k < m->n; k++) {
    int s = st->move[2 * k];
    m->before[k] = cb->slot_ptr[s];
    m->phi[k] = LLVMBuildPhi(b, cb->e.t_ptr, "place");
    LLVMAddIncoming(m->phi[k], &m->before[k], &pre, 1);
  }
  for (int k = 0; k < m->n; k++) cb->slot_ptr[st->move[2 * k]] = m->phi[k];
  LLVMPositionBuilderAtEnd(b, at);
  return 0;
}

/* the moves, all at once, at the latch (the builder's block) */
static void moves_latch(cpu_build *cb, const plan_step *st, moving *m) {
  LLVMBasicBlockRef latch = LLVMGetInsertBlock(cb->eb);
  for (int k = 0; k < m->n; k++) {
    LLVMValueRef to = cb->slot_ptr[st->move[2 * k + 1]];
    LLVMAddIncoming(m->phi[k], &to, &latch, 1);
  }
}

/* After the loop (the builder at its exit): each state whose place moved
 * copied back to its own; every moved slot's pointer as before. */
static void moves_end(cpu_build *cb, const plan_step *st, moving *m) {
  llvm_emit *e = &cb->e;
  LLVMBuilderRef b = cb->eb;
  /* pass 0: the copies out into scratch places; pass 1: the copies back */
  for (int pass = 0; pass < 2; pass++)
    for (int q = 0; q < st->n_state; q++)
      for (int k = 0; k < m->n; k++) {
        int sc = st->scratch ? st->scratch[q] : -1;
        if (st->move[2 * k] != st->state[q] || (pass == 0 && sc < 0)) continue;
        LLVMBasicBlockRef copy = block(cb, "copy"), next = block(cb, "placed");
        LLVMBuildCondBr(b, LLVMBuildICmp(b, LLVMIntNE, m->phi[k], m->before[k], ""), copy, next);
        LLVMPositionBuilderAtEnd(b, copy);
        LLVMValueRef bytes = llvm_i64(e, st->state_bytes[q]);
        if (pass == 0)
          LLVMBuildMemCpy(b, cb->slot_ptr[sc], 1, m->phi[k], 1, bytes);
        else
          LLVMBuildMemCpy(b, m->before[k], 1, sc >= 0 ? cb->slot_ptr[sc] : m->phi[k], 1, bytes);
        LLVMBuildBr(b, next);
        LLVMPositionBuilderAtEnd(b, next);
      }
  for (int k = 0; k < m->n; k++) cb->slot_ptr[st->move[2 * k]] = m->before[k];
}

static void moves_free(moving *m) {
  free(m->before);
  free(m->phi);
}

/* the end of an iteration: the state's moves, i + 1 back to head, and after
 * the loop the copies of states left in other buffers */
static void loop_close(cpu_build *cb, const plan_step *st, LLVMValueRef i, LLVMBasicBlockRef head,
                       LLVMBasicBlockRef exit, moving *m) {
  moves_latch(cb, st, m);
  loop_back(cb, i, head, exit);
  moves_end(cb, st, m);
}

static int emit_while(cpu_build *cb, const plan_step *st) {
  LLVMValueRef i;
  LLVMBasicBlockRef head, exit, pre = LLVMGetInsertBlock(cb->eb);
  moving m = {0};
  loop_head(cb, st->trip, "while", &i, &head, &exit);
  int rc = moves_begin(cb, st, head, pre, &m);
  if (!rc) rc = cpu_emit_steps(cb, st->sub[0], st->n_sub[0]);
  if (!rc) {
    LLVMBasicBlockRef body = block(cb, "body");
    LLVMBuildCondBr(cb->eb, pred_true(cb, st->slots[0]), body, exit);
    LLVMPositionBuilderAtEnd(cb->eb, body);
    rc = cpu_emit_steps(cb, st->sub[1], st->n_sub[1]);
  }
  if (!rc) loop_close(cb, st, i, head, exit, &m);
  moves_free(&m);
  return rc;
}

static int emit_scan(cpu_build *cb, const plan_step *st) {
  llvm_emit *e = &cb->e;
  LLVMBuilderRef b = cb->eb;
  LLVMValueRef i;
  LLVMBasicBlockRef head, exit, pre = LLVMGetInsertBlock(b);
  moving m = {0};
  loop_head(cb, st->trip, "scan", &i, &head, &exit);
  if (moves_begin(cb, st, head, pre, &m)) {
    moves_free(&m);
    return -1;
  }
  LLVMValueRef t = st->reverse ? LLVMBuildSub(b, llvm_i64(e, st->trip - 1), i, "t") : i;
  for (int k = 0; k < st->n_slots; k++) { /* the rows at t */
    const plan_slot *row = &cb->pl.slots[st->slots[k]];
    LLVMValueRef off = LLVMBuildMul(b, t, llvm_i64(e, row->offset), "");
    cb->slot_ptr[st->slots[k]] = LLVMBuildGEP2(b, e->t_i8, cb->slot_ptr[row->index], &off, 1, "row");
  }
  int rc = cpu_emit_steps(cb, st->sub[0], st->n_sub[0]);
  if (!rc) loop_close(cb, st, i, head, exit, &m);
  moves_free(&m);
  return rc;
}

int cpu_emit_control(cpu_build *cb, const plan_step *st) {
  switch (st->kind) {
    case PLAN_STEP_COND: return emit_cond(cb, st);
    case PLAN_STEP_WHILE: return emit_while(cb, st);
    case PLAN_STEP_SCAN: return emit_scan(cb, st);
    default: return kiln_set_error("cpu: @%s: unknown step %d", cb->f->name, st->kind);
  }
}
