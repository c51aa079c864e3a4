// knapformer(spec, gamma): the KnapFormer balancer (arXiv 2508.06001) as REFERENCE.md describes it.
// Static bags of consecutive ranks from a spec like g1n2+g2n1+g4n1 (n bags of g GPUs, laid out by
// increasing g). Per step, each sequence costs W(L) = 24 L d^2 + gamma 4 L^2 d (d = model width,
// L = attended length); no communication and no memory term. Sequences, heaviest first, go to the
// eligible bag (capacity >= W and length >= bag size) with the smallest occupancy ratio, else to
// the largest bags. Inside a bag of g GPUs every sequence runs Ulysses over all g ranks.
#include <algorithm>
#include <cctype>
#include <cstdio>
#include <numeric>
#include <stdexcept>
#include <utility>
#include <vector>

#include "rank_loads.h"
#include "registry.h"
#include "zellige/planners.h"

namespace zellige {
namespace {

struct BagTerm {
  int64_t bag_size = 0;  // g
  int64_t num_bags = 0;  // n
};

[[noreturn]] void bad_spec(const std::string& spec, const std::string& why) {
  throw std::invalid_argument("knapformer spec '" + spec + "': " + why +
                              " (allowed: terms gGnN joined by '+', e.g. g4n8 or "
                              "g1n8+g2n4+g4n2+g8n1, distinct bag sizes, G*N summing to the "
                              "number of GPUs)");
}

// Parses the digits at spec[*pos...]; returns -1 if there are none or they overflow.
int64_t parse_count(const std::string& term, size_t* pos) {
  int64_t value = 0;
  const size_t start = *pos;
  while (*pos < term.size() && std::isdigit(static_cast<unsigned char>(term[*pos]))) {
    if (value > 1'000'000'000) return -1;
    value = value * 10 + (term[*pos] - '0');
    ++*pos;
  }
  return *pos == start ? -1 : value;
}

std::vector<BagTerm> parse_spec(const std::string& spec) {
  std::vector<BagTerm> terms;
  size_t begin = 0;
  while (true) {
    const size_t end = std::min(spec.find('+', begin), spec.size());
    const std::string term = spec.substr(begin, end - begin);
    size_t pos = 0;
    if (term.empty() || term[pos++] != 'g') bad_spec(spec, "malformed term '" + term + "'");
    const int64_t bag_size = parse_count(term, &pos);
    if (pos >= term.size() || term[pos++] != 'n') bad_spec(spec, "malformed term '" + term + "'");
    const int64_t num_bags = parse_count(term, &pos);
    if (bag_size <= 0 || num_bags <= 0 || pos != term.size()) {
      bad_spec(spec, "malformed term '" + term + "'");
    }
    for (const BagTerm& other : terms) {
      if (other.bag_size == bag_size) {
        bad_spec(spec, "bag size " + std::to_string(bag_size) + " appears twice");
      }
    }
    terms.push_back({bag_size, num_bags});
    if (end == spec.size()) break;
    begin = end + 1;
  }
  std::sort(terms.begin(), terms.end(),
            [](const BagTerm& a, const BagTerm& b) { return a.bag_size < b.bag_size; });
  return terms;
}

}  // namespace

Plan plan_knapformer(const Batch& batch, const CostModel& cost_model, const std::string& spec,
                     double gamma) {
  const planners::KnapformerWork work = planners::knapformer_work(batch, cost_model, gamma);
  const planners::KnapformerBags bags = planners::knapformer_assign(batch, cost_model, spec, work);
  return planners::knapformer_plan(batch, cost_model, spec, gamma, bags);
}

planners::KnapformerWork planners::knapformer_work(const Batch& batch, const CostModel& cost_model,
                                                   double gamma) {
  if (!(gamma >= 0) || gamma > 1e9) {
    throw std::invalid_argument("knapformer gamma must be a finite number >= 0, got " +
                                std::to_string(gamma));
  }
  const int64_t num_sequences = static_cast<int64_t>(batch.sequences.size());
  const double width = static_cast<double>(cost_model.model().width);
  KnapformerWork result;
  result.work.resize(num_sequences);
  for (int64_t i = 0; i < num_sequences; ++i) {
    const Sequence& sequence = batch.sequences[i];
    const double length = static_cast<double>(
        attended_tokens(cost_model.model(), sequence.num_tokens, sequence.text_tokens));
    result.work[i] = 24.0 * length * width * width + gamma * 4.0 * length * length * width;
    result.total_work += result.work[i];
  }
  result.order.resize(num_sequences);
  std::iota(result.order.begin(), result.order.end(), 0);
  std::stable_sort(result.order.begin(), result.order.end(),
                   [&](int64_t a, int64_t b) { return result.work[a] > result.work[b]; });
  return result;
}

planners::KnapformerBags planners::knapformer_assign(const Batch& batch,
                                                     const CostModel& cost_model,
                                                     const std::string& spec,
                                                     const KnapformerWork& work,
                                                     const KnapformerStop& stop) {
  const std::vector<BagTerm> terms = parse_spec(spec);
  const int64_t num_ranks = cost_model.cluster().num_ranks();
  const int64_t num_heads = cost_model.model().num_heads;
  int64_t spec_ranks = 0;
  for (const BagTerm& term : terms) spec_ranks += term.bag_size * term.num_bags;
  if (spec_ranks != num_ranks) {
    bad_spec(spec, "covers " + std::to_string(spec_ranks) + " GPUs, the cluster has " +
                       std::to_string(num_ranks));
  }
  for (const BagTerm& term : terms) {
    if (num_heads % term.bag_size != 0) {
      bad_spec(spec, "bag size " + std::to_string(term.bag_size) + " does not divide the " +
                         std::to_string(num_heads) + " heads of " + cost_model.model().name +
                         " (KnapFormer runs Ulysses inside a bag)");
    }
  }

  // Bags in layout order: by increasing size, each a block of consecutive ranks.
  KnapformerBags bags;
  std::vector<int64_t> bag_term;
  for (int64_t rank = 0, t = 0; t < static_cast<int64_t>(terms.size()); ++t) {
    for (int64_t b = 0; b < terms[t].num_bags; ++b, rank += terms[t].bag_size) {
      bags.first_rank.push_back(rank);
      bags.size.push_back(terms[t].bag_size);
      bag_term.push_back(t);
    }
  }
  const int64_t num_bags = static_cast<int64_t>(bag_term.size());
  const double capacity_per_gpu = work.total_work / static_cast<double>(num_ranks);

  bags.of_sequence.assign(batch.sequences.size(), -1);
  // Eligibility depends on the bag size only, so each term keeps its bags ordered by
  // (occupancy, layout index) in a min-heap: the best bag of a size is the top of its heap.
  // Entries are distinct (by index), so the top is the same whatever the heap's layout.
  using Entry = std::pair<double, int64_t>;
  using Heap = std::vector<Entry>;  // heap[0] is the least
  std::vector<double> occupancy(num_bags, 0.0);
  std::vector<Heap> bags_by_occupancy(terms.size());
  // Bags enter in index order at occupancy 0: already a heap.
  for (int64_t b = 0; b < num_bags; ++b) bags_by_occupancy[bag_term[b]].push_back({0.0, b});
  // The top's occupancy grew: sift it down (one pass, where pop + push would take two).
  // `less` without short-circuit branches: the comparisons of a sift are hard to predict.
  auto less = [](const Entry& a, const Entry& b) {
    return (a.first < b.first) | ((a.first == b.first) & (a.second < b.second));
  };
  auto replace_top = [&less](Heap& heap, Entry entry) {
    const size_t size = heap.size();
    size_t at = 0;
    for (;;) {
      size_t child = 2 * at + 1;
      if (child >= size) break;
      child += static_cast<size_t>(child + 1 < size && less(heap[child + 1], heap[child]));
      if (!less(heap[child], entry)) break;
      heap[at] = heap[child];
      at = child;
    }
    heap[at] = entry;
  };
  for (int64_t index : work.order) {
    const Sequence& sequence = batch.sequences[index];
    const double sequence_work = work.work[index];
    int64_t best = -1;
    for (size_t t = 0; t < terms.size(); ++t) {
      const bool eligible =
          capacity_per_gpu * static_cast<double>(terms[t].bag_size) >= sequence_work &&
          sequence.num_tokens >= terms[t].bag_size;
      const int64_t candidate = bags_by_occupancy[t].front().second;
      if (eligible && (best < 0 || std::make_pair(occupancy[candidate], candidate) <
                                       std::make_pair(occupancy[best], best))) {
        best = candidate;
      }
    }
    if (best < 0) best = bags_by_occupancy.back().front().second;  // fallback: the largest bags
    const int64_t size = terms[bag_term[best]].bag_size;
    occupancy[best] += sequence_work / (capacity_per_gpu * static_cast<double>(size));
    replace_top(bags_by_occupancy[bag_term[best]], {occupancy[best], best});  // `best` was its top
    bags.of_sequence[index] = static_cast<int32_t>(best);
    if (stop && stop(bags, index)) {
      bags.complete = false;
      break;
    }
  }
  return bags;
}

Plan planners::knapformer_plan(const Batch& batch, const CostModel& cost_model,
                               const std::string& spec, double gamma, const KnapformerBags& bags) {
  char gamma_text[32];
  std::snprintf(gamma_text, sizeof(gamma_text), "%g", gamma);
  Plan plan = planners::empty_plan("knapformer:" + spec + ":" + gamma_text, cost_model);
  const int64_t num_sequences = static_cast<int64_t>(batch.sequences.size());
  plan.placements.resize(num_sequences);
  for (int64_t index = 0; index < num_sequences; ++index) {
    const int64_t bag = bags.of_sequence[index];
    const int64_t size = bags.size[bag];
    std::vector<int64_t> ranks = planners::consecutive_ranks(bags.first_rank[bag], size);
    plan.placements[index] =
        size == 1 ? make_placement(batch.sequences[index].id, Strategy::kLocal, std::move(ranks))
                  : make_placement(batch.sequences[index].id, Strategy::kUlysses, std::move(ranks));
  }
  return plan;
}

}  // namespace zellige
