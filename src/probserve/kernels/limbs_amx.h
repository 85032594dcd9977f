// limbs.cpp's tile path (AMX-INT8, or its exact emulation: tiles.h): the same limbs, weights,
// groups and float64 sums as the vpdpbusd path, its integer dot products from tdpbsud. Included
// by limbs.cpp inside its namespace, after the AVX-512 path (row_limbs, half_quants,
// half_scales, i32_pd) and limbs_super.h, whose arithmetic it repeats.
//
// The formats in blocks of 32 (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0; the K-quants further down): a pass
// is 16 rows (one A tile's; the limbs are padded to whole tiles with zero rows) and one half of a
// panel (16 columns: a C tile of int32), over all of K. Per block of 32 k's the block's quants
// are one B tile: the limb layout's chunks already are tdpbsud's B rows (byte 4j + i: column j's
// k 4c + i of chunk c), so Q4_1 and Q5_1's are widened to a byte a quant (half_quants, into a
// 512-byte buffer: nothing is repacked or stored twice) and the offset formats' (Q4_0, Q5_0,
// Q8_0) also moved by their offset to signed bytes u + offset (Q8_0's the file's int8). Each of
// the four limbs is one A tile (16 rows of the block's k's; three A tiles in turn) and one
// tdpbsud (unsigned quants) or tdpbssd (signed) into its own C tile (|sum| <= 32 * 128 * 255 <
// 2^21, exact). For the unsigned quants a C tile holds, for 16 rows and 16 columns, the very
// int32 sums vpdpbusd gives; for the signed, limb i's sums minus offset times the limb's own sum,
// so the joined T is T + offset S, the integer limb_micro adds in float64 (exact there: < 2^53):
// the same double either way, and add_group<F, FOLDED> leaves out the add. The sums are stored
// and joined per row in the same order, with the same float64 operations, as limb_micro's.
// Integer sums are exact in any order, so each row's outputs are the vpdpbusd path's bits
// whichever path a call takes: the choice by row count (limbs.cpp's ps_limb_linear) keeps every
// row's bits batch-invariant.

constexpr int64_t TROWS = 16;               // rows a pass (an A tile's)
enum : int { T_A0 = 4, T_A1 = 5, T_B = 6, T_A2 = 7 };  // tiles 0..3: the C of limbs 0..3; B; three A's
// (the K-quants' tile_panel_k: C tiles 0..4 (T_A0 the fifth), the A tile T_A1, b0 in T_B, b1 in T_A2)

// C tiles 0..N-1 zeroed, and stored to sums[0..N-1] (16 rows of 16 int32 each)
template <int N, class Tiles>
inline void zero_sums(Tiles& t) {
    if constexpr (N > 0) {
        zero_sums<N - 1>(t);
        t.template zero<N - 1>();
    }
}
template <int N, class Tiles>
inline void store_sums(Tiles& t, int32_t (*sums)[TROWS][16]) {
    if constexpr (N > 0) {
        store_sums<N - 1>(t, sums);
        t.template store<N - 1>(sums[N - 1], 64);
    }
}

// the tiles' shapes for the blocks of 32: A 16 rows of a block's k's, B its chunks, C 16 x 16 int32
inline TileConfig limb_tiles() {
    TileConfig c;
    for (int t = 0; t < LIMBS; ++t) {
        c.rows[t] = TROWS;
        c.colsb[t] = 64;
    }
    for (int t : {T_A0, T_A1, T_A2}) {
        c.rows[t] = TROWS;
        c.colsb[t] = 32;
    }
    c.rows[T_B] = 8;
    c.colsb[T_B] = 64;
    return c;
}

// a thread's buffers: one sub-block's quants a byte each (B tiles), the four C tiles' sums
struct TileScratch {
    alignas(64) uint8_t quants[8 * 64];
    alignas(64) int32_t sums[2][LIMBS][TROWS][16];  // two passes' (tile_half's pipeline)
};

// the limbs as the A tiles read them: for limb i, tile pass (16 rows) p and run of `width` k's
// (32: a group's, limb_tile's; 64: the K-quants') kw, the 16 rows' bytes together (16 width
// bytes at ((i * passes + p) * (K / width) + kw) * 16 width)
struct TiledLimbs {
    std::vector<int8_t> a;
    int64_t passes, nw, width;
    TiledLimbs(const RowLimbs& R, int64_t padded, int64_t width_)
        : a(LIMBS * padded * R.K), passes(padded / TROWS), nw(R.K / width_), width(width_) {}
    // pass p's rows of limb i, from R
    void fill(const RowLimbs& R, int64_t i, int64_t p) {
        for (int64_t kw = 0; kw < nw; ++kw)
            for (int64_t r = 0; r < TROWS; ++r)
                std::memcpy(at(i, p, kw) + r * width, R.l[i].data() + (p * TROWS + r) * R.K + kw * width, width);
    }
    int8_t* at(int64_t i, int64_t p, int64_t kw) { return a.data() + ((i * passes + p) * nw + kw) * TROWS * width; }
    const int8_t* at(int64_t i, int64_t p, int64_t kw) const {
        return a.data() + ((i * passes + p) * nw + kw) * TROWS * width;
    }
};

// limb I of pass p's rows over the group's k's (A tile) times the B tile, into C tile I
// (SIGNED: the B tile holds signed quants u + offset, tdpbssd; else unsigned u, tdpbsud)
template <int I, bool SIGNED, class Tiles>
inline void limb_tile(Tiles& t, const TiledLimbs& T, int64_t p, int64_t kb) {
    constexpr int A = I == 1 ? T_A1 : I == 2 ? T_A2 : T_A0;
    t.template load<A>(T.at(I, p, kb), 32);
    t.template dp<true, SIGNED, I, A, T_B>();
}

// the sums of one pass (sums[i]: C tile i, 16 rows x 16 columns) added to the rows' y: block kb,
// its scales s and offsets o; from the sums on, limb_micro's arithmetic, operation for operation
template <int F>
inline void add_pass(const int32_t (*sums)[TROWS][16], const RowLimbs& R, int64_t m0, int64_t rows, int64_t kb,
                     const __m512d* s, const __m512d* o, __m512d (*y)[2]) {
    using L = LimbLayout<F>;
    for (int64_t r = 0; r < rows; ++r) {
        const int64_t at = (m0 + r) * R.nb + kb;
        const __m512d e = _mm512_set1_pd(R.scale[at]);
        __m512i a[LIMBS];
        for (int i = 0; i < LIMBS; ++i) a[i] = _mm512_load_si512(sums[i][r]);
        add_group<F, L::offset != 0>(a, R.sum[at], s, o, e, y[r]);
    }
}

// rows m0..m0 + rows - 1 (rows <= 16) of the limbs times half h of one packed panel. The passes
// are pipelined: a pass's tile instructions are issued before the previous pass's sums are
// scaled (two buffers of sums), so the tiles and the vector units work at once; each row's y
// still takes the passes in order
template <int F, class Tiles>
void tile_half(Tiles& t, TileScratch& sc, const RowLimbs& R, const TiledLimbs& TL, int64_t m0, int64_t rows,
               const uint8_t* panel, int64_t h, const float* bias, float* out, int64_t ldo, int64_t ncols) {
    using L = LimbLayout<F>;
    static_assert(!L::kquant, "the K-quants: tile_panel_k");
    constexpr bool SIGNED = L::offset != 0;  // the offset folded into the quants (add_group's FOLDED)
    const int64_t K = R.K, pass = m0 / TROWS;
    __m512d y[TROWS][2];
    for (int64_t r = 0; r < rows; ++r) y[r][0] = y[r][1] = _mm512_setzero_pd();
    int cur = 0;  // the buffer of sums this pass stores
    bool pending = false;  // the other buffer holds the previous pass's sums, not yet added
    int64_t prev_kb = 0;
    __m512d prev_s[2], prev_o[2];
    for (int64_t b = 0; b < K / L::QK; ++b) {
        const uint8_t* blk = panel + b * L::block;
        for (int64_t j = 0; j < L::subs; ++j) {
            const uint8_t* sb = blk + L::head + j * L::sub;
            const int64_t kb = b * L::subs + j;  // the block of 32 k's
            __m512d s[2], o[2];
            half_scales<F>(blk, h, s, o);
            const uint8_t* q = sb + L::scale_bytes + h * L::chunks * 64;
            if constexpr (F != L8_0 || SIGNED) {
                __m512i w[8];
                half_quants<F>(q, w);
                if constexpr (SIGNED)  // u + offset, in -128..127 (Q8_0's: its int8, u ^ 128)
                    for (int c = 0; c < 8; ++c) w[c] = _mm512_add_epi8(w[c], _mm512_set1_epi8(L::offset));
                for (int c = 0; c < 8; ++c) _mm512_store_si512(sc.quants + 64 * c, w[c]);
                q = sc.quants;
            }
            t.template load<T_B>(q, 64);
            zero_sums<LIMBS>(t);
            limb_tile<0, SIGNED>(t, TL, pass, kb);
            limb_tile<1, SIGNED>(t, TL, pass, kb);
            limb_tile<2, SIGNED>(t, TL, pass, kb);
            limb_tile<3, SIGNED>(t, TL, pass, kb);
            store_sums<LIMBS>(t, sc.sums[cur]);
            if (pending) add_pass<F>(sc.sums[cur ^ 1], R, m0, rows, prev_kb, prev_s, prev_o, y);
            pending = true;
            prev_kb = kb;
            prev_s[0] = s[0], prev_s[1] = s[1], prev_o[0] = o[0], prev_o[1] = o[1];
            cur ^= 1;
        }
    }
    if (pending) add_pass<F>(sc.sums[cur ^ 1], R, m0, rows, prev_kb, prev_s, prev_o, y);
    const int64_t c0 = h * 16;
    if (c0 >= ncols) return;
    const int64_t n = std::min<int64_t>(16, ncols - c0);
    for (int64_t r = 0; r < rows; ++r) {
        const __m256 lo = _mm512_cvtpd_ps(y[r][0]), hi = _mm512_cvtpd_ps(y[r][1]);
        __m512 v = _mm512_insertf32x8(_mm512_castps256_ps512(lo), hi, 1);
        if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + c0));
        _mm512_mask_storeu_ps(out + (m0 + r) * ldo + c0, static_cast<__mmask16>((1u << n) - 1u), v);
    }
}

// The K-quants on tiles (limbs_super.h's join, once a super-block): a group's sc is folded
// into its quants, B = sc u (Q6_K: sc (u - 32)), within -4064..4096, so each product is split in two
// bytes, B = b0 + 256 b1 (b0 unsigned 0..255, b1 0..7, Q6_K's -16..16 signed): two B planes
// whose tiles' 16 rows are 64 k's (two sub-blocks: a sub-block no longer needs its own tiles,
// and the A tiles are whole, 16 rows of 64 limbs). A pass (16 rows, a super-block, 16 columns)
// adds limb i times b0 into C tile i and times b1 into C tile i + 1 (the same power of 256), so
// five C tiles hold c_0..c_4, |c| <= 256 * 128 * (255 + 16) < 2^24 (exact), and
// c_0 + 256 c_1 + ... + 2^32 c_4 is the super-block's T of limbs_super.h, the integer the
// vpdpbusd path joins from its four limbs' sums: the same double, the same bits. The B planes
// are built once a super-block for every pass of 16 rows.
// the K-quants' tiles: limb_tile's numbering, every tile 16 rows of 64 bytes
inline TileConfig kquant_tiles() {
    TileConfig c;
    for (int t = 0; t < 8; ++t) {
        c.rows[t] = TROWS;
        c.colsb[t] = 64;
    }
    return c;
}

// a thread's buffers for the K-quants: one super-block's two halves as the B planes (b0, b1:
// 8 sub-blocks x 8 chunks of 64 bytes, in k order), five C tiles' sums, the rows' y (two halves)
struct KTileScratch {
    alignas(64) uint8_t b0[2][8 * 8 * 64];
    alignas(64) uint8_t b1[2][8 * 8 * 64];
    alignas(64) int32_t sums[5][TROWS][16];
    std::unique_ptr<__m512d[]> y;
    explicit KTileScratch(int64_t rows) : y(new __m512d[4 * rows]) {}
};

// half h of one super-block's quants times their groups' sc, split into the bytes b0 and b1
template <int F>
inline void fold_scales(const uint8_t* blk, int64_t h, uint8_t* b0, uint8_t* b1) {
    using L = LimbLayout<F>;
    constexpr int G = L::groups, CG = 8 / G;
    const __m512i lo8 = _mm512_set1_epi16(0x00ff), hi8 = _mm512_set1_epi16(static_cast<int16_t>(0xff00));
    for (int64_t j = 0; j < L::subs; ++j) {
        const uint8_t* sb = blk + L::head + j * L::sub;
        __m512i w[8], scw[G];
        half_quants<F>(sb + L::scale_bytes + h * L::chunks * 64, w);
        for (int g = 0; g < G; ++g) {  // column n's sc in both words of lane n
            const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(sb + g * LP + 16 * h));
            const __m512i v = F == L6_K ? _mm512_cvtepi8_epi32(bytes) : _mm512_cvtepu8_epi32(bytes);
            scw[g] = _mm512_or_si512(_mm512_and_si512(v, _mm512_set1_epi32(0xffff)), _mm512_slli_epi32(v, 16));
        }
        for (int c = 0; c < 8; ++c) {
            __m512i ev = _mm512_and_si512(w[c], lo8), od = _mm512_srli_epi16(w[c], 8);
            if constexpr (L::offset != 0) {
                ev = _mm512_add_epi16(ev, _mm512_set1_epi16(L::offset));
                od = _mm512_add_epi16(od, _mm512_set1_epi16(L::offset));
            }
            const __m512i pe = _mm512_mullo_epi16(ev, scw[c / CG]), po = _mm512_mullo_epi16(od, scw[c / CG]);
            const int64_t at = (j * 8 + c) * 64;
            _mm512_store_si512(b0 + at, _mm512_or_si512(_mm512_and_si512(pe, lo8), _mm512_slli_epi16(po, 8)));
            _mm512_store_si512(b1 + at, _mm512_or_si512(_mm512_srli_epi16(pe, 8), _mm512_and_si512(po, hi8)));
        }
    }
}

// limb I of pass p's rows over 64 k's (an A tile) times b0 into C tile I and b1 into C tile
// I + 1 (C tiles 0..4; the A tile T_A1; b0 in T_B, b1 in T_A2: limb_tile's numbering)
template <int I, bool SIGNED_B1, class Tiles>
inline void limb_tiles_k(Tiles& t, const TiledLimbs& TL, int64_t p, int64_t kw) {
    t.template load<T_A1>(TL.at(I, p, kw), 64);
    t.template dp<true, false, I, T_A1, T_B>();
    t.template dp<true, SIGNED_B1, I + 1, T_A1, T_A2>();
}

// rows m_lo..m_hi - 1 (whole passes but the last) of the limbs times one packed K-quant panel,
// super-block by super-block, a pass of 16 rows both halves in turn (its A tiles read twice,
// from the cache), each pass's sums joined into its rows' y (y[0]: row m_lo's) as it ends
template <int F, class Tiles>
void tile_panel_k(Tiles& t, KTileScratch& sc, const RowLimbs& R, const TiledLimbs& TL, int64_t m_lo, int64_t m_hi,
                  const uint8_t* panel, const float* bias, float* out, int64_t ldo, int64_t ncols) {
    using L = LimbLayout<F>;
    constexpr bool SIGNED_B1 = L::offset != 0;
    __m512d* y = sc.y.get();
    for (int64_t r = 0; r < 4 * (m_hi - m_lo); ++r) y[r] = _mm512_setzero_pd();
    for (int64_t b = 0; b < R.K / L::QK; ++b) {
        const uint8_t* blk = panel + b * L::block;
        SuperScales<F> ss[2];
        for (int64_t h = 0; h < 2; ++h) {
            fold_scales<F>(blk, h, sc.b0[h], sc.b1[h]);
            super_scales<F, L::kmin>(blk, h, ss[h]);
        }
        for (int64_t m0 = m_lo; m0 < m_hi; m0 += TROWS) {
            const int64_t p = m0 / TROWS, rows = std::min<int64_t>(TROWS, m_hi - m0);
            for (int64_t h = 0; h < 2; ++h) {
                zero_sums<5>(t);
                for (int64_t s = 0; s < L::QK / 64; ++s) {
                    const int64_t kw = b * (L::QK / 64) + s;
                    t.template load<T_B>(sc.b0[h] + s * 1024, 64);
                    t.template load<T_A2>(sc.b1[h] + s * 1024, 64);
                    // limbs 0, 2, 1, 3: a C tile's two products three apart (each waits
                    // for the one before it: C tile i + 1 takes limb i's and limb i + 1's)
                    limb_tiles_k<0, SIGNED_B1>(t, TL, p, kw);
                    limb_tiles_k<2, SIGNED_B1>(t, TL, p, kw);
                    limb_tiles_k<1, SIGNED_B1>(t, TL, p, kw);
                    limb_tiles_k<3, SIGNED_B1>(t, TL, p, kw);
                }
                store_sums<5>(t, sc.sums);
                for (int64_t r = 0; r < rows; ++r) {
                    __m512i c[5];
                    for (int i = 0; i < 5; ++i) c[i] = _mm512_load_si512(sc.sums[i][r]);
                    __m512d T0, T1;
                    join_limbs<5>(c, T0, T1);
                    add_super<F, true>(T0, T1, R, m0 + r, b, ss[h], y + 4 * (m0 + r - m_lo) + 2 * h);
                }
            }
        }
    }
    for (int64_t m = m_lo; m < m_hi; ++m)
        for (int64_t h = 0; h < 2; ++h)
            store_half(y + 4 * (m - m_lo) + 2 * h, bias, out + m * ldo, h * 16, ncols);
}

// the rows a K-quant's panels take at a time: whole passes whose four limbs (4 M K bytes) fill at
// most 1 MiB (a core's L2 holds them while every panel's weights stream by; without the blocks
// 512 rows of K = 2048 were 4 MiB of A tiles read again for each panel), at least one pass
inline int64_t kquant_row_block(int64_t K, int64_t M) {
    constexpr int64_t bytes = int64_t{1} << 20;
    const int64_t passes = std::max<int64_t>(1, bytes / (LIMBS * K * TROWS));
    return std::min(passes * TROWS, (M + TROWS - 1) / TROWS * TROWS);
}

// limb_linear on tiles (Tiles: AmxTiles, only where amx_usable(); or EmuTiles): the team fills
// one buffer of limbs (rows padded with zeros to whole tiles), then shares out the panels; each
// thread loads the tile configuration before its passes and releases the tiles after
template <int F, class Tiles>
void limb_linear_tiles(const float* x, int64_t M, int64_t K, const uint8_t* packed, int64_t N, const float* bias,
                       float* out) {
    using L = LimbLayout<F>;
    const int64_t panels = (N + LP - 1) / LP, panel_bytes = (K / L::QK) * L::block;
    const int64_t padded = (M + TROWS - 1) / TROWS * TROWS;
    const TileConfig cfg = L::kquant ? kquant_tiles() : limb_tiles();
    on_team(M * N * K > (1 << 18), [&] {
        RowLimbs* shared = nullptr;
        TiledLimbs* tiled = nullptr;
#pragma omp single copyprivate(shared, tiled)
        {
            shared = new RowLimbs(padded, K);  // zero limbs past row M
            tiled = new TiledLimbs(*shared, padded, L::kquant ? 64 : 32);
        }
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; ++m) row_limbs(x, m, *shared, L::QK);
#pragma omp for schedule(static)
        for (int64_t ip = 0; ip < LIMBS * tiled->passes; ++ip) tiled->fill(*shared, ip % LIMBS, ip / LIMBS);
        const RowLimbs& R = *shared;
        const TiledLimbs& TL = *tiled;
        std::unique_ptr<Tiles> tiles(new Tiles());
        tiles->config(cfg);
        if constexpr (L::kquant) {
            // blocks of rows whose A tiles stay in a core's L2 while every panel passes them
            const int64_t block = kquant_row_block(K, M);
            const int64_t blocks = (M + block - 1) / block;
            std::unique_ptr<KTileScratch> sc(new KTileScratch(std::min(block, padded)));
#pragma omp for schedule(static)
            for (int64_t bp = 0; bp < blocks * panels; ++bp) {
                const int64_t p = bp % panels, m_lo = bp / panels * block;
                const float* b = bias ? bias + p * LP : nullptr;
                const int64_t ncols = std::min<int64_t>(LP, N - p * LP);
                tile_panel_k<F>(*tiles, *sc, R, TL, m_lo, std::min(M, m_lo + block), packed + p * panel_bytes, b,
                                out + p * LP, N, ncols);
            }
        } else {
            std::unique_ptr<TileScratch> sc(new TileScratch());
#pragma omp for schedule(static)
            for (int64_t p = 0; p < panels; ++p) {
                const uint8_t* panel = packed + p * panel_bytes;
                const float* b = bias ? bias + p * LP : nullptr;
                const int64_t ncols = std::min<int64_t>(LP, N - p * LP);
                for (int64_t m0 = 0; m0 < M; m0 += TROWS)
                    for (int64_t h = 0; h < 2; ++h)
                        tile_half<F>(*tiles, *sc, R, TL, m0, std::min<int64_t>(TROWS, M - m0), panel, h, b,
                                     out + p * LP, N, ncols);
            }
        }
        tiles->release();
#pragma omp single
        {
            delete tiled;  // every thread is past the loop's barrier
            delete shared;
        }
    });
}
