// SPDX-License-Identifier: Apache-2.0
#include "support/catch.hpp"

#include "dcpattn/core/lse.hpp"

TEST_CASE("merge of two empty states is empty", "[lse]") {
  const auto w = dcpattn::merge_lse(dcpattn::lse_neg_inf, dcpattn::lse_neg_inf);
  REQUIRE(w.lse == dcpattn::lse_neg_inf);
  REQUIRE(w.w_a == 0.0f);
  REQUIRE(w.w_b == 0.0f);
}
