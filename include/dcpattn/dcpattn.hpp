// SPDX-License-Identifier: Apache-2.0
// Umbrella header: everything that compiles with a plain host compiler.
#pragma once

#include "dcpattn/config.hpp"
#include "dcpattn/core/fp8_cache.hpp"
#include "dcpattn/core/lse.hpp"
#include "dcpattn/core/norm.hpp"
#include "dcpattn/core/numeric.hpp"
#include "dcpattn/core/rope.hpp"
#include "dcpattn/core/tensor.hpp"
#include "dcpattn/error.hpp"
#include "dcpattn/ownership/round_robin.hpp"
#include "dcpattn/ownership/slot_ownership.hpp"
