// The zellige planner against brute force on tiny batches, the lower bound and all-local LPT on
// larger ones, and memory; candidate_placements' windows.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <random>
#include <set>
#include <string>
#include <vector>

#include <time.h>

#include "test_util.h"
#include "zellige/planners.h"

namespace zellige {
namespace {

using test_util::batch_of;
using test_util::brute_force_makespan;
using test_util::seeded_profile;
using test_util::with_launch_rows;

// Stated bound: on tiny batches the planner's makespan is within this factor of the optimum over
// every placement (every rank subset, strategy and degree); on the cases below it is exact.
constexpr double kBruteForceBound = 1.01;

// Longest-processing-time of whole sequences by their exact local time (dp-cost's policy).
PlanCost all_local_lpt_cost(const Batch& batch, const CostModel& cost_model) {
  const int64_t num_ranks = cost_model.cluster().num_ranks();
  std::vector<std::pair<double, size_t>> order;
  for (size_t i = 0; i < batch.sequences.size(); ++i) {
    const RankShare share = cost_model.shares(
        batch.sequences[i], make_placement(batch.sequences[i].id, Strategy::kLocal, {0}))[0];
    order.push_back({cost_model.rank_time_s(share.tokens, share.attention_s, share.exchange_s), i});
  }
  std::sort(order.rbegin(), order.rend());
  std::vector<double> load_s(num_ranks, 0.0);
  Plan plan;
  plan.num_ranks = num_ranks;
  for (const auto& [time_s, i] : order) {
    const int64_t rank = std::min_element(load_s.begin(), load_s.end()) - load_s.begin();
    load_s[rank] += time_s;
    plan.placements.push_back(make_placement(batch.sequences[i].id, Strategy::kLocal, {rank}));
  }
  return cost_model.evaluate(batch, plan);
}

PlanCost plan_and_check(const Batch& batch, const CostModel& cost_model, Plan* plan_out = nullptr,
                        uint64_t seed = 0) {
  PlannerOptions options;
  options.seed = seed;
  Plan plan = plan_zellige(batch, cost_model, options);
  validate_plan(plan, batch, cost_model.cluster().num_ranks(), cost_model.model().num_heads);
  EXPECT_EQ(plan.planner, "zellige");
  EXPECT_EQ(plan.num_ranks, cost_model.cluster().num_ranks());
  const PlanCost cost = cost_model.evaluate(batch, plan);
  if (plan_out) *plan_out = plan;
  return cost;
}

TEST(ZelligePlanner, WithinStatedBoundOfBruteForceOnTinyBatches) {
  const std::vector<std::vector<int64_t>> cases = {{4096},
                                                   {100000},
                                                   {300, 5000},
                                                   {20000, 20000},
                                                   {64, 2000, 30000},
                                                   {500, 500, 500},
                                                   {60000, 1000, 1000},
                                                   {40000, 30000, 256}};
  Cluster cluster = make_cluster(4, 2);
  cluster.intra_node_bytes_per_s = 1e10;
  cluster.inter_node_bytes_per_s = 1e9;
  for (const std::string& model : {"tiny", "wan-1.3b"}) {
    const CostModel cost_model(model_preset(model), seeded_profile(), cluster);
    for (const auto& lengths : cases) {
      const Batch batch = batch_of(lengths, 16);
      const double optimum = brute_force_makespan(batch, cost_model);
      const PlanCost cost = plan_and_check(batch, cost_model);
      EXPECT_TRUE(cost.fits);
      EXPECT_LE(cost.makespan_s, optimum * kBruteForceBound)
          << model << " " << ::testing::PrintToString(lengths);
      EXPECT_GE(cost.makespan_s, optimum * (1 - 1e-12));
    }
  }
}

TEST(ZelligePlanner, WithinStatedBoundOfBruteForceOnRandomTinyBatches) {
  std::mt19937_64 random(11);
  for (int trial = 0; trial < 16; ++trial) {
    Cluster cluster = make_cluster(4, trial % 2 == 0 ? 2 : 4);
    cluster.intra_node_bytes_per_s = trial % 3 == 0 ? 1e9 : 1e11;
    cluster.inter_node_bytes_per_s = cluster.intra_node_bytes_per_s / 8;
    const CostModel cost_model(model_preset(trial % 4 == 0 ? "tiny" : "wan-1.3b"), seeded_profile(),
                               cluster);
    std::vector<int64_t> lengths;
    const int num_sequences = 1 + static_cast<int>(random() % 3);
    for (int i = 0; i < num_sequences; ++i) {
      lengths.push_back((int64_t{1} << (8 + random() % 9)) + static_cast<int64_t>(random() % 97));
    }
    const Batch batch = batch_of(lengths, 32);
    const double optimum = brute_force_makespan(batch, cost_model);
    const PlanCost cost = plan_and_check(batch, cost_model);
    EXPECT_LE(cost.makespan_s, optimum * kBruteForceBound)
        << "trial " << trial << " " << ::testing::PrintToString(lengths);
  }
}

TEST(ZelligePlanner, ShardsWhatDoesNotFitOneRankAndStaysInMemory) {
  // 24 GiB GPUs: a 100k-token wan-1.3b video needs more than one rank's activations.
  Cluster cluster = make_cluster(8, 4);
  cluster.gpu_memory_bytes = int64_t{24} << 30;
  const CostModel cost_model(model_preset("wan-1.3b"), seeded_profile(), cluster);
  const RankShare local = cost_model.shares(sequence_from_tokens(0, "video", 100000, 512, 0),
                                            make_placement(0, Strategy::kLocal, {0}))[0];
  ASSERT_GT(cost_model.fixed_bytes() + local.memory_bytes, cost_model.memory_capacity_bytes());
  const Batch batch = batch_of({100000, 100000, 30000, 3600, 3600, 3600, 1560, 1560}, 512);
  Plan plan;
  const PlanCost cost = plan_and_check(batch, cost_model, &plan);
  EXPECT_TRUE(cost.fits);
  EXPECT_GE(plan.placements[0].degree(), 2);
  EXPECT_GE(plan.placements[1].degree(), 2);
}

TEST(ZelligePlanner, HonoursMemoryWhenMemoryNotTimeBinds) {
  // Four long videos and a thousand small images: balancing time alone piles the images (cheap in
  // time, not in memory) onto the ranks without a video and overfills them.
  int feasible_trials = 0, binding_trials = 0;
  for (int64_t gib : {44, 48, 56}) {
    Cluster cluster = make_cluster(8, 4);
    cluster.gpu_memory_bytes = gib << 30;
    const CostModel cost_model(model_preset("wan-1.3b"), seeded_profile(), cluster);
    std::vector<int64_t> lengths = {100000, 100000, 100000, 100000};
    for (int i = 0; i < 1000; ++i) lengths.push_back(900 + (i * 37) % 200);
    const Batch batch = batch_of(lengths, 512);
    // A plan that fits exists: every sequence Ulysses over all 8 ranks.
    Plan spread;
    spread.num_ranks = 8;
    for (const Sequence& sequence : batch.sequences) {
      spread.placements.push_back(
          make_placement(sequence.id, Strategy::kUlysses, {0, 1, 2, 3, 4, 5, 6, 7}));
    }
    if (!cost_model.evaluate(batch, spread).fits) continue;
    ++feasible_trials;
    binding_trials += all_local_lpt_cost(batch, cost_model).fits ? 0 : 1;
    EXPECT_TRUE(plan_and_check(batch, cost_model).fits) << gib << " GiB";
  }
  EXPECT_GT(feasible_trials, 0);
  EXPECT_GT(binding_trials, 0);  // memory really binds: time-only LPT overfills some rank
}

TEST(ZelligePlanner, AboveLowerBoundAndNoWorseThanAllLocalOnRecipeLikeBatches) {
  struct Case {
    std::string model;
    int64_t gpus, gpus_per_node;
    std::vector<int64_t> lengths;
  };
  std::mt19937_64 random(3);
  std::vector<Case> cases;
  for (int trial = 0; trial < 8; ++trial) {
    Case c{trial % 2 ? "wan-14b" : "mmdit-11b", trial < 4 ? 16 : 32, 8, {}};
    const int num_sequences = static_cast<int>(2 * c.gpus + random() % (4 * c.gpus));
    for (int i = 0; i < num_sequences; ++i) {
      const int kind = static_cast<int>(random() % 10);
      c.lengths.push_back(kind < 6   ? 256 + static_cast<int64_t>(random() % 4000)
                          : kind < 9 ? 8000 + static_cast<int64_t>(random() % 30000)
                                     : 60000 + static_cast<int64_t>(random() % 60000));
    }
    cases.push_back(c);
  }
  for (const Case& c : cases) {
    const CostModel cost_model(model_preset(c.model), seeded_profile(),
                               make_cluster(c.gpus, c.gpus_per_node));
    const Batch batch = batch_of(c.lengths, 512);
    const PlanCost cost = plan_and_check(batch, cost_model);
    const double bound = makespan_lower_bound(batch, cost_model);
    EXPECT_TRUE(cost.fits);
    EXPECT_GE(cost.makespan_s, bound * (1 - 1e-12));
    EXPECT_LE(cost.makespan_s, all_local_lpt_cost(batch, cost_model).makespan_s * (1 + 1e-9));
    EXPECT_LE(cost.makespan_s, bound * 1.10)
        << c.model << " " << c.gpus << " GPUs, " << c.lengths.size() << " sequences";
  }
}

TEST(ZelligePlanner, DeterministicForASeed) {
  std::vector<int64_t> lengths;
  for (int i = 0; i < 60; ++i) lengths.push_back(256 + (i * 7919) % 70000);
  const Batch batch = batch_of(lengths, 512);
  const CostModel cost_model(model_preset("mmdit-11b"), seeded_profile(), make_cluster(16, 8));
  Plan first, second;
  plan_and_check(batch, cost_model, &first, 1);
  plan_and_check(batch, cost_model, &second, 1);
  ASSERT_EQ(first.placements.size(), second.placements.size());
  for (size_t i = 0; i < first.placements.size(); ++i) {
    EXPECT_EQ(first.placements[i].ranks, second.placements[i].ranks);
    EXPECT_EQ(first.placements[i].strategy, second.placements[i].strategy);
    EXPECT_EQ(first.placements[i].ulysses_degree, second.placements[i].ulysses_degree);
  }
}

TEST(ZelligePlanner, SingleRankCluster) {
  const CostModel cost_model(model_preset("tiny"), seeded_profile(), make_cluster(1, 1));
  const Batch batch = batch_of({300, 5000, 20});
  EXPECT_TRUE(plan_and_check(batch, cost_model).fits);
}

// The planner prices an anchor's shares on canonical ranks (0..d-1: whole nodes, then a partial
// one) and reuses them on any rank set of the same node pattern; that is sound only while links
// differ by node alone.
TEST(ZelligePlanner, SharesDependOnNodePatternOnly) {
  const CostModel cost_model(model_preset("wan-14b"), seeded_profile(), make_cluster(32, 8));
  const Sequence sequence = sequence_from_tokens(0, "video", 75600, 512, 3);
  const std::vector<std::pair<std::vector<int64_t>, std::vector<int64_t>>> same_pattern = {
      {{0, 1, 2}, {9, 12, 15}},
      {{0, 1, 2, 3, 4, 5, 6, 7, 8, 9}, {16, 17, 18, 19, 20, 21, 22, 23, 26, 30}}};
  for (const auto& [canonical, other] : same_pattern) {
    const int64_t degree = static_cast<int64_t>(canonical.size());
    std::vector<Placement> pairs[2];
    for (int k = 0; k < 2; ++k) {
      const std::vector<int64_t>& ranks = k == 0 ? canonical : other;
      pairs[k].push_back(make_placement(0, Strategy::kRing, ranks));
      if (degree <= 40) pairs[k].push_back(make_placement(0, Strategy::kUlysses, ranks));
      if (degree % 2 == 0) pairs[k].push_back(make_placement(0, Strategy::kHybrid, ranks, 2));
    }
    for (size_t p = 0; p < pairs[0].size(); ++p) {
      const std::vector<RankShare> a = cost_model.shares(sequence, pairs[0][p]);
      const std::vector<RankShare> b = cost_model.shares(sequence, pairs[1][p]);
      ASSERT_EQ(a.size(), b.size());
      for (size_t k = 0; k < a.size(); ++k) {
        EXPECT_EQ(a[k].tokens, b[k].tokens);
        EXPECT_DOUBLE_EQ(a[k].attention_s, b[k].attention_s);
        EXPECT_DOUBLE_EQ(a[k].exchange_s, b[k].exchange_s);
        EXPECT_DOUBLE_EQ(a[k].memory_bytes, b[k].memory_bytes);
      }
    }
  }
}

TEST(CandidatePlacements, NodeAlignedWindowsEveryStrategyAndCapped) {
  const CostModel cost_model(model_preset("mmdit-11b"), seeded_profile(), make_cluster(16, 8));
  const Sequence sequence = sequence_from_tokens(7, "video", 40000, 512, 0);
  const std::vector<Placement> candidates = candidate_placements(sequence, cost_model, 3);
  std::set<std::pair<int64_t, std::string>> shapes;
  std::vector<int64_t> windows_per_shape(64, 0);
  for (const Placement& placement : candidates) {
    EXPECT_EQ(placement.sequence_id, 7);
    Plan plan;
    plan.num_ranks = 16;
    plan.placements = {placement};
    Batch batch;
    batch.sequences = {sequence};
    EXPECT_NO_THROW(validate_plan(plan, batch, 16, 24));
    const int64_t degree = placement.degree();
    for (int64_t k = 1; k < degree; ++k) EXPECT_EQ(placement.ranks[k], placement.ranks[0] + k);
    if (degree <= 8) EXPECT_EQ(placement.ranks.front() / 8, placement.ranks.back() / 8);
    if (degree > 8) {
      EXPECT_TRUE(placement.ranks.front() % 8 == 0 || (placement.ranks.back() + 1) % 8 == 0);
    }
    shapes.insert({degree, strategy_name(placement)});
  }
  std::map<std::pair<int64_t, std::string>, int64_t> count;
  for (const Placement& placement : candidates) {
    ++count[{placement.degree(), strategy_name(placement)}];
  }
  for (const auto& [shape, windows] : count) EXPECT_LE(windows, 3) << shape.second;
  auto windows = [&](int64_t degree, const std::string& name) {
    const auto it = count.find({degree, name});
    return it == count.end() ? int64_t{0} : it->second;
  };
  EXPECT_EQ(windows(1, "local"), 3);
  EXPECT_EQ(windows(4, "ulysses"), 3);
  EXPECT_EQ(windows(4, "ring"), 3);
  EXPECT_EQ(windows(4, "hybrid(2,2)"), 3);
  EXPECT_EQ(windows(16, "hybrid(8,2)"), 1);   // one 16-rank window on 16 GPUs
  EXPECT_EQ(windows(16, "hybrid(16,1)"), 0);  // a Ulysses group never spans nodes in a hybrid
  EXPECT_EQ(windows(16, "ulysses"), 1);
  EXPECT_THROW(candidate_placements(sequence, cost_model, 0), std::invalid_argument);

  // Uncapped, every rank is a local window and degree 2 has every offset in a node.
  const std::vector<Placement> all = candidate_placements(sequence, cost_model, 1000);
  int64_t local = 0, pairs = 0;
  for (const Placement& placement : all) {
    local += placement.degree() == 1;
    pairs += placement.degree() == 2 && placement.strategy == Strategy::kRing;
  }
  EXPECT_EQ(local, 16);
  EXPECT_EQ(pairs, 2 * 7);
}

// Thousands of equal sequences are interchangeable: planning them (the baselines zellige builds
// included) must cost about linearly in their count. 4x the sequences within 8x the thread CPU
// time (a step quadratic in them would take 16x). Best of three per size, so that a preempted
// run does not count.
double thread_cpu_s() {
  timespec now{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &now);
  return static_cast<double>(now.tv_sec) + 1e-9 * static_cast<double>(now.tv_nsec);
}

TEST(ZelligePlanner, EqualSequencesPlanInTimeAboutLinearInTheirCount) {
  const CostModel cost_model(model_preset("tiny"), seeded_profile(), make_cluster(8, 8));
  auto best_cpu_s = [&](int64_t count) {
    const Batch batch = batch_of(std::vector<int64_t>(count, 256), 8);
    double best_s = 1e9;
    for (int repeat = 0; repeat < 3; ++repeat) {
      const double start_s = thread_cpu_s();
      const Plan plan = make_plan("zellige", batch, cost_model, PlannerOptions{});
      best_s = std::min(best_s, thread_cpu_s() - start_s);
      EXPECT_EQ(plan.placements.size(), static_cast<size_t>(count));
    }
    return best_s;
  };
  const double small_s = best_cpu_s(4096);
  const double large_s = best_cpu_s(16384);
  EXPECT_LT(large_s, 8 * small_s) << "4096 sequences: " << small_s << " s, 16384: " << large_s;
}

// Many short sequences of three lengths per rank: a rank's attention calls, one per length and
// kind, set its launch floor, whatever the balance. Oracles: the batch's lower bound (which the
// plan must reach, grouping each length on ranks of its own) and every covered baseline, priced
// exactly (each mixes lengths on a rank and must be no faster).
// wan-1.3b under the seeded profile with host launch times of the order of an H200's
// (src/zellige/profiles/h200.json): short sequences wait for their launches.
CostModel launch_bound_model(int64_t gpus, int64_t gpus_per_node) {
  const HardwareProfile profile = with_launch_rows(seeded_profile(), "wan-1.3b", 0.016, 6e-4);
  CostOptions options;
  options.activation_checkpointing = true;
  return CostModel(model_preset("wan-1.3b"), profile, make_cluster(gpus, gpus_per_node), options);
}

// Two lengths of short images on two ranks, launch-bound: the best plan puts each length on a
// rank of its own (one call per kind there). Oracle: brute force over every placement.
TEST(ZelligePlanner, ShortSequencesOfTwoLengthsMatchBruteForce) {
  const CostModel cost_model = launch_bound_model(2, 2);
  const Batch batch = batch_of({64, 256, 64, 256, 256, 64}, 512);
  const Plan plan = make_plan("zellige", batch, cost_model, PlannerOptions{});
  EXPECT_LE(plan.predicted.makespan_s, brute_force_makespan(batch, cost_model) * (1 + 1e-12))
      << plan.note;
}

TEST(ZelligePlanner, ManyShortSequencesOfFewLengthsReachTheLowerBound) {
  const CostModel cost_model = launch_bound_model(64, 8);
  std::mt19937 rng(7);
  const int64_t image_tokens[] = {64, 144, 256};
  std::vector<int64_t> lengths;
  for (int i = 0; i < 64 * 16; ++i) lengths.push_back(image_tokens[rng() % 3]);
  const Batch batch = batch_of(lengths, 512);
  const Plan plan = make_plan("zellige", batch, cost_model, PlannerOptions{});
  const double bound_s = makespan_lower_bound(batch, cost_model);
  EXPECT_LE(plan.predicted.makespan_s, bound_s * (1 + 1e-12)) << plan.note;
  EXPECT_GE(plan.predicted.makespan_s, bound_s * (1 - 1e-12));
  for (const std::string& name : covered_baselines(batch, cost_model)) {
    SCOPED_TRACE(name);
    const Plan other = make_plan(name, batch, cost_model, PlannerOptions{});
    EXPECT_LE(plan.predicted.makespan_s, other.predicted.makespan_s);
  }
}

}  // namespace
}  // namespace zellige
