// The job token's crypto and handshake: SHA-256 and HMAC-SHA-256 against the published vectors
// (FIPS 180-4 examples, RFC 4231), and the challenge/response over real sockets: the right token
// gets in both ways, a wrong one or a silent peer is refused within the deadline.
#include <gtest/gtest.h>

#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <set>
#include <thread>

#include "security/auth_token.h"
#include "security/hmac_sha256.h"
#include "shoal/error.h"
#include "testing/multi_rank.h"

namespace shoal::security {
namespace test_auth_token {

std::string hex(const Digest& d) {
  static const char* kHex = "0123456789abcdef";
  std::string out;
  for (uint8_t b : d) {
    out += kHex[b >> 4];
    out += kHex[b & 15];
  }
  return out;
}

std::string unhex(const std::string& text) {
  std::string out;
  for (size_t i = 0; i + 1 < text.size(); i += 2) out += static_cast<char>(std::stoi(text.substr(i, 2), nullptr, 16));
  return out;
}

TEST(HmacSha256, Sha256MatchesFipsExamples) {
  EXPECT_EQ(hex(sha256("")), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(hex(sha256("abc")), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_EQ(hex(sha256("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq")),
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  EXPECT_EQ(hex(sha256(std::string(1000000, 'a'))),
            "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
}

TEST(HmacSha256, MatchesRfc4231) {
  struct Case {
    std::string key, data, mac;
  };
  const std::vector<Case> cases = {
      {std::string(20, '\x0b'), "Hi There", "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7"},
      {"Jefe", "what do ya want for nothing?", "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"},
      {std::string(20, '\xaa'), std::string(50, '\xdd'),
       "773ea91e36800e46854db8ebd09181a72959098b3ef8c122d9635514ced565fe"},
      {unhex("0102030405060708090a0b0c0d0e0f10111213141516171819"), std::string(50, '\xcd'),
       "82558a389a443c0ea4cc819899f2083a85f0faa3e578f8077a2e3ff46729665b"},
      // Case 5 (truncated output) is the same computation; 6 and 7 use a key longer than a block.
      {std::string(131, '\xaa'), "Test Using Larger Than Block-Size Key - Hash Key First",
       "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54"},
      {std::string(131, '\xaa'),
       "This is a test using a larger than block-size key and a larger than block-size data. The key "
       "needs to be hashed before being used by the HMAC algorithm.",
       "9b09ffa71b942fcb27635fbcd5b0e944bfdc63644f0713938a7f51535c3a35e2"},
  };
  for (const auto& c : cases) EXPECT_EQ(hex(hmac_sha256(c.key, c.data)), c.mac) << c.data;
}

TEST(AuthToken, TokensAreFreshAndHex) {
  std::set<std::string> seen;
  for (int i = 0; i < 100; ++i) {
    const std::string t = generate_token();
    EXPECT_EQ(t.size(), 64u);
    EXPECT_EQ(t.find_first_not_of("0123456789abcdef"), std::string::npos);
    seen.insert(t);
  }
  EXPECT_EQ(seen.size(), 100u);
}

struct Pair {
  int fds[2];
  Pair() { EXPECT_EQ(::socketpair(AF_UNIX, SOCK_STREAM, 0, fds), 0); }
  ~Pair() {
    ::close(fds[0]);
    ::close(fds[1]);
  }
};

Deadline in(std::chrono::milliseconds ms) { return std::chrono::steady_clock::now() + ms; }

TEST(AuthToken, SameTokenGetsIn) {
  Pair p;
  bool accepted = false;
  std::thread server([&] { accepted = accept_peer(p.fds[0], "secret", "store", in(std::chrono::seconds(5))); });
  EXPECT_NO_THROW(authenticate_to_server(p.fds[1], "secret", "store", "test:1", in(std::chrono::seconds(5))));
  server.join();
  EXPECT_TRUE(accepted);
}

TEST(AuthToken, WrongTokenIsRefusedBothWays) {
  Pair p;
  bool accepted = true;
  std::string why;
  std::thread server([&] { accepted = accept_peer(p.fds[0], "secret", "store", in(std::chrono::seconds(5)), &why); });
  // The client sees the server does not know its token (the server's proof fails) and stops.
  try {
    authenticate_to_server(p.fds[1], "guess", "store", "test:1", in(std::chrono::seconds(5)));
    ADD_FAILURE() << "a wrong token got in";
  } catch (const PeerError& e) {
    EXPECT_NE(std::string(e.what()).find("test:1"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("token"), std::string::npos) << e.what();
  }
  ::shutdown(p.fds[1], SHUT_RDWR);
  server.join();
  EXPECT_FALSE(accepted);

  // A token for another purpose does not open this listener either.
  Pair q;
  std::thread server2([&] { accepted = accept_peer(q.fds[0], "secret", "store", in(std::chrono::seconds(5))); });
  EXPECT_THROW(authenticate_to_server(q.fds[1], "secret", "ps", "test:2", in(std::chrono::seconds(5))), PeerError);
  ::shutdown(q.fds[1], SHUT_RDWR);
  server2.join();
  EXPECT_FALSE(accepted);
}

TEST(AuthToken, SilentPeerIsDroppedAtTheDeadline) {
  Pair p;
  std::string why;
  const auto start = std::chrono::steady_clock::now();
  EXPECT_FALSE(accept_peer(p.fds[0], "secret", "store", in(std::chrono::milliseconds(300)), &why));
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_GE(seconds, 0.29);
  EXPECT_LT(seconds, 0.3 + shoal::testing::kLoadMargin.count() / 1000.0) << "kept past its deadline";
  EXPECT_EQ(why, "no greeting in time");

  // A listener that never answers: the client gives up at its deadline, naming the endpoint.
  Pair q;
  try {
    authenticate_to_server(q.fds[1], "secret", "store", "10.0.0.7:29500", in(std::chrono::milliseconds(300)));
    ADD_FAILURE() << "no error";
  } catch (const TimeoutError& e) {
    EXPECT_NE(std::string(e.what()).find("10.0.0.7:29500"), std::string::npos) << e.what();
  }
}

TEST(AuthToken, GarbageIsRefused) {
  Pair p;
  const std::string junk = "GET / HTTP/1.1\r\nHost: x\r\n\r\n" + std::string(64, 'x');
  ASSERT_EQ(::write(p.fds[1], junk.data(), junk.size()), static_cast<ssize_t>(junk.size()));
  std::string why;
  EXPECT_FALSE(accept_peer(p.fds[0], "secret", "store", in(std::chrono::seconds(30)), &why));
  EXPECT_EQ(why, "not Shoal's handshake");
}

}  // namespace test_auth_token
}  // namespace shoal::security
