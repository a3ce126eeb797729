// SPDX-License-Identifier: Apache-2.0
// RoundRobinOwnership against a plain simulation of the DCP semantics of DESIGN.md: tokens are
// dealt to ranks I at a time, cycling over N ranks (owner(t) = (t / I) mod N), and every rank
// stores its tokens densely in ascending t. The simulation below walks t = 0, 1, 2, ... and counts;
// it never calls the library to produce an expected value.
#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "support/catch.hpp"

#include "dcpattn/ownership/round_robin.hpp"
#include "dcpattn/ownership/slot_ownership.hpp"

namespace {

using dcpattn::RoundRobinOwnership;

constexpr int kInterleaves[] = {1, 2, 4, 16, 64};

/// Plain simulation of one (N, I) layout over tokens [0, len_max).
struct Simulation {
  std::vector<int> owner;                            // owner[t]
  std::vector<std::int64_t> local_pos;               // position of t among its owner's tokens
  std::vector<std::vector<std::int64_t>> prefix;     // prefix[L][r]: tokens of [0, L) on rank r
  std::vector<std::vector<std::int64_t>> tokens_of;  // tokens_of[r]: tokens of rank r, ascending
};

/// Deals tokens to `groups` groups, `interleave` at a time: the token t goes to group
/// (t / interleave) mod groups. Written as a walk with a cursor, not with the closed formula.
Simulation simulate(int groups, int interleave, std::int64_t len_max) {
  Simulation s;
  s.owner.resize(std::size_t(len_max));
  s.local_pos.resize(std::size_t(len_max));
  s.tokens_of.assign(std::size_t(groups), {});
  std::vector<std::int64_t> count(std::size_t(groups), 0);
  s.prefix.push_back(count);
  int current = 0;        // group receiving tokens now
  int dealt_in_turn = 0;  // tokens it received in this turn
  for (std::int64_t t = 0; t < len_max; ++t) {
    s.owner[std::size_t(t)] = current;
    s.local_pos[std::size_t(t)] = count[std::size_t(current)]++;
    s.tokens_of[std::size_t(current)].push_back(t);
    s.prefix.push_back(count);
    if (++dealt_in_turn == interleave) {
      dealt_in_turn = 0;
      current = (current + 1) % groups;
    }
  }
  return s;
}

/// Collects the first mismatch of a long loop so the loop stays cheap and a failure still says
/// where it happened.
struct Mismatches {
  std::int64_t count = 0;
  std::string first;
  template <class... Args>
  void add(const Args&... what) {
    if (count++ == 0) {
      std::ostringstream os;
      (os << ... << what);
      first = os.str();
    }
  }
};

}  // namespace

TEST_CASE("round robin: owner, positions and lengths match a plain simulation", "[ownership]") {
  for (int n = 1; n <= 8; ++n) {
    for (int il : kInterleaves) {
      const RoundRobinOwnership own(n, il);
      REQUIRE(own.group_size() == n);
      REQUIRE(own.interleave() == il);
      const std::int64_t len_max = 3 * std::int64_t(n) * il + 5;
      const Simulation sim = simulate(n, il, len_max);
      Mismatches bad;

      for (std::int64_t t = 0; t < len_max; ++t) {
        const int r = sim.owner[std::size_t(t)];
        const std::int64_t p = sim.local_pos[std::size_t(t)];
        // The walk agrees with DESIGN.md's closed form owner(t) = (t / I) mod N.
        if (r != int((t / il) % n)) bad.add("simulated owner of ", t, " is ", r);
        if (own.owner(t) != r) bad.add("owner(", t, ") = ", own.owner(t), ", expected ", r);
        if (own.local_position(t) != p)
          bad.add("local_position(", t, ") = ", own.local_position(t), ", expected ", p);
        if (own.global_position(p, r) != t)
          bad.add("global_position(", p, ", ", r, ") = ", own.global_position(p, r), ", expected ",
                  t);
      }
      // Every token is owned exactly once: walking each rank's local positions through
      // global_position covers [0, len_max) exactly once, and each token lands on its owner.
      std::vector<int> seen(std::size_t(len_max), 0);
      for (int r = 0; r < n; ++r)
        for (std::int64_t p = 0; p < own.local_length(len_max, r); ++p) {
          const std::int64_t t = own.global_position(p, r);
          if (t < 0 || t >= len_max) {
            bad.add("global_position(", p, ", ", r, ") = ", t, " is outside [0, ", len_max, ")");
            continue;
          }
          ++seen[std::size_t(t)];
          if (own.owner(t) != r)
            bad.add("token ", t, " at (", p, ", ", r, ") is owned by ", own.owner(t));
        }
      for (std::int64_t t = 0; t < len_max; ++t)
        if (seen[std::size_t(t)] != 1)
          bad.add("token ", t, " is held ", seen[std::size_t(t)], " times");

      for (std::int64_t len = 0; len <= len_max; ++len) {
        std::int64_t total = 0;
        for (int r = 0; r < n; ++r) {
          const std::int64_t got = own.local_length(len, r);
          const std::int64_t want = sim.prefix[std::size_t(len)][std::size_t(r)];
          if (got != want) bad.add("local_length(", len, ", ", r, ") = ", got, ", expected ", want);
          total += got;
        }
        if (total != len) bad.add("local lengths of L = ", len, " sum to ", total);
      }
      INFO("N = " << n << ", I = " << il << ": " << bad.count
                  << " mismatches; first: " << bad.first);
      CHECK(bad.count == 0);
    }
  }
}

TEST_CASE("round robin: paged slots on the owner, -1 elsewhere", "[ownership]") {
  std::mt19937_64 rng(20260101);
  for (int n = 1; n <= 8; ++n) {
    for (int il : kInterleaves) {
      const RoundRobinOwnership own(n, il);
      const std::int64_t len_max = 3 * std::int64_t(n) * il + 5;
      const Simulation sim = simulate(n, il, len_max);
      for (int mult : {1, 2, 3}) {
        const std::int64_t page = std::int64_t(il) * mult;  // page sizes are multiples of I
        // A permuted block table (page ids 0..pages-1 shuffled, offset so no id equals its index)
        // per rank: a wrong page index or a wrong rank's table gives a different slot.
        const std::int64_t pages = len_max / page + 2;
        std::vector<std::vector<int>> tables(static_cast<std::size_t>(n));
        for (int r = 0; r < n; ++r) {
          auto& tb = tables[std::size_t(r)];
          tb.resize(std::size_t(pages));
          std::iota(tb.begin(), tb.end(), 1000 * (r + 1));
          std::shuffle(tb.begin(), tb.end(), rng);
        }
        Mismatches bad;
        for (std::int64_t t = 0; t < len_max; ++t) {
          const int owner = sim.owner[std::size_t(t)];
          const std::int64_t p = sim.local_pos[std::size_t(t)];
          for (int r = 0; r < n; ++r) {
            const auto& tb = tables[std::size_t(r)];
            const std::int64_t got = dcpattn::paged_slot(own, t, r, tb, page);
            const std::int64_t want =
                r == owner ? std::int64_t(tb[std::size_t(p / page)]) * page + p % page : -1;
            if (got != want)
              bad.add("paged_slot(t = ", t, ", rank ", r, ", B = ", page, ") = ", got,
                      ", expected ", want);
          }
        }
        INFO("N = " << n << ", I = " << il << ", B = " << page << ": " << bad.count
                    << " mismatches; first: " << bad.first);
        CHECK(bad.count == 0);
      }
    }
  }
}

TEST_CASE("round robin: paged slots of one rank are pairwise distinct", "[ownership]") {
  // Writers of different tokens on one rank must never collide: the slots of a rank's tokens are
  // pairwise distinct for a block table of distinct pages.
  const RoundRobinOwnership own(4, 2);
  const std::int64_t page = 4, len = 200;
  std::vector<long long> table(64);
  for (std::size_t i = 0; i < table.size(); ++i) table[i] = std::int64_t(63 - i) * 3;
  for (int r = 0; r < 4; ++r) {
    std::vector<std::int64_t> slots;
    for (std::int64_t t = 0; t < len; ++t) {
      const std::int64_t s = dcpattn::paged_slot(own, t, r, table, page);
      if (s >= 0) slots.push_back(s);
    }
    REQUIRE(std::int64_t(slots.size()) == own.local_length(len, r));
    std::sort(slots.begin(), slots.end());
    CHECK(std::adjacent_find(slots.begin(), slots.end()) == slots.end());
  }
}

TEST_CASE("round robin: virtual shards match a plain simulation", "[ownership][virtual]") {
  for (int n = 1; n <= 8; ++n) {
    int v0 = 1;
    while (v0 < n) v0 *= 2;
    for (int vs = v0; vs <= 16; vs *= 2) {
      if (vs % n != 0) continue;  // N = 3, 5, 6, 7 have no power-of-two multiple in range
      for (int il : kInterleaves) {
        const RoundRobinOwnership own(n, il, vs);
        REQUIRE(own.num_virtual_shards() == vs);
        REQUIRE(std::string(own.validate_virtual_shards()).empty());
        const std::int64_t len_max = 3 * std::int64_t(vs) * il + 5;
        const Simulation ranks = simulate(n, il, len_max);
        const Simulation shards = simulate(vs, il, len_max);
        Mismatches bad;
        for (std::int64_t t = 0; t < len_max; ++t) {
          const int v = shards.owner[std::size_t(t)];
          if (own.virtual_shard(t) != v)
            bad.add("virtual_shard(", t, ") = ", own.virtual_shard(t), ", expected ", v);
          // owner(t) = shard(t) mod N: the ranks' dealing and the shards' dealing agree.
          if (ranks.owner[std::size_t(t)] != v % n)
            bad.add("simulated owner(", t, ") != shard ", v, " mod N");
          if (own.owner(t) != own.virtual_shard(t) % n)
            bad.add("owner(", t, ") != virtual_shard(t) mod N");
        }
        for (int v = 0; v < vs; ++v) {
          const auto& toks = shards.tokens_of[std::size_t(v)];
          for (std::size_t k = 0; k < toks.size(); ++k) {
            const std::int64_t t = toks[k];
            const std::int64_t lp = ranks.local_pos[std::size_t(t)];
            if (own.shard_global_position(std::int64_t(k), v) != t)
              bad.add("shard_global_position(", k, ", ", v,
                      ") = ", own.shard_global_position(std::int64_t(k), v), ", expected ", t);
            if (own.shard_local_position(std::int64_t(k), v) != lp)
              bad.add("shard_local_position(", k, ", ", v,
                      ") = ", own.shard_local_position(std::int64_t(k), v), ", expected ", lp);
          }
        }
        for (std::int64_t len = 0; len <= len_max; ++len) {
          std::int64_t total = 0;
          for (int v = 0; v < vs; ++v) {
            const std::int64_t got = own.shard_length(len, v);
            const std::int64_t want = shards.prefix[std::size_t(len)][std::size_t(v)];
            if (got != want)
              bad.add("shard_length(", len, ", ", v, ") = ", got, ", expected ", want);
            total += got;
          }
          if (total != len) bad.add("shard lengths of L = ", len, " sum to ", total);
        }
        INFO("N = " << n << ", I = " << il << ", V = " << vs << ": " << bad.count
                    << " mismatches; first: " << bad.first);
        CHECK(bad.count == 0);
      }
    }
  }
}

TEST_CASE("round robin: the default virtual shard count", "[ownership][virtual]") {
  CHECK(RoundRobinOwnership(1, 1).num_virtual_shards() == 8);
  CHECK(RoundRobinOwnership(4, 2).num_virtual_shards() == 8);
  // V below N is raised to N.
  CHECK(RoundRobinOwnership(16, 1).num_virtual_shards() == 16);
  CHECK(RoundRobinOwnership(8, 1, 4).num_virtual_shards() == 8);
  CHECK(std::string(RoundRobinOwnership(8, 1, 4).validate_virtual_shards()).empty());
}

TEST_CASE("round robin: validation names the offending parameter", "[ownership][validate]") {
  auto contains = [](const char* msg, const char* word) {
    return std::string(msg).find(word) != std::string::npos;
  };
  SECTION("good parameters") {
    for (int n = 1; n <= 8; ++n)
      for (int il : kInterleaves) {
        CAPTURE(n, il);
        CHECK(std::string(RoundRobinOwnership(n, il).validate()).empty());
      }
    for (int n : {1, 2, 4, 8})
      for (int vs : {8, 16, 32}) {
        CAPTURE(n, vs);
        CHECK(std::string(RoundRobinOwnership(n, 1, vs).validate_virtual_shards()).empty());
      }
  }
  SECTION("group_size") {
    for (int n : {0, -1, -8}) {
      CAPTURE(n);
      const RoundRobinOwnership own(n, 1);
      CHECK(contains(own.validate(), "group_size"));
      // The shard check must refuse it too (and not divide by zero doing so).
      CHECK(!std::string(own.validate_virtual_shards()).empty());
    }
  }
  SECTION("interleave") {
    for (int il : {0, -1, -64}) {
      CAPTURE(il);
      CHECK(contains(RoundRobinOwnership(2, il).validate(), "interleave"));
    }
  }
  SECTION("virtual_shards not a power of two") {
    for (int vs : {6, 12, 24}) {
      CAPTURE(vs);
      const RoundRobinOwnership own(1, 1, vs);
      CHECK(std::string(own.validate()).empty());  // N and I are fine
      CHECK(contains(own.validate_virtual_shards(), "virtual_shards"));
    }
    CHECK(contains(RoundRobinOwnership(2, 1, 6).validate_virtual_shards(), "virtual_shards"));
  }
  SECTION("virtual_shards not a multiple of group_size") {
    for (int n : {3, 5, 6, 7}) {
      CAPTURE(n);
      const RoundRobinOwnership own(n, 1, 8);
      CHECK(std::string(own.validate()).empty());
      const char* msg = own.validate_virtual_shards();
      CHECK(contains(msg, "group_size"));
      CHECK(contains(msg, "virtual_shards"));
    }
  }
}

TEST_CASE("round robin: multi-token decode bounds are computed per row", "[ownership][spec]") {
  // DESIGN.md: N = 2, I = 1, rank 1; global causal bounds [8, 9, 10] -> local bounds [4, 4, 5].
  // Rank 1 holds the odd tokens: 1 3 5 7 (< 8), + none (token 8 is rank 0's), + 9.
  const RoundRobinOwnership own(2, 1);
  const std::int64_t bounds[] = {8, 9, 10};
  const std::int64_t expected[] = {4, 4, 5};
  for (int row = 0; row < 3; ++row) {
    CAPTURE(row, bounds[row]);
    CHECK(own.local_length(bounds[row], 1) == expected[row]);
  }
}

TEST_CASE("round robin: the worked example of the header", "[ownership]") {
  // N = 4, I = 2: tokens 0 1 -> rank 0, 2 3 -> rank 1, ..., 8 9 -> rank 0 at local 2, 3.
  const RoundRobinOwnership own(4, 2);
  const int owners[] = {0, 0, 1, 1, 2, 2, 3, 3, 0, 0, 1};
  for (int t = 0; t < 11; ++t) CHECK(own.owner(t) == owners[t]);
  CHECK(own.local_position(8) == 2);
  CHECK(own.local_position(9) == 3);
  CHECK(own.global_position(3, 0) == 9);
}

TEST_CASE("round robin: usable in constant expressions and trivially copyable", "[ownership]") {
  constexpr RoundRobinOwnership own(4, 2);
  constexpr int o = own.owner(9);
  constexpr std::int64_t p = own.local_position(9);
  constexpr std::int64_t g = own.global_position(3, 0);
  constexpr std::int64_t l = own.local_length(10, 0);
  constexpr int s = own.virtual_shard(13);
  CHECK(o == 0);
  CHECK(p == 3);
  CHECK(g == 9);
  CHECK(l == 4);
  CHECK(s == 6);
  static_assert(dcpattn::SlotOwnership<RoundRobinOwnership>);
  static_assert(dcpattn::VirtualShardedOwnership<RoundRobinOwnership>);
  static_assert(std::string_view(RoundRobinOwnership(0, 1).validate()).size() > 0);
  static_assert(std::string_view(RoundRobinOwnership(2, 1).validate()).empty());
}

TEST_CASE("round robin: 64-bit positions", "[ownership]") {
  // Positions beyond 2^31 (very long contexts, or global slot arithmetic) stay exact.
  const RoundRobinOwnership own(8, 64);
  const std::int64_t t = (std::int64_t(1) << 40) + 12345;
  const int r = own.owner(t);
  const std::int64_t p = own.local_position(t);
  CHECK(r == int((t / 64) % 8));
  CHECK(own.global_position(p, r) == t);
  std::int64_t sum = 0;
  for (int q = 0; q < 8; ++q) sum += own.local_length(t, q);
  CHECK(sum == t);
}

TEST_CASE("round robin: the 32-bit and 64-bit arithmetic agree across 2^31", "[ownership]") {
  // owner and local_position divide in 32 bits below 2^31 and in 64 bits above: both sides of
  // the boundary against the closed forms of the header, in 64 bits here, for groups whose
  // N I is small, near 2^31 and past it.
  const std::int64_t edge = std::int64_t(1) << 31;
  int checked = 0;
  for (const auto& [n, i] :
       {std::pair{1, 1}, std::pair{3, 5}, std::pair{8, 64}, std::pair{2, 1 << 30},
        std::pair{3, 1 << 30}, std::pair{7, 2147483647}}) {
    const RoundRobinOwnership own(n, i);
    const std::int64_t span = std::int64_t(n) * i;
    for (std::int64_t t :
         {std::int64_t(0), std::int64_t(i) - 1, std::int64_t(i), span - 1, span, edge - 2, edge - 1,
          edge, edge + 1, 3 * edge + 7, (std::int64_t(1) << 40) + 99}) {
      if (t < 0) continue;
      CAPTURE(n, i, t);
      CHECK(own.owner(t) == int((t / i) % n));
      CHECK(own.local_position(t) == (t / span) * i + t % i);
      ++checked;
    }
  }
  CHECK(checked >= 60);
}
