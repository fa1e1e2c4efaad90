#include "coordinator/server_routing.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <vector>

#include "coordinator/client.h"  // kMaxSamplesPerRequest, refusal_chunks

namespace spade::coord {

namespace {

// The final chunk of sample `sample` of a request that failed with `error`.
proto::GenerateChunk error_chunk(uint64_t request_id, const std::string& error, uint32_t sample = 0) {
  proto::GenerateChunk ch;
  ch.set_request_id(request_id);
  ch.set_finished(true);
  ch.set_finish_reason(proto::FINISH_ERROR);
  ch.set_error(error);
  ch.set_index(sample);
  return ch;
}

// The route of a request: one open sample per GenerateRequest.n (0 and 1: one).
Route make_route(std::weak_ptr<Conn> submitter, uint64_t submitter_request_id, uint32_t inference_rank, ChunkSink sink,
                 const proto::GenerateRequest& req) {
  Route r{std::move(submitter), submitter_request_id, inference_rank, std::move(sink), {}, 1};
  r.open_samples = std::max<uint32_t>(1, req.n());
  r.sample_done.assign(r.open_samples, false);
  return r;
}

}  // namespace

RequestRouter::RequestRouter(ServerContext& ctx, const Membership& membership, Connections& conns)
    : ctx_(ctx), membership_(membership), conns_(conns) {}

// ---- request routing
// -------------------------------------------------------------------------------------------

void RequestRouter::send_error_chunk(const ConnPtr& c, uint64_t request_id, const std::string& error,
                                     uint32_t sample) {
  proto::Envelope out;
  *out.mutable_generate_chunk() = error_chunk(request_id, error, sample);
  conns_.send(c, out);
}

// Picks the inference rank for `req`; "" and the rank, or the error text.
std::string RequestRouter::pick_target(const proto::GenerateRequest& req, uint32_t* target) {
  if (ctx_.shutting_down)
    return fmt::format("coordinator: shutting down, cannot route request {}", req.request_id());
  if (req.n() > kMaxSamplesPerRequest)
    return fmt::format("coordinator: request {}: n = {} samples is above the limit of {} per request",
                       req.request_id(), req.n(), kMaxSamplesPerRequest);
  if (!membership_.world_complete())
    return fmt::format("coordinator: world not complete yet, cannot route request {}", req.request_id());
  std::vector<uint32_t> live = membership_.live_inference_ranks();
  if (req.has_target_inference()) {
    auto it = std::find_if(live.begin(), live.end(), [&](uint32_t r) {
      return membership_.member(r).info.role_index() == req.target_inference();
    });
    if (it == live.end())
      return fmt::format("coordinator: inference #{} is not alive (request {})", req.target_inference(),
                         req.request_id());
    *target = *it;
    return "";
  }
  if (live.empty()) return fmt::format("coordinator: no live inference rank (request {})", req.request_id());
  *target = live[rr_++ % live.size()];
  return "";
}

void RequestRouter::forward(uint64_t routed_id, const proto::GenerateRequest& req, uint32_t target) {
  proto::Envelope out;
  *out.mutable_generate_request() = req;
  out.mutable_generate_request()->set_request_id(routed_id);
  conns_.send(membership_.member(target).conn, out);
}

void RequestRouter::on_generate_request(const ConnPtr& c, const proto::GenerateRequest& req) {
  uint32_t target = 0;
  if (auto err = pick_target(req, &target); !err.empty()) {
    for (uint32_t i = 0; i < refusal_chunks(req); ++i) send_error_chunk(c, req.request_id(), err, i);
    return;
  }
  const uint64_t routed_id = next_route_id_++;
  routes_[routed_id] = make_route(c, req.request_id(), target, nullptr, req);
  forward(routed_id, req, target);
  spdlog::debug("coordinator: routed request {} from {} to {} as {}", req.request_id(), c->remote,
                membership_.describe(target), routed_id);
}

void RequestRouter::refuse(const ConnPtr& c, const proto::GenerateRequest& req, const std::string& why) {
  for (uint32_t i = 0; i < refusal_chunks(req); ++i)
    send_error_chunk(c, req.request_id(), fmt::format("coordinator: request {} refused: {}", req.request_id(), why), i);
}

// In-process submission (HTTP API). `routed_id` was reserved by the caller's thread.
void RequestRouter::on_local_request(uint64_t routed_id, const proto::GenerateRequest& req, ChunkSink sink) {
  uint32_t target = 0;
  if (auto err = pick_target(req, &target); !err.empty()) {
    for (uint32_t i = 0; i < refusal_chunks(req); ++i) sink(error_chunk(routed_id, err, i));
    return;
  }
  routes_[routed_id] = make_route({}, routed_id, target, std::move(sink), req);
  forward(routed_id, req, target);
  spdlog::debug("coordinator: routed local request {} to {}", routed_id, membership_.describe(target));
}

// ---- cancellation
// ----------------------------------------------------------------------------------------------

void RequestRouter::send_cancel(uint32_t inference_rank, uint64_t routed_id, const std::string& reason,
                                std::optional<uint32_t> sample) {
  const auto& m = membership_.member(inference_rank);
  if (m.state != proto::ALIVE || !m.conn) return;
  proto::Envelope out;
  out.mutable_cancel_request()->set_request_id(routed_id);
  out.mutable_cancel_request()->set_reason(reason);
  if (sample) out.mutable_cancel_request()->set_index(*sample);
  conns_.send(m.conn, out);
}

void RequestRouter::cancel_route(uint64_t routed_id, const std::string& reason) {
  auto it = routes_.find(routed_id);
  if (it == routes_.end()) return;
  spdlog::info("coordinator: cancelling request {} on {}: {}", routed_id,
               membership_.describe(it->second.inference_rank), reason);
  send_cancel(it->second.inference_rank, routed_id, reason);
  routes_.erase(it);  // later chunks of it are dropped
}

void RequestRouter::cancel_sample(uint64_t routed_id, uint32_t sample, const std::string& reason) {
  auto it = routes_.find(routed_id);
  if (it == routes_.end() || sample >= it->second.sample_done.size() || it->second.sample_done[sample]) return;
  spdlog::info("coordinator: cancelling sample {} of request {} on {}: {}", sample, routed_id,
               membership_.describe(it->second.inference_rank), reason);
  send_cancel(it->second.inference_rank, routed_id, reason, sample);
}

void RequestRouter::on_cancel_request(const ConnPtr& c, const proto::CancelRequest& cr) {
  for (auto& [routed_id, route] : routes_) {
    if (route.submitter.lock() == c && route.submitter_request_id == cr.request_id()) {
      const uint64_t id = routed_id;
      const std::string why = fmt::format("cancelled by {}: {}", c->remote, cr.reason());
      if (cr.has_index()) return cancel_sample(id, cr.index(), why);  // the rank's own last chunk ends the sample
      const uint32_t served_by = route.inference_rank;
      const std::vector<bool> done = route.sample_done;
      cancel_route(id, why);
      // The route is gone, so the rank's own last chunks would be dropped: end the request for its submitter here,
      // so that every sample of a submitted request ends with exactly one final chunk.
      for (uint32_t i = 0; i < done.size(); ++i) {
        if (done[i]) continue;
        proto::Envelope out;
        proto::GenerateChunk* end = out.mutable_generate_chunk();
        end->set_request_id(cr.request_id());
        end->set_finished(true);
        end->set_finish_reason(proto::FINISH_CANCELLED);
        end->set_served_by_rank(served_by);
        end->set_index(i);
        if (c->open) conns_.send(c, out);
      }
      return;
    }
  }
}

// A submitter that went away does not want its requests any more: cancel them on their inference ranks.
void RequestRouter::drop_routes_of_submitter(const ConnPtr& c) {
  for (auto it = routes_.begin(); it != routes_.end();) {
    if (it->second.local_sink) {
      ++it;
      continue;
    }
    auto sub = it->second.submitter.lock();
    if (!sub || sub == c) {
      send_cancel(it->second.inference_rank, it->first, fmt::format("submitter {} disconnected", c->remote));
      it = routes_.erase(it);
    } else {
      ++it;
    }
  }
}

// ---- chunks back to the submitter
// ------------------------------------------------------------------------------

void RequestRouter::on_generate_chunk(const ConnPtr& c, const proto::GenerateChunk& chunk) {
  auto it = routes_.find(chunk.request_id());
  if (it == routes_.end()) {
    spdlog::debug("coordinator: chunk for unknown/finished request {} from {}; dropped", chunk.request_id(),
                  c->remote);
    return;
  }
  if (c->kind != Conn::Kind::kMember || c->rank != it->second.inference_rank) {
    spdlog::warn("coordinator: chunk for request {} from {} which does not serve it; dropped",
                 chunk.request_id(), c->remote + membership_.conn_label(*c));
    return;
  }
  Route& route = it->second;
  if (chunk.index() >= route.sample_done.size()) {
    spdlog::warn("coordinator: chunk for sample {} of request {} (n = {}) from {}; dropped", chunk.index(),
                 chunk.request_id(), route.sample_done.size(), c->remote + membership_.conn_label(*c));
    return;
  }
  if (route.sample_done[chunk.index()]) {
    spdlog::debug("coordinator: chunk for finished sample {} of request {} from {}; dropped", chunk.index(),
                  chunk.request_id(), c->remote);
    return;
  }
  bool ends = false;  // the last open sample's finished chunk: the route ends
  if (chunk.finished()) {
    route.sample_done[chunk.index()] = true;
    ends = --route.open_samples == 0;
  }
  if (route.local_sink) {
    proto::GenerateChunk out = chunk;
    out.set_served_by_rank(c->rank);
    auto sink = route.local_sink;  // the sink may cancel (erase) this route
    if (ends) routes_.erase(it);
    sink(out);
    return;
  }
  ConnPtr sub = route.submitter.lock();
  if (sub && sub->open) {
    proto::Envelope out;
    *out.mutable_generate_chunk() = chunk;
    out.mutable_generate_chunk()->set_request_id(route.submitter_request_id);
    out.mutable_generate_chunk()->set_served_by_rank(c->rank);
    conns_.send(sub, out);
  }
  if (ends) routes_.erase(it);
}

void RequestRouter::fail_routes_of_inference(uint32_t r, const std::string& why) {
  for (auto it = routes_.begin(); it != routes_.end();) {
    if (it->second.inference_rank == r) {
      const std::vector<bool> done = it->second.sample_done;
      if (it->second.local_sink) {
        const uint64_t id = it->first;
        auto sink = std::move(it->second.local_sink);
        it = routes_.erase(it);
        for (uint32_t i = 0; i < done.size(); ++i) {
          if (done[i]) continue;
          proto::GenerateChunk ch = error_chunk(id, why, i);
          ch.set_served_by_rank(r);
          sink(ch);
        }
        continue;
      }
      if (auto sub = it->second.submitter.lock(); sub && sub->open) {
        for (uint32_t i = 0; i < done.size(); ++i)
          if (!done[i]) send_error_chunk(sub, it->second.submitter_request_id, why, i);
      }
      it = routes_.erase(it);
    } else {
      ++it;
    }
  }
}

}  // namespace spade::coord
