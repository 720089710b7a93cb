// Fused attention through cuDNN's SDPA graphs (the frontend's Graph API): packed documents as
// ragged (THD) tensors, top-left causal mask inside each document, GQA, bf16 in and out, fp32
// log-sum-exp laid out (N, H) like the reference's.
//
// A graph is built once per shape and cached: the document count is padded to a power of two
// (empty documents past the real ones) and the longest document to a power of two (at most the
// token count), so a run with varying packing builds a handful of graphs, not one per step. The
// backward plans the documents longer than a quarter of the longest apart from the rest
// (ops::long_document_threshold), its deterministic workspace sized by each class. The
// ragged offsets and lengths come from the device boundaries through one small kernel: no host
// sync.
#include "ops/cuda/attention_cudnn.h"

#include <cudnn_frontend.h>

#include <algorithm>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>

#include "core/cuda/check.h"
#include "core/profile.h"
#include "ops/cuda/attention.h"

namespace mt::cuda {

namespace fe = cudnn_frontend;
using TensorAttr = std::shared_ptr<fe::graph::Tensor_attributes>;

namespace {

// Below a long-document threshold of this many tokens the backward keeps one plan: the short
// documents' partial sums are small either way.
constexpr int64_t kMinSplitLength = 128;

// Tensor uids of the variant pack.
enum Uid : int64_t {
  kQ = 1,
  kK,
  kV,
  kO,
  kStats,
  kDO,
  kDQ,
  kDK,
  kDV,
  kSeqLenQ,
  kSeqLenKV,
  kOffQ,
  kOffK,
  kOffV,
  kOffO,
  kOffStats
};

// heads and kv_heads are the packed tensors' (their row strides); a graph covers one of
// head_groups equal slices of them (the backward's deterministic workspace grows with the heads
// it covers: cudnn_attention_backward).
// docs counts the ragged sequences; tokens and max_len are the keys' (the whole rows'), q_tokens
// and max_len_q the queries' (the same but for a context-parallel rank, whose sequences are its
// chunks' parts of the documents, their queries ending their keys: bottom_right).
struct SdpaShape {
  int64_t docs, max_len, tokens, heads, kv_heads, dqk, dv;
  float scale;
  bool backward, deterministic;
  int64_t head_groups = 1;
  int64_t q_tokens = 0, max_len_q = 0;
  bool bottom_right = false;
  auto key() const {
    return std::tuple(docs, max_len, tokens, heads, kv_heads, dqk, dv, scale, backward,
                      deterministic, head_groups, q_tokens, max_len_q, bottom_right);
  }
};

void check(fe::error_t status, const SdpaShape& s, const char* step) {
  MT_CHECK(status.is_good(),
           "cuDNN SDPA {} ({}): {} (documents {}, longest {}, tokens {}, heads {}/{}, dims {}/{})",
           s.backward ? "backward" : "forward", step, status.get_message(), s.docs, s.max_len,
           s.tokens, s.heads, s.kv_heads, s.dqk, s.dv);
}

cudnnHandle_t handle() {
  static cudnnHandle_t h = [] {
    cudnnHandle_t created = nullptr;
    const cudnnStatus_t st = cudnnCreate(&created);
    MT_CHECK(st == CUDNN_STATUS_SUCCESS, "cudnnCreate failed: {}", cudnnGetErrorString(st));
    return created;
  }();
  return h;
}

// A packed (tokens, heads, dim) tensor seen as cuDNN's (docs, heads / head_groups, len, dim) with
// ragged per-sequence offsets: one group's heads, at the whole tensor's strides. len: the longest
// sequence of its side (max_len_q for q, out and their gradients; max_len for k and v).
fe::graph::Tensor_attributes& describe_packed(fe::graph::Tensor_attributes& t, Uid uid,
                                              const TensorAttr& offsets, const SdpaShape& s,
                                              int64_t heads, int64_t dim, int64_t len) {
  return t.set_uid(uid)
      .set_dim({s.docs, heads / s.head_groups, len, dim})
      .set_stride({len * heads * dim, dim, heads * dim, 1})
      .set_ragged_offset(offsets);
}

TensorAttr packed(fe::graph::Graph& g, const char* name, Uid uid, const TensorAttr& offsets,
                  const SdpaShape& s, int64_t heads, int64_t dim, int64_t len) {
  fe::graph::Tensor_attributes t;
  t.set_name(name);
  return g.tensor(describe_packed(t, uid, offsets, s, heads, dim, len));
}

void as_packed(const TensorAttr& t, Uid uid, const TensorAttr& offsets, const SdpaShape& s,
               int64_t heads, int64_t dim, int64_t len) {
  describe_packed(t->set_output(true), uid, offsets, s, heads, dim, len);
}

TensorAttr int_vector(fe::graph::Graph& g, const char* name, Uid uid, int64_t len) {
  return g.tensor(fe::graph::Tensor_attributes()
                      .set_name(name)
                      .set_uid(uid)
                      .set_dim({len, 1, 1, 1})
                      .set_stride({1, 1, 1, 1})
                      .set_data_type(fe::DataType_t::INT32));
}

struct GraphInputs {
  TensorAttr q, k, v, seq_q, seq_kv, off_q, off_k, off_v, off_o, off_stats;
};

GraphInputs declare_inputs(fe::graph::Graph& g, const SdpaShape& s) {
  GraphInputs in;
  in.off_q = int_vector(g, "off_q", kOffQ, s.docs + 1);
  in.off_k = int_vector(g, "off_k", kOffK, s.docs + 1);
  in.off_v = int_vector(g, "off_v", kOffV, s.docs + 1);
  in.off_o = int_vector(g, "off_o", kOffO, s.docs + 1);
  in.off_stats = int_vector(g, "off_stats", kOffStats, s.docs + 1);
  in.seq_q = int_vector(g, "seq_q", kSeqLenQ, s.docs);
  in.seq_kv = int_vector(g, "seq_kv", kSeqLenKV, s.docs);
  in.q = packed(g, "q", kQ, in.off_q, s, s.heads, s.dqk, s.max_len_q);
  in.k = packed(g, "k", kK, in.off_k, s, s.kv_heads, s.dqk, s.max_len);
  in.v = packed(g, "v", kV, in.off_v, s, s.kv_heads, s.dv, s.max_len);
  return in;
}

// The log-sum-exp, (docs, heads, max_len, 1) over the packed (tokens, heads) f32 buffer.
void describe_stats(fe::graph::Tensor_attributes& t, const GraphInputs& in, const SdpaShape& s) {
  t.set_uid(kStats)
      .set_data_type(fe::DataType_t::FLOAT)
      .set_dim({s.docs, s.heads / s.head_groups, s.max_len_q, 1})
      .set_stride({s.max_len_q * s.heads, 1, s.heads, 1})
      .set_ragged_offset(in.off_stats);
}

std::shared_ptr<fe::graph::Graph> build(const SdpaShape& s) {
  auto g = std::make_shared<fe::graph::Graph>();
  g->set_io_data_type(fe::DataType_t::BFLOAT16)
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  const GraphInputs in = declare_inputs(*g, s);
  if (!s.backward) {
    auto options = fe::graph::SDPA_attributes()
                       .set_name("sdpa")
                       .set_generate_stats(true)
                       .set_causal_mask(!s.bottom_right)
                       .set_causal_mask_bottom_right(s.bottom_right)
                       .set_attn_scale(s.scale)
                       .set_padding_mask(true)
                       .set_seq_len_q(in.seq_q)
                       .set_seq_len_kv(in.seq_kv);
    auto [o, stats] = g->sdpa(in.q, in.k, in.v, options);
    as_packed(o, kO, in.off_o, s, s.heads, s.dv, s.max_len_q);
    stats->set_output(true);
    describe_stats(*stats, in, s);
  } else {
    const TensorAttr o = packed(*g, "o", kO, in.off_o, s, s.heads, s.dv, s.max_len_q);
    const TensorAttr dout = packed(*g, "dO", kDO, in.off_o, s, s.heads, s.dv, s.max_len_q);
    fe::graph::Tensor_attributes stats_desc;
    stats_desc.set_name("stats");
    describe_stats(stats_desc, in, s);
    const TensorAttr stats = g->tensor(stats_desc);
    auto options = fe::graph::SDPA_backward_attributes()
                       .set_name("sdpa_backward")
                       .set_causal_mask(!s.bottom_right)
                       .set_causal_mask_bottom_right(s.bottom_right)
                       .set_attn_scale(s.scale)
                       .set_padding_mask(true)
                       .set_seq_len_q(in.seq_q)
                       .set_seq_len_kv(in.seq_kv)
                       .set_max_total_seq_len_q(s.q_tokens)
                       .set_max_total_seq_len_kv(s.tokens)
                       .set_deterministic_algorithm(s.deterministic);
    auto [dq, dk, dv] = g->sdpa_backward(in.q, in.k, in.v, o, dout, stats, options);
    as_packed(dq, kDQ, in.off_q, s, s.heads, s.dqk, s.max_len_q);
    as_packed(dk, kDK, in.off_k, s, s.kv_heads, s.dqk, s.max_len);
    as_packed(dv, kDV, in.off_v, s, s.kv_heads, s.dv, s.max_len);
  }
  check(g->validate(), s, "validate");
  check(g->build_operation_graph(handle()), s, "operation graph");
  check(g->create_execution_plans({fe::HeurMode_t::A}), s, "execution plans");
  check(g->check_support(handle()), s, "support");
  check(g->build_plans(handle()), s, "build plans");
  return g;
}

const fe::graph::Graph& cached_graph(const SdpaShape& s) {
  static std::mutex mutex;
  static std::map<decltype(s.key()), std::shared_ptr<fe::graph::Graph>> cache;
  const std::lock_guard lock(mutex);
  auto& slot = cache[s.key()];
  if (!slot) slot = build(s);
  return *slot;
}

SdpaShape shape_of(const Tensor& q, const Tensor& k, const Tensor& v, const ops::Documents& docs,
                   double scale, bool backward, ops::Determinism determinism) {
  MT_CHECK(docs.cu_seqlens.device() == Device::kCUDA && docs.cu_seqlens.dtype() == DType::kI32,
           "cuDNN attention needs i32 cu_seqlens on the GPU");
  MT_CHECK(docs.max_length >= 1 && docs.max_length <= q.dim(0),
           "longest document {} outside [1, {}]", docs.max_length, q.dim(0));
  MT_CHECK(q.dim(0) * q.dim(1) * std::max(q.dim(2), v.dim(2)) < (int64_t{1} << 31),
           "cuDNN attention: {} tokens x {} heads overflow its 32-bit ragged offsets", q.dim(0),
           q.dim(1));
  const ops::PlannedDocuments planned =
      ops::planned_documents(docs.cu_seqlens.numel() - 1, docs.max_length, q.dim(0));
  SdpaShape s{planned.count, planned.longest,
              q.dim(0),      q.dim(1),
              k.dim(1),      q.dim(2),
              v.dim(2),      static_cast<float>(scale),
              backward,      determinism == ops::Determinism::kDeterministic};
  s.q_tokens = s.tokens;
  s.max_len_q = s.max_len;
  return s;
}

// Offsets and lengths on the device, the (padded_docs + 1) x 5 offsets then padded_docs lengths
// (twice where the keys' lengths differ from the queries').
struct Ragged {
  Tensor buffer;
  kernels::RaggedLayout at;
};

enum class KeyLengths : uint8_t { kQueries, kOwn };

// A layout buffer for `b` sequences (its arrays pointed at; the kernels fill them).
Ragged ragged_buffer(int64_t b, KeyLengths keys = KeyLengths::kQueries) {
  const int64_t lengths = keys == KeyLengths::kOwn ? 2 * b : b;
  Ragged r{Tensor::empty({5 * (b + 1) + lengths}, DType::kI32, Device::kCUDA), {}};
  int32_t* base = r.buffer.data<int32_t>();
  r.at = {base,
          base + (b + 1),
          base + 2 * (b + 1),
          base + 3 * (b + 1),
          base + 4 * (b + 1),
          base + 5 * (b + 1),
          base + 5 * (b + 1) + (keys == KeyLengths::kOwn ? b : 0)};
  return r;
}

kernels::RaggedStrides ragged_strides(const SdpaShape& s) {
  const auto i32 = [](int64_t x) { return static_cast<int32_t>(x); };
  return {i32(s.heads * s.dqk), i32(s.kv_heads * s.dqk), i32(s.kv_heads * s.dv),
          i32(s.heads * s.dv), i32(s.heads)};
}

Ragged ragged_layout(const ops::Documents& docs, const SdpaShape& s) {
  Ragged r = ragged_buffer(s.docs);
  MT_CUDA_CHECK(kernels::attention_ragged_layout(
      docs.cu_seqlens.data<int32_t>(), static_cast<int>(docs.cu_seqlens.numel() - 1),
      static_cast<int>(s.docs), ragged_strides(s), r.at, stream()));
  return r;
}

int64_t workspace_bytes(const fe::graph::Graph& g) {
  int64_t bytes = 0;
  MT_CHECK(g.get_workspace_size(bytes).is_good(), "cuDNN SDPA workspace query failed");
  return bytes;
}

// The backward's head groups: the fewest (a divisor of the KV heads, so that every query head
// stays in its KV head's group and each head's sums keep their order) whose deterministic
// workspace fits the budget, else as many as there are KV heads. The deterministic algorithm
// keeps per-block partial sums of dQ that grow with the document length and the heads: 16.5 GiB
// for 32 heads at 16 documents of up to 4096 tokens, the step's peak before it was split.
SdpaShape backward_groups(SdpaShape s, int64_t budget_bytes) {
  s.head_groups = 1;
  for (int64_t groups = 1; groups <= s.kv_heads; ++groups) {
    // Later groups' pointers keep cuDNN's 16-byte alignment when each group's query heads are a
    // multiple of 4 (the LSE has one float per head; q, k, v rows are multiples of 8 bf16).
    const bool aligned = groups == 1 || (s.heads / groups) % 4 == 0;
    if (s.kv_heads % groups != 0 || !aligned) continue;
    s.head_groups = groups;
    if (workspace_bytes(cached_graph(s)) <= budget_bytes) break;
  }
  return s;
}

// Element offset of head group `group` in a packed (tokens, heads, dim) tensor.
int64_t group_offset(int64_t group, int64_t heads, int64_t groups, int64_t dim) {
  return group * (heads / groups) * dim;
}

void run(const fe::graph::Graph& g, std::unordered_map<int64_t, void*>& pack, const Ragged& r) {
  pack[kOffQ] = r.at.q;
  pack[kOffK] = r.at.k;
  pack[kOffV] = r.at.v;
  pack[kOffO] = r.at.o;
  pack[kOffStats] = r.at.stats;
  pack[kSeqLenQ] = r.at.seq_len;
  pack[kSeqLenKV] = r.at.seq_len_kv;
  Tensor workspace =
      Tensor::empty({std::max<int64_t>(workspace_bytes(g), 1)}, DType::kU8, Device::kCUDA);
  // The handle is shared; the stream is the calling thread's (set on every call).
  const cudnnStatus_t st = cudnnSetStream(handle(), stream());
  MT_CHECK(st == CUDNN_STATUS_SUCCESS, "cudnnSetStream failed: {}", cudnnGetErrorString(st));
  fe::error_t status = g.execute(handle(), pack, workspace.raw());
  MT_CHECK(status.is_good(), "cuDNN SDPA execute failed: {}", status.get_message());
}

void check_operands(std::initializer_list<const Tensor*> ts) {
  for (const Tensor* t : ts)
    MT_CHECK(t->device() == Device::kCUDA && t->dtype() == DType::kBF16,
             "cuDNN attention operands must be bf16 on the GPU, got {}", dtype_name(t->dtype()));
}

// The variant pack holds non-const pointers; cuDNN only reads the inputs.
void* ptr(const Tensor& t) {
  return const_cast<void*>(t.raw());
}

}  // namespace

bool cudnn_attention_supports(const Tensor& q, const Tensor& v) {
  const auto dim_ok = [](int64_t d) { return d % 8 == 0 && d <= 256; };
  return q.dtype() == DType::kBF16 && dim_ok(q.dim(2)) && dim_ok(v.dim(2));
}

void cudnn_attention_forward(const Tensor& q, const Tensor& k, const Tensor& v,
                             const ops::Documents& docs, double scale, Tensor& out, Tensor& lse) {
  const profile::Phase phase("gpu.cudnn_attention_forward");
  check_operands({&q, &k, &v, &out});
  expect_shape(out, {q.dim(0), q.dim(1), v.dim(2)}, "attention out");
  expect_shape(lse, {q.dim(0), q.dim(1)}, "attention lse");
  expect_dtype(lse, DType::kF32, "attention lse (GPU)");
  const SdpaShape s = shape_of(q, k, v, docs, scale, false, ops::Determinism::kFast);
  const fe::graph::Graph& g = cached_graph(s);
  const Ragged r = ragged_layout(docs, s);
  std::unordered_map<int64_t, void*> pack{
      {kQ, ptr(q)}, {kK, ptr(k)}, {kV, ptr(v)}, {kO, out.raw()}, {kStats, lse.raw()}};
  run(g, pack, r);
}

namespace {

struct BackwardOperands {
  const Tensor &q, &k, &v, &out, &lse, &dout;
  Tensor &dq, &dk, &dv;
};

// One plan's backward (s before its head groups) over the documents of layout r.
void backward_over(const BackwardOperands& t, SdpaShape s, const Ragged& r, int64_t budget) {
  s = backward_groups(s, budget);
  const fe::graph::Graph& g = cached_graph(s);
  const int64_t groups = s.head_groups;  // offsets at the whole tensors' strides: every group's
  for (int64_t i = 0; i < groups; ++i) {
    const int64_t q_at = group_offset(i, s.heads, groups, s.dqk),
                  kv_at = group_offset(i, s.kv_heads, groups, s.dqk),
                  v_at = group_offset(i, s.kv_heads, groups, s.dv),
                  o_at = group_offset(i, s.heads, groups, s.dv),
                  lse_at = group_offset(i, s.heads, groups, 1);
    const auto at = [](const Tensor& x, int64_t elements) {
      return static_cast<char*>(ptr(x)) + elements * dtype_size(x.dtype());
    };
    std::unordered_map<int64_t, void*> pack{
        {kQ, at(t.q, q_at)},   {kK, at(t.k, kv_at)},        {kV, at(t.v, v_at)},
        {kO, at(t.out, o_at)}, {kStats, at(t.lse, lse_at)}, {kDO, at(t.dout, o_at)},
        {kDQ, at(t.dq, q_at)}, {kDK, at(t.dk, kv_at)},      {kDV, at(t.dv, v_at)}};
    run(g, pack, r);
  }
}

}  // namespace

void cudnn_attention_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                              const Tensor& lse, const Tensor& dout, const ops::Documents& docs,
                              double scale, ops::Determinism determinism, Tensor& dq, Tensor& dk,
                              Tensor& dv, int64_t workspace_budget_bytes) {
  const profile::Phase phase("gpu.cudnn_attention_backward");
  check_operands({&q, &k, &v, &out, &dout, &dq, &dk, &dv});
  expect_shape(dq, q.shape(), "attention dq");
  expect_shape(dk, k.shape(), "attention dk");
  expect_shape(dv, v.shape(), "attention dv");
  expect_dtype(lse, DType::kF32, "attention lse (GPU)");
  const BackwardOperands t{q, k, v, out, lse, dout, dq, dk, dv};
  const SdpaShape s = shape_of(q, k, v, docs, scale, true, determinism);
  const int64_t count = docs.cu_seqlens.numel() - 1;
  const int64_t threshold = ops::long_document_threshold(docs.max_length, q.dim(0));
  // Unknown long documents, or a quarter of the longest too short to matter: one plan.
  if (docs.long_count < 0 || threshold < kMinSplitLength) {
    backward_over(t, s, ragged_layout(docs, s), workspace_budget_bytes);
    return;
  }
  MT_CHECK(docs.long_count <= count, "{} long documents of {}", docs.long_count, count);
  // The long documents at the longest, the rest at the threshold (ops::long_document_threshold).
  SdpaShape longer = s, rest = s;
  longer.docs = ops::planned_long_documents(docs.long_count);
  rest.max_len = threshold;
  const Ragged long_layout = ragged_buffer(std::max<int64_t>(longer.docs, 1)),
               rest_layout = ragged_buffer(rest.docs);
  MT_CUDA_CHECK(kernels::attention_ragged_layout_split(
      docs.cu_seqlens.data<int32_t>(), static_cast<int>(count), static_cast<int>(threshold),
      static_cast<int>(longer.docs), static_cast<int>(rest.docs), ragged_strides(s), long_layout.at,
      rest_layout.at, stream()));
  if (docs.long_count > 0) backward_over(t, longer, long_layout, workspace_budget_bytes);
  if (docs.long_count < count) backward_over(t, rest, rest_layout, workspace_budget_bytes);
}

namespace {

// A context-parallel rank's shape: slots of its chunks per row in one pass, each chunk's part of
// each (planned) document one sequence; the queries' longest is a chunk (or the longest document).
SdpaShape chunks_shape(const Tensor& q, const ops::ContextChunks& c, const Tensor& k,
                       const Tensor& v, const ops::Documents& docs, double scale, bool backward,
                       ops::Determinism determinism, int64_t slots) {
  SdpaShape s = shape_of(k, k, v, docs, scale, backward, determinism);  // the keys' side
  MT_CHECK(q.dim(0) * q.dim(1) * std::max(q.dim(2), v.dim(2)) < (int64_t{1} << 31),
           "cuDNN attention: {} queries x {} heads overflow its 32-bit ragged offsets", q.dim(0),
           q.dim(1));
  s.heads = q.dim(1);
  const int64_t rows = k.dim(0) / c.row_tokens;
  MT_CHECK(rows * slots * s.docs < (int64_t{1} << 31), "{} rows x {} documents: too many sequences",
           rows, s.docs);
  s.docs *= rows * slots;
  s.q_tokens = q.dim(0);
  s.max_len_q = std::min(c.chunk(), s.max_len);
  s.bottom_right = true;
  return s;
}

Ragged chunk_layout(const ops::ContextChunks& c, const ops::Documents& docs, const SdpaShape& s,
                    int64_t rows, int slot_begin, int slots) {
  const int64_t planned = s.docs / (rows * slots);
  Ragged r = ragged_buffer(s.docs, KeyLengths::kOwn);
  const auto i32 = [](int64_t x) { return static_cast<int32_t>(x); };
  const kernels::ContextGeometry g{i32(c.row_tokens), i32(c.chunk()), i32(c.cp), i32(c.rank),
                                   i32(rows)};
  MT_CUDA_CHECK(kernels::attention_chunk_layout(
      docs.cu_seqlens.data<int32_t>(), static_cast<int>(docs.cu_seqlens.numel() - 1),
      static_cast<int>(planned), g, slot_begin, slots, ragged_strides(s), r.at, stream()));
  return r;
}

}  // namespace

void cudnn_attention_forward_chunks(const Tensor& q, const ops::ContextChunks& chunks,
                                    const Tensor& k, const Tensor& v, const ops::Documents& docs,
                                    double scale, Tensor& out, Tensor& lse) {
  const profile::Phase phase("gpu.cudnn_attention_forward_chunks");
  check_operands({&q, &k, &v, &out});
  const SdpaShape s =
      chunks_shape(q, chunks, k, v, docs, scale, false, ops::Determinism::kFast, /*slots=*/2);
  const fe::graph::Graph& g = cached_graph(s);
  const Ragged r = chunk_layout(chunks, docs, s, k.dim(0) / chunks.row_tokens, 0, 2);
  std::unordered_map<int64_t, void*> pack{
      {kQ, ptr(q)}, {kK, ptr(k)}, {kV, ptr(v)}, {kO, out.raw()}, {kStats, lse.raw()}};
  run(g, pack, r);
}

void cudnn_attention_backward_chunks(const Tensor& q, const ops::ContextChunks& chunks,
                                     const Tensor& k, const Tensor& v, const Tensor& out,
                                     const Tensor& lse, const Tensor& dout,
                                     const ops::Documents& docs, double scale,
                                     ops::Determinism determinism, int slot, Tensor& dq, Tensor& dk,
                                     Tensor& dv, int64_t workspace_budget_bytes) {
  const profile::Phase phase("gpu.cudnn_attention_backward_chunks");
  check_operands({&q, &k, &v, &out, &dout, &dq, &dk, &dv});
  MT_CHECK(slot == 0 || slot == 1, "a rank's chunk slot is 0 or 1, got {}", slot);
  const SdpaShape s = chunks_shape(q, chunks, k, v, docs, scale, true, determinism, /*slots=*/1);
  const Ragged r = chunk_layout(chunks, docs, s, k.dim(0) / chunks.row_tokens, slot, 1);
  backward_over({q, k, v, out, lse, dout, dq, dk, dv}, s, r, workspace_budget_bytes);
}

}  // namespace mt::cuda
