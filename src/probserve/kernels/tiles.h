// The AMX tile layer of limbs_amx.h: tile configuration, tileloadd, tilestored, tilezero and the
// int8 tile dot products (tdpbssd, tdpbsud, tdpbusd, tdpbuud) behind one interface, with two
// implementations of the same integer semantics:
//   AmxTiles  the instructions themselves (inline assembly: nothing else in the file needs an AMX
//             target, so the library builds and loads on every x86-64 CPU; they run only where
//             amx_usable() said yes, after the process asked Linux for the tile state)
//   EmuTiles  an exact C emulation, so the AMX kernels' code runs (and is tested) on any CPU
// A tile t is rows[t] rows of colsb[t] bytes (at most 16 x 64, palette 1). The semantics, as
// Intel's SDM states them:
//   load<t>(p, stride)   row r (r < rows) = colsb bytes at p + r stride; the rest of the tile 0
//   store<t>(p, stride)  rows r < rows, colsb bytes each, to p + r stride
//   zero<t>()            every byte 0
//   dp<SA, SB, C, A, B>  for each row m < rows[C], column n < colsb[C] / 4 (int32):
//                          C[m][n] += sum over k < colsb[A] / 4, i < 4 of
//                                     A[m][4k + i] * B[k][4n + i]
//                        A's bytes signed if SA, else unsigned; B's if SB; the sum in int32,
//                        wrapping (the kernels keep their sums far below 2^31: exact); the
//                        rows and bytes of C past its shape 0
// The kernels call config() once a thread before their tiles and release() after.
#pragma once
#include <sys/syscall.h>
#include <unistd.h>
#include <cpuid.h>

#include <cstdint>
#include <cstring>

namespace {

// ldtilecfg's 64-byte operand
struct TileConfig {
    uint8_t palette = 1;  // 16 rows x 64 bytes a tile, 8 tiles
    uint8_t start_row = 0;
    uint8_t reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
};
static_assert(sizeof(TileConfig) == 64, "ldtilecfg reads 64 bytes");

// Whether this CPU has AMX-TILE and AMX-INT8 and Linux gave this process the tile state
// (arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA): without it the first tile instruction
// is a SIGILL). Asked once a process.
inline bool amx_usable() {
    static const bool usable = [] {
        unsigned a = 0, b = 0, c = 0, d = 0;
        if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
        if (!((d >> 24) & 1u) || !((d >> 25) & 1u)) return false;  // AMX-TILE, AMX-INT8
        constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
        return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    }();
    return usable;
}

// The instructions (AT&T operand order: the sources first, the destination last)
struct AmxTiles {
    void config(const TileConfig& c) { asm volatile("ldtilecfg %0" ::"m"(c)); }
    void release() { asm volatile("tilerelease" ::); }
    template <int T>
    void zero() {
        asm volatile("tilezero %%tmm%c0" ::"i"(T));
    }
    template <int T>
    void load(const void* p, int64_t stride) {
        asm volatile("tileloadd (%0,%1,1), %%tmm%c2" ::"r"(p), "r"(stride), "i"(T) : "memory");
    }
    template <int T>
    void store(void* p, int64_t stride) {
        asm volatile("tilestored %%tmm%c2, (%0,%1,1)" ::"r"(p), "r"(stride), "i"(T) : "memory");
    }
    template <bool SA, bool SB, int C, int A, int B>
    void dp() {
        if constexpr (SA && SB) asm volatile("tdpbssd %%tmm%c0, %%tmm%c1, %%tmm%c2" ::"i"(B), "i"(A), "i"(C));
        else if constexpr (SA) asm volatile("tdpbsud %%tmm%c0, %%tmm%c1, %%tmm%c2" ::"i"(B), "i"(A), "i"(C));
        else if constexpr (SB) asm volatile("tdpbusd %%tmm%c0, %%tmm%c1, %%tmm%c2" ::"i"(B), "i"(A), "i"(C));
        else asm volatile("tdpbuud %%tmm%c0, %%tmm%c1, %%tmm%c2" ::"i"(B), "i"(A), "i"(C));
    }
};

// The emulation: eight tiles of 16 x 64 bytes in memory, the same results bit for bit
struct EmuTiles {
    TileConfig cfg;
    alignas(64) uint8_t t[8][16][64];

    void config(const TileConfig& c) {
        cfg = c;
        std::memset(t, 0, sizeof t);
    }
    void release() { std::memset(t, 0, sizeof t); }
    template <int T>
    void zero() {
        std::memset(t[T], 0, sizeof t[T]);
    }
    template <int T>
    void load(const void* p, int64_t stride) {
        std::memset(t[T], 0, sizeof t[T]);
        for (int r = 0; r < cfg.rows[T]; ++r)
            std::memcpy(t[T][r], static_cast<const uint8_t*>(p) + r * stride, cfg.colsb[T]);
    }
    template <int T>
    void store(void* p, int64_t stride) {
        for (int r = 0; r < cfg.rows[T]; ++r)
            std::memcpy(static_cast<uint8_t*>(p) + r * stride, t[T][r], cfg.colsb[T]);
    }
    template <bool SA, bool SB, int C, int A, int B>
    void dp() {
        for (int m = 0; m < cfg.rows[C]; ++m)
            for (int n = 0; n < cfg.colsb[C] / 4; ++n) {
                uint32_t acc;  // int32 arithmetic, wrapping as the instruction's
                std::memcpy(&acc, t[C][m] + 4 * n, 4);
                for (int k = 0; k < cfg.colsb[A] / 4; ++k)
                    for (int i = 0; i < 4; ++i) {
                        const uint8_t a = t[A][m][4 * k + i], b = t[B][k][4 * n + i];
                        const int32_t av = SA ? static_cast<int8_t>(a) : a, bv = SB ? static_cast<int8_t>(b) : b;
                        acc += static_cast<uint32_t>(av * bv);
                    }
                std::memcpy(t[C][m] + 4 * n, &acc, 4);
            }
        for (int m = 0; m < 16; ++m)  // the rows and bytes past the destination's shape: 0
            std::memset(t[C][m] + (m < cfg.rows[C] ? cfg.colsb[C] : 0), 0, 64 - (m < cfg.rows[C] ? cfg.colsb[C] : 0));
    }
};

}  // namespace
