// PeerDirectory: who each rank is (host, pid), and who is to blame when an operation fails.
//
// At group creation every rank publishes "host pid" under its rank in the store. When an
// operation fails or times out, diagnose() names the peer at fault: a peer on this host whose
// process has exited, or else the peers that did not report the same failure through the store
// within a short budget. Backends use the result in their error messages.
//
// Thread safety: diagnose() may be called from several threads.
#pragma once

#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "shoal/comm/store.h"

namespace shoal::comm {

class PeerDirectory {
 public:
  /// Publishes this rank's entry; `scope` keeps groups sharing a store apart.
  PeerDirectory(std::shared_ptr<Store> store, std::string scope, int rank, int size);

  /// "rank 3 (host node1, pid 4242: the process has exited)"; empty when nobody can be blamed.
  /// `sequence` identifies the failed operation for the check-in; waits at most `budget`.
  std::string diagnose(uint64_t sequence, Milliseconds budget);

  /// "host:pid" of a rank, "?" when unknown.
  std::string describe(int rank);

  /// True when `rank` runs on this host and its process is gone (exited or a zombie).
  bool is_dead(int rank);

 private:
  struct Entry {
    std::string host;
    int pid = 0;
    bool known = false;
  };
  void load(Milliseconds budget);

  std::shared_ptr<Store> store_;
  std::string scope_;
  int rank_;
  int size_;
  std::string host_;
  std::mutex mutex_;
  std::vector<Entry> entries_;
  bool store_unreachable_ = false;
};

/// True when process `pid` on this host has exited or is a zombie (killed, not yet reaped).
bool process_is_gone(int pid);

/// True when process `pid` (on this host) is stopped: SIGSTOP, Ctrl-Z (SIGTSTP) or a debugger.
/// A stopped peer is alive to kill() but will not answer until continued.
bool process_is_stopped(int pid);

/// This machine's host name.
std::string local_hostname();

/// Every rank's `mine`, in rank order, with O(1) store requests per rank: each rank sets its own
/// key "scope/R", rank 0 reads them all in one batch and publishes them as one record "scope/all",
/// which the others read (each wait up to the store's time-out).
std::vector<std::string> gather_records(Store& store, const std::string& scope, int rank, int size,
                                        const std::string& mine);

}  // namespace shoal::comm
