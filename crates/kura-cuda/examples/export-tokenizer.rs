//! Writes a model file's tokenizer and chat template as an HF directory's `tokenizer.json` and
//! `tokenizer_config.json`: `export-tokenizer MODEL OUT_DIR`. The GPU tests give models made on the GPU
//! machine the default model's tokenizer this way (the GGUF itself is too large to carry there).

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() != 3 {
        eprintln!("usage: export-tokenizer MODEL OUT_DIR");
        std::process::exit(2);
    }
    if let Err(e) = run(&args[1], &args[2]) {
        eprintln!("export-tokenizer: {e}");
        std::process::exit(1);
    }
}

fn run(model: &str, out: &str) -> Result<(), Box<dyn std::error::Error>> {
    let parts = kura_checkpoint::ModelParts::open(std::path::Path::new(model))?;
    let tok = &parts.text.tokenizer;
    let out = std::path::Path::new(out);
    std::fs::create_dir_all(out)?;
    std::fs::write(out.join("tokenizer.json"), tok.to_hf_json()?)?;
    let name = |id: Option<u32>| id.and_then(|i| tok.id_to_token(i));
    let config = serde_json::json!({
        "bos_token": name(tok.bos_token_id),
        "eos_token": name(tok.eos_token_id),
        "chat_template": parts.text.chat_template.source(),
        "add_bos_token": false,
    });
    std::fs::write(
        out.join("tokenizer_config.json"),
        serde_json::to_string_pretty(&config)?,
    )?;
    println!("{}", out.display());
    Ok(())
}
