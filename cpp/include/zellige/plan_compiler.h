// Plan compiler: a plan -> the integer tables one rank's runtime needs (route, exchanges,
// coalesced attention, ring steps, positions). Pure bookkeeping: no tensors, no process group.
//
// Vocabulary (T = tokens this rank holds, N = num_heads, W = num_ranks):
//  - source tokens: the tokens of the sequences whose source_rank is this rank, whole sequences
//    concatenated in batch order (what the rank's loader produced);
//  - held tokens: the token chunks this rank holds for the per-token layers (plan.h contract),
//    in held order: whole local sequences first (longest first, then batch order, so equal
//    lengths sit side by side), then chunks of ring sequences, then chunks of Ulysses and hybrid
//    sequences (each group longest chunk first, then batch order);
//  - rows: attention works on rows of head_dim values, one per (token, head) pair. The rank's
//    own q/k/v [T, N, H] are "own rows" (row = held_token * N + head). The Ulysses exchange
//    fills "exchange rows": per Ulysses sequence (or hybrid block) the rank attends to, the whole
//    sequence (block) for the rank's head share, token-major ([tokens, heads, H]).
#pragma once

#include <cstdint>
#include <vector>

#include "zellige/plan.h"
#include "zellige/workload.h"

namespace zellige {

enum class SegmentKind { kLocal, kUlysses, kRing, kHybrid };

struct RankLayout {
  int64_t rank = 0;
  int64_t num_ranks = 0;
  int64_t num_heads = 0;

  // ---- Held chunks, in held order (one entry per chunk). ----
  std::vector<int64_t> chunk_sequence_index;  // index into batch.sequences
  std::vector<int64_t> chunk_token_offset;    // first token within the sequence
  std::vector<int64_t> chunk_num_tokens;
  std::vector<int64_t> chunk_held_offset;  // first held token of the chunk
  int64_t num_held_tokens = 0;             // T

  // ---- Per held token. ----
  std::vector<int64_t> token_sequence_index;  // [T], index into batch.sequences
  std::vector<int64_t> token_position_thw;    // [T * 3], (t, h, w) in the sequence's latent grid

  // ---- Route: source tokens -> held tokens, one all_to_all over the world. ----
  // Send buffer row i = source token route_send_index[i]; rows go to ranks in rank order with
  // route_send_splits[r] rows for rank r. Held token p = receive row route_recv_index[p].
  int64_t num_source_tokens = 0;
  std::vector<int64_t> route_send_index;   // [num_source_tokens], a permutation
  std::vector<int64_t> route_send_splits;  // [W]
  std::vector<int64_t> route_recv_splits;  // [W]
  std::vector<int64_t> route_recv_index;   // [T], a permutation

  // ---- Ulysses exchange: own rows -> exchange rows, ONE all_to_all over the world for all the
  // rank's Ulysses and hybrid sequences (zero splits for non-members). ----
  // world_has_exchange is the same on every rank: when false, no rank calls the collective.
  bool world_has_exchange = false;
  std::vector<int64_t> exchange_send_index;   // own rows (token * N + head), in send order
  std::vector<int64_t> exchange_send_splits;  // [W], rows
  std::vector<int64_t> exchange_recv_splits;  // [W], rows
  int64_t num_exchange_rows = 0;
  std::vector<int64_t> exchange_recv_index;  // [num_exchange_rows]: exchange row b = recv row [b]

  // ---- Attention segments: every piece of attention the rank computes (step 0 for ring). ----
  // A segment is `segment_num_tokens` tokens x `segment_num_heads` heads (global heads
  // [head_offset, head_offset + num_heads)) at `segment_row_offset` rows of buffer
  // `segment_in_exchange` (0: own rows, 1: exchange rows), token-major. Order: own-row segments
  // (local, then ring) then exchange-row segments (Ulysses, then hybrid), each in row order.
  // cu_seqlens: prefix sums of segment_num_tokens (q and k lengths agree at step 0).
  std::vector<int64_t> segment_sequence_index;
  std::vector<int64_t> segment_kind;  // SegmentKind as int
  std::vector<int64_t> segment_in_exchange;
  std::vector<int64_t> segment_row_offset;
  std::vector<int64_t> segment_num_tokens;
  std::vector<int64_t> segment_num_heads;
  std::vector<int64_t> segment_head_offset;
  std::vector<int64_t> cu_seqlens;  // [num_segments + 1]

  // ---- Ring table: one entry per ring or hybrid segment of this rank. ----
  // The rank is at ring_position j of ring_degree r; its peers (the ranks holding the other
  // blocks for the same head share) and their block sizes are ring_peers / ring_block_tokens
  // [ring_peer_offset[i], ring_peer_offset[i] + r) in block order (entry j is this rank). At ring
  // step s (1..r-1) the rank sends its k/v block to peer (j + s) % r and receives block
  // (j - s) % r from that peer, so every step is independent of the others.
  std::vector<int64_t> ring_segment;  // index into the segment table
  std::vector<int64_t> ring_degree;
  std::vector<int64_t> ring_position;
  std::vector<int64_t> ring_peer_offset;  // [num_ring + 1]
  std::vector<int64_t> ring_peers;
  std::vector<int64_t> ring_block_tokens;

  int64_t num_segments() const { return static_cast<int64_t>(segment_kind.size()); }
};

// Validates the batch and the plan (validate_batch, validate_plan with plan.num_ranks and
// num_heads; num_heads must be positive) and 0 <= rank < plan.num_ranks, then builds the layout.
// Deterministic: every rank can compile every other rank's layout. Throws std::invalid_argument.
RankLayout compile_rank_layout(const Batch& batch, const Plan& plan, int64_t rank,
                               int64_t num_heads);

}  // namespace zellige
