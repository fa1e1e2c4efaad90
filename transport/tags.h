// Tag layout of Spade's data-plane messages (48-bit tags, transport/transport.h kMaxTag).
//
//   bit 47            40 39                                   16 15                0
//      [   kind (8)     |           step (24, mod 2^24)          |   pack (16)      ]
//
//   kind : what the message is (MsgKind). 0xFF is reserved for the transport's own control messages (the UCX
//          connect handshake); make_tag refuses it.
//   step : decode step the message belongs to, modulo 2^24. Reuse after wraparound is safe as long as fewer
//   than
//          2^24 steps of the same kind and pack are outstanding (in practice: 1-2).
//   pack : layer-pack index (P consecutive layers form one pack, AsyncSpade Sec. 4.3).
// Implementations may add bits above 48 (UCX: [sender id 16][tag 48]).
//
// Per decode step t and pack p the inference rank posts
//   send(make_tag(kQkvPack, t, p))        q/k/v of step t for the pack's layers        (inference -> cache)
//   recv(make_tag(kSelectedKv, t + 1, p)) selected KV used at step t + 1               (cache -> inference)
// and the cache rank posts the mirror-image operations.
#pragma once

#include <cstdint>

#include "common/error.h"
#include "transport/transport.h"

namespace spade::transport {

enum class MsgKind : uint8_t {
  kQkvPack = 1,     // inference -> cache: the step's query/key/value states of one layer pack (Sec. 4.1)
  kSelectedKv = 2,  // cache -> inference: the filtered (selected) KV of one layer pack for the next step
  kInitKv = 3,      // inference -> cache: prefill KV + recent queries at step theta_t - 1 (sparse mode start)
  kControl = 4,     // small in-band control messages between paired ranks (e.g. end of request)
  kTransportReserved = 0xFF,
};

inline constexpr uint32_t kTagStepBits = 24;
inline constexpr uint32_t kTagPackBits = 16;
inline constexpr uint64_t kTagStepMask = (uint64_t{1} << kTagStepBits) - 1;

/// Builds a tag; `step` is taken modulo 2^24. Throws spade::Error for the reserved kind.
inline uint64_t make_tag(MsgKind kind, uint64_t step, uint16_t pack) {
  SPADE_CHECK(kind != MsgKind::kTransportReserved, "tag kind 0xFF is reserved for the transport");
  return (uint64_t{static_cast<uint8_t>(kind)} << (kTagStepBits + kTagPackBits)) |
         ((step & kTagStepMask) << kTagPackBits) | pack;
}

inline MsgKind tag_kind(uint64_t tag) {
  return static_cast<MsgKind>((tag >> (kTagStepBits + kTagPackBits)) & 0xFF);
}
inline uint32_t tag_step(uint64_t tag) {
  return static_cast<uint32_t>((tag >> kTagPackBits) & kTagStepMask);
}
inline uint16_t tag_pack(uint64_t tag) {
  return static_cast<uint16_t>(tag & 0xFFFF);
}

/// Tag used by implementations for their own control traffic (kind 0xFF); never produced by make_tag.
inline constexpr uint64_t transport_control_tag(uint32_t low) {
  return (uint64_t{0xFF} << (kTagStepBits + kTagPackBits)) | low;
}

}  // namespace spade::transport
