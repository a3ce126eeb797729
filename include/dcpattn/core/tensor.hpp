// SPDX-License-Identifier: Apache-2.0
// How tensors cross the API: cuda::std::mdspan views (libcu++), strided so a caller's own layouts
// plug in without copies. Shapes are written (tokens, heads, dim) in doc comments.
#pragma once

#include <cuda/std/array>
#include <cstddef>
#include <cstdint>

#include <cuda/std/mdspan>
#include <cuda/std/span>

#include "dcpattn/config.hpp"

DCPATTN_NAMESPACE_BEGIN

/// Rank-R view with 64-bit runtime extents and arbitrary strides (in elements).
template <class T, std::size_t R>
using TensorView =
    cuda::std::mdspan<T, cuda::std::dextents<std::int64_t, R>, cuda::std::layout_stride>;

/// Contiguous row-major rank-R view.
template <class T, std::size_t R>
using DenseView = cuda::std::mdspan<T, cuda::std::dextents<std::int64_t, R>>;

/// A row-major TensorView over contiguous memory: make_view(ptr, {tokens, heads, dim}).
template <class T, std::size_t R>
TensorView<T, R> make_view(T* data, const std::int64_t (&extents)[R]) {
  cuda::std::array<std::int64_t, R> ext{};
  cuda::std::array<std::int64_t, R> strides{};
  std::int64_t s = 1;
  for (std::size_t i = R; i-- > 0;) {
    ext[i] = extents[i];
    strides[i] = s;
    s *= extents[i];
  }
  using Ext = cuda::std::dextents<std::int64_t, R>;
  return TensorView<T, R>(data, cuda::std::layout_stride::mapping<Ext>(Ext(ext), strides));
}

/// A TensorView with explicit strides (in elements).
template <class T, std::size_t R>
TensorView<T, R> make_view(T* data, const std::int64_t (&extents)[R],
                           const std::int64_t (&strides)[R]) {
  cuda::std::array<std::int64_t, R> ext{}, str{};
  for (std::size_t i = 0; i < R; ++i) {
    ext[i] = extents[i];
    str[i] = strides[i];
  }
  using Ext = cuda::std::dextents<std::int64_t, R>;
  return TensorView<T, R>(data, cuda::std::layout_stride::mapping<Ext>(Ext(ext), str));
}

DCPATTN_NAMESPACE_END
