//! [`PipelineOutline`]: what a stored [`ResolvedPipeline`](crate::ResolvedPipeline) says about
//! its steps (ids, kinds, needs, the source of `hf.download`), read leniently for readers that
//! only show it, such as the dashboard.
//!
//! A run keeps the resolved pipeline it was submitted with, as JSON, for ever; the types have
//! changed since older runs were stored. So every field is optional and a value of the wrong
//! type reads as absent, a step that cannot be read is left out, and a spec that is not a
//! pipeline has no steps. Besides the shape [`ResolvedStep`](crate::ResolvedStep) writes
//! (`{"id", "kind", "needs", "config": {"kind": "hf.download", "repo": …}}`), a step's config may
//! be keyed by its kind (`{"hf.download": {"repo": …}}`) or carry no kind (then the step's counts).

use std::collections::BTreeMap;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Deserializer};

/// The steps of a stored resolved pipeline, in file order.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(default)]
pub struct PipelineOutline {
    #[serde(deserialize_with = "readable_items")]
    pub steps: Vec<StepOutline>,
}

/// A step of a stored resolved pipeline.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(default)]
pub struct StepOutline {
    #[serde(deserialize_with = "readable")]
    pub id: Option<String>,
    /// The step's own kind; see [`StepOutline::kind`].
    #[serde(deserialize_with = "readable")]
    kind: Option<String>,
    /// The ids of the steps it needs (entries that are not strings left out).
    #[serde(deserialize_with = "readable_items")]
    pub needs: Vec<String>,
    #[serde(deserialize_with = "readable")]
    config: Option<ConfigOutline>,
}

/// A step's config, in each shape it has been stored in.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(untagged)]
enum ConfigOutline {
    /// `{"kind": "hf.download", "repo": …}`, as [`StepConfig`](crate::StepConfig) writes it.
    Tagged {
        kind: String,
        #[serde(flatten)]
        source: SourceOutline,
    },
    /// `{"hf.download": {"repo": …}}`: keyed by the kind.
    Keyed(BTreeMap<String, SourceOutline>),
    /// `{"path": …}`: no kind (the step's own says what it is).
    Plain(SourceOutline),
}

/// The source fields of an `hf.download` config.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(default)]
pub struct SourceOutline {
    /// The Hub repository (`org/name`).
    #[serde(deserialize_with = "readable")]
    pub repo: Option<String>,
    /// The local directory.
    #[serde(deserialize_with = "readable")]
    pub path: Option<String>,
    /// The Hub revision.
    #[serde(deserialize_with = "readable")]
    pub revision: Option<String>,
}

impl PipelineOutline {
    /// Reads a stored resolved pipeline; never fails (see the module documentation).
    pub fn from_value(spec: &serde_json::Value) -> PipelineOutline {
        PipelineOutline::deserialize(spec).unwrap_or_default()
    }
}

impl StepOutline {
    /// The step's kind: its own, else its config's, else the key its config is keyed by.
    pub fn kind(&self) -> Option<&str> {
        self.kind.as_deref().or(match &self.config {
            Some(ConfigOutline::Tagged { kind, .. }) => Some(kind.as_str()),
            Some(ConfigOutline::Keyed(by_kind)) if by_kind.len() == 1 => by_kind.keys().next().map(String::as_str),
            _ => None,
        })
    }

    /// The source fields of an `hf.download` step's config; `None` for other steps and for a
    /// step without config.
    pub fn download_source(&self) -> Option<&SourceOutline> {
        const DOWNLOAD: &str = "hf.download";
        match self.config.as_ref()? {
            ConfigOutline::Keyed(by_kind) => by_kind.get(DOWNLOAD),
            ConfigOutline::Tagged { source, .. } | ConfigOutline::Plain(source) => {
                (self.kind() == Some(DOWNLOAD)).then_some(source)
            }
        }
    }
}

/// A value of type `T`, or `None` when it has another shape.
fn readable<'de, D: Deserializer<'de>, T: DeserializeOwned>(d: D) -> Result<Option<T>, D::Error> {
    Ok(T::deserialize(serde_json::Value::deserialize(d)?).ok())
}

/// The items of a list that are of type `T`; none when the value is not a list.
fn readable_items<'de, D: Deserializer<'de>, T: DeserializeOwned>(d: D) -> Result<Vec<T>, D::Error> {
    Ok(match serde_json::Value::deserialize(d)? {
        serde_json::Value::Array(items) => items.into_iter().filter_map(|v| T::deserialize(v).ok()).collect(),
        _ => Vec::new(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn reads_what_instantiate_writes() {
        let text = "apiVersion: shardline/v1\nkind: Pipeline\nname: demo\nsteps:\n  \
                    - {id: download, uses: hf.download, with: {repo: org/m, revision: v2}}\n  \
                    - {id: shard, uses: megatron.shard, needs: [download], with: {tp: 1, dp: 1}}\n";
        let (pipeline, diagnostics) = crate::lint("demo.yaml", text, &crate::LintContext::new());
        assert!(diagnostics.is_empty(), "{diagnostics:?}");
        let resolved = pipeline.expect("pipeline").instantiate(&[], "run-1").expect("instantiate");
        let outline = PipelineOutline::from_value(&serde_json::to_value(&resolved).expect("json"));
        let shown: Vec<(Option<&str>, Option<&str>, &[String])> =
            outline.steps.iter().map(|s| (s.id.as_deref(), s.kind(), s.needs.as_slice())).collect();
        assert_eq!(
            shown,
            [
                (Some("download"), Some("hf.download"), &[][..]),
                (Some("shard"), Some("megatron.shard"), &["download".to_string()][..])
            ]
        );
        let source = outline.steps[0].download_source().expect("source");
        assert_eq!((source.repo.as_deref(), source.revision.as_deref()), (Some("org/m"), Some("v2")));
        assert_eq!(outline.steps[1].download_source(), None);
    }

    #[test]
    fn a_config_keyed_by_its_kind_or_without_one() {
        let keyed: StepOutline = serde_json::from_value(json!({"config": {"hf.download": {"path": "/m"}}})).unwrap();
        assert_eq!(keyed.kind(), Some("hf.download"));
        assert_eq!(keyed.download_source().and_then(|s| s.path.as_deref()), Some("/m"));
        let plain: StepOutline =
            serde_json::from_value(json!({"kind": "hf.download", "config": {"path": "/m"}})).unwrap();
        assert_eq!(plain.download_source().and_then(|s| s.path.as_deref()), Some("/m"));
        let other: StepOutline = serde_json::from_value(json!({"config": {"path": "/m"}})).unwrap();
        assert_eq!((other.kind(), other.download_source()), (None, None));
    }

    #[test]
    fn what_cannot_be_read_is_left_out() {
        let outline = PipelineOutline::from_value(&json!({"steps": [
            {"id": 1, "kind": ["x"], "needs": ["a", 2, null], "config": 3}, "step", {"id": "b", "needs": "a"}]}));
        assert_eq!(outline.steps.len(), 2);
        assert_eq!((outline.steps[0].id.as_deref(), outline.steps[0].kind()), (None, None));
        assert_eq!(outline.steps[0].needs, ["a"]);
        assert!(outline.steps[1].needs.is_empty());
        for spec in [json!(null), json!("x"), json!({"steps": 1})] {
            assert_eq!(PipelineOutline::from_value(&spec), PipelineOutline::default());
        }
    }
}
