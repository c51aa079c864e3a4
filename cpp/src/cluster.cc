#include "zellige/cluster.h"

#include <stdexcept>

namespace zellige {

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
