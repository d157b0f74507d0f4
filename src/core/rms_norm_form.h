// The two RMSNorm weight forms every backend implements (the CPU reference's numeric contract is in
// core/norm_rope.h).
#pragma once

namespace e4kv {

enum class RmsNormForm {
  kWeight,         // x * r * w (Llama)
  kOnePlusWeight,  // x * r * (1 + w) (Qwen3-Next / Qwen4Exp)
};

}  // namespace e4kv
