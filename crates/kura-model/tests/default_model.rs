//! The default model (SmolLM2-135M-Instruct, Q4_1 GGUF) end to end.

mod common;

use kura_model::{LoadOptions, Model, WeightsDtype};

#[test]
fn capital_of_france_is_paris() {
    for dtype in [WeightsDtype::F32, WeightsDtype::Bf16] {
        let model = Model::load_with(
            &common::default_model_path(),
            LoadOptions {
                weights_dtype: dtype,
            },
        )
        .unwrap();
        let tok = model.tokenizer();
        let prompt = tok.encode("The capital of France is", true).unwrap();
        let (out, _) = common::greedy(&model, &prompt, 1, 16, true);
        assert_eq!(tok.decode(&out, false).unwrap(), " Paris", "{dtype:?}");
    }
}
