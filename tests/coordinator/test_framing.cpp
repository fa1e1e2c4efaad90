// Framing of the coordinator protocol (common/proto/framing.h): varint length prefix + Envelope.
#include <gtest/gtest.h>

#include <string>

#include "common/error.h"
#include "common/proto/framing.h"

namespace spade::proto {
namespace {

Envelope heartbeat(uint64_t seq) {
  Envelope e;
  e.mutable_heartbeat()->set_rank(3);
  e.mutable_heartbeat()->set_seq(seq);
  (*e.mutable_heartbeat()->mutable_stats())["tpot_ms"] = 12.5;
  return e;
}

std::string varint(uint64_t v) {
  std::string s;
  while (v >= 0x80) {
    s.push_back(static_cast<char>((v & 0x7F) | 0x80));
    v >>= 7;
  }
  s.push_back(static_cast<char>(v));
  return s;
}

TEST(Framing, RoundTripManyFramesFedByteByByte) {
  std::string stream;
  for (uint64_t i = 1; i <= 50; ++i) append_frame(heartbeat(i), &stream);
  Envelope reg;
  reg.mutable_register_request()->mutable_self()->set_role(INFERENCE);
  reg.mutable_register_request()->mutable_self()->mutable_transport()->set_address(
      std::string(100000, '\x7f'));
  append_frame(reg, &stream);

  FrameDecoder dec;
  Envelope out;
  std::string err;
  uint64_t next_seq = 1;
  bool got_reg = false;
  for (char c : stream) {
    dec.feed(&c, 1);
    for (;;) {
      auto r = dec.next(&out, &err);
      ASSERT_NE(r, FrameDecoder::Result::kError) << err;
      if (r == FrameDecoder::Result::kNeedMore) break;
      if (out.has_heartbeat()) {
        EXPECT_EQ(out.heartbeat().seq(), next_seq++);
        EXPECT_DOUBLE_EQ(out.heartbeat().stats().at("tpot_ms"), 12.5);
      } else {
        ASSERT_TRUE(out.has_register_request());
        EXPECT_EQ(out.register_request().self().transport().address().size(), 100000u);
        got_reg = true;
      }
    }
  }
  EXPECT_EQ(next_seq, 51u);
  EXPECT_TRUE(got_reg);
  EXPECT_FALSE(dec.mid_frame());
  EXPECT_EQ(dec.eof_error(), "");
}

TEST(Framing, PrefixIsProtobufDelimitedVarint) {
  auto e = heartbeat(7);
  std::string frame = encode_frame(e);
  std::string body = e.SerializeAsString();
  EXPECT_EQ(frame, varint(body.size()) + body);
}

TEST(Framing, TruncatedFrameIsReportedAtEof) {
  std::string frame = encode_frame(heartbeat(1));
  FrameDecoder dec;
  dec.feed(frame.data(), frame.size() - 3);
  Envelope out;
  std::string err;
  EXPECT_EQ(dec.next(&out, &err), FrameDecoder::Result::kNeedMore);
  EXPECT_TRUE(dec.mid_frame());
  EXPECT_NE(dec.eof_error().find("truncated frame"), std::string::npos) << dec.eof_error();
  EXPECT_NE(dec.eof_error().find(std::to_string(frame.size() - 1)), std::string::npos) << dec.eof_error();

  FrameDecoder dec2;
  std::string half_prefix = "\x80";  // continuation bit set, stream ends
  dec2.feed(half_prefix.data(), 1);
  EXPECT_EQ(dec2.next(&out, &err), FrameDecoder::Result::kNeedMore);
  EXPECT_NE(dec2.eof_error().find("length prefix"), std::string::npos) << dec2.eof_error();
}

TEST(Framing, GarbageIsRejected) {
  // A plausible length prefix followed by bytes that are not an Envelope (wire type 7 is invalid).
  std::string garbage = std::string("\x05", 1) + std::string("\xFF\xFF\xFF\xFF\xFF", 5);
  FrameDecoder dec;
  dec.feed(garbage.data(), garbage.size());
  Envelope out;
  std::string err;
  ASSERT_EQ(dec.next(&out, &err), FrameDecoder::Result::kError);
  EXPECT_NE(err.find("malformed Envelope"), std::string::npos) << err;
  // Poisoned: later good frames are not accepted on this stream.
  std::string good = encode_frame(heartbeat(1));
  dec.feed(good.data(), good.size());
  EXPECT_EQ(dec.next(&out, &err), FrameDecoder::Result::kError);
}

TEST(Framing, ValidProtobufWithoutKnownMessageIsRejected) {
  // Field 99 (varint) is valid protobuf but not an Envelope case.
  std::string body = std::string("\x98\x06\x01", 3);
  std::string frame = varint(body.size()) + body;
  FrameDecoder dec;
  dec.feed(frame.data(), frame.size());
  Envelope out;
  std::string err;
  ASSERT_EQ(dec.next(&out, &err), FrameDecoder::Result::kError);
  EXPECT_NE(err.find("no known message"), std::string::npos) << err;
}

TEST(Framing, OversizedLengthPrefixRejectedBeforeTheBodyArrives) {
  // Only the 5-byte prefix announcing ~4 GiB is fed: the decoder must refuse from the prefix alone instead of
  // waiting for (or allocating) the body.
  std::string prefix = varint(0xFFFFFFF0ull);
  FrameDecoder dec;
  dec.feed(prefix.data(), prefix.size());
  Envelope out;
  std::string err;
  ASSERT_EQ(dec.next(&out, &err), FrameDecoder::Result::kError);
  EXPECT_NE(err.find("exceeds the maximum frame size"), std::string::npos) << err;

  // Exactly at the limit is fine (waits for the body); one byte more is not.
  FrameDecoder small(1000);
  std::string at = varint(1000);
  small.feed(at.data(), at.size());
  EXPECT_EQ(small.next(&out, &err), FrameDecoder::Result::kNeedMore);
  FrameDecoder small2(1000);
  std::string over = varint(1001);
  small2.feed(over.data(), over.size());
  EXPECT_EQ(small2.next(&out, &err), FrameDecoder::Result::kError);
}

TEST(Framing, OverlongVarintRejected) {
  std::string bad(6, '\x80');
  FrameDecoder dec;
  dec.feed(bad.data(), bad.size());
  Envelope out;
  std::string err;
  ASSERT_EQ(dec.next(&out, &err), FrameDecoder::Result::kError);
  EXPECT_NE(err.find("malformed length prefix"), std::string::npos) << err;
}

TEST(Framing, SenderRefusesOversizedAndEmptyEnvelopes) {
  Envelope big;
  big.mutable_register_request()->mutable_self()->mutable_transport()->set_address(std::string(5000, 'x'));
  EXPECT_THROW(encode_frame(big, 4096), spade::Error);
  EXPECT_NO_THROW(encode_frame(big, 8192));
  Envelope empty;
  EXPECT_THROW(encode_frame(empty), spade::Error);
}

}  // namespace
}  // namespace spade::proto
