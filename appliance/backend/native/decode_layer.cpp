// decode_layer: a pre-norm decoder layer's decode step (Llama, Qwen 2 and 3 with tiled 4- or
// 8-bit weights, each linear its own) in one MLX operation.
//
// Built of the appliance's operations one by one, a layer's decode step is some twenty graph
// nodes (norms, the products, views, RoPE, the KV cache's two slice updates and their views,
// attention, SwiGLU), six hundred a step of SmolLM2. MLX handles each node on the engine's
// thread (and a task to release its inputs), and its eval stops walking the graph while
// more than ten tasks are in flight, so a step built ahead could not start until the one
// before was three quarters done (docs/decisions.md). Here the layer is one node: the same
// loops in the same order (fast_kernels.h), so its numbers are those of the nodes one by one,
// bit for bit, and the KV buffers are written where they lie, as MLX's slice update writes
// a buffer it may donate (else the output is a copy, as MLX's would be).
//
// In: h [B, D] (then the chunks' rows, below), the layer's KV buffers [R, KV, W, d] (float32,
// or float16 where the cache is kept in 16 bits; rows 0..B-1 are the batch's), each row's
// RoPE position [B] (int32), RoPE's inverse frequencies, the two norms' weights, q/k norm
// weights and q/k/v biases where the model has them, q, k, v, o, gate, up and down as
// tile()'s arrays (tiles, scales, biases each), the mask [.., L] where there is one, each
// chunk's key and value buffers. The new position is written at
// `at` in every row; attention reads positions first..at.
// Out: h + attention + MLP [B, D], the keys, the values.
//
// Prompt chunks may ride in the step (a mixed tick, appliance/engine/mixed.py): their tokens
// are rows after the batch's in h, through the same products; each chunk writes its keys and
// values into its own sequence's buffers (outputs after the batch's) and its queries attend
// causally over them. The batch's rows get the bits they get alone; a chunk's attention is
// summed in another order than its own forward's (a matrix product there).
//
// A verify (appliance/engine/lookup.py) is each row's next token and drafts: `span` tokens a
// row at at.. of its slot, token i attending over first..at + i (and the mask [B, 1, span,
// L + span - 1] where rows are padded). Each gets the bits a plain step at its position
// would (the products are row by row; attention stops at its own key).

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/vector.h>

#include <array>
#include <cstdint>
#include <cstring>
#include <optional>
#include <stdexcept>
#include <vector>

#include "mlx/allocator.h"
#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"

#include "fast_kernels.h"
#include "staging.h"

namespace nb = nanobind;
namespace mx = mlx::core;
namespace fk = fast_kernels;

namespace {

constexpr int LINEARS = 7;  // q, k, v, o, gate, up, down

struct Shape {
  int group;
  int64_t heads, kv, d, inter;
  int dims;
  bool traditional, qk_norm, bias;
  int mask_kind;
  int64_t at, first;
  int64_t rows;                 // the decode batch's rows (the first of h's)
  std::vector<int64_t> chunks;  // per prompt chunk riding after them: its offset and length
  float rope_scale, attn_scale, eps_in, eps_post, eps_qk;
  mx::Dtype scales;
  std::array<int, LINEARS> bits;  // each linear's, from its tiles' width (4 or 8)
  int64_t span = 1;  // tokens of each decode row: > 1 for a verify (its drafts)

  bool operator==(const Shape&) const = default;

  // Where each kind of input starts (see the header).
  int norms() const { return 5; }
  int qk() const { return 7; }
  int biases() const { return qk_norm ? 9 : 7; }
  int linears() const { return biases() + (bias ? 3 : 0); }
  int mask() const { return linears() + 3 * LINEARS; }
  // chunk c's key and value buffers (after the mask, where there is one)
  int chunk_kv(int c) const { return mask() + (mask_kind == fk::NO_MASK ? 0 : 1) + 2 * c; }
  int64_t count() const { return static_cast<int64_t>(chunks.size() / 2); }
};

// kv: the decode buffers' keys and values, then each chunk's (outputs, written in place).
void run(const Shape& s, std::vector<mx::array>& in, float* h_out,
         std::vector<mx::array>& kv) {
  const mx::array& h = in[0];
  // m rows through the products: the decode batch's b tokens, then the chunks' tokens
  const int64_t m = h.shape(0), b = s.rows * s.span, dm = h.shape(1), hd = s.heads * s.d,
                kd = s.kv * s.d;
  std::vector<float> x(m * dm), q(m * hd), k(m * kd), v(m * kd), qr(m * hd), kr(m * kd),
      att(m * hd), mid(m * dm), gate(m * s.inter), up(m * s.inter);
  // products of xin [b, kin] with linears `which` (their outputs ys, n columns each)
  const auto product = [&](const float* xin, int64_t kin, std::initializer_list<int> which,
                           std::initializer_list<float*> ys, std::initializer_list<int64_t> ns,
                           const float* residual) {
    std::vector<fk::TiledWeight> ws;
    auto n = ns.begin();
    for (int i : which) {
      const int at = s.linears() + 3 * i;
      ws.push_back({in[at].data<void>(), in[at + 1].data<void>(), in[at + 2].data<void>(), *n++,
                    s.bits[i]});
    }
    fk::tiled_products(xin, m, kin, s.group, s.scales, ws.data(), std::data(ys),
                       static_cast<int>(ws.size()), residual);
  };
  // attention: norm, q/k/v (+ biases, q/k norms), RoPE, the cache's new position, attention
  fk::rms_norm_rows(h.data<float>(), in[s.norms()].data<float>(), x.data(), m, dm, s.eps_in);
  product(x.data(), dm, {0, 1, 2}, {q.data(), k.data(), v.data()}, {hd, kd, kd}, nullptr);
  if (s.bias) {
    float* outs[3] = {q.data(), k.data(), v.data()};
    const int64_t widths[3] = {hd, kd, kd};
    for (int p = 0; p < 3; p++) {
      const float* bias = in[s.biases() + p].data<float>();
      for (int64_t r = 0; r < m; r++)
        for (int64_t i = 0; i < widths[p]; i++) outs[p][r * widths[p] + i] += bias[i];
    }
  }
  if (s.qk_norm) {
    fk::rms_norm_rows(q.data(), in[s.qk()].data<float>(), q.data(), m * s.heads, s.d, s.eps_qk);
    fk::rms_norm_rows(k.data(), in[s.qk() + 1].data<float>(), k.data(), m * s.kv, s.d, s.eps_qk);
  }
  // each row's position: a decode row's own (or the batch's one), a chunk token's in its prompt
  const mx::array& offset = in[3];
  const int32_t* off = offset.data<int32_t>();
  std::vector<int32_t> pos(static_cast<size_t>(m));
  for (int64_t r = 0; r < b; r++)
    pos[r] = off[offset.size() > 1 ? r / s.span : 0] + static_cast<int32_t>(r % s.span);
  for (int64_t c = 0, r = b; c < s.count(); c++)
    for (int64_t i = 0; i < s.chunks[2 * c + 1]; i++)
      pos[r++] = static_cast<int32_t>(s.chunks[2 * c] + i);
  const float* inv = in[4].data<float>();
  fk::rope_apply(q.data(), qr.data(), m, s.heads, 1, s.d, s.dims, s.traditional, s.rope_scale,
                 pos.data(), true, inv);
  fk::rope_apply(k.data(), kr.data(), m, s.kv, 1, s.d, s.dims, s.traditional, s.rope_scale,
                 pos.data(), true, inv);
  // the new keys and values where they go: row r's of buffer [R, KV, W, d] at position p
  // (a float16 cache's rounded to nearest, as MLX's cast rounds them)
  const bool half = kv[0].dtype() == mx::float16;
  const int64_t esize = half ? 2 : 4;
  const auto put = [&](char* keys, char* values, int64_t window, int64_t r, int64_t from_row,
                       int64_t p) {
    for (int64_t g = 0; g < s.kv; g++) {
      const int64_t to = ((r * s.kv + g) * window + p) * s.d, from = (from_row * s.kv + g) * s.d;
      if (half) {
        fk::narrow_half(kr.data() + from, reinterpret_cast<uint16_t*>(keys) + to, s.d);
        fk::narrow_half(v.data() + from, reinterpret_cast<uint16_t*>(values) + to, s.d);
      } else {
        std::memcpy(keys + to * 4, kr.data() + from, s.d * sizeof(float));
        std::memcpy(values + to * 4, v.data() + from, s.d * sizeof(float));
      }
    }
  };
  const fk::Strided none{nullptr, {0, 0, 0, 0}};
  const int64_t rep = s.heads / s.kv;
  if (s.span > 1) {  // row r's token i at at + i of its slot, attention over first..at + i
    char *keys = kv[0].data<char>(), *values = kv[1].data<char>();
    const int64_t window = kv[0].shape(2), head = window * s.d, row = s.kv * head;
    const fk::Strided mask = s.mask_kind == fk::NO_MASK ? none : fk::strided(in[s.mask()]);
    const int64_t msize = s.mask_kind == fk::BOOL_MASK ? 1 : 4;
    for (int64_t r = 0; r < s.rows; r++) {
      for (int64_t i = 0; i < s.span; i++) put(keys, values, window, r, r * s.span + i, s.at + i);
      const int64_t skip = r * row + s.first * s.d;
      const fk::Strided sq{reinterpret_cast<const char*>(qr.data() + r * s.span * hd),
                           {hd, s.d, s.d, 1}};
      const fk::Strided sk{keys + skip * esize, {0, head, s.d, 1}, half},
          sv{values + skip * esize, {0, head, s.d, 1}, half};
      // the row's mask [span, L]: a query's axis where a plain step has the rows'
      const fk::Strided sm{mask.base ? mask.base + r * mask.st[0] * msize : nullptr,
                           {mask.st[2], mask.st[1], 0, mask.st[3]}};
      fk::decode_attention(sq, sk, sv, sm, s.mask_kind, att.data() + r * s.span * hd, s.span,
                           s.kv, rep, s.at + s.span - s.first, s.d, s.attn_scale,
                           s.at - s.first);
    }
  } else {  // the decode rows: row r's new position at `at` of its slot, attention over first..at
    char *keys = kv[0].data<char>(), *values = kv[1].data<char>();
    const int64_t window = kv[0].shape(2);
    for (int64_t r = 0; r < b; r++) put(keys, values, window, r, r, s.at);
    const int64_t length = s.at + 1 - s.first;
    const int64_t row = s.kv * window * s.d, head = window * s.d;
    const fk::Strided sq{reinterpret_cast<const char*>(qr.data()), {hd, s.d, s.d, 1}};
    const char *k0 = keys + s.first * s.d * esize, *v0 = values + s.first * s.d * esize;
    const fk::Strided sk{k0, {row, head, s.d, 1}, half}, sv{v0, {row, head, s.d, 1}, half};
    const fk::Strided sm = s.mask_kind == fk::NO_MASK ? none : fk::strided(in[s.mask()]);
    fk::decode_attention(sq, sk, sv, sm, s.mask_kind, att.data(), b, s.kv, rep, length, s.d,
                         s.attn_scale);
  }
  // each chunk: its tokens' keys and values into its own buffers [1, KV, W, d], then causal
  // attention of its queries over its sequence's keys (one query a row)
  for (int64_t c = 0, r0 = b; c < s.count(); c++) {
    const int64_t at = s.chunks[2 * c], n = s.chunks[2 * c + 1];
    char *keys = kv[2 + 2 * c].data<char>(), *values = kv[3 + 2 * c].data<char>();
    const int64_t window = kv[2 + 2 * c].shape(2), head = window * s.d;
    for (int64_t i = 0; i < n; i++) put(keys, values, window, 0, r0 + i, at + i);
    const fk::Strided sq{reinterpret_cast<const char*>(qr.data() + r0 * hd), {hd, s.d, s.d, 1}};
    const fk::Strided sk{keys, {0, head, s.d, 1}, half}, sv{values, {0, head, s.d, 1}, half};
    fk::decode_attention(sq, sk, sv, none, fk::NO_MASK, att.data() + r0 * hd, n, s.kv, rep,
                         at + n, s.d, s.attn_scale, at);
    r0 += n;
  }
  product(att.data(), hd, {3}, {mid.data()}, {dm}, h.data<float>());
  // MLP: norm, gate and up, SwiGLU, down (+ the residual)
  fk::rms_norm_rows(mid.data(), in[s.norms() + 1].data<float>(), x.data(), m, dm, s.eps_post);
  product(x.data(), dm, {4, 5}, {gate.data(), up.data()}, {s.inter, s.inter}, nullptr);
  fk::silu_mul_span(gate.data(), up.data(), gate.data(), m * s.inter);
  product(gate.data(), s.inter, {6}, {h_out}, {dm}, mid.data());
}

class DecodeLayer : public mx::Primitive {
 public:
  DecodeLayer(mx::Stream stream, const Shape& s) : mx::Primitive(stream), s_(s) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    auto& enc = mx::cpu::get_command_encoder(stream());
    mx::array& h_out = outputs[0];
    h_out.set_data(mx::allocator::malloc(h_out.nbytes()));
    // The KV buffers: written in place where MLX would let a slice update donate them. Each
    // output of a multi-output operation holds its own list of the inputs, so the outputs
    // not being evaluated let go of theirs first (MLX detaches them all once this returns;
    // it reads only the evaluated output's list), else no input would ever be donatable.
    for (auto& out : outputs)
      if (&out.inputs() != &inputs) out.inputs().clear();
    // outputs 1.. are the buffers: the decode batch's two (inputs 1, 2), then each chunk's
    std::vector<int> from = {1, 2};
    for (int c = 0; c < s_.count(); c++)
      from.insert(from.end(), {s_.chunk_kv(c), s_.chunk_kv(c) + 1});
    std::vector<bool> copy;
    for (size_t i = 0; i < from.size(); i++) {
      const mx::array& buf = inputs[from[i]];
      copy.push_back(!(buf.flags().row_contiguous && buf.is_donatable()));
      if (copy.back()) outputs[1 + i].set_data(mx::allocator::malloc(outputs[1 + i].nbytes()));
      else outputs[1 + i].copy_shared_buffer(buf);
    }
    // every input row-contiguous (a broadcast mask gets a contiguous copy)
    staging::Staged staged = staging::stage(enc, inputs);
    for (auto& out : outputs) enc.set_output_array(out);
    std::vector<mx::array> kv;
    for (size_t i = 1; i < outputs.size(); i++)
      kv.push_back(mx::array::unsafe_weak_copy(outputs[i]));
    enc.dispatch([staged = std::move(staged), h = mx::array::unsafe_weak_copy(outputs[0]),
                  kv = std::move(kv), from = std::move(from), copy = std::move(copy),
                  s = s_]() mutable {
      staged.fill();
      auto& in = staged.ins;
      for (size_t i = 0; i < kv.size(); i++)
        if (copy[i]) std::memcpy(kv[i].data<char>(), in[from[i]].data<char>(), kv[i].nbytes());
      run(s, in, h.data<float>(), kv);
    });
  }
  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("appliance decode_layer runs on the CPU only");
  }
  const char* name() const override { return "ApplianceDecodeLayer"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    return s_ == static_cast<const DecodeLayer&>(other).s_;
  }

 private:
  Shape s_;
};

void need(bool ok, const char* what) {
  if (!ok) throw std::invalid_argument(std::string("decode_layer: ") + what);
}

void need_f32(const mx::array& a, int64_t size, const char* what) {
  need(a.dtype() == mx::float32 && a.ndim() == 1 && a.shape(0) == size, what);
}

// A layer's weights and shape, checked once when the model is read (the inputs after h,
// the buffers and the offsets: inv_freq, the norms, q/k norms, biases, linears).
struct LayerWeights {
  Shape s;  // but for at, first and the mask: each step's
  std::vector<mx::array> arrays;
  int64_t hidden;
};

// linears: q, k, v, o, gate, up, down, each as (tiles, scales, biases), 21 arrays.
LayerWeights layer_weights(const std::vector<mx::array>& norms,
                           const std::vector<mx::array>& qk_norms,
                           const std::vector<mx::array>& biases,
                           const std::vector<mx::array>& linears, int group, int heads,
                           int kv_heads, int head_dim, int dims, bool traditional,
                           const mx::array& inv_freq, float rope_scale, float attn_scale,
                           const std::vector<float>& eps) {
  need(norms.size() == 2 && (qk_norms.empty() || qk_norms.size() == 2) &&
           (biases.empty() || biases.size() == 3) && linears.size() == 3 * LINEARS &&
           eps.size() == 3,
       "two norms, none or two q/k norms, none or three biases, 21 linear arrays, three eps");
  const int64_t d = head_dim, dm = norms[0].ndim() == 1 ? norms[0].shape(0) : 0;
  need(kv_heads > 0 && heads % kv_heads == 0 && d > 0, "heads must be a multiple of KV heads");
  need(dims > 0 && dims % 2 == 0 && dims <= d, "RoPE dims must be even, at most d");
  need(inv_freq.dtype() == mx::float32 && inv_freq.ndim() == 1 && inv_freq.shape(0) == dims / 2,
       "inv_freq must be float32 [dims / 2]");
  need(group == 32 || group == 64 || group == 128, "group size must be 32, 64 or 128");
  need_f32(norms[0], dm, "norm weights must be float32 [D]");
  need_f32(norms[1], dm, "norm weights must be float32 [D]");
  for (const auto& w : qk_norms) need_f32(w, d, "q/k norm weights must be float32 [d]");
  const int64_t widths[LINEARS] = {heads * d, kv_heads * d, kv_heads * d, dm, -1, -1, dm};
  const int64_t inter = linears[3 * 4 + 1].ndim() == 3 ? linears[3 * 4 + 1].shape(0) * 16 : 0;
  const int64_t ks[LINEARS] = {dm, dm, dm, heads * d, dm, dm, inter};
  for (int i = 0; i < 3 && !biases.empty(); i++)
    need_f32(biases[i], widths[i], "q/k/v biases must be float32 of their outputs");
  const mx::Dtype sd = linears[1].dtype();
  std::array<int, LINEARS> bits{};
  for (int i = 0; i < LINEARS; i++) {
    const mx::array &t = linears[3 * i], &sc = linears[3 * i + 1], &bi = linears[3 * i + 2];
    const int64_t n = widths[i] < 0 ? inter : widths[i];
    const int32_t tn = static_cast<int32_t>((n + 15) / 16);
    need(n > 0 && n % 16 == 0 && ks[i] % group == 0, "N a multiple of 16, K of the group size");
    bits[i] = t.ndim() == 2 && t.shape(1) == ks[i] * 16 ? 8 : 4;
    need(t.dtype() == mx::uint8 &&
             t.shape() == mx::Shape({tn, static_cast<int32_t>(ks[i] * 2 * bits[i])}),
         "tiles must be uint8 [N / 16, K * 8] (8-bit: K * 16)");
    need(sc.shape() == mx::Shape({tn, static_cast<int32_t>(ks[i] / group), 16}) &&
             bi.shape() == sc.shape() && sc.dtype() == sd && bi.dtype() == sd,
         "scales and biases must be [N / 16, K / group, 16], one dtype");
  }
  LayerWeights w{{group, heads, kv_heads, d, inter, dims, traditional, !qk_norms.empty(),
                  !biases.empty(), fk::NO_MASK, 0, 0, 0, {}, rope_scale, attn_scale, eps[0],
                  eps[1], eps[2], sd, bits},
                 {inv_freq},
                 dm};
  for (const auto* list : {&norms, &qk_norms, &biases, &linears})
    w.arrays.insert(w.arrays.end(), list->begin(), list->end());
  return w;
}

std::vector<mx::array> decode_layer(const mx::array& h, const mx::array& keys,
                                    const mx::array& values, const mx::array& offset,
                                    const std::optional<mx::array>& mask,
                                    const LayerWeights& w, int at, int first,
                                    const std::vector<mx::array>& chunk_kv,
                                    const std::vector<int64_t>& chunk_at,
                                    const std::vector<int64_t>& chunk_len, int64_t span) {
  Shape s = w.s;
  need(h.dtype() == mx::float32 && h.ndim() == 2 && h.shape(1) == w.hidden,
       "h must be float32 [B + T, D]");
  const auto buffers = [&](const mx::array& k, const mx::array& v) {
    return k.dtype() == keys.dtype() && v.dtype() == keys.dtype() && k.ndim() == 4 &&
           k.shape() == v.shape() && k.shape(1) == s.kv && k.shape(3) == s.d;
  };
  need(keys.dtype() == mx::float32 || keys.dtype() == mx::float16,
       "keys and values must be float32 or float16");
  need(buffers(keys, values), "keys and values must be [R, KV, W, d], one shape and dtype");
  need(chunk_kv.size() == 2 * chunk_at.size() && chunk_at.size() == chunk_len.size(),
       "each chunk needs its keys, values, offset and length");
  int64_t tokens = 0;
  for (size_t c = 0; c < chunk_at.size(); c++) {
    const mx::array &ck = chunk_kv[2 * c], &cv = chunk_kv[2 * c + 1];
    need(buffers(ck, cv) && ck.shape(0) == 1, "a chunk's keys and values must be "
         "[1, KV, W, d], one shape, the decode buffers' dtype");
    need(chunk_len[c] >= 1 && chunk_at[c] >= 0 && chunk_at[c] + chunk_len[c] <= ck.shape(2),
         "a chunk's positions must lie in its buffers");
    tokens += chunk_len[c];
    s.chunks.insert(s.chunks.end(), {chunk_at[c], chunk_len[c]});
  }
  const int64_t b = h.shape(0) - tokens;
  need(span >= 1 && b % span == 0, "span must be at least 1 and divide h's decode rows");
  need(span == 1 || !mask || (mask->ndim() == 4 && mask->shape(0) == b / span &&
                              mask->shape(2) == span && mask->shape(3) == at + span - first),
       "a span's mask must be [B, 1 or H, span, L + span - 1]");
  s.span = span;
  s.rows = b / span;
  need(b >= 1 && s.rows <= keys.shape(0), "B rows must fit the buffers' rows");
  need(first >= 0 && first <= at && at + span <= keys.shape(2),
       "positions first..at + span - 1 must lie in W");
  need(offset.dtype() == mx::int32 && offset.ndim() == 1 &&
           (offset.size() == 1 || static_cast<int64_t>(offset.size()) == s.rows),
       "offset must be int32 [1] or [B]");
  s.at = at;
  s.first = first;
  std::vector<mx::array> ins = {h, keys, values, offset};
  ins.insert(ins.end(), w.arrays.begin(), w.arrays.end());
  if (mask) {
    const mx::array& m = *mask;
    need(m.dtype() == mx::bool_ || m.dtype() == mx::float32, "the mask is boolean or float32");
    need(m.ndim() >= 1 && m.ndim() <= 4 && m.shape(-1) == at + span - first &&
             (m.ndim() < 4 || m.shape(0) == 1 || m.shape(0) == s.rows),
         "the mask must broadcast to [B, H, 1, L]");
    s.mask_kind = m.dtype() == mx::bool_ ? fk::BOOL_MASK : fk::ADD_MASK;
    ins.push_back(m);
  }
  std::vector<mx::Shape> shapes = {h.shape(), keys.shape(), values.shape()};
  for (const auto& a : chunk_kv) shapes.push_back(a.shape());
  ins.insert(ins.end(), chunk_kv.begin(), chunk_kv.end());
  auto stream = mx::to_stream({}, mx::Device::cpu);
  std::vector<mx::Dtype> dtypes(shapes.size(), keys.dtype());
  dtypes[0] = mx::float32;
  return mx::array::make_arrays(shapes, dtypes, std::make_shared<DecodeLayer>(stream, s), ins);
}

}  // namespace

void define_layer(nb::module_& m) {
  nb::class_<LayerWeights>(m, "DecodeLayerWeights",
                           "A layer's arrays and shape for decode_layer, checked once.");
  m.def("decode_layer_weights", &layer_weights, nb::arg("norms"), nb::arg("qk_norms"),
        nb::arg("biases"), nb::arg("linears"), nb::arg("group_size"), nb::arg("heads"),
        nb::arg("kv_heads"), nb::arg("head_dim"), nb::arg("dims"), nb::arg("traditional"),
        nb::arg("inv_freq"), nb::arg("rope_scale"), nb::arg("attn_scale"), nb::arg("eps"),
        "A pre-norm layer's weights for decode_layer: its two norms, q/k norms and q/k/v "
        "biases (none where it has none), q, k, v, o, gate, up and down as tiles, scales and "
        "biases (21 arrays), its RoPE's inverse frequencies; checked once.");
  m.def("decode_layer", &decode_layer, nb::arg("h"), nb::arg("keys"), nb::arg("values"),
        nb::arg("offset"), nb::arg("mask").none(), nb::arg("layer"), nb::arg("at"),
        nb::arg("first"), nb::arg("chunk_kv") = std::vector<mx::array>{},
        nb::arg("chunk_at") = std::vector<int64_t>{},
        nb::arg("chunk_len") = std::vector<int64_t>{}, nb::arg("span") = 1,
        "A pre-norm decoder layer's decode step (Llama, Qwen 2 and 3; tiled 4- or 8-bit "
        "weights) in one operation: [h + attention + MLP, keys, values], the new KV at `at` "
        "of rows 0..B-1, "
        "attention over first..at (appliance/backend/native/decode_layer.cpp). Prompt chunks "
        "may ride after the B rows of h: chunk c's length tokens at positions chunk_at[c].., "
        "its keys and values (chunk_kv[2c], [2c + 1], [1, KV, W, d]) written there and "
        "returned after the batch's, its queries attending causally over its own keys. "
        "span > 1: h's first B * span rows are span tokens a row at at.. (a verify of "
        "drafts), each attending over first..its own position (and the mask [B, 1, span, "
        "L + span - 1], where there is one).");
  m.def("rope_inv_freq", &fk::rope_inv_freq, nb::arg("half"), nb::arg("base"),
        "RoPE's inverse frequencies for a base, as rope computes them (float32 [half]).");
}
