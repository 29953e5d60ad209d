//! Python pickle support, as far as DCP and `torch.save` need it.
//!
//! * [`PickleWriter`] emits protocol-2 opcodes one by one. The caller decides the structure; the
//!   writer only gets the byte encoding of each opcode right (`.metadata` and `data.pkl` are built
//!   from it in [`crate::dcp_metadata`] and [`crate::torch_save`]).
//! * [`loads`] is a small, bounded stack machine that turns what `pickle.dump` writes (protocols
//!   0–5, binary opcodes plus the few text ones that are trivial to parse) into a generic
//!   [`Value`] tree. It never calls anything: globals, `REDUCE` and `NEWOBJ` are kept as data. It
//!   never panics; malformed, truncated or oversized input gives a [`PickleError`].
//!
//! The reader keeps Python's reference semantics while it runs (objects live in an arena, the memo
//! and the stack hold references, and `APPEND`/`SETITEM`/`BUILD` mutate in place), then expands
//! the root into a tree. Shared objects are cloned during that expansion, under a node and byte
//! budget so that a small pickle cannot expand into a huge tree; cycles hit the depth limit.

use std::collections::HashMap;

use thiserror::Error;

// ------------------------------------------------------------------------------------------------
// Opcodes

mod op {
    pub const MARK: u8 = b'(';
    pub const STOP: u8 = b'.';
    pub const POP: u8 = b'0';
    pub const POP_MARK: u8 = b'1';
    pub const DUP: u8 = b'2';
    pub const FLOAT: u8 = b'F';
    pub const INT: u8 = b'I';
    pub const BININT: u8 = b'J';
    pub const BININT1: u8 = b'K';
    pub const LONG: u8 = b'L';
    pub const BININT2: u8 = b'M';
    pub const NONE: u8 = b'N';
    pub const PERSID: u8 = b'P';
    pub const BINPERSID: u8 = b'Q';
    pub const REDUCE: u8 = b'R';
    pub const BINSTRING: u8 = b'T';
    pub const SHORT_BINSTRING: u8 = b'U';
    pub const BINUNICODE: u8 = b'X';
    pub const APPEND: u8 = b'a';
    pub const BUILD: u8 = b'b';
    pub const GLOBAL: u8 = b'c';
    pub const DICT: u8 = b'd';
    pub const EMPTY_DICT: u8 = b'}';
    pub const APPENDS: u8 = b'e';
    pub const GET: u8 = b'g';
    pub const BINGET: u8 = b'h';
    pub const LONG_BINGET: u8 = b'j';
    pub const LIST: u8 = b'l';
    pub const EMPTY_LIST: u8 = b']';
    pub const PUT: u8 = b'p';
    pub const BINPUT: u8 = b'q';
    pub const LONG_BINPUT: u8 = b'r';
    pub const SETITEM: u8 = b's';
    pub const TUPLE: u8 = b't';
    pub const EMPTY_TUPLE: u8 = b')';
    pub const SETITEMS: u8 = b'u';
    pub const BINFLOAT: u8 = b'G';
    // protocol 2
    pub const PROTO: u8 = 0x80;
    pub const NEWOBJ: u8 = 0x81;
    pub const TUPLE1: u8 = 0x85;
    pub const TUPLE2: u8 = 0x86;
    pub const TUPLE3: u8 = 0x87;
    pub const NEWTRUE: u8 = 0x88;
    pub const NEWFALSE: u8 = 0x89;
    pub const LONG1: u8 = 0x8a;
    pub const LONG4: u8 = 0x8b;
    // protocol 3
    pub const BINBYTES: u8 = b'B';
    pub const SHORT_BINBYTES: u8 = b'C';
    // protocol 4
    pub const SHORT_BINUNICODE: u8 = 0x8c;
    pub const BINUNICODE8: u8 = 0x8d;
    pub const BINBYTES8: u8 = 0x8e;
    pub const EMPTY_SET: u8 = 0x8f;
    pub const ADDITEMS: u8 = 0x90;
    pub const FROZENSET: u8 = 0x91;
    pub const NEWOBJ_EX: u8 = 0x92;
    pub const STACK_GLOBAL: u8 = 0x93;
    pub const MEMOIZE: u8 = 0x94;
    pub const FRAME: u8 = 0x95;
    // protocol 5
    pub const BYTEARRAY8: u8 = 0x96;
}

/// The highest pickle protocol the reader accepts.
pub const HIGHEST_PROTOCOL: u8 = 5;

// ------------------------------------------------------------------------------------------------
// Writer

/// Emits pickle opcodes into a byte buffer, one method per opcode.
///
/// The writer does not check that the opcode sequence makes sense; it only encodes each opcode
/// correctly. Methods chain: `w.global("torch", "Size").mark().int(3).tuple()`.
#[derive(Clone, Debug, Default)]
pub struct PickleWriter {
    buf: Vec<u8>,
}

impl PickleWriter {
    /// An empty writer (no `PROTO` yet; call [`PickleWriter::proto`]).
    pub fn new() -> Self {
        Self::default()
    }

    /// `PROTO n`.
    pub fn proto(&mut self, protocol: u8) -> &mut Self {
        self.buf.extend_from_slice(&[op::PROTO, protocol]);
        self
    }

    /// `GLOBAL`: `c<module>\n<name>\n`. Neither part may contain a newline (they are Python
    /// identifiers and dotted module paths, always constants of this crate).
    pub fn global(&mut self, module: &str, name: &str) -> &mut Self {
        debug_assert!(!module.contains('\n') && !name.contains('\n'));
        self.buf.push(op::GLOBAL);
        self.buf.extend_from_slice(module.as_bytes());
        self.buf.push(b'\n');
        self.buf.extend_from_slice(name.as_bytes());
        self.buf.push(b'\n');
        self
    }

    /// `EMPTY_TUPLE`.
    pub fn empty_tuple(&mut self) -> &mut Self {
        self.op(op::EMPTY_TUPLE)
    }

    /// `NEWOBJ`: `cls.__new__(cls, *args)` from `cls args` on the stack.
    pub fn newobj(&mut self) -> &mut Self {
        self.op(op::NEWOBJ)
    }

    /// `BUILD`: applies the state on top of the stack to the object below it.
    pub fn build(&mut self) -> &mut Self {
        self.op(op::BUILD)
    }

    /// `REDUCE`: `callable(*args)` from `callable args` on the stack.
    pub fn reduce(&mut self) -> &mut Self {
        self.op(op::REDUCE)
    }

    /// `MARK`.
    pub fn mark(&mut self) -> &mut Self {
        self.op(op::MARK)
    }

    /// `TUPLE`: everything since the last mark.
    pub fn tuple(&mut self) -> &mut Self {
        self.op(op::TUPLE)
    }

    /// `TUPLE1`.
    pub fn tuple1(&mut self) -> &mut Self {
        self.op(op::TUPLE1)
    }

    /// `TUPLE2`.
    pub fn tuple2(&mut self) -> &mut Self {
        self.op(op::TUPLE2)
    }

    /// `TUPLE3`.
    pub fn tuple3(&mut self) -> &mut Self {
        self.op(op::TUPLE3)
    }

    /// A tuple of ints the way CPython's pickler writes it: `EMPTY_TUPLE`, the items and
    /// `TUPLE1..3`, or `MARK`, the items and `TUPLE`.
    pub fn int_tuple(&mut self, items: &[u64]) -> &mut Self {
        if items.is_empty() {
            return self.empty_tuple();
        }
        let short = items.len() <= 3;
        if !short {
            self.mark();
        }
        for &i in items {
            self.int(i.into());
        }
        match items.len() {
            1 => self.tuple1(),
            2 => self.tuple2(),
            3 => self.tuple3(),
            _ => self.tuple(),
        }
    }

    /// `EMPTY_DICT`.
    pub fn empty_dict(&mut self) -> &mut Self {
        self.op(op::EMPTY_DICT)
    }

    /// `SETITEM`: one key/value pair into the dict below them.
    pub fn setitem(&mut self) -> &mut Self {
        self.op(op::SETITEM)
    }

    /// `SETITEMS`: the key/value pairs since the last mark.
    pub fn setitems(&mut self) -> &mut Self {
        self.op(op::SETITEMS)
    }

    /// `EMPTY_LIST`.
    pub fn empty_list(&mut self) -> &mut Self {
        self.op(op::EMPTY_LIST)
    }

    /// `APPEND`: one value into the list below it.
    pub fn append(&mut self) -> &mut Self {
        self.op(op::APPEND)
    }

    /// `APPENDS`: the values since the last mark.
    pub fn appends(&mut self) -> &mut Self {
        self.op(op::APPENDS)
    }

    /// A `str`: `BINUNICODE` (u32 length), or `BINUNICODE8` beyond 4 GiB.
    pub fn str(&mut self, s: &str) -> &mut Self {
        match u32::try_from(s.len()) {
            Ok(n) => {
                self.buf.push(op::BINUNICODE);
                self.buf.extend_from_slice(&n.to_le_bytes());
            }
            Err(_) => {
                self.buf.push(op::BINUNICODE8);
                self.buf.extend_from_slice(&(s.len() as u64).to_le_bytes());
            }
        }
        self.buf.extend_from_slice(s.as_bytes());
        self
    }

    /// An `int`: `BININT1` (0..=255), `BININT2` (256..=65535), `BININT` (the rest of the i32
    /// range) or `LONG1` (minimal two's complement, little endian) beyond.
    pub fn int(&mut self, v: i128) -> &mut Self {
        if let Ok(b) = u8::try_from(v) {
            self.buf.extend_from_slice(&[op::BININT1, b]);
        } else if let Ok(h) = u16::try_from(v) {
            self.buf.push(op::BININT2);
            self.buf.extend_from_slice(&h.to_le_bytes());
        } else if let Ok(i) = i32::try_from(v) {
            self.buf.push(op::BININT);
            self.buf.extend_from_slice(&i.to_le_bytes());
        } else {
            let bytes = long_bytes(v);
            self.buf.push(op::LONG1);
            // At most 16 bytes for an i128.
            self.buf.push(bytes.len() as u8);
            self.buf.extend_from_slice(&bytes);
        }
        self
    }

    /// `NEWTRUE` / `NEWFALSE`.
    pub fn bool(&mut self, b: bool) -> &mut Self {
        self.op(if b { op::NEWTRUE } else { op::NEWFALSE })
    }

    /// `NONE`.
    pub fn none(&mut self) -> &mut Self {
        self.op(op::NONE)
    }

    /// `BINFLOAT`: big-endian IEEE 754 double.
    pub fn float(&mut self, v: f64) -> &mut Self {
        self.buf.push(op::BINFLOAT);
        self.buf.extend_from_slice(&v.to_be_bytes());
        self
    }

    /// `BINPERSID`: the value on top of the stack becomes a persistent id.
    pub fn binpersid(&mut self) -> &mut Self {
        self.op(op::BINPERSID)
    }

    /// `STOP`.
    pub fn stop(&mut self) -> &mut Self {
        self.op(op::STOP)
    }

    /// The bytes written so far.
    pub fn as_bytes(&self) -> &[u8] {
        &self.buf
    }

    /// Hands the bytes written so far to `sink` and empties the buffer (for streaming large
    /// pickles that need no memo).
    pub fn drain_into(&mut self, sink: &mut impl std::io::Write) -> std::io::Result<()> {
        sink.write_all(&self.buf)?;
        self.buf.clear();
        Ok(())
    }

    /// Consumes the writer, returning its bytes.
    pub fn into_bytes(self) -> Vec<u8> {
        self.buf
    }

    fn op(&mut self, code: u8) -> &mut Self {
        self.buf.push(code);
        self
    }
}

/// `v` as Python's `encode_long` writes it: minimal two's complement, little endian, empty for 0.
fn long_bytes(v: i128) -> Vec<u8> {
    if v == 0 {
        return Vec::new();
    }
    let mut bytes = v.to_le_bytes().to_vec();
    // Drop a top byte while it is pure sign extension of the byte below it.
    while bytes.len() > 1 {
        let (Some(&top), Some(&next)) = (bytes.last(), bytes.get(bytes.len() - 2)) else {
            break;
        };
        let redundant = (top == 0x00 && next & 0x80 == 0) || (top == 0xff && next & 0x80 != 0);
        if !redundant {
            break;
        }
        bytes.pop();
    }
    bytes
}

// ------------------------------------------------------------------------------------------------
// Values

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
    Global {
        module: String,
        name: String,
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

// ------------------------------------------------------------------------------------------------
// Reader

/// Errors of the pickle reader. Offsets are byte offsets into the pickle.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum PickleError {
    #[error("pickle truncated: {opcode} at offset {offset} needs {needed} bytes, {available} left")]
    Truncated { opcode: &'static str, offset: usize, needed: u64, available: usize },
    #[error("pickle ends at offset {offset} without STOP")]
    MissingStop { offset: usize },
    #[error("unsupported pickle opcode 0x{opcode:02x} ({name}) at offset {offset}")]
    UnsupportedOpcode { opcode: u8, name: &'static str, offset: usize },
    #[error("unsupported pickle protocol {protocol} at offset {offset} (highest supported: 5)")]
    UnsupportedProtocol { protocol: u8, offset: usize },
    #[error("pickle stack underflow: {opcode} at offset {offset}")]
    StackUnderflow { opcode: &'static str, offset: usize },
    #[error("pickle mark missing: {opcode} at offset {offset} has no MARK to pop to")]
    MissingMark { opcode: &'static str, offset: usize },
    #[error("pickle memo key {key} undefined: {opcode} at offset {offset}")]
    UndefinedMemo { key: u64, opcode: &'static str, offset: usize },
    #[error("invalid pickle: {opcode} at offset {offset}: {detail}")]
    Invalid { opcode: &'static str, offset: usize, detail: String },
    #[error("pickle limit exceeded: {what} above {max} (at offset {offset})")]
    Limit { what: &'static str, max: u64, offset: usize },
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

/// Reads one pickle with [`Limits::for_input`]. Bytes after `STOP` are ignored, as Python does.
pub fn loads(data: &[u8]) -> Result<Value, PickleError> {
    loads_with_limits(data, &Limits::for_input(data.len()))
}

/// Reads one pickle within `limits`.
pub fn loads_with_limits(data: &[u8], limits: &Limits) -> Result<Value, PickleError> {
    let mut vm = Vm {
        data,
        pos: 0,
        op_start: 0,
        opcode: "PROTO",
        limits,
        arena: Vec::new(),
        stack: Vec::new(),
        marks: Vec::new(),
        memo: HashMap::new(),
    };
    let root = vm.run()?;
    let mut budget = Budget { nodes: 0, bytes: 0, limits, offset: vm.pos };
    expand(&vm.arena, root, &mut budget)
}

type Id = usize;

/// An object while the pickle is being read; containers refer to other objects by arena index.
enum Node {
    Leaf(Value),
    Tuple(Vec<Id>),
    List(Vec<Id>),
    Dict(Vec<(Id, Id)>),
    Set(Vec<Id>),
    FrozenSet(Vec<Id>),
    Reduce {
        callable: Id,
        args: Id,
        state: Option<Id>,
        list_items: Vec<Id>,
        dict_items: Vec<(Id, Id)>,
    },
    Object {
        class: Id,
        args: Id,
        kwargs: Option<Id>,
        state: Option<Id>,
        list_items: Vec<Id>,
        dict_items: Vec<(Id, Id)>,
    },
    PersistentId(Id),
}

struct Vm<'a> {
    data: &'a [u8],
    pos: usize,
    op_start: usize,
    opcode: &'static str,
    limits: &'a Limits,
    arena: Vec<Node>,
    stack: Vec<Id>,
    marks: Vec<usize>,
    memo: HashMap<u64, Id>,
}

impl<'a> Vm<'a> {
    fn run(&mut self) -> Result<Id, PickleError> {
        loop {
            self.op_start = self.pos;
            let Some(&code) = self.data.get(self.pos) else {
                return Err(PickleError::MissingStop { offset: self.pos });
            };
            self.pos += 1;
            self.opcode = opcode_name(code);
            match code {
                op::PROTO => {
                    let p = self.take_u8()?;
                    if p > HIGHEST_PROTOCOL {
                        return Err(PickleError::UnsupportedProtocol { protocol: p, offset: self.op_start });
                    }
                }
                op::FRAME => {
                    let n = self.take_u64()?;
                    let left = self.data.len() - self.pos;
                    if n > left as u64 {
                        return Err(self.truncated(n));
                    }
                }
                op::STOP => return self.pop(),

                // --- scalars
                op::NONE => self.push_leaf(Value::None)?,
                op::NEWTRUE => self.push_leaf(Value::Bool(true))?,
                op::NEWFALSE => self.push_leaf(Value::Bool(false))?,
                op::BININT1 => {
                    let v = self.take_u8()?;
                    self.push_leaf(Value::Int(v.into()))?
                }
                op::BININT2 => {
                    let v = u16::from_le_bytes(self.take_array()?);
                    self.push_leaf(Value::Int(v.into()))?
                }
                op::BININT => {
                    let v = i32::from_le_bytes(self.take_array()?);
                    self.push_leaf(Value::Int(v.into()))?
                }
                op::LONG1 => {
                    let n = self.take_u8()?;
                    let bytes = self.take(n.into())?;
                    let v = self.decode_long(bytes)?;
                    self.push_leaf(Value::Int(v))?
                }
                op::LONG4 => {
                    let n = i32::from_le_bytes(self.take_array()?);
                    let n = u64::try_from(n).map_err(|_| self.invalid("negative byte count"))?;
                    let bytes = self.take(n)?;
                    let v = self.decode_long(bytes)?;
                    self.push_leaf(Value::Int(v))?
                }
                op::INT => {
                    let line = self.take_line()?;
                    let v = match line {
                        "00" => Value::Bool(false),
                        "01" => Value::Bool(true),
                        s => Value::Int(s.parse::<i128>().map_err(|_| self.invalid("malformed decimal integer"))?),
                    };
                    self.push_leaf(v)?
                }
                op::LONG => {
                    let line = self.take_line()?;
                    let s = line.strip_suffix('L').unwrap_or(line);
                    let v = s.parse::<i128>().map_err(|_| self.invalid("malformed or out-of-range decimal integer"))?;
                    self.push_leaf(Value::Int(v))?
                }
                op::BINFLOAT => {
                    let v = f64::from_be_bytes(self.take_array()?);
                    self.push_leaf(Value::Float(v))?
                }
                op::FLOAT => {
                    let line = self.take_line()?;
                    let v = line.parse::<f64>().map_err(|_| self.invalid("malformed float"))?;
                    self.push_leaf(Value::Float(v))?
                }

                // --- strings and bytes
                op::SHORT_BINUNICODE => {
                    let n = self.take_u8()?;
                    self.push_str(n.into())?
                }
                op::BINUNICODE => {
                    let n = u32::from_le_bytes(self.take_array()?);
                    self.push_str(n.into())?
                }
                op::BINUNICODE8 => {
                    let n = self.take_u64()?;
                    self.push_str(n)?
                }
                op::SHORT_BINSTRING => {
                    // Python 2 `str`; Python 3 decodes it as ASCII by default.
                    let n = self.take_u8()?;
                    self.push_str(n.into())?
                }
                op::BINSTRING => {
                    let n = i32::from_le_bytes(self.take_array()?);
                    let n = u64::try_from(n).map_err(|_| self.invalid("negative length"))?;
                    self.push_str(n)?
                }
                op::SHORT_BINBYTES => {
                    let n = self.take_u8()?;
                    self.push_bytes(n.into())?
                }
                op::BINBYTES => {
                    let n = u32::from_le_bytes(self.take_array()?);
                    self.push_bytes(n.into())?
                }
                op::BINBYTES8 | op::BYTEARRAY8 => {
                    let n = self.take_u64()?;
                    self.push_bytes(n)?
                }

                // --- containers
                op::EMPTY_TUPLE => self.push_node(Node::Tuple(Vec::new()))?,
                op::TUPLE1 | op::TUPLE2 | op::TUPLE3 => {
                    let n = usize::from(code - op::TUPLE1 + 1);
                    let items = self.pop_n(n)?;
                    self.push_node(Node::Tuple(items))?
                }
                op::TUPLE => {
                    let items = self.pop_mark()?;
                    self.push_node(Node::Tuple(items))?
                }
                op::EMPTY_LIST => self.push_node(Node::List(Vec::new()))?,
                op::LIST => {
                    let items = self.pop_mark()?;
                    self.push_node(Node::List(items))?
                }
                op::EMPTY_DICT => self.push_node(Node::Dict(Vec::new()))?,
                op::DICT => {
                    let items = self.pop_mark()?;
                    let pairs = self.pairs(items)?;
                    self.push_node(Node::Dict(pairs))?
                }
                op::EMPTY_SET => self.push_node(Node::Set(Vec::new()))?,
                op::FROZENSET => {
                    let items = self.pop_mark()?;
                    self.push_node(Node::FrozenSet(items))?
                }
                op::APPEND => {
                    let item = self.pop()?;
                    let target = self.top()?;
                    self.extend_list(target, vec![item])?
                }
                op::APPENDS => {
                    let items = self.pop_mark()?;
                    let target = self.top()?;
                    self.extend_list(target, items)?
                }
                op::SETITEM => {
                    let value = self.pop()?;
                    let key = self.pop()?;
                    let target = self.top()?;
                    self.extend_dict(target, vec![(key, value)])?
                }
                op::SETITEMS => {
                    let items = self.pop_mark()?;
                    let pairs = self.pairs(items)?;
                    let target = self.top()?;
                    self.extend_dict(target, pairs)?
                }
                op::ADDITEMS => {
                    let items = self.pop_mark()?;
                    let target = self.top()?;
                    match self.arena.get_mut(target) {
                        Some(Node::Set(v)) => v.extend(items),
                        _ => return Err(self.invalid("target is not a set")),
                    }
                }

                // --- stack and memo
                op::MARK => {
                    if self.marks.len() >= self.limits.max_depth.saturating_mul(4) {
                        return Err(self.limit("open marks", self.limits.max_depth as u64 * 4));
                    }
                    self.marks.push(self.stack.len())
                }
                op::POP => {
                    // Python pops a mark instead when the stack is empty above the last mark.
                    if self.marks.last() == Some(&self.stack.len()) {
                        self.marks.pop();
                    } else {
                        self.pop()?;
                    }
                }
                op::POP_MARK => {
                    self.pop_mark()?;
                }
                op::DUP => {
                    let top = self.top()?;
                    self.push_id(top)?
                }
                op::BINPUT => {
                    let k = self.take_u8()?;
                    self.memo_put(k.into())?
                }
                op::LONG_BINPUT => {
                    let k = u32::from_le_bytes(self.take_array()?);
                    self.memo_put(k.into())?
                }
                op::PUT => {
                    let k = self.take_decimal_key()?;
                    self.memo_put(k)?
                }
                op::MEMOIZE => {
                    let k = self.memo.len() as u64;
                    self.memo_put(k)?
                }
                op::BINGET => {
                    let k = self.take_u8()?;
                    self.memo_get(k.into())?
                }
                op::LONG_BINGET => {
                    let k = u32::from_le_bytes(self.take_array()?);
                    self.memo_get(k.into())?
                }
                op::GET => {
                    let k = self.take_decimal_key()?;
                    self.memo_get(k)?
                }

                // --- objects
                op::GLOBAL => {
                    let module = self.take_line()?.to_owned();
                    let name = self.take_line()?.to_owned();
                    self.push_leaf(Value::Global { module, name })?
                }
                op::STACK_GLOBAL => {
                    let name = self.pop()?;
                    let module = self.pop()?;
                    let (Some(module), Some(name)) = (self.leaf_str(module), self.leaf_str(name)) else {
                        return Err(self.invalid("module and name must be str"));
                    };
                    let (module, name) = (module.to_owned(), name.to_owned());
                    self.push_leaf(Value::Global { module, name })?
                }
                op::REDUCE => {
                    let args = self.pop()?;
                    let callable = self.pop()?;
                    self.push_node(Node::Reduce {
                        callable,
                        args,
                        state: None,
                        list_items: Vec::new(),
                        dict_items: Vec::new(),
                    })?
                }
                op::NEWOBJ => {
                    let args = self.pop()?;
                    let class = self.pop()?;
                    self.push_node(Node::Object {
                        class,
                        args,
                        kwargs: None,
                        state: None,
                        list_items: Vec::new(),
                        dict_items: Vec::new(),
                    })?
                }
                op::NEWOBJ_EX => {
                    let kwargs = self.pop()?;
                    let args = self.pop()?;
                    let class = self.pop()?;
                    self.push_node(Node::Object {
                        class,
                        args,
                        kwargs: Some(kwargs),
                        state: None,
                        list_items: Vec::new(),
                        dict_items: Vec::new(),
                    })?
                }
                op::BUILD => {
                    let new_state = self.pop()?;
                    let target = self.top()?;
                    let slot = match self.arena.get_mut(target) {
                        Some(Node::Reduce { state, .. }) | Some(Node::Object { state, .. }) => state,
                        _ => {
                            return Err(self.invalid("target is not an object"));
                        }
                    };
                    if slot.is_some() {
                        return Err(self.invalid("object already has a state"));
                    }
                    *slot = Some(new_state);
                }
                op::BINPERSID => {
                    let pid = self.pop()?;
                    self.push_node(Node::PersistentId(pid))?
                }
                op::PERSID => {
                    let pid = self.take_line()?.to_owned();
                    let pid = self.new_node(Node::Leaf(Value::Str(pid)))?;
                    self.push_node(Node::PersistentId(pid))?
                }

                _ => {
                    return Err(PickleError::UnsupportedOpcode {
                        opcode: code,
                        name: self.opcode,
                        offset: self.op_start,
                    })
                }
            }
        }
    }

    // --- input

    fn truncated(&self, needed: u64) -> PickleError {
        PickleError::Truncated {
            opcode: self.opcode,
            offset: self.op_start,
            needed,
            available: self.data.len().saturating_sub(self.pos),
        }
    }

    fn take(&mut self, n: u64) -> Result<&'a [u8], PickleError> {
        let data: &'a [u8] = self.data;
        let end = usize::try_from(n)
            .ok()
            .and_then(|n| self.pos.checked_add(n))
            .filter(|&end| end <= data.len())
            .ok_or_else(|| self.truncated(n))?;
        let out = data.get(self.pos..end).ok_or_else(|| self.truncated(n))?;
        self.pos = end;
        Ok(out)
    }

    fn take_array<const N: usize>(&mut self) -> Result<[u8; N], PickleError> {
        let bytes = self.take(N as u64)?;
        let mut out = [0u8; N];
        out.copy_from_slice(bytes);
        Ok(out)
    }

    fn take_u8(&mut self) -> Result<u8, PickleError> {
        let [b] = self.take_array::<1>()?;
        Ok(b)
    }

    fn take_u64(&mut self) -> Result<u64, PickleError> {
        Ok(u64::from_le_bytes(self.take_array()?))
    }

    /// A `\n`-terminated UTF-8 line (text opcodes, `GLOBAL`).
    fn take_line(&mut self) -> Result<&'a str, PickleError> {
        let data: &'a [u8] = self.data;
        let rest = data.get(self.pos..).unwrap_or_default();
        let Some(n) = rest.iter().position(|&b| b == b'\n') else {
            return Err(self.truncated(rest.len() as u64 + 1));
        };
        let line = rest.get(..n).unwrap_or_default();
        self.pos += n + 1;
        std::str::from_utf8(line).map_err(|_| self.invalid("line is not UTF-8"))
    }

    fn take_decimal_key(&mut self) -> Result<u64, PickleError> {
        let line = self.take_line()?;
        line.parse::<u64>().map_err(|_| self.invalid("malformed memo key"))
    }

    fn decode_long(&self, bytes: &[u8]) -> Result<i128, PickleError> {
        let Some(&last) = bytes.last() else {
            return Ok(0);
        };
        let fill = if last & 0x80 != 0 { 0xff } else { 0x00 };
        let mut buf = [fill; 16];
        for (i, &b) in bytes.iter().enumerate() {
            match buf.get_mut(i) {
                Some(slot) => *slot = b,
                // Beyond 16 bytes only sign extension is allowed.
                None if b == fill => {}
                None => return Err(self.invalid("integer does not fit in 128 bits")),
            }
        }
        // The 16th byte must carry the sign when the encoding is longer than 16 bytes.
        if bytes.len() > 16 && (i128::from_le_bytes(buf) < 0) != (fill == 0xff) {
            return Err(self.invalid("integer does not fit in 128 bits"));
        }
        Ok(i128::from_le_bytes(buf))
    }

    // --- errors

    fn invalid(&self, detail: &str) -> PickleError {
        PickleError::Invalid { opcode: self.opcode, offset: self.op_start, detail: detail.to_owned() }
    }

    fn underflow(&self) -> PickleError {
        PickleError::StackUnderflow { opcode: self.opcode, offset: self.op_start }
    }

    fn limit(&self, what: &'static str, max: u64) -> PickleError {
        PickleError::Limit { what, max, offset: self.op_start }
    }

    // --- stack

    fn new_node(&mut self, node: Node) -> Result<Id, PickleError> {
        if self.arena.len() >= self.limits.max_nodes {
            return Err(self.limit("values", self.limits.max_nodes as u64));
        }
        self.arena.push(node);
        Ok(self.arena.len() - 1)
    }

    fn push_id(&mut self, id: Id) -> Result<(), PickleError> {
        if self.stack.len() >= self.limits.max_nodes {
            return Err(self.limit("stack entries", self.limits.max_nodes as u64));
        }
        self.stack.push(id);
        Ok(())
    }

    fn push_node(&mut self, node: Node) -> Result<(), PickleError> {
        let id = self.new_node(node)?;
        self.push_id(id)
    }

    fn push_leaf(&mut self, v: Value) -> Result<(), PickleError> {
        self.push_node(Node::Leaf(v))
    }

    fn push_str(&mut self, n: u64) -> Result<(), PickleError> {
        let bytes = self.take(n)?;
        let s = std::str::from_utf8(bytes).map_err(|_| self.invalid("string is not UTF-8"))?;
        self.push_leaf(Value::Str(s.to_owned()))
    }

    fn push_bytes(&mut self, n: u64) -> Result<(), PickleError> {
        let bytes = self.take(n)?;
        self.push_leaf(Value::Bytes(bytes.to_vec()))
    }

    /// The top of the stack, above the last mark.
    fn top(&self) -> Result<Id, PickleError> {
        let floor = self.marks.last().copied().unwrap_or(0);
        if self.stack.len() <= floor {
            return Err(self.underflow());
        }
        self.stack.last().copied().ok_or_else(|| self.underflow())
    }

    fn pop(&mut self) -> Result<Id, PickleError> {
        self.top()?;
        self.stack.pop().ok_or_else(|| self.underflow())
    }

    fn pop_n(&mut self, n: usize) -> Result<Vec<Id>, PickleError> {
        let floor = self.marks.last().copied().unwrap_or(0);
        let start = self.stack.len().checked_sub(n).filter(|&s| s >= floor).ok_or_else(|| self.underflow())?;
        Ok(self.stack.split_off(start))
    }

    fn pop_mark(&mut self) -> Result<Vec<Id>, PickleError> {
        let mark = self.marks.pop().ok_or(PickleError::MissingMark { opcode: self.opcode, offset: self.op_start })?;
        if mark > self.stack.len() {
            return Err(self.underflow());
        }
        Ok(self.stack.split_off(mark))
    }

    fn pairs(&self, items: Vec<Id>) -> Result<Vec<(Id, Id)>, PickleError> {
        if items.len() & 1 != 0 {
            return Err(self.invalid("odd number of items for key/value pairs"));
        }
        let mut it = items.into_iter();
        let mut out = Vec::with_capacity(it.len() / 2);
        while let (Some(k), Some(v)) = (it.next(), it.next()) {
            out.push((k, v));
        }
        Ok(out)
    }

    fn extend_list(&mut self, target: Id, items: Vec<Id>) -> Result<(), PickleError> {
        match self.arena.get_mut(target) {
            Some(Node::List(v))
            | Some(Node::Reduce { list_items: v, .. })
            | Some(Node::Object { list_items: v, .. }) => {
                v.extend(items);
                Ok(())
            }
            _ => Err(self.invalid("target is not a list or object")),
        }
    }

    fn extend_dict(&mut self, target: Id, pairs: Vec<(Id, Id)>) -> Result<(), PickleError> {
        match self.arena.get_mut(target) {
            Some(Node::Dict(v))
            | Some(Node::Reduce { dict_items: v, .. })
            | Some(Node::Object { dict_items: v, .. }) => {
                v.extend(pairs);
                Ok(())
            }
            _ => Err(self.invalid("target is not a dict or object")),
        }
    }

    fn leaf_str(&self, id: Id) -> Option<&str> {
        match self.arena.get(id) {
            Some(Node::Leaf(Value::Str(s))) => Some(s),
            _ => None,
        }
    }

    // --- memo

    fn memo_put(&mut self, key: u64) -> Result<(), PickleError> {
        let top = self.top()?;
        if self.memo.len() >= self.limits.max_memo && !self.memo.contains_key(&key) {
            return Err(self.limit("memo entries", self.limits.max_memo as u64));
        }
        self.memo.insert(key, top);
        Ok(())
    }

    fn memo_get(&mut self, key: u64) -> Result<(), PickleError> {
        let id = *self.memo.get(&key).ok_or(PickleError::UndefinedMemo {
            key,
            opcode: self.opcode,
            offset: self.op_start,
        })?;
        self.push_id(id)
    }
}

struct Budget<'a> {
    nodes: usize,
    bytes: usize,
    limits: &'a Limits,
    offset: usize,
}

impl Budget<'_> {
    fn charge(&mut self, bytes: usize) -> Result<(), PickleError> {
        self.nodes += 1;
        if self.nodes > self.limits.max_nodes {
            return Err(PickleError::Limit {
                what: "values in the result",
                max: self.limits.max_nodes as u64,
                offset: self.offset,
            });
        }
        self.bytes = self.bytes.saturating_add(bytes);
        if self.bytes > self.limits.max_bytes {
            return Err(PickleError::Limit {
                what: "string bytes in the result",
                max: self.limits.max_bytes as u64,
                offset: self.offset,
            });
        }
        Ok(())
    }
}

/// The objects `node` refers to, in the order [`assemble`] consumes them.
fn children(node: &Node) -> Vec<Id> {
    let flat = |pairs: &[(Id, Id)]| pairs.iter().flat_map(|&(k, v)| [k, v]).collect::<Vec<_>>();
    match node {
        Node::Leaf(_) => Vec::new(),
        Node::Tuple(ids) | Node::List(ids) | Node::Set(ids) | Node::FrozenSet(ids) => ids.clone(),
        Node::Dict(pairs) => flat(pairs),
        Node::PersistentId(i) => vec![*i],
        Node::Reduce { callable, args, state, list_items, dict_items } => {
            let mut v = vec![*callable, *args];
            v.extend(state);
            v.extend(list_items);
            v.extend(flat(dict_items));
            v
        }
        Node::Object { class, args, kwargs, state, list_items, dict_items } => {
            let mut v = vec![*class, *args];
            v.extend(kwargs);
            v.extend(state);
            v.extend(list_items);
            v.extend(flat(dict_items));
            v
        }
    }
}

/// Builds the value of `node` from the expanded values of its [`children`].
fn assemble(node: &Node, vals: Vec<Value>) -> Option<Value> {
    let mut it = vals.into_iter();
    let pairs = |it: &mut std::vec::IntoIter<Value>, n: usize| -> Option<Vec<(Value, Value)>> {
        (0..n).map(|_| Some((it.next()?, it.next()?))).collect()
    };
    let items =
        |it: &mut std::vec::IntoIter<Value>, n: usize| -> Option<Vec<Value>> { (0..n).map(|_| it.next()).collect() };
    Some(match node {
        Node::Leaf(v) => v.clone(),
        Node::Tuple(_) => Value::Tuple(it.collect()),
        Node::List(_) => Value::List(it.collect()),
        Node::Set(_) => Value::Set(it.collect()),
        Node::FrozenSet(_) => Value::FrozenSet(it.collect()),
        Node::Dict(p) => Value::Dict(pairs(&mut it, p.len())?),
        Node::PersistentId(_) => Value::PersistentId(Box::new(it.next()?)),
        Node::Reduce { state, list_items, dict_items, .. } => {
            let callable = Box::new(it.next()?);
            let args = Box::new(it.next()?);
            let state = match state {
                Some(_) => Some(Box::new(it.next()?)),
                None => None,
            };
            let list_items = items(&mut it, list_items.len())?;
            let dict_items = pairs(&mut it, dict_items.len())?;
            Value::Reduce { callable, args, state, list_items, dict_items }
        }
        Node::Object { kwargs, state, list_items, dict_items, .. } => {
            let class = Box::new(it.next()?);
            let args = Box::new(it.next()?);
            let kwargs = match kwargs {
                Some(_) => Some(Box::new(it.next()?)),
                None => None,
            };
            let state = match state {
                Some(_) => Some(Box::new(it.next()?)),
                None => None,
            };
            let list_items = items(&mut it, list_items.len())?;
            let dict_items = pairs(&mut it, dict_items.len())?;
            Value::Object { class, args, kwargs, state, list_items, dict_items }
        }
    })
}

/// Turns the arena graph under `root` into a tree, without recursion (so a large `max_depth`
/// cannot overflow the thread's stack).
fn expand(arena: &[Node], root: Id, budget: &mut Budget) -> Result<Value, PickleError> {
    enum Task {
        Visit(Id, usize),
        Assemble(Id, usize),
    }
    let offset = budget.offset;
    let internal = |detail: &str| PickleError::Invalid { opcode: "STOP", offset, detail: detail.to_owned() };
    let mut tasks = vec![Task::Visit(root, 0)];
    let mut out: Vec<Value> = Vec::new();
    while let Some(task) = tasks.pop() {
        match task {
            Task::Visit(id, depth) => {
                if depth > budget.limits.max_depth {
                    return Err(PickleError::Limit {
                        what: "nesting depth",
                        max: budget.limits.max_depth as u64,
                        offset,
                    });
                }
                let node = arena.get(id).ok_or_else(|| internal("dangling reference"))?;
                let leaf_bytes = match node {
                    Node::Leaf(Value::Str(s)) => s.len(),
                    Node::Leaf(Value::Bytes(b)) => b.len(),
                    Node::Leaf(Value::Global { module, name }) => module.len() + name.len(),
                    _ => 0,
                };
                budget.charge(leaf_bytes)?;
                if let Node::Leaf(v) = node {
                    out.push(v.clone());
                    continue;
                }
                let kids = children(node);
                tasks.push(Task::Assemble(id, kids.len()));
                tasks.extend(kids.into_iter().rev().map(|k| Task::Visit(k, depth + 1)));
            }
            Task::Assemble(id, n) => {
                let node = arena.get(id).ok_or_else(|| internal("dangling reference"))?;
                let start = out.len().checked_sub(n).ok_or_else(|| internal("lost values"))?;
                let vals = out.split_off(start);
                out.push(assemble(node, vals).ok_or_else(|| internal("lost values"))?);
            }
        }
    }
    out.pop().ok_or_else(|| internal("no result"))
}

/// The name of an opcode, for error messages.
fn opcode_name(code: u8) -> &'static str {
    match code {
        op::MARK => "MARK",
        op::STOP => "STOP",
        op::POP => "POP",
        op::POP_MARK => "POP_MARK",
        op::DUP => "DUP",
        op::FLOAT => "FLOAT",
        op::INT => "INT",
        op::BININT => "BININT",
        op::BININT1 => "BININT1",
        op::LONG => "LONG",
        op::BININT2 => "BININT2",
        op::NONE => "NONE",
        op::PERSID => "PERSID",
        op::BINPERSID => "BINPERSID",
        op::REDUCE => "REDUCE",
        b'S' => "STRING",
        op::BINSTRING => "BINSTRING",
        op::SHORT_BINSTRING => "SHORT_BINSTRING",
        b'V' => "UNICODE",
        op::BINUNICODE => "BINUNICODE",
        op::APPEND => "APPEND",
        op::BUILD => "BUILD",
        op::GLOBAL => "GLOBAL",
        op::DICT => "DICT",
        op::EMPTY_DICT => "EMPTY_DICT",
        op::APPENDS => "APPENDS",
        op::GET => "GET",
        op::BINGET => "BINGET",
        b'i' => "INST",
        op::LONG_BINGET => "LONG_BINGET",
        op::LIST => "LIST",
        op::EMPTY_LIST => "EMPTY_LIST",
        b'o' => "OBJ",
        op::PUT => "PUT",
        op::BINPUT => "BINPUT",
        op::LONG_BINPUT => "LONG_BINPUT",
        op::SETITEM => "SETITEM",
        op::TUPLE => "TUPLE",
        op::EMPTY_TUPLE => "EMPTY_TUPLE",
        op::SETITEMS => "SETITEMS",
        op::BINFLOAT => "BINFLOAT",
        op::PROTO => "PROTO",
        op::NEWOBJ => "NEWOBJ",
        0x82 => "EXT1",
        0x83 => "EXT2",
        0x84 => "EXT4",
        op::TUPLE1 => "TUPLE1",
        op::TUPLE2 => "TUPLE2",
        op::TUPLE3 => "TUPLE3",
        op::NEWTRUE => "NEWTRUE",
        op::NEWFALSE => "NEWFALSE",
        op::LONG1 => "LONG1",
        op::LONG4 => "LONG4",
        op::BINBYTES => "BINBYTES",
        op::SHORT_BINBYTES => "SHORT_BINBYTES",
        op::SHORT_BINUNICODE => "SHORT_BINUNICODE",
        op::BINUNICODE8 => "BINUNICODE8",
        op::BINBYTES8 => "BINBYTES8",
        op::EMPTY_SET => "EMPTY_SET",
        op::ADDITEMS => "ADDITEMS",
        op::FROZENSET => "FROZENSET",
        op::NEWOBJ_EX => "NEWOBJ_EX",
        op::STACK_GLOBAL => "STACK_GLOBAL",
        op::MEMOIZE => "MEMOIZE",
        op::FRAME => "FRAME",
        op::BYTEARRAY8 => "BYTEARRAY8",
        0x97 => "NEXT_BUFFER",
        0x98 => "READONLY_BUFFER",
        _ => "unknown",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(s: &str) -> Vec<u8> {
        (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap()).collect()
    }

    fn s(v: &str) -> Value {
        Value::Str(v.into())
    }

    /// Writes a plain-data value with the writer (test helper for round trips).
    fn write_value(w: &mut PickleWriter, v: &Value) {
        match v {
            Value::None => {
                w.none();
            }
            Value::Bool(b) => {
                w.bool(*b);
            }
            Value::Int(i) => {
                w.int(*i);
            }
            Value::Float(f) => {
                w.float(*f);
            }
            Value::Str(x) => {
                w.str(x);
            }
            Value::Tuple(items) => {
                w.mark();
                for i in items {
                    write_value(w, i);
                }
                w.tuple();
            }
            Value::List(items) => {
                w.empty_list().mark();
                for i in items {
                    write_value(w, i);
                }
                w.appends();
            }
            Value::Dict(items) => {
                w.empty_dict().mark();
                for (k, v) in items {
                    write_value(w, k);
                    write_value(w, v);
                }
                w.setitems();
            }
            Value::Global { module, name } => {
                w.global(module, name);
            }
            other => panic!("test writer does not handle {other:?}"),
        }
    }

    #[test]
    fn int_encodings_match_python() {
        // pickle.dumps([2**31, -2**31-1, 2**63, -1, 0, 255, 256, 65535, 65536, -256], protocol=2)
        // without the BINPUT after EMPTY_LIST.
        let mut w = PickleWriter::new();
        w.proto(2).empty_list().mark();
        for v in [1i128 << 31, -(1i128 << 31) - 1, 1i128 << 63, -1, 0, 255, 256, 65535, 65536, -256] {
            w.int(v);
        }
        w.appends().stop();
        let python = hex("80025d288a0500000080008a05ffffff7fff8a090000000000000080004affffffff4b004bff4d00014d\
             ffff4a000001004a00ffffff652e");
        assert_eq!(w.as_bytes(), python.as_slice());
        let back = loads(w.as_bytes()).unwrap();
        assert_eq!(
            back,
            Value::List(
                [1i128 << 31, -(1i128 << 31) - 1, 1i128 << 63, -1, 0, 255, 256, 65535, 65536, -256]
                    .into_iter()
                    .map(Value::Int)
                    .collect()
            )
        );
    }

    #[test]
    fn long_extremes_round_trip() {
        for v in [i128::MAX, i128::MIN, i128::MIN + 1, 1 << 100, -(1 << 100), (1 << 31) - 1] {
            let mut w = PickleWriter::new();
            w.proto(2).int(v).stop();
            assert_eq!(loads(w.as_bytes()).unwrap(), Value::Int(v), "{v}");
        }
        assert_eq!(long_bytes(0), Vec::<u8>::new());
        assert_eq!(long_bytes(127), vec![0x7f]);
        assert_eq!(long_bytes(128), vec![0x80, 0x00]);
        assert_eq!(long_bytes(-128), vec![0x80]);
        assert_eq!(long_bytes(-129), vec![0x7f, 0xff]);
    }

    #[test]
    fn exact_bytes_of_scalar_opcodes() {
        let mut w = PickleWriter::new();
        w.proto(2)
            .global("torch", "Size")
            .empty_tuple()
            .str("ab")
            .float(1.5)
            .bool(true)
            .bool(false)
            .none()
            .binpersid()
            .stop();
        let mut want = b"\x80\x02ctorch\nSize\n)X\x02\x00\x00\x00ab".to_vec();
        want.extend_from_slice(&[b'G', 0x3f, 0xf8, 0, 0, 0, 0, 0, 0]);
        want.extend_from_slice(&[0x88, 0x89, b'N', b'Q', b'.']);
        assert_eq!(w.as_bytes(), want.as_slice());
    }

    #[test]
    fn int_tuples() {
        let mut w = PickleWriter::new();
        w.int_tuple(&[]).int_tuple(&[1]).int_tuple(&[1, 2]).int_tuple(&[1, 2, 3]);
        w.int_tuple(&[1, 2, 3, 4]);
        assert_eq!(w.as_bytes(), b")K\x01\x85K\x01K\x02\x86K\x01K\x02K\x03\x87(K\x01K\x02K\x03K\x04t");
    }

    #[test]
    fn round_trip_nested_values() {
        let v = Value::Dict(vec![
            (s("a"), Value::Tuple(vec![])),
            (s("b"), Value::Tuple(vec![Value::Int(1), Value::None, Value::Bool(true)])),
            (s("c"), Value::List(vec![Value::Float(-0.25), s("é"), Value::List(vec![])])),
            (s("g"), Value::Global { module: "torch".into(), name: "bfloat16".into() }),
            (Value::Int(7), Value::Dict(vec![])),
        ]);
        let mut w = PickleWriter::new();
        w.proto(2);
        write_value(&mut w, &v);
        w.stop();
        assert_eq!(loads(w.as_bytes()).unwrap(), v);
    }

    #[test]
    fn reads_python_protocol_5_mix() {
        // pickle.dumps({'a': (1, -2, 2**31, -2**31-1, 2**70, -(2**100)), 'b': b'\x00\xff',
        //   's': {3}, 'f': frozenset(), 't': True, 'n': None, 'fl': 1.5, 'u': 'hé'}, protocol=5)
        let bytes = hex("80059577000000000000007d94288c016194284b014afeffffff8a0500000080008a05ffffff7fff8a09\
             0000000000000000408a0d000000000000000000000000f074948c016294430200ff948c0173948f9428\
             4b03908c0166942891948c017494888c016e944e8c02666c94473ff80000000000008c0175948c0368c3\
             a994752e");
        let v = loads(&bytes).unwrap();
        assert_eq!(
            v,
            Value::Dict(vec![
                (
                    s("a"),
                    Value::Tuple(vec![
                        Value::Int(1),
                        Value::Int(-2),
                        Value::Int(1 << 31),
                        Value::Int(-(1 << 31) - 1),
                        Value::Int(1 << 70),
                        Value::Int(-(1 << 100)),
                    ])
                ),
                (s("b"), Value::Bytes(vec![0, 255])),
                (s("s"), Value::Set(vec![Value::Int(3)])),
                (s("f"), Value::FrozenSet(vec![])),
                (s("t"), Value::Bool(true)),
                (s("n"), Value::None),
                (s("fl"), Value::Float(1.5)),
                (s("u"), s("hé")),
            ])
        );
        assert_eq!(v.dict_get("fl"), Some(&Value::Float(1.5)));
    }

    #[test]
    fn memo_references_see_later_mutation() {
        // x = [1]; pickle.dumps([x, x], protocol=4): the inner list is memoized while empty,
        // filled by APPEND, then referenced again by BINGET.
        let bytes = hex("8004950c000000000000005d94285d944b01616801652e");
        let inner = Value::List(vec![Value::Int(1)]);
        assert_eq!(loads(&bytes).unwrap(), Value::List(vec![inner.clone(), inner]));
    }

    #[test]
    fn reads_ordered_dict_reduce_with_setitem() {
        // pickle.dumps(collections.OrderedDict(a=1), protocol=2)
        let bytes = hex("800263636f6c6c656374696f6e730a4f726465726564446963740a71002952710158010000006171024b\
             01732e");
        let Value::Reduce { callable, args, state, list_items, dict_items } = loads(&bytes).unwrap() else {
            panic!("not a reduce");
        };
        assert!(callable.is_global("collections", "OrderedDict"));
        assert_eq!(*args, Value::Tuple(vec![]));
        assert_eq!(state, None);
        assert!(list_items.is_empty());
        assert_eq!(dict_items, vec![(s("a"), Value::Int(1))]);
    }

    #[test]
    fn newobj_build_and_newobj_ex() {
        let mut w = PickleWriter::new();
        w.proto(2).global("m", "C").empty_tuple().newobj().empty_dict().mark();
        w.str("k").int(1).setitems().build().stop();
        let v = loads(w.as_bytes()).unwrap();
        let Value::Object { class, args, kwargs, state, .. } = &v else { panic!("{v:?}") };
        assert!(class.is_global("m", "C"));
        assert_eq!(**args, Value::Tuple(vec![]));
        assert_eq!(*kwargs, None);
        assert_eq!(state.as_deref().and_then(|s| s.dict_get("k")), Some(&Value::Int(1)));

        // STACK_GLOBAL + NEWOBJ_EX (protocol 4).
        let mut b = vec![0x80, 4, 0x8c, 1, b'm', 0x8c, 1, b'C', 0x93, b')', b'}', 0x92, b'.'];
        let v = loads(&b).unwrap();
        assert!(matches!(&v, Value::Object { kwargs: Some(k), .. } if **k == Value::Dict(vec![])));
        // BUILD twice on one object is rejected.
        b.truncate(b.len() - 1);
        b.extend_from_slice(b"NbNb.");
        assert!(matches!(loads(&b), Err(PickleError::Invalid { opcode: "BUILD", .. })));
    }

    #[test]
    fn persistent_id_and_text_opcodes() {
        let v = loads(b"\x80\x02(X\x01\x00\x00\x00atQ.").unwrap();
        assert_eq!(v, Value::PersistentId(Box::new(Value::Tuple(vec![s("a")]))));
        assert_eq!(loads(b"I42\n.").unwrap(), Value::Int(42));
        assert_eq!(loads(b"I01\n.").unwrap(), Value::Bool(true));
        assert_eq!(loads(b"L-12345678901234567890L\n.").unwrap(), Value::Int(-12345678901234567890));
        assert_eq!(loads(b"F0.5\n.").unwrap(), Value::Float(0.5));
        assert_eq!(loads(b"(I1\nI2\nl.").unwrap(), Value::List(vec![Value::Int(1), Value::Int(2)]));
        assert_eq!(loads(b"I1\np7\n0g7\n.").unwrap(), Value::Int(1));
        assert_eq!(loads(b"Pabc\n.").unwrap(), Value::PersistentId(Box::new(s("abc"))));
    }

    #[test]
    fn truncations_are_errors() {
        let bytes = hex("80059577000000000000007d94288c016194284b014afeffffff8a0500000080008a05ffffff7fff8a09\
             0000000000000000408a0d000000000000000000000000f074948c016294430200ff948c0173948f9428\
             4b03908c0166942891948c017494888c016e944e8c02666c94473ff80000000000008c0175948c0368c3\
             a994752e");
        for n in 0..bytes.len() {
            assert!(loads(&bytes[..n]).is_err(), "prefix of {n} bytes accepted");
        }
        assert!(matches!(loads(&[]), Err(PickleError::MissingStop { offset: 0 })));
        assert!(matches!(
            loads(b"\x80\x02X\xff\x00\x00\x00ab"),
            Err(PickleError::Truncated { opcode: "BINUNICODE", offset: 2, needed: 255, available: 2 })
        ));
    }

    #[test]
    fn malformed_inputs_are_errors() {
        let cases: &[(&[u8], &str)] = &[
            (b"\x80\x06N.", "protocol"),
            (b".", "underflow"),
            (b"t.", "mark"),
            (b"h\x05.", "memo"),
            (b"N(.", "underflow"),      // STOP cannot pop below a mark
            (b"NNa.", "append target"), // APPEND onto None
            (b"}NNNu.", "odd"),         // SETITEM needs pairs
            (b"}(Nu.", "odd"),
            (b"NN\x93.", "stack global"),
            (b"Nb.", "build"),
            (b"X\x02\x00\x00\x00\xff\xfe.", "utf8"),
            (b"\x8b\xff\xff\xff\xff.", "negative long4"),
            (b"\x8a\x11\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x80\x00.", "big"),
            (b"\x82\x01.", "ext1"),
            (b"\x95\xff\x00\x00\x00\x00\x00\x00\x00N.", "frame"),
            (b"cmod\n", "global"),
        ];
        for (bytes, what) in cases {
            assert!(loads(bytes).is_err(), "{what}: {bytes:?} accepted");
        }
        // A 17-byte LONG1 that still fits (sign extension only) is accepted.
        let mut b = vec![0x8a, 17];
        b.extend_from_slice(&[0xff; 17]);
        b.push(b'.');
        assert_eq!(loads(&b).unwrap(), Value::Int(-1));
    }

    #[test]
    fn exponential_sharing_hits_the_node_limit() {
        // t0 = (x, x); t1 = (t0, t0); ... 64 levels: 2^64 nodes when expanded.
        let mut b = vec![0x80, 4, b'N'];
        for _ in 0..64 {
            b.extend_from_slice(&[0x94, b'2', 0x86]); // MEMOIZE, DUP, TUPLE2
        }
        b.push(b'.');
        let limits = Limits { max_depth: 100, max_nodes: 100_000, ..Limits::default() };
        let err = loads_with_limits(&b, &limits).unwrap_err();
        assert!(matches!(err, PickleError::Limit { what: "values in the result", .. }), "{err}");
    }

    #[test]
    fn cycles_and_deep_nesting_hit_the_depth_limit() {
        // l = []; l.append(l)
        let err = loads(b"]\x94h\x00a.").unwrap_err();
        assert!(matches!(err, PickleError::Limit { what: "nesting depth", .. }), "{err}");
        let mut deep = vec![b')'];
        deep.extend(std::iter::repeat_n(0x85u8, 500)); // TUPLE1 x 500
        deep.push(b'.');
        assert!(loads(&deep).is_err());
        let limits = Limits { max_depth: 1000, ..Limits::default() };
        assert!(loads_with_limits(&deep, &limits).is_ok());
    }

    #[test]
    fn default_limits_scale_with_the_input() {
        // 64 levels of doubling through the memo, 200 bytes: refused by `loads` without
        // building 2^64 nodes, well before the absolute ceiling.
        let mut b = vec![0x80, 4, b'N'];
        for _ in 0..64 {
            b.extend_from_slice(&[0x94, b'2', 0x86]);
        }
        b.push(b'.');
        let err = loads(&b).unwrap_err();
        assert!(matches!(err, PickleError::Limit { what: "nesting depth" | "values in the result", .. }));
        let l = Limits::for_input(1000);
        assert_eq!((l.max_nodes, l.max_bytes), ((1 << 20) + 16_000, (64 << 20) + 256_000));
        assert_eq!(Limits::for_input(usize::MAX), Limits::default());
    }

    #[test]
    fn memo_limit() {
        let limits = Limits { max_memo: 2, ..Limits::default() };
        assert!(loads_with_limits(b"N\x94\x94.", &limits).is_ok());
        let err = loads_with_limits(b"N\x94\x94\x94.", &limits).unwrap_err();
        assert!(matches!(err, PickleError::Limit { what: "memo entries", .. }), "{err}");
    }

    #[test]
    fn string_byte_budget() {
        // One 1000-byte string referenced 100 times.
        let mut b = vec![b'X'];
        b.extend_from_slice(&1000u32.to_le_bytes());
        b.extend(std::iter::repeat_n(b'a', 1000));
        b.extend_from_slice(&[0x94, b'(']);
        b.extend(std::iter::repeat_n([b'h', 0], 100).flatten());
        b.extend_from_slice(b"l.");
        let limits = Limits { max_bytes: 50_000, ..Limits::default() };
        let err = loads_with_limits(&b, &limits).unwrap_err();
        assert!(matches!(err, PickleError::Limit { what: "string bytes in the result", .. }));
        assert!(loads(&b).is_ok());
    }

    proptest::proptest! {
        #[test]
        fn random_bytes_never_panic(bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..200)) {
            let _ = loads(&bytes);
        }

        #[test]
        fn mutated_valid_pickles_never_panic(pos in 0usize..150, byte in proptest::prelude::any::<u8>()) {
            let mut b = hex(
                "80059577000000000000007d94288c016194284b014afeffffff8a0500000080008a05ffffff7fff8a09\
                 0000000000000000408a0d000000000000000000000000f074948c016294430200ff948c0173948f9428\
                 4b03908c0166942891948c017494888c016e944e8c02666c94473ff80000000000008c0175948c0368c3\
                 a994752e",
            );
            let i = pos % b.len();
            b[i] = byte;
            let _ = loads(&b);
        }

        #[test]
        fn ints_round_trip(v in proptest::prelude::any::<i128>()) {
            let mut w = PickleWriter::new();
            w.proto(2).int(v).stop();
            proptest::prop_assert_eq!(loads(w.as_bytes()).unwrap(), Value::Int(v));
        }
    }
}
