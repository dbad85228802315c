//! A real `kura-server` on a loopback port in front of the real engine loop, with a small deterministic
//! stand-in model (the only mock: the real model is exercised by the Python tests). The stand-in's
//! next token is a function of the prompt's sum and the position, its text one letter per token, and it
//! can be told to be slow, to panic, or to block tokenization until released.

#![allow(dead_code)]

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use kura_engine::{
    start_engine, ChatMessage, EngineConfig, EngineHandle, ExecError, Executor, SchedulingPolicy,
    SeqInput, TextCodec,
};
use kura_server::{ConnLimits, ServeError, ServerConfig};
use tokio::sync::oneshot;

pub const VOCAB: usize = 64;
pub const BLOCK: usize = 4;
/// The stand-in's end-of-sequence token; it never samples it (see `logits`).
pub const EOS: u32 = 0;

/// How the stand-in model behaves.
#[derive(Debug, Clone, Default)]
pub struct Behaviour {
    /// Sleep this long in every forward call (to keep requests running).
    pub step_delay: Duration,
    /// Panic in this forward call (1-based), if set.
    pub panic_at_forward: Option<usize>,
    /// Return this error from this forward call (1-based), if set.
    pub fail_at_forward: Option<(usize, ExecError)>,
    /// Bytes of text each generated token decodes to (default 1).
    pub token_text_bytes: usize,
}

pub struct FakeModel {
    behaviour: Behaviour,
    forwards: usize,
}

impl Executor for FakeModel {
    fn forward(&mut self, batch: &[SeqInput<'_>]) -> Result<Vec<Vec<f32>>, ExecError> {
        self.forwards += 1;
        if self.behaviour.panic_at_forward == Some(self.forwards) {
            panic!("stand-in model failure at forward call {}", self.forwards);
        }
        if let Some((at, error)) = &self.behaviour.fail_at_forward {
            if *at == self.forwards {
                return Err(error.clone());
            }
        }
        if !self.behaviour.step_delay.is_zero() {
            // Paces the stand-in (keeps a long request running); no test waits on it for a state.
            std::thread::sleep(self.behaviour.step_delay);
        }
        Ok(batch
            .iter()
            .map(|s| {
                let last = s.start_pos + s.tokens.len() - 1;
                let sum: usize = s.tokens.iter().map(|&t| t as usize).sum();
                let mut logits = vec![0.0; VOCAB];
                logits[(sum * 7 + last) % (VOCAB - 1) + 1] = 10.0;
                logits
            })
            .collect())
    }

    /// Every position's row as `forward` would give it for the tokens up to there (the last row is
    /// `forward`'s): what scoring a prompt (`echo` with `logprobs`) needs.
    fn forward_every_position(&mut self, item: SeqInput<'_>) -> Result<Vec<f32>, ExecError> {
        let mut rows = vec![0.0; item.tokens.len() * VOCAB];
        let mut sum = 0usize;
        for (i, &t) in item.tokens.iter().enumerate() {
            sum += t as usize;
            rows[i * VOCAB + (sum * 7 + item.start_pos + i) % (VOCAB - 1) + 1] = 10.0;
        }
        Ok(rows)
    }

    fn copy_block_prefix(
        &mut self,
        _src: u32,
        _dst: u32,
        _num_tokens: usize,
    ) -> Result<(), ExecError> {
        Ok(())
    }
}

/// A gate that tokenization waits at while closed (to prove it runs off the async workers).
#[derive(Debug, Default)]
pub struct Gate {
    open: Mutex<bool>,
    cond: Condvar,
    pub waiting: AtomicUsize,
}

impl Gate {
    pub fn closed() -> Arc<Self> {
        Arc::new(Self::default())
    }

    pub fn open() -> Arc<Self> {
        let g = Self::default();
        *g.open.lock().unwrap() = true;
        Arc::new(g)
    }

    pub fn release(&self) {
        *self.open.lock().unwrap() = true;
        self.cond.notify_all();
    }

    fn pass(&self) {
        self.waiting.fetch_add(1, Ordering::SeqCst);
        let mut open = self.open.lock().unwrap();
        while !*open {
            open = self.cond.wait(open).unwrap();
        }
        self.waiting.fetch_sub(1, Ordering::SeqCst);
    }
}

pub struct FakeCodec {
    gate: Arc<Gate>,
    token_text_bytes: usize,
}

impl TextCodec for FakeCodec {
    fn encode(&self, text: &str) -> Result<Vec<u32>, String> {
        self.gate.pass();
        Ok(text
            .bytes()
            .map(|b| u32::from(b) % (VOCAB as u32 - 1) + 1)
            .collect())
    }

    fn encode_chat(&self, messages: &[ChatMessage]) -> Result<Vec<u32>, String> {
        let text = self.render_chat(messages)?;
        self.encode(&text)
    }

    /// No special tokens: nothing to keep apart.
    fn chat_content_spans(
        &self,
        _text: &str,
        _from: usize,
        _messages: &[ChatMessage],
    ) -> Result<Vec<std::ops::Range<usize>>, String> {
        Ok(Vec::new())
    }

    fn encode_with_plain_spans(
        &self,
        text: &str,
        _plain: &[std::ops::Range<usize>],
    ) -> Result<Vec<u32>, String> {
        self.encode(text)
    }

    fn decode(&self, ids: &[u32]) -> String {
        ids.iter()
            .filter(|&&t| t != EOS)
            .map(|&t| {
                let c = char::from(b'a' + (t % 26) as u8);
                c.to_string().repeat(self.token_text_bytes.max(1))
            })
            .collect()
    }

    fn token_bytes(&self, id: u32) -> Vec<u8> {
        self.decode(&[id]).into_bytes()
    }

    fn render_chat(&self, messages: &[ChatMessage]) -> Result<String, String> {
        Ok(messages
            .iter()
            .map(|m| format!("<{}>{}", m.role, m.content))
            .collect::<String>()
            + "<assistant>")
    }

    fn eos_token_ids(&self) -> &[u32] {
        &[EOS]
    }

    fn vocab_size(&self) -> usize {
        VOCAB
    }
}

/// Engine settings of a test server.
#[derive(Debug, Clone)]
pub struct Setup {
    pub num_blocks: usize,
    pub max_model_len: usize,
    pub behaviour: Behaviour,
    pub server: ServerConfig,
    pub policy: SchedulingPolicy,
    pub stalled_client_timeout: Duration,
}

impl Default for Setup {
    fn default() -> Self {
        Self {
            num_blocks: 4096,
            max_model_len: 8192,
            behaviour: Behaviour::default(),
            server: ServerConfig {
                conn: ConnLimits::default(),
                ..ServerConfig::default()
            },
            policy: SchedulingPolicy::Fcfs,
            stalled_client_timeout: Duration::from_secs(30),
        }
    }
}

/// A running server: its address, engine handle, and how to stop it.
pub struct TestServer {
    pub addr: SocketAddr,
    pub engine: EngineHandle,
    pub gate: Arc<Gate>,
    shutdown: Option<oneshot::Sender<()>>,
    pub done: Option<tokio::task::JoinHandle<Result<(), ServeError>>>,
}

impl TestServer {
    pub async fn start(setup: Setup) -> Self {
        Self::start_gated(setup, Gate::open()).await
    }

    pub async fn start_gated(setup: Setup, gate: Arc<Gate>) -> Self {
        let token_text_bytes = setup.behaviour.token_text_bytes;
        let engine = start_engine(
            EngineConfig {
                model_name: "fake".into(),
                max_model_len: setup.max_model_len,
                block_size_tokens: BLOCK,
                num_blocks: setup.num_blocks,
                max_num_seqs: 64,
                max_num_batched_tokens: 512,
                max_queue: 256,
                enable_prefix_caching: true,
                model_fingerprint: "fake".into(),
                scheduling_policy: setup.policy,
                stalled_client_timeout: setup.stalled_client_timeout,
                ..EngineConfig::default()
            },
            Box::new(FakeModel {
                behaviour: setup.behaviour,
                forwards: 0,
            }),
            Arc::new(FakeCodec {
                gate: gate.clone(),
                token_text_bytes,
            }),
        )
        .expect("engine starts");
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (tx, rx) = oneshot::channel::<()>();
        let done = tokio::spawn(kura_server::serve(
            listener,
            engine.clone(),
            setup.server,
            async move {
                let _ = rx.await;
            },
        ));
        Self {
            addr,
            engine,
            gate,
            shutdown: Some(tx),
            done: Some(done),
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    /// Sends the shutdown signal and returns what `serve` returned.
    pub async fn shutdown(&mut self) -> Result<(), ServeError> {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        self.done.take().expect("not yet stopped").await.unwrap()
    }

    pub fn metric(&self, name: &str) -> f64 {
        metric_of(&self.engine.metrics().render_prometheus(), name)
    }

    /// Waits until no KV block is in use (the engine frees a cancelled request's blocks).
    pub async fn wait_blocks_free(&self, within: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + within;
        while tokio::time::Instant::now() < deadline {
            if self.metric("kura:kv_cache_blocks_used") == 0.0
                && self.metric("kura:num_requests_running") == 0.0
            {
                return true;
            }
            // Poll interval: `within` only turns a hang into a failure.
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        false
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        self.engine.stop();
    }
}

/// The value of an unlabelled sample in Prometheus text.
pub fn metric_of(text: &str, name: &str) -> f64 {
    text.lines()
        .find_map(|l| {
            let (n, v) = l.rsplit_once(' ')?;
            (n == name).then(|| v.parse().ok()).flatten()
        })
        .unwrap_or_else(|| panic!("no metric {name} in:\n{text}"))
}

pub fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(20))
        .build()
        .unwrap()
}
