//! Row recipes: segments, casts and dequantizations against values worked out by hand.

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
fn casts_round_once_to_nearest_even() {
    // bf16 → f32 is exact; f32 → bf16 rounds halfway cases to even.
    let src: Vec<u8> = [0x3F80u16, 0xC000, 0x0001].iter().flat_map(|h| h.to_le_bytes()).collect();
    let mut out = vec![0u8; 12];
    cast_into(DType::BF16, DType::F32, &src, &mut out);
    let got: Vec<u32> = out.chunks_exact(4).map(|e| u32::from_le_bytes([e[0], e[1], e[2], e[3]])).collect();
    assert_eq!(got, vec![0x3F80_0000, 0xC000_0000, 0x0001_0000]);
    let src: Vec<u8> = [0x3F80_8000u32, 0x3F81_8000, 0x3F80_8001].iter().flat_map(|w| w.to_le_bytes()).collect();
    let mut out = vec![0u8; 6];
    cast_into(DType::F32, DType::BF16, &src, &mut out);
    let got: Vec<u16> = out.chunks_exact(2).map(|e| u16::from_le_bytes([e[0], e[1]])).collect();
    assert_eq!(got, vec![0x3F80, 0x3F82, 0x3F81]);
}

#[test]
fn e4m3_decodes_per_the_ocp_spec() {
    // 0x38 = 2^0 · 1.0; 0x01 = smallest subnormal 2^-9; 0x7E = 448 (largest); 0x7F NaN.
    assert_eq!(f8e4m3_to_f32(0x38), 1.0);
    assert_eq!(f8e4m3_to_f32(0xB8), -1.0);
    assert_eq!(f8e4m3_to_f32(0x01), 2f32.powi(-9));
    assert_eq!(f8e4m3_to_f32(0x7E), 448.0);
    assert!(f8e4m3_to_f32(0x7F).is_nan() && f8e4m3_to_f32(0xFF).is_nan());
    assert_eq!(f8e4m3_to_f32(0x80).to_bits(), (-0.0f32).to_bits());
}

#[test]
fn fp8_dequantizes_to_f32_unrounded() {
    // 2 × 4 codes in blocks of 1 × 2: four scales.
    let codes = [0x38u8, 0x39, 0x3A, 0xB8, 0x40, 0x41, 0x00, 0x7E];
    let values = [0.3f32, 1.0, 3.0e-3, -2.5];
    let scales = Fp8Scales { values: &values, row_elems: 4, block: [1, 2] };
    let mut out = [0u8; 32];
    dequant_fp8_f32_into(&codes, 0, &scales, &mut out);
    let got: Vec<f32> = out.chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect();
    let want: Vec<f32> = codes.iter().enumerate().map(|(i, c)| f8e4m3_to_f32(*c) * values[i / 2]).collect();
    assert_eq!(got, want);
    assert_ne!(got[0], f32::from_bits(u32::from(f32_to_bf16(got[0])) << 16), "a value bf16 would round");
    // From the middle of the weight: element 5 onwards.
    let mut part = [0u8; 12];
    dequant_fp8_f32_into(&codes[5..8], 5, &scales, &mut part);
    assert_eq!(part[..], out[20..]);
}

#[test]
fn fp8_dequantizes_by_block_with_ragged_edges() {
    // A [3, 5] weight in blocks of [2, 2]: scales [2, 3]; codes 0x38 (1.0) everywhere but
    // [2, 4] = 0xB8 (−1.0); scale of block (r/2, c/2) = 1 + 3·(r/2) + c/2.
    let mut codes = vec![0x38u8; 15];
    codes[14] = 0xB8;
    let values: Vec<f32> = (0..6).map(|i| 1.0 + i as f32).collect();
    let scales = Fp8Scales { values: &values, row_elems: 5, block: [2, 2] };
    let mut out = vec![0u8; 30];
    dequant_fp8_into(&codes, 0, &scales, &mut out);
    let got: Vec<f32> =
        out.chunks_exact(2).map(|e| f32::from_bits(u32::from(u16::from_le_bytes([e[0], e[1]])) << 16)).collect();
    assert_eq!(got, vec![1., 1., 2., 2., 3., 1., 1., 2., 2., 3., 4., 4., 5., 5., -6.]);
    // From the middle: element 7 onwards.
    let mut part = vec![0u8; 6];
    dequant_fp8_into(&codes[7..10], 7, &scales, &mut part);
    assert_eq!(&part[..], &out[14..20]);
    // One f32 product, then one rounding: 1.125 (e4m3 0x39) × 1.0078125 rounds in bf16.
    let values = [1.0078125f32];
    let scales = Fp8Scales { values: &values, row_elems: 1, block: [128, 128] };
    dequant_fp8_into(&[0x39], 0, &scales, &mut part[..2]);
    assert_eq!(u16::from_le_bytes([part[0], part[1]]), f32_to_bf16(1.125 * 1.0078125));
}

#[test]
fn fp8_tables_give_the_direct_results() {
    // Blocks of 32×32 (tabulated) against the same scales computed per element (blocks of
    // 32×32 described to the direct path as one row of 32 elements per block... by hand).
    let (m, n) = (70u64, 90u64);
    let codes: Vec<u8> = (0..m * n).map(|i| (i * 37 % 251) as u8).collect();
    let values: Vec<f32> = (0..3 * 3).map(|i| 0.001 + i as f32 * 0.37).collect();
    let scales = Fp8Scales { values: &values, row_elems: n, block: [32, 32] };
    let mut out = vec![0u8; 2 * codes.len()];
    dequant_fp8_into(&codes, 0, &scales, &mut out);
    for (i, code) in codes.iter().enumerate() {
        let (r, c) = (i as u64 / n, i as u64 % n);
        let s = values[((r / 32) * 3 + c / 32) as usize];
        let want = f32_to_bf16(f8e4m3_to_f32(*code) * s);
        assert_eq!(u16::from_le_bytes([out[2 * i], out[2 * i + 1]]), want, "element {i}");
    }
}

#[test]
fn mxfp4_decodes_low_nibble_first_with_e8m0_scales() {
    // Codes 0x21: element 0 = FP4[1] = 0.5, element 1 = FP4[2] = 1.0; 0xF8: −0.0, −6.0.
    // Block 0 scaled by 2^(128−127) = 2, block 1 (elements 32..64) by 2^(125−127) = 1/4.
    let mut src = vec![0u8; 32];
    src[0] = 0x21;
    src[1] = 0xF8;
    src[16] = 0x7F; // elements 32, 33: FP4[15] = −6.0, FP4[7] = 6.0
    let scales = [128u8, 125];
    let mut out = vec![0u8; 128];
    dequant_mxfp4_into(&src, 0, &scales, 0, &mut out);
    let v = |i: usize| u16::from_le_bytes([out[2 * i], out[2 * i + 1]]);
    let f = |i: usize| f32::from_bits(u32::from(v(i)) << 16);
    assert_eq!((f(0), f(1), f(3), f(32), f(33)), (1.0, 2.0, -12.0, -1.5, 1.5));
    assert_eq!(v(2), 0x8000, "−0.0 keeps its sign");
    // From element 32 on, with only block 1's scale.
    let mut part = vec![0u8; 4];
    dequant_mxfp4_into(&src[16..17], 32, &scales[1..], 1, &mut part);
    assert_eq!(&part[..], &out[64..68]);
}

#[test]
fn strided_blocks_take_every_other_source_row() {
    // Rows 1, 3, 5 of a [6, 2] bf16 source as a [3, 2] output, then a slice of its last two.
    let recipe = [RowBlock::strided(0, 1, 3, 2)];
    let segs = segments(&[3, 2], DType::BF16, &recipe, &[0, 0], &[3, 2]);
    let offs: Vec<_> = segs.iter().map(|s| (s.source, s.len)).collect();
    assert_eq!(offs, vec![(Some((0, 4)), 4), (Some((0, 12)), 4), (Some((0, 20)), 4)]);
    assert_eq!(slice_recipe(&recipe, 1, 2), vec![RowBlock::strided(0, 3, 2, 2)]);
}

#[test]
fn transposed_blocks_read_columns() {
    // Output [3, 2] (f32) = columns 1, 3, 5 of a [2, 6] source matrix at element 12.
    let recipe = [RowBlock::transposed(0, 12 + 1, 3, 6, 2)];
    let segs = segments(&[3, 2], DType::F32, &recipe, &[0, 0], &[3, 2]);
    let offs: Vec<_> = segs.iter().map(|s| (s.source.map(|x| x.1 / 4), s.len)).collect();
    assert_eq!(offs, vec![(Some(13), 8), (Some(15), 8), (Some(17), 8)]);
    // Output column 1 only (a stripe): the source's row 1.
    let segs = segments(&[3, 2], DType::F32, &recipe, &[1, 1], &[2, 1]);
    let offs: Vec<_> = segs.iter().map(|s| (s.source.map(|x| x.1 / 4), s.len)).collect();
    assert_eq!(offs, vec![(Some(15 + 6), 4), (Some(17 + 6), 4)]);
    assert_eq!(slice_recipe(&recipe, 1, 2), vec![RowBlock::transposed(0, 15, 2, 6, 2)]);
}

#[test]
fn cast_segments_address_source_elements() {
    // A [2, 4] f32 output cast from a bf16 source: source offsets count 2-byte elements.
    let recipe = [RowBlock { transform: Transform::Cast(DType::BF16), ..RowBlock::copy(0, 1, 2) }];
    let segs = segments(&[2, 4], DType::F32, &recipe, &[0, 0], &[2, 4]);
    assert_eq!(segs, vec![Segment { source: Some((0, 8)), len: 32, transform: Transform::Cast(DType::BF16) }]);
    assert_eq!(segs[0].source_len(DType::F32), 16);
    let segs = segments(&[2, 4], DType::F32, &recipe, &[0, 2], &[2, 2]);
    assert_eq!(segs[1], Segment { source: Some((0, 16 + 4)), len: 8, transform: Transform::Cast(DType::BF16) });
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

/// Every box of a few 3-D and 4-D tensors, whichever dims it cuts: the segments read exactly
/// the box's elements, in C order.
#[test]
fn segments_of_any_box_are_its_elements_in_c_order() {
    for shape in [vec![2u64, 3, 4], vec![2, 2, 3, 2], vec![3, 1, 5]] {
        let strides: Vec<u64> = (0..shape.len()).map(|d| shape[d + 1..].iter().product()).collect();
        let ranges: Vec<Vec<(u64, u64)>> =
            shape.iter().map(|&n| (0..n).flat_map(|o| (1..=n - o).map(move |s| (o, s))).collect()).collect();
        let mut boxes: Vec<Vec<(u64, u64)>> = vec![vec![]];
        for options in &ranges {
            boxes = boxes.iter().flat_map(|b| options.iter().map(move |&r| [b.clone(), vec![r]].concat())).collect();
        }
        let recipe = [RowBlock::copy(0, 0, shape[0])];
        for b in boxes {
            let (offsets, sizes): (Vec<u64>, Vec<u64>) = b.iter().copied().unzip();
            let mut want = Vec::new();
            let count: u64 = sizes.iter().product();
            for mut i in 0..count {
                let mut flat = 0;
                for d in (0..shape.len()).rev() {
                    flat += (offsets[d] + i % sizes[d]) * strides[d];
                    i /= sizes[d];
                }
                want.push(flat);
            }
            let got: Vec<u64> = segments(&shape, DType::F32, &recipe, &offsets, &sizes)
                .iter()
                .flat_map(|s| {
                    let (_, at) = s.source.expect("copied");
                    (at / 4..(at + s.len) / 4).collect::<Vec<_>>()
                })
                .collect();
            assert_eq!(got, want, "shape {shape:?} box {offsets:?} {sizes:?}");
        }
    }
}
