// Planners: every sequence placed exactly once on valid distinct ranks, memory honoured or refused,
// the lower bound checked against a brute-force optimum on tiny batches, and each policy's rules.
#include "zellige/planners.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <limits>
#include <map>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "../../cpp/src/planners/rank_loads.h"
#include "../../cpp/src/planners/registry.h"
#include "test_util.h"
#include "zellige/cost_model.h"

namespace zellige {
namespace {

HardwareProfile test_profile() { return analytic_profile("test-h200", 700e12, 550e12, 4.2e12); }

CostModel make_cost_model(const std::string& model, int64_t num_gpus, int64_t gpus_per_node,
                          int64_t gpu_memory_bytes = 0) {
  Cluster cluster = make_cluster(num_gpus, gpus_per_node);
  if (gpu_memory_bytes > 0) cluster.gpu_memory_bytes = gpu_memory_bytes;
  return CostModel(model_preset(model), test_profile(), cluster);
}

// A memory size whose capacity (after headroom) is the fixed bytes plus `room_bytes`.
int64_t memory_for_room(const CostModel& cost_model, double room_bytes) {
  return static_cast<int64_t>((cost_model.fixed_bytes() + room_bytes) /
                              (1.0 - cost_model.options().memory_headroom));
}

// A bucketed loader in the shape of Open-Sora 2.0 stage 2: image micro-batches, short and long
// videos at 256px and 768px (tokens per latent frame 256 and 2304).
Recipe bucket_recipe() {
  Recipe recipe;
  recipe.name = "test-buckets";
  recipe.model = "mmdit-11b";
  recipe.text_tokens = 512;
  recipe.buckets = {
      {"256px", 1, 24, 250, 260, 1.0},   {"256px", 33, 4, 250, 260, 1.0},
      {"256px", 129, 1, 250, 260, 1.0},  {"768px", 1, 6, 2294, 2312, 1.0},
      {"768px", 33, 1, 2294, 2312, 1.0}, {"768px", 129, 1, 2294, 2312, 0.5},
  };
  return recipe;
}

// Names of every planner form that is valid for this cost model's cluster and heads.
std::vector<std::string> planners_for(const CostModel& cost_model) {
  const int64_t num_ranks = cost_model.cluster().num_ranks();
  const int64_t num_heads = cost_model.model().num_heads;
  std::vector<std::string> names = {"dp-tokens", "dp-cost", "megatron-dcp"};
  for (int64_t size : {1, 2, 4, 8, 16}) {
    if (size > num_ranks || num_ranks % size != 0) continue;
    names.push_back("static-cp:" + std::to_string(size));
    if (num_heads % size == 0) {
      names.push_back("knapformer:g" + std::to_string(size) + "n" +
                      std::to_string(num_ranks / size));
    }
  }
  if (num_ranks % 8 == 0 && num_heads % 4 == 0) {  // a mixed spec: g1n2+g2n1+g4n1 per 8 GPUs
    const int64_t blocks = num_ranks / 8;
    names.push_back("knapformer:g1n" + std::to_string(2 * blocks) + "+g2n" +
                    std::to_string(blocks) + "+g4n" + std::to_string(blocks) + ":0.7");
  }
  return names;
}

// Independent of validate_plan: ids, ranks and degrees checked from scratch.
void expect_places_every_sequence_once(const Plan& plan, const Batch& batch, int64_t num_ranks,
                                       int64_t num_heads, const std::string& context) {
  ASSERT_EQ(plan.placements.size(), batch.sequences.size()) << context;
  std::map<int64_t, int64_t> count_by_id;
  for (const Placement& placement : plan.placements) {
    ++count_by_id[placement.sequence_id];
    const std::set<int64_t> distinct(placement.ranks.begin(), placement.ranks.end());
    EXPECT_EQ(distinct.size(), placement.ranks.size()) << context;
    ASSERT_FALSE(placement.ranks.empty()) << context;
    EXPECT_GE(*distinct.begin(), 0) << context;
    EXPECT_LT(*distinct.rbegin(), num_ranks) << context;
    EXPECT_EQ(placement.ulysses_degree * placement.ring_degree, placement.degree()) << context;
    EXPECT_LE(placement.ulysses_degree, num_heads) << context;
    switch (placement.strategy) {
      case Strategy::kLocal:
        EXPECT_EQ(placement.degree(), 1) << context;
        break;
      case Strategy::kUlysses:
        EXPECT_EQ(placement.ring_degree, 1) << context;
        break;
      case Strategy::kRing:
        EXPECT_EQ(placement.ulysses_degree, 1) << context;
        break;
      case Strategy::kHybrid:
        EXPECT_GE(placement.ulysses_degree, 2) << context;
        EXPECT_GE(placement.ring_degree, 2) << context;
        break;
    }
  }
  for (const Sequence& sequence : batch.sequences) {
    EXPECT_EQ(count_by_id[sequence.id], 1) << context << " sequence " << sequence.id;
  }
  EXPECT_EQ(count_by_id.size(), batch.sequences.size()) << context;
}

void expect_prediction_consistent(const Plan& plan, const Batch& batch, const CostModel& cost_model,
                                  const std::string& context) {
  const PlanCost cost = cost_model.evaluate(batch, plan);
  EXPECT_DOUBLE_EQ(plan.predicted.makespan_s, cost.makespan_s) << context;
  ASSERT_EQ(plan.predicted.rank_time_s.size(), static_cast<size_t>(plan.num_ranks)) << context;
  EXPECT_DOUBLE_EQ(
      *std::max_element(plan.predicted.rank_time_s.begin(), plan.predicted.rank_time_s.end()),
      plan.predicted.makespan_s)
      << context;
  for (double peak_bytes : plan.predicted.rank_peak_bytes) {
    EXPECT_LE(peak_bytes, cost_model.memory_capacity_bytes()) << context;
  }
  const double lower_bound_s = makespan_lower_bound(batch, cost_model);
  EXPECT_GE(plan.predicted.makespan_s, lower_bound_s * (1 - 1e-9)) << context;
  EXPECT_GE(plan.plan_ms, 0.0) << context;
}

TEST(Planners, EveryPlannerPlacesEverySequenceOnceOnRecipeBatches) {
  const Recipe recipe = bucket_recipe();
  std::map<std::string, int64_t> refusals_by_planner;
  int64_t num_plans = 0, num_expected = 0;
  for (auto [num_gpus, gpus_per_node] : std::vector<std::pair<int64_t, int64_t>>{
           {1, 1}, {2, 2}, {8, 8}, {12, 4}, {16, 8}, {32, 8}}) {
    // An 11B model's training state alone fills one GPU; the small one stands in there.
    const CostModel cost_model =
        make_cost_model(num_gpus == 1 ? "wan-1.3b" : "mmdit-11b", num_gpus, gpus_per_node);
    for (uint64_t seed = 0; seed < 6; ++seed) {
      const Batch batch = generate_batch(recipe, num_gpus, seed);
      for (const std::string& name : planners_for(cost_model)) {
        ++num_expected;
        const std::string context =
            name + " on " + std::to_string(num_gpus) + " GPUs, seed " + std::to_string(seed);
        Plan plan;
        try {
          plan = make_plan(name, batch, cost_model);
        } catch (const PlanMemoryError& error) {  // a refusal must say memory
          EXPECT_NE(std::string(error.what()).find("memory"), std::string::npos) << context;
          ++refusals_by_planner[name.substr(0, name.find(':'))];
          continue;
        }
        EXPECT_EQ(plan.planner, name) << context;
        EXPECT_EQ(plan.num_ranks, num_gpus) << context;
        expect_places_every_sequence_once(plan, batch, num_gpus, cost_model.model().num_heads,
                                          context);
        expect_prediction_consistent(plan, batch, cost_model, context);
        ++num_plans;
      }
    }
  }
  // H200 memory holds these batches: no planner may refuse them.
  for (const auto& [name, count] : refusals_by_planner) EXPECT_EQ(count, 0) << name;
  EXPECT_EQ(num_plans, num_expected);
}

TEST(Planners, DeterministicForTheSameInput) {
  const CostModel cost_model = make_cost_model("mmdit-11b", 16, 8);
  const Batch batch = generate_batch(bucket_recipe(), 16, 3);
  for (const std::string& name : planners_for(cost_model)) {
    const Plan first = make_plan(name, batch, cost_model);
    const Plan second = make_plan(name, batch, cost_model);
    ASSERT_EQ(first.placements.size(), second.placements.size()) << name;
    for (size_t i = 0; i < first.placements.size(); ++i) {
      EXPECT_EQ(first.placements[i].ranks, second.placements[i].ranks) << name;
      EXPECT_EQ(first.placements[i].strategy, second.placements[i].strategy) << name;
    }
  }
}

// ---- Memory ----

Batch batch_of(const std::vector<int64_t>& num_tokens, int64_t text_tokens = 0) {
  Batch batch;
  for (int64_t i = 0; i < static_cast<int64_t>(num_tokens.size()); ++i) {
    batch.sequences.push_back(sequence_from_tokens(i, "video", num_tokens[i], text_tokens, 0));
  }
  return batch;
}

// Per-rank memory of `sequence` alone on one rank (fixed bytes excluded).
double local_memory_bytes(const CostModel& cost_model, const Sequence& sequence) {
  double bytes = 0;
  for (const RankShare& share :
       cost_model.shares(sequence, make_placement(sequence.id, Strategy::kLocal, {0}))) {
    bytes = std::max(bytes, share.memory_bytes);
  }
  return bytes;
}

TEST(PlannersMemory, SequenceThatFitsNowhereIsNamed) {
  const CostModel probe = make_cost_model("mmdit-11b", 8, 8);
  const Batch batch = batch_of({256, 118800, 1024}, 512);
  // Room for the 118,800-token video on no rank, not even split 8 ways.
  const double room_bytes = local_memory_bytes(probe, batch.sequences[1]) / 64;
  const CostModel cost_model =
      make_cost_model("mmdit-11b", 8, 8, memory_for_room(probe, room_bytes));
  for (const std::string& name : {"dp-tokens", "megatron-dcp", "knapformer:g8n1"}) {
    try {
      make_plan(name, batch, cost_model);
      ADD_FAILURE() << name << " placed a sequence that fits nowhere";
    } catch (const PlanMemoryError& error) {
      const std::string message = error.what();
      EXPECT_NE(message.find("sequence 1 (118800 tokens) does not fit in memory under any "
                             "placement on 8 GPUs: needs "),
                std::string::npos)
          << message;
      EXPECT_NE(message.find("GiB per rank at best"), std::string::npos) << message;
      EXPECT_NE(message.find("GiB available"), std::string::npos) << message;
    }
  }
  EXPECT_THROW(check_sequences_fit(batch, cost_model), PlanMemoryError);
  EXPECT_NO_THROW(check_sequences_fit(batch_of({256, 1024}, 512), cost_model));
}

TEST(PlannersMemory, TrainingStateThatFitsNowhereSaysMoreGpus) {
  // wan-14b's weights, gradients and Adam state (18 bytes per parameter) exceed one H200.
  const CostModel one_gpu = make_cost_model("wan-14b", 1, 1);
  ASSERT_GT(one_gpu.fixed_bytes(), one_gpu.memory_capacity_bytes());
  try {
    check_sequences_fit(batch_of({256}, 512), one_gpu);
    ADD_FAILURE() << "the training state of wan-14b fits one GPU";
  } catch (const PlanMemoryError& error) {
    const std::string message = error.what();
    EXPECT_NE(message.find("the training state of wan-14b alone does not fit in memory on 1 GPUs"),
              std::string::npos)
        << message;
    EXPECT_NE(message.find("use more GPUs"), std::string::npos) << message;
  }
  EXPECT_NO_THROW(check_sequences_fit(batch_of({256}, 512), make_cost_model("wan-14b", 8, 8)));
}

TEST(PlannersMemory, TightMemoryIsHonouredOrRefused) {
  const CostModel probe = make_cost_model("mmdit-11b", 8, 8);
  const Batch batch = generate_batch(bucket_recipe(), 8, 11);
  int64_t longest = 0;
  for (const Sequence& sequence : batch.sequences) {
    if (sequence.num_tokens > batch.sequences[longest].num_tokens) longest = sequence.id;
  }
  const double longest_bytes = local_memory_bytes(probe, batch.sequences[longest]);
  int64_t num_plans = 0, num_refusals = 0;
  for (double fraction : {4.0, 1.5, 1.05, 0.6, 0.3}) {
    const CostModel cost_model =
        make_cost_model("mmdit-11b", 8, 8, memory_for_room(probe, longest_bytes * fraction));
    for (const std::string& name : planners_for(cost_model)) {
      const std::string context = name + " with room for " + std::to_string(fraction) + "x";
      try {
        const Plan plan = make_plan(name, batch, cost_model);
        expect_places_every_sequence_once(plan, batch, 8, cost_model.model().num_heads, context);
        expect_prediction_consistent(plan, batch, cost_model, context);
        ++num_plans;
      } catch (const PlanMemoryError& error) {
        EXPECT_NE(std::string(error.what()).find("memory"), std::string::npos) << context;
        ++num_refusals;
      }
    }
  }
  EXPECT_GT(num_plans, 0);
  EXPECT_GT(num_refusals, 0);  // local-only planners cannot hold the longest video at 0.6x
}

// zellige builds static-cp:1 as dp-cost (the same greedy on groups of one rank): their placements
// must stay equal, refusals included.
TEST(PlannersMemory, StaticCpOfOneIsDpCost) {
  const CostModel probe = make_cost_model("mmdit-11b", 8, 8);
  for (int64_t seed = 0; seed < 4; ++seed) {
    const Batch batch = generate_batch(bucket_recipe(), 8, seed);
    double longest_bytes = 0;
    for (const Sequence& sequence : batch.sequences) {
      longest_bytes = std::max(longest_bytes, local_memory_bytes(probe, sequence));
    }
    for (double fraction : {4.0, 1.05, 0.6}) {
      const CostModel cost_model =
          make_cost_model("mmdit-11b", 8, 8, memory_for_room(probe, longest_bytes * fraction));
      const std::string context =
          "seed " + std::to_string(seed) + ", room for " + std::to_string(fraction) + "x";
      Plan dp_cost, static_cp;
      bool dp_cost_refused = false, static_cp_refused = false;
      try {
        dp_cost = make_plan("dp-cost", batch, cost_model);
      } catch (const PlanMemoryError&) {
        dp_cost_refused = true;
      }
      try {
        static_cp = make_plan("static-cp:1", batch, cost_model);
      } catch (const PlanMemoryError&) {
        static_cp_refused = true;
      }
      ASSERT_EQ(dp_cost_refused, static_cp_refused) << context;
      ASSERT_EQ(dp_cost.placements.size(), static_cp.placements.size()) << context;
      for (size_t i = 0; i < dp_cost.placements.size(); ++i) {
        EXPECT_EQ(dp_cost.placements[i].sequence_id, static_cp.placements[i].sequence_id);
        EXPECT_EQ(dp_cost.placements[i].strategy, static_cp.placements[i].strategy) << context;
        EXPECT_EQ(dp_cost.placements[i].ranks, static_cp.placements[i].ranks) << context;
      }
    }
  }
}

TEST(PlannersMemory, DpCostSkipsTheLeastLoadedRankWhenItIsFull) {
  // One long video, one medium video and many images on 2 ranks of a small model (FSDP state leaves
  // room): balancing time (attention is quadratic) piles the images' tokens onto the medium video's
  // rank.
  std::vector<int64_t> lengths = {40000, 25000};
  lengths.insert(lengths.end(), 80, 1000);
  const Batch batch = batch_of(lengths);
  const CostModel roomy = make_cost_model("wan-1.3b", 2, 2);
  const Plan unconstrained = make_plan("dp-cost", batch, roomy);
  // The planners size ranks additively (every share's memory_bytes over the fixed bytes), an
  // upper bound of the predicted peak (the maximum over the backward's progress): the room is
  // set on that sum.
  std::vector<double> additive(2, 0.0);
  for (const Placement& placement : unconstrained.placements) {
    for (const RankShare& share : roomy.shares(batch.sequences[placement.sequence_id], placement)) {
      additive[share.rank] += share.memory_bytes;
    }
  }
  const double room_bytes = 0.5 * (additive[0] + additive[1]) * 1.02;
  ASSERT_GT(std::max(additive[0], additive[1]), room_bytes);  // greedy alone overflows

  const CostModel tight = make_cost_model("wan-1.3b", 2, 2, memory_for_room(roomy, room_bytes));
  const Plan plan = make_plan("dp-cost", batch, tight);
  expect_places_every_sequence_once(plan, batch, 2, 12, "dp-cost, tight");
  expect_prediction_consistent(plan, batch, tight, "dp-cost, tight");
  for (const Placement& placement : plan.placements) EXPECT_EQ(placement.degree(), 1);
  EXPECT_GE(plan.predicted.makespan_s, unconstrained.predicted.makespan_s * (1 - 1e-12));

  // Three long videos on two ranks with room for about 1.05 of them each: no plan exists. (The
  // predicted peak of two videos on one rank lays their activations out over the backward's
  // progress, which the additive sizing over-counts, so 1.3 videos' room can hold two.)
  const Batch three = batch_of({20000, 19000, 18000});
  const CostModel one_each =
      make_cost_model("wan-1.3b", 2, 2,
                      memory_for_room(roomy, local_memory_bytes(roomy, three.sequences[0]) * 1.05));
  for (const std::string& name :
       {"dp-tokens", "dp-cost", "static-cp:1", "static-cp:2", "knapformer:g1n2", "megatron-dcp"}) {
    try {
      make_plan(name, three, one_each);
      ADD_FAILURE() << name << " returned a plan above memory";
    } catch (const PlanMemoryError& error) {
      EXPECT_NE(std::string(error.what()).find("memory"), std::string::npos) << error.what();
    }
  }
}

TEST(PlannersMemory, KnapformerIgnoresMemoryAndSaysSo) {
  const CostModel probe = make_cost_model("mmdit-11b", 8, 8);
  const Batch batch = batch_of({60000, 256, 256, 256, 256, 256, 256, 256}, 512);
  // The long video fits split 8 ways but not on one rank.
  const double room_bytes = local_memory_bytes(probe, batch.sequences[0]) * 0.5;
  const CostModel cost_model =
      make_cost_model("mmdit-11b", 8, 8, memory_for_room(probe, room_bytes));
  EXPECT_NO_THROW(make_plan("knapformer:g8n1", batch, cost_model));
  try {
    make_plan("knapformer:g1n8", batch, cost_model);
    ADD_FAILURE() << "knapformer:g1n8 returned a plan above memory";
  } catch (const PlanMemoryError& error) {
    const std::string message = error.what();
    EXPECT_NE(message.find("rank "), std::string::npos) << message;
    EXPECT_NE(message.find("knapformer balances compute and ignores memory"), std::string::npos)
        << message;
  }
}

// ---- Brute force: every placement of tiny batches ----

// Every ordered placement of one sequence on num_ranks ranks: every rank tuple, every strategy.
std::vector<Placement> all_placements(int64_t sequence_id, int64_t num_ranks, int64_t num_heads) {
  std::vector<Placement> placements;
  std::vector<int64_t> ranks;
  std::vector<bool> used(num_ranks, false);
  std::function<void()> extend = [&]() {
    const int64_t degree = static_cast<int64_t>(ranks.size());
    if (degree == 1) placements.push_back(make_placement(sequence_id, Strategy::kLocal, ranks));
    if (degree >= 2) {
      if (degree <= num_heads) {
        placements.push_back(make_placement(sequence_id, Strategy::kUlysses, ranks));
      }
      placements.push_back(make_placement(sequence_id, Strategy::kRing, ranks));
      for (int64_t u = 2; u <= std::min(num_heads, degree / 2); ++u) {
        if (degree % u == 0) {
          placements.push_back(make_placement(sequence_id, Strategy::kHybrid, ranks, u));
        }
      }
    }
    for (int64_t rank = 0; rank < num_ranks; ++rank) {
      if (used[rank]) continue;
      used[rank] = true;
      ranks.push_back(rank);
      extend();
      ranks.pop_back();
      used[rank] = false;
    }
  };
  extend();
  return placements;
}

struct BruteForceOptimum {
  double makespan_s = std::numeric_limits<double>::infinity();
  Plan plan;
};

// Minimum makespan over every combination of placements (memory ignored: a relaxation, so it is
// a lower bound on every planner's makespan too).
BruteForceOptimum brute_force(const Batch& batch, const CostModel& cost_model) {
  const int64_t num_ranks = cost_model.cluster().num_ranks();
  const int64_t num_sequences = static_cast<int64_t>(batch.sequences.size());
  std::vector<std::vector<Placement>> options;
  std::vector<std::vector<std::vector<RankShare>>> shares;
  for (const Sequence& sequence : batch.sequences) {
    options.push_back(all_placements(sequence.id, num_ranks, cost_model.model().num_heads));
    shares.emplace_back();
    for (const Placement& placement : options.back()) {
      shares.back().push_back(cost_model.shares(sequence, placement));
    }
  }
  std::vector<int64_t> tokens(num_ranks, 0);
  std::vector<double> attention_s(num_ranks, 0), exchange_s(num_ranks, 0);
  std::vector<int64_t> choice(num_sequences, 0);
  BruteForceOptimum best;
  std::function<void(int64_t)> search = [&](int64_t i) {
    if (i == num_sequences) {
      double makespan_s = 0;
      for (int64_t r = 0; r < num_ranks; ++r) {
        makespan_s =
            std::max(makespan_s, cost_model.rank_time_s(tokens[r], attention_s[r], exchange_s[r]));
      }
      if (makespan_s < best.makespan_s) {
        best.makespan_s = makespan_s;
        best.plan.placements.clear();
        for (int64_t j = 0; j < num_sequences; ++j) {
          best.plan.placements.push_back(options[j][choice[j]]);
        }
      }
      return;
    }
    for (int64_t k = 0; k < static_cast<int64_t>(options[i].size()); ++k) {
      choice[i] = k;
      for (const RankShare& share : shares[i][k]) {
        tokens[share.rank] += share.tokens;
        attention_s[share.rank] += share.attention_s;
        exchange_s[share.rank] += share.exchange_s;
      }
      search(i + 1);
      for (const RankShare& share : shares[i][k]) {
        tokens[share.rank] -= share.tokens;
        attention_s[share.rank] -= share.attention_s;
        exchange_s[share.rank] -= share.exchange_s;
      }
    }
  };
  search(0);
  best.plan.planner = "brute-force";
  best.plan.num_ranks = num_ranks;
  return best;
}

struct TinyCase {
  std::string model;
  int64_t num_gpus;
  int64_t gpus_per_node;
  int64_t num_sequences;
};

TEST(PlannersBruteForce, LowerBoundNeverExceedsTheOptimumAndNoPlannerBeatsIt) {
  // Lengths span images to long videos so local, Ulysses, ring and hybrid all win somewhere.
  const std::vector<int64_t> lengths = {256, 1024, 4096, 16384, 65536, 131072};
  std::mt19937_64 rng(20260611);
  int64_t num_cases = 0;
  for (const TinyCase& tiny : std::vector<TinyCase>{{"mmdit-11b", 2, 2, 4},
                                                    {"mmdit-11b", 2, 1, 4},
                                                    {"wan-1.3b", 3, 3, 3},
                                                    {"mmdit-11b", 4, 2, 3},
                                                    {"wan-14b", 4, 4, 2},
                                                    {"tiny", 4, 4, 3}}) {
    const CostModel cost_model = make_cost_model(tiny.model, tiny.num_gpus, tiny.gpus_per_node);
    for (int64_t trial = 0; trial < 3; ++trial) {
      Batch batch;
      for (int64_t i = 0; i < tiny.num_sequences; ++i) {
        const int64_t num_tokens =
            lengths[rng() % lengths.size()] + static_cast<int64_t>(rng() % 97);
        batch.sequences.push_back(sequence_from_tokens(
            i, "video", num_tokens, 512, static_cast<int64_t>(rng() % tiny.num_gpus)));
      }
      const std::string context = tiny.model + " on " + std::to_string(tiny.num_gpus) + "x" +
                                  std::to_string(tiny.gpus_per_node) + ", trial " +
                                  std::to_string(trial);
      const BruteForceOptimum optimum = brute_force(batch, cost_model);
      const double lower_bound_s = makespan_lower_bound(batch, cost_model);
      EXPECT_LE(lower_bound_s, optimum.makespan_s * (1 + 1e-9)) << context;
      EXPECT_GT(lower_bound_s, 0.0) << context;
      // The oracle's additive rank totals agree with the cost model's own evaluation, unless
      // memory makes some rank recompute attention too (the oracle ignores memory).
      const PlanCost evaluated = cost_model.evaluate(batch, optimum.plan);
      const bool selective = std::all_of(evaluated.ranks.begin(), evaluated.ranks.end(),
                                         [](const RankCost& r) { return r.full_recompute_layers == 0; });
      if (selective) {
        EXPECT_NEAR(evaluated.makespan_s, optimum.makespan_s, 1e-9 * optimum.makespan_s)
            << context;
      } else {
        EXPECT_GT(evaluated.makespan_s, optimum.makespan_s) << context;
      }
      for (const std::string& name : planners_for(cost_model)) {
        Plan plan;
        try {
          plan = make_plan(name, batch, cost_model);
        } catch (const PlanMemoryError&) {
          continue;
        }
        EXPECT_GE(plan.predicted.makespan_s, optimum.makespan_s * (1 - 1e-9)) << context << name;
        EXPECT_GE(plan.predicted.makespan_s, lower_bound_s * (1 - 1e-9)) << context << name;
      }
      ++num_cases;
    }
  }
  EXPECT_EQ(num_cases, 18);
}

// ---- Names ----

void expect_invalid(const std::string& name, const CostModel& cost_model, const Batch& batch,
                    const std::string& fragment) {
  try {
    make_plan(name, batch, cost_model);
    ADD_FAILURE() << "'" << name << "' was accepted";
  } catch (const PlanMemoryError& error) {
    ADD_FAILURE() << "'" << name << "' gave a memory error: " << error.what();
  } catch (const std::invalid_argument& error) {
    EXPECT_NE(std::string(error.what()).find(fragment), std::string::npos)
        << "'" << name << "': " << error.what();
  }
}

TEST(PlannerNames, UnknownAndMalformedNamesAreRejected) {
  const CostModel cost_model = make_cost_model("mmdit-11b", 8, 8);  // 24 heads
  const Batch batch = batch_of({256, 4096, 30000}, 512);
  const std::string allowed =
      "allowed: dp-tokens, dp-cost, static-cp:C, knapformer:SPEC[:GAMMA], megatron-dcp, zellige";
  for (const std::string& name : {"",
                                  "dp",
                                  "DP-TOKENS",
                                  "dp-tokens:",
                                  "dp-cost ",
                                  "joint",
                                  "megatron",
                                  "static-cp",
                                  "knapformer",
                                  "knapformer:",
                                  "static-cp:",
                                  "static-cp:0",
                                  "static-cp:-2",
                                  "static-cp:x",
                                  "static-cp:4.0",
                                  "static-cp: 4",
                                  "knapformer:g4n2:abc",
                                  "knapformer:g4n2:-1",
                                  "knapformer:g4n2:inf",
                                  "knapformer:g4n2:"}) {
    expect_invalid(name, cost_model, batch, allowed);
  }
  expect_invalid("static-cp:3", cost_model, batch, "must divide the 8 GPUs");
  expect_invalid("static-cp:16", cost_model, batch, "must divide the 8 GPUs");
  expect_invalid("knapformer:g4n1", cost_model, batch, "covers 4 GPUs, the cluster has 8");
  expect_invalid("knapformer:g4n1+g4n1", cost_model, batch, "appears twice");
  expect_invalid("knapformer:g4", cost_model, batch, "malformed term 'g4'");
  expect_invalid("knapformer:g0n8", cost_model, batch, "malformed term 'g0n8'");
  expect_invalid("knapformer:g4n2+", cost_model, batch, "malformed term ''");
  expect_invalid("knapformer:x4n2", cost_model, batch, "malformed term 'x4n2'");
  expect_invalid("knapformer:g8n1", make_cost_model("wan-1.3b", 8, 8), batch,
                 "bag size 8 does not divide the 12 heads");
  const std::vector<std::string> names = planner_names();
  EXPECT_EQ(names.size(), 6u);
  EXPECT_NE(std::find(names.begin(), names.end(), "knapformer:SPEC[:GAMMA]"), names.end());
}

TEST(PlannerNames, GammaAndMixedSpecsAreAccepted) {
  const CostModel cost_model = make_cost_model("mmdit-11b", 8, 8);
  const Batch batch = generate_batch(bucket_recipe(), 8, 1);
  for (const std::string& name :
       {"knapformer:g1n2+g2n1+g4n1", "knapformer:g4n1+g1n2+g2n1:0", "knapformer:g2n4:1.5e-1"}) {
    const Plan plan = make_plan(name, batch, cost_model);
    EXPECT_EQ(plan.planner, name);
  }
}

// ---- Each policy's rules ----

TEST(PlannerRules, DpTokensIsGreedyLongestFirstByTokens) {
  const CostModel cost_model = make_cost_model("mmdit-11b", 2, 2);
  const Batch batch = batch_of({3000, 5000, 3000, 4000, 3000});
  const Plan plan = make_plan("dp-tokens", batch, cost_model);
  // 5000 -> r0; 4000 -> r1; 3000 (id 0) -> r1 (4000 < 5000); 3000 (id 2) -> r0 (5000 < 7000);
  // 3000 (id 4) -> r1 (7000 < 8000).
  const std::vector<int64_t> expected_rank = {1, 0, 0, 1, 1};
  for (int64_t i = 0; i < 5; ++i) {
    EXPECT_EQ(plan.placements[i].strategy, Strategy::kLocal);
    EXPECT_EQ(plan.placements[i].ranks, std::vector<int64_t>{expected_rank[i]}) << i;
  }
}

TEST(PlannerRules, DpCostBeatsDpTokensOnQuadraticAttention) {
  const CostModel cost_model = make_cost_model("wan-1.3b", 2, 2);
  // Token-balanced {60000} vs {30000, 30000} leaves the 60000-token rank with 2x the attention.
  const Batch batch = batch_of({60000, 30000, 30000, 2000, 2000, 2000, 2000});
  const Plan tokens = make_plan("dp-tokens", batch, cost_model);
  const Plan cost = make_plan("dp-cost", batch, cost_model);
  EXPECT_LE(cost.predicted.makespan_s, tokens.predicted.makespan_s);
  for (const Placement& placement : cost.placements) EXPECT_EQ(placement.degree(), 1);
}

TEST(PlannerRules, StaticCpShardsEverySequenceOverAWholeGroup) {
  for (const auto& [model, group_size, strategy, ulysses] :
       std::vector<std::tuple<std::string, int64_t, Strategy, int64_t>>{
           {"mmdit-11b", 8, Strategy::kUlysses, 8},  // 24 heads: Ulysses 8
           {"mmdit-11b", 16, Strategy::kHybrid, 8},  // Ulysses 8 x ring 2
           {"wan-1.3b", 8, Strategy::kHybrid, 4},    // 12 heads: Ulysses 4 x ring 2
           {"mmdit-11b", 1, Strategy::kLocal, 1}}) {
    const CostModel cost_model = make_cost_model(model, 32, 8);
    const Batch batch = generate_batch(bucket_recipe(), 32, 5);
    Plan plan;
    try {
      plan = make_plan("static-cp:" + std::to_string(group_size), batch, cost_model);
    } catch (const PlanMemoryError& error) {  // whole long videos may not fit on one rank
      EXPECT_EQ(group_size, 1) << error.what();
      continue;
    }
    for (const Placement& placement : plan.placements) {
      ASSERT_EQ(placement.degree(), group_size);
      EXPECT_EQ(placement.ranks.front() % group_size, 0);
      for (int64_t k = 1; k < group_size; ++k) {
        EXPECT_EQ(placement.ranks[k], placement.ranks[0] + k);
      }
      EXPECT_EQ(placement.strategy, strategy) << model << " static-cp:" << group_size;
      EXPECT_EQ(placement.ulysses_degree, ulysses);
    }
  }
}

TEST(PlannerRules, KnapformerUsesItsBagsAndWorkModel) {
  const CostModel cost_model = make_cost_model("mmdit-11b", 8, 8);
  const Batch batch = generate_batch(bucket_recipe(), 8, 2);
  const Plan plan = make_plan("knapformer:g4n1+g1n2+g2n1", batch, cost_model);
  // Bags by increasing size: [0], [1], [2, 3], [4, 5, 6, 7].
  const std::set<std::vector<int64_t>> bags = {{0}, {1}, {2, 3}, {4, 5, 6, 7}};
  for (const Placement& placement : plan.placements) {
    EXPECT_TRUE(bags.count(placement.ranks)) << placement.ranks.front();
    EXPECT_EQ(placement.strategy, placement.degree() == 1 ? Strategy::kLocal : Strategy::kUlysses);
  }

  // Two equal sequences and one 8x heavier on g1n2+g2n1 (4 GPUs): the heavy one exceeds a g1
  // bag's capacity and goes to the g2 bag; the others fill the g1 bags, one each.
  const CostModel four = make_cost_model("mmdit-11b", 4, 4);
  const Batch small = batch_of({40000, 5000, 5000}, 512);
  const Plan bagged = make_plan("knapformer:g1n2+g2n1", small, four);
  EXPECT_EQ(bagged.placements[0].ranks, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(bagged.placements[1].ranks, std::vector<int64_t>{0});
  EXPECT_EQ(bagged.placements[2].ranks, std::vector<int64_t>{1});

  // A sequence shorter than a bag is not eligible for it: 3 tokens never go to a 4-GPU bag
  // (8 equal sequences on 8 GPUs: each fits a 1-GPU bag's capacity exactly).
  const Batch tiny = batch_of({3, 3, 3, 3, 3, 3, 3, 3}, 0);
  const Plan short_plan =
      make_plan("knapformer:g1n4+g4n1", tiny, make_cost_model("mmdit-11b", 8, 8));
  for (const Placement& placement : short_plan.placements) EXPECT_EQ(placement.degree(), 1);
}

// zellige stops KnapFormer's assignment early (its floor already too high): the bags given until
// then are the full assignment's, and the result says it is incomplete.
TEST(PlannerRules, KnapformerAssignStopsWhereAsked) {
  const CostModel cost_model = make_cost_model("mmdit-11b", 8, 8);
  const Batch batch = generate_batch(bucket_recipe(), 8, 2);
  const planners::KnapformerWork work = planners::knapformer_work(batch, cost_model, 0.4);
  const planners::KnapformerBags full =
      planners::knapformer_assign(batch, cost_model, "g1n2+g2n1+g4n1", work);
  EXPECT_TRUE(full.complete);
  const int64_t stop_after = static_cast<int64_t>(work.order.size()) / 2;
  int64_t calls = 0;
  const planners::KnapformerBags part = planners::knapformer_assign(
      batch, cost_model, "g1n2+g2n1+g4n1", work,
      [&](const planners::KnapformerBags& bags, int64_t sequence) {
        EXPECT_EQ(sequence, work.order[calls]);
        EXPECT_EQ(bags.of_sequence[sequence], full.of_sequence[sequence]);
        return ++calls == stop_after;
      });
  EXPECT_FALSE(part.complete);
  EXPECT_EQ(calls, stop_after);
  for (size_t k = 0; k < work.order.size(); ++k) {
    const int64_t i = work.order[k];
    EXPECT_EQ(part.of_sequence[i], static_cast<int64_t>(k) < stop_after ? full.of_sequence[i] : -1);
  }
}

TEST(PlannerRules, MegatronDcpDegreesArePowersOfTwoFromMemory) {
  const CostModel probe = make_cost_model("mmdit-11b", 8, 8);
  const Batch batch = batch_of({100000, 40000, 20000, 5000, 1000, 1000, 256, 256}, 512);
  // Room for about 30k tokens per rank: the 100k video needs cp 4, the 40k one cp 2.
  const double room_bytes =
      local_memory_bytes(probe, sequence_from_tokens(0, "video", 30000, 512, 0));
  const CostModel cost_model =
      make_cost_model("mmdit-11b", 8, 8, memory_for_room(probe, room_bytes));
  const Plan plan = make_plan("megatron-dcp", batch, cost_model);
  expect_places_every_sequence_once(plan, batch, 8, 24, "megatron-dcp");
  for (const Placement& placement : plan.placements) {
    const int64_t degree = placement.degree();
    EXPECT_EQ(degree & (degree - 1), 0) << "degree " << degree;
    EXPECT_EQ(placement.strategy, degree == 1 ? Strategy::kLocal : Strategy::kRing);
    for (int64_t k = 1; k < degree; ++k) EXPECT_EQ(placement.ranks[k], placement.ranks[0] + k);
  }
  EXPECT_GE(plan.placements[0].degree(), 4);
  EXPECT_GE(plan.placements[1].degree(), 2);
  // With memory to spare: no rank is left empty (the fill step doubles groups if needed).
  const Plan roomy = make_plan("megatron-dcp", batch, probe);
  std::set<int64_t> busy;
  for (const Placement& placement : roomy.placements) {
    busy.insert(placement.ranks.begin(), placement.ranks.end());
  }
  EXPECT_EQ(busy.size(), 8u);  // empty ranks are filled by doubling groups
}

TEST(PlannerRules, MegatronDcpShardsALongSequenceWhenThatLowersTheMakespan) {
  // Memory to spare (every sequence fits one rank): Megatron's degree from memory alone would keep
  // the 120k video whole, which is dp-cost's plan with that video as the makespan. The knob M and
  // the packing-aware choice shard it because that lowers the critical path.
  const CostModel cost_model = make_cost_model("mmdit-11b", 8, 8);
  std::vector<int64_t> lengths = {120000};
  for (int i = 0; i < 14; ++i) lengths.push_back(6000 + 500 * i);
  const Batch batch = batch_of(lengths, 512);
  const Plan plan = make_plan("megatron-dcp", batch, cost_model);
  const Plan dp_cost = make_plan("dp-cost", batch, cost_model);
  expect_places_every_sequence_once(plan, batch, 8, 24, "megatron-dcp");
  EXPECT_GE(plan.placements[0].degree(), 2);
  EXPECT_LT(plan.predicted.makespan_s, 0.8 * dp_cost.predicted.makespan_s);
  for (double peak : plan.predicted.rank_peak_bytes) {
    EXPECT_LE(peak, cost_model.memory_capacity_bytes());
  }
}

TEST(PlannerRules, MegatronDcpUsesTheWholeClusterAsItsNonPowerOfTwoGroup) {
  // 24 GPUs: groups are powers of two up to 16 or all 24 ranks. A video that needs more than 16
  // ranks by memory (room for 12k tokens a rank) gets the whole cluster.
  const CostModel probe = make_cost_model("mmdit-11b", 24, 8);
  const double room_bytes =
      local_memory_bytes(probe, sequence_from_tokens(0, "video", 12000, 512, 0));
  const CostModel cost_model =
      make_cost_model("mmdit-11b", 24, 8, memory_for_room(probe, room_bytes));
  const Batch batch = batch_of({240000, 1500, 1500, 1000, 1000, 500}, 512);
  const Plan plan = make_plan("megatron-dcp", batch, cost_model);
  expect_places_every_sequence_once(plan, batch, 24, 24, "megatron-dcp");
  EXPECT_EQ(plan.placements[0].degree(), 24);
  for (const Placement& placement : plan.placements) {
    const int64_t degree = placement.degree();
    EXPECT_TRUE((degree & (degree - 1)) == 0 || degree == 24) << "degree " << degree;
    for (int64_t k = 1; k < degree; ++k) EXPECT_EQ(placement.ranks[k], placement.ranks[0] + k);
  }
}


// megatron-dcp stops a knob's schedule once RankLoads::time_floor_s of a rank exceeds the best
// knob's rank time: that floor must stay at or below the rank's time, then and after every later
// add. Random ring and local shares of random lengths (GEMM tables: per-token rates vary).
TEST(RankLoads, TimeFloorStaysBelowEveryLaterTime) {
  for (const HardwareProfile& profile : {test_profile(), test_util::seeded_profile()}) {
    const CostModel cost_model(model_preset("wan-14b"), profile, make_cluster(16, 8));
    planners::RankLoads loads(cost_model);
    std::vector<double> highest_floor_s(16, 0.0);
    std::mt19937_64 rng(15);
    for (int step = 0; step < 400; ++step) {
      const int64_t tokens = std::uniform_int_distribution<int64_t>(1, 60000)(rng);
      const Sequence sequence = sequence_from_tokens(step, "video", tokens, step % 2 ? 512 : 0, 0);
      const int64_t degree = int64_t{1} << std::uniform_int_distribution<int>(0, 3)(rng);
      const int64_t first = std::uniform_int_distribution<int64_t>(0, 16 - degree)(rng);
      std::vector<int64_t> ranks(degree);
      std::iota(ranks.begin(), ranks.end(), first);
      loads.add(cost_model.shares(
          sequence, make_placement(step, degree == 1 ? Strategy::kLocal : Strategy::kRing, ranks)));
      for (int64_t rank = 0; rank < 16; ++rank) {
        highest_floor_s[rank] = std::max(highest_floor_s[rank], loads.time_floor_s(rank));
        ASSERT_LE(highest_floor_s[rank], loads.time_s(rank)) << "rank " << rank << " step " << step;
      }
    }
    // Not vacuous: the floor is close to the time (within the per-token rates' spread).
    EXPECT_GT(loads.time_floor_s(0), 0.5 * loads.time_s(0));
  }
}

}  // namespace
}  // namespace zellige
