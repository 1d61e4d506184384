// staging.h: a primitive's inputs as its task reads them, row-contiguous.
//
// The appliance's primitives read their inputs in row order. They used to get them through
// Contiguous nodes added when the graph was built, which copy nothing where the input turns
// out contiguous but cost the step a node each: MLX handles every node of a graph on the
// engine's thread before its task runs, and a 4-bit decode step of SmolLM2 had 331 of
// them among 1,311 nodes (docs/decisions.md). Here an input that is not row-contiguous when
// the primitive is evaluated gets a contiguous temporary, filled at the start of the
// primitive's own task.

#pragma once

#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "mlx/allocator.h"
#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"

namespace staging {

namespace mx = mlx::core;

// src's elements in row order into dst (row-contiguous, same shape and item size).
inline void copy_rows(const mx::array& src, mx::array& dst) {
  if (src.size() == 0) return;
  const int64_t item = static_cast<int64_t>(src.itemsize());
  const int nd = static_cast<int>(src.ndim());
  const char* in = src.data<char>();
  char* out = dst.data<char>();
  if (nd == 0) {
    std::memcpy(out, in, item);
    return;
  }
  const int64_t inner = src.shape(nd - 1), stride = src.strides()[nd - 1];
  const int64_t rows = static_cast<int64_t>(src.size()) / inner;
  std::vector<int64_t> index(nd, 0);
  for (int64_t r = 0; r < rows; r++) {
    int64_t off = 0;
    for (int d = 0; d < nd - 1; d++) off += index[d] * src.strides()[d];
    const char* p = in + off * item;
    if (stride == 1) {
      std::memcpy(out, p, inner * item);
    } else {
      for (int64_t i = 0; i < inner; i++) std::memcpy(out + i * item, p + i * stride * item, item);
    }
    out += inner * item;
    for (int d = nd - 2; d >= 0 && ++index[d] == src.shape(d); d--) index[d] = 0;
  }
}

// The inputs' weak copies for a primitive's task, registered with the encoder; where one is
// not row-contiguous, a contiguous temporary stands in for it, filled by fill() at the
// start of the task.
struct Staged {
  std::vector<mx::array> ins;
  std::vector<std::pair<mx::array, mx::array>> copies;  // (input, its temporary)

  void fill() {
    for (auto& [src, dst] : copies) copy_rows(src, dst);
  }
};

inline bool row_contiguous(const mx::array& a) { return a.flags().row_contiguous; }

// `readable`: which inputs the task reads as they lie (by default the row-contiguous ones;
// a primitive that reads strides takes more).
inline Staged stage(mx::cpu::CommandEncoder& enc, const std::vector<mx::array>& inputs,
                    bool (*readable)(const mx::array&) = row_contiguous) {
  Staged st;
  for (const auto& a : inputs) {
    enc.set_input_array(a);
    if (readable(a)) {
      st.ins.push_back(mx::array::unsafe_weak_copy(a));
      continue;
    }
    mx::array tmp(a.shape(), a.dtype(), nullptr, {});
    tmp.set_data(mx::allocator::malloc(tmp.nbytes()));
    enc.add_temporary(tmp);
    st.copies.emplace_back(mx::array::unsafe_weak_copy(a), mx::array::unsafe_weak_copy(tmp));
    st.ins.push_back(mx::array::unsafe_weak_copy(tmp));
  }
  return st;
}

}  // namespace staging
