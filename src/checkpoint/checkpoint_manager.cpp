#include "shoal/checkpoint/checkpoint_manager.h"

#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>
#include <csignal>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>

#include "checkpoint/atomic_file.h"
#include "log/error_file.h"
#include "shoal/checkpoint/sharded_checkpoint.h"
#include "shoal/comm/process_group.h"
#include "shoal/error.h"
#include "shoal/log.h"

namespace shoal::checkpoint {
namespace {

constexpr const char* kLatestFile = "latest";
constexpr const char* kExtension = ".pt";

/// Numbered checkpoints in `dir` (files and sharded folders), ascending by number.
std::vector<std::pair<int64_t, std::string>> numbered(const std::string& dir, const std::string& prefix) {
  std::vector<std::pair<int64_t, std::string>> out;
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) return out;
  while (dirent* entry = ::readdir(d)) {
    const std::string name = entry->d_name;
    // "<prefix>N.pt" files and "<prefix>N.sharded" folders (sharded checkpoints) share numbers.
    auto ends_with = [&](const std::string& ext) {
      return name.size() > prefix.size() + ext.size() &&
             name.compare(name.size() - ext.size(), ext.size(), ext) == 0;
    };
    const std::string ext = ends_with(kExtension) ? kExtension
                            : ends_with(kShardedExtension) ? kShardedExtension
                                                           : "";
    if (ext.empty() || name.compare(0, prefix.size(), prefix) != 0) continue;
    const std::string digits = name.substr(prefix.size(), name.size() - prefix.size() - ext.size());
    if (digits.empty() || !std::all_of(digits.begin(), digits.end(), ::isdigit)) continue;
    out.emplace_back(std::stoll(digits), name);
  }
  ::closedir(d);
  std::sort(out.begin(), out.end());
  return out;
}

bool is_file(const std::string& path) {
  struct stat info {};
  return ::stat(path.c_str(), &info) == 0 && S_ISREG(info.st_mode);
}

/// A numbered checkpoint's name: "<prefix>000012<extension>".
std::string checkpoint_name(const std::string& prefix, int64_t number, const char* extension) {
  char digits[64];
  std::snprintf(digits, sizeof(digits), "%06lld", static_cast<long long>(number));
  return prefix + digits + extension;
}

/// The name "latest" points at, or "" when it names nothing readable.
std::string latest_name(const std::string& dir) {
  std::ifstream pointer(dir + "/" + kLatestFile);
  std::string name;
  if (!pointer || !std::getline(pointer, name) || name.find('/') != std::string::npos) return "";
  return name;
}

bool is_sharded_name(const std::string& name) {
  const size_t n = std::strlen(kShardedExtension);
  return name.size() > n && name.compare(name.size() - n, n, kShardedExtension) == 0;
}

/// Sharded folders of saves that never completed: no manifest, and newer than the checkpoint
/// "latest" names (without one, than the newest complete checkpoint). A save killed mid-way
/// leaves such a folder; it is never resumed from. An older Shoal's folders (no manifest) at or
/// below that checkpoint count as complete.
std::set<std::string> abandoned_folders(const std::string& dir, const std::string& prefix) {
  const auto all = numbered(dir, prefix);
  const std::string latest = latest_name(dir);
  int64_t reference = -1;
  for (const auto& [number, name] : all) {
    if (name == latest) reference = number;
  }
  if (reference < 0) {
    for (const auto& [number, name] : all) {
      const bool complete = is_sharded_name(name) ? has_sharded_manifest(dir + "/" + name)
                                                  : is_file(dir + "/" + name);
      if (complete) reference = number;
    }
  }
  std::set<std::string> out;
  for (const auto& [number, name] : all) {
    if (number > reference && is_sharded_name(name) && !has_sharded_manifest(dir + "/" + name)) {
      out.insert(name);
    }
  }
  return out;
}

/// Deletes the folders of interrupted sharded saves, their temporary files with them.
void remove_abandoned_folders(const std::string& dir, const std::string& prefix) {
  for (const auto& name : abandoned_folders(dir, prefix)) {
    log::info("shoal: removing ", dir, "/", name, ": an interrupted save (no manifest)");
    detail::remove_tree(dir + "/" + name);
  }
}

/// Deletes the oldest checkpoints (files or sharded folders) beyond `keep`, never `current`; only
/// complete checkpoints count.
void remove_old_checkpoints(const std::string& dir, const std::string& prefix, int keep,
                            const std::string& current) {
  if (keep <= 0) return;
  const auto abandoned = abandoned_folders(dir, prefix);
  std::vector<std::string> complete;
  for (const auto& [number, name] : numbered(dir, prefix)) {
    if (abandoned.count(name) == 0) complete.push_back(name);
  }
  for (size_t i = 0; i + static_cast<size_t>(keep) < complete.size(); ++i) {
    if (complete[i] == current) continue;
    detail::remove_tree(dir + "/" + complete[i]);
  }
}

/// Every rank's chunk places summed into one tensor: [0] the ranks that failed, then rank r's
/// (offset, length) pairs at its own slots (zeros elsewhere).
at::Tensor gather_places(const ShardedTrainingState& mine, const std::vector<int64_t>& places, bool failed,
                         comm::ProcessGroup* pg) {
  int64_t total = 1;
  int64_t start = 1;
  for (int64_t r = 0; r < mine.world_size; ++r) {
    if (r == mine.rank) start = total;
    total += 2 * dcp_chunk_count(mine, r);
  }
  at::Tensor out = at::zeros({total}, at::kLong);
  out[0] = failed ? 1 : 0;
  if (!failed && static_cast<int64_t>(places.size()) == 2 * dcp_chunk_count(mine, mine.rank)) {
    out.narrow(0, start, static_cast<int64_t>(places.size())).copy_(at::tensor(places, at::kLong));
  } else {
    out[0] = 1;
  }
  if (pg != nullptr) pg->allreduce(out)->wait();
  return out;
}

/// The pairs of each rank, from gather_places' tensor.
std::vector<std::vector<int64_t>> split_places(const ShardedTrainingState& mine, const at::Tensor& gathered) {
  std::vector<std::vector<int64_t>> out;
  int64_t next = 1;
  for (int64_t r = 0; r < mine.world_size; ++r) {
    const int64_t n = 2 * dcp_chunk_count(mine, r);
    const at::Tensor part = gathered.narrow(0, next, n).contiguous();
    out.emplace_back(part.data_ptr<int64_t>(), part.data_ptr<int64_t>() + n);
    next += n;
  }
  return out;
}

void make_directories(const std::string& dir) {
  std::string partial;
  for (size_t i = 0; i <= dir.size(); ++i) {
    if (i == dir.size() || (dir[i] == '/' && i > 0)) {
      partial = dir.substr(0, i);
      if (::mkdir(partial.c_str(), 0755) != 0 && errno != EEXIST) {
        SHOAL_THROW(CheckpointError, "cannot create the checkpoint folder ", partial, ": ", std::strerror(errno));
      }
    }
  }
}

/// Removes temporary files ("<dir>/.<prefix>....tmp.<pid>", "<dir>/.latest.tmp.<pid>") left by
/// writers that died mid-save; files of a live process are left alone.
void remove_stale_temporaries(const std::string& dir, const std::string& prefix) {
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) return;
  std::vector<std::string> stale;
  const std::string start = "." + prefix;
  while (dirent* entry = ::readdir(d)) {
    const std::string name = entry->d_name;
    const size_t tmp = name.rfind(".tmp.");
    const std::string latest = std::string(".") + kLatestFile + ".";
    const bool ours = name.compare(0, start.size(), start) == 0 ||
                      name.compare(0, latest.size(), latest) == 0;
    if (!ours || tmp == std::string::npos) continue;
    const std::string pid = name.substr(tmp + 5);
    if (pid.empty() || !std::all_of(pid.begin(), pid.end(), ::isdigit)) continue;
    const pid_t owner = static_cast<pid_t>(std::stoll(pid));
    if (owner != ::getpid() && ::kill(owner, 0) != 0 && errno == ESRCH) stale.push_back(name);
  }
  ::closedir(d);
  for (const auto& name : stale) ::unlink((dir + "/" + name).c_str());
}

}  // namespace

std::optional<std::string> find_latest(const std::string& dir, const std::string& prefix) {
  // A pointer that is not a regular file (a FIFO would block open()) is ignored like a missing one.
  std::ifstream pointer;
  if (is_file(dir + "/" + kLatestFile)) pointer.open(dir + "/" + kLatestFile);
  std::string name;
  if (pointer && std::getline(pointer, name) && !name.empty() && name.find('/') == std::string::npos &&
      (is_file(dir + "/" + name) || is_directory(dir + "/" + name))) {
    return dir + "/" + name;
  }
  const auto files = numbered(dir, prefix);
  if (files.empty()) return std::nullopt;
  return dir + "/" + files.back().second;
}

std::optional<ResumePoint> load_latest_intact(const std::string& dir, const LoadOptions& options,
                                              const std::string& prefix) {
  std::vector<std::string> candidates;
  if (auto latest = find_latest(dir, prefix)) candidates.push_back(*latest);
  const auto files = numbered(dir, prefix);
  for (auto it = files.rbegin(); it != files.rend(); ++it) {
    const std::string path = dir + "/" + it->second;
    if (std::find(candidates.begin(), candidates.end(), path) == candidates.end()) candidates.push_back(path);
  }
  if (candidates.empty()) return std::nullopt;
  ResumePoint point;
  for (const auto& path : candidates) {
    try {
      point.state = load_training_state(path, options);
      point.path = path;
      return point;
    } catch (const CheckpointError& e) {
      // The message already names the file.
      point.skipped.push_back(e.what());
    }
  }
  std::string all;
  for (const auto& why : point.skipped) all += "\n  " + why;
  SHOAL_THROW(CheckpointError, "no intact checkpoint in ", dir, " (", point.skipped.size(),
              " tried, newest first):", all);
}

CheckpointManager::CheckpointManager(std::string dir, CheckpointManagerOptions options)
    : dir_(std::move(dir)), options_(std::move(options)) {
  SHOAL_CHECK_T(InvalidArgument, !dir_.empty(), "the checkpoint folder must not be empty");
  SHOAL_CHECK_T(InvalidArgument, options_.keep_last >= 0, "keep_last must be >= 0, got ", options_.keep_last);
  while (dir_.size() > 1 && dir_.back() == '/') dir_.pop_back();
}

CheckpointManager::CheckpointManager(std::string dir, int keep_last)
    : CheckpointManager(std::move(dir), CheckpointManagerOptions{keep_last}) {}

std::vector<std::string> CheckpointManager::list() const {
  std::vector<std::string> out;
  for (const auto& [number, name] : numbered(dir_, options_.prefix)) out.push_back(dir_ + "/" + name);
  return out;
}

std::optional<std::string> CheckpointManager::latest_path() const {
  return find_latest(dir_, options_.prefix);
}

std::optional<TrainingState> CheckpointManager::load_latest(const LoadOptions& options) const {
  auto point = load_latest_intact(dir_, options, options_.prefix);
  if (!point) return std::nullopt;
  for (const auto& why : point->skipped) {
    log::warn("shoal: skipping an unreadable checkpoint: ", why);
  }
  if (!point->skipped.empty()) log::warn("shoal: resuming from ", point->path, " instead");
  return std::move(point->state);
}

std::string CheckpointManager::write(const TrainingState& state) {
  make_directories(dir_);
  remove_stale_temporaries(dir_, options_.prefix);
  const auto existing = numbered(dir_, options_.prefix);
  const int64_t number = existing.empty() ? 0 : existing.back().first + 1;
  const std::string file = checkpoint_name(options_.prefix, number, kExtension);
  const std::string path = dir_ + "/" + file;
  remove_abandoned_folders(dir_, options_.prefix);

  TrainingState copy = state;
  if (copy.shoal_version.empty()) copy.shoal_version = version();
  save_training_state(copy, path);
  detail::write_file_atomically(dir_ + "/" + kLatestFile, file + "\n");

  remove_old_checkpoints(dir_, options_.prefix, options_.keep_last, file);
  log::debug("shoal: saved checkpoint ", path, " (epoch ", copy.epoch, ", step ", copy.step, ")");
  return path;
}

std::string CheckpointManager::save(const TrainingState& state, comm::ProcessGroup* pg) {
  if (pg == nullptr || pg->size() == 1) return write(state);
  std::string path;
  std::string error;
  if (pg->rank() == 0) {
    try {
      path = write(state);
    } catch (const std::exception& e) {
      error = e.what();
      log::note_failure();  // before the broadcast that makes the others fail
    }
  }
  // Rank 0 tells everyone whether the write succeeded, and which number it got; this also holds
  // the other ranks until the file is complete.
  at::Tensor outcome = at::zeros({2}, at::kLong);
  if (pg->rank() == 0) {
    outcome[0] = error.empty() ? 1 : 0;
    if (error.empty()) {
      const auto files = numbered(dir_, options_.prefix);
      outcome[1] = files.empty() ? 0 : files.back().first;
    }
  }
  pg->broadcast(outcome)->wait();
  if (pg->rank() == 0) {
    if (!error.empty()) SHOAL_THROW(CheckpointError, error);
    return path;
  }
  SHOAL_CHECK_T(CheckpointError, outcome[0].item<int64_t>() == 1, pg->rank_prefix(),
                " rank 0 failed to save the checkpoint in ", dir_, " (see rank 0's error)");
  return dir_ + "/" + checkpoint_name(options_.prefix, outcome[1].item<int64_t>(), kExtension);
}

std::string CheckpointManager::save_sharded(const ShardedTrainingState& state,
                                            comm::ProcessGroup* pg) {
  const bool alone = pg == nullptr || pg->size() == 1;
  const int rank = alone ? 0 : pg->rank();
  SHOAL_CHECK_T(InvalidArgument, state.rank == rank && state.world_size == (alone ? 1 : pg->size()),
                "save_sharded: the state is rank ", state.rank, " of ", state.world_size,
                "'s, this process is rank ", rank, " of ", alone ? 1 : pg->size());
  // Rank 0 picks the number (one past every file and folder present, complete or not, so that
  // an interrupted save's folder is never reused) and the save's id, removes the folders of
  // interrupted saves, and everyone writes its file into the new folder.
  std::string error;
  at::Tensor chosen = at::zeros({2}, at::kLong);  // number (-1: failed), save id
  if (rank == 0) {
    try {
      make_directories(dir_);
      remove_stale_temporaries(dir_, options_.prefix);
      const auto existing = numbered(dir_, options_.prefix);
      chosen[0] = existing.empty() ? 0 : existing.back().first + 1;
      chosen[1] = new_save_id();
      remove_abandoned_folders(dir_, options_.prefix);
    } catch (const std::exception& e) {
      error = e.what();
      chosen[0] = -1;
    }
  }
  if (!alone) pg->broadcast(chosen)->wait();
  const int64_t number = chosen[0].item<int64_t>();
  if (number < 0) {
    SHOAL_CHECK_T(CheckpointError, rank != 0, error);
    SHOAL_THROW(CheckpointError, pg->rank_prefix(), " rank 0 cannot save the sharded checkpoint in ",
                dir_, " (see rank 0's error)");
  }
  const std::string name = checkpoint_name(options_.prefix, number, kShardedExtension);
  const std::string folder = dir_ + "/" + name;
  ShardedTrainingState mine = state;  // tensors shared, not copied
  mine.save_id = chosen[1].item<int64_t>();
  std::vector<int64_t> places;
  try {
    make_directories(folder);
    places = save_dcp_shard(mine, folder);
  } catch (const std::exception& e) {
    error = e.what();
  }
  // Every rank's file complete, or none counts: the ranks that failed, summed, and where each
  // rank's chunks lie (rank 0 writes them into .metadata), each rank in its own slots.
  const at::Tensor gathered = gather_places(mine, places, !error.empty(), alone ? nullptr : pg);
  at::Tensor failed = gathered.narrow(0, 0, 1).clone();
  if (failed[0].item<int64_t>() == 0 && rank == 0) {
    try {
      write_dcp_sharded_metadata(mine, folder, split_places(mine, gathered));
      detail::write_file_atomically(dir_ + "/" + kLatestFile, name + "\n");
      remove_old_checkpoints(dir_, options_.prefix, options_.keep_last, name);
    } catch (const std::exception& e) {
      error = e.what();
      failed[0] = 1;
    }
  } else if (failed[0].item<int64_t>() != 0 && rank == 0) {
    // An incomplete folder is never resumed from: remove it ("latest" still names the previous).
    detail::remove_tree(folder);
  }
  // Everyone returns once "latest" names the new checkpoint (or everyone throws).
  if (!alone) pg->broadcast(failed)->wait();
  if (!error.empty()) SHOAL_THROW(CheckpointError, error);
  SHOAL_CHECK_T(CheckpointError, failed[0].item<int64_t>() == 0, pg->rank_prefix(),
                " another rank failed to save its part of the sharded checkpoint ", folder,
                " (see its error); the previous checkpoint is kept");
  log::debug("shoal: saved sharded checkpoint ", folder, " (epoch ", state.replicated.epoch,
             ", step ", state.replicated.step, ")");
  return folder;
}

}  // namespace shoal::checkpoint
