//! Recipes: how the rows of an output tensor are gathered from release tensors, and how a chunk
//! of it becomes a list of byte segments to copy.
//!
//! Every layout we write is a permutation/selection of *rows* (dim-0 slices) of source tensors,
//! optionally followed by zero rows (vocab padding) and an element-wise value transform. A source
//! tensor is viewed as `[-1, row_elems]` with the row length of the output, which also covers
//! packed expert tensors (`[E, 2F, H]` viewed as `[E·2F, H]`).

use crate::dtype::DType;

/// An element-wise value transform applied while copying.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Transform {
    /// Bytes as they are.
    Identity,
    /// `x − 1` computed as torch computes it for the dtype (in f32 for 16-bit floats, rounded to
    /// nearest even): zero-centred RMSNorm weights.
    SubtractOne,
    /// Elements of the source are of this float dtype and are converted to the output's as
    /// `tensor.to(dtype)` does: exactly when the output is wider, else one round to nearest even.
    Cast(DType),
    /// Block-scaled FP8 e4m3 → the output's dtype (bf16 or f32): element `[r, c]` of the source
    /// (rows as long as the output's) times `scale[r / rows, c / cols]` of the float32 source
    /// `scale`, one f32 multiply, then for bf16 one round (archs-2025.md §4.1).
    DequantFp8 { scale: u32, rows: u32, cols: u32 },
    /// MXFP4 → bf16 (archs-2025.md §4.2): the source holds two FP4 E2M1 codes a byte, low
    /// nibble first; element `i` (row-major over the output's rows) is `FP4[code] ·
    /// 2^(scales[i / 32] − 127)`, `scales` a u8 source with one E8M0 exponent per 32 elements.
    DequantMxfp4 { scales: u32 },
    /// The rows are columns of a row-major source matrix of `src_cols` columns (and as many rows
    /// as an output row has elements): output row `k` of the block is column `c + k·col_stride`,
    /// where the block's `source` names the element offset of (row 0, column `c`) and its
    /// `stride` equals `col_stride`. Packed experts stored `[E, in, out]` (gpt-oss and
    /// Qwen3-VL-MoE in bf16).
    Transpose { src_cols: u32, col_stride: u32 },
}

/// Elements of MXFP4 that share one scale.
pub const MXFP4_BLOCK: u64 = 32;

impl Transform {
    /// Source bytes holding `elems` output elements of dtype `out` (an even count for MXFP4).
    pub fn source_bytes(self, out: DType, elems: u64) -> u64 {
        match self {
            Transform::Cast(from) => elems * from.size() as u64,
            Transform::DequantFp8 { .. } => elems,
            Transform::DequantMxfp4 { .. } => elems / 2,
            // The next element of an output row is the next row of the source matrix.
            Transform::Transpose { src_cols, .. } => elems * u64::from(src_cols) * out.size() as u64,
            _ => elems * out.size() as u64,
        }
    }

    /// Output elements per unit a converted piece must be a multiple of (whole source bytes,
    /// and for MXFP4 whole scale blocks), short of the end of a segment.
    pub fn piece_elems(self) -> u64 {
        match self {
            Transform::DequantMxfp4 { .. } => MXFP4_BLOCK,
            _ => 1,
        }
    }

    /// Whether the output is computed from source bytes read aside (of another size, or with
    /// other tensors' values), not transformed where they land.
    pub fn converts(self) -> bool {
        matches!(
            self,
            Transform::Cast(_)
                | Transform::DequantFp8 { .. }
                | Transform::DequantMxfp4 { .. }
                | Transform::Transpose { .. }
        )
    }
}

/// FP4 E2M1 values by code (OCP MX spec): sign bit 3, then exponent 2 bits, mantissa 1 bit.
const FP4_E2M1: [f32; 16] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0];

/// The largest E8M0 scale for which every FP4 value times it stays finite in bf16
/// (6 · 2^(252 − 127) = 1.5 · 2^127); 255 is NaN.
pub const MXFP4_MAX_SCALE: u8 = 252;

/// Dequantizes MXFP4 codes `src` (two elements a byte, low nibble first), the first being element
/// `first` (a multiple of 2) of the tensor, into bf16 `out`; `scales[k]` is the E8M0 exponent of
/// elements `[32·(base_block + k), …)`. Exact: every product is a bf16 value for scales up to
/// [`MXFP4_MAX_SCALE`] (larger ones give ±inf; the caller rejects them first).
pub fn dequant_mxfp4_into(src: &[u8], first: u64, scales: &[u8], base_block: u64, out: &mut [u8]) {
    dequant_mxfp4_as(DType::BF16, src, first, scales, base_block, out);
}

/// [`dequant_mxfp4_into`] into `out` elements of `dtype`: bfloat16, or float32 (a code times a
/// power of two is exact in either, as torch's `QuantizedHuggingFaceStorageReader` computes it
/// with `ldexp` in its target dtype).
pub fn dequant_mxfp4_as(dtype: DType, src: &[u8], first: u64, scales: &[u8], base_block: u64, out: &mut [u8]) {
    let size = if dtype == DType::F32 { 4 } else { 2 };
    for (k, o) in out.chunks_exact_mut(size).enumerate() {
        let i = first + k as u64;
        // Element `i`'s byte, counted from element `first`'s (which may hold its high nibble).
        let byte = src.get(((first % 2 + k as u64) / 2) as usize).copied().unwrap_or(0);
        let code = if i.is_multiple_of(2) { byte & 0x0F } else { byte >> 4 };
        let e = scales.get((i / MXFP4_BLOCK - base_block) as usize).copied().unwrap_or(255);
        let v = if e == 255 { f32::NAN } else { FP4_E2M1[code as usize] * 2f32.powi(i32::from(e) - 127) };
        if dtype == DType::F32 {
            o.copy_from_slice(&v.to_le_bytes());
        } else {
            o.copy_from_slice(&f32_to_bf16(v).to_le_bytes());
        }
    }
}

/// The float32 block scales of one FP8 weight, `[ceil(M / rows), ceil(N / cols)]`, for
/// [`dequant_fp8_into`].
#[derive(Clone, Copy, Debug)]
pub struct Fp8Scales<'a> {
    pub values: &'a [f32],
    /// Elements per weight row (`N`).
    pub row_elems: u64,
    /// Block size `[rows, cols]`.
    pub block: [u64; 2],
}

/// Dequantizes FP8 e4m3 codes `src`, the first being element `first` of the weight (row-major),
/// into bf16 `out` (two bytes per code), as `(w.float() * scale).to(torch.bfloat16)` does; see
/// [`dequant_fp8_f32_into`] for float32.
///
/// A block has one scale, so each of its 256 possible codes has one result: for blocks of at
/// least 1,024 elements the results are tabulated once per block (of the block row at hand) and
/// the codes looked up, the same arithmetic done 256 times instead of once per element.
pub fn dequant_fp8_into(src: &[u8], first: u64, scales: &Fp8Scales<'_>, out: &mut [u8]) {
    let (n, [b0, b1]) = (scales.row_elems.max(1), scales.block);
    let (b0, b1) = (b0.max(1), b1.max(1));
    let scale_cols = n.div_ceil(b1) as usize;
    let lut = e4m3_table();
    let tabulate = b0 * b1 >= 1024;
    // Tables of the current block row, by column block.
    let (mut block_row, mut tables, mut have) = (u64::MAX, Vec::new(), Vec::new());
    let mut i = 0usize;
    let count = src.len().min(out.len() / 2);
    while i < count {
        let at = first + i as u64;
        let (r, c) = (at / n, at % n);
        // A run of one scale: to the end of the column block or of the row.
        let run = ((b1 - c % b1).min(n - c) as usize).min(count - i);
        let bc = (c / b1) as usize;
        let s = scales.values.get((r / b0) as usize * scale_cols + bc).copied().unwrap_or(f32::NAN);
        let (codes, dst) = (&src[i..i + run], &mut out[2 * i..2 * (i + run)]);
        if tabulate {
            if r / b0 != block_row {
                block_row = r / b0;
                tables.resize(scale_cols, [0u16; 256]);
                have.clear();
                have.resize(scale_cols, false);
            }
            if !have[bc] {
                tables[bc] = std::array::from_fn(|b| f32_to_bf16(lut[b] * s));
                have[bc] = true;
            }
            let table = &tables[bc];
            // Eight codes a step: one 16-byte store instead of eight 2-byte ones.
            let (head, tail) = (codes.chunks_exact(8), codes.len() / 8 * 8);
            for (c8, o) in head.zip(dst.chunks_exact_mut(16)) {
                let mut w = [0u8; 16];
                for (k, code) in c8.iter().enumerate() {
                    w[2 * k..2 * k + 2].copy_from_slice(&table[*code as usize].to_le_bytes());
                }
                o.copy_from_slice(&w);
            }
            for (code, o) in codes[tail..].iter().zip(dst[2 * tail..].chunks_exact_mut(2)) {
                o.copy_from_slice(&table[*code as usize].to_le_bytes());
            }
        } else {
            for (code, o) in codes.iter().zip(dst.chunks_exact_mut(2)) {
                o.copy_from_slice(&f32_to_bf16(lut[*code as usize] * s).to_le_bytes());
            }
        }
        i += run;
    }
}

/// [`dequant_fp8_into`] into float32 `out` (four bytes per code), as `w.float() * scale` does
/// (torch's `QuantizedHuggingFaceStorageReader` with `target_dtype=torch.float32`): the product,
/// unrounded.
pub fn dequant_fp8_f32_into(src: &[u8], first: u64, scales: &Fp8Scales<'_>, out: &mut [u8]) {
    let (n, [b0, b1]) = (scales.row_elems.max(1), scales.block);
    let (b0, b1) = (b0.max(1), b1.max(1));
    let scale_cols = n.div_ceil(b1) as usize;
    let lut = e4m3_table();
    let count = src.len().min(out.len() / 4);
    let mut i = 0usize;
    while i < count {
        let at = first + i as u64;
        let (r, c) = (at / n, at % n);
        let run = ((b1 - c % b1).min(n - c) as usize).min(count - i);
        let s = scales.values.get((r / b0) as usize * scale_cols + (c / b1) as usize).copied().unwrap_or(f32::NAN);
        for (code, o) in src[i..i + run].iter().zip(out[4 * i..4 * (i + run)].chunks_exact_mut(4)) {
            o.copy_from_slice(&(lut[*code as usize] * s).to_le_bytes());
        }
        i += run;
    }
}

/// Every e4m3 code's value (a 1 KiB table: a lookup beats decoding bits per element).
fn e4m3_table() -> &'static [f32; 256] {
    static TABLE: std::sync::OnceLock<[f32; 256]> = std::sync::OnceLock::new();
    TABLE.get_or_init(|| std::array::from_fn(|b| f8e4m3_to_f32(b as u8)))
}

/// Float dtypes a [`Transform::Cast`] converts between.
pub fn can_cast(from: DType, to: DType) -> bool {
    let float = |d| matches!(d, DType::F16 | DType::BF16 | DType::F32 | DType::F8E4M3);
    float(from) && matches!(to, DType::F16 | DType::BF16 | DType::F32)
}

/// A run of consecutive output rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RowBlock {
    pub rows: u64,
    /// `(source tensor id, first source row)`, or `None` for zero rows.
    pub source: Option<(usize, u64)>,
    pub transform: Transform,
    /// Source rows between consecutive output rows: 1, or 2 to take every other row of a
    /// row-interleaved source (gpt-oss's gate/up rows).
    pub stride: u32,
}

impl RowBlock {
    /// `rows` rows of source `id` starting at `first_row`.
    pub fn copy(id: usize, first_row: u64, rows: u64) -> RowBlock {
        RowBlock { rows, source: Some((id, first_row)), transform: Transform::Identity, stride: 1 }
    }

    /// `rows` rows of source `id`: `first_row`, `first_row + stride`, …
    pub fn strided(id: usize, first_row: u64, rows: u64, stride: u32) -> RowBlock {
        RowBlock { rows, source: Some((id, first_row)), transform: Transform::Identity, stride: stride.max(1) }
    }

    /// `rows` columns of a row-major matrix of `src_cols` columns in source `id`, from the
    /// element at `first` (row 0 of the first column), every `col_stride`-th column.
    pub fn transposed(id: usize, first: u64, rows: u64, src_cols: u32, col_stride: u32) -> RowBlock {
        RowBlock {
            rows,
            source: Some((id, first)),
            transform: Transform::Transpose { src_cols, col_stride },
            stride: col_stride.max(1),
        }
    }

    /// `rows` zero rows.
    pub fn zeros(rows: u64) -> RowBlock {
        RowBlock { rows, source: None, transform: Transform::Identity, stride: 1 }
    }
}

/// Rows `[start, start + rows)` of the tensor `recipe` builds, as a recipe of their own.
pub fn slice_recipe(recipe: &[RowBlock], start: u64, rows: u64) -> Vec<RowBlock> {
    let mut out = Vec::new();
    let mut block_start = 0u64;
    for b in recipe {
        let lo = start.max(block_start);
        let hi = (start + rows).min(block_start + b.rows);
        if lo < hi {
            out.push(RowBlock {
                rows: hi - lo,
                source: b.source.map(|(id, first)| (id, first + (lo - block_start) * u64::from(b.stride))),
                transform: b.transform,
                stride: b.stride,
            });
        }
        block_start += b.rows;
    }
    out
}

/// A contiguous byte range of the output chunk, in output order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Segment {
    /// `(source tensor id, byte offset within that tensor's data)`, or `None` for zeros.
    pub source: Option<(usize, u64)>,
    /// Output bytes.
    pub len: u64,
    pub transform: Transform,
}

impl Segment {
    /// Source bytes the segment reads, for an output of `out` (`len` unless it converts).
    pub fn source_len(&self, out: DType) -> u64 {
        self.transform.source_bytes(out, self.len / out.size() as u64)
    }
}

/// Number of dim-0 rows of a shape (a 0-d tensor is one row of one element).
pub fn rows_of(shape: &[u64]) -> u64 {
    shape.first().copied().unwrap_or(1)
}

/// Elements per dim-0 row, `prod(shape[1:])`.
pub fn row_elems(shape: &[u64]) -> u64 {
    shape.iter().skip(1).product()
}

/// The byte segments of the box `offsets/sizes` of a tensor of `shape` built by `recipe`,
/// in C order. Consecutive full-width rows from one source merge into one segment.
pub fn segments(shape: &[u64], dtype: DType, recipe: &[RowBlock], offsets: &[u64], sizes: &[u64]) -> Vec<Segment> {
    let item = dtype.size() as u64;
    let elems_per_row = row_elems(shape);
    // Box along dim 0; within each row, the runs the box's other dims cut out of it.
    let (row0, nrows) = (offsets.first().copied().unwrap_or(0), sizes.first().copied().unwrap_or(1));
    let runs = row_runs(shape, offsets, sizes);
    let full_width = runs.as_slice() == [(0, elems_per_row.max(1))];
    let row_bytes = elems_per_row.max(1) * item;
    let box_row_bytes: u64 = runs.iter().map(|&(_, n)| n * item).sum();

    let mut out: Vec<Segment> = Vec::new();
    let mut push = |seg: Segment| {
        if seg.len == 0 {
            return;
        }
        if let Some(last) = out.last_mut() {
            let contiguous = match (last.source, seg.source) {
                (Some((a, off_a)), Some((b, off_b))) => a == b && off_a + last.source_len(dtype) == off_b,
                (None, None) => true,
                _ => false,
            };
            // A transposed row's elements are not one run of the source.
            let merges = !matches!(seg.transform, Transform::Transpose { .. });
            if contiguous && merges && last.transform == seg.transform {
                last.len += seg.len;
                return;
            }
        }
        out.push(seg);
    };

    let mut block_start = 0u64;
    for block in recipe {
        let block_end = block_start + block.rows;
        let lo = row0.max(block_start);
        let hi = (row0 + nrows).min(block_end);
        if lo < hi {
            match block.source {
                None => push(Segment { source: None, len: (hi - lo) * box_row_bytes, transform: block.transform }),
                Some((id, first)) if matches!(block.transform, Transform::Transpose { .. }) => {
                    // `first` is an element offset; output row k is source column first + k·stride,
                    // its element c the source's row c.
                    let Transform::Transpose { src_cols, col_stride } = block.transform else { continue };
                    for k in (lo - block_start)..(hi - block_start) {
                        for &(c0, n) in &runs {
                            let elem = first + k * u64::from(col_stride) + c0 * u64::from(src_cols);
                            push(Segment {
                                source: Some((id, elem * item)),
                                len: n * item,
                                transform: block.transform,
                            });
                        }
                    }
                }
                Some((id, first)) => {
                    // Source offsets count source bytes, which a conversion makes of another size.
                    let src_bytes = |elems: u64| block.transform.source_bytes(dtype, elems);
                    let stride = u64::from(block.stride.max(1));
                    let src_row = first + (lo - block_start) * stride;
                    let src_row_bytes = src_bytes(elems_per_row.max(1));
                    if full_width && stride == 1 {
                        push(Segment {
                            source: Some((id, src_row * src_row_bytes)),
                            len: (hi - lo) * row_bytes,
                            transform: block.transform,
                        });
                    } else {
                        for k in 0..(hi - lo) {
                            for &(c0, n) in &runs {
                                push(Segment {
                                    source: Some((id, (src_row + k * stride) * src_row_bytes + src_bytes(c0))),
                                    len: n * item,
                                    transform: block.transform,
                                });
                            }
                        }
                    }
                }
            }
        }
        block_start = block_end;
    }
    out
}

/// The runs `(first element, elements)` of one dim-0 row that the box `offsets/sizes` covers,
/// in C order: one run for a whole row or a column stripe (dim 1), one per index of the dims
/// before the last cut one otherwise (an FSDP2 or TP cut of dim 2 of stacked experts).
fn row_runs(shape: &[u64], offsets: &[u64], sizes: &[u64]) -> Vec<(u64, u64)> {
    if shape.len() < 2 {
        return vec![(0, 1)];
    }
    let dims = shape.len();
    // Elements per step of each dim, within a row (dim d ≥ 1).
    let step = |d: usize| shape[d + 1..].iter().product::<u64>();
    let cut = (1..dims).rev().find(|&d| offsets[d] != 0 || sizes[d] != shape[d]);
    let Some(last) = cut else { return vec![(0, row_elems(shape))] };
    let run = sizes[last] * step(last);
    // Every index of dims 1..last within the box, in C order.
    let mut runs = Vec::new();
    let outer: Vec<usize> = (1..last).collect();
    let count: u64 = outer.iter().map(|&d| sizes[d]).product();
    for mut i in 0..count {
        let mut start = offsets[last] * step(last);
        for &d in outer.iter().rev() {
            start += (offsets[d] + i % sizes[d]) * step(d);
            i /= sizes[d];
        }
        runs.push((start, run));
    }
    runs
}

/// Adds `delta` in place to every little-endian float of `dtype` in `bytes`, as torch does
/// (16-bit floats computed in f32 and rounded to nearest even). `weight − 1` of zero-centred
/// norms, and `+ 1` when exporting them back. Other dtypes are left as they are (the planner
/// attaches value transforms to floats only).
pub fn add_scalar(dtype: DType, bytes: &mut [u8], delta: f32) {
    match dtype {
        DType::BF16 => {
            for e in bytes.chunks_exact_mut(2) {
                let x = f32::from_bits(u32::from(u16::from_le_bytes([e[0], e[1]])) << 16);
                e.copy_from_slice(&f32_to_bf16(x + delta).to_le_bytes());
            }
        }
        DType::F16 => {
            for e in bytes.chunks_exact_mut(2) {
                let x = f16_to_f32(u16::from_le_bytes([e[0], e[1]]));
                e.copy_from_slice(&f32_to_f16(x + delta).to_le_bytes());
            }
        }
        DType::F32 => {
            for e in bytes.chunks_exact_mut(4) {
                let x = f32::from_le_bytes([e[0], e[1], e[2], e[3]]);
                e.copy_from_slice(&(x + delta).to_le_bytes());
            }
        }
        DType::F64 => {
            for e in bytes.chunks_exact_mut(8) {
                let mut a = [0u8; 8];
                a.copy_from_slice(e);
                e.copy_from_slice(&(f64::from_le_bytes(a) + f64::from(delta)).to_le_bytes());
            }
        }
        _ => {}
    }
}

/// Applies a same-size `transform` in place to `bytes` holding little-endian elements of
/// `dtype` (a cast, which changes the size, goes through [`cast_into`]).
pub fn apply_transform(transform: Transform, dtype: DType, bytes: &mut [u8]) {
    match transform {
        Transform::Identity
        | Transform::Cast(_)
        | Transform::DequantFp8 { .. }
        | Transform::DequantMxfp4 { .. }
        | Transform::Transpose { .. } => {}
        Transform::SubtractOne => add_scalar(dtype, bytes, -1.0),
    }
}

/// Converts the little-endian `from` elements of `src` into `to` elements in `out` (one element
/// out per element in), as torch's `Tensor.to` does; `out` sets the count. Pairs outside
/// [`can_cast`] fill `out` with zeros (the planner never makes them).
pub fn cast_into(from: DType, to: DType, src: &[u8], out: &mut [u8]) {
    let n = out.len() / to.size();
    let wide = |i: usize| -> f32 {
        let e = &src[i * from.size()..];
        match from {
            DType::BF16 => f32::from_bits(u32::from(u16::from_le_bytes([e[0], e[1]])) << 16),
            DType::F16 => f16_to_f32(u16::from_le_bytes([e[0], e[1]])),
            DType::F32 => f32::from_le_bytes([e[0], e[1], e[2], e[3]]),
            DType::F8E4M3 => f8e4m3_to_f32(e[0]),
            _ => 0.0,
        }
    };
    if !can_cast(from, to) || src.len() < n * from.size() {
        out.fill(0);
        return;
    }
    // The two casts a checkpoint meets most (masters widened, model copies rounded) get loops
    // without a per-element dtype match, which the compiler vectorizes.
    match (from, to) {
        (DType::BF16, DType::F32) => {
            for (o, e) in out.chunks_exact_mut(4).zip(src.chunks_exact(2)) {
                o.copy_from_slice(&(u32::from(u16::from_le_bytes([e[0], e[1]])) << 16).to_le_bytes());
            }
            return;
        }
        (DType::F32, DType::BF16) => {
            for (o, e) in out.chunks_exact_mut(2).zip(src.chunks_exact(4)) {
                o.copy_from_slice(&f32_to_bf16(f32::from_le_bytes([e[0], e[1], e[2], e[3]])).to_le_bytes());
            }
            return;
        }
        _ => {}
    }
    match to {
        DType::BF16 => {
            for (i, o) in out.chunks_exact_mut(2).enumerate() {
                o.copy_from_slice(&f32_to_bf16(wide(i)).to_le_bytes());
            }
        }
        DType::F16 => {
            for (i, o) in out.chunks_exact_mut(2).enumerate() {
                o.copy_from_slice(&f32_to_f16(wide(i)).to_le_bytes());
            }
        }
        _ => {
            for (i, o) in out.chunks_exact_mut(4).enumerate() {
                o.copy_from_slice(&wide(i).to_le_bytes());
            }
        }
    }
}

/// OCP FP8 E4M3 (`float8_e4m3fn`: bias 7, no infinities, `S.1111.111` is NaN) → f32, exactly.
pub fn f8e4m3_to_f32(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let exp = i32::from((b >> 3) & 0x0F);
    let man = f32::from(b & 0x07);
    if exp == 0x0F && b & 0x07 == 0x07 {
        // torch widens the NaN with its sign.
        return f32::from_bits(if b & 0x80 != 0 { 0xFFC0_0000 } else { 0x7FC0_0000 });
    }
    let magnitude = if exp == 0 { man / 8.0 * 2f32.powi(-6) } else { (1.0 + man / 8.0) * 2f32.powi(exp - 7) };
    sign * magnitude
}

/// f32 → bf16 with round-to-nearest-even, NaN kept quiet (what torch does).
pub fn f32_to_bf16(x: f32) -> u16 {
    let bits = x.to_bits();
    if x.is_nan() {
        return ((bits >> 16) as u16) | 0x0040;
    }
    let rounding = 0x7FFF + ((bits >> 16) & 1);
    (bits.wrapping_add(rounding) >> 16) as u16
}

/// IEEE half → f32 (exact).
pub fn f16_to_f32(h: u16) -> f32 {
    let sign = u32::from(h >> 15) << 31;
    let exp = u32::from((h >> 10) & 0x1F);
    let man = u32::from(h & 0x3FF);
    let bits = match (exp, man) {
        (0, 0) => sign,
        (0, m) => {
            // Subnormal: value = m · 2^-24.
            let v = m as f32 * f32::from_bits(0x3380_0000);
            return if sign != 0 { -v } else { v };
        }
        (0x1F, 0) => sign | 0x7F80_0000,
        (0x1F, m) => sign | 0x7FC0_0000 | (m << 13),
        (e, m) => sign | ((e + 112) << 23) | (m << 13),
    };
    f32::from_bits(bits)
}

/// f32 → IEEE half with round-to-nearest-even.
pub fn f32_to_f16(x: f32) -> u16 {
    let bits = x.to_bits();
    let sign = ((bits >> 16) & 0x8000) as u16;
    if x.is_nan() {
        return sign | 0x7E00;
    }
    let exp = ((bits >> 23) & 0xFF) as i32;
    let man = bits & 0x7F_FFFF;
    let e = exp - 127 + 15;
    if e >= 0x1F {
        return sign | 0x7C00;
    }
    if e <= 0 {
        if e < -10 {
            return sign;
        }
        let m = man | 0x80_0000;
        let shift = (14 - e) as u32;
        let half = 1u32 << (shift - 1);
        let rem = m & ((1u32 << shift) - 1);
        let mut r = m >> shift;
        if rem > half || (rem == half && (r & 1) == 1) {
            r += 1;
        }
        return sign | r as u16;
    }
    let mut r = ((e as u32) << 10) | (man >> 13);
    let rem = man & 0x1FFF;
    if rem > 0x1000 || (rem == 0x1000 && (r & 1) == 1) {
        r += 1; // may carry into the exponent, which is the correct rounding to the next binade/inf
    }
    sign | r as u16
}

#[cfg(test)]
mod tests;
