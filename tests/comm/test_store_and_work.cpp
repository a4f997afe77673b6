// The Store calls no collective test exercises (check, delete_key, timeout/set_timeout) on every
// kind of store, and the Work helpers (PromiseWork with then(), make_completed_work, the comm
// hooks' parallel::then) on success, error and time-out.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <future>
#include <thread>

#include "shoal/comm/store.h"
#include "shoal/comm/work.h"
#include "shoal/error.h"
#include "shoal/parallel/grad_bucket.h"
#include "testing/multi_rank.h"

namespace shoal::comm {
namespace test_store_and_work {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// check, delete_key, timeout and set_timeout on one store; `peer` is a second client of the same
// store (another handle on it) that must see the same keys.
void check_store(Store& store, Store& peer) {
  EXPECT_FALSE(store.check({"a"}));
  store.set("a", std::vector<uint8_t>{1, 2, 3});
  EXPECT_TRUE(store.check({"a"}));
  EXPECT_TRUE(peer.check({"a"}));
  EXPECT_FALSE(store.check({"a", "b"})) << "check() is true only when every key exists";
  peer.set("b", std::vector<uint8_t>{4});
  EXPECT_TRUE(store.check({"a", "b"}));

  EXPECT_TRUE(peer.delete_key("a"));
  EXPECT_FALSE(store.check({"a"}));
  EXPECT_TRUE(store.check({"b"})) << "delete_key removed only its key";
  // A deleted counter starts again from 0.
  EXPECT_EQ(store.add("n", 5), 5);
  EXPECT_TRUE(store.delete_key("n"));
  EXPECT_EQ(peer.add("n", 2), 2);

  // set_timeout bounds get()/wait() on missing keys: a short one fails fast with a TimeoutError
  // naming the key.
  store.set_timeout(Milliseconds(200));
  EXPECT_EQ(store.timeout(), Milliseconds(200));
  const auto start = Clock::now();
  try {
    store.get("never-set");
    ADD_FAILURE() << "get() of a missing key returned";
  } catch (const TimeoutError& e) {
    EXPECT_NE(std::string(e.what()).find("never-set"), std::string::npos) << e.what();
  }
  EXPECT_LT(seconds_since(start), shoal::testing::fault_deadline_seconds(Milliseconds(200)));
  EXPECT_GE(seconds_since(start), 0.19) << "gave up before its time-out";
  store.set_timeout(Milliseconds(30'000));
  EXPECT_EQ(store.timeout(), Milliseconds(30'000));
  // And a key set meanwhile by the peer ends the wait.
  std::thread setter([&] {
    // Set even when the signal never shows: then get() below has its own error to report.
    shoal::testing::wait_until([&] { return peer.check({"ready-to-set"}); }, Milliseconds(30'000));
    peer.set("late", std::vector<uint8_t>{9});
  });
  store.set("ready-to-set", std::vector<uint8_t>{});
  EXPECT_EQ(store.get("late"), std::vector<uint8_t>{9});
  setter.join();
}

TEST(Store, HashStoreCheckDeleteAndTimeout) {
  auto store = make_hash_store(Milliseconds(30'000));
  check_store(*store, *store);
}

TEST(Store, FileStoreCheckDeleteAndTimeout) {
  const std::string path = shoal::testing::temp_path("store-api");
  {
    auto a = make_file_store(path, 2, Milliseconds(30'000));
    auto b = make_file_store(path, 2, Milliseconds(30'000));
    check_store(*a, *b);
  }
  std::filesystem::remove(path);
}

TEST(Store, TcpStoreCheckDeleteAndTimeout) {
  const int port = shoal::testing::free_port();
  auto server = make_tcp_store("127.0.0.1", port, 2, /*is_server=*/true, Milliseconds(30'000));
  auto client = make_tcp_store("127.0.0.1", port, 2, /*is_server=*/false, Milliseconds(30'000));
  check_store(*client, *server);
}

TEST(Store, PrefixStoreKeepsItsKeysApart) {
  auto base = make_hash_store(Milliseconds(30'000));
  auto one = make_prefix_store("one", base);
  auto two = make_prefix_store("two", base);
  check_store(*one, *one);
  EXPECT_FALSE(two->check({"b"})) << "a key of prefix one seen under prefix two";
  EXPECT_TRUE(base->check({"one/b"}));
  two->set_timeout(Milliseconds(100));
  EXPECT_EQ(two->timeout(), Milliseconds(100));
}

// multi_get/multi_set: the defaults (one get/set per key) on c10d's stores, the TCP store's one
// request, and a prefix store over each, all agree.
void check_batches(Store& store) {
  const std::vector<std::string> keys{"m/a", "m/b", "m/c"};
  const std::vector<std::vector<uint8_t>> values{{1}, {}, {3, 4}};
  store.multi_set(keys, values);
  EXPECT_EQ(store.multi_get(keys), values);
  EXPECT_EQ(store.get("m/c"), values[2]);
  EXPECT_THROW(store.multi_set(keys, {{1}}), InvalidArgument);
}

TEST(Store, BatchedCallsOnEveryStore) {
  auto hash = make_hash_store(Milliseconds(30'000));
  check_batches(*hash);
  check_batches(*make_prefix_store("p", hash));
  EXPECT_EQ(hash->get("p/m/a"), std::vector<uint8_t>{1});
  const int port = shoal::testing::free_port();
  auto tcp = make_tcp_store("127.0.0.1", port, 1, /*is_server=*/true, Milliseconds(30'000));
  check_batches(*tcp);
  check_batches(*make_prefix_store("p", tcp));
  EXPECT_EQ(tcp->get("p/m/c"), (std::vector<uint8_t>{3, 4}));
}

// ---- Work -----------------------------------------------------------------------------------------

OpLabel label(const char* name, uint64_t sequence) {
  OpLabel l;
  l.name = name;
  l.sequence = sequence;
  l.rank = 1;
  l.size = 4;
  return l;
}

TEST(PromiseWork, FinishRunsCallbacksOnceAndWakesTheWaiter) {
  auto work = std::make_shared<PromiseWork>(label("allreduce", 7), Milliseconds(30'000));
  EXPECT_FALSE(work->is_completed());
  EXPECT_EQ(work->sequence_number(), 7u);
  std::atomic<int> calls{0};
  work->then([&] { ++calls; });
  auto waiter = std::async(std::launch::async, [&] { work->wait(); });
  EXPECT_EQ(waiter.wait_for(Milliseconds(50)), std::future_status::timeout) << "wait() returned early";
  work->finish();
  waiter.get();
  EXPECT_TRUE(work->is_completed());
  EXPECT_EQ(work->exception(), nullptr);
  EXPECT_EQ(calls.load(), 1);
  // A callback added after completion runs at once, exactly once.
  work->then([&] { ++calls; });
  EXPECT_EQ(calls.load(), 2);
  work->wait();
  EXPECT_EQ(calls.load(), 2);
}

TEST(PromiseWork, ErrorIsRethrownByEveryWait) {
  auto work = std::make_shared<PromiseWork>(label("broadcast", 3), Milliseconds(30'000));
  work->finish_with_error(std::make_exception_ptr(PeerError("rank 2 closed the connection")));
  EXPECT_TRUE(work->is_completed());
  EXPECT_NE(work->exception(), nullptr);
  for (int i = 0; i < 2; ++i) {
    try {
      work->wait();
      ADD_FAILURE() << "wait() of a failed work returned";
    } catch (const PeerError& e) {
      EXPECT_NE(std::string(e.what()).find("rank 2 closed"), std::string::npos) << e.what();
    }
  }
}

TEST(PromiseWork, WaitTimesOutNamingTheOperation) {
  auto work = std::make_shared<PromiseWork>(label("allgather", 12), Milliseconds(150));
  const auto start = Clock::now();
  try {
    work->wait();  // kGroupTimeout: the work's own 150 ms
    ADD_FAILURE() << "wait() of an unfinished work returned";
  } catch (const TimeoutError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("[rank 1/4] allgather #12"), std::string::npos) << what;
    EXPECT_NE(what.find("150 ms"), std::string::npos) << what;
  }
  EXPECT_GE(seconds_since(start), 0.14);
  EXPECT_LT(seconds_since(start), shoal::testing::fault_deadline_seconds(Milliseconds(150)));
  // An explicit time-out overrides the work's own.
  EXPECT_THROW(work->wait(Milliseconds(10)), TimeoutError);
  work->finish();
  EXPECT_NO_THROW(work->wait(Milliseconds(10)));
}

TEST(PromiseWork, CompletedWorkIsDoneAtOnce) {
  auto work = make_completed_work(label("barrier", 1));
  ASSERT_NE(work, nullptr);
  EXPECT_TRUE(work->is_completed());
  EXPECT_EQ(work->exception(), nullptr);
  EXPECT_NO_THROW(work->wait(Milliseconds(0)));
  EXPECT_EQ(work->sequence_number(), 1u);
  EXPECT_NE(work->description().find("barrier #1"), std::string::npos) << work->description();
}

TEST(HookThen, RunsAfterSuccessOnlyAndOnce) {
  auto inner = std::make_shared<PromiseWork>(label("allreduce", 2), Milliseconds(30'000));
  int runs = 0;
  auto work = parallel::then(inner, [&] { ++runs; });
  EXPECT_FALSE(work->is_completed());
  inner->finish();
  EXPECT_TRUE(work->is_completed());
  work->wait();
  work->wait();
  EXPECT_EQ(runs, 1);

  auto failing = std::make_shared<PromiseWork>(label("allreduce", 3), Milliseconds(30'000));
  auto after_failure = parallel::then(failing, [&] { ++runs; });
  failing->finish_with_error(std::make_exception_ptr(PeerError("peer gone")));
  EXPECT_THROW(after_failure->wait(), PeerError);
  EXPECT_NE(after_failure->exception(), nullptr);
  EXPECT_EQ(runs, 1) << "the continuation ran after a failure";
  EXPECT_THROW(parallel::then(nullptr, [] {}), InvalidArgument);
}

}  // namespace test_store_and_work
}  // namespace shoal::comm
