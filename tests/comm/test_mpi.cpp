// SPDX-License-Identifier: Apache-2.0
// MpiCommunicator over MPI_COMM_WORLD and over DCP groups split from it. Every rank runs every
// collective, in the same order; value checks use CHECK so a wrong value never skips a collective.
#include <chrono>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <mpi.h>

#include "collective_checks.hpp"
#include "dcpattn/comm/mpi.hpp"
#include "dcpattn/core/numeric.hpp"
#include "dcpattn/error.hpp"
#include "support/catch.hpp"
#include "support/mpi_env.hpp"

using dcpattn::MpiCommunicator;
using dcpattn::test::world_rank;
using dcpattn::test::world_size;

namespace {

/// The message of the dcpattn::Error that split_dcp_group raises, or "" when it does not throw.
std::string split_refusal(int dcp_size) {
  try {
    MpiCommunicator group = MpiCommunicator::split_dcp_group(MPI_COMM_WORLD, dcp_size);
  } catch (const dcpattn::Error& e) {
    return e.message();
  }
  return "";
}

}  // namespace

TEST_CASE("MpiCommunicator owns a duplicate of its communicator", "[comm][mpi]") {
  MpiCommunicator c(MPI_COMM_WORLD);
  CHECK(c.rank() == world_rank());
  CHECK(c.size() == world_size());
  CHECK(dcpattn::error_rank() == world_rank());
  REQUIRE(c.comm() != MPI_COMM_NULL);
  CHECK(c.comm() != MPI_COMM_WORLD);
  int relation = MPI_UNEQUAL;
  MPI_Comm_compare(c.comm(), MPI_COMM_WORLD, &relation);
  CHECK(relation == MPI_CONGRUENT);

  SECTION("errors on the duplicate come back as dcpattn::Error") {
    // A send to a rank outside the group fails locally (no message is matched anywhere); with
    // MPI's default handler this would abort the job.
    const auto send_out_of_group = [&] {
      int x = 0;
      DCPATTN_MPI_CHECK(MPI_Send(&x, 1, MPI_INT, c.size() + 3, 0, c.comm()));
    };
    REQUIRE_THROWS_AS(send_out_of_group(), dcpattn::Error);
  }

  SECTION("moving transfers the communicator") {
    MPI_Comm handle = c.comm();
    MpiCommunicator moved(std::move(c));
    CHECK(moved.comm() == handle);
    CHECK(moved.size() == world_size());
    CHECK(c.comm() == MPI_COMM_NULL);
    CHECK(c.size() == 0);
    REQUIRE_THROWS_AS(c.barrier(), dcpattn::Error);  // local check, no communication
    MpiCommunicator assigned(MPI_COMM_WORLD);
    assigned = std::move(moved);
    CHECK(assigned.comm() == handle);
    CHECK(assigned.all_reduce_max_int(assigned.rank()) == world_size() - 1);
  }
}

TEST_CASE("MpiCommunicator all_gather", "[comm][mpi]") {
  MpiCommunicator c(MPI_COMM_WORLD);
  dcpattn::test::check_all_gather<float>(c);
  dcpattn::test::check_all_gather<std::uint8_t>(c);
}

TEST_CASE("MpiCommunicator all_to_all", "[comm][mpi]") {
  MpiCommunicator c(MPI_COMM_WORLD);
  dcpattn::test::check_all_to_all<float>(c);
  dcpattn::test::check_all_to_all<dcpattn::bfloat16>(c);
  dcpattn::test::check_all_to_all<std::uint8_t>(c);
}

TEST_CASE("MpiCommunicator all_to_all of an element without an MPI type", "[comm][mpi]") {
  struct Triple {  // 12 bytes: travels as a derived contiguous type
    std::int32_t src;
    std::int32_t dst;
    float x;
  };
  MpiCommunicator c(MPI_COMM_WORLD);
  const int size = c.size(), rank = c.rank();
  const std::size_t n = 3;
  std::vector<Triple> send(std::size_t(size) * n), recv(std::size_t(size) * n, Triple{-1, -1, 0});
  for (int d = 0; d < size; ++d)
    for (std::size_t i = 0; i < n; ++i) send[std::size_t(d) * n + i] = {rank, d, float(i) + 0.25f};
  c.all_to_all(send.data(), recv.data(), n);
  int bad = 0;
  for (int r = 0; r < size; ++r)
    for (std::size_t i = 0; i < n; ++i) {
      const Triple& t = recv[std::size_t(r) * n + i];
      bad += (t.src != r || t.dst != rank || t.x != float(i) + 0.25f) ? 1 : 0;
    }
  CHECK(bad == 0);
}

TEST_CASE("MpiCommunicator reduce_scatter_sum", "[comm][mpi]") {
  MpiCommunicator c(MPI_COMM_WORLD);
  dcpattn::test::check_reduce_scatter_sum(c);
}

TEST_CASE("MpiCommunicator barrier waits for the last rank", "[comm][mpi]") {
  MpiCommunicator c(MPI_COMM_WORLD);
  const int last = c.size() - 1;
  constexpr double delay_s = 0.3;
  c.barrier();
  if (c.rank() == last) std::this_thread::sleep_for(std::chrono::duration<double>(delay_s));
  const double t0 = MPI_Wtime();
  c.barrier();
  const double waited = MPI_Wtime() - t0;
  INFO("rank " << c.rank() << " waited " << waited << " s");
  // The others entered at most a scheduling delay after `last` started sleeping.
  if (c.rank() != last) CHECK(waited > delay_s / 2);
}

TEST_CASE("MpiCommunicator all_reduce_max_int", "[comm][mpi]") {
  MpiCommunicator c(MPI_COMM_WORLD);
  const int n = c.size(), r = c.rank();
  CHECK(c.all_reduce_max_int(3 * r + 5) == 3 * (n - 1) + 5);
  CHECK(c.all_reduce_max_int(-(r + 1)) == -1);
  CHECK(c.all_reduce_max_int(r == 0 ? INT_MAX : INT_MIN) == INT_MAX);
  CHECK(c.all_reduce_max_int(42) == 42);
}

TEST_CASE("split_dcp_group makes groups of consecutive ranks", "[comm][mpi]") {
  const int world = world_size(), me = world_rank();
  for (const int dcp_size : {1, 2}) {
    if (world % dcp_size != 0) continue;  // the same on every rank
    INFO("dcp_size = " << dcp_size << ", world rank " << me << " of " << world);
    MpiCommunicator group = MpiCommunicator::split_dcp_group(MPI_COMM_WORLD, dcp_size);
    CHECK(group.size() == dcp_size);
    CHECK(group.rank() == me % dcp_size);
    CHECK(dcpattn::error_rank() == me % dcp_size);

    const int first = me / dcp_size * dcp_size;
    std::vector<std::int32_t> members(std::size_t(group.size()), -1);
    const std::int32_t mine = me;
    group.all_gather(&mine, members.data(), 1);
    for (int k = 0; k < group.size(); ++k) {
      INFO("member " << k);
      CHECK(members[std::size_t(k)] == first + k);
    }
    CHECK(group.all_reduce_max_int(me) == first + dcp_size - 1);

    dcpattn::test::check_all_to_all<float>(group);
    dcpattn::test::check_reduce_scatter_sum(group);
  }
  dcpattn::set_error_rank(me);
}

TEST_CASE("split_dcp_group refuses a dcp_size that does not divide the group", "[comm][mpi]") {
  const int world = world_size();
  for (const int dcp_size : {0, -1, 3, world + 1}) {
    if (dcp_size >= 1 && world % dcp_size == 0) continue;  // the same on every rank
    INFO("dcp_size = " << dcp_size << ", world size " << world);
    REQUIRE_THROWS_AS(MpiCommunicator::split_dcp_group(MPI_COMM_WORLD, dcp_size), dcpattn::Error);
    const std::string message = split_refusal(dcp_size);
    INFO("message: " << message);
    CHECK(message.find("dcp_size (" + std::to_string(dcp_size) + ")") != std::string::npos);
  }
  // Nothing was split: the world still runs collectives in step.
  MpiCommunicator c(MPI_COMM_WORLD);
  CHECK(c.all_reduce_max_int(c.rank()) == world - 1);
}

TEST_CASE("MpiCommunicator refuses counts above INT_MAX", "[comm][mpi]") {
  MpiCommunicator c(MPI_COMM_WORLD);
  const std::size_t too_many = std::size_t(INT_MAX) + 1;
  // Refused before any communication, identically on every rank; the buffers are never touched.
  REQUIRE_THROWS_AS(c.all_gather<float>(nullptr, nullptr, too_many), dcpattn::Error);
  REQUIRE_THROWS_AS(c.all_to_all<std::uint8_t>(nullptr, nullptr, too_many), dcpattn::Error);
  REQUIRE_THROWS_AS(c.reduce_scatter_sum(nullptr, nullptr, too_many), dcpattn::Error);
  try {
    c.all_to_all<float>(nullptr, nullptr, too_many);
    CHECK(false);
  } catch (const dcpattn::Error& e) {
    INFO(e.what());
    CHECK(e.message().find("INT_MAX") != std::string::npos);
    CHECK(e.message().find("all_to_all") != std::string::npos);
  }
  c.barrier();
}
