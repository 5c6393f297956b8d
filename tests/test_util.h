// test_util.h — helpers shared by the GoogleTest suites in tests/*.cc:
// a leak-checking scope, owners for variables and optimizers, tensor
// constructors, and readers of a tensor's shape and elements.
//
// Header-only; everything is inline in namespace kiln_test, so a suite that
// does not use a helper compiles without an unused-function warning. A suite
// says `using namespace kiln_test;` (a helper of its own with the same name
// hides the shared one).
#pragma once

#include <gtest/gtest.h>
#include <kiln.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <cstdlib>
#include <limits>
#include <string>
#include <vector>

#include <stdio.h>
#include <unistd.h>

namespace kiln_test {

using V64 = std::vector<int64_t>;
using VD = std::vector<double>;

inline const float kNanF = std::numeric_limits<float>::quiet_NaN();
inline const double kNan = std::numeric_limits<double>::quiet_NaN();
inline const float kInfF = std::numeric_limits<float>::infinity();
inline const double kInf = std::numeric_limits<double>::infinity();

// Opens a scope for the test and checks nothing leaked when it closes.
// Declare it first, so that variables, optimizers and tapes are freed before it.
struct Scoped {
  int64_t live = kiln_debug_live_tensors();
  Scoped() {
    kiln_clear_error();
    kiln_scope_push();
  }
  ~Scoped() {
    kiln_scope_pop();
    EXPECT_EQ(kiln_debug_live_tensors(), live) << "tensors leaked";
  }
};

// Variables and optimizers freed at the end of the test.
struct Owned {
  std::vector<kiln_variable *> vars;
  std::vector<kiln_optimizer *> opts;
  kiln_variable *var(kiln_tensor *init, const char *name) {
    kiln_variable *v = kiln_variable_new(init, name);
    EXPECT_NE(v, nullptr) << kiln_last_error();
    vars.push_back(v);
    return v;
  }
  kiln_optimizer *opt(kiln_optimizer *o) {
    EXPECT_NE(o, nullptr) << kiln_last_error();
    opts.push_back(o);
    return o;
  }
  ~Owned() {
    for (kiln_optimizer *o : opts) kiln_optimizer_free(o);
    for (kiln_variable *v : vars) kiln_variable_free(v);
  }
};

// ---- making tensors ----

// A tensor of dtype dt from raw host values of type T (sizeof(T) is the
// dtype's size). NULL, as kiln_tensor_new gives it, on failure.
template <typename T>
kiln_tensor *make(kiln_dtype dt, const V64 &shape, const std::vector<T> &data) {
  return kiln_tensor_new(dt, (int)shape.size(), shape.data(), data.data());
}

// A tensor of dtype dt (F32, F64, I32 or I64) holding the values v, each
// converted to dt (exact for the values the tests use).
inline kiln_tensor *from_values(kiln_dtype dt, const V64 &shape, const VD &v) {
  std::vector<unsigned char> buf(v.size() * kiln_dtype_size(dt) + 1);
  for (size_t i = 0; i < v.size(); i++) {
    switch (dt) {
      case KILN_F32:
        ((float *)buf.data())[i] = (float)v[i];
        break;
      case KILN_F64:
        ((double *)buf.data())[i] = v[i];
        break;
      case KILN_I32:
        ((int32_t *)buf.data())[i] = (int32_t)v[i];
        break;
      case KILN_I64:
        ((int64_t *)buf.data())[i] = (int64_t)v[i];
        break;
      default:
        ADD_FAILURE() << "from_values: dtype " << kiln_dtype_name(dt);
    }
  }
  return kiln_tensor_new(dt, (int)shape.size(), shape.data(), buf.data());
}

// Typed shorthands: f64({2, 2}, {1, 2, 3, 4}); f32({1, 2}) is 1-D.
inline kiln_tensor *f32(const V64 &shape, const std::vector<float> &d) { return make(KILN_F32, shape, d); }
inline kiln_tensor *f64(const V64 &shape, const std::vector<double> &d) { return make(KILN_F64, shape, d); }
inline kiln_tensor *i32(const V64 &shape, const std::vector<int32_t> &d) { return make(KILN_I32, shape, d); }
inline kiln_tensor *i64(const V64 &shape, const std::vector<int64_t> &d) { return make(KILN_I64, shape, d); }
inline kiln_tensor *f32(const std::vector<float> &d) { return f32({(int64_t)d.size()}, d); }
inline kiln_tensor *f64(const std::vector<double> &d) { return f64({(int64_t)d.size()}, d); }

// ---- reading tensors ----

// The shape of t ({} for NULL).
inline V64 shape_of(const kiln_tensor *t) {
  if (!t) return {};
  return V64(kiln_tensor_shape(t), kiln_tensor_shape(t) + kiln_tensor_rank(t));
}

// The raw elements of t as T (sizeof(T) is the dtype's size); a failure and
// {} for NULL.
template <typename T>
std::vector<T> read(const kiln_tensor *t) {
  std::vector<T> v(t ? kiln_tensor_size(t) : 0);
  EXPECT_NE(t, nullptr) << kiln_last_error();
  if (t) {
    EXPECT_EQ(kiln_tensor_read(t, v.data(), v.size() * sizeof(T)), 0) << kiln_last_error();
  }
  return v;
}

// The raw elements of a variable's value as T.
template <typename T>
std::vector<T> read(kiln_variable *var) {
  kiln_scope_push();
  kiln_tensor *t = kiln_variable_read(var);
  std::vector<T> out(kiln_tensor_size(t));
  EXPECT_EQ(kiln_tensor_read(t, out.data(), out.size() * sizeof(T)), 0) << kiln_last_error();
  kiln_scope_pop();
  return out;
}

// Every element of t as a double, whatever its (F32, F64, I32, I64 or BOOL)
// dtype; a failure and {} for NULL.
inline VD values(const kiln_tensor *t) {
  EXPECT_NE(t, nullptr) << kiln_last_error();
  if (!t) return {};
  size_t n = (size_t)kiln_tensor_size(t);
  kiln_dtype dt = kiln_tensor_dtype(t);
  std::vector<unsigned char> buf(n * kiln_dtype_size(dt) + 1);
  EXPECT_EQ(kiln_tensor_read(t, buf.data(), n * kiln_dtype_size(dt)), 0) << kiln_last_error();
  VD v(n);
  for (size_t i = 0; i < n; i++) {
    switch (dt) {
      case KILN_F32:
        v[i] = ((float *)buf.data())[i];
        break;
      case KILN_F64:
        v[i] = ((double *)buf.data())[i];
        break;
      case KILN_I32:
        v[i] = ((int32_t *)buf.data())[i];
        break;
      case KILN_I64:
        v[i] = (double)((int64_t *)buf.data())[i];
        break;
      case KILN_BOOL:
        v[i] = ((uint8_t *)buf.data())[i];
        break;
      default:
        ADD_FAILURE() << "values: dtype " << kiln_dtype_name(dt);
        return v;
    }
  }
  return v;
}

// Same dtype, shape and bytes: staged and eager results must agree exactly.
inline bool same_bits(const kiln_tensor *a, const kiln_tensor *b) {
  if (!a || !b || kiln_tensor_dtype(a) != kiln_tensor_dtype(b) || shape_of(a) != shape_of(b)) return false;
  size_t bytes = (size_t)kiln_tensor_size(a) * kiln_dtype_size(kiln_tensor_dtype(a));
  return std::memcmp(kiln_tensor_data(a), kiln_tensor_data(b), bytes) == 0;
}

// Same dtype and shape, and every float element within max_ulps of the
// other (NaN where the other is NaN, infinities equal); other dtypes must
// match exactly. Compiled code may round differently from the eager kernels
// (FMA contraction, its own vector math, other summation orders).
inline bool within_ulps(const kiln_tensor *a, const kiln_tensor *b, int64_t max_ulps) {
  if (!a || !b || kiln_tensor_dtype(a) != kiln_tensor_dtype(b) || shape_of(a) != shape_of(b)) return false;
  kiln_dtype dt = kiln_tensor_dtype(a);
  if (dt != KILN_F32 && dt != KILN_F64) return same_bits(a, b);
  int64_t n = kiln_tensor_size(a);
  for (int64_t i = 0; i < n; i++) {
    double x, y;
    int64_t ix, iy;
    if (dt == KILN_F32) {
      float fx = ((const float *)kiln_tensor_data(a))[i], fy = ((const float *)kiln_tensor_data(b))[i];
      int32_t bx, by;
      std::memcpy(&bx, &fx, 4);
      std::memcpy(&by, &fy, 4);
      x = fx, y = fy;
      ix = bx < 0 ? INT32_MIN - (int64_t)bx : bx; // monotonic integer order
      iy = by < 0 ? INT32_MIN - (int64_t)by : by;
    } else {
      x = ((const double *)kiln_tensor_data(a))[i], y = ((const double *)kiln_tensor_data(b))[i];
      std::memcpy(&ix, &x, 8);
      std::memcpy(&iy, &y, 8);
      ix = ix < 0 ? INT64_MIN - ix : ix;
      iy = iy < 0 ? INT64_MIN - iy : iy;
    }
    if (x != x || y != y) {
      if ((x != x) != (y != y)) return false;
      continue;
    }
    if (x == y) continue;
    if ((ix > iy ? ix - iy : iy - ix) > max_ulps) return false;
  }
  return true;
}

// The random-program tests' corpus: KILN_RANDOM_PROGRAMS=N programs
// (fallback when unset), from seed KILN_RANDOM_SEED=S (default 1), so that
// `KILN_RANDOM_SEED=S KILN_RANDOM_PROGRAMS=1` replays one failure.
inline int program_count(int fallback = 500) {
  const char *s = std::getenv("KILN_RANDOM_PROGRAMS");
  long n = s ? std::strtol(s, nullptr, 10) : 0;
  return n > 0 ? (int)n : fallback;
}

inline uint64_t first_seed() {
  const char *s = std::getenv("KILN_RANDOM_SEED");
  return s && *s ? std::strtoull(s, nullptr, 10) : 1;
}

// NumPy's allclose: same dtype and shape, |a - b| <= atol + rtol * |b|
// elementwise (NaN matching NaN). For composed float expressions, where
// last-bit differences of compiled code grow through cancellation.
inline bool allclose(const kiln_tensor *a, const kiln_tensor *b, double rtol = 1e-5, double atol = 1e-6) {
  if (!a || !b || kiln_tensor_dtype(a) != kiln_tensor_dtype(b) || shape_of(a) != shape_of(b)) return false;
  VD x = values(a), y = values(b);
  for (size_t i = 0; i < x.size(); i++) {
    if (x[i] != x[i] || y[i] != y[i]) {
      if ((x[i] != x[i]) != (y[i] != y[i])) return false;
      continue;
    }
    if (x[i] == y[i]) continue;
    if (!(std::fabs(x[i] - y[i]) <= atol + rtol * std::fabs(y[i]))) return false;
  }
  return true;
}

// Sets an environment variable for one test and restores it after.
struct EnvGuard {
  std::string name, saved;
  bool had;
  EnvGuard(const char *n, const char *value) : name(n) {
    const char *old = getenv(n);
    had = old != nullptr;
    if (old) saved = old;
    if (value)
      setenv(n, value, 1);
    else
      unsetenv(n);
  }
  ~EnvGuard() {
    if (had)
      setenv(name.c_str(), saved.c_str(), 1);
    else
      unsetenv(name.c_str());
  }
};

// The directory (ending in '/') of the source file whose __FILE__ is file:
// absolute, or relative to the build directory where the test binary lives
// (when ccache rewrites __FILE__), resolved through /proc/self/exe.
inline std::string source_dir(const char *file) {
  std::string f = file;
  std::string dir = f.substr(0, f.rfind('/') + 1);
  if (!dir.empty() && dir[0] != '/') {
    char exe[4096];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (n > 0) {
      exe[n] = 0;
      std::string e = exe;
      dir = e.substr(0, e.rfind('/') + 1) + dir;
    }
  }
  return dir;
}

// Runs this test binary again in a child process with env ("NAME=value
// ...") set and no test selected (--gtest_filter=-*): a child role that
// reads a variable from env runs from a static initializer and exits.
// Its output (stdout and stderr) and exit status (*rc, -1 when it could
// not start).
inline std::string run_self(const std::string &env, int *rc) {
  // popen runs sh, whose /proc/self/exe is sh: name this program itself
  char exe[4096];
  ssize_t len = readlink("/proc/self/exe", exe, sizeof exe - 1);
  *rc = -1;
  if (len <= 0) return "readlink failed";
  exe[len] = 0;
  std::string cmd = env + " " + exe + " --gtest_filter=-* 2>&1";
  FILE *p = popen(cmd.c_str(), "r");
  if (!p) return "popen failed";
  std::string out;
  char buf[512];
  while (fgets(buf, sizeof buf, p)) out += buf;
  *rc = pclose(p);
  return out;
}

}  // namespace kiln_test
