// The expert-parallel layers from C++ (include/qmoe/expert_parallel_layer.h): payload rows at home, a
// dispatch, moe_expert_rows on the owner, a combine, moe_finalize at home through a row index. Low
// latency: fixed-size exchanges, no host sync. Throughput: the host plan (expert_parallel.h), counts
// first, then variable-size exchanges of only what a peer needs. Data movement is copies (2D memcpy /
// memset on CUDA, memcpy on the CPU) plus three tiny kernels (src/cuda/ep/ep_layer_kernels.cu): the
// low-latency row index, the broadcast of a per-tensor a1 into the payload rows, the row gather.
// With deterministic = false the owners finalize their own slots and the combine carries one partial
// row per (token, owner) instead of one row per slot (the reduced combine; fewer bytes, not bitwise
// equal to one GPU: the header says how).
#include "qmoe/expert_parallel_layer.h"

#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "cuda/common/device_guard.h"
#include "cuda/launch.h"
#include "qmoe/expert_parallel.h"
#include "qmoe/formats.h"
#include "qmoe/tactics.h"
#include "reference/out_element.h"

namespace qmoe::ep {

namespace {

constexpr int64_t kRowAlign = 16;    // payload rows stay 16-byte aligned
constexpr int64_t kSpanAlign = 256;  // workspace spans, as cudaMalloc aligns

int64_t round_up(int64_t v, int64_t a) { return (v + a - 1) / a * a; }

// One per-token tensor that travels: its home source (rows `pitch` bytes apart; pitch 0 = a [1] value
// broadcast to every row, only for the w4a8_int4 a1) and its place in the payload row.
struct Part {
  DType dtype;
  int64_t row_elems;  // stored elements per token (the receiver's tensor is [W*C, row_elems])
  int64_t row_bytes;
  int64_t offset = 0;  // in the payload row
  const void* src = nullptr;
  int64_t pitch = 0;
};

struct Plan {
  int64_t tokens, topk, hidden, capacity, world, row_bytes;
  // x, then its scales (w4a8_int4: a1 per row), per_token_scale, topk_weights (reduced combine only),
  // topk_ids (last)
  std::vector<Part> parts;
  bool quantize_x = false, dynamic_a1 = false;  // w4a8_int4 with a bf16 x: quantized at home
  bool reduce = false;        // deterministic == false: owners finalize, partial rows come back
  DType partial = DType::kBFloat16;  // the partial rows' dtype: the output's
  int64_t partial_bytes = 0;  // bytes of one partial row (H elements)
};

Part part_of(const TensorRef& t, int64_t tokens) {
  const int64_t elems = tokens > 0 ? t.numel() / tokens : (t.ndim == 2 ? t.size(1) : 1);
  return Part{t.dtype, elems, elems * dtype_size(t.dtype)};
}

Plan make_plan(const FusedMoeParams& p, int world_size, int64_t capacity) {
  Plan plan;
  plan.tokens = p.topk_ids.size(0);
  plan.topk = p.topk_ids.size(1);
  plan.hidden = p.w2.size(1);
  plan.capacity = capacity;
  plan.world = world_size;
  if (p.quant_mode == QuantMode::kW4A8Int4) {
    plan.quantize_x = p.x.dtype == DType::kBFloat16;
    plan.dynamic_a1 = !p.x_scale.has_value();
    plan.parts.push_back(Part{DType::kFloat8E4M3, plan.hidden, plan.hidden});
    plan.parts.push_back(Part{DType::kFloat32, 1, 4});  // a1 of the token's home, per row
  } else {
    plan.parts.push_back(part_of(p.x, plan.tokens));
    if (p.x_scale) plan.parts.push_back(part_of(*p.x_scale, plan.tokens));
    if (p.per_token_scale) plan.parts.push_back(Part{DType::kFloat32, 1, 4});
  }
  plan.reduce = !p.deterministic;
  plan.partial = p.output.dtype;
  plan.partial_bytes = plan.hidden * dtype_size(p.output.dtype);
  if (plan.reduce) plan.parts.push_back(Part{DType::kFloat32, plan.topk, 4 * plan.topk});
  plan.parts.push_back(Part{DType::kInt32, plan.topk, 4 * plan.topk});
  int64_t offset = 0;
  for (Part& part : plan.parts) {
    part.offset = offset;
    offset += part.row_bytes;
  }
  plan.row_bytes = round_up(offset, kRowAlign);
  return plan;
}

// Workspace spans (CUDA: carved from the caller's buffer; CPU: one host vector).
struct Spans {
  int64_t xq, a1, send, recv, received, weights, rows, back, row_index, engine, total;
  std::vector<int64_t> received_part;  // offset of each part's [W*C, ...] tensor inside `received`
};

// The owner's engine call over `received` tokens whose payload parts lie at part_data[i] ([received,
// row_elems] each). topk_weights: the received part with the reduced combine, else `weights`, an
// unread [received, k] f32 tensor (checked, never read by moe_expert_rows).
FusedMoeParams owner_params_at(const FusedMoeParams& moe, const Plan& plan, int64_t received,
                               const std::vector<uint8_t*>& part_data, void* weights) {
  const Device device = moe.x.device;
  const int index = moe.x.device_index;
  auto tensor = [&](void* data, DType dtype, int64_t cols) {  // [received, cols]
    return make_tensor(data, dtype, {received, cols}, device, index);
  };
  auto vector = [&](void* data) {  // a per-row fp32 value: [received]
    return make_tensor(data, DType::kFloat32, {received}, device, index);
  };
  FusedMoeParams o = moe;
  size_t i = 0;
  o.x = tensor(part_data[i], plan.parts[i].dtype, plan.parts[i].row_elems);
  ++i;
  if (moe.quant_mode == QuantMode::kW4A8Int4) {
    o.x_scale = vector(part_data[i]);
    ++i;
  } else {
    if (moe.x_scale) {
      o.x_scale = tensor(part_data[i], plan.parts[i].dtype, plan.parts[i].row_elems);
      ++i;
    }
    if (moe.per_token_scale) {
      o.per_token_scale = vector(part_data[i]);
      ++i;
    }
  }
  if (plan.reduce) {
    weights = part_data[i];
    ++i;
  }
  o.topk_ids = tensor(part_data[i], DType::kInt32, plan.topk);
  o.topk_weights = tensor(weights, DType::kFloat32, plan.topk);
  o.aux_stream = nullptr;  // the owner's output is the layer's scratch: zeroed on the layer's stream
  return o;
}

// The low-latency owner call: its parts in the workspace; `base` = the workspace base (or any
// non-null address when only sizes are wanted).
FusedMoeParams owner_params(const LowLatencyLayer& l, const Plan& plan, const Spans& s, uint8_t* base) {
  std::vector<uint8_t*> parts;
  for (int64_t offset : s.received_part) parts.push_back(base + s.received + offset);
  return owner_params_at(l.moe, plan, plan.world * plan.capacity, parts, base + s.weights);
}

// The owner's result: one bf16 row per slot [W*C*k, H], or with the reduced combine one partial row per
// token [W*C, H] (the owner's fused_moe output).
TensorRef rows_tensor(const LowLatencyLayer& l, const Plan& plan, uint8_t* base, int64_t offset) {
  const int64_t received = plan.world * plan.capacity;
  if (plan.reduce)
    return make_tensor(base + offset, plan.partial, {received, plan.hidden}, l.moe.x.device, l.moe.x.device_index);
  return make_tensor(base + offset, DType::kBFloat16, {received * plan.topk, plan.hidden}, l.moe.x.device,
                     l.moe.x.device_index);
}

// The owner's engine: per-slot rows, or its own finalize into the partial rows (reduced combine).
void run_owner(FusedMoeParams owner, const Plan& plan, const TensorRef& rows, void* workspace, int64_t bytes,
               cudaStream_t stream) {
  const bool cuda = owner.x.is_cuda();
  if (plan.reduce) {
    owner.output = rows;
    if (cuda)
      fused_moe(owner, workspace, bytes, stream);
    else
      fused_moe(owner);
  } else if (cuda) {
    moe_expert_rows(owner, rows, workspace, bytes, stream);
  } else {
    moe_expert_rows(owner, rows);
  }
}

int64_t owner_workspace_size(FusedMoeParams owner, const Plan& plan, const TensorRef& rows) {
  if (!plan.reduce) return moe_expert_rows_workspace_size(owner, rows);
  owner.output = rows;
  return fused_moe_workspace_size(owner);
}

// Home, reduced combine: output[t] = sum over d in rank order of partials[row(d, t)] in fp32, rounded
// once. row(d, t) = index[d*T + t] (-1: none), or d*C + t without an index.
void sum_partials(const Plan& plan, const uint8_t* partials, const int32_t* index, const TensorRef& output,
                  cudaStream_t stream) {
  if (output.is_cuda()) {
    cuda::ep_sum_partials(partials, index, plan.world, plan.capacity, output, stream);
    return;
  }
  const int64_t T = output.size(0), H = output.size(1), W = plan.world;
  auto load = [&](int64_t row, int64_t c) {
    return load_out_element(output.dtype, partials + row * plan.partial_bytes, c);
  };
  for (int64_t t = 0; t < T; ++t)
    for (int64_t c = 0; c < H; ++c) {
      float acc = 0.0f;
      for (int64_t d = 0; d < W; ++d) {
        const int64_t row = index != nullptr ? index[d * T + t] : d * plan.capacity + t;
        if (row >= 0) acc += load(row, c);
      }
      store_out_element(output.dtype, output.data, t * H + c, acc);
    }
}

Spans make_spans(const LowLatencyLayer& l, const Plan& plan) {
  Spans s{};
  int64_t at = 0;
  auto take = [&](int64_t bytes) {
    const int64_t here = at;
    at += round_up(bytes, kSpanAlign);
    return here;
  };
  const int64_t received = plan.world * plan.capacity;
  s.xq = take(plan.quantize_x ? plan.tokens * plan.hidden : 0);
  s.a1 = take(plan.dynamic_a1 ? 4 : 0);
  s.send = take(plan.capacity * plan.row_bytes);  // one block: every peer gets the same rows
  s.recv = take(received * plan.row_bytes);
  int64_t parts = 0;
  for (const Part& part : plan.parts) {
    s.received_part.push_back(parts);
    parts += round_up(received * part.row_bytes, kSpanAlign);
  }
  s.received = take(parts);
  const int64_t row_bytes = plan.reduce ? plan.partial_bytes : plan.topk * plan.hidden * 2;
  s.weights = take(plan.reduce ? 0 : received * plan.topk * 4);
  s.rows = take(received * row_bytes);
  s.back = take(received * row_bytes);
  s.row_index = take(plan.reduce ? 0 : plan.tokens * plan.topk * 4);
  s.engine = at;
  s.total = at;
  if (l.moe.x.is_cuda()) {
    uint8_t* fake = reinterpret_cast<uint8_t*>(uintptr_t{1} << 12);  // sizes only: never dereferenced
    s.total += owner_workspace_size(owner_params(l, plan, s, fake), plan, rows_tensor(l, plan, fake, s.rows));
  }
  return s;
}

// rows x width bytes: dst rows dst_pitch apart, src rows src_pitch apart.
void copy_rows(bool cuda, void* dst, int64_t dst_pitch, const void* src, int64_t src_pitch, int64_t width, int64_t rows,
               cudaStream_t stream) {
  if (rows <= 0 || width <= 0) return;
  if (cuda) {
    cuda::check_cuda(cudaMemcpy2DAsync(dst, dst_pitch, src, src_pitch, width, rows, cudaMemcpyDeviceToDevice, stream),
                     "cudaMemcpy2DAsync (expert-parallel payload)");
    return;
  }
  for (int64_t r = 0; r < rows; ++r)
    std::memcpy(static_cast<uint8_t*>(dst) + r * dst_pitch, static_cast<const uint8_t*>(src) + r * src_pitch, width);
}

void fill(bool cuda, void* dst, int value, int64_t bytes, cudaStream_t stream) {
  if (bytes <= 0) return;
  if (cuda) {
    cuda::check_cuda(cudaMemsetAsync(dst, value, bytes, stream), "cudaMemsetAsync (expert-parallel payload)");
    return;
  }
  std::memset(dst, value, bytes);
}

void fill_rows(bool cuda, void* dst, int64_t pitch, int value, int64_t width, int64_t rows, cudaStream_t stream) {
  if (rows <= 0 || width <= 0) return;
  if (cuda) {
    cuda::check_cuda(cudaMemset2DAsync(dst, pitch, value, width, rows, stream), "cudaMemset2DAsync (pad rows)");
    return;
  }
  for (int64_t r = 0; r < rows; ++r) std::memset(static_cast<uint8_t*>(dst) + r * pitch, value, width);
}

// dst row i = src row index[i] (count rows of `width` bytes; index on the tensors' side).
void gather_rows(bool cuda, uint8_t* dst, int64_t dst_pitch, const uint8_t* src, int64_t src_pitch,
                 const int32_t* index, int64_t count, int64_t width, cudaStream_t stream) {
  if (count <= 0 || width <= 0) return;
  if (cuda) {
    cuda::ep_gather_rows(dst, dst_pitch, src, src_pitch, index, count, width, stream);
    return;
  }
  for (int64_t i = 0; i < count; ++i) std::memcpy(dst + i * dst_pitch, src + index[i] * src_pitch, width);
}

// A scratch buffer on the layer's device (stream-ordered cudaMallocAsync, freed the same way) or on
// the host. The throughput layer sizes its buffers from the exchanged counts, so it allocates.
class Buffer {
 public:
  Buffer(bool cuda, int64_t bytes, cudaStream_t stream) : cuda_(cuda), stream_(stream) {
    if (bytes <= 0) return;
    if (cuda) {
      cuda::check_cuda(cudaMallocAsync(&ptr_, static_cast<size_t>(bytes), stream),
                       "cudaMallocAsync (expert parallelism)");
    } else {
      host_.resize(static_cast<size_t>(bytes));
      ptr_ = host_.data();
    }
  }
  ~Buffer() {
    if (cuda_ && ptr_ != nullptr) cudaFreeAsync(ptr_, stream_);
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  uint8_t* data() const { return static_cast<uint8_t*>(ptr_); }

 private:
  bool cuda_;
  cudaStream_t stream_;
  void* ptr_ = nullptr;
  std::vector<uint8_t> host_;
};

// Host <-> layer-side copies of small arrays; to_host waits for the stream (a host sync).
void to_device(bool cuda, void* dst, const void* src, int64_t bytes, cudaStream_t stream) {
  if (bytes <= 0) return;
  if (cuda)
    cuda::check_cuda(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream), "cudaMemcpyAsync");
  else
    std::memcpy(dst, src, bytes);
}
void to_host(bool cuda, void* dst, const void* src, int64_t bytes, cudaStream_t stream) {
  if (bytes <= 0) return;
  if (cuda) {
    cuda::check_cuda(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, stream), "cudaMemcpyAsync");
    cuda::check_cuda(cudaStreamSynchronize(stream), "cudaStreamSynchronize (expert parallelism)");
  } else {
    std::memcpy(dst, src, bytes);
  }
}

std::vector<int64_t> prefix(const std::vector<int64_t>& counts) {  // exclusive, one more entry: the total
  std::vector<int64_t> out(counts.size() + 1, 0);
  for (size_t i = 0; i < counts.size(); ++i) out[i + 1] = out[i] + counts[i];
  return out;
}

// This rank's T payload rows into dst ([T, B], B = plan.row_bytes; padding bytes are left as they
// are): the mode's per-token parts, quantized first for a w4a8_int4 bf16 x (xq: T*H bytes and a1: 4
// bytes of scratch), a per-tensor a1 copied into every row.
void pack_payload(const FusedMoeParams& p, const Plan& plan, uint8_t* xq, uint8_t* a1_scratch, uint8_t* dst, bool cuda,
                  cudaStream_t stream) {
  const int64_t T = plan.tokens, H = plan.hidden, k = plan.topk, B = plan.row_bytes;
  auto ref = [&](void* data, DType dtype, std::initializer_list<int64_t> shape) {
    return make_tensor(data, dtype, shape, p.x.device, p.x.device_index);
  };
  std::vector<Part> parts = plan.parts;
  size_t i = 0;
  if (p.quant_mode == QuantMode::kW4A8Int4) {
    const void* a1 = p.x_scale ? p.x_scale->data : a1_scratch;
    const bool a1_per_row = p.x_scale && p.x_scale->numel() == T && T != 1;
    if (plan.dynamic_a1) fp8_dynamic_scale(p.x, ref(a1_scratch, DType::kFloat32, {1}), stream);
    if (plan.quantize_x) {
      const TensorRef scale = p.x_scale ? *p.x_scale : ref(a1_scratch, DType::kFloat32, {1});
      quantize_fp8(p.x, scale, ref(xq, DType::kFloat8E4M3, {T, H}), stream);
    }
    parts[0].src = plan.quantize_x ? static_cast<const void*>(xq) : p.x.data;
    parts[0].pitch = H;
    parts[1].src = a1;
    parts[1].pitch = a1_per_row ? 4 : 0;
    i = 2;
  } else {
    parts[0].src = p.x.data;
    parts[0].pitch = parts[0].row_bytes;
    i = 1;
    if (p.x_scale) {
      parts[i].src = p.x_scale->data;
      parts[i].pitch = parts[i].row_bytes;
      ++i;
    }
    if (p.per_token_scale) {
      parts[i].src = p.per_token_scale->data;
      parts[i].pitch = 4;
      ++i;
    }
  }
  if (plan.reduce) {  // the owners apply the routing weights
    parts[i].src = p.topk_weights.data;
    parts[i].pitch = 4 * k;
    ++i;
  }
  parts[i].src = p.topk_ids.data;
  parts[i].pitch = 4 * k;
  for (const Part& part : parts) {
    if (part.pitch == 0) {  // a per-tensor a1 in every row of this rank's tokens
      if (cuda)
        cuda::ep_broadcast_f32_rows(static_cast<const float*>(part.src), dst + part.offset, B, T, stream);
      else
        for (int64_t t = 0; t < T; ++t) std::memcpy(dst + t * B + part.offset, part.src, 4);
    } else {
      copy_rows(cuda, dst + part.offset, B, part.src, part.pitch, part.row_bytes, T, stream);
    }
  }
}

// The throughput layer's owner over its N received tokens (payload parts at part_data) into `rows`, with
// a stream-ordered engine workspace; nothing when N == 0.
void run_owner_throughput(const FusedMoeParams& p, const Plan& plan, int64_t N, const std::vector<uint8_t*>& part_data,
                          void* weights, const TensorRef& rows, cudaStream_t stream) {
  if (N == 0) return;
  const bool cuda = p.x.is_cuda();
  const FusedMoeParams owner = owner_params_at(p, plan, N, part_data, weights);
  const int64_t bytes = cuda ? owner_workspace_size(owner, plan, rows) : 0;
  Buffer engine(cuda, bytes, stream);
  run_owner(owner, plan, rows, engine.data(), bytes, stream);
}

// The throughput layer's steps 3-5 with the reduced combine: the owner finalizes its slots of the N
// received tokens into one partial row each and returns them in receive order (no host wait for the
// received routing); home row i of `back` is the partial of token send_tokens[i] from the rank whose
// group holds i, and the partials are summed in rank order.
void combine_reduced(const ThroughputLayer& l, const Plan& plan, int64_t N, const std::vector<uint8_t*>& part_data,
                     const DispatchPlan& dp, const std::vector<int64_t>& recv_tokens, const std::vector<int64_t>& recv_at,
                     const std::vector<int64_t>& send_at, const Exchange& exchange, cudaStream_t stream) {
  const FusedMoeParams& p = l.moe;
  const bool cuda = p.x.is_cuda();
  const int64_t T = plan.tokens, W = plan.world, R = plan.partial_bytes;
  const size_t w = static_cast<size_t>(W);
  Buffer rows(cuda, N * R, stream);
  run_owner_throughput(p, plan, N, part_data, nullptr,
                       make_tensor(rows.data(), plan.partial, {N, plan.hidden}, p.x.device, p.x.device_index), stream);
  Buffer back(cuda, send_at[w] * R, stream);
  std::vector<PeerTransfer> peers(w);
  for (size_t d = 0; d < w; ++d)
    peers[d] = PeerTransfer{rows.data() + recv_at[d] * R, recv_tokens[d] * R, back.data() + send_at[d] * R,
                            dp.send_counts[d] * R};
  exchange(peers, stream);
  std::vector<int32_t> index(static_cast<size_t>(W * T), -1);
  for (size_t d = 0; d < w; ++d)
    for (int64_t i = send_at[d]; i < send_at[d + 1]; ++i)
      index[d * T + dp.send_tokens[static_cast<size_t>(i)]] = static_cast<int32_t>(i);
  Buffer index_buffer(cuda, W * T * 4, stream);
  to_device(cuda, index_buffer.data(), index.data(), W * T * 4, stream);
  sum_partials(plan, back.data(), reinterpret_cast<const int32_t*>(index_buffer.data()), p.output, stream);
}

// The checks both layers share (everything but the low-latency capacity), before any exchange.
void validate_layer(const FusedMoeParams& p, int world_size, int rank) {
  QMOE_CHECK_ARG(world_size >= 1, "world_size", "at least 1 rank", std::to_string(world_size));
  QMOE_CHECK_ARG(rank >= 0 && rank < world_size, "rank", "a rank in [0, world_size)", std::to_string(rank));
  const int64_t per_rank = experts_per_rank(p.num_experts, world_size);  // names num_experts / world_size
  QMOE_CHECK_ARG(p.num_local_experts == per_rank, "num_local_experts",
                 "num_experts / world_size = " + std::to_string(per_rank) + " (this rank's experts)",
                 std::to_string(p.num_local_experts));
  QMOE_CHECK_ARG(p.local_expert_offset == rank * per_rank, "local_expert_offset",
                 "rank * num_experts / world_size = " + std::to_string(rank * per_rank),
                 std::to_string(p.local_expert_offset));
  QMOE_CHECK_ARG(p.quant_mode != QuantMode::kW4A8Int4 || p.fc2_input_scale.has_value(), "fc2_input_scale",
                 "a static a2 (a dynamic one would differ between the owners)", "None");
  validate_fused_moe(p);
  // The owner's engine runs after the dispatch: a tactic it would refuse must fail here, before it.
  if (!p.x.is_cuda()) {
    QMOE_CHECK_ARG(p.tactic.empty(), "tactic", "empty on CPU tensors (the CPU reference has no tactics)",
                   "'" + p.tactic + "'");
  } else if (!p.tactic.empty()) {
    parse_tactic(p.tactic);  // names 'tactic' when it is no compiled tactic
  }
}

}  // namespace

Exchange nccl_exchange(void* comm) {
  return
      [comm](const std::vector<PeerTransfer>& peers, cudaStream_t stream) { nccl_all_to_all_v(comm, peers, stream); };
}

void validate_low_latency_layer(const LowLatencyLayer& l) {
  validate_layer(l.moe, l.world_size, l.rank);
  check_low_latency_capacity(l.moe.topk_ids.size(0), l.max_tokens_per_rank);
}

int64_t low_latency_layer_workspace_size(const LowLatencyLayer& l) {
  validate_low_latency_layer(l);
  if (!l.moe.x.is_cuda()) return 0;
  const Plan plan = make_plan(l.moe, l.world_size, l.max_tokens_per_rank);
  return make_spans(l, plan).total;
}

void low_latency_layer(const LowLatencyLayer& l, const Exchange& exchange, void* workspace, int64_t workspace_bytes,
                       cudaStream_t stream) {
  validate_low_latency_layer(l);
  QMOE_CHECK_ARG(static_cast<bool>(exchange), "exchange", "a callable all-to-all", "an empty std::function");
  const FusedMoeParams& p = l.moe;
  const bool cuda = p.x.is_cuda();
  const Plan plan = make_plan(l.moe, l.world_size, l.max_tokens_per_rank);
  const Spans s = make_spans(l, plan);
  std::vector<uint8_t> host;
  uint8_t* base = nullptr;
  if (cuda) {
    QMOE_CHECK_ARG(workspace != nullptr && workspace_bytes >= s.total, "workspace",
                   "a CUDA buffer of low_latency_layer_workspace_size = " + std::to_string(s.total) + " bytes",
                   std::to_string(workspace_bytes) + " bytes");
    base = static_cast<uint8_t*>(workspace);
  } else {
    host.resize(static_cast<size_t>(s.total));
    base = host.data();
  }
  const int64_t T = plan.tokens, C = plan.capacity, W = plan.world, k = plan.topk, H = plan.hidden;
  const int64_t B = plan.row_bytes;
  auto ref = [&](int64_t offset, DType dtype, std::initializer_list<int64_t> shape) {
    return make_tensor(base + offset, dtype, shape, p.x.device, p.x.device_index);
  };

  // 1. Home: the payload rows [C, B] (token t at row t; rows T..C-1 are pads with ids -1).
  uint8_t* send = base + s.send;
  fill(cuda, send, 0, C * B, stream);  // alignment padding and pad rows: defined bytes on the wire
  pack_payload(p, plan, base + s.xq, base + s.a1, send, cuda, stream);
  fill_rows(cuda, send + T * B + plan.parts.back().offset, B, 0xFF, 4 * k, C - T, stream);  // pad ids = -1

  // 2. Dispatch: the same C rows to every peer; C rows from each.
  uint8_t* recv = base + s.recv;
  std::vector<PeerTransfer> peers(static_cast<size_t>(W));
  for (int64_t d = 0; d < W; ++d) peers[d] = PeerTransfer{send, C * B, recv + d * C * B, C * B};
  exchange(peers, stream);

  // 3. Owner: the received rows as the engine's tensors, then one bf16 row per owned slot (or one
  //    partial row per token: its own slots finalized).
  for (size_t j = 0; j < plan.parts.size(); ++j)
    copy_rows(cuda, base + s.received + s.received_part[j], plan.parts[j].row_bytes, recv + plan.parts[j].offset, B,
              plan.parts[j].row_bytes, W * C, stream);
  run_owner(owner_params(l, plan, s, base), plan, rows_tensor(l, plan, base, s.rows), base + s.engine,
            s.total - s.engine, stream);

  // 4. Combine: rows of home h's tokens (block h: C*k slot rows, or C partial rows) back to h.
  uint8_t* back = base + s.back;
  const int64_t block = plan.reduce ? C * plan.partial_bytes : C * k * H * 2;
  for (int64_t h = 0; h < W; ++h) peers[h] = PeerTransfer{base + s.rows + h * block, block, back + h * block, block};
  exchange(peers, stream);
  if (plan.reduce) {  // 5. Home: the partial rows of token t sit at d*C + t
    sum_partials(plan, back, nullptr, p.output, stream);
    return;
  }

  // 5. Home: slot (t, j) owned by d sits at row d*C*k + t*k + j of `back`.
  const TensorRef row_index = ref(s.row_index, DType::kInt32, {T * k});
  if (cuda) {
    cuda::ep_low_latency_row_index(p.topk_ids, p.num_experts, static_cast<int>(W), C, row_index, stream);
  } else {
    const int32_t* ids = p.topk_ids.ptr<const int32_t>();
    int32_t* index = row_index.ptr<int32_t>();
    const int64_t per_rank = p.num_experts / W;
    for (int64_t t = 0; t < T; ++t)
      for (int64_t j = 0; j < k; ++j) {
        const int64_t e = ids[t * k + j];
        index[t * k + j] = e >= 0 && e < p.num_experts ? static_cast<int32_t>((e / per_rank) * C * k + t * k + j) : -1;
      }
  }
  MoeFinalizeParams f;
  f.rows = ref(s.back, DType::kBFloat16, {W * C * k, H});
  f.topk_ids = p.topk_ids;
  f.topk_weights = p.topk_weights;
  f.output = p.output;
  f.row_index = row_index;
  f.num_experts = p.num_experts;
  f.routed_scaling_factor = p.routed_scaling_factor;
  moe_finalize(f, stream);
}

void validate_throughput_layer(const ThroughputLayer& l) { validate_layer(l.moe, l.world_size, l.rank); }

void throughput_layer(const ThroughputLayer& l, const Exchange& exchange, cudaStream_t stream) {
  validate_throughput_layer(l);
  QMOE_CHECK_ARG(static_cast<bool>(exchange), "exchange", "a callable all-to-all", "an empty std::function");
  const FusedMoeParams& p = l.moe;
  const bool cuda = p.x.is_cuda();
  std::optional<cuda::DeviceGuard> device;  // the stream-ordered allocations below land on the current device
  if (cuda) device.emplace(p.x.device_index);
  const Plan plan = make_plan(p, l.world_size, 0);
  const int64_t T = plan.tokens, k = plan.topk, H = plan.hidden, B = plan.row_bytes, W = plan.world;
  const size_t w = static_cast<size_t>(W);

  // 1. The routing on the host (sync 1), its plan, and the counts every peer needs (sync 2).
  std::vector<int32_t> ids(static_cast<size_t>(T * k));
  to_host(cuda, ids.data(), p.topk_ids.data, T * k * 4, stream);
  const DispatchPlan dp = plan_dispatch(make_tensor(ids.data(), DType::kInt32, {T, k}), p.num_experts, W);
  std::vector<int64_t> mine(2 * w), theirs(2 * w);
  for (size_t d = 0; d < w; ++d) mine[2 * d] = dp.send_counts[d], mine[2 * d + 1] = dp.return_counts[d];
  {
    Buffer send(cuda, 16 * W, stream), recv(cuda, 16 * W, stream);
    to_device(cuda, send.data(), mine.data(), 16 * W, stream);
    std::vector<PeerTransfer> peers(w);
    for (size_t d = 0; d < w; ++d) peers[d] = PeerTransfer{send.data() + 16 * d, 16, recv.data() + 16 * d, 16};
    exchange(peers, stream);
    to_host(cuda, theirs.data(), recv.data(), 16 * W, stream);
  }
  std::vector<int64_t> recv_tokens(w), recv_slots(w);
  for (size_t s = 0; s < w; ++s) recv_tokens[s] = theirs[2 * s], recv_slots[s] = theirs[2 * s + 1];
  const std::vector<int64_t> send_at = prefix(dp.send_counts), recv_at = prefix(recv_tokens);
  const std::vector<int64_t> give_at = prefix(recv_slots), back_at = prefix(dp.return_counts);
  const int64_t N = recv_at[w];  // tokens this rank computes for its peers (and itself)

  // 2. Dispatch: this rank's payload rows, grouped by destination in the plan's order.
  Buffer xq(cuda, plan.quantize_x ? T * H : 0, stream), a1(cuda, plan.dynamic_a1 ? 4 : 0, stream);
  Buffer staged(cuda, T * B, stream), send(cuda, send_at[w] * B, stream), recv(cuda, N * B, stream);
  fill(cuda, staged.data(), 0, T * B, stream);
  pack_payload(p, plan, xq.data(), a1.data(), staged.data(), cuda, stream);
  {
    std::vector<int32_t> order(dp.send_tokens.begin(), dp.send_tokens.end());
    Buffer index(cuda, send_at[w] * 4, stream);
    to_device(cuda, index.data(), order.data(), send_at[w] * 4, stream);
    gather_rows(cuda, send.data(), B, staged.data(), B, reinterpret_cast<const int32_t*>(index.data()), send_at[w], B,
                stream);
    std::vector<PeerTransfer> peers(w);
    for (size_t d = 0; d < w; ++d)
      peers[d] = PeerTransfer{send.data() + send_at[d] * B, dp.send_counts[d] * B, recv.data() + recv_at[d] * B,
                              recv_tokens[d] * B};
    exchange(peers, stream);
  }

  // 3. Owner: the received rows as the engine's tensors; one bf16 row per owned slot.
  std::vector<std::unique_ptr<Buffer>> parts;
  std::vector<uint8_t*> part_data;
  for (const Part& part : plan.parts) {
    parts.push_back(std::make_unique<Buffer>(cuda, N * part.row_bytes, stream));
    part_data.push_back(parts.back()->data());
    copy_rows(cuda, part_data.back(), part.row_bytes, recv.data() + part.offset, B, part.row_bytes, N, stream);
  }
  if (plan.reduce) {  // 3-5 with the reduced combine
    combine_reduced(l, plan, N, part_data, dp, recv_tokens, recv_at, send_at, exchange, stream);
    return;
  }
  Buffer weights(cuda, N * k * 4, stream), rows(cuda, N * k * H * 2, stream);
  run_owner_throughput(p, plan, N, part_data, weights.data(),
                       make_tensor(rows.data(), DType::kBFloat16, {N * k, H}, p.x.device, p.x.device_index), stream);

  // 4. Combine: the owned slots' rows back to their homes, grouped by home in receive order (sync 3:
  //    the received routing picks them).
  Buffer back(cuda, back_at[w] * H * 2, stream);
  {
    std::vector<int32_t> received_ids(static_cast<size_t>(N * k));
    to_host(cuda, received_ids.data(), part_data.back(), N * k * 4, stream);
    const std::vector<int64_t> owned =
        owner_return_slots(make_tensor(received_ids.data(), DType::kInt32, {N, k}), p.num_experts, W, l.rank);
    QMOE_CHECK_ARG(static_cast<int64_t>(owned.size()) == give_at[w], "exchange",
                   "an all-to-all that delivers what the peers sent (" + std::to_string(give_at[w]) + " owned slots)",
                   std::to_string(owned.size()) + " owned slots in the received routing");
    std::vector<int32_t> order(owned.begin(), owned.end());
    Buffer index(cuda, give_at[w] * 4, stream), give(cuda, give_at[w] * H * 2, stream);
    to_device(cuda, index.data(), order.data(), give_at[w] * 4, stream);
    gather_rows(cuda, give.data(), H * 2, rows.data(), H * 2, reinterpret_cast<const int32_t*>(index.data()),
                give_at[w], H * 2, stream);
    std::vector<PeerTransfer> peers(w);
    for (size_t s = 0; s < w; ++s)
      peers[s] = PeerTransfer{give.data() + give_at[s] * H * 2, recv_slots[s] * H * 2, back.data() + back_at[s] * H * 2,
                              dp.return_counts[s] * H * 2};
    exchange(peers, stream);
  }

  // 5. Home: the row of slot return_slots[i] is back[i].
  std::vector<int32_t> index(static_cast<size_t>(T * k), -1);
  for (int64_t i = 0; i < back_at[w]; ++i) index[static_cast<size_t>(dp.return_slots[i])] = static_cast<int32_t>(i);
  Buffer row_index(cuda, T * k * 4, stream);
  to_device(cuda, row_index.data(), index.data(), T * k * 4, stream);
  MoeFinalizeParams f;
  f.rows = make_tensor(back.data(), DType::kBFloat16, {back_at[w], H}, p.x.device, p.x.device_index);
  f.topk_ids = p.topk_ids;
  f.topk_weights = p.topk_weights;
  f.output = p.output;
  f.row_index = make_tensor(row_index.data(), DType::kInt32, {T * k}, p.x.device, p.x.device_index);
  f.num_experts = p.num_experts;
  f.routed_scaling_factor = p.routed_scaling_factor;
  moe_finalize(f, stream);
}

}  // namespace qmoe::ep
