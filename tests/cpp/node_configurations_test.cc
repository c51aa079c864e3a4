// The configuration view of a run of equal sequences (cpp/src/planners/node_configurations.h):
// the solver against a brute force over every set of windows on every node, on tiny inputs.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <random>
#include <vector>

#include "../../cpp/src/planners/node_configurations.h"

namespace zellige::planners {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

struct NodeOption {
  int64_t sequences = 0;
  double rank_seconds = 0;
};

// Every way to fill one node with windows (any degrees summing to at most the node, each window
// carrying 1..num_sequences sequences within the caps), listed window by window.
std::vector<NodeOption> every_node_filling(const RunShapes& shapes, int64_t gpus_per_node,
                                           int64_t num_sequences, double cap_s,
                                           double free_bytes) {
  std::vector<NodeOption> options;
  std::function<void(int64_t, int64_t, double)> fill = [&](int64_t free_ranks, int64_t carried,
                                                           double rank_seconds) {
    options.push_back({carried, rank_seconds});
    for (int64_t degree = 1; degree <= free_ranks; ++degree) {
      if (!std::isfinite(shapes.time_s[degree])) continue;
      for (int64_t count = 1; carried + count <= num_sequences; ++count) {
        const double c = static_cast<double>(count);
        if (c * shapes.time_s[degree] > cap_s || c * shapes.memory_bytes[degree] > free_bytes) {
          break;
        }
        fill(free_ranks - degree, carried + count,
             rank_seconds + c * shapes.rank_seconds[degree]);
      }
    }
  };
  fill(gpus_per_node, 0, 0.0);
  return options;
}

// The least rank-seconds over every node's every filling (nodes taken one by one, not as
// identical), carrying exactly num_sequences; infinity when none does.
double brute_force(const RunShapes& shapes, int64_t gpus_per_node, int64_t num_nodes,
                   int64_t num_sequences, double cap_s, double free_bytes) {
  const std::vector<NodeOption> options =
      every_node_filling(shapes, gpus_per_node, num_sequences, cap_s, free_bytes);
  double best_s = kInf;
  std::function<void(int64_t, int64_t, double)> node = [&](int64_t n, int64_t carried,
                                                            double rank_seconds) {
    if (n == num_nodes) {
      if (carried == num_sequences) best_s = std::min(best_s, rank_seconds);
      return;
    }
    for (const NodeOption& option : options) {
      if (carried + option.sequences > num_sequences) continue;
      node(n + 1, carried + option.sequences, rank_seconds + option.rank_seconds);
    }
  };
  node(0, 0, 0.0);
  return best_s;
}

// The solver's answer is a real placement: node counts, degrees, caps, and its own sums.
void expect_valid(const ConfigurationChoice& choice, const RunShapes& shapes,
                  int64_t gpus_per_node, int64_t num_nodes, int64_t num_sequences, double cap_s,
                  double free_bytes) {
  int64_t nodes = 0, sequences = 0;
  double rank_seconds = 0;
  for (const NodeConfiguration& configuration : choice.configurations) {
    EXPECT_GE(configuration.nodes, 1);
    nodes += configuration.nodes;
    int64_t ranks = 0, carried = 0;
    double node_s = 0;
    for (const WindowUse& window : configuration.windows) {
      ASSERT_GE(window.degree, 1);
      ASSERT_LE(window.degree, gpus_per_node);
      EXPECT_GE(window.count, 1);
      const double c = static_cast<double>(window.count);
      EXPECT_LE(c * shapes.time_s[window.degree], cap_s);
      EXPECT_LE(c * shapes.memory_bytes[window.degree], free_bytes);
      ranks += window.degree;
      carried += window.count;
      node_s += c * shapes.rank_seconds[window.degree];
    }
    EXPECT_LE(ranks, gpus_per_node);
    EXPECT_EQ(carried, configuration.sequences);
    EXPECT_NEAR(node_s, configuration.rank_seconds, 1e-9 * (1 + node_s));
    sequences += configuration.nodes * carried;
    rank_seconds += static_cast<double>(configuration.nodes) * node_s;
  }
  EXPECT_LE(nodes, num_nodes);
  EXPECT_EQ(sequences, num_sequences);
  EXPECT_NEAR(rank_seconds, choice.rank_seconds, 1e-9 * (1 + rank_seconds));
}

TEST(NodeConfigurations, MatchesBruteForceOnTinyInputs) {
  std::mt19937_64 rng(15);
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  int feasible = 0, infeasible = 0, mixed = 0;
  for (int trial = 0; trial < 3000; ++trial) {
    const int64_t gpus_per_node = 1 + static_cast<int64_t>(rng() % 5);  // 1..5
    const int64_t num_nodes = 1 + static_cast<int64_t>(rng() % 3);      // 1..3
    const int64_t num_sequences = static_cast<int64_t>(rng() % 8);      // 0..7
    RunShapes shapes;
    shapes.time_s.assign(gpus_per_node + 1, kInf);
    shapes.rank_seconds.assign(gpus_per_node + 1, kInf);
    shapes.memory_bytes.assign(gpus_per_node + 1, 0.0);
    for (int64_t degree = 1; degree <= gpus_per_node; ++degree) {
      if (unit(rng) < 0.15) continue;  // no shape of this degree fits
      const double d = static_cast<double>(degree);
      // Sharding shortens the busiest share but costs extra rank-seconds, more or less so.
      shapes.time_s[degree] = (0.6 + 0.8 * unit(rng)) / d;
      shapes.rank_seconds[degree] = shapes.time_s[degree] * d * (0.85 + 0.4 * unit(rng));
      shapes.memory_bytes[degree] = (0.5 + unit(rng)) / d;
    }
    const double cap_s = 0.3 + 2.5 * unit(rng);
    const double free_bytes = 0.4 + 2.0 * unit(rng);
    const ConfigurationChoice choice = solve_node_configurations(
        shapes, gpus_per_node, num_nodes, num_sequences, cap_s, free_bytes);
    const double oracle_s =
        brute_force(shapes, gpus_per_node, num_nodes, num_sequences, cap_s, free_bytes);
    SCOPED_TRACE("trial " + std::to_string(trial));
    ASSERT_EQ(choice.feasible, std::isfinite(oracle_s));
    if (!choice.feasible) {
      ++infeasible;
      continue;
    }
    ++feasible;
    EXPECT_NEAR(choice.rank_seconds, oracle_s, 1e-9 * (1 + oracle_s));
    expect_valid(choice, shapes, gpus_per_node, num_nodes, num_sequences, cap_s, free_bytes);
    bool several_degrees = false;
    for (const NodeConfiguration& configuration : choice.configurations) {
      for (const WindowUse& window : configuration.windows) {
        several_degrees |= window.degree != configuration.windows.front().degree;
      }
    }
    mixed += several_degrees ? 1 : 0;
  }
  // The draws cover both outcomes and plans that mix degrees inside a node.
  EXPECT_GT(feasible, 500);
  EXPECT_GT(infeasible, 100);
  EXPECT_GT(mixed, 20) << feasible << " feasible, " << infeasible << " infeasible";
}

TEST(NodeConfigurations, MixesDegreesInsideANodeWhenThatIsCheapest) {
  // Eight ranks, five sequences, cap 1: one alone takes 1.2 s (too slow), on two ranks 0.6 s
  // (2 x 0.6 > 1, one per pair), on four ranks 0.3 s (three fit: 0.9). Rank-seconds: 1.3 per
  // sequence on two ranks, 1.4 on four. One node: the cheapest is 4 pairs = 4 sequences, or a
  // four-window carrying 3 plus two pairs = 5 sequences (4.2 + 2.6 = 6.8), which is the only
  // way to carry five on one node.
  RunShapes shapes;
  shapes.time_s = {kInf, 1.2, 0.6, kInf, 0.3, kInf, kInf, kInf, kInf};
  shapes.rank_seconds = {kInf, 1.2, 1.3, kInf, 1.4, kInf, kInf, kInf, kInf};
  shapes.memory_bytes.assign(9, 0.0);
  const ConfigurationChoice choice = solve_node_configurations(shapes, 8, 1, 5, 1.0, 1.0);
  ASSERT_TRUE(choice.feasible);
  ASSERT_EQ(choice.configurations.size(), 1u);
  const NodeConfiguration& configuration = choice.configurations[0];
  ASSERT_EQ(configuration.windows.size(), 3u);
  EXPECT_EQ(configuration.windows[0].degree, 4);
  EXPECT_EQ(configuration.windows[0].count, 3);
  EXPECT_EQ(configuration.windows[1].degree, 2);
  EXPECT_EQ(configuration.windows[2].degree, 2);
  EXPECT_NEAR(choice.rank_seconds, 6.8, 1e-12);
  // Two nodes: five pairs (6.5) beat the mixed node.
  const ConfigurationChoice two = solve_node_configurations(shapes, 8, 2, 5, 1.0, 1.0);
  ASSERT_TRUE(two.feasible);
  EXPECT_NEAR(two.rank_seconds, 6.5, 1e-12);
}

}  // namespace
}  // namespace zellige::planners
