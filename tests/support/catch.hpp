// SPDX-License-Identifier: Apache-2.0
// The one compatibility header between Catch2 v3 (preferred) and Catch2 v2.13 (Debian's package).
// Test files include this instead of a Catch2 header.
#pragma once

#if DCPATTN_CATCH2_V3
#include <catch2/catch_approx.hpp>
#include <catch2/catch_session.hpp>
#include <catch2/catch_test_macros.hpp>
#include <catch2/generators/catch_generators.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>
#else
#include <catch2/catch.hpp>
#endif
