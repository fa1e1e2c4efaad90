#include "transport/loopback.h"

#include <fmt/format.h>

#include <atomic>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <set>

#include "common/error.h"
#include "transport/op.h"

namespace spade::transport {
namespace {

std::atomic<uint64_t> g_next_fabric_id{1};

struct Pending {
  std::shared_ptr<detail::Op> op;
  uint64_t ep_id;
};

struct Channel {              // messages from node `src` to node `dst`
  std::deque<Pending> sends;  // posted by src's endpoint to dst, not yet matched
  std::deque<Pending> recvs;  // posted by dst's endpoint to src, not yet matched
};

struct EpRecord {
  uint64_t owner = 0;  // node that owns the endpoint
  uint64_t peer = 0;   // node it talks to
  std::string peer_name;
  bool failed = false;
  std::string failure;
};

struct Node {
  std::string name;
  bool alive = true;
  std::string death;
};

class FabricImpl;

// Completion owner of the ops of one endpoint.
class EpOwner : public detail::OpOwner {
 public:
  EpOwner(std::shared_ptr<FabricImpl> f, uint64_t id) : fabric(std::move(f)), ep_id(id) {}
  void cancel_op(const std::shared_ptr<detail::Op>& op) override;
  std::shared_ptr<FabricImpl> fabric;
  uint64_t ep_id;
};

class FabricImpl : public LoopbackFabric, public std::enable_shared_from_this<FabricImpl> {
 public:
  FabricImpl() : id_(g_next_fabric_id++) {}

  std::unique_ptr<Transport> make_transport(const std::string& name) override;

  void kill(const std::string& address, const std::string& reason) override {
    std::lock_guard lk(mu_);
    uint64_t node = parse_address(address);
    kill_locked(node, reason);
  }

  void kill_locked(uint64_t node, const std::string& reason) {
    auto& n = nodes_.at(node);
    if (!n.alive) return;
    n.alive = false;
    n.death = reason;
    for (auto& [id, ep] : eps_) {
      if (ep.owner == node) {
        fail_endpoint_locked(id, fmt::format("transport of {} closed: {}", n.name, reason));
      } else if (ep.peer == node) {
        fail_endpoint_locked(id, fmt::format("peer {} died: {}", ep.peer_name, reason));
      }
    }
  }

  uint64_t parse_address(const std::string& address) const {
    unsigned long long fab = 0, node = 0;
    char tail = 0;
    if (std::sscanf(address.c_str(), "loopback:%llu:%llu%c", &fab, &node, &tail) != 2) {
      fail("loopback transport: malformed address '{}' (expected loopback:<fabric>:<node>)", address);
    }
    SPADE_CHECK(fab == id_, "loopback transport: address '{}' belongs to another fabric (this is fabric {})",
                address, id_);
    SPADE_CHECK(nodes_.count(node), "loopback transport: unknown node in address '{}'", address);
    return node;
  }

  std::string address_of(uint64_t node) const { return fmt::format("loopback:{}:{}", id_, node); }

  uint64_t add_node(const std::string& name) {
    std::lock_guard lk(mu_);
    uint64_t id = next_node_++;
    nodes_[id] = Node{name, true, ""};
    return id;
  }

  void close_node(uint64_t node) {
    std::lock_guard lk(mu_);
    kill_locked(node, "transport destroyed");
  }

  uint64_t connect(uint64_t self, const std::string& peer_address, const std::string& peer_name) {
    std::lock_guard lk(mu_);
    uint64_t peer = parse_address(peer_address);
    const auto& me = nodes_.at(self);
    SPADE_CHECK(me.alive, "loopback transport {}: cannot connect to {}: this transport is closed ({})",
                me.name, peer_name, me.death);
    const auto& pn = nodes_.at(peer);
    SPADE_CHECK(pn.alive, "loopback transport {}: cannot connect to peer {} ({}): it died: {}", me.name,
                peer_name, peer_address, pn.death);
    for (const auto& [id, ep] : eps_) {
      SPADE_CHECK(!(ep.owner == self && ep.peer == peer && !ep.failed),
                  "loopback transport {}: already connected to peer {} ({})", me.name, peer_name,
                  peer_address);
    }
    uint64_t id = next_ep_++;
    eps_[id] = EpRecord{self, peer, peer_name, false, ""};
    if (auto it = broken_.find({self, peer}); it != broken_.end()) {
      fail_endpoint_locked(id, it->second);
    }
    return id;
  }

  std::shared_ptr<detail::Op> post(uint64_t ep_id, detail::Op::Kind kind, uint64_t tag, void* buf,
                                   size_t size, const std::shared_ptr<detail::OpOwner>& owner) {
    auto op = std::make_shared<detail::Op>(kind, tag, buf, size, owner);
    std::lock_guard lk(mu_);
    auto& ep = eps_.at(ep_id);
    if (ep.failed) {
      op->complete(Status::FAILED, 0, ep.failure);
      return op;
    }
    if (kind == detail::Op::Kind::kSend) {
      auto& ch = channels_[{ep.owner, ep.peer}];
      for (auto it = ch.recvs.begin(); it != ch.recvs.end(); ++it) {
        if (it->op->tag == tag) {
          auto recv = *it;
          ch.recvs.erase(it);
          deliver(op, recv.op, eps_.at(recv.ep_id).peer_name);
          return op;
        }
      }
      ch.sends.push_back(Pending{op, ep_id});
    } else {
      auto& ch = channels_[{ep.peer, ep.owner}];
      for (auto it = ch.sends.begin(); it != ch.sends.end(); ++it) {
        if (it->op->tag == tag) {
          auto send = *it;
          ch.sends.erase(it);
          deliver(send.op, op, ep.peer_name);
          return op;
        }
      }
      ch.recvs.push_back(Pending{op, ep_id});
    }
    return op;
  }

  void cancel(uint64_t ep_id, const std::shared_ptr<detail::Op>& op) {
    std::lock_guard lk(mu_);
    auto& ep = eps_.at(ep_id);
    auto& ch =
        op->kind == detail::Op::Kind::kSend ? channels_[{ep.owner, ep.peer}] : channels_[{ep.peer, ep.owner}];
    auto& q = op->kind == detail::Op::Kind::kSend ? ch.sends : ch.recvs;
    for (auto it = q.begin(); it != q.end(); ++it) {
      if (it->op == op) {
        q.erase(it);
        op->complete(
            Status::CANCELLED, 0,
            fmt::format("{} with tag {:#x} to/from {} cancelled",
                        op->kind == detail::Op::Kind::kSend ? "send" : "receive", op->tag, ep.peer_name));
        return;
      }
    }
  }

  void abort(uint64_t ep_id, const std::string& reason) {
    std::lock_guard lk(mu_);
    auto& ep = eps_.at(ep_id);
    if (ep.failed) return;
    uint64_t owner = ep.owner, peer = ep.peer;
    std::string owner_name = nodes_.at(owner).name;
    fail_endpoint_locked(ep_id, fmt::format("connection to {} aborted: {}", ep.peer_name, reason));
    std::string remote_msg = fmt::format("peer {} closed the connection: {}", owner_name, reason);
    for (auto& [id, other] : eps_) {
      if (other.owner == peer && other.peer == owner && !other.failed) {
        fail_endpoint_locked(id, fmt::format("peer {} closed the connection: {}", other.peer_name, reason));
      }
    }
    broken_[{peer, owner}] = remote_msg;
    broken_[{owner, peer}] = fmt::format("connection to {} was aborted earlier: {}", ep.peer_name, reason);
  }

  bool failed(uint64_t ep_id) const {
    std::lock_guard lk(mu_);
    return eps_.at(ep_id).failed;
  }

  std::string failure(uint64_t ep_id) const {
    std::lock_guard lk(mu_);
    return eps_.at(ep_id).failure;
  }

  // Closed endpoints: fail their ops, forget the record.
  void release(uint64_t ep_id) {
    abort(ep_id, "endpoint closed");
    std::lock_guard lk(mu_);
    eps_.erase(ep_id);
  }

 private:
  // Both ops are unlinked already.
  static void deliver(const std::shared_ptr<detail::Op>& send, const std::shared_ptr<detail::Op>& recv,
                      const std::string& sender_name) {
    if (send->size > recv->size) {
      recv->complete(
          Status::FAILED, 0,
          fmt::format("message with tag {:#x} from {} is {} bytes, larger than the posted buffer of {} bytes",
                      recv->tag, sender_name, send->size, recv->size));
      send->complete(Status::OK, send->size, "");
      return;
    }
    if (send->size > 0) std::memcpy(recv->buf, send->buf, send->size);
    recv->complete(Status::OK, send->size, "");
    send->complete(Status::OK, send->size, "");
  }

  void fail_endpoint_locked(uint64_t ep_id, const std::string& why) {
    auto& ep = eps_.at(ep_id);
    if (!ep.failed) {
      ep.failed = true;
      ep.failure = why;
    }
    auto drain = [&](std::deque<Pending>& q) {
      for (auto it = q.begin(); it != q.end();) {
        if (it->ep_id == ep_id) {
          it->op->complete(Status::FAILED, 0, ep.failure);
          it = q.erase(it);
        } else {
          ++it;
        }
      }
    };
    if (auto it = channels_.find({ep.owner, ep.peer}); it != channels_.end()) drain(it->second.sends);
    if (auto it = channels_.find({ep.peer, ep.owner}); it != channels_.end()) drain(it->second.recvs);
  }

  const uint64_t id_;
  mutable std::mutex mu_;
  uint64_t next_node_ = 1;
  uint64_t next_ep_ = 1;
  std::map<uint64_t, Node> nodes_;
  std::map<uint64_t, EpRecord> eps_;
  std::map<std::pair<uint64_t, uint64_t>, Channel> channels_;
  std::map<std::pair<uint64_t, uint64_t>, std::string> broken_;  // (owner, peer) -> failure for new endpoints
};

void EpOwner::cancel_op(const std::shared_ptr<detail::Op>& op) {
  fabric->cancel(ep_id, op);
}

class LoopbackEndpoint : public Endpoint {
 public:
  LoopbackEndpoint(std::shared_ptr<FabricImpl> f, uint64_t id, std::string peer_name)
      : owner_(std::make_shared<EpOwner>(std::move(f), id)), peer_name_(std::move(peer_name)) {}
  ~LoopbackEndpoint() override { owner_->fabric->release(owner_->ep_id); }

  SendHandle post_send(uint64_t tag, const void* buf, size_t len) override {
    check_user_tag(tag, "loopback send to " + peer_name_);
    SPADE_CHECK(buf != nullptr || len == 0, "loopback send to {}: null buffer with length {}", peer_name_,
                len);
    return SendHandle(owner_->fabric->post(owner_->ep_id, detail::Op::Kind::kSend, tag,
                                           const_cast<void*>(buf), len, owner_));
  }

  RecvHandle post_recv(uint64_t tag, void* buf, size_t capacity) override {
    check_user_tag(tag, "loopback receive from " + peer_name_);
    SPADE_CHECK(buf != nullptr || capacity == 0, "loopback receive from {}: null buffer with capacity {}",
                peer_name_, capacity);
    return RecvHandle(
        owner_->fabric->post(owner_->ep_id, detail::Op::Kind::kRecv, tag, buf, capacity, owner_));
  }

  void abort(const std::string& reason) override { owner_->fabric->abort(owner_->ep_id, reason); }
  bool failed() const override { return owner_->fabric->failed(owner_->ep_id); }
  std::string failure() const override { return owner_->fabric->failure(owner_->ep_id); }
  const std::string& peer_name() const override { return peer_name_; }

 private:
  std::shared_ptr<EpOwner> owner_;
  std::string peer_name_;
};

class LoopbackTransport : public Transport {
 public:
  LoopbackTransport(std::shared_ptr<FabricImpl> f, const std::string& name)
      : fabric_(std::move(f)), node_(fabric_->add_node(name)) {}
  ~LoopbackTransport() override { fabric_->close_node(node_); }

  std::string local_address() const override { return fabric_->address_of(node_); }

  std::unique_ptr<Endpoint> connect(const std::string& peer_address, const std::string& peer_name,
                                    Deadline /*deadline: connect never waits*/) override {
    uint64_t id = fabric_->connect(node_, peer_address, peer_name);
    return std::make_unique<LoopbackEndpoint>(fabric_, id, peer_name);
  }

  std::string kind() const override { return "loopback"; }

 private:
  std::shared_ptr<FabricImpl> fabric_;
  uint64_t node_;
};

std::unique_ptr<Transport> FabricImpl::make_transport(const std::string& name) {
  return std::make_unique<LoopbackTransport>(shared_from_this(), name);
}

}  // namespace

std::shared_ptr<LoopbackFabric> LoopbackFabric::create() {
  return std::make_shared<FabricImpl>();
}

}  // namespace spade::transport
