#include "cache_rank/link.h"

#include <cstring>

#include "common/error.h"
#include "transport/tags.h"

namespace spade::cache {

using transport::Status;

uint64_t link_up_prefix_tag() { return transport::make_tag(transport::MsgKind::kControl, 0, 1); }
uint64_t link_up_tag() { return transport::make_tag(transport::MsgKind::kQkvPack, 0, 0); }
uint64_t link_down_prefix_tag() { return transport::make_tag(transport::MsgKind::kControl, 0, 2); }
uint64_t link_down_tag() { return transport::make_tag(transport::MsgKind::kSelectedKv, 0, 0); }

// ---- in-process ----

InProcessLink::InProcessLink(const ModelConfig& cfg, const SelectionConfig& sc, int num_pages, int page_size,
                             bool delta)
    : sel_(cfg, sc, num_pages, page_size),
      mirror_(delta ? std::make_unique<SelectionMirror>(cfg.num_kv_heads, sc.token_budget, cfg.head_dim) : nullptr) {}

void InProcessLink::send(PackUpdate&& u) {
  ++stats_.updates;
  done_.push_back(process_pack(sel_, u, sampler_));
  if (mirror_) mirror_->to_delta(u, done_.back());
  stats_.cache_select_ms += done_.back().select_ms;
}

PackSelection InProcessLink::receive(transport::Deadline, bool* waited) {
  SPADE_CHECK(!done_.empty(), "in-process cache rank: receive without a pending update");
  if (waited) *waited = false;
  PackSelection p = std::move(done_.front());
  done_.pop_front();
  if (!p.error.empty()) fail("in-process cache rank: {}", p.error);
  return p;
}

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

void TransportLink::shutdown() {
  if (ep_->failed()) return;
  FramePrefix f;
  f.kind = 3;
  auto h = ep_->post_send(link_up_prefix_tag(), &f, sizeof(f));
  h.wait(transport::Clock::now() + std::chrono::milliseconds(500));
}

// ---- the cache rank's side ----

std::string serve_cache_rank(transport::Endpoint& ep, Selector& sel, const PackShape& shape,
                             const std::atomic<bool>& stop, LinkStats* stats, std::chrono::milliseconds poll,
                             const ServeHooks& hooks) {
  std::deque<std::pair<std::unique_ptr<std::pair<FramePrefix, std::vector<uint8_t>>>,
                       std::pair<transport::SendHandle, transport::SendHandle>>>
      out;
  auto reap = [&]() -> std::string {
    while (!out.empty()) {
      const Status a = out.front().second.first.poll(), b = out.front().second.second.poll();
      if (a == Status::PENDING || b == Status::PENDING) break;
      if (a == Status::FAILED) return out.front().second.first.error();
      if (b == Status::FAILED) return out.front().second.second.error();
      out.pop_front();
    }
    return "";
  };
  while (!stop.load()) {
    FramePrefix f;
    auto h = ep.post_recv(link_up_prefix_tag(), &f, sizeof(f));
    Status s;
    while ((s = h.wait_for(poll)) == Status::TIMEOUT) {
      if (hooks.on_poll) hooks.on_poll();
      if (stop.load()) {
        h.cancel();
        return "";
      }
      if (std::string e = reap(); !e.empty()) return e;
    }
    if (s != Status::OK) return h.error();
    if (f.magic != FramePrefix::kMagic || (f.kind != 1 && f.kind != 3) || f.payload_bytes > (uint64_t{1} << 34))
      return fmt::format("{}: malformed frame prefix (magic {:#x}, kind {}, {} bytes)", ep.peer_name(), f.magic,
                         f.kind, f.payload_bytes);
    if (f.kind == 3) return "";
    std::vector<uint8_t> payload(f.payload_bytes);
    auto hp = ep.post_recv(link_up_tag(), payload.data(), payload.size());
    while ((s = hp.wait_for(poll)) == Status::TIMEOUT)
      if (stop.load()) return "";
    if (s != Status::OK) return hp.error();
    PackSelection sel_out;
    PackUpdate u;
    try {
      u = decode_update(payload.data(), payload.size(), shape, ep.peer_name());
      sel_out = process_pack(sel, u, hooks.sampler);
      if (hooks.mirror) hooks.mirror->to_delta(u, sel_out);
    } catch (const Error& e) {
      sel_out.error = e.what();
    }
    auto msg = std::make_unique<std::pair<FramePrefix, std::vector<uint8_t>>>();
    msg->second = encode(sel_out, shape);
    if (hooks.on_poll) hooks.on_poll();
    if (hooks.on_pack) hooks.on_pack(u, sel_out, payload.size() + sizeof(FramePrefix),
                                     msg->second.size() + sizeof(FramePrefix));
    msg->first.kind = 2;
    msg->first.payload_bytes = msg->second.size();
    if (stats) {
      stats->bytes_received += payload.size();
      stats->bytes_sent += msg->second.size();
      ++stats->updates;
      stats->cache_select_ms += sel_out.select_ms;
    }
    auto s1 = ep.post_send(link_down_prefix_tag(), &msg->first, sizeof(FramePrefix));
    auto s2 = ep.post_send(link_down_tag(), msg->second.data(), msg->second.size());
    out.emplace_back(std::move(msg), std::make_pair(s1, s2));
    if (std::string e = reap(); !e.empty()) return e;
  }
  return "";
}

}  // namespace spade::cache
