// Framing of the coordinator protocol over a byte stream (TCP).
//
// Frame = varint(len) || Envelope bytes, where varint is the protobuf base-128 varint (1..5 bytes for len <
// 2^32). This is exactly protobuf's "delimited" format (google::protobuf::util::SerializeDelimitedToOstream,
// Python's _VarintBytes(len) + SerializeToString()), so non-C++ tools can speak the protocol.
//
// Limits, enforced on the receive side before anything is allocated for the body:
//   * len must be <= max_frame_bytes (default kMaxFrameBytes = 64 MiB), else kError "length prefix ...
//   exceeds";
//   * the varint must end within 5 bytes (a 32-bit length), else kError "malformed length prefix";
//   * the body must parse as an Envelope with a message set, else kError "malformed Envelope".
// A stream that ends in the middle of a frame is reported by FrameDecoder::eof_error() ("truncated frame").
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "common/proto/coordinator.pb.h"

namespace spade::proto {

/// Version sent in RegisterRequest.protocol_version; bump only for incompatible changes.
inline constexpr uint32_t kProtocolVersion = 1;

/// Default maximum size of one frame body in bytes (64 MiB).
inline constexpr size_t kMaxFrameBytes = size_t{64} << 20;

/// Serializes `env` as one frame (varint length prefix + body) appended to `out`.
/// Throws spade::Error when the body would exceed `max_frame_bytes` or the envelope has no message set.
void append_frame(const Envelope& env, std::string* out, size_t max_frame_bytes = kMaxFrameBytes);

/// Same as append_frame into a fresh string.
std::string encode_frame(const Envelope& env, size_t max_frame_bytes = kMaxFrameBytes);

/// Name of the message case of an envelope, e.g. "register_request" ("<none>" when unset); for logs and
/// errors.
const char* envelope_case_name(const Envelope& env);

/// Incremental decoder: feed() bytes as they arrive from the socket, then call next() until it returns
/// kNeedMore. After kError the decoder is poisoned (every later next() returns kError): the connection must
/// be closed.
class FrameDecoder {
 public:
  enum class Result { kNeedMore, kFrame, kError };

  explicit FrameDecoder(size_t max_frame_bytes = kMaxFrameBytes) : max_frame_bytes_(max_frame_bytes) {}

  /// Appends received bytes.
  void feed(const char* data, size_t n);

  /// Decodes the next complete frame into *out. On kError, *error says why (without the peer's name: the
  /// caller adds it).
  Result next(Envelope* out, std::string* error);

  /// True when bytes of an incomplete frame are buffered (the stream must not end here).
  bool mid_frame() const { return pos_ < buf_.size(); }
  /// Bytes received but not yet decoded (those of an incomplete frame).
  size_t buffered_bytes() const { return buf_.size() - pos_; }

  /// For a stream that ended: "" when it ended on a frame boundary, else a "truncated frame: ..."
  /// description.
  std::string eof_error() const;

  size_t max_frame_bytes() const { return max_frame_bytes_; }
  /// Changes the limit from the next call of next() on (e.g. raised once a peer has authenticated); buffered
  /// bytes are kept.
  void set_max_frame_bytes(size_t max_frame_bytes) { max_frame_bytes_ = max_frame_bytes; }

 private:
  // Parses the varint at pos_. Returns 1 = complete (*len, *prefix_bytes), 0 = need more, -1 = malformed.
  int parse_prefix(uint64_t* len, size_t* prefix_bytes) const;
  void compact();

  size_t max_frame_bytes_;
  std::string buf_;
  size_t pos_ = 0;  // start of the first unconsumed byte in buf_
  std::string poisoned_;
};

}  // namespace spade::proto
