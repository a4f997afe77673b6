#include "shoal/ps/worker.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>

#include "ps/auth.h"
#include "ps/message.h"
#include "shoal/error.h"
#include "shoal/ps/partition.h"

namespace shoal::ps {
namespace {
using Clock = std::chrono::steady_clock;
}  // namespace

struct Worker::Impl {
  WorkerOptions options;
  Limits limits;
  std::vector<std::pair<std::string, at::Tensor>> parameters;
  std::vector<Segment> segments;
  zmq::context_t context{1};
  std::vector<zmq::socket_t> sockets;  // by server rank
  std::vector<zmq::socket_t> monitors;  // by server rank, while connecting: handshake failures
  std::vector<int64_t> versions;       // the shard version each server last sent
  int64_t seq = 0;
  int64_t clock = 0;
  int64_t sum_round = 0;
  double pull_seconds = 0;
  double lr_factor = 1;
  bool closed = false;

  std::string name() const {
    return "[ps worker " + std::to_string(options.rank) + "/" +
           std::to_string(options.num_workers) + "]";
  }

  std::string server_name(size_t s) const {
    return "server " + std::to_string(s) + " (" + options.servers[s] + ")";
  }

  // Waits for the answer to request `request_seq` from server `s`; throws on error or deadline.
  InMessage await(size_t s, int64_t request_seq, const char* what) {
    return await(s, request_seq, what, options.timeout);
  }
  InMessage await(size_t s, int64_t request_seq, const char* what,
                  std::chrono::milliseconds timeout,
                  const std::function<void()>& between = nullptr) {
    const Clock::time_point deadline = Clock::now() + timeout;
    while (true) {
      const auto left =
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
      if (left.count() <= 0) {
        SHOAL_THROW(PeerError, name(), " ", what, " #", request_seq, ": no answer from ",
                    server_name(s), " in ", timeout.count(),
                    " ms: the server died or is unreachable");
      }
      // With `between`, in slices of 100 ms, calling it after each.
      const auto slice = between ? std::min(left, std::chrono::milliseconds(100)) : left;
      ReceiveResult got = receive_message(sockets[s], slice, limits, /*router=*/false);
      if (!got.message) {
        SHOAL_CHECK_T(PeerError, got.error.empty(), name(), " ", what, " #", request_seq,
                      ": malformed answer from ", server_name(s), ": ", got.error);
        if (between) between();
        continue;  // timed out: the loop reports it
      }
      InMessage& m = *got.message;
      if (m.header.seq != request_seq) continue;  // an answer to an earlier, abandoned request
      if (m.type() == MessageType::kError) {
        SHOAL_THROW(PeerError, name(), " ", what, " #", request_seq, ": ", server_name(s),
                    " refused: ", m.blob);
      }
      return std::move(m);
    }
  }

  void send(size_t s, OutMessage& out, const char* what) {
    SHOAL_CHECK_T(PeerError, send_message(sockets[s], std::string(), out), name(), " ", what,
                  " #", out.header.seq, ": cannot send to ", server_name(s),
                  " (its queue stayed full)");
  }

  // Throws when ZeroMQ's handshake with server `s` failed: the server's gate refused this
  // worker's token, or one side has a token and the other none.
  void check_handshake(size_t s) {
    zmq::message_t event;
    zmq::message_t address;
    while (monitors[s].recv(event, zmq::recv_flags::dontwait)) {
      if (event.more()) (void)monitors[s].recv(address, zmq::recv_flags::dontwait);
      uint16_t id = 0;
      if (event.size() >= sizeof(id)) std::memcpy(&id, event.data(), sizeof(id));
      if (id == ZMQ_EVENT_HANDSHAKE_FAILED_AUTH) {
        SHOAL_THROW(PeerError, name(), " hello: authentication failed: ", server_name(s),
                    " refused this worker's token in ZeroMQ's handshake (is SHOAL_AUTH_TOKEN the "
                    "same for every process of the job?)");
      }
      if (id == ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL) {
        SHOAL_CHECK_T(InvalidArgument, !options.auth_token.empty(), name(), " ", server_name(s),
                      " requires authentication: set SHOAL_AUTH_TOKEN to the job's token");
        SHOAL_THROW(PeerError, name(), " hello: ", server_name(s),
                    " does not speak this worker's handshake: it runs without a token while this "
                    "worker has SHOAL_AUTH_TOKEN set (set it for every process of the job, or none)");
      }
    }
  }

  void connect() {
    for (size_t s = 0; s < options.servers.size(); ++s) {
      sockets.emplace_back(context, zmq::socket_type::dealer);
      zmq::socket_t& socket = sockets.back();
      configure_socket(socket, limits);
      if (!options.auth_token.empty()) {  // the server's gate (auth.h)
        socket.set(zmq::sockopt::plain_username, kGateUser);
        socket.set(zmq::sockopt::plain_password, gate_password(options.auth_token));
      }
      // Handshake failures, which libzmq otherwise only retries in silence.
      const std::string monitor = "inproc://shoal-ps-worker-monitor-" + std::to_string(s);
      SHOAL_CHECK(zmq_socket_monitor(socket.handle(), monitor.c_str(),
                                     ZMQ_EVENT_HANDSHAKE_FAILED_AUTH |
                                         ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL) == 0,
                  name(), " cannot monitor its socket: ", zmq_strerror(zmq_errno()));
      monitors.emplace_back(context, zmq::socket_type::pair);
      monitors.back().connect(monitor);
      socket.connect(options.servers[s]);
    }
    // Hello to every server, then the answers (challenge or welcome).
    std::vector<int64_t> hellos(options.servers.size());
    for (size_t s = 0; s < sockets.size(); ++s) {
      OutMessage hello(MessageType::kHello, options.rank, ++seq);
      hellos[s] = seq;
      send(s, hello, "hello");
    }
    for (size_t s = 0; s < sockets.size(); ++s) {
      InMessage answer = await(s, hellos[s], "hello", options.timeout, [&] { check_handshake(s); });
      if (answer.type() == MessageType::kWelcome) continue;
      SHOAL_CHECK_T(PeerError, answer.type() == MessageType::kChallenge, name(), " hello: ",
                    server_name(s), " answered ", message_type_name(answer.type()));
      SHOAL_CHECK_T(InvalidArgument, !options.auth_token.empty(), name(), " ", server_name(s),
                    " requires authentication: set SHOAL_AUTH_TOKEN to the job's token");
      Challenge challenge{};
      SHOAL_CHECK_T(PeerError, answer.blob.size() == challenge.size(), name(), " ",
                    server_name(s), " sent a challenge of ", answer.blob.size(), " bytes");
      std::memcpy(challenge.data(), answer.blob.data(), challenge.size());
      const Digest response = auth_response(options.auth_token, challenge);
      OutMessage auth(MessageType::kAuth, options.rank, ++seq);
      auth.blob.assign(reinterpret_cast<const char*>(response.data()), response.size());
      send(s, auth, "auth");
      InMessage welcome = await(s, auth.header.seq, "auth");
      SHOAL_CHECK_T(PeerError, welcome.type() == MessageType::kWelcome, name(), " auth: ",
                    server_name(s), " answered ", message_type_name(welcome.type()));
    }
    for (size_t s = 0; s < sockets.size(); ++s) zmq_socket_monitor(sockets[s].handle(), nullptr, 0);
    monitors.clear();
  }

  at::Tensor flat(size_t param) const { return parameters[param].second.view(-1); }

  // The ranges of server s, with the tensors `pick` gives for each segment (skipped when
  // undefined).
  template <typename Pick>
  OutMessage ranges_for(size_t s, MessageType type, Pick pick) {
    OutMessage out(type, options.rank, ++seq);
    for (size_t k = 0; k < segments.size(); ++k) {
      const Segment& seg = segments[k];
      if (seg.server != static_cast<int>(s)) continue;
      at::Tensor tensor = pick(seg);
      if (!tensor.defined()) continue;
      KeyRange range;
      range.key = static_cast<uint32_t>(k);
      range.offset = seg.offset;
      range.numel = seg.numel;
      out.keys.push_back(range);
      out.tensors.push_back(tensor.view(-1).slice(0, seg.offset, seg.offset + seg.numel));
    }
    return out;
  }

  void push() {
    std::vector<int64_t> sent(sockets.size());
    for (size_t s = 0; s < sockets.size(); ++s) {
      OutMessage out = ranges_for(s, MessageType::kPush, [&](const Segment& seg) {
        const at::Tensor& grad = parameters[static_cast<size_t>(seg.param)].second.grad();
        return grad.defined() ? grad.contiguous() : at::Tensor();
      });
      out.header.clock = clock;
      out.blob.assign(reinterpret_cast<const char*>(&lr_factor), sizeof(lr_factor));
      sent[s] = out.header.seq;
      send(s, out, "push");
    }
    for (size_t s = 0; s < sockets.size(); ++s) await(s, sent[s], "push");
    ++clock;
  }

  void pull() {
    const Clock::time_point start = Clock::now();
    std::vector<int64_t> sent(sockets.size());
    for (size_t s = 0; s < sockets.size(); ++s) {
      OutMessage out(MessageType::kPull, options.rank, ++seq);
      out.header.clock = clock;
      out.header.version = versions[s];
      sent[s] = out.header.seq;
      send(s, out, "pull");
    }
    at::NoGradGuard no_grad;
    for (size_t s = 0; s < sockets.size(); ++s) {
      InMessage m = await(s, sent[s], "pull");
      SHOAL_CHECK_T(PeerError, m.type() == MessageType::kParams, name(), " pull: ",
                    server_name(s), " answered ", message_type_name(m.type()));
      for (size_t i = 0; i < m.keys.size(); ++i) {
        const KeyRange& range = m.keys[i];
        SHOAL_CHECK_T(PeerError, range.key < segments.size(), name(), " pull: ", server_name(s),
                      " sent unknown key ", range.key);
        const Segment& seg = segments[range.key];
        SHOAL_CHECK_T(PeerError,
                      seg.server == static_cast<int>(s) && seg.offset == range.offset &&
                          seg.numel == range.numel,
                      name(), " pull: ", server_name(s), " sent key ", range.key,
                      " with a range that does not match the partition");
        flat(static_cast<size_t>(seg.param))
            .slice(0, seg.offset, seg.offset + seg.numel)
            .copy_(m.tensor(i));
      }
      versions[s] = m.header.version;
    }
    pull_seconds += std::chrono::duration<double>(Clock::now() - start).count();
  }

  // A sum round of nothing on every server; the rounds share the worker's counter, and each
  // server completes its own once all live workers have joined it. A checkpoint round carries
  // the step the servers save their shards as.
  void barrier_round(bool checkpoint, int64_t step) {
    const int64_t round = sum_round++;
    const char* what = checkpoint ? "checkpoint barrier" : "barrier";
    std::vector<int64_t> sent(sockets.size());
    for (size_t s = 0; s < sockets.size(); ++s) {
      OutMessage out(MessageType::kSum, options.rank, ++seq);
      out.header.clock = round;
      out.header.version = checkpoint ? 1 : 0;
      if (checkpoint) out.blob.assign(reinterpret_cast<const char*>(&step), sizeof(step));
      sent[s] = out.header.seq;
      send(s, out, what);
    }
    for (size_t s = 0; s < sockets.size(); ++s) await(s, sent[s], what);
  }
};

Worker::Worker(WorkerOptions options, std::vector<std::pair<std::string, at::Tensor>> parameters)
    : impl_(std::make_unique<Impl>()) {
  SHOAL_CHECK_T(InvalidArgument, !options.servers.empty(), "ps worker: no server given");
  SHOAL_CHECK_T(InvalidArgument, options.rank >= 0 && options.rank < options.num_workers,
                "ps worker: rank ", options.rank, " is not in 0..", options.num_workers - 1);
  if (options.auth_token_from_env && options.auth_token.empty()) {
    options.auth_token = auth_token_from_env();
  }
  std::vector<int64_t> numels;
  for (const auto& [name, tensor] : parameters) {
    SHOAL_CHECK_T(InvalidArgument,
                  tensor.scalar_type() == at::kFloat && tensor.is_contiguous() &&
                      tensor.device().is_cpu(),
                  "ps worker: parameter ", name, " must be a contiguous float32 CPU tensor");
    numels.push_back(tensor.numel());
  }
  impl_->options = std::move(options);
  impl_->limits.max_message_bytes = impl_->options.max_message_bytes;
  impl_->parameters = std::move(parameters);
  impl_->segments = partition_parameters(
      numels, static_cast<int>(impl_->options.servers.size()), impl_->options.split_threshold);
  impl_->versions.assign(impl_->options.servers.size(), -1);
  impl_->connect();
}

Worker::~Worker() {
  try {
    close();
  } catch (const std::exception&) {
    // A dead server cannot be told goodbye; the error was reported where it happened.
  }
}

void Worker::init() {
  if (impl_->options.rank == 0) {
    std::vector<int64_t> sent(impl_->sockets.size());
    for (size_t s = 0; s < impl_->sockets.size(); ++s) {
      OutMessage out = impl_->ranges_for(s, MessageType::kInit, [&](const Segment& seg) {
        return impl_->parameters[static_cast<size_t>(seg.param)].second.detach();
      });
      sent[s] = out.header.seq;
      impl_->send(s, out, "init");
    }
    for (size_t s = 0; s < impl_->sockets.size(); ++s) impl_->await(s, sent[s], "init");
  }
  impl_->pull();
}

void Worker::push() { impl_->push(); }
void Worker::pull() { impl_->pull(); }

void Worker::step() {
  impl_->push();
  impl_->pull();
}

std::vector<double> Worker::all_reduce_sum(const std::vector<double>& values) {
  OutMessage out(MessageType::kSum, impl_->options.rank, ++impl_->seq);
  out.header.clock = impl_->sum_round++;
  out.blob.assign(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(double));
  impl_->send(0, out, "sum");
  InMessage m = impl_->await(0, out.header.seq, "sum");
  SHOAL_CHECK_T(PeerError, m.blob.size() == values.size() * sizeof(double), impl_->name(),
                " sum: ", impl_->server_name(0), " answered ", m.blob.size(), " bytes for ",
                values.size(), " values");
  std::vector<double> sums(values.size());
  if (!sums.empty()) std::memcpy(sums.data(), m.blob.data(), m.blob.size());
  return sums;
}

void Worker::barrier() { impl_->barrier_round(false, 0); }

void Worker::checkpoint_barrier(int64_t step) { impl_->barrier_round(true, step); }

void Worker::close() {
  if (impl_->closed) return;
  impl_->closed = true;
  std::vector<int64_t> sent(impl_->sockets.size());
  for (size_t s = 0; s < impl_->sockets.size(); ++s) {
    OutMessage out(MessageType::kBye, impl_->options.rank, ++impl_->seq);
    sent[s] = out.header.seq;
    impl_->send(s, out, "bye");
  }
  // Why at most 5 s: goodbye only spares the servers their worker_timeout; a server that does
  // not answer it quickly is gone or busy, and the worker's work is done.
  const auto timeout = std::min(impl_->options.timeout, std::chrono::milliseconds(5000));
  for (size_t s = 0; s < impl_->sockets.size(); ++s) impl_->await(s, sent[s], "bye", timeout);
}

void Worker::set_lr_factor(double factor) {
  SHOAL_CHECK_T(InvalidArgument, std::isfinite(factor) && factor >= 0, impl_->name(),
                " set_lr_factor: the factor must be finite and >= 0, got ", factor);
  impl_->lr_factor = factor;
}

int Worker::rank() const { return impl_->options.rank; }
int Worker::num_workers() const { return impl_->options.num_workers; }
int64_t Worker::clock() const { return impl_->clock; }
double Worker::pull_seconds() const { return impl_->pull_seconds; }

}  // namespace shoal::ps
