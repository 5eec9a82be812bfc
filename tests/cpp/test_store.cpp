#include <gtest/gtest.h>

#include <cstdlib>
#include <thread>

#include "hemiola/status.h"
#include "hemiola/store.h"
#include "temp_dir.h"

namespace hemiola {
namespace {


void exercise(Store& store) {
  EXPECT_FALSE(store.check("a/b"));
  store.set("a/b", std::string("x\0y", 3));  // binary-safe
  EXPECT_TRUE(store.check("a/b"));
  EXPECT_EQ(store.get("a/b", std::chrono::milliseconds(10)), std::string("x\0y", 3));
  store.set("a/b", "overwritten");
  EXPECT_EQ(store.get("a/b", std::chrono::milliseconds(10)), "overwritten");

  // get() waits for a value set later by another thread.
  std::thread writer([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    store.set("late", "here");
  });
  EXPECT_EQ(store.get("late", std::chrono::seconds(10)), "here");
  writer.join();

  const auto start = std::chrono::steady_clock::now();
  try {
    store.get("never", std::chrono::milliseconds(100));
    FAIL() << "expected a timeout";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kTimeout);
    EXPECT_NE(std::string(e.what()).find("never"), std::string::npos);
  }
  EXPECT_GE(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(90));
}

TEST(Store, MemoryStore) {
  MemoryStore store;
  exercise(store);
}

TEST(Store, FileStore) {
  const tests::TempDir temp("hemiola-store");
  FileStore store(temp.path());
  exercise(store);
}

TEST(Store, FileStoreIsSharedBetweenInstancesOnOneDirectory) {
  const tests::TempDir temp("hemiola-store");
  const std::string& dir = temp.path();
  FileStore a(dir), b(dir);
  a.set("k", "v");
  EXPECT_EQ(b.get("k", std::chrono::seconds(1)), "v");
}

TEST(Store, PrefixStoreSeparatesNamespaces) {
  auto base = std::make_shared<MemoryStore>();
  PrefixStore one("one", base), two("two", base);
  one.set("k", "1");
  two.set("k", "2");
  EXPECT_EQ(one.get("k", std::chrono::milliseconds(10)), "1");
  EXPECT_EQ(two.get("k", std::chrono::milliseconds(10)), "2");
  EXPECT_EQ(base->get("one/k", std::chrono::milliseconds(10)), "1");
  exercise(one);
}

}  // namespace
}  // namespace hemiola
