//! Tests of the writer and the reader together: what one writes the other reads.

use super::write::long_bytes;
use super::*;

fn hex(s: &str) -> Vec<u8> {
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap()).collect()
}

fn s(v: &str) -> Value {
    Value::Str(v.into())
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
    assert_eq!(loads(&dumps(&v).unwrap()).unwrap(), v);
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
    assert_eq!(loads(b"I1\np0\n0g0\n.").unwrap(), Value::Int(1));
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
        (b"\x95\x01\x00\x00\x00\x00\x00\x00\x00K\x01.", "opcode crossing its frame"),
        (b"\x95\x02\x00\x00\x00\x00\x00\x00\x00N\x95\x01\x00\x00\x00\x00\x00\x00\x00..", "frame inside a frame"),
        (b"N.N", "trailing data"),
        (b"NN.", "values left on the stack"),
        (b"Nq\x05.", "memo key out of sequence"),
        (b"U\x01\xe9.", "non-ASCII Python 2 string"),
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
    assert!(matches!(err, PickleError::Limit { what: "values", .. }), "{err}");
}

#[test]
fn cycles_are_refused_and_deep_nesting_hits_the_depth_limit() {
    // l = []; l.append(l): the list is mutated after a reference to it was taken.
    let err = loads(b"]\x94h\x00a.").unwrap_err();
    assert!(matches!(err, PickleError::Invalid { opcode: "APPEND", .. }), "{err}");
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
    assert!(matches!(err, PickleError::Limit { what: "nesting depth" | "values", .. }));
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
    let mut b = vec![b'(', b'X'];
    b.extend_from_slice(&1000u32.to_le_bytes());
    b.extend(std::iter::repeat_n(b'a', 1000));
    b.push(0x94);
    b.extend(std::iter::repeat_n([b'h', 0], 100).flatten());
    b.extend_from_slice(b"l.");
    let limits = Limits { max_bytes: 50_000, ..Limits::default() };
    let err = loads_with_limits(&b, &limits).unwrap_err();
    assert!(matches!(err, PickleError::Limit { what: "string bytes", .. }));
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
