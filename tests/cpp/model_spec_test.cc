#include "zellige/model_spec.h"

#include <gtest/gtest.h>

#include <stdexcept>

#include "zellige/cluster.h"

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
