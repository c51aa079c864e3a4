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

// The lower bound on unlike ranks stays below the brute-force optimum (every plan of a tiny batch
// on 4 ranks of different speeds and memory, priced by evaluate), and zellige stays above it.
TEST(HeterogeneousCluster, LowerBoundNeverAboveBruteForceOptimum) {
  std::mt19937_64 random(131);
  const ModelSpec tiny = model_preset("tiny");
  int compared = 0;
  for (int trial = 0; trial < 16; ++trial) {
    Cluster cluster = make_cluster(4, trial % 2 == 0 ? 2 : 4);
    cluster.intra_node_bytes_per_s = trial % 3 == 0 ? 1e8 : 1e10;
    cluster.inter_node_bytes_per_s = cluster.intra_node_bytes_per_s / 10;
    cluster.gpu_memory_bytes = int64_t{4000} << 20;
    for (int64_t rank = 0; rank < 4; ++rank) {
      cluster.rank_speeds.push_back(0.5 + 0.25 * static_cast<double>(random() % 5));  // 0.5..1.5
      // every other trial: some ranks with less memory, so long sequences must avoid them
      cluster.rank_memory_bytes.push_back(trial % 2 && random() % 2 ? int64_t{3300} << 20
                                                                    : int64_t{4000} << 20);
    }
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
    const double optimum = test_util::brute_force_makespan(batch, cost_model);
    EXPECT_TRUE(std::isfinite(bound));
    if (!std::isfinite(optimum)) continue;
    ++compared;
    EXPECT_GT(bound, 0);
    EXPECT_LE(bound, optimum * (1 + 1e-12)) << "trial " << trial;
    const Plan plan = make_plan("zellige", batch, cost_model);
    EXPECT_GE(plan.predicted.makespan_s, optimum * (1 - 1e-12)) << "trial " << trial;
  }
  EXPECT_GE(compared, 10);
}

// Unlike clusters of the benchmark's kinds: half the nodes faster with more memory (H100 next to
// H200), or one node throttled.
Cluster unlike_cluster(int64_t num_gpus, int kind, std::mt19937_64& random) {
  Cluster cluster = make_cluster(num_gpus, 8);
  const int64_t num_nodes = cluster.num_nodes;
  cluster.rank_speeds.assign(num_gpus, 1.0);
  cluster.rank_memory_bytes.assign(num_gpus, cluster.gpu_memory_bytes);
  if (kind == 0) {
    const double fast = 1.2 + 0.1 * static_cast<double>(random() % 4);
    for (int64_t rank = 0; rank < num_gpus; ++rank) {
      if (cluster.node_of(rank) % 2 == 1) {
        cluster.rank_speeds[rank] = fast;
      } else {
        cluster.rank_memory_bytes[rank] = int64_t{80} << 30;
      }
    }
  } else {
    const int64_t slow_node = static_cast<int64_t>(random() % static_cast<uint64_t>(num_nodes));
    for (int64_t rank = slow_node * 8; rank < slow_node * 8 + 8; ++rank) {
      cluster.rank_speeds[rank] = 0.7;
    }
  }
  return cluster;
}

Batch random_unlike_batch(int family, int64_t num_gpus, std::mt19937_64& random) {
  auto uniform = [&](int64_t low, int64_t high) {
    return low + static_cast<int64_t>(random() % static_cast<uint64_t>(high - low + 1));
  };
  Batch batch;
  auto add = [&](const char* kind, int64_t tokens) {
    const int64_t id = static_cast<int64_t>(batch.sequences.size());
    batch.sequences.push_back(sequence_from_tokens(id, kind, tokens, 512, id % num_gpus));
  };
  switch (family) {
    case 0:  // long and short videos with images
      for (int64_t i = 0, n = uniform(num_gpus / 4 + 1, num_gpus); i < n; ++i) {
        add("video", uniform(20000, 90000));
      }
      for (int64_t i = 0, n = uniform(0, 3 * num_gpus); i < n; ++i) {
        add("image", uniform(256, 4096));
      }
      break;
    case 1:  // a few huge videos
      for (int64_t i = 0, n = uniform(1, 4); i < n; ++i) add("video", uniform(120000, 250000));
      for (int64_t i = 0, n = uniform(0, num_gpus / 2); i < n; ++i) {
        add("video", uniform(8000, 60000));
      }
      break;
    case 2:  // many short sequences
      for (int64_t i = 0, n = uniform(3 * num_gpus, 6 * num_gpus); i < n; ++i) {
        add(i % 3 ? "image" : "video", uniform(256, 16000));
      }
      break;
    default:  // heavy tail
      for (int64_t i = 0, n = uniform(num_gpus, 3 * num_gpus); i < n; ++i) {
        const double u = std::uniform_real_distribution<double>(1e-3, 1.0)(random);
        add("video", std::min<int64_t>(250000, static_cast<int64_t>(512 / std::pow(u, 1.3))));
      }
      break;
  }
  return batch;
}

// zellige's promise on unlike ranks: never slower than a covered baseline (each planning as on
// the homogeneous cluster, priced on the real one), never below the lower bound, and no rank
// above its own memory.
TEST(HeterogeneousCluster, ZelligeNeverWorseThanEveryBaselineAndNoRankOverItsMemory) {
  std::mt19937_64 random(2031);
  int batches = 0, strictly_better = 0;
  for (int64_t num_gpus : {16, 32}) {
    for (int kind = 0; kind < 2; ++kind) {
      for (int family = 0; family < 4; ++family) {
        for (int seed = 0; seed < 3; ++seed) {
          const std::string model = seed % 2 ? "wan-14b" : "mmdit-11b";
          const Cluster cluster = unlike_cluster(num_gpus, kind, random);
          const CostModel cost_model(model_preset(model), seeded_profile(), cluster);
          const Batch batch = random_unlike_batch(family, num_gpus, random);
          const std::string where = model + " " + std::to_string(num_gpus) + " GPUs kind " +
                                    std::to_string(kind) + " family " + std::to_string(family) +
                                    " seed " + std::to_string(seed);
          ++batches;
          double ours_s = std::numeric_limits<double>::infinity();
          try {
            const Plan plan = make_plan("zellige", batch, cost_model);
            ours_s = plan.predicted.makespan_s;
            for (int64_t rank = 0; rank < num_gpus; ++rank) {
              EXPECT_LE(plan.predicted.rank_peak_bytes[rank],
                        cost_model.memory_capacity_bytes(rank))
                  << "rank " << rank << " on " << where;
            }
          } catch (const PlanMemoryError&) {
          }
          const double bound_s = makespan_lower_bound(batch, cost_model);
          if (std::isfinite(ours_s)) EXPECT_GE(ours_s, bound_s * (1 - 1e-12)) << where;
          double best_baseline_s = std::numeric_limits<double>::infinity();
          for (const std::string& name : covered_baselines(batch, cost_model)) {
            double theirs_s = std::numeric_limits<double>::infinity();
            try {
              theirs_s = make_plan(name, batch, cost_model).predicted.makespan_s;
            } catch (const PlanMemoryError&) {
              continue;
            }
            EXPECT_GE(theirs_s, bound_s * (1 - 1e-12)) << name << " on " << where;
            EXPECT_LE(ours_s, theirs_s) << name << " beats zellige on " << where;
            best_baseline_s = std::min(best_baseline_s, theirs_s);
          }
          if (ours_s < best_baseline_s * (1 - 1e-6)) ++strictly_better;
        }
      }
    }
  }
  EXPECT_EQ(batches, 48);
  // Speed awareness must show: zellige beats every speed-blind baseline on most of them.
  EXPECT_GT(strictly_better, batches / 2) << strictly_better << " of " << batches;
}

}  // namespace
}  // namespace zellige
