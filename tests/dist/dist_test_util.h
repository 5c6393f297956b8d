// dist_test_util.h — what the distribution tests (kiln_dist_tests: the
// eager, staged, overlap and random-program suites) share: this process's
// rank and world size, and one collective as a staged body calls it.
#ifndef KILN_TESTS_DIST_TEST_UTIL_H
#define KILN_TESTS_DIST_TEST_UTIL_H

#include <kiln.h>

#include <string>

namespace kiln_test {

inline int rank_() { return kiln_dist_rank(); }
inline int size_() { return kiln_dist_size(); }

// One collective, as a staged body calls it.
struct Coll {
  const char *kind; // "all_reduce", "all_gather", "reduce_scatter", "broadcast_from"
  const char *op;   // reduction, or nullptr
  int arg;          // axis or root
  kiln_tensor *run(kiln_tensor *x) const {
    std::string k = kind;
    if (k == "all_reduce") return kiln_all_reduce(x, op);
    if (k == "all_gather") return kiln_all_gather(x, arg);
    if (k == "reduce_scatter") return kiln_reduce_scatter(x, arg, op);
    return kiln_broadcast_from(x, arg);
  }
  std::string name() const { return std::string(kind) + (op ? std::string(" ") + op : "") + " " + std::to_string(arg); }
};

} // namespace kiln_test

#endif
