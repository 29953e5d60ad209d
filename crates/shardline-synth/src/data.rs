//! The data: deterministic pseudo-random streams, one per tensor, through tables of normal
//! quantiles (bf16 values, their float32 widenings, or e4m3 codes).

use crate::model::*;
use crate::*;

const TABLE_LEN: usize = 1 << 16;

/// bf16 bit patterns of the 65 536 quantiles `mean + std · Φ⁻¹((i + ½) / 65 536)`: indexing it
/// with 16 uniform bits draws from a (finely quantised) normal distribution.
pub(crate) struct NormalTable(pub(crate) Box<[u16; TABLE_LEN]>);

impl NormalTable {
    pub(crate) fn new(mean: f64, std: f64) -> NormalTable {
        let mut table = Box::new([0u16; TABLE_LEN]);
        for (i, slot) in table.iter_mut().enumerate() {
            let p = (i as f64 + 0.5) / TABLE_LEN as f64;
            *slot = f32_to_bf16((mean + std * inverse_normal_cdf(p)) as f32);
        }
        NormalTable(table)
    }

    #[inline(always)]
    fn four(&self, r: u64) -> u64 {
        let t = &self.0;
        u64::from(t[r as u16 as usize])
            | u64::from(t[(r >> 16) as u16 as usize]) << 16
            | u64::from(t[(r >> 32) as u16 as usize]) << 32
            | u64::from(t[(r >> 48) as u16 as usize]) << 48
    }

    /// Two float32 values (little-endian) from the low 32 bits of `r`.
    #[inline(always)]
    fn two_f32(&self, r: u64) -> u64 {
        let t = &self.0;
        u64::from(t[r as u16 as usize]) << 16 | u64::from(t[(r >> 16) as u16 as usize]) << 48
    }
}

/// e4m3 codes of the 65 536 quantiles `FP8_CODE_STD · Φ⁻¹((i + ½) / 65 536)` (at most 4.5 σ
/// = 442 from 0, inside the e4m3 range of ±448): never a NaN code (`0x7F`, `0xFF`).
pub(crate) struct Fp8Table(pub(crate) Box<[u8; TABLE_LEN]>);

impl Fp8Table {
    pub(crate) fn new(std: f64) -> Fp8Table {
        let mut table = Box::new([0u8; TABLE_LEN]);
        let values = e4m3_magnitudes();
        for (i, slot) in table.iter_mut().enumerate() {
            let p = (i as f64 + 0.5) / TABLE_LEN as f64;
            *slot = f32_to_e4m3((std * inverse_normal_cdf(p)) as f32, &values);
        }
        Fp8Table(table)
    }

    #[inline(always)]
    fn four(&self, r: u64) -> u64 {
        let t = &self.0;
        u64::from(t[r as u16 as usize])
            | u64::from(t[(r >> 16) as u16 as usize]) << 8
            | u64::from(t[(r >> 32) as u16 as usize]) << 16
            | u64::from(t[(r >> 48) as u16 as usize]) << 24
    }
}

/// The values of the finite non-negative e4m3 codes `0x00..=0x7E`, increasing with the code.
fn e4m3_magnitudes() -> [f32; 0x7F] {
    std::array::from_fn(|c| {
        let (exp, man) = ((c >> 3) as i32, (c & 7) as f32);
        if exp == 0 {
            man / 8.0 * 2f32.powi(-6)
        } else {
            (1.0 + man / 8.0) * 2f32.powi(exp - 7)
        }
    })
}

/// Rounds to the nearest e4m3 code, ties to even, saturating at ±448 (inputs here are finite).
pub(crate) fn f32_to_e4m3(x: f32, magnitudes: &[f32; 0x7F]) -> u8 {
    let sign = if x.is_sign_negative() { 0x80 } else { 0 };
    let a = x.abs();
    let above = magnitudes.partition_point(|&m| m < a).min(0x7E);
    let code = match above.checked_sub(1) {
        None => above,
        Some(below) => {
            let (lo, hi) = (magnitudes[below], magnitudes[above]);
            if a - lo < hi - a || (a - lo == hi - a && below % 2 == 0) {
                below
            } else {
                above
            }
        }
    };
    sign | code as u8
}

/// How a tensor's bytes are drawn: each 8 bytes from a fixed number of draws.
#[derive(Clone, Copy)]
pub(crate) enum Sampler<'a> {
    /// Four bf16 values per draw.
    Bf16(&'a NormalTable),
    /// Two float32 values per draw: the table's bf16 values, widened exactly.
    F32(&'a NormalTable),
    /// Eight e4m3 codes per two draws.
    Fp8(&'a Fp8Table),
}

/// The value tables, one per [`Init`], and the FP8 codes.
pub(crate) struct Tables {
    pub(crate) normal: NormalTable,
    pub(crate) around_one: NormalTable,
    pub(crate) scale: NormalTable,
    pub(crate) fp8: Fp8Table,
}

impl Tables {
    pub(crate) fn new() -> Tables {
        Tables {
            normal: NormalTable::new(0.0, WEIGHT_STD),
            around_one: NormalTable::new(1.0, WEIGHT_STD),
            scale: NormalTable::new(SCALE_MEAN, SCALE_STD),
            fp8: Fp8Table::new(FP8_CODE_STD),
        }
    }

    /// The sampler of a tensor of `dtype` (the model makes BF16, F32 and F8_E4M3 ones) drawn as
    /// `init` says. FP8 codes are drawn from one distribution whatever the init (only weights
    /// are FP8).
    pub(crate) fn sampler(&self, dtype: DType, init: Init) -> Sampler<'_> {
        let table = match init {
            Init::Normal => &self.normal,
            Init::AroundOne => &self.around_one,
            Init::Scale => &self.scale,
        };
        match dtype {
            DType::F8E4M3 => Sampler::Fp8(&self.fp8),
            DType::F32 => Sampler::F32(table),
            _ => Sampler::Bf16(table),
        }
    }
}

/// Rounds to the nearest bf16, ties to even (inputs here are finite).
pub(crate) fn f32_to_bf16(x: f32) -> u16 {
    let bits = x.to_bits();
    let rounding = 0x7FFF + ((bits >> 16) & 1);
    (bits.wrapping_add(rounding) >> 16) as u16
}

/// Φ⁻¹(p) for 0 < p < 1, by Acklam's rational approximation (relative error < 1.2e-9).
pub(crate) fn inverse_normal_cdf(p: f64) -> f64 {
    const A: [f64; 6] = [
        -3.969_683_028_665_376e1,
        2.209_460_984_245_205e2,
        -2.759_285_104_469_687e2,
        1.383_577_518_672_69e2,
        -3.066_479_806_614_716e1,
        2.506_628_277_459_239,
    ];
    const B: [f64; 5] = [
        -5.447_609_879_822_406e1,
        1.615_858_368_580_409e2,
        -1.556_989_798_598_866e2,
        6.680_131_188_771_972e1,
        -1.328_068_155_288_572e1,
    ];
    const C: [f64; 6] = [
        -7.784_894_002_430_293e-3,
        -3.223_964_580_411_365e-1,
        -2.400_758_277_161_838,
        -2.549_732_539_343_734,
        4.374_664_141_464_968,
        2.938_163_982_698_783,
    ];
    const D: [f64; 4] =
        [7.784_695_709_041_462e-3, 3.224_671_290_700_398e-1, 2.445_134_137_142_996, 3.754_408_661_907_416];
    const P_LOW: f64 = 0.024_25;
    let tail = |q: f64| {
        (((((C[0] * q + C[1]) * q + C[2]) * q + C[3]) * q + C[4]) * q + C[5])
            / ((((D[0] * q + D[1]) * q + D[2]) * q + D[3]) * q + 1.0)
    };
    if p < P_LOW {
        tail((-2.0 * p.ln()).sqrt())
    } else if p <= 1.0 - P_LOW {
        let q = p - 0.5;
        let r = q * q;
        (((((A[0] * r + A[1]) * r + A[2]) * r + A[3]) * r + A[4]) * r + A[5]) * q
            / (((((B[0] * r + B[1]) * r + B[2]) * r + B[3]) * r + B[4]) * r + 1.0)
    } else {
        -tail((-2.0 * (1.0 - p).ln()).sqrt())
    }
}

/// 64-bit FNV-1a, a hash that is the same on every platform and Rust version.
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3))
}

fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The pseudo-random byte stream of one tensor (wyrand).
pub(crate) struct TensorStream {
    state: u64,
}

impl TensorStream {
    pub(crate) fn new(seed: u64, name: &str) -> TensorStream {
        TensorStream { state: splitmix64(splitmix64(seed) ^ fnv1a(name.as_bytes())) }
    }

    #[inline(always)]
    fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0xa076_1d64_78bd_642f);
        let t = u128::from(self.state) * u128::from(self.state ^ 0xe703_7ed1_a0b4_28db);
        (t >> 64) as u64 ^ t as u64
    }

    /// Fills `out` with the next values. Calls with lengths that are multiples of 8 bytes
    /// continue the stream exactly, so the bytes do not depend on how a tensor is cut into pieces.
    pub(crate) fn fill(&mut self, sampler: Sampler<'_>, out: &mut [u8]) {
        match sampler {
            Sampler::Bf16(t) => self.fill_chunks(out, |s| t.four(s.next_u64())),
            Sampler::F32(t) => self.fill_chunks(out, |s| t.two_f32(s.next_u64())),
            Sampler::Fp8(t) => self.fill_chunks(out, |s| {
                let low = t.four(s.next_u64());
                low | t.four(s.next_u64()) << 32
            }),
        }
    }

    /// Fills `out` with 8-byte chunks (little-endian) made by `chunk`.
    #[inline(always)]
    fn fill_chunks(&mut self, out: &mut [u8], mut chunk: impl FnMut(&mut Self) -> u64) {
        let mut chunks = out.chunks_exact_mut(8);
        for c in &mut chunks {
            c.copy_from_slice(&chunk(self).to_le_bytes());
        }
        let rest = chunks.into_remainder();
        if !rest.is_empty() {
            let bytes = chunk(self).to_le_bytes();
            rest.copy_from_slice(&bytes[..rest.len()]);
        }
    }
}
