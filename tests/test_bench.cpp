// bench's noisy mark (issue 34 item 7): repeats whose slowest is more than
// kNoisySpread times the fastest are marked; the figure is max / min.
#include <catch2/catch.hpp>

#include "bench.h"

using namespace moev;

TEST_CASE("bench marks repeats spread past 1.5x as noisy", "[cpu][bench]") {
  CHECK(spread_of({}) == 0);
  CHECK(spread_of({0.0, 1.0}) == 0);  // a zero time is no ratio
  CHECK(spread_of({2.0, 2.0, 2.0}) == 1.0);
  CHECK(spread_of({3.0, 2.0, 2.5}) == 1.5);
  CHECK_FALSE(spread_of({3.0, 2.0, 2.5}) > kNoisySpread);  // exactly 1.5x is not noisy
  CHECK(spread_of({1.0, 1.6, 1.2}) > kNoisySpread);
  CHECK(spread_of({1.6, 1.0}) == Approx(1.6));
}
