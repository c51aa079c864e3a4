// Model presets and FLOP counts (REFERENCE.md: model presets, FLOPs per layer).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace zellige {

struct ModelSpec {
  std::string name;
  int64_t width = 0;              // d
  int64_t num_layers = 0;         // all transformer blocks (MMDiT: double + single)
  int64_t num_double_layers = 0;  // MMDiT blocks with separate text/image weights (2x params)
  int64_t num_heads = 0;
  int64_t head_dim = 0;  // width / num_heads
  int64_t ffn_width = 0;
  int64_t text_tokens = 0;       // default text length
  bool joint_attention = false;  // MMDiT: text joins self-attention; Wan: separate cross-attention
  int64_t param_count = 0;       // presets: the blocks' (block_param_count); a module's: all
};

// Upper bounds of a model's sizes, the one table (docs/model-spec.md lists it): far above any
// DiT (Wan 14B: width 5120, 40 layers, 40 heads), low enough that the parameter count and every
// product of sizes stay inside int64 and a plan takes seconds (the planners' memory search
// weighs every layer). text_tokens has a sequence's bound, kMaxTextTokens (workload.h).
inline constexpr int64_t kMaxModelWidth = int64_t{1} << 16;     // width; head_dim too
inline constexpr int64_t kMaxModelHeads = int64_t{1} << 12;     // num_heads
inline constexpr int64_t kMaxModelLayers = int64_t{1} << 8;     // num_layers
inline constexpr int64_t kMaxModelFfnWidth = int64_t{1} << 18;  // ffn_width
inline constexpr int64_t kMaxModelParams = int64_t{1} << 50;    // param_count (10^15)

// Presets: "wan-1.3b", "wan-14b", "mmdit-11b", "hunyuan-13b", "tiny" and "mmdit-tiny" (for
// tests and CPU smoke runs: zellige.model's tiny-cpu and mmdit-tiny-cpu). Throws
// std::invalid_argument naming the allowed names for an unknown one.
ModelSpec model_preset(const std::string& name);
std::vector<std::string> model_preset_names();

// Checks a model given by its sizes (a spec file, a user's module; zellige.load_model_spec) and
// throws std::invalid_argument naming the field that is wrong and what is allowed: every size
// > 0 and at most its bound above, head_dim * num_heads == width (the cost model's attention
// width is the model's), a cross-attention model has no double-stream layers, a joint one at
// most num_layers of them.
void validate_model_spec(const ModelSpec& model);

// A validated ModelSpec from sizes. head_dim 0: width / num_heads; param_count 0: the blocks'
// count (block_param_count), as for a preset.
ModelSpec make_model_spec(const std::string& name, int64_t width, int64_t num_heads,
                          int64_t num_layers, int64_t ffn_width, int64_t text_tokens,
                          bool joint_attention, int64_t num_double_layers = 0,
                          int64_t head_dim = 0, int64_t param_count = 0);

// Parameters of the transformer blocks alone, from the sizes (a preset's param_count; a real
// module's count adds its embeddings and final layer).
int64_t block_param_count(const ModelSpec& model);

// Forward FLOPs of ONE layer for one sequence (multiply-add = 2 FLOPs).
struct LayerFlops {
  double linear = 0;           // projections + FFN (+ cross-attention q/o and text k/v)
  double self_attention = 0;   // 4 * d * L_attn^2, L_attn = tokens (+ text for joint attention)
  double cross_attention = 0;  // 4 * d * tokens * text (cross-attention models only)
};
LayerFlops layer_forward_flops(const ModelSpec& model, int64_t num_tokens, int64_t text_tokens);

// Tokens that attend together: num_tokens (+ text_tokens for joint-attention models).
int64_t attended_tokens(const ModelSpec& model, int64_t num_tokens, int64_t text_tokens);

// Forward + backward FLOPs of the whole model for one sequence (3x forward), for MFU.
double train_flops(const ModelSpec& model, int64_t num_tokens, int64_t text_tokens);

}  // namespace zellige
