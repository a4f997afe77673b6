#include "collective_checks.h"

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <sstream>
#include <thread>
#include <stdexcept>

namespace shoal::comm::testing {
namespace {

const std::vector<torch::Dtype> kAllDtypes = {torch::kFloat, torch::kDouble, torch::kHalf,
                                              torch::kBFloat16, torch::kInt, torch::kLong,
                                              torch::kByte, torch::kChar};

// Rank r's input: r + 1 + (i mod 7) * 0.5 in float64; exact in every floating dtype used here.
torch::Tensor input(int rank, int64_t numel, torch::Dtype dtype = torch::kFloat) {
  auto i = torch::arange(numel, torch::kDouble);
  return (torch::fmod(i, 7) * 0.5 + (rank + 1)).to(dtype);
}

void expect(bool ok, const ProcessGroup& pg, const std::string& what) {
  if (!ok) {
    throw std::runtime_error(pg.rank_prefix() + " " + pg.backend_name() + ": " + what);
  }
}

void expect_close(const ProcessGroup& pg, const torch::Tensor& got, const torch::Tensor& want,
                  const std::string& what, double tolerance = 1e-6) {
  expect(got.sizes() == want.sizes(), pg, what + ": wrong shape");
  if (got.numel() == 0) return;
  const auto a = got.to(torch::kDouble);
  const auto b = want.to(torch::kDouble);
  const double error = (a - b).abs().max().item<double>();
  const double scale = std::max(1.0, b.abs().max().item<double>());
  std::ostringstream detail;
  detail << what << ": max error " << error << " (first got " << a.flatten()[0].item<double>()
         << ", want " << b.flatten()[0].item<double>() << ")";
  expect(error <= tolerance * scale, pg, detail.str());
}

torch::Tensor reduce_expected(ReduceOp op, int n, int64_t numel, int salt = 0) {
  auto expected = input(salt, numel, torch::kDouble);
  for (int r = 1; r < n; ++r) {
    auto x = input(r + salt, numel, torch::kDouble);
    if (op == ReduceOp::kSum || op == ReduceOp::kAvg) expected = expected + x;
    if (op == ReduceOp::kMin) expected = torch::minimum(expected, x);
    if (op == ReduceOp::kMax) expected = torch::maximum(expected, x);
    if (op == ReduceOp::kProduct) expected = expected * x;
  }
  if (op == ReduceOp::kAvg) expected = expected / n;
  return expected;
}

}  // namespace

void check_allreduce_ops(ProcessGroup& pg, int64_t numel) {
  for (auto op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMin, ReduceOp::kMax,
                  ReduceOp::kProduct}) {
    auto t = input(pg.rank(), numel, torch::kDouble);
    pg.allreduce(t, {op})->wait();
    expect_close(pg, t, reduce_expected(op, pg.size(), numel),
                 std::string("allreduce ") + to_string(op), 1e-12);
  }
}

void check_allreduce_dtypes(ProcessGroup& pg, int64_t numel) {
  // Every dtype at up to 64 Ki elements: the large-count paths are covered in float32/float64 by
  // the other checks, and 16-bit conversions of a million elements cost seconds on 2 cores.
  numel = std::min<int64_t>(numel, 1 << 16);
  const int n = pg.size();
  for (auto dtype : kAllDtypes) {
    const std::string name = c10::toString(dtype);
    // Small integers: exact in every dtype (the sum over 4 ranks is at most 10, fits int8).
    auto t = torch::full({numel}, pg.rank() + 1, torch::TensorOptions().dtype(dtype));
    pg.allreduce(t)->wait();
    expect(t.scalar_type() == dtype, pg, "allreduce changed the dtype of " + name);
    expect_close(pg, t, torch::full({numel}, n * (n + 1) / 2.0, torch::kDouble),
                 "allreduce sum " + name, 0);
    auto m = torch::full({numel}, pg.rank() + 1, torch::TensorOptions().dtype(dtype));
    pg.allreduce(m, {ReduceOp::kMax})->wait();
    expect_close(pg, m, torch::full({numel}, static_cast<double>(n), torch::kDouble),
                 "allreduce max " + name, 0);
    auto a = torch::full({numel}, 2 * (pg.rank() + 1), torch::TensorOptions().dtype(dtype));
    pg.allreduce(a, {ReduceOp::kAvg})->wait();
    expect_close(pg, a, torch::full({numel}, static_cast<double>(n + 1), torch::kDouble),
                 "allreduce avg " + name, 0);
    // Byte-moving operations with the 16-bit and 8-bit types too.
    auto b = input(pg.rank(), numel, dtype);
    pg.broadcast(b, {n - 1})->wait();
    expect_close(pg, b, input(n - 1, numel, dtype), "broadcast " + name, 0);
  }
}

void check_broadcast(ProcessGroup& pg, int64_t numel) {
  for (int root = 0; root < pg.size(); ++root) {
    auto t = input(pg.rank(), numel);
    pg.broadcast(t, {root})->wait();
    expect_close(pg, t, input(root, numel), "broadcast from root " + std::to_string(root), 0);
  }
}

void check_reduce(ProcessGroup& pg, int64_t numel) {
  const int n = pg.size();
  for (auto op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax}) {
    const int root = static_cast<int>(op) % n;
    auto t = input(pg.rank(), numel, torch::kDouble);
    pg.reduce(t, {root, op})->wait();
    if (pg.rank() == root) {
      expect_close(pg, t, reduce_expected(op, n, numel),
                   std::string("reduce ") + to_string(op) + " to root " + std::to_string(root),
                   1e-12);
    }
  }
  auto h = input(pg.rank(), numel, torch::kBFloat16);
  pg.reduce(h, {0, ReduceOp::kSum})->wait();
  if (pg.rank() == 0) {
    // Exact: every input and partial sum is a multiple of 0.5 below 32, 7 significant bits at most
    // (bfloat16 holds 8), whatever the order of the additions.
    expect_close(pg, h, reduce_expected(ReduceOp::kSum, n, numel), "reduce bfloat16", 0);
  }
}

void check_allgather(ProcessGroup& pg, int64_t numel) {
  const int n = pg.size();
  for (auto dtype : {torch::kFloat, torch::kHalf, torch::kLong}) {
    std::vector<torch::Tensor> outputs;
    for (int r = 0; r < n; ++r) outputs.push_back(torch::full({numel}, -1, dtype));
    pg.allgather(outputs, input(pg.rank(), numel, dtype))->wait();
    for (int r = 0; r < n; ++r) {
      expect_close(pg, outputs[r], input(r, numel, dtype), "allgather from rank " +
                                                               std::to_string(r), 0);
    }
  }
  // In place, as FSDP's stages 1-2 gather: the input is this rank's own block of the output.
  auto full = torch::full({numel * n}, -1.0f);
  auto own = full.narrow(0, pg.rank() * numel, numel).copy_(input(pg.rank(), numel));
  pg.all_gather_into_tensor(full, own)->wait();
  std::vector<torch::Tensor> blocks;
  for (int r = 0; r < n; ++r) blocks.push_back(input(r, numel));
  expect_close(pg, full, torch::cat(blocks), "all_gather_into_tensor in place", 0);
}

void check_gather(ProcessGroup& pg, int64_t numel) {
  const int n = pg.size();
  for (int root : {0, n - 1}) {
    std::vector<torch::Tensor> gathered;
    if (pg.rank() == root) {
      for (int r = 0; r < n; ++r) gathered.push_back(torch::full({numel}, -1.0));
    }
    pg.gather(gathered, input(pg.rank(), numel), {root})->wait();
    if (pg.rank() == root) {
      for (int r = 0; r < n; ++r) {
        expect_close(pg, gathered[r], input(r, numel), "gather from rank " + std::to_string(r), 0);
      }
    }
  }
}

void check_scatter(ProcessGroup& pg, int64_t numel) {
  const int n = pg.size();
  for (int root : {0, n / 2}) {
    std::vector<torch::Tensor> pieces;
    if (pg.rank() == root) {
      for (int r = 0; r < n; ++r) pieces.push_back(input(r * 10, numel));
    }
    auto out = torch::full({numel}, -1.0);
    pg.scatter(out, pieces, {root})->wait();
    expect_close(pg, out, input(pg.rank() * 10, numel),
                 "scatter from root " + std::to_string(root), 0);
  }
}

void check_reduce_scatter(ProcessGroup& pg, int64_t numel) {
  const int n = pg.size();
  for (auto op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMin}) {
    std::vector<torch::Tensor> inputs;
    for (int r = 0; r < n; ++r) inputs.push_back(input(pg.rank() + 7 * r, numel, torch::kDouble));
    auto out = torch::full({numel}, -1.0, torch::kDouble);
    pg.reduce_scatter(out, inputs, {op})->wait();
    // Block r of every rank's input list lands, reduced, on rank r.
    auto expected = input(7 * pg.rank(), numel, torch::kDouble);
    for (int src = 1; src < n; ++src) {
      auto x = input(src + 7 * pg.rank(), numel, torch::kDouble);
      expected = op == ReduceOp::kMin ? torch::minimum(expected, x) : expected + x;
    }
    if (op == ReduceOp::kAvg) expected = expected / n;
    expect_close(pg, out, expected, std::string("reduce_scatter ") + to_string(op), 1e-12);
  }
}

void check_send_recv(ProcessGroup& pg, int64_t numel) {
  const int n = pg.size();
  if (n < 2) return;
  const int next = (pg.rank() + 1) % n;
  const int prev = (pg.rank() + n - 1) % n;
  auto out = input(pg.rank(), numel);
  auto in = torch::full({numel}, -1.0);
  auto send = pg.send(out, next, {3});
  auto recv = pg.recv(in, prev, {3});
  send->wait();
  recv->wait();
  expect_close(pg, in, input(prev, numel), "recv from rank " + std::to_string(prev), 0);
}

// Every rank notes when it entered and left each barrier (CLOCK_MONOTONIC, which threads and
// processes of one machine share); one rank per round enters late. No rank may leave before the
// last one entered: a barrier that does not wait fails this by the delay, whatever the scheduling.
void check_barrier(ProcessGroup& pg, int64_t numel) {
  check_barrier_with(pg, numel, [&pg] { pg.barrier()->wait(); });
}

void check_barrier_with(ProcessGroup& pg, int64_t numel, const std::function<void()>& barrier) {
  for (int i = 0; i < 3; ++i) barrier();
  if (numel != 1) return;  // the timed rounds once per backend and world size, not per count
  using Clock = std::chrono::steady_clock;
  // Long enough to dwarf the time a no-op barrier takes to return, short enough to keep the
  // check cheap across every backend and world size.
  constexpr auto kDelay = std::chrono::milliseconds(20);
  const int n = pg.size();
  for (int round = 0; round < std::min(n, 3); ++round) {
    const int late = (n - 1 + round) % n;
    if (pg.rank() == late) std::this_thread::sleep_for(kDelay);
    const int64_t entered = Clock::now().time_since_epoch().count();
    barrier();
    const int64_t left = Clock::now().time_since_epoch().count();
    std::vector<torch::Tensor> times;
    for (int r = 0; r < n; ++r) times.push_back(torch::zeros({2}, torch::kLong));
    pg.allgather(times, torch::tensor({entered, left}, torch::kLong))->wait();
    int64_t last_entry = 0;
    for (const auto& t : times) last_entry = std::max(last_entry, t[0].item<int64_t>());
    for (int r = 0; r < n; ++r) {
      expect(times[r][1].item<int64_t>() >= last_entry, pg,
             "barrier round " + std::to_string(round) + ": rank " + std::to_string(r) +
                 " left before rank " + std::to_string(late) + " entered");
    }
  }
}

void check_sub_group(ProcessGroup& pg, int64_t numel) {
  std::vector<int> evens;
  for (int r = 0; r < pg.size(); r += 2) evens.push_back(r);
  auto sub = pg.new_group(evens);
  expect((sub != nullptr) == (pg.rank() % 2 == 0), pg, "new_group membership");
  if (sub) {
    expect(sub->rank() == pg.rank() / 2 && sub->size() == static_cast<int>(evens.size()), pg,
           "sub-group rank or size");
    auto t = torch::full({numel}, pg.rank() + 1.0);
    sub->allreduce(t)->wait();
    double want = 0;
    for (int r : evens) want += r + 1;
    expect_close(pg, t, torch::full({numel}, want), "sub-group allreduce", 0);
  }
  // The parent stays usable, in step, after the sub-group's operations.
  pg.barrier()->wait();
}

void check_blocking_calls(ProcessGroup& pg, int64_t numel) {
  // Up to 64 Ki elements (256 KiB of float32: above shm's inline size, so a blocking call is what
  // keeps it on the calling thread); the million-element paths are the other checks'.
  numel = std::min<int64_t>(numel, 1 << 16);
  const int n = pg.size();
  const auto done = [&](const std::shared_ptr<Work>& work, const std::string& what) {
    expect(work->is_completed(), pg, what + " (async_op = false) returned before it completed");
  };
  // Behind an asynchronous allreduce that may still be queued (the shm backend's worker thread).
  auto queued = input(pg.rank(), numel);
  auto queued_work = pg.allreduce(queued);
  auto t = input(pg.rank(), numel, torch::kDouble);
  AllreduceOptions sum;
  sum.async_op = false;
  done(pg.allreduce(t, sum), "allreduce");
  expect_close(pg, t, reduce_expected(ReduceOp::kSum, n, numel), "allreduce(async_op=false)",
               1e-12);
  queued_work->wait();
  expect_close(pg, queued, reduce_expected(ReduceOp::kSum, n, numel), "allreduce before it");

  BroadcastOptions from_last;
  from_last.root = n - 1;
  from_last.async_op = false;
  auto b = input(pg.rank(), numel);
  done(pg.broadcast(b, from_last), "broadcast");
  expect_close(pg, b, input(n - 1, numel), "broadcast(async_op=false)", 0);

  AllgatherOptions gather;
  gather.async_op = false;
  auto gathered = torch::full({numel * n}, -1.0f);
  done(pg.all_gather_into_tensor(gathered, input(pg.rank(), numel), gather),
       "all_gather_into_tensor");
  std::vector<torch::Tensor> blocks;
  for (int r = 0; r < n; ++r) blocks.push_back(input(r, numel));
  expect_close(pg, gathered, torch::cat(blocks), "all_gather_into_tensor(async_op=false)", 0);

  ReduceScatterOptions scatter;
  scatter.async_op = false;
  auto piece = torch::full({numel}, -1.0, torch::kDouble);
  done(pg.reduce_scatter_tensor(piece, input(pg.rank(), numel * n, torch::kDouble), scatter),
       "reduce_scatter_tensor");
  expect_close(pg, piece,
               reduce_expected(ReduceOp::kSum, n, numel * n).narrow(0, pg.rank() * numel, numel),
               "reduce_scatter_tensor(async_op=false)", 1e-12);
}

const std::vector<NamedCheck>& all_checks() {
  static const std::vector<NamedCheck> checks = {
      {"allreduce_ops", check_allreduce_ops}, {"allreduce_dtypes", check_allreduce_dtypes},
      {"broadcast", check_broadcast},         {"reduce", check_reduce},
      {"allgather", check_allgather},         {"gather", check_gather},
      {"scatter", check_scatter},             {"reduce_scatter", check_reduce_scatter},
      {"send_recv", check_send_recv},         {"barrier", check_barrier},
      {"sub_group", check_sub_group},         {"blocking_calls", check_blocking_calls},
  };
  return checks;
}

const std::vector<int64_t>& element_counts() {
  // 0 and 1 are the edge cases; 1001 is odd and not a multiple of any chunk size; 2^20 floats
  // (4 MB) is large enough to take every backend's pipelined/chunked path.
  static const std::vector<int64_t> counts = {0, 1, 1001, 1 << 20};
  return counts;
}

}  // namespace shoal::comm::testing
