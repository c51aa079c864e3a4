#include "rank_loads.h"

#include <algorithm>
#include <cstdio>
#include <numeric>

namespace zellige::planners {

RankLoads::RankLoads(const CostModel& cost_model, EvaluationCache* cache)
    : cost_model_(cost_model),
      cache_(cache),
      fixed_bytes_(cost_model.fixed_bytes()),
      capacity_bytes_(cost_model.memory_capacity_bytes()),
      least_s_per_token_(cost_model.min_linear_time_per_token_s() * (1 - 1e-9)),
      tokens_(cost_model.cluster().num_ranks(), 0),
      attention_s_(cost_model.cluster().num_ranks(), 0.0),
      exchange_s_(cost_model.cluster().num_ranks(), 0.0),
      memory_bytes_(cost_model.cluster().num_ranks(), 0.0) {}

double RankLoads::time_s(int64_t rank) const {
  return cost_model_.rank_time_s(tokens_[rank], attention_s_[rank], exchange_s_[rank]);
}

bool RankLoads::fits(const std::vector<RankShare>& shares) const {
  for (const RankShare& share : shares) {
    if (fixed_bytes_ + memory_bytes_[share.rank] + share.memory_bytes > capacity_bytes_) {
      return false;
    }
  }
  return true;
}

double RankLoads::time_with_s(const std::vector<RankShare>& shares) const {
  double time_s = 0;
  for (const RankShare& share : shares) {
    const int64_t r = share.rank;
    time_s = std::max(time_s, cost_model_.rank_time_s(tokens_[r] + share.tokens,
                                                      attention_s_[r] + share.attention_s,
                                                      exchange_s_[r] + share.exchange_s));
  }
  return time_s;
}

void RankLoads::add(const std::vector<RankShare>& shares) {
  for (const RankShare& share : shares) {
    tokens_[share.rank] += share.tokens;
    attention_s_[share.rank] += share.attention_s;
    exchange_s_[share.rank] += share.exchange_s;
    memory_bytes_[share.rank] += share.memory_bytes;
  }
}

bool RankLoads::fits(const RankShare& share, int64_t first_rank, int64_t num_ranks) const {
  for (int64_t rank = first_rank; rank < first_rank + num_ranks; ++rank) {
    if (fixed_bytes_ + memory_bytes_[rank] + share.memory_bytes > capacity_bytes_) return false;
  }
  return true;
}

void RankLoads::add(const RankShare& share, int64_t first_rank, int64_t num_ranks) {
  for (int64_t rank = first_rank; rank < first_rank + num_ranks; ++rank) {
    tokens_[rank] += share.tokens;
    attention_s_[rank] += share.attention_s;
    exchange_s_[rank] += share.exchange_s;
    memory_bytes_[rank] += share.memory_bytes;
  }
}

void RankLoads::remove(const std::vector<RankShare>& shares) {
  for (const RankShare& share : shares) {
    tokens_[share.rank] -= share.tokens;
    attention_s_[share.rank] -= share.attention_s;
    exchange_s_[share.rank] -= share.exchange_s;
    memory_bytes_[share.rank] -= share.memory_bytes;
  }
}

std::string format_gib(double bytes) {
  char text[64];
  std::snprintf(text, sizeof(text), "%.1f GiB", bytes / (1024.0 * 1024.0 * 1024.0));
  return text;
}

std::string describe_sequence(const Sequence& sequence) {
  return "sequence " + std::to_string(sequence.id) + " (" + std::to_string(sequence.num_tokens) +
         " tokens)";
}

double placement_time_s(const CostModel& cost_model, const std::vector<RankShare>& shares) {
  double time_s = 0;
  for (const RankShare& share : shares) {
    time_s =
        std::max(time_s, cost_model.rank_time_s(share.tokens, share.attention_s, share.exchange_s));
  }
  return time_s;
}

double placement_memory_bytes(const std::vector<RankShare>& shares) {
  double bytes = 0;
  for (const RankShare& share : shares) bytes = std::max(bytes, share.memory_bytes);
  return bytes;
}

Plan empty_plan(const std::string& planner, const CostModel& cost_model) {
  Plan plan;
  plan.planner = planner;
  plan.num_ranks = cost_model.cluster().num_ranks();
  return plan;
}

std::vector<int64_t> consecutive_ranks(int64_t first, int64_t count) {
  std::vector<int64_t> ranks(count);
  std::iota(ranks.begin(), ranks.end(), first);
  return ranks;
}

}  // namespace zellige::planners
