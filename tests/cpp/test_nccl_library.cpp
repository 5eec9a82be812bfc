// The run-time NCCL loader: a missing or wrong library is a reason, never an
// exception; the nvidia-nccl-cu13 wheel's library loads (no GPU needed) and
// reports its version.
#include <gtest/gtest.h>

#include <string>

#include "comm/nccl_library.h"
#include "hemiola/status.h"

namespace hemiola::comm {
namespace {

TEST(NcclLibrary, MissingLibraryGivesReasonWithoutThrowing) {
  const std::string name = "/nonexistent/libnccl.so.2";
  EXPECT_NO_THROW({ NcclLibrary probe(name); });
  const NcclLibrary library(name);
  EXPECT_FALSE(library.loaded());
  EXPECT_NE(library.reason().find(name + " not found: "), std::string::npos) << library.reason();
  EXPECT_NE(library.reason().find("pip install nvidia-nccl-cu13"), std::string::npos);
  EXPECT_TRUE(library.path().empty());
  EXPECT_EQ(library.version_code(), 0);
  EXPECT_EQ(library.version(), "");
  EXPECT_THROW(library.api(), Error);
}

TEST(NcclLibrary, LibraryWithoutNcclSymbolsGivesReason) {
  // libm is on every glibc system and exports no NCCL symbol.
  const NcclLibrary library("libm.so.6");
  EXPECT_FALSE(library.loaded());
  EXPECT_NE(library.reason().find("lacks ncclGetVersion"), std::string::npos) << library.reason();
  EXPECT_TRUE(library.path().empty());
}

TEST(NcclLibrary, VersionStringsDecodeBothEncodings) {
  EXPECT_EQ(nccl_version_string(23203), "2.32.3");  // NCCL >= 2.9: X*10000 + Y*100 + Z
  EXPECT_EQ(nccl_version_string(21803), "2.18.3");
  EXPECT_EQ(nccl_version_string(2708), "2.7.8");  // NCCL < 2.9: X*1000 + Y*100 + Z
}

#ifdef HEMIOLA_TEST_NCCL_LIBRARY
TEST(NcclLibrary, WheelLibraryResolvesEveryEntryPoint) {
  const NcclLibrary library(HEMIOLA_TEST_NCCL_LIBRARY);
  ASSERT_TRUE(library.loaded()) << library.reason();
  EXPECT_TRUE(library.reason().empty());
  EXPECT_EQ(library.path(), HEMIOLA_TEST_NCCL_LIBRARY);
  EXPECT_EQ(library.version_code() / 10000, NCCL_MAJOR);
  EXPECT_EQ(library.version().rfind(std::to_string(NCCL_MAJOR) + ".", 0), 0u) << library.version();

  const NcclFunctions& api = library.api();
  EXPECT_NE(api.get_version, nullptr);
  EXPECT_NE(api.get_error_string, nullptr);
  EXPECT_NE(api.get_unique_id, nullptr);
  EXPECT_NE(api.comm_init_rank, nullptr);
  EXPECT_NE(api.comm_destroy, nullptr);
  EXPECT_NE(api.comm_abort, nullptr);
  EXPECT_NE(api.comm_get_async_error, nullptr);
  EXPECT_NE(api.all_reduce, nullptr);
  EXPECT_NE(api.broadcast, nullptr);
  EXPECT_NE(api.group_start, nullptr);
  EXPECT_NE(api.group_end, nullptr);
  const std::string message = api.get_error_string(ncclInvalidArgument);
  EXPECT_NE(message.find("invalid argument"), std::string::npos) << message;
}

TEST(NcclLibrary, EachObjectOwnsItsHandle) {
  // The dynamic linker reference-counts the library: closing one object's
  // handle must leave another object's function pointers valid.
  const NcclLibrary kept(HEMIOLA_TEST_NCCL_LIBRARY);
  ASSERT_TRUE(kept.loaded()) << kept.reason();
  { const NcclLibrary closed(HEMIOLA_TEST_NCCL_LIBRARY); ASSERT_TRUE(closed.loaded()); }
  int version = 0;
  ASSERT_EQ(kept.api().get_version(&version), ncclSuccess);
  EXPECT_EQ(version, kept.version_code());
}
#else
TEST(NcclLibrary, WheelLibraryResolvesEveryEntryPoint) {
  GTEST_SKIP() << "the nvidia-nccl-cu13 wheel was not found at configure time "
                  "(pip install nvidia-nccl-cu13 and reconfigure)";
}
#endif

}  // namespace
}  // namespace hemiola::comm
