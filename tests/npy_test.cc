// npy_test.cc — kiln_load_npy / kiln_save_npy: round trips of every dtype
// and shape (0-d and empty included), the exact bytes NumPy writes, files
// built byte by byte here (versions 1.0-3.0, big-endian, Fortran order,
// narrow and unsigned integers), bad files and paths, and both directions
// against NumPy itself (tests/npy_check.py) where python3-numpy is present.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <kiln.h>

#include <sys/stat.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "io_util.h"
#include "test_util.h"

using ::testing::HasSubstr;
using ::testing::StartsWith;

namespace {

using namespace kiln_test;
using namespace kiln_io_test;

// A .npy file by hand: preamble of the given major version, the dict padded
// with spaces and a newline to a multiple of 64 (pad false: as given), data.
std::string npy_bytes(int major, const std::string &dict, const std::string &data, bool pad = true) {
  size_t pre = major == 1 ? 10 : 12;
  std::string h = dict;
  if (pad) {
    while ((pre + h.size() + 1) % 64) h += ' ';
    h += '\n';
  }
  std::string out = "\x93NUMPY";
  out += (char)major;
  out += '\0';
  for (size_t k = 0; k < pre - 8; k++) out += (char)((h.size() >> (8 * k)) & 0xff);
  return out + h + data;
}

template <typename T>
std::string le_bytes(const std::vector<T> &v) {
  std::string s((const char *)v.data(), v.size() * sizeof(T));
  return s;  // the test hosts are little-endian (checked in HostIsLittleEndian)
}

template <typename T>
std::string be_bytes(const std::vector<T> &v) {
  std::string s = le_bytes(v);
  for (size_t i = 0; i < s.size(); i += sizeof(T)) std::reverse(s.begin() + (long)i, s.begin() + (long)(i + sizeof(T)));
  return s;
}

std::string raw_of(const kiln_tensor *t) {
  std::string s((size_t)kiln_tensor_size(t) * kiln_dtype_size(kiln_tensor_dtype(t)), '\0');
  EXPECT_EQ(kiln_tensor_read(t, s.data(), s.size()), 0) << kiln_last_error();
  return s;
}

// A tensor of random bytes valid for dt (bool: 0 or 1; floats: any bits,
// NaNs included), its bytes into *bytes.
kiln_tensor *random_tensor(kiln_dtype dt, const V64 &shape, std::mt19937_64 &rng, std::string *bytes) {
  int64_t n = 1;
  for (int64_t x : shape) n *= x;
  bytes->assign((size_t)n * kiln_dtype_size(dt), '\0');
  for (auto &c : *bytes) c = (char)(dt == KILN_BOOL ? rng() & 1 : rng() & 0xff);
  kiln_tensor *t = kiln_tensor_new(dt, (int)shape.size(), shape.data(), bytes->data());
  EXPECT_NE(t, nullptr) << kiln_last_error();
  return t;
}

kiln_tensor *load_file(const IoTempDir &d, const std::string &name, const std::string &bytes) {
  put_file(d.file(name), bytes);
  return kiln_load_npy(d.file(name).c_str());
}

TEST(Npy, HostIsLittleEndian) {
  uint16_t one = 1;
  ASSERT_EQ(*(uint8_t *)&one, 1) << "these tests spell little-endian data by hand";
}

TEST(Npy, RoundTripEveryDtypeAndShape) {
  Scoped s;
  IoTempDir d;
  std::mt19937_64 rng(7);
  const std::vector<V64> shapes = {{}, {0}, {1}, {5}, {2, 3}, {3, 0, 2}, {2, 1, 3, 2}, {1, 1, 1, 1, 1, 1, 1, 2}};
  for (kiln_dtype dt : {KILN_F32, KILN_F64, KILN_I32, KILN_I64, KILN_BOOL, KILN_F16}) {
    for (const V64 &shape : shapes) {
      std::string bytes;
      kiln_tensor *t = random_tensor(dt, shape, rng, &bytes);
      std::string path = d.file("t.npy");
      ASSERT_EQ(kiln_save_npy(path.c_str(), t), 0) << kiln_last_error();
      std::string file = get_file(path);
      EXPECT_EQ(file.size() % 64, bytes.size() % 64) << "the data starts 64-aligned";
      kiln_tensor *u = kiln_load_npy(path.c_str());
      ASSERT_NE(u, nullptr) << kiln_last_error();
      EXPECT_EQ(kiln_tensor_dtype(u), dt) << kiln_dtype_name(dt);
      EXPECT_EQ(shape_of(u), shape) << kiln_dtype_name(dt);
      EXPECT_EQ(raw_of(u), bytes) << kiln_dtype_name(dt) << " rank " << shape.size();
    }
  }
  EXPECT_EQ(d.entries(), std::vector<std::string>{"t.npy"}) << "no temporary file is left";
}

TEST(Npy, SavesWhatNumPyWrites) {
  Scoped s;
  IoTempDir d;
  std::string path = d.file("a.npy");
  ASSERT_EQ(kiln_save_npy(path.c_str(), f32({2, 3}, {1, 2, 3, 4, 5, 6})), 0) << kiln_last_error();
  std::string want = npy_bytes(1, "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }",
                               le_bytes(std::vector<float>{1, 2, 3, 4, 5, 6}));
  EXPECT_EQ(get_file(path), want);
  ASSERT_EQ(kiln_save_npy(path.c_str(), i64({3}, {-1, 0, 7})), 0) << kiln_last_error();
  EXPECT_EQ(get_file(path), npy_bytes(1, "{'descr': '<i8', 'fortran_order': False, 'shape': (3,), }",
                                      le_bytes(std::vector<int64_t>{-1, 0, 7})));
  uint8_t b = 1;
  ASSERT_EQ(kiln_save_npy(path.c_str(), kiln_tensor_new(KILN_BOOL, 0, nullptr, &b)), 0) << kiln_last_error();
  EXPECT_EQ(get_file(path), npy_bytes(1, "{'descr': '|b1', 'fortran_order': False, 'shape': (), }", "\x01"));
}

TEST(Npy, LoadedTensorBelongsToTheScope) {
  int64_t live = kiln_debug_live_tensors();
  IoTempDir d;
  std::string path = d.file("x.npy");
  put_file(path, npy_bytes(1, "{'descr': '<f8', 'fortran_order': False, 'shape': (2,), }",
                           le_bytes(std::vector<double>{1.5, -2})));
  kiln_scope_push();
  kiln_tensor *t = kiln_load_npy(path.c_str());
  ASSERT_NE(t, nullptr) << kiln_last_error();
  EXPECT_EQ(values(t), (VD{1.5, -2}));
  kiln_scope_pop();
  EXPECT_EQ(kiln_debug_live_tensors(), live);
  kiln_tensor *own = kiln_load_npy(path.c_str());  // no scope: the caller's
  ASSERT_NE(own, nullptr);
  kiln_release(own);
  EXPECT_EQ(kiln_debug_live_tensors(), live);
}

TEST(Npy, HandMadeHeaders) {
  Scoped s;
  IoTempDir d;
  const std::string f4 = le_bytes(std::vector<float>{1, -2, 3.5f});
  // versions 2.0 and 3.0: a 4-byte header length
  for (int major : {1, 2, 3}) {
    kiln_tensor *t = load_file(d, "v.npy", npy_bytes(major, "{'descr': '<f4', 'fortran_order': False, 'shape': (3,), }", f4));
    EXPECT_EQ(values(t), (VD{1, -2, 3.5})) << "version " << major;
  }
  // what older NumPy wrote: no 64-alignment, double quotes, no trailing comma, odd spacing
  kiln_tensor *t = load_file(d, "q.npy",
                             npy_bytes(1, "{ \"shape\" :(3 ,) , \"descr\":\"<f4\",\"fortran_order\": False}\n", f4, false));
  EXPECT_EQ(values(t), (VD{1, -2, 3.5}));
  t = load_file(d, "l.npy", npy_bytes(1, "{'descr': '<f4', 'fortran_order': False, 'shape': (3L,), }", f4));
  EXPECT_EQ(values(t), (VD{1, -2, 3.5})) << "Python 2's long dims";
  // big-endian files are swapped into host order
  t = load_file(d, "be4.npy", npy_bytes(1, "{'descr': '>f4', 'fortran_order': False, 'shape': (3,), }",
                                        be_bytes(std::vector<float>{1, -2, 3.5f})));
  EXPECT_EQ(values(t), (VD{1, -2, 3.5}));
  t = load_file(d, "be8.npy", npy_bytes(2, "{'descr': '>i8', 'fortran_order': False, 'shape': (2,), }",
                                        be_bytes(std::vector<int64_t>{-3, 1LL << 40})));
  EXPECT_EQ(read<int64_t>(t), (std::vector<int64_t>{-3, 1LL << 40}));
  t = load_file(d, "be2.npy", npy_bytes(1, "{'descr': '>f2', 'fortran_order': False, 'shape': (2,), }",
                                        be_bytes(std::vector<uint16_t>{0x3c00, 0xc000})));
  ASSERT_NE(t, nullptr) << kiln_last_error();
  EXPECT_EQ(kiln_tensor_dtype(t), KILN_F16);
  EXPECT_EQ(read<uint16_t>(t), (std::vector<uint16_t>{0x3c00, 0xc000}));
  t = load_file(d, "n.npy", npy_bytes(1, "{'descr': '=i4', 'fortran_order': False, 'shape': (2,), }",
                                      le_bytes(std::vector<int32_t>{5, -6})));
  EXPECT_EQ(read<int32_t>(t), (std::vector<int32_t>{5, -6})) << "'=' is the host's order";
  // Fortran order: element (i, j, k) of a [2, 3, 4] array at i + 2 * (j + 3 * k)
  std::vector<int32_t> fortran(24), c_order(24);
  for (int i = 0; i < 2; i++)
    for (int j = 0; j < 3; j++)
      for (int k = 0; k < 4; k++) {
        int v = 100 * i + 10 * j + k;
        fortran[(size_t)(i + 2 * (j + 3 * k))] = v;
        c_order[(size_t)((i * 3 + j) * 4 + k)] = v;
      }
  t = load_file(d, "f.npy", npy_bytes(1, "{'descr': '<i4', 'fortran_order': True, 'shape': (2, 3, 4), }",
                                      le_bytes(fortran)));
  EXPECT_EQ(shape_of(t), (V64{2, 3, 4}));
  EXPECT_EQ(read<int32_t>(t), c_order);
  t = load_file(d, "fbe.npy", npy_bytes(1, "{'descr': '>f8', 'fortran_order': True, 'shape': (2, 2), }",
                                        be_bytes(std::vector<double>{1, 2, 3, 4})));
  EXPECT_EQ(values(t), (VD{1, 3, 2, 4}));
  t = load_file(d, "f1.npy", npy_bytes(1, "{'descr': '<i2', 'fortran_order': True, 'shape': (3, 2), }",
                                       le_bytes(std::vector<int16_t>{1, 2, 3, -4, 5, 6})));
  EXPECT_EQ(kiln_tensor_dtype(t), KILN_I32);
  EXPECT_EQ(read<int32_t>(t), (std::vector<int32_t>{1, -4, 2, 5, 3, 6})) << "widened and transposed";
  t = load_file(d, "fe.npy", npy_bytes(1, "{'descr': '<f4', 'fortran_order': True, 'shape': (0, 3), }", ""));
  EXPECT_EQ(shape_of(t), (V64{0, 3}));
}

TEST(Npy, NarrowAndUnsignedIntegersWiden) {
  Scoped s;
  IoTempDir d;
  struct Case {
    const char *descr;
    std::string data;
    kiln_dtype want;
    VD values;
  };
  const Case cases[] = {
      {"|i1", std::string("\x80\x7f\xff", 3), KILN_I32, {-128, 127, -1}},
      {"|u1", std::string("\x80\x7f\xff", 3), KILN_I32, {128, 127, 255}},
      {"<i2", le_bytes(std::vector<int16_t>{-32768, 32767, -1}), KILN_I32, {-32768, 32767, -1}},
      {"<u2", le_bytes(std::vector<uint16_t>{65535, 1, 0}), KILN_I32, {65535, 1, 0}},
      {">u2", be_bytes(std::vector<uint16_t>{65535, 1, 256}), KILN_I32, {65535, 1, 256}},
      {"<u4", le_bytes(std::vector<uint32_t>{4294967295u, 1, 0}), KILN_I64, {4294967295.0, 1, 0}},
      {"<u8", le_bytes(std::vector<uint64_t>{1ull << 62, 1, 0}), KILN_I64, {4611686018427387904.0, 1, 0}},
      {"|b1", std::string("\x00\x02\x01", 3), KILN_BOOL, {0, 1, 1}},
      {"?", std::string("\x01\x00\xff", 3), KILN_BOOL, {1, 0, 1}},
  };
  for (const Case &c : cases) {
    std::string dict = std::string("{'descr': '") + c.descr + "', 'fortran_order': False, 'shape': (3,), }";
    kiln_tensor *t = load_file(d, "w.npy", npy_bytes(1, dict, c.data));
    ASSERT_NE(t, nullptr) << c.descr << ": " << kiln_last_error();
    EXPECT_EQ(kiln_tensor_dtype(t), c.want) << c.descr;
    EXPECT_EQ(values(t), c.values) << c.descr;
  }
  kiln_tensor *t = load_file(d, "big.npy", npy_bytes(1, "{'descr': '<u8', 'fortran_order': False, 'shape': (1,), }",
                                                     le_bytes(std::vector<uint64_t>{1ull << 63})));
  EXPECT_EQ(t, nullptr);
  EXPECT_THAT(kiln_last_error(), StartsWith("load_npy: "));
  EXPECT_THAT(kiln_last_error(), HasSubstr("does not fit i64"));
}

TEST(Npy, BadFilesAreRefused) {
  Scoped s;
  IoTempDir d;
  const std::string f4 = le_bytes(std::vector<float>{1, 2, 3});
  auto dict = [](const std::string &descr, const std::string &shape, const std::string &fortran = "False") {
    return "{'descr': '" + descr + "', 'fortran_order': " + fortran + ", 'shape': " + shape + ", }";
  };
  std::string huge_v2 = std::string("\x93NUMPY\x02\x00", 8) + std::string("\xff\xff\xff\xff", 4) + "{";
  std::string big_v2 = std::string("\x93NUMPY\x02\x00", 8) + std::string("\xa0\x86\x01\x00", 4) +
                       std::string(100000, ' ');  // 100000 bytes claimed and present
  struct Case {
    const char *name;
    std::string bytes;
    const char *why;
  };
  const Case cases[] = {
      {"empty", "", "not a .npy file"},
      {"bad magic", npy_bytes(1, dict("<f4", "(3,)"), f4).replace(1, 1, "X"), "not a .npy file"},
      {"a safetensors file", std::string("\x08\0\0\0\0\0\0\0{}      ", 16), "not a .npy file"},
      {"version 4", npy_bytes(1, dict("<f4", "(3,)"), f4).replace(6, 1, "\x04"), "version 4.0"},
      {"v2 preamble cut", std::string("\x93NUMPY\x02\x00\x10", 9) + " ", "preamble"},
      {"huge header", huge_v2, "at most"},
      {"100 KB header", big_v2, "at most"},
      {"header cut", npy_bytes(1, dict("<f4", "(3,)"), "").substr(0, 40), "truncated in its header"},
      {"data cut", npy_bytes(1, dict("<f4", "(3,)"), f4.substr(0, 11)), "truncated"},
      {"trailing data", npy_bytes(1, dict("<f4", "(3,)"), f4 + "x"), "trailing bytes"},
      {"complex", npy_bytes(1, dict("<c8", "(3,)"), f4), "dtype '<c8' is not supported"},
      {"object", npy_bytes(1, dict("|O", "(3,)"), f4), "dtype '|O' is not supported"},
      {"string", npy_bytes(1, dict("<U3", "(1,)"), f4), "dtype '<U3' is not supported"},
      {"f16 digits", npy_bytes(1, dict("<f16", "(1,)"), f4), "is not supported"},
      {"no byte order for f4", npy_bytes(1, dict("|f4", "(3,)"), f4), "no byte order"},
      {"structured", npy_bytes(1, "{'descr': [('a', '<f4')], 'fortran_order': False, 'shape': (3,), }", f4),
       "structured"},
      {"rank 9", npy_bytes(1, dict("<f4", "(1, 1, 1, 1, 1, 1, 1, 1, 3)"), f4), "more than 8 dimensions"},
      {"count overflow", npy_bytes(1, dict("<f4", "(4294967296, 4294967296, 4)"), f4), "overflows"},
      {"dim overflow", npy_bytes(1, dict("<f4", "(99999999999999999999,)"), f4), "overflows"},
      {"negative dim", npy_bytes(1, dict("<f4", "(-3,)"), f4), "something other than sizes"},
      {"shape a list", npy_bytes(1, dict("<f4", "[3]"), f4), "not a tuple"},
      {"float dim", npy_bytes(1, dict("<f4", "(3.0,)"), f4), "malformed"},
      {"fortran 1", npy_bytes(1, dict("<f4", "(3,)", "1"), f4), "neither True nor False"},
      {"unknown key", npy_bytes(1, "{'descr': '<f4', 'fortran_order': False, 'shape': (3,), 'x': 1}", f4),
       "unknown key 'x'"},
      {"repeated key", npy_bytes(1, "{'descr': '<f4', 'descr': '<f4', 'fortran_order': False, 'shape': (3,)}", f4),
       "repeats 'descr'"},
      {"no shape", npy_bytes(1, "{'descr': '<f4', 'fortran_order': False}", f4), "lacks 'shape'"},
      {"not a dict", npy_bytes(1, "('<f4', False, (3,))", f4), "not a dict"},
      {"after the dict", npy_bytes(1, dict("<f4", "(3,)") + " x", f4), "after its dict"},
      {"escaped string", npy_bytes(1, "{'descr': '<f\\4', 'fortran_order': False, 'shape': (3,)}", f4),
       "descr is not a short string"},
      {"unterminated", npy_bytes(1, "{'descr': '<f4", f4), "not a short string"},
  };
  for (const Case &c : cases) {
    kiln_clear_error();
    kiln_tensor *t = load_file(d, "bad.npy", c.bytes);
    EXPECT_EQ(t, nullptr) << c.name;
    EXPECT_THAT(kiln_last_error(), StartsWith("load_npy: " + d.file("bad.npy") + ": ")) << c.name;
    EXPECT_THAT(kiln_last_error(), HasSubstr(c.why)) << c.name;
  }
  // every prefix of a good file is refused
  std::string good = npy_bytes(2, dict(">f8", "(2, 2)", "True"), std::string(32, '\x01'));
  for (size_t n = 0; n < good.size(); n++) {
    EXPECT_EQ(load_file(d, "cut.npy", good.substr(0, n)), nullptr) << n << " bytes";
    EXPECT_THAT(kiln_last_error(), StartsWith("load_npy: ")) << n;
  }
  EXPECT_NE(load_file(d, "cut.npy", good), nullptr) << kiln_last_error();
}

TEST(Npy, BadPathsAreRefused) {
  Scoped s;
  IoTempDir d;
  EXPECT_EQ(kiln_load_npy(nullptr), nullptr);
  EXPECT_STREQ(kiln_last_error(), "load_npy: path is NULL");
  EXPECT_EQ(kiln_load_npy(d.file("missing.npy").c_str()), nullptr);
  EXPECT_THAT(kiln_last_error(), StartsWith("load_npy: " + d.file("missing.npy") + ": cannot open"));
  EXPECT_EQ(kiln_load_npy(d.path.c_str()), nullptr);
  EXPECT_THAT(kiln_last_error(), HasSubstr("not a regular file"));
  ASSERT_EQ(mkfifo(d.file("fifo").c_str(), 0600), 0);
  EXPECT_EQ(kiln_load_npy(d.file("fifo").c_str()), nullptr) << "a FIFO is refused, not waited on";
  EXPECT_THAT(kiln_last_error(), HasSubstr("not a regular file"));

  kiln_tensor *t = f32({2}, {1, 2});
  EXPECT_EQ(kiln_save_npy(nullptr, t), -1);
  EXPECT_STREQ(kiln_last_error(), "save_npy: path is NULL");
  EXPECT_EQ(kiln_save_npy("", t), -1);
  EXPECT_STREQ(kiln_last_error(), "save_npy: path is empty");
  kiln_clear_error();
  EXPECT_EQ(kiln_save_npy(d.file("n.npy").c_str(), nullptr), -1);
  EXPECT_STREQ(kiln_last_error(), "save_npy: tensor is NULL");
  kiln_fail("earlier: kept");
  EXPECT_EQ(kiln_save_npy(d.file("n.npy").c_str(), nullptr), -1);
  EXPECT_STREQ(kiln_last_error(), "earlier: kept") << "a NULL input keeps the first error";
  EXPECT_EQ(kiln_save_npy(d.path.c_str(), t), -1);
  EXPECT_THAT(kiln_last_error(), HasSubstr("a directory"));
  EXPECT_EQ(kiln_save_npy(d.file("fifo").c_str(), t), -1);
  EXPECT_THAT(kiln_last_error(), HasSubstr("a FIFO"));
  ASSERT_EQ(symlink("target.npy", d.file("link.npy").c_str()), 0);
  EXPECT_EQ(kiln_save_npy(d.file("link.npy").c_str(), t), -1);
  EXPECT_THAT(kiln_last_error(), HasSubstr("a symbolic link"));
  EXPECT_EQ(kiln_save_npy(d.file("no/such/dir.npy").c_str(), t), -1);
  EXPECT_THAT(kiln_last_error(), StartsWith("save_npy: " + d.file("no/such/dir.npy") + ": cannot create a file there"));
  uint16_t h[2] = {0x3f80, 0x4000};
  const int64_t two = 2;
  kiln_tensor *bf = kiln_tensor_new(KILN_BF16, 1, &two, h);
  EXPECT_EQ(kiln_save_npy(d.file("bf.npy").c_str(), bf), -1);
  EXPECT_THAT(kiln_last_error(), HasSubstr("bf16 has no NumPy dtype"));
  ASSERT_EQ(kiln_save_npy(d.file("bf.npy").c_str(), kiln_cast(bf, KILN_F32)), 0) << kiln_last_error();
  EXPECT_EQ(values(kiln_load_npy(d.file("bf.npy").c_str())), (VD{1, 2})) << "the advertised way round";

  // a failed save leaves the old file as it was
  std::string keep = d.file("keep.npy");
  ASSERT_EQ(kiln_save_npy(keep.c_str(), t), 0) << kiln_last_error();
  std::string before = get_file(keep);
  EXPECT_EQ(kiln_save_npy(keep.c_str(), bf), -1);
  EXPECT_EQ(get_file(keep), before);
  if (geteuid() != 0) {  // root writes anywhere
    ASSERT_EQ(chmod(d.path.c_str(), 0500), 0);
    EXPECT_EQ(kiln_save_npy(keep.c_str(), f32({1}, {9})), -1);
    EXPECT_THAT(kiln_last_error(), HasSubstr("cannot create a file there"));
    ASSERT_EQ(chmod(d.path.c_str(), 0700), 0);
    EXPECT_EQ(get_file(keep), before);
  }
  for (const std::string &e : d.entries()) EXPECT_EQ(e.find(".tmp-"), std::string::npos) << e;
}

// ---- against NumPy ----

bool numpy_available() { return std::system("/usr/bin/python3 -c 'import numpy' >/dev/null 2>&1") == 0; }

std::string check_script() { return source_dir(__FILE__) + "npy_check.py"; }

// One line of a manifest: "name dtype d0,d1,..." ("-" for a 0-d shape).
std::map<std::string, std::pair<std::string, V64>> read_manifest(const std::string &path) {
  std::map<std::string, std::pair<std::string, V64>> out;
  std::istringstream in(get_file(path));
  std::string name, dtype, dims;
  while (in >> name >> dtype >> dims) {
    V64 shape;
    if (dims != "-") {
      std::istringstream ds(dims);
      std::string x;
      while (std::getline(ds, x, ',')) shape.push_back(std::stoll(x));
    }
    out[name] = {dtype, shape};
  }
  return out;
}

TEST(Npy, NumPyWritesKilnReads) {
  Scoped s;
  if (!numpy_available()) GTEST_SKIP() << "/usr/bin/python3 cannot import numpy: install python3-numpy";
  IoTempDir d;
  std::string out;
  int rc = run_command("/usr/bin/python3 '" + check_script() + "' write '" + d.path + "'", &out);
  ASSERT_EQ(rc, 0) << out;
  auto manifest = read_manifest(d.file("manifest.txt"));
  ASSERT_GE(manifest.size(), 20u) << out;
  for (auto &[name, want] : manifest) {
    kiln_tensor *t = kiln_load_npy(d.file(name + ".npy").c_str());
    ASSERT_NE(t, nullptr) << name << ": " << kiln_last_error();
    EXPECT_STREQ(kiln_dtype_name(kiln_tensor_dtype(t)), want.first.c_str()) << name;
    EXPECT_EQ(shape_of(t), want.second) << name;
    EXPECT_EQ(raw_of(t), get_file(d.file(name + ".raw"))) << name << ": elements differ from NumPy's";
  }
}

TEST(Npy, KilnWritesNumPyReads) {
  Scoped s;
  if (!numpy_available()) GTEST_SKIP() << "/usr/bin/python3 cannot import numpy: install python3-numpy";
  IoTempDir d;
  std::mt19937_64 rng(11);
  std::string manifest;
  const std::vector<V64> shapes = {{}, {0}, {7}, {3, 5}, {2, 0}, {2, 3, 1, 2}};
  int k = 0;
  for (kiln_dtype dt : {KILN_F32, KILN_F64, KILN_I32, KILN_I64, KILN_BOOL, KILN_F16}) {
    for (const V64 &shape : shapes) {
      std::string bytes;
      kiln_tensor *t = random_tensor(dt, shape, rng, &bytes);
      std::string name = "k" + std::to_string(k++);
      ASSERT_EQ(kiln_save_npy(d.file(name + ".npy").c_str(), t), 0) << kiln_last_error();
      put_file(d.file(name + ".raw"), bytes);
      std::string dims;
      for (size_t i = 0; i < shape.size(); i++) dims += (i ? "," : "") + std::to_string(shape[i]);
      manifest += name + " " + kiln_dtype_name(dt) + " " + (dims.empty() ? "-" : dims) + "\n";
    }
  }
  put_file(d.file("manifest.txt"), manifest);
  std::string out;
  int rc = run_command("/usr/bin/python3 '" + check_script() + "' read '" + d.path + "'", &out);
  EXPECT_EQ(rc, 0) << out;
  EXPECT_THAT(out, HasSubstr("checked " + std::to_string(k) + " files"));
}

}  // namespace
