// Hardware profile: measured (or analytic) time tables, read from the profile JSON in Python.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace zellige {

// Physical ranges of a profile's values (README, "Limits"), checked by HardwareProfile::validate.
// Wide enough for any GPU or CPU, narrow enough that a typo such as 1e-300 or 1e308 is refused
// instead of turning predictions into inf or NaN. Predictions are checked for finiteness too
// (tables extrapolate along their end segments), where they are made.
inline constexpr double kMinRatePerS = 1e6;       // FLOP/s and bytes/s, rates and rate tables
inline constexpr double kMaxRatePerS = 1e18;
inline constexpr double kMinTableSeconds = 1e-9;  // times in the attention and exchange tables
inline constexpr double kMaxTableSeconds = 1e6;
inline constexpr double kMaxTableX = 1e15;        // tokens, heads or bytes; at least 1
inline constexpr double kMaxLaunchSeconds = 1.0;  // host time per layer or per attention call
inline constexpr double kMaxLayoutSecondsPerByte = 1e-6;
inline constexpr double kMaxBytesPerToken = 1e9;  // per-model memory rows, per token (and layer)
inline constexpr double kMaxProfileBytes = 1e15;  // step_fixed_bytes, runtime_reserved_bytes
inline constexpr int64_t kMaxHeadDim = 65536;

// y(x) sampled at increasing x > 0, interpolated linearly in log-log space and extrapolated along
// the end segments. `source` says how the samples were obtained: "measured", "seeded" (copied
// from published measurements, not yet re-measured by `zellige profile`) or "analytic".
struct Table {
  std::vector<double> x;
  std::vector<double> y;
  std::string source = "analytic";

  bool empty() const { return x.empty(); }
  // Throws std::invalid_argument if sizes differ, x is not strictly increasing, or x/y <= 0.
  void validate(const std::string& name) const;
  double operator()(double at) const;
};

struct HardwareProfile {
  std::string device_name;
  std::string created;  // date, library versions: free text for people
  // Analytic fallbacks used where a table below is empty.
  double matmul_flops_per_s = 0;     // dense bf16 GEMM rate at large sizes
  double attention_flops_per_s = 0;  // dense attention rate at long lengths
  double memory_bytes_per_s = 0;     // device copy bandwidth (read + write)

  // Attention of ONE head of dimension attention_head_dim over a length-L segment (L x L), as run
  // inside the engine's coalesced call; seconds. x = L.
  int64_t attention_head_dim = 128;
  Table attention_forward_s_per_head;
  Table attention_backward_s_per_head;
  // Optional, measured together (all empty = not modelled): GPU seconds of ONE coalesced
  // attention call over L = attention_call_lengths[i] tokens (increasing) by the total heads H it
  // holds (x = H = segments x heads per segment), forward and backward. Only their shape in H is
  // used: a call of few heads (a Ulysses shard, a lone sequence) runs slower per head than the
  // largest call measured at that length, which is what the per-head tables above describe.
  std::vector<double> attention_call_lengths;
  std::vector<Table> attention_call_forward_s;
  std::vector<Table> attention_call_backward_s;
  // Dense GEMM throughput (FLOP/s) against the token count M of the per-token layers. x = M.
  Table matmul_forward_flops_per_s;
  Table matmul_backward_flops_per_s;
  // All-to-all time inside one node by bytes each rank sends (x = bytes), per group size;
  // optional, the cluster's alpha-beta links are used when empty.
  std::vector<int64_t> exchange_group_sizes;
  std::vector<Table> exchange_intra_node_s;
  // Fraction of a rank's exchange time hidden behind its local attention (0 until measured).
  double exchange_overlap = 0.0;
  // Seconds per byte a rank sends in Ulysses exchanges that the engine spends laying rows out
  // around them (send buffers, the call's head layout and back), on the rank's compute; 0 = not
  // modelled.
  double ulysses_layout_s_per_byte = 0.0;
  // The same for ring k/v (and dk/dv) messages: gathering the ring rows into their compact
  // layout and back, and merging each step's partial output or gradients; 0 = not modelled.
  double ring_layout_s_per_byte = 0.0;
  // Memory: bytes per token per layer kept for backward with and without activation
  // checkpointing (selective: the layer input and its attention outputs o and lse), per model
  // preset name; 0 = analytic.
  std::vector<std::string> memory_models;
  std::vector<double> activation_bytes_per_token_layer;
  std::vector<double> checkpoint_bytes_per_token_layer;
  // Optional (empty, or one per memory model; 0 = analytic): peak bytes per token, beyond the
  // kept activations, while one layer runs its backward (gradient buffers, attention workspace).
  // Replaces the analytic q/k/v/o buffer term of the cost model's memory.
  std::vector<double> backward_bytes_per_token_layer;
  // Optional likewise: bytes per TEXT token that one cross-attention layer adds to the peak (text
  // keys/values, their norms and backward buffers); charged per sequence on each of its ranks,
  // for one layer under activation checkpointing (the recompute) and every layer without (an
  // over-estimate there: backward buffers exist for one layer only). 0 = none.
  std::vector<double> text_bytes_per_token_layer;
  // Optional likewise (0 = analytic: two gathered bf16 layers and one layer's fp32 gradients):
  // the step's bytes above the FSDP shard that do not grow with tokens, measured at the backward
  // peak of the model's blocks sharded as in training (gathered and prefetched weights, weight
  // gradients, reduce-scatter buffers).
  std::vector<double> step_fixed_bytes;
  // Optional likewise (0 = not modelled): the step's other peak moment, right after the backward
  // of a block of the model's largest kind (an MMDiT's double-stream block, twice a single one's
  // weights), while its unsharded bf16 and fp32 gradients and reduce-scatter buffers are alive
  // and the block's activations are gone. Bytes above the FSDP shard that do not grow with tokens
  // (in place of step_fixed_bytes), and per held token (inputs, input gradients; the kept
  // activations of the layers below are added by the cost model). Measured at small token
  // counts, where this moment is the peak: above a few thousand tokens the backward's peak
  // (step_fixed_bytes + per-token rows) is higher, below it this one.
  std::vector<double> reduce_fixed_bytes;
  std::vector<double> reduce_bytes_per_token;
  // Optional likewise (0 = analytic): bytes per held token that a Ulysses (ring) shard adds to
  // the step's peak beyond a local sequence of as many tokens (exchange buffers, head layouts;
  // may be negative where the shard's attention needs less workspace than a whole sequence's).
  // Replace the analytic q/k/v send-and-receive (k/v double buffer) term.
  std::vector<double> ulysses_bytes_per_token;
  std::vector<double> ring_bytes_per_token;
  // Optional likewise (0 = none): ulysses_bytes_per_token is measured over 2 ranks, where a shard
  // exchanges half of its q/k/v/o and their gradients; a group of u ranks exchanges (u - 1) / u
  // of them. Bytes per held token and per share exchanged, so that a shard of a group of u adds
  // ulysses_bytes_per_token + ulysses_exchanged_bytes_per_token * ((u - 1) / u - 1/2); measured
  // from a second shard over more ranks.
  std::vector<double> ulysses_exchanged_bytes_per_token;
  // Optional likewise (0 = none): bytes per held token of the attention backward's buffers (the
  // kernels' gradients of q, k, v and their workspace) that the rows above charge for every
  // token, as they are measured on packs whose attention is one phase, but that exist for one
  // phase at a time: a rank's attention backward runs its local sequences' calls, then those of
  // the sequences Ulysses exchanged, then the ring steps (runtime/attention.py), each phase
  // freeing its buffers before the next. The cost model takes this row x the held tokens outside
  // the rank's largest phase off the rank's backward buffers. Measured from a shard beside a
  // local sequence against one shard of both (`zellige profile --memory-only`).
  std::vector<double> attention_phase_bytes_per_token;
  // Optional likewise (0 = not modelled): host seconds to issue one layer's kernels (forward,
  // recompute, backward) apart from its attention calls, and per attention call (self or cross)
  // and layer, for the model's blocks. A rank whose GPU work is shorter waits for its host:
  // CostModel::evaluate's launch floor.
  std::vector<double> launch_s_per_layer;
  std::vector<double> launch_s_per_attention_call;
  // Optional likewise (empty, or one table per memory model; an empty table = the shared
  // matmul_*_flops_per_s above): the per-token layers' rates measured on that model's own
  // blocks, double- and single-stream blocks of an MMDiT mixed in the model's proportion. The
  // shared tables then serve the models without a table of their own.
  std::vector<Table> model_matmul_forward_flops_per_s;
  std::vector<Table> model_matmul_backward_flops_per_s;
  // Optional likewise (empty, or one table per memory model; an empty table = the rows alone):
  // x = held tokens of a local pack, y = bytes the step holds at the backward's peak beyond the
  // layers' kept activations (its fixed bytes and one layer's backward buffers), measured at
  // several packs. Replaces step_fixed_bytes + x * backward_bytes_per_token_layer for a rank of
  // x tokens, read LINEARLY between the packs and along the end segments beyond them: the peak
  // is convex in tokens (the moment of the layer's backward it comes from changes with them),
  // so two packs' line errs above between them and below outside.
  std::vector<Table> backward_peak_bytes;
  int64_t runtime_reserved_bytes = 0;  // CUDA context, workspaces, allocator slack
  // The measured GPU's memory (torch's total_memory), which the cluster's memory capacity
  // defaults to under this profile (costs.make_cost_model); 0: not recorded (140 GiB assumed).
  int64_t device_memory_bytes = 0;
  // CUDA streams the attention engine spreads one table's calls over (runtime/coalesced.py
  // _for_each_group; the device's call table says how many), and the measured share of the ideal
  // gain that concurrency delivers: a rank whose calls, assigned to streams as the engine assigns
  // them (stream_assignment: most work first, to the least loaded), load its streams at
  // L_1..L_S seconds runs them in sum(L) - attention_stream_overlap * (sum(L) - max(L)). 1 and 0
  // (the defaults): calls priced as run one after another. Measured by `zellige profile`
  // (profiler/attention_calls.py measure_stream_overlap) on a pack of many lengths.
  int64_t attention_streams = 1;
  double attention_stream_overlap = 0.0;
  // Whether the engine on this machine runs a disjoint table of two or more dense calls with one
  // head count as ONE ragged call (runtime/coalesced.py _ragged_choice: the cuDNN frontend
  // installed and checked). The cost model then prices such a table of a rank (its local self- or
  // joint attention, its Ulysses-exchanged sequences, its cross-attention; never ring steps) at
  // the per-head tables with no call's excess and no streams, and as one call in the launch
  // floor (CostModel::evaluate). false (the default): the engine's dense calls.
  bool attention_ragged = false;

  // Every non-empty table valid, every value inside the ranges above; throws
  // std::invalid_argument naming the field, the value and the allowed range.
  void validate() const;
};

// A profile with no tables: every time comes from the three peak rates. The built-in H200
// profile is package data (src/zellige/profiles/h200.json), read by zellige.load_profile().
HardwareProfile analytic_profile(const std::string& device_name, double matmul_flops_per_s,
                                 double attention_flops_per_s, double memory_bytes_per_s);

}  // namespace zellige
