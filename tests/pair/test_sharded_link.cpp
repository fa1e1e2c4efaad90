// ShardedLink (pair/sharded_link.h): packs round-robin over N cache-rank links, answers in send order, releases
// forwarded to every shard, failures named; shard_layers covers every layer exactly once.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <deque>
#include <set>

#include "common/error.h"
#include "pair/sharded_link.h"

namespace spade::pair {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

// Records every update; answers each with a selection naming its step and pack, in order.
struct Recorder : CacheRankLink {
  explicit Recorder(std::string name) : name_(std::move(name)) {}
  void send(PackUpdate&& u) override {
    if (!fail_.empty()) throw Error(fail_);
    got.push_back(u);
    answers_.push_back({u.step, u.pack});
    ++stats_.updates;
    stats_.bytes_sent += 10;
  }
  PackSelection receive(transport::Deadline, bool* waited) override {
    if (waited) *waited = false;
    SPADE_CHECK(!answers_.empty(), "{}: nothing to receive", name_);
    PackSelection p;
    p.step = answers_.front().first;
    p.pack = answers_.front().second;
    answers_.pop_front();
    return p;
  }
  size_t in_flight() const override { return answers_.size(); }
  const LinkStats& stats() const override { return stats_; }
  std::string peer() const override { return name_; }
  std::string failure() const override { return fail_; }

  std::vector<PackUpdate> got;
  std::string fail_;

 private:
  std::string name_;
  std::deque<std::pair<int64_t, int32_t>> answers_;
  LinkStats stats_;
};

struct Sharded : ::testing::Test {
  std::vector<Recorder*> rec;
  std::unique_ptr<ShardedLink> make(int n) {
    std::vector<std::unique_ptr<CacheRankLink>> links;
    for (int i = 0; i < n; ++i) {
      auto r = std::make_unique<Recorder>("cache rank " + std::to_string(i));
      rec.push_back(r.get());
      links.push_back(std::move(r));
    }
    return std::make_unique<ShardedLink>(std::move(links));
  }
  static PackUpdate update(int64_t step, int pack, std::vector<uint64_t> released = {}) {
    PackUpdate u;
    u.step = step;
    u.pack = pack;
    u.first_layer = 2 * pack;
    u.num_layers = 2;
    u.released = std::move(released);
    return u;
  }
};

TEST_F(Sharded, PacksGoRoundRobinAndAnswersComeInSendOrder) {
  auto link = make(3);
  for (int64_t step = 0; step < 2; ++step)
    for (int pack = 0; pack < 5; ++pack) link->send(update(step, pack));
  EXPECT_EQ(link->in_flight(), 10u);
  for (int i = 0; i < 3; ++i)
    for (const PackUpdate& u : rec[static_cast<size_t>(i)]->got) EXPECT_EQ(u.pack % 3, i);
  EXPECT_EQ(rec[0]->got.size(), 4u);  // packs 0, 3 of two steps
  EXPECT_EQ(rec[1]->got.size(), 4u);  // packs 1, 4
  EXPECT_EQ(rec[2]->got.size(), 2u);  // pack 2
  for (int64_t step = 0; step < 2; ++step)
    for (int pack = 0; pack < 5; ++pack) {
      const PackSelection p = link->receive(transport::Clock::now(), nullptr);
      EXPECT_EQ(p.step, step);
      EXPECT_EQ(p.pack, pack);
    }
  EXPECT_EQ(link->in_flight(), 0u);
  EXPECT_EQ(link->stats().updates, 10u);
  EXPECT_EQ(link->stats().bytes_sent, 100u);
  EXPECT_EQ(link->peer(), "cache rank 0,cache rank 1,cache rank 2");
}

TEST_F(Sharded, ReleasesReachEveryShardOnItsNextUpdate) {
  auto link = make(2);
  link->send(update(0, 0, {7, 8}));  // shard 0 gets 7, 8 now
  link->send(update(0, 1));          // shard 1 gets them with its next update
  link->send(update(1, 0, {9}));
  link->send(update(1, 1));
  EXPECT_THAT(rec[0]->got[0].released, ElementsAre(7, 8));
  EXPECT_THAT(rec[1]->got[0].released, ElementsAre(7, 8));
  EXPECT_THAT(rec[0]->got[1].released, ElementsAre(9));
  EXPECT_THAT(rec[1]->got[1].released, ElementsAre(9));
}

TEST_F(Sharded, AReleasesOnlyUpdateReachesEveryShardAtOnceAndIsAnsweredOnce) {
  auto link = make(3);
  link->send(update(0, 1, {5}));  // shards 0 and 2 have 5 pending
  PackUpdate flush;
  flush.step = 1;
  flush.pack = 0;
  flush.num_layers = 0;
  flush.released = {6};
  link->send(std::move(flush));
  EXPECT_EQ(link->in_flight(), 2u);
  EXPECT_THAT(rec[0]->got.back().released, ElementsAre(5, 6));
  EXPECT_THAT(rec[1]->got.back().released, ElementsAre(6));
  EXPECT_THAT(rec[2]->got.back().released, ElementsAre(5, 6));
  EXPECT_EQ(link->receive(transport::Clock::now(), nullptr).pack, 1);
  const PackSelection p = link->receive(transport::Clock::now(), nullptr);
  EXPECT_EQ(p.step, 1);
  for (Recorder* r : rec) EXPECT_EQ(r->in_flight(), 0u) << r->peer();  // every shard's answer was taken
  EXPECT_EQ(link->in_flight(), 0u);
}

// Retained prefixes and their drops reach every shard as releases do, merged as the inference rank merges its own.
TEST_F(Sharded, RetainedPrefixesAndDropsReachEveryShardMerged) {
  auto link = make(2);
  PackUpdate a = update(0, 0, {7});
  a.retained = {{7, 64}};  // 7 ended, its first 64 tokens kept: shard 0 now, shard 1 queued
  link->send(std::move(a));
  PackUpdate b = update(0, 0);
  b.retained = {{7, 32}};  // shortened before shard 1 heard of it: one entry, the later tokens
  link->send(std::move(b));
  link->send(update(0, 1));
  EXPECT_THAT(rec[0]->got[0].retained, ElementsAre(Retain{7, 64}));
  EXPECT_THAT(rec[0]->got[1].retained, ElementsAre(Retain{7, 32}));
  EXPECT_THAT(rec[1]->got[0].released, ElementsAre(7));
  EXPECT_THAT(rec[1]->got[0].retained, ElementsAre(Retain{7, 32}));
  EXPECT_EQ(link->retained_prefixes(), 1u);
  // 8 ends retained and is dropped at once: shard 1, which has both queued, just releases it.
  PackUpdate c = update(1, 0, {8});
  c.retained = {{8, 16}};
  link->send(std::move(c));
  PackUpdate d = update(1, 0);
  d.dropped = {8, 7};  // 7: a shortened-then-dropped prefix shard 1 already holds
  link->send(std::move(d));
  EXPECT_THAT(rec[0]->got.back().dropped, ElementsAre(8, 7));
  EXPECT_EQ(link->retained_prefixes(), 0u);
  PackUpdate flush;  // the idle flush carries shard 1's queue at once
  flush.step = 2;
  flush.num_layers = 0;
  link->send(std::move(flush));
  const PackUpdate& got1 = rec[1]->got.back();
  EXPECT_THAT(got1.released, ElementsAre(8));
  EXPECT_TRUE(got1.retained.empty());
  EXPECT_THAT(got1.dropped, ElementsAre(7));
}

// An idle flush whose send fails on one shard (its cache rank is down) leaves its news queued for the others: after
// the replacement, the healthy shard still frees the ended sequence (its retain cancelled by the replacement's drop).
TEST_F(Sharded, NewsOfAFlushThatFailsOnOneShardStaysQueuedForTheOthers) {
  auto link = make(2);
  for (int pack = 0; pack < 2; ++pack) {
    PackUpdate u = update(0, pack);
    u.seqs.emplace_back();
    u.seqs.back().seq_id = 7;
    link->send(std::move(u));
  }
  for (int pack = 0; pack < 2; ++pack) (void)link->receive(transport::Clock::now(), nullptr);
  rec[0]->fail_ = "cache rank 0 is down";
  PackUpdate flush;
  flush.step = 1;
  flush.num_layers = 0;
  flush.released = {7};
  flush.retained = {{7, 16}};
  EXPECT_THROW(link->send(std::move(flush)), Error);
  EXPECT_TRUE(rec[1]->got.size() == 1u) << "shard 1 was not reached";
  auto next = link->replaced(0, std::make_unique<Recorder>("cache rank 0 (incarnation 1)"),
                             transport::Clock::now() + std::chrono::seconds(1));
  next->send(update(2, 1));
  const PackUpdate& got = rec[1]->got.back();
  EXPECT_THAT(got.released, ElementsAre(7));
  EXPECT_TRUE(got.retained.empty());
  EXPECT_TRUE(got.dropped.empty()) << "its release frees it: no drop of a prefix shard 1 never retained";
}

TEST_F(Sharded, AFailedShardFailsTheLinkNamingIt) {
  auto link = make(2);
  EXPECT_EQ(link->failure(), "");
  rec[1]->fail_ = "cache rank 1 is unreachable: SIGKILL";
  EXPECT_THAT(link->failure(), HasSubstr("cache rank 1"));
  link->send(update(0, 0));  // shard 0 still takes its pack
  EXPECT_THAT([&] { link->send(update(0, 1)); }, ::testing::ThrowsMessage<Error>(HasSubstr("cache rank 1")));
}

TEST_F(Sharded, BadInputIsRefused) {
  EXPECT_THROW(ShardedLink({}), Error);
  std::vector<std::unique_ptr<CacheRankLink>> with_null;
  with_null.push_back(nullptr);
  EXPECT_THROW(ShardedLink(std::move(with_null)), Error);
  auto link = make(2);
  EXPECT_THROW(link->receive(transport::Clock::now(), nullptr), Error);
  EXPECT_THROW(shard_of_pack(0, 0), Error);
  EXPECT_THROW(shard_of_pack(-1, 2), Error);
  EXPECT_THROW(shard_layers(2, 2, 8, 2), Error);
  EXPECT_THROW(shard_layers(0, 1, 8, 0), Error);
}

TEST(ShardLayers, AShardsPoolHasTheFullPoolsMemory) {
  EXPECT_EQ(shard_pool_pages(100, 5, 5), 100);  // every layer: the flag's pages
  EXPECT_EQ(shard_pool_pages(100, 5, 3), 166);  // 3 of 5 layers: 500 / 3, rounded down
  EXPECT_EQ(shard_pool_pages(100, 36, 12), 300);
  // N equal shards hold N times the tokens of one full pool in N times its memory.
  const int layers = 36, per_pack = 2, n = 3;
  for (int s = 0; s < n; ++s)
    EXPECT_EQ(shard_pool_pages(1000, layers, static_cast<int>(shard_layers(s, n, layers, per_pack).size())), 3000);
  EXPECT_THROW(shard_pool_pages(0, 5, 1), Error);
  EXPECT_THROW(shard_pool_pages(10, 5, 0), Error);
  EXPECT_THROW(shard_pool_pages(10, 5, 6), Error);
  EXPECT_THROW(shard_pool_pages(1 << 30, 64, 1), Error);  // overflows int
}

TEST(ShardLayers, EveryLayerHasExactlyOneShard) {
  for (int layers : {1, 5, 6, 36, 64})
    for (int per_pack : {1, 2, 4, 6, 12})
      for (int n : {1, 2, 3, 4}) {
        std::multiset<int> all;
        for (int s = 0; s < n; ++s)
          for (int l : shard_layers(s, n, layers, per_pack)) {
            EXPECT_EQ(shard_of_pack(l / per_pack, n), s);
            all.insert(l);
          }
        ASSERT_EQ(all.size(), static_cast<size_t>(layers)) << layers << " " << per_pack << " " << n;
        for (int l = 0; l < layers; ++l) EXPECT_EQ(all.count(l), 1u);
      }
  EXPECT_THAT(shard_layers(1, 2, 5, 2), ElementsAre(2, 3));
  EXPECT_THAT(shard_layers(3, 4, 5, 2), ElementsAre());  // more shards than packs: nothing to hold
}

}  // namespace
}  // namespace spade::pair
