// The serving loop's request intake (inference_rank/serve.h take_requests): only the first take may wait, so a
// request that reaches an idle rank starts with the next step instead of after the loop's idle wait.
#include <gtest/gtest.h>

#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "inference_rank/serve.h"

namespace spade {
namespace {

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

TEST(TakeRequests, OnlyTheFirstTakeWaitsAndEveryQueuedRequestIsTaken) {
  std::deque<int> queue = {1, 2, 3};
  std::vector<Clock::time_point> deadlines;
  std::vector<Clock::time_point> called_at;
  std::vector<int> taken;
  const auto first = Clock::now() + 10s;
  const int n = take_requests(
      [&](Clock::time_point d) -> std::optional<int> {
        deadlines.push_back(d);
        called_at.push_back(Clock::now());
        if (queue.empty()) return std::nullopt;
        const int v = queue.front();
        queue.pop_front();
        return v;
      },
      first, [&](int v) { taken.push_back(v); });
  EXPECT_EQ(n, 3);
  EXPECT_EQ(taken, (std::vector<int>{1, 2, 3}));
  ASSERT_EQ(deadlines.size(), 4u);  // three requests, then the empty queue ends the pass
  EXPECT_EQ(deadlines[0], first);
  for (size_t i = 1; i < deadlines.size(); ++i)
    EXPECT_LE(deadlines[i], called_at[i]) << "take " << i << " must not wait: its deadline has to be in the past";
}

// Against a real blocking queue (a condition variable, as the coordinator client's): one request arrives 20 ms into
// a 5 s idle wait; the pass ends right after it, not at the idle deadline.
TEST(TakeRequests, AnArrivalEndsTheIdleWait) {
  std::mutex mu;
  std::condition_variable cv;
  std::deque<int> queue;
  auto next = [&](Clock::time_point deadline) -> std::optional<int> {
    std::unique_lock<std::mutex> lk(mu);
    if (!cv.wait_until(lk, deadline, [&] { return !queue.empty(); })) return std::nullopt;
    const int v = queue.front();
    queue.pop_front();
    return v;
  };
  std::thread producer([&] {
    std::this_thread::sleep_for(20ms);
    {
      std::lock_guard<std::mutex> lk(mu);
      queue.push_back(7);
    }
    cv.notify_all();
  });
  const auto t0 = Clock::now();
  std::vector<int> taken;
  const int n = take_requests(next, t0 + 5s, [&](int v) { taken.push_back(v); });
  const auto elapsed = Clock::now() - t0;
  producer.join();
  EXPECT_EQ(n, 1);
  EXPECT_EQ(taken, std::vector<int>{7});
  EXPECT_LT(elapsed, 2s) << "the pass waited for the idle deadline after the request arrived";
  // Nothing queued and a deadline already passed: returns at once with nothing.
  const auto t1 = Clock::now();
  EXPECT_EQ(take_requests(next, t1, [&](int) { ADD_FAILURE() << "nothing was queued"; }), 0);
  EXPECT_LT(Clock::now() - t1, 1s);
}

}  // namespace
}  // namespace spade
