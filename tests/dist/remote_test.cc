// remote_test.cc — remote devices (API.md §12, the TF Eager paper's §4.5).
// ctest runs this binary alone (a world of one: task:K devices are unknown,
// with a clear error) and under mpirun -np 3, where ranks 1 and 2 serve
// (kiln_dist_serve in main, or the installed kiln-worker in the MPMD
// entry) and rank 0 runs every test: ops on task:1/cpu:0 and task:2/cpu:0
// equal the same ops here bit for bit, results stay there until read,
// released tensors are freed there, workers' errors come back naming the
// op. RemoteFault (an entry of its own: it leaves task:1 unusable) makes a
// worker hang past a short KILN_DIST_TIMEOUT_S.
#include <stdlib.h>

#include <string>

#include "../test_util.h"

using namespace kiln_test;

extern "C" {
int64_t dist_remote_live(const char *name);
int dist_remote_stall(const char *name, double seconds);
int64_t dist_remote_programs(const char *name);
int64_t dist_remote_texts_sent(void);
int64_t dist_remote_caps_sent(void);
}

namespace {

const char *kTask1 = "task:1/cpu:0";
const char *kTask2 = "task:2/cpu:0";

#define NEED_WORKERS()                                                                                 \
  do {                                                                                                 \
    if (kiln_dist_size() < 3)                                                                          \
      GTEST_SKIP() << "needs a world of 3 processes (rank 0 and two workers): ctest runs this binary " \
                      "under mpirun -np 3 (the remote.np3 entries)"                                    \
                   << (kHaveMpi ? "" : "; Kiln was built without MPI (libopenmpi-dev openmpi-bin)");    \
  } while (0)

#ifdef KILN_TEST_HAVE_MPI
const bool kHaveMpi = true;
#else
const bool kHaveMpi = false;
#endif

bool starts_with(const std::string &s, const std::string &p) { return s.compare(0, p.size(), p) == 0; }

// An input of shape with distinct, non-trivial values (seeded).
kiln_tensor *data(const V64 &shape, double seed) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  VD v((size_t)n);
  for (int64_t i = 0; i < n; i++) v[(size_t)i] = std::sin(seed + 0.37 * (double)i) * 1.7;
  return from_values(KILN_F32, shape, v);
}

// The op f on inputs, here and on `device`: the remote result lives there,
// and its bytes equal the local result's.
template <typename F>
void same_there(const char *device, const char *what, F f) {
  SCOPED_TRACE(std::string(what) + " on " + device);
  kiln_tensor *local = f();
  ASSERT_NE(local, nullptr) << kiln_last_error();
  ASSERT_EQ(kiln_device_push(device), 0) << kiln_last_error();
  kiln_tensor *remote = f();
  kiln_device_pop();
  ASSERT_NE(remote, nullptr) << kiln_last_error();
  EXPECT_STREQ(kiln_tensor_device(remote), device);
  EXPECT_EQ(kiln_tensor_data(remote), nullptr); // not here
  kiln_clear_error();
  EXPECT_EQ(shape_of(remote), shape_of(local));
  EXPECT_EQ(kiln_tensor_dtype(remote), kiln_tensor_dtype(local));
  kiln_tensor *back = kiln_to_device(remote, "cpu:0");
  ASSERT_NE(back, nullptr) << kiln_last_error();
  EXPECT_STREQ(kiln_tensor_device(back), "cpu:0");
  EXPECT_TRUE(same_bits(back, local)) << what;
}

TEST(RemoteOneProcess, TaskDevicesAreUnknown) {
  if (kiln_dist_size() != 1) GTEST_SKIP() << "a world of one process only (the remote.one_process entry)";
  Scoped s;
  EXPECT_EQ(kiln_device_push(kTask1), -1);
  std::string e = kiln_last_error();
  EXPECT_TRUE(starts_with(e, "device_push: unknown device 'task:1/cpu:0'")) << e;
  EXPECT_NE(e.find("one process"), std::string::npos) << e;
  EXPECT_EQ(kiln_to_device(f32({1, 2}), kTask1), nullptr);
  EXPECT_TRUE(starts_with(kiln_last_error(), "to_device: unknown device 'task:1/cpu:0'")) << kiln_last_error();
  for (int i = 0; i < kiln_device_count(); i++) EXPECT_NE(std::string(kiln_device_name(i)).rfind("task:", 0), 0u);
  EXPECT_EQ(kiln_dist_serve(), -1);
  EXPECT_TRUE(starts_with(kiln_last_error(), "dist_serve: the world has one process")) << kiln_last_error();
}

TEST(Remote, DevicesAreListedAfterTheLocalOnes) {
  NEED_WORKERS();
  Scoped s;
  ASSERT_EQ(kiln_device_push(kTask2), 0) << kiln_last_error(); // waits for task 2's announcement
  kiln_device_pop();
  ASSERT_EQ(kiln_device_push(kTask1), 0) << kiln_last_error();
  EXPECT_STREQ(kiln_device_current(), kTask1);
  kiln_device_pop();
  int n = kiln_device_count(), first_remote = -1;
  bool seen1 = false, seen2 = false;
  for (int i = 0; i < n; i++) {
    std::string name = kiln_device_name(i);
    bool remote = starts_with(name, "task:");
    if (remote && first_remote < 0) first_remote = i;
    if (!remote) {
      EXPECT_LT(first_remote, 0) << name << " after a remote device";
    }
    seen1 |= name == kTask1;
    seen2 |= name == kTask2;
  }
  EXPECT_TRUE(seen1 && seen2);
  EXPECT_STREQ(kiln_device_name(0), "cpu:0");
  EXPECT_EQ(kiln_device_name(n), nullptr);
  EXPECT_EQ(kiln_dist_serve(), -1); // rank 0 is the client
  EXPECT_TRUE(starts_with(kiln_last_error(), "dist_serve: rank 0 is the client")) << kiln_last_error();
}

TEST(Remote, BadDeviceNames) {
  NEED_WORKERS();
  Scoped s;
  const char *bad[] = {"task:3/cpu:0", "task:0/cpu:0", "task:1/cpu:1", "task:1/tpu:0", "task:1",
                       "task:x/cpu:0", "task:1/cpu:0/x", "task:-1/cpu:0", "task:1/gpu:99"};
  for (const char *name : bad) {
    EXPECT_EQ(kiln_device_push(name), -1) << name;
    std::string e = kiln_last_error();
    EXPECT_TRUE(starts_with(e, std::string("device_push: unknown device '") + name + "'")) << e;
    kiln_clear_error();
  }
  EXPECT_EQ(kiln_device_push("task:3/cpu:0"), -1);
  EXPECT_NE(std::string(kiln_last_error()).find("no task:3 in a world of 3"), std::string::npos) << kiln_last_error();
  EXPECT_STREQ(kiln_device_current(), "cpu:0");
}

TEST(Remote, OpsEqualLocalBitForBit) {
  NEED_WORKERS();
  Scoped s;
  kiln_tensor *a = data({3, 5}, 0.1), *b = data({5, 4}, 2.0), *c = data({3, 5}, 4.0), *v = data({5}, 1.3);
  for (const char *dev : {kTask1, kTask2}) {
    same_there(dev, "add", [&] { return kiln_add(a, c); });
    same_there(dev, "mul broadcast", [&] { return kiln_mul(a, v); });
    same_there(dev, "matmul", [&] { return kiln_matmul(a, b); });
    same_there(dev, "exp", [&] { return kiln_exp(a); });
    same_there(dev, "tanh", [&] { return kiln_tanh(c); });
    int ax[] = {1};
    same_there(dev, "reduce_sum", [&] { return kiln_reduce_sum(a, 1, ax, false); });
    same_there(dev, "reduce_max all", [&] { return kiln_reduce_max(a, 0, nullptr, true); });
    same_there(dev, "transpose", [&] { return kiln_transpose(a, 2, nullptr); });
    int64_t sh[] = {5, 3};
    same_there(dev, "reshape", [&] { return kiln_reshape(a, 2, sh); });
    int64_t bg[] = {1, 2}, sz[] = {2, -1};
    same_there(dev, "slice", [&] { return kiln_slice(a, bg, sz); });
    kiln_tensor *two[] = {a, c};
    same_there(dev, "concat", [&] { return kiln_concat(2, two, 0); });
    same_there(dev, "softmax (a composite)", [&] { return kiln_softmax(a, -1); });
    same_there(dev, "argmax", [&] { return kiln_argmax(a, 1); });
    same_there(dev, "cast", [&] { return kiln_cast(a, KILN_F64); });
    same_there(dev, "less", [&] { return kiln_less(a, c); });
    kiln_tensor *idx = i64({4}, {2, 0, 1, 2});
    same_there(dev, "gather", [&] { return kiln_gather(a, idx, 0); });
    same_there(dev, "arange", [&] { return kiln_arange(KILN_I32, 7); });
    int64_t rs[] = {4, 6};
    same_there(dev, "random_normal", [&] {
      kiln_random_seed(42); // the same draw: the counter is taken here, the numbers made there
      return kiln_random_normal(KILN_F32, 2, rs);
    });
    same_there(dev, "zero size", [&] {
      int64_t z[] = {0, 3};
      return kiln_add(kiln_zeros(KILN_F32, 2, z), kiln_ones(KILN_F32, 2, z));
    });
  }
}

// A chain of ops whose intermediate results never leave the worker.
TEST(Remote, ResultsStayRemoteUntilRead) {
  NEED_WORKERS();
  Scoped s;
  kiln_tensor *x = data({4, 4}, 0.5), *w = data({4, 4}, 1.5);
  kiln_tensor *local = kiln_reduce_sum(kiln_relu(kiln_matmul(kiln_tanh(kiln_matmul(x, w)), w)), 0, nullptr, false);
  ASSERT_EQ(kiln_device_push(kTask1), 0) << kiln_last_error();
  kiln_tensor *xr = kiln_to_device(x, kTask1), *wr = kiln_to_device(w, kTask1);
  ASSERT_NE(xr, nullptr) << kiln_last_error();
  int64_t before = dist_remote_live(kTask1);
  kiln_tensor *h1 = kiln_matmul(xr, wr), *h2 = kiln_tanh(h1), *h3 = kiln_matmul(h2, wr), *h4 = kiln_relu(h3);
  kiln_tensor *r = kiln_reduce_sum(h4, 0, nullptr, false);
  kiln_device_pop();
  ASSERT_NE(r, nullptr) << kiln_last_error();
  for (kiln_tensor *t : {xr, wr, h1, h2, h3, h4, r}) EXPECT_STREQ(kiln_tensor_device(t), kTask1);
  EXPECT_EQ(dist_remote_live(kTask1), before + 5); // each result held there
  EXPECT_EQ(kiln_tensor_item(r), kiln_tensor_item(local)) << kiln_last_error();
  float back[16], want[16];
  ASSERT_EQ(kiln_tensor_read(h4, back, sizeof back), 0) << kiln_last_error();
  ASSERT_EQ(kiln_tensor_read(kiln_relu(kiln_matmul(kiln_tanh(kiln_matmul(x, w)), w)), want, sizeof want), 0);
  EXPECT_EQ(memcmp(back, want, sizeof back), 0);
  EXPECT_EQ(kiln_tensor_read(h4, back, 8), -1); // too small, as for any tensor
  char *str = kiln_tensor_str(r);
  ASSERT_NE(str, nullptr) << kiln_last_error();
  EXPECT_NE(std::string(str).find("shape=()"), std::string::npos) << str;
  free(str);
  // a local op on a remote input brings it here; a remote op on another
  // worker's tensor sends it there
  kiln_tensor *here = kiln_add(r, kiln_scalar(KILN_F32, 1));
  EXPECT_STREQ(kiln_tensor_device(here), "cpu:0");
  EXPECT_EQ(kiln_tensor_item(here), (double)(float)(kiln_tensor_item(local) + 1.0f));
  ASSERT_EQ(kiln_device_push(kTask2), 0);
  kiln_tensor *there = kiln_add(h4, h4);
  kiln_device_pop();
  ASSERT_NE(there, nullptr) << kiln_last_error();
  EXPECT_STREQ(kiln_tensor_device(there), kTask2);
  EXPECT_TRUE(same_bits(kiln_to_device(there, "cpu:0"), kiln_add(kiln_to_device(h4, "cpu:0"), kiln_to_device(h4, "cpu:0"))));
  kiln_tensor *moved = kiln_to_device(h4, kTask2);
  ASSERT_NE(moved, nullptr) << kiln_last_error();
  EXPECT_STREQ(kiln_tensor_device(moved), kTask2);
  EXPECT_TRUE(same_bits(kiln_to_device(moved, "cpu:0"), kiln_to_device(h4, "cpu:0")));
}

TEST(Remote, ReleasedTensorsAreFreedThere) {
  NEED_WORKERS();
  int64_t before = dist_remote_live(kTask2);
  ASSERT_GE(before, 0) << kiln_last_error();
  {
    Scoped s;
    ASSERT_EQ(kiln_device_push(kTask2), 0);
    int64_t eight[] = {8};
    kiln_tensor *t = kiln_to_device(kiln_ones(KILN_F32, 1, eight), kTask2); // constructors make host tensors
    for (int i = 0; i < 20; i++) t = kiln_add(t, t);
    kiln_device_pop();
    EXPECT_EQ(kiln_tensor_item(kiln_reduce_sum(kiln_to_device(t, "cpu:0"), 0, nullptr, false)), 8.0 * (1 << 20));
    EXPECT_GE(dist_remote_live(kTask2), before + 21);
  }
  EXPECT_EQ(dist_remote_live(kTask2), before); // the scope's frees went with this request
  // a tensor released outside any scope
  int64_t live = kiln_debug_live_tensors();
  kiln_tensor *one = kiln_ones(KILN_F64, 0, nullptr), *t = kiln_to_device(one, kTask2);
  kiln_release(one);
  ASSERT_NE(t, nullptr) << kiln_last_error();
  EXPECT_EQ(dist_remote_live(kTask2), before + 1);
  kiln_release(t);
  EXPECT_EQ(dist_remote_live(kTask2), before);
  EXPECT_EQ(kiln_debug_live_tensors(), live);
}

TEST(Remote, WorkerErrorsNameTheOp) {
  NEED_WORKERS();
  Scoped s;
  ASSERT_EQ(kiln_device_push(kTask1), 0);
  // bad shapes: refused by the op table's rule before anything travels
  EXPECT_EQ(kiln_matmul(data({2, 3}, 0), data({4, 2}, 0)), nullptr);
  EXPECT_TRUE(starts_with(kiln_last_error(), "matmul:")) << kiln_last_error();
  // an index error only the kernel sees: it happens on the worker
  kiln_tensor *params = data({3, 2}, 0);
  EXPECT_EQ(kiln_gather(params, i64({2}, {1, 7}), 0), nullptr);
  std::string e = kiln_last_error();
  EXPECT_TRUE(starts_with(e, "gather:")) << e;
  EXPECT_NE(e.find("(on task:1/cpu:0)"), std::string::npos) << e;
  // the worker goes on serving
  kiln_tensor *ok = kiln_gather(params, i64({2}, {1, 2}), 0);
  kiln_device_pop();
  ASSERT_NE(ok, nullptr) << kiln_last_error();
  EXPECT_TRUE(same_bits(kiln_to_device(ok, "cpu:0"), kiln_gather(params, i64({2}, {1, 2}), 0)));
  EXPECT_EQ(dist_remote_live("cpu:0"), -1);
  EXPECT_TRUE(starts_with(kiln_last_error(), "dist_remote_live: 'cpu:0' is not a remote device")) << kiln_last_error();
}

// One SGD step of a two-layer MLP with its backward pass written out:
// in x, y (one-hot), w1, b1, w2, b2; out loss and the four new parameters.
int mlp_step(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  kiln_tensor *x = in[0], *y = in[1], *w1 = in[2], *b1 = in[3], *w2 = in[4], *b2 = in[5];
  int ax0[] = {0}, ax1[] = {1};
  kiln_tensor *h = kiln_relu(kiln_add(kiln_matmul(x, w1), b1));
  kiln_tensor *logits = kiln_add(kiln_matmul(h, w2), b2);
  double n = (double)kiln_tensor_shape(x)[0];
  kiln_tensor *nll = kiln_neg(kiln_reduce_sum(kiln_mul(y, kiln_log_softmax(logits, 1)), 1, ax1, false));
  out[0] = kiln_reduce_mean(nll, 0, nullptr, false);
  kiln_tensor *dlogits = kiln_div(kiln_sub(kiln_softmax(logits, 1), y), kiln_scalar(KILN_F32, n));
  kiln_tensor *dw2 = kiln_matmul(kiln_transpose(h, 2, nullptr), dlogits);
  kiln_tensor *db2 = kiln_reduce_sum(dlogits, 1, ax0, false);
  kiln_tensor *dh = kiln_mul(kiln_matmul(dlogits, kiln_transpose(w2, 2, nullptr)),
                             kiln_cast(kiln_greater(h, kiln_scalar(KILN_F32, 0)), KILN_F32));
  kiln_tensor *dw1 = kiln_matmul(kiln_transpose(x, 2, nullptr), dh);
  kiln_tensor *db1 = kiln_reduce_sum(dh, 1, ax0, false);
  kiln_tensor *lr = kiln_scalar(KILN_F32, 0.1);
  out[1] = kiln_sub(w1, kiln_mul(lr, dw1));
  out[2] = kiln_sub(b1, kiln_mul(lr, db1));
  out[3] = kiln_sub(w2, kiln_mul(lr, dw2));
  out[4] = kiln_sub(b2, kiln_mul(lr, db2));
  return 0;
}

// Three steps here and three on device (parameters staying there between
// steps): the same losses and parameters, bit for bit.
TEST(Remote, StagedMlpStepsEqualLocal) {
  NEED_WORKERS();
  Scoped s;
  kiln_function *f = kiln_function_new("mlp_step", mlp_step, nullptr, 6, 5);
  ASSERT_NE(f, nullptr) << kiln_last_error();
  kiln_tensor *x = data({8, 4}, 0.3);
  int64_t labels_shape[] = {8};
  kiln_tensor *labels = kiln_tensor_new(KILN_I32, 1, labels_shape, std::vector<int32_t>{0, 1, 2, 1, 0, 2, 2, 1}.data());
  kiln_tensor *y = kiln_one_hot(labels, 3, KILN_F32);
  kiln_tensor *init[4] = {data({4, 16}, 1.0), data({16}, 2.0), data({16, 3}, 3.0), data({3}, 4.0)};
  std::vector<double> local_loss, remote_loss;
  kiln_tensor *local[4], *remote[4];
  for (int p = 0; p < 4; p++) local[p] = init[p];
  for (int step = 0; step < 3; step++) {
    kiln_tensor *in[6] = {x, y, local[0], local[1], local[2], local[3]}, *out[5];
    ASSERT_EQ(kiln_function_call(f, in, out), 0) << kiln_last_error();
    local_loss.push_back(kiln_tensor_item(out[0]));
    for (int p = 0; p < 4; p++) local[p] = out[p + 1];
  }
  for (const char *dev : {kTask1, kTask2}) {
    SCOPED_TRACE(dev);
    int64_t texts = dist_remote_texts_sent(), programs = dist_remote_programs(dev);
    ASSERT_EQ(kiln_device_push(dev), 0);
    for (int p = 0; p < 4; p++) remote[p] = init[p]; // host values, sent with the first call
    remote_loss.clear();
    for (int step = 0; step < 3; step++) {
      kiln_tensor *in[6] = {x, y, remote[0], remote[1], remote[2], remote[3]}, *out[5];
      ASSERT_EQ(kiln_function_call(f, in, out), 0) << kiln_last_error();
      for (int k = 0; k < 5; k++) EXPECT_STREQ(kiln_tensor_device(out[k]), dev);
      remote_loss.push_back(kiln_tensor_item(out[0]));
      for (int p = 0; p < 4; p++) remote[p] = out[p + 1];
    }
    kiln_device_pop();
    EXPECT_EQ(remote_loss, local_loss);
    for (int p = 0; p < 4; p++) EXPECT_TRUE(same_bits(kiln_to_device(remote[p], "cpu:0"), local[p])) << "param " << p;
    // the trace traveled once to this worker (two signatures: host, then
    // remote parameters, are two traces at most), then only tensors
    EXPECT_LE(dist_remote_texts_sent() - texts, 2);
    EXPECT_GE(dist_remote_texts_sent() - texts, 1);
    EXPECT_EQ(dist_remote_programs(dev) - programs, dist_remote_texts_sent() - texts);
  }
  // again on task:1 with its parameters there (a signature task:1 has
  // seen): nothing new travels
  for (int p = 0; p < 4; p++) remote[p] = kiln_to_device(remote[p], kTask1);
  int64_t texts = dist_remote_texts_sent();
  ASSERT_EQ(kiln_device_push(kTask1), 0);
  kiln_tensor *in[6] = {x, y, remote[0], remote[1], remote[2], remote[3]}, *out[5];
  EXPECT_EQ(kiln_function_call(f, in, out), 0) << kiln_last_error();
  kiln_device_pop();
  EXPECT_EQ(dist_remote_texts_sent(), texts);
  EXPECT_STREQ(kiln_tensor_device(out[1]), kTask1);
  kiln_function_free(f);
}

int gather_body(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  out[0] = kiln_gather(in[0], in[1], 0);
  return out[0] ? 0 : -1;
}

TEST(Remote, StagedErrorsComeBack) {
  NEED_WORKERS();
  Scoped s;
  kiln_function *f = kiln_function_new("pick", gather_body, nullptr, 2, 1);
  kiln_tensor *in[2] = {data({3, 2}, 0), i64({2}, {0, 9})}, *out[1] = {nullptr};
  ASSERT_EQ(kiln_device_push(kTask2), 0);
  EXPECT_EQ(kiln_function_call(f, in, out), -1);
  std::string e = kiln_last_error();
  EXPECT_TRUE(starts_with(e, "@pick: gather:")) << e;
  EXPECT_NE(e.find("(on task:2/cpu:0)"), std::string::npos) << e;
  in[1] = i64({2}, {2, 1});
  EXPECT_EQ(kiln_function_call(f, in, out), 0) << kiln_last_error();
  kiln_device_pop();
  ASSERT_NE(out[0], nullptr);
  EXPECT_TRUE(same_bits(kiln_to_device(out[0], "cpu:0"), kiln_gather(in[0], in[1], 0)));
  kiln_function_free(f);
}

// x @ w + b for a w and b the body closes over: captured constants of the trace
int affine_body(void *user, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  kiln_tensor *const *wb = static_cast<kiln_tensor *const *>(user);
  out[0] = kiln_add(kiln_matmul(in[0], wb[0]), wb[1]);
  return 0;
}

// The trace's captured constants travel with its text, once per worker:
// later calls name them (the same bits as local, and nothing resent).
TEST(Remote, StagedCapturedConstantsTravelOnce) {
  NEED_WORKERS();
  Scoped s;
  kiln_tensor *wb[2] = {data({64, 48}, 5.0), data({48}, 6.0)};
  kiln_function *f = kiln_function_new("affine", affine_body, wb, 1, 1);
  ASSERT_NE(f, nullptr) << kiln_last_error();
  for (const char *dev : {kTask1, kTask2}) {
    SCOPED_TRACE(dev);
    int64_t texts = dist_remote_texts_sent(), caps = dist_remote_caps_sent();
    for (int call = 0; call < 4; call++) {
      kiln_tensor *x = data({8, 64}, 0.1 * call), *local = nullptr, *remote = nullptr;
      ASSERT_EQ(kiln_function_call(f, &x, &local), 0) << kiln_last_error();
      ASSERT_EQ(kiln_device_push(dev), 0);
      ASSERT_EQ(kiln_function_call(f, &x, &remote), 0) << kiln_last_error();
      kiln_device_pop();
      EXPECT_STREQ(kiln_tensor_device(remote), dev);
      EXPECT_TRUE(same_bits(kiln_to_device(remote, "cpu:0"), local)) << "call " << call;
    }
    EXPECT_EQ(dist_remote_texts_sent() - texts, 1);
    EXPECT_EQ(dist_remote_caps_sent() - caps, 2); // w and b, with the text only
  }
  kiln_function_free(f);
}

// Its own ctest entry: task:1 is unusable afterwards.
TEST(RemoteFault, HungWorkerTimesOut) {
  NEED_WORKERS();
  Scoped s;
  ASSERT_EQ(kiln_device_push(kTask1), 0) << kiln_last_error();
  int64_t three[] = {3};
  kiln_tensor *x = kiln_to_device(kiln_ones(KILN_F32, 1, three), kTask1);
  ASSERT_NE(x, nullptr) << kiln_last_error();
  setenv("KILN_DIST_TIMEOUT_S", "1", 1);
  EXPECT_EQ(dist_remote_stall(kTask1, 4), -1); // the worker sleeps 4 s: no answer within 1 s
  std::string e = kiln_last_error();
  EXPECT_NE(e.find("task:1/cpu:0 did not answer within 1 s (KILN_DIST_TIMEOUT_S)"), std::string::npos) << e;
  kiln_clear_error();
  EXPECT_EQ(kiln_exp(x), nullptr); // the next op fails at once, clearly
  e = kiln_last_error();
  EXPECT_TRUE(starts_with(e, "exp: task:1/cpu:0 is unusable")) << e;
  EXPECT_EQ(kiln_to_device(x, "cpu:0"), nullptr);
  EXPECT_TRUE(starts_with(kiln_last_error(), "to_device: task:1/cpu:0 is unusable")) << kiln_last_error();
  kiln_device_pop();
  setenv("KILN_DIST_TIMEOUT_S", "60", 1); // finalize waits for the late reply and the worker's goodbye
  // the other worker still serves
  ASSERT_EQ(kiln_device_push(kTask2), 0);
  kiln_tensor *y = kiln_exp(kiln_ones(KILN_F32, 1, three));
  kiln_device_pop();
  ASSERT_NE(y, nullptr) << kiln_last_error();
  EXPECT_FLOAT_EQ((float)kiln_tensor_item(kiln_reduce_max(kiln_to_device(y, "cpu:0"), 0, nullptr, false)),
                  std::exp(1.0f));
}

} // namespace

// Its own ctest entry (remote.np3_killed, under mpirun --enable-recovery
// so that the others outlive it): task:1's process is killed mid-run. The
// request it took fails after KILN_DIST_TIMEOUT_S, every later op there
// fails at once naming the op, and task:2 still serves.
TEST(RemoteKilled, KilledWorkerFailsTheNextOpClearly) {
  NEED_WORKERS();
  Scoped s;
  kiln_tensor *x = data({4, 4}, 1.0);
  ASSERT_EQ(kiln_device_push(kTask1), 0) << kiln_last_error();
  kiln_tensor *y = kiln_add(x, x); // task:1 works, and holds y
  kiln_device_pop();
  ASSERT_NE(y, nullptr) << kiln_last_error();
  setenv("KILN_DIST_TIMEOUT_S", "2", 1); // also bounds finalize's wait for task:1's goodbye
  EXPECT_EQ(dist_remote_stall(kTask1, -1), -1); // SIGKILL there: no answer
  std::string e = kiln_last_error();
  EXPECT_NE(e.find("task:1/cpu:0 did not answer within 2 s (KILN_DIST_TIMEOUT_S): the worker died"),
            std::string::npos)
      << e;
  ASSERT_EQ(kiln_device_push(kTask1), 0) << kiln_last_error();
  EXPECT_EQ(kiln_mul(x, x), nullptr);
  e = kiln_last_error();
  EXPECT_TRUE(starts_with(e, "mul: task:1/cpu:0 is unusable")) << e;
  kiln_device_pop();
  EXPECT_EQ(kiln_to_device(y, "cpu:0"), nullptr); // what it held is gone with it
  EXPECT_TRUE(starts_with(kiln_last_error(), "to_device: task:1/cpu:0 is unusable")) << kiln_last_error();
  ASSERT_EQ(kiln_device_push(kTask2), 0) << kiln_last_error();
  kiln_tensor *z = kiln_add(x, x);
  kiln_device_pop();
  ASSERT_NE(z, nullptr) << kiln_last_error();
  EXPECT_TRUE(same_bits(kiln_to_device(z, "cpu:0"), kiln_add(x, x)));
}

int main(int argc, char **argv) {
  ::testing::InitGoogleTest(&argc, argv);
  if (kiln_dist_init()) {
    fprintf(stderr, "remote_test: kiln_dist_init: %s\n", kiln_last_error());
    return 1;
  }
  if (kiln_dist_rank() > 0) { // a worker: serves until rank 0 finalizes
    int rc = kiln_dist_serve();
    if (rc) fprintf(stderr, "remote_test: rank %d: %s\n", kiln_dist_rank(), kiln_last_error());
    kiln_dist_finalize();
    return rc ? 1 : 0;
  }
  int rc = RUN_ALL_TESTS();
  kiln_dist_finalize();
  return rc;
}
