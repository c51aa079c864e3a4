// The cluster: nodes x GPUs, memory and links.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

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
  // Per rank, by rank: relative speed (1.0 = the profile's device; a rank's time is its nominal
  // time divided by its speed) and usable GPU memory. Empty: every rank 1.0 and
  // gpu_memory_bytes, the homogeneous cluster (priced bit for bit as without these fields).
  std::vector<double> rank_speeds;
  std::vector<int64_t> rank_memory_bytes;

  int64_t num_ranks() const { return num_nodes * gpus_per_node; }
  int64_t node_of(int64_t rank) const { return rank / gpus_per_node; }
  double speed_of(int64_t rank) const {
    return rank_speeds.empty() ? 1.0 : rank_speeds[static_cast<size_t>(rank)];
  }
  int64_t memory_of(int64_t rank) const {
    return rank_memory_bytes.empty() ? gpu_memory_bytes
                                     : rank_memory_bytes[static_cast<size_t>(rank)];
  }
  // Whether any rank differs from the profile's device (speed) or from gpu_memory_bytes.
  bool heterogeneous() const;
  // The least and the sum of memory_of / speed_of over the ranks.
  int64_t min_memory_bytes() const;
  double total_speed() const;
  double max_speed() const;
};

// Throws std::invalid_argument unless rank_speeds and rank_memory_bytes are empty or hold one
// entry per rank, every speed positive and finite, every memory positive.
void validate_cluster(const Cluster& cluster);

// The same cluster with every rank alike: no per-rank speeds, and the smallest rank memory as
// gpu_memory_bytes. What a speed-unaware policy plans on.
Cluster homogeneous_view(const Cluster& cluster);

// H200 SXM nodes: 8 GPUs on NVLink, 400 Gb/s per GPU between nodes. `links` picks the link
// class: "nvlink" (default) or "pcie" (25 GB/s between any two GPUs, like the A6000 cluster of
// the published evaluation). Throws std::invalid_argument when num_gpus is outside [1, kMaxGpus],
// gpus_per_node <= 0, gpus_per_node > num_gpus, num_gpus % gpus_per_node != 0, or an unknown
// link class.
Cluster make_cluster(int64_t num_gpus, int64_t gpus_per_node, const std::string& links = "nvlink");

}  // namespace zellige
