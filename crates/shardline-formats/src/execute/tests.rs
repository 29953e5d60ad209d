//! Whole writes against rank-by-rank writes and a separate commit, the streamed `.metadata`
//! against the whole encoding, the kernel-copy and read paths, stripe sets, CRCs.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};

use shardline_layout::{build_plan, Mesh, ModelConfig, Plan, PlanOptions, PlanTable, SourceTensor};

use super::*;
use super::{dcp::*, sources::*, stripes::*};
use crate::dcp_metadata::{
    self, decode_metadata, encode_metadata, ChunkMeta, EntryMeta, Metadata, StorageInfo, StorageKey,
};
use crate::safetensors::Release;
use crate::torch_save::{read_tensor_archive, TensorArchive};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/hf-tiny").join(name)
}

fn plan(release: &Release, mesh: Mesh, optimizer_state: bool) -> Plan {
    let config = ModelConfig::from_json(release.config_json()).unwrap();
    let sources = release
        .tensors()
        .map(|t| SourceTensor { name: t.info.name.clone(), dtype: t.info.dtype, shape: t.info.shape.clone() })
        .collect();
    let options = PlanOptions { optimizer_state, ..PlanOptions::default() };
    build_plan(&config, sources, mesh, &options).unwrap()
}

/// Converts into a fresh directory; every file's bytes, by name, and the report.
fn convert(release: &Release, plan: &Plan, options: &ExecuteOptions) -> (BTreeMap<String, Vec<u8>>, WriteReport) {
    let dir = tempfile::tempdir().unwrap();
    let report = write_checkpoint(plan, release, dir.path(), options, &Progress::default()).unwrap();
    let files = fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap())
        .map(|e| (e.file_name().to_string_lossy().into_owned(), fs::read(e.path()).unwrap()))
        .collect();
    (files, report)
}

fn meshes() -> Vec<(&'static str, Mesh, bool)> {
    let m = |tp, dp, ep| Mesh { tp, cp: 1, dp, ep, etp: tp };
    vec![
        ("llama", m(2, 2, 1), true),
        ("qwen3_moe", m(2, 2, 2), false),
        ("qwen3_moe", Mesh { etp: 1, ..m(2, 3, 2) }, true),
        ("qwen3_next", m(2, 1, 1), false),
    ]
}

#[test]
fn rank_by_rank_writes_and_a_separate_commit_equal_a_whole_write() {
    for (name, mesh, optimizer_state) in meshes() {
        let release = Release::open(fixture(name)).unwrap();
        let plan = plan(&release, mesh, optimizer_state);
        for format in [OutputFormat::Dcp, OutputFormat::DcpSafetensors] {
            let options = ExecuteOptions { format, ..ExecuteOptions::default() };
            let (whole, _) = convert(&release, &plan, &options);
            let dir = tempfile::tempdir().unwrap();
            // Ranks in reverse order, as independent tasks would finish in any order.
            for rank in (0..plan.world()).rev() {
                write_rank_file(&plan, &release, dir.path(), rank, &options, &Progress::default()).unwrap();
            }
            assert!(!dir.path().join(".metadata").exists(), "no commit marker before the commit");
            commit_checkpoint(&plan, dir.path(), &options).unwrap();
            let parts: BTreeMap<String, Vec<u8>> = fs::read_dir(dir.path())
                .unwrap()
                .map(|e| e.unwrap())
                .map(|e| (e.file_name().to_string_lossy().into_owned(), fs::read(e.path()).unwrap()))
                .collect();
            assert_eq!(parts.keys().collect::<Vec<_>>(), whole.keys().collect::<Vec<_>>(), "{name} {mesh} {format:?}");
            assert!(parts == whole, "{name} {mesh} {format:?}: bytes differ");
        }
    }
}

/// The `.metadata` the plan implies, built as a whole [`Metadata`] the plain way.
fn whole_metadata(layout: &DcpLayout, plan: &Plan) -> Metadata {
    let mut storage_data = Vec::new();
    let mut chunk_lists: Vec<Vec<ChunkMeta>> = vec![Vec::new(); plan.tensors.len()];
    for rank in 0..layout.world() {
        for item in layout.rank(&PlanTable::new(plan), rank) {
            let t = &plan.tensors[item.tensor];
            let c = &item.chunk;
            chunk_lists[item.tensor].push(ChunkMeta { offsets: c.offsets.clone(), sizes: c.sizes.clone() });
            let key = StorageKey { fqn: t.key.clone(), offset: Some(c.offsets.clone()) };
            let info = StorageInfo {
                relative_path: dcp_rank_file(rank as u64),
                offset: item.offset,
                length: item.length,
                transform_descriptors: None,
            };
            storage_data.push((key, info));
        }
    }
    let state_dict_metadata = plan
        .tensors
        .iter()
        .zip(chunk_lists)
        .map(|(t, chunks)| (t.key.clone(), EntryMeta::Tensor { dtype: t.dtype, size: t.shape.clone(), chunks }))
        .collect();
    let planner_data = plan.tensors.iter().map(|t| (t.key.clone(), planner_path(&t.key))).collect();
    Metadata { state_dict_metadata, storage_data, planner_data, version: None }
}

#[test]
fn streamed_metadata_equals_the_whole_encoding() {
    for (name, mesh, optimizer_state) in meshes() {
        let release = Release::open(fixture(name)).unwrap();
        let plan = plan(&release, mesh, optimizer_state);
        let layout = DcpLayout::new(&PlanTable::new(&plan));
        let streamed = layout.write_metadata(&PlanTable::new(&plan), Vec::new()).unwrap();
        let whole = whole_metadata(&layout, &plan);
        assert!(whole.storage_data.len() > plan.tensors.len(), "{name} {mesh}");
        assert!(streamed == encode_metadata(&whole), "{name} {mesh}: bytes differ");
        assert_eq!(decode_metadata(&streamed).unwrap(), whole, "{name} {mesh}");
    }
}

#[test]
fn commit_refuses_a_missing_or_short_rank_file() {
    let release = Release::open(fixture("llama")).unwrap();
    let plan = plan(&release, Mesh::new(1, 1, 2, 1), false);
    let options = ExecuteOptions::default();
    let dir = tempfile::tempdir().unwrap();
    write_rank_file(&plan, &release, dir.path(), 0, &options, &Progress::default()).unwrap();
    let err = commit_checkpoint(&plan, dir.path(), &options).unwrap_err().to_string();
    assert!(err.contains("__1_0.distcp"), "{err}");
    write_rank_file(&plan, &release, dir.path(), 1, &options, &Progress::default()).unwrap();
    let f = dir.path().join("__1_0.distcp");
    let len = fs::metadata(&f).unwrap().len();
    fs::OpenOptions::new().write(true).open(&f).unwrap().set_len(len - 1).unwrap();
    let err = commit_checkpoint(&plan, dir.path(), &options).unwrap_err().to_string();
    assert!(err.contains("the plan implies"), "{err}");
    assert!(!dir.path().join(".metadata").exists());
}

#[test]
fn kernel_copy_and_read_paths_write_identical_bytes() {
    for (name, mesh, optimizer_state) in meshes() {
        let release = Release::open(fixture(name)).unwrap();
        let plan = plan(&release, mesh, optimizer_state);
        let what = format!("{name} {mesh}");
        let base = ExecuteOptions { copy_file_range: false, threads: 2, ..ExecuteOptions::default() };
        let (want, report) = convert(&release, &plan, &base);
        assert_eq!(report.kernel_copy_bytes, 0, "{what}");
        assert!(want.contains_key(".metadata") && !want.contains_key(".metadata.tmp"), "{what}");
        let variants = [
            // Every plain segment copied by the kernel.
            ExecuteOptions { copy_min_bytes: 1, ..base.clone() }.with_kernel_copy(),
            // Mixed: larger segments by the kernel, the rest gathered through a tiny,
            // odd-sized buffer (many flushes mid-segment and mid-gather).
            ExecuteOptions { copy_min_bytes: 700, buffer_bytes: 4099, threads: 3, ..base.clone() }.with_kernel_copy(),
            // The read path alone with the tiny buffer.
            ExecuteOptions { buffer_bytes: 4096, threads: 1, ..base.clone() },
        ];
        for options in variants {
            let (got, report) = convert(&release, &plan, &options);
            if options.copy_file_range {
                // /tmp's filesystem copies in the kernel (ext4, xfs, btrfs, tmpfs all do).
                assert!(report.kernel_copy_bytes > 0, "{what}: {options:?}");
            }
            assert_eq!(got.keys().collect::<Vec<_>>(), want.keys().collect::<Vec<_>>(), "{what}");
            for (file, bytes) in &want {
                assert!(got[file] == *bytes, "{what}: {file} differs with {options:?}");
            }
        }
    }
}

/// With fewer rank files than writers, files are written in sections side by side: the same
/// bytes as one writer per file.
#[test]
fn rank_files_written_in_sections_side_by_side_equal_one_writer_each() {
    for (name, dp) in [("llama", 1), ("qwen3_moe", 1), ("qwen3_moe", 2)] {
        let release = Release::open(fixture(name)).unwrap();
        let plan = plan(&release, Mesh { tp: 1, cp: 1, dp, ep: 1, etp: 1 }, true);
        let base = ExecuteOptions { threads: 1, ..ExecuteOptions::default() };
        let (want, _) = convert(&release, &plan, &base);
        for options in [
            ExecuteOptions { threads: 4, ..base.clone() },
            ExecuteOptions { threads: 7, buffer_bytes: 4099, copy_file_range: false, ..base.clone() },
        ] {
            let layout = DcpLayout::new(&PlanTable::new(&plan));
            assert!(sections(&PlanTable::new(&plan), &layout, options.threads).len() > dp as usize, "{name}");
            let (got, _) = convert(&release, &plan, &options);
            assert_eq!(got.keys().collect::<Vec<_>>(), want.keys().collect::<Vec<_>>(), "{name}");
            for (file, bytes) in &want {
                assert!(got[file] == *bytes, "{name} dp {dp}: {file} differs with {options:?}");
            }
        }
    }
}

#[test]
fn column_stripes_of_tp_peers_are_written_together() {
    let release = Release::open(fixture("qwen3_moe")).unwrap();
    let plan = plan(&release, Mesh { tp: 2, cp: 1, dp: 2, ep: 2, etp: 2 }, false);
    let plan = PlanTable::new(&plan);
    let shared = StripeSets::new(&plan, 2);
    assert!(shared.shared);
    assert_eq!(shared.units, vec![vec![0, 1], vec![2, 3]]);
    // More writers than groups: each rank alone, stripes gathered per rank.
    let alone = StripeSets::new(&plan, 4);
    assert!(!alone.shared);
    assert_eq!(alone.units.len(), 4);
}

#[test]
fn a_release_consumed_into_sources_converts_as_the_release_does() {
    let mesh = Mesh { tp: 2, cp: 1, dp: 2, ep: 2, etp: 2 };
    let release = Release::open(fixture("qwen3_moe")).unwrap();
    let planned = plan(&release, mesh, false);
    let options = ExecuteOptions { threads: 2, ..ExecuteOptions::default() };
    let (want, _) = convert(&release, &planned, &options);
    let config = ModelConfig::from_json(release.config_json()).unwrap();
    let (sources, locations) = release.into_sources();
    assert_eq!(sources, planned.sources, "the same sources, in the same order");
    let plan = build_plan(&config, sources, mesh, &PlanOptions::default()).unwrap();
    let mut short = locations.clone();
    short.tensors.pop();
    assert!(matches!(
        SourceMap::open(&plan, short),
        Err(ExecuteError::SourceCount { planned, located }) if located + 1 == planned
    ));
    let map = SourceMap::open(&plan, locations).unwrap();
    let dir = tempfile::tempdir().unwrap();
    write_checkpoint_from(&PlanTable::new(&plan), &map, dir.path(), &options, &Progress::default()).unwrap();
    for (file, bytes) in &want {
        assert!(fs::read(dir.path().join(file)).unwrap() == *bytes, "{file}");
    }
}

#[test]
fn stripe_sets_with_columns_between_and_around_them_write_what_ranks_alone_write() {
    let release = Release::open(fixture("qwen3_moe")).unwrap();
    let mesh = Mesh { tp: 2, cp: 1, dp: 2, ep: 2, etp: 2 };
    let mut plan = plan(&release, mesh, false);
    // Narrow the TP stripes of the row-parallel dense weights so that source columns lie
    // before, between and after those any rank holds: a set then reads them into scratch.
    let mut narrowed = 0;
    for t in plan.tensors.iter_mut().filter(|t| t.tp_mode == shardline_layout::arch::TpMode::Row) {
        for c in t.listed_chunks(&mesh).iter_mut().filter(|c| c.sizes[1] > 2) {
            c.offsets[1] += 1;
            c.sizes[1] -= 2;
            narrowed += 1;
        }
    }
    assert!(narrowed > 0);
    let base = ExecuteOptions { copy_file_range: false, ..ExecuteOptions::default() };
    // Eight writers for four TP groups: every rank alone, reading its own columns.
    let (alone, _) = convert(&release, &plan, &ExecuteOptions { threads: 8, ..base.clone() });
    let table = PlanTable::new(&plan);
    assert!(!StripeSets::new(&table, 8).shared && StripeSets::new(&table, 2).shared);
    for options in [
        ExecuteOptions { threads: 2, ..base.clone() },
        // A buffer of a few rows: sets flush their files between batches.
        ExecuteOptions { threads: 2, buffer_bytes: 4099, ..base.clone() },
    ] {
        let (together, _) = convert(&release, &plan, &options);
        assert_eq!(together.keys().collect::<Vec<_>>(), alone.keys().collect::<Vec<_>>());
        for (file, bytes) in &alone {
            assert!(together[file] == *bytes, "{file} differs with {options:?}");
        }
    }
}

#[test]
fn zip_crc32_fills_in_the_crcs_and_changes_nothing_else() {
    for (name, mesh, optimizer_state) in meshes() {
        let release = Release::open(fixture(name)).unwrap();
        let plan = plan(&release, mesh, optimizer_state);
        let base = ExecuteOptions { threads: 2, ..ExecuteOptions::default() };
        let (plain, _) = convert(&release, &plan, &base);
        let crc = ExecuteOptions { zip_crc32: true, buffer_bytes: 4099, ..base.clone() };
        let (with_crc, _) = convert(&release, &plan, &crc);
        assert_eq!(with_crc[".metadata"], plain[".metadata"], "{name}: same items at the same places");
        let md = dcp_metadata::decode_metadata(&plain[".metadata"]).unwrap();
        assert!(!md.storage_data.is_empty());
        for (key, info) in &md.storage_data {
            let range = info.offset as usize..(info.offset + info.length) as usize;
            let (a, b) = (&plain[&info.relative_path][range.clone()], &with_crc[&info.relative_path][range]);
            let (ta, tb) =
                (read_tensor_archive(a, 0, info.length).unwrap(), read_tensor_archive(b, 0, info.length).unwrap());
            let data = ta.data_offset_in_item as usize..(ta.data_offset_in_item + ta.data_len) as usize;
            assert_eq!(a[data.clone()], b[data.clone()], "{name} {}: same data", key.fqn);
            let want = crc32fast::hash(&b[data.clone()]);
            assert_eq!(tb.data_crc32, Some(want), "{name} {}", key.fqn);
            assert_eq!(ta.data_crc32, (want == 0).then_some(0), "{name} {}: no crc computed", key.fqn);
            // Only the data entry's two CRC fields differ: in its local header (just
            // before the data) and in the central directory (after it).
            let archive = TensorArchive::new(ta.dtype, &ta.shape);
            let local = archive.crc_offset() as usize..archive.crc_offset() as usize + 4;
            for (i, (x, y)) in a.iter().zip(b).enumerate() {
                assert!(x == y || local.contains(&i) || i >= data.end, "{name} {}: byte {i}", key.fqn);
            }
            assert!(a.iter().zip(b).filter(|(x, y)| x != y).count() <= 8);
        }
    }
}

impl ExecuteOptions {
    fn with_kernel_copy(self) -> ExecuteOptions {
        ExecuteOptions { copy_file_range: true, ..self }
    }
}

/// A copy of the release's files holding only their headers and `ranges`, zeros elsewhere.
fn sparse_release(release_dir: &Path, sources: &SourceMap, ranges: &[ByteRange]) -> tempfile::TempDir {
    let out = tempfile::tempdir().unwrap();
    for e in fs::read_dir(release_dir).unwrap().flatten() {
        let bytes = fs::read(e.path()).unwrap();
        let name = e.file_name();
        if !name.to_string_lossy().ends_with(".safetensors") {
            fs::write(out.path().join(&name), bytes).unwrap();
            continue;
        }
        let header = 8 + u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        let mut copy = vec![0u8; bytes.len()];
        copy[..header].copy_from_slice(&bytes[..header]);
        let index = sources.file_paths().position(|p| p.file_name() == Some(name.as_os_str())).unwrap();
        for r in ranges.iter().filter(|r| r.file == index) {
            let span = r.start as usize..r.end as usize;
            copy[span.clone()].copy_from_slice(&bytes[span]);
        }
        fs::write(out.path().join(&name), copy).unwrap();
    }
    out
}

#[test]
fn a_rank_file_written_a_section_at_a_time_from_each_sections_ranges_equals_the_whole_file() {
    for (name, mesh, optimizer_state) in meshes() {
        let release = Release::open(fixture(name)).unwrap();
        let plan = plan(&release, mesh, optimizer_state);
        let table = PlanTable::new(&plan);
        let sources = SourceMap::new(&plan, &release).unwrap();
        let whole = tempfile::tempdir().unwrap();
        let options = ExecuteOptions::default();
        for rank in 0..plan.world() {
            let len = write_rank_file(&plan, &release, whole.path(), rank, &options, &Progress::default()).unwrap();
            let want = fs::read(whole.path().join(dcp_rank_file(rank))).unwrap();
            let spans = rank_item_spans(&plan, rank);
            assert_eq!(spans.iter().map(|(_, l)| l).sum::<u64>(), len, "{name} rank {rank}");
            let out = tempfile::tempdir().unwrap();
            let path = out.path().join("rank.distcp");
            // Sections of 1, 3, 2, 5, … items, each written from a release holding its ranges only.
            let (mut at, mut k) = (0usize, 0usize);
            while at < spans.len() {
                let items = at..(at + [1, 3, 2, 5][k % 4]).min(spans.len());
                let ranges = sources.rank_ranges_of(&table, rank, items.clone());
                let sparse = sparse_release(&fixture(name), &sources, &ranges);
                let sparse = Release::open(sparse.path()).unwrap();
                let (start, end) =
                    write_rank_section(&plan, &sparse, &path, rank, items.clone(), &options, &Progress::default())
                        .unwrap();
                assert_eq!((start, end), (spans[items.start].0, spans[items.end - 1].0 + spans[items.end - 1].1));
                (at, k) = (items.end, k + 1);
            }
            assert!(
                fs::read(&path).unwrap() == want,
                "{name} {mesh:?} rank {rank}: sections differ from the whole file"
            );
        }
    }
}

/// A write that fails (here: cancelled) leaves nothing behind, not even the directories it
/// created for its output; one that succeeds leaves no staging behind, and DCP-safetensors files
/// (which no marker commits) take their names only once all are written.
#[test]
fn a_failed_write_leaves_nothing_behind_and_a_finished_one_no_staging() {
    let release = Release::open(fixture("llama")).unwrap();
    let plan = plan(&release, Mesh { tp: 2, cp: 1, dp: 2, ep: 1, etp: 2 }, false);
    for format in [OutputFormat::Dcp, OutputFormat::DcpSafetensors] {
        let tmp = tempfile::tempdir().unwrap();
        let out = tmp.path().join("runs/a/ckpt");
        let options = ExecuteOptions { format, ..ExecuteOptions::default() };
        let cancelled = Progress::default();
        cancelled.cancel.store(true, std::sync::atomic::Ordering::Relaxed);
        let err = write_checkpoint(&plan, &release, &out, &options, &cancelled).unwrap_err();
        assert!(matches!(err, ExecuteError::Cancelled), "{format:?}: {err}");
        assert!(!tmp.path().join("runs").exists(), "{format:?}: a failed write left the directories it made");

        // An obstacle where the last rank file's staged copy must go fails that rank after the
        // others finished: none of theirs is in place, and the obstacle's directory, which the
        // write did not make, stays.
        if format == OutputFormat::DcpSafetensors {
            let obstacle = out.join(SAFETENSORS_STAGING).join(dcp_safetensors_rank_file(3, 4));
            fs::create_dir_all(obstacle.join("x")).unwrap();
            write_checkpoint(&plan, &release, &out, &options, &Progress::default()).unwrap_err();
            let left: Vec<String> =
                fs::read_dir(&out).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
            assert!(left.is_empty(), "{left:?}");
        }

        write_checkpoint(&plan, &release, &out, &options, &Progress::default()).unwrap();
        let mut names: Vec<String> =
            fs::read_dir(&out).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
        names.sort();
        let want: Vec<String> = match format {
            OutputFormat::Dcp => [".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp", "__3_0.distcp"]
                .iter()
                .map(|s| s.to_string())
                .collect(),
            OutputFormat::DcpSafetensors => (0..4).map(|r| dcp_safetensors_rank_file(r, 4)).collect(),
        };
        assert_eq!(names, want, "{format:?}");
    }
}
