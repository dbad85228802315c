//! The workloads: which prompts are sent, in which sessions, in what order.
//!
//! Every text comes from a named seeded stream ([`Rng::stream`]), so the same seed gives the same prompts:
//!
//! ```text
//! shared-prefix  group g:  [system g: S tokens][question (g,u): Q tokens]   for u in 0..users_per_group
//! multi-turn     conv c:   [system][u0][a0][u1][a1]...[u_t]                  each turn resends the history
//! long-doc                 [document: D tokens][question q: Q tokens]        for q in 0..questions
//! unique                   [prompt i: P tokens]                              nothing shared
//! trace (Mooncake)         [block id0][block id1]...                         512 tokens per hash id,
//!                                                                            equal ids give equal text
//! ```
//!
//! A session is a sequence of turns sent one after another; all workloads but multi-turn have one turn.
//!
//! Prompts without a system prompt of their own (unique, trace) are sent as the system message, followed
//! by the fixed user turn [`CONTINUE`]: otherwise chat templates that insert a default system prompt
//! (SmolLM2's does) would put a shared head in front of every "unique" prompt.

/// The user turn after a prompt sent as the system message.
pub const CONTINUE: &str = "Continue.";

use std::collections::HashMap;
use std::path::PathBuf;

use kura_trace::file::{read_trace, TraceFormat, MOONCAKE_BLOCK_TOKENS};
use serde::Serialize;
use serde_json::{json, Value};

use crate::rng::Rng;
use crate::text::{Sized, TokenCounter, TokenCounting};
use crate::BenchError;

/// Stream tags: the first element of every [`Rng::stream`] path, one per kind of text.
mod tag {
    pub const SYSTEM: u64 = 1;
    pub const QUESTION: u64 = 2;
    pub const TURN: u64 = 3;
    pub const DOCUMENT: u64 = 4;
    pub const UNIQUE: u64 = 5;
    pub const BLOCK: u64 = 6;
    pub const TRACE_PROMPT: u64 = 7;
    pub const ORDER: u64 = 8;
}

#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "workload", rename_all = "kebab-case")]
pub enum WorkloadSpec {
    SharedPrefix {
        groups: usize,
        users_per_group: usize,
        system_tokens: usize,
        question_tokens: usize,
        /// Send each group's users at the same instant, one group after another.
        burst: bool,
    },
    MultiTurn {
        conversations: usize,
        turns: usize,
        system_tokens: usize,
        user_tokens: usize,
    },
    LongDoc {
        doc_tokens: usize,
        questions: usize,
        question_tokens: usize,
    },
    Unique {
        requests: usize,
        prompt_tokens: usize,
    },
    Trace {
        path: PathBuf,
        format: TraceFormat,
        max_requests: Option<usize>,
        /// Arrival times are multiplied by this (0.1 replays ten times faster).
        time_scale: f64,
        /// Prompts longer than this are cut to it (whole blocks first), for models with short contexts.
        max_prompt_tokens: Option<usize>,
        max_output_tokens: Option<usize>,
    },
}

impl WorkloadSpec {
    pub fn name(&self) -> &'static str {
        match self {
            WorkloadSpec::SharedPrefix { .. } => "shared-prefix",
            WorkloadSpec::MultiTurn { .. } => "multi-turn",
            WorkloadSpec::LongDoc { .. } => "long-doc",
            WorkloadSpec::Unique { .. } => "unique",
            WorkloadSpec::Trace { .. } => "trace",
        }
    }

    /// Checks the figures a user gave; the message names the flag.
    pub fn validate(&self) -> Result<(), BenchError> {
        let positive = |v: usize, flag: &str| {
            if v == 0 {
                Err(BenchError::Config(format!("{flag} must be at least 1")))
            } else {
                Ok(())
            }
        };
        match self {
            WorkloadSpec::SharedPrefix {
                groups,
                users_per_group,
                question_tokens,
                ..
            } => {
                positive(*groups, "--groups")?;
                positive(*users_per_group, "--users-per-group")?;
                positive(*question_tokens, "--question-tokens")
            }
            WorkloadSpec::MultiTurn {
                conversations,
                turns,
                user_tokens,
                ..
            } => {
                positive(*conversations, "--conversations")?;
                positive(*turns, "--turns")?;
                positive(*user_tokens, "--user-tokens")
            }
            WorkloadSpec::LongDoc {
                doc_tokens,
                questions,
                question_tokens,
            } => {
                positive(*doc_tokens, "--doc-tokens")?;
                positive(*questions, "--questions")?;
                positive(*question_tokens, "--question-tokens")
            }
            WorkloadSpec::Unique {
                requests,
                prompt_tokens,
            } => {
                positive(*requests, "--requests")?;
                positive(*prompt_tokens, "--prompt-tokens")
            }
            WorkloadSpec::Trace {
                time_scale,
                max_requests,
                max_prompt_tokens,
                max_output_tokens,
                ..
            } => {
                if !(time_scale.is_finite() && *time_scale >= 0.0) {
                    return Err(BenchError::Config(format!(
                        "--time-scale must be a number >= 0, got {time_scale}"
                    )));
                }
                for (v, flag) in [
                    (max_requests, "--max-requests"),
                    (max_prompt_tokens, "--max-prompt-tokens"),
                    (max_output_tokens, "--max-output-tokens"),
                ] {
                    if let Some(v) = v {
                        positive(*v, flag)?;
                    }
                }
                Ok(())
            }
        }?;
        self.check_size()
    }

    /// That the texts and the number of requests stay within what a client builds in memory (as
    /// `kura sim` bounds the same workloads): every text at most [`MAX_TEXT_TOKENS`] tokens, at most
    /// [`MAX_REQUESTS`] requests and [`MAX_BUILT_TOKENS`] tokens in all.
    fn check_size(&self) -> Result<(), BenchError> {
        // (value, flag) pairs: each text's tokens, and the counts whose product is the requests; and
        // the tokens the texts a run builds before it sends anything hold (every session's own copy
        // of each), `None` past a usize.
        type Flags = Vec<(usize, &'static str)>;
        let (texts, counts, built): (Flags, Flags, Option<usize>) = match *self {
            WorkloadSpec::SharedPrefix {
                groups,
                users_per_group,
                system_tokens,
                question_tokens,
                ..
            } => (
                vec![
                    (system_tokens, "--system-tokens"),
                    (question_tokens, "--question-tokens"),
                ],
                vec![(groups, "--groups"), (users_per_group, "--users-per-group")],
                groups
                    .checked_mul(users_per_group)
                    .and_then(|n| n.checked_mul(system_tokens.checked_add(question_tokens)?)),
            ),
            WorkloadSpec::MultiTurn {
                conversations,
                turns,
                system_tokens,
                user_tokens,
            } => (
                vec![
                    (system_tokens, "--system-tokens"),
                    (user_tokens, "--user-tokens"),
                ],
                vec![(conversations, "--conversations"), (turns, "--turns")],
                turns
                    .checked_mul(user_tokens)
                    .and_then(|t| t.checked_add(system_tokens))
                    .and_then(|t| t.checked_mul(conversations)),
            ),
            WorkloadSpec::LongDoc {
                doc_tokens,
                questions,
                question_tokens,
            } => (
                vec![
                    (doc_tokens, "--doc-tokens"),
                    (question_tokens, "--question-tokens"),
                ],
                vec![(questions, "--questions")],
                doc_tokens
                    .checked_add(question_tokens)
                    .and_then(|t| t.checked_mul(questions)),
            ),
            WorkloadSpec::Unique {
                requests,
                prompt_tokens,
            } => (
                vec![(prompt_tokens, "--prompt-tokens")],
                vec![(requests, "--requests")],
                requests.checked_mul(prompt_tokens),
            ),
            WorkloadSpec::Trace {
                max_prompt_tokens, ..
            } => (
                max_prompt_tokens
                    .map(|n| (n, "--max-prompt-tokens"))
                    .into_iter()
                    .collect(),
                vec![],
                Some(0),
            ),
        };
        if let Some((n, flag)) = texts.iter().find(|(n, _)| *n > MAX_TEXT_TOKENS) {
            return Err(BenchError::Config(format!(
                "{flag} {n}: a text may hold at most {MAX_TEXT_TOKENS} tokens"
            )));
        }
        let requests = counts
            .iter()
            .try_fold(1usize, |all, (n, _)| all.checked_mul(*n))
            .filter(|n| *n <= MAX_REQUESTS);
        if requests.is_none() {
            let flags: Vec<String> = counts.iter().map(|(n, f)| format!("{f} {n}")).collect();
            return Err(BenchError::Config(format!(
                "{} make more than the {MAX_REQUESTS} requests a run may send",
                flags.join(" × ")
            )));
        }
        if built.is_none_or(|n| n > MAX_BUILT_TOKENS) {
            return Err(BenchError::Config(format!(
                "the {} workload's prompts hold more than {MAX_BUILT_TOKENS} tokens in all, which a \
                 run builds before it sends them: give fewer requests or shorter texts",
                self.name()
            )));
        }
        Ok(())
    }

    pub fn params(&self) -> Value {
        serde_json::to_value(self).unwrap_or(Value::Null)
    }
}

/// The most tokens one text of a workload may hold (a prompt a client builds in memory).
pub const MAX_TEXT_TOKENS: usize = 1 << 24;

/// The most requests one workload may make.
pub const MAX_REQUESTS: usize = 1 << 24;

/// The most tokens the prompts of one workload may hold in all (each session's copy of a shared text
/// counted): a run builds them before it sends anything.
pub const MAX_BUILT_TOKENS: usize = 1 << 27;

/// The longest a trace replay may last, in milliseconds (a week of real time).
pub const MAX_REPLAY_MS: f64 = 7.0 * 86_400_000.0;

/// One user turn: the new text and how many tokens to generate for it.
#[derive(Debug, Clone)]
pub struct Turn {
    pub user: Sized,
    pub max_tokens: u32,
}

#[derive(Debug, Clone)]
pub struct Session {
    pub id: usize,
    pub group: Option<usize>,
    /// Trace replays: when the session's first request is sent, after the run's start.
    pub arrival_ms: Option<f64>,
    pub system: Option<Sized>,
    pub turns: Vec<Turn>,
}

/// A built workload, ready to send.
#[derive(Debug, Clone)]
pub struct Workload {
    pub name: &'static str,
    pub params: Value,
    pub sessions: Vec<Session>,
    pub counting: TokenCounting,
    /// Shared-prefix burst: the runner sends each group at one instant, group after group.
    pub burst: bool,
    /// Facts a reader of the report needs (cuts made to a trace, for example).
    pub notes: Vec<String>,
}

impl Workload {
    pub fn requests(&self) -> usize {
        self.sessions.iter().map(|s| s.turns.len()).sum()
    }
}

/// Builds the prompts of `spec` with seed `seed`, counting tokens with `counter`.
pub async fn build(
    spec: &WorkloadSpec,
    output_tokens: u32,
    seed: u64,
    counter: &TokenCounter,
) -> Result<Workload, BenchError> {
    spec.validate()?;
    let text = |path: &[u64], tokens: usize| counter.text_of(Rng::stream(seed, path), tokens);
    let mut sessions = Vec::new();
    let mut notes = Vec::new();
    let mut burst = false;
    let cont = counter.sized(CONTINUE).await?;
    match spec {
        WorkloadSpec::SharedPrefix {
            groups,
            users_per_group,
            system_tokens,
            question_tokens,
            burst: b,
        } => {
            burst = *b;
            for g in 0..*groups {
                let system = text(&[tag::SYSTEM, g as u64], *system_tokens).await?;
                for u in 0..*users_per_group {
                    let question =
                        text(&[tag::QUESTION, g as u64, u as u64], *question_tokens).await?;
                    sessions.push(Session {
                        id: sessions.len(),
                        group: Some(g),
                        arrival_ms: None,
                        system: Some(system.clone()),
                        turns: vec![Turn {
                            user: question,
                            max_tokens: output_tokens,
                        }],
                    });
                }
            }
            if !burst {
                // Interleave the groups (seeded) so that a group's users do not all arrive back to back.
                shuffle(&mut sessions, &mut Rng::stream(seed, &[tag::ORDER]));
            }
        }
        WorkloadSpec::MultiTurn {
            conversations,
            turns,
            system_tokens,
            user_tokens,
        } => {
            for c in 0..*conversations {
                let system = if *system_tokens > 0 {
                    Some(text(&[tag::SYSTEM, c as u64], *system_tokens).await?)
                } else {
                    None
                };
                let mut ts = Vec::new();
                for t in 0..*turns {
                    ts.push(Turn {
                        user: text(&[tag::TURN, c as u64, t as u64], *user_tokens).await?,
                        max_tokens: output_tokens,
                    });
                }
                sessions.push(Session {
                    id: c,
                    group: Some(c),
                    arrival_ms: None,
                    system,
                    turns: ts,
                });
            }
        }
        WorkloadSpec::LongDoc {
            doc_tokens,
            questions,
            question_tokens,
        } => {
            let doc = text(&[tag::DOCUMENT], *doc_tokens).await?;
            for q in 0..*questions {
                sessions.push(Session {
                    id: q,
                    group: Some(0),
                    arrival_ms: None,
                    system: Some(doc.clone()),
                    turns: vec![Turn {
                        user: text(&[tag::QUESTION, 0, q as u64], *question_tokens).await?,
                        max_tokens: output_tokens,
                    }],
                });
            }
        }
        WorkloadSpec::Unique {
            requests,
            prompt_tokens,
        } => {
            for i in 0..*requests {
                sessions.push(Session {
                    id: i,
                    group: None,
                    arrival_ms: None,
                    system: Some(text(&[tag::UNIQUE, i as u64], *prompt_tokens).await?),
                    turns: vec![Turn {
                        user: cont.clone(),
                        max_tokens: output_tokens,
                    }],
                });
            }
        }
        WorkloadSpec::Trace {
            path,
            format,
            max_requests,
            time_scale,
            max_prompt_tokens,
            max_output_tokens,
        } => {
            let requests = read_trace(path, *format, *max_requests)?;
            let mut blocks: HashMap<(u64, usize), Sized> = HashMap::new();
            let (mut cut_prompts, mut cut_outputs) = (0usize, 0usize);
            for (i, r) in requests.iter().enumerate() {
                let input = match max_prompt_tokens {
                    Some(max) if r.input_tokens > *max => {
                        cut_prompts += 1;
                        *max
                    }
                    _ => r.input_tokens,
                };
                let output = match max_output_tokens {
                    Some(max) if r.output_tokens > *max => {
                        cut_outputs += 1;
                        *max
                    }
                    _ => r.output_tokens,
                }
                .max(1);
                let prompt = if r.hash_ids.is_empty() {
                    text(&[tag::TRACE_PROMPT, i as u64], input).await?
                } else {
                    let mut joined = Sized {
                        text: String::new(),
                        tokens: 0,
                    };
                    let mut left = input;
                    for &id in &r.hash_ids {
                        if left == 0 {
                            break;
                        }
                        let len = left.min(MOONCAKE_BLOCK_TOKENS);
                        let piece = match blocks.get(&(id, len)) {
                            Some(p) => p.clone(),
                            None => {
                                let p = text(&[tag::BLOCK, id], len).await?;
                                blocks.insert((id, len), p.clone());
                                p
                            }
                        };
                        joined.text.push_str(&piece.text);
                        joined.tokens += piece.tokens;
                        left -= len;
                    }
                    joined
                };
                let arrival_ms = r.arrival_ms * time_scale;
                if arrival_ms > MAX_REPLAY_MS {
                    return Err(BenchError::Config(format!(
                        "trace {}: request {} arrives {:.0} s into the replay (× --time-scale \
                         {time_scale}), past the week a replay may last; lower --time-scale or cut \
                         the trace",
                        path.display(),
                        i + 1,
                        arrival_ms / 1e3
                    )));
                }
                sessions.push(Session {
                    id: i,
                    group: None,
                    arrival_ms: Some(arrival_ms),
                    system: Some(prompt),
                    turns: vec![Turn {
                        user: cont.clone(),
                        max_tokens: u32::try_from(output).unwrap_or(u32::MAX),
                    }],
                });
            }
            notes.push(format!(
                "trace {} ({:?}): {} requests, arrival times × {time_scale}",
                path.display(),
                format,
                requests.len()
            ));
            if cut_prompts > 0 {
                notes.push(format!(
                    "{cut_prompts} prompts cut to --max-prompt-tokens {}",
                    max_prompt_tokens.unwrap_or(0)
                ));
            }
            if cut_outputs > 0 {
                notes.push(format!(
                    "{cut_outputs} outputs cut to --max-output-tokens {}",
                    max_output_tokens.unwrap_or(0)
                ));
            }
        }
    }
    let mut params = spec.params();
    if let Value::Object(map) = &mut params {
        if !matches!(spec, WorkloadSpec::Trace { .. }) {
            // A trace carries its own output lengths.
            map.insert("output_tokens".into(), json!(output_tokens));
        }
        map.insert("seed".into(), json!(seed));
    }
    Ok(Workload {
        name: spec.name(),
        params,
        sessions,
        counting: counter.counting(),
        burst,
        notes,
    })
}

fn shuffle<T>(items: &mut [T], rng: &mut Rng) {
    for i in (1..items.len()).rev() {
        items.swap(i, rng.below(i + 1));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn block_on<F: std::future::Future>(f: F) -> F::Output {
        tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("runtime")
            .block_on(f)
    }

    fn shared(burst: bool) -> WorkloadSpec {
        WorkloadSpec::SharedPrefix {
            groups: 3,
            users_per_group: 4,
            system_tokens: 40,
            question_tokens: 10,
            burst,
        }
    }

    fn prompts(w: &Workload) -> Vec<String> {
        w.sessions
            .iter()
            .map(|s| {
                let sys = s
                    .system
                    .as_ref()
                    .map(|t| t.text.clone())
                    .unwrap_or_default();
                let turns: Vec<&str> = s.turns.iter().map(|t| t.user.text.as_str()).collect();
                format!("{sys}|{}", turns.join("|"))
            })
            .collect()
    }

    #[test]
    fn workloads_past_what_a_client_builds_are_refused_naming_the_flag() {
        let cases = [
            (
                WorkloadSpec::Unique {
                    requests: 1,
                    prompt_tokens: usize::MAX,
                },
                "--prompt-tokens 18446744073709551615: a text may hold at most 16777216 tokens",
            ),
            (
                WorkloadSpec::LongDoc {
                    doc_tokens: MAX_TEXT_TOKENS + 1,
                    questions: 1,
                    question_tokens: 1,
                },
                "--doc-tokens 16777217",
            ),
            (
                WorkloadSpec::SharedPrefix {
                    groups: 1 << 13,
                    users_per_group: 1 << 12,
                    system_tokens: 10,
                    question_tokens: 10,
                    burst: false,
                },
                "--groups 8192 × --users-per-group 4096 make more than the 16777216 requests",
            ),
            (
                WorkloadSpec::MultiTurn {
                    conversations: usize::MAX,
                    turns: 2,
                    system_tokens: 0,
                    user_tokens: 10,
                },
                "make more than the 16777216 requests",
            ),
            (
                WorkloadSpec::Trace {
                    path: "t.jsonl".into(),
                    format: TraceFormat::Mooncake,
                    max_requests: Some(0),
                    time_scale: 1.0,
                    max_prompt_tokens: None,
                    max_output_tokens: None,
                },
                "--max-requests must be at least 1",
            ),
            (
                WorkloadSpec::Trace {
                    path: "t.jsonl".into(),
                    format: TraceFormat::Mooncake,
                    max_requests: None,
                    time_scale: 1.0,
                    max_prompt_tokens: Some(0),
                    max_output_tokens: None,
                },
                "--max-prompt-tokens must be at least 1",
            ),
        ];
        for (spec, expected) in cases {
            let e = spec.validate().unwrap_err().to_string();
            assert!(e.contains(expected), "{e}");
        }
        // Within each limit, but more text in all than a run builds.
        let e = WorkloadSpec::Unique {
            requests: MAX_REQUESTS,
            prompt_tokens: MAX_TEXT_TOKENS,
        }
        .validate()
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("the unique workload's prompts hold more than 134217728 tokens"),
            "{e}"
        );
        let e = WorkloadSpec::LongDoc {
            doc_tokens: 1 << 20,
            questions: 1 << 8,
            question_tokens: 1,
        }
        .validate()
        .unwrap_err()
        .to_string();
        assert!(e.contains("long-doc workload's prompts"), "{e}");
        // At the limits, accepted.
        let at = WorkloadSpec::Unique {
            requests: 1 << 11,
            prompt_tokens: 1 << 16,
        };
        assert!(at.validate().is_ok());
        let at = WorkloadSpec::Unique {
            requests: MAX_REQUESTS,
            prompt_tokens: 8,
        };
        assert!(at.validate().is_ok());
    }

    #[test]
    fn same_seed_same_prompts_other_seed_other_prompts() {
        let a = block_on(build(&shared(false), 8, 11, &TokenCounter::Approximate)).unwrap();
        let b = block_on(build(&shared(false), 8, 11, &TokenCounter::Approximate)).unwrap();
        let c = block_on(build(&shared(false), 8, 12, &TokenCounter::Approximate)).unwrap();
        assert_eq!(prompts(&a), prompts(&b));
        assert_ne!(prompts(&a), prompts(&c));
        assert_eq!(a.requests(), 12);
        assert_eq!(a.counting, TokenCounting::Approximate);
    }

    #[test]
    fn shared_prefix_groups_share_system_prompts_and_nothing_else() {
        let w = block_on(build(&shared(true), 8, 5, &TokenCounter::Approximate)).unwrap();
        assert!(w.burst);
        for s in &w.sessions {
            let same_group: Vec<&Session> =
                w.sessions.iter().filter(|o| o.group == s.group).collect();
            assert!(same_group.iter().all(|o| o.system == s.system));
            let other = w.sessions.iter().find(|o| o.group != s.group).unwrap();
            assert_ne!(other.system, s.system);
            assert_eq!(s.system.as_ref().unwrap().tokens, 40);
            assert_eq!(
                s.system.as_ref().unwrap().text.split_whitespace().count(),
                40
            );
        }
        // Questions are all different.
        let mut qs: Vec<&str> = w
            .sessions
            .iter()
            .map(|s| s.turns[0].user.text.as_str())
            .collect();
        qs.sort_unstable();
        qs.dedup();
        assert_eq!(qs.len(), 12);
        // Burst keeps groups contiguous; the default order interleaves them.
        let groups: Vec<usize> = w.sessions.iter().filter_map(|s| s.group).collect();
        assert!(groups.windows(2).all(|p| p[0] <= p[1]));
        let mixed = block_on(build(&shared(false), 8, 5, &TokenCounter::Approximate)).unwrap();
        let groups: Vec<usize> = mixed.sessions.iter().filter_map(|s| s.group).collect();
        assert!(groups.windows(2).any(|p| p[0] > p[1]));
    }

    #[test]
    fn unique_prompts_differ_from_the_first_word() {
        let spec = WorkloadSpec::Unique {
            requests: 20,
            prompt_tokens: 30,
        };
        let w = block_on(build(&spec, 4, 1, &TokenCounter::Approximate)).unwrap();
        let mut heads: Vec<String> = w
            .sessions
            .iter()
            .map(|s| {
                assert_eq!(s.turns[0].user.text, CONTINUE);
                s.system
                    .as_ref()
                    .expect("unique prompts go in the system message")
                    .text
                    .split_whitespace()
                    .take(4)
                    .collect::<Vec<_>>()
                    .join(" ")
            })
            .collect();
        heads.sort();
        heads.dedup();
        assert_eq!(heads.len(), 20);
    }

    #[test]
    fn mooncake_equal_hash_ids_give_equal_text() {
        let dir = std::env::temp_dir().join(format!("kura-bench-wl-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("t.jsonl");
        std::fs::write(
            &path,
            "{\"timestamp\": 0, \"input_length\": 1024, \"output_length\": 3, \"hash_ids\": [7, 8]}\n\
             {\"timestamp\": 20, \"input_length\": 700, \"output_length\": 3, \"hash_ids\": [7, 9]}\n",
        )
        .unwrap();
        let spec = WorkloadSpec::Trace {
            path,
            format: TraceFormat::Mooncake,
            max_requests: None,
            time_scale: 0.5,
            max_prompt_tokens: None,
            max_output_tokens: None,
        };
        let w = block_on(build(&spec, 0, 3, &TokenCounter::Approximate)).unwrap();
        let a = w.sessions[0].system.as_ref().unwrap();
        let b = w.sessions[1].system.as_ref().unwrap();
        assert_eq!((a.tokens, b.tokens), (1024, 700));
        let a_words: Vec<&str> = a.text.split_whitespace().collect();
        let b_words: Vec<&str> = b.text.split_whitespace().collect();
        assert_eq!(a_words[..512], b_words[..512], "shared block 7");
        assert_ne!(
            a_words[512..700],
            b_words[512..700],
            "blocks 8 and 9 differ"
        );
        assert_eq!(w.sessions[1].arrival_ms, Some(10.0));
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn zero_counts_are_rejected_with_the_flag_named() {
        let spec = WorkloadSpec::Unique {
            requests: 0,
            prompt_tokens: 5,
        };
        let err = block_on(build(&spec, 4, 1, &TokenCounter::Approximate)).unwrap_err();
        assert!(err.to_string().contains("--requests"), "{err}");
    }
}
