//! Crafted GGUF files: a tiny writer builds a valid Llama model (which must load, so the checks below
//! are proven against a writer that works), then each test breaks one thing (an offset, a count, a
//! dimension, a metadata value) and expects an error that names the problem, never a panic, a huge
//! allocation or a silent load.

use std::path::PathBuf;

use kura_model::config::ModelConfig;
use kura_model::gguf::{self, GgufFile};
use kura_model::{Model, ModelError};

const T_U32: u32 = 4;
const T_F32: u32 = 6;
const T_BOOL: u32 = 7;
const T_STRING: u32 = 8;
const T_ARRAY: u32 = 9;
const T_U64: u32 = 10;
const GGML_F32: u32 = 0;
const GGML_Q4_0: u32 = 2;

struct Tensor {
    name: String,
    /// Innermost first, as GGUF stores them.
    dims: Vec<u64>,
    ty: u32,
    data: Vec<u8>,
    /// Written instead of the offset the writer computed (the data still goes where it computed).
    offset: Option<u64>,
}

/// A GGUF under construction: metadata entries as raw `(key, type, payload)` so that a test can write
/// anything, tensors laid out one after the other at `alignment`.
struct Gguf {
    kvs: Vec<(String, u32, Vec<u8>)>,
    tensors: Vec<Tensor>,
    alignment: usize,
    /// Written instead of the real counts.
    n_tensors: Option<u64>,
    n_kv: Option<u64>,
}

fn string_bytes(s: &str) -> Vec<u8> {
    let mut b = (s.len() as u64).to_le_bytes().to_vec();
    b.extend_from_slice(s.as_bytes());
    b
}

impl Gguf {
    fn new() -> Self {
        Gguf {
            kvs: Vec::new(),
            tensors: Vec::new(),
            alignment: 32,
            n_tensors: None,
            n_kv: None,
        }
    }

    fn raw(&mut self, key: &str, ty: u32, payload: Vec<u8>) -> &mut Self {
        self.kvs.retain(|(k, _, _)| k != key);
        self.kvs.push((key.into(), ty, payload));
        self
    }

    fn u32(&mut self, key: &str, v: u32) -> &mut Self {
        self.raw(key, T_U32, v.to_le_bytes().to_vec())
    }

    fn u64(&mut self, key: &str, v: u64) -> &mut Self {
        self.raw(key, T_U64, v.to_le_bytes().to_vec())
    }

    fn f32(&mut self, key: &str, v: f32) -> &mut Self {
        self.raw(key, T_F32, v.to_le_bytes().to_vec())
    }

    fn str(&mut self, key: &str, v: &str) -> &mut Self {
        self.raw(key, T_STRING, string_bytes(v))
    }

    fn strs(&mut self, key: &str, v: &[&str]) -> &mut Self {
        let mut b = T_STRING.to_le_bytes().to_vec();
        b.extend_from_slice(&(v.len() as u64).to_le_bytes());
        for s in v {
            b.extend(string_bytes(s));
        }
        self.raw(key, T_ARRAY, b)
    }

    fn tensor(&mut self, name: &str, torch_shape: &[u64]) -> &mut Self {
        let n: u64 = torch_shape.iter().product();
        let data = (0..n)
            .flat_map(|i| (((i * 37 % 17) as f32 - 8.0) / 16.0).to_le_bytes())
            .collect();
        self.tensors.push(Tensor {
            name: name.into(),
            dims: torch_shape.iter().rev().copied().collect(),
            ty: GGML_F32,
            data,
            offset: None,
        });
        self
    }

    /// An F32 tensor holding `values`.
    fn tensor_values(&mut self, name: &str, torch_shape: &[u64], values: &[f32]) -> &mut Self {
        self.tensor(name, torch_shape);
        self.get(name).data = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        self
    }

    fn get(&mut self, name: &str) -> &mut Tensor {
        self.tensors.iter_mut().find(|t| t.name == name).unwrap()
    }

    fn bytes(&self) -> Vec<u8> {
        let a = self.alignment;
        let pad = |b: &mut Vec<u8>| {
            while !b.len().is_multiple_of(a) {
                b.push(0);
            }
        };
        let mut b = b"GGUF".to_vec();
        b.extend_from_slice(&3u32.to_le_bytes());
        let n_tensors = self.n_tensors.unwrap_or(self.tensors.len() as u64);
        b.extend_from_slice(&n_tensors.to_le_bytes());
        b.extend_from_slice(&self.n_kv.unwrap_or(self.kvs.len() as u64).to_le_bytes());
        for (k, ty, payload) in &self.kvs {
            b.extend(string_bytes(k));
            b.extend_from_slice(&ty.to_le_bytes());
            b.extend_from_slice(payload);
        }
        let mut offset = 0u64;
        for t in &self.tensors {
            b.extend(string_bytes(&t.name));
            b.extend_from_slice(&(t.dims.len() as u32).to_le_bytes());
            for d in &t.dims {
                b.extend_from_slice(&d.to_le_bytes());
            }
            b.extend_from_slice(&t.ty.to_le_bytes());
            b.extend_from_slice(&t.offset.unwrap_or(offset).to_le_bytes());
            offset = (offset + t.data.len() as u64).next_multiple_of(a as u64);
        }
        pad(&mut b);
        for t in &self.tensors {
            b.extend_from_slice(&t.data);
            pad(&mut b);
        }
        b
    }
}

/// A complete one-layer Llama: hidden 8, two heads of 4, one KV head, FFN 16, a four-token BPE vocabulary.
fn tiny_model() -> Gguf {
    let mut g = Gguf::new();
    g.str("general.architecture", "llama")
        .u32("llama.block_count", 1)
        .u32("llama.embedding_length", 8)
        .u32("llama.feed_forward_length", 16)
        .u32("llama.attention.head_count", 2)
        .u32("llama.attention.head_count_kv", 1)
        .u32("llama.context_length", 64)
        .f32("llama.attention.layer_norm_rms_epsilon", 1e-5)
        .str("tokenizer.ggml.model", "gpt2")
        .strs("tokenizer.ggml.tokens", &["a", "b", "ab", "<|end|>"])
        .strs("tokenizer.ggml.merges", &["a b"])
        .u32("tokenizer.ggml.eos_token_id", 3);
    g.tensor("token_embd.weight", &[4, 8])
        .tensor("output_norm.weight", &[8])
        .tensor("blk.0.attn_norm.weight", &[8])
        .tensor("blk.0.attn_q.weight", &[8, 8])
        .tensor("blk.0.attn_k.weight", &[4, 8])
        .tensor("blk.0.attn_v.weight", &[4, 8])
        .tensor("blk.0.attn_output.weight", &[8, 8])
        .tensor("blk.0.ffn_norm.weight", &[8])
        .tensor("blk.0.ffn_gate.weight", &[16, 8])
        .tensor("blk.0.ffn_up.weight", &[16, 8])
        .tensor("blk.0.ffn_down.weight", &[8, 16]);
    g
}

fn write(name: &str, bytes: &[u8]) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kura-bad-files-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join(name);
    std::fs::write(&p, bytes).unwrap();
    p
}

/// Loads the bytes as a model from a file and from memory; both must fail, and the file's error must
/// contain every one of `expected`.
#[track_caller]
fn rejects(name: &str, g: &Gguf, expected: &[&str]) -> ModelError {
    let bytes = g.bytes();
    let path = write(name, &bytes);
    let err = match Model::load(&path) {
        Ok(_) => panic!("{name}: loaded, expected an error containing {expected:?}"),
        Err(e) => e,
    };
    let text = err.to_string();
    for e in expected {
        assert!(text.contains(e), "{name}: expected '{e}' in: {text}");
    }
    assert!(
        gguf::parse_bytes(&bytes).is_err(),
        "{name}: parse_bytes accepted it"
    );
    std::fs::remove_file(path).ok();
    err
}

#[test]
fn the_tiny_model_loads_and_its_tensors_read_back() {
    let g = tiny_model();
    let bytes = g.bytes();
    let path = write("ok.gguf", &bytes);
    let model = Model::load(&path).unwrap();
    assert_eq!(model.config().num_layers(), 1);
    assert_eq!(model.config().head_dim(), 4);
    assert_eq!(model.config().vocab_size(), 4);
    let file = GgufFile::open(&path).unwrap();
    let q = kura_model::gguf::tensor_f32(&file, "blk.0.attn_q.weight").unwrap();
    let expected: Vec<f32> = g.tensors[3]
        .data
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    assert_eq!(q, expected);
    let (mem, cfg) = gguf::parse_bytes(&bytes).unwrap();
    assert_eq!(mem.tensors.len(), 11);
    assert_eq!(&cfg, model.config());
    std::fs::remove_file(path).ok();
}

#[test]
fn a_larger_alignment_is_honoured() {
    let mut g = tiny_model();
    g.alignment = 64;
    g.u32("general.alignment", 64);
    let bytes = g.bytes();
    let file = GgufFile::from_bytes("a64", bytes).unwrap();
    assert_eq!(file.alignment, 64);
    assert_eq!(file.data_start % 64, 0);
    assert_eq!(
        kura_model::gguf::tensor_f32(&file, "output_norm.weight")
            .unwrap()
            .len(),
        8,
        "second tensor read at its 64-aligned offset"
    );
}

#[test]
fn offsets_that_wrap_or_point_past_the_end_are_rejected() {
    // 2^64 − 32 is aligned: data_start + offset wraps to 32 bytes before the data, inside the header;
    // unchecked, the tensor was read from the directory and the model served garbage.
    let mut g = tiny_model();
    g.get("blk.0.attn_q.weight").offset = Some(u64::MAX - 31);
    rejects(
        "wrap.gguf",
        &g,
        &["blk.0.attn_q.weight", "outside the file"],
    );
    // An aligned offset far past the end (unchecked, a range panic in `kura serve`).
    let mut g = tiny_model();
    g.get("blk.0.ffn_down.weight").offset = Some(1 << 40);
    rejects(
        "far.gguf",
        &g,
        &["blk.0.ffn_down.weight", "outside the file"],
    );
    // Data that runs past the end of a truncated file.
    let mut bytes = tiny_model().bytes();
    bytes.truncate(bytes.len() - 40);
    let err = GgufFile::from_bytes("cut", bytes)
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains("blk.0.ffn_down.weight") && err.contains("outside the file"),
        "{err}"
    );
}

#[test]
fn misaligned_offsets_and_bad_alignments_are_rejected() {
    let mut g = tiny_model();
    g.get("blk.0.attn_k.weight").offset = Some(u64::MAX);
    rejects(
        "max.gguf",
        &g,
        &["blk.0.attn_k.weight", "not a multiple of the alignment 32"],
    );
    let mut g = tiny_model();
    let at = g.tensors[0].data.len() as u64 + 4;
    g.get("output_norm.weight").offset = Some(at);
    rejects(
        "misaligned.gguf",
        &g,
        &[
            "output_norm.weight",
            &format!("offset {at} is not a multiple"),
        ],
    );
    for a in [0u32, 48] {
        let mut g = tiny_model();
        g.u32("general.alignment", a);
        rejects(
            &format!("align{a}.gguf"),
            &g,
            &["general.alignment", &format!("is {a}"), "power of two"],
        );
    }
}

#[test]
fn overlapping_and_duplicate_tensors_are_rejected() {
    let mut g = tiny_model();
    g.get("blk.0.attn_v.weight").offset = Some(0);
    rejects("overlap.gguf", &g, &["overlaps", "token_embd.weight"]);
    let mut g = tiny_model();
    g.tensor("blk.0.attn_norm.weight", &[8]);
    rejects(
        "dup.gguf",
        &g,
        &["tensor 'blk.0.attn_norm.weight' appears twice"],
    );
    // The block count a second time (the builder's setters keep keys unique, so push it by hand).
    let mut g = tiny_model();
    g.kvs.push((
        "llama.block_count".into(),
        T_U32,
        1u32.to_le_bytes().to_vec(),
    ));
    let b = g.bytes();
    let err = GgufFile::from_bytes("dupkey", b).err().unwrap().to_string();
    assert!(
        err.contains("metadata key 'llama.block_count' appears twice"),
        "{err}"
    );
}

#[test]
fn dimensions_are_checked() {
    for (i, (dims, what)) in [
        (vec![], "0 dimensions"),
        (vec![1, 1, 1, 1, 1], "5 dimensions"),
        (vec![8, 0], "dimension 0"),
        (vec![1 << 32, 1 << 32, 1 << 32], "overflow an element count"),
    ]
    .into_iter()
    .enumerate()
    {
        let mut g = tiny_model();
        g.get("output_norm.weight").dims = dims;
        rejects(&format!("dims{i}.gguf"), &g, &["output_norm.weight", what]);
    }
    // Q4_0 stores rows of whole 32-element blocks.
    let mut g = tiny_model();
    let t = g.get("blk.0.ffn_down.weight");
    t.ty = GGML_Q4_0;
    t.dims = vec![16, 8];
    rejects(
        "q4.gguf",
        &g,
        &[
            "blk.0.ffn_down.weight",
            "not a whole number of 32-element Q4_0 blocks",
        ],
    );
}

#[test]
fn a_tensor_whose_type_no_longer_matches_its_data_is_refused() {
    // An f32 matrix relabelled f16 (an edited type code; a Q4_1 read as Q4_0 is the same case): half
    // its bytes would be read as the whole tensor. Its size no longer reaches the next tensor's data.
    let mut g = tiny_model();
    g.get("blk.0.attn_q.weight").ty = 1;
    rejects(
        "retyped.gguf",
        &g,
        &[
            "tensor 'blk.0.attn_k.weight'",
            "tensor 'blk.0.attn_q.weight' before it in the directory (F16, [8, 8]) ends at",
            "type or shape does not match its data",
        ],
    );
    // A dimension edited down, likewise.
    let mut g = tiny_model();
    g.get("blk.0.ffn_gate.weight").dims = vec![8, 8];
    rejects(
        "reshaped.gguf",
        &g,
        &["blk.0.ffn_gate.weight", "does not match its data"],
    );
    // Gaps are refused even where no tensor is read under the wrong type: ggml lays tensors out end to
    // end, and so does every writer.
    // Here the last tensor's data is moved 32 bytes on, into 32 bytes added at the end.
    let mut g = tiny_model();
    let end: u64 = g.tensors[..10].iter().map(|t| t.data.len() as u64).sum();
    g.get("blk.0.ffn_down.weight").offset = Some(end + 32);
    let mut bytes = g.bytes();
    bytes.extend([0; 32]);
    let path = write("gap.gguf", &bytes);
    let err = Model::load(&path).err().unwrap().to_string();
    assert!(
        err.contains(&format!(
            "tensor 'blk.0.ffn_down.weight' (F32, [16, 8]) has its data at offset {}, where tensor \
             'blk.0.ffn_up.weight' before it in the directory (F32, [8, 16]) ends at {end}",
            end + 32
        )),
        "{err}"
    );
    std::fs::remove_file(path).ok();
    // The bytes without the gap load.
    let g = tiny_model();
    let mut bytes = g.bytes();
    bytes.extend([0; 32]);
    assert!(gguf::parse_bytes(&bytes).is_ok());
}

#[test]
fn a_tensor_the_model_needs_must_be_there_and_readable_before_anything_loads() {
    // `parse_bytes` reads the configuration only, as `kura plan` does: it refuses the same files.
    let mut g = tiny_model();
    g.tensors.retain(|t| t.name != "blk.0.ffn_down.weight");
    let err = gguf::parse_bytes(&g.bytes()).err().unwrap().to_string();
    assert!(
        err.contains("tensor 'blk.0.ffn_down.weight' is missing"),
        "{err}"
    );
    rejects("missing.gguf", &g, &["blk.0.ffn_down.weight", "is missing"]);
    let mut g = tiny_model();
    g.tensors.clear();
    let err = gguf::parse_bytes(&g.bytes()).err().unwrap().to_string();
    assert!(err.contains("is missing"), "{err}");
    // An element type Kura cannot read, on a tensor the model reads.
    let mut g = tiny_model();
    g.get("blk.0.ffn_down.weight").ty = 99;
    let err = gguf::parse_bytes(&g.bytes()).err().unwrap().to_string();
    assert!(
        err.contains(
            "tensor 'blk.0.ffn_down.weight' has element type ggml type 99, which is not supported"
        ),
        "{err}"
    );
    // The same type on a tensor nothing reads: the file loads (its size is unknown, so the tensor
    // after it need only start after it).
    let mut g = tiny_model();
    g.tensor("extra.weight", &[8]);
    g.tensors.swap(1, 11);
    g.get("extra.weight").ty = 99;
    let path = write("extra.gguf", &g.bytes());
    Model::load(&path).unwrap();
    std::fs::remove_file(path).ok();
}

#[test]
fn tokenizer_keys_of_the_wrong_type_or_size_are_refused_naming_the_key() {
    // 2^32 + 3 was read as token 3 (truncated to 32 bits).
    let mut g = tiny_model();
    g.u64("tokenizer.ggml.eos_token_id", (1 << 32) + 3);
    load_fails(
        "eos-wide.gguf",
        &g,
        "'tokenizer.ggml.eos_token_id' is 4294967299, which is no token id (ids are below 2^32)",
    );
    // A string id is refused, as it was (the other keys below were read as their defaults).
    let mut g = tiny_model();
    g.str("tokenizer.ggml.bos_token_id", "1");
    load_fails(
        "bos-str.gguf",
        &g,
        "'tokenizer.ggml.bos_token_id' has the wrong type",
    );
    // Booleans were read as their default whatever their type.
    for key in [
        "tokenizer.ggml.add_bos_token",
        "tokenizer.ggml.add_space_prefix",
    ] {
        let mut g = tiny_model();
        g.u32(key, 0);
        if key.ends_with("add_space_prefix") {
            // Read by the SentencePiece vocabulary only.
            g.str("tokenizer.ggml.model", "llama");
        }
        load_fails(
            "bool.gguf",
            &g,
            &format!("'{key}' has the wrong type: expected a boolean"),
        );
    }
    let mut g = tiny_model();
    g.u32("tokenizer.ggml.pre", 7);
    load_fails(
        "pre.gguf",
        &g,
        "'tokenizer.ggml.pre' has the wrong type: expected a string",
    );
    // Per-token arrays: one entry per token, of the right type.
    let ints = |v: &[u32]| {
        let mut b = T_U32.to_le_bytes().to_vec();
        b.extend_from_slice(&(v.len() as u64).to_le_bytes());
        for x in v {
            b.extend_from_slice(&x.to_le_bytes());
        }
        b
    };
    let mut g = tiny_model();
    g.raw("tokenizer.ggml.token_type", T_ARRAY, ints(&[1, 1, 1]));
    load_fails(
        "types-short.gguf",
        &g,
        "'tokenizer.ggml.token_type' has 3 entries for 4 tokens",
    );
    let mut g = tiny_model();
    g.strs("tokenizer.ggml.token_type", &["1", "1", "1", "3"]);
    load_fails(
        "types-str.gguf",
        &g,
        "'tokenizer.ggml.token_type' has the wrong type: expected an array of integers",
    );
    let mut g = tiny_model();
    g.str("tokenizer.ggml.model", "llama");
    g.raw("tokenizer.ggml.scores", T_ARRAY, ints(&[0, 0]));
    load_fails(
        "scores.gguf",
        &g,
        "'tokenizer.ggml.scores' has 2 entries for 4 tokens",
    );
    // A chat template that is not a string is named, not replaced by the default.
    let mut g = tiny_model();
    g.raw(
        "tokenizer.chat_template",
        T_U32,
        7u32.to_le_bytes().to_vec(),
    );
    load_fails(
        "template-type.gguf",
        &g,
        "'tokenizer.chat_template' has the wrong type: expected a string",
    );
    // A token text given twice would leave the first id without a text.
    for model in ["gpt2", "llama"] {
        let mut g = tiny_model();
        g.str("tokenizer.ggml.model", model);
        g.strs("tokenizer.ggml.tokens", &["a", "b", "a", "<|end|>"]);
        load_fails(
            &format!("dup-{model}.gguf"),
            &g,
            "tokenizer.ggml.tokens: token 2 is \"a\", as token 0 is",
        );
    }
    // Empty texts may repeat (llama.cpp loads such files): no text encodes to one.
    let mut g = tiny_model();
    g.str("tokenizer.ggml.model", "llama");
    g.strs("tokenizer.ggml.tokens", &["a", "", "", "<|end|>"]);
    let path = write("empty-twice.gguf", &g.bytes());
    Model::load(&path).unwrap();
    std::fs::remove_file(path).ok();
    // SentencePiece merges are rebuilt from the pieces: pieces too long to do so in bounded time are
    // refused (a vocabulary of "a", "aa", … would otherwise cost the cube of its size).
    let mut g = tiny_model();
    g.str("tokenizer.ggml.model", "llama");
    let long = "x".repeat(20_000);
    g.strs("tokenizer.ggml.tokens", &["a", "b", &long, "<|end|>"]);
    load_fails(
        "long-pieces.gguf",
        &g,
        "tokenizer.ggml.tokens: the pieces are too long to rebuild SentencePiece merges from",
    );
    // The right types load.
    let mut g = tiny_model();
    g.raw("tokenizer.ggml.token_type", T_ARRAY, ints(&[1, 1, 1, 3]));
    g.raw("tokenizer.ggml.add_bos_token", T_BOOL, vec![0]);
    let path = write("types-ok.gguf", &g.bytes());
    Model::load(&path).unwrap();
    std::fs::remove_file(path).ok();
}

#[test]
fn huge_declared_counts_fail_without_allocating() {
    // An array of 2^60 strings: sized by the count, the Vec would abort the process.
    let mut g = tiny_model();
    let mut payload = T_STRING.to_le_bytes().to_vec();
    payload.extend_from_slice(&(1u64 << 60).to_le_bytes());
    g.raw("tokenizer.ggml.tokens", T_ARRAY, payload);
    rejects(
        "arr.gguf",
        &g,
        &["tokenizer.ggml.tokens", "1152921504606846976 declared"],
    );
    let mut g = tiny_model();
    g.raw(
        "general.name",
        T_STRING,
        (1u64 << 62).to_le_bytes().to_vec(),
    );
    rejects("str.gguf", &g, &["general.name", "string length"]);
    let mut g = tiny_model();
    g.n_kv = Some(u64::MAX);
    rejects("nkv.gguf", &g, &["metadata entries", "declared"]);
    // A count the file's bytes could hold, past what a model declares.
    let mut g = tiny_model();
    let mut pad = (1u64 << 20).to_le_bytes().to_vec();
    pad.resize(pad.len() + (1 << 20), b'x');
    g.raw("general.pad", T_STRING, pad);
    g.n_kv = Some(kura_gguf::MAX_METADATA_ENTRIES as u64 + 1);
    rejects(
        "nkv-many.gguf",
        &g,
        &["metadata entries: 65537 declared; at most 65536"],
    );
    let mut g = tiny_model();
    g.n_tensors = Some(1 << 59);
    rejects("nt.gguf", &g, &["tensor entries", "declared"]);
    let mut g = tiny_model();
    g.raw("general.x", 99, vec![0; 8]);
    rejects("ty.gguf", &g, &["general.x", "unknown value type 99"]);
    let mut g = tiny_model();
    let mut payload = 77u32.to_le_bytes().to_vec();
    payload.extend_from_slice(&1u64.to_le_bytes());
    g.raw("general.y", T_ARRAY, payload);
    rejects(
        "ety.gguf",
        &g,
        &["general.y", "unknown array element type 77"],
    );
}

#[test]
fn degenerate_metadata_is_rejected_at_load_naming_the_key() {
    let cases: &[(&str, u64, &[&str])] = &[
        ("llama.context_length", 0, &["'llama.context_length' is 0"]),
        (
            "llama.block_count",
            0,
            &["'llama.block_count' must be a positive integer, got 0"],
        ),
        (
            "llama.attention.head_count",
            0,
            &["'llama.attention.head_count' must be a positive integer, got 0"],
        ),
        (
            "llama.attention.head_count_kv",
            0,
            &["'llama.attention.head_count_kv' must be a positive integer, got 0"],
        ),
        (
            "llama.embedding_length",
            0,
            &["'llama.embedding_length' must be a positive integer, got 0"],
        ),
        (
            "llama.feed_forward_length",
            0,
            &["llama.feed_forward_length is 0"],
        ),
        (
            "llama.attention.head_count_kv",
            4,
            &["llama.attention.head_count_kv (4) exceeds llama.attention.head_count (2)"],
        ),
        (
            "llama.embedding_length",
            9,
            &["llama.embedding_length", "not a multiple"],
        ),
        (
            "llama.attention.key_length",
            0,
            &["'llama.attention.key_length' must be a positive integer, got 0"],
        ),
        (
            "llama.rope.dimension_count",
            2,
            &["'llama.rope.dimension_count' is 2, but Kura rotates whole heads: it needs the head size 4"],
        ),
        (
            "llama.attention.sliding_window",
            0,
            &["'llama.attention.sliding_window' must be a positive integer, got 0"],
        ),
        (
            "llama.context_length",
            u64::MAX,
            &["'llama.context_length' is 18446744073709551615"],
        ),
        (
            "llama.block_count",
            1 << 40,
            &["'llama.block_count' is 1099511627776"],
        ),
        (
            "llama.vocab_size",
            0,
            &["'llama.vocab_size' must be a positive integer, got 0"],
        ),
        (
            "llama.embedding_length",
            1 << 40,
            &["llama.embedding_length 1099511627776", "too large"],
        ),
    ];
    for (key, v, expected) in cases {
        let mut g = tiny_model();
        g.u64(key, *v);
        rejects(&format!("{key}-{v}.gguf"), &g, expected);
    }
    let mut g = tiny_model();
    g.f32("llama.attention.layer_norm_rms_epsilon", f32::NAN);
    rejects("eps.gguf", &g, &["llama.attention.layer_norm_rms_epsilon"]);
}

#[test]
fn tensor_shapes_must_agree_with_the_metadata() {
    // A head count that disagrees with the Q projection is caught from the directory, before loading.
    let mut g = tiny_model();
    g.u32("llama.attention.head_count_kv", 2);
    let err = rejects(
        "kv.gguf",
        &g,
        &["blk.0.attn_k.weight", "shape [4, 8], expected [8, 8]"],
    );
    assert!(matches!(err, ModelError::TensorShape { .. }), "{err}");
    let bytes = g.bytes();
    let err = ModelConfig::from_gguf(&GgufFile::from_bytes("kv", bytes).unwrap())
        .unwrap_err()
        .to_string();
    assert!(err.contains("blk.0.attn_k.weight"), "{err}");
    // A layer tensor beyond block_count.
    let mut g = tiny_model();
    g.tensor("blk.1.attn_norm.weight", &[8]);
    rejects(
        "extra.gguf",
        &g,
        &[
            "blk.1.attn_norm.weight",
            "layer 1",
            "llama.block_count is 1",
        ],
    );
}

#[test]
fn short_or_foreign_files_are_not_gguf() {
    for (name, bytes) in [
        ("empty.gguf", &b""[..]),
        ("three.gguf", &b"GGU"[..]),
        ("json.gguf", &b"{\"hidden_size\": 1}"[..]),
    ] {
        let path = write(name, bytes);
        let err = Model::load(&path).err().unwrap().to_string();
        assert!(
            err.contains(name) && err.contains("not a GGUF file"),
            "{name}: {err}"
        );
        std::fs::remove_file(path).ok();
    }
    let err = GgufFile::from_bytes("x", Vec::new())
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("0 bytes, too short"), "{err}");
}

#[test]
fn every_prefix_of_the_tiny_model_is_an_error_not_a_panic() {
    let bytes = tiny_model().bytes();
    for len in 0..bytes.len() {
        assert!(
            gguf::parse_bytes(&bytes[..len]).is_err(),
            "prefix of {len} bytes accepted"
        );
    }
}

/// An HF directory copied from the tiny Llama of the test data, with `edit` applied.
fn hf_dir(name: &str, edit: impl FnOnce(&std::path::Path)) -> PathBuf {
    let src = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/tiny-llama");
    let dir = std::env::temp_dir().join(format!("kura-bad-hf-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    for f in [
        "config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "model.safetensors",
    ] {
        std::fs::copy(src.join(f), dir.join(f)).unwrap();
    }
    edit(&dir);
    dir
}

#[test]
fn hf_directories_with_bad_configs_or_shard_names_are_rejected() {
    let ok = hf_dir("ok", |_| {});
    assert!(Model::load(&ok).is_ok(), "the unedited copy must load");
    std::fs::remove_dir_all(ok).ok();
    // A shard named outside the directory.
    let dir = hf_dir("escape", |d| {
        std::fs::rename(
            d.join("model.safetensors"),
            d.join("../kura-escape.safetensors"),
        )
        .ok();
        std::fs::write(
            d.join("model.safetensors.index.json"),
            r#"{"weight_map": {"model.embed_tokens.weight": "../kura-escape.safetensors"}}"#,
        )
        .unwrap();
    });
    let err = Model::load(&dir).err().unwrap().to_string();
    assert!(
        err.contains("'../kura-escape.safetensors', which is not a file of the model directory"),
        "{err}"
    );
    std::fs::remove_file(dir.join("../kura-escape.safetensors")).ok();
    std::fs::remove_dir_all(dir).ok();
    // Absurd config values name the field.
    for (key, value, expected) in [
        (
            "num_hidden_layers",
            "0",
            "'num_hidden_layers' must be a positive integer, got 0",
        ),
        (
            "max_position_embeddings",
            "18446744073709551615",
            "'max_position_embeddings' is 18446744073709551615",
        ),
        // What transformers computes for these and the runtime does not: refused, not ignored.
        ("attention_bias", "true", "'attention_bias' is true"),
        ("mlp_bias", "true", "'mlp_bias' is true"),
        ("hidden_act", r#""gelu""#, "'hidden_act' is 'gelu'"),
        // A configuration the checkpoint's tensors disagree with, refused before any allocation
        // (a config of 2^46-element matrices over an 8 KiB file aborted on its allocation).
        (
            "intermediate_size",
            "4096",
            "model.layers.0.mlp.gate_proj.weight",
        ),
        (
            "num_attention_heads",
            "65536",
            "model.layers.0.self_attn.q_proj.weight",
        ),
    ] {
        let dir = hf_dir(key, |d| {
            let text = std::fs::read_to_string(d.join("config.json")).unwrap();
            let mut v: serde_json::Value = serde_json::from_str(&text).unwrap();
            v[key] = serde_json::from_str(value).unwrap();
            std::fs::write(d.join("config.json"), v.to_string()).unwrap();
        });
        let err = Model::load(&dir).err().unwrap().to_string();
        assert!(err.contains(expected), "{key}: {err}");
        std::fs::remove_dir_all(dir).ok();
    }
    // tokenizer_config.json: a special token of another type was read as none.
    for (key, value, expected) in [
        (
            "eos_token",
            "2",
            "'eos_token' is 2: expected a string, an object with \"content\", or null",
        ),
        (
            "bos_token",
            r#"{"id": 1}"#,
            "'bos_token' is an object without a string \"content\"",
        ),
        (
            "chat_template",
            "true",
            "'chat_template' is neither a string nor a list of named templates",
        ),
    ] {
        let dir = hf_dir(key, |d| {
            let file = d.join("tokenizer_config.json");
            let mut v: serde_json::Value =
                serde_json::from_str(&std::fs::read_to_string(&file).unwrap()).unwrap();
            v[key] = serde_json::from_str(value).unwrap();
            std::fs::write(file, v.to_string()).unwrap();
        });
        let err = Model::load(&dir).err().unwrap().to_string();
        assert!(
            err.contains("tokenizer_config.json") && err.contains(expected),
            "{key}: {err}"
        );
        std::fs::remove_dir_all(dir).ok();
    }
    // tokenizer.json that is not a regular file: never opened (a FIFO blocked the start).
    let dir = hf_dir("tokenizer-dir", |d| {
        std::fs::remove_file(d.join("tokenizer.json")).unwrap();
        std::fs::create_dir(d.join("tokenizer.json")).unwrap();
    });
    let err = Model::load(&dir).err().unwrap().to_string();
    assert!(
        err.contains("tokenizer.json") && err.contains("not a regular file"),
        "{err}"
    );
    std::fs::remove_dir_all(dir).ok();
    // A tensor in two shards: which one is meant cannot be known.
    let dir = hf_dir("two-shards", |d| {
        std::fs::copy(d.join("model.safetensors"), d.join("model-2.safetensors")).unwrap();
        std::fs::write(
            d.join("model.safetensors.index.json"),
            r#"{"weight_map": {"a": "model.safetensors", "b": "model-2.safetensors"}}"#,
        )
        .unwrap();
    });
    let err = Model::load(&dir).err().unwrap().to_string();
    assert!(
        err.contains("is also in") && err.contains("a tensor must be in one shard"),
        "{err}"
    );
    std::fs::remove_dir_all(dir).ok();
    // The object form loads.
    let dir = hf_dir("eos-object", |d| {
        let file = d.join("tokenizer_config.json");
        let mut v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&file).unwrap()).unwrap();
        v["eos_token"] = serde_json::json!({"content": "<|im_end|>", "special": true});
        std::fs::write(file, v.to_string()).unwrap();
    });
    let model = Model::load(&dir).unwrap();
    assert!(model.text().tokenizer.eos_token_id.is_some());
    std::fs::remove_dir_all(dir).ok();
}

/// A one-layer Gemma 3 (tied embeddings, per-head Q/K norms, post-norms), shaped like [`tiny_model`]
/// with SentencePiece pieces.
fn tiny_gemma3() -> Gguf {
    let mut g = Gguf::new();
    g.str("general.architecture", "gemma3")
        .u32("gemma3.block_count", 1)
        .u32("gemma3.embedding_length", 8)
        .u32("gemma3.feed_forward_length", 16)
        .u32("gemma3.attention.head_count", 2)
        .u32("gemma3.attention.head_count_kv", 1)
        .u32("gemma3.attention.key_length", 4)
        .u32("gemma3.attention.value_length", 4)
        .u32("gemma3.context_length", 64)
        .u32("gemma3.attention.sliding_window", 8)
        .f32("gemma3.attention.layer_norm_rms_epsilon", 1e-6)
        .f32("gemma3.rope.freq_base", 1e6)
        .str("tokenizer.ggml.model", "llama")
        .strs("tokenizer.ggml.tokens", &["<pad>", "<eos>", "<bos>", "a"])
        .u32("tokenizer.ggml.bos_token_id", 2)
        .u32("tokenizer.ggml.eos_token_id", 1);
    g.tensor("token_embd.weight", &[4, 8])
        .tensor("output_norm.weight", &[8])
        .tensor("blk.0.attn_norm.weight", &[8])
        .tensor("blk.0.attn_q.weight", &[8, 8])
        .tensor("blk.0.attn_k.weight", &[4, 8])
        .tensor("blk.0.attn_v.weight", &[4, 8])
        .tensor("blk.0.attn_q_norm.weight", &[4])
        .tensor("blk.0.attn_k_norm.weight", &[4])
        .tensor("blk.0.attn_output.weight", &[8, 8])
        .tensor("blk.0.post_attention_norm.weight", &[8])
        .tensor("blk.0.ffn_norm.weight", &[8])
        .tensor("blk.0.ffn_gate.weight", &[16, 8])
        .tensor("blk.0.ffn_up.weight", &[16, 8])
        .tensor("blk.0.ffn_down.weight", &[8, 16])
        .tensor("blk.0.post_ffw_norm.weight", &[8]);
    g
}

/// Loads `g` as a model file and returns the error it must give.
#[track_caller]
fn load_error(name: &str, g: &Gguf) -> String {
    let path = write(name, &g.bytes());
    let err = match Model::load(&path) {
        Ok(_) => panic!("{name}: loaded, expected an error"),
        Err(e) => e.to_string(),
    };
    std::fs::remove_file(path).ok();
    err
}

#[test]
fn gemma3_files_name_what_is_missing_or_unsupported() {
    let path = write("gemma3.gguf", &tiny_gemma3().bytes());
    let model = Model::load(&path).unwrap();
    let c = model.config();
    // One layer, the sixth-layer rule: layer 0 slides; the sliding layers' own RoPE base.
    assert_eq!(c.layer_window(0), Some(8));
    assert_eq!(c.params.rope_theta_sliding, Some(10_000.0));
    std::fs::remove_file(path).ok();

    for missing in [
        "blk.0.attn_q_norm.weight",
        "blk.0.attn_k_norm.weight",
        "blk.0.post_attention_norm.weight",
        "blk.0.post_ffw_norm.weight",
    ] {
        let mut g = tiny_gemma3();
        g.tensors.retain(|t| t.name != missing);
        let err = load_error("gemma3-missing.gguf", &g);
        assert!(err.contains(missing), "{missing}: {err}");
    }
    let mut g = tiny_gemma3();
    g.tensors.retain(|t| t.name != "blk.0.attn_k_norm.weight");
    g.tensor("blk.0.attn_k_norm.weight", &[8]);
    let err = load_error("gemma3-shape.gguf", &g);
    assert!(err.contains("blk.0.attn_k_norm.weight"), "{err}");

    let mut g = tiny_gemma3();
    g.f32("gemma3.final_logit_softcapping", 30.0);
    let err = load_error("gemma3-softcap.gguf", &g);
    assert!(
        err.contains("gemma3.final_logit_softcapping") && err.contains("soft-capping"),
        "{err}"
    );
    let mut g = tiny_gemma3();
    g.str("gemma3.rope.scaling.type", "yarn");
    let err = load_error("gemma3-yarn.gguf", &g);
    assert!(
        err.contains("gemma3.rope.scaling.type") && err.contains("yarn"),
        "{err}"
    );
    let mut g = tiny_gemma3();
    g.str("gemma3.rope.scaling.type", "linear");
    let err = load_error("gemma3-linear.gguf", &g);
    assert!(err.contains("gemma3.rope.scaling.factor"), "{err}");

    // Linear scaling divides the full-attention layers' frequencies, not the sliding ones'.
    let mut g = tiny_gemma3();
    g.str("gemma3.rope.scaling.type", "linear")
        .f32("gemma3.rope.scaling.factor", 8.0);
    let path = write("gemma3-linear-ok.gguf", &g.bytes());
    let c = Model::load(&path).unwrap().config().clone();
    let full = kura_model::config::rope_inv_freq(&c);
    let sliding = kura_model::config::rope_inv_freq_sliding(&c).unwrap();
    assert_eq!(full[1], 1.0 / 1e6f32.powf(0.5) / 8.0);
    assert_eq!(sliding[1], 1.0 / 1e4f32.powf(0.5));
    std::fs::remove_file(path).ok();
}

/// The model of `g` fails to load (its GGUF is well formed: the tokenizer is what is wrong) with an
/// error containing `expected`.
#[track_caller]
fn load_fails(name: &str, g: &Gguf, expected: &str) {
    let path = write(name, &g.bytes());
    match Model::load(&path) {
        Ok(_) => panic!("{name}: loaded, expected an error containing {expected:?}"),
        Err(e) => assert!(e.to_string().contains(expected), "{name}: {e}"),
    }
    std::fs::remove_file(path).ok();
}

#[test]
fn a_tokenizer_that_does_not_match_the_embedding_is_rejected_at_load() {
    let mut g = tiny_model();
    g.u32("tokenizer.ggml.bos_token_id", 4);
    load_fails(
        "bos_past_vocab.gguf",
        &g,
        "the BOS token id 4 is outside the model's vocabulary of 4 tokens",
    );
    let mut g = tiny_model();
    g.u32("llama.vocab_size", 4).strs(
        "tokenizer.ggml.tokens",
        &["a", "b", "ab", "<|end|>", "<|extra|>"],
    );
    load_fails(
        "more_tokens_than_rows.gguf",
        &g,
        "token id 4, past the model's 4 embedding rows",
    );
}

/// RoPE scaling in a GGUF of any architecture: llama.cpp writes Llama 3.1's as the tensor
/// `rope_freqs.weight` (a divisor per frequency), other models as `rope.scaling.type`. Both were read
/// for Gemma 3 only: a Llama 3.1 GGUF ran unscaled, a model that is not the one in the file.
#[test]
fn rope_scaling_of_a_gguf_is_read_for_every_architecture() {
    use kura_model::config::rope_inv_freq;
    let load = |name: &str, g: &Gguf| {
        let path = write(name, &g.bytes());
        let model = Model::load(&path).unwrap();
        std::fs::remove_file(path).ok();
        model
    };
    let plain = load("rope-plain.gguf", &tiny_model());
    let base = rope_inv_freq(plain.config());
    assert_eq!(base.len(), 2, "head size 4: two frequencies");
    let mut g = tiny_model();
    g.tensor_values("rope_freqs.weight", &[2], &[1.0, 4.0]);
    let scaled = load("rope-freqs.gguf", &g);
    assert_eq!(rope_inv_freq(scaled.config()), [base[0], base[1] / 4.0]);
    // KV computed without the factors is not KV of this model.
    assert_ne!(
        scaled.config().kv_params_digest(),
        plain.config().kv_params_digest()
    );
    let mut g = tiny_model();
    g.str("llama.rope.scaling.type", "linear")
        .f32("llama.rope.scaling.factor", 4.0);
    assert_eq!(
        load("rope-linear.gguf", &g)
            .config()
            .params
            .rope_linear_factor,
        Some(4.0)
    );
    // What the runtime does not compute is refused, naming it.
    for (name, edit, words) in [
        (
            "rope-freqs-len.gguf",
            Box::new(|g: &mut Gguf| {
                g.tensor_values("rope_freqs.weight", &[3], &[1.0, 2.0, 3.0]);
            }) as Box<dyn Fn(&mut Gguf)>,
            "tensor 'rope_freqs.weight' has shape [3], expected [2]",
        ),
        (
            "rope-freqs-zero.gguf",
            Box::new(|g: &mut Gguf| {
                g.tensor_values("rope_freqs.weight", &[2], &[1.0, 0.0]);
            }),
            "'rope_freqs.weight' holds 0",
        ),
        (
            "rope-yarn.gguf",
            Box::new(|g: &mut Gguf| {
                g.str("llama.rope.scaling.type", "yarn");
            }),
            "llama.rope.scaling.type",
        ),
    ] {
        let mut g = tiny_model();
        edit(&mut g);
        let err = load_error(name, &g);
        assert!(err.contains(words), "{name}: {err}");
    }
}
