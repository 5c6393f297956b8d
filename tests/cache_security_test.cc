// cache_security_test.cc — the disk cache of compiled code as something a
// process executes (backends/cpu/cache.c; the PTX cache goes through it):
// a directory of another user's or that others may write is refused, once,
// with a line naming it; KILN_CACHE_MAX_MB is parsed without overflow (inf,
// 1e13 and friends once emptied the cache); stores trim in amortized O(1)
// and still keep the directory under the bound.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "cpu/cpu.h"
#include "test_util.h"

namespace {

using namespace kiln_test;
using ::testing::HasSubstr;
namespace fs = std::filesystem;

struct TempDir {
  std::string path;
  TempDir() {
    char tmpl[] = "/tmp/kiln-cache-sec-XXXXXX";
    EXPECT_NE(mkdtemp(tmpl), nullptr);
    path = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
  // bytes and count of the entries (*.kco) in it
  int64_t bytes(int *count = nullptr) const {
    int64_t total = 0;
    int n = 0;
    for (const auto &e : fs::directory_iterator(path))
      if (e.path().extension() == ".kco") total += (int64_t)e.file_size(), n++;
    if (count) *count = n;
    return total;
  }
};

// stderr while f runs
template <class F>
std::string stderr_of(F f) {
  testing::internal::CaptureStderr();
  f();
  return testing::internal::GetCapturedStderr();
}

int64_t lines(const std::string &s) { return std::count(s.begin(), s.end(), '\n'); }

// an entry of about `bytes` bytes under key number k
int store(const std::string &dir, uint64_t k, size_t bytes) {
  uint8_t key[16] = {0};
  memcpy(key, &k, 8);
  key[15] = 0x5a;
  std::vector<char> obj(bytes, 'o'), bc(16, 'b');
  cpu_cache_entry e{};
  e.obj = obj.data(), e.obj_len = obj.size(), e.bc = bc.data(), e.bc_len = bc.size();
  return cpu_cache_store(dir.c_str(), key, "cache_security_test", &e);
}

// ---- KILN_CACHE_MAX_MB ----

TEST(CacheLimit, ParsedWithoutOverflow) {
  const int64_t def = (int64_t)1024 << 20, most = (int64_t)1 << 60;
  struct Case {
    const char *value;
    int64_t bytes;
    const char *said;  // the log line's reason, or nullptr: no line
  } cases[] = {
      {nullptr, def, nullptr},
      {"512", (int64_t)512 << 20, nullptr},
      {"0.25", (int64_t)256 << 10, nullptr},
      {" 64 ", (int64_t)64 << 20, nullptr},
      {"inf", most, "is more than 2^40 MB"},
      {"-inf", def, "is not a positive number"},
      {"1e13", most, "is more than 2^40 MB"},
      {"1e400", most, "is more than 2^40 MB"},
      {"99999999999999999999999999", most, "is more than 2^40 MB"},
      {"-5", def, "is not a positive number"},
      {"0", def, "is not a positive number"},
      {"nan", def, "is not a positive number"},
      {"lots", def, "is not a positive number"},
      {"12abc", def, "is not a positive number"},
      {"   ", def, "is not a positive number"},
  };
  for (const Case &c : cases) {
    EnvGuard g("KILN_CACHE_MAX_MB", c.value);
    int64_t got = 0;
    std::string err = stderr_of([&] { got = cpu_cache_limit_bytes(); });
    std::string what = c.value ? c.value : "(unset)";
    EXPECT_EQ(got, c.bytes) << what;
    if (c.said) {
      EXPECT_THAT(err, HasSubstr("KILN_CACHE_MAX_MB=\"" + std::string(c.value) + "\" " + c.said)) << what;
      EXPECT_EQ(lines(err), 1) << what << ": " << err;
      // said once per process, however often it is read
      EXPECT_EQ(stderr_of([&] { got = cpu_cache_limit_bytes(); }), "") << what;
      EXPECT_EQ(got, c.bytes) << what;
    } else {
      EXPECT_EQ(err, "") << what;
    }
  }
}

// inf and 1e13 once wrapped to a negative bound: the next store deleted
// every entry. Now they mean "no bound" and the entries stay.
TEST(CacheLimit, HugeOrBadBoundsKeepTheEntries) {
  TempDir dir;
  for (uint64_t k = 0; k < 20; k++) ASSERT_EQ(store(dir.path, k, 1000), 0);
  int n = 0;
  for (const char *v : {"INF", "1E13", "-1", "1e308", "junk", "18446744073709551616"}) {
    EnvGuard g("KILN_CACHE_MAX_MB", v);
    stderr_of([&] { EXPECT_EQ(store(dir.path, 100 + (uint64_t)n, 1000), 0) << v; });
    n++;
    int count = 0;
    dir.bytes(&count);
    EXPECT_EQ(count, 20 + n) << v << ": entries were deleted";
  }
}

// ---- the directory ----

TEST(CacheDir, AnotherUsersOrAnOpenDirectoryIsRefusedOnce) {
  TempDir dir;
  char buf[4096];
  std::string theirs;
  if (geteuid() == 0) {
    theirs = dir.path + "/theirs";
    ASSERT_EQ(mkdir(theirs.c_str(), 0700), 0);
    ASSERT_EQ(chown(theirs.c_str(), 65534, 65534), 0);
  } else {
    theirs = "/";  // root's
  }
  struct Case {
    std::string path;
    mode_t mode;  // 0: leave it
    const char *why;
  } cases[] = {
      {theirs, 0, "owned by uid "},
      {dir.path + "/group", 0770, "writable by its group (mode 770)"},
      {dir.path + "/others", 0703, "writable by others (mode 703)"},
      {dir.path + "/sticky", 01777, "writable by others (mode 777)"},
      {dir.path + "/file", 0, "not a directory"},
  };
  std::FILE *f = std::fopen((dir.path + "/file").c_str(), "w");
  ASSERT_NE(f, nullptr);
  std::fclose(f);
  for (const Case &c : cases) {
    if (c.mode) {
      ASSERT_EQ(mkdir(c.path.c_str(), 0700), 0);
      ASSERT_EQ(chmod(c.path.c_str(), c.mode), 0);
    }
    EnvGuard g("KILN_CACHE_DIR", c.path.c_str());
    bool on = true;
    std::string err = stderr_of([&] { on = cpu_cache_dir(buf, sizeof buf); });
    EXPECT_FALSE(on) << c.path;
    EXPECT_THAT(err, HasSubstr("kiln: cache: " + c.path + ": " + c.why)) << err;
    EXPECT_THAT(err, HasSubstr("not caching"));
    EXPECT_EQ(lines(err), 1) << err;
    EXPECT_EQ(stderr_of([&] { on = cpu_cache_dir(buf, sizeof buf); }), "") << "said once: " << c.path;
    EXPECT_FALSE(on) << c.path;
  }
  // this user's, 0700 or 0755, is a cache; a missing one is made 0700
  for (mode_t mode : {0700, 0755}) {
    std::string mine = dir.path + "/mine" + std::to_string(mode);
    ASSERT_EQ(mkdir(mine.c_str(), mode), 0);
    EnvGuard g("KILN_CACHE_DIR", mine.c_str());
    EXPECT_EQ(stderr_of([&] { EXPECT_TRUE(cpu_cache_dir(buf, sizeof buf)); }), "");
    EXPECT_EQ(std::string(buf), mine);
  }
  std::string fresh = dir.path + "/x/y";
  EnvGuard g("KILN_CACHE_DIR", fresh.c_str());
  EXPECT_TRUE(cpu_cache_dir(buf, sizeof buf));
  struct stat st;
  ASSERT_EQ(stat(fresh.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 0700u);
}

// ---- trimming ----

// Stores trim without scanning the directory each time, and the directory
// still stays under the bound (a single writer: after every store).
TEST(CacheTrim, StoresKeepTheDirectoryUnderTheBound) {
  TempDir dir;
  EnvGuard g("KILN_CACHE_MAX_MB", "0.25");  // 262144 bytes: ~120 entries of 2 KB
  const int64_t limit = (int64_t)256 << 10;
  int64_t most = 0;
  for (uint64_t k = 0; k < 1500; k++) {
    ASSERT_EQ(store(dir.path, k, 2000), 0);
    if (k % 7 == 0) {
      int64_t b = dir.bytes();
      most = std::max(most, b);
      ASSERT_LE(b, limit) << "after store " << k;
    }
  }
  int count = 0;
  int64_t b = dir.bytes(&count);
  EXPECT_LE(b, limit);
  EXPECT_GT(b, limit / 2) << "trimmed far below the bound";
  EXPECT_GT(most, limit * 8 / 10);
  // the newest entry stays, the oldest went
  uint8_t key[16] = {0};
  uint64_t last = 1499, first = 0;
  cpu_cache_entry e;
  memcpy(key, &last, 8), key[15] = 0x5a;
  EXPECT_EQ(cpu_cache_load(dir.path.c_str(), key, "cache_security_test", &e), 1);
  cpu_cache_entry_free(&e);
  memcpy(key, &first, 8);
  EXPECT_EQ(cpu_cache_load(dir.path.c_str(), key, "cache_security_test", &e), 0);
}

// Figures, not a timed assertion: a store into a directory of thousands of
// entries, against a store that also scans it (as every store did before).
TEST(CacheTrim, StoreTimeWithThousandsOfEntries) {
  TempDir dir;
  EnvGuard g("KILN_CACHE_MAX_MB", nullptr);
  const int n = 4000, timed = 400;
  using clock = std::chrono::steady_clock;
  for (uint64_t k = 0; k < (uint64_t)n; k++) ASSERT_EQ(store(dir.path, k, 4000), 0);
  auto t0 = clock::now();
  for (uint64_t k = 0; k < (uint64_t)timed; k++) ASSERT_EQ(store(dir.path, n + k, 4000), 0);
  auto t1 = clock::now();
  for (uint64_t k = 0; k < (uint64_t)timed; k++) {
    ASSERT_EQ(store(dir.path, n + timed + k, 4000), 0);
    cpu_cache_trim(dir.path.c_str(), cpu_cache_limit_bytes());  // the scan each store made before
  }
  auto t2 = clock::now();
  double now_us = std::chrono::duration<double, std::micro>(t1 - t0).count() / timed;
  double scan_us = std::chrono::duration<double, std::micro>(t2 - t1).count() / timed;
  std::printf("[ figures  ] store into %d entries: %.1f us amortized; with a scan per store (before): %.1f us\n", n,
              now_us, scan_us);
  int count = 0;
  dir.bytes(&count);
  EXPECT_EQ(count, n + 2 * timed);
}

}  // namespace
