//! The release as the writers read it: open files and where each of a plan's sources sits in
//! them, and the streaming of one chunk's bytes out of them.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use shardline_layout::recipe::{
    apply_transform, cast_into, dequant_fp8_f32_into, dequant_fp8_into, dequant_mxfp4_as, segments, Fp8Scales, Segment,
    Transform, MXFP4_BLOCK, MXFP4_MAX_SCALE,
};
use shardline_layout::{DType, Plan, TensorView};

use crate::safetensors::{Release, SourceLocations};

use super::*;

/// Opens release files for reading.
fn open_release_files<'a>(paths: impl Iterator<Item = &'a Path>) -> Result<Vec<(PathBuf, File)>, ExecuteError> {
    let mut files = Vec::new();
    for p in paths {
        let f = File::open(p).map_err(io_err(p, "open release file"))?;
        // Larger readahead when the release is not in the page cache, as `cp` asks; a hint that
        // may be refused.
        let _ = rustix::fs::fadvise(&f, 0, None, rustix::fs::Advice::Sequential);
        files.push((p.to_path_buf(), f));
    }
    Ok(files)
}

/// The release files a plan reads, open, and where each of the plan's sources sits in them:
/// `(file index, absolute data offset, byte length)`. All the writers need of the release, so a
/// caller can let the release's header descriptions go before the bytes are copied.
pub struct SourceMap {
    pub(super) files: Vec<(PathBuf, File)>,
    pub(super) locs: Vec<(usize, u64, u64)>,
}

impl SourceMap {
    /// Opens the files of `release` and locates every source of `plan` in them, checking that
    /// each has the dtype and shape the plan was made for.
    pub fn new(plan: &Plan, release: &Release) -> Result<SourceMap, ExecuteError> {
        let files = open_release_files(release.file_paths())?;
        let mut locs = Vec::with_capacity(plan.sources.len());
        for s in &plan.sources {
            let t = release.tensor(&s.name).ok_or_else(|| ExecuteError::MissingSource(s.name.clone()))?;
            if t.info.dtype != s.dtype || t.info.shape != s.shape {
                return Err(ExecuteError::SourceMismatch {
                    name: s.name.clone(),
                    planned: format!("{} {:?}", s.dtype, s.shape),
                    actual: format!("{} {:?}", t.info.dtype, t.info.shape),
                });
            }
            locs.push((t.file_index, t.info.file_offset, t.info.byte_len));
        }
        Ok(SourceMap { files, locs })
    }

    /// Opens the files of a release whose sources `plan` was made from, as
    /// [`Release::into_sources`] gave them with `locations`.
    pub fn open(plan: &Plan, locations: SourceLocations) -> Result<SourceMap, ExecuteError> {
        if locations.tensors.len() != plan.sources.len() {
            return Err(ExecuteError::SourceCount { planned: plan.sources.len(), located: locations.tensors.len() });
        }
        let files = open_release_files(locations.files.iter().map(PathBuf::as_path))?;
        let locs = locations.tensors.into_iter().map(|(file, offset, len)| (file as usize, offset, len)).collect();
        Ok(SourceMap { files, locs })
    }

    /// Reads `buf.len()` bytes of source `id` at byte `offset` within the tensor.
    pub(super) fn read(&self, id: usize, offset: u64, buf: &mut [u8]) -> Result<(), ExecuteError> {
        let (fi, at) = self.locate(id, offset, buf.len() as u64);
        self.read_at(fi, at, buf)
    }

    /// `(file index, absolute offset)` of byte `offset` of source `id`, for `len` bytes.
    pub(super) fn locate(&self, id: usize, offset: u64, len: u64) -> (usize, u64) {
        let (fi, start, tensor_len) = self.locs[id];
        debug_assert!(offset + len <= tensor_len);
        (fi, start + offset)
    }

    /// The whole of source `id`, a little-endian float32 tensor (FP8 block scales).
    pub(super) fn read_f32s(&self, id: usize) -> Result<Vec<f32>, ExecuteError> {
        let mut bytes = vec![0u8; self.locs[id].2 as usize];
        self.read(id, 0, &mut bytes)?;
        Ok(bytes.chunks_exact(4).map(|e| f32::from_le_bytes([e[0], e[1], e[2], e[3]])).collect())
    }

    pub(super) fn read_at(&self, fi: usize, at: u64, buf: &mut [u8]) -> Result<(), ExecuteError> {
        let (path, file) = &self.files[fi];
        file.read_exact_at(buf, at).map_err(io_err(path, "read release tensor"))
    }
}

/// Reads the source bytes of casts and FP8 dequantizations aside and converts them, keeping the
/// block scales of the last FP8 weight (a few KiB) for the next piece of it.
#[derive(Default)]
pub(super) struct Converter {
    staging: Vec<u8>,
    scales: Option<(u32, Vec<f32>)>,
    /// The MXFP4 exponents of the piece at hand.
    block_scales: Vec<u8>,
    band: Band,
}

/// Columns of a transposed source matrix read ahead, already transposed: `rows` output rows of
/// `width` elements, the first being the column at element `first` of source `id`, the next
/// `stride` elements on. One read per matrix row serves many output rows.
#[derive(Default)]
struct Band {
    id: usize,
    first: u64,
    width: usize,
    stride: u64,
    rows: u64,
    bytes: Vec<u8>,
}

/// Bytes of transposed rows read ahead at once.
const BAND_BYTES: usize = 1 << 20;

impl Band {
    /// Output row `k` of the band holding the column at element `elem`, if it holds it.
    fn row(&self, id: usize, elem: u64, width: usize, stride: u64) -> Option<u64> {
        let hit = self.rows > 0 && id == self.id && width == self.width && stride == self.stride && elem >= self.first;
        let k = (elem - self.first.min(elem)) / stride.max(1);
        (hit && (elem - self.first).is_multiple_of(stride.max(1)) && k < self.rows).then_some(k)
    }
}

impl Converter {
    /// Fills `out` (whole output elements of `t`) from source `id` at byte `offset`.
    pub(super) fn convert(
        &mut self,
        sources: &SourceMap,
        t: TensorView<'_>,
        id: usize,
        offset: u64,
        transform: Transform,
        out: &mut [u8],
    ) -> Result<(), ExecuteError> {
        let item = t.dtype.size();
        let elems = out.len() / item;
        if let Transform::Transpose { src_cols, col_stride } = transform {
            return self.transposed(sources, t, id, offset, u64::from(src_cols), u64::from(col_stride), out);
        }
        let src_len = transform.source_bytes(t.dtype, elems as u64) as usize;
        self.staging.resize(src_len, 0);
        sources.read(id, offset, &mut self.staging)?;
        let staging = &self.staging;
        match transform {
            Transform::Cast(from) => {
                cast_into(from, t.dtype, staging, out);
            }
            Transform::DequantFp8 { scale, rows, cols } => {
                let values = match &self.scales {
                    Some((held, v)) if *held == scale => v,
                    _ => &self.scales.insert((scale, sources.read_f32s(scale as usize)?)).1,
                };
                // The scale grid is over the weight's matrix: rows as long as the output's last
                // dim (a stacked `[E, F, D]` output takes each expert's `[F, D]` whole).
                let row = t.shape.last().copied().unwrap_or(1);
                let scales = Fp8Scales { values, row_elems: row, block: [rows.into(), cols.into()] };
                // FP8 codes are one byte: the byte offset is the element index.
                match t.dtype {
                    DType::F32 => dequant_fp8_f32_into(staging, offset, &scales, out),
                    _ => dequant_fp8_into(staging, offset, &scales, out),
                }
            }
            Transform::DequantMxfp4 { scales } => {
                // Two codes a byte (a unit is a byte: two elements); one scale per 32 elements.
                let first = 2 * offset;
                let (lo, hi) = (first / MXFP4_BLOCK, (first + elems as u64).div_ceil(MXFP4_BLOCK));
                self.block_scales.resize((hi - lo) as usize, 0);
                sources.read(scales as usize, lo, &mut self.block_scales)?;
                if let Some(k) = self.block_scales.iter().position(|s| *s > MXFP4_MAX_SCALE) {
                    return Err(ExecuteError::Mxfp4Scale {
                        key: t.key.to_string(),
                        element: (lo + k as u64) * MXFP4_BLOCK,
                        scale: self.block_scales[k],
                        max: MXFP4_MAX_SCALE,
                    });
                }
                dequant_mxfp4_as(t.dtype, staging, first, &self.block_scales, lo, out);
            }
            _ => out.fill(0),
        }
        Ok(())
    }
}

impl Converter {
    /// Fills `out` with `out.len() / item` elements of the source column at byte `offset`: rows
    /// of a row-major matrix of `src_cols` columns. Reads a band of the following columns
    /// (`stride` apart, up to the end of the matrix row) with one read per element of `out`,
    /// keeps it transposed, and serves the next output rows from it.
    #[allow(clippy::too_many_arguments)]
    fn transposed(
        &mut self,
        sources: &SourceMap,
        t: TensorView<'_>,
        id: usize,
        offset: u64,
        src_cols: u64,
        stride: u64,
        out: &mut [u8],
    ) -> Result<(), ExecuteError> {
        let item = t.dtype.size();
        let (elem, width) = (offset / item as u64, out.len() / item);
        let k = match self.band.row(id, elem, width, stride) {
            Some(k) => k,
            None => {
                // Columns left in this matrix row, and what fits the band.
                let left = (src_cols - elem % src_cols).div_ceil(stride.max(1));
                let rows = left.min((BAND_BYTES / out.len().max(1)).max(1) as u64);
                let run = ((rows - 1) * stride + 1) as usize * item;
                self.staging.resize(run, 0);
                self.band.bytes.resize(rows as usize * out.len(), 0);
                for i in 0..width {
                    sources.read(id, (elem + i as u64 * src_cols) * item as u64, &mut self.staging)?;
                    for r in 0..rows as usize {
                        let from = r * stride as usize * item;
                        let to = (r * width + i) * item;
                        self.band.bytes[to..to + item].copy_from_slice(&self.staging[from..from + item]);
                    }
                }
                self.band = Band { id, first: elem, width, stride, rows, bytes: std::mem::take(&mut self.band.bytes) };
                0
            }
        };
        let at = k as usize * out.len();
        out.copy_from_slice(&self.band.bytes[at..at + out.len()]);
        Ok(())
    }
}

/// Neighbouring segments of one source are read together when the bytes between them are at most
/// this many: a chunk of a column-split weight is one short stripe per row, and a read per row
/// costs more than the bytes it skips.
const COALESCE_GAP: u64 = 64 << 10;

/// Streams the bytes of one chunk through `sink`, in pieces of at most `buf.len()` bytes.
pub(crate) fn stream_chunk(
    t: TensorView<'_>,
    offsets: &[u64],
    sizes: &[u64],
    sources: &SourceMap,
    buf: &mut [u8],
    mut sink: impl FnMut(&[u8]) -> Result<(), ExecuteError>,
) -> Result<(), ExecuteError> {
    let item = t.dtype.size();
    // Keep pieces element-aligned so transforms see whole elements.
    let piece = (buf.len() / item).max(1) * item;
    let segs = segments(t.shape, t.dtype, t.recipe, offsets, sizes);
    // Casts and dequantizations: converted into `buf` piece by piece.
    let mut converter = Converter::default();
    let mut i = 0;
    while i < segs.len() {
        if let Segment { source: Some((id, off)), len, transform } = segs[i] {
            if transform.converts() {
                // Pieces of whole source bytes and scale blocks.
                let unit = transform.piece_elems() as usize * item;
                let piece = (buf.len() / unit).max(1) * unit;
                let (mut done, mut src) = (0u64, off);
                while done < len {
                    let n = ((len - done) as usize).min(piece);
                    let b = &mut buf[..n];
                    converter.convert(sources, t, id, src, transform, b)?;
                    sink(b)?;
                    done += n as u64;
                    src += transform.source_bytes(t.dtype, (n / item) as u64);
                }
                i += 1;
                continue;
            }
        }
        let run = coalesced_run(&segs[i..], piece as u64);
        if run > 1 {
            // One read covers the run; each segment's bytes are then cut out of it.
            let (Some((id, start)), Some(last)) = (segs[i].source, segs.get(i + run - 1)) else { break };
            let end = last.source.map_or(start, |(_, o)| o + last.len);
            let span = &mut buf[..(end - start) as usize];
            sources.read(id, start, span)?;
            for s in &segs[i..i + run] {
                let at = (s.source.map_or(start, |(_, o)| o) - start) as usize;
                let b = &mut span[at..at + s.len as usize];
                apply_transform(s.transform, t.dtype, b);
                sink(b)?;
            }
            i += run;
            continue;
        }
        let Segment { source, len, transform } = segs[i];
        let mut done = 0u64;
        while done < len {
            let n = ((len - done) as usize).min(piece);
            let b = &mut buf[..n];
            match source {
                Some((id, off)) => {
                    sources.read(id, off + done, b)?;
                    apply_transform(transform, t.dtype, b);
                }
                None => b.fill(0),
            }
            sink(b)?;
            done += n as u64;
        }
        i += 1;
    }
    Ok(())
}

/// How many segments from the first one read together: the same source, in increasing order,
/// gaps of at most [`COALESCE_GAP`], the whole span within `max_span` bytes.
fn coalesced_run(segs: &[Segment], max_span: u64) -> usize {
    let Some((id, start)) = segs.first().and_then(|s| s.source) else { return 1 };
    // Conversions read source bytes of another size: segment by segment.
    let sized = |s: &Segment| !s.transform.converts();
    if !sized(&segs[0]) {
        return 1;
    }
    let mut end = start + segs[0].len;
    let mut n = 1;
    for s in &segs[1..] {
        match s.source {
            Some((sid, off))
                if sid == id
                    && sized(s)
                    && off >= end
                    && off - end <= COALESCE_GAP
                    && off + s.len - start <= max_span =>
            {
                end = off + s.len;
                n += 1;
            }
            _ => break,
        }
    }
    if end - start > max_span {
        return 1;
    }
    n
}
