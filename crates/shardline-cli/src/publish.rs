//! `publish` (a local checkpoint to a destination, by the commit protocol of
//! `shardline_publish`) and `verify-destination` (what a published location holds, and cleaning
//! what an interrupted publish left there).

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use anyhow::{Context, Result};
use clap::Args;
use serde_json::json;
use shardline_publish::{Destination, LocationReport, LocationState, PublishOptions, Verify};

use crate::report::bytes;

#[derive(Args, Debug)]
pub struct PublishArgs {
    /// The checkpoint directory to publish (every file in it: rank files, `.metadata`, …).
    pub ckpt: PathBuf,
    /// Where: an absolute path, or a `file://`, `s3://`, `gs://` or `az://` URL (stores are
    /// configured from the environment: `AWS_ENDPOINT_URL`, `AWS_ACCESS_KEY_ID`, …).
    #[arg(long = "to", value_name = "URL")]
    pub to: String,
    /// Files being uploaded at once.
    #[arg(long, default_value_t = 4)]
    pub files_in_flight: usize,
    /// Parts (and single-PUT bodies) being uploaded at once, over all files.
    #[arg(long, default_value_t = 8)]
    pub parts_in_flight: usize,
    /// Files larger than this go as multipart uploads in parts of this size (S3: at least 5MiB).
    #[arg(long, default_value = "64MiB")]
    pub part_size: String,
    /// How each object is checked once uploaded: `read-back` (hashed again from the store) or
    /// `head` (size and recorded SHA-256 only).
    #[arg(long, default_value = "read-back", value_parser = ["read-back", "head"])]
    pub verify: String,
    /// Machine-readable output on stdout.
    #[arg(long)]
    pub json: bool,
}

pub fn run_publish(args: PublishArgs) -> Result<ExitCode> {
    let started = Instant::now();
    let part_size =
        shardline_units::parse_size_lenient(&args.part_size).map_err(|e| anyhow::anyhow!("--part-size: {e}"))?;
    let options = PublishOptions {
        part_size: usize::try_from(part_size).context("--part-size is too large")?,
        max_parts_in_flight: args.parts_in_flight,
        max_files_in_flight: args.files_in_flight,
        verify: if args.verify == "head" { Verify::Head } else { Verify::ReadBack },
        ..PublishOptions::default()
    };
    let ckpt = std::fs::canonicalize(&args.ckpt).with_context(|| format!("reading {}", args.ckpt.display()))?;
    refuse_nested(&ckpt)?;
    let source = json!({ "path": ckpt });
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().context("starting the runtime")?;
    let (manifest, report) = runtime
        .block_on(shardline_publish::publish(&ckpt, &args.to, source, json!({}), &options))
        .with_context(|| format!("publishing {} to {}", ckpt.display(), args.to))?;
    let secs = started.elapsed().as_secs_f64();
    if args.json {
        println!(
            "{}",
            json!({"to": args.to, "files": manifest.files.len(), "copied": report.copied, "skipped": report.skipped,
                   "resumed": report.resumed, "bytes_copied": report.bytes_copied,
                   "bytes_verified": report.bytes_verified, "parts_uploaded": report.parts_uploaded,
                   "manifest_written": report.manifest_written, "seconds": secs})
        );
    } else {
        println!(
            "published {} → {}: {} file(s), {} copied, {} kept, {} resumed ({}), in {secs:.2}s",
            ckpt.display(),
            args.to,
            manifest.files.len(),
            report.copied.len(),
            report.skipped.len(),
            report.resumed.len(),
            bytes(report.bytes_copied),
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// A checkpoint is published as the files of one directory (a subdirectory would be left out
/// without a word), or as a Megatron-LM save directory: its tracker and the checkpoint
/// directory it names, the tracker committing last.
fn refuse_nested(dir: &std::path::Path) -> Result<()> {
    if let Some(named) = shardline_formats::checkpoint::megatron_checkpoint_dir(dir)? {
        if !named.join(".metadata").is_file() {
            anyhow::bail!(
                "{} is a Megatron-LM save directory whose tracker names {}, which holds no checkpoint (no .metadata)",
                dir.display(),
                named.display()
            );
        }
        return Ok(());
    }
    let nested: Vec<String> = std::fs::read_dir(dir)
        .with_context(|| format!("listing {}", dir.display()))?
        .flatten()
        .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    if !nested.is_empty() {
        anyhow::bail!(
            "{} has subdirectories ({}): a checkpoint is published as the files of one directory",
            dir.display(),
            nested.join(", ")
        );
    }
    Ok(())
}

#[derive(Args, Debug)]
pub struct VerifyDestinationArgs {
    /// The published location: an absolute path, or a `file://`, `s3://`, `gs://` or `az://` URL.
    pub url: String,
    /// Remove what an interrupted publish left (its `.metadata` first, its pending record last;
    /// open multipart uploads aborted). A complete checkpoint's files are never removed.
    #[arg(long)]
    pub clean: bool,
    /// Machine-readable output on stdout.
    #[arg(long)]
    pub json: bool,
}

/// Exit 0 when the location holds a complete checkpoint, 1 when it does not (after `--clean`
/// too: an empty location is no checkpoint), 2 on an error.
pub fn run_verify_destination(args: VerifyDestinationArgs) -> Result<ExitCode> {
    let dest = Destination::open(&args.url, &[]).with_context(|| format!("opening {}", args.url))?;
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().context("starting the runtime")?;
    let report = runtime
        .block_on(async {
            if args.clean {
                shardline_publish::clean(&dest).await
            } else {
                shardline_publish::survey(&dest).await
            }
        })
        .with_context(|| format!("surveying {}", args.url))?;
    if args.json {
        println!("{}", serde_json::to_string(&report).context("encoding the report")?);
    } else {
        print_report(&report);
    }
    Ok(if report.state == LocationState::Complete { ExitCode::SUCCESS } else { ExitCode::from(1) })
}

fn print_report(r: &LocationReport) {
    match r.state {
        LocationState::Complete => println!(
            "{}: complete checkpoint, manifest sha256 {}, {} object(s)",
            r.url,
            r.manifest_sha256.as_deref().unwrap_or("?"),
            r.files
        ),
        LocationState::Empty => println!("{}: empty", r.url),
        LocationState::Incomplete => println!(
            "{}: NOT a complete checkpoint ({} object(s); torch {} it for one)",
            r.url,
            r.files,
            if r.torch_visible { "WOULD take" } else { "would not take" }
        ),
    }
    for p in &r.problems {
        println!("  problem: {p}");
    }
    for d in &r.debris {
        println!("  debris: {d}");
    }
    for o in &r.other {
        println!("  other (not ours): {o}");
    }
    for c in &r.cleaned {
        println!("  removed: {c}");
    }
    if !r.debris.is_empty() && r.cleaned.is_empty() {
        println!("  (run with --clean to remove the debris)");
    }
}
