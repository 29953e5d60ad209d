//! Python pickle support, as far as DCP and `torch.save` need it.
//!
//! * [`PickleWriter`] emits protocol-2 opcodes one by one. The caller decides the structure; the
//!   writer only gets the byte encoding of each opcode right (`.metadata` and `data.pkl` are built
//!   from it in [`crate::dcp_metadata`] and [`crate::torch_save`]).
//! * [`loads`] and [`Reader`] are a small, bounded, strict stack machine that turns what CPython's
//!   pickler writes (protocols 0–5) into a generic [`Value`] tree. It never calls anything:
//!   globals, `REDUCE` and `NEWOBJ` are kept as data. It never panics; malformed, truncated,
//!   oversized or trailing input gives a [`PickleError`]. [`Reader`] streams: it reads from any
//!   `BufRead`, and hands the items of chosen top-level dicts to the caller as they complete
//!   instead of keeping them, so memory follows the largest item, not the file.

mod encode;
mod input;
mod opcodes;
mod patch;
mod read;
mod repr;
mod scan;
mod write;

use std::sync::Arc;

use thiserror::Error;

pub use encode::dumps;
pub use patch::set_int_fields;
pub use read::{loads, loads_with_limits, Reader};
pub use scan::{scan_memo_references, MemoReferences};
pub use write::PickleWriter;

/// The highest pickle protocol the reader accepts.
pub const HIGHEST_PROTOCOL: u8 = 5;

/// A Python object as the pickle describes it. Nothing is evaluated: a class instance is its
/// class reference plus the arguments and state the pickle gives for it.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    None,
    Bool(bool),
    Int(i128),
    Float(f64),
    Str(String),
    Bytes(Vec<u8>),
    Tuple(Vec<Value>),
    List(Vec<Value>),
    /// Key/value pairs in pickle order. Repeated keys are kept as they come (Python would keep
    /// the last value).
    Dict(Vec<(Value, Value)>),
    Set(Vec<Value>),
    FrozenSet(Vec<Value>),
    /// A reference to `module.name` (`GLOBAL` or `STACK_GLOBAL`).
    /// Shared: a pickle names the same few classes over and over.
    Global {
        module: Arc<str>,
        name: Arc<str>,
    },
    /// `callable(*args)` (`REDUCE`), with what later opcodes applied to the result: `BUILD`
    /// (state), `APPEND(S)` (list items) and `SETITEM(S)` (dict items) — the last three parts
    /// of a `__reduce__` tuple.
    Reduce {
        callable: Box<Value>,
        args: Box<Value>,
        state: Option<Box<Value>>,
        list_items: Vec<Value>,
        dict_items: Vec<(Value, Value)>,
    },
    /// `cls.__new__(cls, *args, **kwargs)` (`NEWOBJ`, `NEWOBJ_EX`), plus what later opcodes
    /// applied to it, as for [`Value::Reduce`].
    Object {
        class: Box<Value>,
        args: Box<Value>,
        kwargs: Option<Box<Value>>,
        state: Option<Box<Value>>,
        list_items: Vec<Value>,
        dict_items: Vec<(Value, Value)>,
    },
    /// `persistent_load(pid)` (`BINPERSID`, `PERSID`).
    PersistentId(Box<Value>),
}

impl Value {
    /// A short name of the kind of value, for error messages (`"tuple"`, `"global torch.Size"`).
    pub fn describe(&self) -> String {
        match self {
            Value::None => "None".into(),
            Value::Bool(b) => format!("bool {}", if *b { "True" } else { "False" }),
            Value::Int(i) => format!("int {i}"),
            Value::Float(f) => format!("float {f}"),
            Value::Str(_) => "str".into(),
            Value::Bytes(_) => "bytes".into(),
            Value::Tuple(v) => format!("tuple of {}", v.len()),
            Value::List(v) => format!("list of {}", v.len()),
            Value::Dict(v) => format!("dict of {}", v.len()),
            Value::Set(_) => "set".into(),
            Value::FrozenSet(_) => "frozenset".into(),
            Value::Global { module, name } => format!("global {module}.{name}"),
            Value::Reduce { callable, .. } => format!("call of {}", callable.describe()),
            Value::Object { class, .. } => format!("instance of {}", class.describe()),
            Value::PersistentId(_) => "persistent id".into(),
        }
    }

    /// `(nodes, string bytes)` of this value counted without recursion, or `None` past
    /// `max_nodes` nodes.
    pub fn size_within(&self, max_nodes: usize) -> Option<(usize, usize)> {
        let (mut nodes, mut bytes) = (0usize, 0usize);
        let mut todo = vec![self];
        while let Some(v) = todo.pop() {
            nodes += 1;
            if nodes > max_nodes {
                return None;
            }
            match v {
                Value::Str(s) => bytes += s.len(),
                Value::Bytes(b) => bytes += b.len(),
                Value::Global { module, name } => bytes += module.len() + name.len(),
                Value::Tuple(x) | Value::List(x) | Value::Set(x) | Value::FrozenSet(x) => todo.extend(x),
                Value::Dict(p) => todo.extend(p.iter().flat_map(|(k, v)| [k, v])),
                Value::PersistentId(x) => todo.push(x),
                Value::Reduce { callable: a, args: b, state, list_items, dict_items }
                | Value::Object { class: a, args: b, state, list_items, dict_items, .. } => {
                    todo.extend([&**a, &**b]);
                    todo.extend(state.as_deref());
                    if let Value::Object { kwargs: Some(k), .. } = v {
                        todo.push(k);
                    }
                    todo.extend(list_items);
                    todo.extend(dict_items.iter().flat_map(|(k, v)| [k, v]));
                }
                _ => {}
            }
        }
        Some((nodes, bytes))
    }

    /// The string, if this is a `str`.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }

    /// The integer, if this is an `int` (not a bool).
    pub fn as_int(&self) -> Option<i128> {
        match self {
            Value::Int(i) => Some(*i),
            _ => None,
        }
    }

    /// The items, if this is a tuple or a list.
    pub fn as_seq(&self) -> Option<&[Value]> {
        match self {
            Value::Tuple(v) | Value::List(v) => Some(v),
            _ => None,
        }
    }

    /// The pairs, if this is a dict.
    pub fn as_dict(&self) -> Option<&[(Value, Value)]> {
        match self {
            Value::Dict(v) => Some(v),
            _ => None,
        }
    }

    /// `(module, name)`, if this is a global reference.
    pub fn as_global(&self) -> Option<(&str, &str)> {
        match self {
            Value::Global { module, name } => Some((module, name)),
            _ => None,
        }
    }

    /// Whether this is the global `module.name`.
    pub fn is_global(&self, module: &str, name: &str) -> bool {
        self.as_global() == Some((module, name))
    }

    /// The value of the `str` key `key`, if this is a dict that has it (the last one wins, as in
    /// Python).
    pub fn dict_get(&self, key: &str) -> Option<&Value> {
        self.as_dict()?.iter().rev().find(|(k, _)| k.as_str() == Some(key)).map(|(_, v)| v)
    }
}

/// Errors of the pickle reader. Offsets are byte offsets into the pickle.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum PickleError {
    #[error("pickle truncated: {opcode} at offset {offset} needs {needed} bytes, {available} left")]
    Truncated { opcode: &'static str, offset: u64, needed: u64, available: u64 },
    #[error("pickle ends at offset {offset} without STOP")]
    MissingStop { offset: u64 },
    #[error("unsupported pickle opcode 0x{opcode:02x} ({name}) at offset {offset}")]
    UnsupportedOpcode { opcode: u8, name: &'static str, offset: u64 },
    #[error("unsupported pickle protocol {protocol} at offset {offset} (highest supported: 5)")]
    UnsupportedProtocol { protocol: u8, offset: u64 },
    #[error("pickle stack underflow: {opcode} at offset {offset}")]
    StackUnderflow { opcode: &'static str, offset: u64 },
    #[error("pickle mark missing: {opcode} at offset {offset} has no MARK to pop to")]
    MissingMark { opcode: &'static str, offset: u64 },
    #[error("pickle memo key {key} undefined: {opcode} at offset {offset}")]
    UndefinedMemo { key: u64, opcode: &'static str, offset: u64 },
    #[error("invalid pickle: {opcode} at offset {offset}: {detail}")]
    Invalid { opcode: &'static str, offset: u64, detail: String },
    #[error("unexpected data after the pickle's STOP at offset {offset}")]
    TrailingData { offset: u64 },
    #[error("pickle i/o error at offset {offset}: {detail}")]
    Io { offset: u64, detail: String },
    #[error("pickle limit exceeded: {what} above {max} (at offset {offset})")]
    Limit { what: &'static str, max: u64, offset: u64 },
}

/// Bounds on what [`loads_with_limits`] will build.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Deepest nesting of containers and objects in the result.
    pub max_depth: usize,
    /// Most memo entries.
    pub max_memo: usize,
    /// Most values: objects created while reading, and again nodes of the result tree (where
    /// shared objects count once per reference).
    pub max_nodes: usize,
    /// Most bytes of `str`/`bytes` content in the result tree (shared strings count once per
    /// reference).
    pub max_bytes: usize,
}

impl Default for Limits {
    /// The ceilings: generous enough for the `.metadata` of a large checkpoint (millions of
    /// chunks).
    fn default() -> Self {
        Limits { max_depth: 200, max_memo: 1 << 26, max_nodes: 1 << 27, max_bytes: 1 << 31 }
    }
}

impl Limits {
    /// The limits [`loads`] uses for an `input_len`-byte pickle: the [`Limits::default`]
    /// ceilings, lowered in proportion to the input so that sharing through the memo cannot
    /// blow a small pickle up into a huge tree. Real pickles stay far below these ratios (a
    /// memo reference costs 2 bytes and mostly points at a string or a small tuple).
    pub fn for_input(input_len: usize) -> Self {
        let d = Limits::default();
        Limits {
            max_nodes: d.max_nodes.min(input_len.saturating_mul(16).saturating_add(1 << 20)),
            max_bytes: d.max_bytes.min(input_len.saturating_mul(256).saturating_add(64 << 20)),
            ..d
        }
    }
}

#[cfg(test)]
mod tests;
