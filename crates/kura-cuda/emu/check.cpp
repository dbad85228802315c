// Kura's CUDA kernels run on the CPU (`emu.h`): the claims that need no GPU's own arithmetic.
// - The prefill attention kernels (8 warps, the wide one of 4 warps of 32 rows, the half-tile one of 4
//   warps of 16 rows, the small one: half tiles over the wide kernel's key tiles, and the 8-warp and
//   half-tile ones with three stages) agree with attention computed in double from the same K/V, over
//   paged blocks in shuffled order, a cached prefix, several sequences, a sliding window, bf16 / f32 /
//   fp8 pools; the half-tile kernel and both three-stage ones give the 8-warp kernel's bits, the small
//   one the wide one's, and at head size 64 all six give the same; the 8-warp and half-tile kernels on
//   warpgroup products (`wgmma`, its descriptors decoded as the PTX ISA lays out B) give the 8-warp
//   kernel's bits;
//   the timing probes (the 8-warp kernel with a part left out) keep what they do not leave out.
// - The split-key kernel with its merge fused (the last block of a token's KV head merges) gives the
//   bits of the split kernel and `attn_merge`, whatever the order blocks finish in, leaves its counters
//   at zero, and agrees with attention in double.
// - The matrix-vector kernels that norm their input (`gemv_norm_T`, `gemv_swiglu_norm_T`) give the bits
//   of `rms_norm`, `gemv_T` and `silu_mul`, on grids smaller than their rows (grid-stride); the L2
//   window's (`gemv_ahead_T`) and the staged copies' (`gemv_batched_T`) forms give `gemv_T`'s.
// Built and run by `cargo test -p kura-cuda --test emulated`; prints one line per check, exits 1 on a
// failed check (naming it) and 3 on a fault the emulation caught (a divergent barrier, a copy never
// waited for).
#include "emu.h"
#include "../kernels/kura.cu"

#include <cstdarg>
#include <type_traits>
#include <string>

static int failures = 0;
static void check(bool ok, const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  std::printf("%s: ", ok ? "ok" : "FAILED");
  std::vprintf(fmt, ap);
  std::printf("\n");
  va_end(ap);
  if (!ok) failures++;
}

struct Rng {
  uint64_t s;
  uint64_t next() {
    uint64_t z = (s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  float uniform() { return (float)(next() >> 40) * (1.0f / 16777216.0f) * 2.f - 1.f; }
  int below(int n) { return (int)(next() % (uint64_t)n); }
};

template <typename T> static void shuffle(std::vector<T>& v, Rng& r) {
  for (size_t i = v.size(); i > 1; i--) std::swap(v[i - 1], v[r.below((int)i)]);
}
static std::vector<dim3> all_blocks(dim3 g, Rng* shuffled) {
  std::vector<dim3> order;
  for (unsigned z = 0; z < g.z; z++)
    for (unsigned y = 0; y < g.y; y++)
      for (unsigned x = 0; x < g.x; x++) order.push_back({x, y, z});
  if (shuffled) shuffle(order, *shuffled);
  return order;
}

// ---------------------------------------------------------------------------------------------------
// A paged KV pool of one element type, filled with random K/V for every (block, layer, kind, head, slot).
enum class Kv { Bf16, F32, Fp8 };
static const char* kv_name(Kv k) { return k == Kv::Bf16 ? "bf16" : k == Kv::F32 ? "f32" : "fp8"; }

struct Pool {
  Kv kv;
  PoolShape shape;
  int blocks;
  std::vector<unsigned char> bytes;  // the device pool's bytes
  size_t row_bytes() const {
    int d = shape.head_dim;
    return kv == Kv::Bf16 ? 2 * d : kv == Kv::F32 ? 4 * d : d;
  }
  size_t block_bytes() const {
    size_t per_row = kv == Kv::Fp8 ? shape.head_dim + (shape.head_dim / 64) * 2 : row_bytes();
    return (size_t)shape.layers * 2 * shape.kv_heads * shape.block_size * per_row;
  }
  Pool(Kv kv, PoolShape s, int blocks, Rng& r) : kv(kv), shape(s), blocks(blocks) {
    bytes.assign(block_bytes() * blocks, 0);
    int d = s.head_dim;
    for (int b = 0; b < blocks; b++)
      for (int l = 0; l < s.layers; l++)
        for (int kind = 0; kind < 2; kind++)
          for (int h = 0; h < s.kv_heads; h++)
            for (int slot = 0; slot < s.block_size; slot++) {
              std::vector<float> v(d);
              for (auto& x : v) x = r.uniform() * (kind == 0 ? 2.f : 1.f);
              put(b, l, kind, h, slot, v);
            }
  }
  void put(int b, int l, int kind, int h, int slot, const std::vector<float>& v) {
    int d = shape.head_dim;
    if (kv == Kv::Fp8) {
      size_t region = fp8_region(shape, b, l, kind, h);
      unsigned char* row = bytes.data() + region + (size_t)slot * d;
      unsigned char* sc = bytes.data() + region + (size_t)shape.block_size * d + (size_t)slot * (d / 64) * 2;
      for (int g = 0; g < d / 64; g++) {
        float m = 0.f;
        for (int j = 0; j < 64; j++) m = std::max(m, std::fabs(v[64 * g + j]));
        __half scale = __float2half_rn(m / 448.f);
        std::memcpy(sc + 2 * g, &scale.x, 2);
        float s = __half2float(scale);
        for (int j = 0; j < 64; j++)
          row[64 * g + j] = __nv_cvt_float_to_fp8(s > 0 ? v[64 * g + j] / s : 0.f, __NV_SATFINITE, __NV_E4M3);
      }
      return;
    }
    size_t at = pool_at(shape, b, l, kind, h, slot);
    for (int j = 0; j < d; j++) {
      if (kv == Kv::Bf16) {
        bf16 x = __float2bfloat16(v[j]);
        std::memcpy(bytes.data() + 2 * (at + j), &x, 2);
      } else {
        std::memcpy(bytes.data() + 4 * (at + j), &v[j], 4);
      }
    }
  }
  // The value attention reads at (block, layer, kind, head, slot, j).
  double get(int b, int l, int kind, int h, int slot, int j) const {
    int d = shape.head_dim;
    if (kv == Kv::Fp8) {
      size_t region = fp8_region(shape, b, l, kind, h);
      unsigned char x = bytes[region + (size_t)slot * d + j];
      __half scale;
      std::memcpy(&scale.x, bytes.data() + region + (size_t)shape.block_size * d + (size_t)slot * (d / 64) * 2 + (j / 64) * 2, 2);
      __half2_raw hr = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)x, __NV_E4M3);
      return (double)__half2float(__half{hr.x}) * __half2float(scale);
    }
    size_t at = pool_at(shape, b, l, kind, h, slot) + j;
    if (kv == Kv::Bf16) {
      bf16 x;
      std::memcpy(&x, bytes.data() + 2 * at, 2);
      return __bfloat162float(x);
    }
    float x;
    std::memcpy(&x, bytes.data() + 4 * at, 4);
    return x;
  }
};

struct Seq {
  int start, n;           // cached positions, new tokens
  std::vector<int> table;  // block of each block_size positions
};

static std::vector<bf16> random_bf16(size_t n, Rng& r, float scale = 1.f) {
  std::vector<bf16> v(n);
  for (auto& x : v) x = __float2bfloat16(r.uniform() * scale);
  return v;
}
static bool same_bits(const void* a, const void* b, size_t bytes) { return std::memcmp(a, b, bytes) == 0; }

// out[row][head] of attention in double over the pool, for query row `row` at position `pos`.
static void reference(const Pool& p, const Seq& s, const std::vector<bf16>& q, int row, int pos, int heads, int layer,
                      int window, std::vector<double>& out) {
  int d = p.shape.head_dim, group = heads / p.shape.kv_heads, bs = p.shape.block_size;
  int lo = window > 0 ? std::max(0, pos + 1 - window) : 0;
  out.assign((size_t)heads * d, 0.0);
  double scale = 1.0 / std::sqrt((double)d);
  for (int h = 0; h < heads; h++) {
    int kvh = h / group;
    std::vector<double> w(pos + 1 - lo);
    double m = -1e300;
    for (int k = lo; k <= pos; k++) {
      double sc = 0;
      for (int j = 0; j < d; j++)
        sc += (double)__bfloat162float(q[((size_t)row * heads + h) * d + j]) * p.get(s.table[k / bs], layer, 0, kvh, k % bs, j);
      w[k - lo] = sc * scale;
      m = std::max(m, w[k - lo]);
    }
    double l = 0;
    for (auto& x : w) l += (x = std::exp(x - m));
    for (int k = lo; k <= pos; k++)
      for (int j = 0; j < d; j++)
        out[(size_t)h * d + j] += w[k - lo] / l * p.get(s.table[k / bs], layer, 1, kvh, k % bs, j);
  }
}

// Largest |got − want| over rows `rows` of an output [row][heads][d] in bf16.
static double worst_error(const std::vector<bf16>& got, const Pool& p, const std::vector<Seq>& seqs,
                          const std::vector<bf16>& q, int heads, int layer, int window) {
  int d = p.shape.head_dim;
  double worst = 0;
  int row = 0;
  std::vector<double> want;
  for (const Seq& s : seqs) {
    for (int i = 0; i < s.n; i++, row++) {
      reference(p, s, q, row, s.start + i, heads, layer, window, want);
      for (int j = 0; j < heads * d; j++)
        worst = std::max(worst, std::fabs((double)__bfloat162float(got[(size_t)row * heads * d + j]) - want[j]));
    }
  }
  return worst;
}

// Sequences with tables into `blocks` shuffled blocks.
static std::vector<Seq> make_seqs(const std::vector<std::pair<int, int>>& shape, int bs, int blocks, Rng& r) {
  std::vector<int> free(blocks);
  for (int i = 0; i < blocks; i++) free[i] = i;
  shuffle(free, r);
  std::vector<Seq> seqs;
  size_t next = 0;
  for (auto [start, n] : shape) {
    Seq s{start, n, {}};
    for (int b = 0; b < (start + n + bs - 1) / bs; b++) s.table.push_back(free.at(next++));
    seqs.push_back(s);
  }
  return seqs;
}

static int blocks_needed(const std::vector<std::pair<int, int>>& shape, int bs) {
  int n = 0;
  for (auto [start, len] : shape) n += (start + len + bs - 1) / bs;
  return n;
}

// ---------------------------------------------------------------------------------------------------
template <typename KVT>
static void prefill_case(Kv kv, int d, int bs, int window, Rng& r, int group = 2) {
  const int kv_heads = 2, heads = kv_heads * group, layers = 2, layer = 1;
  std::vector<std::pair<int, int>> shape = {{0, 150}, {77, 130}};
  PoolShape ps{layers, kv_heads, bs, d};
  Pool pool(kv, ps, blocks_needed(shape, bs) + 3, r);
  std::vector<Seq> seqs = make_seqs(shape, bs, pool.blocks, r);
  // The step's metadata as the executor packs it: tiles of 128 rows, then the tables.
  std::vector<int> tile_info, tables;
  int row = 0;
  for (const Seq& s : seqs) {
    int toff = (int)tables.size();
    tables.insert(tables.end(), s.table.begin(), s.table.end());
    for (int r0 = 0; r0 < s.n; r0 += 128) tile_info.insert(tile_info.end(), {row + r0, std::min(128, s.n - r0), s.start + r0, toff});
    row += s.n;
  }
  int tiles = (int)tile_info.size() / 4, rows = row;
  std::vector<bf16> q = random_bf16((size_t)rows * heads * d, r);
  float scale_log2 = (1.f / std::sqrt((float)d)) * 1.4426950408889634f;
  const KVT* pv = reinterpret_cast<const KVT*>(pool.bytes.data());
  // Kernel 0: 8 warps; 1: wide; 2: half tiles; 3: small (half tiles over the wide kernel's key tiles);
  // 4: deep (8 warps, three stages); 5: half tiles with three stages; 6: 8 warps on warpgroup products;
  // 7: half tiles on warpgroup products; 8 and 9: 6 and 7 with a tile's score product and softmax
  // overlapping the value product of the tile before (three stages).
  auto run = [&](int kind, int mask_all) {
    bool wide = kind == 1, halves = kind == 2 || kind == 3 || kind == 5 || kind == 7 || kind == 9, wg = kind >= 6;
    std::vector<bf16> out((size_t)rows * heads * d, __float2bfloat16(NAN));
    int nk = kind == 1 || kind == 3 ? WIDE_NK(d) : BC, stages = kind == 4 || kind == 5 || kind >= 8 ? 3 : 2;
    size_t smem = (size_t)stages * 2 * nk * (wg ? d : d + 8) * 2 + (wide ? (size_t)128 * (d + 8) * 2 : 0);
    using Kernel = void (*)(const bf16*, const KVT*, const int*, const int*, bf16*, PoolShape, int, int, int, float, int,
                            int);
    Kernel kernels64[10] = {attn_prefill<KVT, 64, 1, BC, 1>, attn_prefill<KVT, 64, 2, WIDE_NK(64), 1>,
                           attn_prefill<KVT, 64, 1, BC, 2>, attn_prefill<KVT, 64, 1, WIDE_NK(64), 2>,
                           attn_prefill<KVT, 64, 1, BC, 1, PROBE_NONE, 3>, attn_prefill<KVT, 64, 1, BC, 2, PROBE_NONE, 3>,
                           attn_prefill<KVT, 64, 1, BC, 1, PROBE_NONE, 2, 1>,
                           attn_prefill<KVT, 64, 1, BC, 2, PROBE_NONE, 2, 1>,
                           attn_prefill<KVT, 64, 1, BC, 1, PROBE_NONE, 3, 2>,
                           attn_prefill<KVT, 64, 1, BC, 2, PROBE_NONE, 3, 2>};
    Kernel kernels128[10] = {attn_prefill<KVT, 128, 1, BC, 1>, attn_prefill<KVT, 128, 2, WIDE_NK(128), 1>,
                            attn_prefill<KVT, 128, 1, BC, 2>, attn_prefill<KVT, 128, 1, WIDE_NK(128), 2>,
                            attn_prefill<KVT, 128, 1, BC, 1, PROBE_NONE, 3>,
                            attn_prefill<KVT, 128, 1, BC, 2, PROBE_NONE, 3>,
                            attn_prefill<KVT, 128, 1, BC, 1, PROBE_NONE, 2, 1>,
                            attn_prefill<KVT, 128, 1, BC, 2, PROBE_NONE, 2, 1>,
                            attn_prefill<KVT, 128, 1, BC, 1, PROBE_NONE, 3, 2>,
                            attn_prefill<KVT, 128, 1, BC, 2, PROBE_NONE, 3, 2>};
    Kernel kernel = d == 64 ? kernels64[kind] : kernels128[kind];
    dim3 grid{(unsigned)(halves ? 2 * tiles : tiles), (unsigned)heads, 1};
    emu::launch(grid, {kind == 0 || kind == 4 || kind == 6 || kind == 8 ? 256u : 128u, 1, 1}, smem, [&] {
      kernel(q.data(), pv, tables.data(), tile_info.data(), out.data(), ps, layer, heads, window, scale_log2, tiles, mask_all);
    }, all_blocks(grid, &r));
    return out;
  };
  auto narrow = run(0, 0), wide = run(1, 0), masked = run(0, 1), half = run(2, 0), small = run(3, 0), deep = run(4, 0),
       halfdeep = run(5, 0), wg = run(6, 0), halfwg = run(7, 0), wgpipe = run(8, 0), halfwgpipe = run(9, 0);
  double en = worst_error(narrow, pool, seqs, q, heads, layer, window);
  double ew = worst_error(wide, pool, seqs, q, heads, layer, window);
  // bf16 output (8 bits of mantissa) of values within [-1, 1], and P rounded to bf16 for the product.
  const double tol = 2e-2;
  std::string what = std::string("prefill ") + kv_name(kv) + " d=" + std::to_string(d) + " group " + std::to_string(group) + " block " + std::to_string(bs) +
                     " window " + std::to_string(window);
  check(en < tol, "%s: 8-warp kernel within %.4f of attention in double (tolerance %.3f)", what.c_str(), en, tol);
  check(ew < tol, "%s: wide kernel within %.4f of attention in double (tolerance %.3f)", what.c_str(), ew, tol);
  check(same_bits(narrow.data(), masked.data(), narrow.size() * 2), "%s: masking every tile gives the same bits",
        what.c_str());
  check(same_bits(narrow.data(), half.data(), narrow.size() * 2),
        "%s: the half-tile kernel gives the 8-warp kernel's bits", what.c_str());
  check(same_bits(wide.data(), small.data(), wide.size() * 2), "%s: the small kernel gives the wide kernel's bits",
        what.c_str());
  check(same_bits(narrow.data(), deep.data(), narrow.size() * 2),
        "%s: the 8-warp kernel with three stages gives its bits", what.c_str());
  check(same_bits(narrow.data(), halfdeep.data(), narrow.size() * 2),
        "%s: the half-tile kernel with three stages gives the 8-warp kernel's bits", what.c_str());
  check(same_bits(narrow.data(), wg.data(), narrow.size() * 2),
        "%s: the 8-warp kernel on warpgroup products gives its bits", what.c_str());
  check(same_bits(narrow.data(), halfwg.data(), narrow.size() * 2),
        "%s: the half-tile kernel on warpgroup products gives the 8-warp kernel's bits", what.c_str());
  check(same_bits(narrow.data(), wgpipe.data(), narrow.size() * 2),
        "%s: the 8-warp kernel on overlapped warpgroup products gives its bits", what.c_str());
  check(same_bits(narrow.data(), halfwgpipe.data(), narrow.size() * 2),
        "%s: the half-tile kernel on overlapped warpgroup products gives the 8-warp kernel's bits", what.c_str());
  if (d == 64)
    check(same_bits(narrow.data(), wide.data(), narrow.size() * 2), "%s: the wide kernel gives the 8-warp kernel's bits",
          what.c_str());
  if constexpr (std::is_same_v<KVT, bf16>) {
    // The timing probes: the 8-warp kernel with a part left out. Without copies after the first tile,
    // the rows that see only the first key tile (the first sequence's first 64) keep their bits and
    // later rows change; without the softmax (no row sums), and without products, every row is zero.
    auto probe = [&](auto kernel) {
      std::vector<bf16> out((size_t)rows * heads * d, __float2bfloat16(NAN));
      dim3 grid{(unsigned)tiles, (unsigned)heads, 1};
      emu::launch(grid, {256u, 1, 1}, (size_t)2 * 2 * BC * (d + 8) * 2, [&] {
        kernel(q.data(), pv, tables.data(), tile_info.data(), out.data(), ps, layer, heads, window, scale_log2, tiles, 0);
      }, all_blocks(grid, &r));
      return out;
    };
    auto probes = [&](auto noload, auto nosoftmax, auto loadonly, auto mmaonly) {
      auto nl = probe(noload);
      size_t first = (size_t)std::min(64, seqs[0].n) * heads * d;
      check(same_bits(narrow.data(), nl.data(), first * 2) && !same_bits(narrow.data(), nl.data(), nl.size() * 2),
            "%s: the probe without copies keeps the rows of the first key tile only", what.c_str());
      const char* names[3] = {"without the softmax", "of the copies alone", "of the products alone"};
      std::vector<bf16> outs[3] = {probe(nosoftmax), probe(loadonly), probe(mmaonly)};
      for (int i = 0; i < 3; i++) {
        bool zero = true;
        for (bf16 x : outs[i]) zero = zero && __bfloat162float(x) == 0.f;
        check(zero, "%s: the probe %s writes every row, zeros", what.c_str(), names[i]);
      }
    };
    if (d == 64)
      probes(attn_prefill<bf16, 64, 1, BC, 1, PROBE_NO_LOAD>, attn_prefill<bf16, 64, 1, BC, 1, PROBE_NO_SOFTMAX>,
             attn_prefill<bf16, 64, 1, BC, 1, PROBE_LOAD_ONLY>, attn_prefill<bf16, 64, 1, BC, 1, PROBE_MMA_ONLY>);
    else
      probes(attn_prefill<bf16, 128, 1, BC, 1, PROBE_NO_LOAD>, attn_prefill<bf16, 128, 1, BC, 1, PROBE_NO_SOFTMAX>,
             attn_prefill<bf16, 128, 1, BC, 1, PROBE_LOAD_ONLY>, attn_prefill<bf16, 128, 1, BC, 1, PROBE_MMA_ONLY>);
  }
}

// ---------------------------------------------------------------------------------------------------
template <typename KVT, int D, int G>
static void split_case(Kv kv, int bs, int window, Rng& r, int group = G) {
  const int kv_heads = 2, heads = kv_heads * group, layers = 2, layer = 1;
  // Decode tokens (one new token each) at contexts of 1 to 2 splits ... 8 splits, and a 3-token chunk.
  std::vector<std::pair<int, int>> shape = {{0, 1}, {300, 1}, {128, 1}, {900, 1}, {40, 3}};
  PoolShape ps{layers, kv_heads, bs, D};
  Pool pool(kv, ps, blocks_needed(shape, bs) + 2, r);
  std::vector<Seq> seqs = make_seqs(shape, bs, pool.blocks, r);
  std::vector<int> tok_info, tables;
  int row = 0, max_splits = 0;
  for (const Seq& s : seqs) {
    int toff = (int)tables.size();
    tables.insert(tables.end(), s.table.begin(), s.table.end());
    for (int i = 0; i < s.n; i++) {
      int qpos = s.start + i, lo = window > 0 ? std::max(0, qpos + 1 - window) : 0;
      max_splits = std::max(max_splits, (qpos + 1 - lo + SPLIT - 1) / SPLIT);
      tok_info.insert(tok_info.end(), {row + i, qpos, toff, lo});
    }
    row += s.n;
  }
  int p2 = 1;
  while (p2 < max_splits) p2 <<= 1;
  max_splits = p2;
  int tokens = (int)tok_info.size() / 4, rows = row;
  std::vector<bf16> q = random_bf16((size_t)rows * heads * D, r);
  float scale_log2 = (1.f / std::sqrt((float)D)) * 1.4426950408889634f;
  const KVT* pv = reinterpret_cast<const KVT*>(pool.bytes.data());
  std::vector<float> part((size_t)tokens * heads * max_splits * (D + 2));
  std::vector<int> arrive((size_t)tokens * kv_heads, 0);
  dim3 grid{(unsigned)tokens, (unsigned)kv_heads, (unsigned)max_splits};
  auto split = [&](int fuse, std::vector<bf16>& out) {
    emu::launch(grid, {128, 1, 1}, 0, [&] {
      attn_split<KVT, D, G>(q.data(), pv, tables.data(), tok_info.data(), part.data(), ps, layer, heads, max_splits,
                            scale_log2, arrive.data(), out.data(), fuse);
    }, all_blocks(grid, &r));
  };
  std::vector<bf16> separate((size_t)rows * heads * D, __float2bfloat16(NAN)), fused = separate, again = separate;
  split(0, separate);
  dim3 mgrid{(unsigned)tokens, (unsigned)heads, 1};
  emu::launch(mgrid, {(unsigned)D, 1, 1}, 0, [&] { attn_merge(part.data(), tok_info.data(), separate.data(), heads, max_splits, D); },
              all_blocks(mgrid, &r));
  split(SPLIT_MERGE | SPLIT_PREFETCH, fused);
  bool zero = std::all_of(arrive.begin(), arrive.end(), [](int c) { return c == 0; });
  split(SPLIT_MERGE, again);
  std::string what = std::string("split-key ") + kv_name(kv) + " d=" + std::to_string(D) + " group " + std::to_string(group) +
                     " block " + std::to_string(bs) + " window " + std::to_string(window);
  double e = worst_error(separate, pool, seqs, q, heads, layer, window);
  check(e < 1e-2, "%s: split + merge within %.5f of attention in double (tolerance 0.01)", what.c_str(), e);
  check(same_bits(separate.data(), fused.data(), separate.size() * 2),
        "%s: the fused merge (blocks in shuffled order) gives the bits of attn_merge", what.c_str());
  check(zero, "%s: the fused merge leaves every arrival counter at zero", what.c_str());
  check(same_bits(separate.data(), again.data(), separate.size() * 2), "%s: a second fused launch gives the same bits",
        what.c_str());
}

// ---------------------------------------------------------------------------------------------------
template <int T>
static void gemv_case(int k, int n, int inter, int grid_blocks, Rng& r) {
  const float eps = 1e-5f;
  std::vector<float> x((size_t)(T + 2) * k), nw(k);
  for (auto& v : x) v = r.uniform() * 3.f;
  for (auto& v : nw) v = 1.f + 0.5f * r.uniform();
  std::vector<bf16> w = random_bf16((size_t)n * k, r, 0.1f), wgu = random_bf16((size_t)2 * inter * k, r, 0.1f);
  // Rows T+1, 0, 2, ... of x (an index list, as the output head's last tokens), and the first T.
  std::vector<int> rows(T);
  for (int t = 0; t < T; t++) rows[t] = t == 0 ? T + 1 : t - 1 + (t > 1);
  // The separate kernels: rms_norm of rows `idx` (or the first T) into bf16, gemv_T into f32.
  auto norm = [&](const int* idx) {
    std::vector<bf16> xn((size_t)T * k);
    emu::launch({(unsigned)T, 1, 1}, {NORM_THREADS, 1, 1}, 0, [&] { rms_norm(x.data(), idx, nw.data(), xn.data(), k, eps); });
    return xn;
  };
  auto product = [&](const std::vector<bf16>& wt, int rows_out, const std::vector<bf16>& xn) {
    std::vector<float> y((size_t)T * rows_out, NAN);
    emu::launch({(unsigned)((rows_out + 7) / 8), 1, 1}, {256, 1, 1}, 0,
                [&] { gemv<T, GEMV_PLAIN>(wt.data(), xn.data(), y.data(), rows_out, k, 0); });
    return y;
  };
  // gemv_ahead_T (the L2 window) and gemv_batched_T (a lane's chunks staged in batches) give gemv_T's bits,
  // adding to y as well as writing it.
  {
    std::vector<bf16> xn = norm(nullptr);
    for (int accumulate : {0, 1}) {
      std::vector<float> y4((size_t)T * n), y8, yb;
      for (auto& v : y4) v = r.uniform();
      y8 = y4;
      yb = y4;
      dim3 g{(unsigned)((n + 7) / 8), 1, 1}, b{256, 1, 1};
      emu::launch(g, b, 0, [&] { gemv<T, GEMV_PLAIN>(w.data(), xn.data(), y4.data(), n, k, accumulate); });
      emu::launch(g, b, 0, [&] { gemv<T, GEMV_AHEAD>(w.data(), xn.data(), y8.data(), n, k, accumulate); });
      emu::launch(g, b, 0, [&] { gemv<T, GEMV_BATCHED>(w.data(), xn.data(), yb.data(), n, k, accumulate); });
      check(same_bits(y4.data(), y8.data(), y4.size() * 4), "gemv_ahead_%d (%d rows of %d, accumulate %d): the bits of gemv_%d",
            T, n, k, accumulate, T);
      check(same_bits(y4.data(), yb.data(), y4.size() * 4),
            "gemv_batched_%d (%d rows of %d, accumulate %d): the bits of gemv_%d", T, n, k, accumulate, T);
    }
  }
  // A fused kernel, on `grid_blocks` blocks (fewer than its rows need: grid-stride) in shuffled order.
  const dim3 g{(unsigned)grid_blocks, 1, 1};
  auto fused = [&](const std::function<void()>& kernel) {
    emu::launch(g, {NORM_THREADS, 1, 1}, (size_t)T * k * 2, kernel, all_blocks(g, &r));
  };
  std::vector<bf16> xn_first = norm(nullptr);
  for (const int* idx : {(const int*)nullptr, (const int*)rows.data()}) {
    std::vector<float> y_sep = product(w, n, idx ? norm(idx) : xn_first), y_fused((size_t)T * n, NAN);
    fused([&] { gemv_normed<T, false>(w.data(), x.data(), idx, nw.data(), eps, y_fused.data(), nullptr, n, k); });
    check(same_bits(y_sep.data(), y_fused.data(), y_sep.size() * 4),
          "gemv_norm_%d (%s rows, %d rows of %d on %d blocks): the bits of rms_norm + gemv_%d", T,
          idx ? "listed" : "first", n, k, grid_blocks, T);
  }
  // The FFN: rms_norm, gemv_T over [gate | up] into f32, silu_mul; against gemv_swiglu_norm_T.
  std::vector<float> gu = product(wgu, 2 * inter, xn_first);
  std::vector<bf16> act_sep((size_t)T * inter, __float2bfloat16(NAN)), act_fused = act_sep;
  int total = T * inter;
  emu::launch({(unsigned)((total / 4 + 255) / 256), 1, 1}, {256, 1, 1}, 0,
              [&] { silu_mul(gu.data(), act_sep.data(), inter, total); });
  fused([&] { gemv_normed<T, true>(wgu.data(), x.data(), nullptr, nw.data(), eps, nullptr, act_fused.data(), inter, k); });
  check(same_bits(act_sep.data(), act_fused.data(), act_sep.size() * 2),
        "gemv_swiglu_norm_%d (%d of %d on %d blocks): the bits of rms_norm + gemv_%d + silu_mul", T, inter, k, grid_blocks, T);
  // The sums themselves (the bf16 activations above hide most differences of an f32 sum): two rows at
  // once, as the FFN kernel takes gate and up, give each row's bits alone.
  // Rows of 4,096: each lane sums 16 pieces of 8, so the order of its multiply-adds matters.
  const int kl = 4096;
  const int pairs = 8;
  std::vector<bf16> rows2 = random_bf16((size_t)2 * pairs * kl, r), xl = random_bf16((size_t)T * kl, r);
  std::vector<float> two(2 * pairs * T), one(2 * pairs * T);
  emu::launch({1, 1, 1}, {32, 1, 1}, 0, [&] {
    for (int p = 0; p < pairs; p++) {
      const bf16 *r0 = rows2.data() + (size_t)2 * p * kl, *r1 = r0 + kl;
      float acc2[2][T], a0[1][T], a1[1][T];
      gemv_dots<T, 2>(r0, r1, xl.data(), kl, threadIdx.x & 31, acc2);
      gemv_dots<T, 1>(r0, r0, xl.data(), kl, threadIdx.x & 31, a0);
      gemv_dots<T, 1>(r1, r1, xl.data(), kl, threadIdx.x & 31, a1);
      if (threadIdx.x == 0)
        for (int t = 0; t < T; t++) {
          two[2 * p * T + t] = acc2[0][t], two[(2 * p + 1) * T + t] = acc2[1][t];
          one[2 * p * T + t] = a0[0][t], one[(2 * p + 1) * T + t] = a1[0][t];
        }
    }
  });
  check(same_bits(two.data(), one.data(), two.size() * 4), "gemv_dots<%d, 2>: each row's sum has the bits of gemv_dots<%d, 1>", T, T);
  // The staged copies over rows of whole batches (4,096: 16 chunks a lane, four batches), of a chunk
  // more for some lanes than others (2,400: 300 chunks, 9 or 10 a lane), of fewer chunks than a batch
  // (576: 2 or 3 a lane) and of the down product's 14,336 (56 a lane): each row's sum has the bits of
  // gemv_dots, the stages reused from row to row.
  for (int kb : {4096, 2400, 576, 14336}) {
    std::vector<bf16> wr = random_bf16((size_t)pairs * kb, r), xb = random_bf16((size_t)T * kb, r);
    std::vector<float> plain(pairs * T), batched(pairs * T);
    std::vector<uint4> stage(GEMV_STAGES * GEMV_BATCH * 32);
    emu::launch({1, 1, 1}, {32, 1, 1}, 0, [&] {
      for (int p = 0; p < pairs; p++) {
        const bf16* row = wr.data() + (size_t)p * kb;
        float a[1][T], bt[1][T];
        gemv_dots<T, 1>(row, row, xb.data(), kb, threadIdx.x & 31, a);
        gemv_dots_staged<T>(row, xb.data(), kb, threadIdx.x & 31, stage.data(), bt);
        if (threadIdx.x == 0)
          for (int t = 0; t < T; t++) plain[p * T + t] = a[0][t], batched[p * T + t] = bt[0][t];
      }
    });
    check(same_bits(plain.data(), batched.data(), plain.size() * 4),
          "gemv_dots_staged<%d> (rows of %d): each row's sum has the bits of gemv_dots<%d, 1>", T, kb, T);
  }
}

// ---------------------------------------------------------------------------------------------------
// Writing new tokens' K/V: `rope_kv_inplace` + `quant_store_fp8` (fp8 pools) against `rope_store_f32`.
static void store_case(int d, int bs, Rng& r) {
  const int kv_heads = 2, heads = 4, layers = 2, layer = 1, t = 5, half = d / 2, style = 0;
  PoolShape ps{layers, kv_heads, bs, d};
  int width = (heads + 2 * kv_heads) * d;
  std::vector<float> qkv((size_t)t * width), bias(width), cs((size_t)t * half), sn((size_t)t * half);
  for (auto& x : qkv) x = r.uniform() * 4.f;
  for (auto& x : bias) x = r.uniform() * 0.5f;
  // The first K head tiny (values and bias), so that its scales are small and f16 keeps them in its
  // own subnormals.
  for (int j = 0; j < d; j++) {
    bias[heads * d + j] *= 1e-5f;
    for (int i = 0; i < t; i++) qkv[(size_t)i * width + heads * d + j] *= 1e-5f;
  }
  for (size_t i = 0; i < cs.size(); i++) {
    float a = 3.f * r.uniform();
    cs[i] = std::cos(a), sn[i] = std::sin(a);
  }
  int blocks = 4;
  std::vector<int> slot_block;
  for (int i = 0; i < t; i++) slot_block.insert(slot_block.end(), {(i * 3 + 1) % blocks, (i * 5 + 2) % bs});
  Rng fill{7};
  Pool f32(Kv::F32, ps, blocks, fill), fp8(Kv::Fp8, ps, blocks, fill);
  std::vector<bf16> q32((size_t)t * heads * d), q8 = q32;
  int items = (heads + kv_heads) * half + kv_heads * d;
  dim3 grid{(unsigned)t, (unsigned)((items + 255) / 256), 1};
  emu::launch(grid, {256, 1, 1}, 0, [&] {
    rope_store_f32(qkv.data(), bias.data(), cs.data(), sn.data(), slot_block.data(), q32.data(),
                   reinterpret_cast<float*>(f32.bytes.data()), ps, layer, heads, style);
  });
  std::vector<float> work = qkv;
  emu::launch(grid, {256, 1, 1}, 0, [&] {
    rope_kv_inplace(work.data(), bias.data(), cs.data(), sn.data(), q8.data(), ps, heads, style);
  });
  emu::launch({(unsigned)t, (unsigned)(2 * kv_heads), 1}, {(unsigned)(d / 2), 1, 1}, 0, [&] {
    quant_store_fp8(work.data(), slot_block.data(), fp8.bytes.data(), ps, layer, heads);
  });
  std::string what = "K/V store d=" + std::to_string(d) + " block " + std::to_string(bs);
  check(same_bits(q32.data(), q8.data(), q32.size() * 2), "%s: q of rope_kv_inplace has the bits of rope_store", what.c_str());
  bool scales_ok = true, values_ok = true;
  double worst = 0;
  for (int i = 0; i < t; i++) {
    int b = slot_block[2 * i], slot = slot_block[2 * i + 1];
    for (int kind = 0; kind < 2; kind++)
      for (int h = 0; h < kv_heads; h++)
        for (int g = 0; g < d / 64; g++) {
          double amax = 0;
          for (int j = 64 * g; j < 64 * g + 64; j++) amax = std::max(amax, std::fabs(f32.get(b, layer, kind, h, slot, j)));
          __half want = __float2half_rn((float)amax / 448.f), got;
          size_t region = fp8_region(ps, b, layer, kind, h);
          std::memcpy(&got.x, fp8.bytes.data() + region + (size_t)bs * d + (size_t)slot * (d / 64) * 2 + 2 * g, 2);
          scales_ok &= got.x == want.x;
          float sf = __half2float(got), inv = sf > 0.f ? 1.f / sf : 0.f;
          for (int j = 64 * g; j < 64 * g + 64; j++) {
            // Each byte is the f32 value times the inverse of the stored scale, rounded to e4m3.
            double x = f32.get(b, layer, kind, h, slot, j), y = fp8.get(b, layer, kind, h, slot, j);
            unsigned char byte = fp8.bytes[region + (size_t)slot * d + j];
            values_ok &= byte == __nv_cvt_float_to_fp8((float)x * inv, __NV_SATFINITE, __NV_E4M3);
            if (h > 0) worst = std::max(worst, std::fabs(x - y) / std::max(std::fabs(x), 1e-30));
          }
        }
  }
  check(scales_ok, "%s: each group's f16 scale is its largest magnitude over 448", what.c_str());
  check(values_ok && worst < 1.0 / 16 + 1e-3,
        "%s: every byte is the f32 store's value over its scale in e4m3 (worst relative error %.4f where the "
        "scale is an f16 normal)",
        what.c_str(), worst);
}

// ---------------------------------------------------------------------------------------------------
// Greedy sampling: the first index of each row's largest logit, as the host's `sampling::argmax` finds it
// (a walk from the first logit that moves on to each strictly greater one: NaN is never the largest unless
// it comes first, and a row of only NaN or -inf gives 0).
static void argmax_case(Rng& r) {
  const int vocab = 5000, rows = 7;
  std::vector<float> logits((size_t)rows * vocab);
  for (auto& x : logits) x = r.uniform() * 10.f;
  float* row = logits.data();
  row[4321] = 50.f, row[17] = 50.f;  // a tie: the first wins
  row = logits.data() + vocab;
  for (int i = 0; i < vocab; i++) row[i] = (i % 3) ? NAN : -INFINITY;  // nothing to choose
  row = logits.data() + 2 * vocab;
  row[vocab - 1] = 1e30f;  // the last index
  row = logits.data() + 3 * vocab;
  for (int i = 0; i < vocab; i++) row[i] = i == 2500 ? 3.f : NAN;  // NaN first, beside one number
  row = logits.data() + 4 * vocab;
  for (int i = 0; i < vocab; i++) row[i] = i == 0 ? -INFINITY : i == 3000 ? -3.4028235e38f : NAN;
  row = logits.data() + 5 * vocab;
  for (int i = 0; i < vocab; i++) row[i] = i % 7 ? NAN : -1.f;  // NaN among equal numbers
  row[4998] = -0.5f;
  row = logits.data() + 6 * vocab;
  for (int i = 0; i < vocab; i++) row[i] = -INFINITY;
  std::vector<int> want(rows);
  for (int i = 0; i < rows; i++) {
    const float* x = logits.data() + (size_t)i * vocab;
    int best = 0;
    for (int j = 1; j < vocab; j++)
      if (x[j] > x[best]) best = j;
    want[i] = best;
  }
  check(want[0] == 17 && want[1] == 0 && want[2] == vocab - 1 && want[3] == 0 && want[4] == 3000 && want[5] == 4998 &&
            want[6] == 0,
        "argmax: the host's walk finds the cases meant");
  // Segments of the executor's 4,096 (two a row), of 512 (ten: the tie, the NaN and -inf runs across
  // segments), of 4,000 (a short last one) and of 333 (not whole 16-byte chunks: a logit a load), the
  // segments' blocks in shuffled order.
  for (int seg : {4096, 512, 4000, 333}) {
    int segs = (vocab + seg - 1) / seg;
    std::vector<float> part((size_t)rows * segs * 2, NAN);
    std::vector<u32> got(rows, 0xdeadbeef);
    dim3 g{(unsigned)rows, (unsigned)segs, 1};
    emu::launch(g, {256, 1, 1}, 0, [&] { argmax_part(logits.data(), part.data(), vocab, seg); }, all_blocks(g, &r));
    emu::launch({(unsigned)rows, 1, 1}, {32, 1, 1}, 0,
                [&] { argmax_merge(logits.data(), part.data(), got.data(), vocab, segs); });
    bool ok = true;
    for (int i = 0; i < rows; i++) ok &= got[i] == (u32)want[i];
    check(ok,
          "argmax_part + argmax_merge (segments of %d): the first largest logit of each row, as the host's walk "
          "finds it (a tie, the last index, NaN first, -inf first, NaN among numbers, a row of -inf)",
          seg);
  }
}

// ---------------------------------------------------------------------------------------------------
// Copy-on-write of a partial block: the first n slots of every region of block src into dst, the rest of
// dst untouched (bf16 and fp8 pools).
static void copy_case(Kv kv, Rng& r) {
  PoolShape ps{3, 2, 16, 128};
  Pool pool(kv, ps, 4, r);
  std::vector<unsigned char> before = pool.bytes;
  const int src = 3, dst = 1, n = 9;
  int runs = ps.layers * 2 * ps.kv_heads;
  emu::launch({(unsigned)runs, 1, 1}, {256, 1, 1}, 0, [&] {
    if (kv == Kv::Fp8)
      copy_block_prefix_fp8(pool.bytes.data(), src, dst, n, pool.block_bytes(), ps.block_size, ps.head_dim);
    else
      copy_block_prefix(pool.bytes.data(), src, dst, n, pool.block_bytes(), ps.block_size, (int)pool.row_bytes());
  });
  bool ok = true;
  for (int l = 0; l < ps.layers; l++)
    for (int kind = 0; kind < 2; kind++)
      for (int h = 0; h < ps.kv_heads; h++)
        for (int slot = 0; slot < ps.block_size; slot++)
          for (int j = 0; j < ps.head_dim; j++) {
            double want = slot < n ? pool.get(src, l, kind, h, slot, j) : 0;
            if (slot < n) ok &= pool.get(dst, l, kind, h, slot, j) == want;
          }
  // Bytes outside dst's copied slots are as before.
  Pool old = pool;
  old.bytes = before;
  for (int l = 0; l < ps.layers; l++)
    for (int kind = 0; kind < 2; kind++)
      for (int h = 0; h < ps.kv_heads; h++)
        for (int slot = n; slot < ps.block_size; slot++)
          for (int j = 0; j < ps.head_dim; j++) ok &= pool.get(dst, l, kind, h, slot, j) == old.get(dst, l, kind, h, slot, j);
  size_t bb = pool.block_bytes();
  for (int b = 0; b < pool.blocks; b++)
    if (b != dst) ok &= std::memcmp(pool.bytes.data() + b * bb, before.data() + b * bb, bb) == 0;
  check(ok, "copy_block_prefix%s: the first %d slots of every region copied, nothing else written",
        kv == Kv::Fp8 ? "_fp8" : "", n);
}

int main() {
  Rng r{12345};
  prefill_case<bf16>(Kv::Bf16, 64, 16, 0, r);
  prefill_case<bf16>(Kv::Bf16, 64, 7, 0, r);
  prefill_case<bf16>(Kv::Bf16, 64, 16, 100, r);
  prefill_case<bf16>(Kv::Bf16, 128, 16, 0, r);
  prefill_case<float>(Kv::F32, 64, 16, 0, r);
  prefill_case<float>(Kv::F32, 128, 3, 20, r);
  prefill_case<bf16>(Kv::Bf16, 64, 1, 0, r);
  prefill_case<unsigned char>(Kv::Fp8, 64, 16, 0, r);
  prefill_case<unsigned char>(Kv::Fp8, 128, 8, 70, r);
  prefill_case<bf16>(Kv::Bf16, 128, 16, 0, r, 7);
  // Again with every cp.async copy landing as it is issued (the earliest a GPU may deliver it) and each
  // warp running on to the next barrier before the next warp starts: a copy into a stage that another
  // warp still reads before the barrier that should guard it (a stage reused a tile too soon) changes
  // that warp's keys, and the kernel's outputs with them.
  std::printf("copies landing as they are issued, each warp running ahead to the next barrier:\n");
  emu::emu_copies_land_early = emu::emu_warps_run_ahead = true;
  prefill_case<bf16>(Kv::Bf16, 64, 16, 0, r);
  prefill_case<bf16>(Kv::Bf16, 128, 16, 0, r);
  prefill_case<unsigned char>(Kv::Fp8, 128, 8, 70, r);
  emu::emu_copies_land_early = emu::emu_warps_run_ahead = false;

  split_case<bf16, 64, 2>(Kv::Bf16, 16, 0, r);
  split_case<bf16, 64, 4>(Kv::Bf16, 7, 200, r);
  split_case<bf16, 128, 4>(Kv::Bf16, 16, 0, r);
  split_case<float, 64, 2>(Kv::F32, 16, 0, r);
  split_case<unsigned char, 64, 2>(Kv::Fp8, 16, 0, r);
  split_case<unsigned char, 128, 4>(Kv::Fp8, 8, 0, r);
  // Groups that do not fill their instance (Qwen2.5-7B's 7 query heads a KV head), and more than one
  // pass of the weighted sum (16 heads, 8 a pass).
  split_case<bf16, 128, 8>(Kv::Bf16, 16, 0, r, 7);
  split_case<bf16, 64, 16>(Kv::Bf16, 16, 0, r, 12);

  store_case(64, 16, r);
  store_case(128, 8, r);

  argmax_case(r);
  copy_case(Kv::Bf16, r);
  copy_case(Kv::Fp8, r);

  gemv_case<1>(1024, 72, 96, 3, r);
  // Rows of 4,096: gemv_ahead_T's window branch runs (its prefetch is the GPU's alone).
  gemv_case<1>(4096, 24, 32, 2, r);
  gemv_case<2>(576, 72, 96, 2, r);
  gemv_case<3>(1536, 40, 64, 4, r);
  gemv_case<4>(1024, 24, 32, 1, r);

  std::printf("%d failed\n", failures);
  return failures ? 1 : 0;
}
