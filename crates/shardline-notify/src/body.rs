//! What a webhook receives: the JSON body of an event ([`Body`]) and its Slack form.

use chrono::{DateTime, Utc};
use serde::Serialize;
use shardline_spec::PipelineOutline;
use shardline_store::{Notification, NotifyEvent, RunRow};

/// The JSON body (`format: json`). Fields that do not apply are `null`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Body {
    /// `succeeded`, `failed`, `cancelled` or `trigger-error`.
    pub event: String,
    pub run_id: Option<i64>,
    pub run_name: Option<String>,
    pub pipeline: Option<String>,
    /// The Hub repository (or local directory) of the run's download step.
    pub model: Option<String>,
    pub revision: Option<String>,
    /// The run's state when the notification is sent.
    pub state: Option<String>,
    /// Why the run failed, or the trigger's last error.
    pub error: Option<String>,
    pub trigger_id: Option<i64>,
    pub started_at: Option<DateTime<Utc>>,
    pub finished_at: Option<DateTime<Utc>>,
    /// The run's page on the dashboard (the trigger list for a trigger error).
    pub link: Option<String>,
}

/// What a trigger error's body is built from.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TriggerInfo {
    pub pipeline: String,
    pub summary: String,
    pub error: Option<String>,
}

impl Body {
    /// The body of `n`, from its run (as it is now) or its trigger, with links under `base`
    /// (the dashboard's address, without a trailing `/`).
    pub fn new(n: &Notification, run: Option<&RunRow>, trigger: Option<&TriggerInfo>, base: Option<&str>) -> Body {
        let outline = run.map(|r| PipelineOutline::from_value(&r.spec));
        let source = outline.as_ref().and_then(|o| o.steps.iter().find_map(|s| s.download_source()));
        let link = match (base, n.run) {
            (Some(b), Some(id)) => Some(format!("{b}/runs/{id}")),
            (Some(b), None) => Some(format!("{b}/pipelines")),
            (None, _) => None,
        };
        Body {
            event: n.event.as_str().to_string(),
            run_id: n.run.map(|r| r.0),
            run_name: run.map(|r| r.options.name.clone().unwrap_or_else(|| format!("run {}", r.id))),
            pipeline: run.map(|r| r.pipeline_name.clone()).or_else(|| trigger.map(|t| t.pipeline.clone())),
            model: source.and_then(|s| s.repo.clone().or_else(|| s.path.clone())),
            revision: source.and_then(|s| s.revision.clone()),
            state: run.map(|r| r.state.as_str().to_string()),
            error: run.and_then(|r| r.error.clone()).or_else(|| trigger.and_then(|t| t.error.clone())),
            trigger_id: n.trigger_id,
            started_at: run.and_then(|r| r.started_at),
            finished_at: run.and_then(|r| r.finished_at),
            link,
        }
    }

    /// One line for people: what happened, to which run, and where to look.
    pub fn text(&self, event: NotifyEvent, trigger: Option<&TriggerInfo>) -> String {
        let pipeline = self.pipeline.as_deref().unwrap_or("?");
        let mut s = match event {
            NotifyEvent::TriggerError => {
                let what = trigger.map(|t| t.summary.as_str()).unwrap_or("a trigger");
                format!("Shardline: trigger `{what}` of pipeline `{pipeline}` is failing")
            }
            _ => {
                let run = self.run_name.as_deref().unwrap_or("?");
                let id = self.run_id.map(|i| format!(" (#{i})")).unwrap_or_default();
                let model = match (&self.model, &self.revision) {
                    (Some(m), Some(r)) => format!(" of {m}@{r}"),
                    (Some(m), None) => format!(" of {m}"),
                    _ => String::new(),
                };
                format!("Shardline: run {run}{id} of pipeline `{pipeline}`{model} {}", event.as_str())
            }
        };
        if let Some(e) = &self.error {
            let short: String = e.chars().take(300).collect();
            s.push_str(&format!(": {short}"));
        }
        if let Some(l) = &self.link {
            s.push_str(&format!(" — {l}"));
        }
        s
    }
}

/// The Slack body (`format: slack`): what incoming webhooks accept.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SlackBody {
    pub text: String,
}
