// The parameter server's wire format, authentication and partition: known-answer tests for
// SHA-256/HMAC, and a real server (ZeroMQ over TCP on loopback) fed malformed, truncated,
// oversized and unauthenticated messages, which it must reject while it keeps serving a real
// worker.
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <optional>
#include <thread>

#include "ps/auth.h"
#include "ps/message.h"
#include "ps_testing.h"
#include "shoal/error.h"
#include "shoal/ps/partition.h"
#include "testing/multi_rank.h"

namespace shoal::ps {
namespace test_ps_protocol {

using testing::ServerSet;
using std::chrono::milliseconds;

// SHA-256 and HMAC-SHA256 known answers: tests/security/test_auth_token.cpp (one implementation).

TEST(PsAuth, ResponseChecksTokenAndChallenge) {
  const Challenge c1 = make_challenge();
  const Challenge c2 = make_challenge();
  EXPECT_NE(c1, c2);
  EXPECT_TRUE(check_auth_response("secret", c1, auth_response("secret", c1)));
  EXPECT_FALSE(check_auth_response("secret", c1, auth_response("Secret", c1)));
  EXPECT_FALSE(check_auth_response("secret", c2, auth_response("secret", c1)));
}

TEST(PsPartition, CoversEveryElementOnceAndBalances) {
  const std::vector<int64_t> numels{100000, 10, 300000, 7, 5000, 0};
  for (int servers : {1, 2, 3}) {
    const std::vector<Segment> segments = partition_parameters(numels, servers, 65536);
    std::vector<int64_t> covered(numels.size(), 0);
    std::vector<int64_t> load(servers, 0);
    for (const Segment& s : segments) {
      EXPECT_EQ(s.offset, covered[s.param]) << "ranges are contiguous, in order";
      covered[s.param] += s.numel;
      load[s.server] += s.numel;
    }
    EXPECT_EQ(covered, numels);
    const auto [lo, hi] = std::minmax_element(load.begin(), load.end());
    EXPECT_LE(*hi - *lo, 6000) << servers << " servers";
  }
}

// What a raw peer presents to the server's gate (ZeroMQ's PLAIN mechanism).
struct GateCredentials {
  std::string user;
  std::string password;
};

// A raw peer: a DEALER socket that sends whatever frames the test gives it.
struct RawPeer {
  zmq::context_t context{1};
  zmq::socket_t socket{context, zmq::socket_type::dealer};
  /// With `token`, it passes the server's gate (ZeroMQ's handshake) as a worker does, and no more.
  explicit RawPeer(const std::string& endpoint, const std::string& token = {})
      : RawPeer(endpoint, token.empty() ? std::optional<GateCredentials>()
                                        : GateCredentials{kGateUser, gate_password(token)}) {}
  RawPeer(const std::string& endpoint, const std::optional<GateCredentials>& credentials) {
    socket.set(zmq::sockopt::linger, 0);
    if (credentials) {
      socket.set(zmq::sockopt::plain_username, credentials->user);
      socket.set(zmq::sockopt::plain_password, credentials->password);
    }
    socket.connect(endpoint);
  }
  void send(std::vector<std::string> frames) {
    for (size_t i = 0; i < frames.size(); ++i) {
      socket.send(zmq::buffer(frames[i]),
                  i + 1 < frames.size() ? zmq::send_flags::sndmore : zmq::send_flags::none);
    }
  }
  // The answer (type and blob), or nullopt when none came within `timeout` (by default long
  // enough for a server thread of a loaded machine).
  std::optional<InMessage> answer(milliseconds timeout = milliseconds(10000)) {
    ReceiveResult got = receive_message(socket, timeout, Limits{}, false);
    return std::move(got.message);
  }
};

std::string header_bytes(MessageType type, int32_t rank, uint32_t num_keys, uint32_t magic = kMagic,
                         uint16_t version = kFormatVersion) {
  Header h;
  h.magic = magic;
  h.format_version = version;
  h.type = static_cast<uint16_t>(type);
  h.rank = rank;
  h.num_keys = num_keys;
  h.seq = 7;
  return std::string(reinterpret_cast<const char*>(&h), sizeof(h));
}

std::string key_bytes(uint32_t key, int64_t offset, int64_t numel) {
  KeyRange k;
  k.key = key;
  k.offset = offset;
  k.numel = numel;
  return std::string(reinterpret_cast<const char*>(&k), sizeof(k));
}

// Trains a real worker for a few steps against `set` (the server still serves).
void train_a_little(ServerSet& set, const std::string& token = {}) {
  auto net = testing::make_tiny_net(1);
  WorkerOptions options = testing::worker_options(set, 0, 1);
  options.auth_token = token;
  Worker worker(options, testing::named(*net));
  worker.init();
  const at::Tensor before = net->fc1->weight.detach().clone();
  for (int step = 0; step < 3; ++step) {
    net->zero_grad();
    net->forward(torch::ones({2, 8})).sum().backward();
    worker.step();
  }
  EXPECT_FALSE(torch::equal(before, net->fc1->weight.detach()));
  worker.close();
}

TEST(PsServer, RejectsMalformedMessagesAndKeepsServing) {
  ServerOptions options;
  options.num_workers = 1;
  options.auth_token_from_env = false;
  options.max_message_bytes = 1 << 20;
  options.verbose = false;
  ServerSet set(1, options);
  const std::string endpoint = set.endpoints()[0];

  {
    RawPeer peer(endpoint);
    peer.send({"short"});  // header too short: rejected without an answer (no valid seq)
    peer.send({header_bytes(MessageType::kHello, 0, 0, 0xdeadbeef), "", ""});  // bad magic
    peer.send({header_bytes(MessageType::kHello, 0, 0, kMagic, 99), "", ""});  // bad version
    peer.send({header_bytes(MessageType::kHello, 0, 1), ""});  // truncated: no key frame
    // A tensor frame whose size disagrees with its key entry.
    peer.send({header_bytes(MessageType::kPush, 0, 1), "", key_bytes(0, 0, 4), std::string(12, 'x')});
    // More frames than keys announced.
    peer.send({header_bytes(MessageType::kHello, 0, 0), "", "", "extra"});
    // Frames within the per-frame limit that add up to more than the message limit.
    peer.send({header_bytes(MessageType::kPush, 0, 2), "",
               key_bytes(0, 0, 200000) + key_bytes(1, 0, 200000), std::string(800000, 'a'),
               std::string(800000, 'b')});
    // A push before hello/auth is refused with an answer.
    peer.send({header_bytes(MessageType::kPush, 0, 0), "", ""});
    const auto answer = peer.answer();
    ASSERT_TRUE(answer.has_value());
    EXPECT_EQ(answer->type(), MessageType::kError);
    EXPECT_NE(answer->blob.find("before authentication"), std::string::npos) << answer->blob;
  }
  {
    // A frame larger than max_message_bytes: libzmq drops the connection before allocating it,
    // so no answer comes.
    RawPeer peer(endpoint);
    peer.send({header_bytes(MessageType::kHello, 0, 0), std::string(2 << 20, 'z'), ""});
    EXPECT_FALSE(peer.answer(milliseconds(500)).has_value());
  }
  // Eight rejected (the oversized frame never reaches the server's code).
  shoal::testing::wait_until([&] { return set.servers[0]->stats().rejected >= 8; },
                             milliseconds(30000));
  EXPECT_EQ(set.servers[0]->stats().rejected, 8);
  train_a_little(set);
  set.join();
  EXPECT_EQ(set.servers[0]->stats().finished_workers, std::vector<int>{0});
}

// A push's learning-rate factor (its 8-byte blob) is checked before anything is applied: a
// missing, NaN, negative or huge factor is refused with an answer naming it, and the shard is
// unchanged.
TEST(PsServer, RefusesAPushWithABadLearningRateFactor) {
  ServerOptions options;
  options.num_workers = 1;
  options.auth_token_from_env = false;
  options.verbose = false;
  options.optimizer = std::make_shared<Sgd>(SgdOptions{0.5, 0});
  ServerSet set(1, options);
  RawPeer peer(set.endpoints()[0]);
  peer.send({header_bytes(MessageType::kHello, 0, 0), "", ""});
  auto welcome = peer.answer();
  ASSERT_TRUE(welcome.has_value());
  ASSERT_EQ(welcome->type(), MessageType::kWelcome);
  const std::string values(4 * sizeof(float), '\0');  // four zeros
  peer.send({header_bytes(MessageType::kInit, 0, 1), "", key_bytes(0, 0, 4), values});
  auto ok = peer.answer();
  ASSERT_TRUE(ok.has_value());
  ASSERT_EQ(ok->type(), MessageType::kOk);
  const float ones[4] = {1, 1, 1, 1};
  const std::string grad(reinterpret_cast<const char*>(ones), sizeof(ones));
  const auto factor_blob = [](double f) {
    return std::string(reinterpret_cast<const char*>(&f), sizeof(f));
  };
  int expected_rejections = 0;
  for (const std::string& blob : {std::string(), std::string("abc"), factor_blob(NAN),
                                  factor_blob(-1), factor_blob(1e9)}) {
    peer.send({header_bytes(MessageType::kPush, 0, 1), blob, key_bytes(0, 0, 4), grad});
    auto refused = peer.answer();
    ASSERT_TRUE(refused.has_value());
    EXPECT_EQ(refused->type(), MessageType::kError);
    EXPECT_NE(refused->blob.find("learning-rate factor"), std::string::npos) << refused->blob;
    ++expected_rejections;
  }
  EXPECT_EQ(set.servers[0]->stats().rejected, expected_rejections);
  EXPECT_EQ(set.servers[0]->stats().updates, 0) << "nothing applied";
  // A good factor is applied: param -= lr * factor * grad = 0.5 * 0.25 * 1.
  peer.send({header_bytes(MessageType::kPush, 0, 1), factor_blob(0.25), key_bytes(0, 0, 4), grad});
  auto applied = peer.answer();
  ASSERT_TRUE(applied.has_value());
  EXPECT_EQ(applied->type(), MessageType::kOk);
  peer.send({header_bytes(MessageType::kPull, 0, 0), "", ""});
  auto params = peer.answer();
  ASSERT_TRUE(params.has_value());
  ASSERT_EQ(params->type(), MessageType::kParams);
  ASSERT_EQ(params->keys.size(), 1u);
  EXPECT_TRUE(torch::allclose(params->tensor(0), torch::full({4}, -0.125f)))
      << params->tensor(0);
  set.servers[0]->stop();
  set.join();
}

TEST(PsServer, RefusesPeersWithoutTheToken) {
  ServerOptions options;
  options.num_workers = 1;
  options.auth_token_from_env = false;
  options.auth_token = "s3cret-token";
  options.verbose = false;
  ServerSet set(1, options);
  auto net = testing::make_tiny_net(1);

  WorkerOptions wrong = testing::worker_options(set, 0, 1);
  wrong.auth_token = "guess";
  try {
    Worker worker(wrong, testing::named(*net));
    FAIL() << "a wrong token was accepted";
  } catch (const PeerError& e) {
    EXPECT_NE(std::string(e.what()).find("authentication failed"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("server 0"), std::string::npos) << e.what();
  }
  WorkerOptions none = testing::worker_options(set, 0, 1);
  EXPECT_THROW({ Worker worker(none, testing::named(*net)); }, InvalidArgument);
  // The wrong token, refused by the gate (libzmq may have tried again before the worker gave up).
  EXPECT_GE(set.servers[0]->stats().gate_refusals, 1);

  // A peer without the token is refused in ZeroMQ's handshake: nothing it sends is read.
  {
    RawPeer stranger(set.endpoints()[0]);
    stranger.send({header_bytes(MessageType::kHello, 0, 0), "", ""});
    EXPECT_FALSE(stranger.answer(milliseconds(1000)).has_value());
  }
  // A peer past the gate that skips the challenge cannot push or pull.
  RawPeer peer(set.endpoints()[0], "s3cret-token");
  peer.send({header_bytes(MessageType::kHello, 0, 0), "", ""});
  auto challenge = peer.answer();
  ASSERT_TRUE(challenge.has_value());
  EXPECT_EQ(challenge->type(), MessageType::kChallenge);
  peer.send({header_bytes(MessageType::kPull, 0, 0), "", ""});
  auto refused = peer.answer();
  ASSERT_TRUE(refused.has_value());
  EXPECT_EQ(refused->type(), MessageType::kError);

  train_a_little(set, "s3cret-token");
}

// The gate alone. A peer with the gate's user name and a guessed password would also fail the
// HMAC challenge that follows the gate, so only this shows that the gate itself refuses it: its
// Hello gets no answer (not even the challenge), and the gate counts the refusal.
TEST(PsServer, GateRefusesAGuessedPasswordBeforeTheChallenge) {
  ServerOptions options;
  options.num_workers = 1;
  options.auth_token_from_env = false;
  options.auth_token = "s3cret-token";
  options.verbose = false;
  ServerSet set(1, options);
  {
    RawPeer guesser(set.endpoints()[0], GateCredentials{kGateUser, "guessed-password"});
    guesser.send({header_bytes(MessageType::kHello, 0, 0), "", ""});
    EXPECT_FALSE(guesser.answer(milliseconds(2000)).has_value())
        << "the gate let a guessed password through to the challenge";
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (set.servers[0]->stats().gate_refusals < 1 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(milliseconds(20));
  }
  EXPECT_GE(set.servers[0]->stats().gate_refusals, 1);
  EXPECT_EQ(set.servers[0]->stats().auth_failures, 0) << "the guess reached the challenge";

  // The same Hello with the gate's password is answered with the challenge: what refused the
  // guess above was the password, not the message.
  RawPeer peer(set.endpoints()[0], "s3cret-token");
  peer.send({header_bytes(MessageType::kHello, 0, 0), "", ""});
  auto challenge = peer.answer();
  ASSERT_TRUE(challenge.has_value());
  EXPECT_EQ(challenge->type(), MessageType::kChallenge);
}

}  // namespace test_ps_protocol
}  // namespace shoal::ps
