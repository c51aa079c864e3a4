// Co-location for coalescing (cpp/src/planners/zellige_exact.cc): on an MMDiT batch of image
// buckets with per-sequence text 0-512 on 8 GPUs (the mmdit-text-dropout family), sequences of
// equal lengths are moved next to each other so that a rank's attention calls merge, priced by
// evaluate(): fewer calls, never a slower plan.
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "../../cpp/src/planners/registry.h"
#include "test_util.h"
#include "zellige/cost_model.h"
#include "zellige/planners.h"

namespace zellige {
namespace {

// The seeded profile with the host's launch floor for mmdit-11b's blocks (its other per-model
// rows analytic): a rank of many short sequences pays per distinct attention call.
CostModel mmdit_with_launch(int64_t gpus) {
  const HardwareProfile profile =
      test_util::with_launch_rows(test_util::seeded_profile(), "mmdit-11b", 2e-3, 1e-3);
  return CostModel(model_preset("mmdit-11b"), profile, make_cluster(gpus, 8));
}

// Images of three buckets, text 0-512 per sequence (one in ten dropped to 0), seeded.
Batch text_dropout_batch(uint64_t seed, int64_t count) {
  std::mt19937_64 rng(seed);
  const int64_t buckets[] = {256, 576, 1024};
  std::uniform_int_distribution<int> bucket(0, 2), text(1, 32), dropped(0, 9);
  Batch batch;
  for (int64_t i = 0; i < count; ++i) {
    const int64_t tokens = buckets[bucket(rng)];
    const int64_t text_tokens = dropped(rng) == 0 ? 0 : 16 * text(rng);
    batch.sequences.push_back(sequence_from_tokens(i, "image", tokens, text_tokens, i % 8));
  }
  return batch;
}

int64_t total_calls(const PlanCost& cost) {
  int64_t calls = 0;
  for (const RankCost& rank : cost.ranks) calls += rank.attention_calls;
  return calls;
}

int64_t busiest_calls(const PlanCost& cost) {
  const RankCost* busiest = &cost.ranks[0];
  for (const RankCost& rank : cost.ranks) {
    if (rank.time_s > busiest->time_s) busiest = &rank;
  }
  return busiest->attention_calls;
}

TEST(ZelligeCoalesce, EqualLengthsMergeTheirCallsOnFewerRanks) {
  const CostModel cost_model = mmdit_with_launch(8);
  for (const uint64_t seed : {1u, 2u}) {
    SCOPED_TRACE("seed " + std::to_string(seed));
    const Batch batch = text_dropout_batch(seed, 160);
    const Plan start = make_plan("dp-cost", batch, cost_model);
    const PlanCost before = cost_model.evaluate(batch, start);
    int64_t steps = 0;
    const Plan coalesced = planners::zellige_coalesce(batch, cost_model, start, &steps);
    const PlanCost after = cost_model.evaluate(batch, coalesced);  // also validates the plan
    EXPECT_GT(steps, 0);
    EXPECT_TRUE(after.fits);
    EXPECT_LT(total_calls(after), total_calls(before));
    EXPECT_LE(busiest_calls(after), busiest_calls(before));
    EXPECT_LT(after.makespan_s, before.makespan_s);
    // Only local sequences move, and only between ranks: the same sequences, each once.
    ASSERT_EQ(coalesced.placements.size(), start.placements.size());
    for (size_t i = 0; i < start.placements.size(); ++i) {
      EXPECT_EQ(coalesced.placements[i].sequence_id, start.placements[i].sequence_id);
      EXPECT_EQ(coalesced.placements[i].ranks.size(), start.placements[i].ranks.size());
    }
    // zellige takes the step too, and stays no slower than the baseline it may start from.
    const Plan planned = make_plan("zellige", batch, cost_model);
    EXPECT_LE(cost_model.evaluate(batch, planned).makespan_s, before.makespan_s * (1 + 1e-12));
  }
}

TEST(ZelligeCoalesce, NothingToMergeLeavesThePlan) {
  // Every length distinct: no call can merge, so no step is taken.
  const CostModel cost_model = mmdit_with_launch(8);
  Batch batch;
  for (int64_t i = 0; i < 24; ++i) {
    batch.sequences.push_back(sequence_from_tokens(i, "image", 1024, 16 * i, i % 8));
  }
  const Plan start = make_plan("dp-cost", batch, cost_model);
  int64_t steps = -1;
  const Plan coalesced = planners::zellige_coalesce(batch, cost_model, start, &steps);
  EXPECT_EQ(steps, 0);
  for (size_t i = 0; i < start.placements.size(); ++i) {
    EXPECT_EQ(coalesced.placements[i].ranks, start.placements[i].ranks);
  }
}

}  // namespace
}  // namespace zellige
