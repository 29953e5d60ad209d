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
}

/// A run of consecutive output rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RowBlock {
    pub rows: u64,
    /// `(source tensor id, first source row)`, or `None` for zero rows.
    pub source: Option<(usize, u64)>,
    pub transform: Transform,
}

impl RowBlock {
    /// `rows` rows of source `id` starting at `first_row`.
    pub fn copy(id: usize, first_row: u64, rows: u64) -> RowBlock {
        RowBlock { rows, source: Some((id, first_row)), transform: Transform::Identity }
    }

    /// `rows` zero rows.
    pub fn zeros(rows: u64) -> RowBlock {
        RowBlock { rows, source: None, transform: Transform::Identity }
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
                source: b.source.map(|(id, first)| (id, first + (lo - block_start))),
                transform: b.transform,
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
    pub len: u64,
    pub transform: Transform,
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
    // Box along dim 0, and along dim 1 (column stripe) when the tensor has one; further dims are whole.
    let (row0, nrows) = (offsets.first().copied().unwrap_or(0), sizes.first().copied().unwrap_or(1));
    let inner: u64 = shape.iter().skip(2).product();
    let (col0, ncols) = if shape.len() >= 2 { (offsets[1], sizes[1]) } else { (0, 1) };
    let full_width = shape.len() < 2 || (col0 == 0 && ncols == shape[1]);
    let stripe_off = col0 * inner * item;
    let stripe_len = if shape.len() >= 2 { ncols * inner * item } else { item };
    let row_bytes = elems_per_row.max(1) * item;

    let mut out: Vec<Segment> = Vec::new();
    let mut push = |seg: Segment| {
        if seg.len == 0 {
            return;
        }
        if let Some(last) = out.last_mut() {
            let contiguous = match (last.source, seg.source) {
                (Some((a, off_a)), Some((b, off_b))) => a == b && off_a + last.len == off_b,
                (None, None) => true,
                _ => false,
            };
            if contiguous && last.transform == seg.transform {
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
                None => push(Segment { source: None, len: (hi - lo) * stripe_len, transform: block.transform }),
                Some((id, first)) => {
                    let src_row = first + (lo - block_start);
                    if full_width {
                        push(Segment {
                            source: Some((id, src_row * row_bytes)),
                            len: (hi - lo) * row_bytes,
                            transform: block.transform,
                        });
                    } else {
                        for k in 0..(hi - lo) {
                            push(Segment {
                                source: Some((id, (src_row + k) * row_bytes + stripe_off)),
                                len: stripe_len,
                                transform: block.transform,
                            });
                        }
                    }
                }
            }
        }
        block_start = block_end;
    }
    out
}

/// Applies `transform` in place to `bytes` holding little-endian elements of `dtype`.
pub fn apply_transform(transform: Transform, dtype: DType, bytes: &mut [u8]) {
    match transform {
        Transform::Identity => {}
        Transform::SubtractOne => match dtype {
            DType::BF16 => {
                for e in bytes.chunks_exact_mut(2) {
                    let x = f32::from_bits(u32::from(u16::from_le_bytes([e[0], e[1]])) << 16);
                    e.copy_from_slice(&f32_to_bf16(x - 1.0).to_le_bytes());
                }
            }
            DType::F16 => {
                for e in bytes.chunks_exact_mut(2) {
                    let x = f16_to_f32(u16::from_le_bytes([e[0], e[1]]));
                    e.copy_from_slice(&f32_to_f16(x - 1.0).to_le_bytes());
                }
            }
            DType::F32 => {
                for e in bytes.chunks_exact_mut(4) {
                    let x = f32::from_le_bytes([e[0], e[1], e[2], e[3]]);
                    e.copy_from_slice(&(x - 1.0).to_le_bytes());
                }
            }
            DType::F64 => {
                for e in bytes.chunks_exact_mut(8) {
                    let mut a = [0u8; 8];
                    a.copy_from_slice(e);
                    e.copy_from_slice(&(f64::from_le_bytes(a) - 1.0).to_le_bytes());
                }
            }
            // The planner only attaches value transforms to 16/32/64-bit floats.
            _ => {}
        },
    }
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
mod tests {
    use super::*;

    #[test]
    fn bf16_subtract_one_rounds_like_torch() {
        // 1.0 − 1 = 0; 0.5 − 1 = −0.5; 3.0078125 (bf16 0x4040+) − 1 rounds to nearest even.
        let mut b = Vec::new();
        for v in [1.0f32, 0.5, 1.0078125, 256.0] {
            b.extend_from_slice(&f32_to_bf16(v).to_le_bytes());
        }
        apply_transform(Transform::SubtractOne, DType::BF16, &mut b);
        let got: Vec<f32> =
            b.chunks_exact(2).map(|e| f32::from_bits(u32::from(u16::from_le_bytes([e[0], e[1]])) << 16)).collect();
        assert_eq!(got, vec![0.0, -0.5, 0.0078125, 255.0]);
    }

    #[test]
    fn f16_round_trip_is_exact_for_all_finite_halves() {
        for h in 0u16..=0xFFFF {
            let f = f16_to_f32(h);
            if f.is_nan() {
                continue;
            }
            assert_eq!(f32_to_f16(f), h, "half {h:#06x}");
        }
    }

    #[test]
    fn segments_merge_full_rows_and_split_stripes() {
        // [4, 6] bf16 tensor = rows 0..2 of source 0 then rows 5..7 of source 1.
        let recipe = [RowBlock::copy(0, 0, 2), RowBlock::copy(1, 5, 2)];
        let segs = segments(&[4, 6], DType::BF16, &recipe, &[1, 0], &[2, 6]);
        assert_eq!(
            segs,
            vec![
                Segment { source: Some((0, 12)), len: 12, transform: Transform::Identity },
                Segment { source: Some((1, 60)), len: 12, transform: Transform::Identity },
            ]
        );
        // Column stripe [cols 3..6) of rows 0..2: one segment per row.
        let segs = segments(&[4, 6], DType::BF16, &recipe, &[0, 3], &[2, 3]);
        assert_eq!(segs.len(), 2);
        assert_eq!(segs[1], Segment { source: Some((0, 12 + 6)), len: 6, transform: Transform::Identity });
    }
}
