// The parameter server before authentication: a stranger that speaks ZeroMQ's wire
// protocol (ZMTP 3.0, written here byte by byte) and sends unfinished 256 MiB multi-frame
// messages on 4 connections does not grow the server; 2,000 malformed messages do not write 2,000
// log lines. The server runs in a forked process, measured through /proc/PID/status.
#include <gtest/gtest.h>
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>
#include <zmq.hpp>

#include "ps/auth.h"
#include "ps/message.h"
#include "shoal/ps/server.h"
#include "testing/child_process.h"
#include "testing/multi_rank.h"

namespace test_hostile_comm_ps {

using Clock = std::chrono::steady_clock;
using shoal::testing::Milliseconds;

long status_field(pid_t pid, const std::string& name) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(name + ":", 0) == 0) return std::atol(line.c_str() + name.size() + 1);
  }
  return -1;
}

// Writes all of `data` unless the peer closes or `deadline` passes; false then.
bool send_all(int fd, const std::string& data, Clock::time_point deadline) {
  size_t done = 0;
  while (done < data.size()) {
    if (Clock::now() > deadline) return false;
    const ssize_t n = ::send(fd, data.data() + done, data.size() - done, MSG_NOSIGNAL);
    if (n <= 0) return false;
    done += static_cast<size_t>(n);
  }
  return true;
}

// ZMTP 3.0 as a DEALER with the NULL mechanism: greeting, then READY.
std::string zmtp_hello() {
  std::string greeting(64, '\0');
  greeting[0] = '\xff';
  greeting[9] = '\x7f';
  greeting[10] = 3;  // version 3.0
  std::memcpy(&greeting[12], "NULL", 4);
  std::string body;
  body += '\x05';
  body += "READY";
  body += '\x0b';
  body += "Socket-Type";
  body += std::string("\0\0\0\x06", 4);
  body += "DEALER";
  return greeting + '\x04' + static_cast<char>(body.size()) + body;
}

// One long frame with the MORE flag: the message is never finished.
std::string zmtp_frame_more(const std::string& data) {
  std::string out;
  out += '\x03';  // MORE | LONG
  const uint64_t size = data.size();
  for (int i = 7; i >= 0; --i) out += static_cast<char>((size >> (8 * i)) & 0xff);
  return out + data;
}

// The server with a token in a forked process; its endpoint in `endpoint_file`.
std::unique_ptr<shoal::testing::ChildProcess> start_server(const std::string& endpoint_file) {
  return std::make_unique<shoal::testing::ChildProcess>([endpoint_file] {
    shoal::ps::ServerOptions options;
    options.num_workers = 1;
    options.auth_token_from_env = false;
    options.auth_token = "hostile-test-token";
    options.verbose = false;
    options.worker_timeout = std::chrono::milliseconds(600'000);
    shoal::ps::Server server(options);
    {
      std::ofstream out(endpoint_file + ".tmp");
      out << server.endpoint();
    }
    std::rename((endpoint_file + ".tmp").c_str(), endpoint_file.c_str());
    server.run();  // until the test kills it
  });
}

// 4 connections, each an unfinished message of 256 frames of 1 MiB (256 MiB): before, libzmq
// held all of it in the server (209 -> 1,237 MB measured); now a connection that does not present
// the token's gate password is closed in the handshake.
TEST(HostileCommPs, UnfinishedMessagesFromStrangersDoNotGrowTheServer) {
  const std::string endpoint_file = shoal::testing::temp_path("ps-endpoint");
  auto server = start_server(endpoint_file);
  ASSERT_TRUE(shoal::testing::wait_for_file(endpoint_file, Milliseconds(30'000)));
  const std::string endpoint = shoal::testing::read_file(endpoint_file);
  std::remove(endpoint_file.c_str());
  const int port = std::stoi(endpoint.substr(endpoint.rfind(':') + 1));
  const long rss_before = status_field(server->pid(), "VmRSS");

  const std::string frame = zmtp_frame_more(std::string(1 << 20, 'x'));
  std::vector<std::thread> strangers;
  std::atomic<int64_t> sent{0};
  for (int c = 0; c < 4; ++c) {
    strangers.emplace_back([&] {
      const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
      sockaddr_in addr{};
      addr.sin_family = AF_INET;
      addr.sin_port = htons(static_cast<uint16_t>(port));
      addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
      if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0) {
        const auto deadline = Clock::now() + std::chrono::seconds(60);
        if (send_all(fd, zmtp_hello(), deadline)) {
          for (int i = 0; i < 256 && send_all(fd, frame, deadline); ++i) sent += 1;
        }
      }
      ::close(fd);
    });
  }
  for (auto& t : strangers) t.join();
  const long hwm = status_field(server->pid(), "VmHWM");
  const long rss_after = status_field(server->pid(), "VmRSS");
  server->kill(SIGKILL);
  std::printf("ps server under 4 unfinished 256 MiB messages: resident %ld kB before, peak %ld kB, %ld kB after; "
              "%lld MiB of frames accepted by the kernel\n",
              rss_before, hwm, rss_after, static_cast<long long>(sent.load()));
  ASSERT_GT(rss_before, 0);
  EXPECT_LT(hwm, 2 * rss_before);
  EXPECT_LT(hwm - rss_before, 64 * 1024) << "kB";
}

// 2,000 malformed messages from one peer: the server rejects (and counts) each, but writes at
// most 10 lines a second, and the next line written says how many were held back.
TEST(HostileCommPs, MalformedMessagesDoNotFloodTheLog) {
  const std::string log = shoal::testing::temp_path("ps-log");
  const auto outcome = shoal::testing::run_in_child([log] {
    std::fflush(stderr);
    const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    ::dup2(fd, 2);
    ::close(fd);
    shoal::ps::ServerOptions options;
    options.num_workers = 1;
    options.auth_token_from_env = false;  // no gate: every message reaches the server's checks
    options.verbose = true;
    shoal::ps::Server server(options);
    server.start();
    zmq::context_t context{1};
    zmq::socket_t peer{context, zmq::socket_type::dealer};
    peer.set(zmq::sockopt::linger, 0);
    peer.connect(server.endpoint());
    const auto start = Clock::now();
    for (int i = 0; i < 2000; ++i) peer.send(zmq::buffer(std::string("short")), zmq::send_flags::none);
    shoal::testing::wait_until([&] { return server.stats().rejected >= 2000; }, Milliseconds(60'000));
    const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
    // One more, a second later: its line reports those held back.
    std::this_thread::sleep_for(std::chrono::milliseconds(1100));
    peer.send(zmq::buffer(std::string("short")), zmq::send_flags::none);
    shoal::testing::wait_until([&] { return server.stats().rejected >= 2001; }, Milliseconds(60'000));
    server.stop();
    server.join();
    return std::to_string(server.stats().rejected) + " " + std::to_string(seconds);
  });
  const std::string text = shoal::testing::read_file(log);
  std::remove(log.c_str());
  ASSERT_TRUE(outcome.exited && outcome.exit_code == 0) << outcome.message << text;
  long rejected = 0;
  double seconds = 0;
  ASSERT_EQ(std::sscanf(outcome.message.c_str(), "%ld %lf", &rejected, &seconds), 2) << outcome.message;
  EXPECT_EQ(rejected, 2001);
  size_t lines = 0;
  for (char c : text) lines += c == '\n';
  std::printf("ps server: 2001 malformed messages in %.1f s, %zu log lines\n", seconds + 1.1, lines);
  // At most 10 a second over the run (plus the second's window that straddles), far from 2,001.
  EXPECT_LE(static_cast<double>(lines), 10 * (seconds + 1.1 + 2)) << text;
  EXPECT_LT(lines, 200u) << text;
  EXPECT_NE(text.find("like this held back"), std::string::npos) << text;
}

}  // namespace test_hostile_comm_ps
