// SPDX-License-Identifier: Apache-2.0
// Round-robin ownership across a real MPI job: each rank r of a world of N lists the tokens it
// stores (global_position(p, r) for p < local_length(L, r)); gathered over all ranks they must be
// exactly 0..L-1, each once. Every rank runs the same collectives in the same order and reports
// the same verdict.
#include <algorithm>
#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

#include <mpi.h>

#include "support/catch.hpp"
#include "support/mpi_env.hpp"

#include "dcpattn/ownership/round_robin.hpp"

namespace {

/// Gathers every rank's int64 list on every rank (rank-major).
std::vector<std::int64_t> allgather_lists(const std::vector<std::int64_t>& mine) {
  const int n = dcpattn::test::world_size();
  int count = int(mine.size());
  std::vector<int> counts(std::size_t(n), 0), displs(std::size_t(n), 0);
  MPI_Allgather(&count, 1, MPI_INT, counts.data(), 1, MPI_INT, MPI_COMM_WORLD);
  int total = 0;
  for (int r = 0; r < n; ++r) {
    displs[std::size_t(r)] = total;
    total += counts[std::size_t(r)];
  }
  std::vector<std::int64_t> all(static_cast<std::size_t>(total));
  MPI_Allgatherv(mine.data(), count, MPI_INT64_T, all.data(), counts.data(), displs.data(),
                 MPI_INT64_T, MPI_COMM_WORLD);
  return all;
}

}  // namespace

TEST_CASE("round robin over MPI: the ranks' tokens partition every prefix", "[ownership][mpi]") {
  const int n = dcpattn::test::world_size();
  const int rank = dcpattn::test::world_rank();
  for (int il : {1, 2, 4, 16, 64}) {
    const dcpattn::RoundRobinOwnership own(n, il);
    REQUIRE(dcpattn::test::all_ranks(std::string(own.validate()).empty()));
    const std::int64_t span = std::int64_t(n) * il;
    const std::int64_t lengths[] = {
        0, 1, il, span - 1, span, span + 1, 3 * span + il / 2 + 1, 7 * span + 5, 1000};
    for (std::int64_t len : lengths) {
      std::vector<std::int64_t> mine;
      bool owners_ok = true;
      for (std::int64_t p = 0; p < own.local_length(len, rank); ++p) {
        const std::int64_t t = own.global_position(p, rank);
        mine.push_back(t);
        // The token a rank lists is one it owns, at the local position it was listed at.
        owners_ok = owners_ok && own.owner(t) == rank && own.local_position(t) == p;
      }
      // Stored in ascending t, densely.
      const bool ascending = std::is_sorted(mine.begin(), mine.end()) &&
                             std::adjacent_find(mine.begin(), mine.end()) == mine.end();

      std::vector<std::int64_t> all = allgather_lists(mine);
      std::sort(all.begin(), all.end());
      bool partition = std::int64_t(all.size()) == len;
      for (std::size_t i = 0; partition && i < all.size(); ++i)
        partition = all[i] == std::int64_t(i);

      INFO("world " << n << ", rank " << rank << ", I = " << il << ", L = " << len << ": "
                    << all.size() << " tokens gathered");
      // all_ranks is a collective: evaluate all three on every rank before any REQUIRE.
      const bool ok_owners = dcpattn::test::all_ranks(owners_ok);
      const bool ok_ascending = dcpattn::test::all_ranks(ascending);
      const bool ok_partition = dcpattn::test::all_ranks(partition);
      REQUIRE(ok_owners);
      REQUIRE(ok_ascending);
      REQUIRE(ok_partition);
    }
  }
}
