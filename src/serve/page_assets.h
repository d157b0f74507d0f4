// The chat page's files (src/serve/page/), embedded in the binary at build time
// (cmake/embed_page.cmake): the server needs no files beside it and no network.
#pragma once

#include <cstddef>
#include <string_view>

namespace e4kv::serve {

struct PageAsset {
  const char* path;          // "/index.html"
  const char* content_type;  // "text/html; charset=utf-8"
  const unsigned char* data;
  size_t size;
};

// The asset served at `path` ("/index.html"), or null.
const PageAsset* find_page_asset(std::string_view path);

}  // namespace e4kv::serve
