// The pack update's shared INIT on the wire (pair/pack.h, v3 "SKPW"): a round trip carries the share and only the
// unshared tokens' K/V; malformed shares, unknown flags and a v1 payload are refused naming the peer and the sequence.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <numeric>

#include "common/error.h"
#include "pair/pack.h"
#include "tests/small_config.h"

namespace spade::pair {
namespace {

using ::testing::HasSubstr;

using test::small_cfg;

// An update of two layers: sequence 5 INIT of 40 tokens sharing the first 32 with sequence 3, and an APPEND of 3.
PackUpdate shared_update(const ModelConfig& c) {
  PackUpdate u;
  u.step = 4;
  u.num_layers = 2;
  u.released = {8};
  SeqUpdate e;
  e.seq_id = 5;
  e.context_len = 40;
  e.init = true;
  e.num_queries = 2;
  e.shared_tokens = 32;
  e.shared_from = 3;
  e.q.resize(static_cast<size_t>(2) * 2 * c.q_dim());
  e.k.resize(static_cast<size_t>(2) * (40 - 32) * c.kv_dim());
  std::iota(e.q.begin(), e.q.end(), 0.f);
  std::iota(e.k.begin(), e.k.end(), 1000.f);
  e.v = e.k;
  u.seqs.push_back(e);
  SeqUpdate a;
  a.seq_id = 3;
  a.context_len = 41;
  a.num_queries = 1;
  a.q.resize(static_cast<size_t>(2) * c.q_dim(), 1.f);
  a.k.resize(static_cast<size_t>(2) * c.kv_dim(), 2.f);
  a.v = a.k;
  u.seqs.push_back(a);
  return u;
}

TEST(PackSharedInit, RoundTripCarriesTheShareAndOnlyTheUnsharedTokens) {
  const ModelConfig c = small_cfg();
  const PackShape s = pack_shape(c, {});
  const PackUpdate u = shared_update(c);
  const auto bytes = encode(u, s);
  const PackUpdate d = decode_update(bytes.data(), bytes.size(), s, "inference rank 0");
  ASSERT_EQ(d.seqs.size(), 2u);
  EXPECT_TRUE(d.seqs[0].init);
  EXPECT_EQ(d.seqs[0].shared_tokens, 32);
  EXPECT_EQ(d.seqs[0].shared_from, 3u);
  EXPECT_EQ(d.seqs[0].kv_tokens(), 8);
  EXPECT_EQ(d.seqs[0].k, u.seqs[0].k);
  EXPECT_EQ(d.seqs[0].q, u.seqs[0].q);
  EXPECT_FALSE(d.seqs[1].init);
  EXPECT_EQ(d.seqs[1].shared_tokens, 0);
  EXPECT_EQ(d.released, std::vector<uint64_t>{8});

  // The same INIT unshared carries the 32 tokens' K and V of both layers more.
  PackUpdate full = u;
  full.seqs[0].shared_tokens = 0;
  full.seqs[0].shared_from = 0;
  full.seqs[0].k.resize(static_cast<size_t>(2) * 40 * c.kv_dim());
  full.seqs[0].v = full.seqs[0].k;
  const size_t saved = 2 * 2 * 32 * c.kv_dim() * sizeof(float);
  EXPECT_EQ(encode(full, s).size(), bytes.size() + saved - 16) << "a share costs 16 bytes on the wire";
}

TEST(PackSharedInit, MalformedSharesAreRefusedNamingPeerAndSequences) {
  const ModelConfig c = small_cfg();
  const PackShape s = pack_shape(c, {});
  auto refused = [&](std::vector<uint8_t> bytes) -> std::string {
    try {
      decode_update(bytes.data(), bytes.size(), s, "inference rank 2");
    } catch (const Error& e) {
      return e.what();
    }
    return "accepted";
  };
  const PackUpdate u = shared_update(c);
  const auto good = encode(u, s);
  // Header: magic 4, step 8, pack 4, first_layer 4, num_layers 4, released, retained, dropped and seq counts 16,
  // released 8 = 48; then sequence 5: id 8, context_len 4, flags 4, num_queries 4, token budget 4, shared_tokens 4,
  // pad 4, from 8.
  const size_t seq0 = 48, flags = seq0 + 12, shared_tokens = seq0 + 24, pad = seq0 + 28, from = seq0 + 32;
  auto with = [&](size_t off, auto value) {
    auto b = good;
    std::memcpy(b.data() + off, &value, sizeof(value));
    return b;
  };
  EXPECT_THAT(refused(with(shared_tokens, int32_t{40})),
              HasSubstr("inference rank 2: malformed pack update: sequence 5 (context 40) shares 40 tokens of sequence 3"));
  EXPECT_THAT(refused(with(shared_tokens, int32_t{0})), HasSubstr("sequence 5 (context 40) shares 0 tokens"));
  EXPECT_THAT(refused(with(shared_tokens, int32_t{-7})), HasSubstr("shares -7 tokens of sequence 3"));
  EXPECT_THAT(refused(with(from, uint64_t{5})), HasSubstr("sequence 5 (context 40) shares 32 tokens of sequence 5"));
  EXPECT_THAT(refused(with(pad, int32_t{1})), HasSubstr("malformed pack update: sequence 5"));
  EXPECT_THAT(refused(with(flags, uint32_t{2})),
              HasSubstr("inference rank 2: malformed pack update: sequence 5 shares KV of sequence 3 on an APPEND"));
  EXPECT_THAT(refused(with(flags, uint32_t{5})),
              HasSubstr("inference rank 2: malformed pack update: sequence 5 has unknown flags 0x5"));
  // The share's shorter K/V: a share removed from the flags leaves the lengths wrong, which the decoder catches.
  EXPECT_THAT(refused(with(flags, uint32_t{1})), HasSubstr("inference rank 2: malformed pack update"));
  // A v1 or v2 payload (magic "SKPU", "SKPV") is refused by name.
  EXPECT_THAT(refused(with(0, uint32_t{0x55504b53})),
              HasSubstr("inference rank 2: pack update of wire format v1 (\"SKPU\"); this rank speaks v3"));
  EXPECT_THAT(refused(with(0, uint32_t{0x56504b53})),
              HasSubstr("inference rank 2: pack update of wire format v2 (\"SKPV\"); this rank speaks v3"));
  for (size_t cut : {size_t{2}, seq0 + 30, good.size() - 1})
    EXPECT_THAT(refused(std::vector<uint8_t>(good.begin(), good.begin() + static_cast<long>(cut))),
                HasSubstr("inference rank 2: malformed pack"))
        << cut;
  EXPECT_EQ(refused(good), "accepted");
}

TEST(PackSharedInit, EncodeRefusesAShareOnAnAppend) {
  const ModelConfig c = small_cfg();
  PackUpdate u = shared_update(c);
  u.seqs[1].shared_tokens = 4;
  u.seqs[1].shared_from = 5;
  u.seqs[1].k.clear();  // kv_tokens() of an APPEND stays 1: only the share is wrong
  u.seqs[1].k.resize(static_cast<size_t>(2) * c.kv_dim());
  EXPECT_THAT([&] { encode(u, pack_shape(c, {})); },
              ::testing::ThrowsMessage<Error>(HasSubstr("sequence 3 shares tokens on an APPEND")));
}

}  // namespace
}  // namespace spade::pair
