// Argument checks and the check-and-dispatch step shared by handlers. Python validates first;
// these keep a handler safe if it is ever called with something else (they return errors,
// never assert).
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>
#include <type_traits>
#include <utility>

#include "jaxops/dtype.h"
#include "xla/ffi/api/ffi.h"

namespace jaxops {

inline bool same_dims(const xla::ffi::AnyBuffer& a, const xla::ffi::AnyBuffer& b) {
  auto da = a.dimensions(), db = b.dimensions();
  if (da.size() != db.size()) return false;
  for (size_t i = 0; i < da.size(); ++i)
    if (da[i] != db[i]) return false;
  return true;
}

inline xla::ffi::Error invalid(const std::string& op, const std::string& msg) {
  return xla::ffi::Error::InvalidArgument(op + ": " + msg);
}

// ---------------------------------------------------------------------------------------------
// Element types. A registered FFI target is public: anyone can call it with any element type
// through jax.ffi.ffi_call. Sub-byte types (int4, uint2, float4_e2m1fn, ...) pack several
// elements per byte, so sizes computed as elements * ByteWidth overrun them. Every handler
// therefore checks each buffer's type against the set it supports FIRST (in its family's
// shared check function, so CPU and CUDA agree), before any size arithmetic or copy.

using DataType = xla::ffi::DataType;
using Types = uint64_t;  // a set of element types, one bit per DataType (all codes are < 64)

constexpr Types types_of(std::initializer_list<DataType> list) {
  Types s = 0;
  for (DataType t : list) s |= Types(1) << static_cast<unsigned>(t);
  return s;
}

constexpr Types kFloatTypes =
    types_of({DataType::F32, DataType::F64, DataType::F16, DataType::BF16});
constexpr Types kIndexTypes = types_of({DataType::S32, DataType::S64});
// Every type stored in whole bytes per element: what the byte-moving Concat/Split handle.
constexpr Types kWholeByteTypes =
    kFloatTypes | types_of({DataType::PRED, DataType::S8, DataType::S16, DataType::S32,
                            DataType::S64, DataType::U8, DataType::U16, DataType::U32,
                            DataType::U64, DataType::C64, DataType::C128, DataType::F8E5M2,
                            DataType::F8E4M3, DataType::F8E4M3FN, DataType::F8E4M3B11FNUZ,
                            DataType::F8E5M2FNUZ, DataType::F8E4M3FNUZ, DataType::F8E3M4,
                            DataType::F8E8M0FNU});

inline const char* type_name(DataType t) {
  switch (t) {
    case DataType::PRED: return "bool";
    case DataType::S1: return "int1";
    case DataType::S2: return "int2";
    case DataType::S4: return "int4";
    case DataType::S8: return "int8";
    case DataType::S16: return "int16";
    case DataType::S32: return "int32";
    case DataType::S64: return "int64";
    case DataType::U1: return "uint1";
    case DataType::U2: return "uint2";
    case DataType::U4: return "uint4";
    case DataType::U8: return "uint8";
    case DataType::U16: return "uint16";
    case DataType::U32: return "uint32";
    case DataType::U64: return "uint64";
    case DataType::F16: return "float16";
    case DataType::F32: return "float32";
    case DataType::F64: return "float64";
    case DataType::BF16: return "bfloat16";
    case DataType::C64: return "complex64";
    case DataType::C128: return "complex128";
    case DataType::TOKEN: return "token";
    case DataType::F8E5M2: return "float8_e5m2";
    case DataType::F8E4M3: return "float8_e4m3";
    case DataType::F8E4M3FN: return "float8_e4m3fn";
    case DataType::F8E4M3B11FNUZ: return "float8_e4m3b11fnuz";
    case DataType::F8E5M2FNUZ: return "float8_e5m2fnuz";
    case DataType::F8E4M3FNUZ: return "float8_e4m3fnuz";
    case DataType::F8E3M4: return "float8_e3m4";
    case DataType::F4E2M1FN: return "float4_e2m1fn";
    case DataType::F8E8M0FNU: return "float8_e8m0fnu";
    default: return "an unknown type";
  }
}

inline bool has_type(Types ok, DataType t) {
  const unsigned code = static_cast<unsigned>(t);
  return code < 64 && (ok >> code) & 1;
}

// "<what> has unsupported dtype int4 (supported: float32, ...)" when t is not in `ok`, else "".
inline std::string check_type(const std::string& what, DataType t, Types ok) {
  if (has_type(ok, t)) return {};
  std::string names;
  for (unsigned code = 0; code < 64; ++code)
    if ((ok >> code) & 1) names += (names.empty() ? "" : ", ") +
                                   std::string(type_name(static_cast<DataType>(code)));
  return what + " has unsupported dtype " + type_name(t) + " (supported: " + names + ")";
}

// The same for every buffer of a variadic list (ffi::RemainingArgs or ffi::RemainingRets).
template <typename List>
std::string check_list_types(const char* what, const List& list, Types ok) {
  for (size_t i = 0; i < list.size(); ++i) {
    auto b = list.template get<xla::ffi::AnyBuffer>(i);
    if (b.has_error()) return std::string(what) + " " + std::to_string(i) + " is not a buffer";
    DataType t;
    if constexpr (std::is_same_v<List, xla::ffi::RemainingRets>) t = (*b)->element_type();
    else t = b->element_type();
    if (auto err = check_type(std::string(what) + " " + std::to_string(i), t, ok); !err.empty())
      return err;
  }
  return {};
}

// ---------------------------------------------------------------------------------------------
// The step every typed handler starts with, on both platforms:
//   View v;
//   return checked_dispatch(op, check_args(..., &v), x.element_type(), [&](auto tag) {
//     using T = decltype(tag);  // f32, f64, f16 or bf16 storage
//     ...                       // returns nothing (success) or an ffi::Error
//   });
// `err` is the family's check (from its header, so CPU and CUDA agree): a message naming the
// bad argument, empty when the arguments are valid. It checked the element types first, so the
// dispatch finds a type; "unsupported dtype" only guards a check that forgot to.
template <typename F>
xla::ffi::Error checked_dispatch(const char* op, const std::string& err, DataType dt, F&& f) {
  if (!err.empty()) return invalid(op, err);
  xla::ffi::Error result = xla::ffi::Error::Success();
  const bool ok = dispatch_float(dt, [&](auto tag) {
    if constexpr (std::is_void_v<decltype(f(tag))>) f(tag);
    else result = f(tag);
  });
  return ok ? std::move(result) : invalid(op, "unsupported dtype");
}

// The same for two float dtypes (an input's and an output's): f(T{}, O{}).
template <typename F>
xla::ffi::Error checked_dispatch(const char* op, const std::string& err, DataType t, DataType o,
                                 F&& f) {
  return checked_dispatch(op, err, t, [&](auto tt) {
    return checked_dispatch(op, {}, o, [&](auto oo) { return f(tt, oo); });
  });
}

}  // namespace jaxops
