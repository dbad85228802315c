//! What the manager tells the outside world (see `events`): the buffer of [`KvEvent`]s, when the
//! configuration records them, and the [`EvictionHook`] that receives every evicted block.
//!
//! The manager decides when a block is announced or evicted; the outbox only holds what it is told.
//! Events are built only when recorded, and an evicted block is shown only when a hook is installed.

use crate::events::{EvictedBlock, EvictionHook, KvEvent};

pub(super) struct Outbox {
    /// Buffer events (the configuration's `record_events`).
    record: bool,
    events: Vec<KvEvent>,
    hook: Option<Box<dyn EvictionHook>>,
}

impl Outbox {
    pub fn new(record: bool) -> Self {
        Self {
            record,
            events: Vec::new(),
            hook: None,
        }
    }

    /// Installs the receiver of evicted blocks (replacing any earlier one).
    pub fn set_hook(&mut self, hook: Box<dyn EvictionHook>) {
        self.hook = Some(hook);
    }

    /// Whether events are buffered.
    pub fn recording(&self) -> bool {
        self.record
    }

    /// Buffers the event `event` builds, if events are recorded.
    pub fn record(&mut self, event: impl FnOnce() -> KvEvent) {
        if self.record {
            self.events.push(event());
        }
    }

    /// Shows the block `block` builds to the eviction hook, if one is installed.
    pub fn evict<'a>(&mut self, block: impl FnOnce() -> EvictedBlock<'a>) {
        if let Some(hook) = self.hook.as_mut() {
            hook.on_evict(&block());
        }
    }

    /// A mark for [`Self::clear_since`]: the number of events buffered so far.
    pub fn mark(&self) -> usize {
        self.events.len()
    }

    /// Replaces the events buffered since `mark` by one [`KvEvent::Cleared`].
    pub fn clear_since(&mut self, mark: usize) {
        self.events.truncate(mark);
        self.events.push(KvEvent::Cleared);
    }

    pub fn drain(&mut self) -> std::vec::Drain<'_, KvEvent> {
        self.events.drain(..)
    }
}
