// resnet_test.cc — the ResNet of bench/resnet_model.h (bench_resnet's
// model, torchvision's resnet50 in Kiln's public API): a small ResNet in
// f64 gives the same inference logits, training loss, gradients and
// weights after SGD-momentum steps eagerly and staged, and the same as
// PyTorch (torchvision's Bottleneck blocks, bench/resnet_torch.py --check)
// where /usr/bin/python3 imports torch and torchvision; ResNet-50's shape
// (25,557,032 parameters, as torchvision's); bad inputs fail with errors.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <string>

#include "../bench/resnet_model.h"
#include "test_util.h"

using namespace kiln_test;

namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;

// bench/resnet_torch.py, found from this source file (__FILE__ is relative
// to the build directory, where the test binary lives, when ccache rewrites
// it). KILN_RESNET_TORCH overrides the path.
std::string torch_script() {
  if (const char *env = std::getenv("KILN_RESNET_TORCH")) return env;
  return source_dir(__FILE__) + "../bench/resnet_torch.py";
}

kiln_tensor *normal(kiln_dtype dt, const V64 &shape) { return kiln_random_normal(dt, (int)shape.size(), shape.data()); }

bool torch_available() {
  return std::system("/usr/bin/python3 -c 'import torch, torchvision, numpy' >/dev/null 2>&1") == 0;
}

TEST(Resnet, EagerEqualsStaged) {
  Scoped s;
  char report[16384];
  int bad = resnet_check(nullptr, nullptr, 1e-9, report, sizeof report);
  EXPECT_EQ(bad, 0) << report;
  EXPECT_THAT(report, HasSubstr("worst relative difference eager vs staged"));
}

// Kiln == PyTorch; then the check must notice a PyTorch answer that differs
// (one result perturbed, one missing), rerun against the files PyTorch
// wrote the first time (the check is seeded, so Kiln's side is the same).
TEST(Resnet, MatchesPyTorch) {
  if (!torch_available())
    GTEST_SKIP() << "/usr/bin/python3 cannot import torch, torchvision and numpy: install python3-torch, "
                    "python3-torchvision and python3-numpy";
  Scoped s;
  char dir[] = "/tmp/kiln_resnet_test_XXXXXX";
  ASSERT_NE(mkdtemp(dir), nullptr);
  std::string cmd = "/usr/bin/python3 '" + torch_script() + "' --check";
  char report[16384];
  int bad = resnet_check(cmd.c_str(), dir, 1e-9, report, sizeof report);
  EXPECT_EQ(bad, 0) << report;
  EXPECT_THAT(report, HasSubstr("Kiln vs PyTorch"));

  std::string bias = std::string(dir) + "/torch.final.fc.bias.npy";
  kiln_tensor *b = rn_load_npy(bias.c_str());
  ASSERT_NE(b, nullptr) << kiln_last_error();
  ASSERT_EQ(rn_save_npy(bias.c_str(), kiln_add(b, kiln_scalar_like(b, 1e-6))), 0) << kiln_last_error();
  bad = resnet_check("true", dir, 1e-9, report, sizeof report);
  EXPECT_EQ(bad, 1) << report;
  EXPECT_THAT(report, HasSubstr("fc.bias after 2 steps, Kiln vs PyTorch: relative difference"));

  std::string grad = std::string(dir) + "/torch.grad.conv1.weight.npy";
  ASSERT_EQ(std::remove(grad.c_str()), 0);
  bad = resnet_check("true", dir, 1e-9, report, sizeof report);
  EXPECT_EQ(bad, 2) << report;
  EXPECT_THAT(report, HasSubstr("gradient of conv1.weight, Kiln vs PyTorch: relative difference inf"));
  EXPECT_EQ(std::system(("rm -rf '" + std::string(dir) + "'").c_str()), 0);
}

// ResNet-50: torchvision's resnet50 has 25,557,032 parameters and 4.09 G
// multiply-adds per 224x224 image; the logits of a small image are [1, 1000].
TEST(Resnet, Resnet50Shape) {
  Scoped s;
  resnet_config cfg = resnet50_config();
  kiln_random_seed(1);
  resnet_model *m = resnet_new(&cfg, nullptr);
  ASSERT_NE(m, nullptr) << kiln_last_error();
  EXPECT_EQ(m->params, 25557032);
  EXPECT_EQ(m->ntrain, 161);
  EXPECT_EQ(m->nvars, 161 + 2 * 53);
  EXPECT_NEAR(m->flops / 2, 4.09e9, 0.01e9);
  EXPECT_STREQ(kiln_variable_name(m->vars[0]), "conv1.weight");
  EXPECT_STREQ(kiln_variable_name(m->vars[m->nvars - 1]), "fc.bias");
  kiln_tensor *x = normal(KILN_F32, {1, 64, 64, 3});
  kiln_tensor *logits = resnet_forward(m, x, false, false);
  ASSERT_NE(logits, nullptr) << kiln_last_error();
  EXPECT_EQ(shape_of(logits), (V64{1, 1000}));
  resnet_free(m);
}

TEST(Resnet, BadInputs) {
  Scoped s;
  resnet_config cfg = resnet_check_config();
  kiln_random_seed(2);
  resnet_model *m = resnet_new(&cfg, nullptr);
  ASSERT_NE(m, nullptr) << kiln_last_error();
  // four channels where the stem conv wants three
  kiln_tensor *x4 = normal(KILN_F64, {2, 32, 32, 4});
  EXPECT_EQ(resnet_forward(m, x4, true, false), nullptr);
  EXPECT_THAT(kiln_last_error(), StartsWith("conv2d"));
  kiln_clear_error();
  // f32 images for f64 weights
  kiln_tensor *x32 = normal(KILN_F32, {2, 32, 32, 3});
  EXPECT_EQ(resnet_forward(m, x32, false, false), nullptr);
  EXPECT_STRNE(kiln_last_error(), "");
  kiln_clear_error();
  EXPECT_EQ(resnet_forward(m, nullptr, false, false), nullptr);
  kiln_clear_error();
  // labels out of range fail the loss
  kiln_tensor *x = normal(KILN_F64, {2, 32, 32, 3});
  kiln_tensor *labels = make<int64_t>(KILN_I64, {2}, {1, 10});
  kiln_tensor *loss = nullptr, *grads[RN_MAX_VARS] = {};
  EXPECT_EQ(resnet_loss_grads(m, x, labels, false, &loss, grads), -1);
  EXPECT_STRNE(kiln_last_error(), "");
  kiln_clear_error();
  // .npy files: missing, not one, and a round trip
  EXPECT_EQ(rn_load_npy("/nonexistent/kiln.npy"), nullptr);
  EXPECT_THAT(kiln_last_error(), StartsWith("load_npy: cannot open"));
  kiln_clear_error();
  char dir[] = "/tmp/kiln_resnet_test_XXXXXX";
  ASSERT_NE(mkdtemp(dir), nullptr);
  std::string junk = std::string(dir) + "/junk.npy", good = std::string(dir) + "/good.npy";
  FILE *f = std::fopen(junk.c_str(), "wb");
  ASSERT_NE(f, nullptr);
  std::fputs("not numpy", f);
  std::fclose(f);
  EXPECT_EQ(rn_load_npy(junk.c_str()), nullptr);
  EXPECT_THAT(kiln_last_error(), StartsWith("load_npy:"));
  kiln_clear_error();
  kiln_tensor *t = normal(KILN_F32, {2, 3, 5});
  ASSERT_EQ(rn_save_npy(good.c_str(), t), 0) << kiln_last_error();
  kiln_tensor *back = rn_load_npy(good.c_str());
  ASSERT_NE(back, nullptr) << kiln_last_error();
  EXPECT_EQ(shape_of(back), (V64{2, 3, 5}));
  EXPECT_EQ(rn_rel_diff(back, t), 0);
  EXPECT_EQ(rn_save_npy(good.c_str(), kiln_zeros(KILN_BOOL, 1, V64{2}.data())), -1);
  EXPECT_THAT(kiln_last_error(), HasSubstr("is not f32, f64 or i64"));
  kiln_clear_error();
  EXPECT_EQ(std::system(("rm -rf '" + std::string(dir) + "'").c_str()), 0);
  resnet_free(m);
}

// The CPU arena against the buffers pass's plan on this small ResNet (its
// inference and gradient functions) is checked in tests/arena_test.cc.

}  // namespace
