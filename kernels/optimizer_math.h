// The arithmetic of one optimizer step on one element, shared by the ps's
// loops on the CPU (ps/optimizer.cc) and the GPU replicas of a job without
// ps (Backend::ApplyOptimizer), so that both apply the same rule the same
// way. OptimizerStep carries the rule and its scalars for one step (the
// learning rate of the step's schedule, Adam's bias corrections, ...), as
// ps::Optimizer::StepAt computes them; the functions below update one
// weight and its slots. Plain header: compiles as C++ and as CUDA.
#ifndef PSFLOW_KERNELS_OPTIMIZER_MATH_H_
#define PSFLOW_KERNELS_OPTIMIZER_MATH_H_

#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#define PSFLOW_HOST_DEVICE __host__ __device__
#else
#define PSFLOW_HOST_DEVICE
#endif

namespace psflow::kernels {

struct OptimizerStep {
  enum Rule : int32_t {
    kSgd,            // w -= lr (g + wd w)
    kMomentum,       // s0 = mu s0 + (g + wd w); w -= lr s0
    kNesterov,       // the same, w -= lr (d + mu s0)
    kAdam,           // s0, s1 = m, v; decoupled decay (AdamW) through `decay`
    kAdagrad,        // s0 = sum of squares
    kRmsprop,        // s0 = square average
    kMovingAverage,  // w = (1 - mu) w + mu g: running statistics, no optimizer
  };
  Rule rule = kSgd;
  float lr = 0;                     // the step's learning rate
  float wd = 0;                     // weight decay added to the gradient (L2); Adam's is l2 below
  float mu = 0;                     // momentum (kMomentum, kNesterov, kMovingAverage)
  float b1 = 0, b2 = 0;             // Adam's betas
  float step_size = 0, inv_c2 = 0;  // Adam: lr / (1 - b1^t), 1 / sqrt(1 - b2^t)
  float l2 = 0, decay = 1;          // Adam: L2 term; AdamW: 1 - lr * wd
  float alpha = 0;                  // RMSprop's smoothing
  float eps = 0;
  // How many slot buffers the rule reads and writes (s0, then s1).
  PSFLOW_HOST_DEVICE int slots() const {
    return rule == kAdam ? 2 : (rule == kSgd || rule == kMovingAverage) ? 0 : 1;
  }
};

PSFLOW_HOST_DEVICE inline void SgdElement(float lr, float wd, float& w, float g) {
  w -= lr * (g + wd * w);
}

PSFLOW_HOST_DEVICE inline void MomentumElement(float lr, float mu, float wd, float& w, float g,
                                               float& buf) {
  buf = mu * buf + (g + wd * w);
  w -= lr * buf;
}

PSFLOW_HOST_DEVICE inline void NesterovElement(float lr, float mu, float wd, float& w, float g,
                                               float& buf) {
  const float d = g + wd * w;
  buf = mu * buf + d;
  w -= lr * (d + mu * buf);
}

PSFLOW_HOST_DEVICE inline void AdamElement(float b1, float b2, float eps, float step_size,
                                           float inv_c2, float l2, float decay, float& w, float g,
                                           float& m, float& v) {
  const float d = g + l2 * w;
  m = b1 * m + (1 - b1) * d;
  v = b2 * v + (1 - b2) * d * d;
  w = w * decay - step_size * m / (sqrtf(v) * inv_c2 + eps);
}

PSFLOW_HOST_DEVICE inline void AdagradElement(float lr, float eps, float wd, float& w, float g,
                                              float& sum) {
  const float d = g + wd * w;
  sum += d * d;
  w -= lr * d / (sqrtf(sum) + eps);
}

PSFLOW_HOST_DEVICE inline void RmspropElement(float lr, float alpha, float eps, float wd, float& w,
                                              float g, float& sq) {
  const float d = g + wd * w;
  sq = alpha * sq + (1 - alpha) * d * d;
  w -= lr * d / (sqrtf(sq) + eps);
}

PSFLOW_HOST_DEVICE inline void MovingAverageElement(float momentum, float& r, float x) {
  r = (1 - momentum) * r + momentum * x;
}

// One element of `step`'s rule: weight w, gradient g, slots s0 and s1
// (whichever the rule reads; pass any float for the others).
PSFLOW_HOST_DEVICE inline void ApplyElement(const OptimizerStep& step, float& w, float g, float& s0,
                                            float& s1) {
  switch (step.rule) {
    case OptimizerStep::kSgd:
      SgdElement(step.lr, step.wd, w, g);
      break;
    case OptimizerStep::kMomentum:
      MomentumElement(step.lr, step.mu, step.wd, w, g, s0);
      break;
    case OptimizerStep::kNesterov:
      NesterovElement(step.lr, step.mu, step.wd, w, g, s0);
      break;
    case OptimizerStep::kAdam:
      AdamElement(step.b1, step.b2, step.eps, step.step_size, step.inv_c2, step.l2, step.decay, w,
                  g, s0, s1);
      break;
    case OptimizerStep::kAdagrad:
      AdagradElement(step.lr, step.eps, step.wd, w, g, s0);
      break;
    case OptimizerStep::kRmsprop:
      RmspropElement(step.lr, step.alpha, step.eps, step.wd, w, g, s0);
      break;
    case OptimizerStep::kMovingAverage:
      MovingAverageElement(step.mu, w, g);
      break;
  }
}

}  // namespace psflow::kernels

#endif  // PSFLOW_KERNELS_OPTIMIZER_MATH_H_
