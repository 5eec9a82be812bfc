#include "trace.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <iomanip>
#include <limits>
#include <sstream>
#include <stdexcept>

#include "csv.h"
#include "rng.h"

namespace hemiola::cluster {

namespace {
// Days since 1970-01-01 of a proleptic Gregorian date (H. Hinnant's algorithm).
long long days_from_civil(long long y, unsigned m, unsigned d) {
  y -= m <= 2;
  const long long era = (y >= 0 ? y : y - 399) / 400;
  const unsigned yoe = static_cast<unsigned>(y - era * 400);
  const unsigned doy = (153 * (m + (m > 2 ? -3 : 9)) + 2) / 5 + d - 1;
  const unsigned doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
  return era * 146097 + static_cast<long long>(doe) - 719468;
}

// 1.6e+13 rather than to_string's 16129032258064.000000.
std::string format_count(double v) {
  std::ostringstream out;
  out << std::setprecision(3) << v;
  return out.str();
}

int days_in_month(int y, int m) {
  static const int kDays[] = {31, 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31};
  const bool leap = (y % 4 == 0 && y % 100 != 0) || y % 400 == 0;
  return m == 2 && leap ? 29 : kDays[m - 1];
}

int digits(const std::string& s, size_t pos, size_t n) {
  int v = 0;
  for (size_t i = pos; i < pos + n; ++i) {
    if (s[i] < '0' || s[i] > '9') throw std::invalid_argument("bad timestamp");
    v = v * 10 + (s[i] - '0');
  }
  return v;
}
}  // namespace

long long parse_timestamp(const std::string& s) {
  // 0123456789012345678
  // YYYY-MM-DD HH:MM:SS
  if (s.size() != 19 || s[4] != '-' || s[7] != '-' || (s[10] != ' ' && s[10] != 'T') ||
      s[13] != ':' || s[16] != ':') {
    throw std::invalid_argument("timestamp '" + abbreviate(s) + "' is not 'YYYY-MM-DD HH:MM:SS'");
  }
  try {
    const int y = digits(s, 0, 4), mo = digits(s, 5, 2), d = digits(s, 8, 2);
    const int h = digits(s, 11, 2), mi = digits(s, 14, 2), se = digits(s, 17, 2);
    // A real calendar date (no 2021-02-30) and time; no leap seconds, which a
    // job trace has no use for.
    if (mo < 1 || mo > 12 || d < 1 || d > days_in_month(y, mo) || h > 23 || mi > 59 ||
        se > 59) {
      throw std::invalid_argument("out of range");
    }
    return days_from_civil(y, mo, d) * 86400LL + h * 3600LL + mi * 60LL + se;
  } catch (const std::invalid_argument&) {
    throw std::invalid_argument("timestamp '" + abbreviate(s) +
                                "' is not a real date and time 'YYYY-MM-DD HH:MM:SS'");
  }
}

std::vector<JobSpec> parse_trace(std::istream& in, const std::string& source,
                                 const std::vector<ModelSpec>& models, const ClusterSpec& cluster,
                                 const TraceOptions& options) {
  if (models.empty()) throw std::invalid_argument("trace: no models to map jobs to");
  if (options.first_row < 0) {
    throw std::invalid_argument(source + ": first_row must be >= 0, got " +
                                std::to_string(options.first_row));
  }
  // -1 is the documented "all rows"; any other value <= 0 is a mistake (a
  // selection of nothing, or a sign slip), not a request for everything.
  if (options.max_rows == 0 || options.max_rows < -1) {
    throw std::invalid_argument(source + ": max_rows must be > 0 (or -1 for all rows), got " +
                                std::to_string(options.max_rows));
  }
  if (options.max_jobs < 1 || options.max_jobs > kMaxJobs) {
    throw std::invalid_argument(source + ": max_jobs must be in 1.." + std::to_string(kMaxJobs) +
                                ", got " + std::to_string(options.max_jobs));
  }
  validate_cluster(cluster);
  CsvReader reader(in, source, {"timestamp", "duration", "num_gpus"});
  Rng rng(options.seed);
  std::vector<JobSpec> jobs;
  std::vector<long long> stamps;
  long long row = -1;
  StopPoller poller(options.stop);
  while (reader.next()) {
    ++row;
    if (poller.should_stop(row)) {
      throw Interrupted("loading " + source + " interrupted at line " +
                        std::to_string(reader.line()));
    }
    if (row < options.first_row) continue;
    if (options.max_rows >= 0 && row >= options.first_row + options.max_rows) break;
    // Checked before the row is kept: a file of 25M rows used to take the
    // whole of it into memory (or run out) before the simulator refused it.
    if (static_cast<long long>(jobs.size()) >= options.max_jobs) {
      throw std::invalid_argument(
          reader.where() + ": more than " + std::to_string(options.max_jobs) +
          " jobs selected (the simulator's limit); select fewer rows with first_row and "
          "max_rows (--first-row, --max-rows)");
    }
    JobSpec job;
    job.origin = reader.where();
    long long stamp = 0;
    try {
      stamp = parse_timestamp(reader.field("timestamp"));
    } catch (const std::invalid_argument& e) {
      throw std::invalid_argument(reader.where() + ": column 'timestamp': " + e.what());
    }
    const double duration_s = reader.number("duration");
    if (duration_s < 0.0) {
      throw std::invalid_argument(reader.where() + ": column 'duration' is negative (" +
                                  reader.field("duration") + ")");
    }
    if (duration_s > kMaxTraceDurationS) {
      throw std::invalid_argument(reader.where() + ": column 'duration' is out of range (" +
                                  reader.field("duration") + " s; at most " +
                                  std::to_string(static_cast<long long>(kMaxTraceDurationS)) +
                                  " s, one year)");
    }
    long long gpus = 0;
    try {
      gpus = reader.integer("num_gpus");
    } catch (const std::invalid_argument&) {
      gpus = 0;  // reported below with the column's own message
    }
    if (gpus <= 0 || gpus > std::numeric_limits<int>::max()) {
      throw std::invalid_argument(reader.where() +
                                  ": column 'num_gpus' must be a positive decimal integer, got '" +
                                  abbreviate(reader.field("num_gpus")) + "'");
    }
    job.num_gpus = static_cast<int>(gpus);
    // Drawn for every row, even one that names its model, so that adding a
    // model to one row does not change the models drawn for the others.
    job.model = static_cast<int>(rng.uniform_int(0, static_cast<long long>(models.size()) - 1));
    if (reader.has("model") && !reader.field("model").empty()) {
      try {
        job.model = find_model(models, reader.field("model"));
      } catch (const std::invalid_argument& e) {
        throw std::invalid_argument(reader.where() + ": column 'model': " + e.what());
      }
    }
    const ModelSpec& m = models[job.model];
    if (reader.has("iterations") && !reader.field("iterations").empty()) {
      job.iterations = reader.integer("iterations");
      if (job.iterations <= 0 || job.iterations > kMaxIterations) {
        throw std::invalid_argument(reader.where() + ": column 'iterations' must be in 1.." +
                                    std::to_string(kMaxIterations) + ", got " +
                                    reader.field("iterations"));
      }
    } else {
      double iteration_ms = m.compute_ms();
      if (job.num_gpus > cluster.gpus_per_node) iteration_ms += m.size_mb * cluster.beta_ms_per_mb;
      // Checked as a double: std::llround of a value beyond long long is undefined.
      const double iterations = std::round(duration_s * 1000.0 / iteration_ms);
      if (iterations > static_cast<double>(kMaxIterations)) {
        throw std::invalid_argument(
            reader.where() + ": column 'duration' is out of range: " + reader.field("duration") +
            " s is " + format_count(iterations) + " iterations of model '" + m.name +
            "', more than " + std::to_string(kMaxIterations));
      }
      job.iterations = std::max<long long>(1, static_cast<long long>(iterations));
    }
    validate_job(job, models, cluster);  // wider than the cluster, memory, ...
    jobs.push_back(job);
    stamps.push_back(stamp);
  }
  // An empty selection is a mistake to report, not a workload whose every
  // metric is zero.
  if (row < 0) throw std::invalid_argument(source + ": no data rows (only a header)");
  if (jobs.empty()) {
    throw std::invalid_argument(source + ": first_row " + std::to_string(options.first_row) +
                                " is past the last data row (the file has " +
                                std::to_string(row + 1) + " data rows, numbered from 0)");
  }
  const long long t0 = *std::min_element(stamps.begin(), stamps.end());
  for (size_t i = 0; i < jobs.size(); ++i) jobs[i].arrival_ms = (stamps[i] - t0) * 1000.0;
  std::stable_sort(jobs.begin(), jobs.end(),
                   [](const JobSpec& a, const JobSpec& b) { return a.arrival_ms < b.arrival_ms; });
  for (size_t i = 0; i < jobs.size(); ++i) jobs[i].id = static_cast<int>(i);
  return jobs;
}

std::vector<JobSpec> load_trace(const std::string& path, const std::vector<ModelSpec>& models,
                                const ClusterSpec& cluster, const TraceOptions& options) {
  std::ifstream in(path);
  if (!in) throw std::invalid_argument("cannot open trace file '" + path + "'");
  return parse_trace(in, path, models, cluster, options);
}

}  // namespace hemiola::cluster
