// Test helpers for loaders that must refuse a FIFO (or other non-regular file) in place of a checkpoint file
// without blocking: make_fifo, and error_within, which runs a loader on a thread with a deadline and, should
// the loader block on the FIFO, unblocks it (by opening the FIFO's write end) so that the test fails instead
// of hanging.
#pragma once

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <exception>
#include <filesystem>
#include <functional>
#include <future>
#include <memory>
#include <string>
#include <thread>

#include "common/error.h"

namespace spade::test {

/// Replaces whatever is at `path` with a FIFO (mkfifo 0600); fails the test when it cannot.
inline void make_fifo(const std::string& path) {
  std::error_code ec;
  std::filesystem::remove(path, ec);
  ASSERT_EQ(::mkfifo(path.c_str(), 0600), 0) << "mkfifo " << path;
}

/// Runs `fn` on a thread and returns the message of the spade::Error it throws ("" when it returns,
/// "unexpected exception: ..." for another type). When it has not finished within `deadline` the test fails
/// ("blocked"), and the FIFO `fifo` is opened for writing and closed, repeatedly for up to 30 s, until the
/// blocked open/read returns; a loader still stuck after that is left running (detached) so that the test
/// ends.
inline std::string error_within(std::function<void()> fn, const std::string& fifo,
                                std::chrono::milliseconds deadline = std::chrono::milliseconds(5000)) {
  auto done = std::make_shared<std::promise<std::string>>();
  std::future<std::string> result = done->get_future();
  std::thread t([done, fn = std::move(fn)] {
    try {
      fn();
      done->set_value("");
    } catch (const Error& e) {
      done->set_value(e.what());
    } catch (const std::exception& e) {
      done->set_value(std::string("unexpected exception: ") + e.what());
    }
  });
  const auto start = std::chrono::steady_clock::now();
  if (result.wait_for(deadline) != std::future_status::ready) {
    ADD_FAILURE() << "the loader blocked for more than " << deadline.count() << " ms on " << fifo;
    for (int i = 0; i < 600 && result.wait_for(std::chrono::milliseconds(50)) != std::future_status::ready;
         ++i) {
      const int fd =
          ::open(fifo.c_str(), O_WRONLY | O_NONBLOCK | O_CLOEXEC);  // a writer unblocks a reader's open
      if (fd >= 0) ::close(fd);                                     // and closing it ends its read
    }
  }
  if (result.wait_for(std::chrono::milliseconds(0)) != std::future_status::ready) {
    ADD_FAILURE() << "the loader is still blocked on " << fifo << "; leaving its thread behind";
    t.detach();
    return "";
  }
  t.join();
  EXPECT_LT(std::chrono::steady_clock::now() - start, deadline) << fifo;
  return result.get();
}

}  // namespace spade::test
