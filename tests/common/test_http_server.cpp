// The Beast-based HTTP server every process serves /metrics (and the coordinator its API) from: plain and
// streamed (chunked) responses, answers from other threads, keep-alive and pipelining, limits (413, 431, 400),
// the client-disconnect callback the coordinator cancels requests with, HEAD (headers without a body) and
// HTTP/1.0 clients (close-delimited streams, explicit keep-alive).
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

/// Everything the server sends until it closes the connection (or 5 s pass).
std::string read_to_eof(RawClient& c) {
  EXPECT_TRUE(c.eof()) << "the server kept the connection open";
  return c.read_until("", 1, 0ms);
}

TEST(HttpServer, HeadGetsTheHeadersOfGetWithoutTheBody) {
  std::atomic<int> calls{0};
  HttpServer srv(options(), [&](const HttpRequest& r, std::shared_ptr<HttpResponder> res) {
    ++calls;
    res->send(200, "text/plain", "hello world " + r.path);
  });
  // Two requests on one keep-alive connection: the HEAD answer carries Content-Length but no body, so the GET's
  // answer follows the HEAD's header directly (the framing of the connection is intact).
  RawClient c(srv.port());
  c.send("HEAD /a HTTP/1.1\r\nHost: x\r\n\r\nGET /b HTTP/1.1\r\nHost: x\r\n\r\n");
  const std::string all = c.read_until("hello world /b");
  const size_t second = all.find("HTTP/1.1 200", 1);
  ASSERT_NE(second, std::string::npos) << all;
  const std::string head = all.substr(0, second);
  EXPECT_THAT(head, HasSubstr("Content-Length: 14\r\n"));  // "hello world /a"
  EXPECT_TRUE(head.ends_with("\r\n\r\n")) << "bytes after the HEAD response's header: " << head;
  EXPECT_EQ(all.find("hello world /a"), std::string::npos) << all;
  EXPECT_EQ(calls.load(), 2);
  // The client helper reads a HEAD answer without waiting for a body.
  auto r = http_request("127.0.0.1", srv.port(), "HEAD", "/c", "", {}, 2000ms);
  EXPECT_EQ(r.status, 200);
  EXPECT_EQ(r.body, "");
  EXPECT_EQ(r.headers["content-length"], "14");
  // A server-level error answered to a HEAD request (413 here) is its header only, without the JSON body.
  HttpServer small(options(10), [](const HttpRequest&, std::shared_ptr<HttpResponder> res) {
    res->send(200, "text/plain", "ok");
  });
  RawClient s(small.port());
  s.send("HEAD /x HTTP/1.1\r\nHost: x\r\nContent-Length: 11\r\n\r\nhello world");
  const std::string e = read_to_eof(s);
  EXPECT_THAT(e, HasSubstr("HTTP/1.1 413"));
  EXPECT_TRUE(e.ends_with("\r\n\r\n")) << e;
}

TEST(HttpServer, HeadToAStreamSendsTheHeaderAndStopsTheProducer) {
  std::atomic<bool> stopped{false};
  std::shared_ptr<HttpResponder> kept;
  std::mutex mu;
  HttpServer srv(options(), [&](const HttpRequest&, std::shared_ptr<HttpResponder> res) {
    res->on_close([&] { stopped = true; });
    res->begin_stream(200, "text/event-stream");
    res->write("data: never sent\n\n");
    std::lock_guard<std::mutex> lk(mu);
    kept = res;
  });
  RawClient c(srv.port());
  c.send("HEAD /s HTTP/1.1\r\nHost: x\r\n\r\n");
  const std::string all = read_to_eof(c);
  EXPECT_THAT(all, HasSubstr("HTTP/1.1 200"));
  EXPECT_THAT(all, HasSubstr("Content-Type: text/event-stream"));
  EXPECT_TRUE(all.ends_with("\r\n\r\n")) << all;
  EXPECT_EQ(all.find("never sent"), std::string::npos);
  for (auto until = std::chrono::steady_clock::now() + 5s; !stopped && std::chrono::steady_clock::now() < until;)
    std::this_thread::sleep_for(5ms);
  EXPECT_TRUE(stopped.load()) << "the producer of a HEAD stream was not told to stop";
  std::lock_guard<std::mutex> lk(mu);
  ASSERT_TRUE(kept);
  EXPECT_TRUE(kept->closed());
}

TEST(HttpServer, Http10ClientsGetACloseDelimitedStream) {
  std::vector<std::thread> threads;
  std::mutex mu;
  HttpServer srv(options(), [&](const HttpRequest& r, std::shared_ptr<HttpResponder> res) {
    EXPECT_EQ(r.version, 10u);
    std::lock_guard<std::mutex> lk(mu);
    threads.emplace_back([res] {
      res->begin_stream(200, "text/event-stream");
      for (int i = 0; i < 3; ++i) {
        res->write("data: " + std::to_string(i) + "\n\n");
        std::this_thread::sleep_for(5ms);
      }
      res->write("data: [DONE]\n\n");
      res->end();
    });
  });
  RawClient c(srv.port());
  c.send("POST /s HTTP/1.0\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}");
  const std::string all = read_to_eof(c);
  {
    std::lock_guard<std::mutex> lk(mu);
    for (auto& t : threads) t.join();
  }
  const size_t hdr_end = all.find("\r\n\r\n");
  ASSERT_NE(hdr_end, std::string::npos) << all;
  const std::string hdr = all.substr(0, hdr_end + 4), body = all.substr(hdr_end + 4);
  EXPECT_THAT(hdr, HasSubstr(" 200 "));
  EXPECT_THAT(hdr, HasSubstr("Connection: close\r\n"));
  EXPECT_EQ(hdr.find("Transfer-Encoding"), std::string::npos) << hdr;
  EXPECT_EQ(hdr.find("Content-Length"), std::string::npos) << hdr;
  EXPECT_EQ(body, "data: 0\n\ndata: 1\n\ndata: 2\n\ndata: [DONE]\n\n") << "not the raw event bytes: " << body;
}

TEST(HttpServer, Http10KeepAliveIsAnsweredExplicitly) {
  HttpServer srv(options(), [](const HttpRequest& r, std::shared_ptr<HttpResponder> res) {
    res->send(200, "text/plain", r.path);
  });
  {  // asked for keep-alive: told so, and the connection serves a second request
    RawClient c(srv.port());
    c.send("GET /one HTTP/1.0\r\nConnection: keep-alive\r\n\r\n");
    EXPECT_THAT(c.read_until("/one"), HasSubstr("Connection: keep-alive\r\n"));
    c.send("GET /two HTTP/1.0\r\n\r\n");
    const std::string all = read_to_eof(c);  // no keep-alive asked the second time: closed after it
    EXPECT_THAT(all, HasSubstr("/two"));
  }
  {  // plain HTTP/1.0: one response with Content-Length, then close
    RawClient c(srv.port());
    c.send("GET /three HTTP/1.0\r\n\r\n");
    const std::string all = read_to_eof(c);
    EXPECT_THAT(all, HasSubstr("Content-Length: 6\r\n"));
    EXPECT_TRUE(all.ends_with("/three")) << all;
  }
}

TEST(HttpServer, ExpectContinueGetsContinueThenTheAnswer) {
  HttpServer srv(options(100), [](const HttpRequest& r, std::shared_ptr<HttpResponder> res) {
    res->send(200, "text/plain", "got " + r.body);
  });
  {  // the body is sent only after "100 Continue" (a client waiting for it would otherwise stall)
    RawClient c(srv.port());
    c.send("POST /x HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 5\r\n\r\n");
    EXPECT_THAT(c.read_until("\r\n\r\n", 1, 5000ms), ::testing::StartsWith("HTTP/1.1 100 Continue\r\n\r\n"));
    c.send("hello");
    EXPECT_THAT(c.read_until("got hello", 1, 5000ms), HasSubstr("HTTP/1.1 200"));
  }
  {  // over the limit: 413 at once, no 100, the body never read
    RawClient c(srv.port());
    c.send("POST /x HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 101\r\n\r\n");
    const std::string all = read_to_eof(c);
    EXPECT_THAT(all, ::testing::StartsWith("HTTP/1.1 413"));
    EXPECT_EQ(all.find("100 Continue"), std::string::npos);
  }
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
