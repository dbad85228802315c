// A stand-in for NVIDIA's driver (`libcuda.so`), for tests on machines without a GPU: the part of the
// driver API the CUDA executor calls (through cudarc), over host memory, with Kura's kernels run on the
// CPU by `emu.h`. With it, the executor's own host code — launch arguments, graphs, dependent launches,
// copies, events, pinned memory, host-tier transfers — runs in CI.
//
// It keeps the driver's rules where breaking them is a bug on a GPU, and takes the latest legal moment
// to run work, so that a missing wait shows:
// - work on a stream (kernels, copies, memsets, event records, frees) runs only when the host waits for
//   it: `cuStreamSynchronize`, `cuCtxSynchronize`, `cuEventSynchronize`, a second `cuEventQuery` (the
//   first of a pending event answers not ready), or a synchronous copy (which waits for the legacy
//   stream and the blocking streams only, as the driver's does). `cuStreamWaitEvent` is a wait on the
//   device: the event's stream runs up to that record when the waiting stream reaches the wait, not
//   before, and work queued after the record stays pending. A read of a copy's destination before such
//   a wait reads the old bytes; a write to a pinned source before it changes what is copied.
// - copies from pageable host memory read their source when called; copies to pageable host memory wait
//   for the stream (the driver stages pageable memory); pinned memory (registered or allocated by the
//   driver) is read and written when the copy runs.
// - a kernel's parameters are copied at the launch; a launch names a kernel of the loaded module, its
//   block at most 1,024 threads, its shared memory (static, from the cubin, and dynamic) within 48 KiB or
//   what the kernel was allowed (up to what a block may opt in to: below).
// - every device range a copy names lies within one allocation; elapsed time needs both events done.
// - while a stream captures a graph, its work goes into the graph, and calls the driver refuses during a
//   capture (synchronous copies, allocations and frees outside the stream, synchronisation) fail and
//   invalidate it.
// `kura_emu_fail` makes chosen calls fail, for tests of the executor's error paths; `kura_emu_shared_optin`
// lowers the shared memory a block may opt in to.
// The device: compute capability 9.0 (`KURA_EMU_CC`, e.g. `8.0`, overrides), 4 multiprocessors, the shared
// memory of its compute capability (a block with opt-in / a multiprocessor: 227 / 228 KiB from 9.0, 163 /
// 164 on 8.0 and 8.7, 99 / 100 on the others), `KURA_EMU_MEMORY_MB` of memory (default 4,096).
#include <cuda.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "driver.h"

using emu_driver::Op;

namespace {

struct Graph {
  std::vector<Op> ops;
};

struct Stream {
  unsigned flags = 0;
  std::deque<Op> queue;
  Graph* capture = nullptr;  // while capturing
  bool invalidated = false;  // a refused call during the capture
};

struct Event {
  Stream* stream = nullptr;  // where it was last recorded
  bool pending = false;      // recorded, not yet run
  bool done = false;         // has run at least once
  bool queried = false;      // answered "not ready" once for this record
  uint64_t records = 0;      // how many times it was recorded: only the latest record completes it
  uint64_t completed = 0;    // the newest of its records that has run
  int queued = 0;            // its records on streams' queues, not yet run
  bool captured = false;     // recorded into a graph (then never freed: a graph may run it any time)
  bool destroyed = false;    // destroyed with records still queued: the last of them frees it
  double ms = 0;
};

struct Func {
  std::string name;
  int static_bytes = 0;            // the kernel's own `__shared__` memory, from the cubin
  int max_dynamic = 48 << 10;      // dynamic shared memory a launch may ask for
};

constexpr int kBlockShared = 48 << 10;     // static + dynamic shared memory a block has without opt-in

// Each kernel's static shared memory in a cubin: the size of its section `.nv.shared.<kernel>`, less
// the 1 KiB a block reserves for the system where the cubin says so (`.nv.shared.reserved.0`), as
// ptxas reports it. Empty when the image is not a well-formed 64-bit ELF file.
std::map<std::string, int> static_shared(const unsigned char* b, size_t len) {
  std::map<std::string, int> out;
  auto u16 = [&](size_t at) { uint16_t v; std::memcpy(&v, b + at, 2); return v; };
  auto u32 = [&](size_t at) { uint32_t v; std::memcpy(&v, b + at, 4); return v; };
  auto u64 = [&](size_t at) { uint64_t v; std::memcpy(&v, b + at, 8); return v; };
  if (len < 64 || b[4] != 2) return out;
  uint64_t shoff = u64(0x28);
  size_t entsize = u16(0x3a), count = u16(0x3c), strndx = u16(0x3e);
  if (entsize < 64 || strndx >= count || shoff > len || count > (len - shoff) / entsize) return out;
  auto section = [&](size_t i) { return shoff + i * entsize; };
  uint64_t strtab = u64(section(strndx) + 0x18), strsize = u64(section(strndx) + 0x20);
  if (strtab > len || strsize > len - strtab) return out;
  bool reserved = false;
  std::map<std::string, uint64_t> sizes;
  for (size_t i = 0; i < count; i++) {
    uint32_t at = u32(section(i));
    if (at >= strsize) continue;
    const char* name = reinterpret_cast<const char*>(b + strtab + at);
    size_t n = strnlen(name, strsize - at);
    std::string s(name, n);
    if (s.rfind(".nv.shared.reserved.", 0) == 0)
      reserved = true;
    else if (s.rfind(".nv.shared.", 0) == 0)
      sizes[s.substr(11)] = u64(section(i) + 0x20);
  }
  for (auto& [k, v] : sizes) out[k] = (int)std::min<uint64_t>(v - (reserved && v >= 1024 ? 1024 : 0), 1 << 30);
  return out;
}

std::recursive_mutex& lock() {
  static std::recursive_mutex m;
  return m;
}

struct State {
  Stream legacy;
  std::set<Stream*> streams;
  std::map<uintptr_t, size_t> device;  // allocations: start → bytes
  std::map<uintptr_t, size_t> pinned;  // registered or driver-allocated host memory
  size_t used = 0;
  uint64_t launches = 0;
  int ctx_marker = 0;
  int module_marker = 0;
  std::map<std::string, int> static_bytes;  // of the loaded module's kernels
  std::chrono::steady_clock::time_point start = std::chrono::steady_clock::now();
};
State& S() {
  static State s;
  return s;
}

// Calls made to fail (`kura_emu_fail`): the driver function's name → the calls to let through first, the
// calls to fail after them, the error.
struct Fault {
  long pass, fail;
  CUresult code;
};
std::map<std::string, Fault>& faults() {
  static std::map<std::string, Fault> f;
  return f;
}
CUresult injected(const char* name) {
  auto it = faults().find(name);
  if (it == faults().end()) return CUDA_SUCCESS;
  Fault& f = it->second;
  if (f.pass > 0) {
    f.pass--;
    return CUDA_SUCCESS;
  }
  if (f.fail == 0) return CUDA_SUCCESS;
  if (f.fail > 0) f.fail--;
  return f.code;
}
#define FAULT(name) \
  if (CUresult injected_error = injected(name)) return injected_error

size_t total_memory() {
  const char* mb = std::getenv("KURA_EMU_MEMORY_MB");
  size_t v = mb ? std::strtoull(mb, nullptr, 10) : 4096;
  return (v ? v : 4096) << 20;
}

void compute_capability(int* major, int* minor) {
  *major = 9;
  *minor = 0;
  if (const char* cc = std::getenv("KURA_EMU_CC")) std::sscanf(cc, "%d.%d", major, minor);
}

// What `kura_emu_shared_optin` set (0: none).
int& shared_optin_set() {
  static int bytes = 0;
  return bytes;
}

// Static + dynamic shared memory a block may have with opt-in, by compute capability or as
// `kura_emu_shared_optin` set it (a multiprocessor has 1 KiB more).
int block_shared_optin() {
  if (shared_optin_set() > 0) return shared_optin_set();
  int major, minor;
  compute_capability(&major, &minor);
  if (major >= 9) return 227 << 10;
  if (major == 8 && (minor == 0 || minor == 7)) return 163 << 10;
  return 99 << 10;
}

Stream* stream_of(CUstream s) {
  if (s == nullptr || s == CU_STREAM_LEGACY || s == CU_STREAM_PER_THREAD) return &S().legacy;
  return reinterpret_cast<Stream*>(s);
}

// A call the driver refuses while a stream captures: it fails, and the capture is invalidated.
bool refused_in_capture() {
  bool any = false;
  if (S().legacy.capture) S().legacy.invalidated = any = true;
  for (Stream* s : S().streams)
    if (s->capture) s->invalidated = any = true;
  return any;
}

void run(Stream* s) {
  while (!s->queue.empty()) {
    Op op = std::move(s->queue.front());
    s->queue.pop_front();
    op();
  }
}

// Runs the work of `e`'s stream up to its latest record and no further (what a wait on it waits for:
// work queued after the record may still be pending, as on a GPU). A record captured into a graph is
// not on the stream's queue: then the whole queue runs.
void run_to(Event* e) {
  Stream* s = e->stream;
  while (e->pending && !s->queue.empty()) {
    Op op = std::move(s->queue.front());
    s->queue.pop_front();
    op();
  }
}

// Runs `from` until record `record` of `e` has run (a wait on the device, when the waiting stream
// reaches it).
void run_until(Event* e, Stream* from, uint64_t record) {
  while (e->completed < record && !from->queue.empty()) {
    Op op = std::move(from->queue.front());
    from->queue.pop_front();
    op();
  }
}

void run_all() {
  run(&S().legacy);
  for (Stream* s : S().streams) run(s);
}

// What a synchronous call waits for: the legacy stream and every blocking stream.
void run_blocking() {
  run(&S().legacy);
  for (Stream* s : S().streams)
    if (!(s->flags & CU_STREAM_NON_BLOCKING)) run(s);
}

void enqueue(Stream* s, Op op) {
  if (s->capture)
    s->capture->ops.push_back(std::move(op));
  else
    s->queue.push_back(std::move(op));
}

// The allocation holding [p, p + n), or none.
bool in_device(uintptr_t p, size_t n) {
  auto& d = S().device;
  auto it = d.upper_bound(p);
  if (it == d.begin()) return false;
  --it;
  return p >= it->first && n <= it->second && p - it->first <= it->second - n;
}
bool overlaps_device(uintptr_t p) {
  auto& d = S().device;
  auto it = d.upper_bound(p);
  if (it == d.begin()) return false;
  --it;
  return p - it->first < it->second;
}
bool in_pinned(const void* ptr, size_t n) {
  uintptr_t p = (uintptr_t)ptr;
  auto& d = S().pinned;
  auto it = d.upper_bound(p);
  if (it == d.begin()) return false;
  --it;
  return p >= it->first && n <= it->second && p - it->first <= it->second - n;
}

CUresult host_to_device(CUdeviceptr dst, const void* src, size_t n, Stream* s) {
  if (n == 0) return CUDA_SUCCESS;
  if (!in_device(dst, n) || overlaps_device((uintptr_t)src)) return CUDA_ERROR_INVALID_VALUE;
  if (in_pinned(src, n) || s->capture) {
    enqueue(s, [dst, src, n] { std::memcpy((void*)dst, src, n); });
  } else {
    auto staged = std::make_shared<std::vector<unsigned char>>((const unsigned char*)src,
                                                                (const unsigned char*)src + n);
    enqueue(s, [dst, staged] { std::memcpy((void*)dst, staged->data(), staged->size()); });
  }
  return CUDA_SUCCESS;
}

CUresult device_to_host(void* dst, CUdeviceptr src, size_t n, Stream* s) {
  if (n == 0) return CUDA_SUCCESS;
  if (!in_device(src, n) || overlaps_device((uintptr_t)dst)) return CUDA_ERROR_INVALID_VALUE;
  if (in_pinned(dst, n) || s->capture) {
    enqueue(s, [dst, src, n] { std::memcpy(dst, (const void*)src, n); });
  } else {
    run(s);
    std::memcpy(dst, (const void*)src, n);
  }
  return CUDA_SUCCESS;
}

void* alloc_device(size_t n) {
  size_t bytes = (std::max<size_t>(n, 1) + 255) & ~(size_t)255;
  void* p = std::aligned_alloc(256, bytes);
  if (!p) return nullptr;
  // Fresh device memory holds whatever was there: a NaN pattern, so that a read of what nobody wrote shows.
  std::memset(p, 0xff, bytes);
  S().device[(uintptr_t)p] = n;
  S().used += n;
  return p;
}

// An allocation of `n` bytes within the device's memory.
CUresult alloc_checked(CUdeviceptr* p, size_t n) {
  if (n == 0) return CUDA_ERROR_INVALID_VALUE;
  if (n > total_memory() - std::min(S().used, total_memory())) return CUDA_ERROR_OUT_OF_MEMORY;
  void* a = alloc_device(n);
  if (!a) return CUDA_ERROR_OUT_OF_MEMORY;
  *p = (CUdeviceptr)a;
  return CUDA_SUCCESS;
}

CUresult free_device(CUdeviceptr p) {
  auto it = S().device.find(p);
  if (it == S().device.end()) return CUDA_ERROR_INVALID_VALUE;
  S().used -= it->second;
  S().device.erase(it);
  std::free((void*)p);
  return CUDA_SUCCESS;
}

CUresult launch(CUfunction f, const unsigned grid[3], const unsigned block[3], unsigned smem, CUstream hs,
                void** params, void** extra) {
  if (!f) return CUDA_ERROR_INVALID_HANDLE;
  if (extra) return CUDA_ERROR_NOT_SUPPORTED;
  FAULT("launch");
  Func* fn = reinterpret_cast<Func*>(f);
  uint64_t threads = (uint64_t)block[0] * block[1] * block[2];
  if (threads == 0 || threads > 1024 || block[2] > 64 || grid[0] == 0 || grid[1] == 0 || grid[2] == 0 ||
      grid[1] > 65535 || grid[2] > 65535 || grid[0] > 0x7fffffffu || (int)smem > fn->max_dynamic)
    return CUDA_ERROR_INVALID_VALUE;
  emu_driver::Launch l{{grid[0], grid[1], grid[2]}, {block[0], block[1], block[2]}, smem, ++S().launches};
  Op op;
  if (!emu_driver::bind_kernel(fn->name, params, l, &op)) return CUDA_ERROR_INVALID_VALUE;
  enqueue(stream_of(hs), std::move(op));
  return CUDA_SUCCESS;
}

const char* error_name(CUresult e) {
  switch (e) {
    case CUDA_SUCCESS: return "CUDA_SUCCESS";
    case CUDA_ERROR_INVALID_VALUE: return "CUDA_ERROR_INVALID_VALUE";
    case CUDA_ERROR_OUT_OF_MEMORY: return "CUDA_ERROR_OUT_OF_MEMORY";
    case CUDA_ERROR_INVALID_DEVICE: return "CUDA_ERROR_INVALID_DEVICE";
    case CUDA_ERROR_INVALID_HANDLE: return "CUDA_ERROR_INVALID_HANDLE";
    case CUDA_ERROR_NOT_FOUND: return "CUDA_ERROR_NOT_FOUND";
    case CUDA_ERROR_NOT_READY: return "CUDA_ERROR_NOT_READY";
    case CUDA_ERROR_NOT_SUPPORTED: return "CUDA_ERROR_NOT_SUPPORTED";
    case CUDA_ERROR_INVALID_IMAGE: return "CUDA_ERROR_INVALID_IMAGE";
    case CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED: return "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED";
    case CUDA_ERROR_STREAM_CAPTURE_INVALIDATED: return "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED";
    case CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED: return "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED";
    case CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED: return "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED";
    default: return "CUDA_ERROR_UNKNOWN";
  }
}

}  // namespace

#define GUARD std::lock_guard<std::recursive_mutex> guard(lock())

extern "C" {

// Makes driver function `name` (its exported name, e.g. `cuMemcpyBatchAsync_v2`; `launch` for either
// kernel launch) return `code` on `fail` calls (-1: every call) after letting `pass` through; `fail` 0
// clears it. For tests of the executor's error paths.
void kura_emu_fail(const char* name, long pass, long fail, int code) {
  GUARD;
  if (fail == 0)
    faults().erase(name);
  else
    faults()[name] = Fault{pass, fail, (CUresult)code};
}

// Makes the device's blocks opt in to at most `bytes` of shared memory (0: its compute capability's
// again), for tests of a device on which some kernels do not fit a block. Devices opened before keep what
// they read.
void kura_emu_shared_optin(int bytes) {
  GUARD;
  shared_optin_set() = bytes;
}

int kura_emu_enqueue(void* stream, void (*fn)(void*), void (*drop)(void*), void* data) {
  GUARD;
  std::shared_ptr<void> keep(data, drop);
  enqueue(stream_of((CUstream)stream), [fn, keep] { fn(keep.get()); });
  return CUDA_SUCCESS;
}

// ---- errors, version, device, context ----
CUresult CUDAAPI cuGetErrorString(CUresult e, const char** s) {
  *s = error_name(e);
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuGetErrorName(CUresult e, const char** s) {
  *s = error_name(e);
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuInit(unsigned int) { return CUDA_SUCCESS; }
CUresult CUDAAPI cuDriverGetVersion(int* v) {
  *v = 13000;
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuDeviceGetCount(int* n) {
  *n = 1;
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuDeviceGet(CUdevice* d, int ordinal) {
  if (ordinal != 0) return CUDA_ERROR_INVALID_DEVICE;
  *d = 0;
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuDeviceGetName(char* name, int len, CUdevice d) {
  if (d != 0) return CUDA_ERROR_INVALID_DEVICE;
  std::snprintf(name, (size_t)len, "Kura emulated GPU (CPU)");
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuDeviceTotalMem(size_t* bytes, CUdevice d) {
  if (d != 0) return CUDA_ERROR_INVALID_DEVICE;
  *bytes = total_memory();
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuDeviceGetAttribute(int* v, CUdevice_attribute a, CUdevice d) {
  if (d != 0) return CUDA_ERROR_INVALID_DEVICE;
  int major, minor;
  compute_capability(&major, &minor);
  switch (a) {
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: *v = major; break;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: *v = minor; break;
    case CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: *v = 4; break;
    case CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED: *v = 1; break;
    case CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK: *v = 1024; break;
    case CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR: *v = 2048; break;
    case CU_DEVICE_ATTRIBUTE_WARP_SIZE: *v = 32; break;
    case CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK: *v = 48 << 10; break;
    case CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN: *v = block_shared_optin(); break;
    case CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR: *v = block_shared_optin() + (1 << 10); break;
    case CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING: *v = 1; break;
    default: *v = 0;
  }
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuDevicePrimaryCtxRetain(CUcontext* c, CUdevice d) {
  if (d != 0) return CUDA_ERROR_INVALID_DEVICE;
  *c = reinterpret_cast<CUcontext>(&S().ctx_marker);
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuDevicePrimaryCtxRelease(CUdevice) { return CUDA_SUCCESS; }
CUresult CUDAAPI cuCtxSetCurrent(CUcontext) { return CUDA_SUCCESS; }
CUresult CUDAAPI cuCtxGetCurrent(CUcontext* c) {
  *c = reinterpret_cast<CUcontext>(&S().ctx_marker);
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuCtxGetDevice(CUdevice* d) {
  *d = 0;
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuCtxSynchronize(void) {
  GUARD;
  if (refused_in_capture()) return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
  run_all();
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuCtxGetStreamPriorityRange(int* least, int* greatest) {
  *least = 0;
  *greatest = -5;
  return CUDA_SUCCESS;
}

// ---- memory ----
CUresult CUDAAPI cuMemGetInfo(size_t* free, size_t* total) {
  GUARD;
  *total = total_memory();
  *free = S().used >= *total ? 0 : *total - S().used;
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuMemAlloc(CUdeviceptr* p, size_t n) {
  GUARD;
  if (refused_in_capture()) return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
  return alloc_checked(p, n);
}
CUresult CUDAAPI cuMemFree(CUdeviceptr p) {
  GUARD;
  if (refused_in_capture()) return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
  run_all();
  return free_device(p);
}
CUresult CUDAAPI cuMemAllocAsync(CUdeviceptr* p, size_t n, CUstream) {
  GUARD;
  FAULT("cuMemAllocAsync");
  return alloc_checked(p, n);
}
CUresult CUDAAPI cuMemFreeAsync(CUdeviceptr p, CUstream hs) {
  GUARD;
  if (!S().device.count(p)) return CUDA_ERROR_INVALID_VALUE;
  enqueue(stream_of(hs), [p] { free_device(p); });
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuMemHostAlloc(void** p, size_t n, unsigned int) {
  GUARD;
  void* a = std::aligned_alloc(4096, (std::max<size_t>(n, 1) + 4095) & ~(size_t)4095);
  if (!a) return CUDA_ERROR_OUT_OF_MEMORY;
  S().pinned[(uintptr_t)a] = n;
  *p = a;
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuMemAllocHost(void** p, size_t n) { return cuMemHostAlloc(p, n, 0); }
CUresult CUDAAPI cuMemFreeHost(void* p) {
  GUARD;
  run_all();
  if (!S().pinned.erase((uintptr_t)p)) return CUDA_ERROR_INVALID_VALUE;
  std::free(p);
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuMemHostRegister(void* p, size_t n, unsigned int) {
  GUARD;
  if (!p || n == 0) return CUDA_ERROR_INVALID_VALUE;
  uintptr_t a = (uintptr_t)p;
  for (auto& [at, len] : S().pinned)
    if (a < at + len && at < a + n) return CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED;
  S().pinned[a] = n;
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuMemHostUnregister(void* p) {
  GUARD;
  run_all();
  return S().pinned.erase((uintptr_t)p) ? CUDA_SUCCESS : CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED;
}

// ---- copies and memsets ----
CUresult CUDAAPI cuMemcpyHtoD(CUdeviceptr dst, const void* src, size_t n) {
  GUARD;
  FAULT("cuMemcpyHtoD_v2");
  if (refused_in_capture()) return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
  if (n == 0) return CUDA_SUCCESS;
  if (!in_device(dst, n) || overlaps_device((uintptr_t)src)) return CUDA_ERROR_INVALID_VALUE;
  run_blocking();
  std::memcpy((void*)dst, src, n);
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuMemcpyDtoH(void* dst, CUdeviceptr src, size_t n) {
  GUARD;
  FAULT("cuMemcpyDtoH_v2");
  if (refused_in_capture()) return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
  if (n == 0) return CUDA_SUCCESS;
  if (!in_device(src, n) || overlaps_device((uintptr_t)dst)) return CUDA_ERROR_INVALID_VALUE;
  run_blocking();
  std::memcpy(dst, (const void*)src, n);
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuMemcpyDtoD(CUdeviceptr dst, CUdeviceptr src, size_t n) {
  GUARD;
  if (refused_in_capture()) return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
  if (n == 0) return CUDA_SUCCESS;
  if (!in_device(dst, n) || !in_device(src, n)) return CUDA_ERROR_INVALID_VALUE;
  run_blocking();
  std::memmove((void*)dst, (const void*)src, n);
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuMemcpyHtoDAsync(CUdeviceptr dst, const void* src, size_t n, CUstream hs) {
  GUARD;
  FAULT("cuMemcpyHtoDAsync_v2");
  return host_to_device(dst, src, n, stream_of(hs));
}
CUresult CUDAAPI cuMemcpyDtoHAsync(void* dst, CUdeviceptr src, size_t n, CUstream hs) {
  GUARD;
  FAULT("cuMemcpyDtoHAsync_v2");
  return device_to_host(dst, src, n, stream_of(hs));
}
CUresult CUDAAPI cuMemcpyDtoDAsync(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream hs) {
  GUARD;
  if (n == 0) return CUDA_SUCCESS;
  if (!in_device(dst, n) || !in_device(src, n)) return CUDA_ERROR_INVALID_VALUE;
  enqueue(stream_of(hs), [dst, src, n] { std::memmove((void*)dst, (const void*)src, n); });
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuMemsetD8(CUdeviceptr p, unsigned char v, size_t n) {
  GUARD;
  if (refused_in_capture()) return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
  if (n && !in_device(p, n)) return CUDA_ERROR_INVALID_VALUE;
  run_blocking();
  std::memset((void*)p, v, n);
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuMemsetD8Async(CUdeviceptr p, unsigned char v, size_t n, CUstream hs) {
  GUARD;
  if (n && !in_device(p, n)) return CUDA_ERROR_INVALID_VALUE;
  enqueue(stream_of(hs), [p, v, n] { std::memset((void*)p, v, n); });
  return CUDA_SUCCESS;
}
// Copies between host and device memory in one call. The source of a copy is read when it runs, or
// at the call for CU_MEMCPY_SRC_ACCESS_ORDER_DURING_API_CALL; each copy's direction is read from its
// pointers (device allocations or not).
CUresult CUDAAPI cuMemcpyBatchAsync(CUdeviceptr* dsts, CUdeviceptr* srcs, size_t* sizes, size_t count,
                                    CUmemcpyAttributes* attrs, size_t* attrs_idxs, size_t num_attrs,
                                    CUstream hs) {
  GUARD;
  FAULT("cuMemcpyBatchAsync_v2");
  if (count == 0 || num_attrs == 0 || num_attrs > count || !attrs || !attrs_idxs || attrs_idxs[0] != 0)
    return CUDA_ERROR_INVALID_VALUE;
  for (size_t i = 1; i < num_attrs; i++)
    if (attrs_idxs[i] <= attrs_idxs[i - 1] || attrs_idxs[i] >= count) return CUDA_ERROR_INVALID_VALUE;
  struct One {
    uintptr_t dst, src;
    size_t n;
    std::shared_ptr<std::vector<unsigned char>> staged;
  };
  std::vector<One> copies;
  size_t a = 0;
  for (size_t i = 0; i < count; i++) {
    while (a + 1 < num_attrs && attrs_idxs[a + 1] <= i) a++;
    size_t n = sizes[i];
    uintptr_t d = dsts[i], s = srcs[i];
    if (n == 0) continue;
    bool dd = in_device(d, n), sd = in_device(s, n);
    if ((!dd && overlaps_device(d)) || (!sd && overlaps_device(s))) return CUDA_ERROR_INVALID_VALUE;
    if (!dd && !sd) return CUDA_ERROR_INVALID_VALUE;  // host to host
    One c{d, s, n, nullptr};
    if (attrs[a].srcAccessOrder == CU_MEMCPY_SRC_ACCESS_ORDER_DURING_API_CALL)
      c.staged = std::make_shared<std::vector<unsigned char>>((const unsigned char*)s, (const unsigned char*)s + n);
    else if (attrs[a].srcAccessOrder == CU_MEMCPY_SRC_ACCESS_ORDER_INVALID)
      return CUDA_ERROR_INVALID_VALUE;
    copies.push_back(c);
  }
  enqueue(stream_of(hs), [copies] {
    for (const One& c : copies)
      std::memmove((void*)c.dst, c.staged ? (const void*)c.staged->data() : (const void*)c.src, c.n);
  });
  return CUDA_SUCCESS;
}

// ---- streams, events, host functions ----
CUresult CUDAAPI cuStreamCreate(CUstream* s, unsigned int flags) {
  GUARD;
  Stream* st = new Stream;
  st->flags = flags;
  S().streams.insert(st);
  *s = reinterpret_cast<CUstream>(st);
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuStreamCreateWithPriority(CUstream* s, unsigned int flags, int) { return cuStreamCreate(s, flags); }
CUresult CUDAAPI cuStreamDestroy(CUstream hs) {
  GUARD;
  Stream* s = stream_of(hs);
  if (s == &S().legacy || !S().streams.count(s)) return CUDA_ERROR_INVALID_HANDLE;
  run(s);
  S().streams.erase(s);
  delete s->capture;
  delete s;
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuStreamSynchronize(CUstream hs) {
  GUARD;
  FAULT("cuStreamSynchronize");
  if (refused_in_capture()) return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
  run(stream_of(hs));
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuStreamQuery(CUstream hs) {
  GUARD;
  if (refused_in_capture()) return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
  Stream* s = stream_of(hs);
  if (!s->queue.empty()) {
    run(s);
    return CUDA_ERROR_NOT_READY;
  }
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuStreamWaitEvent(CUstream hs, CUevent he, unsigned int) {
  GUARD;
  FAULT("cuStreamWaitEvent");
  Event* e = reinterpret_cast<Event*>(he);
  Stream* s = stream_of(hs);
  if (!(e->stream && e->stream != s && !e->stream->capture && e->pending)) return CUDA_SUCCESS;
  if (s->capture) {
    // Into a graph: the event's stream runs now up to the record, one order the wait allows.
    run_to(e);
    return CUDA_SUCCESS;
  }
  // On the device, not the host: the event's stream runs up to this record only when `hs` reaches the
  // wait, so the host sees nothing of that work before it waits for `hs` or for the event itself (a
  // host read that counted on another stream's wait shows as stale bytes). What the event's stream
  // queued after the record stays pending (a wait on an earlier event than the one that covers the
  // work needed shows as stale bytes too). The wait holds the event until it runs.
  Stream* from = e->stream;
  uint64_t record = e->records;
  e->queued++;
  enqueue(s, [e, from, record] {
    run_until(e, from, record);
    e->queued--;
    if (e->destroyed && e->queued == 0 && !e->captured) delete e;
  });
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuLaunchHostFunc(CUstream hs, CUhostFn fn, void* data) {
  GUARD;
  enqueue(stream_of(hs), [fn, data] { fn(data); });
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuEventCreate(CUevent* e, unsigned int) {
  *e = reinterpret_cast<CUevent>(new Event);
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuEventDestroy(CUevent he) {
  GUARD;
  Event* e = reinterpret_cast<Event*>(he);
  // Nothing runs: a pending record still runs when its stream does, and the driver releases the event
  // once it has (a destroyed event does not order anything, so dropping one is no wait).
  if (e->queued > 0 || e->captured)
    e->destroyed = true;
  else
    delete e;
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuEventRecord(CUevent he, CUstream hs) {
  GUARD;
  FAULT("cuEventRecord");
  Event* e = reinterpret_cast<Event*>(he);
  Stream* s = stream_of(hs);
  e->stream = s;
  e->pending = true;
  e->queried = false;
  uint64_t record = ++e->records;
  bool queued = !s->capture;
  if (queued)
    e->queued++;
  else
    e->captured = true;
  enqueue(s, [e, record, queued] {
    if (queued) e->queued--;
    e->completed = std::max(e->completed, record);
    if (record == e->records) {  // else recorded again since: the later record completes it
      e->pending = false;
      e->done = true;
      e->ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - S().start).count();
    }
    if (e->destroyed && e->queued == 0 && !e->captured) delete e;
  });
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuEventQuery(CUevent he) {
  GUARD;
  Event* e = reinterpret_cast<Event*>(he);
  if (!e->pending) return CUDA_SUCCESS;
  if (!e->queried) {
    e->queried = true;
    return CUDA_ERROR_NOT_READY;
  }
  run_to(e);
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuEventSynchronize(CUevent he) {
  GUARD;
  Event* e = reinterpret_cast<Event*>(he);
  if (e->pending) run_to(e);
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuEventElapsedTime(float* ms, CUevent a, CUevent b) {
  GUARD;
  Event *x = reinterpret_cast<Event*>(a), *y = reinterpret_cast<Event*>(b);
  if (!x->done || !y->done) return x->pending || y->pending ? CUDA_ERROR_NOT_READY : CUDA_ERROR_INVALID_HANDLE;
  if (x->pending || y->pending) return CUDA_ERROR_NOT_READY;
  *ms = (float)(y->ms - x->ms);
  return CUDA_SUCCESS;
}

// ---- graphs ----
CUresult CUDAAPI cuStreamBeginCapture(CUstream hs, CUstreamCaptureMode) {
  GUARD;
  Stream* s = stream_of(hs);
  if (s->capture || s == &S().legacy) return CUDA_ERROR_INVALID_VALUE;
  s->capture = new Graph;
  s->invalidated = false;
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuStreamEndCapture(CUstream hs, CUgraph* g) {
  GUARD;
  Stream* s = stream_of(hs);
  if (!s->capture) return CUDA_ERROR_INVALID_VALUE;
  Graph* graph = s->capture;
  s->capture = nullptr;
  if (s->invalidated) {
    delete graph;
    *g = nullptr;
    return CUDA_ERROR_STREAM_CAPTURE_INVALIDATED;
  }
  *g = reinterpret_cast<CUgraph>(graph);
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuStreamIsCapturing(CUstream hs, CUstreamCaptureStatus* status) {
  GUARD;
  Stream* s = stream_of(hs);
  *status = !s->capture ? CU_STREAM_CAPTURE_STATUS_NONE
                        : s->invalidated ? CU_STREAM_CAPTURE_STATUS_INVALIDATED : CU_STREAM_CAPTURE_STATUS_ACTIVE;
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuGraphInstantiateWithFlags(CUgraphExec* exec, CUgraph g, unsigned long long) {
  GUARD;
  if (!g) return CUDA_ERROR_INVALID_VALUE;
  *exec = reinterpret_cast<CUgraphExec>(new Graph(*reinterpret_cast<Graph*>(g)));
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuGraphUpload(CUgraphExec, CUstream) { return CUDA_SUCCESS; }
CUresult CUDAAPI cuGraphLaunch(CUgraphExec exec, CUstream hs) {
  GUARD;
  if (!exec) return CUDA_ERROR_INVALID_VALUE;
  Stream* s = stream_of(hs);
  for (const Op& op : reinterpret_cast<Graph*>(exec)->ops) enqueue(s, op);
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuGraphDestroy(CUgraph g) {
  GUARD;
  delete reinterpret_cast<Graph*>(g);
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuGraphExecDestroy(CUgraphExec g) {
  GUARD;
  // Launches of it already on a stream hold their own copies of its work.
  delete reinterpret_cast<Graph*>(g);
  return CUDA_SUCCESS;
}

// ---- modules, functions, launches ----
CUresult CUDAAPI cuModuleLoadData(CUmodule* m, const void* image) {
  GUARD;
  const unsigned char* b = static_cast<const unsigned char*>(image);
  // A cubin: an ELF file for the CUDA machine (190). Its size is not passed: what is read (the section
  // headers and their names) lies before the end of the section header table in NVIDIA's cubins.
  if (!b || std::memcmp(b, "\x7f" "ELF", 4) != 0 || (b[18] | (b[19] << 8)) != 190) return CUDA_ERROR_INVALID_IMAGE;
  uint64_t shoff;
  uint16_t entsize, count;
  std::memcpy(&shoff, b + 0x28, 8);
  std::memcpy(&entsize, b + 0x3a, 2);
  std::memcpy(&count, b + 0x3c, 2);
  S().static_bytes = static_shared(b, shoff + (uint64_t)entsize * count);
  if (S().static_bytes.empty()) return CUDA_ERROR_INVALID_IMAGE;
  *m = reinterpret_cast<CUmodule>(&S().module_marker);
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuModuleUnload(CUmodule) { return CUDA_SUCCESS; }
CUresult CUDAAPI cuModuleGetFunction(CUfunction* f, CUmodule, const char* name) {
  GUARD;
  if (!emu_driver::has_kernel(name)) {
    // What a GPU's module would hold but the stand-in's table lacks: a kernel added to kura.cu and to
    // the executor's list, not yet to emu/kernels.cpp.
    std::fprintf(stderr, "kura's stand-in driver: no kernel %s in emu/kernels.cpp's table (add it there)\n", name);
    return CUDA_ERROR_NOT_FOUND;
  }
  Func* fn = new Func;
  fn->name = name;
  auto it = S().static_bytes.find(name);
  fn->static_bytes = it == S().static_bytes.end() ? 0 : it->second;
  fn->max_dynamic = kBlockShared - fn->static_bytes;
  *f = reinterpret_cast<CUfunction>(fn);
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuFuncSetAttribute(CUfunction f, CUfunction_attribute a, int v) {
  GUARD;
  Func* fn = reinterpret_cast<Func*>(f);
  if (a == CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES) {
    if (v < 0 || v > block_shared_optin() - fn->static_bytes) return CUDA_ERROR_INVALID_VALUE;
    fn->max_dynamic = v;
  }
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuFuncGetAttribute(int* v, CUfunction_attribute a, CUfunction f) {
  Func* fn = reinterpret_cast<Func*>(f);
  switch (a) {
    case CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK: *v = 1024; break;
    case CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES: *v = fn->max_dynamic; break;
    case CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES: *v = fn->static_bytes; break;
    case CU_FUNC_ATTRIBUTE_NUM_REGS: *v = 64; break;
    default: *v = 0;
  }
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuOccupancyMaxActiveBlocksPerMultiprocessor(int* n, CUfunction f, int block, size_t smem) {
  GUARD;
  if (!f || block <= 0 || block > 1024) return CUDA_ERROR_INVALID_VALUE;
  Func* fn = reinterpret_cast<Func*>(f);
  if (smem > (size_t)fn->max_dynamic) {
    *n = 0;
    return CUDA_SUCCESS;
  }
  int by_threads = 2048 / block, by_smem = (int)((228u << 10) / (smem + fn->static_bytes + 1024));
  *n = std::max(0, std::min({32, by_threads, by_smem}));
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags(int* n, CUfunction f, int block, size_t smem,
                                                                      unsigned int) {
  return cuOccupancyMaxActiveBlocksPerMultiprocessor(n, f, block, smem);
}
CUresult CUDAAPI cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                                unsigned bz, unsigned smem, CUstream hs, void** params, void** extra) {
  GUARD;
  unsigned grid[3] = {gx, gy, gz}, block[3] = {bx, by, bz};
  return launch(f, grid, block, smem, hs, params, extra);
}
CUresult CUDAAPI cuLaunchKernelEx(const CUlaunchConfig* c, CUfunction f, void** params, void** extra) {
  GUARD;
  int major, minor;
  compute_capability(&major, &minor);
  for (unsigned i = 0; i < c->numAttrs; i++) {
    if (c->attrs[i].id != CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION) return CUDA_ERROR_NOT_SUPPORTED;
    // Programmatic dependent launch needs compute capability 9.0.
    if (major < 9 && c->attrs[i].value.programmaticStreamSerializationAllowed) return CUDA_ERROR_NOT_SUPPORTED;
  }
  unsigned grid[3] = {c->gridDimX, c->gridDimY, c->gridDimZ}, block[3] = {c->blockDimX, c->blockDimY, c->blockDimZ};
  return launch(f, grid, block, c->sharedMemBytes, c->hStream, params, extra);
}

}  // extern "C"
