// Kura's kernels by name, for the stand-in driver (`driver.cpp`): `kernels/kura.cu` compiled against
// `emu.h`, and for each kernel the executor launches a binder that copies a launch's parameters (as
// `cuLaunchKernel` does, when it is called) and returns the launch to run later, on the CPU.
#include "emu.h"
#include "../kernels/kura.cu"

#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

#include "driver.h"

namespace {

using Binder = std::function<bool(void**, const emu_driver::Launch&, emu_driver::Op*)>;

// The parameters of kernel `k`, copied out of `params` (one pointer to each, in order).
template <typename... A, size_t... I>
std::shared_ptr<std::tuple<std::decay_t<A>...>> copy_params(void** params, std::index_sequence<I...>) {
  return std::make_shared<std::tuple<std::decay_t<A>...>>(*static_cast<const std::decay_t<A>*>(params[I])...);
}

// Blocks run in a shuffled order (fixed by the launch's number): a kernel whose result depends on the
// order its blocks run in shows it.
std::vector<dim3> shuffled(dim3 grid, uint64_t seed) {
  std::vector<dim3> order;
  for (unsigned z = 0; z < grid.z; z++)
    for (unsigned y = 0; y < grid.y; y++)
      for (unsigned x = 0; x < grid.x; x++) order.push_back({x, y, z});
  uint64_t s = seed * 0x9E3779B97F4A7C15ull + 1;
  for (size_t i = order.size(); i > 1; i--) {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    std::swap(order[i - 1], order[(s >> 33) % i]);
  }
  return order;
}

template <typename... A> Binder binder(const char* name, void (*k)(A...)) {
  return [name, k](void** params, const emu_driver::Launch& l, emu_driver::Op* out) {
    if (params == nullptr && sizeof...(A) > 0) return false;
    auto args = copy_params<A...>(params, std::index_sequence_for<A...>{});
    dim3 grid{l.grid[0], l.grid[1], l.grid[2]}, block{l.block[0], l.block[1], l.block[2]};
    size_t smem = l.shared_bytes;
    uint64_t seed = l.seed;
    *out = [name, k, args, grid, block, smem, seed]() {
      emu::running() = name;
      emu::launch(grid, block, smem, [&]() { std::apply(k, *args); }, shuffled(grid, seed));
    };
    return true;
  };
}

const std::map<std::string, Binder>& kernels() {
  static const std::map<std::string, Binder> m = [] {
    std::map<std::string, Binder> m;
#define K(name) m[#name] = binder(#name, &name);
    K(embed)
    K(rms_norm)
    K(silu_mul)
    K(rope_store_bf16)
    K(rope_store_f32)
    K(rope_table)
    K(attn_merge)
    K(argmax_part) K(argmax_merge)
    K(copy_block_prefix)
    K(copy_block_prefix_fp8)
    K(rope_kv_inplace)
    K(quant_store_fp8)
    K(fill_random_bf16)
#define KV_D(KVN, D)                                                                                     \
  K(attn_prefill_##KVN##_##D) K(attn_prefill_wide_##KVN##_##D) K(attn_prefill_half_##KVN##_##D)          \
      K(attn_prefill_small_##KVN##_##D) K(attn_prefill_deep_##KVN##_##D) K(attn_prefill_halfdeep_##KVN##_##D) \
      K(attn_prefill_wg_##KVN##_##D) K(attn_prefill_halfwg_##KVN##_##D)                                     \
      K(attn_prefill_wgpipe_##KVN##_##D) K(attn_prefill_halfwgpipe_##KVN##_##D)                             \
      K(attn_split_##KVN##_##D##_g1) K(attn_split_##KVN##_##D##_g2)                                           \
          K(attn_split_##KVN##_##D##_g4) K(attn_split_##KVN##_##D##_g8) K(attn_split_##KVN##_##D##_g16)
    KV_D(bf16, 64)
    KV_D(bf16, 128)
    KV_D(f32, 64)
    KV_D(f32, 128)
    KV_D(fp8, 64)
    KV_D(fp8, 128)
#define PROBES(D)                                                                                        \
  K(attn_prefill_probe_noload_bf16_##D) K(attn_prefill_probe_nosoftmax_bf16_##D)                          \
      K(attn_prefill_probe_loadonly_bf16_##D) K(attn_prefill_probe_mmaonly_bf16_##D)
    PROBES(64)
    PROBES(128)
    K(gemv_1) K(gemv_2) K(gemv_3) K(gemv_4) K(gemv_5) K(gemv_6) K(gemv_7) K(gemv_8)
    K(gemv_ahead_1) K(gemv_ahead_2) K(gemv_ahead_3) K(gemv_ahead_4) K(gemv_ahead_5) K(gemv_ahead_6) K(gemv_ahead_7)
    K(gemv_ahead_8)
    K(gemv_batched_1) K(gemv_batched_2) K(gemv_batched_3) K(gemv_batched_4) K(gemv_batched_5) K(gemv_batched_6)
    K(gemv_batched_7) K(gemv_batched_8)
    K(gemv_norm_1) K(gemv_norm_2) K(gemv_norm_3) K(gemv_norm_4)
    K(gemv_swiglu_norm_1) K(gemv_swiglu_norm_2) K(gemv_swiglu_norm_3) K(gemv_swiglu_norm_4)
#undef KV_D
#undef PROBES
#undef K
    return m;
  }();
  return m;
}

}  // namespace

namespace emu_driver {

bool has_kernel(const std::string& name) { return kernels().count(name) != 0; }

bool bind_kernel(const std::string& name, void** params, const Launch& launch, Op* out) {
  auto it = kernels().find(name);
  return it != kernels().end() && it->second(params, launch, out);
}

}  // namespace emu_driver
