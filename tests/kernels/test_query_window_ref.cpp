// push_query_window_ref (kernels/query_window_ref.h): the last min(capacity, len + n) queries, oldest first, over
// several steps; reset; bad input.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "common/error.h"
#include "kernels/query_window_ref.h"

namespace spade::kernels {
namespace {

constexpr int kHeads = 2, kDim = 3, kCap = 4;

// The query of token `id` for head h: a pure function, so a window's content names its tokens.
float qv(int id, int h, int d) { return static_cast<float>(id * 100 + h * 10 + d); }

TEST(QueryWindowRef, KeepsTheLastQueriesOldestFirstAcrossSteps) {
  const int windows = 3;
  std::vector<float> win(static_cast<size_t>(windows) * kHeads * kCap * kDim, -1.f);
  std::vector<int32_t> len(windows, 0);
  // history[w]: token ids pushed so far
  std::vector<std::vector<int>> history(windows);
  int next_id = 1;
  const std::vector<std::vector<int>> steps = {{3, 1, 0}, {1, 6, 2}, {1, 1, 1}, {5, 0, 3}};  // tokens per window
  for (const auto& counts : steps) {
    std::vector<int32_t> idx, cu = {0};
    std::vector<float> q;
    for (int w = windows - 1; w >= 0; --w) {  // rows in another order than the windows
      idx.push_back(w);
      for (int i = 0; i < counts[w]; ++i) {
        const int id = next_id++;
        history[w].push_back(id);
        for (int h = 0; h < kHeads; ++h)
          for (int d = 0; d < kDim; ++d) q.push_back(qv(id, h, d));
      }
      cu.push_back(cu.back() + counts[w]);
    }
    PushQueryWindowRefParams p;
    p.windows = win.data();
    p.window_len = len.data();
    p.window_idx = idx.data();
    p.q = q.data();
    p.cu_tokens = cu.data();
    p.num_windows = windows;
    p.rows = windows;
    p.num_heads = kHeads;
    p.capacity = kCap;
    p.head_dim = kDim;
    push_query_window_ref(p);
    for (int w = 0; w < windows; ++w) {
      const int n = static_cast<int>(history[w].size()), keep = std::min(kCap, n);
      ASSERT_EQ(len[w], keep) << "window " << w;
      for (int e = 0; e < keep; ++e) {
        const int id = history[w][static_cast<size_t>(n - keep + e)];
        for (int h = 0; h < kHeads; ++h)
          for (int d = 0; d < kDim; ++d)
            ASSERT_EQ(win[((static_cast<size_t>(w) * kHeads + h) * kCap + e) * kDim + d], qv(id, h, d))
                << "window " << w << " entry " << e;
      }
    }
  }
  // reset: window 1 starts over with two queries.
  std::vector<int32_t> idx = {1}, cu = {0, 2}, reset = {1};
  std::vector<float> q;
  for (int id : {900, 901})
    for (int h = 0; h < kHeads; ++h)
      for (int d = 0; d < kDim; ++d) q.push_back(qv(id, h, d));
  PushQueryWindowRefParams p;
  p.windows = win.data();
  p.window_len = len.data();
  p.window_idx = idx.data();
  p.q = q.data();
  p.cu_tokens = cu.data();
  p.reset = reset.data();
  p.num_windows = windows;
  p.rows = 1;
  p.num_heads = kHeads;
  p.capacity = kCap;
  p.head_dim = kDim;
  push_query_window_ref(p);
  EXPECT_EQ(len[1], 2);
  EXPECT_EQ(win[(static_cast<size_t>(1) * kHeads * kCap) * kDim], qv(900, 0, 0));
  // Bad input: a window used twice, a window outside the pool, a corrupt length.
  std::vector<int32_t> twice = {0, 0}, cu2 = {0, 0, 0};
  p.window_idx = twice.data();
  p.cu_tokens = cu2.data();
  p.reset = nullptr;
  p.rows = 2;
  EXPECT_THROW(push_query_window_ref(p), Error);
  std::vector<int32_t> out = {windows};
  p.window_idx = out.data();
  p.rows = 1;
  EXPECT_THROW(push_query_window_ref(p), Error);
  len[0] = kCap + 1;
  std::vector<int32_t> zero = {0};
  p.window_idx = zero.data();
  EXPECT_THROW(push_query_window_ref(p), Error);
}

}  // namespace
}  // namespace spade::kernels
