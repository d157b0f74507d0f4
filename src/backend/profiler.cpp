#include "backend/profiler.h"

#include <algorithm>
#include <utility>

namespace e4kv {

void add_profile_section(std::vector<ProfileSection>& sections, const char* name, double host_ms,
                         double device_ms) {
  auto it = std::find_if(sections.begin(), sections.end(),
                         [&](const ProfileSection& s) { return s.name == name; });
  if (it == sections.end()) it = sections.insert(sections.end(), ProfileSection{name, 0, 0, 0});
  it->count += 1;
  it->host_ms += host_ms;
  it->device_ms += device_ms;
}

void HostStepProfiler::begin(bool /*isolate*/) {
  profiling_ = true;
  sections_.clear();
  open_section_ = nullptr;
}

void HostStepProfiler::mark(const char* section) {
  if (!profiling_) return;
  close_section();
  open_section_ = section;
  section_start_ = std::chrono::steady_clock::now();
}

std::vector<ProfileSection> HostStepProfiler::end() {
  if (!profiling_) return {};
  close_section();
  profiling_ = false;
  return std::move(sections_);
}

void HostStepProfiler::close_section() {
  if (open_section_ == nullptr) return;
  const double ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - section_start_)
          .count();
  add_profile_section(sections_, open_section_, ms, 0.0);
  open_section_ = nullptr;
}

}  // namespace e4kv
