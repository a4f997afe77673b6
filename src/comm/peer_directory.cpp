#include "comm/peer_directory.h"

#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <fstream>
#include <sstream>

#include "shoal/error.h"

namespace shoal::comm {

std::string local_hostname() {
  char name[256] = {0};
  if (gethostname(name, sizeof name - 1) != 0) return "localhost";
  return name;
}

bool process_is_gone(int pid) {
  if (pid <= 0) return false;
  if (kill(pid, 0) != 0 && errno == ESRCH) return true;
  // A killed process whose parent has not reaped it yet still answers kill(); it is a zombie.
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(stat, line)) return true;
  const auto close = line.rfind(')');
  return close != std::string::npos && close + 2 < line.size() && line[close + 2] == 'Z';
}

bool process_is_stopped(int pid) {
  if (pid <= 0) return false;
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(stat, line)) return false;
  const auto close = line.rfind(')');
  return close != std::string::npos && close + 2 < line.size() &&
         (line[close + 2] == 'T' || line[close + 2] == 't');
}

namespace {

// Records joined as "length:bytes" each, so that any byte may appear in one.
std::string join_records(const std::vector<std::vector<uint8_t>>& records) {
  std::string out;
  for (const auto& r : records) out += std::to_string(r.size()) + ":" + std::string(r.begin(), r.end());
  return out;
}

std::vector<std::string> split_records(const std::string& joined, size_t count, const std::string& key) {
  std::vector<std::string> out;
  size_t at = 0;
  while (out.size() < count && at < joined.size()) {
    const size_t colon = joined.find(':', at);
    if (colon == std::string::npos) break;
    const size_t length = std::strtoull(joined.c_str() + at, nullptr, 10);
    if (length > joined.size() - colon - 1) break;
    out.push_back(joined.substr(colon + 1, length));
    at = colon + 1 + length;
  }
  SHOAL_CHECK_T(PeerError, out.size() == count && at == joined.size(), "store key '", key, "' holds ",
                out.size(), " records where ", count,
                " were expected: every rank must run the same Shoal build and group size");
  return out;
}

}  // namespace

std::vector<std::string> gather_records(Store& store, const std::string& scope, int rank, int size,
                                        const std::string& mine) {
  store.set_string(scope + "/" + std::to_string(rank), mine);
  const std::string all = scope + "/all";
  if (rank == 0) {
    std::vector<std::string> keys;
    for (int r = 0; r < size; ++r) keys.push_back(scope + "/" + std::to_string(r));
    store.set_string(all, join_records(store.multi_get(keys)));
  }
  return split_records(store.get_string(all), static_cast<size_t>(size), all);
}

PeerDirectory::PeerDirectory(std::shared_ptr<Store> store, std::string scope, int rank, int size)
    : store_(std::move(store)),
      scope_(std::move(scope)),
      rank_(rank),
      size_(size),
      host_(local_hostname()),
      entries_(size) {
  entries_[rank].host = host_;
  entries_[rank].pid = static_cast<int>(getpid());
  entries_[rank].known = true;
  store_->set_string(scope_ + "/peer/" + std::to_string(rank),
                     host_ + " " + std::to_string(getpid()));
}

void PeerDirectory::load(Milliseconds budget) {
  for (int r = 0; r < size_; ++r) {
    if (entries_[r].known || store_unreachable_) continue;
    const std::string key = scope_ + "/peer/" + std::to_string(r);
    try {
      store_->wait({key}, budget);
      std::istringstream in(store_->get_string(key));
      in >> entries_[r].host >> entries_[r].pid;
      entries_[r].known = true;
    } catch (const TimeoutError&) {
      // Not published yet: that rank never joined this group.
    } catch (const Error&) {
      store_unreachable_ = true;
    }
  }
}

std::string PeerDirectory::describe(int rank) {
  std::lock_guard<std::mutex> lock(mutex_);
  load(Milliseconds(200));
  const auto& e = entries_[rank];
  if (!e.known) return "?";
  return e.host + ":" + std::to_string(e.pid);
}

bool PeerDirectory::is_dead(int rank) {
  std::lock_guard<std::mutex> lock(mutex_);
  load(Milliseconds(200));
  const auto& e = entries_[rank];
  return e.known && e.host == host_ && process_is_gone(e.pid);
}

std::string PeerDirectory::diagnose(uint64_t sequence, Milliseconds budget) {
  std::lock_guard<std::mutex> lock(mutex_);
  load(std::min(budget, Milliseconds(500)));

  std::vector<std::string> blamed;
  for (int r = 0; r < size_; ++r) {
    const auto& e = entries_[r];
    if (r != rank_ && e.known && e.host == host_ && process_is_gone(e.pid)) {
      blamed.push_back(detail::str_cat("rank ", r, " (host ", e.host, ", pid ", e.pid,
                                       ": the process has exited)"));
    }
  }
  if (blamed.empty() && store_unreachable_) {
    blamed.push_back("rank 0 (it serves the store, which is unreachable: it has probably exited)");
  }
  if (blamed.empty()) {
    // Nobody visibly dead: every rank that sees the failure reports it; the silent ones are stuck
    // or gone on another host.
    const std::string base = scope_ + "/failed/" + std::to_string(sequence) + "/";
    try {
      store_->set_string(base + std::to_string(rank_), "1");
      const auto deadline = std::chrono::steady_clock::now() + budget;
      std::vector<int> silent;
      for (int r = 0; r < size_; ++r) {
        if (r == rank_) continue;
        auto left = std::chrono::duration_cast<Milliseconds>(deadline -
                                                             std::chrono::steady_clock::now());
        if (left.count() < 1) left = Milliseconds(1);
        try {
          store_->wait({base + std::to_string(r)}, left);
        } catch (const TimeoutError&) {
          silent.push_back(r);
        }
      }
      for (int r : silent) {
        const auto& e = entries_[r];
        blamed.push_back(e.known ? detail::str_cat("rank ", r, " (host ", e.host, ", pid ", e.pid,
                                                   ": did not reach this operation)")
                                 : detail::str_cat("rank ", r, " (never joined the group)"));
      }
    } catch (const Error&) {
      blamed.push_back("rank 0 (it serves the store, which is unreachable: it has probably exited)");
    }
  }
  std::string out;
  for (const auto& b : blamed) out += (out.empty() ? "" : ", ") + b;
  return out;
}

}  // namespace shoal::comm
