#include "zellige/plan.h"

#include <algorithm>
#include <cctype>
#include <stdexcept>
#include <unordered_map>
#include <vector>

namespace zellige {
namespace {

constexpr const char* kAllowedStrategies = "local, ulysses, ring, hybrid(u,r) with u, r >= 2";

std::string seq_prefix(int64_t id) { return "sequence " + std::to_string(id) + ": "; }

std::string strip_spaces(const std::string& text) {
  std::string out;
  for (char c : text) {
    if (!std::isspace(static_cast<unsigned char>(c))) out += c;
  }
  return out;
}

// Parses a positive decimal integer that fills the whole of `text`; -1 otherwise.
int64_t parse_positive(const std::string& text) {
  if (text.empty() || text.size() > 9) return -1;
  int64_t value = 0;
  for (char c : text) {
    if (!std::isdigit(static_cast<unsigned char>(c))) return -1;
    value = value * 10 + (c - '0');
  }
  return value > 0 ? value : -1;
}

}  // namespace

Placement make_placement(int64_t sequence_id, Strategy strategy, std::vector<int64_t> ranks,
                         int64_t ulysses_degree) {
  const int64_t degree = static_cast<int64_t>(ranks.size());
  if (degree == 0) throw std::invalid_argument(seq_prefix(sequence_id) + "placement has no ranks");
  Placement placement;
  placement.sequence_id = sequence_id;
  placement.strategy = strategy;
  placement.ranks = std::move(ranks);
  switch (strategy) {
    case Strategy::kLocal:
      if (degree != 1) {
        throw std::invalid_argument(seq_prefix(sequence_id) + "local placement needs 1 rank, got " +
                                    std::to_string(degree));
      }
      break;
    case Strategy::kUlysses:
      placement.ulysses_degree = degree;
      break;
    case Strategy::kRing:
      placement.ring_degree = degree;
      break;
    case Strategy::kHybrid:
      if (ulysses_degree < 2 || degree % ulysses_degree != 0 || degree / ulysses_degree < 2) {
        throw std::invalid_argument(seq_prefix(sequence_id) + "hybrid with ulysses degree " +
                                    std::to_string(ulysses_degree) + " on " +
                                    std::to_string(degree) +
                                    " ranks needs u >= 2, r >= 2 and u * r == ranks");
      }
      placement.ulysses_degree = ulysses_degree;
      placement.ring_degree = degree / ulysses_degree;
      break;
  }
  return placement;
}

std::string strategy_name(const Placement& placement) {
  switch (placement.strategy) {
    case Strategy::kLocal:
      return "local";
    case Strategy::kUlysses:
      return "ulysses";
    case Strategy::kRing:
      return "ring";
    case Strategy::kHybrid:
      return "hybrid(" + std::to_string(placement.ulysses_degree) + "," +
             std::to_string(placement.ring_degree) + ")";
  }
  return "unknown";
}

void parse_strategy(const std::string& name, Strategy* strategy, int64_t* ulysses_degree,
                    int64_t* ring_degree) {
  const std::string text = strip_spaces(name);
  if (text == "local") {
    *strategy = Strategy::kLocal;
    *ulysses_degree = 1;
    *ring_degree = 1;
    return;
  }
  if (text == "ulysses") {
    *strategy = Strategy::kUlysses;
    *ulysses_degree = 0;  // the rank count
    *ring_degree = 1;
    return;
  }
  if (text == "ring") {
    *strategy = Strategy::kRing;
    *ulysses_degree = 1;
    *ring_degree = 0;  // the rank count
    return;
  }
  const std::string prefix = "hybrid(";
  const size_t comma = text.find(',');
  if (text.rfind(prefix, 0) == 0 && text.back() == ')' && comma != std::string::npos) {
    const int64_t u = parse_positive(text.substr(prefix.size(), comma - prefix.size()));
    const int64_t r = parse_positive(text.substr(comma + 1, text.size() - comma - 2));
    if (u >= 2 && r >= 2) {
      *strategy = Strategy::kHybrid;
      *ulysses_degree = u;
      *ring_degree = r;
      return;
    }
  }
  throw std::invalid_argument("unknown strategy '" + name + "' (allowed: " + kAllowedStrategies +
                              ")");
}

std::vector<int64_t> balanced_split(int64_t total, int64_t parts) {
  if (parts <= 0 || total < 0) {
    throw std::invalid_argument("balanced_split needs total >= 0 and parts > 0, got " +
                                std::to_string(total) + " into " + std::to_string(parts));
  }
  std::vector<int64_t> sizes(parts, total / parts);
  for (int64_t i = 0; i < total % parts; ++i) ++sizes[i];
  return sizes;
}

void validate_plan(const Plan& plan, const Batch& batch, int64_t num_ranks, int64_t num_heads) {
  if (plan.num_ranks != num_ranks) {
    throw std::invalid_argument("plan is for " + std::to_string(plan.num_ranks) +
                                " ranks, the cluster has " + std::to_string(num_ranks));
  }
  // Times each batch id is placed: in a vector over the id range when ids are dense (the usual
  // case; plans of tens of thousands of placements are checked per step), else in a hash map.
  // -1 in the vector: not a batch id.
  int64_t min_id = 0, max_id = -1;
  for (const Sequence& seq : batch.sequences) {
    if (max_id < min_id) min_id = max_id = seq.id;
    min_id = std::min(min_id, seq.id);
    max_id = std::max(max_id, seq.id);
  }
  const bool dense = max_id >= min_id && static_cast<uint64_t>(max_id) - static_cast<uint64_t>(min_id) <
                                             2 * static_cast<uint64_t>(batch.sequences.size()) + 64;
  std::vector<int> times_placed_dense;
  std::unordered_map<int64_t, int> times_placed;
  if (dense) {
    times_placed_dense.assign(static_cast<size_t>(max_id - min_id + 1), -1);
    for (const Sequence& seq : batch.sequences) times_placed_dense[seq.id - min_id] = 0;
  } else {
    for (const Sequence& seq : batch.sequences) times_placed[seq.id] = 0;
  }
  // The count of a placed id, or nullptr when it is not a batch id.
  auto count_of = [&](int64_t id) -> int* {
    if (dense) {
      if (id < min_id || id > max_id || times_placed_dense[id - min_id] < 0) return nullptr;
      return &times_placed_dense[id - min_id];
    }
    auto it = times_placed.find(id);
    return it == times_placed.end() ? nullptr : &it->second;
  };
  std::vector<char> in_placement(static_cast<size_t>(std::max<int64_t>(num_ranks, 0)), 0);
  for (const Placement& p : plan.placements) {
    // Built only for an error: plans of tens of thousands of placements are checked per step.
    const auto prefix = [&p] { return seq_prefix(p.sequence_id); };
    int* count = count_of(p.sequence_id);
    if (count == nullptr) {
      throw std::invalid_argument(prefix() + "placed but not in the batch");
    }
    if (++*count > 1) throw std::invalid_argument(prefix() + "placed more than once");
    if (p.ranks.empty()) throw std::invalid_argument(prefix() + "placement has no ranks");
    for (int64_t rank : p.ranks) {
      if (rank < 0 || rank >= num_ranks) {
        throw std::invalid_argument(prefix() + "rank " + std::to_string(rank) +
                                    " is outside [0, " + std::to_string(num_ranks) + ")");
      }
      if (in_placement[rank]) {
        throw std::invalid_argument(prefix() + "rank " + std::to_string(rank) + " is repeated");
      }
      in_placement[rank] = 1;
    }
    for (int64_t rank : p.ranks) in_placement[rank] = 0;
    const int64_t degree = p.degree();
    bool degrees_ok =
        p.ulysses_degree >= 1 && p.ring_degree >= 1 && p.ulysses_degree * p.ring_degree == degree;
    switch (p.strategy) {
      case Strategy::kLocal:
        degrees_ok = degrees_ok && degree == 1;
        break;
      case Strategy::kUlysses:
        degrees_ok = degrees_ok && p.ring_degree == 1;
        break;
      case Strategy::kRing:
        degrees_ok = degrees_ok && p.ulysses_degree == 1;
        break;
      case Strategy::kHybrid:
        degrees_ok = degrees_ok && p.ulysses_degree >= 2 && p.ring_degree >= 2;
        break;
    }
    if (!degrees_ok) {
      throw std::invalid_argument(prefix() + "strategy " + strategy_name(p) + " (ulysses degree " +
                                  std::to_string(p.ulysses_degree) + ", ring degree " +
                                  std::to_string(p.ring_degree) + ") does not match its " +
                                  std::to_string(degree) + " ranks");
    }
    if (num_heads > 0 && p.ulysses_degree > num_heads) {
      throw std::invalid_argument(prefix() + "ulysses degree " + std::to_string(p.ulysses_degree) +
                                  " exceeds the model's " + std::to_string(num_heads) +
                                  " heads (a rank would get no head)");
    }
  }
  for (const Sequence& seq : batch.sequences) {
    if (*count_of(seq.id) == 0) throw std::invalid_argument(seq_prefix(seq.id) + "not placed");
  }
}

}  // namespace zellige
