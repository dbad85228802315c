// A stand-in for cuBLAS (`libcublas.so`) beside the stand-in driver (`driver.cpp`): the handle, its
// stream, and `cublasGemmEx` for the types the executor asks for (bf16 or f32 inputs, f32 output, f32
// compute), run on the CPU in the stream's order. Each output element is summed in f32 over k in order;
// cuBLAS' own order is not promised, so tests compare with tolerances, as on a GPU.
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "driver.h"

extern "C" {

typedef enum { CUBLAS_STATUS_SUCCESS = 0, CUBLAS_STATUS_NOT_INITIALIZED = 1, CUBLAS_STATUS_INVALID_VALUE = 7,
               CUBLAS_STATUS_EXECUTION_FAILED = 13, CUBLAS_STATUS_NOT_SUPPORTED = 15 } cublasStatus_t;
typedef enum { CUBLAS_OP_N = 0, CUBLAS_OP_T = 1, CUBLAS_OP_C = 2 } cublasOperation_t;
// cudaDataType_t values (library_types.h).
enum { CUDA_R_32F = 0, CUDA_R_16F = 2, CUDA_R_16BF = 14 };
// cublasComputeType_t values.
enum { CUBLAS_COMPUTE_32F = 68, CUBLAS_COMPUTE_32F_FAST_16BF = 75 };

struct Handle {
  void* stream = nullptr;
};
typedef Handle* cublasHandle_t;

cublasStatus_t cublasCreate_v2(cublasHandle_t* h) {
  *h = new Handle;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasDestroy_v2(cublasHandle_t h) {
  delete h;
  return CUBLAS_STATUS_SUCCESS;
}
// The stand-in's own version (cuBLAS 13.0 says 130000 and up): a KV fingerprint tells its numerics
// from a real cuBLAS'.
cublasStatus_t cublasGetVersion_v2(cublasHandle_t h, int* version) {
  if (!h) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (!version) return CUBLAS_STATUS_INVALID_VALUE;
  *version = 1;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasSetStream_v2(cublasHandle_t h, void* stream) {
  if (!h) return CUBLAS_STATUS_NOT_INITIALIZED;
  h->stream = stream;
  return CUBLAS_STATUS_SUCCESS;
}

}  // extern "C"

namespace {

float load(const void* p, int type, int64_t i) {
  if (type == CUDA_R_32F) return static_cast<const float*>(p)[i];
  uint16_t h = static_cast<const uint16_t*>(p)[i];
  uint32_t u = (uint32_t)h << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

struct Gemm {
  int ta, tb, m, n, k, lda, ldb, ldc, at, bt;
  float alpha, beta;
  const void *a, *b;
  float* c;
  void run() const {
    // C (m × n, column-major) = alpha · op(A) · op(B) + beta · C. The operands are read once into rows
    // of k floats (op(A)'s rows, op(B)'s columns); each output element is then summed in order over k.
    std::vector<float> ar((size_t)m * k), bc((size_t)n * k);
    for (int i = 0; i < m; i++)
      for (int l = 0; l < k; l++) ar[(size_t)i * k + l] = load(a, at, ta ? (int64_t)i * lda + l : (int64_t)l * lda + i);
    for (int j = 0; j < n; j++)
      for (int l = 0; l < k; l++) bc[(size_t)j * k + l] = load(b, bt, tb ? (int64_t)l * ldb + j : (int64_t)j * ldb + l);
    for (int j = 0; j < n; j++) {
      const float* y = &bc[(size_t)j * k];
      int i = 0;
      // Four elements at a time (four independent sums, each in order).
      for (; i + 4 <= m; i += 4) {
        const float *x0 = &ar[(size_t)i * k], *x1 = x0 + k, *x2 = x1 + k, *x3 = x2 + k;
        float s0 = 0, s1 = 0, s2 = 0, s3 = 0;
        for (int l = 0; l < k; l++) {
          s0 += x0[l] * y[l];
          s1 += x1[l] * y[l];
          s2 += x2[l] * y[l];
          s3 += x3[l] * y[l];
        }
        store(i, j, s0);
        store(i + 1, j, s1);
        store(i + 2, j, s2);
        store(i + 3, j, s3);
      }
      for (; i < m; i++) {
        const float* x = &ar[(size_t)i * k];
        float acc = 0;
        for (int l = 0; l < k; l++) acc += x[l] * y[l];
        store(i, j, acc);
      }
    }
  }
  void store(int i, int j, float acc) const {
    float& out = c[(int64_t)j * ldc + i];
    out = beta == 0.f ? alpha * acc : alpha * acc + beta * out;
  }
};

}  // namespace

extern "C" cublasStatus_t cublasGemmEx(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n,
                                       int k, const void* alpha, const void* a, int at, int lda, const void* b, int bt,
                                       int ldb, const void* beta, void* c, int ct, int ldc, int compute, int) {
  if (!h) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (m < 0 || n < 0 || k < 0 || ta == CUBLAS_OP_C || tb == CUBLAS_OP_C) return CUBLAS_STATUS_INVALID_VALUE;
  if (lda < (ta ? k : m) || ldb < (tb ? n : k) || ldc < m || lda < 1 || ldb < 1 || ldc < 1)
    return CUBLAS_STATUS_INVALID_VALUE;
  if (ct != CUDA_R_32F || (compute != CUBLAS_COMPUTE_32F && compute != CUBLAS_COMPUTE_32F_FAST_16BF) ||
      (at != CUDA_R_16BF && at != CUDA_R_32F) || (bt != CUDA_R_16BF && bt != CUDA_R_32F))
    return CUBLAS_STATUS_NOT_SUPPORTED;
  // alpha and beta are host values (the default pointer mode), read at the call.
  Gemm* g = new Gemm{ta == CUBLAS_OP_T, tb == CUBLAS_OP_T, m, n, k, lda, ldb, ldc, at, bt,
                     *static_cast<const float*>(alpha), *static_cast<const float*>(beta), a, b, static_cast<float*>(c)};
  int r = kura_emu_enqueue(
      h->stream, [](void* p) { static_cast<Gemm*>(p)->run(); }, [](void* p) { delete static_cast<Gemm*>(p); }, g);
  return r == 0 ? CUBLAS_STATUS_SUCCESS : CUBLAS_STATUS_EXECUTION_FAILED;
}
