// The configuration view of a run of equal sequences: which windows of one
// node carry how many of them, and how many nodes take each configuration. Private to the
// planners (zellige's configuration start, zellige_moves.cc); declared here for its oracle test.
#pragma once

#include <cstdint>
#include <vector>

namespace zellige::planners {

// One sequence of the run on a window of `degree` consecutive ranks of one node, in its best
// shape of that degree, indexed by degree (1..gpus_per_node; entry 0 unused): the busiest share's
// time, the summed time of its shares, and the largest share's bytes. A degree whose shape does
// not fit in memory has an infinite time.
struct RunShapes {
  std::vector<double> time_s;
  std::vector<double> rank_seconds;
  std::vector<double> memory_bytes;
};

// `count` sequences of the run, one after the other, on a window of `degree` ranks.
struct WindowUse {
  int64_t degree = 0;
  int64_t count = 0;
};

struct NodeConfiguration {
  std::vector<WindowUse> windows;  // largest degree first; their degrees sum to <= gpus_per_node
  int64_t sequences = 0;           // summed counts
  double rank_seconds = 0;         // summed count x rank_seconds of the degree
  int64_t nodes = 0;               // how many nodes take this configuration
};

struct ConfigurationChoice {
  bool feasible = false;  // false: the run fits no set of windows under the cap
  double rank_seconds = 0;
  std::vector<NodeConfiguration> configurations;  // nodes summed: at most num_nodes
};

// Every sequence of a run of `num_sequences` on `num_nodes` identical nodes of `gpus_per_node`
// ranks, each on a window inside one node (windows of a node do not overlap; ranks may stay free),
// such that no window's load (count x time_s) exceeds `cap_s` and no window's memory
// (count x memory_bytes) exceeds `free_bytes`, with the least summed rank-seconds (the most time
// left to the rest of the batch). Exact: a knapsack over one node's windows, then a knapsack over
// node counts (nodes are identical, so only how many take each configuration matters). Ties go to
// the first found in a fixed order (deterministic). Work: about num_nodes x num_sequences x (the
// most sequences one node carries); the caller bounds it.
ConfigurationChoice solve_node_configurations(const RunShapes& shapes, int64_t gpus_per_node,
                                              int64_t num_nodes, int64_t num_sequences,
                                              double cap_s, double free_bytes);

}  // namespace zellige::planners
