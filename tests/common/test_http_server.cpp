// The Beast-based HTTP server every process serves /metrics (and the coordinator its API) from: plain and
// streamed (chunked) responses, answers from other threads, keep-alive and pipelining, limits (413, 431, 400),
// and the client-disconnect callback the coordinator cancels requests with.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <mutex>
#include <thread>

#include "common/error.h"
#include "common/http_server.h"
#include "tests/test_util.h"

namespace spade::http {
namespace {

using test::RawClient;

using namespace std::chrono_literals;
using ::testing::HasSubstr;

HttpServerOptions options(size_t max_body = 1024) {
  HttpServerOptions o;
  o.bind_host = "127.0.0.1";
  o.max_body_bytes = max_body;
  o.name = "test server";
  o.error_body = [](int status, const std::string& msg) {
    return std::make_pair(std::string("application/json"),
                          "{\"error\":{\"code\":" + std::to_string(status) + ",\"message\":\"" + msg + "\"}}");
  };
  return o;
}

TEST(HttpServer, AnswersAndEchoesRequestParts) {
  HttpServer srv(options(), [](const HttpRequest& r, std::shared_ptr<HttpResponder> res) {
    res->send(201, "text/plain", r.method + " " + r.path + " ?" + r.query + " [" + r.body + "] " +
                                     r.headers.at("x-test"), {{"X-Reply", "yes"}});
  });
  auto resp = http_request("127.0.0.1", srv.port(), "POST", "/a/b?c=1", "hello", {{"X-Test", "v"}});
  EXPECT_EQ(resp.status, 201);
  EXPECT_EQ(resp.body, "POST /a/b ?c=1 [hello] v");
  EXPECT_EQ(resp.headers["x-reply"], "yes");
  EXPECT_EQ(resp.headers["content-type"], "text/plain");
}

TEST(HttpServer, StreamsChunksWrittenFromAnotherThread) {
  std::vector<std::thread> threads;
  HttpServer srv(options(), [&](const HttpRequest&, std::shared_ptr<HttpResponder> res) {
    threads.emplace_back([res] {
      res->begin_stream(200, "text/event-stream");
      for (int i = 0; i < 5; ++i) {
        res->write("data: " + std::to_string(i) + "\n\n");
        std::this_thread::sleep_for(5ms);
      }
      res->write("");  // skipped, does not end the stream
      res->write("data: [DONE]\n\n");
      res->end();
      res->write("after end is ignored");
    });
  });
  auto resp = http_request("127.0.0.1", srv.port(), "GET", "/stream");
  for (auto& t : threads) t.join();
  EXPECT_EQ(resp.status, 200);
  EXPECT_EQ(resp.headers["content-type"], "text/event-stream");
  EXPECT_EQ(resp.headers["transfer-encoding"], "chunked");
  EXPECT_EQ(resp.body, "data: 0\n\ndata: 1\n\ndata: 2\n\ndata: 3\n\ndata: 4\n\ndata: [DONE]\n\n");
}

TEST(HttpServer, KeepAliveAndPipelinedRequests) {
  std::atomic<int> n{0};
  HttpServer srv(options(), [&](const HttpRequest& r, std::shared_ptr<HttpResponder> res) {
    ++n;
    res->send(200, "text/plain", r.path);
  });
  RawClient c(srv.port());
  c.send("GET /one HTTP/1.1\r\nHost: x\r\n\r\n");
  EXPECT_THAT(c.read_until("/one"), HasSubstr("HTTP/1.1 200"));
  // Two requests in one write: both answered, in order, on the same connection.
  c.send("GET /two HTTP/1.1\r\nHost: x\r\n\r\nGET /three HTTP/1.1\r\nHost: x\r\n\r\n");
  const std::string all = c.read_until("/three");
  EXPECT_LT(all.find("/two"), all.find("/three"));
  EXPECT_EQ(n.load(), 3);
}

TEST(HttpServer, OversizedBodyGets413WithoutReachingTheHandler) {
  std::atomic<int> n{0};
  HttpServer srv(options(100), [&](const HttpRequest&, std::shared_ptr<HttpResponder> res) {
    ++n;
    res->send(200, "text/plain", "ok");
  });
  auto resp = http_request("127.0.0.1", srv.port(), "POST", "/x", std::string(101, 'a'));
  EXPECT_EQ(resp.status, 413);
  EXPECT_THAT(resp.body, HasSubstr("request body exceeds the limit of 100 bytes"));
  EXPECT_EQ(resp.headers["content-type"], "application/json");
  EXPECT_EQ(n.load(), 0);
  EXPECT_EQ(http_request("127.0.0.1", srv.port(), "POST", "/x", std::string(100, 'a')).status, 200);
}

TEST(HttpServer, MalformedAndHugeHeadersAreRejected) {
  HttpServer srv(options(), [&](const HttpRequest&, std::shared_ptr<HttpResponder> res) {
    res->send(200, "text/plain", "ok");
  });
  {
    RawClient c(srv.port());
    c.send("THIS IS NOT HTTP\r\n\r\n");
    EXPECT_THAT(c.read_until("}}", 1, 5000ms), HasSubstr("HTTP/1.1 400"));
    EXPECT_TRUE(c.eof());
  }
  {
    RawClient c(srv.port());
    c.send("GET / HTTP/1.1\r\nX-Big: " + std::string(20000, 'b') + "\r\n\r\n");
    EXPECT_THAT(c.read_until("}}", 1, 5000ms), HasSubstr("HTTP/1.1 431"));
  }
  // Still serving.
  EXPECT_EQ(http_request("127.0.0.1", srv.port(), "GET", "/").status, 200);
}

TEST(HttpServer, ClientDisconnectRunsOnCloseOnce) {
  std::mutex mu;
  std::condition_variable cv;
  int closes = 0;
  std::shared_ptr<HttpResponder> kept;
  HttpServer srv(options(), [&](const HttpRequest&, std::shared_ptr<HttpResponder> res) {
    res->on_close([&] {
      std::lock_guard<std::mutex> lk(mu);
      ++closes;
      cv.notify_all();
    });
    res->begin_stream(200, "text/event-stream");
    res->write("data: first\n\n");
    std::lock_guard<std::mutex> lk(mu);
    kept = res;
  });
  {
    RawClient c(srv.port());
    c.send("GET /s HTTP/1.1\r\nHost: x\r\n\r\n");
    EXPECT_THAT(c.read_until("first"), HasSubstr("data: first"));
  }  // closes the socket mid-stream
  std::unique_lock<std::mutex> lk(mu);
  ASSERT_TRUE(cv.wait_for(lk, 5s, [&] { return closes == 1; })) << "on_close never ran";
  ASSERT_TRUE(kept);
  EXPECT_TRUE(kept->closed());
  kept->write("data: late\n\n");  // no effect, no crash
  kept->end();
  bool late = false;
  kept->on_close([&] { late = true; });  // registered after the fact: runs (on the io thread) at once
  cv.wait_for(lk, 2s, [&] { return late; });
  EXPECT_TRUE(late);
  EXPECT_EQ(closes, 1);
}

TEST(HttpServer, CompletedResponseNeverReportsClosed) {
  std::shared_ptr<HttpResponder> kept;
  std::atomic<bool> called{false};
  HttpServer srv(options(), [&](const HttpRequest&, std::shared_ptr<HttpResponder> res) {
    res->on_close([&] { called = true; });
    res->send(200, "text/plain", "done");
    kept = res;
  });
  EXPECT_EQ(http_request("127.0.0.1", srv.port(), "GET", "/").body, "done");
  std::this_thread::sleep_for(200ms);  // the client closed after the complete response
  EXPECT_FALSE(called.load());
  EXPECT_FALSE(kept->closed());
}

TEST(HttpServer, HandlerExceptionBecomes500) {
  HttpServer srv(options(), [](const HttpRequest&, std::shared_ptr<HttpResponder>) { fail("boom"); });
  auto r = http_request("127.0.0.1", srv.port(), "GET", "/");
  EXPECT_EQ(r.status, 500);
  EXPECT_THAT(r.body, HasSubstr("boom"));
}

TEST(HttpServer, StopClosesPendingStreams) {
  std::atomic<bool> closed{false};
  auto srv = std::make_unique<HttpServer>(options(), [&](const HttpRequest&, std::shared_ptr<HttpResponder> res) {
    res->on_close([&] { closed = true; });
    res->begin_stream(200, "text/event-stream");
  });
  RawClient c(srv->port());
  c.send("GET / HTTP/1.1\r\nHost: x\r\n\r\n");
  c.read_until("\r\n\r\n");
  srv->stop();
  EXPECT_TRUE(closed.load());
  EXPECT_TRUE(c.eof());
}

TEST(HttpServer, BindErrorsNameTheAddress) {
  HttpServer a(options(), [](const HttpRequest&, std::shared_ptr<HttpResponder> r) { r->send(200, "t", ""); });
  auto o = options();
  o.port = a.port();
  try {
    HttpServer b(o, [](const HttpRequest&, std::shared_ptr<HttpResponder> r) { r->send(200, "t", ""); });
    ADD_FAILURE() << "second bind on the same port succeeded";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("cannot listen on 127.0.0.1:" + std::to_string(a.port())));
  }
  EXPECT_THROW(http_request("127.0.0.1", 1, "GET", "/"), Error);
}

}  // namespace
}  // namespace spade::http
