// A minimal test harness for the native core: TEST_CASE registers, CHECK records
// failures without stopping the case, main.cpp runs them all. The last line printed is
// "N passed, N failed" so CI can read it.
#pragma once

#include <cstdio>
#include <functional>
#include <string>
#include <vector>

namespace pydflash::testing {

struct Case {
  const char* name;
  std::function<void()> fn;
};

inline std::vector<Case>& registry() {
  static std::vector<Case> cases;
  return cases;
}

inline int& failures_in_case() {
  static int failures = 0;
  return failures;
}

struct Register {
  Register(const char* name, std::function<void()> fn) {
    registry().push_back({name, std::move(fn)});
  }
};

}  // namespace pydflash::testing

#define PYDFLASH_CONCAT_INNER(a, b) a##b
#define PYDFLASH_CONCAT(a, b) PYDFLASH_CONCAT_INNER(a, b)
#define TEST_CASE(name)                                                      \
  static void PYDFLASH_CONCAT(test_fn_, __LINE__)();                         \
  static ::pydflash::testing::Register PYDFLASH_CONCAT(test_reg_, __LINE__)( \
      name, &PYDFLASH_CONCAT(test_fn_, __LINE__));                           \
  static void PYDFLASH_CONCAT(test_fn_, __LINE__)()

#define CHECK(cond)                                                                     \
  do {                                                                                  \
    if (!(cond)) {                                                                      \
      std::fprintf(stderr, "  CHECK failed: %s at %s:%d\n", #cond, __FILE__, __LINE__); \
      ++::pydflash::testing::failures_in_case();                                        \
    }                                                                                   \
  } while (0)

#define CHECK_THROWS_AS(expr, type)           \
  do {                                        \
    bool caught_ = false;                     \
    try {                                     \
      (void)(expr);                           \
    } catch (const type&) {                   \
      caught_ = true;                         \
    }                                         \
    CHECK(caught_ && #expr " throws " #type); \
  } while (0)
