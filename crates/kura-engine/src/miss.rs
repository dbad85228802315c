//! Why a prompt was not cached further ([`CacheMiss`]): the engine remembers the recent token
//! sequences of each cache salt (prompts, and prompts with their output once finished), bounded in
//! tokens, and compares a prompt whose cached part falls short of what a prompt can have cached
//! (every whole block before its last token) with the longest of them.
//!
//! - The pool held the next blocks, but not the parts of them a sliding-window layer reads (a hybrid
//!   pool reclaims those first, and a lookup is cut back to where the window can be served):
//!   `window_dropped`. The scheduler tells it at admission
//!   ([`kura_kv::PrefixHit::num_window_cut_blocks`]).
//! - The salt had a sequence that matches at least one more whole block: that block was cached and is
//!   gone — `evicted`.
//! - It had one that goes on differently within the next block: the prompt `diverged` at the first
//!   token that differs (only whole blocks are cached); `template_rerendered` when that token lies in
//!   the earlier turns of a conversation ([`GenerateRequest::history_tokens`]).
//! - Another salt of the same tenant (the part of the salt before [`TENANT_SEPARATOR`]: the API key's
//!   tenant) had it: `salt_differs`. Other tenants are never looked at: their prompts say nothing to
//!   this one. (Without API keys a salt has no tenant part, and each salt is a tenant of its own.)
//! - This tenant never sent a prompt that starts like this one: `never_seen`.
//!
//! A prompt that goes on past everything its tenant had, all of which it found cached (the next turn of
//! a conversation), missed nothing: no reason is told.
//!
//! The comparison costs one pass over the salt's remembered tokens, and is made only on a miss.
//!
//! [`GenerateRequest::history_tokens`]: crate::GenerateRequest::history_tokens

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use crate::request::{CacheMiss, MissReason, TENANT_SEPARATOR};

/// Tokens remembered over every salt (4 bytes each).
pub const MAX_TOKENS: usize = 1 << 21;
/// Sequences remembered per salt.
pub const PER_SALT: usize = 64;

type Salt = Option<String>;

#[derive(Default)]
pub(crate) struct SeenLog {
    by_salt: HashMap<Salt, Vec<Arc<[u32]>>>,
    /// Oldest first, for dropping past [`MAX_TOKENS`].
    order: VecDeque<(Salt, Arc<[u32]>)>,
    tokens: usize,
}

fn lcp(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

fn tenant_of(salt: &Salt) -> &str {
    salt.as_deref()
        .map_or("", |s| s.split(TENANT_SEPARATOR).next().unwrap_or(""))
}

impl SeenLog {
    /// Remembers `seq` under `salt` (a sequence it extends is forgotten: this one says more).
    pub fn record(&mut self, salt: &Salt, seq: &[u32]) {
        if seq.is_empty() || seq.len() > MAX_TOKENS {
            return;
        }
        let list = self.by_salt.entry(salt.clone()).or_default();
        if list
            .iter()
            .any(|s| s.len() >= seq.len() && s[..seq.len()] == *seq)
        {
            return;
        }
        let before: usize = list.iter().map(|s| s.len()).sum();
        list.retain(|s| !(s.len() < seq.len() && seq[..s.len()] == **s));
        if list.len() >= PER_SALT {
            list.remove(0);
        }
        let seq: Arc<[u32]> = seq.into();
        list.push(seq.clone());
        let after: usize = list.iter().map(|s| s.len()).sum();
        self.tokens = self.tokens + after - before;
        self.order.push_back((salt.clone(), seq));
        while self.tokens > MAX_TOKENS {
            let Some((salt, old)) = self.order.pop_front() else {
                break;
            };
            if let Some(list) = self.by_salt.get_mut(&salt) {
                if let Some(i) = list.iter().position(|s| Arc::ptr_eq(s, &old)) {
                    self.tokens -= old.len();
                    list.remove(i);
                }
                if list.is_empty() {
                    self.by_salt.remove(&salt);
                }
            }
        }
        // Entries replaced above stay in `order` until their turn; they count for nothing.
        if self.order.len() > 4 * PER_SALT * self.by_salt.len().max(1) {
            let live: Vec<(Salt, Arc<[u32]>)> = self
                .order
                .drain(..)
                .filter(|(salt, s)| {
                    self.by_salt
                        .get(salt)
                        .is_some_and(|l| l.iter().any(|x| Arc::ptr_eq(x, s)))
                })
                .collect();
            self.order.extend(live);
        }
    }

    /// The longest common prefix of `prompt` with a sequence of `salt`, and whether a sequence that
    /// long goes on differently (rather than ending where the prompt goes on).
    fn longest(&self, salt: &Salt, prompt: &[u32]) -> (usize, bool) {
        let Some(list) = self.by_salt.get(salt) else {
            return (0, false);
        };
        let mut best = (0, false);
        for s in list {
            let n = lcp(s, prompt);
            let differs = n < s.len() && n < prompt.len();
            if n > best.0 || (n == best.0 && differs) {
                best = (n, differs);
            }
        }
        best
    }

    fn longest_other_salt(&self, salt: &Salt, prompt: &[u32]) -> usize {
        let tenant = tenant_of(salt);
        self.by_salt
            .iter()
            .filter(|(s, _)| *s != salt && tenant_of(s) == tenant)
            .flat_map(|(_, l)| l.iter().map(|s| lcp(s, prompt)))
            .max()
            .unwrap_or(0)
    }

    /// Why `prompt` (of which `cached` tokens came from the cache) was not cached further, if it could
    /// have been; blocks of `block` tokens.
    pub fn explain(
        &self,
        salt: &Salt,
        prompt: &[u32],
        cached: usize,
        block: usize,
        history: usize,
        window_cut: bool,
    ) -> Option<CacheMiss> {
        let cacheable = prompt.len().saturating_sub(1) / block * block;
        if cached >= cacheable {
            return None;
        }
        let at = |n: usize| u32::try_from(n).unwrap_or(u32::MAX);
        let (seen, differs) = self.longest(salt, prompt);
        let (reason, pos) = if window_cut {
            (MissReason::WindowDropped, cached)
        } else if seen >= cached + block {
            (MissReason::Evicted, cached)
        } else if differs && seen > 0 && seen >= cached {
            // (Sharing no token with anything the tenant sent is not diverging: never seen, below.)
            if seen < history {
                (MissReason::TemplateRerendered, seen)
            } else {
                (MissReason::Diverged, seen)
            }
        } else if self.longest_other_salt(salt, prompt) >= cached + block {
            (MissReason::SaltDiffers, cached)
        } else if seen == 0 {
            (MissReason::NeverSeen, cached)
        } else {
            // The prompt goes on past everything this tenant had, and all of that was cached: the
            // rest is new, and nothing was missed.
            return None;
        };
        Some(CacheMiss {
            reason,
            at: at(pos),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn salt(s: &str) -> Salt {
        Some(s.to_string())
    }

    #[test]
    fn each_reason_is_told_apart() {
        let mut log = SeenLog::default();
        let a = salt("t1");
        let p: Vec<u32> = (0..64).collect();
        assert_eq!(
            log.explain(&a, &p, 0, 16, 0, false).unwrap().reason,
            MissReason::NeverSeen
        );
        log.record(&a, &p);
        // All of it was seen, only 16 tokens came back: the rest was evicted.
        let m = log.explain(&a, &p, 16, 16, 0, false).unwrap();
        assert_eq!((m.reason, m.at), (MissReason::Evicted, 16));
        // Cached as far as a prompt can be: no miss.
        assert!(log.explain(&a, &p, 48, 16, 0, false).is_none());
        // Differs at token 40, inside the block after the 32 cached.
        let mut q = p.clone();
        q[40] = 999;
        let m = log.explain(&a, &q, 32, 16, 0, false).unwrap();
        assert_eq!((m.reason, m.at), (MissReason::Diverged, 40));
        let m = log.explain(&a, &q, 32, 16, 50, false).unwrap();
        assert_eq!((m.reason, m.at), (MissReason::TemplateRerendered, 40));
        // Differing right at a block's start is diverging too.
        let mut r = p.clone();
        r[32] = 999;
        let m = log.explain(&a, &r, 32, 16, 0, false).unwrap();
        assert_eq!((m.reason, m.at), (MissReason::Diverged, 32));
        // A prompt that goes on past everything seen, all of it cached (a conversation's next turn):
        // nothing was missed.
        let longer: Vec<u32> = (0..100).collect();
        assert!(log.explain(&a, &longer, 64, 16, 0, false).is_none());
        // Seen only in part, and not cached that far: evicted.
        let m = log.explain(&a, &longer, 32, 16, 0, false).unwrap();
        assert_eq!((m.reason, m.at), (MissReason::Evicted, 32));
        // Nothing of the tenant's shares even its first token: never seen, not diverged at 0, with a
        // rendered history or without.
        let unrelated: Vec<u32> = (500..564).collect();
        for history in [0, 20] {
            let m = log.explain(&a, &unrelated, 0, 16, history, false).unwrap();
            assert_eq!((m.reason, m.at), (MissReason::NeverSeen, 0));
        }
        // The same tenant under another salt had it; another tenant's prompts are never looked at.
        let b = salt("t1\u{1f}mine");
        assert_eq!(
            log.explain(&b, &p, 0, 16, 0, false).unwrap().reason,
            MissReason::SaltDiffers
        );
        assert_eq!(
            log.explain(&salt("t2"), &p, 0, 16, 0, false)
                .unwrap()
                .reason,
            MissReason::NeverSeen
        );
        // The pool had the next blocks, without their window parts: that is the reason, whatever
        // the log says.
        let m = log.explain(&a, &p, 16, 16, 0, true).unwrap();
        assert_eq!((m.reason, m.at), (MissReason::WindowDropped, 16));
        assert!(log.explain(&a, &p, 48, 16, 0, true).is_none());
    }

    #[test]
    fn the_log_stays_within_its_bounds() {
        let mut log = SeenLog::default();
        let a = salt("t");
        for i in 0..(PER_SALT as u32 * 3) {
            log.record(&a, &[i, 1, 2, 3]);
        }
        assert_eq!(log.by_salt[&a].len(), PER_SALT);
        // A longer sequence replaces the one it extends.
        log.record(&a, &[9999, 1]);
        log.record(&a, &[9999, 1, 5]);
        assert_eq!(log.by_salt[&a].iter().filter(|s| s[0] == 9999).count(), 1);
        let big: Vec<u32> = (0..(MAX_TOKENS as u32 / 2 + 10)).collect();
        log.record(&salt("x"), &big);
        let mut other = big.clone();
        other[0] = 7;
        log.record(&salt("y"), &other);
        assert!(log.tokens <= MAX_TOKENS, "{}", log.tokens);
        let total: usize = log.by_salt.values().flatten().map(|s| s.len()).sum();
        assert_eq!(total, log.tokens);
    }
}
