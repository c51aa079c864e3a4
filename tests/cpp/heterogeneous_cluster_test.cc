// Clusters of unlike ranks (per-rank speeds and memory): validation, the cost model's per-rank
// pricing against the homogeneous one, the baselines' speed-blind plans, zellige against them and
// the lower bound against brute force.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "test_util.h"
#include "zellige/cluster.h"
#include "zellige/cost_model.h"
#include "zellige/planners.h"

namespace zellige {
namespace {

using test_util::seeded_profile;

TEST(HeterogeneousCluster, AccessorsDefaultToTheHomogeneousValues) {
  Cluster cluster = make_cluster(16, 8);
  EXPECT_FALSE(cluster.heterogeneous());
  EXPECT_EQ(cluster.speed_of(5), 1.0);
  EXPECT_EQ(cluster.memory_of(5), cluster.gpu_memory_bytes);
  EXPECT_EQ(cluster.total_speed(), 16.0);
  EXPECT_NO_THROW(validate_cluster(cluster));
  cluster.rank_speeds.assign(16, 1.0);
  cluster.rank_memory_bytes.assign(16, cluster.gpu_memory_bytes);
  EXPECT_FALSE(cluster.heterogeneous());  // all entries at the defaults
  cluster.rank_speeds[3] = 0.7;
  cluster.rank_memory_bytes[9] = int64_t{80} << 30;
  EXPECT_TRUE(cluster.heterogeneous());
  EXPECT_EQ(cluster.speed_of(3), 0.7);
  EXPECT_EQ(cluster.memory_of(9), int64_t{80} << 30);
  EXPECT_EQ(cluster.min_memory_bytes(), int64_t{80} << 30);
  EXPECT_DOUBLE_EQ(cluster.total_speed(), 15.7);
  const Cluster view = homogeneous_view(cluster);
  EXPECT_FALSE(view.heterogeneous());
  EXPECT_TRUE(view.rank_speeds.empty());
  EXPECT_EQ(view.gpu_memory_bytes, int64_t{80} << 30);
}

TEST(HeterogeneousCluster, ValidationRefusesBadPerRankLists) {
  const Cluster base = make_cluster(8, 8);
  Cluster cluster = base;
  cluster.rank_speeds.assign(7, 1.0);  // one short
  EXPECT_THROW(validate_cluster(cluster), std::invalid_argument);
  for (double bad : {0.0, -1.0, std::numeric_limits<double>::infinity(),
                     std::numeric_limits<double>::quiet_NaN()}) {
    cluster = base;
    cluster.rank_speeds.assign(8, 1.0);
    cluster.rank_speeds[2] = bad;
    EXPECT_THROW(validate_cluster(cluster), std::invalid_argument) << bad;
  }
  cluster = base;
  cluster.rank_memory_bytes.assign(9, base.gpu_memory_bytes);
  EXPECT_THROW(validate_cluster(cluster), std::invalid_argument);
  cluster.rank_memory_bytes.assign(8, base.gpu_memory_bytes);
  cluster.rank_memory_bytes[0] = 0;
  EXPECT_THROW(validate_cluster(cluster), std::invalid_argument);
  // The cost model refuses such a cluster too.
  EXPECT_THROW(CostModel(model_preset("wan-14b"), seeded_profile(), cluster),
               std::invalid_argument);
}

Batch mixed_batch(int64_t num_gpus, std::mt19937_64& random) {
  Batch batch;
  int64_t id = 0;
  for (int64_t i = 0; i < num_gpus / 2 + 1; ++i) {
    const int64_t tokens = 20000 + static_cast<int64_t>(random() % 60000);
    batch.sequences.push_back(sequence_from_tokens(id, "video", tokens, 512, id % num_gpus));
    ++id;
  }
  for (int64_t i = 0; i < 3 * num_gpus; ++i) {
    const int64_t tokens = 256 + static_cast<int64_t>(random() % 4000);
    batch.sequences.push_back(sequence_from_tokens(id, "image", tokens, 512, id % num_gpus));
    ++id;
  }
  return batch;
}

// Evaluate on unlike ranks = the homogeneous evaluation with every rank's time (each term) divided
// by its speed; memory the same, checked against each rank's own capacity.
TEST(HeterogeneousCluster, EvaluateDividesEachRanksTimeByItsSpeed) {
  std::mt19937_64 random(31);
  const Cluster base = make_cluster(16, 8);
  const CostModel homogeneous(model_preset("wan-14b"), seeded_profile(), base);
  Cluster cluster = base;
  for (int64_t rank = 0; rank < 16; ++rank) cluster.rank_speeds.push_back(0.5 + 0.1 * rank);
  const CostModel unlike(model_preset("wan-14b"), seeded_profile(), cluster);
  const Batch batch = mixed_batch(16, random);
  const Plan plan = make_plan("static-cp:4", batch, homogeneous);
  const PlanCost nominal = homogeneous.evaluate(batch, plan);
  const PlanCost scaled = unlike.evaluate(batch, plan);
  double makespan_s = 0;
  for (int64_t rank = 0; rank < 16; ++rank) {
    const RankCost& a = nominal.ranks[rank];
    const RankCost& b = scaled.ranks[rank];
    const double speed = cluster.speed_of(rank);
    EXPECT_DOUBLE_EQ(b.time_s, a.time_s / speed) << rank;
    EXPECT_DOUBLE_EQ(b.linear_s, a.linear_s / speed) << rank;
    EXPECT_DOUBLE_EQ(b.attention_s, a.attention_s / speed) << rank;
    EXPECT_DOUBLE_EQ(b.exchange_s, a.exchange_s / speed) << rank;
    EXPECT_DOUBLE_EQ(b.launch_floor_s, a.launch_floor_s / speed) << rank;
    EXPECT_EQ(b.peak_bytes, a.peak_bytes) << rank;
    EXPECT_EQ(b.tokens, a.tokens) << rank;
    makespan_s = std::max(makespan_s, a.time_s / speed);
  }
  EXPECT_DOUBLE_EQ(scaled.makespan_s, makespan_s);
  EXPECT_EQ(scaled.exchange_bytes, nominal.exchange_bytes);
  // The floor the planners use stays below the exact makespan on unlike ranks too.
  EvaluationCache cache;
  EXPECT_LE(unlike.makespan_floor(batch, plan, cache), scaled.makespan_s * (1 + 1e-12));
}

// All speeds 1 and every rank the default memory: bit for bit the homogeneous numbers.
TEST(HeterogeneousCluster, UnitSpeedsPriceBitForBitAsTheHomogeneousCluster) {
  std::mt19937_64 random(7);
  const Cluster base = make_cluster(16, 8);
  Cluster ones = base;
  ones.rank_speeds.assign(16, 1.0);
  ones.rank_memory_bytes.assign(16, base.gpu_memory_bytes);
  const CostModel a(model_preset("mmdit-11b"), seeded_profile(), base);
  const CostModel b(model_preset("mmdit-11b"), seeded_profile(), ones);
  const Batch batch = mixed_batch(16, random);
  for (const std::string& planner : {"dp-cost", "static-cp:8", "zellige"}) {
    const Plan plan_a = make_plan(planner, batch, a);
    const Plan plan_b = make_plan(planner, batch, b);
    EXPECT_EQ(plan_a.predicted.rank_time_s, plan_b.predicted.rank_time_s) << planner;
    EXPECT_EQ(plan_a.predicted.rank_peak_bytes, plan_b.predicted.rank_peak_bytes) << planner;
  }
}

// Memory is per rank: a peak within the large ranks' memory but above the small ranks' fits
// only where it lies.
TEST(HeterogeneousCluster, FitsChecksEachRankAgainstItsOwnMemory) {
  const Cluster base = make_cluster(8, 8);
  const CostModel probe(model_preset("wan-14b"), seeded_profile(), base);
  const Batch batch = test_util::batch_of({60000});
  Plan plan;
  plan.num_ranks = 8;
  plan.placements.push_back(make_placement(0, Strategy::kLocal, {0}));
  const double peak_bytes = probe.evaluate(batch, plan).ranks[0].peak_bytes;
  const double headroom = probe.options().memory_headroom;
  Cluster cluster = base;
  cluster.rank_memory_bytes.assign(8, static_cast<int64_t>(peak_bytes / (1 - headroom)) + 1);
  // Rank 0: the training state and a little more, too little for the video even recomputed.
  cluster.rank_memory_bytes[0] =
      static_cast<int64_t>((probe.fixed_bytes() + (int64_t{1} << 28)) / (1 - headroom));
  const CostModel small_rank0(model_preset("wan-14b"), seeded_profile(), cluster);
  EXPECT_FALSE(small_rank0.evaluate(batch, plan).fits);
  EXPECT_LT(small_rank0.memory_capacity_bytes(0), peak_bytes);
  EXPECT_GE(small_rank0.memory_capacity_bytes(1), peak_bytes);
  EXPECT_EQ(small_rank0.memory_capacity_bytes(), small_rank0.memory_capacity_bytes(0));
  plan.placements[0].ranks = {1};
  EXPECT_TRUE(small_rank0.evaluate(batch, plan).fits);
}

// The baselines know nothing of speeds: on unlike ranks they plan exactly as on the homogeneous
// view (smallest memory), and only the prices differ.
TEST(HeterogeneousCluster, BaselinesPlanAsOnTheHomogeneousView) {
  std::mt19937_64 random(3);
  Cluster cluster = make_cluster(16, 8);
  cluster.rank_speeds.assign(16, 1.0);
  for (int64_t rank = 8; rank < 16; ++rank) cluster.rank_speeds[rank] = 1.4;
  cluster.rank_memory_bytes.assign(16, cluster.gpu_memory_bytes);
  for (int64_t rank = 0; rank < 8; ++rank) cluster.rank_memory_bytes[rank] = int64_t{80} << 30;
  const CostModel unlike(model_preset("wan-14b"), seeded_profile(), cluster);
  const CostModel view = unlike.homogeneous_view();
  EXPECT_EQ(view.memory_capacity_bytes(), unlike.memory_capacity_bytes());
  const Batch batch = mixed_batch(16, random);
  for (const std::string& name : covered_baselines(batch, unlike)) {
    Plan theirs, blind;
    try {
      theirs = make_plan(name, batch, unlike);
      blind = make_plan(name, batch, view);
    } catch (const PlanMemoryError&) {
      continue;
    }
    ASSERT_EQ(theirs.placements.size(), blind.placements.size()) << name;
    for (size_t k = 0; k < theirs.placements.size(); ++k) {
      EXPECT_EQ(theirs.placements[k].ranks, blind.placements[k].ranks) << name;
    }
    EXPECT_EQ(theirs.predicted.makespan_s, unlike.evaluate(batch, theirs).makespan_s) << name;
  }
}

}  // namespace
}  // namespace zellige
