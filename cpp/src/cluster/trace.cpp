#include "trace.h"

#include <algorithm>
#include <cmath>
#include <fstream>
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
    throw std::invalid_argument("timestamp '" + s + "' is not 'YYYY-MM-DD HH:MM:SS'");
  }
  try {
    const int y = digits(s, 0, 4), mo = digits(s, 5, 2), d = digits(s, 8, 2);
    const int h = digits(s, 11, 2), mi = digits(s, 14, 2), se = digits(s, 17, 2);
    if (mo < 1 || mo > 12 || d < 1 || d > 31 || h > 23 || mi > 59 || se > 60) {
      throw std::invalid_argument("out of range");
    }
    return days_from_civil(y, mo, d) * 86400LL + h * 3600LL + mi * 60LL + se;
  } catch (const std::invalid_argument&) {
    throw std::invalid_argument("timestamp '" + s + "' is not 'YYYY-MM-DD HH:MM:SS'");
  }
}

std::vector<JobSpec> parse_trace(std::istream& in, const std::string& source,
                                 const std::vector<ModelSpec>& models, const ClusterSpec& cluster,
                                 const TraceOptions& options) {
  if (models.empty()) throw std::invalid_argument("trace: no models to map jobs to");
  if (options.first_row < 0) throw std::invalid_argument("trace: first_row must be >= 0");
  validate_cluster(cluster);
  CsvReader reader(in, source, {"timestamp", "duration", "num_gpus"});
  Rng rng(options.seed);
  std::vector<JobSpec> jobs;
  std::vector<long long> stamps;
  long long row = -1;
  while (reader.next()) {
    ++row;
    if (row < options.first_row) continue;
    if (options.max_rows >= 0 && row >= options.first_row + options.max_rows) break;
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
    const double gpus = reader.number("num_gpus");
    if (gpus != std::floor(gpus) || gpus <= 0.0 || gpus > 1e9) {
      throw std::invalid_argument(reader.where() +
                                  ": column 'num_gpus' must be a positive integer, got '" +
                                  reader.field("num_gpus") + "'");
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
      if (job.iterations <= 0) {
        throw std::invalid_argument(reader.where() + ": column 'iterations' must be > 0, got " +
                                    reader.field("iterations"));
      }
    } else {
      double iteration_ms = m.compute_ms();
      if (job.num_gpus > cluster.gpus_per_node) iteration_ms += m.size_mb * cluster.beta_ms_per_mb;
      job.iterations = std::max<long long>(1, std::llround(duration_s * 1000.0 / iteration_ms));
    }
    validate_job(job, models, cluster);  // wider than the cluster, memory, ...
    jobs.push_back(job);
    stamps.push_back(stamp);
  }
  if (jobs.empty()) return jobs;
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
