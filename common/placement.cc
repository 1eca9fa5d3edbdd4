#include "common/placement.h"

#include <algorithm>
#include <numeric>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "common/tensor_view.h"

namespace psflow {

absl::StatusOr<Placement> PlaceVariables(const std::vector<VariableShape>& variables, int num_ps,
                                         int64_t split_bytes, int64_t slice_bytes) {
  if (num_ps < 1) return absl::InvalidArgumentError("placement needs at least one ps");
  Placement placement;
  placement.set_num_ps(num_ps);
  std::vector<int64_t> load(num_ps, 0);
  absl::flat_hash_set<std::string> names;
  std::vector<int> whole;  // indices of variables placed whole
  for (size_t i = 0; i < variables.size(); ++i) {
    const VariableShape& v = variables[i];
    if (!names.insert(v.name).second) {
      return absl::InvalidArgumentError(absl::StrCat("variable '", v.name, "' appears twice"));
    }
    if (v.shape.empty() || NumElements(v.shape) <= 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("variable '", v.name, "' has shape ", ShapeString(v.shape)));
    }
    VariablePlacement* vp = placement.add_variable();
    vp->set_name(v.name);
    for (int64_t d : v.shape) vp->add_shape(d);
    vp->set_non_trainable(!v.trainable);
    const int64_t bytes = NumElements(v.shape) * 4;
    const int64_t rows = v.shape[0];
    if (bytes <= split_bytes || rows < 2) {
      whole.push_back(static_cast<int>(i));
      continue;
    }
    // Slices per ps: enough that none is above slice_bytes.
    int64_t per_ps = 1;
    if (slice_bytes > 0) {
      const int64_t most = slice_bytes * num_ps;
      per_ps = (bytes + most - 1) / most;
    }
    const int64_t parts = std::min<int64_t>(per_ps * num_ps, rows);
    if (parts < 2) {
      whole.push_back(static_cast<int>(i));
      continue;
    }
    const int64_t row_bytes = bytes / rows;
    int64_t begin = 0;
    for (int64_t p = 0; p < parts; ++p) {
      int64_t end = begin + rows / parts + (p < rows % parts ? 1 : 0);
      VariableSlice* s = vp->add_slice();
      s->set_ps(static_cast<int>(p % num_ps));
      s->set_row_begin(begin);
      s->set_row_end(end);
      load[p % num_ps] += (end - begin) * row_bytes;
      begin = end;
    }
  }
  // Largest first; equal sizes keep model order so the result is stable.
  std::stable_sort(whole.begin(), whole.end(), [&](int a, int b) {
    return NumElements(variables[a].shape) > NumElements(variables[b].shape);
  });
  for (int i : whole) {
    int target = static_cast<int>(std::min_element(load.begin(), load.end()) - load.begin());
    VariableSlice* s = placement.mutable_variable(i)->add_slice();
    s->set_ps(target);
    s->set_row_begin(0);
    s->set_row_end(variables[i].shape[0]);
    load[target] += NumElements(variables[i].shape) * 4;
  }
  return placement;
}

std::vector<SliceRef> SlicesOnPs(const Placement& placement, int ps) {
  std::vector<SliceRef> out;
  for (int i = 0; i < placement.variable_size(); ++i) {
    const VariablePlacement& v = placement.variable(i);
    std::vector<int64_t> shape(v.shape().begin(), v.shape().end());
    const int64_t row_floats =
        shape.empty() ? 0 : NumElements(shape) / std::max<int64_t>(shape[0], 1);
    for (const VariableSlice& s : v.slice()) {
      if (s.ps() != ps) continue;
      SliceRef r;
      r.name = v.name();
      r.variable_shape = shape;
      r.slice_shape = shape;
      r.slice_shape[0] = s.row_end() - s.row_begin();
      r.row_begin = s.row_begin();
      r.row_end = s.row_end();
      r.float_offset = s.row_begin() * row_floats;
      r.variable_index = i;
      r.trainable = !v.non_trainable();
      out.push_back(std::move(r));
    }
  }
  return out;
}

std::vector<TensorSink> SliceSinks(const Placement& placement, int ps,
                                   absl::Span<float* const> buffers, const std::string& slot,
                                   DataType dtype) {
  std::vector<TensorSink> sinks;
  for (const SliceRef& s : SlicesOnPs(placement, ps)) {
    TensorSink& sink = sinks.emplace_back(TensorSink{
        s.name, slot, s.slice_shape, buffers[s.variable_index] + s.float_offset, true, dtype});
    sink.row_begin = s.row_begin;
  }
  return sinks;
}

namespace {

// Ps `ps`'s slices as refs of `slot` in `dtype`, each given its values by
// `point(slice, &ref)`.
template <typename Point>
std::vector<TensorRef> RefsOnPs(const Placement& placement, int ps, const std::string& slot,
                                DataType dtype, Point point) {
  std::vector<TensorRef> refs;
  for (const SliceRef& s : SlicesOnPs(placement, ps)) {
    refs.push_back({s.name, slot, s.slice_shape, nullptr, dtype, s.row_begin});
    point(s, &refs.back());
  }
  return refs;
}

}  // namespace

std::vector<TensorRef> SliceRefs(const Placement& placement, int ps,
                                 absl::Span<const float* const> buffers, const std::string& slot,
                                 DataType dtype) {
  return RefsOnPs(placement, ps, slot, dtype, [&](const SliceRef& s, TensorRef* r) {
    r->data = buffers[s.variable_index] + s.float_offset;
  });
}

std::vector<TensorRef> EncodedSliceRefs(const Placement& placement, int ps,
                                        absl::Span<const uint16_t* const> values, DataType dtype) {
  return RefsOnPs(placement, ps, "", dtype, [&](const SliceRef& s, TensorRef* r) {
    r->encoded = values[s.variable_index] + s.float_offset;
  });
}

std::vector<TensorSink> StateSinks(const Placement& placement, int ps,
                                   const std::vector<std::vector<float*>>& buffers,
                                   const std::vector<std::string>& slots) {
  std::vector<TensorSink> sinks;
  for (size_t k = 0; k < slots.size(); ++k) {
    if (buffers[k].empty()) continue;
    for (TensorSink& s : SliceSinks(placement, ps, buffers[k], slots[k]))
      sinks.push_back(std::move(s));
  }
  return sinks;
}

std::vector<TensorRef> StateRefs(const Placement& placement, int ps,
                                 const std::vector<std::vector<const float*>>& buffers,
                                 const std::vector<std::string>& slots) {
  std::vector<TensorRef> refs;
  for (size_t k = 0; k < slots.size(); ++k) {
    if (buffers[k].empty()) continue;
    for (TensorRef& r : SliceRefs(placement, ps, buffers[k], slots[k]))
      refs.push_back(std::move(r));
  }
  return refs;
}

bool AppliesEachGradient(const JobConfig& job) {
  return job.mode() == JobConfig::ASYNC || (job.mode() == JobConfig::SSP && job.staleness() > 0);
}

int64_t VersionAhead(const JobConfig& job, int64_t newest) {
  return std::min<int64_t>(newest + 2 * job.num_workers() + 2, job.train_steps());
}

JobConfig ReplicaJob(const JobConfig& job) {
  JobConfig replica = job;
  replica.set_wire_dtype(JobConfig::FP32);
  return replica;
}

DataType WireDtypeOf(const JobConfig& job) {
  switch (job.wire_dtype()) {
    case JobConfig::FP32:
      return DT_FLOAT;
    case JobConfig::BF16:
      return DT_BFLOAT16;
    case JobConfig::FP16:
      return DT_HALF;
    default:
      return DT_INVALID;
  }
}

std::vector<SliceSpec> SliceSpecs(const Placement& placement, int ps) {
  std::vector<SliceSpec> specs;
  for (const SliceRef& s : SlicesOnPs(placement, ps)) {
    SliceSpec& spec = specs.emplace_back();
    spec.set_name(s.name);
    for (int64_t d : s.slice_shape) spec.add_shape(d);
    spec.set_row_begin(s.row_begin);
    spec.set_row_end(s.row_end);
    spec.set_non_trainable(!s.trainable);
  }
  return specs;
}

std::vector<int64_t> BytesPerPs(const Placement& placement) {
  std::vector<int64_t> bytes(placement.num_ps(), 0);
  for (int p = 0; p < placement.num_ps(); ++p) {
    for (const SliceRef& s : SlicesOnPs(placement, p)) bytes[p] += NumElements(s.slice_shape) * 4;
  }
  return bytes;
}

int ReplicasPerWorker(const JobConfig& job) { return std::max(job.replicas_per_worker(), 1); }

int64_t WorkerBatch(const JobConfig& job) {
  return static_cast<int64_t>(job.batch_size()) * ReplicasPerWorker(job);
}

}  // namespace psflow
