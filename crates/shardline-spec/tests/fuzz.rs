//! Lint and instantiation never panic, whatever the text: random YAML-ish strings and random
//! mutations of valid specs give diagnostics (or a pipeline), never a crash.

use proptest::prelude::*;
use shardline_spec::{lint, render_all, LintContext};

const SEEDS: &[&str] = &[
    include_str!("../../../pipelines/qwen3-moe.yaml"),
    include_str!("../../../pipelines/demo.yaml"),
    include_str!("data/valid/block-style-and-anchors.yaml"),
    include_str!("data/invalid/cycle.yaml"),
    include_str!("data/invalid/type-errors.yaml"),
];

/// Characters that matter to YAML and to our syntax.
const ALPHABET: &[char] = &[
    ' ', ' ', '\n', '\t', ':', '-', '[', ']', '{', '}', ',', '&', '*', '!', '|', '>', '#', '"', '\'', '%', '@', '`',
    '?', '$', '.', 'a', 'p', 't', '0', '1', '2', '~', 'é', '\u{feff}', '\r', '\\',
];

fn check(text: &str) {
    let ctx = LintContext::new().with_model_config(|_| None);
    let (pipeline, diags) = lint("fuzz.yaml", text, &ctx);
    let rendered = render_all(&diags, text);
    for d in &diags {
        assert!(!d.message.is_empty());
        let lines = text.split(['\r', '\n']).count() + 1;
        assert!(d.line == 0 || d.line <= lines, "line {} out of range: {d}", d.line);
    }
    let positions: Vec<(usize, usize)> = diags.iter().map(|d| (d.line, d.column)).collect();
    assert!(positions.windows(2).all(|w| w[0] <= w[1]), "{rendered}");
    if let Some(p) = pipeline {
        assert!(diags.iter().all(|d| !d.is_error()));
        for overrides in [vec![], vec![("tp".to_string(), "3".to_string()), ("x".to_string(), "".to_string())]] {
            match p.instantiate(&overrides, "fuzz-run") {
                Ok(run) => {
                    assert_eq!(run.topo_order().len(), run.steps.len());
                    let _ = run.step_hashes();
                }
                Err(diags) => {
                    assert!(!diags.is_empty());
                    let _ = render_all(&diags, text);
                }
            }
        }
    }
}

#[derive(Debug, Clone)]
enum Edit {
    Insert(usize, char),
    Delete(usize),
    Replace(usize, char),
    Duplicate(usize, usize),
}

fn edit() -> impl Strategy<Value = Edit> {
    let ch = proptest::sample::select(ALPHABET);
    prop_oneof![
        (any::<usize>(), ch.clone()).prop_map(|(i, c)| Edit::Insert(i, c)),
        any::<usize>().prop_map(Edit::Delete),
        (any::<usize>(), ch).prop_map(|(i, c)| Edit::Replace(i, c)),
        (any::<usize>(), 1usize..40).prop_map(|(i, n)| Edit::Duplicate(i, n)),
    ]
}

fn apply(text: &str, edits: &[Edit]) -> String {
    let mut chars: Vec<char> = text.chars().collect();
    for e in edits {
        let n = chars.len().max(1);
        match *e {
            Edit::Insert(i, c) => chars.insert(i % (chars.len() + 1), c),
            Edit::Delete(i) if !chars.is_empty() => {
                chars.remove(i % n);
            }
            Edit::Replace(i, c) if !chars.is_empty() => chars[i % n] = c,
            Edit::Duplicate(i, len) if !chars.is_empty() => {
                let start = i % n;
                let piece: Vec<char> = chars[start..(start + len).min(chars.len())].to_vec();
                let at = (start + len).min(chars.len());
                chars.splice(at..at, piece);
            }
            _ => {}
        }
    }
    chars.into_iter().collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn mutated_specs_never_panic(seed in 0..SEEDS.len(), edits in proptest::collection::vec(edit(), 1..12)) {
        check(&apply(SEEDS[seed], &edits));
    }

    #[test]
    fn random_yamlish_text_never_panics(chars in proptest::collection::vec(proptest::sample::select(ALPHABET), 0..300)) {
        check(&chars.into_iter().collect::<String>());
    }

    #[test]
    fn arbitrary_unicode_never_panics(text in "\\PC{0,200}") {
        check(&text);
    }
}

#[test]
fn pathological_inputs() {
    for text in [
        "[".repeat(10_000),
        "{a: ".repeat(5_000),
        "- ".repeat(10_000),
        format!("a: &x {}\n", "[*x]".repeat(3)),
        "a: *undefined\n".to_string(),
        "\u{feff}apiVersion: shardline/v1\n".to_string(),
        "steps:\n  - id: a\n    needs: [a]\n    uses: megatron.shard\n".to_string(),
        "apiVersion: shardline/v1\nkind: Pipeline\nname: x\nsteps:\n  - {id: a, uses: store.upload, with: {to: \"${{\"}}\n".to_string(),
        "? [complex, key]\n: value\n".to_string(),
        "\"\\u\"".to_string(),
        "key: 'unterminated\n".to_string(),
        "\0\0\0".to_string(),
        "x: !!binary aGVsbG8=\n".to_string(),
        "%YAML 1.2\n---\na: 1\n".to_string(),
        "--- !!map\n? a\n: b\n".to_string(),
    ] {
        check(&text);
    }
}

/// Big generated files stay fast (every pass is linear or n·log n) and report a bounded number
/// of diagnostics.
#[test]
fn large_inputs_lint_in_bounded_time_and_output() {
    let mut chain = String::from("apiVersion: shardline/v1\nkind: Pipeline\nname: chain\nsteps:\n");
    let mut i = 0;
    while chain.len() < 900_000 {
        chain.push_str(&format!(
            "  - {{id: s{i}, uses: megatron.shard, needs: [s{}], with: {{tp: 1, dp: 1}}}}\n",
            i + 1
        ));
        i += 1;
    }
    let mut keys = String::new();
    let mut i = 0;
    while keys.len() < 900_000 {
        keys.push_str(&format!("k{i}: v\n"));
        i += 1;
    }
    for text in [chain, keys] {
        let start = std::time::Instant::now();
        let (_, diags) = lint("big.yaml", &text, &LintContext::new());
        let rendered = render_all(&diags, &text);
        assert_eq!(diags.len(), shardline_spec::MAX_DIAGNOSTICS + 1);
        assert_eq!(diags.last().unwrap().code, "too-many-diagnostics");
        assert!(rendered.len() < 200_000);
        assert!(start.elapsed() < std::time::Duration::from_secs(60), "took {:?}", start.elapsed());
    }
}
