// The cluster: nodes x GPUs, memory and links.
#pragma once

#include <cstdint>
#include <string>

namespace zellige {

// Documented limit (README, "Limits"): the largest cluster a plan may describe. Ranks index
// per-rank tables everywhere, so a larger count is refused before anything is allocated.
inline constexpr int64_t kMaxGpus = 16384;

struct Cluster {
  int64_t num_nodes = 1;
  int64_t gpus_per_node = 8;
  int64_t gpu_memory_bytes = 0;      // usable by the training process
  double intra_node_bytes_per_s = 0;  // per-GPU all-to-all bandwidth inside a node
  double inter_node_bytes_per_s = 0;  // per-GPU bandwidth when a group spans nodes
  double intra_node_latency_s = 0;
  double inter_node_latency_s = 0;

  int64_t num_ranks() const { return num_nodes * gpus_per_node; }
  int64_t node_of(int64_t rank) const { return rank / gpus_per_node; }
};

// H200 SXM nodes: 8 GPUs on NVLink, 400 Gb/s per GPU between nodes. `links` picks the link
// class: "nvlink" (default) or "pcie" (25 GB/s between any two GPUs, like the A6000 cluster of
// the published evaluation). Throws std::invalid_argument when num_gpus is outside [1, kMaxGpus],
// gpus_per_node <= 0, gpus_per_node > num_gpus, num_gpus % gpus_per_node != 0, or an unknown
// link class.
Cluster make_cluster(int64_t num_gpus, int64_t gpus_per_node, const std::string& links = "nvlink");

}  // namespace zellige
