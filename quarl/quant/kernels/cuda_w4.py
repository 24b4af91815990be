"""W4A16 (int4, groups of 128, fp32 scales) GEMM for decode-sized M, as a CUDA kernel.

Why CUDA and not Triton: at M <= 16 the GEMM only has to stream the packed weight, but
the Triton kernels plateau at ~1.5 TB/s of the H200's 4.1 (bench/NOTES.md, runs 4-8):
each 64x128 chunk goes global -> shared -> registers and is unpacked in a layout Triton
picks. Here the weight is repacked once, offline, into the order in which the
``mma.sync.m16n8k16`` B fragments sit in registers, so each thread loads its fragments
with one 16-byte load straight from global memory into a register ring 8 steps deep, and
unpacks 8 codes with 3 shifts, 4 ``lop3`` and 4 ``fma.bf16x2`` (no shared memory, no
shuffles). The source is compiled at first use with NVRTC (``torch.cuda._compile_kernel``),
so nothing is built at install time.

Numerics are those of the Triton small-M kernel: ``(u - z)`` is exact in bf16, each
group's products are summed by the tensor cores in fp32 and scaled by the fp32 group
scale, ``acc += s_g * sum_k x_k (u_k - z)``; the split-K partial sums are added in split
order by the last-arriving block (deterministic).

Repacked ("fragment") layout, built by :func:`repack_w4` from the canonical packed
weight (:mod:`quarl.quant.reference`). N is padded to a multiple of 64 (a "slab"), Kp to
128. For slab ``s`` and 16-column step ``kk`` there are 512 bytes; lane ``L`` (``g = L //
4``, ``t = L % 4``) owns bytes ``16 L .. 16 L + 15``, four little-endian 32-bit words
``w_i``. Word ``i`` feeds the 8-column tiles ``j = 2 i + h`` (h = 0, 1); its nibble
``p`` (bits ``4p .. 4p+3``) is the code of weight ``W[64 s + 8 j + g, 16 kk + k]`` with
``h = (p >> 1) & 1`` and ``k = 2 t + (p >= 4) + 8 (p & 1)``. A 16-bit mask of ``w >> 4q``
then yields the bf16x2 register of fragment half ``q & 1`` of tile ``2 i + (q >> 1)``.
Scales are stored transposed, ``[Kp / 128, Np]`` fp32; asymmetric zero points as the bf16x2
bit pattern of ``-(128 + z)``, ``[Kp / 128, Np]`` uint32.

Two kernels read that layout. ``w4a16_frag`` (M <= 16): every warp streams its own slab
and K range through a private cp.async ring, activation tile included. ``w4a16_tile``
(M <= 64): a block owns SW adjacent slabs and a K range; one ring slot holds a whole group
(the slabs' fragments, the activation tile of all M rows, the group's scales and zero
points) and is shared by the block's warps, each of which computes MT m16 x NT n8 output
tiles over the whole range (no reduction inside the block). Same numerics and the same
split-K rule (partials summed in split order by the last block) in both.

On Hopper, ``w4a16_wgmma`` (M <= 64) feeds the dequantized weights to wgmma as its register
A operand; its ``w4a16_wgmma_cluster`` entry runs the K splits of a column block as one
thread-block cluster and sums them through distributed shared memory, in the same order.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from quarl.quant import reference as ref
from quarl.quant.qweight import QuantizedWeight
from quarl.quant.scheme import PACK_K

SLAB = 64  # output columns per warp (fragment kernel) / per slab
MAX_M = 16  # rows the fragment kernel takes (one m16 tile)
TILE_MAX_M = 64  # rows the block-tiled kernel takes (MT x WM m16 tiles)

_SOURCE = r"""
typedef unsigned int u32;
typedef unsigned short u16;

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

// grid (Np / 64, split), block NW warps. Block (s, sp) owns the 64 output columns of slab s
// and groups [sp * gpb, (sp + 1) * gpb); its warps take contiguous shares of those groups
// and are summed in shared memory at the end.
// Each warp streams its steps (16 columns of K) through its own ring of ST slots in shared
// memory with cp.async (no register ring: a deep register prefetch runs out of the SM's
// load scoreboards and of registers, measured 2x slower). Slot layout, 1 KB: the weight
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
template <int NTH, int CMAX>
__device__ __forceinline__ void splitk_finish(
    const float* part, u16* out, const u16* bias, int* counters, int cb, int c0, int cols,
    int M, int N, int ldo, int split, int has_bias) {
  __shared__ int last_flag;
  const int tid = threadIdx.x;
  __syncthreads();  // every thread's partial stores ...
  if (tid == 0) {
    __threadfence();  // ... made visible at GPU scope before the arrival
    const int last = atomicAdd(counters + cb, 1) == split - 1;
    if (last) __threadfence();  // the other blocks' partials seen before this block reads them
    last_flag = last;
  }
  __syncthreads();
  if (!last_flag) return;
  if ((N & 3) == 0 && (ldo & 3) == 0)  // 16-byte partial loads, 8-byte output stores
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
// W4A16 for 8 < M <= 64 on Hopper: the dequantized weight is the register A operand of
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
// one group behind.
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
//WGMMA_WRAPPERS//
// Timing probes, compiled only with -DW4_TRACE (bench/w4_trace.py): thread 0 of each block
// stores %globaltimer and %clock64 at point i (0 entry, 1 first group landed, 2 main loop done,
// 3 partials stored, 4 split-K finish done) and its SM in trace[block * 12 + ...].
#ifdef W4_TRACE
__device__ __forceinline__ void w4_trace_at(unsigned long long* tr, int i) {
  unsigned long long gt, ck;
  u32 sm;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(gt));
  asm volatile("mov.u64 %0, %%clock64;" : "=l"(ck));
  asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
  tr += (size_t)blockIdx.x * 12;
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
      int ldo, int Np, int G, int gpb, int split, int has_bias, int whole W4_TRACE_PARAM
#define W4_WGMMA_ARGS \
  x, wq, scales, negz, bias, out, part, counters, M, N, K, ldx, ldo, Np, G, gpb, split, has_bias, whole W4_TRACE_ARG

template <int NWG, int NTOK, int ST, bool ASYM, bool SINGLE, int CS>
__device__ __forceinline__ void w4a16_wgmma_body(W4_WGMMA_PARAMS) {
  constexpr int NTH = NWG * 128, NACC = NTOK / 2;
  W4_TRACE_AT(0);
  // groups in flight: a slot is refilled once the wgmmas that read it are done, one group
  // behind in the single-tile loop (waited for before its fold), two in the double-buffered one
  constexpr int LA = SINGLE ? ST - 1 : ST - 2;
  constexpr int XBYTES = NTOK * 256, STAGE = XBYTES + NWG * 4096;  // both multiples of 1024
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
  u32 xsrc[CX], xdst[CX];
  int xcol[CX];  // first column in group 0; -1: zero-fill only (row >= M) or no chunk
#pragma unroll
  for (int i = 0; i < CX; ++i) {
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
  zero_skipped_chunks<CX, NTH, ST>(ring, STAGE, tid, NTOK * 16, xdst, xcol);
  auto issue = [&](int grp, int slot) {
    const u32 sbase = ring + slot * STAGE;
    const unsigned char* xg = reinterpret_cast<const unsigned char*>(x) + (size_t)grp * 256;
    const unsigned char* wg = reinterpret_cast<const unsigned char*>(wq) + (size_t)grp * 4096;
    if (grp * 128 + 128 <= K) {  // a whole group (uniform branch): no per-chunk bounds
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
#pragma unroll
    for (int i = 0; i < CW; ++i)
      if (tid + i * NTH < NWG * 256 && wok[i]) cp_async16(sbase + wdst[i], wg + wsrc[i], 16);
  };

  // t0 / t1 are only ever written by wgmma (the first of a group overwrites): any other
  // write would make the compiler copy them between wgmma and wait (ptxas then serializes)
  float acc[NACC], t0[NACC], t1[NACC];
#pragma unroll
  for (int i = 0; i < NACC; ++i) acc[i] = 0.f;
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
  auto stage = [&](int gi, u32 (&a)[8][4], float (&tmp)[NACC]) {
    const int grp = gb0 + gi;
    const u32 z0 = ASYM ? negz[(size_t)grp * Np + srow] : 0xC308C308u;
    const u32 z1 = ASYM ? negz[(size_t)grp * Np + srow + 8] : 0xC308C308u;
    cp_wait<LA - 1>();
    proxy_fence();  // cp.async wrote through the generic proxy, wgmma reads through the async one
    __syncthreads();
    if (gi == 0) W4_TRACE_AT(1);
    if (gi + LA < ngroups) issue(gb0 + gi + LA, (gi + LA) % ST);
    cp_commit();
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
    wg_fence();
    const unsigned long long d0 = desc_sw128(sbase);  // + (byte offset >> 4): the start address field
#pragma unroll
    for (int s = 0; s < 8; ++s)
      wgmma_bf16<NTOK>(tmp, a[s], d0 + (((s >> 2) * (NTOK * 128) + (s & 3) * 32) >> 4), s > 0);
    wg_commit();
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

#pragma unroll
  for (int p = 0; p < LA; ++p) {
    if (p < ngroups) issue(gb0 + p, p);
    cp_commit();
  }
  if (SINGLE) {
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
    cluster_sync();  // the other blocks may still be reading this block's tile
    W4_TRACE_AT(4);
    return;
  }
  if constexpr (CS == 0) {
  if (nsplit == 1) {
    W4_TRACE_AT(3);
    if (!live) return;
#pragma unroll
    for (int i = 0; i < NACC; ++i) {
      const int n = row0 + 8 * ((i >> 1) & 1), r = 8 * (i >> 2) + 2 * t + (i & 1);
      if (r >= M || n >= N) continue;
      float v = acc[i];
      if (has_bias) v += from_bf16(bias[n]);
      out[(size_t)r * ldo + n] = to_bf16(v);
    }
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
  splitk_finish<NTH, NWG * 64>(part, out, bias, counters, cb, cb * NWG * 64, min(NWG * 64, N - cb * NWG * 64), M, N, ldo, nsplit, has_bias);
  W4_TRACE_AT(4);
  }
}
template <int NWG, int NTOK, int ST, bool ASYM, bool SINGLE, int MINB>
__global__ void __launch_bounds__(NWG * 128, MINB) w4a16_wgmma(W4_WGMMA_PARAMS) {
  w4a16_wgmma_body<NWG, NTOK, ST, ASYM, SINGLE, 0>(W4_WGMMA_ARGS);
}
template <int NWG, int NTOK, int ST, bool ASYM, bool SINGLE, int MINB, int CS>
__global__ void __launch_bounds__(NWG * 128, MINB) __cluster_dims__(CS, 1, 1) w4a16_wgmma_cluster(W4_WGMMA_PARAMS) {
  w4a16_wgmma_body<NWG, NTOK, ST, ASYM, SINGLE, CS>(W4_WGMMA_ARGS);
}
"""


class FragWeight(NamedTuple):
    """The fragment-ordered copy of a w4 g128 weight (see the module docstring)."""

    qdata: torch.Tensor  # 32-bit words (int32 storage) [Np / 64, Kp / 16, 32, 4]
    scales: torch.Tensor  # fp32 [Kp / 128, Np]
    negz: torch.Tensor | None  # 32-bit patterns (int32 storage) [Kp / 128, Np], asymmetric only


def _lane_maps(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(n, k) offsets ``[32 lanes, 4 words, 8 nibbles]`` inside a 64 x 16 (slab x step) tile."""
    lane = torch.arange(32).view(32, 1, 1)
    i = torch.arange(4).view(1, 4, 1)
    p = torch.arange(8).view(1, 1, 8)
    g, t = lane // 4, lane % 4
    j = 2 * i + ((p >> 1) & 1)
    n = 8 * j + g
    k = 2 * t + (p >= 4).long() + 8 * (p & 1)
    return n.expand(32, 4, 8).to(device), k.expand(32, 4, 8).to(device)


def repack_codes(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes ``[N, Kp]`` (< 16, Kp % 128 == 0) -> fragment words ``[Np/64, Kp/16, 32, 4]``
    (32-bit patterns stored as int32)."""
    n, kp = codes.shape
    np_ = -(-n // SLAB) * SLAB
    c = torch.zeros(np_, kp, dtype=torch.int32, device=codes.device)
    c[:n] = codes.to(torch.int32)
    tiles = c.view(np_ // SLAB, SLAB, kp // 16, 16).permute(0, 2, 1, 3)  # [S, KS, 64, 16]
    nmap, kmap = _lane_maps(codes.device)
    nib = tiles[:, :, nmap, kmap]  # [S, KS, 32, 4, 8]
    shifts = 4 * torch.arange(8, device=codes.device, dtype=torch.int64)
    words = (nib.to(torch.int64) << shifts).sum(dim=-1)  # disjoint bits: sum == or
    return _as_u32(words)


def unpack_frag_codes(frag: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of :func:`repack_codes` (tests): fragment words -> uint8 codes ``[N, Kp]``."""
    s, ks = frag.shape[0], frag.shape[1]
    words = frag.to(torch.int64) & 0xFFFFFFFF
    shifts = 4 * torch.arange(8, device=frag.device).view(1, 1, 1, 1, 8)
    nib = (words.unsqueeze(-1) >> shifts) & 0xF  # [S, KS, 32, 4, 8]
    nmap, kmap = _lane_maps(frag.device)
    tiles = torch.zeros(s, ks, SLAB, 16, dtype=torch.int64, device=frag.device)
    tiles[:, :, nmap, kmap] = nib
    return tiles.permute(0, 2, 1, 3).reshape(s * SLAB, ks * 16)[:n].to(torch.uint8)


def wgmma_words(frag: torch.Tensor) -> torch.Tensor:
    """Fragment words ``[S, KS, 32 lanes, 4]`` -> the wgmma kernel's order ``[S, KS / 8, 4
    warps, 2 halves, 32 lanes, 4]``: the same words, those warp ``w`` of a warpgroup unpacks
    (word ``w`` of each lane: rows ``16 w + g`` and ``16 w + 8 + g`` of the slab, the wgmma A
    fragment of that warp) brought together, four steps (``4 h .. 4 h + 3``) per 16 bytes."""
    s, ks = frag.shape[:2]
    return frag.reshape(s, ks // 8, 2, 4, 32, 4).permute(0, 1, 5, 2, 4, 3).contiguous()


def unwgmma_words(words: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`wgmma_words`."""
    s, groups = words.shape[:2]
    return words.permute(0, 1, 3, 5, 4, 2).reshape(s, groups * 8, 32, 4).contiguous()


LAYOUTS = ("frag", "wgmma")


def repack_w4(qw: QuantizedWeight, layout: str = "frag") -> FragWeight:
    """The ``layout`` ("frag" or "wgmma", see :func:`wgmma_words`) copy of an int4 g128
    ``QuantizedWeight`` (pure torch, any device)."""
    if not (qw.scheme.weight_format == "int" and qw.scheme.weight_bits == 4 and qw.scheme.group_size == PACK_K):
        raise ValueError(f"fragment layout needs int4 weights with group 128, got {qw.scheme.name}")
    if layout not in LAYOUTS:
        raise ValueError(f"unknown w4 layout {layout!r}; one of {LAYOUTS}")
    n = qw.shape[0]
    np_ = -(-n // SLAB) * SLAB
    codes = ref.unpack_4bit(qw.qdata)
    frag = repack_codes(codes)
    if layout == "wgmma":
        frag = wgmma_words(frag)
    scales = torch.zeros(qw.scales.shape[1], np_, dtype=torch.float32, device=qw.device)
    scales[:, :n] = qw.scales.t()
    negz = None
    if qw.zeros is not None:
        bits = (0xC300 | qw.zeros.to(torch.int64)) * 0x10001  # bf16x2 of -(128 + z), both halves
        nz = torch.full((qw.zeros.shape[1], np_), 0xC308C308, dtype=torch.int64, device=qw.device)
        nz[:, :n] = bits.t()
        negz = _as_u32(nz)
    return FragWeight(frag, scales, negz)


def _as_u32(v: torch.Tensor) -> torch.Tensor:
    """int64 values in [0, 2^32) -> the same bits as a 32-bit tensor (int32 storage)."""
    return torch.where(v >= 2**31, v - 2**32, v).to(torch.int32)


# ----------------------------------------------------------------------------- cache
def _version_key(qw: QuantizedWeight) -> tuple:
    return (qw.qdata._version, qw.scales._version, None if qw.zeros is None else qw.zeros._version)


def frag_weight(qw: QuantizedWeight, layout: str = "frag") -> FragWeight:
    """The ``layout`` copy of ``qw``, cached on its ``qdata`` tensor and rebuilt in place
    (same storage, so captured CUDA graphs see new weights) when ``qdata`` changed."""
    attr = f"_quarl_{layout}"
    key = _version_key(qw)
    cached = getattr(qw.qdata, attr, None)
    if cached is not None and cached[0] == key:
        return cached[1]
    if qw.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            f"the w4 {layout} layout is first needed (or stale) inside CUDA-graph capture; "
            "run the same forward eagerly once before capturing"
        )
    # normal tensors even when first built under inference_mode (the engine generates in
    # it), so that later in-place loads outside it can refresh them
    with torch.inference_mode(False), torch.no_grad():
        fresh = repack_w4(qw, layout)
        if cached is not None:
            old = cached[1]
            for a, b in zip(old, fresh):
                if a is not None:
                    a.copy_(b)
            fresh = old
    setattr(qw.qdata, attr, (key, fresh))
    return fresh


def is_fresh(qw: QuantizedWeight) -> bool:
    """No repacked copy cached on ``qw``, or only ones that match its current contents."""
    key = _version_key(qw)
    return all(getattr(qw.qdata, f"_quarl_{lay}", (key,))[0] == key for lay in LAYOUTS)


def refresh(qw: QuantizedWeight, rows: tuple[int, int] | None = None) -> None:
    """Rebuild ``qw``'s repacked copies now, those that exist (called after in-place loads).

    With ``rows = (start, stop)`` only the 64-row slabs covering those output rows are
    repacked (a fused q/k/v weight loading one of its parts); the caller guarantees the
    rest of each copy was fresh before the write."""
    for layout in LAYOUTS:
        attr = f"_quarl_{layout}"
        cached = getattr(qw.qdata, attr, None)
        if cached is None:
            continue
        if rows is None:
            frag_weight(qw, layout)
            continue
        s0, s1 = rows[0] // SLAB, -(-rows[1] // SLAB)
        a, b = s0 * SLAB, min(s1 * SLAB, qw.shape[0])
        sub = QuantizedWeight(qw.scheme, (b - a, qw.shape[1]), **{f: t[a:b] for f, t in qw.tensors().items()})
        fw = cached[1]
        with torch.inference_mode(False), torch.no_grad():
            part = repack_w4(sub, layout)
            fw.qdata[s0:s1].copy_(part.qdata)
            fw.scales[:, a:b].copy_(part.scales[:, : b - a])
            if fw.negz is not None:
                fw.negz[:, a:b].copy_(part.negz[:, : b - a])
        setattr(qw.qdata, attr, (_version_key(qw), fw))


# ----------------------------------------------------------------------------- launch
@functools.lru_cache(maxsize=1)
def available() -> bool:
    """NVRTC compilation through torch is there and the GPU has mma.sync bf16 (sm80+)."""
    if not torch.cuda.is_available() or not hasattr(torch.cuda, "_compile_kernel"):
        return False
    return torch.cuda.get_device_capability()[0] >= 8


@functools.lru_cache(maxsize=32)
def _kernel(nw: int, asym: bool, stages: int):
    name = f"w4a16_frag<{nw}, {'true' if asym else 'false'}, {stages}>"
    return torch.cuda._compile_kernel(_SOURCE, name, nvcc_options=["-std=c++17"])


class FragConfig(NamedTuple):
    nw: int = 4  # warps per block (they split the block's groups)
    blocks_per_sm: float = 4.0  # split K until about this many blocks per SM
    stages: int = 4  # cp.async ring slots per warp (2, 4 or 8; nw x stages <= 32: static smem)


def pick_split(n: int, groups: int, nw: int, sms: int, blocks_per_sm: float, slabs_per_block: int = 1) -> tuple[int, int]:
    """(split, groups per block): split K until the grid (``ceil(slabs / slabs_per_block)``
    column blocks x split) has ~blocks_per_sm x SMs blocks, keeping at least ``nw`` groups
    per block (the fragment kernel's warps split a block's groups; pass 1 for the tile kernel)."""
    cols = -(-(-(-n // SLAB)) // slabs_per_block)
    split = max(1, min(-(-int(blocks_per_sm * sms) // cols), -(-groups // nw)))
    gpb = -(-groups // split)
    return -(-groups // gpb), gpb


def w4a16_frag_gemm(
    x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None, cfg: FragConfig = FragConfig(),
    counters=None,
) -> torch.Tensor:
    """``x [M, K] (bf16, M <= 16) @ W.T + bias`` with the fragment kernel. ``counters``:
    ``device, n -> zeroed int32 buffer`` for the split-K arrivals (launch's by default)."""
    from quarl.quant.kernels import launch  # (imports this module)

    counters = counters or launch._counters
    m, k = x.shape
    n = qw.shape[0]
    if m > MAX_M or x.dtype != torch.bfloat16:
        raise ValueError(f"fragment kernel takes bf16 x with M <= {MAX_M}, got {x.dtype} M={m}")
    if k % 8 or x.stride(0) % 8 or x.data_ptr() % 16 or x.stride(1) != 1:  # 16-byte row copies
        x = torch.nn.functional.pad(x, (0, -k % 8)).contiguous()
    if bias is not None and bias.dtype != torch.bfloat16:
        bias = bias.to(torch.bfloat16)
    if cfg.stages not in (2, 4, 8) or cfg.nw not in (1, 2, 4, 8) or cfg.nw * cfg.stages > 32:
        raise ValueError(f"fragment kernel: nw in 1/2/4/8, stages in 2/4/8 and nw x stages <= 32 (48 KB of static shared memory); got {cfg}")
    fw = frag_weight(qw)
    groups = fw.scales.shape[0]
    np_ = fw.scales.shape[1]
    sms = launch.num_sms(x.device)
    split, gpb = pick_split(n, groups, cfg.nw, sms, cfg.blocks_per_sm)
    out = torch.empty(m, n, dtype=torch.bfloat16, device=x.device)
    slabs = np_ // SLAB
    if split > 1:
        part = torch.empty(split, m, n, dtype=torch.float32, device=x.device)
        cnt = counters(x.device, slabs)
    else:
        part = cnt = out
    kern = _kernel(cfg.nw, fw.negz is not None, cfg.stages)
    kern(
        grid=(slabs, split, 1), block=(cfg.nw * 32, 1, 1),
        args=[
            x, fw.qdata, fw.scales, fw.negz if fw.negz is not None else fw.scales,
            bias if bias is not None else out, out, part, cnt,
            m, n, k, x.stride(0), out.stride(0), np_, groups, gpb, split, int(bias is not None),
        ],
    )
    return out


class TileKConfig(NamedTuple):
    """Block shape of the block-tiled kernel (``w4a16_tile``): SW slabs x (8 / NT) warps
    along N, WM warps along M, each warp MT m16 tiles x NT n8 tiles; ST ring slots (one
    group each) in dynamic shared memory."""

    sw: int = 4
    nt: int = 4
    mt: int = 4
    wm: int = 1
    stages: int = 3
    blocks_per_sm: float = 2.0  # split K until about this many blocks per SM

    @property
    def warps(self) -> int:
        return self.sw * (8 // self.nt) * self.wm

    @property
    def rows(self) -> int:
        return 16 * self.mt * self.wm

    def smem_bytes(self) -> int:
        return self.stages * (4096 * (self.sw + self.mt * self.wm) + 512 * self.sw)  # (+ zero points)


def tile_config_for(m: int) -> TileKConfig:
    """Default block shape for ``m`` rows (H200 sweeps, bench/results/w4_tile_sweep_h200.json:
    4 slabs x 2 warps of 4 n8 tiles per block, 4 slots, K split to ~2 blocks per SM at
    M <= 16; the M <= 64 shapes are the sweep's best, still slower than the Triton swapb
    kernel there, see bench/NOTES.md run 11)."""
    if m <= 16:
        return TileKConfig(sw=4, nt=4, mt=1, wm=1, stages=4, blocks_per_sm=2.0)
    if m <= 32:
        return TileKConfig(sw=4, nt=4, mt=2, wm=1, stages=4, blocks_per_sm=1.0)
    return TileKConfig(sw=2, nt=4, mt=2, wm=2, stages=6, blocks_per_sm=2.0)


@functools.lru_cache(maxsize=64)
def _tile_kernel(cfg: TileKConfig, asym: bool):
    name = f"w4a16_tile<{cfg.sw}, {cfg.nt}, {cfg.mt}, {cfg.wm}, {cfg.stages}, {'true' if asym else 'false'}>"
    kern = torch.cuda._compile_kernel(_SOURCE, name, nvcc_options=["-std=c++17"])
    kern.set_shared_memory_config(cfg.smem_bytes())
    return kern


def check_tile_config(cfg: TileKConfig, m: int) -> None:
    if cfg.nt not in (2, 4, 8) or cfg.stages < 2 or cfg.warps * 32 > 1024 or cfg.sw < 1 or cfg.mt < 1 or cfg.wm < 1:
        raise ValueError(f"block-tiled w4 kernel: NT in 2/4/8, >= 2 stages, <= 32 warps; got {cfg}")
    if m > cfg.rows:
        raise ValueError(f"block-tiled w4 kernel: {cfg} covers {cfg.rows} rows, got M={m}")
    if cfg.smem_bytes() > 227 * 1024:
        raise ValueError(f"block-tiled w4 kernel: {cfg} needs {cfg.smem_bytes()} bytes of shared memory (> 227 KB)")


def tail_split(cols: int, groups: int, slots: int) -> tuple[int, int, int]:
    """``(whole, split, groups per split)``: the column blocks of the full waves of ``slots``
    blocks run whole (all of K), the ``r`` of the last, partial wave are split along K to
    about fill it (``slots // r`` ways, >= 2 groups each); ``whole = cols``: no split."""
    whole = cols // slots * slots
    rest = cols - whole
    split = min(slots // rest, groups // 2) if rest else 1
    if split <= 1:
        return cols, 1, groups
    gpb = -(-groups // split)
    return whole, -(-groups // gpb), gpb


MAX_CLUSTER = 8  # portable thread-block cluster size: the most K splits one cluster sums


def cluster_split(groups: int, split: int) -> tuple[int, int]:
    """``(split, groups per split)`` with at most :data:`MAX_CLUSTER` splits, none empty."""
    gpb = -(-groups // min(split, MAX_CLUSTER))
    return -(-groups // gpb), gpb


def split_plan(n: int, groups: int, cols: int, sms: int, blocks_per_sm: float, slabs_per_block: int,
               tail: bool | None, cluster: bool) -> tuple[int, int, int, int]:
    """``(whole, split, groups per split, cluster size)`` of :func:`_launch_blocked`'s grid:
    ``whole`` column blocks over all of K, the other ``cols - whole`` split ``split`` ways;
    cluster size 0 = the splits are summed through global partials."""
    if tail:
        whole, split, gpb = tail_split(cols, groups, max(1, round(blocks_per_sm * sms)))
    else:
        split, gpb = pick_split(n, groups, 1, sms, blocks_per_sm, slabs_per_block)
        whole = 0 if split > 1 else cols
    if not (cluster and split > 1 and whole == 0):
        return whole, split, gpb, 0
    split, gpb = cluster_split(groups, split)
    return (0, split, gpb, split) if split > 1 else (cols, 1, groups, 0)


def _launch_blocked(make_kernel, x, qw, bias, layout: str, slabs_per_block: int, blocks_per_sm: float,
                    threads: int, smem: int, counters, tail: bool | None = None, cluster: bool = False) -> torch.Tensor:
    """Launch a kernel whose blocks own ``slabs_per_block`` slabs and a K range (the tile and
    wgmma kernels: same arguments, same split-K rule). ``make_kernel(asym, cs)`` -> the
    kernel (``cs``: cluster size, 0 = none). ``tail`` (wgmma kernel: a 1-D grid and a
    ``whole`` argument): None = every column block's K split alike (``pick_split``); True =
    :func:`tail_split` over ``blocks_per_sm x SMs`` slots; False = the uniform split as a 1-D
    grid. ``cluster`` (wgmma kernel): when every column block is split, its splits (at most
    :data:`MAX_CLUSTER`) form one cluster and are summed through distributed shared memory."""
    from quarl.quant.kernels import launch  # (imports this module)

    m, k = x.shape
    n = qw.shape[0]
    if k % 8 or x.stride(0) % 8 or x.data_ptr() % 16 or x.stride(1) != 1:  # 16-byte row copies
        x = torch.nn.functional.pad(x, (0, -k % 8)).contiguous()
    if bias is not None and bias.dtype != torch.bfloat16:
        bias = bias.to(torch.bfloat16)
    fw = frag_weight(qw, layout)
    groups, np_ = fw.scales.shape
    cols = -(-(np_ // SLAB) // slabs_per_block)
    whole, split, gpb, cs = split_plan(n, groups, cols, launch.num_sms(x.device), blocks_per_sm, slabs_per_block, tail, cluster)
    out = torch.empty(m, n, dtype=torch.bfloat16, device=x.device)
    if split > 1 and not cs:
        part = torch.empty(split, m, n, dtype=torch.float32, device=x.device)
        cnt = (counters or launch._counters)(x.device, cols)
    else:
        part = cnt = out
    args = [
        x, fw.qdata, fw.scales, fw.negz if fw.negz is not None else fw.scales,
        bias if bias is not None else out, out, part, cnt,
        m, n, k, x.stride(0), out.stride(0), np_, groups, gpb, split, int(bias is not None),
    ]
    if tail is None:
        grid = (cols, split, 1)
    else:
        grid = (whole + (cols - whole) * split, 1, 1)
        args.append(whole)
    make_kernel(fw.negz is not None, cs)(grid=grid, block=(threads, 1, 1), shared_mem=smem, args=args)
    return out


def w4a16_tile_gemm(
    x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None, cfg: TileKConfig | None = None,
    counters=None,
) -> torch.Tensor:
    """``x [M, K] (bf16, M <= 64) @ W.T + bias`` with the block-tiled kernel: same fragment
    layout and numerics as :func:`w4a16_frag_gemm` (per-group fp32 post-scale, split-K
    partials summed in split order), the activation tile shared by the block's warps."""
    m = x.shape[0]
    cfg = cfg or tile_config_for(m)
    if x.dtype != torch.bfloat16:
        raise ValueError(f"block-tiled w4 kernel takes bf16 x, got {x.dtype}")
    check_tile_config(cfg, m)
    return _launch_blocked(
        lambda asym, cs: _tile_kernel(cfg._replace(blocks_per_sm=0.0), asym), x, qw, bias, "frag",
        cfg.sw, cfg.blocks_per_sm, cfg.warps * 32, cfg.smem_bytes(), counters,
    )


# ----------------------------------------------------------------------------- wgmma (sm90a)
WGMMA_TOKENS = (8, 16, 32, 64)  # wgmma N sides compiled: M is padded up to the next one


def _wgmma_wrappers() -> str:
    """``wgmma_bf16<N>``: one ``wgmma.mma_async.m64nNk16`` (bf16, fp32 accumulation, A from
    registers, B through a shared-memory descriptor; ``acc == 0`` overwrites D)."""
    out = ["template <int N_> __device__ __forceinline__ void wgmma_bf16(float* d, const u32* a, unsigned long long desc, int acc);"]
    for n in WGMMA_TOKENS:
        nd = n // 2
        dregs = ", ".join(f"%{i}" for i in range(nd))
        aregs = ", ".join(f"%{nd + i}" for i in range(4))
        outs = ", ".join(f'"+f"(d[{i}])' for i in range(nd))
        out.append(
            f"template <> __device__ __forceinline__ void wgmma_bf16<{n}>(float* d, const u32* a, unsigned long long desc, int acc) {{\n"
            f'  asm volatile("{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{nd + 5}, 0;\\n"\n'
            f'    "wgmma.mma_async.sync.aligned.m64n{n}k16.f32.bf16.bf16 {{{dregs}}}, {{{aregs}}}, %{nd + 4}, p, 1, 1, 0;\\n}}\\n"\n'
            f"    : {outs}\n"
            f'    : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(acc));\n}}'
        )
    return "\n".join(out)


class WgConfig(NamedTuple):
    """Block shape of the wgmma kernel (``w4a16_wgmma``): NWG warpgroups (one 64-row slab
    each) sharing the activation tile; ``stages`` ring slots of one group each."""

    nwg: int = 2
    stages: int = 4
    blocks_per_sm: float = 1.0  # split K until about this many blocks per SM
    single: bool = False  # one fp32 tile: each group's wgmmas waited for before its fold
    minb: int = 1  # __launch_bounds__ blocks per SM (caps registers at 64K / (minb x threads))
    tail: bool = False  # blocks_per_sm = resident slots per SM; split K of the last wave only
    cluster: bool = False  # sum the K splits through distributed shared memory (all column blocks split)

    def smem_bytes(self, ntok: int) -> int:
        return self.stages * (ntok * 256 + self.nwg * 4096) + 1024  # (+ 1024: alignment of the ring)


@functools.lru_cache(maxsize=1)
def wgmma_available() -> bool:
    """NVRTC through torch and a Hopper GPU (sm_90a: wgmma)."""
    return available() and torch.cuda.get_device_capability() == (9, 0)


def wgmma_tokens(m: int) -> int:
    for n in WGMMA_TOKENS:
        if m <= n:
            return n
    raise ValueError(f"wgmma w4 kernel takes M <= {WGMMA_TOKENS[-1]}, got M={m}")


def wgmma_source() -> str:
    return _SOURCE.replace("//WGMMA_WRAPPERS//", _wgmma_wrappers())


@functools.lru_cache(maxsize=64)
def _wgmma_kernel(nwg: int, ntok: int, stages: int, asym: bool, smem: int, single: bool = False, minb: int = 1,
                  cs: int = 0, defines: tuple[str, ...] = ()):
    b = lambda v: "true" if v else "false"
    name = f"w4a16_wgmma<{nwg}, {ntok}, {stages}, {b(asym)}, {b(single)}, {minb}>"
    if cs:
        name = f"w4a16_wgmma_cluster<{nwg}, {ntok}, {stages}, {b(asym)}, {b(single)}, {minb}, {cs}>"
    opts = ["-std=c++17", *(f"-D{d}" for d in defines)]
    kern = torch.cuda._compile_kernel(wgmma_source(), name, compute_capability="90a", nvcc_options=opts)
    kern.set_shared_memory_config(smem)
    return kern


def check_wgmma_config(cfg: WgConfig, m: int) -> None:
    if cfg.nwg not in (1, 2, 3, 4) or cfg.stages < 3 or cfg.blocks_per_sm <= 0 or not 1 <= cfg.minb * cfg.nwg <= 16:
        raise ValueError(f"wgmma w4 kernel: 1-4 warpgroups, >= 3 stages, blocks_per_sm > 0, 1 <= minb x nwg <= 16; got {cfg}")
    if cfg.smem_bytes(wgmma_tokens(m)) > 227 * 1024:
        raise ValueError(f"wgmma w4 kernel: {cfg} needs {cfg.smem_bytes(wgmma_tokens(m))} bytes of shared memory at M={m} (> 227 KB)")


def w4a16_wgmma_gemm(
    x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None, cfg: WgConfig = WgConfig(),
    counters=None,
) -> torch.Tensor:
    """``x [M, K] (bf16, M <= 64) @ W.T + bias`` with the wgmma kernel (Hopper): same
    fragment words (reordered, :func:`wgmma_words`) and numerics as :func:`w4a16_frag_gemm`
    (per-group fp32 post-scale, split-K partials summed in split order)."""
    m = x.shape[0]
    if x.dtype != torch.bfloat16:
        raise ValueError(f"wgmma w4 kernel takes bf16 x, got {x.dtype}")
    check_wgmma_config(cfg, m)
    if qw.shape[0] * qw.shape[1] // 2 >= 1 << 32 or m * x.stride(0) * 2 >= 1 << 32:  # the kernel's 32-bit byte offsets
        raise ValueError(f"wgmma w4 kernel: weight {tuple(qw.shape)} or activation rows past 4 GiB; split the layer")
    ntok = wgmma_tokens(m)
    smem = cfg.smem_bytes(ntok)
    return _launch_blocked(
        lambda asym, cs: _wgmma_kernel(cfg.nwg, ntok, cfg.stages, asym, smem, cfg.single, cfg.minb, cs), x, qw, bias,
        "wgmma", cfg.nwg, cfg.blocks_per_sm, cfg.nwg * 128, smem, counters, tail=cfg.tail, cluster=cfg.cluster,
    )
