// W4A16 CUDA kernels (int4, groups of 128, bf16 activations): w4a16_frag (M <= 16),
// w4a16_tile (M <= 64) and, on sm_90a, w4a16_wgmma / w4a16_wgmma_cluster (M <= 128). They read
// the fragment-ordered weight of quarl/quant/kernels/w4_layout.py; launched by cuda_w4.py,
// which compiles this file with NVRTC at first use.

typedef unsigned int u32;
typedef unsigned short u16;

// Programmatic dependent launch (sm_90+; launched by quarl.quant.kernels.cuda_launch.launch):
// wait until the kernel ahead on the stream has finished and its writes are visible, then let
// the kernel behind be scheduled (it waits the same way). Without the launch attribute both are
// no-ops, so every launch may run this first.
__device__ __forceinline__ void wait_ahead() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n\tgriddepcontrol.launch_dependents;" ::: "memory");
#endif
}

__device__ __forceinline__ u32 lop_q(u32 a) {  // (a & 0x000F000F) | 0x43004300: bf16x2 128 + code
  u32 r;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(a), "r"(0x000F000Fu), "r"(0x43004300u));
  return r;
}
__device__ __forceinline__ u32 sub_z(u32 a, u32 negz) {  // (128 + u) - (128 + z), exact
  u32 r;
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(0x3F803F80u), "r"(negz));
  return r;
}
// bf16x2 of bf16((u - z) s) from the bf16x2 of the exact (u - z) (sub_z) and the group scale s
// as both halves of `sb` (pair_bf16): the product of two bf16 values is exact before fma's one
// rounding, so this is the weight quarl.quant's dequantize writes ((u - z) s in fp32, then bf16)
// wherever s is a bf16 value, as the quantizer makes it (reference.bf16_scale); the -0 addend
// keeps the product's sign. (A scale that is not a bf16 value is taken rounded to nearest.)
__device__ __forceinline__ u32 pair_bf16(float s) {
  u32 r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %1;" : "=r"(r) : "f"(s));
  return r;
}
__device__ __forceinline__ u32 scale_bf16x2(u32 v, u32 sb) {
  u32 r;
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(v), "r"(sb), "r"(0x80008000u));
  return r;
}
__device__ __forceinline__ void mma16816(float* c, const u32* a, u32 b0, u32 b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ u32 smem_addr(const void* p) {
  u32 a;
  asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
  return a;
}
// 16 bytes global -> shared, bypassing L1; bytes past `valid` (0..16) are zero-filled
__device__ __forceinline__ void cp_async16(u32 dst, const void* src, int valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(dst), "l"(src), "r"(valid));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;"); }
template <int N_>
__device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;" :: "n"(N_)); }
__device__ __forceinline__ void sts128_zero(u32 addr) {
  asm volatile("st.shared.v4.u32 [%0], {%1,%1,%1,%1};" :: "r"(addr), "r"(0u));
}
// this thread's 16-byte weight chunks for a block of S slabs (chunk i: c = tid + i NTH, slab
// c / 256, byte 16 (c % 256) of the slab's 4 KB per group): group-0 source, ring offset from
// `base`, and whether the chunk is the thread's and its slab exists
template <int C, int NTH, int S>
__device__ __forceinline__ void weight_chunks(const u32* wq, int tid, int cb, int nslabs, int G, u32 base,
                                              const unsigned char* (&src)[C], u32 (&dst)[C], bool (&ok)[C]) {
#pragma unroll
  for (int i = 0; i < C; ++i) {
    const int c = tid + i * NTH, s = c >> 8, off = c & 255, sl = cb * S + s;
    ok[i] = c < S * 256 && sl < nslabs;
    src[i] = reinterpret_cast<const unsigned char*>(wq) + (ok[i] ? ((size_t)sl * G * 4096 + off * 16) : 0);
    dst[i] = base + s * 4096 + off * 16;
  }
}
// activation chunks this thread never copies (col < 0: rows >= M) zeroed once in all ST
// slots (chunk i is the thread's if tid + i NTH < limit)
template <int C, int NTH, int ST>
__device__ __forceinline__ void zero_skipped_chunks(u32 ring, u32 stage, int tid, int limit, const u32 (&dst)[C], const int (&col)[C]) {
#pragma unroll
  for (int i = 0; i < C; ++i)
    if (tid + i * NTH < limit && col[i] < 0)
      for (int p = 0; p < ST; ++p) sts128_zero(ring + p * stage + dst[i]);
}
__device__ __forceinline__ void lds128(u32* r, u32 addr) {
  asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void ldmatrix4(u32* r, u32 addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ float ldcg_f(const float* p) {  // other blocks' partials: skip L1
  float r;
  asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(r) : "l"(p));
  return r;
}
__device__ __forceinline__ u16 to_bf16(float v) {
  u16 r;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(v));
  return r;
}
__device__ __forceinline__ float from_bf16(u16 v) { return __uint_as_float(((u32)v) << 16); }
// silu(g) * u of the fp32 sums g, u, as the plain GEMM's bf16 outputs then the engine's
// SiLU-and-mul kernel (quarl.rollout.fused, Triton) compute it, instruction for instruction:
// g and u rounded to bf16; s = bf16(g / (1 + 2^(-g log2 e))) with ex2.approx, add.rn and
// div.full; then bf16(s u) (exact in fp32 before its one rounding)
__device__ __forceinline__ u16 silu_mul_bf16(float g, float u) {
  const float gf = from_bf16(to_bf16(g)), uf = from_bf16(to_bf16(u));
  float e, q;
  asm("ex2.approx.f32 %0, %1;" : "=f"(e) : "f"(__fmul_rn(gf, -1.4426950408889634f)));
  asm("div.full.f32 %0, %1, %2;" : "=f"(q) : "f"(gf), "f"(__fadd_rn(e, 1.f)));
  return to_bf16(__fmul_rn(from_bf16(to_bf16(q)), uf));
}
// Gated output (the [gate; up] weight's rows permuted so that each 16-row group holds 8 gate
// rows, then the same 8 rows of up: w4_layout's "wgmma-gated"): column j of h for the gate
// row at permuted position n (n % 16 < 8), whose up row is n + 8
__device__ __forceinline__ int gated_col(int n) { return (n >> 4) * 8 + (n & 7); }

// grid (Np / 64, split), block NW warps. Block (s, sp) owns the 64 output columns of slab s
// and groups [sp * gpb, (sp + 1) * gpb); its warps take contiguous shares of those groups
// and are summed in shared memory at the end.
// Each warp streams its steps (16 columns of K) through its own ring of ST slots in shared
// memory with cp.async (no register ring: a deep register prefetch runs out of the SM's
// load scoreboards and of registers). Slot layout, 1 KB: the weight
// fragments (lane L's 16 bytes at 16 L, read back by the same lane), then the activation
// tile as [2 column halves][16 rows][8 columns] bf16, so that lane L copies row L % 16,
// half L / 16 to 16 L and ldmatrix.x4 with lane L pointing at 16 L yields the mma A
// fragment. Rows >= M and columns >= K are zero-filled by cp.async.
template <int NW, bool ASYM, int ST>
__global__ void __launch_bounds__(NW * 32) w4a16_frag(
    const u16* __restrict__ x, const u32* __restrict__ wq, const float* __restrict__ scales,
    const u32* __restrict__ negz, const u16* __restrict__ bias, u16* __restrict__ out,
    float* __restrict__ part, int* __restrict__ counters,
    int M, int N, int K, int ldx, int ldo, int Np, int G, int gpb, int split, int has_bias) {
  constexpr int RING = NW * ST * 1024, RED = NW * 16 * 65 * 4;
  __shared__ __align__(128) unsigned char smem[RING > RED ? RING : RED];
  __shared__ int last_flag;
  wait_ahead();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int slab = blockIdx.x, sp = blockIdx.y;
  const int n0 = slab * 64;
  const int gb0 = sp * gpb, gb1 = min(G, gb0 + gpb);
  const int gpw = (gb1 - gb0 + NW - 1) / NW;
  const int wg0 = min(gb1, gb0 + warp * gpw), wg1 = min(gb1, wg0 + gpw);
  const int nsteps = (wg1 - wg0) * 8;
  const int kk0 = wg0 * 8;
  const size_t KS = (size_t)G * 8;
  const u32* wp = wq + (((size_t)slab * KS + kk0) * 32 + lane) * 4;
  const u32 ring = smem_addr(smem) + warp * ST * 1024;
  // this lane's activation copy: row lane % 16, columns 8 * (lane / 16) .. + 7 of each step
  const int xrow = lane & 15, xhalf = lane >> 4;
  const u16* xp = x + (size_t)(xrow < M ? xrow : 0) * ldx + kk0 * 16 + 8 * xhalf;
  const int xcol0 = kk0 * 16 + 8 * xhalf;

  auto issue = [&](int step, int slot) {
    const u32 base = ring + slot * 1024 + 16 * lane;
    cp_async16(base, wp + (size_t)step * 128, 16);
    const int left = K - (xcol0 + step * 16);
    const int valid = xrow < M ? (left >= 8 ? 16 : (left > 0 ? 2 * left : 0)) : 0;
    cp_async16(base + 512, valid ? xp + step * 16 : x, valid);
  };

  float acc[8][4];
  float tmp[8][4];
  float sc[8][2];
  u32 nz[8];
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int c = 0; c < 4; ++c) acc[j][c] = 0.f;

#pragma unroll
  for (int p = 0; p < ST - 1; ++p) {
    if (p < nsteps) issue(p, p);
    cp_commit();
  }
  for (int s0 = 0; s0 < nsteps; s0 += 8) {
    const int grp = wg0 + (s0 >> 3);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const float* sp_ = scales + (size_t)grp * Np + n0 + 8 * j + 2 * t;
      sc[j][0] = sp_[0];
      sc[j][1] = sp_[1];
      nz[j] = ASYM ? negz[(size_t)grp * Np + n0 + 8 * j + g] : 0xC308C308u;
    }
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int c = 0; c < 4; ++c) tmp[j][c] = 0.f;
#pragma unroll
    for (int p = 0; p < 8; ++p) {
      const int step = s0 + p, slot = p % ST;  // s0 % ST == 0 (ST divides 8)
      cp_wait<ST - 2>();
      __syncwarp();
      u32 b[4], a[4];
      lds128(b, ring + slot * 1024 + 16 * lane);
      ldmatrix4(a, ring + slot * 1024 + 512 + 16 * lane);
      // refill the slot read one step ago (all lanes are past it: __syncwarp above)
      if (step + ST - 1 < nsteps) issue(step + ST - 1, (p + ST - 1) % ST);
      cp_commit();
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const u32 w = b[i];
        const u32 q0 = lop_q(w), q1 = lop_q(w >> 4), q2 = lop_q(w >> 8), q3 = lop_q(w >> 12);
        mma16816(tmp[2 * i], a, sub_z(q0, nz[2 * i]), sub_z(q1, nz[2 * i]));
        mma16816(tmp[2 * i + 1], a, sub_z(q2, nz[2 * i + 1]), sub_z(q3, nz[2 * i + 1]));
      }
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      acc[j][0] += tmp[j][0] * sc[j][0];
      acc[j][1] += tmp[j][1] * sc[j][1];
      acc[j][2] += tmp[j][2] * sc[j][0];
      acc[j][3] += tmp[j][3] * sc[j][1];
    }
  }
  cp_wait<0>();
  __syncthreads();  // the ring becomes the reduction buffer

  // sum the warps: fragment (row g / g + 8, cols 8j + 2t, +1) -> red[warp][row][col]
  float (*red)[16][65] = reinterpret_cast<float (*)[16][65]>(smem);
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    red[warp][g][8 * j + 2 * t] = acc[j][0];
    red[warp][g][8 * j + 2 * t + 1] = acc[j][1];
    red[warp][g + 8][8 * j + 2 * t] = acc[j][2];
    red[warp][g + 8][8 * j + 2 * t + 1] = acc[j][3];
  }
  __syncthreads();
  const int rows = min(M, 16);
  if (split == 1) {
    for (int e = threadIdx.x; e < rows * 64; e += NW * 32) {
      const int r = e >> 6, c = e & 63, n = n0 + c;
      if (n >= N) continue;
      float v = 0.f;
#pragma unroll
      for (int w = 0; w < NW; ++w) v += red[w][r][c];
      if (has_bias) v += from_bf16(bias[n]);
      out[(size_t)r * ldo + n] = to_bf16(v);
    }
    return;
  }
  // split-K: store this split's partial, the last block to arrive sums all in split order
  for (int e = threadIdx.x; e < rows * 64; e += NW * 32) {
    const int r = e >> 6, c = e & 63, n = n0 + c;
    if (n >= N) continue;
    float v = 0.f;
#pragma unroll
    for (int w = 0; w < NW; ++w) v += red[w][r][c];
    part[((size_t)sp * M + r) * N + n] = v;
  }
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) last_flag = atomicAdd(counters + slab, 1) == split - 1;
  __syncthreads();
  if (!last_flag) return;
  __threadfence();
  for (int e = threadIdx.x; e < rows * 64; e += NW * 32) {
    const int r = e >> 6, c = e & 63, n = n0 + c;
    if (n >= N) continue;
    // issue 8 loads before adding (in-order issue would otherwise wait for each), sum in
    // split order
    float v = 0.f;
    for (int s = 0; s < split; s += 8) {
      float pv[8];
#pragma unroll
      for (int u = 0; u < 8; ++u) pv[u] = s + u < split ? ldcg_f(part + ((size_t)(s + u) * M + r) * N + n) : 0.f;
#pragma unroll
      for (int u = 0; u < 8; ++u) v += pv[u];
    }
    if (has_bias) v += from_bf16(bias[n]);
    out[(size_t)r * ldo + n] = to_bf16(v);
  }
  if (threadIdx.x == 0) atomicExch(counters + slab, 0);
}

// Split-K, after this block stored its partial sums in part[sp]: the last block to arrive for
// column block cb sums the splits in split order (+ bias) into out's columns c0 .. c0 + cols - 1
// (cols <= CMAX) and resets the counter. One fence, by thread 0 after the block barrier (the
// release / acquire pattern of CUTLASS's semaphores), not one per thread. Each thread owns
// 4 (row, V-column) items per round, V = 4 when N % 4 == 0 (16-byte loads), and issues the
// loads of 4 splits of all 4 before adding them (in split order).
__device__ __forceinline__ float4 ldcg_f4(const float* p) {
  float4 r;
  asm volatile("ld.global.cg.v4.f32 {%0,%1,%2,%3}, [%4];" : "=f"(r.x), "=f"(r.y), "=f"(r.z), "=f"(r.w) : "l"(p));
  return r;
}
// out[r][n .. n + V - 1] = bf16(v + bias) for the columns < N; V = 4: one 8-byte store when
// all 4 columns are in range and the address is 8-byte aligned
template <int V>
__device__ __forceinline__ void store_out(u16* out, int ldo, int r, int n, int N, const float* v, const u16* bias, int has_bias) {
  u16 h[V];
#pragma unroll
  for (int e = 0; e < V; ++e) h[e] = to_bf16(v[e] + (has_bias && n + e < N ? from_bf16(bias[n + e]) : 0.f));
  u16* dst = out + (size_t)r * ldo + n;
  if (V == 4 && n + 4 <= N && ((ldo | n) & 3) == 0) {
    *reinterpret_cast<uint2*>(dst) = make_uint2(h[0] | ((u32)h[1] << 16), h[2] | ((u32)h[3] << 16));
  } else {
#pragma unroll
    for (int e = 0; e < V; ++e)
      if (n + e < N) dst[e] = h[e];
  }
}
template <int NTH, int CQ, int V>
__device__ __forceinline__ void splitk_sum(
    const float* part, u16* out, const u16* bias, int c0, int cols, int M, int N, int ldo, int split, int has_bias) {
  const int tid = threadIdx.x, total = M * CQ;
  const size_t stride = (size_t)M * N;
  for (int i0 = 0; i0 < total; i0 += 4 * NTH) {
    size_t off[4];
    bool ok[4];
    float v[4][V];
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int i = i0 + tid + u * NTH, r = i / CQ, q = i % CQ;
      ok[u] = i < total && q * V < cols;
      off[u] = ok[u] ? (size_t)r * N + c0 + q * V : 0;
#pragma unroll
      for (int e = 0; e < V; ++e) v[u][e] = 0.f;
    }
    for (int s = 0; s < split; s += 4) {
      float pv[4][4][V];
#pragma unroll
      for (int d = 0; d < 4; ++d)
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          const bool live = ok[u] && s + d < split;
          const float* p = part + off[u] + (size_t)(s + d) * stride;
          if constexpr (V == 4) {
            const float4 t = live ? ldcg_f4(p) : make_float4(0.f, 0.f, 0.f, 0.f);
            pv[d][u][0] = t.x; pv[d][u][1] = t.y; pv[d][u][2] = t.z; pv[d][u][3] = t.w;
          } else {
            pv[d][u][0] = live ? ldcg_f(p) : 0.f;
          }
        }
#pragma unroll
      for (int d = 0; d < 4; ++d)
#pragma unroll
        for (int u = 0; u < 4; ++u)
#pragma unroll
          for (int e = 0; e < V; ++e) v[u][e] += pv[d][u][e];
    }
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      if (!ok[u]) continue;
      const int i = i0 + tid + u * NTH;
      store_out<V>(out, ldo, i / CQ, c0 + (i % CQ) * V, N, v[u], bias, has_bias);
    }
  }
}
// The gated sum: items (row, 4 gate columns); the gate and the up partials (8 columns on) are
// summed in split order as splitk_sum sums them, then h = silu(g) u into out [M, N / 2]
template <int NTH, int CQ>
__device__ __forceinline__ void splitk_sum_gated(const float* part, u16* out, int c0, int cols, int M, int N, int ldo, int split) {
  constexpr int HQ = CQ / 2;  // gate items per row
  const int tid = threadIdx.x, total = M * HQ;
  const size_t stride = (size_t)M * N;
  for (int i = tid; i < total; i += NTH) {
    const int r = i / HQ, q = i % HQ, c = 16 * (q >> 1) + 4 * (q & 1);
    if (c >= cols) continue;
    const float* p = part + (size_t)r * N + c0 + c;
    float gv[4] = {0.f, 0.f, 0.f, 0.f}, uv[4] = {0.f, 0.f, 0.f, 0.f};
    for (int s = 0; s < split; ++s) {
      const float4 a = ldcg_f4(p + (size_t)s * stride), b = ldcg_f4(p + 8 + (size_t)s * stride);
      gv[0] += a.x; gv[1] += a.y; gv[2] += a.z; gv[3] += a.w;
      uv[0] += b.x; uv[1] += b.y; uv[2] += b.z; uv[3] += b.w;
    }
    u16 h[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) h[e] = silu_mul_bf16(gv[e], uv[e]);
    *reinterpret_cast<uint2*>(out + (size_t)r * ldo + gated_col(c0 + c)) = make_uint2(h[0] | ((u32)h[1] << 16), h[2] | ((u32)h[3] << 16));
  }
}
// (BAR > 0: the block's first NTH threads only, on named barrier BAR: a producer warpgroup has left)
template <int NTH, int CMAX, bool GATED = false, int BAR = 0>
__device__ __forceinline__ void splitk_finish(
    const float* part, u16* out, const u16* bias, int* counters, int cb, int c0, int cols,
    int M, int N, int ldo, int split, int has_bias) {
  __shared__ int last_flag;
  const int tid = threadIdx.x;
  auto sync = [&]() {
    if constexpr (BAR > 0) asm volatile("bar.sync %0, %1;" :: "n"(BAR), "n"(NTH) : "memory");
    else __syncthreads();
  };
  sync();  // every thread's partial stores ...
  if (tid == 0) {
    __threadfence();  // ... made visible at GPU scope before the arrival
    const int last = atomicAdd(counters + cb, 1) == split - 1;
    if (last) __threadfence();  // the other blocks' partials seen before this block reads them
    last_flag = last;
  }
  sync();
  if (!last_flag) return;
  if constexpr (GATED)  // N % 16 == 0 and ldo % 4 == 0 (launch checks)
    splitk_sum_gated<NTH, CMAX / 4>(part, out, c0, cols, M, N, ldo, split);
  else if ((N & 3) == 0 && (ldo & 3) == 0)  // 16-byte partial loads, 8-byte output stores
    splitk_sum<NTH, CMAX / 4, 4>(part, out, bias, c0, cols, M, N, ldo, split, has_bias);
  else
    splitk_sum<NTH, CMAX, 1>(part, out, bias, c0, cols, M, N, ldo, split, has_bias);
  if (tid == 0) atomicExch(counters + cb, 0);
}

// The block-tiled variant for 16 < M <= 64 (and small M where it wins): the block's warps
// share one activation tile per stage instead of each copying its own.
// grid (ceil(Np / (64 SW)), split), block NW = SW x (8 / NT) x WM warps. Block (cb, sp) owns
// slabs cb * SW .. + SW - 1 and groups [sp * gpb, (sp + 1) * gpb). Warp (ws, wh, wm) computes
// n8 tiles wh * NT .. + NT - 1 of slab ws (words wh * NT / 2 .. of each lane's 16 bytes) for
// m16 tiles wm * MT .. + MT - 1 over all of the block's groups, so no reduction inside the
// block. One ring slot (dynamic shared memory) holds one group (128 columns of K): the SW
// slabs' fragments, 4 KB each, as they lie in global memory, then the activation tile as
// [MT * WM m16 tiles][8 steps][2 column halves][16 rows][8 columns] bf16, so ldmatrix.x4 with
// lane L at 16 L of a (tile, step) yields its A fragment. All threads copy with cp.async
// (rows >= M, columns >= K and slabs >= Np / 64 zero-filled); one barrier per group.
template <int SW, int NT, int MT, int WM, int ST, bool ASYM>
__global__ void __launch_bounds__(SW * (8 / NT) * WM * 32, (MT * NT <= 8 && SW * (8 / NT) * WM <= 8) ? 2 : 1) w4a16_tile(
    const u16* __restrict__ x, const u32* __restrict__ wq, const float* __restrict__ scales,
    const u32* __restrict__ negz, const u16* __restrict__ bias, u16* __restrict__ out,
    float* __restrict__ part, int* __restrict__ counters,
    int M, int N, int K, int ldx, int ldo, int Np, int G, int gpb, int split, int has_bias) {
  constexpr int WH = 8 / NT, NWD = NT / 2, NTH = SW * WH * WM * 32, MTOT = MT * WM;
  // slot: weights | activations | scales (SW x 64 fp32) | zero points (SW x 64 u32, ASYM)
  constexpr int WBYTES = SW * 4096, SBYTES = WBYTES + MTOT * 4096, STAGE = SBYTES + SW * 256 * (ASYM ? 2 : 1);
  extern __shared__ __align__(128) unsigned char dsmem[];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int wm = warp % WM, wh = (warp / WM) % WH, ws = warp / (WM * WH);
  wait_ahead();
  const int cb = blockIdx.x, sp = blockIdx.y;
  const int nslabs = Np >> 6;
  const int slab = cb * SW + ws;
  const bool live = slab < nslabs;
  const int n0 = slab * 64;
  const int gb0 = sp * gpb, ngroups = min(G, gb0 + gpb) - gb0;
  const size_t KS = (size_t)G * 8;
  const u32 ring = smem_addr(dsmem);

  // this thread's copies, fixed but for the group: CW weight chunks and CA activation chunks
  // of 16 bytes (chunk c = tid + i * NTH); offsets in bytes from the group's first byte
  constexpr int CW = (SW * 256 + NTH - 1) / NTH, CA = (MTOT * 256 + NTH - 1) / NTH;
  constexpr int CS = (SW * 16 * (ASYM ? 2 : 1) + NTH - 1) / NTH;
  const unsigned char* wsrc[CW];
  u32 wdst[CW];
  bool wok[CW];
  weight_chunks<CW, NTH, SW>(wq, tid, cb, nslabs, G, 0, wsrc, wdst, wok);
  const unsigned char* asrc[CA];
  u32 adst[CA];
  int acol[CA];  // first column of the chunk in group 0; -1: nothing to copy (row >= M)
#pragma unroll
  for (int i = 0; i < CA; ++i) {
    const int c = tid + i * NTH, r = c >> 4, q = c & 15;
    const bool ok = c < MTOT * 256 && r < M;
    acol[i] = ok ? q * 8 : -1;
    asrc[i] = reinterpret_cast<const unsigned char*>(x) + (ok ? ((size_t)r * ldx + q * 8) * 2 : 0);
    adst[i] = c < MTOT * 256 ? WBYTES + ((((r >> 4) * 8 + (q >> 1)) * 2 + (q & 1)) * 16 + (r & 15)) * 16 : 0;
  }

  // activation rows >= M are never copied: zeroed once here in every slot, they stay zero
  // (the first group's __syncthreads orders these stores before any ldmatrix)
  zero_skipped_chunks<CA, NTH, ST>(ring, STAGE, tid, MTOT * 256, adst, acol);

  auto issue = [&](int grp, int slot) {
    const u32 sbase = ring + slot * STAGE;
#pragma unroll
    for (int i = 0; i < CW; ++i)  // a slab's group: 4 KB at slab * KS * 512 + grp * 4096
      if (tid + i * NTH < SW * 256) cp_async16(sbase + wdst[i], wsrc[i] + (wok[i] ? (size_t)grp * 4096 : 0), wok[i] ? 16 : 0);
#pragma unroll
    for (int i = 0; i < CA; ++i) {
      if (tid + i * NTH >= MTOT * 256 || acol[i] < 0) continue;
      const int left = K - grp * 128 - acol[i];
      if (left >= 8) cp_async16(sbase + adst[i], asrc[i] + (size_t)grp * 256, 16);
      else cp_async16(sbase + adst[i], left > 0 ? asrc[i] + (size_t)grp * 256 : asrc[i], left > 0 ? 2 * left : 0);
    }
    // the group's scales (and zero points) of the block's slabs: 16 chunks of 16 bytes each
#pragma unroll
    for (int i = 0; i < CS; ++i) {
      const int c = tid + i * NTH;
      if (c >= SW * 16 * (ASYM ? 2 : 1)) continue;
      const int zp = c >= SW * 16, cc = c - zp * SW * 16, sl = cb * SW + (cc >> 4);
      const bool ok = sl < nslabs;
      const void* src = zp ? (const void*)(negz + (size_t)grp * Np + sl * 64 + (cc & 15) * 4)
                           : (const void*)(scales + (size_t)grp * Np + sl * 64 + (cc & 15) * 4);
      cp_async16(sbase + SBYTES + c * 16, ok ? src : (const void*)scales, ok ? 16 : 0);
    }
  };

  float acc[MT][NT][4];
  float tmp[MT][NT][4];
  float sc[NT][2];
  u32 nz[NT];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int c = 0; c < 4; ++c) acc[mt][j][c] = 0.f;

#pragma unroll
  for (int p = 0; p < ST - 1; ++p) {
    if (p < ngroups) issue(gb0 + p, p);
    cp_commit();
  }
  for (int gi = 0; gi < ngroups; ++gi) {
    cp_wait<ST - 2>();
    __syncthreads();  // group gi landed for every thread; all are past the slot of gi - 1
    if (gi + ST - 1 < ngroups) issue(gb0 + gi + ST - 1, (gi + ST - 1) % ST);
    cp_commit();
    const int grp = gb0 + gi;
    const u32 sbase = ring + (gi % ST) * STAGE;
#pragma unroll
    for (int jl = 0; jl < NT; ++jl) {
      const u32 col = ws * 64 + 8 * (wh * NT + jl);
      asm volatile("ld.shared.v2.f32 {%0,%1}, [%2];" : "=f"(sc[jl][0]), "=f"(sc[jl][1]) : "r"(sbase + SBYTES + 4 * (col + 2 * t)));
      if constexpr (ASYM) {
        asm volatile("ld.shared.u32 %0, [%1];" : "=r"(nz[jl]) : "r"(sbase + SBYTES + SW * 256 + 4 * (col + g)));
      } else {
        nz[jl] = 0xC308C308u;
      }
    }
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int c = 0; c < 4; ++c) tmp[mt][j][c] = 0.f;
#pragma unroll
    for (int s = 0; s < 8; ++s) {
      u32 b[NWD], a[MT][4];
      const u32 waddr = sbase + ws * 4096 + s * 512 + 16 * lane + 4 * NWD * wh;
      if constexpr (NWD == 4) {
        lds128(b, waddr);
      } else {
#pragma unroll
        for (int i = 0; i < NWD; ++i) asm volatile("ld.shared.u32 %0, [%1];" : "=r"(b[i]) : "r"(waddr + 4 * i));
      }
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) ldmatrix4(a[mt], sbase + WBYTES + (((wm * MT + mt) * 8 + s) * 2) * 256 + 16 * lane);
#pragma unroll
      for (int i = 0; i < NWD; ++i) {
        const u32 w = b[i];
        const u32 b0 = sub_z(lop_q(w), nz[2 * i]), b1 = sub_z(lop_q(w >> 4), nz[2 * i]);
        const u32 b2 = sub_z(lop_q(w >> 8), nz[2 * i + 1]), b3 = sub_z(lop_q(w >> 12), nz[2 * i + 1]);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma16816(tmp[mt][2 * i], a[mt], b0, b1);
          mma16816(tmp[mt][2 * i + 1], a[mt], b2, b3);
        }
      }
    }
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        acc[mt][j][0] += tmp[mt][j][0] * sc[j][0];
        acc[mt][j][1] += tmp[mt][j][1] * sc[j][1];
        acc[mt][j][2] += tmp[mt][j][2] * sc[j][0];
        acc[mt][j][3] += tmp[mt][j][3] * sc[j][1];
      }
  }
  cp_wait<0>();

  // fragment element (mt, j, c): row (wm * MT + mt) * 16 + g + 8 (c >> 1), column n0 + 8 (wh NT + j) + 2 t + (c & 1)
  if (split == 1) {
    if (!live) return;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          const int r = (wm * MT + mt) * 16 + g + 8 * (c >> 1), n = n0 + 8 * (wh * NT + j) + 2 * t + (c & 1);
          if (r >= M || n >= N) continue;
          float v = acc[mt][j][c];
          if (has_bias) v += from_bf16(bias[n]);
          out[(size_t)r * ldo + n] = to_bf16(v);
        }
    return;
  }
  // split-K: store this split's partial, the last block to arrive sums all in split order
  if (live) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          const int r = (wm * MT + mt) * 16 + g + 8 * (c >> 1), n = n0 + 8 * (wh * NT + j) + 2 * t + (c & 1);
          if (r < M && n < N) part[((size_t)sp * M + r) * N + n] = acc[mt][j][c];
        }
  }
  splitk_finish<NTH, SW * 64>(part, out, bias, counters, cb, cb * SW * 64, min(SW * 64, N - cb * SW * 64), M, N, ldo, split, has_bias);
}

// ----------------------------------------------------------------------------- wgmma (sm90a)
// W4A16 for 8 < M <= 128 on Hopper: the dequantized weight is the register A operand of
// wgmma.m64nNk16 (64 weight rows per warpgroup on the MMA's M side), the activation tile
// (N = NTOK tokens) the B operand, read by the tensor cores straight from shared memory.
// grid (ceil(Np / (64 NWG)), split), block NWG warpgroups. Block (cb, sp) owns slabs cb * NWG ..
// + NWG - 1 (one per warpgroup) and groups [sp * gpb, (sp + 1) * gpb). A ring slot (dynamic
// shared memory, 1024-aligned) holds one group: the activation tile as two 64-column atoms
// of NTOK rows x 128 bytes in the 128-byte swizzled K-major layout wgmma reads (16-byte chunk
// c of row r at r * 128 + ((c ^ (r % 8)) << 4)), then the slabs' weight words
// ([warp][half][lane][4 words], word i of half h = step 4 h + i, see wgmma_words), filled by
// all threads with cp.async (rows >= M and columns >= K zero-filled); one barrier per group.
// Per group each warpgroup unpacks its 8 steps (4 registers each) and issues 8 wgmmas into a
// fresh fp32 tile; while they run it adds the previous group's tile, scaled by that group's
// scale, to the accumulator (two tiles in turn; the numerics of w4a16_frag). Slots are
// refilled two groups behind (ST >= 3), once the wgmmas that read them are done. SINGLE: one
// tile, waited for before each fold (~126 registers: up to 4 warpgroups per SM), slots refilled
// one group behind. NTOK = 128 (M = 65-128) runs the single-tile loop only: its fp32 tile is 64
// registers a thread, and a second one would spill.
__device__ __forceinline__ unsigned long long desc_sw128(u32 addr) {
  // K-major operand, 128-byte swizzle, 8-row core groups 1024 bytes apart
  return (unsigned long long)((addr >> 4) & 0x3FFF) | ((unsigned long long)(1024 >> 4) << 32) | (1ull << 62);
}
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wg_wait0() { asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory"); }
__device__ __forceinline__ void wg_wait1() { asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory"); }
__device__ __forceinline__ void proxy_fence() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
__device__ __forceinline__ void keep_f(float& v) { asm volatile("" : "+f"(v) :: "memory"); }
__device__ __forceinline__ void keep_r(u32& v) { asm volatile("" : "+r"(v) :: "memory"); }
// named barrier ID0 + wg over the 128 threads of warpgroup wg (< 4), with immediate IDs
template <int ID0>
__device__ __forceinline__ void wg_bar(int wg) {
  if (wg == 0) asm volatile("bar.sync %0, 128;" :: "n"(ID0) : "memory");
  else if (wg == 1) asm volatile("bar.sync %0, 128;" :: "n"(ID0 + 1) : "memory");
  else if (wg == 2) asm volatile("bar.sync %0, 128;" :: "n"(ID0 + 2) : "memory");
  else asm volatile("bar.sync %0, 128;" :: "n"(ID0 + 3) : "memory");
}
// a warpgroup's register budget (setmaxnreg, sm90: every thread of the warpgroup executes it)
template <int R>
__device__ __forceinline__ void regs_down() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" :: "n"(R)); }
template <int R>
__device__ __forceinline__ void regs_up() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" :: "n"(R)); }
// mbarriers (shared::cta, 64-bit): the MB loop's per-slot "landed" and "read" barriers
__device__ __forceinline__ void mb_init(u32 bar, u32 count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mb_arrive(u32 bar) {
  asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.shared::cta.b64 st, [%0];\n}" :: "r"(bar) : "memory");
}
__device__ __forceinline__ void mb_wait(u32 bar, u32 parity) {  // until the phase of this parity completed
  asm volatile("{\n.reg .pred done;\nMB_WAIT:\n"
               "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
               "@!done bra MB_WAIT;\n}" :: "r"(bar), "r"(parity) : "memory");
}
// The bulk-copy engine (TMA, sm90; the TMA loop): one thread's arrival on a slot's "full"
// barrier that also expects the slot's bytes, a contiguous copy (weights) and a 2-D tile of
// the activation tensor map (its 128-byte swizzle is the one wgmma reads), each completing
// its bytes on that barrier. Rows and columns past the tensor's end arrive as zeros.
__device__ __forceinline__ void mb_expect_tx(u32 bar, u32 bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void bulk_copy(u32 dst, const void* src, u32 bytes, u32 bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               :: "r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}
__device__ __forceinline__ void tma_tile(u32 dst, const void* map, int col, int row, u32 bar) {
  asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];"
               :: "r"(dst), "l"(map), "r"(col), "r"(row), "r"(bar) : "memory");
}
// The staged epilogue's pieces: four 8x8 bf16 matrices from mma fragments (thread (g, t) holds
// row g, columns 2t, 2t + 1 of each) stored transposed, row q of matrix m at the address lane
// 8 m + q gives; a bf16x2 of (lo, hi) rounded to nearest; a 16-byte global store
__device__ __forceinline__ void stmatrix4_trans(u32 addr, u32 r0, u32 r1, u32 r2, u32 r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};"
               :: "r"(addr), "r"(r0), "r"(r1), "r"(r2), "r"(r3) : "memory");
}
__device__ __forceinline__ u32 bf16x2_of(float lo, float hi) {
  u32 r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
__device__ __forceinline__ void stg128(void* p, const u32* v) {
  asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};" :: "l"(p), "r"(v[0]), "r"(v[1]), "r"(v[2]), "r"(v[3]) : "memory");
}
// CUtensorMap (cuda.h): 128 opaque bytes, passed by value (__grid_constant__)
struct __align__(64) TmaMap { unsigned long long v[16]; };
//WGMMA_WRAPPERS//
// Timing probes, compiled only with -DW4_TRACE (quarl bench trace): thread 0 of each block
// stores %globaltimer and %clock64 at point i (0 entry, 1 first group landed, 2 main loop done,
// 3 partials stored or, in a block over all of K, its output stores begin, 4 output written:
// the split-K finish done or the block's stores issued) and its SM in trace[b * 12 + ...],
// b = blockIdx.y * gridDim.x + blockIdx.x (points a block does not pass stay 0).
#ifdef W4_TRACE
__device__ __forceinline__ void w4_trace_at(unsigned long long* tr, int i) {
  unsigned long long gt, ck;
  u32 sm;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(gt));
  asm volatile("mov.u64 %0, %%clock64;" : "=l"(ck));
  asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
  tr += ((size_t)blockIdx.y * gridDim.x + blockIdx.x) * 12;
  tr[i] = gt;
  tr[5 + i] = ck;
  tr[10] = sm;
}
#define W4_TRACE_AT(i) do { if (threadIdx.x == 0) w4_trace_at(trace, (i)); } while (0)
#else
#define W4_TRACE_AT(i) do { } while (0)
#endif

// Cluster variant (CS > 0, 2..8; __cluster_dims__(CS)): the CS K splits of one column
// block are the CS blocks of one thread-block cluster (block b: column block b / CS, split
// b % CS) and are summed through distributed shared memory instead of global partials:
// each block stores its fp32 tile in its own shared memory, one cluster barrier, then block
// r sums its share of the (token, 4-column) items over the CS tiles in split order (the
// numerics of splitk_sum, bit for bit), a second barrier keeps the tiles alive until all
// are read. No partials buffer, no arrival counter, no fences through L2.
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
__device__ __forceinline__ float4 ld_cluster_f4(u32 addr, u32 rank) {
  u32 remote;
  float4 r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(addr), "r"(rank));
  asm volatile("ld.shared::cluster.v4.f32 {%0,%1,%2,%3}, [%4];" : "=f"(r.x), "=f"(r.y), "=f"(r.z), "=f"(r.w) : "r"(remote) : "memory");
  return r;
}

#ifdef W4_TRACE
#define W4_TRACE_PARAM , unsigned long long* __restrict__ trace
#define W4_TRACE_ARG , trace
#else
#define W4_TRACE_PARAM
#define W4_TRACE_ARG
#endif
#define W4_WGMMA_PARAMS                                                                       \
  const u16* __restrict__ x, const u32* __restrict__ wq, const float* __restrict__ scales,    \
      const u32* __restrict__ negz, const u16* __restrict__ bias, u16* __restrict__ out,      \
      float* __restrict__ part, int* __restrict__ counters, int M, int N, int K, int ldx,     \
      int ldo, int Np, int G, int gpb, int split, int has_bias, int whole, const u16* __restrict__ lt, \
      const u16* __restrict__ lb, int ldt, int ldb, int lw, int lscale_bits, int lr1, int lr2, int lc0, int lc1, \
      int lc2 W4_TRACE_PARAM
#define W4_WGMMA_ARGS                                                                                 \
  x, wq, scales, negz, bias, out, part, counters, M, N, K, ldx, ldo, Np, G, gpb, split, has_bias, whole, lt, lb, \
      ldt, ldb, lw, lscale_bits, lr1, lr2, lc0, lc1, lc2 W4_TRACE_ARG

// LoRA term (LR > 0: LR 64-column atoms, ranks up to 64 LR): the K-split 0 block of each
// column block adds scaling * t[:, c .. c + 64 LR) B[rows, c .. c + 64 LR)^T to its fp32 tile
// (before the main loop in the mbarrier loop, after it in the others: whichever measured
// cheaper): t = x A^T [M, lw] (the group's stacked shrink, bf16), B [N, lw] (bf16,
// block-diagonal over the members of a fused group: other members' columns are zero in a
// member's rows), c the column offset of the member that owns the slab (member i starts at
// output row lr_i: lr1, lr2; offsets lc0..lc2). One more wgmma group, the same instructions as a
// weight group's with bf16 B rows as the A operand. Each warpgroup's t tile (swizzled as the
// activation tile) and B rows (row pitch 64 LR + 8 bf16: no bank conflicts) are copied to
// shared memory past the ring with the prologue's copies.
// TMA (the TMA loop, w4a16_wgmma_tma): the mbarrier loop with its copies made by the bulk-copy
// engine instead of every thread's cp.async: thread 0 arms a slot's "full" barrier with the
// slot's bytes and issues the activation tile (two boxes of the tensor map `xmap`, rows >= M
// and columns >= K zero-filled) and each live slab's 4 KB of words (one contiguous copy each).
// The other threads issue no copies, no cp.async waits and no arrivals on "full", and each
// group's weights are unpacked while the previous group's wgmmas run. Same products in the
// same order as the mbarrier loop: its output bit for bit.
// WSP (the pre-scaled TMA loop with a producer warpgroup, w4a16_wgmma_tma_ws): one more
// warpgroup, past the NWG that compute, whose thread NTH issues every unit's copies as soon as
// its slot is released (all ST slots in flight), so no computing warp ever waits to refill; it
// gives its registers to the computing warpgroups (setmaxnreg) and leaves. The same wgmmas in
// the same order: the pre-scaled TMA loop's output bit for bit.
template <int NWG, int NTOK, int ST, bool ASYM, bool SINGLE, int CS, bool MB, int LR, bool GATED, int PS, bool TMA = false,
          bool WSP = false>
__device__ __forceinline__ void w4a16_wgmma_body(W4_WGMMA_PARAMS, const void* xmap = nullptr) {
  static_assert(!WSP || (TMA && PS && CS == 0 && (NWG == 2 || NWG == 3)),
                "the producer warpgroup feeds the pre-scaled TMA loop of 2-3 warpgroups, no cluster");
  static_assert(!GATED || LR == 0, "the gated epilogue takes no LoRA term");
  static_assert(!TMA || (LR == 0 && (MB || PS)), "TMA copies feed the mbarrier or the pre-scaled loop, no LoRA term");
  static_assert(!PS || (!SINGLE && !MB && LR == 0), "the pre-scaled loop is its own loop and takes no LoRA term");
  constexpr int NTH = NWG * 128, NACC = NTOK / 2;
  static_assert(NTOK <= 64 || SINGLE || PS, "128-token tiles run the single-tile or the pre-scaled loop");
  if constexpr (PS) {
    // PS: blockIdx.y is the token tile (rows tt NTOK .. + NTOK - 1 of x and out): the block
    // sees a tile of M <= NTOK rows, with its own stretch of the partials and the counters
    const int tt = blockIdx.y;
    x += (size_t)tt * NTOK * ldx;
    out += (size_t)tt * NTOK * ldo;
    part += (size_t)tt * split * NTOK * N;
    counters += tt * ((Np / 64 + NWG - 1) / NWG);
    M = min(NTOK, M - tt * NTOK);
  }
  static_assert(!MB || (SINGLE && ST >= 4), "the mbarrier loop is a single-tile loop of >= 4 slots");
  W4_TRACE_AT(0);
  // groups in flight: a slot is refilled once the wgmmas that read it are done, one group
  // behind in the single-tile loop (waited for before its fold), two in the double-buffered one
  constexpr int LA = SINGLE && !MB ? ST - 1 : ST - 2;
  // PS == 2: ring slots of half a group (64 columns of K: one activation atom, each slab's words
  // of that half), refilled per half, so that the same shared memory holds copies further ahead
  constexpr bool HS = PS == 2;
  static_assert(!HS || NTOK > 128, "half-group slots: 192- and 256-token tiles");
  constexpr int XBYTES = HS ? NTOK * 128 : NTOK * 256, STAGE = XBYTES + NWG * (HS ? 2048 : 4096);  // multiples of 1024
  constexpr int BROW = (LR * 64 + 8) * 2, LBYTES = LR * NTOK * 128 + 64 * BROW;  // LoRA bytes a warpgroup
  extern __shared__ unsigned char dsmem[];
  const int tid = threadIdx.x, lane = tid & 31, warp = (tid >> 5) & 3, wg = tid >> 7;
  const int g = lane >> 2, t = lane & 3;
  const int nslabs = Np >> 6;
  // block -> (column block, K split): the first `whole` blocks take one column block each
  // over all of K; the others split the remaining column blocks' K `split` ways (gpb groups
  // each), the blocks of one split `tcols` apart (whole = 0: every column block split)
  const int tcols = (nslabs + NWG - 1) / NWG - whole, tb = (int)blockIdx.x - whole;
  const bool whole_blk = CS == 0 && tb < 0;
  const int cb = CS ? blockIdx.x / CS : (whole_blk ? blockIdx.x : whole + tb % tcols);
  const int sp = CS ? blockIdx.x % CS : (whole_blk ? 0 : tb / tcols);
  const int nsplit = CS ? CS : (whole_blk ? 1 : split);
  const int slab = cb * NWG + wg;
  const bool live = slab < nslabs;
  const int n0 = slab * 64;
  const int gb0 = sp * gpb, ngroups = whole_blk ? G : min(G, gb0 + gpb) - gb0;
  const u32 ring = (smem_addr(dsmem) + 1023u) & ~1023u;

  // this thread's copies: CX activation chunks (row c / 16, chunk c % 16) and CW weight
  // chunks, as 32-bit byte offsets from x / wq (one 64-bit base per group: fewer registers
  // and address instructions than a pointer per chunk; launch checks both fit)
  constexpr int CX = (NTOK * 16 + NTH - 1) / NTH, CW = (NWG * 256 + NTH - 1) / NTH;
  // LINX (192- and 256-token tiles): copy i of a thread is row r0 + i RSTEP, chunk q0 (RSTEP = NTH / 16 is
  // a multiple of 8, so all its copies share one swizzle): one base and one stride for each
  // address instead of three CX-long arrays (48 registers at 256 tokens)
  constexpr bool LINX = NTOK > 128;
  constexpr int CXA = LINX ? 1 : CX, RSTEP = NTH / 16;
  static_assert(!LINX || (RSTEP % 8 == 0 && (NTOK * 16) % NTH == 0), "256-token tiles: 1 or 2 warpgroups");
  const int r0 = tid >> 4, q0 = tid & 15;
  const u32 xsrc0 = ((u32)r0 * ldx + q0 * 8) * 2, xstep = (u32)RSTEP * ldx * 2;
  const u32 xdst0 = (q0 >> 3) * (NTOK * 128) + r0 * 128 + (((q0 & 7) ^ (r0 & 7)) << 4);
  u32 xsrc[CXA], xdst[CXA];
  int xcol[CXA];  // first column in group 0; -1: zero-fill only (row >= M) or no chunk
#pragma unroll
  for (int i = 0; i < CXA; ++i) {
    const int c = tid + i * NTH, r = c >> 4, q = c & 15;
    const bool ok = c < NTOK * 16 && r < M;
    xcol[i] = ok ? q * 8 : -1;
    xsrc[i] = ok ? ((u32)r * ldx + q * 8) * 2 : 0;
    xdst[i] = (q >> 3) * (NTOK * 128) + r * 128 + (((q & 7) ^ (r & 7)) << 4);
  }
  u32 wsrc[CW], wdst[CW];
  bool wok[CW];
#pragma unroll
  for (int i = 0; i < CW; ++i) {
    const int c = tid + i * NTH, s = c >> 8, off = c & 255, sl = cb * NWG + s;
    wok[i] = c < NWG * 256 && sl < nslabs;
    wsrc[i] = wok[i] ? (u32)sl * G * 4096 + off * 16 : 0;
    wdst[i] = XBYTES + s * 4096 + off * 16;
  }
  // activation rows >= M are never copied: zeroed once here in every slot, they stay zero
  // (the first group's barrier orders these stores before any wgmma reads them)
  // HS: half j (group gb0 + j / 2, columns 64 (j % 2) ..) into a half slot. Activations: chunk q1
  // of rows r1 + i RSTEP1 (8 chunks a row, RSTEP1 = NTH / 8, a multiple of 8: one swizzle); weights:
  // one 16-byte word a thread, word (warp w, lane l) of its slab's half at (2 w + h) 512 + 16 l
  constexpr int RSTEP1 = NTH / 8, CXH = HS ? NTOK * 8 / NTH : 1;
  static_assert(!HS || (RSTEP1 % 8 == 0 && (NTOK * 8) % NTH == 0), "half-group slots: 1 or 2 warpgroups");
  const int r1 = tid >> 3, q1 = tid & 7;
  const u32 hsrc0 = ((u32)r1 * ldx + q1 * 8) * 2, hstep = (u32)RSTEP1 * ldx * 2;
  const u32 hdst0 = r1 * 128 + ((q1 ^ (r1 & 7)) << 4);
  const int hslab = cb * NWG + (tid >> 7), hoff = tid & 127;
  const bool hwok = hslab < nslabs;
  if constexpr (TMA) {
    // (the tensor map's boxes write every row: zeros past M)
  } else if constexpr (HS) {
#pragma unroll
    for (int i = 0; i < CXH; ++i)
      if (r1 + i * RSTEP1 >= M)
        for (int p = 0; p < ST; ++p) sts128_zero(ring + p * STAGE + hdst0 + i * RSTEP1 * 128);
  } else if constexpr (LINX) {
#pragma unroll
    for (int i = 0; i < CX; ++i)
      if (r0 + i * RSTEP >= M)
        for (int p = 0; p < ST; ++p) sts128_zero(ring + p * STAGE + xdst0 + i * RSTEP * 128);
  } else {
    zero_skipped_chunks<CX, NTH, ST>(ring, STAGE, tid, NTOK * 16, xdst, xcol);
  }
  auto issue_x = [&](int grp, int slot) {
    const u32 sbase = ring + slot * STAGE;
    const unsigned char* xg = reinterpret_cast<const unsigned char*>(x) + (size_t)grp * 256;
    if constexpr (LINX) {
      const int left = K - grp * 128 - q0 * 8;  // (the same for every copy of this thread)
      const int valid = left >= 8 ? 16 : (left > 0 ? 2 * left : 0);
      const int rows = min(CX, (M - r0 + RSTEP - 1) / RSTEP);  // copies whose row is < M
#pragma unroll
      for (int i = 0; i < CX; ++i)
        if (i < rows)
          cp_async16(sbase + xdst0 + i * RSTEP * 128, valid ? xg + xsrc0 + i * xstep : reinterpret_cast<const unsigned char*>(x), valid);
    } else if (grp * 128 + 128 <= K) {  // a whole group (uniform branch): no per-chunk bounds
#pragma unroll
      for (int i = 0; i < CX; ++i)
        if (tid + i * NTH < NTOK * 16 && xcol[i] >= 0) cp_async16(sbase + xdst[i], xg + xsrc[i], 16);
    } else {
#pragma unroll
      for (int i = 0; i < CX; ++i) {
        if (tid + i * NTH >= NTOK * 16 || xcol[i] < 0) continue;
        const int left = K - grp * 128 - xcol[i];
        const int valid = left >= 8 ? 16 : (left > 0 ? 2 * left : 0);
        cp_async16(sbase + xdst[i], valid ? xg + xsrc[i] : reinterpret_cast<const unsigned char*>(x), valid);
      }
    }
  };
  auto issue_w = [&](int grp, int slot) {
    const u32 sbase = ring + slot * STAGE;
    const unsigned char* wg = reinterpret_cast<const unsigned char*>(wq) + (size_t)grp * 4096;
#pragma unroll
    for (int i = 0; i < CW; ++i)
      if (tid + i * NTH < NWG * 256 && wok[i]) cp_async16(sbase + wdst[i], wg + wsrc[i], 16);
  };
  auto issue = [&](int grp, int slot) {
    issue_x(grp, slot);
    issue_w(grp, slot);
  };
  auto issue_xh = [&](int j, int slot) {
    const int grp = gb0 + (j >> 1), h = j & 1;
    const u32 sbase = ring + slot * STAGE;
    const unsigned char* xg = reinterpret_cast<const unsigned char*>(x) + (size_t)grp * 256 + h * 128;
    const int left = K - grp * 128 - h * 64 - q1 * 8;
    const int valid = left >= 8 ? 16 : (left > 0 ? 2 * left : 0);
    const int rows = min(CXH, (M - r1 + RSTEP1 - 1) / RSTEP1);
#pragma unroll
    for (int i = 0; i < CXH; ++i)
      if (i < rows)
        cp_async16(sbase + hdst0 + i * RSTEP1 * 128, valid ? xg + hsrc0 + i * hstep : reinterpret_cast<const unsigned char*>(x), valid);
  };
  auto issue_wh = [&](int j, int slot) {
    const int grp = gb0 + (j >> 1), h = j & 1;
    if (hwok)
      cp_async16(ring + slot * STAGE + XBYTES + (tid >> 7) * 2048 + hoff * 16,
                 reinterpret_cast<const unsigned char*>(wq) + ((size_t)hslab * G + grp) * 4096 +
                     ((hoff >> 5) * 2 + h) * 512 + (hoff & 31) * 16, 16);
  };

  // t0 / t1 are only ever written by wgmma (the first of a group overwrites): any other
  // write would make the compiler copy them between wgmma and wait (ptxas then serializes)
  // (PS: acc is the wgmmas' own tile, the same rule: the first wgmma overwrites it)
  float acc[NACC], t0[NACC], t1[NACC];
  if constexpr (!PS) {
#pragma unroll
    for (int i = 0; i < NACC; ++i) acc[i] = 0.f;
  }
  u32 a0[8][4], a1[8][4];
  float s00 = 0.f, s01 = 0.f, s10 = 0.f, s11 = 0.f;  // scales of the group in t0 / t1
  const int row0 = n0 + 16 * warp + g;  // this thread's weight rows: row0 and row0 + 8
  const size_t srow = live ? (size_t)row0 : 0;

  // Group gi: wait for its slot, refill the slot of gi + LA - ST (gi - 2, or gi - 1 in the
  // single-tile loop: its wgmmas finished before the barrier, every warpgroup waited for
  // them), unpack the 8 steps into `a` and issue their wgmmas into `tmp` (the double-buffered
  // loop folds gi - 1 meanwhile).
  auto ld_scales = [&](int gi, float& s0, float& s1) {
    s0 = scales[(size_t)(gb0 + gi) * Np + srow];
    s1 = scales[(size_t)(gb0 + gi) * Np + srow + 8];
  };
  // group gi's zero points (loaded before the wait for its slot), then, once the slot has landed
  // for every thread: unpack its 8 steps into `a` and issue their wgmmas into `tmp`
  auto zero_points = [&](int gi, u32& z0, u32& z1) {
    const int grp = gb0 + gi;
    z0 = ASYM ? negz[(size_t)grp * Np + srow] : 0xC308C308u;
    z1 = ASYM ? negz[(size_t)grp * Np + srow + 8] : 0xC308C308u;
  };
  // (unpack_group: the 8 steps into `a`; issue_group: their wgmmas into `tmp`)
  auto unpack_group = [&](int gi, u32 (&a)[8][4], u32 z0, u32 z1) {
    const u32 sbase = ring + (gi % ST) * STAGE;
    u32 w[8];
    lds128(w, sbase + XBYTES + wg * 4096 + ((warp * 2) * 32 + lane) * 16);
    lds128(w + 4, sbase + XBYTES + wg * 4096 + ((warp * 2 + 1) * 32 + lane) * 16);
#pragma unroll
    for (int s = 0; s < 8; ++s) {
      a[s][0] = sub_z(lop_q(w[s]), z0);         // row g,     columns 2t, 2t + 1
      a[s][1] = sub_z(lop_q(w[s] >> 8), z1);    // row g + 8
      a[s][2] = sub_z(lop_q(w[s] >> 4), z0);    // row g,     columns 2t + 8, 2t + 9
      a[s][3] = sub_z(lop_q(w[s] >> 12), z1);   // row g + 8
    }
  };
  auto issue_group = [&](int gi, u32 (&a)[8][4], float (&tmp)[NACC]) {
    wg_fence();
    const unsigned long long d0 = desc_sw128(ring + (gi % ST) * STAGE);  // + (byte offset >> 4): the start address field
#pragma unroll
    for (int s = 0; s < 8; ++s)
      wgmma_bf16<NTOK>(tmp, a[s], d0 + (((s >> 2) * (NTOK * 128) + (s & 3) * 32) >> 4), s > 0);
    wg_commit();
  };
  auto mma_group = [&](int gi, u32 (&a)[8][4], float (&tmp)[NACC], u32 z0, u32 z1) {
    if (gi == 0) W4_TRACE_AT(1);
    unpack_group(gi, a, z0, z1);
    issue_group(gi, a, tmp);
  };
  // PS: half h of group gi (steps 4 h .. 4 h + 3: the thread's 16-byte word of that half) with
  // the weights scaled before the MMA, bf16((u - z) s) as the learner dequantizes them; its 4
  // wgmmas accumulate straight into acc (the very first one overwrites it)
  auto ps_half = [&](int gi, int h, u32 (&a)[4][4], u32 z0, u32 z1, float s0, float s1) {
    // (HS: the half's own slot, its atom at the slot's start)
    const u32 sbase = ring + ((HS ? 2 * gi + h : gi) % ST) * STAGE;
    u32 w[4];
    lds128(w, sbase + XBYTES + (HS ? wg * 2048 + (warp * 32 + lane) * 16 : wg * 4096 + ((warp * 2 + h) * 32 + lane) * 16));
    const u32 b0 = pair_bf16(s0), b1 = pair_bf16(s1);
#pragma unroll
    for (int s = 0; s < 4; ++s) {
      a[s][0] = scale_bf16x2(sub_z(lop_q(w[s]), z0), b0);
      a[s][1] = scale_bf16x2(sub_z(lop_q(w[s] >> 8), z1), b1);
      a[s][2] = scale_bf16x2(sub_z(lop_q(w[s] >> 4), z0), b0);
      a[s][3] = scale_bf16x2(sub_z(lop_q(w[s] >> 12), z1), b1);
    }
    wg_fence();
    const unsigned long long d0 = desc_sw128(sbase);
#pragma unroll
    for (int s = 0; s < 4; ++s)
      wgmma_bf16<NTOK>(acc, a[s], d0 + (((HS ? 0 : h * (NTOK * 128)) + s * 32) >> 4), gi > 0 || h > 0 || s > 0);
    wg_commit();
  };
  // the LoRA term's copies (LR > 0): in the mbarrier loop with the first group's, the term then
  // added before the main loop; else in the prologue's last cp.async batch (or its first without
  // a group, for a block with fewer groups), landing by that group's wait, the term added after
  auto lora_copies = [&]() {
    if constexpr (LR > 0) {
    if (sp == 0 && live) {
      const int mi = (n0 >= lr1) + (n0 >= lr2), coff = mi == 0 ? lc0 : (mi == 1 ? lc1 : lc2);
      const u32 lbase = ring + ST * STAGE + wg * LBYTES;
      const int ltid = tid & 127;
      for (int c = ltid; c < NTOK * LR * 8; c += 128) {  // the t tile: 16-byte chunk q of token row r
        const int r = c / (LR * 8), q = c % (LR * 8), col = coff + q * 8;
        const bool ok = r < M && col < lw;
        cp_async16(lbase + (q >> 3) * (NTOK * 128) + r * 128 + (((q & 7) ^ (r & 7)) << 4),
                   ok ? lt + (size_t)r * ldt + col : lt, ok ? 16 : 0);
      }
      for (int c = ltid; c < 64 * LR * 8; c += 128) {  // the slab's B rows
        const int rr = c / (LR * 8), q = c % (LR * 8), col = coff + q * 8, n = n0 + rr;
        const bool ok = n < N && col < lw;
        cp_async16(lbase + LR * NTOK * 128 + rr * BROW + q * 16, ok ? lb + (size_t)n * ldb + col : lb, ok ? 16 : 0);
      }
    }
    }
  };
  auto stage = [&](int gi, u32 (&a)[8][4], float (&tmp)[NACC]) {
    u32 z0, z1;
    zero_points(gi, z0, z1);
    cp_wait<LA - 1>();
    proxy_fence();  // cp.async wrote through the generic proxy, wgmma reads through the async one
    __syncthreads();
    if (gi + LA < ngroups) issue(gb0 + gi + LA, (gi + LA) % ST);
    cp_commit();
    mma_group(gi, a, tmp, z0, z1);
  };
  // after the wait for its wgmmas: acc += tmp x the group scale of each row; `a` stays
  // live (and unmodified) until here, as wgmma reads registers asynchronously
  auto fold = [&](u32 (&a)[8][4], float (&tmp)[NACC], float s0, float s1) {
#pragma unroll
    for (int i = 0; i < NACC; ++i) keep_f(tmp[i]);
#pragma unroll
    for (int s = 0; s < 8; ++s)
#pragma unroll
      for (int c = 0; c < 4; ++c) keep_r(a[s][c]);
#pragma unroll
    for (int i = 0; i < NACC; ++i) acc[i] += tmp[i] * (((i >> 1) & 1) ? s1 : s0);
  };

  // the prologue: the first groups' weights are no kernel's output, so they are copied before
  // the wait for the kernel ahead (a dependent launch streams them while that one finishes);
  // the activations and the LoRA operands after it. (The first commit group then holds all of
  // these weights: its wait covers them.)
  // TMA: slot s's "full" barrier at full0 + 8 s, "empty" at empty0 + 8 s (the MB loop's)
  __shared__ __align__(8) unsigned long long mbar[2 * ST];
  const u32 full0 = smem_addr(&mbar[0]), empty0 = smem_addr(&mbar[ST]);
  // A TMA copy unit is what a slot holds: a group of this block's K range (unit j: group
  // gb0 + j), or with HS half of one (unit j: half j % 2 of group gb0 + j / 2); the activation
  // boxes start at the block's token tile (PS: blockIdx.y)
  const int live_slabs = max(0, min(NWG, nslabs - cb * NWG));
  const u32 slot_bytes = XBYTES + live_slabs * (HS ? 2048 : 4096);
  const int nunits = HS ? 2 * ngroups : ngroups, trow = PS ? (int)blockIdx.y * NTOK : 0;
  auto tma_w = [&](int j, int slot) {  // (thread 0) the live slabs' words of unit j
    const int grp = gb0 + (HS ? j >> 1 : j);
    const unsigned char* wg = reinterpret_cast<const unsigned char*>(wq) + (size_t)grp * 4096;
    for (int s = 0; s < live_slabs; ++s) {
      const unsigned char* src = wg + (size_t)(cb * NWG + s) * G * 4096;
      if constexpr (HS) {  // each warp's 512 bytes of the half: at (2 w + h) 512 of the group's 4 KB
        for (int w = 0; w < 4; ++w)
          bulk_copy(ring + slot * STAGE + XBYTES + s * 2048 + w * 512, src + (2 * w + (j & 1)) * 512, 512, full0 + 8 * slot);
      } else {
        bulk_copy(ring + slot * STAGE + XBYTES + s * 4096, src, 4096, full0 + 8 * slot);
      }
    }
  };
  auto tma_x = [&](int j, int slot) {  // (thread 0) unit j's 64-column atoms
    if constexpr (HS) {
      tma_tile(ring + slot * STAGE, xmap, (gb0 + (j >> 1)) * 128 + (j & 1) * 64, trow, full0 + 8 * slot);
    } else {
      tma_tile(ring + slot * STAGE, xmap, (gb0 + j) * 128, trow, full0 + 8 * slot);
      tma_tile(ring + slot * STAGE + NTOK * 128, xmap, (gb0 + j) * 128 + 64, trow, full0 + 8 * slot);
    }
  };
  // (thread 0) unit j into its slot, once every warp released unit j - ST there
  auto tma_refill = [&](int j) {
    if (!WSP && tid == 0 && j < nunits) {
      if (j >= ST) mb_wait(empty0 + 8 * (j % ST), (j / ST - 1) & 1);
      mb_expect_tx(full0 + 8 * (j % ST), slot_bytes);
      tma_w(j, j % ST);
      tma_x(j, j % ST);
    }
  };
  auto tma_release = [&](int j) {  // this warp is done with unit j's slot
    __syncwarp();
    if (lane == 0) mb_arrive(empty0 + 8 * (j % ST));
  };
  if constexpr (TMA) {
    if (tid == 0) {
#pragma unroll
      for (int p = 0; p < ST; ++p) {
        mb_init(full0 + 8 * p, 1);
        mb_init(empty0 + 8 * p, NWG * 4);
      }
      asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    if constexpr (WSP) {
      // 384 threads (2 + 1 warpgroups) start with 168 registers each, 512 (3 + 1) with 128: the
      // producer keeps 40 / 24, the computing warpgroups take 232 / 160 (the 256-token tile needs 207)
      constexpr int PREG = NWG == 2 ? 40 : 24, CREG = NWG == 2 ? 232 : 160;
      if (wg == NWG) {
        regs_down<PREG>();
        if (tid == NTH) {
          const int first = min(ST, nunits);
          for (int p = 0; p < first; ++p) {
            mb_expect_tx(full0 + 8 * p, slot_bytes);
            tma_w(p, p);
          }
          wait_ahead();
          for (int p = 0; p < first; ++p) tma_x(p, p);
          for (int j = ST; j < nunits; ++j) {
            const int slot = j % ST;
            mb_wait(empty0 + 8 * slot, (j / ST - 1) & 1);
            mb_expect_tx(full0 + 8 * slot, slot_bytes);
            tma_w(j, slot);
            tma_x(j, slot);
          }
        }
        return;
      }
      regs_up<CREG>();
      wait_ahead();
    } else {
    if (tid == 0) {
#pragma unroll
      for (int p = 0; p < LA; ++p)
        if (p < nunits) {
          mb_expect_tx(full0 + 8 * p, slot_bytes);
          tma_w(p, p);
        }
    }
    wait_ahead();
    if (tid == 0) {
#pragma unroll
      for (int p = 0; p < LA; ++p)
        if (p < nunits) tma_x(p, p);
    }
    }
  } else if constexpr (HS) {  // (in halves)
#pragma unroll
    for (int p = 0; p < LA; ++p)
      if (p < 2 * ngroups) issue_wh(p, p);
    wait_ahead();
#pragma unroll
    for (int p = 0; p < LA; ++p) {
      if (p < 2 * ngroups) issue_xh(p, p);
      cp_commit();
    }
  } else {
#pragma unroll
  for (int p = 0; p < LA; ++p)
    if (p < ngroups) issue_w(gb0 + p, p);
  wait_ahead();
#pragma unroll
  for (int p = 0; p < LA; ++p) {
    if (p < ngroups) issue_x(gb0 + p, p);
    if (p == (MB ? 0 : min(ngroups, LA - 1))) lora_copies();
    cp_commit();
  }
  }
  // the LoRA term (LR > 0), once this warpgroup's copies of it landed: acc += scaling * t B^T
  auto lora_term = [&]() {
    if constexpr (LR > 0) {
      if (sp == 0 && live) {  // (uniform in the warpgroup)
        proxy_fence();
        asm volatile("bar.sync %0, 128;" :: "r"(wg + 1) : "memory");  // the warpgroup's copies landed
        const u32 lbase = ring + ST * STAGE + wg * LBYTES;
        const u32 brow = lbase + LR * NTOK * 128 + (16 * warp + g) * BROW + 4 * t;
#pragma unroll
        for (int s = 0; s < 4 * LR; ++s) {  // rows g / g + 8 of the warp's 16, columns 16 s + 2 t (+ 8)
          asm volatile("ld.shared.u32 %0, [%1];" : "=r"(a0[s][0]) : "r"(brow + 32 * s));
          asm volatile("ld.shared.u32 %0, [%1];" : "=r"(a0[s][1]) : "r"(brow + 8 * BROW + 32 * s));
          asm volatile("ld.shared.u32 %0, [%1];" : "=r"(a0[s][2]) : "r"(brow + 32 * s + 16));
          asm volatile("ld.shared.u32 %0, [%1];" : "=r"(a0[s][3]) : "r"(brow + 8 * BROW + 32 * s + 16));
        }
        wg_fence();
        const unsigned long long d0 = desc_sw128(lbase);
#pragma unroll
        for (int s = 0; s < 4 * LR; ++s)
          wgmma_bf16<NTOK>(t0, a0[s], d0 + (((s >> 2) * (NTOK * 128) + (s & 3) * 32) >> 4), s > 0);
        wg_commit();
        wg_wait0();
        const float ls = __int_as_float(lscale_bits);
        fold(a0, t0, ls, ls);
      }
    }
  };
  if constexpr (LR > 0 && MB) {  // (the warpgroups drift apart: the term first hides its latency, measured)
    cp_wait<LA - 1>();
    lora_term();
  }
  if constexpr (TMA && !PS) {
    // The TMA loop: group gi + 1 is waited for and unpacked into the other set of A registers
    // (a0 / a1 in turn) while group gi's wgmmas run, so a group's path is its wgmmas, the wait
    // and the fold. Thread 0 refills the slot of group gi + LA once every warp released group
    // gi + LA - ST ("empty"). The same products, folded in the same order, as the MB loop.
    auto unpack = [&](int gi, u32 (&a)[8][4]) {
      u32 z0, z1;
      zero_points(gi, z0, z1);
      mb_wait(full0 + 8 * (gi % ST), (gi / ST) & 1);
      unpack_group(gi, a, z0, z1);
    };
    auto step = [&](int gi, u32 (&a)[8][4], u32 (&an)[8][4]) {
      issue_group(gi, a, t0);
      s00 = s10;
      s01 = s11;
      if (gi + 1 < ngroups) ld_scales(gi + 1, s10, s11);
      tma_refill(gi + LA);
      if (gi + 1 < ngroups) unpack(gi + 1, an);
      wg_wait0();
      fold(a, t0, s00, s01);
      tma_release(gi);
    };
    ld_scales(0, s10, s11);
    unpack(0, a0);
    for (int gi = 0; gi < ngroups; gi += 2) {
      step(gi, a0, a1);
      if (gi + 1 < ngroups) step(gi + 1, a1, a0);
    }
  } else if constexpr (MB) {
    // MB: the single-tile loop without a block barrier per group. Slot s has two mbarriers:
    // full[s] completes when every thread's copies of the slot's group landed (each thread
    // arrives one group ahead, after its own cp.async wait and proxy fence), empty[s] when
    // every warp's wgmmas that read it are done; a slot is refilled two groups behind, so
    // the warpgroups drift apart by up to a group and one's unpacking and folding overlap
    // another's wgmmas. Same arithmetic, in the same order, as the barrier loop.
    if (tid == 0) {
#pragma unroll
      for (int p = 0; p < ST; ++p) {
        mb_init(full0 + 8 * p, NTH);
        mb_init(empty0 + 8 * p, NWG * 4);
      }
    }
    proxy_fence();  // the zeroed activation rows, before any wgmma reads them
    __syncthreads();  // ... and the barriers initialized
    cp_wait<LA - 1>();  // this thread's copies of group 0
    proxy_fence();
    mb_arrive(full0);
    ld_scales(0, s10, s11);
    for (int gi = 0; gi < ngroups; ++gi) {
      s00 = s10;
      s01 = s11;
      if (gi + 1 < ngroups) {
        ld_scales(gi + 1, s10, s11);
        cp_wait<LA - 2>();  // this thread's copies of group gi + 1
        proxy_fence();
        mb_arrive(full0 + 8 * ((gi + 1) % ST));
      }
      if (gi + LA < ngroups) {
        const int j = gi + LA;
        if (j >= ST) mb_wait(empty0 + 8 * (j % ST), (j / ST - 1) & 1);  // group j - ST read by every warp
        issue(gb0 + j, j % ST);
      }
      cp_commit();
      u32 z0, z1;
      zero_points(gi, z0, z1);
      mb_wait(full0 + 8 * (gi % ST), (gi / ST) & 1);
      mma_group(gi, a0, t0, z0, z1);
      wg_wait0();
      fold(a0, t0, s00, s01);
      __syncwarp();
      if (lane == 0) mb_arrive(empty0 + 8 * (gi % ST));  // this warp is done with the slot
    }
  } else if constexpr (PS) {
    // pre-scaled: one fp32 tile over all of K, in half groups (4 steps): one half's wgmmas in
    // flight while the next half is dequantized into the other set of A registers (a0: the
    // first halves, a1: the second; 32 registers for both), so the wgmmas stream back to back;
    // a slot is refilled two groups behind (LA = ST - 2), once every warpgroup retired its halves
    u32 (&h0)[4][4] = *reinterpret_cast<u32 (*)[4][4]>(&a0[0][0]);
    u32 (&h1)[4][4] = *reinterpret_cast<u32 (*)[4][4]>(&a1[0][0]);
    // after the wait that retires a half: its A registers stay live (unmodified) until here
    auto keep_a = [&](u32 (&a)[4][4]) {
#pragma unroll
      for (int s = 0; s < 4; ++s)
#pragma unroll
        for (int c = 0; c < 4; ++c) keep_r(a[s][c]);
    };
    float sc0, sc1, sn0 = 0.f, sn1 = 0.f;
    ld_scales(0, sc0, sc1);
    if constexpr (TMA) {
      // the copies by the bulk-copy engine: per unit (a group, or with HS a half) a "full"
      // mbarrier instead of the block barrier, refilled LA units ahead once every warp has
      // retired (released) the unit ST back; the wgmmas and their order as below
      for (int gi = 0; gi < ngroups; ++gi) {
        u32 z0, z1;
        zero_points(gi, z0, z1);
        if (gi + 1 < ngroups) ld_scales(gi + 1, sn0, sn1);
        const int j0 = HS ? 2 * gi : gi;
        tma_refill(j0 + LA);
        mb_wait(full0 + 8 * (j0 % ST), (j0 / ST) & 1);
        if (gi == 0) W4_TRACE_AT(1);
        ps_half(gi, 0, h0, z0, z1, sc0, sc1);
        wg_wait1();  // retires the previous group's second half
        keep_a(h1);
        if (gi > 0) tma_release(HS ? j0 - 1 : gi - 1);
        if constexpr (HS) {
          tma_refill(j0 + 1 + LA);
          mb_wait(full0 + 8 * ((j0 + 1) % ST), ((j0 + 1) / ST) & 1);
        }
        ps_half(gi, 1, h1, z0, z1, sc0, sc1);
        wg_wait1();  // retires this group's first half
        keep_a(h0);
        if constexpr (HS) tma_release(j0);
        sc0 = sn0;
        sc1 = sn1;
      }
    } else {
    // the wait for a slot's copies, the barrier after which every warpgroup retired the half
    // LA + ... slots back, and the refill of that slot (HS: per half, LA halves ahead)
    auto land = [&](int j) {
      cp_wait<LA - 1>();
      proxy_fence();
      __syncthreads();
      if constexpr (HS) {
        if (j + LA < 2 * ngroups) {
          issue_xh(j + LA, (j + LA) % ST);
          issue_wh(j + LA, (j + LA) % ST);
        }
      } else if (j + LA < ngroups) {
        issue(gb0 + j + LA, (j + LA) % ST);
      }
      cp_commit();
    };
    for (int gi = 0; gi < ngroups; ++gi) {
      u32 z0, z1;
      zero_points(gi, z0, z1);
      if (gi + 1 < ngroups) ld_scales(gi + 1, sn0, sn1);
      land(HS ? 2 * gi : gi);
      if (gi == 0) W4_TRACE_AT(1);
      ps_half(gi, 0, h0, z0, z1, sc0, sc1);
      wg_wait1();  // retires the previous group's second half
      keep_a(h1);
      if constexpr (HS) land(2 * gi + 1);
      ps_half(gi, 1, h1, z0, z1, sc0, sc1);
      wg_wait1();  // retires this group's first half
      keep_a(h0);
      sc0 = sn0;
      sc1 = sn1;
    }
    }
    wg_wait0();
    keep_a(h1);
#pragma unroll
    for (int i = 0; i < NACC; ++i) keep_f(acc[i]);  // read only after the last wait
  } else if (SINGLE) {
    // one tile: wait for each group's wgmmas before folding it (about half the registers,
    // so more blocks per SM hide the latency the double-buffered loop hides with ILP); the
    // next group's scales are loaded a group ahead
    ld_scales(0, s10, s11);
    for (int gi = 0; gi < ngroups; ++gi) {
      s00 = s10;
      s01 = s11;
      if (gi + 1 < ngroups) ld_scales(gi + 1, s10, s11);
      stage(gi, a0, t0);
      wg_wait0();
      fold(a0, t0, s00, s01);
    }
  } else {
  // steady state: stage one group, fold the one before (peeled so that every wait retires
  // a known group: ptxas then keeps the wgmmas asynchronous)
  ld_scales(0, s00, s01);
  stage(0, a0, t0);  // (every block has >= 1 group)
  int gi = 1;
  for (; gi + 1 < ngroups; gi += 2) {
    ld_scales(gi, s10, s11);
    stage(gi, a1, t1);
    wg_wait1();
    fold(a0, t0, s00, s01);
    ld_scales(gi + 1, s00, s01);
    stage(gi + 1, a0, t0);
    wg_wait1();
    fold(a1, t1, s10, s11);
  }
  if (gi < ngroups) {
    ld_scales(gi, s10, s11);
    stage(gi, a1, t1);
    wg_wait1();
    fold(a0, t0, s00, s01);
    wg_wait0();
    fold(a1, t1, s10, s11);
  } else {
    wg_wait0();
    fold(a0, t0, s00, s01);
  }
  }
  cp_wait<0>();
  if constexpr (!MB) lora_term();
  W4_TRACE_AT(2);

  // accumulator i: weight row row0 + 8 ((i >> 1) & 1), token 8 (i >> 2) + 2 t + (i & 1)
  if constexpr (CS > 0) {
    // tile [token][column] fp32, rows padded by 4 floats (no bank conflicts on the stores,
    // 16-byte rows for the vector reads), in the ring (all wgmmas and copies are done)
    constexpr int CW = NWG * 64 + 4;
    static_assert(NTOK * CW * 4 <= ST * STAGE, "the reduction tile fits in the ring");
    __syncthreads();
    float* red = reinterpret_cast<float*>(dsmem + (ring - smem_addr(dsmem)));
    if (live) {
#pragma unroll
      for (int i = 0; i < NACC; ++i) {
        const int c = wg * 64 + 16 * warp + g + 8 * ((i >> 1) & 1), r = 8 * (i >> 2) + 2 * t + (i & 1);
        if (r < M) red[r * CW + c] = acc[i];
      }
    }
    W4_TRACE_AT(3);
    cluster_sync();
    const int c0 = cb * NWG * 64, cols = min(NWG * 64, N - c0);
    constexpr int CQ = NWG * 16;  // 4-column items per token row
    if constexpr (GATED) {  // items (row, 4 gate columns), the up columns 8 on
      constexpr int HQ = CQ / 2;
      const int total = M * HQ, per = (total + CS - 1) / CS, i1 = min(total, (sp + 1) * per);
      for (int i = sp * per + tid; i < i1; i += NTH) {
        const int r = i / HQ, q = i % HQ, c = 16 * (q >> 1) + 4 * (q & 1);
        if (c >= cols) continue;
        const u32 addr = ring + (u32)(r * CW + c) * 4;
        float4 pg[CS], pu[CS];
#pragma unroll
        for (int s = 0; s < CS; ++s) {
          pg[s] = ld_cluster_f4(addr, s);
          pu[s] = ld_cluster_f4(addr + 32, s);
        }
        float gv[4] = {0.f, 0.f, 0.f, 0.f}, uv[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int s = 0; s < CS; ++s) {
          gv[0] += pg[s].x; gv[1] += pg[s].y; gv[2] += pg[s].z; gv[3] += pg[s].w;
          uv[0] += pu[s].x; uv[1] += pu[s].y; uv[2] += pu[s].z; uv[3] += pu[s].w;
        }
        u16 h[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) h[e] = silu_mul_bf16(gv[e], uv[e]);
        *reinterpret_cast<uint2*>(out + (size_t)r * ldo + gated_col(c0 + c)) = make_uint2(h[0] | ((u32)h[1] << 16), h[2] | ((u32)h[3] << 16));
      }
    } else {
      const int total = M * CQ, per = (total + CS - 1) / CS, i1 = min(total, (sp + 1) * per);
      for (int i = sp * per + tid; i < i1; i += NTH) {
        const int r = i / CQ, q = i % CQ;
        if (q * 4 >= cols) continue;
        const u32 addr = ring + (u32)(r * CW + q * 4) * 4;
        float4 p[CS];
#pragma unroll
        for (int s = 0; s < CS; ++s) p[s] = ld_cluster_f4(addr, s);
        float v[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int s = 0; s < CS; ++s) {
          v[0] += p[s].x; v[1] += p[s].y; v[2] += p[s].z; v[3] += p[s].w;
        }
        store_out<4>(out, ldo, r, c0 + q * 4, N, v, bias, has_bias);
      }
    }
    cluster_sync();  // the other blocks may still be reading this block's tile
    W4_TRACE_AT(4);
    return;
  }
  if constexpr (CS == 0) {
  if (nsplit == 1) {
    W4_TRACE_AT(3);
    // Staged epilogue (the 192- and 256-token tiles, 16-byte aligned output rows of whole 8-column chunks):
    // once every computing warpgroup is past its last wgmma (named barrier 5; the ring is then
    // free), each warpgroup writes its output tile as bf16 into the ring with stmatrix
    // (transposed: token-major rows of OC columns, 16-byte chunks swizzled by token) and copies
    // it out in 16-byte stores, a warp covering whole rows, instead of one 2-byte store per
    // accumulator. The same roundings (the gated ones: silu_mul_bf16), so the same bits.
    constexpr int OC = GATED ? 32 : 64, OQ = OC / 8;  // output columns (16-byte chunks) a warpgroup
    if constexpr (NTOK >= 192 && NWG * NTOK * OC * 2 <= ST * STAGE) {
      const int ocols = GATED ? N / 2 : N, oc0 = GATED ? n0 / 2 : n0;
      if ((N & (GATED ? 15 : 7)) == 0 && (ldo & 7) == 0 && (reinterpret_cast<size_t>(out) & 15) == 0) {
        asm volatile("bar.sync 5, %0;" :: "n"(NTH) : "memory");
        if (!live) return;
        const u32 tile = ring + wg * (NTOK * OC * 2);
        const int mq = lane >> 3, rq = lane & 7;  // this lane's matrix and row of each stmatrix
        // chunk c of token row r at r * OC * 2 + ((c ^ sw(r)) << 4): conflict-free for 8 rows at one chunk
        auto chunk_at = [&](int r, int c) -> u32 {
          return tile + r * (OC * 2) + ((GATED ? (c ^ ((r >> 1) & 3)) : (c ^ (r & 7))) << 4);
        };
        if constexpr (GATED) {  // one matrix a token block (8 tokens x the warp's 8 gated columns)
#pragma unroll
          for (int j = 0; j < NTOK / 8; j += 4) {
            u32 r[4];
#pragma unroll
            for (int u = 0; u < 4; ++u) {
              const int i = 4 * (j + u);
              r[u] = (u32)silu_mul_bf16(acc[i], acc[i + 2]) | ((u32)silu_mul_bf16(acc[i + 1], acc[i + 3]) << 16);
            }
            stmatrix4_trans(chunk_at(8 * (j + mq) + rq, warp), r[0], r[1], r[2], r[3]);
          }
        } else {  // two matrices a token block: the warp's columns g and g + 8
          float b0 = 0.f, b1 = 0.f;
          if (has_bias) {
            b0 = row0 < N ? from_bf16(bias[row0]) : 0.f;
            b1 = row0 + 8 < N ? from_bf16(bias[row0 + 8]) : 0.f;
          }
#pragma unroll
          for (int j = 0; j < NTOK / 8; j += 2) {
            u32 r[4];
#pragma unroll
            for (int u = 0; u < 2; ++u) {
              const int i = 4 * (j + u);
              r[2 * u] = has_bias ? bf16x2_of(acc[i] + b0, acc[i + 1] + b0) : bf16x2_of(acc[i], acc[i + 1]);
              r[2 * u + 1] = has_bias ? bf16x2_of(acc[i + 2] + b1, acc[i + 3] + b1) : bf16x2_of(acc[i + 2], acc[i + 3]);
            }
            stmatrix4_trans(chunk_at(8 * (j + (mq >> 1)) + rq, 2 * warp + (mq & 1)), r[0], r[1], r[2], r[3]);
          }
        }
        wg_bar<6>(wg);  // this warpgroup's tile is in place
        const int wt = tid & 127;
#pragma unroll 4
        for (int c = wt; c < NTOK * OQ; c += 128) {
          const int r = c / OQ, q = c % OQ, col = oc0 + 8 * q;
          if (r < M && col < ocols) {
            u32 v[4];
            lds128(v, chunk_at(r, q));
            stg128(out + (size_t)r * ldo + col, v);
          }
        }
        W4_TRACE_AT(4);
        return;
      }
    }
    if (!live) return;
    if constexpr (GATED) {  // rows row0 (gate) and row0 + 8 (up): accumulators i and i + 2
#pragma unroll
      for (int i = 0; i < NACC; ++i) {
        if ((i >> 1) & 1) continue;
        const int r = 8 * (i >> 2) + 2 * t + (i & 1);
        if (r < M && row0 < N) out[(size_t)r * ldo + gated_col(row0)] = silu_mul_bf16(acc[i], acc[i + 2]);
      }
    } else {
#pragma unroll
      for (int i = 0; i < NACC; ++i) {
        const int n = row0 + 8 * ((i >> 1) & 1), r = 8 * (i >> 2) + 2 * t + (i & 1);
        if (r >= M || n >= N) continue;
        float v = acc[i];
        if (has_bias) v += from_bf16(bias[n]);
        out[(size_t)r * ldo + n] = to_bf16(v);
      }
    }
    W4_TRACE_AT(4);
    return;
  }
  if (live) {
#pragma unroll
    for (int i = 0; i < NACC; ++i) {
      const int n = row0 + 8 * ((i >> 1) & 1), r = 8 * (i >> 2) + 2 * t + (i & 1);
      if (r < M && n < N) part[((size_t)sp * M + r) * N + n] = acc[i];
    }
  }
  W4_TRACE_AT(3);
  splitk_finish<NTH, NWG * 64, GATED, WSP ? 1 : 0>(part, out, bias, counters, cb, cb * NWG * 64, min(NWG * 64, N - cb * NWG * 64), M, N, ldo, nsplit, has_bias);
  W4_TRACE_AT(4);
  }
}
template <int NWG, int NTOK, int ST, bool ASYM, bool SINGLE, int MINB, bool MB, int LR, bool GATED, int PS>
__global__ void __launch_bounds__(NWG * 128, MINB) w4a16_wgmma(W4_WGMMA_PARAMS) {
  w4a16_wgmma_body<NWG, NTOK, ST, ASYM, SINGLE, 0, MB, LR, GATED, PS>(W4_WGMMA_ARGS);
}
template <int NWG, int NTOK, int ST, bool ASYM, bool SINGLE, int MINB, bool MB, int CS, int LR, bool GATED, int PS>
__global__ void __launch_bounds__(NWG * 128, MINB) __cluster_dims__(CS, 1, 1) w4a16_wgmma_cluster(W4_WGMMA_PARAMS) {
  w4a16_wgmma_body<NWG, NTOK, ST, ASYM, SINGLE, CS, MB, LR, GATED, PS>(W4_WGMMA_ARGS);
}
// the TMA loop (WgConfig.tma): xmap is the activation's tensor map (cuda_w4.x_tensor_map)
// (PS > 0: the pre-scaled loop fed the same way)
template <int NWG, int NTOK, int ST, bool ASYM, int MINB, bool GATED, int PS>
__global__ void __launch_bounds__(NWG * 128, MINB) w4a16_wgmma_tma(W4_WGMMA_PARAMS, const __grid_constant__ TmaMap xmap) {
  w4a16_wgmma_body<NWG, NTOK, ST, ASYM, PS == 0, 0, PS == 0, 0, GATED, PS, true>(W4_WGMMA_ARGS, &xmap);
}
template <int NWG, int NTOK, int ST, bool ASYM, int MINB, int CS, bool GATED, int PS>
__global__ void __launch_bounds__(NWG * 128, MINB) __cluster_dims__(CS, 1, 1) w4a16_wgmma_tma_cluster(
    W4_WGMMA_PARAMS, const __grid_constant__ TmaMap xmap) {
  w4a16_wgmma_body<NWG, NTOK, ST, ASYM, PS == 0, CS, PS == 0, 0, GATED, PS, true>(W4_WGMMA_ARGS, &xmap);
}
// the pre-scaled TMA loop with a producer warpgroup (WgConfig.producer): NWG + 1 warpgroups
template <int NWG, int NTOK, int ST, bool ASYM, bool GATED, int PS>
__global__ void __launch_bounds__((NWG + 1) * 128, 1) w4a16_wgmma_tma_ws(W4_WGMMA_PARAMS, const __grid_constant__ TmaMap xmap) {
  w4a16_wgmma_body<NWG, NTOK, ST, ASYM, false, 0, false, 0, GATED, PS, true, true>(W4_WGMMA_ARGS, &xmap);
}
