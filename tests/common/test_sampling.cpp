#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <map>

#include "common/error.h"
#include "common/sampling.h"

namespace spade {
namespace {

TEST(Sampling, ArgmaxLowestIdOnTies) {
  std::vector<float> l = {0.5f, 2.0f, -1.0f, 2.0f};
  EXPECT_EQ(argmax(l.data(), 4), 1);
}

TEST(Sampling, GreedyModes) {
  std::mt19937_64 rng(1);
  std::vector<float> l = {0.1f, 0.3f, 3.0f, 0.2f};
  EXPECT_EQ(sample_token(l.data(), 4, {.temperature = 0.f}, rng), 2);
  EXPECT_EQ(sample_token(l.data(), 4, {.temperature = 5.f, .top_k = 1}, rng), 2);
  for (int i = 0; i < 50; ++i) EXPECT_EQ(sample_token(l.data(), 4, {.temperature = 1.f, .top_p = 1e-6f}, rng), 2);
}

TEST(Sampling, EmpiricalDistributionMatchesSoftmax) {
  std::vector<float> l = {1.0f, 2.0f, 0.0f, 1.5f};
  for (float temp : {1.0f, 0.5f, 2.0f}) {
    std::vector<double> p(4);
    double z = 0;
    for (int i = 0; i < 4; ++i) z += p[i] = std::exp(l[i] / temp);
    std::mt19937_64 rng(42);
    std::vector<int> count(4);
    const int n = 200000;
    for (int i = 0; i < n; ++i) ++count[sample_token(l.data(), 4, {.temperature = temp}, rng)];
    for (int i = 0; i < 4; ++i) EXPECT_NEAR(count[i] / double(n), p[i] / z, 0.005) << "temp " << temp << " id " << i;
  }
}

TEST(Sampling, TopKAndTopPRestrictSupport) {
  std::vector<float> l = {1.0f, 2.0f, 0.0f, 1.5f, -1.0f};
  std::mt19937_64 rng(3);
  std::map<int, int> seen;
  for (int i = 0; i < 5000; ++i) ++seen[sample_token(l.data(), 5, {.temperature = 1.f, .top_k = 2}, rng)];
  EXPECT_EQ(seen.size(), 2u);
  EXPECT_TRUE(seen.count(1) && seen.count(3));
  // softmax probs sorted: id1 .43, id3 .26, id0 .16, ... top_p 0.6 keeps {1, 3}.
  seen.clear();
  for (int i = 0; i < 5000; ++i) ++seen[sample_token(l.data(), 5, {.temperature = 1.f, .top_p = 0.6f}, rng)];
  EXPECT_EQ(seen.size(), 2u);
  EXPECT_TRUE(seen.count(1) && seen.count(3));
}

TEST(Sampling, SeedReproducible) {
  std::vector<float> l(100);
  for (int i = 0; i < 100; ++i) l[i] = std::sin(i * 0.37f);
  std::mt19937_64 a(9), b(9);
  for (int i = 0; i < 100; ++i) EXPECT_EQ(sample_token(l.data(), 100, {}, a), sample_token(l.data(), 100, {}, b));
}

TEST(Sampling, ValidateNamesParameter) {
  using ::testing::HasSubstr;
  auto msg = [](SamplingParams p) {
    try {
      validate(p);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_EQ(msg({}), "");
  EXPECT_THAT(msg({.temperature = -1}), HasSubstr("temperature"));
  EXPECT_THAT(msg({.temperature = NAN}), HasSubstr("temperature"));
  EXPECT_THAT(msg({.top_p = 0}), HasSubstr("top_p"));
  EXPECT_THAT(msg({.top_p = 1.5f}), HasSubstr("top_p"));
  EXPECT_THAT(msg({.top_k = -2}), HasSubstr("top_k"));
}

}  // namespace
}  // namespace spade
