// Output processing: the engine's token ids become text, off the step's critical path.
//
// The engine's owner runs an OutputProcessor after each step over the step's updates. Per request
// it decodes incrementally (io/tokenizer.h's StreamingDecoder: never half a UTF-8 character) and
// matches stop strings across token boundaries: a stop string may begin in one token's text and
// end in a later one's, so text that could be the start of a stop string (the longest suffix of
// the undecided text that is a proper prefix of one) is held back until a later token decides it,
// and released when the request ends without it.
//
// vLLM's semantics:
// - A stop string counts only when it ends in the text of an output token after the first
//   min_tokens (a match ending earlier is ordinary text); of the stop strings ending in one piece
//   of text, the one starting first wins (ties: the first listed).
// - The matched stop string and everything after it are cut from the text unless
//   include_stop_str_in_output; the token ids are all kept.
// - A stop or EOS id that ends the request (the engine's "stop") leaves its own text out unless
//   include_stop_str_in_output.
// - A stop string ends the request in the engine (Engine::abort: its blocks and slot are freed at
//   once) and the reported finish reason is "stop" with the string, even when the engine finished
//   it in the same step for "length".
// - A request with n completions (RequestParams::n) is n such streams, one per completion index:
//   a stop string ends only the completion whose text it is in (Engine::abort(id, index)).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "engine/engine.h"
#include "io/tokenizer.h"

namespace e4kv {

// What one step gave one completion of one request, as text.
struct RequestOutput {
  RequestId id = 0;
  int32_t index = 0;  // the completion (RequestUpdate::index)
  std::vector<int32_t> new_tokens;
  std::string new_text;  // text that became final this step (may be empty)
  bool finished = false;          // this completion has ended
  bool request_finished = false;  // and with it every completion of the request
  std::string finish_reason;  // "stop", "length", "abort", "error"
  std::string stop_string;    // the stop string that matched (finish_reason "stop")
  int32_t stop_token = -1;    // the stop or EOS id that matched (finish_reason "stop")
  std::string error;          // finish_reason "error"
  std::vector<TokenLogprobs> logprobs;         // as RequestUpdate
  std::vector<TokenLogprobs> prompt_logprobs;  // as RequestUpdate
  int64_t prompt_logprobs_start = 0;
};

// An update as an output without text: what the processor gives for a request it does not hold,
// and what a caller without a tokenizer uses.
RequestOutput output_without_text(const RequestUpdate& update);

class OutputProcessor {
 public:
  // The tokenizer must outlive the processor.
  explicit OutputProcessor(const Tokenizer& tokenizer);

  // Starts a request the engine accepted with `params` (n, stop, include_stop_str_in_output,
  // skip_special_tokens, min_tokens are used here).
  void add_request(RequestId id, const RequestParams& params);

  // The outputs of one step's updates, in order. A request whose stop string matched is ended in
  // `engine` when given (tests may pass none). Updates of requests never added pass through with
  // their ids and no text.
  std::vector<RequestOutput> process(std::span<const RequestUpdate> updates, Engine* engine);

  // Ends a request at its owner's wish: aborted in `engine` when given, its held text dropped.
  // One output with finish_reason "abort" per completion still running (the last with
  // request_finished); none for an unknown id.
  std::vector<RequestOutput> abort(RequestId id, Engine* engine);

  size_t n_requests() const { return requests_.size(); }

 private:
  struct State {
    StreamingDecoder decoder;
    std::vector<std::string> stop;
    bool include_stop_str_in_output = false;
    int64_t min_tokens = 0;
    int64_t n_tokens = 0;
    std::string held;  // decoded text not yet released: it may begin a stop string
    bool finished = false;
  };
  struct Request {
    std::vector<State> completions;  // [n]
    int64_t n_unfinished = 0;
  };
  // Appends `text` to the held text and releases what is decided into `out`; true when a stop
  // string matched (it is then in out.stop_string). `may_stop`: the text belongs to a token after
  // the first min_tokens.
  static bool take_text(State& state, const std::string& text, bool may_stop, RequestOutput& out);

  const Tokenizer* tokenizer_;
  std::unordered_map<RequestId, Request> requests_;
};

}  // namespace e4kv
