#include "model/ple_ngram.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <iterator>
#include <limits>
#include <map>
#include <new>
#include <string_view>
#include <thread>
#include <utility>

#include "core/check.h"
#include "core/half.h"
#include "e4kv/e4m3.h"

namespace e4kv {
namespace {

constexpr uint64_t kSplitmixGamma = 0x9E3779B97F4A7C15ull;
// The per-layer seed stride of the multipliers (M:1041-1057).
constexpr int64_t kPleLayerSeedStride = 10007;

uint64_t splitmix64(uint64_t v) {
  v += kSplitmixGamma;
  v = (v ^ (v >> 30)) * 0xBF58476D1CE4E5B9ull;
  v = (v ^ (v >> 27)) * 0x94D049BB133111EBull;
  return v ^ (v >> 31);
}

// a * b mod m for a, b < m.
uint64_t mul_mod(uint64_t a, uint64_t b, uint64_t m) {
  if (m <= (uint64_t(1) << 32)) return a * b % m;  // a, b < 2^32: the product fits
  __extension__ using U128 = unsigned __int128;
  return uint64_t(U128(a) * b % m);
}

uint64_t pow_mod(uint64_t base, uint64_t exponent, uint64_t m) {
  uint64_t result = 1;
  base %= m;
  while (exponent > 0) {
    if (exponent & 1u) result = mul_mod(result, base, m);
    base = mul_mod(base, base, m);
    exponent >>= 1;
  }
  return result;
}

// Deterministic for every n < 2^64: trial division by the primes up to 37, then Miller-Rabin with
// those primes as witnesses (enough below 3.3e24).
bool is_prime(int64_t value) {
  if (value < 2) return false;
  const auto n = uint64_t(value);
  static constexpr uint64_t kWitnesses[] = {2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37};
  for (uint64_t p : kWitnesses) {
    if (n % p == 0) return n == p;
  }
  if (n < 41 * 41) return true;
  uint64_t d = n - 1;
  int s = 0;
  while ((d & 1u) == 0) {
    d >>= 1;
    ++s;
  }
  for (uint64_t a : kWitnesses) {
    uint64_t x = pow_mod(a, d, n);
    if (x == 1 || x == n - 1) continue;
    bool composite = true;
    for (int r = 1; r < s && composite; ++r) {
      x = mul_mod(x, x, n);
      composite = x != n - 1;
    }
    if (composite) return false;
  }
  return true;
}

// x mod m with the sign of m (torch.remainder), m > 0.
int64_t floor_mod(int64_t x, int64_t m) {
  const int64_t r = x % m;
  return r < 0 ? r + m : r;
}

std::string shape_string(const std::vector<int64_t>& shape) {
  std::string out = "[";
  for (size_t i = 0; i < shape.size(); ++i) out += cat(i == 0 ? "" : ", ", shape[i]);
  return out + "]";
}

std::string values_string(const std::vector<int64_t>& values) {
  return shape_string(values);
}

bool is_table_dtype(DType dtype) {
  return dtype == DType::kF32 || dtype == DType::kF16 || dtype == DType::kBF16;
}

// The k of "<digits>.weight" after the shard prefix; -1 when `rest` is not exactly that with a
// plain decimal k (no sign, no leading zero, at most 9 digits).
int64_t parse_shard_index(std::string_view rest) {
  constexpr std::string_view kSuffix = ".weight";
  if (!rest.ends_with(kSuffix)) return -1;
  const std::string_view digits = rest.substr(0, rest.size() - kSuffix.size());
  if (digits.empty() || digits.size() > 9 || (digits.size() > 1 && digits[0] == '0')) return -1;
  int64_t k = 0;
  for (char c : digits) {
    if (c < '0' || c > '9') return -1;
    k = k * 10 + (c - '0');
  }
  return k;
}

// The int64 values of an I64 tensor of shape [n]; errors name the tensor.
Result<std::vector<int64_t>> read_i64_vector(const Checkpoint& ckpt, const std::string& name,
                                             const SafetensorsTensor& tensor, int64_t n,
                                             std::string_view meaning) {
  if (tensor.dtype != DType::kI64) {
    return Status::error(cat(ckpt.dir().string(), ": tensor ", name, " has dtype ",
                             dtype_name(tensor.dtype),
                             " but must be I64 (an int64 hash buffer, never converted to a "
                             "float type)"));
  }
  if (tensor.shape != std::vector<int64_t>{n}) {
    return Status::error(cat(ckpt.dir().string(), ": tensor ", name, " has shape ",
                             shape_string(tensor.shape), " but config.json implies [", n, "] (",
                             meaning, "); the checkpoint and its config.json disagree"));
  }
  std::vector<int64_t> values(static_cast<size_t>(n));
  E4KV_ASSERT(tensor.bytes.size() == size_t(n) * sizeof(int64_t), "I64 tensor of the wrong size");
  if (n > 0) std::memcpy(values.data(), tensor.bytes.data(), tensor.bytes.size());
  return values;
}

}  // namespace

PleHashParams ple_hash_params(const Qwen4ExpConfig& config, int64_t vocab_size, int64_t ple_index) {
  E4KV_ASSERT(config.ngram_size >= 2 && config.heads_per_ngram > 0,
              cat("ple_hash_params: ngram_size ", config.ngram_size, " (must be >= 2), ",
                  "heads_per_ngram ", config.heads_per_ngram, " (must be > 0)"));
  E4KV_ASSERT(
      vocab_size > 0 && ple_index >= 0 && config.ngram_vocab_size_base > 0 &&
          config.make_ngram_vocab_size_divisible_by > 0,
      cat("ple_hash_params: vocab_size ", vocab_size, ", ple_index ", ple_index,
          ", ngram_vocab_size_base ", config.ngram_vocab_size_base,
          ", make_ngram_vocab_size_divisible_by ", config.make_ngram_vocab_size_divisible_by));
  PleHashParams params;
  params.ngram_size = config.ngram_size;
  params.heads_per_ngram = config.heads_per_ngram;
  const int64_t n_heads = params.n_heads();

  // Multipliers (M:1041-1057): Python integers reduced modulo 2^64, i.e. uint64 arithmetic.
  const uint64_t half =
      std::max<uint64_t>(1, uint64_t(std::numeric_limits<int64_t>::max() / vocab_size) / 2);
  const uint64_t base_seed =
      uint64_t(config.seed) + uint64_t(kPleLayerSeedStride) * uint64_t(ple_index);
  for (int64_t i = 0; i < params.ngram_size; ++i) {
    const uint64_t x = base_seed + kSplitmixGamma * uint64_t(i + 1);
    params.multipliers.push_back(int64_t(2 * (splitmix64(x) % half) + 1));
  }

  // Moduli: skip the first ple_index * G primes >= base, take the next G (M:1071-1104).
  int64_t candidate = config.ngram_vocab_size_base - 1;
  const int64_t skip = ple_index * n_heads;
  for (int64_t found = 0; found < skip + n_heads;) {
    E4KV_ASSERT(candidate < std::numeric_limits<int64_t>::max(),
                "ple_hash_params: prime search beyond int64");
    ++candidate;
    if (!is_prime(candidate)) continue;
    if (found >= skip) params.moduli.push_back(candidate);
    ++found;
  }
  int64_t total = 0;
  for (int64_t modulus : params.moduli) {
    params.offsets.push_back(total);
    E4KV_ASSERT(!__builtin_add_overflow(total, modulus, &total),
                "ple_hash_params: n-gram table rows overflow int64");
  }
  const int64_t multiple = config.make_ngram_vocab_size_divisible_by;
  const int64_t padded = (total / multiple + (total % multiple != 0 ? 1 : 0));
  E4KV_ASSERT(!__builtin_mul_overflow(padded, multiple, &params.n_rows),
              "ple_hash_params: n-gram table rows overflow int64");
  return params;
}

std::vector<int32_t> ple_history_init(int64_t ngram_size, int64_t eos) {
  E4KV_ASSERT(ngram_size >= 1, cat("ple_history_init: ngram_size ", ngram_size));
  return std::vector<int32_t>(size_t(ngram_size - 1), int32_t(eos));
}

void ple_ngram_ids(const PleHashParams& params, int64_t eos, std::span<const int32_t> tokens,
                   std::span<int32_t> history, int64_t* ids) {
  const int64_t order = params.ngram_size;
  const int64_t n_context = order - 1;
  const int64_t n_heads = params.n_heads();
  E4KV_ASSERT(
      order >= 2 && params.heads_per_ngram > 0 && int64_t(params.multipliers.size()) == order &&
          int64_t(params.moduli.size()) == n_heads && int64_t(params.offsets.size()) == n_heads,
      cat("ple_ngram_ids: inconsistent params (ngram_size ", order, ", heads_per_ngram ",
          params.heads_per_ngram, ", ", params.multipliers.size(), " multipliers, ",
          params.moduli.size(), " moduli, ", params.offsets.size(), " offsets)"));
  E4KV_ASSERT(
      int64_t(history.size()) == n_context,
      cat("ple_ngram_ids: history holds ", history.size(), " tokens, expected ", n_context));
  E4KV_ASSERT(tokens.empty() || ids != nullptr, "ple_ngram_ids: null ids");
  const auto n_tokens = int64_t(tokens.size());
  // Token `back` places before token t of this run, reaching into the history.
  auto before = [&](int64_t t, int64_t back) -> int64_t {
    return back <= t ? tokens[size_t(t - back)] : history[size_t(n_context + t - back)];
  };
  std::vector<uint64_t> context(static_cast<size_t>(order));
  for (int64_t t = 0; t < n_tokens; ++t) {
    // context_s is eos once an EOS sits at any of distances 1..s (HF's segment test,
    // _shift_right_ignore_eos): the token s back when it is EOS itself gives eos either way.
    context[0] = uint64_t(int64_t(tokens[size_t(t)]));
    bool blocked = false;
    for (int64_t s = 1; s < order; ++s) {
      const int64_t token = blocked ? eos : before(t, s);
      blocked = blocked || token == eos;
      context[size_t(s)] = uint64_t(token);
    }
    int64_t* row = ids + t * n_heads;
    uint64_t mix = context[0] * uint64_t(params.multipliers[0]);  // int64 products wrap
    for (int64_t n = 2; n <= order; ++n) {
      mix ^= context[size_t(n - 1)] * uint64_t(params.multipliers[size_t(n - 1)]);
      for (int64_t j = 0; j < params.heads_per_ngram; ++j) {
        const auto h = size_t((n - 2) * params.heads_per_ngram + j);
        row[h] = floor_mod(int64_t(mix), params.moduli[h]) + params.offsets[h];
      }
    }
  }
  // The last n_context tokens of [history | tokens]; ascending writes read only entries at or
  // after the one written, so the shift is safe in place.
  for (int64_t r = 0; r < n_context; ++r) {
    const int64_t src = r + n_tokens - n_context;  // index in tokens; < 0 reaches the history
    history[size_t(r)] = src >= 0 ? tokens[size_t(src)] : history[size_t(n_context + src)];
  }
}

Result<PleTable> PleTable::open(const Checkpoint& ckpt, const std::string& prefix,
                                int64_t expected_rows, int64_t expected_dim) {
  const std::string where = ckpt.dir().string();
  const std::string single_name = prefix + "ngram_embedding.weight";
  const std::string shard_prefix = prefix + "ngram_embedding.shard_";

  // Shard names are contiguous in the sorted name list; order them by their number.
  std::map<int64_t, std::string> shard_names;
  const std::vector<std::string> names = ckpt.tensor_names();
  for (auto it = std::lower_bound(names.begin(), names.end(), shard_prefix);
       it != names.end() && it->starts_with(shard_prefix); ++it) {
    const int64_t k = parse_shard_index(std::string_view(*it).substr(shard_prefix.size()));
    if (k < 0) {
      return Status::error(cat(where, ": tensor ", *it, " is not a PLE table shard name (",
                               shard_prefix, "{k}.weight with k a plain decimal number)"));
    }
    shard_names.emplace(k, *it);
  }
  const SafetensorsTensor* single = ckpt.find(single_name);
  if (single != nullptr && !shard_names.empty()) {
    return Status::error(cat(where, ": the PLE table is stored twice: as ", single_name,
                             " and as shards ", shard_prefix, "{k}.weight; keep one form"));
  }
  if (single == nullptr && shard_names.empty()) {
    return Status::error(cat(where, ": tensor ", single_name,
                             " is missing (a qwen4exp "
                             "checkpoint with PLE needs it, or its row shards ",
                             shard_prefix, "{k}.weight)"));
  }

  PleTable table;
  std::vector<std::pair<std::string, const SafetensorsTensor*>> parts;
  if (single != nullptr) {
    parts.emplace_back(single_name, single);
  } else {
    int64_t next = 0;
    for (const auto& [k, name] : shard_names) {
      if (k != next) {
        return Status::error(cat(where, ": tensor ", shard_prefix, next, ".weight is missing: ",
                                 "the PLE table's shards must be numbered 0, 1, 2, ... without a "
                                 "gap (found ",
                                 name, ")"));
      }
      parts.emplace_back(name, ckpt.find(name));
      ++next;
    }
  }
  const SafetensorsTensor* first = parts.front().second;
  for (const auto& [name, tensor] : parts) {
    if (!is_table_dtype(tensor->dtype)) {
      return Status::error(cat(where, ": tensor ", name, " has dtype ", dtype_name(tensor->dtype),
                               "; a PLE table must be F32, F16 or BF16"));
    }
    if (tensor->shape.size() != 2) {
      return Status::error(cat(where, ": tensor ", name, " has shape ", shape_string(tensor->shape),
                               "; a PLE table (shard) must be 2-D [rows, ple_embed_dim / G]"));
    }
    if (tensor->dtype != first->dtype || tensor->shape[1] != first->shape[1]) {
      return Status::error(cat(where, ": PLE table shards disagree: ", name, " is ",
                               dtype_name(tensor->dtype), " ", shape_string(tensor->shape), " but ",
                               parts.front().first, " is ", dtype_name(first->dtype), " ",
                               shape_string(first->shape), " (all shards share dtype and width)"));
    }
    table.shards_.push_back({table.n_rows_, tensor->shape[0],
                             reinterpret_cast<const std::byte*>(tensor->bytes.data())});
    table.shard_begins_.push_back(table.n_rows_);
    table.n_rows_ += tensor->shape[0];
    table.used_names_.push_back(name);
  }
  table.dim_ = first->shape[1];
  table.dtype_ = first->dtype;
  const std::string what =
      single != nullptr ? cat("tensor ", single_name)
                        : cat("the PLE table ", shard_prefix, "{0..", parts.size() - 1, "}.weight");
  if (table.dim_ != expected_dim) {
    return Status::error(cat(where, ": ", what, " has rows of ", table.dim_,
                             " values but config.json implies ", expected_dim,
                             " (ple_embed_dim / ((ngram_size - 1) * heads_per_ngram)); the "
                             "checkpoint and its config.json disagree"));
  }
  if (table.n_rows_ != expected_rows) {
    return Status::error(cat(where, ": ", what, " has ", table.n_rows_,
                             " rows but config.json implies ", expected_rows,
                             " (the sum of the n-gram head primes rounded up to "
                             "make_ngram_vocab_size_divisible_by); the checkpoint and its "
                             "config.json disagree"));
  }
  return table;
}

const std::byte* PleTable::mapped_row(int64_t id) const {
  const auto it = std::upper_bound(shard_begins_.begin(), shard_begins_.end(), id);
  const Shard& shard = shards_[size_t(std::distance(shard_begins_.begin(), it) - 1)];
  return shard.data + size_t(id - shard.row_begin) * size_t(dim_) * dtype_size(dtype_);
}

namespace {

// A row of the checkpoint's table as fp32 (exact). The mapping gives no alignment guarantee for a
// tensor's data: copy bytes, never cast.
void row_to_f32(const std::byte* src, DType dtype, int64_t dim, float* dst) {
  if (dtype == DType::kF32) {
    std::memcpy(dst, src, size_t(dim) * sizeof(float));
    return;
  }
  for (int64_t c = 0; c < dim; ++c) {
    uint16_t bits;
    std::memcpy(&bits, src + c * 2, 2);
    dst[c] = dtype == DType::kBF16 ? bf16_to_f32(bits) : f16_to_f32(bits);
  }
}

}  // namespace

Result<PleDtype> parse_ple_dtype(std::string_view name) {
  if (name == "auto") return PleDtype::kAuto;
  if (name == "fp8_e4m3") return PleDtype::kE4m3;
  return Status::option_error(
      "ple_dtype", cat("unknown value \"", name,
                       "\"; expected auto (the checkpoint's dtype, read in place) or fp8_e4m3 "
                       "(an E4M3 copy with a scale per row, half the host memory)"));
}

std::string_view ple_dtype_name(PleDtype dtype) {
  return dtype == PleDtype::kE4m3 ? "fp8_e4m3" : "auto";
}

double PleTableError::rel_l2() const {
  return sum_sq_value > 0.0 ? std::sqrt(sum_sq_error / sum_sq_value) : 0.0;
}

float ple_encode_row_e4m3(std::span<const float> row, uint8_t* codes) {
  float amax = 0.0f;
  for (float x : row) amax = std::max(amax, std::fabs(x));
  const float scale = amax > 0.0f ? amax / kE4m3Max : 1.0f;
  for (size_t c = 0; c < row.size(); ++c) codes[c] = e4m3_encode(row[c], scale);
  return scale;
}

Status PleTable::to_e4m3(const Checkpoint& ckpt, const std::string& prefix, PleE4m3Cache* cache) {
  if (e4m3_ != nullptr) return ok_status();
  if (cache != nullptr) {
    if (std::shared_ptr<const PleE4m3Rows> held = cache->find(prefix)) {
      e4m3_ = std::move(held);
      return ok_status();
    }
  }
  const size_t n_codes = size_t(n_rows_) * size_t(dim_);
  auto rows = std::make_shared<PleE4m3Rows>();
  rows->codes.reset(new (std::nothrow) uint8_t[std::max<size_t>(1, n_codes)]);
  rows->scales.reset(new (std::nothrow) float[std::max<size_t>(1, size_t(n_rows_))]);
  if (rows->codes == nullptr || rows->scales == nullptr) {
    return Status::error(cat(ckpt.dir().string(), ": the E4M3 copy of the PLE table ", prefix,
                             "ngram_embedding (", n_codes + size_t(n_rows_) * 4,
                             " bytes) does not fit in host memory; use --ple-dtype auto (the "
                             "table read in place from the checkpoint)"));
  }
  // Blocks of rows, each with its own error sums, added in block order at the end: the figures do
  // not depend on the number of threads.
  constexpr int64_t kBlockRows = int64_t(1) << 14;
  const int64_t n_blocks = (n_rows_ + kBlockRows - 1) / kBlockRows;
  std::vector<PleTableError> block_errors(static_cast<size_t>(n_blocks));
  std::vector<int64_t> bad_rows(static_cast<size_t>(n_blocks), -1);  // a block's first non-finite row
  std::atomic<int64_t> next_block{0};
  auto work = [&] {
    std::vector<float> values(static_cast<size_t>(dim_));
    for (int64_t b = next_block++; b < n_blocks; b = next_block++) {
      PleTableError& error = block_errors[size_t(b)];
      const int64_t end = std::min(n_rows_, (b + 1) * kBlockRows);
      for (int64_t r = b * kBlockRows; r < end; ++r) {
        row_to_f32(mapped_row(r), dtype_, dim_, values.data());
        if (!std::all_of(values.begin(), values.end(), [](float x) { return std::isfinite(x); })) {
          bad_rows[size_t(b)] = r;
          break;
        }
        uint8_t* codes = rows->codes.get() + size_t(r) * size_t(dim_);
        const float scale = ple_encode_row_e4m3(values, codes);
        rows->scales[size_t(r)] = scale;
        for (int64_t c = 0; c < dim_; ++c) {
          const double value = values[size_t(c)];
          const double decoded = e4m3_decode(codes[c]) * scale;
          error.sum_sq_error += (decoded - value) * (decoded - value);
          error.sum_sq_value += value * value;
        }
        error.n_rows += 1;
        error.n_values += dim_;
      }
    }
  };
  const int64_t n_threads =
      std::clamp<int64_t>(int64_t(std::thread::hardware_concurrency()), 1, 32);
  std::vector<std::thread> threads;
  for (int64_t t = 1; t < std::min(n_threads, n_blocks); ++t) threads.emplace_back(work);
  work();
  for (std::thread& thread : threads) thread.join();
  for (int64_t b = 0; b < n_blocks; ++b) {
    if (const int64_t r = bad_rows[size_t(b)]; r >= 0) {
      return Status::error(cat(ckpt.dir().string(), ": the PLE table ", prefix,
                               "ngram_embedding has a non-finite value in row ", r,
                               "; it cannot be stored as E4M3 (use --ple-dtype auto)"));
    }
    rows->error += block_errors[size_t(b)];
  }
  e4m3_ = rows;
  if (cache != nullptr) cache->add(prefix, std::move(rows));
  return ok_status();
}

std::span<const uint8_t> PleTable::e4m3_codes() const {
  if (e4m3_ == nullptr) return {};
  return {e4m3_->codes.get(), size_t(n_rows_) * size_t(dim_)};
}

std::span<const float> PleTable::e4m3_scales() const {
  if (e4m3_ == nullptr) return {};
  return {e4m3_->scales.get(), size_t(n_rows_)};
}

int64_t PleTable::owned_bytes() const {
  return e4m3_ == nullptr ? 0 : n_rows_ * dim_ + n_rows_ * int64_t(sizeof(float));
}

void PleTable::gather(const int64_t* ids, int64_t n, float* out) const {
  E4KV_ASSERT(n >= 0 && (n == 0 || (ids != nullptr && out != nullptr)),
              "PleTable::gather: null ids or out");
  for (int64_t i = 0; i < n; ++i) {
    const int64_t id = ids[i];
    E4KV_ASSERT(id >= 0 && id < n_rows_,
                cat("PleTable::gather: row ", id, " outside [0, ", n_rows_, ")"));
    float* dst = out + i * dim_;
    if (e4m3_ != nullptr) {
      const uint8_t* codes = e4m3_->codes.get() + size_t(id) * size_t(dim_);
      const float scale = e4m3_->scales[size_t(id)];
      for (int64_t c = 0; c < dim_; ++c) dst[c] = e4m3_decode(codes[c]) * scale;
      continue;
    }
    row_to_f32(mapped_row(id), dtype_, dim_, dst);
  }
}

Result<std::vector<std::string>> ple_read_hash_buffers(const Checkpoint& ckpt,
                                                       const std::string& prefix,
                                                       PleHashParams& params) {
  const std::string where = ckpt.dir().string();
  const int64_t n_heads = params.n_heads();
  PleHashParams updated = params;
  std::vector<std::string> used;

  const std::string multipliers_name = prefix + "layer_multipliers";
  const std::string moduli_name = prefix + "ngram_heads_vocab_sizes";
  const std::string offsets_name = prefix + "ngram_heads_offsets";
  struct Buffer {
    const std::string* name;
    int64_t size;
    const char* meaning;
    std::vector<int64_t>* target;
  };
  const Buffer buffers[] = {
      {&multipliers_name, params.ngram_size, "ngram_size", &updated.multipliers},
      {&moduli_name, n_heads, "(ngram_size - 1) * heads_per_ngram", &updated.moduli},
      {&offsets_name, n_heads, "(ngram_size - 1) * heads_per_ngram", &updated.offsets},
  };
  for (const Buffer& buffer : buffers) {
    const SafetensorsTensor* tensor = ckpt.find(*buffer.name);
    if (tensor == nullptr) continue;
    E4KV_ASSIGN_OR_RETURN(
        *buffer.target, read_i64_vector(ckpt, *buffer.name, *tensor, buffer.size, buffer.meaning));
    used.push_back(*buffer.name);
  }
  if (used.empty()) return used;

  // The moduli and offsets in force must address rows of the table.
  const bool moduli_read = ckpt.find(moduli_name) != nullptr;
  const bool offsets_read = ckpt.find(offsets_name) != nullptr;
  const std::string& offsets_source = offsets_read ? offsets_name : moduli_name;
  E4KV_ASSERT(
      int64_t(updated.moduli.size()) == n_heads && int64_t(updated.offsets.size()) == n_heads,
      "ple_read_hash_buffers: params with the wrong number of heads");
  int64_t total = 0;
  for (int64_t h = 0; h < n_heads; ++h) {
    const int64_t modulus = updated.moduli[size_t(h)];
    if (modulus <= 0) {
      return Status::error(cat(where, ": tensor ", moduli_name, " holds ",
                               values_string(updated.moduli), ": head ", h, " has modulus ",
                               modulus, " (every n-gram head's vocabulary size must be > 0)"));
    }
    if (updated.offsets[size_t(h)] != total) {
      return Status::error(
          cat(where, ": tensor ", offsets_source, ": ngram_heads_offsets ",
              values_string(updated.offsets), offsets_read ? "" : " (recomputed from config.json)",
              " are not the running sums of ngram_heads_vocab_sizes ",
              values_string(updated.moduli), moduli_read ? "" : " (recomputed from config.json)",
              "; head ", h, " should start at ", total));
    }
    if (__builtin_add_overflow(total, modulus, &total) || total > params.n_rows) {
      return Status::error(cat(where, ": tensor ", moduli_name, " holds ",
                               values_string(updated.moduli),
                               ": the n-gram heads need more rows than the table's ", params.n_rows,
                               " (config.json's geometry)"));
    }
  }
  params = std::move(updated);
  return used;
}

}  // namespace e4kv
