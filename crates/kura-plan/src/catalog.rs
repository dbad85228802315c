//! The offline catalogs of `kura plan`, kept as data files beside the crate:
//! - `data/models.json`: popular models, each with the shape keys of its Hugging Face `config.json` that
//!   decide memory, the config's address as its source, and the parameter count of its model card;
//! - `data/gpus.json`: accelerators, each with its memory as the driver reports it (`nvidia-smi`'s MiB for
//!   NVIDIA, `rocm-smi`'s for AMD) and the vendor's product page as its source.
//!
//! Both are compiled in and parsed once, on first use. Lookups are O(catalog); an unknown name gets the
//! closest names by edit distance.

use std::sync::OnceLock;

use serde::Deserialize;
use serde_json::Value;

use crate::spec::ModelSpec;

/// One model of the catalog. `config` holds the keys of its Hugging Face `config.json` that decide memory.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CatalogModel {
    pub name: String,
    pub source: String,
    pub params: u64,
    pub config: Value,
}

/// One accelerator: its name, memory in bytes, and where the figure comes from.
#[derive(Debug)]
pub struct Gpu {
    pub name: String,
    pub memory_bytes: u64,
    pub source: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct GpuEntry {
    name: String,
    memory_mib: u64,
    source: String,
}

const MODELS_JSON: &str = include_str!("../data/models.json");
const GPUS_JSON: &str = include_str!("../data/gpus.json");

/// The model catalog (`data/models.json`; its tests check that every entry parses).
pub fn models() -> &'static [CatalogModel] {
    static MODELS: OnceLock<Vec<CatalogModel>> = OnceLock::new();
    MODELS.get_or_init(|| {
        serde_json::from_str(MODELS_JSON).unwrap_or_else(|e| {
            panic!("data/models.json compiled into kura-plan is malformed: {e}")
        })
    })
}

/// The accelerator catalog (`data/gpus.json`).
pub fn gpus() -> &'static [Gpu] {
    static GPUS: OnceLock<Vec<Gpu>> = OnceLock::new();
    GPUS.get_or_init(|| {
        let entries: Vec<GpuEntry> = serde_json::from_str(GPUS_JSON)
            .unwrap_or_else(|e| panic!("data/gpus.json compiled into kura-plan is malformed: {e}"));
        entries
            .into_iter()
            .map(|g| Gpu {
                name: g.name,
                memory_bytes: g.memory_mib.saturating_mul(1 << 20),
                source: g.source,
            })
            .collect()
    })
}

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
    find(models(), |m| m.name.as_str(), given, "model")
}

pub fn find_gpu(given: &str) -> Result<&'static Gpu, UnknownName> {
    find(gpus(), |g| g.name.as_str(), given, "accelerator")
}

impl CatalogModel {
    pub fn spec(&self) -> ModelSpec {
        let mut spec = ModelSpec::from_hf_config(&self.config, &self.name, &self.source)
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
        assert!(models().len() >= 20);
        for m in models() {
            let spec = m.spec();
            let est = spec.estimate_params() as f64;
            let card = m.params as f64;
            // The shapes alone give each card's count to 1 %: the catalog's numbers agree with each other.
            if m.config.get("text_config").is_some() {
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
        assert_eq!(find_gpu("h100").unwrap().memory_bytes, 81_559 << 20);
        assert!(gpus().iter().all(|g| g.source.starts_with("https://")));
        assert!(models()
            .iter()
            .all(|m| m.source.starts_with("https://huggingface.co/")));
        assert_eq!(find_gpu("rtx 4090").unwrap().name, "RTX-4090-24GB");
        let err = find_model("lama-3.1-8b").unwrap_err();
        assert_eq!(err.suggestions[0], "llama-3.1-8b");
        assert!(err.to_string().contains("unknown model 'lama-3.1-8b'"));
    }
}
