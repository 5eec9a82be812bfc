// Placement policies on hand-made GPU states.
#include <gtest/gtest.h>

#include "cluster/placement.h"

namespace hemiola::cluster {
namespace {

struct Fixture {
  ClusterSpec cluster;
  std::vector<double> free, load;
  Fixture() {
    cluster.nodes = 4;
    cluster.gpus_per_node = 2;  // GPUs 0-1 node 0, 2-3 node 1, 4-5 node 2, 6-7 node 3
    free.assign(8, 10000.0);
    load.assign(8, 0.0);
  }
  std::vector<int> place(const std::string& policy, int gpus, double memory,
                         std::uint64_t seed = 0) {
    PolicyConfig p;
    parse_placement(policy, p);
    Rng rng(seed);
    return place_job(p, cluster, free, load, {gpus, memory}, rng);
  }
};

TEST(Placement, FirstFitTakesLowestGpusWithMemory) {
  Fixture f;
  f.free[0] = 100.0;  // GPU 0 too full for a 4527 MB model
  EXPECT_EQ(f.place("first-fit", 3, 4527.0), (std::vector<int>{1, 2, 3}));
  EXPECT_EQ(f.place("first-fit", 3, 50.0), (std::vector<int>{0, 1, 2}));
  EXPECT_TRUE(f.place("first-fit", 8, 4527.0).empty());  // only 7 GPUs have room
}

TEST(Placement, LwfSmallJobsTakeLeastLoadedAnywhere) {
  Fixture f;
  f.load = {5, 1, 7, 0, 3, 2, 9, 4};
  EXPECT_EQ(f.place("lwf:2", 2, 1.0), (std::vector<int>{1, 3}));
  f.free[3] = 0.0;  // no memory on GPU 3: next least loaded is GPU 5
  EXPECT_EQ(f.place("lwf:2", 2, 1.0), (std::vector<int>{1, 5}));
}

TEST(Placement, LwfLargeJobsPackOntoLeastLoadedNodes) {
  Fixture f;
  // Node loads: n0 = 6, n1 = 7, n2 = 5, n3 = 13.
  f.load = {5, 1, 7, 0, 3, 2, 9, 4};
  EXPECT_EQ(f.place("lwf:2", 4, 1.0), (std::vector<int>{0, 1, 4, 5}));
  // Three GPUs: all of node 2, then node 0's least-loaded GPU (1).
  EXPECT_EQ(f.place("lwf:2", 3, 1.0), (std::vector<int>{1, 4, 5}));
}

TEST(Placement, RandomIsSeededAndRespectsMemory) {
  Fixture f;
  f.free[2] = 0.0;
  const auto a = f.place("random", 4, 1.0, 42), b = f.place("random", 4, 1.0, 42);
  EXPECT_EQ(a, b);
  EXPECT_EQ(a.size(), 4u);
  for (int g : a) EXPECT_NE(g, 2);
  bool differs = false;
  for (std::uint64_t s = 0; s < 20 && !differs; ++s) differs = f.place("random", 4, 1.0, s) != a;
  EXPECT_TRUE(differs);
}

}  // namespace
}  // namespace hemiola::cluster
