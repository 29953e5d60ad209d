//! Pickle opcodes (CPython's `pickle.py` names) and their names for error messages.

use super::PickleError;

pub(super) const MARK: u8 = b'(';
pub(super) const STOP: u8 = b'.';
pub(super) const POP: u8 = b'0';
pub(super) const POP_MARK: u8 = b'1';
pub(super) const DUP: u8 = b'2';
pub(super) const FLOAT: u8 = b'F';
pub(super) const INT: u8 = b'I';
pub(super) const BININT: u8 = b'J';
pub(super) const BININT1: u8 = b'K';
pub(super) const LONG: u8 = b'L';
pub(super) const BININT2: u8 = b'M';
pub(super) const NONE: u8 = b'N';
pub(super) const PERSID: u8 = b'P';
pub(super) const BINPERSID: u8 = b'Q';
pub(super) const REDUCE: u8 = b'R';
pub(super) const BINSTRING: u8 = b'T';
pub(super) const SHORT_BINSTRING: u8 = b'U';
pub(super) const BINUNICODE: u8 = b'X';
pub(super) const APPEND: u8 = b'a';
pub(super) const BUILD: u8 = b'b';
pub(super) const GLOBAL: u8 = b'c';
pub(super) const DICT: u8 = b'd';
pub(super) const EMPTY_DICT: u8 = b'}';
pub(super) const APPENDS: u8 = b'e';
pub(super) const GET: u8 = b'g';
pub(super) const BINGET: u8 = b'h';
pub(super) const LONG_BINGET: u8 = b'j';
pub(super) const LIST: u8 = b'l';
pub(super) const EMPTY_LIST: u8 = b']';
pub(super) const PUT: u8 = b'p';
pub(super) const BINPUT: u8 = b'q';
pub(super) const LONG_BINPUT: u8 = b'r';
pub(super) const SETITEM: u8 = b's';
pub(super) const TUPLE: u8 = b't';
pub(super) const EMPTY_TUPLE: u8 = b')';
pub(super) const SETITEMS: u8 = b'u';
pub(super) const BINFLOAT: u8 = b'G';
// protocol 2
pub(super) const PROTO: u8 = 0x80;
pub(super) const NEWOBJ: u8 = 0x81;
pub(super) const TUPLE1: u8 = 0x85;
pub(super) const TUPLE2: u8 = 0x86;
pub(super) const TUPLE3: u8 = 0x87;
pub(super) const NEWTRUE: u8 = 0x88;
pub(super) const NEWFALSE: u8 = 0x89;
pub(super) const LONG1: u8 = 0x8a;
pub(super) const LONG4: u8 = 0x8b;
// protocol 3
pub(super) const BINBYTES: u8 = b'B';
pub(super) const SHORT_BINBYTES: u8 = b'C';
// protocol 4
pub(super) const SHORT_BINUNICODE: u8 = 0x8c;
pub(super) const BINUNICODE8: u8 = 0x8d;
pub(super) const BINBYTES8: u8 = 0x8e;
pub(super) const EMPTY_SET: u8 = 0x8f;
pub(super) const ADDITEMS: u8 = 0x90;
pub(super) const FROZENSET: u8 = 0x91;
pub(super) const NEWOBJ_EX: u8 = 0x92;
pub(super) const STACK_GLOBAL: u8 = 0x93;
pub(super) const MEMOIZE: u8 = 0x94;
pub(super) const FRAME: u8 = 0x95;
// protocol 5
pub(super) const BYTEARRAY8: u8 = 0x96;

/// The name of an opcode, for error messages.
pub(super) fn opcode_name(code: u8) -> &'static str {
    match code {
        MARK => "MARK",
        STOP => "STOP",
        POP => "POP",
        POP_MARK => "POP_MARK",
        DUP => "DUP",
        FLOAT => "FLOAT",
        INT => "INT",
        BININT => "BININT",
        BININT1 => "BININT1",
        LONG => "LONG",
        BININT2 => "BININT2",
        NONE => "NONE",
        PERSID => "PERSID",
        BINPERSID => "BINPERSID",
        REDUCE => "REDUCE",
        b'S' => "STRING",
        BINSTRING => "BINSTRING",
        SHORT_BINSTRING => "SHORT_BINSTRING",
        b'V' => "UNICODE",
        BINUNICODE => "BINUNICODE",
        APPEND => "APPEND",
        BUILD => "BUILD",
        GLOBAL => "GLOBAL",
        DICT => "DICT",
        EMPTY_DICT => "EMPTY_DICT",
        APPENDS => "APPENDS",
        GET => "GET",
        BINGET => "BINGET",
        b'i' => "INST",
        LONG_BINGET => "LONG_BINGET",
        LIST => "LIST",
        EMPTY_LIST => "EMPTY_LIST",
        b'o' => "OBJ",
        PUT => "PUT",
        BINPUT => "BINPUT",
        LONG_BINPUT => "LONG_BINPUT",
        SETITEM => "SETITEM",
        TUPLE => "TUPLE",
        EMPTY_TUPLE => "EMPTY_TUPLE",
        SETITEMS => "SETITEMS",
        BINFLOAT => "BINFLOAT",
        PROTO => "PROTO",
        NEWOBJ => "NEWOBJ",
        0x82 => "EXT1",
        0x83 => "EXT2",
        0x84 => "EXT4",
        TUPLE1 => "TUPLE1",
        TUPLE2 => "TUPLE2",
        TUPLE3 => "TUPLE3",
        NEWTRUE => "NEWTRUE",
        NEWFALSE => "NEWFALSE",
        LONG1 => "LONG1",
        LONG4 => "LONG4",
        BINBYTES => "BINBYTES",
        SHORT_BINBYTES => "SHORT_BINBYTES",
        SHORT_BINUNICODE => "SHORT_BINUNICODE",
        BINUNICODE8 => "BINUNICODE8",
        BINBYTES8 => "BINBYTES8",
        EMPTY_SET => "EMPTY_SET",
        ADDITEMS => "ADDITEMS",
        FROZENSET => "FROZENSET",
        NEWOBJ_EX => "NEWOBJ_EX",
        STACK_GLOBAL => "STACK_GLOBAL",
        MEMOIZE => "MEMOIZE",
        FRAME => "FRAME",
        BYTEARRAY8 => "BYTEARRAY8",
        0x97 => "NEXT_BUFFER",
        0x98 => "READONLY_BUFFER",
        _ => "unknown",
    }
}

/// Where the machine is: the opcode and its offset, for errors.
#[derive(Clone, Copy)]
pub(super) struct OpAt {
    pub(super) code: u8,
    pub(super) offset: u64,
}

impl OpAt {
    pub(super) fn invalid(self, detail: &str) -> PickleError {
        PickleError::Invalid { opcode: opcode_name(self.code), offset: self.offset, detail: detail.to_owned() }
    }

    pub(super) fn underflow(self) -> PickleError {
        PickleError::StackUnderflow { opcode: opcode_name(self.code), offset: self.offset }
    }
}
