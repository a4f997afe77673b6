// DeviceMesh: the job's ranks arranged as an N-dimensional array with named dimensions, and a
// process group for every slice along each dimension; the counterpart of PyTorch's DeviceMesh
// (torch.distributed.device_mesh.init_device_mesh).
//
//   auto mesh = shoal::comm::DeviceMesh(world, {{"dp", 2}, {"tp", 2}});
//   auto tp = mesh.get_group("tp");    // the ranks that differ from this one only in "tp"
//   int64_t dp_rank = mesh.get_local_rank("dp");
//
// Ranks are laid out row-major, as PyTorch's: the last dimension varies fastest, so with
// {{"dp", 2}, {"tp", 2}} the tp groups are {0, 1} and {2, 3} and the dp groups {0, 2} and {1, 3}.
// Every group is built once, in the constructor, with ProcessGroup::new_group on the job's group
// (so on its backend): a collective, which every rank of that group runs with the same dimensions.
//
// Thread safety: immutable after construction; the groups it hands out follow process_group.h.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace shoal::comm {

class ProcessGroup;

/// A named dimension of a mesh and its size.
using MeshDimension = std::pair<std::string, int64_t>;

class DeviceMesh {
 public:
  /// Arranges `world`'s ranks as `dimensions` (outermost first). InvalidArgument when the sizes'
  /// product is not world->size(), a size is below 1, or a name is empty or repeats.
  DeviceMesh(std::shared_ptr<ProcessGroup> world, std::vector<MeshDimension> dimensions);

  /// The group of this rank's slice along `dimension` (InvalidArgument for an unknown name).
  std::shared_ptr<ProcessGroup> get_group(const std::string& dimension) const;
  /// This rank's index along every dimension, outermost first.
  std::vector<int64_t> get_coordinate() const { return coordinate_; }
  /// The size of `dimension`.
  int64_t size(const std::string& dimension) const;
  /// The number of ranks in the mesh (the world's size).
  int64_t size() const;
  /// This rank's index along `dimension` (its rank in get_group(dimension)).
  int64_t get_local_rank(const std::string& dimension) const;
  /// The dimensions' names, outermost first.
  std::vector<std::string> dim_names() const;
  /// The group the mesh was built on.
  const std::shared_ptr<ProcessGroup>& world() const { return world_; }

 private:
  size_t index_of(const std::string& dimension) const;

  std::shared_ptr<ProcessGroup> world_;
  std::vector<MeshDimension> dimensions_;
  std::vector<int64_t> coordinate_;
  std::vector<std::shared_ptr<ProcessGroup>> groups_;  ///< one per dimension: this rank's slice
};

/// PyTorch's init_device_mesh: DeviceMesh(world, dimensions).
DeviceMesh init_device_mesh(std::shared_ptr<ProcessGroup> world,
                            std::vector<MeshDimension> dimensions);

/// Parses "dp=2,tp=2" into dimensions; InvalidArgument naming `flag` when the text is not a
/// comma-separated list of name=size with sizes >= 1 and distinct names.
std::vector<MeshDimension> parse_mesh(const std::string& text, const std::string& flag = "--mesh");

}  // namespace shoal::comm
