//! Structured outputs and tool calls on the server side: the model's vocabulary for llguidance (built
//! on the first request that needs it, then shared), a request's grammar compiled on the blocking pool
//! (a grammar llguidance refuses is a 400 naming the problem), two at a time, once for a tenant's
//! requests that ask for the same grammar at once, and kept for the tenant's next request with the
//! same grammar (an agent sends the same tools every turn).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use kura_api::keys::TENANT_SEPARATOR;
use kura_api::reasoning::ThinkBudget;
use kura_api::tools::{Guide, ToolPlan, ToolStyle};
use kura_engine::{ConstraintSpec, EngineHandle};
use kura_guide::{Compiled, Guides};

use crate::error::ApiError;
use crate::handlers::off_the_workers;

/// The model's vocabulary as llguidance reads it, built once (or why it could not be), and the
/// grammars compiled lately.
#[derive(Default)]
pub(crate) struct Grammars {
    vocab: OnceLock<Result<Guides, String>>,
    kept: Mutex<Kept<Arc<Compiled>>>,
    /// Grammars being compiled: a request for one of them waits for that compile (its tenant's
    /// request asked first) rather than compiling it again.
    compiling: Flights<(Arc<Compiled>, bool)>,
    compiles: AtomicU64,
    reused: AtomicU64,
}

pub(crate) type GuidesCell = Arc<Grammars>;

/// Work in progress by key, which the callers that ask for the same key while it runs share: one
/// runs it, the others wait for its value. A caller whose work fails, or that leaves before it ends,
/// hands it to the next waiting (which runs it again); once it ends, its key is free again.
struct Flights<V> {
    running: Mutex<HashMap<KeptKey, Arc<tokio::sync::OnceCell<V>>>>,
}

impl<V> Default for Flights<V> {
    fn default() -> Self {
        Flights {
            running: Mutex::default(),
        }
    }
}

impl<V: Clone> Flights<V> {
    /// The value of `work` for `key`, run here or by the caller that asked first while it runs; and
    /// whether it ran here.
    async fn share<F, E>(&self, key: &KeptKey, work: F) -> Result<(V, bool), E>
    where
        F: std::future::Future<Output = Result<V, E>>,
    {
        let flight = self
            .running
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(key.clone())
            .or_default()
            .clone();
        let ran = AtomicBool::new(false);
        let value = flight
            .get_or_try_init(|| async {
                ran.store(true, Ordering::Relaxed);
                // Done, failed or dropped: a later caller starts afresh.
                let _ends = Ends {
                    running: &self.running,
                    key,
                    flight: &flight,
                };
                work.await
            })
            .await?;
        Ok((value.clone(), ran.load(Ordering::Relaxed)))
    }
}

/// Frees a flight's key when its work ends, however it ends.
struct Ends<'a, V> {
    running: &'a Mutex<HashMap<KeptKey, Arc<tokio::sync::OnceCell<V>>>>,
    key: &'a KeptKey,
    flight: &'a Arc<tokio::sync::OnceCell<V>>,
}

impl<V> Drop for Ends<'_, V> {
    fn drop(&mut self) {
        let mut running = self.running.lock().unwrap_or_else(|e| e.into_inner());
        if running
            .get(self.key)
            .is_some_and(|f| Arc::ptr_eq(f, self.flight))
        {
            running.remove(self.key);
        }
    }
}

/// Compiled grammars kept at most. Each holds memory in proportion to its source (about 30 to 200
/// times it, the small ones the most: 125 KiB for one tool's, 850 KiB for 32 tools' 22 KB, 28 MiB
/// for 1 MiB), so the sources kept are bounded too: about 50 MB when full. Larger grammars (a
/// schema's enum of thousands of values) are compiled for each request and freed after it.
const KEPT_GRAMMARS: usize = 64;
/// Bytes of grammar source kept at most, all tenants together.
const KEPT_SOURCE_BYTES: usize = 1 << 20;
/// The largest source of a grammar kept: an agent's tools (22 KB for 32 tools of agent-sized
/// schemas) and more.
const KEPT_GRAMMAR_BYTES: usize = 128 << 10;
/// What one tenant keeps at most, so that a tenant's grammars go for its own before another's: the
/// capacity is shared, and only among more than four busy tenants does one's go for another's.
const TENANT_GRAMMARS: usize = KEPT_GRAMMARS / 4;
const TENANT_SOURCE_BYTES: usize = KEPT_SOURCE_BYTES / 4;

/// A kept grammar's key: the request's cache salt (a tenant never reuses another's grammar) and the
/// BLAKE3 digest of the grammar's source ([`source_key`]).
type KeptKey = (Option<String>, [u8; 32]);

/// The key of `guide` for the requests of cache salt `salt`, and its source's length.
fn kept_key(salt: Option<String>, guide: &Guide) -> (KeptKey, usize) {
    let text = source_key(guide);
    (
        (salt, *blake3::hash(text.as_bytes()).as_bytes()),
        text.len(),
    )
}

/// The tenant a cache salt belongs to: the part before [`TENANT_SEPARATOR`] (a server with API
/// keys), else the salt itself.
fn tenant_of(salt: &Option<String>) -> Option<&str> {
    salt.as_deref()
        .map(|s| s.split(TENANT_SEPARATOR).next().unwrap_or(s))
}

/// A grammar as one text: its kind and its source, whose bytes [`Guide::source_bytes`] counts.
fn source_key(guide: &Guide) -> String {
    match guide {
        Guide::JsonObject => "object".into(),
        Guide::JsonSchema(schema) => format!("schema {schema}"),
        Guide::Regex(rx) => format!("regex {rx}"),
        Guide::Lark(lark) => format!("lark {lark}"),
        Guide::Choice(options) => format!("choice {}", serde_json::Value::from(options.clone())),
        Guide::AfterThinking {
            open,
            budget,
            answer,
        } => format!("after thinking {open} {budget:?} {}", source_key(answer)),
    }
}

/// One kept value: the compiled grammar, when it was last used, its source's bytes.
struct Entry<T> {
    value: T,
    used: u64,
    bytes: usize,
}

/// Values (compiled grammars) by [`KeptKey`], the least lately used dropped past the bounds: the
/// tenant's own first, then anyone's.
struct Kept<T> {
    grammars: HashMap<KeptKey, Entry<T>>,
    source_bytes: usize,
    clock: u64,
}

impl<T> Default for Kept<T> {
    fn default() -> Self {
        Kept {
            grammars: HashMap::new(),
            source_bytes: 0,
            clock: 0,
        }
    }
}

impl<T: Clone> Kept<T> {
    fn get(&mut self, key: &KeptKey) -> Option<T> {
        self.clock += 1;
        let clock = self.clock;
        self.grammars.get_mut(key).map(|e| {
            e.used = clock;
            e.value.clone()
        })
    }

    /// Drops the least lately used grammar of `tenant` (of anyone's: `None`); false when there is none.
    fn drop_oldest(&mut self, tenant: Option<Option<&str>>) -> bool {
        let oldest = self
            .grammars
            .iter()
            .filter(|(k, _)| tenant.is_none_or(|t| tenant_of(&k.0) == t))
            .min_by_key(|(_, e)| e.used)
            .map(|(k, _)| k.clone());
        let Some(key) = oldest else {
            return false;
        };
        if let Some(e) = self.grammars.remove(&key) {
            self.source_bytes = self.source_bytes.saturating_sub(e.bytes);
        }
        true
    }

    /// What `tenant` keeps: grammars and source bytes.
    fn held_by(&self, tenant: Option<&str>) -> (usize, usize) {
        self.grammars
            .iter()
            .filter(|(k, _)| tenant_of(&k.0) == tenant)
            .fold((0, 0), |(n, b), (_, e)| (n + 1, b + e.bytes))
    }

    /// Keeps `value` under `key` (a source of `bytes`), dropping the least lately used past the
    /// bounds: the tenant's own past its share, then anyone's past the whole. A grammar whose source
    /// passes [`KEPT_GRAMMAR_BYTES`] is not kept.
    fn put(&mut self, key: KeptKey, value: T, bytes: usize) {
        if bytes > KEPT_GRAMMAR_BYTES || self.grammars.contains_key(&key) {
            return;
        }
        let tenant = tenant_of(&key.0).map(str::to_string);
        loop {
            let (n, b) = self.held_by(tenant.as_deref());
            if n < TENANT_GRAMMARS && b.saturating_add(bytes) <= TENANT_SOURCE_BYTES {
                break;
            }
            if !self.drop_oldest(Some(tenant.as_deref())) {
                break;
            }
        }
        while self.grammars.len() >= KEPT_GRAMMARS
            || self.source_bytes.saturating_add(bytes) > KEPT_SOURCE_BYTES
        {
            if !self.drop_oldest(None) {
                break;
            }
        }
        self.clock += 1;
        self.source_bytes += bytes;
        let used = self.clock;
        self.grammars.insert(key, Entry { value, used, bytes });
    }
}

impl Grammars {
    /// The grammar kept for this tenant (`salt`), if any.
    fn kept(&self, key: &KeptKey) -> Option<Arc<Compiled>> {
        self.kept.lock().unwrap_or_else(|e| e.into_inner()).get(key)
    }

    /// Prometheus lines: grammars compiled, and requests that reused a kept one.
    pub(crate) fn render_prometheus(&self) -> String {
        format!(
            "# HELP kura:grammar_compiles_total Grammars compiled for requests (structured outputs, tool calls).\n\
             # TYPE kura:grammar_compiles_total counter\n\
             kura:grammar_compiles_total {}\n\
             # HELP kura:grammar_reuses_total Requests whose grammar was compiled for another of the same tenant (kept, or compiling at once).\n\
             # TYPE kura:grammar_reuses_total counter\n\
             kura:grammar_reuses_total {}\n",
            self.compiles.load(Ordering::Relaxed),
            self.reused.load(Ordering::Relaxed)
        )
    }
}

/// Grammars compiled at once, server-wide.
static COMPILES: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(2);

/// How the served model's template writes tool calls.
pub(crate) fn tool_style(engine: &EngineHandle) -> ToolStyle {
    ToolStyle::of(engine.codec().as_ref())
}

/// The grammar a chat or completions request's output follows: its tool calls when `tool_choice` asks
/// for one (`required`, a named function); calls or an answer in its output format when it has both
/// tools the model may call (`auto`) and a JSON format; else its output format; with no format and
/// a strict tool the model may call, an answer or calls whose strict arguments are valid; compiled
/// for the served model, or kept from the tenant's (`salt`'s) last request with the same grammar.
/// With `thinking` (a reasoning model's answer, [`crate::output::ResponseMeta::reasoning`]), the
/// grammar holds the output after its reasoning, which `think_budget` (tokens, and the field that
/// asked) bounds; a budget with no grammar is a walk of its own ([`ThinkBudget`]).
#[allow(clippy::too_many_arguments)]
pub(crate) async fn constraint(
    engine: &EngineHandle,
    cell: &GuidesCell,
    salt: Option<String>,
    guide: Option<(Guide, &'static str)>,
    tools: Option<&ToolPlan>,
    style: ToolStyle,
    thinking: Option<bool>,
    think_budget: Option<(u32, &'static str)>,
    deadline: crate::output::Deadline,
) -> Result<Option<Arc<dyn ConstraintSpec>>, ApiError> {
    let calls = tools.filter(|t| t.parses_calls());
    // Beside tools the model may call, a format is the answer of a turn that calls none: a JSON one.
    // (A forced call's turn is the call; its format is for a later turn's text, as the OpenAI Agents
    // SDK sends an agent's output type.)
    let answer = match (&guide, calls) {
        (Some((g, param)), Some(_)) => Some(answer_schema(g, param)?),
        _ => None,
    };
    let (guide, param) = match tools.and_then(ToolPlan::constrained) {
        Some(defs) => {
            let parallel = tools.is_some_and(|t| t.parallel);
            (
                Guide::Lark(style.format.call_grammar(&defs, parallel, style.call_token)),
                "tools",
            )
        }
        None => match (guide, calls, answer) {
            // Strict tools the model may call: an answer, or calls held to their schemas.
            (None, Some(plan), _) if plan.strict_under_auto() => (
                Guide::Lark(style.format.call_or_text_grammar(
                    &plan.tools,
                    plan.parallel,
                    style.call_token,
                )),
                "tools",
            ),
            // No grammar: a reasoning budget alone, where one is asked.
            (None, _, _) => {
                return match (thinking, think_budget) {
                    (Some(inside), Some((budget, param))) => {
                        ThinkBudget::new(engine.codec().clone(), inside, budget, param)
                            .map(|b| Some(Arc::new(b) as Arc<dyn ConstraintSpec>))
                            .map_err(|e| {
                                ApiError::invalid(
                                    format!("the reasoning budget cannot be kept: {e}"),
                                    Some(param),
                                )
                            })
                    }
                    _ => Ok(None),
                }
            }
            // The model may call a tool or answer: the answer alone follows the format.
            (Some((_, param)), Some(plan), Some(schema)) => (
                Guide::Lark(style.format.call_or_json_grammar(
                    &plan.tools,
                    plan.parallel,
                    &schema,
                    style.call_token,
                )),
                param,
            ),
            (Some(g), _, _) => g,
        },
    };
    let guide = match thinking {
        Some(open) => guide.after_thinking(open, think_budget.map(|(b, _)| b)),
        None => guide,
    };
    let (key, source_bytes) = kept_key(salt, &guide);
    // The grammar kept, or one compile for the tenant's requests that ask for it at once (an
    // agent's parallel turns with the same tools): the others wait for it, and a flight begun just
    // after another ended finds that one's grammar kept.
    let work = async {
        match cell.kept(&key) {
            Some(spec) => Ok((spec, false)),
            None => compile(
                engine,
                cell,
                guide,
                param,
                key.clone(),
                source_bytes,
                deadline,
            )
            .await
            .map(|spec| (spec, true)),
        }
    };
    let shared = cell.compiling.share(&key, work);
    let ((spec, compiled), ran) = crate::output::finish_before(deadline, shared).await?;
    if !(ran && compiled) {
        cell.reused.fetch_add(1, Ordering::Relaxed);
    }
    Ok(Some(
        Arc::new(FromParam { spec, param }) as Arc<dyn ConstraintSpec>
    ))
}

/// Compiles `guide` for the served model on the blocking pool, in its turn, and keeps it under `key`
/// (when small enough, [`Kept::put`]).
async fn compile(
    engine: &EngineHandle,
    cell: &GuidesCell,
    guide: Guide,
    param: &'static str,
    key: KeptKey,
    source_bytes: usize,
    deadline: crate::output::Deadline,
) -> Result<Arc<Compiled>, ApiError> {
    // Compiles take turns, a few at a time: each holds memory in proportion to its grammar (up to
    // tens of MB), and many at once must not take the machine's memory. The turn goes with the
    // compile: a client that leaves while its grammar compiles drops the wait, not the compile, which
    // keeps its turn until it ends.
    let turn = crate::output::finish_before(deadline, async {
        COMPILES
            .acquire()
            .await
            .map_err(|_| ApiError::Internal("the grammar compiler's queue is closed".into()))
    })
    .await?;
    let (codec, cell) = (engine.codec().clone(), cell.clone());
    // Within the deadline too: past it the request is answered (504) while the compile, which keeps
    // its turn, runs on to its end.
    let compile = off_the_workers(move || {
        let _turn = turn;
        let guides = cell
            .vocab
            .get_or_init(|| Guides::new(codec))
            .as_ref()
            .map_err(|e| {
                ApiError::invalid(
                    format!("structured outputs are not available for this model: {e}"),
                    Some(param),
                )
            })?;
        let compiled = guides.compile(&guide).map_err(|e| {
            ApiError::invalid(
                format!("the {param} grammar could not be compiled: {e}"),
                Some(param),
            )
        })?;
        cell.compiles.fetch_add(1, Ordering::Relaxed);
        cell.kept.lock().unwrap_or_else(|e| e.into_inner()).put(
            key,
            compiled.clone(),
            source_bytes,
        );
        Ok(compiled)
    });
    crate::output::finish_before(deadline, compile).await
}

/// The schema of an answer in `guide` beside tool calls: JSON only (a regex, a grammar or a choice
/// could not stand beside a call), refused by name otherwise.
fn answer_schema(guide: &Guide, param: &'static str) -> Result<serde_json::Value, ApiError> {
    match guide {
        Guide::JsonObject => Ok(serde_json::json!({"type": "object"})),
        Guide::JsonSchema(schema) => Ok(schema.clone()),
        _ => Err(ApiError::invalid(
            format!(
                "{param} beside tools the model may call must be a JSON schema or json_object: a \
                 call or an answer in that format is what the output can be; send tool_choice none \
                 to answer in this format only"
            ),
            Some(param),
        )),
    }
}

/// A compiled grammar and the request field it came from, which an error met while generating names.
#[derive(Debug)]
struct FromParam<S> {
    spec: Arc<S>,
    param: &'static str,
}

impl<S: ConstraintSpec> ConstraintSpec for FromParam<S> {
    fn start(&self) -> Result<Box<dyn kura_engine::TokenConstraint>, String> {
        self.spec.start()
    }

    fn param(&self) -> Option<&'static str> {
        Some(self.param)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(tenant: &str, source: &str) -> KeptKey {
        kept_key(Some(tenant.into()), &Guide::Lark(source.into())).0
    }

    #[test]
    fn grammars_are_kept_per_salt_and_the_least_lately_used_go_first() {
        let mut kept = Kept::default();
        kept.put(key("a", "g1"), 1, 10);
        assert_eq!(kept.get(&key("a", "g1")), Some(1));
        // Another tenant's request with the same grammar compiles its own, as does another salt.
        assert_eq!(kept.get(&key("b", "g1")), None);
        assert_eq!(kept.get(&key("a\u{1f}x", "g1")), None);
        assert_eq!(kept.get(&(None, key("a", "g1").1)), None);
        // Past a tenant's share, its own least lately used goes: g1 was used, g2 was not.
        for i in 2..=TENANT_GRAMMARS {
            kept.put(key("a", &format!("g{i}")), i, 10);
        }
        assert_eq!(kept.get(&key("a", "g1")), Some(1));
        kept.put(key("a", "new"), 0, 10);
        assert_eq!(kept.grammars.len(), TENANT_GRAMMARS);
        assert_eq!(kept.get(&key("a", "g2")), None);
        assert_eq!(kept.get(&key("a", "g1")), Some(1));
        assert_eq!(kept.get(&key("a", "new")), Some(0));
    }

    #[test]
    fn a_tenant_s_grammars_go_for_its_own_before_anothers() {
        let mut kept = Kept::default();
        kept.put(key("a", "mine"), 1, 10);
        // Another tenant keeps many more: its own go, a's stays.
        for i in 0..KEPT_GRAMMARS {
            kept.put(key("b", &format!("g{i}")), i, 10);
        }
        assert_eq!(kept.get(&key("a", "mine")), Some(1));
        assert!(kept.held_by(Some("b")).0 <= TENANT_GRAMMARS);
        // Its salts are its own: the tenant is the part before the separator.
        for i in 0..KEPT_GRAMMARS {
            kept.put(key(&format!("b\u{1f}{i}"), "g"), i, 10);
        }
        assert_eq!(kept.get(&key("a", "mine")), Some(1));
        // Past the whole, among many tenants, anyone's least lately used goes.
        for t in 0..KEPT_GRAMMARS {
            kept.put(key(&format!("t{t}"), "g"), t, 10);
        }
        assert_eq!(kept.grammars.len(), KEPT_GRAMMARS);
        assert_eq!(kept.get(&key("a", "mine")), None);
    }

    #[test]
    fn kept_sources_are_bounded_in_bytes() {
        let mut kept = Kept::default();
        let big = KEPT_GRAMMAR_BYTES;
        // A tenant's share holds two of the largest kept: a third drops its oldest.
        for i in 0..3 {
            kept.put(key("a", &i.to_string()), i, big);
        }
        assert_eq!(kept.grammars.len(), TENANT_SOURCE_BYTES / big);
        assert_eq!(kept.get(&key("a", "0")), None);
        assert_eq!(kept.get(&key("a", "2")), Some(2));
        // A source past the largest kept is not kept, and drops nothing.
        kept.put(key("a", "huge"), 9, big + 1);
        assert_eq!(kept.get(&key("a", "huge")), None);
        assert_eq!(kept.grammars.len(), TENANT_SOURCE_BYTES / big);
        // Every tenant at its share: the whole holds what its bytes allow.
        for t in 0..8 {
            for i in 0..2 {
                kept.put(key(&format!("t{t}"), &i.to_string()), t, big);
            }
        }
        assert!(kept.source_bytes <= KEPT_SOURCE_BYTES);
        assert_eq!(kept.grammars.len(), KEPT_SOURCE_BYTES / big);
    }

    #[test]
    fn a_grammar_s_key_tells_kinds_and_sources_apart() {
        let keys = [
            source_key(&Guide::JsonObject),
            source_key(&Guide::JsonSchema(serde_json::json!({"type": "object"}))),
            source_key(&Guide::Regex("a".into())),
            source_key(&Guide::Lark("a".into())),
            source_key(&Guide::Choice(vec!["a".into()])),
            source_key(&Guide::Choice(vec!["a".into(), "b".into()])),
            source_key(&Guide::Choice(vec!["a\",\"b".into()])),
        ];
        let distinct: std::collections::HashSet<_> = keys.iter().collect();
        assert_eq!(distinct.len(), keys.len(), "{keys:?}");
    }

    /// Callers waiting on `key`'s flight, besides the map's own hold on it.
    fn waiting(flights: &Flights<u32>, key: &KeptKey) -> usize {
        let running = flights.running.lock().unwrap();
        running.get(key).map_or(0, |f| Arc::strong_count(f) - 1)
    }

    async fn until_waiting(flights: &Flights<u32>, key: &KeptKey, n: usize) {
        while waiting(flights, key) < n {
            tokio::task::yield_now().await;
        }
    }

    #[tokio::test]
    async fn callers_of_one_key_share_one_run_and_other_keys_run_their_own() {
        let flights = Arc::new(Flights::<u32>::default());
        let (a, b) = (key("t", "start: \"a\""), key("u", "start: \"a\""));
        let runs = Arc::new(AtomicU64::new(0));
        let (go, gate) = tokio::sync::watch::channel(false);
        let caller = |key: KeptKey, value: u32| {
            let (flights, runs, mut gate) = (flights.clone(), runs.clone(), gate.clone());
            tokio::spawn(async move {
                flights
                    .share(&key, async move {
                        runs.fetch_add(1, Ordering::Relaxed);
                        gate.wait_for(|open| *open).await.unwrap();
                        Ok::<_, String>(value)
                    })
                    .await
            })
        };
        let first = caller(a.clone(), 1);
        until_waiting(&flights, &a, 1).await;
        let waiters: Vec<_> = (0..3).map(|i| caller(a.clone(), 10 + i)).collect();
        until_waiting(&flights, &a, 4).await;
        // Another tenant's key (the same source): its own run, its own value.
        let other = caller(b.clone(), 2);
        until_waiting(&flights, &b, 1).await;
        go.send(true).unwrap();
        assert_eq!(first.await.unwrap(), Ok((1, true)));
        for w in waiters {
            assert_eq!(w.await.unwrap(), Ok((1, false)), "the first caller's value");
        }
        assert_eq!(other.await.unwrap(), Ok((2, true)));
        assert_eq!(runs.load(Ordering::Relaxed), 2);
        // Ended: the keys are free, and a later caller runs afresh.
        assert!(flights.running.lock().unwrap().is_empty());
        let again = flights.share(&a, async { Ok::<_, String>(3) }).await;
        assert_eq!(again, Ok((3, true)));
    }

    #[tokio::test]
    async fn a_failed_or_dropped_run_goes_to_the_next_caller() {
        let flights = Arc::new(Flights::<u32>::default());
        let a = key("t", "start: \"a\"");
        let (go, gate) = tokio::sync::watch::channel(false);
        // The first caller fails once its gate opens; the waiter then runs the work itself.
        let failing = {
            let (flights, a, mut gate) = (flights.clone(), a.clone(), gate.clone());
            tokio::spawn(async move {
                flights
                    .share(&a, async move {
                        gate.wait_for(|open| *open).await.unwrap();
                        Err::<u32, _>("refused".to_string())
                    })
                    .await
            })
        };
        until_waiting(&flights, &a, 1).await;
        let waiter = {
            let (flights, a) = (flights.clone(), a.clone());
            tokio::spawn(async move { flights.share(&a, async { Ok::<_, String>(7) }).await })
        };
        until_waiting(&flights, &a, 2).await;
        go.send(true).unwrap();
        assert_eq!(failing.await.unwrap(), Err("refused".to_string()));
        assert_eq!(waiter.await.unwrap(), Ok((7, true)));
        assert!(flights.running.lock().unwrap().is_empty());
        // A caller dropped while it runs (its client left) frees the key.
        let pending = flights.share(&a, std::future::pending::<Result<u32, String>>());
        let timed_out = tokio::time::timeout(std::time::Duration::from_millis(1), pending).await;
        assert!(timed_out.is_err());
        assert!(flights.running.lock().unwrap().is_empty());
    }
}
