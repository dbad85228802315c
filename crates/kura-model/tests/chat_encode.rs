//! Chat prompts get exactly the special tokens their template writes: one BOS for a Llama-3-style
//! checkpoint whose tokenizer post-processor would add another, and none doubled for the default model.

mod common;
#[path = "support/llama3.rs"]
mod llama3;

use kura_model::{ChatMessage, Model};

fn messages() -> Vec<ChatMessage> {
    vec![
        ChatMessage::new("system", "Be brief."),
        ChatMessage::new("user", "Hi there"),
    ]
}

#[test]
fn llama3_style_chat_prompt_has_exactly_one_bos() {
    let dir = llama3::write_checkpoint(&common::golden_dir().join("tiny-llama"), "chat-llama3");
    let model = Model::load(&dir).unwrap();
    let tok = model.tokenizer();
    let text = model.chat_template().render(&messages(), true).unwrap();
    assert!(text.starts_with(llama3::BOS), "{text:?}");
    // The trap: the template writes BOS and the post-processor adds one more.
    let doubled = tok.encode(&text, true).unwrap();
    assert_eq!(
        doubled[..2],
        [llama3::BOS_ID, llama3::BOS_ID],
        "the test tokenizer must add BOS itself, or this test proves nothing: {doubled:?}"
    );

    let ids = model
        .chat_template()
        .encode(tok, &messages(), true)
        .unwrap();
    assert_eq!(ids[0], llama3::BOS_ID, "{ids:?}");
    assert_eq!(
        ids.iter().filter(|&&t| t == llama3::BOS_ID).count(),
        1,
        "{ids:?}"
    );
    assert_eq!(ids, doubled[1..]);
    assert!(ids.contains(&llama3::EOT_ID));
    assert_eq!(model.encode_chat(&messages(), true).unwrap(), ids);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn default_model_chat_prompt_is_the_rendered_text_without_added_tokens() {
    let model = Model::load(&common::default_model_path()).unwrap();
    let tok = model.tokenizer();
    let text = model.chat_template().render(&messages(), true).unwrap();
    let ids = model
        .chat_template()
        .encode(tok, &messages(), true)
        .unwrap();
    assert_eq!(ids, tok.encode(&text, false).unwrap());
    assert_eq!(tok.decode(&ids, false).unwrap(), text);
    if let Some(bos) = tok.bos_token_id {
        assert!(ids[..2] != [bos, bos], "double BOS: {ids:?}");
    }
}
