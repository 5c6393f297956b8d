// donate_test.cc — buffer donation: a staged call that assigns a variable
// whose old value nothing else holds writes the new value over the old one
// in place (cpu_program_donor decides where that is safe, cpu_run_donating
// does it, run_trace offers the variables' buffers). Checked: which results
// get a donor and which must not, that donated runs compute what fresh
// buffers do, that the variable's buffer is reused only when nobody else
// sees it, and that a failing call leaves the variable as it was.
#include <gtest/gtest.h>
#include <kiln.h>

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "cpu/cpu.h"
#include "ir.h"
#include "test_util.h"

using namespace kiln_test;

namespace {

struct Program {
  ir_module *m = nullptr;
  cpu_program *p = nullptr;
  explicit Program(const char *text) {
    m = ir_parse(text, "donate.kir");
    EXPECT_NE(m, nullptr) << kiln_last_error() << "\n" << text;
    if (m) p = cpu_compile(ir_module_find(m, "f"));
    EXPECT_NE(p, nullptr) << kiln_last_error() << "\n" << text;
  }
  ~Program() {
    cpu_program_free(p);
    ir_module_free(m);
  }
  int donor(int r) const { return cpu_program_donor(p, r); }
};

TEST(Donation, WhichResultsMayBeWrittenOverWhichParameters) {
  Scoped s;
  struct Case {
    const char *what, *text;
    std::vector<int> donors;
  };
  const Case cases[] = {
      {"an SGD update: the weight, read at the element written",
       "func @f(%w: f32[8,8], %g: f32[8,8], %lr: f32[]) -> f32[8,8] {\n"
       "  %s = mul %g, %lr : f32[8,8]\n"
       "  %n = sub %w, %s : f32[8,8]\n"
       "  return %n\n"
       "}\n",
       {0}},
      {"a later step reads the weight: the gradient's buffer instead; the last kernel, which reads neither, "
       "may take the weight's",
       "func @f(%w: f32[8,8], %g: f32[8,8]) -> (f32[8,8], f32[8,8]) {\n"
       "  %n = sub %w, %g : f32[8,8]\n"
       "  %t = transpose %w {perm=[1,0]} : f32[8,8]\n"
       "  %m = add %n, %t : f32[8,8]\n"
       "  return %n, %m\n"
       "}\n",
       {1, 0}},
      {"the kernel reads the weight transposed: not in place",
       "func @k(%w: f32[8,8], %g: f32[8]) -> f32[8,8] {\n"
       "  %t = transpose %w {perm=[1,0]} : f32[8,8]\n"
       "  %n = add %t, %g : f32[8,8]\n"
       "  return %n\n"
       "}\n"
       "func @f(%w: f32[8,8], %g: f32[8]) -> f32[8,8] {\n"
       "  %r = fusion @k(%w, %g) : f32[8,8]\n"
       "  return %r\n"
       "}\n",
       {-1}},
      {"the weight itself is returned too",
       "func @f(%w: f32[8,8], %g: f32[8]) -> (f32[8,8], f32[8,8]) {\n"
       "  %n = sub %w, %g : f32[8,8]\n"
       "  return %n, %w\n"
       "}\n",
       {-1, -1}},
      {"a later kernel can fail (integer division by zero)",
       "func @f(%w: i32[8], %g: i32[8]) -> (i32[8], i32[8]) {\n"
       "  %n = sub %w, %g : i32[8]\n"
       "  %d = div %n, %g : i32[8]\n"
       "  return %n, %d\n"
       "}\n",
       {-1, -1}},
      {"a runtime helper (a long matmul) runs after",
       "func @f(%w: f32[32,32], %g: f32[32,32]) -> (f32[32,32], f32[32,32]) {\n"
       "  %n = sub %w, %g : f32[32,32]\n"
       "  %d = dot %g, %g : f32[32,32]\n"
       "  return %n, %d\n"
       "}\n",
       {-1, -1}},
      {"a kernel of two outputs",
       "func @k(%w: f32[8], %g: f32[8]) -> (f32[8], f32[8]) {\n"
       "  %n = sub %w, %g : f32[8]\n"
       "  %m = mul %w, %g : f32[8]\n"
       "  return %n, %m\n"
       "}\n"
       "func @f(%w: f32[8], %g: f32[8]) -> (f32[8], f32[8]) {\n"
       "  %n, %m = fusion @k(%w, %g) : f32[8], f32[8]\n"
       "  return %n, %m\n"
       "}\n",
       {-1, -1}},
      {"another dtype or shape never",
       "func @f(%w: f64[8], %g: f32[2,4]) -> f32[8] {\n"
       "  %c = convert %w {dtype=f32} : f32[8]\n"
       "  return %c\n"
       "}\n",
       {-1}},
  };
  for (const Case &c : cases) {
    Program prog(c.text);
    if (!prog.p) continue;
    for (size_t r = 0; r < c.donors.size(); r++) EXPECT_EQ(prog.donor((int)r), c.donors[r]) << c.what << ", result " << r;
  }
}

TEST(Donation, InPlaceRunsComputeWhatFreshBuffersDo) {
  Scoped s;
  // narrow rows, a flat kernel split over the thread pool, an inline dot
  const char *text =
      "func @k(%x: f32[300,1], %dy: f32[1,700], %lr: f32[], %w: f32[300,700]) -> f32[300,700] {\n"
      "  %g = dot %x, %dy : f32[300,700]\n"
      "  %s = mul %g, %lr : f32[300,700]\n"
      "  %n = sub %w, %s : f32[300,700]\n"
      "  return %n\n"
      "}\n"
      "func @f(%x: f32[300,1], %dy: f32[1,700], %lr: f32[], %w: f32[300,700], %b: f32[300,2], %db: f32[300,2]) "
      "-> (f32[300,700], f32[300,2]) {\n"
      "  %n = fusion @k(%x, %dy, %lr, %w) : f32[300,700]\n"
      "  %m = sub %b, %db : f32[300,2]\n"
      "  return %n, %m\n"
      "}\n";
  Program prog(text);
  ASSERT_NE(prog.p, nullptr);
  EXPECT_EQ(prog.donor(0), 3);
  EXPECT_EQ(prog.donor(1), 4);
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> u(-1, 1);
  auto rand = [&](V64 shape) {
    kiln_tensor *t = kiln_zeros(KILN_F32, (int)shape.size(), shape.data());
    float *d = (float *)kiln_tensor_data(t);
    for (int64_t i = 0; i < kiln_tensor_size(t); i++) d[i] = u(rng);
    return t;
  };
  std::vector<kiln_tensor *> args = {rand({300, 1}), rand({1, 700}), kiln_scalar(KILN_F32, 0.25),
                                     rand({300, 700}), rand({300, 2}), rand({300, 2})};
  kiln_tensor *fresh[2], *inplace[2];
  ASSERT_EQ(cpu_run(prog.p, args.data(), fresh), 0) << kiln_last_error();
  EXPECT_NE(fresh[0], args[3]);
  bool donate[6] = {false, false, false, true, true, false};
  ASSERT_EQ(cpu_run_donating(prog.p, args.data(), inplace, donate), 0) << kiln_last_error();
  EXPECT_EQ(inplace[0], args[3]);  // the same tensor, written over
  EXPECT_EQ(inplace[1], args[4]);
  EXPECT_EQ(values(inplace[0]), values(fresh[0]));
  EXPECT_EQ(values(inplace[1]), values(fresh[1]));
  // a parameter not offered keeps its buffer
  bool only_b[6] = {false, false, false, false, true, false};
  kiln_tensor *w_before = args[3], *third[2];
  ASSERT_EQ(cpu_run_donating(prog.p, args.data(), third, only_b), 0) << kiln_last_error();
  EXPECT_NE(third[0], w_before);
  EXPECT_EQ(third[1], args[4]);
}

// ---- through the public API: variables assigned by a staged call ----

struct Sgd {
  kiln_variable *w;
};

int sgd_step(void *user, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  Sgd *m = (Sgd *)user;
  kiln_tensor *w = kiln_variable_read(m->w);
  kiln_tensor *loss = kiln_reduce_sum(kiln_mul(w, in[0]), 0, nullptr, false);
  if (kiln_variable_assign_sub(m->w, kiln_mul(in[0], kiln_scalar(KILN_F32, 0.5)))) return -1;
  out[0] = loss;
  return out[0] ? 0 : -1;
}

const void *data_of(kiln_variable *v) {
  kiln_scope_push();
  const void *d = kiln_tensor_data(kiln_variable_read(v));
  kiln_scope_pop();
  return d;
}

TEST(Donation, AVariableNothingElseHoldsIsUpdatedInPlace) {
  Scoped s;
  Owned own;
  std::vector<float> w0(4096), x0(4096);
  for (int i = 0; i < 4096; i++) w0[i] = (float)(i % 17) - 8, x0[i] = (float)(i % 5) * 0.25f;
  Sgd m = {own.var(f32({64, 64}, w0), "w")};
  kiln_function *f = kiln_function_new("sgd", sgd_step, &m, 1, 1);
  kiln_tensor *x = f32({64, 64}, x0), *loss = nullptr;
  const void *before = data_of(m.w);
  ASSERT_EQ(kiln_function_call(f, &x, &loss), 0) << kiln_last_error();
  ASSERT_EQ(kiln_function_call(f, &x, &loss), 0) << kiln_last_error();
  kiln_stats st = {};
  kiln_function_stats(f, 0, &st);
  if (st.compile_ms > 0) {
    EXPECT_EQ(data_of(m.w), before) << "compiled calls update the weight in place";
  }
  kiln_scope_push();
  VD got = values(kiln_variable_read(m.w));
  kiln_scope_pop();
  for (int i = 0; i < 4096; i++) ASSERT_EQ(got[i], (double)(w0[i] - 2 * (x0[i] * 0.5f))) << i;
  kiln_function_free(f);
}

TEST(Donation, AHeldOldValueIsNeverWrittenOver) {
  Scoped s;
  Owned own;
  std::vector<float> w0(256, 3.0f);
  Sgd m = {own.var(f32({16, 16}, w0), "w")};
  kiln_function *f = kiln_function_new("sgd", sgd_step, &m, 1, 1);
  kiln_tensor *x = f32({16, 16}, std::vector<float>(256, 1.0f)), *loss = nullptr;
  kiln_tensor *held = kiln_variable_read(m.w);  // the caller keeps the old value
  ASSERT_EQ(kiln_function_call(f, &x, &loss), 0) << kiln_last_error();
  EXPECT_EQ(values(held), VD(256, 3.0));
  kiln_tensor *now = kiln_variable_read(m.w);
  EXPECT_NE(kiln_tensor_data(now), kiln_tensor_data(held));
  EXPECT_EQ(values(now), VD(256, 2.5));
  EXPECT_EQ(kiln_tensor_item(loss), 3.0 * 256);
  kiln_function_free(f);
}

int update_then_gather(void *user, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  Sgd *m = (Sgd *)user;
  if (kiln_variable_assign_sub(m->w, kiln_scalar(KILN_F32, 1))) return -1;
  out[0] = kiln_gather(kiln_variable_read(m->w), in[0], 0);  // fails on a bad index
  return out[0] ? 0 : -1;
}

TEST(Donation, AFailedCallLeavesTheVariableAsItWas) {
  Scoped s;
  Owned own;
  Sgd m = {own.var(f32({4}, {1, 2, 3, 4}), "w")};
  kiln_function *f = kiln_function_new("update_then_gather", update_then_gather, &m, 1, 1);
  const int64_t one = 1, two = 2, nine = 9;
  kiln_tensor *good = kiln_tensor_new(KILN_I64, 1, &one, &two), *out = nullptr;
  ASSERT_NE(good, nullptr) << kiln_last_error();
  ASSERT_EQ(kiln_function_call(f, &good, &out), 0) << kiln_last_error();
  EXPECT_EQ(values(out), VD{2});
  kiln_tensor *bad = kiln_tensor_new(KILN_I64, 1, &one, &nine);
  EXPECT_EQ(kiln_function_call(f, &bad, &out), -1);
  EXPECT_NE(std::string(kiln_last_error()).find("gather"), std::string::npos) << kiln_last_error();
  kiln_scope_push();
  EXPECT_EQ(values(kiln_variable_read(m.w)), (VD{0, 1, 2, 3}));
  kiln_scope_pop();
  kiln_function_free(f);
}

}  // namespace
