//! The offline catalogs of `kura plan`: popular models (the shape keys of each one's `config.json`, with
//! the config's address as its source and the parameter count of its model card) and accelerators (memory
//! as the driver reports it: `nvidia-smi`'s MiB for NVIDIA, `rocm-smi`'s for AMD).
//!
//! Lookups are O(catalog); an unknown name gets the closest names by edit distance.

use super::spec::ModelSpec;

/// One model of the catalog. `config` holds the keys of its Hugging Face `config.json` that decide memory.
#[derive(Debug)]
pub struct CatalogModel {
    pub name: &'static str,
    pub source: &'static str,
    pub params: u64,
    pub config: &'static str,
}

const B: u64 = 1_000_000_000;
const M: u64 = 1_000_000;

macro_rules! hf {
    ($repo:literal) => {
        concat!("https://huggingface.co/", $repo, "/blob/main/config.json")
    };
}

pub static MODELS: &[CatalogModel] = &[
    CatalogModel {
        name: "llama-2-7b",
        source: hf!("meta-llama/Llama-2-7b-hf"),
        params: 6_740 * M,
        config: r#"{"model_type":"llama","num_hidden_layers":32,"hidden_size":4096,"num_attention_heads":32,"num_key_value_heads":32,"intermediate_size":11008,"vocab_size":32000,"max_position_embeddings":4096}"#,
    },
    CatalogModel {
        name: "llama-2-13b",
        source: hf!("meta-llama/Llama-2-13b-hf"),
        params: 13_016 * M,
        config: r#"{"model_type":"llama","num_hidden_layers":40,"hidden_size":5120,"num_attention_heads":40,"num_key_value_heads":40,"intermediate_size":13824,"vocab_size":32000,"max_position_embeddings":4096}"#,
    },
    CatalogModel {
        name: "llama-2-70b",
        source: hf!("meta-llama/Llama-2-70b-hf"),
        params: 68_977 * M,
        config: r#"{"model_type":"llama","num_hidden_layers":80,"hidden_size":8192,"num_attention_heads":64,"num_key_value_heads":8,"intermediate_size":28672,"vocab_size":32000,"max_position_embeddings":4096}"#,
    },
    CatalogModel {
        name: "llama-3-8b",
        source: hf!("meta-llama/Meta-Llama-3-8B"),
        params: 8_030 * M,
        config: r#"{"model_type":"llama","num_hidden_layers":32,"hidden_size":4096,"num_attention_heads":32,"num_key_value_heads":8,"intermediate_size":14336,"vocab_size":128256,"max_position_embeddings":8192}"#,
    },
    CatalogModel {
        name: "llama-3.1-8b",
        source: hf!("meta-llama/Llama-3.1-8B-Instruct"),
        params: 8_030 * M,
        config: r#"{"model_type":"llama","num_hidden_layers":32,"hidden_size":4096,"num_attention_heads":32,"num_key_value_heads":8,"intermediate_size":14336,"vocab_size":128256,"max_position_embeddings":131072}"#,
    },
    CatalogModel {
        name: "llama-3.1-70b",
        source: hf!("meta-llama/Llama-3.1-70B-Instruct"),
        params: 70_554 * M,
        config: r#"{"model_type":"llama","num_hidden_layers":80,"hidden_size":8192,"num_attention_heads":64,"num_key_value_heads":8,"intermediate_size":28672,"vocab_size":128256,"max_position_embeddings":131072}"#,
    },
    CatalogModel {
        name: "llama-3.1-405b",
        source: hf!("meta-llama/Llama-3.1-405B-Instruct"),
        params: 405_853 * M,
        config: r#"{"model_type":"llama","num_hidden_layers":126,"hidden_size":16384,"num_attention_heads":128,"num_key_value_heads":8,"intermediate_size":53248,"vocab_size":128256,"max_position_embeddings":131072}"#,
    },
    CatalogModel {
        name: "llama-3.2-1b",
        source: hf!("meta-llama/Llama-3.2-1B-Instruct"),
        params: 1_236 * M,
        config: r#"{"model_type":"llama","num_hidden_layers":16,"hidden_size":2048,"num_attention_heads":32,"num_key_value_heads":8,"head_dim":64,"intermediate_size":8192,"vocab_size":128256,"max_position_embeddings":131072,"tie_word_embeddings":true}"#,
    },
    CatalogModel {
        name: "llama-3.2-3b",
        source: hf!("meta-llama/Llama-3.2-3B-Instruct"),
        params: 3_213 * M,
        config: r#"{"model_type":"llama","num_hidden_layers":28,"hidden_size":3072,"num_attention_heads":24,"num_key_value_heads":8,"head_dim":128,"intermediate_size":8192,"vocab_size":128256,"max_position_embeddings":131072,"tie_word_embeddings":true}"#,
    },
    CatalogModel {
        name: "llama-3.3-70b",
        source: hf!("meta-llama/Llama-3.3-70B-Instruct"),
        params: 70_554 * M,
        config: r#"{"model_type":"llama","num_hidden_layers":80,"hidden_size":8192,"num_attention_heads":64,"num_key_value_heads":8,"intermediate_size":28672,"vocab_size":128256,"max_position_embeddings":131072}"#,
    },
    CatalogModel {
        name: "qwen2.5-0.5b",
        source: hf!("Qwen/Qwen2.5-0.5B-Instruct"),
        params: 494 * M,
        config: r#"{"model_type":"qwen2","num_hidden_layers":24,"hidden_size":896,"num_attention_heads":14,"num_key_value_heads":2,"intermediate_size":4864,"vocab_size":151936,"max_position_embeddings":32768,"sliding_window":32768,"use_sliding_window":false,"tie_word_embeddings":true}"#,
    },
    CatalogModel {
        name: "qwen2.5-1.5b",
        source: hf!("Qwen/Qwen2.5-1.5B-Instruct"),
        params: 1_544 * M,
        config: r#"{"model_type":"qwen2","num_hidden_layers":28,"hidden_size":1536,"num_attention_heads":12,"num_key_value_heads":2,"intermediate_size":8960,"vocab_size":151936,"max_position_embeddings":32768,"sliding_window":32768,"use_sliding_window":false,"tie_word_embeddings":true}"#,
    },
    CatalogModel {
        name: "qwen2.5-3b",
        source: hf!("Qwen/Qwen2.5-3B-Instruct"),
        params: 3_086 * M,
        config: r#"{"model_type":"qwen2","num_hidden_layers":36,"hidden_size":2048,"num_attention_heads":16,"num_key_value_heads":2,"intermediate_size":11008,"vocab_size":151936,"max_position_embeddings":32768,"sliding_window":32768,"use_sliding_window":false,"tie_word_embeddings":true}"#,
    },
    CatalogModel {
        name: "qwen2.5-7b",
        source: hf!("Qwen/Qwen2.5-7B-Instruct"),
        params: 7_616 * M,
        config: r#"{"model_type":"qwen2","num_hidden_layers":28,"hidden_size":3584,"num_attention_heads":28,"num_key_value_heads":4,"intermediate_size":18944,"vocab_size":152064,"max_position_embeddings":32768,"sliding_window":131072,"use_sliding_window":false}"#,
    },
    CatalogModel {
        name: "qwen2.5-14b",
        source: hf!("Qwen/Qwen2.5-14B-Instruct"),
        params: 14_770 * M,
        config: r#"{"model_type":"qwen2","num_hidden_layers":48,"hidden_size":5120,"num_attention_heads":40,"num_key_value_heads":8,"intermediate_size":13824,"vocab_size":152064,"max_position_embeddings":32768,"sliding_window":131072,"use_sliding_window":false}"#,
    },
    CatalogModel {
        name: "qwen2.5-32b",
        source: hf!("Qwen/Qwen2.5-32B-Instruct"),
        params: 32_764 * M,
        config: r#"{"model_type":"qwen2","num_hidden_layers":64,"hidden_size":5120,"num_attention_heads":40,"num_key_value_heads":8,"intermediate_size":27648,"vocab_size":152064,"max_position_embeddings":32768,"sliding_window":131072,"use_sliding_window":false}"#,
    },
    CatalogModel {
        name: "qwen2.5-72b",
        source: hf!("Qwen/Qwen2.5-72B-Instruct"),
        params: 72_706 * M,
        config: r#"{"model_type":"qwen2","num_hidden_layers":80,"hidden_size":8192,"num_attention_heads":64,"num_key_value_heads":8,"intermediate_size":29568,"vocab_size":152064,"max_position_embeddings":32768,"sliding_window":131072,"use_sliding_window":false}"#,
    },
    CatalogModel {
        name: "qwen3-8b",
        source: hf!("Qwen/Qwen3-8B"),
        params: 8_190 * M,
        config: r#"{"model_type":"qwen3","num_hidden_layers":36,"hidden_size":4096,"num_attention_heads":32,"num_key_value_heads":8,"head_dim":128,"intermediate_size":12288,"vocab_size":151936,"max_position_embeddings":40960,"use_sliding_window":false}"#,
    },
    CatalogModel {
        name: "qwen3-32b",
        source: hf!("Qwen/Qwen3-32B"),
        params: 32_762 * M,
        config: r#"{"model_type":"qwen3","num_hidden_layers":64,"hidden_size":5120,"num_attention_heads":64,"num_key_value_heads":8,"head_dim":128,"intermediate_size":25600,"vocab_size":151936,"max_position_embeddings":40960,"use_sliding_window":false}"#,
    },
    CatalogModel {
        name: "qwen3-30b-a3b",
        source: hf!("Qwen/Qwen3-30B-A3B"),
        params: 30_532 * M,
        config: r#"{"model_type":"qwen3_moe","num_hidden_layers":48,"hidden_size":2048,"num_attention_heads":32,"num_key_value_heads":4,"head_dim":128,"intermediate_size":6144,"moe_intermediate_size":768,"num_experts":128,"num_experts_per_tok":8,"vocab_size":151936,"max_position_embeddings":40960,"use_sliding_window":false}"#,
    },
    CatalogModel {
        name: "mistral-7b-v0.1",
        source: hf!("mistralai/Mistral-7B-v0.1"),
        params: 7_242 * M,
        config: r#"{"model_type":"mistral","num_hidden_layers":32,"hidden_size":4096,"num_attention_heads":32,"num_key_value_heads":8,"intermediate_size":14336,"vocab_size":32000,"max_position_embeddings":32768,"sliding_window":4096}"#,
    },
    CatalogModel {
        name: "mistral-7b-instruct-v0.3",
        source: hf!("mistralai/Mistral-7B-Instruct-v0.3"),
        params: 7_248 * M,
        config: r#"{"model_type":"mistral","num_hidden_layers":32,"hidden_size":4096,"num_attention_heads":32,"num_key_value_heads":8,"intermediate_size":14336,"vocab_size":32768,"max_position_embeddings":32768,"sliding_window":null}"#,
    },
    CatalogModel {
        name: "mixtral-8x7b",
        source: hf!("mistralai/Mixtral-8x7B-v0.1"),
        params: 46_703 * M,
        config: r#"{"model_type":"mixtral","num_hidden_layers":32,"hidden_size":4096,"num_attention_heads":32,"num_key_value_heads":8,"intermediate_size":14336,"num_local_experts":8,"num_experts_per_tok":2,"vocab_size":32000,"max_position_embeddings":32768,"sliding_window":null}"#,
    },
    CatalogModel {
        name: "gemma-2-9b",
        source: hf!("google/gemma-2-9b-it"),
        params: 9_242 * M,
        config: r#"{"model_type":"gemma2","num_hidden_layers":42,"hidden_size":3584,"num_attention_heads":16,"num_key_value_heads":8,"head_dim":256,"intermediate_size":14336,"vocab_size":256000,"max_position_embeddings":8192,"sliding_window":4096,"tie_word_embeddings":true}"#,
    },
    CatalogModel {
        name: "gemma-2-27b",
        source: hf!("google/gemma-2-27b-it"),
        params: 27_227 * M,
        config: r#"{"model_type":"gemma2","num_hidden_layers":46,"hidden_size":4608,"num_attention_heads":32,"num_key_value_heads":16,"head_dim":128,"intermediate_size":36864,"vocab_size":256000,"max_position_embeddings":8192,"sliding_window":4096,"tie_word_embeddings":true}"#,
    },
    CatalogModel {
        name: "gemma-3-4b",
        source: hf!("google/gemma-3-4b-it"),
        params: 4_300 * M,
        config: r#"{"model_type":"gemma3","text_config":{"model_type":"gemma3_text","num_hidden_layers":34,"hidden_size":2560,"num_attention_heads":8,"num_key_value_heads":4,"head_dim":256,"intermediate_size":10240,"vocab_size":262208,"max_position_embeddings":131072,"sliding_window":1024,"sliding_window_pattern":6,"tie_word_embeddings":true}}"#,
    },
    CatalogModel {
        name: "gemma-3-27b",
        source: hf!("google/gemma-3-27b-it"),
        params: 27_432 * M,
        config: r#"{"model_type":"gemma3","text_config":{"model_type":"gemma3_text","num_hidden_layers":62,"hidden_size":5376,"num_attention_heads":32,"num_key_value_heads":16,"head_dim":128,"intermediate_size":21504,"vocab_size":262208,"max_position_embeddings":131072,"sliding_window":1024,"sliding_window_pattern":6,"tie_word_embeddings":true}}"#,
    },
    CatalogModel {
        name: "deepseek-v3",
        source: hf!("deepseek-ai/DeepSeek-V3"),
        params: 671 * B,
        config: r#"{"model_type":"deepseek_v3","num_hidden_layers":61,"hidden_size":7168,"num_attention_heads":128,"num_key_value_heads":128,"kv_lora_rank":512,"q_lora_rank":1536,"qk_rope_head_dim":64,"qk_nope_head_dim":128,"v_head_dim":128,"intermediate_size":18432,"moe_intermediate_size":2048,"n_routed_experts":256,"n_shared_experts":1,"num_experts_per_tok":8,"first_k_dense_replace":3,"vocab_size":129280,"max_position_embeddings":163840}"#,
    },
    CatalogModel {
        name: "phi-3-mini-4k",
        source: hf!("microsoft/Phi-3-mini-4k-instruct"),
        params: 3_821 * M,
        config: r#"{"model_type":"phi3","num_hidden_layers":32,"hidden_size":3072,"num_attention_heads":32,"num_key_value_heads":32,"intermediate_size":8192,"vocab_size":32064,"max_position_embeddings":4096,"sliding_window":2047}"#,
    },
    CatalogModel {
        name: "phi-4",
        source: hf!("microsoft/phi-4"),
        params: 14_660 * M,
        config: r#"{"model_type":"phi3","num_hidden_layers":40,"hidden_size":5120,"num_attention_heads":40,"num_key_value_heads":10,"intermediate_size":17920,"vocab_size":100352,"max_position_embeddings":16384,"sliding_window":null}"#,
    },
    CatalogModel {
        name: "smollm2-135m",
        source: hf!("HuggingFaceTB/SmolLM2-135M-Instruct"),
        params: 134_515_008,
        config: r#"{"model_type":"llama","num_hidden_layers":30,"hidden_size":576,"num_attention_heads":9,"num_key_value_heads":3,"intermediate_size":1536,"vocab_size":49152,"max_position_embeddings":8192,"tie_word_embeddings":true}"#,
    },
    CatalogModel {
        name: "smollm2-1.7b",
        source: hf!("HuggingFaceTB/SmolLM2-1.7B-Instruct"),
        params: 1_711 * M,
        config: r#"{"model_type":"llama","num_hidden_layers":24,"hidden_size":2048,"num_attention_heads":32,"num_key_value_heads":32,"intermediate_size":8192,"vocab_size":49152,"max_position_embeddings":8192,"tie_word_embeddings":true}"#,
    },
];

/// One accelerator: its name and memory in bytes.
#[derive(Debug)]
pub struct Gpu {
    pub name: &'static str,
    pub memory_bytes: u64,
}

const MIB: u64 = 1 << 20;

pub static GPUS: &[Gpu] = &[
    Gpu {
        name: "H100-80GB",
        memory_bytes: 81_559 * MIB,
    },
    Gpu {
        name: "H100-94GB",
        memory_bytes: 95_830 * MIB,
    },
    Gpu {
        name: "H200-141GB",
        memory_bytes: 143_771 * MIB,
    },
    Gpu {
        name: "B200-180GB",
        memory_bytes: 183_359 * MIB,
    },
    Gpu {
        name: "A100-80GB",
        memory_bytes: 81_920 * MIB,
    },
    Gpu {
        name: "A100-40GB",
        memory_bytes: 40_960 * MIB,
    },
    Gpu {
        name: "A10G-24GB",
        memory_bytes: 23_028 * MIB,
    },
    Gpu {
        name: "L4-24GB",
        memory_bytes: 23_034 * MIB,
    },
    Gpu {
        name: "L40S-48GB",
        memory_bytes: 46_068 * MIB,
    },
    Gpu {
        name: "T4-16GB",
        memory_bytes: 15_360 * MIB,
    },
    Gpu {
        name: "V100-32GB",
        memory_bytes: 32_768 * MIB,
    },
    Gpu {
        name: "RTX-3090-24GB",
        memory_bytes: 24_576 * MIB,
    },
    Gpu {
        name: "RTX-4090-24GB",
        memory_bytes: 24_564 * MIB,
    },
    Gpu {
        name: "RTX-5090-32GB",
        memory_bytes: 32_607 * MIB,
    },
    Gpu {
        name: "MI300X-192GB",
        memory_bytes: 196_592 * MIB,
    },
    Gpu {
        name: "MI325X-256GB",
        memory_bytes: 262_128 * MIB,
    },
];

/// A name found in neither catalog, with the closest names of the catalog.
#[derive(Debug, Clone, thiserror::Error)]
#[error("unknown {what} '{given}'; closest: {}", .suggestions.join(", "))]
pub struct UnknownName {
    pub what: &'static str,
    pub given: String,
    pub suggestions: Vec<String>,
}

fn normalize(s: &str) -> String {
    s.to_ascii_lowercase()
        .chars()
        .filter(|c| c.is_ascii_alphanumeric() || *c == '.')
        .collect()
}

fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut prev = row[0];
        row[0] = i + 1;
        for j in 0..b.len() {
            let cur = row[j + 1];
            row[j + 1] = (prev + usize::from(ca != b[j]))
                .min(row[j] + 1)
                .min(cur + 1);
            prev = cur;
        }
    }
    row[b.len()]
}

/// Finds `given` among `items`: equal after normalising case and punctuation (`Qwen2.5-32B-Instruct` finds
/// `qwen2.5-32b`: an `org/` prefix and an `-instruct`/`-chat`/`-it`/`-hf` suffix are dropped when that
/// makes a match), else the first whose name starts with it (`h100` finds `H100-80GB`), else an error
/// with the three closest names by edit distance.
fn find<'a, T>(
    items: &'a [T],
    name_of: impl Fn(&T) -> &str,
    given: &str,
    what: &'static str,
) -> Result<&'a T, UnknownName> {
    let key = normalize(given.rsplit('/').next().unwrap_or(given));
    let names: Vec<String> = items.iter().map(|i| normalize(name_of(i))).collect();
    let stripped = ["instruct", "chat", "it", "hf"]
        .iter()
        .filter_map(|s| key.strip_suffix(s));
    let candidates: Vec<&str> = std::iter::once(key.as_str()).chain(stripped).collect();
    for k in &candidates {
        if let Some(i) = names.iter().position(|n| n == k) {
            return Ok(&items[i]);
        }
    }
    if key.len() >= 3 {
        if let Some(i) = names.iter().position(|n| n.starts_with(&key)) {
            return Ok(&items[i]);
        }
    }
    let mut ranked: Vec<(usize, usize)> = names
        .iter()
        .enumerate()
        .map(|(i, n)| (edit_distance(&key, n), i))
        .collect();
    ranked.sort();
    Err(UnknownName {
        what,
        given: given.to_string(),
        suggestions: ranked
            .iter()
            .take(3)
            .map(|&(_, i)| name_of(&items[i]).to_string())
            .collect(),
    })
}

pub fn find_model(given: &str) -> Result<&'static CatalogModel, UnknownName> {
    find(MODELS, |m| m.name, given, "model")
}

pub fn find_gpu(given: &str) -> Result<&'static Gpu, UnknownName> {
    find(GPUS, |g| g.name, given, "accelerator")
}

impl CatalogModel {
    pub fn spec(&self) -> ModelSpec {
        let mut spec = ModelSpec::from_hf_config_str(self.config, self.name, self.source)
            .unwrap_or_else(|e| panic!("catalog entry {} is malformed: {e}", self.name));
        spec.params_given = Some(self.params);
        spec
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_catalog_entry_parses_and_the_estimate_is_near_the_card() {
        assert!(MODELS.len() >= 20);
        for m in MODELS {
            let spec = m.spec();
            let est = spec.estimate_params() as f64;
            let card = m.params as f64;
            // The shapes alone give each card's count to 1 %: the catalog's numbers agree with each other.
            if m.config.contains("text_config") {
                // Multimodal cards count the vision tower (0.4 B in Gemma-3), outside the KV and text shapes.
                assert!(
                    est < card && (card - est) / card < 0.12,
                    "{}: estimate {est:.4e} vs card {card:.4e}",
                    m.name
                );
            } else {
                assert!(
                    (est - card).abs() / card < 0.01,
                    "{}: estimate {est:.4e} vs card {card:.4e}",
                    m.name
                );
            }
        }
    }

    #[test]
    fn names_are_found_loosely_and_unknown_ones_get_suggestions() {
        assert_eq!(
            find_model("Qwen/Qwen2.5-32B-Instruct").unwrap().name,
            "qwen2.5-32b"
        );
        assert_eq!(
            find_model("meta-llama/Llama-3.1-8B-Instruct").unwrap().name,
            "llama-3.1-8b"
        );
        assert_eq!(find_gpu("h100").unwrap().name, "H100-80GB");
        assert_eq!(find_gpu("rtx 4090").unwrap().name, "RTX-4090-24GB");
        let err = find_model("lama-3.1-8b").unwrap_err();
        assert_eq!(err.suggestions[0], "llama-3.1-8b");
        assert!(err.to_string().contains("unknown model 'lama-3.1-8b'"));
    }
}
