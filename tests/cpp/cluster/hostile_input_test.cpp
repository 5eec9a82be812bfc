// Hostile input (issue 15): values out of range, dates that do not exist,
// non-decimal numbers, byte-order marks, binary files, empty selections; and
// stopping a long run from outside.
#include <gtest/gtest.h>

#include <limits>
#include <sstream>

#include "cluster/policy.h"
#include "cluster/simulator.h"
#include "cluster/trace.h"
#include "cluster/workload.h"
#include "expect_error.h"

namespace hemiola::cluster {
namespace {

std::vector<JobSpec> trace(const std::string& text, const TraceOptions& o = {}) {
  std::istringstream in(text);
  return parse_trace(in, "t.csv", builtin_models(), ClusterSpec{}, o);
}

const std::string kHeader = "timestamp,duration,num_gpus\n";

std::string row(const std::string& stamp, const std::string& duration,
                const std::string& gpus) {
  return stamp + "," + duration + "," + gpus + "\n";
}

TEST(HostileTrace, HugeDurationsAreRefusedNotWrapped) {
  // 1e300 s used to overflow std::llround into a 1-iteration job; 1e12 s was
  // 1.6e13 iterations, which the task level would never finish.
  for (const char* d : {"1e300", "1e12", "31536001"}) {
    expect_error([&] { trace(kHeader + row("2017-10-09 07:01:55", d, "1")); },
                 "t.csv line 2: column 'duration' is out of range (" + std::string(d));
  }
  expect_error([&] { trace(kHeader + row("2017-10-09 07:01:55", "1e400", "1")); },
               "t.csv line 2: column 'duration' is out of range: '1e400'");
  // One year is accepted, and at the iteration level it simulates at once.
  auto jobs = trace(kHeader + row("2017-10-09 07:01:55", "31536000", "1"));
  ASSERT_EQ(jobs.size(), 1u);
  EXPECT_GT(jobs[0].iterations, 100'000'000);
  EXPECT_LE(jobs[0].iterations, kMaxIterations);
  PolicyConfig p;
  p.fidelity = Fidelity::kIteration;
  const auto r = simulate(ClusterSpec{}, builtin_models(), jobs, p);
  EXPECT_NEAR(r.jobs[0].jct_ms, 31536000e3, 100.0);
}

TEST(HostileTrace, DerivedIterationsAreBounded) {
  // A model of 1 microsecond per iteration turns a day into 8.6e10 iterations.
  std::istringstream in(kHeader + row("2017-10-09 07:01:55", "86400", "1"));
  const std::vector<ModelSpec> fast = {{"fast", 1.0, 0.0005, 0.0005, 10.0}};
  expect_error([&] { parse_trace(in, "t.csv", fast, ClusterSpec{}, {}); },
               "t.csv line 2: column 'duration' is out of range: 86400 s is 8.64e+10 "
               "iterations of model 'fast', more than 1000000000");
}

TEST(HostileTrace, IterationCountsAreBounded) {
  const std::string h = "timestamp,duration,num_gpus,iterations\n";
  expect_error([&] { trace(h + "2017-10-09 07:01:55,0,1,9223372036854775807\n"); },
               "t.csv line 2: column 'iterations' must be in 1..1000000000, "
               "got 9223372036854775807");
  expect_error([&] { trace(h + "2017-10-09 07:01:55,0,1,9223372036854775808\n"); },
               "t.csv line 2: column 'iterations' is out of range: '9223372036854775808'");
  expect_error([&] { trace(h + "2017-10-09 07:01:55,0,1,1e3\n"); },
               "t.csv line 2: column 'iterations' is not a decimal integer: '1e3'");
  EXPECT_EQ(trace(h + "2017-10-09 07:01:55,0,1,1000000000\n")[0].iterations, kMaxIterations);
}

TEST(HostileTrace, OnlyRealDates) {
  for (const char* stamp : {"2021-02-30 00:00:00", "2021-02-29 00:00:00", "1900-02-29 00:00:00",
                            "2021-04-31 00:00:00", "2021-13-01 00:00:00", "2021-00-10 00:00:00",
                            "2021-01-01 24:00:00", "2021-01-01 00:60:00", "2021-01-01 00:00:60"}) {
    expect_error([&] { trace(kHeader + row(stamp, "60", "1")); },
                 "t.csv line 2: column 'timestamp': timestamp '" + std::string(stamp) +
                     "' is not a real date and time");
  }
  EXPECT_EQ(parse_timestamp("2020-02-29 00:00:00"), parse_timestamp("2020-02-28 00:00:00") + 86400);
  EXPECT_EQ(parse_timestamp("2000-02-29 23:59:59"), 951868799);
  EXPECT_EQ(parse_timestamp("2021-12-31 00:00:00") + 86400, parse_timestamp("2022-01-01 00:00:00"));
}

TEST(HostileTrace, DecimalNumbersOnly) {
  for (const char* gpus : {"0x10", "4.0", "1e1", "+", "", "1 6", "16abc", "9999999999999"}) {
    expect_error([&] { trace(kHeader + row("2017-10-09 07:01:55", "60", gpus)); },
                 "t.csv line 2: column 'num_gpus' must be a positive decimal integer, got '" +
                     std::string(gpus) + "'");
  }
  for (const char* d : {"0x10", "inf", "nan", "-inf", "1e", ".", "1..2", "0x1p3"}) {
    expect_error([&] { trace(kHeader + row("2017-10-09 07:01:55", d, "1")); },
                 "t.csv line 2: column 'duration' is not a number: '" + std::string(d) + "'");
  }
  auto jobs = trace(kHeader + row("2017-10-09 07:01:55", "6.2e1", "+16"));
  ASSERT_EQ(jobs.size(), 1u);
  EXPECT_EQ(jobs[0].num_gpus, 16);
}

TEST(HostileTrace, ByteOrderMarkIsSkipped) {
  auto jobs = trace("\xEF\xBB\xBF" + kHeader + row("2017-10-09 07:01:55", "60", "2"));
  ASSERT_EQ(jobs.size(), 1u);
  EXPECT_EQ(jobs[0].num_gpus, 2);
}

TEST(HostileTrace, BinaryInputNamesFileAndLine) {
  // The start of a gzip file, then a NUL byte, then a stray Latin-1 byte in a row.
  expect_error([] { trace(std::string("\x1f\x8b\x08\x00\x12\x34", 6) + "\n"); },
               "t.csv line 1: not a UTF-8 text CSV file (byte 0x1f at column 1)");
  expect_error([] { trace(kHeader + std::string("2017-10-09 07:01:55,6\0,1\n", 24)); },
               "t.csv line 2: not a UTF-8 text CSV file (byte 0x00 at column 22)");
  expect_error([] { trace(kHeader + row("2017-10-09 07:01:55", "60", "1") + "caf\xE9,1,1\n"); },
               "t.csv line 3: not a UTF-8 text CSV file (byte 0xe9 at column 4)");
  // Well-formed UTF-8 is text: it reaches the column checks.
  expect_error([] { trace(kHeader + row("2017-10-09 07:01:55", "60", "zw\xC3\xB6lf")); },
               "t.csv line 2: column 'num_gpus' must be a positive decimal integer, got "
               "'zw\xC3\xB6lf'");
}

TEST(HostileTrace, EmptySelectionsAreErrors) {
  std::string ten = kHeader;
  for (int i = 0; i < 10; ++i) ten += row("2017-10-09 07:01:0" + std::to_string(i), "60", "1");
  expect_error([&] { trace(kHeader); }, "t.csv: no data rows (only a header)");
  expect_error([&] { trace(kHeader + "\n  \n"); }, "t.csv: no data rows");
  TraceOptions past;
  past.first_row = 10;
  expect_error([&] { trace(ten, past); },
               "t.csv: first_row 10 is past the last data row (the file has 10 data rows");
  for (long long bad : {0LL, -5LL, -2LL}) {
    TraceOptions o;
    o.max_rows = bad;
    expect_error([&] { trace(ten, o); }, "t.csv: max_rows must be > 0 (or -1 for all rows), got " +
                                              std::to_string(bad));
  }
  TraceOptions last;
  last.first_row = 9;
  EXPECT_EQ(trace(ten, last).size(), 1u);
  TraceOptions all;
  all.max_rows = -1;
  EXPECT_EQ(trace(ten, all).size(), 10u);
}

TEST(HostileSimulate, OutOfRangeJobsModelsAndClusters) {
  PolicyConfig p;
  const auto models = builtin_models();
  expect_error([&] { simulate(ClusterSpec{}, models, {}, p); }, "simulate: no jobs");
  JobSpec huge;
  huge.iterations = std::numeric_limits<long long>::max();
  huge.origin = "row 3";
  expect_error([&] { simulate(ClusterSpec{}, models, {huge}, p); },
               "row 3: iterations must be in 1..1000000000, got 9223372036854775807");
  JobSpec never;
  never.arrival_ms = std::numeric_limits<double>::infinity();
  expect_error([&] { simulate(ClusterSpec{}, models, {never}, p); },
               "arrival_ms must be finite and >= 0");
  ClusterSpec wide;
  wide.nodes = 100000;
  wide.gpus_per_node = 100000;  // 1e10 GPUs: would overflow the int total
  expect_error([&] { simulate(wide, models, {JobSpec{}}, p); },
               "nodes x gpus_per_node must be at most 1048576 GPUs");
  ClusterSpec slow;
  slow.beta_ms_per_mb = 1e300;
  expect_error([&] { simulate(slow, models, {JobSpec{}}, p); }, "beta_ms_per_mb must be > 0");
  std::vector<ModelSpec> big = {{"big", 1e300, 1, 1, 1}};
  expect_error([&] { simulate(ClusterSpec{}, big, {JobSpec{}}, p); },
               "model 'big': size_mb must be a number in [0, 1e+09], got 1e+300");
  PaperWorkloadOptions o;
  o.max_iterations = kMaxIterations + 1;
  expect_error([&] { paper_workload(o, 4); }, "max_iterations <= 1000000000");
  o = {};
  o.jobs = kMaxJobs + 1;
  expect_error([&] { paper_workload(o, 4); }, "paper workload: jobs must be in 0..10000000");
}

// A job of a billion iterations on 8 GPUs of two nodes: hours at the task level.
std::vector<JobSpec> endless() {
  JobSpec j;
  j.num_gpus = 8;
  j.iterations = kMaxIterations;
  return {j};
}

TEST(Interrupt, StopCheckEndsALongRunAtEitherFidelity) {
  for (Fidelity f : {Fidelity::kTask, Fidelity::kIteration}) {
    int calls = 0;
    const StopCheck stop_on_third = [&calls] { return ++calls == 3; };
    PolicyConfig p;
    p.fidelity = f;
    // The iteration level finishes this job in a few events; give it many jobs.
    std::vector<JobSpec> jobs = endless();
    if (f == Fidelity::kIteration) {
      PaperWorkloadOptions o;
      o.jobs = 20'000;
      o.max_iterations = kMaxIterations;
      jobs = paper_workload(o, 4);
    }
    try {
      simulate(ClusterSpec{}, builtin_models(), jobs, p, stop_on_third);
      FAIL() << "the run was not interrupted";
    } catch (const Interrupted& e) {
      EXPECT_EQ(calls, 3);
      EXPECT_NE(std::string(e.what()).find("simulation interrupted after "), std::string::npos)
          << e.what();
    }
  }
}

TEST(Interrupt, ExceptionFromTheCheckPropagates) {
  struct Cancelled {};
  const StopCheck cancel = []() -> bool { throw Cancelled{}; };
  EXPECT_THROW(simulate(ClusterSpec{}, builtin_models(), endless(), PolicyConfig{}, cancel),
               Cancelled);
}

TEST(Interrupt, ACheckThatNeverStopsChangesNothing) {
  PaperWorkloadOptions o;
  o.seed = 4;
  const auto jobs = paper_workload(o, 4);
  int calls = 0;
  const StopCheck never = [&calls] {
    ++calls;
    return false;
  };
  const PolicyConfig p;
  const auto plain = simulate(ClusterSpec{}, builtin_models(), jobs, p);
  const auto polled = simulate(ClusterSpec{}, builtin_models(), jobs, p, never);
  EXPECT_GE(calls, 1);  // asked at least at the start
  EXPECT_EQ(plain.mean_jct_ms, polled.mean_jct_ms);
  EXPECT_EQ(plain.makespan_ms, polled.makespan_ms);
  EXPECT_EQ(plain.events, polled.events);
}

}  // namespace
}  // namespace hemiola::cluster
