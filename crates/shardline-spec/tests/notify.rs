//! `notify:`: what valid entries parse to (defaults included), every bad entry reported at its
//! position, and that adding `notify:` leaves the spec hash alone.

use shardline_spec::notify::{NotifyEvent, NotifyFormat, NotifyTarget};
use shardline_spec::{lint, render_all, LintContext};

const HEAD: &str = "apiVersion: shardline/v1\nkind: Pipeline\nname: nightly\n";
const STEPS: &str = "steps:\n  - {id: download, uses: hf.download, with: {path: /data/m}}\n";

fn diags(notify: &str) -> Vec<(String, usize, usize, String)> {
    let text = format!("{HEAD}{notify}{STEPS}");
    let (_, d) = lint("p.yaml", &text, &LintContext::new());
    d.into_iter().map(|d| (d.code, d.line, d.column, d.path)).collect()
}

#[test]
fn entries_parse_with_defaults() {
    let text = format!(
        "{HEAD}notify:\n  - url: https://hooks.slack.com/services/${{SLACK_HOOK}}\n    on: [failed, trigger-error]\n    format: slack\n  - url: http://127.0.0.1:8080/hook?key=${{KEY}}\n{STEPS}"
    );
    let (p, d) = lint("p.yaml", &text, &LintContext::new());
    assert!(d.is_empty(), "{}", render_all(&d, &text));
    let p = p.expect("pipeline");
    assert_eq!(
        p.notify,
        [
            NotifyTarget {
                url: "https://hooks.slack.com/services/${SLACK_HOOK}".into(),
                on: vec![NotifyEvent::Failed, NotifyEvent::TriggerError],
                format: NotifyFormat::Slack
            },
            NotifyTarget {
                url: "http://127.0.0.1:8080/hook?key=${KEY}".into(),
                on: vec![NotifyEvent::Failed, NotifyEvent::Succeeded],
                format: NotifyFormat::Json
            },
        ]
    );
}

#[test]
fn bad_entries_are_reported_where_they_are() {
    let got = diags(
        "notify:\n  - url: https://h/x\n    on: [failed, cancel]\n    format: slak\n  - {url: \"ftp://h/x\", onn: [failed]}\n  - {on: []}\n  - url: \"https://h/${bad-name}\"\n  - url: \"https://h/${{ params.hook }}\"\n  - just-a-string\n",
    );
    let want = [
        ("unknown-event", 6, 18, "notify[0].on[1]"),
        ("unknown-format", 7, 13, "notify[0].format"),
        ("invalid-url", 8, 11, "notify[1].url"),
        ("unknown-key", 8, 24, "notify[1].onn"),
        ("missing-key", 9, 5, "notify[2].url"),
        ("empty-list", 9, 10, "notify[2].on"),
        ("invalid-url", 10, 10, "notify[3].url"),
        ("invalid-url", 11, 10, "notify[4].url"),
        ("wrong-type", 12, 5, "notify[5]"),
    ];
    let got: Vec<(&str, usize, usize, &str)> =
        got.iter().map(|(c, l, col, p)| (c.as_str(), *l, *col, p.as_str())).collect();
    assert_eq!(got, want);
    assert_eq!(diags("notify: {url: https://h}\n")[0].0, "wrong-type");
}

#[test]
fn notify_is_not_part_of_the_spec_hash() {
    let plain = format!("{HEAD}{STEPS}");
    let with = format!("{HEAD}notify:\n  - url: https://h/x\n{STEPS}");
    let hash = |text: &str| {
        let (p, d) = lint("p.yaml", text, &LintContext::new());
        assert!(d.is_empty(), "{}", render_all(&d, text));
        p.expect("pipeline").instantiate(&[], "run-1").expect("instantiate").spec_hash
    };
    assert_eq!(hash(&plain), hash(&with));
}
