// The host half of a PLE layer (PleBlock::prepare, model/layers/ple.h), which hashes the step's
// tokens and gathers the table rows before any launch: on a synthetic Qwen4Exp checkpoint, its
// ids and rows equal those computed here the way the layer computed them inside the forward (per
// sequence from the slot's history: ple_ngram_ids, then PleTable::gather and the conversion to the
// activation dtype), the histories advance the same way, and a step split in two gives the rows
// of the whole.
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "core/half.h"
#include "io/checkpoint.h"
#include "model/layers/ple.h"
#include "model/weights.h"
#include "testing/files.h"
#include "testing/synth_checkpoint.h"

namespace e4kv {
namespace {

struct PleFixture {
  testing_support::TempDir tmp;
  std::unique_ptr<Backend> backend = make_cpu_backend({1});
  std::optional<Checkpoint> ckpt;
  std::optional<PleBlock> block;
  PleShape shape;
  int64_t eos = 0;

  void load() {
    SynthCheckpointOptions synth;
    synth.family = SynthFamily::kQwen4Exp;
    synth.n_layers = 2;
    synth.ple_layer = 1;
    ASSERT_TRUE(write_synth_checkpoint(tmp.path(), synth).ok());
    Result<Checkpoint> opened = Checkpoint::open(tmp.path());
    ASSERT_TRUE(opened.ok()) << opened.message();
    ckpt.emplace(std::move(opened).value());
    const ModelConfig& config = ckpt->config();
    const Qwen4ExpConfig& q = *config.qwen4exp;
    eos = *q.eos_token_id;
    shape.hidden = config.hidden_size;
    shape.streams = q.hc_count;
    shape.embed_dim = q.ple_embed_dim > 0 ? q.ple_embed_dim : config.hidden_size;
    shape.conv_kernel = q.ple_conv_kernel_size;
    shape.dilation = q.ngram_size;
    WeightLoader weights(*ckpt, *backend, "qwen4_exp");
    const bool nested = ckpt->find("model.language_model.embed_tokens.weight") != nullptr;
    const std::string root = nested ? "model.language_model." : "model.";
    Result<PleBlock> loaded =
        PleBlock::load(*ckpt, weights, root + "layers.1.ple.", shape, q, config.vocab_size, 0);
    ASSERT_TRUE(loaded.ok()) << loaded.message();
    block.emplace(std::move(loaded).value());
  }
};

TEST(PlePrepare, IdsAndRowsEqualThoseOfTheLayersOwnHashingAndGather) {
  PleFixture f;
  ASSERT_NO_FATAL_FAILURE(f.load());
  const PleBlock& block = *f.block;
  const int64_t n_heads = block.hash().n_heads();
  const int64_t embed = f.shape.embed_dim;
  Result<PleState> state = block.create_state(*f.backend, 3);
  ASSERT_TRUE(state.ok()) << state.message();
  // Two sequences in slots 2 and 0 (a 5-row chunk with an EOS inside, and 2 rows); slot 0 has
  // seen tokens before (its history is not the initial one).
  state->history[0] = std::vector<int32_t>(state->history[0].size(), 17);
  std::vector<std::vector<int32_t>> histories = state->history;
  const std::vector<int32_t> tokens{3, 9, int32_t(f.eos), 41, 5, 77, 12};
  const std::vector<int32_t> row_begin{0, 5, 7};
  const std::vector<int32_t> slots{2, 0};

  for (const DType act : {DType::kF32, DType::kF16}) {
    SCOPED_TRACE(dtype_name(act));
    PleState& st = *state;
    st.history = histories;
    const int64_t n = int64_t(tokens.size());
    std::vector<int64_t> ids(size_t(n * n_heads));
    std::vector<float> emb_f32(size_t(n * embed));
    std::vector<std::byte> emb(size_t(n * embed) * dtype_size(act));
    ASSERT_TRUE(
        block.prepare(tokens, row_begin, slots, st, ids.data(), emb_f32.data(), act, emb.data())
            .ok());

    // The layer's own computation, per sequence on a copy of its history.
    std::vector<std::vector<int32_t>> want_histories = histories;
    std::vector<int64_t> want_ids(size_t(n * n_heads));
    for (size_t q = 0; q < slots.size(); ++q) {
      ple_ngram_ids(block.hash(), f.eos,
                    std::span<const int32_t>(tokens).subspan(
                        size_t(row_begin[q]), size_t(row_begin[q + 1] - row_begin[q])),
                    want_histories[size_t(slots[q])], want_ids.data() + row_begin[q] * n_heads);
    }
    EXPECT_EQ(ids, want_ids);
    EXPECT_EQ(st.history, want_histories);
    std::vector<float> want_rows(size_t(n * embed));
    block.table().gather(want_ids.data(), n * n_heads, want_rows.data());
    for (size_t i = 0; i < want_rows.size(); ++i) {
      if (act == DType::kF32) {
        float got;
        std::memcpy(&got, emb.data() + i * 4, 4);
        ASSERT_EQ(got, want_rows[i]) << "element " << i;
      } else {
        uint16_t got;
        std::memcpy(&got, emb.data() + i * 2, 2);
        ASSERT_EQ(got, f32_to_f16(want_rows[i])) << "element " << i;
      }
    }

    // The same tokens in two steps (3 + 2 rows of the first sequence, then the rest with the
    // second): the rows of the whole step, and the same final histories.
    st.history = histories;
    std::vector<float> split_rows;
    const std::vector<std::vector<int32_t>> steps_tokens{{3, 9, int32_t(f.eos)}, {41, 5, 77, 12}};
    const std::vector<std::vector<int32_t>> steps_begin{{0, 3, 3}, {0, 2, 4}};
    for (size_t k = 0; k < 2; ++k) {
      const int64_t m = int64_t(steps_tokens[k].size());
      std::vector<std::byte> part(size_t(m * embed) * dtype_size(DType::kF32));
      ASSERT_TRUE(block
                      .prepare(steps_tokens[k], steps_begin[k], slots, st, ids.data(),
                               emb_f32.data(), DType::kF32, part.data())
                      .ok());
      const float* p = reinterpret_cast<const float*>(part.data());
      split_rows.insert(split_rows.end(), p, p + m * embed);
    }
    EXPECT_EQ(st.history, want_histories);
    // Step 2 holds rows 3, 4 of sequence 0, then sequence 1's: the whole step's row order.
    EXPECT_EQ(split_rows, want_rows);
  }
}

}  // namespace
}  // namespace e4kv
