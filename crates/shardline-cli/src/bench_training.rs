//! `bench --training`: `reshard` and `export` of a training checkpoint (a synthetic release
//! converted with optimizer state) against `cp -r` of the same bytes, side by side, and their
//! peak memory; with `--target torch_dist`, also its translation to a Megatron-LM `torch_dist`
//! save directory and back.

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

use anyhow::{Context, Result};
use serde_json::json;

use crate::convert::{time_command, BenchArgs, Target};
use crate::report::bytes;
use crate::reshard::parse_mesh;

/// Bytes of the regular files under `dir`, subdirectories included (a save directory).
pub(crate) fn dir_bytes(dir: &Path) -> u64 {
    let Ok(entries) = std::fs::read_dir(dir) else { return 0 };
    entries
        .flatten()
        .filter_map(|e| {
            let m = e.metadata().ok()?;
            Some(if m.is_dir() { dir_bytes(&e.path()) } else { m.len() })
        })
        .sum()
}

/// Best of `repeat` runs of `cp -r SRC COPY` and of the same made durable: `(cp, cp + fsync)`.
pub(crate) fn time_copies(src: &Path, copy: &Path, repeat: usize) -> Result<(f64, f64)> {
    let (mut cp, mut cp_sync) = (f64::MAX, f64::MAX);
    for _ in 0..repeat {
        let _ = std::fs::remove_dir_all(copy);
        cp = cp.min(time_command(Command::new("cp").arg("-r").arg(src).arg(copy))?.0);
        let _ = std::fs::remove_dir_all(copy);
        let script = format!("cp -r '{}' '{}' && sync '{}'/*", src.display(), copy.display(), copy.display());
        cp_sync = cp_sync.min(time_command(Command::new("sh").arg("-c").arg(script))?.0);
        let _ = std::fs::remove_dir_all(copy);
    }
    Ok((cp, cp_sync))
}

/// Best time and largest peak RSS of `repeat` runs of `cmd(out)`, removing `out` after each.
fn time_runs(repeat: usize, out: &Path, mut cmd: impl FnMut() -> Command) -> Result<(f64, u64)> {
    let (mut best, mut rss) = (f64::MAX, 0u64);
    for _ in 0..repeat {
        let _ = std::fs::remove_dir_all(out);
        let (t, stdout) = time_command(&mut cmd())?;
        let v: serde_json::Value = serde_json::from_str(stdout.trim()).context("parsing --json output")?;
        best = best.min(t);
        rss = rss.max(v["peak_rss_bytes"].as_u64().unwrap_or(0));
        let _ = std::fs::remove_dir_all(out);
    }
    Ok((best, rss))
}

/// The translation of the training checkpoint `ckpt` to `torch_dist` on `target`, and of that
/// back to `fsdp_dtensor` on the source mesh, each against `cp -r` of what it reads.
fn time_translations(
    args: &BenchArgs,
    exe: &Path,
    ckpt: &Path,
    target: shardline_layout::Mesh,
    (cp, cp_sync): (f64, f64),
    repeat: usize,
) -> Result<serde_json::Value> {
    let from = args.mesh.mesh();
    let mesh_args = |m: shardline_layout::Mesh| {
        ["--tp", "--cp", "--dp", "--ep", "--etp"]
            .into_iter()
            .zip([m.tp, m.cp, m.dp, m.ep, m.etp].map(|n| n.to_string()))
            .flat_map(|(k, v)| [k.to_string(), v])
            .collect::<Vec<_>>()
    };
    let (td, back, copy) = (args.work.join("torch-dist"), args.work.join("translated-back"), args.work.join("cp-copy"));
    let reshard = |src: &Path, out: &Path, m: shardline_layout::Mesh, dialect: &str| {
        let mut c = Command::new(exe);
        c.args(["reshard", "--json"]).arg(src).arg("--to").arg(out).args(mesh_args(m)).args(["--target", dialect]);
        c
    };
    let (to_td, to_td_rss) = time_runs(repeat, &td, || reshard(ckpt, &td, target, "torch_dist"))?;
    // The torch_dist checkpoint kept once more, to translate it back and to copy it.
    let _ = std::fs::remove_dir_all(&td);
    time_command(&mut reshard(ckpt, &td, target, "torch_dist"))?;
    let td_bytes = dir_bytes(&td);
    let (td_cp, td_cp_sync) = time_copies(&td, &copy, repeat)?;
    let (to_fsdp, to_fsdp_rss) = time_runs(repeat, &back, || reshard(&td, &back, from, "fsdp_dtensor"))?;
    let _ = std::fs::remove_dir_all(&td);
    if !args.json {
        // It writes more than it reads (the model beside its fp32 masters), so also against a
        // copy of what it writes.
        println!(
            "  translate → torch_dist on {target} ({}): {to_td:.2}s → {:.2}× cp -r of the checkpoint, {:.2}× cp -r + fsync; \
             {:.2}× cp -r of what it writes, {:.2}× cp -r + fsync; peak RSS {}",
            bytes(td_bytes),
            to_td / cp,
            to_td / cp_sync,
            to_td / td_cp,
            to_td / td_cp_sync,
            bytes(to_td_rss)
        );
        println!(
            "  translate back → fsdp_dtensor on {from}: {to_fsdp:.2}s → {:.2}× cp -r of the torch_dist checkpoint \
             ({td_cp:.2}s), {:.2}× cp -r + fsync; peak RSS {}",
            to_fsdp / td_cp,
            to_fsdp / td_cp_sync,
            bytes(to_fsdp_rss)
        );
    }
    Ok(json!({
        "arch": args.arch, "translate": "torch_dist", "from": from.to_string(), "to": target.to_string(),
        "torch_dist_bytes": td_bytes,
        "to_torch_dist_seconds": to_td, "to_torch_dist_ratio_to_cp": to_td / cp,
        "to_torch_dist_ratio_to_cp_sync": to_td / cp_sync, "to_torch_dist_peak_rss_bytes": to_td_rss,
        "to_torch_dist_ratio_to_output_cp": to_td / td_cp, "to_torch_dist_ratio_to_output_cp_sync": to_td / td_cp_sync,
        "torch_dist_cp_seconds": td_cp, "torch_dist_cp_sync_seconds": td_cp_sync,
        "to_fsdp_dtensor_seconds": to_fsdp, "to_fsdp_dtensor_ratio_to_cp": to_fsdp / td_cp,
        "to_fsdp_dtensor_ratio_to_cp_sync": to_fsdp / td_cp_sync, "to_fsdp_dtensor_peak_rss_bytes": to_fsdp_rss,
    }))
}

pub fn run_training_bench(args: &BenchArgs, to: &str) -> Result<ExitCode> {
    let exe = std::env::current_exe().context("locating the shardline binary")?;
    let from = args.mesh.mesh();
    let target = parse_mesh(to)?;
    std::fs::create_dir_all(&args.work).with_context(|| format!("creating {}", args.work.display()))?;
    let repeat = args.repeat.max(1);
    let mut rows = Vec::new();
    for size in &args.sizes {
        let release = args.work.join(format!("{}-{size}", args.arch));
        if !release.join("config.json").exists() {
            eprintln!("generating {} {size} at {} …", args.arch, release.display());
            time_command(Command::new(&exe).args(["synth", "--arch", &args.arch, "--size", size]).arg(&release))?;
        }
        // The training checkpoint: parameters and two float32 moments per parameter.
        let ckpt: PathBuf = args.work.join(format!("{}-{size}-training-{}", args.arch, from).replace('·', "-"));
        if !ckpt.join(".metadata").exists() {
            eprintln!("converting it with optimizer state on {from} …");
            time_command(
                Command::new(&exe)
                    .args(["convert", "--json", "--optimizer-state", "--from"])
                    .arg(&release)
                    .arg("--to")
                    .arg(&ckpt)
                    .args(["--tp", &from.tp.to_string(), "--cp", &from.cp.to_string(), "--dp", &from.dp.to_string()])
                    .args(["--ep", &from.ep.to_string(), "--etp", &from.etp.to_string()]),
            )?;
        }
        let (ckpt_bytes, release_bytes) = (dir_bytes(&ckpt), dir_bytes(&release));
        let copy = args.work.join("cp-copy");
        let out = args.work.join("resharded");
        let hf = args.work.join("exported");
        let (cp, cp_sync) = time_copies(&ckpt, &copy, repeat)?;
        let from_mesh = format!("tp={},cp={},dp={},ep={},etp={}", from.tp, from.cp, from.dp, from.ep, from.etp);
        let (reshard, reshard_rss) = time_runs(repeat, &out, || {
            let mut c = Command::new(&exe);
            c.args(["reshard", "--json"]).arg(&ckpt).arg("--to").arg(&out);
            c.args(["--tp", &target.tp.to_string(), "--cp", &target.cp.to_string(), "--dp", &target.dp.to_string()]);
            c.args(["--ep", &target.ep.to_string(), "--etp", &target.etp.to_string(), "--from-mesh", &from_mesh]);
            c
        })?;
        if args.target == Target::TorchDist {
            rows.push(time_translations(args, &exe, &ckpt, target, (cp, cp_sync), repeat)?);
        }
        let (release_cp, release_cp_sync) = time_copies(&release, &copy, repeat)?;
        let (export, export_rss) = time_runs(repeat, &hf, || {
            let mut c = Command::new(&exe);
            c.args(["export", "--json"]).arg(&ckpt).arg("--to").arg(&hf).arg("--like").arg(&release);
            c.args(["--etp", &from.etp.to_string()]);
            c
        })?;
        rows.push(json!({
            "arch": args.arch, "size": size, "from": from.to_string(), "to": target.to_string(),
            "checkpoint_bytes": ckpt_bytes, "release_bytes": release_bytes,
            "cp_seconds": cp, "cp_sync_seconds": cp_sync, "reshard_seconds": reshard,
            "reshard_ratio_to_cp": reshard / cp, "reshard_ratio_to_cp_sync": reshard / cp_sync,
            "reshard_peak_rss_bytes": reshard_rss,
            "release_cp_seconds": release_cp, "release_cp_sync_seconds": release_cp_sync, "export_seconds": export,
            "export_ratio_to_cp": export / release_cp, "export_ratio_to_cp_sync": export / release_cp_sync,
            "export_ratio_to_checkpoint_cp": export / cp, "export_ratio_to_checkpoint_cp_sync": export / cp_sync,
            "export_peak_rss_bytes": export_rss,
        }));
        if !args.json {
            println!(
                "{} {size}: training checkpoint {} on {from} → {target}: cp -r {cp:.2}s, cp -r + fsync {cp_sync:.2}s, \
                 reshard {reshard:.2}s → {:.2}× cp -r, {:.2}× cp -r + fsync; peak RSS {}",
                args.arch,
                bytes(ckpt_bytes),
                reshard / cp,
                reshard / cp_sync,
                bytes(reshard_rss)
            );
            // Against the checkpoint's copy (the figure reshard is held to) and, stricter, against
            // a copy of the release it writes: export reads the float32 master weights, twice
            // the release's bytes, so that ratio cannot fall much below 1.5.
            println!(
                "  export → HF ({}): export {export:.2}s → {:.2}× cp -r of the checkpoint, {:.2}× cp -r + fsync; \
                 against cp -r of the release {release_cp:.2}s, + fsync {release_cp_sync:.2}s: {:.2}×, {:.2}×; \
                 peak RSS {}",
                bytes(release_bytes),
                export / cp,
                export / cp_sync,
                export / release_cp,
                export / release_cp_sync,
                bytes(export_rss)
            );
        }
    }
    if args.json {
        println!("{}", serde_json::Value::Array(rows));
    }
    Ok(ExitCode::SUCCESS)
}
