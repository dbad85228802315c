//! `Tokenizer::token_bytes`: a token's own bytes, not the bytes of its lossy decoded text. On the
//! default model (byte-level BPE) a token holding part of a UTF-8 character decodes to U+FFFD but its
//! bytes are the real ones; on llama.cpp's SentencePiece test vocabulary `▁` is a space and `<0xNN>`
//! byte-fallback pieces are that byte.

mod common;

use std::path::PathBuf;

use kura_model::gguf::GgufFile;
use kura_model::{Model, Tokenizer};

const REPLACEMENT: &[u8] = "\u{FFFD}".as_bytes();

fn concat_bytes(tok: &Tokenizer, ids: &[u32]) -> Vec<u8> {
    ids.iter()
        .flat_map(|&id| tok.token_bytes(id).expect("id in the vocabulary"))
        .collect()
}

#[test]
fn byte_level_tokens_of_a_split_character_have_their_own_bytes() {
    let model = Model::load(&common::default_model_path()).unwrap();
    let tok = model.tokenizer();
    for text in ["🙂", "é", " naïve 日本"] {
        let ids = tok.encode(text, false).unwrap();
        assert_eq!(
            concat_bytes(tok, &ids),
            text.as_bytes(),
            "{text:?}: {ids:?}"
        );
    }
    // The emoji's four bytes are split over tokens that each decode to U+FFFD.
    let ids = tok.encode("🙂", false).unwrap();
    assert!(ids.len() > 1, "{ids:?}");
    let partial: Vec<u32> = ids
        .iter()
        .copied()
        .filter(|&id| tok.decode(&[id], false).unwrap() == "\u{FFFD}")
        .collect();
    assert!(!partial.is_empty(), "no partial-character token in {ids:?}");
    let mut seen = Vec::new();
    for id in partial {
        let bytes = tok.token_bytes(id).unwrap();
        assert_ne!(bytes, REPLACEMENT);
        assert!(std::str::from_utf8(&bytes).is_err(), "{bytes:?}");
        seen.push(bytes);
    }
    seen.dedup();
    assert!(
        seen.len() > 1 || ids.len() == 2,
        "distinct tokens must have distinct bytes: {seen:?}"
    );
    // A word with its leading space, and a special token as its text.
    let ids = tok.encode(" Paris", false).unwrap();
    assert_eq!(ids.len(), 1);
    assert_eq!(tok.token_bytes(ids[0]).unwrap(), b" Paris");
    let im_end = tok.token_to_id("<|im_end|>").unwrap();
    assert_eq!(tok.token_bytes(im_end).unwrap(), b"<|im_end|>");
    assert_eq!(tok.token_bytes(u32::MAX), None);
}

fn vocab_dir() -> PathBuf {
    let dir = std::env::var_os("KURA_VOCAB_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| kura_model::cache_dir().join("vocab"));
    assert!(
        dir.join("ggml-vocab-llama-spm.gguf").exists(),
        "llama.cpp vocabulary tests missing in {}: run scripts/fetch-vocab-tests.sh",
        dir.display()
    );
    dir
}

#[test]
fn sentencepiece_pieces_map_spaces_and_byte_fallback_to_bytes() {
    let g = GgufFile::open(&vocab_dir().join("ggml-vocab-llama-spm.gguf")).unwrap();
    let tok = Tokenizer::from_gguf(&g).unwrap();
    let ids = tok.encode("Hello world", false).unwrap();
    let bytes: Vec<Vec<u8>> = ids.iter().map(|&id| tok.token_bytes(id).unwrap()).collect();
    assert_eq!(bytes, [b" Hello".to_vec(), b" world".to_vec()], "{ids:?}");
    // No piece covers this emoji: it is spelled by four `<0xNN>` pieces, each its own byte.
    let emoji = "\u{1F9CC}";
    let ids = tok.encode(emoji, false).unwrap();
    let fallback: Vec<u32> = ids
        .iter()
        .copied()
        .filter(|&id| tok.id_to_token(id).is_some_and(|p| p.starts_with("<0x")))
        .collect();
    assert_eq!(fallback.len(), 4, "{ids:?}");
    let fallback_bytes: Vec<u8> = fallback
        .iter()
        .flat_map(|&id| tok.token_bytes(id).unwrap())
        .collect();
    assert_eq!(fallback_bytes, emoji.as_bytes());
    // The whole encoding spells the text with the added leading space.
    assert_eq!(concat_bytes(&tok, &ids), format!(" {emoji}").as_bytes());
    let newline = tok.token_to_id("<0x0A>").unwrap();
    assert_eq!(tok.token_bytes(newline).unwrap(), b"\n");
    let bos = tok.bos_token_id.unwrap();
    assert_eq!(tok.token_bytes(bos).unwrap(), b"<s>");
}
