// makespan_lower_bound against the brute-force optimum on tiny clusters and against hand-made
// plans at scale: no plan beats it.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <stdexcept>
#include <vector>

#include "test_util.h"
#include "zellige/cost_model.h"
#include "zellige/planners.h"
#include "zellige/simulator.h"

namespace zellige {
namespace {

using test_util::brute_force_makespan;
using test_util::iota_ranks;
using test_util::make_model;
using test_util::seeded_profile;
using test_util::with_launch_rows;

TEST(LowerBound, NeverAboveBruteForceOptimum) {
  // 2 nodes x 2 GPUs so that placements can cross a node; tiny model (4 heads, cross-attention).
  const ModelSpec tiny = model_preset("tiny");
  const std::vector<std::vector<int64_t>> cases = {
      {4096}, {100000}, {300, 5000}, {20000, 20000}, {64, 2000, 30000}, {500, 500, 500}};
  // A profile whose attention efficiency rises, dips and rises again, with a measured all-to-all
  // table for pairs: the bound must not assume monotone tables.
  HardwareProfile bumpy = analytic_profile("bumpy", 1e12, 1e12, 1e11);
  bumpy.attention_forward_s_per_head = {
      {100, 1000, 3000, 10000}, {1e-7, 2e-6, 4e-5, 2e-4}, "measured"};
  bumpy.attention_backward_s_per_head = {{50, 5000}, {1e-6, 1e-3}, "measured"};
  bumpy.matmul_forward_flops_per_s = {{10, 100, 1000}, {1e11, 8e11, 5e11}, "measured"};
  bumpy.exchange_group_sizes = {2};
  bumpy.exchange_intra_node_s = {{{1e3, 1e7}, {1e-5, 1e-2}, "measured"}};
  for (const HardwareProfile& profile :
       {seeded_profile(), analytic_profile("a", 1e12, 1e12, 1e11), bumpy}) {
    Cluster cluster = make_cluster(4, 2);
    cluster.intra_node_bytes_per_s = 1e9;  // slow links, so that sharding is not free
    cluster.inter_node_bytes_per_s = 1e8;
    const CostModel cost_model(tiny, profile, cluster);
    for (const auto& lengths : cases) {
      Batch batch;
      for (size_t i = 0; i < lengths.size(); ++i) {
        batch.sequences.push_back(sequence_from_tokens(static_cast<int64_t>(i), "video", lengths[i],
                                                       8, static_cast<int64_t>(i)));
      }
      const double bound = makespan_lower_bound(batch, cost_model);
      const double optimum = brute_force_makespan(batch, cost_model);
      EXPECT_GT(bound, 0);
      EXPECT_LE(bound, optimum * (1 + 1e-12)) << profile.device_name << " " << lengths.size();
    }
  }
}

TEST(LowerBound, NeverAboveBruteForceOptimumOnRandomBatches) {
  std::mt19937_64 random(7);
  const ModelSpec tiny = model_preset("tiny");
  for (int trial = 0; trial < 12; ++trial) {
    Cluster cluster = make_cluster(4, trial % 2 == 0 ? 2 : 4);
    cluster.intra_node_bytes_per_s = trial % 3 == 0 ? 1e8 : 1e10;
    cluster.inter_node_bytes_per_s = cluster.intra_node_bytes_per_s / 10;
    cluster.gpu_memory_bytes = int64_t{3400} << 20;  // tight: long sequences must be split
    const CostModel cost_model(tiny, seeded_profile(), cluster,
                               CostOptions{trial % 4 != 1, 2, 18.0, 0.05});
    Batch batch;
    const int64_t num_sequences = 1 + static_cast<int64_t>(random() % 3);
    for (int64_t i = 0; i < num_sequences; ++i) {
      const int64_t tokens = int64_t{1} << (3 + random() % 15);  // 8 .. 131072
      batch.sequences.push_back(
          sequence_from_tokens(i, "video", tokens + static_cast<int64_t>(random() % 7), 8, i % 4));
    }
    const double bound = makespan_lower_bound(batch, cost_model);
    const double optimum = brute_force_makespan(batch, cost_model);
    EXPECT_TRUE(std::isfinite(bound));  // even when nothing fits (then the plan is refused)
    if (std::isfinite(optimum)) EXPECT_LE(bound, optimum * (1 + 1e-12)) << "trial " << trial;
  }
}

// The bound's call excess, launch floor and per-token rate under the makespan (issue 15): a
// profile whose calls of few heads are slower per head (so grouping equal segments matters),
// with a launch floor and a GEMM rate that peaks at a size no rank of these batches reaches.
// Repeated lengths and texts let segments of several sequences share a call.
// With ragged calls (profile.attention_ragged) too: the bound stays below the optimum, and no
// planner's plan beats it.
class LowerBoundRagged : public ::testing::TestWithParam<bool> {};

TEST_P(LowerBoundRagged, WithCallTablesLaunchFloorAndGemmPeakNeverAboveBruteForceOptimum) {
  HardwareProfile profile = seeded_profile();
  profile.attention_ragged = GetParam();
  const std::vector<double> call_heads = {1, 2, 4, 8, 64};
  for (double length : {64.0, 4096.0, 65536.0}) {
    Table table{call_heads, {}, "measured"};
    // Per head, a call of h heads is (1 + 2 / h) x the largest call's, and a bit slower for
    // short segments (the slowdown varies with the length too).
    for (double h : call_heads) {
      table.y.push_back(h * 1e-9 * length * length * (1.0 + (2.0 + 1e3 / length) / h));
    }
    profile.attention_call_lengths.push_back(length);
    profile.attention_call_forward_s.push_back(table);
    profile.attention_call_backward_s.push_back(table);
  }
  profile.matmul_forward_flops_per_s = {{64, 4096, 1 << 22}, {2e13, 3e14, 9e14}, "measured"};
  profile = with_launch_rows(profile, "tiny", 2e-4, 5e-5);
  const ModelSpec tiny = model_preset("tiny");
  const std::vector<std::vector<std::pair<int64_t, int64_t>>> cases = {
      {{300, 8}, {300, 8}, {300, 8}},    {{64, 8}, {64, 8}, {5000, 8}},
      {{4096, 16}, {4096, 8}},           {{20000, 8}, {20000, 8}, {900, 8}},
      {{100000, 8}},                     {{2000, 8}, {3000, 16}, {2000, 16}},
      {{128, 0}, {128, 0}, {128, 0}}};
  for (int64_t gpus_per_node : {2, 4}) {
    Cluster cluster = make_cluster(4, gpus_per_node);
    cluster.intra_node_bytes_per_s = 1e9;
    cluster.inter_node_bytes_per_s = 1e8;
    for (bool checkpointing : {true, false}) {
      CostOptions options;
      options.activation_checkpointing = checkpointing;
      const CostModel cost_model(tiny, profile, cluster, options);
      for (const auto& lengths : cases) {
        Batch batch;
        for (size_t i = 0; i < lengths.size(); ++i) {
          batch.sequences.push_back(sequence_from_tokens(static_cast<int64_t>(i), "video",
                                                         lengths[i].first, lengths[i].second,
                                                         static_cast<int64_t>(i)));
        }
        const double bound = makespan_lower_bound(batch, cost_model);
        const double optimum = brute_force_makespan(batch, cost_model);
        EXPECT_GT(bound, 0);
        EXPECT_LE(bound, optimum * (1 + 1e-12))
            << gpus_per_node << " " << checkpointing << " " << lengths.size() << " "
            << lengths[0].first;
        for (const char* name : {"dp-tokens", "dp-cost", "megatron-dcp", "static-cp:2",
                                 "zellige"}) {
          Plan plan;
          try {
            plan = make_plan(name, batch, cost_model);
          } catch (const PlanMemoryError&) {
            continue;
          }
          const double makespan_s = cost_model.evaluate(batch, plan).makespan_s;
          EXPECT_EQ(plan.predicted.makespan_s, makespan_s) << name;
          EXPECT_GE(makespan_s, optimum * (1 - 1e-12)) << name;
          EvaluationCache cache;
          EXPECT_LE(cost_model.makespan_floor(batch, plan, cache), makespan_s * (1 + 1e-12))
              << name;
        }
      }
    }
  }
  // More equal sequences than ranks: the optimum groups their segments into shared calls.
  const std::vector<std::pair<int64_t, int64_t>> crowded = {{300, 5}, {4096, 5}, {40000, 4}};
  for (const auto& [length, count] : crowded) {
    const CostModel cost_model(tiny, profile, make_cluster(2, 2));
    Batch batch;
    for (int64_t i = 0; i < count; ++i) {
      batch.sequences.push_back(sequence_from_tokens(i, "video", length, 8, i % 2));
    }
    EXPECT_LE(makespan_lower_bound(batch, cost_model),
              brute_force_makespan(batch, cost_model) * (1 + 1e-12))
        << length;
  }
  // Distinct lengths, more than ranks: the optimum shares a rank between different lengths,
  // whose table a ragged call runs without any call's excess.
  {
    const CostModel cost_model(tiny, profile, make_cluster(2, 2));
    Batch batch;
    for (int64_t i = 0; i < 4; ++i) {
      batch.sequences.push_back(sequence_from_tokens(i, "video", 40000 + 1000 * i, 0, i % 2));
    }
    EXPECT_LE(makespan_lower_bound(batch, cost_model),
              brute_force_makespan(batch, cost_model) * (1 + 1e-12));
  }
  // The terms bite: without call tables, launch floor and GEMM peak the bound is lower.
  HardwareProfile plain = seeded_profile();
  plain.matmul_forward_flops_per_s = {{64, 1 << 22}, {2e13, 9e14}, "measured"};
  const Cluster cluster = make_cluster(4, 4);
  Batch batch;
  for (int64_t i = 0; i < 3; ++i) {
    batch.sequences.push_back(sequence_from_tokens(i, "video", 300, 8, i));
  }
  EXPECT_GT(makespan_lower_bound(batch, CostModel(tiny, profile, cluster)),
            1.05 * makespan_lower_bound(batch, CostModel(tiny, plain, cluster)));
}

INSTANTIATE_TEST_SUITE_P(CostModel, LowerBoundRagged, ::testing::Bool(),
                         [](const auto& info) { return info.param ? "ragged" : "dense"; });

TEST(LowerBound, BelowHandMadePlansAtScale) {
  const CostModel cost_model = make_model("wan-14b", 32, 8);
  Batch batch;
  const std::vector<int64_t> lengths = {118800, 75600, 75600, 32760, 14040, 3600, 3600, 1024,
                                        1024,   1024,  256,   256,   256,   256,  256,  256};
  for (size_t i = 0; i < lengths.size(); ++i) {
    batch.sequences.push_back(sequence_from_tokens(static_cast<int64_t>(i), "video", lengths[i],
                                                   512, static_cast<int64_t>(i) % 32));
  }
  const double bound = makespan_lower_bound(batch, cost_model);
  Plan dp, ulysses, ring, mixed;
  for (Plan* plan : {&dp, &ulysses, &ring, &mixed}) plan->num_ranks = 32;
  for (size_t i = 0; i < lengths.size(); ++i) {
    const int64_t id = static_cast<int64_t>(i);
    dp.placements.push_back(make_placement(id, Strategy::kLocal, {id}));
    ulysses.placements.push_back(
        make_placement(id, Strategy::kUlysses, iota_ranks((id % 4) * 8, 8)));
    ring.placements.push_back(make_placement(id, Strategy::kRing, iota_ranks((id % 2) * 16, 16)));
    if (i < 3) {
      mixed.placements.push_back(make_placement(id, Strategy::kUlysses, iota_ranks(id * 8, 8)));
    } else {
      mixed.placements.push_back(make_placement(id, Strategy::kLocal, {24 + id % 8}));
    }
  }
  for (const Plan* plan : {&dp, &ulysses, &ring, &mixed}) {
    const PlanCost cost = cost_model.evaluate(batch, *plan);
    if (cost.fits) EXPECT_LE(bound, cost.makespan_s);
  }
  // The 118,800-token clip alone needs at least its best split over 32 ranks.
  EXPECT_GT(bound, cost_model.linear_time_s(118800) / 32);
}

// The peak over the backward's progress, by hand: 3 layers, per layer A = 10, C = 1, buffer 5,
// gradients g per layer. Layer j's backward holds the kept activations of layers below j, its own
// full activations (recomputed around its checkpoint, which is part of them), the buffer and the
// gradients above j.
}  // namespace
}  // namespace zellige
