//! Grammars compiled by llguidance over the served model's vocabulary.

use std::collections::VecDeque;
use std::sync::Arc;

use kura_request::{ConstraintSpec, TextCodec, TokenConstraint};
use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};
use llguidance::{Matcher, ParserFactory};
use serde_json::json;

use crate::{regex_literal, with_layout, Guide, MAX_SOURCE_BYTES, THINK_CLOSE, THINK_OPEN};

impl Guide {
    /// llguidance's grammar for this guide.
    pub fn grammar(&self) -> TopLevelGrammar {
        match self {
            Guide::JsonObject => {
                TopLevelGrammar::from_json_schema(with_layout(&json!({"type": "object"})))
            }
            Guide::JsonSchema(schema) => TopLevelGrammar::from_json_schema(with_layout(schema)),
            Guide::Regex(rx) => TopLevelGrammar::from_regex(rx),
            Guide::Lark(lark) => TopLevelGrammar::from_lark(lark.clone()),
            Guide::Choice(options) => {
                let alternatives: Vec<String> = options.iter().map(|o| regex_literal(o)).collect();
                TopLevelGrammar::from_regex(&format!("({})", alternatives.join("|")))
            }
            Guide::AfterThinking { open, answer, .. } => {
                // The answer's grammar (one, of the kinds above) by name, after the reasoning: a lazy
                // lexeme that ends at the first `</think>`.
                let mut grammars = answer.grammar().grammars;
                let mut inner = grammars.swap_remove(0);
                inner.name = Some("answer".into());
                let close = crate::lark_literal(THINK_CLOSE);
                let start = match open {
                    true => "start: thinking blank? @answer",
                    false => "start: (opening thinking blank?)? @answer",
                };
                let outer = format!(
                    "{start}\n\
                     opening: {}\n\
                     thinking[lazy]: /(.|\\n)*/ {close}\n\
                     blank: /[ \\t\\r\\n]+/\n",
                    crate::lark_literal(THINK_OPEN)
                );
                let mut top = TopLevelGrammar::from_lark(outer);
                top.grammars.push(inner);
                top
            }
        }
    }
}

/// The served model's vocabulary as llguidance sees it: each token's bytes, special tokens marked (so
/// that no grammar writes one as text), and the tokenizer for the literals of a grammar.
struct CodecEnv {
    trie: TokTrie,
    codec: Arc<dyn TextCodec>,
    /// What encoding an empty text gives (BOS for models that want one): taken off every encoding.
    added: Vec<u32>,
}

impl TokenizerEnv for CodecEnv {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    /// Valid UTF-8 through the model's tokenizer; bytes that are not (part of a character a grammar
    /// forces, say the first two of an emoji's four) by the longest tokens that spell them, as
    /// llguidance's own environments do: text with U+FFFD in their place would force the wrong token.
    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        self.trie
            .tokenize_with_greedy_fallback(s, |text| self.tokenize_text(text))
    }
}

impl CodecEnv {
    fn tokenize_text(&self, text: &str) -> Vec<TokenId> {
        // Plain text: special-token text inside it stays text.
        let whole = 0..text.len();
        let ids = self
            .codec
            .encode_with_plain_spans(text, std::slice::from_ref(&whole))
            .unwrap_or_default();
        match ids.strip_prefix(self.added.as_slice()) {
            Some(rest) => rest.to_vec(),
            None => ids,
        }
    }
}

/// Grammars over one model's vocabulary: built once per server (a pass over the vocabulary), shared by
/// every request.
#[derive(Clone)]
pub struct Guides {
    factory: Arc<ParserFactory>,
    /// Every end-of-sequence token: where the grammar may end, any of them may come.
    eos: Arc<[u32]>,
    closer: Arc<Closer>,
}

impl std::fmt::Debug for Guides {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Guides").field("eos", &self.eos).finish()
    }
}

impl Guides {
    /// The vocabulary of `codec`, read token by token.
    pub fn new(codec: Arc<dyn TextCodec>) -> Result<Self, String> {
        let vocab = codec.vocab_size();
        let vocab_u32 =
            u32::try_from(vocab).map_err(|_| format!("vocabulary of {vocab} tokens"))?;
        let eos: Vec<u32> = codec.eos_token_ids().to_vec();
        let Some(&first_eos) = eos.first() else {
            return Err(
                "the model has no end-of-sequence token; structured outputs need one".into(),
            );
        };
        let words: Vec<Vec<u8>> = (0..vocab_u32)
            .map(|id| {
                let bytes = codec.token_bytes(id);
                if codec.is_special(id) || bytes.is_empty() {
                    // Marked: a grammar never produces it as text (llguidance's convention).
                    let mut w = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                    if bytes.is_empty() {
                        w.extend_from_slice(format!("<[{id}]>").as_bytes());
                    } else {
                        w.extend_from_slice(&bytes);
                    }
                    w
                } else {
                    bytes
                }
            })
            .collect();
        let info = TokRxInfo::new(vocab_u32, first_eos);
        let trie = TokTrie::from(&info, &words);
        let added = codec.encode("").unwrap_or_default();
        let env: TokEnv = Arc::new(CodecEnv { trie, codec, added });
        let closer = Arc::new(Closer::new(env.clone()));
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| e.to_string())?;
        // Warnings and errors come back to the request; nothing goes to stderr.
        factory.set_stderr_log_level(0);
        Ok(Guides {
            factory: Arc::new(factory),
            eos: eos.into(),
            closer,
        })
    }

    /// `guide` compiled for this vocabulary; an error (a schema or grammar llguidance cannot compile)
    /// names the problem.
    pub fn compile(&self, guide: &Guide) -> Result<Arc<Compiled>, String> {
        let bytes = guide.source_bytes();
        if bytes > MAX_SOURCE_BYTES {
            return Err(format!(
                "the grammar's source is {bytes} bytes; at most {MAX_SOURCE_BYTES} (1 MiB) are compiled"
            ));
        }
        let parser = self
            .factory
            .create_parser(guide.grammar())
            .map_err(|e| first_line(&e.to_string()))?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(first_line(&e));
        }
        // The first step's mask, as generation will ask for it: a grammar that matches nothing, or
        // one past llguidance's limits at its start (too many alternatives in a row, a lexer too
        // large), is refused here rather than failing the request once it runs.
        let mut first = matcher.deep_clone();
        Walk::mask_of(&mut first, &self.eos, &mut Vec::new()).map_err(|e| {
            if e.starts_with("no token can continue") {
                "the grammar matches no text: no token can start it".to_string()
            } else {
                e
            }
        })?;
        let think = match guide {
            Guide::AfterThinking { open, budget, .. } => Some(Think {
                open: *open,
                budget: budget.map(|b| b as usize),
                close: self
                    .closer
                    .env
                    .tokenize_bytes(THINK_CLOSE.as_bytes())
                    .into(),
            }),
            _ => None,
        };
        Ok(Arc::new(Compiled {
            start: matcher,
            eos: self.eos.clone(),
            closer: self.closer.clone(),
            think,
        }))
    }
}

/// An llguidance error as a client reads it: its first line (what went wrong, without the parser's
/// state that follows), with the two that name llguidance's internals said in the request's terms.
fn first_line(e: &str) -> String {
    let line = e.lines().next().unwrap_or_default().trim_end();
    if line.contains("NoExtensionBias") {
        // The grammar had a way on, but no token fits it: a schema that admits no finite value.
        "no token can continue the output here: a schema (a tool's parameters or the response \
         format) admits no value (for example one that refers only to itself)"
            .to_string()
    } else if let Some(what) = line.strip_prefix("panic: ") {
        // llguidance stops on its own limits (symbols, states) with an assertion it catches.
        format!(
            "the grammar is larger than the compiler takes ({what}): give fewer tools or smaller \
             schemas"
        )
    } else {
        line.to_string()
    }
}

/// A compiled grammar: each choice starts from a copy of it.
pub struct Compiled {
    start: Matcher,
    eos: Arc<[u32]>,
    closer: Arc<Closer>,
    /// A grammar after a reasoning model's reasoning ([`Guide::AfterThinking`]).
    think: Option<Think>,
}

/// How a walk meets a grammar's reasoning: whether the output starts inside it, and the tokens of
/// `</think>`, which close it.
#[derive(Debug, Clone)]
struct Think {
    open: bool,
    /// The most tokens the reasoning may take before the walk closes it.
    budget: Option<usize>,
    close: Arc<[u32]>,
}

/// Where a walk stands in a grammar's reasoning ([`Guide::AfterThinking`]): the answer's lexical
/// state ([`Lex`]) counts only the answer's bytes, and a way to close the grammar from inside the
/// reasoning starts with `</think>`.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Phase {
    /// In the answer (or a grammar with no reasoning).
    Answer,
    /// At the output's start, where the model may open the reasoning: the bytes so far (a start of
    /// `<think>`).
    Before(Vec<u8>),
    /// Inside the reasoning: its last bytes, up to `</think>`'s length.
    Inside(Vec<u8>),
    /// Just past `</think>`: white space, or the answer's first byte, comes next.
    Closed,
}

impl Phase {
    /// The phase after `bytes`, and the bytes of them that are the answer's.
    fn after(self, bytes: &[u8]) -> (Phase, Vec<u8>) {
        let mut phase = self;
        let mut answer = Vec::new();
        for &b in bytes {
            phase = match phase {
                Phase::Answer => {
                    answer.push(b);
                    Phase::Answer
                }
                Phase::Before(mut seen) => {
                    seen.push(b);
                    if seen == THINK_OPEN.as_bytes() {
                        Phase::Inside(Vec::new())
                    } else if THINK_OPEN.as_bytes().starts_with(&seen) {
                        Phase::Before(seen)
                    } else {
                        answer.extend_from_slice(&seen);
                        Phase::Answer
                    }
                }
                Phase::Closed if b.is_ascii_whitespace() => Phase::Closed,
                Phase::Closed => {
                    answer.push(b);
                    Phase::Answer
                }
                Phase::Inside(mut tail) => {
                    tail.push(b);
                    if tail.ends_with(THINK_CLOSE.as_bytes()) {
                        Phase::Closed
                    } else {
                        if tail.len() >= THINK_CLOSE.len() {
                            tail.remove(0);
                        }
                        Phase::Inside(tail)
                    }
                }
            };
        }
        (phase, answer)
    }
}

impl std::fmt::Debug for Compiled {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Compiled grammar")
    }
}

impl Compiled {
    fn walk(&self) -> Walk {
        Walk {
            matcher: self.start.deep_clone(),
            eos: self.eos.clone(),
            closer: self.closer.clone(),
            mask: Vec::new(),
            closing: VecDeque::new(),
            closed_early: false,
            ahead: None,
            here: None,
            wait: 0,
            estimate: None,
            lex: Lex::default(),
            phase: match &self.think {
                None => Phase::Answer,
                Some(t) if t.open => Phase::Inside(Vec::new()),
                Some(_) => Phase::Before(Vec::new()),
            },
            think: self.think.clone(),
            reasoned: 0,
            forced: VecDeque::new(),
        }
    }
}

impl ConstraintSpec for Compiled {
    fn start(&self) -> Result<Box<dyn TokenConstraint>, String> {
        Ok(Box::new(self.walk()))
    }
}

/// One choice's walk through a compiled grammar.
struct Walk {
    matcher: Matcher,
    eos: Arc<[u32]>,
    closer: Arc<Closer>,
    mask: Vec<u32>,
    /// Once the budget can hold no more than the way that closes the grammar: that way's tokens
    /// still to come, one allowed at each step.
    closing: VecDeque<u32>,
    /// The walk took the closing way.
    closed_early: bool,
    /// The token just chosen and the closing way after it (found when it was checked): the next
    /// step's way, unless another token came.
    ahead: Option<(u32, Vec<u32>)>,
    /// The closing way from the walk's state now, when known.
    here: Option<Vec<u32>>,
    /// Steps to wait before looking for a closing way again, after one was not found.
    wait: usize,
    /// The length of the closing way when last found, and the budget then.
    estimate: Option<(usize, usize)>,
    /// Where the answer so far stands in JSON's lexical grammar.
    lex: Lex,
    /// Where the output stands in a reasoning before the answer.
    phase: Phase,
    /// A grammar after a reasoning: `</think>`'s tokens, and the most the reasoning may take.
    think: Option<Think>,
    /// The reasoning's tokens so far.
    reasoned: usize,
    /// `</think>`'s tokens still to come once the reasoning has spent its budget.
    forced: VecDeque<u32>,
}

impl Walk {
    /// The mask of `matcher` in its state now, every end-of-sequence token allowed where the grammar
    /// may end (llguidance knows one; the model may have several).
    fn mask_of(matcher: &mut Matcher, eos: &[u32], out: &mut Vec<u32>) -> Result<(), String> {
        let vob = matcher
            .compute_mask()
            .map_err(|e| first_line(&e.to_string()))?;
        out.clear();
        out.extend_from_slice(vob.as_slice());
        if out.iter().all(|&w| w == 0) {
            return Err("the grammar allows no token here".into());
        }
        if allows(out, eos[0]) {
            for &e in eos {
                let (w, b) = (e as usize / 32, e % 32);
                if let Some(word) = out.get_mut(w) {
                    *word |= 1 << b;
                }
            }
        }
        Ok(())
    }

    /// The way to close the grammar from `matcher`'s state: the tokens [`Closer::next`] chooses,
    /// until the grammar may end (end-of-sequence not included: the choice ends as `length` after
    /// the last); `None` when it does not end within `limit` tokens. With `branch`, where the closer
    /// has a choice of key (an optional one or the next required one), each option is followed
    /// greedily and the shorter way taken; elsewhere, and without, the closer's first option (a few
    /// microseconds a step, a mask where it chooses).
    fn way(
        &self,
        mut matcher: Matcher,
        mut lex: Lex,
        mut phase: Phase,
        limit: usize,
        branch: bool,
    ) -> Option<Vec<u32>> {
        let mut way = Vec::new();
        loop {
            // Inside a reasoning: `</think>` first, then the answer's way.
            if matches!(phase, Phase::Inside(_)) {
                for &t in self.think_close() {
                    if way.len() == limit {
                        return None;
                    }
                    way.push(t);
                    matcher.consume_token(t).ok()?;
                }
                (phase, lex) = (Phase::Closed, Lex::default());
            }
            if matcher.is_stopped() || matcher.is_accepting().ok()? {
                return Some(way);
            }
            // Past `</think>`, the answer rather than the blank before it.
            let blank_last = phase == Phase::Closed;
            let tokens = match self.closer.next(&mut matcher, lex, blank_last)? {
                Next::Run(tokens) => tokens,
                // Which key comes next (an optional one, or the next required one) is worth a
                // look ahead; other choices (digits of a pattern, `true` or `false`) are not.
                Next::Choice(options) if branch && lex.key => {
                    let mut best: Option<(usize, u32)> = None;
                    for token in options {
                        let room = best.map_or(limit.checked_sub(way.len() + 1)?, |(len, _)| len);
                        let mut after = matcher.deep_clone();
                        if after.consume_token(token).is_err() {
                            continue;
                        }
                        let (p, l) = advance(phase.clone(), lex, self.closer.bytes(token));
                        if let Some(rest) = self.way(after, l, p, room, false) {
                            if best.is_none_or(|(len, _)| rest.len() < len) {
                                best = Some((rest.len(), token));
                            }
                        }
                    }
                    vec![best?.1]
                }
                // Where the output may open a reasoning, the answer is the shorter way.
                Next::Choice(options) if matches!(phase, Phase::Before(_)) => {
                    let opens = |t: &u32| self.closer.bytes(*t).first() == Some(&b'<');
                    vec![options
                        .iter()
                        .copied()
                        .find(|t| !opens(t))
                        .unwrap_or(options[0])]
                }
                Next::Choice(options) => vec![options[0]],
            };
            for token in tokens {
                if way.len() == limit {
                    return None;
                }
                way.push(token);
                (phase, lex) = advance(phase, lex, self.closer.bytes(token));
                matcher.consume_token(token).ok()?;
            }
        }
    }

    /// The tokens of `</think>` (none for a grammar with no reasoning before it).
    fn think_close(&self) -> &[u32] {
        self.think.as_ref().map_or(&[], |t| &t.close)
    }

    /// The way to close the grammar after `token`, within `limit` tokens.
    fn way_after(&self, token: u32, limit: usize) -> Option<Vec<u32>> {
        let mut after = self.matcher.deep_clone();
        after.consume_token(token).ok()?;
        let (phase, lex) = advance(self.phase.clone(), self.lex, self.closer.bytes(token));
        self.way(after, lex, phase, limit, true)
    }
}

/// Where an output stands after `bytes`: in its reasoning (`phase`) and, in its answer, in JSON's
/// lexical grammar (counting the answer's bytes only).
fn advance(phase: Phase, lex: Lex, bytes: &[u8]) -> (Phase, Lex) {
    if phase == Phase::Answer {
        return (phase, lex.after(bytes));
    }
    let (phase, answer) = phase.after(bytes);
    (phase, Lex::default().after(&answer))
}

/// Whether bit `token` of `mask` is set.
fn allows(mask: &[u32], token: u32) -> bool {
    mask.get(token as usize / 32)
        .is_some_and(|w| w >> (token % 32) & 1 == 1)
}

impl TokenConstraint for Walk {
    fn choose(
        &mut self,
        budget: usize,
        sample: &mut dyn FnMut(&[u32]) -> u32,
    ) -> Result<u32, String> {
        // On the closing way, the way's token: the model has no say.
        if let Some(&next) = self.closing.front() {
            return Ok(next);
        }
        if let Some(&next) = self.forced.front() {
            return Ok(next);
        }
        let mut mask = std::mem::take(&mut self.mask);
        let got = Self::mask_of(&mut self.matcher, &self.eos, &mut mask);
        self.mask = mask;
        got?;
        // A reasoning that has spent its budget is closed, a token at a time, once the grammar
        // takes `</think>` (not inside a character the last token cut).
        if matches!(self.phase, Phase::Inside(_))
            && self
                .think
                .as_ref()
                .and_then(|t| t.budget)
                .is_some_and(|b| self.reasoned >= b)
            && self
                .think_close()
                .first()
                .is_some_and(|&t| allows(&self.mask, t))
        {
            self.forced = self.think_close().iter().copied().collect();
            if let Some(&next) = self.forced.front() {
                return Ok(next);
            }
        }
        let here = self.here.take();
        if budget > CLOSING_WINDOW || allows(&self.mask, self.eos[0]) {
            return Ok(sample(&self.mask));
        }
        if self.wait > 0 {
            self.wait -= 1;
            return Ok(sample(&self.mask));
        }
        // The budget is near its end. The way that closes the grammar is looked for every few steps;
        // once the budget is within a few tokens of it, at each step: the model's token stands if the
        // grammar can still be closed after it within what is left, else the walk takes the way.
        let fresh = self.estimate.is_none_or(|(len, at)| {
            at.saturating_sub(budget) >= CLOSING_RECHECK || budget <= len + CLOSING_ZONE
        });
        let here = match here {
            Some(way) => way,
            None if fresh => {
                match self.way(
                    self.matcher.deep_clone(),
                    self.lex,
                    self.phase.clone(),
                    budget,
                    true,
                ) {
                    Some(way) if !way.is_empty() => way,
                    _ => {
                        // Too long for the budget (the model may yet close some of it itself).
                        self.estimate = None;
                        self.wait = CLOSING_RETRY;
                        return Ok(sample(&self.mask));
                    }
                }
            }
            None => return Ok(sample(&self.mask)),
        };
        self.estimate = Some((here.len(), budget));
        if budget > here.len() + CLOSING_ZONE {
            return Ok(sample(&self.mask));
        }
        let token = sample(&self.mask);
        let after = if here[0] == token {
            Some(here[1..].to_vec())
        } else {
            self.way_after(token, budget - 1)
        };
        if let Some(after) = after {
            self.ahead = Some((token, after));
            return Ok(token);
        }
        self.closed_early = true;
        let next = here[0];
        self.closing = here.into();
        Ok(next)
    }

    fn accept(&mut self, token: u32) -> Result<(), String> {
        if self.closing.front() == Some(&token) {
            self.closing.pop_front();
        } else {
            self.closing.clear();
        }
        if self.forced.front() == Some(&token) {
            self.forced.pop_front();
        } else {
            self.forced.clear();
        }
        if matches!(self.phase, Phase::Inside(_)) {
            self.reasoned += 1;
        }
        self.here = match self.ahead.take() {
            Some((t, way)) if t == token => Some(way),
            _ => None,
        };
        // Any of the model's end-of-sequence tokens stands for the one llguidance knows.
        let token = if self.eos.contains(&token) {
            self.eos[0]
        } else {
            // The answer's lexical state counts its own bytes only.
            let phase = std::mem::replace(&mut self.phase, Phase::Answer);
            (self.phase, self.lex) = advance(phase, self.lex, self.closer.bytes(token));
            token
        };
        self.matcher
            .consume_token(token)
            .map_err(|e| first_line(&e.to_string()))
    }

    fn is_done(&self) -> bool {
        self.matcher.is_stopped() || (self.closed_early && self.closing.is_empty())
    }

    fn closed_early(&self) -> bool {
        self.closed_early
    }
}

/// How near the end of its token budget a choice must be before its walk looks for the way to close
/// its grammar.
const CLOSING_WINDOW: usize = 64;

/// Within how many tokens of the closing way's length the budget must be for the walk to check every
/// token the model chooses (a search each, unless the token is the way's own); further off,
/// the way is looked for again every [`CLOSING_RECHECK`] steps, so a model token that lengthens it by
/// more than this can still leave the grammar unclosed.
const CLOSING_ZONE: usize = 16;

/// Steps between looks for the closing way outside the zone.
const CLOSING_RECHECK: usize = 8;

/// Steps a walk waits before it looks again for a way to close its grammar, after none fitted.
const CLOSING_RETRY: usize = 8;

/// Where a text stands in JSON's lexical grammar: inside a string or not (and after a backslash
/// there), whether that string is an object's key, and the open containers (64 deep; deeper ones are
/// taken for arrays). For a grammar that is not JSON the closer is only less apt.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Lex {
    in_string: bool,
    escaped: bool,
    /// The string open now is a key.
    key: bool,
    /// Outside a string: the next string is a key.
    expect_key: bool,
    depth: u32,
    /// Bit `i`: the container at depth `i + 1` is an object.
    objects: u64,
}

impl Lex {
    fn in_object(&self) -> bool {
        self.depth > 0 && self.depth <= 64 && self.objects >> (self.depth - 1) & 1 == 1
    }

    fn after(mut self, bytes: &[u8]) -> Self {
        for &b in bytes {
            if self.escaped {
                self.escaped = false;
            } else if self.in_string {
                match b {
                    b'\\' => self.escaped = true,
                    b'"' => {
                        self.in_string = false;
                        self.key = false;
                    }
                    _ => {}
                }
            } else {
                match b {
                    b'"' => {
                        self.in_string = true;
                        self.key = self.expect_key;
                        self.expect_key = false;
                    }
                    b'{' | b'[' => {
                        self.depth = self.depth.saturating_add(1);
                        if self.depth <= 64 {
                            let bit = 1u64 << (self.depth - 1);
                            if b == b'{' {
                                self.objects |= bit;
                            } else {
                                self.objects &= !bit;
                            }
                        }
                        self.expect_key = b == b'{';
                    }
                    b'}' | b']' => {
                        self.depth = self.depth.saturating_sub(1);
                        self.expect_key = false;
                    }
                    b',' => self.expect_key = self.in_object(),
                    b':' => self.expect_key = false,
                    _ => {}
                }
            }
        }
        self
    }
}

/// How a grammar is closed fast, a step at a time: the first of a few one-byte tokens the grammar
/// takes (inside a string the quote that ends it; outside, the brackets and braces that end values,
/// then a separator, then the shortest values: `""`, `0`), else the tokens the grammar forces (a
/// key's rest), else the longest token it allows (a literal, a value a pattern bounds). The first two
/// cost microseconds a step; the last a mask.
pub struct Closer {
    /// The one-byte tokens to try, in order: outside a string, inside a key, inside a value (where
    /// a pattern may want a digit or a letter: tried before a mask is computed).
    tries: [Vec<u32>; 3],
    /// The vocabulary (its token trie holds every token's bytes).
    env: TokEnv,
}

impl Closer {
    fn new(env: TokEnv) -> Self {
        let trie = env.tok_trie();
        let tries = |bytes: &[u8]| bytes.iter().filter_map(|&b| trie.token_id(&[b])).collect();
        Closer {
            tries: [
                tries(b"}],\"0123456789"),
                tries(b"\""),
                tries(b"\"0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ-_ ."),
            ],
            env,
        }
    }

    fn bytes(&self, token: u32) -> &[u8] {
        self.env.tok_trie().token(token)
    }

    /// The next tokens of the way that closes the grammar from `matcher`'s state, whose output so far
    /// stands at `lex`; `None` when the grammar allows nothing.
    fn next(&self, matcher: &mut Matcher, lex: Lex, blank_last: bool) -> Option<Next> {
        if !lex.escaped {
            let tries = match (lex.in_string, lex.key) {
                (false, _) => &self.tries[0],
                (true, true) => &self.tries[1],
                (true, false) => &self.tries[2],
            };
            for &t in tries {
                if matcher.validate_tokens(&[t]).ok()? == 1 {
                    return Some(Next::Run(vec![t]));
                }
            }
        }
        let forced = matcher.compute_ff_tokens();
        if !forced.is_empty() {
            return Some(Next::Run(forced));
        }
        // The longest allowed tokens that begin with different bytes, longest first; with
        // `blank_last` (the blank after a reasoning's `</think>`, which closes nothing), white space
        // only where nothing else is allowed.
        let mask = matcher.compute_mask().ok()?;
        let mut best: [Option<(usize, u32)>; CHOICES] = [None; CHOICES];
        let mut blank = None;
        for (w, &word) in mask.as_slice().iter().enumerate() {
            let mut bits = word;
            while bits != 0 {
                let t = (w * 32) as u32 + bits.trailing_zeros();
                bits &= bits - 1;
                let bytes = self.bytes(t);
                let Some(&first) = bytes.first() else {
                    continue;
                };
                if blank_last && first.is_ascii_whitespace() {
                    blank = blank.or(Some(t));
                    continue;
                }
                let len = bytes.len();
                let same = best
                    .iter()
                    .position(|b| b.is_some_and(|(_, o)| self.bytes(o).first() == Some(&first)));
                let slot = match same {
                    Some(i) if best[i].is_some_and(|(l, _)| len > l) => i,
                    Some(_) => continue,
                    None => match best.iter().position(|b| b.is_none_or(|(l, _)| len > l)) {
                        Some(i) => i,
                        None => continue,
                    },
                };
                best[slot] = Some((len, t));
                best.sort_by_key(|b| std::cmp::Reverse(b.map(|(l, _)| l)));
            }
        }
        let mut options: Vec<u32> = best.iter().flatten().map(|&(_, t)| t).collect();
        if options.is_empty() {
            options.extend(blank);
        }
        match options.len() {
            0 => None,
            1 => Some(Next::Run(options)),
            _ => Some(Next::Choice(options)),
        }
    }
}

/// How many of the allowed tokens the closer weighs where the grammar leaves it a choice.
const CHOICES: usize = 2;

/// The closer's next step.
enum Next {
    /// These tokens, in order.
    Run(Vec<u32>),
    /// One of these, best first by the closer's own measure (the longest).
    Choice(Vec<u32>),
}

#[cfg(test)]
mod tests {
    use std::ops::Range;

    use kura_request::ChatMessage;
    use serde_json::Value;

    use super::*;

    /// Every byte a token of its own, then a few words a BPE vocabulary has, then end-of-sequence.
    struct Bytes {
        words: Vec<Vec<u8>>,
    }

    const WORDS: &[&str] = &[
        "birch", "\"}", "\", ", "}}", "\": ", "true", "000", "aaaa", "\"\"",
    ];
    /// A control token, as Mistral's vocabulary has it (the last word).
    const CONTROL: &str = "[TOOL_CALLS]";

    impl Bytes {
        fn new() -> Arc<Self> {
            let mut words: Vec<Vec<u8>> = (0..=255u8).map(|b| vec![b]).collect();
            words.extend(WORDS.iter().map(|w| w.as_bytes().to_vec()));
            words.push(CONTROL.as_bytes().to_vec());
            Arc::new(Bytes { words })
        }
        fn eos(&self) -> u32 {
            self.words.len() as u32
        }
        fn id(&self, word: &str) -> u32 {
            self.words
                .iter()
                .position(|w| w == word.as_bytes())
                .unwrap() as u32
        }
    }

    impl TextCodec for Bytes {
        fn encode(&self, text: &str) -> Result<Vec<u32>, String> {
            Ok(text.bytes().map(u32::from).collect())
        }
        fn decode(&self, ids: &[u32]) -> String {
            let bytes: Vec<u8> = ids.iter().flat_map(|&i| self.token_bytes(i)).collect();
            String::from_utf8_lossy(&bytes).into_owned()
        }
        fn token_bytes(&self, id: u32) -> Vec<u8> {
            self.words.get(id as usize).cloned().unwrap_or_default()
        }
        fn render_chat(&self, _: &[ChatMessage]) -> Result<String, String> {
            Err("no template".into())
        }
        fn encode_chat(&self, _: &[ChatMessage]) -> Result<Vec<u32>, String> {
            Err("no template".into())
        }
        fn chat_content_spans(
            &self,
            _: &str,
            _: usize,
            _: &[ChatMessage],
        ) -> Result<Vec<Range<usize>>, String> {
            Ok(Vec::new())
        }
        fn encode_with_plain_spans(
            &self,
            text: &str,
            _: &[Range<usize>],
        ) -> Result<Vec<u32>, String> {
            self.encode(text)
        }
        fn eos_token_ids(&self) -> &[u32] {
            std::slice::from_ref(Box::leak(Box::new(self.eos())))
        }
        fn vocab_size(&self) -> usize {
            self.words.len() + 1
        }
        fn is_special(&self, id: u32) -> bool {
            id as usize == self.words.len() - 1
        }
    }

    /// A model that never wants to stop: it writes `script` (a byte token at a time), then takes the
    /// first of `likes` the mask allows, else the lowest allowed token that is not end-of-sequence.
    /// Returns the text, whether the walk ended its grammar within `budget` tokens, and whether it
    /// closed it early.
    fn run(
        codec: &Bytes,
        spec: &Compiled,
        script: &str,
        likes: &[u32],
        budget: usize,
    ) -> (String, bool, bool) {
        run_after(codec, spec, &[], script, likes, budget)
    }

    /// [`run`] after the model has written `first` (each of which the walk must allow).
    fn run_after(
        codec: &Bytes,
        spec: &Compiled,
        first: &[u32],
        script: &str,
        likes: &[u32],
        budget: usize,
    ) -> (String, bool, bool) {
        let mut walk = spec.start().unwrap();
        for &t in first {
            let chosen = walk
                .choose(budget, &mut |mask: &[u32]| {
                    assert!(allows(mask, t), "token {t} is not allowed here");
                    t
                })
                .unwrap();
            walk.accept(chosen).unwrap();
        }
        // The script goes on after the bytes of the tokens written first.
        let skip: usize = first.iter().map(|&t| codec.token_bytes(t).len()).sum();
        let script = format!("{}{script}", " ".repeat(skip));
        let mut out = Vec::new();
        for left in (1..=budget).rev() {
            // The script goes on from the bytes written (a forced word may be several).
            let written: usize = skip
                + out
                    .iter()
                    .map(|&t| codec.token_bytes(t).len())
                    .sum::<usize>();
            let scripted = script.as_bytes().get(written).map(|&b| u32::from(b));
            let mut model = |mask: &[u32]| {
                scripted
                    .iter()
                    .chain(likes)
                    .copied()
                    .find(|&t| allows(mask, t))
                    .or_else(|| (0..codec.eos()).find(|&t| allows(mask, t)))
                    .unwrap_or(codec.eos())
            };
            let token = walk.choose(left, &mut model).unwrap();
            walk.accept(token).unwrap();
            if token == codec.eos() {
                break;
            }
            out.push(token);
            if walk.is_done() {
                break;
            }
        }
        (codec.decode(&out), walk.is_done(), walk.closed_early())
    }

    fn guides(codec: &Arc<Bytes>) -> Guides {
        Guides::new(codec.clone() as Arc<dyn TextCodec>).unwrap()
    }

    #[test]
    fn a_walk_near_its_budget_closes_the_schema_it_would_have_overrun() {
        let codec = Bytes::new();
        let schema = serde_json::json!({
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "items": {"type": "array", "items": {"type": "object",
                    "properties": {"n": {"type": "number"}, "ok": {"type": "boolean"}},
                    "required": ["n", "ok"]}},
                "note": {"type": "string"}
            },
            "required": ["name", "items", "note"]
        });
        let spec = guides(&codec)
            .compile(&Guide::JsonSchema(schema.clone()))
            .unwrap();
        // Repeats inside the name for ever.
        let birch = [codec.id("birch")];
        // What closing takes from the start: `{"name": "", "items": [], "note": ""}`.
        let least = {
            let walk = spec.walk();
            let way = walk.way(
                walk.matcher.deep_clone(),
                Lex::default(),
                Phase::Answer,
                100,
                true,
            );
            way.unwrap().len()
        };
        for budget in [least, least + 1, 40, 64, 65, 100, 200] {
            let (text, done, early) = run(&codec, &spec, "", &birch, budget);
            assert!(done && early, "budget {budget}: not closed: {text}");
            let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
            // The model's own text runs until the closing needs what is left.
            let name = v["name"].as_str().unwrap();
            assert!(
                name.len() >= 5 * (budget - least) && name.replace("birch", "").is_empty(),
                "{text}"
            );
            assert_eq!(v["items"], serde_json::json!([]), "{text}");
            assert_eq!(v["note"], "", "{text}");
        }
        // Repeats digits of the first item's number: closed inside the array.
        let digits = [codec.id("000"), codec.id("1")];
        let script = r#"{"name": "x", "items": [{"n": 1"#;
        let (text, done, early) = run(&codec, &spec, script, &digits, 60);
        assert!(done && early, "{text}");
        let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
        assert!(
            v["items"][0]["n"].is_number() && v["items"][0]["ok"].is_boolean(),
            "{text}"
        );
        // Too small a budget for even the closing: the walk does not pretend.
        let (text, done, _) = run(&codec, &spec, "", &birch, 8);
        assert!(!done, "{text}");
    }

    #[test]
    fn llguidances_own_failures_are_told_in_the_requests_terms() {
        let codec = Bytes::new();
        // A schema with no finite value after text that can start: compiled, then stuck at the schema.
        let spec = guides(&codec)
            .compile(&Guide::Lark(
                r##"start: "<x>" %json {"$ref": "#"}"##.to_string(),
            ))
            .unwrap();
        let mut walk = spec.start().unwrap();
        let mut err = None;
        for b in "<x>".bytes().map(u32::from).chain([b'{'.into()]) {
            match walk.choose(100, &mut |_: &[u32]| b) {
                Ok(t) => walk.accept(t).unwrap(),
                Err(e) => {
                    err = Some(e);
                    break;
                }
            }
        }
        let err = err.expect("the walk went past a schema with no value");
        assert!(
            err.starts_with("no token can continue the output here"),
            "{err}"
        );
        assert!(!err.contains("NoExtensionBias"), "{err}");
        // The same schema alone matches no text at all.
        let e = guides(&codec)
            .compile(&Guide::JsonSchema(serde_json::json!({"$ref": "#"})))
            .unwrap_err();
        assert_eq!(e, "the grammar matches no text: no token can start it");
        // A grammar past llguidance's own limits (it asserts on more than 65,525 symbols).
        let alternatives: Vec<String> = (0..70_000).map(|i| format!("\"w{i}\"")).collect();
        let lark = format!("start: {}", alternatives.join(" | "));
        match guides(&codec).compile(&Guide::Lark(lark)) {
            Ok(_) => panic!("70,000 alternatives compiled"),
            Err(e) => assert!(
                e.starts_with("the grammar is larger than the compiler takes (")
                    && e.ends_with("give fewer tools or smaller schemas"),
                "{e}"
            ),
        }
    }

    #[test]
    fn tools_the_model_may_call_beside_a_format_allow_a_call_or_an_answer_in_it() {
        let codec = Bytes::new();
        let tools = [crate::tools::ToolDef {
            name: "w".into(),
            description: None,
            // Schemas with references of their own (as Pydantic writes nested models).
            parameters: serde_json::json!({"$defs": {"City": {"type": "string"}}, "type": "object",
                "properties": {"city": {"$ref": "#/$defs/City"}}, "required": ["city"]}),
            strict: false,
        }];
        let answer = serde_json::json!({"$defs": {"T": {"type": "integer"}}, "type": "object",
            "properties": {"temp": {"$ref": "#/$defs/T"}}, "required": ["temp"]});
        for (format, parallel) in [
            crate::tools::ToolFormat::Hermes,
            crate::tools::ToolFormat::Llama3Json,
            crate::tools::ToolFormat::Mistral,
        ]
        .into_iter()
        .flat_map(|f| [(f, false), (f, true)])
        {
            let tag = (format == crate::tools::ToolFormat::Mistral).then(|| codec.id(CONTROL));
            let grammar = format.call_or_json_grammar(&tools, parallel, &answer, tag);
            let spec = guides(&codec).compile(&Guide::Lark(grammar)).unwrap();
            let call = format.write_calls(&[crate::tools::ParsedCall {
                name: "w".into(),
                arguments: r#"{"city": "Oslo"}"#.into(),
            }]);
            // Mistral's tag is a control token the grammar leaves out.
            let call = call.trim_start_matches("[TOOL_CALLS]");
            let (text, done, early) = run(&codec, &spec, call, &[], 200);
            if parallel {
                // More calls may follow: the walk goes on past the script.
                assert!(text.starts_with(call), "{format:?}: {text}");
            } else {
                assert!(done && !early, "{format:?}: {text}");
                assert_eq!(text, call, "{format:?}");
            }
            let (text, done, early) = run(&codec, &spec, r#"{"temp": 21}"#, &[], 200);
            assert!(text.starts_with(r#"{"temp": 21}"#), "{format:?}: {text}");
            if !parallel {
                assert!(done && !early, "{format:?}: {text}");
                assert_eq!(text, r#"{"temp": 21}"#, "{format:?}");
            }
            // Text that is neither is not written: the walk leaves the script at its first byte.
            let (text, _, _) = run(&codec, &spec, "Hello", &[], 200);
            assert!(!text.starts_with('H'), "{format:?}: {text}");
            if let Some(tag) = tag {
                // After Mistral's control token, the calls and not the answer.
                let (text, _, _) = run_after(&codec, &spec, &[tag], call, &[], 200);
                assert!(text.starts_with(call), "{format:?}: {text}");
                let (text, _, _) = run_after(&codec, &spec, &[tag], r#"{"temp": 21}"#, &[], 200);
                assert!(!text.starts_with('{'), "{format:?}: {text}");
            }
        }
    }

    #[test]
    fn strict_tools_the_model_may_call_allow_an_answer_or_calls_valid_under_their_schemas() {
        let codec = Bytes::new();
        let tool = |name: &str, strict: bool| crate::tools::ToolDef {
            name: name.into(),
            description: None,
            parameters: serde_json::json!({"type": "object",
                "properties": {"unit": {"enum": ["kelvin"]}}, "required": ["unit"]}),
            strict,
        };
        let tools = [tool("w", true), tool("loose", false)];
        let eos = [codec.eos()];
        let call = |name: &str, arguments: &str| crate::tools::ParsedCall {
            name: name.into(),
            arguments: arguments.into(),
        };
        use crate::tools::ToolFormat::*;
        for (format, parallel) in [Hermes, Fallback, Llama3Json, Mistral]
            .into_iter()
            .flat_map(|f| [(f, false), (f, true)])
        {
            let tag = (format == Mistral).then(|| codec.id(CONTROL));
            let grammar = format.call_or_text_grammar(&tools, parallel, tag);
            let spec = guides(&codec)
                .compile(&Guide::Lark(grammar.clone()))
                .unwrap_or_else(|e| panic!("{format:?}: {e}\n{grammar}"));
            let written = |calls: &[crate::tools::ParsedCall]| {
                let text = format.write_calls(calls);
                text.trim_start_matches("[TOOL_CALLS]").to_string()
            };
            // An answer with no call, ended by the model.
            let answer = "It is cold <b>today</b>.";
            let (text, done, _) = run(&codec, &spec, answer, &eos, 200);
            assert_eq!(text, answer, "{format:?}");
            assert!(done, "{format:?}");
            // A strict call valid under its schema is written as it is.
            let good = written(&[call("w", r#"{"unit": "kelvin"}"#)]);
            let (text, done, _) = run(&codec, &spec, &good, &eos, 200);
            assert!(text.starts_with(&good), "{format:?}: {text}");
            if !parallel {
                assert!(done && text == good, "{format:?}: {text}");
            }
            // A strict call the schema refuses leaves the script at the value it refuses.
            let bad = written(&[call("w", r#"{"unit": "celsius"}"#)]);
            let (text, _, _) = run(&codec, &spec, &bad, &eos, 200);
            let at = bad.find("celsius").unwrap();
            assert!(
                text.starts_with(&bad[..at]) && !text[at..].starts_with('c'),
                "{format:?}: {text}"
            );
            // A tool that is not strict takes any object.
            let loose = written(&[call("loose", r#"{"unit": "celsius"}"#)]);
            let (text, _, _) = run(&codec, &spec, &loose, &eos, 200);
            assert!(text.starts_with(&loose), "{format:?}: {text}");
            // A call of a tool not offered is not written.
            let other = written(&[call("other", r#"{"unit": "kelvin"}"#)]);
            let (text, _, _) = run(&codec, &spec, &other, &eos, 200);
            assert!(!text.starts_with(&other), "{format:?}: {text}");
            if matches!(format, Hermes | Fallback) {
                // Text before the calls; two calls with parallel, one without.
                let both = format!(
                    "Let me check.\n{}",
                    written(&[
                        call("w", r#"{"unit": "kelvin"}"#),
                        call("loose", r#"{"a": 1}"#)
                    ])
                );
                let (text, done, _) = run(&codec, &spec, &both, &eos, 300);
                let one = both.split("</tool_call>").next().unwrap().to_string() + "</tool_call>";
                if parallel {
                    assert!(done && text == both, "{format:?}: {text}");
                } else {
                    assert!(done && text == one, "{format:?}: {text}");
                }
            } else {
                // The bare-JSON formats' answers do not start as a call does, after any white
                // space or the format's tag written as text (what `parse` would read as calls).
                let starts: &[&str] = if format == Llama3Json {
                    &["  {", "\u{a0}{", "<|python_tag|>{", "<|python_tag|> {"]
                } else {
                    &[" [", "\u{2003}[", "[TOOL_CALLS][", "[TOOL_CALLS] ["]
                };
                for start in starts {
                    let (text, _, _) = run(&codec, &spec, start, &eos, 200);
                    assert!(!text.starts_with(start), "{format:?}: {text:?}");
                }
                if let Some(tag) = tag {
                    // Mistral's control token may open the calls (as the model writes them); no
                    // answer follows it.
                    let (text, done, _) = run_after(&codec, &spec, &[tag], &good, &eos, 200);
                    assert!(text.starts_with(&good), "{format:?}: {text}");
                    if !parallel {
                        assert!(done && text == good, "{format:?}: {text}");
                    }
                    let (text, _, _) = run_after(&codec, &spec, &[tag], answer, &eos, 200);
                    assert!(!text.starts_with('I'), "{format:?}: {text}");
                }
            }
        }
    }

    #[test]
    fn a_walk_that_ends_by_itself_is_not_closed_early() {
        let codec = Bytes::new();
        let spec = guides(&codec)
            .compile(&Guide::Choice(vec!["yes".into(), "no".into()]))
            .unwrap();
        let (text, done, early) = run(&codec, &spec, "", &[], 3);
        assert_eq!(text, "no");
        assert!(done && !early);
        // A string the model would write for ever is the model's until the last token.
        let spec = guides(&codec)
            .compile(&Guide::JsonSchema(serde_json::json!({"type": "string"})))
            .unwrap();
        let aaaa = [codec.id("aaaa")];
        let (text, done, early) = run(&codec, &spec, "", &aaaa, 40);
        assert!(done && early, "{text}");
        assert_eq!(text, format!("\"{}\"", "a".repeat(38 * 4)));
    }

    #[test]
    fn the_closing_way_writes_the_smallest_values_of_what_is_required() {
        let codec = Bytes::new();
        let schema = serde_json::json!({
            "type": "object",
            "properties": {
                "a": {"type": "string"},
                "b": {"type": "array", "items": {"type": "integer"}, "minItems": 2},
                "c": {"type": "boolean"},
                "d": {"type": "number", "minimum": 5},
                "e": {"type": "string", "enum": ["tea", "coffee"]},
                "f": {"type": "object", "properties": {"g": {"type": "null"}}, "required": ["g"]},
                "h": {"type": "string"}
            },
            "required": ["a", "b", "c", "d", "e", "f"]
        });
        let spec = guides(&codec).compile(&Guide::JsonSchema(schema)).unwrap();
        let walk = spec.walk();
        let way = walk
            .way(
                walk.matcher.deep_clone(),
                Lex::default(),
                Phase::Answer,
                200,
                true,
            )
            .unwrap();
        let text = codec.decode(&way);
        let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
        assert_eq!(v["a"], "", "{text}");
        assert_eq!(v["b"], serde_json::json!([0, 0]), "{text}");
        assert!(
            v["c"].is_boolean() && v["d"].as_f64().unwrap() >= 5.0,
            "{text}"
        );
        assert!(v["e"] == "tea" || v["e"] == "coffee", "{text}");
        assert_eq!(v["f"], serde_json::json!({"g": null}), "{text}");
        assert!(v.get("h").is_none(), "{text}");
        // Too few tokens for it: no way.
        let short = walk.way(
            walk.matcher.deep_clone(),
            Lex::default(),
            Phase::Answer,
            way.len() - 1,
            true,
        );
        assert_eq!(short, None);
    }

    #[test]
    fn lexical_state_follows_quotes_and_escapes() {
        let after = |text: &str| Lex::default().after(text.as_bytes());
        assert!(after("{\"a").in_string);
        assert!(!after("{\"a\": ").in_string);
        assert!(after("\"a\\\"").in_string);
        assert!(!after("\"a\\\\\"").in_string);
        assert!(after("\"\\").escaped);
        // Keys and values.
        assert!(after("{\"").key);
        assert!(!after("{\"a\": \"").key);
        assert!(after("{\"a\": 1, \"").key);
        assert!(!after("[\"").key && !after("[1, \"").key);
        assert!(after("[{\"a\": [1, 2], \"").key);
        assert!(!after("{\"a\": [\"x\", \"").key);
        assert!(after("{\"a\": {\"b\": \"}\"}, \"").key);
    }

    #[test]
    fn a_grammar_after_thinking_holds_the_answer_only() {
        let codec = Bytes::new();
        let schema = serde_json::json!({"type": "object", "properties": {"n": {"type": "integer"}},
                                        "required": ["n"]});
        let g = guides(&codec);
        let walk_all = |spec: &Compiled, text: &str| -> Result<bool, String> {
            let mut walk = spec.start()?;
            for b in text.bytes() {
                walk.choose(100, &mut |mask: &[u32]| {
                    if allows(mask, u32::from(b)) {
                        u32::from(b)
                    } else {
                        codec.eos()
                    }
                })
                .ok()
                .filter(|&t| t == u32::from(b))
                .ok_or_else(|| format!("{:?} refused after {text:?}", b as char))?;
                walk.accept(u32::from(b))?;
            }
            Ok(walk.is_done() || {
                let mut done = false;
                walk.choose(100, &mut |mask: &[u32]| {
                    done = allows(mask, codec.eos());
                    codec.eos()
                })?;
                done
            })
        };
        // The prompt opened the reasoning: any text (a `<` and `{` too) up to `</think>`, then JSON.
        let open = g
            .compile(&Guide::JsonSchema(schema.clone()).after_thinking(true, None))
            .unwrap();
        assert_eq!(
            walk_all(&open, "Let me see: {n} < 3.\n</think>\n\n{\"n\": 2}"),
            Ok(true)
        );
        assert_eq!(walk_all(&open, "x</think>{\"n\": 2}"), Ok(true));
        assert!(walk_all(&open, "x</think>\n\n{\"n\": \"two\"}").is_err());
        assert!(walk_all(&open, "x</think> hello").is_err());
        // The model may open it, or answer at once; nothing else.
        let may = g
            .compile(&Guide::JsonSchema(schema).after_thinking(false, None))
            .unwrap();
        assert_eq!(
            walk_all(&may, "<think>\nhmm\n</think>\n\n{\"n\": 1}"),
            Ok(true)
        );
        assert_eq!(walk_all(&may, "{\"n\": 1}"), Ok(true));
        assert!(walk_all(&may, "hmm</think>{\"n\": 1}").is_err());
        // Other answers: a choice.
        let choice = g
            .compile(&Guide::Choice(vec!["yes".into(), "no".into()]).after_thinking(true, None))
            .unwrap();
        assert_eq!(walk_all(&choice, "Hmm.</think>\nno"), Ok(true));
        assert!(walk_all(&choice, "Hmm.</think>\nmaybe").is_err());
        // Near its budget the walk closes the reasoning and the answer.
        let (text, done, early) = run(&codec, &open, "", &[codec.id("birch")], 40);
        assert!(done && early, "{text}");
        let (_, answer) = text
            .split_once("</think>")
            .unwrap_or_else(|| panic!("{text}"));
        let v: Value =
            serde_json::from_str(answer.trim_start()).unwrap_or_else(|e| panic!("{e}: {text}"));
        assert!(v["n"].is_i64(), "{text}");
        // A reasoning budget: closed after its fifth token, then the answer (the model would go on).
        let budgeted = g
            .compile(
                &Guide::JsonSchema(serde_json::json!({"type": "object",
                    "properties": {"n": {"type": "integer"}}, "required": ["n"]}))
                .after_thinking(true, Some(5)),
            )
            .unwrap();
        let (text, done, _) = run(&codec, &budgeted, "", &[codec.id("birch")], 200);
        let (thought, answer) = text
            .split_once("</think>")
            .unwrap_or_else(|| panic!("{text}"));
        assert_eq!(thought, "birch".repeat(5), "{text}");
        let v: Value =
            serde_json::from_str(answer.trim_start()).unwrap_or_else(|e| panic!("{e}: {text}"));
        assert!(done && v["n"].is_i64(), "{text}");
        // Spent inside a character (`é` is two byte tokens here): closed once the character is whole.
        let (text, _, _) = run(&codec, &budgeted, "aaaaé", &[codec.id("birch")], 200);
        assert!(text.starts_with("aaaaé</think>"), "{text}");
        // Where the model may open it: it opens it near its budget, reasons, and is closed in time.
        let (text, done, early) = run(&codec, &may, "<think>", &[codec.id("birch")], 40);
        assert!(done && early, "{text}");
        let (thought, answer) = text
            .split_once("</think>")
            .unwrap_or_else(|| panic!("{text}"));
        assert!(thought.starts_with("<think>birch"), "{text}");
        let v: Value =
            serde_json::from_str(answer.trim_start()).unwrap_or_else(|e| panic!("{e}: {text}"));
        assert!(v["n"].is_i64(), "{text}");
    }
}
