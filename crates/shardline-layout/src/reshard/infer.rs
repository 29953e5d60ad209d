//! The source mesh as far as a checkpoint's chunk geometry tells, for checkpoints without `args`
//! (Megatron-Bridge writes none): the TP and expert-TP sizes from how row-parallel weights split
//! their columns, the world from the rank files, the expert-parallel size from which ranks hold
//! which experts. Context parallelism folds into the FSDP group and cannot be told apart from
//! data parallelism: the result has `cp = 1`.

use super::keys::{classify, ItemKind};
use super::params::{param_layout, vision_table};
use super::plan::SourceItem;
use crate::arch::TpMode;
use crate::mesh::Mesh;

/// The mesh `items` were saved on; `rank_of(item, chunk)` is the rank that saved a chunk (from
/// its file's name). `None` when the geometry does not tell the TP size (no row-parallel weight).
pub fn infer_mesh(items: &[SourceItem], rank_of: impl Fn(usize, usize) -> Option<u64>) -> Option<Mesh> {
    let mut world = 0u64;
    let (mut tp, mut etp) = (None, None);
    // (expert, rank) of every expert chunk.
    let mut owners: Vec<(u64, u64)> = Vec::new();
    let kinds: Vec<ItemKind> = items.iter().map(|i| classify(&i.path)).collect();
    let vision = vision_table(kinds.iter().filter_map(|k| match k {
        ItemKind::Model { name } => Some(name.as_str()),
        _ => None,
    }));
    for (i, item) in items.iter().enumerate() {
        let Some(t) = &item.tensor else { continue };
        for (c, _) in t.chunks.iter().enumerate() {
            if let Some(r) = rank_of(i, c) {
                world = world.max(r + 1);
            }
        }
        let ItemKind::Model { name } = &kinds[i] else { continue };
        let Some(layout) = param_layout(name, vision) else { continue };
        if layout.tp_mode == TpMode::Row {
            let split = t.chunks.iter().find(|c| c.numel() > 0).and_then(|c| {
                let (cols, width) = (t.shape.get(1)?, c.sizes.get(1)?);
                (*width > 0 && cols % width == 0).then(|| cols / width)
            });
            match layout.expert {
                None => tp = tp.or(split),
                Some(_) => etp = etp.or(split),
            }
        }
        if let Some(e) = layout.expert {
            owners.extend(t.chunks.iter().enumerate().filter_map(|(c, _)| rank_of(i, c).map(|r| (e, r))));
        }
    }
    let tp = tp?;
    let etp = etp.unwrap_or(tp);
    if world == 0 || !world.is_multiple_of(tp) || !world.is_multiple_of(etp) {
        return None;
    }
    let experts = owners.iter().map(|(e, _)| e + 1).max().unwrap_or(0);
    // The largest EP size under which every expert chunk sits on its owner's EP rank.
    let ep = (1..=world / etp)
        .rev()
        .filter(|ep| (world / etp).is_multiple_of(*ep) && experts.is_multiple_of(*ep))
        .find(|ep| owners.iter().all(|(e, r)| (r / etp) % ep == e / (experts / ep)))
        .unwrap_or(1);
    Some(Mesh { tp, cp: 1, dp: world / tp, ep, etp })
}
