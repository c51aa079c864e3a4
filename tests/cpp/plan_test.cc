#include "zellige/plan.h"

#include <gtest/gtest.h>

#include <numeric>
#include <stdexcept>

namespace zellige {
namespace {

TEST(BalancedSplit, FirstPartsGetTheRemainder) {
  EXPECT_EQ(balanced_split(24, 5), (std::vector<int64_t>{5, 5, 5, 5, 4}));
  EXPECT_EQ(balanced_split(3, 5), (std::vector<int64_t>{1, 1, 1, 0, 0}));
  EXPECT_EQ(balanced_split(0, 2), (std::vector<int64_t>{0, 0}));
  for (int64_t total : {1, 7, 100, 75600}) {
    for (int64_t parts : {1, 2, 3, 8, 13}) {
      const std::vector<int64_t> split = balanced_split(total, parts);
      EXPECT_EQ(std::accumulate(split.begin(), split.end(), int64_t{0}), total);
      EXPECT_LE(split.front() - split.back(), 1);
    }
  }
  EXPECT_THROW(balanced_split(4, 0), std::invalid_argument);
}

TEST(Strategy, NameRoundTrip) {
  const std::vector<Placement> placements = {
      make_placement(0, Strategy::kLocal, {3}), make_placement(1, Strategy::kUlysses, {0, 1, 2}),
      make_placement(2, Strategy::kRing, {4, 5}),
      make_placement(3, Strategy::kHybrid, {0, 1, 2, 3, 4, 5}, 2)};
  EXPECT_EQ(strategy_name(placements[3]), "hybrid(2,3)");
  for (const Placement& p : placements) {
    Strategy strategy;
    int64_t u = -1, r = -1;
    parse_strategy(strategy_name(p), &strategy, &u, &r);
    const Placement back = make_placement(p.sequence_id, strategy, p.ranks, u);
    EXPECT_EQ(back.strategy, p.strategy);
    EXPECT_EQ(back.ulysses_degree, p.ulysses_degree);
    EXPECT_EQ(back.ring_degree, p.ring_degree);
    if (strategy == Strategy::kHybrid) EXPECT_EQ(r, p.ring_degree);
  }
}

TEST(Strategy, ParseAcceptsSpacesRejectsOthers) {
  Strategy strategy;
  int64_t u = 0, r = 0;
  parse_strategy(" hybrid( 4 , 2 ) ", &strategy, &u, &r);
  EXPECT_EQ(strategy, Strategy::kHybrid);
  EXPECT_EQ(u, 4);
  EXPECT_EQ(r, 2);
  parse_strategy("ring", &strategy, &u, &r);
  EXPECT_EQ(strategy, Strategy::kRing);
  EXPECT_EQ(u, 1);
  for (const char* bad : {"", "Local", "hybrid", "hybrid(4)", "hybrid(1,4)", "hybrid(4,1)",
                          "hybrid(a,2)", "hybrid(2,2", "hybrid(2,2)x", "hybrid(-2,2)"}) {
    try {
      parse_strategy(bad, &strategy, &u, &r);
      FAIL() << "accepted '" << bad << "'";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("hybrid(u,r)"), std::string::npos) << e.what();
    }
  }
}

TEST(MakePlacement, RejectsInconsistentRankCounts) {
  EXPECT_THROW(make_placement(0, Strategy::kLocal, {0, 1}), std::invalid_argument);
  EXPECT_THROW(make_placement(0, Strategy::kUlysses, {}), std::invalid_argument);
  EXPECT_THROW(make_placement(0, Strategy::kHybrid, {0, 1, 2, 3}, 3), std::invalid_argument);
  EXPECT_THROW(make_placement(0, Strategy::kHybrid, {0, 1, 2, 3}, 4), std::invalid_argument);
  EXPECT_EQ(make_placement(0, Strategy::kUlysses, {0, 1, 2}).degree(), 3);
}

class ValidatePlanTest : public ::testing::Test {
 protected:
  void SetUp() override {
    batch_.sequences = {sequence_from_tokens(10, "video", 4096, 8, 0),
                        sequence_from_tokens(11, "image", 256, 8, 1)};
    plan_.num_ranks = 8;
    plan_.placements = {make_placement(10, Strategy::kUlysses, {0, 1, 2, 3}),
                        make_placement(11, Strategy::kLocal, {4})};
  }
  void expect_error(const std::string& needle) {
    try {
      validate_plan(plan_, batch_, 8, 4);
      FAIL() << "expected an error containing '" << needle << "'";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  }
  Batch batch_;
  Plan plan_;
};

TEST_F(ValidatePlanTest, AcceptsAValidPlan) { validate_plan(plan_, batch_, 8, 4); }

TEST_F(ValidatePlanTest, MissingPlacement) {
  plan_.placements.pop_back();
  expect_error("sequence 11: not placed");
}

TEST_F(ValidatePlanTest, PlacedTwice) {
  plan_.placements.push_back(make_placement(11, Strategy::kLocal, {5}));
  expect_error("sequence 11: placed more than once");
}

TEST_F(ValidatePlanTest, UnknownSequence) {
  plan_.placements.push_back(make_placement(99, Strategy::kLocal, {5}));
  expect_error("sequence 99: placed but not in the batch");
}

TEST_F(ValidatePlanTest, EmptyRepeatedOrOutOfRangeRanks) {
  plan_.placements[1].ranks = {};
  expect_error("sequence 11: placement has no ranks");
  plan_.placements[1].ranks = {8};
  expect_error("sequence 11: rank 8 is outside [0, 8)");
  plan_.placements[1].ranks = {-1};
  expect_error("sequence 11: rank -1");
  plan_.placements[0].ranks = {0, 1, 1, 3};
  plan_.placements[1].ranks = {4};
  expect_error("sequence 10: rank 1 is repeated");
}

TEST_F(ValidatePlanTest, DegreesMustMatchRankCount) {
  plan_.placements[0].ulysses_degree = 2;
  expect_error("sequence 10: strategy ulysses");
  plan_.placements[0] = make_placement(10, Strategy::kHybrid, {0, 1, 2, 3}, 2);
  plan_.placements[0].ranks.push_back(5);
  expect_error("sequence 10: strategy hybrid(2,2)");
  plan_.placements[0] = make_placement(10, Strategy::kRing, {0, 1, 2, 3});
  plan_.placements[0].ulysses_degree = 4;
  plan_.placements[0].ring_degree = 1;
  expect_error("sequence 10: strategy ring");
  plan_.placements[0] = make_placement(10, Strategy::kLocal, {0});
  plan_.placements[0].ranks = {0, 1};
  expect_error("sequence 10: strategy local");
}

TEST_F(ValidatePlanTest, UlyssesDegreeAboveHeads) {
  plan_.placements[0] = make_placement(10, Strategy::kUlysses, {0, 1, 2, 3, 5});
  expect_error("sequence 10: ulysses degree 5 exceeds the model's 4 heads");
  validate_plan(plan_, batch_, 8, 0);  // head check skipped
  plan_.placements[0] = make_placement(10, Strategy::kRing, {0, 1, 2, 3, 5, 6});
  validate_plan(plan_, batch_, 8, 4);  // ring needs no head split
}

TEST_F(ValidatePlanTest, NumRanksMismatch) {
  plan_.num_ranks = 16;
  expect_error("plan is for 16 ranks");
}

}  // namespace
}  // namespace zellige
