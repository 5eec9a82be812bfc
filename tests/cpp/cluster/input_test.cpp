// Bad input gives a clear error naming the row or field.
#include <gtest/gtest.h>

#include <cmath>
#include <sstream>
#include <streambuf>

#include "cluster/csv.h"
#include "cluster/policy.h"
#include "cluster/simulator.h"
#include "cluster/trace.h"
#include "expect_error.h"

namespace hemiola::cluster {
namespace {

std::vector<JobSpec> trace(const std::string& text, const ClusterSpec& c = ClusterSpec{}) {
  std::istringstream in(text);
  return parse_trace(in, "t.csv", builtin_models(), c, TraceOptions{});
}

const char* kHeader = "timestamp,duration,num_gpus,gpu_time,cluster\n";

TEST(Trace, ParsesAndMaps) {
  auto jobs = trace(std::string(kHeader) +
                    "2017-10-09 07:01:55,90.0,1,90.0,x\n"
                    "2017-10-09 07:01:50,9000.0,8,72000.0,x\n");
  ASSERT_EQ(jobs.size(), 2u);
  // Sorted by arrival; the earliest row defines t = 0.
  EXPECT_EQ(jobs[0].arrival_ms, 0.0);
  EXPECT_EQ(jobs[0].num_gpus, 8);
  EXPECT_EQ(jobs[0].origin, "t.csv line 3");
  EXPECT_EQ(jobs[1].arrival_ms, 5000.0);
  // Iterations reproduce the duration with the isolated iteration time.
  const auto models = builtin_models();
  const ModelSpec& m1 = models[jobs[1].model];
  EXPECT_EQ(jobs[1].iterations, std::llround(90000.0 / m1.compute_ms()));
  const ModelSpec& m0 = models[jobs[0].model];
  EXPECT_EQ(jobs[0].iterations,
            std::llround(9000000.0 / (m0.compute_ms() + m0.size_mb * 0.856)));
}

TEST(Trace, SliceAndTimestamp) {
  std::string text = kHeader;
  for (int i = 0; i < 10; ++i) text += "2017-10-09 07:01:0" + std::to_string(i) + ",60,1,60,x\n";
  std::istringstream in(text);
  TraceOptions o;
  o.first_row = 3;
  o.max_rows = 4;
  auto jobs = parse_trace(in, "t.csv", builtin_models(), ClusterSpec{}, o);
  ASSERT_EQ(jobs.size(), 4u);
  EXPECT_EQ(jobs[0].origin, "t.csv line 5");
  EXPECT_EQ(jobs[3].arrival_ms, 3000.0);
  EXPECT_EQ(parse_timestamp("1970-01-02 00:00:01"), 86401);
  EXPECT_EQ(parse_timestamp("2000-03-01 00:00:00"), 951868800);
}

TEST(Trace, MalformedRowsNameTheLine) {
  const std::string h = kHeader;
  expect_error([&] { trace(h + "2017-10-09 07:01:55,60,1,60,x\n2017-10-09,60,1,60,x\n"); },
               "t.csv line 3: column 'timestamp'");
  expect_error([&] { trace(h + "2017-10-09 07:01:55,-5,1,60,x\n"); },
               "t.csv line 2: column 'duration' is negative");
  expect_error([&] { trace(h + "2017-10-09 07:01:55,abc,1,60,x\n"); },
               "t.csv line 2: column 'duration' is not a number");
  expect_error([&] { trace(h + "2017-10-09 07:01:55,60,0,60,x\n"); },
               "t.csv line 2: column 'num_gpus' must be a positive decimal integer");
  expect_error([&] { trace(h + "2017-10-09 07:01:55,60,1.5,60,x\n"); }, "line 2");
  expect_error([&] { trace(h + "2017-10-09 07:01:55,60,1\n"); },
               "t.csv line 2: expected 5 fields, got 3");
  expect_error([&] { trace("timestamp,num_gpus\n"); }, "missing column 'duration'");
  expect_error([&] { trace(""); }, "empty file");
  // A column named twice is the header's fault, refused at line 1, not at every row.
  expect_error([&] { trace("timestamp,duration,num_gpus,duration\n2017-10-09 07:01:55,1,1,1\n"); },
               "t.csv line 1: column 'duration' appears twice");
  // A runaway line fails at its start, whether header or row.
  const std::string huge(CsvReader::kMaxLineBytes + 1, '9');
  expect_error([&] { trace(huge + "\n"); }, "t.csv line 1: longer than 1048576 bytes");
  expect_error([&] { trace(h + "2017-10-09 07:01:55,60,1,60,x\n" + huge); },
               "t.csv line 3: longer than 1048576 bytes");
  // A line of exactly the limit is read (and then judged on its fields).
  expect_error([&] { trace(h + std::string(CsvReader::kMaxLineBytes, '9') + "\n"); },
               "t.csv line 2: expected 5 fields, got 1");
  // Wider than the cluster (64 GPUs by default).
  expect_error(
      [&] { trace(h + "2017-10-09 07:01:55,60,1,60,x\n2017-10-09 07:01:55,60,128,60,x\n"); },
               "t.csv line 3: needs 128 GPUs but the cluster has only 64");
  expect_error([&] { load_trace("/nonexistent/philly.csv", builtin_models(), ClusterSpec{}, {}); },
               "cannot open trace file '/nonexistent/philly.csv'");
}

TEST(Trace, AStopCheckEndsALoadMidFileNamingTheLine) {
  std::string text = kHeader;
  for (int i = 0; i < 200000; ++i) text += "2017-10-09 07:01:55,60,1,60,x\n";
  std::istringstream in(text);
  TraceOptions options;
  int calls = 0;
  options.stop = [&calls] { return ++calls == 3; };
  try {
    parse_trace(in, "t.csv", builtin_models(), ClusterSpec{}, options);
    FAIL() << "the load ignored its stop check";
  } catch (const Interrupted& e) {
    EXPECT_NE(std::string(e.what()).find("loading t.csv interrupted at line"), std::string::npos)
        << e.what();
  }
  EXPECT_EQ(calls, 3);
}

// An endless trace, made a row at a time as the reader asks for bytes (never
// held whole), counting the rows it handed out.
class EndlessTrace : public std::streambuf {
 public:
  long long rows_served() const { return rows_; }

 protected:
  int_type underflow() override {
    line_ = rows_ < 0 ? std::string(kHeader) : std::string("2017-10-09 07:01:55,60,1,60,x\n");
    ++rows_;
    setg(line_.data(), line_.data(), line_.data() + line_.size());
    return traits_type::to_int_type(line_[0]);
  }

 private:
  std::string line_;
  long long rows_ = -1;  // the header first
};

TEST(Trace, TheJobLimitIsCheckedWhileReading) {
  // The limit is the simulator's 10^7 by default; 1000 here, so that a file
  // of rows without end shows the load stops at the limit's next row (it
  // used to read the whole file first: 20 s and 3.5 GB for 10^7 + 1 rows).
  EndlessTrace endless;
  std::istream in(&endless);
  TraceOptions options;
  options.max_jobs = 1000;
  expect_error([&] { parse_trace(in, "t.csv", builtin_models(), ClusterSpec{}, options); },
               "t.csv line 1002: more than 1000 jobs selected (the simulator's limit); select "
               "fewer rows with first_row and max_rows (--first-row, --max-rows)");
  EXPECT_LE(endless.rows_served(), 1001 + 1);  // the reader may look one line ahead
  // Exactly the limit loads; the limit itself is checked.
  std::string text = kHeader;
  for (int i = 0; i < 1000; ++i) text += "2017-10-09 07:01:55,60,1,60,x\n";
  std::istringstream exact(text);
  EXPECT_EQ(parse_trace(exact, "t.csv", builtin_models(), ClusterSpec{}, options).size(), 1000u);
  options.max_jobs = kMaxJobs + 1;
  std::istringstream again(text);
  expect_error([&] { parse_trace(again, "t.csv", builtin_models(), ClusterSpec{}, options); },
               "max_jobs must be in 1..10000000");
}

TEST(Trace, OptionalModelAndIterationColumns) {
  auto jobs = trace("timestamp,duration,num_gpus,model,iterations\n"
                    "2017-10-09 07:00:00,60,4,resnet50,25\n"
                    "2017-10-09 07:00:01,60,2,,\n");
  ASSERT_EQ(jobs.size(), 2u);
  EXPECT_EQ(jobs[0].model, 1);  // resnet50
  EXPECT_EQ(jobs[0].iterations, 25);
  EXPECT_GE(jobs[1].iterations, 1);  // derived from the duration
  expect_error(
      [] { trace("timestamp,duration,num_gpus,model\n2017-10-09 07:00:00,60,4,gpt\n"); },
      "t.csv line 2: column 'model': unknown model 'gpt' (known: vgg16,");
  expect_error(
      [] { trace("timestamp,duration,num_gpus,iterations\n2017-10-09 07:00:00,60,4,-2\n"); },
      "t.csv line 2: column 'iterations' must be in 1..1000000000, got -2");
}

TEST(Models, UnknownAndNegative) {
  expect_error([] { find_model(builtin_models(), "gpt-5"); },
               "unknown model 'gpt-5' (known: vgg16, resnet50, inception-v3, lstm-ptb)");
  std::istringstream bad("name,size_mb,forward_ms,backward_ms,memory_mb\n"
                         "ok,10,1,1,100\n"
                         "neg,-3,1,1,100\n");
  expect_error([&] { parse_models_csv(bad, "m.csv"); }, "m.csv line 3: model 'neg': size_mb");
  std::istringstream good("name,size_mb,forward_ms,backward_ms,memory_mb\nbert,1300,80,160,9000\n");
  auto models = parse_models_csv(good, "m.csv");
  ASSERT_EQ(models.size(), 1u);
  EXPECT_EQ(models[0].size_mb, 1300.0);
}

TEST(Simulate, RejectsBadJobs) {
  ClusterSpec c;
  PolicyConfig p;
  JobSpec wide;
  wide.num_gpus = 65;
  wide.origin = "my job 7";
  expect_error([&] { simulate(c, builtin_models(), {wide}, p); },
               "my job 7: needs 65 GPUs but the cluster has only 64");
  JobSpec neg;
  neg.iterations = -1;
  expect_error([&] { simulate(c, builtin_models(), {neg}, p); },
               "job 0: iterations must be in 1..1000000000, got -1");
  JobSpec unknown;
  unknown.model = 9;
  expect_error([&] { simulate(c, builtin_models(), {unknown}, p); }, "unknown model index 9");
  ClusterSpec small_memory;
  small_memory.gpu_memory_mb = 1000;
  expect_error([&] { simulate(small_memory, builtin_models(), {JobSpec{}}, p); },
               "needs 4527.000000 MB per GPU");
  expect_error([&] { parse_placement("best-fit", p); }, "unknown placement 'best-fit'");
  expect_error([&] { parse_comm("srsf:0", p); }, "positive integer");
  expect_error([&] { parse_comm("srsf", p); }, "unknown communication policy");
}

}  // namespace
}  // namespace hemiola::cluster
