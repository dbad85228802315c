//! HF `config.json` readers: the runtime's (`ModelConfig::from_hf_json`) and the planner's
//! (`ModelSpec::from_hf_config_str` and the plan `kura plan <config.json>` computes from it).
#![no_main]

use kura_kv::codec::KvDtype;
use kura_plan::spec::ModelSpec;
use kura_plan::PlanRequest;
use kura_model::config::rope_inv_freq;
use kura_model::ModelConfig;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };

    if let Ok(cfg) = ModelConfig::from_hf_json(text) {
        let _ = cfg.layer_window(0);
        // The runtime builds these only after weights of this shape loaded (so head_dim is bounded by
        // the checkpoint); outside that, an absurd head_dim would only measure the allocator.
        if cfg.head_dim() <= 1 << 16 {
            let _ = rope_inv_freq(&cfg);
        }
        if cfg.num_layers() <= 1 << 16 {
            let _ = cfg.kv_layout(KvDtype::Bf16, 16);
        }
    }

    if let Ok(spec) = ModelSpec::from_hf_config_str(text, "fuzz", "fuzz") {
        let _ = spec.kv_layout(KvDtype::F16, 16);
        let _ = spec.params();
        let _ = spec.active_ffn_width();
        let mut req = PlanRequest::new(spec);
        req.memory_bytes = Some(80 << 30);
        let _ = req.plan();
        req.memory_bytes = None;
        req.kv_cache_memory = Some(10 << 30);
        req.tp = 2;
        let _ = req.plan();
    }
});
