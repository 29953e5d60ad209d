//! [`PickleWriter`]: protocol-2 opcodes, one method each.

use super::opcodes as op;

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
pub(super) fn long_bytes(v: i128) -> Vec<u8> {
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
