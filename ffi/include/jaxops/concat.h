// ConcatTraining / SplitTraining layout, written once for the CPU handler and the CUDA kernel.
//
// Both ops move bytes only, so they are typeless: every tensor is viewed as a byte matrix
// [outer, row] with outer = prod(d[:axis]) and row = prod(d[axis:]) * itemsize. Piece k (an
// input of Concat, an output of Split) occupies the byte columns [offset_k, offset_k + row_k)
// of every row of the whole tensor (Concat's output, Split's input), whose row is `whole_row`.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "jaxops/checks.h"
#include "jaxops/dtype.h"

namespace jaxops::concat {

struct Piece {
  const void* data;  // Concat: the input read; Split: the output written (cast back)
  int64_t row;       // bytes of one row of this piece
  int64_t offset;    // byte column of the piece in a row of the whole tensor
};

struct Plan {
  int64_t outer = 1;      // rows
  int64_t whole_row = 0;  // bytes of one row of the whole tensor
  std::vector<Piece> pieces;  // non-empty pieces only, in order
};

// Checks that `pieces` (dims + data) tile `whole` along `axis` and builds the plan.
// Returns an error message, empty when the arguments are valid.
inline std::string make_plan(const ffi::AnyBuffer& whole,
                             const std::vector<std::pair<ffi::AnyBuffer, const void*>>& pieces,
                             int64_t axis, Plan* plan) {
  // Types first: the byte sizes below hold for whole-byte element types only.
  if (auto err = check_type("tensor", whole.element_type(), kWholeByteTypes); !err.empty())
    return err;
  for (const auto& piece : pieces)
    if (piece.first.element_type() != whole.element_type()) return "all tensors must share one dtype";
  auto wd = whole.dimensions();
  const int64_t rank = static_cast<int64_t>(wd.size());
  if (rank == 0) return "tensors must have rank >= 1";
  if (axis < 0 || axis >= rank) return "axis " + std::to_string(axis) + " out of range";
  if (pieces.empty()) return "needs at least one piece";
  const size_t item = ffi::ByteWidth(whole.element_type());
  *plan = Plan{};
  int64_t inner = 1;  // elements of one row of d[axis+1:]
  for (int64_t i = 0; i < rank; ++i) {
    if (i < axis) plan->outer *= wd[i];
    if (i > axis) inner *= wd[i];
  }
  int64_t along = 0;  // extent covered so far along axis
  for (const auto& [buf, data] : pieces) {
    auto d = buf.dimensions();
    if (static_cast<int64_t>(d.size()) != rank) return "all tensors must share one rank";
    for (int64_t i = 0; i < rank; ++i)
      if (i != axis && d[i] != wd[i]) return "tensors differ in a dim other than axis";
    const int64_t row = d[axis] * inner * static_cast<int64_t>(item);
    const int64_t offset = along * inner * static_cast<int64_t>(item);
    along += d[axis];
    if (row > 0) plan->pieces.push_back(Piece{data, row, offset});
  }
  if (along != wd[axis]) return "the pieces' extents along axis do not add up to the whole";
  plan->whole_row = wd[axis] * inner * static_cast<int64_t>(item);
  return {};
}

// Copies row r of piece p between the piece and the whole tensor: whole -> piece for Split,
// piece -> whole for Concat. Host only; the CUDA kernel does the same per vector.
inline void copy_row_host(const Plan& plan, const Piece& p, int64_t r, bool split, void* whole) {
  char* w = static_cast<char*>(whole) + r * plan.whole_row + p.offset;
  char* q = static_cast<char*>(const_cast<void*>(p.data)) + r * p.row;
  if (split) std::memcpy(q, w, static_cast<size_t>(p.row));
  else std::memcpy(w, q, static_cast<size_t>(p.row));
}

// The FFI signatures both platforms share, appended to a binding (the CUDA one starts with
// its stream). Concat: (inputs...) -> output; Split: (input) -> (outputs...). Attribute axis
// (>= 0). Split's piece extents are its outputs' extents along axis.
template <typename Binding>
auto bind_concat(Binding b) {
  return std::move(b).RemainingArgs().template Ret<ffi::AnyBuffer>().template Attr<int64_t>("axis");
}
template <typename Binding>
auto bind_split(Binding b) {
  return std::move(b).template Arg<ffi::AnyBuffer>().RemainingRets().template Attr<int64_t>("axis");
}

// Gathers the pieces of a call: the remaining args (Concat) or rets (Split).
inline std::string concat_pieces(const ffi::RemainingArgs& args,
                                 std::vector<std::pair<ffi::AnyBuffer, const void*>>* out) {
  for (size_t i = 0; i < args.size(); ++i) {
    auto a = args.get<ffi::AnyBuffer>(i);
    if (a.has_error()) return "input " + std::to_string(i) + " is not a buffer";
    out->emplace_back(*a, a->untyped_data());
  }
  return {};
}
inline std::string split_pieces(const ffi::RemainingRets& rets,
                                std::vector<std::pair<ffi::AnyBuffer, const void*>>* out) {
  for (size_t i = 0; i < rets.size(); ++i) {
    auto r = rets.get<ffi::AnyBuffer>(i);
    if (r.has_error()) return "output " + std::to_string(i) + " is not a buffer";
    ffi::AnyBuffer buf = **r;
    out->emplace_back(buf, buf.untyped_data());
  }
  return {};
}

}  // namespace jaxops::concat
