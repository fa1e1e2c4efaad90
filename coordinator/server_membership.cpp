#include "coordinator/server_membership.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <algorithm>

#include "coordinator/launch_env.h"

namespace spade::coord {

Membership::Membership(ServerContext& ctx, Connections& conns, MembershipEvents& events)
    : ctx_(ctx), conns_(conns), events_(events) {
  const auto& rm = ctx_.opts.role_map;
  num_inference_ = static_cast<uint32_t>(std::count(rm.begin(), rm.end(), proto::INFERENCE));
  num_cache_ = static_cast<uint32_t>(std::count(rm.begin(), rm.end(), proto::CACHE));
  cache_per_inference_ = cache_ranks_per_inference(num_inference_, num_cache_);
  for (uint32_t r = 0; r < rm.size(); ++r) {
    Member m;
    m.info.set_role(rm[r]);
    m.info.set_rank(r);
    m.info.set_role_index(role_index_of(r));
    if (rm[r] == proto::CACHE) m.info.set_shard(m.info.role_index() % cache_per_inference_);
    m.state = rm[r] == proto::COORDINATOR ? proto::ALIVE : proto::MISSING;
    if (rm[r] == proto::COORDINATOR) {
      m.info.set_host(asio::ip::host_name());
      m.info.set_pid(static_cast<uint32_t>(::getpid()));
      m.info.set_device("cpu");
    }
    members_.push_back(std::move(m));
  }
}

// ---- queries
// ---------------------------------------------------------------------------------------------------

uint32_t Membership::role_index_of(uint32_t r) const {
  const auto& rm = ctx_.opts.role_map;
  return static_cast<uint32_t>(std::count(rm.begin(), rm.begin() + r, rm[r]));
}

std::string Membership::describe(uint32_t r) const {
  const auto& m = members_[r];
  std::string s = fmt::format("{} rank {} (#{})", role_name(m.info.role()), r, m.info.role_index());
  if (m.conn) s += fmt::format(" at {}", m.conn->remote);
  if (!m.info.host().empty()) s += fmt::format(" [host {} pid {}]", m.info.host(), m.info.pid());
  return s;
}

std::string Membership::conn_label(const Conn& c) const {
  if (c.kind == Conn::Kind::kMember) return " (" + describe(c.rank) + ")";
  if (c.kind == Conn::Kind::kClient) return " (client)";
  return "";
}

std::string Membership::role_map_string() const {
  const auto& rm = ctx_.opts.role_map;
  std::string s;
  for (size_t i = 0; i < rm.size(); ++i) {
    if (i) s += ',';
    auto r = rm[i];
    s += r == proto::COORDINATOR ? 'c' : r == proto::INFERENCE ? 'i' : 'k';
  }
  return s;
}

std::vector<uint32_t> Membership::paired_ranks(uint32_t r) const {
  // inference #i <-> cache #(i*N + s), s = 0..N-1: an inference rank's cache ranks in shard order; a cache rank's one
  // inference rank.
  const auto& info = members_[r].info;
  std::vector<uint32_t> out;
  const uint32_t n = cache_per_inference_;
  auto rank_of = [&](proto::Role role, uint32_t index) {
    for (uint32_t q = 0; q < members_.size(); ++q)
      if (members_[q].info.role() == role && members_[q].info.role_index() == index) out.push_back(q);
  };
  if (info.role() == proto::INFERENCE)
    for (uint32_t s = 0; s < n; ++s) rank_of(proto::CACHE, info.role_index() * n + s);
  else if (info.role() == proto::CACHE && n > 0)
    rank_of(proto::INFERENCE, info.role_index() / n);
  return out;
}

std::vector<uint32_t> Membership::live_inference_ranks() const {
  std::vector<uint32_t> live;
  for (uint32_t r = 0; r < members_.size(); ++r) {
    const auto& m = members_[r];
    if (m.info.role() == proto::INFERENCE && m.state == proto::ALIVE && m.conn) live.push_back(r);
  }
  return live;
}

void Membership::count_live(uint32_t* inference, uint32_t* cache) const {
  for (const auto& m : members_) {
    if (m.state != proto::ALIVE || !m.conn) continue;
    if (m.info.role() == proto::INFERENCE) ++*inference;
    if (m.info.role() == proto::CACHE) ++*cache;
  }
}

std::vector<std::string> Membership::missing_ranks() const {
  std::vector<std::string> missing;
  for (uint32_t r = 0; r < members_.size(); ++r) {
    const auto& m = members_[r];
    if (m.state != proto::ALIVE) {
      missing.push_back(fmt::format("{} ({} #{})", r, role_name(m.info.role()), m.info.role_index()));
    }
  }
  return missing;
}

std::string Membership::degraded() const {
  if (!world_complete_) return "";
  std::string out;
  for (uint32_t r = 0; r < members_.size(); ++r) {
    const auto& m = members_[r];
    if (m.info.role() == proto::COORDINATOR) continue;
    std::string why;
    if (m.state != proto::ALIVE)
      why = fmt::format("{} rank {} (#{}) is dead ({}); waiting for its replacement", role_name(m.info.role()), r,
                        m.info.role_index(), m.dead_reason);
    else if (!m.view_sent)
      why = fmt::format("{} rank {} (#{}) incarnation {} is re-pairing", role_name(m.info.role()), r,
                        m.info.role_index(), m.info.incarnation());
    if (why.empty()) continue;
    out += (out.empty() ? "" : "; ") + why;
  }
  return out;
}

// ---- status
// ----------------------------------------------------------------------------------------------------

proto::StatusReply Membership::build_status() const {
  proto::StatusReply st;
  auto now = Clock::now();
  st.set_world_complete(world_complete_);
  st.set_world_size(static_cast<uint32_t>(members_.size()));
  st.set_uptime_ms(age_ms(ctx_.start_time, now));
  st.set_shutting_down(ctx_.shutting_down);
  st.set_session_id(ctx_.session_id);
  for (const auto& m : members_) {
    if (m.info.role() == proto::COORDINATOR) continue;
    auto* rs = st.add_ranks();
    *rs->mutable_info() = m.info;
    rs->set_state(m.state);
    if (m.state != proto::MISSING) rs->set_last_heartbeat_age_ms(age_ms(m.last_seen, now));
    rs->set_heartbeat_seq(m.heartbeat_seq);
    rs->set_dead_reason(m.dead_reason);
    for (const auto& [k, v] : m.stats) (*rs->mutable_stats())[k] = v;
  }
  return st;
}

// ---- registration
// ----------------------------------------------------------------------------------------------

void Membership::reject_registration(const ConnPtr& c, const std::string& error) {
  spdlog::warn("coordinator: registration from {} rejected: {}", c->remote, error);
  proto::Envelope out;
  out.mutable_register_reply()->set_error(error);
  out.mutable_register_reply()->set_world_size(static_cast<uint32_t>(members_.size()));
  conns_.send(c, out);
  conns_.close_gracefully(c);
}

// The RegisterReply of an accepted registration (client or rank).
void Membership::send_register_reply(const ConnPtr& c) {
  proto::Envelope out;
  auto* rep = out.mutable_register_reply();
  if (c->kind == Conn::Kind::kMember) rep->set_incarnation(members_[c->rank].info.incarnation());
  rep->set_world_size(static_cast<uint32_t>(members_.size()));
  rep->set_heartbeat_interval_ms(static_cast<uint32_t>(ctx_.opts.heartbeat_interval.count()));
  rep->set_heartbeat_timeout_ms(static_cast<uint32_t>(ctx_.opts.heartbeat_timeout.count()));
  rep->set_session_id(ctx_.session_id);
  conns_.send(c, out);
}

void Membership::on_register(const ConnPtr& c, const proto::RegisterRequest& req) {
  const auto& self = req.self();
  if (c->kind != Conn::Kind::kUnregistered) {
    return reject_registration(c, fmt::format("connection already registered{}", conn_label(*c)));
  }
  if (req.protocol_version() != proto::kProtocolVersion) {
    return reject_registration(c, fmt::format("protocol version {} is not supported (coordinator speaks {})",
                                              req.protocol_version(), proto::kProtocolVersion));
  }
  if (self.role() == proto::CLIENT) return register_client(c, self);
  std::string who = fmt::format("{} rank {} (#{}) from {}", role_name(self.role()), self.rank(),
                                self.role_index(), c->remote);
  if (auto err = rank_registration_error(req, who); !err.empty()) return reject_registration(c, err);
  register_rank(c, self);
}

void Membership::register_client(const ConnPtr& c, const proto::RankInfo& self) {
  c->kind = Conn::Kind::kClient;
  spdlog::info("coordinator: client registered from {} (host {} pid {})", c->remote, self.host(), self.pid());
  send_register_reply(c);
}

std::string Membership::rank_registration_error(const proto::RegisterRequest& req,
                                                const std::string& who) const {
  const auto& self = req.self();
  const uint32_t world = static_cast<uint32_t>(members_.size());
  if (self.role() != proto::INFERENCE && self.role() != proto::CACHE) {
    return fmt::format("{}: role {} cannot register (only inference, cache or client)", who,
                       role_name(self.role()));
  }
  if (req.world_size() != 0 && req.world_size() != world) {
    return fmt::format(
        "{}: launched with world size {} but the coordinator's world size is "
        "{} (role map {})",
        who, req.world_size(), world, role_map_string());
  }
  if (self.rank() >= world) {
    return fmt::format("{}: rank {} is out of range for world size {}", who, self.rank(), world);
  }
  const auto& m = members_[self.rank()];
  if (m.info.role() != self.role() || m.info.role_index() != self.role_index()) {
    return fmt::format("{}: the role map {} says rank {} is {} #{}", who, role_map_string(), self.rank(),
                       role_name(m.info.role()), m.info.role_index());
  }
  if (m.state == proto::ALIVE) {
    // No split brain: a replacement is admitted only once the coordinator declared the holder dead.
    return fmt::format(
        "{}: duplicate registration, rank {} is already registered by {} and alive (incarnation {}); a replacement "
        "is admitted only after the coordinator declared it dead",
        who, self.rank(), describe(self.rank()), m.info.incarnation());
  }
  return "";  // MISSING, or DEAD: a replacement (a new incarnation)
}

void Membership::register_rank(const ConnPtr& c, const proto::RankInfo& self) {
  // Accept.
  auto& m = members_[self.rank()];
  const bool replacement = m.state == proto::DEAD;
  proto::RankInfo info = self;
  info.set_rank(self.rank());
  info.set_shard(m.info.shard());  // the coordinator's (role map), whatever the rank sent
  info.set_incarnation(replacement ? m.info.incarnation() + 1 : 0);
  m.info = info;
  m.state = proto::ALIVE;
  m.view_sent = false;
  m.conn = c;
  m.last_seen = Clock::now();
  m.heartbeat_seq = 0;
  m.stats.clear();
  c->kind = Conn::Kind::kMember;
  c->rank = self.rank();
  spdlog::info("coordinator: registered {} (device {}, transport {} bytes){}", describe(self.rank()),
               self.device(), self.transport().address().size(),
               replacement ? fmt::format(", replacing incarnation {} declared dead ({})", m.info.incarnation() - 1,
                                         m.dead_reason)
                           : std::string());
  send_register_reply(c);
  if (replacement) return pair_replacement(self.rank());
  maybe_complete();
}

// A replacement joins a complete world. Its peers, when alive and paired, re-handshake with it:
//   replacement cache rank     -> PeerReplaced to the inference rank, which answers with a PairOffer (its data-plane
//                                 address; for NCCL fresh ids); on_pair_offer then sends the replacement its view.
//   replacement inference rank -> PeerReplaced to each of its paired cache ranks, and its ClusterView (the cache
//                                 ranks' addresses) once all N of them are alive.
// A peer that is itself a replacement still waiting for its view (both died) gets it now, as at the first pairing;
// a dead peer leaves the replacement waiting for the peer's own replacement (its rendezvous deadline bounds that).
void Membership::pair_replacement(uint32_t r) {
  auto& m = members_[r];
  auto live = [&](uint32_t q) { return members_[q].state == proto::ALIVE && members_[q].conn != nullptr; };
  const std::vector<uint32_t> peers = paired_ranks(r);
  if (m.info.role() == proto::CACHE) {
    for (uint32_t q : peers) {  // its one inference rank
      if (!live(q)) continue;
      if (!members_[q].view_sent) {  // both were replaced: pair them as at the world's start
        pair_inference(q);
        continue;
      }
      proto::Envelope out;
      *out.mutable_peer_replaced()->mutable_peer() = m.info;
      out.mutable_peer_replaced()->set_previous_reason(m.dead_reason);
      conns_.send(members_[q].conn, out);
      spdlog::info("coordinator: sent PeerReplaced({} incarnation {}) to {}", r, m.info.incarnation(), describe(q));
    }
    return;
  }
  for (uint32_t q : peers) {
    if (!live(q) || !members_[q].view_sent) continue;  // a waiting replacement gets its view with ours
    proto::Envelope out;
    *out.mutable_peer_replaced()->mutable_peer() = m.info;
    out.mutable_peer_replaced()->set_previous_reason(m.dead_reason);
    conns_.send(members_[q].conn, out);
    spdlog::info("coordinator: sent PeerReplaced({} incarnation {}) to {}", r, m.info.incarnation(), describe(q));
  }
  pair_inference(r);
}

// Inference rank `r` waits for its view: sends it, and their views to its cache ranks still waiting for theirs, once
// the rank and all its N cache ranks are alive (the view names every shard's current address).
void Membership::pair_inference(uint32_t r) {
  auto live = [&](uint32_t q) { return members_[q].state == proto::ALIVE && members_[q].conn != nullptr; };
  if (!live(r) || members_[r].view_sent) return;
  const std::vector<uint32_t> peers = paired_ranks(r);
  for (uint32_t q : peers)
    if (!live(q)) return;
  send_cluster_view(r);
  for (uint32_t q : peers)
    if (!members_[q].view_sent) send_cluster_view(q);
}

void Membership::on_pair_offer(const ConnPtr& c, const proto::PairOffer& offer) {
  const uint32_t from = c->rank;
  const uint32_t r = offer.peer_rank();
  auto stale = [&](const std::string& why) {
    spdlog::warn("coordinator: ignoring a pair offer from {} for rank {} incarnation {}: {}", describe(from), r,
                 offer.peer_incarnation(), why);
  };
  if (members_[from].info.role() != proto::INFERENCE) return stale("only an inference rank offers a pairing");
  if (r >= members_.size()) return stale("no such rank");
  const auto pairs = paired_ranks(from);
  if (std::find(pairs.begin(), pairs.end(), r) == pairs.end()) return stale("not its paired cache rank");
  auto& m = members_[r];
  if (m.state != proto::ALIVE || !m.conn) return stale("that rank is not alive");
  if (m.info.incarnation() != offer.peer_incarnation())
    return stale(fmt::format("the rank's incarnation is {}", m.info.incarnation()));
  if (m.view_sent) return stale("that incarnation is paired already");
  *members_[from].info.mutable_transport() = offer.transport();
  spdlog::info("coordinator: {} offered its data plane ({} bytes) to {}; sending its ClusterView", describe(from),
               offer.transport().address().size(), describe(r));
  send_cluster_view(r);
}

void Membership::maybe_complete() {
  if (world_complete_) return;
  for (const auto& m : members_) {
    if (m.state != proto::ALIVE) return;
  }
  world_complete_ = true;
  events_.on_world_complete();
  spdlog::info("coordinator: world complete ({} inference + {} cache ranks) after {} ms; pairing {}",
               num_inference_, num_cache_, age_ms(ctx_.start_time, Clock::now()), pairing_rule(cache_per_inference_));
  for (uint32_t r = 0; r < members_.size(); ++r) send_cluster_view(r);
}

void Membership::send_cluster_view(uint32_t r) {
  auto& m = members_[r];
  if (!m.conn) return;
  m.view_sent = true;
  proto::Envelope out;
  auto* view = out.mutable_cluster_view();
  *view->mutable_self() = m.info;
  for (uint32_t q : paired_ranks(r)) *view->add_peers() = members_[q].info;
  view->set_world_size(static_cast<uint32_t>(members_.size()));
  view->set_num_inference(num_inference_);
  view->set_num_cache(num_cache_);
  view->set_pairing_rule(pairing_rule(cache_per_inference_));
  view->set_cache_ranks_per_inference(cache_per_inference_);
  view->set_session_id(ctx_.session_id);
  view->set_served_model_name(ctx_.opts.served_model_name);
  conns_.send(m.conn, out);
}

// ---- liveness
// --------------------------------------------------------------------------------------------------

void Membership::touch(const ConnPtr& c) {
  if (c->kind != Conn::Kind::kMember) return;
  auto& m = members_[c->rank];
  if (m.conn == c) m.last_seen = Clock::now();
}

void Membership::on_heartbeat(const ConnPtr& c, const proto::Heartbeat& hb) {
  proto::Envelope ack;
  ack.mutable_heartbeat_ack()->set_seq(hb.seq());
  if (c->kind == Conn::Kind::kClient) {  // keeps the client's connection from the idle timeout
    conns_.send(c, ack);
    return;
  }
  if (c->kind != Conn::Kind::kMember) {
    spdlog::warn("coordinator: rejecting connection from {}: heartbeat before registration; closing it",
                 c->remote);
    conns_.close(c, "protocol error: heartbeat before registration");
    return;
  }
  auto& m = members_[c->rank];
  if (hb.rank() != c->rank) {
    spdlog::warn("coordinator: heartbeat from {} carries rank {}; ignoring the field", describe(c->rank),
                 hb.rank());
  }
  m.heartbeat_seq = hb.seq();
  m.stats.clear();
  for (const auto& [k, v] : hb.stats()) m.stats[k] = v;
  conns_.send(c, ack);
}

void Membership::check_heartbeats() {
  auto now = Clock::now();
  for (uint32_t r = 0; r < members_.size(); ++r) {
    auto& m = members_[r];
    if (m.state != proto::ALIVE || !m.conn) continue;
    auto silent = age_ms(m.last_seen, now);
    if (silent > static_cast<uint64_t>(ctx_.opts.heartbeat_timeout.count())) {
      on_member_lost(r, fmt::format("no heartbeat for {} ms (timeout {} ms)", silent,
                                    ctx_.opts.heartbeat_timeout.count()));
    }
  }
}

void Membership::on_connection_closed(const ConnPtr& c, const std::string& why) {
  auto& m = members_[c->rank];
  if (m.conn == c && m.state == proto::ALIVE) on_member_lost(c->rank, why);
}

// A registered rank's connection dropped or its heartbeats stopped.
void Membership::on_member_lost(uint32_t r, const std::string& why) {
  if (!world_complete_) return free_slot(r, why);
  declare_dead(r, why);
  send_peer_down(r, why);
  events_.on_rank_dead(r, fmt::format("{} died: {}", describe(r), why));
}

// Before the world is complete a lost rank just gives its slot back; it may register again.
void Membership::free_slot(uint32_t r, const std::string& why) {
  auto& m = members_[r];
  spdlog::warn("coordinator: {} lost before the world was complete ({}); its slot is free again", describe(r),
               why);
  ConnPtr c = m.conn;
  m.state = proto::MISSING;
  m.conn.reset();
  if (c && c->open) {
    c->kind = Conn::Kind::kUnregistered;
    conns_.close(c, why);
  }
}

// Marks `r` DEAD for good and tells it so (Shutdown{is_error}) when its connection is still open.
void Membership::declare_dead(uint32_t r, const std::string& why) {
  auto& m = members_[r];
  m.state = proto::DEAD;
  m.dead_reason = why;
  spdlog::error("coordinator: {} declared dead: {}", describe(r), why);
  ConnPtr c = m.conn;
  m.conn.reset();
  if (c && c->open) {
    proto::Envelope bye;
    bye.mutable_shutdown()->set_reason(fmt::format("coordinator declared {} dead: {}", describe(r), why));
    bye.mutable_shutdown()->set_is_error(true);
    conns_.send(c, bye);
    c->kind = Conn::Kind::kUnregistered;
    conns_.close_gracefully(c);
  }
}

// PeerDown(r) to every live rank paired with `r` and, for a cache rank that is one of N > 1 layer shards, to the
// other shards of its inference rank (a GPU cache rank ends then: its inference rank aborted every shard's link and
// re-pairs the N shards together; a CPU cache rank ignores it).
void Membership::send_peer_down(uint32_t r, const std::string& why) {
  const auto& m = members_[r];
  std::vector<uint32_t> to = paired_ranks(r);
  const uint32_t n = cache_per_inference_;
  if (m.info.role() == proto::CACHE && n > 1)
    for (uint32_t q = 0; q < members_.size(); ++q)
      if (q != r && members_[q].info.role() == proto::CACHE &&
          members_[q].info.role_index() / n == m.info.role_index() / n)
        to.push_back(q);
  for (uint32_t q : to) {
    auto& peer = members_[q];
    if (peer.state != proto::ALIVE || !peer.conn) continue;
    proto::Envelope out;
    auto* pd = out.mutable_peer_down();
    pd->set_rank(r);
    pd->set_role(m.info.role());
    pd->set_role_index(m.info.role_index());
    pd->set_host(m.info.host());
    pd->set_reason(why);
    pd->set_incarnation(m.info.incarnation());
    conns_.send(peer.conn, out);
    spdlog::info("coordinator: sent PeerDown({}) to {}", r, describe(q));
  }
}

}  // namespace spade::coord
