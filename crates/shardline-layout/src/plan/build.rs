//! Building a plan: each mapping rule expanded over layers and experts, the release tensors it
//! consumes checked, drafted and chunked; every problem reported at once.

use std::borrow::Cow;
use std::collections::{BTreeSet, HashMap};

use super::chunk::chunk_draft;
use super::draft::draft;
use super::quant::Fp8Scales;
use super::*;
use crate::arch::{self, Kind, MtpStyle, Rule};
use crate::config::ModelConfig;
use crate::error::LayoutError;

fn fill(template: &str, layer: Option<u64>, expert: Option<u64>) -> String {
    let mut s = template.to_string();
    if let Some(l) = layer {
        s = s.replace("{L}", &l.to_string());
    }
    if let Some(e) = expert {
        s = s.replace("{E}", &e.to_string());
    }
    s
}

/// Release inventory, indexed by normalised name (multimodal `model.language_model.` → `model.`).
pub(super) struct Inventory<'a> {
    pub(super) sources: &'a [SourceTensor],
    by_name: HashMap<Cow<'a, str>, usize>,
}

impl<'a> Inventory<'a> {
    pub(super) fn new(sources: &'a [SourceTensor], language_model_prefix: bool) -> Inventory<'a> {
        let mut by_name = HashMap::with_capacity(sources.len());
        for (i, s) in sources.iter().enumerate() {
            by_name.insert(normalise(&s.name, language_model_prefix), i);
        }
        Inventory { sources, by_name }
    }
    pub(super) fn get(&self, name: &str) -> Option<usize> {
        self.by_name.get(name).copied()
    }
    pub(super) fn shape(&self, id: usize) -> &[u64] {
        &self.sources[id].shape
    }
}

pub(super) fn normalise(name: &str, language_model_prefix: bool) -> Cow<'_, str> {
    if language_model_prefix {
        if let Some(rest) = name.strip_prefix("model.language_model.") {
            return Cow::Owned(format!("model.{rest}"));
        }
    }
    Cow::Borrowed(name)
}

/// Model-level divisibility checks Megatron would make for this mesh; every violation names the
/// numbers. Usable without a release (e.g. to lint a pipeline spec).
pub fn check_mesh_for_model(config: &ModelConfig, mesh: &Mesh) -> Vec<LayoutError> {
    let mut errors = mesh.check();
    if !errors.is_empty() {
        return errors;
    }
    let mut err = |msg: String| errors.push(LayoutError::Mesh(msg));
    let (t, ng, nh) = (mesh.tp, config.num_query_groups, config.num_attention_heads);
    if nh % ng != 0 {
        err(format!("num_attention_heads ({nh}) is not divisible by num_query_groups ({ng})"));
    }
    if ng < t {
        err(format!(
            "num_query_groups ({ng}) < tp ({t}): Megatron's replicated-KV path is not supported; use tp ≤ {ng}"
        ));
    } else if ng % t != 0 {
        err(format!("num_query_groups ({ng}) is not divisible by tp ({t})"));
    }
    if let Some(f) = config.ffn_hidden_size {
        if config.num_experts == 0 && f % t != 0 {
            err(format!("intermediate_size ({f}) is not divisible by tp ({t})"));
        }
    }
    if let Some(f) = config.shared_expert_ffn_hidden_size {
        if f % t != 0 {
            err(format!("shared_expert_intermediate_size ({f}) is not divisible by tp ({t})"));
        }
    }
    if config.num_experts == 0 {
        if mesh.ep > 1 {
            err(format!("ep ({}) > 1 but `{}` has no experts", mesh.ep, config.model_type));
        }
    } else {
        let e = config.num_experts;
        if !e.is_multiple_of(mesh.ep) {
            err(format!("num_experts ({e}) is not divisible by ep ({})", mesh.ep));
        }
        if let Some(f) = config.moe_ffn_hidden_size {
            if f % mesh.etp != 0 {
                err(format!("moe_intermediate_size ({f}) is not divisible by etp ({})", mesh.etp));
            }
        }
    }
    if config.family == crate::config::Family::GptOss {
        if let Some(f) = config.moe_ffn_hidden_size.filter(|f| f % mesh.etp == 0) {
            if !(f / mesh.etp).is_multiple_of(2) {
                // MXFP4 packs two elements a byte: a column stripe must start on a byte.
                err(format!(
                    "intermediate_size / etp = {f} / {} is odd: MXFP4 experts split by columns need an even width",
                    mesh.etp
                ));
            }
        }
    }
    if config.mla.is_some() && nh % t != 0 {
        // The latent up-projections split by heads.
        err(format!(
            "num_attention_heads ({nh}) is not divisible by tp ({t}) (MLA splits its up-projections by heads)"
        ));
    }
    if let Some(g) = &config.gdn {
        let (nk, nv) = (g.num_key_heads, g.num_value_heads);
        if nk % t != 0 {
            err(format!("linear_num_key_heads ({nk}) is not divisible by tp ({t})"));
        }
        if nv % t != 0 {
            err(format!("linear_num_value_heads ({nv}) is not divisible by tp ({t})"));
        }
        if nk == 0 || nv % nk != 0 {
            err(format!("linear_num_value_heads ({nv}) is not divisible by linear_num_key_heads ({nk})"));
        }
        if nk % t == 0 && nv % t == 0 {
            for (what, size) in [("qk", g.qk() / t), ("v", g.v() / t), ("nv", nv / t)] {
                if size % mesh.cp != 0 {
                    err(format!(
                        "GDN in_proj section {what}/tp = {size} is not divisible by cp ({}); Megatron splits each section across CP ranks",
                        mesh.cp
                    ));
                }
            }
        }
    }
    errors
}

/// A rule with where it applies: re-targeted at MTP layers (`(megatron, hf)` prefixes) or not,
/// its `(megatron layer, release layer)` pairs, and the prefix of its Megatron names.
struct Placed<'a> {
    rule: Rule,
    mtp: Option<(&'static str, &'static str)>,
    layers: &'a [(u64, u64)],
    prefix: &'static str,
}

/// Builds the plan. Returns every error found, not just the first.
pub fn build_plan(
    config: &ModelConfig,
    sources: Vec<SourceTensor>,
    mesh: Mesh,
    options: &PlanOptions,
) -> Result<Plan, Vec<LayoutError>> {
    if let Dialect::Torchtitan(target) = options.dialect {
        return super::torchtitan::build_torchtitan_plan(config, sources, mesh, target, options);
    }
    let mut errors = check_mesh_for_model(config, &mesh);
    if !mesh.check().is_empty() {
        return Err(errors);
    }
    let inv = Inventory::new(&sources, config.language_model_prefix);
    let mut consumed = vec![false; sources.len()];
    let mut drafts: Vec<Draft> = Vec::new();

    // A vision tower converts when the release holds it; the language model then sits beside it.
    let tower = arch::vision_tower(config.family).filter(|t| sources.iter().any(|s| s.name.starts_with(t.hf_prefix)));
    let lm_prefix = tower.map_or(arch::megatron_prefix(config.family), |t| t.language_prefix);
    let tower_tables = tower.map_or(&[][..], |t| t.tables);
    let vision_layers: Vec<(u64, u64)> = match &config.vision {
        Some(v) if tower.is_some() => {
            if v.num_heads == 0 || !v.hidden_size.is_multiple_of(v.num_heads) {
                errors.push(LayoutError::Config {
                    field: "vision_config.num_heads".into(),
                    message: format!("hidden_size ({}) is not divisible by num_heads ({})", v.hidden_size, v.num_heads),
                });
            } else if !v.num_heads.is_multiple_of(mesh.tp) {
                errors.push(LayoutError::Mesh(format!(
                    "vision_config.num_heads ({}) is not divisible by tp ({}); the vision tower splits its heads",
                    v.num_heads, mesh.tp
                )));
            }
            (0..v.depth).map(|l| (l, l)).collect()
        }
        None if tower.is_some() => {
            errors.push(LayoutError::Config {
                field: "vision_config".into(),
                message: "needs `depth`, `num_heads` and `hidden_size`: the release holds a vision tower".into(),
            });
            Vec::new()
        }
        _ => Vec::new(),
    };

    let (tables, mtp_style) = arch::tables(config.family);
    // Each rule with the layers it applies to: `(megatron layer, release layer)` pairs.
    let decoder_layers: Vec<(u64, u64)> = (0..config.num_layers).map(|l| (l, l)).collect();
    let mtp_layers: Vec<(u64, u64)> = match mtp_style {
        // Qwen3-Next numbers its MTP layers from 0 under `mtp.`; guards pick the ones present.
        Some(MtpStyle::Separate) => decoder_layers.clone(),
        Some(MtpStyle::AfterDecoder) => (0..config.mtp_layers).map(|k| (k, config.num_layers + k)).collect(),
        None => Vec::new(),
    };
    let mut rules: Vec<Placed<'_>> = Vec::new();
    for table in tables {
        for r in *table {
            let layers = if r.megatron.starts_with("mtp.layers.{L}.") { &mtp_layers } else { &decoder_layers };
            rules.push(Placed { rule: *r, mtp: None, layers, prefix: lm_prefix });
            if let Some(style) = mtp_style {
                if r.megatron.starts_with("decoder.layers.{L}.") {
                    rules.push(Placed {
                        rule: *r,
                        mtp: Some(style.prefixes()),
                        layers: &mtp_layers,
                        prefix: lm_prefix,
                    });
                }
            }
        }
    }
    // The tower's rules name their parameters in full; `{L}` is a vision block, or a deepstack
    // merger (fewer: those the release holds).
    rules.extend(tower_tables.iter().flat_map(|t| t.iter()).map(|r| Placed {
        rule: *r,
        mtp: None,
        layers: &vision_layers,
        prefix: "",
    }));
    let retarget = |s: &str, mtp: Option<(&str, &str)>| -> String {
        match mtp {
            None => s.to_string(),
            Some((meg, hf)) => s.replacen("decoder.layers.{L}.", meg, 1).replacen("model.layers.{L}.", hf, 1),
        }
    };

    let experts: Vec<u64> = (0..config.num_experts).collect();
    let mut unconverted = Vec::new();
    let fp8 = Fp8Scales::find(config, &inv, &mut errors);
    for Placed { rule, mtp, layers, prefix } in &rules {
        let megatron_t = retarget(rule.megatron, *mtp);
        let hf_t: Vec<String> = rule.hf.iter().map(|h| retarget(h, *mtp)).collect();
        let guard_t = retarget(rule.guard.unwrap_or(rule.hf[0]), *mtp);
        let layer_iter: Vec<Option<(u64, u64)>> =
            if megatron_t.contains("{L}") { layers.iter().map(|l| Some(*l)).collect() } else { vec![None] };
        let expert_iter: Vec<Option<u64>> =
            if rule.expert { experts.iter().map(|e| Some(*e)).collect() } else { vec![None] };
        for layer in &layer_iter {
            let (megatron_layer, hf_layer) = (layer.map(|l| l.0), layer.map(|l| l.1));
            for expert in &expert_iter {
                let guard = fill(&guard_t, hf_layer, *expert);
                if inv.get(&guard).is_none() {
                    continue;
                }
                let target = format!("{prefix}{}", fill(&megatron_t, megatron_layer, *expert));
                let mut ids = Vec::new();
                for h in &hf_t {
                    let name = fill(h, hf_layer, *expert);
                    match inv.get(&name) {
                        Some(id) => ids.push(id),
                        None => errors.push(LayoutError::MissingTensor {
                            missing: name,
                            present: guard.clone(),
                            target: target.clone(),
                        }),
                    }
                }
                if ids.len() != hf_t.len() {
                    continue;
                }
                for id in &ids {
                    consumed[*id] = true;
                }
                if rule.kind == Kind::NotConverted {
                    unconverted.extend(ids.iter().map(|id| sources[*id].name.clone()));
                    continue;
                }
                // Dequantized FP8 weights become bf16, as Megatron-Bridge loads them.
                let scaled = fp8.as_ref().filter(|f| f.any(&ids));
                if let Some(f) = scaled {
                    for id in ids.iter().filter_map(|id| f.scale_of.get(id)) {
                        consumed[*id] = true;
                    }
                }
                let dtype = rule.dtype.or(arch::output_dtype(config.family)).or(scaled.map(|_| DType::BF16));
                match draft(config, &inv, rule.kind, &target, &ids, *expert, dtype) {
                    Ok(mut d) => {
                        if let Some(f) = scaled {
                            f.dequantize(&mut d);
                        }
                        drafts.push(d)
                    }
                    Err(e) => errors.push(e),
                }
            }
        }
    }

    // The name index and the FP8 pairs serve drafting only: freed before the plan's tensors are
    // made, when planning holds the most.
    drop(fp8);
    drop(inv);

    let mut unmapped = Vec::new();
    for (i, s) in sources.iter().enumerate() {
        if consumed[i] {
            continue;
        }
        let norm = normalise(&s.name, config.language_model_prefix);
        // A tower that converts leaves nothing of its own unconverted: a tensor its table does
        // not know is unmapped.
        let in_tower = tower.is_some_and(|t| s.name.starts_with(t.hf_prefix));
        if !in_tower && arch::UNCONVERTED_PREFIXES.iter().any(|p| norm.starts_with(p) || s.name.starts_with(p)) {
            unconverted.push(s.name.clone());
        } else {
            unmapped.push(s.name.clone());
        }
    }
    if !unmapped.is_empty() {
        unmapped.sort();
        errors.push(LayoutError::Unmapped { model_type: config.model_type.clone(), names: unmapped });
    }
    // Backstop checks on the tensors themselves (the config may understate what the release holds).
    for d in &drafts {
        let t = tp_of(&mesh, d.expert.is_some());
        for s in &d.sections {
            let bad = match d.tp_mode {
                // Vocab rows are padded to a multiple of tp when chunked.
                TpMode::Column => !d.pad_vocab && !rows_of(&s.shape).is_multiple_of(t),
                TpMode::Row => s.shape.len() != 2 || s.shape[1] % t != 0,
                TpMode::Replicated => false,
            };
            if bad {
                let dim = if d.tp_mode == TpMode::Row { 1 } else { 0 };
                errors.push(LayoutError::Mesh(format!(
                    "`{}{}` shape {:?}: dim {dim} is not divisible by {} ({t})",
                    d.name,
                    s.suffix,
                    s.shape,
                    if d.expert.is_some() { "etp" } else { "tp" }
                )));
            }
        }
    }
    drafts.sort_unstable_by(|a, b| a.name.cmp(&b.name));
    for pair in drafts.windows(2).filter(|pair| pair[0].name == pair[1].name) {
        // Two rules for one target (e.g. per-expert and packed forms both present).
        let id = pair[1].first_source;
        errors.push(LayoutError::Shape {
            tensor: sources[id].name.clone(),
            actual: sources[id].shape.clone(),
            expected: format!("a single source for `{}`", pair[1].name),
            why: "the release holds the same parameter twice".to_string(),
        });
    }
    if !errors.is_empty() {
        let mut seen = BTreeSet::new();
        errors.retain(|e| seen.insert(e.to_string()));
        return Err(errors);
    }

    // A plan lives for the whole conversion: sized exactly, and sorted in place.
    let params: usize = drafts.iter().map(|d| d.sections.len()).sum();
    let mut tensors = Vec::with_capacity(if options.optimizer_state { 3 * params } else { params });
    let mut rank_bytes = vec![0u64; mesh.world() as usize];
    for d in drafts {
        tensors.extend(chunk_draft(d, &mesh, config.num_experts, options, &mut rank_bytes));
    }
    tensors.sort_unstable_by(|a, b| a.key.cmp(&b.key));
    if options.optimizer_state {
        let mut states = Vec::new();
        for t in &tensors {
            let name = t.key.strip_prefix(&options.prefix).unwrap_or(&t.key);
            for state in ["exp_avg", "exp_avg_sq"] {
                let mut s = t.clone();
                s.key = format!("{}{name}.{state}", options.optimizer_prefix);
                if let Some(split) = &mut s.split {
                    // The fused name sits after the optimizer prefix instead of the model one.
                    let shift = |at: u32| at as usize - (t.key.len() - name.len()) + options.optimizer_prefix.len();
                    split.name = (shift(split.name.0) as u32, shift(split.name.1) as u32);
                }
                s.dtype = DType::F32;
                s.recipe = vec![RowBlock::zeros(rows_of(&t.shape))];
                s.role = Role::OptimizerState { param_key: t.key.clone(), state };
                states.push(s);
            }
        }
        tensors.extend(states);
        tensors.sort_unstable_by(|a, b| a.key.cmp(&b.key));
    }
    unconverted.sort();
    Ok(Plan { mesh, options: options.clone(), model_type: config.model_type.clone(), sources, tensors, unconverted })
}

fn tp_of(mesh: &Mesh, expert: bool) -> u64 {
    if expert {
        mesh.etp
    } else {
        mesh.tp
    }
}
