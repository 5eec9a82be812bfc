// What the reducer says when something goes wrong: the tensors and buckets a
// failed or stalled reduction was at, by name, so that a timeout on one rank
// points at the layer whose gradient never came.
#include <sstream>

#include "engine/reducer/reducer_impl.h"

namespace hemiola {

std::string ReducerImpl::names(const std::vector<size_t>& indices, size_t limit) const {
  std::vector<size_t> unique;
  for (size_t i : indices) {
    if (unique.empty() || unique.back() != i) unique.push_back(i);  // pieces of one tensor
  }
  std::ostringstream out;
  for (size_t i = 0; i < unique.size() && i < limit; ++i) {
    out << (i ? ", " : "") << specs_[unique[i]].name;
  }
  if (unique.size() > limit) out << ", ... (" << unique.size() - limit << " more)";
  return out.str();
}

std::string ReducerImpl::describe(size_t position) const {
  std::ostringstream out;
  const size_t count = plan_.size();
  if (position >= count) {
    out << ", at the usage all-reduce after all " << count << " buckets";
    return out.str();
  }
  const size_t b = issue_order_[position];
  const PlannedBucket& plan = plan_[b];
  out << ", at bucket " << b << " (" << position + 1 << " of " << count << " in issue order; "
      << dtype_name(plan.dtype) << ", " << plan.nbytes()
      << " bytes; parameters: " << names(plan.tensors) << ")";
  if (position + 1 < count) {
    std::vector<size_t> rest;
    for (size_t p = position + 1; p < count; ++p) {
      for (size_t t : plan_[issue_order_[p]].tensors) rest.push_back(t);
    }
    out << "; still pending after it: " << count - position - 1
        << " bucket(s) (parameters: " << names(rest, 4) << ")";
  }
  return out.str();
}

}  // namespace hemiola
