//! The quantized product on Intel AMX tiles (Sapphire Rapids and later): the integer sums of a block by
//! `tdpbsud`, sixteen tokens × sixteen rows × 32 columns in one instruction, where the VNNI kernel spends
//! 128 `vpdpbusd`. Prefill only: a decode step is bound by memory, not by arithmetic.
//!
//! The tile A is sixteen tokens' int8 activations of a block (16 rows of 32 bytes, `cols` apart in the
//! activations); the tile B is the panel's sixteen rows of that block in the dot-product layout that
//! `tdpbsud` reads (8 rows of 64 bytes, byte `4n + k` of row `j` = `u[n][4j + k]`): for 8-bit records that
//! is the record's values as stored ([`super`]'s layout), for 4-bit ones the low and high nibbles of each
//! value vector, unpacked once per work item. The 16 × 16 exact int32 sums go to memory and take the VNNI
//! kernel's fused multiply-adds in its order, so every token gets the same bits on this path as on the
//! others (and so in any batch).
//!
//! Those float steps, the same as the VNNI kernel's, are most of the time left: measured on a Xeon with
//! AMX, the tile instructions and the AVX-512 float work do not overlap (docs/performance.md), so the
//! kernel gains what the tiles save over `vpdpbusd`, about a tenth of a prefill.

use std::arch::asm;
use std::arch::x86_64::*;
use std::cell::RefCell;
use std::sync::OnceLock;

use super::x86::store_row;
use super::{QBits, Tile, AMX_TOKENS as GROUP, QBLOCK, QROWS};

/// Bytes of one block's B tile: 8 rows of 64.
const B_BYTES: usize = 8 * 64;

/// Proof that this process may run AMX tiles with int8 products: the CPU has AMX-TILE and AMX-INT8, the
/// OS saves the tile state (XCR0 bits 17 and 18) and granted this process the tile data (Linux's
/// `ARCH_REQ_XCOMP_PERM`), and the VNNI kernel runs (its AVX-512 does the tiles' float part).
/// `KURA_ISA=avx512` narrows to the VNNI kernel.
pub struct Amx(());

impl Amx {
    pub fn detect() -> Option<Amx> {
        static HAS: OnceLock<bool> = OnceLock::new();
        let has = *HAS.get_or_init(|| {
            super::Vnni::detect().is_some()
                && std::env::var("KURA_ISA").is_err()
                && cpu_and_os_have_amx()
                && granted()
        });
        has.then_some(Amx(()))
    }
}

/// Whether the CPU has AMX-TILE and AMX-INT8 and the OS enabled their state, whatever `KURA_ISA` says.
pub(crate) fn cpu_and_os_have_amx() -> bool {
    // CPUID leaf 7: EDX bit 24 AMX-TILE, bit 25 AMX-INT8; leaf 1: ECX bit 27 OSXSAVE.
    let leaf7 = __cpuid_count(7, 0);
    let osxsave = __cpuid(1).ecx >> 27 & 1 == 1;
    if leaf7.edx >> 24 & 1 == 0 || leaf7.edx >> 25 & 1 == 0 || !osxsave {
        return false;
    }
    // SAFETY: OSXSAVE says `xgetbv` runs.
    let xcr0 = unsafe { xcr0() };
    xcr0 >> 17 & 3 == 3
}

/// # Safety
/// The CPU has `xgetbv` (CPUID.1:ECX.OSXSAVE).
#[target_feature(enable = "xsave")]
unsafe fn xcr0() -> u64 {
    // SAFETY: the caller's guarantee.
    unsafe { _xgetbv(0) }
}

/// Asks Linux for this process's permission to use the tile data (XFEATURE 18); other systems are not
/// asked, and get the VNNI kernel.
fn granted() -> bool {
    #[cfg(target_os = "linux")]
    {
        const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
        const XFEATURE_XTILEDATA: libc::c_long = 18;
        // SAFETY: a request for a permission; it touches no memory of ours.
        unsafe {
            libc::syscall(
                libc::SYS_arch_prctl,
                ARCH_REQ_XCOMP_PERM,
                XFEATURE_XTILEDATA,
            ) == 0
        }
    }
    #[cfg(not(target_os = "linux"))]
    {
        false
    }
}

/// The tile configuration `ldtilecfg` reads (palette 1): `tmm0`, `tmm1` A (16 × 32 bytes); `tmm2`,
/// `tmm3` B (8 × 64); `tmm4`–`tmm7` the sums of four blocks (16 × 64 each).
#[repr(C, align(64))]
struct Config([u8; 64]);

impl Config {
    fn new() -> Config {
        let (a, b, sums) = ((GROUP as u8, QBLOCK as u16), (8, 64), (GROUP as u8, 64));
        let shapes: [(u8, u16); 8] = [a, a, b, b, sums, sums, sums, sums];
        let mut c = [0u8; 64];
        c[0] = 1;
        for (t, (rows, colsb)) in shapes.into_iter().enumerate() {
            c[16 + 2 * t..18 + 2 * t].copy_from_slice(&colsb.to_le_bytes());
            c[48 + t] = rows;
        }
        Config(c)
    }
}

/// One block's B tile, unpacked from 4-bit values.
#[repr(C, align(64))]
struct BTile([u8; B_BYTES]);

/// One block's 16 × 16 int32 sums, as `tilestored` writes them.
#[repr(C, align(64))]
struct Sums([[i32; QROWS]; GROUP]);

/// A thread's working memory: a panel's unpacked B tiles, and a last group of fewer than 16 tokens
/// padded with zeros.
#[derive(Default)]
struct Scratch {
    b: Vec<BTile>,
    a: Vec<i8>,
    ds: Vec<[f32; 2]>,
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::default();
}

/// `m` tokens (any number) × the panel's 16 rows, as [`super::tile_portable`] computes them.
///
/// # Safety
/// [`Amx::detect`] is `Some`; see [`super::tile_portable`] for `out`.
pub(super) unsafe fn tile(tile: &Tile<'_>, m: usize) {
    SCRATCH.with_borrow_mut(|s| {
        // SAFETY: the caller's guarantee.
        unsafe {
            match tile.bits {
                QBits::U4 => tile_on::<true>(tile, m, s),
                QBits::U8 => tile_on::<false>(tile, m, s),
            }
        }
    })
}

/// # Safety
/// As [`tile`].
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn tile_on<const U4: bool>(tile: &Tile<'_>, m: usize, s: &mut Scratch) {
    let (blocks, cols, rec, vb) = tile.shape::<U4>(m);
    // The B tiles: the records themselves (8-bit), or their nibbles unpacked (4-bit).
    let (b_base, b_step) = if U4 {
        s.b.resize_with(blocks, || BTile([0; B_BYTES]));
        let out = s.b.as_mut_ptr().cast::<u8>();
        let low = _mm512_set1_epi8(0x0F);
        for b in 0..blocks {
            // SAFETY: record b lies in the panel (`shape`); block b's 512 bytes lie in `s.b`.
            unsafe {
                let r = tile.panel.as_ptr().add(b * rec);
                let o = out.add(b * B_BYTES);
                for v in 0..4 {
                    let w = _mm512_loadu_si512(r.add(v * 64).cast());
                    let lo = _mm512_and_si512(w, low);
                    let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(w), low);
                    _mm512_store_si512(o.add(2 * v * 64).cast(), lo);
                    _mm512_store_si512(o.add((2 * v + 1) * 64).cast(), hi);
                }
            }
        }
        (out.cast_const(), B_BYTES)
    } else {
        (tile.panel.as_ptr(), rec)
    };
    let config = Config::new();
    // SAFETY: AMX is present and granted (the caller's guarantee); the configuration is 64 bytes.
    unsafe { asm!("ldtilecfg [{}]", in(reg) config.0.as_ptr(), options(nostack, readonly)) };
    let mut g = 0;
    while g < m {
        let n = GROUP.min(m - g);
        let (xq, xds) = if n == GROUP {
            (
                tile.xq[g * cols..].as_ptr(),
                tile.xds[g * blocks..].as_ptr(),
            )
        } else {
            // The last group, padded: rows n.. are zero and never stored.
            s.a.clear();
            s.a.extend_from_slice(&tile.xq[g * cols..(g + n) * cols]);
            s.a.resize(GROUP * cols, 0);
            s.ds.clear();
            s.ds.extend_from_slice(&tile.xds[g * blocks..(g + n) * blocks]);
            s.ds.resize(GROUP * blocks, [0.0; 2]);
            (s.a.as_ptr(), s.ds.as_ptr())
        };
        // SAFETY: 16 tokens of activations and scales at xq and xds; rows g..g+n of `out` are this tile's.
        unsafe {
            group(
                tile,
                Group {
                    xq,
                    xds,
                    b_base,
                    b_step,
                    out: tile.out.add(g * tile.ldo),
                    tokens: n,
                },
                Shape {
                    blocks,
                    cols,
                    rec,
                    vb,
                },
            )
        };
        g += n;
    }
    // SAFETY: tiles were configured above; releasing them leaves nothing for a context switch to save.
    unsafe { asm!("tilerelease", options(nostack, nomem)) };
}

/// Sixteen tokens' activations, the panel's B tiles, and where the tokens' outputs go.
struct Group {
    xq: *const i8,
    xds: *const [f32; 2],
    b_base: *const u8,
    b_step: usize,
    out: *mut f32,
    /// Tokens to store (the rest are padding).
    tokens: usize,
}

/// A panel's blocks, the activations' columns, and its record's bytes and value bytes
/// ([`Tile::shape`]).
struct Shape {
    blocks: usize,
    cols: usize,
    rec: usize,
    vb: usize,
}

/// Blocks multiplied on the tiles before their sums are stored together and scaled (the fastest of the
/// orders measured).
const BATCH: usize = 4;

/// Four blocks' sums (blocks `b`..`b + 4`) into `out`: each block's A and B tiles loaded
/// (`tmm0`/`tmm2` for even blocks, `tmm1`/`tmm3` for odd ones) and multiplied into `tmm4`–`tmm7`, then
/// the four stored.
///
/// # Safety
/// The tiles are configured ([`Config`]); `a` holds 16 rows of 4 × 32 bytes `lda` apart, `bt` four
/// blocks' B tiles `b_step` apart.
#[inline(always)]
unsafe fn sums4(a: *const i8, lda: usize, bt: *const u8, b_step: usize, out: &mut [Sums; BATCH]) {
    // SAFETY: the caller's guarantee; each `out` is 16 rows of 64 bytes.
    unsafe {
        asm!(
            "tileloadd tmm0, [{a0} + {lda} * 1]",
            "tileloadd tmm2, [{b0} + {ldb} * 1]",
            "tilezero tmm4",
            "tdpbsud tmm4, tmm0, tmm2",
            "tileloadd tmm1, [{a0} + {lda} * 1 + 32]",
            "tileloadd tmm3, [{b1} + {ldb} * 1]",
            "tilezero tmm5",
            "tdpbsud tmm5, tmm1, tmm3",
            "tileloadd tmm0, [{a0} + {lda} * 1 + 64]",
            "tileloadd tmm2, [{b2} + {ldb} * 1]",
            "tilezero tmm6",
            "tdpbsud tmm6, tmm0, tmm2",
            "tileloadd tmm1, [{a0} + {lda} * 1 + 96]",
            "tileloadd tmm3, [{b3} + {ldb} * 1]",
            "tilezero tmm7",
            "tdpbsud tmm7, tmm1, tmm3",
            "tilestored [{c0} + {ldb} * 1], tmm4",
            "tilestored [{c1} + {ldb} * 1], tmm5",
            "tilestored [{c2} + {ldb} * 1], tmm6",
            "tilestored [{c3} + {ldb} * 1], tmm7",
            a0 = in(reg) a, lda = in(reg) lda,
            b0 = in(reg) bt, b1 = in(reg) bt.add(b_step), b2 = in(reg) bt.add(2 * b_step),
            b3 = in(reg) bt.add(3 * b_step), ldb = in(reg) 64usize,
            c0 = in(reg) out[0].0.as_mut_ptr(), c1 = in(reg) out[1].0.as_mut_ptr(),
            c2 = in(reg) out[2].0.as_mut_ptr(), c3 = in(reg) out[3].0.as_mut_ptr(),
            options(nostack),
        )
    }
}

/// One block's sums into `out` (`tmm0`, `tmm2`, `tmm4`).
///
/// # Safety
/// As [`sums4`], for one block.
#[inline(always)]
unsafe fn sums1(a: *const i8, lda: usize, bt: *const u8, out: &mut Sums) {
    // SAFETY: the caller's guarantee; `out` is 16 rows of 64 bytes.
    unsafe {
        asm!(
            "tileloadd tmm0, [{a} + {lda} * 1]",
            "tileloadd tmm2, [{b} + {ldb} * 1]",
            "tilezero tmm4",
            "tdpbsud tmm4, tmm0, tmm2",
            "tilestored [{c} + {ldb} * 1], tmm4",
            a = in(reg) a, lda = in(reg) lda, b = in(reg) bt, ldb = in(reg) 64usize,
            c = in(reg) out.0.as_mut_ptr(),
            options(nostack),
        )
    }
}

/// One group of sixteen tokens over every block: the offsets (`min · sx`) first, then the products,
/// [`BATCH`] blocks at a time multiplied, stored, then scaled in block order.
///
/// # Safety
/// See [`tile_on`]; `g` points at sixteen tokens and the panel's B tiles.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn group(tile: &Tile<'_>, g: Group, shape: Shape) {
    let Shape {
        blocks,
        cols,
        rec,
        vb,
    } = shape;
    let p = tile.panel.as_ptr();
    // SAFETY: b < blocks keeps every record, activation and scale read inside the tile (`shape`) or
    // the padded group; the sums buffers are this function's.
    unsafe {
        let mut offsets = [_mm512_setzero_ps(); GROUP];
        for b in 0..blocks {
            let min = _mm512_cvtph_ps(_mm256_loadu_si256(p.add(b * rec + vb + 2 * QROWS).cast()));
            for (i, o) in offsets.iter_mut().enumerate() {
                let [_, sx] = *g.xds.add(i * blocks + b);
                *o = _mm512_fmadd_ps(min, _mm512_set1_ps(sx), *o);
            }
        }
        let mut products = [_mm512_setzero_ps(); GROUP];
        let mut buf: [Sums; BATCH] = std::array::from_fn(|_| Sums([[0; QROWS]; GROUP]));
        let scale = |b: usize, s: &Sums, products: &mut [__m512; GROUP]| {
            let sc = _mm512_cvtph_ps(_mm256_loadu_si256(p.add(b * rec + vb).cast()));
            for (i, a) in products.iter_mut().enumerate() {
                let [dx, _] = *g.xds.add(i * blocks + b);
                let f = _mm512_mul_ps(sc, _mm512_set1_ps(dx));
                let total = _mm512_load_si512(s.0[i].as_ptr().cast());
                *a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total), f, *a);
            }
        };
        let mut b = 0;
        while b < blocks {
            let (a, bt) = (g.xq.add(b * QBLOCK), g.b_base.add(b * g.b_step));
            if b + BATCH <= blocks {
                sums4(a, cols, bt, g.b_step, &mut buf);
                for (k, s) in buf.iter().enumerate() {
                    scale(b + k, s, &mut products);
                }
                b += BATCH;
            } else {
                sums1(a, cols, bt, &mut buf[0]);
                scale(b, &buf[0], &mut products);
                b += 1;
            }
        }
        for i in 0..g.tokens {
            let a = _mm512_add_ps(products[i], offsets[i]);
            store_row(g.out.add(i * tile.ldo), tile.valid, tile.add, a);
        }
    }
}
