//! `kura sim`: replays a Mooncake-format trace through the KV cache manager (no model) and prints hit
//! ratios, evictions and the manager's throughput as a table or JSON; with `--workload`, simulates the
//! server (the engine's scheduler and a cost model) under one of `kura bench`'s workloads; with
//! `--calibrate`, times forward steps of the real model and fits that cost model.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::{Args, ValueEnum};
use kura_engine::{AdmissionMode, SchedulerConfig, SchedulingPolicy, DEFAULT_MAX_BATCHED_TOKENS};
use kura_kv::codec::KvDtype;
use kura_kv::EvictionPolicy;
use kura_model::{ChatMessage, Model, ModelText, SeqBatchItem, WeightsDtype};
use kura_sim::fleet::{simulate_fleet, FleetSim};
use kura_sim::replay::replay_with_progress;
use kura_sim::{simulate, CostModel, Policy, ServeSim, SimConfig, StepItem, Workload};
use kura_trace::{load_trace_limited, TraceRequest};

#[derive(Clone, Copy, Debug, ValueEnum)]
enum WorkloadArg {
    SharedPrefix,
    MultiTurn,
    Unique,
    /// The `--trace` file, open loop: each request sent at its timestamp (times `--time-scale`).
    Trace,
}

#[derive(Args, Debug)]
pub struct SimArgs {
    /// A Mooncake-format trace (JSONL: timestamp, input_length, output_length, hash_ids).
    #[arg(long, default_value = "data/traces/mooncake_conversation_trace.jsonl")]
    trace: PathBuf,
    /// Tokens per KV block (1..=1024); each 512-token hash id of the trace is mapped to its tokens.
    #[arg(long, default_value_t = 16, value_parser = crate::setup::block_size_arg)]
    block_size: usize,
    /// Cache capacity in tokens, at least one block (rounded down to whole blocks). Default: unbounded
    /// (nothing is ever evicted).
    #[arg(long)]
    capacity_tokens: Option<u64>,
    /// Eviction policy.
    #[arg(long, value_enum, default_value_t = Policy::LeafLru)]
    policy: Policy,
    /// Free each request as soon as it is allocated instead of holding it for its duration.
    #[arg(long)]
    no_overlap: bool,
    /// Cost model: prefill speed for uncached prompt tokens (positive).
    #[arg(long, default_value_t = 10_000.0)]
    prefill_tokens_per_s: f64,
    /// Cost model: time per output token (0 or more; 0: output takes no time).
    #[arg(long, default_value_t = 20.0)]
    decode_ms_per_token: f64,
    /// Replay only the first N requests (N >= 1); the rest of the trace is not read. The name of
    /// `kura bench trace`'s flag; `--limit` is accepted too.
    #[arg(long, visible_alias = "limit")]
    max_requests: Option<usize>,
    /// Hash seed (results do not depend on it unless hashes collide).
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,

    /// Simulate the server instead of the cache alone: one of `kura bench`'s workloads, sent by a closed
    /// loop of `--concurrency` clients, through the engine's scheduler with the `--cost` model.
    #[arg(long, value_enum)]
    workload: Option<WorkloadArg>,
    /// Clients in flight (closed loop), one or more values: `1,2,4,8`.
    #[arg(long, value_delimiter = ',', default_value = "8")]
    concurrency: Vec<usize>,
    /// The cost model (`kura sim --calibrate` writes one).
    #[arg(long, default_value = "data/cost/smollm2-135m-q4_1-2t-f32kv.json")]
    cost: PathBuf,
    /// KV blocks of the simulated server's pool (`kura serve` logs its own; `kura plan` gives it).
    #[arg(long, default_value_t = 1024)]
    kv_blocks: usize,
    /// The server's limits, as `kura serve`'s flags of the same names.
    #[arg(long, default_value_t = 64)]
    max_num_seqs: usize,
    #[arg(long, default_value_t = DEFAULT_MAX_BATCHED_TOKENS)]
    max_num_batched_tokens: usize,
    #[arg(long, default_value_t = 8192)]
    max_model_len: usize,
    /// As `kura serve --prefill-step-ms`: beside decodes, a step's prompt tokens are cut to about this
    /// many milliseconds at the prefill rate measured on the simulated steps; 0: no cut.
    #[arg(long, default_value_t = 250, value_parser = clap::value_parser!(u64).range(0..=3_600_000))]
    prefill_step_ms: u64,
    /// Turn prefix caching off in the simulated server.
    #[arg(long)]
    no_prefix_cache: bool,
    /// Admission, as `kura serve --scheduling`: `max-utilization` or `guaranteed` (every request's KV
    /// reserved at admission, no preemption).
    #[arg(long, value_enum, default_value_t = AdmissionMode::MaxUtilization)]
    scheduling: AdmissionMode,
    /// Tokens generated per request (as `kura bench --output-tokens`).
    #[arg(long, default_value_t = 64)]
    output_tokens: usize,
    /// shared-prefix: groups, users per group, system and question tokens.
    #[arg(long, default_value_t = 4)]
    groups: usize,
    #[arg(long, default_value_t = 8)]
    users_per_group: usize,
    #[arg(long)]
    system_tokens: Option<usize>,
    #[arg(long, default_value_t = 50)]
    question_tokens: usize,
    /// multi-turn: conversations, turns, user tokens per turn (system tokens: --system-tokens, 200).
    #[arg(long, default_value_t = 8)]
    conversations: usize,
    #[arg(long, default_value_t = 4)]
    turns: usize,
    #[arg(long, default_value_t = 100)]
    user_tokens: usize,
    /// unique: requests and prompt tokens.
    #[arg(long, default_value_t = 32)]
    requests: usize,
    #[arg(long, default_value_t = 1050)]
    prompt_tokens: usize,

    #[command(flatten)]
    shaping: crate::bench::TraceShaping,

    /// Simulate a fleet instead of one server (`--workload trace` only): this many replicas behind a
    /// router, one run per count and policy: `4,8,16,32,64`. Each replica has `--kv-blocks` blocks.
    #[arg(long, value_delimiter = ',')]
    replicas: Vec<usize>,
    /// The router's policies to compare, as `kura router --policy`: `kv,round-robin,least-load`.
    #[arg(long, value_delimiter = ',', default_value = "kv")]
    router: Vec<kura_fleet::Policy>,
    /// The `kv` policy's weight of a block to prefill against a block of work in flight.
    #[arg(long, default_value_t = 1.0)]
    overlap_weight: f64,
    /// A tier shared by the fleet (Redis, L4) of this many blocks; one run per size: `0,100000`
    /// (0: none).
    #[arg(long, value_delimiter = ',', default_value = "0")]
    l4_blocks: Vec<usize>,

    /// Time forward steps of the real model and write the fitted cost model to `--cost` (or print it).
    #[arg(long)]
    calibrate: bool,
    /// Calibration: the model (default: the default model).
    #[arg(long)]
    model: Option<PathBuf>,
    /// Calibration: worker threads (default: one per physical core this process may use).
    #[arg(long)]
    threads: Option<usize>,
    /// Calibration: time the steps on the CPU (`cpu`) or a GPU (`cuda`, `cuda:N`), as `kura serve
    /// --device`.
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Calibration: K/V element format, as `kura serve --kv-dtype`.
    #[arg(long, default_value = "bf16")]
    kv_dtype: KvDtype,
    /// Calibration: weights format, as `kura serve --weights-dtype`.
    #[arg(long, default_value = "native")]
    weights_dtype: WeightsDtype,
    /// Calibration: timed runs of each step shape (the median counts).
    #[arg(long, default_value_t = 5)]
    repeats: usize,
}

pub fn run(args: SimArgs) -> Result<()> {
    if args.calibrate {
        return calibrate(&args);
    }
    if let Some(w) = args.workload {
        return serve_sim(&args, w);
    }
    if !args.replicas.is_empty() {
        bail!("--replicas simulates a fleet on a trace: give --workload trace");
    }
    let cfg = SimConfig {
        block_size: args.block_size,
        capacity_tokens: args.capacity_tokens,
        policy: args.policy,
        overlap: !args.no_overlap,
        prefill_tokens_per_s: args.prefill_tokens_per_s,
        decode_ms_per_token: args.decode_ms_per_token,
        hash_seed: args.seed,
    };
    // Flags first: a bad one is reported before a large trace is read.
    cfg.validate()?;
    let trace = load_requests(&args)?;
    // Requests replayed, drawn only on a terminal.
    let bar = crate::progress::bar(trace.len() as u64, "replay", "requests");
    // (Every 1,024 requests: the replay's own timing, ops_per_sec, should not measure the bar.)
    let mut progress = |done: usize, total: usize| {
        if done % 1024 == 0 || done == total {
            bar.set_position(done as u64)
        }
    };
    let report = replay_with_progress(&trace, &cfg, &mut progress)
        .with_context(|| format!("replaying {}", args.trace.display()))?;
    bar.finish_and_clear();
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        println!("trace                {}", args.trace.display());
        print!("{report}");
    }
    Ok(())
}

/// The trace's first `--max-requests` requests (all without it); 0 is refused before the file is read.
fn load_requests(args: &SimArgs) -> Result<Vec<TraceRequest>> {
    if args.max_requests == Some(0) {
        bail!(
            "--max-requests 0 replays no request: give at least 1, or leave it out to replay the whole trace"
        );
    }
    Ok(load_trace_limited(&args.trace, args.max_requests)?)
}

fn serve_sim(args: &SimArgs, w: WorkloadArg) -> Result<()> {
    let workload = match w {
        WorkloadArg::SharedPrefix => Workload::SharedPrefix {
            groups: args.groups,
            users_per_group: args.users_per_group,
            system_tokens: args.system_tokens.unwrap_or(1000),
            question_tokens: args.question_tokens,
        },
        WorkloadArg::MultiTurn => Workload::MultiTurn {
            conversations: args.conversations,
            turns: args.turns,
            system_tokens: args.system_tokens.unwrap_or(200),
            user_tokens: args.user_tokens,
        },
        WorkloadArg::Unique => Workload::Unique {
            requests: args.requests,
            prompt_tokens: args.prompt_tokens,
        },
        WorkloadArg::Trace => Workload::Trace {
            source: args.trace.display().to_string(),
            requests: load_requests(args)?,
            time_scale: args.shaping.time_scale,
            max_prompt_tokens: args.shaping.max_prompt_tokens,
            max_output_tokens: args.shaping.max_output_tokens,
        },
    };
    if args.concurrency.is_empty() || args.concurrency.contains(&0) {
        bail!("--concurrency takes one or more counts of at least 1");
    }
    if matches!(w, WorkloadArg::Trace) && args.concurrency.len() > 1 {
        bail!(
            "--workload trace sends each request at its time in the trace: one run, so --concurrency \
             takes no list"
        );
    }
    let cost = CostModel::load(&args.cost)?;
    if !args.replicas.is_empty() {
        return fleet_sim(args, &workload, cost);
    }
    let mut reports = Vec::new();
    for &concurrency in &args.concurrency {
        let sim = ServeSim {
            scheduler: scheduler_config(args),
            cost: cost.clone(),
            concurrency,
            output_tokens: args.output_tokens,
            max_model_len: args.max_model_len,
            prefill_step: prefill_step(args),
        };
        reports.push(simulate(&workload, &sim)?);
    }
    if args.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&serde_json::json!({
                "workload": workload,
                "cost_model": cost,
                "kv_blocks": args.kv_blocks,
                "block_size": args.block_size,
                "points": reports,
            }))?
        );
        return Ok(());
    }
    println!(
        "simulated {} on {} blocks of {} tokens, cost model {} ({})",
        workload.name(),
        args.kv_blocks,
        args.block_size,
        args.cost.display(),
        cost.measured_on
    );
    println!("| concurrency | requests | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | E2E p50 ms | out tok/s | cached | preemptions |");
    println!("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for r in &reports {
        let clients = match r.concurrency {
            0 => "open loop".to_string(),
            n => n.to_string(),
        };
        println!(
            "| {clients} | {} | {:.0} | {:.0} | {:.1} | {:.1} | {:.0} | {:.1} | {:.1} % | {} |",
            r.requests,
            r.ttft_ms.p50,
            r.ttft_ms.p99,
            r.itl_ms.p50,
            r.itl_ms.p99,
            r.e2e_ms.p50,
            r.output_tokens_per_s,
            r.cached_ratio * 100.0,
            r.preemptions
        );
    }
    Ok(())
}

/// `kura sim --replicas`: the trace through each fleet size and policy.
fn fleet_sim(args: &SimArgs, workload: &Workload, cost: CostModel) -> Result<()> {
    if !matches!(workload, Workload::Trace { .. }) {
        bail!("--replicas simulates a fleet on a trace: give --workload trace");
    }
    if args.replicas.contains(&0) || args.replicas.iter().any(|&n| n > 4096) {
        bail!("--replicas takes counts from 1 to 4096");
    }
    if args.router.is_empty() {
        bail!("--router takes one or more policies: kv, round-robin, least-load");
    }
    let replica = ServeSim {
        scheduler: scheduler_config(args),
        cost: cost.clone(),
        concurrency: 1,
        output_tokens: args.output_tokens,
        max_model_len: args.max_model_len,
        prefill_step: prefill_step(args),
    };
    let mut reports = Vec::new();
    for &l4 in &args.l4_blocks {
        for &replicas in &args.replicas {
            for &policy in &args.router {
                let sim = FleetSim {
                    replica: replica.clone(),
                    replicas,
                    policy,
                    overlap_weight: args.overlap_weight,
                    l4_blocks: (l4 > 0).then_some(l4),
                };
                let report = simulate_fleet(workload, &sim)?;
                if !args.json {
                    if reports.is_empty() {
                        println!(
                            "simulated fleet on {}, {} blocks of {} tokens per replica, cost model {} ({})",
                            args.trace.display(),
                            args.kv_blocks,
                            args.block_size,
                            args.cost.display(),
                            cost.measured_on
                        );
                        println!("| replicas | router | L4 blocks | requests | cached | from L4 | TTFT p50 ms | TTFT p99 ms | out tok/s | requests per replica (max/min) |");
                        println!("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|");
                    }
                    println!(
                        "| {} | {} | {} | {} | {:.1} % | {:.1} % | {:.0} | {:.0} | {:.1} | {} / {} |",
                        report.replicas,
                        report.policy,
                        l4,
                        report.requests,
                        report.cached_ratio * 100.0,
                        report.l4_ratio * 100.0,
                        report.ttft_ms.p50,
                        report.ttft_ms.p99,
                        report.output_tokens_per_s,
                        report.max_replica_requests,
                        report.min_replica_requests
                    );
                }
                reports.push(report);
            }
        }
    }
    if args.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&serde_json::json!({
                "workload": workload,
                "cost_model": cost,
                "kv_blocks": args.kv_blocks,
                "block_size": args.block_size,
                "fleets": reports,
            }))?
        );
    }
    Ok(())
}

/// `--prefill-step-ms` as the simulated server's pacing (0: none).
fn prefill_step(args: &SimArgs) -> Option<std::time::Duration> {
    (args.prefill_step_ms > 0).then(|| std::time::Duration::from_millis(args.prefill_step_ms))
}

/// Each simulated server's scheduler, from the flags.
fn scheduler_config(args: &SimArgs) -> SchedulerConfig {
    SchedulerConfig {
        block_size_tokens: args.block_size,
        num_blocks: args.kv_blocks,
        max_num_seqs: args.max_num_seqs,
        max_num_batched_tokens: args.max_num_batched_tokens,
        enable_prefix_caching: !args.no_prefix_cache,
        policy: SchedulingPolicy::Fcfs,
        eviction_policy: EvictionPolicy::LeafLru,
        hash_seed: Some(args.seed),
        tiers: Default::default(),
        preemption: Default::default(),
        admission: args.scheduling,
        window: None,
        record_kv_events: false,
    }
}

/// The step shapes timed by `--calibrate`: prompts of several lengths and offsets, decode batches at
/// several contexts, and prompts mixed with decode tokens, as the scheduler makes them.
fn calibration_shapes() -> Vec<Vec<StepItem>> {
    let item = |start, tokens| StepItem {
        start,
        tokens,
        shared: 0,
    };
    let mut shapes = Vec::new();
    for n in [16, 64, 128, 256, 512, 1024] {
        shapes.push(vec![item(0, n)]);
    }
    for start in [256, 512, 1024, 1536] {
        shapes.push(vec![item(start, 256)]);
    }
    for batch in [1, 2, 4, 8, 16] {
        for context in [64, 512, 1024, 2048] {
            shapes.push(vec![item(context, 1); batch]);
        }
    }
    for batch in [4, 8, 16] {
        for context in [512, 1024, 2048] {
            shapes.push(StepItem::decode_sharing(context, context, batch));
        }
    }
    for (decode, context, chunk) in [(7, 512, 256), (3, 256, 64), (7, 1100, 1024), (15, 300, 128)] {
        let mut s = vec![item(context, 1); decode];
        s.push(item(0, chunk));
        shapes.push(s);
    }
    shapes
}

/// Times the server's front end on a prompt of about 1,000 tokens: the chat template rendered and the
/// result tokenized, as `kura serve` does for each chat request (median of `repeats`).
fn frontend_ms_per_token(model_text: &ModelText, repeats: usize) -> Result<f64> {
    let words = [
        "the", "cache", "holds", "keys", "and", "values", "of", "every", "token", "so", "that",
        "later", "requests", "with", "a", "shared", "prefix", "skip", "its", "prefill",
    ];
    let text: Vec<&str> = (0..900)
        .map(|i| words[(i * 7 + i / 20) % words.len()])
        .collect();
    let messages = [
        ChatMessage::new("system", text.join(" ")),
        ChatMessage::new("user", "Continue."),
    ];
    let mut times = Vec::new();
    let mut tokens = 0;
    for run in 0..=repeats {
        let t0 = Instant::now();
        let ids = model_text
            .chat_template
            .encode(&model_text.tokenizer, &messages, true)
            .context("timing the chat template and tokenizer")?;
        if run > 0 {
            times.push(t0.elapsed().as_secs_f64() * 1e3);
        }
        tokens = ids.len();
    }
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2] / tokens.max(1) as f64)
}

/// What calibration times: one forward step of a batch on the CPU runtime or the CUDA executor, the
/// logits back on the host and each row's greedy token chosen there (as the engine samples).
enum Runner {
    Cpu(Box<(Model, kura_kv::storage::KvStorage)>),
    Gpu(Box<kura_cuda::CudaExecutor>),
}

impl Runner {
    /// One step of `items`: (tokens, first position, block table) each.
    fn step(&mut self, items: &[(Vec<u32>, usize, Vec<u32>)]) -> Result<()> {
        let greedy = |row: &[f32]| {
            (0..row.len())
                .max_by(|&a, &b| row[a].total_cmp(&row[b]))
                .unwrap_or(0)
        };
        let mut chosen = 0usize;
        match self {
            Runner::Cpu(cpu) => {
                let (model, kv) = &mut **cpu;
                let batch: Vec<SeqBatchItem<'_>> = items
                    .iter()
                    .map(|(tokens, start, table)| SeqBatchItem {
                        tokens,
                        start_pos: *start,
                        block_table: table,
                        layer_pages: &[],
                    })
                    .collect();
                let logits = model.forward(&batch, kv)?;
                for r in 0..logits.num_rows() {
                    chosen ^= greedy(logits.row(r));
                }
            }
            Runner::Gpu(exec) => {
                let batch: Vec<kura_engine::SeqInput<'_>> = items
                    .iter()
                    .map(|(tokens, start, table)| kura_engine::SeqInput::new(tokens, *start, table))
                    .collect();
                let vocab = exec.config().vocab_size();
                let logits = exec
                    .forward_logits(&batch)
                    .context("a calibration step on the GPU")?;
                for row in logits.chunks_exact(vocab) {
                    chosen ^= greedy(row);
                }
            }
        }
        std::hint::black_box(chosen);
        Ok(())
    }
}

fn calibrate(args: &SimArgs) -> Result<()> {
    if args.repeats == 0 {
        bail!("--repeats must be at least 1");
    }
    let device =
        kura_cuda::parse_device(&args.device).map_err(|e| anyhow::anyhow!("--device: {e}"))?;
    match device {
        None => crate::setup::threads(args.threads)?,
        Some(_) => {
            crate::gpu::check_weights(args.weights_dtype)?;
            crate::gpu::check_pool(args.kv_dtype, args.block_size)?;
        }
    }
    let path = crate::setup::model_path(args.model.as_ref())?;
    let shapes = calibration_shapes();
    let bs = args.block_size;
    let blocks_of =
        |s: &[StepItem]| -> usize { s.iter().map(|i| (i.start + i.tokens).div_ceil(bs)).sum() };
    let num_blocks = shapes.iter().map(|s| blocks_of(s)).max().unwrap_or(1);
    let (mut runner, config, text, hardware) = match device {
        None => {
            let model = crate::setup::load_model(&path, args.weights_dtype)?;
            let layout = model.kv_layout(args.kv_dtype, bs)?;
            let kv = model
                .kv_storage(&layout, num_blocks)
                .context("allocating the KV cache")?;
            let (config, text) = (model.config().clone(), model.text().clone());
            let hardware = format!(
                "{} threads, {} weights",
                kura_model::num_threads(),
                model.weights_dtype().name()
            );
            (Runner::Cpu(Box::new((model, kv))), config, text, hardware)
        }
        Some(ordinal) => {
            let parts = kura_model::ModelParts::open(&path)
                .with_context(|| format!("opening the model {}", path.display()))?;
            let max_tokens = shapes
                .iter()
                .map(|s| s.iter().map(|i| i.tokens).sum::<usize>())
                .max()
                .unwrap_or(1);
            let max_seqs = shapes.iter().map(Vec::len).max().unwrap_or(1);
            let setup = crate::gpu::GpuSetup::load(
                ordinal,
                &path,
                &parts,
                args.kv_dtype,
                bs,
                max_tokens,
                max_seqs,
            )?;
            let hardware = format!("{}, bf16 weights", setup.device_name());
            let layout = parts.config.kv_layout(args.kv_dtype, bs)?;
            let exec = setup.executor(&layout, num_blocks)?;
            (
                Runner::Gpu(Box::new(exec)),
                parts.config,
                std::sync::Arc::new(parts.text),
                hardware,
            )
        }
    };
    let mut samples = Vec::new();
    for shape in &shapes {
        // Each item its own blocks; the tokens are any ids, their values do not change the time.
        // (A shared item's context is the first item's blocks; its own token goes to a block of its own:
        // the shapes' contexts are whole blocks.)
        let mut next = 0u32;
        let mut tables: Vec<Vec<u32>> = Vec::new();
        for i in shape {
            let n = (i.start + i.tokens).div_ceil(bs) as u32;
            let table: Vec<u32> = if i.shared > 0 {
                let keep = (i.shared / bs).min(tables[0].len());
                let own = n - keep as u32;
                let mut t = tables[0][..keep].to_vec();
                t.extend(next..next + own);
                next += own;
                t
            } else {
                let t = (next..next + n).collect();
                next += n;
                t
            };
            tables.push(table);
        }
        let vocab = config.vocab_size() as u32;
        let items: Vec<(Vec<u32>, usize, Vec<u32>)> = shape
            .iter()
            .zip(tables)
            .map(|(i, table)| {
                let tokens = (0..i.tokens as u32)
                    .map(|t| (100 + t % 1000) % vocab)
                    .collect();
                (tokens, i.start, table)
            })
            .collect();
        let mut times = Vec::new();
        for run in 0..=args.repeats {
            let t0 = Instant::now();
            runner.step(&items)?;
            if run > 0 {
                times.push(t0.elapsed().as_secs_f64() * 1e3);
            }
        }
        times.sort_by(f64::total_cmp);
        let ms = times[times.len() / 2];
        eprintln!(
            "{:>3} items, {:>5} tokens, contexts up to {:>5}: {ms:8.2} ms",
            shape.len(),
            shape.iter().map(|i| i.tokens).sum::<usize>(),
            shape.iter().map(|i| i.start + i.tokens).max().unwrap_or(0)
        );
        samples.push((shape.clone(), ms));
    }
    let measured_on = format!(
        "{}, {hardware}, {} KV, blocks of {bs}",
        path.file_name().map_or_else(
            || path.display().to_string(),
            |n| n.to_string_lossy().into_owned()
        ),
        args.kv_dtype,
    );
    // On a GPU the step's work is not split over CPU threads: the fit sees one.
    let threads = match device {
        None => kura_model::num_threads(),
        Some(_) => 1,
    };
    let mut cost = CostModel::fit(&samples, threads, config.num_kv_heads(), measured_on)?;
    cost.frontend_ms_per_token = frontend_ms_per_token(&text, args.repeats)?;
    eprintln!(
        "front end (chat template + tokenizer): {:.4} ms per prompt token",
        cost.frontend_ms_per_token
    );
    let worst = samples
        .iter()
        .map(|(s, ms)| (cost.step_ms(s) - ms).abs() / ms)
        .fold(0.0, f64::max);
    eprintln!(
        "fit: largest relative error over the timed shapes {:.1} %",
        worst * 100.0
    );
    let json = serde_json::to_string_pretty(&cost)?;
    if args.cost.as_os_str().is_empty() || args.json {
        println!("{json}");
    }
    if !args.cost.as_os_str().is_empty() {
        if let Some(dir) = args.cost.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        }
        std::fs::write(&args.cost, json + "\n")
            .with_context(|| format!("writing {}", args.cost.display()))?;
        eprintln!("cost model written to {}", args.cost.display());
    }
    Ok(())
}
