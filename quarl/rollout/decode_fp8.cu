// Paged decode attention over an fp8 KV cache (e4m3fn codes + one float32 power-of-two scale
// per (token, kv head) row, quarl/quant/kv.py), head_dim 128, for mma.sync GPUs (sm80+).
// Launched by quarl/rollout/fp8_decode.py, which compiles this file with NVRTC at first use.
//
// Grid (sequence, kv head, split); NW warps per block. The block's share of the context
// (split `blockIdx.z` of `*split_len` tokens) is cut into tiles of TOK = 16 KC tokens, dealt to
// the warps in turn; each warp streams its tiles through its own ring of ST shared-memory
// slots with cp.async and keeps an online softmax; the warps are merged at the end.
//
// Why not Triton: the codes must reach the mma operand registers with few instructions per
// byte. Here every thread reads, for each operand, bytes that are already in fragment order:
// - scores S = Q K^T: K is the mma's B operand (k = head dim, n = token). The head dimension
//   is permuted (the dot product does not care, Q gets the same permutation): in k16 chunk c,
//   thread t (lane % 4) holds dims 32 t + 4 c + {0, 1} (k = 2t, 2t+1) and + {2, 3} (k = 2t+8,
//   2t+9), so its 32 bytes of a K row are one contiguous run: two 16-byte shared loads give
//   all eight chunks' codes.
// - O = P V: V is the B operand (k = token, n = head dim). The tokens of a 16-token chunk are
//   permuted (P's columns come from the score tiles, which are loaded in the same order):
//   thread t holds tokens 4t .. 4t+3, so that for output column g (lane / 4) of d tile i,
//   dim 16 g + i, its four codes sit at byte i of the 16-byte runs 16 g .. 16 g + 15 of its
//   four token rows; one byte permute puts two of them into a bf16x2 word.
// A code is made a bf16 exactly in integer ops: its sign and 7 low bits go into a bf16's sign,
// exponent and mantissa fields (the value / 2^120, subnormal for subnormal codes), then one
// bf16x2 fma by 2^120 (and -0, which keeps a zero's sign). The row scales multiply the fp32
// scores (K) and the probabilities before they are rounded to bf16 (V): for powers of two
// that gives the floats of the dot products over the dequantized rows.

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

constexpr int D = 128;
#define NEG_INF __int_as_float(0xff800000)

__device__ __forceinline__ u32 smem_u32(const void* p) {
  u32 a;
  asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
  return a;
}
// global -> shared, bypassing L1 (16 bytes) or through it (4 bytes); bytes past `valid` are zero-filled
__device__ __forceinline__ void cp_async16(u32 dst, const void* src, int valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(dst), "l"(src), "r"(valid));
}
__device__ __forceinline__ void cp_async4(u32 dst, const void* src, int valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" :: "r"(dst), "l"(src), "r"(valid));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;"); }
template <int N_>
__device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;" :: "n"(N_)); }
__device__ __forceinline__ void lds128(u32* r, u32 addr) {
  asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void lds128f(float* r, u32 addr) {
  asm volatile("ld.shared.v4.f32 {%0,%1,%2,%3}, [%4];" : "=f"(r[0]), "=f"(r[1]), "=f"(r[2]), "=f"(r[3]) : "r"(addr));
}
__device__ __forceinline__ float lds32f(u32 addr) {
  float r;
  asm volatile("ld.shared.f32 %0, [%1];" : "=f"(r) : "r"(addr));
  return r;
}
__device__ __forceinline__ void mma16816(float* c, const u32* a, u32 b0, u32 b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// bf16x2 {lo, hi} from two floats, round to nearest even
__device__ __forceinline__ u32 pack_bf16(float lo, float hi) {
  u32 r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
// The e4m3fn codes in bytes 1 and 3 of `t` as a bf16x2 {byte 1, byte 3}, exact (bytes 0 and 2
// are ignored).
__device__ __forceinline__ u32 e4m3x2_bf16(u32 t) {
  u32 r = ((t >> 4) & 0x07F007F0u) | (t & 0x80008000u);
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(r), "r"(0x7B807B80u), "r"(0x80008000u));
  return r;
}
__device__ __forceinline__ float ex2(float x) {
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
}

// Slot layout (TOK tokens): K codes [TOK][128], V codes [TOK][128], K scales [TOK], V scales
// [TOK]. Row r's 16-byte piece p sits at piece p ^ (r & 1) (K) or p ^ ((r >> 1) & 6) (V), so
// that the fragment reads above hit distinct banks.
template <int TOK>
struct Slot {
  static constexpr int K = 0, V = TOK * D, KS = 2 * TOK * D, VS = 2 * TOK * D + 4 * TOK, BYTES = 2 * TOK * D + 8 * TOK;
};

// Merge scratch per warp: m and l of 16 rows, then the 16 x 128 accumulator as [row][t][36]
// (the 32 dims 32 t .. 32 t + 31 of lane t, padded against bank conflicts).
constexpr int MERGE_FLOATS = 32 + 16 * 4 * 36;

// q [B, Hq, 128] bf16 (strides sq_b, sq_h elements, unit last); caches [blocks, PAGE, Hkv, 128]
// bytes (strides skb, skt, skh); scales [blocks, PAGE, Hkv] float32 (strides ssb, sst, unit
// head); block_tables [B, *] int32 (row stride sbt); context_lens [B] int32; *split_len tokens
// per split (a multiple of 16). One split: out [B, Hq, 128] bf16 (strides so_b, so_h);
// several: part_out [B, Hq, S, 128] and part_lse [B, Hq, S] float32 (log2 domain), merged by
// the caller. TWO: the group has more than 8 query heads (the mma's rows 8..15 are used).
template <int NW, int ST, int KC, int PAGE, bool TWO>
__global__ void __launch_bounds__(NW * 32) decode_fp8(
    const u16* __restrict__ q, const unsigned char* __restrict__ kc, const unsigned char* __restrict__ vc,
    const float* __restrict__ ks, const float* __restrict__ vs, const int* __restrict__ block_tables,
    const int* __restrict__ context_lens, const int* __restrict__ split_len_p,
    u16* __restrict__ out, float* __restrict__ part_out, float* __restrict__ part_lse, double qk_scale_d,
    int sq_b, int sq_h, int skb, int skt, int skh, int ssb, int sst, int sbt, int so_b, int so_h,
    int group, int num_splits) {
  constexpr int TOK = 16 * KC;
  using L = Slot<TOK>;
  extern __shared__ __align__(128) unsigned char smem[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int b = blockIdx.x, kvh = blockIdx.y, split = blockIdx.z, hkv = gridDim.y;
  wait_ahead();
  const float qk_scale = (float)qk_scale_d;
  const int ctx = context_lens[b];
  const int split_len = *split_len_p;
  const int start = split * split_len;
  const int end = min(ctx, start + split_len);
  const int ntiles = end > start ? (end - start + TOK - 1) / TOK : 0;
  const int mytiles = ntiles > warp ? (ntiles - warp + NW - 1) / NW : 0;
  const int* bt = block_tables + (size_t)b * sbt;

  // Q as the A operand of the score mma, in the permuted head-dim order: rows g (and g + 8),
  // dims 32 t .. 32 t + 31; heads past the group are zero.
  u32 qa[8][4];
  {
    u32 lo[16], hi[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) lo[i] = hi[i] = 0u;
    if (g < group) {
      const uint4* p = reinterpret_cast<const uint4*>(q + (size_t)b * sq_b + (size_t)(kvh * group + g) * sq_h + 32 * t);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        uint4 v = p[i];
        lo[4 * i] = v.x; lo[4 * i + 1] = v.y; lo[4 * i + 2] = v.z; lo[4 * i + 3] = v.w;
      }
    }
    if (TWO && g + 8 < group) {
      const uint4* p = reinterpret_cast<const uint4*>(q + (size_t)b * sq_b + (size_t)(kvh * group + g + 8) * sq_h + 32 * t);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        uint4 v = p[i];
        hi[4 * i] = v.x; hi[4 * i + 1] = v.y; hi[4 * i + 2] = v.z; hi[4 * i + 3] = v.w;
      }
    }
#pragma unroll
    for (int c = 0; c < 8; ++c) {
      qa[c][0] = lo[2 * c]; qa[c][1] = hi[2 * c]; qa[c][2] = lo[2 * c + 1]; qa[c][3] = hi[2 * c + 1];
    }
  }

  const u32 ring = smem_u32(smem) + warp * ST * L::BYTES;
  // this lane's copies per 16-token chunk: pieces lane + 32 i of K and of V (row (lane + 32 i) / 8,
  // piece lane % 8) and one scale (lanes 0..15: K, 16..31: V)
  // the block of each chunk of a tile (the chunk's 16 tokens share one: PAGE % 16 == 0), read a
  // tile ahead of its copies so that they do not wait for the block table
  auto pages_of = [&](int tile, int (&pg)[KC]) {
    const int tok0 = start + (warp + tile * NW) * TOK;
#pragma unroll
    for (int chunk = 0; chunk < KC; ++chunk) {
      const int c0 = min(tok0 + 16 * chunk, end - 1);
      pg[chunk] = tile < mytiles ? bt[c0 / PAGE] : 0;
    }
  };
  auto issue = [&](int tile, int slot, const int (&pg)[KC]) {
    const int tok0 = start + (warp + tile * NW) * TOK;
    const u32 base = ring + slot * L::BYTES;
#pragma unroll
    for (int chunk = 0; chunk < KC; ++chunk) {
      const int c0 = tok0 + 16 * chunk;
      const int page = pg[chunk];
      const size_t row0 = (size_t)page * skb + (size_t)(c0 % PAGE) * skt + (size_t)kvh * skh;
      const size_t srow0 = (size_t)page * ssb + (size_t)(c0 % PAGE) * sst + kvh;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int piece = lane + 32 * i, rr = piece >> 3, pc = piece & 7, r = 16 * chunk + rr;
        const bool ok = c0 + rr < end;
        const size_t off = row0 + (size_t)rr * skt + pc * 16;
        cp_async16(base + L::K + r * D + ((pc ^ (r & 1)) << 4), kc + off, ok ? 16 : 0);
        cp_async16(base + L::V + r * D + ((pc ^ ((r >> 1) & 6)) << 4), vc + off, ok ? 16 : 0);
      }
      {
        const int rr = lane & 15, r = 16 * chunk + rr;
        const bool ok = c0 + rr < end;
        const size_t soff = srow0 + (size_t)rr * sst;
        if (lane < 16) cp_async4(base + L::KS + 4 * r, ks + soff, ok ? 4 : 0);
        else cp_async4(base + L::VS + 4 * r, vs + soff, ok ? 4 : 0);
      }
    }
  };

  float acc[16][4];
#pragma unroll
  for (int i = 0; i < 16; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
  float m_lo = NEG_INF, m_hi = NEG_INF, l_lo = 0.f, l_hi = 0.f;

  int pg[KC];
#pragma unroll
  for (int s = 0; s < ST - 1; ++s) {
    pages_of(s, pg);
    if (s < mytiles) issue(s, s, pg);
    cp_commit();
  }
  pages_of(ST - 1, pg);
  for (int it = 0; it < mytiles; ++it) {
    if (it + ST - 1 < mytiles) issue(it + ST - 1, (it + ST - 1) % ST, pg);
    cp_commit();
    pages_of(it + ST, pg);
    cp_wait<ST - 1>();
    __syncwarp();
    const u32 base = ring + (it % ST) * L::BYTES;
    const int tok0 = start + (warp + it * NW) * TOK;

    // scores of the tile: chunk, tile j (tokens 4t + 2j, 4t + 2j + 1 of the chunk), {row g x 2, row g+8 x 2}
    float s[KC][2][4];
#pragma unroll
    for (int chunk = 0; chunk < KC; ++chunk) {
      float ksc[4];
      lds128f(ksc, base + L::KS + 4 * (16 * chunk + 4 * t));
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int r = 16 * chunk + 4 * (g >> 1) + 2 * j + (g & 1);  // the token of B column g
        u32 w[8];
        lds128(w, base + L::K + r * D + (((2 * t) ^ (r & 1)) << 4));
        lds128(w + 4, base + L::K + r * D + (((2 * t + 1) ^ (r & 1)) << 4));
        float* c = s[chunk][j];
        c[0] = c[1] = c[2] = c[3] = 0.f;
#pragma unroll
        for (int k = 0; k < 8; ++k)
          mma16816(c, qa[k], e4m3x2_bf16(__byte_perm(w[k], 0, 0x1000)), e4m3x2_bf16(__byte_perm(w[k], 0, 0x3020)));
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int u = 2 * j + (e & 1);  // token 4t + u of the chunk
          const bool ok = tok0 + 16 * chunk + 4 * t + u < end;
          c[e] = ok ? c[e] * (ksc[u] * qk_scale) : NEG_INF;
        }
      }
    }
    // online softmax (rows g and g + 8; a row's four lanes agree on m)
    float mx_lo = NEG_INF, mx_hi = NEG_INF;
#pragma unroll
    for (int chunk = 0; chunk < KC; ++chunk)
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        mx_lo = fmaxf(mx_lo, fmaxf(s[chunk][j][0], s[chunk][j][1]));
        if (TWO) mx_hi = fmaxf(mx_hi, fmaxf(s[chunk][j][2], s[chunk][j][3]));
      }
    mx_lo = fmaxf(mx_lo, __shfl_xor_sync(0xffffffffu, mx_lo, 1));
    mx_lo = fmaxf(mx_lo, __shfl_xor_sync(0xffffffffu, mx_lo, 2));
    const float mn_lo = fmaxf(m_lo, mx_lo), alpha_lo = ex2(m_lo - mn_lo);
    m_lo = mn_lo;
    float mn_hi = 0.f, alpha_hi = 1.f;
    if (TWO) {
      mx_hi = fmaxf(mx_hi, __shfl_xor_sync(0xffffffffu, mx_hi, 1));
      mx_hi = fmaxf(mx_hi, __shfl_xor_sync(0xffffffffu, mx_hi, 2));
      mn_hi = fmaxf(m_hi, mx_hi);
      alpha_hi = ex2(m_hi - mn_hi);
      m_hi = mn_hi;
    }
    l_lo *= alpha_lo;
    l_hi *= alpha_hi;
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      acc[i][0] *= alpha_lo;
      acc[i][1] *= alpha_lo;
      if (TWO) {
        acc[i][2] *= alpha_hi;
        acc[i][3] *= alpha_hi;
      }
    }
#pragma unroll
    for (int chunk = 0; chunk < KC; ++chunk) {
      float vsc[4];
      lds128f(vsc, base + L::VS + 4 * (16 * chunk + 4 * t));
      u32 pa[4];
      {
        float p[2][4];
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          p[j][0] = ex2(s[chunk][j][0] - mn_lo);
          p[j][1] = ex2(s[chunk][j][1] - mn_lo);
          l_lo += p[j][0] + p[j][1];
          if (TWO) {
            p[j][2] = ex2(s[chunk][j][2] - mn_hi);
            p[j][3] = ex2(s[chunk][j][3] - mn_hi);
            l_hi += p[j][2] + p[j][3];
          }
        }
        // A operand of P V: k = 2t, 2t+1 -> tokens 4t, 4t+1 (score tile 0); k = 2t+8, 2t+9 -> 4t+2, 4t+3 (tile 1)
        pa[0] = pack_bf16(p[0][0] * vsc[0], p[0][1] * vsc[1]);
        pa[2] = pack_bf16(p[1][0] * vsc[2], p[1][1] * vsc[3]);
        pa[1] = TWO ? pack_bf16(p[0][2] * vsc[0], p[0][3] * vsc[1]) : 0u;
        pa[3] = TWO ? pack_bf16(p[1][2] * vsc[2], p[1][3] * vsc[3]) : 0u;
      }
      u32 v[4][4];  // token 4t + u, dims 16 g .. 16 g + 15
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int r = 16 * chunk + 4 * t + u;
        lds128(v[u], base + L::V + r * D + ((g ^ ((r >> 1) & 6)) << 4));
      }
#pragma unroll
      for (int i = 0; i < 16; ++i) {  // d tile i: column g is dim 16 g + i, byte i % 4 of word i / 4
        const int wd = i >> 2, by = i & 3;
        const u32 sel = (by << 4) | ((4 + by) << 12);
        mma16816(acc[i], pa, e4m3x2_bf16(__byte_perm(v[0][wd], v[1][wd], sel)),
                 e4m3x2_bf16(__byte_perm(v[2][wd], v[3][wd], sel)));
      }
    }
    __syncwarp();  // the slot is refilled next iteration
  }
  cp_wait<0>();
  l_lo += __shfl_xor_sync(0xffffffffu, l_lo, 1);
  l_lo += __shfl_xor_sync(0xffffffffu, l_lo, 2);
  if (TWO) {
    l_hi += __shfl_xor_sync(0xffffffffu, l_hi, 1);
    l_hi += __shfl_xor_sync(0xffffffffu, l_hi, 2);
  }
  __syncthreads();  // every warp is done with its ring: the merge scratch overlays it

  // Merge the warps: thread's accumulator column 2t (+1) of d tile i is dim 32 t + i (+ 16).
  float* mrg = reinterpret_cast<float*>(smem);
  float* mine = mrg + warp * MERGE_FLOATS;
  if (t == 0) {
    mine[g] = m_lo;
    mine[16 + g] = l_lo;
    if (TWO) {
      mine[g + 8] = m_hi;
      mine[16 + g + 8] = l_hi;
    }
  }
#pragma unroll
  for (int half = 0; half < (TWO ? 2 : 1); ++half) {
    float* row = mine + 32 + ((g + 8 * half) * 4 + t) * 36;
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      row[i] = acc[i][2 * half];
      row[16 + i] = acc[i][2 * half + 1];
    }
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < group * D; idx += NW * 32) {
    const int r = idx / D, d = idx % D;
    float mstar = NEG_INF;
#pragma unroll
    for (int w = 0; w < NW; ++w) mstar = fmaxf(mstar, mrg[w * MERGE_FLOATS + r]);
    float lsum = 0.f, o = 0.f;
    if (mstar != NEG_INF) {
#pragma unroll
      for (int w = 0; w < NW; ++w) {
        const float* mw = mrg + w * MERGE_FLOATS;
        const float e = ex2(mw[r] - mstar);
        lsum += e * mw[16 + r];
        o += e * mw[32 + (r * 4 + d / 32) * 36 + d % 32];
      }
    }
    o = o / fmaxf(lsum, 1e-30f);
    const int head = kvh * group + r;
    if (num_splits == 1) {
      u32 bits = pack_bf16(o, 0.f);
      out[(size_t)b * so_b + (size_t)head * so_h + d] = (u16)(bits & 0xFFFFu);
    } else {
      const size_t base = ((size_t)b * hkv * group + head) * num_splits + split;
      part_out[base * D + d] = o;
      if (d == 0) part_lse[base] = lsum > 0.f ? mstar + __log2f(lsum) : NEG_INF;
    }
  }
}
