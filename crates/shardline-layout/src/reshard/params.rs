//! A Megatron parameter's name → how Megatron-FSDP lays it out: TP mode, vocab padding, the
//! fused parameter it is a section of, the expert it belongs to. Read from the mapping tables of
//! every family — the data `convert` plans from — so resharding knows every parameter `convert`
//! writes, and nothing is guessed from shapes.

use crate::arch::{self, Kind, TpMode};
use crate::config::SUPPORTED_MODEL_TYPES;

/// How one parameter key is laid out.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParamLayout {
    pub tp_mode: TpMode,
    /// Embedding or output layer: dim 0 padded to a multiple of `divisible_by · tp`.
    pub vocab: bool,
    /// The global expert index, for a routed expert's parameter.
    pub expert: Option<u64>,
    /// When the key is a section of a fused parameter: the fused name (the key without the
    /// suffix), this section's index, and every section's suffix in order.
    pub section: Option<(String, usize, &'static [&'static str])>,
    /// Kept fused in a layout that depends on the (expert-)TP size (gpt-oss's expert fc1), so it
    /// keeps its global layout only at the same size.
    pub tp_dependent: bool,
}

const GATED: &[&str] = &["_w", "_v"];
const GDN_IN_PROJ: &[&str] = &[".query", ".key", ".value", ".z", ".beta", ".alpha"];
const GDN_CONV: &[&str] = &[".query", ".key", ".value"];

/// `(TP mode, vocab, section suffixes, TP-dependent)` of a table kind; `None` when it makes no
/// Megatron parameter.
fn kind_layout(kind: Kind) -> Option<(TpMode, bool, &'static [&'static str], bool)> {
    use Kind::*;
    Some(match kind {
        Copy(m) | ZeroCentered(m) | PackedExpertRow(m) => (m, false, &[], false),
        Vocab => (TpMode::Column, true, &[], false),
        Qkv => (TpMode::Column, false, &[], false),
        GatedMlp | PackedGatedExperts | TransposedGatedExperts => (TpMode::Column, false, GATED, false),
        VisionQkv => (TpMode::Column, false, &[], false),
        GdnInProjQkvz | GdnInProjSplit => (TpMode::Column, false, GDN_IN_PROJ, false),
        GdnConv1d => (TpMode::Column, false, GDN_CONV, false),
        PackedExpertsDown | Mxfp4Down | TransposedDown => (TpMode::Row, false, &[], false),
        Mxfp4GateUp | TransposedGateUp | InterleavedGateUpBias => (TpMode::Column, false, &[], true),
        NotConverted => return None,
    })
}

/// Matches `name` against a table pattern (`{L}`, `{E}`: decimal numbers); returns the expert
/// number when the pattern has one, and the rest of `name` after the pattern.
fn match_pattern<'n>(pattern: &str, name: &'n str) -> Option<(Option<u64>, &'n str)> {
    let mut rest = name;
    let mut expert = None;
    let mut pat = pattern;
    while !pat.is_empty() {
        if let Some(p) = pat.strip_prefix("{L}").or_else(|| pat.strip_prefix("{E}")) {
            let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
            if digits == 0 {
                return None;
            }
            if pat.starts_with("{E}") {
                expert = rest[..digits].parse().ok();
            }
            rest = &rest[digits..];
            pat = p;
        } else {
            let literal = pat.find('{').unwrap_or(pat.len());
            rest = rest.strip_prefix(&pat[..literal])?;
            pat = &pat[literal..];
        }
    }
    Some((expert, rest))
}

/// The vision-tower tables of the Megatron ViT whose parameters `names` (without the checkpoint
/// prefix) hold, if any: those of the family that knows every `vision_model.` name (Qwen3-VL's
/// add deepstack mergers to the ViT Qwen3.5 shares), else of the first that knows a block of
/// them. A checkpoint without one has no vision parameter a table lays out.
pub fn vision_table<'a>(names: impl IntoIterator<Item = &'a str>) -> Option<&'static [&'static [arch::Rule]]> {
    let names: Vec<&str> = names.into_iter().filter(|n| n.starts_with("vision_model.")).collect();
    let towers: Vec<&'static [&'static [arch::Rule]]> =
        SUPPORTED_MODEL_TYPES.iter().filter_map(|(_, family)| Some(arch::vision_tower(*family)?.tables)).collect();
    let rules = |tables: &'static [&'static [arch::Rule]]| tables.iter().flat_map(|t| t.iter());
    let block = |tables, name: &str| {
        rules(tables)
            .any(|r| r.megatron.contains("{L}") && match_pattern(r.megatron, name).is_some_and(|m| m.1.is_empty()))
    };
    let known = |tables| names.iter().all(|n| layout_by_rules(rules(tables), n, n).is_some());
    let with_blocks: Vec<_> = towers.into_iter().filter(|t| names.iter().any(|n| block(t, n))).collect();
    with_blocks.iter().copied().find(|t| known(t)).or(with_blocks.first().copied())
}

/// The layout of the Megatron parameter `name` (without the checkpoint prefix), or `None` when
/// no table of any family names it. `vision`: the checkpoint's [`vision_table`].
pub fn param_layout(name: &str, vision: Option<&'static [&'static [arch::Rule]]>) -> Option<ParamLayout> {
    let name = name.strip_prefix("language_model.").unwrap_or(name);
    if name.starts_with("vision_model.") {
        return vision.and_then(|tables| layout_by_rules(tables.iter().flat_map(|t| t.iter()), name, name));
    }
    // An MTP layer's transformer layer is a decoder layer.
    let decoder_name;
    let lookup = match mtp_layer_rest(name) {
        Some(rest) => {
            decoder_name = format!("decoder.layers.0.{rest}");
            decoder_name.as_str()
        }
        None => name,
    };
    layout_by_rules(all_rules(), name, lookup)
}

/// The layout the first of `rules` naming `lookup` gives `name`.
fn layout_by_rules<'r>(rules: impl Iterator<Item = &'r arch::Rule>, name: &str, lookup: &str) -> Option<ParamLayout> {
    for rule in rules {
        let Some((tp_mode, vocab, suffixes, tp_dependent)) = kind_layout(rule.kind) else { continue };
        let Some((expert, rest)) = match_pattern(rule.megatron, lookup) else { continue };
        // A parameter kept fused in an expert-TP-dependent layout also goes by its SwiGLU
        // sections (`_w`, `_v`: gate and up, each TP-invariant), as `torch_dist` plans it.
        if tp_dependent && !rest.is_empty() {
            let Some(index) = GATED.iter().position(|s| *s == rest) else { continue };
            let section = Some((name[..name.len() - rest.len()].to_string(), index, GATED));
            let expert = expert.filter(|_| rule.expert);
            return Some(ParamLayout { tp_mode, vocab, expert, section, tp_dependent: false });
        }
        let section = if suffixes.is_empty() {
            if !rest.is_empty() {
                continue;
            }
            None
        } else {
            let Some(index) = suffixes.iter().position(|s| *s == rest) else { continue };
            Some((name[..name.len() - rest.len()].to_string(), index, suffixes))
        };
        // Families agree on every name they share: the first table that names it decides.
        return Some(ParamLayout { tp_mode, vocab, expert: expert.filter(|_| rule.expert), section, tp_dependent });
    }
    None
}

/// `rest` of `mtp.layers.{k}.transformer_layer.<rest>`.
fn mtp_layer_rest(name: &str) -> Option<&str> {
    let rest = name.strip_prefix("mtp.layers.")?;
    let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
    (digits > 0).then_some(())?;
    rest[digits..].strip_prefix(".transformer_layer.")
}

/// Every rule of every family's tables.
fn all_rules() -> impl Iterator<Item = &'static arch::Rule> {
    SUPPORTED_MODEL_TYPES.iter().flat_map(|(_, family)| arch::tables(*family).0.iter().flat_map(|t| t.iter()))
}

/// Buffers Megatron saves as plain tensors (registered with `register_buffer`, so not sharded
/// and without optimizer state): the router's score-correction bias.
pub fn is_buffer(name: &str) -> bool {
    name.ends_with(".router.expert_bias")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_from_every_family_resolve() {
        let l = param_layout("decoder.layers.3.self_attention.linear_proj.weight", None).unwrap();
        assert_eq!((l.tp_mode, l.vocab, l.expert, l.section), (TpMode::Row, false, None, None));
        let l = param_layout("embedding.word_embeddings.weight", None).unwrap();
        assert!(l.vocab && l.tp_mode == TpMode::Column);
        let l = param_layout("decoder.layers.1.mlp.experts.linear_fc1.weight17_v", None).unwrap();
        assert_eq!(l.expert, Some(17));
        assert_eq!(l.section, Some(("decoder.layers.1.mlp.experts.linear_fc1.weight17".into(), 1, GATED)));
        let l = param_layout("decoder.layers.1.mlp.experts.linear_fc2.weight3", None).unwrap();
        assert_eq!((l.tp_mode, l.expert), (TpMode::Row, Some(3)));
        // gpt-oss: fc1 fused on disk, its layout depends on the expert-TP size.
        let l = param_layout("decoder.layers.0.mlp.experts.linear_fc1.weight2", None).unwrap();
        assert!(l.tp_dependent && l.section.is_none());
        // ... and its sections, as torch_dist plans it, are TP-invariant SwiGLU halves.
        let l = param_layout("decoder.layers.0.mlp.experts.linear_fc1.bias2_v", None).unwrap();
        assert_eq!(l.section, Some(("decoder.layers.0.mlp.experts.linear_fc1.bias2".into(), 1, GATED)));
        assert!(!l.tp_dependent && l.expert == Some(2));
        let l = param_layout("decoder.layers.0.self_attention.linear_kv_down_proj.weight", None).unwrap();
        assert_eq!(l.tp_mode, TpMode::Replicated);
        let l = param_layout("decoder.layers.0.self_attention.in_proj.weight.beta", None).unwrap();
        assert_eq!(l.section.map(|s| s.1), Some(4));
        let l = param_layout("mtp.layers.0.transformer_layer.mlp.linear_fc1.weight_w", None).unwrap();
        assert_eq!(l.section.map(|s| s.0), Some("mtp.layers.0.transformer_layer.mlp.linear_fc1.weight".into()));
        let l = param_layout("language_model.decoder.layers.0.mlp.router.weight", None).unwrap();
        assert_eq!(l.tp_mode, TpMode::Replicated);
        assert!(param_layout("decoder.layers.0.mystery.weight", None).is_none());
        // A vision parameter is laid out by the Megatron ViT the checkpoint's block names show:
        // TP-split, the GELU fc1 whole. Qwen3-VL's deepstack mergers pick its tables over Qwen3.5's.
        let fc1 = "vision_model.merger.linear_fc1.weight";
        assert!(param_layout(fc1, None).is_none());
        let vit =
            vision_table(["language_model.output_layer.weight", "vision_model.decoder.layers.4.mlp.linear_fc1.bias"]);
        assert!(vit.is_some());
        assert_eq!(param_layout(fc1, vit).unwrap().tp_mode, TpMode::Column);
        let l = param_layout("vision_model.decoder.layers.0.mlp.linear_fc1.weight", vit).unwrap();
        assert_eq!((l.tp_mode, l.section), (TpMode::Column, None), "a GELU fc1 stays whole");
        let l = param_layout("vision_model.decoder.layers.0.self_attention.linear_proj.bias", vit).unwrap();
        assert_eq!(l.tp_mode, TpMode::Replicated);
        let deepstack = "vision_model.decoder.deepstack_merger_list.1.linear_fc2.weight";
        let vl = vision_table(["vision_model.decoder.layers.0.mlp.linear_fc1.bias", deepstack]);
        assert_eq!(param_layout(deepstack, vl).unwrap().tp_mode, TpMode::Row);
        assert!(param_layout("vision_model.blocks.0.attn.qkv.weight", vl).is_none());
        assert_eq!(vision_table(["vision_model.blocks.0.attn.qkv.weight", fc1]), None);
        assert!(param_layout("decoder.layers.0.mlp.linear_fc1.weight_x", None).is_none());
    }
}
