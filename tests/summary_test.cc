// summary_test.cc — TensorBoard event files: the file's name and first
// record, scalars and histograms decoded here by a reader of our own
// (TFRecord framing with a table-driven CRC-32C, a generic protobuf field
// walker), histograms against TensorFlow's bucket rule, many threads on
// one writer, bad arguments and unwritable log dirs; and the same files
// parsed by protobuf from the public .proto definitions
// (tests/summary_check.py) where protoc and python3-protobuf are present.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <kiln.h>

#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <cfloat>
#include <cmath>
#include <cstring>
#include <map>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "io_util.h"
#include "test_util.h"

using ::testing::HasSubstr;
using ::testing::StartsWith;

namespace {

using namespace kiln_test;
using namespace kiln_io_test;

// ---- an independent reader ----

uint32_t crc32c_table_driven(const std::string &s) {
  static uint32_t table[256];
  static bool made = false;
  if (!made) {
    for (uint32_t i = 0; i < 256; i++) {
      uint32_t c = i;
      for (int k = 0; k < 8; k++) c = c & 1 ? (c >> 1) ^ 0x82f63b78u : c >> 1;
      table[i] = c;
    }
    made = true;
  }
  uint32_t c = 0xffffffffu;
  for (unsigned char b : s) c = table[(c ^ b) & 0xff] ^ (c >> 8);
  return c ^ 0xffffffffu;
}

uint32_t masked(const std::string &s) {
  uint32_t c = crc32c_table_driven(s);
  return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

uint64_t le(const std::string &s, size_t off, int n) {
  uint64_t v = 0;
  for (int k = 0; k < n; k++) v |= (uint64_t)(unsigned char)s[off + (size_t)k] << (8 * k);
  return v;
}

// The records of an event file; a test failure for a bad CRC or a cut.
std::vector<std::string> read_records(const std::string &path) {
  std::string d = get_file(path);
  std::vector<std::string> out;
  size_t off = 0;
  while (off < d.size()) {
    if (off + 12 > d.size()) {
      ADD_FAILURE() << "truncated record header at " << off;
      break;
    }
    uint64_t n = le(d, off, 8);
    EXPECT_EQ(le(d, off + 8, 4), masked(d.substr(off, 8))) << "length CRC at " << off;
    if (off + 16 + n > d.size()) {
      ADD_FAILURE() << "truncated record at " << off;
      break;
    }
    std::string body = d.substr(off + 12, n);
    EXPECT_EQ(le(d, off + 12 + n, 4), masked(body)) << "data CRC at " << off;
    out.push_back(body);
    off += 16 + n;
  }
  return out;
}

// A protobuf message as field number -> values, each the raw field: a
// varint, the 8 or 4 bytes of a fixed field, a length-delimited payload.
struct Field {
  int wire = 0;
  uint64_t varint = 0;
  std::string bytes;
};
using Message = std::multimap<int, Field>;

bool read_varint(const std::string &s, size_t *off, uint64_t *v) {
  *v = 0;
  for (int shift = 0; shift < 70; shift += 7) {
    if (*off >= s.size()) return false;
    unsigned char b = (unsigned char)s[(*off)++];
    *v |= (uint64_t)(b & 0x7f) << shift;
    if (!(b & 0x80)) return true;
  }
  return false;
}

Message parse(const std::string &s) {
  Message m;
  size_t off = 0;
  while (off < s.size()) {
    uint64_t key;
    if (!read_varint(s, &off, &key)) {
      ADD_FAILURE() << "bad key";
      return m;
    }
    Field f;
    f.wire = (int)(key & 7);
    size_t n = f.wire == 1 ? 8 : f.wire == 5 ? 4 : 0;
    if (f.wire == 0) {
      EXPECT_TRUE(read_varint(s, &off, &f.varint));
    } else if (f.wire == 2) {
      uint64_t len;
      EXPECT_TRUE(read_varint(s, &off, &len));
      n = (size_t)len;
    } else if (!n) {
      ADD_FAILURE() << "wire type " << f.wire;
      return m;
    }
    if (f.wire != 0) {
      if (off + n > s.size()) {
        ADD_FAILURE() << "field runs past the message";
        return m;
      }
      f.bytes = s.substr(off, n);
      off += n;
    }
    m.emplace((int)(key >> 3), f);
  }
  return m;
}

const Field *one(const Message &m, int field) {
  EXPECT_LE(m.count(field), 1u) << "field " << field;
  auto it = m.find(field);
  return it == m.end() ? nullptr : &it->second;
}

double f64_of(const Message &m, int field) {  // absent: proto3's 0
  const Field *f = one(m, field);
  if (!f) return 0;
  EXPECT_EQ(f->wire, 1);
  double d;
  uint64_t u = le(f->bytes, 0, 8);
  memcpy(&d, &u, 8);
  return d;
}

std::vector<double> packed(const Message &m, int field) {
  const Field *f = one(m, field);
  std::vector<double> v;
  if (!f) return v;
  EXPECT_EQ(f->wire, 2);
  for (size_t i = 0; i + 8 <= f->bytes.size(); i += 8) {
    uint64_t u = le(f->bytes, i, 8);
    double d;
    memcpy(&d, &u, 8);
    v.push_back(d);
  }
  return v;
}

// An event: step, and its one summary value's Message (tag = field 1).
struct Event {
  double wall_time;
  int64_t step;
  std::string tag;
  Message value;
};

Event decode_event(const std::string &rec) {
  Message ev = parse(rec);
  Event e{f64_of(ev, 1), 0, "", {}};
  if (const Field *s = one(ev, 2)) e.step = (int64_t)s->varint;
  const Field *summary = one(ev, 5);
  EXPECT_NE(summary, nullptr) << "no summary";
  if (!summary) return e;
  Message sm = parse(summary->bytes);
  EXPECT_EQ(sm.count(1), 1u) << "one value per event";
  const Field *v = one(sm, 1);
  if (!v) return e;
  e.value = parse(v->bytes);
  const Field *tag = one(e.value, 1);
  if (tag) e.tag = tag->bytes;
  return e;
}

float simple_value(const Event &e) {
  const Field *f = one(e.value, 2);
  EXPECT_NE(f, nullptr);
  if (!f) return NAN;
  EXPECT_EQ(f->wire, 5);
  uint32_t u = (uint32_t)le(f->bytes, 0, 4);
  float x;
  memcpy(&x, &u, 4);
  return x;
}

std::string event_file(const IoTempDir &d) {
  auto e = d.entries();
  EXPECT_EQ(e.size(), 1u);
  return e.empty() ? "" : d.file(e[0]);
}

double now() {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

// ---- tests ----

TEST(Summary, Crc32cKnownAnswer) {
  EXPECT_EQ(crc32c_table_driven("123456789"), 0xe3069283u);  // the check value of CRC-32C
  EXPECT_EQ(crc32c_table_driven(""), 0u);
}

TEST(Summary, FileNameAndFirstRecord) {
  IoTempDir d;
  std::string logdir = d.file("runs/exp1");  // created with its parent
  double t0 = now();
  kiln_summary_writer *w = kiln_summary_writer_new(logdir.c_str());
  ASSERT_NE(w, nullptr) << kiln_last_error();
  kiln_summary_writer_free(w);
  double t1 = now();
  auto names = IoTempDir::entries_of(logdir);
  ASSERT_EQ(names.size(), 1u);
  char host[256] = "";
  gethostname(host, sizeof host);
  // events.out.tfevents.<10 digits>.<host>
  const std::string prefix = "events.out.tfevents.";
  ASSERT_EQ(names[0].compare(0, prefix.size(), prefix), 0) << names[0];
  std::string secs_str = names[0].substr(prefix.size(), 10);
  ASSERT_EQ(secs_str.find_first_not_of("0123456789"), std::string::npos) << names[0];
  ASSERT_EQ(secs_str.size(), 10u) << names[0];
  EXPECT_EQ(names[0].substr(prefix.size() + 10), std::string(".") + host);
  long long secs = std::stoll(secs_str);
  EXPECT_GE(secs, (long long)t0);
  EXPECT_LE(secs, (long long)t1);
  auto recs = read_records(logdir + "/" + names[0]);
  ASSERT_EQ(recs.size(), 1u);
  Message ev = parse(recs[0]);
  double wt = f64_of(ev, 1);
  EXPECT_GE(wt, t0 - 1e-3);
  EXPECT_LE(wt, t1 + 1e-3);
  const Field *v = one(ev, 3);
  ASSERT_NE(v, nullptr);
  EXPECT_EQ(v->bytes, "brain.Event:2");
  EXPECT_EQ(ev.size(), 2u) << "wall_time and file_version only";
  // a second writer in the same second gets a name of its own
  kiln_summary_writer *a = kiln_summary_writer_new(logdir.c_str());
  kiln_summary_writer *b = kiln_summary_writer_new(logdir.c_str());
  ASSERT_NE(a, nullptr) << kiln_last_error();
  ASSERT_NE(b, nullptr) << kiln_last_error();
  kiln_summary_writer_free(a);
  kiln_summary_writer_free(b);
  EXPECT_EQ(IoTempDir::entries_of(logdir).size(), 3u);
}

TEST(Summary, ScalarsDecode) {
  IoTempDir d;
  kiln_summary_writer *w = kiln_summary_writer_new(d.path.c_str());
  ASSERT_NE(w, nullptr) << kiln_last_error();
  const std::vector<std::pair<std::string, double>> tv = {
      {"loss", 2.5}, {"train/accuracy", 0.125}, {"zero", 0.0}, {"neg", -1e30}, {"損失", 3.0}, {"huge", 1e300}};
  const int64_t steps[] = {0, 1, 7, -5, INT64_MAX, 1LL << 40};
  for (size_t i = 0; i < tv.size(); i++)
    ASSERT_EQ(kiln_summary_scalar(w, tv[i].first.c_str(), tv[i].second, steps[i]), 0) << kiln_last_error();
  ASSERT_EQ(kiln_summary_flush(w), 0);
  auto recs = read_records(event_file(d));  // visible after a flush, before the free
  EXPECT_EQ(recs.size(), tv.size() + 1);
  kiln_summary_writer_free(w);
  recs = read_records(event_file(d));
  ASSERT_EQ(recs.size(), tv.size() + 1);
  for (size_t i = 0; i < tv.size(); i++) {
    Event e = decode_event(recs[i + 1]);
    EXPECT_EQ(e.tag, tv[i].first);
    EXPECT_EQ(e.step, steps[i]);
    EXPECT_EQ(simple_value(e), (float)(std::fabs(tv[i].second) > FLT_MAX ? INFINITY : tv[i].second)) << e.tag;
  }
}

TEST(Summary, HistogramsFollowTensorFlowsBuckets) {
  Scoped s;
  IoTempDir d;
  kiln_summary_writer *w = kiln_summary_writer_new(d.path.c_str());
  ASSERT_NE(w, nullptr) << kiln_last_error();
  std::mt19937 rng(1);
  std::normal_distribution<double> normal(0.0, 3.0);
  std::vector<double> xs(1000);
  for (double &x : xs) x = normal(rng);
  xs[0] = 0.0, xs[1] = -0.0, xs[2] = 1e-13, xs[3] = DBL_MAX, xs[4] = -DBL_MAX, xs[5] = 1e25;
  ASSERT_EQ(kiln_summary_histogram(w, "weights", f64({10, 100}, xs), 3), 0) << kiln_last_error();
  ASSERT_EQ(kiln_summary_histogram(w, "ints", i32({4}, {1, 1, 2, -7}), 4), 0) << kiln_last_error();
  ASSERT_EQ(kiln_summary_histogram(w, "empty", f32({0}, {}), 5), 0) << kiln_last_error();
  kiln_summary_writer_free(w);
  auto recs = read_records(event_file(d));
  ASSERT_EQ(recs.size(), 4u);
  const std::vector<std::vector<double>> inputs = {xs, {1, 1, 2, -7}, {}};
  for (size_t r = 0; r < inputs.size(); r++) {
    Event e = decode_event(recs[r + 1]);
    const std::vector<double> &v = inputs[r];
    EXPECT_EQ(e.step, (int64_t)r + 3);
    const Field *hf = one(e.value, 5);
    ASSERT_NE(hf, nullptr) << e.tag;
    Message h = parse(hf->bytes);
    double lo = DBL_MAX, hi = -DBL_MAX, sum = 0, sq = 0;
    for (double x : v) lo = std::min(lo, x), hi = std::max(hi, x), sum += x, sq += x * x;
    EXPECT_EQ(f64_of(h, 1), lo) << e.tag;
    EXPECT_EQ(f64_of(h, 2), hi) << e.tag;
    EXPECT_EQ(f64_of(h, 3), (double)v.size()) << e.tag;
    EXPECT_DOUBLE_EQ(f64_of(h, 4), sum) << e.tag;
    EXPECT_DOUBLE_EQ(f64_of(h, 5), sq) << e.tag;
    std::vector<double> limits = packed(h, 6), counts = packed(h, 7);
    ASSERT_EQ(limits.size(), counts.size()) << e.tag;
    ASSERT_FALSE(limits.empty()) << e.tag;
    EXPECT_EQ(limits.back(), DBL_MAX) << e.tag;
    // bucket i counts the values in [limits[i-1], limits[i]); DBL_MAX in the last
    double prev = -INFINITY, total = 0;
    for (size_t i = 0; i < limits.size(); i++) {
      EXPECT_LT(prev, limits[i]) << e.tag << ": limits rise";
      double want = 0;
      for (double x : v) want += (x >= prev && x < limits[i]) || (i + 1 == limits.size() && x == DBL_MAX);
      EXPECT_EQ(counts[i], want) << e.tag << " bucket " << i << " [" << prev << ", " << limits[i] << ")";
      if (i > 0 && i + 1 < limits.size() && counts[i] == 0) {
        EXPECT_NE(counts[i - 1], 0) << "empty runs merged";
      }
      total += counts[i];
      prev = limits[i];
    }
    EXPECT_EQ(total, (double)v.size()) << e.tag;
  }
  // the edges are TensorFlow's: 1.1^k * 1e-12 around 1 and 2
  Event ints = decode_event(recs[2]);
  Message h = parse(one(ints.value, 5)->bytes);
  std::vector<double> limits = packed(h, 6), want_edges;
  double v = 1e-12;
  for (; v < 1e20; v *= 1.1) want_edges.push_back(v);
  for (double l : limits) {
    if (l != 0 && std::fabs(l) < 1e20) {
      EXPECT_NE(std::find(want_edges.begin(), want_edges.end(), std::fabs(l)), want_edges.end()) << l;
    }
  }
}

TEST(Summary, ManyThreadsOneWriter) {
  IoTempDir d;
  kiln_summary_writer *w = kiln_summary_writer_new(d.path.c_str());
  ASSERT_NE(w, nullptr) << kiln_last_error();
  const int threads = 4, per = 200;
  std::vector<std::thread> ts;
  for (int t = 0; t < threads; t++)
    ts.emplace_back([w, t] {
      std::string tag = "thread" + std::to_string(t);
      for (int i = 0; i < per; i++) {
        EXPECT_EQ(kiln_summary_scalar(w, tag.c_str(), t * 1000 + i, i), 0) << kiln_last_error();
        if (i % 50 == 0) {
          kiln_scope_push();
          EXPECT_EQ(kiln_summary_histogram(w, tag.c_str(), f32({3}, {1, 2, (float)i}), i), 0);
          kiln_scope_pop();
          EXPECT_EQ(kiln_summary_flush(w), 0);
        }
      }
    });
  for (auto &t : ts) t.join();
  kiln_summary_writer_free(w);
  auto recs = read_records(event_file(d));
  ASSERT_EQ(recs.size(), (size_t)(1 + threads * per + threads * per / 50));
  std::set<std::pair<std::string, int64_t>> seen;
  for (size_t i = 1; i < recs.size(); i++) {
    Event e = decode_event(recs[i]);
    if (one(e.value, 2)) {
      EXPECT_EQ(simple_value(e), (float)(std::stoi(e.tag.substr(6)) * 1000 + e.step));
      seen.insert({e.tag, e.step});
    }
  }
  EXPECT_EQ(seen.size(), (size_t)(threads * per)) << "every scalar once";
}

TEST(Summary, BadArguments) {
  Scoped s;
  IoTempDir d;
  EXPECT_EQ(kiln_summary_writer_new(nullptr), nullptr);
  EXPECT_STREQ(kiln_last_error(), "summary_writer_new: logdir is NULL");
  EXPECT_EQ(kiln_summary_writer_new(""), nullptr);
  EXPECT_THAT(kiln_last_error(), StartsWith("summary_writer_new: "));
  put_file(d.file("file"), "x");
  EXPECT_EQ(kiln_summary_writer_new(d.file("file").c_str()), nullptr);
  EXPECT_THAT(kiln_last_error(), StartsWith("summary_writer_new: " + d.file("file") + ": cannot create the directory"));
  EXPECT_EQ(kiln_summary_writer_new(d.file("file/sub").c_str()), nullptr);
  EXPECT_THAT(kiln_last_error(), StartsWith("summary_writer_new: " + d.file("file/sub") + ": "));
  if (geteuid() != 0) {  // root writes anywhere
    ASSERT_EQ(mkdir(d.file("ro").c_str(), 0500), 0);
    EXPECT_EQ(kiln_summary_writer_new(d.file("ro").c_str()), nullptr);
    EXPECT_THAT(kiln_last_error(), HasSubstr("cannot create an event file there"));
    EXPECT_EQ(kiln_summary_writer_new(d.file("ro/sub").c_str()), nullptr);
    EXPECT_THAT(kiln_last_error(), HasSubstr("cannot create the directory"));
  }
  EXPECT_EQ(kiln_summary_scalar(nullptr, "a", 1, 0), -1);
  EXPECT_STREQ(kiln_last_error(), "summary_scalar: writer is NULL");
  EXPECT_EQ(kiln_summary_histogram(nullptr, "a", f32({1}, {1}), 0), -1);
  EXPECT_STREQ(kiln_last_error(), "summary_histogram: writer is NULL");
  EXPECT_EQ(kiln_summary_flush(nullptr), -1);
  kiln_summary_writer_free(nullptr);

  std::string logdir = d.file("ok");
  kiln_summary_writer *w = kiln_summary_writer_new(logdir.c_str());
  ASSERT_NE(w, nullptr) << kiln_last_error();
  EXPECT_EQ(kiln_summary_scalar(w, nullptr, 1, 0), -1);
  EXPECT_STREQ(kiln_last_error(), "summary_scalar: tag is NULL");
  EXPECT_EQ(kiln_summary_scalar(w, "", 1, 0), -1);
  EXPECT_STREQ(kiln_last_error(), "summary_scalar: tag is empty");
  EXPECT_EQ(kiln_summary_scalar(w, "bad\xff", 1, 0), -1);
  EXPECT_THAT(kiln_last_error(), StartsWith("summary_scalar: tag is not UTF-8"));
  kiln_clear_error();
  EXPECT_EQ(kiln_summary_histogram(w, "h", nullptr, 0), -1);
  EXPECT_STREQ(kiln_last_error(), "summary_histogram: values is NULL");
  EXPECT_EQ(kiln_summary_histogram(w, "h", f32({3}, {1, kNanF, 2}), 0), -1);
  EXPECT_THAT(kiln_last_error(), StartsWith("summary_histogram: values[1] is nan"));
  EXPECT_EQ(kiln_summary_histogram(w, "h", f64({1}, {-kInf}), 0), -1);
  EXPECT_THAT(kiln_last_error(), HasSubstr("finite"));
  ASSERT_EQ(kiln_summary_scalar(w, "nan is a value", kNan, 1), 0) << "TensorBoard plots NaN scalars";
  kiln_summary_writer_free(w);
  auto names = IoTempDir::entries_of(logdir);
  ASSERT_EQ(names.size(), 1u);
  EXPECT_EQ(read_records(logdir + "/" + names[0]).size(), 2u) << "failed calls write nothing";
}

// ---- against protobuf ----

bool protobuf_available() {
  return std::system("command -v protoc >/dev/null 2>&1 && "
                     "/usr/bin/python3 -c 'import google.protobuf' >/dev/null 2>&1") == 0;
}

std::string hex(const std::string &s) {
  static const char *digits = "0123456789abcdef";
  std::string out;
  for (unsigned char c : s) out += digits[c >> 4], out += digits[c & 15];
  return out;
}

TEST(Summary, ProtobufParsesEveryRecord) {
  Scoped s;
  IoTempDir d;
  // the C++ reader above checks these bytes too, whatever is installed
  std::string logdir = d.file("logs"), expect;
  double t0 = now() - 1e-3;
  kiln_summary_writer *w = kiln_summary_writer_new(logdir.c_str());
  ASSERT_NE(w, nullptr) << kiln_last_error();
  std::mt19937 rng(4);
  std::uniform_real_distribution<double> u(-50, 50);
  char buf[64];
  for (int step = -2; step < 60; step++) {
    std::string tag = step % 3 ? "loss" : "métrique/ψ";
    double v = u(rng);
    ASSERT_EQ(kiln_summary_scalar(w, tag.c_str(), v, step), 0) << kiln_last_error();
    snprintf(buf, sizeof buf, "%.17g", v);
    expect += "scalar " + hex(tag) + " " + std::to_string(step) + " " + buf + "\n";
    if (step % 10 == 0) {
      int n = step;
      std::vector<double> xs;
      std::string list;
      for (int i = 0; i < n; i++) {
        xs.push_back(u(rng) * std::pow(10.0, (double)(i % 7) - 3));
        snprintf(buf, sizeof buf, "%.17g", xs.back());
        list += (i ? "," : "") + std::string(buf);
      }
      kiln_scope_push();
      ASSERT_EQ(kiln_summary_histogram(w, "layer/w", f64({(int64_t)n}, xs), step), 0) << kiln_last_error();
      kiln_scope_pop();
      expect += "histo " + hex("layer/w") + " " + std::to_string(step) + " " + list + "\n";
    }
  }
  kiln_summary_writer_free(w);
  double t1 = now() + 1e-3;
  auto names = IoTempDir::entries_of(logdir);
  ASSERT_EQ(names.size(), 1u);
  std::string events = logdir + "/" + names[0];
  EXPECT_EQ(read_records(events).size(), (size_t)(1 + 62 + 6));
  if (!protobuf_available())
    GTEST_SKIP() << "protoc or python3's google.protobuf missing: install protobuf-compiler and python3-protobuf";
  put_file(d.file("expect.txt"), expect);
  std::string pb = d.file("pb"), out;
  ASSERT_EQ(mkdir(pb.c_str(), 0700), 0);
  std::string protos = source_dir(__FILE__) + "tensorboard_proto";
  int rc = run_command("protoc -I '" + protos + "' --python_out='" + pb + "' event.proto summary.proto", &out);
  ASSERT_EQ(rc, 0) << out;
  char t[128];
  snprintf(t, sizeof t, " %.6f %.6f", t0, t1);
  rc = run_command("/usr/bin/python3 '" + source_dir(__FILE__) + "summary_check.py' '" + pb + "' '" + events +
                       "' '" + d.file("expect.txt") + "'" + t,
                   &out);
  EXPECT_EQ(rc, 0) << out;
  EXPECT_THAT(out, HasSubstr("ok 68 events"));
}

}  // namespace
