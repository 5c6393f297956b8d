// digits_bugs_test.cc — Kiln bugs that examples/digits_cnn.c ran into, each
// as the smallest program that showed it, compiled against eager.
//
// A dot that reads a transposed operand in place (backends/plan/plan.c,
// plan_policy.dot_transposes) read the transpose's source after the
// buffers pass had given the source's arena bytes to an instruction in
// between: the digits training step's dense-layer gradient (dot of the
// flattened features, transposed, and the logits' gradient, fused with
// Adam's update) read bytes conv2d_backprop_filter had written, and 1425 of
// dense/w's 2560 elements moved the wrong way in the first compiled step.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "test_util.h"

using namespace kiln_test;

namespace {

std::vector<float> read_f32(kiln_tensor *t) {
  std::vector<float> v((size_t)kiln_tensor_size(t));
  EXPECT_EQ(kiln_tensor_read(t, v.data(), v.size() * sizeof(float)), 0) << kiln_last_error();
  return v;
}

// in: a [32, 64], d [32, 10], q [32, 64], w [64, 256]. h = a @ w and
// z = q @ w are arena temporaries of one size, z made after h's last
// reader as the buffers pass sees it (the transpose), so z takes h's bytes;
// the dot of transpose(h) and d (with an epilogue that keeps it a separate
// call before its fusion's kernel) runs after z.
int transposed_after_reuse(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  kiln_tensor *h = kiln_matmul(in[0], in[3]);
  kiln_tensor *ht = kiln_transpose(h, 0, nullptr);
  kiln_tensor *z = kiln_matmul(in[2], in[3]);
  out[1] = kiln_reduce_sum(kiln_mul(z, z), KILN_AXES(1), false);
  kiln_tensor *g = kiln_matmul(ht, in[1]);
  out[0] = kiln_add(kiln_mul(g, g), kiln_mul(g, kiln_scalar(KILN_F32, 0.5)));
  return out[0] && out[1] ? 0 : -1;
}

TEST(DigitsBugs, DotReadsATransposeInPlaceOnlyWhileItsSourceIsIntact) {
  Scoped s;
  kiln_random_seed(1);
  kiln_tensor *in[4] = {kiln_random_normal(KILN_F32, KILN_SHAPE(32, 64)), kiln_random_normal(KILN_F32, KILN_SHAPE(32, 10)),
                        kiln_random_normal(KILN_F32, KILN_SHAPE(32, 64)), kiln_random_normal(KILN_F32, KILN_SHAPE(64, 256))};
  kiln_tensor *eager[2] = {nullptr, nullptr}, *staged[2] = {nullptr, nullptr};
  ASSERT_EQ(transposed_after_reuse(nullptr, 4, in, 2, eager), 0) << kiln_last_error();
  kiln_function *f = kiln_function_new("transposed_after_reuse", transposed_after_reuse, nullptr, 4, 2);
  ASSERT_NE(f, nullptr) << kiln_last_error();
  ASSERT_EQ(kiln_function_call(f, in, staged), 0) << kiln_last_error();
  for (int k = 0; k < 2; k++) {
    SCOPED_TRACE(k);
    std::vector<float> e = read_f32(eager[k]), st = read_f32(staged[k]);
    ASSERT_EQ(e.size(), st.size());
    double worst = 0;
    for (size_t i = 0; i < e.size(); i++)
      worst = std::max(worst, std::fabs((double)e[i] - st[i]) / std::max(1.0, std::fabs((double)e[i])));
    EXPECT_LT(worst, 1e-4);  // was 1.3e7 in absolute terms
  }
  kiln_function_free(f);
}

}  // namespace
