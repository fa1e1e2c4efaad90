// The link factory (transport/link_factory.h) on the CPU: kind names, which kinds this build has, clear errors for
// kinds it lacks or for the wrong family, and host links made through the factory: a loopback pair (own fabric and
// the process-wide one) exchanging messages, and the transport contract (tests/transport/contract.h) on every host
// kind this build has. SPADE_TEST_EXPECT_GPU_LINKS (tests/transport/CMakeLists.txt) says whether the build has the
// GPU links; SPADE_HAVE_UCX whether it has UCX.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "common/error.h"
#include "tests/transport/contract.h"
#include "transport/link_factory.h"
#include "transport/loopback.h"

namespace spade::transport::test {
namespace {

constexpr LinkKind kKinds[] = {LinkKind::kNccl, LinkKind::kCudaIpc, LinkKind::kUcx, LinkKind::kLoopback};

bool has(const std::vector<LinkKind>& v, LinkKind k) { return std::find(v.begin(), v.end(), k) != v.end(); }

// The message an unavailable kind's creation throws.
std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const spade::Error& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(LinkFactory, KindNamesRoundTrip) {
  EXPECT_STREQ(link_kind_name(LinkKind::kNccl), "nccl");
  EXPECT_STREQ(link_kind_name(LinkKind::kCudaIpc), "cuda-ipc");
  EXPECT_STREQ(link_kind_name(LinkKind::kUcx), "ucx");
  EXPECT_STREQ(link_kind_name(LinkKind::kLoopback), "loopback");
  for (LinkKind k : kKinds) EXPECT_EQ(parse_link_kind(link_kind_name(k)), k);
  EXPECT_EQ(parse_link_kind("ipc"), LinkKind::kCudaIpc);  // inference_rank --gpu-link ipc
  EXPECT_EQ(parse_link_kind("cuda_ipc"), LinkKind::kCudaIpc);
  EXPECT_TRUE(is_gpu_link_kind(LinkKind::kNccl));
  EXPECT_TRUE(is_gpu_link_kind(LinkKind::kCudaIpc));
  EXPECT_FALSE(is_gpu_link_kind(LinkKind::kUcx));
  EXPECT_FALSE(is_gpu_link_kind(LinkKind::kLoopback));
  const std::string m = error_of([] { parse_link_kind("infiniband"); });
  EXPECT_NE(m.find("unknown link kind 'infiniband'"), std::string::npos) << m;
  EXPECT_NE(m.find("nccl, cuda-ipc, ucx, loopback"), std::string::npos) << m;
}

TEST(LinkFactory, AvailableKindsMatchTheBuild) {
  const std::vector<LinkKind> kinds = available_link_kinds();
  EXPECT_TRUE(has(kinds, LinkKind::kLoopback));
  EXPECT_EQ(has(kinds, LinkKind::kUcx), static_cast<bool>(SPADE_HAVE_UCX));
  EXPECT_EQ(has(kinds, LinkKind::kNccl), static_cast<bool>(SPADE_TEST_EXPECT_GPU_LINKS));
  EXPECT_EQ(has(kinds, LinkKind::kCudaIpc), static_cast<bool>(SPADE_TEST_EXPECT_GPU_LINKS));
  EXPECT_TRUE(std::is_sorted(kinds.begin(), kinds.end()));  // enum order, no duplicates
  EXPECT_EQ(std::adjacent_find(kinds.begin(), kinds.end()), kinds.end());
  for (LinkKind k : kKinds) {
    EXPECT_EQ(link_kind_available(k), has(kinds, k)) << link_kind_name(k);
    if (link_kind_available(k)) {
      EXPECT_NO_THROW(require_link_kind(k)) << link_kind_name(k);
    }
  }
}

// Every kind this build lacks is refused by name, saying what the build lacks and what it has, by
// require_link_kind() and by the function that would create it.
TEST(LinkFactory, UnavailableKindIsAClearErrorNamingIt) {
  int checked = 0;
  for (LinkKind k : kKinds) {
    if (link_kind_available(k)) continue;
    ++checked;
    const std::string prefix =
        fmt::format("link kind '{}' is not built into this binary (built without ", link_kind_name(k));
    LinkOptions o;
    o.kind = k;
    o.peer_name = "cache rank 1 (#0) on host-b";
    std::vector<std::string> errors = {error_of([&] { require_link_kind(k); })};
    if (is_gpu_link_kind(k)) {
      errors.push_back(error_of([&] { offer_gpu_link(o); }));
      errors.push_back(error_of([&] { join_gpu_link(std::string(16, 'x'), o); }));
    } else {
      errors.push_back(error_of([&] { make_host_transport(o); }));
    }
    for (const std::string& m : errors) {
      EXPECT_EQ(m.rfind(prefix, 0), 0u) << m;
      EXPECT_NE(m.find("this binary has: "), std::string::npos) << m;
      EXPECT_NE(m.find("loopback"), std::string::npos) << m;
    }
  }
  if (!SPADE_TEST_EXPECT_GPU_LINKS) {
    EXPECT_GE(checked, 2);
    const std::string m = error_of([] {
      LinkOptions o;
      o.kind = LinkKind::kNccl;
      offer_gpu_link(o);
    });
    EXPECT_EQ(m.rfind("link kind 'nccl' is not built into this binary (built without NCCL)", 0), 0u) << m;
    const std::string c = error_of([] { require_link_kind(LinkKind::kCudaIpc); });
    EXPECT_EQ(c.rfind("link kind 'cuda-ipc' is not built into this binary (built without CUDA)", 0), 0u) << c;
  }
  if (checked == 0) GTEST_SKIP() << "every link kind is built into this binary";
}

TEST(LinkFactory, WrongFamilyIsAClearError) {
  LinkOptions o;
  o.kind = LinkKind::kNccl;
  std::string m = error_of([&] { make_host_transport(o); });
  EXPECT_NE(m.find("link kind 'nccl' is a GPU link"), std::string::npos) << m;
  o.kind = LinkKind::kLoopback;
  m = error_of([&] { offer_gpu_link(o); });
  EXPECT_NE(m.find("link kind 'loopback' is a host link"), std::string::npos) << m;
  o.kind = LinkKind::kUcx;
  m = error_of([&] { join_gpu_link("address", o); });
  EXPECT_NE(m.find("link kind 'ucx' is a host link"), std::string::npos) << m;
}

// Sends `text` a -> b and checks it arrives whole.
void exchange(Endpoint& from, Endpoint& to, uint64_t tag, const std::string& text) {
  std::vector<char> got(64, '\0');
  RecvHandle r = to.post_recv(tag, got.data(), got.size());
  SendHandle s = from.post_send(tag, text.data(), text.size());
  ASSERT_EQ(s.wait(in(5000ms)), Status::OK) << s.error();
  ASSERT_EQ(r.wait(in(5000ms)), Status::OK) << r.error();
  ASSERT_EQ(r.length(), text.size());
  EXPECT_EQ(std::string(got.data(), r.length()), text);
}

TEST(LinkFactory, LoopbackPairMadeByTheFactoryExchangesMessages) {
  LinkOptions o;
  o.kind = LinkKind::kLoopback;
  o.loopback_fabric = LoopbackFabric::create();
  o.name = "inference rank 0 (#0)";
  auto inf = make_host_transport(o);
  o.name = "cache rank 1 (#0)";
  auto cache = make_host_transport(o);
  EXPECT_EQ(inf->kind(), "loopback");
  EXPECT_NE(inf->local_address(), cache->local_address());
  auto [to_cache, to_inf] = connect_pair(*inf, "inference rank 0 (#0)", *cache, "cache rank 1 (#0)");
  EXPECT_EQ(to_cache->peer_name(), "cache rank 1 (#0)");
  exchange(*to_cache, *to_inf, 7, "q/k/v of pack 0");
  exchange(*to_inf, *to_cache, 8, "selected kv of pack 0");
  // Aborting one end breaks the connection for both.
  to_inf->abort("test over");
  EXPECT_TRUE(to_cache->failed());
}

TEST(LinkFactory, LoopbackWithoutAFabricSharesTheProcessWideOne) {
  LinkOptions o;
  o.kind = LinkKind::kLoopback;
  o.name = "a";
  auto a = make_host_transport(o);
  o.name = "b";
  auto b = make_host_transport(o);
  auto [ab, ba] = connect_pair(*a, "a", *b, "b");
  exchange(*ab, *ba, 1, "hello over the default fabric");
}

// The transport contract on every host kind the factory can make in this build.
std::vector<TransportFactory> host_factories() {
  std::vector<TransportFactory> out;
  for (LinkKind k : available_link_kinds()) {
    if (is_gpu_link_kind(k)) continue;
    out.push_back(TransportFactory{std::string("factory_") + link_kind_name(k), [k](const std::string& label) {
                                     LinkOptions o;
                                     o.kind = k;
                                     o.name = label;
                                     return make_host_transport(o);
                                   }});
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(LinkFactory, TransportContract, ::testing::ValuesIn(host_factories()),
                         [](const ::testing::TestParamInfo<TransportFactory>& i) { return i.param.name; });

}  // namespace
}  // namespace spade::transport::test
