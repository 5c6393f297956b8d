// ptxas_util.h — ptxas for the tests that check generated PTX without a
// GPU (ptx_test.cc, the CUDA tests): where it is, and whether it accepts a
// module. Header-only, no CUDA needed.
#ifndef KILN_PTXAS_UTIL_H
#define KILN_PTXAS_UTIL_H

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>

namespace kiln_test {

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
    while (!s.empty() && (s.back() == '\n' || s.back() == '\r' || s.back() == ' ')) s.pop_back();
    return s;
  }();
  return path;
}

inline bool have_ptxas() { return !ptxas_path().empty(); }

// Time spent in ptxas and the number of runs (the PTX corpus test reports them).
inline double ptxas_seconds = 0;
inline int ptxas_runs = 0;

// "" when ptxas accepts ptx for arch, else its complaint
inline std::string ptxas(const std::string &ptx, const char *arch) {
  char in[] = "/tmp/kiln_ptx_XXXXXX";
  int fd = mkstemp(in);
  if (fd < 0) return "cannot make a temporary file";
  bool ok = write(fd, ptx.data(), ptx.size()) == (ssize_t)ptx.size();
  close(fd);
  std::string log = std::string(in) + ".log";
  std::string cmd = ptxas_path() + " -arch=" + arch + " " + in + " -o /dev/null >" + log + " 2>&1";
  auto t0 = std::chrono::steady_clock::now();
  int rc = ok ? std::system(cmd.c_str()) : -1;
  ptxas_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ptxas_runs++;
  std::string out;
  if (FILE *f = std::fopen(log.c_str(), "r")) {
    char buf[4096];
    size_t n;
    while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) out.append(buf, n);
    std::fclose(f);
  }
  std::remove(in);
  std::remove(log.c_str());
  if (rc == 0) return "";
  return "ptxas -arch=" + std::string(arch) + " failed (" + std::to_string(rc) + "): " + out.substr(0, 2000);
}

}  // namespace kiln_test

#endif
