//! A sharded HF checkpoint (`model.safetensors.index.json` naming several `*.safetensors` files) loads to
//! the same model as the single file it was cut from, and a shard the index names but the directory lacks
//! is an error that names it.

mod common;

use std::path::PathBuf;

use kura_model::{LoadOptions, Model, WeightsDtype};
use safetensors::SafeTensors;

fn scratch_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("kura-test-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[test]
fn sharded_checkpoint_loads_like_the_single_file() {
    let src = common::golden_dir().join("tiny-llama");
    let dir = scratch_dir("sharded");
    for f in ["config.json", "tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(src.join(f), dir.join(f)).unwrap();
    }
    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors = st.tensors();
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    let half = tensors.len() / 2;
    let mut weight_map = serde_json::Map::new();
    for (i, part) in [&tensors[..half], &tensors[half..]].into_iter().enumerate() {
        let file = format!("model-{:05}-of-00002.safetensors", i + 1);
        safetensors::serialize_to_file(
            part.iter().map(|(n, v)| (n.as_str(), v)),
            None,
            &dir.join(&file),
        )
        .unwrap();
        for (n, _) in part {
            weight_map.insert(n.clone(), serde_json::Value::String(file.clone()));
        }
    }
    let index = serde_json::json!({ "metadata": {}, "weight_map": weight_map });
    std::fs::write(
        dir.join("model.safetensors.index.json"),
        serde_json::to_string_pretty(&index).unwrap(),
    )
    .unwrap();
    assert!(!dir.join("model.safetensors").exists());

    let opts = LoadOptions {
        weights_dtype: WeightsDtype::F32,
    };
    let one = Model::load_with(&src, opts).unwrap();
    let sharded = Model::load_with(&dir, opts).unwrap();
    let prompt = one
        .tokenizer()
        .encode("Hello world, this is a test", true)
        .unwrap();
    let (tokens_one, logits_one) = common::greedy(&one, &prompt, 8, 16, true);
    let (tokens_sharded, logits_sharded) = common::greedy(&sharded, &prompt, 8, 16, true);
    assert_eq!(tokens_one, tokens_sharded);
    assert_eq!(logits_one, logits_sharded);

    std::fs::remove_file(dir.join("model-00002-of-00002.safetensors")).unwrap();
    let err = Model::load_with(&dir, opts)
        .err()
        .expect("a missing shard must fail")
        .to_string();
    assert!(
        err.contains("model-00002-of-00002.safetensors"),
        "error does not name the missing shard: {err}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
