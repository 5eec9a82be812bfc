// Shared by the cluster input tests: bad input must be refused with a message
// that says what is wrong.
#pragma once

#include <gtest/gtest.h>

#include <stdexcept>
#include <string>

namespace hemiola::cluster {

// Runs `fn`, expects std::invalid_argument whose message contains `needle`.
template <typename Fn>
void expect_error(Fn fn, const std::string& needle) {
  try {
    fn();
    FAIL() << "no error; expected one containing '" << needle << "'";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos)
        << "message was: " << e.what();
  }
}

}  // namespace hemiola::cluster
