// metrics_test.cc — kiln_metric_*: means weighted by element count across
// batches of any dtype, accuracy from class ids, logits and one-hot labels
// (ties, NaN rows), reset, NaN when empty, and every bad shape and dtype
// leaving the metric as it was. Expected values are computed here, in
// double, from the same data.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <kiln.h>

#include <cmath>
#include <random>
#include <vector>

#include "test_util.h"

using ::testing::HasSubstr;
using ::testing::StartsWith;

namespace {

using namespace kiln_test;

struct Metric {
  kiln_metric *m;
  explicit Metric(kiln_metric *m) : m(m) { EXPECT_NE(m, nullptr) << kiln_last_error(); }
  ~Metric() { kiln_metric_free(m); }
};

TEST(Metrics, MeanWeighsEveryElement) {
  Scoped s;
  Metric mean(kiln_metric_mean_new());
  EXPECT_TRUE(std::isnan(kiln_metric_result(mean.m))) << "nothing seen yet";
  ASSERT_EQ(kiln_metric_update(mean.m, f32({2, 2}, {1, 2, 3, 4}), nullptr), 0) << kiln_last_error();
  EXPECT_DOUBLE_EQ(kiln_metric_result(mean.m), 2.5);
  ASSERT_EQ(kiln_metric_update(mean.m, f64({}, {10}), nullptr), 0);  // a scalar weighs one
  EXPECT_DOUBLE_EQ(kiln_metric_result(mean.m), 20.0 / 5);
  ASSERT_EQ(kiln_metric_update(mean.m, i64({3}, {-1, -2, 0}), nullptr), 0);
  EXPECT_DOUBLE_EQ(kiln_metric_result(mean.m), 17.0 / 8);
  ASSERT_EQ(kiln_metric_update(mean.m, f32({0, 3}, {}), nullptr), 0);  // empty: no change
  EXPECT_DOUBLE_EQ(kiln_metric_result(mean.m), 17.0 / 8);
  uint8_t b[4] = {1, 0, 1, 1};
  ASSERT_EQ(kiln_metric_update(mean.m, kiln_tensor_new(KILN_BOOL, 1, (V64{4}).data(), b), nullptr), 0);
  EXPECT_DOUBLE_EQ(kiln_metric_result(mean.m), 20.0 / 12);
  ASSERT_EQ(kiln_metric_update(mean.m, kiln_cast(f32({2}, {0.5f, 1.5f}), KILN_F16), nullptr), 0);
  ASSERT_EQ(kiln_metric_update(mean.m, kiln_cast(f32({1}, {3}), KILN_BF16), nullptr), 0);
  EXPECT_DOUBLE_EQ(kiln_metric_result(mean.m), 25.0 / 15);
  kiln_metric_reset(mean.m);
  EXPECT_TRUE(std::isnan(kiln_metric_result(mean.m))) << "reset forgets everything";
  ASSERT_EQ(kiln_metric_update(mean.m, f32({1}, {7}), nullptr), 0);
  EXPECT_DOUBLE_EQ(kiln_metric_result(mean.m), 7);
}

TEST(Metrics, MeanMatchesADoubleSumOfRandomBatches) {
  Scoped s;
  Metric mean(kiln_metric_mean_new());
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(1.0f, 1000.0f);
  double sum = 0;
  int64_t n = 0;
  for (int batch = 0; batch < 50; batch++) {
    int64_t k = 1 + (int64_t)(rng() % 200);
    std::vector<float> v((size_t)k);
    for (float &x : v) sum += x = normal(rng);
    n += k;
    kiln_scope_push();
    ASSERT_EQ(kiln_metric_update(mean.m, f32({k}, v), nullptr), 0) << kiln_last_error();
    kiln_scope_pop();
  }
  EXPECT_NEAR(kiln_metric_result(mean.m), sum / (double)n, 1e-12 * std::fabs(sum / (double)n) + 1e-12);
}

TEST(Metrics, AccuracyFromClassIdsLogitsAndOneHot) {
  Scoped s;
  Metric acc(kiln_metric_accuracy_new());
  EXPECT_TRUE(std::isnan(kiln_metric_result(acc.m)));
  // class ids against class ids
  ASSERT_EQ(kiln_metric_update(acc.m, i32({4}, {0, 1, 2, 1}), i64({4}, {0, 2, 2, 1})), 0) << kiln_last_error();
  EXPECT_DOUBLE_EQ(kiln_metric_result(acc.m), 3.0 / 4);
  // logits: argmax per row, the first of equal maxima (as NumPy's argmax)
  kiln_tensor *logits = f32({3, 3}, {0.1f, 2.0f, -1.0f,   // 1
                                     5.0f, 5.0f, 0.0f,    // tie: 0
                                     -3.0f, -2.0f, -1.0f});  // 2
  ASSERT_EQ(kiln_metric_update(acc.m, i64({3}, {1, 1, 2}), logits), 0) << kiln_last_error();
  EXPECT_DOUBLE_EQ(kiln_metric_result(acc.m), 5.0 / 7);
  // one-hot labels against probabilities (f64)
  kiln_tensor *onehot = f32({2, 3}, {0, 0, 1, 1, 0, 0});
  ASSERT_EQ(kiln_metric_update(acc.m, onehot, f64({2, 3}, {0.2, 0.3, 0.5, 0.1, 0.8, 0.1})), 0);
  EXPECT_DOUBLE_EQ(kiln_metric_result(acc.m), 6.0 / 9);
  // one-hot labels against class ids
  ASSERT_EQ(kiln_metric_update(acc.m, onehot, i32({2}, {2, 0})), 0);
  EXPECT_DOUBLE_EQ(kiln_metric_result(acc.m), 8.0 / 11);
  // a row holding a NaN predicts nothing, even where the NaN would be the argmax
  ASSERT_EQ(kiln_metric_update(acc.m, i32({2}, {0, 1}), f32({2, 2}, {kNanF, 1, 0, 1})), 0);
  EXPECT_DOUBLE_EQ(kiln_metric_result(acc.m), 9.0 / 13);
  // an empty batch changes nothing
  ASSERT_EQ(kiln_metric_update(acc.m, i32({0}, {}), f32({0, 3}, {})), 0) << kiln_last_error();
  EXPECT_DOUBLE_EQ(kiln_metric_result(acc.m), 9.0 / 13);
  kiln_metric_reset(acc.m);
  EXPECT_TRUE(std::isnan(kiln_metric_result(acc.m)));
}

TEST(Metrics, AccuracyOfRandomLogitsMatchesAHandCount) {
  Scoped s;
  Metric acc(kiln_metric_accuracy_new());
  std::mt19937 rng(9);
  int64_t correct = 0, total = 0;
  for (int batch = 0; batch < 20; batch++) {
    const int64_t n = 1 + rng() % 64, c = 10;
    std::vector<float> z((size_t)(n * c));
    std::vector<int32_t> y((size_t)n);
    for (float &v : z) v = (float)(rng() % 7);  // small integers: many ties
    for (int64_t i = 0; i < n; i++) {
      y[(size_t)i] = (int32_t)(rng() % c);
      int64_t best = 0;
      for (int64_t j = 1; j < c; j++)
        if (z[(size_t)(i * c + j)] > z[(size_t)(i * c + best)]) best = j;
      correct += best == y[(size_t)i];
    }
    total += n;
    kiln_scope_push();
    ASSERT_EQ(kiln_metric_update(acc.m, i32({n}, y), f32({n, c}, z)), 0) << kiln_last_error();
    kiln_scope_pop();
  }
  EXPECT_DOUBLE_EQ(kiln_metric_result(acc.m), (double)correct / (double)total);
}

TEST(Metrics, BadInputsLeaveTheMetricAsItWas) {
  Scoped s;
  Metric acc(kiln_metric_accuracy_new());
  Metric mean(kiln_metric_mean_new());
  ASSERT_EQ(kiln_metric_update(acc.m, i32({2}, {0, 1}), i32({2}, {0, 0})), 0);
  ASSERT_EQ(kiln_metric_update(mean.m, f32({2}, {1, 2}), nullptr), 0);
  struct Case {
    const char *name;
    kiln_metric *m;
    kiln_tensor *a, *b;
    const char *why;
  };
  const Case cases[] = {
      {"float labels", acc.m, f32({2}, {0, 1}), i32({2}, {0, 1}), "labels of shape (2,) are f32"},
      {"float predictions", acc.m, i32({2}, {0, 1}), f32({2}, {0, 1}), "predictions of shape (2,) are f32"},
      {"rank 3", acc.m, i32({2}, {0, 1}), f32({2, 1, 1}, {0, 1}), "shape (2, 1, 1)"},
      {"scalar labels", acc.m, i32({}, {0}), i32({1}, {0}), "[n] class ids"},
      {"n differs", acc.m, i32({3}, {0, 1, 2}), f32({2, 3}, {0, 1, 2, 3, 4, 5}), "do not match"},
      {"classes differ", acc.m, f32({2, 2}, {1, 0, 0, 1}), f32({2, 3}, {0, 1, 2, 3, 4, 5}), "do not match"},
      {"bool scores", acc.m, i32({1}, {0}), kiln_cast(f32({1, 2}, {1, 0}), KILN_BOOL), "are bool"},
      {"no predictions", acc.m, i32({1}, {0}), nullptr, "accuracy needs predictions"},
      {"mean with two", mean.m, f32({1}, {1}), f32({1}, {1}), "a mean takes one tensor"},
      {"mean of nothing", mean.m, nullptr, nullptr, "the first tensor is NULL"},
  };
  for (const Case &c : cases) {
    kiln_clear_error();
    EXPECT_EQ(kiln_metric_update(c.m, c.a, c.b), -1) << c.name;
    EXPECT_THAT(kiln_last_error(), StartsWith("metric_update: ")) << c.name;
    EXPECT_THAT(kiln_last_error(), HasSubstr(c.why)) << c.name;
  }
  EXPECT_DOUBLE_EQ(kiln_metric_result(acc.m), 0.5);
  EXPECT_DOUBLE_EQ(kiln_metric_result(mean.m), 1.5);
  // a NULL input from a failed op keeps that op's error
  kiln_clear_error();
  kiln_tensor *bad = kiln_add(f32({2}, {1, 2}), f32({3}, {1, 2, 3}));
  ASSERT_EQ(bad, nullptr);
  std::string first = kiln_last_error();
  EXPECT_EQ(kiln_metric_update(mean.m, bad, nullptr), -1);
  EXPECT_EQ(kiln_last_error(), first);
  EXPECT_EQ(kiln_metric_update(acc.m, i32({1}, {0}), bad), -1);
  EXPECT_EQ(kiln_last_error(), first);
  EXPECT_EQ(kiln_metric_update(nullptr, bad, nullptr), -1);
  EXPECT_STREQ(kiln_last_error(), "metric_update: metric is NULL");
  EXPECT_TRUE(std::isnan(kiln_metric_result(nullptr)));
  kiln_metric_reset(nullptr);
  kiln_metric_free(nullptr);
}

}  // namespace
