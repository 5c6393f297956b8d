// digits_cnn_test.cc — examples/digits_cnn.c's pieces: the checked-in digits
// files (examples/data/, scripts/make_digits.py) load with their shapes,
// ranges and class balance, and bad files fail with an error; the convnet's
// training step (examples/digits_model.h: conv2d, max_pool2d, dense, sparse
// softmax cross-entropy, Adam) gives the same losses and weights eagerly
// and staged, and its loss goes down. (The compiled step once moved most of
// dense/w the wrong way: tests/digits_bugs_test.cc.)
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include <unistd.h>

#include "../examples/digits_data.h"
#include "../examples/digits_model.h"
#include "test_util.h"

using namespace kiln_test;

namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;

std::vector<float> floats(kiln_tensor *t) {
  std::vector<float> v((size_t)kiln_tensor_size(t));
  EXPECT_EQ(kiln_tensor_read(t, v.data(), v.size() * sizeof(float)), 0) << kiln_last_error();
  return v;
}

std::vector<int64_t> longs(kiln_tensor *t) {
  std::vector<int64_t> v((size_t)kiln_tensor_size(t));
  EXPECT_EQ(kiln_tensor_read(t, v.data(), v.size() * sizeof(int64_t)), 0) << kiln_last_error();
  return v;
}

std::vector<int64_t> shape_of(kiln_tensor *t) {
  return std::vector<int64_t>(kiln_tensor_shape(t), kiln_tensor_shape(t) + kiln_tensor_rank(t));
}

TEST(DigitsCnn, DataFilesLoadWithTheirShapes) {
  Scoped s;
  const int64_t sizes[2] = {1437, 360};
  const char *splits[2] = {"train", "test"};
  for (int k = 0; k < 2; k++) {
    SCOPED_TRACE(splits[k]);
    kiln_tensor *x = nullptr, *y = nullptr;
    ASSERT_EQ(digits_load(nullptr, splits[k], &x, &y), 0) << kiln_last_error();
    EXPECT_EQ(kiln_tensor_dtype(x), KILN_F32);
    EXPECT_EQ(kiln_tensor_dtype(y), KILN_I64);
    EXPECT_EQ(shape_of(x), (std::vector<int64_t>{sizes[k], 8, 8, 1}));
    EXPECT_EQ(shape_of(y), (std::vector<int64_t>{sizes[k]}));
    std::vector<float> px = floats(x);
    float lo = 1, hi = 0;
    for (float p : px) {
      lo = std::min(lo, p), hi = std::max(hi, p);
      ASSERT_EQ(p * 16, std::round(p * 16)) << "a pixel that is not n/16";
    }
    EXPECT_EQ(lo, 0.0f);
    EXPECT_EQ(hi, 1.0f);
    // a stratified split: each class holds about a tenth of the images
    std::vector<int> count(10, 0);
    for (int64_t l : longs(y)) {
      ASSERT_GE(l, 0);
      ASSERT_LT(l, 10);
      count[(size_t)l]++;
    }
    for (int c = 0; c < 10; c++) {
      EXPECT_GE(count[(size_t)c], sizes[k] / 10 - 4) << "class " << c;
      EXPECT_LE(count[(size_t)c], sizes[k] / 10 + 4) << "class " << c;
    }
  }
}

void write_file(const std::string &path, const std::string &bytes) {
  FILE *f = std::fopen(path.c_str(), "wb");
  ASSERT_NE(f, nullptr);
  std::fwrite(bytes.data(), 1, bytes.size(), f);
  std::fclose(f);
}

// A .npy file (version 1) with the header dict text, padded as NumPy does.
std::string npy(const std::string &dict, const std::string &data) {
  std::string h = dict;
  while ((10 + h.size() + 1) % 64) h += ' ';
  h += '\n';
  std::string out = std::string("\x93NUMPY\x01\x00", 8);
  out += (char)(h.size() & 0xff);
  out += (char)(h.size() >> 8);
  return out + h + data;
}

TEST(DigitsCnn, BadDataFilesFailWithAnError) {
  Scoped s;
  kiln_tensor *x = nullptr, *y = nullptr;
  EXPECT_EQ(digits_load("/nonexistent/digits", "train", &x, &y), -1);
  EXPECT_THAT(kiln_last_error(), StartsWith("digits: cannot open /nonexistent/digits/digits_train_images.npy"));

  char dir[] = "/tmp/digits_test_XXXXXX";
  ASSERT_NE(mkdtemp(dir), nullptr);
  const std::string d = dir, img = d + "/digits_bad_images.npy", lab = d + "/digits_bad_labels.npy";
  const std::string pixels(2 * 64, '\x03'), labels("\x01\x07", 2);
  struct Case {
    std::string images, labels, error;
  } cases[] = {
      {"not a npy file at all", npy("{'descr': '|u1', 'fortran_order': False, 'shape': (2,), }", labels),
       "is not a .npy file"},
      {npy("{'descr': '<f4', 'fortran_order': False, 'shape': (2, 8, 8, 1), }", pixels),
       npy("{'descr': '|u1', 'fortran_order': False, 'shape': (2,), }", labels), "dtype is not uint8"},
      {npy("{'descr': '|u1', 'fortran_order': True, 'shape': (2, 8, 8, 1), }", pixels),
       npy("{'descr': '|u1', 'fortran_order': False, 'shape': (2,), }", labels), "not in C order"},
      {npy("{'descr': '|u1', 'fortran_order': False, 'shape': (3, 8, 8, 1), }", pixels),
       npy("{'descr': '|u1', 'fortran_order': False, 'shape': (2,), }", labels), "fewer found"},
      {npy("{'descr': '|u1', 'fortran_order': False, 'shape': (2, 8, 8, 1), }", pixels + "x"),
       npy("{'descr': '|u1', 'fortran_order': False, 'shape': (2,), }", labels), "bytes after the data"},
      {npy("{'descr': '|u1', 'fortran_order': False, 'shape': (2, 8, 8, 1), }", pixels),
       npy("{'descr': '|u1', 'fortran_order': False, 'shape': (3,), }", labels + "\x01"), "are not [n, 8, 8, 1]"},
      {npy("{'descr': '|u1', 'fortran_order': False, 'shape': (2, 64), }", pixels),
       npy("{'descr': '|u1', 'fortran_order': False, 'shape': (2,), }", labels), "are not [n, 8, 8, 1]"},
      {npy("{'descr': '|u1', 'fortran_order': False, 'shape': (2, 8, 8, 1), }", pixels),
       npy("{'descr': '|u1', 'fortran_order': False, 'shape': (2,), }", "\x01\x0a"), "a label above 9"},
      {npy("{'descr': '|u1', 'fortran_order': False, 'shape': (2, 8, 8, 1, 1), }", pixels),
       npy("{'descr': '|u1', 'fortran_order': False, 'shape': (2,), }", labels), "bad shape"},
      {std::string("\x93NUMPY\x09\x00\x00\x00", 10), labels, "format version 9"},
  };
  for (const Case &c : cases) {
    SCOPED_TRACE(c.error);
    write_file(img, c.images);
    write_file(lab, c.labels);
    kiln_clear_error();
    x = y = nullptr;
    EXPECT_EQ(digits_load(dir, "bad", &x, &y), -1);
    EXPECT_THAT(kiln_last_error(), StartsWith("digits: "));
    EXPECT_THAT(kiln_last_error(), HasSubstr(c.error));
  }
  // and the good case of the same shape loads
  write_file(img, npy("{'descr': '|u1', 'fortran_order': False, 'shape': (2, 8, 8, 1), }", pixels));
  write_file(lab, npy("{'descr': '|u1', 'fortran_order': False, 'shape': (2,), }", labels));
  ASSERT_EQ(digits_load(dir, "bad", &x, &y), 0) << kiln_last_error();
  EXPECT_EQ(floats(x)[5], 3.0f / 16);
  EXPECT_EQ(longs(y), (std::vector<int64_t>{1, 7}));
  std::remove(img.c_str());
  std::remove(lab.c_str());
  rmdir(dir);
}

struct Staged {
  digits_model *m;
  kiln_optimizer *opt;
};

int staged_step(void *user, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  Staged *s = static_cast<Staged *>(user);
  return digits_train_step(s->m, s->opt, in[0], in[1], &out[0]);
}

// STEPS training steps on the first 32 images, eagerly (f null) or staged.
enum { STEPS = 10, B = 32 };

void train(kiln_function *f, digits_model *m, kiln_optimizer *opt, kiln_tensor *x, kiln_tensor *y,
           std::vector<double> *losses) {
  const int64_t xb[4] = {0, 0, 0, 0}, xn[4] = {B, -1, -1, -1}, yb[1] = {0}, yn[1] = {B};
  for (int i = 0; i < STEPS; i++) {
    kiln_scope_push();
    kiln_tensor *in[2] = {kiln_slice(x, xb, xn), kiln_slice(y, yb, yn)};
    kiln_tensor *loss = nullptr;
    int rc = f ? kiln_function_call(f, in, &loss) : digits_train_step(m, opt, in[0], in[1], &loss);
    EXPECT_EQ(rc, 0) << kiln_last_error();
    losses->push_back(rc == 0 ? kiln_tensor_item(loss) : NAN);
    kiln_scope_pop();
  }
}

TEST(DigitsCnn, EagerAndStagedTrainingStepsAgree) {
  Scoped s;
  kiln_tensor *x = nullptr, *y = nullptr;
  ASSERT_EQ(digits_load(nullptr, "train", &x, &y), 0) << kiln_last_error();

  digits_model eager = {}, staged = {};
  kiln_random_seed(7);
  ASSERT_EQ(digits_model_init(&eager), 0) << kiln_last_error();
  kiln_random_seed(7);
  ASSERT_EQ(digits_model_init(&staged), 0) << kiln_last_error();
  kiln_optimizer *opt_e = digits_optimizer_new(), *opt_s = digits_optimizer_new();
  Staged st = {&staged, opt_s};
  kiln_function *f = kiln_function_new("digits_step", staged_step, &st, 2, 1);
  ASSERT_NE(f, nullptr) << kiln_last_error();

  std::vector<double> le, ls;
  train(nullptr, &eager, opt_e, x, y, &le);
  train(f, &staged, opt_s, x, y, &ls);
  EXPECT_EQ(kiln_function_trace_count(f), 1);

  ASSERT_EQ(le.size(), (size_t)STEPS);
  ASSERT_EQ(ls.size(), (size_t)STEPS);
  for (int i = 0; i < STEPS; i++) {
    SCOPED_TRACE(i);
    EXPECT_NEAR(le[(size_t)i], ls[(size_t)i], 1e-4 * std::max(1.0, std::fabs(le[(size_t)i])));
  }
  // from about ln 10 (2.63 at this seed) to 0.93 after nine updates
  EXPECT_NEAR(le[0], std::log(10.0), 1.0);
  EXPECT_LT(le[STEPS - 1], 0.5 * le[0]) << "the loss did not go down";
  EXPECT_LT(ls[STEPS - 1], 0.5 * ls[0]) << "the loss did not go down";

  // and both end with the same weights
  for (int i = 0; i < DIGITS_VARS; i++) {
    SCOPED_TRACE(digits_var_names[i]);
    std::vector<float> a = floats(kiln_variable_read(eager.v[i])), b = floats(kiln_variable_read(staged.v[i]));
    ASSERT_EQ(a.size(), b.size());
    double worst = 0;
    for (size_t k = 0; k < a.size(); k++) worst = std::max(worst, (double)std::fabs(a[k] - b[k]));
    EXPECT_LT(worst, 1e-4);
  }
  kiln_function_free(f);
  kiln_optimizer_free(opt_e);
  kiln_optimizer_free(opt_s);
  digits_model_free(&eager);
  digits_model_free(&staged);
}

}  // namespace
