// Sizing a workspace at load: each buffer of a list allocated from the backend in one call.
#pragma once

#include <cstddef>
#include <initializer_list>

#include "backend/backend.h"
#include "core/status.h"

namespace e4kv {

// One buffer of a workspace and the bytes it needs.
struct BufferNeed {
  BackendBuffer* buffer;
  size_t bytes;
};

// Allocates every buffer of `needs`, each at least 64 bytes, so that a dimension that is 0 for
// some shape still leaves a valid pointer. Errors: the backend's, for the first that fails.
Status allocate_buffers(Backend& backend, std::initializer_list<BufferNeed> needs);

}  // namespace e4kv
