// A token drawn from each row of logits on the CPU (sample.cpp): temperature, top-k, top-p,
// min-p as mlxinfer's filtered_logprobs applies them, then the row's uniform number u mapped
// through the kept tokens' cumulative probabilities (inverse transform sampling).
#pragma once

#include "mlx/mlx.h"
#include "mlx/primitives.h"

namespace mlxinfer {

namespace mx = mlx::core;

struct SampleSettings {
  float temperature = 1.0f;
  int top_k = 0; // 0: off
  float top_p = 1.0f; // 1: off
  float min_p = 0.0f; // 0: off
  bool operator==(const SampleSettings&) const = default;
};

// logits (B, V) float, u (B,) float32 in [0, 1) -> (B,) uint32 tokens; with `probs` the
// (B, V) float32 distribution drawn from instead (the tests compare it with the reference).
mx::array sample(const mx::array& logits, const mx::array& u, const SampleSettings& st,
                 bool probs = false, mx::StreamOrDevice s = {});

class Sample : public mx::UnaryPrimitive {
 public:
  Sample(mx::Stream stream, SampleSettings st, bool probs)
      : mx::UnaryPrimitive(stream), st_(st), probs_(probs) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  const char* name() const override {
    return "MlxinferSample";
  }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const Sample&>(other);
    return st_ == o.st_ && probs_ == o.probs_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {probs_ ? inputs[0].shape() : mx::Shape{inputs[0].shape(0)}};
  }

 private:
  SampleSettings st_;
  bool probs_;
};

} // namespace mlxinfer
