// The step profile: a measuring tool for benchmarks, apart from the Backend's ops. A model reaches
// a StepProfiler through one optional pointer (Model::set_step_profiler); without one, it marks
// nothing and pays nothing.
//
// begin() starts collecting; each mark() closes the open section and opens `section` (a string
// that outlives the profile); end() closes the last one, waits for the device and returns the
// sections summed by name, in first-seen order; marks outside begin() .. end() are ignored. With
// `isolate`, each mark waits for the device to finish the previous section and then holds it back
// (a spin of about kIsolateMicros), so the host issues the section's ops while the device waits
// and the device then runs them back to back: device_ms is the ops' own time and host_ms the
// host's cost to issue them (for sections the host issues within the hold). Without it, device_ms
// is the span the section occupied on the device in a normal step (waits included).
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

namespace e4kv {

// One named section of a step profile: `count` marks, summed times.
struct ProfileSection {
  std::string name;
  int64_t count = 0;
  double host_ms = 0;
  double device_ms = 0;
};

// Adds one closed section to `sections` (summed by name, first-seen order).
void add_profile_section(std::vector<ProfileSection>& sections, const char* name, double host_ms,
                         double device_ms);

class StepProfiler {
 public:
  static constexpr int kIsolateMicros = 500;

  virtual ~StepProfiler() = default;
  virtual void begin(bool isolate) = 0;
  virtual void mark(const char* section) = 0;
  virtual std::vector<ProfileSection> end() = 0;
};

// The host clock's profile, for a backend whose ops have finished when they return (the CPU
// backend): host_ms is the ops' time, device_ms 0, and `isolate` changes nothing.
class HostStepProfiler final : public StepProfiler {
 public:
  void begin(bool isolate) override;
  void mark(const char* section) override;
  std::vector<ProfileSection> end() override;

 private:
  void close_section();

  bool profiling_ = false;
  const char* open_section_ = nullptr;
  std::chrono::steady_clock::time_point section_start_;
  std::vector<ProfileSection> sections_;
};

}  // namespace e4kv
