// Between the stand-in driver (`driver.cpp`, which sees `cuda.h`) and the emulated kernels
// (`kernels.cpp`, which sees `emu.h`): neither header can be included beside the other.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>

namespace emu_driver {

// Work a stream runs when the host waits for it.
using Op = std::function<void()>;

struct Launch {
  unsigned grid[3], block[3];
  size_t shared_bytes;
  uint64_t seed;  // orders the blocks (a different shuffle each launch)
};

bool has_kernel(const std::string& name);

// Copies the parameters of a launch of kernel `name` (one pointer to each, in the kernel's order) and
// puts the launch in `out`; false when there is no such kernel.
bool bind_kernel(const std::string& name, void** params, const Launch& launch, Op* out);

}  // namespace emu_driver

// For the stand-in cuBLAS: puts `run(data)` on `stream` (or into the graph it captures), in order with
// the stream's other work; `drop(data)` once it will not run again. Returns a CUresult.
extern "C" int kura_emu_enqueue(void* stream, void (*run)(void*), void (*drop)(void*), void* data);
