// GPU layer shards (pair/gpu_shard.h): model pack p <-> local pack p / N on shard p mod N; a shard's local view (its
// layer count cut into packs of P by the one-cache-rank server) is the same packs as the model packs it serves; each
// shard's hello carries its layer count; the N link addresses travel as one.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <numeric>
#include <tuple>

#include "common/error.h"
#include "pair/gpu_shard.h"
#include "pair/sharded_link.h"

namespace spade::pair {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

// The message sizes a server with `layers` layers in packs of P expects, pack by pack, against the inference side's
// per-pack sizes of the model packs it routes to that shard: equal for every pack and every shard.
void expect_sizes_match(int L, int P, int N) {
  ModelConfig cfg;
  cfg.num_layers = L;
  cfg.num_q_heads = 4;
  cfg.num_kv_heads = 2;
  cfg.head_dim = 64;
  GpuStepPlan plan;
  plan.rows = {{0, 3, 40, kRowSelect}, {1, 1, 70, kRowSelect | kRowFirstSelect}, {2, 5, 5, kRowFresh}};
  const int packs = (L + P - 1) / P;
  std::vector<int> served(static_cast<size_t>(N), 0);
  int layers_total = 0;
  for (int s = 0; s < N; ++s) {
    const GpuShardView v = gpu_shard_view(s, N, L, P);
    layers_total += v.num_layers();
    EXPECT_EQ(v.layers, shard_layers(s, N, L, P));
    for (size_t j = 0; j < v.packs.size(); ++j) {
      const int p = v.packs[j];
      EXPECT_EQ(shard_of_pack(p, N), s);
      EXPECT_EQ(local_pack_of(p, N), static_cast<int>(j));
      // The shard's server cuts its layers into packs of P: local pack j has min(P, L_s - j P) layers.
      const int local = std::min(P, v.num_layers() - static_cast<int>(j) * P);
      const int model = std::min(P, L - p * P);
      EXPECT_EQ(local, model) << "L " << L << " P " << P << " N " << N << " pack " << p;
      const GpuPackSizes a = gpu_pack_sizes(plan, model, cfg, 64, 16), b = gpu_pack_sizes(plan, local, cfg, 64, 16);
      EXPECT_EQ(a.up_bytes, b.up_bytes);
      EXPECT_EQ(a.steady.bytes, b.steady.bytes);
      EXPECT_EQ(a.first.bytes, b.first.bytes);
      ++served[static_cast<size_t>(s)];
    }
  }
  EXPECT_EQ(layers_total, L) << "every layer on exactly one shard";
  EXPECT_EQ(std::accumulate(served.begin(), served.end(), 0), packs);
}

TEST(GpuShard, LocalViewOfSixLayersInPacksOfFourOverTwoShards) {
  // 2 packs: pack 0 = layers 0..3 (shard 0), pack 1 = layers 4..5 (shard 1, the model's partial last pack).
  const GpuShardView s0 = gpu_shard_view(0, 2, 6, 4), s1 = gpu_shard_view(1, 2, 6, 4);
  EXPECT_THAT(s0.packs, ElementsAre(0));
  EXPECT_THAT(s0.layers, ElementsAre(0, 1, 2, 3));
  EXPECT_THAT(s0.pack_layers, ElementsAre(4));
  EXPECT_THAT(s1.packs, ElementsAre(1));
  EXPECT_THAT(s1.layers, ElementsAre(4, 5));
  EXPECT_THAT(s1.pack_layers, ElementsAre(2));
  expect_sizes_match(6, 4, 2);
}

TEST(GpuShard, LocalViewOfThirtySixLayersInPacksOfTwelve) {
  // N = 2: packs 0, 2 on shard 0 (24 layers: local packs 0, 1), pack 1 on shard 1 (12 layers).
  const GpuShardView a = gpu_shard_view(0, 2, 36, 12), b = gpu_shard_view(1, 2, 36, 12);
  EXPECT_THAT(a.packs, ElementsAre(0, 2));
  EXPECT_EQ(a.num_layers(), 24);
  EXPECT_EQ(a.layers.front(), 0);
  EXPECT_EQ(a.layers[12], 24);  // local layer 12 (local pack 1's first) is model layer 24 (pack 2's first)
  EXPECT_THAT(b.packs, ElementsAre(1));
  EXPECT_EQ(b.num_layers(), 12);
  expect_sizes_match(36, 12, 2);
  // N = 3: one pack of 12 layers each.
  for (int s = 0; s < 3; ++s) {
    const GpuShardView v = gpu_shard_view(s, 3, 36, 12);
    EXPECT_THAT(v.packs, ElementsAre(s));
    EXPECT_EQ(v.num_layers(), 12);
  }
  expect_sizes_match(36, 12, 3);
}

TEST(GpuShard, EveryPartialLastPackIsItsShardsLastPack) {
  for (int L = 1; L <= 40; ++L)
    for (int P = 1; P <= 13; ++P) {
      const int packs = (L + P - 1) / P;
      for (int N = 1; N <= std::min(packs, 5); ++N) expect_sizes_match(L, P, N);
    }
}

TEST(GpuShard, MoreShardsThanPacksIsRefusedNamingTheFlag) {
  try {
    gpu_shard_view(2, 3, 6, 4);
    FAIL() << "a shard with no pack was accepted";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("3 cache ranks but only 2 layer packs"));
    EXPECT_THAT(e.what(), HasSubstr("--layers-per-pack"));
  }
  EXPECT_THROW(gpu_shard_view(2, 2, 6, 4), Error);  // shard outside 0..N-1
  EXPECT_THROW(local_pack_of(-1, 2), Error);
}

TEST(GpuShard, EachShardsHelloCarriesItsLayerCount) {
  GpuPairHello h;
  h.num_layers = 36;
  h.layers_per_pack = 12;
  h.num_pages = 777;
  h.token_budget = 64;
  const GpuPairHello a = shard_gpu_hello(h, 0, 2), b = shard_gpu_hello(h, 1, 2);
  EXPECT_EQ(a.num_layers, 24);
  EXPECT_EQ(b.num_layers, 12);
  EXPECT_EQ(a.num_pages, 777);
  EXPECT_EQ(b.layers_per_pack, 12);
  EXPECT_EQ(b.token_budget, 64);
  EXPECT_EQ(shard_gpu_hello(h, 0, 1).num_layers, 36);
  // The cache side validates the shard's hello against its local attention view (decode_gpu_hello).
  ModelConfig local;
  local.num_layers = 12;
  local.num_q_heads = h.num_q_heads = 4;
  local.num_kv_heads = h.num_kv_heads = 2;
  local.head_dim = h.head_dim = 64;
  GpuPairHello c = shard_gpu_hello(h, 1, 2);
  c.local_window = c.delta_capacity = c.max_slots = c.max_step_tokens = c.page_size = c.max_pages_per_seq = 1;
  const std::vector<uint8_t> bytes = encode_gpu_hello(c);
  EXPECT_EQ(decode_gpu_hello(bytes.data(), bytes.size(), local, "inference rank 1").num_layers, 12);
  local.num_layers = 24;  // shard 0's view: the shard-1 hello is refused, naming the layer counts
  try {
    decode_gpu_hello(bytes.data(), bytes.size(), local, "inference rank 1");
    FAIL() << "a hello for another shard was accepted";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("12 full-attention layers"));
  }
}

TEST(GpuShard, AddressesTravelAsOne) {
  const std::string bin1("nccl\0id-one", 11), bin2("\x01\x02\x00\x03", 4), bin3 = "three";
  EXPECT_EQ(join_shard_addresses({bin1}), bin1) << "one shard: the one-cache-rank wire, unchanged";
  EXPECT_EQ(shard_address(bin1, 0, 1, "inference rank 1"), bin1);
  const std::string j = join_shard_addresses({bin1, bin2, bin3});
  EXPECT_EQ(shard_address(j, 0, 3, "inference rank 1"), bin1);
  EXPECT_EQ(shard_address(j, 1, 3, "inference rank 1"), bin2);
  EXPECT_EQ(shard_address(j, 2, 3, "inference rank 1"), bin3);
  const auto refused = [](const std::string& a, int s, int n, const char* what) {
    try {
      shard_address(a, s, n, "inference rank 1");
      ADD_FAILURE() << "accepted: " << what;
    } catch (const Error& e) {
      EXPECT_THAT(e.what(), HasSubstr("inference rank 1")) << what;
    }
  };
  refused(j, 0, 2, "three addresses for two shards");
  refused(j, 0, 1, "a list for one shard");
  refused(bin1, 0, 2, "one address for two shards");
  refused(j.substr(0, j.size() - 2), 2, 3, "a truncated list");
  refused(j + "x", 0, 3, "trailing bytes");
  EXPECT_THROW(join_shard_addresses({}), Error);
}

}  // namespace
}  // namespace spade::pair
