//! `shardline`: the command-line shell. It parses arguments, wires the crates together and
//! reports; the logic lives in the library crates.

mod archs;
mod bench_s3;
mod bench_torchtitan;
mod bench_training;
mod convert;
mod export;
mod follow;
mod gc;
mod gpu;
mod inspect;
mod malloc;
mod notify;
mod orchestrate;
mod publish;
mod report;
mod reshard;
mod reshard_sim;
mod serve;
mod triggers;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "shardline", version, about = "HF safetensors → training-ready distributed checkpoints")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Convert an HF safetensors release into a sharded checkpoint for a target mesh.
    Convert(convert::ConvertArgs),
    /// List the supported architectures, or print one's mapping table (HF → Megatron).
    Archs(archs::ArchsArgs),
    /// List the keys, dtypes, global shapes and chunks of a checkpoint.
    Inspect(inspect::InspectArgs),
    /// Check a checkpoint's invariants and reconstruct every tensor bit-exactly against its source.
    Validate(inspect::ValidateArgs),
    /// Reshard a Megatron-FSDP training checkpoint (parameters and optimizer state) to another mesh.
    Reshard(reshard::ReshardArgs),
    /// Write a checkpoint's model weights back as an HF safetensors release.
    Export(export::ExportArgs),
    /// Publish a local checkpoint directory to a destination: data first, each object verified,
    /// then `.metadata`, then the manifest; nothing torch could take for a checkpoint until then.
    Publish(publish::PublishArgs),
    /// Say whether a published location holds a complete checkpoint (which one), or what an
    /// interrupted publish left there; `--clean` removes it.
    VerifyDestination(publish::VerifyDestinationArgs),
    /// Write a synthetic HF release with real key names and shapes (deterministic data).
    Synth(convert::SynthArgs),
    /// Measure conversion speed against `cp -r` of the same input, and peak memory.
    Bench(convert::BenchArgs),
    /// Run a pipeline to completion with in-process workers (embedded SQLite state by default).
    Run(orchestrate::RunArgs),
    /// Check pipeline specs; every problem at once, with file:line:column.
    Lint(orchestrate::LintArgs),
    /// Show the tasks a pipeline would run, their resources, and which are cached.
    Plan(orchestrate::PlanArgs),
    /// Queue a pipeline run in a shared job store.
    Submit(orchestrate::SubmitArgs),
    /// Serve the job store: return expired leases to the queue; with --http, the API and dashboard.
    Server(orchestrate::ServerArgs),
    /// Lease and execute tasks from the job store.
    Worker(orchestrate::WorkerArgs),
    /// List runs.
    Runs(orchestrate::RunsArgs),
    /// Print a run's (or a task's) logs.
    Logs(orchestrate::LogsArgs),
    /// Cancel a run.
    Cancel(orchestrate::CancelArgs),
    /// Re-queue a failed or cancelled run, or re-run it from a step.
    Retry(orchestrate::RetryArgs),
    /// Create, list and revoke API tokens of the HTTP API and dashboard.
    Token(serve::TokenArgs),
    /// List the registered triggers (schedules, Hub watches) with their last and next firing.
    Triggers(triggers::TriggersArgs),
    /// Free what the retention policy no longer keeps in a state directory: work directories of
    /// finished runs, step caches and downloads (least recently used first); never what a queued
    /// or running run needs.
    Gc(gc::GcArgs),
}

/// Exit codes: 0 success, 1 the checked thing is wrong (validation found differences), 2 error.
fn main() -> ExitCode {
    sigpipe::reset();
    let filter = tracing_subscriber::EnvFilter::try_from_env("SHARDLINE_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Convert(a) => convert::run(a),
        Command::Archs(a) => archs::run_archs(a),
        Command::Inspect(a) => inspect::run_inspect(a),
        Command::Validate(a) => inspect::run_validate(a),
        Command::Reshard(a) => reshard::run_reshard(a),
        Command::Export(a) => export::run_export(a),
        Command::Publish(a) => publish::run_publish(a),
        Command::VerifyDestination(a) => publish::run_verify_destination(a),
        Command::Synth(a) => convert::run_synth(a),
        Command::Bench(a) => convert::run_bench(a),
        Command::Run(a) => {
            // Workers allocate large I/O buffers (parts, fetched pieces) on many threads: each
            // its own mapping, so what a finished task freed does not stay resident.
            malloc::map_large_buffers();
            orchestrate::run_run(a)
        }
        Command::Lint(a) => orchestrate::run_lint(a),
        Command::Plan(a) => orchestrate::run_plan(a),
        Command::Submit(a) => orchestrate::run_submit(a),
        Command::Server(a) => orchestrate::run_server(a),
        Command::Worker(a) => {
            malloc::map_large_buffers();
            orchestrate::run_worker_cmd(a)
        }
        Command::Runs(a) => orchestrate::run_runs(a),
        Command::Logs(a) => orchestrate::run_logs(a),
        Command::Cancel(a) => orchestrate::run_cancel(a),
        Command::Retry(a) => orchestrate::run_retry(a),
        Command::Token(a) => serve::run_token(a),
        Command::Triggers(a) => triggers::run_triggers(a),
        Command::Gc(a) => gc::run_gc(a),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {}", shardline_formats::error_message(e.as_ref()));
            ExitCode::from(2)
        }
    }
}
