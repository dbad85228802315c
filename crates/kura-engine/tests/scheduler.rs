//! The scheduler with a deterministic stand-in model, so that batches can be inspected: chunked prefill
//! mixed with decode in one forward call, the token budget and the sequence limit, and cached blocks
//! reused by a later request. The stand-in's next token depends on the last input token and its position,
//! so any mix-up of positions or block tables changes the output.

use std::sync::mpsc::{self, Receiver};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kura_engine::{
    start_engine, ChatMessage, EngineConfig, EngineEvent, EngineHandle, Executor, GenerateRequest,
    RequestGuard, SeqInput, TextCodec, Usage,
};

const VOCAB: usize = 64;
const BLOCK: usize = 4;

/// What one forward call contained: per item, (first position, number of tokens).
type Batch = Vec<(usize, usize)>;

struct FakeModel {
    batches: Arc<Mutex<Vec<Batch>>>,
    /// The token written at each (block, slot), to check that reads see what was written.
    kv: Vec<Option<u32>>,
}

impl Executor for FakeModel {
    fn forward(&mut self, batch: &[SeqInput<'_>]) -> Result<Vec<Vec<f32>>, String> {
        self.batches.lock().unwrap().push(
            batch
                .iter()
                .map(|s| (s.start_pos, s.tokens.len()))
                .collect(),
        );
        Ok(batch
            .iter()
            .map(|s| {
                for (i, &t) in s.tokens.iter().enumerate() {
                    let pos = s.start_pos + i;
                    let slot = s.block_table[pos / BLOCK] as usize * BLOCK + pos % BLOCK;
                    self.kv[slot] = Some(t);
                }
                // "Attention": the sum of every earlier token as read back through the block table.
                let last = s.start_pos + s.tokens.len() - 1;
                let sum: u32 = (0..=last)
                    .map(|p| {
                        let slot = s.block_table[p / BLOCK] as usize * BLOCK + p % BLOCK;
                        self.kv[slot].expect("every earlier position was written")
                    })
                    .sum();
                let mut logits = vec![0.0; VOCAB];
                logits[(sum as usize * 7 + last) % (VOCAB - 1) + 1] = 1.0;
                logits
            })
            .collect())
    }

    fn copy_block_prefix(&mut self, src: u32, dst: u32, num_tokens: usize) {
        for i in 0..num_tokens {
            self.kv[dst as usize * BLOCK + i] = self.kv[src as usize * BLOCK + i];
        }
    }
}

struct Letters;

impl TextCodec for Letters {
    fn encode(&self, text: &str) -> Result<Vec<u32>, String> {
        Ok(text.bytes().map(|b| u32::from(b) % VOCAB as u32).collect())
    }
    fn decode(&self, ids: &[u32]) -> String {
        ids.iter()
            .map(|&i| char::from(b'0' + (i % 64) as u8))
            .collect()
    }
    fn render_chat(&self, messages: &[ChatMessage]) -> Result<String, String> {
        Ok(messages.iter().map(|m| m.content.as_str()).collect())
    }
    fn encode_chat(&self, messages: &[ChatMessage]) -> Result<Vec<u32>, String> {
        self.encode(&self.render_chat(messages)?)
    }
    fn eos_token_ids(&self) -> &[u32] {
        &[0]
    }
    fn vocab_size(&self) -> usize {
        VOCAB
    }
}

fn engine(
    num_blocks: usize,
    budget: usize,
    max_num_seqs: usize,
) -> (EngineHandle, Arc<Mutex<Vec<Batch>>>) {
    let batches = Arc::new(Mutex::new(Vec::new()));
    let model = FakeModel {
        batches: batches.clone(),
        kv: vec![None; num_blocks * BLOCK],
    };
    let e = start_engine(
        EngineConfig {
            model_name: "fake".into(),
            max_model_len: 4096,
            block_size_tokens: BLOCK,
            num_blocks,
            max_num_seqs,
            max_num_batched_tokens: budget,
            max_queue: 100,
            enable_prefix_caching: true,
            model_fingerprint: "fake".into(),
        },
        Box::new(model),
        Arc::new(Letters),
    )
    .unwrap();
    (e, batches)
}

fn submit(e: &EngineHandle, r: GenerateRequest) -> (RequestGuard, Receiver<EngineEvent>) {
    let (tx, rx) = mpsc::channel();
    let guard = e.submit(r, move |ev| tx.send(ev).is_ok()).unwrap();
    (guard, rx)
}

fn wait(rx: &Receiver<EngineEvent>) -> (Vec<u32>, Usage) {
    let mut tokens = Vec::new();
    loop {
        match rx.recv_timeout(Duration::from_secs(30)).unwrap() {
            EngineEvent::Delta { token_ids, .. } => tokens.extend(token_ids),
            EngineEvent::Finished { .. } => {}
            EngineEvent::Done { usage } => return (tokens, usage),
            EngineEvent::Failed(e) => panic!("{e}"),
        }
    }
}

fn request(prompt_len: u32, max_tokens: u32) -> GenerateRequest {
    let mut r = GenerateRequest::greedy((1..=prompt_len).map(|i| i % 60 + 1).collect(), max_tokens);
    r.ignore_eos = true;
    r
}

#[test]
fn prefill_chunks_and_decode_tokens_share_forward_calls_within_the_budget() {
    let (e, batches) = engine(1024, 16, 8);
    // A decodes for long enough (and is dropped once B is done).
    let (a, a_rx) = submit(&e, request(6, 3000));
    // Let A reach decode, then send a long prompt that needs several chunks.
    let first = a_rx.recv_timeout(Duration::from_secs(10)).unwrap();
    assert!(matches!(first, EngineEvent::Delta { .. }));
    let (_b, b_rx) = submit(&e, request(100, 3));
    let (b_tokens, b_usage) = wait(&b_rx);
    drop(a);
    let batches = batches.lock().unwrap().clone();
    assert!(batches
        .iter()
        .all(|b| b.iter().map(|&(_, n)| n).sum::<usize>() <= 16));
    let mixed = batches
        .iter()
        .filter(|b| b.len() == 2 && b.iter().any(|&(_, n)| n == 1) && b.iter().any(|&(_, n)| n > 1))
        .count();
    assert!(
        mixed >= 3,
        "decode and prefill chunks in the same call: {batches:?}"
    );
    assert_eq!(b_usage.prompt_tokens, 100);
    assert_eq!(b_tokens.len(), 3);

    // Chunked or not, cached or not, the same tokens: B alone on a fresh engine with a big budget.
    let (fresh, _) = engine(256, 4096, 8);
    let (_b2, rx) = submit(&fresh, request(100, 3));
    assert_eq!(wait(&rx).0, b_tokens);
    // And again on the same engine, from the cache (all whole blocks but the last token's).
    let (_b3, rx) = submit(&fresh, request(100, 3));
    let (tokens, usage) = wait(&rx);
    assert_eq!(tokens, b_tokens);
    assert_eq!(usage.cached_tokens, 99);
    e.stop();
    fresh.stop();
}

#[test]
fn at_most_max_num_seqs_run_at_once() {
    let (e, batches) = engine(256, 64, 2);
    let rxs: Vec<_> = (0..5).map(|i| submit(&e, request(5 + i, 6))).collect();
    for (_, rx) in &rxs {
        wait(rx);
    }
    let batches = batches.lock().unwrap();
    assert!(batches.iter().all(|b| b.len() <= 2), "{batches:?}");
    e.stop();
}

#[test]
fn n_choices_compute_the_prompt_once() {
    let (e, batches) = engine(256, 64, 8);
    let mut r = request(10, 5);
    r.n = 3;
    let (_g, rx) = submit(&e, r);
    let (tokens, usage) = wait(&rx);
    assert_eq!(usage.completion_tokens, 15);
    assert_eq!(tokens.len(), 15);
    // The prompt was computed once: one item covers positions 0..10, no other item starts before 10.
    let batches = batches.lock().unwrap();
    let prompt_items: Vec<_> = batches
        .iter()
        .flatten()
        .filter(|&&(start, _)| start < 10)
        .collect();
    assert_eq!(prompt_items, vec![&(0, 10)]);
    e.stop();
}
