//! Stop strings and stop tokens over generated text.

/// Why generation ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StopReason {
    /// A stop token (EOS, end of turn, or one the request named).
    Token(u32),
    /// A stop string; the text up to it is kept, the string itself is not.
    String(String),
}

/// Watches generated text for stop strings, holding back any tail that could still become one, so that
/// a stop string never reaches the client even when it arrives split across tokens.
#[derive(Debug, Clone, Default)]
pub struct StopChecker {
    stop_tokens: Vec<u32>,
    stop_strings: Vec<String>,
    /// Text received but not yet released.
    pending: String,
}

impl StopChecker {
    pub fn new(stop_tokens: Vec<u32>, stop_strings: Vec<String>) -> Self {
        let stop_strings = stop_strings.into_iter().filter(|s| !s.is_empty()).collect();
        StopChecker {
            stop_tokens,
            stop_strings,
            pending: String::new(),
        }
    }

    pub fn is_stop_token(&self, id: u32) -> bool {
        self.stop_tokens.contains(&id)
    }

    /// Feeds the text of a new token; returns the text safe to release and whether a stop string ended it.
    pub fn push(&mut self, text: &str) -> (String, Option<StopReason>) {
        self.pending.push_str(text);
        if let Some((at, s)) = self
            .stop_strings
            .iter()
            .filter_map(|s| self.pending.find(s.as_str()).map(|i| (i, s)))
            .min_by_key(|(i, _)| *i)
        {
            let out = self.pending[..at].to_string();
            let reason = StopReason::String(s.clone());
            self.pending.clear();
            return (out, Some(reason));
        }
        // Hold back the longest suffix that is a prefix of some stop string.
        let mut hold = 0;
        for s in &self.stop_strings {
            for n in (1..s.len().min(self.pending.len() + 1)).rev() {
                if s.is_char_boundary(n) && self.pending.ends_with(&s[..n]) {
                    hold = hold.max(n);
                    break;
                }
            }
        }
        let cut = self.pending.len() - hold;
        let out = self.pending[..cut].to_string();
        self.pending.drain(..cut);
        (out, None)
    }

    /// Releases whatever was held back (generation ended for another reason).
    pub fn flush(&mut self) -> String {
        std::mem::take(&mut self.pending)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stop_string_split_across_tokens_is_never_released() {
        let mut c = StopChecker::new(vec![], vec!["END".into()]);
        assert_eq!(c.push("hello E"), ("hello ".to_string(), None));
        assert_eq!(c.push("N"), (String::new(), None));
        assert_eq!(
            c.push("D tail"),
            (String::new(), Some(StopReason::String("END".into())))
        );
        let mut c = StopChecker::new(vec![], vec!["END".into()]);
        assert_eq!(c.push("E"), (String::new(), None));
        assert_eq!(c.push("x"), ("Ex".to_string(), None));
        assert_eq!(c.flush(), "");
    }
}
