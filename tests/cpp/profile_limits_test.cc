// HardwareProfile::validate's physical ranges: the values of issue 17's stress test (1e-300 bytes
// per second, 1e308 s of launch time, tables spanning 1e-300..1e300) are refused with a message
// naming the field; the shipped profile's kind of values pass.
#include <gtest/gtest.h>

#include <limits>
#include <stdexcept>
#include <string>

#include "test_util.h"
#include "zellige/profile.h"

namespace zellige {
namespace {

using test_util::seeded_profile;

std::string refusal(const HardwareProfile& profile) {
  try {
    profile.validate();
  } catch (const std::invalid_argument& error) {
    return error.what();
  }
  return "";
}

TEST(ProfileLimits, SeededProfilePasses) { EXPECT_EQ(refusal(seeded_profile()), ""); }

TEST(ProfileLimits, RefusesRatesOutsideTheirPhysicalRange) {
  HardwareProfile profile = seeded_profile();
  profile.memory_bytes_per_s = 1e-300;
  EXPECT_NE(refusal(profile).find("memory_bytes_per_s"), std::string::npos);
  profile = seeded_profile();
  profile.matmul_flops_per_s = 1e300;
  EXPECT_NE(refusal(profile).find("matmul_flops_per_s"), std::string::npos);
  profile = seeded_profile();
  profile.matmul_forward_flops_per_s.y.back() = 1e300;
  EXPECT_NE(refusal(profile).find("matmul_forward_flops_per_s.y[3]"), std::string::npos);
}

TEST(ProfileLimits, RefusesTablesSpanningAbsurdValues) {
  HardwareProfile profile = seeded_profile();
  profile.attention_forward_s_per_head.y.front() = 1e-300;
  profile.attention_forward_s_per_head.y.back() = 1e300;
  EXPECT_NE(refusal(profile).find("attention_forward_s_per_head.y[0]"), std::string::npos);
  profile = seeded_profile();
  profile.attention_backward_s_per_head.x.back() = 1e300;
  EXPECT_NE(refusal(profile).find("attention_backward_s_per_head.x[5]"), std::string::npos);
}

TEST(ProfileLimits, RefusesPerModelRowsOutsideTheirRange) {
  HardwareProfile profile = seeded_profile();
  profile.memory_models = {"wan-14b"};
  profile.activation_bytes_per_token_layer = {1000};
  profile.checkpoint_bytes_per_token_layer = {100};
  EXPECT_EQ(refusal(profile), "");
  profile.launch_s_per_layer = {1e308};
  profile.launch_s_per_attention_call = {0};
  EXPECT_NE(refusal(profile).find("launch_s_per_layer[0] (wan-14b)"), std::string::npos);
  profile.launch_s_per_layer = {0.01};
  profile.ulysses_bytes_per_token = {-1e300};
  EXPECT_NE(refusal(profile).find("ulysses_bytes_per_token"), std::string::npos);
  profile.ulysses_bytes_per_token = {};
  profile.runtime_reserved_bytes = std::numeric_limits<int64_t>::max();
  EXPECT_NE(refusal(profile).find("runtime_reserved_bytes"), std::string::npos);
  profile.runtime_reserved_bytes = 0;
  profile.ulysses_layout_s_per_byte = 1.0;
  EXPECT_NE(refusal(profile).find("ulysses_layout_s_per_byte"), std::string::npos);
}

TEST(ProfileLimits, ModelTablesAreOnePerModelAndInRange) {
  HardwareProfile profile = seeded_profile();
  profile.memory_models = {"wan-14b", "mmdit-11b"};
  profile.activation_bytes_per_token_layer = {1000, 2000};
  profile.checkpoint_bytes_per_token_layer = {100, 200};
  profile.model_matmul_forward_flops_per_s = {Table{}, profile.matmul_forward_flops_per_s};
  profile.model_matmul_backward_flops_per_s = {Table{}, profile.matmul_backward_flops_per_s};
  EXPECT_EQ(refusal(profile), "");  // an empty table: that model uses the shared one
  profile.model_matmul_forward_flops_per_s[1].y.back() = 1e300;
  EXPECT_NE(refusal(profile).find("model_matmul_forward_flops_per_s[1] (mmdit-11b).y[3]"),
            std::string::npos);
  profile.model_matmul_forward_flops_per_s.pop_back();
  EXPECT_NE(refusal(profile).find("one table per memory model"), std::string::npos);
}

}  // namespace
}  // namespace zellige
