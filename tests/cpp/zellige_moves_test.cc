// zellige's whole-anchor moves (cpp/src/planners/zellige_moves.cc): an anchor moved to an aligned
// window of another degree, two anchors put on the union of their ranks. Checked through the
// local search alone (planners::zellige_search) from chosen and from random starting plans,
// against the brute-force optimum on tiny clusters.
#include <gtest/gtest.h>

#include <algorithm>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "../../cpp/src/planners/registry.h"
#include "test_util.h"
#include "zellige/cost_model.h"
#include "zellige/planners.h"

namespace zellige {
namespace {

using test_util::seeded_profile;

// No call tables and no launch floor: evaluate() is then the search's own additive rank time.
CostModel model_of(const std::string& model, int64_t gpus, int64_t gpus_per_node) {
  return CostModel(model_preset(model), seeded_profile(), make_cluster(gpus, gpus_per_node));
}

double makespan(const CostModel& cost_model, const Batch& batch, const Plan& plan) {
  const PlanCost cost = cost_model.evaluate(batch, plan);  // also validates the plan
  EXPECT_TRUE(cost.fits);
  return cost.makespan_s;
}

std::vector<int64_t> iota_ranks(int64_t first, int64_t count) {
  std::vector<int64_t> ranks(static_cast<size_t>(count));
  for (int64_t k = 0; k < count; ++k) ranks[k] = first + k;
  return ranks;
}

TEST(ZelligeMoves, TwoAnchorsShareTheUnionOfTheirRanks) {
  // Two long videos, each a ring on its own half of a node: the longer one's half is the
  // bottleneck. Single-rank steps end with it on three ranks and the other whole on the fourth;
  // both on all four ranks is the optimum (brute force), and the pair move finds it.
  const CostModel cost_model = model_of("wan-14b", 4, 4);
  const Batch batch = test_util::batch_of({120000, 60000});
  Plan start;
  start.num_ranks = 4;
  start.placements = {make_placement(0, Strategy::kRing, {0, 1}),
                      make_placement(1, Strategy::kRing, {2, 3})};
  const Plan without = planners::zellige_search(batch, cost_model, start, false);
  const Plan with = planners::zellige_search(batch, cost_model, start, true);
  const double start_s = makespan(cost_model, batch, start);
  const double without_s = makespan(cost_model, batch, without);
  const double with_s = makespan(cost_model, batch, with);
  EXPECT_LE(without_s, start_s * (1 + 1e-12));
  EXPECT_LT(with_s, 0.99 * without_s);
  for (const Placement& placement : with.placements) EXPECT_EQ(placement.ranks, iota_ranks(0, 4));
  EXPECT_NEAR(with_s, test_util::brute_force_makespan(batch, cost_model), 1e-9 * with_s);
}

TEST(ZelligeMoves, AnAnchorMovesToAnAlignedWindowOfAnotherDegree) {
  // Two nodes of four; two videos stacked on node 1, node 0 idle. Single-rank steps widen one of
  // them rank by rank over both nodes (each rank of node 1 keeps both) and stop there; moving
  // them whole to aligned windows (here: both over all eight ranks) is 20% faster.
  const CostModel cost_model = model_of("wan-14b", 8, 4);
  const Batch batch = test_util::batch_of({40000, 16384});
  Plan start;
  start.num_ranks = 8;
  start.placements = {make_placement(0, Strategy::kRing, iota_ranks(4, 4)),
                      make_placement(1, Strategy::kRing, iota_ranks(4, 4))};
  const Plan without = planners::zellige_search(batch, cost_model, start, false);
  const Plan with = planners::zellige_search(batch, cost_model, start, true);
  const double start_s = makespan(cost_model, batch, start);
  const double without_s = makespan(cost_model, batch, without);
  const double with_s = makespan(cost_model, batch, with);
  EXPECT_LE(without_s, start_s * (1 + 1e-12));
  EXPECT_LT(with_s, 0.8 * without_s);
  // Each video ends on an aligned window (consecutive ranks from a multiple of its degree, or of
  // the node size beyond a node), which only the whole-anchor moves reach from this start.
  for (const Placement& placement : with.placements) {
    const int64_t degree = placement.degree();
    EXPECT_EQ(placement.ranks, iota_ranks(placement.ranks.front(), degree));
    EXPECT_EQ(placement.ranks.front() % std::min<int64_t>(degree, 4), 0);
  }
}

TEST(ZelligeMoves, SearchFromRandomPlansNeverRaisesTheMakespanNorBeatsTheOptimum) {
  // Random valid starting plans on tiny clusters; the search with every move must end valid,
  // within memory, no slower than where it started, and never below the brute-force optimum.
  std::mt19937_64 random(15);
  const std::vector<int64_t> lengths = {2048, 16384, 40000, 90000, 150000};
  int64_t improved = 0, cases = 0;
  for (const auto& [gpus, gpus_per_node] :
       std::vector<std::pair<int64_t, int64_t>>{{4, 2}, {4, 4}, {3, 3}}) {
    const CostModel cost_model = model_of("wan-14b", gpus, gpus_per_node);
    for (int trial = 0; trial < 12; ++trial) {
      const int64_t count = 2 + static_cast<int64_t>(random() % 2);
      std::vector<int64_t> picked;
      for (int64_t i = 0; i < count; ++i) picked.push_back(lengths[random() % lengths.size()]);
      const Batch batch = test_util::batch_of(picked);
      Plan start;
      start.num_ranks = gpus;
      for (int64_t i = 0; i < count; ++i) {
        const Sequence& sequence = batch.sequences[i];
        const std::vector<Placement> options = test_util::all_placements(
            i, gpus, cost_model.model().num_heads,
            attended_tokens(cost_model.model(), sequence.num_tokens, sequence.text_tokens));
        start.placements.push_back(options[random() % options.size()]);
      }
      if (!cost_model.evaluate(batch, start).fits) continue;
      const std::string context =
          std::to_string(gpus) + "x" + std::to_string(gpus_per_node) + " trial " +
          std::to_string(trial);
      const Plan searched = planners::zellige_search(batch, cost_model, start, true);
      const double start_s = makespan(cost_model, batch, start);
      const double searched_s = makespan(cost_model, batch, searched);
      EXPECT_LE(searched_s, start_s * (1 + 1e-9)) << context;
      EXPECT_GE(searched_s, test_util::brute_force_makespan(batch, cost_model) * (1 - 1e-9))
          << context;
      improved += searched_s < start_s * (1 - 1e-6) ? 1 : 0;
      ++cases;
    }
  }
  EXPECT_GE(cases, 20);
  EXPECT_GE(improved, cases / 2);  // the search does move
}

TEST(ZelligeMoves, EqualMakespanStepsLowerTheFullestRank) {
  // Four ranks: a long video as a ring on ranks 0-1 (the busiest, time T each), short clips on
  // rank 2 (more tokens than a ring share, so more bytes, in under T) and one medium video on
  // rank 3 (under T, fewer bytes). No move lowers ranks 0-1 without lifting another rank to T, so
  // the search stops there; the equal-makespan memory steps then move clips from rank 2 to rank 3
  // while rank 3 stays within T: the same makespan, a lower peak.
  const CostModel cost_model = model_of("wan-14b", 4, 4);
  const int64_t long_tokens = 60000, clip_tokens = 2048;
  // A plan of the long video as a ring on ranks 0-1, the clips on rank 2, the medium on rank 3.
  auto plan_of = [](size_t num_clips, bool medium) {
    Plan plan;
    plan.num_ranks = 4;
    plan.placements = {make_placement(0, Strategy::kRing, {0, 1})};
    int64_t id = 1;
    if (medium) plan.placements.push_back(make_placement(id++, Strategy::kLocal, {3}));
    for (size_t i = 0; i < num_clips; ++i) {
      plan.placements.push_back(make_placement(id++, Strategy::kLocal, {2}));
    }
    return plan;
  };
  auto lengths_of = [&](size_t num_clips, int64_t medium_tokens) {
    std::vector<int64_t> lengths = {long_tokens};
    if (medium_tokens > 0) lengths.push_back(medium_tokens);
    lengths.insert(lengths.end(), num_clips, clip_tokens);
    return lengths;
  };
  auto rank_s = [&](size_t num_clips, int64_t medium_tokens, int64_t rank) {
    const Batch batch = test_util::batch_of(lengths_of(num_clips, medium_tokens));
    const PlanCost cost = cost_model.evaluate(batch, plan_of(num_clips, medium_tokens > 0));
    return cost.fits ? cost.ranks[rank].time_s : std::numeric_limits<double>::infinity();
  };
  const double ring_s = rank_s(0, 0, 0);
  size_t num_clips = 0;
  while (rank_s(num_clips + 1, 0, 2) < 0.9 * ring_s) ++num_clips;
  int64_t medium_tokens = 1024;
  while (rank_s(num_clips, 2 * medium_tokens, 3) < 0.8 * ring_s) medium_tokens *= 2;
  const Batch batch = test_util::batch_of(lengths_of(num_clips, medium_tokens));
  const Plan start = plan_of(num_clips, true);
  const PlanCost start_cost = cost_model.evaluate(batch, start);
  ASSERT_TRUE(start_cost.fits);
  ASSERT_GT(num_clips, 4u);
  ASSERT_GT(start_cost.ranks[2].peak_bytes, start_cost.ranks[0].peak_bytes);  // the fullest
  ASSERT_GT(start_cost.ranks[2].peak_bytes, start_cost.ranks[3].peak_bytes);
  ASSERT_NEAR(start_cost.makespan_s, ring_s, 1e-9 * ring_s);  // ranks 0-1 are the busiest

  const Plan without = planners::zellige_search(batch, cost_model, start, false);
  const Plan with = planners::zellige_search(batch, cost_model, start, true);
  const PlanCost without_cost = cost_model.evaluate(batch, without);
  const PlanCost with_cost = cost_model.evaluate(batch, with);
  ASSERT_TRUE(with_cost.fits);
  EXPECT_NEAR(without_cost.makespan_s, start_cost.makespan_s, 1e-9 * start_cost.makespan_s);
  EXPECT_NEAR(without_cost.peak_bytes, start_cost.peak_bytes, 1e-9 * start_cost.peak_bytes);
  EXPECT_LE(with_cost.makespan_s, start_cost.makespan_s * (1 + 1e-9));
  EXPECT_LT(with_cost.peak_bytes, without_cost.peak_bytes * 0.99);
}

}  // namespace
}  // namespace zellige
