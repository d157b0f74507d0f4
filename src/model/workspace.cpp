#include "model/workspace.h"

#include <algorithm>

namespace e4kv {

Status allocate_buffers(Backend& backend, std::initializer_list<BufferNeed> needs) {
  for (const BufferNeed& need : needs) {
    E4KV_ASSIGN_OR_RETURN(*need.buffer, backend.allocate(std::max<size_t>(64, need.bytes)));
  }
  return ok_status();
}

}  // namespace e4kv
