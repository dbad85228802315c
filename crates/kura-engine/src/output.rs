//! The output stage: a thread beside the engine loop that turns sampled token ids into what clients read
//! (incremental detokenization, stop strings, the texts and bytes of logprob candidates) and hands the
//! events to the requests' sinks, so that the engine loop spends its time between forward passes on
//! scheduling and sampling only.
//!
//! ```text
//!  engine loop ──OutMsg──► output thread ──EngineEvent──► request's sink (the server's stream)
//!       ▲                        │ stop string matched: the choice is finished here, and
//!       └──── finished choices ◄─┘ the engine frees its blocks at its next step
//! ```
//!
//! Every event of a request passes through the one channel, so clients see them in the order the engine
//! made them. The engine loop checks its sinks for backpressure only once this stage has handled every
//! message of the step before last: the text of one step is made while the next is computed, and a
//! request whose sink fills is stepped at most once more. Stop tokens, `max_tokens` and the context limit are the engine's (token decisions); stop
//! strings are this stage's. A choice finished by a stop string may have sampled a token or two more
//! before the engine hears of it: those are dropped here, and the request's usage counts the tokens its
//! client received.

use std::collections::HashMap;
use std::panic::{self, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, Sender};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use kura_text::{StopChecker, StopReason};

use crate::backend::TextCodec;
use crate::request::{
    EngineEvent, EventSink, FinishReason, PromptLogprobs, RequestError, TokenCandidate,
    TokenLogprob, Usage,
};
use crate::seq::Detokenizer;

/// A request's sink, shared by the output thread (which sends) and the engine loop (which asks whether
/// the client is behind before each step).
pub(crate) struct SinkSlot {
    sink: Mutex<Box<dyn EventSink>>,
    open: AtomicBool,
}

impl SinkSlot {
    pub fn new(sink: Box<dyn EventSink>) -> Arc<Self> {
        Arc::new(Self {
            sink: Mutex::new(sink),
            open: AtomicBool::new(true),
        })
    }

    /// Sends one event; a sink whose reader is gone is marked closed (the engine then cancels).
    pub fn send(&self, event: EngineEvent) {
        if !self.is_open() {
            return;
        }
        let mut sink = self.sink.lock().unwrap_or_else(|e| e.into_inner());
        if !sink.send(event) {
            self.open.store(false, Ordering::Release);
        }
    }

    pub fn is_open(&self) -> bool {
        self.open.load(Ordering::Acquire)
    }

    pub fn is_full(&self) -> bool {
        self.is_open()
            && self
                .sink
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .is_full()
    }
}

/// What the engine loop tells the output stage.
pub(crate) enum OutMsg {
    /// A new request: where its events go, the stop strings of its choices, and how many tokens of
    /// each come before any stop string is looked for (`min_tokens`).
    Open {
        id: u64,
        slot: Arc<SinkSlot>,
        stop: Vec<String>,
        min_tokens: u32,
        /// A stop string that ends a choice is part of its text (`include_stop_str_in_output`).
        include_stop_str: bool,
        /// The text keeps special tokens (`skip_special_tokens: false`).
        keep_special: bool,
    },
    /// A sampled token of one choice. `stop_token`: it ends the choice and is not part of the text;
    /// `last`: the engine ends the choice after it, for this reason (`Length`: `max_tokens` or the
    /// context; `Stop`: its grammar is complete).
    Token {
        id: u64,
        choice: u32,
        token: u32,
        logprob: Option<crate::sampling::TokenLogprob>,
        stop_token: bool,
        last: Option<FinishReason>,
    },
    /// A choice ended without a token (`max_tokens` 0: a prompt scored only).
    Ended {
        id: u64,
        choice: u32,
        reason: FinishReason,
    },
    /// The request's prompt is scored: its first token, and the scores of the others.
    PromptLogprobs {
        id: u64,
        first: u32,
        rest: Vec<crate::sampling::TokenLogprob>,
        ranks: Vec<u32>,
    },
    /// The request's prompt is computed: its usage so far (the cache split).
    Prompted { id: u64, usage: Usage },
    /// Every choice has finished in the engine.
    Done { id: u64, usage: Usage },
    /// The request failed or was cancelled with a reason its client is told.
    Failed { id: u64, error: RequestError },
    /// The request is gone without a word (its client went away).
    Forget { id: u64 },
}

#[derive(Default)]
struct ChoiceState {
    detok: Detokenizer,
    stop: StopChecker,
    finished: bool,
    /// Tokens the client received.
    tokens: u32,
}

struct RequestState {
    slot: Arc<SinkSlot>,
    stop: Vec<String>,
    /// Stop strings are looked for in the text of a choice's tokens after its first `min_tokens`.
    min_tokens: u32,
    /// A stop string that ends a choice is part of its text.
    include_stop_str: bool,
    /// The text keeps special tokens.
    keep_special: bool,
    choices: HashMap<u32, ChoiceState>,
}

/// How many messages the output stage has handled, which the engine loop waits on (blocked, not
/// spinning) for its backpressure check.
pub(crate) struct Handled {
    state: Mutex<HandledState>,
    /// Signalled when `done` reaches the count a waiter asked for.
    reached: Condvar,
}

struct HandledState {
    done: u64,
    /// The count the engine loop waits for; `u64::MAX` while it waits for none (the output thread then
    /// signals nobody).
    wanted: u64,
}

impl Handled {
    pub fn new() -> Arc<Self> {
        Arc::new(Self {
            state: Mutex::new(HandledState {
                done: 0,
                wanted: u64::MAX,
            }),
            reached: Condvar::new(),
        })
    }

    /// The output thread handled one more message.
    fn one_more(&self) {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        s.done += 1;
        if s.done >= s.wanted {
            self.reached.notify_all();
        }
    }

    /// Messages handled so far.
    #[cfg(test)]
    fn done(&self) -> u64 {
        self.state.lock().unwrap_or_else(|e| e.into_inner()).done
    }

    /// Blocks until `target` messages are handled or `timeout` has passed; returns whether they were.
    pub fn wait_for(&self, target: u64, timeout: Duration) -> bool {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if s.done >= target {
            return true;
        }
        let deadline = Instant::now() + timeout;
        s.wanted = target;
        while s.done < target {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            s = self
                .reached
                .wait_timeout(s, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        s.wanted = u64::MAX;
        s.done >= target
    }
}

/// The output thread's loop: until the engine drops its sender.
/// `handled` counts the messages handled, for the engine loop's backpressure check.
pub(crate) fn run(
    rx: Receiver<OutMsg>,
    codec: Arc<dyn TextCodec>,
    finished: Sender<(u64, u32)>,
    handled: Arc<Handled>,
) {
    let mut requests: HashMap<u64, RequestState> = HashMap::new();
    for msg in rx {
        // A sink that panics must not take the other requests' output with it.
        let _ = panic::catch_unwind(AssertUnwindSafe(|| {
            handle(msg, &mut requests, &codec, &finished)
        }));
        handled.one_more();
    }
}

fn handle(
    msg: OutMsg,
    requests: &mut HashMap<u64, RequestState>,
    codec: &Arc<dyn TextCodec>,
    finished: &Sender<(u64, u32)>,
) {
    match msg {
        OutMsg::Open {
            id,
            slot,
            stop,
            min_tokens,
            include_stop_str,
            keep_special,
        } => {
            requests.insert(
                id,
                RequestState {
                    slot,
                    stop,
                    min_tokens,
                    include_stop_str,
                    keep_special,
                    choices: HashMap::new(),
                },
            );
        }
        OutMsg::Token {
            id,
            choice,
            token,
            logprob,
            stop_token,
            last,
        } => {
            let Some(r) = requests.get_mut(&id) else {
                return;
            };
            let stop = &r.stop;
            let keep_special = r.keep_special;
            let c = r.choices.entry(choice).or_insert_with(|| ChoiceState {
                stop: StopChecker::new(Vec::new(), stop.clone()),
                detok: Detokenizer::keeping_special(keep_special),
                ..ChoiceState::default()
            });
            if c.finished {
                return;
            }
            c.tokens += 1;
            let checked = c.tokens > r.min_tokens;
            let include = r.include_stop_str;
            let (mut text, finish) = text_of(c, codec, token, stop_token, last, checked, include);
            if let (true, Some((_, Some(s)))) = (include, &finish) {
                text.push_str(s);
            }
            if finish.is_some() {
                c.finished = true;
                if !stop_token && last.is_none() {
                    // A stop string: the engine has not ended this choice; it frees it at its next step.
                    let _ = finished.send((id, choice));
                }
            }
            let logprobs: Vec<TokenLogprob> = logprob
                .map(|lp| with_texts(codec, &lp, keep_special))
                .into_iter()
                .collect();
            r.slot.send(EngineEvent::Delta {
                choice,
                text,
                token_ids: vec![token],
                logprobs,
            });
            if let Some((reason, stop_sequence)) = finish {
                r.slot.send(EngineEvent::Finished {
                    choice,
                    reason,
                    stop_sequence,
                });
            }
        }
        OutMsg::Ended { id, choice, reason } => {
            let Some(r) = requests.get_mut(&id) else {
                return;
            };
            let c = r.choices.entry(choice).or_default();
            if !c.finished {
                c.finished = true;
                r.slot.send(EngineEvent::Finished {
                    choice,
                    reason,
                    stop_sequence: None,
                });
            }
        }
        OutMsg::PromptLogprobs {
            id,
            first,
            rest,
            ranks,
        } => {
            if let Some(r) = requests.get(&id) {
                let logprobs = PromptLogprobs {
                    first: candidate(codec, first, 0.0, false),
                    rest: rest.iter().map(|lp| with_texts(codec, lp, false)).collect(),
                    ranks,
                };
                r.slot.send(EngineEvent::PromptLogprobs {
                    prompt: 0,
                    logprobs: Arc::new(logprobs),
                });
            }
        }
        OutMsg::Prompted { id, usage } => {
            if let Some(r) = requests.get(&id) {
                r.slot.send(EngineEvent::Prompted { usage });
            }
        }
        OutMsg::Done { id, mut usage } => {
            if let Some(r) = requests.remove(&id) {
                usage.completion_tokens = r.choices.values().map(|c| c.tokens).sum();
                r.slot.send(EngineEvent::Done { usage });
            }
        }
        OutMsg::Failed { id, error } => {
            if let Some(r) = requests.remove(&id) {
                r.slot.send(EngineEvent::Failed(error));
            }
        }
        OutMsg::Forget { id } => {
            requests.remove(&id);
        }
    }
}

/// A token with its text and bytes, as clients read it: a special token's text kept when the
/// output keeps them (`skip_special_tokens: false`), as the choice's text does.
fn candidate(
    codec: &Arc<dyn TextCodec>,
    token_id: u32,
    logprob: f32,
    keep_special: bool,
) -> TokenCandidate {
    TokenCandidate {
        token_id,
        text: crate::seq::decode(codec, &[token_id], keep_special),
        bytes: codec.token_bytes(token_id),
        logprob,
    }
}

/// A token's scores with the texts and bytes of the token and its alternatives.
fn with_texts(
    codec: &Arc<dyn TextCodec>,
    lp: &crate::sampling::TokenLogprob,
    keep_special: bool,
) -> TokenLogprob {
    TokenLogprob {
        sampled: candidate(codec, lp.token, lp.logprob, keep_special),
        top: lp
            .top
            .iter()
            .map(|&(t, l)| candidate(codec, t, l, keep_special))
            .collect(),
    }
}

/// The text a token adds to its choice, and whether it ends it (with the stop string that ended it).
/// `checked`: stop strings are looked for in its text (past the request's `min_tokens`);
/// `include_stop`: a stop token's own text is part of it (`include_stop_str_in_output`; a special
/// one's only where the output keeps special tokens).
fn text_of(
    c: &mut ChoiceState,
    codec: &Arc<dyn TextCodec>,
    token: u32,
    stop_token: bool,
    last: Option<FinishReason>,
    checked: bool,
    include_stop: bool,
) -> (String, Option<(FinishReason, Option<String>)>) {
    let matched = |s: Option<StopReason>| match s {
        Some(StopReason::String(s)) => Some(s),
        _ => None,
    };
    let push = |stop: &mut StopChecker, text: &str| match checked {
        true => stop.push(text),
        false => (text.to_string(), None),
    };
    if stop_token {
        // The stop token's own text is not part of the output (unless asked); release what was
        // held back.
        let mut rest = match include_stop {
            true => c.detok.push(codec, token),
            false => String::new(),
        };
        rest.push_str(&c.detok.flush(codec));
        let (mut out, stopped) = push(&mut c.stop, &rest);
        if stopped.is_some() {
            return (out, Some((FinishReason::Stop, matched(stopped))));
        }
        out.push_str(&c.stop.flush());
        return (out, Some((FinishReason::Stop, None)));
    }
    let piece = c.detok.push(codec, token);
    let (mut out, stopped) = push(&mut c.stop, &piece);
    if stopped.is_some() {
        return (out, Some((FinishReason::Stop, matched(stopped))));
    }
    let Some(reason) = last else {
        return (out, None);
    };
    let rest = c.detok.flush(codec);
    let (more, stopped) = push(&mut c.stop, &rest);
    out.push_str(&more);
    if stopped.is_some() {
        (out, Some((FinishReason::Stop, matched(stopped))))
    } else {
        out.push_str(&c.stop.flush());
        (out, Some((reason, None)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// CPU time this thread has used (user + system), from /proc; `None` where it cannot be read.
    fn thread_cpu() -> Option<Duration> {
        let stat = std::fs::read_to_string("/proc/thread-self/stat").ok()?;
        // The fields after the command name (which may hold spaces) in parentheses; utime and stime
        // are the 14th and 15th fields of the line, in clock ticks of 1/100 s on Linux.
        let rest = &stat[stat.rfind(')')? + 2..];
        let fields: Vec<&str> = rest.split(' ').collect();
        let ticks: u64 =
            fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?;
        Some(Duration::from_millis(ticks * 10))
    }

    #[test]
    fn a_count_already_reached_does_not_wait() {
        let h = Handled::new();
        assert!(h.wait_for(0, Duration::ZERO));
        h.one_more();
        h.one_more();
        assert_eq!(h.done(), 2);
        // Reached: true even with no time to wait.
        assert!(h.wait_for(2, Duration::ZERO));
        assert!(!h.wait_for(3, Duration::ZERO));
    }

    #[test]
    fn the_waiter_is_woken_when_its_count_is_reached() {
        let h = Handled::new();
        let h2 = h.clone();
        let worker = std::thread::spawn(move || {
            // Messages are handled only once the engine side is waiting for them, so the wait below
            // blocks and must be woken (it cannot find the count already reached).
            while h2.state.lock().unwrap().wanted != 3 {
                std::thread::yield_now();
            }
            for _ in 0..3 {
                h2.one_more();
            }
        });
        // The timeout is a patience limit only: true means the count was reached, not the time run out.
        assert!(h.wait_for(3, Duration::from_secs(600)));
        assert_eq!(h.done(), 3);
        worker.join().unwrap();
        // The wait is over: nobody is waited for, and more messages signal nobody.
        assert_eq!(h.state.lock().unwrap().wanted, u64::MAX);
        h.one_more();
        assert_eq!(h.done(), 4);
    }

    #[test]
    fn a_wait_ends_at_its_timeout_without_spinning() {
        let h = Handled::new();
        let cpu_before = thread_cpu();
        assert!(!h.wait_for(1, Duration::from_millis(400)));
        assert_eq!(h.state.lock().unwrap().wanted, u64::MAX);
        // A spinning wait would burn about the whole 400 ms of CPU; a blocked one next to nothing.
        // (Linux only: elsewhere the thread's CPU time is not read.)
        if cfg!(target_os = "linux") {
            let (before, after) = (cpu_before, thread_cpu());
            let (Some(before), Some(after)) = (before, after) else {
                panic!("/proc/thread-self/stat unreadable");
            };
            let used = after.saturating_sub(before);
            assert!(
                used < Duration::from_millis(100),
                "the wait used {used:?} of CPU"
            );
        }
    }
}
