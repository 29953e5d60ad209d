//! The file-system half of the path policy (the spec crate decides, this resolves): a local path
//! as the worker would reach it — joined to the base directory when relative, its symlinks
//! followed — and the server's roots read from its flags.

use std::path::{Path, PathBuf};

use shardline_spec::policy::{parse_root, PathPolicy};

/// `path` as a worker reaches it: joined to `base` when relative, symlinks followed. A path that
/// does not exist yet (a destination) is its deepest existing ancestor, resolved, with the rest
/// appended as written (`..` never gets here: the policy refuses it first).
pub fn resolve_local(base: &Path, path: &Path) -> Result<PathBuf, String> {
    let full = if path.is_relative() { base.join(path) } else { path.to_path_buf() };
    let mut existing = full.as_path();
    let mut rest = Vec::new();
    loop {
        match existing.canonicalize() {
            Ok(mut real) => {
                real.extend(rest.iter().rev());
                return Ok(real);
            }
            Err(_) => match (existing.parent(), existing.file_name()) {
                (Some(parent), Some(name)) => {
                    rest.push(name.to_owned());
                    existing = parent;
                }
                _ => return Err(format!("`{}` cannot be resolved", full.display())),
            },
        }
    }
}

/// The policy of `--allow-source`, `--allow-dest` and `--allow-commands`; `None` when no root
/// was given and commands are not mentioned (the local CLI's freedom).
pub fn policy_from_flags(sources: &[String], dests: &[String], commands: bool) -> Result<PathPolicy, String> {
    let resolve = |p: &Path| resolve_local(Path::new("/"), p);
    let roots = |texts: &[String]| texts.iter().map(|t| parse_root(t, &resolve)).collect::<Result<Vec<_>, _>>();
    Ok(PathPolicy { sources: roots(sources)?, dests: roots(dests)?, commands })
}
