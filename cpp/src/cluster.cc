#include "zellige/cluster.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>

namespace zellige {

bool Cluster::heterogeneous() const {
  for (double speed : rank_speeds) {
    if (speed != 1.0) return true;
  }
  for (int64_t bytes : rank_memory_bytes) {
    if (bytes != gpu_memory_bytes) return true;
  }
  return false;
}

int64_t Cluster::min_memory_bytes() const {
  if (rank_memory_bytes.empty()) return gpu_memory_bytes;
  return *std::min_element(rank_memory_bytes.begin(), rank_memory_bytes.end());
}

double Cluster::total_speed() const {
  if (rank_speeds.empty()) return static_cast<double>(num_ranks());
  double total = 0;
  for (double speed : rank_speeds) total += speed;
  return total;
}

double Cluster::max_speed() const {
  if (rank_speeds.empty()) return 1.0;
  return *std::max_element(rank_speeds.begin(), rank_speeds.end());
}

void validate_cluster(const Cluster& cluster) {
  const int64_t num_ranks = cluster.num_ranks();
  const auto size_error = [&](const char* field, size_t size) {
    return std::invalid_argument(std::string("cluster: ") + field + " has " +
                                 std::to_string(size) + " entries, want 0 or one per rank (" +
                                 std::to_string(num_ranks) + ")");
  };
  if (!cluster.rank_speeds.empty() &&
      static_cast<int64_t>(cluster.rank_speeds.size()) != num_ranks) {
    throw size_error("rank_speeds", cluster.rank_speeds.size());
  }
  if (!cluster.rank_memory_bytes.empty() &&
      static_cast<int64_t>(cluster.rank_memory_bytes.size()) != num_ranks) {
    throw size_error("rank_memory_bytes", cluster.rank_memory_bytes.size());
  }
  for (size_t rank = 0; rank < cluster.rank_speeds.size(); ++rank) {
    const double speed = cluster.rank_speeds[rank];
    if (!(speed > 0) || !std::isfinite(speed)) {
      throw std::invalid_argument("cluster: rank_speeds[" + std::to_string(rank) +
                                  "] must be positive and finite, got " + std::to_string(speed));
    }
  }
  for (size_t rank = 0; rank < cluster.rank_memory_bytes.size(); ++rank) {
    if (cluster.rank_memory_bytes[rank] <= 0) {
      throw std::invalid_argument("cluster: rank_memory_bytes[" + std::to_string(rank) +
                                  "] must be positive, got " +
                                  std::to_string(cluster.rank_memory_bytes[rank]));
    }
  }
}

Cluster homogeneous_view(const Cluster& cluster) {
  Cluster view = cluster;
  view.gpu_memory_bytes = cluster.min_memory_bytes();
  view.rank_speeds.clear();
  view.rank_memory_bytes.clear();
  return view;
}

Cluster make_cluster(int64_t num_gpus, int64_t gpus_per_node, const std::string& links) {
  if (num_gpus <= 0 || num_gpus > kMaxGpus) {
    throw std::invalid_argument("--gpus must be in [1, " + std::to_string(kMaxGpus) + "], got " +
                                std::to_string(num_gpus));
  }
  if (gpus_per_node <= 0) {
    throw std::invalid_argument("--gpus-per-node must be positive, got " +
                                std::to_string(gpus_per_node));
  }
  if (gpus_per_node > num_gpus) {
    throw std::invalid_argument("--gpus-per-node " + std::to_string(gpus_per_node) +
                                " exceeds --gpus " + std::to_string(num_gpus));
  }
  if (num_gpus % gpus_per_node != 0) {
    throw std::invalid_argument("--gpus " + std::to_string(num_gpus) +
                                " is not a multiple of --gpus-per-node " +
                                std::to_string(gpus_per_node));
  }
  Cluster cluster;
  cluster.num_nodes = num_gpus / gpus_per_node;
  cluster.gpus_per_node = gpus_per_node;
  cluster.gpu_memory_bytes = int64_t{140} << 30;
  if (links == "nvlink") {
    cluster.intra_node_bytes_per_s = 300e9;
    cluster.inter_node_bytes_per_s = 45e9;  // 400 Gb/s NIC per GPU, ~90% achieved
    cluster.intra_node_latency_s = 15e-6;
    cluster.inter_node_latency_s = 30e-6;
  } else if (links == "pcie") {
    cluster.intra_node_bytes_per_s = 25e9;
    cluster.inter_node_bytes_per_s = 25e9;
    cluster.intra_node_latency_s = 20e-6;
    cluster.inter_node_latency_s = 30e-6;
  } else {
    throw std::invalid_argument("unknown link class '" + links + "' (allowed: nvlink, pcie)");
  }
  return cluster;
}

}  // namespace zellige
