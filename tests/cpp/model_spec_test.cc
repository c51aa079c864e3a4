#include "zellige/model_spec.h"

#include <gtest/gtest.h>

#include <functional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "zellige/cluster.h"
#include "zellige/workload.h"

namespace zellige {
namespace {

TEST(ModelPreset, SizesAndParamCounts) {
  const ModelSpec wan14 = model_preset("wan-14b");
  EXPECT_EQ(wan14.width, 5120);
  EXPECT_EQ(wan14.num_layers, 40);
  EXPECT_EQ(wan14.num_heads, 40);
  EXPECT_EQ(wan14.head_dim, 128);
  EXPECT_FALSE(wan14.joint_attention);
  EXPECT_NEAR(wan14.param_count / 1e9, 14.05, 0.05);
  EXPECT_NEAR(model_preset("wan-1.3b").param_count / 1e9, 1.39, 0.02);
  const ModelSpec mmdit = model_preset("mmdit-11b");
  EXPECT_EQ(mmdit.num_layers, 57);
  EXPECT_EQ(mmdit.num_double_layers, 19);
  EXPECT_EQ(mmdit.head_dim, 128);
  EXPECT_TRUE(mmdit.joint_attention);
  EXPECT_NEAR(mmdit.param_count / 1e9, 11.8, 0.1);
  const ModelSpec hunyuan = model_preset("hunyuan-13b");
  EXPECT_EQ(hunyuan.num_layers, 60);
  EXPECT_EQ(hunyuan.text_tokens, 256);
  EXPECT_NEAR(hunyuan.param_count / 1e9, 12.5, 0.2);
  const ModelSpec tiny = model_preset("tiny");
  EXPECT_EQ(tiny.param_count, 2 * (8 * 64 * 64 + 2 * 64 * 128));
  // 2 double blocks (two streams of q,k,v,o + FFN + 6-way AdaLN) and 1 single block
  const ModelSpec mmdit_tiny = model_preset("mmdit-tiny");
  EXPECT_TRUE(mmdit_tiny.joint_attention);
  EXPECT_EQ(mmdit_tiny.num_layers, 3);
  EXPECT_EQ(mmdit_tiny.param_count, 2 * 2 * (10 * 64 * 64 + 2 * 64 * 128) +
                                        (7 * 64 * 64 + 2 * 64 * 128));
}

TEST(ModelPreset, EveryNameResolvesAndUnknownListsThem) {
  for (const std::string& name : model_preset_names()) EXPECT_EQ(model_preset(name).name, name);
  try {
    model_preset("wan-2b");
    FAIL();
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("wan-14b"), std::string::npos) << e.what();
  }
}

TEST(ModelSpecFromSizes, EqualsThePresetOfTheSameSizes) {
  for (const std::string& name : model_preset_names()) {
    const ModelSpec preset = model_preset(name);
    validate_model_spec(preset);
    const ModelSpec made = make_model_spec(name, preset.width, preset.num_heads, preset.num_layers,
                                           preset.ffn_width, preset.text_tokens,
                                           preset.joint_attention, preset.num_double_layers);
    EXPECT_EQ(made.head_dim, preset.head_dim) << name;
    EXPECT_EQ(made.param_count, preset.param_count) << name;
  }
  EXPECT_EQ(make_model_spec("m", 64, 4, 2, 128, 8, false, 0, 0, 12345).param_count, 12345);
}

TEST(ModelSpecFromSizes, RejectsEachBadFieldByName) {
  const auto message = [](auto make) {
    try {
      make();
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(message([] { make_model_spec("m", 0, 4, 2, 128, 8, false); }).find("width"),
            std::string::npos);
  EXPECT_NE(message([] { make_model_spec("m", 64, 4, 2, 128, 8, false, 0, 20); })
                .find("head_dim * num_heads must equal width"),
            std::string::npos);
  EXPECT_NE(message([] { make_model_spec("m", 64, 4, 2, 128, 8, false, 1); })
                .find("cross-attention"),
            std::string::npos);
  EXPECT_NE(message([] { make_model_spec("m", 64, 4, 2, 128, 8, true, 3); })
                .find("num_double_layers must be in 0..2"),
            std::string::npos);
  EXPECT_NE(message([] { make_model_spec("m", 64, 4, 2, 128, -1, true); }).find("text_tokens"),
            std::string::npos);
  EXPECT_NE(message([] { make_model_spec("", 64, 4, 2, 128, 8, true); }).find("name"),
            std::string::npos);
}

std::string error_of(const std::function<void()>& make) {
  try {
    make();
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "no error";
}

TEST(ModelSpecFromSizes, RefusesEachSizeAboveItsBoundByName) {
  // name, width, heads, layers, ffn, text, joint, double layers, head_dim, param_count
  const std::vector<std::pair<std::function<void()>, std::string>> cases = {
      {[] { make_model_spec("m", kMaxModelWidth * 2, 4, 2, 128, 8, false); },
       "width must be at most 65536, got 131072"},
      {[] { make_model_spec("m", kMaxModelHeads * 2, kMaxModelHeads + 1, 2, 128, 8, false, 0, 2); },
       "num_heads must be at most 4096, got 4097"},
      {[] { make_model_spec("m", 64, 4, kMaxModelLayers + 1, 128, 8, false); },
       "num_layers must be at most 256, got 257"},
      {[] { make_model_spec("m", 64, 4, int64_t{1} << 20, 128, 8, false); },
       "num_layers must be at most 256"},
      {[] { make_model_spec("m", 64, 4, int64_t{1} << 40, 128, 8, false); },
       "num_layers must be at most 256"},
      {[] { make_model_spec("m", 64, 4, 2, kMaxModelFfnWidth + 1, 8, false); },
       "ffn_width must be at most 262144"},
      {[] { make_model_spec("m", 64, 4, 2, 128, kMaxTextTokens + 1, false); },
       "text_tokens must be at most 1048576"},
      {[] { make_model_spec("m", 64, 4, 2, 128, 8, false, 0, 0, kMaxModelParams + 1); },
       "param_count must be at most 1125899906842624"},
      // 4 x (2^62 + 1) wraps to 4 = width in int64: head_dim is refused before the product.
      {[] { make_model_spec("m", 4, 4, 2, 128, 8, false, 0, (int64_t{1} << 62) + 1); },
       "head_dim must be at most 65536"},
  };
  for (const auto& [make, needle] : cases) {
    const std::string message = error_of(make);
    EXPECT_NE(message.find(needle), std::string::npos) << message << " lacks " << needle;
  }
}

TEST(ModelSpecFromSizes, TheLargestSizesCountTheirParametersWithinTheBound) {
  for (const bool joint : {false, true}) {
    const int64_t double_layers = joint ? kMaxModelLayers : 0;
    const ModelSpec m =
        make_model_spec("m", kMaxModelWidth, kMaxModelWidth / 128, kMaxModelLayers,
                        kMaxModelFfnWidth, kMaxTextTokens, joint, double_layers);
    // The count in exact floating point (every term below 2^53).
    const double d = static_cast<double>(kMaxModelWidth);
    const double ffn = 2.0 * d * static_cast<double>(kMaxModelFfnWidth);
    const double layers = static_cast<double>(kMaxModelLayers);
    EXPECT_EQ(static_cast<double>(m.param_count),
              joint ? layers * 2.0 * (10.0 * d * d + ffn) : layers * (8.0 * d * d + ffn));
    EXPECT_LE(m.param_count, kMaxModelParams);
  }
}

TEST(ModelSpecFromSizes, AHandMadeSpecWhoseCountWouldWrapIsRefused) {
  ModelSpec m = model_preset("wan-14b");
  m.num_layers = int64_t{1} << 40;  // 2^40 x 8 x 5120^2 > 2^63
  const std::string message = error_of([&] { block_param_count(m); });
  EXPECT_NE(message.find("more than 2^63 parameters"), std::string::npos) << message;
}

TEST(LayerFlops, CrossAttentionBreakEvenAtThreeWidthPlusFfn) {
  // REFERENCE.md: attention equals the linear layers at s = 3d + ffn (~29k for wan-14b).
  const ModelSpec m = model_preset("wan-14b");
  const int64_t s = 3 * m.width + m.ffn_width;
  const LayerFlops f = layer_forward_flops(m, s, 0);
  EXPECT_DOUBLE_EQ(f.linear, f.self_attention);
  EXPECT_EQ(f.cross_attention, 0);
  const LayerFlops g = layer_forward_flops(m, 1000, 512);
  const double d = m.width;
  EXPECT_DOUBLE_EQ(g.cross_attention, 4 * d * 1000 * 512);
  EXPECT_DOUBLE_EQ(g.linear, (12 * d * d + 4 * d * m.ffn_width) * 1000 + 4 * d * d * 512);
  EXPECT_EQ(attended_tokens(m, 1000, 512), 1000);
}

TEST(LayerFlops, JointAttentionCountsTextInTheAttendedLength) {
  const ModelSpec m = model_preset("mmdit-11b");
  EXPECT_EQ(attended_tokens(m, 1000, 512), 1512);
  const LayerFlops f = layer_forward_flops(m, 1000, 512);
  const double d = m.width;
  EXPECT_DOUBLE_EQ(f.self_attention, 4 * d * 1512.0 * 1512.0);
  EXPECT_DOUBLE_EQ(f.linear, (8 * d * d + 4 * d * m.ffn_width) * 1512);
  EXPECT_EQ(f.cross_attention, 0);
  EXPECT_DOUBLE_EQ(train_flops(m, 1000, 512), 3 * 57 * (f.linear + f.self_attention));
}

TEST(Cluster, NvlinkAndPcie) {
  const Cluster c = make_cluster(32, 8);
  EXPECT_EQ(c.num_nodes, 4);
  EXPECT_EQ(c.num_ranks(), 32);
  EXPECT_EQ(c.node_of(17), 2);
  EXPECT_EQ(c.gpu_memory_bytes, int64_t{140} << 30);
  EXPECT_GT(c.intra_node_bytes_per_s, c.inter_node_bytes_per_s);
  const Cluster p = make_cluster(16, 8, "pcie");
  EXPECT_EQ(p.intra_node_bytes_per_s, 25e9);
  EXPECT_EQ(p.inter_node_bytes_per_s, 25e9);
}

TEST(Cluster, RejectsBadShapes) {
  try {
    make_cluster(8, 16);
    FAIL();
  } catch (const std::invalid_argument& e) {
    EXPECT_STREQ(e.what(), "--gpus-per-node 16 exceeds --gpus 8");
  }
  EXPECT_THROW(make_cluster(0, 8), std::invalid_argument);
  EXPECT_THROW(make_cluster(8, 0), std::invalid_argument);
  EXPECT_THROW(make_cluster(12, 8), std::invalid_argument);
  EXPECT_THROW(make_cluster(8, 8, "infiniband"), std::invalid_argument);
}

}  // namespace
}  // namespace zellige
