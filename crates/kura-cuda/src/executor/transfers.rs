//! Copies between the device pool and the host tier's pinned region on streams of their own, one for
//! each direction, beside the forward passes on the device's stream ([`Executor::start_import`],
//! [`Executor::start_export`]).
//!
//! Stores (device → host) are one copy per block, each with an event after it; a step, block copy or
//! import that writes a stored block waits for its store, on the device (the engine frees a block as it
//! stores it, and may hand it on at once), and the host waits for the stores into a slot before it
//! reads or writes that slot. Work that writes no stored block does not wait, nor does the host: a
//! swap-out of a long sequence (2 GiB for 16,384 tokens of Llama-3.1-8B, about 40 ms at 50 GB/s) runs
//! beside the steps after it, and holds one back only for the copies up to the store of the first of
//! its blocks that step writes ([`super::store_order`]).
//!
//! Loads (host → device) take one of two forms:
//! - **whole blocks**, one copy each, reported by [`CudaExecutor::try_imports_done`] when they land; the
//!   engine schedules a request that wants one only then;
//! - **ordered, layer by layer** (where the driver has `cuMemcpyBatchAsync_v2`, CUDA 13), reported to
//!   the engine as landed when started ([`Executor::imports_ordered`]). The loads started between two
//!   uses of the device are issued together before the next one ([`CudaExecutor::issue_imports`]): per
//!   group of consecutive layers, one batched copy of those layers' bytes of every block (a block's
//!   bytes are layer-major, so each is one run; a group is the fewest layers whose bytes reach
//!   [`crate::executor::LOAD_COPY_MIN_BYTES`], since each copy costs about a microsecond whatever its
//!   size), then an event for each of its layers. A step whose block tables hold such a block makes the device
//!   stream wait for layer *i*'s event just before layer *i* writes or reads the pool: layer 0 computes
//!   as soon as its bytes are in, while the copies of the later layers go on. A block copy or export of
//!   such a block waits for all of it first.
//!
//! ```text
//!   load stream:      [layer 0 of every block]─e0─[layer 1]─e1─ … ─[layer L−1]─e(L−1)
//!   device stream:    embed, qkv ─wait e0─ attention 0 … ─wait e1─ attention 1 … ─wait e(L−1)─ …
//! ```
//!
//! Loads and stores run on two streams, so that the bus carries both directions at once and a load (a
//! request waits for it) never queues behind stores (which nothing waits for but the work that writes
//! their blocks): a swap-out's or the pool's stores ahead of eviction run while a revisit's loads
//! arrive. What one direction must not overtake in the other is waited for on the device:
//! - a load waits for the newest store that reads the block it writes (the block's old KV, stored as
//!   the pool evicted it) or writes the host slot it reads (a block stored and loaded back), and so for
//!   the stores before it on their stream;
//! - a store waits for every load issued before it (one into the block it reads, or out of the slot it
//!   writes): a store never overtakes a load.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::sys::{self, CUevent_flags};
use cudarc::driver::{CudaEvent, CudaStream};
use kura_engine::SeqInput;

use super::load_order::{layers_per_copy, LoadOrder};
use super::store_order::StoreOrder;
use super::CudaExecutor;
use crate::device::Device;
use crate::error::{CudaError, Result};

/// Host-tier loads and stores copied on streams of their own, beside the forward passes on the device's
/// stream: loads (host → device) on `stream`, stores (device → host) on `store_stream`.
pub(super) struct HostLoads {
    stream: Arc<CudaStream>,
    store_stream: Arc<CudaStream>,
    /// Started whole-block loads in the order they were issued: (block, an event before the copy, one
    /// after).
    in_flight: VecDeque<(u32, CudaEvent, CudaEvent)>,
    /// Ordered loads: queued, issued, and which issue each unordered block waits for.
    order: LoadOrder,
    /// The events of the issues `order` has in flight, oldest first.
    layered: VecDeque<Layered>,
    /// Stores the host has not seen land, each with the event after its copy, and which of them the
    /// device stream has waited for (work writing their blocks waits for the others).
    stores: StoreOrder<CudaEvent>,
    /// Whether batched copies work here; after one fails, ordered loads are whole-block copies (a step
    /// that reads one then waits for all of it).
    batched: bool,
    /// Ordered loads that no way of copying could copy: (blocks, why). The engine counted them as
    /// landed, so from then on every load, poll and step answers [`CudaError::LoadsLost`].
    lost: Option<(usize, String)>,
}

/// The events of ordered loads issued together: their issue's number, how many blocks, an event before
/// the copies and one after each layer's.
struct Layered {
    seq: u64,
    blocks: usize,
    start: CudaEvent,
    layers: Vec<CudaEvent>,
    /// The copies' time when they were not timed by the events (copied synchronously after issuing
    /// them failed).
    copy_time: Option<Duration>,
}

impl HostLoads {
    /// [`CudaError::LoadsLost`] once ordered loads were lost.
    fn check(&self) -> Result<()> {
        match &self.lost {
            Some((blocks, message)) => Err(CudaError::LoadsLost {
                blocks: *blocks,
                message: message.clone(),
            }),
            None => Ok(()),
        }
    }

    /// The events of issue `seq`, which a step may wait for only while it is in flight
    /// ([`LoadOrder::newest_writing`] names no other).
    fn issue(&self, seq: u64) -> &Layered {
        debug_assert!(self.order.in_flight(seq));
        self.layered
            .iter()
            .find(|l| l.seq == seq)
            .expect("an issue is waited for only while it is in flight")
    }

    /// Makes the load stream wait for the newest store that reads one of the blocks of `copies` (block,
    /// host slot) or writes one of their slots, and so for the stores before it on their stream: a load
    /// must not overwrite a block before its old KV is stored, nor read a slot before its store lands.
    /// Stores the device stream waited for are covered by the load stream's wait for the device's
    /// work, which comes after.
    fn after_stores_over(&self, copies: &[(u32, u64)]) -> Result<()> {
        let reading = self.stores.newest_reading(copies.iter().map(|c| c.0));
        let slots: Vec<u64> = copies.iter().map(|c| c.1).collect();
        let into = self.stores.newest_into_any(&slots);
        if let Some(seq) = reading.max(into) {
            let ev = self
                .stores
                .event(seq)
                .expect("a pending store has its event");
            self.stream.wait(ev)?;
        }
        Ok(())
    }

    /// The executor's transfers, made with their stream on first use.
    fn get<'a>(loads: &'a mut Option<HostLoads>, dev: &Device) -> Result<&'a mut HostLoads> {
        if loads.is_none() {
            *loads = Some(HostLoads {
                stream: dev.ctx.new_stream()?,
                store_stream: dev.ctx.new_stream()?,
                in_flight: VecDeque::new(),
                order: LoadOrder::default(),
                layered: VecDeque::new(),
                stores: StoreOrder::default(),
                batched: true,
                lost: None,
            });
        }
        Ok(loads.as_mut().expect("made above"))
    }
}

impl Drop for HostLoads {
    fn drop(&mut self) {
        // The copies read pinned host memory that is unpinned (and freed) after this.
        let _ = self.stream.synchronize();
        let _ = self.store_stream.synchronize();
    }
}

/// Which way a host-tier copy goes, and so which stream it runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Direction {
    /// Host → device, on the load stream.
    Load,
    /// Device → host, on the store stream.
    Store,
}

pub(super) const TIMED: Option<CUevent_flags> = Some(CUevent_flags::CU_EVENT_DEFAULT);
/// Pending stores past which those that landed are let go (each holds an event).
const STORES_HELD: usize = 4096;
const UNTIMED: Option<CUevent_flags> = Some(CUevent_flags::CU_EVENT_DISABLE_TIMING);

impl CudaExecutor {
    /// Starts copying `bytes` into block `block` and returns `true`; `false` (nothing started) when
    /// `bytes` are not in a pinned host region, whose copies the driver would stage synchronously
    /// anyway. An ordered load is queued and issued with the others before the executor next uses the
    /// device; a whole-block one is copied on the load stream after everything already issued on the
    /// device's stream and the stores it must follow.
    pub fn try_start_import(&mut self, block: u32, bytes: &[u8]) -> Result<bool> {
        if self.ordered_imports {
            if !self.dev.is_pinned(bytes) {
                return Ok(false);
            }
            self.check_block_bytes(block, bytes.len())?;
            self.dev.ctx.bind_to_thread()?;
            // Two loads into one block go out in order, not in one batch (whose copies have none).
            if self
                .loads
                .as_ref()
                .is_some_and(|l| l.order.is_queued(block))
            {
                self.issue_imports()?;
            }
            let loads = HostLoads::get(&mut self.loads, &self.dev)?;
            loads.check()?;
            loads.order.queue(block, bytes.as_ptr() as u64);
            return Ok(true);
        }
        let Some(dst) = self.begin_transfer(block, bytes, Direction::Load)? else {
            return Ok(false);
        };
        let loads = self.loads.as_mut().expect("begin_transfer made it");
        let before = self.dev.ctx.new_event(TIMED)?;
        before.record(&loads.stream)?;
        // SAFETY: `dst` is the block's place in the pool, `block_bytes` long (checked by
        // begin_transfer); `bytes` is pinned host memory of that length, which the engine leaves
        // unchanged until the copy is reported (and which outlives the executor's copies: `HostLoads`
        // waits for them when dropped).
        unsafe {
            sys::cuMemcpyHtoDAsync_v2(
                dst,
                bytes.as_ptr().cast(),
                bytes.len(),
                loads.stream.cu_stream(),
            )
        }
        .result()?;
        let after = self.dev.ctx.new_event(TIMED)?;
        after.record(&loads.stream)?;
        loads.in_flight.push_back((block, before, after));
        Ok(true)
    }

    /// Starts copying block `block` into `out` on the store stream, after everything already issued on
    /// the device's stream (the steps that wrote the block) and every load issued so far, and returns `true`; `false` (nothing
    /// started) when `out` is not in a pinned host region. Pool writes issued after it wait for it on
    /// the device ([`CudaExecutor::after_stores`]); the host reads `out` after
    /// [`CudaExecutor::try_stores_fence`].
    pub fn try_start_export(&mut self, block: u32, out: &mut [u8]) -> Result<bool> {
        let Some(src) = self.begin_transfer(block, out, Direction::Store)? else {
            return Ok(false);
        };
        let loads = self.loads.as_mut().expect("begin_transfer made it");
        // SAFETY: `src` is the block's place in the pool, `block_bytes` long (checked by
        // begin_transfer); `out` is pinned host memory of that length, which the engine neither reads
        // nor writes until it has called `exports_fence`, and which outlives the copy (`HostLoads`
        // waits for it when dropped).
        unsafe {
            sys::cuMemcpyDtoHAsync_v2(
                out.as_mut_ptr().cast(),
                src,
                out.len(),
                loads.store_stream.cu_stream(),
            )
        }
        .result()?;
        let stored = self.dev.ctx.new_event(UNTIMED)?;
        stored.record(&loads.store_stream)?;
        loads.stores.started(block, out.as_ptr() as u64, stored);
        // Stores of blocks that are never rewritten (write-through, swap-outs of blocks that stay
        // cached) and never fenced would pile up: past a bound, those that landed are let go.
        if loads.stores.len() > STORES_HELD {
            while let Some((seq, ev)) = loads.stores.oldest() {
                if !ev.try_is_complete()? {
                    break;
                }
                loads.stores.landed_through(seq);
            }
        }
        Ok(true)
    }

    /// For a copy of block `block` to or from `host` on the stream of its direction: checks both,
    /// issues the ordered loads queued before it, orders that stream after the device stream's work so
    /// far (the steps and block copies that wrote the block, or wrote it before it was freed and handed
    /// on) and after what it must not overtake in the other direction (a load: the stores of its block
    /// and into its slot; a store: every load issued before it), and returns the block's address in
    /// the pool; `None` (nothing done) when `host` is not in a pinned region, whose copies the driver
    /// would stage synchronously anyway.
    fn begin_transfer(
        &mut self,
        block: u32,
        host: &[u8],
        direction: Direction,
    ) -> Result<Option<u64>> {
        if !self.dev.is_pinned(host) {
            return Ok(None);
        }
        let b = self.check_block_bytes(block, host.len())?;
        self.dev.ctx.bind_to_thread()?;
        self.issue_imports()?;
        let loads = HostLoads::get(&mut self.loads, &self.dev)?;
        let issued = self.dev.ctx.new_event(UNTIMED)?;
        issued.record(&self.dev.stream)?;
        match direction {
            Direction::Load => {
                loads.stream.wait(&issued)?;
                loads.after_stores_over(&[(block, host.as_ptr() as u64)])?;
            }
            Direction::Store => {
                loads.store_stream.wait(&issued)?;
                let loaded = self.dev.ctx.new_event(UNTIMED)?;
                loaded.record(&loads.stream)?;
                loads.store_stream.wait(&loaded)?;
            }
        }
        Ok(Some(
            self.dev.ptr(&self.pool) + (b * self.block_bytes) as u64,
        ))
    }

    /// Issues the ordered loads started since the device was last used, on the load stream after the
    /// device stream's work so far (which wrote their blocks before they were freed): per group of
    /// layers, one batched copy of those layers' bytes of every block, then an event a layer.
    pub(super) fn issue_imports(&mut self) -> Result<()> {
        let Some(loads) = self.loads.as_mut() else {
            return Ok(());
        };
        loads.check()?;
        if !loads.order.has_queued() {
            return Ok(());
        }
        // Every event first: once the loads are an issue, steps wait on its events, so they must exist
        // whatever fails after.
        let layers = self.cfg.num_layers();
        let ctx = &self.dev.ctx;
        let start = ctx.new_event(TIMED)?;
        let events = (0..layers)
            .map(|l| ctx.new_event(if l + 1 == layers { TIMED } else { UNTIMED }))
            .collect::<std::result::Result<Vec<_>, _>>()?;
        let (seq, queued) = loads.order.issue().expect("loads are queued");
        let copies = Copies {
            dev: &self.dev,
            pool: self.dev.ptr(&self.pool),
            block_bytes: self.block_bytes,
            queued: &queued,
            layers_per_copy: layers_per_copy(self.block_bytes / layers, layers, self.load_copy_min),
        };
        let mut copy_time = None;
        if let Err(e) = copies.layered(loads, &start, &events) {
            // Copied synchronously instead. If that fails too, the blocks do not hold what the engine
            // counted them as holding: the executor answers so from now on (the issue's events, never
            // recorded, are not waited for or timed again).
            tracing::error!("issuing host-tier loads failed ({e}); copying them synchronously");
            let t = std::time::Instant::now();
            match copies.now(loads) {
                Ok(()) => copy_time = Some(t.elapsed()),
                Err(sync) => {
                    loads.lost = Some((
                        queued.len(),
                        format!("{e}; copying them synchronously: {sync}"),
                    ))
                }
            }
        }
        loads.layered.push_back(Layered {
            seq,
            blocks: queued.len(),
            start,
            layers: events,
            copy_time,
        });
        loads.check()
    }

    /// The issue of ordered loads a step over `batch` waits for, layer by layer: the newest not waited
    /// for that writes a block of the step's tables (the load stream runs in order: its layer *i*
    /// follows every earlier issue's copies), if any.
    pub(super) fn imports_read_by(&self, batch: &[SeqInput<'_>]) -> Option<u64> {
        let loads = self.loads.as_ref()?;
        let bs = self.shape.block_size as usize;
        // The blocks each sequence reads or writes: those of its positions so far.
        loads.order.newest_writing(batch.iter().flat_map(|s| {
            let used = (s.start_pos + s.tokens.len()).div_ceil(bs);
            s.block_table[..used.min(s.block_table.len())]
                .iter()
                .copied()
        }))
    }

    /// Makes the device stream wait for layer `layer` of the ordered loads issued as `wait`.
    pub(super) fn wait_layer(&self, wait: Option<u64>, layer: usize) -> Result<()> {
        if let (Some(seq), Some(loads)) = (wait, self.loads.as_ref()) {
            self.dev.stream.wait(&loads.issue(seq).layers[layer])?;
        }
        Ok(())
    }

    /// Makes the device stream wait for every layer of the ordered loads issued as `wait` (before a
    /// captured step, which cannot wait inside).
    pub(super) fn wait_all_layers(&self, wait: Option<u64>) -> Result<()> {
        if let (Some(seq), Some(loads)) = (wait, self.loads.as_ref()) {
            let last = loads.issue(seq).layers.last().expect("a model has layers");
            self.dev.stream.wait(last)?;
        }
        Ok(())
    }

    /// Notes that the device stream now waits for the ordered loads issued as `wait` and before it (the
    /// load stream runs its copies in order).
    pub(super) fn waited_for(&mut self, wait: Option<u64>) {
        if let (Some(seq), Some(loads)) = (wait, self.loads.as_mut()) {
            loads.order.waited_for(seq);
        }
    }

    /// Before a block copy, export or synchronous import touching `blocks`: issues the ordered loads
    /// queued, and makes the device stream wait for all of any that writes one of `blocks`.
    pub(super) fn after_imports_of(&mut self, blocks: &[u32]) -> Result<()> {
        self.issue_imports()?;
        let wait = self
            .loads
            .as_ref()
            .and_then(|l| l.order.newest_writing(blocks.iter().copied()));
        self.wait_all_layers(wait)?;
        self.waited_for(wait);
        Ok(())
    }

    /// Before a synchronous export of `block` (which takes `&self`): copies into `out` the bytes of an
    /// ordered load into the block not issued yet, from its host slot once the stores before it have
    /// landed, and returns `true`; or, where an issued load into it has not been waited for, makes the
    /// device stream wait for every such load and returns `false`.
    pub(super) fn export_over_imports(&self, block: u32, out: &mut [u8]) -> Result<bool> {
        let Some(loads) = self.loads.as_ref() else {
            return Ok(false);
        };
        if let Some(host) = loads.order.queued_host(block) {
            // The stores into that slot (the bookkeeping, which `&self` cannot change, waits again
            // at the next fence).
            if let Some(seq) = loads.stores.newest_into(host) {
                let ev = loads
                    .stores
                    .event(seq)
                    .expect("a pending store has its event");
                ev.synchronize()?;
            }
            // SAFETY: a pinned slot of `block_bytes` in the host region (checked when the load was
            // started), which the engine does not write while the load is under way, and whose
            // stores have landed.
            let bytes = unsafe { std::slice::from_raw_parts(host as *const u8, self.block_bytes) };
            out.copy_from_slice(bytes);
            return Ok(true);
        }
        // The stream's wait is kept; the bookkeeping (which `&self` cannot change) waits again later.
        self.wait_all_layers(loads.order.newest_writing([block]))?;
        Ok(false)
    }

    /// Makes the device stream wait (on the device, not the host) for the stores that read any of
    /// `blocks`, before work that writes them: for the newest such store, and so for every store before
    /// it on the store stream. Stores of other blocks go on beside that work.
    pub(super) fn after_stores_of(&mut self, blocks: impl IntoIterator<Item = u32>) -> Result<()> {
        let Some(loads) = self.loads.as_mut() else {
            return Ok(());
        };
        if let Some(seq) = loads.stores.newest_reading(blocks) {
            let ev = loads
                .stores
                .event(seq)
                .expect("a pending store has its event");
            self.dev.stream.wait(ev)?;
            loads.stores.device_waited(seq);
        }
        Ok(())
    }

    /// Waits until every store started so far has landed in host memory.
    pub fn try_stores_fence(&mut self) -> Result<()> {
        if let Some(loads) = self.loads.as_mut() {
            if let Some((seq, ev)) = loads.stores.newest() {
                ev.synchronize()?;
                loads.stores.landed_through(seq);
            }
        }
        Ok(())
    }

    /// Waits until the stores started into `slot` (its first byte's address, as given to
    /// [`CudaExecutor::try_start_export`]) have landed in host memory, and with them every store
    /// started before the newest of those (the store stream runs in order); later stores go on.
    pub fn try_stores_fence_slot(&mut self, slot: &[u8]) -> Result<()> {
        if let Some(loads) = self.loads.as_mut() {
            if let Some(seq) = loads.stores.newest_into(slot.as_ptr() as u64) {
                let ev = loads
                    .stores
                    .event(seq)
                    .expect("a pending store has its event");
                ev.synchronize()?;
                loads.stores.landed_through(seq);
            }
        }
        Ok(())
    }

    /// Stores that device work writing their blocks would still wait for: neither waited for by the
    /// device stream nor seen landed by the host (for tests).
    pub fn stores_unordered(&self) -> usize {
        self.loads.as_ref().map_or(0, |l| l.stores.unordered())
    }

    /// Appends the blocks whose started loads have finished (in issue order, with each copy's own time;
    /// an ordered load's time is its layered copies' time over their blocks) to `done`, waiting at most
    /// `wait` for the first when none has.
    pub fn try_imports_done(
        &mut self,
        wait: Duration,
        done: &mut Vec<(u32, Duration)>,
    ) -> Result<()> {
        // Ordered loads not issued yet are issued now, so that they are reported in time.
        self.dev.ctx.bind_to_thread()?;
        self.issue_imports()?;
        let Some(loads) = self.loads.as_mut() else {
            return Ok(());
        };
        let deadline = std::time::Instant::now() + wait;
        let found = done.len();
        loop {
            while let Some((_, _, after)) = loads.in_flight.front() {
                if !after.try_is_complete()? {
                    break;
                }
                let (block, before, after) = loads.in_flight.pop_front().expect("looked at");
                let ms = f64::from(before.elapsed_ms(&after)?.max(0.0));
                done.push((block, Duration::from_secs_f64(ms / 1e3)));
            }
            while let Some(l) = loads.layered.front() {
                let last = l.layers.last().expect("a model has layers");
                if !last.try_is_complete()? {
                    break;
                }
                let l = loads.layered.pop_front().expect("looked at");
                let last = l.layers.last().expect("a model has layers");
                let all = match l.copy_time {
                    Some(t) => t,
                    None => {
                        Duration::from_secs_f64(f64::from(l.start.elapsed_ms(last)?.max(0.0)) / 1e3)
                    }
                };
                let each = all / l.blocks.max(1) as u32;
                debug_assert_eq!(loads.order.oldest(), Some(l.seq));
                // Landed: whatever the device does from now on comes after.
                let blocks = loads
                    .order
                    .landed()
                    .expect("an issue in flight for each events");
                done.extend(blocks.into_iter().map(|b| (b, each)));
            }
            if done.len() > found
                || (loads.in_flight.is_empty() && loads.order.is_idle())
                || std::time::Instant::now() >= deadline
            {
                return Ok(());
            }
            // A copy of a block takes tens of microseconds to milliseconds.
            std::thread::sleep(Duration::from_micros(20));
        }
    }
}

/// The copies of one issue of ordered loads: (block, host address of its slot) each.
struct Copies<'a> {
    dev: &'a Device,
    pool: u64,
    block_bytes: usize,
    queued: &'a [(u32, u64)],
    /// Consecutive layers of a block one copy takes ([`layers_per_copy`]).
    layers_per_copy: usize,
}

impl Copies<'_> {
    /// On the load stream after the device stream's work so far (which wrote these blocks before they
    /// were freed) and the stores of these blocks and into these slots: `start`, then per group of `layers_per_copy` layers one batched copy of those
    /// layers' bytes of every block and the events of the group's layers.
    fn layered(
        &self,
        loads: &mut HostLoads,
        start: &CudaEvent,
        events: &[CudaEvent],
    ) -> Result<()> {
        let issued = self.dev.ctx.new_event(UNTIMED)?;
        issued.record(&self.dev.stream)?;
        loads.stream.wait(&issued)?;
        loads.after_stores_over(self.queued)?;
        start.record(&loads.stream)?;
        // A block is every layer's K then V, layer by layer (`pool_at` in kura.cu).
        let layer_bytes = self.block_bytes / events.len();
        let mut attrs = sys::CUmemcpyAttributes {
            srcAccessOrder: sys::CUmemcpySrcAccessOrder_enum::CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
            srcLocHint: sys::CUmemLocation {
                type_: sys::CUmemLocationType_enum::CU_MEM_LOCATION_TYPE_HOST,
                id: 0,
            },
            dstLocHint: sys::CUmemLocation {
                type_: sys::CUmemLocationType_enum::CU_MEM_LOCATION_TYPE_DEVICE,
                id: self.dev.ordinal as i32,
            },
            flags: sys::CUmemcpyFlags_enum::CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE as u32,
        };
        let mut attr_at = [0usize];
        let n = self.queued.len();
        let (mut dsts, mut srcs, mut sizes) = (
            Vec::with_capacity(n),
            Vec::with_capacity(n),
            Vec::with_capacity(n),
        );
        // Whole blocks once a batched copy failed: every layer's event then follows every block.
        let mut whole = false;
        let per = self.layers_per_copy.max(1);
        for (g, group_events) in events.chunks(per).enumerate() {
            let at = (g * per * layer_bytes) as u64;
            dsts.clear();
            srcs.clear();
            sizes.clear();
            sizes.resize(n, group_events.len() * layer_bytes);
            for &(block, host) in self.queued {
                dsts.push(self.pool + (block as usize * self.block_bytes) as u64 + at);
                srcs.push(host + at);
            }
            // SAFETY (both forms): each destination is the group's layers' bytes of a block within the
            // pool (or the rest of the block), checked when the load was started; each source the
            // same bytes of a pinned host slot of `block_bytes`, which the engine writes again only
            // through a store, issued on this stream after this copy, and which outlives the copy
            // (`HostLoads` waits for its stream when dropped). The three arrays are `n` long and live
            // across the call; one attribute applies to all.
            let batch = if whole {
                Ok(())
            } else if loads.batched {
                unsafe {
                    sys::cuMemcpyBatchAsync_v2(
                        dsts.as_mut_ptr(),
                        srcs.as_mut_ptr(),
                        sizes.as_mut_ptr(),
                        n,
                        &mut attrs,
                        attr_at.as_mut_ptr(),
                        1,
                        loads.stream.cu_stream(),
                    )
                }
                .result()
                .map_err(|e| e.to_string())
            } else {
                Err(String::new())
            };
            if let Err(e) = batch {
                if loads.batched {
                    tracing::warn!(
                        "a batched copy of host-tier loads failed ({e}); loads are whole-block copies \
                         from now on, and a step that reads one waits for all of them"
                    );
                    loads.batched = false;
                }
                // From this layer on (the earlier ones are copied, and a step may already read them):
                // copies the batch may have enqueued write the same bytes again.
                whole = true;
                for (&dst, &src) in dsts.iter().zip(&srcs) {
                    // SAFETY: as above: this layer and the ones after it, the rest of the block.
                    unsafe {
                        sys::cuMemcpyHtoDAsync_v2(
                            dst,
                            src as *const std::ffi::c_void,
                            self.block_bytes - at as usize,
                            loads.stream.cu_stream(),
                        )
                    }
                    .result()?;
                }
            }
            for ev in group_events {
                ev.record(&loads.stream)?;
            }
        }
        Ok(())
    }

    /// Whole blocks, synchronously, after everything the device stream and both transfer streams have
    /// started.
    fn now(&self, transfers: &HostLoads) -> Result<()> {
        self.dev.synchronize()?;
        transfers.stream.synchronize()?;
        transfers.store_stream.synchronize()?;
        for &(block, host) in self.queued {
            // SAFETY: as in `layered`, a whole block, with both streams idle.
            unsafe {
                sys::cuMemcpyHtoD_v2(
                    self.pool + (block as usize * self.block_bytes) as u64,
                    host as *const std::ffi::c_void,
                    self.block_bytes,
                )
            }
            .result()?;
        }
        Ok(())
    }
}
