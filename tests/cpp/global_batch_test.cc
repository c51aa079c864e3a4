// The global-batch planner against its oracle: on tiny global batches that need 2-3
// micro-batches, every assignment of the sequences to at most 3 micro-batches, each placed by
// zellige; and against every global-batch baseline. Every plan holds each sequence exactly once
// and every micro-batch fits in memory.
#include "zellige/global_batch.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <limits>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "test_util.h"
#include "zellige/planners.h"

namespace zellige {
namespace {

using test_util::seeded_profile;

// How much slower than the best brute-force assignment the planner may be: it tries a handful
// of cuts, the oracle every one.
constexpr double kOracleTolerance = 0.02;

// GPUs whose room above the training state holds `tokens_per_rank` tokens of one local sequence
// each, so a global batch of a few long sequences needs several micro-batches.
CostModel tight_cost_model(const std::string& model, int64_t tokens_per_rank,
                           int64_t num_ranks = 4) {
  const Cluster roomy = make_cluster(num_ranks, std::min<int64_t>(num_ranks, 8));
  const CostModel probe(model_preset(model), seeded_profile(), roomy);
  const Sequence sequence = sequence_from_tokens(0, "video", tokens_per_rank, 0, 0);
  double bytes = 0;
  for (const RankShare& share :
       probe.shares(sequence, make_placement(0, Strategy::kLocal, {0}))) {
    bytes = std::max(bytes, share.memory_bytes);
  }
  Cluster cluster = roomy;
  cluster.gpu_memory_bytes =
      static_cast<int64_t>((probe.fixed_bytes() + bytes) / (1 - probe.options().memory_headroom));
  return CostModel(model_preset(model), seeded_profile(), cluster);
}

// Heavy-tailed: mostly short clips, one in `long_every` a long one.
Batch random_global_batch(int64_t num_sequences, std::mt19937_64& random, int64_t long_every = 3,
                          int64_t num_ranks = 4) {
  Batch batch;
  for (int64_t i = 0; i < num_sequences; ++i) {
    const bool long_one = static_cast<int64_t>(random() % long_every) == 0;
    const int64_t tokens = long_one ? 20000 + static_cast<int64_t>(random() % 40000)
                                    : 1024 + static_cast<int64_t>(random() % 12000);
    batch.sequences.push_back(sequence_from_tokens(i, "video", tokens, 0, i % num_ranks));
  }
  return batch;
}

// Every assignment of the batch to at most `max_micro_batches` micro-batches (restricted growth
// strings, so each partition once), placed by zellige; the least step time of those that fit.
double brute_force_step_s(const Batch& batch, const CostModel& cost_model,
                          int64_t max_micro_batches) {
  const int64_t n = static_cast<int64_t>(batch.sequences.size());
  std::vector<int64_t> label(n, 0);
  double best_s = std::numeric_limits<double>::infinity();
  while (true) {
    const int64_t parts = *std::max_element(label.begin(), label.end()) + 1;
    std::vector<std::vector<int64_t>> ids(parts);
    for (int64_t i = 0; i < n; ++i) ids[label[i]].push_back(batch.sequences[i].id);
    try {
      best_s = std::min(best_s, place_micro_batches("zellige", batch, ids, cost_model).step_time_s);
    } catch (const PlanMemoryError&) {
    }
    // Next restricted growth string: label[i] <= 1 + max(label[0..i-1]), < max_micro_batches.
    int64_t i = n - 1;
    for (; i > 0; --i) {
      const int64_t prefix_max = *std::max_element(label.begin(), label.begin() + i);
      if (label[i] <= prefix_max && label[i] + 1 < max_micro_batches) break;
    }
    if (i == 0) break;
    ++label[i];
    std::fill(label.begin() + i + 1, label.end(), 0);
  }
  return best_s;
}

// What zellige's abandoning of cuts rests on: the per-token layers alone, every token at the
// floor's least rate per token, spread over all ranks.
double token_bound_s(const Batch& batch, const CostModel& cost_model) {
  double tokens = 0;
  for (const Sequence& sequence : batch.sequences) {
    for (const RankShare& share :
         cost_model.shares(sequence, make_placement(sequence.id, Strategy::kLocal, {0}))) {
      tokens += static_cast<double>(share.tokens);
    }
  }
  return tokens * cost_model.min_floor_time_per_token_s() / cost_model.cluster().total_speed();
}

// Each micro-batch of a step of several priced holding the earlier ones' gradients.
void expect_valid(const GlobalPlan& plan, const Batch& batch, const CostModel& step_cost_model) {
  const CostModel cost_model = plan.micro_batches.size() > 1
                                   ? step_cost_model.accumulating_view()
                                   : step_cost_model;
  std::multiset<int64_t> ids;
  double total_s = 0;
  for (const MicroBatch& micro_batch : plan.micro_batches) {
    ASSERT_FALSE(micro_batch.batch.sequences.empty());
    ASSERT_EQ(micro_batch.plan.placements.size(), micro_batch.batch.sequences.size());
    for (const Sequence& sequence : micro_batch.batch.sequences) ids.insert(sequence.id);
    const PlanCost cost = cost_model.evaluate(micro_batch.batch, micro_batch.plan);
    EXPECT_TRUE(cost.fits);
    EXPECT_DOUBLE_EQ(cost.makespan_s, micro_batch.plan.predicted.makespan_s);
    EXPECT_GE(cost.makespan_s, token_bound_s(micro_batch.batch, cost_model) * (1 - 1e-12));
    total_s += cost.makespan_s;
  }
  std::multiset<int64_t> expected;
  for (const Sequence& sequence : batch.sequences) expected.insert(sequence.id);
  EXPECT_EQ(ids, expected);
  EXPECT_NEAR(plan.step_time_s, total_s, 1e-12 * total_s);
}

// What zellige's skipping of a baseline rests on, from a micro-batch's own placements: the ranks
// together run at least the sum of the placements' floors (CostModel::floor_rank_seconds), and
// the busiest rank at least each placement's mean floor per rank.
double shape_bound_s(const MicroBatch& micro_batch, const CostModel& cost_model) {
  EvaluationCache cache;
  double total_s = 0, busiest_s = 0;
  for (size_t i = 0; i < micro_batch.plan.placements.size(); ++i) {
    const Placement& placement = micro_batch.plan.placements[i];
    const double floor_s =
        cost_model.floor_rank_seconds(micro_batch.batch.sequences[i], placement, cache);
    total_s += floor_s;
    busiest_s = std::max(busiest_s, floor_s / static_cast<double>(placement.degree()));
  }
  return std::max(total_s / cost_model.cluster().total_speed(),
                  busiest_s / cost_model.cluster().max_speed());
}

TEST(GlobalBatch, NoWorseThanBruteForceAndEveryBaseline) {
  std::mt19937_64 random(30);
  int cases = 0, multi_micro_batch = 0;
  double worst_ratio = 0;
  for (const std::string model : {"wan-1.3b", "mmdit-11b"}) {
    for (int seed = 0; seed < 8; ++seed) {
      const CostModel cost_model = tight_cost_model(model, 24000);
      const Batch batch = random_global_batch(5 + seed % 3, random);
      const std::string where = model + " seed " + std::to_string(seed);
      const GlobalPlan plan = plan_global_batch("zellige", batch, cost_model);
      expect_valid(plan, batch, cost_model);
      const double oracle_s = brute_force_step_s(batch, cost_model, 3);
      ASSERT_LT(oracle_s, std::numeric_limits<double>::infinity()) << where;
      EXPECT_LE(plan.step_time_s, oracle_s * (1 + kOracleTolerance)) << where;
      worst_ratio = std::max(worst_ratio, plan.step_time_s / oracle_s);
      for (const std::string& baseline : global_batch_baseline_names()) {
        try {
          const GlobalPlan other = plan_global_batch(baseline, batch, cost_model);
          expect_valid(other, batch, cost_model);
          EXPECT_LE(plan.step_time_s, other.step_time_s) << where << " " << baseline;
        } catch (const PlanMemoryError&) {
        }
      }
      ++cases;
      multi_micro_batch += plan.micro_batches.size() > 1;
    }
  }
  std::printf("%d global batches, %d of them cut, worst step time / brute force %.4f\n", cases,
              multi_micro_batch, worst_ratio);
  EXPECT_GE(multi_micro_batch, cases / 2);  // the batches do exceed memory
}

// Larger global batches (past the size where zellige tries every cut, so its placement budget
// and abandoned cuts are exercised, on 128 GPUs also the baselines cut short by the lower bounds
// of their micro-batches): never slower than any baseline, every plan valid, and no step faster
// than the lower bound of the whole batch, which no cut into micro-batches beats (a sum of
// makespans is at least the rank-seconds over the ranks; benchmark's ceiling).
TEST(GlobalBatch, NeverWorseThanEveryBaselineOnRandomGlobalBatches) {
  std::mt19937_64 random(300);
  int cut_cases = 0;
  for (const std::string model : {"wan-1.3b", "mmdit-11b"}) {
    for (const int64_t num_ranks : {8, 16, 128}) {
      // On 128 GPUs, less memory each and more sequences, so that the batch still needs several
      // micro-batches and every baseline fits.
      const bool large = num_ranks > 16;
      const CostModel cost_model = tight_cost_model(model, large ? 24000 : 48000, num_ranks);
      for (int seed = 0; seed < 2; ++seed) {
        const Batch batch =
            random_global_batch((large ? 520 : 300) + 40 * seed, random, 6, num_ranks);
        const std::string where =
            model + " " + std::to_string(num_ranks) + " GPUs seed " + std::to_string(seed);
        const GlobalPlan plan = plan_global_batch("zellige", batch, cost_model);
        expect_valid(plan, batch, cost_model);
        const double bound_s = makespan_lower_bound(batch, cost_model);
        EXPECT_GE(plan.step_time_s, bound_s * (1 - 1e-12)) << where;
        for (const std::string& baseline : global_batch_baseline_names()) {
          try {
            const GlobalPlan other = plan_global_batch(baseline, batch, cost_model);
            expect_valid(other, batch, cost_model);
            EXPECT_LE(plan.step_time_s, other.step_time_s) << where << " " << baseline;
            EXPECT_GE(other.step_time_s, bound_s * (1 - 1e-12)) << where << " " << baseline;
            // What zellige's abandoning of baselines rests on: a step is at least the sum of its
            // micro-batches' bounds.
            double bounds_s = 0;
            for (const MicroBatch& micro_batch : other.micro_batches) {
              bounds_s += makespan_lower_bound(micro_batch.batch, cost_model);
            }
            EXPECT_GE(other.step_time_s, bounds_s * (1 - 1e-12)) << where << " " << baseline;
            for (const MicroBatch& micro_batch : other.micro_batches) {
              EXPECT_GE(micro_batch.plan.predicted.makespan_s,
                        shape_bound_s(micro_batch, cost_model) * (1 - 1e-12))
                  << where << " " << baseline;
            }
          } catch (const PlanMemoryError&) {
          }
        }
        cut_cases += plan.micro_batches.size() > 1;
      }
    }
  }
  EXPECT_EQ(cut_cases, 12);  // every batch exceeds memory
}

// Nearly equal sequences on 128 GPUs, where a baseline's cut may beat zellige's own (its
// micro-batch count, fewer than zellige tries first): zellige cuts each baseline short by the
// lower bounds of its remaining micro-batches, so a bound above a true makespan would drop the
// winner and break the promise here (a 5% overestimate does).
TEST(GlobalBatch, NeverWorseWhereABaselineCutWinsOnALargeCluster) {
  int baseline_cuts_chosen = 0;
  for (const std::string model : {"wan-1.3b", "mmdit-11b"}) {
    const CostModel cost_model = tight_cost_model(model, 12000, 128);
    for (const int64_t tokens : {1024, 4096, 16384}) {
      Batch batch;
      for (int64_t i = 0; i < 600; ++i) {
        batch.sequences.push_back(
            sequence_from_tokens(i, "video", tokens + (i % 7) * 64, 0, i % 128));
      }
      const std::string where = model + " " + std::to_string(tokens) + " tokens";
      const GlobalPlan plan = plan_global_batch("zellige", batch, cost_model);
      expect_valid(plan, batch, cost_model);
      for (const std::string& baseline : global_batch_baseline_names()) {
        try {
          const GlobalPlan other = plan_global_batch(baseline, batch, cost_model);
          EXPECT_LE(plan.step_time_s, other.step_time_s) << where << " " << baseline;
        } catch (const PlanMemoryError&) {
        }
      }
      baseline_cuts_chosen += plan.chosen != "zellige:spread" && plan.chosen != "zellige:grouped";
    }
  }
  // The case this test is for does occur (wan-1.3b at 4096 tokens; in the others zellige's own
  // cut at its best-estimated count wins).
  EXPECT_GE(baseline_cuts_chosen, 1);
}

// Two lengths only, on 128 GPUs: many micro-batches hold the same lengths and zellige places
// such a set once, the others taking its placements on their own sequences. Each such plan is
// priced anew and must be exact, cover its micro-batch and keep the never-worse promise.
TEST(GlobalBatch, MicroBatchesOfEqualLengthsPlannedOnceStayExact) {
  for (const std::string model : {"wan-1.3b", "mmdit-11b"}) {
    const CostModel cost_model = tight_cost_model(model, 12000, 128);
    Batch batch;
    for (int64_t i = 0; i < 900; ++i) {
      batch.sequences.push_back(
          sequence_from_tokens(i, "video", i % 5 == 0 ? 16384 : 2048, 0, i % 128));
    }
    const GlobalPlan plan = plan_global_batch("zellige", batch, cost_model);
    expect_valid(plan, batch, cost_model);
    std::set<std::multiset<int64_t>> lengths;
    for (const MicroBatch& micro_batch : plan.micro_batches) {
      std::multiset<int64_t> tokens;
      for (const Sequence& sequence : micro_batch.batch.sequences) {
        tokens.insert(sequence.num_tokens);
      }
      lengths.insert(tokens);
    }
    EXPECT_LT(lengths.size(), plan.micro_batches.size()) << model;  // the case does occur
    for (const std::string& baseline : global_batch_baseline_names()) {
      try {
        const GlobalPlan other = plan_global_batch(baseline, batch, cost_model);
        EXPECT_LE(plan.step_time_s, other.step_time_s) << model << " " << baseline;
      } catch (const PlanMemoryError&) {
      }
    }
  }
}

TEST(GlobalBatch, DeterministicForASeed) {
  std::mt19937_64 random(7);
  const CostModel cost_model = tight_cost_model("wan-1.3b", 24000);
  const Batch batch = random_global_batch(7, random);
  GlobalBatchOptions options;
  options.seed = 3;
  const GlobalPlan first = plan_global_batch("zellige", batch, cost_model, options);
  const GlobalPlan second = plan_global_batch("zellige", batch, cost_model, options);
  EXPECT_EQ(first.chosen, second.chosen);
  EXPECT_EQ(first.step_time_s, second.step_time_s);
  ASSERT_EQ(first.micro_batches.size(), second.micro_batches.size());
  for (size_t k = 0; k < first.micro_batches.size(); ++k) {
    const auto& a = first.micro_batches[k];
    const auto& b = second.micro_batches[k];
    ASSERT_EQ(a.plan.placements.size(), b.plan.placements.size());
    for (size_t i = 0; i < a.plan.placements.size(); ++i) {
      EXPECT_EQ(a.plan.placements[i].sequence_id, b.plan.placements[i].sequence_id);
      EXPECT_EQ(a.plan.placements[i].ranks, b.plan.placements[i].ranks);
      EXPECT_EQ(a.plan.placements[i].strategy, b.plan.placements[i].strategy);
    }
  }
}

TEST(GlobalBatch, OverheadPerMicroBatchCounts) {
  std::mt19937_64 random(11);
  const CostModel cost_model = tight_cost_model("wan-1.3b", 24000);
  const Batch batch = random_global_batch(6, random);
  GlobalBatchOptions options;
  options.micro_batch_overhead_s = 0.5;
  const GlobalPlan plan = plan_global_batch("zellige", batch, cost_model, options);
  double makespans_s = 0;
  for (const MicroBatch& micro_batch : plan.micro_batches) {
    makespans_s += micro_batch.plan.predicted.makespan_s;
  }
  EXPECT_NEAR(plan.step_time_s, makespans_s + 0.5 * static_cast<double>(plan.micro_batches.size()),
              1e-9);
}

// Micro-batches of a step of several are priced holding the earlier ones' gradients
// (CostModel::accumulating_view); a global batch that fits at once is a step of one, priced so.
TEST(GlobalBatch, MicroBatchesOfSeveralHoldTheEarlierGradients) {
  std::mt19937_64 random(5);
  const CostModel cost_model = tight_cost_model("wan-1.3b", 24000);
  const CostModel accumulating = cost_model.accumulating_view();
  const Batch batch = random_global_batch(7, random);
  for (const std::string& planner : global_batch_planner_names()) {
    SCOPED_TRACE(planner);
    const GlobalPlan plan = plan_global_batch(planner, batch, cost_model);
    ASSERT_GT(plan.micro_batches.size(), 1u);
    bool held_more = false;
    for (const MicroBatch& micro_batch : plan.micro_batches) {
      const PlanCost priced = accumulating.evaluate(micro_batch.batch, micro_batch.plan);
      const PlanCost alone = cost_model.evaluate(micro_batch.batch, micro_batch.plan);
      EXPECT_TRUE(priced.fits);
      for (size_t r = 0; r < priced.ranks.size(); ++r) {
        EXPECT_DOUBLE_EQ(micro_batch.plan.predicted.rank_peak_bytes[r], priced.ranks[r].peak_bytes);
        held_more = held_more || priced.ranks[r].peak_bytes > alone.ranks[r].peak_bytes;
      }
    }
    EXPECT_TRUE(held_more);
  }
  Batch small;
  small.sequences = {sequence_from_tokens(0, "video", 2000, 0, 0)};
  const GlobalPlan one = plan_global_batch("zellige", small, cost_model);
  ASSERT_EQ(one.micro_batches.size(), 1u);
  const PlanCost alone = cost_model.evaluate(small, one.micro_batches[0].plan);
  EXPECT_DOUBLE_EQ(one.micro_batches[0].plan.predicted.makespan_s, alone.makespan_s);
  EXPECT_DOUBLE_EQ(one.micro_batches[0].plan.predicted.rank_peak_bytes[0],
                   alone.ranks[0].peak_bytes);
  EXPECT_DOUBLE_EQ(one.step_time_s, alone.makespan_s);
}

TEST(GlobalBatch, RejectsBadInput) {
  const CostModel cost_model = tight_cost_model("wan-1.3b", 24000);
  const Batch batch = test_util::batch_of({4096, 8192});
  EXPECT_THROW(plan_global_batch("nope", batch, cost_model), std::invalid_argument);
  EXPECT_THROW(place_micro_batches("zellige", batch, {{0}}, cost_model), std::invalid_argument);
  EXPECT_THROW(place_micro_batches("zellige", batch, {{0, 1}, {1}}, cost_model),
               std::invalid_argument);
  EXPECT_THROW(place_micro_batches("zellige", batch, {{0, 1, 5}}, cost_model),
               std::invalid_argument);
  GlobalBatchOptions options;
  options.micro_batch_overhead_s = -1;
  EXPECT_THROW(plan_global_batch("zellige", batch, cost_model, options), std::invalid_argument);
}

// Two lengths alternating in loader order on 128 GPUs with little memory: knapformer's cut in
// loader order (local placements) comes close to zellige's own cuts, and on a looser memory or
// a step of one it wins.
// zellige skips or cuts short the baselines of one shape per sequence by their shape bounds, so
// a bound above a true makespan would drop a winner and break the promise.
TEST(GlobalBatch, NeverWorseWhereABaselineOfOneShapeWins) {
  for (const std::string model : {"wan-1.3b", "mmdit-11b"}) {
    const CostModel cost_model = tight_cost_model(model, 6000, 128);
    Batch batch;
    for (int64_t i = 0; i < 400; ++i) {
      batch.sequences.push_back(
          sequence_from_tokens(i, "video", 2048 + (i % 2) * 2048, 0, i % 128));
    }
    const GlobalPlan plan = plan_global_batch("zellige", batch, cost_model);
    expect_valid(plan, batch, cost_model);
    const GlobalPlan knapformer = plan_global_batch("knapformer", batch, cost_model);
    EXPECT_LE(plan.step_time_s, knapformer.step_time_s) << model << " " << plan.chosen;
  }
}

// Many short sequences on 128 GPUs, where the per-token layers are most of a micro-batch's time:
// zellige abandons cuts (its own and the baselines') by the token bounds of their remaining
// micro-batches, so the bound must stay below every makespan (expect_valid) while close to it
// here (a 10% overestimate fails), and the promise must hold.
TEST(GlobalBatch, TokenBoundHoldsAndIsTightOnShortSequences) {
  for (const std::string model : {"wan-1.3b", "mmdit-11b"}) {
    const CostModel cost_model = tight_cost_model(model, 12000, 128);
    Batch batch;
    for (int64_t i = 0; i < 2000; ++i) {
      batch.sequences.push_back(sequence_from_tokens(i, "video", 256 + (i % 7) * 16, 0, i % 128));
    }
    const GlobalPlan plan = plan_global_batch("zellige", batch, cost_model);
    expect_valid(plan, batch, cost_model);
    double tightest = 0;
    for (const MicroBatch& micro_batch : plan.micro_batches) {
      tightest = std::max(tightest, token_bound_s(micro_batch.batch, cost_model) /
                                        micro_batch.plan.predicted.makespan_s);
    }
    EXPECT_GT(tightest, 1 / 1.1) << model;
    for (const std::string& baseline : global_batch_baseline_names()) {
      try {
        const GlobalPlan other = plan_global_batch(baseline, batch, cost_model);
        expect_valid(other, batch, cost_model);
        EXPECT_LE(plan.step_time_s, other.step_time_s) << model << " " << baseline;
      } catch (const PlanMemoryError&) {
      }
    }
  }
}

}  // namespace
}  // namespace zellige
