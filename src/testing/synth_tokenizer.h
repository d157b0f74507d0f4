// A small synthetic byte-level BPE tokenizer for tests and demos, shaped like Qwen2's
// tokenizer.json: the Qwen2 pre-tokenizer regex, a ByteLevel pre-tokenizer and decoder, byte
// tokens, merges learned from a short embedded English text, and the special tokens
// "<|endoftext|>" (EOS), "<|im_start|>" and "<|im_end|>". Deterministic: the same vocab_size
// gives the same bytes.
//
// Ids: the 243 bytes that can occur in UTF-8 text (all but C0, C1 and F5..FF; e4kv reads invalid
// input as U+FFFD, so these never reach the model) take ids 0..242 in byte order, then one id per
// learned merge, then the three special tokens. Merges are learned greedily (the most frequent
// adjacent pair over the text's words, the smallest pair on ties) until the ids fill vocab_size
// or no pair occurs twice; the total number of ids is therefore <= vocab_size.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>

#include "core/status.h"

namespace e4kv {

// The smallest vocab_size the synthetic tokenizer fits in: 243 byte tokens + 3 special tokens.
inline constexpr int64_t kSynthTokenizerMinVocab = 246;

// tokenizer.json text for a model with `vocab_size` ids (kSynthTokenizerMinVocab..1048576).
Result<std::string> make_synth_tokenizer_json(int64_t vocab_size);

// The chat template the synthetic tokenizer_config.json carries: ChatML over the special tokens
// ("<|im_start|>ROLE\nCONTENT<|im_end|>\n" per message, then "<|im_start|>assistant\n" when a
// generation prompt is asked for), as Qwen checkpoints use.
inline constexpr const char* kSynthChatTemplate =
    "{%- for message in messages -%}\n"
    "<|im_start|>{{ message.role }}\n"
    "{{ message.content }}<|im_end|>\n"
    "{% endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "<|im_start|>assistant\n"
    "{% endif -%}\n";

// Writes dir/tokenizer.json and dir/tokenizer_config.json (eos_token "<|endoftext|>", no BOS, the
// chat template above); `dir` is created if needed.
Status write_synth_tokenizer(const std::filesystem::path& dir, int64_t vocab_size);

}  // namespace e4kv
