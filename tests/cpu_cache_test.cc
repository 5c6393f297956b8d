// cpu_cache_test.cc — the CPU backend's disk cache of compiled programs
// (backends/cpu/cache.c): a second compile, in this process or a fresh one,
// loads the code instead of running LLVM and gives the same results; large
// constants work from a hit; corrupt and stale entries are rebuilt; an
// unwritable or disabled cache only costs the caching; processes compiling
// into one directory at once all succeed and leave valid entries. Processes
// are fresh: the test binary re-executes itself with KILN_CACHE_TEST_ROLE set.
#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "cpu/cpu.h"
#include "ir.h"
#include "test_util.h"

extern char **environ;

namespace {

using namespace kiln_test;
using ::testing::HasSubstr;
namespace fs = std::filesystem;

// The suite never writes into the user's cache: run by hand (not by ctest,
// which sets KILN_CACHE_DIR), the whole test binary gets a private one.
struct DefaultCacheDir {
  std::string dir;
  DefaultCacheDir() {
    if (getenv("KILN_CACHE_DIR")) return;
    char tmpl[] = "/tmp/kiln-test-cache-XXXXXX";
    if (mkdtemp(tmpl)) {
      dir = tmpl;
      setenv("KILN_CACHE_DIR", tmpl, 0);
    } else {
      setenv("KILN_CACHE_DIR", "off", 0);
    }
  }
  ~DefaultCacheDir() {
    std::error_code ec;
    if (!dir.empty() && getenv("KILN_CACHE_TEST_ROLE") == nullptr) fs::remove_all(dir, ec);
  }
} default_cache_dir;

// A fresh directory, removed at the end.
struct TempDir {
  std::string path;
  TempDir() {
    char tmpl[] = "/tmp/kiln-cache-test-XXXXXX";
    EXPECT_NE(mkdtemp(tmpl), nullptr);
    path = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
  std::vector<std::string> files() const {
    std::vector<std::string> v;
    std::error_code ec;
    if (!fs::is_directory(path, ec)) return v;
    for (const auto &e : fs::directory_iterator(path)) v.push_back(e.path().filename().string());
    return v;
  }
  // the programs' entries (not those of the matmul micro-kernels, which a
  // test's first big matmul in this process may add)
  std::vector<std::string> entries() const {
    std::vector<std::string> v;
    for (const std::string &f : files()) {
      if (f.size() != 36 || f.substr(32) != ".kco") continue;
      std::ifstream in(path + "/" + f, std::ios::binary);
      std::string head(512, '\0');
      in.read(&head[0], (std::streamsize)head.size());
      if (head.find("kiln gemm micro-kernel") == std::string::npos) v.push_back(path + "/" + f);
    }
    return v;
  }
};

// KILN_CACHE_DIR set for the test (NULL: unset), and XDG_CACHE_HOME, which a
// test may change, both restored after.
struct CacheEnv {
  EnvGuard dir, xdg;
  explicit CacheEnv(const char *d) : dir("KILN_CACHE_DIR", d), xdg("XDG_CACHE_HOME", getenv("XDG_CACHE_HOME")) {}
};

// ---- the programs (the same in every process) ----

// 0: a dense layer (dot, then a fused bias + relu) and a row sum
const char *kDense =
    "func @k(%d: f32[64,96], %b: f32[96]) -> f32[64,96] {\n"
    "  %z = constant dense<0.0> : f32[]\n"
    "  %1 = add %d, %b : f32[64,96]\n"
    "  %2 = max %1, %z : f32[64,96]\n"
    "  return %2\n"
    "}\n"
    "func @f(%x: f32[64,128], %w: f32[128,96], %b: f32[96]) -> (f32[64,96], f32[64]) {\n"
    "  %d = dot %x, %w : f32[64,96]\n"
    "  %h = fusion @k(%d, %b) : f32[64,96]\n"
    "  %s = reduce_sum %h {axes=[1]} : f32[64]\n"
    "  return %h, %s\n"
    "}\n";

// 1: elementwise math into two reductions, an integer division that can fail
const char *kSoftmax =
    "func @k(%x: f32[31,67], %y: f32[67]) -> (f32[31], f32[31]) {\n"
    "  %d = sub %x, %y : f32[31,67]\n"
    "  %e = exp %d : f32[31,67]\n"
    "  %s = reduce_sum %e {axes=[1]} : f32[31]\n"
    "  %m = reduce_max %d {axes=[1]} : f32[31]\n"
    "  return %s, %m\n"
    "}\n"
    "func @f(%x: f32[31,67], %y: f32[67], %i: i32[40], %j: i32[40]) -> (f32[31], f32[31], i32[40]) {\n"
    "  %s, %m = fusion @k(%x, %y) : f32[31], f32[31]\n"
    "  %q = div %i, %j : i32[40]\n"
    "  return %s, %m, %q\n"
    "}\n";

struct Program {
  ir_module *m = nullptr;
  ir_func *f = nullptr;
  std::vector<kiln_tensor *> args;  // owned by the test's scope
  ~Program() { ir_module_free(m); }
};

kiln_tensor *random_f32(std::mt19937 &rng, V64 shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  std::uniform_real_distribution<float> u(-2, 2);
  std::vector<float> v((size_t)n);
  for (float &x : v) x = u(rng);
  return f32(shape, v);
}

kiln_tensor *random_i32(std::mt19937 &rng, V64 shape, bool nonzero) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  std::uniform_int_distribution<int> u(-50, 50);
  std::vector<int32_t> v((size_t)n);
  for (int32_t &x : v) {
    x = u(rng);
    if (nonzero && x == 0) x = 7;
  }
  return i32(shape, v);
}

// 2: large constants (read in place by the code), one read twice: shared
// says whether the two reads are one tensor or two equal ones (the IR text,
// and so the key, is the same either way).
bool constants_program(Program &p, bool shared, int variant = 0) {
  p.m = ir_module_new();
  op_type t{};
  t.dtype = KILN_F32;
  t.rank = 1;
  t.shape[0] = 4099;
  p.f = ir_func_new(p.m, "consts", 1, &t);
  if (!p.f) return false;
  std::vector<float> a(4099), b(4099);
  for (int i = 0; i < 4099; i++) a[(size_t)i] = (float)(i % 97) * 0.25f + (float)variant, b[(size_t)i] = 1.0f / (1 + i);
  kiln_tensor *ca = f32({4099}, a), *cb = f32({4099}, b), *ca2 = shared ? ca : f32({4099}, a);
  ir_value va = ir_constant(p.f, ca, ir_loc{}), vb = ir_constant(p.f, cb, ir_loc{});
  ir_value in1[2] = {0, va};
  ir_value m1 = ir_append(p.f, OP_MUL, nullptr, 2, in1, ir_loc{});
  ir_value in2[2] = {m1, vb};
  ir_value s1 = ir_append(p.f, OP_ADD, nullptr, 2, in2, ir_loc{});
  ir_value va2 = ir_constant(p.f, ca2, ir_loc{});
  ir_value in3[2] = {s1, va2};
  ir_value s2 = ir_append(p.f, OP_SUB, nullptr, 2, in3, ir_loc{});
  ir_value res[2] = {s2, va2};
  if (s2 < 0 || ir_set_results(p.f, 2, res)) return false;
  std::mt19937 rng(5);
  p.args = {random_f32(rng, {4099})};
  return true;
}

bool make_program(Program &p, int which, bool shared = true) {
  std::mt19937 rng(11 + which);
  if (which == 2) return constants_program(p, shared);
  p.m = ir_parse(which == 0 ? kDense : kSoftmax, "cache.kir");
  if (!p.m) return false;
  p.f = ir_module_find(p.m, "f");
  if (which == 0) {
    p.args = {random_f32(rng, {64, 128}), random_f32(rng, {128, 96}), random_f32(rng, {96})};
  } else {
    p.args = {random_f32(rng, {31, 67}), random_f32(rng, {67}), random_i32(rng, {40}, false),
              random_i32(rng, {40}, true)};
  }
  return true;
}

// within float rounding of another order of sums or FMA contraction
std::string mismatch(const kiln_tensor *want, const kiln_tensor *got) {
  if (!want || !got) return "missing result";
  if (kiln_tensor_dtype(want) != kiln_tensor_dtype(got) || shape_of(want) != shape_of(got)) return "another type";
  VD w = values(want), g = values(got);
  for (size_t i = 0; i < w.size(); i++)
    if (std::fabs(w[i] - g[i]) > 1e-4 * (1 + std::fabs(w[i])))
      return "element " + std::to_string(i) + ": want " + std::to_string(w[i]) + ", got " + std::to_string(g[i]);
  return "";
}

// Runs p's program compiled as c; the results against the interpreter's.
std::string check_results(const Program &p, cpu_program *c, std::vector<kiln_tensor *> *out = nullptr) {
  int n = p.f->n_results;
  std::vector<kiln_tensor *> want((size_t)n), got((size_t)n);
  if (ir_interpret(p.f, p.args.data(), want.data())) return std::string("interpreter: ") + kiln_last_error();
  if (cpu_run(c, p.args.data(), got.data())) return std::string("run: ") + kiln_last_error();
  for (int r = 0; r < n; r++) {
    std::string m = mismatch(want[(size_t)r], got[(size_t)r]);
    if (!m.empty()) return "result " + std::to_string(r) + ": " + m;
  }
  if (out) *out = got;
  return "";
}

// Compiles (expecting success), checks the results; whether it was a hit.
bool compile_check(const Program &p, const char *what, cpu_program **keep = nullptr) {
  cpu_program *c = cpu_compile(p.f);
  EXPECT_NE(c, nullptr) << what << ": " << kiln_last_error();
  if (!c) return false;
  EXPECT_EQ(check_results(p, c), "") << what;
  bool hit = cpu_program_from_cache(c);
  if (keep)
    *keep = c;
  else
    cpu_program_free(c);
  return hit;
}

// ---- child processes ----

enum { CHILD_MISS = 10, CHILD_HIT = 11 };

// Runs this test binary as a child (child_role) compiling program `which` into
// dir; returns its pid.
pid_t spawn_child(const std::string &dir, int which) {
  static std::string self = fs::read_symlink("/proc/self/exe").string();
  std::vector<std::string> env_s;
  for (char **e = environ; *e; e++)
    if (strncmp(*e, "KILN_CACHE_DIR=", 15) && strncmp(*e, "KILN_CACHE_TEST_ROLE=", 21)) env_s.push_back(*e);
  env_s.push_back("KILN_CACHE_DIR=" + dir);
  env_s.push_back("KILN_CACHE_TEST_ROLE=" + std::to_string(which));
  std::vector<char *> envp;
  for (std::string &s : env_s) envp.push_back(s.data());
  envp.push_back(nullptr);
  std::string filter = "--gtest_filter=-*"; // child_role exits before main
  char *argv[] = {self.data(), filter.data(), nullptr};
  pid_t pid = fork();
  if (pid == 0) {
    int null = open("/dev/null", O_WRONLY);
    if (null >= 0) dup2(null, 1);
    execve(self.c_str(), argv, envp.data());
    _exit(127);
  }
  return pid;
}

int wait_child(pid_t pid) {
  int status = 0;
  if (pid < 0 || waitpid(pid, &status, 0) != pid) return -1;
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + (WIFSIGNALED(status) ? WTERMSIG(status) : 0);
}

// The child's side: compile, check, report through the exit status.
// It runs before main (a static initializer below), so a child is never a
// test of its own.
int child_role() {
  const char *role = getenv("KILN_CACHE_TEST_ROLE");
  if (!role) return 0;
  int code;
  {
    kiln_scope_push();
    Program p;
    // the constants are separate tensors here, one in the parent
    if (!make_program(p, atoi(role), false)) {
      fprintf(stderr, "child: no program: %s\n", kiln_last_error());
      code = 2;
    } else if (cpu_program *c = cpu_compile(p.f); !c) {
      fprintf(stderr, "child: compile: %s\n", kiln_last_error());
      code = 3;
    } else {
      std::string m = check_results(p, c);
      if (!m.empty()) fprintf(stderr, "child: %s\n", m.c_str());
      code = !m.empty() ? 4 : cpu_program_from_cache(c) ? CHILD_HIT : CHILD_MISS;
      cpu_program_free(c);
    }
    kiln_scope_pop();
  }
  fflush(stderr);
  _exit(code);
}
const int child_hook = child_role();

// ---- the tests ----

TEST(CpuCache, ASecondCompileLoadsTheSameCode) {
  Scoped scope;
  TempDir dir;
  CacheEnv env(dir.path.c_str());
  for (int which = 0; which < 3; which++) {
    Program p;
    ASSERT_TRUE(make_program(p, which)) << kiln_last_error();
    cpu_program *cold = nullptr, *warm = nullptr;
    EXPECT_FALSE(compile_check(p, "cold", &cold));
    EXPECT_EQ(dir.entries().size(), (size_t)which + 1);
    EXPECT_TRUE(compile_check(p, "warm", &warm));
    ASSERT_TRUE(cold && warm);
    EXPECT_EQ(cpu_program_kernels(cold), cpu_program_kernels(warm));
    EXPECT_GT(cpu_program_compile_ms(warm), 0);
    // the same code: the same bits
    std::vector<kiln_tensor *> a, b;
    EXPECT_EQ(check_results(p, cold, &a), "");
    EXPECT_EQ(check_results(p, warm, &b), "");
    for (size_t r = 0; r < a.size() && r < b.size(); r++) EXPECT_TRUE(same_bits(a[r], b[r])) << which << " " << r;
    // both loaded at once, then one freed: the other still runs
    cpu_program_free(cold);
    EXPECT_EQ(check_results(p, warm), "");
    cpu_program_free(warm);
  }
  for (const std::string &f : dir.files()) EXPECT_EQ(f.find(".tmp"), std::string::npos) << f;
}

// A program compiled as two modules (two objects, two bitcodes) is one
// entry, and a hit links both objects again.
TEST(CpuCache, TwoPartProgramsAreOneEntry) {
  Scoped scope;
  TempDir dir;
  CacheEnv env(dir.path.c_str());
  cpu_options two{};
  two.parts = 2;
  for (int which = 0; which < 2; which++) {
    Program p;
    ASSERT_TRUE(make_program(p, which)) << kiln_last_error();
    cpu_program *cold = cpu_compile_with(p.f, &two), *warm = cpu_compile_with(p.f, &two);
    ASSERT_TRUE(cold && warm) << kiln_last_error();
    EXPECT_EQ(dir.entries().size(), 1u);
    EXPECT_FALSE(cpu_program_from_cache(cold));
    EXPECT_TRUE(cpu_program_from_cache(warm));
    EXPECT_EQ(cpu_program_parts(cold), 2);
    EXPECT_EQ(cpu_program_parts(warm), 2);
    std::vector<kiln_tensor *> a, b;
    EXPECT_EQ(check_results(p, cold, &a), "");
    EXPECT_EQ(check_results(p, warm, &b), "");
    for (size_t r = 0; r < a.size() && r < b.size(); r++) EXPECT_TRUE(same_bits(a[r], b[r])) << which << " " << r;
    char *ll = cpu_program_text(warm, "llvm");  // both bitcodes, read back as one module
    ASSERT_NE(ll, nullptr) << kiln_last_error();
    EXPECT_NE(std::string(ll).find("define dso_local void @kernel"), std::string::npos);
    free(ll);
    cpu_program_free(cold);
    cpu_program_free(warm);
    // the parts are part of the key: one module is another entry
    cpu_options one{};
    one.parts = 1;
    cpu_program *single = cpu_compile_with(p.f, &one);
    ASSERT_NE(single, nullptr) << kiln_last_error();
    EXPECT_FALSE(cpu_program_from_cache(single));
    EXPECT_EQ(cpu_program_parts(single), 1);
    cpu_program_free(single);
    for (const std::string &e : dir.entries()) fs::remove(e);
  }
}

TEST(CpuCache, PartsPackAndUnpack) {
  const char a[] = "first part", b[] = "the second";
  const void *data[2] = {a, b};
  size_t len[2] = {sizeof a, sizeof b}, packed_len = 0;
  char *packed = (char *)cpu_parts_pack(2, data, len, &packed_len);
  ASSERT_NE(packed, nullptr);
  const void *got[2];
  size_t got_len[2];
  ASSERT_EQ(cpu_parts_unpack(packed, packed_len, 2, got, got_len), 2);
  EXPECT_EQ(std::string((const char *)got[0], got_len[0]), std::string(a, sizeof a));
  EXPECT_EQ(std::string((const char *)got[1], got_len[1]), std::string(b, sizeof b));
  EXPECT_EQ(cpu_parts_unpack(packed, packed_len, 1, got, got_len), -1) << "more parts than room";
  EXPECT_EQ(cpu_parts_unpack(packed, packed_len - 1, 2, got, got_len), -1) << "truncated";
  std::vector<char> longer(packed, packed + packed_len);
  longer.push_back(0);
  EXPECT_EQ(cpu_parts_unpack(longer.data(), longer.size(), 2, got, got_len), -1) << "a trailing byte";
  std::vector<char> v(packed, packed + packed_len);
  v[8] = 0;  // no parts
  EXPECT_EQ(cpu_parts_unpack(v.data(), v.size(), 2, got, got_len), -1);
  v.assign(packed, packed + packed_len);
  for (int i = 12; i < 20; i++) v[(size_t)i] = (char)0xff;  // the first length
  EXPECT_EQ(cpu_parts_unpack(v.data(), v.size(), 2, got, got_len), -1);
  v.assign(packed, packed + packed_len);
  for (int i = 12; i < 20; i++) v[(size_t)i] = 0;  // an empty part
  EXPECT_EQ(cpu_parts_unpack(v.data(), v.size(), 2, got, got_len), -1);
  // an untagged buffer (an object file) is one part
  ASSERT_EQ(cpu_parts_unpack(a, sizeof a, 2, got, got_len), 1);
  EXPECT_EQ(got[0], (const void *)a);
  EXPECT_EQ(got_len[0], sizeof a);
  free(packed);
}

TEST(CpuCache, ManyProgramsOfOneEntryInOneProcess) {
  Scoped scope;
  TempDir dir;
  CacheEnv env(dir.path.c_str());
  Program p;
  ASSERT_TRUE(make_program(p, 0)) << kiln_last_error();
  std::vector<cpu_program *> ps;
  for (int i = 0; i < 6; i++) {
    cpu_program *c = nullptr;
    EXPECT_EQ(compile_check(p, "one of many", &c), i > 0);
    ps.push_back(c);
    if (i == 2) {  // freed JITDylibs are reused
      cpu_program_free(ps[0]);
      ps[0] = nullptr;
    }
  }
  for (cpu_program *c : ps) {
    if (c) {
      EXPECT_EQ(check_results(p, c), "");
    }
  }
  for (cpu_program *c : ps) cpu_program_free(c);
}

TEST(CpuCache, AFreshProcessLoadsTheCode) {
  Scoped scope;
  TempDir dir;
  CacheEnv env(dir.path.c_str());
  for (int which = 0; which < 3; which++) {
    Program p;
    ASSERT_TRUE(make_program(p, which)) << kiln_last_error();
    EXPECT_FALSE(compile_check(p, "parent"));
    // the child's constants are other tensors, at other addresses
    EXPECT_EQ(wait_child(spawn_child(dir.path, which)), CHILD_HIT) << "program " << which;
  }
  // and the other way round: the child writes, the parent reads
  TempDir dir2;
  EXPECT_EQ(wait_child(spawn_child(dir2.path, 2)), CHILD_MISS);
  CacheEnv env2(dir2.path.c_str());
  Program p;
  ASSERT_TRUE(make_program(p, 2, true)) << kiln_last_error();
  EXPECT_TRUE(compile_check(p, "after the child"));
}

TEST(CpuCache, ConstantsAreNotPartOfTheCode) {
  Scoped scope;
  TempDir dir;
  CacheEnv env(dir.path.c_str());
  Program a, b, c;
  ASSERT_TRUE(constants_program(a, true)) << kiln_last_error();
  ASSERT_TRUE(constants_program(b, false)) << kiln_last_error();
  ASSERT_TRUE(constants_program(c, false, 1)) << kiln_last_error();
  cpu_program *pa = nullptr, *pb = nullptr, *pc = nullptr;
  EXPECT_FALSE(compile_check(a, "shared", &pa));
  EXPECT_TRUE(compile_check(b, "separate", &pb));  // the same IR text
  EXPECT_FALSE(compile_check(c, "other values", &pc));
  // each reads its own constants, in place
  EXPECT_EQ(check_results(a, pa), "");
  EXPECT_EQ(check_results(b, pb), "");
  EXPECT_EQ(check_results(c, pc), "");
  cpu_program_free(pa);
  cpu_program_free(pb);
  cpu_program_free(pc);
}

void write_file(const std::string &path, const std::vector<char> &bytes) {
  std::ofstream o(path, std::ios::binary | std::ios::trunc);
  o.write(bytes.data(), (std::streamsize)bytes.size());
}

std::vector<char> read_file(const std::string &path) {
  std::ifstream i(path, std::ios::binary);
  return std::vector<char>(std::istreambuf_iterator<char>(i), std::istreambuf_iterator<char>());
}

TEST(CpuCache, CorruptEntriesAreRebuilt) {
  Scoped scope;
  TempDir dir;
  CacheEnv env(dir.path.c_str());
  Program p;
  ASSERT_TRUE(make_program(p, 1)) << kiln_last_error();
  EXPECT_FALSE(compile_check(p, "first"));
  ASSERT_EQ(dir.entries().size(), 1u);
  const std::string entry = dir.entries()[0];
  const std::vector<char> good = read_file(entry);
  ASSERT_GT(good.size(), 200u);
  struct Damage {
    const char *what;
    std::vector<char> bytes;
  };
  std::vector<Damage> damages;
  damages.push_back({"empty", {}});
  damages.push_back({"truncated", std::vector<char>(good.begin(), good.begin() + (long)good.size() / 2)});
  damages.push_back({"header only", std::vector<char>(good.begin(), good.begin() + 80)});
  std::vector<char> v = good;
  v[v.size() - 100] ^= 0x10;  // the bitcode
  damages.push_back({"a byte of the payload", v});
  v = good;
  v[v.size() / 2] ^= 0x01;  // the object code
  damages.push_back({"a byte of the object", v});
  v = good;
  v[0] = 'X';
  damages.push_back({"magic", v});
  v = good;
  v[8] ^= 0x7f;  // the format
  damages.push_back({"format", v});
  v = good;
  v.push_back(0);
  damages.push_back({"trailing byte", v});
  v = good;
  for (size_t i = 40; i < 48; i++) v[i] = (char)0xff;  // a length
  damages.push_back({"length", v});
  damages.push_back({"garbage", std::vector<char>(good.size(), 'k')});
  for (const Damage &d : damages) {
    write_file(entry, d.bytes);
    EXPECT_FALSE(compile_check(p, d.what)) << d.what;  // detected: compiled again
    EXPECT_EQ(read_file(entry), good) << d.what << ": rebuilt";
    EXPECT_TRUE(compile_check(p, d.what)) << d.what << ": a hit again";
  }
  // a directory where the entry should be: compiles, caches nothing
  fs::remove(entry);
  fs::create_directory(entry);
  EXPECT_FALSE(compile_check(p, "a directory"));
  EXPECT_FALSE(compile_check(p, "a directory"));
}

TEST(CpuCache, AnotherKeysEntryIsStale) {
  Scoped scope;
  TempDir dir;
  CacheEnv env(dir.path.c_str());
  Program a, b;
  ASSERT_TRUE(make_program(a, 0)) << kiln_last_error();
  ASSERT_TRUE(make_program(b, 1)) << kiln_last_error();
  EXPECT_FALSE(compile_check(a, "a"));
  std::string ea = dir.entries()[0];
  EXPECT_FALSE(compile_check(b, "b"));
  ASSERT_EQ(dir.entries().size(), 2u);
  std::string eb = dir.entries()[0] == ea ? dir.entries()[1] : dir.entries()[0];
  // a's entry under b's name (as if two keys collided): not taken
  fs::copy_file(ea, eb, fs::copy_options::overwrite_existing);
  EXPECT_FALSE(compile_check(b, "b over a"));
  EXPECT_TRUE(compile_check(b, "b again"));
  EXPECT_TRUE(compile_check(a, "a again"));
}

TEST(CpuCache, OptionsAreInTheKey) {
  Scoped scope;
  TempDir dir;
  CacheEnv env(dir.path.c_str());
  Program p;
  ASSERT_TRUE(make_program(p, 0)) << kiln_last_error();
  EXPECT_FALSE(compile_check(p, "contract"));
  cpu_options strict{};
  strict.no_contract = true;
  cpu_program *c = cpu_compile_with(p.f, &strict);
  ASSERT_NE(c, nullptr) << kiln_last_error();
  EXPECT_FALSE(cpu_program_from_cache(c));
  cpu_program_free(c);
  c = cpu_compile_with(p.f, &strict);
  ASSERT_NE(c, nullptr) << kiln_last_error();
  EXPECT_TRUE(cpu_program_from_cache(c));
  EXPECT_EQ(check_results(p, c), "");
  cpu_program_free(c);
  EXPECT_EQ(dir.entries().size(), 2u);
}

TEST(CpuCache, AnUnwritableDirectoryOnlyCostsTheCaching) {
  Scoped scope;
  TempDir dir;
  // a directory that cannot be made, even by root: under a plain file
  std::string file = dir.path + "/file";
  write_file(file, {'x'});
  std::string sub = file + "/cache/kiln";
  CacheEnv env(sub.c_str());
  Program p;
  ASSERT_TRUE(make_program(p, 0)) << kiln_last_error();
  kiln_clear_error();
  EXPECT_FALSE(compile_check(p, "unwritable"));
  EXPECT_FALSE(compile_check(p, "unwritable"));
  EXPECT_STREQ(kiln_last_error(), "");
  EXPECT_EQ(dir.files(), std::vector<std::string>{"file"});
  // read-only for its owner (root ignores the mode: then it caches)
  std::string ro = dir.path + "/ro";
  fs::create_directory(ro);
  chmod(ro.c_str(), 0500);
  CacheEnv env2(ro.c_str());
  EXPECT_FALSE(compile_check(p, "read-only"));
  bool root = geteuid() == 0;
  EXPECT_EQ(compile_check(p, "read-only"), root);
  chmod(ro.c_str(), 0700);
}

TEST(CpuCache, OffOrEmptyDisablesIt) {
  Scoped scope;
  TempDir dir;
  std::string cwd = fs::current_path().string();
  ASSERT_EQ(chdir(dir.path.c_str()), 0);
  Program p;
  ASSERT_TRUE(make_program(p, 1)) << kiln_last_error();
  for (const char *v : {"off", ""}) {
    CacheEnv env(v);
    EXPECT_FALSE(compile_check(p, v));
    EXPECT_FALSE(compile_check(p, v));
  }
  EXPECT_TRUE(dir.files().empty());
  ASSERT_EQ(chdir(cwd.c_str()), 0);
}

TEST(CpuCache, TheDefaultIsUnderXdgCacheHome) {
  Scoped scope;
  TempDir dir;
  CacheEnv env(nullptr);
  setenv("XDG_CACHE_HOME", dir.path.c_str(), 1);
  Program p;
  ASSERT_TRUE(make_program(p, 1)) << kiln_last_error();
  EXPECT_FALSE(compile_check(p, "default"));
  EXPECT_TRUE(compile_check(p, "default"));
  std::error_code ec;
  int n = 0;
  for (const auto &e : fs::directory_iterator(dir.path + "/kiln", ec)) n += e.path().extension() == ".kco";
  EXPECT_EQ(n, 1);
}

TEST(CpuCache, TextStagesFromAHit) {
  Scoped scope;
  TempDir dir;
  CacheEnv env(dir.path.c_str());
  ir_module *m = ir_parse(
      "func @f(%x: f32[1000], %y: f32[1000]) -> f32[1000] {\n  %a = add %x, %y : f32[1000]\n"
      "  %e = exp %a : f32[1000]\n  return %e\n}\n",
      "text.kir");
  ASSERT_NE(m, nullptr) << kiln_last_error();
  std::string text[2][2];
  for (int i = 0; i < 2; i++) {
    cpu_program *p = cpu_compile(m->funcs[0]);
    ASSERT_NE(p, nullptr) << kiln_last_error();
    EXPECT_EQ(cpu_program_from_cache(p), i == 1);
    EXPECT_EQ(cpu_program_kernels(p), 2);
    for (int s = 0; s < 2; s++) {
      char *t = cpu_program_text(p, s ? "asm" : "llvm");
      ASSERT_NE(t, nullptr) << kiln_last_error();
      text[i][s] = t;
      free(t);
    }
    cpu_program_free(p);
  }
  EXPECT_THAT(text[1][0], HasSubstr("x float>"));  // vectorized
  EXPECT_THAT(text[1][1], HasSubstr("vfmadd"));
  EXPECT_EQ(text[0][0], text[1][0]);
  EXPECT_EQ(text[0][1], text[1][1]);
  ir_module_free(m);
}

TEST(CpuCache, ProcessesCompilingAtOnce) {
  Scoped scope;
  TempDir dir;
  // eight fresh processes, three programs, one empty directory
  std::vector<pid_t> pids;
  for (int i = 0; i < 8; i++) pids.push_back(spawn_child(dir.path, i % 3));
  for (size_t i = 0; i < pids.size(); i++) {
    int code = wait_child(pids[i]);
    EXPECT_TRUE(code == CHILD_HIT || code == CHILD_MISS) << "child " << i << " exited with " << code;
  }
  for (const std::string &f : dir.files()) EXPECT_EQ(f.find(".tmp"), std::string::npos) << "left over: " << f;
  EXPECT_EQ(dir.entries().size(), 3u);
  // every entry is whole: this process and new ones hit
  CacheEnv env(dir.path.c_str());
  for (int which = 0; which < 3; which++) {
    Program p;
    ASSERT_TRUE(make_program(p, which)) << kiln_last_error();
    EXPECT_TRUE(compile_check(p, "after the children")) << which;
  }
  pids.clear();
  for (int i = 0; i < 6; i++) pids.push_back(spawn_child(dir.path, i % 3));
  for (pid_t pid : pids) EXPECT_EQ(wait_child(pid), CHILD_HIT);
  EXPECT_EQ(dir.entries().size(), 3u);
}

}  // namespace

namespace {

// Sets path's access and modification times to age_seconds ago.
void set_age(const std::string &path, int age_seconds) {
  struct timespec t[2];
  clock_gettime(CLOCK_REALTIME, &t[0]);
  t[0].tv_sec -= age_seconds;
  t[1] = t[0];
  EXPECT_EQ(utimensat(AT_FDCWD, path.c_str(), t, 0), 0) << path;
}

void make_aged_file(const std::string &path, size_t bytes, int age_seconds) {
  std::ofstream(path, std::ios::binary) << std::string(bytes, 'x');
  set_age(path, age_seconds);
}

bool exists(const std::string &path) { return access(path.c_str(), F_OK) == 0; }

// Beyond the limit, the least recently used entries go first, down to 90%
// of it; a writer's temporary file goes once it is an hour old; other files
// stay.
TEST(CpuCache, TrimmingDropsTheLeastRecentlyUsed) {
  TempDir dir;
  std::string d = dir.path + "/";
  make_aged_file(d + "a.kco", 1000, 300);
  make_aged_file(d + "b.kco", 1000, 200);
  make_aged_file(d + "c.kco", 1000, 100);
  make_aged_file(d + "a.kco.tmp-1-00ff", 10, 7200); // a crashed writer's
  make_aged_file(d + "b.kco.tmp-2-00ff", 10, 5);    // a writer at work
  make_aged_file(d + "notes.txt", 5000, 9000);
  cpu_cache_trim(dir.path.c_str(), 4000); // under the limit: only the old temporary file goes
  EXPECT_TRUE(exists(d + "a.kco") && exists(d + "b.kco") && exists(d + "c.kco"));
  EXPECT_FALSE(exists(d + "a.kco.tmp-1-00ff"));
  EXPECT_TRUE(exists(d + "b.kco.tmp-2-00ff"));
  cpu_cache_trim(dir.path.c_str(), 2500); // 3000 bytes > 2500: down to 2250, oldest first
  EXPECT_FALSE(exists(d + "a.kco"));
  EXPECT_TRUE(exists(d + "b.kco") && exists(d + "c.kco"));
  cpu_cache_trim(dir.path.c_str(), 1000); // 2000 > 1000: down to 900
  EXPECT_FALSE(exists(d + "b.kco") || exists(d + "c.kco"));
  EXPECT_TRUE(exists(d + "notes.txt") && exists(d + "b.kco.tmp-2-00ff"));
  cpu_cache_trim((dir.path + "/missing").c_str(), 1); // no directory: nothing to do
}

// A hit marks its entry recently used; KILN_CACHE_MAX_MB bounds what
// stores leave behind, and a program whose entry was trimmed still runs.
TEST(CpuCache, HitsAreRecentAndStoresKeepTheLimit) {
  Scoped scope;
  TempDir dir;
  CacheEnv env(dir.path.c_str());
  Program p;
  ASSERT_TRUE(make_program(p, 0)) << kiln_last_error();
  EXPECT_FALSE(compile_check(p, "cold"));
  std::vector<std::string> es = dir.entries();
  ASSERT_EQ(es.size(), 1u);
  set_age(es[0], 86400);
  EXPECT_TRUE(compile_check(p, "warm"));
  struct stat st;
  ASSERT_EQ(stat(es[0].c_str(), &st), 0);
  EXPECT_GT(st.st_mtime, time(nullptr) - 3600) << "a hit touches its entry";

  EnvGuard limit("KILN_CACHE_MAX_MB", "0.000001"); // about one byte: every store trims everything
  EXPECT_EQ(cpu_cache_limit_bytes(), 1);
  Program q;
  ASSERT_TRUE(make_program(q, 1)) << kiln_last_error();
  EXPECT_FALSE(compile_check(q, "cold, then trimmed"));
  EXPECT_TRUE(dir.entries().empty());
}

// ---- the cache holds code we execute ----

// waits for a child at most `seconds`; kills it (and says so) past that
int wait_child_for(pid_t pid, int seconds) {
  for (int i = 0; i < seconds * 20; i++) {
    int status = 0;
    pid_t r = waitpid(pid, &status, WNOHANG);
    if (r == pid) return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + (WIFSIGNALED(status) ? WTERMSIG(status) : 0);
    if (r < 0) return -1;
    usleep(50000);
  }
  kill(pid, SIGKILL);
  waitpid(pid, nullptr, 0);
  return -2;  // hung
}

// The program's entry in dir (compiled cold here): its path.
std::string entry_of(const Program &p, const TempDir &dir) {
  EXPECT_FALSE(compile_check(p, "cold"));
  std::vector<std::string> es = dir.entries();
  EXPECT_EQ(es.size(), 1u);
  return es.empty() ? "" : es[0];
}

// A FIFO named like an entry hung every process that compiled the program
// (open() blocked for a writer); now it is a miss, and the store replaces
// it with a regular file. A child compiles, so a hang fails the test.
TEST(CpuCacheSecurity, AFifoNamedLikeAnEntryDoesNotHang) {
  Scoped scope;
  TempDir dir;
  CacheEnv env(dir.path.c_str());
  Program p;
  ASSERT_TRUE(make_program(p, 1)) << kiln_last_error();
  std::string entry = entry_of(p, dir);
  ASSERT_FALSE(entry.empty());
  ASSERT_EQ(unlink(entry.c_str()), 0);
  ASSERT_EQ(mkfifo(entry.c_str(), 0600), 0) << strerror(errno);
  EXPECT_EQ(wait_child_for(spawn_child(dir.path, 1), 60), CHILD_MISS) << "-2: the child hung on the FIFO";
  struct stat st;
  ASSERT_EQ(lstat(entry.c_str(), &st), 0);
  EXPECT_TRUE(S_ISREG(st.st_mode)) << "the store replaced the FIFO";
  EXPECT_EQ(st.st_mode & 0777, 0600u) << "entries are private";
  EXPECT_TRUE(compile_check(p, "after the FIFO"));
}

// An entry that is a symbolic link (even to a valid entry) is never read,
// nor one too large for the bound; both are misses that still compile.
TEST(CpuCacheSecurity, LinksAndOversizedEntriesAreNotRead) {
  Scoped scope;
  TempDir dir, elsewhere;
  CacheEnv env(dir.path.c_str());
  Program p;
  ASSERT_TRUE(make_program(p, 0)) << kiln_last_error();
  std::string entry = entry_of(p, dir);
  ASSERT_FALSE(entry.empty());
  std::string moved = elsewhere.path + "/valid.kco";
  ASSERT_EQ(rename(entry.c_str(), moved.c_str()), 0);
  ASSERT_EQ(symlink(moved.c_str(), entry.c_str()), 0);
  EXPECT_FALSE(compile_check(p, "a link to a valid entry"));
  struct stat st;
  ASSERT_EQ(lstat(entry.c_str(), &st), 0);
  EXPECT_TRUE(S_ISREG(st.st_mode)) << "the store replaced the link, not its target";
  EXPECT_TRUE(compile_check(p, "rewritten"));
  {
    // the entry is some kilobytes: over a bound of 1000 bytes it is not
    // read, and the store under that bound trims it
    ASSERT_GT(st.st_size, 1000);
    EnvGuard limit("KILN_CACHE_MAX_MB", "0.0009");
    EXPECT_FALSE(compile_check(p, "over the bound"));
    EXPECT_TRUE(dir.entries().empty());
  }
  EXPECT_FALSE(compile_check(p, "under the default bound"));
  EXPECT_TRUE(compile_check(p, "under the default bound, again"));
  // over 256 MB (a sparse file) an entry is not read at all: a miss, rewritten
  {
    int fd = open(entry.c_str(), O_WRONLY | O_TRUNC);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(ftruncate(fd, (off_t)300 << 20), 0);
    close(fd);
  }
  EXPECT_FALSE(compile_check(p, "a 300 MB entry"));
  ASSERT_EQ(stat(entry.c_str(), &st), 0);
  EXPECT_LT(st.st_size, 1 << 20);
  EXPECT_TRUE(compile_check(p, "rewritten after 300 MB"));
  if (geteuid() == 0) {  // root: an entry of another user's is not read either
    ASSERT_EQ(chown(entry.c_str(), 65534, 65534), 0);
    EXPECT_FALSE(compile_check(p, "another user's entry"));
  }
}

// A directory that others may write (or another user owns) is not a cache:
// one line on stderr, once, names it and why; compiles still work.
TEST(CpuCacheSecurity, AWorldWritableDirectoryIsNoCache) {
  Scoped scope;
  TempDir dir;
  std::string open_dir = dir.path + "/shared";
  ASSERT_EQ(mkdir(open_dir.c_str(), 0700), 0);
  ASSERT_EQ(chmod(open_dir.c_str(), 0777), 0);
  CacheEnv env(open_dir.c_str());
  Program p;
  ASSERT_TRUE(make_program(p, 1)) << kiln_last_error();
  testing::internal::CaptureStderr();
  EXPECT_FALSE(compile_check(p, "world-writable"));
  EXPECT_FALSE(compile_check(p, "world-writable, again"));
  std::string err = testing::internal::GetCapturedStderr();
  EXPECT_THAT(err, HasSubstr(open_dir + ": writable by others (mode 777)"));
  EXPECT_EQ(std::count(err.begin(), err.end(), '\n'), 1) << err;
  EXPECT_TRUE(fs::is_empty(open_dir));
  // a missing directory is made private
  std::string fresh = dir.path + "/a/b/kiln";
  CacheEnv env2(fresh.c_str());
  EXPECT_FALSE(compile_check(p, "fresh"));
  EXPECT_TRUE(compile_check(p, "fresh, again"));
  struct stat st;
  ASSERT_EQ(stat(fresh.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0700u);
}

}  // namespace
