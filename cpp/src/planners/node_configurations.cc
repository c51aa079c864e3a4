#include "node_configurations.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace zellige::planners {

ConfigurationChoice solve_node_configurations(const RunShapes& shapes, int64_t gpus_per_node,
                                              int64_t num_nodes, int64_t num_sequences,
                                              double cap_s, double free_bytes) {
  constexpr double kInf = std::numeric_limits<double>::infinity();
  ConfigurationChoice choice;
  if (num_sequences <= 0) {
    choice.feasible = true;
    return choice;
  }
  // The window kinds: (degree, count) with the count's load and memory within the caps.
  std::vector<WindowUse> kinds;
  for (int64_t degree = gpus_per_node; degree >= 1; --degree) {
    if (degree >= static_cast<int64_t>(shapes.time_s.size())) continue;
    const double time_s = shapes.time_s[degree];
    if (!(time_s > 0) || !std::isfinite(time_s)) continue;
    for (int64_t count = 1; count <= num_sequences; ++count) {
      const double c = static_cast<double>(count);
      if (c * time_s > cap_s || c * shapes.memory_bytes[degree] > free_bytes) break;
      kinds.push_back({degree, count});
    }
  }
  // One node: least rank-seconds with exactly `used` ranks in windows carrying `carried`
  // sequences (an unbounded knapsack: a kind may repeat), with the last kind added.
  // At most gpus_per_node windows on a node, each carrying at most the largest count.
  int64_t largest_count = 0;
  for (const WindowUse& kind : kinds) largest_count = std::max(largest_count, kind.count);
  const int64_t most = std::min(num_sequences, gpus_per_node * largest_count);
  const size_t width = static_cast<size_t>(most + 1);
  std::vector<double> node_s((gpus_per_node + 1) * width, kInf);
  std::vector<int32_t> last_kind((gpus_per_node + 1) * width, -1);
  node_s[0] = 0;
  for (int64_t used = 0; used < gpus_per_node; ++used) {
    for (int64_t carried = 0; carried <= most; ++carried) {
      const double from_s = node_s[used * width + carried];
      if (!std::isfinite(from_s)) continue;
      for (size_t k = 0; k < kinds.size(); ++k) {
        const WindowUse& kind = kinds[k];
        if (used + kind.degree > gpus_per_node || carried + kind.count > most) continue;
        const size_t to = (used + kind.degree) * width + (carried + kind.count);
        const double to_s =
            from_s + static_cast<double>(kind.count) * shapes.rank_seconds[kind.degree];
        if (to_s < node_s[to]) {
          node_s[to] = to_s;
          last_kind[to] = static_cast<int32_t>(k);
        }
      }
    }
  }
  // Per carried count, the node's best: its rank-seconds and how many ranks it uses.
  std::vector<double> best_node_s(width, kInf);
  std::vector<int64_t> best_used(width, -1);
  for (int64_t carried = 0; carried <= most; ++carried) {
    for (int64_t used = 0; used <= gpus_per_node; ++used) {
      if (node_s[used * width + carried] < best_node_s[carried]) {
        best_node_s[carried] = node_s[used * width + carried];
        best_used[carried] = used;
      }
    }
  }
  // Nodes are identical: per node count n and sequences m, the least summed rank-seconds, and how
  // many sequences the n-th node carries.
  const size_t cols = static_cast<size_t>(num_sequences + 1);
  std::vector<double> total_s(cols, kInf), next_s(cols);
  std::vector<int64_t> carried_by((num_nodes + 1) * cols, -1);
  total_s[0] = 0;
  for (int64_t n = 1; n <= num_nodes; ++n) {
    std::fill(next_s.begin(), next_s.end(), kInf);
    for (int64_t m = 0; m <= num_sequences; ++m) {
      for (int64_t carried = 0; carried <= std::min(most, m); ++carried) {
        const double s = best_node_s[carried] + total_s[m - carried];
        if (s < next_s[m]) {
          next_s[m] = s;
          carried_by[n * cols + m] = carried;
        }
      }
    }
    total_s.swap(next_s);
  }
  if (!std::isfinite(total_s[num_sequences])) return choice;
  choice.feasible = true;
  choice.rank_seconds = total_s[num_sequences];
  // Back: each node's count, then that count's windows; equal counts share one configuration.
  std::vector<int64_t> nodes_carrying(width, 0);
  for (int64_t n = num_nodes, m = num_sequences; n >= 1; --n) {
    const int64_t carried = carried_by[n * cols + m];
    ++nodes_carrying[carried];
    m -= carried;
  }
  for (int64_t carried = most; carried >= 1; --carried) {
    if (nodes_carrying[carried] == 0) continue;
    NodeConfiguration configuration;
    configuration.nodes = nodes_carrying[carried];
    configuration.sequences = carried;
    configuration.rank_seconds = best_node_s[carried];
    for (int64_t used = best_used[carried], c = carried; used > 0;) {
      const WindowUse& kind = kinds[last_kind[used * width + c]];
      configuration.windows.push_back(kind);
      used -= kind.degree;
      c -= kind.count;
    }
    std::stable_sort(configuration.windows.begin(), configuration.windows.end(),
                     [](const WindowUse& a, const WindowUse& b) { return a.degree > b.degree; });
    choice.configurations.push_back(std::move(configuration));
  }
  return choice;
}

}  // namespace zellige::planners
