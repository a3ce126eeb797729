// SPDX-License-Identifier: Apache-2.0
// SelfCommunicator, on every rank of the job: a group of one where each collective is a copy.
#include <cstdint>
#include <vector>

#include "collective_checks.hpp"
#include "dcpattn/comm/self.hpp"
#include "dcpattn/core/numeric.hpp"
#include "support/catch.hpp"

using dcpattn::SelfCommunicator;

TEST_CASE("SelfCommunicator is a group of one", "[comm][self]") {
  const SelfCommunicator c;
  CHECK(c.rank() == 0);
  CHECK(c.size() == 1);
  static_assert(SelfCommunicator{}.rank() == 0 && SelfCommunicator{}.size() == 1);
}

TEST_CASE("SelfCommunicator all_gather copies", "[comm][self]") {
  SelfCommunicator c;
  dcpattn::test::check_all_gather<float>(c);
  dcpattn::test::check_all_gather<std::uint8_t>(c);
}

TEST_CASE("SelfCommunicator all_to_all copies", "[comm][self]") {
  SelfCommunicator c;
  dcpattn::test::check_all_to_all<float>(c);
  dcpattn::test::check_all_to_all<dcpattn::bfloat16>(c);
  dcpattn::test::check_all_to_all<std::uint8_t>(c);
}

TEST_CASE("SelfCommunicator reduce_scatter_sum copies", "[comm][self]") {
  SelfCommunicator c;
  dcpattn::test::check_reduce_scatter_sum(c);
}

TEST_CASE("SelfCommunicator moves any trivially copyable element", "[comm][self]") {
  struct Pair {
    std::int32_t a;
    float b;
  };
  SelfCommunicator c;
  const std::vector<Pair> send = {{1, 0.5f}, {-2, 1.5f}, {3, -2.5f}};
  std::vector<Pair> recv(send.size(), Pair{0, 0.0f});
  c.all_to_all(send.data(), recv.data(), send.size());
  for (std::size_t i = 0; i < send.size(); ++i) {
    INFO("i = " << i);
    CHECK(recv[i].a == send[i].a);
    CHECK(recv[i].b == send[i].b);
  }
}

TEST_CASE("SelfCommunicator barrier and all_reduce_max_int", "[comm][self]") {
  SelfCommunicator c;
  c.barrier();
  c.barrier(dcpattn::HostStream{});
  CHECK(c.all_reduce_max_int(7) == 7);
  CHECK(c.all_reduce_max_int(-3) == -3);
}
