// Attention calls of few heads (the profile's call tables: priced in the shares, each segment a
// call of its own; evaluate() gives back what grouping equal segments saves) and the host's
// launch floor (evaluate()).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <vector>

#include "test_util.h"
#include "zellige/cost_model.h"
#include "zellige/planners.h"
#include "zellige/simulator.h"

namespace zellige {
namespace {

using test_util::seeded_profile;
using test_util::with_launch_rows;

// Per-head time of a call of H heads = (1 + 3 / H) x the per-head time of a very large call, at
// every length; measured up to 160 heads.
double slowdown(double heads) { return 1.0 + 3.0 / heads; }
const std::vector<double> kCallHeads = {1, 5, 10, 40, 160};

HardwareProfile call_profile() {
  HardwareProfile profile = seeded_profile();
  for (double length : {1024.0, 65536.0}) {
    Table table{kCallHeads, {}, "measured"};
    for (double h : kCallHeads) table.y.push_back(h * 1e-6 * length * length * slowdown(h));
    profile.attention_call_lengths.push_back(length);
    profile.attention_call_forward_s.push_back(table);
    profile.attention_call_backward_s.push_back(table);
  }
  profile.validate();
  return profile;
}

CostModel wan14b(const HardwareProfile& profile, int64_t gpus = 8) {
  return CostModel(model_preset("wan-14b"), profile, make_cluster(gpus, 8));
}

// What a call of `call_heads` heads over L x L costs beyond the full-call rate, all layers.
double expected_call_s(const CostModel& model, double length, double call_heads) {
  const HardwareProfile& profile = model.profile();
  const double excess = slowdown(call_heads) / slowdown(kCallHeads.back()) - 1.0;
  const double forward = profile.attention_forward_s_per_head(length);
  const double backward = profile.attention_backward_s_per_head(length);
  // one forward and one backward: checkpointing keeps the attention outputs (no recompute)
  return static_cast<double>(model.model().num_layers) * call_heads * excess * (forward + backward);
}

TEST(AttentionCalls, FewHeadCallsPayTheMeasuredSlowdown) {
  const CostModel model = wan14b(call_profile());
  const CostModel plain = wan14b(seeded_profile());  // the same tables without call tables
  Batch batch = test_util::batch_of({20000, 40000});
  Plan plan;
  plan.num_ranks = 8;
  plan.placements = {make_placement(0, Strategy::kLocal, {0}),
                     make_placement(1, Strategy::kUlysses, {2, 3, 4, 5})};
  const PlanCost cost = model.evaluate(batch, plan);
  const PlanCost plain_cost = plain.evaluate(batch, plan);
  // Each segment is alone in its call: the shares carry the whole slowdown, call_s is 0.
  EXPECT_NEAR(cost.ranks[0].attention_s - plain_cost.ranks[0].attention_s,
              expected_call_s(model, 20000, 40), 1e-9);
  EXPECT_NEAR(cost.ranks[2].attention_s - plain_cost.ranks[2].attention_s,
              expected_call_s(model, 40000, 10), 1e-9);
  EXPECT_EQ(cost.ranks[0].call_s, 0);
  EXPECT_EQ(cost.ranks[2].call_s, 0);
  // 10 heads a call lose more per head than 40.
  EXPECT_GT(expected_call_s(model, 40000, 10) / plain_cost.ranks[2].attention_s,
            expected_call_s(model, 20000, 40) / plain_cost.ranks[0].attention_s);
  EXPECT_EQ(cost.ranks[0].attention_calls, 1);
  EXPECT_EQ(cost.ranks[1].attention_calls, 0);
  EXPECT_DOUBLE_EQ(cost.ranks[0].time_s, cost.ranks[0].linear_s + cost.ranks[0].attention_s);
  EXPECT_EQ(plain_cost.ranks[0].call_s, 0);
  // The shares the planners add up carry the same slowdown.
  const RankShare share = model.shares(batch.sequences[1], plan.placements[1])[0];
  EXPECT_DOUBLE_EQ(share.attention_s, cost.ranks[2].attention_s);
}

TEST(AttentionCalls, EqualSegmentsShareOneCallAndRingStepsDoNot) {
  const CostModel model = wan14b(call_profile());
  const CostModel plain = wan14b(seeded_profile());
  Batch batch = test_util::batch_of({20000, 20000, 40000, 3000}, /*text_tokens=*/512);
  Plan plan;
  plan.num_ranks = 8;
  plan.placements = {
      make_placement(0, Strategy::kLocal, {0}), make_placement(1, Strategy::kLocal, {0}),
      make_placement(2, Strategy::kRing, {6, 7}), make_placement(3, Strategy::kLocal, {1})};
  const PlanCost cost = model.evaluate(batch, plan);
  const PlanCost plain_cost = plain.evaluate(batch, plan);
  // Rank 0: one self-attention call of 80 heads and one cross-attention call of 80: the shares
  // priced four calls of 40; one call of 80 loses less per head, and call_s gives that back.
  EXPECT_EQ(cost.ranks[0].attention_calls, 2);
  const double priced_alone = cost.ranks[0].attention_s - plain_cost.ranks[0].attention_s;
  EXPECT_LT(cost.ranks[0].call_s, 0);
  EXPECT_GT(priced_alone + cost.ranks[0].call_s, 0);
  // Rank 1 and the ring's ranks hold no equal segments: nothing to give back.
  EXPECT_EQ(cost.ranks[1].call_s, 0);
  // Ring: two steps (two calls) and one cross-attention call on each rank.
  EXPECT_EQ(cost.ranks[6].attention_calls, 3);
  EXPECT_EQ(cost.ranks[7].attention_calls, 3);
  EXPECT_EQ(cost.ranks[6].call_s, 0);
  // The lower bound prices attention at the per-head tables, below any call's rate.
  EXPECT_LE(makespan_lower_bound(batch, model), cost.makespan_s);
}

TEST(AttentionCalls, LaunchFloorBindsOnlyTinyRanks) {
  const HardwareProfile profile = with_launch_rows(call_profile(), "wan-14b", 5e-3, 1e-3);
  const CostModel model = wan14b(profile);
  Batch batch = test_util::batch_of({256, 300, 60000}, /*text_tokens=*/512);
  Plan plan;
  plan.num_ranks = 8;
  plan.placements = {make_placement(0, Strategy::kLocal, {0}),
                     make_placement(1, Strategy::kLocal, {0}),
                     make_placement(2, Strategy::kLocal, {1})};
  const PlanCost cost = model.evaluate(batch, plan);
  const double layers = 40;
  // Rank 0: 2 distinct lengths, each a self- and a cross-attention call.
  EXPECT_EQ(cost.ranks[0].attention_calls, 4);
  EXPECT_NEAR(cost.ranks[0].launch_floor_s, layers * (5e-3 + 4 * 1e-3), 1e-12);
  EXPECT_DOUBLE_EQ(cost.ranks[0].time_s, cost.ranks[0].launch_floor_s);
  EXPECT_GT(cost.ranks[1].time_s, cost.ranks[1].launch_floor_s);
  EXPECT_DOUBLE_EQ(cost.ranks[1].time_s,
                   cost.ranks[1].linear_s + cost.ranks[1].attention_s + cost.ranks[1].call_s);
  EXPECT_EQ(cost.ranks[2].time_s, 0);  // an idle rank waits for nothing
  EXPECT_EQ(cost.ranks[2].launch_floor_s, 0);

  // The timeline still ends at the rank times.
  std::vector<double> end(8, 0.0);
  for (const TimelineSegment& segment : simulate(batch, plan, model)) {
    end[segment.rank] = segment.end_s;
  }
  for (int64_t rank = 0; rank < 8; ++rank) EXPECT_NEAR(end[rank], cost.ranks[rank].time_s, 1e-9);

  // The floor was measured with wan-14b's blocks: another model gets none from it.
  const CostModel other(model_preset("wan-1.3b"), profile, make_cluster(8, 8));
  EXPECT_EQ(other.evaluate(batch, plan).ranks[0].launch_floor_s, 0);
}

TEST(AttentionCalls, EqualLengthsMergeWhereverTheyComeOnARankOfManyLengths) {
  const HardwareProfile profile = with_launch_rows(call_profile(), "wan-14b", 5e-3, 1e-3);
  const CostModel model = wan14b(profile);
  // Rank 0: 50 distinct lengths, each twice: the first five side by side (merged as they come),
  // the others 45 placements apart (past the distinct calls evaluate scans before it sorts).
  std::vector<int64_t> lengths;
  for (int64_t k = 0; k < 5; ++k) lengths.insert(lengths.end(), 2, 256 + 16 * k);
  for (int pass = 0; pass < 2; ++pass) {
    for (int64_t k = 5; k < 50; ++k) lengths.push_back(256 + 16 * k);
  }
  const Batch batch = test_util::batch_of(lengths, /*text_tokens=*/512);
  Plan plan;
  plan.num_ranks = 8;
  for (int64_t id = 0; id < 100; ++id) {
    plan.placements.push_back(make_placement(id, Strategy::kLocal, {0}));
  }
  const PlanCost cost = model.evaluate(batch, plan);
  EXPECT_EQ(cost.ranks[0].attention_calls, 100);  // a self- and a cross-attention call per length
  // The same calls in another order, and through a cache, cost the same (the rank's other terms
  // add up in placement order: its time to rounding).
  Plan reversed = plan;
  std::reverse(reversed.placements.begin(), reversed.placements.end());
  EvaluationCache cache;
  for (const Plan* other : {&reversed, &plan}) {
    const PlanCost other_cost = model.evaluate(batch, *other, cache);
    EXPECT_EQ(other_cost.ranks[0].attention_calls, 100);
    EXPECT_EQ(other_cost.ranks[0].call_s, cost.ranks[0].call_s);
    EXPECT_DOUBLE_EQ(other_cost.ranks[0].time_s, cost.ranks[0].time_s);
  }
}

TEST(AttentionCalls, LowerBoundHoldsForPlannedBatches) {
  const CostModel model = wan14b(with_launch_rows(call_profile(), "wan-14b", 1e-3, 1e-4), 16);
  Recipe recipe;
  recipe.name = "images-and-clips";
  recipe.model = "wan-14b";
  recipe.text_tokens = 512;
  recipe.buckets = {{"256px", 1, 24, 250, 260, 1.0},
                    {"480p", 33, 2, 1500, 1600, 1.0},
                    {"720p", 81, 1, 3500, 3600, 1.0}};
  const Batch batch = generate_batch(recipe, 16, 3);
  for (const char* planner : {"dp-cost", "static-cp:4", "zellige"}) {
    const Plan plan = make_plan(planner, batch, model);
    EXPECT_LE(makespan_lower_bound(batch, model), model.evaluate(batch, plan).makespan_s)
        << planner;
  }
}

HardwareProfile ragged(HardwareProfile profile) {
  profile.attention_ragged = true;
  return profile;
}

TEST(AttentionCalls, RaggedTablesRunAtThePerHeadTablesAsOneCallEach) {
  const HardwareProfile dense = with_launch_rows(call_profile(), "wan-14b", 5e-3, 1e-3);
  const CostModel model = wan14b(dense);
  const CostModel ragged_model = wan14b(ragged(dense));
  const CostModel plain =
      wan14b(with_launch_rows(seeded_profile(), "wan-14b", 5e-3, 1e-3));  // no call tables
  // Rank 0: six distinct lengths (a local table of six calls, a cross-attention table of six).
  Batch batch = test_util::batch_of({300, 700, 1500, 3000, 6000, 9000, 20000}, 512);
  Plan plan;
  plan.num_ranks = 8;
  for (int64_t i = 0; i < 6; ++i) {
    plan.placements.push_back(make_placement(i, Strategy::kLocal, {0}));
  }
  plan.placements.push_back(make_placement(6, Strategy::kLocal, {1}));  // alone: no table
  const PlanCost cost = model.evaluate(batch, plan);
  const PlanCost ragged_cost = ragged_model.evaluate(batch, plan);
  const PlanCost plain_cost = plain.evaluate(batch, plan);
  const double layers = 40;
  EXPECT_EQ(cost.ranks[0].attention_calls, 12);
  EXPECT_EQ(ragged_cost.ranks[0].attention_calls, 2);
  EXPECT_NEAR(ragged_cost.ranks[0].launch_floor_s, layers * (5e-3 + 2 * 1e-3), 1e-12);
  EXPECT_LT(ragged_cost.ranks[0].launch_floor_s, cost.ranks[0].launch_floor_s);
  // Each segment at the per-head tables: none of the excess the shares priced.
  EXPECT_NEAR(ragged_cost.ranks[0].attention_s + ragged_cost.ranks[0].call_s,
              plain_cost.ranks[0].attention_s, 1e-9 * plain_cost.ranks[0].attention_s);
  EXPECT_LT(ragged_cost.ranks[0].time_s, cost.ranks[0].time_s);
  // A rank whose tables hold a sequence over kRaggedMaxSegmentTokens runs dense calls: priced
  // bit for bit as without ragged calls.
  EXPECT_EQ(ragged_cost.ranks[1].time_s, cost.ranks[1].time_s);
  EXPECT_EQ(ragged_cost.ranks[1].call_s, cost.ranks[1].call_s);
  EXPECT_EQ(ragged_cost.ranks[1].launch_floor_s, cost.ranks[1].launch_floor_s);
  EXPECT_EQ(ragged_cost.ranks[1].attention_calls, 2);
  EXPECT_LE(makespan_lower_bound(batch, ragged_model), ragged_cost.makespan_s);
  EvaluationCache cache;
  EXPECT_LE(ragged_model.makespan_floor(batch, plan, cache), ragged_cost.makespan_s);
}

TEST(AttentionCalls, ATableOfOneDenseCallOfShortSegmentsIsOneRaggedCall) {
  // Rank 0: three sequences of one length (a micro-batch of one bucket: each table is one dense
  // call); rank 1: one sequence alone. Both run each table as one ragged call, which gives back
  // the excess the shares priced (none is left for a lone segment's dense call to save).
  const HardwareProfile dense = with_launch_rows(call_profile(), "wan-14b", 5e-3, 1e-3);
  const CostModel model = wan14b(dense);
  const CostModel ragged_model = wan14b(ragged(dense));
  const CostModel plain =
      wan14b(with_launch_rows(seeded_profile(), "wan-14b", 5e-3, 1e-3));  // no call tables
  EXPECT_EQ(kRaggedMinCalls, 1);
  Batch batch = test_util::batch_of({3000, 3000, 3000, 4000}, 512);
  Plan plan;
  plan.num_ranks = 8;
  for (int64_t i = 0; i < 4; ++i) {
    plan.placements.push_back(make_placement(i, Strategy::kLocal, {i < 3 ? 0 : 1}));
  }
  const PlanCost cost = model.evaluate(batch, plan);
  const PlanCost ragged_cost = ragged_model.evaluate(batch, plan);
  const PlanCost plain_cost = plain.evaluate(batch, plan);
  for (int64_t rank : {0, 1}) {
    EXPECT_EQ(cost.ranks[rank].attention_calls, 2) << rank;
    EXPECT_EQ(ragged_cost.ranks[rank].attention_calls, 2) << rank;
    EXPECT_LT(ragged_cost.ranks[rank].call_s, 0) << rank;
    EXPECT_NEAR(ragged_cost.ranks[rank].attention_s + ragged_cost.ranks[rank].call_s,
                plain_cost.ranks[rank].attention_s, 1e-9 * plain_cost.ranks[rank].attention_s)
        << rank;
  }
  EXPECT_EQ(cost.ranks[1].call_s, 0);  // one segment per table: its own call, nothing merged
  EXPECT_LE(makespan_lower_bound(batch, ragged_model), ragged_cost.makespan_s);
}

TEST(AttentionCalls, RaggedTablesNeedOneHeadCountAndRingStepsStayCalls) {
  const CostModel model = wan14b(ragged(with_launch_rows(call_profile(), "wan-14b", 5e-3, 1e-3)));
  // Ranks 2 and 3: two sequences over Ulysses 2 (20 heads each) and one over Ulysses 3 with rank
  // 4 (14 or 13 heads): their exchanged table holds two head counts, so it stays three calls; the
  // cross-attention table (every head) is one ragged call. Ranks 6 and 7: a ring of two steps.
  Batch batch = test_util::batch_of({8000, 12000, 15000, 50000}, 512);
  Plan plan;
  plan.num_ranks = 8;
  plan.placements = {make_placement(0, Strategy::kUlysses, {2, 3}),
                     make_placement(1, Strategy::kUlysses, {2, 3}),
                     make_placement(2, Strategy::kUlysses, {2, 3, 4}),
                     make_placement(3, Strategy::kRing, {6, 7})};
  const PlanCost cost = model.evaluate(batch, plan);
  EXPECT_EQ(cost.ranks[2].attention_calls, 3 + 1);
  EXPECT_NEAR(cost.ranks[2].launch_floor_s, 40 * (5e-3 + (3 + 1) * 1e-3), 1e-12);
  // Without the third sequence, ranks 2 and 3 hold one head count: one ragged call each table.
  Plan two = plan;
  two.placements[2] = make_placement(2, Strategy::kLocal, {5});
  EXPECT_EQ(model.evaluate(batch, two).ranks[2].attention_calls, 2);
  // Ring: two steps and one cross-attention call, none ragged (one call in the cross table).
  EXPECT_EQ(cost.ranks[6].attention_calls, 3);
  EXPECT_EQ(cost.ranks[6].call_s, 0);
}

TEST(AttentionCalls, RaggedTablesHoldNoSegmentOverTheLengthLimit) {
  const CostModel model = wan14b(ragged(with_launch_rows(call_profile(), "wan-14b", 5e-3, 1e-3)));
  // Rank 0: three short sequences (one ragged call a table); rank 1: two short ones and one of
  // more than kRaggedMaxSegmentTokens, so its local table runs its three dense calls (its
  // cross-attention table too: the long sequence's queries).
  const int64_t long_tokens = kRaggedMaxSegmentTokens + 1000;
  Batch batch = test_util::batch_of({2000, 3000, 5000, 2500, 3500, long_tokens}, 512);
  Plan plan;
  plan.num_ranks = 8;
  for (int64_t i = 0; i < 6; ++i) {
    plan.placements.push_back(make_placement(i, Strategy::kLocal, {i < 3 ? 0 : 1}));
  }
  const PlanCost cost = model.evaluate(batch, plan);
  EXPECT_EQ(cost.ranks[0].attention_calls, 2);
  EXPECT_EQ(cost.ranks[1].attention_calls, 6);
  EXPECT_LT(cost.ranks[0].call_s, 0);  // the ragged tables give back the calls' excess
  EXPECT_EQ(cost.ranks[1].call_s, 0);  // distinct dense calls: each keeps its own
  EXPECT_LE(makespan_lower_bound(batch, model), cost.makespan_s);
}

// `model` charges 1 ps a byte of layout work beyond `plain`: every share of `placement` pays,
// and the extra time adds up to the bytes the placement exchanges less the routing of the
// sequence's tokens from rank 0 to the others (512 bytes a token each way for wan-14b).
void expect_charged_per_byte_sent(const CostModel& model, const CostModel& plain,
                                  const Sequence& sequence, const Placement& placement) {
  const std::vector<RankShare> with = model.shares(sequence, placement);
  const std::vector<RankShare> without = plain.shares(sequence, placement);
  double extra_bytes = 0;
  for (size_t i = 0; i < with.size(); ++i) {
    EXPECT_GT(with[i].attention_s, without[i].attention_s);
    extra_bytes += (with[i].attention_s - without[i].attention_s) / 1e-12;
  }
  const double routed = 2.0 * 512.0 * static_cast<double>(sequence.num_tokens - with[0].tokens);
  EXPECT_NEAR(extra_bytes, model.exchange_bytes(sequence, placement) - routed, 1e3);
}

TEST(UlyssesLayout, ChargesTheShardsPerByteSent) {
  HardwareProfile profile = seeded_profile();
  const CostModel plain = wan14b(profile);
  profile.ulysses_layout_s_per_byte = 1e-12;
  const CostModel model = wan14b(profile);
  const Sequence sequence = sequence_from_tokens(0, "video", 40000, 512, 0);
  expect_charged_per_byte_sent(model, plain, sequence,
                               make_placement(0, Strategy::kUlysses, {0, 1, 2, 3}));
  // A whole sequence sends nothing and pays nothing.
  const Placement local = make_placement(0, Strategy::kLocal, {0});
  EXPECT_DOUBLE_EQ(model.shares(sequence, local)[0].attention_s,
                   plain.shares(sequence, local)[0].attention_s);
  profile.ulysses_layout_s_per_byte = -1;
  EXPECT_THROW(profile.validate(), std::invalid_argument);
}

TEST(RingLayout, ChargesTheShardsPerByteSent) {
  HardwareProfile profile = seeded_profile();
  const CostModel plain = wan14b(profile);
  profile.ring_layout_s_per_byte = 1e-12;
  const CostModel model = wan14b(profile);
  const Sequence sequence = sequence_from_tokens(0, "video", 40000, 512, 0);
  expect_charged_per_byte_sent(model, plain, sequence,
                               make_placement(0, Strategy::kRing, {0, 1, 2, 3}));
  // Ulysses shards pay the Ulysses rate, not the ring one.
  const Placement ulysses = make_placement(0, Strategy::kUlysses, {0, 1, 2, 3});
  EXPECT_DOUBLE_EQ(model.shares(sequence, ulysses)[0].attention_s,
                   plain.shares(sequence, ulysses)[0].attention_s);
  profile.ring_layout_s_per_byte = std::nan("");
  EXPECT_THROW(profile.validate(), std::invalid_argument);
}

TEST(AttentionCalls, ProfileRejectsBadCallTables) {
  HardwareProfile profile = call_profile();
  profile.attention_call_backward_s.pop_back();
  EXPECT_THROW(profile.validate(), std::invalid_argument);
  profile = call_profile();
  profile.attention_call_lengths = {65536, 1024};
  EXPECT_THROW(profile.validate(), std::invalid_argument);
  profile = call_profile();
  profile.attention_call_forward_s[0] = Table{};
  EXPECT_THROW(profile.validate(), std::invalid_argument);
  profile = with_launch_rows(call_profile(), "wan-14b", 1e-3, 1e-4);
  profile.launch_s_per_attention_call = {-1};
  EXPECT_THROW(profile.validate(), std::invalid_argument);
  profile.launch_s_per_attention_call = {1e-4, 1e-4};  // one row per memory model
  EXPECT_THROW(profile.validate(), std::invalid_argument);
}

}  // namespace
}  // namespace zellige
