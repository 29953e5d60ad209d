//! The first pass over a pickle: which memo keys are ever fetched, so the second pass keeps only
//! those.

use std::io::BufRead;

use super::input::Input;
use super::opcodes::{self as op, opcode_name};
use super::PickleError;

// ------------------------------------------------------------------------------------------------
// Memo pre-pass

/// Which memo keys a pickle ever fetches (`GET`, `BINGET`, `LONG_BINGET`), found by
/// [`scan_memo_references`]. Keys are dense: CPython assigns them in sequence.
#[derive(Clone, Debug, Default)]
pub struct MemoReferences {
    fetched: Vec<u64>,
    /// Memo keys assigned.
    count: u64,
}

impl MemoReferences {
    pub(super) fn contains(&self, key: u64) -> bool {
        let (w, b) = ((key / 64) as usize, key % 64);
        self.fetched.get(w).is_some_and(|x| x & (1 << b) != 0)
    }

    fn insert(&mut self, key: u64) {
        let w = (key / 64) as usize;
        if self.fetched.len() <= w {
            self.fetched.resize(w + 1, 0);
        }
        if let Some(x) = self.fetched.get_mut(w) {
            *x |= 1 << (key % 64);
        }
    }
}

/// How an opcode's argument is laid out in the stream.
pub(super) enum Arg {
    None,
    Fixed(u64),
    /// A little-endian length of this many bytes, then that many bytes.
    Counted(u8),
    /// `n` text lines.
    Lines(u8),
}

pub(super) fn arg_of(code: u8) -> Option<Arg> {
    Some(match code {
        op::MARK
        | op::STOP
        | op::POP
        | op::POP_MARK
        | op::DUP
        | op::NONE
        | op::BINPERSID
        | op::REDUCE
        | op::APPEND
        | op::BUILD
        | op::DICT
        | op::EMPTY_DICT
        | op::APPENDS
        | op::LIST
        | op::EMPTY_LIST
        | op::SETITEM
        | op::TUPLE
        | op::EMPTY_TUPLE
        | op::SETITEMS
        | op::NEWOBJ
        | op::TUPLE1
        | op::TUPLE2
        | op::TUPLE3
        | op::NEWTRUE
        | op::NEWFALSE
        | op::EMPTY_SET
        | op::ADDITEMS
        | op::FROZENSET
        | op::NEWOBJ_EX
        | op::STACK_GLOBAL
        | op::MEMOIZE => Arg::None,
        op::PROTO | op::BININT1 | op::BINPUT | op::BINGET => Arg::Fixed(1),
        op::BININT2 => Arg::Fixed(2),
        op::BININT | op::LONG_BINPUT | op::LONG_BINGET => Arg::Fixed(4),
        op::BINFLOAT | op::FRAME => Arg::Fixed(8),
        op::LONG1 | op::SHORT_BINUNICODE | op::SHORT_BINSTRING | op::SHORT_BINBYTES => Arg::Counted(1),
        op::LONG4 | op::BINUNICODE | op::BINSTRING | op::BINBYTES => Arg::Counted(4),
        op::BINUNICODE8 | op::BINBYTES8 | op::BYTEARRAY8 => Arg::Counted(8),
        op::INT | op::LONG | op::FLOAT | op::PERSID | op::PUT | op::GET => Arg::Lines(1),
        op::GLOBAL => Arg::Lines(2),
        _ => return None,
    })
}

pub(super) fn le_u64(b: &[u8]) -> u64 {
    let mut a = [0u8; 8];
    for (d, s) in a.iter_mut().zip(b) {
        *d = *s;
    }
    u64::from_le_bytes(a)
}

/// The first pass: walks the opcodes without building anything and records which memo keys are
/// fetched later, so that the second pass keeps only those. Memo keys must be assigned in
/// sequence (0, 1, 2, …), as CPython's pickler assigns them.
pub fn scan_memo_references<R: BufRead>(r: R) -> Result<MemoReferences, PickleError> {
    let mut input = Input { r, pos: 0 };
    let mut refs = MemoReferences::default();
    let mut buf = Vec::new();
    // Where the current frame ends: opcodes may not cross it, and a new frame starts only there.
    let mut frame_end: Option<u64> = None;
    loop {
        let start = input.pos;
        let Some(code) = input.next_byte()? else {
            return Err(PickleError::MissingStop { offset: input.pos });
        };
        // Named only when an error needs it: this loop runs once per opcode of a large file.
        let opcode = || opcode_name(code);
        let truncated = |needed: u64, got: &[u8]| PickleError::Truncated {
            opcode: opcode(),
            offset: start,
            needed,
            available: got.len() as u64,
        };
        let invalid =
            |detail: &str| PickleError::Invalid { opcode: opcode(), offset: start, detail: detail.to_owned() };
        if code == op::FRAME && frame_end.is_some() {
            return Err(invalid("a frame starts before the current frame ends"));
        }
        let arg = arg_of(code).ok_or_else(|| PickleError::UnsupportedOpcode {
            opcode: code,
            name: opcode(),
            offset: start,
        })?;
        match arg {
            Arg::None => {}
            Arg::Fixed(n) => {
                if !input.take_into(n, &mut buf)? {
                    return Err(truncated(n, &buf));
                }
            }
            Arg::Counted(w) => {
                if !input.take_into(w.into(), &mut buf)? {
                    return Err(truncated(w.into(), &buf));
                }
                let n = le_u64(&buf);
                let n = if w == 4 && code != op::BINUNICODE && code != op::BINBYTES {
                    n as u32 as i32 as i64 as u64
                } else {
                    n
                };
                // Skip without keeping: read in bounded pieces.
                let mut left = n;
                while left > 0 {
                    let k = left.min(1 << 20);
                    if !input.take_into(k, &mut buf)? {
                        return Err(truncated(n, &buf));
                    }
                    left -= k;
                }
            }
            Arg::Lines(n) => {
                for _ in 0..n {
                    if !input.line_into(&mut buf)? {
                        return Err(truncated(1, &[]));
                    }
                }
            }
        }
        if code == op::FRAME {
            frame_end = Some(input.pos.saturating_add(le_u64(&buf)));
        } else if let Some(end) = frame_end {
            if input.pos > end {
                return Err(invalid("opcode crosses the end of its frame"));
            }
            if input.pos == end {
                frame_end = None;
            }
        }
        let key = match code {
            op::MEMOIZE => Some(refs.count),
            op::BINPUT => Some(u64::from(*buf.first().unwrap_or(&0))),
            op::LONG_BINPUT => Some(le_u64(&buf)),
            op::PUT => std::str::from_utf8(&buf).ok().and_then(|s| s.parse().ok()),
            _ => None,
        };
        if matches!(code, op::MEMOIZE | op::BINPUT | op::LONG_BINPUT | op::PUT) {
            if key != Some(refs.count) {
                return Err(PickleError::Invalid {
                    opcode: opcode(),
                    offset: start,
                    detail: format!("memo key {key:?} out of sequence (expected {})", refs.count),
                });
            }
            refs.count += 1;
        }
        let fetched = match code {
            op::BINGET => Some(u64::from(*buf.first().unwrap_or(&0))),
            op::LONG_BINGET => Some(le_u64(&buf)),
            op::GET => std::str::from_utf8(&buf).ok().and_then(|s| s.parse().ok()),
            _ => None,
        };
        if matches!(code, op::BINGET | op::LONG_BINGET | op::GET) {
            match fetched {
                Some(k) if k < refs.count => refs.insert(k),
                Some(k) => return Err(PickleError::UndefinedMemo { key: k, opcode: opcode(), offset: start }),
                None => {
                    return Err(PickleError::Invalid {
                        opcode: opcode(),
                        offset: start,
                        detail: "malformed memo key".into(),
                    })
                }
            }
        }
        if code == op::STOP {
            if frame_end.is_some() {
                return Err(invalid("pickle ends inside a frame"));
            }
            return Ok(refs);
        }
    }
}
