//! Scenarios of the CUDA executor that the GPU tests (`gpu.rs`, on a device) and the emulated ones
//! (`emulated_executor.rs`, on the stand-in driver of `emu/`) both run, each on its own models:
//! blocks moving as the CPU pool lays them out, and the host tier's loads and stores through pinned
//! memory, whole-block and ordered layer by layer.

#![allow(dead_code)]

use std::time::{Duration, Instant};

use kura_cuda::executor::LOAD_COPY_MIN_BYTES;
use kura_cuda::CudaExecutor;
use kura_engine::{sampling, ExecError, Executor, Row, SeqInput, Want};
use kura_kv::codec::KvDtype;
use kura_model::{Model, SeqBatchItem};

/// `‖a − b‖ / ‖b‖` (every `a` finite).
pub fn rel(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    let (mut d2, mut b2) = (0f64, 0f64);
    for (x, y) in a.iter().zip(b) {
        assert!(x.is_finite(), "non-finite value {x}");
        let d = f64::from(*x) - f64::from(*y);
        d2 += d * d;
        b2 += f64::from(*y) * f64::from(*y);
    }
    (d2 / b2).sqrt()
}

pub fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

/// The CPU runtime's last-token logits of `prompt` (bf16 weights as stored, `dtype` KV).
pub fn cpu_logits(model: &Model, prompt: &[u32], dtype: KvDtype) -> Vec<f32> {
    let bs = 16;
    let layout = model.kv_layout(dtype, bs).unwrap();
    let blocks = prompt.len().div_ceil(bs);
    let mut kv = model.kv_storage(&layout, blocks).unwrap();
    let table: Vec<u32> = (0..blocks as u32).collect();
    model
        .forward(&[SeqBatchItem::new(prompt, 0, &table)], &mut kv)
        .unwrap()
        .data
}

/// Waits (at most `limit`) until `n` loads are reported.
pub fn reported(gpu: &mut CudaExecutor, n: usize, limit: Duration) -> Vec<(u32, Duration)> {
    let mut done = Vec::new();
    let deadline = Instant::now() + limit;
    while done.len() < n {
        assert!(Instant::now() < deadline, "loads never reported: {done:?}");
        gpu.imports_done(Duration::from_millis(10), &mut done)
            .unwrap();
    }
    done
}

/// `gpu` (bf16 KV, blocks of `bs`, 8 blocks) computes `p` (at most 6 blocks); its block 0 against the
/// CPU runtime's pool of the same tokens (the same layout; layer 0 within bf16 rounding), export →
/// import the same bytes, copy-on-write of 5 slots, and blocks or slots out of range refused.
pub fn blocks_move_as_the_cpu_pool_lays_them_out(
    gpu: &mut CudaExecutor,
    cpu: &Model,
    p: &[u32],
    bs: usize,
) {
    let blocks = p.len().div_ceil(bs);
    let table: Vec<u32> = (0..blocks as u32).collect();
    gpu.forward_logits(&[SeqInput::new(p, 0, &table)]).unwrap();
    let layout = cpu.kv_layout(KvDtype::Bf16, bs).unwrap();
    let mut kv = cpu.kv_storage(&layout, blocks).unwrap();
    cpu.forward(&[SeqBatchItem::new(p, 0, &table)], &mut kv)
        .unwrap();
    let bb = layout.bytes_per_block() as usize;
    assert_eq!(gpu.block_bytes(), bb);
    let (mut g, mut c) = (vec![0u8; bb], vec![0u8; bb]);
    gpu.export_block(0, &mut g).unwrap();
    kv.export_block(0, &mut c).unwrap();
    let as_f32 = |b: &[u8]| -> Vec<f32> {
        b.chunks_exact(2)
            .map(|x| half::bf16::from_le_bytes([x[0], x[1]]).to_f32())
            .collect()
    };
    let (gv, cv) = (as_f32(&g), as_f32(&c));
    // Per layer: K then V, each kv_heads × block × head_dim values.
    let head_dim = cpu.config().head_dim();
    let run = cpu.config().num_kv_heads() * bs * head_dim;
    let per_layer: Vec<String> = gv
        .chunks_exact(run)
        .zip(cv.chunks_exact(run))
        .map(|(a, b)| format!("{:.1e}", rel(a, b)))
        .collect();
    println!(
        "block 0 against the CPU pool's: rel {:.2e}; per layer (K, V, K, V, …): {per_layer:?}",
        rel(&gv, &cv)
    );
    // Layer 0's K and V come from the embeddings through one norm and one product: bf16 rounding only.
    let (k0, v0) = (
        rel(&gv[..run], &cv[..run]),
        rel(&gv[run..2 * run], &cv[run..2 * run]),
    );
    assert!(k0 <= 5e-3 && v0 <= 5e-3, "layer 0: K {k0:.2e}, V {v0:.2e}");
    gpu.import_block(5, &g).unwrap();
    let mut back = vec![0u8; bb];
    gpu.export_block(5, &mut back).unwrap();
    assert_eq!(back, g);
    // Copy-on-write of 5 slots: those slots copied, the others left as they were.
    gpu.import_block(6, &vec![0u8; bb]).unwrap();
    gpu.copy_block_prefix(0, 6, 5).unwrap();
    gpu.export_block(6, &mut back).unwrap();
    let row = head_dim * 2;
    for (run, (a, b)) in back
        .chunks_exact(bs * row)
        .zip(g.chunks_exact(bs * row))
        .enumerate()
    {
        assert_eq!(&a[..5 * row], &b[..5 * row], "run {run}: copied slots");
        assert!(
            a[5 * row..].iter().all(|x| *x == 0),
            "run {run}: slots past the copy"
        );
    }
    // Out of range, or a buffer of another size: errors, not writes.
    assert!(gpu.try_export_block(8, &mut back).is_err());
    assert!(gpu.try_import_block(8, &back).is_err());
    assert!(gpu.try_copy_block_prefix(0, 8, 1).is_err());
    assert!(gpu.try_copy_block_prefix(0, 1, bs + 1).is_err());
    assert!(gpu.try_import_block(1, &back[1..]).is_err());
}

/// Whole-block loads into `gpu` (blocks of `bs`, 8 blocks) from a pinned host tier, reported once each
/// in issue order with the right bytes; stores out of it, fenced, each seeing the block as it was when
/// issued; a load of a slot following the store into it. `p` fills blocks 0 and 1 at least.
pub fn whole_block_loads_and_stores(mut gpu: CudaExecutor, p: &[u32], bs: usize, limit: Duration) {
    // Whole-block loads, which the engine waits for (ordered ones: `ordered_loads`).
    assert!(gpu.set_ordered_imports(false));
    let blocks = p.len().div_ceil(bs);
    assert!((2..=6).contains(&blocks), "the prompt fits blocks 0..6");
    let table: Vec<u32> = (0..blocks as u32).collect();
    gpu.forward_logits(&[SeqInput::new(p, 0, &table)]).unwrap();
    let bb = gpu.block_bytes();
    // A host tier of two slots holding blocks 0 and 1, as the engine's arena would.
    let mut region = vec![0u8; 2 * bb];
    // Dropped before the region, also when an assertion fails (a parameter is dropped last).
    let mut gpu = gpu;
    gpu.export_block(0, &mut region[..bb]).unwrap();
    gpu.export_block(1, &mut region[bb..]).unwrap();
    // Pageable bytes are not started: the engine then imports them synchronously.
    let pageable = region[..bb].to_vec();
    assert!(!gpu.start_import(7, &pageable).unwrap());
    assert!(gpu.register_host_region(&mut region));
    assert!(gpu.start_import(6, &region[..bb]).unwrap());
    assert!(gpu.start_import(7, &region[bb..]).unwrap());
    let mut done = reported(&mut gpu, 2, limit);
    let order: Vec<u32> = done.iter().map(|d| d.0).collect();
    assert_eq!(order, [6, 7], "reported once each, in issue order");
    println!("async block copies of {bb} bytes: {done:?}");
    let mut back = vec![0u8; bb];
    gpu.export_block(6, &mut back).unwrap();
    assert_eq!(back, region[..bb]);
    gpu.export_block(7, &mut back).unwrap();
    assert_eq!(back, region[bb..]);
    // Nothing left to report.
    gpu.imports_done(Duration::ZERO, &mut done).unwrap();
    assert_eq!(done.len(), 2);
    // Stores into the host tier. Blocks 0 and 1 hold different tokens; block 7 now holds block 1's bytes.
    let (mut want0, mut want1) = (vec![0u8; bb], vec![0u8; bb]);
    gpu.export_block(0, &mut want0).unwrap();
    gpu.export_block(1, &mut want1).unwrap();
    assert_ne!(want0, want1);
    region.fill(0);
    // The fence alone waits for a store (no call on the device stream between).
    assert!(gpu.start_export(0, &mut region[..bb]).unwrap());
    gpu.exports_fence().unwrap();
    assert_eq!(&region[..bb], &want0[..], "a store, fenced");
    // A write of the block issued right after its store waits for the store on the device.
    assert!(gpu.start_export(1, &mut region[bb..]).unwrap());
    gpu.copy_block_prefix(0, 1, bs).unwrap();
    gpu.exports_fence().unwrap();
    assert_eq!(
        &region[bb..],
        &want1[..],
        "the store, not the copy issued after it"
    );
    gpu.export_block(1, &mut back).unwrap();
    assert_eq!(back, want0, "the copy issued after the store");
    // A load of a slot follows the store into it (the load stream waits for it).
    assert!(gpu.start_export(7, &mut region[..bb]).unwrap());
    assert!(gpu.start_import(5, &region[..bb]).unwrap());
    let done = reported(&mut gpu, 1, limit);
    assert_eq!(done[0].0, 5);
    gpu.export_block(5, &mut back).unwrap();
    assert_eq!(
        back, want1,
        "block 5 loaded from the slot block 7 was stored into"
    );
    gpu.exports_fence().unwrap();
    // Two stores and one fence: the fence waits for the later store too (block 6 holds block 0's
    // bytes, block 7 block 1's).
    region.fill(0);
    assert!(gpu.start_export(6, &mut region[..bb]).unwrap());
    assert!(gpu.start_export(7, &mut region[bb..]).unwrap());
    gpu.exports_fence().unwrap();
    assert_eq!(&region[..bb], &want0[..], "the first of two stores");
    assert_eq!(
        &region[bb..],
        &want1[..],
        "the second of two stores, fenced once"
    );
    // Two stores, then a write of the later one's block: the write waits for both.
    region.fill(0);
    assert!(gpu.start_export(6, &mut region[..bb]).unwrap());
    assert!(gpu.start_export(7, &mut region[bb..]).unwrap());
    gpu.copy_block_prefix(6, 7, bs).unwrap();
    gpu.exports_fence().unwrap();
    assert_eq!(
        &region[bb..],
        &want1[..],
        "the second of two stores, not the copy issued after both"
    );
    // The executor (which unpins the region) goes before the region.
    drop(gpu);
}

/// `gpu`'s block `b`, as `export_block` writes it.
fn exported(gpu: &CudaExecutor, b: u32) -> Vec<u8> {
    let mut v = vec![0u8; gpu.block_bytes()];
    gpu.export_block(b, &mut v).unwrap();
    v
}

/// Computes `p`, cut to fill blocks 0 and 1 and part of 2 (of `bs`), into those blocks: the prompt
/// computed and the three blocks' bytes, all different.
fn three_blocks<'p>(gpu: &mut CudaExecutor, p: &'p [u32], bs: usize) -> (&'p [u32], Vec<Vec<u8>>) {
    let p = &p[..p.len().min(3 * bs - 1)];
    assert!(
        p.len() > 2 * bs,
        "the prompt fills blocks 0 and 1 and part of 2"
    );
    gpu.forward_logits(&[SeqInput::new(p, 0, &[0, 1, 2])])
        .unwrap();
    let want: Vec<Vec<u8>> = (0..3).map(|b| exported(gpu, b)).collect();
    assert!(want[0] != want[1] && want[1] != want[2] && want[0] != want[2]);
    (p, want)
}

/// Host-tier stores waited for only by the work that writes their blocks (`gpu`: blocks of `bs`, 8
/// blocks; `p` fills blocks 0 and 1 and part of 2 at least): a step that writes none of the stored
/// blocks leaves the three stores pending, a block copy into the second stored block waits for the first
/// two stores and not the third, a step into the third waits for it, and each store keeps the bytes its
/// block had when it was issued. With `lazy` (the stand-in driver, which runs a stream's work only when
/// something waits for it) the host slots also show which stores have run: none after the step, the
/// first two after the copy.
pub fn stores_wait_only_for_their_blocks_writers(
    mut gpu: CudaExecutor,
    p: &[u32],
    bs: usize,
    lazy: bool,
) {
    let (p, want) = three_blocks(&mut gpu, p, bs);
    let bb = gpu.block_bytes();
    let export = exported;
    let mut region = vec![0u8; 3 * bb];
    // Dropped before the region, also when an assertion fails (a parameter is dropped last).
    let mut gpu = gpu;
    assert!(gpu.register_host_region(&mut region));
    for (b, slot) in region.chunks_exact_mut(bb).enumerate() {
        assert!(gpu.start_export(b as u32, slot).unwrap());
    }
    assert_eq!(gpu.stores_unordered(), 3);
    // Another sequence's step, in blocks 5 and 6: no store reads them.
    gpu.forward_logits(&[SeqInput::new(&p[..bs + 1], 0, &[5, 6])])
        .unwrap();
    assert_eq!(
        gpu.stores_unordered(),
        3,
        "a step that writes no stored block waits for no store"
    );
    if lazy {
        assert!(
            region.iter().all(|x| *x == 0),
            "no store ran: nothing waited for one"
        );
    }
    // A copy into block 1 (stored second): after the stores of blocks 0 and 1, which its stream runs
    // in order, and not after the store of block 2.
    gpu.copy_block_prefix(5, 1, bs).unwrap();
    assert_eq!(
        gpu.stores_unordered(),
        1,
        "a copy into the second stored block waits for the first two stores"
    );
    // The host waits for the device stream (an export of another block does): the copy's wait has run.
    export(&gpu, 7);
    if lazy {
        assert!(region[..bb] == want[0][..], "the first store ran");
        assert!(region[bb..2 * bb] == want[1][..], "the second store ran");
        assert!(
            region[2 * bb..].iter().all(|x| *x == 0),
            "the third store did not run: the copy does not write its block"
        );
    }
    // A decode step into block 2 (its next free slot) waits for the third.
    gpu.forward_logits(&[SeqInput::new(&p[..1], p.len(), &[0, 1, 2])])
        .unwrap();
    assert_eq!(gpu.stores_unordered(), 0);
    gpu.exports_fence().unwrap();
    for (b, (got, want)) in region.chunks_exact(bb).zip(&want).enumerate() {
        assert_eq!(
            got,
            &want[..],
            "block {b}'s store holds the bytes it had when the store was issued"
        );
    }
    let copied = export(&gpu, 5);
    assert_ne!(copied, want[1]);
    assert!(export(&gpu, 1) == copied, "the copy issued after the store");
    assert_ne!(
        export(&gpu, 2),
        want[2],
        "the step wrote block 2 after its store"
    );
    // A store the device waits for before a copy into its block, then the host's fence with nothing
    // run between: the fence still waits for the store itself (the device's wait orders the device's
    // work, not the host's read).
    region[..bb].fill(0);
    assert!(gpu.start_export(0, &mut region[..bb]).unwrap());
    gpu.copy_block_prefix(5, 0, bs).unwrap();
    assert_eq!(gpu.stores_unordered(), 0);
    gpu.exports_fence().unwrap();
    assert!(
        region[..bb] == want[0][..],
        "the fence waits for a store the device waited for"
    );
    assert!(export(&gpu, 0) == copied, "the copy after the store");
    // A fence of one slot: its store lands (with those before it on the stream); a later store into
    // another slot goes on.
    let (now0, now2) = (export(&gpu, 0), export(&gpu, 2));
    assert!(now0 != now2);
    region.fill(0);
    assert!(gpu.start_export(0, &mut region[..bb]).unwrap());
    assert!(gpu.start_export(2, &mut region[bb..2 * bb]).unwrap());
    gpu.exports_fence_slot(&region[..bb]).unwrap();
    assert!(region[..bb] == now0[..], "the fenced slot's store landed");
    if lazy {
        assert!(
            region[bb..2 * bb].iter().all(|x| *x == 0),
            "the later store into another slot was not waited for"
        );
    }
    gpu.exports_fence().unwrap();
    assert!(region[bb..2 * bb] == now2[..], "the later store, fenced");
    // A load of a slot queued behind a store into it, and the loaded block exported before the load
    // is issued: the export reads the slot once the store has landed.
    if gpu.set_ordered_imports(true) {
        region.fill(0);
        assert!(gpu.start_export(2, &mut region[..bb]).unwrap());
        assert!(gpu.start_import(6, &region[..bb]).unwrap());
        assert!(
            export(&gpu, 6) == now2,
            "the block a queued load fills, as the store into its slot left it"
        );
        gpu.exports_fence().unwrap();
    }
    // The executor (which unpins the region) goes before the region.
    drop(gpu);
}

/// Loads and stores on streams of their own (`gpu`: blocks of `bs`, 8 blocks; `p` fills blocks 0 and 1
/// and part of 2 at least): a load does not wait for a store it has nothing to do with, a load into a
/// block waits for the store of the block's old bytes, a store of a block waits for the load into it
/// (whole-block and, where the driver has them, ordered loads). With `lazy` (the stand-in driver, which
/// runs a stream's work only when something waits for it) the host slots also show that a load
/// reported landed left an unrelated store unrun.
pub fn loads_and_stores_go_both_ways_at_once(
    mut gpu: CudaExecutor,
    p: &[u32],
    bs: usize,
    limit: Duration,
    lazy: bool,
) {
    let (p, want) = three_blocks(&mut gpu, p, bs);
    assert!(gpu.set_ordered_imports(false));
    let bb = gpu.block_bytes();
    let export = exported;
    let mut region = vec![0u8; 4 * bb];
    // Dropped before the region, also when an assertion fails (a parameter is dropped last).
    let mut gpu = gpu;
    assert!(gpu.register_host_region(&mut region));
    region[3 * bb..].copy_from_slice(&want[2]);
    // A store of block 0, then a load of slot 3 into block 5: reported landed before the store ran.
    let (slot0, rest) = region.split_at_mut(bb);
    assert!(gpu.start_export(0, slot0).unwrap());
    assert!(gpu.start_import(5, &rest[2 * bb..]).unwrap());
    let done = reported(&mut gpu, 1, limit);
    assert_eq!(done[0].0, 5);
    if lazy {
        assert!(
            region[..bb].iter().all(|x| *x == 0),
            "the load waited for a store of another block into another slot"
        );
    }
    assert!(export(&gpu, 5) == want[2], "block 5 loaded");
    gpu.exports_fence().unwrap();
    assert!(region[..bb] == want[0][..], "the store, fenced");
    // A store of block 1, then a load into block 1: the store keeps the bytes the load overwrites.
    region[bb..2 * bb].fill(0);
    let (head, tail) = region.split_at_mut(2 * bb);
    assert!(gpu.start_export(1, &mut head[bb..]).unwrap());
    assert!(gpu.start_import(1, &tail[bb..]).unwrap());
    reported(&mut gpu, 1, limit);
    assert!(export(&gpu, 1) == want[2], "block 1 loaded");
    gpu.exports_fence().unwrap();
    assert!(
        region[bb..2 * bb] == want[1][..],
        "the store of block 1 holds its bytes from before the load into it"
    );
    // A load into block 6, then a store of block 6 at once: the store holds the loaded bytes.
    region[..bb].fill(0);
    let (slot0, rest) = region.split_at_mut(bb);
    assert!(gpu.start_import(6, &rest[2 * bb..]).unwrap());
    assert!(gpu.start_export(6, slot0).unwrap());
    gpu.exports_fence().unwrap();
    assert!(
        region[..bb] == want[2][..],
        "the store of a block follows the load into it"
    );
    reported(&mut gpu, 1, limit);
    // The same with ordered loads (queued, issued before the next use of the device).
    if gpu.set_ordered_imports(true) {
        region[3 * bb..].copy_from_slice(&want[0]);
        region[2 * bb..3 * bb].fill(0);
        let (head, tail) = region.split_at_mut(3 * bb);
        assert!(gpu.start_export(2, &mut head[2 * bb..]).unwrap());
        assert!(gpu.start_import(2, tail).unwrap());
        // Another sequence's step issues the load (without waiting for it: it reads blocks 5 and 6).
        gpu.forward_logits(&[SeqInput::new(&p[..bs + 1], 0, &[5, 6])])
            .unwrap();
        // The load first (an export of its block waits for it), then the store.
        assert!(export(&gpu, 2) == want[0], "block 2 loaded, ordered");
        gpu.exports_fence().unwrap();
        assert!(
            region[2 * bb..3 * bb] == want[2][..],
            "the store of block 2 holds its bytes from before the ordered load into it"
        );
        region[..bb].fill(0);
        let (slot0, rest) = region.split_at_mut(bb);
        assert!(gpu.start_import(7, &rest[2 * bb..]).unwrap());
        assert!(gpu.start_export(7, slot0).unwrap());
        gpu.exports_fence().unwrap();
        assert!(
            region[..bb] == want[0][..],
            "the store of a block follows the ordered load into it"
        );
        let mut done = Vec::new();
        gpu.imports_done(limit, &mut done).unwrap();
    }
    // The executor (which unpins the region) goes before the region.
    drop(gpu);
}

/// The byte the blocks that loads go to are filled with first.
pub const JUNK: u8 = 0x3f;

/// Host-tier loads of a prefix staged on `gpu` (bf16 KV, blocks of `bs`, `p` computed into blocks
/// `0..` and loaded into `there`): the prefix's `nb` blocks computed in place and the step of `new`
/// tokens after it over them (its logits, returned), those blocks' bytes in a pinned host tier
/// (returned: it must outlive `gpu`), the blocks of `there` filled with [`JUNK`], and a load of each
/// block started, not issued.
pub fn start_prefix_loads(
    gpu: &mut CudaExecutor,
    p: &[u32],
    bs: usize,
    nb: usize,
    new: usize,
    there: &[u32],
) -> (Vec<f32>, Vec<u8>) {
    let here: Vec<u32> = (0..p.len().div_ceil(bs) as u32).collect();
    let cached = nb * bs;
    let step = &p[cached..cached + new];
    gpu.forward_logits(&[SeqInput::new(&p[..cached], 0, &here)])
        .unwrap();
    let want = gpu
        .forward_logits(&[SeqInput::new(step, cached, &here)])
        .unwrap();
    let bb = gpu.block_bytes();
    let mut region = vec![0u8; nb * bb];
    for b in 0..nb {
        gpu.export_block(b as u32, &mut region[b * bb..(b + 1) * bb])
            .unwrap();
    }
    assert!(gpu.register_host_region(&mut region));
    let junk = vec![JUNK; bb];
    for &b in there {
        gpu.import_block(b, &junk).unwrap();
    }
    for b in 0..nb {
        assert!(gpu
            .start_import(there[b], &region[b * bb..(b + 1) * bb])
            .unwrap());
    }
    (want, region)
}

/// Host-tier loads ordered layer by layer (`make(num_blocks)`: an executor of bf16 KV in blocks of
/// `bs`), read by the next step bit for bit: the step over loaded blocks gives the bits of the same
/// step over blocks computed in place, with `pad` more loads of other bytes queued behind (a step that
/// did not wait for each layer would read junk). `p` has at least 289 tokens.
pub fn ordered_loads(
    make: &mut dyn FnMut(usize) -> CudaExecutor,
    p: &[u32],
    bs: usize,
    pad: u32,
    limit: Duration,
) {
    let total = p.len().div_ceil(bs);
    // Blocks 0..total hold the prompt computed in place; the loads go to total..2·total.
    let pad_at = 2 * total as u32;
    let num_blocks = 2 * total + pad as usize;
    let pad_loads = |gpu: &mut CudaExecutor, slot: &[u8]| {
        for b in pad_at..pad_at + pad {
            assert!(gpu.start_import(b, slot).unwrap());
        }
    };
    let there: Vec<u32> = (total as u32..2 * total as u32).collect();
    // (blocks of cached prefix, new tokens after it, the prefill kernel from): the split kernel launch
    // by launch, the prefill kernel, and a decode step (a captured graph). A region is pinned once, so
    // each case has an executor of its own.
    // Each with copies of its own size: a layer a copy (the step waits for each layer's copies),
    // groups of layers up to the default minimum, and every layer of a block in one copy.
    for (nb, new, prefill_min, copy_min) in [
        (15, 44, usize::MAX, 0),
        (12, 108, 64, LOAD_COPY_MIN_BYTES),
        (18, 1, usize::MAX, usize::MAX),
    ] {
        let mut gpu = make(num_blocks);
        assert!(
            gpu.set_ordered_imports(true),
            "this driver has batched copies (cuMemcpyBatchAsync_v2, CUDA 13)"
        );
        assert!(gpu.imports_ordered());
        gpu.set_prefill_min(prefill_min);
        let bb = gpu.block_bytes();
        let copy_min = copy_min.min(bb);
        gpu.set_load_copy_min(copy_min);
        let cached = nb * bs;
        let step = &p[cached..cached + new];
        let (want, region) = start_prefix_loads(&mut gpu, p, bs, nb, new, &there);
        let junk = vec![JUNK; bb];
        // The step issued right after the loads: it waits for each layer on the device.
        pad_loads(&mut gpu, &region[..bb]);
        let got = gpu
            .forward_logits(&[SeqInput::new(step, cached, &there)])
            .unwrap();
        assert!(
            same_bits(&got, &want),
            "{new} new tokens over {cached} loaded: {:.2e} from the bits of the same step over blocks \
             computed in place",
            rel(&got, &want)
        );
        // Each load reported once, in order, with its time.
        let loads = nb + pad as usize;
        let mut done = reported(&mut gpu, loads, limit);
        let order: Vec<u32> = done.iter().map(|d| d.0).collect();
        assert_eq!(order[..nb], there[..nb]);
        let copy: Duration = done.iter().map(|d| d.1).sum();
        println!(
            "{new} new tokens over {cached} loaded: the bits of the step in place; ordered loads of \
             {loads} blocks of {bb} bytes, copies of at least {copy_min} bytes: {:.3} ms, {:.1} GB/s",
            copy.as_secs_f64() * 1e3,
            (loads * bb) as f64 / copy.as_secs_f64().max(1e-9) / 1e9
        );
        gpu.imports_done(Duration::ZERO, &mut done).unwrap();
        assert_eq!(done.len(), loads, "nothing reported twice");
        // An export of a block whose load is only queued, or issued and still copying, and a block
        // copy of one issued, see the loaded bytes.
        let mut back = vec![0u8; bb];
        gpu.import_block(there[0], &junk).unwrap();
        assert!(gpu.start_import(there[0], &region[..bb]).unwrap());
        pad_loads(&mut gpu, &region[bb..2 * bb]);
        gpu.export_block(there[0], &mut back).unwrap();
        assert_eq!(
            back,
            region[..bb],
            "an export of a block whose load is queued"
        );
        reported(&mut gpu, 1 + pad as usize, limit);
        for (b, what) in [(there[0], "an export"), (there[1], "a block copy")] {
            gpu.import_block(b, &junk).unwrap();
            assert!(gpu.start_import(b, &region[..bb]).unwrap());
            pad_loads(&mut gpu, &region[bb..2 * bb]);
            // Issued now (a poll issues what is queued), and copying.
            let mut early = Vec::new();
            gpu.imports_done(Duration::ZERO, &mut early).unwrap();
            if b == there[1] {
                gpu.copy_block_prefix(b, there[2], bs).unwrap();
                gpu.export_block(there[2], &mut back).unwrap();
            } else {
                gpu.export_block(b, &mut back).unwrap();
            }
            assert_eq!(
                back,
                region[..bb],
                "{what} of a block whose load is copying"
            );
            reported(&mut gpu, 1 + pad as usize - early.len(), limit);
        }
        // The executor (which unpins the region) waits for its copies before the region goes.
        drop(gpu);
        drop(region);
    }
}

/// Sequences prefilled side by side in one pool, each with 20 tokens kept back for the steps after:
/// sequence `i` holds `tokens[i]` (its prompt and the 20), in blocks after the previous sequence's, in
/// descending order (block 0 unused).
pub struct Sequences {
    pub tokens: Vec<Vec<u32>>,
    pub tables: Vec<Vec<u32>>,
}

impl Sequences {
    /// The blocks `tokens` need in blocks of `bs` (with 4 tokens to spare each), and block 0.
    pub fn blocks(tokens: &[Vec<u32>], bs: usize) -> usize {
        1 + tokens
            .iter()
            .map(|t| (t.len() + 4).div_ceil(bs))
            .sum::<usize>()
    }

    /// Lays `tokens` out and prefills each but its last 20 tokens on `gpu`.
    pub fn prefill(gpu: &mut CudaExecutor, tokens: Vec<Vec<u32>>, bs: usize) -> Self {
        let mut next = 1usize;
        let tables = tokens
            .iter()
            .map(|t| {
                let k = (t.len() + 4).div_ceil(bs);
                next += k;
                ((next - k) as u32..next as u32).rev().collect()
            })
            .collect();
        let s = Sequences { tokens, tables };
        for (q, t) in s.tokens.iter().zip(&s.tables) {
            gpu.forward_logits(&[SeqInput::new(&q[..q.len() - 20], 0, t)])
                .unwrap();
        }
        s
    }

    /// `n` of sequence `i`'s kept-back tokens, from the first on.
    pub fn item(&self, i: usize, n: usize) -> SeqInput<'_> {
        let at = self.tokens[i].len() - 20;
        SeqInput::new(&self.tokens[i][at..at + n], at, &self.tables[i])
    }

    /// The steps every fused-decode comparison runs: four sequences decoding together, the first alone,
    /// a 3-token chunk of the first beside a token of the second (the output head's rows are tokens 2
    /// and 3), and a 20-token chunk of the third (cuBLAS products).
    pub fn mixed_steps(&self) -> Vec<(&'static str, Vec<SeqInput<'_>>)> {
        vec![
            ("decode of four", (0..4).map(|i| self.item(i, 1)).collect()),
            ("decode of one", vec![self.item(0, 1)]),
            (
                "3-token chunk beside a decode",
                vec![self.item(0, 3), self.item(1, 1)],
            ),
            ("20-token chunk", vec![self.item(2, 20)]),
        ]
    }
}

/// Each step's logits.
pub fn run_steps(gpu: &mut CudaExecutor, steps: &[(&str, Vec<SeqInput<'_>>)]) -> Vec<Vec<f32>> {
    steps
        .iter()
        .map(|(_, batch)| gpu.forward_logits(batch).unwrap())
        .collect()
}

/// A step checking drafts (speculative decoding: [`Executor::forward_tails`]) over `seqs`' first three
/// sequences, in four shapes: a draft of 4 beside a decode token and a 3-token chunk's last 2 rows (9
/// tokens: the products' many-row path); a draft of 2 beside a decode token, then the same the other
/// way round (4 tokens and 4 rows each: a decode step's shape, one graph for both where `gpu` uses
/// them); drafts of 3 and 1 (6 rows: the output head's separate norm). Every row asked is the logits of
/// the tokens up to its position: within `tol` of the CPU runtime's last logits of that prefix, with
/// its argmax; in a step of at most 8 tokens, the bits of a step of that position's token alone (one
/// token a step). Asked for greedy tokens, the step gives each row's argmax; asked for one row an item
/// (tails of 1), the rows `forward_rows` gives; asked for mixed answers, each as asked; bad tails and
/// answers are refused. Each run of a shape writes the same K and V before reading them, so each
/// gives the same bits. Returns each shape's rows of logits, in order.
pub fn tail_rows(gpu: &mut CudaExecutor, cpu: &Model, seqs: &Sequences, tol: f64) -> Vec<Vec<f32>> {
    // (sequence, new tokens, rows asked) per item.
    type Items = &'static [(usize, usize, usize)];
    let shapes: [(&str, Items); 4] = [
        (
            "a draft of 4, a decode token and a chunk's last 2 rows",
            &[(0, 5, 5), (1, 1, 1), (2, 3, 2)],
        ),
        ("a draft of 2 beside a decode", &[(0, 3, 3), (1, 1, 1)]),
        ("a decode beside a draft of 2", &[(0, 1, 1), (1, 3, 3)]),
        ("drafts of 3 and 1", &[(0, 4, 4), (1, 2, 2)]),
    ];
    let mut out = Vec::new();
    for (shape, items) in shapes {
        let batch: Vec<SeqInput<'_>> = items.iter().map(|&(i, n, _)| seqs.item(i, n)).collect();
        let tails: Vec<usize> = items.iter().map(|&(_, _, k)| k).collect();
        let rows = gpu
            .forward_tails(&batch, &vec![Want::Logits; batch.len()], &tails)
            .unwrap_or_else(|e| panic!("{shape}: {e}"));
        assert_eq!(rows.len(), batch.len(), "{shape}");
        let mut flat = Vec::new();
        for ((&(i, n, k), item_rows), item) in items.iter().zip(&rows).zip(&batch) {
            assert_eq!(item_rows.len(), k, "{shape}: sequence {i}'s rows");
            for (j, row) in item_rows.iter().enumerate() {
                let Row::Logits(got) = row else {
                    panic!("{shape}: sequence {i}, row {j}: {row:?} where logits were asked");
                };
                // The row of the item's token `n - k + j`, at position `start_pos + n - k + j`.
                let end = item.start_pos + n - k + j + 1;
                let want = cpu_logits(cpu, &seqs.tokens[i][..end], KvDtype::Bf16);
                let d = rel(got, &want);
                println!(
                    "{shape}: sequence {i}, position {}: {d:.2e} from the CPU runtime",
                    end - 1
                );
                assert!(
                    d <= tol,
                    "{shape}: sequence {i}, position {}: {d:.2e}",
                    end - 1
                );
                // The same greedy token where the CPU's best leads its second by more than twice the
                // largest difference between the two rows (random weights give near ties, which
                // rounding may turn either way).
                let c = sampling::argmax(&want) as usize;
                let second = want
                    .iter()
                    .enumerate()
                    .filter(|&(t, _)| t != c)
                    .map(|(_, v)| *v)
                    .fold(f32::NEG_INFINITY, f32::max);
                let apart = got
                    .iter()
                    .zip(&want)
                    .map(|(a, b)| (a - b).abs())
                    .fold(0f32, f32::max);
                if want[c] - second > 2.0 * apart {
                    assert_eq!(
                        sampling::argmax(got) as usize,
                        c,
                        "{shape}: sequence {i}, position {}",
                        end - 1
                    );
                } else {
                    println!(
                        "{shape}: sequence {i}, position {}: a near tie on the CPU ({:.2e} apart, rows \
                         {apart:.2e} apart), its argmax not compared",
                        end - 1,
                        want[c] - second
                    );
                }
                flat.extend_from_slice(got);
            }
        }
        let vocab = flat.len() / tails.iter().sum::<usize>();
        let row = |r: usize| &flat[r * vocab..(r + 1) * vocab];
        // Greedy tokens on the device: each row's argmax.
        let tokens = gpu
            .forward_tails(&batch, &vec![Want::Argmax; batch.len()], &tails)
            .unwrap();
        for (r, t) in tokens.iter().flatten().enumerate() {
            assert_eq!(*t, Row::Token(sampling::argmax(row(r))), "{shape}: row {r}");
        }
        // Mixed answers, each as asked, the others' rows in their places.
        let asks = [Want::Argmax, Want::Logits, Want::Nothing];
        let wants: Vec<Want> = (0..batch.len()).map(|i| asks[i % 3]).collect();
        let mixed = gpu.forward_tails(&batch, &wants, &tails).unwrap();
        let mut r = 0;
        for (i, (want, item_rows)) in wants.iter().zip(&mixed).enumerate() {
            assert_eq!(item_rows.len(), tails[i], "{shape}: item {i}");
            for got in item_rows {
                match (want, got) {
                    (Want::Argmax, Row::Token(t)) => {
                        assert_eq!(*t, sampling::argmax(row(r)), "{shape}: row {r}")
                    }
                    (Want::Logits, Row::Logits(l)) => {
                        assert!(same_bits(l, row(r)), "{shape}: row {r}'s logits")
                    }
                    (Want::Nothing, Row::Nothing) => {}
                    (want, got) => panic!("{shape}: row {r} asked {want:?}, answered {got:?}"),
                }
                r += 1;
            }
        }
        // One row an item: `forward_rows`' rows, bit for bit.
        let ones = vec![1; batch.len()];
        let logits = vec![Want::Logits; batch.len()];
        let lone = gpu.forward_tails(&batch, &logits, &ones).unwrap();
        let plain = Executor::forward_rows(gpu, &batch, &logits).unwrap();
        for (i, (a, b)) in lone.iter().zip(&plain).enumerate() {
            assert_eq!(a.len(), 1, "{shape}: item {i}");
            let (Some(a), Some(b)) = (a[0].logits(), b.logits()) else {
                panic!("{shape}: item {i}: logits asked");
            };
            assert!(
                same_bits(a, b),
                "{shape}: item {i}, tails of 1 and forward_rows"
            );
        }
        // Within 8 tokens a step sums each token's products in one order whatever else it computes:
        // each row is the one its position's token gives alone (its K and V rows rewritten with the
        // same bits).
        if batch.iter().map(|s| s.tokens.len()).sum::<usize>() <= 8 {
            let mut r = 0;
            for (&(i, n, k), item) in items.iter().zip(&batch) {
                for j in 0..k {
                    let p = item.start_pos + n - k + j;
                    let alone = SeqInput::new(&seqs.tokens[i][p..=p], p, &seqs.tables[i]);
                    let got = gpu.forward_logits(&[alone]).unwrap();
                    assert!(
                        same_bits(&got, row(r)),
                        "{shape}: sequence {i}, position {p}: {:.2e} from its token alone",
                        rel(&got, row(r))
                    );
                    r += 1;
                }
            }
        }
        out.push(flat);
    }
    // Refused by name: a tail longer than its item, none, and answers or tails for too few items.
    let batch = [seqs.item(0, 2), seqs.item(1, 1)];
    for (wants, tails, expect) in [
        (
            2,
            &[3usize, 1][..],
            "sequence 0: 3 rows of logits asked of its 2 new tokens",
        ),
        (2, &[2, 0], "sequence 1: 0 rows of logits"),
        (1, &[2, 1], "1 answers asked of a step of 2"),
        (2, &[2], "1 tails asked of a step of 2"),
    ] {
        match Executor::forward_tails(gpu, &batch, &vec![Want::Argmax; wants], tails) {
            Err(ExecError::Step(e)) => assert!(e.contains(expect), "{tails:?}: {e}"),
            other => panic!("{tails:?}: {other:?}"),
        }
    }
    out
}
