//! [`ToolFormat::parse_partial`] over a reply that grows a piece at a time. Parsing the whole text after
//! every token costs the text's length each time, the square of it over a reply: a call whose arguments
//! run to tens of thousands of tokens (a file written through a tool), times `n` choices, on the
//! server's async workers. [`PartialStream`] keeps where each scan stopped (the content searched for a
//! call's opening, calls already ended, the last call's fields and the value being written) and goes on
//! from there, so a piece costs about its own length.
//!
//! What it gives after each piece is what `parse_partial` gives for the text so far, with one
//! difference: in the Hermes and fallback formats, the end of a call's text that could be the start of
//! `</tool_call>` is held back until it is known not to be (`parse_partial` counts it into the last
//! call's arguments, which then shrink when the marker completes).

use super::{ToolFormat, HERMES_CLOSE, HERMES_OPEN, MISTRAL_TAG, PYTHON_TAG};

/// A JSON string's value.
fn string_value(json: &str) -> Option<String> {
    serde_json::from_str(json).ok()
}

#[cfg(test)]
thread_local! {
    /// Bytes the value scans looked at, for the test that a long value is scanned once.
    static VISITED: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// Counts a byte a scan looked at (tests only).
#[inline]
fn visit() {
    #[cfg(test)]
    VISITED.with(|v| v.set(v.get() + 1));
}

/// A resumable `value_end`: the end of the JSON value that starts at `start`, scanned a piece at a
/// time (`j`: the next byte to look at).
#[derive(Debug, Clone, Copy, Default)]
struct ValueScan {
    started: bool,
    j: usize,
    depth: usize,
    in_str: bool,
}

impl ValueScan {
    /// The value's end (exclusive) if `b` completes it; else `None`, and the next call goes on from
    /// where this one stopped (`b` only grows between calls).
    fn end(&mut self, b: &[u8], start: usize) -> Option<usize> {
        if !self.started {
            self.started = true;
            self.j = if b[start] == b'"' { start + 1 } else { start };
        }
        match b[start] {
            b'"' => {
                while self.j < b.len() {
                    visit();
                    match b[self.j] {
                        b'\\' => self.j += 2,
                        b'"' => return Some(self.j + 1),
                        _ => self.j += 1,
                    }
                }
                None
            }
            b'{' | b'[' => {
                while self.j < b.len() {
                    visit();
                    let c = b[self.j];
                    if self.in_str {
                        match c {
                            b'\\' => self.j += 2,
                            b'"' => {
                                self.in_str = false;
                                self.j += 1;
                            }
                            _ => self.j += 1,
                        }
                        continue;
                    }
                    match c {
                        b'"' => self.in_str = true,
                        b'{' | b'[' => self.depth += 1,
                        b'}' | b']' => {
                            self.depth -= 1;
                            if self.depth == 0 {
                                return Some(self.j + 1);
                            }
                        }
                        _ => {}
                    }
                    self.j += 1;
                }
                None
            }
            _ => {
                while self.j < b.len() {
                    visit();
                    let c = b[self.j];
                    if c == b',' || c == b'}' || c == b']' || c.is_ascii_whitespace() {
                        return Some(self.j);
                    }
                    self.j += 1;
                }
                None
            }
        }
    }
}

/// Where a resumable scan of a call object's top-level fields stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stage {
    /// Looking for the object's `{`.
    Brace,
    /// After `{` or a value: whitespace, then maybe a comma.
    BeforeComma,
    /// After a comma: whitespace.
    AfterComma,
    /// A key's string (`key_start`).
    Key,
    /// After the key: whitespace, then `:`.
    Colon,
    /// After `:`: whitespace.
    BeforeValue,
    /// A value (`value_start`).
    Value,
    /// Something that is not a field: no more fields.
    Done,
}

/// A call object's `name` and `arguments` (or `parameters`) as `partial_call` finds them, scanned a
/// piece at a time from byte `at`.
#[derive(Debug, Clone)]
struct CallScan {
    stage: Stage,
    i: usize,
    key_start: usize,
    key_scan: ValueScan,
    key: String,
    value_start: usize,
    value_scan: ValueScan,
    /// From the fields that ended.
    name: Option<String>,
    arguments: Option<(usize, Option<usize>)>,
    /// Arguments written as a JSON string holding the object, decoded once the string ended: they
    /// stream as the object's text (as the finished call reads them), not as a string literal.
    decoded: Option<String>,
}

impl CallScan {
    fn new(at: usize) -> Self {
        CallScan {
            stage: Stage::Brace,
            i: at,
            key_start: 0,
            key_scan: ValueScan::default(),
            key: String::new(),
            value_start: 0,
            value_scan: ValueScan::default(),
            name: None,
            arguments: None,
            decoded: None,
        }
    }

    /// Scans on through `text` (the call's text ends at `text`'s end for now).
    fn advance(&mut self, text: &str) {
        let b = text.as_bytes();
        loop {
            match self.stage {
                Stage::Done => return,
                Stage::Brace => match b[self.i..].iter().position(|&c| c == b'{') {
                    Some(p) => {
                        self.i += p + 1;
                        self.stage = Stage::BeforeComma;
                    }
                    None => {
                        self.i = b.len();
                        return;
                    }
                },
                Stage::BeforeComma | Stage::AfterComma | Stage::Colon | Stage::BeforeValue => {
                    while self.i < b.len() && b[self.i].is_ascii_whitespace() {
                        self.i += 1;
                    }
                    if self.i >= b.len() {
                        return;
                    }
                    match self.stage {
                        Stage::BeforeComma if b[self.i] == b',' => {
                            self.i += 1;
                            self.stage = Stage::AfterComma;
                        }
                        Stage::BeforeComma | Stage::AfterComma => {
                            if b[self.i] != b'"' {
                                self.stage = Stage::Done;
                                return;
                            }
                            self.key_start = self.i;
                            self.key_scan = ValueScan::default();
                            self.stage = Stage::Key;
                        }
                        Stage::Colon => {
                            if b[self.i] != b':' {
                                self.stage = Stage::Done;
                                return;
                            }
                            self.i += 1;
                            self.stage = Stage::BeforeValue;
                        }
                        _ => {
                            self.value_start = self.i;
                            self.value_scan = ValueScan::default();
                            self.stage = Stage::Value;
                        }
                    }
                }
                Stage::Key => match self.key_scan.end(b, self.key_start) {
                    Some(end) => {
                        self.key = string_value(&text[self.key_start..end]).unwrap_or_default();
                        self.i = end;
                        self.stage = Stage::Colon;
                    }
                    None => return,
                },
                Stage::Value => match self.value_scan.end(b, self.value_start) {
                    Some(end) => {
                        self.apply(text, self.value_start, Some(end));
                        self.i = end;
                        self.stage = Stage::BeforeComma;
                    }
                    None => return,
                },
            }
        }
    }

    /// A field's effect on the call, as `partial_call` takes them in order.
    fn apply(&mut self, text: &str, start: usize, end: Option<usize>) {
        match self.key.as_str() {
            "name" => {
                if let Some(end) = end {
                    self.name = string_value(&text[start..end]);
                }
            }
            "arguments" | "parameters" => {
                self.arguments = Some((start, end));
                // Only a string that holds an object is arguments (as a finished call reads it).
                self.decoded = end
                    .filter(|_| text.as_bytes().get(start) == Some(&b'"'))
                    .and_then(|end| string_value(&text[start..end]))
                    .filter(|s| {
                        serde_json::from_str::<serde_json::Value>(s).is_ok_and(|v| v.is_object())
                    });
            }
            _ => {}
        }
    }

    /// The call's name and arguments as they stand, `text` being the call's text so far.
    fn view<'a>(&'a self, text: &'a str) -> CallView<'a> {
        let mut arguments = self.arguments;
        if self.stage == Stage::Value && matches!(self.key.as_str(), "arguments" | "parameters") {
            arguments = Some((self.value_start, None));
        }
        let arguments_at = arguments;
        let arguments = match arguments {
            None => "",
            // A string is sent decoded, whole, once it ended (nothing of it before).
            Some((s, _)) if text.as_bytes().get(s) == Some(&b'"') => {
                self.decoded.as_deref().unwrap_or("")
            }
            Some((s, e)) => &text[s..e.unwrap_or(text.len())],
        };
        CallView {
            name: self.name.as_deref(),
            arguments,
            keyed: arguments_at.is_some(),
        }
    }
}

/// A call as it stands: its name once its string is closed, its arguments' text so far.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CallView<'a> {
    pub name: Option<&'a str>,
    pub arguments: &'a str,
    /// Whether its arguments' key (`arguments`, `parameters`) is written yet.
    pub keyed: bool,
}

/// A call that ended: its text is `text[..end]`.
#[derive(Debug, Clone)]
struct Ended {
    end: usize,
    scan: CallScan,
}

#[derive(Debug, Clone)]
enum Phase {
    /// No call yet (Hermes, fallback): none opens before byte `earliest`.
    Content { earliest: usize },
    /// Llama 3 and Mistral before the reply shows whether it is a call.
    Undecided,
    /// Content for good: the reply is not a call (Llama 3, Mistral).
    Plain,
    /// Calls, after content that ends at `content_end`.
    Calls {
        content_end: usize,
        calls: Box<Calls>,
    },
}

/// The calls of a reply, by format.
#[derive(Debug, Clone)]
enum Calls {
    /// `<tool_call>…</tool_call>` blocks; text between them is not read.
    Hermes {
        ended: Vec<Ended>,
        /// The call being written (from its text's start), or `None` between calls.
        open: Option<(usize, CallScan)>,
        /// The open call's close (or the next call's opening) starts here or later.
        earliest: usize,
    },
    /// Top-level values cut at separators (Llama 3: newline and `;`; Mistral: `,` in the array).
    Split {
        separators: &'static [u8],
        /// Mistral keeps only the parts that are objects.
        objects_only: bool,
        ended: Vec<Ended>,
        /// The part being written starts here.
        from: usize,
        /// The next byte to look at, and the value being skipped (`value_end`) if one is open.
        i: usize,
        value: Option<(usize, ValueScan)>,
        /// The part being written, once it is a call.
        open: Option<CallScan>,
    },
}

/// A reply's content and calls, kept up to date as the reply grows ([`PartialStream::push`]).
#[derive(Debug, Clone)]
pub struct PartialStream {
    format: ToolFormat,
    text: String,
    phase: Phase,
}

/// What [`PartialStream::push`] found: the content so far (a possible start of a call held back), and
/// the calls from index `first` on, which are the ones the piece may have changed (earlier calls had
/// ended before it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PartialView<'a> {
    pub content: &'a str,
    pub first: usize,
    pub calls: Vec<CallView<'a>>,
}

/// The length of the longest end of `text` that is a proper start of `marker`.
fn held(text: &str, marker: &str) -> usize {
    (1..marker.len())
        .rev()
        .find(|&keep| text.ends_with(&marker[..keep]))
        .unwrap_or(0)
}

/// Where `marker` first starts in `text` at or after `*earliest`. Without a match, `*earliest` moves to
/// the first place a match may yet start once more text comes (a marker's length back from the end).
fn find_from(text: &str, earliest: &mut usize, marker: &str) -> Option<usize> {
    if let Some(at) = text[*earliest..].find(marker) {
        return Some(*earliest + at);
    }
    let mut at = text.len().saturating_sub(marker.len() - 1);
    while !text.is_char_boundary(at) {
        at -= 1;
    }
    *earliest = at.max(*earliest);
    None
}

impl PartialStream {
    pub fn new(format: ToolFormat) -> Self {
        let phase = match format {
            ToolFormat::Hermes | ToolFormat::Fallback => Phase::Content { earliest: 0 },
            ToolFormat::Llama3Json | ToolFormat::Mistral => Phase::Undecided,
        };
        PartialStream {
            format,
            text: String::new(),
            phase,
        }
    }

    /// The reply so far.
    pub fn text(&self) -> &str {
        &self.text
    }

    /// Adds `piece` to the reply; its content and calls as they now stand.
    pub fn push(&mut self, piece: &str) -> PartialView<'_> {
        self.text.push_str(piece);
        let text = self.text.as_str();
        if let Phase::Content { earliest } = &mut self.phase {
            if let Some(first) = find_from(text, earliest, HERMES_OPEN) {
                self.phase = Phase::Calls {
                    content_end: first,
                    calls: Box::new(Calls::Hermes {
                        ended: Vec::new(),
                        open: None,
                        earliest: first,
                    }),
                };
            }
        }
        if matches!(self.phase, Phase::Undecided) {
            let marker = match self.format {
                ToolFormat::Mistral => MISTRAL_TAG,
                _ => PYTHON_TAG,
            };
            let body = text.trim_start();
            let body = body.strip_prefix(marker).unwrap_or(body).trim_start();
            let at = text.len() - body.len();
            let opener = if self.format == ToolFormat::Mistral {
                '['
            } else {
                '{'
            };
            if !body.is_empty() && !marker.starts_with(body) {
                self.phase = match body.starts_with(opener) {
                    false => Phase::Plain,
                    true => Phase::Calls {
                        content_end: 0,
                        calls: Box::new(Calls::Split {
                            separators: if opener == '[' { b"," } else { b"\n;" },
                            objects_only: opener == '[',
                            ended: Vec::new(),
                            // Mistral's parts are inside its array.
                            from: at + usize::from(opener == '['),
                            i: at + usize::from(opener == '['),
                            value: None,
                            open: None,
                        }),
                    },
                };
            }
        }
        match &mut self.phase {
            Phase::Content { .. } => PartialView {
                content: &text[..text.len() - held(text, HERMES_OPEN)],
                first: 0,
                calls: Vec::new(),
            },
            Phase::Undecided => PartialView {
                content: "",
                first: 0,
                calls: Vec::new(),
            },
            Phase::Plain => PartialView {
                content: text,
                first: 0,
                calls: Vec::new(),
            },
            Phase::Calls { content_end, calls } => {
                let content = &text[..*content_end];
                let (first, calls) = calls.advance(text);
                PartialView {
                    content,
                    first,
                    calls,
                }
            }
        }
    }
}

impl Calls {
    /// Scans on through `text`; the calls from the first one that had not ended before.
    fn advance<'a>(&'a mut self, text: &'a str) -> (usize, Vec<CallView<'a>>) {
        match self {
            Calls::Hermes {
                ended,
                open,
                earliest,
            } => {
                let first = ended.len();
                loop {
                    let Some((body, mut scan)) = open.take() else {
                        match find_from(text, earliest, HERMES_OPEN) {
                            Some(at) => {
                                let body = at + HERMES_OPEN.len();
                                *open = Some((body, CallScan::new(body)));
                                *earliest = body;
                                continue;
                            }
                            None => break,
                        }
                    };
                    match find_from(text, earliest, HERMES_CLOSE) {
                        Some(end) => {
                            scan.advance(&text[..end]);
                            ended.push(Ended { end, scan });
                            *earliest = end + HERMES_CLOSE.len();
                        }
                        None => {
                            // A possible start of the close is not the call's yet.
                            let upto = (text.len() - held(text, HERMES_CLOSE)).max(body);
                            scan.advance(&text[..upto]);
                            *open = Some((body, scan));
                            break;
                        }
                    }
                }
                let mut views: Vec<CallView<'a>> = ended[first..]
                    .iter()
                    .map(|e| e.scan.view(&text[..e.end]))
                    .collect();
                if let Some((body, scan)) = open {
                    let upto = (text.len() - held(text, HERMES_CLOSE)).max(*body);
                    views.push(scan.view(&text[..upto]));
                }
                (first, views)
            }
            Calls::Split {
                separators,
                objects_only,
                ended,
                from,
                i,
                value,
                open,
            } => {
                let first = ended.len();
                let b = text.as_bytes();
                // Whether the part `text[start..end]` is a call, and its scan if so.
                let is_call = |start: usize, end: usize| {
                    let part = text[start..end].trim_start();
                    !part.trim_end().is_empty() && (!*objects_only || part.starts_with('{'))
                };
                while *i < b.len() {
                    if let Some((start, scan)) = value {
                        match scan.end(b, *start) {
                            Some(e) => {
                                *i = e;
                                *value = None;
                                continue;
                            }
                            // The rest of the text is the part being written.
                            None => break,
                        }
                    }
                    let c = b[*i];
                    if c == b'{' || c == b'[' {
                        *value = Some((*i, ValueScan::default()));
                        continue;
                    }
                    if separators.contains(&c) {
                        if is_call(*from, *i) {
                            let mut scan = open.take().unwrap_or_else(|| CallScan::new(*from));
                            scan.advance(&text[..*i]);
                            ended.push(Ended { end: *i, scan });
                        }
                        *open = None;
                        *from = *i + 1;
                    }
                    *i += 1;
                }
                if open.is_none() && is_call(*from, text.len()) {
                    *open = Some(CallScan::new(*from));
                }
                if let Some(scan) = open {
                    scan.advance(text);
                }
                let mut views: Vec<CallView<'a>> = ended[first..]
                    .iter()
                    .map(|e| e.scan.view(&text[..e.end]))
                    .collect();
                if let Some(scan) = open {
                    views.push(scan.view(text));
                }
                (first, views)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tools::{Partial, PartialCall};

    /// What `parse_partial` gives for `text`, with the end that could start `</tool_call>` held back
    /// from a Hermes call (the one way the stream differs, on purpose).
    fn reference(format: ToolFormat, text: &str) -> Partial {
        let hermes = matches!(format, ToolFormat::Hermes | ToolFormat::Fallback);
        match text.find(HERMES_OPEN) {
            Some(_) if hermes => {
                format.parse_partial(&text[..text.len() - held(text, HERMES_CLOSE)])
            }
            _ => format.parse_partial(text),
        }
    }

    /// Feeds `pieces` one at a time; after each, the stream's content and calls must be the
    /// reference's for the text so far.
    fn check(format: ToolFormat, pieces: &[&str]) {
        let mut stream = PartialStream::new(format);
        let mut calls: Vec<PartialCall> = Vec::new();
        for (k, piece) in pieces.iter().enumerate() {
            let view = stream.push(piece);
            let content = view.content.to_string();
            assert!(view.first <= calls.len(), "{format:?} piece {k}");
            calls.truncate(view.first);
            calls.extend(view.calls.iter().map(|c| PartialCall {
                name: c.name.map(str::to_string),
                arguments: c.arguments.to_string(),
            }));
            let want = reference(format, stream.text());
            assert_eq!(
                (content.as_str(), &calls),
                (want.content.as_str(), &want.calls),
                "{format:?} after piece {k} of {pieces:?}"
            );
        }
    }

    const FORMATS: [ToolFormat; 4] = [
        ToolFormat::Hermes,
        ToolFormat::Fallback,
        ToolFormat::Llama3Json,
        ToolFormat::Mistral,
    ];

    #[test]
    fn replies_cut_anywhere_give_what_the_whole_text_gives() {
        let replies = [
            "Sure.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>{\"name\": \"w\", \"arguments\": {\"a\": [1, {\"b\": \"}\\\"\"}]}}</tool_call>",
            "<tool_call>{\"arguments\": {\"x\": \"</tool\"}, \"name\": \"f\"}</tool_call>",
            "<tool_call>{\"name\": \"f\", \"arguments\": {\"x\": \"a</tool_call> tail",
            "<|python_tag|>{\"name\": \"f\", \"parameters\": {\"q\": \"a;b\\n\"}}; {\"name\": \"g\", \"parameters\": {}}\n{\"name\": \"h\"",
            " [TOOL_CALLS] [{\"name\": \"f\", \"arguments\": {\"a\": 1}}, {\"name\": \"g\", \"arguments\": \"{\\\"b\\\": 2}\"}]",
            "No call here, only text: { \"name\": 1 } and <tool_ and more.",
            "{\"name\": \"f\", \"arguments\": 12, \"arguments\": {\"z\": true}}",
            "[{\"name\":\"é\",\"arguments\":{\"k\":\"ü<tool_call>\"}}, 5, {\"name\": \"x\"}]",
        ];
        for reply in replies {
            let chars: Vec<(usize, char)> = reply.char_indices().collect();
            for format in FORMATS {
                // Every cut into two pieces, and one character at a time.
                for &(at, _) in &chars {
                    check(format, &[&reply[..at], &reply[at..]]);
                }
                let singles: Vec<&str> = chars
                    .iter()
                    .map(|&(at, c)| &reply[at..at + c.len_utf8()])
                    .collect();
                check(format, &singles);
            }
        }
    }

    #[test]
    fn random_replies_in_random_pieces_give_what_the_whole_text_gives() {
        // Fragments that drive every state of the scans.
        let fragments = [
            "<tool_call>",
            "</tool_call>",
            "<tool",
            "</tool",
            "_call>",
            "<|python_tag|>",
            "[TOOL_CALLS]",
            "{",
            "}",
            "[",
            "]",
            "\"",
            "\\",
            "\\\"",
            ",",
            ";",
            "\n",
            " ",
            ":",
            "\"name\"",
            "\"arguments\"",
            "\"parameters\"",
            "\"f\"",
            "1",
            "true",
            "ab",
            "é",
            "{\"name\": \"f\", \"arguments\": {",
        ];
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        let mut next = |n: usize| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed % n as u64) as usize
        };
        for _ in 0..3_000 {
            let len = 1 + next(40);
            let reply: String = (0..len).map(|_| fragments[next(fragments.len())]).collect();
            let mut pieces = Vec::new();
            let mut rest = reply.as_str();
            while !rest.is_empty() {
                let mut cut = (1 + next(8)).min(rest.len());
                while !rest.is_char_boundary(cut) {
                    cut += 1;
                }
                pieces.push(&rest[..cut]);
                rest = &rest[cut..];
            }
            for format in FORMATS {
                check(format, &pieces);
            }
        }
    }

    #[test]
    fn a_long_argument_is_scanned_once() {
        // 20,000 pieces of one argument's text: the scans look at each byte about once, where parsing
        // the text so far after each piece looks at 20,000² / 2 pieces' worth.
        for format in FORMATS {
            let mut stream = PartialStream::new(format);
            let start = match format {
                ToolFormat::Hermes | ToolFormat::Fallback => "<tool_call>",
                ToolFormat::Llama3Json => "<|python_tag|>",
                ToolFormat::Mistral => "[TOOL_CALLS] [",
            };
            stream.push(start);
            stream.push("{\"name\": \"write\", \"arguments\": {\"text\": \"");
            VISITED.with(|v| v.set(0));
            let piece = "word, \\\"quoted\\\" {x}; ";
            for _ in 0..20_000 {
                let view = stream.push(piece);
                assert_eq!(view.calls.len(), 1, "{format:?}");
                assert!(view.calls[0].arguments.ends_with(piece), "{format:?}");
            }
            let visited = VISITED.with(|v| v.get());
            // Each byte by the argument's scan and by the scan for the end of the call's part.
            assert!(
                visited <= 2 * 20_000 * piece.len() + 1_000,
                "{format:?}: {visited}"
            );
        }
    }
}
