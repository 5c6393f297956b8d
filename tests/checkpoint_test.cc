// checkpoint_test.cc — safetensors checkpoints: round trips of every dtype,
// files built byte by byte here (independently of lib/checkpoint.c) and by
// an independent Python writer and reader, mismatched variables, truncated
// and corrupt files, unwritable paths, and a deterministic mini-fuzz.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <kiln.h>

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "io_util.h"
#include "test_util.h"

using ::testing::HasSubstr;
using ::testing::StartsWith;

namespace {

namespace fs = std::filesystem;

using namespace kiln_test;

// A fresh directory, removed with everything in it at the end.
struct TempDir : kiln_io_test::IoTempDir {
  TempDir() : IoTempDir("kiln_ckpt") {}
};

void write_file(const std::string &path, const std::string &bytes) {
  std::remove(path.c_str());  // truncating in place makes ext4 flush on close: slow
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), (std::streamsize)bytes.size());
  ASSERT_TRUE(f.good()) << path;
}

std::string read_file(const std::string &path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// The format, written out here by hand: little-endian u64 header length,
// the header padded with spaces to a multiple of 8, then the data.
std::string u64le(uint64_t v) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; i++) s[i] = (char)(v >> (8 * i) & 0xff);
  return s;
}
std::string padded(std::string header) {
  while (header.size() % 8) header += ' ';
  return header;
}
std::string st_file(const std::string &header, const std::string &data, bool pad = true) {
  std::string h = pad ? padded(header) : header;
  return u64le(h.size()) + h + data;
}
template <typename T>
std::string le_bytes(std::vector<T> v) {  // the test machines are little-endian x86/ARM
  return std::string((const char *)v.data(), v.size() * sizeof(T));
}

std::string raw(kiln_variable *v) {
  kiln_scope_push();
  kiln_tensor *t = kiln_variable_read(v);
  size_t n = (size_t)kiln_tensor_size(t) * kiln_dtype_size(kiln_tensor_dtype(t));
  std::string out(n, '\0');
  EXPECT_EQ(kiln_tensor_read(t, out.data(), n), 0) << kiln_last_error();
  kiln_scope_pop();
  return out;
}

std::vector<float> f32s(kiln_variable *v) {
  std::string r = raw(v);
  std::vector<float> out(r.size() / 4);
  memcpy(out.data(), r.data(), r.size());
  return out;
}

const std::string kW = R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";

// ---------------------------------------------------------------------------

TEST(Checkpoint, RoundTripEveryDtype) {
  Scoped s;
  Owned own;
  TempDir dir;
  float f[6] = {1.5f, -2, 3.25f, 0, -0.0f, 1e30f};
  double d = 3.141592653589793;
  int32_t i32[4] = {INT32_MIN, -1, 0, INT32_MAX};
  int64_t i64[4] = {INT64_MIN, 1, -2, INT64_MAX};
  uint8_t b[3] = {1, 0, 1};
  uint16_t h[3] = {0x3c00, 0xc000, 0x7c00};  // 1, -2, inf
  uint16_t bf[2] = {0x3fc0, 0xc049};         // 1.5, -3.140625
  std::vector<kiln_variable *> saved = {
      own.var(kiln_tensor_new(KILN_F32, KILN_SHAPE(2, 3), f), "f32"),
      own.var(kiln_tensor_new(KILN_F64, 0, nullptr, &d), "f64"),
      own.var(kiln_tensor_new(KILN_I32, KILN_SHAPE(4), i32), "i32"),
      own.var(kiln_tensor_new(KILN_I64, KILN_SHAPE(2, 2), i64), "i64"),
      own.var(kiln_tensor_new(KILN_BOOL, KILN_SHAPE(3), b), "bool"),
      own.var(kiln_tensor_new(KILN_F16, KILN_SHAPE(3), h), "f16"),
      own.var(kiln_tensor_new(KILN_BF16, KILN_SHAPE(1, 2), bf), "bf16"),
      own.var(kiln_zeros(KILN_F32, KILN_SHAPE(0, 3)), "empty"),
  };
  std::string path = dir.file("all.safetensors");
  ASSERT_EQ(kiln_checkpoint_save(path.c_str(), (int)saved.size(), saved.data()), 0) << kiln_last_error();
  EXPECT_EQ(dir.entries(), std::vector<std::string>{"all.safetensors"}) << "a temporary file was left";

  std::vector<kiln_variable *> fresh;
  for (kiln_variable *v : saved) {
    kiln_tensor *t = kiln_variable_read(v);
    fresh.push_back(own.var(kiln_zeros(kiln_tensor_dtype(t), kiln_tensor_rank(t), kiln_tensor_shape(t)),
                             kiln_variable_name(v)));
  }
  // restore in another order than saved
  std::vector<kiln_variable *> reversed(fresh.rbegin(), fresh.rend());
  ASSERT_EQ(kiln_checkpoint_restore(path.c_str(), (int)reversed.size(), reversed.data()), 0) << kiln_last_error();
  for (size_t i = 0; i < saved.size(); i++) EXPECT_EQ(raw(fresh[i]), raw(saved[i])) << kiln_variable_name(saved[i]);
}

TEST(Checkpoint, SavedBytesAreExactlyTheFormat) {
  Scoped s;
  Owned own;
  TempDir dir;
  kiln_variable *w = own.var(f32({1, 2}), "w");
  std::string path = dir.file("w.safetensors");
  ASSERT_EQ(kiln_checkpoint_save(path.c_str(), 1, &w), 0) << kiln_last_error();
  // 54 bytes of JSON, two spaces of padding
  ASSERT_EQ(kW.size(), 54u);
  std::string want = u64le(56) + kW + "  " + le_bytes<float>({1, 2});
  EXPECT_EQ(read_file(path), want);
}

TEST(Checkpoint, LayoutAsTheReferenceOrdersIt) {
  Scoped s;
  Owned own;
  TempDir dir;
  // The reference sorts by dtype, in the descending order of its enum
  // (U64 I64 F64 F32 U32 I32 BF16 F16 ... BOOL), then by name.
  std::vector<kiln_variable *> v = {
      own.var(kiln_zeros(KILN_F16, KILN_SHAPE(1)), "a"),  own.var(kiln_zeros(KILN_F64, KILN_SHAPE(1)), "b"),
      own.var(kiln_zeros(KILN_F32, KILN_SHAPE(1)), "d"),  own.var(kiln_zeros(KILN_BOOL, KILN_SHAPE(2)), "e"),
      own.var(kiln_zeros(KILN_F32, 0, nullptr), "c"),     own.var(kiln_zeros(KILN_I64, KILN_SHAPE(1)), "f"),
      own.var(kiln_zeros(KILN_I32, KILN_SHAPE(1)), "g"),  own.var(kiln_zeros(KILN_BF16, KILN_SHAPE(1)), "h"),
  };
  std::string path = dir.file("l.safetensors");
  ASSERT_EQ(kiln_checkpoint_save(path.c_str(), (int)v.size(), v.data()), 0) << kiln_last_error();
  std::string header = R"({"f":{"dtype":"I64","shape":[1],"data_offsets":[0,8]},)"
                       R"("b":{"dtype":"F64","shape":[1],"data_offsets":[8,16]},)"
                       R"("c":{"dtype":"F32","shape":[],"data_offsets":[16,20]},)"
                       R"("d":{"dtype":"F32","shape":[1],"data_offsets":[20,24]},)"
                       R"("g":{"dtype":"I32","shape":[1],"data_offsets":[24,28]},)"
                       R"("h":{"dtype":"BF16","shape":[1],"data_offsets":[28,30]},)"
                       R"("a":{"dtype":"F16","shape":[1],"data_offsets":[30,32]},)"
                       R"("e":{"dtype":"BOOL","shape":[2],"data_offsets":[32,34]}})";
  EXPECT_EQ(read_file(path), st_file(header, std::string(34, '\0')));
}

// Byte vectors from the reference implementation's own serialization tests.
TEST(Checkpoint, SavesTheReferenceBytes) {
  Scoped s;
  Owned own;
  TempDir dir;
  float data[6] = {0, 1, 2, 3, 4, 5};
  kiln_variable *attn0 = own.var(kiln_tensor_new(KILN_F32, KILN_SHAPE(1, 1, 2, 3), data), "attn0");
  std::string path = dir.file("r.safetensors");
  ASSERT_EQ(kiln_checkpoint_save(path.c_str(), 1, &attn0), 0) << kiln_last_error();
  const unsigned char want[] = {
      72,  0,   0,   0,   0,  0,  0,   0,   123, 34,  97,  116, 116, 110, 48,  34,  58,  123, 34,  100,
      116, 121, 112, 101, 34, 58, 34,  70,  51,  50,  34,  44,  34,  115, 104, 97,  112, 101, 34,  58,
      91,  49,  44,  49,  44, 50, 44,  51,  93,  44,  34,  100, 97,  116, 97,  95,  111, 102, 102, 115,
      101, 116, 115, 34,  58, 91, 48,  44,  50,  52,  93,  125, 125, 32,  32,  32,  32,  32,  32,  32,
      0,   0,   0,   0,   0,  0,  128, 63,  0,   0,   0,   64,  0,   0,   64,  64,  0,   0,   128, 64,
      0,   0,   160, 64};
  EXPECT_EQ(read_file(path), std::string((const char *)want, sizeof want));
  ASSERT_EQ(kiln_checkpoint_save(path.c_str(), 0, nullptr), 0) << kiln_last_error();
  const unsigned char empty[] = {8, 0, 0, 0, 0, 0, 0, 0, 123, 125, 32, 32, 32, 32, 32, 32};
  EXPECT_EQ(read_file(path), std::string((const char *)empty, sizeof empty));
  // and with metadata, which kiln does not write but reads past
  const unsigned char meta[] = {40,  0,   0,   0,   0,   0,   0,   0,   123, 34,  95,  95,  109, 101,
                                116, 97,  100, 97,  116, 97,  95,  95,  34,  58,  123, 34,  102, 114,
                                97,  109, 101, 119, 111, 114, 107, 34,  58,  34,  112, 116, 34,  125,
                                125, 32,  32,  32,  32,  32};
  write_file(path, std::string((const char *)meta, sizeof meta));
  EXPECT_EQ(kiln_checkpoint_restore(path.c_str(), 0, nullptr), 0) << kiln_last_error();
}

TEST(Checkpoint, RestoresHeaderAsHuggingFaceWritesIt) {
  Scoped s;
  Owned own;
  TempDir dir;
  // safetensors.torch.save_file({"w": torch.tensor([1.5, -2.0])}) writes this
  std::string path = dir.file("hf.safetensors");
  write_file(path, st_file(R"({"__metadata__":{"format":"pt"},"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})",
                           le_bytes<float>({1.5f, -2})));
  kiln_variable *w = own.var(kiln_zeros(KILN_F32, KILN_SHAPE(2)), "w");
  ASSERT_EQ(kiln_checkpoint_restore(path.c_str(), 1, &w), 0) << kiln_last_error();
  EXPECT_EQ(f32s(w), (std::vector<float>{1.5f, -2}));
}

TEST(Checkpoint, RestoresAnyJsonSpelling) {
  Scoped s;
  Owned own;
  TempDir dir;
  kiln_variable *w = own.var(kiln_zeros(KILN_F32, KILN_SHAPE(2)), "w");
  kiln_variable *e = own.var(kiln_zeros(KILN_I64, 0, nullptr), "\xc3\xa9t\xc3\xa9 \xf0\x9f\x98\x80");
  const char *headers[] = {
      // Python's json.dumps: spaces after ':' and ','; other key orders
      R"({"w": {"shape": [2], "data_offsets": [0, 8], "dtype": "F32"}, "\u00e9t\u00e9 \ud83d\ude00": {"dtype": "I64", "shape": [], "data_offsets": [8, 16]}})",
      // whitespace everywhere, escapes in keys and names, unknown keys of every JSON type
      "\n{ \"\\u0077\" :\t{\"d\\u0074ype\":\"F32\",\r\n \"shape\":[ 2 ],\"data_offsets\":[0,8],"
      " \"extra\": {\"a\": [1, -2.5e+3, 0.0, true, false, null, \"x\\\"\\\\\\/\\b\\f\\n\\r\\t\"], \"b\": {}}},"
      " \"\\u00e9t\\u00E9 \\ud83d\\ude00\": {\"dtype\":\"I64\",\"shape\":[],\"data_offsets\":[8,16]},"
      " \"__metadata__\": {\"format\": \"pt\", \"note\": \"a \\\"quoted\\\" \\u2603\"} }",
      // metadata last, UTF-8 written raw
      "{\"\xc3\xa9t\xc3\xa9 \xf0\x9f\x98\x80\":{\"dtype\":\"I64\",\"shape\":[],\"data_offsets\":[8,16]},"
      "\"w\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},\"__metadata__\":{}}",
  };
  for (const char *header : headers) {
    std::string path = dir.file("j.safetensors");
    write_file(path, st_file(header, le_bytes<float>({3, 4}) + le_bytes<int64_t>({-5})));
    kiln_variable *both[2] = {w, e};
    ASSERT_EQ(kiln_checkpoint_restore(path.c_str(), 2, both), 0) << kiln_last_error() << "\n" << header;
    EXPECT_EQ(f32s(w), (std::vector<float>{3, 4}));
    EXPECT_EQ(kiln_tensor_item(kiln_variable_read(e)), -5);
    // unpadded headers are fine too
    write_file(path, st_file(header, le_bytes<float>({5, 6}) + le_bytes<int64_t>({7}), false));
    ASSERT_EQ(kiln_checkpoint_restore(path.c_str(), 2, both), 0) << kiln_last_error() << "\n" << header;
    EXPECT_EQ(f32s(w), (std::vector<float>{5, 6}));
  }
}

TEST(Checkpoint, NamesAreEscaped) {
  Scoped s;
  Owned own;
  TempDir dir;
  const char *name = "a\"b\\c\nd\te\x01 \xc3\xa9/\xf0\x9f\x98\x80";
  kiln_variable *v = own.var(f32({7}), name);
  std::string path = dir.file("n.safetensors");
  ASSERT_EQ(kiln_checkpoint_save(path.c_str(), 1, &v), 0) << kiln_last_error();
  std::string file = read_file(path);
  EXPECT_THAT(file, HasSubstr(R"({"a\"b\\c\nd\te\u0001 )" "\xc3\xa9/\xf0\x9f\x98\x80" R"(":{"dtype")"));
  kiln_variable *back = own.var(f32({0}), name);
  ASSERT_EQ(kiln_checkpoint_restore(path.c_str(), 1, &back), 0) << kiln_last_error();
  EXPECT_EQ(f32s(back), (std::vector<float>{7}));
}

TEST(Checkpoint, ExtraTensorsAndUnsupportedDtypesInTheFile) {
  Scoped s;
  Owned own;
  TempDir dir;
  std::string path = dir.file("x.safetensors");
  write_file(path, st_file(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                           R"("x":{"dtype":"U8","shape":[3],"data_offsets":[8,11]},)"
                           R"("q":{"dtype":"F4","shape":[2,3],"data_offsets":[11,14]},)"
                           R"("y":{"dtype":"I16","shape":[1],"data_offsets":[14,16]}})",
                           le_bytes<float>({1, 2}) + std::string(8, '\x01')));
  kiln_variable *w = own.var(kiln_zeros(KILN_F32, KILN_SHAPE(2)), "w");
  ASSERT_EQ(kiln_checkpoint_restore(path.c_str(), 1, &w), 0) << kiln_last_error();
  EXPECT_EQ(f32s(w), (std::vector<float>{1, 2}));
  kiln_variable *x = own.var(kiln_zeros(KILN_I32, KILN_SHAPE(3)), "x");
  EXPECT_EQ(kiln_checkpoint_restore(path.c_str(), 1, &x), -1);
  EXPECT_EQ(kiln_last_error(), "checkpoint_restore: " + path + ": 'x' is U8[3] in the file, the variable is i32(3,)");
  EXPECT_EQ(kiln_checkpoint_restore(path.c_str(), 0, nullptr), 0) << "nothing asked for, the file is valid";
}

TEST(Checkpoint, BoolBytesAreNormalised) {
  Scoped s;
  Owned own;
  TempDir dir;
  std::string path = dir.file("b.safetensors");
  write_file(path, st_file(R"({"m":{"dtype":"BOOL","shape":[3],"data_offsets":[0,3]}})", std::string("\x00\x02\xff", 3)));
  kiln_variable *m = own.var(kiln_zeros(KILN_BOOL, KILN_SHAPE(3)), "m");
  ASSERT_EQ(kiln_checkpoint_restore(path.c_str(), 1, &m), 0) << kiln_last_error();
  EXPECT_EQ(raw(m), std::string("\x00\x01\x01", 3));
}

TEST(Checkpoint, MismatchedVariablesChangeNothing) {
  Scoped s;
  Owned own;
  TempDir dir;
  std::string path = dir.file("m.safetensors");
  kiln_variable *a = own.var(f32({1, 2, 3}), "a");
  kiln_variable *w = own.var(kiln_zeros(KILN_F32, KILN_SHAPE(3)), "w");
  {
    kiln_variable *both[2] = {a, w};
    ASSERT_EQ(kiln_checkpoint_save(path.c_str(), 2, both), 0) << kiln_last_error();
  }
  kiln_variable *a2 = own.var(f32({9, 9, 9}), "a");
  struct Case {
    kiln_variable *other;
    std::string error;
  } cases[] = {
      {own.var(f32({0, 0, 0}), "q"), "checkpoint_restore: no tensor named 'q' in " + path},
      {own.var(kiln_zeros(KILN_F64, KILN_SHAPE(3)), "w"),
       "checkpoint_restore: " + path + ": 'w' is F32[3] in the file, the variable is f64(3,)"},
      {own.var(kiln_zeros(KILN_F32, KILN_SHAPE(2, 3)), "w"),
       "checkpoint_restore: " + path + ": 'w' is F32[3] in the file, the variable is f32(2, 3)"},
      {own.var(kiln_zeros(KILN_F32, 0, nullptr), "w"),
       "checkpoint_restore: " + path + ": 'w' is F32[3] in the file, the variable is f32()"},
  };
  for (auto &c : cases) {
    kiln_variable *both[2] = {a2, c.other};  // a2 alone would restore fine
    EXPECT_EQ(kiln_checkpoint_restore(path.c_str(), 2, both), -1);
    EXPECT_EQ(kiln_last_error(), c.error);
    EXPECT_EQ(f32s(a2), (std::vector<float>{9, 9, 9})) << "a failed restore changed a variable";
  }
  ASSERT_EQ(kiln_checkpoint_restore(path.c_str(), 1, &a2), 0);
  EXPECT_EQ(f32s(a2), (std::vector<float>{1, 2, 3}));
}

TEST(Checkpoint, EveryTruncationFails) {
  Scoped s;
  Owned own;
  TempDir dir;
  uint16_t h[2] = {0x3c00, 0x4000};
  std::vector<kiln_variable *> v = {own.var(f32({1, 2, 3}), "w"),
                                    own.var(kiln_tensor_new(KILN_F16, KILN_SHAPE(2), h), "h"),
                                    own.var(kiln_scalar(KILN_I64, 5), "step")};
  std::string path = dir.file("full.safetensors");
  ASSERT_EQ(kiln_checkpoint_save(path.c_str(), 3, v.data()), 0) << kiln_last_error();
  std::string full = read_file(path);
  std::vector<kiln_variable *> into = {own.var(f32({0, 0, 0}), "w"),
                                       own.var(kiln_zeros(KILN_F16, KILN_SHAPE(2)), "h"),
                                       own.var(kiln_scalar(KILN_I64, 0), "step")};
  std::string cut = dir.file("cut.safetensors");
  for (size_t len = 0; len < full.size(); len++) {
    write_file(cut, full.substr(0, len));
    EXPECT_EQ(kiln_checkpoint_restore(cut.c_str(), 3, into.data()), -1) << len;
    EXPECT_THAT(kiln_last_error(), StartsWith("checkpoint_restore: " + cut + ": ")) << len;
    EXPECT_EQ(kiln_checkpoint_restore(cut.c_str(), 0, nullptr), -1) << len;
  }
  EXPECT_EQ(f32s(into[0]), (std::vector<float>{0, 0, 0}));
  write_file(cut, full.substr(0, 5));
  EXPECT_EQ(kiln_checkpoint_restore(cut.c_str(), 3, into.data()), -1);
  EXPECT_EQ(kiln_last_error(),
            "checkpoint_restore: " + cut + ": truncated: 5 bytes, less than the 8-byte header length");
  write_file(cut, full.substr(0, 20));
  EXPECT_EQ(kiln_checkpoint_restore(cut.c_str(), 3, into.data()), -1);
  EXPECT_THAT(kiln_last_error(), HasSubstr(": truncated: the header is "));
  write_file(cut, full.substr(0, full.size() - 1));
  EXPECT_EQ(kiln_checkpoint_restore(cut.c_str(), 3, into.data()), -1);
  EXPECT_THAT(kiln_last_error(), HasSubstr(": truncated: the header describes 24 bytes of data, the file holds 23"));
  write_file(cut, full + "x");
  EXPECT_EQ(kiln_checkpoint_restore(cut.c_str(), 3, into.data()), -1);
  EXPECT_THAT(kiln_last_error(), HasSubstr(": corrupt: 1 bytes follow the data of the last tensor"));
  ASSERT_EQ(kiln_checkpoint_restore(path.c_str(), 3, into.data()), 0) << kiln_last_error();
  EXPECT_EQ(f32s(into[0]), (std::vector<float>{1, 2, 3}));
}

struct Corrupt {
  std::string header;
  size_t data;        // bytes of data after the header
  std::string error;  // a part of the message
};

TEST(Checkpoint, CorruptHeadersFailCleanly) {
  Scoped s;
  Owned own;
  TempDir dir;
  std::string deep = "{\"__metadata__\":" + std::string(100, '[') + std::string(100, ']') + "}";
  std::string rank9 = R"({"w":{"dtype":"F32","shape":[1,1,1,1,1,1,1,1,1],"data_offsets":[0,4]}})";
  const Corrupt cases[] = {
      {R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]})", 8, "expected ',' or '}', found the end"},
      {R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},})", 8, "expected a string, found '}'"},
      {R"({"w" {"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", 8, "at byte 13: expected ':', found '{'"},
      {R"([{"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}])", 8, "at byte 8: expected '{', found '['"},
      {"", 8, "expected '{', found the end of the header"},
      {"   ", 8, "expected '{', found the end of the header"},
      {R"({"w":5})", 8, "tensor 'w' is not an object"},
      {R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}} x)", 8, "'x' after the end of the header object"},
      {R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}{})", 8, "'{' after the end of the header object"},
      {R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8})", 8, "expected ',' or ']' in the data_offsets"},
      {R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}, "u":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}})", 16, "after the end"},
      // strings
      {R"({"w:{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", 8, "expected ':'"},
      {R"({"w)", 8, "unterminated string"},
      {R"({"w\)", 8, "unterminated string"},
      {R"({"w\q":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", 8, "bad escape '\\q'"},
      {R"({"w\u12":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", 8, "bad \\u escape"},
      {R"({"w\u12G4":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", 8, "bad \\u escape"},
      {R"({"w\ud800":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", 8, "lone surrogate \\ud800"},
      {R"({"w\ud800\u0041":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", 8, "lone surrogate \\ud800"},
      {R"({"w\udc00":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", 8, "lone surrogate \\udc00"},
      {"{\"w\x01\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", 8, "control byte 0x01 in a string"},
      {"{\"w\xff\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", 8, "at byte 11: not UTF-8"},
      {"{\"w\xc0\xb7\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", 8, "not UTF-8"},  // overlong
      {"{\"w\xed\xa0\x80\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", 8, "not UTF-8"},  // surrogate
      {"{\"w\xe2\x82\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", 8, "not UTF-8"},  // cut short
      // dtypes
      {R"({"w":{"dtype":"f32","shape":[2],"data_offsets":[0,8]}})", 8, "tensor 'w' has an unknown dtype \"f32\""},
      {R"({"w":{"dtype":"FLOAT","shape":[2],"data_offsets":[0,8]}})", 8, "unknown dtype \"FLOAT\""},
      {R"({"w":{"dtype":"","shape":[2],"data_offsets":[0,8]}})", 8, "unknown dtype \"\""},
      {R"({"w":{"dtype":32,"shape":[2],"data_offsets":[0,8]}})", 8, "expected a string, found '3'"},
      {R"({"w":{"dtype":"F32","dtype":"F32","shape":[2],"data_offsets":[0,8]}})", 8, "two \"dtype\" keys"},
      {R"({"w":{"shape":[2],"data_offsets":[0,8]}})", 8, "tensor 'w' has no \"dtype\""},
      {R"({"w":{"dtype":"F32","data_offsets":[0,8]}})", 8, "tensor 'w' has no \"shape\""},
      {R"({"w":{"dtype":"F32","shape":[2]}})", 8, "tensor 'w' has no \"data_offsets\""},
      {R"({"w":{}})", 8, "tensor 'w' has no \"dtype\""},
      {R"({"w":{"dtype":"F4","shape":[3],"data_offsets":[0,1]}})", 1, "is not a whole number of bytes"},
      // shapes
      {R"({"w":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", 8, "a dimension of tensor 'w' is negative"},
      {R"({"w":{"dtype":"F32","shape":[2.0],"data_offsets":[0,8]}})", 8, "a dimension of tensor 'w' is not an integer"},
      {R"({"w":{"dtype":"F32","shape":[1e3],"data_offsets":[0,8]}})", 8, "is not an integer"},
      {R"({"w":{"dtype":"F32","shape":["2"],"data_offsets":[0,8]}})", 8, "expected a dimension of tensor 'w' (an integer), found '\"'"},
      {R"({"w":{"dtype":"F32","shape":[02],"data_offsets":[0,8]}})", 8, "has a leading zero"},
      {R"({"w":{"dtype":"F32","shape":[2,],"data_offsets":[0,8]}})", 8, "expected a dimension of tensor 'w' (an integer), found ']'"},
      {R"({"w":{"dtype":"F32","shape":2,"data_offsets":[0,8]}})", 8, "expected '[', found '2'"},
      {R"({"w":{"dtype":"F32","shape":[99999999999999999999],"data_offsets":[0,8]}})", 8, "is too large"},
      {R"({"w":{"dtype":"F32","shape":[9223372036854775808],"data_offsets":[0,8]}})", 8, "is too large"},
      {R"({"w":{"dtype":"F32","shape":[4611686018427387904,4],"data_offsets":[0,8]}})", 8, "tensor 'w' has a shape whose size overflows"},
      {R"({"w":{"dtype":"F64","shape":[2305843009213693952],"data_offsets":[0,8]}})", 8, "tensor 'w' is too large"},
      {rank9, 4, "the shape of tensor 'w' has more than 8 entries"},
      // offsets
      {R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,12]}})", 12, "'w' is F32[2] (8 bytes) but its data_offsets [0, 12] hold another size"},
      {R"({"w":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", 8, "'w' is F32[3] (12 bytes) but its data_offsets [0, 8]"},
      {R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}})", 8, "hold a negative size"},
      {R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}})", 8, "8 unused bytes before the data of tensor 'w'"},
      {R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"u":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}})", 8,
       "truncated: the header describes 16 bytes of data, the file holds 8"},
      {R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"u":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})", 12,
       "the data of tensor 'u' overlaps the tensor before it"},
      {R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"u":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", 8,
       "overlaps"},
      {R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"w":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}})", 16,
       "two tensors are named 'w'"},
      {R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0]}})", 8, "the data_offsets of tensor 'w' need 2 entries, not 1"},
      {R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8,8]}})", 8, "the data_offsets of tensor 'w' has more than 2 entries"},
      {R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[-1,7]}})", 8, "a data offset of tensor 'w' is negative"},
      {R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,18446744073709551616]}})", 8, "is too large"},
      {R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", 12, "4 bytes follow the data of the last tensor"},
      // unknown values
      {deep, 0, "nested more than 64 deep"},
      {R"({"__metadata__":{"a":tru},"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", 8, "expected a value, found 't'"},
      {R"({"__metadata__":{"a":-},"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", 8, "malformed number"},
      {R"({"__metadata__":{"a":1.},"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", 8, "malformed number"},
      {R"({"__metadata__":{"a":[1 2]},"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", 8, "expected ',' or ']', found '2'"},
      {R"({"__metadata__":{1:2},"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", 8, "expected a string, found '1'"},
      {R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"x":}})", 8, "expected a value, found '}'"},
  };
  kiln_variable *w = own.var(f32({5, 6}), "w");
  std::string path = dir.file("c.safetensors");
  for (const Corrupt &c : cases) {
    write_file(path, st_file(c.header, std::string(c.data, '\x01')));
    EXPECT_EQ(kiln_checkpoint_restore(path.c_str(), 1, &w), -1) << c.header;
    EXPECT_THAT(kiln_last_error(), StartsWith("checkpoint_restore: " + path + ": ")) << c.header;
    EXPECT_THAT(kiln_last_error(), HasSubstr(c.error)) << c.header;
  }
  // one message in full
  write_file(path, st_file(R"({"w" {"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", std::string(8, '\0')));
  EXPECT_EQ(kiln_checkpoint_restore(path.c_str(), 1, &w), -1);
  EXPECT_EQ(kiln_last_error(), "checkpoint_restore: " + path + ": corrupt header at byte 13: expected ':', found '{'");
  // padding must be whitespace: NUL bytes are not
  write_file(path, u64le(56) + kW + std::string(1, '\0') + std::string(8, '\0'));
  EXPECT_EQ(kiln_checkpoint_restore(path.c_str(), 1, &w), -1);
  EXPECT_THAT(kiln_last_error(), HasSubstr("byte 0x00 after the end of the header object"));
  EXPECT_EQ(f32s(w), (std::vector<float>{5, 6})) << "a failed restore changed the variable";
}

TEST(Checkpoint, HeaderLengthField) {
  Scoped s;
  Owned own;
  TempDir dir;
  kiln_variable *w = own.var(f32({5, 6}), "w");
  std::string path = dir.file("h.safetensors");
  std::string body = padded(kW) + std::string(8, '\0');
  struct {
    uint64_t len;
    std::string error;
  } cases[] = {
      {UINT64_MAX, "corrupt: the header length 18446744073709551615 is over the limit of 100000000 bytes"},
      {100000001, "corrupt: the header length 100000001 is over the limit"},
      {100000000, "truncated: the header is 100000000 bytes, only 64 follow its length"},
      {65, "truncated: the header is 65 bytes, only 64 follow its length"},
      {64, "after the end of the header object"},  // the data read as header
      {50, "corrupt header at byte 58: expected a data offset of tensor 'w'"},  // cut inside
      {0, "expected '{', found the end of the header"},
  };
  for (auto &c : cases) {
    write_file(path, u64le(c.len) + body);
    EXPECT_EQ(kiln_checkpoint_restore(path.c_str(), 1, &w), -1) << c.len;
    EXPECT_THAT(kiln_last_error(), HasSubstr(c.error)) << c.len;
  }
  write_file(path, u64le(56) + body);
  EXPECT_EQ(kiln_checkpoint_restore(path.c_str(), 1, &w), 0) << kiln_last_error();
}

TEST(Checkpoint, UnreadablePaths) {
  Scoped s;
  Owned own;
  TempDir dir;
  kiln_variable *w = own.var(f32({5, 6}), "w");
  std::string missing = dir.file("missing.safetensors");
  EXPECT_EQ(kiln_checkpoint_restore(missing.c_str(), 1, &w), -1);
  EXPECT_EQ(kiln_last_error(), "checkpoint_restore: " + missing + ": cannot open: No such file or directory");
  EXPECT_EQ(kiln_checkpoint_restore(dir.path.c_str(), 1, &w), -1);
  EXPECT_EQ(kiln_last_error(), "checkpoint_restore: " + dir.path + ": not a regular file");
  std::string fifo = dir.file("fifo");
  ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0);
  EXPECT_EQ(kiln_checkpoint_restore(fifo.c_str(), 1, &w), -1) << "and it did not wait for a writer";
  EXPECT_EQ(kiln_last_error(), "checkpoint_restore: " + fifo + ": not a regular file");
  EXPECT_EQ(kiln_checkpoint_restore("/dev/null", 1, &w), -1);
  EXPECT_STREQ(kiln_last_error(), "checkpoint_restore: /dev/null: not a regular file");
  EXPECT_EQ(kiln_checkpoint_restore(nullptr, 1, &w), -1);
  EXPECT_STREQ(kiln_last_error(), "checkpoint_restore: path is NULL");
  std::string ok = dir.file("ok.safetensors");
  write_file(ok, st_file(kW, std::string(8, '\0')));
  EXPECT_EQ(kiln_checkpoint_restore(ok.c_str(), -1, &w), -1);
  EXPECT_STREQ(kiln_last_error(), "checkpoint_restore: n = -1 is negative");
  EXPECT_EQ(kiln_checkpoint_restore(ok.c_str(), 1, nullptr), -1);
  EXPECT_STREQ(kiln_last_error(), "checkpoint_restore: vars is NULL");
  kiln_variable *two[2] = {w, nullptr};
  EXPECT_EQ(kiln_checkpoint_restore(ok.c_str(), 2, two), -1);
  EXPECT_STREQ(kiln_last_error(), "checkpoint_restore: vars[1] is NULL");
  if (geteuid() != 0) {  // root reads anything
    ASSERT_EQ(chmod(ok.c_str(), 0), 0);
    EXPECT_EQ(kiln_checkpoint_restore(ok.c_str(), 1, &w), -1);
    EXPECT_EQ(kiln_last_error(), "checkpoint_restore: " + ok + ": cannot open: Permission denied");
  }
  EXPECT_EQ(f32s(w), (std::vector<float>{5, 6}));
}

// A save renames a new file over its path, which would swap whatever is
// there for a regular file: run as root, it replaced /dev/null. Only a
// regular file (or nothing) is replaced; a FIFO, a directory, a device or a
// symbolic link (even to a regular file: the link is not the checkpoint) is
// an error that names the path and leaves it as it was.
TEST(Checkpoint, SaveReplacesOnlyARegularFile) {
  Scoped s;
  Owned own;
  TempDir dir;
  kiln_variable *w = own.var(f32({1, 2}), "w");
  auto refused = [&](const std::string &path, const char *kind) {
    EXPECT_EQ(kiln_checkpoint_save(path.c_str(), 1, &w), -1) << path;
    EXPECT_EQ(kiln_last_error(), "checkpoint_save: " + path + " is not a regular file (" + kind +
                                     "); a save replaces only a regular file");
  };
  std::string fifo = dir.file("fifo");
  ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0);
  refused(fifo, "a FIFO");
  std::string sub = dir.file("sub");
  ASSERT_EQ(mkdir(sub.c_str(), 0700), 0);
  refused(sub, "a directory");
  std::string null_link = dir.file("null.safetensors");
  ASSERT_EQ(symlink("/dev/null", null_link.c_str()), 0);
  refused(null_link, "a symbolic link");
  refused("/dev/null", "a character device");
  std::string target = dir.file("target.safetensors"), link = dir.file("link.safetensors");
  write_file(target, "not a checkpoint");
  ASSERT_EQ(symlink(target.c_str(), link.c_str()), 0);
  refused(link, "a symbolic link");
  struct stat st;
  ASSERT_EQ(lstat(fifo.c_str(), &st), 0);
  EXPECT_TRUE(S_ISFIFO(st.st_mode));
  ASSERT_EQ(lstat(null_link.c_str(), &st), 0);
  EXPECT_TRUE(S_ISLNK(st.st_mode));
  ASSERT_EQ(stat("/dev/null", &st), 0);
  EXPECT_TRUE(S_ISCHR(st.st_mode));
  std::ifstream in(target);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_EQ(text, "not a checkpoint");
  // no temporary file left behind
  int n = 0;
  for (const auto &e : fs::directory_iterator(dir.path)) n += e.path().filename().string().find(".tmp-") != std::string::npos;
  EXPECT_EQ(n, 0);
  // a regular file is replaced, and a missing one made
  std::string plain = dir.file("plain.safetensors");
  write_file(plain, "old");
  EXPECT_EQ(kiln_checkpoint_save(plain.c_str(), 1, &w), 0) << kiln_last_error();
  EXPECT_EQ(kiln_checkpoint_save(dir.file("new.safetensors").c_str(), 1, &w), 0) << kiln_last_error();
  kiln_variable *back = own.var(f32({0, 0}), "w");
  EXPECT_EQ(kiln_checkpoint_restore(plain.c_str(), 1, &back), 0) << kiln_last_error();
  EXPECT_EQ(f32s(back), (std::vector<float>{1, 2}));
}

TEST(Checkpoint, SaveErrors) {
  Scoped s;
  Owned own;
  TempDir dir;
  kiln_variable *w = own.var(f32({1, 2}), "w");
  kiln_variable *w2 = own.var(f32({3}), "w");
  kiln_variable *u = own.var(f32({4}), "u");

  std::string nodir = dir.file("no/such/dir/w.safetensors");
  EXPECT_EQ(kiln_checkpoint_save(nodir.c_str(), 1, &w), -1);
  EXPECT_EQ(kiln_last_error(), "checkpoint_save: " + nodir + ": cannot create a file there: No such file or directory");
  std::string file = dir.file("plain");
  write_file(file, "x");
  std::string under = file + "/w.safetensors";
  EXPECT_EQ(kiln_checkpoint_save(under.c_str(), 1, &w), -1);
  EXPECT_EQ(kiln_last_error(), "checkpoint_save: " + under + ": cannot create a file there: Not a directory");
  EXPECT_EQ(kiln_checkpoint_save("/proc/kiln_checkpoint_test.safetensors", 1, &w), -1);
  EXPECT_THAT(kiln_last_error(), StartsWith("checkpoint_save: /proc/kiln_checkpoint_test.safetensors: cannot create"));
  fs::create_directory(dir.file("sub"));
  EXPECT_EQ(kiln_checkpoint_save(dir.file("sub").c_str(), 1, &w), -1);
  EXPECT_EQ(kiln_last_error(), "checkpoint_save: " + dir.file("sub") +
                                   " is not a regular file (a directory); a save replaces only a regular file");
  if (geteuid() != 0) {  // root writes anywhere
    fs::create_directory(dir.file("ro"));
    chmod(dir.file("ro").c_str(), 0500);
    EXPECT_EQ(kiln_checkpoint_save(dir.file("ro/w.safetensors").c_str(), 1, &w), -1);
    EXPECT_THAT(kiln_last_error(), HasSubstr("Permission denied"));
    chmod(dir.file("ro").c_str(), 0700);
  }

  // argument errors leave an existing checkpoint as it was
  std::string path = dir.file("keep.safetensors");
  ASSERT_EQ(kiln_checkpoint_save(path.c_str(), 1, &w), 0) << kiln_last_error();
  std::string before = read_file(path);
  kiln_variable *dup[3] = {w, u, w2};
  EXPECT_EQ(kiln_checkpoint_save(path.c_str(), 3, dup), -1);
  EXPECT_STREQ(kiln_last_error(), "checkpoint_save: vars[0] and vars[2] are both named 'w'");
  kiln_variable *same[2] = {u, u};
  EXPECT_EQ(kiln_checkpoint_save(path.c_str(), 2, same), -1);
  EXPECT_STREQ(kiln_last_error(), "checkpoint_save: vars[0] and vars[1] are both named 'u'");
  kiln_variable *meta = own.var(f32({1}), "__metadata__");
  EXPECT_EQ(kiln_checkpoint_save(path.c_str(), 1, &meta), -1);
  EXPECT_STREQ(kiln_last_error(), "checkpoint_save: vars[0] is named '__metadata__', which the format reserves");
  kiln_variable *bad_utf8 = own.var(f32({1}), "w\xff");
  EXPECT_EQ(kiln_checkpoint_save(path.c_str(), 1, &bad_utf8), -1);
  EXPECT_STREQ(kiln_last_error(), "checkpoint_save: the name of vars[0] is not UTF-8");
  EXPECT_EQ(kiln_checkpoint_save(nullptr, 1, &w), -1);
  EXPECT_STREQ(kiln_last_error(), "checkpoint_save: path is NULL");
  EXPECT_EQ(kiln_checkpoint_save("", 1, &w), -1);
  EXPECT_STREQ(kiln_last_error(), "checkpoint_save: path is empty");
  EXPECT_EQ(kiln_checkpoint_save(path.c_str(), -2, &w), -1);
  EXPECT_STREQ(kiln_last_error(), "checkpoint_save: n = -2 is negative");
  EXPECT_EQ(kiln_checkpoint_save(path.c_str(), 1, nullptr), -1);
  EXPECT_STREQ(kiln_last_error(), "checkpoint_save: vars is NULL");
  kiln_variable *null_var[2] = {w, nullptr};
  EXPECT_EQ(kiln_checkpoint_save(path.c_str(), 2, null_var), -1);
  EXPECT_STREQ(kiln_last_error(), "checkpoint_save: vars[1] is NULL");
  EXPECT_EQ(read_file(path), before);
  std::vector<std::string> names = dir.entries();
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"keep.safetensors", "plain", "sub"})) << "temporary files were left";

  // an empty checkpoint is valid, and saving replaces the old file
  ASSERT_EQ(kiln_checkpoint_save(path.c_str(), 0, nullptr), 0) << kiln_last_error();
  EXPECT_EQ(read_file(path), u64le(8) + "{}      ");
  EXPECT_EQ(kiln_checkpoint_restore(path.c_str(), 1, &w), -1);
  EXPECT_EQ(kiln_last_error(), "checkpoint_restore: no tensor named 'w' in " + path);
}

TEST(Checkpoint, TrainSaveRestore) {
  Scoped s;
  Owned own;
  TempDir dir;
  kiln_variable *w = own.var(f32({0, 0}), "layer/w");
  kiln_variable *b = own.var(kiln_scalar(KILN_F64, 0), "layer/b");
  kiln_optimizer *o = kiln_adam_new(0.1, 0.9, 0.999, 1e-8);
  ASSERT_NE(o, nullptr);
  for (int i = 0; i < 5; i++) {
    kiln_scope_push();
    kiln_variable *both[2] = {w, b};
    kiln_tensor *g[2] = {f32({1, -1}), kiln_scalar(KILN_F64, 2)};
    ASSERT_EQ(kiln_optimizer_apply(o, 2, both, g), 0) << kiln_last_error();
    kiln_scope_pop();
  }
  kiln_optimizer_free(o);
  std::string path = dir.file("model.safetensors");
  kiln_variable *both[2] = {w, b};
  ASSERT_EQ(kiln_checkpoint_save(path.c_str(), 2, both), 0) << kiln_last_error();
  kiln_variable *w2 = own.var(f32({9, 9}), "layer/w");
  kiln_variable *b2 = own.var(kiln_scalar(KILN_F64, 9), "layer/b");
  kiln_variable *both2[2] = {b2, w2};
  ASSERT_EQ(kiln_checkpoint_restore(path.c_str(), 2, both2), 0) << kiln_last_error();
  EXPECT_EQ(raw(w2), raw(w));
  EXPECT_EQ(raw(b2), raw(b));
}

// An independent writer and reader of the format in Python's standard
// library (struct + json).
TEST(Checkpoint, InteropWithIndependentPythonCode) {
  ASSERT_EQ(std::system("python3 -c 'import json, struct' >/dev/null 2>&1"), 0)
      << "python3 is needed (scripts/setup.sh installs it)";
  Scoped s;
  Owned own;
  TempDir dir;
  const char *script = R"PY(
import json, struct, sys

def bf16(x):  # the top half of the f32 (exact for these values)
    return struct.pack('<I', struct.unpack('<I', struct.pack('<f', x))[0])[2:]

TENSORS = {  # name: (dtype, shape, bytes); not in sorted order
    'weight': ('F32', [2, 2], struct.pack('<4f', 1.5, -2.0, 0.25, 1e-3)),
    'bias': ('F64', [3], struct.pack('<3d', 0.1, -0.2, 1e300)),
    'count': ('I64', [], struct.pack('<q', -(2 ** 40))),
    'idx': ('I32', [2], struct.pack('<2i', -7, 2 ** 31 - 1)),
    'mask': ('BOOL', [3], bytes([1, 0, 1])),
    'half': ('F16', [2], struct.pack('<2e', 0.5, -65504.0)),
    'brain': ('BF16', [2], bf16(1.5) + bf16(-3.140625)),
    'extra': ('U8', [4], bytes([1, 2, 3, 4])),
    'caf\u00e9': ('F32', [1], struct.pack('<f', 42.0)),
}

def write(path):
    header, data = {'__metadata__': {'format': 'pt'}}, b''
    for name, (dtype, shape, raw) in TENSORS.items():
        header[name] = {'dtype': dtype, 'shape': shape, 'data_offsets': [len(data), len(data) + len(raw)]}
        data += raw
    h = json.dumps(header).encode()  # ASCII with \u escapes, spaces after ':' and ','
    h += b' ' * (-len(h) % 8)
    open(path, 'wb').write(struct.pack('<Q', len(h)) + h + data)

def read(path):
    blob = open(path, 'rb').read()
    (n,) = struct.unpack('<Q', blob[:8])
    assert (8 + n) % 8 == 0, 'data is not 8-aligned'
    header = json.loads(blob[8:8 + n].decode('utf-8'))
    data = blob[8 + n:]
    spans = sorted(tuple(v['data_offsets']) for k, v in header.items() if k != '__metadata__')
    assert spans[0][0] == 0 and spans[-1][1] == len(data), spans
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:])), spans
    for name, (dtype, shape, raw) in TENSORS.items():
        if name == 'extra':
            assert name not in header
            continue
        t = header[name]
        assert t['dtype'] == dtype and t['shape'] == shape, (name, t)
        b, e = t['data_offsets']
        assert data[b:e] == raw, (name, data[b:e], raw)
        size = {'F64': 8, 'I64': 8, 'F32': 4, 'I32': 4, 'F16': 2, 'BF16': 2, 'BOOL': 1}[dtype]
        assert b % size == 0, (name, 'misaligned')
    print('ok')

write(sys.argv[1]) if sys.argv[2] == 'write' else read(sys.argv[1])
)PY";
  std::string py = dir.file("st.py"), from_py = dir.file("from_python.safetensors"),
              from_kiln = dir.file("from_kiln.safetensors");
  write_file(py, script);
  ASSERT_EQ(std::system(("python3 " + py + " " + from_py + " write").c_str()), 0);

  std::vector<kiln_variable *> v = {
      own.var(kiln_zeros(KILN_F32, KILN_SHAPE(2, 2)), "weight"), own.var(kiln_zeros(KILN_F64, KILN_SHAPE(3)), "bias"),
      own.var(kiln_zeros(KILN_I64, 0, nullptr), "count"),       own.var(kiln_zeros(KILN_I32, KILN_SHAPE(2)), "idx"),
      own.var(kiln_zeros(KILN_BOOL, KILN_SHAPE(3)), "mask"),     own.var(kiln_zeros(KILN_F16, KILN_SHAPE(2)), "half"),
      own.var(kiln_zeros(KILN_BF16, KILN_SHAPE(2)), "brain"),    own.var(kiln_zeros(KILN_F32, KILN_SHAPE(1)), "caf\xc3\xa9"),
  };
  ASSERT_EQ(kiln_checkpoint_restore(from_py.c_str(), (int)v.size(), v.data()), 0) << kiln_last_error();
  EXPECT_EQ(f32s(v[0]), (std::vector<float>{1.5f, -2, 0.25f, 1e-3f}));
  EXPECT_EQ(raw(v[1]), le_bytes<double>({0.1, -0.2, 1e300}));
  EXPECT_EQ(raw(v[2]), le_bytes<int64_t>({-(INT64_C(1) << 40)}));
  EXPECT_EQ(raw(v[3]), le_bytes<int32_t>({-7, INT32_MAX}));
  EXPECT_EQ(raw(v[4]), std::string("\x01\x00\x01", 3));
  EXPECT_EQ(raw(v[5]), le_bytes<uint16_t>({0x3800, 0xfbff}));  // 0.5, -65504 in IEEE half
  EXPECT_EQ(raw(v[6]), le_bytes<uint16_t>({0x3fc0, 0xc049}));  // 1.5, -3.140625 in bfloat16
  EXPECT_EQ(f32s(v[7]), (std::vector<float>{42}));

  ASSERT_EQ(kiln_checkpoint_save(from_kiln.c_str(), (int)v.size(), v.data()), 0) << kiln_last_error();
  FILE *p = popen(("python3 " + py + " " + from_kiln + " read 2>&1").c_str(), "r");
  ASSERT_NE(p, nullptr);
  char out[4096] = {0};
  size_t got = fread(out, 1, sizeof out - 1, p);
  out[got] = '\0';
  EXPECT_EQ(pclose(p), 0) << out;
  EXPECT_STREQ(out, "ok\n");
}

// A deterministic mini-fuzz: thousands of random mutations of a valid file
// (bit flips, truncations, random and JSON-ish header bytes, spliced spans,
// header length changes). Restore must fail cleanly or succeed; never crash,
// read out of bounds or leak (the sanitizer build runs this too).
TEST(Checkpoint, MiniFuzz) {
  Scoped s;
  Owned own;
  TempDir dir;
  uint16_t h[3] = {0x3c00, 0x4000, 0xbc00};
  uint8_t m[2] = {1, 0};
  double w[6] = {1, 2, 3, 4, 5, 6};
  std::vector<kiln_variable *> v = {
      own.var(kiln_tensor_new(KILN_F64, KILN_SHAPE(2, 3), w), "w"), own.var(kiln_scalar(KILN_I64, 7), "step"),
      own.var(kiln_tensor_new(KILN_F16, KILN_SHAPE(3), h), "h"),    own.var(kiln_tensor_new(KILN_BOOL, KILN_SHAPE(2), m), "m"),
      own.var(kiln_zeros(KILN_F32, KILN_SHAPE(0)), "e"),
  };
  std::string good = dir.file("good.safetensors"), bad = dir.file("bad.safetensors");
  ASSERT_EQ(kiln_checkpoint_save(good.c_str(), (int)v.size(), v.data()), 0) << kiln_last_error();
  const std::string valid = read_file(good);
  size_t header_end = 8;
  for (int i = 0; i < 8; i++) header_end += (size_t)(uint8_t)valid[i] << (8 * i);

  uint64_t state = 0x9e3779b97f4a7c15ull;
  auto next = [&]() {  // xorshift64*
    state ^= state >> 12;
    state ^= state << 25;
    state ^= state >> 27;
    return state * 0x2545f4914f6cdd1dull;
  };
  auto below = [&](size_t n) { return n ? (size_t)(next() % n) : 0; };
  const std::string json_bytes = "{}[]\":,0123456789-.eE \\u\tFI";
  int ok = 0, failed = 0;
  for (int iter = 0; iter < 4000; iter++) {
    std::string f = valid;
    int mutations = 1 + (int)below(3);
    for (int k = 0; k < mutations; k++) {
      switch (below(8)) {
      case 0:  // flip a bit anywhere
        if (!f.empty()) f[below(f.size())] ^= (char)(1 << below(8));
        break;
      case 1:  // a random byte in the header
        if (f.size() > 8) f[8 + below(std::min(f.size(), header_end) - 8)] = (char)below(256);
        break;
      case 2:  // a JSON-significant byte in the header
        if (f.size() > 8) f[8 + below(std::min(f.size(), header_end) - 8)] = json_bytes[below(json_bytes.size())];
        break;
      case 3:  // truncate
        f.resize(below(f.size() + 1));
        break;
      case 4:  // insert random bytes
        f.insert(below(f.size() + 1), std::string(1 + below(4), (char)below(256)));
        break;
      case 5: {  // delete a span
        size_t at = below(f.size() + 1);
        f.erase(at, below(8));
        break;
      }
      case 6: {  // duplicate a span of the header
        size_t at = below(std::min(f.size(), header_end) + 1);
        f.insert(below(f.size() + 1), f.substr(at, below(24)));
        break;
      }
      case 7: {  // change the header length
        uint64_t len = 0;
        for (int i = 0; i < 8 && i < (int)f.size(); i++) len |= (uint64_t)(uint8_t)f[i] << (8 * i);
        uint64_t choices[] = {len + 1, len - 1, len + 8, len - 8, next(), next() & 0xffff, 0};
        std::string le = u64le(choices[below(7)]);
        for (int i = 0; i < 8 && i < (int)f.size(); i++) f[i] = le[i];
        break;
      }
      }
    }
    write_file(bad, f);
    int rc = kiln_checkpoint_restore(bad.c_str(), (int)v.size(), v.data());
    if (rc == 0) {
      ok++;
    } else {
      ASSERT_EQ(rc, -1);
      ASSERT_THAT(kiln_last_error(), StartsWith("checkpoint_restore: ")) << iter;
      failed++;
    }
  }
  EXPECT_GT(failed, 2000);
  EXPECT_GT(ok, 0) << "some mutations (in the data) must still restore";
  // the variables still have their dtypes and shapes, and the valid file restores
  ASSERT_EQ(kiln_checkpoint_restore(good.c_str(), (int)v.size(), v.data()), 0) << kiln_last_error();
  EXPECT_EQ(raw(v[0]), le_bytes<double>({1, 2, 3, 4, 5, 6}));
}

}  // namespace
