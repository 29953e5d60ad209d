//! The pickle reader: a strict, bounded stack machine over a byte stream.
//!
//! Values are owned trees. Python's reference semantics are kept where CPython's pickler relies
//! on them — an object memoized before its state is built (`NEWOBJ MEMOIZE … BUILD`) and fetched
//! later sees the built object — by committing a memo entry when its object leaves the stack
//! (its construction is then over), not when it is memoized. What CPython never writes is
//! refused instead of emulated: memo keys out of sequence, mutating an object after it was
//! fetched from the memo (which is what a cycle needs), bytes after `STOP`.
//!
//! A first pass ([`scan_memo_references`]) finds which memo entries are ever fetched; only those
//! are kept, so a pickle that memoizes every object (protocol 4 does) costs no more than one that
//! memoizes none.

use std::collections::HashSet;
use std::io::BufRead;
use std::sync::Arc;

use super::input::Input;
use super::opcodes::{self as op, opcode_name, OpAt};
use super::scan::{le_u64, scan_memo_references, MemoReferences};
use super::{Limits, PickleError, Value, HIGHEST_PROTOCOL};

// ------------------------------------------------------------------------------------------------
// The machine

/// A value on the stack and what the reader knows about it.
struct Slot {
    value: Value,
    /// Nesting depth of `value` (a leaf is 0).
    depth: usize,
    /// The memo key it was stored under, if that key is fetched later.
    memo_key: Option<u64>,
    /// Fetched from the memo, or fetched while still on the stack: mutating it would change
    /// another reference, which CPython's pickler never asks for.
    shared: bool,
    /// For a streamed dict: which of [`Reader::new`]'s `streamed` names it is the value of.
    streamed: Option<usize>,
}

impl Slot {
    fn new(value: Value, depth: usize) -> Self {
        Slot { value, depth, memo_key: None, shared: false, streamed: None }
    }
}

enum Memo {
    /// Never fetched: nothing kept.
    Dropped,
    /// Its object is still on the stack, under construction.
    Pending,
    Ready(Value, usize),
}

/// Streams one pickle. The items of the dicts that are the values of `streamed` keys of the root
/// object's state (`Cls.__new__(Cls)` + `BUILD {name: {...}, ...}`, the shape of a pickled
/// dataclass such as DCP's `Metadata`) are handed to the caller as each `SETITEMS` batch
/// completes and are not kept; those dicts are empty in the returned root.
pub struct Reader<'a, R> {
    input: Input<R>,
    limits: Limits,
    refs: &'a MemoReferences,
    streamed: &'a [&'a str],
    stack: Vec<Slot>,
    marks: Vec<usize>,
    memo: Vec<Memo>,
    nodes: usize,
    bytes: usize,
    op_start: u64,
    code: u8,
    buf: Vec<u8>,
    names: HashSet<Arc<str>>,
}

/// Reads one pickle held in memory with [`Limits::for_input`].
pub fn loads(data: &[u8]) -> Result<Value, PickleError> {
    loads_with_limits(data, &Limits::for_input(data.len()))
}

/// Reads one pickle held in memory within `limits`.
pub fn loads_with_limits(data: &[u8], limits: &Limits) -> Result<Value, PickleError> {
    let refs = scan_memo_references(data)?;
    Reader::new(data, *limits, &refs, &[]).run(|_, _, _| Ok::<(), PickleError>(()))
}

impl<'a, R: BufRead> Reader<'a, R> {
    /// A reader of `r`, whose memo references a first pass over the same bytes found.
    pub fn new(r: R, limits: Limits, refs: &'a MemoReferences, streamed: &'a [&'a str]) -> Self {
        Reader {
            input: Input { r, pos: 0 },
            limits,
            refs,
            streamed,
            stack: Vec::new(),
            marks: Vec::new(),
            memo: Vec::new(),
            nodes: 0,
            bytes: 0,
            op_start: 0,
            code: op::PROTO,
            buf: Vec::new(),
            names: HashSet::new(),
        }
    }

    /// Runs to `STOP` and the end of the input. `item(section, key, value)` receives each item
    /// of a streamed dict, `section` indexing the `streamed` names.
    pub fn run<E: From<PickleError>>(
        mut self,
        mut item: impl FnMut(usize, Value, Value) -> Result<(), E>,
    ) -> Result<Value, E> {
        loop {
            self.op_start = self.input.pos;
            let Some(code) = self.input.next_byte()? else {
                return Err(PickleError::MissingStop { offset: self.input.pos }.into());
            };
            self.code = code;
            if code == op::STOP {
                let root = self.pop()?;
                if !self.stack.is_empty() || !self.marks.is_empty() {
                    return Err(self.invalid("values or marks left on the stack at STOP").into());
                }
                if !self.input.at_end()? {
                    return Err(PickleError::TrailingData { offset: self.input.pos }.into());
                }
                return Ok(root.value);
            }
            if let Some((section, pairs)) = self.step(code)? {
                for (k, v) in pairs {
                    item(section, k, v)?;
                }
            }
        }
    }

    /// Executes one opcode; returns the items a streamed dict received.
    #[allow(clippy::type_complexity)]
    fn step(&mut self, code: u8) -> Result<Option<(usize, Vec<(Value, Value)>)>, PickleError> {
        match code {
            op::PROTO => {
                let p = self.take_u8()?;
                if p > HIGHEST_PROTOCOL {
                    return Err(PickleError::UnsupportedProtocol { protocol: p, offset: self.op_start });
                }
            }
            // Frames only group opcodes for buffering; their bounds need no checking to read.
            op::FRAME => {
                self.take_fixed(8)?;
            }

            op::NONE => self.push_leaf(Value::None)?,
            op::NEWTRUE => self.push_leaf(Value::Bool(true))?,
            op::NEWFALSE => self.push_leaf(Value::Bool(false))?,
            op::BININT1 => {
                let v = self.take_u8()?;
                self.push_leaf(Value::Int(v.into()))?
            }
            op::BININT2 => {
                let v = self.take_fixed(2)?;
                self.push_leaf(Value::Int(v.into()))?
            }
            op::BININT => {
                let v = self.take_fixed(4)? as u32 as i32;
                self.push_leaf(Value::Int(v.into()))?
            }
            op::LONG1 | op::LONG4 => {
                let n = if code == op::LONG1 { self.take_u8()?.into() } else { self.take_len_i32()? };
                self.take_bytes(n)?;
                let v = self.decode_long()?;
                self.push_leaf(Value::Int(v))?
            }
            op::INT => {
                let v = match self.take_line()?.as_str() {
                    "00" => Value::Bool(false),
                    "01" => Value::Bool(true),
                    s => Value::Int(s.parse::<i128>().map_err(|_| self.invalid("malformed decimal integer"))?),
                };
                self.push_leaf(v)?
            }
            op::LONG => {
                let line = self.take_line()?;
                let s = line.strip_suffix('L').unwrap_or(&line);
                let v = s.parse::<i128>().map_err(|_| self.invalid("malformed or out-of-range decimal integer"))?;
                self.push_leaf(Value::Int(v))?
            }
            op::BINFLOAT => {
                let bits = self.take_fixed(8)?.swap_bytes();
                self.push_leaf(Value::Float(f64::from_bits(bits)))?
            }
            op::FLOAT => {
                let v = self.take_line()?.parse::<f64>().map_err(|_| self.invalid("malformed float"))?;
                self.push_leaf(Value::Float(v))?
            }

            op::SHORT_BINUNICODE => {
                let n = self.take_u8()?.into();
                self.push_str(n, false)?
            }
            op::BINUNICODE => {
                let n = self.take_fixed(4)?;
                self.push_str(n, false)?
            }
            op::BINUNICODE8 => {
                let n = self.take_fixed(8)?;
                self.push_str(n, false)?
            }
            // Python 2 `str`: Python 3 decodes it as ASCII.
            op::SHORT_BINSTRING => {
                let n = self.take_u8()?.into();
                self.push_str(n, true)?
            }
            op::BINSTRING => {
                let n = self.take_len_i32()?;
                self.push_str(n, true)?
            }
            op::SHORT_BINBYTES => {
                let n = self.take_u8()?.into();
                self.push_bytes(n)?
            }
            op::BINBYTES => {
                let n = self.take_fixed(4)?;
                self.push_bytes(n)?
            }
            op::BINBYTES8 | op::BYTEARRAY8 => {
                let n = self.take_fixed(8)?;
                self.push_bytes(n)?
            }

            op::EMPTY_TUPLE => self.push_container(Value::Tuple(Vec::new()), Vec::new())?,
            op::TUPLE1 | op::TUPLE2 | op::TUPLE3 => {
                let items = self.pop_n(usize::from(code - op::TUPLE1 + 1))?;
                self.push_seq(Value::Tuple, items)?
            }
            op::TUPLE => {
                let items = self.pop_mark()?;
                self.push_seq(Value::Tuple, items)?
            }
            op::EMPTY_LIST => self.push_container(Value::List(Vec::new()), Vec::new())?,
            op::LIST => {
                let items = self.pop_mark()?;
                self.push_seq(Value::List, items)?
            }
            op::EMPTY_DICT => self.push_dict(Vec::new())?,
            op::DICT => {
                let items = self.pop_mark()?;
                self.push_dict(items)?
            }
            op::EMPTY_SET => self.push_container(Value::Set(Vec::new()), Vec::new())?,
            op::FROZENSET => {
                let items = self.pop_mark()?;
                self.push_seq(Value::FrozenSet, items)?
            }
            op::APPEND => {
                let item = self.pop()?;
                self.extend(vec![item], false)?;
            }
            op::APPENDS => {
                let items = self.pop_mark()?;
                self.extend(items, false)?;
            }
            op::ADDITEMS => {
                let items = self.pop_mark()?;
                self.extend(items, true)?;
            }
            op::SETITEM => {
                let value = self.pop()?;
                let key = self.pop()?;
                return self.set_items(vec![key, value]);
            }
            op::SETITEMS => {
                let items = self.pop_mark()?;
                return self.set_items(items);
            }

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
                let top = self.top_mut()?;
                top.shared = true;
                let (value, depth) = (top.value.clone(), top.depth);
                self.charge_clone(&value)?;
                self.push(Slot { shared: true, ..Slot::new(value, depth) })?
            }
            op::MEMOIZE => self.memo_put(self.memo.len() as u64)?,
            op::BINPUT => {
                let k = self.take_u8()?.into();
                self.memo_put(k)?
            }
            op::LONG_BINPUT => {
                let k = self.take_fixed(4)?;
                self.memo_put(k)?
            }
            op::PUT => {
                let k = self.take_line()?.parse::<u64>().map_err(|_| self.invalid("malformed memo key"))?;
                self.memo_put(k)?
            }
            op::BINGET => {
                let k = self.take_u8()?.into();
                self.memo_get(k)?
            }
            op::LONG_BINGET => {
                let k = self.take_fixed(4)?;
                self.memo_get(k)?
            }
            op::GET => {
                let k = self.take_line()?.parse::<u64>().map_err(|_| self.invalid("malformed memo key"))?;
                self.memo_get(k)?
            }

            op::GLOBAL => {
                let module = self.take_name()?;
                let name = self.take_name()?;
                self.push_global(module, name)?
            }
            op::STACK_GLOBAL => {
                let name = self.pop()?.value;
                let module = self.pop()?.value;
                let (Value::Str(module), Value::Str(name)) = (module, name) else {
                    return Err(self.invalid("module and name must be str"));
                };
                let (module, name) = (self.intern(&module), self.intern(&name));
                self.push_global(module, name)?
            }
            op::REDUCE => {
                let args = self.pop()?;
                let callable = self.pop()?;
                let depth = 1 + callable.depth.max(args.depth);
                let v = Value::Reduce {
                    callable: Box::new(callable.value),
                    args: Box::new(args.value),
                    state: None,
                    list_items: Vec::new(),
                    dict_items: Vec::new(),
                };
                self.push_built(v, depth)?
            }
            op::NEWOBJ | op::NEWOBJ_EX => {
                let kwargs = if code == op::NEWOBJ_EX { Some(self.pop()?) } else { None };
                let args = self.pop()?;
                let class = self.pop()?;
                let depth = 1 + class.depth.max(args.depth).max(kwargs.as_ref().map_or(0, |k| k.depth));
                let v = Value::Object {
                    class: Box::new(class.value),
                    args: Box::new(args.value),
                    kwargs: kwargs.map(|k| Box::new(k.value)),
                    state: None,
                    list_items: Vec::new(),
                    dict_items: Vec::new(),
                };
                self.push_built(v, depth)?
            }
            op::BUILD => {
                let new_state = self.pop()?;
                let target = self.target()?;
                let slot = match &mut target.value {
                    Value::Reduce { state, .. } | Value::Object { state, .. } => state,
                    _ => return Err(self.invalid("target is not an object")),
                };
                if slot.is_some() {
                    return Err(self.invalid("object already has a state"));
                }
                *slot = Some(Box::new(new_state.value));
                target.depth = target.depth.max(1 + new_state.depth);
                self.check_depth(self.stack.last().map_or(0, |s| s.depth))?;
            }
            op::BINPERSID => {
                let pid = self.pop()?;
                self.push_built(Value::PersistentId(Box::new(pid.value)), 1 + pid.depth)?
            }
            op::PERSID => {
                let pid = self.take_line()?;
                self.push_built(Value::PersistentId(Box::new(Value::Str(pid))), 1)?
            }
            _ => {
                return Err(PickleError::UnsupportedOpcode {
                    opcode: code,
                    name: opcode_name(code),
                    offset: self.op_start,
                })
            }
        }
        Ok(None)
    }

    // --- input

    /// `needed` bytes asked for, `self.buf` holding the fewer there were.
    fn truncated(&self, needed: u64) -> PickleError {
        PickleError::Truncated {
            opcode: opcode_name(self.code),
            offset: self.op_start,
            needed,
            available: self.buf.len() as u64,
        }
    }

    /// `n` bytes into `self.buf`.
    fn take_bytes(&mut self, n: u64) -> Result<(), PickleError> {
        if n > self.limits.max_bytes as u64 {
            return Err(self.limit("bytes of one value", self.limits.max_bytes as u64));
        }
        let mut buf = std::mem::take(&mut self.buf);
        let ok = self.input.take_into(n, &mut buf);
        self.buf = buf;
        if ok? {
            Ok(())
        } else {
            Err(self.truncated(n))
        }
    }

    /// A little-endian unsigned integer of `n` ≤ 8 bytes.
    fn take_fixed(&mut self, n: u64) -> Result<u64, PickleError> {
        self.take_bytes(n)?;
        Ok(le_u64(&self.buf))
    }

    fn take_u8(&mut self) -> Result<u8, PickleError> {
        Ok(self.take_fixed(1)? as u8)
    }

    /// A signed 4-byte length, which must not be negative.
    fn take_len_i32(&mut self) -> Result<u64, PickleError> {
        let n = self.take_fixed(4)? as u32 as i32;
        u64::try_from(n).map_err(|_| self.invalid("negative length"))
    }

    /// A `\n`-terminated UTF-8 line (text opcodes, `GLOBAL`).
    fn take_line(&mut self) -> Result<String, PickleError> {
        let mut buf = std::mem::take(&mut self.buf);
        let ok = self.input.line_into(&mut buf);
        self.buf = buf;
        if !ok? {
            return Err(self.truncated(1));
        }
        String::from_utf8(self.buf.clone()).map_err(|_| self.invalid("line is not UTF-8"))
    }

    /// A `\n`-terminated UTF-8 line, interned (`GLOBAL`'s module and name).
    fn take_name(&mut self) -> Result<Arc<str>, PickleError> {
        let mut buf = std::mem::take(&mut self.buf);
        let ok = self.input.line_into(&mut buf);
        let name = match ok {
            Ok(true) => {
                std::str::from_utf8(&buf).map(|s| self.intern(s)).map_err(|_| self.invalid("line is not UTF-8"))
            }
            Ok(false) => Err(self.truncated(1)),
            Err(e) => Err(e),
        };
        self.buf = buf;
        name
    }

    /// The two's-complement little-endian integer in `self.buf`.
    fn decode_long(&self) -> Result<i128, PickleError> {
        let bytes = &self.buf;
        let Some(&last) = bytes.last() else {
            return Ok(0);
        };
        let fill = if last & 0x80 != 0 { 0xff } else { 0x00 };
        let mut out = [fill; 16];
        for (i, &b) in bytes.iter().enumerate() {
            match out.get_mut(i) {
                Some(slot) => *slot = b,
                // Beyond 16 bytes only sign extension is allowed.
                None if b == fill => {}
                None => return Err(self.invalid("integer does not fit in 128 bits")),
            }
        }
        // The 16th byte must carry the sign when the encoding is longer than 16 bytes.
        if bytes.len() > 16 && (i128::from_le_bytes(out) < 0) != (fill == 0xff) {
            return Err(self.invalid("integer does not fit in 128 bits"));
        }
        Ok(i128::from_le_bytes(out))
    }

    // --- errors

    /// The opcode being run, for errors built after a mutable borrow of the stack.
    fn at(&self) -> OpAt {
        OpAt { code: self.code, offset: self.op_start }
    }

    fn invalid(&self, detail: &str) -> PickleError {
        self.at().invalid(detail)
    }

    fn underflow(&self) -> PickleError {
        self.at().underflow()
    }

    fn limit(&self, what: &'static str, max: u64) -> PickleError {
        PickleError::Limit { what, max, offset: self.op_start }
    }

    // --- budget

    fn charge(&mut self, nodes: usize, bytes: usize) -> Result<(), PickleError> {
        self.nodes = self.nodes.saturating_add(nodes);
        if self.nodes > self.limits.max_nodes {
            return Err(self.limit("values", self.limits.max_nodes as u64));
        }
        self.bytes = self.bytes.saturating_add(bytes);
        if self.bytes > self.limits.max_bytes {
            return Err(self.limit("string bytes", self.limits.max_bytes as u64));
        }
        Ok(())
    }

    /// Charges a copy of `v`: its nodes and string bytes.
    fn charge_clone(&mut self, v: &Value) -> Result<(), PickleError> {
        let max = self.limits.max_nodes;
        let (nodes, bytes) = v.size_within(max).ok_or_else(|| self.limit("values", max as u64))?;
        self.charge(nodes, bytes)
    }

    fn check_depth(&self, depth: usize) -> Result<(), PickleError> {
        if depth > self.limits.max_depth {
            return Err(self.limit("nesting depth", self.limits.max_depth as u64));
        }
        Ok(())
    }

    // --- stack

    fn push(&mut self, slot: Slot) -> Result<(), PickleError> {
        if self.stack.len() >= self.limits.max_nodes {
            return Err(self.limit("stack entries", self.limits.max_nodes as u64));
        }
        self.stack.push(slot);
        Ok(())
    }

    fn push_leaf(&mut self, v: Value) -> Result<(), PickleError> {
        self.charge(1, 0)?;
        self.push(Slot::new(v, 0))
    }

    /// A new value built from popped ones (whose nodes were charged already).
    fn push_built(&mut self, v: Value, depth: usize) -> Result<(), PickleError> {
        self.check_depth(depth)?;
        self.charge(1, 0)?;
        self.push(Slot::new(v, depth))
    }

    fn push_container(&mut self, v: Value, items: Vec<Slot>) -> Result<(), PickleError> {
        let depth = items.iter().map(|s| s.depth + 1).max().unwrap_or(1);
        self.push_built(v, depth)
    }

    fn push_seq(&mut self, make: fn(Vec<Value>) -> Value, items: Vec<Slot>) -> Result<(), PickleError> {
        let depth = items.iter().map(|s| s.depth + 1).max().unwrap_or(1);
        self.push_built(make(items.into_iter().map(|s| s.value).collect()), depth)
    }

    fn push_dict(&mut self, items: Vec<Slot>) -> Result<(), PickleError> {
        let depth = items.iter().map(|s| s.depth + 1).max().unwrap_or(1);
        let pairs = self.pairs(items)?;
        self.push_built(Value::Dict(pairs), depth)?;
        // The value of a streamed name in the root object's state, whose items are being set:
        // stack [obj, state, MARK, (key, value)*, name, this dict].
        let streamed = match self.stack.as_slice() {
            [Slot { value: Value::Object { .. }, .. }, Slot { value: Value::Dict(_), .. }, rest @ ..]
                if self.marks == [2] && rest.len() % 2 == 0 =>
            {
                match rest.get(rest.len().wrapping_sub(2)) {
                    Some(Slot { value: Value::Str(name), .. }) => self.streamed.iter().position(|s| s == name),
                    _ => None,
                }
            }
            _ => None,
        };
        if let Some(top) = self.stack.last_mut() {
            top.streamed = streamed;
        }
        Ok(())
    }

    fn push_str(&mut self, n: u64, ascii: bool) -> Result<(), PickleError> {
        self.take_bytes(n)?;
        if ascii && !self.buf.is_ascii() {
            return Err(self.invalid("Python 2 string is not ASCII"));
        }
        let s = std::str::from_utf8(&self.buf).map_err(|_| self.invalid("string is not UTF-8"))?.to_owned();
        self.charge(1, s.len())?;
        self.push(Slot::new(Value::Str(s), 0))
    }

    fn push_bytes(&mut self, n: u64) -> Result<(), PickleError> {
        self.take_bytes(n)?;
        let b = self.buf.clone();
        self.charge(1, b.len())?;
        self.push(Slot::new(Value::Bytes(b), 0))
    }

    /// The one shared copy of a global's module or name.
    fn intern(&mut self, s: &str) -> Arc<str> {
        if let Some(a) = self.names.get(s) {
            return a.clone();
        }
        let a: Arc<str> = Arc::from(s);
        // A pickle names few globals; a hostile one naming many only loses the sharing.
        if self.names.len() < 4096 {
            self.names.insert(a.clone());
        }
        a
    }

    fn push_global(&mut self, module: Arc<str>, name: Arc<str>) -> Result<(), PickleError> {
        self.charge(1, module.len() + name.len())?;
        self.push(Slot::new(Value::Global { module, name }, 0))
    }

    /// The floor of the current frame: nothing below the last mark may be popped.
    fn floor(&self) -> usize {
        self.marks.last().copied().unwrap_or(0)
    }

    /// Takes a value off the stack. Its construction is over: its memo entry, if fetched later,
    /// is committed now.
    fn pop(&mut self) -> Result<Slot, PickleError> {
        if self.stack.len() <= self.floor() {
            return Err(self.underflow());
        }
        let slot = self.stack.pop().ok_or_else(|| self.underflow())?;
        self.commit(&slot)?;
        Ok(slot)
    }

    fn commit(&mut self, slot: &Slot) -> Result<(), PickleError> {
        if let Some(key) = slot.memo_key {
            if slot.streamed.is_some() {
                return Err(self.invalid("a streamed dict is fetched from the memo"));
            }
            if let Some(m) = usize::try_from(key).ok().and_then(|k| self.memo.get_mut(k)) {
                *m = Memo::Ready(slot.value.clone(), slot.depth);
            }
        }
        Ok(())
    }

    fn pop_n(&mut self, n: usize) -> Result<Vec<Slot>, PickleError> {
        let start = self.stack.len().checked_sub(n).filter(|&s| s >= self.floor()).ok_or_else(|| self.underflow())?;
        self.take_from(start)
    }

    fn pop_mark(&mut self) -> Result<Vec<Slot>, PickleError> {
        let mark = self
            .marks
            .pop()
            .ok_or(PickleError::MissingMark { opcode: opcode_name(self.code), offset: self.op_start })?;
        if mark > self.stack.len() {
            return Err(self.underflow());
        }
        self.take_from(mark)
    }

    fn take_from(&mut self, start: usize) -> Result<Vec<Slot>, PickleError> {
        let items = self.stack.split_off(start);
        for s in &items {
            self.commit(s)?;
        }
        Ok(items)
    }

    fn top_mut(&mut self) -> Result<&mut Slot, PickleError> {
        if self.stack.len() <= self.floor() {
            return Err(self.underflow());
        }
        let at = self.at();
        self.stack.last_mut().ok_or_else(|| at.underflow())
    }

    /// The top of the stack as the target of a mutation: never a shared object.
    fn target(&mut self) -> Result<&mut Slot, PickleError> {
        let at = self.at();
        let top = self.top_mut()?;
        if top.shared {
            return Err(at.invalid("mutates an object that is referenced elsewhere (a cycle or a shared object)"));
        }
        Ok(top)
    }

    fn pairs(&self, items: Vec<Slot>) -> Result<Vec<(Value, Value)>, PickleError> {
        if !items.len().is_multiple_of(2) {
            return Err(self.invalid("odd number of items for key/value pairs"));
        }
        let mut it = items.into_iter();
        let mut out = Vec::with_capacity(it.len() / 2);
        while let (Some(k), Some(v)) = (it.next(), it.next()) {
            out.push((k.value, v.value));
        }
        Ok(out)
    }

    fn extend(&mut self, items: Vec<Slot>, set: bool) -> Result<(), PickleError> {
        let depth = items.iter().map(|s| s.depth + 1).max().unwrap_or(0);
        let values = items.into_iter().map(|s| s.value);
        let at = self.at();
        let target = self.target()?;
        match (&mut target.value, set) {
            (Value::Set(v), true)
            | (Value::List(v), false)
            | (Value::Reduce { list_items: v, .. }, false)
            | (Value::Object { list_items: v, .. }, false) => v.extend(values),
            _ => return Err(at.invalid(if set { "target is not a set" } else { "target is not a list or object" })),
        }
        target.depth = target.depth.max(depth);
        let d = target.depth;
        self.check_depth(d)
    }

    /// `SETITEM(S)`: into the target, or to the caller for a streamed dict.
    #[allow(clippy::type_complexity)]
    fn set_items(&mut self, items: Vec<Slot>) -> Result<Option<(usize, Vec<(Value, Value)>)>, PickleError> {
        let depth = items.iter().map(|s| s.depth + 1).max().unwrap_or(0);
        let pairs = self.pairs(items)?;
        let at = self.at();
        let target = self.target()?;
        if let (Some(section), Value::Dict(_)) = (target.streamed, &target.value) {
            return Ok(Some((section, pairs)));
        }
        match &mut target.value {
            Value::Dict(v) | Value::Reduce { dict_items: v, .. } | Value::Object { dict_items: v, .. } => {
                v.extend(pairs)
            }
            _ => return Err(at.invalid("target is not a dict or object")),
        }
        target.depth = target.depth.max(depth);
        let d = target.depth;
        self.check_depth(d)?;
        Ok(None)
    }

    // --- memo

    fn memo_put(&mut self, key: u64) -> Result<(), PickleError> {
        if key != self.memo.len() as u64 {
            return Err(self.invalid(&format!("memo key {key} out of sequence (expected {})", self.memo.len())));
        }
        if self.memo.len() >= self.limits.max_memo {
            return Err(self.limit("memo entries", self.limits.max_memo as u64));
        }
        let fetched = self.refs.contains(key);
        let top = self.top_mut()?;
        if fetched {
            if top.memo_key.is_some() {
                return Err(self.invalid("object memoized twice"));
            }
            top.memo_key = Some(key);
        }
        self.memo.push(if fetched { Memo::Pending } else { Memo::Dropped });
        Ok(())
    }

    fn memo_get(&mut self, key: u64) -> Result<(), PickleError> {
        let at = self.at();
        let undefined = || PickleError::UndefinedMemo { key, opcode: opcode_name(at.code), offset: at.offset };
        let (value, depth) = match usize::try_from(key).ok().and_then(|k| self.memo.get(k)) {
            None => return Err(undefined()),
            Some(Memo::Ready(v, d)) => (v.clone(), *d),
            // Still on the stack: a later reference to an object of the same batch.
            Some(Memo::Pending) => {
                let slot = self.stack.iter_mut().rev().find(|s| s.memo_key == Some(key)).ok_or_else(undefined)?;
                slot.shared = true;
                (slot.value.clone(), slot.depth)
            }
            Some(Memo::Dropped) => return Err(self.invalid("memo entry fetched that the first pass did not see")),
        };
        self.charge_clone(&value)?;
        self.push(Slot { shared: true, ..Slot::new(value, depth) })
    }
}
