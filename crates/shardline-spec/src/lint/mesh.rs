//! Mesh checks shared with value resolution: a mesh's errors (with the model's when it is
//! known), the `with` field each error is about, and the values of a field that would fit.

use std::collections::BTreeSet;

use shardline_layout::{check_mesh_for_model, LayoutError, Mesh, ModelConfig};

/// Errors of a mesh, with the model's checks when the model is known.
pub(crate) fn mesh_errors(mesh: &Mesh, model: Option<&ModelConfig>) -> Vec<LayoutError> {
    match model {
        Some(cfg) => check_mesh_for_model(cfg, mesh),
        None => mesh.check(),
    }
}

/// The `with` field a layout message is about.
pub(crate) fn mesh_field(msg: &str, written: &BTreeSet<&str>) -> &'static str {
    if msg.starts_with("world size") {
        return if written.contains("ep") {
            "ep"
        } else if written.contains("etp") {
            "etp"
        } else {
            "dp"
        };
    }
    for f in ["tp", "cp", "dp", "ep", "etp"] {
        if msg.starts_with(&format!("`{f}` must")) {
            return f;
        }
    }
    if msg.contains("etp (") {
        "etp"
    } else if msg.contains("ep (") {
        "ep"
    } else if msg.contains("cp (") {
        "cp"
    } else {
        "tp"
    }
}

/// Values of `field` (1..=64) for which the mesh passes every check, the other fields kept
/// (`etp` follows `tp` when it is not set). At most 8.
pub(crate) fn fitting_values(mesh: &Mesh, field: &str, etp_follows_tp: bool, model: Option<&ModelConfig>) -> Vec<u64> {
    (1..=64u64)
        .filter(|&v| {
            let mut m = *mesh;
            match field {
                "tp" => {
                    m.tp = v;
                    if etp_follows_tp {
                        m.etp = v;
                    }
                }
                "cp" => m.cp = v,
                "dp" => m.dp = v,
                "ep" => m.ep = v,
                _ => m.etp = v,
            }
            let written: BTreeSet<&str> = ["tp", "cp", "dp", "ep", "etp"].into_iter().collect();
            !mesh_errors(&m, model).iter().any(|e| {
                let msg = match e {
                    LayoutError::Mesh(m) => m.clone(),
                    other => other.to_string(),
                };
                let f = mesh_field(&msg, &written);
                f == field || (field == "tp" && etp_follows_tp && f == "etp")
            })
        })
        .take(8)
        .collect()
}
