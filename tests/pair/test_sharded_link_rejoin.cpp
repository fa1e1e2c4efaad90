// Rejoin of one layer shard (pair/sharded_link.h): ShardedLink::replaced() swaps one shard's link, drains the answers
// the other shards still owe and releases on them every sequence they held; probe_shard() accepts a cache rank that
// holds the shard's layers and refuses, by name and layers, one that does not; shard_claim_error() refuses a
// replacement announced as another shard's.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <deque>
#include <set>

#include "common/error.h"
#include "pair/sharded_link.h"

namespace spade::pair {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::UnorderedElementsAre;

// A cache rank holding `held` layers: records every update and answers it in order, with an error when an entry
// touches a layer it does not hold (as cache::Selector does); tracks the sequences it holds. `fail_` makes the
// transport fail (sends throw, answers never come); `late_` makes receive time out without consuming the answer.
struct FakeShard : CacheRankLink {
  FakeShard(std::string name, std::set<int> held) : name_(std::move(name)), held_(std::move(held)) {}
  void send(PackUpdate&& u) override {
    if (!fail_.empty()) throw Error(fail_);
    PackSelection p;
    p.step = u.step;
    p.pack = u.pack;
    for (uint64_t id : u.released) seqs.erase(id);
    for (const SeqUpdate& e : u.seqs)
      for (int l = u.first_layer; l < u.first_layer + u.num_layers; ++l) {
        if (!held_.count(l)) {
          p.error = "layer " + std::to_string(l) + " is not held by this shard";
          continue;
        }
        seqs.insert(e.seq_id);
      }
    got.push_back(std::move(u));
    answers_.push_back(std::move(p));
    ++stats_.updates;
  }
  PackSelection receive(transport::Deadline, bool* waited) override {
    if (waited) *waited = false;
    if (!fail_.empty()) fail("{} failed: {}", name_, fail_);
    if (late_) fail("{}: selection not received before the deadline", name_);
    SPADE_CHECK(!answers_.empty(), "{}: nothing to receive", name_);
    PackSelection p = std::move(answers_.front());
    answers_.pop_front();
    if (!p.error.empty()) fail("{}: {}", name_, p.error);
    return p;
  }
  size_t in_flight() const override { return answers_.size(); }
  const LinkStats& stats() const override { return stats_; }
  std::string peer() const override { return name_; }
  std::string failure() const override { return fail_; }

  std::vector<PackUpdate> got;
  std::set<uint64_t> seqs;  // sequences held
  std::string fail_;
  bool late_ = false;

 private:
  std::string name_;
  std::set<int> held_;
  std::deque<PackSelection> answers_;
  LinkStats stats_;
};

// 5 layers, packs of one layer.
ModelConfig five_layers() {
  ModelConfig c;
  c.num_layers = 5;
  c.num_q_heads = 4;
  c.num_kv_heads = 2;
  c.head_dim = 8;
  return c;
}

PackUpdate update(int64_t step, int pack, std::vector<uint64_t> seqs, std::vector<uint64_t> released = {}) {
  PackUpdate u;
  u.step = step;
  u.pack = pack;
  u.first_layer = pack;
  u.num_layers = 1;
  u.released = std::move(released);
  for (uint64_t id : seqs) {
    SeqUpdate e;
    e.seq_id = id;
    u.seqs.push_back(e);
  }
  return u;
}

std::vector<uint64_t> released_of(const PackUpdate& u) {
  std::vector<uint64_t> r = u.released;
  std::sort(r.begin(), r.end());
  return r;
}

struct ShardRejoin : ::testing::Test {
  std::vector<FakeShard*> shard;
  std::unique_ptr<ShardedLink> make(int n) {
    std::vector<std::unique_ptr<CacheRankLink>> links;
    for (int i = 0; i < n; ++i) {
      std::set<int> held;
      for (int l = i; l < 5; l += n) held.insert(l);
      auto r = std::make_unique<FakeShard>("cache rank " + std::to_string(i), held);
      shard.push_back(r.get());
      links.push_back(std::move(r));
    }
    return std::make_unique<ShardedLink>(std::move(links));
  }
  static transport::Deadline soon() { return transport::Clock::now() + std::chrono::seconds(1); }
};

TEST_F(ShardRejoin, ReplacedDrainsTheOtherShardAndReleasesWhatItHeld) {
  auto link = make(2);
  for (int pack = 0; pack < 5; ++pack) link->send(update(0, pack, {7, 8}));
  for (int i = 0; i < 2; ++i) (void)link->receive(soon(), nullptr);
  link->send(update(1, 0, {7}, {8}));  // 8 ended: shard 0 frees it now, shard 1 with its next update
  EXPECT_EQ(link->live_sequences(), 1u);
  EXPECT_THAT(shard[0]->seqs, UnorderedElementsAre(7));
  shard[1]->fail_ = "connection reset";  // shard 1's cache rank dies with answers owed
  EXPECT_THAT(link->failure(), HasSubstr("connection reset"));
  const uint64_t updates_before = link->stats().updates;

  auto fresh = std::make_unique<FakeShard>("cache rank 1 (incarnation 1)", std::set<int>{1, 3});
  FakeShard* repl = fresh.get();
  std::unique_ptr<ShardedLink> next = link->replaced(1, std::move(fresh), soon());
  EXPECT_EQ(shard[0]->in_flight(), 0u) << "shard 0's owed answers were read";
  EXPECT_EQ(next->in_flight(), 0u);
  EXPECT_EQ(next->failure(), "");
  EXPECT_EQ(next->peer(), "cache rank 0,cache rank 1 (incarnation 1)");
  EXPECT_EQ(next->live_sequences(), 0u);
  // The emptied link still names its peers, and refuses to be used.
  EXPECT_EQ(link->peer(), "cache rank 0,cache rank 1");
  EXPECT_EQ(link->num_shards(), 0);
  EXPECT_THROW(link->send(update(2, 0, {9})), Error);
  EXPECT_LT(next->stats().updates, updates_before) << "shard 1's old link (and its counters) is gone";

  // New sequences go sparse over both shards; shard 0 frees the sequence it still held, the replacement gets no
  // release (it holds nothing).
  for (int pack = 0; pack < 5; ++pack) next->send(update(2, pack, {9}));
  ASSERT_FALSE(shard[0]->got.empty());
  EXPECT_THAT(released_of(shard[0]->got[shard[0]->got.size() - 3]), ElementsAre(7));
  EXPECT_THAT(shard[0]->seqs, UnorderedElementsAre(9));
  ASSERT_EQ(repl->got.size(), 2u);
  for (const PackUpdate& u : repl->got) EXPECT_THAT(u.released, IsEmpty());
  EXPECT_THAT(repl->seqs, UnorderedElementsAre(9));
  for (int pack = 0; pack < 5; ++pack) EXPECT_EQ(next->receive(soon(), nullptr).pack, pack);
}

TEST_F(ShardRejoin, AnotherShardStillDownIsLeftFailedUntilItIsReplacedInTurn) {
  auto link = make(3);
  for (int pack = 0; pack < 5; ++pack) link->send(update(0, pack, {4}));
  shard[1]->fail_ = "shard 1 died";
  shard[2]->fail_ = "shard 2 died";
  auto next = link->replaced(1, std::make_unique<FakeShard>("new 1", std::set<int>{1, 4}), soon());
  EXPECT_THAT(next->failure(), HasSubstr("shard 2 died"));
  EXPECT_EQ(shard[0]->in_flight(), 0u);
  auto whole = next->replaced(2, std::make_unique<FakeShard>("new 2", std::set<int>{2}), soon());
  EXPECT_EQ(whole->failure(), "");
  EXPECT_EQ(whole->peer(), "cache rank 0,new 1,new 2");
  whole->send(update(1, 0, {5}));
  EXPECT_THAT(released_of(shard[0]->got.back()), ElementsAre(4));
}

TEST_F(ShardRejoin, ReplacedFailsNamingAShardWhoseAnswersDoNotCome) {
  auto link = make(2);
  for (int pack = 0; pack < 5; ++pack) link->send(update(0, pack, {7}));
  shard[1]->fail_ = "dead";
  shard[0]->late_ = true;
  try {
    (void)link->replaced(1, std::make_unique<FakeShard>("new 1", std::set<int>{1, 3}), soon());
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("layer shard 0 (cache rank 0) failed while shard 1 was replaced"));
    EXPECT_THAT(e.what(), HasSubstr("before the deadline"));
  }
  EXPECT_THROW((void)link->replaced(2, std::make_unique<FakeShard>("x", std::set<int>{}), soon()), Error);
  EXPECT_THROW((void)link->replaced(0, nullptr, soon()), Error);
}

TEST(ProbeShard, ACacheRankHoldingTheShardsLayersPassesAndKeepsNothing) {
  FakeShard good("cache rank 3 (#1)", {1, 3});
  probe_shard(good, 1, 2, five_layers(), 1, transport::Clock::now() + std::chrono::seconds(1));
  ASSERT_EQ(good.got.size(), 3u);  // packs 1 and 3, then the release
  EXPECT_EQ(good.got[0].pack, 1);
  EXPECT_EQ(good.got[1].pack, 3);
  ASSERT_EQ(good.got[0].seqs.size(), 1u);
  const SeqUpdate& e = good.got[0].seqs[0];
  EXPECT_EQ(e.seq_id, kProbeSeqId);
  EXPECT_TRUE(e.init);
  EXPECT_EQ(e.q.size(), static_cast<size_t>(4 * 8));  // [1 layer, 1 query, q_dim]
  EXPECT_EQ(e.k.size(), static_cast<size_t>(2 * 8));  // [1 layer, 1 token, kv_dim]
  EXPECT_THAT(good.got[2].released, ElementsAre(kProbeSeqId));
  EXPECT_THAT(good.seqs, IsEmpty());
  EXPECT_EQ(good.in_flight(), 0u);
}

TEST(ProbeShard, ACacheRankHoldingOtherLayersIsRefusedNamingItAndTheLayers) {
  FakeShard wrong("cache rank 3 (#1)", {0, 2, 4});  // shard 0's layers
  try {
    probe_shard(wrong, 1, 2, five_layers(), 1, transport::Clock::now() + std::chrono::seconds(1));
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("cache rank 3 (#1) does not serve layer shard 1 of 2 (layers 1,3 of 5, "
                                    "--layers-per-pack 1)"));
    EXPECT_THAT(e.what(), HasSubstr("layer 1 is not held"));
  }
  EXPECT_EQ(wrong.in_flight(), 0u) << "every answer was read";
  EXPECT_THAT(wrong.seqs, IsEmpty());
  FakeShard dead("cache rank 3 (#1)", {1, 3});
  dead.fail_ = "unreachable";
  EXPECT_THROW(probe_shard(dead, 1, 2, five_layers(), 1, transport::Clock::now()), Error);
  FakeShard fine("cache rank 2 (#0)", {0, 2, 4});
  EXPECT_THROW(probe_shard(fine, 5, 2, five_layers(), 1, transport::Clock::now()), Error);  // no shard 5 of 2
}

TEST(ShardClaim, TheShardsOwnCacheRankIsAccepted) {
  EXPECT_EQ(shard_claim_error({true, 3, 1, 1}, "cache rank 3 (#1) on h", 1, 2, 1, 5, 1), "");
}

TEST(ShardClaim, AnotherShardIndexOrRoleIsRefusedNamingTheClaimAndTheLayers) {
  const std::string why = shard_claim_error({true, 3, 1, 0}, "cache rank 3 (#1) on h", 1, 2, 1, 5, 1);
  EXPECT_THAT(why, HasSubstr("the replacement cache rank 3 (#1) on h is refused: it claims layer shard 0 as cache #1"));
  EXPECT_THAT(why, HasSubstr("rank 3 is layer shard 1 of 2 (cache #1, layers 1,3)"));
  EXPECT_THAT(shard_claim_error({true, 3, 2, 1}, "x", 1, 2, 1, 5, 1), HasSubstr("as cache #2"));
  EXPECT_THAT(shard_claim_error({false, 3, 1, 1}, "x", 1, 2, 1, 5, 1), HasSubstr("as a non-cache rank #1"));
}

}  // namespace
}  // namespace spade::pair
