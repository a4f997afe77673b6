// The rendezvous store's connection budget under strangers: connections that hold
// every handshake slot cannot lock the job's ranks out, thousands of overlapping strangers do not
// grow rank 0's memory or threads, and a client dropped by a flooded listener says so (not "your
// token was refused"). Real sockets against a real TcpStoreServer; memory from /proc.
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <deque>
#include <fstream>
#include <string>
#include <thread>

#include "comm/tcp_store.h"
#include "comm/tcp_store_server.h"
#include "security/socket_io.h"
#include "shoal/error.h"
#include "testing/child_process.h"
#include "testing/multi_rank.h"

namespace test_hostile_comm_store {

using Clock = std::chrono::steady_clock;
using shoal::comm::TcpStore;
using shoal::testing::Milliseconds;

int raw_connect(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

// Whether the server has closed `fd` (readable with nothing to read), without waiting.
bool closed_by_server(int fd) {
  pollfd p{fd, POLLIN, 0};
  if (::poll(&p, 1, 0) <= 0) return false;
  char byte;
  return ::recv(fd, &byte, 1, MSG_DONTWAIT) <= 0;
}

// A field of /proc/self/status in KiB (VmRSS, VmHWM, VmSize) or a count (Threads).
long status_field(const std::string& name) {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(name + ":", 0) == 0) return std::atol(line.c_str() + name.size() + 1);
  }
  return -1;
}

// 80 strangers hold silent connections (more than the 64 handshake slots) and open a new one
// whenever the store drops one, for as long as the ranks connect: 3 ranks with the token still
// get in and meet (a store that closed the 65th connection on at once would fail a rank with
// "refused this process's token").
TEST(HostileCommStore, HeldStrangersDoNotLockTheRanksOut) {
  TcpStore server("127.0.0.1", 0, true, "tok", Milliseconds(10'000));
  const int port = server.port();
  std::atomic<bool> stop{false};
  std::deque<int> held;
  for (int i = 0; i < 80; ++i) held.push_back(raw_connect(port));
  std::thread flood([&] {
    while (!stop) {
      for (int& fd : held) {
        if (fd < 0 || closed_by_server(fd)) {
          if (fd >= 0) ::close(fd);
          fd = raw_connect(port);
        }
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  });
  // The slots are full before the ranks come (16 of the strangers' connections were refused).
  ASSERT_TRUE(shoal::testing::wait_until([&] { return server.server()->refused() >= 16; }, Milliseconds(10'000)));
  std::vector<std::thread> ranks;
  std::atomic<int> met{0};
  std::string error;
  std::mutex error_mutex;
  for (int r = 0; r < 3; ++r) {
    ranks.emplace_back([&, r] {
      try {
        TcpStore client("127.0.0.1", port, false, "tok", Milliseconds(10'000));
        client.set_string("rank/" + std::to_string(r), "here");
        client.wait({"rank/0", "rank/1", "rank/2"});
        ++met;
      } catch (const std::exception& e) {
        std::lock_guard<std::mutex> lock(error_mutex);
        error = e.what();
      }
    });
  }
  for (auto& t : ranks) t.join();
  stop = true;
  flood.join();
  for (int fd : held) {
    if (fd >= 0) ::close(fd);
  }
  EXPECT_EQ(met.load(), 3) << error;
  std::printf("store: %d strangers' connections refused while 3 ranks met\n", server.server()->refused());
}

// A listener that closes every connection before answering (as a flooded one does): the client
// connects again until its time-out and then says what happened, not that its token was refused.
TEST(HostileCommStore, ListenerThatClosesBeforeAnsweringIsNamedAsBusy) {
  const int listener = shoal::security::listen_on("127.0.0.1", 0);
  const int port = shoal::security::bound_port(listener);
  std::atomic<bool> stop{false};
  std::atomic<int> accepted{0};
  std::thread closer([&] {
    while (!stop) {
      pollfd p{listener, POLLIN, 0};
      if (::poll(&p, 1, 20) <= 0) continue;
      const int fd = ::accept(listener, nullptr, nullptr);
      if (fd >= 0) {
        ++accepted;
        ::close(fd);
      }
    }
  });
  std::string message;
  try {
    TcpStore client("127.0.0.1", port, false, "tok", Milliseconds(1500));
    ADD_FAILURE() << "connected to a listener that closes every connection";
  } catch (const shoal::Error& e) {
    message = e.what();
  }
  stop = true;
  closer.join();
  ::close(listener);
  EXPECT_EQ(message.find("refused this process's token"), std::string::npos) << message;
  EXPECT_NE(message.find("closed the connection before answering"), std::string::npos) << message;
  EXPECT_NE(message.find("flooded"), std::string::npos) << message;
  EXPECT_GE(accepted.load(), 2) << "the client did not connect again";
}

// 3,000 strangers that connect and leave at once, while a few others hold silent connections (a
// new set every 0.5 s, each held 1.5 s, under the 2 s handshake deadline), so that some handshake
// is always in flight: rank 0 (this forked process) keeps its threads and memory (finished
// handshake threads joined only when none is in flight would keep their stacks: hundreds of MB
// resident, gigabytes virtual).
TEST(HostileCommStore, OverlappingStrangersDoNotGrowRankZero) {
  const auto outcome = shoal::testing::run_in_child([] {
    const long rss_before = status_field("VmRSS");
    const long size_before = status_field("VmSize");
    TcpStore server("127.0.0.1", 0, true, "tok", Milliseconds(10'000));
    std::deque<std::pair<Clock::time_point, int>> anchors;
    auto last_anchors = Clock::now() - std::chrono::seconds(1);
    long max_threads = 0;
    for (int i = 0; i < 3000; ++i) {
      const auto now = Clock::now();
      if (now - last_anchors >= std::chrono::milliseconds(500)) {
        for (int a = 0; a < 4; ++a) anchors.emplace_back(now, raw_connect(server.port()));
        last_anchors = now;
      }
      while (!anchors.empty() && now - anchors.front().first >= std::chrono::milliseconds(1500)) {
        ::close(anchors.front().second);
        anchors.pop_front();
      }
      const int fd = raw_connect(server.port());
      if (fd >= 0) ::close(fd);
      if (i % 100 == 0) max_threads = std::max(max_threads, status_field("Threads"));
      // Paced by the server (at most 64 ahead of the handshakes it has ended), so that the listen
      // backlog never overflows into SYN retransmits of a second each.
      if (i % 16 == 0) {
        shoal::testing::wait_until([&] { return server.server()->refused() + 64 >= i; }, Milliseconds(10'000));
      }
    }
    const long size_peak = status_field("VmSize");
    const long hwm = status_field("VmHWM");
    for (const auto& anchor : anchors) ::close(anchor.second);
    // A rank still gets in afterwards.
    TcpStore client("127.0.0.1", server.port(), false, "tok", Milliseconds(10'000));
    client.set_string("k", "v");
    return std::to_string(rss_before) + " " + std::to_string(hwm) + " " + std::to_string(size_before) +
           " " + std::to_string(size_peak) + " " + std::to_string(max_threads) + " " +
           std::to_string(server.server()->refused());
  });
  ASSERT_TRUE(outcome.exited && outcome.exit_code == 0) << outcome.message;
  long rss_before = 0, hwm = 0, size_before = 0, size_peak = 0, max_threads = 0, refused = 0;
  ASSERT_EQ(std::sscanf(outcome.message.c_str(), "%ld %ld %ld %ld %ld %ld", &rss_before, &hwm, &size_before,
                        &size_peak, &max_threads, &refused),
            6)
      << outcome.message;
  std::printf("store under 3000 overlapping strangers: resident %ld -> peak %ld kB, virtual %ld -> %ld kB, "
              "at most %ld threads, %ld refused\n",
              rss_before, hwm, size_before, size_peak, max_threads, refused);
  EXPECT_LT(hwm, 2 * rss_before);
  EXPECT_LT(hwm - rss_before, 64 * 1024) << "kB";
  // 2 x 64 handshake threads of 8 MiB stacks at most: about 1 GiB of address space.
  EXPECT_LT(size_peak - size_before, 1100 * 1024) << "kB";
  EXPECT_LE(max_threads, 2 * 64 + 8);
}

}  // namespace test_hostile_comm_store
