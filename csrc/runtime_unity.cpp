// The extension's runtime core as one translation unit (setup.py compiles this file instead of
// the component sources it includes). Every component .cpp pulls in the ATen headers, which cost
// far more to compile than the components' own code: one unit parses them once instead of once
// per component, which keeps the component split from adding build time on the 2-core CI
// machines. CMakeLists.txt (the C++ tests) still compiles the components one by one, so each
// stays self-contained: it must include what it uses and keep its helpers in an anonymous
// namespace whose names no other component uses.
#include "registry.cpp"
#include "reduce_bucket.cpp"
#include "lanes.cpp"
#include "grad_reducer.cpp"
#include "gather.cpp"
#include "executor.cpp"
#include "z3_executor.cpp"
#include "runtime.cpp"
#include "ops.cpp"
#include "comm/process_group.cpp"
