// ir_test_util.h — helpers for tests that parse IR text and run it: a
// parsed module freed at the end, the interpreter's results, and counting
// and finding instructions by op. Inline in namespace kiln_test.
#pragma once

#include <gtest/gtest.h>
#include <kiln.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "ir.h"

namespace kiln_test {

// A parsed module (freed at the end).
struct Mod {
  ir_module *m = nullptr;
  explicit Mod(const std::string &text, const char *file = "t.kir") {
    m = ir_parse(text.c_str(), file);
    EXPECT_NE(m, nullptr) << kiln_last_error();
  }
  ~Mod() { ir_module_free(m); }
  Mod(const Mod &) = delete;
  Mod &operator=(const Mod &) = delete;
  ir_func *f(const char *name) const { return ir_module_find(m, name); }
  std::string text() const {
    char *s = ir_print_module(m);
    std::string r = s ? s : "";
    free(s);
    return r;
  }
  std::string func_text(const char *name) const {
    char *s = ir_print_func(f(name));
    std::string r = s ? s : "";
    free(s);
    return r;
  }
};

// The results of f on args through the interpreter (owned by the test's scope).
inline std::vector<kiln_tensor *> run(const ir_func *f, std::vector<kiln_tensor *> args) {
  std::vector<kiln_tensor *> out((size_t)f->n_results + 1, nullptr);
  EXPECT_EQ(ir_interpret(f, args.data(), out.data()), 0) << kiln_last_error();
  out.pop_back();
  return out;
}

// How many instructions of op f holds (not counting its regions').
inline int count(const ir_func *f, op_id op) {
  int n = 0;
  for (int i = 0; i < f->n_instrs; i++) n += f->instrs[i].op == op;
  return n;
}

// The first instruction of op in f.
inline const ir_instr *first(const ir_func *f, op_id op) {
  for (int i = 0; i < f->n_instrs; i++)
    if (f->instrs[i].op == op) return &f->instrs[i];
  return nullptr;
}

}  // namespace kiln_test
