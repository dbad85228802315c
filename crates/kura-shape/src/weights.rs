//! The element format of a model's weights.

/// The element format of a model's weights: what `kura plan` sizes (every variant) and what the runtime
/// computes in (bf16, the default, or f32; it refuses the others by name).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum WeightsDtype {
    F32,
    F16,
    #[default]
    Bf16,
    Fp8,
    /// 8-bit with a 2-byte scale per 32 weights (GGUF Q8_0): 8.5 bits per weight.
    Int8,
    /// 4-bit with a 2-byte scale per 32 weights (GGUF Q4_0, GPTQ/AWQ with group 32): 4.5 bits per weight.
    Int4,
    /// As the model file stores them: a GGUF's block formats kept in blocks, a float checkpoint in bf16.
    /// Sized as bf16 where no file tells the formats (catalog entries are bf16 checkpoints).
    Native,
}

impl WeightsDtype {
    pub fn name(self) -> &'static str {
        match self {
            WeightsDtype::F32 => "f32",
            WeightsDtype::F16 => "f16",
            WeightsDtype::Bf16 => "bf16",
            WeightsDtype::Fp8 => "fp8",
            WeightsDtype::Int8 => "int8",
            WeightsDtype::Int4 => "int4",
            WeightsDtype::Native => "native",
        }
    }

    pub fn bits_per_weight(self) -> f64 {
        match self {
            WeightsDtype::F32 => 32.0,
            WeightsDtype::F16 | WeightsDtype::Bf16 | WeightsDtype::Native => 16.0,
            WeightsDtype::Fp8 => 8.0,
            WeightsDtype::Int8 => 8.5,
            WeightsDtype::Int4 => 4.5,
        }
    }
}

impl std::str::FromStr for WeightsDtype {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(match s.to_ascii_lowercase().as_str() {
            "f32" | "fp32" | "float32" => WeightsDtype::F32,
            "f16" | "fp16" | "float16" => WeightsDtype::F16,
            "bf16" | "bfloat16" => WeightsDtype::Bf16,
            "fp8" => WeightsDtype::Fp8,
            "int8" | "q8_0" => WeightsDtype::Int8,
            "int4" | "q4_0" | "awq" | "gptq" => WeightsDtype::Int4,
            "native" => WeightsDtype::Native,
            _ => {
                return Err(format!(
                "unknown weights format '{s}': expected native, f32, f16, bf16, fp8, int8 or int4"
            ))
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_vocabulary_for_the_planner_and_the_runtime() {
        for (text, d) in [
            ("bf16", WeightsDtype::Bf16),
            ("bfloat16", WeightsDtype::Bf16),
            ("F32", WeightsDtype::F32),
            ("float32", WeightsDtype::F32),
            ("fp16", WeightsDtype::F16),
            ("q4_0", WeightsDtype::Int4),
            ("q8_0", WeightsDtype::Int8),
            ("native", WeightsDtype::Native),
        ] {
            assert_eq!(text.parse::<WeightsDtype>(), Ok(d), "{text}");
        }
        let err = "int3".parse::<WeightsDtype>().unwrap_err();
        assert!(err.contains("'int3'") && err.contains("int4"), "{err}");
        assert_eq!(WeightsDtype::default(), WeightsDtype::Bf16);
        assert_eq!(WeightsDtype::Int4.name(), "int4");
    }
}
