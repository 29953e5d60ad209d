//! A batch of new tasks, checked before any of it is written: names, needs, value ranges and
//! cycles among the batch's own edges, every problem reported at once.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use serde_json::{json, Value};

use crate::error::{Result, StoreError};
use crate::types::*;

/// Task names, kinds and step ids longer than this are refused.
const MAX_NAME_LEN: usize = 512;

/// A validated task of a batch, in the store's units.
pub(crate) struct Prepared {
    pub(crate) name: String,
    pub(crate) needs: Vec<String>,
    pub(crate) row: Value,
}

pub(crate) fn prepare(run: RunId, tasks: &[NewTask]) -> Result<Vec<Prepared>> {
    let mut problems = Vec::new();
    let mut seen = HashSet::new();
    let mut out = Vec::with_capacity(tasks.len());
    for t in tasks {
        let name = &t.name;
        if name.is_empty() {
            problems.push("a task has an empty name".to_string());
        } else if !seen.insert(name.as_str()) {
            problems.push(format!("task `{name}` appears twice in the batch"));
        }
        for (what, value) in [("name", name), ("step_id", &t.step_id), ("kind", &t.kind)] {
            if value.len() > MAX_NAME_LEN {
                problems.push(format!("task `{name}`: `{what}` is longer than {MAX_NAME_LEN} bytes"));
            }
            if value.contains('\0') {
                problems.push(format!("task `{name}`: `{what}` contains a NUL byte"));
            }
        }
        if t.needs.iter().any(|n| n == name) {
            problems.push(format!("task `{name}` needs itself"));
        }
        if t.max_attempts == 0 {
            problems.push(format!("task `{name}`: `max_attempts` must be at least 1"));
        }
        if t.max_lost == 0 {
            problems.push(format!("task `{name}`: `max_lost` must be at least 1"));
        }
        let memory = i64::try_from(t.resources.memory);
        let scratch = i64::try_from(t.resources.scratch);
        if memory.is_err() || scratch.is_err() {
            problems.push(format!("task `{name}`: memory and scratch must be below 2^63 bytes"));
        }
        let backoff = millis(t.backoff);
        let timeout = millis(t.timeout);
        if backoff.is_none() || timeout.is_none() {
            problems.push(format!("task `{name}`: backoff and timeout must be below 2^63 ms"));
        }
        let mut needs: Vec<String> = t.needs.clone();
        needs.sort();
        needs.dedup();
        out.push(Prepared {
            name: name.clone(),
            needs,
            row: json!({
                "name": name,
                "step_id": t.step_id,
                "kind": t.kind,
                "cpus": t.resources.cpus,
                "memory": memory.unwrap_or(0),
                "gpus": t.resources.gpus,
                "scratch": scratch.unwrap_or(0),
                "payload": t.payload,
                "max_attempts": t.max_attempts,
                "max_lost": t.max_lost,
                "backoff_ms": backoff.unwrap_or(0),
                "timeout_ms": timeout.unwrap_or(0),
                "cache_key": t.cache_key,
            }),
        });
    }
    if let Some(chain) = batch_cycle(&out) {
        problems.push(format!("dependency cycle: {}", chain.join(" -> ")));
    }
    if problems.is_empty() {
        Ok(out)
    } else {
        Err(StoreError::InvalidTasks { run, problems })
    }
}

fn millis(d: Duration) -> Option<i64> {
    i64::try_from(d.as_millis()).ok()
}

/// A cycle among the batch's own edges, as the chain of names that closes it.
fn batch_cycle(tasks: &[Prepared]) -> Option<Vec<String>> {
    let mut index: HashMap<&str, usize> = HashMap::new();
    for (i, t) in tasks.iter().enumerate() {
        index.entry(t.name.as_str()).or_insert(i);
    }
    // 0 = unvisited, 1 = on the stack, 2 = done.
    let mut color = vec![0u8; tasks.len()];
    for root in 0..tasks.len() {
        if color[root] != 0 {
            continue;
        }
        // Iterative DFS: (node, next need to look at).
        let mut stack: Vec<(usize, usize)> = vec![(root, 0)];
        color[root] = 1;
        while let Some(&mut (node, ref mut next)) = stack.last_mut() {
            let needs = &tasks[node].needs;
            if *next < needs.len() {
                let need = &needs[*next];
                *next += 1;
                // Self-needs are reported on their own.
                let Some(&m) = index.get(need.as_str()).filter(|&&m| m != node) else { continue };
                match color[m] {
                    0 => {
                        color[m] = 1;
                        stack.push((m, 0));
                    }
                    1 => {
                        let start = stack.iter().position(|&(n, _)| n == m).unwrap_or(0);
                        let mut chain: Vec<String> =
                            stack[start..].iter().map(|&(n, _)| tasks[n].name.clone()).collect();
                        chain.push(tasks[m].name.clone());
                        return Some(chain);
                    }
                    _ => {}
                }
            } else {
                color[node] = 2;
                stack.pop();
            }
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn task(name: &str, needs: &[&str]) -> NewTask {
        NewTask {
            name: name.into(),
            step_id: "s".into(),
            kind: "k".into(),
            needs: needs.iter().map(|s| s.to_string()).collect(),
            ..NewTask::default()
        }
    }

    #[test]
    fn batch_problems_are_all_reported() {
        let err = prepare(
            RunId(1),
            &[
                task("a", &["b"]),
                task("b", &["c"]),
                task("c", &["a"]),
                task("a", &[]),
                NewTask { max_attempts: 0, ..task("d", &["d"]) },
            ],
        )
        .err()
        .map(|e| e.to_string());
        let msg = err.unwrap_or_default();
        assert!(msg.contains("task `a` appears twice"), "{msg}");
        assert!(msg.contains("task `d` needs itself"), "{msg}");
        assert!(msg.contains("`max_attempts` must be at least 1"), "{msg}");
        assert!(msg.contains("dependency cycle: a -> b -> c -> a"), "{msg}");
    }
}
