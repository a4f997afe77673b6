#include "security/auth_token.h"

#include <sys/random.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "security/hmac_sha256.h"
#include "security/socket_io.h"
#include "shoal/env.h"
#include "shoal/error.h"

namespace shoal::security {
namespace {

constexpr std::string_view kHello = "SHOALAU1";
constexpr size_t kNonce = 32;
constexpr char kAccepted = 'A';

Io send_text(int fd, std::string_view text, Deadline deadline) {
  return write_all(fd, text.data(), text.size(), deadline);
}

std::string as_text(const Digest& d) { return std::string(reinterpret_cast<const char*>(d.data()), d.size()); }

Digest mac(std::string_view token, std::string_view side, std::string_view purpose, std::string_view nonce_c,
           std::string_view nonce_s) {
  std::string message;
  message.reserve(side.size() + purpose.size() + 1 + 2 * kNonce);
  message.append(side).append(purpose).append(1, '\0').append(nonce_c).append(nonce_s);
  return hmac_sha256(token, message);
}

Digest as_digest(std::string_view bytes) {
  Digest d{};
  std::memcpy(d.data(), bytes.data(), std::min(bytes.size(), d.size()));
  return d;
}

}  // namespace

std::string random_bytes(size_t n) {
  std::string out(n, '\0');
  size_t done = 0;
  while (done < n) {
    const ssize_t got = ::getrandom(out.data() + done, n - done, 0);
    if (got < 0 && errno == EINTR) continue;
    SHOAL_CHECK(got > 0, "getrandom failed: ", std::strerror(errno));
    done += static_cast<size_t>(got);
  }
  return out;
}

std::string generate_token() {
  static const char* kHex = "0123456789abcdef";
  const std::string bytes = random_bytes(32);
  std::string out;
  for (unsigned char c : bytes) {
    out += kHex[c >> 4];
    out += kHex[c & 15];
  }
  return out;
}

std::string token_from_env() {
  return env::text(env::Var::kAuthToken).value_or("");
}

bool try_authenticate_to_server(int fd, std::string_view token, std::string_view purpose,
                                const std::string& endpoint, Deadline deadline) {
  bool answered = false;
  const auto check = [&](Io io, const char* step) {
    if (io == Io::kOk) return true;
    if (io == Io::kTimeout) {
      SHOAL_THROW(TimeoutError, "the listener at ", endpoint, " did not complete Shoal's handshake (", step,
                  ") in time: it is not a Shoal job's listener, or it is overloaded");
    }
    if (!answered) return false;  // closed before proving itself: busy (or not Shoal's), not a refusal
    SHOAL_THROW(PeerError, "the listener at ", endpoint, " closed the connection during Shoal's handshake (",
                step, ") after it had proved it knows the job's token: it refused this process's token (is ",
                kTokenEnv, " the same on every rank?)");
  };
  const std::string nonce_c = random_bytes(kNonce);
  if (!check(send_text(fd, std::string(kHello) + nonce_c, deadline), "sending the greeting")) return false;
  char reply[2 * kNonce];
  if (!check(read_exact(fd, reply, sizeof(reply), deadline), "reading the server's proof")) return false;
  answered = true;
  const std::string_view nonce_s(reply, kNonce);
  if (!digests_equal(as_digest(std::string_view(reply + kNonce, kNonce)),
                     mac(token, "server", purpose, nonce_c, nonce_s))) {
    SHOAL_THROW(PeerError, "the listener at ", endpoint, " does not know this job's token: it belongs to ",
                "another job (or ", kTokenEnv, " differs between ranks); refusing to talk to it");
  }
  check(send_text(fd, as_text(mac(token, "client", purpose, nonce_c, nonce_s)), deadline), "sending our proof");
  char verdict = 0;
  check(read_exact(fd, &verdict, 1, deadline), "reading the verdict");
  if (verdict != kAccepted) check(Io::kClosed, "reading the verdict");
  return true;
}

void authenticate_to_server(int fd, std::string_view token, std::string_view purpose,
                            const std::string& endpoint, Deadline deadline) {
  if (!try_authenticate_to_server(fd, token, purpose, endpoint, deadline)) {
    SHOAL_THROW(PeerError, "the listener at ", endpoint, " closed the connection before answering Shoal's ",
                "handshake: it is busy with other connections (strangers holding its handshake slots?) ",
                "or is not a Shoal job's listener");
  }
}

bool accept_peer(int fd, std::string_view token, std::string_view purpose, Deadline deadline, std::string* why) {
  const auto refuse = [&](const char* reason) {
    if (why != nullptr) *why = reason;
    return false;
  };
  char hello[kHello.size() + kNonce];
  if (read_exact(fd, hello, sizeof(hello), deadline) != Io::kOk) return refuse("no greeting in time");
  if (std::string_view(hello, kHello.size()) != kHello) return refuse("not Shoal's handshake");
  const std::string_view nonce_c(hello + kHello.size(), kNonce);
  const std::string nonce_s = random_bytes(kNonce);
  if (send_text(fd, nonce_s + as_text(mac(token, "server", purpose, nonce_c, nonce_s)), deadline) != Io::kOk) {
    return refuse("could not answer");
  }
  char proof[kNonce];
  if (read_exact(fd, proof, sizeof(proof), deadline) != Io::kOk) return refuse("no proof in time");
  if (!digests_equal(as_digest(std::string_view(proof, kNonce)), mac(token, "client", purpose, nonce_c, nonce_s))) {
    return refuse("wrong token");
  }
  const char accepted = kAccepted;
  if (send_text(fd, std::string_view(&accepted, 1), deadline) != Io::kOk) return refuse("could not confirm");
  return true;
}

}  // namespace shoal::security
