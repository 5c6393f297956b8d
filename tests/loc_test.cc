// loc_test.cc — source locations of traced instructions (resolved from the
// user's call site, this file is built with -g) and KILN_DUMP's files.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <kiln.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <filesystem>
#include <string>
#include <unistd.h>

#include "ir.h"
#include "test_util.h"

using namespace kiln_test;
using testing::HasSubstr;

namespace {

int g_add_line, g_exp_line;

int body(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  g_add_line = __LINE__ + 1;
  kiln_tensor *s = kiln_add(in[0], in[0]);
  g_exp_line = __LINE__ + 1;
  out[0] = kiln_exp(s);
  return out[0] ? 0 : -1;
}

std::string loc_of(int line) { return "loc(loc_test.cc:" + std::to_string(line) + ")"; }

std::string read_all(const std::string &path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace

TEST(Loc, TracedInstructionsCarryTheCallSite) {
  Scoped s;
  kiln_function *f = kiln_function_new("locs", body, nullptr, 1, 1);
  ASSERT_NE(f, nullptr);
  kiln_tensor *x = f32({1, 2}), *y = nullptr;
  ASSERT_EQ(kiln_function_call(f, &x, &y), 0) << kiln_last_error();
  for (const char *stage : {"traced", "optimized"}) {
    char *ir = kiln_function_ir(f, 0, stage);
    ASSERT_NE(ir, nullptr) << kiln_last_error();
    EXPECT_THAT(ir, HasSubstr(loc_of(g_add_line))) << ir;
    EXPECT_THAT(ir, HasSubstr(loc_of(g_exp_line))) << ir;
    ir_module *m = ir_parse(ir, "locs.kir");  // the text stays valid .kir
    ASSERT_NE(m, nullptr) << kiln_last_error() << "\n" << ir;
    ir_func *fn = ir_module_find(m, "locs");
    ASSERT_NE(fn, nullptr);
    if (!strcmp(stage, "traced")) { // optimized: the two may be one fusion, whose body keeps the locs
      ASSERT_EQ(fn->n_instrs, 2);
      ASSERT_NE(fn->instrs[0].loc.file, nullptr);
      EXPECT_STREQ(fn->instrs[0].loc.file, "loc_test.cc");
      EXPECT_EQ(fn->instrs[0].loc.line, g_add_line);
    }
    ir_module_free(m);
    // a second print gives the same text (resolved once, cached)
    char *again = kiln_function_ir(f, 0, stage);
    ASSERT_NE(again, nullptr);
    EXPECT_STREQ(ir, again);
    free(again);
    free(ir);
  }
  kiln_function_free(f);
}

TEST(Loc, DumpWritesOneFilePerStage) {
  char tmpl[] = "/tmp/kiln_dump_XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  std::string dir = tmpl;
  const char *old = getenv("KILN_DUMP");
  std::string saved = old ? old : "";
  ASSERT_EQ(setenv("KILN_DUMP", dir.c_str(), 1), 0);  // read at each trace
  {
    Scoped s;
    kiln_function *f = kiln_function_new("dumped", body, nullptr, 1, 1);
    ASSERT_NE(f, nullptr);
    kiln_tensor *a = f32({1, 2}), *b = f32({1, 2, 3}), *y = nullptr;
    ASSERT_EQ(kiln_function_call(f, &a, &y), 0) << kiln_last_error();
    ASSERT_EQ(kiln_function_call(f, &a, &y), 0) << kiln_last_error();  // a hit dumps nothing new
    ASSERT_EQ(kiln_function_call(f, &b, &y), 0) << kiln_last_error();  // trace 1
    for (int t = 0; t < 2; t++) {
      char *ir = kiln_function_ir(f, t, "traced"), *opt_ir = kiln_function_ir(f, t, "optimized");
      ASSERT_NE(ir, nullptr);
      ASSERT_NE(opt_ir, nullptr);
      std::string p = dir + "/dumped." + std::to_string(t) + ".";
      // 00.traced, then one file per pass of the pipeline, then the result
      std::string traced = read_all(p + "00.traced.kir");
      EXPECT_EQ(traced, ir) << p;
      EXPECT_THAT(traced, HasSubstr(loc_of(g_exp_line)));
      EXPECT_EQ(read_all(p + "01.inline.kir").empty(), false);
      int steps = 0;
      for (const char *pass : {"inline", "simplify", "fold", "licm", "cse", "dce", "combine", "fuse", "buffers"}) {
        std::string name = p + (steps + 1 < 10 ? "0" : "") + std::to_string(steps + 1) + "." + pass + ".kir";
        if (access(name.c_str(), F_OK) != 0) break;
        unlink(name.c_str());
        steps++;
      }
      EXPECT_GE(steps, 5);
      std::string last = p + (steps + 1 < 10 ? "0" : "") + std::to_string(steps + 1) + ".optimized.kir";
      EXPECT_EQ(read_all(last), opt_ir) << last;
      // then the compiled code: LLVM IR and host assembly, as kiln_function_ir gives them
      auto numbered = [&](int step, const char *tail) {
        return p + (step < 10 ? "0" : "") + std::to_string(step) + tail;
      };
      char *llvm = kiln_function_ir(f, t, "llvm"), *assembly = kiln_function_ir(f, t, "asm");
      ASSERT_NE(llvm, nullptr) << kiln_last_error();
      ASSERT_NE(assembly, nullptr) << kiln_last_error();
      EXPECT_EQ(read_all(numbered(steps + 2, ".llvm.ll")), llvm);
      EXPECT_EQ(read_all(numbered(steps + 3, ".asm.s")), assembly);
      char *ptx = kiln_function_ir(f, t, "ptx");
      ASSERT_NE(ptx, nullptr) << kiln_last_error();
      EXPECT_EQ(read_all(numbered(steps + 4, ".ptx.ptx")), ptx);
      free(ptx);
      unlink(numbered(steps + 2, ".llvm.ll").c_str());
      unlink(numbered(steps + 3, ".asm.s").c_str());
      unlink(numbered(steps + 4, ".ptx.ptx").c_str());
      free(llvm);
      free(assembly);
      free(ir);
      free(opt_ir);
      unlink((p + "00.traced.kir").c_str());
      unlink(last.c_str());
    }
    EXPECT_EQ(std::filesystem::is_empty(dir), true) << "unexpected extra files in " << dir;

    // a directory that is missing is made, parents too (it once wrote nothing)
    std::string made = dir + "/missing/sub";
    ASSERT_EQ(setenv("KILN_DUMP", made.c_str(), 1), 0);
    kiln_tensor *c = f32({4}, {1, 2, 3, 4});
    testing::internal::CaptureStderr();
    int rc = kiln_function_call(f, &c, &y);
    std::string err = testing::internal::GetCapturedStderr();
    EXPECT_EQ(rc, 0) << kiln_last_error();
    EXPECT_EQ(err, "");
    EXPECT_EQ(read_all(made + "/dumped.2.00.traced.kir").empty(), false);
    // one that cannot be made (under a plain file, even for root): the call
    // still succeeds, one line says why
    std::string file = dir + "/plain";
    FILE *pf = fopen(file.c_str(), "w");
    ASSERT_NE(pf, nullptr);
    fclose(pf);
    std::string bad = file + "/sub";
    ASSERT_EQ(setenv("KILN_DUMP", bad.c_str(), 1), 0);
    kiln_tensor *d = f32({5}, {1, 2, 3, 4, 5});
    testing::internal::CaptureStderr();
    rc = kiln_function_call(f, &d, &y);
    err = testing::internal::GetCapturedStderr();
    EXPECT_EQ(rc, 0) << kiln_last_error();
    EXPECT_NE(y, nullptr);
    EXPECT_THAT(err, HasSubstr("KILN_DUMP: cannot create the directory " + bad + ": Not a directory"));
    EXPECT_EQ(std::count(err.begin(), err.end(), '\n'), 1) << err;
    kiln_function_free(f);
    std::error_code ec;
    std::filesystem::remove_all(dir, ec);
  }
  if (old)
    setenv("KILN_DUMP", saved.c_str(), 1);
  else
    unsetenv("KILN_DUMP");
}
