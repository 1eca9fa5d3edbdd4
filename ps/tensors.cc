#include "ps/tensors.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace psflow::ps {
namespace {

std::vector<int64_t> ShapeOf(const SliceSpec& s) { return {s.shape().begin(), s.shape().end()}; }

}  // namespace

std::vector<TensorSink> InitSinks(const InitHeader& header,
                                  const std::vector<std::string>& slot_names,
                                  std::vector<Shard::SliceValues>* values) {
  // Nothing is allocated here: each tensor grows as its chunks arrive, so a
  // header alone (a peer's garbage) costs nothing. Slots that never come
  // stay empty (the shard starts them at zero).
  values->assign(header.slice_size(), {});
  for (Shard::SliceValues& v : *values) v.slots.resize(slot_names.size());
  std::vector<TensorSink> sinks;
  for (int i = 0; i < header.slice_size(); ++i) {
    const SliceSpec& s = header.slice(i);
    TensorSink value{s.name(), "", ShapeOf(s), nullptr, true};
    value.storage = &(*values)[i].value;
    value.grow = true;
    value.row_begin = s.row_begin();
    sinks.push_back(std::move(value));
    for (size_t k = 0; k < slot_names.size(); ++k) {
      TensorSink slot{s.name(), slot_names[k], ShapeOf(s), nullptr, false};
      slot.storage = &(*values)[i].slots[k];
      slot.grow = true;
      slot.row_begin = s.row_begin();
      sinks.push_back(std::move(slot));
    }
  }
  return sinks;
}

std::vector<TensorSink> GradientSinks(const std::vector<SliceSpec>& slices,
                                      const std::vector<int>& indices, DataType dtype,
                                      std::vector<Shard::SliceGradient>* grads,
                                      std::vector<std::vector<float>> buffers, bool borrow,
                                      float magnitude_limit) {
  grads->assign(indices.size(), {});
  std::vector<TensorSink> sinks;
  for (size_t k = 0; k < indices.size(); ++k) {
    const SliceSpec& s = slices[indices[k]];
    Shard::SliceGradient& g = (*grads)[k];
    g.slice = indices[k];
    // A buffer the shard has spare (taken for the header: no memory is
    // allocated for it), or else allocated with the gradient's first chunk.
    TensorSink sink{s.name(), "", ShapeOf(s), nullptr, true, dtype};
    if (borrow) {
      // Decoded into `values` only where the chunks do not follow one another.
      sink.borrow = &g.borrowed.data;
      g.borrowed.count = NumElements(sink.shape);
      g.borrowed.dtype = dtype;
    } else if (k < buffers.size()) {
      g.values = std::move(buffers[k]);
    }
    sink.storage = &g.values;
    sink.non_finite = &g.non_finite;
    sink.magnitude_limit = magnitude_limit;
    sink.row_begin = s.row_begin();
    g.finite_checked = true;
    sinks.push_back(std::move(sink));
  }
  return sinks;
}

absl::StatusOr<std::vector<int>> SliceIndices(absl::Span<const int32_t> asked, int num_slices,
                                              absl::string_view what) {
  std::vector<int> indices;
  if (asked.empty()) {
    for (int i = 0; i < num_slices; ++i) indices.push_back(i);
    return indices;
  }
  std::vector<bool> named(num_slices, false);
  for (int32_t i : asked) {
    if (i < 0 || i >= num_slices) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, " names slice #", i, "; the ps holds ", num_slices, " slices"));
    }
    if (named[i]) {
      return absl::InvalidArgumentError(absl::StrCat(what, " names slice #", i, " twice"));
    }
    named[i] = true;
    indices.push_back(i);
  }
  return indices;
}

TensorRef SliceValueRef(const SliceSpec& slice, const Shard::Value& value, DataType dtype) {
  return {slice.name(), "", ShapeOf(slice), value->data(), dtype, slice.row_begin()};
}

std::vector<Shard::SliceGradient> SkipGradients(const std::vector<int>& indices, int num_slices) {
  std::vector<Shard::SliceGradient> skips;
  auto skip = [&](int i) {
    Shard::SliceGradient& g = skips.emplace_back();
    g.slice = i;
    g.skip = true;
  };
  if (indices.empty()) {
    for (int i = 0; i < num_slices; ++i) skip(i);
  } else {
    for (int i : indices) skip(i);
  }
  return skips;
}

std::vector<TensorRef> SnapshotRefs(const Shard::Snapshot& snapshot) {
  const Shard::Weights& weights = *snapshot.weights;
  std::vector<TensorRef> refs;
  for (size_t i = 0; i < weights.slices->size(); ++i) {
    const SliceSpec& s = (*weights.slices)[i];
    refs.push_back({s.name(), "", ShapeOf(s), weights.values[i]->data(), DT_FLOAT, s.row_begin()});
    for (size_t k = 0; k < snapshot.slot_names.size(); ++k) {
      refs.push_back({s.name(), snapshot.slot_names[k], ShapeOf(s), snapshot.slots[i][k].data(),
                      DT_FLOAT, s.row_begin()});
    }
  }
  return refs;
}

}  // namespace psflow::ps
