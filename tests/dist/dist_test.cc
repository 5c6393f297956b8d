// dist_test.cc — API.md §12 on a world of processes: ctest runs this binary
// alone (a world of one, where every collective is an identity) and under
// mpirun -np 2, 3 and 4. Each collective against a hand computation (every
// dtype, odd and zero sizes, several axes), bit-identical results across
// ranks, gradients against finite differences of the world's loss,
// mismatched calls failing on every rank with the world usable afterwards,
// a rank that skips a collective (DistTimeout, an entry of its own), and
// data-parallel training equal to one process on the whole batch.
//
// Every rank runs every test in the same order: a test that skips, skips on
// every rank (the conditions depend on the world's size alone).
#include <unistd.h>

#include <string>

#include "../test_util.h"
#include "dist_test_util.h"
#include "../../examples/data_parallel_model.h"

using namespace kiln_test;

namespace {

// the message for tests that need several processes
#define NEED_WORLD(n)                                                                                  \
  do {                                                                                                 \
    if (size_() < (n)) GTEST_SKIP() << multi_process_note(n);                                          \
  } while (0)

std::string multi_process_note(int n) {
#ifdef KILN_TEST_HAVE_MPI
  return "needs a world of " + std::to_string(n) +
         " processes: ctest runs this binary under mpirun -np 2, 3 and 4 (the dist_np* entries)";
#else
  return "needs a world of " + std::to_string(n) +
         " processes: Kiln was built without MPI (install libopenmpi-dev and openmpi-bin, reconfigure)";
#endif
}

const kiln_dtype kAll[] = {KILN_F32, KILN_F64, KILN_I32, KILN_I64, KILN_BOOL, KILN_F16, KILN_BF16};

bool is_float(kiln_dtype dt) { return dt == KILN_F32 || dt == KILN_F64 || dt == KILN_F16 || dt == KILN_BF16; }

// Rank r's input element i: small values exact in every dtype (halves in
// the float ones), different on each rank and with ties between ranks.
double value(kiln_dtype dt, int r, int64_t i) {
  if (dt == KILN_BOOL) return (i + r) % 3 == 0;
  double v = (double)((i * 7 + r * 5) % 13) - 6;
  return is_float(dt) ? v + 0.5 * (r % 2) : v;
}

// Rank r's input of dtype dt and shape.
kiln_tensor *input(kiln_dtype dt, const V64 &shape, int r) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  VD v((size_t)n);
  for (int64_t i = 0; i < n; i++) v[(size_t)i] = value(dt, r, i);
  return kiln_cast(from_values(KILN_F64, shape, v), dt);
}

// Elementwise over the world's inputs, in double; integer mean truncates.
VD expected_reduce(kiln_dtype dt, const V64 &shape, const std::string &op) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  int size = size_();
  VD out((size_t)n);
  for (int64_t i = 0; i < n; i++) {
    double acc = value(dt, 0, i);
    for (int r = 1; r < size; r++) {
      double v = value(dt, r, i);
      acc = op == "max" ? std::max(acc, v) : op == "min" ? std::min(acc, v) : acc + v;
    }
    if (op == "mean") acc = is_float(dt) ? acc / size : (double)((int64_t)acc / size);
    out[(size_t)i] = acc;
  }
  return out;
}

double tolerance(kiln_dtype dt) {
  switch (dt) {
    case KILN_F32: return 1e-6;
    case KILN_F16: return 1e-3;
    case KILN_BF16: return 8e-3;
    default: return 0;
  }
}

// got's elements (any dtype, as f64) against want, within dt's rounding
void expect_values(kiln_tensor *got, const VD &want, kiln_dtype dt, const std::string &what) {
  ASSERT_NE(got, nullptr) << what << ": " << kiln_last_error();
  EXPECT_EQ(kiln_tensor_dtype(got), dt) << what;
  VD v = values(kiln_cast(got, KILN_F64));
  ASSERT_EQ(v.size(), want.size()) << what;
  for (size_t i = 0; i < v.size(); i++)
    ASSERT_NEAR(v[i], want[i], tolerance(dt) * std::max(1.0, std::fabs(want[i]))) << what << " element " << i;
}

// Do all ranks hold the same bytes in t? (a hash, all-reduced max == min)
bool same_on_every_rank(kiln_tensor *t) {
  uint64_t h = 14695981039346656037u;
  const unsigned char *p = (const unsigned char *)kiln_tensor_data(t);
  size_t bytes = (size_t)kiln_tensor_size(t) * kiln_dtype_size(kiln_tensor_dtype(t));
  for (size_t k = 0; k < bytes; k++) h = (h ^ p[k]) * 1099511628211u;
  int64_t halves[2] = {(int64_t)(h >> 32), (int64_t)(h & 0xffffffffu)};
  kiln_tensor *x = i64({2}, {halves[0], halves[1]});
  VD hi = values(kiln_all_reduce(x, "max")), lo = values(kiln_all_reduce(x, "min"));
  return hi == lo && hi.size() == 2;
}

std::string shape_name(const V64 &s) {
  std::string out = "(";
  for (size_t i = 0; i < s.size(); i++) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + ")";
}

const V64 kShapes[] = {{0}, {1}, {7}, {3, 5}, {1001}, {2, 0, 3}};

// every test: nothing leaks, and the error of the last test does not linger
struct Dist : ::testing::Test {
  Scoped scope;
};

TEST_F(Dist, WorldHasEveryProcess) {
  EXPECT_EQ(kiln_dist_init(), 0) << kiln_last_error(); // again: nothing changes
  const char *n = getenv("OMPI_COMM_WORLD_SIZE");
  if (!n) n = getenv("PMI_SIZE");
  EXPECT_EQ(size_(), n ? atoi(n) : 1);
  EXPECT_GE(rank_(), 0);
  EXPECT_LT(rank_(), size_());
  // every rank's rank, gathered in order
  kiln_tensor *all = kiln_all_gather(i32({1}, {rank_()}), 0);
  VD want;
  for (int r = 0; r < size_(); r++) want.push_back(r);
  EXPECT_EQ(values(all), want);
}

TEST_F(Dist, AllReduceEveryDtypeOpAndSize) {
  for (kiln_dtype dt : kAll)
    for (const char *op : {"sum", "mean", "max", "min"})
      for (const V64 &shape : kShapes) {
        std::string what = std::string(kiln_dtype_name(dt)) + " " + op + " " + shape_name(shape);
        kiln_tensor *x = input(dt, shape, rank_());
        kiln_tensor *y = kiln_all_reduce(x, op);
        if (dt == KILN_BOOL && (std::string(op) == "sum" || std::string(op) == "mean")) {
          EXPECT_EQ(y, nullptr) << what;
          EXPECT_NE(std::string(kiln_last_error()).find("all_reduce: \""), std::string::npos) << kiln_last_error();
          kiln_clear_error();
          continue;
        }
        ASSERT_NE(y, nullptr) << what << ": " << kiln_last_error();
        EXPECT_EQ(shape_of(y), shape) << what;
        EXPECT_NE(y, x) << what;
        expect_values(y, expected_reduce(dt, shape, op), dt, what);
        EXPECT_TRUE(same_on_every_rank(y)) << what;
      }
}

TEST_F(Dist, AllReduceRanksGetTheSameBitsOnRoundingSums) {
  // values that round differently in different orders of summation
  std::vector<float> v(4099);
  for (size_t i = 0; i < v.size(); i++) v[i] = (float)(1.0 + 1e-7 * (double)((i * 31 + (size_t)rank_() * 17) % 97)) *
                                               (rank_() % 2 ? 1e8f : 1e-3f);
  for (const char *op : {"sum", "mean"}) {
    kiln_tensor *y = kiln_all_reduce(f32(v), op);
    ASSERT_NE(y, nullptr) << kiln_last_error();
    EXPECT_TRUE(same_on_every_rank(y)) << op;
  }
}

TEST_F(Dist, AllGatherConcatenatesInRankOrder) {
  const struct {
    V64 shape;
    int axis;
  } cases[] = {{{3}, 0}, {{2, 3}, 0}, {{2, 3}, 1}, {{2, 3, 5}, -1}, {{2, 3, 5}, 1}, {{0, 4}, 1}, {{4, 0}, 0}, {{1, 7}, 0}};
  for (kiln_dtype dt : kAll)
    for (const auto &c : cases) {
      std::string what = std::string(kiln_dtype_name(dt)) + " " + shape_name(c.shape) + " axis " + std::to_string(c.axis);
      std::vector<kiln_tensor *> parts;
      for (int r = 0; r < size_(); r++) parts.push_back(input(dt, c.shape, r));
      kiln_tensor *want = kiln_concat((int)parts.size(), parts.data(), c.axis);
      kiln_tensor *got = kiln_all_gather(input(dt, c.shape, rank_()), c.axis);
      ASSERT_NE(got, nullptr) << what << ": " << kiln_last_error();
      EXPECT_TRUE(same_bits(got, want)) << what;
    }
  EXPECT_EQ(kiln_all_gather(f32({1}, {1}), 2), nullptr);
  EXPECT_NE(std::string(kiln_last_error()).find("all_gather:"), std::string::npos) << kiln_last_error();
  kiln_clear_error();
  EXPECT_EQ(kiln_all_gather(kiln_scalar(KILN_F32, 1), 0), nullptr);
  EXPECT_NE(std::string(kiln_last_error()).find("all_gather: a scalar"), std::string::npos) << kiln_last_error();
  kiln_clear_error();
}

TEST_F(Dist, ReduceScatterGivesRankItsReducedBlock) {
  int size = size_();
  const struct {
    V64 shape; // the axis's length is a multiple of size
    int axis;
  } cases[] = {{{size}, 0}, {{3 * size, 2}, 0}, {{2, 3 * size}, 1}, {{2, size, 3}, -2}, {{0, size}, 1}, {{2 * size, 0}, 0}};
  for (kiln_dtype dt : kAll)
    for (const char *op : {"sum", "mean", "max", "min"}) {
      if (dt == KILN_BOOL && (std::string(op) == "sum" || std::string(op) == "mean")) continue;
      for (const auto &c : cases) {
        std::string what = std::string(kiln_dtype_name(dt)) + " " + op + " " + shape_name(c.shape) + " axis " +
                           std::to_string(c.axis);
        // the whole reduction, then this rank's block of it
        kiln_tensor *whole = from_values(KILN_F64, c.shape, expected_reduce(dt, c.shape, op));
        int axis = c.axis < 0 ? c.axis + (int)c.shape.size() : c.axis;
        kiln_tensor *blocks[8];
        ASSERT_EQ(kiln_split(whole, size, axis, blocks), 0) << kiln_last_error();
        kiln_tensor *got = kiln_reduce_scatter(input(dt, c.shape, rank_()), c.axis, op);
        ASSERT_NE(got, nullptr) << what << ": " << kiln_last_error();
        EXPECT_EQ(shape_of(got), shape_of(blocks[rank_()])) << what;
        expect_values(got, values(blocks[rank_()]), dt, what);
      }
    }
  if (size > 1) {
    EXPECT_EQ(kiln_reduce_scatter(f32({size + 1}, std::vector<float>((size_t)size + 1, 1.0f)), 0, "sum"), nullptr);
    EXPECT_NE(std::string(kiln_last_error()).find("reduce_scatter: axis 0 of shape"), std::string::npos)
        << kiln_last_error();
    kiln_clear_error();
  }
  // the world is usable after the error
  expect_values(kiln_all_reduce(f64({1}, {1}), "sum"), {(double)size}, KILN_F64, "after the error");
}

TEST_F(Dist, BroadcastFromEveryRoot) {
  for (int root = 0; root < size_(); root++)
    for (kiln_dtype dt : kAll)
      for (const V64 &shape : kShapes) {
        std::string what = std::string(kiln_dtype_name(dt)) + " " + shape_name(shape) + " root " + std::to_string(root);
        kiln_tensor *got = kiln_broadcast_from(input(dt, shape, rank_()), root);
        ASSERT_NE(got, nullptr) << what << ": " << kiln_last_error();
        EXPECT_TRUE(same_bits(got, input(dt, shape, root))) << what;
      }
  for (int root : {-1, size_()}) {
    EXPECT_EQ(kiln_broadcast_from(f32({1}, {1}), root), nullptr);
    EXPECT_NE(std::string(kiln_last_error()).find("broadcast_from: root " + std::to_string(root) + " is not a rank"),
              std::string::npos)
        << kiln_last_error();
    kiln_clear_error();
  }
}

TEST_F(Dist, BadArgumentsFailClearly) {
  EXPECT_EQ(kiln_all_reduce(f32({2}, {1, 2}), "avg"), nullptr);
  EXPECT_NE(std::string(kiln_last_error()).find("all_reduce: op \"avg\""), std::string::npos) << kiln_last_error();
  kiln_clear_error();
  EXPECT_EQ(kiln_all_reduce(f32({2}, {1, 2}), nullptr), nullptr);
  EXPECT_NE(std::string(kiln_last_error()).find("all_reduce: op NULL"), std::string::npos) << kiln_last_error();
  kiln_clear_error();
  EXPECT_EQ(kiln_all_reduce(nullptr, "sum"), nullptr);
  EXPECT_NE(std::string(kiln_last_error()).find("all_reduce: t is NULL"), std::string::npos) << kiln_last_error();
  kiln_clear_error();
  // a NULL input keeps the first error
  EXPECT_EQ(kiln_all_gather(kiln_reshape(f32({2}, {1, 2}), KILN_SHAPE(3)), 0), nullptr);
  EXPECT_NE(std::string(kiln_last_error()).find("reshape"), std::string::npos) << kiln_last_error();
  kiln_clear_error();
  EXPECT_EQ(kiln_reduce_scatter(f32({2}, {1, 2}), 0, "median"), nullptr);
  kiln_clear_error();
  EXPECT_EQ(kiln_dist_average_gradients(-1, nullptr), -1);
  EXPECT_NE(std::string(kiln_last_error()).find("dist_average_gradients:"), std::string::npos) << kiln_last_error();
  kiln_clear_error();
  kiln_tensor *ints[1] = {i32({1}, {1})};
  EXPECT_EQ(kiln_dist_average_gradients(1, ints), -1);
  EXPECT_NE(std::string(kiln_last_error()).find("not a float tensor"), std::string::npos) << kiln_last_error();
  kiln_clear_error();
  EXPECT_EQ(kiln_dist_sync_variables(0, nullptr, size_()), -1);
  EXPECT_NE(std::string(kiln_last_error()).find("dist_sync_variables: root"), std::string::npos) << kiln_last_error();
  kiln_clear_error();
  if (rank_() == 0) { // ranks >= 1 would serve (tests/dist/remote_test.cc)
    EXPECT_EQ(kiln_dist_serve(), -1);
    EXPECT_NE(std::string(kiln_last_error()).find(size_() == 1 ? "dist_serve: the world has one process"
                                                                : "dist_serve: rank 0 is the client"),
              std::string::npos)
        << kiln_last_error();
    kiln_clear_error();
  }
  expect_values(kiln_all_reduce(f64({1}, {2}), "sum"), {2.0 * size_()}, KILN_F64, "after the errors");
}

int all_reduce_body(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  out[0] = kiln_all_reduce(in[0], "sum");
  return out[0] ? 0 : -1;
}

// staged_test.cc tests the staged collectives in depth
TEST_F(Dist, StagedFunctionsCallCollectives) {
  kiln_function *f = kiln_function_new("reduce", all_reduce_body, nullptr, 1, 1);
  ASSERT_NE(f, nullptr) << kiln_last_error();
  kiln_tensor *x = f32({2}, {1, 2}), *out = nullptr;
  ASSERT_EQ(kiln_function_call(f, &x, &out), 0) << kiln_last_error();
  expect_values(out, {1.0 * size_(), 2.0 * size_()}, KILN_F32, "staged");
  kiln_function_free(f);
  expect_values(kiln_all_reduce(x, "sum"), {1.0 * size_(), 2.0 * size_()}, KILN_F32, "eagerly");
}

// ---- calls that disagree across ranks ----

void expect_everyone_fails(kiln_tensor *got, const std::string &message) {
  EXPECT_EQ(got, nullptr);
  EXPECT_EQ(std::string(kiln_last_error()).find(message), 0u) << "got: " << kiln_last_error() << "\nwant: " << message;
  kiln_clear_error();
}

TEST_F(Dist, MismatchedCallsFailOnEveryRankAndTheWorldGoesOn) {
  NEED_WORLD(2);
  int r = rank_();
  int64_t n = r == 1 ? 3 : 4;
  expect_everyone_fails(kiln_all_reduce(kiln_ones(KILN_F32, 1, &n), "sum"),
                        "all_reduce: rank 1 has shape (3,) where rank 0 has (4,)");
  expect_everyone_fails(kiln_all_reduce(kiln_ones(r == 1 ? KILN_F64 : KILN_F32, KILN_SHAPE(2)), "sum"),
                        "all_reduce: rank 1 has dtype f64 where rank 0 has f32");
  expect_everyone_fails(kiln_all_reduce(kiln_ones(KILN_F32, KILN_SHAPE(2)), r == 1 ? "max" : "sum"),
                        "all_reduce: rank 1 reduces with \"max\" where rank 0 with \"sum\"");
  expect_everyone_fails(kiln_broadcast_from(kiln_ones(KILN_F32, KILN_SHAPE(2)), r == 1 ? 1 : 0),
                        "broadcast_from: rank 1 passed root 1 where rank 0 passed 0");
  expect_everyone_fails(kiln_all_gather(kiln_ones(KILN_F32, KILN_SHAPE(2, 2)), r == 1 ? 1 : 0),
                        "all_gather: rank 1 passed axis 1 where rank 0 passed 0");
  // different collectives: each rank's error starts with its own
  kiln_tensor *x = kiln_ones(KILN_F32, KILN_SHAPE(2));
  if (r == 1) {
    expect_everyone_fails(kiln_all_gather(x, 0), "all_gather: rank 1 called all_gather where rank 0 called all_reduce");
  } else {
    expect_everyone_fails(kiln_all_reduce(x, "sum"), "all_reduce: rank 1 called all_gather where rank 0 called all_reduce");
  }
  // one rank's bad call: its own error there, the others name it
  if (r == 1) {
    expect_everyone_fails(kiln_all_reduce(x, "avg"), "all_reduce: op \"avg\"");
  } else {
    expect_everyone_fails(kiln_all_reduce(x, "sum"), "all_reduce: rank 1's call failed");
  }
  if (r == size_() - 1) {
    expect_everyone_fails(kiln_all_reduce(nullptr, "sum"), "all_reduce: t is NULL");
  } else {
    expect_everyone_fails(kiln_all_reduce(x, "sum"), "all_reduce: rank " + std::to_string(size_() - 1) + "'s call failed");
  }
  // average_gradients: one rank's list differs
  kiln_tensor *g[2] = {kiln_ones(KILN_F32, KILN_SHAPE(2)), r == 1 ? nullptr : kiln_ones(KILN_F32, KILN_SHAPE(3))};
  EXPECT_EQ(kiln_dist_average_gradients(2, g), -1);
  EXPECT_NE(std::string(kiln_last_error()).find("dist_average_gradients: rank 1's tensors differ"), std::string::npos)
      << kiln_last_error();
  kiln_clear_error();
  // and the world works on
  expect_values(kiln_all_reduce(f64({2}, {1, (double)r}), "sum"),
                {(double)size_(), (double)size_() * (size_() - 1) / 2}, KILN_F64, "after the mismatches");
}

// ---- gradients ----

// The world's loss: the sum over ranks of sum(w_r * f(x_r)), w_r fixed per rank.
double world_loss(kiln_tensor *(*f)(kiln_tensor *), kiln_tensor *x, kiln_tensor *w, kiln_tape *tape,
                  kiln_tensor **grad) {
  if (tape) kiln_tape_watch(tape, x);
  kiln_tensor *mine = kiln_reduce_sum(kiln_mul(w, f(x)), 0, nullptr, false);
  if (tape) {
    kiln_tape_end(tape);
    EXPECT_EQ(kiln_tape_gradient(tape, mine, 1, &x, grad), 0) << kiln_last_error();
    kiln_tape_free(tape);
  }
  return kiln_tensor_item(kiln_all_reduce(mine, "sum"));
}

struct GradCase {
  const char *name;
  V64 in, out; // in: shape of x (n = the world's size, below)
  kiln_tensor *(*f)(kiln_tensor *);
};

TEST_F(Dist, GradientsMatchFiniteDifferencesOfTheWorldsLoss) {
  int size = size_(), r = rank_();
  const GradCase cases[] = {
      {"all_reduce sum", {2, 3}, {2, 3}, [](kiln_tensor *x) { return kiln_all_reduce(x, "sum"); }},
      {"all_reduce mean", {2, 3}, {2, 3}, [](kiln_tensor *x) { return kiln_all_reduce(x, "mean"); }},
      {"all_reduce max", {2, 3}, {2, 3}, [](kiln_tensor *x) { return kiln_all_reduce(x, "max"); }},
      {"all_reduce min", {2, 3}, {2, 3}, [](kiln_tensor *x) { return kiln_all_reduce(x, "min"); }},
      {"all_gather 0", {2, 3}, {2 * size, 3}, [](kiln_tensor *x) { return kiln_all_gather(x, 0); }},
      {"all_gather 1", {2, 3}, {2, 3 * size}, [](kiln_tensor *x) { return kiln_all_gather(x, 1); }},
      {"reduce_scatter sum", {2 * size, 3}, {2, 3}, [](kiln_tensor *x) { return kiln_reduce_scatter(x, 0, "sum"); }},
      {"reduce_scatter mean", {3, size}, {3, 1}, [](kiln_tensor *x) { return kiln_reduce_scatter(x, 1, "mean"); }},
      {"reduce_scatter max", {2 * size, 3}, {2, 3}, [](kiln_tensor *x) { return kiln_reduce_scatter(x, 0, "max"); }},
      {"broadcast_from last", {2, 3}, {2, 3}, [](kiln_tensor *x) { return kiln_broadcast_from(x, kiln_dist_size() - 1); }},
      {"all_gather(all_reduce mean)", {2, 3}, {2 * size, 3},
       [](kiln_tensor *x) { return kiln_all_gather(kiln_tanh(kiln_all_reduce(kiln_mul(x, x), "mean")), 0); }},
  };
  const double eps = 1e-6;
  for (const GradCase &c : cases) {
    int64_t n = 1, m = 1;
    for (int64_t d : c.in) n *= d;
    for (int64_t d : c.out) m *= d;
    // x_r: distinct across ranks and elements (no ties for max/min); w_r likewise
    VD xv((size_t)n), wv((size_t)m);
    for (int64_t i = 0; i < n; i++) xv[(size_t)i] = 0.1 * (double)((i * 5 + r * 3) % 17) + 0.013 * r + 0.001 * (double)i;
    for (int64_t i = 0; i < m; i++) wv[(size_t)i] = 1.0 + 0.5 * (double)((i + 2 * r) % 5);
    kiln_tensor *w = from_values(KILN_F64, c.out, wv);
    kiln_tensor *grad = nullptr;
    world_loss(c.f, from_values(KILN_F64, c.in, xv), w, kiln_tape_begin(false), &grad);
    ASSERT_NE(grad, nullptr) << c.name << ": " << kiln_last_error();
    VD g = values(grad);
    // perturb each rank's elements in turn: every rank runs every perturbation
    for (int p = 0; p < size; p++)
      for (int64_t i = 0; i < n; i += 2) {
        double loss[2];
        for (int s = 0; s < 2; s++) {
          VD xp = xv;
          if (r == p) xp[(size_t)i] += s ? -eps : eps;
          loss[s] = world_loss(c.f, from_values(KILN_F64, c.in, xp), w, nullptr, nullptr);
        }
        if (r == p) {
          EXPECT_NEAR(g[(size_t)i], (loss[0] - loss[1]) / (2 * eps), 1e-5) << c.name << " rank " << p << " x[" << i << "]";
        }
      }
  }
}

TEST_F(Dist, GradientOfATieIsShared) {
  // every rank holds the max: each gets its share of the world's gradient
  kiln_tensor *x = f64({2}, {1, 2}), *grad = nullptr;
  kiln_tape *tape = kiln_tape_begin(false);
  kiln_tape_watch(tape, x);
  kiln_tensor *loss = kiln_reduce_sum(kiln_all_reduce(x, "max"), 0, nullptr, false);
  kiln_tape_end(tape);
  ASSERT_EQ(kiln_tape_gradient(tape, loss, 1, &x, &grad), 0) << kiln_last_error();
  kiln_tape_free(tape);
  EXPECT_EQ(values(grad), (VD{1, 1})); // the world's dy = size, split between size ranks
  // the second derivative through the collectives: d2/dx2 of the world's sum(all_reduce(x*x, sum))
  kiln_tape *outer = kiln_tape_begin(false);
  kiln_tape_watch(outer, x);
  kiln_tape *inner = kiln_tape_begin(false);
  kiln_tape_watch(inner, x);
  kiln_tensor *y = kiln_reduce_sum(kiln_all_reduce(kiln_mul(x, x), "sum"), 0, nullptr, false);
  kiln_tape_end(inner);
  kiln_tensor *dx = nullptr, *ddx = nullptr;
  ASSERT_EQ(kiln_tape_gradient(inner, y, 1, &x, &dx), 0) << kiln_last_error();
  kiln_tensor *dsum = kiln_reduce_sum(dx, 0, nullptr, false);
  kiln_tape_end(outer);
  ASSERT_EQ(kiln_tape_gradient(outer, dsum, 1, &x, &ddx), 0) << kiln_last_error();
  // the world's y = size * sum_r sum(x_r^2): dx_r = 2 size x_r, and the
  // world's sum of those, differentiated again, 2 size
  double s = size_();
  EXPECT_EQ(values(dx), (VD{2 * s, 4 * s}));
  EXPECT_EQ(values(ddx), (VD{2 * s, 2 * s}));
  kiln_tape_free(inner);
  kiln_tape_free(outer);
}

// ---- data-parallel training ----

TEST_F(Dist, AverageGradientsInBucketsOwnershipAndDtypes) {
  int size = size_(), r = rank_();
  for (const char *fusion : {"64", "1000000"}) { // many small buckets, then one
    setenv("KILN_DIST_FUSION_BYTES", fusion, 1);
    kiln_scope_push();
    std::vector<kiln_dtype> dts = {KILN_F32, KILN_F64, KILN_F16, KILN_BF16, KILN_F32, KILN_F64};
    std::vector<V64> shapes = {{7}, {3, 2}, {5}, {0}, {40}, {1}};
    std::vector<kiln_tensor *> g;
    for (size_t i = 0; i < dts.size(); i++) g.push_back(input(dts[i], shapes[i], r));
    g.push_back(nullptr); // a variable the loss does not reach
    ASSERT_EQ(kiln_dist_average_gradients((int)g.size(), g.data()), 0) << kiln_last_error();
    EXPECT_EQ(g.back(), nullptr);
    for (size_t i = 0; i < dts.size(); i++)
      expect_values(g[i], expected_reduce(dts[i], shapes[i], "mean"), dts[i], std::string("grads ") + std::to_string(i));
    kiln_scope_pop();
  }
  unsetenv("KILN_DIST_FUSION_BYTES");
  // no scope open: the old tensors are released, the new ones the caller's
  kiln_scope_pop();
  int64_t live = kiln_debug_live_tensors();
  kiln_tensor *g[2] = {kiln_fill(KILN_F32, KILN_SHAPE(3), r), kiln_fill(KILN_F64, KILN_SHAPE(2), 2 * r)};
  ASSERT_EQ(kiln_dist_average_gradients(2, g), 0) << kiln_last_error();
  EXPECT_EQ(kiln_debug_live_tensors(), live + 2);
  double mean = (size - 1) / 2.0;
  EXPECT_EQ(values(g[0]), (VD{mean, mean, mean}));
  EXPECT_EQ(values(g[1]), (VD{2 * mean, 2 * mean}));
  kiln_release(g[0]);
  kiln_release(g[1]);
  EXPECT_EQ(kiln_debug_live_tensors(), live);
  kiln_scope_push();
}

TEST_F(Dist, SyncVariablesCopiesRootsValues) {
  Owned own;
  int r = rank_(), root = size_() - 1;
  kiln_variable *v[2] = {own.var(kiln_fill(KILN_F32, KILN_SHAPE(2, 2), r), "a"),
                         own.var(kiln_fill(KILN_I64, KILN_SHAPE(3), 10 * r), "b")};
  ASSERT_EQ(kiln_dist_sync_variables(2, v, root), 0) << kiln_last_error();
  EXPECT_EQ(values(kiln_variable_read(v[0])), VD(4, root));
  EXPECT_EQ(values(kiln_variable_read(v[1])), VD(3, 10.0 * root));
}

// N ranks on shards of one batch equal one process on the whole batch
TEST_F(Dist, DataParallelTrainingEqualsOneProcessOnTheWholeBatch) {
  enum { BATCH = 48, IN = 12, HIDDEN = 16, STEPS = 20 };
  int size = size_(), r = rank_();
  ASSERT_EQ(BATCH % size, 0) << "the test's batch is for worlds of 1, 2, 3 and 4";
  kiln_random_seed(7); // every rank draws the same data and initial values
  kiln_tensor *x = kiln_random_normal(KILN_F32, KILN_SHAPE(BATCH, IN));
  kiln_tensor *y = kiln_cast(kiln_mul(kiln_random_uniform(KILN_F32, KILN_SHAPE(BATCH), 0, 1), kiln_scalar(KILN_F32, 9.99)),
                             KILN_I64);
  dp_mlp one, world;
  kiln_random_seed(11);
  ASSERT_EQ(dp_mlp_init(&one, IN, HIDDEN), 0) << kiln_last_error();
  kiln_random_seed(11 + (uint64_t)r); // different everywhere until synced
  ASSERT_EQ(dp_mlp_init(&world, IN, HIDDEN), 0) << kiln_last_error();
  ASSERT_EQ(kiln_dist_sync_variables(DP_VARS, world.v, 0), 0) << kiln_last_error();
  Owned own;
  kiln_optimizer *sgd_one = own.opt(kiln_sgd_new(0.2)), *sgd_world = own.opt(kiln_sgd_new(0.2));
  int64_t shard = BATCH / size;
  const int64_t begin[2] = {r * shard, 0}, extent[2] = {shard, IN};
  kiln_tensor *xs = kiln_slice(x, begin, extent), *ys = kiln_slice(y, begin, extent);
  for (int step = 0; step < STEPS; step++) {
    kiln_scope_push();
    kiln_tensor *l1, *lw;
    ASSERT_EQ(dp_mlp_step(&one, sgd_one, x, y, false, &l1), 0) << kiln_last_error();
    ASSERT_EQ(dp_mlp_step(&world, sgd_world, xs, ys, true, &lw), 0) << kiln_last_error();
    EXPECT_NEAR(kiln_tensor_item(kiln_all_reduce(lw, "mean")), kiln_tensor_item(l1), 1e-5) << "step " << step;
    for (int i = 0; i < DP_VARS; i++)
      EXPECT_TRUE(allclose(kiln_variable_read(world.v[i]), kiln_variable_read(one.v[i]), 1e-5, 1e-5))
          << "step " << step << " variable " << i;
    EXPECT_EQ(dp_mlp_ranks_agree(&world), 1) << "step " << step;
    kiln_scope_pop();
  }
  dp_mlp_free(&one);
  dp_mlp_free(&world);
}

// ---- a rank that never comes (ctest runs it in an entry of its own: the
// world is unusable afterwards) ----

TEST(DistTimeout, ARankThatSkipsACollectiveFailsTheOthersInTime) {
  int64_t live = kiln_debug_live_tensors();
  NEED_WORLD(2);
  setenv("KILN_DIST_TIMEOUT_S", "2", 1);
  kiln_scope_push();
  if (kiln_dist_rank() == 0) {
    kiln_tensor *y = kiln_all_reduce(kiln_ones(KILN_F32, KILN_SHAPE(4)), "sum");
    EXPECT_EQ(y, nullptr);
    EXPECT_EQ(std::string(kiln_last_error()).find("all_reduce: timed out after 2 s"), 0u) << kiln_last_error();
    kiln_clear_error();
    EXPECT_EQ(kiln_all_reduce(kiln_ones(KILN_F32, KILN_SHAPE(4)), "sum"), nullptr);
    EXPECT_NE(std::string(kiln_last_error()).find("all_reduce: the world is unusable"), std::string::npos)
        << kiln_last_error();
    kiln_clear_error();
  } else {
    sleep(3); // skips the collective
  }
  kiln_scope_pop();
  EXPECT_EQ(kiln_debug_live_tensors(), live);
}

} // namespace

int main(int argc, char **argv) {
  ::testing::InitGoogleTest(&argc, argv);
  if (kiln_dist_init()) {
    fprintf(stderr, "dist_test: kiln_dist_init: %s\n", kiln_last_error());
    return 1;
  }
  int rc = RUN_ALL_TESTS();
  kiln_dist_finalize();
  return rc;
}
