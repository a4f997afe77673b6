#include "shoal/env.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <sstream>
#include <string_view>

#include "shoal/error.h"

namespace shoal::env {
namespace {

// The shm backend's byte counts: a page at least (its buffers are page-aligned), at most 64 MiB
// (its segment holds a few chunks per rank).
constexpr int64_t kPage = 4096;
constexpr int64_t kMaxShmBytes = int64_t{64} << 20;
// Rank and process counts: far above any real job, far below int's overflow.
constexpr int64_t kMaxCount = (int64_t{1} << 30) - 1;

// Never destroyed: a thread still running at exit (a heartbeat, a detached reader) may read a
// variable after static destructors ran.
const std::vector<Variable>& table() {
  static const auto* rows = new std::vector<Variable>{
      {Var::kLogLevel, "SHOAL_LOG_LEVEL", Kind::kChoice, "debug|info|warn|error|off", "info",
       "Which of Shoal's own messages are written to stderr; `debug` adds the process group each "
       "rank joins, every checkpoint saved and a failing TorchScript model's traceback. An unknown "
       "value is reported once and read as `info`."},
      {Var::kTimeout, "SHOAL_TIMEOUT", Kind::kDuration, "", "`600s` (`30s` for a store or group made directly)",
       "How long a collective, a store or a rendezvous waits for a slow peer before failing; "
       "`InitOptions::timeout` overrides it."},
      {Var::kHeartbeatTimeout, "SHOAL_HEARTBEAT_TIMEOUT", Kind::kDuration, "", "`10s`",
       "How long a peer's heartbeat may stand still before an operation waiting for it fails (a "
       "process stopped or cut off on another host; one stopped on this host fails it within 5 s "
       "or this, whichever is shorter)."},
      {Var::kDebug, "SHOAL_DEBUG", Kind::kChoice, "off|info|detail", "off",
       "`detail`, as PyTorch's `TORCH_DISTRIBUTED_DEBUG=DETAIL`: DDP checks that every rank got "
       "gradients for the same parameters, and every collective first checks that all ranks issue "
       "the same one. `info` is read as `off`."},
      {Var::kCheckCollectives, "SHOAL_CHECK_COLLECTIVES", Kind::kFlag, "", "on under `SHOAL_DEBUG=detail`, off otherwise",
       "Turns the check that all ranks issue the same collective on (`1`) or off (`0`) alone."},
      {Var::kBackend, "SHOAL_BACKEND", Kind::kText,
       "a backend as `init_process_group` takes it (`gloo`, `shm`, `cpu:shm,cuda:nccl`, ...)", "`auto`",
       "The backend `init_process_group` uses when its options say `auto`."},
      {Var::kAuthToken, "SHOAL_AUTH_TOKEN", Kind::kText, "a secret, the same on every rank",
       "made per job by `shoal run`; none by hand",
       "The token every connection between a job's processes (stores, parameter servers) proves "
       "it knows before anything else."},
      {Var::kHostname, "SHOAL_HOSTNAME", Kind::kText, "a host name", "the machine's host name",
       "The host name by which the hierarchical backend groups ranks (tests pretend to be several "
       "hosts)."},
      {Var::kSigusr1, "SHOAL_SIGUSR1", Kind::kFlag, "", "1",
       "`0` leaves out the handler that prints every group's recent operations on `kill -USR1 PID`."},
      {Var::kSigusr1Ignored, "SHOAL_SIGUSR1_IGNORED", Kind::kFlag, "", "0",
       "Set by `shoal run` for its workers: SIGUSR1 is ignored only until the dump handler "
       "replaces it."},
      {Var::kGlooReduceScatter, "SHOAL_GLOO_REDUCE_SCATTER", Kind::kChoice, "ring|allreduce", "ring",
       "How the `gloo` backend reduce-scatters: a ring of point-to-point sends, or an allreduce of "
       "every block (for comparisons: a test and `bench/gloo_reduce_scatter_bench.cpp` use it)."},
      {Var::kAllreduceAlgo, "SHOAL_ALLREDUCE_ALGO", Kind::kChoice,
       "native|auto|ring|tree|recursive_doubling|rabenseifner", "native",
       "How the `gloo` backend (and the leaders of `hierarchical`) allreduce: c10d Gloo's own "
       "algorithm, the schedule a cost model picks per call from size, ranks and ranks per node, "
       "or one of Shoal's schedules over point-to-point messages (to compare them: `shoal bench "
       "allreduce --algorithm`)."},
      {Var::kShmChunkBytes, "SHOAL_SHM_CHUNK_BYTES", Kind::kInteger, "bytes",
       "a quarter of the L2 cache, 256 KiB to 1 MiB",
       "The chunk the `shm` backend stages large operations in (rounded up to 4 KiB).", kPage,
       kMaxShmBytes},
      {Var::kShmInlineBytes, "SHOAL_SHM_INLINE_BYTES", Kind::kInteger, "bytes", "32768",
       "The largest `shm` collective run on the calling thread when nothing is queued before it.",
       kPage, kMaxShmBytes},
      {Var::kShmSymmetricMinBytes, "SHOAL_SHM_SYMMETRIC_MIN_BYTES", Kind::kInteger, "bytes", "65536",
       "All-gathers and reduce-scatters of the `shm` backend larger than this (the full tensor) "
       "take the symmetric-memory way when their tensors are symmetric.",
       kPage, kMaxShmBytes},
      {Var::kShmSpinUs, "SHOAL_SHM_SPIN_US", Kind::kInteger, "microseconds", "20",
       "The most a wait of the `shm` backend spins before it yields.", 0, 1'000'000},
      {Var::kTuneMalloc, "SHOAL_TUNE_MALLOC", Kind::kFlag, "", "1",
       "`0` leaves glibc's malloc settings alone (Shoal raises its mmap, trim and top-pad "
       "thresholds so that freed memory is reused; a `MALLOC_*_` variable set by the user is kept "
       "either way)."},
      {Var::kLaunchExec, "SHOAL_LAUNCH_EXEC", Kind::kFlag, "", "0",
       "`1`: `shoal run` and `shoal train` start every worker with exec, also when the worker is "
       "`shoal` itself (started by fork alone otherwise)."},
      {Var::kPsNumServers, "SHOAL_PS_NUM_SERVERS", Kind::kInteger, "", "1",
       "Set by `shoal run --num-servers`: how many parameter servers the job has.", 1, kMaxCount},
      {Var::kPsNumWorkers, "SHOAL_PS_NUM_WORKERS", Kind::kInteger, "", "1",
       "Set by `shoal run --num-servers`: how many workers the parameter-server job has.", 1,
       kMaxCount},
      {Var::kPsHost, "SHOAL_PS_HOST", Kind::kText, "a host name or address", "`MASTER_ADDR`",
       "The address a parameter server listens on."},
      {Var::kSourceDir, "SHOAL_SOURCE_DIR", Kind::kText, "a folder", "found from the binary's place",
       "The source tree, where `shoal bench allreduce` finds `bench/allreduce_torch.py` for its "
       "`torch_gloo` contender."},
      {Var::kRestartCount, "TORCHELASTIC_RESTART_COUNT", Kind::kInteger, "", "0",
       "Set by `shoal run --max-restarts` and torchrun: how many times the workers were "
       "restarted; above 0, `shoal train` resumes from the newest checkpoint.", 0, kMaxCount},
      {Var::kGlooSocketIfname, "GLOO_SOCKET_IFNAME", Kind::kText, "a network interface (`eth0`)",
       "chosen by Gloo", "The network interface the `gloo` backend connects over, as in PyTorch."},
      {Var::kFtAgentStore, "SHOAL_FT_AGENT_STORE", Kind::kFlag, "", "0",
       "Set by `shoal run` for `shoal train --fault-tolerant`: the launcher serves the job's store "
       "at `MASTER_ADDR:MASTER_PORT` (else rank 0 does), so that any rank may die."},
      {Var::kFtSampleLog, "SHOAL_FT_SAMPLE_LOG", Kind::kText, "a path prefix", "none",
       "`shoal train --fault-tolerant`: each rank appends the samples of each step it trains, and "
       "which steps committed, to PATH.rankN (to check that every sample is trained on once)."},
  };
  return *rows;
}

std::string lower(std::string text) {
  for (char& c : text) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return text;
}

std::vector<std::string> choices(const Variable& row) {
  std::vector<std::string> out;
  std::istringstream in(row.values);
  for (std::string choice; std::getline(in, choice, '|');) out.push_back(choice);
  return out;
}

// What a value of `row` may be, for its error message and the table.
std::string accepted(const Variable& row, bool markdown) {
  const std::string q = markdown ? "`" : "";
  switch (row.kind) {
    case Kind::kText: return row.values;
    case Kind::kFlag: return q + "0" + q + " or " + q + "1" + q;
    case Kind::kDuration:
      return "milliseconds (" + q + "30000" + q + ", " + q + "500ms" + q + ") or seconds (" + q +
             "30s" + q + ")";
    case Kind::kInteger: {
      std::string text = std::to_string(row.min) + " to " + std::to_string(row.max);
      return row.values[0] == '\0' ? text : text + " " + row.values;
    }
    case Kind::kChoice: {
      std::string text;
      for (const std::string& choice : choices(row)) {
        text += (text.empty() ? "" : ", ") + q + choice + q;
      }
      return text;
    }
  }
  return "";
}

std::string without_quotes(std::string text) {
  text.erase(std::remove(text.begin(), text.end(), '`'), text.end());
  return text;
}

[[noreturn]] void reject(const Variable& row, const std::string& value) {
  SHOAL_THROW(InvalidArgument, row.name, "='", value, "' is not accepted: use ",
              accepted(row, false));
}

const Variable& expect(Var var, Kind kind) {
  const Variable& row = describe(var);
  SHOAL_CHECK_T(InvalidArgument, row.kind == kind, row.name, " is not read that way");
  return row;
}

std::optional<double> parse_number(const std::string& text) {
  errno = 0;
  char* end = nullptr;
  const double value = std::strtod(text.c_str(), &end);
  if (end == text.c_str() || *end != '\0' || errno != 0) return std::nullopt;
  return value;
}

}  // namespace

const std::vector<Variable>& variables() { return table(); }

const Variable& describe(Var var) {
  const Variable& row = table().at(static_cast<size_t>(var));
  SHOAL_CHECK(row.var == var, "the table of environment variables is out of the order of Var");
  return row;
}

std::optional<std::string> text(Var var) {
  const char* value = std::getenv(describe(var).name);
  if (value == nullptr || *value == '\0') return std::nullopt;
  return std::string(value);
}

std::optional<bool> flag_if_set(Var var) {
  const Variable& row = expect(var, Kind::kFlag);
  const auto value = text(var);
  if (!value) return std::nullopt;
  const std::string word = lower(*value);
  if (word == "1" || word == "true") return true;
  if (word == "0" || word == "false") return false;
  reject(row, *value);
}

bool flag(Var var) {
  return flag_if_set(var).value_or(std::string_view(describe(var).default_value) == "1");
}

std::optional<int64_t> integer(Var var) {
  const Variable& row = expect(var, Kind::kInteger);
  const auto value = text(var);
  if (!value) return std::nullopt;
  errno = 0;
  char* end = nullptr;
  const long long parsed = std::strtoll(value->c_str(), &end, 10);
  if (end == value->c_str() || *end != '\0' || errno != 0 || parsed < row.min || parsed > row.max) {
    reject(row, *value);
  }
  return static_cast<int64_t>(parsed);
}

std::optional<std::chrono::milliseconds> duration(Var var) {
  const Variable& row = expect(var, Kind::kDuration);
  const auto value = text(var);
  if (!value) return std::nullopt;
  std::string number = *value;
  double scale = 1.0;
  if (number.size() > 2 && number.compare(number.size() - 2, 2, "ms") == 0) {
    number.resize(number.size() - 2);
  } else if (number.size() > 1 && number.back() == 's') {
    number.pop_back();
    scale = 1000.0;
  }
  const auto parsed = parse_number(number);
  if (!parsed || !(*parsed > 0) || *parsed * scale > 1e15) reject(row, *value);
  return std::chrono::milliseconds(static_cast<int64_t>(*parsed * scale));
}

std::string choice(Var var) {
  const Variable& row = expect(var, Kind::kChoice);
  const auto value = text(var);
  if (!value) return row.default_value;
  const std::string word = lower(*value);
  for (const std::string& allowed : choices(row)) {
    if (word == allowed) return word;
  }
  reject(row, *value);
}

std::string listing() {
  std::string out;
  for (const Variable& row : table()) {
    out += std::string(row.name) + "\n    " + without_quotes(row.meaning) + "\n    values: " +
           without_quotes(accepted(row, false)) + "; default: " + without_quotes(row.default_value) +
           "\n";
  }
  return out;
}

std::string markdown_table() {
  std::string out = "| Variable | Values | Default | What it does |\n|---|---|---|---|\n";
  for (const Variable& row : table()) {
    // One word ("info", "20") is code; a phrase is prose, with its own code spans.
    const std::string fallback = row.default_value;
    const bool word = fallback.find_first_of(" `") == std::string::npos;
    out += "| `" + std::string(row.name) + "` | " + accepted(row, true) + " | " +
           (word ? "`" + fallback + "`" : fallback) + " | " + row.meaning + " |\n";
  }
  return out;
}

}  // namespace shoal::env
