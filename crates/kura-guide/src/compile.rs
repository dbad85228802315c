//! Grammars compiled by llguidance over the served model's vocabulary.

use std::sync::Arc;

use kura_request::{ConstraintSpec, TextCodec, TokenConstraint};
use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};
use llguidance::{Matcher, ParserFactory};
use serde_json::json;

use crate::{regex_literal, with_layout, Guide};

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

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        let text = String::from_utf8_lossy(s);
        // Plain text: special-token text inside it stays text.
        let whole = 0..text.len();
        let ids = self
            .codec
            .encode_with_plain_spans(&text, std::slice::from_ref(&whole))
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
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| e.to_string())?;
        // Warnings and errors come back to the request; nothing goes to stderr.
        factory.set_stderr_log_level(0);
        Ok(Guides {
            factory: Arc::new(factory),
            eos: eos.into(),
        })
    }

    /// `guide` compiled for this vocabulary; an error (a schema or grammar llguidance cannot compile)
    /// names the problem.
    pub fn compile(&self, guide: &Guide) -> Result<Arc<Compiled>, String> {
        let parser = self
            .factory
            .create_parser(guide.grammar())
            .map_err(|e| e.to_string())?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(e);
        }
        Ok(Arc::new(Compiled {
            start: matcher,
            eos: self.eos.clone(),
        }))
    }
}

/// A compiled grammar: each choice starts from a copy of it.
pub struct Compiled {
    start: Matcher,
    eos: Arc<[u32]>,
}

impl std::fmt::Debug for Compiled {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Compiled grammar")
    }
}

impl ConstraintSpec for Compiled {
    fn start(&self) -> Result<Box<dyn TokenConstraint>, String> {
        Ok(Box::new(Walk {
            matcher: self.start.deep_clone(),
            eos: self.eos.clone(),
            mask: Vec::new(),
        }))
    }
}

/// One choice's walk through a compiled grammar.
struct Walk {
    matcher: Matcher,
    eos: Arc<[u32]>,
    mask: Vec<u32>,
}

impl TokenConstraint for Walk {
    fn allowed(&mut self) -> Result<&[u32], String> {
        let vob = self.matcher.compute_mask().map_err(|e| e.to_string())?;
        self.mask.clear();
        self.mask.extend_from_slice(vob.as_slice());
        if self.mask.iter().all(|&w| w == 0) {
            return Err("the grammar allows no token here".into());
        }
        // llguidance knows one end-of-sequence token; the model may have several.
        let first = self.eos[0] as usize;
        if self
            .mask
            .get(first / 32)
            .is_some_and(|w| w >> (first % 32) & 1 == 1)
        {
            for &e in self.eos.iter() {
                let (w, b) = (e as usize / 32, e % 32);
                if let Some(word) = self.mask.get_mut(w) {
                    *word |= 1 << b;
                }
            }
        }
        Ok(&self.mask)
    }

    fn accept(&mut self, token: u32) -> Result<(), String> {
        // Any of the model's end-of-sequence tokens stands for the one llguidance knows.
        let token = if self.eos.contains(&token) {
            self.eos[0]
        } else {
            token
        };
        self.matcher.consume_token(token).map_err(|e| e.to_string())
    }

    fn is_done(&self) -> bool {
        self.matcher.is_stopped()
    }
}
