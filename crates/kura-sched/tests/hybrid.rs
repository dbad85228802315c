//! The scheduler over a hybrid pool (sliding-window layers paged apart; one full-attention and one
//! sliding layer, window 8, blocks of 2 tokens: a window overlaps 5 blocks), where pages run out before
//! block ids do: a waiting prompt that the pages could not hold even empty is refused instead of holding
//! up the queue behind it, and a sequence that cannot get its window's pages while a sequence before it
//! waits on its pending blocks steps back instead of keeping everything, so that the waiter computes
//! them.

mod common;

use common::step;
use std::time::Duration;

use kura_kv::{CacheKey, WindowPool};
use kura_sched::{OutputLimit, SchedEvent, Scheduler, SchedulerConfig, SchedulingPolicy};

fn config(pages: u32, budget: usize) -> SchedulerConfig {
    let window = WindowPool {
        sliding: vec![false, true],
        window_tokens: 8,
        num_pages: pages,
    };
    SchedulerConfig {
        window: Some(window.clone()),
        ..common::config(2, window.logical_blocks() as usize, budget)
    }
}

const LIMIT: OutputLimit = OutputLimit {
    max_tokens: 64,
    n: 1,
};

#[test]
fn a_prompt_the_pages_cannot_hold_is_refused_and_the_queue_goes_on() {
    // 80 pages: 80 logical blocks. A prompt of 152 tokens is 76 blocks, fewer than 80, but its pages
    // are 76 of the full layer and 5 of the sliding one: 81. It waited for room that never came, and
    // every request behind it with it.
    let mut s = Scheduler::new(config(80, 256)).unwrap();
    assert!(!s.kv().could_hold(76));
    s.add_request(
        0,
        CacheKey::new(),
        0,
        Duration::ZERO,
        (0..152).collect(),
        LIMIT,
    );
    let next = s.add_request(
        1,
        CacheKey::new(),
        0,
        Duration::ZERO,
        (500..510).collect(),
        LIMIT,
    );
    let plan = step(&mut s, 0);
    assert!(
        plan.events.contains(&SchedEvent::CannotFit {
            request: 0,
            needed_blocks: 76,
            total_blocks: 80,
        }),
        "{:?}",
        plan.events
    );
    assert_eq!(plan.items.len(), 1, "the request behind it runs");
    assert_eq!(plan.items[0].seq, next);
    assert_eq!(s.num_waiting(), 0);
}

/// A sequence alone whose prompt and output fit the pages exactly runs to its end. The last chunk of
/// its prompt left window references on every block that chunk's tokens read; its next block was
/// allocated before the step's window moved past them, so that their pages counted as held and it
/// failed with `CannotFit` (needing 71 blocks' pages, 76 of the 80) though it fits.
#[test]
fn a_sequence_that_fits_the_pages_is_not_failed_for_window_references_left_behind() {
    let mut s = Scheduler::new(config(80, 64)).unwrap();
    // 140 tokens of prompt and 11 of output: 150 of KV, 75 blocks, 80 pages.
    let limit = OutputLimit {
        max_tokens: 11,
        n: 1,
    };
    assert!(s.kv().could_hold(75));
    let seq = s.add_request(
        0,
        CacheKey::new(),
        0,
        Duration::ZERO,
        (3..143).collect(),
        limit,
    );
    for t in 0..100 {
        let plan = step(&mut s, t);
        common::assert_none_failed(&plan, t);
        if s.num_generated(seq) == 11 {
            return;
        }
    }
    panic!("{} of 11 tokens generated", s.num_generated(seq));
}
/// Early reuse where the reader comes first: W computes a long prompt in chunks; R, of a better
/// priority and with the same prefix, arrives meanwhile, attaches to W's pending blocks and waits for
/// them, before W in the order. R's window references on those blocks keep their parts as W moves on,
/// and W ran out of pages with no one after it to preempt: it kept everything and waited, R waited for
/// W, and nothing ever ran again. W steps back instead (its pending blocks withdrawn), R computes them,
/// and both finish.
#[test]
fn a_writer_out_of_window_pages_steps_back_for_a_reader_before_it() {
    let mut config = config(48, 8);
    config.policy = SchedulingPolicy::Priority;
    let mut s = Scheduler::new(config).unwrap();
    // 60 shared tokens (30 blocks) and one of each own: alone, 31 blocks and 5 window parts.
    let shared: Vec<u32> = (1000..1060).collect();
    let mut w_prompt = shared.clone();
    w_prompt.push(1);
    let mut r_prompt = shared;
    r_prompt.push(2);
    let w = s.add_request(0, CacheKey::new(), 0, Duration::ZERO, w_prompt, LIMIT);
    let mut r = None;
    let mut r_waited_for_w = false;
    let mut idle = 0;
    for t in 0..400 {
        if t == 1 {
            let ms = Duration::from_millis(1);
            r = Some(s.add_request(1, CacheKey::new(), -1, ms, r_prompt.clone(), LIMIT));
        }
        let plan = step(&mut s, t);
        common::assert_none_failed(&plan, t);
        r_waited_for_w |= plan.pending_waits > 0 && plan.items.iter().any(|i| i.seq == w);
        if plan.items.is_empty() {
            idle += 1;
            assert!(
                idle < 3,
                "pass {t}: nothing planned, {} running, {} waiting for pending blocks",
                s.num_running(),
                plan.pending_waits
            );
        } else {
            idle = 0;
        }
        for k in [Some(w), r].into_iter().flatten() {
            if s.num_generated(k) >= 3 {
                let request = s.request_of(k).unwrap();
                s.finish(k);
                s.remove_request(request);
            }
        }
        if t > 1 && s.is_idle() {
            assert!(r_waited_for_w, "R never waited for W's blocks");
            return;
        }
    }
    panic!("not done after 400 passes");
}

/// A prompt that fits the pages exactly, whose prefix is cached with its window's parts, is admitted
/// with nothing else running. Admission counted the hit's parts in its first window and the parts of
/// its last window together (84 pages of 80), though it holds one window's at a time: it waited for
/// ever, and every request behind it.
#[test]
fn a_prompt_that_fits_the_pages_with_a_cached_prefix_is_admitted() {
    let mut s = Scheduler::new(config(80, 64)).unwrap();
    let a = s.add_request(
        0,
        CacheKey::new(),
        0,
        Duration::ZERO,
        (0..20).collect(),
        LIMIT,
    );
    while s.num_generated(a) == 0 {
        step(&mut s, 0);
    }
    s.finish(a);
    s.remove_request(0);
    // 20 tokens of A's and 130 more: 75 blocks, 75 pages of the full layer and 5 of the sliding one.
    let limit = OutputLimit {
        max_tokens: 1,
        n: 1,
    };
    let b = s.add_request(
        1,
        CacheKey::new(),
        0,
        Duration::ZERO,
        (0..150).collect(),
        limit,
    );
    // Its window's pages are all the room there is: its chunks are a token or two.
    for t in 1..400 {
        let plan = step(&mut s, t);
        assert!(!plan.items.is_empty(), "pass {t}: nothing planned");
        if s.num_generated(b) == 1 {
            assert!(s.kv().stats().prefix_hit_tokens >= 16, "it read A's blocks");
            return;
        }
    }
    panic!(
        "B not done: {} running, {} waiting",
        s.num_running(),
        s.num_waiting()
    );
}
