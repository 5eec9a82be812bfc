// The policy choices of one simulation run, parsed from short strings
// ("first-fit", "random", "lwf:4"; "srsf:1", "srsf:2", "srsf:inf", "ada-srsf";
// "task", "iteration"; "fifo", "srsf").
#pragma once

#include <climits>
#include <cstdint>
#include <string>

namespace hemiola::cluster {

enum class PlacementKind { kFirstFit, kRandom, kLeastWorkloadFirst };
enum class CommKind { kSrsf, kAdaSrsf };
enum class Fidelity { kTask, kIteration };
// Order in which arrived-but-unplaced jobs are offered to placement.
enum class JobOrder { kFifo, kSrsf };

struct PolicyConfig {
  PlacementKind placement = PlacementKind::kLeastWorkloadFirst;
  int kappa = 4;            // LWF-kappa: jobs of <= kappa GPUs spread, larger ones pack by node
  CommKind comm = CommKind::kAdaSrsf;
  int max_concurrent = 1;   // SRSF(n): at most n ongoing transfers per node (srsf:inf: no limit)
  Fidelity fidelity = Fidelity::kTask;
  JobOrder job_order = JobOrder::kFifo;
  std::uint64_t seed = 0;   // for random placement
};

// Parse helpers; throw std::invalid_argument with the accepted spellings.
void parse_placement(const std::string& text, PolicyConfig& config);
void parse_comm(const std::string& text, PolicyConfig& config);
Fidelity parse_fidelity(const std::string& text);
JobOrder parse_job_order(const std::string& text);
std::string job_order_name(JobOrder order);
std::string placement_name(const PolicyConfig& config);
std::string comm_name(const PolicyConfig& config);
std::string fidelity_name(Fidelity fidelity);

}  // namespace hemiola::cluster
