#include "comm/tcp_store_server.h"

#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "comm/tcp_store_wire.h"
#include "security/auth_token.h"
#include "security/socket_io.h"
#include "shoal/error.h"
#include "shoal/log.h"

namespace shoal::comm {
namespace {

// Connections allowed to be in their handshake at once. A job has one connection per rank (plus a
// few per backend) and each finishes its handshake in microseconds; the cap stops a flood of
// silent connections from starting a thread each (beyond it: kYoungHandshake).
constexpr size_t kMaxHandshakes = 64;
// Handshake threads that may exist at once (running, or shut down and ending): beyond this a new
// connection is closed at once. Dropped handshakes end within microseconds, so this is only
// reached when connections arrive faster than threads end.
constexpr size_t kMaxHandshakeThreads = 2 * kMaxHandshakes;
// A reply to an authenticated client that stops reading is abandoned after this.
constexpr std::chrono::seconds kReplyTimeout{30};
// A connection in its handshake for longer than this may be dropped for a newer one.
constexpr std::chrono::milliseconds kYoungHandshake{500};
// Connections the kernel queues before accept(): a job of thousands of ranks connects at once.
constexpr int kListenBacklog = 4096;
// A wait request's time-out is cut to this (a client's own time-out is shorter).
constexpr int64_t kMaxWaitMs = 7LL * 24 * 3600 * 1000;
// epoll event ids of the two descriptors that are not clients (client ids count up from 1).
constexpr uint64_t kListenId = ~0ULL;
constexpr uint64_t kWakeId = ~0ULL - 1;
constexpr uint32_t kIdle = EPOLLIN | EPOLLRDHUP;  // ready for the next request

void watch(int epoll_fd, int op, int fd, uint32_t events, uint64_t id) {
  epoll_event event{};
  event.events = events;
  event.data.u64 = id;
  SHOAL_CHECK(::epoll_ctl(epoll_fd, op, fd, &event) == 0 || op == EPOLL_CTL_DEL,
              "TCP store: epoll_ctl: ", std::strerror(errno));
}

}  // namespace

TcpStoreServer::TcpStoreServer(const std::string& host, int port, std::string token)
    : token_(std::move(token)) {
  listen_fd_ = security::listen_on(host, port, kListenBacklog);
  port_ = security::bound_port(listen_fd_);
  ::fcntl(listen_fd_, F_SETFL, ::fcntl(listen_fd_, F_GETFL) | O_NONBLOCK);  // accept until empty
  SHOAL_CHECK(::pipe2(wake_, O_CLOEXEC | O_NONBLOCK) == 0, "TCP store: pipe: ", std::strerror(errno));
  epoll_fd_ = ::epoll_create1(EPOLL_CLOEXEC);
  SHOAL_CHECK(epoll_fd_ >= 0, "TCP store: epoll_create1: ", std::strerror(errno));
  watch(epoll_fd_, EPOLL_CTL_ADD, listen_fd_, EPOLLIN, kListenId);
  watch(epoll_fd_, EPOLL_CTL_ADD, wake_[0], EPOLLIN, kWakeId);
  thread_ = std::thread([this] { serve(); });
}

TcpStoreServer::~TcpStoreServer() {
  stop_ = true;
  const char byte = 0;
  (void)!::write(wake_[1], &byte, 1);
  {
    std::lock_guard<std::mutex> lock(pending_mutex_);
    for (auto& [id, h] : handshakes_) {
      if (h.running) ::shutdown(h.fd, SHUT_RDWR);  // ends their handshakes at once
    }
  }
  if (thread_.joinable()) thread_.join();
  // serve() has ended, so the map no longer changes shape: the threads still look their entries
  // up (under the mutex) while they are joined here.
  for (auto& [id, h] : handshakes_) h.thread.join();
  for (int fd : authenticated_) ::close(fd);
  ::close(epoll_fd_);
  ::close(listen_fd_);
  ::close(wake_[0]);
  ::close(wake_[1]);
}

void TcpStoreServer::handshake(uint64_t id, int fd) {
  const auto deadline = std::chrono::steady_clock::now() + security::kHandshakeTimeout;
  const bool ok = security::accept_peer(fd, token_, "store", deadline);
  std::lock_guard<std::mutex> lock(pending_mutex_);
  Handshake& h = handshakes_.at(id);
  h.running = false;
  if (ok && !stop_ && !h.dropped) {
    authenticated_.push_back(fd);
  } else {
    ::close(fd);
    ++refused_;
  }
  finished_.push_back(id);
  const char byte = 1;
  (void)!::write(wake_[1], &byte, 1);  // serve() joins this thread now
}

void TcpStoreServer::reap_finished() {
  std::vector<std::thread> ended;
  {
    std::lock_guard<std::mutex> lock(pending_mutex_);
    for (uint64_t id : finished_) {
      auto found = handshakes_.find(id);
      if (found == handshakes_.end()) continue;
      ended.push_back(std::move(found->second.thread));
      handshakes_.erase(found);
    }
    finished_.clear();
  }
  for (auto& t : ended) t.join();  // each has left handshake(): returns at once
}

void TcpStoreServer::accept_ready() {
  reap_finished();  // threads that ended count against kMaxHandshakeThreads until joined
  // Up to a backlog's worth a wake-up; the rest on the next one (the listener stays ready).
  for (int i = 0; i < kListenBacklog; ++i) {
    if (!room_for_handshake()) {
      // The rest wait in the kernel's backlog until a handshake ends or ages (next_timeout_ms).
      set_accepting(false);
      return;
    }
    const int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) return;
    accept_one(fd);
  }
}

void TcpStoreServer::set_accepting(bool on) {
  if (accepting_ == on) return;
  accepting_ = on;
  watch(epoll_fd_, EPOLL_CTL_MOD, listen_fd_, on ? EPOLLIN : 0, kListenId);
}

bool TcpStoreServer::room_for_handshake() {
  std::string note;
  {
    std::lock_guard<std::mutex> lock(pending_mutex_);
    Handshake* oldest = nullptr;
    size_t in_handshake = 0;
    for (auto& [id, h] : handshakes_) {  // ascending ids: the oldest first
      if (!h.running || h.dropped) continue;
      ++in_handshake;
      if (oldest == nullptr) oldest = &h;
    }
    if (in_handshake < kMaxHandshakes) return true;
    // A rank finishes in microseconds (milliseconds when the machine is loaded); a connection
    // in its handshake for longer is taken to be a stranger's, and dropped to make room. Younger
    // ones are left to finish: dropping them would drop ranks that arrive together.
    if (Clock::now() - oldest->started < kYoungHandshake) return false;
    oldest->dropped = true;
    ::shutdown(oldest->fd, SHUT_RDWR);  // its thread fails the handshake and ends
    ++dropped_;
    note = "dropped the oldest connection still in its handshake (" + std::to_string(kMaxHandshakes) +
           " were, the most allowed at once)";
  }
  if (int64_t held = 0; drop_log_.allow(&held)) {
    log::warn("TCP store on port ", port_, ": ", note,
              ": connections that do not finish Shoal's handshake are flooding the store's port "
              "(strangers?); the job's ranks connect again and get in",
              drop_log_.held_note(held));
  }
  return true;
}

void TcpStoreServer::accept_one(int fd) {
  const int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  std::string note;
  {
    std::lock_guard<std::mutex> lock(pending_mutex_);
    if (handshakes_.size() >= kMaxHandshakeThreads) {
      ::close(fd);
      ++refused_;
      note = "closed a new connection at once: " + std::to_string(handshakes_.size()) +
             " handshake threads are still ending";
    } else {
      const uint64_t id = next_id_++;
      Handshake& h = handshakes_[id];
      h.fd = fd;
      h.started = Clock::now();
      h.thread = std::thread([this, id, fd] { handshake(id, fd); });
    }
  }
  if (int64_t held = 0; !note.empty() && drop_log_.allow(&held)) {
    log::warn("TCP store on port ", port_, ": ", note,
              ": connections that do not finish Shoal's handshake are flooding the store's port "
              "(strangers?); the job's ranks connect again and get in",
              drop_log_.held_note(held));
  }
}

void TcpStoreServer::adopt_authenticated() {
  char drain[64];
  while (::read(wake_[0], drain, sizeof(drain)) > 0) {
  }
  reap_finished();
  std::vector<int> fds;
  {
    std::lock_guard<std::mutex> lock(pending_mutex_);
    fds.swap(authenticated_);
  }
  for (int fd : fds) {
    const uint64_t id = next_client_++;
    Client& client = clients_[id];
    client.id = id;
    client.fd = fd;
    client.interest = kIdle;
    watch(epoll_fd_, EPOLL_CTL_ADD, fd, kIdle, id);
  }
}

void TcpStoreServer::serve() {
  std::vector<epoll_event> events(256);
  while (!stop_) {
    const int n = ::epoll_wait(epoll_fd_, events.data(), static_cast<int>(events.size()),
                               next_timeout_ms(Clock::now()));
    if (n < 0 && errno != EINTR) break;
    if (stop_) break;
    for (int i = 0; i < n; ++i) {
      const uint64_t id = events[i].data.u64;
      if (id == kWakeId) {
        adopt_authenticated();
      } else if (id == kListenId) {
        accept_ready();
      } else {
        on_event(id, events[i].events);
      }
    }
    expire(Clock::now());
    resume_answered();
    if (!accepting_) set_accepting(room_for_handshake());
  }
  for (const auto& [id, client] : clients_) ::close(client.fd);
  clients_.clear();
}

void TcpStoreServer::on_event(uint64_t id, uint32_t events) {
  auto found = clients_.find(id);
  if (found == clients_.end()) return;  // dropped earlier in this round
  Client& client = found->second;
  bool ok = true;
  if (events & EPOLLOUT) ok = flush(client);
  if (ok && (events & EPOLLIN)) ok = read_from(client);
  // A client that hung up while its request waits, or that errs, is gone.
  if (ok && (events & (EPOLLERR | EPOLLHUP))) ok = false;
  if (ok && (events & EPOLLRDHUP) && !(events & EPOLLIN)) ok = false;
  if (ok) ok = run_requests(client);
  if (!ok) return drop(id);
  update_interest(id, client);
}

bool TcpStoreServer::read_from(Client& client) {
  uint8_t buffer[64 * 1024];
  const ssize_t n = ::recv(client.fd, buffer, sizeof(buffer), MSG_DONTWAIT);
  if (n == 0) return false;
  if (n < 0) return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR;
  client.in.insert(client.in.end(), buffer, buffer + n);
  return true;
}

bool TcpStoreServer::run_requests(Client& client) {
  while (client.waiter == 0 && client.out.empty()) {
    const size_t left = client.in.size() - client.in_used;
    if (left < 4) break;
    const uint8_t* frame = client.in.data() + client.in_used;
    const uint32_t size = wire::Reader(frame, 4).u32();
    if (size == 0 || size > wire::kMaxFrame) return false;
    if (left < 4 + size) break;
    client.in_used += 4 + size;
    if (!run_request(client, frame + 4, size)) return false;
  }
  if (client.in_used > 0 && client.in_used * 2 >= client.in.size()) {
    client.in.erase(client.in.begin(), client.in.begin() + static_cast<std::ptrdiff_t>(client.in_used));
    client.in_used = 0;
  }
  return true;
}

bool TcpStoreServer::run_request(Client& client, const uint8_t* body, uint32_t size) {
  const uint8_t op = body[0];
  if (op < wire::kOpCount) ++requests_[op];
  if (op == wire::kWait || op == wire::kMultiGet) {
    wire::WaitRequest request;
    if (!wire::parse_wait(body, size, &request)) return false;
    const size_t missing = wire::first_missing(data_, request.keys);
    if (missing == request.keys.size() || request.timeout_ms <= 0) {
      reply(client, wire::answer_wait(data_, request, missing == request.keys.size()));
    } else {
      park(client.id, std::move(request), missing);
    }
    return true;
  }
  bool ok = true;
  std::vector<std::string> changed;
  const std::vector<uint8_t> answer = wire::execute(data_, body, size, &ok, &changed);
  if (!ok) return false;
  reply(client, answer);
  for (const auto& key : changed) on_changed(key);
  return true;
}

void TcpStoreServer::park(uint64_t client_id, wire::WaitRequest request, size_t missing) {
  const uint64_t id = next_waiter_++;
  Waiter& waiter = waiters_[id];
  waiter.client = client_id;
  waiter.missing = missing;
  waiter.deadline = Clock::now() + std::chrono::milliseconds(std::min(request.timeout_ms, kMaxWaitMs));
  parked_on_[request.keys[missing]].push_back(id);
  waiter.request = std::move(request);
  deadlines_.emplace(waiter.deadline, id);
  clients_.at(client_id).waiter = id;
}

void TcpStoreServer::on_changed(const std::string& key) {
  auto found = parked_on_.find(key);
  if (found == parked_on_.end()) return;
  const std::vector<uint64_t> ids = std::move(found->second);
  parked_on_.erase(found);
  for (uint64_t id : ids) {
    Waiter& waiter = waiters_.at(id);
    const auto& keys = waiter.request.keys;
    size_t missing = wire::first_missing(data_, keys, waiter.missing);
    // A key before the parked one may have been deleted since: look again from the start.
    if (missing == keys.size()) missing = wire::first_missing(data_, keys);
    if (missing == keys.size()) {
      finish_wait(id, true);
    } else {
      waiter.missing = missing;
      parked_on_[keys[missing]].push_back(id);
    }
  }
}

void TcpStoreServer::unpark(uint64_t waiter_id) {
  const Waiter& waiter = waiters_.at(waiter_id);
  auto parked = parked_on_.find(waiter.request.keys[waiter.missing]);
  if (parked != parked_on_.end()) {
    auto& ids = parked->second;
    ids.erase(std::remove(ids.begin(), ids.end(), waiter_id), ids.end());
    if (ids.empty()) parked_on_.erase(parked);
  }
  deadlines_.erase({waiter.deadline, waiter_id});
  waiters_.erase(waiter_id);
}

void TcpStoreServer::finish_wait(uint64_t waiter_id, bool ready) {
  const Waiter& waiter = waiters_.at(waiter_id);
  Client& client = clients_.at(waiter.client);
  reply(client, wire::answer_wait(data_, waiter.request, ready));
  client.waiter = 0;
  answered_.push_back(client.id);
  unpark(waiter_id);
}

void TcpStoreServer::resume_answered() {
  std::vector<uint64_t> ids;
  while (!answered_.empty()) {
    ids.swap(answered_);
    for (uint64_t id : ids) {
      auto found = clients_.find(id);
      if (found == clients_.end()) continue;
      if (!run_requests(found->second)) {
        drop(id);
      } else {
        update_interest(id, found->second);
      }
    }
    ids.clear();
  }
}

void TcpStoreServer::reply(Client& client, const std::vector<uint8_t>& body) {
  if (client.out.empty()) client.out_since = Clock::now();
  wire::put_u32(client.out, static_cast<uint32_t>(body.size()));
  client.out.insert(client.out.end(), body.begin(), body.end());
  // Sent at once where the socket takes it (almost always); the rest when it is writable again.
  flush(client);
}

bool TcpStoreServer::flush(Client& client) {
  while (client.out_sent < client.out.size()) {
    const ssize_t n = ::send(client.fd, client.out.data() + client.out_sent,
                             client.out.size() - client.out_sent, MSG_DONTWAIT | MSG_NOSIGNAL);
    if (n < 0) return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR;
    client.out_sent += static_cast<size_t>(n);
  }
  client.out.clear();
  client.out_sent = 0;
  return true;
}

void TcpStoreServer::update_interest(uint64_t id, Client& client) {
  // Reading stops while a request waits or a reply is unsent: requests run one at a time.
  uint32_t interest = EPOLLRDHUP;
  if (!client.out.empty()) interest |= EPOLLOUT;
  if (client.waiter == 0 && client.out.empty()) interest |= EPOLLIN;
  if (interest == client.interest) return;
  client.interest = interest;
  watch(epoll_fd_, EPOLL_CTL_MOD, client.fd, interest, id);
}

void TcpStoreServer::drop(uint64_t id) {
  auto found = clients_.find(id);
  if (found == clients_.end()) return;
  if (found->second.waiter != 0) unpark(found->second.waiter);
  watch(epoll_fd_, EPOLL_CTL_DEL, found->second.fd, 0, id);
  ::close(found->second.fd);
  clients_.erase(found);
}

void TcpStoreServer::expire(Clock::time_point now) {
  while (!deadlines_.empty() && deadlines_.begin()->first <= now) {
    finish_wait(deadlines_.begin()->second, false);
  }
  // Stalled replies are rare and slow to matter: look for them once a second, not every wake-up.
  if (now < next_stall_check_) return;
  next_stall_check_ = now + std::chrono::seconds(1);
  std::vector<uint64_t> stalled;
  for (const auto& [id, client] : clients_) {
    if (!client.out.empty() && now - client.out_since > kReplyTimeout) stalled.push_back(id);
  }
  for (uint64_t id : stalled) drop(id);
}

int TcpStoreServer::next_timeout_ms(Clock::time_point now) const {
  // A second at most, so that replies stalled past kReplyTimeout are noticed; 10 ms while new
  // connections wait for a handshake to age.
  int64_t ms = accepting_ ? 1000 : 10;
  if (!deadlines_.empty()) {
    const auto until = std::chrono::ceil<std::chrono::milliseconds>(deadlines_.begin()->first - now);
    ms = std::clamp<int64_t>(until.count(), 0, ms);
  }
  return static_cast<int>(ms);
}

TcpStoreServer::RequestCounts TcpStoreServer::request_counts() const {
  RequestCounts counts{};
  for (int op = 0; op < wire::kOpCount; ++op) counts[op] = requests_[op].load();
  return counts;
}

uint64_t TcpStoreServer::total_requests() const {
  uint64_t total = 0;
  for (const auto& count : requests_) total += count.load();
  return total;
}

}  // namespace shoal::comm
