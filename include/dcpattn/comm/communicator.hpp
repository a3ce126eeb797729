// SPDX-License-Identifier: Apache-2.0
// The Communicator concept: the collectives a DCP group needs, on the group's own buffers.
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <string>

#include "dcpattn/config.hpp"
#include "dcpattn/core/numeric.hpp"
#include "dcpattn/error.hpp"

DCPATTN_NAMESPACE_BEGIN

/// The stream type of host communicators (SelfCommunicator, MpiCommunicator): their collectives
/// are blocking, so there is nothing to order against and the stream carries no state.
struct HostStream {};

/// Requirements on a Communicator model C over a group of N = cc.size() ranks. `n` is always the
/// per-rank element count and must be the same on every rank; every rank calls the same
/// collectives in the same order. Buffers live where C says (host memory for host communicators,
/// device memory for NcclCommunicator); send and receive buffers must not overlap.
///   - typename C::stream_type           the stream collectives are ordered on (HostStream on host)
///   - cc.rank() -> int                  this process's rank in [0, N)
///   - cc.size() -> int                  N >= 1
///   - c.all_gather(send, recv, n, s)    send (n), recv (N * n): rank-major concatenation, recv
///                                       chunk r holds rank r's n elements
///   - c.all_to_all(send, recv, n, s)    send (N * n): chunk d goes to rank d; recv (N * n): chunk
///                                       r came from rank r
///   - c.reduce_scatter_sum(send, recv, n, s)  send (N * n) floats; recv (n): elementwise sum over
///                                       ranks of chunk rank()
///   - c.barrier(s)                      nothing after it (in host order, or in stream order on
///                                       s) proceeds before every rank has reached it
/// all_gather must accept float and std::uint8_t elements, all_to_all float, bfloat16 and
/// std::uint8_t, reduce_scatter_sum float. Models usually template the first two over any
/// trivially copyable element type.
template <class C>
concept Communicator = requires(C& c, const C& cc, typename C::stream_type s, const float* cf,
                                float* f, const bfloat16* cb, bfloat16* b, const std::uint8_t* cu,
                                std::uint8_t* u, std::size_t n) {
  typename C::stream_type;
  { cc.rank() } -> std::convertible_to<int>;
  { cc.size() } -> std::convertible_to<int>;
  c.all_gather(cf, f, n, s);
  c.all_gather(cu, u, n, s);
  c.all_to_all(cf, f, n, s);
  c.all_to_all(cb, b, n, s);
  c.all_to_all(cu, u, n, s);
  c.reduce_scatter_sum(cf, f, n, s);
  c.barrier(s);
};

/// The message every consumer of a communicator gives when the type does not conform.
#define DCPATTN_COMMUNICATOR_MESSAGE                                                         \
  "dcpattn: the communicator does not satisfy Communicator: it must define stream_type and " \
  "provide rank(), size(), all_gather(send, recv, n, stream) for float and uint8_t, "        \
  "all_to_all(send, recv, n, stream) for float, bfloat16 and uint8_t, "                      \
  "reduce_scatter_sum(send, recv, n, stream) for float and barrier(stream) "                 \
  "(see dcpattn/comm/communicator.hpp)"

/// The message of a collective called with an element type it cannot move.
#define DCPATTN_COLLECTIVE_ELEMENT_MESSAGE \
  "dcpattn: collective element types must be trivially copyable (they are moved as bytes)"

namespace detail {

/// Refuses a DCP split of a tensor-parallel group of `tp_size` ranks into groups of `dcp_size`
/// consecutive ranks unless dcp_size >= 1 divides tp_size. The same check on every rank, with no
/// communication, so every rank throws or none does.
inline void require_dcp_split(int tp_size, int dcp_size) {
  DCPATTN_REQUIRE(dcp_size >= 1, "dcp_size (" + std::to_string(dcp_size) + ") must be >= 1");
  DCPATTN_REQUIRE(tp_size % dcp_size == 0, "dcp_size (" + std::to_string(dcp_size) +
                                               ") must divide the tensor-parallel group size (" +
                                               std::to_string(tp_size) + ")");
}

}  // namespace detail

DCPATTN_NAMESPACE_END
