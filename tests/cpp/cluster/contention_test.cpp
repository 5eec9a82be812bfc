// Hand-checked numbers for the contention law and the AdaDUAL rule.
#include <gtest/gtest.h>

#include "cluster/contention.h"

namespace hemiola::cluster {
namespace {

TEST(Contention, RateLaw) {
  ClusterSpec c;  // beta 0.856, eta 0.235 ms/MB
  EXPECT_DOUBLE_EQ(transfer_rate(1, c), 1.0 / 0.856);
  EXPECT_DOUBLE_EQ(transfer_rate(2, c), 1.0 / (2 * 0.856 + 0.235));
  EXPECT_DOUBLE_EQ(transfer_rate(3, c), 1.0 / (3 * 0.856 + 2 * 0.235));
  EXPECT_THROW(transfer_rate(0, c), std::invalid_argument);
}

// Two 100 MB transfers that start together on one link both finish at
// 100 * (2 * 0.856 + 0.235) = 194.7 ms.
TEST(Contention, TwoEqualTransfersFinishAt194_7) {
  ClusterSpec c;
  Network net(c);
  net.start(0, {0, 1}, 100.0);
  net.start(1, {0, 1}, 100.0);
  EXPECT_NEAR(net.next_finish_ms(), 194.7, 1e-9);
  auto done = net.advance_to(net.next_finish_ms());
  ASSERT_EQ(done.size(), 2u);
  EXPECT_NEAR(done[0].moved_mb, 100.0, 1e-9);
  EXPECT_NEAR(done[1].moved_mb, 100.0, 1e-9);
  EXPECT_EQ(net.size(), 0u);
}

TEST(Contention, AloneTakesSizeTimesBeta) {
  ClusterSpec c;
  Network net(c);
  net.start(7, {2, 3}, 100.0);
  EXPECT_NEAR(net.next_finish_ms(), 85.6, 1e-9);
}

// Rates are recomputed when k changes: 100 MB and 50 MB start together; the
// 50 MB one ends at 50 * 1.947 = 97.35 ms, having moved the other by 50 MB as
// well; the rest (50 MB) then runs alone: + 50 * 0.856 = 42.8 -> 140.15 ms.
TEST(Contention, RateRecomputedWhenOneEnds) {
  ClusterSpec c;
  Network net(c);
  net.start(0, {0, 1}, 100.0);
  net.start(1, {1, 2}, 50.0);  // shares only node 1
  EXPECT_NEAR(net.next_finish_ms(), 97.35, 1e-9);
  auto first = net.advance_to(net.next_finish_ms());
  ASSERT_EQ(first.size(), 1u);
  EXPECT_EQ(first[0].id, 1);
  EXPECT_NEAR(net.remaining_mb(0), 50.0, 1e-9);
  EXPECT_NEAR(net.rate(0), 1.0 / 0.856, 1e-12);
  EXPECT_NEAR(net.next_finish_ms(), 140.15, 1e-9);
}

// The busiest node sets k: a transfer over nodes {0,1} with two others on
// node 1 and none on node 0 runs at the 3-way rate.
TEST(Contention, BusiestNodeSetsK) {
  ClusterSpec c;
  Network net(c);
  net.start(0, {0, 1}, 100.0);
  net.start(1, {1, 2}, 100.0);
  net.start(2, {1, 3}, 100.0);
  EXPECT_DOUBLE_EQ(net.rate(0), transfer_rate(3, c));
}

// Reading a remaining size never moves a transfer (the published simulator's bug).
TEST(Contention, ReadingDoesNotProgress) {
  ClusterSpec c;
  Network net(c);
  net.start(0, {0, 1}, 100.0);
  for (int i = 0; i < 1000; ++i) EXPECT_DOUBLE_EQ(net.remaining_mb(0), 100.0);
  net.advance_to(10.0);
  EXPECT_NEAR(net.remaining_mb(0), 100.0 - 10.0 / 0.856, 1e-9);
}

TEST(Contention, SharingLowersSumExactlyAboveThreshold) {
  ClusterSpec c;
  const double thr = adadual_threshold(c);
  EXPECT_NEAR(thr, 2.0 * (0.856 + 0.235) / 0.856, 1e-12);
  EXPECT_NEAR(thr, 2.549065, 1e-6);
  // Summed completion time of R (running) and M (new) when they share versus
  // when M waits for R: sharing wins iff R/M > thr (equal at thr).
  auto sum_shared = [&](double r, double m) {  // m < r: m ends first
    const double t1 = m * (2 * c.beta_ms_per_mb + c.eta_ms_per_mb);
    return t1 + (t1 + (r - m) * c.beta_ms_per_mb);
  };
  auto sum_serial = [&](double r, double m) {
    return r * c.beta_ms_per_mb + (r + m) * c.beta_ms_per_mb;
  };
  const double m = 10.0;
  EXPECT_LT(sum_shared(m * thr * 1.001, m), sum_serial(m * thr * 1.001, m));
  EXPECT_GT(sum_shared(m * thr * 0.999, m), sum_serial(m * thr * 0.999, m));
  EXPECT_NEAR(sum_shared(m * thr, m), sum_serial(m * thr, m), 1e-9);
}

TEST(Contention, AdaDualBoundary) {
  ClusterSpec c;
  const double thr = adadual_threshold(c);
  const double m = 100.0;
  EXPECT_TRUE(adadual_may_share(m * thr, m, c));            // exactly at the threshold
  EXPECT_TRUE(adadual_may_share(m * thr * (1 + 1e-9), m, c));
  EXPECT_FALSE(adadual_may_share(m * thr * (1 - 1e-9), m, c));
  EXPECT_FALSE(adadual_may_share(m, m, c));                 // equal transfers never share
}

}  // namespace
}  // namespace hemiola::cluster
