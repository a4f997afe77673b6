// DataParallel: data parallelism in one process, PyTorch's nn.DataParallel in C++.
//
//   shoal::parallel::DataParallel<Net> dp(net, DataParallelOptions().device_ids({0, 1, 2}));
//   auto loss = torch::nll_loss(dp.forward(x), y);  // x scattered along dim, outputs gathered
//   loss.backward();                                // summed gradients land on net's parameters
//   optimizer.step();                               // any optimizer over net->parameters()
//
// Each step scatters the input batch along `dim` into chunks (torch.chunk's sizes, as PyTorch's
// scatter: a batch of 7 over 3 replicas gives 3, 3, 1; a batch of 2 uses only 2 replicas), runs
// each chunk through a replica on its own persistent thread, and concatenates the outputs on
// `output_device`. With CUDA, device_ids are GPUs; on CPU they name CPU worker slots (a thread
// each, with its own intra-op thread count), so DataParallel is useful on many-core machines.
//
// Replicas. Replica 0 is the wrapped module itself (PyTorch requires it on device_ids[0], and its
// replica 0 shares the module's parameters and buffers too). The other replicas are made once
// (module->clone(), or a factory for modules that are not Cloneable) and kept between steps.
// Their parameters are leaves that, on the module's own device, share the module's storage (no
// copy, ever: an optimizer step is seen at once); on another device they are copies refreshed
// only when the module's parameter changed (its version counter moved: optimizers and
// load_state_dict change parameters in place through autograd-visible ops; a write through
// `.data()` is not seen there). Buffers follow PyTorch: replica 0 updates the module's own
// buffers (BatchNorm running statistics), the other replicas get fresh copies of them before
// each forward (BatchNorm's kernels do not move version counters) and their updates are discarded.
//
// Gradients. The gathered outputs are produced by one autograd node whose inputs are the module's
// parameters (and any scattered inputs that require grad). Its backward splits the output gradient
// into the replicas' chunks, runs each replica's backward on that replica's thread (in parallel:
// LibTorch runs a CPU backward on the calling thread only, so one backward over all replicas
// would be serial), and returns the replicas' parameter gradients summed in replica order, which
// autograd accumulates into the module's `.grad` as for any parameter. So backward leaves the
// summed gradient on the module's parameters, the sum is deterministic, and the replicas' own
// `.grad` stay empty. (PyTorch links replicas to the module through a differentiable Broadcast
// instead; on GPUs its engine has a thread per device, which CPU slots lack.) The replicas'
// graphs are freed by that backward: backward through a DataParallel output once per forward
// (retain_graph is not supported across it).
//
// Inputs and outputs. Tensors are scattered/gathered; std::vector<at::Tensor>, std::tuple and
// std::pair are walked recursively; other values (ints, strings, options structs) are given to
// every replica as they are, and in outputs replica 0's value is returned. A 0-dim tensor output
// gathers into a [n] tensor (one value per replica), as in PyTorch. Specialise
// shoal::parallel::ScatterGather<T> for other containers.
//
// Errors. An exception in a replica is rethrown in the caller as shoal::Error naming the replica
// and its device, with the original message; a replica running past `timeout` gives TimeoutError.
//
// State dicts: parameters()/named_parameters()/named_buffers() are the module's own, with the
// module's names (no "module." prefix), so checkpoints of the wrapper and of the module are the
// same file.
//
// Thread safety: one thread drives a DataParallel (forward, backward, optimizer step); replica
// forwards/backwards run on the wrapper's own threads meanwhile.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace shoal::parallel {

class ReplicaThreads;

/// PyTorch's DataParallel arguments, plus what CPU slots and deadlines need.
struct DataParallelOptions {
  /// The replicas' devices: CUDA device indices when `cuda` is on, else CPU slot numbers (any
  /// distinct numbers; their count is the replica count). Empty: every visible GPU with `cuda`,
  /// else one CPU slot (PyTorch's DataParallel also just runs the module when it has no GPU).
  TORCH_ARG(std::vector<int64_t>, device_ids) = {};
  /// Where outputs are gathered (an entry of device_ids); -1: device_ids[0]. Ignored on CPU.
  TORCH_ARG(int64_t, output_device) = -1;
  /// The dimension inputs are scattered along and outputs gathered along.
  TORCH_ARG(int64_t, dim) = 0;
  /// Replicas on GPUs; off: CPU slots. Defaults to whether a GPU is visible.
  TORCH_ARG(std::optional<bool>, cuda) = std::nullopt;
  /// Intra-op threads of each CPU slot's thread (at::set_num_threads there); 0 leaves the default.
  /// One is what K slots on K cores want.
  TORCH_ARG(int, intra_op_threads) = 1;
  /// How long one replica's forward or backward may take before the step fails.
  TORCH_ARG(std::chrono::milliseconds, timeout) = std::chrono::minutes(30);
};

/// Where a DataParallel step's time went (seconds summed over steps), for benchmarks.
struct DataParallelStats {
  int64_t steps = 0;              ///< forward calls
  int64_t backward_steps = 0;     ///< backward passes through a gathered output
  double scatter_seconds = 0;     ///< splitting the inputs (and moving them to devices)
  double replicate_seconds = 0;   ///< refreshing replicas from the module
  double forward_seconds = 0;     ///< wall time of the parallel replica forwards
  double gather_seconds = 0;      ///< concatenating the outputs
  double backward_seconds = 0;    ///< wall time of the parallel replica backwards
  double reduce_seconds = 0;      ///< summing replica gradients, concatenating input gradients
  /// Per replica: forward and backward compute time (the slowest replica bounds a step).
  std::vector<double> replica_forward_seconds;
  std::vector<double> replica_backward_seconds;
};

/// How a value of type T travels through scatter and gather. The primary template treats T as an
/// opaque value: every replica gets a copy; gather returns replica 0's.
template <typename T, typename Enable = void>
struct ScatterGather {
  /// Appends the tensors inside `value` (in a fixed order) to `out`.
  static void tensors(const T&, std::vector<at::Tensor>&) {}
  /// Rebuilds a T shaped like `like` from `tensors[pos...]`, advancing pos.
  static T rebuild(const T& like, const std::vector<at::Tensor>&, size_t&) { return like; }
};

template <>
struct ScatterGather<at::Tensor> {
  static void tensors(const at::Tensor& value, std::vector<at::Tensor>& out) { out.push_back(value); }
  static at::Tensor rebuild(const at::Tensor&, const std::vector<at::Tensor>& tensors, size_t& pos) {
    return tensors[pos++];
  }
};

template <typename E>
struct ScatterGather<std::vector<E>> {
  static void tensors(const std::vector<E>& value, std::vector<at::Tensor>& out) {
    for (const auto& e : value) ScatterGather<E>::tensors(e, out);
  }
  static std::vector<E> rebuild(const std::vector<E>& like, const std::vector<at::Tensor>& tensors,
                                size_t& pos) {
    std::vector<E> result;
    result.reserve(like.size());
    for (const auto& e : like) result.push_back(ScatterGather<E>::rebuild(e, tensors, pos));
    return result;
  }
};

template <typename... Ts>
struct ScatterGather<std::tuple<Ts...>> {
  static void tensors(const std::tuple<Ts...>& value, std::vector<at::Tensor>& out) {
    std::apply([&](const auto&... e) { (ScatterGather<std::decay_t<decltype(e)>>::tensors(e, out), ...); },
               value);
  }
  static std::tuple<Ts...> rebuild(const std::tuple<Ts...>& like,
                                   const std::vector<at::Tensor>& tensors, size_t& pos) {
    // Braced initialisation evaluates left to right, so the tensors are taken in order.
    return std::apply(
        [&](const auto&... e) {
          return std::tuple<Ts...>{ScatterGather<std::decay_t<decltype(e)>>::rebuild(e, tensors, pos)...};
        },
        like);
  }
};

template <typename A, typename B>
struct ScatterGather<std::pair<A, B>> {
  static void tensors(const std::pair<A, B>& value, std::vector<at::Tensor>& out) {
    ScatterGather<A>::tensors(value.first, out);
    ScatterGather<B>::tensors(value.second, out);
  }
  static std::pair<A, B> rebuild(const std::pair<A, B>& like, const std::vector<at::Tensor>& tensors,
                                 size_t& pos) {
    A first = ScatterGather<A>::rebuild(like.first, tensors, pos);
    B second = ScatterGather<B>::rebuild(like.second, tensors, pos);
    return {std::move(first), std::move(second)};
  }
};

/// The type-independent part of DataParallel (see the file comment).
class DataParallelBase {
 public:
  /// Makes a new module with the same structure as the wrapped one (its values are overwritten).
  using ReplicaFactory = std::function<std::shared_ptr<torch::nn::Module>()>;

  DataParallelBase(std::shared_ptr<torch::nn::Module> module, DataParallelOptions options,
                   ReplicaFactory factory);
  virtual ~DataParallelBase();
  DataParallelBase(const DataParallelBase&) = delete;
  DataParallelBase& operator=(const DataParallelBase&) = delete;

  /// The number of replicas (device_ids' size).
  int replica_count() const { return static_cast<int>(devices_.size()); }
  /// Replica r's device, and its name in messages ("cpu slot 1", "cuda:1").
  const at::Device& device(int replica) const { return devices_[replica]; }
  std::string device_name(int replica) const;
  const DataParallelOptions& options() const { return options_; }

  /// The wrapped module's parameters and buffers with its own names (see the file comment).
  torch::OrderedDict<std::string, at::Tensor> named_parameters() const;
  torch::OrderedDict<std::string, at::Tensor> named_buffers() const;
  std::vector<at::Tensor> parameters() const;

  DataParallelStats stats() const;
  void reset_stats();

 protected:
  /// What scatter made of one step's inputs: the tensors that require grad and, per replica, the
  /// leaf standing for its chunk of each.
  struct ScatterState {
    int replicas = 0;
    std::vector<at::Tensor> sources;
    std::vector<std::vector<at::Tensor>> leaves;  // [replica][source]
    std::vector<std::vector<int64_t>> chunk_counts;
  };

  /// How many chunks `tensor` splits into (torch.chunk over replica_count()), for counting.
  void count_chunks(const at::Tensor& tensor, ScatterState& state) const;
  /// Settles the step's replica count from the counted chunks (throws when tensors disagree).
  void settle_replicas(ScatterState& state) const;
  /// Replica r's chunk of `tensor`, on its device; a leaf tied to `tensor` when that requires grad.
  at::Tensor scatter_tensor(const at::Tensor& tensor, int replica, size_t tensor_index,
                            ScatterState& state);

  /// Brings replicas 1..n-1 up to date with the module (see the file comment).
  void replicate(int n);
  /// The replica modules; replica 0 is the wrapped module.
  const std::shared_ptr<torch::nn::Module>& replica_module(int r) const { return replicas_[r]; }

  /// Runs job(r) (a forward) for r < n on the replica threads; rethrows the first failure naming
  /// its replica.
  void run_replicas(int n, std::shared_ptr<const std::function<void(int)>> job);

  /// Concatenates outputs[r][j] over r for each j on the output device; the result is tied to the
  /// module's parameters (and the scattered inputs) by the gather node when autograd is on.
  std::vector<at::Tensor> gather(const std::vector<std::vector<at::Tensor>>& outputs,
                                 ScatterState& scatter);

  /// Accumulates phase time into the stats.
  void add_phase(double DataParallelStats::*field, double seconds);

  std::shared_ptr<torch::nn::Module> module_;

 public:
  /// Shared with the gather nodes of the autograd graphs (which may outlive a step).
  struct Shared;

 private:
  struct ReplicaState;
  void make_replicas();

  DataParallelOptions options_;
  ReplicaFactory factory_;
  std::vector<at::Device> devices_;
  at::Device output_device_;
  std::vector<std::shared_ptr<torch::nn::Module>> replicas_;
  std::vector<std::unique_ptr<ReplicaState>> replica_states_;
  std::shared_ptr<Shared> shared_;
};

/// DataParallel over a module of type ModuleType (see the file comment). ModuleType's forward is
/// called with the scattered arguments; replicas come from module->clone() unless a factory is
/// given (needed for modules that derive from torch::nn::Module rather than Cloneable).
template <typename ModuleType = torch::nn::Module>
class DataParallel : public DataParallelBase {
 public:
  using Factory = std::function<std::shared_ptr<ModuleType>()>;

  explicit DataParallel(std::shared_ptr<ModuleType> module, DataParallelOptions options = {},
                        Factory factory = nullptr)
      : DataParallelBase(module, std::move(options), wrap(module, std::move(factory))),
        module_typed_(std::move(module)) {}

  explicit DataParallel(torch::nn::ModuleHolder<ModuleType> module,
                        DataParallelOptions options = {}, Factory factory = nullptr)
      : DataParallel(module.ptr(), std::move(options), std::move(factory)) {}

  /// The wrapped module (whose state is what you checkpoint).
  const std::shared_ptr<ModuleType>& module() const { return module_typed_; }

  /// Scatter, parallel replica forwards, gather (see the file comment).
  template <typename... Args>
  auto forward(const Args&... args) {
    using Output = std::decay_t<decltype(std::declval<ModuleType&>().forward(args...))>;
    ScatterState scatter;
    auto start = std::chrono::steady_clock::now();
    {
      std::vector<at::Tensor> found;
      (ScatterGather<Args>::tensors(args, found), ...);
      for (const auto& t : found) count_chunks(t, scatter);
      settle_replicas(scatter);
    }
    const int n = scatter.replicas;
    // Per replica: the arguments, with each tensor replaced by that replica's chunk.
    auto inputs = std::make_shared<std::vector<std::tuple<Args...>>>();
    inputs->reserve(n);
    for (int r = 0; r < n; ++r) {
      size_t index = 0;
      inputs->push_back(std::tuple<Args...>{scatter_arg(args, r, index, scatter)...});
    }
    start = lap(start, &DataParallelStats::scatter_seconds);
    replicate(n);
    start = lap(start, &DataParallelStats::replicate_seconds);

    auto outputs = std::make_shared<std::vector<std::optional<Output>>>(n);
    std::vector<std::shared_ptr<ModuleType>> replicas;
    for (int r = 0; r < n; ++r) replicas.push_back(typed_replica(r));
    auto job = std::make_shared<const std::function<void(int)>>(
        [inputs, outputs, replicas](int r) {
          (*outputs)[r].emplace(std::apply(
              [&](const auto&... a) { return replicas[r]->forward(a...); }, (*inputs)[r]));
        });
    run_replicas(n, std::move(job));
    start = lap(start, &DataParallelStats::forward_seconds);

    std::vector<std::vector<at::Tensor>> flat(n);
    for (int r = 0; r < n; ++r) ScatterGather<Output>::tensors(*(*outputs)[r], flat[r]);
    std::vector<at::Tensor> gathered = gather(flat, scatter);
    size_t pos = 0;
    Output result = ScatterGather<Output>::rebuild(*(*outputs)[0], gathered, pos);
    lap(start, &DataParallelStats::gather_seconds);
    return result;
  }

  template <typename... Args>
  auto operator()(const Args&... args) {
    return forward(args...);
  }

 private:
  static ReplicaFactory wrap(const std::shared_ptr<ModuleType>& module, Factory factory) {
    if (factory) return [factory]() -> std::shared_ptr<torch::nn::Module> { return factory(); };
    return nullptr;  // the base clones
  }

  std::shared_ptr<ModuleType> typed_replica(int r) const {
    if (r == 0) return module_typed_;
    auto typed = std::dynamic_pointer_cast<ModuleType>(replica_module(r));
    return typed;
  }

  template <typename T>
  T scatter_arg(const T& value, int r, size_t& index, ScatterState& state) {
    if constexpr (std::is_same_v<T, at::Tensor>) {
      return scatter_tensor(value, r, index++, state);
    } else if constexpr (is_vector<T>::value) {
      T result;
      result.reserve(value.size());
      for (const auto& e : value) result.push_back(scatter_arg(e, r, index, state));
      return result;
    } else if constexpr (is_tuple_like<T>::value) {
      return std::apply(
          [&](const auto&... e) { return T{scatter_arg(e, r, index, state)...}; }, value);
    } else {
      return value;
    }
  }

  std::chrono::steady_clock::time_point lap(std::chrono::steady_clock::time_point start,
                                            double DataParallelStats::*field) {
    auto now = std::chrono::steady_clock::now();
    add_phase(field, std::chrono::duration<double>(now - start).count());
    return now;
  }

  template <typename T>
  struct is_vector : std::false_type {};
  template <typename E>
  struct is_vector<std::vector<E>> : std::true_type {};
  template <typename T>
  struct is_tuple_like : std::false_type {};
  template <typename... Ts>
  struct is_tuple_like<std::tuple<Ts...>> : std::true_type {};
  template <typename A, typename B>
  struct is_tuple_like<std::pair<A, B>> : std::true_type {};

  std::shared_ptr<ModuleType> module_typed_;
};

template <typename M>
DataParallel(std::shared_ptr<M>) -> DataParallel<M>;
template <typename M>
DataParallel(std::shared_ptr<M>, DataParallelOptions) -> DataParallel<M>;
template <typename M>
DataParallel(torch::nn::ModuleHolder<M>) -> DataParallel<M>;
template <typename M>
DataParallel(torch::nn::ModuleHolder<M>, DataParallelOptions) -> DataParallel<M>;

}  // namespace shoal::parallel

namespace shoal {
using parallel::DataParallel;
using parallel::DataParallelOptions;
}  // namespace shoal
