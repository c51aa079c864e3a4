#include "zellige/plan_compiler.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <numeric>
#include <stdexcept>
#include <string>
#include <tuple>
#include <unordered_map>

namespace zellige {
namespace {

// Where one rank sits in one sequence's placement, and what that gives it. Token offsets and
// counts are in the sequence's attended token list (joint: text first).
struct Membership {
  int64_t sequence_index = 0;
  int64_t position = 0;      // index into placement.ranks
  int64_t block = 0;         // j
  int64_t chunk = 0;         // k
  int64_t block_offset = 0;  // first token of block j in the sequence
  int64_t block_tokens = 0;  // b_j
  int64_t chunk_offset = 0;  // first token of chunk k within the block
  int64_t chunk_tokens = 0;
  int64_t head_offset = 0;  // first head of share k
  int64_t num_heads = 0;    // n_k
};

int64_t prefix_before(const std::vector<int64_t>& sizes, int64_t index) {
  return std::accumulate(sizes.begin(), sizes.begin() + index, int64_t{0});
}

Membership membership(int64_t attended, const Placement& placement, int64_t sequence_index,
                      int64_t position, int64_t num_heads) {
  const int64_t u = placement.ulysses_degree;
  Membership m;
  m.sequence_index = sequence_index;
  m.position = position;
  m.block = position / u;
  m.chunk = position % u;
  const std::vector<int64_t> blocks = balanced_split(attended, placement.ring_degree);
  m.block_offset = prefix_before(blocks, m.block);
  m.block_tokens = blocks[m.block];
  const std::vector<int64_t> chunks = balanced_split(m.block_tokens, u);
  m.chunk_offset = prefix_before(chunks, m.chunk);
  m.chunk_tokens = chunks[m.chunk];
  const std::vector<int64_t> heads = balanced_split(num_heads, u);
  m.head_offset = prefix_before(heads, m.chunk);
  m.num_heads = heads[m.chunk];
  return m;
}

// Longest first, then batch order: equal sizes end up adjacent (dense attention batches).
void sort_longest_first(std::vector<Membership>& items, int64_t Membership::* size) {
  std::stable_sort(items.begin(), items.end(), [size](const Membership& a, const Membership& b) {
    if (a.*size != b.*size) return a.*size > b.*size;
    return a.sequence_index < b.sequence_index;
  });
}

void sort_exchange_segments(std::vector<Membership>& items) {
  std::stable_sort(items.begin(), items.end(), [](const Membership& a, const Membership& b) {
    if (a.block_tokens != b.block_tokens) return a.block_tokens > b.block_tokens;
    if (a.num_heads != b.num_heads) return a.num_heads > b.num_heads;
    return a.sequence_index < b.sequence_index;
  });
}

// a + b and a * b for non-negative sizes, saturating at kMaxRowsPerRank + 1 (so limits can be
// checked before anything of that size is allocated, without overflow).
int64_t add_rows(int64_t a, int64_t b) {
  return (a > kMaxRowsPerRank || b > kMaxRowsPerRank) ? kMaxRowsPerRank + 1
                                                      : std::min(a + b, kMaxRowsPerRank + 1);
}
int64_t mul_rows(int64_t a, int64_t b) {
  if (a == 0 || b == 0) return 0;
  if (a > kMaxRowsPerRank || b > kMaxRowsPerRank) return kMaxRowsPerRank + 1;
  return std::min(a * b, kMaxRowsPerRank + 1);  // both < 2^31 + 1: the product fits int64
}

void check_rows(int64_t rows, int64_t rank, const std::string& what) {
  if (rows > kMaxRowsPerRank) {
    throw std::invalid_argument(
        "rank " + std::to_string(rank) + " would hold more than 2^31 " + what +
        " in one step (text included); no rank's memory holds that: shorten the sequences or "
        "their text, or spread them over more ranks");
  }
}

uint64_t fnv1a(uint64_t hash, int64_t value) {
  for (int byte = 0; byte < 8; ++byte) {
    hash ^= static_cast<uint64_t>(value >> (8 * byte)) & 0xffu;
    hash *= 1099511628211ull;
  }
  return hash;
}

int64_t program_fingerprint(const Batch& batch, const Plan& plan, int64_t num_heads,
                            bool joint_attention) {
  uint64_t hash = 14695981039346656037ull;
  hash = fnv1a(hash, num_heads);
  hash = fnv1a(hash, joint_attention ? 1 : 0);
  hash = fnv1a(hash, plan.num_ranks);
  for (const Sequence& s : batch.sequences) {
    for (int64_t v :
         {s.id, s.num_tokens, s.text_tokens, s.source_rank, s.grid_t, s.grid_h, s.grid_w}) {
      hash = fnv1a(hash, v);
    }
  }
  for (const Placement& p : plan.placements) {
    hash = fnv1a(hash, p.sequence_id);
    hash = fnv1a(hash, static_cast<int64_t>(p.strategy));
    hash = fnv1a(hash, p.ulysses_degree);
    hash = fnv1a(hash, p.ring_degree);
    for (int64_t r : p.ranks) hash = fnv1a(hash, r);
  }
  return static_cast<int64_t>(hash >> 1);
}

}  // namespace

std::vector<SegmentGroup> group_segments(const std::vector<int64_t>& q_row_offset,
                                         const std::vector<int64_t>& k_row_offset,
                                         const std::vector<int64_t>& q_len,
                                         const std::vector<int64_t>& k_len,
                                         const std::vector<int64_t>& num_heads) {
  const size_t n = q_row_offset.size();
  if (k_row_offset.size() != n || q_len.size() != n || k_len.size() != n || num_heads.size() != n) {
    throw std::invalid_argument(
        "group_segments: offsets, lengths and heads must have one entry "
        "per segment");
  }
  std::map<std::tuple<int64_t, int64_t, int64_t>, std::vector<std::pair<int64_t, int64_t>>> by;
  for (size_t s = 0; s < n; ++s) {
    if (q_len[s] > 0 && k_len[s] > 0 && num_heads[s] > 0) {
      by[{q_len[s], k_len[s], num_heads[s]}].emplace_back(q_row_offset[s], k_row_offset[s]);
    }
  }
  std::vector<SegmentGroup> groups;
  for (auto it = by.rbegin(); it != by.rend(); ++it) {
    auto members = it->second;
    std::sort(members.begin(), members.end());
    SegmentGroup g;
    std::tie(g.q_len, g.k_len, g.num_heads) = it->first;
    for (const auto& [q, k] : members) {
      g.q_row_offset.push_back(q);
      g.k_row_offset.push_back(k);
    }
    groups.push_back(std::move(g));
  }
  return groups;
}

namespace {

// Compiles one rank's step program. The shared bookkeeping (what the rank holds, its held
// chunks, token routes, cross-attention) brackets one step per strategy: local sequences attend
// on own rows; ring sequences pass k/v blocks around on own rows; Ulysses sequences exchange
// heads for tokens into exchange rows; hybrid sequences do both (the exchange, then a ring over
// exchange rows). compile() runs them in the order that numbers segments and rows.
class StepCompiler {
 public:
  StepCompiler(const Batch& batch, const Plan& plan, int64_t rank, int64_t num_heads,
               bool joint_attention);
  StepProgram compile() &&;

 private:
  void collect_memberships();
  void lay_out_held_chunks();
  void route_tokens_out();
  void route_tokens_in();
  void add_local();
  void add_ring();
  void add_ulysses();
  void add_hybrid();
  void add_exchange_segment(const Membership& m, SegmentKind kind);
  void exchange_sends();
  void exchange_receives();
  void lay_out_ring_rows();
  void add_ring_step(int64_t step);
  void add_cross_attention();
  void add_segment(const Membership& m, SegmentKind kind, bool in_exchange, int64_t row_offset,
                   int64_t tokens, int64_t heads, int64_t head_offset);
  std::vector<SegmentGroup> dense_groups(SegmentKind kind) const;
  Membership membership_of(int64_t i, int64_t position) const {
    return membership(attended_[i], *placement_[i], i, position, N_);
  }

  const Batch& batch_;
  const int64_t rank_, num_ranks_, num_sequences_, N_;
  const bool joint_attention_;
  StepProgram program_;
  // Per sequence in batch order: its placement, attended tokens, and how many are text (joint).
  std::vector<const Placement*> placement_;
  std::vector<int64_t> attended_, text_of_;
  // What this rank holds, by kind (exchanged: Ulysses and hybrid, in batch order).
  std::vector<Membership> local_, ring_, exchanged_;
  std::vector<int64_t> held_offset_of_, exchange_offset_of_;  // per sequence; -1: not held
  std::vector<std::pair<int64_t, Membership>> ring_members_;  // (segment index, membership)
  // A ring or hybrid segment in compact rows: ring table entry e, segment g.
  struct RingEntry {
    int64_t e, g, compact, rows;
  };
  std::vector<RingEntry> ring_entries_;
};

StepCompiler::StepCompiler(const Batch& batch, const Plan& plan, int64_t rank, int64_t num_heads,
                           bool joint_attention)
    : batch_(batch),
      rank_(rank),
      num_ranks_(plan.num_ranks),
      num_sequences_(static_cast<int64_t>(batch.sequences.size())),
      N_(num_heads),
      joint_attention_(joint_attention) {
  std::unordered_map<int64_t, const Placement*> placement_of_id;
  for (const Placement& p : plan.placements) placement_of_id[p.sequence_id] = &p;
  placement_.resize(num_sequences_);
  attended_.resize(num_sequences_);
  text_of_.resize(num_sequences_);
  held_offset_of_.assign(num_sequences_, -1);
  exchange_offset_of_.assign(num_sequences_, -1);
  for (int64_t i = 0; i < num_sequences_; ++i) {
    const Sequence& seq = batch.sequences[i];
    placement_[i] = placement_of_id.at(seq.id);
    text_of_[i] = joint_attention ? seq.text_tokens : 0;
    if (__builtin_add_overflow(seq.num_tokens, text_of_[i], &attended_[i]) ||
        attended_[i] > kMaxRowsPerRank) {
      throw std::invalid_argument("sequence " + std::to_string(seq.id) + " has " +
                                  std::to_string(seq.num_tokens) + " tokens and " +
                                  std::to_string(seq.text_tokens) +
                                  " text tokens: more than the 2^31 attended tokens a sequence "
                                  "may have");
    }
  }
  program_.rank = rank;
  program_.num_ranks = num_ranks_;
  program_.num_heads = N_;
  program_.joint_attention = joint_attention;
  program_.fingerprint = program_fingerprint(batch, plan, N_, joint_attention);
}

StepProgram StepCompiler::compile() && {
  collect_memberships();
  lay_out_held_chunks();
  route_tokens_out();
  route_tokens_in();
  // Segments in this order: local, ring, Ulysses, hybrid.
  add_local();
  add_ring();
  add_ulysses();
  add_hybrid();
  exchange_sends();
  exchange_receives();
  lay_out_ring_rows();
  int64_t max_degree = 1;
  for (int64_t r : program_.ring_degree) max_degree = std::max(max_degree, r);
  for (int64_t step = 1; step < max_degree; ++step) add_ring_step(step);
  add_cross_attention();
  return std::move(program_);
}

// What this rank holds, by kind; refuses sizes no rank can hold before anything is allocated.
void StepCompiler::collect_memberships() {
  int64_t held_rows = 0, exchange_rows = 0, cross_rows = 0, source_rows = 0, source_text = 0;
  for (int64_t i = 0; i < num_sequences_; ++i) {
    const Placement& p = *placement_[i];
    const Sequence& seq = batch_.sequences[i];
    if (p.ulysses_degree > 1) program_.world_has_exchange = true;
    if (seq.source_rank == rank_) {
      source_rows = add_rows(source_rows, attended_[i]);
      source_text = add_rows(source_text, seq.text_tokens);
    }
    const auto it = std::find(p.ranks.begin(), p.ranks.end(), rank_);
    if (it == p.ranks.end()) continue;
    const Membership m = membership_of(i, static_cast<int64_t>(it - p.ranks.begin()));
    held_rows = add_rows(held_rows, mul_rows(m.chunk_tokens, N_));
    if (!joint_attention_ && m.chunk_tokens > 0) {
      cross_rows = add_rows(cross_rows, mul_rows(seq.text_tokens, N_));
    }
    if (p.ulysses_degree > 1) {
      exchange_rows = add_rows(exchange_rows, mul_rows(m.block_tokens, m.num_heads));
      exchanged_.push_back(m);
    } else if (p.ring_degree > 1) {
      ring_.push_back(m);
    } else {
      local_.push_back(m);
    }
  }
  check_rows(held_rows, rank_, "token x head rows");
  check_rows(exchange_rows, rank_, "Ulysses exchange rows");
  check_rows(cross_rows, rank_, "cross-attention text x head rows");
  check_rows(source_rows, rank_, "source tokens");
  check_rows(source_text, rank_, "source text tokens");
  sort_longest_first(local_, &Membership::chunk_tokens);
  sort_longest_first(ring_, &Membership::chunk_tokens);
}

// Held chunks (local, ring, then exchanged; each longest first) and the per-token tables.
void StepCompiler::lay_out_held_chunks() {
  StepProgram& program = program_;
  std::vector<Membership> exchanged_held = exchanged_;
  sort_longest_first(exchanged_held, &Membership::chunk_tokens);
  for (const std::vector<Membership>* group : {&local_, &ring_, &exchanged_held}) {
    for (const Membership& m : *group) {
      const int64_t i = m.sequence_index;
      const Sequence& seq = batch_.sequences[i];
      const int64_t first = m.block_offset + m.chunk_offset;
      const int64_t chunk = static_cast<int64_t>(program.chunk_sequence_index.size());
      const int64_t cross_text = (!joint_attention_ && m.chunk_tokens > 0) ? seq.text_tokens : 0;
      held_offset_of_[i] = program.num_held_tokens;
      program.chunk_sequence_index.push_back(i);
      program.chunk_token_offset.push_back(first);
      program.chunk_num_tokens.push_back(m.chunk_tokens);
      program.chunk_num_text_tokens.push_back(
          std::clamp<int64_t>(text_of_[i] - first, 0, m.chunk_tokens));
      program.chunk_cross_text_tokens.push_back(cross_text);
      program.chunk_held_offset.push_back(program.num_held_tokens);
      program.chunk_cross_text_offset.push_back(program.num_cross_text_rows);
      program.num_cross_text_rows += cross_text;
      const int64_t frame_tokens = seq.grid_h * seq.grid_w;
      for (int64_t token = first; token < first + m.chunk_tokens; ++token) {
        const int64_t held = program.num_held_tokens + (token - first);
        program.token_sequence_index.push_back(i);
        program.token_chunk_index.push_back(chunk);
        if (token < text_of_[i]) {
          program.token_position_thw.insert(program.token_position_thw.end(), {token, 0, 0});
          program.token_modality.push_back(1);
          program.held_text_index.push_back(held);
        } else {
          const int64_t v = token - text_of_[i];
          program.token_position_thw.insert(
              program.token_position_thw.end(),
              {v / frame_tokens, (v / seq.grid_w) % seq.grid_h, v % seq.grid_w});
          program.token_modality.push_back(0);
          program.held_visual_index.push_back(held);
        }
      }
      program.num_held_tokens += m.chunk_tokens;
    }
  }
}

// Routes, sending side. Rows from source rank q to holder s: sequences with source q in batch
// order, each sequence's chunk held by s, tokens in order (per modality: filtered).
void StepCompiler::route_tokens_out() {
  StepProgram& program = program_;
  struct Sent {
    int64_t all_row, modality, modal_row;
  };
  std::vector<std::vector<Sent>> sent_to(num_ranks_);
  std::vector<std::vector<int64_t>> text_rows_to(num_ranks_);  // cross-attention text
  int64_t source_all = 0, source_visual = 0, source_text_rows = 0;
  for (int64_t i = 0; i < num_sequences_; ++i) {
    const Sequence& seq = batch_.sequences[i];
    if (seq.source_rank != rank_) continue;
    const Placement& p = *placement_[i];
    for (int64_t position = 0; position < p.degree(); ++position) {
      const Membership m = membership_of(i, position);
      const int64_t dest = p.ranks[position];
      const int64_t first = m.block_offset + m.chunk_offset;
      for (int64_t token = first; token < first + m.chunk_tokens; ++token) {
        const bool text = token < text_of_[i];
        sent_to[dest].push_back(
            {source_all + token, text ? 1 : 0,
             text ? source_text_rows + token : source_visual + token - text_of_[i]});
      }
      if (!joint_attention_ && m.chunk_tokens > 0) {
        for (int64_t t = 0; t < seq.text_tokens; ++t) {
          text_rows_to[dest].push_back(source_text_rows + t);
        }
      }
    }
    source_all += attended_[i];
    source_visual += seq.num_tokens;
    source_text_rows += seq.text_tokens;
  }
  TokenRoute* modal[2] = {&program.visual_route, &program.text_route};
  program.route.num_source = source_all;
  program.visual_route.num_source = source_visual;
  program.text_route.num_source = joint_attention_ ? source_text_rows : 0;
  program.cross_text_route.num_source = joint_attention_ ? 0 : source_text_rows;
  for (TokenRoute* r : {&program.route, modal[0], modal[1], &program.cross_text_route}) {
    r->send_splits.assign(num_ranks_, 0);
    r->recv_splits.assign(num_ranks_, 0);
  }
  for (int64_t s = 0; s < num_ranks_; ++s) {
    for (const Sent& row : sent_to[s]) {
      program.route.send_index.push_back(row.all_row);
      ++program.route.send_splits[s];
      modal[row.modality]->send_index.push_back(row.modal_row);
      ++modal[row.modality]->send_splits[s];
    }
    program.cross_text_route.send_index.insert(program.cross_text_route.send_index.end(),
                                               text_rows_to[s].begin(), text_rows_to[s].end());
    program.cross_text_route.send_splits[s] = static_cast<int64_t>(text_rows_to[s].size());
  }
}

// Routes, receiving side: held chunks sorted by (source rank, batch order).
void StepCompiler::route_tokens_in() {
  StepProgram& program = program_;
  TokenRoute* modal[2] = {&program.visual_route, &program.text_route};
  program.route.num_held = program.num_held_tokens;
  program.visual_route.num_held = static_cast<int64_t>(program.held_visual_index.size());
  program.text_route.num_held = static_cast<int64_t>(program.held_text_index.size());
  program.cross_text_route.num_held = program.num_cross_text_rows;
  program.route.recv_index.assign(program.num_held_tokens, -1);
  program.visual_route.recv_index.assign(program.visual_route.num_held, -1);
  program.text_route.recv_index.assign(program.text_route.num_held, -1);
  program.cross_text_route.recv_index.assign(program.num_cross_text_rows, -1);
  std::vector<int64_t> modal_ordinal(program.num_held_tokens, -1);
  for (int64_t k = 0; k < program.visual_route.num_held; ++k) {
    modal_ordinal[program.held_visual_index[k]] = k;
  }
  for (int64_t k = 0; k < program.text_route.num_held; ++k) {
    modal_ordinal[program.held_text_index[k]] = k;
  }
  std::vector<int64_t> chunk_order(program.chunk_sequence_index.size());
  std::iota(chunk_order.begin(), chunk_order.end(), 0);
  auto source_of = [&](int64_t c) {
    return batch_.sequences[program.chunk_sequence_index[c]].source_rank;
  };
  std::stable_sort(chunk_order.begin(), chunk_order.end(), [&](int64_t a, int64_t b) {
    if (source_of(a) != source_of(b)) return source_of(a) < source_of(b);
    return program.chunk_sequence_index[a] < program.chunk_sequence_index[b];
  });
  int64_t all_row = 0, text_row = 0;
  int64_t modal_row[2] = {0, 0};
  for (int64_t c : chunk_order) {
    const int64_t source = source_of(c);
    for (int64_t t = 0; t < program.chunk_num_tokens[c]; ++t) {
      const int64_t held = program.chunk_held_offset[c] + t;
      program.route.recv_index[held] = all_row++;
      ++program.route.recv_splits[source];
      const int64_t mod = program.token_modality[held];
      modal[mod]->recv_index[modal_ordinal[held]] = modal_row[mod]++;
      ++modal[mod]->recv_splits[source];
    }
    for (int64_t t = 0; t < program.chunk_cross_text_tokens[c]; ++t) {
      program.cross_text_route.recv_index[program.chunk_cross_text_offset[c] + t] = text_row++;
    }
    program.cross_text_route.recv_splits[source] += program.chunk_cross_text_tokens[c];
  }
}

void StepCompiler::add_segment(const Membership& m, SegmentKind kind, bool in_exchange,
                               int64_t row_offset, int64_t tokens, int64_t heads,
                               int64_t head_offset) {
  program_.segment_sequence_index.push_back(m.sequence_index);
  program_.segment_kind.push_back(static_cast<int64_t>(kind));
  program_.segment_in_exchange.push_back(in_exchange ? 1 : 0);
  program_.segment_row_offset.push_back(row_offset);
  program_.segment_num_tokens.push_back(tokens);
  program_.segment_num_heads.push_back(heads);
  program_.segment_head_offset.push_back(head_offset);
}

// The segments of one kind grouped into dense calls (own rows against own rows).
std::vector<SegmentGroup> StepCompiler::dense_groups(SegmentKind kind) const {
  std::vector<int64_t> rows, tokens, heads;
  for (int64_t g = 0; g < program_.num_segments(); ++g) {
    if (program_.segment_kind[g] != static_cast<int64_t>(kind)) continue;
    rows.push_back(program_.segment_row_offset[g]);
    tokens.push_back(program_.segment_num_tokens[g]);
    heads.push_back(program_.segment_num_heads[g]);
  }
  return group_segments(rows, rows, tokens, tokens, heads);
}

// Local: each whole sequence attends on its own rows, every head; equal lengths in one call.
void StepCompiler::add_local() {
  for (const Membership& m : local_) {
    add_segment(m, SegmentKind::kLocal, false, held_offset_of_[m.sequence_index] * N_,
                m.chunk_tokens, N_, 0);
  }
  program_.local_groups = dense_groups(SegmentKind::kLocal);
}

// Ring: each block attends on its own rows, every head; the ring steps bring the other blocks.
void StepCompiler::add_ring() {
  for (const Membership& m : ring_) {
    ring_members_.emplace_back(program_.num_segments(), m);
    add_segment(m, SegmentKind::kRing, false, held_offset_of_[m.sequence_index] * N_,
                m.chunk_tokens, N_, 0);
  }
}

// Exchanged (Ulysses and hybrid) segments, each group longest first.
std::vector<Membership> exchange_group(const std::vector<Membership>& exchanged,
                                       const std::vector<const Placement*>& placement,
                                       bool hybrid) {
  std::vector<Membership> group;
  for (const Membership& m : exchanged) {
    if ((placement[m.sequence_index]->ring_degree > 1) == hybrid) group.push_back(m);
  }
  sort_exchange_segments(group);
  return group;
}

// A sequence's (hybrid: its block's) exchange rows: the whole block for this rank's heads.
void StepCompiler::add_exchange_segment(const Membership& m, SegmentKind kind) {
  exchange_offset_of_[m.sequence_index] = program_.num_exchange_rows;
  if (kind == SegmentKind::kHybrid) ring_members_.emplace_back(program_.num_segments(), m);
  add_segment(m, kind, true, program_.num_exchange_rows, m.block_tokens, m.num_heads,
              m.head_offset);
  program_.num_exchange_rows += m.block_tokens * m.num_heads;
}

// Ulysses: the exchange gives each rank the whole sequence for its head share.
void StepCompiler::add_ulysses() {
  for (const Membership& m : exchange_group(exchanged_, placement_, /*hybrid=*/false)) {
    add_exchange_segment(m, SegmentKind::kUlysses);
  }
  program_.exchange_groups = dense_groups(SegmentKind::kUlysses);
}

// Hybrid: the exchange gives each rank its whole block for its head share, then a ring over the
// Ulysses groups' peers brings the other blocks.
void StepCompiler::add_hybrid() {
  for (const Membership& m : exchange_group(exchanged_, placement_, /*hybrid=*/true)) {
    add_exchange_segment(m, SegmentKind::kHybrid);
  }
}

// Ulysses exchange, sending side. Rows from rank a to rank b (same block of sequence i):
// sequences in batch order, a's chunk tokens in order, b's heads in order (token-major).
void StepCompiler::exchange_sends() {
  std::vector<std::vector<int64_t>> exchange_rows_to(num_ranks_);
  for (const Membership& m : exchanged_) {  // batch order
    const Placement& p = *placement_[m.sequence_index];
    const int64_t u = p.ulysses_degree;
    const std::vector<int64_t> heads = balanced_split(N_, u);
    const int64_t held_first = held_offset_of_[m.sequence_index];
    for (int64_t k = 0; k < u; ++k) {
      const int64_t peer = p.ranks[m.block * u + k];
      const int64_t head_first = prefix_before(heads, k);
      std::vector<int64_t>& rows = exchange_rows_to[peer];
      for (int64_t t = 0; t < m.chunk_tokens; ++t) {
        for (int64_t h = head_first; h < head_first + heads[k]; ++h) {
          rows.push_back((held_first + t) * N_ + h);
        }
      }
    }
  }
  for (int64_t s = 0; s < num_ranks_; ++s) {
    program_.exchange_send_splits.push_back(static_cast<int64_t>(exchange_rows_to[s].size()));
    program_.exchange_send_index.insert(program_.exchange_send_index.end(),
                                        exchange_rows_to[s].begin(), exchange_rows_to[s].end());
  }
}

// Ulysses exchange, receiving side: from each peer (rank order) its chunk of every block this
// rank shares with it (batch order), for this rank's heads.
void StepCompiler::exchange_receives() {
  std::vector<std::vector<std::pair<int64_t, int64_t>>> exchange_from(num_ranks_);  // (i, k')
  for (const Membership& m : exchanged_) {  // batch order
    const Placement& p = *placement_[m.sequence_index];
    for (int64_t k = 0; k < p.ulysses_degree; ++k) {
      exchange_from[p.ranks[m.block * p.ulysses_degree + k]].emplace_back(m.sequence_index, k);
    }
  }
  program_.exchange_recv_splits.assign(num_ranks_, 0);
  program_.exchange_recv_index.assign(program_.num_exchange_rows, -1);
  std::vector<int64_t> position_of(num_sequences_, -1);
  for (const Membership& m : exchanged_) position_of[m.sequence_index] = m.position;
  int64_t recv_row = 0;
  for (int64_t source = 0; source < num_ranks_; ++source) {
    for (const auto& [i, k] : exchange_from[source]) {
      const Placement& p = *placement_[i];
      const Membership mine = membership_of(i, position_of[i]);
      const Membership theirs = membership_of(i, mine.block * p.ulysses_degree + k);
      const int64_t base = exchange_offset_of_[i];
      for (int64_t t = 0; t < theirs.chunk_tokens; ++t) {
        for (int64_t h = 0; h < mine.num_heads; ++h) {
          program_.exchange_recv_index[base + (theirs.chunk_offset + t) * mine.num_heads + h] =
              recv_row++;
        }
      }
      program_.exchange_recv_splits[source] += theirs.chunk_tokens * mine.num_heads;
    }
  }
}

// Ring and hybrid: the ring table in segment order, their segments in compact rows (own-row ones
// first), and step 0 (each block against itself).
void StepCompiler::lay_out_ring_rows() {
  StepProgram& program = program_;
  std::sort(ring_members_.begin(), ring_members_.end(),
            [](const auto& a, const auto& b) { return a.first < b.first; });
  program.ring_peer_offset.push_back(0);
  for (const auto& [segment, m] : ring_members_) {
    const Placement& p = *placement_[m.sequence_index];
    const std::vector<int64_t> blocks = balanced_split(attended_[m.sequence_index], p.ring_degree);
    program.ring_segment.push_back(segment);
    program.ring_degree.push_back(p.ring_degree);
    program.ring_position.push_back(m.block);
    for (int64_t j = 0; j < p.ring_degree; ++j) {
      program.ring_peers.push_back(p.ranks[j * p.ulysses_degree + m.chunk]);
      program.ring_block_tokens.push_back(blocks[j]);
    }
    program.ring_peer_offset.push_back(static_cast<int64_t>(program.ring_peers.size()));
  }
  for (int64_t in_exchange : {0, 1}) {
    for (int64_t e = 0; e < static_cast<int64_t>(program.ring_segment.size()); ++e) {
      const int64_t g = program.ring_segment[e];
      if (program.segment_in_exchange[g] != in_exchange) continue;
      const int64_t rows = program.segment_num_tokens[g] * program.segment_num_heads[g];
      std::vector<int64_t>& to = in_exchange ? program.ring_exchange_rows : program.ring_own_rows;
      for (int64_t r = 0; r < rows; ++r) to.push_back(program.segment_row_offset[g] + r);
      ring_entries_.push_back({e, g, program.ring_num_rows, rows});
      program.ring_num_rows += rows;
    }
  }
  std::vector<int64_t> offsets, tokens, heads;
  for (const RingEntry& x : ring_entries_) {
    offsets.push_back(x.compact);
    tokens.push_back(program.segment_num_tokens[x.g]);
    heads.push_back(program.segment_num_heads[x.g]);
  }
  program.ring_step0_groups = group_segments(offsets, offsets, tokens, tokens, heads);
}

// Ring step s: each block goes s peers on, and the one s peers back arrives. Messages to / from
// one peer carry their sequences in batch order on both ends.
void StepCompiler::add_ring_step(int64_t s) {
  const StepProgram& program = program_;
  std::map<int64_t, std::vector<std::tuple<int64_t, int64_t, int64_t>>> send_to;
  std::map<int64_t, std::vector<std::tuple<int64_t, int64_t, int64_t, int64_t>>> recv_from;
  for (const RingEntry& x : ring_entries_) {
    const int64_t r = program.ring_degree[x.e];
    if (r <= s || x.rows == 0) continue;  // an empty block neither sends nor needs anything
    const int64_t j = program.ring_position[x.e], base = program.ring_peer_offset[x.e];
    const int64_t sequence = program.segment_sequence_index[x.g];
    const int64_t dst = (j + s) % r, src = ((j - s) % r + r) % r;
    if (program.ring_block_tokens[base + dst] > 0) {
      send_to[program.ring_peers[base + dst]].emplace_back(sequence, x.compact, x.rows);
    }
    if (program.ring_block_tokens[base + src] > 0) {
      recv_from[program.ring_peers[base + src]].emplace_back(
          sequence, x.g, x.compact, program.ring_block_tokens[base + src]);
    }
  }
  RingStep step;
  for (auto& [peer, items] : send_to) {
    std::sort(items.begin(), items.end());
    PeerRows message{peer, {}};
    for (const auto& [sequence, compact, rows] : items) {
      message.rows.push_back({compact, compact + rows});
    }
    step.sends.push_back(std::move(message));
  }
  std::vector<int64_t> q_offsets, k_offsets, q_tokens, k_tokens, heads;
  for (auto& [peer, items] : recv_from) {
    std::sort(items.begin(), items.end());
    const int64_t start = step.num_recv_rows;
    for (const auto& [sequence, g, compact, block] : items) {
      q_offsets.push_back(compact);
      k_offsets.push_back(step.num_recv_rows);
      q_tokens.push_back(program.segment_num_tokens[g]);
      k_tokens.push_back(block);
      heads.push_back(program.segment_num_heads[g]);
      step.num_recv_rows += block * program.segment_num_heads[g];
    }
    step.recvs.push_back({peer, {{start, step.num_recv_rows}}});
  }
  step.groups = group_segments(q_offsets, k_offsets, q_tokens, k_tokens, heads);
  program_.ring_steps.push_back(std::move(step));
}

// Cross-attention: each nonempty chunk's queries against its sequence's text rows.
void StepCompiler::add_cross_attention() {
  StepProgram& program = program_;
  std::vector<int64_t> q_offsets, k_offsets, q_tokens, k_tokens, heads;
  for (size_t c = 0; c < program.chunk_sequence_index.size(); ++c) {
    q_offsets.push_back(program.chunk_held_offset[c] * N_);
    k_offsets.push_back(program.chunk_cross_text_offset[c] * N_);
    q_tokens.push_back(program.chunk_num_tokens[c]);
    k_tokens.push_back(program.chunk_cross_text_tokens[c]);
    heads.push_back(N_);
  }
  program.cross_groups = group_segments(q_offsets, k_offsets, q_tokens, k_tokens, heads);
}

}  // namespace

StepProgram compile_step_program(const Batch& batch, const Plan& plan, int64_t rank,
                                 int64_t num_heads, bool joint_attention) {
  if (num_heads <= 0) {
    throw std::invalid_argument("num_heads must be positive, got " + std::to_string(num_heads));
  }
  validate_batch(batch, plan.num_ranks);
  validate_plan(plan, batch, plan.num_ranks, num_heads);
  if (rank < 0 || rank >= plan.num_ranks) {
    throw std::invalid_argument("rank " + std::to_string(rank) + " is outside the plan's " +
                                std::to_string(plan.num_ranks) + " ranks");
  }
  return StepCompiler(batch, plan, rank, num_heads, joint_attention).compile();
}

// ---- Binary form: a magic number, a version, then every field in declaration order. ----
namespace {

constexpr int64_t kProgramMagic = 0x5a5350524f47;  // "ZSPROG"
constexpr int64_t kProgramVersion = 1;

struct Writer {
  std::string bytes;
  static constexpr bool reading = false;
  void raw(void* data, size_t size) { bytes.append(static_cast<const char*>(data), size); }
  void check_count(int64_t, size_t) {}
};

struct Reader {
  const std::string& bytes;
  size_t at = 0;
  static constexpr bool reading = true;
  void raw(void* data, size_t size) {
    if (size > bytes.size() - at) {
      throw std::invalid_argument("step program bytes are truncated");
    }
    std::memcpy(data, bytes.data() + at, size);
    at += size;
  }
  // A count of items of at least `item_bytes` each must fit in what is left.
  void check_count(int64_t count, size_t item_bytes) {
    if (count < 0 || static_cast<uint64_t>(count) > (bytes.size() - at) / item_bytes) {
      throw std::invalid_argument("step program bytes are corrupted (a count of " +
                                  std::to_string(count) + " items)");
    }
  }
};

template <class A>
void io(A& a, int64_t& value) {
  a.raw(&value, sizeof value);
}
template <class A>
void io(A& a, bool& value) {
  int64_t word = value ? 1 : 0;
  io(a, word);
  value = word != 0;
}
template <class A>
void io(A& a, std::vector<int64_t>& values) {
  int64_t count = static_cast<int64_t>(values.size());
  io(a, count);
  a.check_count(count, sizeof(int64_t));
  if constexpr (A::reading) values.resize(count);
  if (count > 0) a.raw(values.data(), count * sizeof(int64_t));
}
template <class A>
void io(A& a, RowSlice& slice) {
  io(a, slice.begin);
  io(a, slice.end);
}
template <class A>
void io(A& a, PeerRows& message);
template <class A>
void io(A& a, SegmentGroup& group);
template <class A>
void io(A& a, RingStep& step);
template <class A, class T>
void io(A& a, std::vector<T>& items) {
  int64_t count = static_cast<int64_t>(items.size());
  io(a, count);
  a.check_count(count, sizeof(int64_t));  // every item is at least one word
  if constexpr (A::reading) items.resize(count);
  for (T& item : items) io(a, item);
}
template <class A>
void io(A& a, PeerRows& message) {
  io(a, message.peer);
  io(a, message.rows);
}
template <class A>
void io(A& a, SegmentGroup& group) {
  io(a, group.q_len);
  io(a, group.k_len);
  io(a, group.num_heads);
  io(a, group.q_row_offset);
  io(a, group.k_row_offset);
}
template <class A>
void io(A& a, RingStep& step) {
  io(a, step.sends);
  io(a, step.recvs);
  io(a, step.num_recv_rows);
  io(a, step.groups);
}
template <class A>
void io(A& a, TokenRoute& route) {
  io(a, route.num_source);
  io(a, route.num_held);
  io(a, route.send_index);
  io(a, route.send_splits);
  io(a, route.recv_splits);
  io(a, route.recv_index);
}

// Every field of StepProgram, once: adding a field is one line here.
template <class A>
void io(A& a, StepProgram& p) {
  for (int64_t* v : {&p.rank, &p.num_ranks, &p.num_heads}) io(a, *v);
  io(a, p.joint_attention);
  io(a, p.fingerprint);
  for (std::vector<int64_t>* v :
       {&p.chunk_sequence_index, &p.chunk_token_offset, &p.chunk_num_tokens,
        &p.chunk_num_text_tokens, &p.chunk_cross_text_tokens, &p.chunk_held_offset,
        &p.chunk_cross_text_offset}) {
    io(a, *v);
  }
  io(a, p.num_held_tokens);
  io(a, p.num_cross_text_rows);
  for (std::vector<int64_t>* v :
       {&p.token_sequence_index, &p.token_chunk_index, &p.token_position_thw, &p.token_modality,
        &p.held_visual_index, &p.held_text_index}) {
    io(a, *v);
  }
  for (TokenRoute* r : {&p.route, &p.visual_route, &p.text_route, &p.cross_text_route}) {
    io(a, *r);
  }
  io(a, p.world_has_exchange);
  for (std::vector<int64_t>* v :
       {&p.exchange_send_index, &p.exchange_send_splits, &p.exchange_recv_splits}) {
    io(a, *v);
  }
  io(a, p.num_exchange_rows);
  for (std::vector<int64_t>* v :
       {&p.exchange_recv_index, &p.segment_sequence_index, &p.segment_kind, &p.segment_in_exchange,
        &p.segment_row_offset, &p.segment_num_tokens, &p.segment_num_heads, &p.segment_head_offset,
        &p.ring_segment, &p.ring_degree, &p.ring_position, &p.ring_peer_offset, &p.ring_peers,
        &p.ring_block_tokens}) {
    io(a, *v);
  }
  io(a, p.local_groups);
  io(a, p.exchange_groups);
  io(a, p.ring_num_rows);
  io(a, p.ring_own_rows);
  io(a, p.ring_exchange_rows);
  io(a, p.ring_step0_groups);
  io(a, p.ring_steps);
  io(a, p.cross_groups);
}

}  // namespace

std::string serialize_step_program(const StepProgram& program) {
  Writer writer;
  int64_t magic = kProgramMagic, version = kProgramVersion;
  io(writer, magic);
  io(writer, version);
  io(writer, const_cast<StepProgram&>(program));  // the writer only reads
  return std::move(writer.bytes);
}

StepProgram deserialize_step_program(const std::string& bytes) {
  Reader reader{bytes};
  int64_t magic = 0, version = 0;
  io(reader, magic);
  io(reader, version);
  if (magic != kProgramMagic || version != kProgramVersion) {
    throw std::invalid_argument("not a step program of format version " +
                                std::to_string(kProgramVersion));
  }
  StepProgram program;
  io(reader, program);
  if (reader.at != bytes.size()) {
    throw std::invalid_argument("step program bytes are corrupted (trailing bytes)");
  }
  return program;
}

}  // namespace zellige
