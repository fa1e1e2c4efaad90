// Tests for common/safetensors.h: one test per malformed-file check (asserting the exact reason and the
// file/tensor named), writer -> reader round trips, sharded checkpoint directories, and the real checkpoints
// in shared/data.
#include "common/safetensors.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>

#include "common/error.h"
#include "tests/fifo_util.h"
#include "tests/test_util.h"

namespace spade {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using ::testing::HasSubstr;

class SafetensorsTest : public ::testing::Test {
 protected:
  void SetUp() override { dir_ = test::make_temp_dir("spade_st_"); }
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }

  // Writes raw bytes to <tmp>/<name> and returns the path.
  std::string write_bytes(const std::string& bytes, const std::string& name = "model.safetensors") {
    const std::string p = dir_ + "/" + name;
    std::ofstream f(p, std::ios::binary | std::ios::trunc);
    f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    EXPECT_TRUE(f.good()) << p;
    return p;
  }

  // A file with an explicit header-length prefix, the header text and `data_size` zero bytes of data.
  std::string write_with_len(uint64_t header_len, const std::string& header, size_t data_size) {
    std::string b(8, '\0');
    std::memcpy(b.data(), &header_len, 8);
    b += header;
    b.append(data_size, '\0');
    return write_bytes(b);
  }

  // A well-formed prefix for `header`, followed by `data_size` zero bytes.
  std::string write_header(const std::string& header, size_t data_size) {
    return write_with_len(header.size(), header, data_size);
  }

  // The spade::Error message of opening `path`; fails the test when it opens.
  static std::string open_error(const std::string& path) {
    try {
      SafetensorsFile::open(path);
    } catch (const Error& e) {
      return e.what();
    }
    ADD_FAILURE() << "expected SafetensorsFile::open('" << path << "') to throw";
    return {};
  }

  // The error message of opening a file whose header is `header` with `data_size` data bytes; checks the
  // message starts with the file path.
  std::string header_error(const std::string& header, size_t data_size = 24) {
    const std::string p = write_header(header, data_size);
    const std::string msg = open_error(p);
    EXPECT_EQ(msg.rfind(p + ": ", 0), 0u) << "message does not start with the path: " << msg;
    return msg;
  }

  std::string dir_;
};

// ---- malformed files
// ------------------------------------------------------------------------------------------------

TEST_F(SafetensorsTest, FileShorterThan8Bytes) {
  const std::string p = write_bytes("abcde");
  EXPECT_EQ(open_error(p), p + ": file is 5 bytes, shorter than the 8-byte header length prefix");
}

TEST_F(SafetensorsTest, EmptyFile) {
  const std::string p = write_bytes("");
  EXPECT_EQ(open_error(p), p + ": file is 0 bytes, shorter than the 8-byte header length prefix");
}

TEST_F(SafetensorsTest, MissingFile) {
  const std::string p = dir_ + "/nope.safetensors";
  EXPECT_THAT(open_error(p), HasSubstr(p + ": cannot open a safetensors file: No such file or directory"));
}

TEST_F(SafetensorsTest, DirectoryIsNotAFile) {
  EXPECT_EQ(open_error(dir_), dir_ + ": not a regular file (a directory); a safetensors file must be a regular file");
}

// A FIFO named model.safetensors blocked open(2) forever (no writer); now it is refused at once, by the file and by
// the checkpoint directory.
TEST_F(SafetensorsTest, FifoIsRefusedWithoutBlocking) {
  const std::string p = dir_ + "/model.safetensors";
  test::make_fifo(p);
  const std::string want = p + ": not a regular file (a FIFO); a safetensors file must be a regular file";
  EXPECT_EQ(test::error_within([p] { SafetensorsFile::open(p); }, p), want);
  const std::string d = dir_;
  EXPECT_EQ(test::error_within([d] { Checkpoint::open_dir(d); }, p), want);
}

// A link to a character device (endless zeros) is refused; a link to a regular file (the Hugging Face cache layout)
// is followed.
TEST_F(SafetensorsTest, SymlinksAreFollowedToRegularFilesOnly) {
  const std::string p = dir_ + "/model.safetensors";
  fs::create_symlink("/dev/zero", p);
  EXPECT_EQ(open_error(p), p + ": not a regular file (a character device); a safetensors file must be a regular file");
  fs::remove(p);
  const std::string blob = dir_ + "/blob";
  write_safetensors(blob, {{"w", DType::F32, {2}, std::vector<uint8_t>(8, 0)}});
  fs::create_symlink(blob, p);
  EXPECT_EQ(Checkpoint::open_dir(dir_).get("w").shape, (std::vector<int64_t>{2}));
}

TEST_F(SafetensorsTest, HeaderLengthZero) {
  const std::string p = write_with_len(0, "", 16);
  EXPECT_EQ(open_error(p), p + ": header length is 0");
}

TEST_F(SafetensorsTest, HeaderLengthOverLimit) {
  const std::string p = write_with_len(kSafetensorsMaxHeaderBytes + 1, "{}", 0);
  EXPECT_EQ(open_error(p), p + ": header length 100000001 exceeds the 100000000-byte limit");
}

TEST_F(SafetensorsTest, HeaderLengthPastEndOfFile) {
  const std::string p = write_with_len(64, "{}", 8);  // 10 bytes after the prefix
  EXPECT_EQ(open_error(p),
            p + ": header length 64 runs past the end of the file (10 bytes follow the 8-byte prefix)");
}

TEST_F(SafetensorsTest, HeaderNotJson) {
  EXPECT_THAT(header_error("{\"a\": {\"dtype\": "), HasSubstr(": header is not valid JSON: "));
}

TEST_F(SafetensorsTest, HeaderInvalidUtf8) {
  EXPECT_THAT(header_error("{\"a\xff\": {}}"), HasSubstr(": header is not valid JSON: "));
}

TEST_F(SafetensorsTest, HeaderNotObject) {
  EXPECT_THAT(header_error("[1, 2]"), HasSubstr(": header is a JSON array, expected an object"));
}

TEST_F(SafetensorsTest, DuplicateTensorName) {
  const std::string h =
      R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
          "a": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}})";
  EXPECT_THAT(header_error(h), HasSubstr(": tensor name 'a' appears twice in the header"));
}

TEST_F(SafetensorsTest, EntryNotObject) {
  EXPECT_THAT(
      header_error(R"({"a": 3})"),
      HasSubstr(": tensor 'a': entry is number 3, expected an object with dtype, shape and data_offsets"));
}

TEST_F(SafetensorsTest, EntryMissingDtype) {
  EXPECT_THAT(header_error(R"({"a": {"shape": [6], "data_offsets": [0, 24]}})"),
              HasSubstr(": tensor 'a': missing \"dtype\""));
}

TEST_F(SafetensorsTest, EntryMissingShape) {
  EXPECT_THAT(header_error(R"({"a": {"dtype": "F32", "data_offsets": [0, 24]}})"),
              HasSubstr(": tensor 'a': missing \"shape\""));
}

TEST_F(SafetensorsTest, EntryMissingDataOffsets) {
  EXPECT_THAT(header_error(R"({"a": {"dtype": "F32", "shape": [6]}})"),
              HasSubstr(": tensor 'a': missing \"data_offsets\""));
}

TEST_F(SafetensorsTest, DtypeNotString) {
  EXPECT_THAT(header_error(R"({"a": {"dtype": 5, "shape": [6], "data_offsets": [0, 24]}})"),
              HasSubstr(": tensor 'a': \"dtype\" is number 5, expected a string"));
}

TEST_F(SafetensorsTest, ShapeNotArray) {
  EXPECT_THAT(header_error(R"({"a": {"dtype": "F32", "shape": "2x3", "data_offsets": [0, 24]}})"),
              HasSubstr(": tensor 'a': \"shape\" is string \"2x3\", expected an array of integers"));
}

TEST_F(SafetensorsTest, ShapeElementNotInteger) {
  EXPECT_THAT(header_error(R"({"a": {"dtype": "F32", "shape": [2, 3.5], "data_offsets": [0, 24]}})"),
              HasSubstr(": tensor 'a': shape[1] is number 3.5, expected an integer"));
}

TEST_F(SafetensorsTest, DataOffsetsNotPair) {
  EXPECT_THAT(header_error(R"({"a": {"dtype": "F32", "shape": [6], "data_offsets": [0]}})"),
              HasSubstr(": tensor 'a': \"data_offsets\" is array [0], expected [begin, end]"));
}

TEST_F(SafetensorsTest, DataOffsetNotInteger) {
  EXPECT_THAT(header_error(R"({"a": {"dtype": "F32", "shape": [6], "data_offsets": [0, "24"]}})"),
              HasSubstr(": tensor 'a': data_offsets[1] is string \"24\", expected a non-negative integer"));
}

TEST_F(SafetensorsTest, DataOffsetNegative) {
  EXPECT_THAT(header_error(R"({"a": {"dtype": "F32", "shape": [6], "data_offsets": [-1, 23]}})"),
              HasSubstr(": tensor 'a': data_offsets[0] is number -1, expected a non-negative integer"));
}

TEST_F(SafetensorsTest, UnknownDtype) {
  EXPECT_THAT(header_error(R"({"w.bias": {"dtype": "I64", "shape": [3], "data_offsets": [0, 24]}})"),
              HasSubstr(": tensor 'w.bias': unsupported dtype 'I64' (accepted: F32, F16, BF16)"));
}

TEST_F(SafetensorsTest, NegativeDimension) {
  EXPECT_THAT(header_error(R"({"a": {"dtype": "F32", "shape": [2, -3], "data_offsets": [0, 24]}})"),
              HasSubstr(": tensor 'a': shape[1] = -3 is a negative dimension"));
}

TEST_F(SafetensorsTest, NumelOverflow) {
  EXPECT_THAT(
      header_error(R"({"a": {"dtype": "F32", "shape": [4294967296, 4294967296], "data_offsets": [0, 24]}})"),
      HasSubstr(
          ": tensor 'a': shape [4294967296, 4294967296] has more than 2^63-1 elements (numel overflow)"));
}

TEST_F(SafetensorsTest, DimensionAboveInt64) {
  EXPECT_THAT(
      header_error(R"({"a": {"dtype": "F32", "shape": [9223372036854775808], "data_offsets": [0, 24]}})"),
      HasSubstr(": tensor 'a': shape[0] = 9223372036854775808 exceeds 2^63-1 (numel overflow)"));
}

TEST_F(SafetensorsTest, ByteSizeOverflow) {
  EXPECT_THAT(
      header_error(R"({"a": {"dtype": "F32", "shape": [4611686018427387904], "data_offsets": [0, 24]}})"),
      HasSubstr(": tensor 'a': shape [4611686018427387904] of F32 needs more than 2^64-1 bytes"));
}

TEST_F(SafetensorsTest, BeginAfterEnd) {
  EXPECT_THAT(header_error(R"({"a": {"dtype": "F32", "shape": [0], "data_offsets": [24, 0]}})"),
              HasSubstr(": tensor 'a': data_offsets [24, 0] have begin > end"));
}

TEST_F(SafetensorsTest, EndPastDataSection) {
  EXPECT_THAT(
      header_error(R"({"a": {"dtype": "F32", "shape": [6], "data_offsets": [0, 24]}})", 16),
      HasSubstr(": tensor 'a': data_offsets [0, 24] end past the data section, which holds 16 bytes"));
}

TEST_F(SafetensorsTest, SizeMismatch) {
  const std::string p =
      write_header(R"({"a.weight": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 12]}})", 24);
  EXPECT_EQ(open_error(p),
            p + ": tensor 'a.weight': data_offsets [0, 12] hold 12 bytes but shape [2, 3] of F32 needs 24");
}

TEST_F(SafetensorsTest, SizeMismatchHalfPrecision) {
  EXPECT_THAT(
      header_error(R"({"a": {"dtype": "BF16", "shape": [2, 3], "data_offsets": [0, 24]}})"),
      HasSubstr(": tensor 'a': data_offsets [0, 24] hold 24 bytes but shape [2, 3] of BF16 needs 12"));
}

TEST_F(SafetensorsTest, OverlappingTensors) {
  const std::string h =
      R"({"a": {"dtype": "F32", "shape": [6], "data_offsets": [0, 24]},
          "b": {"dtype": "F32", "shape": [6], "data_offsets": [16, 40]}})";
  EXPECT_THAT(header_error(h, 40),
              HasSubstr(": tensors 'a' (data_offsets [0, 24]) and 'b' (data_offsets [16, 40]) overlap"));
}

TEST_F(SafetensorsTest, IdenticalRangesOverlap) {
  const std::string h =
      R"({"x": {"dtype": "F16", "shape": [4], "data_offsets": [8, 16]},
          "y": {"dtype": "BF16", "shape": [2, 2], "data_offsets": [8, 16]}})";
  EXPECT_THAT(header_error(h, 16),
              HasSubstr(": tensors 'x' (data_offsets [8, 16]) and 'y' (data_offsets [8, 16]) overlap"));
}

TEST_F(SafetensorsTest, MetadataNotObject) {
  EXPECT_THAT(header_error(R"({"__metadata__": ["pt"]})"),
              HasSubstr(": \"__metadata__\" is array [\"pt\"], expected an object of strings"));
}

TEST_F(SafetensorsTest, MetadataValueNotString) {
  EXPECT_THAT(header_error(R"({"__metadata__": {"format": "pt", "step": 7}})"),
              HasSubstr(": \"__metadata__\" key 'step' is number 7, expected a string"));
}

// ---- accepted edge cases
// ------------------------------------------------------------------------------------------

TEST_F(SafetensorsTest, AcceptsScalarsEmptyTensorsGapsAndPadding) {
  // A scalar (shape []), an empty tensor at the same offset as a real one, a 4-byte gap, trailing header
  // spaces.
  const std::string h =
      R"({"s": {"dtype": "F32", "shape": [], "data_offsets": [0, 4]},
          "e": {"dtype": "F16", "shape": [0, 5], "data_offsets": [4, 4]},
          "v": {"dtype": "BF16", "shape": [2], "data_offsets": [8, 12]}}    )";
  const std::string p = write_header(h, 12);
  auto f = SafetensorsFile::open(p);
  ASSERT_EQ(f->tensors().size(), 3u);
  EXPECT_EQ(f->tensors().at("s").numel(), 1);
  EXPECT_EQ(f->tensors().at("s").nbytes, 4u);
  EXPECT_EQ(f->tensors().at("e").numel(), 0);
  EXPECT_EQ(f->tensors().at("e").nbytes, 0u);
  EXPECT_EQ(f->tensors().at("v").dtype, DType::BF16);
  EXPECT_EQ(f->tensors().at("v").file, p);
  EXPECT_TRUE(f->metadata().empty());
}

// ---- writer -> reader
// ---------------------------------------------------------------------------------------------

template <typename T>
std::vector<uint8_t> bytes_of(const std::vector<T>& v) {
  std::vector<uint8_t> b(v.size() * sizeof(T));
  std::memcpy(b.data(), v.data(), b.size());
  return b;
}

TEST_F(SafetensorsTest, WriterReaderRoundTrip) {
  // Values exactly representable in each dtype, with their hand-derived encodings.
  const std::vector<float> f32 = {0.0f, -1.5f, 3.25e-3f, 1e30f, -7.0f, 0.1f};
  const std::vector<uint16_t> f16 = {0x0000, 0xB800, 0x3C00, 0x7BFF, 0x0400, 0x0001, 0xC380, 0x8000};
  const std::vector<float> f16_values = {
      0.0f, -0.5f, 1.0f, 65504.0f, 6.103515625e-05f, 5.9604644775390625e-08f, -3.75f, -0.0f};
  const std::vector<uint16_t> bf16 = {0x3F80, 0xC000, 0x3E20, 0x7F7F};
  const std::vector<float> bf16_values = {1.0f, -2.0f, 0.15625f, 3.3895313892515355e38f};

  std::vector<TensorToWrite> ts = {
      {"z.f32", DType::F32, {2, 3}, bytes_of(f32)},
      {"b.f16", DType::F16, {4, 2}, bytes_of(f16)},
      {"a.bf16", DType::BF16, {4}, bytes_of(bf16)},
      {"m.empty", DType::F32, {0, 7}, {}},
  };
  const std::map<std::string, std::string> meta = {{"format", "pt"}, {"note", "round \"trip\" \xc3\xa9"}};
  const std::string p = dir_ + "/model.safetensors";
  write_safetensors(p, ts, meta);

  // Layout: 8-byte aligned header padded with spaces; data sorted by tensor name.
  const std::string raw = test::read_file(p);
  uint64_t n = 0;
  std::memcpy(&n, raw.data(), 8);
  EXPECT_EQ(n % 8, 0u);
  const std::string header = raw.substr(8, n);
  const json h = json::parse(header);
  EXPECT_EQ(header.find_last_not_of(' ') + 1, header.rfind('}') + 1);
  EXPECT_EQ(h["a.bf16"]["data_offsets"], json({0, 8}));
  EXPECT_EQ(h["b.f16"]["data_offsets"], json({8, 24}));
  EXPECT_EQ(h["m.empty"]["data_offsets"], json({24, 24}));
  EXPECT_EQ(h["z.f32"]["data_offsets"], json({24, 48}));
  EXPECT_EQ(raw.size(), 8 + n + 48);

  auto f = SafetensorsFile::open(p);
  EXPECT_EQ(f->metadata(), meta);
  ASSERT_EQ(f->tensors().size(), ts.size());
  for (const auto& t : ts) {
    SCOPED_TRACE(t.name);
    const TensorView& v = f->tensors().at(t.name);
    EXPECT_EQ(v.dtype, t.dtype);
    EXPECT_EQ(v.shape, t.shape);
    ASSERT_EQ(v.nbytes, t.data.size());
    if (v.nbytes != 0) {
      EXPECT_EQ(std::memcmp(v.data, t.data.data(), v.nbytes), 0);
    }
  }

  const Checkpoint ck = Checkpoint::open_dir(dir_);
  EXPECT_EQ(ck.names(), (std::vector<std::string>{"a.bf16", "b.f16", "m.empty", "z.f32"}));
  EXPECT_EQ(ck.load_f32("z.f32", {2, 3}), f32);
  const std::vector<float> got16 = ck.load_f32("b.f16", {4, 2});
  ASSERT_EQ(got16.size(), f16_values.size());
  for (size_t i = 0; i < got16.size(); ++i) {
    EXPECT_EQ(got16[i], f16_values[i]) << i;
    EXPECT_EQ(std::signbit(got16[i]), std::signbit(f16_values[i])) << i;
  }
  EXPECT_EQ(ck.load_f32("a.bf16", {4}), bf16_values);
  EXPECT_TRUE(ck.load_f32("m.empty", {0, 7}).empty());
}

TEST_F(SafetensorsTest, WriterWithoutMetadataOmitsIt) {
  write_safetensors(dir_ + "/x.safetensors", {{"t", DType::F32, {1}, bytes_of(std::vector<float>{2.0f})}});
  const std::string raw = test::read_file(dir_ + "/x.safetensors");
  EXPECT_EQ(raw.find("__metadata__"), std::string::npos);
  EXPECT_TRUE(SafetensorsFile::open(dir_ + "/x.safetensors")->metadata().empty());
}

TEST_F(SafetensorsTest, WriterRejectsBadInput) {
  const std::string p = dir_ + "/bad.safetensors";
  auto err = [&](const std::vector<TensorToWrite>& ts, const std::string& dest) -> std::string {
    try {
      write_safetensors(dest, ts);
    } catch (const Error& e) {
      return e.what();
    }
    ADD_FAILURE() << "write_safetensors did not throw";
    return {};
  };
  EXPECT_EQ(err({{"w", DType::BF16, {2, 3}, std::vector<uint8_t>(10)}}, p),
            p + ": tensor 'w': data holds 10 bytes but shape [2, 3] of BF16 needs 12");
  EXPECT_EQ(
      err({{"w", DType::F32, {1}, std::vector<uint8_t>(4)}, {"w", DType::F32, {1}, std::vector<uint8_t>(4)}},
          p),
      p + ": tensor 'w' is given twice");
  EXPECT_EQ(err({{"w", DType::F32, {-1}, {}}}, p), p + ": tensor 'w': shape[0] = -1 is a negative dimension");
  EXPECT_EQ(err({{"__metadata__", DType::F32, {1}, std::vector<uint8_t>(4)}}, p),
            p + ": '__metadata__' is reserved and cannot name a tensor");
  const std::string nodir = dir_ + "/missing/sub/x.safetensors";
  EXPECT_THAT(err({{"w", DType::F32, {1}, std::vector<uint8_t>(4)}}, nodir),
              HasSubstr(nodir + ": cannot open '" + nodir + ".tmp."));
  EXPECT_FALSE(fs::exists(p));
}

TEST_F(SafetensorsTest, MisalignedHalfPrecisionLoads) {
  // An F16 tensor at an odd data offset (the format allows it): load_f32 must still convert correctly.
  std::string h = R"({"h": {"dtype": "F16", "shape": [2], "data_offsets": [1, 5]}})";
  h.append((8 - h.size() % 8) % 8, ' ');
  std::string b(8, '\0');
  const uint64_t n = h.size();
  std::memcpy(b.data(), &n, 8);
  b += h;
  const uint8_t data[5] = {0, 0x00, 0x3C, 0x00, 0xC0};  // 1.0, -2.0 little-endian at offset 1
  b.append(reinterpret_cast<const char*>(data), 5);
  write_bytes(b);
  const Checkpoint ck = Checkpoint::open_dir(dir_);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(ck.get("h").data) % 2, 1u);
  EXPECT_EQ(ck.load_f32("h", {2}), (std::vector<float>{1.0f, -2.0f}));
}

TEST_F(SafetensorsTest, CheckpointGetAndShapeErrors) {
  write_safetensors(dir_ + "/model.safetensors", {{"w", DType::F32, {2, 3}, std::vector<uint8_t>(24)}});
  const Checkpoint ck = Checkpoint::open_dir(dir_);
  EXPECT_TRUE(ck.has("w"));
  EXPECT_FALSE(ck.has("nope"));
  try {
    ck.get("nope");
    ADD_FAILURE() << "get did not throw";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()), dir_ + ": tensor 'nope' not found");
  }
  try {
    ck.load_f32("w", {3, 2});
    ADD_FAILURE() << "load_f32 did not throw";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()),
              dir_ + ": tensor 'w' (in " + dir_ + "/model.safetensors): expected shape [3, 2], got [2, 3]");
  }
}

// ---- non-finite values
// ------------------------------------------------------------------------------------------------

struct BitPatterns {
  DType dtype;
  std::vector<uint32_t> finite;  // max, -max, 1, -1, smallest subnormal, -0, 0
  uint32_t nan, snan, neg_nan, inf, neg_inf;
};

const std::vector<BitPatterns>& bit_patterns() {
  static const std::vector<BitPatterns> p = {
      {DType::F32,
       {0x7f7fffffu, 0xff7fffffu, 0x3f800000u, 0xbf800000u, 0x00000001u, 0x80000000u, 0u},
       0x7fc00000u, 0x7f800001u, 0xffc00000u, 0x7f800000u, 0xff800000u},
      {DType::F16,
       {0x7bffu, 0xfbffu, 0x3c00u, 0xbc00u, 0x0001u, 0x8000u, 0u},
       0x7e00u, 0x7c01u, 0xfe00u, 0x7c00u, 0xfc00u},
      {DType::BF16,
       {0x7f7fu, 0xff7fu, 0x3f80u, 0xbf80u, 0x0001u, 0x8000u, 0u},
       0x7fc0u, 0x7f81u, 0xffc0u, 0x7f80u, 0xff80u},
  };
  return p;
}

void put_bits(std::vector<uint8_t>& buf, size_t offset, DType dt, size_t i, uint32_t bits) {
  if (dt == DType::F32) {
    std::memcpy(buf.data() + offset + 4 * i, &bits, 4);
  } else {
    const auto h = static_cast<uint16_t>(bits);
    std::memcpy(buf.data() + offset + 2 * i, &h, 2);
  }
}

// Every element count around the 64-byte vector step, every misalignment, and a NaN / Inf at the first, a middle and
// the last element (the vector body and the scalar tail): has_nonfinite and count_nonfinite agree on the bits.
TEST(NonFinite, BitPatternsOfEveryDtypeAtEveryPositionAndAlignment) {
  for (const BitPatterns& bp : bit_patterns()) {
    const size_t es = dtype_size(bp.dtype);
    for (size_t n : {size_t{1}, size_t{7}, size_t{15}, size_t{16}, size_t{17}, size_t{31}, size_t{32}, size_t{33},
                     size_t{100}, size_t{1000}}) {
      for (size_t offset : {size_t{0}, size_t{1}, size_t{3}}) {
        SCOPED_TRACE(::testing::Message() << dtype_name(bp.dtype) << " n=" << n << " offset=" << offset);
        std::vector<uint8_t> buf(offset + n * es + 8, 0xff);  // 0xff around the tensor: NaN bits, must not be read
        for (size_t i = 0; i < n; ++i) put_bits(buf, offset, bp.dtype, i, bp.finite[i % bp.finite.size()]);
        TensorView v;
        v.name = "t";
        v.dtype = bp.dtype;
        v.shape = {static_cast<int64_t>(n)};
        v.data = buf.data() + offset;
        v.nbytes = n * es;
        EXPECT_FALSE(has_nonfinite(v));
        EXPECT_EQ(count_nonfinite(v).first, -1);
        for (size_t at : {size_t{0}, n / 2, n - 1}) {
          for (uint32_t bad : {bp.nan, bp.snan, bp.neg_nan, bp.inf, bp.neg_inf}) {
            put_bits(buf, offset, bp.dtype, at, bad);
            EXPECT_TRUE(has_nonfinite(v)) << "at " << at << " bits " << std::hex << bad;
            const NonFiniteCount c = count_nonfinite(v);
            const bool is_inf = bad == bp.inf || bad == bp.neg_inf;
            EXPECT_EQ(c.nan, is_inf ? 0 : 1);
            EXPECT_EQ(c.inf, is_inf ? 1 : 0);
            EXPECT_EQ(c.first, static_cast<int64_t>(at));
            put_bits(buf, offset, bp.dtype, at, bp.finite[at % bp.finite.size()]);
          }
        }
        EXPECT_FALSE(has_nonfinite(v));
      }
    }
  }
}

class CheckFiniteTest : public SafetensorsTest {
 protected:
  // big: 3M finite F32 (12 MB: two 8 MiB scan chunks) with a NaN in the second chunk; allnan: BF16 all NaN;
  // inf: F16 with -Inf at 5; ok: finite.
  Checkpoint write_and_open() {
    std::vector<float> big(3'000'000, 0.5f);
    big[2'500'000] = std::numeric_limits<float>::quiet_NaN();
    std::vector<uint16_t> allnan(10, 0x7fc0), inf(8, 0x3c00), ok(4, 0x3f80);
    inf[5] = 0xfc00;
    write_safetensors(dir_ + "/model.safetensors", {{"big", DType::F32, {3000, 1000}, bytes_of(big)},
                                                    {"allnan", DType::BF16, {2, 5}, bytes_of(allnan)},
                                                    {"inf", DType::F16, {8}, bytes_of(inf)},
                                                    {"ok", DType::BF16, {4}, bytes_of(ok)}});
    return Checkpoint::open_dir(dir_);
  }
  static std::string finite_error(const Checkpoint& c, const std::vector<std::string>& names, unsigned threads) {
    try {
      c.check_finite(names, threads);
    } catch (const Error& e) {
      return e.what();
    }
    return "";
  }
};

TEST_F(CheckFiniteTest, NamesTheFirstNonFiniteTensorInOrderWithItsCounts) {
  const Checkpoint c = write_and_open();
  const std::string f = dir_ + "/model.safetensors";
  for (unsigned threads : {1u, 2u, 8u, 0u}) {
    SCOPED_TRACE(threads);
    EXPECT_EQ(finite_error(c, {"ok"}, threads), "");
    EXPECT_EQ(finite_error(c, {"ok", "big", "allnan", "inf"}, threads),
              dir_ + ": tensor 'big' (in " + f +
                  ") holds non-finite values: 1 NaN and 0 Inf among 3000000 elements (first at flat index 2500000), "
                  "and 2 more tensors hold NaN or Inf");
    EXPECT_EQ(finite_error(c, {"allnan", "ok"}, threads),
              dir_ + ": tensor 'allnan' (in " + f + ") holds non-finite values: all 10 elements are NaN");
    EXPECT_EQ(finite_error(c, {"inf", "allnan"}, threads),
              dir_ + ": tensor 'inf' (in " + f +
                  ") holds non-finite values: 0 NaN and 1 Inf among 8 elements (first at flat index 5), and 1 more "
                  "tensor holds NaN or Inf");
  }
  EXPECT_EQ(finite_error(c, {"ok", "nope"}, 1), dir_ + ": tensor 'nope' not found");
}

// ---- sharded checkpoints
// ------------------------------------------------------------------------------------------

class ShardedTest : public SafetensorsTest {
 protected:
  // Two shards: a, b (F32) in shard 1; c (BF16) in shard 2; and the index.
  void write_checkpoint() {
    a_ = {1.0f, 2.0f, -3.0f, 4.5f};
    b_ = {0.25f, -0.125f};
    c_bits_ = {0x3F80, 0x4040, 0xBF00};  // 1, 3, -0.5
    write_safetensors(shard1(), {{"model.a", DType::F32, {2, 2}, bytes_of(a_)},
                                 {"model.b", DType::F32, {2}, bytes_of(b_)}});
    write_safetensors(shard2(), {{"model.c", DType::BF16, {3}, bytes_of(c_bits_)}});
    write_safetensors_index(index(), weight_map(), 16 + 8 + 6);
  }
  std::map<std::string, std::string> weight_map() const {
    return {{"model.a", kShard1}, {"model.b", kShard1}, {"model.c", kShard2}};
  }
  void write_index_json(const json& j) { std::ofstream(index(), std::ios::trunc) << j.dump(); }
  std::string index() const { return dir_ + "/model.safetensors.index.json"; }
  std::string shard1() const { return dir_ + "/" + kShard1; }
  std::string shard2() const { return dir_ + "/" + kShard2; }
  std::string open_dir_error() const {
    try {
      Checkpoint::open_dir(dir_);
    } catch (const Error& e) {
      return e.what();
    }
    ADD_FAILURE() << "expected Checkpoint::open_dir('" << dir_ << "') to throw";
    return {};
  }

  static constexpr const char* kShard1 = "model-00001-of-00002.safetensors";
  static constexpr const char* kShard2 = "model-00002-of-00002.safetensors";
  std::vector<float> a_, b_;
  std::vector<uint16_t> c_bits_;
};

TEST_F(ShardedTest, RoundTrip) {
  write_checkpoint();
  const json idx = json::parse(test::read_file(index()));
  EXPECT_EQ(idx["metadata"]["total_size"], 30);
  EXPECT_EQ(idx["weight_map"]["model.c"], kShard2);

  const Checkpoint ck = Checkpoint::open_dir(dir_);
  EXPECT_EQ(ck.dir(), dir_);
  EXPECT_EQ(ck.names(), (std::vector<std::string>{"model.a", "model.b", "model.c"}));
  EXPECT_EQ(ck.get("model.a").file, shard1());
  EXPECT_EQ(ck.get("model.c").file, shard2());
  EXPECT_EQ(ck.load_f32("model.a", {2, 2}), a_);
  EXPECT_EQ(ck.load_f32("model.b", {2}), b_);
  EXPECT_EQ(ck.load_f32("model.c", {3}), (std::vector<float>{1.0f, 3.0f, -0.5f}));

  // Views stay valid in a copy after the original is gone.
  std::unique_ptr<Checkpoint> first(new Checkpoint(Checkpoint::open_dir(dir_)));
  const Checkpoint copy = *first;
  first.reset();
  EXPECT_EQ(copy.load_f32("model.a"), a_);
}

TEST_F(ShardedTest, SingleFileWinsOverIndex) {
  write_checkpoint();
  write_safetensors(dir_ + "/model.safetensors",
                    {{"only", DType::F32, {1}, bytes_of(std::vector<float>{9.0f})}});
  const Checkpoint ck = Checkpoint::open_dir(dir_);
  EXPECT_EQ(ck.names(), std::vector<std::string>{"only"});
}

TEST_F(ShardedTest, UnlistedShardTensorsAreIgnored) {
  write_checkpoint();
  auto wm = weight_map();
  wm.erase("model.b");
  write_safetensors_index(index(), wm, 0);
  const Checkpoint ck = Checkpoint::open_dir(dir_);
  EXPECT_FALSE(ck.has("model.b"));
  EXPECT_TRUE(ck.has("model.a"));
}

TEST_F(ShardedTest, NotADirectory) {
  const std::string d = dir_ + "/absent";
  try {
    Checkpoint::open_dir(d);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()), d + ": not a directory (looking for a safetensors checkpoint)");
  }
}

TEST_F(ShardedTest, EmptyDirectory) {
  EXPECT_EQ(open_dir_error(),
            dir_ + ": neither model.safetensors nor model.safetensors.index.json exists in this directory");
}

TEST_F(ShardedTest, IndexNotJson) {
  write_checkpoint();
  std::ofstream(index(), std::ios::trunc) << "{\"weight_map\": ";
  EXPECT_THAT(open_dir_error(), HasSubstr(index() + ": index is not valid JSON: "));
}

TEST_F(ShardedTest, IndexNotObject) {
  write_checkpoint();
  write_index_json(json::array({1, 2}));
  EXPECT_EQ(open_dir_error(), index() + ": index is a JSON array, expected an object");
}

TEST_F(ShardedTest, IndexMissingWeightMap) {
  write_checkpoint();
  write_index_json({{"metadata", {{"total_size", 30}}}});
  EXPECT_EQ(open_dir_error(), index() + ": missing \"weight_map\"");
}

TEST_F(ShardedTest, IndexWeightMapNotObject) {
  write_checkpoint();
  write_index_json({{"weight_map", json::array({"model.a"})}});
  EXPECT_EQ(
      open_dir_error(),
      index() + ": \"weight_map\" is array [\"model.a\"], expected an object {tensor name: shard file}");
}

TEST_F(ShardedTest, IndexWeightMapEmpty) {
  write_checkpoint();
  write_index_json({{"weight_map", json::object()}});
  EXPECT_EQ(open_dir_error(), index() + ": \"weight_map\" is empty");
}

TEST_F(ShardedTest, IndexMetadataNotObject) {
  write_checkpoint();
  write_index_json({{"metadata", 5}, {"weight_map", weight_map()}});
  EXPECT_EQ(open_dir_error(), index() + ": \"metadata\" is number 5, expected an object");
}

TEST_F(ShardedTest, IndexShardNotString) {
  write_checkpoint();
  json j = {{"weight_map", weight_map()}};
  j["weight_map"]["model.b"] = 1;
  write_index_json(j);
  EXPECT_EQ(open_dir_error(),
            index() + ": weight_map entry for tensor 'model.b' is number 1, expected a shard file name");
}

TEST_F(ShardedTest, IndexShardOutsideDirectory) {
  write_checkpoint();
  json j = {{"weight_map", weight_map()}};
  j["weight_map"]["model.b"] = "../elsewhere.safetensors";
  write_index_json(j);
  EXPECT_EQ(open_dir_error(), index() +
                                  ": weight_map entry for tensor 'model.b' is '../elsewhere.safetensors', " +
                                  "expected a file name inside " + dir_);
}

TEST_F(ShardedTest, IndexDuplicateTensor) {
  write_checkpoint();
  std::ofstream(index(), std::ios::trunc)
      << R"({"weight_map": {"model.a": ")" << kShard1 << R"(", "model.a": ")" << kShard2 << R"("}})";
  EXPECT_EQ(open_dir_error(), index() + ": key 'model.a' appears twice in one object of the index");
}

TEST_F(ShardedTest, MissingShardFile) {
  write_checkpoint();
  fs::remove(shard2());
  EXPECT_EQ(open_dir_error(),
            index() + ": shard '" + kShard2 + "' (listed for tensor 'model.c') does not exist: " + shard2());
  write_checkpoint();
  fs::remove(shard1());
  EXPECT_EQ(open_dir_error(), index() + ": shard '" + kShard1 +
                                  "' (listed for tensor 'model.a' and 1 more) does not exist: " + shard1());
}

TEST_F(ShardedTest, TensorAbsentFromItsShard) {
  write_checkpoint();
  auto wm = weight_map();
  wm["model.d"] = kShard1;
  write_safetensors_index(index(), wm, 30);
  EXPECT_EQ(open_dir_error(), index() + ": tensor 'model.d' is listed in \"weight_map\" for shard '" +
                                  kShard1 + "', but " + shard1() + " has no such tensor");
}

TEST_F(ShardedTest, TensorListedInTheWrongShard) {
  write_checkpoint();
  auto wm = weight_map();
  wm["model.c"] = kShard1;  // c lives in shard 2
  write_safetensors_index(index(), wm, 30);
  EXPECT_EQ(open_dir_error(), index() + ": tensor 'model.c' is listed in \"weight_map\" for shard '" +
                                  kShard1 + "', but " + shard1() + " has no such tensor");
}

TEST_F(ShardedTest, FifoIndexOrShardIsRefusedWithoutBlocking) {
  write_checkpoint();
  test::make_fifo(index());
  const std::string d = dir_;
  EXPECT_EQ(test::error_within([d] { Checkpoint::open_dir(d); }, index()),
            index() + ": not a regular file (a FIFO); the shard index must be a regular file");
  write_checkpoint();  // write_safetensors_index renames a regular file over the FIFO
  test::make_fifo(shard2());
  EXPECT_EQ(test::error_within([d] { Checkpoint::open_dir(d); }, shard2()),
            shard2() + ": not a regular file (a FIFO); a safetensors file must be a regular file");
}

TEST_F(ShardedTest, CorruptShardNamesTheShard) {
  write_checkpoint();
  std::ofstream(shard2(), std::ios::trunc | std::ios::binary) << "abc";
  EXPECT_EQ(open_dir_error(), shard2() + ": file is 3 bytes, shorter than the 8-byte header length prefix");
}

// ---- real checkpoints
// ---------------------------------------------------------------------------------------------

// Cross-checks a real checkpoint against an independent reading of its raw bytes, and checks the tensor count
// against the architecture in config.json.
void check_real_checkpoint(const std::string& model_dir, size_t tensors_per_layer) {
  SCOPED_TRACE(model_dir);
  const json config = json::parse(test::read_file(model_dir + "/config.json"));
  const int64_t vocab = config.at("vocab_size").get<int64_t>();
  const int64_t hidden = config.at("hidden_size").get<int64_t>();
  const size_t layers = config.at("num_hidden_layers").get<size_t>();
  const bool tied = config.value("tie_word_embeddings", false);
  // embed_tokens + final norm (+ lm_head when untied) + per-layer tensors.
  const size_t expected_count = layers * tensors_per_layer + 2 + (tied ? 0 : 1);

  const std::string path = model_dir + "/model.safetensors";
  auto f = SafetensorsFile::open(path);
  EXPECT_EQ(f->tensors().size(), expected_count);
  EXPECT_EQ(f->metadata().at("format"), "pt");

  // The raw file, parsed by hand: little-endian u64 header length, JSON header, data section.
  const std::string raw = test::read_file(path);
  ASSERT_GE(raw.size(), 8u);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<uint8_t>(raw[static_cast<size_t>(i)]);
  const json header = json::parse(raw.substr(8, n));
  EXPECT_EQ(header.size() - header.count("__metadata__"), f->tensors().size());

  const std::string name = "model.embed_tokens.weight";
  const TensorView& emb = f->tensors().at(name);
  EXPECT_EQ(emb.dtype, DType::F32);
  EXPECT_EQ(emb.shape, (std::vector<int64_t>{vocab, hidden}));
  EXPECT_EQ(header[name]["dtype"], "F32");
  const uint64_t begin = header[name]["data_offsets"][0].get<uint64_t>();
  const size_t numel = static_cast<size_t>(emb.numel());
  ASSERT_EQ(emb.nbytes, numel * 4);
  ASSERT_LE(8 + n + begin + emb.nbytes, raw.size());

  const Checkpoint ck = Checkpoint::open_dir(model_dir);
  const std::vector<float> loaded = ck.load_f32(name, {vocab, hidden});
  const auto* view = static_cast<const uint8_t*>(emb.data);
  for (size_t i : {size_t{0}, size_t{1}, size_t{63}, numel / 2 + 5, numel - 1}) {
    SCOPED_TRACE(i);
    const size_t at = 8 + n + begin + 4 * i;
    uint32_t bits = 0;
    for (int k = 3; k >= 0; --k) bits = (bits << 8) | static_cast<uint8_t>(raw[at + static_cast<size_t>(k)]);
    float by_hand;
    std::memcpy(&by_hand, &bits, 4);
    float via_view;
    std::memcpy(&via_view, view + 4 * i, 4);
    EXPECT_EQ(std::memcmp(&via_view, &by_hand, 4), 0);
    EXPECT_EQ(std::memcmp(&loaded[i], &by_hand, 4), 0);
  }

  double sum = 0, sq = 0;
  for (float v : loaded) {
    ASSERT_TRUE(std::isfinite(v));
    sum += v;
    sq += static_cast<double>(v) * v;
  }
  const double mean = sum / static_cast<double>(numel);
  const double stdev = std::sqrt(sq / static_cast<double>(numel) - mean * mean);
  EXPECT_GT(stdev, 1e-3);
  EXPECT_LT(stdev, 10.0);

  // The raw-bits scan agrees: no NaN / Inf anywhere.
  EXPECT_NO_THROW(ck.check_finite(ck.names()));

  // Every tensor loads as finite fp32 of the right size.
  for (const std::string& t : ck.names()) {
    const std::vector<float> v = ck.load_f32(t);
    EXPECT_EQ(v.size(), static_cast<size_t>(ck.get(t).numel())) << t;
    for (float x : v) ASSERT_TRUE(std::isfinite(x)) << t;
  }
}

TEST(SafetensorsRealData, Stories260K) {
  // Llama: q/k/v/o + gate/up/down + 2 norms per layer.
  check_real_checkpoint(test::data_path("models/stories260K"), 9);
}

TEST(SafetensorsRealData, TinyRandomQwen3) {
  // Qwen3: the Llama set plus q_norm and k_norm per layer.
  check_real_checkpoint(test::data_path("models/tiny-random-qwen3"), 11);
}

}  // namespace
}  // namespace spade
