// libFuzzer target: the TCP store's request decoders (the ops that run at once, and the waits'
// parser and reply) and the token handshake's server side, on arbitrary bytes (what a stranger
// can send). Nothing may crash; bad input only drops the peer.
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "comm/tcp_store_wire.h"
#include "security/auth_token.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // Requests: the input split into frames as the server splits its byte stream.
  static shoal::comm::wire::Table table;
  if (table.size() > 1000) table.clear();
  size_t pos = 0;
  while (size - pos >= 4) {
    shoal::comm::wire::Reader header(data + pos, 4);
    const uint32_t length = header.u32();
    if (length == 0 || length > size - pos - 4) break;
    const uint8_t* body = data + pos + 4;
    bool ok = true;
    if (body[0] == shoal::comm::wire::kWait || body[0] == shoal::comm::wire::kMultiGet) {
      shoal::comm::wire::WaitRequest request;
      ok = shoal::comm::wire::parse_wait(body, length, &request);
      if (ok) {
        const bool ready =
            shoal::comm::wire::first_missing(table, request.keys) == request.keys.size();
        shoal::comm::wire::answer_wait(table, request, ready);
      }
    } else {
      std::vector<std::string> changed;
      shoal::comm::wire::execute(table, body, length, &ok, &changed);
    }
    if (!ok) break;
    pos += 4 + length;
  }
  // The handshake: the input is what the peer sends.
  int fds[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM, 0, fds) != 0) return 0;
  if (size <= 64 * 1024 && ::write(fds[1], data, size) == static_cast<ssize_t>(size)) {
    ::shutdown(fds[1], SHUT_WR);
    shoal::security::accept_peer(fds[0], "token", "store",
                                 std::chrono::steady_clock::now() + std::chrono::milliseconds(5));
  }
  ::close(fds[0]);
  ::close(fds[1]);
  return 0;
}
