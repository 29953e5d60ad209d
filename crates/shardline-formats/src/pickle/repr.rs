//! A short, Python-like rendering of an unpickled value, for reports (`inspect` of a training
//! checkpoint's bytes items). Objects show their class and attributes
//! (`argparse.Namespace(lr=0.0003, …)`); long renderings are cut with `…`.

use std::fmt::Write;

use super::Value;

impl Value {
    /// At most `max` characters of a Python-like rendering of this value.
    pub fn repr(&self, max: usize) -> String {
        let mut out = String::new();
        render(self, &mut out, max);
        if out.chars().count() > max {
            out = out.chars().take(max.saturating_sub(1)).collect();
            out.push('…');
        }
        out
    }
}

fn seq(items: &[Value], open: &str, close: &str, out: &mut String, max: usize) {
    out.push_str(open);
    for (i, v) in items.iter().enumerate() {
        if out.len() > max {
            break;
        }
        if i > 0 {
            out.push_str(", ");
        }
        render(v, out, max);
    }
    out.push_str(close);
}

fn render(v: &Value, out: &mut String, max: usize) {
    if out.len() > max {
        return;
    }
    match v {
        Value::None => out.push_str("None"),
        Value::Bool(b) => out.push_str(if *b { "True" } else { "False" }),
        Value::Int(i) => {
            let _ = write!(out, "{i}");
        }
        Value::Float(f) => {
            let _ = write!(out, "{f:?}");
        }
        Value::Str(s) => {
            let _ = write!(out, "{s:?}");
        }
        Value::Bytes(b) => {
            let _ = write!(out, "<{} bytes>", b.len());
        }
        Value::Tuple(items) => seq(items, "(", if items.len() == 1 { ",)" } else { ")" }, out, max),
        Value::List(items) => seq(items, "[", "]", out, max),
        Value::Set(items) | Value::FrozenSet(items) => seq(items, "{", "}", out, max),
        Value::Dict(pairs) => {
            out.push('{');
            for (i, (k, v)) in pairs.iter().enumerate() {
                if out.len() > max {
                    break;
                }
                if i > 0 {
                    out.push_str(", ");
                }
                render(k, out, max);
                out.push_str(": ");
                render(v, out, max);
            }
            out.push('}');
        }
        Value::Global { module, name } => {
            let _ = write!(out, "{module}.{name}");
        }
        Value::Reduce { callable: class, args, state, .. } | Value::Object { class, args, state, .. } => {
            render(class, out, max);
            match state.as_deref() {
                // An instance with attributes: `Class(name=value, …)`.
                Some(Value::Dict(pairs)) => {
                    out.push('(');
                    for (i, (k, v)) in pairs.iter().enumerate() {
                        if out.len() > max {
                            break;
                        }
                        if i > 0 {
                            out.push_str(", ");
                        }
                        match k.as_str() {
                            Some(name) => out.push_str(name),
                            None => render(k, out, max),
                        }
                        out.push('=');
                        render(v, out, max);
                    }
                    out.push(')');
                }
                _ => match args.as_ref() {
                    Value::Tuple(items) => seq(items, "(", ")", out, max),
                    other => {
                        out.push('(');
                        render(other, out, max);
                        out.push(')');
                    }
                },
            }
        }
        Value::PersistentId(_) => out.push_str("<persistent id>"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_like_python_and_cuts_long_values() {
        let ns = Value::Object {
            class: Box::new(Value::Global { module: "argparse".into(), name: "Namespace".into() }),
            args: Box::new(Value::Tuple(vec![])),
            kwargs: None,
            state: Some(Box::new(Value::Dict(vec![
                (Value::Str("lr".into()), Value::Float(0.0003)),
                (Value::Str("swiglu".into()), Value::Bool(true)),
                (Value::Str("betas".into()), Value::Tuple(vec![Value::Float(0.9), Value::Float(0.95)])),
            ]))),
            list_items: vec![],
            dict_items: vec![],
        };
        assert_eq!(ns.repr(200), "argparse.Namespace(lr=0.0003, swiglu=True, betas=(0.9, 0.95))");
        assert_eq!(ns.repr(12), "argparse.Na…");
        assert_eq!(Value::Tuple(vec![Value::Int(3)]).repr(10), "(3,)");
        assert_eq!(Value::Str("3.0".into()).repr(10), "\"3.0\"");
    }
}
