//! [`ModelCodec`], the tokenizer seam the server uses: chat prompts carry exactly the special tokens the
//! template writes (one BOS for a Llama-3-style checkpoint whose tokenizer would add another), and a
//! token's bytes are its own, not those of its lossy decoded text.

#[path = "../../kura-model/tests/support/llama3.rs"]
mod llama3;

use std::path::PathBuf;
use std::sync::Arc;

use kura_engine::{ChatMessage, ModelCodec, TextCodec};
use kura_model::Model;

fn default_model() -> Arc<Model> {
    let path = kura_model::default_model_path();
    assert!(
        path.exists(),
        "default model missing at {}: run scripts/fetch-model.sh (or set KURA_MODEL)",
        path.display()
    );
    Arc::new(Model::load(&path).expect("default model loads"))
}

fn tiny_llama() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../kura-model/tests/data/tiny-llama")
}

fn messages() -> Vec<ChatMessage> {
    ["system", "user"]
        .iter()
        .zip(["Be brief.", "Hi there"])
        .map(|(role, content)| ChatMessage::new(*role, content))
        .collect()
}

#[test]
fn chat_prompt_of_a_llama3_style_checkpoint_starts_with_one_bos() {
    let dir = llama3::write_checkpoint(&tiny_llama(), "engine-codec-llama3");
    let codec = ModelCodec::from_text(Model::load(&dir).unwrap().text().clone());
    // Rendering and then encoding as a raw prompt doubles BOS: the template wrote one.
    let text = codec.render_chat(&messages()).unwrap();
    let doubled = codec.encode(&text).unwrap();
    assert_eq!(
        doubled[..2],
        [llama3::BOS_ID, llama3::BOS_ID],
        "{doubled:?}"
    );

    let ids = codec.encode_chat(&messages()).unwrap();
    assert_eq!(ids[0], llama3::BOS_ID, "{ids:?}");
    assert_eq!(
        ids.iter().filter(|&&t| t == llama3::BOS_ID).count(),
        1,
        "{ids:?}"
    );
    assert_eq!(ids, doubled[1..]);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn chat_prompt_of_the_default_model_has_no_double_bos() {
    let model = default_model();
    let codec = ModelCodec::from_text(model.text().clone());
    let ids = codec.encode_chat(&messages()).unwrap();
    let text = codec.render_chat(&messages()).unwrap();
    assert_eq!(ids, model.tokenizer().encode(&text, false).unwrap());
    if let Some(bos) = model.tokenizer().bos_token_id {
        assert!(ids[..2] != [bos, bos], "double BOS: {ids:?}");
    }
}

#[test]
fn token_bytes_of_a_split_character_are_its_own_bytes_not_u_fffd() {
    let model = default_model();
    let codec = ModelCodec::from_text(model.text().clone());
    let text = "🙂";
    let ids = model.tokenizer().encode(text, false).unwrap();
    assert!(ids.len() > 1, "{ids:?}");
    let bytes: Vec<Vec<u8>> = ids.iter().map(|&id| codec.token_bytes(id)).collect();
    assert_eq!(bytes.concat(), text.as_bytes());
    for (&id, b) in ids.iter().zip(&bytes) {
        if codec.decode(&[id]) == "\u{FFFD}" {
            assert_ne!(b.as_slice(), "\u{FFFD}".as_bytes(), "token {id}");
        }
    }
    assert!(codec.token_bytes(u32::MAX).is_empty());
}
