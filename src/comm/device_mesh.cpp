#include "shoal/comm/device_mesh.h"

#include <set>
#include <sstream>

#include "shoal/comm/process_group.h"
#include "shoal/error.h"

namespace shoal::comm {
namespace {

/// The rank distance between neighbours along each dimension (row-major: the last is 1).
std::vector<int64_t> strides_of(const std::vector<MeshDimension>& dimensions) {
  std::vector<int64_t> strides(dimensions.size(), 1);
  for (size_t d = dimensions.size(); d-- > 1;) strides[d - 1] = strides[d] * dimensions[d].second;
  return strides;
}

std::string mesh_description(const std::vector<MeshDimension>& dimensions) {
  std::ostringstream text;
  for (size_t d = 0; d < dimensions.size(); ++d) {
    text << (d ? "," : "") << dimensions[d].first << "=" << dimensions[d].second;
  }
  return text.str();
}

void check_dimensions(const std::vector<MeshDimension>& dimensions, int world_size) {
  SHOAL_CHECK_T(InvalidArgument, !dimensions.empty(), "DeviceMesh: the mesh has no dimensions");
  std::set<std::string> names;
  int64_t product = 1;
  for (const auto& [name, size] : dimensions) {
    SHOAL_CHECK_T(InvalidArgument, !name.empty(), "DeviceMesh: a dimension has no name (",
                  mesh_description(dimensions), ")");
    SHOAL_CHECK_T(InvalidArgument, names.insert(name).second, "DeviceMesh: dimension '", name,
                  "' appears twice in ", mesh_description(dimensions));
    SHOAL_CHECK_T(InvalidArgument, size >= 1 && size <= world_size, "DeviceMesh: dimension '", name,
                  "' has size ", size, "; sizes must be in [1, ", world_size, "]");
    product *= size;
  }
  SHOAL_CHECK_T(InvalidArgument, product == world_size, "DeviceMesh: the mesh ",
                mesh_description(dimensions), " holds ", product, " ranks but the job has ",
                world_size, "; the sizes' product must equal the world size");
}

}  // namespace

DeviceMesh::DeviceMesh(std::shared_ptr<ProcessGroup> world, std::vector<MeshDimension> dimensions)
    : world_(std::move(world)), dimensions_(std::move(dimensions)) {
  SHOAL_CHECK_T(InvalidArgument, world_ != nullptr, "DeviceMesh: the world group is null");
  check_dimensions(dimensions_, world_->size());
  const std::vector<int64_t> strides = strides_of(dimensions_);
  for (size_t d = 0; d < dimensions_.size(); ++d) {
    coordinate_.push_back(world_->rank() / strides[d] % dimensions_[d].second);
  }
  // Every rank builds every slice's group in the same order (new_group's rule): dimension by
  // dimension, each slice named by its lowest rank.
  groups_.resize(dimensions_.size());
  for (size_t d = 0; d < dimensions_.size(); ++d) {
    for (int first = 0; first < world_->size(); ++first) {
      if (first / strides[d] % dimensions_[d].second != 0) continue;
      std::vector<int> ranks;
      for (int64_t k = 0; k < dimensions_[d].second; ++k) {
        ranks.push_back(static_cast<int>(first + k * strides[d]));
      }
      if (auto group = world_->new_group(ranks)) groups_[d] = std::move(group);
    }
  }
}

size_t DeviceMesh::index_of(const std::string& dimension) const {
  for (size_t d = 0; d < dimensions_.size(); ++d) {
    if (dimensions_[d].first == dimension) return d;
  }
  SHOAL_THROW(InvalidArgument, "DeviceMesh: no dimension named '", dimension, "' in the mesh ",
              mesh_description(dimensions_));
}

std::shared_ptr<ProcessGroup> DeviceMesh::get_group(const std::string& dimension) const {
  return groups_[index_of(dimension)];
}

int64_t DeviceMesh::size(const std::string& dimension) const {
  return dimensions_[index_of(dimension)].second;
}

int64_t DeviceMesh::size() const { return world_->size(); }

int64_t DeviceMesh::get_local_rank(const std::string& dimension) const {
  return coordinate_[index_of(dimension)];
}

std::vector<std::string> DeviceMesh::dim_names() const {
  std::vector<std::string> names;
  for (const auto& dimension : dimensions_) names.push_back(dimension.first);
  return names;
}

DeviceMesh init_device_mesh(std::shared_ptr<ProcessGroup> world,
                            std::vector<MeshDimension> dimensions) {
  return DeviceMesh(std::move(world), std::move(dimensions));
}

std::vector<MeshDimension> parse_mesh(const std::string& text, const std::string& flag) {
  std::vector<MeshDimension> dimensions;
  std::istringstream items(text);
  std::string item;
  std::set<std::string> names;
  while (std::getline(items, item, ',')) {
    const size_t equals = item.find('=');
    const std::string name = item.substr(0, equals);
    const std::string size = equals == std::string::npos ? "" : item.substr(equals + 1);
    const bool digits = !size.empty() && size.size() <= 6 &&
                        size.find_first_not_of("0123456789") == std::string::npos;
    SHOAL_CHECK_T(InvalidArgument, !name.empty() && digits && std::stoll(size) >= 1, flag,
                  " takes name=size pairs separated by commas (e.g. dp=2,tp=2), got '", text, "'");
    SHOAL_CHECK_T(InvalidArgument, names.insert(name).second, flag, ": dimension '", name,
                  "' appears twice in '", text, "'");
    dimensions.emplace_back(name, std::stoll(size));
  }
  SHOAL_CHECK_T(InvalidArgument, !dimensions.empty(), flag,
                " takes name=size pairs separated by commas (e.g. dp=2,tp=2), got '", text, "'");
  return dimensions;
}

}  // namespace shoal::comm
