// Reading the transformers Qwen4Exp references (tests/data/hf_qwen4exp, made by
// scripts/hf_reference_qwen4exp.py) and checking a model's logits against them, for the CPU and
// CUDA model tests.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <limits>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "kv/block_allocator.h"
#include "model/model.h"
#include "testing/compare.h"

namespace e4kv::test {

inline const std::filesystem::path& qwen4exp_reference_dir() {
  static const std::filesystem::path dir =
      std::filesystem::path(E4KV_SOURCE_DIR) / "tests" / "data" / "hf_qwen4exp";
  return dir;
}

inline nlohmann::json read_json(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream text;
  text << in.rdbuf();
  return nlohmann::json::parse(text.str(), nullptr, /*allow_exceptions=*/false);
}

inline std::vector<std::filesystem::path> qwen4exp_cases() {
  std::vector<std::filesystem::path> dirs;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(qwen4exp_reference_dir(), ec)) {
    if (entry.is_directory() && std::filesystem::exists(entry.path() / "reference.json")) {
      dirs.push_back(entry.path());
    }
  }
  std::sort(dirs.begin(), dirs.end());
  return dirs;
}

struct Sequence {
  std::vector<int32_t> ids;
  std::vector<std::vector<double>> logits;
  std::set<int64_t> tie_affected;
  // The reference's near ties (near_ties()): positions of the last QSA layer's small boundary
  // gaps, and the first position with a small gap in an earlier QSA layer or the router.
  nlohmann::json qsa;              // {layer: {"boundary_gap": [...]}}
  std::vector<double> router_gap;  // [positions]
};

inline Sequence read_sequence(const nlohmann::json& j) {
  Sequence s;
  s.ids = j["input_ids"].get<std::vector<int32_t>>();
  s.logits = j["logits"].get<std::vector<std::vector<double>>>();
  for (int64_t p : j["qsa_tie_affected_positions"].get<std::vector<int64_t>>()) {
    s.tie_affected.insert(p);
  }
  if (j.contains("qsa")) s.qsa = j["qsa"];
  if (j.contains("router_min_gap")) s.router_gap = j["router_min_gap"].get<std::vector<double>>();
  return s;
}

// Where a backend whose activations carry more rounding than the reference's may choose other
// QSA blocks or experts: the positions whose k-th minus (k+1)-th block score in the last QSA
// layer is below `tau` (that row alone differs), and from the first position with such a gap in an
// earlier QSA layer, or a router gap below `tau`, on (DeltaNet states and later layers' keys carry
// the other choice to every later position).
struct NearTies {
  std::set<int64_t> rows;
  int64_t from = std::numeric_limits<int64_t>::max();

  bool covers(int64_t pos) const { return pos >= from || rows.count(pos) != 0; }
};

inline NearTies near_ties(const Sequence& s, double tau) {
  NearTies out;
  int64_t last = -1;
  for (const auto& [layer, record] : s.qsa.items())
    last = std::max<int64_t>(last, std::stoll(layer));
  for (const auto& [layer, record] : s.qsa.items()) {
    const nlohmann::json& gaps = record["boundary_gap"];
    for (size_t p = 0; p < gaps.size(); ++p) {
      if (gaps[p].is_null() || gaps[p].get<double>() >= tau) continue;
      if (std::stoll(layer) == last) {
        out.rows.insert(int64_t(p));
      } else {
        out.from = std::min(out.from, int64_t(p));
      }
    }
  }
  for (size_t p = 0; p < s.router_gap.size(); ++p) {
    if (s.router_gap[p] < tau) out.from = std::min(out.from, int64_t(p));
  }
  return out;
}

// Checks rows of `got` ([n, vocab] for positions first..first+n-1) against the reference. With
// near_tie_tau > 0, a row over the bound that near_ties() covers is counted in `near_tie_rows`
// instead of failing (the caller bounds how many there may be); any other row over it fails.
struct Checker {
  std::string what;
  double max_rel_l2 = 1e-3;
  double near_tie_tau = 0.0;
  double worst = 0.0;  // over the rows held to the bound
  int64_t excluded = 0;
  int64_t checked = 0;
  int64_t near_tie_rows = 0;

  void check(const std::vector<float>& got, int64_t vocab, const Sequence& ref, int64_t first) {
    const int64_t n = int64_t(got.size()) / vocab;
    const NearTies ties = near_tie_tau > 0.0 ? near_ties(ref, near_tie_tau) : NearTies{};
    for (int64_t i = 0; i < n; ++i) {
      const int64_t pos = first + i;
      if (ref.tie_affected.count(pos) != 0) {
        ++excluded;
        continue;
      }
      ++checked;
      const std::vector<float> row(got.begin() + i * vocab, got.begin() + (i + 1) * vocab);
      const double err = compare(row, ref.logits[size_t(pos)], 0.0, 0.0).rel_l2;
      if (err > max_rel_l2 && ties.covers(pos)) {
        ++near_tie_rows;
        continue;
      }
      worst = std::max(worst, err);
      EXPECT_LE(err, max_rel_l2) << what << ": position " << pos;
    }
  }
};

// Runs `ref` through one sequence in forwards of `chunk` tokens (all of them: chunk <= 0),
// checking every row's logits.
inline void run_chunked(Model& model, const Sequence& ref, int64_t chunk, Checker& checker) {
  const int64_t total = int64_t(ref.ids.size());
  if (chunk <= 0) chunk = total;
  BlockAllocator allocator(model.n_blocks(), model.block_size());
  BlockTable table;
  Result<ScopedSequence> sequence = ScopedSequence::allocate(model);
  ASSERT_TRUE(sequence.ok()) << sequence.message();
  const int32_t slot = sequence->slot();
  for (int64_t begin = 0; begin < total; begin += chunk) {
    const int64_t n = std::min(chunk, total - begin);
    allocator.append(table, n);
    std::vector<int32_t> ids(ref.ids.begin() + begin, ref.ids.begin() + begin + n);
    std::vector<int32_t> seq(static_cast<size_t>(n), 0), pos(static_cast<size_t>(n)),
        rows(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) {
      pos[size_t(i)] = int32_t(begin + i);
      rows[size_t(i)] = int32_t(i);
    }
    const ForwardBatch batch{ids, seq, pos, {&table}, rows, std::span<const int32_t>(&slot, 1)};
    Result<std::vector<float>> got = model.forward(batch);
    ASSERT_TRUE(got.ok()) << checker.what << ": " << got.message();
    checker.check(*got, model.vocab_size(), ref, begin);
  }
}

}  // namespace e4kv::test
