// Plan compiler: a plan -> the step program of one rank, every integer table its runtime needs for
// one step (routes, exchanges, ring schedule, attention groups, positions). Pure bookkeeping: no
// tensors, no process group. Formats and the flow of a step: docs/formats.md, docs/architecture.md.
//
// Vocabulary (T = tokens this rank holds, N = num_heads, W = num_ranks):
//  - attended tokens of a sequence: its visual tokens (cross-attention models), or its text tokens
//    followed by its visual tokens (joint attention, MMDiT: [text, visual] as SD3/Flux
//    concatenate them). Every cut of plan.h (ring blocks, then Ulysses chunks) cuts this list, so
//    text travels with its sequence and no text token is held twice.
//  - source tokens: the attended tokens of the sequences whose source_rank is this rank, whole
//    sequences concatenated in batch order (what the rank's loader produced). Per modality
//    ("visual", "text"): the same sequences' tokens of that modality only, in batch order.
//  - held tokens: the token chunks this rank holds for the per-token layers (plan.h contract),
//    in held order: whole local sequences first (longest first, then batch order, so equal
//    lengths sit side by side), then chunks of ring sequences, then chunks of Ulysses and hybrid
//    sequences (each group longest chunk first, then batch order);
//  - rows: attention works on rows of head_dim values, one per (token, head) pair. The rank's
//    own q/k/v [T, N, H] are "own rows" (row = held_token * N + head). The Ulysses exchange
//    fills "exchange rows": per Ulysses sequence (or hybrid block) the rank attends to, the whole
//    sequence (block) for the rank's head share, token-major ([tokens, heads, H]). Ring and
//    hybrid segments are gathered into "compact rows" (own-row segments first, then exchange-row
//    ones) for their ring steps. Cross-attention keys are "text rows" (text row * N + head).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "zellige/plan.h"
#include "zellige/workload.h"

namespace zellige {

enum class SegmentKind { kLocal, kUlysses, kRing, kHybrid };

// Segments of one shape attended in one dense kernel call. Segment s has q_len query tokens x
// num_heads heads at query row q_row_offset[s] (token-major) and k_len key tokens at key row
// k_row_offset[s]. The one grouping engine for every kind of attention (self, joint, cross,
// ring steps), in the step program and behind runtime.SegmentTable.build.
struct SegmentGroup {
  int64_t q_len = 0;
  int64_t k_len = 0;
  int64_t num_heads = 0;
  std::vector<int64_t> q_row_offset;
  std::vector<int64_t> k_row_offset;
  bool operator==(const SegmentGroup&) const = default;
};

// Groups segments by (q_len, k_len, num_heads), largest shape first; members sorted by query
// then key offset. Segments without queries, keys or heads are dropped. All spans must have the
// same length (std::invalid_argument otherwise).
std::vector<SegmentGroup> group_segments(const std::vector<int64_t>& q_row_offset,
                                         const std::vector<int64_t>& k_row_offset,
                                         const std::vector<int64_t>& q_len,
                                         const std::vector<int64_t>& k_len,
                                         const std::vector<int64_t>& num_heads);

// One all_to_all of rows: send row i = source row send_index[i]; rows go to ranks in rank order,
// send_splits[r] for rank r. Received row recv_index[p] becomes destination row p.
struct TokenRoute {
  int64_t num_source = 0;  // rows the rank provides
  int64_t num_held = 0;    // rows it ends up with
  std::vector<int64_t> send_index;
  std::vector<int64_t> send_splits;  // [W]
  std::vector<int64_t> recv_splits;  // [W]
  std::vector<int64_t> recv_index;   // [num_held]
  bool operator==(const TokenRoute&) const = default;
};

struct RowSlice {
  int64_t begin = 0;
  int64_t end = 0;
  bool operator==(const RowSlice&) const = default;
};

// One point-to-point message of a ring step: its rows, in message order.
struct PeerRows {
  int64_t peer = 0;  // group rank
  std::vector<RowSlice> rows;
  bool operator==(const PeerRows&) const = default;
};

// Ring step s >= 1 for all ring and hybrid segments of the rank: one message per peer each way.
// sends: compact rows of the rank's own k/v blocks per peer (sequences in batch order); recvs:
// the slice of the step's receive buffer each peer fills; groups: the rank's query rows (compact)
// against the received blocks (receive-buffer rows). dk/dv of a received block go back along the
// reverse messages in the backward pass.
struct RingStep {
  std::vector<PeerRows> sends;
  std::vector<PeerRows> recvs;
  int64_t num_recv_rows = 0;
  std::vector<SegmentGroup> groups;
  bool operator==(const RingStep&) const = default;
};

struct StepProgram {
  int64_t rank = 0;
  int64_t num_ranks = 0;
  int64_t num_heads = 0;
  bool joint_attention = false;
  // Digest of what the program depends on (batch, plan, heads, joint flag): ranks compare it to
  // catch loaders that were handed different batches or plans. 63 bits.
  int64_t fingerprint = 0;

  // ---- Held chunks, in held order (one entry per chunk; a chunk may be empty). ----
  std::vector<int64_t> chunk_sequence_index;     // index into batch.sequences
  std::vector<int64_t> chunk_token_offset;       // first attended token within the sequence
  std::vector<int64_t> chunk_num_tokens;         // attended tokens held (joint: text included)
  std::vector<int64_t> chunk_num_text_tokens;    // joint: text tokens among them; cross: 0
  std::vector<int64_t> chunk_cross_text_tokens;  // cross: text rows route_text delivers; joint: 0
  std::vector<int64_t> chunk_held_offset;        // first held token of the chunk
  std::vector<int64_t> chunk_cross_text_offset;  // first text row of the chunk (cross)
  int64_t num_held_tokens = 0;                   // T
  int64_t num_cross_text_rows = 0;               // X (cross)

  // ---- Per held token. ----
  std::vector<int64_t> token_sequence_index;  // [T], index into batch.sequences
  std::vector<int64_t> token_chunk_index;     // [T], index of its held chunk
  std::vector<int64_t> token_position_thw;    // [T * 3]; text token k of a sequence: (k, 0, 0)
  std::vector<int64_t> token_modality;        // [T], 0 visual, 1 text
  std::vector<int64_t> held_visual_index;     // held positions of the visual tokens, in order
  std::vector<int64_t> held_text_index;       // held positions of the text tokens, in order

  // ---- Routes: source tokens -> held tokens. ----
  TokenRoute route;         // all attended tokens
  TokenRoute visual_route;  // visual tokens only: [S_visual] -> held visual tokens in order
  TokenRoute text_route;    // joint: text tokens only; cross: empty
  // Cross-attention text: source text rows -> each nonempty held chunk's sequence text, chunks in
  // held order (a text reaches every rank that holds a nonempty chunk of its sequence).
  TokenRoute cross_text_route;

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
  std::vector<int64_t> segment_sequence_index;
  std::vector<int64_t> segment_kind;  // SegmentKind as int
  std::vector<int64_t> segment_in_exchange;
  std::vector<int64_t> segment_row_offset;
  std::vector<int64_t> segment_num_tokens;
  std::vector<int64_t> segment_num_heads;
  std::vector<int64_t> segment_head_offset;

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

  // ---- What the runtime executes: dense attention groups and the ring schedule. ----
  std::vector<SegmentGroup> local_groups;       // whole local sequences, own rows
  std::vector<SegmentGroup> exchange_groups;    // Ulysses sequences, exchange rows
  int64_t ring_num_rows = 0;                    // compact rows of the ring and hybrid segments
  std::vector<int64_t> ring_own_rows;           // own rows -> compact rows [0, size)
  std::vector<int64_t> ring_exchange_rows;      // exchange rows -> the compact rows after those
  std::vector<SegmentGroup> ring_step0_groups;  // each block against itself, compact rows
  std::vector<RingStep> ring_steps;             // steps 1 .. (largest ring degree) - 1
  std::vector<SegmentGroup> cross_groups;       // cross: own rows (queries) against text rows

  int64_t num_segments() const { return static_cast<int64_t>(segment_kind.size()); }
  bool operator==(const StepProgram&) const = default;
};

// Validates the batch and the plan (validate_batch, validate_plan with plan.num_ranks and
// num_heads; num_heads must be positive), 0 <= rank < plan.num_ranks, and that what the rank
// would hold stays within kMaxRowsPerRank rows (token x head rows, text included, and source
// rows), then builds the program. Deterministic: every rank can compile every other rank's
// program. Throws std::invalid_argument naming what is wrong.
StepProgram compile_step_program(const Batch& batch, const Plan& plan, int64_t rank,
                                 int64_t num_heads, bool joint_attention);

// Index tables beyond this many rows per rank (about 16 GiB of int64 each) are refused: such a
// step cannot fit a rank's memory, and a clear error beats an allocation failure.
inline constexpr int64_t kMaxRowsPerRank = int64_t{1} << 31;

// The program as bytes and back (a versioned binary form; what pickling uses). Throws
// std::invalid_argument for bytes that are not a program of this version (truncated, corrupted).
std::string serialize_step_program(const StepProgram& program);
StepProgram deserialize_step_program(const std::string& bytes);

}  // namespace zellige
