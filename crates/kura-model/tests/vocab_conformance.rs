//! Tokenizer conformance against llama.cpp's own vocabulary tests: for each `ggml-vocab-<name>.gguf`
//! (a vocabulary-only GGUF from llama.cpp's source package), every input of `<name>.gguf.inp` must encode
//! to the token ids of `<name>.gguf.out`, which llama.cpp's reference produced (no BOS, special tokens
//! not parsed). `scripts/fetch-vocab-tests.sh` puts the files in the cache (`$KURA_VOCAB_DIR` overrides).

use std::path::PathBuf;

use kura_model::gguf::GgufFile;
use kura_model::Tokenizer;

fn vocab_dir() -> PathBuf {
    let dir = std::env::var_os("KURA_VOCAB_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| kura_model::cache_dir().join("vocab"));
    assert!(
        dir.join("ggml-vocab-llama-spm.gguf.out").exists(),
        "llama.cpp vocabulary tests missing in {}: run scripts/fetch-vocab-tests.sh",
        dir.display()
    );
    dir
}

fn check(name: &str) -> (usize, Vec<String>) {
    let dir = vocab_dir();
    let path = dir.join(format!("ggml-vocab-{name}.gguf"));
    let g = GgufFile::open(&path).unwrap();
    let tok = Tokenizer::from_gguf(&g).unwrap();
    let inp = std::fs::read_to_string(path.with_extension("gguf.inp")).unwrap();
    let out = std::fs::read_to_string(path.with_extension("gguf.out")).unwrap();
    let inputs: Vec<&str> = inp.split("\n__ggml_vocab_test__\n").collect();
    let outputs: Vec<&str> = out.lines().collect();
    let mut failures = Vec::new();
    for (text, want) in inputs.iter().zip(&outputs) {
        let want: Vec<u32> = want
            .split_whitespace()
            .map(|t| t.parse().unwrap())
            .collect();
        let got = tok.encode(text, false).unwrap();
        if got != want {
            failures.push(format!("{text:?}: got {got:?}, want {want:?}"));
        }
    }
    (inputs.len().min(outputs.len()), failures)
}

#[test]
fn byte_level_bpe_vocabularies_encode_as_llama_cpp() {
    let mut report = Vec::new();
    for name in ["gpt-2", "llama-bpe", "qwen2", "starcoder"] {
        let (n, failures) = check(name);
        assert!(n > 30, "{name}: only {n} cases");
        for f in &failures {
            report.push(format!("{name}: {f}"));
        }
    }
    assert!(
        report.is_empty(),
        "{} mismatches:\n{}",
        report.len(),
        report.join("\n")
    );
}

#[test]
fn sentencepiece_vocabulary_encodes_as_llama_cpp() {
    let (n, failures) = check("llama-spm");
    assert!(n > 30, "only {n} cases");
    // And back: pieces to text, `▁` to spaces, byte pieces to their bytes, the added space dropped.
    let g = GgufFile::open(&vocab_dir().join("ggml-vocab-llama-spm.gguf")).unwrap();
    let tok = Tokenizer::from_gguf(&g).unwrap();
    for text in ["Hello world", "Cửa Việt", "3333333", "🦙 llama ½"] {
        let ids = tok.encode(text, false).unwrap();
        assert_eq!(tok.decode(&ids, false).unwrap(), text, "{ids:?}");
    }
    // With special tokens: BOS first, as the vocabulary asks.
    assert_eq!(tok.encode("Hello", true).unwrap()[0], 1);
    assert!(
        failures.is_empty(),
        "{} mismatches:\n{}",
        failures.len(),
        failures.join("\n")
    );
}
