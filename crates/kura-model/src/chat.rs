//! Chat templates: the model's Jinja template (GGUF `tokenizer.chat_template`, or `chat_template` of
//! `tokenizer_config.json`) rendered with minijinja and its Python-compatibility methods, taking
//! OpenAI-style messages. A model without a template gets its architecture's ([`GEMMA3`]) or ChatML.
//!
//! [`ChatTemplate::encode`] is the one way from messages to prompt tokens: the template writes every
//! special token the model expects (BOS included), so the rendered text is tokenized without adding any,
//! as HF's `apply_chat_template(tokenize=True)` does. Encoding the rendered text *with* special tokens
//! would put a second BOS in front of templates that write `bos_token` (Llama 3).

use minijinja::{context, Environment, Error, ErrorKind};
use serde::{Deserialize, Serialize};

use crate::error::{ModelError, Result};
use crate::tokenizer::Tokenizer;

/// ChatML, the format of SmolLM2 and Qwen2, used when a model ships no template.
pub const CHATML: &str = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

/// Gemma 3's chat template (as published with the instruction-tuned models), used for a gemma3 model
/// that ships none: the system message folded into the first user turn, contents trimmed, the assistant
/// called `model`, turns closed by `<end_of_turn>`.
pub const GEMMA3: &str = include_str!("gemma3_chat_template.jinja");

/// One OpenAI-style chat message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        ChatMessage {
            role: role.into(),
            content: content.into(),
        }
    }
}

/// A compiled chat template. Cheap to render many times; `Send + Sync`.
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
}

/// Template instructions one render may run. A chat template comes from the model file, so a hostile or
/// broken one could loop without end (nested `range`s, recursive macros): past this budget the render
/// fails. Real templates spend tens of instructions a message; this covers far more messages than the
/// largest request body holds.
pub const RENDER_FUEL: u64 = 20_000_000;

fn raise_exception(msg: String) -> std::result::Result<String, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, msg))
}

impl ChatTemplate {
    pub fn new(source: &str, bos_token: &str, eos_token: &str) -> Result<Self> {
        let mut env = Environment::new();
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.set_trim_blocks(false);
        env.set_fuel(Some(RENDER_FUEL));
        env.add_template_owned("chat", source.to_string())
            .map_err(|e| ModelError::ChatTemplate(format!("template does not compile: {e}")))?;
        Ok(ChatTemplate {
            env,
            bos_token: bos_token.to_string(),
            eos_token: eos_token.to_string(),
        })
    }

    /// The prompt text for `messages`; `add_generation_prompt` opens the assistant's turn.
    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
        let t = self
            .env
            .get_template("chat")
            .map_err(|e| ModelError::ChatTemplate(e.to_string()))?;
        t.render(context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            bos_token => &self.bos_token,
            eos_token => &self.eos_token,
        })
        .map_err(|e| ModelError::ChatTemplate(format!("rendering failed: {e}")))
    }

    /// Prompt tokens of `messages`: the rendered template tokenized with its special-token markers
    /// recognised and nothing added (the template already wrote BOS if the model wants one).
    pub fn encode(
        &self,
        tokenizer: &Tokenizer,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<Vec<u32>> {
        let text = self.render(messages, add_generation_prompt)?;
        tokenizer.encode(&text, false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chatml_renders_turns_and_generation_prompt() {
        let t = ChatTemplate::new(CHATML, "", "<|im_end|>").unwrap();
        let s = t.render(&[ChatMessage::new("user", "Hi")], true).unwrap();
        assert_eq!(s, "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
    }

    #[test]
    fn raise_exception_is_an_error_and_bad_template_is_named() {
        let t = ChatTemplate::new("{{ raise_exception('roles must alternate') }}", "", "").unwrap();
        let e = t.render(&[], false).unwrap_err().to_string();
        assert!(e.contains("roles must alternate"), "{e}");
        assert!(ChatTemplate::new("{% for %}", "", "").is_err());
    }

    #[test]
    fn a_template_that_runs_without_end_fails_instead_of_hanging() {
        // 10^8 iterations (range allows at most 10,000 items a call) if nothing stopped it.
        let t = ChatTemplate::new(
            "{% for i in range(10000) %}{% for j in range(10000) %}{% endfor %}{% endfor %}",
            "",
            "",
        )
        .unwrap();
        let e = t.render(&[], false).unwrap_err().to_string();
        assert!(e.contains("fuel"), "{e}");
        // A long conversation through a real template stays well inside the budget.
        let t = ChatTemplate::new(CHATML, "", "<|im_end|>").unwrap();
        let messages: Vec<_> = (0..10_000)
            .map(|i| ChatMessage::new("user", format!("m{i}")))
            .collect();
        assert!(t.render(&messages, true).is_ok());
    }
}
