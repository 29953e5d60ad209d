//! What validation knows of each key while the checkpoint streams past: its expected tensor, and
//! a fingerprint of the chunks `.metadata` declares, to be matched by the items found.

use std::borrow::Cow;
use std::collections::HashMap;
use std::sync::Arc;

use sha2::{Digest, Sha256};
use shardline_layout::dialect::share_of_box;
use shardline_layout::invariants::{tiling_violations, Piece};
use shardline_layout::recipe::rows_of;
use shardline_layout::{DType, OutputTensor, Plan, PlanTable, RowBlock};

/// A key of the checkpoint, as the workers that check its items need it.
#[derive(Debug)]
pub(super) struct KeyInfo {
    pub index: u32,
    pub fqn: String,
    pub dtype: DType,
    /// Global shape as stored (vocab rows included).
    pub shape: Vec<u64>,
    /// The expected tensor, padded like the stored one; `None` for a bytes item.
    pub want: Option<Want>,
}

/// What a stored key must hold: the planned tensors placed in it, each at its origin (one at
/// the origin for a key that is one planned tensor; a layer stack or a `[gate; up]` of several).
#[derive(Clone, Debug)]
pub(super) struct Want {
    pub dtype: DType,
    /// Sorted by origin: a chunk's bytes meet the parts in this order.
    pub parts: Vec<(OutputTensor, Vec<u64>)>,
}

impl Want {
    fn one(t: OutputTensor) -> Want {
        let origin = vec![0; t.shape.len()];
        Want { dtype: t.dtype, parts: vec![(t, origin)] }
    }

    /// The parts a stored box meets, in the order of its bytes: `(tensor, offsets, sizes)` in
    /// the tensor's own coordinates (see [`share_of_box`]).
    pub fn pieces<'w>(&'w self, offsets: &[u64], sizes: &[u64]) -> Vec<(&'w OutputTensor, Vec<u64>, Vec<u64>)> {
        self.parts
            .iter()
            .filter_map(|(t, origin)| {
                share_of_box(offsets, sizes, origin, &t.shape).map(|share| (t, share.offsets, share.sizes))
            })
            .collect()
    }
}

/// The order-independent fingerprint of a set of chunk boxes: a sum of 128-bit digests, so the
/// boxes `.metadata` declares and the boxes the items hold can be compared without keeping
/// either list.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BoxSet {
    pub count: u64,
    pub sum: u128,
}

impl BoxSet {
    pub fn add(&mut self, offsets: &[u64], sizes: &[u64]) {
        let mut h = Sha256::new();
        h.update((offsets.len() as u64).to_le_bytes());
        for v in offsets.iter().chain(sizes) {
            h.update(v.to_le_bytes());
        }
        let d = h.finalize();
        let mut b = [0u8; 16];
        b.copy_from_slice(&d[..16]);
        self.count += 1;
        self.sum = self.sum.wrapping_add(u128::from_le_bytes(b));
    }

    pub fn merge(&mut self, other: BoxSet) {
        self.count += other.count;
        self.sum = self.sum.wrapping_add(other.sum);
    }
}

/// Whether the box `offsets`/`sizes` lies inside `shape`.
pub(super) fn fits(offsets: &[u64], sizes: &[u64], shape: &[u64]) -> bool {
    offsets.len() == shape.len()
        && sizes.len() == shape.len()
        && offsets.iter().zip(sizes).zip(shape).all(|((o, s), g)| o.checked_add(*s).is_some_and(|e| e <= *g))
}

/// Keys whose vocab dim may be padded with zero rows beyond the release's rows.
fn is_vocab_key(key: &str) -> bool {
    key.ends_with("embedding.word_embeddings.weight") || key.ends_with("output_layer.weight")
}

/// The keys met so far, and the expected tensors of the release.
pub(super) struct Keys<'p> {
    expected: HashMap<Cow<'p, str>, Expected<'p>>,
    pub infos: Vec<Arc<KeyInfo>>,
    pub by_name: HashMap<String, u32>,
    /// The chunks `.metadata` declares, per key index.
    pub declared: Vec<BoxSet>,
}

impl<'p> Keys<'p> {
    pub fn new(reference: &'p Plan) -> Self {
        Keys { expected: expected_keys(reference), infos: Vec::new(), by_name: HashMap::new(), declared: Vec::new() }
    }

    /// The release's keys the checkpoint does not have; those under `optional_prefix` only if the
    /// checkpoint has some key under it.
    pub fn missing(&self, optional_prefix: Option<&str>) -> Vec<String> {
        let has_optional = optional_prefix.is_some_and(|p| self.by_name.keys().any(|k| k.starts_with(p)));
        let optional = |k: &str| !has_optional && optional_prefix.is_some_and(|p| k.starts_with(p));
        let mut m: Vec<String> = self
            .expected
            .keys()
            .filter(|k| !self.by_name.contains_key(k.as_ref()) && !optional(k))
            .map(|k| k.to_string())
            .collect();
        m.sort();
        m
    }

    fn register(&mut self, info: KeyInfo, declared: BoxSet) -> Arc<KeyInfo> {
        let info = Arc::new(info);
        self.by_name.insert(info.fqn.clone(), info.index);
        self.infos.push(info.clone());
        self.declared.push(declared);
        info
    }

    fn next_index(&self) -> u32 {
        self.infos.len() as u32
    }

    /// A bytes entry.
    pub fn bytes_entry(&mut self, fqn: String) {
        let info = KeyInfo { index: self.next_index(), fqn, dtype: DType::U8, shape: Vec::new(), want: None };
        let mut one = BoxSet::default();
        one.add(&[], &[]);
        self.register(info, one);
    }

    /// A tensor entry: checked against the release and for exact tiling. Returns the problems
    /// found; the key is registered either way (its items are then checked only for structure).
    pub fn tensor_entry(
        &mut self,
        fqn: String,
        dtype: DType,
        shape: Vec<u64>,
        chunks: &[(Vec<u64>, Vec<u64>)],
    ) -> Vec<String> {
        let mut problems = Vec::new();
        let want = match self.expected.get(fqn.as_str()) {
            None => {
                problems.push("in the checkpoint but not produced by the mapping of this release".to_string());
                None
            }
            Some(w) => match w.as_stored(dtype, &shape) {
                Ok(w) => Some(w),
                Err(p) => {
                    problems.push(p);
                    None
                }
            },
        };
        let mut declared = BoxSet::default();
        let mut distinct: Vec<&(Vec<u64>, Vec<u64>)> = chunks.iter().collect();
        distinct.sort();
        distinct.dedup();
        for (offsets, sizes) in &distinct {
            declared.add(offsets, sizes);
            if !fits(offsets, sizes, &shape) {
                problems.push(format!("chunk offsets {offsets:?} sizes {sizes:?} does not fit global shape {shape:?}"));
            }
        }
        if problems.is_empty() {
            let pieces = distinct
                .iter()
                .map(|(o, s)| Piece { offsets: o.clone(), sizes: s.clone(), owner: "chunk".into() })
                .collect();
            problems.extend(tiling_violations(&shape, pieces));
        }
        let info = KeyInfo {
            index: self.next_index(),
            fqn,
            dtype,
            shape,
            want: if problems.is_empty() { want } else { None },
        };
        self.register(info, declared);
        problems
    }
}

/// An expected key: one planned tensor, or several placed in it (torch_dist).
enum Expected<'p> {
    One(&'p OutputTensor),
    Placed { shape: Vec<u64>, parts: Vec<(&'p OutputTensor, Vec<u64>)> },
}

impl Expected<'_> {
    fn as_stored(&self, dtype: DType, shape: &[u64]) -> Result<Want, String> {
        match self {
            Expected::One(t) => expected_as_stored(t, dtype, shape).map(Want::one),
            Expected::Placed { shape: want_shape, parts } => {
                let want_dtype = parts[0].0.dtype;
                if dtype != want_dtype {
                    return Err(format!("dtype {dtype} but the source gives {want_dtype}"));
                }
                if shape != want_shape.as_slice() {
                    return Err(format!("global shape {shape:?} but the source gives {want_shape:?}"));
                }
                let mut parts: Vec<(OutputTensor, Vec<u64>)> =
                    parts.iter().map(|(t, o)| ((*t).clone(), o.clone())).collect();
                parts.sort_by(|a, b| a.1.cmp(&b.1));
                Ok(Want { dtype, parts })
            }
        }
    }
}

/// The keys the checkpoint must hold: the plan's tensors where they land in its dialect.
fn expected_keys(reference: &Plan) -> HashMap<Cow<'_, str>, Expected<'_>> {
    let table = PlanTable::new(reference);
    if !table.disk.regroups() {
        return reference.tensors.iter().map(|t| (Cow::Borrowed(t.key.as_str()), Expected::One(t))).collect();
    }
    let mut expected: HashMap<Cow<'_, str>, Expected<'_>> = HashMap::new();
    for t in &reference.tensors {
        let place = table.disk.place(&t.key, &t.shape);
        if place.origin.iter().all(|o| *o == 0) && place.shape == t.shape {
            expected.insert(Cow::Borrowed(t.key.as_str()), Expected::One(t));
            continue;
        }
        let entry = expected
            .entry(Cow::Owned(place.key.into_owned()))
            .or_insert_with(|| Expected::Placed { shape: place.shape, parts: Vec::new() });
        if let Expected::Placed { parts, .. } = entry {
            parts.push((t, place.origin));
        }
    }
    expected
}

/// The release's tensor as the checkpoint must hold it: same dtype and shape, or the vocab
/// padded with zero rows.
fn expected_as_stored(want: &OutputTensor, dtype: DType, shape: &[u64]) -> Result<OutputTensor, String> {
    if dtype != want.dtype {
        return Err(format!("dtype {dtype} but the source gives {}", want.dtype));
    }
    let mut want = want.clone();
    if shape != want.shape.as_slice() {
        let padded_ok = is_vocab_key(&want.key)
            && shape.len() == want.shape.len()
            && !shape.is_empty()
            && shape[0] >= want.shape[0]
            && shape[1..] == want.shape[1..];
        if !padded_ok {
            return Err(format!("global shape {shape:?} but the source gives {:?}", want.shape));
        }
        // Vocab padding: the rows beyond the release's vocab must be zeros.
        want.recipe.push(RowBlock::zeros(shape[0] - rows_of(&want.shape)));
        want.shape = shape.to_vec();
    }
    Ok(want)
}
