//! `bench --target torchtitan`: the conversion against `cp -r` of what it writes (a float32 seed
//! has twice the bytes of a bf16 release, so a copy of the input is the wrong yardstick), and,
//! side by side, torchtitan's own converter on the same release.
//!
//! * **Output copy.** After each conversion its `step-0/` is copied with `cp -r` (and once more
//!   made durable with `sync`), from the page cache as the input copy is; then deleted.
//! * **Model flavor.** `--model-flavor qwen3:1.7B` benchmarks the release of a torchtitan model
//!   flavor: its dimensions are read from the installed torchtitan (`--torch-python`), which
//!   builds the flavor on the meta device (no memory), and `shardline synth --config` writes a
//!   release with exactly those dimensions. The release is checked against the names and shapes
//!   the flavor's own state-dict adapter asks for (`to_hf`), so a torchtitan whose flavor has
//!   changed is reported rather than benchmarked on the wrong model.
//! * **Reference.** `--reference-script convert_from_hf.py` runs torchtitan's
//!   `scripts/checkpoint_conversion/convert_from_hf.py` (unchanged, from a torchtitan checkout of
//!   the installed version) on the same release with that flavor, timed from start to exit
//!   (interpreter start and `import torch` included, as a user runs it). Its peak RSS is the
//!   kernel's high-water mark, `getrusage(RUSAGE_SELF).ru_maxrss` (and its children's), read in
//!   the script's own process by a small runner that executes it with `runpy` as `__main__`:
//!   exact (the figure `wait4` or `/usr/bin/time -f %M` report, where polling `/proc` could miss a
//!   short peak), without GNU time installed, and without the `unsafe` a `wait4` from Rust would
//!   need (the workspace denies it).

use std::fmt;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};
use serde_json::{json, Map, Value};
use shardline_formats::checkpoint::TORCHTITAN_SEED_DIR;
use shardline_formats::safetensors::Release;

use crate::bench_training::{dir_bytes, time_copies};
use crate::convert::{time_command, BenchArgs, Target};
use crate::report::bytes;

/// A torchtitan model flavor, `NAME:FLAVOR` as `convert_from_hf.py --model_name NAME
/// --model_flavor FLAVOR` takes them.
#[derive(Clone, Debug)]
pub struct ModelFlavor {
    pub name: String,
    pub flavor: String,
}

/// The torchtitan models whose dense flavors can be benchmarked, with the `model_type` of their
/// HF releases.
const MODEL_TYPES: &[(&str, &str)] = &[("qwen3", "qwen3"), ("llama3", "llama")];

pub fn parse_model_flavor(s: &str) -> Result<ModelFlavor, String> {
    let known = || MODEL_TYPES.iter().map(|(n, _)| *n).collect::<Vec<_>>().join(", ");
    let Some((name, flavor)) = s.split_once(':').filter(|(n, f)| !n.is_empty() && !f.is_empty()) else {
        return Err(format!("`{s}`: expected NAME:FLAVOR, e.g. qwen3:1.7B"));
    };
    if !MODEL_TYPES.iter().any(|(n, _)| *n == name) {
        return Err(format!("`{name}`: the torchtitan models benchmarked are {}", known()));
    }
    Ok(ModelFlavor { name: name.to_string(), flavor: flavor.to_string() })
}

impl ModelFlavor {
    /// The `model_type` of the flavor's HF release.
    pub fn model_type(&self) -> &'static str {
        MODEL_TYPES.iter().find(|(n, _)| *n == self.name).map_or("", |(_, t)| *t)
    }
}

impl fmt::Display for ModelFlavor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.name, self.flavor)
    }
}

/// Reads a flavor from the installed torchtitan: the HF config fields of its dimensions and the
/// tensors (HF names and shapes) `convert_from_hf.py` loads for it, as JSON on stdout.
const FLAVOR_PY: &str = r#"
import importlib, json, sys
import torch
name, flavor = sys.argv[1], sys.argv[2]
spec = importlib.import_module(f"torchtitan.models.{name}").model_registry(flavor)
with torch.device("meta"):
    model = spec.model.build()
layers = list(model.layers.values()) if hasattr(model.layers, "values") else list(model.layers)
if getattr(layers[0], "moe", None) is not None:
    sys.exit(f"{name} {flavor} has routed experts: only dense flavors are benchmarked")
attention = layers[0].attention
vocab, dim = model.tok_embeddings.weight.shape
hf = spec.state_dict_adapter(spec.model, None).to_hf(model.state_dict())
print(json.dumps({
    "config": {
        "hidden_size": dim, "num_hidden_layers": len(layers), "vocab_size": vocab,
        "num_attention_heads": attention.n_heads, "num_key_value_heads": attention.n_kv_heads,
        "head_dim": attention.head_dim,
        "intermediate_size": layers[0].feed_forward.w1.weight.shape[0],
    },
    "tensors": {k: list(v.shape) for k, v in hf.items()},
}))
"#;

/// The release of `flavor`, synthesized under `--work` the first time with its exact dimensions
/// and checked against what torchtitan will load from it.
pub fn flavor_release(exe: &Path, args: &BenchArgs, flavor: &ModelFlavor) -> Result<PathBuf> {
    let python = args.torch_python.as_deref().context("--model-flavor reads the flavor with --torch-python")?;
    let script = write_script(&args.work, "torchtitan-flavor.py", FLAVOR_PY)?;
    let (_, stdout) = time_command(Command::new(python).arg(&script).args([&flavor.name, &flavor.flavor]))
        .with_context(|| format!("reading torchtitan's {flavor} with {}", python.display()))?;
    let last = stdout.lines().last().unwrap_or_default();
    let read: Value = serde_json::from_str(last).context("parsing the flavor's dimensions")?;
    let mut config = read["config"].as_object().cloned().context("the flavor's dimensions")?;
    config.insert("model_type".into(), json!(flavor.model_type()));

    let src = args.work.join(format!("torchtitan-{}-{}", flavor.name, flavor.flavor));
    if !src.join("config.json").exists() {
        let config_path = args.work.join(format!("torchtitan-{}-{}.config.json", flavor.name, flavor.flavor));
        std::fs::write(&config_path, Value::Object(config).to_string())
            .with_context(|| format!("writing {}", config_path.display()))?;
        eprintln!("generating torchtitan {flavor}'s release at {} …", src.display());
        time_command(Command::new(exe).arg("synth").arg("--config").arg(&config_path).arg(&src))?;
    }
    check_release(&src, flavor, read["tensors"].as_object().context("the flavor's tensors")?)?;
    Ok(src)
}

/// Writes one of this module's Python programs to `DIR/NAME` (so that a failure names a file,
/// not the whole program).
fn write_script(dir: &Path, name: &str, text: &str) -> Result<PathBuf> {
    let path = dir.join(name);
    std::fs::write(&path, text.trim_start()).with_context(|| format!("writing {}", path.display()))?;
    Ok(path)
}

/// Fails unless the release at `src` has every tensor of `tensors` with its shape.
fn check_release(src: &Path, flavor: &ModelFlavor, tensors: &Map<String, Value>) -> Result<()> {
    let release = Release::open(src).with_context(|| format!("opening {}", src.display()))?;
    let shapes: std::collections::HashMap<&str, &[u64]> =
        release.tensors().map(|t| (t.info.name.as_str(), t.info.shape.as_slice())).collect();
    for (name, shape) in tensors {
        let want: Vec<u64> = shape.as_array().map(|s| s.iter().filter_map(Value::as_u64).collect()).unwrap_or_default();
        if shapes.get(name.as_str()) != Some(&want.as_slice()) {
            bail!(
                "{} is not torchtitan {flavor}'s release: {name} is {:?} there, {want:?} in the flavor; remove it to \
                 generate it again",
                src.display(),
                shapes.get(name.as_str())
            );
        }
    }
    Ok(())
}

/// Best times of `cp -r` of the converted `step-0/`, and its bytes.
pub struct OutputCopies {
    cp: f64,
    cp_sync: f64,
    bytes: u64,
}

impl Default for OutputCopies {
    fn default() -> Self {
        OutputCopies { cp: f64::MAX, cp_sync: f64::MAX, bytes: 0 }
    }
}

impl OutputCopies {
    /// Copies the seed of the checkpoint at `out` to `copy` (removed again), when `target` is
    /// torchtitan.
    pub fn measure(&mut self, target: Target, out: &Path, copy: &Path) -> Result<()> {
        if target != Target::Torchtitan {
            return Ok(());
        }
        let seed = out.join(TORCHTITAN_SEED_DIR);
        let (cp, cp_sync) = time_copies(&seed, copy, 1)?;
        (self.cp, self.cp_sync, self.bytes) = (self.cp.min(cp), self.cp_sync.min(cp_sync), dir_bytes(&seed));
        Ok(())
    }

    /// The JSON fields of a conversion that took `convert` seconds, if measured.
    pub fn fields(&self, convert: f64) -> Map<String, Value> {
        if self.bytes == 0 {
            return Map::new();
        }
        let fields = json!({
            "output_file_bytes": self.bytes, "output_cp_seconds": self.cp, "output_cp_sync_seconds": self.cp_sync,
            "ratio_to_output_cp": convert / self.cp, "ratio_to_output_cp_sync": convert / self.cp_sync,
        });
        fields.as_object().cloned().unwrap_or_default()
    }

    pub fn print(&self, convert: f64) {
        if self.bytes > 0 {
            println!(
                "  output {} ({TORCHTITAN_SEED_DIR}/): cp -r {:.2}s, cp -r + fsync {:.2}s → convert {:.2}× cp -r of the \
                 output, {:.2}× cp -r + fsync",
                bytes(self.bytes),
                self.cp,
                self.cp_sync,
                convert / self.cp,
                convert / self.cp_sync
            );
        }
    }
}

/// Runs a script as `__main__` (`sys.argv[1]`, its arguments after `sys.argv[2]`), then writes
/// its process's peak RSS in KiB (Linux's `ru_maxrss`; its children's if larger) to the file
/// `sys.argv[2]`.
const RUNNER_PY: &str = r#"
import os, resource, runpy, sys
script, rss_out = sys.argv[1], sys.argv[2]
sys.argv = [script] + sys.argv[3:]
sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python SCRIPT` sets it
try:
    runpy.run_path(script, run_name="__main__")
finally:
    peak = max(resource.getrusage(who).ru_maxrss for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    with open(rss_out, "w") as f:
        f.write(str(peak))
"#;

/// Best time, largest peak RSS and output bytes of torchtitan's converter.
pub struct Reference {
    seconds: f64,
    peak_rss: u64,
    output_bytes: u64,
}

impl Reference {
    /// `repeat` runs of `script` converting `src` as `flavor` into `--work`, each output
    /// removed after it is measured.
    pub fn run(args: &BenchArgs, script: &Path, flavor: &ModelFlavor, src: &Path) -> Result<Reference> {
        let python = args.torch_python.as_deref().context("--reference-script runs with --torch-python")?;
        let (out, rss_file) = (args.work.join("reference-converted"), args.work.join("reference-peak-rss"));
        let runner = write_script(&args.work, "reference-runner.py", RUNNER_PY)?;
        let mut best = Reference { seconds: f64::MAX, peak_rss: 0, output_bytes: 0 };
        for _ in 0..args.repeat.max(1) {
            let _ = std::fs::remove_dir_all(&out);
            eprintln!("running {} {flavor} …", script.display());
            let (t, _) =
                time_command(Command::new(python).arg(&runner).arg(script).arg(&rss_file).arg(src).arg(&out).args([
                    "--model_name",
                    &flavor.name,
                    "--model_flavor",
                    &flavor.flavor,
                ]))
                .with_context(|| format!("running torchtitan's {}", script.display()))?;
            let kib: u64 = std::fs::read_to_string(&rss_file)
                .with_context(|| format!("reading {}", rss_file.display()))?
                .trim()
                .parse()
                .context("the reference's peak RSS")?;
            best.seconds = best.seconds.min(t);
            best.peak_rss = best.peak_rss.max(kib * 1024);
            best.output_bytes = dir_bytes(&out);
            let _ = std::fs::remove_dir_all(&out);
        }
        let _ = std::fs::remove_file(&rss_file);
        Ok(best)
    }

    pub fn fields(&self, script: &Path, flavor: &ModelFlavor, convert: f64) -> Map<String, Value> {
        let fields = json!({"reference": {
            "script": script.display().to_string(), "model_flavor": flavor.to_string(), "seconds": self.seconds,
            "peak_rss_bytes": self.peak_rss, "output_file_bytes": self.output_bytes,
            "ratio_to_convert": self.seconds / convert,
        }});
        fields.as_object().cloned().unwrap_or_default()
    }

    pub fn print(&self, script: &Path, flavor: &ModelFlavor, convert: f64) {
        let name = script.file_name().map_or_else(|| script.display().to_string(), |n| n.to_string_lossy().into());
        println!(
            "  torchtitan {name} {flavor}: {:.2}s ({:.2}× Shardline's convert), peak RSS {}; wrote {}",
            self.seconds,
            self.seconds / convert,
            bytes(self.peak_rss),
            bytes(self.output_bytes)
        );
    }
}
