//! A read [`Value`] pickled again (protocol 2): what a checkpoint's common state holds, carried
//! item by item into another container. Raw bytes and sets are refused: they are not values a
//! checkpoint's state holds. Persistent ids (tensor storages) are written as ids; the archive
//! that holds the pickle must hold the storages they name.

use super::{PickleWriter, Value};

/// The protocol-2 pickle of `value`.
pub fn dumps(value: &Value) -> Result<Vec<u8>, String> {
    let mut w = PickleWriter::new();
    w.proto(2);
    write(&mut w, value)?;
    w.stop();
    Ok(w.into_bytes())
}

fn write_items(w: &mut PickleWriter, items: &[Value]) -> Result<(), String> {
    for v in items {
        write(w, v)?;
    }
    Ok(())
}

fn write_pairs(w: &mut PickleWriter, pairs: &[(Value, Value)]) -> Result<(), String> {
    for (k, v) in pairs {
        write(w, k)?;
        write(w, v)?;
    }
    Ok(())
}

/// What `BUILD`, `APPENDS` and `SETITEMS` applied to an object after it was made.
fn write_after(
    w: &mut PickleWriter,
    state: &Option<Box<Value>>,
    list_items: &[Value],
    dict_items: &[(Value, Value)],
) -> Result<(), String> {
    if !list_items.is_empty() {
        w.mark();
        write_items(w, list_items)?;
        w.appends();
    }
    if !dict_items.is_empty() {
        w.mark();
        write_pairs(w, dict_items)?;
        w.setitems();
    }
    if let Some(state) = state {
        write(w, state)?;
        w.build();
    }
    Ok(())
}

fn write(w: &mut PickleWriter, value: &Value) -> Result<(), String> {
    match value {
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
        Value::Str(s) => {
            w.str(s);
        }
        Value::Tuple(items) => {
            w.mark();
            write_items(w, items)?;
            w.tuple();
        }
        Value::List(items) => {
            w.empty_list();
            if !items.is_empty() {
                w.mark();
                write_items(w, items)?;
                w.appends();
            }
        }
        Value::Dict(pairs) => {
            w.empty_dict();
            if !pairs.is_empty() {
                w.mark();
                write_pairs(w, pairs)?;
                w.setitems();
            }
        }
        Value::Global { module, name } => {
            w.global(module, name);
        }
        Value::Reduce { callable, args, state, list_items, dict_items } => {
            write(w, callable)?;
            write(w, args)?;
            w.reduce();
            write_after(w, state, list_items, dict_items)?;
        }
        Value::Object { class, args, kwargs: None, state, list_items, dict_items } => {
            write(w, class)?;
            write(w, args)?;
            w.newobj();
            write_after(w, state, list_items, dict_items)?;
        }
        // A tensor's storage (`torch.save`'s `('storage', type, key, location, numel)`): the
        // caller writes the storage entries the ids name.
        Value::PersistentId(id) => {
            write(w, id)?;
            w.binpersid();
        }
        other => return Err(format!("{} cannot be carried (not a plain Python value)", kind(other))),
    }
    Ok(())
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Bytes(_) => "a bytes value",
        Value::Set(_) | Value::FrozenSet(_) => "a set",
        Value::Object { .. } => "an object made with keyword arguments",
        _ => "this value",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pickle::loads;

    #[test]
    fn values_survive_a_round_trip() {
        let ns = Value::Object {
            class: Box::new(Value::Global { module: "argparse".into(), name: "Namespace".into() }),
            args: Box::new(Value::Tuple(vec![])),
            kwargs: None,
            state: Some(Box::new(Value::Dict(vec![
                (Value::Str("tensor_model_parallel_size".into()), Value::Int(2)),
                (Value::Str("lr".into()), Value::Float(3e-4)),
                (Value::Str("dtype".into()), Value::Global { module: "torch".into(), name: "bfloat16".into() }),
                (Value::Str("layers".into()), Value::List(vec![Value::Int(1), Value::None, Value::Bool(true)])),
            ]))),
            list_items: vec![],
            dict_items: vec![],
        };
        let v = Value::Dict(vec![(Value::Str("args".into()), ns), (Value::Str("v".into()), Value::Float(3.0))]);
        assert_eq!(loads(&dumps(&v).unwrap()).unwrap(), v);
        assert!(dumps(&Value::Bytes(vec![1])).unwrap_err().contains("bytes"));
    }
}
