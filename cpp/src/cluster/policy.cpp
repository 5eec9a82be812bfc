#include "policy.h"

#include <cerrno>
#include <climits>
#include <cstdlib>
#include <stdexcept>

namespace hemiola::cluster {

namespace {
// "name:N" -> N (> 0); throws naming `what`.
int parse_suffix(const std::string& text, size_t colon, const std::string& what) {
  const std::string num = text.substr(colon + 1);
  char* end = nullptr;
  errno = 0;
  long v = std::strtol(num.c_str(), &end, 10);
  if (num.empty() || end != num.c_str() + num.size() || errno != 0 || v <= 0 || v > 1000000) {
    throw std::invalid_argument(what + " '" + text +
                                "': the number after ':' must be a positive integer");
  }
  return static_cast<int>(v);
}
}  // namespace

void parse_placement(const std::string& text, PolicyConfig& c) {
  if (text == "first-fit" || text == "ff") {
    c.placement = PlacementKind::kFirstFit;
  } else if (text == "random") {
    c.placement = PlacementKind::kRandom;
  } else if (text.rfind("lwf:", 0) == 0) {
    c.placement = PlacementKind::kLeastWorkloadFirst;
    c.kappa = parse_suffix(text, 3, "placement");
  } else {
    throw std::invalid_argument("unknown placement '" + text +
                                "' (use first-fit, random or lwf:K)");
  }
}

void parse_comm(const std::string& text, PolicyConfig& c) {
  if (text == "ada-srsf") {
    c.comm = CommKind::kAdaSrsf;
    c.max_concurrent = 2;
  } else if (text == "srsf:inf") {  // accept all contention
    c.comm = CommKind::kSrsf;
    c.max_concurrent = INT_MAX;
  } else if (text.rfind("srsf:", 0) == 0) {
    c.comm = CommKind::kSrsf;
    c.max_concurrent = parse_suffix(text, 4, "communication policy");
  } else {
    throw std::invalid_argument("unknown communication policy '" + text +
                                "' (use srsf:N, srsf:inf or ada-srsf)");
  }
}

Fidelity parse_fidelity(const std::string& text) {
  if (text == "task") return Fidelity::kTask;
  if (text == "iteration") return Fidelity::kIteration;
  throw std::invalid_argument("unknown fidelity '" + text + "' (use task or iteration)");
}

JobOrder parse_job_order(const std::string& text) {
  if (text == "fifo") return JobOrder::kFifo;
  if (text == "srsf") return JobOrder::kSrsf;
  throw std::invalid_argument("unknown job order '" + text + "' (use fifo or srsf)");
}

std::string job_order_name(JobOrder order) { return order == JobOrder::kFifo ? "fifo" : "srsf"; }

std::string placement_name(const PolicyConfig& c) {
  switch (c.placement) {
    case PlacementKind::kFirstFit: return "first-fit";
    case PlacementKind::kRandom: return "random";
    case PlacementKind::kLeastWorkloadFirst: return "lwf:" + std::to_string(c.kappa);
  }
  return "?";
}

std::string comm_name(const PolicyConfig& c) {
  if (c.comm == CommKind::kAdaSrsf) return "ada-srsf";
  if (c.max_concurrent == INT_MAX) return "srsf:inf";
  return "srsf:" + std::to_string(c.max_concurrent);
}

std::string fidelity_name(Fidelity f) { return f == Fidelity::kTask ? "task" : "iteration"; }

}  // namespace hemiola::cluster
