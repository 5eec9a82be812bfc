#include <gtest/gtest.h>

#include <atomic>
#include <thread>
#include <vector>

#include "core/ready_queue.h"

namespace hemiola {
namespace {

TEST(ReadyQueue, ManyConcurrentProducersDeliverEveryItemExactlyOnce) {
  constexpr int kProducers = 8;
  constexpr int kPerProducer = 20000;
  ReadyQueue<uint32_t> queue(1024);  // smaller than the total: exercises wrap-around
  std::atomic<bool> go{false};
  std::vector<std::thread> producers;
  for (int p = 0; p < kProducers; ++p) {
    producers.emplace_back([&, p] {
      while (!go.load()) {
      }
      for (int i = 0; i < kPerProducer; ++i) {
        const uint32_t value = static_cast<uint32_t>(p * kPerProducer + i);
        while (!queue.push(value)) std::this_thread::yield();  // full: consumer catches up
      }
    });
  }
  std::vector<int> seen(kProducers * kPerProducer, 0);
  std::vector<int> last_per_producer(kProducers, -1);
  go.store(true);
  for (int received = 0; received < kProducers * kPerProducer;) {
    uint32_t value;
    ASSERT_TRUE(queue.pop_wait(value, std::chrono::seconds(10))) << "lost items after " << received;
    ++seen[value];
    // Per-producer FIFO order is preserved.
    const int producer = static_cast<int>(value) / kPerProducer;
    const int index = static_cast<int>(value) % kPerProducer;
    EXPECT_GT(index, last_per_producer[producer]);
    last_per_producer[producer] = index;
    ++received;
  }
  for (auto& t : producers) t.join();
  for (size_t i = 0; i < seen.size(); ++i) ASSERT_EQ(seen[i], 1) << "item " << i;
  uint32_t extra;
  EXPECT_FALSE(queue.try_pop(extra));
}

TEST(ReadyQueue, PushIntoFullQueueFails) {
  ReadyQueue<int> queue(4);
  for (int i = 0; i < 4; ++i) EXPECT_TRUE(queue.push(i));
  EXPECT_FALSE(queue.push(99));
  int v;
  ASSERT_TRUE(queue.try_pop(v));
  EXPECT_EQ(v, 0);
  EXPECT_TRUE(queue.push(4));
}

TEST(ReadyQueue, PopWaitTimesOutWhenEmptyAndWakeInterruptsIt) {
  ReadyQueue<int> queue(2);
  int v;
  const auto start = std::chrono::steady_clock::now();
  EXPECT_FALSE(queue.pop_wait(v, std::chrono::milliseconds(50)));
  EXPECT_GE(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(45));

  std::thread waker([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    queue.wake();
  });
  const auto woken_start = std::chrono::steady_clock::now();
  EXPECT_FALSE(queue.pop_wait(v, std::chrono::seconds(30)));
  EXPECT_LT(std::chrono::steady_clock::now() - woken_start, std::chrono::seconds(5));
  waker.join();
}

TEST(ReadyQueue, ParkedConsumerIsWokenByPush) {
  ReadyQueue<int> queue(2);
  std::thread producer([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(30));
    queue.push(7);
  });
  int v = 0;
  EXPECT_TRUE(queue.pop_wait(v, std::chrono::seconds(30)));
  EXPECT_EQ(v, 7);
  producer.join();
}

}  // namespace
}  // namespace hemiola
