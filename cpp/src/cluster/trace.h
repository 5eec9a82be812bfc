// Loader for the Philly trace as pre-processed by the Pollux artifact
// (columns timestamp,duration,num_gpus[,gpu_time,cluster]; duration in seconds).
#pragma once

#include <cstdint>
#include <iosfwd>
#include <string>
#include <vector>

#include "interrupt.h"
#include "job.h"

namespace hemiola::cluster {

struct TraceOptions {
  std::uint64_t seed = 0;     // picks each row's model
  long long first_row = 0;    // 0-based index of the first data row to use
  long long max_rows = -1;    // -1: all rows from first_row on; otherwise > 0
  // Asked every few milliseconds while the file is read: true stops the load
  // with Interrupted (Python's bindings raise KeyboardInterrupt on Ctrl-C).
  StopCheck stop;
  // At most this many jobs (the simulator's limit): a selection of more is
  // refused at the row past it, while reading, not after loading them all.
  long long max_jobs = kMaxJobs;
};

// Longest duration a row may have: one year (the longest Philly job is 53 days).
constexpr double kMaxTraceDurationS = 365.0 * 86400.0;

// Mapping of a row to a job (documented in docs/cluster.md):
//  - arrival = timestamp - earliest timestamp among the selected rows;
//  - model   = uniform over `models`, drawn from a generator seeded with `seed`
//              in file order (so a seed fixes the mapping);
//  - iterations = max(1, round(duration / isolated iteration time)), where the
//    isolated iteration time is forward + backward, plus size * beta when the job
//    needs more GPUs than one node has (an uncontended all-reduce). A job alone on
//    an empty cluster therefore runs for about its recorded duration.
// Two optional columns turn the format into a general job list: `model` (a
// model name; empty = the seeded choice) and `iterations` (a positive integer;
// empty = derived from the duration as above).
// Jobs are returned sorted by arrival (ties in file order) with ids 0..n-1.
// Malformed rows (a date that does not exist, a non-decimal count, a duration
// above kMaxTraceDurationS or iterations above kMaxIterations, ...) throw
// std::invalid_argument naming the source and line; so does an empty
// selection (no data rows, first_row past the end, max_rows 0) and one of
// more than options.max_jobs rows.
std::vector<JobSpec> parse_trace(std::istream& in, const std::string& source,
                                 const std::vector<ModelSpec>& models, const ClusterSpec& cluster,
                                 const TraceOptions& options);
std::vector<JobSpec> load_trace(const std::string& path, const std::vector<ModelSpec>& models,
                                const ClusterSpec& cluster, const TraceOptions& options);

// "YYYY-MM-DD HH:MM:SS" (UTC) -> seconds since 1970-01-01; throws on anything else.
long long parse_timestamp(const std::string& text);

}  // namespace hemiola::cluster
