#include <gtest/gtest.h>

#include <numeric>
#include <set>

#include "engine/buckets/bucket_plan.h"
#include "hemiola/status.h"

namespace hemiola {
namespace {

std::vector<GradSpec> floats(const std::vector<size_t>& numels) {
  std::vector<GradSpec> specs;
  for (size_t i = 0; i < numels.size(); ++i) {
    specs.push_back({DType::kFloat32, numels[i], "t" + std::to_string(i)});
  }
  return specs;
}

// Every element of every tensor is in exactly one piece, pieces of a tensor
// come in order, offsets within a bucket are contiguous.
void expect_valid(const std::vector<PlannedBucket>& buckets, const std::vector<GradSpec>& specs) {
  std::vector<size_t> next(specs.size(), 0);  // next element expected per tensor
  std::vector<int> pieces(specs.size(), 0);
  for (const auto& b : buckets) {
    size_t offset = 0;
    ASSERT_EQ(b.tensors.size(), b.offsets.size());
    ASSERT_EQ(b.tensors.size(), b.begins.size());
    ASSERT_EQ(b.tensors.size(), b.counts.size());
    for (size_t k = 0; k < b.tensors.size(); ++k) {
      const size_t t = b.tensors[k];
      EXPECT_EQ(b.offsets[k], offset);
      EXPECT_EQ(specs[t].dtype, b.dtype);
      EXPECT_EQ(b.begins[k], next[t]) << "tensor " << t << " pieces out of order";
      next[t] += b.counts[k];
      offset += b.counts[k];
      ++pieces[t];
    }
    EXPECT_EQ(offset, b.numel);
  }
  for (size_t t = 0; t < specs.size(); ++t) {
    EXPECT_EQ(next[t], specs[t].numel) << "tensor " << t << " not fully covered";
    EXPECT_GE(pieces[t], 1);
  }
}

TEST(BucketPlan, OneHugeTensorGetsOneBucket) {
  auto specs = floats({size_t(1) << 28});  // 1 GiB of float32
  auto buckets = plan_buckets(specs, reverse_order(1), 1 << 20, 25 << 20);
  ASSERT_EQ(buckets.size(), 1u);
  EXPECT_EQ(buckets[0].nbytes(), size_t(1) << 30);
  expect_valid(buckets, specs);
}

TEST(BucketPlan, ThousandsOfTinyTensorsAreFusedUpToTheCap) {
  auto specs = floats(std::vector<size_t>(10000, 10));  // 40 bytes each
  auto buckets = plan_buckets(specs, reverse_order(specs.size()), 400, 4000);
  expect_valid(buckets, specs);
  EXPECT_EQ(buckets[0].tensors.size(), 10u);  // first bucket: 400-byte cap
  for (size_t b = 1; b + 1 < buckets.size(); ++b) EXPECT_EQ(buckets[b].tensors.size(), 100u);
  EXPECT_EQ(buckets.size(), 1 + (10000 - 10 + 99) / 100);
  // Reverse registration order: the first bucket holds the last tensors.
  EXPECT_EQ(buckets[0].tensors.front(), 9999u);
}

TEST(BucketPlan, ThresholdSmallerThanAnyTensorGivesOneBucketEach) {
  auto specs = floats({3, 1, 4, 1, 5});
  auto buckets = plan_buckets(specs, reverse_order(5), 1, 1);
  ASSERT_EQ(buckets.size(), 5u);
  for (size_t b = 0; b < 5; ++b) {
    ASSERT_EQ(buckets[b].tensors.size(), 1u);
    EXPECT_EQ(buckets[b].tensors[0], 4 - b);
  }
}

TEST(BucketPlan, TheTensorThatReachesTheCapClosesItsBucket) {
  // DDP's rule: 10 + 10 floats (80 bytes) are below the 100-byte cap, the
  // 1000-float tensor reaches it and goes in with them, and the bucket closes
  // at once, so that large gradient never waits for the ones behind it.
  auto specs = floats({10, 10, 1000, 10, 10});
  auto buckets = plan_buckets(specs, {0, 1, 2, 3, 4}, 100, 100);
  expect_valid(buckets, specs);
  ASSERT_EQ(buckets.size(), 2u);
  EXPECT_EQ(buckets[0].tensors, (std::vector<size_t>{0, 1, 2}));
  EXPECT_EQ(buckets[1].tensors, (std::vector<size_t>{3, 4}));
}

TEST(BucketPlan, TheLastLayersBigWeightIsInTheFirstBucket) {
  // An MLP in backward order: classifier bias and weight (small), then the
  // last hidden layer's bias and its 9 MB weight, then the layer before.
  // With a 1 MiB first cap the big weight closes the first bucket; the
  // bucket never has to wait for the layer before it.
  auto specs = floats({1536 * 1536, 1536, 1536 * 1536, 1536, 1536 * 10, 10});
  auto buckets = plan_buckets(specs, reverse_order(specs.size()), 1 << 20, 25 << 20);
  expect_valid(buckets, specs);
  ASSERT_EQ(buckets.size(), 2u);
  EXPECT_EQ(buckets[0].tensors, (std::vector<size_t>{5, 4, 3, 2}));
  EXPECT_EQ(buckets[1].tensors, (std::vector<size_t>{1, 0}));
}

TEST(BucketPlan, DtypesNeverShareABucketAndOrderFollowsFirstTensor) {
  std::vector<GradSpec> specs = {{DType::kFloat32, 4, "a"},
                                 {DType::kBFloat16, 4, "b"},
                                 {DType::kFloat32, 4, "c"},
                                 {DType::kFloat64, 4, "d"}};
  auto buckets = plan_buckets(specs, {0, 1, 2, 3}, 1 << 20, 1 << 20);
  expect_valid(buckets, specs);
  ASSERT_EQ(buckets.size(), 3u);
  EXPECT_EQ(buckets[0].dtype, DType::kFloat32);
  EXPECT_EQ(buckets[0].tensors, (std::vector<size_t>{0, 2}));
  EXPECT_EQ(buckets[1].dtype, DType::kBFloat16);
  EXPECT_EQ(buckets[2].dtype, DType::kFloat64);
}

TEST(BucketPlan, LargeTensorsArePartitionedIntoPiecesAcrossBuckets) {
  // 1000 floats (4000 bytes) with 1024-byte pieces: 256 + 256 + 256 + 232.
  auto specs = floats({10, 1000, 10});
  auto buckets = plan_buckets(specs, {0, 1, 2}, 1024, 1024, 1024);
  expect_valid(buckets, specs);
  std::vector<size_t> counts_of_1;
  for (const auto& b : buckets) {
    for (size_t k = 0; k < b.tensors.size(); ++k) {
      if (b.tensors[k] == 1) counts_of_1.push_back(b.counts[k]);
    }
    EXPECT_LE(b.nbytes(), 1024u + 1024u);  // the cap, plus at most the piece that reached it
  }
  EXPECT_EQ(counts_of_1, (std::vector<size_t>{256, 256, 256, 232}));
  EXPECT_GE(buckets.size(), 4u);
  // Small tensors are not partitioned; partitioning off gives one piece.
  auto whole = plan_buckets(specs, {0, 1, 2}, 1024, 1024, 0);
  expect_valid(whole, specs);
  for (const auto& b : whole) {
    for (size_t k = 0; k < b.tensors.size(); ++k) EXPECT_EQ(b.counts[k], specs[b.tensors[k]].numel);
  }
}

TEST(BucketPlan, ZeroElementTensorsArePlanned) {
  auto specs = floats({0, 5, 0});
  auto buckets = plan_buckets(specs, reverse_order(3), 1 << 20, 1 << 20);
  expect_valid(buckets, specs);
}

TEST(BucketPlan, RejectsBadOrdersAndNonFloatGradients) {
  auto specs = floats({1, 2, 3});
  EXPECT_THROW(plan_buckets(specs, {0, 1}, 8, 8), Error);
  EXPECT_THROW(plan_buckets(specs, {0, 1, 1}, 8, 8), Error);
  EXPECT_THROW(plan_buckets(specs, {0, 1, 7}, 8, 8), Error);
  std::vector<GradSpec> ints = {{DType::kInt64, 2, "steps"}};
  try {
    plan_buckets(ints, {0}, 8, 8);
    FAIL() << "int64 gradient accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("steps"), std::string::npos);
  }
}

}  // namespace
}  // namespace hemiola
