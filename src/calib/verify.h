// `e4kv verify`: does a derived (overlay) checkpoint still belong to its base, and would engine
// start-up accept its K/V scales?
//
// 1. The start-up gate, exactly as the engine runs it: Checkpoint::open +
// load_kv_scales(calibrated).
//    A failure returns the engine's own message unchanged.
// 2. When kvscales-provenance.json is present, the revision binding: every base file the provenance
//    recorded is hashed again and must match (a missing or changed base file is an error naming
//    it); the base revision and the scales shard's metadata and digest must match the record; files
//    the derived directory holds in place of base files (copies) must match them too; and the
//    derived index must map every base tensor to the base's shard and add only K/V scale keys in
//    model-kvscales.safetensors.
// A plain checkpoint without provenance passes on the gate alone; the result says provenance was
// not checked.
#pragma once

#include <filesystem>
#include <string>
#include <vector>

#include "calib/overlay.h"
#include "core/status.h"
#include "kv/scale_gate.h"

namespace e4kv {

struct VerifyOptions {
  std::filesystem::path dir;
  KvCacheDtype dtype = KvCacheDtype::kE4m3;
  FilesProgress progress;  // may be empty
};

struct VerifyResult {
  KvScales scales;                  // what start-up would load
  bool provenance_checked = false;  // false: no kvscales-provenance.json
  std::string base_dir;             // from the provenance
  std::string base_revision;
  int64_t n_hashed = 0;
  // Human-readable lines for the CLI ("provenance: ...").
  std::vector<std::string> notes;
};

Result<VerifyResult> verify_overlay(const VerifyOptions& options);

}  // namespace e4kv
