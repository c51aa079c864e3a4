// Private to the planners: the longest-first greedy shared by the whole-sequence baselines
// (dp-tokens, dp-cost, static-cp), which differ only in the sort size, the bins and their key.
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <numeric>
#include <queue>
#include <utility>
#include <vector>

#include "rank_loads.h"
#include "zellige/cost_model.h"
#include "zellige/plan.h"
#include "zellige/workload.h"

namespace zellige::planners {

// Sequences in decreasing `size` (stable: equal sizes keep batch order) each go to the bin with
// the smallest key (ties to the lowest bin) whose placement fits in memory; bins without room
// are skipped for that sequence only. `initial_keys[bin]` is each bin's key before any sequence;
// `placement_in(sequence, bin)` builds the placement, `key_after(placement)` gives the bin's key
// once `loads` holds it. Fills plan.placements in batch order; returns the first sequence that
// fits in no bin (plan is then incomplete), or nullptr.
template <typename Size, typename Key, typename PlacementIn, typename KeyAfter>
const Sequence* place_longest_first(const Batch& batch,
                                    const std::vector<Size>& size,
                                    const std::vector<Key>& initial_keys, PlacementIn placement_in,
                                    KeyAfter key_after, RankLoads& loads, Plan& plan) {
  const int64_t num_sequences = static_cast<int64_t>(batch.sequences.size());
  std::vector<int64_t> order(num_sequences);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return size[a] > size[b]; });

  // (key, bin), smallest key first, ties to the lowest bin.
  using Entry = std::pair<Key, int64_t>;
  std::priority_queue<Entry, std::vector<Entry>, std::greater<Entry>> by_key;
  for (int64_t bin = 0; bin < static_cast<int64_t>(initial_keys.size()); ++bin) {
    by_key.push({initial_keys[bin], bin});
  }

  plan.placements.resize(num_sequences);
  std::vector<Entry> full;  // bins without room for the current sequence
  for (int64_t index : order) {
    const Sequence& sequence = batch.sequences[index];
    bool placed = false;
    while (!by_key.empty()) {
      const Entry entry = by_key.top();
      by_key.pop();
      Placement placement = placement_in(sequence, entry.second);
      const std::vector<RankShare> shares = loads.shares(sequence, placement);
      if (!loads.fits(shares)) {
        full.push_back(entry);
        continue;
      }
      loads.add(shares);
      by_key.push({key_after(placement), entry.second});
      plan.placements[index] = std::move(placement);
      placed = true;
      break;
    }
    for (const Entry& entry : full) by_key.push(entry);
    full.clear();
    if (!placed) return &sequence;
  }
  return nullptr;
}

}  // namespace zellige::planners
