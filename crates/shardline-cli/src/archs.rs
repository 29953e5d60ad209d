//! `archs`: the architectures Shardline converts, and each one's mapping table.

use std::process::ExitCode;

use anyhow::{bail, Result};
use clap::Args;
use shardline_layout::arch::{describe, output_dtype, tables, vision_tower, MtpStyle};
use shardline_layout::config::SUPPORTED_MODEL_TYPES;

#[derive(Args, Debug)]
pub struct ArchsArgs {
    /// A `model_type` (as in config.json): print its mapping table.
    pub model_type: Option<String>,
}

pub fn run_archs(args: ArchsArgs) -> Result<ExitCode> {
    let Some(name) = args.model_type else {
        println!("{:<20} {:<12} {:<28} keys on disk", "model_type", "family", "MTP layers");
        for (name, family) in SUPPORTED_MODEL_TYPES {
            let mtp = match tables(*family).1 {
                Some(MtpStyle::Separate) => "mtp.layers.{k}.*",
                Some(MtpStyle::AfterDecoder) => "model.layers.{N+k}.*",
                None => "—",
            };
            let dtype = output_dtype(*family).map_or("release dtype".to_string(), |d| format!("{d} (expert_bias F32)"));
            println!("{name:<20} {:<12} {mtp:<28} {dtype}", format!("{family:?}"));
        }
        println!("\nBlock-FP8 releases (quantization_config fp8 + weight_block_size) are dequantized to BF16.");
        println!("`shardline archs <model_type>` prints a mapping table.");
        return Ok(ExitCode::SUCCESS);
    };
    let Some((_, family)) = SUPPORTED_MODEL_TYPES.iter().find(|(n, _)| *n == name) else {
        let known: Vec<&str> = SUPPORTED_MODEL_TYPES.iter().map(|(n, _)| *n).collect();
        bail!("unknown architecture `{name}` (supported: {})", known.join(", "));
    };
    println!("{name}: HF tensor → Megatron key (under `model.module.`); {{L}} layer, {{E}} expert\n");
    for line in describe(*family) {
        let expert = if line.expert { " [expert mesh]" } else { "" };
        println!("{}", line.hf.join(" + "));
        let transform = if line.transform.is_empty() { String::new() } else { format!("; {}", line.transform) };
        println!("    → {}  ({}, TP {}{transform}){expert}", line.megatron, line.kind, line.tp);
    }
    if let Some(t) = vision_tower(*family) {
        let (hf, megatron, lm) = (t.hf_prefix, t.megatron_prefix, t.language_prefix);
        println!("\nVision tower (a release holding `{hf}…`): the language model's keys go under `{lm}`,");
        println!("the tower becomes Megatron's ViT under `{megatron}` by the `{megatron}…` rules above, {{L}} a vision block");
        if t.tables.iter().flat_map(|r| r.iter()).any(|r| r.megatron.contains("deepstack_merger_list.{L}")) {
            println!("(vision_config.depth), in `deepstack_merger_list.{{L}}` a deepstack merger");
        } else {
            println!("(vision_config.depth)");
        }
    }
    if let Some(style) = tables(*family).1 {
        let (megatron, hf) = style.prefixes();
        println!("\nMTP layers: every `decoder.layers.{{L}}.…` rule also maps `{hf}…` to `{megatron}…`");
        if style == MtpStyle::AfterDecoder {
            println!("(MTP layer k is release layer N + k, N = num_hidden_layers, k < num_nextn_predict_layers)");
        }
    }
    Ok(ExitCode::SUCCESS)
}
