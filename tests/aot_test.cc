// aot_test.cc — ahead-of-time objects (API.md §11): a saved MLP's trace
// through kiln-aot, linked by the system's cc with libkiln_rt alone (ldd:
// neither libkiln nor libLLVM), gives the JIT's bits in a fresh process,
// against the shared and the static runtime; an index out of range inside
// returns -1 with kiln_rt_last_error(); kiln-aot refuses bad arguments
// (missing directory, trace or function name) with clear messages.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <kiln.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "io_util.h"
#include "test_util.h"

using ::testing::HasSubstr;
using ::testing::Not;

namespace {

namespace fs = std::filesystem;
using namespace kiln_test;

struct TempDir : kiln_io_test::IoTempDir {
  TempDir() : IoTempDir("kiln_aot") {}
};

std::string read_file(const std::string &path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

void write_file(const std::string &path, const std::string &bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), (std::streamsize)bytes.size());
}

std::string data_of(const kiln_tensor *t) {
  EXPECT_NE(t, nullptr) << kiln_last_error();
  if (!t) return "";
  std::string data((size_t)kiln_tensor_size(t) * kiln_dtype_size(kiln_tensor_dtype(t)), '\0');
  EXPECT_EQ(kiln_tensor_read(t, data.data(), data.size()), 0) << kiln_last_error();
  return data;
}

// Runs a shell command; its exit status, with stdout and stderr in *out.
int sh(const std::string &cmd, std::string *out = nullptr) {
  std::string full = "(" + cmd + ") 2>&1";
  FILE *p = popen(full.c_str(), "r");
  if (!p) return -1;
  std::string text;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, p)) > 0) text.append(buf, n);
  int status = pclose(p);
  if (out) *out = text;
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

bool have(const char *tool) { return sh(std::string("command -v ") + tool + " >/dev/null") == 0; }

// A program that reads its inputs from argv[1] (their bytes one after the
// other), calls NAME_run and writes the outputs to argv[2]; on failure it
// prints "rc=-1 <kiln_rt_last_error()>" and exits 3.
std::string driver(const std::string &name, int n_in, int n_out) {
  std::string up;
  for (char c : name) up += (char)toupper(c);
  std::ostringstream s;
  s << "#include <stdio.h>\n#include <stdlib.h>\n#include \"" << name << ".h\"\n"
    << "int main(int argc, char **argv) {\n  if (argc != 3) return 2;\n"
    << "  size_t in_bytes[] = {";
  for (int i = 0; i < n_in; i++) s << up << "_INPUT_" << i << "_BYTES, ";
  s << "0};\n  size_t out_bytes[] = {";
  for (int r = 0; r < n_out; r++) s << up << "_OUTPUT_" << r << "_BYTES, ";
  s << "0};\n  const void *in[" << n_in + 1 << "];\n  void *out[" << n_out + 1 << "];\n"
    << "  FILE *f = fopen(argv[1], \"rb\");\n  if (!f) return 4;\n"
    << "  for (int i = 0; i < " << n_in << "; i++) {\n"
    << "    void *p = aligned_alloc(" << up << "_ALIGN, (in_bytes[i] + 63) / 64 * 64);\n"
    << "    if (fread(p, 1, in_bytes[i], f) != in_bytes[i]) return 5;\n    in[i] = p;\n  }\n  fclose(f);\n"
    << "  for (int r = 0; r < " << n_out << "; r++) out[r] = aligned_alloc(" << up
    << "_ALIGN, (out_bytes[r] + 63) / 64 * 64);\n"
    << "  int rc = " << name << "_run(in, out);\n"
    << "  if (rc) { printf(\"rc=%d %s\\n\", rc, kiln_rt_last_error()); return 3; }\n"
    << "  f = fopen(argv[2], \"wb\");\n"
    << "  for (int r = 0; r < " << n_out << "; r++) fwrite(out[r], 1, out_bytes[r], f);\n"
    << "  fclose(f);\n  return 0;\n}\n";
  return s.str();
}

std::string aot_cmd(const std::string &args) { return std::string(KILN_AOT_TOOL) + " " + args; }

// kiln-aot on trace 0 of dir's function name (with flags), then the driver linked
// with the shared libkiln_rt (exe) and with the static one (exe_static).
// False (with a failure) where a step fails.
bool build(const TempDir &t, const std::string &dir, const std::string &name, int n_in, int n_out,
           const std::string &flags = "") {
  std::string out;
  int rc = sh(aot_cmd(dir + " --function " + name + " --trace 0 -o " + t.file(name + ".o") + " --header " +
                      t.file(name + ".h") + flags), &out);
  EXPECT_EQ(rc, 0) << out;
  if (rc) return false;
  write_file(t.file("main.c"), driver(name, n_in, n_out));
  std::string cc = "cc -std=c11 -Wall -Wextra -Werror -O2 -I" + t.path + " " + t.file("main.c") + " " +
                   t.file(name + ".o") + " ";
  rc = sh(cc + "-L" KILN_RT_DIR " -lkiln_rt -Wl,-rpath," KILN_RT_DIR " -lm -lpthread -o " + t.file("exe"), &out);
  EXPECT_EQ(rc, 0) << out;
  if (rc) return false;
  rc = sh(cc + KILN_RT_STATIC " -lm -lpthread -o " + t.file("exe_static"), &out);
  EXPECT_EQ(rc, 0) << out;
  return rc == 0;
}

int mlp_body(void *user, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  kiln_variable **v = (kiln_variable **)user;
  kiln_tensor *h = kiln_relu(kiln_add(kiln_matmul(in[0], kiln_variable_read(v[0])), kiln_variable_read(v[1])));
  out[0] = kiln_add(kiln_matmul(h, kiln_variable_read(v[2])), kiln_variable_read(v[3]));
  out[1] = kiln_argmax(out[0], 1);
  return 0;
}

// mlp_body's function over random [batch, in_dim] inputs and weights of
// hidden units and 10 classes (owned by own), called once (*x, want[2])
// and saved to dir.
void saved_mlp(Owned &own, uint64_t seed, int64_t batch, int64_t in_dim, int64_t hidden, const std::string &dir,
               kiln_tensor **x, kiln_tensor **want) {
  kiln_random_seed(seed);
  const int64_t classes = 10;
  kiln_variable *v[4] = {own.var(kiln_random_normal(KILN_F32, 2, V64{in_dim, hidden}.data()), "w1"),
                         own.var(kiln_random_normal(KILN_F32, 1, V64{hidden}.data()), "b1"),
                         own.var(kiln_random_normal(KILN_F32, 2, V64{hidden, classes}.data()), "w2"),
                         own.var(kiln_random_normal(KILN_F32, 1, V64{classes}.data()), "b2")};
  kiln_function *f = kiln_function_new("mlp", mlp_body, v, 1, 2);
  *x = kiln_random_normal(KILN_F32, 2, V64{batch, in_dim}.data());
  ASSERT_EQ(kiln_function_call(f, x, want), 0) << kiln_last_error();
  ASSERT_EQ(kiln_function_save(f, dir.c_str()), 0) << kiln_last_error();
  kiln_function_free(f);
}

TEST(Aot, MlpGivesTheJitsBitsInAFreshProcess) {
  if (!have("cc")) GTEST_SKIP() << "no C compiler (cc) to link the object with";
  Scoped s;
  Owned own;
  TempDir t;
  // big enough for the blocked matmul's packed paths (64^3 multiply-adds and more)
  std::string dir = t.file("saved");
  kiln_tensor *x, *want[2];
  ASSERT_NO_FATAL_FAILURE(saved_mlp(own, 11, 64, 784, 256, dir, &x, want));
  kiln_function *g = kiln_function_load(dir.c_str());
  ASSERT_NE(g, nullptr) << kiln_last_error();
  kiln_tensor *jit[2];
  ASSERT_EQ(kiln_function_call(g, &x, jit), 0) << kiln_last_error();
  std::string expect = data_of(jit[0]) + data_of(jit[1]);
  ASSERT_EQ(expect, data_of(want[0]) + data_of(want[1]));  // the loaded function is the original
  kiln_function_free(g);

  ASSERT_TRUE(build(t, dir, "mlp", 1, 2));
  std::string header = read_file(t.file("mlp.h"));
  EXPECT_THAT(header, HasSubstr("int mlp_run(const void *const *inputs, void *const *outputs);"));
  EXPECT_THAT(header, HasSubstr("#define MLP_INPUT_0_SHAPE {64, 784}"));
  EXPECT_THAT(header, HasSubstr("#define MLP_OUTPUT_1_DTYPE \"i64\""));
  EXPECT_THAT(header, HasSubstr("#define MLP_ARENA_BYTES "));
  write_file(t.file("in.bin"), data_of(x));
  for (const char *exe : {"exe", "exe_static"}) {
    std::string out;
    std::remove(t.file("out.bin").c_str());
    ASSERT_EQ(sh(t.file(exe) + " " + t.file("in.bin") + " " + t.file("out.bin"), &out), 0) << exe << ": " << out;
    EXPECT_TRUE(read_file(t.file("out.bin")) == expect) << exe << ": the outputs differ from the JIT's";
  }
  // what the program loads: libkiln_rt, not libkiln or LLVM
  if (!have("ldd")) GTEST_SKIP() << "no ldd: the outputs matched; the libraries loaded are not checked";
  std::string libs;
  ASSERT_EQ(sh("ldd " + t.file("exe"), &libs), 0) << libs;
  EXPECT_THAT(libs, HasSubstr("libkiln_rt.so"));
  EXPECT_THAT(libs, Not(HasSubstr("libkiln.so")));
  EXPECT_THAT(libs, Not(HasSubstr("libkiln_internal")));
  EXPECT_THAT(libs, Not(HasSubstr("LLVM")));
  ASSERT_EQ(sh("ldd " + t.file("exe_static"), &libs), 0) << libs;
  EXPECT_THAT(libs, Not(HasSubstr("kiln")));
  EXPECT_THAT(libs, Not(HasSubstr("LLVM")));
}

// An object for another x86-64 level (--cpu) runs where the CPU has it and
// gives the JIT's answers: the same bits where the level fuses
// multiply-adds as the host does, within rounding where it does not.
TEST(Aot, ObjectsForOtherCpuLevelsRun) {
  if (!have("cc")) GTEST_SKIP() << "no C compiler (cc) to link the object with";
  Scoped s;
  Owned own;
  TempDir saved;
  std::string dir = saved.file("saved");
  kiln_tensor *x, *want[2];
  ASSERT_NO_FATAL_FAILURE(saved_mlp(own, 12, 33, 70, 40, dir, &x, want));
  std::string logits = data_of(want[0]);
  std::vector<float> expect(logits.size() / sizeof(float));
  memcpy(expect.data(), logits.data(), logits.size());
  int ran = 0;
  for (const char *cpu : {"x86-64", "x86-64-v2", "x86-64-v3"}) {
    bool runs = !strcmp(cpu, "x86-64") || (!strcmp(cpu, "x86-64-v2") && __builtin_cpu_supports("sse4.2")) ||
                (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"));
    if (!runs) continue;
    TempDir t;
    ASSERT_TRUE(build(t, dir, "mlp", 1, 2, std::string(" --cpu=") + cpu)) << cpu;
    std::string out;
    if (have("objdump")) {  // the level's registers, none wider
      ASSERT_EQ(sh("objdump -d " + t.file("mlp.o"), &out), 0) << out;
      EXPECT_THAT(out, Not(HasSubstr("%zmm"))) << cpu;
      if (strcmp(cpu, "x86-64-v3")) {
        EXPECT_THAT(out, Not(HasSubstr("%ymm"))) << cpu;
      }
    }
    write_file(t.file("in.bin"), data_of(x));
    ASSERT_EQ(sh(t.file("exe") + " " + t.file("in.bin") + " " + t.file("out.bin"), &out), 0) << cpu << ": " << out;
    std::string got = read_file(t.file("out.bin"));
    ASSERT_EQ(got.size(), logits.size() + data_of(want[1]).size()) << cpu;
    std::vector<float> y(expect.size());
    memcpy(y.data(), got.data(), logits.size());
    for (size_t i = 0; i < y.size(); i++)
      ASSERT_NEAR(y[i], expect[i], 1e-4 * (1 + std::fabs(expect[i]))) << cpu << ": logit " << i;
    ran++;
  }
  EXPECT_GE(ran, 1);
}

kiln_tensor *table;  // gather_body's captured constant

int gather_body(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  out[0] = kiln_mul(kiln_gather(table, in[0], 0), kiln_scalar_like(table, 2));
  return 0;
}

TEST(Aot, IndexOutOfRangeReturnsMinusOneWithAMessage) {
  if (!have("cc")) GTEST_SKIP() << "no C compiler (cc) to link the object with";
  Scoped s;
  TempDir t;
  kiln_random_seed(3);
  table = kiln_retain(kiln_random_normal(KILN_F32, 2, V64{8, 4}.data()));
  kiln_function *f = kiln_function_new("lookup", gather_body, nullptr, 1, 1);
  int32_t good[5] = {0, 7, 3, 3, 1}, bad[5] = {0, 7, 8, 3, 1};
  kiln_tensor *idx = kiln_tensor_new(KILN_I32, 1, V64{5}.data(), good), *want;
  ASSERT_EQ(kiln_function_call(f, &idx, &want), 0) << kiln_last_error();
  std::string dir = t.file("saved");
  ASSERT_EQ(kiln_function_save(f, dir.c_str()), 0) << kiln_last_error();
  kiln_function_free(f);
  kiln_release(table);
  ASSERT_TRUE(build(t, dir, "lookup", 1, 1));
  std::string out;
  write_file(t.file("good.bin"), std::string((const char *)good, sizeof good));
  ASSERT_EQ(sh(t.file("exe") + " " + t.file("good.bin") + " " + t.file("out.bin"), &out), 0) << out;
  EXPECT_TRUE(read_file(t.file("out.bin")) == data_of(want));
  write_file(t.file("bad.bin"), std::string((const char *)bad, sizeof bad));
  for (const char *exe : {"exe", "exe_static"}) {
    EXPECT_EQ(sh(t.file(exe) + " " + t.file("bad.bin") + " " + t.file("out.bin"), &out), 3) << out;
    EXPECT_THAT(out, HasSubstr("rc=-1 lookup_run: gather: indices[2] = 8 is not in [0, 8)")) << exe;
  }
}

TEST(Aot, BadArgumentsFailClearly) {
  Scoped s;
  TempDir t;
  kiln_random_seed(3);
  table = kiln_retain(kiln_random_normal(KILN_F32, 2, V64{8, 4}.data()));
  kiln_function *f = kiln_function_new("lookup", gather_body, nullptr, 1, 1);
  int32_t good[2] = {0, 7};
  kiln_tensor *idx = kiln_tensor_new(KILN_I32, 1, V64{2}.data(), good), *y;
  ASSERT_EQ(kiln_function_call(f, &idx, &y), 0) << kiln_last_error();
  std::string dir = t.file("saved");
  ASSERT_EQ(kiln_function_save(f, dir.c_str()), 0) << kiln_last_error();
  kiln_function_free(f);
  kiln_release(table);
  std::string o = " -o " + t.file("x.o") + " --header " + t.file("x.h"), out;
  EXPECT_EQ(sh(aot_cmd(t.file("missing") + " --function lookup --trace 0" + o), &out), 1);
  EXPECT_THAT(out, HasSubstr("kiln-aot: "));
  EXPECT_THAT(out, HasSubstr("missing"));
  EXPECT_EQ(sh(aot_cmd(dir + " --function lookup --trace 1" + o), &out), 1);
  EXPECT_THAT(out, HasSubstr("kiln-aot: @lookup has 1 saved trace (0 to 0); there is no trace 1"));
  EXPECT_EQ(sh(aot_cmd(dir + " --function mlp --trace 0" + o), &out), 1);
  EXPECT_THAT(out, HasSubstr("kiln-aot: " + dir + " holds function @lookup, not @mlp"));
  EXPECT_EQ(sh(aot_cmd(dir + " --function lookup --trace x" + o), &out), 2);
  EXPECT_THAT(out, HasSubstr("kiln-aot: --trace takes a trace number"));
  EXPECT_EQ(sh(aot_cmd(dir + " --function 'no-c-name' --trace 0" + o), &out), 2);
  EXPECT_THAT(out, HasSubstr("kiln-aot: --function takes a C identifier"));
  EXPECT_EQ(sh(aot_cmd(dir + " --function lookup --trace 0"), &out), 2);
  EXPECT_THAT(out, HasSubstr("usage: kiln-aot DIR"));
  EXPECT_EQ(sh(aot_cmd(dir + " --function lookup --trace 0 --target=nonsense-triple" + o), &out), 1);
  EXPECT_THAT(out, HasSubstr("kiln-aot: cpu: @lookup: no target for nonsense-triple"));
  EXPECT_FALSE(fs::exists(t.file("x.o")));
}

}  // namespace
