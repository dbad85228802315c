//! What a model says about text — its tokenizer, chat template and vocabulary size — loaded without its
//! weights, from a GGUF's metadata or an HF directory's `tokenizer.json`, `tokenizer_config.json` (chat
//! template, BOS/EOS) and `config.json` (vocabulary size).

use std::path::Path;

use kura_gguf::{GgufFile, Value};
use kura_shape::{GgufMetadata, ModelSpec, SpecError};

use crate::chat::{ChatTemplate, CHATML, GEMMA3};
use crate::error::{Result, TextError};
use crate::tokenizer::Tokenizer;

/// The tokenizer, chat template and vocabulary size of a model (a router tokenizes requests as the
/// server does, without holding the model).
pub struct ModelText {
    pub tokenizer: Tokenizer,
    pub chat_template: ChatTemplate,
    pub vocab_size: usize,
}

/// The chat template of an architecture whose file has none: Gemma 3's own, else ChatML.
pub fn default_template(arch: &str) -> &'static str {
    match arch {
        "gemma3" | "gemma3_text" => GEMMA3,
        _ => CHATML,
    }
}

/// The shape of an open GGUF of architecture `arch` as the runtime reads it: one value per key (a
/// per-layer array, layers of different shapes, is refused with the key's name), the vocabulary size from
/// `tokenizer.ggml.tokens` when the file has no `<arch>.vocab_size`.
pub fn gguf_model_spec(g: &GgufFile, arch: &str) -> std::result::Result<ModelSpec, SpecError> {
    let number = |key: &str| -> std::result::Result<Option<u64>, String> {
        g.opt_u64(key).map_err(|e| e.to_string())
    };
    let token_count = match g.metadata.get("tokenizer.ggml.tokens") {
        Some(Value::Array(tokens)) => Some(tokens.len()),
        _ => None,
    };
    let meta = GgufMetadata {
        arch,
        number: &number,
        token_count,
        has_output_weight: g.tensors.contains_key("output.weight"),
        num_parameters: None,
    };
    ModelSpec::from_gguf(&meta, arch, "GGUF")
}

fn read_text(path: &Path) -> Result<String> {
    kura_files::read_text(path, crate::MODEL_JSON_MAX_BYTES).map_err(|source| TextError::Io {
        path: path.to_path_buf(),
        source,
    })
}

impl ModelText {
    /// The text side of a GGUF file or an HF model directory; the vocabulary size is read as
    /// `kura-shape` reads it for the runtime.
    pub fn load(path: &Path) -> Result<Self> {
        Ok(Self::load_with_context(path)?.0)
    }

    /// [`ModelText::load`], with the model's context length (tokens) where its file gives one.
    pub fn load_with_context(path: &Path) -> Result<(Self, Option<u64>)> {
        let spec_error = |e: SpecError| TextError::Config(e.to_string());
        if path.is_dir() {
            let config_path = path.join("config.json");
            let v: serde_json::Value =
                serde_json::from_str(&read_text(&config_path)?).map_err(|e| TextError::Format {
                    path: config_path.clone(),
                    what: e.to_string(),
                })?;
            let model_type = v
                .get("model_type")
                .and_then(serde_json::Value::as_str)
                .unwrap_or("llama")
                .to_string();
            let spec =
                ModelSpec::from_hf_config(&v, &model_type, "config.json").map_err(spec_error)?;
            let text = Self::from_hf_dir(path, default_template(&model_type), spec.vocab_size)?;
            Ok((text, spec.max_context))
        } else {
            let g = GgufFile::open(path)?;
            let arch = g.get_str("general.architecture")?.to_string();
            let spec = gguf_model_spec(&g, &arch).map_err(spec_error)?;
            let text = Self::from_gguf(&g, default_template(&arch), spec.vocab_size)?;
            Ok((text, spec.max_context))
        }
    }

    /// The text side of an open GGUF: its tokenizer, its chat template (`default_template` when the
    /// file has none) and `vocab_size`.
    pub fn from_gguf(g: &GgufFile, default_template: &str, vocab_size: usize) -> Result<Self> {
        let tokenizer = Tokenizer::from_gguf(g)?;
        check_ids(&tokenizer, vocab_size)?;
        let template = match g.metadata.get("tokenizer.chat_template") {
            None => default_template.to_string(),
            Some(_) => g.get_str("tokenizer.chat_template")?.to_string(),
        };
        let name = |id: Option<u32>| {
            id.and_then(|i| tokenizer.id_to_token(i))
                .unwrap_or_default()
        };
        let chat_template = ChatTemplate::new(
            &template,
            &name(tokenizer.bos_token_id),
            &name(tokenizer.eos_token_id),
        )?;
        Ok(Self {
            tokenizer,
            chat_template,
            vocab_size,
        })
    }

    /// The text side of an HF directory (`tokenizer.json`, `tokenizer_config.json`).
    pub fn from_hf_dir(dir: &Path, default_template: &str, vocab_size: usize) -> Result<Self> {
        let tcfg = TokenizerConfig::read(dir)?;
        let tokenizer = Tokenizer::from_hf_files(
            &dir.join("tokenizer.json"),
            tcfg.bos_token.as_deref(),
            tcfg.eos_token.as_deref(),
        )?;
        check_ids(&tokenizer, vocab_size)?;
        let chat_template = ChatTemplate::new(
            tcfg.chat_template.as_deref().unwrap_or(default_template),
            tcfg.bos_token.as_deref().unwrap_or(""),
            tcfg.eos_token.as_deref().unwrap_or(""),
        )?;
        Ok(Self {
            tokenizer,
            chat_template,
            vocab_size,
        })
    }
}

/// Every id the tokenizer can give, and its BOS, EOS and stop tokens, name a row of the model's
/// `vocab_size` embedding rows: a tokenizer that does not match the weights is refused when the model
/// loads, not found out by the requests that meet its tokens.
fn check_ids(tokenizer: &Tokenizer, vocab_size: usize) -> Result<()> {
    let past = |id: u32| id as usize >= vocab_size;
    if let Some(max) = tokenizer.max_id().filter(|&m| past(m)) {
        return Err(TextError::Tokenizer(format!(
            "the tokenizer has token id {max}, past the model's {vocab_size} embedding rows: the \
             tokenizer and the weights do not match"
        )));
    }
    let named = [
        ("BOS", tokenizer.bos_token_id),
        ("EOS", tokenizer.eos_token_id),
    ];
    let stops = tokenizer
        .stop_token_ids
        .iter()
        .map(|&id| ("stop", Some(id)));
    for (what, id) in named.into_iter().chain(stops) {
        if let Some(id) = id.filter(|&id| past(id)) {
            return Err(TextError::Tokenizer(format!(
                "the {what} token id {id} is outside the model's vocabulary of {vocab_size} tokens"
            )));
        }
    }
    Ok(())
}

/// What `tokenizer_config.json` says about the chat template and special tokens.
#[derive(Debug, Default)]
pub struct TokenizerConfig {
    pub chat_template: Option<String>,
    pub bos_token: Option<String>,
    pub eos_token: Option<String>,
}

impl TokenizerConfig {
    pub fn read(dir: &Path) -> Result<Self> {
        let path = dir.join("tokenizer_config.json");
        if !path.exists() {
            return Ok(Self::default());
        }
        let v: serde_json::Value =
            serde_json::from_str(&read_text(&path)?).map_err(|e| TextError::Format {
                path: path.clone(),
                what: e.to_string(),
            })?;
        let bad = |what: String| TextError::Format {
            path: path.clone(),
            what,
        };
        // A token is a string, an object with a string "content", or null (none).
        let token = |key: &str| match v.get(key) {
            None | Some(serde_json::Value::Null) => Ok(None),
            Some(serde_json::Value::String(s)) => Ok(Some(s.clone())),
            Some(serde_json::Value::Object(o)) => match o.get("content") {
                Some(serde_json::Value::String(c)) => Ok(Some(c.clone())),
                _ => Err(bad(format!(
                    "'{key}' is an object without a string \"content\""
                ))),
            },
            Some(other) => Err(bad(format!(
                "'{key}' is {other}: expected a string, an object with \"content\", or null"
            ))),
        };
        // A template is a string, or a list of named templates of which "default" is used.
        let chat_template = match v.get("chat_template") {
            None | Some(serde_json::Value::Null) => None,
            Some(serde_json::Value::String(s)) => Some(s.clone()),
            Some(serde_json::Value::Array(list)) => list
                .iter()
                .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
                .and_then(|t| t.get("template").and_then(|s| s.as_str()).map(String::from)),
            Some(_) => {
                return Err(bad(
                    "'chat_template' is neither a string nor a list of named templates".into(),
                ))
            }
        };
        let chat_template = match chat_template {
            Some(t) => Some(t),
            // Newer checkpoints keep the template in its own file.
            None if dir.join("chat_template.jinja").exists() => {
                Some(read_text(&dir.join("chat_template.jinja"))?)
            }
            None => None,
        };
        Ok(TokenizerConfig {
            chat_template,
            bos_token: token("bos_token")?,
            eos_token: token("eos_token")?,
        })
    }
}
