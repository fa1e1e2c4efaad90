#include "pair/link.h"

#include <cstring>

#include "common/error.h"
#include "transport/tags.h"

namespace spade::pair {

using transport::Status;

uint64_t link_up_prefix_tag() { return transport::make_tag(transport::MsgKind::kControl, 0, 1); }
uint64_t link_up_tag() { return transport::make_tag(transport::MsgKind::kQkvPack, 0, 0); }
uint64_t link_down_prefix_tag() { return transport::make_tag(transport::MsgKind::kControl, 0, 2); }
uint64_t link_down_tag() { return transport::make_tag(transport::MsgKind::kSelectedKv, 0, 0); }

// ---- over a transport ----

TransportLink::TransportLink(std::unique_ptr<transport::Endpoint> ep, PackShape shape)
    : ep_(std::move(ep)), shape_(shape) {}

TransportLink::~TransportLink() {
  // Outstanding sends must not outlive their buffers: give them a moment, then abort the endpoint.
  const auto deadline = transport::Clock::now() + std::chrono::milliseconds(500);
  for (auto& m : sends_) {
    if (m->h1.valid() && m->h1.wait(deadline) == Status::TIMEOUT) ep_->abort("link closed");
    if (m->h2.valid() && m->h2.wait(deadline) == Status::TIMEOUT) ep_->abort("link closed");
  }
  for (auto& r : pending_recvs_) r->h.cancel();
}

void TransportLink::reap_sends() {
  while (!sends_.empty()) {
    OutMsg& m = *sends_.front();
    const Status s1 = m.h1.poll(), s2 = m.h2.valid() ? m.h2.poll() : Status::OK;
    if (s1 == Status::PENDING || s2 == Status::PENDING) break;
    if (s1 == Status::FAILED || s2 == Status::FAILED)
      fail("cache rank {} failed: {}", ep_->peer_name(), s1 == Status::FAILED ? m.h1.error() : m.h2.error());
    sends_.pop_front();
  }
}

void TransportLink::send(PackUpdate&& u) {
  if (ep_->failed()) fail("cache rank {} is unreachable: {}", ep_->peer_name(), ep_->failure());
  reap_sends();
  auto m = std::make_unique<OutMsg>();
  m->payload = encode(u, shape_);
  m->prefix.kind = 1;
  m->prefix.payload_bytes = m->payload.size();
  m->h1 = ep_->post_send(link_up_prefix_tag(), &m->prefix, sizeof(FramePrefix));
  m->h2 = ep_->post_send(link_up_tag(), m->payload.data(), m->payload.size());
  stats_.bytes_sent += m->payload.size();
  ++stats_.updates;
  sends_.push_back(std::move(m));
  // The answer's prefix can be received as soon as it arrives.
  auto r = std::make_unique<InMsg>();
  r->h = ep_->post_recv(link_down_prefix_tag(), &r->prefix, sizeof(FramePrefix));
  pending_recvs_.push_back(std::move(r));
}

PackSelection TransportLink::receive(transport::Deadline deadline, bool* waited) {
  SPADE_CHECK(!pending_recvs_.empty(), "cache rank {}: receive without a pending update", ep_->peer_name());
  InMsg& r = *pending_recvs_.front();
  Status s = r.h.poll();
  if (waited) *waited = s == Status::PENDING;
  if (s == Status::PENDING) s = r.h.wait(deadline);
  if (s == Status::TIMEOUT)
    fail("cache rank {}: selection not received before the deadline (selection stall)", ep_->peer_name());
  if (s != Status::OK) fail("cache rank {} failed: {}", ep_->peer_name(), r.h.error());
  if (r.prefix.magic != FramePrefix::kMagic || r.prefix.kind != 2 || r.prefix.payload_bytes > (uint64_t{1} << 34))
    fail("cache rank {}: malformed frame prefix (magic {:#x}, kind {}, {} bytes)", ep_->peer_name(), r.prefix.magic,
         r.prefix.kind, r.prefix.payload_bytes);
  std::vector<uint8_t> payload(r.prefix.payload_bytes);
  auto h = ep_->post_recv(link_down_tag(), payload.data(), payload.size());
  s = h.wait(deadline);
  if (s == Status::TIMEOUT) {
    h.cancel();
    fail("cache rank {}: selection payload not received before the deadline", ep_->peer_name());
  }
  if (s != Status::OK) fail("cache rank {} failed: {}", ep_->peer_name(), h.error());
  pending_recvs_.pop_front();
  stats_.bytes_received += payload.size();
  reap_sends();
  PackSelection p = decode_selection(payload.data(), payload.size(), shape_, ep_->peer_name());
  stats_.cache_select_ms += p.select_ms;
  if (!p.error.empty()) fail("cache rank {}: {}", ep_->peer_name(), p.error);
  return p;
}

std::string TransportLink::failure() const {
  return ep_->failed() ? fmt::format("{} is unreachable: {}", ep_->peer_name(), ep_->failure()) : std::string();
}

void TransportLink::shutdown() {
  if (ep_->failed()) return;
  FramePrefix f;
  f.kind = 3;
  auto h = ep_->post_send(link_up_prefix_tag(), &f, sizeof(f));
  h.wait(transport::Clock::now() + std::chrono::milliseconds(500));
}

}  // namespace spade::pair
