// limbs.cpp's tile path (AMX-INT8, or its exact emulation: tiles.h): the same limbs, weights,
// groups and float64 sums as the vpdpbusd path, its integer dot products from tdpbsud. Included
// by limbs.cpp inside its namespace, after the AVX-512 path (row_limbs, half_quants,
// half_scales, i32_pd), whose arithmetic it repeats.
//
// A pass is 16 rows (one A tile's; the limbs are padded to whole tiles with zero rows) and one
// half of a panel (16 columns: a C tile of int32), over all of K. Per group of k's (32; Q6_K's
// 16) the group's quants are one B tile: the limb layout's chunks already are tdpbsud's B rows
// (byte 4j + i: column j's k 4c + i of chunk c), so Q4_1, Q5_1, Q4_K and Q5_K's are widened to
// a byte a quant (half_quants, into a 512-byte buffer: nothing is repacked or stored twice) and
// the offset formats' (Q4_0, Q5_0, Q8_0, Q6_K) also moved by their offset to signed bytes
// u + offset (-32..31 at most; Q8_0's the file's int8). Each of the four limbs is one A tile (16
// rows of the group's k's, strided by K in RowLimbs; three A tiles in turn) and one tdpbsud
// (unsigned quants) or tdpbssd (signed) into its own C tile (|sum| <= 32 * 128 * 255 < 2^21,
// exact). For the unsigned quants a C tile holds, for 16 rows and 16 columns, the very int32
// sums vpdpbusd gives; for the signed, limb i's sums minus offset times the limb's own sum, so
// the joined T is T + offset S, the integer limb_micro adds in float64 (exact there: < 2^53):
// the same double either way, and add_group<F, FOLDED> leaves out the add. The sums are stored
// and joined per row in the same order, with the same float64 operations, as limb_micro's.
// Integer sums are exact in any order, so each row's outputs are the vpdpbusd path's bits
// whichever path a call takes: the choice by row count (limbs.cpp's ps_limb_linear) keeps every
// row's bits batch-invariant.

constexpr int64_t TROWS = 16;               // rows a pass (an A tile's)
enum : int { T_A0 = 4, T_A1 = 5, T_B = 6, T_A2 = 7 };  // tiles 0..3: the C of limbs 0..3; B; three A's

// the tiles' shapes for format F: A 16 rows of a group's k's, B a group's chunks, C 16 x 16 int32
template <int F>
TileConfig limb_tiles() {
    constexpr int G = LimbLayout<F>::groups;
    TileConfig c;
    for (int t = 0; t < LIMBS; ++t) {
        c.rows[t] = TROWS;
        c.colsb[t] = 64;
    }
    for (int t : {T_A0, T_A1, T_A2}) {
        c.rows[t] = TROWS;
        c.colsb[t] = 32 / G;
    }
    c.rows[T_B] = 8 / G;
    c.colsb[T_B] = 64;
    return c;
}

// a thread's buffers: one sub-block's quants a byte each (B tiles), the four C tiles' sums
struct TileScratch {
    alignas(64) uint8_t quants[8 * 64];
    alignas(64) int32_t sums[2][LIMBS][TROWS][16];  // two passes' (tile_half's pipeline)
};

// the limbs as the A tiles read them: for limb i, tile pass (16 rows) p and block of 32 k's kb,
// the 16 rows' 32 bytes together (512 bytes at ((i * passes + p) * nb + kb) * 512)
struct TiledLimbs {
    std::vector<int8_t> a;
    int64_t passes, nb;
    TiledLimbs(const RowLimbs& R, int64_t padded) : a(LIMBS * padded * R.K), passes(padded / TROWS), nb(R.nb) {}
    // pass p's rows of limb i, from R
    void fill(const RowLimbs& R, int64_t i, int64_t p) {
        for (int64_t kb = 0; kb < nb; ++kb)
            for (int64_t r = 0; r < TROWS; ++r)
                std::memcpy(at(i, p, kb) + r * 32, R.l[i].data() + (p * TROWS + r) * R.K + kb * 32, 32);
    }
    int8_t* at(int64_t i, int64_t p, int64_t kb) { return a.data() + ((i * passes + p) * nb + kb) * 512; }
    const int8_t* at(int64_t i, int64_t p, int64_t kb) const {
        return a.data() + ((i * passes + p) * nb + kb) * 512;
    }
};

// limb I of pass p's rows over the group's k's (A tile) times the B tile, into C tile I
// (SIGNED: the B tile holds signed quants u + offset, tdpbssd; else unsigned u, tdpbsud)
template <int I, bool SIGNED, class Tiles>
inline void limb_tile(Tiles& t, const TiledLimbs& T, int64_t p, int64_t kb, int64_t off) {
    constexpr int A = I == 1 ? T_A1 : I == 2 ? T_A2 : T_A0;
    t.template load<A>(T.at(I, p, kb) + off, 32);
    t.template dp<true, SIGNED, I, A, T_B>();
}

// the sums of one pass (sums[i]: C tile i, 16 rows x 16 columns) added to the rows' y: group g
// of block kb, its scales s and offsets o; from the sums on, limb_micro's arithmetic, operation
// for operation
template <int F>
inline void add_pass(const int32_t (*sums)[TROWS][16], const RowLimbs& R, int64_t m0, int64_t rows, int64_t kb,
                     int g, const __m512d* s, const __m512d* o, __m512d (*y)[2]) {
    using L = LimbLayout<F>;
    constexpr int G = L::groups;
    for (int64_t r = 0; r < rows; ++r) {
        const int64_t at = (m0 + r) * R.nb + kb;
        const __m512d e = _mm512_set1_pd(R.scale[at]);
        __m512i a[LIMBS];
        for (int i = 0; i < LIMBS; ++i) a[i] = _mm512_load_si512(sums[i][r]);
        const double S = G == 1 ? R.sum[at] : R.sum16[2 * at + g];
        add_group<F, L::offset != 0>(a, S, s, o, e, y[r]);
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
    constexpr int G = L::groups, CG = 8 / G, GK = 32 / G;  // chunks and k's a group
    constexpr bool SIGNED = L::offset != 0;  // the offset folded into the quants (add_group's FOLDED)
    const int64_t K = R.K, pass = m0 / TROWS;
    __m512d y[TROWS][2];
    for (int64_t r = 0; r < rows; ++r) y[r][0] = y[r][1] = _mm512_setzero_pd();
    int cur = 0;  // the buffer of sums this pass stores
    bool pending = false;  // the other buffer holds the previous pass's sums, not yet added
    int64_t prev_kb = 0;
    int prev_g = 0;
    __m512d prev_s[2], prev_o[2];
    for (int64_t b = 0; b < K / L::QK; ++b) {
        const uint8_t* blk = panel + b * L::block;
        for (int64_t j = 0; j < L::subs; ++j) {
            const uint8_t* sb = blk + L::head + j * L::sub;
            const int64_t kb = b * L::subs + j;  // the block of 32 k's
            __m512d s[G][2], o[G][2];
            half_scales<F>(blk, sb, h, s, o);
            const uint8_t* q = sb + L::scale_bytes + h * L::chunks * 64;
            if constexpr (F != L8_0 || SIGNED) {
                __m512i w[8];
                half_quants<F>(q, w);
                if constexpr (SIGNED)  // u + offset, in -128..127 (Q8_0's: its int8, u ^ 128)
                    for (int c = 0; c < 8; ++c) w[c] = _mm512_add_epi8(w[c], _mm512_set1_epi8(L::offset));
                for (int c = 0; c < 8; ++c) _mm512_store_si512(sc.quants + 64 * c, w[c]);
                q = sc.quants;
            }
            for (int g = 0; g < G; ++g) {
                t.template load<T_B>(q + g * CG * 64, 64);
                t.template zero<0>();
                t.template zero<1>();
                t.template zero<2>();
                t.template zero<3>();
                limb_tile<0, SIGNED>(t, TL, pass, kb, g * GK);
                limb_tile<1, SIGNED>(t, TL, pass, kb, g * GK);
                limb_tile<2, SIGNED>(t, TL, pass, kb, g * GK);
                limb_tile<3, SIGNED>(t, TL, pass, kb, g * GK);
                t.template store<0>(sc.sums[cur][0], 64);
                t.template store<1>(sc.sums[cur][1], 64);
                t.template store<2>(sc.sums[cur][2], 64);
                t.template store<3>(sc.sums[cur][3], 64);
                if (pending) add_pass<F>(sc.sums[cur ^ 1], R, m0, rows, prev_kb, prev_g, prev_s, prev_o, y);
                pending = true;
                prev_kb = kb;
                prev_g = g;
                prev_s[0] = s[g][0], prev_s[1] = s[g][1], prev_o[0] = o[g][0], prev_o[1] = o[g][1];
                cur ^= 1;
            }
        }
    }
    if (pending) add_pass<F>(sc.sums[cur ^ 1], R, m0, rows, prev_kb, prev_g, prev_s, prev_o, y);
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

// limb_linear on tiles (Tiles: AmxTiles, only where amx_usable(); or EmuTiles): the team fills
// one buffer of limbs (rows padded with zeros to whole tiles), then shares out the panels; each
// thread loads the tile configuration before its passes and releases the tiles after
template <int F, class Tiles>
void limb_linear_tiles(const float* x, int64_t M, int64_t K, const uint8_t* packed, int64_t N, const float* bias,
                       float* out) {
    using L = LimbLayout<F>;
    const int64_t panels = (N + LP - 1) / LP, panel_bytes = (K / L::QK) * L::block;
    const int64_t padded = (M + TROWS - 1) / TROWS * TROWS;
    const TileConfig cfg = limb_tiles<F>();
    on_team(M * N * K > (1 << 18), [&] {
        RowLimbs* shared = nullptr;
        TiledLimbs* tiled = nullptr;
#pragma omp single copyprivate(shared, tiled)
        {
            shared = new RowLimbs(padded, K);  // zero limbs past row M
            tiled = new TiledLimbs(*shared, padded);
        }
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; ++m) row_limbs(x, m, *shared);
#pragma omp for schedule(static)
        for (int64_t ip = 0; ip < LIMBS * tiled->passes; ++ip) tiled->fill(*shared, ip % LIMBS, ip / LIMBS);
        const RowLimbs& R = *shared;
        const TiledLimbs& TL = *tiled;
        std::unique_ptr<Tiles> tiles(new Tiles());
        std::unique_ptr<TileScratch> sc(new TileScratch());
        tiles->config(cfg);
#pragma omp for schedule(static)
        for (int64_t p = 0; p < panels; ++p) {
            const uint8_t* panel = packed + p * panel_bytes;
            const float* b = bias ? bias + p * LP : nullptr;
            const int64_t ncols = std::min<int64_t>(LP, N - p * LP);
            for (int64_t m0 = 0; m0 < M; m0 += TROWS)
                for (int64_t h = 0; h < 2; ++h)
                    tile_half<F>(*tiles, *sc, R, TL, m0, std::min<int64_t>(TROWS, M - m0), panel, h, b, out + p * LP, N,
                                 ncols);
        }
        tiles->release();
#pragma omp single
        {
            delete tiled;  // every thread is past the loop's barrier
            delete shared;
        }
    });
}
