// The attention engine's CUDA streams in the cost model: the assignment both sides use, and the
// pricing of a cross-attention table whose calls run side by side.
#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

#include "test_util.h"
#include "zellige/cost_model.h"
#include "zellige/planners.h"

namespace zellige {
namespace {

using test_util::brute_force_makespan;
using test_util::seeded_profile;

HardwareProfile streamed_profile(int64_t streams, double overlap) {
  HardwareProfile profile = seeded_profile();
  profile.attention_streams = streams;
  profile.attention_stream_overlap = overlap;
  profile.validate();
  return profile;
}

// Many sequences of distinct lengths, all local on rank 0 of `num_ranks`: one cross-attention
// call each (distinct chunk lengths), the table the engine spreads over its streams.
std::pair<Batch, Plan> distinct_local_pack(int64_t count, int64_t num_ranks,
                                           int64_t text_tokens) {
  Batch batch;
  Plan plan;
  plan.num_ranks = num_ranks;
  for (int64_t i = 0; i < count; ++i) {
    batch.sequences.push_back(sequence_from_tokens(i, "video", 900 + 517 * i, text_tokens, 0));
    plan.placements.push_back(make_placement(i, Strategy::kLocal, {0}));
  }
  return {batch, plan};
}

TEST(StreamAssignment, LongestFirstToTheLeastLoaded) {
  EXPECT_EQ(stream_assignment({100, 90, 30, 20, 10, 5}, 2),
            (std::vector<int64_t>{0, 1, 1, 0, 0, 1}));
  EXPECT_EQ(stream_assignment({8, 8, 8, 8, 8}, 3), (std::vector<int64_t>{0, 1, 2, 0, 1}));
  EXPECT_EQ(stream_assignment({5, 4}, 1), (std::vector<int64_t>{0, 0}));
  EXPECT_EQ(stream_assignment({5, 4}, 0), (std::vector<int64_t>{0, 0}));
  EXPECT_TRUE(stream_assignment({}, 4).empty());
}

TEST(StreamedCalls, SumMinusTheMeasuredShareOfTheIdealGain) {
  const std::vector<int64_t> works = {100, 90, 30, 20};
  const std::vector<double> seconds = {1.0, 0.9, 0.3, 0.25};
  const double sum = 1.0 + 0.9 + 0.3 + 0.25;
  EXPECT_EQ(streamed_calls_s(works, seconds, 1, 0.7), sum);  // one stream: serial
  EXPECT_EQ(streamed_calls_s(works, seconds, 2, 0.0), sum);  // nothing overlaps
  // 2 streams: {100, 20} on stream 0 (1.25 s), {90, 30} on stream 1 (1.2 s)
  EXPECT_DOUBLE_EQ(streamed_calls_s(works, seconds, 2, 1.0), 1.25);
  EXPECT_DOUBLE_EQ(streamed_calls_s(works, seconds, 2, 0.4), sum - 0.4 * (sum - 1.25));
  // more streams than calls: each alone, the longest is the most loaded
  EXPECT_DOUBLE_EQ(streamed_calls_s(works, seconds, 8, 1.0), 1.0);
  EXPECT_THROW(streamed_calls_s(works, {1.0}, 2, 0.5), std::invalid_argument);
}

TEST(CostModel, OneStreamOrNoOverlapReproducesTheSerialPrices) {
  const auto [batch, plan] = distinct_local_pack(12, 4, 512);
  const ModelSpec model = model_preset("wan-14b");
  const Cluster cluster = make_cluster(4, 4);
  const PlanCost serial = CostModel(model, seeded_profile(), cluster).evaluate(batch, plan);
  for (const auto& [streams, overlap] :
       std::vector<std::pair<int64_t, double>>{{1, 0.0}, {1, 0.8}, {2, 0.0}, {4, 0.0}}) {
    const PlanCost cost =
        CostModel(model, streamed_profile(streams, overlap), cluster).evaluate(batch, plan);
    for (size_t r = 0; r < cost.ranks.size(); ++r) {
      EXPECT_EQ(cost.ranks[r].time_s, serial.ranks[r].time_s) << streams << " " << overlap;
      EXPECT_EQ(cost.ranks[r].call_s, serial.ranks[r].call_s);
      EXPECT_EQ(cost.ranks[r].stream_s, 0.0);
    }
    EXPECT_EQ(cost.makespan_s, serial.makespan_s);
  }
}

TEST(CostModel, StreamsTakeTheirMeasuredShareOffTheCrossAttentionTable) {
  const auto [batch, plan] = distinct_local_pack(12, 4, 512);
  const ModelSpec model = model_preset("wan-14b");
  const Cluster cluster = make_cluster(4, 4);
  const RankCost serial = CostModel(model, seeded_profile(), cluster).evaluate(batch, plan).ranks[0];
  const RankCost full = CostModel(model, streamed_profile(2, 1.0), cluster).evaluate(batch, plan).ranks[0];
  const RankCost half = CostModel(model, streamed_profile(2, 0.5), cluster).evaluate(batch, plan).ranks[0];
  const RankCost four = CostModel(model, streamed_profile(4, 1.0), cluster).evaluate(batch, plan).ranks[0];
  EXPECT_LT(full.stream_s, 0);
  EXPECT_NEAR(half.stream_s, 0.5 * full.stream_s, 1e-12 * serial.time_s);
  EXPECT_LT(four.stream_s, full.stream_s);  // 12 calls: 4 streams hide more than 2
  EXPECT_DOUBLE_EQ(full.time_s, serial.time_s + full.stream_s);
  EXPECT_DOUBLE_EQ(full.call_s, serial.call_s + full.stream_s);
  // Only the cross-attention calls overlap: at most (1 - 1/2) of them, and far less than the
  // rank's self-attention, which runs on one stream.
  EXPECT_LT(-full.stream_s, 0.5 * serial.attention_s);
  // Ranks without calls, and a model without cross-attention (joint: one table on one stream),
  // keep their serial prices.
  EXPECT_EQ(full.tokens, serial.tokens);
  const ModelSpec joint = model_preset("mmdit-11b");
  const PlanCost joint_serial = CostModel(joint, seeded_profile(), cluster).evaluate(batch, plan);
  const PlanCost joint_streams =
      CostModel(joint, streamed_profile(2, 1.0), cluster).evaluate(batch, plan);
  EXPECT_EQ(joint_streams.makespan_s, joint_serial.makespan_s);
  EXPECT_EQ(joint_streams.ranks[0].stream_s, 0.0);
}

TEST(LowerBound, StaysBelowWithStreamsThatOverlapFully) {
  HardwareProfile profile = streamed_profile(2, 1.0);
  const ModelSpec tiny = model_preset("tiny");
  const std::vector<std::vector<std::pair<int64_t, int64_t>>> cases = {
      {{300, 8}, {300, 8}, {300, 8}}, {{64, 8}, {64, 8}, {5000, 8}},
      {{2000, 8}, {3000, 16}, {2000, 16}}, {{700, 64}, {900, 32}, {1100, 16}}};
  const Cluster cluster = make_cluster(2, 2);
  for (bool checkpointing : {true, false}) {
    CostOptions options;
    options.activation_checkpointing = checkpointing;
    const CostModel cost_model(tiny, profile, cluster, options);
    for (const auto& lengths : cases) {
      Batch batch;
      for (size_t i = 0; i < lengths.size(); ++i) {
        batch.sequences.push_back(sequence_from_tokens(static_cast<int64_t>(i), "video",
                                                       lengths[i].first, lengths[i].second, 0));
      }
      EXPECT_LE(makespan_lower_bound(batch, cost_model),
                brute_force_makespan(batch, cost_model) * (1 + 1e-12))
          << checkpointing << " " << lengths[0].first;
    }
  }
  // The memoised floor of the planners, on plans of many local sequences of distinct lengths.
  std::mt19937_64 random(3);
  const CostModel wan(model_preset("wan-14b"), profile, make_cluster(8, 8));
  for (int trial = 0; trial < 6; ++trial) {
    Batch batch;
    for (int64_t i = 0; i < 40; ++i) {
      const int64_t tokens = 256 + static_cast<int64_t>(random() % 20000);
      batch.sequences.push_back(
          sequence_from_tokens(i, "video", tokens, 128 + static_cast<int64_t>(random() % 400),
                               static_cast<int64_t>(random() % 8)));
    }
    EvaluationCache cache;
    for (const std::string& name : {"dp-cost", "dp-tokens", "zellige"}) {
      const Plan plan = make_plan(name, batch, wan);
      const PlanCost cost = wan.evaluate(batch, plan);
      double saved = 0;
      for (const RankCost& rank : cost.ranks) saved += rank.stream_s;
      EXPECT_LT(saved, 0) << name;  // the streams are priced here
      EXPECT_LE(wan.makespan_floor(batch, plan, cache), cost.makespan_s * (1 + 1e-12)) << name;
    }
  }
}

}  // namespace
}  // namespace zellige
