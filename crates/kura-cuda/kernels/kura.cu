// Kura's CUDA kernels: everything of a Llama-family forward step but the weight products (cuBLAS, and
// `gemv_*` for decode batches of at most 8 tokens). Compiled at run time by NVRTC, once per device,
// and cached on disk (`kernels.rs`). Every kernel is `extern "C"` so that the host finds it by name.
//
// The KV pool is one device buffer of blocks; a block holds, for every layer, K then V, each
// `[kv_head][slot][head_dim]`: for bf16 and f32, byte for byte what the CPU pool's `export_block` writes;
// a block moves to and from the lower tiers with one copy.
//
// The residual stream is f32; the inputs of the weight products are bf16; products accumulate in f32.
//
// KV elements are bf16, f32, or fp8: e4m3 bytes with one f16 scale per 64 elements of a row (the KV
// type `unsigned char`). An fp8 region of (block, layer, kind, head) holds the block's payload rows
// (`head_dim` bytes each) and then their scale rows (`head_dim / 64` halves each): as many bytes per
// block as the CPU's fp8 layout, but not its bytes (the CPU rotates groups and keeps each vector's scales
// beside it; here payload rows stay 16-byte aligned). The KV fingerprint names the executor, so the
// tiers never give one's blocks to the other.

#ifndef KURA_EMU  // `emu/emu.h` runs these kernels on the CPU in tests, and stands for these headers
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#endif

typedef __nv_bfloat16 bf16;
typedef unsigned int u32;
typedef unsigned long long u64;

#define KURA_NEG_INF (-1.0e30f)

// A kernel's dynamic shared memory, as bytes named `name`.
#ifndef KURA_EMU
#define KURA_DYNAMIC_SHARED(name) extern __shared__ __align__(16) unsigned char name[]
#else
#define KURA_DYNAMIC_SHARED(name) KURA_EMU_DYNAMIC(name)
#endif

// Programmatic dependent launch (sm_90): the executor may launch a step's kernels so that each starts
// while the one before it drains. Every such kernel calls `dep_wait()` before it reads what an earlier
// kernel wrote or writes anything (until then it may only read the weights), then `dep_launch()` to let
// the next kernel be scheduled. Both are no-ops on older architectures and in a plain launch.
__device__ __forceinline__ void dep_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void dep_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
}
#define KURA_DEP() \
  dep_wait();      \
  dep_launch()

// Asks L2 for the 128-byte line holding `p` (sm_90; nothing elsewhere, and the emulation has no
// caches). Holds no register and changes no value.
__device__ __forceinline__ void prefetch_l2(const void* p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
#endif
}

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(bf16 x) { return __bfloat162float(x); }
template <typename T> __device__ __forceinline__ T from_f(float x);
template <> __device__ __forceinline__ float from_f<float>(float x) { return x; }
template <> __device__ __forceinline__ bf16 from_f<bf16>(float x) { return __float2bfloat16(x); }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Sum over a block of at most 1024 threads; every thread gets the result. `red` holds 32 floats.
__device__ float block_sum(float v, float* red) {
  int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
  v = warp_sum(v);
  __syncthreads();
  if (lane == 0) red[warp] = v;
  __syncthreads();
  float r = lane < nw ? red[lane] : 0.f;
  return warp_sum(r);
}

// ---------------------------------------------------------------------------------------------------
// Embedding: x[t] = scale · E[tokens[t]] (f32 rows). One block per token.
extern "C" __global__ void embed(const u32* tokens, const bf16* table, float* x, int hidden, float scale) {
  KURA_DEP();
  int t = blockIdx.x;
  const bf16* row = table + (size_t)tokens[t] * hidden;
  float* out = x + (size_t)t * hidden;
  for (int i = threadIdx.x; i < hidden; i += blockDim.x) out[i] = __bfloat162float(row[i]) * scale;
}

// RMSNorm of f32 rows into bf16 (out = x / rms · w), by blocks of NORM_THREADS threads (the executor's
// `NORM_THREADS`: every kernel that calls `row_inv_rms` is launched with exactly these). The sum of
// squares has one fixed order (thread i takes float4s i, i + 256, ..., explicit multiply-adds, then
// the block's sum), so that every kernel that norms a row — `rms_norm`, and the matrix-vector kernels
// that norm their input themselves — gives the same bits. hidden % 4 == 0.
#define NORM_THREADS 256
__device__ __forceinline__ float row_inv_rms(const float* __restrict__ xr, int hidden, float eps, float* red) {
  const float4* x4 = reinterpret_cast<const float4*>(xr);
  float ss = 0.f;
  for (int i = threadIdx.x; i < hidden / 4; i += NORM_THREADS) {
    float4 v = x4[i];
    ss = __fmaf_rn(v.w, v.w, __fmaf_rn(v.z, v.z, __fmaf_rn(v.y, v.y, __fmaf_rn(v.x, v.x, ss))));
  }
  ss = block_sum(ss, red);
  return rsqrtf(__fadd_rn(__fdiv_rn(ss, (float)hidden), eps));
}
// out = xr · inv · w, rounded to bf16 (any thread count: each element on its own).
__device__ __forceinline__ void norm_row(const float* __restrict__ xr, const float* __restrict__ w, float inv,
                                         bf16* __restrict__ out, int hidden) {
  const float4* x4 = reinterpret_cast<const float4*>(xr);
  const float4* w4 = reinterpret_cast<const float4*>(w);
  __nv_bfloat162* o = reinterpret_cast<__nv_bfloat162*>(out);
  for (int i = threadIdx.x; i < hidden / 4; i += blockDim.x) {
    float4 v = x4[i], g = w4[i];
    o[2 * i] = __floats2bfloat162_rn(__fmul_rn(__fmul_rn(v.x, inv), g.x), __fmul_rn(__fmul_rn(v.y, inv), g.y));
    o[2 * i + 1] = __floats2bfloat162_rn(__fmul_rn(__fmul_rn(v.z, inv), g.z), __fmul_rn(__fmul_rn(v.w, inv), g.w));
  }
}

// RMSNorm of f32 rows into bf16: out[r] = x[rows[r]] / rms · w (rows == null: row r is x's row r). One
// block of NORM_THREADS per output row.
extern "C" __global__ void __launch_bounds__(NORM_THREADS) rms_norm(const float* __restrict__ x,
                                                                    const int* __restrict__ rows,
                                                                    const float* __restrict__ w,
                                                                    bf16* __restrict__ out, int hidden, float eps) {
  // The norm's weights depend on no earlier kernel: while the kernel before drains (a dependent
  // launch), ask L2 for them, a 128-byte line a thread (a decode token's weights stream through L2
  // between one use of a norm's weights and the next, so they come from memory, about a microsecond).
  for (int i = threadIdx.x * 32; i < hidden; i += NORM_THREADS * 32) prefetch_l2(w + i);
  KURA_DEP();
  __shared__ float red[32];
  int r = blockIdx.x;
  const float* xr = x + (size_t)(rows ? rows[r] : r) * hidden;
  float inv = row_inv_rms(xr, hidden, eps, red);
  norm_row(xr, w, inv, out + (size_t)r * hidden, hidden);
}

// SiLU(g) · u, explicit operations: `silu_mul` and the fused FFN kernel give the same bits.
__device__ __forceinline__ float silu_times(float g, float u) {
  return __fmul_rn(__fdiv_rn(g, __fadd_rn(1.f, expf(-g))), u);
}

// out[t] = SiLU(gate[t]) · up[t] into bf16, where a token's row of `gu` is [gate | up]; four columns a
// thread (inter % 4 == 0).
extern "C" __global__ void silu_mul(const float* __restrict__ gu, bf16* __restrict__ out, int inter, int total) {
  KURA_DEP();
  int i = (blockIdx.x * blockDim.x + threadIdx.x) * 4;
  if (i >= total) return;
  int t = i / inter, c = i - t * inter;
  float4 g = *reinterpret_cast<const float4*>(gu + (size_t)t * 2 * inter + c);
  float4 u = *reinterpret_cast<const float4*>(gu + (size_t)t * 2 * inter + inter + c);
  __nv_bfloat162* o = reinterpret_cast<__nv_bfloat162*>(out + i);
  o[0] = __floats2bfloat162_rn(silu_times(g.x, u.x), silu_times(g.y, u.y));
  o[1] = __floats2bfloat162_rn(silu_times(g.z, u.z), silu_times(g.w, u.w));
}

// ---------------------------------------------------------------------------------------------------
// Where a token's K/V lives: element offset of (block, layer, kind 0=K/1=V, head, slot) in the pool.
struct PoolShape {
  int layers, kv_heads, block_size, head_dim;
};
__device__ __forceinline__ size_t pool_at(const PoolShape& p, int block, int layer, int kind, int head, int slot) {
  return ((((size_t)block * p.layers + layer) * 2 + kind) * p.kv_heads + head) * (size_t)p.block_size * p.head_dim +
         (size_t)slot * p.head_dim;
}

// fp8 KV: bytes of one stored row (payload and scales), and byte offsets of a slot's payload and scales.
__device__ __forceinline__ int fp8_row_bytes(int d) { return d + (d / 64) * 2; }
__device__ __forceinline__ size_t fp8_region(const PoolShape& p, int block, int layer, int kind, int head) {
  return ((((size_t)block * p.layers + layer) * 2 + kind) * p.kv_heads + head) * (size_t)p.block_size *
         fp8_row_bytes(p.head_dim);
}

template <class A, class B> struct same_type { static constexpr bool value = false; };
template <class A> struct same_type<A, A> { static constexpr bool value = true; };

// Where a K row (kind 0) starts, and its scales (fp8 only; 0 otherwise), in the pool's elements; V's are
// `kind_stride` further.
template <typename KV> struct KvAddr {
  static __device__ __forceinline__ size_t row(const PoolShape& p, int block, int layer, int head, int slot) {
    return pool_at(p, block, layer, 0, head, slot);
  }
  static __device__ __forceinline__ size_t scales(const PoolShape& p, int block, int layer, int head, int slot) {
    return 0;
  }
  static __device__ __forceinline__ size_t kind_stride(const PoolShape& p) {
    return (size_t)p.kv_heads * p.block_size * p.head_dim;
  }
};
template <> struct KvAddr<unsigned char> {
  static __device__ __forceinline__ size_t row(const PoolShape& p, int block, int layer, int head, int slot) {
    return fp8_region(p, block, layer, 0, head) + (size_t)slot * p.head_dim;
  }
  static __device__ __forceinline__ size_t scales(const PoolShape& p, int block, int layer, int head, int slot) {
    return fp8_region(p, block, layer, 0, head) + (size_t)p.block_size * p.head_dim + (size_t)slot * (p.head_dim / 64) * 2;
  }
  static __device__ __forceinline__ size_t kind_stride(const PoolShape& p) {
    return (size_t)p.kv_heads * p.block_size * fp8_row_bytes(p.head_dim);
  }
};

// RoPE angles of each new token, once per step for every layer: cs[t][j] = cos(pos[t] · inv_freq[j]),
// sn likewise (the angle an f32 product, as the CPU runtime computes it).
extern "C" __global__ void rope_table(const int* pos, const float* inv_freq, float* cs, float* sn, int half,
                                      int total) {
  KURA_DEP();
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= total) return;
  int t = i / half, j = i - t * half;
  float ang = (float)pos[t] * inv_freq[j];
  float s, c;
  sincosf(ang, &s, &c);
  cs[i] = c;
  sn[i] = s;
}

// Bias and RoPE of one item of token t's row of qkv: a rotated pair of q (into q, bf16, `[t][head][d]`)
// or of K, or one element of V. K's pair goes to `put_k(kv_head, a, b, y0, y1)`, V's element to
// `put_v(kv_head, j, v)`. An item is thread blockIdx.y · blockDim.x + threadIdx.x of block (t, chunk of
// 256 items). `style` 0 rotates (i, i + d/2) (HF), 1 rotates (2i, 2i+1).
template <typename PutK, typename PutV>
__device__ __forceinline__ void rope_item(const float* row, const float* __restrict__ bias,
                                          const float* __restrict__ cs, const float* __restrict__ sn,
                                          bf16* __restrict__ q, int t, PoolShape p, int heads, int style,
                                          PutK put_k, PutV put_v) {
  int d = p.head_dim, half = d / 2;
  int qd = heads * d, kvd = p.kv_heads * d;
  int pairs = (heads + p.kv_heads) * half;
  int i = blockIdx.y * blockDim.x + threadIdx.x;
  if (i >= pairs + kvd) return;
  if (i < pairs) {
    int head = i / half, j = i - head * half;
    int a = style == 0 ? j : 2 * j, b = style == 0 ? j + half : 2 * j + 1;
    int base = head * d;  // heads of q, then heads of k, in the row
    float x0 = row[base + a], x1 = row[base + b];
    if (bias) { x0 += bias[base + a]; x1 += bias[base + b]; }
    float c = cs[t * half + j], s = sn[t * half + j];
    float y0 = x0 * c - x1 * s, y1 = x1 * c + x0 * s;
    if (head < heads) {
      bf16* qo = q + (size_t)t * qd + base;
      qo[a] = __float2bfloat16(y0);
      qo[b] = __float2bfloat16(y1);
    } else {
      put_k(head - heads, a, b, y0, y1);
    }
  } else {
    int e = i - pairs, head = e / d;
    float v = row[qd + kvd + e];
    if (bias) v += bias[qd + kvd + e];
    put_v(head, e - head * d, v);
  }
}

// Bias, RoPE and the KV write of each new token: q for attention, K and V into their slot of `layer`.
template <typename KV>
__device__ void rope_store(const float* __restrict__ qkv, const float* __restrict__ bias, const float* __restrict__ cs,
                           const float* __restrict__ sn, const int* __restrict__ slot_block, bf16* __restrict__ q,
                           KV* __restrict__ pool, PoolShape p, int layer, int heads, int style) {
  KURA_DEP();
  int t = blockIdx.x;
  const float* row = qkv + (size_t)t * (heads + 2 * p.kv_heads) * p.head_dim;
  int block = slot_block[2 * t], slot = slot_block[2 * t + 1];
  rope_item(
      row, bias, cs, sn, q, t, p, heads, style,
      [&](int head, int a, int b, float y0, float y1) {
        KV* ko = pool + pool_at(p, block, layer, 0, head, slot);
        ko[a] = from_f<KV>(y0);
        ko[b] = from_f<KV>(y1);
      },
      [&](int head, int j, float v) { pool[pool_at(p, block, layer, 1, head, slot) + j] = from_f<KV>(v); });
}
extern "C" __global__ void rope_store_bf16(const float* qkv, const float* bias, const float* cs, const float* sn,
                                           const int* sb, bf16* q, bf16* pool, PoolShape p, int layer, int heads,
                                           int style) {
  rope_store<bf16>(qkv, bias, cs, sn, sb, q, pool, p, layer, heads, style);
}
extern "C" __global__ void rope_store_f32(const float* qkv, const float* bias, const float* cs, const float* sn,
                                          const int* sb, bf16* q, float* pool, PoolShape p, int layer, int heads,
                                          int style) {
  rope_store<float>(qkv, bias, cs, sn, sb, q, pool, p, layer, heads, style);
}

// fp8 KV, first half: bias and RoPE as `rope_store`, q into `q`, but K (rotated) and V (with its bias)
// written back into their place in `qkv` (f32), where `quant_store_fp8` reads whole rows to scale them.
// Each item reads and writes only its own elements.
extern "C" __global__ void rope_kv_inplace(float* qkv, const float* __restrict__ bias, const float* __restrict__ cs,
                                           const float* __restrict__ sn, bf16* __restrict__ q, PoolShape p, int heads,
                                           int style) {
  KURA_DEP();
  int t = blockIdx.x, d = p.head_dim, kvd = p.kv_heads * d;
  float* row = qkv + (size_t)t * (heads * d + 2 * kvd);
  float* k = row + heads * d;
  float* v = k + kvd;
  rope_item(
      row, bias, cs, sn, q, t, p, heads, style,
      [&](int head, int a, int b, float y0, float y1) {
        k[head * d + a] = y0;
        k[head * d + b] = y1;
      },
      [&](int head, int j, float x) { v[head * d + j] = x; });
}

// fp8 KV, second half: each new token's K and V rows (from `qkv`, after `rope_kv_inplace`) as e4m3
// with one f16 scale per 64 elements (the group's largest magnitude over 448, as the CPU's fp8 format
// scales; rounded to nearest even, saturating). Block (token, kind · kv_heads + head), head_dim / 2
// threads: a warp is one group of 64, two elements a thread.
extern "C" __global__ void quant_store_fp8(const float* __restrict__ qkv, const int* __restrict__ slot_block,
                                           unsigned char* __restrict__ pool, PoolShape p, int layer, int heads) {
  KURA_DEP();
  int t = blockIdx.x, kind = blockIdx.y / p.kv_heads, head = blockIdx.y % p.kv_heads;
  int d = p.head_dim, qd = heads * d, kvd = p.kv_heads * d;
  int e = 2 * threadIdx.x, group = e / 64;
  const float* src = qkv + (size_t)t * (qd + 2 * kvd) + qd + kind * kvd + head * d;
  float x0 = src[e], x1 = src[e + 1];
  float amax = warp_max(fmaxf(fabsf(x0), fabsf(x1)));
  float scale = amax / 448.f;
  scale = isfinite(scale) ? fminf(scale, 65504.f) : 0.f;
  __half sh = __float2half_rn(scale);
  float sf = __half2float(sh), inv = sf > 0.f ? 1.f / sf : 0.f;
  int block = slot_block[2 * t], slot = slot_block[2 * t + 1];
  size_t region = fp8_region(p, block, layer, kind, head);
  unsigned char* payload = pool + region + (size_t)slot * d;
  payload[e] = __nv_cvt_float_to_fp8(x0 * inv, __NV_SATFINITE, __NV_E4M3);
  payload[e + 1] = __nv_cvt_float_to_fp8(x1 * inv, __NV_SATFINITE, __NV_E4M3);
  if ((threadIdx.x & 31) == 0) {
    __half* scales = reinterpret_cast<__half*>(pool + region + (size_t)p.block_size * d + (size_t)slot * (d / 64) * 2);
    scales[group] = sh;
  }
}

// ---------------------------------------------------------------------------------------------------
// Attention of few query tokens (decode, short chunks) over paged K/V, split along the keys: block
// (token, kv head, split) scores SPLIT keys for the `group` query heads that share the KV head, and
// writes each head's partial (max, sum, weighted V) for `attn_merge`. 128 threads: one key each for
// the scores, 8 dimensions of one key slot each (D / 8 threads a V row) for the weighted sum.
//
// Per token: `tok_info[4t..]` = (token row in q/out, query position, first table index in `tables`,
// first key position the window keeps).
#define SPLIT 128
// Eight consecutive elements of a K/V row as floats (16-byte loads).
__device__ __forceinline__ void load8(const bf16* p, float* f) {
  uint4 v = *reinterpret_cast<const uint4*>(p);
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int j = 0; j < 4; j++) {
    float2 x = __bfloat1622float2(h[j]);
    f[2 * j] = x.x;
    f[2 * j + 1] = x.y;
  }
}
__device__ __forceinline__ void load8(const float* p, float* f) {
  float4 a = *reinterpret_cast<const float4*>(p), b = *reinterpret_cast<const float4*>(p + 4);
  f[0] = a.x; f[1] = a.y; f[2] = a.z; f[3] = a.w;
  f[4] = b.x; f[5] = b.y; f[6] = b.z; f[7] = b.w;
}
// Eight e4m3 bytes (8-byte load) times their group's scale.
__device__ __forceinline__ void load8_fp8(const unsigned char* p, float scale, float* f) {
  uint2 v = *reinterpret_cast<const uint2*>(p);
  const unsigned int w[2] = {v.x, v.y};
#pragma unroll
  for (int j = 0; j < 4; j++) {
    __half2_raw hr = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)((w[j / 2] >> (16 * (j % 2))) & 0xFFFFu), __NV_E4M3);
    __half2 h = *reinterpret_cast<__half2*>(&hr);
    float2 x = __half22float2(h);
    f[2 * j] = x.x * scale;
    f[2 * j + 1] = x.y * scale;
  }
}
// Eight elements of a K/V row at element `off` (bf16, f32), or at byte `off` with the f16 scale at byte
// `soff` (fp8).
__device__ __forceinline__ void kv_load8(const bf16* pool, size_t off, size_t, float* f) { load8(pool + off, f); }
__device__ __forceinline__ void kv_load8(const float* pool, size_t off, size_t, float* f) { load8(pool + off, f); }
__device__ __forceinline__ void kv_load8(const unsigned char* pool, size_t off, size_t soff, float* f) {
  float scale = __half2float(*reinterpret_cast<const __half*>(pool + soff));
  load8_fp8(pool + off, scale, f);
}

// One dimension of one head's merged output from its `splits` partials at `pp` (each (max, sum,
// weighted V[d])): Σ e^(m_i - m) o_i / Σ e^(m_i - m) l_i. Explicit operations (no contraction left to
// the compiler) and reads past L1 (another block may have written the partials), so that
// `attn_merge` and the merge fused into `attn_split` give the same bits.
__device__ __forceinline__ float merge_dim(const float* pp, int splits, int d, int dim) {
  float m = KURA_NEG_INF;
  for (int s = 0; s < splits; s++) m = fmaxf(m, __ldcg(pp + (size_t)s * (d + 2)));
  float l = 0.f, o = 0.f;
  for (int s = 0; s < splits; s++) {
    const float* x = pp + (size_t)s * (d + 2);
    float w = exp2f(__fsub_rn(__ldcg(x), m));
    l = __fmaf_rn(w, __ldcg(x + 1), l);
    o = __fmaf_rn(w, __ldcg(x + 2 + dim), o);
  }
  return __fdiv_rn(o, l);
}

// The merge fused into `attn_split` (`fuse`): called by every thread of each block once its partials are
// written. The last of a token's blocks for a KV head to arrive (of `gridDim.z`, counted in `arrive`,
// which it sets back to zero for the next launch) merges the splits of the heads that KV head serves into
// `merged`, as `attn_merge` would: one launch a layer fewer, and the merge runs while the other heads'
// blocks still compute.
template <int D>
__device__ void split_arrive(const float* part, const int* tok_info, int* arrive, bf16* merged, int kv_heads,
                             int heads, int max_splits) {
  __shared__ int last;
  int ti = blockIdx.x, kvh = blockIdx.y;
  // Each thread's partials visible to every block before the count says they are written.
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    int* c = arrive + (size_t)ti * kv_heads + kvh;
    last = atomicAdd(c, 1) == (int)gridDim.z - 1;
    if (last) *c = 0;
  }
  __syncthreads();
  if (!last) return;
  __threadfence();
  int group = heads / kv_heads;
  int row = tok_info[4 * ti], qpos = tok_info[4 * ti + 1], lo = tok_info[4 * ti + 3];
  int splits = (qpos + 1 - lo + SPLIT - 1) / SPLIT;
  for (int i = threadIdx.x; i < group * D; i += blockDim.x) {
    int g = i / D, dim = i - g * D, h = kvh * group + g;
    const float* pp = part + ((size_t)ti * heads + h) * max_splits * (D + 2);
    merged[((size_t)row * heads + h) * D + dim] = __float2bfloat16(merge_dim(pp, splits, D, dim));
  }
}

// `fuse` of `attn_split`: the last block of each (token, KV head) merges the splits (`split_arrive`;
// otherwise `attn_merge` does), and each key's K and V rows are asked of L2 before they are read.
#define SPLIT_MERGE 1
#define SPLIT_PREFETCH 2

// G: the most query heads one KV head serves that this instance handles (group ≤ G); `fuse`: the
// SPLIT_* flags.
template <typename KV, int D, int G>
__device__ void attn_split(const bf16* q, const KV* pool, const int* tables, const int* tok_info, float* part,
                           PoolShape p, int layer, int heads, int max_splits, float scale_log2, int* arrive,
                           bf16* merged, int fuse) {
  constexpr int LPK = D / 8;         // threads per key row, 8 dimensions each (16-byte loads)
  constexpr int KPW = 32 / LPK;      // keys a warp covers at once
  constexpr int GC = G < 8 ? G : 8;  // heads per pass of the weighted sum
  KURA_DEP();
  __shared__ __align__(16) float qs[G * D];
  __shared__ float ps[G][SPLIT];
  __shared__ float stat[G][2];
  constexpr bool FP8 = same_type<KV, unsigned char>::value;
  __shared__ size_t kofs[SPLIT];
  __shared__ size_t sofs[FP8 ? SPLIT : 1];
  __shared__ __align__(16) float acc[4][GC][D];
  int ti = blockIdx.x, kvh = blockIdx.y, split = blockIdx.z;
  int row = tok_info[4 * ti], qpos = tok_info[4 * ti + 1], toff = tok_info[4 * ti + 2], lo = tok_info[4 * ti + 3];
  int group = heads / p.kv_heads;
  int k0 = lo + split * SPLIT;
  int n = min(SPLIT, qpos + 1 - k0);
  float* out = part + (((size_t)ti * heads + kvh * group) * max_splits + split) * (D + 2);
  if (n <= 0) {
    // Nothing to attend in this split: a partial that `attn_merge` weighs zero.
    if (threadIdx.x < group) {
      float* o = out + (size_t)threadIdx.x * max_splits * (D + 2);
      o[0] = KURA_NEG_INF;
      o[1] = 0.f;
    }
    if (fuse & SPLIT_MERGE) split_arrive<D>(part, tok_info, arrive, merged, p.kv_heads, heads, max_splits);
    return;
  }
  for (int i = threadIdx.x; i < group * D; i += blockDim.x)
    qs[i] = __bfloat162float(q[(size_t)row * heads * D + (size_t)kvh * group * D + i]);
  __syncthreads();
  int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  // Scores: one key a thread. Each thread reads its whole K row, so every row's loads are in flight at
  // once (a row across 16 threads, summed by shuffles, waited on 16 dependent rounds: slower at batch 1).
  if (tid < n) {
    int kp = k0 + tid;
    int blk = tables[toff + kp / p.block_size], slot = kp % p.block_size;
    size_t kat = KvAddr<KV>::row(p, blk, layer, kvh, slot), sat = KvAddr<KV>::scales(p, blk, layer, kvh, slot);
    kofs[tid] = kat;
    if constexpr (FP8) sofs[tid] = sat;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    if (fuse & SPLIT_PREFETCH) {
      // The rest of this key's K row, and its V row, asked of L2 now: the K loads after the first line
      // and the weighted sum's V loads then wait on L2, not on memory.
      const char* kr = reinterpret_cast<const char*>(pool + kat);
      const char* vr = reinterpret_cast<const char*>(pool + kat + KvAddr<KV>::kind_stride(p));
#pragma unroll
      for (int b = 0; b < D * (int)sizeof(KV); b += 128) {
        if (b > 0) asm volatile("prefetch.global.L2 [%0];" ::"l"(kr + b));
        asm volatile("prefetch.global.L2 [%0];" ::"l"(vr + b));
      }
    }
#endif
    float s[G];
#pragma unroll
    for (int g = 0; g < G; g++) s[g] = 0.f;
#pragma unroll 4
    for (int i = 0; i < D; i += 8) {
      float kf[8];
      kv_load8(pool, kat + i, sat + (i / 64) * 2, kf);
#pragma unroll
      for (int g = 0; g < G; g++) {
        if (g < group) {
          const float4* qv = reinterpret_cast<const float4*>(qs + g * D + i);
          float4 a = qv[0], b = qv[1];
          s[g] += a.x * kf[0] + a.y * kf[1] + a.z * kf[2] + a.w * kf[3] + b.x * kf[4] + b.y * kf[5] + b.z * kf[6] +
                  b.w * kf[7];
        }
      }
    }
#pragma unroll
    for (int g = 0; g < G; g++)
      if (g < group) ps[g][tid] = s[g] * scale_log2;
  }
  int c = (lane % LPK) * 8, kq = lane / LPK;
  const size_t vstride = KvAddr<KV>::kind_stride(p);
  __syncthreads();
  // Max and sum per head: warp w takes heads w, w + 4, ...
  for (int g = warp; g < group; g += 4) {
    float m = KURA_NEG_INF;
    for (int i = lane; i < n; i += 32) m = fmaxf(m, ps[g][i]);
    m = warp_max(m);
    float l = 0.f;
    for (int i = lane; i < n; i += 32) {
      float e = exp2f(ps[g][i] - m);
      ps[g][i] = e;
      l += e;
    }
    l = warp_sum(l);
    if (lane == 0) { stat[g][0] = m; stat[g][1] = l; }
  }
  __syncthreads();
  // Weighted V: thread (key slot, 8 dimensions); a warp takes KPW keys at once, the 4 warps interleave.
  for (int g0 = 0; g0 < group; g0 += GC) {
    float o[GC][8];
#pragma unroll
    for (int g = 0; g < GC; g++)
#pragma unroll
      for (int j = 0; j < 8; j++) o[g][j] = 0.f;
#pragma unroll 4
    for (int i = warp * KPW + kq; i < n; i += 4 * KPW) {
      float v[8];
      size_t so = 0;
      if constexpr (FP8) so = sofs[i] + vstride + (c / 64) * 2;
      kv_load8(pool, kofs[i] + vstride + c, so, v);
#pragma unroll
      for (int g = 0; g < GC; g++) {
        if (g0 + g < group) {
          float w = ps[g0 + g][i];
#pragma unroll
          for (int j = 0; j < 8; j++) o[g][j] += w * v[j];
        }
      }
    }
    // Sum the key slots of a warp (lanes LPK apart), then the 4 warps through shared memory.
#pragma unroll
    for (int g = 0; g < GC; g++)
#pragma unroll
      for (int j = 0; j < 8; j++)
#pragma unroll
        for (int off = LPK; off < 32; off <<= 1) o[g][j] += __shfl_xor_sync(0xffffffffu, o[g][j], off);
    if (lane < LPK) {
#pragma unroll
      for (int g = 0; g < GC; g++)
#pragma unroll
        for (int j = 0; j < 8; j++) acc[warp][g][c + j] = o[g][j];
    }
    __syncthreads();
    for (int i = tid; i < GC * D; i += blockDim.x) {
      int g = i / D, dim = i - g * D;
      if (g0 + g >= group) continue;
      float s = acc[0][g][dim] + acc[1][g][dim] + acc[2][g][dim] + acc[3][g][dim];
      float* o = out + (size_t)(g0 + g) * max_splits * (D + 2);
      o[2 + dim] = s;
      if (dim == 0) { o[0] = stat[g0 + g][0]; o[1] = stat[g0 + g][1]; }
    }
    __syncthreads();
  }
  if (fuse & SPLIT_MERGE) split_arrive<D>(part, tok_info, arrive, merged, p.kv_heads, heads, max_splits);
}

#define ATTN_SPLIT(KVN, KVT, D, G)                                                                           \
  extern "C" __global__ void __launch_bounds__(128, 2) attn_split_##KVN##_##D##_g##G(                            \
      const bf16* q, const KVT* pool, const int* tables, const int* tok_info, float* part, PoolShape p,       \
      int layer, int heads, int max_splits, float scale_log2, int* arrive, bf16* merged, int fuse) {          \
    attn_split<KVT, D, G>(q, pool, tables, tok_info, part, p, layer, heads, max_splits, scale_log2, arrive,   \
                          merged, fuse);                                                                      \
  }
#define ATTN_SPLIT_G(KVN, KVT, D) \
  ATTN_SPLIT(KVN, KVT, D, 1) ATTN_SPLIT(KVN, KVT, D, 2) ATTN_SPLIT(KVN, KVT, D, 4) ATTN_SPLIT(KVN, KVT, D, 8) \
  ATTN_SPLIT(KVN, KVT, D, 16)
ATTN_SPLIT_G(bf16, bf16, 64)
ATTN_SPLIT_G(bf16, bf16, 128)
ATTN_SPLIT_G(f32, float, 64)
ATTN_SPLIT_G(f32, float, 128)
ATTN_SPLIT_G(fp8, unsigned char, 64)
ATTN_SPLIT_G(fp8, unsigned char, 128)

// Merges the splits of `attn_split`: out[row][head] = Σ e^(m_i - m) o_i / Σ e^(m_i - m) l_i. Block
// (token, head), D threads.
extern "C" __global__ void attn_merge(const float* part, const int* tok_info, bf16* out, int heads, int max_splits,
                                      int d) {
  KURA_DEP();
  int ti = blockIdx.x, h = blockIdx.y, dim = threadIdx.x;
  int qpos = tok_info[4 * ti + 1], lo = tok_info[4 * ti + 3];
  int splits = (qpos + 1 - lo + SPLIT - 1) / SPLIT;
  const float* pp = part + ((size_t)ti * heads + h) * max_splits * (d + 2);
  out[((size_t)tok_info[4 * ti] * heads + h) * d + dim] = __float2bfloat16(merge_dim(pp, splits, d, dim));
}

// ---------------------------------------------------------------------------------------------------
// Prefill attention on tensor cores (mma.sync m16n8k16, bf16 in, f32 accumulate), flash style: block
// (tile of 128 query tokens of one sequence, query head), 8 warps of 16 query rows each, over key tiles
// of 64 read from the paged pool into shared memory two tiles deep (cp.async for a bf16 pool: the next
// tile's copy runs under this tile's products). Fragments come from shared memory through ldmatrix (V
// transposed on the way). Per tile: `tile_info[4i..]` = (first token row, rows in the tile, position of
// the first, first table index); the tile's keys end at its last query's position. Dynamic shared
// memory: 2 stages × (K + V) × 64 keys × (D + 8) bf16 (the wide kernel below: NK keys, then 128 query
// rows of D + 8).
#define BR 128
#define BC 64
// Keys a tile of the wide kernel: 32 at a head size of 128, where 64 keys' scores would not fit beside
// two m-tiles' outputs in 255 registers.
#define WIDE_NK(D) ((D) > 64 ? 32 : 64)
__device__ __forceinline__ u32 pack_bf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<u32*>(&v);
}
// The tensor-core and asynchronous-copy instructions (their emulation in `emu/emu.h` for CPU tests).
#ifndef KURA_EMU
__device__ __forceinline__ void mma16816(float* c, const u32* a, const u32* b) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
__device__ __forceinline__ u32 smem_addr(const void* p) { return (u32)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void ldmatrix_x4(u32* r, const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldmatrix_x2(u32* r, const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n" : "=r"(r[0]), "=r"(r[1]) : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(u32* r, const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}
// 16 bytes global → shared, asynchronously; `bytes` 0 writes zeros. The copies and the waits clobber
// memory: `volatile` alone lets the compiler move this thread's own shared-memory loads across them
// (a load of a stage above the wait that completes it, or one of the stage a copy then overwrites
// below the copy), which nothing but a barrier would otherwise keep in order (the GEMV's stages have
// none).
__device__ __forceinline__ void cp_async16(void* dst, const void* src, int bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void cp_async_wait1() { asm volatile("cp.async.wait_group 1;\n" ::: "memory"); }
// Waits until at most the newest N groups of this thread's copies are still on the way.
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }
// 2^x in one instruction, subnormal results flushed to zero (`exp2f` adds a range test and two
// multiplications to keep them): a weight under 2^-126 beside the row's largest, 1, changes nothing.
__device__ __forceinline__ float exp2_ftz(float x) {
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(r) : "f"(x));
  return r;
}
#else
__device__ __forceinline__ float exp2_ftz(float x) { return exp2f(x); }
__device__ __forceinline__ void mma16816(float* c, const u32* a, const u32* b) { emu::mma16816(c, a, b); }
__device__ __forceinline__ void ldmatrix_x4(u32* r, const void* p) { emu::ldmatrix(r, p, 4, false); }
__device__ __forceinline__ void ldmatrix_x2(u32* r, const void* p) { emu::ldmatrix(r, p, 2, false); }
__device__ __forceinline__ void ldmatrix_x4_trans(u32* r, const void* p) { emu::ldmatrix(r, p, 4, true); }
__device__ __forceinline__ void cp_async16(void* dst, const void* src, int bytes) { emu::cp_async16(dst, src, bytes); }
__device__ __forceinline__ void cp_async_commit() { emu::cp_async_commit(); }
__device__ __forceinline__ void cp_async_wait1() { emu::cp_async_wait(1); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { emu::cp_async_wait(N); }
#endif

// Hopper's warpgroup products (`wgmma.mma_async`, sm_90a only: the module is compiled for `sm_90a` on
// compute capability 9.0; their emulation in `emu/emu.h`). A warpgroup (4 consecutive warps, 128
// threads) multiplies its 64 rows of A by a 16 × N tile of B and adds the products to its accumulators.
// A is in registers, each warp's 16 rows (warp w of the group: rows 16w..16w + 15) as an `mma.sync`
// m16n8k16 A fragment; a warp's accumulators are its 16 rows in `mma.sync`'s C layout n-tile after
// n-tile (`d[j][e]`: row g + 8·(e / 2), column 8j + 2·tq + e % 2), so each element is the sum a chain of
// `mma16816` gives over the same k-steps. The tensor cores read B from shared memory through a
// descriptor: B lies there as core matrices of 8 × 8 values, 128 contiguous bytes each (8 rows of 16
// bytes, no swizzle), `lbo` bytes from one to the next along k and `sbo` along N. TRANS 0: a core
// matrix's row holds 8 values of k for one column of B (K-major, as K rows give Kᵀ); TRANS 1: 8 columns
// for one k (N-major, as V rows give V). Issued asynchronously: `wg_fence` orders the registers written
// before (accumulators, A) ahead of the products, `wg_wait` waits for them, and `reg_fence` after it
// keeps the compiler from reading an accumulator, or reusing an A register, before that wait.
#if defined(KURA_EMU) || defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define KURA_WGMMA 1
#endif
#if defined(KURA_WGMMA) && !defined(KURA_EMU)
__device__ __forceinline__ u64 wg_desc(const void* p, u32 lbo, u32 sbo) {
  return (u64)((smem_addr(p) >> 4) & 0x3fff) | ((u64)((lbo >> 4) & 0x3fff) << 16) |
         ((u64)((sbo >> 4) & 0x3fff) << 32);
}
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
// Waits until at most N committed groups of this warpgroup's products are not complete (the oldest
// complete first).
template <int N = 0>
__device__ __forceinline__ void wg_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }
// This thread's writes to shared memory (its landed copies, its stores) made visible to the tensor
// cores' reads, which go through the async proxy.
__device__ __forceinline__ void smem_to_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
__device__ __forceinline__ void reg_fence(float& r) { asm volatile("" : "+f"(r)::"memory"); }
__device__ __forceinline__ void reg_fence(u32& r) { asm volatile("" : "+r"(r)::"memory"); }
#define WG_D4(j) "+f"(d[j][0]), "+f"(d[j][1]), "+f"(d[j][2]), "+f"(d[j][3])
template <int TRANS>
__device__ __forceinline__ void wg_mma(float (&d)[8][4], const u32 (&a)[4], u64 desc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %38, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, "
      "%22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, %37;\n}\n"
      : WG_D4(0), WG_D4(1), WG_D4(2), WG_D4(3), WG_D4(4), WG_D4(5), WG_D4(6), WG_D4(7)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "n"(TRANS), "r"(1));
}
template <int TRANS>
__device__ __forceinline__ void wg_mma(float (&d)[16][4], const u32 (&a)[4], u64 desc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %70, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, "
      "%22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, "
      "%42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, "
      "%62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, %69;\n}\n"
      : WG_D4(0), WG_D4(1), WG_D4(2), WG_D4(3), WG_D4(4), WG_D4(5), WG_D4(6), WG_D4(7), WG_D4(8), WG_D4(9),
        WG_D4(10), WG_D4(11), WG_D4(12), WG_D4(13), WG_D4(14), WG_D4(15)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "n"(TRANS), "r"(1));
}
#undef WG_D4
#elif defined(KURA_EMU)
__device__ __forceinline__ u64 wg_desc(const void* p, u32 lbo, u32 sbo) { return emu::wg_desc(p, lbo, sbo); }
// The emulation computes each product at the wait that must wait for it.
__device__ __forceinline__ void wg_fence() {}
__device__ __forceinline__ void wg_commit() { emu::wg_commit(); }
template <int N = 0>
__device__ __forceinline__ void wg_wait() { emu::wg_wait(N); }
__device__ __forceinline__ void smem_to_async() {}
__device__ __forceinline__ void reg_fence(float&) {}
__device__ __forceinline__ void reg_fence(u32&) {}
template <int TRANS, int N>
__device__ __forceinline__ void wg_mma(float (&d)[N][4], const u32 (&a)[4], u64 desc) {
  emu::wgmma(&d[0][0], 8 * N, a, desc, TRANS);
}
#endif
#ifdef KURA_WGMMA
// `reg_fence` on every register of a fragment array (accumulators, A fragments).
template <typename T, int N>
__device__ __forceinline__ void reg_fences(T (&r)[N][4]) {
#pragma unroll
  for (int i = 0; i < N; i++)
#pragma unroll
    for (int e = 0; e < 4; e++) reg_fence(r[i][e]);
}
#endif

// Where one thread's share of a K/V tile comes from. With NT threads, 16-byte chunk n of a thread is key
// `key0 + n * (NT / (D / 8))` of the tile, columns c..c+7 (the share of `i = tid + n * NT`, key `i / (D /
// 8)`; CM: 8 consecutive threads take 8 consecutive keys of one column, a core matrix of `tile_at`); its
// pool address is the block's (from the table) times `block_stride` plus `base` plus the slot's row, with
// no division where the block size is a power of two.
struct TileSrc {
  size_t block_stride;  // elements from a block to the next (bf16 and f32 pools)
  size_t base;          // pool_at(block 0, layer, K, kvh, slot 0) + c
  size_t kind_stride;   // elements from a K row to its V row
  int key0, c, shift;   // shift: log2 of the block size if it is a power of two, else -1
  int layer, kvh;       // (fp8 pools address rows through KvAddr)
};
template <int D, int NT, bool CM = false>
__device__ __forceinline__ TileSrc tile_src(const PoolShape& p, int layer, int kvh) {
  TileSrc t;
  if (CM) {
    t.key0 = (threadIdx.x & 7) + 8 * ((int)threadIdx.x / D);
    t.c = (((int)threadIdx.x >> 3) % (D / 8)) * 8;
  } else {
    t.key0 = threadIdx.x / (D / 8);
    t.c = (threadIdx.x % (D / 8)) * 8;
  }
  int bs = p.block_size, shift = 0;
  while ((1 << shift) < bs) shift++;
  t.shift = (1 << shift) == bs ? shift : -1;
  t.block_stride = (size_t)p.layers * 2 * p.kv_heads * bs * D;
  t.base = pool_at(p, 0, layer, 0, kvh, 0) + t.c;
  t.kind_stride = (size_t)p.kv_heads * bs * D;
  t.layer = layer;
  t.kvh = kvh;
  return t;
}
// Block (table index) and slot of position kp.
__device__ __forceinline__ void tile_pos(const TileSrc& t, const PoolShape& p, int kp, int& blk, int& slot) {
  if (t.shift >= 0) {
    blk = kp >> t.shift;
    slot = kp & ((1 << t.shift) - 1);
  } else {
    blk = kp / p.block_size;
    slot = kp - blk * p.block_size;
  }
}
// Where this thread's chunk of position kp's K row starts in a bf16 or f32 pool (its V row is
// `kind_stride` further).
template <int D>
__device__ __forceinline__ size_t tile_row(const TileSrc& t, const PoolShape& p, const int* tables, int toff,
                                           int kp) {
  int blk, slot;
  tile_pos(t, p, kp, blk, slot);
  return (size_t)tables[toff + blk] * t.block_stride + t.base + (size_t)slot * D;
}

// The A fragment of P for k-step kk (keys 16kk..16kk + 15): the scores of two adjacent 8-key n-tiles, as
// their C fragments hold them, rounded to bf16.
template <int NT8>
__device__ __forceinline__ void p_frag(const float (&s)[NT8][4], int kk, u32 (&a)[4]) {
  a[0] = pack_bf16(s[2 * kk][0], s[2 * kk][1]);
  a[1] = pack_bf16(s[2 * kk][2], s[2 * kk][3]);
  a[2] = pack_bf16(s[2 * kk + 1][0], s[2 * kk + 1][1]);
  a[3] = pack_bf16(s[2 * kk + 1][2], s[2 * kk + 1][3]);
}

// Where chunk (key, c..c + 7) of a K or V tile lies in its stage, in elements: in rows of D + 8 (read
// through ldmatrix without bank conflicts), or (CM, for the warpgroup products) in core matrices of 8
// keys × 8 columns, 64 contiguous elements each, one key group's D / 8 of them after another's; 8
// threads writing one core matrix write 128 contiguous bytes.
template <int D, bool CM>
__device__ __forceinline__ int tile_at(int key, int c) {
  return CM ? ((key >> 3) * (D / 8) + (c >> 3)) * 64 + (key & 7) * 8 : key * (D + 8) + c;
}

// K and V rows of keys kt..kt+NK (past `last`: zeros) into one stage, this thread's chunks of 8 elements.
template <int D, int NK, int NT, bool CM = false>
__device__ __forceinline__ void load_tile(bf16* ks, bf16* vs, const bf16* pool, const int* tables, const PoolShape& p,
                                          const TileSrc& t, int toff, int kt, int last) {
  constexpr int STEP = NT / (D / 8);
  static_assert(NT % (D / 8) == 0 && NK % STEP == 0, "a tile is whole chunks of every thread");
  static_assert(!CM || (NT % D == 0 && NK % 8 == 0), "CM: whole core matrices of 8 threads");
#pragma unroll
  for (int n = 0; n < NK / STEP; n++) {
    int key = t.key0 + n * STEP, kp = kt + key;
    bool ok = kp <= last;
    size_t at = 0;
    if (ok) at = tile_row<D>(t, p, tables, toff, kp);
    cp_async16(ks + tile_at<D, CM>(key, t.c), pool + at, ok ? 16 : 0);
    cp_async16(vs + tile_at<D, CM>(key, t.c), pool + at + t.kind_stride, ok ? 16 : 0);
  }
}
template <int D, int NK, int NT, bool CM = false>
__device__ __forceinline__ void load_tile(bf16* ks, bf16* vs, const float* pool, const int* tables,
                                          const PoolShape& p, const TileSrc& t, int toff, int kt, int last) {
  constexpr int STEP = NT / (D / 8);
  static_assert(NT % (D / 8) == 0 && NK % STEP == 0, "a tile is whole chunks of every thread");
  static_assert(!CM || (NT % D == 0 && NK % 8 == 0), "CM: whole core matrices of 8 threads");
#pragma unroll
  for (int n = 0; n < NK / STEP; n++) {
    int key = t.key0 + n * STEP, kp = kt + key;
    float kf[8], vf[8];
    if (kp <= last) {
      size_t at = tile_row<D>(t, p, tables, toff, kp);
      load8(pool + at, kf);
      load8(pool + at + t.kind_stride, vf);
    } else {
#pragma unroll
      for (int j = 0; j < 8; j++) kf[j] = vf[j] = 0.f;
    }
    uint4 kw, vw;
    kw.x = pack_bf16(kf[0], kf[1]); kw.y = pack_bf16(kf[2], kf[3]);
    kw.z = pack_bf16(kf[4], kf[5]); kw.w = pack_bf16(kf[6], kf[7]);
    vw.x = pack_bf16(vf[0], vf[1]); vw.y = pack_bf16(vf[2], vf[3]);
    vw.z = pack_bf16(vf[4], vf[5]); vw.w = pack_bf16(vf[6], vf[7]);
    *reinterpret_cast<uint4*>(ks + tile_at<D, CM>(key, t.c)) = kw;
    *reinterpret_cast<uint4*>(vs + tile_at<D, CM>(key, t.c)) = vw;
  }
}

template <int D, int NK, int NT, bool CM = false>
__device__ __forceinline__ void load_tile(bf16* ks, bf16* vs, const unsigned char* pool, const int* tables,
                                          const PoolShape& p, const TileSrc& t, int toff, int kt, int last) {
  constexpr int STEP = NT / (D / 8);
  static_assert(NT % (D / 8) == 0 && NK % STEP == 0, "a tile is whole chunks of every thread");
  static_assert(!CM || (NT % D == 0 && NK % 8 == 0), "CM: whole core matrices of 8 threads");
  const size_t vstride = KvAddr<unsigned char>::kind_stride(p);
#pragma unroll
  for (int n = 0; n < NK / STEP; n++) {
    int key = t.key0 + n * STEP, kp = kt + key;
    float kf[8], vf[8];
    if (kp <= last) {
      int blk, slot;
      tile_pos(t, p, kp, blk, slot);
      blk = tables[toff + blk];
      size_t at = KvAddr<unsigned char>::row(p, blk, t.layer, t.kvh, slot) + t.c;
      size_t sat = KvAddr<unsigned char>::scales(p, blk, t.layer, t.kvh, slot) + (t.c / 64) * 2;
      kv_load8(pool, at, sat, kf);
      kv_load8(pool, at + vstride, sat + vstride, vf);
    } else {
#pragma unroll
      for (int j = 0; j < 8; j++) kf[j] = vf[j] = 0.f;
    }
    uint4 kw, vw;
    kw.x = pack_bf16(kf[0], kf[1]); kw.y = pack_bf16(kf[2], kf[3]);
    kw.z = pack_bf16(kf[4], kf[5]); kw.w = pack_bf16(kf[6], kf[7]);
    vw.x = pack_bf16(vf[0], vf[1]); vw.y = pack_bf16(vf[2], vf[3]);
    vw.z = pack_bf16(vf[4], vf[5]); vw.w = pack_bf16(vf[6], vf[7]);
    *reinterpret_cast<uint4*>(ks + tile_at<D, CM>(key, t.c)) = kw;
    *reinterpret_cast<uint4*>(vs + tile_at<D, CM>(key, t.c)) = vw;
  }
}

// Mask (causal, window, past the keys) and the online softmax of a warp's rows g and g + 8 (positions
// `qp0` and `qp0 + 8`) over the scores `s` of the key tile from `kt`, as `mma.sync`'s C fragments leave
// them: `s` becomes the weights P, the rows' running maxima `m0`, `m1` and sums `l0`, `l1` move on, and
// `c0` and `c1` are what the rows' outputs are to be multiplied by. A tile `whole` (every row of the
// warp sees all its keys) needs no mask, and its scores are all finite: it takes a path without either
// test (the same operations on every score it keeps).
template <int NK>
__device__ __forceinline__ void online_softmax(float (&s)[NK / 8][4], int kt, bool whole, int qp0, int window,
                                               float scale_log2, int tq, float& m0, float& m1, float& l0, float& l1,
                                               float& c0, float& c1) {
  int qp1 = qp0 + 8;
  float mx0 = m0, mx1 = m1;
  if (whole) {
#pragma unroll
    for (int nt = 0; nt < NK / 8; nt++) {
#pragma unroll
      for (int e = 0; e < 4; e++) {
        float v = __fmul_rn(s[nt][e], scale_log2);  // never fused into the exponent's FMA
        s[nt][e] = v;
        if (e < 2) mx0 = fmaxf(mx0, v); else mx1 = fmaxf(mx1, v);
      }
    }
  } else {
#pragma unroll
    for (int nt = 0; nt < NK / 8; nt++) {
#pragma unroll
      for (int e = 0; e < 4; e++) {
        int key = kt + nt * 8 + 2 * tq + (e & 1);
        int qp = e < 2 ? qp0 : qp1;
        bool ok = key <= qp && (window <= 0 || key > qp - window);
        float v = ok ? __fmul_rn(s[nt][e], scale_log2) : KURA_NEG_INF;
        s[nt][e] = v;
        if (e < 2) mx0 = fmaxf(mx0, v); else mx1 = fmaxf(mx1, v);
      }
    }
  }
  mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
  mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
  mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
  mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
  c0 = exp2_ftz(m0 - mx0);
  c1 = exp2_ftz(m1 - mx1);
  m0 = mx0;
  m1 = mx1;
  float rs0 = 0.f, rs1 = 0.f;
  if (whole) {
#pragma unroll
    for (int nt = 0; nt < NK / 8; nt++) {
      s[nt][0] = exp2_ftz(s[nt][0] - mx0);
      s[nt][1] = exp2_ftz(s[nt][1] - mx0);
      s[nt][2] = exp2_ftz(s[nt][2] - mx1);
      s[nt][3] = exp2_ftz(s[nt][3] - mx1);
      rs0 += s[nt][0] + s[nt][1];
      rs1 += s[nt][2] + s[nt][3];
    }
  } else {
#pragma unroll
    for (int nt = 0; nt < NK / 8; nt++) {
      // A fully masked row keeps m = -1e30: its weights are zero, not exp2(0).
      s[nt][0] = s[nt][0] <= KURA_NEG_INF ? 0.f : exp2_ftz(s[nt][0] - mx0);
      s[nt][1] = s[nt][1] <= KURA_NEG_INF ? 0.f : exp2_ftz(s[nt][1] - mx0);
      s[nt][2] = s[nt][2] <= KURA_NEG_INF ? 0.f : exp2_ftz(s[nt][2] - mx1);
      s[nt][3] = s[nt][3] <= KURA_NEG_INF ? 0.f : exp2_ftz(s[nt][3] - mx1);
      rs0 += s[nt][0] + s[nt][1];
      rs1 += s[nt][2] + s[nt][3];
    }
  }
  l0 = l0 * c0 + rs0;
  l1 = l1 * c1 + rs1;
}

// A warp's outputs of rows g and g + 8 multiplied by their factors, only where a row's maximum rose
// (otherwise both factors are exactly 1).
template <int D>
__device__ __forceinline__ void rescale_rows(float (&o)[D / 8][4], float c0, float c1) {
  if (__any_sync(0xffffffffu, c0 != 1.f || c1 != 1.f)) {
#pragma unroll
    for (int i = 0; i < D / 8; i++) {
      o[i][0] *= c0; o[i][1] *= c0;
      o[i][2] *= c1; o[i][3] *= c1;
    }
  }
}

// MT: m-tiles of 16 query rows a warp. MT 1: 8 warps, each warp's Q fragments in registers. MT 2 ("wide"):
// 4 warps of 32 rows, Q in shared memory (`2 stages` are followed by the tile's 128 query rows, D + 8
// bf16 each), read once per key tile: each K and V fragment a warp reads from shared memory serves two
// m-tiles, half the shared-memory reads per product. NK: keys a tile. With the same NK both give the same
// bits: every score and output element is summed in the same order (k-steps, key tiles and key steps
// ascending), and a warp's rows that a tile does not reach add exact zeros. HALVES 2 ("half"): a block
// takes half a tile, 64 rows of 4 warps (MT 1), the later half first; each warp computes what it would
// in the 8-warp kernel (the same key tiles in the same order), so the bits are that kernel's, and two
// blocks share a multiprocessor, where the 8-warp kernel's one block has all its warps meet at every
// key tile.
//
// STAGES 3 ("deep"): three stages of K and V, and one barrier a key tile instead of two. Tile j + 2's
// copy is issued right after tile j's barrier, into the stage tile j - 1 was read from (every thread
// has passed that barrier, so none still reads it), and it has two tiles' products to land instead of
// one. The same operations in the same order as with two stages: the same bits.
//
// WG 1 ("wg"): the two products of a key tile on Hopper's warpgroup instructions, each issued and
// waited for in turn. WG 2 ("wgpipe", with three stages): tile j's score product is issued before tile
// j - 1's value product, and tile j's softmax runs while the tensor cores add that product (FA3's
// overlap within a warpgroup); tile j's copy is issued one tile ahead, as with two stages, into the
// stage of tile j - 2, and one barrier a key tile. Each product over the same operands, and each
// rescaling of the outputs between the same two products, as with WG 1: the same bits.
//
// PROBE (timing probes, `attn_prefill_probe_*`, which only `gpu-bench` launches): the kernel with one part
// left out, to place its time on a device. Their outputs are not attention.
enum : int {
  PROBE_NONE = 0,
  PROBE_NO_LOAD = 1,     // every key tile is read from the first tile's stage: no copy after the first
  PROBE_NO_SOFTMAX = 2,  // no mask, maxima, exponentials or rescaling: P is S as the product leaves it
  PROBE_LOAD_ONLY = 3,   // the copies, waits and barriers alone
  PROBE_MMA_ONLY = 4,    // the products over the first tile's stage, no softmax
};
template <typename KV, int D, int MT, int NK, int HALVES, int PROBE = PROBE_NONE, int STAGES = 2, int WG = 0>
__device__ void attn_prefill(const bf16* q, const KV* pool, const int* tables, const int* tile_info, bf16* out,
                             PoolShape p, int layer, int heads, int window, float scale_log2, int tiles,
                             int mask_all) {
  KURA_DEP();
  constexpr int KS = D + 8;  // row stride of the query tile (MT 2) and of the K and V tiles (bf16): 16-byte
                             // rows, no bank conflicts in ldmatrix
  constexpr int TS = WG ? D : KS;  // elements a key of a K or V tile takes (WG: core matrices, `tile_at`)
  constexpr int WR = 16 * MT;  // query rows a warp
  constexpr int ROWS = BR / HALVES;  // query rows a block
  constexpr int NT = ROWS / WR * 32;  // threads a block (a warp for each WR of its rows)
  static_assert(HALVES == 1 || MT == 1, "half tiles are for the 8-warp kernel's warps");
  static_assert(STAGES == 2 || (STAGES == 3 && PROBE == PROBE_NONE), "two stages, or three without a probe");
  static_assert(!WG || (MT == 1 && NK == 64 && PROBE == PROBE_NONE), "warpgroup products: warps of 16 rows");
  static_assert(WG != 2 || STAGES == 3, "overlapped warpgroup products: three stages");
  constexpr int STAGE = 2 * NK * TS;  // elements of a stage (K, then V)
  constexpr bool LOADS = PROBE != PROBE_NO_LOAD && PROBE != PROBE_MMA_ONLY;  // a copy for every key tile
  constexpr bool SOFTMAX = PROBE == PROBE_NONE || PROBE == PROBE_NO_LOAD;
  constexpr bool PRODUCTS = PROBE != PROBE_LOAD_ONLY;
  KURA_DYNAMIC_SHARED(smem_raw);
  bf16* smem = reinterpret_cast<bf16*>(smem_raw);
  // Stage s: K at smem + s * STAGE, V right after it; (MT 2) the query rows after the stages.
  bf16* qs = smem + STAGES * STAGE;
  int tile = tiles - 1 - (int)blockIdx.x / HALVES, h = blockIdx.y;  // longest tiles first
  int half = HALVES - 1 - (int)blockIdx.x % HALVES;                  // (and their later rows)
  int row0 = tile_info[4 * tile] + half * ROWS, nrows = tile_info[4 * tile + 1] - half * ROWS,
      pos0 = tile_info[4 * tile + 2] + half * ROWS, toff = tile_info[4 * tile + 3];
  if (nrows <= 0) return;  // the second half of a tile of at most ROWS rows
  nrows = min(nrows, ROWS);
  int group = heads / p.kv_heads, kvh = h / group;
  int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;
  int last = pos0 + nrows - 1;
  int lo = window > 0 ? max(0, pos0 + 1 - window) : 0;
  int first = (lo / NK) * NK;
  int ntiles = (last - first) / NK + 1;
  if constexpr (MT > 1) {
    // The tile's query rows (rows past the tile read row 0 and are dropped), in the first copy group.
    for (int i = threadIdx.x; i < ROWS * (D / 8); i += blockDim.x) {
      int r = i / (D / 8), c = (i % (D / 8)) * 8;
      cp_async16(qs + r * KS + c, q + ((size_t)(row0 + (r < nrows ? r : 0)) * heads + h) * D + c, 16);
    }
  }
  const TileSrc src = tile_src<D, NT, (WG > 0)>(p, layer, kvh);
  load_tile<D, NK, NT, (WG > 0)>(smem, smem + NK * TS, pool, tables, p, src, toff, first, last);
  cp_async_commit();
  if constexpr (STAGES == 3 && WG != 2) {
    // The second tile's copy too: every tile's copy starts two tiles ahead of its products.
    if (ntiles > 1)
      load_tile<D, NK, NT, (WG > 0)>(smem + STAGE, smem + STAGE + NK * TS, pool, tables, p, src, toff, first + NK,
                                     last);
    cp_async_commit();
  }
  // MT 1: Q fragments of this warp's 16 rows (rows past the tile read row 0 and are dropped): in
  // registers for the whole kernel; WG: read again for each key tile's product (`q_frags`), since ptxas
  // of CUDA 13.0 gives fragments kept across the loop the registers of P's fragments for the second
  // product, so that from the second key tile on the scores were computed from the previous tile's P
  // (at a head size of 64; its SASS shows it, and CUDA 13.5's compiles them apart).
  const bf16* q0 = q;
  const bf16* q1 = q;
  if constexpr (MT == 1) {
    int r0 = warp * 16 + g, r1 = r0 + 8;
    q0 = q + ((size_t)(row0 + (r0 < nrows ? r0 : 0)) * heads + h) * D;
    q1 = q + ((size_t)(row0 + (r1 < nrows ? r1 : 0)) * heads + h) * D;
  }
  auto q_frags = [&](u32 (&f)[D / 16][4]) {
#pragma unroll
    for (int kk = 0; kk < D / 16; kk++) {
      f[kk][0] = *reinterpret_cast<const u32*>(q0 + kk * 16 + 2 * tq);
      f[kk][1] = *reinterpret_cast<const u32*>(q1 + kk * 16 + 2 * tq);
      f[kk][2] = *reinterpret_cast<const u32*>(q0 + kk * 16 + 2 * tq + 8);
      f[kk][3] = *reinterpret_cast<const u32*>(q1 + kk * 16 + 2 * tq + 8);
    }
  };
  u32 qa[MT == 1 && !WG ? D / 16 : 1][4];
  if constexpr (MT == 1 && !WG) q_frags(qa);
  float o[MT][D / 8][4];
#pragma unroll
  for (int mt = 0; mt < MT; mt++)
#pragma unroll
    for (int i = 0; i < D / 8; i++) o[mt][i][0] = o[mt][i][1] = o[mt][i][2] = o[mt][i][3] = 0.f;
  // Per m-tile: the running max and sum of rows g and g + 8.
  float m0[MT], m1[MT], l0[MT], l1[MT];
#pragma unroll
  for (int mt = 0; mt < MT; mt++) {
    m0[mt] = m1[mt] = KURA_NEG_INF;
    l0[mt] = l1[mt] = 0.f;
  }
  int warp_pos = pos0 + warp * WR;  // position of this warp's first row
  int warp_last = min(warp_pos + WR - 1, last);
  int warp_first = window > 0 ? max(0, warp_pos + 1 - window) : 0;
  // The rows that decide whether a tile is computed: this warp's, or (WG) its warpgroup's.
  constexpr int GROUP = WG ? 4 : 1;
  int group_pos = pos0 + (warp / GROUP) * GROUP * WR;
  int group_last = min(group_pos + GROUP * WR - 1, last);
  int group_first = window > 0 ? max(0, group_pos + 1 - window) : 0;
  // ldmatrix lane addressing: Q (MT 2; the rows of one 16 × 16 fragment), K (non-transposed, two
  // k-steps; k2: one, MT 2) and V (transposed, two n-tiles).
  int q_row = lane & 15, q_col = (lane >> 4) * 8;
  int k_row = lane & 7, k_col = (lane >> 3) * 8, k2_col = ((lane >> 3) & 1) * 8;
  int v_row = (lane & 7) + ((lane >> 3) & 1) * 8, v_col = (lane >> 4) * 8;
#ifdef KURA_WGMMA
  // `issue_scores`: the warpgroup's score product over the K tile at `ks`, issued: its 64 rows × 64
  // keys into `s` (zeros before), a k-step (16 columns of Q and K) a product, in order, A the Q
  // fragments it loads into `qt`. `issue_values`: its value product over the V tile at `vs` into the
  // outputs, issued: A the weights' fragments `pa`, a product of the 64 rows by 16 keys' V rows
  // (N-major: a core matrix row is 8 columns of V) a k-step, in order. The register fences around the
  // products keep their operands' writes before `wg_fence`, and the caller's after `wg_wait` keep
  // their reads and reuse after the wait, as the compiler sees them.
  auto issue_scores = [&](float (&s)[NK / 8][4], u32 (&qt)[D / 16][4], const bf16* ks) {
    if constexpr (WG > 0) {
      q_frags(qt);
      reg_fences(qt);
      reg_fences(s);
      wg_fence();
#pragma unroll
      for (int kk = 0; kk < D / 16; kk++) wg_mma<0>(s, qt[kk], wg_desc(ks + kk * 128, 128, D / 8 * 128));
      wg_commit();
    }
  };
  auto issue_values = [&](u32 (&pa)[NK / 16][4], const bf16* vs) {
    if constexpr (WG > 0) {
      reg_fences(pa);
      reg_fences(o[0]);
      wg_fence();
#pragma unroll
      for (int kk = 0; kk < NK / 16; kk++)
        wg_mma<1>(o[0], pa[kk], wg_desc(vs + kk * 2 * D * 8, D / 8 * 128, 128));
      wg_commit();
    }
  };
#endif
  // (WG 2) The weights' fragments of the last tile computed, whose value product is not yet issued,
  // and its V tile.
  u32 pa[WG == 2 ? NK / 16 : 1][4];
  bool pending = false;
  const bf16* pending_vs = nullptr;
  int stage = 0;  // (STAGES 3) tile j's stage, j % 3
  for (int j = 0; j < ntiles; j++) {
    int kt = first + j * NK;
    bf16* ks;
    if constexpr (WG == 2) {
      // Three stages, a tile's copy issued one tile ahead of its score product: tile j + 1's goes into
      // the stage of tile j - 2, whose value product every thread waited for before this barrier
      // (tile j - 1's V is still read by its value product, issued in this pass).
      ks = smem + stage * STAGE;
      cp_async_wait<0>();
#ifdef KURA_WGMMA
      smem_to_async();
#endif
      __syncthreads();
      int next = stage == 2 ? 0 : stage + 1;
      if (j + 1 < ntiles) {
        bf16* nk = smem + next * STAGE;
        load_tile<D, NK, NT, true>(nk, nk + NK * TS, pool, tables, p, src, toff, kt + NK, last);
      }
      cp_async_commit();
      stage = next;
    } else if constexpr (STAGES == 2) {
      ks = smem + (LOADS ? j & 1 : 0) * STAGE;
      if (LOADS && j + 1 < ntiles) {
        bf16* nk = smem + ((j + 1) & 1) * STAGE;
        load_tile<D, NK, NT, (WG > 0)>(nk, nk + NK * TS, pool, tables, p, src, toff, kt + NK, last);
      }
      cp_async_commit();
      cp_async_wait1();
#ifdef KURA_WGMMA
      if constexpr (WG) smem_to_async();
#endif
      __syncthreads();
    } else {
      ks = smem + stage * STAGE;
      // Every group but the newest (tile j + 1's) has landed: tile j's, this thread's part; the barrier
      // makes every thread's visible, and every thread is past tile j - 1's products.
      cp_async_wait1();
#ifdef KURA_WGMMA
      if constexpr (WG) smem_to_async();
#endif
      __syncthreads();
      if (j + 2 < ntiles) {
        bf16* nk = smem + (stage == 0 ? 2 : stage - 1) * STAGE;  // stage (j + 2) % 3, tile j - 1's
        load_tile<D, NK, NT, (WG > 0)>(nk, nk + NK * TS, pool, tables, p, src, toff, kt + 2 * NK, last);
      }
      cp_async_commit();
      stage = stage == 2 ? 0 : stage + 1;
    }
    bf16* vs = ks + NK * TS;
    // A warp whose rows all end before this tile (or whose window starts after it) skips it; WG: a
    // warpgroup whose rows all do (the others' weights in it are zeros, which change nothing).
    bool computed = PRODUCTS && kt <= group_last && kt + NK > group_first;
    if constexpr (WG == 2) {
#ifdef KURA_WGMMA
      // This tile's score product is issued before the value product of the tile before (its P in
      // `pa`), and the softmax of these scores runs while the tensor cores add that product: each
      // product over the same operands in the same order as `Wg`'s, each rescaling of the outputs
      // between the same two products.
      float s[MT][NK / 8][4];
      u32 qt[D / 16][4];
      // Each product waited for in the branch that issues it: ptxas serializes every warpgroup product
      // of a kernel where one is in flight across a branch it cannot prove uniform.
      if (computed) {
#pragma unroll
        for (int nt = 0; nt < NK / 8; nt++) s[0][nt][0] = s[0][nt][1] = s[0][nt][2] = s[0][nt][3] = 0.f;
        float c0, c1;
        bool whole = !mask_all && kt + NK - 1 <= warp_pos && (window <= 0 || kt > warp_last - window);
        auto softmax = [&] {
          online_softmax<NK>(s[0], kt, whole, warp_pos + g, window, scale_log2, tq, m0[0], m1[0], l0[0], l1[0], c0,
                             c1);
        };
        if (pending) {
          issue_scores(s[0], qt, ks);
          issue_values(pa, pending_vs);
          wg_wait<1>();  // the scores; the value product may still run
          reg_fences(s[0]);
          reg_fences(qt);
          softmax();
          wg_wait();
          reg_fences(o[0]);
          reg_fences(pa);
        } else {
          issue_scores(s[0], qt, ks);
          wg_wait();
          reg_fences(s[0]);
          reg_fences(qt);
          softmax();
        }
        rescale_rows<D>(o[0], c0, c1);
#pragma unroll
        for (int kk = 0; kk < NK / 16; kk++) p_frag(s[0], kk, pa[kk]);
        pending_vs = vs;
      } else if (pending) {
        issue_values(pa, pending_vs);
        wg_wait();
        reg_fences(o[0]);
        reg_fences(pa);
      }
      pending = computed;
#endif
    } else if (computed) {
      // S = Q Kᵀ for WR rows × NK keys, k-steps in order for every element.
      float s[MT][NK / 8][4];
#pragma unroll
      for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int nt = 0; nt < NK / 8; nt++) s[mt][nt][0] = s[mt][nt][1] = s[mt][nt][2] = s[mt][nt][3] = 0.f;
      if constexpr (WG) {
#ifdef KURA_WGMMA
        u32 qt[D / 16][4];
        issue_scores(s[0], qt, ks);
        wg_wait();
        reg_fences(s[0]);
        reg_fences(qt);
#endif
      } else if constexpr (MT == 1) {
#pragma unroll
        for (int nt = 0; nt < NK / 8; nt++) {
#pragma unroll
          for (int kk = 0; kk < D / 16; kk += 2) {
            u32 b[4];
            ldmatrix_x4(b, ks + (nt * 8 + k_row) * KS + kk * 16 + k_col);
            mma16816(s[0][nt], qa[kk], b);
            mma16816(s[0][nt], qa[kk + 1], b + 2);
          }
        }
      } else {
#pragma unroll
        // One k-step at a time: each m-tile's Q fragment (4 registers) and one K fragment (2) live.
#pragma unroll
        for (int kk = 0; kk < D / 16; kk++) {
          u32 a[MT][4];
#pragma unroll
          for (int mt = 0; mt < MT; mt++)
            ldmatrix_x4(a[mt], qs + (warp * WR + mt * 16 + q_row) * KS + kk * 16 + q_col);
#pragma unroll
          for (int nt = 0; nt < NK / 8; nt++) {
            u32 b[2];
            ldmatrix_x2(b, ks + (nt * 8 + k_row) * KS + kk * 16 + k2_col);
#pragma unroll
            for (int mt = 0; mt < MT; mt++) mma16816(s[mt][nt], a[mt], b);
          }
        }
      }
      bool whole = !mask_all && kt + NK - 1 <= warp_pos && (window <= 0 || kt > warp_last - window);
#pragma unroll
      for (int mt = 0; mt < (SOFTMAX ? MT : 0); mt++) {
        float c0, c1;
        online_softmax<NK>(s[mt], kt, whole, warp_pos + mt * 16 + g, window, scale_log2, tq, m0[mt], m1[mt], l0[mt],
                           l1[mt], c0, c1);
        rescale_rows<D>(o[mt], c0, c1);
      }
      // O += P V: P's A fragments straight from the S accumulators of two adjacent 8-key tiles.
      if constexpr (WG) {
#ifdef KURA_WGMMA
        u32 pa[NK / 16][4];
#pragma unroll
        for (int kk = 0; kk < NK / 16; kk++) p_frag(s[0], kk, pa[kk]);
        issue_values(pa, vs);
        wg_wait();
        reg_fences(o[0]);
        reg_fences(pa);
#endif
      } else {
#pragma unroll
        for (int kk = 0; kk < NK / 16; kk++) {
          u32 a[MT][4];
#pragma unroll
          for (int mt = 0; mt < MT; mt++) p_frag(s[mt], kk, a[mt]);
#pragma unroll
          for (int nt = 0; nt < D / 8; nt += 2) {
            u32 b[4];
            ldmatrix_x4_trans(b, vs + (kk * 16 + v_row) * KS + nt * 8 + v_col);
#pragma unroll
            for (int mt = 0; mt < MT; mt++) {
              mma16816(o[mt][nt], a[mt], b);
              mma16816(o[mt][nt + 1], a[mt], b + 2);
            }
          }
        }
      }
    }
    // (Three stages: the next tile's barrier is the only one; the stage read here is written again
    // only after the barrier of the tile after it.)
    if constexpr (STAGES == 2) __syncthreads();
  }
  if constexpr (WG == 2) {
#ifdef KURA_WGMMA
    // The last computed tile's value product.
    if (pending) {
      issue_values(pa, pending_vs);
      wg_wait();
      reg_fences(o[0]);
      reg_fences(pa);
    }
#endif
  }
  // Row sums across the quad, then write rows g and g + 8 of each of this warp's m-tiles.
#pragma unroll
  for (int mt = 0; mt < MT; mt++) {
    float s0 = l0[mt], s1 = l1[mt];
    s0 += __shfl_xor_sync(0xffffffffu, s0, 1);
    s0 += __shfl_xor_sync(0xffffffffu, s0, 2);
    s1 += __shfl_xor_sync(0xffffffffu, s1, 1);
    s1 += __shfl_xor_sync(0xffffffffu, s1, 2);
    int r0 = warp * WR + mt * 16 + g, r1 = r0 + 8;
    float i0 = s0 > 0.f ? 1.f / s0 : 0.f, i1 = s1 > 0.f ? 1.f / s1 : 0.f;
#pragma unroll
    for (int nt = 0; nt < D / 8; nt++) {
      int c = nt * 8 + 2 * tq;
      if (r0 < nrows)
        *reinterpret_cast<u32*>(out + ((size_t)(row0 + r0) * heads + h) * D + c) =
            pack_bf16(o[mt][nt][0] * i0, o[mt][nt][1] * i0);
      if (r1 < nrows)
        *reinterpret_cast<u32*>(out + ((size_t)(row0 + r1) * heads + h) * D + c) =
            pack_bf16(o[mt][nt][2] * i1, o[mt][nt][3] * i1);
    }
  }
}

// `attn_prefill_{kv}_{d}`: 8 warps of 16 rows; `attn_prefill_wide_{kv}_{d}`: 4 warps of 32 rows, two blocks
// a multiprocessor; `attn_prefill_half_{kv}_{d}`: 4 warps of 16 rows, half a tile a block (2 × tiles
// blocks), two blocks a multiprocessor; `attn_prefill_small_{kv}_{d}`: the half-tile kernel over the wide
// kernel's key tiles (`WIDE_NK`, so the wide kernel's bits), whose 168 registers a thread let three
// blocks share a multiprocessor on sm_90 (12 warps, where the others have 8: each of a multiprocessor's
// four schedulers has three warps to issue from while the others wait on a product or a shared-memory
// read). sm_80's code needs a few registers more at a head size of 128 (it would spill): two blocks there.
// `attn_prefill_deep_{kv}_{d}` and `attn_prefill_halfdeep_{kv}_{d}`: the 8-warp and half-tile kernels with
// three stages and one barrier a key tile (their bits), 102 KiB of shared memory a block at a head size
// of 128: more than sm_86's and sm_89's 99, where they are not loaded; two half-tile blocks share an sm_90
// multiprocessor (227 KiB), one an sm_80's.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#define SMALL_BLOCKS 2
#else
#define SMALL_BLOCKS 3
#endif
// Kernel `NAME` of `THREADS` threads a block (at least `BLOCKS` blocks a multiprocessor) over a `KVT` pool:
// `attn_prefill<KVT, ...>` with the template arguments after `BLOCKS`.
#define ATTN_PREFILL_KERNEL(NAME, KVT, THREADS, BLOCKS, ...)                                                  \
  extern "C" __global__ void __launch_bounds__(THREADS, BLOCKS) NAME(                                          \
      const bf16* q, const KVT* pool, const int* tables, const int* tile_info, bf16* out, PoolShape p,        \
      int layer, int heads, int window, float scale_log2, int tiles, int mask_all) {                          \
    attn_prefill<KVT, __VA_ARGS__>(q, pool, tables, tile_info, out, p, layer, heads, window, scale_log2, tiles, \
                                   mask_all);                                                                 \
  }
#define ATTN_PREFILL(KVN, KVT, D)                                                                            \
  ATTN_PREFILL_KERNEL(attn_prefill_##KVN##_##D, KVT, 256, 1, D, 1, BC, 1)                                        \
  ATTN_PREFILL_KERNEL(attn_prefill_wide_##KVN##_##D, KVT, 128, 2, D, 2, WIDE_NK(D), 1)                           \
  ATTN_PREFILL_KERNEL(attn_prefill_half_##KVN##_##D, KVT, 128, 2, D, 1, BC, 2)                                   \
  ATTN_PREFILL_KERNEL(attn_prefill_small_##KVN##_##D, KVT, 128, SMALL_BLOCKS, D, 1, WIDE_NK(D), 2)               \
  ATTN_PREFILL_KERNEL(attn_prefill_deep_##KVN##_##D, KVT, 256, 1, D, 1, BC, 1, PROBE_NONE, 3)                    \
  ATTN_PREFILL_KERNEL(attn_prefill_halfdeep_##KVN##_##D, KVT, 128, 2, D, 1, BC, 2, PROBE_NONE, 3)
// `M(kv name, KV type, head size)` for every pool format and head size.
#define ATTN_EVERY_KV_D(M) \
  M(bf16, bf16, 64) M(bf16, bf16, 128) M(f32, float, 64) M(f32, float, 128) M(fp8, unsigned char, 64) M(fp8, unsigned char, 128)
ATTN_EVERY_KV_D(ATTN_PREFILL)

// `attn_prefill_wg_{kv}_{d}` and `attn_prefill_halfwg_{kv}_{d}`: the 8-warp and half-tile kernels with
// their products on Hopper's warpgroup instructions (sm_90a; not in the module elsewhere): each warp
// keeps its 16 rows, scores and softmax, and the two products of a key tile are 8 and 4 `wgmma`s of a
// warpgroup (64 rows) reading K and V from shared memory, where each warp issued 64 `mma.sync` and 32
// `ldmatrix` for each. K and V tiles lie in core matrices (`tile_at`), 64 KiB a block at a head size of
// 128. The same products over the same k-steps in the same order: the 8-warp kernel's bits where the
// tensor cores round a warpgroup's k-step as they round `mma.sync`'s (the emulated check holds them to
// it; the GPU tests compare them on the device). `attn_prefill_wgpipe_{kv}_{d}` and
// `attn_prefill_halfwgpipe_{kv}_{d}`: the same with a tile's score product and softmax overlapping the
// value product of the tile before (WG 2), three stages, 96 KiB a block at 128: the same bits.
#ifdef KURA_WGMMA
#define ATTN_PREFILL_WG(KVN, KVT, D)                                                                         \
  ATTN_PREFILL_KERNEL(attn_prefill_wg_##KVN##_##D, KVT, 256, 1, D, 1, BC, 1, PROBE_NONE, 2, 1)                   \
  ATTN_PREFILL_KERNEL(attn_prefill_halfwg_##KVN##_##D, KVT, 128, 2, D, 1, BC, 2, PROBE_NONE, 2, 1)               \
  ATTN_PREFILL_KERNEL(attn_prefill_wgpipe_##KVN##_##D, KVT, 256, 1, D, 1, BC, 1, PROBE_NONE, 3, 2)               \
  ATTN_PREFILL_KERNEL(attn_prefill_halfwgpipe_##KVN##_##D, KVT, 128, 2, D, 1, BC, 2, PROBE_NONE, 3, 2)
ATTN_EVERY_KV_D(ATTN_PREFILL_WG)
#endif

// `attn_prefill_probe_{what}_bf16_{d}`: the 8-warp kernel over a bf16 pool with one part left out (PROBE).
#define ATTN_PROBE(NAME, PROBE, D) \
  ATTN_PREFILL_KERNEL(attn_prefill_probe_##NAME##_bf16_##D, bf16, 256, 1, D, 1, BC, 1, PROBE)
#define ATTN_PROBES(D)                                                                                        \
  ATTN_PROBE(noload, PROBE_NO_LOAD, D)                                                                        \
  ATTN_PROBE(nosoftmax, PROBE_NO_SOFTMAX, D)                                                                  \
  ATTN_PROBE(loadonly, PROBE_LOAD_ONLY, D)                                                                    \
  ATTN_PROBE(mmaonly, PROBE_MMA_ONLY, D)
ATTN_PROBES(64)
ATTN_PROBES(128)

// ---------------------------------------------------------------------------------------------------
// y[t][n] (+)= Σ_k W[n][k] · x[t][k] for T ≤ 8 tokens (decode): a warp per output row, 16-byte loads of
// W, f32 accumulation, fixed order. `accumulate` adds to y (the residual add). K % 8 == 0.
//
// One 16-byte chunk of each of R rows of W (`wv[r]`, chunk `i` of the row: elements 8i..8i+7) into
// acc[r][t], with the same elements of the T rows of x: two multiply-adds an element pair, in order.
// Every form of the products adds a lane's chunks through this, in ascending `i`, so that a row's sum
// has the same bits whichever form computes it.
template <int T, int R>
__device__ __forceinline__ void gemv_chunk(const uint4 (&wv)[R], const bf16* x, int k, int i, float (&acc)[R][T]) {
  float wf[R][8];
#pragma unroll
  for (int r = 0; r < R; r++) {
    const __nv_bfloat162* w2 = reinterpret_cast<const __nv_bfloat162*>(&wv[r]);
#pragma unroll
    for (int j = 0; j < 4; j++) {
      float2 f = __bfloat1622float2(w2[j]);
      wf[r][2 * j] = f.x;
      wf[r][2 * j + 1] = f.y;
    }
  }
#pragma unroll
  for (int t = 0; t < T; t++) {
    uint4 xv = *(reinterpret_cast<const uint4*>(x + (size_t)t * k) + i);
    const __nv_bfloat162* x2 = reinterpret_cast<const __nv_bfloat162*>(&xv);
#pragma unroll
    for (int j = 0; j < 4; j++) {
      float2 f = __bfloat1622float2(x2[j]);
#pragma unroll
      for (int r = 0; r < R; r++)
        acc[r][t] = __fmaf_rn(wf[r][2 * j + 1], f.y, __fmaf_rn(wf[r][2 * j], f.x, acc[r][t]));
    }
  }
}

// The dot products of R ≤ 2 rows of W (`row0`, `row1`, each k long) with the T rows of x, in lane
// `lane`'s share of k: acc[r][t]. Explicit multiply-adds (nothing left to the compiler's contraction),
// so that a row's sum has the same bits whichever kernel computes it.
//
// AHEAD: each chunk's load also asks L2 for the chunk 4 KiB further along its row (`prefetch`, which
// holds no register), continuing where `gemv_prefetch` stopped. The compiler keeps only one or two
// chunks of loads in flight a lane (it schedules them for a cache hit's latency, and the sum's order
// is one chain), so a matrix of 4,096 rows, a warp each, has too few bytes in flight to reach the
// memory's bandwidth; with the window each warp has 4 KiB more on the way. The same bits either way.
template <int T, int R, bool AHEAD = false>
__device__ __forceinline__ void gemv_dots(const bf16* row0, const bf16* row1, const bf16* x, int k, int lane,
                                          float (&acc)[R][T]) {
#pragma unroll
  for (int r = 0; r < R; r++)
#pragma unroll
    for (int t = 0; t < T; t++) acc[r][t] = 0.f;
  int k8 = k / 8;
  // Four 16-byte loads of W a lane in flight, whatever R.
  constexpr int UNROLL = 4 / R;
#pragma unroll UNROLL
  for (int i = lane; i < k8; i += 32) {
    uint4 wv[R];
#pragma unroll
    for (int r = 0; r < R; r++) {
      if (AHEAD && i + 256 < k8) prefetch_l2(reinterpret_cast<const uint4*>(r == 0 ? row0 : row1) + i + 256);
      wv[r] = __ldg(reinterpret_cast<const uint4*>(r == 0 ? row0 : row1) + i);
    }
    gemv_chunk<T, R>(wv, x, k, i, acc);
  }
#pragma unroll
  for (int r = 0; r < R; r++)
#pragma unroll
    for (int t = 0; t < T; t++) acc[r][t] = warp_sum(acc[r][t]);
}

// The dot products of one row of W with the T rows of x, a lane's chunks of W staged through shared
// memory: asynchronous copies (`cp.async`) into slots of the lane's own, GEMV_BATCH chunks a batch,
// GEMV_STAGES - 1 batches issued ahead of the one being added. A lane then has 8 chunks on the way (4 KiB
// a warp) whatever the compiler's schedule: it keeps a load into registers one or two chunks ahead of
// its use however the source orders them (it schedules for a cache hit's latency), but a copy has no
// register to wait on and is issued where it is written. Each lane reads back only what it copied,
// after its own wait: no barrier. The chunks are added in the order `gemv_dots` adds them: the same
// bits. `stage`: this warp's GEMV_STAGES × GEMV_BATCH × 32 slots.
constexpr int GEMV_BATCH = 4, GEMV_STAGES = 3, GEMV_WARPS = 8;
template <int T>
__device__ __forceinline__ void gemv_dots_staged(const bf16* row, const bf16* x, int k, int lane, uint4* stage,
                                                 float (&acc)[1][T]) {
#pragma unroll
  for (int t = 0; t < T; t++) acc[0][t] = 0.f;
  const uint4* w = reinterpret_cast<const uint4*>(row);
  int k8 = k / 8;
  int n = lane < k8 ? (k8 - lane + 31) / 32 : 0;  // this lane's chunks: lane + 32 j, j < n
  int batches = ((k8 + 31) / 32 + GEMV_BATCH - 1) / GEMV_BATCH;  // lane 0's, the most (the same in a warp)
  int whole = k8 / 32 / GEMV_BATCH;  // batches whole in every lane
  // Batch m's copies into stage m % GEMV_STAGES, one group (empty past the lane's chunks).
  auto issue = [&](int m) {
    uint4* s = stage + (m % GEMV_STAGES) * GEMV_BATCH * 32 + lane;
#pragma unroll
    for (int b = 0; b < GEMV_BATCH; b++) {
      int j = m * GEMV_BATCH + b;
      if (j < n) cp_async16(s + b * 32, w + lane + 32 * j, 16);
    }
    cp_async_commit();
  };
#pragma unroll
  for (int m = 0; m < GEMV_STAGES - 1; m++) issue(m);
#pragma unroll 1
  for (int m = 0; m < batches; m++) {
    // Into the stage batch m - 1 was read from (its values already added: the lane is past them).
    issue(m + GEMV_STAGES - 1);
    cp_async_wait<GEMV_STAGES - 1>();  // every group but the newest two: batch m
    const uint4* s = stage + (m % GEMV_STAGES) * GEMV_BATCH * 32 + lane;
    if (m < whole) {
      // Every lane has the whole batch: no test between the chunks, whose reads may then all be
      // issued at once (for at most two rows of x: more would hold their chunks of x in too many
      // registers, and spill).
#pragma unroll(T <= 2 ? GEMV_BATCH : 1)
      for (int b = 0; b < GEMV_BATCH; b++) {
        uint4 wv[1] = {s[b * 32]};
        gemv_chunk<T, 1>(wv, x, k, lane + 32 * (m * GEMV_BATCH + b), acc);
      }
    } else {
#pragma unroll
      for (int b = 0; b < GEMV_BATCH; b++) {
        int j = m * GEMV_BATCH + b;
        if (j < n) {
          uint4 wv[1] = {s[b * 32]};
          gemv_chunk<T, 1>(wv, x, k, lane + 32 * j, acc);
        }
      }
    }
  }
#pragma unroll
  for (int t = 0; t < T; t++) acc[0][t] = warp_sum(acc[0][t]);
}

// The weights depend on no earlier kernel: while the kernel before drains (a dependent launch), ask L2
// for the start of a row, a 128-byte line a lane (4 KiB: every resident warp's together stay well inside
// L2).
__device__ __forceinline__ void gemv_prefetch(const bf16* row, int k, int lane) {
  if (lane * 64 < k) prefetch_l2(row + lane * 64);
}

// FORM: GEMV_PLAIN (`gemv_T`), GEMV_AHEAD (`gemv_ahead_T`, the L2 window of `gemv_dots`) or GEMV_BATCHED
// (`gemv_batched_T`, `gemv_dots_staged`; blocks of GEMV_WARPS warps): the same bits.
enum : int { GEMV_PLAIN = 0, GEMV_AHEAD = 1, GEMV_BATCHED = 2 };
template <int T, int FORM>
__device__ void gemv(const bf16* w, const bf16* x, float* y, int n, int k, int accumulate) {
  int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, lane = threadIdx.x & 31;
  const bf16* row = w + (size_t)warp * k;
  if (warp < n) gemv_prefetch(row, k, lane);
  KURA_DEP();
  if (warp >= n) return;
  float acc[1][T];
  if constexpr (FORM == GEMV_BATCHED) {
    __shared__ uint4 stage[GEMV_WARPS][GEMV_STAGES * GEMV_BATCH * 32];  // 48 KiB
    gemv_dots_staged<T>(row, x, k, lane, stage[threadIdx.x >> 5], acc);
  } else {
    gemv_dots<T, 1, FORM == GEMV_AHEAD>(row, row, x, k, lane, acc);
  }
  if (lane == 0) {
#pragma unroll
    for (int t = 0; t < T; t++) {
      float* yo = y + (size_t)t * n + warp;
      *yo = accumulate ? *yo + acc[0][t] : acc[0][t];
    }
  }
}
// gemv_ahead_T: with the L2 window of `gemv_dots`' AHEAD; gemv_batched_T: a lane's chunks of W staged
// through shared memory in batches (`gemv_dots_staged`); `CudaExecutor::set_gemv`.
#define GEMV(T)                                                                                              \
  extern "C" __global__ void __launch_bounds__(256) gemv_##T(const bf16* w, const bf16* x, float* y, int n,  \
                                                             int k, int accumulate) {                        \
    gemv<T, GEMV_PLAIN>(w, x, y, n, k, accumulate);                                                           \
  }                                                                                                          \
  extern "C" __global__ void __launch_bounds__(256) gemv_ahead_##T(const bf16* w, const bf16* x, float* y,   \
                                                                   int n, int k, int accumulate) {          \
    gemv<T, GEMV_AHEAD>(w, x, y, n, k, accumulate);                                                           \
  }                                                                                                          \
  extern "C" __global__ void __launch_bounds__(256) gemv_batched_##T(const bf16* w, const bf16* x, float* y, \
                                                                     int n, int k, int accumulate) {        \
    gemv<T, GEMV_BATCHED>(w, x, y, n, k, accumulate);                                                         \
  }
GEMV(1)
GEMV(2)
GEMV(3)
GEMV(4)
GEMV(5)
GEMV(6)
GEMV(7)
GEMV(8)

// The matrix-vector kernels that norm their input themselves (the fused decode path): the block
// norms its T rows of the f32 residual x (rows `rows[t]`, or the first T when null) with `nw` into
// dynamic shared memory (T × k bf16), the bits `rms_norm` writes, then its warps take rows of W,
// grid-stride (the grid is capped near the device's resident blocks, so that a wide matrix such as the
// output head does not norm the input once per 8 rows). One launch instead of two, and the norm is
// no longer a kernel of a single block on one multiprocessor.
template <int T>
__device__ __forceinline__ void norm_into_shared(const float* x, const int* rows, const float* nw, float eps, int k,
                                                 bf16* xs, float* red) {
#pragma unroll 1
  for (int t = 0; t < T; t++) {
    const float* xr = x + (size_t)(rows ? rows[t] : t) * k;
    float inv = row_inv_rms(xr, k, eps, red);
    norm_row(xr, nw, inv, xs + (size_t)t * k, k);
  }
  __syncthreads();
}

// Without SWIGLU: y[t][row] = Σ_k W[row][k] · norm(x[t])[k] for n rows (the products of `gemv` after
// `rms_norm`). With SWIGLU, the FFN in two launches: act[t][j] = SiLU(gate) · up in bf16, where a warp
// takes rows j (gate) and n + j (up) of w ([gate | up], 2·n rows of k) — the bits of `rms_norm`, `gemv`
// into f32 and `silu_mul`, without the two round trips and launches.
template <int T, bool SWIGLU>
__device__ void gemv_normed(const bf16* w, const float* x, const int* rows, const float* nw, float eps, float* y,
                            bf16* act, int n, int k) {
  KURA_DYNAMIC_SHARED(gemv_smem);
  bf16* xs = reinterpret_cast<bf16*>(gemv_smem);
  __shared__ float red[32];
  int lane = threadIdx.x & 31, first = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  int stride = gridDim.x * (blockDim.x >> 5);
  if (first < n) {
    gemv_prefetch(w + (size_t)first * k, k, lane);
    if (SWIGLU) gemv_prefetch(w + ((size_t)n + first) * k, k, lane);
  }
  KURA_DEP();
  norm_into_shared<T>(x, rows, nw, eps, k, xs, red);
  for (int j = first; j < n; j += stride) {
    if constexpr (SWIGLU) {
      float acc[2][T];
      gemv_dots<T, 2>(w + (size_t)j * k, w + ((size_t)n + j) * k, xs, k, lane, acc);
      if (lane == 0) {
#pragma unroll
        for (int t = 0; t < T; t++) act[(size_t)t * n + j] = __float2bfloat16(silu_times(acc[0][t], acc[1][t]));
      }
    } else {
      const bf16* wr = w + (size_t)j * k;
      float acc[1][T];
      gemv_dots<T, 1>(wr, wr, xs, k, lane, acc);
      if (lane == 0) {
#pragma unroll
        for (int t = 0; t < T; t++) y[(size_t)t * n + j] = acc[0][t];
      }
    }
  }
}
#define GEMV_NORM(T)                                                                                         \
  extern "C" __global__ void __launch_bounds__(NORM_THREADS) gemv_norm_##T(                                  \
      const bf16* w, const float* x, const int* rows, const float* nw, float eps, float* y, int n, int k) {  \
    gemv_normed<T, false>(w, x, rows, nw, eps, y, nullptr, n, k);                                             \
  }                                                                                                          \
  extern "C" __global__ void __launch_bounds__(NORM_THREADS) gemv_swiglu_norm_##T(                           \
      const bf16* w, const float* x, const float* nw, float eps, bf16* act, int inter, int k) {              \
    gemv_normed<T, true>(w, x, nullptr, nw, eps, nullptr, act, inter, k);                                     \
  }
GEMV_NORM(1)
GEMV_NORM(2)
GEMV_NORM(3)
GEMV_NORM(4)

// ---------------------------------------------------------------------------------------------------
// Greedy sampling on the device: out[r] = the first index of row r's largest logit, as the host's
// `sampling::argmax` finds it: NaN is never the largest (unless it comes first: token 0), and a row with
// no number above -inf gives token 0. Two launches, so that a row is read by many blocks at once (one
// block reading a 128,256-entry row took 49 µs on an H200): `argmax_part` finds the first largest of
// each `seg` logits of each row (a block a segment, grid rows × segments) into `part` (value, index
// bits), `argmax_merge` the first largest of a row's segments (a warp a row). The largest value and,
// among equal ones, the lowest index: whatever the split, the index the host's walk finds.
__device__ __forceinline__ void argmax_pick(float& best, int& idx, float v, int i) {
  if (v > best || (v == best && i < idx)) {
    best = v;
    idx = i;
  }
}
constexpr int ARGMAX_NONE = 0x7fffffff;
__device__ __forceinline__ float argmax_neg_inf() { return __int_as_float((int)0xff800000); }
// (best, idx) across the warp, each lane ending with the warp's.
__device__ __forceinline__ void argmax_warp(float& best, int& idx) {
  for (int o = 16; o > 0; o >>= 1) {
    float ov = __shfl_xor_sync(0xffffffffu, best, o);
    int oi = __shfl_xor_sync(0xffffffffu, idx, o);
    argmax_pick(best, idx, ov, oi);
  }
}
extern "C" __global__ void argmax_part(const float* logits, float* part, int vocab, int seg) {
  KURA_DEP();
  __shared__ float bv[32];
  __shared__ int bi[32];
  const float* row = logits + (size_t)blockIdx.x * vocab;
  int lo = blockIdx.y * seg, hi = min(vocab, lo + seg);
  float best = argmax_neg_inf();
  int idx = ARGMAX_NONE;
  // A thread walks its logits from the lowest index up and moves on to each strictly greater one.
  if ((vocab & 3) == 0 && (seg & 3) == 0) {
    // Rows and segments of whole 16-byte chunks: four logits a load.
    const float4* r4 = reinterpret_cast<const float4*>(row);
    for (int i = lo / 4 + threadIdx.x; i < hi / 4; i += blockDim.x) {
      float4 v = r4[i];
      if (v.x > best) { best = v.x; idx = 4 * i; }
      if (v.y > best) { best = v.y; idx = 4 * i + 1; }
      if (v.z > best) { best = v.z; idx = 4 * i + 2; }
      if (v.w > best) { best = v.w; idx = 4 * i + 3; }
    }
  } else {
    for (int i = lo + threadIdx.x; i < hi; i += blockDim.x) {
      float v = row[i];
      if (v > best) { best = v; idx = i; }
    }
  }
  argmax_warp(best, idx);
  int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) { bv[warp] = best; bi[warp] = idx; }
  __syncthreads();
  if (warp == 0) {
    int nw = blockDim.x >> 5;
    best = lane < nw ? bv[lane] : argmax_neg_inf();
    idx = lane < nw ? bi[lane] : ARGMAX_NONE;
    argmax_warp(best, idx);
    if (lane == 0) {
      float* p = part + ((size_t)blockIdx.x * gridDim.y + blockIdx.y) * 2;
      p[0] = best;
      p[1] = __int_as_float(idx);
    }
  }
}
extern "C" __global__ void argmax_merge(const float* logits, const float* part, u32* out, int vocab, int segs) {
  KURA_DEP();
  const float* p = part + (size_t)blockIdx.x * segs * 2;
  float best = argmax_neg_inf();
  int idx = ARGMAX_NONE;
  for (int s = threadIdx.x; s < segs; s += 32) argmax_pick(best, idx, p[2 * s], __float_as_int(p[2 * s + 1]));
  argmax_warp(best, idx);
  if (threadIdx.x == 0)
    out[blockIdx.x] = idx == ARGMAX_NONE || isnan(logits[(size_t)blockIdx.x * vocab]) ? 0u : (u32)idx;
}

// ---------------------------------------------------------------------------------------------------
// Copy-on-write of a partial block: slots 0..n of every layer's K and V of block `src` into `dst`
// (bytes; `row_bytes` = head_dim × element size). Block (layer·2·kv_heads + kind·kv_heads + head).
extern "C" __global__ void copy_block_prefix(unsigned char* pool, int src, int dst, int n, size_t block_bytes,
                                             int block_size, int row_bytes) {
  KURA_DEP();
  size_t run = (size_t)block_size * row_bytes;  // one head's slots
  size_t at = (size_t)blockIdx.x * run;
  const unsigned char* s = pool + (size_t)src * block_bytes + at;
  unsigned char* d = pool + (size_t)dst * block_bytes + at;
  size_t len = (size_t)n * row_bytes;
  for (size_t i = threadIdx.x; i < len; i += blockDim.x) d[i] = s[i];
}

// The same for an fp8 pool: in each region (block (layer · 2 · kv_heads + kind · kv_heads + head)), the
// first n payload rows and the first n scale rows.
extern "C" __global__ void copy_block_prefix_fp8(unsigned char* pool, int src, int dst, int n, size_t block_bytes,
                                                 int block_size, int head_dim) {
  KURA_DEP();
  size_t run = (size_t)block_size * (head_dim + (head_dim / 64) * 2);
  size_t at = (size_t)blockIdx.x * run;
  const unsigned char* s = pool + (size_t)src * block_bytes + at;
  unsigned char* d = pool + (size_t)dst * block_bytes + at;
  size_t payload = (size_t)n * head_dim, scales_at = (size_t)block_size * head_dim,
         scales = (size_t)n * (head_dim / 64) * 2;
  for (size_t i = threadIdx.x; i < payload; i += blockDim.x) d[i] = s[i];
  for (size_t i = threadIdx.x; i < scales; i += blockDim.x) d[scales_at + i] = s[scales_at + i];
}

// ---------------------------------------------------------------------------------------------------
// Seeded pseudo-random bf16 values, uniform in [-scale, scale): weights of a model of a given shape
// made on the device (benchmarks), the same for the same seed.
extern "C" __global__ void fill_random_bf16(bf16* out, size_t n, u64 seed, float scale) {
  KURA_DEP();
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    u64 z = seed + 0x9E3779B97F4A7C15ull * (i + 1);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    float u = (float)(z >> 40) * (1.0f / 16777216.0f);  // [0, 1)
    out[i] = __float2bfloat16((2.f * u - 1.f) * scale);
  }
}
