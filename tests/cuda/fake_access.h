// fake_access.h — what the CUDA runtime tests read from and inject into
// the fake driver (tests/fake_cuda), through dlsym on the handle Kiln
// opened: call counts, contexts, modules, the recorded launches, failing
// or scripted launches. For the cuda_runtime_test executable (which
// defines FAKE_CUDA_PATH and points the runtime at the fake).
#ifndef KILN_FAKE_ACCESS_H
#define KILN_FAKE_ACCESS_H

#include <dlfcn.h>
#include <gtest/gtest.h>
#include <kiln.h>

#include <vector>

#include "fake_cuda.h"

namespace kiln_test {

inline void *fake(const char *name) {
  kiln_device_count();  // loads the driver (the fake, through KILN_CUDA_DRIVER) if nothing has yet
  static void *h = dlopen(FAKE_CUDA_PATH, RTLD_NOW | RTLD_NOLOAD);
  void *f = h ? dlsym(h, name) : nullptr;
  EXPECT_NE(f, nullptr) << "the fake driver has no " << name;
  return f;
}

inline long calls(const char *name) { return ((long (*)(const char *))fake("fake_cuda_calls"))(name); }
inline int ctx_depth() { return ((int (*)())fake("fake_cuda_ctx_depth"))(); }
inline int modules_live() { return ((int (*)())fake("fake_cuda_modules_live"))(); }
inline void clear_launches() { ((void (*)())fake("fake_cuda_launch_clear"))(); }
inline void fail_launch(const char *name, int code) {
  ((void (*)(const char *, int))fake("fake_cuda_fail_launch"))(name, code);
}
inline void launch_write(const char *name, int v) {
  ((void (*)(const char *, int))fake("fake_cuda_launch_write"))(name, v);
}
// launches of kernel name write the values v (width 1 or 4 bytes) into their pointer parameter param, one per launch
inline void script(const char *name, int param, int width, std::vector<int> v) {
  ((void (*)(const char *, int, int, const int *, int))fake("fake_cuda_launch_script"))(name, param, width, v.data(),
                                                                                       (int)v.size());
}
inline void no_scripts() {
  ((void (*)(const char *, int, int, const int *, int))fake("fake_cuda_launch_script"))(nullptr, 0, 0, nullptr, 0);
}

// the launches recorded since the last clear_launches, in order
inline std::vector<fake_launch> launches() {
  int n = ((int (*)())fake("fake_cuda_launch_count"))();
  auto get = (int (*)(int, fake_launch *))fake("fake_cuda_launch_get");
  std::vector<fake_launch> v((size_t)n);
  for (int i = 0; i < n; i++) EXPECT_EQ(get(i, &v[(size_t)i]), 0);
  return v;
}

}  // namespace kiln_test

#endif
