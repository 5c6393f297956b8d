// io_util.h — helpers shared by the file-format tests of API.md §13
// (npy_test.cc, summary_test.cc; the temporary directory also for
// checkpoint_test.cc, saved_test.cc and aot_test.cc): a temporary directory, whole-file reads
// and writes, and running a Python checker beside this source.
#ifndef KILN_TESTS_IO_UTIL_H
#define KILN_TESTS_IO_UTIL_H

#include <gtest/gtest.h>
#include <stdlib.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

namespace kiln_io_test {

// A fresh directory, removed with everything in it at the end.
struct IoTempDir {
  std::string path;
  explicit IoTempDir(const char *tag = "kiln_io") {
    std::string tmpl = ::testing::TempDir() + tag + "_XXXXXX";
    std::vector<char> buf(tmpl.begin(), tmpl.end());
    buf.push_back('\0');
    EXPECT_NE(mkdtemp(buf.data()), nullptr);
    path = buf.data();
  }
  ~IoTempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
  std::string file(const std::string &name) const { return path + "/" + name; }
  std::vector<std::string> entries() const { return entries_of(path); }
  // the names in directory dir, sorted
  static std::vector<std::string> entries_of(const std::string &dir) {
    std::vector<std::string> out;
    std::error_code ec;
    for (auto &e : std::filesystem::directory_iterator(dir, ec)) out.push_back(e.path().filename().string());
    std::sort(out.begin(), out.end());
    return out;
  }
};

inline void put_file(const std::string &path, const std::string &bytes) {
  std::remove(path.c_str());
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), (std::streamsize)bytes.size());
}

inline std::string get_file(const std::string &path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// Runs cmd (through sh), its stdout and stderr into *out; the exit status.
inline int run_command(const std::string &cmd, std::string *out) {
  FILE *p = popen((cmd + " 2>&1").c_str(), "r");
  if (!p) return -1;
  char buf[512];
  out->clear();
  while (fgets(buf, sizeof buf, p)) *out += buf;
  return pclose(p);
}

}  // namespace kiln_io_test

#endif
