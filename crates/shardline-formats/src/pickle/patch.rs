//! Editing a pickle in place: the integer values of named fields replaced, every other byte kept
//! as it was. A training job's `args` holds whatever objects the job put there; rewriting it
//! whole from a parsed value would have to reproduce each of them, while only a handful of ints
//! (the mesh sizes) change when a checkpoint is resharded.

use super::opcodes as op;
use super::scan::{arg_of, le_u64, Arg};
use super::{PickleError, PickleWriter};

/// One opcode: its byte range and, for strings, the text.
struct Op<'a> {
    code: u8,
    start: usize,
    end: usize,
    text: Option<&'a str>,
}

fn walk(pkl: &[u8]) -> Result<Vec<Op<'_>>, PickleError> {
    let mut ops = Vec::new();
    let mut at = 0usize;
    let truncated =
        |start: usize| PickleError::Truncated { opcode: "argument", offset: start as u64, needed: 1, available: 0 };
    while at < pkl.len() {
        let (start, code) = (at, pkl[at]);
        at += 1;
        let arg = arg_of(code).ok_or(PickleError::UnsupportedOpcode {
            opcode: code,
            name: op::opcode_name(code),
            offset: start as u64,
        })?;
        let mut text = None;
        match arg {
            Arg::None => {}
            Arg::Fixed(n) => at += n as usize,
            Arg::Counted(w) => {
                let w = usize::from(w);
                let len = pkl.get(at..at + w).map(le_u64).ok_or_else(|| truncated(start))? as usize;
                let body = pkl.get(at + w..at + w + len).ok_or_else(|| truncated(start))?;
                if matches!(code, op::SHORT_BINUNICODE | op::BINUNICODE | op::BINUNICODE8) {
                    text = std::str::from_utf8(body).ok();
                }
                at += w + len;
            }
            Arg::Lines(n) => {
                for _ in 0..n {
                    let nl = pkl
                        .get(at..)
                        .and_then(|r| r.iter().position(|b| *b == b'\n'))
                        .ok_or_else(|| truncated(start))?;
                    at += nl + 1;
                }
            }
        }
        if at > pkl.len() {
            return Err(truncated(start));
        }
        ops.push(Op { code, start, end: at, text });
        if code == op::STOP {
            break;
        }
    }
    Ok(ops)
}

/// `pkl` with the value after each key of `updates` (a dict key string followed by an int or
/// `None`) replaced by the new int. Returns the new pickle and the keys it found. Pickles with
/// frames (protocol 4+) are refused: their frame lengths would need rewriting too.
pub fn set_int_fields(pkl: &[u8], updates: &[(&str, i128)]) -> Result<(Vec<u8>, Vec<String>), PickleError> {
    let ops = walk(pkl)?;
    if let Some(o) = ops.iter().find(|o| o.code == op::FRAME) {
        return Err(PickleError::Invalid {
            opcode: "FRAME",
            offset: o.start as u64,
            detail: "framed pickles (protocol 4+) are not edited in place".into(),
        });
    }
    let mut out = Vec::with_capacity(pkl.len() + 64);
    let mut copied = 0usize;
    let mut found = Vec::new();
    let mut key: Option<&str> = None;
    for o in &ops {
        let is_memo = matches!(o.code, op::BINPUT | op::LONG_BINPUT | op::PUT | op::MEMOIZE);
        if is_memo {
            continue;
        }
        let is_value = matches!(o.code, op::NONE | op::BININT | op::BININT1 | op::BININT2 | op::LONG1 | op::INT);
        if let (Some(k), true) = (key, is_value) {
            if let Some((name, v)) = updates.iter().find(|(n, _)| *n == k) {
                if !found.iter().any(|f: &String| f == name) {
                    out.extend_from_slice(&pkl[copied..o.start]);
                    let mut w = PickleWriter::new();
                    w.int(*v);
                    out.extend_from_slice(w.as_bytes());
                    copied = o.end;
                    found.push((*name).to_string());
                }
            }
        }
        key = o.text;
    }
    out.extend_from_slice(&pkl[copied..]);
    Ok((out, found))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pickle::{loads, Value};

    #[test]
    fn ints_after_named_keys_change_and_nothing_else() {
        // pickle.dumps({'tp': 1, 'name': 'tp', 'ep': None, 'big': 2**40, 'dp': 4}, protocol=2)
        let mut w = PickleWriter::new();
        w.proto(2).empty_dict().mark();
        w.str("tp").int(1).str("name").str("tp").str("ep").none().str("big").int(1 << 40).str("dp").int(4);
        w.setitems().stop();
        let (patched, found) = set_int_fields(w.as_bytes(), &[("tp", 8), ("ep", 2), ("pp", 1)]).unwrap();
        assert_eq!(found, vec!["tp".to_string(), "ep".to_string()]);
        let v = loads(&patched).unwrap();
        let get = |k: &str| v.dict_get(k).cloned();
        assert_eq!(get("tp"), Some(Value::Int(8)));
        assert_eq!(get("ep"), Some(Value::Int(2)));
        assert_eq!(get("name"), Some(Value::Str("tp".into())));
        assert_eq!(get("big"), Some(Value::Int(1 << 40)));
        assert_eq!(get("dp"), Some(Value::Int(4)));
    }
}
