// SPDX-License-Identifier: Apache-2.0
// The Communicator concept: the shipped host models satisfy it, and types that miss any required
// member or element type do not.
#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>

#include "dcpattn/comm/communicator.hpp"
#include "dcpattn/comm/mpi.hpp"
#include "dcpattn/comm/self.hpp"
#include "support/catch.hpp"

namespace {

using dcpattn::bfloat16;
using dcpattn::Communicator;
using dcpattn::HostStream;

// A minimal user model: templated collectives, its own stream type. Declared only; the concept
// checks expressions without calling them.
struct UserStream {};
struct UserCommunicator {
  using stream_type = UserStream;
  int rank() const;
  int size() const;
  template <class T>
  void all_gather(const T*, T*, std::size_t, UserStream);
  template <class T>
  void all_to_all(const T*, T*, std::size_t, UserStream);
  void reduce_scatter_sum(const float*, float*, std::size_t, UserStream);
  void barrier(UserStream);
};

// Each of these drops one requirement of UserCommunicator.
struct NoStreamType {
  int rank() const;
  int size() const;
  template <class T>
  void all_gather(const T*, T*, std::size_t, HostStream);
  template <class T>
  void all_to_all(const T*, T*, std::size_t, HostStream);
  void reduce_scatter_sum(const float*, float*, std::size_t, HostStream);
  void barrier(HostStream);
};
struct NoBarrier {
  using stream_type = HostStream;
  int rank() const;
  int size() const;
  template <class T>
  void all_gather(const T*, T*, std::size_t, HostStream);
  template <class T>
  void all_to_all(const T*, T*, std::size_t, HostStream);
  void reduce_scatter_sum(const float*, float*, std::size_t, HostStream);
};
struct NonConstRank {  // rank() must be callable on a const communicator
  using stream_type = HostStream;
  int rank();
  int size() const;
  template <class T>
  void all_gather(const T*, T*, std::size_t, HostStream);
  template <class T>
  void all_to_all(const T*, T*, std::size_t, HostStream);
  void reduce_scatter_sum(const float*, float*, std::size_t, HostStream);
  void barrier(HostStream);
};
struct FloatOnlyAllToAll {  // all_to_all must also move bfloat16 and uint8_t
  using stream_type = HostStream;
  int rank() const;
  int size() const;
  template <class T>
  void all_gather(const T*, T*, std::size_t, HostStream);
  void all_to_all(const float*, float*, std::size_t, HostStream);
  void reduce_scatter_sum(const float*, float*, std::size_t, HostStream);
  void barrier(HostStream);
};
struct NoReduceScatter {
  using stream_type = HostStream;
  int rank() const;
  int size() const;
  template <class T>
  void all_gather(const T*, T*, std::size_t, HostStream);
  template <class T>
  void all_to_all(const T*, T*, std::size_t, HostStream);
  void barrier(HostStream);
};
struct WrongStream {  // collectives must take the communicator's own stream_type
  using stream_type = UserStream;
  int rank() const;
  int size() const;
  template <class T>
  void all_gather(const T*, T*, std::size_t, HostStream);
  template <class T>
  void all_to_all(const T*, T*, std::size_t, HostStream);
  void reduce_scatter_sum(const float*, float*, std::size_t, HostStream);
  void barrier(HostStream);
};

static_assert(Communicator<dcpattn::SelfCommunicator>, DCPATTN_COMMUNICATOR_MESSAGE);
static_assert(Communicator<dcpattn::MpiCommunicator>, DCPATTN_COMMUNICATOR_MESSAGE);
static_assert(Communicator<UserCommunicator>, DCPATTN_COMMUNICATOR_MESSAGE);

static_assert(!Communicator<int>);
static_assert(!Communicator<void*>);
static_assert(!Communicator<dcpattn::SelfCommunicator*>);
static_assert(!Communicator<HostStream>);
static_assert(!Communicator<NoStreamType>);
static_assert(!Communicator<NoBarrier>);
static_assert(!Communicator<NonConstRank>);
static_assert(!Communicator<FloatOnlyAllToAll>);
static_assert(!Communicator<NoReduceScatter>);
static_assert(!Communicator<WrongStream>);

static_assert(std::is_empty_v<HostStream>);
static_assert(std::is_same_v<dcpattn::SelfCommunicator::stream_type, HostStream>);
static_assert(std::is_same_v<dcpattn::MpiCommunicator::stream_type, HostStream>);
static_assert(!std::is_copy_constructible_v<dcpattn::MpiCommunicator>);
static_assert(std::is_nothrow_move_constructible_v<dcpattn::MpiCommunicator>);
static_assert(std::is_nothrow_move_assignable_v<dcpattn::MpiCommunicator>);

template <class C>
constexpr bool satisfies = Communicator<C>;

}  // namespace

TEST_CASE("the shipped host communicators satisfy Communicator", "[comm][concept]") {
  CHECK(satisfies<dcpattn::SelfCommunicator>);
  CHECK(satisfies<dcpattn::MpiCommunicator>);
  CHECK(satisfies<UserCommunicator>);
}

TEST_CASE("types missing a requirement do not satisfy Communicator", "[comm][concept]") {
  CHECK(!satisfies<int>);
  CHECK(!satisfies<NoStreamType>);
  CHECK(!satisfies<NoBarrier>);
  CHECK(!satisfies<NonConstRank>);
  CHECK(!satisfies<FloatOnlyAllToAll>);
  CHECK(!satisfies<NoReduceScatter>);
  CHECK(!satisfies<WrongStream>);
}

TEST_CASE("the concept message names the concept and its header", "[comm][concept]") {
  const std::string message = DCPATTN_COMMUNICATOR_MESSAGE;
  CHECK(message.rfind("dcpattn: the communicator does not satisfy Communicator: ", 0) == 0);
  CHECK(message.find("dcpattn/comm/communicator.hpp") != std::string::npos);
}
