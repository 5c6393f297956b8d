// cuda_test_util.h — helpers the CUDA test files share (on top of
// ../test_util.h): the last error as a string, a CPU tensor copied to a
// device, a GPU's allocator counters, ptxas.
#ifndef KILN_CUDA_TEST_UTIL_H
#define KILN_CUDA_TEST_UTIL_H

#include <gtest/gtest.h>
#include <kiln.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <string>

#include "cuda/cuda_rt.h"

namespace kiln_test {

inline std::string error() { return kiln_last_error(); }

// The CPU tensor t on dev, released by the enclosing scope.
inline kiln_tensor *on(const char *dev, kiln_tensor *t) {
  kiln_tensor *g = kiln_to_device(t, dev);
  EXPECT_NE(g, nullptr) << error();
  return g;
}

inline cuda_mem_stats mem(int gpu) {
  cuda_mem_stats s{};
  EXPECT_EQ(kiln_debug_cuda_memory(gpu, &s), 0);
  return s;
}

// ptxas: /usr/local/cuda/bin/ptxas or on PATH ("" where there is none)
inline const std::string &ptxas_path() {
  static const std::string path = [] {
    if (access("/usr/local/cuda/bin/ptxas", X_OK) == 0) return std::string("/usr/local/cuda/bin/ptxas");
    FILE *p = popen("command -v ptxas 2>/dev/null", "r");
    char buf[4096] = {0};
    if (p) {
      if (!fgets(buf, sizeof buf, p)) buf[0] = 0;
      pclose(p);
    }
    std::string s = buf;
    while (!s.empty() && (s.back() == '\n' || s.back() == ' ')) s.pop_back();
    return s;
  }();
  return path;
}
inline bool have_ptxas() { return !ptxas_path().empty(); }

// "" when ptxas accepts ptx for arch, else its complaint
inline std::string ptxas(const std::string &ptx, const char *arch) {
  char in[] = "/tmp/kiln_cuda_ptx_XXXXXX";
  int fd = mkstemp(in);
  if (fd < 0) return "mkstemp failed";
  close(fd);
  std::string log = std::string(in) + ".log";
  std::ofstream(in) << ptx;
  std::string cmd = ptxas_path() + " -arch=" + arch + " " + in + " -o /dev/null >" + log + " 2>&1";
  int rc = system(cmd.c_str());
  std::ifstream l(log);
  std::string out((std::istreambuf_iterator<char>(l)), std::istreambuf_iterator<char>());
  unlink(in);
  unlink(log.c_str());
  if (rc == 0) return "";
  return "ptxas -arch=" + std::string(arch) + " failed (" + std::to_string(rc) + "): " + out.substr(0, 2000);
}

}  // namespace kiln_test

#endif
