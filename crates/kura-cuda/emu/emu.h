// Runs Kura's CUDA kernels (`../kernels/kura.cu`) on the CPU, for tests on machines without a GPU.
//
// Every thread of a block is a fiber (its own stack; x86-64 switches in `emu_switch`); the blocks of a grid run one after another, in an order
// the caller chooses. A fiber runs until it reaches a synchronisation point (`__syncthreads`, or a warp
// collective: shuffles, `ldmatrix`, `mma.sync`), where it yields; the point completes when every thread
// it involves has arrived. This is one legal schedule of the kernel, chosen to expose what a GPU would
// also get wrong:
// - a block's threads run in turn between barriers, so a read of shared memory that another warp writes
//   without a barrier in between reads the old value; or, with `emu_warps_run_ahead`, each warp runs on
//   to the next barrier before the next warp starts, so such a read reads the new value;
// - `cp.async` copies land only at the `cp.async.wait_group` that must wait for them (the latest a GPU
//   may deliver them), so a read before that wait reads the old value; or, with
//   `emu_copies_land_early`, as they are issued (the earliest), so that a copy into shared memory that
//   another thread still reads before the next barrier (a stage reused too soon) changes what it reads;
// - `__shared__` variables are static storage reused by every block, so a block that reads what it did
//   not write sees the previous block's values, and dynamic shared memory is filled with a NaN pattern
//   before each block;
// - a barrier or a collective that not every thread reaches (divergence) is reported, not hung (two
//   different `__syncthreads` call sites still satisfy each other, as one counter serves the block).
// `mma.sync` is computed exactly (products and sums in double, one rounding to f32), `ldmatrix` and the
// fragment layouts follow the PTX ISA. Floating-point results are this CPU's, not the GPU's (its `exp2f`,
// `rsqrtf` and contraction differ): the emulation checks indexing, layouts, synchronisation and that two
// kernels which claim the same bits compute the same operations in the same order — not the GPU's own
// bits, which `scripts/test-gpu.sh` checks on a device.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <utility>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __restrict__ __restrict
#define __align__(n) __attribute__((aligned(n)))
#define __shared__ static
#define KURA_EMU 1

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
};
struct alignas(8) float2 {
  float x, y;
};
struct alignas(16) float4 {
  float x, y, z, w;
};
struct alignas(8) uint2 {
  unsigned x, y;
};
struct alignas(16) uint4 {
  unsigned x, y, z, w;
};

// ---------------------------------------------------------------------------------------------------
// Number formats: bf16, f16 and e4m3 with the rounding CUDA's conversions use.
struct __nv_bfloat16 {
  uint16_t x;
};
struct __nv_bfloat162 {
  __nv_bfloat16 x, y;
};
inline float __bfloat162float(__nv_bfloat16 h) {
  uint32_t u = (uint32_t)h.x << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline __nv_bfloat16 __float2bfloat16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if (std::isnan(f)) return {0x7fff};
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
  return {(uint16_t)(u >> 16)};
}
inline __nv_bfloat162 __floats2bfloat162_rn(float a, float b) { return {__float2bfloat16(a), __float2bfloat16(b)}; }
inline float2 __bfloat1622float2(__nv_bfloat162 h) { return {__bfloat162float(h.x), __bfloat162float(h.y)}; }

struct __half {
  uint16_t x;
};
struct __half2 {
  __half x, y;
};
struct __half2_raw {
  unsigned short x, y;
};
inline float __half2float(__half h) {
  int e = (h.x >> 10) & 31, m = h.x & 1023;
  float v = e == 31 ? (m ? NAN : INFINITY) : e == 0 ? std::ldexp((float)m, -24) : std::ldexp(1.f + m / 1024.f, e - 15);
  return (h.x & 0x8000) ? -v : v;
}
// Rounded to nearest even; past the largest half, infinity.
inline __half __float2half_rn(float f) {
  uint16_t sign = std::signbit(f) ? 0x8000 : 0;
  if (std::isnan(f)) return {0x7fff};
  if (std::isinf(f)) return {(uint16_t)(sign | 0x7c00)};
  float a = std::fabs(f);
  if (a < std::ldexp(1.f, -14)) return {(uint16_t)(sign | (uint16_t)std::nearbyint(a * 16777216.f))};  // 2^-24 steps
  int e;
  float m = std::frexp(a, &e);  // a = m · 2^e, m in [0.5, 1)
  int exp = e - 1, q = (int)std::nearbyint((2.f * m - 1.f) * 1024.f);
  if (q == 1024) {
    q = 0;
    exp++;
  }
  if (exp > 15) return {(uint16_t)(sign | 0x7c00)};
  return {(uint16_t)(sign | ((exp + 15) << 10) | q)};
}
inline float2 __half22float2(__half2 h) { return {__half2float(h.x), __half2float(h.y)}; }

typedef unsigned char __nv_fp8_storage_t;
typedef unsigned short __nv_fp8x2_storage_t;
enum __nv_fp8_interpretation_t { __NV_E4M3, __NV_E5M2 };
enum __nv_saturation_t { __NV_NOSAT, __NV_SATFINITE };
// e4m3: bias 7, no infinities, 0x7f / 0xff NaN, largest 448; rounded to nearest even.
inline __nv_fp8_storage_t __nv_cvt_float_to_fp8(float x, __nv_saturation_t sat, __nv_fp8_interpretation_t) {
  unsigned char sign = std::signbit(x) ? 0x80 : 0;
  if (std::isnan(x)) return 0x7f;
  float a = std::fabs(x);
  if (a > 448.f && (sat == __NV_SATFINITE || a >= 464.f)) return (unsigned char)(sign | (sat == __NV_SATFINITE ? 0x7e : 0x7f));
  if (a < std::ldexp(1.f, -6)) {
    int q = (int)std::nearbyint(a * 512.f);  // subnormal steps of 2^-9; q == 8 is the least normal
    return (unsigned char)(sign | q);
  }
  int e;
  float m = std::frexp(a, &e);  // a = m · 2^e, m in [0.5, 1)
  int exp = e - 1;              // a = (2m) · 2^exp
  int q = (int)std::nearbyint((2.f * m - 1.f) * 8.f);
  if (q == 8) {
    q = 0;
    exp++;
  }
  int code = ((exp + 7) << 3) | q;
  if (code > 0x7e) return (unsigned char)(sign | (sat == __NV_SATFINITE ? 0x7e : 0x7f));
  return (unsigned char)(sign | code);
}
inline float emu_e4m3_to_float(unsigned char b) {
  int e = (b >> 3) & 15, m = b & 7;
  float v;
  if (e == 15 && m == 7)
    v = NAN;
  else if (e == 0)
    v = std::ldexp((float)m, -9);
  else
    v = std::ldexp(1.f + m / 8.f, e - 7);
  return (b & 0x80) ? -v : v;
}
inline __half2_raw __nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t s, __nv_fp8_interpretation_t) {
  __half lo = __float2half_rn(emu_e4m3_to_float((unsigned char)(s & 0xff)));
  __half hi = __float2half_rn(emu_e4m3_to_float((unsigned char)(s >> 8)));
  return {lo.x, hi.x};
}

// ---------------------------------------------------------------------------------------------------
// Arithmetic: one IEEE operation each (build with -ffp-contract=off, so that nothing else is fused).
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float rsqrtf(float x) { return 1.f / std::sqrt(x); }
inline float __int_as_float(int i) {
  float f;
  std::memcpy(&f, &i, sizeof f);
  return f;
}
inline int __float_as_int(float f) {
  int i;
  std::memcpy(&i, &f, sizeof i);
  return i;
}
template <typename T> inline T __ldcg(const T* p) { return *p; }
template <typename T> inline T __ldg(const T* p) { return *p; }
inline void __threadfence() {}
inline int atomicAdd(int* p, int v) {
  int old = *p;
  *p = old + v;
  return old;
}
inline unsigned atomicAdd(unsigned* p, unsigned v) {
  unsigned old = *p;
  *p = old + v;
  return old;
}
using std::isfinite;
using std::isnan;
using std::max;
using std::min;

// ---------------------------------------------------------------------------------------------------
// Fibers, barriers and warp collectives. Hidden: within the stand-in driver they are called directly
// (no lookup through the PLT), and nothing outside it calls them.
namespace emu __attribute__((visibility("hidden"))) {

// The kernel running, named in a fault's report (set by whoever launches; empty: unnamed).
inline const char*& running() {
  static const char* name = "";
  return name;
}

[[noreturn]] inline void fail(const char* what) {
  std::fprintf(stderr, "emulated kernel %s: %s\n", running(), what);
  std::exit(3);
}

struct Copy {
  void* dst;
  const void* src;
  int bytes;  // 16, or 0: write zeros
};

// An issued warpgroup product (`wgmma`): its accumulators and A fragment (this thread's registers,
// read and written when it is computed), its B descriptor and whether B is N-major.
struct Mma {
  float* d;
  int n;
  const uint32_t* a;
  uint64_t desc;
  int trans;
};

// Saves the callee-saved registers on this stack and its pointer in *save, then continues on the stack
// `next` (System V x86-64: what a call may not change; the kernels change no control register).
extern "C" void emu_switch(void** save, void* next);
asm(R"(
  .text
  .globl emu_switch
  .hidden emu_switch
  .type emu_switch, @function
emu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size emu_switch, .-emu_switch
)");

struct Fiber {
  void* sp = nullptr;  // its stack pointer while it is switched out
  // Its stack, left uninitialised (the pages a thread never reaches are never touched).
  std::unique_ptr<char[]> stack;
  dim3 tid;
  int linear = 0;
  bool done = false;
  bool waiting = false;
  unsigned collectives = 0;  // warp collectives entered: which exchange area is next
  std::vector<std::vector<Copy>> groups;  // committed cp.async groups, oldest first
  std::vector<Copy> open;                 // issued since the last commit
  std::vector<std::vector<Mma>> mma_groups;  // committed warpgroup products, oldest first
  std::vector<Mma> mma_open;                 // issued since the last commit
};

struct Barrier {
  int arrived = 0;
  unsigned long generation = 0;
};

// A warp collective's exchange area: each lane's inputs, read by every lane once all have arrived. Two
// areas, used in turn: a lane that has read one collective's inputs may write the next one's while
// others still read (none can write a third before every lane has arrived at the second).
struct WarpSlot {
  Barrier in;
  unsigned char data[2][32][64];
  // An `mma.sync`'s outputs, every lane's, computed by the first lane to read that collective's inputs
  // (`mma_of`: the barrier generation that completed it) and copied by the others.
  float mma_d[2][32][4];
  unsigned long mma_of[2] = {~0ul, ~0ul};
};
// The inputs of one collective, a row a lane; the warp's slot and which of its two areas holds them.
struct Exchange {
  unsigned char (*data)[64];
  WarpSlot* slot;
  int area;
};

struct Grid {
  dim3 grid, block, block_idx;
  std::vector<Fiber> fibers;  // the launch's threads first; kept, stacks and all, for later launches
  std::vector<WarpSlot> warps;
  Barrier block_barrier;
  void* sched = nullptr;  // the scheduler's stack pointer while a fiber runs
  Fiber* current = nullptr;
  int finished = 0;  // the block's threads that have ended
  // The round under way: threads up to `round_end` run in turn, each until it yields; whether every
  // thread that ran has ended, and whether each has ended or waits.
  int round_end = 0;
  bool round_all_done = true, round_all_waiting = true;
  unsigned long progress = 0;
  std::function<void()> body;
  std::vector<unsigned char> dynamic;
};
inline Grid the_grid;
inline Grid& G() { return the_grid; }
inline Fiber& me() { return *G().current; }
// Ends the running thread's turn: on to the next thread of the round that has not ended (switching to
// it directly), or, past the round's last, back to the scheduler.
inline void yield() {
  Grid& g = G();
  Fiber& f = *g.current;
  g.round_all_done &= f.done;
  g.round_all_waiting &= f.done || f.waiting;
  for (int i = f.linear + 1; i < g.round_end; i++) {
    Fiber& next = g.fibers[i];
    if (next.done) continue;
    g.current = &next;
    emu_switch(&f.sp, next.sp);
    return;
  }
  emu_switch(&f.sp, g.sched);
}

inline int block_threads() { return (int)(G().block.x * G().block.y * G().block.z); }
inline int warp_of(int linear) { return linear >> 5; }
inline int lanes_in_warp(int w) { return std::min(32, block_threads() - 32 * w); }

// Waits until `count` threads have arrived at `b` (this one included); fibers that finished count as
// arrived for the block barrier (an exited warp no longer holds a CTA barrier), never for a warp's.
inline void wait_at(Barrier& b, int count, bool finished_count) {
  unsigned long gen = b.generation;
  b.arrived++;
  for (;;) {
    int done = finished_count ? G().finished : 0;
    if (b.generation != gen) break;
    if (b.arrived + done >= count) {
      b.arrived = 0;
      b.generation++;
      G().progress++;
      break;
    }
    me().waiting = true;
    yield();
    me().waiting = false;
  }
}

inline void syncthreads() { wait_at(G().block_barrier, block_threads(), true); }

// Every lane of this warp puts `bytes` of input, then reads any lane's through the exchange returned.
inline Exchange warp_enter(const void* in, size_t bytes) {
  if (bytes > 64) fail("a warp collective's input is over 64 bytes");
  int w = warp_of(me().linear), lane = me().linear & 31;
  if (lanes_in_warp(w) != 32) fail("a warp collective in a warp of fewer than 32 threads");
  WarpSlot& s = G().warps[w];
  int area = me().collectives++ & 1;
  unsigned char(*rows)[64] = s.data[area];
  std::memcpy(rows[lane], in, bytes);
  wait_at(s.in, 32, false);
  return {rows, &s, area};
}
inline int lane() { return me().linear & 31; }

template <typename T> T shfl_xor(unsigned mask, T v, int lm) {
  if (mask != 0xffffffffu) fail("a shuffle with a partial mask");
  static_assert(sizeof(T) <= 64, "shuffled value too large");
  Exchange s = warp_enter(&v, sizeof(T));
  T r;
  std::memcpy(&r, s.data[(lane() ^ lm) & 31], sizeof(T));
  return r;
}

// __any_sync: whether any lane's predicate holds.
inline int any_sync(unsigned mask, int pred) {
  if (mask != 0xffffffffu) fail("a vote with a partial mask");
  int mine = pred != 0;
  Exchange s = warp_enter(&mine, sizeof(mine));
  for (int l = 0; l < 32; l++) {
    int v;
    std::memcpy(&v, s.data[l], sizeof(v));
    if (v) return 1;
  }
  return 0;
}

inline uint16_t b16_at(const unsigned char* p, int i) {
  uint16_t v;
  std::memcpy(&v, p + 2 * i, 2);
  return v;
}
inline uint32_t pack(uint16_t lo, uint16_t hi) { return (uint32_t)lo | ((uint32_t)hi << 16); }

// ldmatrix.m8n8.x{count}[.trans].b16: lanes 8i..8i+7 give the rows of matrix i.
inline void ldmatrix(uint32_t* r, const void* p, int count, bool trans) {
  const void* addr = p;
  Exchange s = warp_enter(&addr, sizeof(addr));
  int l = lane();
  for (int i = 0; i < count; i++) {
    if (!trans) {
      const unsigned char* row;
      std::memcpy(&row, s.data[8 * i + (l >> 2)], sizeof(row));
      r[i] = pack(b16_at(row, 2 * (l & 3)), b16_at(row, 2 * (l & 3) + 1));
    } else {
      const unsigned char *r0, *r1;
      std::memcpy(&r0, s.data[8 * i + 2 * (l & 3)], sizeof(r0));
      std::memcpy(&r1, s.data[8 * i + 2 * (l & 3) + 1], sizeof(r1));
      r[i] = pack(b16_at(r0, l >> 2), b16_at(r1, l >> 2));
    }
  }
}

inline double bf16_bits(uint32_t reg, int half) {
  return (double)__bfloat162float({(uint16_t)(half ? reg >> 16 : reg & 0xffff)});
}

// mma.sync.m16n8k16.row.col.f32.bf16.bf16.f32: D = A·B + C, each element's sum exact in double.
inline void mma16816(float* c, const uint32_t* a, const uint32_t* b) {
  struct In {
    uint32_t a[4], b[2];
    float c[4];
  } in;
  std::memcpy(in.a, a, 16);
  std::memcpy(in.b, b, 8);
  std::memcpy(in.c, c, 16);
  Exchange s = warp_enter(&in, sizeof(in));
  // The generation that completed this collective: no lane can complete the warp's next one before
  // this lane arrives there.
  unsigned long of = s.slot->in.generation;
  float(*out)[4] = s.slot->mma_d[s.area];
  if (s.slot->mma_of[s.area] == of) {
    std::memcpy(c, out[lane()], 16);
    return;
  }
  double A[16][16], B[16][8], C[16][8];
  for (int l = 0; l < 32; l++) {
    In x;
    std::memcpy(&x, s.data[l], sizeof(x));
    int g = l >> 2, t = l & 3;
    for (int h = 0; h < 2; h++) {
      A[g][2 * t + h] = bf16_bits(x.a[0], h);
      A[g + 8][2 * t + h] = bf16_bits(x.a[1], h);
      A[g][2 * t + 8 + h] = bf16_bits(x.a[2], h);
      A[g + 8][2 * t + 8 + h] = bf16_bits(x.a[3], h);
      B[2 * t + h][g] = bf16_bits(x.b[0], h);
      B[2 * t + 8 + h][g] = bf16_bits(x.b[1], h);
    }
    C[g][2 * t] = x.c[0];
    C[g][2 * t + 1] = x.c[1];
    C[g + 8][2 * t] = x.c[2];
    C[g + 8][2 * t + 1] = x.c[3];
  }
  for (int l = 0; l < 32; l++) {
    int g = l >> 2, t = l & 3;
    int rows[4] = {g, g, g + 8, g + 8}, cols[4] = {2 * t, 2 * t + 1, 2 * t, 2 * t + 1};
    for (int e = 0; e < 4; e++) {
      double acc = C[rows[e]][cols[e]];
      for (int k = 0; k < 16; k++) acc += A[rows[e]][k] * B[k][cols[e]];
      out[l][e] = (float)acc;
    }
  }
  s.slot->mma_of[s.area] = of;
  std::memcpy(c, out[lane()], 16);
}

// A `wgmma` shared-memory descriptor (no swizzle) of `p`, which must lie in the block's dynamic shared
// memory, 16-byte aligned: its offset there, `lbo` and `sbo`, each in 16-byte units in 14 bits.
inline uint64_t wg_desc(const void* p, uint32_t lbo, uint32_t sbo) {
  const std::vector<unsigned char>& dyn = G().dynamic;
  ptrdiff_t off = static_cast<const unsigned char*>(p) - dyn.data();
  if (off < 0 || (size_t)off >= dyn.size() || off % 16)
    fail("a wgmma descriptor of memory outside the dynamic shared memory, or not 16-byte aligned");
  if (off >= (1 << 18) || lbo % 16 || sbo % 16 || lbo >= (1u << 18) || sbo >= (1u << 18))
    fail("a wgmma descriptor field out of its 14 bits");
  return (uint64_t)(off >> 4) | ((uint64_t)(lbo >> 4) << 16) | ((uint64_t)(sbo >> 4) << 32);
}

// wgmma.mma_async.sync.aligned.m64nNk16.f32.bf16.bf16 with A in registers, B through descriptor `desc`
// (`imm-trans-b` = `trans`): this warp's 16 rows of the warpgroup's 64 (A: this warp's m16n8k16
// fragments; D: `mma.sync`'s C layout, n-tile after n-tile), each element's sum exact in double as
// `mma16816`'s. B's element (k, n) lies at `start + (n / 8)·sbo + (k / 8)·lbo` plus, K-major (trans 0),
// `(n % 8)·16 + (k % 8)·2`, or, N-major (trans 1), `(k % 8)·16 + (n % 8)·2` bytes (the PTX ISA's
// canonical layouts without swizzle: core matrices of 8 rows of 16 bytes). Computed at the latest
// moment the hardware may compute it, the `wgmma.wait_group` that must wait for it (`wg_wait`): A, the
// accumulators and B are read then, so a kernel that writes any of them, or reads the accumulators,
// between the issue and that wait gets other results (as it may on a GPU).
inline void wgmma_now(const Mma& m) {
  uint32_t mine[4];
  std::memcpy(mine, m.a, 16);
  Exchange s = warp_enter(mine, sizeof(mine));
  double A[16][16];
  for (int l = 0; l < 32; l++) {
    uint32_t x[4];
    std::memcpy(x, s.data[l], sizeof(x));
    int g = l >> 2, t = l & 3;
    for (int h = 0; h < 2; h++) {
      A[g][2 * t + h] = bf16_bits(x[0], h);
      A[g + 8][2 * t + h] = bf16_bits(x[1], h);
      A[g][2 * t + 8 + h] = bf16_bits(x[2], h);
      A[g + 8][2 * t + 8 + h] = bf16_bits(x[3], h);
    }
  }
  const std::vector<unsigned char>& dyn = G().dynamic;
  uint64_t desc = m.desc;
  size_t start = (size_t)(desc & 0x3fff) << 4, lbo = (size_t)((desc >> 16) & 0x3fff) << 4,
         sbo = (size_t)((desc >> 32) & 0x3fff) << 4;
  auto b = [&](int k, int col) {
    size_t at = start + (size_t)(col / 8) * sbo + (size_t)(k / 8) * lbo +
                (m.trans ? (size_t)(k % 8) * 16 + (size_t)(col % 8) * 2
                         : (size_t)(col % 8) * 16 + (size_t)(k % 8) * 2);
    if (at + 2 > dyn.size()) fail("a wgmma operand past the dynamic shared memory");
    return (double)__bfloat162float({b16_at(dyn.data() + at, 0)});
  };
  int g = lane() >> 2, t = lane() & 3;
  for (int j = 0; j < m.n / 8; j++) {
    for (int e = 0; e < 4; e++) {
      int row = g + 8 * (e >> 1), col = 8 * j + 2 * t + (e & 1);
      double acc = m.d[4 * j + e];
      for (int k = 0; k < 16; k++) acc += A[row][k] * b(k, col);
      m.d[4 * j + e] = (float)acc;
    }
  }
}
inline void wgmma(float* d, int n, const uint32_t* a, uint64_t desc, int trans) {
  if (block_threads() % 128) fail("a warpgroup product in a block that is not whole warpgroups");
  if (desc >> 62) fail("a swizzled wgmma descriptor");
  me().mma_open.push_back({d, n, a, desc, trans});
}
inline void wg_commit() {
  me().mma_groups.push_back(std::move(me().mma_open));
  me().mma_open.clear();
}
// Computes every committed group of products but the newest `keep`, oldest first.
inline void wg_wait(size_t keep) {
  if (!me().mma_open.empty()) fail("a warpgroup product waited for before its group was committed");
  auto& gs = me().mma_groups;
  while (gs.size() > keep) {
    std::vector<Mma> grp = std::move(gs.front());
    gs.erase(gs.begin());
    for (const Mma& m : grp) wgmma_now(m);
  }
}

// Whether each cp.async copy lands as it is issued instead of at the wait that must wait for it.
inline bool emu_copies_land_early = false;
// Whether each warp of a block runs on until it waits at a block barrier (or ends) before the next warp
// runs, instead of every thread in turn from one synchronisation point to the next: with copies landing
// early, what one warp copies into shared memory before a barrier is there when the others read it
// before that barrier.
inline bool emu_warps_run_ahead = false;

inline void land(const Copy& c) {
  if (c.bytes == 16)
    std::memcpy(c.dst, c.src, 16);
  else
    std::memset(c.dst, 0, 16);
}

inline void cp_async16(void* dst, const void* src, int bytes) {
  if (emu_copies_land_early)
    land({dst, src, bytes});
  else
    me().open.push_back({dst, src, bytes});
}
inline void cp_async_commit() {
  me().groups.push_back(std::move(me().open));
  me().open.clear();
}
// Lands every committed group but the newest `keep`.
inline void cp_async_wait(size_t keep) {
  auto& gs = me().groups;
  while (gs.size() > keep) {
    for (const Copy& c : gs.front()) land(c);
    gs.erase(gs.begin());
  }
}

// A fiber's first instructions: the kernel, then back to the scheduler for good.
extern "C" inline void emu_fiber_start() {
  G().body();
  me().done = true;
  G().finished++;
  G().progress++;
  yield();
  fail("a finished thread was resumed");
}

// Runs threads `lo` to `hi` (not those that ended) in turn, each until it yields. Returns whether all
// of them have ended, and whether each has ended or waits.
inline std::pair<bool, bool> run_round(int lo, int hi) {
  Grid& g = G();
  g.round_end = hi;
  g.round_all_done = g.round_all_waiting = true;
  for (int i = lo; i < hi; i++) {
    Fiber& f = g.fibers[i];
    if (f.done) continue;
    g.current = &f;
    emu_switch(&g.sched, f.sp);  // back here after the round's last turn
    break;
  }
  return {g.round_all_done, g.round_all_waiting};
}

// A thread's stack, in bytes.
constexpr size_t kStack = 256 * 1024;

// Runs `body` (a kernel call) over `grid` × `block` threads, blocks in `order` (every block once; empty:
// in order), with `dynamic` bytes of dynamic shared memory.
inline void launch(dim3 grid, dim3 block, size_t dynamic, const std::function<void()>& body,
                   std::vector<dim3> order = {}) {
  Grid& g = G();
  g.grid = grid;
  g.block = block;
  g.body = body;
  g.dynamic.assign(dynamic + 16, 0);
  int n = block_threads();
  if (n < 1 || n > 1024) fail("a block of more than 1024 threads");
  if (order.empty())
    for (unsigned z = 0; z < grid.z; z++)
      for (unsigned y = 0; y < grid.y; y++)
        for (unsigned x = 0; x < grid.x; x++) order.push_back({x, y, z});
  if (g.fibers.size() < (size_t)n) g.fibers.resize(n);
  g.warps.assign((n + 31) / 32, WarpSlot{});
  for (int i = 0; i < n; i++)
    if (!g.fibers[i].stack) g.fibers[i].stack.reset(new char[kStack]);
  for (const dim3& b : order) {
    g.block_idx = b;
    g.block_barrier = Barrier{};
    g.finished = 0;
    // Dynamic shared memory starts as NaNs (0xff bytes): a read of what no thread wrote shows.
    std::memset(g.dynamic.data(), 0xff, g.dynamic.size());
    for (int i = 0; i < n; i++) {
      Fiber& f = g.fibers[i];
      f.linear = i;
      f.tid = {(unsigned)(i % block.x), (unsigned)(i / block.x % block.y), (unsigned)(i / (block.x * block.y))};
      f.done = f.waiting = false;
      f.collectives = 0;
      f.groups.clear();
      f.open.clear();
      f.mma_groups.clear();
      f.mma_open.clear();
      // The stack as `emu_switch` leaves it: six saved registers, then the address it returns to (the
      // start), then a return address for the start itself, 16-byte aligned as after a call.
      uintptr_t top = ((uintptr_t)(f.stack.get() + kStack)) & ~(uintptr_t)15;
      void** sp = (void**)top;
      *--sp = nullptr;
      *--sp = (void*)&emu_fiber_start;
      for (int r = 0; r < 6; r++) *--sp = nullptr;
      f.sp = sp;
    }
    for (;;) {
      unsigned long before = g.progress;
      if (emu_warps_run_ahead) {
        // Each warp in turn, until none of its threads can go on (all at a block barrier, or done).
        for (int w = 0; w < (n + 31) / 32; w++) {
          for (;;) {
            unsigned long warp_before = g.progress;
            bool stuck = run_round(32 * w, std::min(n, 32 * w + 32)).second;
            if (stuck && g.progress == warp_before) break;
          }
        }
      }
      auto [all_done, all_waiting] = run_round(0, n);
      if (all_done) break;
      if (all_waiting && g.progress == before) fail("threads wait at a barrier or collective that others never reach");
    }
    // (A committed group of no copies may stay: the kernel's last wait leaves the newest group.)
    for (int i = 0; i < n; i++) {
      const Fiber& f = g.fibers[i];
      bool pending = !f.open.empty();
      for (auto& grp : f.groups) pending |= !grp.empty();
      if (pending) fail("a thread ended with cp.async copies never waited for");
      if (!f.mma_open.empty() || !f.mma_groups.empty())
        fail("a thread ended with warpgroup products never waited for");
    }
  }
  g.current = nullptr;
}

}  // namespace emu

// The built-in variables, as the running fiber sees them.
#define threadIdx (emu::me().tid)
#define blockIdx (emu::G().block_idx)
#define blockDim (emu::G().block)
#define gridDim (emu::G().grid)
inline void __syncthreads() { emu::syncthreads(); }
template <typename T> inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask) {
  return emu::shfl_xor(mask, v, lane_mask);
}
inline int __any_sync(unsigned mask, int pred) { return emu::any_sync(mask, pred); }
// The kernels' dynamic shared memory (`KURA_DYNAMIC_SHARED`).
#define KURA_EMU_DYNAMIC(name) unsigned char* name = emu::G().dynamic.data()
