// cuda_test_util.h — helpers the CUDA test files share (on top of
// ../test_util.h): the last error as a string, a CPU tensor copied to a
// device, a GPU's allocator counters; ptxas from ../ptxas_util.h.
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

#include "../ptxas_util.h"
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

}  // namespace kiln_test

#endif
