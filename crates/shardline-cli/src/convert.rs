//! `convert`, `synth` and `bench`.

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::{Args, ValueEnum};
use serde_json::json;
use shardline_formats::checkpoint::TORCHTITAN_SEED_DIR;
use shardline_formats::execute::{ExecuteOptions, OutputFormat, Progress};
use shardline_formats::safetensors::Release;
use shardline_formats::training::save_dir;
use shardline_layout::{DType, Dialect, Mesh, Plan, TorchtitanTarget, TorchtitanVersion};
use shardline_ops::{convert, plan_release, ConvertRequest};

use shardline_synth::{Arch as SynthArch, SynthModel, WeightFormat};

use crate::report::{bytes, peak_rss, Bar};

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum Format {
    /// PyTorch DCP: `.metadata` + `__<rank>_0.distcp` (what Megatron `fsdp_dtensor` loads).
    Dcp,
    /// DCP-sharded safetensors with `DCP_SHARDING_INFO` (torch ≥ 2.9 HuggingFaceStorageReader).
    DcpSafetensors,
}

/// The checkpoint dialect `convert` writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Target {
    #[value(name = "fsdp_dtensor")]
    FsdpDtensor,
    #[value(name = "torch_dist")]
    TorchDist,
    #[value(name = "torchtitan")]
    Torchtitan,
}

impl Target {
    /// The dialect, torchtitan's with its default version and dtype (see [`TorchtitanArgs`]).
    pub fn dialect(self) -> Dialect {
        match self {
            Target::FsdpDtensor => Dialect::FsdpDtensor,
            Target::TorchDist => Dialect::TorchDist,
            Target::Torchtitan => Dialect::Torchtitan(TorchtitanTarget::default()),
        }
    }
}

/// What `--target torchtitan` writes for.
#[derive(Args, Clone, Debug)]
pub struct TorchtitanArgs {
    /// The torchtitan whose native key names to write, a row per 2026 rename, by date or commit:
    /// `main` (also `0.3.0`, 3101b42f9: `routed_experts.inner_experts.w1_EFD`), `2026-05-27`
    /// (200100e7d: `moe.experts.w1_EFD`, `expert_bias_E`), `2026-04-27` (786e26f8e: `lm_head`),
    /// `2026-04-16` (ad7a86533: `qkv_linear`) or `2025-12` (also `0.2.2`: `attention.wq`,
    /// `output`, `moe.experts.w1`). Default: main.
    #[arg(long, value_parser = parse_torchtitan_version)]
    pub torchtitan_version: Option<TorchtitanVersion>,
    /// The parameters' dtype with --target torchtitan: float32 (torchtitan's training and seed
    /// dtype, the default) or bfloat16.
    #[arg(long, value_parser = parse_seed_dtype)]
    pub dtype: Option<DType>,
}

impl TorchtitanArgs {
    pub fn target(&self) -> TorchtitanTarget {
        let default = TorchtitanTarget::default();
        TorchtitanTarget {
            version: self.torchtitan_version.unwrap_or(default.version),
            dtype: self.dtype.unwrap_or(default.dtype),
        }
    }

    /// Whether either was given (they mean nothing to another target).
    pub fn given(&self) -> bool {
        self.torchtitan_version.is_some() || self.dtype.is_some()
    }
}

fn parse_torchtitan_version(s: &str) -> Result<TorchtitanVersion, String> {
    TorchtitanVersion::parse(s).ok_or_else(|| {
        let known: Vec<&str> = TorchtitanVersion::NAMES.iter().map(|(n, _)| *n).collect();
        format!("unknown torchtitan version `{s}` (known: {})", known.join(", "))
    })
}

fn parse_seed_dtype(s: &str) -> Result<DType, String> {
    match s {
        "float32" | "fp32" => Ok(DType::F32),
        "bfloat16" | "bf16" => Ok(DType::BF16),
        _ => Err(format!("`{s}`: the seed's dtype is float32 or bfloat16")),
    }
}

/// The target mesh, shared by every command that plans.
#[derive(Args, Clone, Debug)]
pub struct MeshArgs {
    /// Tensor-parallel size.
    #[arg(long, default_value_t = 1)]
    pub tp: u64,
    /// Context-parallel size (folded into the FSDP shard group).
    #[arg(long, default_value_t = 1)]
    pub cp: u64,
    /// Data-parallel (FSDP) size.
    #[arg(long, default_value_t = 1)]
    pub dp: u64,
    /// Expert-parallel size.
    #[arg(long, default_value_t = 1)]
    pub ep: u64,
    /// Expert tensor-parallel size (default: tp).
    #[arg(long)]
    pub etp: Option<u64>,
}

impl MeshArgs {
    pub fn mesh(&self) -> Mesh {
        Mesh { tp: self.tp, cp: self.cp, dp: self.dp, ep: self.ep, etp: self.etp.unwrap_or(self.tp) }
    }
}

#[derive(Args, Debug)]
pub struct ConvertArgs {
    /// HF release directory (config.json, *.safetensors, index).
    #[arg(long = "from", value_name = "HF_DIR")]
    pub from: PathBuf,
    /// Output checkpoint directory.
    #[arg(long = "to", value_name = "OUT_DIR", required_unless_present = "dry_run")]
    pub to: Option<PathBuf>,
    #[command(flatten)]
    pub mesh: MeshArgs,
    #[arg(long, value_enum, default_value = "dcp")]
    pub format: Format,
    /// The checkpoint dialect: Megatron-FSDP's `fsdp_dtensor`, or Megatron-LM's default
    /// `torch_dist` (a save directory: the tracker and `release/` with the DCP files,
    /// `common.pt` and `metadata.json`).
    #[arg(long, value_enum, default_value = "fsdp_dtensor")]
    pub target: Target,
    #[command(flatten)]
    pub torchtitan: TorchtitanArgs,
    /// Prefix of every model key (default: `model.module.` for fsdp_dtensor, none for torch_dist).
    #[arg(long)]
    pub prefix: Option<String>,
    /// Pad the vocab to a multiple of this times tp (Megatron's --make-vocab-size-divisible-by).
    #[arg(long, default_value_t = 128)]
    pub vocab_divisible_by: u64,
    /// Also write zero-filled fp32 Adam states (exp_avg, exp_avg_sq) sharded like their parameters.
    #[arg(long)]
    pub optimizer_state: bool,
    /// Print the plan and write nothing.
    #[arg(long)]
    pub dry_run: bool,
    /// Replace a checkpoint already in OUT_DIR.
    #[arg(long)]
    pub overwrite: bool,
    /// Writer threads (default: number of CPUs, at least 2).
    #[arg(long)]
    pub threads: Option<usize>,
    /// Compute the zip CRC-32 of every tensor item of a DCP checkpoint (slower: every byte is
    /// then read and hashed). Off, the CRC fields hold 0, as torch ≥ 2.6 writes them with
    /// `torch.serialization.config.save.compute_crc32 = False`: PyTorch's reader is built with
    /// MINIZ_DISABLE_ZIP_READER_CRC32_CHECKS and never checks them, and `shardline validate`
    /// compares every byte with the source instead.
    #[arg(long)]
    pub zip_crc32: bool,
    /// Machine-readable output on stdout.
    #[arg(long)]
    pub json: bool,
}

pub fn run(args: ConvertArgs) -> Result<ExitCode> {
    crate::malloc::map_large_buffers();
    let mesh = args.mesh.mesh();
    let dialect = match args.target {
        Target::Torchtitan => Dialect::Torchtitan(args.torchtitan.target()),
        t => t.dialect(),
    };
    if !matches!(dialect, Dialect::Torchtitan(_)) && args.torchtitan.given() {
        bail!("--dtype and --torchtitan-version apply only to --target torchtitan");
    }
    let request = ConvertRequest {
        dialect,
        format: match args.format {
            Format::Dcp => OutputFormat::Dcp,
            Format::DcpSafetensors => OutputFormat::DcpSafetensors,
        },
        prefix: args.prefix.clone(),
        vocab_divisible_by: args.vocab_divisible_by,
        optimizer_state: args.optimizer_state,
        overwrite: args.overwrite,
        threads: args.threads.unwrap_or(ExecuteOptions::default().threads),
        zip_crc32: args.zip_crc32,
        ..ConvertRequest::new(args.from.clone(), args.to.clone().unwrap_or_default(), mesh)
    };
    if args.dry_run {
        let (_, plan) = plan_release(&args.from, mesh, &request.plan_options()?)?;
        print_plan(&plan, args.json);
        return Ok(ExitCode::SUCCESS);
    }
    if args.to.is_none() {
        bail!("--to is required unless --dry-run");
    }
    let progress = Arc::new(Progress::default());
    let report = {
        let _bar = Bar::follow("convert", progress.clone());
        convert(&request, &progress, &crate::malloc::return_freed_memory)?
    };
    let (written, secs) = (&report.written, report.seconds);
    let rss = peak_rss().unwrap_or(0);
    if args.json {
        println!(
            "{}",
            json!({
                "model_type": report.model_type, "mesh": mesh.to_string(), "world": report.world,
                "files": written.files.len(), "chunks": written.chunks, "tensor_bytes": written.tensor_bytes,
                "file_bytes": written.file_bytes, "kernel_copy_bytes": written.kernel_copy_bytes,
                "seconds": secs, "peak_rss_bytes": rss,
                "source_bytes": report.source_bytes, "unconverted": report.unconverted,
            })
        );
    } else {
        println!(
            "wrote {} ({} chunks, {} files) for {} at {} in {:.2}s ({}/s), peak RSS {}",
            bytes(written.file_bytes),
            written.chunks,
            written.files.len(),
            mesh,
            report.out.display(),
            secs,
            bytes((written.tensor_bytes as f64 / secs.max(1e-9)) as u64),
            bytes(rss)
        );
        report_unconverted(&report.unconverted);
    }
    Ok(ExitCode::SUCCESS)
}

fn report_unconverted(unconverted: &[String]) {
    if !unconverted.is_empty() {
        eprintln!("note: {} release tensor(s) not converted, by design:", unconverted.len());
        for n in unconverted.iter().take(20) {
            eprintln!("  {n} ({})", shardline_layout::arch::why_not_converted(n));
        }
        if unconverted.len() > 20 {
            eprintln!("  … and {} more", unconverted.len() - 20);
        }
    }
}

fn print_plan(plan: &Plan, as_json: bool) {
    let per_rank = plan.bytes_per_rank();
    if as_json {
        let tensors: Vec<_> = plan
            .tensors
            .iter()
            .map(|t| {
                json!({
                    "key": t.key, "dtype": t.dtype.to_string(), "shape": t.shape,
                    "split_from": t.split_from().map(|s| s.0),
                    "chunks": t.chunks(&plan.mesh).filter(|c| c.written && c.numel() > 0)
                        .map(|c| json!({"rank": c.rank, "offsets": c.offsets, "sizes": c.sizes})).collect::<Vec<_>>(),
                })
            })
            .collect();
        println!(
            "{}",
            json!({"model_type": plan.model_type, "mesh": plan.mesh.to_string(), "world": plan.world(),
                   "bytes_per_rank": per_rank, "tensors": tensors, "unconverted": plan.unconverted})
        );
        return;
    }
    println!("plan for `{}` on {} ({} ranks)", plan.model_type, plan.mesh, plan.world());
    println!("{:<90} {:>6} {:>18}  split from", "key", "dtype", "global shape");
    for t in &plan.tensors {
        let split = t.split_from().map(|s| format!("{} ({}/{})", s.0, s.1 + 1, s.2)).unwrap_or_default();
        println!("{:<90} {:>6} {:>18}  {split}", t.key, t.dtype.to_string(), format!("{:?}", t.shape));
    }
    println!("\nbytes per rank:");
    for (r, b) in per_rank.iter().enumerate() {
        println!("  rank {r:>4}: {:>12}  ({} chunks)", bytes(*b), plan.rank_chunks(r as u64).count());
    }
    println!("total: {} in {} keys", bytes(per_rank.iter().sum()), plan.tensors.len());
    report_unconverted(&plan.unconverted);
}

#[derive(Args, Debug)]
pub struct SynthArgs {
    /// Architecture (config `model_type`), e.g. qwen3_moe.
    #[arg(long, required_unless_present = "config")]
    pub arch: Option<String>,
    /// Approximate release size in bf16, e.g. 4GB, 512MiB.
    #[arg(long, required_unless_present = "config")]
    pub size: Option<String>,
    /// Block-FP8 weights, as DeepSeek-V3 is published (only with --arch deepseek_v3): the model
    /// --size fits in bf16, its layers' projections e4m3 with 128×128 block scales, in about half
    /// the bytes.
    #[arg(long)]
    pub fp8: bool,
    /// Instead of --arch and --size: the model this `config.json` describes, with exactly its
    /// dimensions (`model_type`, `hidden_size`, `num_hidden_layers`, heads, `head_dim`, MLP and
    /// expert widths, `vocab_size`; block FP8 if it has a `quantization_config`), e.g. a real
    /// release's. The release always stores its own `lm_head.weight`.
    #[arg(long, value_name = "CONFIG_JSON", conflicts_with_all = ["arch", "size", "fp8"])]
    pub config: Option<PathBuf>,
    /// Seed of the deterministic data.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Output directory.
    pub out: PathBuf,
}

/// The weight format `--fp8` asks for, refused for architectures not published in FP8.
fn weight_format(arch: &str, fp8: bool) -> Result<WeightFormat> {
    if !fp8 {
        return Ok(WeightFormat::Bf16);
    }
    let parsed: SynthArch = arch.parse()?;
    if !parsed.supports_fp8() {
        bail!(
            "--fp8 is only for --arch deepseek_v3 (the architecture published in block FP8); \
             `{arch}` releases are written in bf16"
        );
    }
    Ok(WeightFormat::FP8)
}

pub fn run_synth(args: SynthArgs) -> Result<ExitCode> {
    let started = Instant::now();
    let model = match (&args.config, &args.arch, &args.size) {
        (Some(path), _, _) => {
            let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
            SynthModel::from_config_json(&text).with_context(|| format!("--config {}", path.display()))?
        }
        (None, Some(arch), Some(size)) => {
            let format = weight_format(arch, args.fp8)?;
            let target = shardline_units::parse_size_lenient(size)
                .map_err(|e| anyhow::anyhow!("{e} ({})", shardline_units::LENIENT_SIZE_FORMS))
                .with_context(|| format!("--size {size}"))?;
            SynthModel::for_target_as(arch.parse()?, format, target)?
        }
        _ => bail!("give --arch and --size, or --config"),
    };
    let arch = model.arch();
    let report = shardline_synth::write_release(&model, &args.out, args.seed, &Default::default(), &|_| {})
        .with_context(|| format!("writing synthetic {arch} release to {}", args.out.display()))?;
    println!(
        "wrote synthetic {arch}{} release ({}) to {} in {:.2}s",
        if model.format() == WeightFormat::Bf16 { "" } else { " FP8" },
        bytes(report.total_bytes),
        args.out.display(),
        started.elapsed().as_secs_f64()
    );
    Ok(ExitCode::SUCCESS)
}

#[derive(Args, Debug)]
pub struct BenchArgs {
    /// Architecture of the synthetic release.
    #[arg(long, default_value = "qwen3_moe")]
    pub arch: String,
    /// Release sizes to measure (repeatable), e.g. --size 1GB --size 8GB.
    #[arg(long = "size", default_values_t = vec!["4GB".to_string()])]
    pub sizes: Vec<String>,
    /// Convert block-FP8 releases (see `synth --fp8`; only with --arch deepseek_v3): the same
    /// models as without, in about half the bytes, dequantized to the same checkpoints.
    #[arg(long)]
    pub fp8: bool,
    #[command(flatten)]
    pub mesh: MeshArgs,
    /// Scratch directory (releases are cached there between runs).
    #[arg(long, default_value = "target/bench")]
    pub work: PathBuf,
    /// Timed repetitions of each command; the best is reported.
    #[arg(long, default_value_t = 2)]
    pub repeat: usize,
    /// Convert with --zip-crc32.
    #[arg(long)]
    pub zip_crc32: bool,
    /// The dialect to convert to (as `convert --target`). With `--training`, `torch_dist` also
    /// times the training checkpoint's translation to a torch_dist save directory and back;
    /// `torchtitan` also times the conversion against `cp -r` of its output (the float32 seed
    /// `step-0/`, twice a bf16 release's bytes).
    #[arg(long, value_enum, default_value = "fsdp_dtensor")]
    pub target: Target,
    /// Also time torch's `FileSystemReader(CKPT).read_metadata()` with this Python (one that has
    /// torch), next to `validate` and `inspect`; with --model-flavor, the Python with torchtitan.
    #[arg(long, value_name = "PYTHON")]
    pub torch_python: Option<PathBuf>,
    /// Instead of --arch and --size: the release of this torchtitan model flavor (`qwen3:1.7B`,
    /// `llama3:8B`: a dense flavor of `torchtitan.models.qwen3` or `.llama3`), with exactly the
    /// dimensions the torchtitan of --torch-python gives it (read from the flavor built on the
    /// meta device, and checked against the tensors its state-dict adapter loads).
    #[arg(long, value_name = "NAME:FLAVOR", value_parser = crate::bench_torchtitan::parse_model_flavor,
          requires = "torch_python", conflicts_with_all = ["arch", "sizes", "fp8"])]
    pub model_flavor: Option<crate::bench_torchtitan::ModelFlavor>,
    /// Side by side with torchtitan's own converter: this `convert_from_hf.py` (from
    /// `scripts/checkpoint_conversion/` of a torchtitan checkout matching the installed one), run
    /// by --torch-python on the same release with --model-flavor; its time and peak RSS. Only
    /// with --target torchtitan.
    #[arg(long, value_name = "PATH", requires = "model_flavor")]
    pub reference_script: Option<PathBuf>,
    /// Measure `reshard` and `export` instead: the release converted with optimizer state on the
    /// mesh, resharded to this one (`tp=1,dp=3,…`), and exported back to HF.
    #[arg(long, value_name = "MESH")]
    pub training: Option<String>,
    /// Measure S3 → S3 instead: the release put under this prefix (`s3://bucket/prefix`, the
    /// store configured from the environment), converted there with `--artifacts`, against a
    /// parallel copy of its objects through the same server.
    #[arg(long, value_name = "URL")]
    pub s3: Option<String>,
    #[arg(long)]
    pub json: bool,
}

/// Times `cmd` after flushing earlier runs' dirty pages, so no run pays for another's writeback.
pub(crate) fn time_command(cmd: &mut Command) -> Result<(f64, String)> {
    let _ = Command::new("sync").status();
    let started = Instant::now();
    let out = cmd.output().with_context(|| format!("running {cmd:?}"))?;
    let secs = started.elapsed().as_secs_f64();
    if !out.status.success() {
        bail!("{cmd:?} failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok((secs, String::from_utf8_lossy(&out.stdout).into_owned()))
}

/// The benchmark's synthetic release of `size`, generated under `--work` the first time (the
/// FP8 and bf16 releases of one model are cached side by side).
pub(crate) fn bench_release(exe: &Path, args: &BenchArgs, size: &str) -> Result<PathBuf> {
    let dir_tag = if args.fp8 { "-fp8" } else { "" };
    let src = args.work.join(format!("{}{dir_tag}-{size}", args.arch));
    if !src.join("config.json").exists() {
        eprintln!("generating {} {size} at {} …", args.arch, src.display());
        time_command(
            Command::new(exe)
                .args(["synth", "--arch", &args.arch, "--size", size])
                .args(args.fp8.then_some("--fp8"))
                .arg(&src),
        )?;
    }
    Ok(src)
}

pub fn run_bench(args: BenchArgs) -> Result<ExitCode> {
    if let Some(to) = &args.training {
        return crate::bench_training::run_training_bench(&args, to);
    }
    if let Some(url) = &args.s3 {
        return crate::bench_s3::run_s3_bench(&args, url);
    }
    if args.reference_script.is_some() && args.target != Target::Torchtitan {
        bail!("--reference-script is torchtitan's converter: use it with --target torchtitan");
    }
    if args.model_flavor.is_none() {
        weight_format(&args.arch, args.fp8)?;
    }
    let exe = std::env::current_exe().context("locating the shardline binary")?;
    let mesh = args.mesh.mesh();
    std::fs::create_dir_all(&args.work).with_context(|| format!("creating {}", args.work.display()))?;
    let (label, releases) = match &args.model_flavor {
        Some(flavor) => {
            let src = crate::bench_torchtitan::flavor_release(&exe, &args, flavor)?;
            (flavor.model_type().to_string(), vec![(flavor.flavor.clone(), src)])
        }
        None => {
            let label = if args.fp8 { format!("{} FP8", args.arch) } else { args.arch.clone() };
            (
                label,
                args.sizes
                    .iter()
                    .map(|size| Ok((size.clone(), bench_release(&exe, &args, size)?)))
                    .collect::<Result<_>>()?,
            )
        }
    };
    let mut rows = Vec::new();
    for (size, src) in &releases {
        let release = Release::open(src)?;
        let input = release.total_bytes();
        let copy = args.work.join("cp-copy");
        let out = args.work.join("converted");
        let (mut best_cp, mut best_cp_sync, mut best_conv) = (f64::MAX, f64::MAX, f64::MAX);
        let (mut rss, mut output) = (0u64, 0u64);
        let mut readers = ReaderTimes::default();
        let mut output_copies = crate::bench_torchtitan::OutputCopies::default();
        for _ in 0..args.repeat.max(1) {
            let _ = std::fs::remove_dir_all(&copy);
            let (t, _) = time_command(Command::new("cp").arg("-r").arg(src).arg(&copy))?;
            best_cp = best_cp.min(t);
            let _ = std::fs::remove_dir_all(&copy);
            // The same copy made durable, as convert makes its output durable before committing.
            let script = format!("cp -r '{}' '{}' && sync '{}'/*", src.display(), copy.display(), copy.display());
            let (t, _) = time_command(Command::new("sh").arg("-c").arg(script))?;
            best_cp_sync = best_cp_sync.min(t);
            let _ = std::fs::remove_dir_all(&copy);

            let _ = std::fs::remove_dir_all(&out);
            let (t, stdout) = time_command(
                Command::new(&exe)
                    .args(["convert", "--json", "--from"])
                    .arg(src)
                    .arg("--to")
                    .arg(&out)
                    .args(["--tp", &mesh.tp.to_string(), "--cp", &mesh.cp.to_string()])
                    .args(["--dp", &mesh.dp.to_string(), "--ep", &mesh.ep.to_string()])
                    .args(["--etp", &mesh.etp.to_string()])
                    .args(["--target", args.target.dialect().name()])
                    .args(args.zip_crc32.then_some("--zip-crc32")),
            )?;
            best_conv = best_conv.min(t);
            let v: serde_json::Value = serde_json::from_str(stdout.trim()).context("parsing convert --json")?;
            rss = rss.max(v["peak_rss_bytes"].as_u64().unwrap_or(0));
            output = v["tensor_bytes"].as_u64().unwrap_or(0);
            output_copies.measure(args.target, &out, &copy)?;
            let dcp_dir = match args.target {
                Target::TorchDist => save_dir::seed_dir(&out),
                Target::Torchtitan => out.join(TORCHTITAN_SEED_DIR),
                Target::FsdpDtensor => out.clone(),
            };
            readers.measure(&exe, &out, &dcp_dir, src, args.torch_python.as_deref())?;
            let _ = std::fs::remove_dir_all(&out);
        }
        // torchtitan's converter on the same release, once ours is removed (disk).
        let reference = match (&args.reference_script, &args.model_flavor) {
            (Some(script), Some(flavor)) => {
                Some((script, flavor, crate::bench_torchtitan::Reference::run(&args, script, flavor, src)?))
            }
            _ => None,
        };
        let mut row = json!({
            "arch": args.model_flavor.as_ref().map_or(args.arch.as_str(), |f| f.model_type()), "fp8": args.fp8,
            "size": size, "model_flavor": args.model_flavor.as_ref().map(|f| f.to_string()),
            "target": args.target.dialect().name(), "input_bytes": input, "output_bytes": output,
            "mesh": mesh.to_string(),
            "cp_seconds": best_cp, "cp_sync_seconds": best_cp_sync, "convert_seconds": best_conv,
            "ratio_to_cp": best_conv / best_cp, "ratio_to_cp_sync": best_conv / best_cp_sync,
            "convert_gb_per_s": input as f64 / best_conv / 1e9, "peak_rss_bytes": rss,
            "validate_seconds": readers.validate.0, "validate_peak_rss_bytes": readers.validate.1,
            "inspect_seconds": readers.inspect.0, "inspect_peak_rss_bytes": readers.inspect.1,
            "torch_read_metadata_seconds": readers.torch,
        });
        if let Some(fields) = row.as_object_mut() {
            fields.extend(output_copies.fields(best_conv));
            if let Some((script, flavor, r)) = &reference {
                fields.extend(r.fields(script, flavor, best_conv));
            }
        }
        rows.push(row);
        if !args.json {
            println!(
                "{label} {size} ({} → {}) on {mesh} as {}: cp -r {best_cp:.2}s, cp -r + fsync {best_cp_sync:.2}s, convert \
                 {best_conv:.2}s → {:.2}× cp -r, {:.2}× cp -r + fsync; {:.2} GB/s; peak RSS {}",
                bytes(input),
                bytes(output),
                args.target.dialect().name(),
                best_conv / best_cp,
                best_conv / best_cp_sync,
                input as f64 / best_conv / 1e9,
                bytes(rss)
            );
            println!(
                "  validate {:.2}s ({:.2}× convert), peak RSS {}; inspect --summary {:.2}s, peak RSS {}{}",
                readers.validate.0,
                readers.validate.0 / best_conv,
                bytes(readers.validate.1),
                readers.inspect.0,
                bytes(readers.inspect.1),
                readers.torch.map(|t| format!("; torch read_metadata {t:.2}s")).unwrap_or_default()
            );
            output_copies.print(best_conv);
            if let Some((script, flavor, r)) = &reference {
                r.print(script, flavor, best_conv);
            }
        }
    }
    if args.json {
        println!("{}", serde_json::Value::Array(rows));
    }
    Ok(ExitCode::SUCCESS)
}

/// Best times (seconds) and largest peak RSS of the readers of a converted checkpoint.
struct ReaderTimes {
    validate: (f64, u64),
    inspect: (f64, u64),
    torch: Option<f64>,
}

impl Default for ReaderTimes {
    fn default() -> Self {
        ReaderTimes { validate: (f64::MAX, 0), inspect: (f64::MAX, 0), torch: None }
    }
}

/// torch's own reading of `.metadata`, to compare with.
const TORCH_READ_METADATA: &str =
    "import sys; from torch.distributed.checkpoint import FileSystemReader; FileSystemReader(sys.argv[1]).read_metadata()";

impl ReaderTimes {
    /// Times the readers of `ckpt` (torch's on `dcp_dir`, the directory holding `.metadata`).
    fn measure(
        &mut self,
        exe: &Path,
        ckpt: &Path,
        dcp_dir: &Path,
        src: &Path,
        torch_python: Option<&Path>,
    ) -> Result<()> {
        let (t, stdout) =
            time_command(Command::new(exe).args(["validate", "--json"]).arg(ckpt).arg("--against").arg(src))?;
        let v: serde_json::Value = serde_json::from_str(stdout.trim()).context("parsing validate --json")?;
        if v["ok"] != true {
            bail!("validate of the benchmark's checkpoint failed: {v}");
        }
        self.validate = (self.validate.0.min(t), self.validate.1.max(v["peak_rss_bytes"].as_u64().unwrap_or(0)));
        let (t, stdout) = time_command(Command::new(exe).args(["inspect", "--json", "--summary"]).arg(ckpt))?;
        let v: serde_json::Value = serde_json::from_str(stdout.trim()).context("parsing inspect --json")?;
        self.inspect = (self.inspect.0.min(t), self.inspect.1.max(v["peak_rss_bytes"].as_u64().unwrap_or(0)));
        if let Some(py) = torch_python {
            let (t, _) = time_command(Command::new(py).args(["-c", TORCH_READ_METADATA]).arg(dcp_dir))?;
            self.torch = Some(self.torch.map_or(t, |b: f64| b.min(t)));
        }
        Ok(())
    }
}
