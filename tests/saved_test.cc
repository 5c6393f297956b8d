// saved_test.cc — saved functions (API.md §11): kiln_function_save and
// kiln_function_load give the original's bits for an MLP, a training step,
// control flow, static arguments, a nested staged call and a host call, in
// this process and in a fresh one (tests/saved_helper.c, fork + exec);
// saves are deterministic and atomic; every missing, truncated, corrupt or
// newer file fails the load cleanly; the optimizer's state as variables
// resumes training bit for bit in a new process.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <kiln.h>

#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "ir.h"
#include "io_util.h"
#include "test_util.h"

using ::testing::HasSubstr;
using ::testing::StartsWith;

// The host callback saved functions name (saved_helper.c has the same).
extern "C" int saved_test_double(void *user, int n_in, kiln_tensor *const *in, int n_out, kiln_tensor **out);
extern "C" int saved_test_double(void *user, int n_in, kiln_tensor *const *in, int n_out, kiln_tensor **out) {
  (void)user, (void)n_in, (void)n_out;
  out[0] = kiln_mul(in[0], kiln_scalar_like(in[0], 2));
  return out[0] ? 0 : -1;
}

namespace {

namespace fs = std::filesystem;
using namespace kiln_test;

struct TempDir : kiln_io_test::IoTempDir {
  TempDir() : IoTempDir("kiln_saved") {}
};

std::string read_file(const std::string &path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

void write_file(const std::string &path, const std::string &bytes) {
  std::remove(path.c_str());
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), (std::streamsize)bytes.size());
}

// Every file of a directory: name -> bytes.
std::map<std::string, std::string> dir_bytes(const std::string &dir) {
  std::map<std::string, std::string> out;
  for (auto &e : fs::directory_iterator(dir)) out[e.path().filename().string()] = read_file(e.path().string());
  return out;
}

// The bytes of a tensor (its dtype and shape first).
std::string bits(const kiln_tensor *t) {
  EXPECT_NE(t, nullptr) << kiln_last_error();
  if (!t) return "";
  std::string s = std::string(kiln_dtype_name(kiln_tensor_dtype(t))) + "[";
  for (int d = 0; d < kiln_tensor_rank(t); d++) s += std::to_string(kiln_tensor_shape(t)[d]) + ",";
  std::string data((size_t)kiln_tensor_size(t) * kiln_dtype_size(kiln_tensor_dtype(t)), '\0');
  EXPECT_EQ(kiln_tensor_read(t, data.data(), data.size()), 0) << kiln_last_error();
  return s + "]" + data;
}

std::string var_bits(kiln_variable *v) {
  kiln_scope_push();
  std::string s = bits(kiln_variable_read(v));
  kiln_scope_pop();
  return s;
}

kiln_tensor *normal(const V64 &shape) { return kiln_random_normal(KILN_F32, (int)shape.size(), shape.data()); }
kiln_tensor *zeros(const V64 &shape) { return kiln_zeros(KILN_F32, (int)shape.size(), shape.data()); }

// f's variables by name
std::map<std::string, kiln_variable *> vars_of(kiln_function *f) {
  int n = kiln_function_variables(f, 0, nullptr);
  EXPECT_GE(n, 0) << kiln_last_error();
  std::vector<kiln_variable *> v(n > 0 ? n : 0);
  EXPECT_EQ(kiln_function_variables(f, n, v.data()), n);
  std::map<std::string, kiln_variable *> out;
  for (kiln_variable *x : v) out[kiln_variable_name(x)] = x;
  return out;
}

// A tensor file of saved_helper.c: int32 dtype, int32 rank, int64 dims, data.
void write_tensor(const std::string &path, const kiln_tensor *t) {
  int32_t head[2] = {(int32_t)kiln_tensor_dtype(t), kiln_tensor_rank(t)};
  std::string b((const char *)head, sizeof head);
  b.append((const char *)kiln_tensor_shape(t), (size_t)head[1] * sizeof(int64_t));
  std::string data((size_t)kiln_tensor_size(t) * kiln_dtype_size(kiln_tensor_dtype(t)), '\0');
  EXPECT_EQ(kiln_tensor_read(t, data.data(), data.size()), 0);
  write_file(path, b + data);
}

// Runs the test helper with args in a new process; its exit status.
int run_helper(const std::vector<std::string> &args) {
  pid_t pid = fork();
  if (pid == 0) {
    std::vector<char *> argv;
    argv.push_back((char *)SAVED_HELPER);
    for (const std::string &a : args) argv.push_back((char *)a.c_str());
    argv.push_back(nullptr);
    execv(SAVED_HELPER, argv.data());
    _exit(127);
  }
  int status = 0;
  EXPECT_EQ(waitpid(pid, &status, 0), pid);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

// ---- the functions ----

struct Mlp {
  kiln_variable *w1, *b1, *w2;
  kiln_tensor *shift;  // a captured constant
};

int mlp_body(void *user, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  Mlp *m = (Mlp *)user;
  kiln_tensor *h = kiln_relu(kiln_add(kiln_matmul(in[0], kiln_variable_read(m->w1)), kiln_variable_read(m->b1)));
  out[0] = kiln_add(kiln_matmul(h, kiln_variable_read(m->w2)), m->shift);
  out[1] = kiln_reduce_sum(kiln_exp(out[0]), 0, nullptr, false);
  return 0;
}

struct MlpFixture {
  Owned own;
  Mlp m;
  kiln_function *f;
  MlpFixture() {
    kiln_random_seed(7);
    m.w1 = own.var(normal({6, 16}), "w1");
    m.b1 = own.var(normal({16}), "b1");
    m.w2 = own.var(normal({16, 3}), "w2");
    m.shift = kiln_retain(normal({3}));
    f = kiln_function_new("mlp", mlp_body, &m, 1, 2);
  }
  ~MlpFixture() {
    kiln_function_free(f);
    kiln_release(m.shift);
  }
};

kiln_tensor *input(int64_t rows, int64_t cols, uint64_t seed) {
  kiln_random_seed(seed);
  return normal({rows, cols});
}

// f and g called on in give the same bits
void expect_same(kiln_function *f, kiln_function *g, std::vector<kiln_tensor *> in, int n_out) {
  std::vector<kiln_tensor *> a(n_out), b(n_out);
  ASSERT_EQ(kiln_function_call(f, in.data(), a.data()), 0) << kiln_last_error();
  ASSERT_EQ(kiln_function_call(g, in.data(), b.data()), 0) << kiln_last_error();
  for (int k = 0; k < n_out; k++) EXPECT_EQ(bits(a[k]), bits(b[k])) << "output " << k;
}

TEST(Saved, MlpSameBitsOwnVariablesTwoSignatures) {
  Scoped s;
  MlpFixture fx;
  TempDir dir;
  kiln_tensor *x4 = input(4, 6, 1), *x2 = input(2, 6, 2), *out[2];
  ASSERT_EQ(kiln_function_call(fx.f, &x4, out), 0) << kiln_last_error();
  ASSERT_EQ(kiln_function_call(fx.f, &x2, out), 0) << kiln_last_error();
  std::string path = dir.file("mlp");
  ASSERT_EQ(kiln_function_save(fx.f, path.c_str()), 0) << kiln_last_error();
  // the layout
  auto files = dir_bytes(path);
  std::vector<std::string> names;
  for (auto &kv : files) names.push_back(kv.first);
  EXPECT_EQ(names, (std::vector<std::string>{"constants.safetensors", "manifest.json", "trace0.kir", "trace1.kir",
                                             "variables.safetensors"}));
  // the IR as traced, parsed back to the same text
  char *traced = kiln_function_ir(fx.f, 0, "traced");
  ASSERT_NE(traced, nullptr);
  EXPECT_EQ(files["trace0.kir"], traced);
  free(traced);
  ir_module *m = ir_parse(files["trace1.kir"].c_str(), "trace1.kir");
  ASSERT_NE(m, nullptr) << kiln_last_error();
  char *again = ir_print_module(m);
  EXPECT_EQ(files["trace1.kir"], again);
  free(again);
  ir_module_free(m);
  EXPECT_THAT(files["manifest.json"], HasSubstr("\"format\": 1"));

  kiln_function *g = kiln_function_load(path.c_str());
  ASSERT_NE(g, nullptr) << kiln_last_error();
  EXPECT_EQ(kiln_function_trace_count(g), 0);  // compiled on first use
  expect_same(fx.f, g, {x4}, 2);
  expect_same(fx.f, g, {x2}, 2);
  EXPECT_EQ(kiln_function_trace_count(g), 2);
  // its own variables: restored, not the original's
  auto vars = vars_of(g);
  ASSERT_EQ(vars.size(), 3u);
  EXPECT_EQ(vars.begin()->first, "b1");
  EXPECT_NE(vars["w1"], fx.m.w1);
  EXPECT_EQ(var_bits(vars["w1"]), var_bits(fx.m.w1));
  ASSERT_EQ(kiln_variable_assign(fx.m.w1, zeros({6, 16})), 0);
  EXPECT_NE(var_bits(vars["w1"]), var_bits(fx.m.w1));
  // an unsaved signature: the error lists the saved ones
  kiln_tensor *x3 = input(3, 6, 3);
  EXPECT_EQ(kiln_function_call(g, &x3, out), -1);
  EXPECT_THAT(kiln_last_error(), StartsWith("function_call: @mlp: no saved trace takes (f32[3,6]) on cpu:0"));
  EXPECT_THAT(kiln_last_error(), HasSubstr("saved: (f32[4,6]) on cpu:0; (f32[2,6]) on cpu:0"));
  // the traced IR of the loaded trace reads as the original's
  char *a = kiln_function_ir(g, 0, "traced");
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(std::string(a), files["trace0.kir"]);
  free(a);
  // gradients replay the saved IR
  kiln_function *gf = kiln_gradients(fx.f), *gg = kiln_gradients(g);
  ASSERT_EQ(kiln_variable_assign(vars["w1"], kiln_variable_read(fx.m.w1)), 0);
  expect_same(gf, gg, {x4}, 1);
  kiln_function_free(gf);
  kiln_function_free(gg);
  kiln_function_free(g);
}

TEST(Saved, DeterministicAndResavedLoadedIsIdentical) {
  Scoped s;
  MlpFixture fx;
  TempDir dir;
  kiln_tensor *x = input(4, 6, 1), *out[2];
  ASSERT_EQ(kiln_function_call(fx.f, &x, out), 0) << kiln_last_error();
  std::string a = dir.file("a"), b = dir.file("b"), c = dir.file("c");
  ASSERT_EQ(kiln_function_save(fx.f, a.c_str()), 0) << kiln_last_error();
  ASSERT_EQ(kiln_function_save(fx.f, b.c_str()), 0) << kiln_last_error();
  EXPECT_EQ(dir_bytes(a), dir_bytes(b));
  kiln_function *g = kiln_function_load(a.c_str());
  ASSERT_NE(g, nullptr) << kiln_last_error();
  ASSERT_EQ(kiln_function_save(g, c.c_str()), 0) << kiln_last_error();  // before any call of g
  EXPECT_EQ(dir_bytes(a), dir_bytes(c));
  // saving over a saved function replaces it; nothing is left beside it
  ASSERT_EQ(kiln_function_save(g, a.c_str()), 0) << kiln_last_error();
  EXPECT_EQ(dir_bytes(a), dir_bytes(c));
  int entries = 0;
  for (auto &e : fs::directory_iterator(dir.path)) entries += e.is_directory();
  EXPECT_EQ(entries, 3);
  kiln_function_free(g);
}

// ---- a training step: its variables (and Adam's) are restored and updated ----

struct Trainer {
  kiln_variable *w, *b;
  kiln_optimizer *opt;
};

int train_body(void *user, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  Trainer *t = (Trainer *)user;
  kiln_tape *tape = kiln_tape_begin(false);
  kiln_tensor *pred = kiln_add(kiln_matmul(in[0], kiln_variable_read(t->w)), kiln_variable_read(t->b));
  kiln_tensor *loss = kiln_reduce_mean(kiln_square(kiln_sub(pred, in[1])), 0, nullptr, false);
  kiln_tape_end(tape);
  kiln_variable *vars[2] = {t->w, t->b};
  kiln_tensor *grads[2] = {nullptr, nullptr};
  int rc = kiln_tape_gradient_vars(tape, loss, 2, vars, grads);
  kiln_tape_free(tape);
  if (!rc) rc = kiln_optimizer_apply(t->opt, 2, vars, grads);
  out[0] = loss;
  return rc;
}

TEST(Saved, TrainingStepUpdatesItsOwnVariables) {
  Scoped s;
  Owned own;
  TempDir dir;
  kiln_random_seed(3);
  Trainer t = {own.var(normal({5, 2}), "w"),
               own.var(zeros({2}), "b"), own.opt(kiln_adam_new(0.05, 0.9, 0.999, 1e-7))};
  kiln_function *f = kiln_function_new("train", train_body, &t, 2, 1);
  kiln_tensor *in[2] = {input(8, 5, 4), input(8, 2, 5)}, *loss;
  ASSERT_EQ(kiln_function_call(f, in, &loss), 0) << kiln_last_error();
  std::string path = dir.file("train");
  ASSERT_EQ(kiln_function_save(f, path.c_str()), 0) << kiln_last_error();
  kiln_function *g = kiln_function_load(path.c_str());
  ASSERT_NE(g, nullptr) << kiln_last_error();
  auto vars = vars_of(g);
  std::vector<std::string> names;
  for (auto &kv : vars) names.push_back(kv.first);
  EXPECT_EQ(names, (std::vector<std::string>{"adam/m/b", "adam/m/w", "adam/step", "adam/v/b", "adam/v/w", "b", "w"}));
  EXPECT_EQ(vars_of(f).size(), 7u);
  for (int step = 0; step < 4; step++) {
    kiln_tensor *a, *b;
    ASSERT_EQ(kiln_function_call(f, in, &a), 0) << kiln_last_error();
    ASSERT_EQ(kiln_function_call(g, in, &b), 0) << kiln_last_error();
    EXPECT_EQ(bits(a), bits(b)) << "step " << step;
  }
  EXPECT_EQ(var_bits(vars["w"]), var_bits(t.w));
  EXPECT_EQ(var_bits(vars["adam/step"]), var_bits(vars_of(f)["adam/step"]));
  kiln_scope_push();
  EXPECT_EQ(kiln_tensor_item(kiln_variable_read(vars["adam/step"])), 5.0);
  kiln_scope_pop();
  kiln_function_free(g);
  kiln_function_free(f);
}

// ---- control flow ----

int cumsum_body(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  out[0] = kiln_add(in[0], in[1]);
  out[1] = kiln_tanh(out[0]);
  return 0;
}
int then_fn(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  out[0] = kiln_exp(in[0]);
  return 0;
}
int else_fn(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  out[0] = kiln_neg(in[0]);
  return 0;
}
int control_body(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  kiln_tensor *carry = zeros({3}), *final_carry = nullptr, *ys = nullptr;
  if (kiln_scan(cumsum_body, nullptr, 1, &carry, 1, &in[0], -1, false, 1, &final_carry, &ys)) return -1;
  kiln_tensor *pred = kiln_greater(kiln_reduce_sum(final_carry, 0, nullptr, false), kiln_scalar(KILN_F32, 0));
  if (kiln_cond(pred, then_fn, else_fn, nullptr, 1, &final_carry, 1, &out[0])) return -1;
  out[1] = ys;
  return 0;
}

TEST(Saved, ControlFlowSameBitsGradientsRefused) {
  Scoped s;
  TempDir dir;
  kiln_function *f = kiln_function_new("control", control_body, nullptr, 1, 2);
  kiln_tensor *x = input(5, 3, 9), *neg = kiln_neg(x), *out[2];
  ASSERT_EQ(kiln_function_call(f, &x, out), 0) << kiln_last_error();
  std::string path = dir.file("control");
  ASSERT_EQ(kiln_function_save(f, path.c_str()), 0) << kiln_last_error();
  EXPECT_THAT(read_file(path + "/trace0.kir"), HasSubstr("scan"));
  kiln_function *g = kiln_function_load(path.c_str());
  ASSERT_NE(g, nullptr) << kiln_last_error();
  expect_same(f, g, {x}, 2);
  expect_same(f, g, {neg}, 2);  // the other branch
  // replayed op by op (eager), control flow runs on concrete values
  kiln_function_set_eager(g, true);
  kiln_tensor *e[2];
  ASSERT_EQ(kiln_function_call(g, &x, e), 0) << kiln_last_error();
  EXPECT_EQ(shape_of(e[1]), (V64{5, 3}));
  kiln_function_set_eager(g, false);
  kiln_function *gg = kiln_gradients(g);
  EXPECT_EQ(kiln_function_call(gg, &x, out), -1);
  EXPECT_THAT(kiln_last_error(), HasSubstr("holds a scan instruction"));
  kiln_function_free(gg);
  kiln_function_free(g);
  kiln_function_free(f);
}

// ---- static arguments, a nested staged call, a host call ----

kiln_tensor *scale_by(kiln_tensor *x, int k, double c) { return kiln_mul(x, kiln_scalar_like(x, k * c)); }

TEST(Saved, StaticArgumentsBakedIntoTraces) {
  Scoped s;
  TempDir dir;
  auto jitted = KILN_JIT(scale_by, "t:tid");
  kiln_function *f = kiln_jit_function((kiln_fnptr)jitted);
  kiln_tensor *x = input(2, 3, 1);
  kiln_tensor *want = jitted(x, 3, 0.5);
  ASSERT_NE(want, nullptr) << kiln_last_error();
  std::string path = dir.file("scale");
  ASSERT_EQ(kiln_function_save(f, path.c_str()), 0) << kiln_last_error();
  EXPECT_THAT(read_file(path + "/manifest.json"), HasSubstr("\"static_values\": [\"3\", \"0.5\"]"));
  kiln_function *g = kiln_function_load(path.c_str());
  ASSERT_NE(g, nullptr) << kiln_last_error();
  kiln_tensor *got;
  ASSERT_EQ(kiln_function_call(g, &x, &got), 0) << kiln_last_error();
  EXPECT_EQ(bits(got), bits(want));
  kiln_function_free(g);
  // two traces that differ only in a static argument: a loaded call cannot choose
  ASSERT_NE(jitted(x, 4, 0.5), nullptr) << kiln_last_error();
  ASSERT_EQ(kiln_function_save(f, path.c_str()), 0) << kiln_last_error();
  g = kiln_function_load(path.c_str());
  ASSERT_NE(g, nullptr) << kiln_last_error();
  EXPECT_EQ(kiln_function_call(g, &x, &got), -1);
  EXPECT_THAT(kiln_last_error(), HasSubstr("static 0 = 3, static 1 = 0.5) and 1"));
  EXPECT_THAT(kiln_last_error(), HasSubstr("differ in static arguments"));
  kiln_function_free(g);
  kiln_jit_free((kiln_fnptr)jitted);
}

kiln_function *g_inner;
int inner_body(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  out[0] = kiln_sigmoid(kiln_mul(in[0], in[0]));
  return 0;
}
int outer_body(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  kiln_tensor *y;
  if (kiln_function_call(g_inner, in, &y)) return -1;
  kiln_tensor *hin[1] = {kiln_add(y, kiln_scalar(KILN_F32, 1))}, *h;
  kiln_spec spec = {KILN_F32, 2, {2, 3}};
  if (kiln_host_call(saved_test_double, nullptr, 1, hin, 1, &spec, &h)) return -1;
  out[0] = kiln_sub(h, in[0]);
  return 0;
}

TEST(Saved, NestedCallAndHostCallInThisAndAFreshProcess) {
  Scoped s;
  TempDir dir;
  g_inner = kiln_function_new("inner", inner_body, nullptr, 1, 1);
  kiln_function *f = kiln_function_new("outer", outer_body, nullptr, 1, 1);
  kiln_tensor *x = input(2, 3, 11), *want;
  ASSERT_EQ(kiln_function_call(f, &x, &want), 0) << kiln_last_error();
  std::string path = dir.file("outer");
  ASSERT_EQ(kiln_function_save(f, path.c_str()), 0) << kiln_last_error();
  std::string kir = read_file(path + "/trace0.kir");
  EXPECT_THAT(kir, HasSubstr("call @inner"));
  EXPECT_THAT(kir, HasSubstr("host_call @saved_test_double"));
  kiln_function *g = kiln_function_load(path.c_str());
  ASSERT_NE(g, nullptr) << kiln_last_error();
  kiln_tensor *got;
  ASSERT_EQ(kiln_function_call(g, &x, &got), 0) << kiln_last_error();
  EXPECT_EQ(bits(got), bits(want));
  kiln_function_free(g);
  // a fresh process: load, call, compare the bytes
  write_tensor(dir.file("x"), x);
  write_tensor(dir.file("want"), want);
  ASSERT_EQ(run_helper({"call", path, dir.file("got"), "1", dir.file("x")}), 0);
  EXPECT_EQ(read_file(dir.file("got.0")), read_file(dir.file("want")));
  // a host call this process lacks fails the load, naming it
  std::string bad = kir;
  for (size_t at; (at = bad.find("saved_test_double")) != std::string::npos;)
    bad.replace(at, 17, "saved_test_absent");
  write_file(path + "/trace0.kir", bad);
  EXPECT_EQ(kiln_function_load(path.c_str()), nullptr);
  EXPECT_THAT(kiln_last_error(), HasSubstr("host call @saved_test_absent: this process has no symbol"));
  kiln_function_free(f);
  kiln_function_free(g_inner);
}

int static_host(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  out[0] = kiln_identity(in[0]);
  return 0;
}
int static_host_body(void *user, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  kiln_spec spec = {KILN_F32, 1, {3}};
  return kiln_host_call(static_host, user, 1, in, 1, &spec, out);
}

TEST(Saved, HostCallsWithoutNameOrWithUserDataAreRefused) {
  Scoped s;
  TempDir dir;
  kiln_function *f = kiln_function_new("h", static_host_body, nullptr, 1, 1);
  kiln_tensor *x = f32({1, 2, 3}), *y;
  ASSERT_EQ(kiln_function_call(f, &x, &y), 0) << kiln_last_error();
  std::string path = dir.file("h");
  EXPECT_EQ(kiln_function_save(f, path.c_str()), -1);
  EXPECT_THAT(kiln_last_error(), StartsWith("function_save: @h: a host call's callback has no symbol name"));
  EXPECT_FALSE(fs::exists(path));
  EXPECT_TRUE(fs::is_empty(dir.path));  // no temporary directory left
  kiln_function_free(f);
}

// ---- a fresh process: the MLP, and training resumed from a checkpoint ----

TEST(Saved, MlpInAFreshProcess) {
  Scoped s;
  MlpFixture fx;
  TempDir dir;
  kiln_tensor *x = input(4, 6, 1), *out[2];
  ASSERT_EQ(kiln_function_call(fx.f, &x, out), 0) << kiln_last_error();
  std::string path = dir.file("mlp");
  ASSERT_EQ(kiln_function_save(fx.f, path.c_str()), 0) << kiln_last_error();
  write_tensor(dir.file("x"), x);
  ASSERT_EQ(run_helper({"call", path, dir.file("got"), "2", dir.file("x")}), 0);
  for (int k = 0; k < 2; k++) {
    std::string want = dir.file("want." + std::to_string(k));
    write_tensor(want, out[k]);
    EXPECT_EQ(read_file(dir.file("got." + std::to_string(k))), read_file(want)) << "output " << k;
  }
  // a wrong signature in the fresh process fails cleanly
  kiln_tensor *x3 = input(3, 6, 1);
  write_tensor(dir.file("x3"), x3);
  EXPECT_EQ(run_helper({"call", path, dir.file("bad"), "2", dir.file("x3")}), 1);
}

TEST(Saved, TrainingResumesBitForBitInANewProcess) {
  TempDir dir;
  ASSERT_EQ(run_helper({"train", dir.file("straight"), "100", "0"}), 0);
  ASSERT_EQ(run_helper({"train", dir.file("half"), "50", "0", "--save", dir.file("ck")}), 0);
  ASSERT_EQ(run_helper({"train", dir.file("resumed"), "50", "50", "--restore", dir.file("ck")}), 0);
  std::string straight = read_file(dir.file("straight")), resumed = read_file(dir.file("resumed"));
  EXPECT_GT(straight.size(), 100u);
  EXPECT_EQ(straight, resumed);
  EXPECT_NE(straight, read_file(dir.file("half")));  // training moved the weights
  // the checkpoint holds Adam's state beside the model
  Scoped s;
  Owned own;
  kiln_variable *step = own.var(kiln_scalar(KILN_F64, 0), "adam/step");
  ASSERT_EQ(kiln_checkpoint_restore(dir.file("ck").c_str(), 1, &step), 0) << kiln_last_error();
  kiln_scope_push();
  EXPECT_EQ(kiln_tensor_item(kiln_variable_read(step)), 50.0);
  kiln_scope_pop();
}

TEST(Saved, OptimizerVariables) {
  Scoped s;
  Owned own;
  kiln_variable *w = own.var(f32({1, 2}), "w"), *v = own.var(f32({3}), "a");
  kiln_variable *vars[2] = {w, v}, *out[8];
  kiln_optimizer *mom = own.opt(kiln_sgd_momentum_new(0.1, 0.9, false));
  EXPECT_EQ(kiln_optimizer_variables(mom, 8, out), 0);
  ASSERT_EQ(kiln_optimizer_build(mom, 2, vars), 0) << kiln_last_error();
  ASSERT_EQ(kiln_optimizer_variables(mom, 8, out), 2);
  EXPECT_STREQ(kiln_variable_name(out[0]), "momentum/velocity/a");
  EXPECT_STREQ(kiln_variable_name(out[1]), "momentum/velocity/w");
  kiln_optimizer *sgd = own.opt(kiln_sgd_new(0.1));
  ASSERT_EQ(kiln_optimizer_build(sgd, 2, vars), 0);
  EXPECT_EQ(kiln_optimizer_variables(sgd, 8, out), 0);
  kiln_optimizer *adam = own.opt(kiln_adam_new(0.1, 0.9, 0.99, 1e-8));
  kiln_tensor *grads[2] = {f32({1, 1}), nullptr};
  ASSERT_EQ(kiln_optimizer_apply(adam, 2, vars, grads), 0);
  EXPECT_EQ(kiln_optimizer_variables(adam, 1, out), 3);  // the count, even past max
  EXPECT_STREQ(kiln_variable_name(out[0]), "adam/m/w");
  // bad arguments
  EXPECT_EQ(kiln_optimizer_variables(nullptr, 8, out), -1);
  EXPECT_THAT(kiln_last_error(), StartsWith("optimizer_variables: optimizer is NULL"));
  EXPECT_EQ(kiln_optimizer_variables(adam, -1, out), -1);
  EXPECT_EQ(kiln_optimizer_variables(adam, 2, nullptr), -1);
  EXPECT_EQ(kiln_optimizer_build(adam, 1, nullptr), -1);
  EXPECT_THAT(kiln_last_error(), StartsWith("optimizer_build: vars is NULL"));
  EXPECT_EQ(kiln_function_variables(nullptr, 0, nullptr), -1);
  EXPECT_THAT(kiln_last_error(), StartsWith("function_variables: function is NULL"));
}

// ---- bad input ----

struct SavedDir {
  TempDir dir;
  std::string path;
  std::map<std::string, std::string> files;
  SavedDir() {
    MlpFixture fx;
    kiln_scope_push();
    kiln_tensor *x = input(4, 6, 1), *out[2];
    EXPECT_EQ(kiln_function_call(fx.f, &x, out), 0) << kiln_last_error();
    kiln_scope_pop();
    path = dir.file("mlp");
    EXPECT_EQ(kiln_function_save(fx.f, path.c_str()), 0) << kiln_last_error();
    files = dir_bytes(path);
  }
  void restore() {
    for (auto &kv : files) write_file(path + "/" + kv.first, kv.second);
  }
  // the load fails, its error starting with "function_load: " and holding what
  void expect_fails(const std::string &what) {
    kiln_function *g = kiln_function_load(path.c_str());
    EXPECT_EQ(g, nullptr);
    kiln_function_free(g);
    EXPECT_THAT(kiln_last_error(), StartsWith("function_load: "));
    EXPECT_THAT(kiln_last_error(), HasSubstr(what));
  }
};

TEST(Saved, BadArgumentsAndPaths) {
  Scoped s;
  MlpFixture fx;
  TempDir dir;
  EXPECT_EQ(kiln_function_save(nullptr, "x"), -1);
  EXPECT_THAT(kiln_last_error(), StartsWith("function_save: function is NULL"));
  EXPECT_EQ(kiln_function_save(fx.f, nullptr), -1);
  EXPECT_THAT(kiln_last_error(), StartsWith("function_save: path is NULL"));
  EXPECT_EQ(kiln_function_save(fx.f, dir.file("none").c_str()), -1);
  EXPECT_THAT(kiln_last_error(), StartsWith("function_save: @mlp has no traces yet"));
  EXPECT_EQ(kiln_function_load(nullptr), nullptr);
  EXPECT_THAT(kiln_last_error(), StartsWith("function_load: path is NULL"));
  EXPECT_EQ(kiln_function_load(dir.file("missing").c_str()), nullptr);
  EXPECT_THAT(kiln_last_error(), HasSubstr("no such directory"));
  kiln_tensor *x = input(4, 6, 1), *out[2];
  ASSERT_EQ(kiln_function_call(fx.f, &x, out), 0) << kiln_last_error();
  // unwritable: below a regular file
  write_file(dir.file("file"), "x");
  EXPECT_EQ(kiln_function_save(fx.f, dir.file("file/sub").c_str()), -1);
  EXPECT_THAT(kiln_last_error(), StartsWith("function_save: "));
  // a directory that is not a saved function is never replaced
  fs::create_directory(dir.file("mine"));
  write_file(dir.file("mine/keep"), "data");
  EXPECT_EQ(kiln_function_save(fx.f, dir.file("mine").c_str()), -1);
  EXPECT_THAT(kiln_last_error(), HasSubstr("exists and is not a saved function"));
  EXPECT_EQ(read_file(dir.file("mine/keep")), "data");
  std::vector<std::string> left;
  for (auto &e : fs::directory_iterator(dir.path)) left.push_back(e.path().filename().string());
  std::sort(left.begin(), left.end());
  EXPECT_EQ(left, (std::vector<std::string>{"file", "mine"}));  // no temporary directories
}

TEST(Saved, MissingTruncatedCorruptAndNewerFilesFailCleanly) {
  Scoped s;
  SavedDir d;
  for (const char *name : {"manifest.json", "trace0.kir", "variables.safetensors", "constants.safetensors"}) {
    std::remove((d.path + "/" + name).c_str());
    d.expect_fails(name);
    d.restore();
  }
  // every truncation of the manifest and the IR, many of the safetensors
  for (const char *name : {"manifest.json", "trace0.kir", "variables.safetensors", "constants.safetensors"}) {
    const std::string &full = d.files[name];
    size_t step = full.size() > 600 ? full.size() / 150 : 1;
    for (size_t n = 0; n < full.size(); n += step) {
      write_file(d.path + "/" + name, full.substr(0, n));
      kiln_function *g = kiln_function_load(d.path.c_str());
      if (g) {  // a cut that still parses (the IR's trailing text, the manifest's last newline) must still work
        kiln_scope_push();
        kiln_tensor *x = input(4, 6, 1), *out[2];
        EXPECT_EQ(kiln_function_call(g, &x, out), 0) << name << " cut at " << n << ": " << kiln_last_error();
        kiln_scope_pop();
        kiln_function_free(g);
        EXPECT_GE(n + 2, full.size()) << name << " cut at " << n << " loaded";
        continue;
      }
      EXPECT_THAT(kiln_last_error(), StartsWith("function_load: ")) << name << " cut at " << n;
    }
    d.restore();
  }
  // a newer format is refused, whatever follows
  std::string m = d.files["manifest.json"];
  std::string newer = m;
  newer.replace(newer.find("\"format\": 1"), 11, "\"format\": 2");
  write_file(d.path + "/manifest.json", newer);
  d.expect_fails("format version 2 is newer than this Kiln");
  write_file(d.path + "/manifest.json", "{\"format\": 7, \"anything\": [");
  d.expect_fails("format version 7 is newer");
  // corrupt values the parse cannot see
  auto bad = [&](const std::string &from, const std::string &to, const std::string &what) {
    std::string c = m;
    size_t at = c.find(from);
    ASSERT_NE(at, std::string::npos) << from;
    c.replace(at, from.size(), to);
    write_file(d.path + "/manifest.json", c);
    d.expect_fails(what);
  };
  bad("\"variables\": [0", "\"variables\": [9", "variable index out of range");
  bad("\"dtype\": \"f32\"", "\"dtype\": \"f33\"", "unknown dtype");
  bad("\"ir\": \"trace0.kir\"", "\"ir\": \"../trace0.kir\"", "not a plain name");
  bad("\"inputs\": 1", "\"inputs\": 2", "do not match the function's count");
  bad("\"shape\": [4, 6]", "\"shape\": [5, 6]", "parameter 0 of @mlp is not of the manifest's type");
  bad("\"format\": 1", "\"format\": -1", "corrupt manifest at byte");
  write_file(d.path + "/manifest.json", std::string("{\"format\": 1,\xff}"));
  d.expect_fails("not UTF-8");
  d.restore();
  // IR that parses but is not the manifest's
  std::string kir = d.files["trace0.kir"];
  std::string other = kir;
  other.replace(other.find("func @mlp("), 10, "func @other(");
  write_file(d.path + "/trace0.kir", other);
  d.expect_fails("no function @mlp");
  d.restore();
  kiln_function *g = kiln_function_load(d.path.c_str());
  ASSERT_NE(g, nullptr) << kiln_last_error();
  kiln_function_free(g);
}

}  // namespace
