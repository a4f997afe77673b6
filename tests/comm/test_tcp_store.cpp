// The rendezvous store over TCP, attacked as a stranger would: it listens on the configured
// address only, lets in only processes that know the job's token, drops silent or foreign peers
// within the handshake deadline without disturbing the job, and a client that reaches the wrong
// listener (or none) fails within its time-out naming the endpoint.
#include <gtest/gtest.h>

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <thread>

#include "comm/c10d_wire_store.h"
#include "comm/peer_directory.h"
#include "comm/rendezvous.h"
#include "comm/tcp_store.h"
#include "comm/tcp_store_server.h"
#include "comm/tcp_store_wire.h"
#include "security/auth_token.h"
#include "security/socket_io.h"
#include "shoal/comm/init.h"
#include "shoal/error.h"
#include "testing/multi_rank.h"
#include "testing/python.h"

namespace shoal::comm {
namespace test_tcp_store {

using Clock = std::chrono::steady_clock;
constexpr Milliseconds kTimeout{5000};
// The server drops a stranger at its handshake deadline; a loaded machine may see it later.
constexpr Milliseconds kDropLimit = security::kHandshakeTimeout + Milliseconds(8000);
constexpr double kHandshakeSeconds = security::kHandshakeTimeout.count() / 1000.0;
// Slack beyond a client's own time-out before "fails within its time-out" counts as broken.
constexpr double kLoadSeconds = shoal::testing::kLoadMargin.count() / 1000.0;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

/// A raw TCP connection to 127.0.0.1:port, as a stranger makes one.
int raw_connect(const std::string& ip, int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  ::inet_pton(AF_INET, ip.c_str(), &addr.sin_addr);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

/// True when the peer closes `fd` within `limit`.
bool closed_within(int fd, std::chrono::milliseconds limit) {
  const auto deadline = Clock::now() + limit;
  char byte;
  while (Clock::now() < deadline) {
    timeval tv{0, 50000};
    ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    const ssize_t n = ::recv(fd, &byte, 1, 0);
    if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK)) return true;
  }
  return false;
}

TEST(TcpStore, SetGetAddCheckWaitDelete) {
  TcpStore server("127.0.0.1", 0, true, "tok", kTimeout);
  TcpStore client("127.0.0.1", server.port(), false, "tok", kTimeout);
  server.set_string("a", "1");
  EXPECT_EQ(client.get_string("a"), "1");
  EXPECT_EQ(client.add("n", 5), 5);
  EXPECT_EQ(server.add("n", -2), 3);
  EXPECT_EQ(client.get_string("n"), "3");
  EXPECT_TRUE(client.check({"a", "n"}));
  EXPECT_FALSE(client.check({"a", "missing"}));
  std::thread late([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    server.set_string("late", "x");
  });
  client.wait({"late"});
  late.join();
  EXPECT_TRUE(client.delete_key("a"));
  EXPECT_FALSE(client.check({"a"}));
  try {
    client.wait({"never"}, Milliseconds(200));
    ADD_FAILURE() << "no time-out";
  } catch (const TimeoutError& e) {
    EXPECT_NE(std::string(e.what()).find("SHOAL_TIMEOUT"), std::string::npos) << e.what();
  }
}

uint64_t requests_of(const TcpStore& server, wire::Op op) { return server.server()->request_counts()[op]; }

TEST(TcpStore, WaitAndGetAreOneRequestAnsweredByTheServer) {
  TcpStore server("127.0.0.1", 0, true, "tok", kTimeout);
  TcpStore client("127.0.0.1", server.port(), false, "tok", kTimeout);
  const uint64_t before = server.server()->total_requests();
  std::thread late([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    server.set_string("late", "x");
  });
  // Polling every 1-20 ms for 300 ms would be tens of requests.
  EXPECT_EQ(client.get_string("late"), "x");
  late.join();
  EXPECT_EQ(requests_of(server, wire::kMultiGet), 1u);
  EXPECT_EQ(server.server()->total_requests() - before, 2u);  // the get and the set
  // A wait that times out is one request too, answered at its deadline.
  const auto start = Clock::now();
  EXPECT_THROW(client.wait({"late", "never"}, Milliseconds(300)), TimeoutError);
  EXPECT_GE(seconds_since(start), 0.29);
  EXPECT_EQ(requests_of(server, wire::kWait), 1u);
  EXPECT_EQ(requests_of(server, wire::kCheck), 0u);
}

TEST(TcpStore, MultiGetAndMultiSetAreOneRequestEach) {
  TcpStore server("127.0.0.1", 0, true, "tok", kTimeout);
  TcpStore client("127.0.0.1", server.port(), false, "tok", kTimeout);
  std::vector<std::string> keys;
  std::vector<std::vector<uint8_t>> values;
  for (int i = 0; i < 500; ++i) {
    keys.push_back("k/" + std::to_string(i));
    values.push_back(std::vector<uint8_t>(i % 7, static_cast<uint8_t>(i)));
  }
  std::thread setter([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    server.multi_set(keys, values);
  });
  EXPECT_EQ(client.multi_get(keys), values);  // waits for them on the server's side
  setter.join();
  EXPECT_EQ(requests_of(server, wire::kMultiGet), 1u);
  EXPECT_EQ(requests_of(server, wire::kMultiSet), 1u);
  EXPECT_EQ(requests_of(server, wire::kSet), 0u);
  // Through a prefix store, still one request.
  auto base = std::shared_ptr<Store>(&client, [](Store*) {});
  auto prefixed = make_prefix_store("k", base);
  EXPECT_EQ(prefixed->multi_get({"3", "4"}), (std::vector<std::vector<uint8_t>>{values[3], values[4]}));
  EXPECT_EQ(requests_of(server, wire::kMultiGet), 2u);
}

TEST(TcpStore, AWaitingThreadDoesNotHoldUpAnother) {
  TcpStore server("127.0.0.1", 0, true, "tok", kTimeout);
  TcpStore client("127.0.0.1", server.port(), false, "tok", Milliseconds(20'000));
  std::thread waiter([&] { EXPECT_EQ(client.get_string("released"), "1"); });
  shoal::testing::wait_until([&] { return requests_of(server, wire::kMultiGet) == 1; }, kTimeout);
  // The waiter holds its connection; this thread's requests take another and are answered now.
  const auto start = Clock::now();
  for (int i = 0; i < 20; ++i) client.add("beat", 1);
  EXPECT_LT(seconds_since(start), 5.0);
  EXPECT_EQ(client.add("beat", 0), 20);
  client.set_string("released", "1");
  waiter.join();
}

TEST(TcpStore, DeletedKeysAndDepartedWaitersKeepTheServerConsistent) {
  TcpStore server("127.0.0.1", 0, true, "tok", kTimeout);
  TcpStore client("127.0.0.1", server.port(), false, "tok", kTimeout);
  {
    // A waiter that leaves while its wait is parked.
    TcpStore gone("127.0.0.1", server.port(), false, "tok", Milliseconds(300));
    EXPECT_THROW(gone.wait({"a", "b"}, Milliseconds(200)), TimeoutError);
  }
  server.set_string("a", "1");
  std::thread later([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    server.delete_key("a");  // "a" was there when the wait parked on "b"
    server.set_string("b", "2");
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    server.set_string("a", "3");
  });
  EXPECT_EQ(client.multi_get({"a", "b"}),
            (std::vector<std::vector<uint8_t>>{{'3'}, {'2'}}));
  later.join();
}

/// Raises the soft limit on open files to at least `wanted` (up to the hard limit); false when the
/// hard limit is below it.
bool raise_open_files(rlim_t wanted) {
  rlimit limit{};
  if (::getrlimit(RLIMIT_NOFILE, &limit) != 0) return false;
  if (limit.rlim_cur >= wanted) return true;
  if (limit.rlim_max != RLIM_INFINITY && limit.rlim_max < wanted) return false;
  limit.rlim_cur = wanted;
  return ::setrlimit(RLIMIT_NOFILE, &limit) == 0;
}

// The real rendezvous for 1,024 simulated ranks, each a thread with its own connection to the real
// server: every rank gets through, with at most 10 store requests per rank in all; then the
// per-host gather a shm or hierarchical group forms from, in 2 requests per rank, where every rank
// sees every rank's record.
TEST(Rendezvous, ThousandRanksMeetWithLinearRequests) {
  constexpr int kRanks = 1024;
  const Milliseconds timeout{60'000};
  // Two descriptors a rank (its connection and the server's end), and some to spare.
  if (!raise_open_files(2 * kRanks + 256)) GTEST_SKIP() << "the hard limit on open files is too low";
  TcpStore server("127.0.0.1", 0, true, "tok", timeout);
  std::vector<std::string> errors(kRanks);
  // The requests of the two phases are counted apart: the gather starts once all have met.
  std::mutex phase_mutex;
  std::condition_variable phase_changed;
  int rendezvous_done = 0;
  bool gather = false;
  std::vector<std::thread> ranks;
  const auto start = Clock::now();
  for (int r = 0; r < kRanks; ++r) {
    ranks.emplace_back([&, r] {
      bool counted = false;
      try {
        TcpStore client("127.0.0.1", server.port(), false, "tok", timeout);
        rendezvous(client, r, kRanks, timeout);
        {
          std::unique_lock<std::mutex> lock(phase_mutex);
          counted = true;
          if (++rendezvous_done == kRanks) phase_changed.notify_all();
          phase_changed.wait(lock, [&] { return gather; });
        }
        const auto records = gather_records(client, "test/host", r, kRanks, "host" + std::to_string(r % 8));
        bool agree = records.size() == kRanks;
        for (int q = 0; q < kRanks && agree; ++q) agree = records[q] == "host" + std::to_string(q % 8);
        if (!agree) errors[r] = "the gathered records differ";
      } catch (const std::exception& e) {
        errors[r] = e.what();
        std::lock_guard<std::mutex> lock(phase_mutex);
        if (!counted && ++rendezvous_done == kRanks) phase_changed.notify_all();
      }
    });
  }
  uint64_t requests = 0;
  {
    std::unique_lock<std::mutex> lock(phase_mutex);
    // Every rank gets there, or records its error and leaves: the deadline is their time-out's.
    phase_changed.wait_for(lock, timeout * 2, [&] { return rendezvous_done == kRanks; });
    requests = server.server()->total_requests();
    gather = true;
    phase_changed.notify_all();
  }
  for (auto& t : ranks) t.join();
  const double seconds = seconds_since(start);
  for (int r = 0; r < kRanks; ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
  const uint64_t gather_requests = server.server()->total_requests() - requests;
  std::printf("rendezvous of %d ranks: %llu store requests; gather: %llu; %.2f s in all\n", kRanks,
              static_cast<unsigned long long>(requests), static_cast<unsigned long long>(gather_requests),
              seconds);
  EXPECT_LE(requests, 10u * kRanks);
  EXPECT_LE(gather_requests, 2u * kRanks + 2);
  EXPECT_EQ(server.get_string("shoal/init/verdict"), "ok");
  EXPECT_EQ(server.add("shoal/init/arrived", 0), kRanks);
}

TEST(TcpStore, ListensOnTheConfiguredAddressOnly) {
  TcpStore server("127.0.0.1", 0, true, "tok", kTimeout);
  // Any non-loopback IPv4 address of this machine: nothing may answer there.
  ifaddrs* list = nullptr;
  ASSERT_EQ(::getifaddrs(&list), 0);
  int tried = 0;
  for (ifaddrs* a = list; a != nullptr; a = a->ifa_next) {
    if (a->ifa_addr == nullptr || a->ifa_addr->sa_family != AF_INET) continue;
    char ip[INET_ADDRSTRLEN];
    ::inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(a->ifa_addr)->sin_addr, ip, sizeof(ip));
    if (std::string(ip).rfind("127.", 0) == 0) continue;
    const int fd = raw_connect(ip, server.port());
    EXPECT_LT(fd, 0) << "the store answered on " << ip;
    if (fd >= 0) ::close(fd);
    ++tried;
  }
  ::freeifaddrs(list);
  const int fd = raw_connect("127.0.0.1", server.port());
  EXPECT_GE(fd, 0);
  if (fd >= 0) ::close(fd);
  if (tried == 0) std::printf("note: no non-loopback IPv4 address here; only loopback checked\n");
}

TEST(TcpStore, StrangerCannotReadOrWriteKeys) {
  TcpStore server("127.0.0.1", 0, true, "tok", kTimeout);
  server.set_string("secret", "value");
  // A store request frame sent without the handshake (a c10d-style client, or an attacker).
  const int fd = raw_connect("127.0.0.1", server.port());
  ASSERT_GE(fd, 0);
  const std::string frame = std::string("\x0b\x00\x00\x00\x02\x06\x00\x00\x00", 9) + "secret";
  ASSERT_EQ(::write(fd, frame.data(), frame.size()), static_cast<ssize_t>(frame.size()));
  EXPECT_TRUE(closed_within(fd, kDropLimit));
  ::close(fd);
  // A client with the wrong token is refused, and says so.
  const auto start = Clock::now();
  try {
    TcpStore stranger("127.0.0.1", server.port(), false, "guess", kTimeout);
    ADD_FAILURE() << "a wrong token got in";
  } catch (const PeerError& e) {
    EXPECT_NE(std::string(e.what()).find("token"), std::string::npos) << e.what();
  }
  EXPECT_LT(seconds_since(start), 3.0);
  EXPECT_EQ(server.get_string("secret"), "value");
  // Counted by the server's handshake thread, which a loaded machine may run later.
  shoal::testing::wait_until([&] { return server.server()->refused() >= 2; }, kDropLimit);
  EXPECT_GE(server.server()->refused(), 2);
}

TEST(TcpStore, SilentStrangersDoNotStallTheJob) {
  TcpStore server("127.0.0.1", 0, true, "tok", kTimeout);
  // Strangers connect first and hold their connections open, one with a partial greeting.
  std::vector<int> strangers;
  for (int i = 0; i < 8; ++i) strangers.push_back(raw_connect("127.0.0.1", server.port()));
  ASSERT_EQ(::write(strangers[0], "SHOAL", 5), 5);
  const auto start = Clock::now();
  std::vector<std::thread> ranks;
  std::atomic<int> done{0};
  for (int r = 0; r < 3; ++r) {
    ranks.emplace_back([&, r] {
      TcpStore client("127.0.0.1", server.port(), false, "tok", kTimeout);
      client.set_string("rank/" + std::to_string(r), "here");
      client.wait({"rank/0", "rank/1", "rank/2"});
      ++done;
    });
  }
  for (auto& t : ranks) t.join();
  EXPECT_EQ(done.load(), 3);
  // Waiting for even one stranger would have taken its whole handshake deadline.
  EXPECT_LT(seconds_since(start), kHandshakeSeconds) << "the job waited for the strangers";
  // They are dropped at the handshake deadline.
  for (int fd : strangers) {
    EXPECT_TRUE(closed_within(fd, kDropLimit));
    ::close(fd);
  }
}

TEST(TcpStore, ForeignListenerOnThePortIsNotTrusted) {
  // Something else listens on MASTER_PORT and never answers: the client fails within its
  // time-out, naming the endpoint, instead of blocking in recv() forever.
  const int listener = security::listen_on("127.0.0.1", 0);
  const int port = security::bound_port(listener);
  const auto start = Clock::now();
  try {
    TcpStore client("127.0.0.1", port, false, "tok", Milliseconds(1000));
    ADD_FAILURE() << "connected to a foreign listener";
  } catch (const TimeoutError& e) {
    EXPECT_NE(std::string(e.what()).find("127.0.0.1:" + std::to_string(port)), std::string::npos) << e.what();
  }
  EXPECT_LT(seconds_since(start), 1.0 + kLoadSeconds);
  ::close(listener);
}

TEST(TcpStore, UnreachableMasterSaysSoWithinTheTimeout) {
  const int probe = security::listen_on("127.0.0.1", 0);
  const int port = security::bound_port(probe);
  ::close(probe);  // nothing listens there now
  const auto start = Clock::now();
  try {
    TcpStore client("127.0.0.1", port, false, "tok", Milliseconds(700));
    ADD_FAILURE() << "no error";
  } catch (const TimeoutError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("cannot reach 127.0.0.1:" + std::to_string(port)), std::string::npos) << what;
    EXPECT_NE(what.find("refused"), std::string::npos) << what;
    EXPECT_EQ(what.find("in use"), std::string::npos) << what;
  }
  const double took = seconds_since(start);
  EXPECT_GE(took, 0.6);
  EXPECT_LT(took, 0.7 + kLoadSeconds);
}

TEST(TcpStore, PortInUseSaysSo) {
  TcpStore first("127.0.0.1", 0, true, "tok", kTimeout);
  try {
    TcpStore second("127.0.0.1", first.port(), true, "tok", kTimeout);
    ADD_FAILURE() << "two listeners on one port";
  } catch (const PeerError& e) {
    EXPECT_NE(std::string(e.what()).find("in use"), std::string::npos) << e.what();
  }
}

TEST(TcpStore, MissingMasterAddressIsAnErrorAboveOneRank) {
  ::setenv("RANK", "0", 1);
  ::setenv("WORLD_SIZE", "2", 1);
  ::unsetenv("MASTER_ADDR");
  ::setenv("MASTER_PORT", "29500", 1);
  try {
    init_process_group();
    ADD_FAILURE() << "no error";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("MASTER_ADDR"), std::string::npos) << e.what();
  }
  ::unsetenv("RANK");
  ::unsetenv("WORLD_SIZE");
  ::unsetenv("MASTER_PORT");
}

// Shoal's client of c10d 2.x's store protocol (how LibTorch 1.13 ranks join PyTorch 2.x torchrun's
// agent store) against PyTorch 2.x's own TCPStore servers: the libuv one (torchrun's default) and
// the legacy one. Values cross both ways; the server checks what the client wrote.
void expect_c10d_server_agrees(bool libuv) {
  const std::string python = shoal::testing::torch2_python();
  if (python.empty()) GTEST_SKIP() << "PyTorch 2.x is not installed (scripts/setup_torch_pypi.sh)";
  const std::string dir = shoal::testing::temp_path("c10d-wire");
  std::filesystem::create_directories(dir);
  const std::string script = dir + "/server.py";
  std::ofstream(script) << "import sys, datetime\n"
                        << shoal::testing::kImportTorchOrExit
                        << "import torch.distributed as dist\n"
                           "store = dist.TCPStore('127.0.0.1', 0, is_master=True, wait_for_workers=False,\n"
                           "    timeout=datetime.timedelta(seconds=30), use_libuv=" << (libuv ? "True" : "False") << ")\n"
                           "store.set('from_python', bytes(range(256)) * 400 + b'\\0end')\n"
                           "store.set('to_delete', 'x')\n"
                           "open(sys.argv[1] + '.tmp', 'w').write(str(store.port))\n"
                           "import os; os.rename(sys.argv[1] + '.tmp', sys.argv[1])\n"
                           "store.wait(['done'])\n"
                           "assert store.get('from_shoal') == bytes(range(255, -1, -1)) * 3, store.get('from_shoal')[:16]\n"
                           "assert store.get('empty') == b''\n"
                           "assert int(store.get('counter')) == 7, store.get('counter')\n"
                           "assert not store.check(['to_delete'])\n"
                           "print('ORACLE OK c10d server saw the client', flush=True)\n";
  const std::string port_file = dir + "/port";
  shoal::testing::PythonResult server;
  std::thread runner([&] { server = shoal::testing::run_command("timeout 120 env " + python + " " + script + " " + port_file); });
  const bool up = shoal::testing::wait_for_file(port_file, Milliseconds(60000));
  if (!up) {
    runner.join();
    FAIL() << "the PyTorch 2.x store did not start: " << server.describe();
  }
  const int port = std::stoi(shoal::testing::read_file(port_file));
  try {
    C10dWireStore client("127.0.0.1", port, 3, kTimeout);
    std::vector<uint8_t> expected;
    for (int r = 0; r < 400; ++r) {
      for (int b = 0; b < 256; ++b) expected.push_back(static_cast<uint8_t>(b));
    }
    for (char c : std::string("\0end", 4)) expected.push_back(static_cast<uint8_t>(c));
    EXPECT_EQ(client.get("from_python"), expected);
    std::vector<uint8_t> mine;
    for (int r = 0; r < 3; ++r) {
      for (int b = 255; b >= 0; --b) mine.push_back(static_cast<uint8_t>(b));
    }
    client.set("from_shoal", mine);
    client.set("empty", {});
    EXPECT_EQ(client.get("empty"), std::vector<uint8_t>());
    EXPECT_EQ(client.add("counter", 3), 3);
    EXPECT_EQ(client.add("counter", 4), 7);
    EXPECT_TRUE(client.check({"from_python", "counter"}));
    EXPECT_FALSE(client.check({"from_python", "missing"}));
    EXPECT_TRUE(client.delete_key("to_delete"));
    EXPECT_FALSE(client.delete_key("to_delete"));
    const auto start = Clock::now();
    try {
      client.wait({"never"}, Milliseconds(300));
      ADD_FAILURE() << "no time-out";
    } catch (const TimeoutError& e) {
      EXPECT_NE(std::string(e.what()).find("'never'"), std::string::npos) << e.what();
    }
    EXPECT_LT(seconds_since(start), 0.3 + kLoadSeconds);
    // The connection is still in step after the time-out.
    EXPECT_EQ(client.add("counter", 0), 7);
    client.set("done", {'1'});
  } catch (const std::exception& e) {
    ADD_FAILURE() << e.what();
  }
  runner.join();
  EXPECT_TRUE(shoal::testing::oracle_succeeded(server));
  std::filesystem::remove_all(dir);
}

TEST(C10dWireStore, PyTorchLibuvServerAgrees) { expect_c10d_server_agrees(true); }
TEST(C10dWireStore, PyTorchLegacyServerAgrees) { expect_c10d_server_agrees(false); }

/// The next connection to `listener`, or -1 when none comes within 10 s.
int accept_within(int listener) {
  pollfd p{listener, POLLIN, 0};
  return ::poll(&p, 1, 10000) == 1 ? ::accept(listener, nullptr, nullptr) : -1;
}

TEST(C10dWireStore, HostileServerIsBoundedInSizeAndTime) {
  // A server that says a value is 1 TiB long: refused before anything is allocated.
  const int listener = security::listen_on("127.0.0.1", 0);
  const int port = security::bound_port(listener);
  std::thread liar([&] {
    const int fd = accept_within(listener);
    if (fd < 0) return;
    // "Ready" for get()'s CHECK, then the length of the GET's value.
    uint8_t reply[9] = {0};
    const uint64_t huge = 1ull << 40;
    std::memcpy(reply + 1, &huge, sizeof(huge));
    (void)!::write(fd, reply, sizeof(reply));
    closed_within(fd, std::chrono::milliseconds(10000));
    ::close(fd);
  });
  try {
    C10dWireStore client("127.0.0.1", port, 3, kTimeout);
    client.get("key");
    ADD_FAILURE() << "accepted a 1 TiB value";
  } catch (const PeerError& e) {
    EXPECT_NE(std::string(e.what()).find("1099511627776 bytes"), std::string::npos) << e.what();
  }
  liar.join();
  // A server that never answers on the first connection: the request fails within the client's
  // time-out, naming the rank, the operation and the endpoint; the next request opens a new
  // connection (the first may still deliver a late reply) and gets its answer there.
  std::thread silent_then_honest([&] {
    const int first = accept_within(listener);
    if (first < 0) return;
    const int second = accept_within(listener);
    if (second >= 0) {
      // VALIDATE (1 + 4 bytes), then ADD: type, u64 length, "/key", i64 delta.
      uint8_t request[5 + 1 + 8 + 4 + 8];
      size_t got = 0;
      const auto until = Clock::now() + std::chrono::seconds(10);
      while (got < sizeof(request) && Clock::now() < until) {
        pollfd p{second, POLLIN, 0};
        if (::poll(&p, 1, 100) != 1) continue;
        const ssize_t n = ::recv(second, request + got, sizeof(request) - got, 0);
        if (n <= 0) break;
        got += static_cast<size_t>(n);
      }
      const int64_t answer = 42;
      if (got == sizeof(request)) (void)!::write(second, &answer, sizeof(answer));
      closed_within(second, std::chrono::milliseconds(10000));
      ::close(second);
    }
    ::close(first);
  });
  try {
    C10dWireStore client("127.0.0.1", port, 3, Milliseconds(500));
    const auto start = Clock::now();
    try {
      client.add("key", 1);
      ADD_FAILURE() << "a silent server answered";
    } catch (const TimeoutError& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("[rank 3] store add of 'key'"), std::string::npos) << what;
      EXPECT_NE(what.find("127.0.0.1:" + std::to_string(port)), std::string::npos) << what;
      EXPECT_NE(what.find("SHOAL_TIMEOUT"), std::string::npos) << what;
    }
    EXPECT_LT(seconds_since(start), 0.5 + kLoadSeconds);
    EXPECT_EQ(client.add("key", 1), 42);
  } catch (const std::exception& e) {
    ADD_FAILURE() << e.what();
  }
  silent_then_honest.join();
  ::close(listener);
}

}  // namespace test_tcp_store
}  // namespace shoal::comm
