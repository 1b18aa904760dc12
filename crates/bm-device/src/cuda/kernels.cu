// Compute kernels of bm-device, compiled at run time with NVRTC (so the
// build needs no CUDA toolkit). No headers: F16/BF16 travel as raw 16-bit
// words and are converted by hand (PTX cvt for F16, bit rounding for BF16),
// and every value is computed in f32, rounded once when stored.
//
// Launch conventions (see compute.rs):
// * elementwise kernels: 1-D grid-stride loops over `n` elements;
// * row kernels (norms, softmax): one block per row, a multiple of 32 threads;
// * attention: one block per (query, head), a multiple of 32 threads, the
//   scores of its visible keys in dynamic shared memory.

typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;


// -inf without math.h (NVRTC has no headers here).
#define NEG_INF (__uint_as_float(0xff800000u))

__device__ __forceinline__ float f16_to_f32(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ u16 f32_to_f16(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

__device__ __forceinline__ float bf16_to_f32(u16 h) {
    return __uint_as_float(((u32)h) << 16);
}

// Round to nearest even, NaN kept quiet: the `half` crate's and PyTorch's rule.
__device__ __forceinline__ u16 f32_to_bf16(float f) {
    u32 u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        return (u16)((u >> 16) | 0x40u);
    }
    u += 0x7fffu + ((u >> 16) & 1u);
    return (u16)(u >> 16);
}

struct F32 {
    typedef float T;
    static __device__ __forceinline__ float load(const T* p, u64 i) { return p[i]; }
    static __device__ __forceinline__ void store(T* p, u64 i, float v) { p[i] = v; }
    static __device__ __forceinline__ float round(float v) { return v; }
};

struct F16 {
    typedef u16 T;
    static __device__ __forceinline__ float load(const T* p, u64 i) { return f16_to_f32(p[i]); }
    static __device__ __forceinline__ void store(T* p, u64 i, float v) { p[i] = f32_to_f16(v); }
    static __device__ __forceinline__ float round(float v) { return f16_to_f32(f32_to_f16(v)); }
};

struct BF16 {
    typedef u16 T;
    static __device__ __forceinline__ float load(const T* p, u64 i) { return bf16_to_f32(p[i]); }
    static __device__ __forceinline__ void store(T* p, u64 i, float v) { p[i] = f32_to_bf16(v); }
    static __device__ __forceinline__ float round(float v) { return bf16_to_f32(f32_to_bf16(v)); }
};

__device__ __forceinline__ u64 grid_start() {
    return (u64)blockIdx.x * blockDim.x + threadIdx.x;
}

__device__ __forceinline__ u64 grid_stride() {
    return (u64)gridDim.x * blockDim.x;
}

// Sum (or max) over the block; every thread gets the result. `scratch`
// holds one float per warp; blockDim.x is a multiple of 32.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    const int warps = blockDim.x / 32;
    float total = 0.0f;
    for (int w = 0; w < warps; ++w) total += scratch[w];
    return total;
}

__device__ __forceinline__ float block_max(float v, float* scratch) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    const int warps = blockDim.x / 32;
    float best = scratch[0];
    for (int w = 1; w < warps; ++w) best = fmaxf(best, scratch[w]);
    return best;
}

template <typename S, typename D>
__device__ void cast(const typename S::T* x, typename D::T* y, u64 n) {
    for (u64 i = grid_start(); i < n; i += grid_stride()) D::store(y, i, S::load(x, i));
}

template <typename D>
__device__ void add(const typename D::T* a, const typename D::T* b, typename D::T* y, u64 n) {
    for (u64 i = grid_start(); i < n; i += grid_stride()) D::store(y, i, D::load(a, i) + D::load(b, i));
}

template <typename D>
__device__ void mul(const typename D::T* a, const typename D::T* b, typename D::T* y, u64 n) {
    for (u64 i = grid_start(); i < n; i += grid_stride()) D::store(y, i, D::load(a, i) * D::load(b, i));
}

// Elementwise activations, one kernel chosen by `op` (the same for every
// element, so no warp diverges on it):
// 0 SiLU, x / (1 + e^-x);
// 1 exact GELU, 0.5 x (1 + erf(x / sqrt 2)), evaluated in double;
// 2 tanh GELU, 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))), in f32
//   as bm-compute's CPU kernel (GPT-2's gelu_new);
// 3 ReLU, max(x, 0) with NaN kept (x < 0 is false for NaN).
template <typename D>
__device__ void unary(const typename D::T* x, typename D::T* y, u64 n, u32 op, float arg) {
    for (u64 i = grid_start(); i < n; i += grid_stride()) {
        const float v = D::load(x, i);
        float r;
        if (op == 0) {
            r = v / (1.0f + expf(-v));
        } else if (op == 1) {
            const double d = (double)v;
            r = (float)(0.5 * d * (1.0 + erf(d * 0.70710678118654752440)));
        } else if (op == 2) {
            r = 0.5f * v * (1.0f + tanhf(0.7978846f * (v + 0.044715f * v * v * v)));
        } else if (op == 3) {
            r = v < 0.0f ? 0.0f : v;
        } else {
            // Soft-capping (Gemma 2's logits): arg · tanh(v / arg).
            r = tanhf(v / arg) * arg;
        }
        D::store(y, i, r);
    }
}

// out[r, c] = acc[r, c] + bias[c]: the end of a linear layer whose product
// cuBLAS left in f32, rounded once to the output dtype.
template <typename D>
__device__ void bias_epilogue(const float* acc, const typename D::T* bias, typename D::T* y,
                              u64 rows, u64 cols) {
    const u64 n = rows * cols;
    for (u64 i = grid_start(); i < n; i += grid_stride()) {
        float v = acc[i];
        if (bias != 0) v += D::load(bias, i % cols);
        D::store(y, i, v);
    }
}

// out[i, :] = table[ids[i], :]; ids were checked against the vocabulary.
template <typename S, typename D>
__device__ void embedding(const typename S::T* table, const u32* ids, typename D::T* y, u64 count,
                          u64 hidden) {
    const u64 n = count * hidden;
    for (u64 i = grid_start(); i < n; i += grid_stride()) {
        const u64 row = i / hidden, col = i % hidden;
        D::store(y, i, S::load(table, (u64)ids[row] * hidden + col));
    }
}

// Llama's RMSNorm: w * round(x / rms(x)), normalised value rounded to the
// activation dtype before the weight multiplies it (as transformers does).
template <typename D>
__device__ void rms_norm(const typename D::T* x, const typename D::T* w, typename D::T* y,
                         u64 cols, float eps) {
    __shared__ float scratch[32];
    const u64 base = (u64)blockIdx.x * cols;
    float sq = 0.0f;
    for (u64 c = threadIdx.x; c < cols; c += blockDim.x) {
        const float v = D::load(x, base + c);
        sq += v * v;
    }
    const float inv = 1.0f / sqrtf(block_sum(sq, scratch) / (float)cols + eps);
    for (u64 c = threadIdx.x; c < cols; c += blockDim.x) {
        D::store(y, base + c, D::load(w, c) * D::round(D::load(x, base + c) * inv));
    }
}

// LayerNorm with biased variance, two passes over the row.
template <typename D>
__device__ void layer_norm(const typename D::T* x, const typename D::T* w,
                           const typename D::T* b, typename D::T* y, u64 cols, float eps) {
    __shared__ float scratch[32];
    const u64 base = (u64)blockIdx.x * cols;
    float s = 0.0f;
    for (u64 c = threadIdx.x; c < cols; c += blockDim.x) s += D::load(x, base + c);
    const float mean = block_sum(s, scratch) / (float)cols;
    float sq = 0.0f;
    for (u64 c = threadIdx.x; c < cols; c += blockDim.x) {
        const float d = D::load(x, base + c) - mean;
        sq += d * d;
    }
    const float inv = 1.0f / sqrtf(block_sum(sq, scratch) / (float)cols + eps);
    for (u64 c = threadIdx.x; c < cols; c += blockDim.x) {
        const float v = (D::load(x, base + c) - mean) * inv;
        D::store(y, base + c, v * D::load(w, c) + D::load(b, c));
    }
}

// Softmax over rows, max subtracted first.
template <typename D>
__device__ void softmax(const typename D::T* x, typename D::T* y, u64 cols) {
    __shared__ float scratch[32];
    const u64 base = (u64)blockIdx.x * cols;
    float m = NEG_INF;
    for (u64 c = threadIdx.x; c < cols; c += blockDim.x) m = fmaxf(m, D::load(x, base + c));
    m = block_max(m, scratch);
    float s = 0.0f;
    for (u64 c = threadIdx.x; c < cols; c += blockDim.x) s += expf(D::load(x, base + c) - m);
    s = block_sum(s, scratch);
    for (u64 c = threadIdx.x; c < cols; c += blockDim.x) {
        D::store(y, base + c, expf(D::load(x, base + c) - m) / s);
    }
}

// Rotary embedding, rotate_half convention: dimension i of a head pairs
// with i + head_dim / 2, at frequency 1 / theta^(2i / head_dim); row r is at
// position start_pos + r. cos/sin are rounded to the activation dtype before
// use, as transformers casts them.
template <typename D>
__device__ void rotary(const typename D::T* x, typename D::T* y, u64 rows, u64 width,
                       u64 head_dim, u64 start_pos, float theta) {
    const u64 half = head_dim / 2;
    const u64 pairs_per_row = width / 2;
    const u64 n = rows * pairs_per_row;
    for (u64 p = grid_start(); p < n; p += grid_stride()) {
        const u64 row = p / pairs_per_row, rem = p % pairs_per_row;
        const u64 head = rem / half, i = rem % half;
        const float inv_freq = 1.0f / powf(theta, (float)(2 * i) / (float)head_dim);
        const float angle = (float)(start_pos + row) * inv_freq;
        const float c = D::round(cosf(angle)), s = D::round(sinf(angle));
        const u64 at = row * width + head * head_dim + i;
        const float a = D::load(x, at), b = D::load(x, at + half);
        D::store(y, at, a * c - b * s);
        D::store(y, at + half, b * c + a * s);
    }
}

// Rotary embedding from tables the host computed (given or scaled
// frequencies, partial rotary, rows at their own positions), one element a
// thread: pair i (i < rotary_dim / 2) of every head of row r turns by
// cos[r, i], sin[r, i], already scaled and rounded as transformers does;
// dimensions from rotary_dim on pass through.
template <typename D>
__device__ void rotary_table(const typename D::T* x, const float* cos, const float* sin,
                             typename D::T* y, u64 rows, u64 width, u64 head_dim,
                             u64 rotary_dim) {
    const u64 half = rotary_dim / 2;
    const u64 n = rows * width;
    for (u64 e = grid_start(); e < n; e += grid_stride()) {
        const u64 row = e / width, d = (e % width) % head_dim;
        if (d >= rotary_dim) {
            D::store(y, e, D::load(x, e));
            continue;
        }
        const u64 i = d % half, head = e - d;
        const float c = cos[row * half + i], s = sin[row * half + i];
        const float a = D::load(x, head + i), b = D::load(x, head + i + half);
        D::store(y, e, d < half ? a * c - b * s : b * c + a * s);
    }
}

// Scaled dot-product attention of query block (blockIdx.x = query row,
// blockIdx.y = head) over f32 keys/values [t, kv_heads * head_dim]; the
// queries are the last `s` of the `t` positions. mask: 0 every key,
// 1 causal, 2 causal within the last `window` positions. Each score is
// q . k * scale, then, when `softcap` > 0 (Gemma 2), softcap * tanh(score /
// softcap), plus, when `bias` is not null (T5), bias[h, j - pos + t - 1]
// (f32 [heads, t + s - 1], by relative position key - query; s <= t).
template <typename D>
__device__ void attention(const typename D::T* q, const float* k, const float* v,
                          const float* bias, typename D::T* y, u32 s, u32 t, u32 heads,
                          u32 kv_heads, u32 head_dim, u32 mask, u32 window, float scale,
                          float softcap) {
    extern __shared__ float scores[];
    __shared__ float scratch[32];
    const u32 i = blockIdx.x, h = blockIdx.y;
    const u32 g = h / (heads / kv_heads);
    const u32 pos = t - s + i;
    u32 lo = 0, hi = t;
    if (mask >= 1) hi = pos + 1;
    if (mask == 2) lo = (pos + 1 > window) ? pos + 1 - window : 0;
    const u64 q_width = (u64)heads * head_dim, kv_width = (u64)kv_heads * head_dim;
    const u64 q_at = (u64)i * q_width + (u64)h * head_dim;

    float m = NEG_INF;
    for (u32 j = lo + threadIdx.x; j < hi; j += blockDim.x) {
        const float* kj = k + (u64)j * kv_width + (u64)g * head_dim;
        float dot = 0.0f;
        for (u32 d = 0; d < head_dim; ++d) dot += D::load(q, q_at + d) * kj[d];
        dot *= scale;
        if (softcap > 0.0f) dot = tanhf(dot / softcap) * softcap;
        // j - pos + t - 1 = j + s - 1 - i, never negative as i < s.
        if (bias != 0) dot += bias[(u64)h * (t + s - 1) + (j + s - 1 - i)];
        scores[j - lo] = dot;
        m = fmaxf(m, dot);
    }
    m = block_max(m, scratch);
    float sum = 0.0f;
    for (u32 j = lo + threadIdx.x; j < hi; j += blockDim.x) {
        const float e = expf(scores[j - lo] - m);
        scores[j - lo] = e;
        sum += e;
    }
    sum = block_sum(sum, scratch);
    for (u32 j = lo + threadIdx.x; j < hi; j += blockDim.x) scores[j - lo] /= sum;
    __syncthreads();
    for (u32 d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float acc = 0.0f;
        for (u32 j = lo; j < hi; ++j) acc += scores[j - lo] * v[(u64)j * kv_width + (u64)g * head_dim + d];
        D::store(y, q_at + d, acc);
    }
}

#define CAST(S, D, name)                                                                  \
    extern "C" __global__ void bm_cast_##name(const S::T* x, D::T* y, u64 n) { cast<S, D>(x, y, n); }

#define EMBED(S, D, name)                                                                \
    extern "C" __global__ void bm_embedding_##name(const S::T* table, const u32* ids, D::T* y, \
                                                   u64 count, u64 hidden) {              \
        embedding<S, D>(table, ids, y, count, hidden);                                    \
    }

#define SAME_TYPE(D, name)                                                                        \
    extern "C" __global__ void bm_add_##name(const D::T* a, const D::T* b, D::T* y, u64 n) {        \
        add<D>(a, b, y, n);                                                                      \
    }                                                                                            \
    extern "C" __global__ void bm_mul_##name(const D::T* a, const D::T* b, D::T* y, u64 n) {        \
        mul<D>(a, b, y, n);                                                                      \
    }                                                                                            \
    extern "C" __global__ void bm_unary_##name(const D::T* x, D::T* y, u64 n, u32 op, float arg) { \
        unary<D>(x, y, n, op, arg);                                                              \
    }                                                                                            \
    extern "C" __global__ void bm_bias_epilogue_##name(const float* acc, const D::T* bias, D::T* y, \
                                                       u64 rows, u64 cols) {                     \
        bias_epilogue<D>(acc, bias, y, rows, cols);                                              \
    }                                                                                            \
    extern "C" __global__ void bm_rms_norm_##name(const D::T* x, const D::T* w, D::T* y, u64 cols, \
                                                  float eps) {                                   \
        rms_norm<D>(x, w, y, cols, eps);                                                         \
    }                                                                                            \
    extern "C" __global__ void bm_layer_norm_##name(const D::T* x, const D::T* w, const D::T* b,   \
                                                    D::T* y, u64 cols, float eps) {              \
        layer_norm<D>(x, w, b, y, cols, eps);                                                    \
    }                                                                                            \
    extern "C" __global__ void bm_softmax_##name(const D::T* x, D::T* y, u64 cols) {              \
        softmax<D>(x, y, cols);                                                                  \
    }                                                                                            \
    extern "C" __global__ void bm_rotary_##name(const D::T* x, D::T* y, u64 rows, u64 width,      \
                                                u64 head_dim, u64 start_pos, float theta) {      \
        rotary<D>(x, y, rows, width, head_dim, start_pos, theta);                                \
    }                                                                                            \
    extern "C" __global__ void bm_rotary_table_##name(const D::T* x, const float* cos,            \
                                                      const float* sin, D::T* y, u64 rows,        \
                                                      u64 width, u64 head_dim, u64 rotary_dim) {  \
        rotary_table<D>(x, cos, sin, y, rows, width, head_dim, rotary_dim);                      \
    }                                                                                            \
    extern "C" __global__ void bm_attention_##name(const D::T* q, const float* k, const float* v,   \
                                                   const float* bias, D::T* y, u32 s, u32 t,     \
                                                   u32 heads, u32 kv_heads, u32 head_dim,        \
                                                   u32 mask, u32 window, float scale,            \
                                                   float softcap) {                              \
        attention<D>(q, k, v, bias, y, s, t, heads, kv_heads, head_dim, mask, window, scale,     \
                     softcap);                                                                   \
    }

CAST(F32, F32, f32_f32)
CAST(F32, F16, f32_f16)
CAST(F32, BF16, f32_bf16)
CAST(F16, F32, f16_f32)
CAST(F16, F16, f16_f16)
CAST(F16, BF16, f16_bf16)
CAST(BF16, F32, bf16_f32)
CAST(BF16, F16, bf16_f16)
CAST(BF16, BF16, bf16_bf16)

EMBED(F32, F32, f32_f32)
EMBED(F32, F16, f32_f16)
EMBED(F32, BF16, f32_bf16)
EMBED(F16, F32, f16_f32)
EMBED(F16, F16, f16_f16)
EMBED(F16, BF16, f16_bf16)
EMBED(BF16, F32, bf16_f32)
EMBED(BF16, F16, bf16_f16)
EMBED(BF16, BF16, bf16_bf16)

SAME_TYPE(F32, f32)
SAME_TYPE(F16, f16)
SAME_TYPE(BF16, bf16)

// Exact casts, for checkpoints loaded onto a GPU: bit for bit what
// bm_tensor::cast does on the host (PyTorch's CPU Tensor.to), NaN payloads
// included. Integer arithmetic only, so no hardware conversion's own NaN
// rule leaks in:
// * F32 to BF16 rounds to nearest even and writes every NaN as 0xFFFF;
//   F16 to BF16 widens exactly, then writes NaN as 0x7FC0;
// * to F16 rounds to nearest even; a NaN keeps its sign and top payload
//   bits and is quieted (the F16C instruction and the `half` crate);
// * widening is exact; F16 NaNs are quieted, BF16 bits are kept.

__device__ __forceinline__ bool exact_is_nan(u32 u) { return (u & 0x7fffffffu) > 0x7f800000u; }

__device__ __forceinline__ u16 exact_rne_bf16(u32 u) {
    return (u16)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

__device__ __forceinline__ u32 exact_f16_to_f32(u16 h) {
    const u32 sign = ((u32)h & 0x8000u) << 16;
    const u32 exp = ((u32)h >> 10) & 0x1fu;
    u32 man = (u32)h & 0x3ffu;
    if (exp == 0x1fu) return sign | 0x7f800000u | (man ? (0x400000u | (man << 13)) : 0u);
    if (exp == 0u) {
        if (man == 0u) return sign;
        int e = -14;
        while ((man & 0x400u) == 0u) {
            man <<= 1;
            --e;
        }
        return sign | ((u32)(e + 127) << 23) | ((man & 0x3ffu) << 13);
    }
    return sign | ((exp + 112u) << 23) | (man << 13);
}

__device__ __forceinline__ u16 exact_f32_to_f16(u32 x) {
    const u32 sign = (x >> 16) & 0x8000u;
    const u32 exp = x & 0x7f800000u;
    const u32 man = x & 0x007fffffu;
    if (exp == 0x7f800000u) return (u16)(sign | 0x7c00u | (man ? (0x200u | (man >> 13)) : 0u));
    const int half_exp = (int)(exp >> 23) - 127 + 15;
    if (half_exp >= 0x1f) return (u16)(sign | 0x7c00u);
    if (half_exp <= 0) {
        if (14 - half_exp > 24) return (u16)sign;
        const u32 m = man | 0x00800000u;
        u32 half_man = m >> (14 - half_exp);
        const u32 round_bit = 1u << (13 - half_exp);
        if ((m & round_bit) != 0u && (m & (3u * round_bit - 1u)) != 0u) ++half_man;
        return (u16)(sign | half_man);
    }
    const u32 out = sign | ((u32)half_exp << 10) | (man >> 13);
    const u32 round_bit = 0x1000u;
    if ((man & round_bit) != 0u && (man & (3u * round_bit - 1u)) != 0u) return (u16)(out + 1u);
    return (u16)out;
}

#define EXACT_CAST(name, S, D, convert)                                                        \
    extern "C" __global__ void bm_exact_cast_##name(const S* x, D* y, u64 n) {                \
        for (u64 i = grid_start(); i < n; i += grid_stride()) {                                 \
            const S v = x[i];                                                                   \
            y[i] = (convert);                                                                   \
        }                                                                                       \
    }

EXACT_CAST(f32_bf16, u32, u16, exact_is_nan(v) ? (u16)0xffffu : exact_rne_bf16(v))
EXACT_CAST(f16_bf16, u16, u16,
           exact_is_nan(exact_f16_to_f32(v)) ? (u16)0x7fc0u : exact_rne_bf16(exact_f16_to_f32(v)))
EXACT_CAST(f32_f16, u32, u16, exact_f32_to_f16(v))
EXACT_CAST(bf16_f16, u16, u16, exact_f32_to_f16((u32)v << 16))
EXACT_CAST(f16_f32, u16, u32, exact_f16_to_f32(v))
EXACT_CAST(bf16_f32, u16, u32, (u32)v << 16)

// bitsandbytes' dequantization (bm-compute's `quant`, whose CPU code is the
// reference): every value is one f32 multiply (`__fmul_rn`, never fused
// into an FMA, so the result is the CPU's bit for bit), rounded once when
// stored.

// LLM.int8() weights: out[r, c] = codes[r, c] * scb[r] * scale (scale is
// 1/127 as bitsandbytes rounds it), multiplied left to right.
template <typename D>
__device__ void dequant_int8(const signed char* codes, const float* scb, typename D::T* y,
                             u64 rows, u64 cols, float scale) {
    const u64 n = rows * cols;
    for (u64 i = grid_start(); i < n; i += grid_stride()) {
        D::store(y, i, __fmul_rn(__fmul_rn((float)codes[i], scb[i / cols]), scale));
    }
}

// Double quantization's block scales: absmax[b] = map[codes[b]] *
// nested[b / 256] + offset (read from device memory, where the packed
// weight keeps it), one f32 multiply then one f32 add.
extern "C" __global__ void bm_dequant_nested_absmax(const unsigned char* codes,
                                                    const float* nested, const float* map,
                                                    const float* offset, float* absmax,
                                                    u64 blocks) {
    const float add = offset[0];
    for (u64 b = grid_start(); b < blocks; b += grid_stride()) {
        absmax[b] = __fadd_rn(__fmul_rn(map[codes[b]], nested[b / 256]), add);
    }
}

#define DEQUANT(D, name)                                                                       \
    extern "C" __global__ void bm_dequant_int8_##name(const signed char* codes, const float* scb, \
                                                      D::T* y, u64 rows, u64 cols, float scale) { \
        dequant_int8<D>(codes, scb, y, rows, cols, scale);                                      \
    }

DEQUANT(F32, f32)
DEQUANT(F16, f16)
DEQUANT(BF16, bf16)

// Quantized linear layers (bm-compute's `linear_quantized`, whose CPU code
// is the reference). A 4-bit code table travels as 16 float parameters and
// is copied into shared memory by each block; weights are read packed.

#define TABLE_PARAMS                                                                           \
    float c0, float c1, float c2, float c3, float c4, float c5, float c6, float c7, float c8,  \
        float c9, float c10, float c11, float c12, float c13, float c14, float c15
#define TABLE_ARGS c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15

__device__ __forceinline__ void fill_table(float* t, TABLE_PARAMS) {
    if (threadIdx.x == 0) {
        t[0] = c0; t[1] = c1; t[2] = c2; t[3] = c3; t[4] = c4; t[5] = c5; t[6] = c6; t[7] = c7;
        t[8] = c8; t[9] = c9; t[10] = c10; t[11] = c11; t[12] = c12; t[13] = c13; t[14] = c14;
        t[15] = c15;
    }
    __syncthreads();
}

// 4-bit NF4/FP4: out[i] = code[nibble i] * absmax[i / blocksize], one f32
// multiply; two codes a byte, the first in the high nibble.
template <typename D>
__device__ void dequant_4bit(const unsigned char* packed, const float* absmax,
                                   typename D::T* y, u64 n, u64 blocksize, TABLE_PARAMS) {
    __shared__ float table[16];
    fill_table(table, TABLE_ARGS);
    for (u64 i = grid_start(); i < n; i += grid_stride()) {
        const u32 byte = packed[i / 2];
        const u32 nibble = (i % 2 == 0) ? (byte >> 4) : (byte & 15u);
        D::store(y, i, __fmul_rn(table[nibble], absmax[i / blocksize]));
    }
}

// 4-bit linear, one output a block (grid: columns n, rows m): as
// `Linear4bit` computes, with C the compute dtype and X the input's,
// y[i, j] = C(sum_l C(x[i, l]) * C(code[nibble(j k + l)] * absmax[(j k + l) / blocksize])
//             + C(bias[j])), stored as X.
template <typename X, typename C>
__device__ void linear_4bit(const typename X::T* x, const unsigned char* packed,
                            const float* absmax, const typename X::T* bias, typename X::T* y,
                            u64 k, u64 n, u64 blocksize, TABLE_PARAMS) {
    __shared__ float table[16];
    __shared__ float scratch[32];
    fill_table(table, TABLE_ARGS);
    const u64 j = blockIdx.x, i = blockIdx.y;
    const u64 row = j * k;
    float acc = 0.0f;
    for (u64 l = threadIdx.x; l < k; l += blockDim.x) {
        const u64 e = row + l;
        const u32 byte = packed[e / 2];
        const u32 nibble = (e % 2 == 0) ? (byte >> 4) : (byte & 15u);
        const float w = C::round(__fmul_rn(table[nibble], absmax[e / blocksize]));
        acc += C::round(X::load(x, i * k + l)) * w;
    }
    const float total = block_sum(acc, scratch);
    if (threadIdx.x == 0) {
        const float b = bias != 0 ? C::round(X::load(bias, j)) : 0.0f;
        X::store(y, i * n + j, C::round(total + b));
    }
}

// The end of a 4-bit prefill (the product cuBLAS left in f32):
// y = C(acc + C(bias)), stored as X.
template <typename X, typename C>
__device__ void linear_epilogue(const float* acc, const typename X::T* bias, typename X::T* y,
                                u64 rows, u64 cols) {
    const u64 n = rows * cols;
    for (u64 i = grid_start(); i < n; i += grid_stride()) {
        const float b = bias != 0 ? C::round(X::load(bias, i % cols)) : 0.0f;
        X::store(y, i, C::round(acc[i] + b));
    }
}

__device__ __forceinline__ float to_f16_value(float v) { return f16_to_f32(f32_to_f16(v)); }

// LLM.int8(), step 1: flags[c] = 1 when a row of column c holds a value
// whose float16 magnitude is at or above `threshold` (float16 too).
template <typename X>
__device__ void int8_outliers(const typename X::T* x, u32* flags, u64 m, u64 k,
                              float threshold) {
    for (u64 c = grid_start(); c < k; c += grid_stride()) {
        u32 flag = 0;
        for (u64 i = 0; i < m; ++i) {
            if (fabsf(to_f16_value(X::load(x, i * k + c))) >= threshold) flag = 1;
        }
        flags[c] = flag;
    }
}

// Step 2, one block a row: the row in float16, values at or above the
// threshold zeroed (when `outliers`), its absmax, then each value scaled
// by (1 / absmax) * 127 and rounded half to even; outlier columns are 0.
template <typename X>
__device__ void int8_quantize_rows(const typename X::T* x, const u32* flags, signed char* q,
                                   float* row_absmax, u64 k, float threshold, u32 outliers) {
    __shared__ float scratch[32];
    const u64 i = blockIdx.x;
    float m = 0.0f;
    for (u64 l = threadIdx.x; l < k; l += blockDim.x) {
        float v = fabsf(to_f16_value(X::load(x, i * k + l)));
        if (outliers != 0 && v >= threshold) v = 0.0f;
        m = fmaxf(m, v);
    }
    const float absmax = block_max(m, scratch);
    const float scale = __fmul_rn(__fdiv_rn(1.0f, absmax), 127.0f);
    for (u64 l = threadIdx.x; l < k; l += blockDim.x) {
        float v = to_f16_value(X::load(x, i * k + l));
        if (outliers != 0 && fabsf(v) >= threshold) v = 0.0f;
        const bool zero = absmax <= 0.0f || (outliers != 0 && flags[l] != 0);
        q[i * k + l] = zero ? (signed char)0 : (signed char)rintf(__fmul_rn(v, scale));
    }
    if (threadIdx.x == 0) row_absmax[i] = absmax;
}

// Sum of a 64-bit integer over the block; every thread gets the result.
__device__ __forceinline__ long long block_sum_i64(long long v, long long* scratch) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    const int warps = blockDim.x / 32;
    long long total = 0;
    for (int w = 0; w < warps; ++w) total += scratch[w];
    return total;
}

// Step 3, one output a block (grid: columns n, rows m): the integer
// product (exact), scaled by row_absmax[i] * scb[j] * inv_127_sq, plus the
// bias, rounded to X; then the outlier columns in X against the weight
// dequantized (code * scb * inv_127, rounded to X), rounded to X again.
template <typename X>
__device__ void int8_linear(const typename X::T* x, const signed char* q, const float* row_absmax,
                            const signed char* codes, const float* scb, const u32* flags,
                            const typename X::T* bias, typename X::T* y, u64 k, u64 n,
                            u32 outliers, float inv_127, float inv_127_sq) {
    __shared__ long long iscratch[32];
    __shared__ float scratch[32];
    const u64 j = blockIdx.x, i = blockIdx.y;
    long long dot = 0;
    float extra = 0.0f;
    for (u64 l = threadIdx.x; l < k; l += blockDim.x) {
        const int c = codes[j * k + l];
        dot += (long long)((int)q[i * k + l] * c);
        if (outliers != 0 && flags[l] != 0) {
            const float w = X::round(__fmul_rn(__fmul_rn((float)c, scb[j]), inv_127));
            extra += X::load(x, i * k + l) * w;
        }
    }
    dot = block_sum_i64(dot, iscratch);
    extra = block_sum(extra, scratch);
    if (threadIdx.x == 0) {
        const float scaled =
            __fmul_rn(__fmul_rn((float)dot, __fmul_rn(row_absmax[i], scb[j])), inv_127_sq);
        float v = X::round(scaled + (bias != 0 ? X::load(bias, j) : 0.0f));
        if (outliers != 0) v = X::round(v + extra);
        X::store(y, i * n + j, v);
    }
}

#define QUANT_OUT(D, name)                                                                     \
    extern "C" __global__ void bm_dequant_4bit_##name(                                   \
        const unsigned char* packed, const float* absmax, D::T* y, u64 n, u64 blocksize,       \
        TABLE_PARAMS) {                                                                        \
        dequant_4bit<D>(packed, absmax, y, n, blocksize, TABLE_ARGS);                    \
    }                                                                                          \
    extern "C" __global__ void bm_int8_outliers_##name(const D::T* x, u32* flags, u64 m, u64 k, \
                                                       float threshold) {                      \
        int8_outliers<D>(x, flags, m, k, threshold);                                           \
    }                                                                                          \
    extern "C" __global__ void bm_int8_quantize_rows_##name(                                   \
        const D::T* x, const u32* flags, signed char* q, float* row_absmax, u64 k,             \
        float threshold, u32 outliers) {                                                       \
        int8_quantize_rows<D>(x, flags, q, row_absmax, k, threshold, outliers);                \
    }                                                                                          \
    extern "C" __global__ void bm_int8_linear_##name(                                          \
        const D::T* x, const signed char* q, const float* row_absmax, const signed char* codes, \
        const float* scb, const u32* flags, const D::T* bias, D::T* y, u64 k, u64 n,           \
        u32 outliers, float inv_127, float inv_127_sq) {                                       \
        int8_linear<D>(x, q, row_absmax, codes, scb, flags, bias, y, k, n, outliers, inv_127,  \
                       inv_127_sq);                                                            \
    }

QUANT_OUT(F32, f32)
QUANT_OUT(F16, f16)
QUANT_OUT(BF16, bf16)

#define QUANT_LINEAR(X, C, name)                                                               \
    extern "C" __global__ void bm_linear_4bit_##name(                                          \
        const X::T* x, const unsigned char* packed, const float* absmax, const X::T* bias,     \
        X::T* y, u64 k, u64 n, u64 blocksize, TABLE_PARAMS) {                                  \
        linear_4bit<X, C>(x, packed, absmax, bias, y, k, n, blocksize, TABLE_ARGS);            \
    }                                                                                          \
    extern "C" __global__ void bm_linear_epilogue_##name(const float* acc, const X::T* bias,   \
                                                         X::T* y, u64 rows, u64 cols) {        \
        linear_epilogue<X, C>(acc, bias, y, rows, cols);                                       \
    }

QUANT_LINEAR(F32, F32, f32_f32)
QUANT_LINEAR(F32, F16, f32_f16)
QUANT_LINEAR(F32, BF16, f32_bf16)
QUANT_LINEAR(F16, F32, f16_f32)
QUANT_LINEAR(F16, F16, f16_f16)
QUANT_LINEAR(F16, BF16, f16_bf16)
QUANT_LINEAR(BF16, F32, bf16_f32)
QUANT_LINEAR(BF16, F16, bf16_f16)
QUANT_LINEAR(BF16, BF16, bf16_bf16)
