//! `reshard`: a checkpoint with optimizer state, written on one mesh, re-tiled for another must be
//! what `convert` writes for that mesh — same keys, shapes, dtypes and chunk boxes, and the same
//! bytes (validated against the release) — and a round trip must give back the original files.
//! Bad input fails before anything is written.

use std::collections::BTreeMap;
use std::path::Path;

use serde_json::Value;
use shardline_formats::dcp_metadata::{decode_metadata, encode_metadata, EntryMeta};

use crate::{bin, convert, fixture, run, stderr, stdout};

type Mesh = (u64, u64, u64, u64, u64);

fn mesh_args(m: Mesh) -> Vec<String> {
    let (tp, cp, dp, ep, etp) = m;
    [("--tp", tp), ("--cp", cp), ("--dp", dp), ("--ep", ep), ("--etp", etp)]
        .iter()
        .flat_map(|(k, v)| [k.to_string(), v.to_string()])
        .collect()
}

fn convert_at(name: &str, out: &Path, m: Mesh) {
    let (tp, cp, dp, ep, etp) = m;
    convert(&fixture(name), out, (tp, cp, dp, ep), &["--optimizer-state", "--etp", &etp.to_string()]);
}

fn reshard(src: &Path, out: &Path, m: Mesh, extra: &[&str]) -> std::process::Output {
    run(bin().arg("reshard").arg(src).arg("--to").arg(out).args(mesh_args(m)).args(extra))
}

/// key → (dtype, shape, sorted chunk boxes).
fn layout_of(dir: &Path) -> BTreeMap<String, (String, Value, Vec<String>)> {
    let o = run(bin().arg("inspect").arg(dir).arg("--json"));
    assert!(o.status.success(), "{}", stderr(&o));
    let v: Value = serde_json::from_str(&stdout(&o)).expect("inspect json");
    v["tensors"]
        .as_array()
        .expect("tensors")
        .iter()
        .map(|t| {
            let mut chunks: Vec<String> =
                t["chunks"].as_array().expect("chunks").iter().map(|c| c.to_string()).collect();
            chunks.sort();
            (t["key"].as_str().unwrap_or_default().to_string(), (t["dtype"].to_string(), t["shape"].clone(), chunks))
        })
        .collect()
}

fn validate(dir: &Path, name: &str, etp: u64) {
    let o = run(bin().arg("validate").arg(dir).arg("--against").arg(fixture(name)).args(["--etp", &etp.to_string()]));
    assert!(o.status.success(), "validate {}: {}{}", dir.display(), stdout(&o), stderr(&o));
}

#[test]
fn reshard_gives_what_convert_writes_for_the_target_mesh() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let cases: &[(&str, Mesh, Mesh)] = &[
        ("qwen3_moe", (1, 1, 4, 2, 1), (2, 1, 3, 2, 1)),
        ("qwen3_moe", (2, 1, 2, 1, 2), (1, 1, 8, 4, 1)),
        ("llama", (2, 1, 4, 1, 2), (1, 2, 3, 1, 1)),
        ("deepseek_v3", (1, 1, 2, 2, 1), (2, 1, 3, 1, 2)),
        ("qwen3_next", (2, 1, 2, 2, 2), (1, 1, 5, 1, 1)),
        ("qwen3_vl_moe", (1, 1, 3, 1, 1), (2, 1, 2, 2, 1)),
        // A Megatron ViT: its merger's fc1 is column-split, unlike Qwen3-VL's of the same name.
        ("qwen3_5_moe_vl", (1, 1, 3, 1, 1), (2, 1, 2, 2, 1)),
        ("gpt_oss", (2, 1, 2, 2, 1), (1, 1, 4, 4, 1)),
    ];
    for (i, &(name, from, to)) in cases.iter().enumerate() {
        let a = tmp.path().join(format!("{i}-a"));
        let b = tmp.path().join(format!("{i}-b"));
        let want = tmp.path().join(format!("{i}-want"));
        convert_at(name, &a, from);
        // A converted checkpoint has no `args`: the source mesh is given.
        let (tp, cp, dp, ep, etp) = from;
        let from_mesh = format!("tp={tp},cp={cp},dp={dp},ep={ep},etp={etp}");
        let o = reshard(&a, &b, to, &["--vocab-size", "256", "--from-mesh", &from_mesh]);
        assert!(o.status.success(), "{name} {from:?} → {to:?}: {}", stderr(&o));
        convert_at(name, &want, to);
        let (got, expected) = (layout_of(&b), layout_of(&want));
        assert_eq!(got.keys().collect::<Vec<_>>(), expected.keys().collect::<Vec<_>>(), "{name}: keys");
        for (k, v) in &expected {
            assert_eq!(&got[k], v, "{name} {from:?} → {to:?}: `{k}`");
        }
        validate(&b, name, to.4);
        // No files torch's format detection would read as another format.
        assert!(!b.join("metadata.json").exists() && !b.join("common.pt").exists());
    }
}

#[test]
fn a_round_trip_gives_back_the_same_files() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let (a, b, c) = (tmp.path().join("a"), tmp.path().join("b"), tmp.path().join("c"));
    let from = (1, 1, 4, 2, 1);
    convert_at("qwen3_moe", &a, from);
    assert!(reshard(&a, &b, (2, 1, 3, 1, 2), &[]).status.success());
    let o = reshard(&b, &c, from, &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    for entry in std::fs::read_dir(&a).expect("list") {
        let name = entry.expect("entry").file_name();
        let (x, y) = (std::fs::read(a.join(&name)).expect("read"), std::fs::read(c.join(&name)).expect("read"));
        assert!(x == y, "{name:?} differs after a → b → a");
    }
}

/// Rewrites `dir/.metadata` with `edit` applied to its decoded form.
fn edit_metadata(dir: &Path, edit: impl FnOnce(&mut shardline_formats::dcp_metadata::Metadata)) {
    let p = dir.join(".metadata");
    let mut md = decode_metadata(&std::fs::read(&p).expect("read .metadata")).expect("decode");
    edit(&mut md);
    std::fs::write(&p, encode_metadata(&md)).expect("write .metadata");
}

fn fails_cleanly(src: &Path, out: &Path, m: Mesh, needle: &str) {
    let o = reshard(src, out, m, &[]);
    assert!(!o.status.success(), "reshard succeeded on bad input ({needle})");
    let err = stderr(&o);
    assert!(err.contains(needle), "error should mention {needle:?}: {err}");
    assert!(!out.exists(), "{} was created: {err}", out.display());
}

#[test]
fn bad_input_is_refused_before_anything_is_written() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let from = (1, 1, 4, 2, 1);
    let to = (2, 1, 2, 2, 1);
    let fresh = |n: &str| {
        let d = tmp.path().join(n);
        convert_at("qwen3_moe", &d, from);
        d
    };
    let key = "model.module.decoder.layers.0.self_attention.linear_proj.weight";

    // A rank file cut short.
    let d = fresh("truncated");
    let f = std::fs::OpenOptions::new().write(true).open(d.join("__2_0.distcp")).expect("open");
    let len = f.metadata().expect("stat").len();
    f.set_len(len - 100).expect("truncate");
    fails_cleanly(&d, &tmp.path().join("out-truncated"), to, "__2_0.distcp");

    // A chunk missing from `.metadata`: elements no chunk holds.
    let d = fresh("missing");
    edit_metadata(&d, |md| {
        for (k, e) in md.state_dict_metadata.iter_mut() {
            if let (true, EntryMeta::Tensor { chunks, .. }) = (k == key, e) {
                let gone = chunks.remove(1);
                md.storage_data.retain(|(s, _)| !(s.fqn == key && s.offset.as_ref() == Some(&gone.offsets)));
            }
        }
    });
    fails_cleanly(&d, &tmp.path().join("out-missing"), to, "a chunk is missing");

    // Two chunks that overlap.
    let d = fresh("overlap");
    edit_metadata(&d, |md| {
        for (k, e) in md.state_dict_metadata.iter_mut() {
            if let (true, EntryMeta::Tensor { chunks, .. }) = (k == key, e) {
                let old = chunks[1].offsets.clone();
                chunks[1].offsets[0] -= 1;
                for (s, _) in md.storage_data.iter_mut() {
                    if s.fqn == key && s.offset.as_ref() == Some(&old) {
                        s.offset = Some(chunks[1].offsets.clone());
                    }
                }
            }
        }
    });
    fails_cleanly(&d, &tmp.path().join("out-overlap"), to, "overlap");

    // Meshes the model cannot take: 4 experts over ep = 3, 32 columns over tp = 3.
    let d = fresh("mesh");
    fails_cleanly(&d, &tmp.path().join("out-ep"), (1, 1, 3, 3, 1), "does not divide the model's");
    fails_cleanly(&d, &tmp.path().join("out-tp"), (3, 1, 1, 1, 3), "do not split over tp = 3");
}

#[test]
fn without_args_the_source_mesh_comes_from_the_chunk_geometry() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let (a, b) = (tmp.path().join("a"), tmp.path().join("b"));
    // gpt-oss keeps its expert fc1 fused in a layout of the expert-TP size: resharding needs it.
    convert_at("gpt_oss_bf16", &a, (2, 1, 2, 2, 1));
    let o = reshard(&a, &b, (1, 1, 4, 4, 1), &["--vocab-size", "256"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("(tp2·cp1·dp2·ep2·etp1, from chunk geometry"), "{}", stdout(&o));
    validate(&b, "gpt_oss_bf16", 1);
}

/// `reshard --overwrite` over a checkpoint withdraws the old `.metadata` before it touches a rank
/// file: a write that fails part-way (a file-size limit, as a full disk) leaves no `.metadata`
/// naming rank files that were replaced or removed, only an empty directory.
#[test]
fn a_failed_overwrite_leaves_no_old_metadata_over_new_rank_files() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let (src, out) = (tmp.path().join("src"), tmp.path().join("out"));
    convert_at("llama", &src, (1, 1, 2, 1, 1));
    convert_at("llama", &out, (1, 1, 4, 1, 1));
    assert!(out.join(".metadata").is_file() && out.join("__3_0.distcp").is_file());
    let script = format!(
        "trap '' XFSZ; ulimit -f 64; exec '{}' reshard '{}' --to '{}' --tp 1 --dp 2 --overwrite",
        env!("CARGO_BIN_EXE_shardline"),
        src.display(),
        out.display()
    );
    let o = std::process::Command::new("sh").arg("-c").arg(script).output().expect("sh");
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    let left: Vec<_> = std::fs::read_dir(&out).expect("out").flatten().map(|e| e.file_name()).collect();
    assert!(left.is_empty(), "{left:?}");
}

/// `reshard --simulate` plans from the model's `config.json` alone what a real reshard of the
/// checkpoint `convert --optimizer-state` writes for it does: the same source and target tensor
/// bytes as that checkpoint and its reshard report, the same number of rank files, and each
/// target rank file's cost as the real checkpoint's `--dry-run` reports it.
#[test]
fn a_simulated_reshard_costs_what_the_real_one_writes() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let (from, to): (Mesh, Mesh) = ((1, 1, 4, 2, 1), (2, 1, 3, 2, 1));
    let (src, out) = (tmp.path().join("src"), tmp.path().join("out"));
    convert_at("qwen3_moe", &src, from);
    let o = reshard(&src, &out, to, &["--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let real: Value = serde_json::from_str(stdout(&o).trim()).expect("reshard json");
    let config = fixture("qwen3_moe").join("config.json");
    let o = run(bin()
        .arg("reshard")
        .arg("--simulate")
        .arg(&config)
        .args(["--from-mesh", "tp=1,dp=4,ep=2,etp=1", "--json"])
        .args(mesh_args(to)));
    assert!(o.status.success(), "{}", stderr(&o));
    let sim: Value = serde_json::from_str(stdout(&o).trim()).expect("simulate json");
    let per = &sim["per_rank_file"];
    assert_eq!(sim["rank_files"], real["files"], "{sim}");
    assert_eq!(per["bytes_written"]["total"], real["tensor_bytes"], "{sim}");
    assert_eq!(per["chunks"]["total"], real["chunks"], "{sim}");
    let o = run(bin().arg("inspect").arg(&src).args(["--json", "--summary"]));
    let inspected: Value = serde_json::from_str(stdout(&o).trim()).expect("inspect json");
    assert_eq!(sim["source_tensors"], inspected["tensor_count"], "{sim}");
    assert_eq!(sim["source_chunks"], inspected["chunk_count"], "{sim}");
    assert!(per["bytes_read"]["total"].as_u64() <= per["bytes_written"]["total"].as_u64(), "{sim}");
    // The real checkpoint's dry run costs each target rank file the same: the simulated chunks
    // are where convert wrote them.
    let o = run(bin().arg("reshard").arg(&src).args(["--dry-run", "--json"]).args(mesh_args(to)));
    assert!(o.status.success(), "{}", stderr(&o));
    let dry: Value = serde_json::from_str(stdout(&o).trim()).expect("dry-run json");
    assert_eq!(dry["per_rank_file"], sim["per_rank_file"], "{dry}\n{sim}");
    assert!(per["source_files"]["max"].as_u64() <= Some(from.2 * from.0), "{sim}");
    assert!(per["reads"]["max"].as_u64() > Some(0), "{sim}");
}

/// A reshard split by target rank file — each file written on its own, in any order, as the
/// pipeline's rank tasks write them, then committed — is the reshard written whole, byte for
/// byte, for an `fsdp_dtensor` and a `torch_dist` target. A commit with a rank file missing or
/// cut short names it and writes no `.metadata`.
#[test]
fn a_reshard_split_by_rank_file_is_the_whole_reshard() {
    use shardline_formats::execute::Progress;
    use shardline_layout::dialect::Dialect;
    use shardline_layout::reshard::RngPolicy;
    use shardline_ops::{plan_reshard_of, ReshardRequest};

    let tmp = tempfile::tempdir().expect("tempdir");
    let src = tmp.path().join("src");
    convert_at("qwen3_moe", &src, (1, 1, 4, 2, 1));
    let target_mesh = (2, 1, 2, 2, 1);
    for (name, target) in [("fsdp_dtensor", None), ("torch_dist", Some(Dialect::TorchDist))] {
        let whole = tmp.path().join(format!("whole-{name}"));
        let extra: &[&str] = if target.is_some() { &["--target", "torch_dist"] } else { &[] };
        let o = reshard(&src, &whole, target_mesh, extra);
        assert!(o.status.success(), "reshard: {}{}", stdout(&o), stderr(&o));

        let (tp, cp, dp, ep, etp) = target_mesh;
        let request = ReshardRequest {
            ckpt: src.clone(),
            mesh: shardline_layout::Mesh { tp, cp, dp, ep, etp },
            target,
            from_mesh: None,
            rng: RngPolicy::FromRank0,
            vocab_size: None,
            vocab_divisible_by: None,
        };
        let planned = plan_reshard_of(&request).expect("plan");
        assert!(planned.splits_by_rank());
        let split = tmp.path().join(format!("split-{name}"));
        let progress = Progress::default();
        for rank in [3, 1, 0] {
            planned.write_ranks(&split, rank..rank + 1, 1, &progress).expect("write a rank file");
        }
        // Rank 2's task has not run: the commit refuses, naming it.
        let e = planned.commit(&split).expect_err("a commit without rank 2's file");
        assert!(e.to_string().contains("rank 2's file is not complete"), "{e}");
        planned.write_ranks(&split, 2..3, 1, &progress).expect("write rank 2");
        // A rank file cut short (a writer killed mid-file) is refused the same way.
        let rank_dir = if target.is_some() { split.join("release") } else { split.clone() };
        let cut = rank_dir.join("__1_0.distcp");
        let len = std::fs::metadata(&cut).expect("rank 1's file").len();
        std::fs::OpenOptions::new().write(true).open(&cut).expect("open").set_len(len - 1).expect("truncate");
        let e = planned.commit(&split).expect_err("a commit with rank 1's file cut short");
        assert!(e.to_string().contains("rank 1's file is not complete"), "{e}");
        assert!(!rank_dir.join(".metadata").exists(), "a refused commit wrote .metadata");
        planned.write_ranks(&split, 1..2, 1, &progress).expect("write rank 1 again");
        planned.commit(&split).expect("commit");

        let (want, got) = (crate::file_bytes(&whole), crate::file_bytes(&split));
        assert_eq!(want.keys().collect::<Vec<_>>(), got.keys().collect::<Vec<_>>(), "{name}: the files differ");
        for (file, bytes) in &want {
            assert!(&got[file] == bytes, "{name}: `{file}` differs from the whole reshard's");
        }
    }
}

/// What one task of a reshard split by rank reads: of the source chunks `rank_sources` names,
/// the byte runs `rank_source_ranges` gives, and nothing else. A copy of the source opened
/// without locating its chunks, with every other byte of chunk data zeroed (the framing kept),
/// writes each target rank file exactly as the whole reshard does.
#[test]
fn a_rank_file_needs_only_the_source_runs_it_is_made_from() {
    use shardline_formats::execute::Progress;
    use shardline_formats::training::{rank_source_ranges, rank_sources, write_resharded_ranks, TrainingCheckpoint};
    use shardline_layout::reshard::{plan_reshard, RngPolicy};
    use shardline_ops::{reshard_options, ReshardHints};
    use std::collections::HashMap;
    use std::os::unix::fs::FileExt;

    let tmp = tempfile::tempdir().expect("tempdir");
    let src = tmp.path().join("src");
    convert_at("qwen3_moe", &src, (1, 1, 4, 2, 1));
    let whole = tmp.path().join("whole");
    let (tp, cp, dp, ep, etp) = (2, 1, 3, 2, 1);
    let o = reshard(&src, &whole, (tp, cp, dp, ep, etp), &[]);
    assert!(o.status.success(), "reshard: {}{}", stdout(&o), stderr(&o));
    let mesh = shardline_layout::Mesh { tp, cp, dp, ep, etp };
    let located = TrainingCheckpoint::open(&src).expect("open");
    for rank in 0..mesh.world() {
        let copy = tmp.path().join(format!("copy-{rank}"));
        std::fs::create_dir(&copy).expect("copy dir");
        for e in std::fs::read_dir(&src).expect("src") {
            let path = e.expect("entry").path();
            std::fs::copy(&path, copy.join(path.file_name().expect("name"))).expect("copy");
        }
        let mut source = TrainingCheckpoint::open_unlocated(&copy).expect("open unlocated");
        let options =
            reshard_options(&source, mesh, RngPolicy::FromRank0, ReshardHints::default(), ReshardHints::default());
        let plan = plan_reshard(&source.items, &options).expect("plan");
        let wanted = rank_sources(&source, &plan, rank);
        let mut keep: HashMap<(usize, usize), Vec<(u64, u64)>> = HashMap::new();
        for (chunk, start, len) in rank_source_ranges(&source, &plan, rank) {
            keep.entry(chunk).or_default().push((start, start + len));
        }
        // Every byte of chunk data outside the kept runs is zeroed; the framing stays.
        let (mut kept, mut zeroed) = (0u64, 0u64);
        for (ti, t) in located.checkpoint.tensors.iter().enumerate() {
            for (ci, c) in t.chunks.iter().enumerate() {
                let f = std::fs::OpenOptions::new().write(true).open(copy.join(&*c.file)).expect("open");
                let mut runs = keep.get(&(ti, ci)).cloned().unwrap_or_default();
                runs.sort_unstable();
                let mut at = 0u64;
                for (start, end) in runs.into_iter().chain([(c.data_len, c.data_len)]) {
                    if start > at {
                        f.write_all_at(&vec![0u8; (start - at) as usize], c.data_offset + at).expect("zero");
                        zeroed += start - at;
                    }
                    kept += end.saturating_sub(start.max(at));
                    at = at.max(end);
                }
            }
        }
        assert!(kept > 0 && zeroed > kept, "rank {rank}: {kept} bytes kept, {zeroed} zeroed");
        source.locate(&wanted).expect("locate");
        let out = tmp.path().join(format!("out-{rank}"));
        write_resharded_ranks(&source, &plan, &out, rank..rank + 1, 1, &Progress::default()).expect("write");
        let name = format!("__{rank}_0.distcp");
        let (want, got) =
            (std::fs::read(whole.join(&name)).expect("whole"), std::fs::read(out.join(&name)).expect("got"));
        assert!(want == got, "rank {rank}: the file differs from the whole reshard's ({kept} bytes kept)");
    }
}
