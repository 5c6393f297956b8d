// plan_test.cc — the shared plan (backends/plan) under small policies of the
// tests' own: every value's slot, every instruction's step, calls inlined,
// views free, results returned or copied, and each hook of plan_policy (a
// kernel of the backend's own, calls, a split reduction, dots that read
// transposes in place, a dot epilogue), errors under the policy's name.
#include "plan/plan.h"

#include <gtest/gtest.h>

#include <string>

#include "ir.h"
#include "test_util.h"

namespace {

using namespace kiln_test;

// elementwise ops and reductions are kernels, random draws and dots calls,
// argmax a kernel of its own; the rest cannot run
plan_as place(const ir_func *, const ir_instr *in) {
  switch (ir_op_info(in->op)->kind) {
    case OPK_UNARY:
    case OPK_BINARY:
    case OPK_COMPARE:
      return PLAN_AS_KERNEL;
    case OPK_REDUCE: return in->op == OP_ARGMAX ? PLAN_AS_SPECIAL : PLAN_AS_KERNEL;
    case OPK_RANDOM:
    case OPK_DOT: return PLAN_AS_CALL;
    default: return PLAN_AS_UNSUPPORTED;
  }
}

bool any_fusion(const ir_func *) { return true; }

plan_policy basic() {
  plan_policy p = {};
  p.who = "test";
  p.unsupported = "cannot run here";
  p.place = place;
  p.fusion_one_kernel = any_fusion;
  return p;
}

// A parsed module and a plan of one of its functions, freed together.
struct Planned {
  ir_module *m = nullptr;
  plan pl = {};
  int rc = -1;
  Planned(const char *text, const char *fn, const plan_policy &policy) {
    m = ir_parse(text, "plan_test");
    if (!m) {
      ADD_FAILURE() << kiln_last_error();
      return;
    }
    rc = plan_build(&pl, ir_module_find(m, fn), &policy);
  }
  ~Planned() {
    plan_free(&pl);
    if (m) ir_module_free(m);
  }
  const plan_slot &slot_of(int s) const { return pl.slots[s]; }
};

TEST(Plan, SlotsStepsAndResults) {
  Scoped scope;
  plan_policy po = basic();
  Planned p(
      "func @inner(%a: f32[3], %b: f32[3]) -> f32[3] {\n"
      "  %s = add %a, %b : f32[3]\n"
      "  return %s\n"
      "}\n"
      "func @body(%x: f32[3]) -> f32[3] {\n"
      "  %e = exp %x : f32[3]\n"
      "  %n = neg %e : f32[3]\n"
      "  return %n\n"
      "}\n"
      "func @f(%x: f32[3], %y: f32[3]) -> (f32[3], f32[3,1], f32[3], f32[3]) {\n"
      "  %c = constant dense<[1.0, 2.0, 3.0]> : f32[3]\n"
      "  %m = mul %x, %c : f32[3]\n"
      "  %r = reshape %m {shape=[3,1]} : f32[3,1]\n"
      "  %u = rng_uniform {dtype=f32, shape=[3], lo=0.0, hi=1.0, seed=1, counter=2} : f32[3]\n"
      "  %s = call @inner(%m, %u) : f32[3]\n"
      "  %k = fusion @body(%s) : f32[3]\n"
      "  return %k, %r, %y, %k\n"
      "}\n",
      "f", po);
  ASSERT_EQ(p.rc, 0) << kiln_last_error();
  const plan &pl = p.pl;
  // mul (the constant pulled inside), the draw, inner's add (inlined), the
  // fusion, then the reshape's bytes copied into result 1
  ASSERT_EQ(pl.n_steps, 5);
  const int kinds[5] = {PLAN_STEP_KERNEL, PLAN_STEP_CALL, PLAN_STEP_KERNEL, PLAN_STEP_KERNEL, PLAN_STEP_COPY};
  for (int s = 0; s < 5; s++) EXPECT_EQ(pl.steps[s].kind, kinds[s]) << "step " << s;
  ASSERT_EQ(pl.n_kernels, 3);
  ASSERT_EQ(pl.n_calls, 1);
  EXPECT_STREQ(ir_op_info(pl.calls[0].op)->name, "rng_uniform");
  EXPECT_EQ(pl.calls[0].n_out, 1);
  EXPECT_EQ(pl.calls[0].n_in, 0);
  ASSERT_EQ(pl.n_consts, 1);

  const ir_func *f = pl.f;
  const plan_kernel &mul = pl.kernels[0];
  EXPECT_EQ(mul.f, f);
  EXPECT_EQ(mul.op, OP_MUL);
  EXPECT_TRUE(mul.member[0]) << "the constant is computed in the kernel";
  EXPECT_TRUE(mul.member[1]);
  EXPECT_EQ(p.slot_of(mul.leaf[0]).kind, PLAN_SLOT_PARAM);
  EXPECT_EQ(mul.leaf[2], -1) << "the constant is no leaf";
  EXPECT_EQ(p.slot_of(mul.out_slot[0]).kind, PLAN_SLOT_ARENA);

  // values: %x %y %c %m %r %u %s %k; the view reads the mul's slot, the
  // fusion writes result 0 in place
  EXPECT_EQ(pl.vslot[4], pl.vslot[3]);
  const plan_kernel &fu = pl.kernels[2];
  EXPECT_EQ(fu.op, OP_FUSION);
  EXPECT_STREQ(fu.f->name, "body");
  EXPECT_EQ(fu.leaf[0], pl.vslot[6]) << "the body's parameter reads the call's result";
  EXPECT_EQ(p.slot_of(fu.out_slot[0]).kind, PLAN_SLOT_RESULT);
  EXPECT_EQ(p.slot_of(fu.out_slot[0]).index, 0);

  const plan_step &copy = pl.steps[4];
  ASSERT_EQ(copy.n_slots, 2);
  EXPECT_EQ(p.slot_of(copy.slots[0]).kind, PLAN_SLOT_RESULT);
  EXPECT_EQ(p.slot_of(copy.slots[0]).index, 1);
  EXPECT_EQ(copy.slots[1], pl.vslot[3]);
  EXPECT_EQ(copy.bytes, 12);

  EXPECT_EQ(pl.results[0].kind, PLAN_RES_OWN);
  EXPECT_EQ(pl.results[1].kind, PLAN_RES_OWN);
  EXPECT_EQ(pl.results[2].kind, PLAN_RES_PARAM);
  EXPECT_EQ(pl.results[2].index, 1);
  EXPECT_EQ(pl.results[3].kind, PLAN_RES_SAME);
  EXPECT_EQ(pl.results[3].index, 0);
  // three arena values of 12 bytes, each aligned
  EXPECT_EQ(pl.arena_bytes, (size_t)3 * KILN_ALIGN);
}

TEST(Plan, SpecialKernelAndErrorsUnderThePolicysName) {
  Scoped scope;
  plan_policy po = basic();
  {
    Planned p(
        "func @f(%x: f32[4,5]) -> i64[4] {\n"
        "  %a = argmax %x {axis=1} : i64[4]\n"
        "  return %a\n"
        "}\n",
        "f", po);
    ASSERT_EQ(p.rc, 0) << kiln_last_error();
    ASSERT_EQ(p.pl.n_kernels, 1);
    ASSERT_NE(p.pl.kernels[0].special, nullptr);
    EXPECT_EQ(p.pl.kernels[0].special->op, OP_ARGMAX);
    EXPECT_EQ(p.pl.kernels[0].leaf[0], 0);
  }
  {
    Planned p(
        "func @g(%x: f32[3]) -> f32[6] {\n"
        "  %c = concat %x, %x {axis=0} : f32[6]\n"
        "  return %c\n"
        "}\n",
        "g", po);
    EXPECT_EQ(p.rc, -1);
    EXPECT_STREQ(kiln_last_error(), "test: @g: concat cannot run here");
    kiln_clear_error();
  }
  {
    // calls nested past the limit, built without the verifier
    ir_module *m = ir_module_new();
    op_type t = {KILN_F32, 1, {2}};
    ir_func *prev = nullptr;
    for (int i = 0; i <= 102 && m; i++) {
      ir_func *f = ir_func_new(m, ("c" + std::to_string(i)).c_str(), 1, &t);
      ASSERT_NE(f, nullptr) << kiln_last_error();
      ir_value x = 0, y;
      if (!prev) {
        y = ir_append(f, OP_NEG, nullptr, 1, &x, ir_loc{});
      } else {
        op_attrs a = {};
        a.callee = prev;
        y = ir_append(f, OP_CALL, &a, 1, &x, ir_loc{});
      }
      ASSERT_GE(y, 0) << kiln_last_error();
      ASSERT_EQ(ir_set_results(f, 1, &y), 0);
      prev = f;
    }
    plan pl;
    EXPECT_EQ(plan_build(&pl, prev, &po), -1);
    EXPECT_STREQ(kiln_last_error(), "test: @c102: calls nest too deep");
    kiln_clear_error();
    plan_free(&pl);
    ir_module_free(m);
  }
}

int64_t split_three(const plan_kernel *k) { return ir_op_info(k->op)->kind == OPK_REDUCE ? 3 : 0; }
int64_t split_one(const plan_kernel *k) { return ir_op_info(k->op)->kind == OPK_REDUCE ? 1 : 0; }

TEST(Plan, SplitReductionsPassPartialsThroughTheArena) {
  Scoped scope;
  const char *text =
      "func @r(%x: f32[100,4]) -> f32[4] {\n"
      "  %s = reduce_sum %x {axes=[0]} : f32[4]\n"
      "  return %s\n"
      "}\n";
  plan_policy po = basic();
  po.split = split_three;
  {
    Planned p(text, "r", po);
    ASSERT_EQ(p.rc, 0) << kiln_last_error();
    const plan &pl = p.pl;
    ASSERT_EQ(pl.n_steps, 2);
    ASSERT_EQ(pl.n_kernels, 2);
    EXPECT_EQ(pl.steps[0].index, 0);
    EXPECT_EQ(pl.steps[1].index, 1);
    const plan_kernel &a = pl.kernels[0], &b = pl.kernels[1];
    EXPECT_EQ(a.pass, 1);
    EXPECT_EQ(b.pass, 2);
    EXPECT_EQ(b.op, OP_REDUCE_SUM);
    const plan_slot &partials = p.slot_of(a.out_slot[0]);
    EXPECT_EQ(partials.kind, PLAN_SLOT_ARENA);
    EXPECT_GE((int64_t)pl.arena_bytes, partials.offset + 3 * 4 * 8) << "3 partials of 8 bytes per output";
    EXPECT_EQ(b.leaf[b.out[0]], a.out_slot[0]) << "the second pass reads the partials";
    EXPECT_EQ(p.slot_of(b.out_slot[0]).kind, PLAN_SLOT_RESULT);
  }
  po.split = split_one;
  {
    Planned p(text, "r", po);
    ASSERT_EQ(p.rc, 0) << kiln_last_error();
    ASSERT_EQ(p.pl.n_steps, 1);
    EXPECT_EQ(p.pl.kernels[0].pass, 1);
    EXPECT_EQ(p.slot_of(p.pl.kernels[0].out_slot[0]).kind, PLAN_SLOT_RESULT);
    EXPECT_EQ(p.pl.arena_bytes, 0u);
  }
}

bool read_all(const op_type *, const op_type *, const ir_instr *const cand[2], const ir_instr *t[2]) {
  t[0] = cand[0], t[1] = cand[1];
  return cand[0] || cand[1];
}

bool lead_dot(const ir_func *c, const ir_instr *in) { return in->op == OP_DOT && in == &c->instrs[0]; }

bool bias_epilogue(const ir_func *c, ir_value ops[PLAN_EPILOGUE_OPS], int *epi) {
  if (c->n_instrs != 2 || c->instrs[0].op != OP_DOT || c->instrs[1].op != OP_ADD) return false;
  ops[0] = c->instrs[0].in[0], ops[1] = c->instrs[0].in[1], ops[2] = c->instrs[1].in[1];
  *epi = 7;
  return true;
}

TEST(Plan, DotHooks) {
  Scoped scope;
  plan_policy po = basic();
  po.dot_transposes = read_all;
  po.dot_before_kernel = lead_dot;
  po.dot_epilogue = bias_epilogue;
  {
    // the transpose is never made: the call reads %w as it lies
    Planned p(
        "func @f(%x: f32[2,5], %w: f32[3,5]) -> f32[2,3] {\n"
        "  %t = transpose %w {perm=[1,0]} : f32[5,3]\n"
        "  %d = dot %x, %t : f32[2,3]\n"
        "  return %d\n"
        "}\n",
        "f", po);
    ASSERT_EQ(p.rc, 0) << kiln_last_error();
    ASSERT_EQ(p.pl.n_steps, 1);
    ASSERT_EQ(p.pl.n_calls, 1);
    const plan_call &c = p.pl.calls[0];
    EXPECT_FALSE(c.trans_a);
    EXPECT_TRUE(c.trans_b);
    EXPECT_EQ(c.in_types[1].shape[0], 3);
    EXPECT_EQ(c.in_types[1].shape[1], 5);
    EXPECT_EQ(p.pl.steps[0].slots[2], 1) << "the call reads parameter %w";
  }
  {
    // a fusion that is one call with its epilogue
    Planned p(
        "func @k(%x: f32[2,5], %w: f32[5,3], %b: f32[3]) -> f32[2,3] {\n"
        "  %d = dot %x, %w : f32[2,3]\n"
        "  %z = add %d, %b : f32[2,3]\n"
        "  return %z\n"
        "}\n"
        "func @f(%x: f32[2,5], %w: f32[5,3], %b: f32[3]) -> f32[2,3] {\n"
        "  %z = fusion @k(%x, %w, %b) : f32[2,3]\n"
        "  return %z\n"
        "}\n",
        "f", po);
    ASSERT_EQ(p.rc, 0) << kiln_last_error();
    ASSERT_EQ(p.pl.n_steps, 1);
    ASSERT_EQ(p.pl.n_kernels, 0);
    ASSERT_EQ(p.pl.n_calls, 1);
    EXPECT_EQ(p.pl.calls[0].n_in, 3);
    EXPECT_EQ(p.pl.calls[0].epilogue, 7);
  }
  {
    // the dot runs as a call before the fusion's kernel, which reads its result
    Planned p(
        "func @k(%x: f32[2,5], %w: f32[5,3], %b: f32[3]) -> f32[2,3] {\n"
        "  %d = dot %x, %w : f32[2,3]\n"
        "  %z = mul %d, %b : f32[2,3]\n"
        "  %e = exp %z : f32[2,3]\n"
        "  return %e\n"
        "}\n"
        "func @f(%x: f32[2,5], %w: f32[5,3], %b: f32[3]) -> f32[2,3] {\n"
        "  %e = fusion @k(%x, %w, %b) : f32[2,3]\n"
        "  return %e\n"
        "}\n",
        "f", po);
    ASSERT_EQ(p.rc, 0) << kiln_last_error();
    ASSERT_EQ(p.pl.n_steps, 2);
    EXPECT_EQ(p.pl.steps[0].kind, PLAN_STEP_CALL);
    EXPECT_EQ(p.pl.steps[1].kind, PLAN_STEP_KERNEL);
    const plan_kernel &k = p.pl.kernels[0];
    EXPECT_FALSE(k.member[0]) << "the dot is not the kernel's";
    EXPECT_TRUE(k.member[1]);
    EXPECT_EQ(k.leaf[3], p.pl.steps[0].slots[0]) << "the kernel reads the dot's result";
  }
}

// A scan: one step holding its body's steps; the xs and ys are rows read
// and written in place (row slots of the stacked buffers), the body's
// temporaries lie past the arena of the enclosing function, the carry the
// body computes is copied back into the scan's result slot, and the carry
// it passes through is not copied at all.
TEST(Plan, ScanHoldsItsBodysSteps) {
  Scoped scope;
  plan_policy po = basic();
  Planned p(
      "func @body.fused(%0: f32[8], %1: f32[8], %2: f32[8]) -> (f32[8], f32[8]) {\n"
      "  %3 = mul %0, %1 : f32[8]\n"
      "  %4 = add %3, %2 : f32[8]\n"
      "  %5 = tanh %4 : f32[8]\n"
      "  %6 = exp %5 : f32[8]\n"
      "  return %5, %6\n"
      "}\n"
      "\n"
      "func @f(%0: f32[8], %1: f32[6,8], %2: f32[8]) -> (f32[8], f32[8], f32[6,8]) {\n"
      "  %3, %4, %5 = scan %0, %2, %1 {carry=2, xs=1, length=6, reverse=true} : f32[8], f32[8], f32[6,8]\n"
      "    body func @scan.body(%0: f32[8], %1: f32[8], %2: f32[8]) -> (f32[8], f32[8], f32[8]) {\n"
      "      %3, %4 = fusion @body.fused(%0, %1, %2) : f32[8], f32[8]\n"
      "      return %3, %1, %4\n"
      "    }\n"
      "  return %3, %4, %5\n"
      "}\n",
      "f", po);
  ASSERT_EQ(p.rc, 0) << kiln_last_error();
  const plan &pl = p.pl;
  // the carries copied into the scan's result buffers, then the loop
  ASSERT_EQ(pl.n_steps, 3);
  EXPECT_EQ(pl.steps[0].kind, PLAN_STEP_COPY);
  EXPECT_EQ(pl.steps[1].kind, PLAN_STEP_COPY);
  EXPECT_EQ(p.slot_of(pl.steps[0].slots[0]).kind, PLAN_SLOT_RESULT);
  const plan_step &scan = pl.steps[2];
  ASSERT_EQ(scan.kind, PLAN_STEP_SCAN);
  EXPECT_EQ(scan.trip, 6);
  EXPECT_TRUE(scan.reverse);
  ASSERT_EQ(scan.n_slots, 2) << "the row of xs and the row of ys";
  for (int k = 0; k < 2; k++) {
    const plan_slot &row = p.slot_of(scan.slots[k]);
    EXPECT_EQ(row.kind, PLAN_SLOT_ROW);
    EXPECT_EQ(row.offset, 32) << "8 floats a row";
    EXPECT_EQ(plan_slot_align(&pl, scan.slots[k]), 32);
  }
  EXPECT_EQ(p.slot_of(p.slot_of(scan.slots[0]).index).kind, PLAN_SLOT_PARAM) << "xs read in place";
  EXPECT_EQ(p.slot_of(p.slot_of(scan.slots[1]).index).kind, PLAN_SLOT_RESULT) << "ys written in place";
  // the body: its kernel, then the new carry copied back (w passes through)
  ASSERT_EQ(scan.n_sub[0], 2);
  const plan_step &k = scan.sub[0][0], &back = scan.sub[0][1];
  ASSERT_EQ(k.kind, PLAN_STEP_KERNEL);
  const plan_kernel &g = pl.kernels[k.index];
  ASSERT_EQ(g.n_out, 2);
  EXPECT_EQ(p.slot_of(g.out_slot[0]).kind, PLAN_SLOT_ARENA) << "a body temporary";
  EXPECT_EQ(g.out_slot[1], scan.slots[1]) << "y_t made in its row";
  EXPECT_EQ(g.leaf[2], scan.slots[0]) << "x_t read from its row";
  EXPECT_EQ(g.leaf[0], pl.steps[0].slots[0]) << "the carry read in the scan's result buffer";
  ASSERT_EQ(back.kind, PLAN_STEP_COPY);
  EXPECT_EQ(back.slots[0], pl.steps[0].slots[0]);
  EXPECT_EQ(back.slots[1], g.out_slot[0]);
  EXPECT_EQ(back.bytes, 32);
  EXPECT_EQ(scan.n_sub[1], 0);
}

// A while whose body swaps its state: the swap goes through a temporary
// (no copy overwrites a value a later copy reads); the predicate's steps
// are the first list, the body's the second.
TEST(Plan, WhileSwapsItsStateThroughATemporary) {
  Scoped scope;
  plan_policy po = basic();
  Planned p(
      "func @f(%0: f32[4], %1: f32[4], %2: f32[]) -> (f32[4], f32[4]) {\n"
      "  %3, %4 = while %0, %1, %2 {state=2, max_iterations=3} : f32[4], f32[4]\n"
      "    cond func @while.cond(%0: f32[4], %1: f32[4], %2: f32[]) -> bool[] {\n"
      "      %3 = lt %2, %2 : bool[]\n"
      "      return %3\n"
      "    }\n"
      "    body func @while.body(%0: f32[4], %1: f32[4], %2: f32[]) -> (f32[4], f32[4]) {\n"
      "      return %1, %0\n"
      "    }\n"
      "  return %3, %4\n"
      "}\n",
      "f", po);
  if (p.rc) {
    ADD_FAILURE() << kiln_last_error();
    return;
  }
  const plan &pl = p.pl;
  ASSERT_EQ(pl.n_steps, 3);
  const plan_step &w = pl.steps[2];
  ASSERT_EQ(w.kind, PLAN_STEP_WHILE);
  EXPECT_EQ(w.trip, 3);
  ASSERT_EQ(w.n_sub[0], 1);
  EXPECT_EQ(w.n_sub[0] ? w.sub[0][0].kind : -1, PLAN_STEP_KERNEL);
  EXPECT_EQ(w.slots[0], pl.kernels[w.sub[0][0].index].out_slot[0]) << "the predicate";
  // each result that is another state value goes through a temporary
  // first, then into its place
  ASSERT_EQ(w.n_sub[1], 4);
  int s0 = pl.steps[0].slots[0], s1 = pl.steps[1].slots[0];
  const plan_step *b = w.sub[1];
  for (int i = 0; i < 4; i++) EXPECT_EQ(b[i].kind, PLAN_STEP_COPY);
  EXPECT_EQ(b[0].slots[1], s1);
  EXPECT_EQ(b[1].slots[1], s0);
  EXPECT_EQ(b[2].slots[0], s0);
  EXPECT_EQ(b[2].slots[1], b[0].slots[0]);
  EXPECT_EQ(b[3].slots[0], s1);
  EXPECT_EQ(b[3].slots[1], b[1].slots[0]);
}

}  // namespace

// ---- loop state stored in place (plan_policy.state_in_place) ----

namespace {

bool any_kernel(const plan_kernel *) { return true; }

plan_policy in_place() {
  plan_policy p = basic();
  p.state_in_place = any_kernel;
  return p;
}

int count_copies(const plan_step *steps, int n) {
  int c = 0;
  for (int i = 0; i < n; i++) {
    c += steps[i].kind == PLAN_STEP_COPY;
    for (int b = 0; b < 2; b++) c += count_copies(steps[i].sub[b], steps[i].n_sub[b]);
  }
  return c;
}

const char *ema_scan =
    "func @body.fused(%0: f32[8], %1: f32[8], %2: f32[8]) -> (f32[8], f32[8]) {\n"
    "  %3 = mul %0, %1 : f32[8]\n"
    "  %4 = add %3, %2 : f32[8]\n"
    "  %5 = exp %4 : f32[8]\n"
    "  return %4, %5\n"
    "}\n"
    "\n"
    "func @f(%0: f32[8], %1: f32[6,8], %2: f32[8]) -> (f32[8], f32[8], f32[6,8]) {\n"
    "  %3, %4, %5 = scan %0, %2, %1 {carry=2, xs=1, length=6, reverse=false} : f32[8], f32[8], f32[6,8]\n"
    "    body func @scan.body(%0: f32[8], %1: f32[8], %2: f32[8]) -> (f32[8], f32[8], f32[8]) {\n"
    "      %3, %4 = fusion @body.fused(%0, %1, %2) : f32[8], f32[8]\n"
    "      return %3, %1, %4\n"
    "    }\n"
    "  return %3, %4, %5\n"
    "}\n";

}  // namespace

// c' = c * w + x_t (one kernel reading c at the element it stores): the
// kernel stores c' over the state's slot, and the body copies nothing; a
// policy without the hook keeps the copy back.
TEST(Plan, ElementwiseCarryIsStoredInPlace) {
  Scoped scope;
  plan_policy po = in_place();
  Planned p(ema_scan, "f", po);
  ASSERT_EQ(p.rc, 0) << kiln_last_error();
  const plan &pl = p.pl;
  ASSERT_EQ(pl.n_steps, 3);
  const plan_step &scan = pl.steps[2];
  ASSERT_EQ(scan.kind, PLAN_STEP_SCAN);
  ASSERT_EQ(scan.n_sub[0], 1) << "the kernel alone: no copy per iteration";
  ASSERT_EQ(scan.sub[0][0].kind, PLAN_STEP_KERNEL);
  const plan_kernel &g = pl.kernels[scan.sub[0][0].index];
  int state = pl.steps[0].slots[0];
  EXPECT_EQ(g.out_slot[0], state) << "c' stored over c";
  EXPECT_EQ(g.leaf[0], state) << "c read there";
  EXPECT_EQ(g.out_slot[1], scan.slots[1]) << "y_t still made in its row";
  EXPECT_EQ(count_copies(pl.steps, pl.n_steps), 2) << "the two copies in, before the loop";

  Planned q(ema_scan, "f", basic());
  ASSERT_EQ(q.rc, 0) << kiln_last_error();
  EXPECT_EQ(q.pl.steps[2].n_sub[0], 2) << "without the hook: the kernel, then the copy back";
}

// The state stays where the body still reads it: read by a later step, or
// read across elements by the kernel that updates it (a transpose), or a
// state that another carry returns (a swap): those copy back, as before.
TEST(Plan, CarryReadElsewhereIsCopiedBack) {
  Scoped scope;
  plan_policy po = in_place();
  {
    Planned p(
        "func @f(%0: f32[8], %1: f32[6,8]) -> (f32[8], f32[6,8]) {\n"
        "  %2, %3 = scan %0, %1 {carry=1, xs=1, length=6, reverse=false} : f32[8], f32[6,8]\n"
        "    body func @scan.body(%0: f32[8], %1: f32[8]) -> (f32[8], f32[8]) {\n"
        "      %2 = add %0, %1 : f32[8]\n"
        "      %3 = mul %0, %2 : f32[8]\n"
        "      return %2, %3\n"
        "    }\n"
        "  return %2, %3\n"
        "}\n",
        "f", po);
    ASSERT_EQ(p.rc, 0) << kiln_last_error();
    const plan_step &scan = p.pl.steps[1];
    ASSERT_EQ(scan.n_sub[0], 3) << "add, mul (reading the old c), the copy back";
    EXPECT_EQ(scan.sub[0][2].kind, PLAN_STEP_COPY);
    EXPECT_EQ(scan.sub[0][2].slots[0], p.pl.steps[0].slots[0]);
  }
  {
    Planned p(
        "func @t.fused(%0: f32[4,4]) -> f32[4,4] {\n"
        "  %1 = transpose %0 {perm=[1,0]} : f32[4,4]\n"
        "  %2 = add %0, %1 : f32[4,4]\n"
        "  return %2\n"
        "}\n"
        "\n"
        "func @f(%0: f32[4,4]) -> f32[4,4] {\n"
        "  %1 = while %0 {state=1, max_iterations=3} : f32[4,4]\n"
        "    cond func @while.cond(%0: f32[4,4]) -> bool[] {\n"
        "      %1 = constant dense<true> : bool[]\n"
        "      return %1\n"
        "    }\n"
        "    body func @while.body(%0: f32[4,4]) -> f32[4,4] {\n"
        "      %1 = fusion @t.fused(%0) : f32[4,4]\n"
        "      return %1\n"
        "    }\n"
        "  return %1\n"
        "}\n",
        "f", po);
    ASSERT_EQ(p.rc, 0) << kiln_last_error();
    const plan_step &w = p.pl.steps[1];
    ASSERT_EQ(w.kind, PLAN_STEP_WHILE);
    ASSERT_EQ(w.n_sub[1], 2) << "the kernel reads c across its elements: copied back";
    EXPECT_EQ(w.sub[1][1].kind, PLAN_STEP_COPY);
    EXPECT_NE(p.pl.kernels[w.sub[1][0].index].out_slot[0], p.pl.steps[0].slots[0]);
  }
  {
    // (a, b) -> (b, a + b): a + b may not go over b (the new a is b's old
    // value, copied after the body)
    Planned p(
        "func @f(%0: f32[4], %1: f32[4]) -> (f32[4], f32[4]) {\n"
        "  %2, %3 = while %0, %1 {state=2, max_iterations=3} : f32[4], f32[4]\n"
        "    cond func @while.cond(%0: f32[4], %1: f32[4]) -> bool[] {\n"
        "      %2 = constant dense<true> : bool[]\n"
        "      return %2\n"
        "    }\n"
        "    body func @while.body(%0: f32[4], %1: f32[4]) -> (f32[4], f32[4]) {\n"
        "      %2 = add %0, %1 : f32[4]\n"
        "      return %1, %2\n"
        "    }\n"
        "  return %2, %3\n"
        "}\n",
        "f", po);
    ASSERT_EQ(p.rc, 0) << kiln_last_error();
    const plan_step &w = p.pl.steps[2];
    int a = p.pl.steps[0].slots[0], b = p.pl.steps[1].slots[0];
    ASSERT_GE(w.n_sub[1], 1);
    EXPECT_NE(p.pl.kernels[w.sub[1][0].index].out_slot[0], a);
    EXPECT_NE(p.pl.kernels[w.sub[1][0].index].out_slot[0], b);
    EXPECT_EQ(count_copies(w.sub[1], w.n_sub[1]), 3) << "b through a temporary into a, a + b into b";
  }
}

// ---- a scan of an elementwise body as one kernel (plan_policy.scan_one_kernel) ----

namespace {

bool elementwise_scan(const ir_func *f, const ir_instr *in) { return plan_scan_elementwise(f, in, 16); }

plan_policy one_kernel() {
  plan_policy p = in_place();
  p.scan_one_kernel = elementwise_scan;
  return p;
}

// a scan of carries (c, d), xs x and a capture a: body given
std::string scan_of(const char *body) {
  return std::string(
             "func @f(%0: f32[8], %1: f32[8], %2: f32[5,8], %3: f32[]) -> (f32[8], f32[8], f32[5,8]) {\n"
             "  %4, %5, %6 = scan %0, %1, %2, %3 {carry=2, xs=1, length=5, reverse=true} : f32[8], f32[8], f32[5,8]\n"
             "    body func @scan.body(%0: f32[8], %1: f32[8], %2: f32[8], %3: f32[])"
             " -> (f32[8], f32[8], f32[8]) {\n") +
         body +
         "    }\n"
         "  return %4, %5, %6\n"
         "}\n";
}

}  // namespace

// c' = c * a + x_t, d' = c (a swap), y_t = c': one kernel of the backend's
// own (the scan itself), its operands the leaves and its results the outputs
TEST(Plan, ElementwiseScanIsOneKernel) {
  Scoped scope;
  plan_policy po = one_kernel();
  Planned p(scan_of("      %4 = mul %0, %3 : f32[8]\n"
                    "      %5 = add %4, %2 : f32[8]\n"
                    "      return %5, %0, %5\n")
                .c_str(),
            "f", po);
  ASSERT_EQ(p.rc, 0) << kiln_last_error();
  const plan &pl = p.pl;
  ASSERT_EQ(pl.n_steps, 1) << "no copies in, no loop of steps";
  ASSERT_EQ(pl.steps[0].kind, PLAN_STEP_KERNEL);
  const plan_kernel &g = pl.kernels[pl.steps[0].index];
  ASSERT_NE(g.special, nullptr);
  EXPECT_EQ(g.special->op, OP_SCAN);
  ASSERT_EQ(g.n_out, 3);
  for (int k = 0; k < 3; k++) {
    EXPECT_EQ(p.slot_of(g.out_slot[k]).kind, PLAN_SLOT_RESULT);
    EXPECT_EQ(p.slot_of(g.out_slot[k]).index, k);
  }
  for (int k = 0; k < 4; k++) EXPECT_EQ(p.slot_of(g.leaf[k]).kind, PLAN_SLOT_PARAM) << "operand " << k;
  EXPECT_EQ(pl.n_consts, 0);

  Planned q(scan_of("      %4 = mul %0, %3 : f32[8]\n"
                    "      %5 = add %4, %2 : f32[8]\n"
                    "      return %5, %0, %5\n")
                .c_str(),
            "f", in_place());
  ASSERT_EQ(q.rc, 0) << kiln_last_error();
  EXPECT_EQ(q.pl.steps[q.pl.n_steps - 1].kind, PLAN_STEP_SCAN) << "without the hook: a loop of steps";
}

// Not elementwise along the rows: a carry read across its elements (a
// reduction, a transpose-like broadcast of a varying value), or a body
// longer than the policy's limit: a SCAN step as before.
TEST(Plan, ScanReadingAcrossElementsIsALoop) {
  Scoped scope;
  plan_policy po = one_kernel();
  const char *bodies[] = {
      "      %4 = reduce_sum %0 {axes=[0], keepdims=false} : f32[]\n"
      "      %5 = add %2, %4 : f32[8]\n"
      "      return %5, %1, %5\n",
      "      %4 = add %0, %2 : f32[8]\n"
      "      %5 = exp %4 : f32[8]\n"
      "      %6 = exp %5 : f32[8]\n"
      "      %7 = exp %6 : f32[8]\n"
      "      %8 = exp %7 : f32[8]\n"
      "      %9 = exp %8 : f32[8]\n"
      "      %10 = exp %9 : f32[8]\n"
      "      %11 = exp %10 : f32[8]\n"
      "      %12 = exp %11 : f32[8]\n"
      "      %13 = exp %12 : f32[8]\n"
      "      %14 = exp %13 : f32[8]\n"
      "      %15 = exp %14 : f32[8]\n"
      "      %16 = exp %15 : f32[8]\n"
      "      %17 = exp %16 : f32[8]\n"
      "      %18 = exp %17 : f32[8]\n"
      "      %19 = exp %18 : f32[8]\n"
      "      %20 = exp %19 : f32[8]\n"
      "      return %20, %1, %4\n",
  };
  for (const char *b : bodies) {
    Planned p(scan_of(b).c_str(), "f", po);
    ASSERT_EQ(p.rc, 0) << kiln_last_error();
    EXPECT_EQ(p.pl.steps[p.pl.n_steps - 1].kind, PLAN_STEP_SCAN) << b;
  }
}

// ---- double buffering (plan_policy.swap_state) ----

namespace {

bool yes() { return true; }

plan_policy swapping() {
  plan_policy p = in_place();
  p.swap_state = yes;
  return p;
}

// the moves of a loop step as (to, from) pairs
std::vector<std::pair<int, int>> moves_of(const plan_step &st) {
  std::vector<std::pair<int, int>> v;
  for (int i = 0; i < st.n_move; i++) v.push_back({st.move[2 * i], st.move[2 * i + 1]});
  return v;
}

}  // namespace

// (a, b, n) -> (b, a + b, n + 1): n + 1 made in place, a takes b's place,
// b the place of a + b, and a + b's temporary the place a no longer holds:
// the body copies nothing (a plain swap (a, b) -> (b, a) neither)
TEST(Plan, SwappedStateMovesInsteadOfCopying) {
  Scoped scope;
  plan_policy po = swapping();
  Planned p(
      "func @f(%0: f32[4], %1: f32[4], %2: i64[]) -> (f32[4], f32[4], i64[]) {\n"
      "  %3, %4, %5 = while %0, %1, %2 {state=3, max_iterations=9} : f32[4], f32[4], i64[]\n"
      "    cond func @while.cond(%0: f32[4], %1: f32[4], %2: i64[]) -> bool[] {\n"
      "      %3 = lt %2, %2 : bool[]\n"
      "      return %3\n"
      "    }\n"
      "    body func @while.body(%0: f32[4], %1: f32[4], %2: i64[]) -> (f32[4], f32[4], i64[]) {\n"
      "      %3 = add %0, %1 : f32[4]\n"
      "      %4 = add %2, %2 : i64[]\n"
      "      return %1, %3, %4\n"
      "    }\n"
      "  return %3, %4, %5\n"
      "}\n",
      "f", po);
  ASSERT_EQ(p.rc, 0) << kiln_last_error();
  const plan &pl = p.pl;
  ASSERT_EQ(pl.n_steps, 4);
  const plan_step &w = pl.steps[3];
  ASSERT_EQ(w.kind, PLAN_STEP_WHILE);
  int a = pl.steps[0].slots[0], b = pl.steps[1].slots[0], n = pl.steps[2].slots[0];
  EXPECT_EQ(count_copies(w.sub[1], w.n_sub[1]), 0) << "no copy per iteration";
  ASSERT_EQ(w.n_sub[1], 2);
  int sum = pl.kernels[w.sub[1][0].index].out_slot[0];
  EXPECT_EQ(pl.kernels[w.sub[1][1].index].out_slot[0], n) << "n + 1 in place";
  ASSERT_EQ(w.n_state, 3);
  EXPECT_EQ(w.state[0], a);
  EXPECT_EQ(w.state[1], b);
  EXPECT_EQ(w.state_bytes[2], 8);
  EXPECT_EQ(moves_of(w), (std::vector<std::pair<int, int>>{{a, b}, {b, sum}, {sum, a}}));

  Planned q(
      "func @f(%0: f32[4], %1: f32[4]) -> (f32[4], f32[4]) {\n"
      "  %2, %3 = while %0, %1 {state=2, max_iterations=3} : f32[4], f32[4]\n"
      "    cond func @while.cond(%0: f32[4], %1: f32[4]) -> bool[] {\n"
      "      %2 = constant dense<true> : bool[]\n"
      "      return %2\n"
      "    }\n"
      "    body func @while.body(%0: f32[4], %1: f32[4]) -> (f32[4], f32[4]) {\n"
      "      return %1, %0\n"
      "    }\n"
      "  return %2, %3\n"
      "}\n",
      "f", po);
  ASSERT_EQ(q.rc, 0) << kiln_last_error();
  const plan_step &s = q.pl.steps[2];
  int qa = q.pl.steps[0].slots[0], qb = q.pl.steps[1].slots[0];
  EXPECT_EQ(s.n_sub[1], 0) << "a swap is two moves";
  EXPECT_EQ(moves_of(s), (std::vector<std::pair<int, int>>{{qa, qb}, {qb, qa}}));
}

// A carry that is also a ys (an LSTM's h): the state takes the place of the
// row just written (no copy); a carry that is a capture, or that two
// carries return, is copied into a temporary of its own, which then moves
TEST(Plan, CarryAlsoAYsTakesItsRow) {
  Scoped scope;
  plan_policy po = swapping();
  Planned p(
      "func @f(%0: f32[16], %1: f32[16], %2: f32[6,16], %3: f32[16]) -> (f32[16], f32[16], f32[6,16]) {\n"
      "  %4, %5, %6 = scan %0, %1, %2, %3 {carry=2, xs=1, length=6, reverse=false} : f32[16], f32[16], f32[6,16]\n"
      "    body func @scan.body(%0: f32[16], %1: f32[16], %2: f32[16], %3: f32[16]) -> (f32[16], f32[16], f32[16]) {\n"
      "      %4 = mul %0, %2 : f32[16]\n"
      "      %5 = mul %4, %1 : f32[16]\n"
      "      return %5, %3, %5\n"
      "    }\n"
      "  return %4, %5, %6\n"
      "}\n",
      "f", po);
  ASSERT_EQ(p.rc, 0) << kiln_last_error();
  const plan &pl = p.pl;
  const plan_step &sc = pl.steps[pl.n_steps - 1];
  ASSERT_EQ(sc.kind, PLAN_STEP_SCAN);
  int h = pl.steps[0].slots[0], w = pl.steps[1].slots[0], row = sc.slots[1];
  ASSERT_EQ(sc.n_sub[0], 3) << "two kernels, and the capture copied into a temporary";
  EXPECT_EQ(pl.kernels[sc.sub[0][1].index].out_slot[0], row) << "h' made in its row of ys";
  const plan_step &c = sc.sub[0][2];
  ASSERT_EQ(c.kind, PLAN_STEP_COPY);
  EXPECT_EQ(pl.slots[c.slots[1]].kind, PLAN_SLOT_PARAM) << "the capture";
  EXPECT_EQ(pl.slots[c.slots[1]].index, 3);
  // the temporary takes w's old place, never h's (a row from the second
  // iteration on)
  EXPECT_EQ(moves_of(sc), (std::vector<std::pair<int, int>>{{h, row}, {w, c.slots[0]}, {c.slots[0], w}}));
}
