// CPU reference decode attention at 4K context: one decode row of one sequence, the seed model's
// head shape (16 query heads over 2 KV heads, head_dim 256), block size 64. Dense reads all 4096
// tokens; QSA reads its budget of 2048 + 3. Items are decode rows (tokens generated per second of
// one layer's attention); bytes are K+V bytes read.
#include <benchmark/benchmark.h>

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "backend/cpu/attention.h"
#include "core/half.h"
#include "e4kv/e4m3.h"
#include "qsa/selection.h"

namespace {

using e4kv::KvCacheDtype;

void BM_DecodeAttention(benchmark::State& state) {
  const auto dtype = state.range(0) == 0 ? KvCacheDtype::kF16 : KvCacheDtype::kE4m3;
  const bool qsa = state.range(1) != 0;
  const int64_t context = 4096;
  const int64_t n_heads = 16;
  const int64_t budget = 2048;

  e4kv::KvCacheGeometry geometry{context / 64, 64, 2, 256, dtype};
  std::vector<uint16_t> storage((geometry.total_bytes() + 1) / 2);
  std::mt19937 rng(1);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  if (dtype == KvCacheDtype::kE4m3) {
    auto* bytes = reinterpret_cast<uint8_t*>(storage.data());
    for (size_t i = 0; i < geometry.total_bytes(); ++i)
      bytes[i] = e4kv::e4m3_encode(normal(rng), 0.02f);
  } else {
    for (uint16_t& x : storage) x = e4kv::f32_to_f16(normal(rng));
  }
  std::vector<int32_t> table(size_t(geometry.n_blocks));
  for (size_t b = 0; b < table.size(); ++b) table[b] = int32_t(b);
  std::vector<int32_t> row_seq = {0};
  std::vector<int32_t> row_pos = {int32_t(context - 1)};
  std::vector<int32_t> seq_lens = {int32_t(context)};
  std::vector<uint16_t> q(size_t(n_heads * geometry.head_dim));
  for (uint16_t& x : q) x = e4kv::f32_to_f16(normal(rng));
  std::vector<float> out(q.size());

  // QSA: every other group, then the causal tail (none at pos = 4095).
  const int64_t width = e4kv::qsa_selection_width(budget, 4);
  std::vector<int32_t> sel(size_t(width), -1);
  std::vector<int32_t> count = {0};
  for (int32_t c = 0; c < int32_t(budget / 4); ++c) {
    for (int32_t i = 0; i < 4; ++i) sel[size_t(count[0]++)] = 8 * c + i;
  }

  e4kv::PagedAttentionParams p;
  p.cache = {storage.data(), geometry, dtype == KvCacheDtype::kE4m3 ? 0.02f : 1.0f, 1.0f};
  p.block_table = {table.data(), 1, geometry.n_blocks};
  p.rows.n_rows = 1;
  p.rows.row_seq = row_seq.data();
  p.rows.row_pos = row_pos.data();
  p.rows.seq_lens = seq_lens.data();
  if (qsa) {
    p.rows.sel_tokens = sel.data();
    p.rows.sel_counts = count.data();
    p.rows.sel_width = width;
  }
  p.n_heads = n_heads;
  p.q = q.data();
  p.out = out.data();

  for (auto _ : state) {
    const e4kv::Status status = e4kv::paged_attention(p);
    if (!status.ok()) state.SkipWithError(status.message().c_str());
    benchmark::DoNotOptimize(out.data());
  }
  const int64_t keys = qsa ? count[0] : context;
  state.SetItemsProcessed(int64_t(state.iterations()));
  state.SetBytesProcessed(int64_t(state.iterations()) * keys * 2 * geometry.row_elems() *
                          int64_t(geometry.elem_bytes()));
  state.SetLabel(std::string(dtype == KvCacheDtype::kE4m3 ? "e4m3" : "fp16") +
                 (qsa ? " qsa 2048 of 4096" : " dense 4096"));
}
BENCHMARK(BM_DecodeAttention)
    ->ArgNames({"e4m3", "qsa"})
    ->Args({0, 0})
    ->Args({1, 0})
    ->Args({0, 1})
    ->Args({1, 1})
    ->Unit(benchmark::kMillisecond);

}  // namespace
