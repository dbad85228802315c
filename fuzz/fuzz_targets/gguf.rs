//! GGUF reader: header, metadata, tensor directory, the model config, tokenizer and chat template derived
//! from them, every tensor dequantized, and the whole loader (`Model::load_with`) over arbitrary bytes.
//! Nothing may panic, abort or allocate without bound; errors are the expected outcome.
#![no_main]

use std::path::PathBuf;
use std::sync::OnceLock;

use kura_kv::codec::KvDtype;
use kura_model::gguf::{GgufFile, Value};
use kura_model::{ChatMessage, ChatTemplate, LoadOptions, Model, ModelConfig, Tokenizer, WeightsDtype};
use libfuzzer_sys::fuzz_target;

/// The reader takes a path (it memory-maps the file): one scratch file per fuzzing process.
fn scratch() -> &'static PathBuf {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| {
        // One compute thread: the machine is shared and the loader's parallelism is not what is tested.
        let _ = kura_model::set_threads(1);
        let dir = if std::path::Path::new("/dev/shm").is_dir() {
            PathBuf::from("/dev/shm")
        } else {
            std::env::temp_dir()
        };
        dir.join(format!("kura-fuzz-gguf-{}.gguf", std::process::id()))
    })
}

fuzz_target!(|data: &[u8]| {
    let path = scratch();
    std::fs::write(path, data).expect("scratch file");
    let Ok(g) = GgufFile::open(path) else { return };

    // Each stage on its own, so that an error in one does not hide the others from the fuzzer.
    if let Ok(cfg) = ModelConfig::from_gguf(&g) {
        let _ = cfg.layer_window(0);
    }
    if let Ok(tok) = Tokenizer::from_gguf(&g) {
        if let Ok(ids) = tok.encode("Hello <|im_start|>world 123 ünï", true) {
            let _ = tok.decode(&ids, false);
        }
    }
    if let Some(Value::String(source)) = g.metadata.get("tokenizer.chat_template") {
        if let Ok(t) = ChatTemplate::new(source, "<s>", "</s>") {
            let _ = t.render(&[ChatMessage::new("user", "Hi")], true);
        }
    }
    for name in g.tensors.keys() {
        let _ = kura_model::gguf::tensor_f32(&g, name);
    }
    drop(g);

    // The loader end to end, as `kura serve` runs it.
    let opts = LoadOptions {
        weights_dtype: WeightsDtype::F32,
    };
    if let Ok(model) = Model::load_with(path, opts) {
        let _ = model.kv_layout(KvDtype::Bf16, 16);
        let _ = model.encode_chat(&[ChatMessage::new("user", "Hi there")], true);
    }
});
