//! `shardline`: the command-line shell. It parses arguments, wires the crates together and
//! reports; the logic lives in the library crates.

mod convert;
mod inspect;
mod report;

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
    /// List the keys, dtypes, global shapes and chunks of a checkpoint.
    Inspect(inspect::InspectArgs),
    /// Check a checkpoint's invariants and reconstruct every tensor bit-exactly against its source.
    Validate(inspect::ValidateArgs),
    /// Write a synthetic HF release with real key names and shapes (deterministic data).
    Synth(convert::SynthArgs),
    /// Measure conversion speed against `cp -r` of the same input, and peak memory.
    Bench(convert::BenchArgs),
}

/// Exit codes: 0 success, 1 the checked thing is wrong (validation found differences), 2 error.
fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Convert(a) => convert::run(a),
        Command::Inspect(a) => inspect::run_inspect(a),
        Command::Validate(a) => inspect::run_validate(a),
        Command::Synth(a) => convert::run_synth(a),
        Command::Bench(a) => convert::run_bench(a),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::from(2)
        }
    }
}
