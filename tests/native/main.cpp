#include <cstring>
#include <exception>

#include "harness.h"

// Runs every registered case, or those whose name contains argv[1].
int main(int argc, char** argv) {
  using namespace pydflash::testing;
  int passed = 0, failed = 0;
  for (auto& c : registry()) {
    if (argc > 1 && std::strstr(c.name, argv[1]) == nullptr) continue;
    failures_in_case() = 0;
    std::printf("%s ...\n", c.name);
    std::fflush(stdout);
    try {
      c.fn();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "  uncaught exception: %s\n", e.what());
      ++failures_in_case();
    }
    if (failures_in_case() == 0) {
      ++passed;
    } else {
      ++failed;
      std::printf("FAILED %s\n", c.name);
    }
  }
  std::printf("%d passed, %d failed\n", passed, failed);
  return failed == 0 ? 0 : 1;
}
