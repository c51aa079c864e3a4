// Cost model: time and memory of any placement of a sequence, and of a whole plan.
//
// All times are for one full training step of the model (all layers, forward + backward, plus the
// recompute under activation checkpointing: selective, so the per-token layers and the q/k/v
// exchange run again but attention does not; docs/training.md). All memory is peak bytes on a
// rank.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <unordered_map>
#include <utility>
#include <vector>

#include "zellige/cluster.h"
#include "zellige/model_spec.h"
#include "zellige/plan.h"
#include "zellige/profile.h"
#include "zellige/workload.h"

namespace zellige {

struct CostOptions {
  bool activation_checkpointing = true;
  int64_t bytes_per_element = 2;  // bf16 activations and exchanges
  // Bytes of training state per parameter, sharded over all ranks by FSDP: fp32 master 4 +
  // Adam 8 + fp32 grad 4. The bf16 copies are gathered per unit (the step's fixed bytes and the
  // root's gathered bytes), not held: one H200 measured 16.2 bytes a parameter after the backward.
  double state_bytes_per_param = 16.0;
  double memory_headroom = 0.05;  // fraction of GPU memory the planner keeps free
  // The part of state_bytes_per_param that exists only from the backward on: training sets
  // gradients to None between steps, so a layer's gradients appear when its backward is done.
  double gradient_bytes_per_param = 4.0;
  // With activation_checkpointing: evaluate() checkpoints on each rank only as many layers (the
  // first ones) as its memory needs, and prices the recompute of those alone. The planners still
  // size ranks as if every layer were checkpointed, so every plan stays feasible.
  bool adaptive_checkpointing = false;
  // Training keeps each block's gathered bf16 weights from its forward to its backward instead
  // of gathering them again there (zellige.train on one rank: FSDP2 without resharding after the
  // forward, or no FSDP). Before layer j's backward the weights of layers 0..j are then held,
  // where the step's fixed bytes count two gathered layers (the one running and the prefetched).
  bool weights_kept_to_backward = false;
  // Bytes a parameter holds in the optimizer step beside its state: zellige.train's copying
  // AdamW on one rank without FSDP writes the next forward's bf16 copy of every weight (2)
  // while the gradients are still held, the step's peak when it holds few tokens. 0: none.
  double optimizer_copy_bytes_per_param = 0.0;
  // Prices a micro-batch of a step of several (gradient accumulation): the gradients the earlier
  // micro-batches added are held from the backward's start, where a step of one grows them layer
  // by layer. Each rank adds into its sharded gradients in place (one rank; FSDP2 reducing every
  // micro-batch), so they take no more than gradient_bytes_per_param. A step's first
  // micro-batch holds less: priced so, it is safe.
  bool accumulating_gradients = false;
};

// What one placement of one sequence costs one of its ranks. Everything is additive over the
// sequences a rank holds except the per-token layers, whose time depends on the rank's total
// token count (GEMM efficiency), see CostModel::linear_time_s.
struct RankShare {
  int64_t rank = 0;
  int64_t tokens = 0;       // tokens this rank holds for the per-token layers
  double attention_s = 0;   // self- (+ cross-) attention, each segment a call of its own
  double exchange_s = 0;    // Ulysses all-to-alls and ring transfers not hidden by compute
  double memory_bytes = 0;  // activations + attention and exchange buffers of this sequence
  // The parts of memory_bytes that evaluate() lays out over the backward's progress: one layer's
  // kept activations without checkpointing, with (selective) checkpointing, and with a full
  // recompute (the layer input alone), and one layer's backward buffers. memory_bytes, which
  // the planners add up, counts every layer at the least of these (a full recompute).
  double layer_activation_bytes = 0;
  double layer_checkpoint_bytes = 0;
  double layer_input_bytes = 0;
  double buffer_bytes = 0;
  // The parts of attention_s (the text k/v projections) and exchange_s (Ulysses' q/k/v) that
  // the selective recompute of every layer adds; attention itself is not recomputed.
  double recompute_s = 0;
  double recompute_exchange_s = 0;
  // What a full recompute of every layer adds on top: attention's forward, and the exchanges
  // that run with it (Ulysses' output all-to-all, the ring's forward transfers).
  double attention_recompute_s = 0;
  double attention_recompute_exchange_s = 0;
};

// time_s = max(linear_s + attention_s + call_s + exchange_s, launch_floor_s).
struct RankCost {
  double time_s = 0;
  double peak_bytes = 0;
  int64_t tokens = 0;
  double linear_s = 0, attention_s = 0, exchange_s = 0;
  // What the engine's calls save against each segment priced as a call of its own (<= 0): equal
  // segments run as one call, and the calls of a table the engine spreads over CUDA streams run
  // side by side (stream_s, the part of call_s from that; see streamed_calls_s).
  double call_s = 0;
  double stream_s = 0;
  double launch_floor_s = 0;    // host time to issue the rank's kernels
  // per layer pass: distinct (shape, heads) groups, ring steps apart; a ragged table one call
  int64_t attention_calls = 0;
  int64_t checkpointed_layers = 0;  // the first this many layers recompute in the backward
  // The first this many of those recompute their attention too (full recompute): only where
  // keeping every checkpointed layer's attention outputs does not fit.
  int64_t full_recompute_layers = 0;
};

// The least number of dense calls of a table that the engine runs as one ragged call where the
// profile says it does (attention_ragged): the one value, read by runtime/coalesced.py through
// zellige._core.RAGGED_MIN_CALLS. One: a table of equal short segments (a micro-batch of one
// bucket) runs ragged too, since the dense call builds a cuDNN plan for every new shape (37-39 ms
// a pass on one H100, and recipes' lengths vary with aspect ratio) where the ragged call's
// graphs are cached per shape bucket.
inline constexpr int64_t kRaggedMinCalls = 1;
// ... and whose segments are all at most this many query and key tokens: a table holding a
// longer one runs its dense calls (with the key split and streams), which were 3-6% faster than
// the ragged call on the packs of a few long sequences on one H200, the ragged call 13-15%
// faster on the packs of only short ones (bench/results/attention_engine_h200_202612.md).
// Read by runtime/coalesced.py as zellige._core.RAGGED_MAX_SEGMENT_TOKENS.
inline constexpr int64_t kRaggedMaxSegmentTokens = 16384;

// The stream of each attention call of one table, calls in the order given (most work first):
// the stream with the least work queued so far, the lowest index on ties. The one place this is
// decided: the engine (runtime/coalesced.py _for_each_group, through zellige._core) issues its
// calls so, and CostModel::evaluate prices the same assignment. streams < 1 counts as 1.
std::vector<int64_t> stream_assignment(const std::vector<int64_t>& works, int64_t streams);

// Seconds of one table's calls (works as the engine orders and assigns them, `seconds` each call's
// time alone) on `streams` streams: sum - overlap * (sum - the most loaded stream's seconds), with
// overlap the measured share of the ideal gain (HardwareProfile::attention_stream_overlap). One
// stream, or overlap 0: the sum, bit for bit.
double streamed_calls_s(const std::vector<int64_t>& works, const std::vector<double>& seconds,
                        int64_t streams, double overlap);

struct LowerBoundSearch;
class CostModel;

namespace cost_detail {
// One attention call: query tokens, key tokens, heads per segment, then -1 for a coalescable
// self-attention segment, -2 for cross-attention, or the sequence id for one of its ring
// steps (the last entry), which run one after another.
using CallKey = std::array<int64_t, 5>;
struct RankCall {
  int64_t rank = 0;
  CallKey key{};
  int64_t segments = 1;
};
}  // namespace cost_detail

// A memo for CostModel::evaluate and CostModel::shares: per placement shape (lengths, degrees and
// the node pattern of its ranks) the shares and attention calls by rank position, which do not
// depend on which ranks. Planners that price many plans of one batch keep one; results are
// bit-identical to the unmemoised calls (exchange bytes up to summation order). Tied to the cost
// model of its first use.
class EvaluationCache {
 public:
  size_t size() const { return entries_.size() + local_entries_.size(); }

 private:
  friend class CostModel;
  struct KeyHash {
    size_t operator()(const std::vector<int64_t>& key) const;
  };
  struct Entry {
    std::vector<RankShare> shares;  // ranks by position 0..degree-1
    // Per position: the most that grouping this share's segments with equal ones of other
    // sequences can give back (each segment's whole call excess), and running its
    // cross-attention call beside others on streams (stream_gain_bound_); see makespan_floor.
    std::vector<double> call_excess_s;
    double exchange_bytes = 0;      // sent by the exchanges, routing excluded
    // Per position: (query, key, heads, tag, step) -> segments, by key, ring steps left out;
    // and its ring steps' calls, counted: each is a call of its own (never grouped, ragged or
    // streamed), so a ring over r ranks keeps r counts, not r calls on each of its ranks.
    // Listed only once evaluate needs them (calls_listed); the floors never read them.
    std::vector<std::vector<std::pair<std::array<int64_t, 5>, int64_t>>> calls;
    std::vector<int64_t> ring_step_calls;
    bool calls_listed = false;
  };
  struct LengthsHash {
    size_t operator()(const std::pair<int64_t, int64_t>& lengths) const {
      return std::hash<int64_t>()(lengths.first * 1000003 + lengths.second);
    }
  };
  std::unordered_map<std::vector<int64_t>, Entry, KeyHash> entries_;
  // Single-rank placements by (tokens, text tokens): the common case, without building a key.
  std::unordered_map<std::pair<int64_t, int64_t>, Entry, LengthsHash> local_entries_;
  std::vector<int64_t> key_;  // scratch
  std::vector<int64_t> node_labels_;  // find_entry's scratch: per node, -1 between calls
  // evaluate's scratch: a plan's calls, then the same by rank (kept: planners price many plans)
  std::vector<cost_detail::RankCall> calls_, calls_by_rank_;
};

struct PlanCost {
  std::vector<RankCost> ranks;
  double makespan_s = 0;
  double peak_bytes = 0;      // max over ranks
  double exchange_bytes = 0;  // total bytes all ranks send per step (route + exchanges)
  bool fits = true;           // every rank within memory_capacity_bytes()
};

class CostModel {
 public:
  // Throws std::invalid_argument if the profile is invalid or the model has no heads.
  CostModel(ModelSpec model, HardwareProfile profile, Cluster cluster, CostOptions options = {});

  const ModelSpec& model() const { return model_; }
  // The profile as this model reads it: the model's own per-token rate tables
  // (model_matmul_*_flops_per_s), where measured, in place of the shared matmul_*_flops_per_s.
  const HardwareProfile& profile() const { return profile_; }
  const Cluster& cluster() const { return cluster_; }
  const CostOptions& options() const { return options_; }

  // Per-rank shares of `placement` (ranks in placement order). The placement must be valid for
  // the cluster (see validate_plan); this is the planners' hot path and does not re-check.
  std::vector<RankShare> shares(const Sequence& sequence, const Placement& placement) const;
  // The largest of s_per_token * tokens + attention_s + exchange_s over shares(sequence,
  // placement), the same value, without listing the shares: a ring's positions take at most a
  // few distinct shares (planners price rings over thousands of ranks for every length).
  double busiest_share_s(const Sequence& sequence, const Placement& placement,
                         double s_per_token) const;
  // The same, memoised in `cache` (see EvaluationCache).
  std::vector<RankShare> shares(const Sequence& sequence, const Placement& placement,
                                EvaluationCache& cache) const;
  // shares(sequence, placement) as runs of alike positions, in placement order: (positions,
  // share), the share's rank that of the run's first position; positions alike but for their
  // rank. A ring without Ulysses takes at most four runs however many ranks it spans, so a planner
  // adds a ring over thousands of ranks without listing (or pricing) a share per rank.
  std::vector<std::pair<int64_t, RankShare>> share_runs(const Sequence& sequence,
                                                        const Placement& placement) const;

  // Per-token layers of all layers, forward + backward (+ recompute), on `tokens` tokens: GEMMs
  // at the profile's rate for that token count (held constant outside the sampled range) plus a
  // memory-bound elementwise term.
  double linear_time_s(int64_t tokens) const;
  // Smallest per-token time of the per-token layers over any token count (for lower bounds).
  double min_linear_time_per_token_s() const;

  // Weights, gradients and optimizer state under FSDP over all ranks, gathered layer buffers,
  // and the runtime's reserve: what a rank holds before any sequence.
  double fixed_bytes() const;
  // The part of fixed_bytes() that is the gradients (present only at the backward's end).
  double gradient_bytes() const;
  // Usable bytes of `rank`: its GPU memory (Cluster::memory_of) x (1 - headroom).
  double memory_capacity_bytes(int64_t rank) const;
  // Usable bytes that every rank has: the smallest rank's (all ranks' on a homogeneous cluster).
  double memory_capacity_bytes() const;
  // Usable bytes of the rank with the most memory.
  double max_memory_capacity_bytes() const;
  // This cost model on Cluster homogeneous_view(cluster()): every rank the profile's device with
  // the smallest rank memory. What the speed-unaware baselines plan with; numbers of a placement
  // (shares, exchanges) are the same, only rank speeds and capacities differ.
  CostModel homogeneous_view() const;
  // This cost model pricing a micro-batch of a step of several: options().accumulating_gradients
  // on, everything else the same.
  CostModel accumulating_view() const;

  // Peak bytes of a rank over its step: the maximum over the backward's progress (layer j's
  // backward holds the kept activations of layers below j, its own full activations (recomputed
  // around what it kept, if checkpointed), one layer's buffers and the gradients of the layers
  // above j), or the end of the backward (every
  // gradient, no activation). Per-layer sums of the rank's shares; the first
  // `checkpointed_layers` layers keep only their checkpoint, and the first `full_layers` of
  // those only their input (layer_input_bytes; full recompute).
  double rank_peak_bytes(double layer_activation_bytes, double layer_checkpoint_bytes,
                         double buffer_bytes, int64_t checkpointed_layers) const;
  // With the profile's reduce rows (HardwareProfile::reduce_fixed_bytes), the step has a second
  // peak moment, right after the backward of each layer of the model's largest kind (an MMDiT's
  // double-stream blocks; every layer of a uniform model): that layer's gradients being reduced
  // (reduce_fixed_bytes in place of the step's fixed bytes), the kept activations of the layers
  // below it, the gradients of the layers above, and reduce_bytes_per_token per `held_tokens`
  // (the rank's tokens). It is the peak of small ranks, where gradients outweigh activations.
  // With the profile's backward_peak_bytes table, the backward's fixed bytes and buffers of a
  // rank of `held_tokens` come from it (measured at several token counts) instead of the rows'
  // line through two (held_tokens 0: the rows).
  double rank_peak_bytes(double layer_activation_bytes, double layer_checkpoint_bytes,
                         double layer_input_bytes, double buffer_bytes,
                         int64_t checkpointed_layers, int64_t full_layers,
                         int64_t held_tokens = 0) const;
  // Seconds of the per-token layers' recompute of all layers (the part of linear_time_s that
  // activation checkpointing adds; 0 without it).
  double linear_recompute_s(int64_t tokens) const;

  // A rank's time from its totals: linear_time_s(tokens) + attention_s + exchange_s, on the
  // profile's device (speed 1).
  double rank_time_s(int64_t tokens, double attention_s, double exchange_s) const;

  // Every rank's time and peak memory under `plan`, plus makespan, exchange bytes and fit.
  // Throws std::invalid_argument if the plan does not match the batch (see validate_plan).
  // Two terms depend on a rank's other sequences, so the planners' additive shares leave them
  // out. Attention calls: a call of few heads is slower per head than the full calls of the
  // per-head tables (the profile's call tables), and each share prices its segments as calls of
  // their own; the engine runs every group of equal (query length, key length, heads) segments
  // of a rank as one call, and call_s gives back what that saves. The launch floor: a rank is
  // not done before its host has issued its kernels (launch_floor_s). A rank's attention with
  // call_s is the per-head tables' time plus each actual call's excess (never negative), and
  // the floor only adds, so makespan_lower_bound stays a bound. Under profile.attention_ragged
  // a rank's table that the engine runs as one ragged call (HardwareProfile::attention_ragged)
  // pays no call's excess and no streams, and is one call in the launch floor.
  // Unlike ranks: every term of a rank's time (launch floor and exchanges included) is divided
  // by its speed (Cluster::speed_of), since a measured speed factor is the ratio of whole step
  // times; each rank's peak is checked against its own memory_capacity_bytes(rank).
  PlanCost evaluate(const Batch& batch, const Plan& plan) const;
  // The same, memoised in `cache` (see EvaluationCache).
  PlanCost evaluate(const Batch& batch, const Plan& plan, EvaluationCache& cache) const;
  // A lower bound on evaluate(batch, plan).makespan_s that skips the grouping of attention calls
  // and the launch floor: every rank's additive time minus the whole call excess of its shares
  // (what grouping could give back at most), and under adaptive checkpointing minus every
  // layer's recompute (what skipping it could give back). Cheap, for planners that compare many
  // plans. Each rank's floor is divided by its speed, as in evaluate. The
  // plan must be valid for the batch (not re-checked).
  // With `recompute_floor_s`, also a tighter floor there: each rank charged the recompute its
  // memory forces (the fewest checkpointed and fully recomputed layers that fit, as evaluate
  // picks them, the most of any rank's on every rank where a Ulysses placement makes the
  // recompute's exchange span the world).
  double makespan_floor(const Batch& batch, const Plan& plan, EvaluationCache& cache,
                        double* recompute_floor_s = nullptr) const;
  // What makespan_floor adds for `placement`, summed over its ranks, with the per-token layers
  // charged at min_floor_time_per_token_s(): a plan's floor is at least the sum of this over its
  // placements divided by the total speed (the rank count on a homogeneous cluster), whichever
  // ranks they use (the shares depend on the ranks only through which share a node).
  double floor_rank_seconds(const Sequence& sequence, const Placement& placement,
                            EvaluationCache& cache) const;
  // makespan_floor by parts, for planners that total ranks themselves (same values, bit for bit):
  // per position of `placement`, the tokens, the seconds it adds to the rank (`added_s`) and,
  // under adaptive checkpointing only, the seconds it then takes back (`skipped_s`); and the
  // floor of per-rank totals so summed.
  // For the recompute floor, also the share's memory per layer (activation, checkpoint, layer
  // input, buffer bytes), the recompute it skips or pays per layer count (`recompute_s`, and
  // `full_recompute_s` of its attention), its attention phase (0 local, 1 Ulysses, 2 ring) and
  // whether its placement uses Ulysses (the recompute's exchange then spans the world).
  struct FloorTerm {
    int64_t tokens = 0;
    double added_s = 0, skipped_s = 0;
    std::array<double, 4> bytes = {0, 0, 0, 0};
    double recompute_s = 0, full_recompute_s = 0;
    int32_t phase = 0;
    bool ulysses = false;
  };
  void floor_terms(const Sequence& sequence, const Placement& placement, EvaluationCache& cache,
                   std::vector<FloorTerm>* terms) const;
  // Per rank (index = rank): its floor divided by its speed; the largest.
  double floor_of_totals(const std::vector<int64_t>& tokens,
                         const std::vector<double>& other_s) const;
  // makespan_floor's per-rank memory sums for its recompute floor (index = rank).
  struct RecomputeTotals {
    std::vector<std::array<double, 4>> bytes;  // activation, checkpoint, input, buffer
    std::vector<std::array<double, 3>> phase_tokens;
    std::vector<double> recompute_s, full_recompute_s;
    bool world_exchange = false;
    void reset(int64_t num_ranks);
    void add(int64_t rank, const FloorTerm& term);
  };
  // makespan_floor's recompute floor from the per-rank totals (`other_s` is charged the
  // recompute) and its first floor `floor_s`; `floor_s` without activation checkpointing.
  double recompute_floor_of_totals(const std::vector<int64_t>& tokens, std::vector<double>& other_s,
                                   const RecomputeTotals& totals, double floor_s) const;
  // The smallest per-token time of the per-token layers as makespan_floor charges them (under
  // adaptive checkpointing without their recompute), over any token count.
  double min_floor_time_per_token_s() const;

  // The largest memory_bytes of any share of a placement of `sequence` with these degrees, as
  // shares() gives them (memory does not depend on which ranks): O(1), not O(degree), so that
  // sizing a sequence over every degree up to thousands stays linear in the degrees.
  double max_share_memory_bytes(const Sequence& sequence, int64_t ulysses_degree,
                                int64_t ring_degree) const;

  // Bytes the ranks of `placement` send in total per step (all layers, forward + backward, plus
  // routing the sequence's tokens from its source rank and back).
  double exchange_bytes(const Sequence& sequence, const Placement& placement) const;

 private:
  struct Shape;      // one sequence under (ulysses_degree, ring_degree): two block sizes
  struct RankTerms;  // what one rank of a shape pays
  Shape make_shape(int64_t unit_tokens, int64_t text_tokens, int64_t ulysses_degree,
                   int64_t ring_degree, bool price_calls = true) const;
  RankTerms rank_terms(const Shape& shape, int block_class, int next_block_class,
                       int64_t chunk_tokens, int64_t heads, bool ulysses_intra_node,
                       bool ring_intra_node) const;
  // Calls visit(share, sent_bytes) for each position of `placement` in order (share.rank set),
  // or, with `distinct_only`, for at least one position of each distinct share (see
  // busiest_share_s), in O(1) per ring of one Ulysses rank rather than O(ranks).
  // A rank's backward buffers where only its largest attention phase's exist at once (tokens
  // held per phase: local, Ulysses-exchanged, ring).
  double phase_buffer_bytes(double buffer_bytes, const std::array<double, 3>& phase_tokens) const;
  // (checkpointed layers, fully recomputed layers) of one rank, as evaluate picks them before
  // the world-wide coupling.
  std::pair<int64_t, int64_t> rank_checkpointing(double activation_bytes, double checkpoint_bytes,
                                                 double input_bytes, double buffer_bytes,
                                                 int64_t tokens, double capacity_bytes) const;
  template <typename Visit>
  void visit_shares(const Sequence& sequence, const Placement& placement, bool distinct_only,
                    Visit&& visit) const;
  std::vector<RankShare> shares_and_bytes(const Sequence& sequence, const Placement& placement,
                                          double* sent_bytes) const;
  EvaluationCache::Entry& cached_terms(const Sequence& sequence, const Placement& placement,
                                       EvaluationCache& cache) const;
  // Lists entry.calls (see EvaluationCache::Entry) if not yet.
  void list_calls(const Sequence& sequence, const Placement& placement,
                  EvaluationCache::Entry* entry) const;
  EvaluationCache::Entry& find_entry(const Sequence& sequence, const Placement& placement,
                                     EvaluationCache& cache, bool* inserted) const;
  void fill_entry(const Sequence& sequence, const Placement& placement,
                  EvaluationCache::Entry* entry) const;
  PlanCost evaluate_impl(const Batch& batch, const Plan& plan, EvaluationCache* cache) const;
  double head_forward_s(double query_tokens, double key_tokens) const;
  double head_backward_s(double query_tokens, double key_tokens) const;
  double text_projection_s(int64_t text_tokens) const;          // fwd + bwd (+ recompute)
  double text_projection_forward_s(int64_t text_tokens) const;  // one forward pass
  using CallKey = cost_detail::CallKey;
  using RankCall = cost_detail::RankCall;
  // The engine's tables that run as one ragged call under profile.attention_ragged
  // (runtime/attention.py): 0 a rank's local self- or joint attention (whole sequences, every
  // head), 1 its Ulysses-exchanged sequences, 2 its cross-attention; -1 a ring step (its own
  // calls, never ragged).
  static constexpr int kRaggedKinds = 3;
  int ragged_kind(const CallKey& key) const;
  // Per kind, whether a rank with these calls (sorted by key) runs that table as one ragged
  // call: attention_ragged, two or more distinct calls, one head count (the engine's
  // coalesced._ragged_choice; a rank's tables are disjoint).
  std::array<bool, kRaggedKinds> ragged_tables(std::vector<RankCall>::const_iterator first,
                                               std::vector<RankCall>::const_iterator last) const;
  // Appends one RankCall per segment (rank: placement.ranks[position]) but the ring steps',
  // which it counts per rank in `ring_step_calls` (indexed by rank).
  void add_attention_calls(const Sequence& sequence, const Placement& placement,
                           std::vector<RankCall>* calls,
                           std::vector<int64_t>* ring_step_calls) const;
  // The calls of one position (j in the ring, k in the Ulysses group), one per segment. With
  // `ring_step_calls`, the ring steps' calls are counted there instead of listed (O(1), not r).
  void position_calls(const Sequence& sequence, const Placement& placement, int64_t j, int64_t k,
                      std::vector<CallKey>* keys, int64_t* ring_step_calls = nullptr) const;
  // Forward + backward seconds per head and layer that a call of `call_heads`
  // heads costs beyond the full-call rate; never negative, 0 without call tables.
  double call_excess_per_head_s(double query_tokens, double key_tokens, double call_heads) const;
  // The same with head_forward_s and head_backward_s of (query_tokens, key_tokens) given.
  double call_excess_per_head_s(double query_tokens, double key_tokens, double call_heads,
                                double forward_s, double backward_s) const;
  friend struct LowerBoundSearch;  // makespan_lower_bound's candidate search (lower_bound.cc)

  // A profile table in log space: a lookup costs one log and one exp (planners' hot path).
  struct LogTable {
    std::vector<double> log_x, log_y, slope;
    LogTable() = default;
    explicit LogTable(const Table& table);
    bool empty() const { return log_x.empty(); }
    double operator()(double at) const;    // as Table::operator()
    double held(double at) const;          // constant outside the sampled range
    double log_held(double log_at) const;  // log(held(exp(log_at)))
  };

  ModelSpec model_;
  HardwareProfile profile_;
  Cluster cluster_;
  CostOptions options_;
  // Derived once in the constructor.
  double forward_flops_per_token_ = 0;  // per-token layers, one layer
  double activation_bytes_ = 0;         // per token per layer, kept without checkpointing
  double checkpoint_bytes_ = 0;         // per token per layer, kept with checkpointing
  double backward_bytes_ = 0;           // per token, one layer's backward transient (0: analytic)
  double ulysses_bytes_ = 0;            // per held token of a Ulysses shard (0: analytic)
  double ulysses_exchanged_bytes_ = 0;  // per held token and share exchanged beyond 2 ranks'
  double ring_bytes_ = 0;               // per held token of a ring shard (0: analytic)
  double attention_phase_bytes_ = 0;    // per held token outside a rank's largest phase (0: none)
  double text_bytes_ = 0;               // per text token per layer, cross-attention (0: none)
  double launch_s_per_layer_ = 0;       // the model's launch floor terms (0: none)
  // The most that running a cross-attention table's calls on the profile's streams can save, as
  // a share of their seconds: overlap * (1 - 1/streams) (the most loaded stream holds at least
  // 1/streams of them). The floors take it off; 0 with one stream.
  double stream_gain_bound_ = 0;
  double launch_s_per_call_ = 0;
  double fixed_bytes_ = 0;
  double step_fixed_bytes_ = 0;         // the backward peak's part of fixed_bytes_
  double reduce_fixed_bytes_ = 0;       // in its place at a largest layer's reduction (0: none)
  double reduce_bytes_per_token_ = 0;   // per held token at that moment
  Table backward_peak_;                 // the model's measured backward peak (empty: the rows)
  // What the measured backward peak of a rank of `tokens` adds to the rows' line
  // (step_fixed_bytes_ + tokens x backward_bytes_); 0 without it.
  double backward_peak_correction(double tokens) const;
  double gradient_bytes_ = 0;           // the gradients within fixed_bytes_
  double optimizer_peak_bytes_ = 0;     // the optimizer step's: state, copies, runtime reserve
  double layer_gradient_bytes_ = 0;     // one block's gradients (they appear layer by layer)
  double layer_weight_bytes_ = 0;       // one block's gathered weights (bytes_per_element each)
  double min_linear_time_per_token_s_ = 0;
  LogTable attention_forward_, attention_backward_, matmul_forward_, matmul_backward_;
  // The profile's call tables: log of the per-head slowdown against the largest call measured.
  std::vector<double> call_log_lengths_;
  std::vector<LogTable> call_forward_, call_backward_;
  double call_log_slowdown(const std::vector<LogTable>& tables, double length, double heads) const;
  // The same from log(length) and log(heads).
  double call_log_slowdown_at(const std::vector<LogTable>& tables, double log_length,
                              double log_heads) const;
};

// A lower bound on the makespan of ANY placement of the batch under this cost model:
//   max( max over sequences of the smallest possible bottleneck-rank time of that sequence alone,
//        (sum over sequences of the smallest total rank-seconds of that sequence) / num_ranks ),
// with per-token layers charged at min_linear_time_per_token_s and attention at the per-head
// tables without any call's excess (see evaluate). Both terms only drop work, so no plan can
// beat it.
// Derivation: a rank's time is linear_time_s(its tokens) plus the attention and exchange of each
// share it holds, and linear_time_s(m) >= m * min_linear_time_per_token_s, so a rank's time is at
// least the sum of its shares charged that way. The makespan is >= the time of the bottleneck
// rank of any one sequence's placement (first term) and >= the mean rank time (second term).
// Candidates per sequence: every shape (u, r) with u * r <= min(num_ranks, unit tokens) and
// u <= num_heads, charged with the best links any rank set of that shape can have (Ulysses group
// in one node iff u <= gpus_per_node, ring in one node iff r <= gpus_per_node: node-packed
// contiguous ranks for local / ulysses / ring); a shape counts only if every rank's share fits in
// memory next to fixed_bytes (a sequence that fits nowhere counts every shape). Balanced splits
// take at most two block sizes, chunk sizes and head counts, so a shape has at most 12 distinct
// rank types and costs O(1). The rank-seconds search stops at the first ring degree r whose
// bound (attention areas at the best per-area rate of blocks of at most ceil(L/r) tokens, text
// projections and ring latencies on >= r ranks; non-decreasing in r) reaches the best found; the
// bottleneck term skips a sequence whose time under the current maximum's shape is already below
// that maximum.
// Then tightened: a plan of makespan T gives every sequence a shape whose bottleneck is <= T, and
// all rank-seconds fit into num_ranks x T; so the bound is the largest T (bisection, from the
// bound above) at which sum over sequences of (min rank-seconds over shapes with bottleneck <= T)
// still exceeds num_ranks x T. Runs in milliseconds for 1024 ranks x 4096 sequences of bucketed
// batches (tens of ms with the terms below).
// Three terms of evaluate() that the above leaves out are added where they are certain:
// - call excess: a ring step's segment is always a call of its own (it pays its excess exactly);
//   a segment without ring, or a cross-attention segment, can share its call only with equal
//   segments of other sequences (at most one per sequence of the same length, or text length),
//   so it pays at least the least excess per head over that range of call sizes;
// - launch floor: a share's rank issues at least that share's own distinct calls, so its time is
//   at least their launch floor (bottleneck only: the floor is a max, not a sum over shares);
// - per-token rate: in a plan of makespan T no rank holds more tokens than T / (the least
//   per-token time), so its per-token layers run at most at the GEMM rates reached up to that
//   count (not under adaptive checkpointing, which may skip their recompute).
// Last, for small clusters and batches (<= 64 ranks, (distinct lengths) x ranks <= 8192), whole
// shares: a rank holds shares summing to at most T, so any dual feasible function of bin packing
// summed over all shares (as fractions of T) is at most the rank count; a Lagrangian relaxation
// of that constraint next to the capacity one raises the bound where sequences must take whole
// ranks.
// Unlike ranks (Cluster::rank_speeds, rank_memory_bytes): the same in nominal seconds (speed 1)
// of a makespan M = T x the fastest speed, with total speed / fastest speed ranks in the capacity
// term (a rank of speed v runs v x T nominal seconds in T), every bottleneck on the fastest rank,
// and a shape fitting if it fits the largest rank memory; the whole-share part is left out
// (its bins are equal). The bound is M / fastest.
double makespan_lower_bound(const Batch& batch, const CostModel& cost_model);

}  // namespace zellige
