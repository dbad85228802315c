//! The engine on a hybrid pool (sliding layers paged apart), with real windowed models: the tiny Mistral
//! (every layer slides, window 8) and the tiny Qwen2 with one full and one sliding layer (window 8),
//! checkpoints of `kura-model`'s golden tests. Cached and cold runs give the same tokens for prefixes
//! shorter and longer than the window, shared prefixes hit where their window parts were kept, a pool
//! too small to keep them still gives the cold tokens (and tells the prompts it cut back why), and
//! nothing leaks.

use std::path::PathBuf;
use std::sync::mpsc::{self, Receiver};
use std::sync::Arc;
use std::time::Duration;

use kura_engine::{
    start_engine, EngineConfig, EngineEvent, EngineHandle, GenerateRequest, MissReason, ModelCodec,
    PinSpec, RequestGuard, Usage,
};
use kura_kv::codec::KvDtype;
use kura_model::{LoadOptions, Model, WeightsDtype};

fn tiny(name: &str) -> Arc<Model> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../kura-model/tests/data")
        .join(name);
    let options = LoadOptions {
        weights_dtype: WeightsDtype::F32,
    };
    Arc::new(Model::load_with(&dir, options).expect("tiny windowed model loads"))
}

/// An engine over a hybrid pool of `pages` pages (one layer of `block` tokens each), f32 KV.
fn engine(model: &Arc<Model>, block: usize, pages: u64, batched: usize) -> EngineHandle {
    engine_with(model, block, pages, batched, |_| {})
}

/// [`engine`] with its configuration changed by `adjust`.
fn engine_with(
    model: &Arc<Model>,
    block: usize,
    pages: u64,
    batched: usize,
    adjust: impl FnOnce(&mut EngineConfig),
) -> EngineHandle {
    let layout = model.kv_layout(KvDtype::F32, block).unwrap();
    let window = layout
        .window_pool(pages * layout.layer_bytes_per_block(0))
        .expect("a windowed model gets a hybrid pool");
    assert_eq!(u64::from(window.num_pages), pages);
    let storage = model
        .kv_storage_paged(&layout, window.num_pages as usize)
        .unwrap();
    let config = EngineConfig {
        model_name: "test".into(),
        max_model_len: model.config().max_context(),
        block_size_tokens: block,
        num_blocks: window.logical_blocks() as usize,
        max_num_seqs: 16,
        max_num_batched_tokens: batched,
        max_queue: 1000,
        enable_prefix_caching: true,
        model_fingerprint: "test".into(),
        window: Some(window),
        ..EngineConfig::default()
    };
    let mut config = config;
    adjust(&mut config);
    start_engine(
        config,
        Box::new(kura_model::ModelExecutor::new(model.clone(), storage)),
        Arc::new(ModelCodec::from_text(model.text().clone())),
    )
    .unwrap()
}

fn submit(e: &EngineHandle, r: GenerateRequest) -> (RequestGuard, Receiver<EngineEvent>) {
    let (tx, rx) = mpsc::channel();
    let guard = e.submit(r, move |ev| tx.send(ev).is_ok()).unwrap();
    (guard, rx)
}

fn wait(rx: &Receiver<EngineEvent>) -> (Vec<u32>, Usage) {
    let mut tokens = Vec::new();
    loop {
        match rx
            .recv_timeout(Duration::from_secs(120))
            .expect("engine answers")
        {
            EngineEvent::Delta { token_ids, .. } => tokens.extend(token_ids),
            EngineEvent::Done { usage } => return (tokens, usage),
            EngineEvent::Failed(e) => panic!("request failed: {e}"),
            _ => {}
        }
    }
}

fn run(e: &EngineHandle, prompt: &[u32], salt: &str, n: u32) -> (Vec<u32>, Usage) {
    let mut r = GenerateRequest::greedy(prompt.to_vec(), n);
    r.cache_salt = Some(salt.into());
    r.ignore_eos = true;
    let (_g, rx) = submit(e, r);
    wait(&rx)
}

/// Token ids below the tiny vocabulary (256 byte tokens), a different run for each seed.
fn prompt(len: usize, seed: u32) -> Vec<u32> {
    (0..len as u32)
        .map(|i| (i.wrapping_mul(2_654_435_761).wrapping_add(seed * 40_503) >> 7) % 250 + 3)
        .collect()
}

fn metric(e: &EngineHandle, name: &str) -> f64 {
    let text = e.metrics().render_prometheus();
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or_else(|| panic!("metric {name} missing"))
}

/// Waits until the engine thread has published its gauges with nothing running and no block held.
fn settle(e: &EngineHandle) {
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    while metric(e, "kura:num_requests_running") != 0.0
        || metric(e, "kura:kv_cache_blocks_used") != 0.0
    {
        assert!(
            std::time::Instant::now() < deadline,
            "blocks still in use after every request finished"
        );
        // Poll interval: the deadline only turns a hang into a failure.
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn cached_runs_give_the_cold_tokens_for_prefixes_shorter_and_longer_than_the_window() {
    for name in ["tiny-mistral", "tiny-qwen2-swa"] {
        let model = tiny(name);
        assert_eq!(model.config().sliding_window(), Some(8), "{name}");
        // Blocks of 2 tokens: a window of 8 overlaps 5 of them.
        let e = engine(&model, 2, 4096, 16);
        for (len, seed) in [(6, 1), (7, 2), (31, 3), (64, 4), (101, 5)] {
            let p = prompt(len, seed);
            let (cold, u) = run(&e, &p, &format!("cold-{seed}"), 10);
            assert_eq!(u.cached_tokens, 0);
            let (warm, u) = run(&e, &p, &format!("cold-{seed}"), 10);
            let whole = (len - 1) / 2 * 2;
            assert!(
                u.cached_tokens as usize >= whole,
                "{name}, prompt of {len}: {} cached, {whole} expected",
                u.cached_tokens
            );
            assert_eq!(cold, warm, "{name}, prompt of {len}");
            // A longer prompt sharing it: hit at the old prompt's end, where a window was kept.
            let mut longer = p.clone();
            longer.extend(prompt(9, seed + 50));
            let (shared, u) = run(&e, &longer, &format!("cold-{seed}"), 6);
            assert!(u.cached_tokens as usize >= whole, "{name}, {len}+9");
            let (alone, _) = run(&e, &longer, &format!("fresh-{seed}"), 6);
            assert_eq!(shared, alone, "{name}, prompt of {len} + 9");
        }
        settle(&e);
        e.stop();
    }
}

#[test]
fn a_prefix_shared_from_the_middle_of_a_cached_chain_hits_and_matches_cold() {
    let model = tiny("tiny-qwen2-swa");
    let e = engine(&model, 2, 4096, 16);
    // A 60-token document, then two questions after it: the second hits at the document's end, inside
    // the first request's chain, where only the window parts its window left behind can serve.
    let doc = prompt(60, 7);
    let ask = |q: u32| {
        let mut p = doc.clone();
        p.extend(prompt(12, q));
        p
    };
    let (_, u) = run(&e, &ask(100), "t", 8);
    assert_eq!(u.cached_tokens, 0);
    let (second, u) = run(&e, &ask(200), "t", 8);
    assert!(
        u.cached_tokens >= 60,
        "the document's blocks were not reused: {} cached",
        u.cached_tokens
    );
    let (cold, _) = run(&e, &ask(200), "other", 8);
    assert_eq!(second, cold);
    settle(&e);
    e.stop();
}

#[test]
fn a_pool_too_small_to_keep_windows_still_gives_the_cold_tokens() {
    let model = tiny("tiny-mistral");
    // 2 layers, blocks of 2: 60 pages hold the windows of a few sequences only, so window parts of
    // cached blocks are reclaimed between requests and hits are cut back to what remains.
    let e = engine(&model, 2, 60, 8);
    let prompts: Vec<Vec<u32>> = (0..6).map(|s| prompt(40 + 5 * s as usize, s)).collect();
    let mut cold = Vec::new();
    for p in &prompts {
        cold.push(run(&e, p, "x", 8).0);
    }
    let mut reasons = Vec::new();
    for (p, want) in prompts.iter().zip(&cold).rev() {
        let (got, u) = run(&e, p, "x", 8);
        assert_eq!(&got, want, "prompt of {}", p.len());
        reasons.push(u.miss.map(|m| m.reason));
    }
    // The pool kept blocks whose window parts it gave back: those prompts are told why.
    let dropped = reasons
        .iter()
        .filter(|r| **r == Some(MissReason::WindowDropped))
        .count();
    assert!(dropped > 0, "{reasons:?}");
    assert_eq!(
        metric(
            &e,
            "kura:prefix_cache_misses_total{reason=\"window_dropped\"}"
        ),
        dropped as f64
    );
    // Several at once: the step shrinks or preempts when windows do not fit.
    let guards: Vec<_> = prompts
        .iter()
        .map(|p| {
            let mut r = GenerateRequest::greedy(p.clone(), 8);
            r.cache_salt = Some("x".into());
            r.ignore_eos = true;
            submit(&e, r)
        })
        .collect();
    for ((_, rx), want) in guards.iter().zip(&cold) {
        assert_eq!(&wait(rx).0, want);
    }
    settle(&e);
    assert!(
        metric(&e, "kura:kv_window_part_drops_total") > 0.0,
        "no window part was reclaimed: the pool was not small"
    );
    assert_eq!(metric(&e, "kura:kv_pages_total"), 60.0);
    // Idle, every page is free or kept for a cached block (full pages of cached blocks, idle windows).
    assert!(metric(&e, "kura:kv_pages_free") + metric(&e, "kura:kv_pages_idle_window") <= 60.0);
    e.stop();
}

/// A pool of 80 pages (blocks of 2 tokens over one full and one sliding layer) with a 60-token prompt
/// pinned: about 35 of its pages held.
fn hybrid_pool_with_a_pin(model: &Arc<Model>) -> EngineHandle {
    let e = engine_with(model, 2, 80, 64, |c| c.pin_budget_blocks = Some(40));
    let doc = prompt(60, 11);
    let mut r = GenerateRequest::greedy(doc.clone(), 1);
    r.cache_salt = Some("t".into());
    r.pins = vec![PinSpec {
        tokens: doc.len(),
        expires_at_ms: e.cache_now_ms() + 600_000,
        persist: false,
    }];
    let (_g, rx) = submit(&e, r);
    wait(&rx);
    assert!(metric(&e, "kura:kv_pinned_blocks") >= 29.0);
    e
}

/// A request running alone whose output outgrows the pages the pins leave (but fits the pool) failed
/// with CannotFit: it steps back to the queue, and a pin gives way, as in a pool of whole blocks.
#[test]
fn pins_give_way_to_a_lone_request_that_outgrows_the_pages_they_leave() {
    let model = tiny("tiny-qwen2-swa");
    let e = hybrid_pool_with_a_pin(&model);
    // 20 tokens of prompt fit beside the pin; with 70 of output the sequence takes 45 pages of the
    // full layer and about 5 of the sliding one: more than the 80 less the pin's 35 or so, less than 80.
    let grows = prompt(20, 12);
    let (tokens, _) = run(&e, &grows, "u", 70);
    assert_eq!(tokens.len(), 70);
    assert_eq!(metric(&e, "kura:kv_pins_demoted_total"), 1.0);
    // The same tokens as on a pool without pins.
    let fresh = engine(&model, 2, 80, 64);
    assert_eq!(run(&fresh, &grows, "u", 70).0, tokens);
    fresh.stop();
    e.stop();
}

/// The same, with smaller requests arriving all along beside it (a few always in flight): they run,
/// and the one that steps back for the pins' room still gets it, while they keep coming (a pass where
/// it steps back admits no one else, so that a pin gives way).
#[test]
fn a_request_that_steps_back_for_pins_is_not_starved_by_others() {
    let model = tiny("tiny-qwen2-swa");
    let e = Arc::new(hybrid_pool_with_a_pin(&model));
    let mut big = GenerateRequest::greedy(prompt(20, 12), 70);
    big.cache_salt = Some("u".into());
    big.ignore_eos = true;
    let (_b, big_rx) = submit(&e, big);
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    // At most this many small requests: the feeder stops there whatever happened.
    const MOST: u32 = 3000;
    let feeder = {
        let (e, done) = (e.clone(), done.clone());
        std::thread::spawn(move || {
            let mut sent = 0u32;
            let mut in_flight = std::collections::VecDeque::new();
            while !done.load(std::sync::atomic::Ordering::Relaxed) && sent < MOST {
                let mut r = GenerateRequest::greedy(prompt(6, 100 + sent), 4);
                r.cache_salt = Some("v".into());
                r.ignore_eos = true;
                in_flight.push_back(submit(&e, r));
                sent += 1;
                if in_flight.len() >= 4 {
                    let (_g, rx) = in_flight.pop_front().unwrap();
                    assert_eq!(wait(&rx).0.len(), 4);
                }
            }
            for (_g, rx) in in_flight {
                assert_eq!(wait(&rx).0.len(), 4);
            }
            sent
        })
    };
    assert_eq!(wait(&big_rx).0.len(), 70);
    done.store(true, std::sync::atomic::Ordering::Relaxed);
    let sent = feeder.join().unwrap();
    assert!(
        sent < MOST,
        "the request that stepped back finished only once the others stopped coming"
    );
    assert!(metric(&e, "kura:kv_pins_demoted_total") >= 1.0);
    e.stop();
}

/// A request whose blocks fit the logical pool but whose pages do not is refused at submission, naming
/// the pages. A prompt of that size was queued, and its admission never found the pages, so that it and
/// every request behind it waited for ever; one whose output would outgrow them ran and then failed
/// ("needs 76 KV blocks at once but the pool has only 80" before that was told in pages).
#[test]
fn a_request_too_large_for_the_pages_is_refused_at_submission() {
    let model = tiny("tiny-qwen2-swa");
    let e = engine(&model, 2, 80, 64);
    // 152 tokens of prompt and one to generate: 76 of the 80 logical blocks, their 76 pages of the full
    // layer and 5 of the sliding one (the blocks a window overlaps). Then 20 of prompt and 136 of output:
    // 78 blocks, 83 pages.
    for (prompt_len, max_tokens, needed) in [(152, 1, "81 KV pages"), (20, 136, "83 KV pages")] {
        let mut r = GenerateRequest::greedy(prompt(prompt_len, 13), max_tokens);
        r.ignore_eos = true;
        let err = e
            .submit(r, |_| true)
            .expect_err("a request larger than the pool's pages is refused");
        let text = err.to_string();
        assert!(
            text.contains(needed) && text.contains("holds 80 pages"),
            "{text}"
        );
    }
    // The largest that fits, 75 blocks (150 tokens of KV) and 80 pages, runs to its end; it is what
    // the pool is said to hold (a default `max_tokens` is bounded by it).
    assert_eq!(e.info().pool_tokens(), 150);
    let mut r = GenerateRequest::greedy(prompt(140, 13), 11);
    r.ignore_eos = true;
    assert!(e.submit(r, |_| true).is_ok());
    let (tokens, _) = run(&e, &prompt(140, 14), "s", 11);
    assert_eq!(tokens.len(), 11);
    let (tokens, _) = run(&e, &prompt(10, 15), "s", 3);
    assert_eq!(tokens.len(), 3);
    e.stop();
}
