#include "common/deferred_work.h"

#include <utility>

namespace psflow {
namespace {

// The outermost scope open on this thread (null: none).
thread_local DeferredWork* open_scope = nullptr;

}  // namespace

DeferredWork::DeferredWork() : outermost_(open_scope == nullptr) {
  if (outermost_) open_scope = this;
}

DeferredWork::~DeferredWork() {
  if (!outermost_) return;  // the outermost scope runs it all
  // Work may defer more while it runs: it joins the end of the list.
  for (size_t i = 0; i < work_.size(); ++i) {
    std::function<void()> fn = std::move(work_[i]);
    fn();
  }
  open_scope = nullptr;
}

bool DeferredWork::Defer(std::function<void()>& fn) {
  if (open_scope == nullptr) return false;
  open_scope->work_.push_back(std::move(fn));
  return true;
}

bool DeferredWork::DeferFirst(std::function<void()>& fn) {
  if (open_scope == nullptr || !open_scope->work_.empty()) return false;
  open_scope->work_.push_back(std::move(fn));
  return true;
}

}  // namespace psflow
