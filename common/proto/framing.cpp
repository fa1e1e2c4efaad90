#include "common/proto/framing.h"

#include <fmt/format.h>

#include "common/error.h"

namespace spade::proto {
namespace {

constexpr size_t kMaxVarintBytes = 5;  // a 32-bit length never needs more

void append_varint(uint64_t v, std::string* out) {
  while (v >= 0x80) {
    out->push_back(static_cast<char>((v & 0x7F) | 0x80));
    v >>= 7;
  }
  out->push_back(static_cast<char>(v));
}

}  // namespace

const char* envelope_case_name(const Envelope& env) {
  switch (env.msg_case()) {
    case Envelope::kRegisterRequest:
      return "register_request";
    case Envelope::kRegisterReply:
      return "register_reply";
    case Envelope::kClusterView:
      return "cluster_view";
    case Envelope::kHeartbeat:
      return "heartbeat";
    case Envelope::kHeartbeatAck:
      return "heartbeat_ack";
    case Envelope::kPeerDown:
      return "peer_down";
    case Envelope::kShutdown:
      return "shutdown";
    case Envelope::kStatusRequest:
      return "status_request";
    case Envelope::kStatusReply:
      return "status_reply";
    case Envelope::kGenerateRequest:
      return "generate_request";
    case Envelope::kGenerateChunk:
      return "generate_chunk";
    case Envelope::kCancelRequest:
      return "cancel_request";
    case Envelope::kAuthHello:
      return "auth_hello";
    case Envelope::kAuthChallenge:
      return "auth_challenge";
    case Envelope::kAuthProof:
      return "auth_proof";
    case Envelope::kPeerReplaced:
      return "peer_replaced";
    case Envelope::kPairOffer:
      return "pair_offer";
    case Envelope::MSG_NOT_SET:
      return "<none>";
  }
  return "<unknown>";
}

void append_frame(const Envelope& env, std::string* out, size_t max_frame_bytes) {
  SPADE_CHECK(env.msg_case() != Envelope::MSG_NOT_SET, "refusing to send an Envelope with no message set");
  size_t body = env.ByteSizeLong();
  SPADE_CHECK(body <= max_frame_bytes, "{} frame of {} bytes exceeds the maximum frame size of {} bytes",
              envelope_case_name(env), body, max_frame_bytes);
  append_varint(body, out);
  size_t at = out->size();
  out->resize(at + body);
  SPADE_CHECK(env.SerializeToArray(out->data() + at, static_cast<int>(body)), "failed to serialize {} frame",
              envelope_case_name(env));
}

std::string encode_frame(const Envelope& env, size_t max_frame_bytes) {
  std::string out;
  append_frame(env, &out, max_frame_bytes);
  return out;
}

void FrameDecoder::feed(const char* data, size_t n) {
  if (!poisoned_.empty()) return;
  compact();
  buf_.append(data, n);
}

void FrameDecoder::compact() {
  // Drop consumed bytes once they dominate the buffer (amortized O(1) per byte).
  if (pos_ > 0 && (pos_ == buf_.size() || pos_ >= buf_.size() / 2)) {
    buf_.erase(0, pos_);
    pos_ = 0;
  }
}

int FrameDecoder::parse_prefix(uint64_t* len, size_t* prefix_bytes) const {
  uint64_t v = 0;
  size_t avail = buf_.size() - pos_;
  for (size_t i = 0; i < kMaxVarintBytes; ++i) {
    if (i >= avail) return 0;
    auto b = static_cast<uint8_t>(buf_[pos_ + i]);
    v |= static_cast<uint64_t>(b & 0x7F) << (7 * i);
    if ((b & 0x80) == 0) {
      *len = v;
      *prefix_bytes = i + 1;
      return 1;
    }
  }
  return -1;
}

FrameDecoder::Result FrameDecoder::next(Envelope* out, std::string* error) {
  if (!poisoned_.empty()) {
    *error = poisoned_;
    return Result::kError;
  }
  if (pos_ >= buf_.size()) return Result::kNeedMore;
  uint64_t len = 0;
  size_t prefix = 0;
  int r = parse_prefix(&len, &prefix);
  if (r < 0) {
    poisoned_ = fmt::format("malformed length prefix (varint longer than {} bytes)", kMaxVarintBytes);
    *error = poisoned_;
    return Result::kError;
  }
  if (r == 0) return Result::kNeedMore;
  if (len > max_frame_bytes_) {
    poisoned_ = fmt::format("frame length prefix {} bytes exceeds the maximum frame size of {} bytes", len,
                            max_frame_bytes_);
    *error = poisoned_;
    return Result::kError;
  }
  if (buf_.size() - pos_ - prefix < len) return Result::kNeedMore;
  const char* body = buf_.data() + pos_ + prefix;
  out->Clear();
  if (!out->ParseFromArray(body, static_cast<int>(len))) {
    poisoned_ = fmt::format("malformed Envelope: {} byte frame is not a valid protobuf message", len);
    *error = poisoned_;
    return Result::kError;
  }
  if (out->msg_case() == Envelope::MSG_NOT_SET) {
    poisoned_ = fmt::format("malformed Envelope: {} byte frame carries no known message", len);
    *error = poisoned_;
    return Result::kError;
  }
  pos_ += prefix + len;
  compact();
  return Result::kFrame;
}

std::string FrameDecoder::eof_error() const {
  if (!mid_frame()) return "";
  uint64_t len = 0;
  size_t prefix = 0;
  size_t avail = buf_.size() - pos_;
  if (parse_prefix(&len, &prefix) != 1) {
    return fmt::format("truncated frame: stream ended inside the length prefix ({} byte(s))", avail);
  }
  return fmt::format("truncated frame: stream ended after {} of {} body bytes", avail - prefix, len);
}

}  // namespace spade::proto
