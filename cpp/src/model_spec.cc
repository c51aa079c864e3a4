#include "zellige/model_spec.h"

#include <stdexcept>
#include <string>

#include "zellige/workload.h"

namespace zellige {
namespace {

// Parameters of the attention + FFN blocks (embeddings, final layer and norms are < 1%).
//  cross-attention block: self q,k,v,o + cross q,k,v,o + FFN in/out
//  MMDiT double block: two streams, each q,k,v,o + FFN + 6-way modulation
//  MMDiT single block: fused q,k,v + FFN in, fused out (= q,k,v,o + FFN) + 3-way modulation
// Sizes within validate_model_spec's bounds give at most about 2^46; beyond them (a ModelSpec
// built by hand) a count past int64 is refused, never wrapped.
int64_t count_block_params(const ModelSpec& m) {
  const auto fail = [&m]() -> int64_t {
    throw std::invalid_argument("model '" + m.name + "': its sizes give more than 2^63 parameters");
  };
  const auto mul = [&](int64_t a, int64_t b) {
    int64_t product = 0;
    return __builtin_mul_overflow(a, b, &product) ? fail() : product;
  };
  const auto add = [&](int64_t a, int64_t b) {
    int64_t sum = 0;
    return __builtin_add_overflow(a, b, &sum) ? fail() : sum;
  };
  const int64_t d2 = mul(m.width, m.width);
  const int64_t ffn = mul(2, mul(m.width, m.ffn_width));
  if (!m.joint_attention) return mul(m.num_layers, add(mul(8, d2), ffn));
  const int64_t double_block = mul(2, add(mul(10, d2), ffn));
  const int64_t single_block = add(mul(7, d2), ffn);
  return add(mul(m.num_double_layers, double_block),
             mul(m.num_layers - m.num_double_layers, single_block));
}

ModelSpec make_model(const std::string& name, int64_t width, int64_t num_double_layers,
                     int64_t num_single_layers, int64_t num_heads, int64_t ffn_width,
                     int64_t text_tokens, bool joint_attention) {
  ModelSpec m;
  m.name = name;
  m.width = width;
  m.num_layers = num_double_layers + num_single_layers;
  m.num_double_layers = num_double_layers;
  m.num_heads = num_heads;
  m.head_dim = width / num_heads;
  m.ffn_width = ffn_width;
  m.text_tokens = text_tokens;
  m.joint_attention = joint_attention;
  m.param_count = count_block_params(m);
  return m;
}

}  // namespace

int64_t block_param_count(const ModelSpec& model) { return count_block_params(model); }

std::vector<std::string> model_preset_names() {
  return {"wan-1.3b", "wan-14b", "mmdit-11b", "hunyuan-13b", "tiny", "mmdit-tiny"};
}

ModelSpec model_preset(const std::string& name) {
  if (name == "wan-1.3b") return make_model(name, 1536, 0, 30, 12, 8960, 512, false);
  if (name == "wan-14b") return make_model(name, 5120, 0, 40, 40, 13824, 512, false);
  if (name == "mmdit-11b") return make_model(name, 3072, 19, 38, 24, 4 * 3072, 512, true);
  if (name == "hunyuan-13b") return make_model(name, 3072, 20, 40, 24, 4 * 3072, 256, true);
  if (name == "tiny") return make_model(name, 64, 0, 2, 4, 128, 8, false);
  if (name == "mmdit-tiny") return make_model(name, 64, 2, 1, 4, 128, 8, true);
  std::string allowed;
  for (const std::string& preset : model_preset_names()) {
    allowed += (allowed.empty() ? "" : ", ") + preset;
  }
  throw std::invalid_argument("unknown model '" + name + "' (allowed: " + allowed + ")");
}

void validate_model_spec(const ModelSpec& m) {
  const std::string where = "model '" + m.name + "': ";
  if (m.name.empty()) throw std::invalid_argument("model: name must not be empty");
  // low is 0 or 1: "> 0" or ">= 0"
  const auto in_range = [&](int64_t value, const char* field, int64_t low, int64_t high) {
    if (value < low) {
      throw std::invalid_argument(where + field + (low > 0 ? " must be > 0" : " must be >= 0") +
                                  ", got " + std::to_string(value));
    }
    if (value > high) {
      throw std::invalid_argument(where + field + " must be at most " + std::to_string(high) +
                                  ", got " + std::to_string(value));
    }
  };
  in_range(m.width, "width", 1, kMaxModelWidth);
  in_range(m.num_heads, "num_heads", 1, kMaxModelHeads);
  in_range(m.head_dim, "head_dim", 1, kMaxModelWidth);
  in_range(m.num_layers, "num_layers", 1, kMaxModelLayers);
  in_range(m.ffn_width, "ffn_width", 1, kMaxModelFfnWidth);
  in_range(m.text_tokens, "text_tokens", 0, kMaxTextTokens);  // 0: no text (class-conditioned)
  in_range(m.param_count, "param_count", 1, kMaxModelParams);
  // Both factors are bounded above, so the product cannot wrap.
  if (m.head_dim * m.num_heads != m.width) {
    throw std::invalid_argument(where + "head_dim * num_heads must equal width (" +
                                std::to_string(m.head_dim) + " * " + std::to_string(m.num_heads) +
                                " != " + std::to_string(m.width) + ")");
  }
  if (m.num_double_layers < 0 || m.num_double_layers > m.num_layers) {
    throw std::invalid_argument(where + "num_double_layers must be in 0.." +
                                std::to_string(m.num_layers) + " (num_layers), got " +
                                std::to_string(m.num_double_layers));
  }
  if (!m.joint_attention && m.num_double_layers != 0) {
    throw std::invalid_argument(where +
                                "num_double_layers must be 0 for a cross-attention model "
                                "(double-stream layers are joint attention's)");
  }
}

ModelSpec make_model_spec(const std::string& name, int64_t width, int64_t num_heads,
                          int64_t num_layers, int64_t ffn_width, int64_t text_tokens,
                          bool joint_attention, int64_t num_double_layers, int64_t head_dim,
                          int64_t param_count) {
  ModelSpec m;
  m.name = name;
  m.width = width;
  m.num_heads = num_heads;
  m.head_dim = head_dim != 0 ? head_dim : (num_heads > 0 ? width / num_heads : 0);
  m.num_layers = num_layers;
  m.num_double_layers = num_double_layers;
  m.ffn_width = ffn_width;
  m.text_tokens = text_tokens;
  m.joint_attention = joint_attention;
  m.param_count = 1;  // checked below with the sizes, then counted
  validate_model_spec(m);
  m.param_count = param_count != 0 ? param_count : count_block_params(m);
  validate_model_spec(m);
  return m;
}

int64_t attended_tokens(const ModelSpec& model, int64_t num_tokens, int64_t text_tokens) {
  return model.joint_attention ? num_tokens + text_tokens : num_tokens;
}

LayerFlops layer_forward_flops(const ModelSpec& model, int64_t num_tokens, int64_t text_tokens) {
  const double d = static_cast<double>(model.width);
  const double ffn = static_cast<double>(model.ffn_width);
  const double text = static_cast<double>(text_tokens);
  LayerFlops flops;
  if (model.joint_attention) {
    const double tokens = static_cast<double>(num_tokens + text_tokens);
    flops.linear = (8 * d * d + 4 * d * ffn) * tokens;
    flops.self_attention = 4 * d * tokens * tokens;
  } else {
    const double tokens = static_cast<double>(num_tokens);
    // self q,k,v,o + cross q,o per video token; cross k,v per text token
    flops.linear = (12 * d * d + 4 * d * ffn) * tokens + 4 * d * d * text;
    flops.self_attention = 4 * d * tokens * tokens;
    flops.cross_attention = 4 * d * tokens * text;
  }
  return flops;
}

double train_flops(const ModelSpec& model, int64_t num_tokens, int64_t text_tokens) {
  const LayerFlops f = layer_forward_flops(model, num_tokens, text_tokens);
  return 3.0 * (f.linear + f.self_attention + f.cross_attention) *
         static_cast<double>(model.num_layers);
}

}  // namespace zellige
