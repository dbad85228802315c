//! Reasoning models' output read apart (vLLM's `--reasoning-parser`): the text a model writes between
//! `<think>` and `</think>` (DeepSeek R1 and its distillations, QwQ, Qwen3) is its reasoning, the text
//! after it the answer. A chat answer carries the reasoning apart (`reasoning_content`), a Responses
//! answer as a `reasoning` item, a Messages answer as a `thinking` block.
//!
//! Where the reasoning starts depends on the chat template: R1's and QwQ's write `<think>` at the end
//! of the prompt, so the output starts inside the reasoning; Qwen3's leave it to the model (and write
//! an empty `<think></think>` when thinking is turned off). [`prompt_ends_thinking`] reads which from
//! the prompt itself, so one rule serves every template and every request (a prefilled assistant
//! message that opened `<think>` too).

use std::collections::VecDeque;
use std::str::FromStr;
use std::sync::Arc;

use kura_request::{ConstraintSpec, TextCodec, TokenConstraint};

pub use kura_guide::{THINK_CLOSE, THINK_OPEN};

/// Whether a server reads reasoning out of its chat answers (`--reasoning-parser`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReasoningParser {
    /// When the chat template spells `<think>` (the default).
    Auto,
    /// Always: `<think>…</think>` (vLLM's `deepseek_r1` and `qwen3`).
    Think,
    /// Never: the answer is the text as written.
    Off,
}

impl FromStr for ReasoningParser {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(ReasoningParser::Auto),
            "deepseek_r1" | "qwen3" | "think" => Ok(ReasoningParser::Think),
            "none" => Ok(ReasoningParser::Off),
            other => Err(format!(
                "unknown reasoning parser {other:?}: give auto, deepseek_r1, qwen3 (both read \
                 <think>…</think>) or none"
            )),
        }
    }
}

impl ReasoningParser {
    /// Whether answers are read for reasoning with this chat template (`source`).
    pub fn reads(self, source: &str) -> bool {
        match self {
            ReasoningParser::Auto => source.contains(THINK_OPEN),
            ReasoningParser::Think => true,
            ReasoningParser::Off => false,
        }
    }
}

/// Tokens of a prompt's end looked at for an open `<think>`, at most (a prefilled reasoning longer
/// than this is read as an answer).
const TAIL_TOKENS: usize = 1024;

/// Whether `prompt` ends inside a reasoning block: in the text after its last special token (the last
/// turn's opening, where the template writes the generation prompt), a `<think>` not closed. User text
/// that spells `<think>` sits before that token and does not count.
pub fn prompt_ends_thinking(codec: &dyn TextCodec, prompt: &[u32]) -> bool {
    let floor = prompt.len().saturating_sub(TAIL_TOKENS);
    let is_tag = |id: u32| {
        let bytes = codec.token_bytes(id);
        bytes == THINK_OPEN.as_bytes() || bytes == THINK_CLOSE.as_bytes()
    };
    let from = (floor..prompt.len())
        .rev()
        .find(|&i| codec.is_special(prompt[i]) && !is_tag(prompt[i]))
        .map_or(floor, |i| i + 1);
    let tail = codec.decode_keeping_special(&prompt[from..]);
    ends_thinking(&tail)
}

/// Whether `text` has a `<think>` after its last `</think>`.
pub fn ends_thinking(text: &str) -> bool {
    match (text.rfind(THINK_OPEN), text.rfind(THINK_CLOSE)) {
        (Some(open), Some(close)) => open > close,
        (Some(_), None) => true,
        _ => false,
    }
}

/// Where a [`ThinkSplit`] stands in the output.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Nothing but white space yet (`held`, then perhaps a start of `<think>`): the output may open
    /// with `<think>`.
    Start,
    /// Inside the reasoning (`started`: past its leading white space). `held` is white space, then
    /// perhaps a start of `</think>` (its last `mark` bytes).
    Thinking { started: bool },
    /// In the answer (`started`: past the white space after `</think>`, or with no reasoning).
    Answer { started: bool },
}

/// Pieces of an output read apart: reasoning and answer.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Split {
    pub reasoning: String,
    pub content: String,
}

/// The length of the longest end of `text` that starts `tag` without being all of it.
fn tag_start_at_end(text: &str, tag: &str) -> usize {
    (1..tag.len())
        .rev()
        .find(|&k| text.ends_with(&tag[..k]))
        .unwrap_or(0)
}

/// An output read apart as it comes ([`ThinkSplit::push`] each piece, [`ThinkSplit::finish`] at its
/// end); the pieces joined are what [`ThinkSplit::whole`] gives for the whole text. The reasoning's
/// white space at both ends and the answer's at its start are left out (the template's `<think>\n`
/// and the `\n\n` after `</think>`); an output with no reasoning is its answer as written. Text that
/// could still be the start of `</think>` (or of `<think>` at the output's start) is held back until
/// it is known. Each piece costs about its own length: held white space is not looked at again.
#[derive(Debug, Clone)]
pub struct ThinkSplit {
    state: State,
    held: String,
    /// In [`State::Start`]: the bytes of `held` known to be white space. In [`State::Thinking`]: the
    /// bytes at `held`'s end that may start `</think>`.
    mark: usize,
    /// The output starts inside the reasoning (a `<think>` it writes anyway is left out, as vLLM's
    /// parser leaves it out).
    inside: bool,
    thought: bool,
    /// Tokens of a start of `<think>` held back ([`ThinkSplit::push_token`]).
    opening: u32,
}

impl ThinkSplit {
    /// A split of an output that starts inside the reasoning (`inside`, [`prompt_ends_thinking`]) or
    /// may open it.
    pub fn new(inside: bool) -> Self {
        ThinkSplit {
            state: State::Start,
            held: String::new(),
            mark: 0,
            inside,
            thought: inside,
            opening: 0,
        }
    }

    /// Whether the output so far is inside its reasoning (or, where it starts inside, has written
    /// nothing but white space yet).
    pub fn reasoning(&self) -> bool {
        match self.state {
            State::Start => self.inside,
            State::Thinking { .. } => true,
            State::Answer { .. } => false,
        }
    }

    /// [`ThinkSplit::push`] of one token's `text`, and how many tokens are now known to be the
    /// reasoning's, as `reasoning_tokens` counts them: this one where it opens, continues or closes
    /// the reasoning, and those of an opening `<think>` that were not known to be one until now.
    pub fn push_token(&mut self, text: &str) -> (Split, u32) {
        let was = self.reasoning();
        let split = self.push(text);
        let now = self.reasoning();
        let count = match (was, now, self.state) {
            (false, true, _) => 1 + std::mem::take(&mut self.opening),
            (true, _, _) => 1,
            // At the output's start, a token of what may yet open the reasoning.
            (false, false, State::Start) => {
                self.opening += u32::from(self.held.len() > self.mark);
                0
            }
            (false, false, _) => 0,
        };
        (split, count)
    }

    /// The reasoning and answer `text` adds, as far as they are known.
    pub fn push(&mut self, text: &str) -> Split {
        let mut out = Split::default();
        let mut text = text;
        loop {
            match self.state {
                State::Start => {
                    // Only the new text is looked at: `held` is white space (`mark` bytes), then
                    // perhaps a start of `<think>`.
                    if self.mark == self.held.len() {
                        let blank = text.len() - text.trim_start().len();
                        self.held.push_str(&text[..blank]);
                        self.mark = self.held.len();
                        text = &text[blank..];
                    }
                    self.held.push_str(text);
                    let rest = &self.held[self.mark..];
                    if let Some(after) = rest.strip_prefix(THINK_OPEN) {
                        let after = after.to_string();
                        self.held.clear();
                        self.mark = 0;
                        self.thought = true;
                        self.state = State::Thinking { started: false };
                        return self.push_thinking(&after, out);
                    }
                    if rest.is_empty() || THINK_OPEN.starts_with(rest) {
                        return out;
                    }
                    if self.inside {
                        // The reasoning, from its first text.
                        let rest = rest.to_string();
                        self.held.clear();
                        self.mark = 0;
                        self.state = State::Thinking { started: false };
                        return self.push_thinking(&rest, out);
                    }
                    // No reasoning: the answer as written.
                    out.content = std::mem::take(&mut self.held);
                    self.state = State::Answer { started: true };
                    return out;
                }
                State::Thinking { .. } => return self.push_thinking(text, out),
                State::Answer { started: false } => {
                    let rest = text.trim_start();
                    if rest.is_empty() {
                        return out;
                    }
                    self.state = State::Answer { started: true };
                    text = rest;
                }
                State::Answer { started: true } => {
                    out.content.push_str(text);
                    return out;
                }
            }
        }
    }

    /// [`ThinkSplit::push`] inside the reasoning.
    fn push_thinking(&mut self, text: &str, mut out: Split) -> Split {
        let mut text = text;
        if self.state == (State::Thinking { started: false }) {
            text = text.trim_start();
            if text.is_empty() {
                return out;
            }
            self.state = State::Thinking { started: true };
        }
        // `</think>` can only start in the held start of it or in the new text.
        let from = self.held.len() - self.mark;
        self.held.push_str(text);
        if let Some(at) = self.held[from..].find(THINK_CLOSE).map(|i| i + from) {
            out.reasoning.push_str(self.held[..at].trim_end());
            let after = self.held[at + THINK_CLOSE.len()..].to_string();
            self.held.clear();
            self.mark = 0;
            self.state = State::Answer { started: false };
            let more = self.push(&after);
            out.content.push_str(&more.content);
            return out;
        }
        // Held back: what may start `</think>`, and the white space before it. Only the new text and
        // the old held start of `</think>` are looked at; what came before them is white space.
        self.mark = tag_start_at_end(&self.held, THINK_CLOSE);
        let end = self.held.len() - self.mark;
        let text_end = self.held[from..end].trim_end().len() + from;
        let cut = if text_end > from { text_end } else { 0 };
        if cut > 0 {
            out.reasoning.push_str(&self.held[..cut]);
            self.held.drain(..cut);
        }
        out
    }

    /// What was held back, once the output has ended: an unclosed reasoning's last text, or an
    /// output's start that turned out to be its answer.
    pub fn finish(&mut self) -> Split {
        let held = std::mem::take(&mut self.held);
        let mut out = Split::default();
        match self.state {
            State::Start if self.inside => out.reasoning = held.trim().to_string(),
            State::Start => out.content = held,
            State::Thinking { .. } => out.reasoning = held.trim_end().to_string(),
            State::Answer { .. } => {}
        }
        self.mark = 0;
        self.state = State::Answer { started: true };
        out
    }

    /// A whole output read apart: its reasoning (`None` when it did not reason, or its reasoning is
    /// empty) and its answer.
    pub fn whole(text: &str, inside: bool) -> (Option<String>, String) {
        let mut whole = ThinkWhole::new(inside);
        let piece = whole.split.push(text);
        whole.keep(&piece);
        whole.finish();
        whole.into_parts()
    }
}

/// An output read apart as it comes and kept whole: [`ThinkSplit`]'s pieces joined, and the tokens
/// of its reasoning ([`ThinkSplit::push_token`]), for an answer sent whole or kept after it streams.
#[derive(Debug, Clone)]
pub struct ThinkWhole {
    split: ThinkSplit,
    reasoning: String,
    content: String,
    tokens: u32,
}

impl ThinkWhole {
    /// As [`ThinkSplit::new`].
    pub fn new(inside: bool) -> Self {
        ThinkWhole {
            split: ThinkSplit::new(inside),
            reasoning: String::new(),
            content: String::new(),
            tokens: 0,
        }
    }

    /// One token's text: the pieces it adds, as [`ThinkSplit::push_token`] gives them (kept too).
    pub fn push_token(&mut self, text: &str) -> Split {
        let (piece, tokens) = self.split.push_token(text);
        self.tokens = self.tokens.saturating_add(tokens);
        self.keep(&piece);
        piece
    }

    /// What was held back, once the output has ended ([`ThinkSplit::finish`]; kept too).
    pub fn finish(&mut self) -> Split {
        let piece = self.split.finish();
        self.keep(&piece);
        piece
    }

    fn keep(&mut self, piece: &Split) {
        self.reasoning.push_str(&piece.reasoning);
        self.content.push_str(&piece.content);
    }

    /// The reasoning so far.
    pub fn reasoning(&self) -> &str {
        &self.reasoning
    }

    /// The reasoning's tokens so far.
    pub fn tokens(&self) -> u32 {
        self.tokens
    }

    /// The output read apart ([`ThinkWhole::finish`] first): its reasoning (`None` when it did not
    /// reason, or its reasoning is empty) and its answer.
    pub fn into_parts(self) -> (Option<String>, String) {
        let thought = self.split.thought && !self.reasoning.is_empty();
        (thought.then_some(self.reasoning), self.content)
    }
}

/// A reasoning of at most `budget` tokens, where no grammar holds the answer (Anthropic's
/// `thinking.budget_tokens`): once the reasoning has that many tokens, `</think>` is written in its
/// place and the model answers. Any token may come otherwise.
pub struct ThinkBudget {
    codec: Arc<dyn TextCodec>,
    inside: bool,
    budget: usize,
    close: Arc<[u32]>,
    /// Every token of the vocabulary allowed.
    any: Arc<[u32]>,
    param: &'static str,
}

impl std::fmt::Debug for ThinkBudget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "a reasoning of at most {} tokens", self.budget)
    }
}

impl ThinkBudget {
    /// The budget for outputs of `codec`'s model that start inside the reasoning (`inside`) or may
    /// open it; `param` names the field it came from.
    pub fn new(
        codec: Arc<dyn TextCodec>,
        inside: bool,
        budget: u32,
        param: &'static str,
    ) -> Result<Self, String> {
        let close: Arc<[u32]> = codec.encode_without_added(THINK_CLOSE)?.into();
        if close.is_empty() {
            return Err(format!("{THINK_CLOSE} has no tokens in this vocabulary"));
        }
        // A control token's text is not in the output's text, where the reasoning is read.
        if close.iter().any(|&t| codec.is_special(t)) {
            return Err(format!(
                "{THINK_CLOSE} is a control token of this vocabulary, which answers do not show"
            ));
        }
        let vocab = codec.vocab_size();
        let mut any = vec![u32::MAX; vocab.div_ceil(32)];
        if vocab % 32 != 0 {
            if let Some(last) = any.last_mut() {
                *last = (1u32 << (vocab % 32)) - 1;
            }
        }
        Ok(ThinkBudget {
            codec,
            inside,
            budget: budget as usize,
            close,
            any: any.into(),
            param,
        })
    }
}

impl ConstraintSpec for ThinkBudget {
    fn start(&self) -> Result<Box<dyn TokenConstraint>, String> {
        Ok(Box::new(BudgetWalk {
            codec: self.codec.clone(),
            split: ThinkSplit::new(self.inside),
            budget: self.budget,
            reasoned: 0,
            close: self.close.clone(),
            forced: VecDeque::new(),
            any: self.any.clone(),
            cut: Vec::new(),
        }))
    }

    fn param(&self) -> Option<&'static str> {
        Some(self.param)
    }
}

/// One choice's count of its reasoning against a [`ThinkBudget`].
struct BudgetWalk {
    codec: Arc<dyn TextCodec>,
    split: ThinkSplit,
    budget: usize,
    reasoned: usize,
    close: Arc<[u32]>,
    /// `</think>`'s tokens still to come once the budget is spent.
    forced: VecDeque<u32>,
    any: Arc<[u32]>,
    /// The bytes of a character the last token cut (the budget closes the reasoning only between
    /// characters).
    cut: Vec<u8>,
}

impl TokenConstraint for BudgetWalk {
    fn choose(
        &mut self,
        _budget: usize,
        sample: &mut dyn FnMut(&[u32]) -> u32,
    ) -> Result<u32, String> {
        if self.forced.is_empty() && self.spent() {
            self.forced = self.close.iter().copied().collect();
        }
        match self.forced.front() {
            Some(&next) => Ok(next),
            None => Ok(sample(&self.any)),
        }
    }

    fn accept(&mut self, token: u32) -> Result<(), String> {
        if self.forced.front() == Some(&token) {
            self.forced.pop_front();
        } else {
            self.forced.clear();
        }
        if self.split.reasoning() {
            self.reasoned += 1;
        }
        // Where the output stands: its text, a character cut between tokens joined first.
        self.cut.extend(self.codec.token_bytes(token));
        let whole = match std::str::from_utf8(&self.cut) {
            Ok(_) => self.cut.len(),
            Err(e) if e.error_len().is_none() => e.valid_up_to(),
            Err(_) => self.cut.len(),
        };
        let rest = self.cut.split_off(whole);
        self.split.push(&String::from_utf8_lossy(&self.cut));
        self.cut = rest;
        Ok(())
    }

    fn is_done(&self) -> bool {
        false
    }

    fn free_next(&self) -> bool {
        self.forced.is_empty() && !self.spent()
    }
}

impl BudgetWalk {
    /// Whether the reasoning has spent its budget and `</think>` may be written now (between
    /// characters).
    fn spent(&self) -> bool {
        self.cut.is_empty() && self.split.reasoning() && self.reasoned >= self.budget
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn streamed(text: &str, inside: bool, cuts: &[usize]) -> (String, String) {
        let mut split = ThinkSplit::new(inside);
        let (mut reasoning, mut content) = (String::new(), String::new());
        let mut at = 0;
        for &cut in cuts.iter().chain([&text.len()]) {
            let piece = split.push(&text[at..cut]);
            reasoning.push_str(&piece.reasoning);
            content.push_str(&piece.content);
            at = cut;
        }
        let rest = split.finish();
        reasoning.push_str(&rest.reasoning);
        content.push_str(&rest.content);
        (reasoning, content)
    }

    #[test]
    fn an_output_is_read_into_its_reasoning_and_its_answer() {
        let cases: [(&str, bool, Option<&str>, &str); 16] = [
            // R1: the prompt opened the reasoning.
            (
                "Two and two.\n</think>\n\nIt is 4.",
                true,
                Some("Two and two."),
                "It is 4.",
            ),
            // Qwen3: the model opens it.
            (
                "<think>\nTwo and two.\n</think>\n\nIt is 4.",
                false,
                Some("Two and two."),
                "It is 4.",
            ),
            ("\n<think>a</think>b", false, Some("a"), "b"),
            // Never closed: all reasoning (the budget ran out while it thought).
            (
                "Still thinking about",
                true,
                Some("Still thinking about"),
                "",
            ),
            // No reasoning: the answer as written, its white space kept.
            ("  It is 4.\n", false, None, "  It is 4.\n"),
            ("<thin", false, None, "<thin"),
            // `<think>` later in an answer is text.
            (
                "4, not <think>x</think>",
                false,
                None,
                "4, not <think>x</think>",
            ),
            // An empty reasoning (Qwen3 with thinking off, written by the model): none.
            ("<think>\n\n</think>\n\n4", false, None, "4"),
            ("<think></think>", false, None, ""),
            // Cut off inside the reasoning: its white space within kept.
            ("x <", true, Some("x <"), ""),
            ("a </thi", true, Some("a </thi"), ""),
            ("a \n\n  ", true, Some("a"), ""),
            // `</think>` in the answer is the answer's.
            ("a</think>b</think>c", true, Some("a"), "b</think>c"),
            // Inside, a `<think>` the model writes anyway is left out; one later is text.
            ("\n<think>\nHmm.</think>4", true, Some("Hmm."), "4"),
            (
                "Is <think> a tag?</think>4",
                true,
                Some("Is <think> a tag?"),
                "4",
            ),
            ("<thi", true, Some("<thi"), ""),
        ];
        for (text, inside, reasoning, content) in cases {
            let (r, c) = ThinkSplit::whole(text, inside);
            assert_eq!((r.as_deref(), c.as_str()), (reasoning, content), "{text:?}");
            // Every cut into two and three pieces (at characters) gives the same.
            let bounds: Vec<usize> = (0..=text.len())
                .filter(|&i| text.is_char_boundary(i))
                .collect();
            for &a in &bounds {
                for &b in bounds.iter().filter(|&&b| b >= a) {
                    let got = streamed(text, inside, &[a, b]);
                    assert_eq!(
                        (got.0.as_str(), got.1.as_str()),
                        (reasoning.unwrap_or(""), content),
                        "{text:?} cut at {a} and {b}"
                    );
                }
            }
        }
    }

    #[test]
    fn long_runs_of_white_space_come_out_as_whole_text_does() {
        // Token by token: a reasoning with runs of blanks inside and at its end, an answer's start.
        let text = format!(
            "<think>{}a{}b </{}</think>{}ok{}",
            " ".repeat(3000),
            "\n".repeat(2000),
            " \t".repeat(1000),
            "\n".repeat(500),
            " ".repeat(100)
        );
        let mut split = ThinkSplit::new(false);
        let (mut r, mut c) = (String::new(), String::new());
        for piece in text.as_bytes().chunks(3) {
            let s = split.push(std::str::from_utf8(piece).unwrap());
            r.push_str(&s.reasoning);
            c.push_str(&s.content);
        }
        let s = split.finish();
        r.push_str(&s.reasoning);
        c.push_str(&s.content);
        let whole = ThinkSplit::whole(&text, false);
        assert_eq!((Some(r.clone()), c.clone()), whole);
        assert!(
            r.starts_with('a') && r.ends_with("b </"),
            "{:?}",
            &r[r.len() - 8..]
        );
        assert_eq!(c, format!("ok{}", " ".repeat(100)));
        // An output of blanks only is its answer, as written.
        let blanks = " \n".repeat(5000);
        assert_eq!(ThinkSplit::whole(&blanks, false), (None, blanks.clone()));
    }

    #[test]
    fn reasoning_tokens_are_those_that_open_continue_or_close_it() {
        let count = |inside: bool, tokens: &[&str]| {
            let mut split = ThinkSplit::new(inside);
            tokens.iter().map(|t| split.push_token(t).1).sum::<u32>()
        };
        assert_eq!(
            count(
                false,
                &["<", "think", ">", "a", " b", "</", "think>", "\n", "4"]
            ),
            7
        );
        assert_eq!(count(true, &["a", "</think>", "4", "."]), 2);
        assert_eq!(count(false, &["4", "."]), 0);
        assert_eq!(count(false, &["<", "b", ">"]), 0);
    }

    #[test]
    fn a_piece_that_may_start_the_close_is_held_back_until_known() {
        let mut split = ThinkSplit::new(true);
        assert_eq!(split.push("Let me see </th").reasoning, "Let me see");
        assert_eq!(split.push("ere").reasoning, " </there");
        let piece = split.push("</think>é");
        assert_eq!(
            (piece.reasoning.as_str(), piece.content.as_str()),
            ("", "é")
        );
        // Multi-byte text at every cut stays whole.
        let text = "né </think> ü";
        for (i, _) in text.char_indices() {
            let (r, c) = streamed(text, true, &[i]);
            assert_eq!((r.as_str(), c.as_str()), ("né", "ü"));
        }
    }

    #[test]
    fn a_prompt_ends_thinking_where_its_last_think_is_open() {
        assert!(ends_thinking("<|im_start|>assistant\n<think>\n"));
        assert!(!ends_thinking("assistant\n<think>\n\n</think>\n\n"));
        assert!(!ends_thinking("assistant\n"));
        assert!(ends_thinking("</think> then <think> again"));
    }

    /// The text a [`ThinkBudget`] lets a model write that would write `script` then `a` for ever.
    fn budgeted(inside: bool, budget: u32, script: &str, tokens: usize) -> String {
        let codec: Arc<dyn TextCodec> = Arc::new(crate::test_codec::Bytes);
        let spec = ThinkBudget::new(codec.clone(), inside, budget, "thinking").unwrap();
        let mut walk = spec.start().unwrap();
        let mut out = Vec::new();
        for i in 0..tokens {
            let wants = script.as_bytes().get(i).copied().unwrap_or(b'a');
            // Free steps take the model's token (the engine may choose it without the walk); the
            // others are `</think>`'s.
            let free = walk.free_next();
            let token = walk
                .choose(usize::MAX, &mut |mask: &[u32]| {
                    assert!(mask[wants as usize / 32] >> (wants % 32) & 1 == 1);
                    u32::from(wants)
                })
                .unwrap();
            assert_eq!(free, token == u32::from(wants), "step {i}");
            walk.accept(token).unwrap();
            out.push(token);
        }
        codec.decode(&out)
    }

    #[test]
    fn a_reasoning_past_its_budget_is_closed_and_the_model_answers() {
        assert_eq!(budgeted(true, 3, "", 14), "aaa</think>aaa");
        // A model's own `<think>` opens it; the count starts after it.
        assert_eq!(budgeted(false, 2, "<think>", 20), "<think>aa</think>aaa");
        // A reasoning closed within its budget is not closed again.
        assert_eq!(budgeted(true, 20, "ab</think>c", 14), "ab</think>caaa");
        // No reasoning opened: nothing to close.
        assert_eq!(budgeted(false, 1, "hi", 6), "hiaaaa");
        // Not inside a character the last token cut: `é` is two byte tokens here.
        let (c3, a9) = (char::from(0xC3u8), char::from(0xA9u8));
        assert_eq!(budgeted(true, 2, "aé", 13), format!("a{c3}{a9}</think>aa"));
    }

    #[test]
    fn parser_names_are_vllm_s() {
        for name in ["deepseek_r1", "qwen3", "think"] {
            assert_eq!(name.parse(), Ok(ReasoningParser::Think));
        }
        assert_eq!("none".parse(), Ok(ReasoningParser::Off));
        assert_eq!("auto".parse(), Ok(ReasoningParser::Auto));
        let e = "granite".parse::<ReasoningParser>().unwrap_err();
        assert!(e.contains("granite"), "{e}");
        assert!(ReasoningParser::Auto.reads("{{ '<think>\\n' }}"));
        assert!(!ReasoningParser::Auto.reads("{{ '<|im_start|>' }}"));
    }
}
