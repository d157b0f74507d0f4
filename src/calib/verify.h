// `e4kv verify`: does a derived (overlay) checkpoint still belong to its base, and would engine
// start-up accept its K/V scales?
//
// 1. The start-up gate, exactly as the engine runs it: Checkpoint::open +
//    load_kv_scales(calibrated). A failure returns the engine's own message unchanged.
// 2. The revision binding. A directory is an overlay when it holds kvscales-provenance.json, when
//    one of its shards records a base revision in its metadata (e4kv_base_revision), or when it
//    holds model-kvscales.safetensors; an overlay without its provenance fails. With the
//    provenance: every base file it recorded is checked again (hashed when it was recorded with a
//    digest; compared by size when it was recorded by size only, --hash index-config) and a
//    missing, unreadable (with the errno's reason) or changed one is an error naming it; the base
//    revision and the scales shard's metadata (contract, revision, revision file, policy,
//    negative-control marker), size and digest (recomputed; a provenance without one fails) must
//    match the record, and the shard must hold exactly the provenance's "scales", key for key
//    and bit for bit (so a shard rewritten together with its recorded digest is still caught);
//    files the derived directory holds in place of base files (copies, shards written anew
//    without embedded scales) must match their records; every file the engine reads from the
//    derived directory (kEngineReadFiles, every shard) must be recorded; the derived index must
//    map every base tensor to the base's shard (embedded scale keys the overlay replaced
//    excepted) and add only K/V scale keys in model-kvscales.safetensors; and everything else in
//    the derived index (its metadata, any other field) must be what the overlay writes: the base
//    index's fields with total_size adjusted for the scales added and embedded scales left out.
//    The digest of the scales file the overlay was made from is recomputed when the file is still
//    there and reported as a note (it is not part of the overlay).
// A plain checkpoint (no provenance, no revision recorded anywhere) passes on the gate alone; the
// result says provenance was not checked. An overlay made with --unit-scale-negative-control
// passes with a NEGATIVE CONTROL note (and the gate's summary says so too).
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
  int64_t n_hashed = 0;                      // files hashed (base files and derived copies)
  std::vector<std::string> hashed_files;     // base files verified by digest
  std::vector<std::string> size_only_files;  // base files verified by existence and size only
  // Human-readable lines for the CLI ("provenance: ...").
  std::vector<std::string> notes;
};

Result<VerifyResult> verify_overlay(const VerifyOptions& options);

}  // namespace e4kv
