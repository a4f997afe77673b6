// TempDir: a private folder under $TMPDIR (or /tmp) that is removed, with everything in it, when
// the object goes (after an exception too): where a launch keeps its workers' error files and a
// benchmark its stores and checkpoints.
//
// Thread safety: one object per thread. A forked child that ends with _exit never removes its
// parent's folder.
#pragma once

#include <stdlib.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <string>

#include "checkpoint/atomic_file.h"
#include "shoal/error.h"

namespace shoal::checkpoint::detail {

class TempDir {
 public:
  /// Makes $TMPDIR/<prefix>XXXXXX (mkdtemp: a new name, mode 0700). Throws shoal::Error naming
  /// `what` the folder is for when it cannot be made.
  TempDir(const std::string& prefix, const std::string& what) {
    const char* tmp = std::getenv("TMPDIR");
    std::string pattern =
        std::string(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp") + "/" + prefix + "XXXXXX";
    SHOAL_CHECK(::mkdtemp(pattern.data()) != nullptr, "cannot create a folder for ", what, " (",
                pattern, "): ", std::strerror(errno), "; set TMPDIR");
    path_ = pattern;
  }
  ~TempDir() { remove_tree(path_); }  // not std::filesystem::remove_all: see atomic_file.h
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  const std::string& path() const { return path_; }
  /// path()/name.
  std::string file(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

}  // namespace shoal::checkpoint::detail
