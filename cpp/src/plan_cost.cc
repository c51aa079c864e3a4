// A whole plan's cost: the attention calls the engine runs on each rank (grouped equal
// segments, ragged tables, streams), the memo of placements' shares, the floors the planners
// compare plans by, and evaluate().
#include <algorithm>
#include <array>
#include <cstdint>
#include <iterator>
#include <limits>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

#include "cost_model_internal.h"
#include "zellige/cost_model.h"

namespace zellige {

using cost_model_internal::kCrossTag;
using cost_model_internal::kElementwiseBytesPerTokenWidth;
using cost_model_internal::kRouteBytesPerToken;
using cost_model_internal::max_rate;

std::vector<int64_t> stream_assignment(const std::vector<int64_t>& works, int64_t streams) {
  std::vector<int64_t> queued(static_cast<size_t>(std::max<int64_t>(1, streams)), 0);
  std::vector<int64_t> chosen;
  chosen.reserve(works.size());
  for (const int64_t work : works) {
    const auto least = std::min_element(queued.begin(), queued.end());  // first of the least
    *least += work;
    chosen.push_back(least - queued.begin());
  }
  return chosen;
}

double streamed_calls_s(const std::vector<int64_t>& works, const std::vector<double>& seconds,
                        int64_t streams, double overlap) {
  if (works.size() != seconds.size()) {
    throw std::invalid_argument("streamed_calls_s: one work and one time per call");
  }
  double serial_s = 0;
  for (const double call_s : seconds) serial_s += call_s;
  if (streams <= 1 || overlap == 0 || works.size() < 2) return serial_s;
  std::vector<double> load_s(static_cast<size_t>(streams), 0.0);
  const std::vector<int64_t> chosen = stream_assignment(works, streams);
  for (size_t i = 0; i < chosen.size(); ++i) load_s[static_cast<size_t>(chosen[i])] += seconds[i];
  const double most_s = *std::max_element(load_s.begin(), load_s.end());
  return serial_s - overlap * (serial_s - most_s);
}

// The segments each rank of `placement` attends, as the engine groups them into calls (see
// the step program's dense groups, docs/architecture.md): self-attention of its block's heads against
// every block (one call per ring step), and cross-attention of its chunk to the text.
void CostModel::add_attention_calls(const Sequence& sequence, const Placement& placement,
                                    std::vector<RankCall>* calls,
                                    std::vector<int64_t>* ring_step_calls) const {
  std::vector<CallKey> keys;
  const int64_t u = placement.ulysses_degree;
  for (int64_t j = 0; j < placement.ring_degree; ++j) {
    for (int64_t k = 0; k < u; ++k) {
      int64_t steps = 0;
      position_calls(sequence, placement, j, k, &keys, &steps);
      const int64_t rank = placement.ranks[j * u + k];
      (*ring_step_calls)[rank] += steps;
      for (const CallKey& key : keys) calls->push_back({rank, key});
    }
  }
}

// Position (j, k) holds block j of the ring and head group k of the Ulysses group. Every key it
// lists differs from the others (ring steps by step, the text call by its tag).
void CostModel::position_calls(const Sequence& sequence, const Placement& placement, int64_t j,
                               int64_t k, std::vector<CallKey>* keys,
                               int64_t* ring_step_calls) const {
  keys->clear();
  if (ring_step_calls != nullptr) *ring_step_calls = 0;
  const int64_t unit_tokens = attended_tokens(model_, sequence.num_tokens, sequence.text_tokens);
  const int64_t u = placement.ulysses_degree;
  const int64_t r = placement.ring_degree;
  const int64_t all_heads = model_.num_heads;
  const bool cross = !model_.joint_attention && sequence.text_tokens > 0;
  const int64_t small_block = unit_tokens / r, num_big_blocks = unit_tokens % r;
  const auto block_of = [&](int64_t i) { return small_block + (i < num_big_blocks ? 1 : 0); };
  const int64_t block = block_of(j);
  const int64_t chunk = block / u + (k < block % u ? 1 : 0);
  const int64_t heads = all_heads / u + (k < all_heads % u ? 1 : 0);
  if (block > 0 && heads > 0 && r > 1 && ring_step_calls != nullptr) {
    // the ring meets every block once: one call per nonempty block
    *ring_step_calls = small_block > 0 ? r : num_big_blocks;
  } else if (block > 0 && heads > 0) {
    for (int64_t step = 0; step < r; ++step) {
      const int64_t key_block = block_of((j + r - step) % r);
      if (key_block == 0) continue;
      const int64_t tag = r == 1 ? -1 : sequence.id;
      keys->push_back({block, key_block, heads, tag, r == 1 ? 0 : step});
    }
  }
  if (cross && chunk > 0) keys->push_back({chunk, sequence.text_tokens, all_heads, kCrossTag, 0});
}

int CostModel::ragged_kind(const CallKey& key) const {
  if (key[3] == kCrossTag) return 2;
  if (key[3] != -1) return -1;  // a ring step's sequence
  return key[2] == model_.num_heads ? 0 : 1;  // a Ulysses rank holds fewer heads than all
}

std::array<bool, CostModel::kRaggedKinds> CostModel::ragged_tables(
    std::vector<RankCall>::const_iterator first, std::vector<RankCall>::const_iterator last) const {
  std::array<bool, kRaggedKinds> ragged{};
  if (!profile_.attention_ragged) return ragged;
  std::array<int64_t, kRaggedKinds> calls{}, heads{}, longest{};
  std::array<bool, kRaggedKinds> one_head_count{true, true, true};
  for (auto it = first; it != last; ++it) {
    if (it != first && std::prev(it)->key == it->key) continue;  // one call per distinct key
    const int kind = ragged_kind(it->key);
    if (kind < 0) continue;
    if (calls[kind]++ == 0) heads[kind] = it->key[2];
    one_head_count[kind] = one_head_count[kind] && heads[kind] == it->key[2];
    longest[kind] = std::max({longest[kind], it->key[0], it->key[1]});
  }
  for (int kind = 0; kind < kRaggedKinds; ++kind) {
    ragged[kind] = calls[kind] >= kRaggedMinCalls && one_head_count[kind] &&
                   longest[kind] <= kRaggedMaxSegmentTokens;
  }
  return ragged;
}

size_t EvaluationCache::KeyHash::operator()(const std::vector<int64_t>& key) const {
  uint64_t hash = 1469598103934665603ull;
  for (int64_t value : key) {
    hash ^= static_cast<uint64_t>(value) + 0x9e3779b97f4a7c15ull + (hash << 6) + (hash >> 2);
  }
  return static_cast<size_t>(hash);
}

namespace {
// Stands for the sequence's own id in fill_entry's call keys: a ring's steps sort alike,
// whichever the sequence, so every entry of one shape sums its excess in one order.
constexpr int64_t kOwnTag = std::numeric_limits<int64_t>::min();
}  // namespace

// Key: lengths, degrees, then the ranks' nodes renumbered by first appearance (shares depend on
// the ranks only through which of them share a node).
EvaluationCache::Entry& CostModel::cached_terms(const Sequence& sequence,
                                                const Placement& placement,
                                                EvaluationCache& cache) const {
  EvaluationCache::Entry* found = nullptr;
  bool inserted = false;
  if (placement.ranks.size() == 1) {
    auto [it, is_new] =
        cache.local_entries_.try_emplace({sequence.num_tokens, sequence.text_tokens});
    found = &it->second;
    inserted = is_new;
  } else {
    found = &find_entry(sequence, placement, cache, &inserted);
  }
  EvaluationCache::Entry& entry = *found;
  if (!inserted) return entry;
  fill_entry(sequence, placement, &entry);
  return entry;
}

EvaluationCache::Entry& CostModel::find_entry(const Sequence& sequence, const Placement& placement,
                                              EvaluationCache& cache, bool* inserted) const {
  std::vector<int64_t>& key = cache.key_;
  key.assign({sequence.num_tokens, sequence.text_tokens, placement.ulysses_degree,
              placement.ring_degree});
  // Per node its label (-1: none yet), scratch that is all -1 between calls: a placement over a
  // few ranks costs a few array reads, not a hash map built per call.
  std::vector<int64_t>& labels = cache.node_labels_;
  if (labels.size() < static_cast<size_t>(cluster_.num_nodes)) {
    labels.assign(static_cast<size_t>(cluster_.num_nodes), -1);
  }
  // Run-length encoded (positions in a row on one node, then its label): a placement's ranks
  // come mostly sorted, so the key holds a pair per node rather than an entry per rank.
  int64_t next_label = 0;
  const std::vector<int64_t>& ranks = placement.ranks;
  // One division per run, not per rank: a run extends while its ranks stay in the node's range.
  const int64_t gpus_per_node = cluster_.gpus_per_node;
  auto for_each_run = [&](auto&& visit) {
    for (size_t k = 0; k < ranks.size();) {
      const int64_t node = cluster_.node_of(ranks[k]);
      const int64_t node_first = node * gpus_per_node, node_end = node_first + gpus_per_node;
      size_t end = k + 1;
      while (end < ranks.size() && ranks[end] >= node_first && ranks[end] < node_end) ++end;
      visit(node, static_cast<int64_t>(end - k));
      k = end;
    }
  };
  for_each_run([&](int64_t node, int64_t length) {
    int64_t& label = labels[static_cast<size_t>(node)];
    if (label < 0) label = next_label++;
    key.push_back(length);
    key.push_back(label);
  });
  for_each_run([&](int64_t node, int64_t) { labels[static_cast<size_t>(node)] = -1; });
  auto [it, is_new] = cache.entries_.try_emplace(key);
  *inserted = is_new;
  return it->second;
}

void CostModel::fill_entry(const Sequence& sequence, const Placement& placement,
                           EvaluationCache::Entry* out) const {
  EvaluationCache::Entry& entry = *out;
  double sent = 0;
  entry.shares = shares_and_bytes(sequence, placement, &sent);
  for (RankShare& share : entry.shares) {
    if (share.rank != sequence.source_rank) {
      sent -= 2.0 * kRouteBytesPerToken * static_cast<double>(share.tokens);
    }
  }
  entry.exchange_bytes = sent;
  for (size_t k = 0; k < entry.shares.size(); ++k) entry.shares[k].rank = static_cast<int64_t>(k);
  // Each position's call excess, summed over its calls in key order (as evaluate lists them).
  // A position's calls are fixed by its block, head count and text chunk up to the ring step
  // (every position's ring meets every block once), so positions alike share one sum: a ring
  // over thousands of ranks lists a few positions' calls, not every one's.
  const int64_t u = placement.ulysses_degree;
  const int64_t r = placement.ring_degree;
  entry.call_excess_s.assign(entry.shares.size(), 0.0);
  entry.calls.clear();
  entry.calls_listed = false;
  const double layers = static_cast<double>(model_.num_layers);
  // Positions repeat a few (query, key, heads) triples (a ring has at most two block sizes):
  // each one's excess is priced once.
  std::vector<std::pair<std::array<int64_t, 3>, double>> excess_per_head_s;
  std::vector<std::pair<std::array<int64_t, 3>, double>> excess_of_position;  // by its triple
  std::vector<CallKey> keys;
  Sequence own = sequence;  // keys ordered alike for every sequence of this shape
  own.id = kOwnTag;
  const int64_t unit_tokens = attended_tokens(model_, sequence.num_tokens, sequence.text_tokens);
  const int64_t all_heads = model_.num_heads;
  for (int64_t j = 0; j < r; ++j) {
    const int64_t block = unit_tokens / r + (j < unit_tokens % r ? 1 : 0);
    for (int64_t k = 0; k < u; ++k) {
      const std::array<int64_t, 3> position = {block, block / u + (k < block % u ? 1 : 0),
                                               all_heads / u + (k < all_heads % u ? 1 : 0)};
      auto alike = std::find_if(excess_of_position.begin(), excess_of_position.end(),
                                [&](const auto& item) { return item.first == position; });
      if (alike == excess_of_position.end()) {
        position_calls(own, placement, j, k, &keys);
        std::sort(keys.begin(), keys.end());  // distinct keys, one segment each
        double excess_s = 0;
        for (const CallKey& call : keys) {
          const std::array<int64_t, 3> lengths_heads = {call[0], call[1], call[2]};
          auto known = std::find_if(excess_per_head_s.begin(), excess_per_head_s.end(),
                                    [&](const auto& item) { return item.first == lengths_heads; });
          if (known == excess_per_head_s.end()) {
            excess_per_head_s.push_back(
                {lengths_heads,
                 call_excess_per_head_s(static_cast<double>(call[0]), static_cast<double>(call[1]),
                                        static_cast<double>(call[2]))});
            known = excess_per_head_s.end() - 1;
          }
          const double heads = static_cast<double>(call[2]);
          excess_s += layers * 1.0 * heads * known->second;
          if (call[3] == kCrossTag && stream_gain_bound_ > 0) {
            // what the cross-attention table's streams may save of this call at most: the floor
            // takes it off with the excess (evaluate prices the actual saving per rank)
            const double lq = static_cast<double>(call[0]), lk = static_cast<double>(call[1]);
            excess_s += stream_gain_bound_ * layers * heads *
                        (head_forward_s(lq, lk) + head_backward_s(lq, lk) + known->second);
          }
        }
        excess_of_position.push_back({position, excess_s});
        alike = excess_of_position.end() - 1;
      }
      entry.call_excess_s[j * u + k] = alike->second;
    }
  }
}

void CostModel::list_calls(const Sequence& sequence, const Placement& placement,
                           EvaluationCache::Entry* entry) const {
  if (entry->calls_listed) return;
  entry->calls_listed = true;
  const int64_t u = placement.ulysses_degree;
  entry->calls.resize(placement.ranks.size());
  entry->ring_step_calls.assign(placement.ranks.size(), 0);
  std::vector<CallKey> keys;
  for (int64_t j = 0; j < placement.ring_degree; ++j) {
    for (int64_t k = 0; k < u; ++k) {
      position_calls(sequence, placement, j, k, &keys, &entry->ring_step_calls[j * u + k]);
      std::sort(keys.begin(), keys.end());  // distinct keys, one segment each
      auto& calls = entry->calls[j * u + k];
      calls.clear();
      for (const CallKey& key : keys) calls.push_back({key, 1});
    }
  }
}

double CostModel::makespan_floor(const Batch& batch, const Plan& plan, EvaluationCache& cache,
                                 double* recompute_floor_s) const {
  const int64_t num_ranks = cluster_.num_ranks();
  std::vector<int64_t> tokens(static_cast<size_t>(num_ranks), 0);
  std::vector<double> other_s(static_cast<size_t>(num_ranks), 0.0);
  // recompute_floor_s's per-rank sums, as evaluate keeps them.
  const bool memory_terms = recompute_floor_s != nullptr && options_.activation_checkpointing;
  RecomputeTotals totals;
  if (memory_terms) totals.reset(num_ranks);
  std::unordered_map<int64_t, const Sequence*> by_id;
  const size_t num_sequences = batch.sequences.size();
  std::vector<FloorTerm> terms;
  for (size_t i = 0; i < plan.placements.size(); ++i) {
    const Placement& placement = plan.placements[i];
    const Sequence* sequence = i < num_sequences ? &batch.sequences[i] : nullptr;
    if (sequence == nullptr || sequence->id != placement.sequence_id) {  // not in batch order
      if (by_id.empty()) {
        for (const Sequence& s : batch.sequences) by_id[s.id] = &s;
      }
      sequence = by_id.at(placement.sequence_id);
    }
    floor_terms(*sequence, placement, cache, &terms);
    for (size_t k = 0; k < terms.size(); ++k) {
      const int64_t rank = placement.ranks[k];
      tokens[rank] += terms[k].tokens;
      other_s[rank] += terms[k].added_s;
      if (terms[k].skipped_s != 0) other_s[rank] -= terms[k].skipped_s;
      if (memory_terms) totals.add(rank, terms[k]);
    }
  }
  const double floor_s = floor_of_totals(tokens, other_s);
  if (recompute_floor_s == nullptr) return floor_s;
  *recompute_floor_s = memory_terms ? recompute_floor_of_totals(tokens, other_s, totals, floor_s)
                                    : floor_s;
  return floor_s;
}

void CostModel::RecomputeTotals::reset(int64_t num_ranks) {
  const size_t n = static_cast<size_t>(num_ranks);
  bytes.assign(n, {0, 0, 0, 0});
  phase_tokens.assign(n, {0, 0, 0});
  recompute_s.assign(n, 0.0);
  full_recompute_s.assign(n, 0.0);
  world_exchange = false;
}

void CostModel::RecomputeTotals::add(int64_t rank, const FloorTerm& term) {
  std::array<double, 4>& held = bytes[rank];
  for (size_t b = 0; b < 4; ++b) held[b] += term.bytes[b];
  phase_tokens[rank][term.phase] += static_cast<double>(term.tokens);
  recompute_s[rank] += term.recompute_s;
  full_recompute_s[rank] += term.full_recompute_s;
  world_exchange = world_exchange || term.ulysses;
}

double CostModel::recompute_floor_of_totals(const std::vector<int64_t>& tokens,
                                            std::vector<double>& other_s,
                                            const RecomputeTotals& totals, double floor_s) const {
  if (!options_.activation_checkpointing) return floor_s;
  const bool skips_recompute = options_.adaptive_checkpointing;
  const int64_t num_ranks = static_cast<int64_t>(tokens.size());
  // Each rank's layers as evaluate picks them (time only grows with either count), then the
  // recompute they cost beyond what the first floor charged.
  std::vector<std::pair<int64_t, int64_t>> layers_of(static_cast<size_t>(num_ranks));
  int64_t most_checkpointed = 0, most_full = 0;
  for (int64_t i = 0; i < num_ranks; ++i) {
    const std::array<double, 4>& held = totals.bytes[i];
    layers_of[i] = rank_checkpointing(held[0], held[1], held[2],
                                      phase_buffer_bytes(held[3], totals.phase_tokens[i]),
                                      tokens[i], memory_capacity_bytes(i));
    most_checkpointed = std::max(most_checkpointed, layers_of[i].first);
    most_full = std::max(most_full, layers_of[i].second);
  }
  const double layers = static_cast<double>(model_.num_layers);
  for (int64_t i = 0; i < num_ranks; ++i) {
    const auto [k, f] =
        totals.world_exchange ? std::pair{most_checkpointed, most_full} : layers_of[i];
    if (skips_recompute) {
      other_s[i] += static_cast<double>(k) / layers *
                    (linear_recompute_s(tokens[i]) + totals.recompute_s[i]);
    }
    other_s[i] += static_cast<double>(f) / layers * totals.full_recompute_s[i];
  }
  return std::max(floor_s, floor_of_totals(tokens, other_s));
}

void CostModel::floor_terms(const Sequence& sequence, const Placement& placement,
                            EvaluationCache& cache, std::vector<FloorTerm>* terms) const {
  const bool skips_recompute = options_.activation_checkpointing && options_.adaptive_checkpointing;
  const EvaluationCache::Entry& entry = cached_terms(sequence, placement, cache);
  const int32_t phase = placement.ring_degree > 1 ? 2 : placement.ulysses_degree > 1 ? 1 : 0;
  terms->resize(entry.shares.size());
  for (size_t k = 0; k < entry.shares.size(); ++k) {
    const RankShare& share = entry.shares[k];
    FloorTerm& term = (*terms)[k];
    term.tokens = share.tokens;
    term.added_s = share.attention_s + share.exchange_s - entry.call_excess_s[k];
    term.skipped_s = skips_recompute ? share.recompute_s + share.recompute_exchange_s : 0.0;
    term.bytes = {share.layer_activation_bytes, share.layer_checkpoint_bytes,
                  share.layer_input_bytes, share.buffer_bytes};
    term.recompute_s = share.recompute_s + share.recompute_exchange_s;
    term.full_recompute_s = share.attention_recompute_s + share.attention_recompute_exchange_s;
    term.phase = phase;
    term.ulysses = placement.ulysses_degree > 1;
  }
}

double CostModel::floor_of_totals(const std::vector<int64_t>& tokens,
                                  const std::vector<double>& other_s) const {
  const bool skips_recompute = options_.activation_checkpointing && options_.adaptive_checkpointing;
  double floor_s = 0;
  for (size_t rank = 0; rank < tokens.size(); ++rank) {
    const double linear_s = linear_time_s(tokens[rank]) -
                            (skips_recompute ? linear_recompute_s(tokens[rank]) : 0.0);
    floor_s = std::max(floor_s, (linear_s + other_s[rank]) /
                                    cluster_.speed_of(static_cast<int64_t>(rank)));
  }
  return floor_s;
}

double CostModel::min_floor_time_per_token_s() const {
  if (!(options_.activation_checkpointing && options_.adaptive_checkpointing)) {
    return min_linear_time_per_token_s_;
  }
  // linear_time_s - linear_recompute_s per token: one forward pass and one elementwise pass less,
  // each at its fastest rate.
  const double d = static_cast<double>(model_.width);
  const double bpe = static_cast<double>(options_.bytes_per_element);
  return min_linear_time_per_token_s_ -
         static_cast<double>(model_.num_layers) *
             (forward_flops_per_token_ /
                  max_rate(profile_.matmul_forward_flops_per_s, profile_.matmul_flops_per_s) +
              kElementwiseBytesPerTokenWidth * d * bpe / profile_.memory_bytes_per_s);
}

double CostModel::floor_rank_seconds(const Sequence& sequence, const Placement& placement,
                                     EvaluationCache& cache) const {
  const bool skips_recompute = options_.activation_checkpointing && options_.adaptive_checkpointing;
  const double rate_s = min_floor_time_per_token_s();
  const EvaluationCache::Entry& entry = cached_terms(sequence, placement, cache);
  double total_s = 0;
  for (size_t k = 0; k < entry.shares.size(); ++k) {
    const RankShare& share = entry.shares[k];
    // As makespan_floor adds it to the rank.
    double other_s = share.attention_s + share.exchange_s - entry.call_excess_s[k];
    if (skips_recompute) other_s -= share.recompute_s + share.recompute_exchange_s;
    total_s += rate_s * static_cast<double>(share.tokens) + other_s;
  }
  return total_s;
}

std::vector<RankShare> CostModel::shares(const Sequence& sequence, const Placement& placement,
                                         EvaluationCache& cache) const {
  std::vector<RankShare> result = cached_terms(sequence, placement, cache).shares;
  for (size_t k = 0; k < result.size(); ++k) result[k].rank = placement.ranks[k];
  return result;
}

// The shares' buffers hold attention_phase_bytes_ for every token; only the largest phase's
// exist at once (the planners' additive sizing keeps them all: it errs above, never below).
double CostModel::phase_buffer_bytes(double buffer_bytes,
                                     const std::array<double, 3>& phase_tokens) const {
  if (attention_phase_bytes_ <= 0) return buffer_bytes;
  const double outside_largest = phase_tokens[0] + phase_tokens[1] + phase_tokens[2] -
                                 std::max({phase_tokens[0], phase_tokens[1], phase_tokens[2]});
  return std::max(0.0, buffer_bytes - attention_phase_bytes_ * outside_largest);
}

// Checkpoint every layer, none, or (adaptive) the fewest whose peak fits, keeping their attention
// outputs; where even that does not fit, the fewest of them that recompute their attention too
// (full recompute) so that it fits; a rank that fits nowhere recomputes all.
std::pair<int64_t, int64_t> CostModel::rank_checkpointing(double activation_bytes,
                                                          double checkpoint_bytes,
                                                          double input_bytes, double buffer_bytes,
                                                          int64_t tokens,
                                                          double capacity_bytes) const {
  const int64_t num_layers = model_.num_layers;
  const auto peak = [&](int64_t k, int64_t f) {
    return rank_peak_bytes(activation_bytes, checkpoint_bytes, input_bytes, buffer_bytes, k, f,
                           tokens);
  };
  // The first count in [first, last) whose peak fits, else `last`. A peak that cannot grow
  // with the count (each layer it covers keeps no more bytes) is bisected, else scanned.
  const auto fewest_fitting = [&](int64_t first, int64_t last, bool monotone, auto&& peak_of) {
    // Most ranks fit at the first count: one peak, not a bisection's.
    if (first < last && peak_of(first) <= capacity_bytes) return first;
    if (!monotone) {
      for (int64_t count = first; count < last; ++count) {
        if (peak_of(count) <= capacity_bytes) return count;
      }
      return last;
    }
    int64_t low = first, high = last;  // the answer lies in [low, high]
    while (low < high) {
      const int64_t middle = low + (high - low) / 2;
      if (peak_of(middle) <= capacity_bytes) {
        high = middle;
      } else {
        low = middle + 1;
      }
    }
    return low;
  };
  int64_t k = options_.activation_checkpointing ? num_layers : 0, f = 0;
  if (options_.activation_checkpointing) {
    if (options_.adaptive_checkpointing) {
      k = fewest_fitting(0, num_layers, checkpoint_bytes <= activation_bytes,
                         [&](int64_t fewer) { return peak(fewer, 0); });
    }
    if (k == num_layers && peak(k, 0) > capacity_bytes) {
      f = fewest_fitting(1, num_layers, input_bytes <= checkpoint_bytes,
                         [&](int64_t full) { return peak(k, full); });
    }
  }
  return {k, f};
}

PlanCost CostModel::evaluate(const Batch& batch, const Plan& plan) const {
  return evaluate_impl(batch, plan, nullptr);
}

PlanCost CostModel::evaluate(const Batch& batch, const Plan& plan, EvaluationCache& cache) const {
  return evaluate_impl(batch, plan, &cache);
}

namespace {
// Distinct keys a rank's calls are merged among before sorting: ranks of many short sequences
// repeat a few keys, and a rank with more keys than this sorts the rest as they are.
constexpr std::ptrdiff_t kMergedKeys = 32;

// Moves equal keys' calls into one (segments summed) while the distinct keys are few; returns the
// new end. What evaluate reads after sorting by key (each distinct key's total segments, in key
// order) is unchanged.
std::vector<cost_detail::RankCall>::iterator merge_equal_keys(
    std::vector<cost_detail::RankCall>::iterator first,
    std::vector<cost_detail::RankCall>::iterator last) {
  auto distinct_end = first;
  auto it = first;
  for (; it != last && distinct_end - first < kMergedKeys; ++it) {
    auto same = first;
    // Element by element: std::array's == calls memcmp, a call per pair on this hot path.
    const auto equal = [&](const cost_detail::CallKey& key) {
      return key[0] == it->key[0] && key[1] == it->key[1] && key[2] == it->key[2] &&
             key[3] == it->key[3] && key[4] == it->key[4];
    };
    while (same != distinct_end && !equal(same->key)) ++same;
    if (same != distinct_end) {
      same->segments += it->segments;
    } else {
      *distinct_end++ = *it;
    }
  }
  if (distinct_end == it) return last;  // every key distinct so far and no call left over
  return std::move(it, last, distinct_end);
}
}  // namespace

PlanCost CostModel::evaluate_impl(const Batch& batch, const Plan& plan,
                                  EvaluationCache* cache) const {
  const int64_t num_ranks = cluster_.num_ranks();
  if (plan.num_ranks != num_ranks) {
    throw std::invalid_argument("plan is for " + std::to_string(plan.num_ranks) +
                                " ranks but the cluster has " + std::to_string(num_ranks));
  }
  validate_plan(plan, batch, num_ranks, model_.num_heads);
  // Placements usually come in batch order (planners make them so): the k-th is then the k-th
  // sequence's, and the id map is built only for a plan that is not.
  std::unordered_map<int64_t, const Sequence*> by_id;
  const auto sequence_of = [&](size_t k, const Placement& placement) -> const Sequence& {
    if (k < batch.sequences.size() && batch.sequences[k].id == placement.sequence_id) {
      return batch.sequences[k];
    }
    if (by_id.empty()) {
      by_id.reserve(batch.sequences.size());
      for (const Sequence& sequence : batch.sequences) by_id[sequence.id] = &sequence;
    }
    return *by_id.at(placement.sequence_id);
  };

  PlanCost cost;
  cost.ranks.assign(static_cast<size_t>(num_ranks), RankCost{});
  // per rank: one layer's kept activations without / with checkpointing, buffers, recompute
  std::vector<double> activation(static_cast<size_t>(num_ranks), 0.0);
  std::vector<double> checkpoint(static_cast<size_t>(num_ranks), 0.0);
  std::vector<double> buffer(static_cast<size_t>(num_ranks), 0.0);
  std::vector<double> recompute(static_cast<size_t>(num_ranks), 0.0);
  std::vector<double> recompute_exchange(static_cast<size_t>(num_ranks), 0.0);
  std::vector<double> input(static_cast<size_t>(num_ranks), 0.0);
  std::vector<double> attention_recompute(static_cast<size_t>(num_ranks), 0.0);
  std::vector<double> attention_recompute_exchange(static_cast<size_t>(num_ranks), 0.0);
  // per rank: held tokens of each phase of its attention backward (local sequences' calls, the
  // calls of the sequences Ulysses exchanged, ring steps), whose buffers never coexist
  std::vector<std::array<double, 3>> phase_tokens(static_cast<size_t>(num_ranks), {0, 0, 0});
  const auto phase_of = [](const Placement& placement) {
    return placement.ring_degree > 1 ? 2 : placement.ulysses_degree > 1 ? 1 : 0;
  };
  // Every segment's call, by rank at the end: a rank's calls sorted by key, equal keys merged (a
  // vector sorted once, not a map per rank). Ring steps' calls are only counted (a ring over r
  // ranks has r on each: r^2 in all).
  std::vector<RankCall> own_calls, own_by_rank;
  std::vector<RankCall>& calls = cache != nullptr ? cache->calls_ : own_calls;
  calls.clear();
  calls.reserve(2 * plan.placements.size());  // a local sequence's self- and cross-attention
  std::vector<int64_t> ring_step_calls(static_cast<size_t>(num_ranks), 0);
  auto add_share = [&](const RankShare& share, int64_t rank_index, int phase) {
    RankCost& rank = cost.ranks[rank_index];
    rank.tokens += share.tokens;
    phase_tokens[rank_index][phase] += static_cast<double>(share.tokens);
    rank.attention_s += share.attention_s;
    rank.exchange_s += share.exchange_s;
    activation[rank_index] += share.layer_activation_bytes;
    checkpoint[rank_index] += share.layer_checkpoint_bytes;
    buffer[rank_index] += share.buffer_bytes;
    recompute[rank_index] += share.recompute_s;
    recompute_exchange[rank_index] += share.recompute_exchange_s;
    input[rank_index] += share.layer_input_bytes;
    attention_recompute[rank_index] += share.attention_recompute_s;
    attention_recompute_exchange[rank_index] += share.attention_recompute_exchange_s;
  };
  for (size_t index = 0; index < plan.placements.size(); ++index) {
    const Placement& placement = plan.placements[index];
    double sent = 0;
    const Sequence& sequence = sequence_of(index, placement);
    if (cache != nullptr) {
      EvaluationCache::Entry& entry = cached_terms(sequence, placement, *cache);
      list_calls(sequence, placement, &entry);
      for (size_t k = 0; k < entry.shares.size(); ++k) {
        const int64_t rank_index = placement.ranks[k];
        add_share(entry.shares[k], rank_index, phase_of(placement));
        if (rank_index != sequence.source_rank) {
          sent += 2.0 * kRouteBytesPerToken * static_cast<double>(entry.shares[k].tokens);
        }
        ring_step_calls[rank_index] += entry.ring_step_calls[k];
        for (const auto& [call, segments] : entry.calls[k]) {
          calls.push_back({rank_index, call, segments});
        }
      }
      cost.exchange_bytes += entry.exchange_bytes + sent;
      continue;
    }
    add_attention_calls(sequence, placement, &calls, &ring_step_calls);
    for (const RankShare& share : shares_and_bytes(sequence, placement, &sent)) {
      add_share(share, share.rank, phase_of(placement));
    }
    cost.exchange_bytes += sent;
  }
  // By rank (counting sort), then each rank's calls by key.
  std::vector<size_t> rank_begin(static_cast<size_t>(num_ranks) + 1, 0);
  for (const RankCall& call : calls) ++rank_begin[call.rank + 1];
  for (int64_t i = 0; i < num_ranks; ++i) rank_begin[i + 1] += rank_begin[i];
  std::vector<RankCall>& by_rank = cache != nullptr ? cache->calls_by_rank_ : own_by_rank;
  by_rank.resize(calls.size());
  {
    std::vector<size_t> next(rank_begin.begin(), rank_begin.end() - 1);
    for (const RankCall& call : calls) by_rank[next[call.rank]++] = call;
  }
  std::vector<std::pair<int64_t, double>> streamed;  // a rank's cross-attention calls: work, s
  for (int64_t i = 0; i < num_ranks; ++i) {
    RankCost& rank = cost.ranks[i];
    const double capacity = memory_capacity_bytes(i);
    rank.linear_s = linear_time_s(rank.tokens);
    const double layers = static_cast<double>(model_.num_layers);
    const auto first = by_rank.begin() + static_cast<std::ptrdiff_t>(rank_begin[i]);
    const auto last = merge_equal_keys(
        first, by_rank.begin() + static_cast<std::ptrdiff_t>(rank_begin[i + 1]));
    std::sort(first, last, [](const RankCall& a, const RankCall& b) { return a.key < b.key; });
    int64_t distinct_calls = 0;
    streamed.clear();
    const std::array<bool, kRaggedKinds> ragged = ragged_tables(first, last);
    for (auto it = first; it != last;) {
      const CallKey& key = it->key;
      int64_t segments = 0;
      for (; it != last && it->key == key; ++it) segments += it->segments;
      const double heads = static_cast<double>(key[2]);
      const double call_heads = static_cast<double>(segments) * heads;
      const double lq = static_cast<double>(key[0]), lk = static_cast<double>(key[1]);
      const int kind = ragged_kind(key);
      if (kind >= 0 && ragged[kind]) {
        // One ragged call runs every segment at the per-head tables' rate (0.89-1.05 of one
        // dense call of the same FLOPs on the twelve packs of bench/attention_engine.py, within
        // the tables' own error; bench/results/attention_engine_h200_202612.md): none of the
        // excess the shares priced.
        rank.call_s -= layers * call_heads * call_excess_per_head_s(lq, lk, heads);
        continue;
      }
      ++distinct_calls;
      if (segments > 1) {  // the shares priced each segment as a call of its own
        rank.call_s +=
            layers * call_heads *
            (call_excess_per_head_s(lq, lk, call_heads) - call_excess_per_head_s(lq, lk, heads));
      }
      if (key[3] == kCrossTag && profile_.attention_streams > 1) {
        const double seconds = layers * call_heads *
                               (head_forward_s(lq, lk) + head_backward_s(lq, lk) +
                                call_excess_per_head_s(lq, lk, call_heads));
        streamed.push_back({segments * key[0] * key[1] * key[2], seconds});
      }
    }
    // The cross-attention table runs its calls on the profile's streams (runtime/attention.py
    // cross_attention: coalesced_attention at the device's count); self- and joint attention of
    // the distributed step run one call after another (forward_into / backward_into on one
    // stream), as do ring steps, so only this table's calls overlap.
    if (streamed.size() > 1) {
      // most work first, as coalesced.SegmentTable.calls orders them (ties: key order)
      std::stable_sort(streamed.begin(), streamed.end(),
                       [](const auto& a, const auto& b) { return a.first > b.first; });
      std::vector<int64_t> works;
      std::vector<double> seconds;
      double serial_s = 0;
      for (const auto& [work, call_s] : streamed) {
        works.push_back(work);
        seconds.push_back(call_s);
        serial_s += call_s;
      }
      rank.stream_s = streamed_calls_s(works, seconds, profile_.attention_streams,
                                       profile_.attention_stream_overlap) -
                      serial_s;
      rank.call_s += rank.stream_s;
    }
    // A ragged table is one call to the host too: in the step program on one H200 it issued in
    // 1.2-2.0 ms forward + backward, where the groups took 1.9 ms + 0.38 ms per dense call
    // (bench/results/attention_engine_h200_202612.md).
    rank.attention_calls =
        distinct_calls + ring_step_calls[i] + std::count(ragged.begin(), ragged.end(), true);
    if (rank.tokens > 0) {
      rank.launch_floor_s =
          layers *
          (launch_s_per_layer_ + launch_s_per_call_ * static_cast<double>(rank.attention_calls));
    }
    buffer[i] = phase_buffer_bytes(buffer[i], phase_tokens[i]);
    const auto [k, f] = rank_checkpointing(activation[i], checkpoint[i], input[i], buffer[i],
                                           rank.tokens, capacity);
    rank.checkpointed_layers = k;
    rank.full_recompute_layers = f;
  }
  // The recompute of a layer sends q, k, v again where the plan has a Ulysses placement, and
  // that all-to-all spans the world (runtime/attention.py): every rank must then recompute the
  // same layers (and run the same of them in full), the most any rank needs.
  const bool world_exchange =
      std::any_of(plan.placements.begin(), plan.placements.end(),
                  [](const Placement& p) { return p.ulysses_degree > 1; });
  int64_t most_checkpointed = 0, most_full = 0;
  for (const RankCost& rank : cost.ranks) {
    most_checkpointed = std::max(most_checkpointed, rank.checkpointed_layers);
    most_full = std::max(most_full, rank.full_recompute_layers);
  }
  for (int64_t i = 0; i < num_ranks; ++i) {
    RankCost& rank = cost.ranks[i];
    if (world_exchange) {
      rank.checkpointed_layers = most_checkpointed;
      rank.full_recompute_layers = most_full;
    }
    const int64_t k = rank.checkpointed_layers, f = rank.full_recompute_layers;
    rank.peak_bytes =
        rank_peak_bytes(activation[i], checkpoint[i], input[i], buffer[i], k, f, rank.tokens);
    // Layers that keep their activations skip the recompute; full ones recompute attention too.
    if (options_.activation_checkpointing) {
      const double layers = static_cast<double>(model_.num_layers);
      const double skipped = static_cast<double>(model_.num_layers - k) / layers;
      const double full = static_cast<double>(f) / layers;
      rank.linear_s -= skipped * linear_recompute_s(rank.tokens);
      rank.attention_s += full * attention_recompute[i] - skipped * recompute[i];
      rank.exchange_s +=
          full * attention_recompute_exchange[i] - skipped * recompute_exchange[i];
    }
    // The one place a rank's speed enters: every term at once, so that they still add up.
    const double speed = cluster_.speed_of(i);
    if (speed != 1.0) {
      for (double* seconds : {&rank.linear_s, &rank.attention_s, &rank.call_s, &rank.stream_s,
                              &rank.exchange_s, &rank.launch_floor_s}) {
        *seconds /= speed;
      }
    }
    rank.time_s = std::max(rank.linear_s + rank.attention_s + rank.call_s + rank.exchange_s,
                           rank.launch_floor_s);
    cost.makespan_s = std::max(cost.makespan_s, rank.time_s);
    cost.peak_bytes = std::max(cost.peak_bytes, rank.peak_bytes);
    if (rank.peak_bytes > memory_capacity_bytes(i)) cost.fits = false;
  }
  return cost;
}

}  // namespace zellige
