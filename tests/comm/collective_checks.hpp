// SPDX-License-Identifier: Apache-2.0
// Checks of the Communicator collectives that hold for any model on host buffers: every rank fills
// its send buffer from a formula of (rank, index) and checks what it receives against the same
// formula, evaluated independently on the receiving side. Every rank must call each check with the
// same arguments, in the same order.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "dcpattn/comm/communicator.hpp"
#include "dcpattn/core/numeric.hpp"
#include "support/catch.hpp"

namespace dcpattn::test {

/// The per-rank counts every collective is checked with (0 included: a no-op on every rank).
inline constexpr std::size_t collective_counts[] = {0, 1, 7, 1000};

/// Element i of rank r's all_gather contribution.
template <class T>
T gather_value(int r, std::size_t i);
template <>
inline float gather_value<float>(int r, std::size_t i) {
  return float(r * 10007 + int(i));  // exact: below 2^24
}
template <>
inline std::uint8_t gather_value<std::uint8_t>(int r, std::size_t i) {
  return std::uint8_t((r * 37 + int(i) * 3 + 1) & 0xff);
}

/// Element i of the chunk that rank `src` sends to rank `dst` in all_to_all.
template <class T>
T exchange_value(int src, int dst, std::size_t i);
template <>
inline float exchange_value<float>(int src, int dst, std::size_t i) {
  return float(src * 1000000 + dst * 10000 + int(i));  // exact: below 2^24 for i < 10000
}
template <>
inline bfloat16 exchange_value<bfloat16>(int src, int dst, std::size_t i) {
  return bfloat16::from_float(float(src * 64 + dst * 8) + float(i % 8) * 0.125f + float(i) * 1e-3f);
}
template <>
inline std::uint8_t exchange_value<std::uint8_t>(int src, int dst, std::size_t i) {
  return std::uint8_t((src * 59 + dst * 13 + int(i) * 7 + 3) & 0xff);
}

/// Element i of chunk d of rank r's reduce_scatter_sum input: small integers, so every sum is
/// exact whatever the summation order.
inline float reduce_value(int r, int d, std::size_t i) {
  return float((r + 1) * (d + 2) + int(i % 17) - 8);
}

/// Index of the first element of `got` that differs from expected(index), or -1.
template <class T, class Expected>
long first_mismatch(const std::vector<T>& got, Expected expected) {
  for (std::size_t k = 0; k < got.size(); ++k)
    if (!(got[k] == expected(k))) return long(k);
  return -1;
}

/// all_gather of T at every count: recv chunk r must be rank r's contribution.
template <class T, Communicator C>
void check_all_gather(C& c) {
  const int rank = c.rank(), size = c.size();
  for (const std::size_t n : collective_counts) {
    INFO("n = " << n << ", rank " << rank << " of " << size);
    std::vector<T> send(n), recv(std::size_t(size) * n);
    for (std::size_t i = 0; i < n; ++i) send[i] = gather_value<T>(rank, i);
    c.all_gather(send.data(), recv.data(), n, typename C::stream_type{});
    const long bad =
        first_mismatch(recv, [&](std::size_t k) { return gather_value<T>(int(k / n), k % n); });
    CHECK(bad == -1);
  }
}

/// all_to_all of T at every count: recv chunk r must be what rank r addressed to this rank.
template <class T, Communicator C>
void check_all_to_all(C& c) {
  const int rank = c.rank(), size = c.size();
  for (const std::size_t n : collective_counts) {
    INFO("n = " << n << ", rank " << rank << " of " << size);
    std::vector<T> send(std::size_t(size) * n), recv(std::size_t(size) * n);
    for (int d = 0; d < size; ++d)
      for (std::size_t i = 0; i < n; ++i)
        send[std::size_t(d) * n + i] = exchange_value<T>(rank, d, i);
    c.all_to_all(send.data(), recv.data(), n, typename C::stream_type{});
    const long bad = first_mismatch(
        recv, [&](std::size_t k) { return exchange_value<T>(int(k / n), rank, k % n); });
    CHECK(bad == -1);
  }
}

/// reduce_scatter_sum at every count: recv must be the sum over ranks of chunk rank().
template <Communicator C>
void check_reduce_scatter_sum(C& c) {
  const int rank = c.rank(), size = c.size();
  for (const std::size_t n : collective_counts) {
    INFO("n = " << n << ", rank " << rank << " of " << size);
    std::vector<float> send(std::size_t(size) * n), recv(n, -1.0f);
    for (int d = 0; d < size; ++d)
      for (std::size_t i = 0; i < n; ++i) send[std::size_t(d) * n + i] = reduce_value(rank, d, i);
    c.reduce_scatter_sum(send.data(), recv.data(), n, typename C::stream_type{});
    const long bad = first_mismatch(recv, [&](std::size_t i) {
      float sum = 0.0f;
      for (int r = 0; r < size; ++r) sum += reduce_value(r, rank, i);
      return sum;
    });
    CHECK(bad == -1);
  }
}

}  // namespace dcpattn::test
